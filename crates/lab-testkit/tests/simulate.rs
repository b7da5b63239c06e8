//! The simulator's fixed budget in the test command: seeded histories against the real inbox
//! and the reference model, on SQLite (with crashes of the hosting process) and on PostgreSQL.

use std::path::PathBuf;

use lab_testkit::simulate::campaign::{self, Campaign, Report, Store};
use lab_testkit::simulate::history::{self, Shape, Step};
use lab_testkit::simulate::host::HostProgram;
use lab_testkit::simulate::run::{Ran, Runner, System};
use lab_testkit::simulate::system::{Backend, Direct};

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
    assert!(
        report.faults.stale_transfers > 0 && report.faults.crashed_transfers > 0,
        "transfers were drawn, stale ones and ones with a crash around them: {report:?}"
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

/// The transfers of the first `seeds` seeds' histories, run against the real inbox (SQLite, no crashes) and
/// the model, summed.
async fn transfers_over_seeds(seeds: u64) -> (Ran, u64) {
    let directory = tempfile::tempdir().expect("a directory");
    let backend = Backend::Sqlite(directory.path().join("transfers.db"));
    let direct = Direct::open(&backend).await.expect("an inbox");
    let mut system = System::Direct(Box::new(direct));
    let shape = Shape::default();
    let (mut total, mut histories) = (Ran::default(), 0);
    for seed in 1..=seeds {
        let history = history::generate(seed, &shape);
        if !history.iter().any(|s| matches!(s, Step::Transfer { .. })) {
            continue;
        }
        histories += 1;
        let runner = Runner {
            namespace: format!("s{seed}-"),
            atomic_batches: true,
            aggregates: history::aggregate_ids(&shape),
        };
        let ran = runner
            .run(&mut system, &history)
            .await
            .unwrap_or_else(|divergence| panic!("seed {seed} diverged: {divergence}"));
        total.transfers += ran.transfers;
        total.transferred += ran.transferred;
        total.old_owner_refused += ran.old_owner_refused;
    }
    system.close().await.expect("the inbox closed");
    (total, histories)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_are_recorded_and_refused_and_the_old_owner_is_then_refused() {
    let (ran, histories) = transfers_over_seeds(300).await;
    eprintln!("{histories} histories with transfers: {ran:?}");
    assert!(histories > 0, "some histories draw transfers");
    assert!(ran.transferred > 0, "some transfers were recorded: {ran:?}");
    assert!(
        ran.transfers > ran.transferred,
        "some transfers were refused: {ran:?}"
    );
    assert!(
        ran.old_owner_refused > 0,
        "a transfer's old owner delivered again and was refused: {ran:?}"
    );
}
