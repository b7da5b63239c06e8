//! The simulator's fixed budget in the test command: seeded histories against the real inbox
//! and the reference model, on SQLite (with crashes of the hosting process) and on PostgreSQL.

use std::path::PathBuf;

use lab_testkit::simulate::campaign::{self, Campaign, Report, Store};
use lab_testkit::simulate::history::{self, Shape};
use lab_testkit::simulate::host::HostProgram;

fn host() -> HostProgram {
    HostProgram {
        program: PathBuf::from(env!("CARGO_BIN_EXE_sim-host")),
        arguments: Vec::new(),
    }
}

fn campaign(store: Store, seeds: u64, crash_every: u64) -> Campaign {
    Campaign {
        first_seed: 1,
        seeds,
        store,
        shape: Shape::default(),
        crash_every,
        host: Some(host()),
        workers: 2,
        progress: false,
    }
}

fn clean(report: &Report) {
    assert!(
        report.failures.is_empty(),
        "the inbox diverged from the model: {:#?}",
        report.failures
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_seeded_histories_on_sqlite_agree_with_the_model_through_crashes() {
    let directory = tempfile::tempdir().expect("a directory");
    let report = campaign::run(campaign(
        Store::Sqlite(directory.path().to_owned()),
        1000,
        20,
    ))
    .await
    .expect("the campaign ran");
    clean(&report);
    assert_eq!(report.seeds_run, 1000);
    assert!(report.crashes >= 50, "crashes were injected: {report:?}");
    assert!(
        report.faults.poison > 1000 && report.faults.stale_resolutions > 100,
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_histories_on_postgresql_agree_with_the_model_through_crashes() {
    let cluster =
        lab_testkit::pg::PrivateCluster::start(lab_testkit::pg::ClusterOptions::for_tests())
            .expect("a private PostgreSQL (Debian package postgresql)");
    let url = cluster.create_database("simulate").expect("a database");
    let report = campaign::run(campaign(Store::Postgres(url), 150, 15))
        .await
        .expect("the campaign ran");
    clean(&report);
    assert!(report.crashes >= 10, "crashes were injected: {report:?}");
}

#[tokio::test]
async fn the_same_seeds_give_the_same_report_timings_aside() {
    let run = || async {
        let directory = tempfile::tempdir().expect("a directory");
        let mut report = campaign::run(Campaign {
            workers: 1,
            ..campaign(Store::Sqlite(directory.path().to_owned()), 40, 10)
        })
        .await
        .expect("the campaign ran");
        report.seconds = 0.0;
        serde_json::to_value(&report).expect("json")
    };
    assert_eq!(run().await, run().await);
}

#[test]
fn a_history_is_a_pure_function_of_its_seed() {
    let shape = Shape {
        crashes: true,
        ..Shape::default()
    };
    assert_eq!(history::generate(42, &shape), history::generate(42, &shape));
    assert_ne!(history::generate(42, &shape), history::generate(43, &shape));
}
