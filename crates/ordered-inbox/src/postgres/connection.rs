//! Where the PostgreSQL inbox connects and how its failures read: the checked connection
//! target (loopback or a Unix socket directory, or any host when the caller says so, with TLS
//! and a password), the failure of one attempt and whether another may be made, the backend's
//! counters. Every other module of the backend builds on these.

use std::net::IpAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::PoolError;
use tokio_postgres::NoTls;
use tokio_postgres::config::Host;
use tokio_postgres_rustls::MakeRustlsConnect;

pub use super::error::PostgresError;
use super::tls::{Remote, SslMode};

use crate::error::{HandlerError, InboxError};
use crate::model::UnknownValue;

/// Connections each server process keeps to the database at most.
pub const POOL_SIZE: usize = 16;
/// Attempts of one operation when PostgreSQL asks for a retry (serialization failure, deadlock,
/// a unique violation from a concurrent first delivery) or a pooled connection turns out closed.
pub const ATTEMPTS: u32 = 8;
/// How long opening a connection may take before the store counts as unavailable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an operation waits for a free pooled connection.
pub const POOL_WAIT: Duration = Duration::from_secs(10);

/// A listening connection's TCP keepalive: its first probe after this much silence, then one
/// every interval; after the retries unanswered it ends, and its owner can open another.
const LISTEN_KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const LISTEN_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const LISTEN_KEEPALIVE_RETRIES: u32 = 3;

/// A checked connection target: loopback or a Unix socket directory ([`Target::parse`]), or any
/// host with the TLS settings and password its caller gives ([`Target::parse_remote`]).
#[derive(Clone)]
pub struct Target {
    pub(crate) config: tokio_postgres::Config,
    /// `user@host:port/database`, without any password: safe to print.
    pub(crate) description: String,
    /// The TLS connector; `None` is plain TCP or a Unix socket (`sslmode = disable`).
    pub(crate) tls: Option<MakeRustlsConnect>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

impl Target {
    /// Parses a `postgres://` (or `postgresql://`) URL and insists on a loopback host or a Unix
    /// socket directory. The URL's password, if any, never appears in an error or a description.
    pub fn parse(url: &str) -> Result<Target, PostgresError> {
        let (config, description) = parse_url(url, true)?;
        Ok(Target {
            config,
            description,
            tls: None,
        })
    }

    /// Parses a URL whose host may be anywhere, and connects as `remote` says: libpq's
    /// `sslmode` (the URL's own `sslmode` is replaced), the CA and the client certificate, the
    /// password (the URL's, if any, is kept when `remote` gives none). Whether a host beyond
    /// loopback may be reached with less than `verify-full` is the caller's rule.
    pub fn parse_remote(url: &str, remote: &Remote) -> Result<Target, PostgresError> {
        let (mut config, description) = parse_url(url, false)?;
        if let Some(password) = &remote.password {
            config.password(password.as_bytes());
        }
        let tls = match remote.sslmode {
            SslMode::Disable => {
                config.ssl_mode(tokio_postgres::config::SslMode::Disable);
                None
            }
            // The verification is rustls's (see `tls`); tokio-postgres only has to insist.
            _ => {
                config.ssl_mode(tokio_postgres::config::SslMode::Require);
                Some(MakeRustlsConnect::new(super::tls::client_config(remote)?))
            }
        };
        Ok(Target {
            config,
            description,
            tls,
        })
    }

    /// Whether every host of the target is loopback or a Unix socket directory.
    pub fn is_local(&self) -> bool {
        self.config.get_hosts().iter().all(|host| match host {
            Host::Tcp(name) => is_loopback_name(name),
            Host::Unix(_) => true,
        }) && self.config.get_hostaddrs().iter().all(IpAddr::is_loopback)
    }

    /// The connection settings, password included: not for printing.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// A pool manager that connects as this target does.
    pub(crate) fn manager(
        &self,
        settings: deadpool_postgres::ManagerConfig,
    ) -> deadpool_postgres::Manager {
        match &self.tls {
            Some(tls) => {
                deadpool_postgres::Manager::from_config(self.config.clone(), tls.clone(), settings)
            }
            None => deadpool_postgres::Manager::from_config(self.config.clone(), NoTls, settings),
        }
    }

    /// Opens one connection outside any pool (migrations, the operator commands); the connection
    /// task runs until the client is dropped.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, PostgresError> {
        let failed = |error: tokio_postgres::Error| connect_failure(&self.description, &error);
        // The connection ends with the client or the server; its error, if any, surfaces on
        // the client's next statement.
        match &self.tls {
            Some(tls) => {
                let (client, connection) =
                    self.config.connect(tls.clone()).await.map_err(failed)?;
                tokio::spawn(async move {
                    let _ = connection.await;
                });
                Ok(client)
            }
            None => {
                let (client, connection) = self.config.connect(NoTls).await.map_err(failed)?;
                tokio::spawn(async move {
                    let _ = connection.await;
                });
                Ok(client)
            }
        }
    }

    /// Opens one connection outside any pool that listens on `channel` (`LISTEN`), for as long
    /// as the answer is kept. Notifications are coalesced: one not yet taken stands for every
    /// later one, which suits a caller that only needs to know that something happened. Those
    /// whose payload is `except` (a caller's own, say) are left out.
    pub async fn listen(
        &self,
        channel: &str,
        except: Option<String>,
    ) -> Result<Listening, PostgresError> {
        let failed = |error: tokio_postgres::Error| connect_failure(&self.description, &error);
        let (heard, receiver) = tokio::sync::mpsc::channel(1);
        // A listener never sends: without probes, a peer that vanished unseen (a restart behind
        // a partition) would leave it waiting forever for notifications that cannot come.
        let mut config = self.config.clone();
        config
            .keepalives(true)
            .keepalives_idle(LISTEN_KEEPALIVE_IDLE)
            .keepalives_interval(LISTEN_KEEPALIVE_INTERVAL)
            .keepalives_retries(LISTEN_KEEPALIVE_RETRIES);
        let client = match &self.tls {
            Some(tls) => {
                let (client, connection) = config.connect(tls.clone()).await.map_err(failed)?;
                tokio::spawn(forward_notifications(connection, heard, except));
                client
            }
            None => {
                let (client, connection) = config.connect(NoTls).await.map_err(failed)?;
                tokio::spawn(forward_notifications(connection, heard, except));
                client
            }
        };
        let quoted = channel.replace('"', "\"\"");
        client
            .batch_execute(&format!("LISTEN \"{quoted}\""))
            .await
            .map_err(failed)?;
        Ok(Listening {
            _client: client,
            heard: receiver,
        })
    }
}

/// A connection listening on a channel ([`Target::listen`]); dropping it closes the connection.
pub struct Listening {
    /// Kept for the connection's sake: it ends when its last client is dropped.
    _client: tokio_postgres::Client,
    heard: tokio::sync::mpsc::Receiver<()>,
}

impl Listening {
    /// Waits for the next notification: `false` once the connection has ended.
    pub async fn notified(&mut self) -> bool {
        self.heard.recv().await.is_some()
    }
}

/// Drives `connection` until it ends, passing each notification whose payload is not `except`
/// on to `heard`, unless one is already waiting there.
async fn forward_notifications<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    heard: tokio::sync::mpsc::Sender<()>,
    except: Option<String>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::StreamExt;
    let mut messages = futures_util::stream::poll_fn(|cx| connection.poll_message(cx));
    while let Some(Ok(message)) = messages.next().await {
        let tokio_postgres::AsyncMessage::Notification(notification) = message else {
            continue;
        };
        if except.as_deref() != Some(notification.payload())
            && let Err(tokio::sync::mpsc::error::TrySendError::Closed(())) = heard.try_send(())
        {
            return;
        }
    }
}

/// Why a connection could not be opened, sorted so that a caller can name its setting: the
/// server's certificate, the password, or anything else.
fn connect_failure(target: &str, error: &tokio_postgres::Error) -> PostgresError {
    let target = target.to_owned();
    let reason = error_text(error);
    let code = error.as_db_error().map(|db| db.code().code());
    // 28P01 is a refused password; 28000 (no pg_hba.conf entry, no client certificate) is not
    // about the password and stays a connection failure.
    if code == Some("28P01") || reason.contains("password missing") {
        return PostgresError::Authentication { target, reason };
    }
    if refused_certificate(error) {
        return PostgresError::Certificate { target, reason };
    }
    PostgresError::Connect { target, reason }
}

/// Whether rustls refused the server's certificate somewhere in the error's causes.
fn refused_certificate(error: &tokio_postgres::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(current) = cause {
        let tls = current.downcast_ref::<rustls::Error>().or_else(|| {
            current
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if matches!(
            tls,
            Some(rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented)
        ) {
            return true;
        }
        cause = current.source();
    }
    false
}

/// Parses a `postgres://` URL; with `local_only`, every host must be loopback or a socket.
fn parse_url(
    url: &str,
    local_only: bool,
) -> Result<(tokio_postgres::Config, String), PostgresError> {
    {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(PostgresError::BadUrl(
                "it must start with postgres:// or postgresql://".to_owned(),
            ));
        }
        let mut config = tokio_postgres::Config::from_str(url).map_err(|error| {
            // tokio-postgres's messages name the offending part, not the whole URL.
            PostgresError::BadUrl(error.to_string())
        })?;
        let hosts = config.get_hosts();
        if hosts.is_empty() && config.get_hostaddrs().is_empty() {
            return Err(PostgresError::BadUrl(
                "it names no host: give 127.0.0.1, ::1, localhost or a socket directory".to_owned(),
            ));
        }
        for host in hosts.iter().filter(|_| local_only) {
            match host {
                Host::Tcp(name) if is_loopback_name(name) => {}
                Host::Tcp(name) => return Err(PostgresError::NotLocal(name.clone())),
                Host::Unix(path) if path.is_absolute() => {}
                Host::Unix(path) => {
                    return Err(PostgresError::NotLocal(path.display().to_string()));
                }
            }
        }
        if let Some(address) = config
            .get_hostaddrs()
            .iter()
            .find(|a| local_only && !a.is_loopback())
        {
            return Err(PostgresError::NotLocal(address.to_string()));
        }
        // Every statement of the inbox is a key lookup or a keyed write: a generic plan is
        // always the right one, so the server never re-plans a prepared statement.
        let options = match config.get_options() {
            Some(given) => format!("{given} -c plan_cache_mode=force_generic_plan"),
            None => "-c plan_cache_mode=force_generic_plan".to_owned(),
        };
        config
            .connect_timeout(CONNECT_TIMEOUT)
            .application_name("production-lab ordered inbox")
            .options(options);
        let description = describe(&config);
        Ok((config, description))
    }
}

fn is_loopback_name(name: &str) -> bool {
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let literal = name.trim_start_matches('[').trim_end_matches(']');
    literal.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn describe(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .chain(config.get_hostaddrs().iter().map(IpAddr::to_string))
        .next()
        .unwrap_or_default();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("");
    let database = config.get_dbname().unwrap_or(user);
    format!("{user}@{host}:{port}/{database}")
}

/// The text of a driver error including its cause (tokio-postgres's `Display` of a database
/// error is just "db error").
pub(crate) fn error_text(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => match std::error::Error::source(error) {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}

/// A failure underneath one attempt of an operation.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A statement failed before COMMIT was sent: the transaction did not commit.
    Db(tokio_postgres::Error),
    /// A statement of the final flight (the writes and COMMIT) failed. A database error there
    /// still means the transaction rolled back; a lost connection leaves its fate unknown.
    Commit(tokio_postgres::Error),
    /// No connection could be had.
    Pool(PoolError),
    /// A stored value this build cannot read.
    Data(String),
    /// The application's handler failed: the operation's transaction is rolled back, and the
    /// caller may deliver again.
    Handler(HandlerError),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(error: tokio_postgres::Error) -> Self {
        Failure::Db(error)
    }
}

impl From<UnknownValue> for Failure {
    fn from(error: UnknownValue) -> Self {
        Failure::Data(error.to_string())
    }
}

/// SQLSTATEs after which the whole operation is tried again: the transaction rolled back, and
/// reading the facts anew decides it correctly.
fn asks_for_retry(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code().map(|code| code.code()),
        Some("40001" | "40P01" | "23505")
    )
}

/// True when the database or the way to it is down, restarting or overloaded.
fn is_unavailable(error: &tokio_postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    match error.code().map(|code| code.code()) {
        // Connection exceptions, insufficient resources, operator intervention (shutdown,
        // cannot connect now), lock not available; and the retry codes once retries ran out.
        Some(code) => {
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P")
                || matches!(code, "55P03" | "40001" | "40P01" | "25006")
        }
        // No SQLSTATE: an I/O error, a timeout or a closed socket.
        None => true,
    }
}

impl Failure {
    /// Whether another attempt may be made.
    pub(crate) fn retryable(&self) -> bool {
        match self {
            Failure::Db(error) => asks_for_retry(error) || error.is_closed(),
            // A database error in the final flight means COMMIT did not take; a lost
            // connection there may have committed, so it is not retried: the caller learns
            // "unavailable" and its own retry reads the outcome (a replay).
            Failure::Commit(error) => asks_for_retry(error),
            Failure::Pool(_) | Failure::Data(_) | Failure::Handler(_) => false,
        }
    }

    /// Whether the failure belongs to the one delivery whose statement or value caused it (a
    /// value PostgreSQL refused, a stored row this build cannot read, the handler), so that a
    /// group commit replays its deliveries one by one rather than failing them all: neither a
    /// condition another attempt clears nor a database that is unreachable.
    pub(crate) fn concerns_one_unit(&self) -> bool {
        match self {
            Failure::Db(error) | Failure::Commit(error) => {
                error.as_db_error().is_some() && !asks_for_retry(error) && !is_unavailable(error)
            }
            Failure::Data(_) | Failure::Handler(_) => true,
            Failure::Pool(_) => false,
        }
    }

    pub(crate) fn into_inbox_error(self) -> InboxError {
        match self {
            Failure::Db(error) | Failure::Commit(error) => {
                let text = format!("postgres: {}", error_text(&error));
                if is_unavailable(&error) {
                    InboxError::Unavailable(text)
                } else {
                    InboxError::Failed(text)
                }
            }
            Failure::Pool(error) => InboxError::Unavailable(format!("postgres pool: {error}")),
            Failure::Data(text) => InboxError::Failed(text),
            Failure::Handler(error) => InboxError::Handler(error),
        }
    }
}

/// Counters of the backend's work: operations (each delivery counts as one, grouped or not),
/// database round trips, retried attempts, and the group commits with the deliveries they
/// committed and the groups replayed one delivery at a time.
#[derive(Debug, Default)]
pub struct Counters {
    pub(crate) operations: AtomicU64,
    pub(crate) round_trips: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) group_commits: AtomicU64,
    pub(crate) grouped_deliveries: AtomicU64,
    pub(crate) replays: AtomicU64,
}

impl Counters {
    /// One flight of pipelined statements and its answers.
    pub(crate) fn trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostgresStats {
    /// Operations run (deliveries, resolutions, reads and the rest).
    pub operations: u64,
    /// Flights of pipelined statements sent.
    pub round_trips: u64,
    /// Transactions run again after PostgreSQL asked for a retry.
    pub retries: u64,
    /// Transactions the group commit committed, and the deliveries in them.
    pub group_commits: u64,
    /// Deliveries committed by the group commit.
    pub grouped_deliveries: u64,
    /// Groups replayed one delivery at a time (a poison or an error from the handler's `apply`,
    /// or a value PostgreSQL refused).
    pub replays: u64,
}

pub(crate) type Client = deadpool_postgres::Client;

/// Ends whatever transaction a failed attempt left open; a connection that cannot even do that
/// is taken out of the pool.
pub(crate) async fn release_after_failure(client: Client) {
    if client.is_closed() || client.batch_execute("ROLLBACK").await.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_and_socket_directories_are_accepted() {
        for url in [
            "postgres://lab@127.0.0.1:5432/inbox",
            "postgresql://lab@localhost/inbox",
            "postgres://lab@[::1]:6000/inbox",
            "postgres://lab@%2Ftmp%2Fpg/inbox",
            "postgres://lab@/inbox?host=/var/run/postgresql",
            "postgres://lab:secret@127.0.0.2:5432/inbox",
        ] {
            let target = Target::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert!(!target.to_string().contains("secret"), "{target}");
        }
        assert_eq!(
            Target::parse("postgres://lab:pw@127.0.0.1:5433/inbox")
                .unwrap()
                .to_string(),
            "lab@127.0.0.1:5433/inbox"
        );
    }

    #[test]
    fn a_remote_target_takes_any_host_and_its_sslmode_replaces_the_url_s() {
        let remote = Remote {
            sslmode: SslMode::Require,
            password: Some("from-the-environment".to_owned()),
            ..Remote::default()
        };
        let target = Target::parse_remote(
            "postgres://gate@db.example.com:6432/gate?sslmode=disable",
            &remote,
        )
        .unwrap();
        assert_eq!(target.to_string(), "gate@db.example.com:6432/gate");
        assert!(!target.is_local());
        assert!(target.tls.is_some());
        assert_eq!(
            target.config().get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(
            target.config().get_password(),
            Some(&b"from-the-environment"[..])
        );
        assert!(!format!("{remote:?}").contains("from-the-environment"));
        let plain =
            Target::parse_remote("postgres://gate@127.0.0.1/gate", &Remote::default()).unwrap();
        assert!(plain.is_local() && plain.tls.is_none());
        let verify = Remote {
            sslmode: SslMode::VerifyFull,
            ..Remote::default()
        };
        assert!(matches!(
            Target::parse_remote("postgres://gate@db.example.com/gate", &verify),
            Err(PostgresError::BadUrl(reason)) if reason.contains("sslrootcert")
        ));
        let missing = Remote {
            sslmode: SslMode::VerifyCa,
            root_certificate: Some("/nonexistent/ca.pem".into()),
            ..Remote::default()
        };
        assert!(matches!(
            Target::parse_remote("postgres://gate@db.example.com/gate", &missing),
            Err(PostgresError::TlsFile { file, .. }) if file == "/nonexistent/ca.pem"
        ));
        assert_eq!("verify-ca".parse::<SslMode>(), Ok(SslMode::VerifyCa));
        assert!("prefer".parse::<SslMode>().is_err());
    }

    #[test]
    fn other_hosts_and_other_forms_are_refused_without_echoing_a_password() {
        for url in [
            "postgres://lab:secret@db.example.com/inbox",
            "postgres://lab:secret@10.0.0.5:5432/inbox",
            "postgres://lab:secret@0.0.0.0/inbox",
            "postgres://lab:secret@127.0.0.1,db.example.com/inbox",
            "postgres://lab:secret@/inbox?hostaddr=192.168.1.2",
        ] {
            let error = Target::parse(url).unwrap_err();
            assert!(
                matches!(error, PostgresError::NotLocal(_)),
                "{url}: {error}"
            );
            assert!(!error.to_string().contains("secret"), "{error}");
        }
        for url in [
            "host=127.0.0.1 user=lab",
            "mysql://lab@127.0.0.1/inbox",
            "postgres://lab@/inbox",
        ] {
            assert!(
                matches!(Target::parse(url), Err(PostgresError::BadUrl(_))),
                "{url}"
            );
        }
    }
}
