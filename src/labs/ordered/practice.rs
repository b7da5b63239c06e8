//! The lesson's companion practice as a command: the ordering policy run over a progression of
//! `sequence:amount` deliveries, one line of output per delivery.

use ordered_inbox::policy::{Decision, decide};

use crate::inbox::ledger::{self, Ledger};

/// The lesson's progression: 2, 1, poison 2, 3, corrected 2.
pub const LESSON_PROGRESSION: &[(i64, i64)] = &[(2, 1), (1, 1), (2, -1), (3, 1), (2, 1)];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PracticeError {
    #[error("'{0}' is not a delivery: write SEQUENCE:AMOUNT with whole numbers, e.g. 3:1 or 2:-1")]
    BadStep(String),
}

/// Parses `SEQUENCE:AMOUNT`.
pub fn parse_step(text: &str) -> Result<(i64, i64), PracticeError> {
    let bad = || PracticeError::BadStep(text.to_owned());
    let (sequence, amount) = text.split_once(':').ok_or_else(bad)?;
    Ok((
        sequence.trim().parse().map_err(|_| bad())?,
        amount.trim().parse().map_err(|_| bad())?,
    ))
}

/// Runs the progression from `last`, returning one line per delivery: `applied:N` (the new
/// last), `quarantined`, `gap:N` (N is still required) or `stale:N` (already passed; N is next).
pub fn run(mut last: i64, steps: &[(i64, i64)]) -> Vec<String> {
    steps
        .iter()
        .map(|&(sequence, amount)| {
            let message = ledger::message(String::new(), String::new(), sequence, amount);
            match decide(last, &message, &Ledger) {
                Decision::Apply { sequence } => {
                    last = sequence;
                    format!("applied:{last}")
                }
                Decision::Quarantine { .. } => "quarantined".to_owned(),
                Decision::Gap { expected } => format!("gap:{expected}"),
                Decision::Stale { expected } => format!("stale:{expected}"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lesson_prints_its_five_lines() {
        assert_eq!(
            run(0, LESSON_PROGRESSION),
            ["gap:1", "applied:1", "quarantined", "gap:2", "applied:2"]
        );
    }

    #[test]
    fn changing_the_first_sequence_to_three_still_requires_one() {
        assert_eq!(
            run(0, &[(3, 1), (1, 1), (3, 1), (2, 1), (3, 1)]),
            ["gap:1", "applied:1", "gap:2", "applied:2", "applied:3"]
        );
    }

    #[test]
    fn steps_parse_or_say_what_is_wrong() {
        assert_eq!(parse_step("2:-1"), Ok((2, -1)));
        assert!(parse_step("2").is_err());
        assert!(parse_step("a:1").is_err());
    }
}
