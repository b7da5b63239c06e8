//! The reference model: the inbox's observable rules written out once, plainly, sharing no code
//! with the library's decisions. Per message id: what it was recorded as, with its aggregate,
//! sequence and value (identity is global and never changes meaning). Per aggregate: the last
//! applied sequence, what applied in order, the open dead letters and the held messages.
//!
//! The rules, in the order they are asked:
//! 1. A known id with the same aggregate, sequence and value: an applied one is a replay, a
//!    dead letter is quarantined again, a held one is held again. With other content: a payload
//!    conflict.
//! 2. A new id behind the position is stale. Ahead of it: a gap on the general door; on the
//!    broker door it is held (a producer's under the epoch it was sent under), unless another id
//!    is held at that sequence (stale: the first held wins).
//! 3. At the expected sequence: a negative value is quarantined (a new open dead letter, the
//!    position stays); any other applies, supersedes the open dead letters there, and then the
//!    held messages that are next apply (or the first poison among them is quarantined). Every
//!    such drain first forgets the held messages that may no longer write the aggregate: a
//!    producer's whose epoch is no longer its producer's current one or whose producer no longer
//!    owns the aggregate, an anonymous one on an owned aggregate, one behind the position.
//! 4. An operator resolves an open dead letter at the expected sequence only, and only when
//!    `expectedLast` is the position: a skip takes the sequence with no effect, a replacement
//!    applies a new id there; either supersedes the others there and drains the held ones.
//! 5. An operator skips a gap from the expected sequence through a later one only when
//!    `expectedLast` is the position, no dead letter is open at the first and nothing is held
//!    inside the range; the position moves to its end and the held successors drain. The same
//!    request again answers as the same resolution and changes nothing.
//! 6. Producers: a delivery under a producer's name is admitted before it is decided (nothing
//!    written otherwise): the producer must have a session, its epoch must be the current one
//!    (an older one is fenced), and the aggregate must be its own, or have no owner, when the
//!    delivery claims it if the delivery is recorded. An anonymous delivery to an owned
//!    aggregate is refused. Each producer's message ids are a namespace of their own.
//! 7. The handler: a negative value is poison by its check, a value of 3 is poison found by
//!    `apply` (after it wrote its row, which must leave no trace), a value of 4 makes `apply`
//!    fail: the delivery records nothing.
//! 8. Bounds (only a model made [`Model::bounded`]; the histories' model has none): a new poison
//!    at the expected sequence of an aggregate with as many open dead letters as the bound is
//!    refused (full), and so is a new early message on the broker door of an aggregate holding
//!    as many as the bound, after the check that its sequence is not held already. A drain never
//!    meets a full quarantine: the apply that starts it supersedes every open dead letter.
//! 9. Transfers: an operator gives an aggregate to a producer, naming the owner it believes the
//!    aggregate has (none: unowned) and its position. Refused, with the owner and the position
//!    as they are, when the producer is unknown or revoked, else when the owner is not the one
//!    named, else when the position is not the one named; otherwise the producer owns the
//!    aggregate under its current epoch (0 before its first session) and the transfer is
//!    recorded. Nothing else moves: from then on the old owner is a producer that is not the
//!    owner (rule 6) and the new one is the owner. The same request again names an owner that
//!    no longer is, and is refused, unless it named the producer it gives the aggregate to.
//!    A transfer rejects every held message that may no longer write the aggregate under its new
//!    owner: all but the new owner's own, sent under its current epoch (they are forgotten, as
//!    if never delivered).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::history::{Delivery, DoorKind};

/// A verdict, as the model and the inbox both give it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    Applied(i64),
    Replay,
    Conflict,
    Gap(i64),
    Stale(i64),
    Quarantined(i64),
    Held {
        repeated: bool,
    },
    Full,
    /// The handler's `apply` failed: nothing was recorded.
    Failed,
    /// A producer's delivery refused before it was decided (the refusal's name).
    NotAdmitted(String),
    /// (a session) the epoch issued.
    Session(i64),
    /// (a resolution) resolved, or refused.
    Resolved,
    Refused,
    /// (a transfer) recorded: the owner before, the new owner's epoch, the held messages
    /// rejected with it.
    Transferred {
        from: Option<String>,
        epoch: i64,
        held_rejected: usize,
    },
    /// (a transfer) refused (the refusal's name), with the ownership as it is.
    TransferRefused {
        refusal: String,
        owner: Option<Owner>,
        last: i64,
    },
}

/// An aggregate's owner: the producer, and the epoch it owns the aggregate under (the claiming
/// delivery's, or the producer's current one when a transfer gave it the aggregate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub producer: String,
    pub epoch: i64,
}

/// A recorded transfer, as the aggregate's audit shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transferred {
    pub from: Option<String>,
    pub to: String,
    pub epoch: i64,
}

/// An operator's transfer, as the model chose it: the aggregate, the producer it goes to, and
/// the owner and position the operator believes it has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub aggregate_id: String,
    pub to: String,
    pub expected_owner: Option<String>,
    pub expected_last: i64,
}

/// What is stored of one aggregate, as the model and the inbox both show it: the position, the
/// held sequences, the open dead letters (ids, sorted), the applied messages in order (with
/// the handler's own row of each), the owner and the transfers recorded, oldest first. An id is
/// written `producer:id` (`:id` for an anonymous one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stored {
    pub last: i64,
    pub held: Vec<i64>,
    pub open: Vec<String>,
    pub applied: Vec<(i64, String)>,
    pub owner: Option<Owner>,
    pub transfers: Vec<Transferred>,
}

/// A message id in its producer's namespace, as [`Stored`] writes it.
pub fn named(producer: Option<&str>, message_id: &str) -> String {
    format!("{}:{message_id}", producer.unwrap_or_default())
}

/// Whether the handler finds `value` poison (by its check, or in `apply`).
pub fn is_poison(value: i64) -> bool {
    value < 0 || value == 3
}

/// Whether the handler's `apply` fails on `value`.
pub fn fails(value: i64) -> bool {
    value == 4
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Applied,
    DeadLetter,
    Held,
}

#[derive(Debug, Clone)]
struct Known {
    kind: Kind,
    aggregate: String,
    sequence: i64,
    value: i64,
}

/// An operator's gap skip, as the model chose it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GapSkip {
    pub aggregate_id: String,
    pub from: i64,
    pub through: i64,
    pub expected_last: i64,
}

#[derive(Debug, Clone, Default)]
struct Aggregate {
    /// The gap skips that resolved, for the identical repeat.
    skips: Vec<GapSkip>,
    last: i64,
    applied: Vec<(i64, String)>,
    /// Open dead letters: id and sequence.
    open: BTreeMap<String, i64>,
    /// Held messages by sequence: id, value, and the producer and epoch it was sent under
    /// (`None`: anonymous).
    held: BTreeMap<i64, (String, i64, Option<Owner>)>,
    owner: Option<Owner>,
    transfers: Vec<Transferred>,
    /// The last transfer that was recorded, for the identical repeat.
    last_transfer: Option<Transfer>,
}

/// The model's state. Cloned to keep the states a crash may leave.
#[derive(Debug, Clone, Default)]
pub struct Model {
    /// By named id ([`named`]).
    known: BTreeMap<String, Known>,
    aggregates: BTreeMap<String, Aggregate>,
    /// Each producer's current epoch (0: no session yet).
    epochs: BTreeMap<String, i64>,
    /// The registered producers, and whether each is active (false: revoked).
    registered: BTreeMap<String, bool>,
    /// Rule 8's bounds; `None`: unbounded.
    bounds: Option<Bounds>,
}

/// Rule 8: what one aggregate may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub open_dead_letters: usize,
    pub held: usize,
}

/// One anonymous aggregate's state, for a test that starts the model there instead of running
/// a history to it. Ids are named ([`named`]); every message is the handler's `{"v": value}`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seeded {
    pub aggregate_id: String,
    pub last: i64,
    /// Applied messages in the order they applied: sequence, id, value.
    pub applied: Vec<(i64, String, i64)>,
    /// Open dead letters (all at `last + 1`): id and value.
    pub open: Vec<(String, i64)>,
    /// Dead letters no longer open (superseded or resolved): sequence, id, value.
    pub closed: Vec<(i64, String, i64)>,
    /// Held messages: sequence, id, value.
    pub held: Vec<(i64, String, i64)>,
}

/// The operator's resolution of an aggregate's first open dead letter, as the model chose it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolution {
    pub aggregate_id: String,
    /// The dead letter's producer (`None`: anonymous) and id.
    pub producer: Option<String>,
    pub dead_letter_id: String,
    /// The replacement's id and value; `None`: a skip.
    pub replacement: Option<(String, i64)>,
    pub expected_last: i64,
}

impl Model {
    /// The model holding exactly `aggregates`, unbounded.
    pub fn seeded(aggregates: &[Seeded]) -> Model {
        let mut model = Model::default();
        for seeded in aggregates {
            model.seed(seeded);
        }
        model
    }

    /// The same model with rule 8's bounds.
    pub fn bounded(self, bounds: Bounds) -> Model {
        Model {
            bounds: Some(bounds),
            ..self
        }
    }

    fn seed(&mut self, seeded: &Seeded) {
        let id = &seeded.aggregate_id;
        let next = seeded.last + 1;
        for (sequence, message, value) in &seeded.applied {
            self.record(Kind::Applied, id, message, *sequence, *value);
        }
        for (message, value) in &seeded.open {
            self.record(Kind::DeadLetter, id, message, next, *value);
        }
        for (sequence, message, value) in &seeded.closed {
            self.record(Kind::DeadLetter, id, message, *sequence, *value);
        }
        for (sequence, message, value) in &seeded.held {
            self.record(Kind::Held, id, message, *sequence, *value);
        }
        let state = Aggregate {
            last: seeded.last,
            applied: (seeded.applied.iter())
                .map(|(sequence, message, _)| (*sequence, message.clone()))
                .collect(),
            open: (seeded.open.iter())
                .map(|(message, _)| (message.clone(), next))
                .collect(),
            held: (seeded.held.iter())
                .map(|(sequence, message, value)| (*sequence, (message.clone(), *value, None)))
                .collect(),
            ..Aggregate::default()
        };
        self.aggregates.insert(id.clone(), state);
    }

    /// Registers `producer` (`active` false: and revokes it).
    pub fn register(&mut self, producer: &str, active: bool) {
        self.registered.insert(producer.to_owned(), active);
    }

    /// A producer's new session: its next epoch.
    pub fn start_session(&mut self, producer: &str) -> i64 {
        let epoch = self.epochs.entry(producer.to_owned()).or_default();
        *epoch += 1;
        *epoch
    }

    /// The producer's current epoch (0: none yet).
    pub fn epoch(&self, producer: &str) -> i64 {
        self.epochs.get(producer).copied().unwrap_or_default()
    }

    pub fn deliver(&mut self, delivery: &Delivery) -> Verdict {
        let claims = match self.admit(delivery) {
            Ok(claims) => claims,
            Err(refusal) => return Verdict::NotAdmitted(refusal.to_owned()),
        };
        let verdict = self.decide(delivery);
        // A gap leaves the aggregate waiting, recorded; but a claim that records nothing writes
        // nothing at all.
        if verdict == Verdict::Gap(self.expected(&delivery.aggregate_id)) && !claims {
            self.aggregates
                .entry(delivery.aggregate_id.clone())
                .or_default();
        }
        let recorded = matches!(
            verdict,
            Verdict::Applied(_) | Verdict::Quarantined(_) | Verdict::Held { repeated: false }
        );
        if claims && recorded {
            let state = self
                .aggregates
                .entry(delivery.aggregate_id.clone())
                .or_default();
            state.owner = delivery.producer.clone().map(|producer| Owner {
                producer,
                epoch: delivery.epoch,
            });
        }
        verdict
    }

    /// Whether the delivery may be decided, and whether it claims the aggregate.
    fn admit(&self, delivery: &Delivery) -> Result<bool, &'static str> {
        let state = self.aggregates.get(&delivery.aggregate_id);
        let producer = delivery.producer.as_deref().map(|name| Producer {
            current_epoch: self.epoch(name),
            active: true,
        });
        let owner = state
            .and_then(|a| a.owner.as_ref())
            .map(|o| o.producer.as_str());
        admission(&Admitting {
            producer,
            epoch: delivery.epoch,
            owner,
            same_owner: owner == delivery.producer.as_deref(),
            history: state.is_some(),
        })
    }

    fn decide(&mut self, delivery: &Delivery) -> Verdict {
        let id = named(delivery.producer.as_deref(), &delivery.message_id);
        let expected = self.expected(&delivery.aggregate_id);
        if let Some(known) = self.known.get(&id) {
            let same = known.aggregate == delivery.aggregate_id
                && known.sequence == delivery.sequence
                && known.value == delivery.value;
            return match (same, known.kind) {
                (false, _) => Verdict::Conflict,
                (true, Kind::Applied) => Verdict::Replay,
                (true, Kind::DeadLetter) => Verdict::Quarantined(expected),
                (true, Kind::Held) => Verdict::Held { repeated: true },
            };
        }
        if delivery.sequence < expected {
            return Verdict::Stale(expected);
        }
        if delivery.sequence > expected {
            return match delivery.door {
                DoorKind::Broker => self.hold(delivery, &id, expected),
                _ => Verdict::Gap(expected),
            };
        }
        if is_poison(delivery.value) {
            if self.full(&delivery.aggregate_id, |bounds, a| {
                a.open.len() >= bounds.open_dead_letters
            }) {
                return Verdict::Full;
            }
            self.quarantine(
                &delivery.aggregate_id,
                &id,
                delivery.sequence,
                delivery.value,
            );
            return Verdict::Quarantined(expected);
        }
        if fails(delivery.value) {
            return Verdict::Failed;
        }
        self.apply(
            &delivery.aggregate_id,
            &id,
            delivery.sequence,
            delivery.value,
        );
        self.drain(&delivery.aggregate_id);
        Verdict::Applied(delivery.sequence)
    }

    /// The resolution an operator asks for: the aggregate's first open dead letter (or one that
    /// does not exist when none is open), with the position as `expectedLast` or, `stale`, not.
    pub fn resolution(
        &self,
        aggregate_id: &str,
        replacement: Option<(String, i64)>,
        stale: bool,
        missing_id: String,
    ) -> Resolution {
        let state = self.aggregates.get(aggregate_id);
        let last = state.map_or(0, |a| a.last);
        let target = state.and_then(|a| a.open.keys().next().cloned());
        let (producer, dead_letter_id) = match target.as_deref().and_then(|t| t.split_once(':')) {
            Some((producer, id)) => (
                (!producer.is_empty()).then(|| producer.to_owned()),
                id.to_owned(),
            ),
            None => (None, missing_id),
        };
        Resolution {
            aggregate_id: aggregate_id.to_owned(),
            producer,
            dead_letter_id,
            replacement,
            expected_last: if stale { last + 1 } else { last },
        }
    }

    /// Resolves as the inbox must: only an open dead letter at the expected sequence, only when
    /// `expectedLast` is the position, and a replacement only under a new id and with a value
    /// that is not poison.
    pub fn resolve(&mut self, resolution: &Resolution) -> Verdict {
        let Some(state) = self.aggregates.get(&resolution.aggregate_id) else {
            return Verdict::Refused;
        };
        let target = named(resolution.producer.as_deref(), &resolution.dead_letter_id);
        let Some(&sequence) = state.open.get(&target) else {
            return Verdict::Refused;
        };
        if resolution.expected_last != state.last || sequence != state.last + 1 {
            return Verdict::Refused;
        }
        let aggregate_id = resolution.aggregate_id.clone();
        match &resolution.replacement {
            Some((id, value)) => {
                let id = named(resolution.producer.as_deref(), id);
                if self.known.contains_key(&id) || is_poison(*value) || fails(*value) {
                    return Verdict::Refused;
                }
                self.apply(&aggregate_id, &id, sequence, *value);
            }
            None => self.take(&aggregate_id, sequence),
        }
        self.drain(&aggregate_id);
        Verdict::Resolved
    }

    /// The gap skip an operator asks for: from the expected sequence through `extra` more, with
    /// the position as `expectedLast` or (`stale`) not; `repeat`: the aggregate's last skip again.
    pub fn gap_skip(&self, aggregate_id: &str, extra: i64, stale: bool, repeat: bool) -> GapSkip {
        let state = self.aggregates.get(aggregate_id);
        if let Some(last_skip) = state.and_then(|a| a.skips.last()).filter(|_| repeat) {
            return last_skip.clone();
        }
        let last = state.map_or(0, |a| a.last);
        GapSkip {
            aggregate_id: aggregate_id.to_owned(),
            from: last + 1,
            through: last + 1 + extra,
            expected_last: if stale { last + 1 } else { last },
        }
    }

    pub fn skip_gap(&mut self, skip: &GapSkip) -> Verdict {
        let Some(state) = self.aggregates.get_mut(&skip.aggregate_id) else {
            return Verdict::Refused;
        };
        if state.skips.contains(skip) {
            return Verdict::Resolved;
        }
        let blocked = state.open.values().any(|at| *at == skip.from);
        let held_inside = state.held.range(skip.from..=skip.through).next().is_some();
        if skip.expected_last != state.last || skip.from != state.last + 1 || blocked || held_inside
        {
            return Verdict::Refused;
        }
        state.last = skip.through;
        state.skips.push(skip.clone());
        self.drain(&skip.aggregate_id);
        Verdict::Resolved
    }

    /// The transfer an operator asks for: the aggregate to `to`, naming its owner and position
    /// as they are, or (`stale_owner`) another owner, or (`stale_last`) another position;
    /// `repeat`: the aggregate's last recorded transfer sent again.
    pub fn transfer_request(
        &self,
        aggregate_id: &str,
        to: &str,
        stale_owner: bool,
        stale_last: bool,
        repeat: bool,
    ) -> Transfer {
        let state = self.aggregates.get(aggregate_id);
        if let Some(last_transfer) = state
            .and_then(|a| a.last_transfer.as_ref())
            .filter(|_| repeat)
        {
            return last_transfer.clone();
        }
        let owner = state
            .and_then(|a| a.owner.as_ref())
            .map(|o| o.producer.clone());
        let last = state.map_or(0, |a| a.last);
        Transfer {
            aggregate_id: aggregate_id.to_owned(),
            to: to.to_owned(),
            // The wrong owner: none for an owned aggregate, the receiving producer for an
            // unowned one.
            expected_owner: match (stale_owner, owner) {
                (false, owner) => owner,
                (true, Some(_)) => None,
                (true, None) => Some(to.to_owned()),
            },
            expected_last: if stale_last { last + 1 } else { last },
        }
    }

    /// Rule 9: transfers the aggregate as the inbox must, or refuses with how it is.
    pub fn transfer(&mut self, transfer: &Transfer) -> Verdict {
        let state = self.aggregates.get(&transfer.aggregate_id);
        let owner = state.and_then(|a| a.owner.clone());
        let last = state.map_or(0, |a| a.last);
        let refused = |refusal: &str| Verdict::TransferRefused {
            refusal: refusal.to_owned(),
            owner: owner.clone(),
            last,
        };
        if self.registered.get(&transfer.to) != Some(&true) {
            return refused("unknown producer");
        }
        if owner.as_ref().map(|o| o.producer.as_str()) != transfer.expected_owner.as_deref() {
            return refused("owner mismatch");
        }
        if transfer.expected_last != last {
            return refused("last mismatch");
        }
        let epoch = self.epoch(&transfer.to);
        let state = self
            .aggregates
            .entry(transfer.aggregate_id.clone())
            .or_default();
        state.owner = Some(Owner {
            producer: transfer.to.clone(),
            epoch,
        });
        state.transfers.push(Transferred {
            from: owner.as_ref().map(|o| o.producer.clone()),
            to: transfer.to.clone(),
            epoch,
        });
        state.last_transfer = Some(transfer.clone());
        let held_rejected = self.reject_held(&transfer.aggregate_id, false);
        Verdict::Transferred {
            from: owner.map(|o| o.producer),
            epoch,
            held_rejected: held_rejected.len(),
        }
    }

    /// Whether `producer` owned the aggregate before a transfer took it away.
    pub fn was_owner(&self, aggregate_id: &str, producer: &str) -> bool {
        self.aggregates
            .get(aggregate_id)
            .is_some_and(|a| (a.transfers.iter()).any(|t| t.from.as_deref() == Some(producer)))
    }

    /// What is stored of the aggregate.
    pub fn stored(&self, aggregate_id: &str) -> Stored {
        match self.aggregates.get(aggregate_id) {
            Some(a) => Stored {
                last: a.last,
                held: a.held.keys().copied().collect(),
                open: a.open.keys().cloned().collect(),
                applied: a.applied.clone(),
                owner: a.owner.clone(),
                transfers: a.transfers.clone(),
            },
            None => Stored::default(),
        }
    }

    fn expected(&self, aggregate_id: &str) -> i64 {
        self.aggregates.get(aggregate_id).map_or(0, |a| a.last) + 1
    }

    fn hold(&mut self, delivery: &Delivery, id: &str, expected: i64) -> Verdict {
        let state = self
            .aggregates
            .entry(delivery.aggregate_id.clone())
            .or_default();
        if state.held.contains_key(&delivery.sequence) {
            return Verdict::Stale(expected);
        }
        if self.full(&delivery.aggregate_id, |bounds, a| {
            a.held.len() >= bounds.held
        }) {
            return Verdict::Full;
        }
        let state = self
            .aggregates
            .entry(delivery.aggregate_id.clone())
            .or_default();
        let sender = delivery.producer.clone().map(|producer| Owner {
            producer,
            epoch: delivery.epoch,
        });
        state
            .held
            .insert(delivery.sequence, (id.to_owned(), delivery.value, sender));
        self.record(
            Kind::Held,
            &delivery.aggregate_id,
            id,
            delivery.sequence,
            delivery.value,
        );
        Verdict::Held { repeated: false }
    }

    /// Whether rule 8 refuses the aggregate one more: `at_bound` against the model's bounds.
    fn full(&self, aggregate_id: &str, at_bound: impl Fn(&Bounds, &Aggregate) -> bool) -> bool {
        let Some(bounds) = &self.bounds else {
            return false;
        };
        let empty = Aggregate::default();
        at_bound(bounds, self.aggregates.get(aggregate_id).unwrap_or(&empty))
    }

    fn record(&mut self, kind: Kind, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        self.known.insert(
            id.to_owned(),
            Known {
                kind,
                aggregate: aggregate_id.to_owned(),
                sequence,
                value,
            },
        );
    }

    fn quarantine(&mut self, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.open.insert(id.to_owned(), sequence);
        self.record(Kind::DeadLetter, aggregate_id, id, sequence, value);
    }

    /// Applies `id` at `sequence` (the expected one).
    fn apply(&mut self, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        self.take(aggregate_id, sequence);
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.applied.push((sequence, id.to_owned()));
        self.record(Kind::Applied, aggregate_id, id, sequence, value);
    }

    /// Moves the position to `sequence`; the open dead letters there are superseded.
    fn take(&mut self, aggregate_id: &str, sequence: i64) {
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.last = sequence;
        state.open.retain(|_, at| *at != sequence);
    }

    /// Forgets the aggregate's held messages that may no longer write it (rules 3 and 9): sent
    /// by someone other than its owner (anonymous: while it has one), or under an epoch that is
    /// no longer the producer's current one, and (`behind`: in a drain) those behind the
    /// position. Returns their ids.
    fn reject_held(&mut self, aggregate_id: &str, behind: bool) -> Vec<String> {
        let Some(state) = self.aggregates.get(aggregate_id) else {
            return Vec::new();
        };
        let owner = state.owner.as_ref().map(|o| o.producer.as_str());
        let rejected: Vec<(i64, String)> = (state.held.iter())
            .filter(|(sequence, (_, _, sender))| {
                let admitted = match sender {
                    None => owner.is_none(),
                    Some(sender) => {
                        owner == Some(sender.producer.as_str())
                            && sender.epoch == self.epoch(&sender.producer)
                    }
                };
                (behind && **sequence <= state.last) || !admitted
            })
            .map(|(sequence, (id, _, _))| (*sequence, id.clone()))
            .collect();
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        for (sequence, _) in &rejected {
            state.held.remove(sequence);
        }
        for (_, id) in &rejected {
            self.known.remove(id);
        }
        rejected.into_iter().map(|(_, id)| id).collect()
    }

    /// Applies the held messages that are next, in order; a poison among them is quarantined
    /// and stops the drain. First the held messages that may no longer apply are forgotten.
    fn drain(&mut self, aggregate_id: &str) {
        self.reject_held(aggregate_id, true);
        loop {
            let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
            let next = state.last + 1;
            let Some((id, value, _)) = state.held.remove(&next) else {
                return;
            };
            if is_poison(value) {
                self.quarantine(aggregate_id, &id, next, value);
                return;
            }
            self.apply(aggregate_id, &id, next, value);
        }
    }
}

/// A producer as admission sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Producer {
    pub current_epoch: i64,
    pub active: bool,
}

/// What admission looks at: the delivering producer (`None`: anonymous) and the epoch it offers,
/// the aggregate's owner (and whether it is that producer), and whether the aggregate has any
/// history.
#[derive(Debug, Clone, Copy)]
pub struct Admitting<'a> {
    pub producer: Option<Producer>,
    pub epoch: i64,
    pub owner: Option<&'a str>,
    pub same_owner: bool,
    pub history: bool,
}

/// Rule 6: whether a delivery may be decided (`Ok(true)`: and it claims the aggregate), or the
/// refusal's name. The producer's standing first, then its epoch, then the aggregate's owner.
pub fn admission(a: &Admitting<'_>) -> Result<bool, &'static str> {
    let Some(producer) = a.producer else {
        return if a.owner.is_some() {
            Err("owner required")
        } else {
            Ok(false)
        };
    };
    if !producer.active {
        return Err("unauthorized");
    }
    if producer.current_epoch < 1 {
        return Err("no session");
    }
    if a.epoch < 1 || a.epoch > producer.current_epoch {
        return Err("epoch not issued");
    }
    if a.epoch < producer.current_epoch {
        return Err("fenced");
    }
    match (a.owner, a.same_owner) {
        (Some(_), true) => Ok(false),
        (Some(_), false) => Err("not the owner"),
        (None, _) if a.history => Err("claim requires operator"),
        (None, _) => Ok(true),
    }
}
