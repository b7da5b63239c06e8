//! What the backends share when they run an application's handler: the report of what its
//! `apply` and `state` said while a plan was written, and how it completes the verdict and the
//! audit row. The backends only differ in how they reach the database.

use serde_json::Value;

use crate::content::{Check, Detail, Poison};
use crate::delivery::Outcome;
use crate::model::OrderedMessage;
use crate::records::ResolutionRecord;
use crate::resolution::Resolved;

/// What writing a plan learnt from the handler.
#[derive(Default)]
pub(crate) struct Report {
    /// Each applied message's detail, by sequence.
    pub details: Vec<(i64, Detail)>,
    pub resolution_id: Option<i64>,
    /// The handler's state of the aggregate right after the plan's first apply.
    pub after: Option<Value>,
}

impl Report {
    /// The delivery's verdict with the detail its message's `apply` reported.
    pub(crate) fn outcome(mut self, mut outcome: Outcome) -> Outcome {
        if let Outcome::Applied {
            sequence, detail, ..
        } = &mut outcome
            && let Some(index) = self.details.iter().position(|(at, _)| at == sequence)
        {
            *detail = self.details.swap_remove(index).1;
        }
        outcome
    }
}

/// A resolution's states of its aggregate: before it, and whether `after` is read right after
/// the replacement's apply (for the aggregate named) or is `before` (a skip has no effect).
pub(crate) struct States<'a> {
    pub before: Option<Value>,
    pub after_the_first_apply: Option<&'a str>,
}

impl States<'_> {
    /// `record` with its `before` and `after` states.
    pub(crate) fn on(
        &self,
        mut record: ResolutionRecord,
        after: Option<&Value>,
        replaces: bool,
    ) -> ResolutionRecord {
        record.before.state = self.before.clone();
        record.after.state = if replaces {
            after.cloned()
        } else {
            self.before.clone()
        };
        record
    }
}

/// The resolution as written: its row's id and the handler's states.
pub(crate) fn recorded(
    resolved: Resolved,
    states: &States<'_>,
    report: &Report,
    replaces: bool,
) -> Resolved {
    let stated = |record: ResolutionRecord| {
        let record = states.on(record, report.after.as_ref(), replaces);
        ResolutionRecord {
            resolution_id: report.resolution_id.or(record.resolution_id),
            ..record
        }
    };
    match resolved {
        Resolved::New(record) => Resolved::New(stated(record)),
        Resolved::DryRun(record) => Resolved::DryRun(ResolutionRecord {
            resolution_id: None,
            ..stated(record)
        }),
        repeated @ Resolved::Repeated(_) => repeated,
    }
}

/// How many times one decision may be made again after a poison from `apply`: each round marks
/// one more of the plan's messages poison, and a plan applies at most the delivered message and
/// every held one.
pub(crate) fn rounds(max_held_per_aggregate: usize) -> usize {
    max_held_per_aggregate.saturating_add(2)
}

/// A check whose verdicts on some sequences were overruled by `apply`: the inbox decides again
/// with it after an `apply` declared a message poison, so that the decision stays the core's.
pub(crate) struct Overruled<'a> {
    pub inner: &'a dyn Check,
    /// Sequences of the aggregate being decided that `apply` found poison. Within one decision
    /// every message that may apply is of one aggregate, so a sequence names one message.
    pub poisoned: &'a [(i64, Poison)],
}

impl Check for Overruled<'_> {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match self
            .poisoned
            .iter()
            .find(|(sequence, _)| *sequence == message.sequence)
        {
            Some((_, poison)) => Err(poison.clone()),
            None => self.inner.check(message),
        }
    }

    fn canonical(&self, message: &OrderedMessage) -> String {
        self.inner.canonical(message)
    }
}
