//! Histories: what the simulator does to the inbox, a pure function of a seed. Small domains
//! (a few aggregates, sequences 1..=8, three ids per sequence) so that ids, sequences, dead
//! letters and held messages meet often.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// Which door a delivery comes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DoorKind {
    General,
    Broker,
}

/// One delivery: a message of the simulator's handler (`{"v": value}`; see
/// [`super::model`] for the values the handler refuses), anonymous or a producer's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    pub door: DoorKind,
    /// The producer that delivers it (`None`: anonymous).
    pub producer: Option<String>,
    /// In a history: whether the producer offers the epoch before its current one (fenced).
    pub stale_epoch: bool,
    /// The epoch offered: set by the runner from the producer's sessions.
    pub epoch: i64,
    pub message_id: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub value: i64,
}

/// Where a crash falls around one step's COMMIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CrashPoint {
    /// The process dies before the step is sent: nothing of it may be stored.
    Before,
    /// The step is sent and the process dies `after_micros` later, without waiting for the
    /// answer: all of it or none of it may be stored (or a prefix of a batch, where the backend
    /// commits each delivery of a batch alone).
    During { after_micros: u16 },
    /// The process dies right after the answer: all of it must be stored.
    After,
}

/// One step of a history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    Deliver(Delivery),
    /// Deliveries handed over together (a broker consumer's fetch): one commit.
    Batch(Vec<Delivery>),
    /// An operator resolves the aggregate's first open dead letter: a skip, or a replacement
    /// with a new id; `stale`: with an `expectedLast` that is not the position.
    Resolve {
        aggregate_id: String,
        replace: bool,
        stale: bool,
    },
    /// An operator skips the aggregate's gap from its expected sequence through `extra` more;
    /// `stale`: with an `expectedLast` that is not the position; `repeat`: the aggregate's
    /// last skip sent again.
    SkipGap {
        aggregate_id: String,
        extra: i64,
        stale: bool,
        repeat: bool,
    },
    /// A producer's new instance starts a session: the producer's next epoch, which fences the
    /// ones before.
    StartSession(String),
    /// An operator transfers the aggregate to producer `to` (one of [`PRODUCERS`], [`REVOKED`]
    /// or [`UNKNOWN`]), naming the owner and position it has, or (`stale_owner`) another owner,
    /// or (`stale_last`) another position; `repeat`: the aggregate's last recorded transfer
    /// sent again.
    Transfer {
        aggregate_id: String,
        to: String,
        stale_owner: bool,
        stale_last: bool,
        repeat: bool,
    },
    /// The next step runs with the inbox's process killed at `point`, and the inbox reopened.
    Crash(CrashPoint),
}

/// The producers of a history whose deliveries are producers'.
pub const PRODUCERS: [&str; 2] = ["p", "q"];
/// A producer registered and then revoked, in a history with producers: a transfer to it is
/// refused.
pub const REVOKED: &str = "r";
/// A producer never registered: a transfer to it is refused.
pub const UNKNOWN: &str = "u";

/// The shape of the histories a campaign draws.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub aggregates: usize,
    pub steps: usize,
    /// Whether the history may kill the inbox's process (the runner must host it in a child).
    pub crashes: bool,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            aggregates: 2,
            steps: 40,
            crashes: false,
        }
    }
}

/// The aggregate ids of a history (the runner puts a namespace in front of every id, so that
/// several histories can share one database).
pub fn aggregate_ids(shape: &Shape) -> Vec<String> {
    (0..shape.aggregates)
        .map(|index| char::from(b'a' + (index % 26) as u8).to_string())
        .collect()
}

/// The history of `seed`.
pub fn generate(seed: u64, shape: &Shape) -> Vec<Step> {
    let mut rng = StdRng::seed_from_u64(seed);
    let aggregates = aggregate_ids(shape);
    let door = if rng.random_bool(0.5) {
        DoorKind::General
    } else {
        DoorKind::Broker
    };
    // Two in five histories are producers': sessions, epochs, ownership.
    let producers = rng.random_bool(0.4);
    let mut steps = Vec::with_capacity(shape.steps);
    if producers {
        steps.push(Step::StartSession(PRODUCERS[0].to_owned()));
    }
    while steps.len() < shape.steps {
        // In a crashing history, about one step in twelve runs with the process killed.
        if shape.crashes && rng.random_bool(0.08) {
            steps.push(Step::Crash(match rng.random_range(0..3) {
                0 => CrashPoint::Before,
                1 => CrashPoint::During {
                    after_micros: rng.random_range(0..3000),
                },
                _ => CrashPoint::After,
            }));
        }
        // In a history with producers, about one step in sixteen is an operator's transfer (a
        // draw of its own, so that the histories without producers stay what they were).
        if producers && rng.random_bool(0.06) {
            steps.push(transfer(&mut rng, &aggregates));
            continue;
        }
        let roll = rng.random_range(0..100);
        let step = match roll {
            0..=4 if producers => {
                Step::StartSession(PRODUCERS[rng.random_range(0..PRODUCERS.len())].to_owned())
            }
            0..=64 => Step::Deliver(delivery(&mut rng, &aggregates, door, producers)),
            65..=79 => Step::Batch(
                (0..rng.random_range(2..6))
                    .map(|_| delivery(&mut rng, &aggregates, door, producers))
                    .collect(),
            ),
            80..=94 => Step::Resolve {
                aggregate_id: aggregates[rng.random_range(0..aggregates.len())].clone(),
                replace: rng.random_bool(0.5),
                stale: rng.random_bool(0.25),
            },
            95..=97 => Step::SkipGap {
                aggregate_id: aggregates[rng.random_range(0..aggregates.len())].clone(),
                extra: rng.random_range(0..3),
                stale: rng.random_bool(0.2),
                repeat: rng.random_bool(0.2),
            },
            _ => continue,
        };
        steps.push(step);
    }
    steps
}

fn transfer(rng: &mut StdRng, aggregates: &[String]) -> Step {
    let aggregate_id = aggregates[rng.random_range(0..aggregates.len())].clone();
    let to = match rng.random_range(0..10) {
        0..=3 => PRODUCERS[0],
        4..=7 => PRODUCERS[1],
        8 => REVOKED,
        _ => UNKNOWN,
    };
    Step::Transfer {
        aggregate_id,
        to: to.to_owned(),
        stale_owner: rng.random_bool(0.2),
        stale_last: rng.random_bool(0.1),
        repeat: rng.random_bool(0.15),
    }
}

fn delivery(rng: &mut StdRng, aggregates: &[String], door: DoorKind, producers: bool) -> Delivery {
    let aggregate_id = aggregates[rng.random_range(0..aggregates.len())].clone();
    let sequence = rng.random_range(1..=8i64);
    let variant = rng.random_range(0..3u8);
    let value = value_of(door, sequence, variant, rng.random_bool(0.08));
    let producer = producers.then(|| PRODUCERS[usize::from(rng.random_bool(0.3))].to_owned());
    Delivery {
        door,
        producer,
        stale_epoch: producers && rng.random_bool(0.1),
        epoch: 0,
        message_id: format!("{aggregate_id}-{sequence}-{variant}"),
        aggregate_id,
        sequence,
        value,
    }
}

/// The value of an id (the same id always has the same value, but for a `tampered` delivery,
/// which reuses the id with other content): variant 0 applies, variant 2 is poison by the
/// handler's check, variant 1 applies but on some sequences is poison found by `apply` (3) or,
/// on the general door only, makes `apply` fail (4; a held message that fails would hold up
/// its predecessor's delivery for ever).
pub fn value_of(door: DoorKind, sequence: i64, variant: u8, tampered: bool) -> i64 {
    match (variant, tampered) {
        (_, true) => 7,
        (0, false) => 1,
        (2, false) => -1,
        _ if sequence % 5 == 0 => 3,
        _ if sequence % 5 == 3 && door == DoorKind::General => 4,
        _ => 2,
    }
}
