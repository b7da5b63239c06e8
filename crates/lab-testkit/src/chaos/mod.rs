//! `production-lab chaos`: a Jepsen-style campaign against the gate's deployment across hosts.
//!
//! Each run builds the deployment in network namespaces ([`topology`]): PostgreSQL with TLS and
//! SCRAM, three NATS nodes with TLS, credentials and `sync_interval: always`, two gates, and a
//! host per producer. Producers behaving like real clients ([`producers`]) send over both
//! doors while a nemesis drawn from the seed ([`nemesis`]) cuts links, pauses, kills and
//! restarts services; the output stream is read live and again in full at the end
//! ([`reader`]). Everything lands in a history ([`history`], JSON lines) that a checker written
//! apart from the gate's code judges ([`checker`]).

pub mod checker;
pub mod history;
pub mod https;
pub mod nemesis;
pub mod producers;
pub mod reader;
pub mod services;
pub mod topology;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::Method;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::nats::NatsServer;
use crate::netns::{Topology, enter};
use crate::pg::{ClusterOptions, PrivateCluster};

use checker::{Verdict, Violation};
use history::{Event, Outcome, Recorder};
use https::HttpsClient;
use nemesis::{Fault, Targets};
use producers::{Phase, Producer, ProducerSetup, SharedPhase};
use reader::LiveView;
use services::GateNode;
use topology::{Authority, Hosts, NatsSync};

/// Why a campaign could not run (not a violation: those are in its report).
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    #[error(transparent)]
    Postgres(#[from] crate::pg::ClusterError),
    #[error(transparent)]
    Nats(#[from] crate::nats::NatsServerError),
    #[error(transparent)]
    LazyFs(#[from] crate::lazyfs::LazyFsError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl ChaosError {
    pub fn setup(what: &str, error: impl std::fmt::Display) -> ChaosError {
        ChaosError::Setup(format!("{what}: {error}"))
    }
}

/// A known bug a run plants, to show that the checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Plant {
    /// The gates' publisher without its fence (`GATE_PLANTED_BUG=fence-off`).
    FenceOff,
    /// The gates' NATS input acked before its COMMIT (`GATE_PLANTED_BUG=ack-before-commit`).
    AckBeforeCommit,
    /// NATS with its default lazy fsync, its stores on lazy file systems, and a nemesis that
    /// kills a majority of the nodes with a power loss.
    LazyFsync,
}

impl Plant {
    pub fn name(self) -> &'static str {
        match self {
            Plant::FenceOff => "fence-off",
            Plant::AckBeforeCommit => "ack-before-commit",
            Plant::LazyFsync => "lazy-fsync",
        }
    }

    /// Whether the gate binary must be built with the `planted-bugs` feature for it.
    pub fn in_the_gate(self) -> bool {
        !matches!(self, Plant::LazyFsync)
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub seed: u64,
    /// How long producers send and the nemesis acts.
    pub duration: Duration,
    /// The `production-lab` binary the gates run.
    pub gate_binary: PathBuf,
    pub producers: usize,
    pub plant: Option<Plant>,
    /// The NATS stores on lazy file systems and majority kills with a power loss, NATS syncing
    /// every write: the control run of the `lazy-fsync` plant (which implies the rest).
    pub power_loss: bool,
    /// Play only these faults of the seed's schedule (a replay of a shortened schedule).
    pub only_faults: Option<Vec<usize>>,
    /// Where the history goes (`history-SEED.jsonl`), if anywhere.
    pub dir: Option<PathBuf>,
    /// Progress lines on stderr.
    pub verbose: bool,
}

/// What one run came to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunReport {
    pub seed: u64,
    pub plant: Option<Plant>,
    /// Lazy stores and power losses (see [`RunOptions::power_loss`]).
    #[serde(default)]
    pub power_loss: bool,
    pub duration_s: f64,
    /// The whole run, setup and final reading included.
    pub wall_s: f64,
    pub faults: Vec<Fault>,
    pub faults_by_kind: BTreeMap<String, u64>,
    pub verdict: Verdict,
    /// The faults whose windows overlapped the violating operations (empty without one).
    pub shortened: Vec<Fault>,
    pub history: Option<PathBuf>,
}

/// Whether a run with `plant` and `power_loss` puts the NATS stores on lazy file systems, so
/// that majority kills lose what the nodes did not sync.
pub fn lazy_stores(plant: Option<Plant>, power_loss: bool) -> bool {
    power_loss || plant == Some(Plant::LazyFsync)
}

impl RunOptions {
    /// See [`lazy_stores`].
    pub fn lazy_stores(&self) -> bool {
        lazy_stores(self.plant, self.power_loss)
    }
}

impl RunReport {
    pub fn passed(&self) -> bool {
        self.verdict.violations.is_empty()
    }

    /// The power-loss control: lazy stores with no bug planted (the plant implies them).
    fn power_loss_control(&self) -> bool {
        self.power_loss && self.plant.is_none()
    }

    /// The command that replays this run's seed with `faults` only (the whole schedule if
    /// there are none).
    pub fn replay_command(&self, faults: &[Fault]) -> String {
        let ids: Vec<String> = faults.iter().map(|fault| fault.id.to_string()).collect();
        format!(
            "production-lab chaos --seed {} --duration {:.0}{}{}{}",
            self.seed,
            self.duration_s,
            self.plant
                .map(|plant| format!(" --plant {}", plant.name()))
                .unwrap_or_default(),
            if self.power_loss_control() {
                " --power-loss"
            } else {
                ""
            },
            if ids.is_empty() {
                String::new()
            } else {
                format!(" --faults {}", ids.join(","))
            }
        )
    }
}

/// The output's duplicate window: shorter than every gate pause, so that it cannot be what
/// keeps a stale publisher's copy out.
pub const OUTPUT_DUPLICATE_WINDOW: Duration = Duration::from_secs(2);
/// How long producers may take to finish what they began, once every fault is healed.
const FINISH_LIMIT: Duration = Duration::from_secs(90);
/// How long the output may take to carry everything acknowledged, after that.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// The services of a run, shared by the nemesis and the campaign.
struct Services {
    // Dropped first: the gates, then NATS, then PostgreSQL.
    gates: Mutex<Vec<GateNode>>,
    nats: Mutex<Vec<NatsServer>>,
    /// The NATS nodes' lazy file systems (empty unless the run has them), unmounted once the
    /// nodes are stopped and before their directory is removed.
    stores: Vec<crate::lazyfs::LazyFs>,
    postgres: PrivateCluster,
    authority: Authority,
    nats_dir: tempfile::TempDir,
    /// The campaign's operator token (it registers the producers and reads positions).
    operator: String,
    producers: Vec<(String, String)>,
}

/// Runs one campaign: builds the deployment, plays the seed's faults against producers for
/// `duration`, heals, drains, reads the output in full, checks. Everything it made is removed
/// when it returns, whatever happened.
pub fn run(options: &RunOptions) -> Result<RunReport, ChaosError> {
    let wall = Instant::now();
    let mut faults = nemesis::schedule(
        options.seed,
        options.duration,
        options.producers,
        options.lazy_stores(),
    );
    if let Some(only) = &options.only_faults {
        faults.retain(|fault| only.contains(&fault.id));
    }
    let mut topology = Topology::new()?;
    let hosts = topology::hosts(&mut topology, options.producers)?;
    let topology = &topology;
    let hosts = &hosts;
    let services = std::thread::scope(|scope| {
        scope
            .spawn(|| in_namespace(&hosts.client, setup(topology, hosts, options)))
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })??;
    if options.verbose {
        eprintln!(
            "chaos seed {}: deployment up, {} faults scheduled",
            options.seed,
            faults.len()
        );
    }
    let recorder = Recorder::new();
    let events = campaign(topology, hosts, &services, options, &faults, &recorder);
    keep_gate_logs(&services, options);
    drop(services);
    let events = events?;
    let verdict = checker::check(&events);
    let history = match &options.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            let path = dir.join(format!("history-{}.jsonl", options.seed));
            history::write_lines(&path, &events)?;
            Some(path)
        }
        None => None,
    };
    let mut faults_by_kind = BTreeMap::new();
    for fault in &faults {
        *faults_by_kind
            .entry(fault.kind.name().to_owned())
            .or_insert(0) += 1;
    }
    let shortened = overlapping(&faults, &events, &verdict.violations);
    Ok(RunReport {
        seed: options.seed,
        plant: options.plant,
        power_loss: options.lazy_stores(),
        duration_s: options.duration.as_secs_f64(),
        wall_s: wall.elapsed().as_secs_f64(),
        faults,
        faults_by_kind,
        verdict,
        shortened,
        history,
    })
}

/// Copies each gate's log into the run's directory (`gate-N-seed-S.log`), if it has one.
fn keep_gate_logs(services: &Services, options: &RunOptions) {
    let Some(dir) = &options.dir else {
        return;
    };
    let _ = std::fs::create_dir_all(dir);
    let gates = services
        .gates
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (index, gate) in gates.iter().enumerate() {
        let _ = std::fs::copy(
            gate.files.log(),
            dir.join(format!("gate-{index}-seed-{}.log", options.seed)),
        );
    }
}

/// Runs `future` on a runtime of a thread that entered `host`'s namespace.
fn in_namespace<T>(
    host: &crate::netns::Host,
    future: impl std::future::Future<Output = T>,
) -> Result<T, ChaosError> {
    enter(host)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    Ok(runtime.block_on(future))
}

/// PostgreSQL, the NATS cluster and its streams, both gates, the operator and the producers'
/// registrations.
async fn setup(
    topology: &Topology,
    hosts: &Hosts,
    options: &RunOptions,
) -> Result<Services, ChaosError> {
    let authority = Authority::new()?;
    let postgres = topology::postgres(
        hosts,
        &authority,
        ClusterOptions {
            fsync: true,
            max_connections: 300,
            statement_statistics: false,
        },
    )
    .await?;
    let nats_dir = tempfile::tempdir()?;
    let gate_key = nkeys::KeyPair::new_user();
    let seed = gate_key
        .seed()
        .map_err(|error| ChaosError::setup("the gates' nkey", error))?;
    let sync = match options.plant {
        Some(Plant::LazyFsync) => NatsSync::Lazy,
        _ => NatsSync::Always,
    };
    let stores = if options.lazy_stores() {
        topology::lazy_stores(nats_dir.path(), hosts.nats.len())?
    } else {
        Vec::new()
    };
    let nats = topology::nats_cluster(
        topology,
        hosts,
        &authority,
        nats_dir.path(),
        &gate_key.public_key(),
        sync,
        &stores,
    )?;
    let js = topology::producer_jetstream(hosts, &nats_dir.path().join("ca.pem")).await?;
    topology::create_streams(&js, OUTPUT_DUPLICATE_WINDOW).await?;

    let names: Vec<String> = hosts
        .gates
        .iter()
        .map(|host| host.address.to_string())
        .collect();
    let https = authority.server(&names)?;
    let env: Vec<(String, String)> = options
        .plant
        .filter(|plant| plant.in_the_gate())
        .map(|plant| ("GATE_PLANTED_BUG".to_owned(), plant.name().to_owned()))
        .into_iter()
        .collect();
    let mut gates = Vec::new();
    for (index, host) in hosts.gates.iter().enumerate() {
        let files = topology::gate_files(
            host,
            &hosts.postgres_address_for(index)?,
            hosts,
            &authority,
            &https,
            &seed,
        )?;
        let mut gate = GateNode::new(
            host.clone(),
            options.gate_binary.clone(),
            files,
            env.clone(),
        );
        gate.start(topology)?;
        gates.push(gate);
    }
    let operator = add_operator(&options.gate_binary, &postgres.socket_url("gate"))?;
    let client = HttpsClient::trusting(&authority.ca_pem)
        .map_err(|error| ChaosError::setup("the HTTPS client", error))?;
    let mut producers = Vec::new();
    for index in 0..options.producers {
        let name = format!("p{index}");
        let token = register_producer(&client, &gates[index % 2].url, &operator, &name).await?;
        producers.push((name, token));
    }
    Ok(Services {
        gates: Mutex::new(gates),
        nats: Mutex::new(nats),
        stores,
        postgres,
        authority,
        nats_dir,
        operator,
        producers,
    })
}

/// `production-lab operator add chaos --inbox URL`: the token it prints.
fn add_operator(binary: &Path, inbox: &str) -> Result<String, ChaosError> {
    let output = std::process::Command::new(binary)
        .args(["operator", "add", "chaos", "--inbox", inbox])
        .env_remove("LAB_ENVIRONMENT")
        .env_remove("LAB_LOG")
        .output()?;
    if !output.status.success() {
        return Err(ChaosError::Setup(format!(
            "operator add: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

async fn register_producer(
    client: &HttpsClient,
    gate: &str,
    operator: &str,
    name: &str,
) -> Result<String, ChaosError> {
    let answer = topology::retry_within(
        &format!("registering producer {name}"),
        Duration::from_secs(30),
        || async {
            let answer = client
                .send(
                    Method::POST,
                    &format!("{gate}/v1/producers"),
                    &[("authorization", format!("Bearer {operator}"))],
                    Some(&serde_json::json!({ "name": name })),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|error| error.to_string())?;
            if answer.status == 201 {
                Ok(answer)
            } else {
                Err(format!(
                    "{} {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                ))
            }
        },
    )
    .await?;
    answer.json()["token"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ChaosError::Setup(format!("no token for producer {name}")))
}

/// The campaign proper: producers, the nemesis and the live reader at once for the duration;
/// then every fault healed, the producers' sends finished, the output drained and read in full.
fn campaign(
    topology: &Topology,
    hosts: &Hosts,
    services: &Services,
    options: &RunOptions,
    faults: &[Fault],
    recorder: &Recorder,
) -> Result<Vec<Event>, ChaosError> {
    let phase = SharedPhase::default();
    let nemesis_stop = AtomicBool::new(false);
    let healed = AtomicBool::new(false);
    let finished_producers = AtomicUsize::new(0);
    let ca = services.nats_dir.path().join("ca.pem");
    let https = HttpsClient::trusting(&services.authority.ca_pem)
        .map_err(|error| ChaosError::setup("the HTTPS client", error))?;
    let gate_urls: Vec<String> = {
        let gates = services
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        gates.iter().map(|gate| gate.url.clone()).collect()
    };
    let mut rng = StdRng::seed_from_u64(options.seed);
    let targets = Targets {
        topology,
        hosts,
        gates: &services.gates,
        nats: &services.nats,
        stores: &services.stores,
        postgres: &services.postgres,
    };
    let targets = &targets;
    std::thread::scope(|scope| {
        let nemesis = scope.spawn(|| {
            nemesis::play(targets, faults, recorder, &nemesis_stop);
            targets.heal_everything(options.producers);
            healed.store(true, Ordering::SeqCst);
        });
        let mut producer_threads = Vec::new();
        for (index, (name, token)) in services.producers.iter().enumerate() {
            let setup = ProducerSetup {
                index,
                name: name.clone(),
                token: token.clone(),
                reader_token: services.operator.clone(),
                gates: gate_urls.clone(),
                https: https.clone(),
                seed: options.seed,
                restarts: rng.random_bool(0.5),
            };
            let span = options.duration.as_millis() as u64;
            let restart_at = Duration::from_millis(rng.random_range(span / 4..=span * 3 / 4));
            let (recorder, phase, ca) = (recorder.clone(), phase.clone(), ca.clone());
            let host = &hosts.producers[index];
            let finished = &finished_producers;
            producer_threads.push(scope.spawn(move || {
                let result = in_namespace(host, async move {
                    let client = topology::producer_client(hosts, &ca).await?;
                    let mut js = async_nats::jetstream::new(client.clone());
                    js.set_timeout(Duration::from_secs(5));
                    Producer::new(setup, js, recorder, phase)
                        .run(client, restart_at)
                        .await;
                    Ok::<(), ChaosError>(())
                });
                finished.fetch_add(1, Ordering::SeqCst);
                result
            }));
        }
        let reading = scope.spawn(|| {
            in_namespace(
                &hosts.client,
                observe(
                    hosts,
                    services,
                    options,
                    recorder,
                    &phase,
                    &healed,
                    &finished_producers,
                ),
            )
        });
        let observed = reading.join();
        nemesis_stop.store(true, Ordering::SeqCst);
        phase.set(Phase::Stopped);
        let _ = nemesis.join();
        for thread in producer_threads {
            if let Ok(Err(error)) = thread.join() {
                eprintln!("chaos: a producer stopped early: {error}");
            }
        }
        match observed {
            Ok(result) => result.and_then(|inner| inner),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })?;
    Ok(recorder.events())
}

/// On the client host: reads the output live for the duration, then lets the producers finish
/// once every fault is healed, waits for the output to carry what was acknowledged, and reads
/// it in full.
async fn observe(
    hosts: &Hosts,
    services: &Services,
    options: &RunOptions,
    recorder: &Recorder,
    phase: &SharedPhase,
    healed: &AtomicBool,
    finished_producers: &AtomicUsize,
) -> Result<(), ChaosError> {
    let js = topology::producer_jetstream(hosts, &services.nats_dir.path().join("ca.pem")).await?;
    let view = LiveView::default();
    let stop_reading = Arc::new(AtomicBool::new(false));
    let live = tokio::spawn(reader::read_live(
        js.clone(),
        recorder.clone(),
        view.clone(),
        stop_reading.clone(),
    ));
    tokio::time::sleep(options.duration).await;
    let progress = |what: &str| {
        if options.verbose {
            eprintln!(
                "chaos seed {}: {what} at {:.1} s",
                options.seed,
                recorder.now_ms() as f64 / 1000.0
            );
        }
    };
    progress("producing ends");
    wait_for(Duration::from_secs(120), || healed.load(Ordering::SeqCst)).await;
    progress("every fault healed");
    phase.set(Phase::Finishing);
    let all_finished = || finished_producers.load(Ordering::SeqCst) >= options.producers;
    if !wait_for(FINISH_LIMIT, all_finished).await {
        progress("producers still retrying; stopped");
        phase.set(Phase::Stopped);
        wait_for(Duration::from_secs(15), all_finished).await;
    }
    progress("producers finished");
    drain(&js, recorder, &view).await;
    progress("output drained");
    stop_reading.store(true, Ordering::SeqCst);
    let _ = live.await;
    reader::read_everything(&js, recorder).await?;
    progress("output read in full");
    Ok(())
}

/// Polls `done` every 100 ms for at most `within`: whether it came true.
async fn wait_for(within: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    true
}

/// Waits until the live reader has seen every sequence an operation got acknowledged and the
/// stream has stopped growing for three seconds (a late stale copy would still come), or
/// [`DRAIN_LIMIT`] passed.
async fn drain(js: &async_nats::jetstream::Context, recorder: &Recorder, view: &LiveView) {
    let acknowledged: Vec<(String, i64)> = recorder
        .events()
        .iter()
        .filter_map(|event| match event {
            Event::Op(op) if op.outcome == Outcome::Ok => Some((op.aggregate.clone(), op.sequence)),
            _ => None,
        })
        .collect();
    let deadline = tokio::time::Instant::now() + DRAIN_LIMIT;
    let mut last = (0, tokio::time::Instant::now());
    while tokio::time::Instant::now() < deadline {
        let stream_last = reader::last_sequence(js).await.unwrap_or(0);
        if stream_last != last.0 {
            last = (stream_last, tokio::time::Instant::now());
        }
        let covered = acknowledged
            .iter()
            .all(|(aggregate, sequence)| view.contains(aggregate, *sequence));
        let quiet = last.1.elapsed() >= Duration::from_secs(3);
        if covered && quiet && view.last_stream_sequence() >= stream_last {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A schedule shortened by replays that still showed a violation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shortened {
    /// The fewest faults a replay failed with (the whole schedule if no replay failed).
    pub faults: Vec<Fault>,
    /// The replays run, and how many of them found a violation.
    pub replays: usize,
    pub failed_replays: usize,
}

/// Replays `report`'s seed with fewer faults while a violation persists, `attempts` replays at
/// most: the faults around the violating operations alone (unless that is the whole schedule,
/// which already failed), then halves of what still fails, then without each fault in turn.
/// A replay runs until five seconds after its last fault (20 s at least), so a short schedule
/// costs little. The interleavings are not the seed's, so a replay that passes only says that
/// this one did not fail.
pub fn shorten(
    options: &RunOptions,
    report: &RunReport,
    attempts: usize,
) -> Result<Shortened, ChaosError> {
    let mut result = Shortened {
        faults: report.faults.clone(),
        replays: 0,
        failed_replays: 0,
    };
    let replay = |faults: &[Fault], result: &mut Shortened| -> Result<bool, ChaosError> {
        if result.replays >= attempts || faults.is_empty() {
            return Ok(false);
        }
        let end = faults
            .iter()
            .map(|fault| fault.start_ms + fault.length_ms)
            .max()
            .unwrap_or(0);
        let replay = RunOptions {
            duration: Duration::from_millis((end + 5_000).max(20_000)),
            only_faults: Some(faults.iter().map(|fault| fault.id).collect()),
            dir: None,
            verbose: false,
            ..options.clone()
        };
        let replayed = run(&replay)?;
        result.replays += 1;
        if options.verbose {
            eprintln!(
                "chaos seed {}: replay with faults {:?}: {} violation(s)",
                options.seed,
                faults.iter().map(|fault| fault.id).collect::<Vec<_>>(),
                replayed.verdict.violations.len()
            );
        }
        let failed = !replayed.passed();
        if failed {
            result.failed_replays += 1;
            result.faults = faults.to_vec();
        }
        Ok(failed)
    };
    let mut kept = if report.shortened.is_empty() {
        report.faults.clone()
    } else {
        report.shortened.clone()
    };
    if kept.len() < report.faults.len() && !replay(&kept, &mut result)? {
        return Ok(result);
    }
    while kept.len() > 1 && result.replays < attempts {
        let (first, second) = kept.split_at(kept.len() / 2);
        let (first, second) = (first.to_vec(), second.to_vec());
        if replay(&first, &mut result)? {
            kept = first;
        } else if replay(&second, &mut result)? {
            kept = second;
        } else {
            break;
        }
    }
    let mut index = 0;
    while kept.len() > 1 && index < kept.len() && result.replays < attempts {
        let mut fewer = kept.clone();
        fewer.remove(index);
        if replay(&fewer, &mut result)? {
            kept = fewer;
        } else {
            index += 1;
        }
    }
    Ok(result)
}

/// The faults whose windows overlapped (within two seconds) the operations of a violation.
fn overlapping(faults: &[Fault], events: &[Event], violations: &[Violation]) -> Vec<Fault> {
    let windows: BTreeMap<usize, (u64, u64)> = events
        .iter()
        .filter_map(|event| match event {
            Event::Fault(window) => Some((window.id, (window.start_ms, window.end_ms))),
            _ => None,
        })
        .collect();
    faults
        .iter()
        .filter(|fault| {
            let Some(&(start, end)) = windows.get(&fault.id) else {
                return false;
            };
            violations.iter().any(|violation| {
                violation.window_ms.is_some_and(|(from, to)| {
                    start <= to.saturating_add(2_000) && from.saturating_sub(2_000) <= end
                })
            })
        })
        .copied()
        .collect()
}

/// A report as text: the totals, the faults, the availability, the violations.
pub fn render(report: &RunReport) -> String {
    let totals = &report.verdict.totals;
    let mut text = format!(
        "chaos seed {}{}{}: {:.0} s of faults ({:.0} s in all): {} faults; {} operations ({} https, {} nats): {} ok, {} refused, {} indeterminate; {} sessions, {} gap notices; output: {} messages of {} aggregates ({} skip markers), {} read live; {} acknowledged inputs checked; {} violation(s)\n",
        report.seed,
        report
            .plant
            .map(|plant| format!(" (planted: {})", plant.name()))
            .unwrap_or_default(),
        if report.power_loss_control() {
            " (power loss)"
        } else {
            ""
        },
        report.duration_s,
        report.wall_s,
        report.faults.len(),
        totals.operations,
        totals.https,
        totals.nats,
        totals.ok,
        totals.fail,
        totals.indeterminate,
        totals.sessions,
        totals.notices,
        totals.output_messages,
        totals.aggregates,
        totals.skip_markers,
        totals.live_reads,
        totals.must_appear,
        report.verdict.violations.len(),
    );
    let kinds: Vec<String> = report
        .faults_by_kind
        .iter()
        .map(|(kind, count)| format!("{kind} ×{count}"))
        .collect();
    text.push_str(&format!("  faults: {}\n", kinds.join(", ")));
    text.push_str("  availability (window: operations, ok %, refused, indeterminate, ok latency p50/p99/max ms):\n");
    for row in &report.verdict.availability {
        text.push_str(&format!(
            "    {}: {}, {:.1} %, {}, {}, {}/{}/{}\n",
            row.window,
            row.operations,
            row.ok_ratio() * 100.0,
            row.fail,
            row.indeterminate,
            row.ok_p50_ms,
            row.ok_p99_ms,
            row.ok_max_ms
        ));
    }
    for violation in report.verdict.violations.iter().take(20) {
        text.push_str(&format!("  VIOLATION {violation}\n"));
    }
    if report.verdict.violations.len() > 20 {
        text.push_str(&format!(
            "  … and {} more violations\n",
            report.verdict.violations.len() - 20
        ));
    }
    if !report.passed() {
        text.push_str(&format!(
            "  seed {} fails; the faults around the violating operations:\n",
            report.seed
        ));
        for fault in &report.shortened {
            text.push_str(&format!("    {fault}\n"));
        }
        text.push_str(&format!(
            "  replay: {}\n",
            report.replay_command(&report.shortened)
        ));
    }
    text
}
