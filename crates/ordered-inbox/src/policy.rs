//! The ordering decision for one message against one aggregate's last applied sequence.
//!
//! It holds no identity and writes nothing: identity, dead letters and the rows to write are the
//! delivery decision's ([`crate::delivery`]). A quarantine is an observation, never an advance.

use crate::content::{Check, Poison};
use crate::model::OrderedMessage;

/// What to do with a message, given the aggregate's last applied sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It is the next sequence and acceptable: apply it; `last` becomes `sequence`.
    Apply {
        /// The sequence it takes.
        sequence: i64,
    },
    /// It is the next sequence but poison: record it, leave `last` where it is.
    Quarantine {
        /// The sequence it holds.
        expected: i64,
        /// Why it is poison.
        poison: Poison,
    },
    /// A later sequence arrived before its predecessor: `expected` is still required.
    Gap {
        /// The sequence still required.
        expected: i64,
    },
    /// The sequence was already passed.
    Stale {
        /// The sequence the aggregate waits for.
        expected: i64,
    },
}

/// Decides one message. `last` is the aggregate's last applied sequence (0 before any). Only a
/// message at the expected sequence is checked: ordering comes before validity.
pub fn decide(last: i64, message: &OrderedMessage, check: &dyn Check) -> Decision {
    let expected = last.saturating_add(1);
    let sequence = message.sequence;
    if sequence > expected {
        Decision::Gap { expected }
    } else if sequence < expected {
        Decision::Stale { expected }
    } else {
        match check.check(message) {
            Ok(()) => Decision::Apply { sequence },
            Err(poison) => Decision::Quarantine { expected, poison },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The tests' check: an order whose `quantity` is missing or negative is poison.
    pub(crate) struct NoNegativeQuantity;

    impl Check for NoNegativeQuantity {
        fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
            match message.payload["quantity"].as_i64() {
                Some(quantity) if quantity >= 0 => Ok(()),
                _ => Err(Poison::new("negative quantity")),
            }
        }
    }

    pub(crate) fn order(id: &str, sequence: i64, quantity: i64) -> OrderedMessage {
        OrderedMessage {
            message_id: id.into(),
            aggregate_id: "a".into(),
            sequence,
            payload: serde_json::json!({ "quantity": quantity }),
        }
    }

    fn decided(last: i64, sequence: i64, quantity: i64) -> Decision {
        decide(last, &order("m", sequence, quantity), &NoNegativeQuantity)
    }

    #[test]
    fn the_next_valid_sequence_applies() {
        assert_eq!(decided(0, 1, 1), Decision::Apply { sequence: 1 });
        assert_eq!(decided(4, 5, 0), Decision::Apply { sequence: 5 });
    }

    #[test]
    fn gap_reports_the_next_required_sequence() {
        assert_eq!(decided(0, 2, 1), Decision::Gap { expected: 1 });
        assert_eq!(decided(1, 3, 1), Decision::Gap { expected: 2 });
    }

    #[test]
    fn an_old_sequence_is_stale_not_a_gap() {
        assert_eq!(decided(2, 2, 1), Decision::Stale { expected: 3 });
        assert_eq!(decided(2, 1, 1), Decision::Stale { expected: 3 });
    }

    #[test]
    fn a_poison_message_at_the_expected_sequence_is_quarantined_without_advancing() {
        assert_eq!(
            decided(1, 2, -1),
            Decision::Quarantine {
                expected: 2,
                poison: Poison::new("negative quantity")
            }
        );
    }

    #[test]
    fn ordering_is_checked_before_validity() {
        // A poison message that is also out of order reports the ordering problem.
        assert_eq!(decided(0, 3, -5), Decision::Gap { expected: 1 });
        assert_eq!(decided(3, 1, -5), Decision::Stale { expected: 4 });
    }
}
