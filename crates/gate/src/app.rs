//! Building and running the gate: the store and the inbox with the gate's handler, the NATS
//! door and the output's publisher, the `/v1` router beside the health routes, the listener
//! (TLS when the configuration has it), and a graceful drain on SIGTERM.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::{Router, middleware};
use ordered_inbox::OrderedMessage;
use ordered_inbox::postgres::{PostgresError, PostgresInbox, Target};
use ordered_inbox::sqlite::SqliteInbox;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::auth::{Access, DeliveryRate};
use super::config::{GateConfig, GateNats, GateStore, PostgresAccess};
use super::handler::{GateHandler, SharedTypes};
use super::health::{self, Health, NatsClients};
use super::lag::{self, LagSamples, LagState};
use super::notices::{self, Announcer};
use super::output::{self, OutputStore};
use super::publisher::{HeldEpoch, PublishedRows, Publisher};
use super::reload::Reloader;
use super::retention::Pruner;
use super::routes::{self, GateMessageInput, GateParts, GateState, RegistryStore};
use super::schemas::MessageTypes;
use http_edge::inbox::SharedInbox;
use http_edge::inbox::changes::InboxChanges;
use http_edge::inbox::observed::ObservedInbox;
use http_edge::jetstream::{BrokerConfig, Consumer, ConsumerStatus, NatsConnectError};
use http_edge::limits::ConnectionLimits;
use http_edge::metrics::Metrics;
use http_edge::server::SHUTDOWN_GRACE;
use http_edge::startup::StartupError;
use http_edge::tls::ReloadingTls;
use ordered_inbox::sqlite::store::Store;

/// The start-up line supervisors, the bench and the tests wait for, as `serve` prints it.
const LISTENING_PREFIX: &str = "Now listening on: ";

/// The gate, bound and ready: [`GateApplication::url`] has the real port even for `:0`.
pub struct GateApplication {
    listener: TcpListener,
    address: SocketAddr,
    router: Router,
    tls: Option<ReloadingTls>,
    limits: ConnectionLimits,
    stores: Stores,
    background: Background,
    reloader: Reloader,
}

/// What runs beside the server while it serves.
struct Background {
    inbox: SharedInbox,
    metrics: Metrics,
    nats: Option<Nats>,
    /// The PostgreSQL store on which other gates announce their output rows, if any, and this
    /// gate's announcer.
    listening: Option<(Target, Announcer)>,
    changes: InboxChanges,
    wake: Arc<Notify>,
    /// The output's lag samples, which `/v1/lag` answers.
    lag: LagSamples,
    output: OutputStore,
    /// Prunes the store by `[retention]`.
    pruner: Pruner,
}

/// The gate's store: the SQLite file or the PostgreSQL database, holding the inbox and the
/// output table together.
struct Stores {
    sqlite: Option<Store>,
    postgres: Option<PostgresInbox>,
    inbox: SharedInbox,
    output: OutputStore,
    registry: RegistryStore,
}

/// The NATS side: the input's consumer and the output's publisher, each on its own connection.
struct Nats {
    input: async_nats::Client,
    output: async_nats::Client,
    consumer: Consumer,
    publisher: Publisher,
}

impl GateApplication {
    /// Compiles the schemas, loads TLS, opens the store, connects to NATS and binds the
    /// listener. Every refusal is a [`StartupError`] with one readable line.
    pub async fn build(config: GateConfig) -> Result<GateApplication, StartupError> {
        crate::planted::announce();
        for line in config.insecure_settings() {
            tracing::warn!(target: "production_lab::gate", "{line}");
        }
        let types = MessageTypes::compile(config.types.clone())
            .map_err(|(name, why)| StartupError::Gate(format!("types.\"{name}\".schema: {why}")))?
            .with_gap_alerts(config.gap_alerts.clone());
        let tls = match &config.tls {
            Some(files) => Some(
                ReloadingTls::load(files)
                    .map_err(|error| StartupError::Gate(format!("tls: {error}")))?,
            ),
            None => None,
        };
        let metrics = Metrics::new();
        let types: SharedTypes = Arc::new(ArcSwap::from_pointee(types));
        let held_epoch = HeldEpoch::default();
        let announcer = Announcer::new(held_epoch.clone());
        let mut handler = GateHandler::with_shared_types(types.clone());
        if config.nats.is_some() {
            handler = handler.with_announcer(announcer.clone());
        }
        let stores = Stores::open(&config, Arc::new(handler), &metrics).await?;
        let changes = InboxChanges::new();
        let inbox: SharedInbox = Arc::new(ObservedInbox::new(
            stores.inbox.clone(),
            metrics.clone(),
            changes.clone(),
        ));
        let wake = Arc::new(Notify::new());
        let nats = match &config.nats {
            Some(settings) => Some(
                Nats::connect(
                    settings,
                    config.publisher.lease,
                    &stores,
                    &metrics,
                    config.auth.anonymous_writes,
                    wake.clone(),
                    held_epoch,
                )
                .await?,
            ),
            None => None,
        };
        let (listener, address) = bind(config.listen.address).await?;
        let pruner = Pruner {
            inbox: inbox.clone(),
            output: stores.output.clone(),
            retention: config.retention,
            metrics: metrics.clone(),
        };
        // Other gates of a PostgreSQL store announce their output to whichever publishes.
        let listening = match (&nats, &stores.postgres) {
            (Some(_), Some(postgres)) => Some((postgres.target().clone(), announcer)),
            _ => None,
        };
        let background = Background {
            inbox,
            metrics,
            nats,
            listening,
            changes,
            wake,
            lag: LagSamples::default(),
            output: stores.output.clone(),
            pruner,
        };
        let access = gate_access(&config);
        let reloader = Reloader::new(
            config.clone(),
            types,
            access.clone(),
            tls.clone(),
            background.metrics.clone(),
        );
        let router = gate_router(&config, &stores, &background, access, &reloader);
        Ok(GateApplication {
            listener,
            address,
            router,
            tls,
            limits: config.connection_limits(),
            stores,
            background,
            reloader,
        })
    }

    /// SIGHUP reloads the configuration from `path` (the file the gate was started with).
    pub fn reloading_from(mut self, path: PathBuf) -> GateApplication {
        self.reloader = self.reloader.with_source(path);
        self
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The root URL clients use: `https://…` when the gate serves TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.address)
    }

    /// Serves until `stop` resolves; then stops accepting, lets in-flight requests finish (at
    /// most [`SHUTDOWN_GRACE`]), lets the consumer answer its batch in hand and the publisher end
    /// its round, and closes the store.
    pub async fn run_until_stopped(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let url = self.url();
        let GateApplication {
            listener,
            router,
            tls,
            limits,
            stores,
            background,
            reloader,
            ..
        } = self;
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        // Before the listening line: a SIGHUP sent once the gate is up must find a handler,
        // or its default action ends the process.
        reloader.spawn_on_sighup(shutdown.clone())?;
        println!("{LISTENING_PREFIX}{url}");
        background.start(&tasks, &shutdown);
        let served = serve(listener, router, tls, limits, shutdown.clone(), stop).await;
        shutdown.cancel();
        tasks.close();
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, tasks.wait()).await;
        stores.close().await;
        served
    }
}

/// The connection server, over TLS when `tls` is given, until `stop` resolves.
async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<ReloadingTls>,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let serving = async {
        match tls {
            Some(tls) => {
                http_edge::server::serve_tls(
                    listener,
                    router,
                    limits,
                    shutdown.clone(),
                    SHUTDOWN_GRACE,
                    tls,
                )
                .await
            }
            None => {
                http_edge::server::serve(listener, router, limits, shutdown.clone(), SHUTDOWN_GRACE)
                    .await
            }
        }
    };
    let mut serving = std::pin::pin!(serving);
    tokio::select! {
        served = serving.as_mut() => served,
        () = stop => {
            println!("The gate is shutting down...");
            // Stops accepting; in-flight requests get at most SHUTDOWN_GRACE.
            shutdown.cancel();
            serving.await
        }
    }
}

impl Background {
    /// The metrics' upkeep and the lag's samples, and with NATS the consumer, the publisher
    /// and its wake-ups.
    fn start(self, tasks: &TaskTracker, shutdown: &CancellationToken) {
        http_edge::observe::spawn_upkeep(self.metrics.clone(), tasks, shutdown.clone());
        let published = self
            .nats
            .as_ref()
            .map_or_else(PublishedRows::default, |nats| {
                nats.publisher.published_rows()
            });
        tasks.spawn(lag::sample(
            self.lag,
            self.output,
            published,
            shutdown.clone(),
        ));
        tasks.spawn(self.pruner.run(shutdown.clone()));
        let Some(nats) = self.nats else {
            return;
        };
        println!("{}", nats.consumer.describe());
        tasks.spawn(nats.consumer.run(self.inbox, shutdown.clone()));
        tasks.spawn(nats.publisher.run(shutdown.clone()));
        if let Some((target, announcer)) = self.listening {
            tasks.spawn(notices::wake_on_notifications(
                target,
                announcer,
                self.wake.clone(),
                self.metrics.clone(),
                shutdown.clone(),
            ));
        }
        tasks.spawn(wake_on_changes(self.changes, self.wake, shutdown.clone()));
    }
}

/// Pokes the publisher after every committed change, so that an applied message leaves for its
/// output subject at once rather than at the publisher's next tick.
async fn wake_on_changes(changes: InboxChanges, wake: Arc<Notify>, stop: CancellationToken) {
    let mut heard = changes.subscribe();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            change = heard.recv() => match change {
                // A lagging listener missed some changes: a wake-up covers them all.
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => wake.notify_one(),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

impl Stores {
    /// The inbox with `handler`, and the output table beside its tables, on the configured
    /// store.
    async fn open(
        config: &GateConfig,
        handler: Arc<GateHandler>,
        metrics: &Metrics,
    ) -> Result<Stores, StartupError> {
        let limits = config.inbox_limits();
        match &config.store {
            GateStore::Sqlite(path) => {
                let store = Store::open_observed(
                    path,
                    ordered_inbox::sqlite::Synchronous::Full,
                    migrate_sqlite,
                    Some(metrics.writer_observer()),
                )
                .map_err(|error| {
                    StartupError::Gate(format!("store.sqlite ({}): {error}", path.display()))
                })?;
                let inbox = SqliteInbox::with_handler(store.clone(), limits, handler);
                Ok(Stores {
                    sqlite: Some(store.clone()),
                    postgres: None,
                    inbox: Arc::new(inbox),
                    output: OutputStore::Sqlite(store),
                    registry: RegistryStore::Sqlite(path.clone()),
                })
            }
            GateStore::Postgres { url, env, access } => {
                let refused = |error: &PostgresError| store_refusal(env, access, error);
                let target = Target::parse_remote(url.expose(), &access.remote)
                    .map_err(|error| refused(&error))?;
                let postgres = PostgresInbox::open_with_handler(target.clone(), limits, handler)
                    .await
                    .map_err(|error| refused(&error))?;
                output::install_postgres(&postgres).await.map_err(|error| {
                    StartupError::Gate(format!("store.postgres_url_env ({env}): {error}"))
                })?;
                Ok(Stores {
                    sqlite: None,
                    inbox: Arc::new(postgres.clone()),
                    output: OutputStore::Postgres(Arc::new(postgres.clone())),
                    registry: RegistryStore::Postgres(Box::new(target)),
                    postgres: Some(postgres),
                })
            }
        }
    }

    async fn close(self) {
        if let Some(store) = &self.sqlite {
            store.shutdown().await;
        }
        if let Some(postgres) = &self.postgres {
            postgres.close();
        }
    }
}

/// A refusal of the PostgreSQL store on one line, naming the key at fault: the CA for a refused
/// certificate, the password's key for a refused password, the URL's variable otherwise.
fn store_refusal(env: &str, access: &PostgresAccess, error: &PostgresError) -> StartupError {
    let key = match error {
        PostgresError::Certificate { .. } => "store.sslrootcert".to_owned(),
        PostgresError::TlsFile { file, .. }
            if access
                .remote
                .root_certificate
                .as_ref()
                .is_some_and(|root| root.display().to_string() == *file) =>
        {
            "store.sslrootcert".to_owned()
        }
        PostgresError::TlsFile { .. } => "store.sslcert".to_owned(),
        PostgresError::Authentication { .. } => match access.password_key {
            Some(key) => key.to_owned(),
            None => format!("store.postgres_url_env ({env})"),
        },
        _ => format!("store.postgres_url_env ({env})"),
    };
    let text = error.to_string();
    StartupError::Gate(format!("{key}: {}", text.replace('\n', " ")))
}

/// The inbox's tables, then the gate's output table beside them.
fn migrate_sqlite(connection: &mut rusqlite::Connection) -> rusqlite::Result<()> {
    ordered_inbox::sqlite::schema::migrate(connection)?;
    output::migrate_sqlite(connection)
}

impl Nats {
    /// One connection for the input's durable consumer (the broker door reading the gate's
    /// envelope) and the output's publisher (holding the store's lease `lease` at a time), and
    /// the output stream, created if missing.
    async fn connect(
        settings: &GateNats,
        lease: std::time::Duration,
        stores: &Stores,
        metrics: &Metrics,
        anonymous_writes: bool,
        wake: Arc<Notify>,
        held_epoch: HeldEpoch,
    ) -> Result<Nats, StartupError> {
        let mut input = BrokerConfig::with_checked_urls(settings.urls.clone());
        input.stream = settings.input.stream.clone();
        input.subject_prefix = settings.input.subject_prefix.clone();
        input.durable = settings.input.durable.clone();
        input.batch = settings.input.batch;
        input.access = settings.access.clone();
        let input_client = nats_client("production-lab gate input", settings).await?;
        let consumer = Consumer::with_client(
            input,
            ConsumerStatus::with_observer(Arc::new(metrics.clone())),
            input_client,
            gate_message,
        )
        .await
        .map_err(|error| StartupError::Gate(format!("nats.input: {error}")))?
        .with_anonymous_writes(anonymous_writes);
        let client = consumer.client();
        // The output has a connection of its own, so that `/ready` tells the two apart and a
        // slow consumer never queues the output's publishes behind its pulls.
        let output_client = nats_client("production-lab gate output", settings).await?;
        let publisher = Publisher::new(
            stores.output.clone(),
            async_nats::jetstream::new(output_client.clone()),
            settings.output.stream.clone(),
            settings.output.subject_prefix.clone(),
            wake,
        )
        .with_metrics(metrics.clone())
        .with_lease(lease)
        .with_held_epoch(held_epoch);
        publisher
            .ensure_stream()
            .await
            .map_err(|error| StartupError::Gate(format!("nats.output: {error}")))?;
        Ok(Nats {
            input: client,
            output: output_client,
            consumer,
            publisher,
        })
    }
}

/// A client of the configured servers with `[nats.tls]` and `[nats.auth]`; a refusal names the
/// key at fault: the CA for a refused certificate, the credential's key for a refused or
/// unreadable credential, the URLs otherwise.
async fn nats_client(name: &str, settings: &GateNats) -> Result<async_nats::Client, StartupError> {
    http_edge::jetstream::connect_client(name.to_owned(), &settings.urls, &settings.access)
        .await
        .map_err(|error| {
            let key = match &error {
                NatsConnectError::Certificate(_) if settings.access.tls.is_some() => "nats.tls.ca",
                NatsConnectError::Credentials(_) => settings
                    .access
                    .auth
                    .as_ref()
                    .map_or("nats.auth", |auth| auth.key()),
                _ => "nats.urls",
            };
            StartupError::Gate(format!(
                "{key}: NATS at {}: {}",
                settings.urls.join(","),
                error.to_string().replace('\n', " ")
            ))
        })
}

/// A NATS message's body for the aggregate its subject names: the same JSON as the HTTP door's
/// (`{"messageId","sequence","type","payload"}`), checked by the same rules.
fn gate_message(aggregate_id: String, body: &[u8]) -> Result<OrderedMessage, String> {
    http_edge::inbox::input::validate_aggregate_id("aggregateId", &aggregate_id)
        .map_err(|error| error.to_string())?;
    let input: GateMessageInput =
        http_edge::error::parse_body(body).map_err(|error| error.to_string())?;
    input
        .validate(aggregate_id)
        .map_err(|error| error.to_string())
}

/// The `/v1` routes, the health routes and the console, one document describing them all (every
/// route goes through `routes!`), behind the edge middleware (request ids, the request line,
/// HTTP metrics, bare statuses as problems) without any lab's, and the gate's own edge
/// (refusals from the head, unread bodies drained, HSTS and `no-store`).
fn gate_router(
    config: &GateConfig,
    stores: &Stores,
    background: &Background,
    access: Access,
    reloader: &Reloader,
) -> Router {
    let state = gate_state(config, stores, background, access, reloader.types());
    let published = state.document();
    let health = Health {
        inbox: background.inbox.clone(),
        metrics: background.metrics.clone(),
        store: stores.sqlite.clone(),
        nats: background.nats.as_ref().map(|nats| NatsClients {
            input: nats.input.clone(),
            output: nats.output.clone(),
        }),
        access: state.0.access.clone(),
        generation: reloader.generation(),
        output: stores.output.clone(),
        publisher: background
            .nats
            .as_ref()
            .map(|nats| nats.publisher.held_epoch()),
        types: reloader.types(),
    };
    let lag = LagState {
        samples: background.lag.clone(),
        output: stores.output.clone(),
        publisher: health.publisher.clone(),
        access: state.0.access.clone(),
        inbox: background.inbox.clone(),
    };
    let documented = routes::api(state)
        .merge(health::routes(health, config.metrics.public))
        .merge(lag::routes(lag))
        .merge(super::console::routes());
    let (router, _document) = routes::finish(documented, &published);
    let edge = http_edge::observe::http::Edge {
        metrics: background.metrics.clone(),
        admission: None,
        trusted_proxy: config.listen.trusted_proxy,
    };
    let router = match proxy_only(config) {
        Some(proxy) => router.layer(middleware::from_fn_with_state(proxy, only_from_proxy)),
        None => router,
    };
    let gate_edge = super::edge::GateEdge {
        https: config.tls.is_some(),
    };
    router
        .layer(middleware::from_fn_with_state(
            gate_edge,
            super::edge::gate_edge,
        ))
        .layer(middleware::from_fn_with_state(
            edge,
            http_edge::observe::http::edge,
        ))
}

/// What the `/v1` routes share: the observed inbox, the output, the credentials and budgets,
/// the registry, the change feed, the message types (for the inventory's gap alerts).
fn gate_state(
    config: &GateConfig,
    stores: &Stores,
    background: &Background,
    access: Access,
    types: SharedTypes,
) -> GateState {
    GateState::new(GateParts {
        inbox: background.inbox.clone(),
        output: stores.output.clone(),
        access,
        registry: stores.registry.clone(),
        changes: background.changes.clone(),
        metrics: background.metrics.clone(),
        types,
        max_payload_bytes: config.limits.max_payload_bytes,
    })
}

/// The configured credentials and producers' budgets (the readers are replaced on reload).
fn gate_access(config: &GateConfig) -> Access {
    let limits = &config.limits;
    Access::new(
        config.auth.anonymous_writes,
        config
            .auth
            .readers
            .iter()
            .map(|reader| (reader.name.clone(), reader.token.expose().to_owned())),
        DeliveryRate {
            per_second: limits.producer_rate_per_second,
            burst: limits.producer_burst,
        },
    )
}

/// The proxy every request must come through: when the gate serves plain HTTP beyond loopback,
/// which the configuration allows only behind `listen.trusted_proxy` (it terminates TLS), a
/// request from any other peer would have crossed the network in clear.
fn proxy_only(config: &GateConfig) -> Option<std::net::IpAddr> {
    let plain_beyond_loopback = config.tls.is_none() && !config.listen.address.ip().is_loopback();
    config
        .listen
        .trusted_proxy
        .filter(|_| plain_beyond_loopback)
}

/// Middleware: a request from a peer that is neither the trusted proxy nor loopback is answered
/// 403 problem+json and never reaches a route.
async fn only_from_proxy(
    axum::extract::State(proxy): axum::extract::State<std::net::IpAddr>,
    request: axum::extract::Request,
    next: middleware::Next,
) -> axum::response::Response {
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip().to_canonical());
    match peer {
        Some(peer) if peer == proxy || peer.is_loopback() => next.run(request).await,
        _ => http_edge::error::problem_response_with(
            axum::http::StatusCode::FORBIDDEN,
            "Not through the proxy",
            Some("this gate serves plain HTTP only to its trusted proxy, which terminates TLS"),
            serde_json::json!({}),
        ),
    }
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

/// `production-lab gate --config FILE` once the file (at `source`) is valid: the gate, until
/// SIGTERM or Ctrl+C; SIGHUP reloads the file. The signal handlers are installed before anything starts, so a SIGTERM that arrives
/// while the gate is still opening its store is a graceful stop too, not the default action.
pub async fn run(config: GateConfig, source: PathBuf) -> anyhow::Result<()> {
    let stop = shutdown_signal()?;
    let application = GateApplication::build(config).await?.reloading_from(source);
    application.run_until_stopped(stop).await?;
    Ok(())
}

/// Resolves at SIGTERM (a supervisor's stop) or Ctrl+C; both handlers installed now.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let interrupt = tokio::signal::ctrl_c();
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt => {}
        }
        #[cfg(not(unix))]
        let _ = interrupt.await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use tower::ServiceExt;

    async fn status_from(peer: &str) -> u16 {
        let proxy: std::net::IpAddr = "10.0.0.2".parse().unwrap();
        // Any request reaches the fallback once the middleware lets it through.
        let router = Router::<()>::default()
            .fallback(|| async { "ok" })
            .layer(middleware::from_fn_with_state(proxy, only_from_proxy));
        let mut request = axum::http::Request::get("/v1/x")
            .body(Body::empty())
            .unwrap();
        let peer: SocketAddr = peer.parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        router.oneshot(request).await.unwrap().status().as_u16()
    }

    #[tokio::test]
    async fn plain_http_beyond_loopback_answers_only_the_trusted_proxy_and_loopback() {
        assert_eq!(status_from("10.0.0.2:40000").await, 200);
        assert_eq!(status_from("[::ffff:10.0.0.2]:40000").await, 200);
        assert_eq!(status_from("127.0.0.1:40000").await, 200);
        assert_eq!(status_from("10.0.0.3:40000").await, 403);
        assert_eq!(status_from("192.0.2.9:40000").await, 403);
    }
}
