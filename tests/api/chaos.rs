//! One seeded chaos campaign (`lab_testkit::chaos`, `production-lab chaos`): the gate's
//! deployment across network namespaces (PostgreSQL with TLS and SCRAM, three NATS nodes with
//! TLS, credentials and `sync_interval: always`, two gates, three producers on hosts of their
//! own) under a minute of partitions, pauses, crashes and restarts drawn from the seed, checked
//! by the campaign's own checker. Needs root and a current nats-server, as `gate_netns` does.

use std::collections::BTreeSet;
use std::time::Duration;

use lab_testkit::chaos::history::read_lines;
use lab_testkit::chaos::nemesis::schedule;
use lab_testkit::chaos::{self, RunOptions};

use crate::helpers::binary;

const DURATION: Duration = Duration::from_secs(60);
const PRODUCERS: usize = 3;

/// The families of faults a schedule has: partitions, pauses, crashes and restarts.
fn families(seed: u64) -> BTreeSet<&'static str> {
    schedule(seed, DURATION, PRODUCERS, false)
        .iter()
        .map(|fault| {
            let name = fault.kind.name();
            if name.starts_with("partition") {
                "partition"
            } else if name.starts_with("pause") {
                "pause"
            } else {
                "crash"
            }
        })
        .collect()
}

#[test]
fn a_seeded_campaign_of_partitions_pauses_and_crashes_leaves_every_acknowledged_message_once_and_in_order()
 {
    // The first seed whose schedule has every family: the schedule is the seed's alone.
    let seed = (1..)
        .find(|seed| families(*seed).len() == 3)
        .expect("a seed with partitions, pauses and crashes");
    let dir = tempfile::tempdir().expect("a temp dir");
    let report = chaos::run(&RunOptions {
        seed,
        duration: DURATION,
        gate_binary: binary().into(),
        producers: PRODUCERS,
        plant: None,
        power_loss: false,
        only_faults: None,
        dir: Some(dir.path().to_owned()),
        verbose: false,
    })
    .unwrap_or_else(|error| panic!("{error}"));
    let rendered = chaos::render(&report);
    assert!(report.passed(), "{rendered}");

    let played: BTreeSet<&str> = report
        .faults
        .iter()
        .map(|fault| fault.kind.name())
        .collect();
    assert!(played.len() >= 4, "several kinds of fault: {rendered}");
    let totals = &report.verdict.totals;
    assert_eq!(
        totals.faults,
        report.faults.len() as u64,
        "every fault played: {rendered}"
    );
    assert!(totals.ok >= 200, "operations acknowledged: {rendered}");
    assert!(
        totals.must_appear >= 100,
        "acknowledged messages checked: {rendered}"
    );
    assert!(
        totals.https > 0 && totals.nats > 0,
        "both doors: {rendered}"
    );
    assert!(totals.output_messages >= totals.must_appear, "{rendered}");
    assert!(totals.live_reads > 0, "the output read live: {rendered}");

    let history = read_lines(&report.history.clone().expect("a history file"))
        .expect("the history reads back");
    assert_eq!(
        lab_testkit::chaos::checker::check(&history),
        report.verdict,
        "the history on disk checks the same"
    );
}
