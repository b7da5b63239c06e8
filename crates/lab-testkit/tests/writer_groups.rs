//! Several callers' units in one SQLite writer group: per seed, 4 to 16 tasks deliver a seeded
//! mix at the same time (in order, duplicates, early, poison by the check and in `apply`, `apply`
//! errors) to a few aggregates of the real `SqliteInbox` on a temp file, with the simulator's
//! handler (a row per apply). The writer groups their units into one transaction and replays a
//! group when one unit fails. Afterwards the answers must be those of the reference model for
//! one serial order: the deliveries that changed the state in their commit order (the
//! timeline's), each other delivery at some point between its caller's previous and next one;
//! and what is stored must be that order's end state, each aggregate's applied messages exactly
//! 1..=last, once each, the handler's rows the same.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lab_testkit::simulate::history::{Delivery, DoorKind, value_of};
use lab_testkit::simulate::model::{Model, Stored, Verdict};
use lab_testkit::simulate::system::{Backend, Direct, Effects, verdict_of};
use ordered_inbox::planted::{self, Bug};
use ordered_inbox::sqlite::{
    BatchCommitted, SqliteInbox, Store, StoreStats, Synchronous, WriterObserver, schema,
};
use ordered_inbox::timeline::TimelineKind;
use ordered_inbox::views::PageRequest;
use ordered_inbox::{Door, Inbox, InboxError, Limits, OrderedMessage, Outcome};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;

const SEEDS: u64 = 200;
/// Each caller's deliveries.
const DELIVERIES: std::ops::RangeInclusive<usize> = 4..=10;
const SEQUENCES: i64 = 6;

/// How a caller hands a delivery to the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Deliver,
    /// `deliver_as` without a producer's claim.
    DeliverAs,
}

/// One seed's workload: the aggregates, and each caller's deliveries in its order (all through
/// one door).
#[derive(Debug)]
struct Workload {
    aggregates: Vec<String>,
    callers: Vec<Vec<(Delivery, Route)>>,
}

fn workload(seed: u64) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let door = if rng.random_bool(0.5) {
        DoorKind::General
    } else {
        DoorKind::Broker
    };
    let aggregates: Vec<String> = ["a", "b", "c"][..rng.random_range(2..=3)]
        .iter()
        .map(|id| (*id).to_owned())
        .collect();
    let callers = (0..rng.random_range(4..=16))
        .map(|_| caller(&mut rng, door, &aggregates))
        .collect();
    Workload {
        aggregates,
        callers,
    }
}

/// A caller's deliveries: mostly its aggregates' sequences in order, and duplicates of its own
/// earlier ones, early ones, and ids reused with other content. Every caller delivers the same
/// ids (`{aggregate}-{sequence}-{variant}`), so callers race for each sequence.
fn caller(rng: &mut StdRng, door: DoorKind, aggregates: &[String]) -> Vec<(Delivery, Route)> {
    let mut next: BTreeMap<&str, i64> = aggregates.iter().map(|a| (a.as_str(), 1)).collect();
    let mut deliveries: Vec<(Delivery, Route)> = Vec::new();
    for _ in 0..rng.random_range(DELIVERIES) {
        let aggregate = &aggregates[rng.random_range(0..aggregates.len())];
        let cursor = next.get(aggregate.as_str()).copied().unwrap_or(1);
        let route = if rng.random_bool(0.5) {
            Route::Deliver
        } else {
            Route::DeliverAs
        };
        let roll = rng.random_range(0..100);
        if (50..70).contains(&roll) && !deliveries.is_empty() {
            let again = deliveries[rng.random_range(0..deliveries.len())].0.clone();
            deliveries.push((again, route));
            continue;
        }
        let (sequence, tampered) = match roll {
            70..88 => ((cursor + rng.random_range(1..=2)).min(SEQUENCES), false),
            88..100 => (rng.random_range(1..=SEQUENCES), true),
            _ => {
                next.insert(aggregate, (cursor + 1).min(SEQUENCES));
                (cursor, false)
            }
        };
        // Variant 0 applies, 1 is poison in `apply` or fails it on some sequences, 2 is poison
        // by the check.
        let variant = match rng.random_range(0..10) {
            0..=5 => 0,
            6..=8 => 1,
            _ => 2,
        };
        let delivery = Delivery {
            door,
            producer: None,
            stale_epoch: false,
            epoch: 0,
            message_id: format!("{aggregate}-{sequence}-{variant}"),
            aggregate_id: aggregate.clone(),
            sequence,
            value: value_of(door, sequence, variant, tampered),
        };
        deliveries.push((delivery, route));
    }
    deliveries
}

/// What the writer's committed groups were like, over every seed.
#[derive(Default)]
struct Groups {
    /// Groups of more than one unit.
    shared: AtomicU64,
    /// Groups of more than one unit run a second time because one of them failed.
    shared_and_replayed: AtomicU64,
}

impl WriterObserver for Groups {
    fn batch_committed(&self, batch: BatchCommitted) {
        if batch.units > 1 {
            self.shared.fetch_add(1, Ordering::Relaxed);
            if batch.replayed {
                self.shared_and_replayed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One caller's delivery with its answer.
#[derive(Debug, Clone)]
struct Answered {
    delivery: Delivery,
    verdict: Verdict,
    /// Whether the answer recorded the message (applied, a new dead letter, newly held): the
    /// deliveries that change the model's state.
    records: bool,
}

fn answered(delivery: Delivery, outcome: Result<Outcome, InboxError>) -> Result<Answered, String> {
    let (verdict, records) = match outcome {
        Ok(outcome) => {
            let records = match &outcome {
                Outcome::Applied { .. }
                | Outcome::Held {
                    repeated: false, ..
                } => true,
                Outcome::Quarantined { dead_letter, .. } => {
                    dead_letter.is_some_and(|note| note.observations == 1)
                }
                _ => false,
            };
            (verdict_of(&outcome), records)
        }
        Err(InboxError::Handler(_)) => (Verdict::Failed, false),
        Err(error) => return Err(format!("{delivery:?} failed: {error}")),
    };
    Ok(Answered {
        delivery,
        verdict,
        records,
    })
}

async fn deliver(
    inbox: &SqliteInbox,
    delivery: &Delivery,
    route: Route,
) -> Result<Outcome, InboxError> {
    let message = OrderedMessage {
        message_id: delivery.message_id.clone(),
        aggregate_id: delivery.aggregate_id.clone(),
        sequence: delivery.sequence,
        payload: json!({ "v": delivery.value }),
    };
    let door = match delivery.door {
        DoorKind::General => Door::General,
        DoorKind::Broker => Door::Broker,
    };
    match route {
        Route::Deliver => inbox.deliver(message, door).await,
        Route::DeliverAs => match inbox.deliver_as(message, door, None).await? {
            Ok(outcome) => Ok(outcome),
            Err(refusal) => Err(InboxError::Unavailable(format!(
                "an anonymous delivery refused: {refusal}"
            ))),
        },
    }
}

/// Runs every caller at once on the inbox; each caller's answers in its order.
async fn run_callers(
    inbox: &SqliteInbox,
    workload: &Workload,
) -> Result<Vec<Vec<Answered>>, String> {
    let start = Arc::new(tokio::sync::Barrier::new(workload.callers.len()));
    let tasks: Vec<_> = (workload.callers.iter().cloned())
        .map(|deliveries| {
            let inbox = inbox.clone();
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                let mut answers = Vec::with_capacity(deliveries.len());
                for (delivery, route) in deliveries {
                    let outcome = deliver(&inbox, &delivery, route).await;
                    answers.push(answered(delivery, outcome)?);
                }
                Ok::<_, String>(answers)
            })
        })
        .collect();
    let mut callers = Vec::with_capacity(tasks.len());
    for task in tasks {
        callers.push(task.await.map_err(|e| e.to_string())??);
    }
    Ok(callers)
}

/// The timeline's state events by (kind, message id), with their commit order.
async fn commit_order(
    inbox: &SqliteInbox,
    aggregates: &[String],
) -> Result<BTreeMap<(&'static str, String), Vec<i64>>, String> {
    let mut events: BTreeMap<(&'static str, String), Vec<i64>> = BTreeMap::new();
    for aggregate in aggregates {
        let mut after = 0;
        loop {
            let page = inbox
                .reads()
                .timeline(aggregate.clone(), PageRequest { after, limit: 1000 })
                .await
                .map_err(|e| e.to_string())?;
            let mut drained = None;
            for event in page.items {
                let Some(id) = event.message_id.clone() else {
                    continue;
                };
                // A drain's own `applied` or `quarantined` event belongs to no delivery: the
                // held message's delivery was recorded by its `held` event.
                let of_a_drain = drained.as_ref() == Some(&id);
                drained = (event.kind == TimelineKind::Drained).then(|| id.clone());
                if !of_a_drain {
                    events
                        .entry((event.kind.as_str(), id))
                        .or_default()
                        .push(event.id);
                }
            }
            match page.next {
                Some(next) => after = next,
                None => break,
            }
        }
    }
    Ok(events)
}

/// The kind of the state event that records an answer.
fn recording_kind(verdict: &Verdict) -> Option<TimelineKind> {
    match verdict {
        Verdict::Applied(_) => Some(TimelineKind::Applied),
        Verdict::Quarantined(_) => Some(TimelineKind::Quarantined),
        Verdict::Held { repeated: false } => Some(TimelineKind::Held),
        _ => None,
    }
}

/// Checks the answers against the model in one serial order; returns the model at its end.
fn serial_order(
    callers: &[Vec<Answered>],
    events: &BTreeMap<(&'static str, String), Vec<i64>>,
) -> Result<Model, String> {
    // The recording deliveries in commit order: (event id, caller, index).
    let mut recording = Vec::new();
    for (caller, answers) in callers.iter().enumerate() {
        for (index, answer) in answers.iter().enumerate().filter(|(_, a)| a.records) {
            let kind =
                recording_kind(&answer.verdict).ok_or("a recording answer without its event")?;
            let key = (kind.as_str(), answer.delivery.message_id.clone());
            let [event] = events.get(&key).map(Vec::as_slice).unwrap_or_default() else {
                return Err(format!(
                    "{answer:?} has not exactly one {kind:?} event: {:?}",
                    events.get(&key)
                ));
            };
            recording.push((*event, caller, index));
        }
    }
    recording.sort_unstable();
    // The model after each prefix of the recording deliveries.
    let mut states = vec![Model::default()];
    let mut position = BTreeMap::new();
    for (at, (_, caller, index)) in recording.iter().enumerate() {
        let answer = &callers[*caller][*index];
        let mut model = states[at].clone();
        let verdict = model.deliver(&answer.delivery);
        if verdict != answer.verdict {
            return Err(format!(
                "{answer:?}, committed {at}th, is {verdict:?} in the model"
            ));
        }
        states.push(model);
        position.insert((*caller, *index), at);
    }
    for (caller, answers) in callers.iter().enumerate() {
        place_the_rest(caller, answers, &states, &position)?;
    }
    states.pop().ok_or_else(|| "no state".to_owned())
}

/// Places each of a caller's answers that recorded nothing at the earliest point, after its
/// caller's previous answer and before its next recording one, where the model answers the same.
fn place_the_rest(
    caller: usize,
    answers: &[Answered],
    states: &[Model],
    position: &BTreeMap<(usize, usize), usize>,
) -> Result<(), String> {
    // A point is a state: 0 before the first recording delivery, p + 1 right after the p-th.
    let mut earliest = 0;
    for (index, answer) in answers.iter().enumerate() {
        if let Some(at) = position.get(&(caller, index)) {
            if *at < earliest {
                return Err(format!(
                    "caller {caller}'s {answer:?} committed before its previous answer"
                ));
            }
            earliest = at + 1;
            continue;
        }
        let latest = (index..answers.len())
            .find_map(|later| position.get(&(caller, later)).copied())
            .unwrap_or(states.len() - 1);
        let found = (earliest..=latest)
            .find(|point| states[*point].clone().deliver(&answer.delivery) == answer.verdict);
        match found {
            Some(point) => earliest = point,
            None => {
                return Err(format!(
                    "caller {caller}'s {answer:?} is the model's answer at no point from \
                     {earliest} to {latest}"
                ));
            }
        }
    }
    Ok(())
}

/// What is stored of each aggregate, read through the simulator's reader (which also checks
/// that the handler's rows are the applied messages).
async fn stored(path: &Path, aggregates: &[String]) -> Result<Vec<Stored>, String> {
    let mut reader = Direct::open(&Backend::Sqlite(path.to_owned())).await?;
    let mut stored = Vec::with_capacity(aggregates.len());
    for aggregate in aggregates {
        stored.push(reader.stored(aggregate).await?);
    }
    reader.close().await;
    Ok(stored)
}

/// One seed: the callers at once, then the answers and the stored state against the model.
async fn run_seed(seed: u64, directory: &Path, groups: &Arc<Groups>) -> Result<StoreStats, String> {
    let workload = workload(seed);
    let path = directory.join(format!("seed-{seed}.db"));
    // The simulator's reader creates the handler's table; the callers' inbox observes its writer.
    stored(&path, &workload.aggregates).await?;
    let observer: Arc<dyn WriterObserver> = groups.clone();
    let store = Store::open_observed(&path, Synchronous::Normal, schema::migrate, Some(observer))
        .map_err(|e| e.to_string())?;
    let inbox = SqliteInbox::with_handler(store.clone(), Limits::default(), Arc::new(Effects));
    let callers = run_callers(&inbox, &workload).await;
    let events = commit_order(&inbox, &workload.aggregates).await;
    let stats = store.stats();
    inbox.shutdown().await;
    let (callers, events) = (callers?, events?);
    let model = serial_order(&callers, &events)?;
    let all = stored(&path, &workload.aggregates).await?;
    for (aggregate, stored) in workload.aggregates.iter().zip(&all) {
        let modelled = model.stored(aggregate);
        if *stored != modelled {
            return Err(format!(
                "{aggregate} is stored as {stored:?}, the serial order leaves {modelled:?}"
            ));
        }
        let sequences: Vec<i64> = stored
            .applied
            .iter()
            .map(|(sequence, _)| *sequence)
            .collect();
        if sequences != (1..=stored.last).collect::<Vec<_>>() {
            return Err(format!(
                "{aggregate}'s applied messages are not 1..={}: {sequences:?}",
                stored.last
            ));
        }
    }
    // No answered unit of a replayed group is lost: every message answered applied is stored.
    let applied: Vec<String> = (callers.iter().flatten())
        .filter(|answer| matches!(answer.verdict, Verdict::Applied(_)))
        .map(|answer| format!(":{}", answer.delivery.message_id))
        .collect();
    if let Some(lost) = applied.iter().find(|id| {
        !all.iter()
            .any(|s| s.applied.iter().any(|(_, stored)| &stored == id))
    }) {
        return Err(format!("{lost} was answered applied and is not stored"));
    }
    Ok(stats)
}

/// Planting a bug is a switch of the whole process: each test holds this while it runs.
static PLANTED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_callers_units_in_one_writer_group_are_answered_and_stored_as_one_serial_order() {
    let _switch = PLANTED.lock().await;
    let directory = tempfile::tempdir().expect("a directory");
    let groups = Arc::new(Groups::default());
    let mut totals = StoreStats {
        commits: 0,
        units: 0,
        replayed: 0,
    };
    for seed in 1..=SEEDS {
        let stats = match run_seed(seed, directory.path(), &groups).await {
            Ok(stats) => stats,
            Err(what) => panic!("seed {seed}: {what}\n{:#?}", workload(seed)),
        };
        totals.commits += stats.commits;
        totals.units += stats.units;
        totals.replayed += stats.replayed;
    }
    let shared = groups.shared.load(Ordering::Relaxed);
    let shared_and_replayed = groups.shared_and_replayed.load(Ordering::Relaxed);
    eprintln!(
        "{SEEDS} seeds: {totals:?}; groups of several units {shared}, of which replayed \
         {shared_and_replayed}"
    );
    assert!(
        totals.units > totals.commits,
        "the writer grouped units: {totals:?}"
    );
    assert!(
        totals.replayed > 0,
        "the writer replayed groups: {totals:?}"
    );
    assert!(
        shared_and_replayed > 0,
        "a group of several units was replayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_loses_a_unit_but_answers_it_is_caught() {
    let _switch = PLANTED.lock().await;
    let directory = tempfile::tempdir().expect("a directory");
    let groups = Arc::new(Groups::default());
    planted::plant(Some(Bug::LoseReplayedUnit));
    let mut caught = None;
    for seed in 1..=SEEDS {
        if let Err(what) = run_seed(seed, directory.path(), &groups).await {
            caught = Some((seed, what));
            break;
        }
    }
    planted::plant(None);
    let (seed, what) = caught.expect("the lost unit is caught within the seeds");
    eprintln!("caught at seed {seed}: {what}");
}
