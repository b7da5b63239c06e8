//! The campaign's checker: what the gate promises, written out again from the history alone.
//! It shares no code with the gate or the inbox; it knows only the output's wire format
//! (`{"aggregateId","sequence","messageId","type","payload"}`, skipped sequences as
//! `gate.skipped`) and what each producer sent.
//!
//! Per aggregate, the output stream read in full at the end must be exactly its sequences
//! `1..=n` in stream order, each once, each an applied message or a skip marker. Every
//! acknowledged input (an HTTPS 200, or a JetStream PubAck of a new message under an epoch its
//! producer never replaced) appears once with its payload; no output message lacks an input
//! that was acknowledged or left indeterminate; everything read live is still there at the end.
//! Availability: each operation counted in the fault windows it was invoked in, in the few
//! seconds after one, or in calm.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::history::{Door, Event, FaultWindow, Operation, Outcome, OutputRead, ReadPhase};

/// The output type of a sequence an operator skipped.
pub const SKIP_MARKER: &str = "gate.skipped";
/// How long after a fault's end an operation still counts as "after" it.
pub const AFTER_MS: u64 = 5_000;

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ViolationKind {
    /// An acknowledged input is not in the output (or a skip marker took its place).
    Lost,
    /// A sequence appears more than once in the output.
    Duplicate,
    /// A sequence appears after a higher one of its aggregate.
    Reordered,
    /// A sequence below the aggregate's highest in the output is missing.
    Gap,
    /// An output message no acknowledged or indeterminate input delivered.
    Phantom,
    /// The output at a sequence is another message than the one its producer sent there.
    WrongContent,
    /// A message read live from the output stream is no longer there (or changed) at the end.
    LiveReadLost,
}

impl ViolationKind {
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::Lost => "lost",
            ViolationKind::Duplicate => "duplicate",
            ViolationKind::Reordered => "reordered",
            ViolationKind::Gap => "gap",
            ViolationKind::Phantom => "phantom",
            ViolationKind::WrongContent => "wrong content",
            ViolationKind::LiveReadLost => "live read lost",
        }
    }
}

/// One violation, with the time span of the operations it is about (for the schedule of the
/// faults around it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Violation {
    pub kind: ViolationKind,
    pub aggregate: String,
    pub sequence: i64,
    pub detail: String,
    /// From the first invocation to the last completion of the operations that sent this
    /// message (and the live read of it, if any).
    pub window_ms: Option<(u64, u64)>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} sequence {}: {}",
            self.kind.name(),
            self.aggregate,
            self.sequence,
            self.detail
        )?;
        if let Some((from, to)) = self.window_ms {
            write!(f, " (operations from {from} ms to {to} ms)")?;
        }
        Ok(())
    }
}

/// Operations counted in one kind of window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Availability {
    /// `during KIND`, `after KIND` or `calm`.
    pub window: String,
    pub operations: u64,
    pub ok: u64,
    pub fail: u64,
    pub indeterminate: u64,
    /// Latency of the acknowledged ones, in ms.
    pub ok_p50_ms: u64,
    pub ok_p99_ms: u64,
    pub ok_max_ms: u64,
}

impl Availability {
    /// The share of operations acknowledged.
    pub fn ok_ratio(&self) -> f64 {
        self.ok as f64 / self.operations.max(1) as f64
    }
}

/// Totals of a history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Totals {
    pub operations: u64,
    pub ok: u64,
    pub fail: u64,
    pub indeterminate: u64,
    pub https: u64,
    pub nats: u64,
    pub sessions: u64,
    pub notices: u64,
    /// Distinct messages that had to appear in the output.
    pub must_appear: u64,
    pub aggregates: u64,
    pub output_messages: u64,
    pub skip_markers: u64,
    pub live_reads: u64,
    pub faults: u64,
}

/// What the checker found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    pub violations: Vec<Violation>,
    pub availability: Vec<Availability>,
    pub totals: Totals,
}

/// The content a producer sent at one sequence.
#[derive(Debug, Clone, PartialEq)]
struct Sent<'a> {
    message_id: &'a str,
    message_type: &'a str,
    payload: &'a Value,
}

/// Everything sent at one (aggregate, sequence).
#[derive(Default)]
struct Slot<'a> {
    operations: Vec<&'a Operation>,
}

impl<'a> Slot<'a> {
    fn window(&self) -> Option<(u64, u64)> {
        let from = self.operations.iter().map(|op| op.invoked_ms).min()?;
        let to = self.operations.iter().map(|op| op.completed_ms).max()?;
        Some((from, to))
    }

    fn sent(op: &'a Operation) -> Sent<'a> {
        Sent {
            message_id: &op.message_id,
            message_type: &op.message_type,
            payload: &op.payload,
        }
    }
}

/// Checks a whole history.
pub fn check(events: &[Event]) -> Verdict {
    let mut verdict = Verdict::default();
    let mut operations = Vec::new();
    let mut faults = Vec::new();
    let mut final_reads = Vec::new();
    let mut live_reads = Vec::new();
    // Per producer, the epochs of its sessions (None: asked, no answer).
    let mut sessions: HashMap<&str, Vec<Option<i64>>> = HashMap::new();
    for event in events {
        match event {
            Event::Op(op) => operations.push(op),
            Event::Session(session) => {
                verdict.totals.sessions += 1;
                sessions
                    .entry(session.producer.as_str())
                    .or_default()
                    .push(session.epoch);
            }
            Event::Fault(fault) => faults.push(fault),
            Event::Read(read) if read.phase == ReadPhase::Final => final_reads.push(read),
            Event::Read(read) => live_reads.push(read),
            Event::Notice(_) => verdict.totals.notices += 1,
        }
    }
    count_operations(&operations, &mut verdict.totals);
    verdict.totals.faults = faults.len() as u64;
    verdict.totals.live_reads = live_reads.len() as u64;
    verdict.totals.output_messages = final_reads.len() as u64;
    verdict.totals.skip_markers = final_reads
        .iter()
        .filter(|read| read.message_type == SKIP_MARKER)
        .count() as u64;

    let mut slots: BTreeMap<(&str, i64), Slot> = BTreeMap::new();
    for op in &operations {
        slots
            .entry((op.aggregate.as_str(), op.sequence))
            .or_default()
            .operations
            .push(op);
    }
    let superseded = |op: &Operation| {
        sessions.get(op.producer.as_str()).is_some_and(|epochs| {
            epochs
                .iter()
                .any(|epoch| epoch.is_none_or(|epoch| epoch > op.epoch))
        })
    };
    let must_appear: BTreeSet<(&str, i64)> = slots
        .iter()
        .filter(|(_, slot)| {
            slot.operations
                .iter()
                .any(|op| op.outcome == Outcome::Ok && (op.door == Door::Https || !superseded(op)))
        })
        .map(|(key, _)| *key)
        .collect();
    verdict.totals.must_appear = must_appear.len() as u64;

    let mut by_aggregate: BTreeMap<&str, Vec<&OutputRead>> = BTreeMap::new();
    for read in &final_reads {
        by_aggregate
            .entry(read.aggregate.as_str())
            .or_default()
            .push(read);
    }
    let aggregates: BTreeSet<&str> = slots
        .keys()
        .map(|(aggregate, _)| *aggregate)
        .chain(by_aggregate.keys().copied())
        .collect();
    verdict.totals.aggregates = aggregates.len() as u64;

    let mut live_times: HashMap<(&str, i64), (u64, u64)> = HashMap::new();
    for read in &live_reads {
        let span = live_times
            .entry((read.aggregate.as_str(), read.sequence))
            .or_insert((read.at_ms, read.at_ms));
        span.0 = span.0.min(read.at_ms);
        span.1 = span.1.max(read.at_ms);
    }
    let mut present: BTreeSet<(&str, i64)> = BTreeSet::new();
    for (aggregate, reads) in &mut by_aggregate {
        reads.sort_by_key(|read| read.stream_sequence);
        let output = AggregateOutput {
            aggregate,
            reads,
            live_times: &live_times,
        };
        check_aggregate_output(&output, &slots, &must_appear, &mut verdict);
        // A skip marker at an acknowledged sequence is reported above, as lost.
        for read in reads.iter() {
            present.insert((aggregate, read.sequence));
        }
    }
    for key in &must_appear {
        if !present.contains(key) {
            let slot = &slots[key];
            let acknowledged: Vec<String> = slot
                .operations
                .iter()
                .filter(|op| op.outcome == Outcome::Ok)
                .map(|op| format!("op {} ({:?}, {})", op.id, op.door, op.detail))
                .collect();
            verdict.violations.push(Violation {
                kind: ViolationKind::Lost,
                aggregate: key.0.to_owned(),
                sequence: key.1,
                detail: format!(
                    "acknowledged by {} but not applied in the output",
                    acknowledged.join(", ")
                ),
                window_ms: slot.window(),
            });
        }
    }
    check_live_reads(&live_reads, &final_reads, &slots, &mut verdict);
    verdict.availability = availability(&operations, &faults);
    verdict.violations.sort_by(|a, b| {
        (a.kind, &a.aggregate, a.sequence).cmp(&(b.kind, &b.aggregate, b.sequence))
    });
    verdict
}

fn count_operations(operations: &[&Operation], totals: &mut Totals) {
    for op in operations {
        totals.operations += 1;
        match op.outcome {
            Outcome::Ok => totals.ok += 1,
            Outcome::Fail => totals.fail += 1,
            Outcome::Indeterminate => totals.indeterminate += 1,
        }
        match op.door {
            Door::Https => totals.https += 1,
            Door::Nats => totals.nats += 1,
        }
    }
}

/// One aggregate's output as read at the end, and when each of its sequences was read live.
struct AggregateOutput<'a> {
    aggregate: &'a str,
    reads: &'a [&'a OutputRead],
    live_times: &'a HashMap<(&'a str, i64), (u64, u64)>,
}

/// The span of `a` and `b` together.
fn union(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> Option<(u64, u64)> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a.0.min(b.0), a.1.max(b.1))),
        (a, b) => a.or(b),
    }
}

/// One aggregate's output in stream order: `1..=n` once each, in order; each message the one
/// its producer sent there, and sent by an operation not refused. A violation's window spans
/// the sends and the live reads of its sequence: a stale copy lands when a fault ends, not
/// when its message was sent.
fn check_aggregate_output(
    output: &AggregateOutput,
    slots: &BTreeMap<(&str, i64), Slot>,
    must_appear: &BTreeSet<(&str, i64)>,
    verdict: &mut Verdict,
) {
    let aggregate = output.aggregate;
    let mut seen: BTreeMap<i64, u64> = BTreeMap::new();
    let mut highest = 0;
    for read in output.reads {
        let slot = slots.get(&(aggregate, read.sequence));
        let window = union(
            slot.and_then(Slot::window),
            output.live_times.get(&(aggregate, read.sequence)).copied(),
        );
        let mut violation = |kind, detail: String| {
            verdict.violations.push(Violation {
                kind,
                aggregate: aggregate.to_owned(),
                sequence: read.sequence,
                detail,
                window_ms: window,
            })
        };
        if let Some(first) = seen.get(&read.sequence) {
            violation(
                ViolationKind::Duplicate,
                format!(
                    "at stream sequences {first} and {} (no de-duplication in the reading)",
                    read.stream_sequence
                ),
            );
            continue;
        }
        if read.sequence < highest {
            violation(
                ViolationKind::Reordered,
                format!(
                    "at stream sequence {}, after sequence {highest}",
                    read.stream_sequence
                ),
            );
        }
        seen.insert(read.sequence, read.stream_sequence);
        highest = highest.max(read.sequence);
        if read.message_type == SKIP_MARKER {
            if must_appear.contains(&(aggregate, read.sequence)) {
                violation(
                    ViolationKind::Lost,
                    "acknowledged, but a skip marker took its place".to_owned(),
                );
            }
            continue;
        }
        let found = Sent {
            message_id: &read.message_id,
            message_type: &read.message_type,
            payload: &read.payload,
        };
        let Some(slot) = slot else {
            violation(
                ViolationKind::Phantom,
                format!("{} was never sent", read.message_id),
            );
            continue;
        };
        let matching: Vec<&&Operation> = slot
            .operations
            .iter()
            .filter(|op| Slot::sent(op) == found)
            .collect();
        if matching.is_empty() {
            let expected = Slot::sent(slot.operations[0]);
            violation(
                ViolationKind::WrongContent,
                format!(
                    "found {} {} {}, sent {} {} {}",
                    found.message_id,
                    found.message_type,
                    found.payload,
                    expected.message_id,
                    expected.message_type,
                    expected.payload
                ),
            );
        } else if matching.iter().all(|op| op.outcome == Outcome::Fail) {
            violation(
                ViolationKind::Phantom,
                format!(
                    "{} in the output, but every send of it was refused",
                    read.message_id
                ),
            );
        }
    }
    for sequence in 1..highest {
        if !seen.contains_key(&sequence) {
            verdict.violations.push(Violation {
                kind: ViolationKind::Gap,
                aggregate: aggregate.to_owned(),
                sequence,
                detail: format!("missing below sequence {highest}"),
                window_ms: slots.get(&(aggregate, sequence)).and_then(Slot::window),
            });
        }
    }
}

/// Everything read live is in the final reading, at the same stream sequence, unchanged.
fn check_live_reads(
    live: &[&OutputRead],
    final_reads: &[&OutputRead],
    slots: &BTreeMap<(&str, i64), Slot>,
    verdict: &mut Verdict,
) {
    let at: HashMap<u64, &OutputRead> = final_reads
        .iter()
        .map(|read| (read.stream_sequence, *read))
        .collect();
    for read in live {
        let same = at.get(&read.stream_sequence).is_some_and(|end| {
            end.aggregate == read.aggregate
                && end.sequence == read.sequence
                && end.message_id == read.message_id
                && end.payload == read.payload
        });
        if !same {
            let window = slots
                .get(&(read.aggregate.as_str(), read.sequence))
                .and_then(Slot::window)
                .map(|(from, to)| (from, to.max(read.at_ms)));
            verdict.violations.push(Violation {
                kind: ViolationKind::LiveReadLost,
                aggregate: read.aggregate.clone(),
                sequence: read.sequence,
                detail: format!(
                    "{} read live at stream sequence {} ({} ms) is not there at the end",
                    read.message_id, read.stream_sequence, read.at_ms
                ),
                window_ms: window,
            });
        }
    }
}

/// Each operation counted under every fault kind whose window it was invoked in, else under
/// every kind it came within [`AFTER_MS`] after, else under calm.
fn availability(operations: &[&Operation], faults: &[&FaultWindow]) -> Vec<Availability> {
    let mut latencies: BTreeMap<String, (Availability, Vec<u64>)> = BTreeMap::new();
    for op in operations {
        let at = op.invoked_ms;
        let during: BTreeSet<&str> = faults
            .iter()
            .filter(|fault| fault.start_ms <= at && at < fault.end_ms)
            .map(|fault| fault.kind.as_str())
            .collect();
        let windows: Vec<String> = if !during.is_empty() {
            during.iter().map(|kind| format!("during {kind}")).collect()
        } else {
            let after: BTreeSet<&str> = faults
                .iter()
                .filter(|fault| fault.end_ms <= at && at < fault.end_ms + AFTER_MS)
                .map(|fault| fault.kind.as_str())
                .collect();
            if after.is_empty() {
                vec!["calm".to_owned()]
            } else {
                after.iter().map(|kind| format!("after {kind}")).collect()
            }
        };
        for window in windows {
            let (row, ok_latencies) = latencies.entry(window.clone()).or_default();
            row.window = window;
            row.operations += 1;
            match op.outcome {
                Outcome::Ok => {
                    row.ok += 1;
                    ok_latencies.push(op.completed_ms.saturating_sub(op.invoked_ms));
                }
                Outcome::Fail => row.fail += 1,
                Outcome::Indeterminate => row.indeterminate += 1,
            }
        }
    }
    latencies
        .into_values()
        .map(|(mut row, mut ok_latencies)| {
            ok_latencies.sort_unstable();
            let quantile = |q: f64| {
                if ok_latencies.is_empty() {
                    0
                } else {
                    let index = ((ok_latencies.len() - 1) as f64 * q).round() as usize;
                    ok_latencies[index]
                }
            };
            row.ok_p50_ms = quantile(0.5);
            row.ok_p99_ms = quantile(0.99);
            row.ok_max_ms = ok_latencies.last().copied().unwrap_or(0);
            row
        })
        .collect()
}
