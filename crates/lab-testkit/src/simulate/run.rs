//! One history against the real inbox and the model, step by step: the same command to both,
//! the verdicts compared, then what the inbox stores of the aggregates the step touched; after a
//! crash, everything it stores, against the states the model allows (what was acknowledged, and
//! the step in flight committed or not).

use std::fmt;

use super::history::{CrashPoint, Delivery, PRODUCERS, REVOKED, Step};
use super::host::Hosted;
use super::model::{Model, Stored, Verdict};
use super::system::{Command, Direct};

/// The inbox a history runs against.
pub enum System {
    /// In this process: no crash can be injected.
    Direct(Box<Direct>),
    /// In a child process, killed and restarted at each crash step.
    Hosted(Box<Hosted>),
}

impl System {
    async fn run(&mut self, command: &Command) -> Result<Vec<Verdict>, String> {
        match self {
            System::Direct(direct) => direct.run(command).await,
            System::Hosted(hosted) => hosted.run(command).await,
        }
    }

    async fn stored(&mut self, aggregate_id: &str) -> Result<Stored, String> {
        match self {
            System::Direct(direct) => direct.stored(aggregate_id).await,
            System::Hosted(hosted) => hosted.stored(aggregate_id).await,
        }
    }

    async fn epochs(&mut self, producers: &[String]) -> Result<Vec<i64>, String> {
        match self {
            System::Direct(direct) => direct.epochs(producers).await,
            System::Hosted(hosted) => hosted.epochs(producers).await,
        }
    }

    pub async fn close(self) -> Result<(), String> {
        match self {
            System::Direct(direct) => {
                direct.close().await;
                Ok(())
            }
            System::Hosted(hosted) => (*hosted).stop().await,
        }
    }
}

/// Where and how the inbox and the model parted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    pub step: usize,
    pub what: String,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: {}", self.step, self.what)
    }
}

/// What a history did. The transfer counts are of the steps run without a crash around them
/// (after a crash, which state the inbox was left in is the run's, not the seed's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ran {
    pub steps: u64,
    pub crashes: u64,
    /// Transfers asked for, and the ones recorded.
    pub transfers: u64,
    pub transferred: u64,
    /// Deliveries refused to a producer a transfer took the aggregate from.
    pub old_owner_refused: u64,
}

/// How a history runs: the namespace in front of its ids, and whether a batch commits as one
/// (SQLite) or delivery by delivery (PostgreSQL), which decides what a crash may leave.
#[derive(Debug, Clone)]
pub struct Runner {
    pub namespace: String,
    pub atomic_batches: bool,
    pub aggregates: Vec<String>,
}

impl Runner {
    pub async fn run(&self, system: &mut System, history: &[Step]) -> Result<Ran, Divergence> {
        let mut model = Model::default();
        let mut crash = None;
        let mut ran = Ran::default();
        if history.iter().any(has_producers) {
            self.register(system, &mut model)
                .await
                .map_err(|what| Divergence { step: 0, what })?;
        }
        for (index, step) in history.iter().enumerate() {
            if let Step::Crash(point) = step {
                crash = Some(*point);
                continue;
            }
            let command = self.command(&model, step, index);
            let failed = |what: String| Divergence { step: index, what };
            ran.steps += 1;
            match crash.take() {
                None => self
                    .step(system, &mut model, &command, &mut ran)
                    .await
                    .map_err(failed)?,
                Some(point) => {
                    ran.crashes += 1;
                    self.crash(system, &mut model, &command, point)
                        .await
                        .map_err(failed)?;
                }
            }
        }
        Ok(ran)
    }

    /// Registers the history's producers, and one more that is revoked at once, in the inbox
    /// and in the model.
    async fn register(&self, system: &mut System, model: &mut Model) -> Result<(), String> {
        let active: Vec<String> = PRODUCERS.iter().map(|p| self.id(p)).collect();
        let revoked = self.id(REVOKED);
        let everyone = active.iter().cloned().chain([revoked.clone()]).collect();
        system.run(&Command::Register(everyone)).await?;
        system.run(&Command::Revoke(vec![revoked.clone()])).await?;
        for producer in &active {
            model.register(producer, true);
        }
        model.register(&revoked, false);
        Ok(())
    }

    /// The command of `step`, with the namespace in front of every id; a resolution names the
    /// dead letter the model's operator would pick.
    fn command(&self, model: &Model, step: &Step, index: usize) -> Command {
        match step {
            Step::Deliver(delivery) => Command::Deliver(self.named(model, delivery)),
            Step::Batch(deliveries) => {
                Command::Batch(deliveries.iter().map(|d| self.named(model, d)).collect())
            }
            Step::Resolve {
                aggregate_id,
                replace,
                stale,
            } => {
                let replacement = replace.then(|| (self.id(&format!("r-{index}")), 5));
                Command::Resolve(model.resolution(
                    &self.id(aggregate_id),
                    replacement,
                    *stale,
                    self.id(&format!("none-{index}")),
                ))
            }
            Step::SkipGap {
                aggregate_id,
                extra,
                stale,
                repeat,
            } => Command::SkipGap(model.gap_skip(&self.id(aggregate_id), *extra, *stale, *repeat)),
            Step::StartSession(producer) => Command::StartSession(self.id(producer)),
            Step::Transfer {
                aggregate_id,
                to,
                stale_owner,
                stale_last,
                repeat,
            } => Command::Transfer(model.transfer_request(
                &self.id(aggregate_id),
                &self.id(to),
                *stale_owner,
                *stale_last,
                *repeat,
            )),
            Step::Crash(_) => unreachable!("a crash is not a command"),
        }
    }

    fn id(&self, id: &str) -> String {
        format!("{}{id}", self.namespace)
    }

    /// The delivery with the namespace in front of its ids and, for a producer's, the epoch
    /// it offers: the producer's current one, or (`stale_epoch`) the one before.
    fn named(&self, model: &Model, delivery: &Delivery) -> Delivery {
        let producer = delivery.producer.as_deref().map(|p| self.id(p));
        let epoch = match &producer {
            Some(producer) => {
                let current = model.epoch(producer);
                if delivery.stale_epoch && current > 1 {
                    current - 1
                } else {
                    current
                }
            }
            None => 0,
        };
        Delivery {
            message_id: self.id(&delivery.message_id),
            aggregate_id: self.id(&delivery.aggregate_id),
            producer,
            epoch,
            ..delivery.clone()
        }
    }

    async fn step(
        &self,
        system: &mut System,
        model: &mut Model,
        command: &Command,
        ran: &mut Ran,
    ) -> Result<(), String> {
        let real = system.run(command).await?;
        let expected = decide(model, command);
        if real != expected {
            return Err(format!(
                "{command:?}: the inbox answered {real:?}, the model {expected:?}"
            ));
        }
        tally(model, command, &expected, ran);
        for aggregate_id in touched(command) {
            let stored = system.stored(&aggregate_id).await?;
            let modelled = model.stored(&aggregate_id);
            if stored != modelled {
                return Err(format!(
                    "after {command:?}, {aggregate_id} stores {stored:?}, the model {modelled:?}"
                ));
            }
        }
        Ok(())
    }

    async fn crash(
        &self,
        system: &mut System,
        model: &mut Model,
        command: &Command,
        point: CrashPoint,
    ) -> Result<(), String> {
        let System::Hosted(hosted) = system else {
            return Err("a crash needs the inbox in a child process".to_owned());
        };
        let candidates = self.candidates(model, command, point);
        let answered = hosted.crash(command, point).await?;
        if let Some(real) = answered {
            let expected = decide(&mut model.clone(), command);
            if real != expected {
                return Err(format!(
                    "{command:?} before a crash: the inbox answered {real:?}, the model {expected:?}"
                ));
            }
        }
        let mut stored = Vec::new();
        for aggregate_id in self.aggregates.iter().map(|a| self.id(a)) {
            stored.push(system.stored(&aggregate_id).await?);
        }
        let producers: Vec<String> = PRODUCERS.iter().map(|p| self.id(p)).collect();
        let epochs = system.epochs(&producers).await?;
        let matches = |candidate: &Model| {
            let same_epochs = producers
                .iter()
                .zip(&epochs)
                .all(|(p, epoch)| candidate.epoch(p) == *epoch);
            same_epochs
                && self
                    .aggregates
                    .iter()
                    .zip(&stored)
                    .all(|(a, stored)| candidate.stored(&self.id(a)) == *stored)
        };
        match candidates.into_iter().find(matches) {
            Some(candidate) => {
                *model = candidate;
                Ok(())
            }
            None => Err(format!(
                "after a crash {point:?} around {command:?}, the inbox stores {stored:?} (epochs \
                 {epochs:?}), which is not a state of what was acknowledged (with the step in \
                 flight or without it)"
            )),
        }
    }

    /// The model states a crash at `point` around `command` may leave.
    fn candidates(&self, model: &Model, command: &Command, point: CrashPoint) -> Vec<Model> {
        let mut done = model.clone();
        decide(&mut done, command);
        match point {
            CrashPoint::Before => vec![model.clone()],
            CrashPoint::After => vec![done],
            CrashPoint::During { .. } => match command {
                Command::Batch(deliveries) if !self.atomic_batches => (0..=deliveries.len())
                    .map(|prefix| {
                        let mut partial = model.clone();
                        for delivery in &deliveries[..prefix] {
                            partial.deliver(delivery);
                        }
                        partial
                    })
                    .collect(),
                _ => vec![model.clone(), done],
            },
        }
    }
}

/// Counts the transfers of a step, and the deliveries refused to an owner a transfer replaced.
fn tally(model: &Model, command: &Command, verdicts: &[Verdict], ran: &mut Ran) {
    let deliveries = match command {
        Command::Deliver(delivery) => std::slice::from_ref(delivery),
        Command::Batch(deliveries) => deliveries.as_slice(),
        Command::Transfer(_) => {
            ran.transfers += 1;
            let recorded = matches!(verdicts, [Verdict::Transferred { .. }]);
            ran.transferred += u64::from(recorded);
            return;
        }
        _ => return,
    };
    for (delivery, verdict) in deliveries.iter().zip(verdicts) {
        let refused = *verdict == Verdict::NotAdmitted("not the owner".to_owned());
        let old_owner = (delivery.producer.as_deref())
            .is_some_and(|producer| model.was_owner(&delivery.aggregate_id, producer));
        ran.old_owner_refused += u64::from(refused && old_owner);
    }
}

/// The model's verdicts on `command`, which it applies to itself.
fn decide(model: &mut Model, command: &Command) -> Vec<Verdict> {
    match command {
        Command::Deliver(delivery) => vec![model.deliver(delivery)],
        Command::Batch(deliveries) => deliveries.iter().map(|d| model.deliver(d)).collect(),
        Command::Resolve(resolution) => vec![model.resolve(resolution)],
        Command::StartSession(producer) => vec![Verdict::Session(model.start_session(producer))],
        Command::SkipGap(skip) => vec![model.skip_gap(skip)],
        Command::Transfer(transfer) => vec![model.transfer(transfer)],
        Command::Register(_) | Command::Revoke(_) => Vec::new(),
    }
}

fn has_producers(step: &Step) -> bool {
    match step {
        Step::StartSession(_) | Step::Transfer { .. } => true,
        Step::Deliver(delivery) => delivery.producer.is_some(),
        Step::Batch(deliveries) => deliveries.iter().any(|d| d.producer.is_some()),
        Step::Resolve { .. } | Step::SkipGap { .. } | Step::Crash(_) => false,
    }
}

fn touched(command: &Command) -> Vec<String> {
    let mut aggregates: Vec<String> = match command {
        Command::Deliver(delivery) => vec![delivery.aggregate_id.clone()],
        Command::Batch(deliveries) => deliveries.iter().map(|d| d.aggregate_id.clone()).collect(),
        Command::Resolve(resolution) => vec![resolution.aggregate_id.clone()],
        Command::SkipGap(skip) => vec![skip.aggregate_id.clone()],
        Command::Transfer(transfer) => vec![transfer.aggregate_id.clone()],
        Command::StartSession(_) | Command::Register(_) | Command::Revoke(_) => Vec::new(),
    };
    aggregates.sort();
    aggregates.dedup();
    aggregates
}
