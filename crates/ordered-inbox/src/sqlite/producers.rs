//! Producers in SQLite: sessions (epochs), the ownership facts a delivery reads in its own unit,
//! operators' transfers, and the listings. The registry commands (`producer add|list|revoke`) are
//! the operators' ones ([`super::operators::add_to`] with [`Registry::Producers`]).

use rusqlite::{Connection, OptionalExtension, params};

use super::engine::{DeliveryRead, delivery_facts, held_for, owner_from, write_changes};
use super::store::StoreError;
use crate::delivery::{Outcome, decide_producer_delivery};
use crate::model::{Door, Limits, OrderedMessage};
use crate::operators::Registry;
use crate::producers::{
    AggregateOwner, OwnershipFacts, ProducerClaim, ProducerFact, ProducerRefusal, TransferFacts,
    TransferRecord, TransferRequest, decide_transfer, next_epoch,
};
use crate::views::{OwnershipState, ProducerView, TransferConflict};

/// Decides and records one delivery made by `claim`'s producer (`None`: anonymous), the ownership
/// facts read in the same unit as the write. A refusal writes nothing.
pub fn deliver_as_in(
    connection: &Connection,
    message: &OrderedMessage,
    door: Door,
    claim: Option<&ProducerClaim>,
    limits: &Limits,
    now: &str,
) -> Result<Result<Outcome, ProducerRefusal>, StoreError> {
    let producer = claim.map(|claim| claim.producer.as_str());
    let DeliveryRead { facts, owner } = delivery_facts(connection, producer, message)?;
    let ownership = ownership_facts(connection, &message.aggregate_id, claim, owner)?;
    match decide_producer_delivery(message, door, claim, &ownership, &facts, limits, now) {
        Ok(plan) => {
            write_changes(connection, &plan.changes)?;
            Ok(Ok(plan.outcome))
        }
        Err(refusal) => Ok(Err(refusal)),
    }
}

/// Starts a session: the producer's epoch goes one up, in this unit.
pub fn start_session_in(
    connection: &Connection,
    producer: &str,
) -> Result<Result<i64, ProducerRefusal>, StoreError> {
    let Some(fact) = producer_fact(connection, producer)? else {
        return Ok(Err(ProducerRefusal::Revoked));
    };
    let epoch = match next_epoch(fact) {
        Ok(epoch) => epoch,
        Err(refusal) => return Ok(Err(refusal)),
    };
    connection
        .prepare_cached("UPDATE producers SET current_epoch = ?2 WHERE name = ?1")?
        .execute(params![producer, epoch])?;
    Ok(Ok(epoch))
}

/// Checks an operator's transfer and records it: the owner columns, an audit row, a timeline
/// event, and the held messages it made inadmissible rejected. A refusal carries the aggregate's
/// ownership as it is now.
pub fn transfer_in(
    connection: &Connection,
    request: &TransferRequest,
    now: &str,
) -> Result<Result<TransferRecord, TransferConflict>, StoreError> {
    let state = ownership_state(connection, &request.aggregate_id)?;
    let facts = TransferFacts {
        operator_active: super::operators::is_active(connection, &request.operator)?,
        producer: producer_fact(connection, &request.producer)?,
        owner: state.owner.clone(),
        last: state.last,
        held: held_for(connection, &request.aggregate_id)?,
    };
    let plan = match decide_transfer(request, &facts, now) {
        Ok(plan) => plan,
        Err(refusal) => {
            return Ok(Err(TransferConflict {
                refusal,
                current: state,
            }));
        }
    };
    write_changes(connection, &plan.changes)?;
    Ok(Ok(plan.record))
}

/// The active producer a token belongs to.
pub fn holder(connection: &Connection, token: &str) -> rusqlite::Result<Option<String>> {
    super::operators::holder(connection, Registry::Producers, token)
}

fn producer_fact(connection: &Connection, name: &str) -> rusqlite::Result<Option<ProducerFact>> {
    connection
        .prepare_cached("SELECT current_epoch, revoked_at IS NULL FROM producers WHERE name = ?1")?
        .query_row([name], |row| {
            Ok(ProducerFact {
                current_epoch: row.get(0)?,
                active: row.get(1)?,
            })
        })
        .optional()
}

/// The ownership facts of a delivery to an aggregate whose owner the delivery's read found.
fn ownership_facts(
    connection: &Connection,
    aggregate_id: &str,
    claim: Option<&ProducerClaim>,
    owner: Option<AggregateOwner>,
) -> rusqlite::Result<OwnershipFacts> {
    let producer = match claim {
        Some(claim) => producer_fact(connection, &claim.producer)?,
        None => None,
    };
    // Only a claim asks whether the aggregate has history: anonymous deliveries and deliveries
    // to an owned aggregate skip the query.
    let history = claim.is_some() && owner.is_none() && has_history(connection, aggregate_id)?;
    Ok(OwnershipFacts {
        producer,
        owner,
        history,
    })
}

fn has_history(connection: &Connection, aggregate_id: &str) -> rusqlite::Result<bool> {
    connection
        .prepare_cached(
            "SELECT EXISTS(SELECT 1 FROM aggregate_state WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM aggregate_timeline WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM held_messages WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM ordered_inbox WHERE aggregate_id = ?1)
                 OR EXISTS(SELECT 1 FROM deadletters WHERE aggregate_id = ?1)",
        )?
        .query_row([aggregate_id], |row| row.get(0))
}

/// The aggregate's owner and last applied sequence (unowned and 0 without a row).
pub fn ownership_state(
    connection: &Connection,
    aggregate_id: &str,
) -> rusqlite::Result<OwnershipState> {
    let row = connection
        .prepare_cached(
            "SELECT owner, owner_epoch, last_sequence FROM aggregate_state WHERE aggregate_id = ?1",
        )?
        .query_row([aggregate_id], |row| {
            Ok((owner_from(row.get(0)?, row.get(1)?), row.get::<_, i64>(2)?))
        })
        .optional()?;
    Ok(match row {
        Some((owner, last)) => OwnershipState { owner, last },
        None => OwnershipState::default(),
    })
}

/// Every producer, the first registered first: never tokens.
pub fn producers(connection: &Connection) -> rusqlite::Result<Vec<ProducerView>> {
    connection
        .prepare_cached(
            "SELECT p.name, p.current_epoch, p.created_at, p.revoked_at, p.last_delivery_at,
                    (SELECT COUNT(*) FROM aggregate_state a WHERE a.owner = p.name)
               FROM producers p ORDER BY p.created_at, p.name",
        )?
        .query_map([], |row| {
            Ok(ProducerView {
                name: row.get(0)?,
                current_epoch: row.get(1)?,
                created_at: row.get(2)?,
                revoked_at: row.get(3)?,
                last_delivery_at: row.get(4)?,
                owned_aggregates: row.get(5)?,
            })
        })?
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqlite::operators::add_to;
    use crate::sqlite::{SqliteInbox, Synchronous};
    use crate::{BatchDelivery, Inbox, TransferRefusal};

    fn message(id: &str, aggregate: &str, sequence: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: aggregate.into(),
            sequence,
            amount: 1,
        }
    }

    fn claim(producer: &str, epoch: i64) -> Option<ProducerClaim> {
        Some(ProducerClaim {
            producer: producer.into(),
            epoch,
        })
    }

    #[tokio::test]
    async fn a_claim_a_fence_and_a_transfer_are_written_in_the_delivery_unit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let inbox = SqliteInbox::open(&path, Synchronous::Normal, Limits::default()).unwrap();
        let billing_token = add_to(Registry::Producers, &path, "billing").unwrap();
        add_to(Registry::Producers, &path, "shipping").unwrap();
        crate::sqlite::operators::add(&path, "alice").unwrap();
        assert_eq!(
            inbox
                .check_producer(billing_token)
                .await
                .unwrap()
                .as_deref(),
            Some("billing")
        );
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(1));
        assert_eq!(inbox.start_session("shipping".into()).await.unwrap(), Ok(1));

        let first = inbox
            .deliver_as(
                message("m-1", "acct", 1),
                Door::General,
                claim("billing", 1),
            )
            .await
            .unwrap();
        assert!(matches!(first, Ok(Outcome::Applied { sequence: 1, .. })));
        let state = inbox.ownership("acct".into()).await.unwrap();
        assert_eq!(
            state.owner,
            Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1
            })
        );
        assert_eq!(
            inbox
                .deliver_as(
                    message("m-1", "acct", 2),
                    Door::General,
                    claim("shipping", 1)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::NotOwner {
                owner: "billing".into()
            })
        );
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(2));
        assert_eq!(
            inbox
                .deliver_as(
                    message("m-2", "acct", 2),
                    Door::General,
                    claim("billing", 1)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::Fenced {
                offered: 1,
                current_epoch: 2
            })
        );
        assert_eq!(inbox.counts("acct".into()).await.unwrap().last, 1);

        let request = TransferRequest {
            aggregate_id: "acct".into(),
            operator: "alice".into(),
            producer: "shipping".into(),
            expected_owner: Some("billing".into()),
            expected_last: 0,
            reason: "billing retired".into(),
        };
        let stale = inbox.transfer_owner(request.clone()).await.unwrap();
        assert_eq!(
            stale.map_err(|conflict| (conflict.refusal, conflict.current.last)),
            Err((TransferRefusal::LastMismatch, 1))
        );
        let record = inbox
            .transfer_owner(TransferRequest {
                expected_last: 1,
                ..request
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.from_owner.as_deref(), Some("billing"));
        assert_eq!(
            inbox
                .deliver_as(
                    message("m-2", "acct", 2),
                    Door::General,
                    claim("billing", 2)
                )
                .await
                .unwrap(),
            Err(ProducerRefusal::NotOwner {
                owner: "shipping".into()
            })
        );
        let listed = inbox.producers().await.unwrap();
        let counts: Vec<(&str, i64, i64)> = listed
            .iter()
            .map(|p| (p.name.as_str(), p.current_epoch, p.owned_aggregates))
            .collect();
        assert_eq!(counts, [("billing", 2, 0), ("shipping", 1, 1)]);
        assert!(listed[0].last_delivery_at.is_some());
        inbox.shutdown().await;
    }

    #[tokio::test]
    async fn a_batch_checks_each_claim_in_its_unit_and_a_refusal_never_stops_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.db");
        let inbox = SqliteInbox::open(&path, Synchronous::Normal, Limits::default()).unwrap();
        add_to(Registry::Producers, &path, "billing").unwrap();
        add_to(Registry::Producers, &path, "shipping").unwrap();
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(1));
        assert_eq!(inbox.start_session("shipping".into()).await.unwrap(), Ok(1));
        let by = |message: OrderedMessage, who: Option<ProducerClaim>| BatchDelivery {
            message,
            door: Door::Broker,
            claim: who,
        };
        let before = inbox.store().stats();
        let verdicts = inbox
            .deliver_batch(vec![
                // billing claims `acct` with its first message; the rest of the batch sees it.
                by(message("m-1", "acct", 1), claim("billing", 1)),
                by(message("s-2", "acct", 2), claim("shipping", 1)),
                by(message("x-2", "acct", 2), None),
                by(message("m-2", "acct", 2), claim("billing", 1)),
                // the same id, another producer, another aggregate: another message.
                by(message("m-1", "ship", 1), claim("shipping", 1)),
                // a producer's message ahead of its turn is not held (a gap, nak'd by a broker).
                by(message("m-4", "acct", 4), claim("billing", 1)),
            ])
            .await
            .unwrap();
        let after = inbox.store().stats();
        assert_eq!(
            after.commits - before.commits,
            1,
            "one COMMIT for the batch"
        );
        assert!(matches!(
            verdicts[0],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert_eq!(
            verdicts[1],
            Err(ProducerRefusal::NotOwner {
                owner: "billing".into()
            })
        );
        assert_eq!(verdicts[2], Err(ProducerRefusal::OwnerRequired));
        assert!(matches!(
            verdicts[3],
            Ok(Outcome::Applied { sequence: 2, .. })
        ));
        assert!(matches!(
            verdicts[4],
            Ok(Outcome::Applied { sequence: 1, .. })
        ));
        assert_eq!(verdicts[5], Ok(Outcome::Gap { expected: 3 }));
        let acct = inbox.aggregate("acct".into()).await.unwrap().unwrap();
        assert_eq!((acct.summary.last, acct.held_count), (2, 0));

        // A new session fences the older epoch for every message of a later batch.
        assert_eq!(inbox.start_session("billing".into()).await.unwrap(), Ok(2));
        let verdicts = inbox
            .deliver_batch(vec![
                by(message("m-3", "acct", 3), claim("billing", 1)),
                by(message("m-3b", "acct", 3), claim("billing", 2)),
            ])
            .await
            .unwrap();
        assert_eq!(
            verdicts[0],
            Err(ProducerRefusal::Fenced {
                offered: 1,
                current_epoch: 2
            })
        );
        assert!(matches!(
            verdicts[1],
            Ok(Outcome::Applied { sequence: 3, .. })
        ));
        assert_eq!(inbox.counts("acct".into()).await.unwrap().last, 3);
        inbox.shutdown().await;
    }
}
