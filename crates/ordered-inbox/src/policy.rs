//! The ordering decision for one message against one aggregate's last applied sequence.
//!
//! It holds no identity and writes nothing: identity, dead letters and the rows to write are the
//! delivery decision's ([`crate::delivery`]). A quarantine is an observation, never an advance.

use crate::model::QuarantineReason;

/// What to do with a message, given the aggregate's last applied sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// It is the next sequence and valid: apply it; `last` becomes `sequence`.
    Apply { sequence: i64 },
    /// It is the next sequence but invalid: record it, leave `last` where it is.
    Quarantine {
        expected: i64,
        reason: QuarantineReason,
    },
    /// A later sequence arrived before its predecessor: `expected` is still required.
    Gap { expected: i64 },
    /// The sequence was already passed.
    Stale { expected: i64 },
}

/// Decides one message. `last` is the aggregate's last applied sequence (0 before any).
pub fn decide(last: i64, sequence: i64, amount: i64) -> Decision {
    let expected = last.saturating_add(1);
    if sequence > expected {
        Decision::Gap { expected }
    } else if sequence < expected {
        Decision::Stale { expected }
    } else if amount < 0 {
        Decision::Quarantine {
            expected,
            reason: QuarantineReason::NegativeAmount,
        }
    } else {
        Decision::Apply { sequence }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_valid_sequence_applies() {
        assert_eq!(decide(0, 1, 1), Decision::Apply { sequence: 1 });
        assert_eq!(decide(4, 5, 0), Decision::Apply { sequence: 5 });
    }

    #[test]
    fn gap_reports_the_next_required_sequence() {
        assert_eq!(decide(0, 2, 1), Decision::Gap { expected: 1 });
        assert_eq!(decide(1, 3, 1), Decision::Gap { expected: 2 });
    }

    #[test]
    fn an_old_sequence_is_stale_not_a_gap() {
        assert_eq!(decide(2, 2, 1), Decision::Stale { expected: 3 });
        assert_eq!(decide(2, 1, 1), Decision::Stale { expected: 3 });
    }

    #[test]
    fn a_negative_amount_at_the_expected_sequence_is_quarantined_without_advancing() {
        assert_eq!(
            decide(1, 2, -1),
            Decision::Quarantine {
                expected: 2,
                reason: QuarantineReason::NegativeAmount
            }
        );
    }

    #[test]
    fn ordering_is_checked_before_validity() {
        // A poison message that is also out of order reports the ordering problem.
        assert_eq!(decide(0, 3, -5), Decision::Gap { expected: 1 });
        assert_eq!(decide(3, 1, -5), Decision::Stale { expected: 4 });
    }
}
