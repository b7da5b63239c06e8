//! The broker door's ack-after-COMMIT protocol, checked exhaustively for small bounds with
//! `stateright`: every state a small stream can reach through the consumer of
//! `src/broker/mod.rs` (fetch, `deliver_batch`, COMMIT, list the rejections, ack / nak / term by
//! verdict), with the consumer dying at every point of a batch, answers lost, the store and the
//! handler failing, the broker redelivering in any order, and an operator skipping dead
//! letters. The inbox's rules are an abstract model of their own (`protocol/inbox.rs`).
//!
//! Each scenario prints the states it explored. The same checker is then shown to fail: with a
//! protocol bug planted in the model (acking before the COMMIT, acking a `hold full`,
//! terminating before listing) it finds a counterexample, whose path is printed.

mod protocol {
    pub mod inbox;
    pub mod model;
    pub mod properties;
    pub mod reach;
}

use std::io::Write;
use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model, Path};

use protocol::inbox::{Content, Limits, Message};
use protocol::model::{
    Action, Batch, Bug, Commit, Consumer, Faults, Protocol, Scenario, Stage, State,
};
use protocol::properties::*;

const A: usize = 0;
const B: usize = 1;

const fn message(id: &'static str, aggregate: usize, sequence: u8, content: Content) -> Message {
    Message {
        id,
        aggregate,
        sequence,
        content,
    }
}

/// Every fault, once or twice per run.
const FAULTS: Faults = Faults {
    crashes: 2,
    lost_answers: 1,
    store_failures: 1,
    handler_failures: 1,
};

const ROOMY: Limits = Limits {
    held: 8,
    open_dead_letters: 8,
};

/// One aggregate: a poison between two valid messages, the first published twice (past the
/// duplicate window, so the stream has two copies).
fn poison_and_duplicate(commit: Commit) -> Scenario {
    Scenario {
        name: match commit {
            Commit::OnePerBatch => "a poison and a duplicate, one COMMIT per batch",
            Commit::OnePerMessage => "a poison and a duplicate, one COMMIT per message",
        },
        stream: vec![
            message("a-1", A, 1, Content::Valid(5)),
            message("a-2", A, 2, Content::Poison),
            message("a-3", A, 3, Content::Valid(1)),
            message("a-1", A, 1, Content::Valid(5)),
        ],
        aggregates: 1,
        commit,
        batch: 2,
        limits: ROOMY,
        faults: FAULTS,
        shows: &[
            REPLAY_AFTER_COMMIT,
            DRAINED,
            SKIP_DRAINS,
            HELD_AGAIN,
            DEAD_AGAIN,
            HANDLER_FAILED,
        ],
    }
}

/// Two aggregates interleaved in one stream, one message re-published with other content.
fn two_aggregates_and_a_conflict() -> Scenario {
    Scenario {
        name: "two aggregates and a payload conflict",
        stream: vec![
            message("b-2", B, 2, Content::Valid(2)),
            message("a-1", A, 1, Content::Valid(1)),
            message("b-1", B, 1, Content::Valid(1)),
            message("a-2", A, 2, Content::Valid(2)),
            message("b-2", B, 2, Content::Valid(9)),
        ],
        aggregates: 2,
        commit: Commit::OnePerBatch,
        batch: 2,
        limits: ROOMY,
        faults: Faults {
            crashes: 1,
            lost_answers: 1,
            store_failures: 0,
            handler_failures: 0,
        },
        shows: &[REPLAY_AFTER_COMMIT, DRAINED, HELD_AGAIN, CONFLICT],
    }
}

/// Limits of one held message and one open dead letter: a second early message is nak'd, and a
/// second poison at the same sequence waits until the first is skipped, then is stale.
fn limits_of_one() -> Scenario {
    Scenario {
        name: "limits of one",
        stream: vec![
            message("a-1", A, 1, Content::Valid(1)),
            message("p-2", A, 2, Content::Poison),
            message("q-2", A, 2, Content::Poison),
            message("a-3", A, 3, Content::Valid(3)),
            message("a-4", A, 4, Content::Valid(4)),
        ],
        aggregates: 1,
        commit: Commit::OnePerBatch,
        batch: 2,
        limits: Limits {
            held: 1,
            open_dead_letters: 1,
        },
        faults: Faults {
            crashes: 1,
            lost_answers: 1,
            store_failures: 1,
            handler_failures: 0,
        },
        shows: &[HOLD_FULL, QUARANTINE_FULL, STALE, SKIP_DRAINS, DRAINED],
    }
}

/// Checks every state the scenario reaches (or only until there is a discovery for each of
/// the properties `until` names) and prints how many there were.
fn check(protocol: Protocol, until: &[&'static str]) -> impl Checker<Protocol> {
    let name = protocol.scenario.name;
    let bug = protocol.bug;
    let started = Instant::now();
    let builder = protocol.checker().threads(1);
    let checker = if until.is_empty() {
        builder.spawn_bfs().join()
    } else {
        let wanted = until.iter().copied().collect();
        builder
            .finish_when(HasDiscoveries::AllOf(wanted))
            .spawn_bfs()
            .join()
    };
    let _ = writeln!(
        std::io::stderr(),
        "protocol check: {name}{}: {} states explored ({} unique), depth {}, {:.1?}",
        bug.map(|bug| format!(" with {bug:?}")).unwrap_or_default(),
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed(),
    );
    checker
}

/// The whole state space holds every promise, and reaches every case the scenario names.
fn assert_settles(scenario: Scenario) {
    let checker = check(
        Protocol {
            scenario,
            bug: None,
        },
        &[],
    );
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn a_poison_and_a_duplicate_settle_under_every_crash_with_one_commit_per_batch() {
    assert_settles(poison_and_duplicate(Commit::OnePerBatch));
}

#[test]
fn a_poison_and_a_duplicate_settle_under_every_crash_with_one_commit_per_message() {
    assert_settles(poison_and_duplicate(Commit::OnePerMessage));
}

#[test]
fn two_aggregates_and_a_payload_conflict_settle_under_every_crash() {
    assert_settles(two_aggregates_and_a_conflict());
}

#[test]
fn at_limits_of_one_naks_and_terminations_still_settle_every_message() {
    assert_settles(limits_of_one());
}

/// The checker finds a counterexample to each of `properties` in the model with `bug`, and
/// each path prints as the actions that lead there. Returns the paths, in that order.
fn assert_caught(
    scenario: Scenario,
    bug: Bug,
    properties: &[&'static str],
) -> Vec<Path<State, Action>> {
    let protocol = Protocol {
        scenario,
        bug: Some(bug),
    };
    let checker = check(protocol, properties);
    let mut paths = Vec::new();
    for &property in properties {
        let Some(path) = checker.discovery(property) else {
            panic!("{bug:?}: no counterexample to \"{property}\"");
        };
        let printed = path.to_string();
        let _ = writeln!(
            std::io::stderr(),
            "counterexample to \"{property}\" with {bug:?}:\n{printed}"
        );
        assert!(printed.starts_with("Path["), "{printed}");
        assert!(printed.contains("- Fetch"), "{printed}");
        paths.push(path);
    }
    paths
}

#[test]
fn acking_before_the_commit_is_caught_as_an_ack_of_nothing_committed() {
    let paths = assert_caught(
        poison_and_duplicate(Commit::OnePerBatch),
        Bug::AckBeforeCommit,
        &[ACKED_IS_RECORDED],
    );
    let steps = paths[0].clone().into_vec();
    let acked_uncommitted = steps.iter().any(|(state, action)| {
        matches!(action, Some(Action::Answer { lost: false })) && in_transaction(state)
    });
    assert!(
        acked_uncommitted,
        "the counterexample answers inside an uncommitted transaction"
    );
}

fn in_transaction(state: &State) -> bool {
    matches!(
        &state.consumer,
        Consumer::Batch(Batch {
            stage: Stage::Delivering { open: Some(_), .. },
            ..
        })
    )
}

#[test]
fn acking_before_the_commit_and_crashing_is_caught_as_a_run_that_never_settles() {
    let mut scenario = poison_and_duplicate(Commit::OnePerBatch);
    // Without store failures, only a crash can lose the acked work.
    scenario.faults.store_failures = 0;
    let paths = assert_caught(
        scenario,
        Bug::AckBeforeCommit,
        &[QUIESCENT_IS_SETTLED, SETTLED],
    );
    for path in paths {
        assert!(path.into_actions().contains(&Action::Crash));
    }
}

#[test]
fn acking_a_hold_full_is_caught_as_a_message_the_broker_forgot() {
    assert_caught(limits_of_one(), Bug::AckHoldFull, &[ACKED_IS_RECORDED]);
}

#[test]
fn terminating_before_listing_is_caught_as_a_termination_missing_from_the_list() {
    assert_caught(
        two_aggregates_and_a_conflict(),
        Bug::TermBeforeListing,
        &[TERMINATED_IS_LISTED],
    );
}

/// The scenario whose naks can cycle (past the hold limit, past the quarantine limit): no
/// schedule can trap it where nothing settles any more.
#[test]
fn from_every_reachable_state_at_limits_of_one_the_run_can_still_settle() {
    let protocol = Protocol {
        scenario: limits_of_one(),
        bug: None,
    };
    let reach = protocol::reach::explore(&protocol);
    let _ = writeln!(
        std::io::stderr(),
        "protocol check: {}: {} states, each of which can still settle: {}",
        protocol.scenario.name,
        reach.states,
        reach.stuck.is_none()
    );
    assert_eq!(reach.stuck, None);
}
