//! The inbox under test: the real library on a real store (a SQLite file, or a PostgreSQL
//! database), with the simulator's handler, which writes a row of its own for every message it
//! applies (`sim_effects`), so that a lost, doubled or uncommitted apply shows.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use ordered_inbox::gaps::{GapRequest, GapResolutionError};
use ordered_inbox::postgres::{HandlerClient, PostgresHandler, PostgresInbox, Target};
use ordered_inbox::producers::TransferRequest;
use ordered_inbox::records::{ProducerClaim, SequenceRange, TransferRefusal, refusal_outcome};
use ordered_inbox::resolution::{Action, Mode, ResolutionError, ResolutionRequest};
use ordered_inbox::sqlite::{
    SqliteHandler, SqliteInbox, Store, Synchronous, WriterConnection, schema,
};
use ordered_inbox::timeline::TimelineKind;
use ordered_inbox::views::PageRequest;
use ordered_inbox::{
    ApplyOutcome, BatchDelivery, Check, Door, HandlerError, Inbox, InboxError, Limits,
    OrderedMessage, Outcome, Poison, Undelivered,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::history::{Delivery, DoorKind};
use super::model::{
    GapSkip, Owner, Resolution, Stored, Transfer, Transferred, Verdict, fails, named,
};

/// The operator every simulated resolution is made by.
pub const OPERATOR: &str = "simulator";

/// What one step sends to the inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    Deliver(Delivery),
    Batch(Vec<Delivery>),
    Resolve(Resolution),
    SkipGap(GapSkip),
    StartSession(String),
    Transfer(Transfer),
    /// Registers producers (a history's, in its namespace) before its first step.
    Register(Vec<String>),
    /// Revokes registered producers.
    Revoke(Vec<String>),
}

/// Where the inbox keeps its state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Backend {
    Sqlite(PathBuf),
    Postgres(String),
}

/// The simulator's handler: a negative `v` is poison by its check; applying writes one row of
/// its own, and then finds a `v` of 3 poison or fails on a `v` of 4 (both must leave no trace of
/// the row).
pub struct Effects;

/// What `apply` says after it wrote its row.
fn after_the_row(message: &OrderedMessage) -> Result<ApplyOutcome, HandlerError> {
    match message.payload["v"].as_i64() {
        Some(3) => Ok(ApplyOutcome::Poison(Poison::new("found in apply"))),
        Some(value) if fails(value) => Err(HandlerError::new("the simulated handler fails")),
        _ => Ok(ApplyOutcome::applied()),
    }
}

const EFFECTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS sim_effects(
    message_id TEXT NOT NULL, aggregate_id TEXT NOT NULL, sequence BIGINT NOT NULL)";
const EFFECTS_INDEX: &str =
    "CREATE INDEX IF NOT EXISTS ix_sim_effects ON sim_effects(aggregate_id, sequence)";

impl Check for Effects {
    fn check(&self, message: &OrderedMessage) -> Result<(), Poison> {
        match message.payload["v"].as_i64() {
            Some(value) if value >= 0 => Ok(()),
            _ => Err(Poison::new("negative value")),
        }
    }
}

impl SqliteHandler for Effects {
    fn apply(
        &self,
        connection: &WriterConnection<'_>,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        connection
            .prepared(
                "INSERT INTO sim_effects(message_id, aggregate_id, sequence) VALUES (?1, ?2, ?3)",
            )?
            .execute((&message.message_id, &message.aggregate_id, message.sequence))?;
        after_the_row(message)
    }
}

#[async_trait]
impl PostgresHandler for Effects {
    async fn apply(
        &self,
        client: &HandlerClient,
        message: &OrderedMessage,
    ) -> Result<ApplyOutcome, HandlerError> {
        client
            .execute(
                "INSERT INTO sim_effects(message_id, aggregate_id, sequence) VALUES ($1, $2, $3)",
                &[
                    &message.message_id,
                    &message.aggregate_id,
                    &message.sequence,
                ],
            )
            .await?;
        after_the_row(message)
    }
}

/// The real inbox, opened on `backend`, and a way to read the handler's rows.
pub struct Direct {
    backend: Backend,
    inbox: Arc<dyn Inbox>,
    effects: EffectsReader,
    shutdown: Shutdown,
}

enum EffectsReader {
    /// Behind a mutex so that the inbox can be shared by a task that awaits.
    Sqlite(std::sync::Mutex<rusqlite::Connection>),
    Postgres(Box<PostgresInbox>),
}

enum Shutdown {
    Sqlite(SqliteInbox),
    Postgres,
}

impl Direct {
    /// Opens the inbox on `backend`, creating its schema, the handler's table and the operator
    /// when they do not exist yet.
    pub async fn open(backend: &Backend) -> Result<Direct, String> {
        match backend {
            Backend::Sqlite(path) => open_sqlite(path),
            Backend::Postgres(url) => open_postgres(url).await,
        }
    }

    pub async fn run(&mut self, command: &Command) -> Result<Vec<Verdict>, String> {
        match command {
            Command::Deliver(delivery) => {
                let (message, door) = message_of(delivery);
                let answer = self
                    .inbox
                    .deliver_as(message, door, claim_of(delivery))
                    .await;
                Ok(vec![match answer {
                    Ok(Ok(outcome)) => verdict_of(&outcome),
                    Ok(Err(refusal)) => Verdict::NotAdmitted(refusal_outcome(&refusal).to_owned()),
                    Err(InboxError::Handler(_)) => Verdict::Failed,
                    Err(error) => return Err(error.to_string()),
                }])
            }
            Command::Batch(deliveries) => self.batch(deliveries).await,
            Command::Resolve(resolution) => self.resolve(resolution).await.map(|v| vec![v]),
            Command::StartSession(producer) => {
                let epoch = self
                    .inbox
                    .start_session(producer.clone())
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|refusal| refusal.to_string())?;
                Ok(vec![Verdict::Session(epoch)])
            }
            Command::SkipGap(skip) => self.skip_gap(skip).await.map(|v| vec![v]),
            Command::Transfer(transfer) => self.transfer(transfer).await.map(|v| vec![v]),
            Command::Register(producers) => {
                for producer in producers {
                    self.register(producer).await?;
                }
                Ok(Vec::new())
            }
            Command::Revoke(producers) => {
                for producer in producers {
                    self.revoke(producer).await?;
                }
                Ok(Vec::new())
            }
        }
    }

    async fn transfer(&self, transfer: &Transfer) -> Result<Verdict, String> {
        let request = TransferRequest {
            aggregate_id: transfer.aggregate_id.clone(),
            operator: OPERATOR.to_owned(),
            producer: transfer.to.clone(),
            expected_owner: transfer.expected_owner.clone(),
            expected_last: transfer.expected_last,
            reason: "simulated transfer".to_owned(),
        };
        let answer = self
            .inbox
            .transfer_owner(request)
            .await
            .map_err(|e| e.to_string())?;
        Ok(match answer {
            Ok(record) => Verdict::Transferred {
                from: record.from_owner,
                epoch: record.epoch,
                held_rejected: record.held_rejected,
            },
            Err(conflict) => Verdict::TransferRefused {
                refusal: transfer_refusal(&conflict.refusal).to_owned(),
                owner: conflict.current.owner.map(owner_of),
                last: conflict.current.last,
            },
        })
    }

    async fn revoke(&self, producer: &str) -> Result<(), String> {
        let registry = ordered_inbox::operators::Registry::Producers;
        match &self.backend {
            Backend::Sqlite(path) => {
                ordered_inbox::sqlite::operators::revoke_in(registry, path, producer).map(drop)
            }
            Backend::Postgres(url) => {
                ordered_inbox::postgres::operators::revoke_in(registry, url, producer)
                    .await
                    .map(drop)
            }
        }
        .map_err(|e| e.to_string())
    }

    async fn skip_gap(&self, skip: &GapSkip) -> Result<Verdict, String> {
        let request = GapRequest {
            aggregate_id: skip.aggregate_id.clone(),
            operator: OPERATOR.to_owned(),
            range: SequenceRange {
                from: skip.from,
                through: skip.through,
            },
            expected_last: skip.expected_last,
            reason: "simulated gap".to_owned(),
        };
        match self.inbox.resolve_gap(request, Mode::Commit).await {
            Ok(_) => Ok(Verdict::Resolved),
            Err(GapResolutionError::Store(error)) => Err(error.to_string()),
            Err(_) => Ok(Verdict::Refused),
        }
    }

    async fn register(&self, producer: &str) -> Result<(), String> {
        let registry = ordered_inbox::operators::Registry::Producers;
        match &self.backend {
            Backend::Sqlite(path) => {
                ordered_inbox::sqlite::operators::add_to(registry, path, producer).map(drop)
            }
            Backend::Postgres(url) => {
                ordered_inbox::postgres::operators::add_to(registry, url, producer)
                    .await
                    .map(drop)
            }
        }
        .map_err(|e| e.to_string())
    }

    async fn batch(&mut self, deliveries: &[Delivery]) -> Result<Vec<Verdict>, String> {
        let batch = deliveries
            .iter()
            .map(|delivery| {
                let (message, door) = message_of(delivery);
                BatchDelivery {
                    message,
                    door,
                    claim: claim_of(delivery),
                }
            })
            .collect();
        let answers = self
            .inbox
            .deliver_batch(batch)
            .await
            .map_err(|e| e.to_string())?;
        answers
            .into_iter()
            .map(|answer| match answer {
                Ok(outcome) => Ok(verdict_of(&outcome)),
                Err(Undelivered::Handler(_)) => Ok(Verdict::Failed),
                Err(Undelivered::Refused(refusal)) => {
                    Ok(Verdict::NotAdmitted(refusal_outcome(&refusal).to_owned()))
                }
            })
            .collect()
    }

    async fn resolve(&mut self, resolution: &Resolution) -> Result<Verdict, String> {
        let action = match &resolution.replacement {
            Some((message_id, value)) => Action::Replace {
                message_id: message_id.clone(),
                payload: json!({ "v": value }),
            },
            None => Action::Skip,
        };
        let request = ResolutionRequest {
            producer: resolution.producer.clone(),
            dead_letter_id: resolution.dead_letter_id.clone(),
            operator: OPERATOR.to_owned(),
            action,
            expected_last: resolution.expected_last,
            reason: "simulated operator".to_owned(),
        };
        match self.inbox.resolve(request, Mode::Commit).await {
            Ok(_) => Ok(Verdict::Resolved),
            Err(ResolutionError::Store(error)) => Err(error.to_string()),
            Err(_) => Ok(Verdict::Refused),
        }
    }

    /// What the inbox stores of the aggregate: its view, its applied messages and the
    /// handler's rows, which must be the same messages.
    pub async fn stored(&mut self, aggregate_id: &str) -> Result<Stored, String> {
        let view = self
            .inbox
            .reads()
            .aggregate(aggregate_id.to_owned())
            .await
            .map_err(|e| e.to_string())?;
        let mut stored = match view {
            Some(view) => {
                let mut open: Vec<String> = view
                    .open_dead_letters
                    .iter()
                    .map(|d| named(d.producer.as_deref(), &d.message_id))
                    .collect();
                open.sort();
                Stored {
                    last: view.summary.last,
                    held: view.held_sequences,
                    open,
                    applied: Vec::new(),
                    owner: None,
                    transfers: Vec::new(),
                }
            }
            None => Stored::default(),
        };
        stored.applied = self.applied(aggregate_id).await?;
        stored.owner = self
            .inbox
            .reads()
            .ownership(aggregate_id.to_owned())
            .await
            .map_err(|e| e.to_string())?
            .owner
            .map(owner_of);
        stored.transfers = self.transfers(aggregate_id).await?;
        // The handler sees a message's id, not its producer's namespace.
        let effects = self.effects(aggregate_id).await?;
        let applied: Vec<(i64, String)> = stored
            .applied
            .iter()
            .map(|(sequence, id)| {
                (
                    *sequence,
                    id.split_once(':')
                        .map_or(id.clone(), |(_, id)| id.to_owned()),
                )
            })
            .collect();
        if effects != applied {
            return Err(format!(
                "the handler's rows {effects:?} are not the inbox's applied messages {:?}",
                stored.applied
            ));
        }
        Ok(stored)
    }

    /// Each producer's current epoch (0: unknown or no session yet).
    pub async fn epochs(&self, producers: &[String]) -> Result<Vec<i64>, String> {
        let known = self
            .inbox
            .reads()
            .producers()
            .await
            .map_err(|e| e.to_string())?;
        Ok(producers
            .iter()
            .map(|name| {
                known
                    .iter()
                    .find(|p| &p.name == name)
                    .map_or(0, |p| p.current_epoch)
            })
            .collect())
    }

    async fn applied(&self, aggregate_id: &str) -> Result<Vec<(i64, String)>, String> {
        let mut applied = Vec::new();
        let mut after = 0;
        loop {
            let page = self
                .inbox
                .reads()
                .applied_messages(aggregate_id.to_owned(), PageRequest { after, limit: 1000 })
                .await
                .map_err(|e| e.to_string())?;
            applied.extend(page.items.into_iter().map(|m| {
                (
                    m.sequence.unwrap_or_default(),
                    named(m.producer.as_deref(), &m.message_id),
                )
            }));
            match page.next {
                Some(next) => after = next,
                None => return Ok(applied),
            }
        }
    }

    /// The aggregate's recorded transfers, oldest first, from its timeline.
    async fn transfers(&self, aggregate_id: &str) -> Result<Vec<Transferred>, String> {
        let mut transfers = Vec::new();
        let mut after = 0;
        loop {
            let page = self
                .inbox
                .reads()
                .timeline(aggregate_id.to_owned(), PageRequest { after, limit: 1000 })
                .await
                .map_err(|e| e.to_string())?;
            for event in page.items {
                if event.kind == TimelineKind::OwnerTransferred {
                    transfers.push(transferred_of(event.detail.as_ref())?);
                }
            }
            match page.next {
                Some(next) => after = next,
                None => return Ok(transfers),
            }
        }
    }

    async fn effects(&self, aggregate_id: &str) -> Result<Vec<(i64, String)>, String> {
        const ROWS: &str = "SELECT sequence, message_id FROM sim_effects WHERE aggregate_id = ";
        match &self.effects {
            EffectsReader::Sqlite(connection) => {
                let connection = connection
                    .lock()
                    .map_err(|_| "the effects reader was poisoned".to_owned())?;
                let mut statement = connection
                    .prepare_cached(&format!("{ROWS}?1 ORDER BY sequence, rowid"))
                    .map_err(|e| e.to_string())?;
                let rows = statement
                    .query_map([aggregate_id], |row| Ok((row.get(0)?, row.get(1)?)))
                    .map_err(|e| e.to_string())?;
                rows.collect::<Result<_, _>>().map_err(|e| e.to_string())
            }
            EffectsReader::Postgres(inbox) => {
                let client = inbox.pool().get().await.map_err(|e| e.to_string())?;
                let rows = client
                    .query(
                        &format!("{ROWS}$1 ORDER BY sequence, ctid"),
                        &[&aggregate_id],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
            }
        }
    }

    /// Stops the inbox's writer (a clean close; a crash is a killed process instead).
    pub async fn close(self) {
        if let Shutdown::Sqlite(inbox) = self.shutdown {
            inbox.shutdown().await;
        }
    }
}

fn open_sqlite(path: &Path) -> Result<Direct, String> {
    let fresh = !path.exists();
    let store = Store::open(path, Synchronous::Normal, |connection| {
        schema::migrate(connection)?;
        connection.execute_batch(&format!("{EFFECTS_TABLE}; {EFFECTS_INDEX};"))
    })
    .map_err(|e| e.to_string())?;
    if fresh {
        ordered_inbox::sqlite::operators::add(path, OPERATOR).map_err(|e| e.to_string())?;
    }
    let inbox = SqliteInbox::with_handler(store, Limits::default(), Arc::new(Effects));
    let reader = rusqlite::Connection::open(path).map_err(|e| e.to_string())?;
    Ok(Direct {
        backend: Backend::Sqlite(path.to_owned()),
        inbox: Arc::new(inbox.clone()),
        effects: EffectsReader::Sqlite(std::sync::Mutex::new(reader)),
        shutdown: Shutdown::Sqlite(inbox),
    })
}

async fn open_postgres(url: &str) -> Result<Direct, String> {
    let target = Target::parse(url).map_err(|e| e.to_string())?;
    let inbox = PostgresInbox::open_with_handler(target, Limits::default(), Arc::new(Effects))
        .await
        .map_err(|e| e.to_string())?;
    let client = inbox.pool().get().await.map_err(|e| e.to_string())?;
    client
        .batch_execute(&format!(
            "SELECT pg_advisory_xact_lock(hashtext('simulator'));
             {EFFECTS_TABLE}; {EFFECTS_INDEX};"
        ))
        .await
        .map_err(|e| e.to_string())?;
    drop(client);
    // An operator added by an earlier run (or another worker) stays: adding it again is refused.
    let _ = ordered_inbox::postgres::operators::add(url, OPERATOR).await;
    Ok(Direct {
        backend: Backend::Postgres(url.to_owned()),
        inbox: Arc::new(inbox.clone()),
        effects: EffectsReader::Postgres(Box::new(inbox)),
        shutdown: Shutdown::Postgres,
    })
}

fn message_of(delivery: &Delivery) -> (OrderedMessage, Door) {
    let message = OrderedMessage {
        message_id: delivery.message_id.clone(),
        aggregate_id: delivery.aggregate_id.clone(),
        sequence: delivery.sequence,
        payload: json!({ "v": delivery.value }),
    };
    let door = match delivery.door {
        DoorKind::General => Door::General,
        DoorKind::Broker => Door::Broker,
    };
    (message, door)
}

fn claim_of(delivery: &Delivery) -> Option<ProducerClaim> {
    delivery.producer.as_ref().map(|producer| ProducerClaim {
        producer: producer.clone(),
        epoch: delivery.epoch,
    })
}

fn owner_of(owner: ordered_inbox::records::AggregateOwner) -> Owner {
    Owner {
        producer: owner.producer,
        epoch: owner.epoch,
    }
}

/// A transfer's timeline event (`from`, `to`, `epoch`), in the model's words.
fn transferred_of(detail: Option<&serde_json::Value>) -> Result<Transferred, String> {
    let detail = detail.ok_or("a transfer's timeline event has no detail")?;
    let to = detail["to"]
        .as_str()
        .ok_or("a transfer's event names no `to`")?;
    let epoch = detail["epoch"]
        .as_i64()
        .ok_or("a transfer's event has no epoch")?;
    Ok(Transferred {
        from: detail["from"].as_str().map(str::to_owned),
        to: to.to_owned(),
        epoch,
    })
}

/// A transfer refusal's name, as the model gives it.
fn transfer_refusal(refusal: &TransferRefusal) -> &'static str {
    match refusal {
        TransferRefusal::Unauthorized => "unauthorized",
        TransferRefusal::UnknownProducer => "unknown producer",
        TransferRefusal::OwnerMismatch => "owner mismatch",
        TransferRefusal::LastMismatch => "last mismatch",
    }
}

/// What the real inbox answered, in the model's words.
pub fn verdict_of(outcome: &Outcome) -> Verdict {
    match outcome {
        Outcome::Applied { sequence, .. } => Verdict::Applied(*sequence),
        Outcome::Replay { .. } => Verdict::Replay,
        Outcome::PayloadConflict => Verdict::Conflict,
        Outcome::Gap { expected } => Verdict::Gap(*expected),
        Outcome::Stale { expected, .. } => Verdict::Stale(*expected),
        Outcome::Quarantined { expected, .. } => Verdict::Quarantined(*expected),
        Outcome::Held { repeated, .. } => Verdict::Held {
            repeated: *repeated,
        },
        Outcome::QuarantineFull { .. } | Outcome::HoldFull { .. } => Verdict::Full,
    }
}
