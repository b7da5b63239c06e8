//! The checker on hand-made histories: a clean one passes, and each kind of violation is found.

use serde_json::json;

use super::*;
use crate::chaos::history::{Door, Event, FaultWindow, Operation, Outcome, OutputRead, Session};

fn op(id: u64, sequence: i64, door: Door, outcome: Outcome) -> Operation {
    Operation {
        id,
        producer: "p0".to_owned(),
        door,
        gate: (door == Door::Https).then_some(0),
        epoch: 1,
        aggregate: "a".to_owned(),
        sequence,
        message_id: format!("a-m{sequence}"),
        message_type: "order.placed".to_owned(),
        payload: json!({"orderId": "a", "amount": sequence * 10}),
        invoked_ms: 100 * id,
        completed_ms: 100 * id + 20,
        outcome,
        detail: String::new(),
    }
}

fn read(phase: ReadPhase, stream_sequence: u64, sequence: i64) -> OutputRead {
    OutputRead {
        phase,
        stream_sequence,
        nats_message_id: format!("a:{sequence}"),
        aggregate: "a".to_owned(),
        sequence,
        message_id: format!("a-m{sequence}"),
        message_type: "order.placed".to_owned(),
        payload: json!({"orderId": "a", "amount": sequence * 10}),
        at_ms: 10_000 + stream_sequence,
    }
}

fn session(epoch: Option<i64>) -> Event {
    Event::Session(Session {
        producer: "p0".to_owned(),
        epoch,
        invoked_ms: 0,
        completed_ms: 1,
    })
}

/// Three messages acknowledged (two over HTTPS, one by a PubAck) and the output holding each
/// once, in order, read live and at the end.
fn clean() -> Vec<Event> {
    let mut events = vec![session(Some(1))];
    events.push(Event::Op(op(1, 1, Door::Https, Outcome::Ok)));
    events.push(Event::Op(op(2, 2, Door::Nats, Outcome::Ok)));
    events.push(Event::Op(op(3, 3, Door::Https, Outcome::Fail)));
    events.push(Event::Op(op(4, 3, Door::Https, Outcome::Ok)));
    for sequence in 1..=3 {
        events.push(Event::Read(read(
            ReadPhase::Live,
            sequence as u64,
            sequence,
        )));
        events.push(Event::Read(read(
            ReadPhase::Final,
            sequence as u64,
            sequence,
        )));
    }
    events
}

fn kinds(events: &[Event]) -> Vec<(ViolationKind, i64)> {
    check(events)
        .violations
        .iter()
        .map(|violation| (violation.kind, violation.sequence))
        .collect()
}

fn without_final_read_of(events: Vec<Event>, sequence: i64) -> Vec<Event> {
    events
        .into_iter()
        .filter(|event| {
            !matches!(event, Event::Read(read)
                if read.phase == ReadPhase::Final && read.sequence == sequence)
        })
        .collect()
}

#[test]
fn a_history_whose_output_holds_every_acknowledged_message_once_in_order_passes() {
    let verdict = check(&clean());
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    assert_eq!(verdict.totals.must_appear, 3);
    assert_eq!(verdict.totals.output_messages, 3);
    assert_eq!((verdict.totals.ok, verdict.totals.fail), (3, 1));
}

#[test]
fn an_acknowledged_message_missing_from_the_end_of_the_output_is_lost() {
    let events = clean()
        .into_iter()
        .filter(|event| !matches!(event, Event::Read(read) if read.sequence == 3))
        .collect::<Vec<_>>();
    assert_eq!(kinds(&events), [(ViolationKind::Lost, 3)]);
}

#[test]
fn a_pub_ack_under_an_epoch_its_producer_replaced_need_not_appear() {
    let mut events = without_final_read_of(clean(), 3);
    events.retain(|event| !matches!(event, Event::Read(read) if read.sequence == 3));
    events.retain(|event| !matches!(event, Event::Op(op) if op.sequence == 3));
    let mut published = op(5, 3, Door::Nats, Outcome::Ok);
    published.epoch = 1;
    events.push(Event::Op(published));
    assert_eq!(kinds(&events), [(ViolationKind::Lost, 3)]);
    events.push(session(Some(2)));
    assert!(kinds(&events).is_empty());
}

#[test]
fn a_sequence_twice_in_the_output_is_a_duplicate_even_with_the_same_message() {
    let mut events = clean();
    events.push(Event::Read(read(ReadPhase::Final, 4, 3)));
    assert_eq!(kinds(&events), [(ViolationKind::Duplicate, 3)]);
}

#[test]
fn a_sequence_after_a_higher_one_is_reordered() {
    let mut events = without_final_read_of(clean(), 2);
    events.push(Event::Read(read(ReadPhase::Final, 4, 2)));
    // Stream sequence 2 is gone too: the live read of it is lost.
    assert_eq!(
        kinds(&events),
        [
            (ViolationKind::Reordered, 2),
            (ViolationKind::LiveReadLost, 2)
        ]
    );
}

#[test]
fn a_hole_below_the_highest_sequence_is_a_gap() {
    let mut events = clean();
    events.retain(|event| !matches!(event, Event::Read(read) if read.sequence == 2));
    events.retain(|event| !matches!(event, Event::Op(op) if op.sequence == 2));
    events.push(Event::Op(op(6, 2, Door::Nats, Outcome::Indeterminate)));
    assert_eq!(kinds(&events), [(ViolationKind::Gap, 2)]);
}

#[test]
fn an_output_message_whose_every_send_was_refused_is_a_phantom() {
    let mut events = clean();
    events.push(Event::Op(op(7, 4, Door::Https, Outcome::Fail)));
    events.push(Event::Read(read(ReadPhase::Final, 4, 4)));
    assert_eq!(kinds(&events), [(ViolationKind::Phantom, 4)]);
    // Left indeterminate instead, it may well have been applied.
    let mut events = clean();
    events.push(Event::Op(op(7, 4, Door::Https, Outcome::Indeterminate)));
    events.push(Event::Read(read(ReadPhase::Final, 4, 4)));
    assert!(kinds(&events).is_empty());
}

#[test]
fn an_output_message_nobody_sent_is_a_phantom() {
    let mut events = clean();
    events.push(Event::Read(read(ReadPhase::Final, 4, 4)));
    assert_eq!(kinds(&events), [(ViolationKind::Phantom, 4)]);
}

#[test]
fn another_payload_at_a_sequence_is_wrong_content() {
    let mut events = without_final_read_of(clean(), 3);
    let mut changed = read(ReadPhase::Final, 3, 3);
    changed.payload = json!({"orderId": "a", "amount": 31});
    events.push(Event::Read(changed));
    let found = kinds(&events);
    assert!(
        found.contains(&(ViolationKind::WrongContent, 3)),
        "{found:?}"
    );
}

#[test]
fn a_skip_marker_in_place_of_an_acknowledged_message_is_a_loss() {
    let mut events = without_final_read_of(clean(), 3);
    let mut marker = read(ReadPhase::Final, 3, 3);
    marker.message_type = SKIP_MARKER.to_owned();
    marker.message_id = "skip:1:3".to_owned();
    events.push(Event::Read(marker));
    let found = kinds(&events);
    assert!(found.contains(&(ViolationKind::Lost, 3)), "{found:?}");
    assert_eq!(
        found
            .iter()
            .filter(|(kind, _)| *kind == ViolationKind::Lost)
            .count(),
        1
    );
}

#[test]
fn a_message_read_live_and_gone_at_the_end_is_a_lost_live_read() {
    let mut events = without_final_read_of(clean(), 3);
    events.retain(|event| !matches!(event, Event::Op(op) if op.sequence == 3));
    events.push(Event::Op(op(8, 3, Door::Nats, Outcome::Indeterminate)));
    assert_eq!(kinds(&events), [(ViolationKind::LiveReadLost, 3)]);
}

#[test]
fn operations_count_in_the_windows_they_were_invoked_in_and_after() {
    let mut events = clean();
    events.push(Event::Fault(FaultWindow {
        id: 0,
        kind: "pause gate".to_owned(),
        target: "gate 0".to_owned(),
        start_ms: 150,
        end_ms: 350,
        breaks_liveness: false,
    }));
    let verdict = check(&events);
    let row = |window: &str| {
        verdict
            .availability
            .iter()
            .find(|row| row.window == window)
            .cloned()
            .unwrap_or_default()
    };
    // Ops 2 and 3 were invoked at 200 and 300 ms, op 4 at 400 ms, op 1 at 100 ms.
    assert_eq!(
        (
            row("during pause gate").operations,
            row("during pause gate").fail
        ),
        (2, 1)
    );
    assert_eq!(row("after pause gate").operations, 1);
    assert_eq!(row("calm").operations, 1);
    assert_eq!(row("calm").ok_p50_ms, 20);
}
