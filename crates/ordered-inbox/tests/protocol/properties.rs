//! What must hold in every state the protocol can reach (`always`), at the end of every run
//! (`eventually`), and what the scenarios must be seen to reach (`sometimes`), so that a pass
//! is not a model that never gets anywhere.

use stateright::{Model, Property};

use super::inbox::{Content, Record, Taken, Verdict};
use super::model::{Action, Consumer, Delivery, Protocol, State};

pub const APPLIED_ONCE: &str = "no message is applied twice";
pub const IN_ORDER: &str = "each aggregate takes its sequences in order";
pub const POISON_NEVER_APPLIED: &str = "a poison is never applied";
pub const APPLIED_OR_DEAD: &str = "no message is both applied and dead-lettered";
pub const ONE_MEANING: &str = "an id is recorded once, as one message";
pub const ACKED_IS_RECORDED: &str = "an acked message is recorded as it was published";
pub const TERMINATED_IS_LISTED: &str = "a terminated message is in the rejected list";
pub const TERMINATED_WAS_REFUSED: &str = "a terminated message is not the one recorded";
pub const HELD_WAITS: &str = "a held message waits only for its turn";
pub const QUIESCENT_IS_SETTLED: &str = "a run that stops has settled every message";
pub const SETTLED: &str = "every message is eventually settled";

pub const REPLAY_AFTER_COMMIT: &str = "a message redelivered after its COMMIT answers replay";
pub const DRAINED: &str = "a held message drains behind its predecessor";
pub const SKIP_DRAINS: &str = "a skip drains the held successors";
pub const HELD_AGAIN: &str = "a held message delivered again is recognised";
pub const DEAD_AGAIN: &str = "a dead letter delivered again is recognised";
pub const HOLD_FULL: &str = "a message past the hold limit is nak'd";
pub const QUARANTINE_FULL: &str = "a poison past the quarantine limit is nak'd";
pub const CONFLICT: &str = "a payload conflict is terminated";
pub const STALE: &str = "a stale message is terminated";
pub const HANDLER_FAILED: &str = "a handler failure is nak'd";

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.actions_in(state, actions);
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        self.next(state, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(APPLIED_ONCE, |_, state| applied_once(state)),
            Property::always(IN_ORDER, |_, state| in_order(state)),
            Property::always(POISON_NEVER_APPLIED, |_, state| poison_never_applied(state)),
            Property::always(APPLIED_OR_DEAD, |_, state| applied_or_dead(state)),
            Property::always(ONE_MEANING, one_meaning),
            Property::always(ACKED_IS_RECORDED, acked_is_recorded),
            Property::always(TERMINATED_IS_LISTED, |_, state| terminated_is_listed(state)),
            Property::always(TERMINATED_WAS_REFUSED, terminated_was_refused),
            Property::always(HELD_WAITS, |_, state| held_waits(state)),
            Property::always(QUIESCENT_IS_SETTLED, |protocol, state| {
                !quiescent(protocol, state) || settled(protocol, state)
            }),
            Property::eventually(SETTLED, settled),
        ];
        let shows = self.scenario.shows;
        properties.extend(
            coverage()
                .into_iter()
                .filter(|property| shows.contains(&property.name)),
        );
        properties
    }
}

/// What a scenario may be asked to show it reaches.
fn coverage() -> Vec<Property<Protocol>> {
    vec![
        Property::sometimes(REPLAY_AFTER_COMMIT, replay_after_commit),
        Property::sometimes(DRAINED, |_, state| {
            all_taken(state).any(|taken| matches!(taken, Taken::Applied { drained: true, .. }))
        }),
        Property::sometimes(SKIP_DRAINS, |_, state| skip_drained(state)),
        Property::sometimes(HELD_AGAIN, |_, state| decided(state, Verdict::HeldAgain)),
        Property::sometimes(DEAD_AGAIN, |_, s| decided(s, Verdict::QuarantinedAgain)),
        Property::sometimes(HOLD_FULL, |_, state| decided(state, Verdict::HoldFull)),
        Property::sometimes(QUARANTINE_FULL, |_, s| decided(s, Verdict::QuarantineFull)),
        Property::sometimes(CONFLICT, |_, s| decided(s, Verdict::PayloadConflict)),
        Property::sometimes(STALE, |_, state| decided(state, Verdict::Stale)),
        Property::sometimes(HANDLER_FAILED, |_, s| decided(s, Verdict::HandlerFailed)),
    ]
}

fn all_taken(state: &State) -> impl Iterator<Item = &Taken> {
    state
        .inbox
        .aggregates
        .iter()
        .flat_map(|aggregate| aggregate.taken.iter())
}

fn applied_ids(state: &State) -> impl Iterator<Item = &'static str> + '_ {
    state
        .inbox
        .aggregates
        .iter()
        .flat_map(|aggregate| aggregate.applied())
        .map(|message| message.id)
}

fn applied_once(state: &State) -> bool {
    let mut seen = Vec::new();
    applied_ids(state).all(|id| {
        let first = !seen.contains(&id);
        seen.push(id);
        first
    })
}

/// Sequence n was the n-th thing an aggregate took, and its position is the last of them.
fn in_order(state: &State) -> bool {
    state.inbox.aggregates.iter().all(|aggregate| {
        usize::from(aggregate.last) == aggregate.taken.len()
            && aggregate
                .taken
                .iter()
                .enumerate()
                .all(|(index, taken)| usize::from(taken.sequence()) == index + 1)
    })
}

fn poison_never_applied(state: &State) -> bool {
    state
        .inbox
        .aggregates
        .iter()
        .flat_map(|aggregate| aggregate.applied())
        .all(|message| message.content != Content::Poison)
}

fn applied_or_dead(state: &State) -> bool {
    applied_ids(state).all(|id| {
        !state
            .inbox
            .records(id)
            .any(|record| matches!(record, Record::DeadLetter(_)))
    })
}

fn one_meaning(protocol: &Protocol, state: &State) -> bool {
    protocol
        .scenario
        .stream
        .iter()
        .all(|message| state.inbox.records(message.id).count() <= 1)
}

fn acked_is_recorded(protocol: &Protocol, state: &State) -> bool {
    entries_in(protocol, state, Delivery::Acked).all(|(_, message)| {
        state
            .inbox
            .records(message.id)
            .any(|record| record.message() == message)
    })
}

fn terminated_is_listed(state: &State) -> bool {
    (0..state.broker.len())
        .all(|entry| state.broker[entry] != Delivery::Terminated || state.listed[entry])
}

fn terminated_was_refused(protocol: &Protocol, state: &State) -> bool {
    entries_in(protocol, state, Delivery::Terminated).all(|(_, message)| {
        !state
            .inbox
            .records(message.id)
            .any(|record| record.message() == message)
    })
}

/// Held messages are all ahead of the aggregate's position, and the next one is held only
/// behind an open dead letter: a drain runs in the transaction that takes its predecessor.
fn held_waits(state: &State) -> bool {
    state.inbox.aggregates.iter().all(|aggregate| {
        let expected = aggregate.last.saturating_add(1);
        let blocked = aggregate
            .open_dead_letters()
            .any(|letter| letter.message.sequence == expected);
        aggregate
            .held
            .iter()
            .all(|held| held.sequence > expected || (held.sequence == expected && blocked))
    })
}

fn entries_in<'a>(
    protocol: &'a Protocol,
    state: &'a State,
    delivery: Delivery,
) -> impl Iterator<Item = (usize, super::inbox::Message)> + 'a {
    protocol
        .scenario
        .stream
        .iter()
        .copied()
        .enumerate()
        .filter(move |(entry, _)| state.broker[*entry] == delivery)
}

/// Nothing can happen any more. (A consumer that is dead or holds a batch always has a next
/// step, so only an idle one's actions are asked for.)
fn quiescent(protocol: &Protocol, state: &State) -> bool {
    if state.consumer != Consumer::Idle {
        return false;
    }
    let mut actions = Vec::new();
    protocol.actions_in(state, &mut actions);
    actions.is_empty()
}

/// The end a run must reach: the consumer idle, the broker holding nothing unanswered, nothing
/// held or blocked, and every published id applied exactly once, dead-lettered, or (every copy
/// of it) refused and terminated.
pub fn settled(protocol: &Protocol, state: &State) -> bool {
    let answered = |delivery: &Delivery| matches!(delivery, Delivery::Acked | Delivery::Terminated);
    let nothing_waits = |aggregate: &super::inbox::Aggregate| {
        aggregate.held.is_empty() && aggregate.open_dead_letters().next().is_none()
    };
    state.consumer == Consumer::Idle
        && state.broker.iter().all(answered)
        && state.inbox.aggregates.iter().all(nothing_waits)
        && protocol
            .scenario
            .stream
            .iter()
            .all(|message| has_an_end(protocol, state, message.id))
}

/// Applied exactly once, dead-lettered, or every copy refused and terminated.
fn has_an_end(protocol: &Protocol, state: &State, id: &str) -> bool {
    let applied = applied_ids(state).filter(|&applied| applied == id).count();
    let dead = state
        .inbox
        .records(id)
        .any(|record| matches!(record, Record::DeadLetter(_)));
    let refused = entries_of(protocol, id).all(|entry| state.broker[entry] == Delivery::Terminated);
    applied == 1 || dead || refused
}

fn entries_of<'a>(protocol: &'a Protocol, id: &'a str) -> impl Iterator<Item = usize> + 'a {
    protocol
        .scenario
        .stream
        .iter()
        .enumerate()
        .filter(move |(_, message)| message.id == id)
        .map(|(entry, _)| entry)
}

/// The batch in hand decided `verdict` for one of its messages.
fn decided(state: &State, verdict: Verdict) -> bool {
    match &state.consumer {
        Consumer::Batch(batch) => batch.verdicts.contains(&Some(verdict)),
        Consumer::Idle | Consumer::Dead => false,
    }
}

/// A replay of a message published once: it was delivered again after the COMMIT that applied
/// it, because its ack never arrived.
fn replay_after_commit(protocol: &Protocol, state: &State) -> bool {
    let Consumer::Batch(batch) = &state.consumer else {
        return false;
    };
    batch
        .entries
        .iter()
        .zip(&batch.verdicts)
        .any(|(&entry, verdict)| {
            let id = protocol.scenario.stream[entry].id;
            *verdict == Some(Verdict::Replay) && entries_of(protocol, id).count() == 1
        })
}

fn skip_drained(state: &State) -> bool {
    state.inbox.aggregates.iter().any(|aggregate| {
        aggregate.taken.windows(2).any(|pair| {
            matches!(
                pair,
                [Taken::Skipped { .. }, Taken::Applied { drained: true, .. }]
            )
        })
    })
}
