//! The inbox as the broker door sees it, kept abstract: per aggregate its position, what took
//! each sequence, its held messages and its dead letters; ids global to the (anonymous)
//! namespace. The rules are the library's for an anonymous delivery through the broker door
//! (identity first, then the ordering policy, then holding, quarantine and the drain), written
//! out again with no code shared with it, so that the check says what the protocol does with
//! the inbox's promises, not what the library's code does.

/// What a message says, as the application's check sees it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Content {
    Valid(u8),
    Poison,
}

/// One message as its producer published it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Message {
    pub id: &'static str,
    pub aggregate: usize,
    pub sequence: u8,
    pub content: Content,
}

/// How many messages an aggregate may hold ahead of their turn and how many open dead letters
/// it may keep.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub held: usize,
    pub open_dead_letters: usize,
}

/// The inbox's verdict on one delivery, or the failure of the application's handler.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Verdict {
    Applied,
    Replay,
    Held,
    HeldAgain,
    HoldFull,
    Quarantined,
    QuarantinedAgain,
    QuarantineFull,
    Stale,
    PayloadConflict,
    /// The handler's `apply` failed: nothing of the delivery was written.
    HandlerFailed,
}

/// What took a sequence of an aggregate.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Taken {
    /// The message applied; `drained`: it had been held and applied behind its predecessor.
    Applied { message: Message, drained: bool },
    /// An operator skipped the dead letter with this id at this sequence.
    Skipped {
        dead_letter: &'static str,
        sequence: u8,
    },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DeadLetterStatus {
    Open,
    Skipped,
    /// A valid message (or a skip) took its sequence.
    Superseded,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct DeadLetter {
    pub message: Message,
    pub status: DeadLetterStatus,
}

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Aggregate {
    /// The last sequence taken (applied or skipped); 0 before any.
    pub last: u8,
    /// What took sequences 1, 2, …, in the order it happened.
    pub taken: Vec<Taken>,
    /// Messages ahead of their turn, in sequence order.
    pub held: Vec<Message>,
    pub dead_letters: Vec<DeadLetter>,
}

impl Taken {
    pub fn sequence(&self) -> u8 {
        match self {
            Taken::Applied { message, .. } => message.sequence,
            Taken::Skipped { sequence, .. } => *sequence,
        }
    }
}

impl Aggregate {
    pub fn open_dead_letters(&self) -> impl Iterator<Item = &DeadLetter> {
        self.dead_letters
            .iter()
            .filter(|letter| letter.status == DeadLetterStatus::Open)
    }

    /// The messages that applied here, in the order they did.
    pub fn applied(&self) -> impl Iterator<Item = &Message> {
        self.taken.iter().filter_map(|taken| match taken {
            Taken::Applied { message, .. } => Some(message),
            Taken::Skipped { .. } => None,
        })
    }

    /// Sequence `sequence` was taken: `last` moves on, and the open dead letters at it are
    /// superseded.
    fn take(&mut self, sequence: u8, taken: Taken) {
        self.taken.push(taken);
        self.last = sequence;
        for letter in &mut self.dead_letters {
            if letter.status == DeadLetterStatus::Open && letter.message.sequence == sequence {
                letter.status = DeadLetterStatus::Superseded;
            }
        }
    }
}

/// What the inbox has committed.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Inbox {
    pub aggregates: Vec<Aggregate>,
}

/// Where an id is recorded, and as which message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    Applied(Message),
    DeadLetter(Message),
    Held(Message),
}

impl Record {
    pub fn message(self) -> Message {
        match self {
            Record::Applied(message) | Record::DeadLetter(message) | Record::Held(message) => {
                message
            }
        }
    }
}

impl Inbox {
    pub fn new(aggregates: usize) -> Inbox {
        Inbox {
            aggregates: vec![Aggregate::default(); aggregates],
        }
    }

    /// Every record of `id`, in every aggregate: a correct inbox has at most one.
    pub fn records<'a>(&'a self, id: &'a str) -> impl Iterator<Item = Record> + 'a {
        self.aggregates.iter().flat_map(move |aggregate| {
            let applied = aggregate.applied().copied().map(Record::Applied);
            let dead = aggregate.dead_letters.iter().map(|letter| letter.message);
            let held = aggregate.held.iter().copied().map(Record::Held);
            applied
                .chain(dead.map(Record::DeadLetter))
                .chain(held)
                .filter(move |record| record.message().id == id)
        })
    }

    fn record(&self, id: &str) -> Option<Record> {
        self.records(id).next()
    }

    /// Decides one broker delivery and records it. A handler that fails (`handler_fails`) on a
    /// delivery that would apply leaves everything as it was.
    pub fn deliver(&mut self, message: Message, limits: Limits, handler_fails: bool) -> Verdict {
        if let Some(record) = self.record(message.id) {
            return match record {
                _ if record.message() != message => Verdict::PayloadConflict,
                Record::Applied(_) => Verdict::Replay,
                Record::DeadLetter(_) => Verdict::QuarantinedAgain,
                Record::Held(_) => Verdict::HeldAgain,
            };
        }
        let Some(aggregate) = self.aggregates.get_mut(message.aggregate) else {
            return Verdict::Stale;
        };
        let expected = aggregate.last.saturating_add(1);
        if message.sequence < expected {
            Verdict::Stale
        } else if message.sequence > expected {
            hold(aggregate, message, limits)
        } else if message.content == Content::Poison {
            quarantine(aggregate, message, limits)
        } else if handler_fails {
            Verdict::HandlerFailed
        } else {
            apply(aggregate, message, false, limits);
            Verdict::Applied
        }
    }

    /// Whether delivering `message` now would apply it (so that its handler can fail).
    pub fn would_apply(&self, message: Message, limits: Limits) -> bool {
        let mut trial = self.clone();
        trial.deliver(message, limits, false) == Verdict::Applied
    }

    /// An operator skips the open dead letter `id` of `aggregate`: its sequence is taken, and the
    /// held messages that became next drain. False when there is no such dead letter at the
    /// aggregate's next sequence.
    pub fn skip(&mut self, aggregate: usize, id: &'static str, limits: Limits) -> bool {
        let Some(state) = self.aggregates.get_mut(aggregate) else {
            return false;
        };
        let expected = state.last.saturating_add(1);
        let Some(letter) = state.dead_letters.iter_mut().find(|letter| {
            letter.message.id == id
                && letter.status == DeadLetterStatus::Open
                && letter.message.sequence == expected
        }) else {
            return false;
        };
        letter.status = DeadLetterStatus::Skipped;
        let skipped = Taken::Skipped {
            dead_letter: id,
            sequence: expected,
        };
        state.take(expected, skipped);
        drain(state, limits);
        true
    }
}

/// An early message: held, unless its sequence is held already (the first held wins) or the
/// aggregate holds the most it may.
fn hold(aggregate: &mut Aggregate, message: Message, limits: Limits) -> Verdict {
    if aggregate
        .held
        .iter()
        .any(|held| held.sequence == message.sequence)
    {
        return Verdict::Stale;
    }
    if aggregate.held.len() >= limits.held {
        return Verdict::HoldFull;
    }
    aggregate.held.push(message);
    aggregate.held.sort_by_key(|held| held.sequence);
    Verdict::Held
}

/// A poison at the expected sequence: a dead letter that blocks the aggregate, unless it holds
/// the most open dead letters it may.
fn quarantine(aggregate: &mut Aggregate, message: Message, limits: Limits) -> Verdict {
    if aggregate.open_dead_letters().count() >= limits.open_dead_letters {
        return Verdict::QuarantineFull;
    }
    aggregate.dead_letters.push(DeadLetter {
        message,
        status: DeadLetterStatus::Open,
    });
    Verdict::Quarantined
}

fn apply(aggregate: &mut Aggregate, message: Message, drained: bool, limits: Limits) {
    aggregate.take(message.sequence, Taken::Applied { message, drained });
    drain(aggregate, limits);
}

/// The held messages that became next apply in sequence order; a held poison is quarantined
/// and stops the drain (or, when the quarantine is full, stays held).
fn drain(aggregate: &mut Aggregate, limits: Limits) {
    loop {
        let expected = aggregate.last.saturating_add(1);
        let Some(position) = aggregate
            .held
            .iter()
            .position(|held| held.sequence == expected)
        else {
            return;
        };
        let next = aggregate.held[position];
        if next.content == Content::Poison {
            if quarantine(aggregate, next, limits) == Verdict::Quarantined {
                aggregate.held.remove(position);
            }
            return;
        }
        aggregate.held.remove(position);
        aggregate.take(
            next.sequence,
            Taken::Applied {
                message: next,
                drained: true,
            },
        );
    }
}
