//! The gate's store as `bench retention` drives it, opened the way the gate opens its own: the
//! inbox with the gate's handler (each applied message writes its `gate_output` row), wrapped as
//! the gate wraps it for its metrics, the output's reads and marks, and the gate's pruner
//! running by the bench's policy. Only NATS is left out: the bench marks output rows published
//! itself, the store's side of what the gate's publisher does after a PubAck.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use http_edge::inbox::SharedInbox;
use http_edge::inbox::changes::InboxChanges;
use http_edge::inbox::observed::ObservedInbox;
use http_edge::metrics::Metrics;
use lab_testkit::bench::retention::{
    GateStoreUnderTest, GateStores, RetentionSettings, StoreLocation,
};
use ordered_inbox::postgres::{PostgresInbox, Target};
use ordered_inbox::retention::Retention;
use ordered_inbox::sqlite::SqliteInbox;
use ordered_inbox::sqlite::store::Store;
use ordered_inbox::{Inbox, Limits};
use ordering_gate::config::GateRetention;
use ordering_gate::handler::GateHandler;
use ordering_gate::output::{self, OutputStore};
use ordering_gate::retention::Pruner;
use ordering_gate::schemas::MessageTypes;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Opens gate stores with this build's gate.
pub struct GateStoreOpener;

#[async_trait]
impl GateStores for GateStoreOpener {
    async fn open(
        &self,
        location: &StoreLocation,
        retention: Option<RetentionSettings>,
        message_type: &str,
        schema: &str,
    ) -> Result<Arc<dyn GateStoreUnderTest>, String> {
        let schema = serde_json::from_str(schema).map_err(|error| error.to_string())?;
        let types = MessageTypes::compile(vec![(message_type.to_owned(), schema)])
            .map_err(|(name, why)| format!("{name}: {why}"))?;
        let handler = Arc::new(GateHandler::new(types));
        let metrics = Metrics::new();
        let limits = Limits::default();
        let (inner, output, sqlite, postgres): (SharedInbox, _, _, _) = match location {
            StoreLocation::Sqlite(path) => {
                let store = Store::open_observed(
                    path,
                    ordered_inbox::sqlite::Synchronous::Full,
                    migrate_sqlite,
                    Some(metrics.writer_observer()),
                )
                .map_err(|error| error.to_string())?;
                let inbox = SqliteInbox::with_handler(store.clone(), limits, handler);
                (
                    Arc::new(inbox),
                    OutputStore::sqlite(store.clone()),
                    Some(store),
                    None,
                )
            }
            StoreLocation::Postgres(url) => {
                let target = Target::parse(url).map_err(|error| error.to_string())?;
                let inbox = PostgresInbox::open_with_handler(target, limits, handler)
                    .await
                    .map_err(|error| error.to_string())?;
                output::install_postgres(&inbox)
                    .await
                    .map_err(|error| error.to_string())?;
                (
                    Arc::new(inbox.clone()),
                    OutputStore::postgres(&inbox),
                    None,
                    Some(inbox),
                )
            }
        };
        let inbox: SharedInbox = Arc::new(ObservedInbox::new(
            inner,
            metrics.clone(),
            InboxChanges::new(),
        ));
        let pruning = retention.map(|settings| {
            let stop = CancellationToken::new();
            let pruner = Pruner {
                inbox: inbox.clone(),
                output: output.clone(),
                retention: gate_retention(&settings),
                metrics: metrics.clone(),
            };
            (stop.clone(), tokio::spawn(pruner.run(stop)))
        });
        Ok(Arc::new(OpenGateStore {
            inbox,
            output,
            metrics,
            sqlite,
            postgres,
            pruning: Mutex::new(pruning),
        }))
    }
}

/// `[retention]` as the bench sets it: identities, output rows and closed dead letters kept as
/// long, the timeline's newest events per aggregate (0: every event, `timeline = "forever"`).
fn gate_retention(settings: &RetentionSettings) -> GateRetention {
    GateRetention {
        inbox: Retention {
            identities: Some(settings.kept()),
            timeline: (settings.timeline > 0).then_some(settings.timeline),
            dead_letters: Some(settings.kept()),
        },
        output: Some(settings.kept()),
        interval: settings.interval(),
        batch: settings.batch,
    }
}

/// The inbox's tables, then the gate's output table beside them, as the gate migrates its file.
fn migrate_sqlite(connection: &mut rusqlite::Connection) -> rusqlite::Result<()> {
    ordered_inbox::sqlite::schema::migrate(connection)?;
    output::migrate_sqlite(connection)
}

struct OpenGateStore {
    inbox: SharedInbox,
    output: OutputStore,
    metrics: Metrics,
    sqlite: Option<Store>,
    postgres: Option<PostgresInbox>,
    /// The pruner's stop and task, while it runs.
    pruning: Mutex<Option<(CancellationToken, JoinHandle<()>)>>,
}

#[async_trait]
impl GateStoreUnderTest for OpenGateStore {
    fn inbox(&self) -> Arc<dyn Inbox> {
        self.inbox.clone()
    }

    async fn publish(&self, limit: usize) -> Result<usize, String> {
        let pending = self
            .output
            .pending(limit)
            .await
            .map_err(|error| error.to_string())?;
        let rows: Vec<(String, i64)> = pending
            .into_iter()
            .map(|entry| (entry.aggregate_id, entry.sequence))
            .collect();
        self.output
            .mark_published(&rows)
            .await
            .map_err(|error| error.to_string())?;
        Ok(rows.len())
    }

    fn metrics_page(&self) -> String {
        self.metrics.render(None, 0)
    }

    async fn close(&self) {
        let pruning = self
            .pruning
            .lock()
            .map(|mut pruning| pruning.take())
            .unwrap_or_default();
        if let Some((stop, task)) = pruning {
            stop.cancel();
            let _ = task.await;
        }
        if let Some(store) = &self.sqlite {
            store.shutdown().await;
        }
        if let Some(postgres) = &self.postgres {
            postgres.close();
        }
    }
}
