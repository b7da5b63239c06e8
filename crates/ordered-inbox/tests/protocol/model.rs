//! The broker door's protocol as a state machine: a JetStream stream and durable pull consumer
//! (each published message pending, in flight, acked or terminated), the consumer of
//! `src/broker/mod.rs` (fetch a batch, hand it to the inbox, COMMIT, list the rejections, then
//! ack / nak / term each message by its verdict), an operator who skips dead letters, and the
//! faults: the consumer dies at any point of a batch, an answer is lost, the store or the
//! handler fails.

use super::inbox::{Inbox, Limits, Message, Verdict};

/// How the inbox commits a batch: SQLite hands the whole fetch to its writer as one unit (one
/// COMMIT); PostgreSQL runs each message in its own transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    OnePerBatch,
    OnePerMessage,
}

/// A protocol bug planted on purpose, to show that the checker finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// Each message is answered as soon as its verdict is decided, before the COMMIT.
    AckBeforeCommit,
    /// `hold full` is acked instead of nak'd: the broker forgets a message the inbox refused.
    AckHoldFull,
    /// The batch is answered first and its rejections listed after.
    TermBeforeListing,
}

/// The faults one run may suffer, at most.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Faults {
    pub crashes: u8,
    pub lost_answers: u8,
    pub store_failures: u8,
    pub handler_failures: u8,
}

/// What the consumer tells the broker about one message.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Answer {
    Ack,
    Nak,
    Term,
}

/// A published message's state at the broker.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Delivery {
    /// Never delivered, nak'd, or its consumer died holding it: it will be delivered (again).
    Pending,
    /// Delivered and not answered yet.
    InFlight,
    Acked,
    Terminated,
}

/// One fetched batch on its way through the consumer.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Batch {
    /// The stream entries fetched, in delivery order.
    pub entries: Vec<usize>,
    /// Each entry's verdict, once its transaction decided it.
    pub verdicts: Vec<Option<Verdict>>,
    /// Each entry's answer once it is known.
    pub answers: Vec<Option<Answer>>,
    /// Which answers were sent.
    pub sent: Vec<bool>,
    /// Whether its rejections are in the rejected list.
    pub listed: bool,
    pub stage: Stage,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Stage {
    /// Entries from `next` on are not committed yet; `open` is the transaction in progress.
    Delivering { next: usize, open: Option<Open> },
    /// `deliver_batch` returned: the rejections are listed, and the answers sent one by one.
    Answering,
}

/// A transaction that decided the batch's entries up to `upto` and has not committed: the
/// inbox as it sees it.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Open {
    pub inbox: Inbox,
    pub upto: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Consumer {
    Idle,
    Dead,
    Batch(Batch),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    /// Each published message's state at the broker, by its place in the stream.
    pub broker: Vec<Delivery>,
    /// Whether the rejected list holds an entry for it.
    pub listed: Vec<bool>,
    pub consumer: Consumer,
    /// What the inbox committed.
    pub inbox: Inbox,
    /// The faults still to come.
    pub faults: Faults,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// The broker delivers these pending entries, in this order.
    Fetch(Vec<usize>),
    /// The inbox decides the next transaction's messages; the handler fails on the one at
    /// `handler_fails` (its index in the batch).
    Decide {
        handler_fails: Option<usize>,
    },
    Commit,
    /// The COMMIT fails: `deliver_batch` returns an error and every message is nak'd.
    CommitFails,
    List,
    ListingFails,
    /// The answer of the batch's next message is sent; `lost`: it never reaches the broker, which
    /// redelivers the message after the ack wait.
    Answer {
        lost: bool,
    },
    /// The consumer's process dies here.
    Crash,
    Restart,
    /// An operator skips an open dead letter (a resolution: its own transaction).
    Skip {
        aggregate: usize,
        id: &'static str,
    },
}

/// One scenario: a stream, an inbox, the consumer's settings and the faults.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub stream: Vec<Message>,
    pub aggregates: usize,
    pub commit: Commit,
    /// The most messages one fetch carries.
    pub batch: usize,
    pub limits: Limits,
    pub faults: Faults,
    /// The cases the check must see it reach (names of `sometimes` properties).
    pub shows: &'static [&'static str],
}

/// The protocol checked: the consumer of `src/broker/mod.rs`, or one with a planted bug.
pub struct Protocol {
    pub scenario: Scenario,
    pub bug: Option<Bug>,
}

/// The broker action for a committed verdict (`action_for` in `src/broker/mod.rs`).
pub fn answer_for(verdict: Verdict, bug: Option<Bug>) -> Answer {
    match verdict {
        Verdict::Applied
        | Verdict::Replay
        | Verdict::Held
        | Verdict::HeldAgain
        | Verdict::Quarantined
        | Verdict::QuarantinedAgain => Answer::Ack,
        Verdict::Stale | Verdict::PayloadConflict => Answer::Term,
        Verdict::HoldFull if bug == Some(Bug::AckHoldFull) => Answer::Ack,
        Verdict::HoldFull | Verdict::QuarantineFull | Verdict::HandlerFailed => Answer::Nak,
    }
}

impl Protocol {
    pub fn initial(&self) -> State {
        let length = self.scenario.stream.len();
        State {
            broker: vec![Delivery::Pending; length],
            listed: vec![false; length],
            consumer: Consumer::Idle,
            inbox: Inbox::new(self.scenario.aggregates),
            faults: self.scenario.faults,
        }
    }

    /// Every action possible in `state`, in a fixed order.
    pub fn actions_in(&self, state: &State, actions: &mut Vec<Action>) {
        match &state.consumer {
            Consumer::Idle => self.fetches(state, actions),
            Consumer::Dead => actions.push(Action::Restart),
            Consumer::Batch(batch) => {
                self.batch_steps(state, batch, actions);
                if state.faults.crashes > 0 {
                    actions.push(Action::Crash);
                }
            }
        }
        if !in_transaction(&state.consumer) {
            self.skips(state, actions);
        }
    }

    /// The broker delivers any pending entries, in any order, up to a batch: JetStream delivers
    /// new messages in stream order and redeliveries out of it, and any order covers both.
    fn fetches(&self, state: &State, actions: &mut Vec<Action>) {
        let pending: Vec<usize> = (0..state.broker.len())
            .filter(|&entry| state.broker[entry] == Delivery::Pending)
            .collect();
        let mut batch = Vec::new();
        orderings(&pending, self.scenario.batch, &mut batch, actions);
    }

    fn batch_steps(&self, state: &State, batch: &Batch, actions: &mut Vec<Action>) {
        match &batch.stage {
            Stage::Delivering { open: None, next } => {
                actions.push(Action::Decide {
                    handler_fails: None,
                });
                if state.faults.handler_failures > 0 {
                    for index in *next..self.unit_end(batch, *next) {
                        if self.handler_can_fail(state, batch, index) {
                            actions.push(Action::Decide {
                                handler_fails: Some(index),
                            });
                        }
                    }
                }
            }
            Stage::Delivering {
                open: Some(open), ..
            } => {
                let early = self.bug == Some(Bug::AckBeforeCommit);
                if early && unsent_below(batch, open.upto) {
                    actions.push(Action::Answer { lost: false });
                    if state.faults.lost_answers > 0 {
                        actions.push(Action::Answer { lost: true });
                    }
                } else {
                    actions.push(Action::Commit);
                    if state.faults.store_failures > 0 {
                        actions.push(Action::CommitFails);
                    }
                }
            }
            Stage::Answering if self.lists_next(batch) => {
                actions.push(Action::List);
                if state.faults.store_failures > 0 {
                    actions.push(Action::ListingFails);
                }
            }
            Stage::Answering => {
                actions.push(Action::Answer { lost: false });
                if state.faults.lost_answers > 0 {
                    actions.push(Action::Answer { lost: true });
                }
            }
        }
    }

    /// Whether the rejections are listed next: before any answer is sent (after every one, with
    /// the planted bug).
    fn lists_next(&self, batch: &Batch) -> bool {
        !batch.listed && (self.bug != Some(Bug::TermBeforeListing) || all_sent(batch))
    }

    /// Whether the handler runs (and so may fail) for the batch's message at `index`: the
    /// inbox as its transaction sees it, after the messages before it in that transaction.
    fn handler_can_fail(&self, state: &State, batch: &Batch, index: usize) -> bool {
        let Stage::Delivering { next, .. } = batch.stage else {
            return false;
        };
        let mut inbox = state.inbox.clone();
        for earlier in next..index {
            inbox.deliver(self.message(batch, earlier), self.scenario.limits, false);
        }
        inbox.would_apply(self.message(batch, index), self.scenario.limits)
    }

    fn skips(&self, state: &State, actions: &mut Vec<Action>) {
        for (aggregate, row) in state.inbox.aggregates.iter().enumerate() {
            for letter in row.open_dead_letters() {
                actions.push(Action::Skip {
                    aggregate,
                    id: letter.message.id,
                });
            }
        }
    }

    /// The end of the transaction that starts at `next`.
    fn unit_end(&self, batch: &Batch, next: usize) -> usize {
        match self.scenario.commit {
            Commit::OnePerBatch => batch.entries.len(),
            Commit::OnePerMessage => (next + 1).min(batch.entries.len()),
        }
    }

    fn message(&self, batch: &Batch, index: usize) -> Message {
        self.scenario.stream[batch.entries[index]]
    }

    /// The state after `action`; `None` when it does not apply.
    pub fn next(&self, state: &State, action: Action) -> Option<State> {
        let mut next = state.clone();
        match action {
            Action::Fetch(entries) => {
                for &entry in &entries {
                    next.broker[entry] = Delivery::InFlight;
                }
                next.consumer = Consumer::Batch(fetched(entries));
            }
            Action::Restart => next.consumer = Consumer::Idle,
            Action::Crash => {
                next.faults.crashes -= 1;
                crash(&mut next);
            }
            Action::Skip { aggregate, id } => {
                if !next.inbox.skip(aggregate, id, self.scenario.limits) {
                    return None;
                }
            }
            step => self.batch_step(&mut next, step)?,
        }
        Some(next)
    }

    fn batch_step(&self, state: &mut State, action: Action) -> Option<()> {
        let Consumer::Batch(mut batch) = std::mem::replace(&mut state.consumer, Consumer::Idle)
        else {
            return None;
        };
        match action {
            Action::Decide { handler_fails } => {
                if handler_fails.is_some() {
                    state.faults.handler_failures -= 1;
                }
                self.decide(state, &mut batch, handler_fails);
            }
            Action::Commit => self.commit(state, &mut batch),
            Action::CommitFails => {
                state.faults.store_failures -= 1;
                // The call fails as a whole: every message not answered yet is nak'd, even one
                // an earlier transaction of the batch committed.
                for (index, answer) in batch.answers.iter_mut().enumerate() {
                    if !batch.sent[index] {
                        *answer = Some(Answer::Nak);
                    }
                }
                answering(&mut batch);
            }
            Action::List => self.list(state, &mut batch),
            Action::ListingFails => {
                state.faults.store_failures -= 1;
                for (index, answer) in batch.answers.iter_mut().enumerate() {
                    if *answer == Some(Answer::Term) && !batch.sent[index] {
                        *answer = Some(Answer::Nak);
                    }
                }
                batch.listed = true;
            }
            Action::Answer { lost } => {
                if lost {
                    state.faults.lost_answers -= 1;
                }
                self.answer_next(state, &mut batch, lost);
            }
            _ => return None,
        }
        state.consumer = if batch_done(&batch) {
            Consumer::Idle
        } else {
            Consumer::Batch(batch)
        };
        Some(())
    }

    /// The next transaction decides its messages, in batch order, each after the ones before.
    fn decide(&self, state: &State, batch: &mut Batch, handler_fails: Option<usize>) {
        let Stage::Delivering { next, open: None } = batch.stage else {
            return;
        };
        let upto = self.unit_end(batch, next);
        let mut inbox = state.inbox.clone();
        for index in next..upto {
            let message = self.message(batch, index);
            let fails = handler_fails == Some(index);
            let verdict = inbox.deliver(message, self.scenario.limits, fails);
            batch.verdicts[index] = Some(verdict);
            if self.bug == Some(Bug::AckBeforeCommit) {
                batch.answers[index] = Some(answer_for(verdict, self.bug));
            }
        }
        batch.stage = Stage::Delivering {
            next,
            open: Some(Open { inbox, upto }),
        };
    }

    /// The COMMIT: the transaction's rows are durable. After the batch's last one
    /// `deliver_batch` returns, and only then are the answers known.
    fn commit(&self, state: &mut State, batch: &mut Batch) {
        let Stage::Delivering {
            open: Some(open), ..
        } = std::mem::replace(&mut batch.stage, Stage::Answering)
        else {
            return;
        };
        state.inbox = open.inbox;
        if open.upto < batch.entries.len() {
            batch.stage = Stage::Delivering {
                next: open.upto,
                open: None,
            };
            return;
        }
        for (answer, verdict) in batch.answers.iter_mut().zip(&batch.verdicts) {
            if let Some(verdict) = verdict {
                answer.get_or_insert(answer_for(*verdict, self.bug));
            }
        }
        answering(batch);
    }

    /// The rejections are written to the rejected list before any of them is terminated.
    fn list(&self, state: &mut State, batch: &mut Batch) {
        for (index, &entry) in batch.entries.iter().enumerate() {
            if batch.answers[index] == Some(Answer::Term) {
                state.listed[entry] = true;
            }
        }
        batch.listed = true;
    }

    fn answer_next(&self, state: &mut State, batch: &mut Batch, lost: bool) {
        let Some(index) = (0..batch.entries.len()).find(|&index| !batch.sent[index]) else {
            return;
        };
        let answer = batch.answers[index].unwrap_or(Answer::Nak);
        let entry = batch.entries[index];
        batch.sent[index] = true;
        state.broker[entry] = match (lost, answer) {
            (true, _) | (false, Answer::Nak) => Delivery::Pending,
            (false, Answer::Ack) => Delivery::Acked,
            (false, Answer::Term) => Delivery::Terminated,
        };
    }
}

fn fetched(entries: Vec<usize>) -> Batch {
    let length = entries.len();
    Batch {
        entries,
        verdicts: vec![None; length],
        answers: vec![None; length],
        sent: vec![false; length],
        listed: false,
        stage: Stage::Delivering {
            next: 0,
            open: None,
        },
    }
}

/// `deliver_batch` returned: what is left is listing and answering. Without a termination
/// there is nothing to list (and no write that could fail).
fn answering(batch: &mut Batch) {
    batch.stage = Stage::Answering;
    if !batch.answers.contains(&Some(Answer::Term)) {
        batch.listed = true;
    }
}

/// Whether the batch is over: every answer sent and its rejections listed.
fn batch_done(batch: &Batch) -> bool {
    batch.listed && all_sent(batch)
}

fn all_sent(batch: &Batch) -> bool {
    batch.sent.iter().all(|&sent| sent)
}

fn unsent_below(batch: &Batch, upto: usize) -> bool {
    batch.sent[..upto].iter().any(|&sent| !sent)
}

/// The consumer dies: its transaction in progress rolls back, and the broker redelivers what
/// it held after the ack wait.
fn crash(state: &mut State) {
    state.consumer = Consumer::Dead;
    for delivery in &mut state.broker {
        if *delivery == Delivery::InFlight {
            *delivery = Delivery::Pending;
        }
    }
}

/// Whether the consumer is inside an open (uncommitted) transaction, during which no other
/// transaction on its aggregates interleaves.
fn in_transaction(consumer: &Consumer) -> bool {
    matches!(
        consumer,
        Consumer::Batch(Batch {
            stage: Stage::Delivering { open: Some(_), .. },
            ..
        })
    )
}

/// Every ordering of 1 to `most` distinct entries of `pending`, each as a fetch.
fn orderings(pending: &[usize], most: usize, batch: &mut Vec<usize>, into: &mut Vec<Action>) {
    if batch.len() == most {
        return;
    }
    for &entry in pending {
        if batch.contains(&entry) {
            continue;
        }
        batch.push(entry);
        into.push(Action::Fetch(batch.clone()));
        orderings(pending, most, batch, into);
        batch.pop();
    }
}
