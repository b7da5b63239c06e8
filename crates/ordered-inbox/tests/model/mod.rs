//! The reference model: the inbox's observable rules written out once, plainly, with no code of
//! the library's decisions. Per message id: what it was recorded as, with its aggregate,
//! sequence and value (identity is global and never changes meaning). Per aggregate: the last
//! applied sequence, what applied in order, the open dead letters and the held messages.
//!
//! The rules, in the order they are asked:
//! 1. A known id with the same aggregate, sequence and value: an applied one is a replay, a
//!    dead letter is quarantined again, a held one is held again. With other content: a payload
//!    conflict.
//! 2. A new id behind the position is stale. Ahead of it: a gap on the general door; on the
//!    broker door it is held, unless another id is held at that sequence (stale: the first
//!    held wins).
//! 3. At the expected sequence: a negative value is quarantined (a new open dead letter, the
//!    position stays); any other applies, supersedes the open dead letters there, and then the
//!    held messages that are next apply (or the first poison among them is quarantined).
//! 4. An operator resolves an open dead letter at the expected sequence only, and only when
//!    `expectedLast` is the position: a skip takes the sequence with no effect, a replacement
//!    applies a new id there; either supersedes the others there and drains the held ones.

use std::collections::BTreeMap;

use ordered_inbox::resolution::{Action, ResolutionRequest};
use ordered_inbox::{Door, OrderedMessage};
use serde_json::json;

use super::AGGREGATES;

/// One step of a history.
#[derive(Debug, Clone)]
pub enum Op {
    /// Delivers message `{aggregate}-{sequence}-{variant}`; variant 2 is poison; `tampered`
    /// changes its value (the same id with other content).
    Deliver {
        aggregate: usize,
        sequence: i64,
        variant: u8,
        tampered: bool,
    },
    /// An operator resolves the aggregate's first open dead letter (by id), or one that does
    /// not exist when none is open; `stale`: with an `expectedLast` that is not the position.
    Resolve {
        aggregate: usize,
        replace: bool,
        stale: bool,
    },
}

/// A verdict, as the model and the inbox both give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Applied(i64),
    Replay,
    Conflict,
    Gap(i64),
    Stale(i64),
    Quarantined(i64),
    Held { repeated: bool },
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Applied,
    DeadLetter,
    Held,
}

#[derive(Debug, Clone)]
struct Known {
    kind: Kind,
    aggregate: String,
    sequence: i64,
    value: i64,
}

#[derive(Debug, Default)]
struct Aggregate {
    last: i64,
    applied: Vec<(i64, String)>,
    /// Open dead letters: id and sequence.
    open: BTreeMap<String, i64>,
    /// Held messages by sequence: id and value.
    held: BTreeMap<i64, (String, i64)>,
}

#[derive(Debug, Default)]
pub struct Model {
    known: BTreeMap<String, Known>,
    aggregates: BTreeMap<String, Aggregate>,
}

fn value_of(variant: u8, tampered: bool) -> i64 {
    match (variant, tampered) {
        (_, true) => 7,
        (2, false) => -1,
        (variant, false) => i64::from(variant) + 1,
    }
}

impl Model {
    /// The message a delivery step sends.
    pub fn message(&self, op: &Op) -> OrderedMessage {
        let Op::Deliver {
            aggregate,
            sequence,
            variant,
            tampered,
        } = op
        else {
            unreachable!("only deliveries carry a message");
        };
        let aggregate = AGGREGATES[*aggregate];
        OrderedMessage {
            message_id: format!("{aggregate}-{sequence}-{variant}"),
            aggregate_id: aggregate.to_owned(),
            sequence: *sequence,
            payload: json!({ "v": value_of(*variant, *tampered) }),
        }
    }

    pub fn deliver(&mut self, message: &OrderedMessage, door: Door) -> Verdict {
        let value = message.payload["v"].as_i64().unwrap_or(-1);
        let id = &message.message_id;
        if let Some(known) = self.known.get(id) {
            let same = known.aggregate == message.aggregate_id
                && known.sequence == message.sequence
                && known.value == value;
            let expected = self.expected(&message.aggregate_id);
            return match (same, known.kind) {
                (false, _) => Verdict::Conflict,
                (true, Kind::Applied) => Verdict::Replay,
                (true, Kind::DeadLetter) => Verdict::Quarantined(expected),
                (true, Kind::Held) => Verdict::Held { repeated: true },
            };
        }
        let expected = self.expected(&message.aggregate_id);
        if message.sequence < expected {
            return Verdict::Stale(expected);
        }
        if message.sequence > expected {
            if door != Door::Broker {
                return Verdict::Gap(expected);
            }
            return self.hold(message, value, expected);
        }
        if value < 0 {
            self.quarantine(&message.aggregate_id, id, message.sequence, value);
            return Verdict::Quarantined(expected);
        }
        self.apply(&message.aggregate_id, id, message.sequence, value);
        self.drain(&message.aggregate_id);
        Verdict::Applied(message.sequence)
    }

    /// The operator's request for this step, and whether the model says it resolves.
    pub fn resolution(
        &mut self,
        aggregate: usize,
        replace: bool,
        stale: bool,
        step: usize,
    ) -> (ResolutionRequest, bool) {
        let aggregate_id = AGGREGATES[aggregate].to_owned();
        let state = self.aggregates.entry(aggregate_id.clone()).or_default();
        let last = state.last;
        let target = state.open.iter().next().map(|(id, seq)| (id.clone(), *seq));
        let replacement_id = format!("r-{step}");
        let action = if replace {
            Action::Replace {
                message_id: replacement_id.clone(),
                payload: json!({ "v": 5 }),
            }
        } else {
            Action::Skip
        };
        let request = ResolutionRequest {
            producer: None,
            dead_letter_id: target
                .as_ref()
                .map_or_else(|| format!("none-{step}"), |(id, _)| id.clone()),
            operator: "alice".to_owned(),
            action,
            expected_last: if stale { last + 1 } else { last },
            reason: "the model's operator".to_owned(),
        };
        let Some((_, sequence)) = target.filter(|_| !stale) else {
            return (request, false);
        };
        if replace {
            self.apply(&aggregate_id, &replacement_id, sequence, 5);
        } else {
            self.take(&aggregate_id, sequence);
        }
        self.drain(&aggregate_id);
        (request, true)
    }

    /// The aggregate's position, held sequences and open dead letters (ids, sorted).
    pub fn state(&self, aggregate_id: &str) -> (i64, Vec<i64>, Vec<String>) {
        match self.aggregates.get(aggregate_id) {
            Some(a) => (
                a.last,
                a.held.keys().copied().collect(),
                a.open.keys().cloned().collect(),
            ),
            None => (0, Vec::new(), Vec::new()),
        }
    }

    /// What applied to the aggregate, in sequence order, with the ids.
    pub fn applied(&self, aggregate_id: &str) -> Vec<(i64, String)> {
        self.aggregates
            .get(aggregate_id)
            .map(|a| a.applied.clone())
            .unwrap_or_default()
    }

    fn expected(&self, aggregate_id: &str) -> i64 {
        self.aggregates.get(aggregate_id).map_or(0, |a| a.last) + 1
    }

    fn hold(&mut self, message: &OrderedMessage, value: i64, expected: i64) -> Verdict {
        let state = self
            .aggregates
            .entry(message.aggregate_id.clone())
            .or_default();
        if state.held.contains_key(&message.sequence) {
            return Verdict::Stale(expected);
        }
        state
            .held
            .insert(message.sequence, (message.message_id.clone(), value));
        self.remember(Kind::Held, message, value);
        Verdict::Held { repeated: false }
    }

    fn remember(&mut self, kind: Kind, message: &OrderedMessage, value: i64) {
        self.known.insert(
            message.message_id.clone(),
            Known {
                kind,
                aggregate: message.aggregate_id.clone(),
                sequence: message.sequence,
                value,
            },
        );
    }

    fn record(&mut self, kind: Kind, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        self.known.insert(
            id.to_owned(),
            Known {
                kind,
                aggregate: aggregate_id.to_owned(),
                sequence,
                value,
            },
        );
    }

    fn quarantine(&mut self, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.open.insert(id.to_owned(), sequence);
        self.record(Kind::DeadLetter, aggregate_id, id, sequence, value);
    }

    /// Applies `id` at `sequence` (the expected one).
    fn apply(&mut self, aggregate_id: &str, id: &str, sequence: i64, value: i64) {
        self.take(aggregate_id, sequence);
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.applied.push((sequence, id.to_owned()));
        self.record(Kind::Applied, aggregate_id, id, sequence, value);
    }

    /// Moves the position to `sequence`; the open dead letters there are superseded.
    fn take(&mut self, aggregate_id: &str, sequence: i64) {
        let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
        state.last = sequence;
        state.open.retain(|_, at| *at != sequence);
    }

    /// Applies the held messages that are next, in order; a poison among them is quarantined
    /// and stops the drain.
    fn drain(&mut self, aggregate_id: &str) {
        loop {
            let state = self.aggregates.entry(aggregate_id.to_owned()).or_default();
            let next = state.last + 1;
            let Some((id, value)) = state.held.remove(&next) else {
                return;
            };
            if value < 0 {
                self.quarantine(aggregate_id, &id, next, value);
                return;
            }
            self.apply(aggregate_id, &id, next, value);
        }
    }
}
