//! The checker can fail: each known bug, planted alone in the library, is caught by the
//! simulator within a bounded number of seeds, with a shrunk history. One test runs them in
//! turn, since a planted bug is a switch of the whole process.

use lab_testkit::simulate::campaign::{self, Campaign, Store};
use lab_testkit::simulate::history::Shape;
use ordered_inbox::planted::{self, Bug};

/// Seeds each bug must be found within.
const SEEDS: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_planted_bug_is_caught_within_a_bounded_number_of_seeds() {
    let bugs = [
        Bug::AdvanceOnQuarantine,
        Bug::ApplyReplayTwice,
        Bug::DrainOutOfOrder,
        Bug::LoseReplayedUnit,
        Bug::AcceptFencedEpoch,
        Bug::TransferKeepsOldOwner,
    ];
    let mut caught = Vec::new();
    for bug in bugs {
        let directory = tempfile::tempdir().expect("a directory");
        planted::plant(Some(bug));
        let report = campaign::run(Campaign {
            first_seed: 1,
            seeds: SEEDS,
            store: Store::Sqlite(directory.path().to_owned()),
            shape: Shape::default(),
            crash_every: 0,
            host: None,
            workers: 2,
            progress: false,
        })
        .await;
        planted::plant(None);
        let report = report.expect("the campaign ran");
        let first = report
            .failures
            .first()
            .unwrap_or_else(|| panic!("{bug:?} was not caught in {SEEDS} seeds: {report:?}"));
        assert!(
            !first.shrunk.is_empty() && first.shrunk.len() <= 12,
            "{bug:?}: the shrunk history is short: {first:#?}"
        );
        eprintln!(
            "{bug:?}: caught after {} seeds; seed {} shrunk to {} steps: {}",
            report.seeds_run,
            first.seed,
            first.shrunk.len(),
            first.what
        );
        caught.push(bug);
    }
    assert_eq!(caught, bugs);
}
