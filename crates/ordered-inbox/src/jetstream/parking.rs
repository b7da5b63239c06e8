//! Messages the inbox cannot take yet because their aggregate is not ready for them (it holds
//! the most it may, or the message is a gap the inbox does not hold), kept unanswered by the
//! consumer instead of nak'd.
//!
//! A nak with a back-off makes the broker offer the message again later, and JetStream offers
//! redeliveries before new messages: one aggregate's flood of early messages then came back wave
//! after wave ahead of every other aggregate's messages, and once its gap filled it caught up one
//! back-off at a time. A parked message instead waits in the consumer, unanswered (kept alive
//! with progress acks), and goes back into the next batch as soon as its aggregate moves (a
//! message of it applied here), lowest sequence first, or, without a sign of movement (another
//! consumer or an operator moved it), after a back-off of its own. Parking is bounded in messages
//! and bytes; past the bound a message is nak'd as before. A crash loses nothing: an unanswered
//! message is redelivered after the ack wait.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::jetstream;
use tokio::time::Instant;

/// The most messages the consumer parks at once.
pub const MAX_PARKED: usize = 10_000;
/// The most payload bytes the consumer parks at once.
pub const MAX_PARKED_BYTES: usize = 64 * 1024 * 1024;
/// The longest an aggregate's parked messages wait for another try without a sign of movement
/// here (another consumer, the HTTP door or an operator may have moved it).
const MAX_RETRY: Duration = Duration::from_secs(5);

/// The parked messages of every aggregate.
pub(super) struct Parking {
    aggregates: HashMap<String, Parked>,
    messages: usize,
    bytes: usize,
    /// The first wait for another try (the consumer's nak delay).
    first_retry: Duration,
    /// How often a parked message's ack deadline is pushed back (a third of the ack wait).
    refresh_every: Duration,
}

/// One aggregate's parked messages, by sequence (then stream sequence: copies of one sequence
/// are parked side by side).
struct Parked {
    messages: BTreeMap<(i64, u64), ParkedMessage>,
    /// When its lowest messages are tried again without a sign of movement.
    due: Instant,
    retry: Duration,
    /// The sequence it expected when it last answered `hold full` here, until it moves.
    full_before: Option<i64>,
}

struct ParkedMessage {
    message: jetstream::Message,
    /// When the broker last heard of it (parked, or its ack deadline pushed back).
    refreshed: Instant,
}

impl Parking {
    pub(super) fn new(first_retry: Duration, ack_wait: Duration) -> Parking {
        Parking {
            aggregates: HashMap::new(),
            messages: 0,
            bytes: 0,
            first_retry: first_retry.max(Duration::from_millis(10)),
            refresh_every: (ack_wait / 3).max(Duration::from_millis(100)),
        }
    }

    /// Parks `message` of `aggregate` at `sequence`, or hands it back when parking is full.
    pub(super) fn park(
        &mut self,
        aggregate: &str,
        sequence: i64,
        message: jetstream::Message,
    ) -> Result<(), Box<jetstream::Message>> {
        let size = message.payload.len();
        if self.messages >= MAX_PARKED || self.bytes.saturating_add(size) > MAX_PARKED_BYTES {
            return Err(Box::new(message));
        }
        let stream_sequence = message.info().map_or(0, |info| info.stream_sequence);
        let now = Instant::now();
        let first_retry = self.first_retry;
        let parked = self
            .aggregates
            .entry(aggregate.to_owned())
            .or_insert_with(|| Parked {
                messages: BTreeMap::new(),
                due: now + first_retry,
                retry: first_retry,
                full_before: None,
            });
        // The broker last heard of it when it was fetched, or, when it comes back from a try,
        // maybe a whole refresh interval ago: its deadline is pushed back at the next round.
        let refreshed = now.checked_sub(self.refresh_every).unwrap_or(now);
        let replaced = parked.messages.insert(
            (sequence, stream_sequence),
            ParkedMessage { message, refreshed },
        );
        match replaced {
            // The same delivery parked twice cannot happen; a redelivered copy of one stream
            // message replaces the older copy, whose acknowledgement is void.
            Some(old) => self.bytes = self.bytes.saturating_sub(old.message.payload.len()),
            None => self.messages += 1,
        }
        self.bytes += size;
        Ok(())
    }

    /// `aggregate` moved: its parked messages are due at once, and their back-off starts over.
    pub(super) fn moved(&mut self, aggregate: &str) {
        if let Some(parked) = self.aggregates.get_mut(aggregate) {
            parked.due = Instant::now();
            parked.retry = self.first_retry;
            parked.full_before = None;
        }
    }

    /// `aggregate`, which has parked messages, answered `hold full` expecting `expected`.
    pub(super) fn full(&mut self, aggregate: &str, expected: i64) {
        if let Some(parked) = self.aggregates.get_mut(aggregate) {
            parked.full_before = Some(expected);
        }
    }

    /// Whether `aggregate` was full when it last answered here, has not moved since, and
    /// `sequence` lies beyond the one it expects.
    pub(super) fn is_full_before(&self, aggregate: &str, sequence: i64) -> bool {
        self.aggregates
            .get(aggregate)
            .and_then(|parked| parked.full_before)
            .is_some_and(|expected| sequence > expected)
    }

    /// Takes at most `limit` parked messages of the aggregates that are due, each aggregate's
    /// lowest sequences first; an aggregate's next try backs off (doubling, at most 30 s) until
    /// it moves again.
    pub(super) fn take_due(&mut self, limit: usize) -> Vec<jetstream::Message> {
        let now = Instant::now();
        let mut taken = Vec::new();
        for parked in self.aggregates.values_mut() {
            if taken.len() >= limit {
                break;
            }
            if parked.due > now || parked.messages.is_empty() {
                continue;
            }
            while taken.len() < limit {
                let Some((_, lowest)) = parked.messages.pop_first() else {
                    break;
                };
                self.messages -= 1;
                self.bytes = self.bytes.saturating_sub(lowest.message.payload.len());
                taken.push(lowest.message);
            }
            parked.due = now + parked.retry;
            parked.retry = (parked.retry * 2).min(MAX_RETRY);
        }
        self.aggregates
            .retain(|_, parked| !parked.messages.is_empty());
        taken
    }

    /// The parked messages whose ack deadline is due to be pushed back, marked as refreshed.
    pub(super) fn due_for_refresh(&mut self) -> Vec<jetstream::Message> {
        let now = Instant::now();
        let mut due = Vec::new();
        for parked in self.aggregates.values_mut() {
            for entry in parked.messages.values_mut() {
                if now.duration_since(entry.refreshed) >= self.refresh_every {
                    entry.refreshed = now;
                    due.push(entry.message.clone());
                }
            }
        }
        due
    }

    /// Every parked message, parking emptied (the consumer stops: they go back to the broker).
    pub(super) fn drain(&mut self) -> Vec<jetstream::Message> {
        self.messages = 0;
        self.bytes = 0;
        self.aggregates
            .drain()
            .flat_map(|(_, parked)| parked.messages.into_values().map(|entry| entry.message))
            .collect()
    }
}
