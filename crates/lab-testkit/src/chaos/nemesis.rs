//! The nemesis: a schedule of faults drawn from the seed alone, then played against the hosts.
//! One fault at a time, each with its window and its recovery, so that at most one NATS node of
//! three is ever down or cut off (a minority) — except the majority kill, which only runs with
//! the NATS stores on lazy file systems draw (the `lazy-fsync` plant, or `--power-loss`): the
//! killed nodes' stores then forget what they did not sync, as in a power failure.
//!
//! Which faults break "PostgreSQL and a NATS majority up" (the condition under which the gates
//! must stay live): a PostgreSQL pause or restart, and the majority kill. Every other fault
//! leaves one path for each request: the other gate, the other NATS nodes.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::lazyfs::LazyFs;
use crate::nats::NatsServer;
use crate::netns::Topology;
use crate::pg::PrivateCluster;

use super::history::{Event, FaultWindow, Recorder};
use super::services::{GateNode, signal};
use super::topology::Hosts;

/// One kind of fault and its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum FaultKind {
    /// A gate's link to PostgreSQL down.
    PartitionGatePostgres {
        gate: usize,
    },
    /// A gate cut from every NATS node.
    PartitionGateNats {
        gate: usize,
    },
    /// A NATS node cut from the other two (its clients still reach it).
    IsolateNatsNode {
        node: usize,
    },
    /// A producer cut from a gate.
    PartitionProducerGate {
        producer: usize,
        gate: usize,
    },
    /// SIGSTOP, then SIGCONT.
    PauseGate {
        gate: usize,
    },
    PausePostgres,
    PauseNatsNode {
        node: usize,
    },
    /// SIGKILL, then started again.
    CrashGate {
        gate: usize,
    },
    CrashNatsNode {
        node: usize,
    },
    /// `pg_ctl stop -m immediate`, then started again.
    RestartPostgres,
    /// Two NATS nodes of three killed at once, each store losing what it did not sync (runs
    /// with lazy stores only).
    KillNatsMajority {
        spared: usize,
    },
}

impl FaultKind {
    /// The kind's name, the same for every target.
    pub fn name(&self) -> &'static str {
        match self {
            FaultKind::PartitionGatePostgres { .. } => "partition gate-postgres",
            FaultKind::PartitionGateNats { .. } => "partition gate-nats",
            FaultKind::IsolateNatsNode { .. } => "partition nats-node",
            FaultKind::PartitionProducerGate { .. } => "partition producer-gate",
            FaultKind::PauseGate { .. } => "pause gate",
            FaultKind::PausePostgres => "pause postgres",
            FaultKind::PauseNatsNode { .. } => "pause nats-node",
            FaultKind::CrashGate { .. } => "crash gate",
            FaultKind::CrashNatsNode { .. } => "crash nats-node",
            FaultKind::RestartPostgres => "restart postgres",
            FaultKind::KillNatsMajority { .. } => "kill nats-majority",
        }
    }

    /// What it hits.
    pub fn target(&self) -> String {
        match *self {
            FaultKind::PartitionGatePostgres { gate }
            | FaultKind::PartitionGateNats { gate }
            | FaultKind::PauseGate { gate }
            | FaultKind::CrashGate { gate } => format!("gate {gate}"),
            FaultKind::IsolateNatsNode { node }
            | FaultKind::PauseNatsNode { node }
            | FaultKind::CrashNatsNode { node } => format!("nats {node}"),
            FaultKind::PartitionProducerGate { producer, gate } => {
                format!("producer {producer}, gate {gate}")
            }
            FaultKind::PausePostgres | FaultKind::RestartPostgres => "postgres".to_owned(),
            FaultKind::KillNatsMajority { spared } => format!("all nats but {spared}"),
        }
    }

    /// Whether PostgreSQL or a NATS majority is unavailable during it.
    pub fn breaks_liveness(&self) -> bool {
        matches!(
            self,
            FaultKind::PausePostgres
                | FaultKind::RestartPostgres
                | FaultKind::KillNatsMajority { .. }
        )
    }
}

/// A fault of the schedule: its kind, when it starts and how long it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fault {
    pub id: usize,
    #[serde(flatten)]
    pub kind: FaultKind,
    pub start_ms: u64,
    pub length_ms: u64,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "#{} {} ({}) at {:.1} s for {:.1} s",
            self.id,
            self.kind.name(),
            self.kind.target(),
            self.start_ms as f64 / 1000.0,
            self.length_ms as f64 / 1000.0
        )
    }
}

/// The first fault starts after this, once the traffic flows.
const WARM_UP_MS: u64 = 3_000;
/// The last fault ends this long before the campaign's end.
const COOL_DOWN_MS: u64 = 2_000;

/// The schedule of a campaign of `duration` with `producers` producers, from `seed` alone.
/// `majority_kills` adds the majority kill (runs with lazy stores) as one fault in three.
pub fn schedule(
    seed: u64,
    duration: Duration,
    producers: usize,
    majority_kills: bool,
) -> Vec<Fault> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e65_6d65_7369_7321);
    let end = u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_sub(COOL_DOWN_MS);
    let mut faults = Vec::new();
    let mut at = WARM_UP_MS;
    loop {
        let kind = if majority_kills && rng.random_bool(1.0 / 3.0) {
            FaultKind::KillNatsMajority {
                spared: rng.random_range(0..3),
            }
        } else {
            draw(&mut rng, producers)
        };
        // Pauses outlast the output's duplicate window, so that it is not what keeps a stale
        // copy out.
        let length_ms = match kind {
            FaultKind::PauseGate { .. } => rng.random_range(3_000..9_000),
            _ => rng.random_range(2_000..8_000),
        };
        if at + length_ms > end {
            break;
        }
        faults.push(Fault {
            id: faults.len(),
            kind,
            start_ms: at,
            length_ms,
        });
        at += length_ms + rng.random_range(1_000..3_000);
    }
    faults
}

fn draw(rng: &mut StdRng, producers: usize) -> FaultKind {
    let gate = rng.random_range(0..2);
    let node = rng.random_range(0..3);
    match rng.random_range(0..10) {
        0 => FaultKind::PartitionGatePostgres { gate },
        1 => FaultKind::PartitionGateNats { gate },
        2 => FaultKind::IsolateNatsNode { node },
        3 => FaultKind::PartitionProducerGate {
            producer: rng.random_range(0..producers.max(1)),
            gate,
        },
        4 => FaultKind::PauseGate { gate },
        5 => FaultKind::PausePostgres,
        6 => FaultKind::PauseNatsNode { node },
        7 => FaultKind::CrashGate { gate },
        8 => FaultKind::CrashNatsNode { node },
        _ => FaultKind::RestartPostgres,
    }
}

/// What the nemesis acts on.
pub struct Targets<'a> {
    pub topology: &'a Topology,
    pub hosts: &'a Hosts,
    pub gates: &'a Mutex<Vec<GateNode>>,
    pub nats: &'a Mutex<Vec<NatsServer>>,
    /// Each NATS node's lazy file system, when the run has them: a majority kill is a power
    /// loss for the killed nodes.
    pub stores: &'a [LazyFs],
    pub postgres: &'a PrivateCluster,
}

/// What went wrong while applying or healing a fault (it is logged, and the run goes on).
fn note(what: &str, result: Result<(), String>) {
    if let Err(error) = result {
        eprintln!("chaos nemesis: {what}: {error}");
    }
}

impl Targets<'_> {
    fn gate_pid(&self, gate: usize) -> Vec<u32> {
        let gates = self
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        gates
            .get(gate)
            .and_then(GateNode::pid)
            .into_iter()
            .collect()
    }

    fn nats_pid(&self, node: usize) -> Vec<u32> {
        let nats = self
            .nats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        nats.get(node)
            .and_then(NatsServer::pid)
            .into_iter()
            .collect()
    }

    fn with_nats(
        &self,
        node: usize,
        action: impl FnOnce(&mut NatsServer) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut nats = self
            .nats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match nats.get_mut(node) {
            Some(server) => action(server),
            None => Err(format!("no NATS node {node}")),
        }
    }

    fn start_gate(&self, gate: usize) -> Result<(), String> {
        let mut gates = self
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let node = gates
            .get_mut(gate)
            .ok_or_else(|| format!("no gate {gate}"))?;
        let mut last = String::new();
        for _ in 0..3 {
            match node.start(self.topology) {
                Ok(()) => return Ok(()),
                Err(error) => last = error.to_string(),
            }
        }
        Err(last)
    }

    /// Applies (`on`) or heals (`!on`) `kind`.
    pub fn set(&self, kind: FaultKind, on: bool) {
        let hosts = self.hosts;
        let topology = self.topology;
        let cut = |a, b| {
            topology
                .set_reachable(a, b, !on)
                .map_err(|error| error.to_string())
        };
        let pause = if on { "STOP" } else { "CONT" };
        match kind {
            FaultKind::PartitionGatePostgres { gate } => note(
                "gate-postgres link",
                topology
                    .set_link(&hosts.store_links[gate], !on)
                    .map_err(|error| error.to_string()),
            ),
            FaultKind::PartitionGateNats { gate } => {
                for node in &hosts.nats {
                    note("gate-nats routes", cut(&hosts.gates[gate], node));
                }
            }
            FaultKind::IsolateNatsNode { node } => {
                for (other, host) in hosts.nats.iter().enumerate() {
                    if other != node {
                        note("nats routes", cut(&hosts.nats[node], host));
                    }
                }
            }
            FaultKind::PartitionProducerGate { producer, gate } => {
                if let Some(host) = hosts.producers.get(producer) {
                    note("producer-gate routes", cut(host, &hosts.gates[gate]));
                }
            }
            FaultKind::PauseGate { gate } => signal(&self.gate_pid(gate), pause),
            FaultKind::PausePostgres => signal(&topology.pids(&hosts.postgres), pause),
            FaultKind::PauseNatsNode { node } => signal(&self.nats_pid(node), pause),
            FaultKind::CrashGate { gate } => {
                if on {
                    let mut gates = self
                        .gates
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if let Some(node) = gates.get_mut(gate) {
                        node.kill();
                    }
                } else {
                    note("gate start", self.start_gate(gate));
                }
            }
            FaultKind::CrashNatsNode { node } => self.crash_nats(node, on),
            FaultKind::RestartPostgres => {
                let result = if on {
                    self.postgres.stop_immediately()
                } else {
                    self.postgres.start_again()
                };
                note(
                    "postgres restart",
                    result.map_err(|error| error.to_string()),
                );
            }
            FaultKind::KillNatsMajority { spared } => {
                let killed = (0..3).filter(|node| *node != spared);
                for node in killed.clone() {
                    self.crash_nats(node, on);
                }
                if on {
                    // Dead processes hold no file open: their stores forget what they did not
                    // sync before they start again.
                    for node in killed {
                        self.lose_unsynced(node);
                    }
                }
            }
        }
    }

    fn crash_nats(&self, node: usize, on: bool) {
        note(
            "nats crash",
            self.with_nats(node, |server| {
                if on {
                    server.kill();
                    Ok(())
                } else {
                    server.start_again().map_err(|error| error.to_string())
                }
            }),
        );
    }

    /// A power loss of NATS node `node`'s store, if it is on a lazy file system.
    fn lose_unsynced(&self, node: usize) {
        if let Some(store) = self.stores.get(node) {
            match store.lose_unsynced() {
                Ok(loss) => eprintln!("chaos nemesis: power loss on nats {node}: {loss}"),
                Err(error) => note("nats power loss", Err(error.to_string())),
            }
        }
    }

    /// Heals everything the nemesis can have done: links up, routes back, processes continued,
    /// crashed ones started again.
    pub fn heal_everything(&self, producers: usize) {
        let hosts = self.hosts;
        for gate in 0..2 {
            self.set(FaultKind::PartitionGatePostgres { gate }, false);
            self.set(FaultKind::PartitionGateNats { gate }, false);
            self.set(FaultKind::PauseGate { gate }, false);
            for producer in 0..producers {
                self.set(FaultKind::PartitionProducerGate { producer, gate }, false);
            }
        }
        for node in 0..hosts.nats.len() {
            self.set(FaultKind::IsolateNatsNode { node }, false);
            self.set(FaultKind::PauseNatsNode { node }, false);
        }
        self.set(FaultKind::PausePostgres, false);
        let _ = self.postgres.start_again();
        for node in 0..hosts.nats.len() {
            let running = self.with_nats(node, |server| {
                if server.pid().is_some() {
                    Ok(())
                } else {
                    Err("killed".to_owned())
                }
            });
            if running.is_err() {
                self.crash_nats(node, false);
            }
        }
        for gate in 0..2 {
            let running = {
                let mut gates = self
                    .gates
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                gates.get_mut(gate).is_some_and(GateNode::is_running)
            };
            if !running {
                note("gate start", self.start_gate(gate));
            }
        }
    }
}

/// Plays `faults` from `started` on: each applied at its start and healed at its end, recorded
/// with the times it really had. Stops early (healing the fault in hand) when `stop` says so.
pub fn play(
    targets: &Targets,
    faults: &[Fault],
    recorder: &Recorder,
    stop: &std::sync::atomic::AtomicBool,
) {
    let started = Instant::now();
    let wait_until = |ms: u64| {
        let at = Duration::from_millis(ms);
        while started.elapsed() < at {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return false;
            }
            // The schedule's clock: faults start and end at the times drawn.
            std::thread::sleep((at - started.elapsed()).min(Duration::from_millis(50)));
        }
        true
    };
    for fault in faults {
        if !wait_until(fault.start_ms) {
            return;
        }
        let start_ms = recorder.now_ms();
        targets.set(fault.kind, true);
        let finished = wait_until(fault.start_ms + fault.length_ms);
        targets.set(fault.kind, false);
        recorder.record(Event::Fault(FaultWindow {
            id: fault.id,
            kind: fault.kind.name().to_owned(),
            target: fault.kind.target(),
            start_ms,
            end_ms: recorder.now_ms(),
            breaks_liveness: fault.kind.breaks_liveness(),
        }));
        if !finished {
            return;
        }
    }
}
