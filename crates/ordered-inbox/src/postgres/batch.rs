//! One transaction for a group of deliveries (the group commit's attempt, see `writer`): the
//! locks of the whole group taken at once in one global order, the facts of the whole group read
//! in one statement, each delivery decided by the core in arrival order, the handler's applies of
//! the group in one call, the rows written set-based, one COMMIT.
//!
//! Locks: the transaction-scoped advisory locks a single operation takes (they exist before an
//! aggregate's row does, and resolutions and transfers take the same ones, so a group and a
//! single operation serialize on them), for every aggregate of the group in sorted order, then
//! every message identity in sorted order, then the aggregates' rows `FOR UPDATE` (so that a
//! writer from outside the library waits too). Every group and every single operation takes its
//! locks in that one order (aggregates, then identities, each sorted), so two groups over
//! overlapping aggregates wait for each other and never deadlock; only two ids whose 64-bit
//! hashes collide could, which PostgreSQL detects (40P01) and the writer retries.
//!
//! Running state: deliveries that share an aggregate or a message identity are decided in
//! rounds. A round holds at most one delivery of each aggregate and identity; its facts are
//! read in the transaction after the rows of the rounds before it were written (sent in the
//! same flight as the read), so each delivery is decided on exactly what the deliveries before
//! it left, as the database itself shows it. Deliveries to distinct aggregates, the usual case,
//! take one round: BEGIN, the locks and the facts in one flight, the applies in a second, the
//! rows and COMMIT in a third.
//!
//! Failures: a poison or an error from the handler's applies, or a statement PostgreSQL refuses
//! because of one delivery's values, abandons the attempt; the writer rolls it back and runs
//! [`replay`], where each delivery is decided and written alone inside a savepoint of its own
//! (its handler's `apply` in the savepoint the single operation takes), so a failing delivery
//! fails alone and the others commit once.

use std::collections::HashMap;

use futures_util::future::join_all;
use futures_util::join;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure};
use super::engine::{Run, Unit, decided};
use super::facts::{PRODUCER_FACTS, delivery_facts_from_row, message_key, ownership_facts};
use super::handler::{HandlerClient, PostgresHandler};
use super::rows::namespace;
use super::writes::{Param, Write, append, commit, execute_all, flush, param, write, writes_for};
use crate::change::Change;
use crate::content::{ApplyOutcome, Detail};
use crate::delivery::{Context, DeliveryPlan, Outcome, decide_delivery, decide_producer_delivery};
use crate::error::InboxError;
use crate::facts::{DeliveryFacts, OwnershipFacts};
use crate::handling::Report;
use crate::model::{AggregateRow, Door, Limits, OrderedMessage};
use crate::records::{ProducerClaim, ProducerRefusal};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};

/// The group's aggregates, sorted: their advisory locks in that order.
const LOCK_AGGREGATES: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended(id, 0)) FROM unnest($1::text[]) AS id";
/// The group's message identities, sorted, after the aggregates.
const LOCK_IDENTITIES: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended(id, 1)) FROM unnest($1::text[]) AS id";
const LOCK_ROWS: &str = "SELECT 1 FROM aggregate_state WHERE aggregate_id = ANY($1::text[])
  ORDER BY aggregate_id FOR UPDATE";
/// The facts of every delivery of a round in one statement, one row per delivery in the order
/// given (`$1` aggregates, `$2` ids, `$3` namespaces); `delivery_facts_from_row` reads the
/// columns. Each lookup is a `LATERAL` subquery with `LIMIT 1`, which the planner never turns
/// into a join: the generic plan a connection keeps (planned while the tables may still be
/// empty) is then a key lookup per delivery, never a hash join over a whole table.
const GROUP_FACTS: &str = "
SELECT a.last_sequence, a.status, a.status_since,
       o.payload, o.sequence, o.applied_at, o.aggregate_id,
       d.payload, d.reason, d.status, d.observations, d.aggregate_id, d.sequence,
       opened.ids, opened.sequences, opened.producers,
       h.message_id, h.aggregate_id, h.sequence, h.payload, h.message_payload, h.held_at,
       h.producer, h.epoch, h.current_epoch, h.active,
       held.ids, held.sequences, held.payloads, held.message_payloads, held.held_at,
       held.producers, held.epochs, held.current_epochs, held.actives,
       a.owner, a.owner_epoch
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY
       AS u(aggregate_id, message_id, space, position)
  LEFT JOIN LATERAL (
    SELECT * FROM aggregate_state WHERE aggregate_id = u.aggregate_id LIMIT 1) a ON true
  LEFT JOIN LATERAL (
    SELECT * FROM ordered_inbox WHERE producer = u.space AND message_id = u.message_id LIMIT 1
  ) o ON true
  LEFT JOIN LATERAL (
    SELECT * FROM deadletters WHERE producer = u.space AND message_id = u.message_id LIMIT 1
  ) d ON true
  LEFT JOIN LATERAL (
    SELECT m.*, p.current_epoch, p.active FROM held_messages AS m LEFT JOIN LATERAL (
        SELECT current_epoch, revoked_at IS NULL AS active FROM producers
         WHERE name = m.producer AND m.producer <> '' FOR SHARE) p ON true
     WHERE m.producer = u.space AND m.message_id = u.message_id LIMIT 1) h ON true
  CROSS JOIN LATERAL (
    SELECT array_agg(message_id ORDER BY id) AS ids, array_agg(sequence ORDER BY id) AS sequences,
           array_agg(NULLIF(producer, '') ORDER BY id) AS producers
      FROM deadletters WHERE aggregate_id = u.aggregate_id AND status = 'open') opened
  CROSS JOIN LATERAL (
    SELECT array_agg(message_id ORDER BY sequence) AS ids,
           array_agg(sequence ORDER BY sequence) AS sequences,
           array_agg(payload ORDER BY sequence) AS payloads,
           array_agg(message_payload ORDER BY sequence) AS message_payloads,
           array_agg(held_at ORDER BY sequence) AS held_at,
           array_agg(producer ORDER BY sequence) AS producers,
           array_agg(epoch ORDER BY sequence) AS epochs,
           array_agg(current_epoch ORDER BY sequence) AS current_epochs,
           array_agg(active ORDER BY sequence) AS actives
      FROM (SELECT m.*, p.current_epoch, p.active FROM held_messages AS m LEFT JOIN LATERAL (
                SELECT current_epoch, revoked_at IS NULL AS active FROM producers
                 WHERE name = m.producer AND m.producer <> '' FOR SHARE) p ON true
             WHERE m.aggregate_id = u.aggregate_id) AS m) held
 ORDER BY u.position";
/// The applied messages of a round, one statement.
const INSERT_APPLIED_ROWS: &str = "
INSERT INTO ordered_inbox(message_id, payload, aggregate_id, sequence, applied_at, producer)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[])";
/// A run of timeline events (not observations, which are numbered one by one), in order: the
/// identity column numbers them as they come.
const APPEND_EVENTS: &str = "
INSERT INTO aggregate_timeline(aggregate_id, at, kind, sequence, message_id, detail)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[])";
/// Each aggregate's row as the round's last delivery to it left it (one row per aggregate: an
/// upsert may not touch a row twice).
const PUT_AGGREGATES: &str = "
INSERT INTO aggregate_state(aggregate_id, last_sequence, total, status, status_since)
SELECT id, last, 0, status, since
  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[]) AS u(id, last, status, since)
ON CONFLICT (aggregate_id) DO UPDATE SET
    last_sequence = excluded.last_sequence,
    status = excluded.status,
    status_since = excluded.status_since";

/// One delivery of a group.
#[derive(Debug, Clone)]
pub(super) struct Delivery {
    pub message: OrderedMessage,
    pub door: Door,
    pub claim: Option<ProducerClaim>,
    /// False for [`crate::Inbox::deliver`], which checks no ownership.
    pub admitted_by_owner: bool,
}

impl Delivery {
    fn key(&self) -> String {
        message_key(self.producer(), &self.message.message_id)
    }

    fn producer(&self) -> Option<&str> {
        self.claim.as_ref().map(|claim| claim.producer.as_str())
    }

    /// The core's decision on `facts`: a plan, or a producer refusal (which writes nothing).
    fn decide(
        &self,
        facts: &DeliveryFacts,
        ownership: &OwnershipFacts,
        context: Context<'_>,
    ) -> Result<DeliveryPlan, ProducerRefusal> {
        if self.admitted_by_owner {
            let claim = self.claim.as_ref();
            decide_producer_delivery(&self.message, self.door, claim, ownership, facts, context)
        } else {
            Ok(decide_delivery(&self.message, self.door, facts, context))
        }
    }
}

/// A delivery's answer: its verdict or producer refusal, or what failed it.
pub(super) type Answer = Result<Result<Outcome, ProducerRefusal>, InboxError>;

/// What a group's transaction works with.
#[derive(Clone, Copy)]
pub(super) struct Means<'a> {
    pub client: &'a Client,
    pub counters: &'a Counters,
    pub handler: &'a dyn PostgresHandler,
    pub limits: &'a Limits,
}

/// The group's attempt in one transaction: every delivery's answer after the COMMIT, or `None`
/// when the attempt was abandoned for the replay (the transaction still to be rolled back).
pub(super) async fn attempt(
    means: Means<'_>,
    deliveries: &[Delivery],
) -> Result<Option<Vec<Answer>>, Failure> {
    let rounds = rounds_of(deliveries);
    let mut answers: Vec<Option<Answer>> = deliveries.iter().map(|_| None).collect();
    let mut pending = Vec::new();
    let round_count = rounds.iter().max().map_or(0, |last| last + 1);
    for round in 0..round_count {
        let members: Vec<&Delivery> = deliveries
            .iter()
            .zip(&rounds)
            .filter(|(_, of)| **of == round)
            .map(|(delivery, _)| delivery)
            .collect();
        let facts = if round == 0 {
            begin_and_read(means, deliveries).await?
        } else {
            let written = std::mem::take(&mut pending);
            let (flushed, facts) = join!(
                execute_all(means.client, &written),
                read_facts(means, &members)
            );
            means.counters.trip();
            for result in flushed {
                result?;
            }
            facts?
        };
        let positions = (0..deliveries.len()).filter(|index| rounds[*index] == round);
        let decided = decide_round(means, &members, &facts, positions, &mut answers);
        let Some(details) = apply_round(means, &decided).await? else {
            return Ok(None);
        };
        pending.extend(write_round(means, decided, details, &mut answers).await?);
    }
    commit(means.client, means.counters, pending).await?;
    Ok(Some(
        answers
            .into_iter()
            .map(|answer| {
                answer
                    .unwrap_or_else(|| Err(InboxError::Failed("a delivery went undecided".into())))
            })
            .collect(),
    ))
}

/// Each delivery's round: one after the latest round of an earlier delivery to its aggregate
/// or with its identity.
fn rounds_of(deliveries: &[Delivery]) -> Vec<usize> {
    let mut by_aggregate: HashMap<&str, usize> = HashMap::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    deliveries
        .iter()
        .map(|delivery| {
            let key = delivery.key();
            let aggregate = delivery.message.aggregate_id.as_str();
            let after = |seen: Option<&usize>| seen.map_or(0, |round| round + 1);
            let round = after(by_aggregate.get(aggregate)).max(after(by_key.get(&key)));
            by_aggregate.insert(aggregate, round);
            by_key.insert(key, round);
            round
        })
        .collect()
}

/// A decided delivery: its position in the group, its plan and the report its writes fill in.
struct Decided {
    position: usize,
    plan: DeliveryPlan,
}

/// Decides the round's deliveries in arrival order; a refusal is answered at once (it writes
/// nothing).
fn decide_round(
    means: Means<'_>,
    members: &[&Delivery],
    facts: &[(DeliveryFacts, OwnershipFacts)],
    positions: impl Iterator<Item = usize>,
    answers: &mut [Option<Answer>],
) -> Vec<Decided> {
    let mut decided = Vec::with_capacity(members.len());
    for ((delivery, (facts, ownership)), position) in members.iter().zip(facts).zip(positions) {
        let now = crate::clock::now();
        let context = Context {
            limits: means.limits,
            check: means.handler,
            now: &now,
        };
        match delivery.decide(facts, ownership, context) {
            Ok(plan) => decided.push(Decided { position, plan }),
            Err(refusal) => answers[position] = Some(Ok(Err(refusal))),
        }
    }
    decided
}

/// The handler's applies of every message the round's plans apply, in order, in one call: their
/// details, or `None` when one was not applied (a poison or an error: the replay decides).
async fn apply_round(
    means: Means<'_>,
    decided: &[Decided],
) -> Result<Option<Vec<Detail>>, Failure> {
    let messages: Vec<&OrderedMessage> = decided
        .iter()
        .flat_map(|decided| decided.plan.changes.iter())
        .filter_map(Change::applied_message)
        .collect();
    if messages.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let client: &HandlerClient = means.client;
    let outcomes = means.handler.apply_many(client, &messages).await;
    means.counters.trip();
    let Ok(outcomes) = outcomes else {
        return Ok(None);
    };
    if outcomes.len() != messages.len() {
        return Ok(None);
    }
    Ok(outcomes
        .into_iter()
        .map(|outcome| match outcome {
            ApplyOutcome::Applied { detail } => Some(detail),
            ApplyOutcome::Poison(_) => None,
        })
        .collect())
}

/// The round's rows, each decided plan's verdict answered (it stands once COMMIT succeeds).
async fn write_round(
    means: Means<'_>,
    decided: Vec<Decided>,
    details: Vec<Detail>,
    answers: &mut [Option<Answer>],
) -> Result<Vec<Write>, Failure> {
    let mut details = details.into_iter();
    let mut rows = GroupRows::default();
    for Decided { position, plan } in decided {
        let mut report = Report::default();
        for change in &plan.changes {
            let detail = match change.applied_message() {
                Some(message) => {
                    let detail = details.next().unwrap_or_default();
                    report.details.push((message.sequence, detail.clone()));
                    detail
                }
                None => Detail::new(),
            };
            rows.add(means, change, detail).await?;
        }
        answers[position] = Some(Ok(Ok(report.outcome(plan.outcome))));
    }
    rows.into_writes(means.client).await
}

/// BEGIN, every lock of the group, and the facts of its first round, in one flight.
async fn begin_and_read(
    means: Means<'_>,
    deliveries: &[Delivery],
) -> Result<Vec<(DeliveryFacts, OwnershipFacts)>, Failure> {
    let client = means.client;
    let (aggregates, keys) = lock_order(deliveries);
    let lock_aggregates = client.prepare_cached(LOCK_AGGREGATES).await?;
    let lock_identities = client.prepare_cached(LOCK_IDENTITIES).await?;
    let lock_rows = client.prepare_cached(LOCK_ROWS).await?;
    let first_round: Vec<&Delivery> = deliveries
        .iter()
        .zip(rounds_of(deliveries))
        .filter(|(_, round)| *round == 0)
        .map(|(delivery, _)| delivery)
        .collect();
    let by_aggregates: [&(dyn ToSql + Sync); 1] = [&aggregates];
    let by_keys: [&(dyn ToSql + Sync); 1] = [&keys];
    let (begin, aggregates_locked, identities_locked, rows_locked, facts) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock_aggregates, &by_aggregates),
        client.execute(&lock_identities, &by_keys),
        client.execute(&lock_rows, &by_aggregates),
        read_facts(means, &first_round),
    );
    means.counters.trip();
    begin?;
    aggregates_locked?;
    identities_locked?;
    rows_locked?;
    facts
}

/// The group's aggregates and message identities, each sorted and without repeats: the order
/// its locks are taken in.
fn lock_order(deliveries: &[Delivery]) -> (Vec<String>, Vec<String>) {
    let mut aggregates: Vec<String> = deliveries
        .iter()
        .map(|delivery| delivery.message.aggregate_id.clone())
        .collect();
    let mut keys: Vec<String> = deliveries.iter().map(Delivery::key).collect();
    for ids in [&mut aggregates, &mut keys] {
        ids.sort_unstable();
        ids.dedup();
    }
    (aggregates, keys)
}

/// The facts of `members` (one statement) and, for those a producer made, the producer's (one
/// statement each), sent in the caller's flight (which counts the round trip).
async fn read_facts(
    means: Means<'_>,
    members: &[&Delivery],
) -> Result<Vec<(DeliveryFacts, OwnershipFacts)>, Failure> {
    let client = means.client;
    let read = client.prepare_cached(GROUP_FACTS).await?;
    let producer_read = client.prepare_cached(PRODUCER_FACTS).await?;
    let aggregates: Vec<&str> = members
        .iter()
        .map(|delivery| delivery.message.aggregate_id.as_str())
        .collect();
    let ids: Vec<&str> = members
        .iter()
        .map(|delivery| delivery.message.message_id.as_str())
        .collect();
    let spaces: Vec<&str> = members
        .iter()
        .map(|delivery| namespace(delivery.producer()))
        .collect();
    let by_identity: [&(dyn ToSql + Sync); 3] = [&aggregates, &ids, &spaces];
    let claimed: Vec<[&(dyn ToSql + Sync); 2]> = members
        .iter()
        .zip(&aggregates)
        .zip(&spaces)
        .filter(|((delivery, _), _)| delivery.claim.is_some())
        .map(|((_, aggregate), space)| [aggregate as &(dyn ToSql + Sync), space])
        .collect();
    let (rows, producers) = join!(
        client.query(&read, &by_identity),
        join_all(
            claimed
                .iter()
                .map(|params| client.query_one(&producer_read, params))
        ),
    );
    let rows = rows?;
    let mut producers = producers.into_iter();
    if rows.len() != members.len() {
        return Err(Failure::Data(format!(
            "{} rows of facts for {} deliveries",
            rows.len(),
            members.len()
        )));
    }
    let mut facts = Vec::with_capacity(members.len());
    for (delivery, row) in members.iter().zip(&rows) {
        let mut read = delivery_facts_from_row(row, &delivery.message.aggregate_id)?;
        // Only a sequence already passed asks which gap skip took it (a round trip of its own).
        read.skipped_by =
            super::gaps::skipped_by(client, means.counters, &delivery.message, &read).await?;
        let producer_row: Option<Row> = match delivery.claim {
            Some(_) => producers.next().transpose()?,
            None => None,
        };
        let ownership = ownership_facts(producer_row.as_ref(), &read)?;
        facts.push((read, ownership));
    }
    Ok(facts)
}

/// The rows of a round, gathered by kind so that the common ones go out set-based: every
/// applied message in one statement, each run of timeline events in one, every aggregate's
/// final row in one; the rest one statement per change, in order. The kinds touch different
/// tables (an owner's columns and an aggregate's position are separate columns of one row), so
/// only the order within each kind matters, and each keeps it.
#[derive(Default)]
struct GroupRows {
    others: Vec<Write>,
    timeline: Vec<TimelineEntry>,
    applied: AppliedRows,
    aggregates: Vec<(String, AggregateRow)>,
    aggregate_index: HashMap<String, usize>,
}

#[derive(Default)]
struct AppliedRows {
    ids: Vec<String>,
    payloads: Vec<String>,
    aggregates: Vec<String>,
    sequences: Vec<i64>,
    applied_at: Vec<String>,
    spaces: Vec<String>,
}

impl GroupRows {
    async fn add(
        &mut self,
        means: Means<'_>,
        change: &Change,
        detail: Detail,
    ) -> Result<(), Failure> {
        match change {
            Change::PutAggregate { aggregate_id, row } => {
                match self.aggregate_index.get(aggregate_id) {
                    Some(index) => self.aggregates[*index].1 = row.clone(),
                    None => {
                        self.aggregate_index
                            .insert(aggregate_id.clone(), self.aggregates.len());
                        self.aggregates.push((aggregate_id.clone(), row.clone()));
                    }
                }
            }
            Change::InsertApplied {
                producer,
                message,
                payload,
                applied_at,
            } => {
                let rows = &mut self.applied;
                rows.ids.push(message.message_id.clone());
                rows.payloads.push(payload.clone());
                rows.aggregates.push(message.aggregate_id.clone());
                rows.sequences.push(message.sequence);
                rows.applied_at.push(applied_at.clone());
                rows.spaces.push(namespace(producer.as_deref()).to_owned());
                self.timeline.push(TimelineEntry {
                    aggregate_id: message.aggregate_id.clone(),
                    at: applied_at.clone(),
                    kind: TimelineKind::Applied,
                    sequence: Some(message.sequence),
                    message_id: Some(message.message_id.clone()),
                    detail: TimelineDetail::Applied(detail),
                });
            }
            Change::Append(entry) => self.timeline.push(entry.clone()),
            other => {
                writes_for(
                    means.client,
                    means.counters,
                    other,
                    &detail,
                    &mut self.others,
                )
                .await?;
            }
        }
        Ok(())
    }

    async fn into_writes(self, client: &Client) -> Result<Vec<Write>, Failure> {
        let mut writes = self.others;
        let mut events: Vec<TimelineEntry> = Vec::new();
        for entry in self.timeline {
            if entry.kind.is_observation() {
                if !events.is_empty() {
                    writes.push(append_events(client, std::mem::take(&mut events)).await?);
                }
                writes.push(append(client, &entry).await?);
            } else {
                events.push(entry);
            }
        }
        if !events.is_empty() {
            writes.push(append_events(client, events).await?);
        }
        if !self.applied.ids.is_empty() {
            let rows = self.applied;
            let params: Vec<Param> = vec![
                param(rows.ids),
                param(rows.payloads),
                param(rows.aggregates),
                param(rows.sequences),
                param(rows.applied_at),
                param(rows.spaces),
            ];
            writes.push(write(client, INSERT_APPLIED_ROWS, params).await?);
        }
        if !self.aggregates.is_empty() {
            writes.push(put_aggregates(client, self.aggregates).await?);
        }
        Ok(writes)
    }
}

async fn append_events(client: &Client, events: Vec<TimelineEntry>) -> Result<Write, Failure> {
    let mut aggregates = Vec::with_capacity(events.len());
    let mut at = Vec::with_capacity(events.len());
    let mut kinds = Vec::with_capacity(events.len());
    let mut sequences = Vec::with_capacity(events.len());
    let mut ids = Vec::with_capacity(events.len());
    let mut details = Vec::with_capacity(events.len());
    for entry in events {
        details.push(entry.detail.to_json());
        aggregates.push(entry.aggregate_id);
        at.push(entry.at);
        kinds.push(entry.kind.as_str().to_owned());
        sequences.push(entry.sequence);
        ids.push(entry.message_id);
    }
    let params: Vec<Param> = vec![
        param(aggregates),
        param(at),
        param(kinds),
        param(sequences),
        param(ids),
        param(details),
    ];
    write(client, APPEND_EVENTS, params).await
}

async fn put_aggregates(
    client: &Client,
    aggregates: Vec<(String, AggregateRow)>,
) -> Result<Write, Failure> {
    let mut ids = Vec::with_capacity(aggregates.len());
    let mut lasts = Vec::with_capacity(aggregates.len());
    let mut statuses = Vec::with_capacity(aggregates.len());
    let mut since = Vec::with_capacity(aggregates.len());
    for (id, row) in aggregates {
        ids.push(id);
        lasts.push(row.last);
        statuses.push(row.status.as_str().to_owned());
        since.push(row.since);
    }
    let params: Vec<Param> = vec![param(ids), param(lasts), param(statuses), param(since)];
    write(client, PUT_AGGREGATES, params).await
}

/// The group again, after its attempt was rolled back: the same locks, then each delivery alone
/// in a savepoint, written as a single operation writes it (its `apply` in a savepoint of its
/// own). A delivery whose handler fails, or that PostgreSQL refuses, is rolled back to its
/// savepoint and answered with its failure; the others commit together.
pub(super) async fn replay(
    means: Means<'_>,
    deliveries: &[Delivery],
) -> Result<Vec<Answer>, Failure> {
    let client = means.client;
    let (aggregates, keys) = lock_order(deliveries);
    let lock_aggregates = client.prepare_cached(LOCK_AGGREGATES).await?;
    let lock_identities = client.prepare_cached(LOCK_IDENTITIES).await?;
    let lock_rows = client.prepare_cached(LOCK_ROWS).await?;
    let by_aggregates: [&(dyn ToSql + Sync); 1] = [&aggregates];
    let by_keys: [&(dyn ToSql + Sync); 1] = [&keys];
    let (begin, aggregates_locked, identities_locked, rows_locked) = join!(
        client.batch_execute("BEGIN"),
        client.execute(&lock_aggregates, &by_aggregates),
        client.execute(&lock_identities, &by_keys),
        client.execute(&lock_rows, &by_aggregates),
    );
    means.counters.trip();
    begin?;
    aggregates_locked?;
    identities_locked?;
    rows_locked?;
    let mut answers = Vec::with_capacity(deliveries.len());
    for delivery in deliveries {
        let answer = match replay_one(means, delivery).await {
            Ok(answer) => answer,
            Err(failure) if failure.concerns_one_unit() => {
                client.batch_execute("ROLLBACK TO SAVEPOINT unit").await?;
                means.counters.trip();
                Err(failure.into_inbox_error())
            }
            Err(failure) => return Err(failure),
        };
        answers.push(answer);
    }
    commit(client, means.counters, Vec::new()).await?;
    Ok(answers)
}

/// One delivery of a replay, inside `SAVEPOINT unit`: its facts, the decision, its handler and
/// its rows. A handler error rolls back to the savepoint here; any other failure is the
/// caller's.
async fn replay_one(means: Means<'_>, delivery: &Delivery) -> Result<Answer, Failure> {
    let client = means.client;
    let alone = [delivery];
    let (savepoint, facts) = join!(
        client.batch_execute("SAVEPOINT unit"),
        read_facts(means, &alone),
    );
    means.counters.trip();
    savepoint?;
    let (facts, ownership) = facts?
        .pop()
        .ok_or_else(|| Failure::Data("no facts for a delivery".into()))?;
    let now = crate::clock::now();
    let unit = Unit {
        client,
        counters: means.counters,
        handler: means.handler,
        limits: means.limits,
        now: &now,
    };
    let run = decided(unit, None, |context| {
        delivery.decide(&facts, &ownership, context)
    })
    .await?;
    match run {
        Run::Written(plan, report, mut writes) => {
            let (flushed, released) = join!(
                flush(client, means.counters, &mut writes),
                client.batch_execute("RELEASE SAVEPOINT unit"),
            );
            flushed?;
            released?;
            Ok(Ok(Ok(report.outcome(plan.outcome))))
        }
        Run::Refused(refusal) => Ok(Ok(Err(refusal))),
        Run::Failed(error) => {
            client.batch_execute("ROLLBACK TO SAVEPOINT unit").await?;
            means.counters.trip();
            Ok(Err(InboxError::Handler(error)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn delivery(id: &str, aggregate: &str) -> Delivery {
        Delivery {
            message: OrderedMessage {
                message_id: id.into(),
                aggregate_id: aggregate.into(),
                sequence: 1,
                payload: json!({}),
            },
            door: Door::General,
            claim: None,
            admitted_by_owner: true,
        }
    }

    #[test]
    fn deliveries_sharing_an_aggregate_or_an_id_go_to_later_rounds_in_arrival_order() {
        let group = [
            delivery("m-1", "a"),
            delivery("m-2", "b"),
            delivery("m-3", "a"),
            delivery("m-2", "c"),
            delivery("m-4", "d"),
            delivery("m-5", "a"),
        ];
        assert_eq!(rounds_of(&group), [0, 0, 1, 1, 0, 2]);
    }

    #[test]
    fn a_group_locks_its_aggregates_and_identities_each_sorted_once() {
        let group = [
            delivery("m-2", "b"),
            delivery("m-1", "a"),
            delivery("m-2", "b"),
        ];
        assert_eq!(
            lock_order(&group),
            (
                vec!["a".to_owned(), "b".to_owned()],
                vec!["m-1".to_owned(), "m-2".to_owned()]
            )
        );
    }
}
