//! Property tests of the inbox against the reference model, with proptest's shrinking: random
//! histories of small domains run through the real SQLite inbox (a fresh file per case), every
//! verdict and every stored state compared with the model's. A failure is shrunk to a short
//! history and its seed kept in `tests/properties.proptest-regressions`.

use lab_testkit::simulate::history::{Delivery, DoorKind, Shape, Step, aggregate_ids, value_of};
use lab_testkit::simulate::run::{Runner, System};
use lab_testkit::simulate::system::{Backend, Direct};
use proptest::prelude::*;

fn delivery(door: DoorKind) -> impl Strategy<Value = Delivery> {
    (0..2usize, 1..7i64, 0..3u8, prop::bool::weighted(0.1)).prop_map(
        move |(aggregate, sequence, variant, tampered)| {
            let aggregate_id = aggregate_ids(&Shape::default())[aggregate].clone();
            Delivery {
                door,
                producer: None,
                stale_epoch: false,
                epoch: 0,
                value: value_of(door, sequence, variant, tampered),
                message_id: format!("{aggregate_id}-{sequence}-{variant}"),
                aggregate_id,
                sequence,
            }
        },
    )
}

fn step(door: DoorKind) -> impl Strategy<Value = Step> {
    prop_oneof![
        7 => delivery(door).prop_map(Step::Deliver),
        1 => prop::collection::vec(delivery(door), 2..5).prop_map(Step::Batch),
        2 => (0..2usize, prop::bool::ANY, prop::bool::weighted(0.25)).prop_map(
            |(aggregate, replace, stale)| Step::Resolve {
                aggregate_id: aggregate_ids(&Shape::default())[aggregate].clone(),
                replace,
                stale,
            }
        ),
    ]
}

fn history() -> impl Strategy<Value = Vec<Step>> {
    prop_oneof![Just(DoorKind::General), Just(DoorKind::Broker)]
        .prop_flat_map(|door| prop::collection::vec(step(door), 1..40))
}

async fn agrees(history: Vec<Step>) -> Result<(), TestCaseError> {
    let directory = tempfile::tempdir().expect("a directory");
    let backend = Backend::Sqlite(directory.path().join("inbox.db"));
    let direct = Direct::open(&backend).await.map_err(TestCaseError::fail)?;
    let mut system = System::Direct(Box::new(direct));
    let runner = Runner {
        namespace: String::new(),
        atomic_batches: true,
        aggregates: aggregate_ids(&Shape::default()),
    };
    let result = runner.run(&mut system, &history).await;
    system.close().await.map_err(TestCaseError::fail)?;
    result
        .map(|_| ())
        .map_err(|divergence| TestCaseError::fail(divergence.to_string()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_history_is_answered_and_stored_as_the_reference_model_says(history in history()) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(agrees(history))?;
    }
}
