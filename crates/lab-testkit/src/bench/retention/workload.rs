//! What one consumer of `bench retention` delivers: its share of the aggregates, position by
//! position (every aggregate of the share at its first sequence, then at its second …), cut into
//! batches as a gate's input fetches them. A tenth of the messages arrive one place early: the
//! sequence ending in 6 comes just before the one ending in 5, so it is held, then drained when
//! its predecessor applies, and the aggregate's timeline grows as a gate's does under a broker
//! that does not keep order.

use ordered_inbox::OrderedMessage;
use serde_json::json;

/// One sequence in this many arrives ahead of its turn.
const EARLY_EVERY: u64 = 10;
/// Which one: the sequence `s` with `s % EARLY_EVERY == EARLY_AT` is delivered before `s - 1`.
const EARLY_AT: u64 = 6;

/// The sequence delivered at 0-based `position` of an aggregate that gets `count` messages:
/// `position + 1`, but for the early sequence and its predecessor, which trade places.
pub fn sequence_at(position: u64, count: u64) -> u64 {
    let natural = position + 1;
    if natural % EARLY_EVERY == EARLY_AT - 1 && natural < count {
        natural + 1
    } else if natural % EARLY_EVERY == EARLY_AT {
        natural - 1
    } else {
        natural
    }
}

/// Whether `sequence` arrives ahead of its turn (and is held until its predecessor applies).
pub fn arrives_early(sequence: u64) -> bool {
    sequence % EARLY_EVERY == EARLY_AT
}

/// The messages `bench retention`'s aggregates get: `messages` spread evenly over `aggregates`,
/// as [`super::super::workload`] spreads them.
pub fn aggregate_counts(aggregates: usize, messages: usize) -> Vec<(String, u64)> {
    (0..aggregates)
        .map(|index| {
            let count = messages / aggregates + usize::from(index < messages % aggregates);
            (format!("bench-{index}"), count as u64)
        })
        .collect()
}

/// Message `AGGREGATE-SEQUENCE` as the gate takes it: an envelope of `message_type` around
/// `{"amount": n}`.
pub fn gate_message(aggregate_id: &str, sequence: u64, message_type: &str) -> OrderedMessage {
    OrderedMessage {
        message_id: format!("{aggregate_id}-{sequence}"),
        aggregate_id: aggregate_id.to_owned(),
        sequence: sequence as i64,
        payload: json!({ "type": message_type, "payload": { "amount": sequence % 7 + 1 } }),
    }
}

/// One consumer's aggregates and where it is in them.
#[derive(Debug, Clone)]
pub struct Share {
    aggregates: Vec<(String, u64)>,
    message_type: String,
    position: u64,
    next: usize,
    longest: u64,
}

impl Share {
    /// Consumer `consumer`'s share of `counts`: aggregates `consumer`, `consumer + consumers` ….
    pub fn of(
        counts: &[(String, u64)],
        consumer: usize,
        consumers: usize,
        message_type: &str,
    ) -> Share {
        let aggregates: Vec<(String, u64)> = counts
            .iter()
            .skip(consumer)
            .step_by(consumers.max(1))
            .cloned()
            .collect();
        let longest = aggregates
            .iter()
            .map(|(_, count)| *count)
            .max()
            .unwrap_or(0);
        Share {
            aggregates,
            message_type: message_type.to_owned(),
            position: 0,
            next: 0,
            longest,
        }
    }

    /// The share's messages in all.
    #[cfg(test)]
    fn messages(&self) -> u64 {
        self.aggregates.iter().map(|(_, count)| count).sum()
    }

    /// The next at most `size` messages (none once the share is delivered).
    pub fn next_batch(&mut self, size: usize) -> Vec<OrderedMessage> {
        let mut batch = Vec::with_capacity(size);
        while batch.len() < size && self.position < self.longest {
            let Some((aggregate_id, count)) = self.aggregates.get(self.next) else {
                self.next = 0;
                self.position += 1;
                continue;
            };
            self.next += 1;
            if self.position < *count {
                let sequence = sequence_at(self.position, *count);
                batch.push(gate_message(aggregate_id, sequence, &self.message_type));
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn every_sequence_comes_once_and_only_the_early_ones_come_before_their_predecessor() {
        for count in 1..=27 {
            let order: Vec<u64> = (0..count).map(|p| sequence_at(p, count)).collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (1..=count).collect::<Vec<_>>(), "count {count}");
            for (index, sequence) in order.iter().enumerate() {
                let expected_before = index as u64 + 1;
                if arrives_early(*sequence) {
                    assert_eq!(order.get(index + 1), Some(&(sequence - 1)), "{order:?}");
                } else {
                    assert!(*sequence <= expected_before, "{order:?}");
                }
            }
        }
        assert_eq!(
            (0..7).map(|p| sequence_at(p, 7)).collect::<Vec<_>>(),
            [1, 2, 3, 4, 6, 5, 7]
        );
        assert_eq!(
            (0..5).map(|p| sequence_at(p, 5)).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn the_shares_cover_every_message_once_in_batches_of_the_fetch_size() {
        let counts = aggregate_counts(5, 53);
        assert_eq!(
            counts.iter().map(|(_, c)| *c).collect::<Vec<_>>(),
            [11, 11, 11, 10, 10]
        );
        let mut seen: HashMap<String, Vec<u64>> = HashMap::new();
        for consumer in 0..2 {
            let mut share = Share::of(&counts, consumer, 2, "bench.event");
            let expected = share.messages();
            let mut delivered = 0;
            loop {
                let batch = share.next_batch(4);
                if batch.is_empty() {
                    break;
                }
                assert!(batch.len() <= 4);
                delivered += batch.len() as u64;
                for message in batch {
                    assert_eq!(message.payload["type"], "bench.event");
                    seen.entry(message.aggregate_id.clone())
                        .or_default()
                        .push(message.sequence as u64);
                }
            }
            assert_eq!(delivered, expected);
        }
        for (aggregate_id, count) in &counts {
            let order = &seen[aggregate_id];
            let expected: Vec<u64> = (0..*count).map(|p| sequence_at(p, *count)).collect();
            assert_eq!(order, &expected, "{aggregate_id}");
        }
    }
}
