//! Building and running the server: the shared state, the router, the listener, and graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::FromRef;
use axum::{Router, middleware};
use ordered_inbox::postgres::{PostgresInbox, Target};
use ordered_inbox::sqlite::SqliteInbox;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;

use crate::config::{
    Config, LiveSettings, StartupError, load_settings, parse_listen_url, require_development,
};
use crate::console::ConsoleEvents;
use crate::inbox::SharedInbox;
use crate::inbox::changes::InboxChanges;
use crate::inbox::ledger::Ledger;
use crate::inbox::observed::ObservedInbox;
use crate::labs;
use crate::labs::context::StartupContext;
use crate::observe::Metrics;
use crate::store::Store;

/// The start-up line that announces the real address; supervisors, the bench and the tests wait
/// for it (lab-testkit's `server::listening_address` reads it).
const LISTENING_PREFIX: &str = "Now listening on: ";

pub use http_edge::server::SHUTDOWN_GRACE;

/// Everything the application shares, behind one `Arc`: axum clones a route's whole service
/// stack, and with it this state, for every request, so a clone must be one reference count
/// (a clone of [`AppParts`] took a dozen, some behind locks: about 10% of the CPU of a delivery).
/// Handlers take only the pieces they use (`State<Store>`, `State<CacheLab>` …) through the
/// [`FromRef`] implementations below; code holding the state reads the parts through `Deref`.
#[derive(Clone)]
pub struct AppState(Arc<AppParts>);

impl AppState {
    pub fn new(parts: AppParts) -> AppState {
        AppState(Arc::new(parts))
    }
}

impl std::ops::Deref for AppState {
    type Target = AppParts;

    fn deref(&self) -> &AppParts {
        &self.0
    }
}

/// The parts of [`AppState`].
pub struct AppParts {
    pub store: Store,
    /// The ordered inbox on the same store: counted and logged ([`ObservedInbox`]), and every
    /// committed change published to the console.
    pub inbox: SharedInbox,
    /// Live updates for open console pages.
    pub console: ConsoleEvents,
    /// The PostgreSQL inbox, when `--inbox` put it there (for its figures and to close it).
    pub postgres: Option<PostgresInbox>,
    /// This application's own metrics recorder.
    pub metrics: Metrics,
    pub config: Arc<Config>,
    /// Cancelled when shutdown begins; background work watches it.
    pub shutdown: CancellationToken,
    /// Background tasks that shutdown waits for (bounded by [`SHUTDOWN_GRACE`]).
    pub tasks: TaskTracker,
    pub messaging: labs::messaging::MessagingLab,
    pub http: labs::http::HttpLab,
    pub cache: labs::cache::CacheLab,
    pub security: labs::security::SecurityLab,
    pub privacy: labs::privacy::PrivacyLab,
    pub worker: labs::worker::WorkerLab,
    /// The NATS JetStream consumer's evidence (idle without `--nats`).
    pub broker: crate::broker::BrokerLab,
}

/// `State<Part>` for each part a handler may take (what `#[derive(FromRef)]` would generate
/// for a struct without the `Arc`).
macro_rules! parts_from_state {
    ($($field:ident: $part:ty),* $(,)?) => {
        $(impl FromRef<AppState> for $part {
            fn from_ref(state: &AppState) -> $part {
                state.0.$field.clone()
            }
        })*
    };
}

parts_from_state!(
    store: Store,
    inbox: SharedInbox,
    console: ConsoleEvents,
    postgres: Option<PostgresInbox>,
    metrics: Metrics,
    config: Arc<Config>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    messaging: labs::messaging::MessagingLab,
    http: labs::http::HttpLab,
    cache: labs::cache::CacheLab,
    security: labs::security::SecurityLab,
    privacy: labs::privacy::PrivacyLab,
    worker: labs::worker::WorkerLab,
    broker: crate::broker::BrokerLab,
);

/// The server, bound and ready: [`Application::port`] is the real port even for `:0`.
pub struct Application {
    listener: TcpListener,
    address: SocketAddr,
    router: Router,
    state: AppState,
    consumer: Option<crate::broker::Consumer>,
}

impl Application {
    /// Checks the environment and the address, loads the settings, opens the database and binds
    /// the listener. Every refusal is a [`StartupError`] with one readable line.
    pub async fn build(config: Config) -> Result<Application, StartupError> {
        require_development(&config.environment)?;
        let requested = parse_listen_url(&config.urls)?;
        // Refuse a non-loopback PostgreSQL before touching any file.
        let inbox_target = config.inbox.as_deref().map(Target::parse).transpose()?;
        let settings = load_settings(&config.settings)?;
        let metrics = Metrics::new();
        let stores = Stores::open(&config, inbox_target, &metrics).await?;
        let (listener, address) = bind(requested).await?;
        let broker = crate::broker::BrokerLab::with_metrics(metrics.clone());
        let consumer = match &config.nats {
            Some(nats) => Some(
                crate::broker::connect_consumer(
                    nats.clone(),
                    broker.status(),
                    crate::inbox::input::general_message,
                )
                .await?,
            ),
            None => None,
        };
        let state = assemble_state(config, &settings, stores, metrics, broker)?;
        let router = router(state.clone());
        Ok(Application {
            listener,
            address,
            router,
            state,
            consumer,
        })
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// The root URL clients use, e.g. `http://127.0.0.1:5080`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `stop` resolves, then stops accepting, lets in-flight requests and background
    /// work finish (at most [`SHUTDOWN_GRACE`] each) and closes the store.
    pub async fn run_until_stopped(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Application {
            listener,
            address,
            router,
            state,
            consumer,
        } = self;
        println!("{LISTENING_PREFIX}http://{address}");
        println!("Database: {}", state.store.path().display());
        if let Some(postgres) = &state.postgres {
            println!("Ordered inbox: PostgreSQL {}", postgres.target());
        }
        if let Some(consumer) = consumer {
            println!("{}", consumer.describe());
            let inbox = state.inbox.clone();
            let stop = state.shutdown.clone();
            state.tasks.spawn(consumer.run(inbox, stop));
        }
        println!("Application started. Press Ctrl+C to shut down.");

        let serving = crate::http::server::serve(
            listener,
            router,
            state.config.limits,
            state.shutdown.clone(),
            SHUTDOWN_GRACE,
        );
        let mut serving = std::pin::pin!(serving);
        let served = tokio::select! {
            served = serving.as_mut() => served,
            () = stop => {
                println!("Application is shutting down...");
                // Stops accepting; in-flight requests get at most SHUTDOWN_GRACE.
                state.shutdown.cancel();
                serving.await
            }
        };
        state.shutdown.cancel();
        state.tasks.close();
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, state.tasks.wait()).await;
        state.store.shutdown().await;
        if let Some(postgres) = &state.postgres {
            postgres.close();
            println!("{}", postgres_figures_line(postgres.stats()));
        }
        served
    }
}

/// The labs' store and the ordered inbox on the backend the configuration names, the lesson's
/// ledger its handler on either.
struct Stores {
    store: Store,
    postgres: Option<PostgresInbox>,
    inbox: SharedInbox,
}

impl Stores {
    /// Opens the labs' database (migrated, its writer observed by `metrics`), then PostgreSQL
    /// when `inbox_target` names it; the inbox is on PostgreSQL then, else in the labs' store.
    /// Either way the ledger ([`Ledger`]) applies every message in the inbox's transaction.
    async fn open(
        config: &Config,
        inbox_target: Option<Target>,
        metrics: &Metrics,
    ) -> Result<Stores, StartupError> {
        let store = Store::open_observed(
            &config.database,
            config.synchronous.into(),
            migrate_with_ledger,
            Some(metrics.writer_observer()),
        )
        .map_err(|error| StartupError::Database {
            path: config.database.display().to_string(),
            reason: error.to_string(),
        })?;
        let postgres = match inbox_target {
            Some(target) => Some(open_postgres(target, config).await?),
            None => None,
        };
        let inbox: SharedInbox = match &postgres {
            Some(postgres) => Arc::new(postgres.clone()),
            None => Arc::new(SqliteInbox::with_handler(
                store.clone(),
                config.inbox_limits(),
                Arc::new(Ledger),
            )),
        };
        Ok(Stores {
            store,
            postgres,
            inbox,
        })
    }
}

/// The labs' tables, then the inbox's, then the ledger's column beside them.
fn migrate_with_ledger(connection: &mut rusqlite::Connection) -> rusqlite::Result<()> {
    crate::store::schema::migrate(connection)?;
    crate::inbox::ledger::migrate_sqlite(connection)
}

/// The inbox in PostgreSQL with the lesson's ledger as its handler, and the ledger's schema
/// beside the inbox's.
async fn open_postgres(target: Target, config: &Config) -> Result<PostgresInbox, StartupError> {
    let postgres =
        PostgresInbox::open_with_handler(target, config.inbox_limits(), Arc::new(Ledger)).await?;
    crate::inbox::ledger::install_postgres(&postgres)
        .await
        .map_err(StartupError::Inbox)?;
    Ok(postgres)
}

/// The listener on `requested`, and the address it really has (a port for `:0`).
async fn bind(requested: SocketAddr) -> Result<(TcpListener, SocketAddr), StartupError> {
    let refused = |error: std::io::Error| StartupError::Bind {
        address: requested.to_string(),
        reason: error.to_string(),
    };
    let listener = TcpListener::bind(requested).await.map_err(refused)?;
    let address = listener.local_addr().map_err(refused)?;
    Ok((listener, address))
}

/// Starts the upkeep task and every lab (each may refuse its settings), and puts them into the
/// application's state with the stores and the broker's evidence.
fn assemble_state(
    config: Config,
    settings: &LiveSettings,
    stores: Stores,
    metrics: Metrics,
    broker: crate::broker::BrokerLab,
) -> Result<AppState, StartupError> {
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    crate::observe::spawn_upkeep(metrics.clone(), &tasks, shutdown.clone());
    let context = StartupContext {
        config: &config,
        store: &stores.store,
        settings,
        shutdown: &shutdown,
        tasks: &tasks,
    };
    let changes = InboxChanges::new();
    let console = ConsoleEvents::new(changes.clone(), shutdown.clone());
    Ok(AppState::new(AppParts {
        messaging: labs::messaging::MessagingLab::new(&context)?,
        http: labs::http::HttpLab::new(&context)?,
        cache: labs::cache::CacheLab::new(&context)?,
        security: labs::security::SecurityLab::new(&context)?,
        privacy: labs::privacy::PrivacyLab::new(&context)?,
        worker: labs::worker::WorkerLab::new(&context)?,
        broker,
        // Every write, whatever door or consumer makes it, is counted, logged and told to the
        // console here.
        inbox: Arc::new(ObservedInbox::new(stores.inbox, metrics.clone(), changes)),
        console,
        postgres: stores.postgres,
        metrics,
        store: stores.store,
        config: Arc::new(config),
        shutdown,
        tasks,
    }))
}

/// The line a server with a PostgreSQL inbox prints when it stops: what its operations cost.
pub fn postgres_figures_line(stats: ordered_inbox::postgres::PostgresStats) -> String {
    format!(
        "{POSTGRES_FIGURES_PREFIX}{} operations, {} round trips, {} retries, {} group commits, {} grouped deliveries, {} replays",
        stats.operations,
        stats.round_trips,
        stats.retries,
        stats.group_commits,
        stats.grouped_deliveries,
        stats.replays
    )
}

/// The bench reads it back (lab-testkit's `server::PostgresFigures::parse`).
const POSTGRES_FIGURES_PREFIX: &str = "Ordered inbox figures: ";

/// Every route with its OpenAPI entry: each lab registers its handlers through `routes!`, which
/// takes the path and the methods from the handler's annotation, so the router and the document
/// are built from one source.
pub fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(crate::http::openapi::ApiDoc::openapi())
        .merge(crate::observe::routes::routes())
        .merge(labs::ordered::routes())
        .merge(labs::sql::routes())
        .merge(labs::messaging::routes())
        .merge(labs::outbox::routes())
        .merge(labs::http::routes())
        .merge(labs::cache::routes())
        .merge(labs::security::routes())
        .merge(labs::privacy::routes())
        .merge(labs::worker::routes())
        .merge(labs::contracts::routes())
        .merge(labs::pipeline::routes())
        .merge(crate::broker::routes())
        .merge(crate::console::routes())
}

/// Every lab's routes on one router, wrapped in the security lab's middleware and, outside it,
/// the request id, the request span and the HTTP metrics.
pub fn router(state: AppState) -> Router {
    let security = state.security.clone();
    let metrics = state.metrics.clone();
    let (routes, mut document) = api_router().split_for_parts();
    crate::http::openapi::Shared.modify(&mut document);
    crate::inbox::ledger::describe_reasons(&mut document);
    crate::observe::routes::publish_document(&document);
    let edge = crate::observe::http::Edge {
        metrics,
        admission: Some(std::sync::Arc::new(security)),
        trusted_proxy: None,
    };
    routes
        .with_state(state)
        // CORS as in the seed, then, outside it, everything else every request goes through
        // (the request id, span, metrics, host filter, forwarded headers, bare-status problems)
        // in one layer: axum clones and drops a route's layers for every request.
        .layer(labs::security::cors_policy())
        .layer(middleware::from_fn_with_state(
            edge,
            crate::observe::http::edge,
        ))
}
