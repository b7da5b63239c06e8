//! The inbox against a reference model: random but reproducible histories (deliveries shuffled,
//! duplicated, conflicting and poisoned, on the general or the broker door; operators' skips and
//! replacements, some with a stale `expectedLast`) run through the real SQLite inbox, and after
//! every step its verdict and the aggregate's state are compared with what the model says.
//! A difference fails the case; proptest then shrinks the history to a short one that still
//! fails, and keeps its seed in `tests/reference_model.proptest-regressions`.
//!
//! The model shares no code with the library's decisions: it is the rules of the inbox written
//! out once, for clarity rather than speed (see `model/mod.rs`).

mod model;

use std::sync::Arc;

use ordered_inbox::resolution::{Mode, ResolutionError};
use ordered_inbox::sqlite::{SqliteHandler, SqliteInbox, Store, Synchronous, operators, schema};
use ordered_inbox::views::PageRequest;
use ordered_inbox::{
    ApplyOutcome, Check, Door, HandlerError, Inbox, Limits, OrderedMessage, Outcome, Poison,
};
use proptest::prelude::*;
use rusqlite::Connection;
use serde_json::json;

use model::{Model, Op, Verdict};

/// A handler of the model's rules: a negative `v` is poison; applying writes nothing else.
struct Values;

impl Check for Values {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match message.payload["v"].as_i64() {
            Some(v) if v >= 0 => Ok(()),
            _ => Err(Poison::new("negative")),
        }
    }
}

impl SqliteHandler for Values {
    fn apply(&self, _: &Connection, _: &OrderedMessage) -> Result<ApplyOutcome, HandlerError> {
        Ok(ApplyOutcome::applied())
    }
}

const AGGREGATES: [&str; 2] = ["a", "b"];

/// One step of a history, as proptest draws it: small domains, so that ids, sequences and
/// dead letters meet often.
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..2usize, 1..7i64, 0..3u8, prop::bool::weighted(0.1)).prop_map(
            |(aggregate, sequence, variant, tampered)| Op::Deliver {
                aggregate,
                sequence,
                variant,
                tampered,
            }
        ),
        2 => (0..2usize, prop::bool::ANY, prop::bool::weighted(0.25)).prop_map(
            |(aggregate, replace, stale)| Op::Resolve {
                aggregate,
                replace,
                stale,
            }
        ),
    ]
}

fn door() -> impl Strategy<Value = Door> {
    prop_oneof![Just(Door::General), Just(Door::Broker)]
}

/// The real inbox in a temporary file, with one operator.
fn open_inbox(directory: &tempfile::TempDir) -> SqliteInbox {
    let path = directory.path().join("inbox.db");
    let store = Store::open(&path, Synchronous::Normal, schema::migrate).expect("a store");
    operators::add(&path, "alice").expect("an operator");
    SqliteInbox::with_handler(store, Limits::default(), Arc::new(Values))
}

/// What the real inbox answers, in the model's words.
fn verdict_of(outcome: &Outcome) -> Verdict {
    match outcome {
        Outcome::Applied { sequence, .. } => Verdict::Applied(*sequence),
        Outcome::Replay { .. } => Verdict::Replay,
        Outcome::PayloadConflict => Verdict::Conflict,
        Outcome::Gap { expected } => Verdict::Gap(*expected),
        Outcome::Stale { expected } => Verdict::Stale(*expected),
        Outcome::Quarantined { expected, .. } => Verdict::Quarantined(*expected),
        Outcome::Held { repeated, .. } => Verdict::Held {
            repeated: *repeated,
        },
        Outcome::QuarantineFull { .. } | Outcome::HoldFull { .. } => Verdict::Full,
    }
}

async fn run_history(door: Door, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let inbox = open_inbox(&directory);
    let mut model = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let real = match op {
            Op::Deliver { .. } => {
                let message = model.message(op);
                let outcome = inbox
                    .deliver(message.clone(), door)
                    .await
                    .map_err(|error| TestCaseError::fail(format!("step {step}: {error}")))?;
                let expected = model.deliver(&message, door);
                prop_assert_eq!(
                    verdict_of(&outcome),
                    expected,
                    "step {} {:?}: the inbox and the model disagree",
                    step,
                    op
                );
                message.aggregate_id
            }
            Op::Resolve {
                aggregate,
                replace,
                stale,
            } => {
                let (request, expected) = model.resolution(*aggregate, *replace, *stale, step);
                let answer = inbox.resolve(request, Mode::Commit).await;
                let resolved = match answer {
                    Ok(_) => true,
                    Err(ResolutionError::Store(error)) => {
                        return Err(TestCaseError::fail(format!("step {step}: {error}")));
                    }
                    Err(_) => false,
                };
                prop_assert_eq!(resolved, expected, "step {} {:?}: resolution", step, op);
                AGGREGATES[*aggregate].to_owned()
            }
        };
        compare_state(&inbox, &model, &real, step).await?;
    }
    for aggregate in AGGREGATES {
        compare_applied(&inbox, &model, aggregate).await?;
    }
    inbox.shutdown().await;
    Ok(())
}

/// The aggregate's position, held sequences and open dead letters, real against model.
async fn compare_state(
    inbox: &SqliteInbox,
    model: &Model,
    aggregate: &str,
    step: usize,
) -> Result<(), TestCaseError> {
    let view = inbox
        .aggregate(aggregate.to_owned())
        .await
        .map_err(|error| TestCaseError::fail(error.to_string()))?;
    let real = view.map(|view| {
        let mut open: Vec<String> = view
            .open_dead_letters
            .iter()
            .map(|d| d.message_id.clone())
            .collect();
        open.sort();
        (view.summary.last, view.held_sequences, open)
    });
    let expected = model.state(aggregate);
    prop_assert_eq!(
        real.unwrap_or_default(),
        expected,
        "after step {}: aggregate {}",
        step,
        aggregate
    );
    Ok(())
}

/// Every applied message of the aggregate, in sequence order, with its id.
async fn compare_applied(
    inbox: &SqliteInbox,
    model: &Model,
    aggregate: &str,
) -> Result<(), TestCaseError> {
    let mut real = Vec::new();
    let mut after = 0;
    loop {
        let page = inbox
            .applied_messages(aggregate.to_owned(), PageRequest { after, limit: 500 })
            .await
            .map_err(|error| TestCaseError::fail(error.to_string()))?;
        real.extend(
            page.items
                .iter()
                .map(|m| (m.sequence.unwrap_or_default(), m.message_id.clone())),
        );
        match page.next {
            Some(next) => after = next,
            None => break,
        }
    }
    prop_assert_eq!(
        real,
        model.applied(aggregate),
        "applied messages of {}",
        aggregate
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_history_is_answered_and_recorded_as_the_reference_model_says(
        door in door(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(run_history(door, ops))?;
    }
}

#[test]
fn the_model_itself_applies_in_order_and_quarantines_a_poison() {
    let mut model = Model::default();
    let first = model.message(&Op::Deliver {
        aggregate: 0,
        sequence: 1,
        variant: 0,
        tampered: false,
    });
    assert_eq!(model.deliver(&first, Door::General), Verdict::Applied(1));
    let poison = model.message(&Op::Deliver {
        aggregate: 0,
        sequence: 2,
        variant: 2,
        tampered: false,
    });
    assert_eq!(poison.payload, json!({"v": -1}));
    assert_eq!(
        model.deliver(&poison, Door::General),
        Verdict::Quarantined(2)
    );
    assert_eq!(model.deliver(&first, Door::General), Verdict::Replay);
    assert_eq!(model.state("a").0, 1);
}
