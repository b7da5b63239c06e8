//! The library's pure core against the reference model, with no database: proptest draws an
//! aggregate's state that the model can hold too (its position, applied messages, open and
//! closed dead letters, held messages, and sometimes bounds), then a few deliveries and
//! resolutions. Each one is decided by `decide_delivery` / `decide_resolution` on facts read from
//! a tiny in-memory store, whose changes the store then applies (playing the handler: a value of
//! 3 is poison found in `apply`, which makes the core decide again with it marked poison, and a
//! value of 4 fails the whole plan), and the verdict and both aggregates' stored state must be
//! the model's after every step. A failure is shrunk to a minimal state and steps.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use lab_testkit::simulate::history::{Delivery, DoorKind};
use lab_testkit::simulate::model::{Bounds, Model, Resolution, Seeded, Stored, Verdict, named};
use lab_testkit::simulate::system::{Effects, verdict_of};
use ordered_inbox::change::Change;
use ordered_inbox::content::canonical_json;
use ordered_inbox::delivery::{Context, decide_delivery};
use ordered_inbox::facts::{
    AppliedFact, DeadLetterFact, DeliveryFacts, HeldMessage, KnownDeadLetter, OpenDeadLetter,
    ResolutionFacts,
};
use ordered_inbox::model::{
    ActionKind, AggregateRow, AggregateStatus, DeadLetterStatus, Position, QuarantineReason,
};
use ordered_inbox::planted::{self, Bug};
use ordered_inbox::records::ResolutionRecord;
use ordered_inbox::resolution::{Action, Mode, ResolutionRequest, Resolved, decide_resolution};
use ordered_inbox::{Check, Door, Limits, OrderedMessage, Poison};
use proptest::prelude::*;
use proptest::test_runner::{
    Config, FailurePersistence, FileFailurePersistence, RngAlgorithm, TestCaseError, TestError,
    TestRng, TestRunner,
};
use serde_json::json;

/// The aggregate a state is drawn for.
const DRAWN: &str = "a";
/// An aggregate with no history, which a step may deliver to as well.
const FRESH: &str = "b";
/// Values an applied message may have (the handler applies them).
const APPLYING: [i64; 3] = [1, 2, 7];
/// Poison values: by the handler's check, or found by its `apply`.
const POISON: [i64; 2] = [-1, 3];
/// Every value a step may deliver; 4 makes `apply` fail.
const DELIVERED: [i64; 6] = [1, 2, 7, -1, 3, 4];
/// Ids no state holds, which the steps of one case share (so that later steps replay them).
const NEW_IDS: [&str; 3] = ["n0", "n1", "n2"];

/// Planting a bug is a switch of the whole process: every run of the core holds this.
static PLANTED: Mutex<()> = Mutex::new(());

fn planted_switch() -> MutexGuard<'static, ()> {
    PLANTED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The drawn aggregate's state, as the model holds it too.
#[derive(Debug, Clone)]
struct State {
    door: DoorKind,
    last: i64,
    /// By sequence from 1 through `last`: the value applied there, if a message applied it
    /// (otherwise a skip took it).
    applied: Vec<Option<i64>>,
    /// By sequence from 1 through `last`: a dead letter there no longer open (its value, and
    /// whether an operator resolved it rather than a message superseding it).
    closed: Vec<Option<(i64, bool)>>,
    /// Values of the open dead letters at `last + 1`.
    open: Vec<i64>,
    /// By sequence from `last + 2`: the value held there (broker door only).
    held: Vec<Option<i64>>,
    bounds: Option<Bounds>,
}

/// What a step picks among the ids known when it runs.
#[derive(Debug, Clone)]
enum Step {
    Deliver {
        fresh: bool,
        /// A known id (modulo their number) or, past them, a new one.
        pick: usize,
        /// For a known id: delivered with its recorded content.
        same: bool,
        /// The sequence, after the expected one (at least 1).
        ahead: i64,
        value: i64,
    },
    Resolve {
        fresh: bool,
        /// One of the aggregate's dead letters (any status) or, past them, one that does not
        /// exist.
        target: usize,
        /// `None`: a skip; else the replacement's id pick (known ids, then new ones) and value.
        replacement: Option<(usize, i64)>,
        /// Added to the position to give `expectedLast`.
        stale_by: i64,
    },
}

fn state() -> impl Strategy<Value = State> {
    let door = prop_oneof![Just(DoorKind::General), Just(DoorKind::Broker)];
    let value = |values: &'static [i64]| prop::sample::select(values);
    let bounds = prop::option::weighted(
        0.3,
        (1..=3usize, 1..=3usize).prop_map(|(open_dead_letters, held)| Bounds {
            open_dead_letters,
            held,
        }),
    );
    (
        door,
        0..=5i64,
        prop::collection::vec(prop::option::weighted(0.7, value(&APPLYING[..])), 5),
        prop::collection::vec(
            prop::option::weighted(0.3, (value(&POISON[..]), any::<bool>())),
            5,
        ),
        prop::collection::vec(value(&POISON[..]), 0..=3),
        prop::collection::vec(prop::option::weighted(0.4, value(&DELIVERED[..5])), 4),
        bounds,
    )
        .prop_map(|(door, last, applied, closed, open, held, bounds)| {
            let through_last = usize::try_from(last).unwrap_or_default();
            State {
                door,
                last,
                applied: applied.into_iter().take(through_last).collect(),
                closed: closed.into_iter().take(through_last).collect(),
                open,
                // Only the broker door holds messages.
                held: if door == DoorKind::Broker {
                    held
                } else {
                    Vec::new()
                },
                bounds,
            }
        })
}

fn step() -> impl Strategy<Value = Step> {
    let delivered = prop::sample::select(&DELIVERED[..]);
    let deliver = (
        prop::bool::weighted(0.15),
        0..12usize,
        prop::bool::weighted(0.6),
        -3..=3i64,
        delivered.clone(),
    )
        .prop_map(|(fresh, pick, same, ahead, value)| Step::Deliver {
            fresh,
            pick,
            same,
            ahead,
            value,
        });
    let resolve = (
        prop::bool::weighted(0.1),
        0..4usize,
        prop::option::weighted(0.5, (0..12usize, delivered)),
        prop_oneof![4 => Just(0i64), 1 => Just(1i64), 1 => Just(-1i64)],
    )
        .prop_map(|(fresh, target, replacement, stale_by)| Step::Resolve {
            fresh,
            target,
            replacement,
            stale_by,
        });
    prop_oneof![3 => deliver, 1 => resolve]
}

/// A drawn state and the steps run from it.
type Case = (State, Vec<Step>);

fn case() -> impl Strategy<Value = Case> {
    (state(), prop::collection::vec(step(), 1..=4))
}

/// The drawn state's message ids: applied `a{s}`, closed dead letters `a{s}-dl`, open ones
/// `a{s}-q{k}`, held `a{s}-h`.
fn seeded(state: &State) -> Seeded {
    let at = |index: usize| i64::try_from(index).unwrap_or_default() + 1;
    let next = state.last + 1;
    Seeded {
        aggregate_id: DRAWN.to_owned(),
        last: state.last,
        applied: (state.applied.iter().enumerate())
            .filter_map(|(index, value)| {
                value.map(|v| (at(index), named(None, &format!("a{}", at(index))), v))
            })
            .collect(),
        open: (state.open.iter().enumerate())
            .map(|(k, value)| (named(None, &format!("a{next}-q{k}")), *value))
            .collect(),
        closed: (state.closed.iter().enumerate())
            .filter_map(|(index, closed)| {
                closed.map(|(v, _)| (at(index), named(None, &format!("a{}-dl", at(index))), v))
            })
            .collect(),
        held: (state.held.iter().enumerate())
            .filter_map(|(index, value)| {
                let sequence = next + at(index);
                value.map(|v| (sequence, named(None, &format!("a{sequence}-h")), v))
            })
            .collect(),
    }
}

fn message(id: &str, aggregate_id: &str, sequence: i64, value: i64) -> OrderedMessage {
    OrderedMessage {
        message_id: id.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        sequence,
        payload: json!({ "v": value }),
    }
}

fn value_of(message: &OrderedMessage) -> i64 {
    message.payload["v"].as_i64().unwrap_or_default()
}

const NOW: &str = "t1";

/// A dead letter as the in-memory store keeps it.
#[derive(Debug, Clone)]
struct DeadLetter {
    message: OrderedMessage,
    payload: String,
    reason: QuarantineReason,
    status: DeadLetterStatus,
    observations: i64,
}

/// The store the changes are applied to: the rows a backend keeps, by (anonymous) message id.
#[derive(Debug, Clone, Default)]
struct MemoryStore {
    rows: BTreeMap<String, AggregateRow>,
    /// Applied messages in the order they applied.
    applied: Vec<(OrderedMessage, String)>,
    dead_letters: BTreeMap<String, DeadLetter>,
    held: BTreeMap<String, HeldMessage>,
    resolutions: BTreeMap<String, ResolutionRecord>,
}

/// How writing a plan ended, when it did not end written.
enum Interrupted {
    /// The handler's `apply` found the message at this sequence poison.
    Poison(i64),
    /// The handler's `apply` failed.
    Failed,
}

/// The handler's check, overruled for the sequences its `apply` found poison (as a backend
/// decides again).
struct Overruled<'a> {
    poisoned: &'a [i64],
}

impl Check for Overruled<'_> {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        if self.poisoned.contains(&message.sequence) {
            return Err(Poison::new("found in apply"));
        }
        Effects.check(message)
    }
}

impl MemoryStore {
    fn from_state(state: &State) -> MemoryStore {
        let mut store = MemoryStore::default();
        let seeded = seeded(state);
        let bare = |id: &str| id.trim_start_matches(':').to_owned();
        for (sequence, id, value) in &seeded.applied {
            let message = message(&bare(id), DRAWN, *sequence, *value);
            let payload = canonical_json(&message.payload);
            store.applied.push((message, payload));
        }
        let next = state.last + 1;
        let open = seeded.open.iter().map(|(id, v)| (next, id, v, None));
        let closed = (seeded.closed.iter())
            .zip(state.closed.iter().flatten())
            .map(|((sequence, id, v), (_, resolved))| (*sequence, id, v, Some(*resolved)));
        for (sequence, id, value, closed) in open.chain(closed) {
            let message = message(&bare(id), DRAWN, sequence, *value);
            let status = match closed {
                None => DeadLetterStatus::Open,
                Some(false) => DeadLetterStatus::Superseded,
                Some(true) => DeadLetterStatus::Resolved,
            };
            if closed == Some(true) {
                store
                    .resolutions
                    .insert(message.message_id.clone(), earlier_resolution(&message));
            }
            store.insert_dead_letter(message, status);
        }
        for (sequence, id, value) in &seeded.held {
            let message = message(&bare(id), DRAWN, *sequence, *value);
            let payload = canonical_json(&message.payload);
            store.held.insert(
                message.message_id.clone(),
                HeldMessage {
                    message,
                    payload,
                    held_at: "t0".to_owned(),
                    claim: None,
                    producer_now: None,
                },
            );
        }
        let status = if !state.open.is_empty() {
            Some(AggregateStatus::Blocked)
        } else if !seeded.held.is_empty() {
            Some(AggregateStatus::Waiting)
        } else {
            (state.last > 0).then_some(AggregateStatus::Flowing)
        };
        if let Some(status) = status {
            store.rows.insert(
                DRAWN.to_owned(),
                AggregateRow {
                    last: state.last,
                    status,
                    since: Some("t0".to_owned()),
                },
            );
        }
        store
    }

    fn insert_dead_letter(&mut self, message: OrderedMessage, status: DeadLetterStatus) {
        let payload = canonical_json(&message.payload);
        let dead_letter = DeadLetter {
            message,
            payload,
            reason: QuarantineReason::new("negative value"),
            status,
            observations: 1,
        };
        self.dead_letters
            .insert(dead_letter.message.message_id.clone(), dead_letter);
    }

    fn last(&self, aggregate_id: &str) -> i64 {
        self.rows.get(aggregate_id).map_or(0, |row| row.last)
    }

    fn applied_fact(&self, id: &str) -> Option<AppliedFact> {
        let (message, payload) = self.applied.iter().find(|(m, _)| m.message_id == id)?;
        Some(AppliedFact {
            payload: payload.clone(),
            aggregate_id: Some(message.aggregate_id.clone()),
            sequence: Some(message.sequence),
            applied_at: Some("t0".to_owned()),
        })
    }

    fn known_dead_letter(&self, id: &str) -> Option<KnownDeadLetter> {
        self.dead_letters.get(id).map(|d| KnownDeadLetter {
            payload: Some(d.payload.clone()),
            aggregate_id: Some(d.message.aggregate_id.clone()),
            sequence: Some(d.message.sequence),
            reason: d.reason.clone(),
            status: d.status,
            observations: d.observations,
        })
    }

    fn open_dead_letters(&self, aggregate_id: &str) -> Vec<OpenDeadLetter> {
        (self.dead_letters.values())
            .filter(|d| {
                d.message.aggregate_id == aggregate_id && d.status == DeadLetterStatus::Open
            })
            .map(|d| OpenDeadLetter {
                producer: None,
                message_id: d.message.message_id.clone(),
                sequence: Some(d.message.sequence),
            })
            .collect()
    }

    fn held_of(&self, aggregate_id: &str) -> Vec<HeldMessage> {
        let mut held: Vec<HeldMessage> = self
            .held
            .values()
            .filter(|h| h.message.aggregate_id == aggregate_id)
            .cloned()
            .collect();
        held.sort_by_key(|h| h.message.sequence);
        held
    }

    fn delivery_facts(&self, message: &OrderedMessage) -> DeliveryFacts {
        let aggregate_id = &message.aggregate_id;
        DeliveryFacts {
            applied: self.applied_fact(&message.message_id),
            dead_letter: self.known_dead_letter(&message.message_id),
            aggregate: self.rows.get(aggregate_id).cloned(),
            open_dead_letters: self.open_dead_letters(aggregate_id),
            held_message: self.held.get(&message.message_id).cloned(),
            held: self.held_of(aggregate_id),
            owner: None,
            skipped_by: None,
        }
    }

    fn resolution_facts(&self, request: &ResolutionRequest) -> ResolutionFacts {
        let dead_letter = self.dead_letters.get(&request.dead_letter_id);
        let aggregate_id = dead_letter
            .map(|d| d.message.aggregate_id.clone())
            .unwrap_or_default();
        let replacement = match &request.action {
            Action::Replace { message_id, .. } => message_id.clone(),
            Action::Skip | Action::Accept => String::new(),
        };
        ResolutionFacts {
            dead_letter: dead_letter.map(|d| DeadLetterFact {
                status: d.status,
                aggregate_id: Some(d.message.aggregate_id.clone()),
                sequence: Some(d.message.sequence),
                payload: Some(d.payload.clone()),
            }),
            recorded: self.resolutions.get(&request.dead_letter_id).cloned(),
            aggregate: self.rows.get(&aggregate_id).cloned(),
            open_dead_letters: self.open_dead_letters(&aggregate_id),
            operator_active: true,
            replacement_applied: self.applied_fact(&replacement),
            replacement_dead_letter: self.known_dead_letter(&replacement),
            replacement_held: self.held.get(&replacement).cloned(),
            held: self.held_of(&aggregate_id),
            owner: None,
        }
    }

    /// Writes `changes` in order, running the handler before each applied message. An
    /// impossible change (a second row for one id, a release of nothing) is the test's failure.
    fn write(&mut self, changes: &[Change]) -> Result<Result<(), Interrupted>, String> {
        for change in changes {
            if let Some(message) = change.applied_message() {
                match value_of(message) {
                    3 => return Ok(Err(Interrupted::Poison(message.sequence))),
                    4 => return Ok(Err(Interrupted::Failed)),
                    _ => {}
                }
            }
            self.write_one(change)?;
        }
        Ok(Ok(()))
    }

    fn write_one(&mut self, change: &Change) -> Result<(), String> {
        let known = |store: &MemoryStore, id: &str| {
            store.applied.iter().any(|(m, _)| m.message_id == id)
                || store.dead_letters.contains_key(id)
        };
        match change {
            Change::PutAggregate { aggregate_id, row } => {
                self.rows.insert(aggregate_id.clone(), row.clone());
            }
            Change::InsertApplied {
                producer: None,
                message,
                payload,
                ..
            } if !known(self, &message.message_id) => {
                self.applied.push((message.clone(), payload.clone()));
            }
            Change::InsertDeadLetter {
                producer: None,
                message,
                ..
            } if !known(self, &message.message_id) => {
                self.insert_dead_letter(message.clone(), DeadLetterStatus::Open);
            }
            Change::ObserveDeadLetter {
                producer: None,
                message_id,
                observations,
                ..
            } => {
                let dead_letter = self
                    .dead_letters
                    .get_mut(message_id)
                    .ok_or("observed no dead letter")?;
                dead_letter.observations = *observations;
            }
            Change::SupersedeDeadLetters {
                aggregate_id,
                message_ids,
                ..
            } => {
                for id in message_ids {
                    let dead_letter = self.dead_letters.get_mut(id).filter(|d| {
                        d.status == DeadLetterStatus::Open
                            && &d.message.aggregate_id == aggregate_id
                    });
                    dead_letter.ok_or("superseded no open dead letter")?.status =
                        DeadLetterStatus::Superseded;
                }
            }
            Change::ResolveDeadLetter {
                producer: None,
                message_id,
                ..
            } => {
                let dead_letter = self
                    .dead_letters
                    .get_mut(message_id)
                    .filter(|d| d.status == DeadLetterStatus::Open);
                dead_letter.ok_or("resolved no open dead letter")?.status =
                    DeadLetterStatus::Resolved;
            }
            Change::RecordResolution(record) => {
                self.resolutions
                    .insert(record.message_id.clone(), record.as_ref().clone());
            }
            Change::InsertHeld {
                claim: None,
                message,
                payload,
                at,
            } => {
                let taken = self.held.values().any(|h| {
                    h.message.aggregate_id == message.aggregate_id
                        && h.message.sequence == message.sequence
                });
                if taken || self.held.contains_key(&message.message_id) {
                    return Err(format!("a second held message at {}", message.sequence));
                }
                let held = HeldMessage {
                    message: message.clone(),
                    payload: payload.clone(),
                    held_at: at.clone(),
                    claim: None,
                    producer_now: None,
                };
                self.held.insert(message.message_id.clone(), held);
            }
            Change::ReleaseHeld {
                producer: None,
                message_id,
            } => {
                self.held
                    .remove(message_id)
                    .ok_or("released no held message")?;
            }
            // The evidence of the decision: nothing the model compares.
            Change::Append(_) | Change::RecordRejected(_) | Change::NoteGap { .. } => {}
            other => {
                return Err(format!(
                    "a change an anonymous decision never writes: {other:?}"
                ));
            }
        }
        Ok(())
    }

    /// What is stored of the aggregate, in the model's words.
    fn stored(&self, aggregate_id: &str) -> Stored {
        let mut open: Vec<String> = (self.open_dead_letters(aggregate_id).iter())
            .map(|d| named(None, &d.message_id))
            .collect();
        open.sort();
        Stored {
            last: self.last(aggregate_id),
            held: self
                .held_of(aggregate_id)
                .iter()
                .map(|h| h.message.sequence)
                .collect(),
            open,
            applied: (self.applied.iter())
                .filter(|(m, _)| m.aggregate_id == aggregate_id)
                .map(|(m, _)| (m.sequence, named(None, &m.message_id)))
                .collect(),
            owner: None,
            transfers: Vec::new(),
        }
    }

    /// Every id the store knows, in a fixed order: what a step picks from.
    fn known_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = (self.applied.iter().map(|(m, _)| m.message_id.clone()))
            .chain(self.dead_letters.keys().cloned())
            .chain(self.held.keys().cloned())
            .collect();
        ids.sort();
        ids
    }

    /// The recorded content of a known id.
    fn content(&self, id: &str) -> Option<OrderedMessage> {
        (self
            .applied
            .iter()
            .find(|(m, _)| m.message_id == id)
            .map(|(m, _)| m))
        .or_else(|| self.dead_letters.get(id).map(|d| &d.message))
        .or_else(|| self.held.get(id).map(|h| &h.message))
        .cloned()
    }
}

/// A resolved dead letter's audit row, by an operator other than the steps'.
fn earlier_resolution(message: &OrderedMessage) -> ResolutionRecord {
    let position = |last| Position { last, state: None };
    ResolutionRecord {
        resolution_id: Some(1),
        producer: None,
        message_id: message.message_id.clone(),
        aggregate_id: message.aggregate_id.clone(),
        sequence: message.sequence,
        action: ActionKind::Skip,
        operator: "earlier".to_owned(),
        reason: "an earlier resolution".to_owned(),
        expected_last: message.sequence - 1,
        replacement: None,
        before: position(message.sequence - 1),
        after: position(message.sequence),
        resolved_at: "t0".to_owned(),
    }
}

/// Runs one decision as a backend does: decide on the store's facts, write the plan; after a
/// poison from `apply`, decide again with that sequence poison; a failure writes nothing.
fn run_decision<P>(
    store: &mut MemoryStore,
    limits: &Limits,
    mut decide: impl FnMut(&MemoryStore, Context<'_>) -> Option<(P, Vec<Change>)>,
) -> Result<Option<Option<P>>, String> {
    let mut poisoned = Vec::new();
    // Each round marks one more message poison: at most the decided one and every held one.
    while poisoned.len() <= store.held.len() + 1 {
        let check = Overruled {
            poisoned: &poisoned,
        };
        let context = Context {
            limits,
            check: &check,
            now: NOW,
        };
        let Some((outcome, changes)) = decide(store, context) else {
            return Ok(Some(None));
        };
        let mut written = store.clone();
        match written.write(&changes)? {
            Ok(()) => {
                *store = written;
                return Ok(Some(Some(outcome)));
            }
            Err(Interrupted::Poison(sequence)) => poisoned.push(sequence),
            Err(Interrupted::Failed) => return Ok(None),
        }
    }
    Err("apply declared more messages poison than the plan applies".to_owned())
}

fn limits_of(bounds: Option<Bounds>) -> Limits {
    bounds.map_or_else(Limits::default, |b| Limits {
        max_open_dead_letters: b.open_dead_letters,
        max_held_per_aggregate: b.held,
    })
}

/// One case: the state in the model and in the store, then each step in both, compared.
fn agrees(state: &State, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut model = Model::seeded(&[seeded(state)]);
    if let Some(bounds) = state.bounds {
        model = model.bounded(bounds);
    }
    let mut store = MemoryStore::from_state(state);
    let limits = limits_of(state.bounds);
    for (index, step) in steps.iter().enumerate() {
        let (real, modelled) = match step {
            Step::Deliver { .. } => {
                let delivered = delivery(&store, state.door, step);
                let real = deliver(&mut store, &limits, &delivered).map_err(TestCaseError::fail)?;
                (real, model.deliver(&delivered))
            }
            Step::Resolve { .. } => {
                let (request, resolution) = resolution(&store, index, step);
                let real = resolve(&mut store, &limits, &request).map_err(TestCaseError::fail)?;
                (real, model.resolve(&resolution))
            }
        };
        prop_assert_eq!(&real, &modelled, "the verdict of step {}", index);
        reached(&real);
        for aggregate_id in [DRAWN, FRESH] {
            prop_assert_eq!(
                store.stored(aggregate_id),
                model.stored(aggregate_id),
                "what is stored of {} after step {}",
                aggregate_id,
                index
            );
        }
    }
    Ok(())
}

/// The delivery a step makes, given the ids known now.
fn delivery(store: &MemoryStore, door: DoorKind, step: &Step) -> Delivery {
    let Step::Deliver {
        fresh,
        pick,
        same,
        ahead,
        value,
    } = step
    else {
        unreachable!("a delivery step");
    };
    let known = store.known_ids();
    let aggregate = if *fresh { FRESH } else { DRAWN };
    let sequence = (store.last(aggregate) + 1 + ahead).max(1);
    // On the broker door a failing apply would hold its predecessor up for ever once held.
    let value = if door == DoorKind::Broker && *value == 4 {
        2
    } else {
        *value
    };
    let offered = match known.get(*pick) {
        Some(id) if *same => store
            .content(id)
            .unwrap_or_else(|| message(id, aggregate, sequence, value)),
        Some(id) => message(id, aggregate, sequence, value),
        None => message(NEW_IDS[pick % NEW_IDS.len()], aggregate, sequence, value),
    };
    Delivery {
        door,
        producer: None,
        stale_epoch: false,
        epoch: 0,
        value: value_of(&offered),
        message_id: offered.message_id,
        aggregate_id: offered.aggregate_id,
        sequence: offered.sequence,
    }
}

fn deliver(
    store: &mut MemoryStore,
    limits: &Limits,
    delivery: &Delivery,
) -> Result<Verdict, String> {
    let offered = message(
        &delivery.message_id,
        &delivery.aggregate_id,
        delivery.sequence,
        delivery.value,
    );
    let door = match delivery.door {
        DoorKind::General => Door::General,
        DoorKind::Broker => Door::Broker,
    };
    let ran = run_decision(store, limits, |store, context| {
        let plan = decide_delivery(&offered, door, &store.delivery_facts(&offered), context);
        Some((plan.outcome, plan.changes))
    })?;
    Ok(match ran {
        Some(Some(outcome)) => verdict_of(&outcome),
        Some(None) | None => Verdict::Failed,
    })
}

/// The request a resolution step makes and the same resolution in the model's words. Each
/// step's reason is its own, so that no step repeats an earlier resolution identically (the
/// model refuses every resolution of a dead letter no longer open).
fn resolution(store: &MemoryStore, index: usize, step: &Step) -> (ResolutionRequest, Resolution) {
    let Step::Resolve {
        fresh,
        target,
        replacement,
        stale_by,
    } = step
    else {
        unreachable!("a resolution step");
    };
    let aggregate_id = if *fresh { FRESH } else { DRAWN };
    let targets: Vec<&String> = (store.dead_letters.iter())
        .filter(|(_, d)| d.message.aggregate_id == aggregate_id)
        .map(|(id, _)| id)
        .collect();
    let dead_letter_id = targets
        .get(*target)
        .map_or("missing".to_owned(), |id| (*id).clone());
    let replacement = replacement.map(|(pick, value)| {
        let known = store.known_ids();
        let id = known
            .get(pick)
            .cloned()
            .unwrap_or_else(|| NEW_IDS[pick % NEW_IDS.len()].to_owned());
        (id, value)
    });
    let expected_last = store.last(aggregate_id) + stale_by;
    let request = ResolutionRequest {
        producer: None,
        dead_letter_id: dead_letter_id.clone(),
        operator: "operator".to_owned(),
        action: match &replacement {
            Some((message_id, value)) => Action::Replace {
                message_id: message_id.clone(),
                payload: json!({ "v": value }),
            },
            None => Action::Skip,
        },
        expected_last,
        reason: format!("step {index}"),
    };
    let resolution = Resolution {
        aggregate_id: aggregate_id.to_owned(),
        producer: None,
        dead_letter_id,
        replacement,
        expected_last,
    };
    (request, resolution)
}

fn resolve(
    store: &mut MemoryStore,
    limits: &Limits,
    request: &ResolutionRequest,
) -> Result<Verdict, String> {
    let ran = run_decision(store, limits, |store, context| {
        let plan = decide_resolution(
            request,
            &store.resolution_facts(request),
            Mode::Commit,
            context,
        )
        .ok()?;
        Some((plan.resolved, plan.changes))
    })?;
    Ok(match ran {
        Some(Some(Resolved::New(_) | Resolved::Repeated(_))) => Verdict::Resolved,
        Some(Some(Resolved::DryRun(_)) | None) | None => Verdict::Refused,
    })
}

/// Runs the property over `cases` cases, keeping a failure's seed in `regressions` (`None`: not
/// kept); the error names the minimal failing case.
fn check(cases: u32, regressions: Option<&'static str>) -> Result<(), Box<TestError<Case>>> {
    let persistence = regressions
        .map(|path| Box::new(FileFailurePersistence::Direct(path)) as Box<dyn FailurePersistence>);
    let config = Config {
        cases,
        failure_persistence: persistence,
        ..Config::default()
    };
    let mut runner = match regressions {
        Some(_) => TestRunner::new(config),
        // A planted bug's run is the same on every run of the test.
        None => TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha)),
    };
    runner
        .run(&case(), |(state, steps)| agrees(&state, &steps))
        .map_err(Box::new)
}

/// Every verdict the property gave so far, by its kind (a model that never reaches a case
/// passes for nothing).
static REACHED: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

fn reached(verdict: &Verdict) {
    let kind = match verdict {
        Verdict::Applied(_) => "applied",
        Verdict::Replay => "replay",
        Verdict::Conflict => "payload conflict",
        Verdict::Gap(_) => "gap",
        Verdict::Stale(_) => "stale",
        Verdict::Quarantined(_) => "quarantined",
        Verdict::Held { repeated: false } => "held",
        Verdict::Held { repeated: true } => "held again",
        Verdict::Full => "full",
        Verdict::Failed => "failed",
        Verdict::Resolved => "resolved",
        Verdict::Refused => "refused",
        Verdict::NotAdmitted(_)
        | Verdict::Session(_)
        | Verdict::Transferred { .. }
        | Verdict::TransferRefused { .. } => "producers' (never drawn)",
    };
    REACHED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert(kind);
}

#[test]
fn the_pure_core_decides_and_plans_as_the_reference_model_says() {
    let _switch = planted_switch();
    if let Err(error) = check(4000, Some("tests/pure_core.proptest-regressions")) {
        panic!("{error}");
    }
    let reached = REACHED
        .lock()
        .map(|kinds| kinds.clone())
        .unwrap_or_default();
    let every = [
        "applied",
        "replay",
        "payload conflict",
        "gap",
        "stale",
        "quarantined",
        "held",
        "held again",
        "full",
        "failed",
        "resolved",
        "refused",
    ];
    let missed: Vec<&str> = every
        .into_iter()
        .filter(|kind| !reached.contains(kind))
        .collect();
    assert!(missed.is_empty(), "the cases never reached {missed:?}");
}

#[test]
fn a_bug_planted_in_the_pure_core_is_caught_and_shrunk_to_a_step_or_two() {
    let _switch = planted_switch();
    for bug in [Bug::AdvanceOnQuarantine, Bug::DrainOutOfOrder] {
        planted::plant(Some(bug));
        let found = check(4000, None);
        planted::plant(None);
        let Some(TestError::Fail(why, (state, steps))) = found.err().map(|error| *error) else {
            panic!("{bug:?} was not caught");
        };
        eprintln!("{bug:?}: {why}\nminimal case: {state:?} then {steps:?}");
        assert!(
            steps.len() <= 2,
            "{bug:?} shrinks to a step or two: {steps:?}"
        );
    }
}
