//! Many seeds: each seed's history runs against the real inbox and the model; a divergence
//! stops the campaign (the seeds in flight finish), and is shrunk to a short history that still
//! diverges and reported with its seed. The report is a
//! pure function of the seeds (timings aside): the histories are, and so are their faults.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::Mutex;

use super::history::{self, Shape, Step};
use super::host::{HostProgram, Hosted};
use super::run::{Divergence, Runner, System};
use super::system::{Backend, Direct};
use crate::progress::Progress;

/// Where a campaign keeps the inbox.
#[derive(Debug, Clone)]
pub enum Store {
    /// SQLite files in this directory: one per worker (renewed every [`SEEDS_PER_FILE`] seeds),
    /// and one per seed whose history crashes.
    Sqlite(PathBuf),
    /// One PostgreSQL database (its URL) shared by every seed, each in its own namespace.
    Postgres(String),
}

/// Seeds a worker's SQLite file serves before it starts a new one (the files stay small).
pub const SEEDS_PER_FILE: u64 = 500;

#[derive(Debug, Clone)]
pub struct Campaign {
    pub first_seed: u64,
    pub seeds: u64,
    pub store: Store,
    pub shape: Shape,
    /// Every this many seeds (by number) a history with crashes, hosted in a child process;
    /// 0 or no host: none.
    pub crash_every: u64,
    pub host: Option<HostProgram>,
    pub workers: usize,
    /// Show progress on stderr.
    pub progress: bool,
}

/// What was injected, counted from the histories.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Faults {
    pub deliveries: u64,
    pub poison: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    pub batches: u64,
    pub resolutions: u64,
    pub stale_resolutions: u64,
    pub gap_skips: u64,
    pub sessions: u64,
    pub fenced: u64,
    /// Operators' transfers, the ones naming a wrong owner or position or sent again, and the
    /// ones run with the inbox's process killed around them.
    pub transfers: u64,
    pub stale_transfers: u64,
    pub crashed_transfers: u64,
    pub crashes: u64,
}

/// One seed whose history diverged, with the shortest history found that still does.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    pub seed: u64,
    pub step: usize,
    pub what: String,
    pub shrunk: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub backend: String,
    pub first_seed: u64,
    /// Seeds asked for, and seeds run (fewer when a divergence stopped the campaign).
    pub seeds: u64,
    pub seeds_run: u64,
    pub steps: u64,
    pub crashes: u64,
    pub faults: Faults,
    pub failures: Vec<Failure>,
    pub seconds: f64,
}

impl Report {
    pub fn seeds_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.seeds_run as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Runs the campaign; an error is the store failing, not a divergence (that is in the report).
pub async fn run(campaign: Campaign) -> Result<Report, String> {
    let started = Instant::now();
    let progress = campaign
        .progress
        .then(|| Progress::start("simulate", campaign.seeds, "seeds"));
    let counter = progress.as_ref().map(Progress::counter);
    let next = Arc::new(AtomicU64::new(0));
    // A divergence stops the campaign: no worker starts another seed.
    let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let report = Arc::new(Mutex::new(Report {
        backend: backend_name(&campaign.store).to_owned(),
        first_seed: campaign.first_seed,
        seeds: campaign.seeds,
        ..Report::default()
    }));
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..campaign.workers.max(1) {
        let (campaign, next, report) = (campaign.clone(), next.clone(), report.clone());
        let stopped = stopped.clone();
        let counter = counter.clone();
        workers.spawn(async move {
            let mut state = Worker::new(worker);
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= campaign.seeds || stopped.load(Ordering::Relaxed) {
                    return state.close().await;
                }
                let seed = campaign.first_seed.wrapping_add(index);
                let outcome = state.seed(&campaign, seed).await?;
                if outcome.failure.is_some() {
                    stopped.store(true, Ordering::Relaxed);
                }
                let mut report = report.lock().await;
                report.add(outcome);
                report.seeds_run += 1;
                drop(report);
                if let Some(counter) = &counter {
                    counter.add(1);
                }
            }
        });
    }
    while let Some(joined) = workers.join_next().await {
        joined.map_err(|e| e.to_string())??;
    }
    if let Some(progress) = progress {
        progress.finish();
    }
    let mut report = Arc::try_unwrap(report)
        .map_err(|_| "the workers still hold the report".to_owned())?
        .into_inner();
    report.failures.sort_by_key(|f| f.seed);
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

fn backend_name(store: &Store) -> &'static str {
    match store {
        Store::Sqlite(_) => "sqlite",
        Store::Postgres(_) => "postgres",
    }
}

/// What one seed did.
struct SeedOutcome {
    steps: u64,
    crashes: u64,
    faults: Faults,
    failure: Option<Failure>,
}

impl Report {
    fn add(&mut self, outcome: SeedOutcome) {
        self.steps += outcome.steps;
        self.crashes += outcome.crashes;
        let (f, o) = (&mut self.faults, outcome.faults);
        f.deliveries += o.deliveries;
        f.poison += o.poison;
        f.duplicates += o.duplicates;
        f.out_of_order += o.out_of_order;
        f.batches += o.batches;
        f.resolutions += o.resolutions;
        f.stale_resolutions += o.stale_resolutions;
        f.gap_skips += o.gap_skips;
        f.sessions += o.sessions;
        f.fenced += o.fenced;
        f.transfers += o.transfers;
        f.stale_transfers += o.stale_transfers;
        f.crashed_transfers += o.crashed_transfers;
        f.crashes += o.crashes;
        self.failures.extend(outcome.failure);
    }
}

/// A worker's inbox for the histories without crashes, reused across seeds.
struct Worker {
    index: usize,
    direct: Option<(Direct, u64)>,
}

impl Worker {
    fn new(index: usize) -> Worker {
        Worker {
            index,
            direct: None,
        }
    }

    async fn close(self) -> Result<(), String> {
        if let Some((direct, _)) = self.direct {
            direct.close().await;
        }
        Ok(())
    }

    async fn seed(&mut self, campaign: &Campaign, seed: u64) -> Result<SeedOutcome, String> {
        let crashes = campaign.host.is_some()
            && campaign.crash_every > 0
            && seed.is_multiple_of(campaign.crash_every);
        let shape = Shape {
            crashes,
            ..campaign.shape
        };
        let history = history::generate(seed, &shape);
        let faults = faults_of(&history);
        let runner = runner(campaign, seed, &shape, "");
        let result = if crashes {
            let mut system = hosted_system(campaign, seed, "").await?;
            let result = runner.run(&mut system, &history).await;
            system.close().await?;
            result
        } else {
            let (direct, file) = self.direct(campaign, seed).await?;
            let mut system = System::Direct(Box::new(direct));
            let result = runner.run(&mut system, &history).await;
            if let System::Direct(direct) = system {
                self.direct = Some((*direct, file));
            }
            result
        };
        let (steps, crashed, failure) = match result {
            Ok(ran) => (ran.steps, ran.crashes, None),
            Err(divergence) => {
                let shrunk =
                    shrink(campaign, seed, &shape, history.clone(), divergence.clone()).await;
                let failure = Failure {
                    seed,
                    step: divergence.step,
                    what: divergence.what,
                    shrunk: shrunk.iter().map(|s| format!("{s:?}")).collect(),
                };
                (history.len() as u64, 0, Some(failure))
            }
        };
        Ok(SeedOutcome {
            steps,
            crashes: crashed,
            faults,
            failure,
        })
    }

    /// The worker's inbox, on a new SQLite file every [`SEEDS_PER_FILE`] seeds, and its file's
    /// number.
    async fn direct(&mut self, campaign: &Campaign, seed: u64) -> Result<(Direct, u64), String> {
        let file = match campaign.store {
            Store::Sqlite(_) => seed / SEEDS_PER_FILE,
            Store::Postgres(_) => 0,
        };
        match self.direct.take() {
            Some((direct, kept)) if kept == file => return Ok((direct, kept)),
            Some((direct, _)) => direct.close().await,
            None => {}
        }
        let backend = fresh_backend(campaign, &format!("worker-{}-{file}.db", self.index));
        Ok((Direct::open(&backend).await?, file))
    }
}

/// The namespace of a seed's ids: seeds (and the attempts of a shrink) share a database.
fn runner(campaign: &Campaign, seed: u64, shape: &Shape, attempt: &str) -> Runner {
    Runner {
        namespace: format!("s{seed}{attempt}-"),
        atomic_batches: matches!(campaign.store, Store::Sqlite(_)),
        aggregates: history::aggregate_ids(shape),
    }
}

/// A child process hosting the inbox for one seed: a fresh SQLite file, or the shared
/// database.
async fn hosted_system(campaign: &Campaign, seed: u64, attempt: &str) -> Result<System, String> {
    let host = campaign.host.as_ref().ok_or("no host program")?;
    let backend = fresh_backend(campaign, &format!("seed-{seed}{attempt}.db"));
    let hosted = Hosted::start(host, &backend).await?;
    Ok(System::Hosted(Box::new(hosted)))
}

/// A fresh inbox for one attempt of a shrink.
async fn fresh_system(
    campaign: &Campaign,
    seed: u64,
    attempt: &str,
    crashes: bool,
) -> Result<System, String> {
    if crashes {
        return hosted_system(campaign, seed, attempt).await;
    }
    let backend = fresh_backend(campaign, &format!("shrink-{seed}{attempt}.db"));
    Ok(System::Direct(Box::new(Direct::open(&backend).await?)))
}

/// The campaign's store for a new inbox: on SQLite the file `name` in its directory, emptied (a
/// file left by an earlier campaign would hold the same namespaces); on PostgreSQL the shared
/// database.
fn fresh_backend(campaign: &Campaign, name: &str) -> Backend {
    match &campaign.store {
        Store::Sqlite(directory) => {
            let path = directory.join(name);
            remove_database(&path);
            Backend::Sqlite(path)
        }
        Store::Postgres(url) => Backend::Postgres(url.clone()),
    }
}

fn remove_database(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let _ = std::fs::remove_file(name);
    }
}

/// Most attempts a shrink makes.
const SHRINK_ATTEMPTS: usize = 300;

/// The shortest history found (removing chunks of steps, then single steps) that still
/// diverges, each attempt on a fresh inbox.
async fn shrink(
    campaign: &Campaign,
    seed: u64,
    shape: &Shape,
    mut history: Vec<Step>,
    first: Divergence,
) -> Vec<Step> {
    // Nothing after the diverging step matters.
    history.truncate(first.step + 1);
    let mut attempts = 0;
    let mut chunk = history.len().div_ceil(2).max(1);
    while chunk >= 1 && attempts < SHRINK_ATTEMPTS {
        let mut start = 0;
        let mut removed_any = false;
        while start < history.len() && attempts < SHRINK_ATTEMPTS {
            let end = (start + chunk).min(history.len());
            let candidate: Vec<Step> = history[..start]
                .iter()
                .chain(&history[end..])
                .cloned()
                .collect();
            attempts += 1;
            if !candidate.is_empty() && diverges(campaign, seed, shape, &candidate, attempts).await
            {
                history = candidate;
                removed_any = true;
            } else {
                start = end;
            }
        }
        if !removed_any {
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
    }
    history
}

async fn diverges(
    campaign: &Campaign,
    seed: u64,
    shape: &Shape,
    history: &[Step],
    attempt: usize,
) -> bool {
    let attempt = format!("x{attempt}");
    let crashes = history.iter().any(|s| matches!(s, Step::Crash(_)));
    let Ok(mut system) = fresh_system(campaign, seed, &attempt, crashes).await else {
        return false;
    };
    let diverged = runner(campaign, seed, shape, &attempt)
        .run(&mut system, history)
        .await
        .is_err();
    let _ = system.close().await;
    if let Store::Sqlite(directory) = &campaign.store {
        remove_database(&directory.join(format!("shrink-{seed}{attempt}.db")));
        remove_database(&directory.join(format!("seed-{seed}{attempt}.db")));
    }
    diverged
}

/// What a history injects.
fn faults_of(history: &[Step]) -> Faults {
    let mut faults = Faults::default();
    let mut seen = std::collections::BTreeSet::new();
    let mut highest: std::collections::BTreeMap<String, i64> = Default::default();
    let mut count = |delivery: &history::Delivery, faults: &mut Faults| {
        faults.deliveries += 1;
        faults.poison += u64::from(super::model::is_poison(delivery.value));
        faults.fenced += u64::from(delivery.stale_epoch);
        faults.duplicates += u64::from(!seen.insert(delivery.message_id.clone()));
        let top = highest.entry(delivery.aggregate_id.clone()).or_default();
        faults.out_of_order += u64::from(delivery.sequence < *top);
        *top = (*top).max(delivery.sequence);
    };
    // A crash step kills the process around the next step that is not a crash.
    let mut crash_pending = false;
    for step in history {
        let crashed = std::mem::replace(&mut crash_pending, matches!(step, Step::Crash(_)));
        match step {
            Step::Deliver(delivery) => count(delivery, &mut faults),
            Step::Batch(deliveries) => {
                faults.batches += 1;
                for delivery in deliveries {
                    count(delivery, &mut faults);
                }
            }
            Step::Resolve { stale, .. } => {
                faults.resolutions += 1;
                faults.stale_resolutions += u64::from(*stale);
            }
            Step::SkipGap { stale, .. } => {
                faults.gap_skips += 1;
                faults.stale_resolutions += u64::from(*stale);
            }
            Step::StartSession(_) => faults.sessions += 1,
            Step::Transfer {
                stale_owner,
                stale_last,
                repeat,
                ..
            } => {
                faults.transfers += 1;
                faults.stale_transfers += u64::from(*stale_owner || *stale_last || *repeat);
                faults.crashed_transfers += u64::from(crashed);
            }
            Step::Crash(_) => faults.crashes += 1,
        }
    }
    faults
}
