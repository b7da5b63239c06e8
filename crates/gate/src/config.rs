//! The gate's configuration file (TOML), read and checked once at start. Every mistake is found
//! in one pass and reported together ([`ConfigErrors`]), one line per mistake, each naming its
//! key (`listen.address: …`, `types."order.placed".schema: …`), so that a deploy fails once with
//! the whole list rather than once per mistake.
//!
//! Each table has a serde shape that denies unknown keys; a table that does not fit is read
//! again key by key to say which keys are wrong. Relative paths are relative to the file's
//! directory. Secrets (reader tokens, the PostgreSQL URL) come from the environment or the file
//! and are never shown by `Debug` or in an error.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use ordered_inbox::postgres::{ClientCertificate, Remote, SslMode};

use crate::schemas::MessageTypes;
use http_edge::jetstream::config::{NatsAccess, NatsAuth, NatsTls};
use http_edge::limits::{ConnectionLimits, MAX_REQUEST_BODY_BYTES};
use http_edge::observe::LogFormat;
use http_edge::tls::{self, TlsFiles};

/// Everything `production-lab gate` runs with, checked.
#[derive(Debug, Clone)]
pub struct GateConfig {
    pub listen: Listen,
    /// Serve HTTPS with these files; `None` is plain HTTP (loopback, or behind `trusted_proxy`).
    pub tls: Option<TlsFiles>,
    pub store: GateStore,
    pub auth: Auth,
    pub limits: GateLimits,
    pub metrics: MetricsSettings,
    pub log: LogSettings,
    /// The JetStream input and output; `None` is HTTP only.
    pub nats: Option<GateNats>,
    pub publisher: PublisherSettings,
    /// `[retention]`: what the store keeps, and how often the gate prunes the rest.
    pub retention: GateRetention,
    /// Each message type with its JSON Schema, as read from its file (compiled by
    /// [`crate::schemas`]).
    pub types: Vec<(String, Value)>,
    /// Each type's `gap_alert_after_ms`, for the types that set one: how long an aggregate whose
    /// lowest held successor has that type may wait before it counts as overdue.
    pub gap_alerts: Vec<(String, Duration)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listen {
    pub address: SocketAddr,
    /// The one proxy in front of the gate whose `X-Forwarded-*` headers are believed (it
    /// terminates TLS when the gate listens beyond loopback without `[tls]`).
    pub trusted_proxy: Option<IpAddr>,
}

/// Where the inbox (and the gate's output table) lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateStore {
    Sqlite(PathBuf),
    /// The URL read from the environment variable `env`, reached as `access` says.
    Postgres {
        url: Secret,
        env: String,
        access: PostgresAccess,
    },
}

/// How the gate reaches its PostgreSQL store: libpq's sslmode, the CA, a client certificate,
/// the password; and whether a host beyond loopback may be reached with less than
/// `verify-full`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PostgresAccess {
    pub remote: Remote,
    /// The key the password came from, for a refusal of it.
    pub password_key: Option<&'static str>,
    pub allow_insecure: bool,
    /// The URL's first host beyond loopback, if it names one.
    pub remote_host: Option<String>,
}

/// A credential or a URL that may hold one: shown as `…` by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// Whether a write without a producer's credential is taken.
    pub anonymous_writes: bool,
    pub readers: Vec<Reader>,
}

/// A read-only credential for the evidence routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reader {
    pub name: String,
    pub token: Secret,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateLimits {
    /// The largest message body; a larger one answers 413.
    pub max_payload_bytes: usize,
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub body_read_timeout: Duration,
    pub request_body_budget: usize,
    pub producer_rate_per_second: NonZeroU32,
    pub producer_burst: NonZeroU32,
    pub max_open_dead_letters: usize,
    pub max_held: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsSettings {
    /// Whether `GET /metrics` answers without a credential.
    pub public: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    pub format: LogFormat,
}

/// How the gates of one store share its output's publishing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublisherSettings {
    /// How long the publisher's lease lasts unless renewed: how soon another gate of the store
    /// takes over from a holder that stopped.
    pub lease: Duration,
}

/// `[retention]`: the inbox's policy, the output's, and the pruner's pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateRetention {
    /// Applied identities, timeline compaction, closed dead letters.
    pub inbox: ordered_inbox::retention::Retention,
    /// Published output rows are deleted once applied longer ago than this (`None`: kept).
    pub output: Option<Duration>,
    /// How long the pruner rests after a round that found nothing more to prune.
    pub interval: Duration,
    /// The most rows of each kind one batch deletes.
    pub batch: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateNats {
    pub urls: Vec<String>,
    pub input: NatsInput,
    pub output: NatsOutput,
    /// `[nats.tls]` and `[nats.auth]`.
    pub access: NatsAccess,
    pub allow_insecure: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsInput {
    pub stream: String,
    pub subject_prefix: String,
    pub durable: String,
    pub batch: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsOutput {
    pub stream: String,
    pub subject_prefix: String,
}

pub const DEFAULT_ADDRESS: &str = "127.0.0.1:8080";
pub const DEFAULT_SQLITE: &str = "gate.db";
pub const DEFAULT_MAX_PAYLOAD_BYTES: u64 = 65_536;
pub const DEFAULT_PRODUCER_RATE_PER_SECOND: u64 = 500;
pub const DEFAULT_PRODUCER_BURST: u64 = 1000;
pub const DEFAULT_INPUT_STREAM: &str = "GATE_IN";
pub const DEFAULT_INPUT_SUBJECT_PREFIX: &str = "gate.in";
pub const DEFAULT_DURABLE: &str = "gate";
pub const DEFAULT_BATCH: u64 = 64;
pub const DEFAULT_OUTPUT_STREAM: &str = "GATE_OUT";
pub const DEFAULT_OUTPUT_SUBJECT_PREFIX: &str = "gate.out";
pub const DEFAULT_LEASE_MS: u64 = 5_000;
/// Published output rows are kept as long as applied identities, by default.
pub const DEFAULT_OUTPUT_RETENTION: Duration =
    ordered_inbox::retention::Retention::DEFAULT_IDENTITIES;
pub const DEFAULT_PRUNE_INTERVAL_MS: u64 = 10_000;
const MAX_PRUNE_INTERVAL_MS: u64 = 3_600_000;
const MAX_PRUNE_BATCH: u64 = 10_000;
/// The longest retention a key takes: ten years.
const MAX_RETENTION: Duration = Duration::from_secs(10 * 366 * 24 * 60 * 60);
/// The shortest lease the file accepts: its holder renews it several times within.
const MIN_LEASE_MS: u64 = 300;
const MAX_LEASE_MS: u64 = 600_000;
/// The longest timeout the file accepts (an hour), as `serve`'s flags.
const MAX_TIMEOUT_MS: u64 = 3_600_000;
const MAX_REQUEST_BODY_BUDGET: u64 = 64 * 1024 * 1024 * 1024;
/// The most a per-aggregate bound or a producer's rate may be.
const MAX_BOUND: u64 = 1_000_000;

impl GateConfig {
    /// Reads and checks the file at `path`, with the process's environment.
    pub fn load(path: &Path) -> Result<GateConfig, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|error| {
            ConfigErrors(vec![ConfigError::new(
                path.display().to_string(),
                format!("cannot read: {error}"),
            )])
        })?;
        let parent = path
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base_dir = std::path::absolute(parent).unwrap_or_else(|_| parent.to_owned());
        GateConfig::parse(&text, &base_dir, &|name| std::env::var(name).ok())
    }

    /// Checks `text`; paths are relative to `base_dir`, `env` answers environment variables.
    pub fn parse(
        text: &str,
        base_dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<GateConfig, ConfigErrors> {
        let table: toml::Table =
            toml::from_str(text).map_err(|error| ConfigErrors(vec![syntax_error(text, &error)]))?;
        let mut checker = Checker::new(base_dir, env);
        let config = checker.file(toml::Value::Table(table));
        match config {
            Some(config) if checker.errors.is_empty() => Ok(config),
            _ => Err(ConfigErrors(checker.errors)),
        }
    }

    /// The connection server's limits.
    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: self.limits.header_read_timeout,
            body_read_timeout: self.limits.body_read_timeout,
            keep_alive_timeout: self.limits.keep_alive_timeout,
            max_connections: self.limits.max_connections,
            request_body_budget: self.limits.request_body_budget,
        }
    }

    /// One line for each setting that weakens TLS or credentials, to be logged as a warning at
    /// every start.
    pub fn insecure_settings(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let GateStore::Postgres { access, .. } = &self.store
            && access.allow_insecure
        {
            lines.push(format!(
                "store.allow_insecure = true: PostgreSQL is reached with sslmode {}{}",
                access.remote.sslmode,
                access
                    .remote_host
                    .as_ref()
                    .map(|host| format!(" at {host}, beyond loopback"))
                    .unwrap_or_default()
            ));
        }
        if let Some(nats) = &self.nats
            && nats.allow_insecure
        {
            lines.push(format!(
                "nats.allow_insecure = true: NATS is reached {}",
                if nats.access.tls.is_some() {
                    "with TLS"
                } else {
                    "without TLS, credentials and messages in clear beyond loopback"
                }
            ));
        }
        lines
    }

    /// The bounds the ordered inbox keeps.
    pub fn inbox_limits(&self) -> ordered_inbox::Limits {
        ordered_inbox::Limits {
            max_open_dead_letters: self.limits.max_open_dead_letters,
            max_held_per_aggregate: self.limits.max_held,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// One mistake: the key it is about and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Every mistake found, in the file's order of tables; `Display` is one line each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    pub fn iter(&self) -> impl Iterator<Item = &ConfigError> {
        self.0.iter()
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, error) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A TOML syntax error at its line and column (toml's own text draws the line with a caret
/// over several lines; one line is kept).
fn syntax_error(text: &str, error: &toml::de::Error) -> ConfigError {
    let start = error.span().map_or(0, |span| span.start).min(text.len());
    let before = text.get(..start).unwrap_or("");
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit_once('\n')
        .map_or(before, |(_, tail)| tail)
        .chars()
        .count()
        + 1;
    let message = one_line(error.message());
    ConfigError::new(
        format!("line {line}, column {column}"),
        format!("not valid TOML: {message}"),
    )
}

fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `parent.key`, quoting a key that is not bare (`types."order.placed"`).
fn join(parent: &str, key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let key = if bare {
        key.to_owned()
    } else {
        format!("{key:?}")
    };
    if parent.is_empty() {
        key
    } else {
        format!("{parent}.{key}")
    }
}

// ---------------------------------------------------------------------------------------------
// The file's shape: every table denies unknown keys; every key is optional here, and required
// keys are checked after, so that a table can be read one key at a time.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    listen: Option<toml::Value>,
    tls: Option<toml::Value>,
    store: Option<toml::Value>,
    auth: Option<toml::Value>,
    limits: Option<toml::Value>,
    metrics: Option<toml::Value>,
    log: Option<toml::Value>,
    nats: Option<toml::Value>,
    publisher: Option<toml::Value>,
    retention: Option<toml::Value>,
    types: Option<BTreeMap<String, toml::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawListen {
    address: Option<String>,
    trusted_proxy: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTls {
    certificate: Option<PathBuf>,
    key: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    sqlite: Option<PathBuf>,
    postgres_url_env: Option<String>,
    sslmode: Option<String>,
    sslrootcert: Option<PathBuf>,
    sslcert: Option<PathBuf>,
    sslkey: Option<PathBuf>,
    password_env: Option<String>,
    password_file: Option<PathBuf>,
    allow_insecure: Option<bool>,
}

impl RawStore {
    /// The PostgreSQL-only keys given, for a refusal beside `sqlite`.
    fn postgres_keys(&self) -> Vec<&'static str> {
        [
            ("sslmode", self.sslmode.is_some()),
            ("sslrootcert", self.sslrootcert.is_some()),
            ("sslcert", self.sslcert.is_some()),
            ("sslkey", self.sslkey.is_some()),
            ("password_env", self.password_env.is_some()),
            ("password_file", self.password_file.is_some()),
            ("allow_insecure", self.allow_insecure.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, given)| given.then_some(key))
        .collect()
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    anonymous_writes: Option<bool>,
    readers: Option<Vec<toml::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawReader {
    name: Option<String>,
    token_env: Option<String>,
    token: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    max_payload_bytes: Option<u64>,
    max_connections: Option<u64>,
    header_read_timeout_ms: Option<u64>,
    keep_alive_timeout_ms: Option<u64>,
    body_read_timeout_ms: Option<u64>,
    request_body_budget_bytes: Option<u64>,
    producer_rate_per_second: Option<u64>,
    producer_burst: Option<u64>,
    max_open_dead_letters: Option<u64>,
    max_held: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    public: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLog {
    format: Option<RawLogFormat>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawLogFormat {
    Json,
    Text,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRetention {
    identities: Option<String>,
    timeline: Option<toml::Value>,
    output: Option<String>,
    dead_letters: Option<String>,
    interval_ms: Option<u64>,
    batch: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPublisher {
    lease_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNats {
    urls: Option<Vec<String>>,
    input: Option<toml::Value>,
    output: Option<toml::Value>,
    tls: Option<toml::Value>,
    auth: Option<toml::Value>,
    allow_insecure: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNatsTls {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNatsAuth {
    creds_file: Option<PathBuf>,
    nkey_seed_file: Option<PathBuf>,
    user: Option<String>,
    password_env: Option<String>,
    token_env: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawInput {
    stream: Option<String>,
    subject_prefix: Option<String>,
    durable: Option<String>,
    batch: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    stream: Option<String>,
    subject_prefix: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawType {
    schema: Option<PathBuf>,
    gap_alert_after_ms: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// Reading and checking, collecting every error

struct Checker<'a> {
    base_dir: &'a Path,
    env: &'a dyn Fn(&str) -> Option<String>,
    errors: Vec<ConfigError>,
}

impl<'a> Checker<'a> {
    fn new(base_dir: &'a Path, env: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Checker {
            base_dir,
            env,
            errors: Vec::new(),
        }
    }

    fn error(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.errors.push(ConfigError::new(key, message));
    }

    /// Reads a table into its shape. When it does not fit, each key is read alone: every key
    /// that is wrong is named, and the table is read without them so that the others are still
    /// checked.
    fn shape<T: DeserializeOwned>(&mut self, value: toml::Value, path: &str) -> Option<T> {
        let whole = match T::deserialize(value.clone()) {
            Ok(shaped) => return Some(shaped),
            Err(error) => error,
        };
        let shown = if path.is_empty() { "file" } else { path };
        let toml::Value::Table(table) = value else {
            self.error(shown, "must be a table");
            return None;
        };
        let mut fitting = toml::Table::new();
        for (key, item) in table {
            let alone = toml::Table::from_iter([(key.clone(), item.clone())]);
            match T::deserialize(toml::Value::Table(alone)) {
                Ok(_) => {
                    fitting.insert(key, item);
                }
                Err(error) => self.error(join(path, &key), field_message(error.message())),
            }
        }
        T::deserialize(toml::Value::Table(fitting))
            .map_err(|_| self.error(shown, field_message(whole.message())))
            .ok()
    }

    /// A section's shape, or its defaults when the section is absent.
    fn section<T: DeserializeOwned + Default>(
        &mut self,
        value: Option<toml::Value>,
        path: &str,
    ) -> Option<T> {
        match value {
            None => Some(T::default()),
            Some(value) => self.shape(value, path),
        }
    }

    fn path(&self, relative: &Path) -> PathBuf {
        self.base_dir.join(relative)
    }

    fn file(&mut self, value: toml::Value) -> Option<GateConfig> {
        let raw: RawFile = self.shape(value, "")?;
        let listen = self.listen(raw.listen);
        let tls = self.tls(raw.tls);
        if let (Some(listen), Some(None)) = (&listen, &tls) {
            self.require_tls_beyond_loopback(listen);
        }
        let store = self.store(raw.store);
        let auth = self.auth(raw.auth);
        let limits = self.limits(raw.limits);
        let metrics = self.section::<RawMetrics>(raw.metrics, "metrics");
        let log = self.section::<RawLog>(raw.log, "log");
        let nats = self.nats(raw.nats);
        let publisher = self.publisher(raw.publisher);
        let retention = self.retention(raw.retention);
        let (types, gap_alerts) = self.types(raw.types).unzip();
        Some(GateConfig {
            listen: listen?,
            tls: tls?,
            store: store?,
            auth: auth?,
            limits: limits?,
            metrics: MetricsSettings {
                public: metrics?.public.unwrap_or(true),
            },
            log: LogSettings {
                format: match log?.format {
                    Some(RawLogFormat::Text) => LogFormat::Text,
                    Some(RawLogFormat::Json) | None => LogFormat::Json,
                },
            },
            nats: nats?,
            publisher: publisher?,
            retention: retention?,
            types: types?,
            gap_alerts: gap_alerts?,
        })
    }

    fn listen(&mut self, value: Option<toml::Value>) -> Option<Listen> {
        let raw: RawListen = self.section(value, "listen")?;
        let text = raw.address.unwrap_or_else(|| DEFAULT_ADDRESS.to_owned());
        let address = text.parse::<SocketAddr>().map_err(|_| {
            format!(
                "'{text}' is not an IP address with a port, such as 127.0.0.1:8080 or [::1]:8443"
            )
        });
        let trusted_proxy = raw.trusted_proxy.map(|text| {
            text.parse::<IpAddr>()
                .map_err(|_| format!("'{text}' is not an IP address, such as 10.0.0.2"))
        });
        let address = address.map_err(|message| self.error("listen.address", message));
        let trusted_proxy = trusted_proxy
            .transpose()
            .map_err(|message| self.error("listen.trusted_proxy", message));
        Some(Listen {
            address: address.ok()?,
            trusted_proxy: trusted_proxy.ok()?,
        })
    }

    /// Plain HTTP beyond loopback only behind a proxy that terminates TLS.
    fn require_tls_beyond_loopback(&mut self, listen: &Listen) {
        if !listen.address.ip().is_loopback() && listen.trusted_proxy.is_none() {
            self.error(
                "tls",
                format!(
                    "required when listen.address ({}) is not loopback; or set listen.trusted_proxy",
                    listen.address
                ),
            );
        }
    }

    /// `Some(None)`: no `[tls]`; `None`: a mistake in it.
    fn tls(&mut self, value: Option<toml::Value>) -> Option<Option<TlsFiles>> {
        let Some(value) = value else {
            return Some(None);
        };
        let raw: RawTls = self.shape(value, "tls")?;
        let certificate = self.required(raw.certificate, "tls.certificate");
        let key = self.required(raw.key, "tls.key");
        let files = TlsFiles {
            certificate: self.path(&certificate?),
            key: self.path(&key?),
        };
        let chain = tls::load_certificate_chain(&files.certificate)
            .map_err(|error| self.error("tls.certificate", error.to_string()));
        let private_key = tls::load_private_key(&files.key)
            .map_err(|error| self.error("tls.key", error.to_string()));
        if chain.is_err() || private_key.is_err() {
            return None;
        }
        // Both files parse: what is left is the pair (a key that is not the certificate's).
        tls::server_config(&files)
            .map_err(|error| self.error("tls", error.to_string()))
            .ok()
            .map(|_| Some(files))
    }

    /// A required key's value; missing is an error, unless the key was named wrong already.
    fn required<T>(&mut self, value: Option<T>, key: &str) -> Option<T> {
        if value.is_none() && !self.errors.iter().any(|error| error.key == key) {
            self.error(key, "required");
        }
        value
    }

    fn store(&mut self, value: Option<toml::Value>) -> Option<GateStore> {
        let Some(value) = value else {
            return Some(GateStore::Sqlite(self.path(Path::new(DEFAULT_SQLITE))));
        };
        let raw: RawStore = self.shape(value, "store")?;
        match (&raw.sqlite, &raw.postgres_url_env) {
            (Some(path), None) => {
                for key in raw.postgres_keys() {
                    self.error(
                        format!("store.{key}"),
                        "only with postgres_url_env (a PostgreSQL store)",
                    );
                }
                Some(GateStore::Sqlite(self.path(path)))
            }
            (None, Some(env)) => {
                let env = env.clone();
                let url = self.postgres_url(&env);
                let access = self.postgres_access(raw, url.as_ref());
                Some(GateStore::Postgres {
                    url: url?.0,
                    env,
                    access: access?,
                })
            }
            _ => {
                self.error(
                    "store",
                    "give exactly one of sqlite = \"FILE\" and postgres_url_env = \"VARIABLE\"",
                );
                None
            }
        }
    }

    /// The URL from the environment, parsed as tokio-postgres does; never shown.
    fn postgres_url(&mut self, env: &str) -> Option<(Secret, tokio_postgres::Config)> {
        let key = "store.postgres_url_env";
        let url = self.variable(env, key)?;
        let Ok(parsed) = url.parse::<tokio_postgres::Config>() else {
            self.error(
                key,
                format!(
                    "{env} does not hold a PostgreSQL connection URL (postgres://USER@HOST:PORT/DB)"
                ),
            );
            return None;
        };
        Some((Secret(url), parsed))
    }

    /// `[store]`'s TLS and password keys. `url` is `None` when the URL itself was refused (its
    /// host and password are then not checked).
    fn postgres_access(
        &mut self,
        raw: RawStore,
        url: Option<&(Secret, tokio_postgres::Config)>,
    ) -> Option<PostgresAccess> {
        let before = self.errors.len();
        let sslmode = match raw.sslmode.as_deref().map(str::parse::<SslMode>) {
            None => SslMode::Disable,
            Some(Ok(mode)) => mode,
            Some(Err(message)) => {
                self.error("store.sslmode", message);
                return None;
            }
        };
        let root_certificate = self.postgres_root_certificate(sslmode, raw.sslrootcert);
        let client_certificate = self.postgres_client_certificate(sslmode, raw.sslcert, raw.sslkey);
        let (password, password_key) =
            self.postgres_password(raw.password_env, raw.password_file, url);
        let allow_insecure = raw.allow_insecure.unwrap_or(false);
        let remote_host = url.and_then(|(_, config)| first_remote_host(config));
        if let Some(host) = &remote_host
            && sslmode != SslMode::VerifyFull
            && !allow_insecure
        {
            self.error(
                "store.sslmode",
                format!(
                    "'{sslmode}' to {host}, beyond loopback: only verify-full is accepted there, unless store.allow_insecure = true"
                ),
            );
        }
        (self.errors.len() == before).then_some(PostgresAccess {
            remote: Remote {
                sslmode,
                root_certificate,
                client_certificate,
                password,
            },
            password_key,
            allow_insecure,
            remote_host,
        })
    }

    /// `store.sslrootcert`: required by the verifying modes, meaningless without them.
    fn postgres_root_certificate(
        &mut self,
        sslmode: SslMode,
        path: Option<PathBuf>,
    ) -> Option<PathBuf> {
        let key = "store.sslrootcert";
        match (sslmode.verifies(), path) {
            (true, None) => {
                self.error(key, format!("required by sslmode {sslmode}"));
                None
            }
            (false, Some(_)) => {
                self.error(key, format!("only with sslmode verify-ca or verify-full (sslmode is {sslmode}, which checks no certificate)"));
                None
            }
            (_, None) => None,
            (true, Some(path)) => {
                let path = self.path(&path);
                ordered_inbox::postgres::tls::read_certificates(&path)
                    .map_err(|error| self.error(key, error.to_string()))
                    .ok()
                    .map(|_| path)
            }
        }
    }

    /// `store.sslcert` and `store.sslkey`: both or neither, and only with TLS.
    fn postgres_client_certificate(
        &mut self,
        sslmode: SslMode,
        certificate: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Option<ClientCertificate> {
        match (certificate, key) {
            (None, None) => None,
            (Some(_), None) => {
                self.error("store.sslkey", "required with store.sslcert");
                None
            }
            (None, Some(_)) => {
                self.error("store.sslcert", "required with store.sslkey");
                None
            }
            (Some(_), Some(_)) if sslmode == SslMode::Disable => {
                self.error("store.sslcert", "only with an sslmode other than disable");
                None
            }
            (Some(certificate), Some(key)) => {
                let files = ClientCertificate {
                    certificate: self.path(&certificate),
                    key: self.path(&key),
                };
                let chain = ordered_inbox::postgres::tls::read_certificates(&files.certificate)
                    .map_err(|error| self.error("store.sslcert", error.to_string()));
                let private = ordered_inbox::postgres::tls::read_private_key(&files.key)
                    .map_err(|error| self.error("store.sslkey", error.to_string()));
                (chain.is_ok() && private.is_ok()).then_some(files)
            }
        }
    }

    /// The password from `password_env` or `password_file` (its first line), at most one, and
    /// not beside a password in the URL.
    fn postgres_password(
        &mut self,
        env: Option<String>,
        file: Option<PathBuf>,
        url: Option<&(Secret, tokio_postgres::Config)>,
    ) -> (Option<String>, Option<&'static str>) {
        let (password, key) = match (env, file) {
            (None, None) => return (None, None),
            (Some(_), Some(_)) => {
                self.error(
                    "store",
                    "give at most one of password_env and password_file",
                );
                return (None, None);
            }
            (Some(name), None) => {
                let key = "store.password_env";
                (self.variable(&name, key), key)
            }
            (None, Some(path)) => {
                let key = "store.password_file";
                (self.password_file(&self.path(&path), key), key)
            }
        };
        if url.is_some_and(|(_, config)| config.get_password().is_some()) {
            self.error(key, "the URL holds a password too: give it in one place");
        }
        (password, Some(key))
    }

    /// The first line of a file that holds a secret alone.
    fn password_file(&mut self, path: &Path, key: &str) -> Option<String> {
        match std::fs::read_to_string(path) {
            Ok(text) => match text.lines().next().map(str::trim_end) {
                Some(line) if !line.is_empty() => Some(line.to_owned()),
                _ => {
                    self.error(key, format!("{} is empty", path.display()));
                    None
                }
            },
            Err(error) => {
                self.error(key, format!("cannot read {}: {error}", path.display()));
                None
            }
        }
    }

    /// An environment variable's value; a name that is unset or empty is an error at `key`.
    fn variable(&mut self, name: &str, key: &str) -> Option<String> {
        if name.is_empty() {
            self.error(key, "must name an environment variable");
            return None;
        }
        match (self.env)(name) {
            Some(value) if !value.is_empty() => Some(value),
            Some(_) => {
                self.error(key, format!("{name} is empty"));
                None
            }
            None => {
                self.error(key, format!("{name} is not set"));
                None
            }
        }
    }

    fn auth(&mut self, value: Option<toml::Value>) -> Option<Auth> {
        let raw: RawAuth = self.section(value, "auth")?;
        let mut readers = Vec::new();
        let mut names = HashSet::new();
        let mut complete = true;
        for (index, value) in raw.readers.unwrap_or_default().into_iter().enumerate() {
            let path = format!("auth.readers[{index}]");
            match self.reader(value, &path) {
                Some(reader) if !names.insert(reader.name.clone()) => {
                    self.error(
                        format!("{path}.name"),
                        format!("'{}' names another reader too", reader.name),
                    );
                    complete = false;
                }
                Some(reader) => readers.push(reader),
                None => complete = false,
            }
        }
        complete.then_some(Auth {
            anonymous_writes: raw.anonymous_writes.unwrap_or(false),
            readers,
        })
    }

    fn reader(&mut self, value: toml::Value, path: &str) -> Option<Reader> {
        let raw: RawReader = self.shape(value, path)?;
        let name = self.required(raw.name, &format!("{path}.name"));
        if name.as_deref().is_some_and(|name| name.trim().is_empty()) {
            self.error(format!("{path}.name"), "must not be blank");
            return None;
        }
        let token = match (raw.token, raw.token_env) {
            (Some(token), None) if token.is_empty() => {
                self.error(format!("{path}.token"), "must not be empty");
                None
            }
            (Some(token), None) => Some(token),
            (None, Some(env)) => self.variable(&env, &format!("{path}.token_env")),
            _ => {
                self.error(path, "give exactly one of token and token_env");
                None
            }
        };
        Some(Reader {
            name: name?,
            token: Secret(token?),
        })
    }

    fn limits(&mut self, value: Option<toml::Value>) -> Option<GateLimits> {
        let raw: RawLimits = self.section(value, "limits")?;
        let before = self.errors.len();
        let timeout = 1..=MAX_TIMEOUT_MS;
        let body = MAX_REQUEST_BODY_BYTES as u64;
        let mut bounded = |value, default, range, key| self.bounded(value, default, range, key);
        let limits = GateLimits {
            max_payload_bytes: bounded(
                raw.max_payload_bytes,
                DEFAULT_MAX_PAYLOAD_BYTES,
                1..=body,
                "max_payload_bytes",
            ) as usize,
            max_connections: bounded(
                raw.max_connections,
                http_edge::limits::DEFAULT_MAX_CONNECTIONS as u64,
                1..=65_536,
                "max_connections",
            ) as usize,
            header_read_timeout: Duration::from_millis(bounded(
                raw.header_read_timeout_ms,
                millis(http_edge::limits::DEFAULT_HEADER_READ_TIMEOUT),
                timeout.clone(),
                "header_read_timeout_ms",
            )),
            keep_alive_timeout: Duration::from_millis(bounded(
                raw.keep_alive_timeout_ms,
                millis(http_edge::limits::DEFAULT_KEEP_ALIVE_TIMEOUT),
                timeout.clone(),
                "keep_alive_timeout_ms",
            )),
            body_read_timeout: Duration::from_millis(bounded(
                raw.body_read_timeout_ms,
                millis(http_edge::limits::DEFAULT_BODY_READ_TIMEOUT),
                timeout,
                "body_read_timeout_ms",
            )),
            request_body_budget: bounded(
                raw.request_body_budget_bytes,
                http_edge::limits::DEFAULT_REQUEST_BODY_BUDGET as u64,
                body..=MAX_REQUEST_BODY_BUDGET,
                "request_body_budget_bytes",
            ) as usize,
            producer_rate_per_second: non_zero(bounded(
                raw.producer_rate_per_second,
                DEFAULT_PRODUCER_RATE_PER_SECOND,
                1..=MAX_BOUND,
                "producer_rate_per_second",
            )),
            producer_burst: non_zero(bounded(
                raw.producer_burst,
                DEFAULT_PRODUCER_BURST,
                1..=MAX_BOUND,
                "producer_burst",
            )),
            max_open_dead_letters: bounded(
                raw.max_open_dead_letters,
                u64::from(http_edge::limits::DEFAULT_MAX_OPEN_DEAD_LETTERS),
                1..=MAX_BOUND,
                "max_open_dead_letters",
            ) as usize,
            max_held: bounded(
                raw.max_held,
                u64::from(http_edge::limits::DEFAULT_MAX_HELD_PER_AGGREGATE),
                1..=MAX_BOUND,
                "max_held",
            ) as usize,
        };
        (self.errors.len() == before).then_some(limits)
    }

    /// `limits.KEY`'s value or its default; out of range is an error (and the default stands in).
    fn bounded(
        &mut self,
        value: Option<u64>,
        default: u64,
        range: RangeInclusive<u64>,
        key: &str,
    ) -> u64 {
        match value {
            None => default,
            Some(value) if range.contains(&value) => value,
            Some(value) => {
                self.error(
                    format!("limits.{key}"),
                    format!(
                        "must be from {} to {} (found {value})",
                        range.start(),
                        range.end()
                    ),
                );
                default
            }
        }
    }

    fn publisher(&mut self, value: Option<toml::Value>) -> Option<PublisherSettings> {
        let raw: RawPublisher = self.section(value, "publisher")?;
        let lease_ms = raw.lease_ms.unwrap_or(DEFAULT_LEASE_MS);
        if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&lease_ms) {
            self.error(
                "publisher.lease_ms",
                format!("must be from {MIN_LEASE_MS} to {MAX_LEASE_MS} (found {lease_ms})"),
            );
            return None;
        }
        Some(PublisherSettings {
            lease: Duration::from_millis(lease_ms),
        })
    }

    fn retention(&mut self, value: Option<toml::Value>) -> Option<GateRetention> {
        let raw: RawRetention = self.section(value, "retention")?;
        let before = self.errors.len();
        let defaults = ordered_inbox::retention::Retention::default();
        let identities = self.kept_for(raw.identities, "retention.identities", defaults.identities);
        let output = self.kept_for(
            raw.output,
            "retention.output",
            Some(DEFAULT_OUTPUT_RETENTION),
        );
        let dead_letters = self.kept_for(
            raw.dead_letters,
            "retention.dead_letters",
            defaults.dead_letters,
        );
        let timeline = match raw.timeline {
            None => defaults.timeline,
            Some(toml::Value::String(text)) if text == "forever" => None,
            Some(toml::Value::Integer(kept)) if (1..=i64::from(u32::MAX)).contains(&kept) => {
                u32::try_from(kept).ok()
            }
            Some(found) => {
                self.error(
                    "retention.timeline",
                    format!("must be a number of events from 1 up, or \"forever\" (found {found})"),
                );
                None
            }
        };
        let interval_ms = raw.interval_ms.unwrap_or(DEFAULT_PRUNE_INTERVAL_MS);
        if !(1..=MAX_PRUNE_INTERVAL_MS).contains(&interval_ms) {
            self.error(
                "retention.interval_ms",
                format!("must be from 1 to {MAX_PRUNE_INTERVAL_MS} (found {interval_ms})"),
            );
        }
        let batch = raw
            .batch
            .unwrap_or(ordered_inbox::retention::DEFAULT_BATCH as u64);
        if !(1..=MAX_PRUNE_BATCH).contains(&batch) {
            self.error(
                "retention.batch",
                format!("must be from 1 to {MAX_PRUNE_BATCH} (found {batch})"),
            );
        }
        (self.errors.len() == before).then(|| GateRetention {
            inbox: ordered_inbox::retention::Retention {
                identities,
                timeline,
                dead_letters,
            },
            output,
            interval: Duration::from_millis(interval_ms),
            batch: usize::try_from(batch).unwrap_or(1),
        })
    }

    /// A retention key: a duration such as `7d`, `12h`, `30m`, `45s` or `500ms`, or `forever`.
    fn kept_for(
        &mut self,
        text: Option<String>,
        key: &str,
        default: Option<Duration>,
    ) -> Option<Duration> {
        let Some(text) = text else {
            return default;
        };
        match retention_duration(&text) {
            Some(kept) => kept,
            None => {
                self.error(
                    key,
                    format!(
                        "must be a duration such as \"7d\", \"12h\", \"30m\", \"45s\" or \"500ms\" \
                         (at most ten years), or \"forever\" (found \"{text}\")"
                    ),
                );
                None
            }
        }
    }

    fn nats(&mut self, value: Option<toml::Value>) -> Option<Option<GateNats>> {
        let Some(value) = value else {
            return Some(None);
        };
        let raw: RawNats = self.shape(value, "nats")?;
        let urls = self.nats_urls(raw.urls.unwrap_or_default());
        let input = self.nats_input(raw.input);
        let output = self.nats_output(raw.output);
        let tls = self.nats_tls(raw.tls);
        let auth = self.nats_auth(raw.auth);
        let allow_insecure = raw.allow_insecure.unwrap_or(false);
        let (urls, input, output, tls, auth) = (urls?, input?, output?, tls?, auth?);
        if tls.is_none() && !allow_insecure {
            self.refuse_plain_beyond_loopback(&urls)?;
        }
        self.keep_streams_apart(&input, &output)?;
        Some(Some(GateNats {
            urls,
            input,
            output,
            access: NatsAccess { tls, auth },
            allow_insecure,
        }))
    }

    /// A `nats://` URL to a host beyond loopback without `[nats.tls]` would carry the
    /// credentials and the messages in clear.
    fn refuse_plain_beyond_loopback(&mut self, urls: &[String]) -> Option<()> {
        let before = self.errors.len();
        for (index, url) in urls.iter().enumerate() {
            let Ok(address) = url.parse::<async_nats::ServerAddr>() else {
                continue;
            };
            if address.tls_required()
                || address.scheme() == "wss"
                || is_loopback_host(address.host())
            {
                continue;
            }
            self.error(
                format!("nats.urls[{index}]"),
                format!(
                    "plain nats:// to {}, beyond loopback: add [nats.tls] or set nats.allow_insecure = true",
                    address.host()
                ),
            );
        }
        (self.errors.len() == before).then_some(())
    }

    /// `[nats.tls]`: the CA, and a client certificate with its key (both or neither).
    fn nats_tls(&mut self, value: Option<toml::Value>) -> Option<Option<NatsTls>> {
        let Some(value) = value else {
            return Some(None);
        };
        let raw: RawNatsTls = self.shape(value, "nats.tls")?;
        let before = self.errors.len();
        let ca = self
            .required(raw.ca, "nats.tls.ca")
            .map(|ca| self.path(&ca));
        if let Some(ca) = &ca {
            self.pem_certificates(ca, "nats.tls.ca");
        }
        let client = match (raw.cert, raw.key) {
            (None, None) => None,
            (Some(_), None) => {
                self.error("nats.tls.key", "required with nats.tls.cert");
                None
            }
            (None, Some(_)) => {
                self.error("nats.tls.cert", "required with nats.tls.key");
                None
            }
            (Some(cert), Some(key)) => {
                let (cert, key) = (self.path(&cert), self.path(&key));
                self.pem_certificates(&cert, "nats.tls.cert");
                if let Err(error) = tls::load_private_key(&key) {
                    self.error("nats.tls.key", error.to_string());
                }
                Some((cert, key))
            }
        };
        (self.errors.len() == before).then(|| ca.map(|ca| NatsTls { ca, client }))
    }

    fn pem_certificates(&mut self, path: &Path, key: &str) {
        if let Err(error) = tls::load_certificate_chain(path) {
            self.error(key, error.to_string());
        }
    }

    /// `[nats.auth]`: exactly one kind of credential, read now (a missing file is named here).
    fn nats_auth(&mut self, value: Option<toml::Value>) -> Option<Option<NatsAuth>> {
        let Some(value) = value else {
            return Some(None);
        };
        let raw: RawNatsAuth = self.shape(value, "nats.auth")?;
        let kinds = [
            raw.creds_file.is_some(),
            raw.nkey_seed_file.is_some(),
            raw.user.is_some() || raw.password_env.is_some(),
            raw.token_env.is_some(),
        ];
        if kinds.iter().filter(|given| **given).count() != 1 {
            self.error(
                "nats.auth",
                "give exactly one of creds_file, nkey_seed_file, user with password_env, token_env",
            );
            return None;
        }
        if let Some(path) = raw.creds_file {
            let path = self.path(&path);
            return match std::fs::read_to_string(&path) {
                Ok(_) => Some(Some(NatsAuth::CredsFile(path))),
                Err(error) => {
                    self.error(
                        "nats.auth.creds_file",
                        format!("cannot read {}: {error}", path.display()),
                    );
                    None
                }
            };
        }
        if let Some(path) = raw.nkey_seed_file {
            let key = "nats.auth.nkey_seed_file";
            let seed = self.password_file(&self.path(&path), key)?;
            if nkeys::KeyPair::from_seed(&seed).is_err() {
                self.error(key, "does not hold an nkey seed (SU…)");
                return None;
            }
            return Some(Some(NatsAuth::NkeySeed(seed)));
        }
        if let Some(name) = raw.token_env {
            let token = self.variable(&name, "nats.auth.token_env")?;
            return Some(Some(NatsAuth::Token(token)));
        }
        let user = self.required(raw.user, "nats.auth.user");
        let password = self.required(raw.password_env, "nats.auth.password_env");
        let password = self.variable(&password?, "nats.auth.password_env");
        Some(Some(NatsAuth::UserPassword {
            user: user?,
            password: password?,
        }))
    }

    /// Each URL as the NATS client reads it; the URL itself is not repeated (it may hold a
    /// password).
    fn nats_urls(&mut self, urls: Vec<String>) -> Option<Vec<String>> {
        if urls.is_empty() {
            self.error(
                "nats.urls",
                "at least one server URL (nats://HOST:PORT) is required",
            );
            return None;
        }
        let before = self.errors.len();
        for (index, url) in urls.iter().enumerate() {
            if let Err(error) = url.parse::<async_nats::ServerAddr>() {
                self.error(
                    format!("nats.urls[{index}]"),
                    format!("not a NATS server URL such as nats://HOST:PORT ({error})"),
                );
            }
        }
        (self.errors.len() == before).then_some(urls)
    }

    fn nats_input(&mut self, value: Option<toml::Value>) -> Option<NatsInput> {
        let raw: RawInput = self.section(value, "nats.input")?;
        let input = NatsInput {
            stream: raw
                .stream
                .unwrap_or_else(|| DEFAULT_INPUT_STREAM.to_owned()),
            subject_prefix: raw
                .subject_prefix
                .unwrap_or_else(|| DEFAULT_INPUT_SUBJECT_PREFIX.to_owned()),
            durable: raw.durable.unwrap_or_else(|| DEFAULT_DURABLE.to_owned()),
            batch: raw.batch.unwrap_or(DEFAULT_BATCH) as usize,
        };
        let before = self.errors.len();
        self.check_name(&input.stream, "nats.input.stream");
        self.check_name(&input.durable, "nats.input.durable");
        self.check_prefix(&input.subject_prefix, "nats.input.subject_prefix");
        if !(1..=10_000).contains(&input.batch) {
            self.error(
                "nats.input.batch",
                format!("must be from 1 to 10000 (found {})", input.batch),
            );
        }
        (self.errors.len() == before).then_some(input)
    }

    fn nats_output(&mut self, value: Option<toml::Value>) -> Option<NatsOutput> {
        let raw: RawOutput = self.section(value, "nats.output")?;
        let output = NatsOutput {
            stream: raw
                .stream
                .unwrap_or_else(|| DEFAULT_OUTPUT_STREAM.to_owned()),
            subject_prefix: raw
                .subject_prefix
                .unwrap_or_else(|| DEFAULT_OUTPUT_SUBJECT_PREFIX.to_owned()),
        };
        let before = self.errors.len();
        self.check_name(&output.stream, "nats.output.stream");
        self.check_prefix(&output.subject_prefix, "nats.output.subject_prefix");
        (self.errors.len() == before).then_some(output)
    }

    /// A stream or consumer name JetStream takes.
    fn check_name(&mut self, name: &str, key: &str) {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok {
            self.error(
                key,
                format!("'{name}' must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'"),
            );
        }
    }

    fn check_prefix(&mut self, prefix: &str, key: &str) {
        let ok = prefix.split('.').all(|token| {
            !token.is_empty()
                && token
                    .chars()
                    .all(|c| !c.is_whitespace() && !matches!(c, '*' | '>'))
        });
        if !ok {
            self.error(
                key,
                format!("'{prefix}' must be dot-separated tokens without '*', '>' or whitespace"),
            );
        }
    }

    /// The output must not land in the input stream (the gate would consume its own output), and
    /// each needs a stream of its own.
    fn keep_streams_apart(&mut self, input: &NatsInput, output: &NatsOutput) -> Option<()> {
        let before = self.errors.len();
        if input.stream == output.stream {
            self.error(
                "nats.output.stream",
                format!("'{}' is nats.input.stream too", output.stream),
            );
        }
        let (a, b) = (&input.subject_prefix, &output.subject_prefix);
        let nested =
            |outer: &str, inner: &str| inner == outer || inner.starts_with(&format!("{outer}."));
        if nested(a, b) || nested(b, a) {
            self.error(
                "nats.output.subject_prefix",
                format!("'{b}' overlaps nats.input.subject_prefix '{a}'"),
            );
        }
        (self.errors.len() == before).then_some(())
    }

    /// Each type's schema, and the gap alerts of the types that set one.
    fn types(
        &mut self,
        types: Option<BTreeMap<String, toml::Value>>,
    ) -> Option<(Vec<(String, Value)>, GapAlerts)> {
        let types = types.unwrap_or_default();
        if types.is_empty() {
            self.error(
                "types",
                "at least one message type is required, e.g. [types.\"order.placed\"] schema = \"schemas/order-placed.json\"",
            );
            return None;
        }
        let before = self.errors.len();
        let mut schemas = Vec::new();
        let mut gap_alerts = Vec::new();
        for (name, value) in types {
            let path = join("types", &name);
            if !is_type_name(&name) {
                self.error(
                    &path,
                    "a type name is 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'",
                );
                continue;
            }
            let Some(raw) = self.shape::<RawType>(value, &path) else {
                continue;
            };
            if let Some(after) = self.gap_alert_after(raw.gap_alert_after_ms, &path) {
                gap_alerts.push((name.clone(), after));
            }
            if let Some(schema) = self.schema(&name, raw.schema, &path) {
                schemas.push((name, schema));
            }
        }
        (self.errors.len() == before).then_some((schemas, gap_alerts))
    }

    /// A type's `gap_alert_after_ms`, when it sets one within bounds.
    fn gap_alert_after(&mut self, millis: Option<u64>, path: &str) -> Option<Duration> {
        let millis = millis?;
        if !(1..=MAX_GAP_ALERT_AFTER_MS).contains(&millis) {
            self.error(
                format!("{path}.gap_alert_after_ms"),
                format!("must be from 1 to {MAX_GAP_ALERT_AFTER_MS} (found {millis})"),
            );
            return None;
        }
        Some(Duration::from_millis(millis))
    }

    /// A type's schema file, read as JSON and compiled as the gate will.
    fn schema(&mut self, name: &str, schema: Option<PathBuf>, path: &str) -> Option<Value> {
        let key = format!("{path}.schema");
        let relative = self.required(schema, &key)?;
        let file = self.path(&relative);
        read_schema(name, &file)
            .map_err(|message| self.error(key, format!("{}: {message}", file.display())))
            .ok()
    }
}

fn read_schema(name: &str, file: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(file).map_err(|error| format!("cannot read: {error}"))?;
    let schema = serde_json::from_str::<Value>(&text).map_err(|error| {
        format!(
            "not JSON (line {}, column {}: {})",
            error.line(),
            error.column(),
            json_reason(&error)
        )
    })?;
    MessageTypes::compile(vec![(name.to_owned(), schema.clone())]).map_err(|(_, why)| why)?;
    Ok(schema)
}

/// `localhost` or a loopback IP literal (bracketed or not).
fn is_loopback_host(name: &str) -> bool {
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let literal = name.trim_start_matches('[').trim_end_matches(']');
    literal.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The URL's first TCP host (or host address) that is not loopback; Unix sockets are local.
fn first_remote_host(config: &tokio_postgres::Config) -> Option<String> {
    let named = config.get_hosts().iter().find_map(|host| match host {
        tokio_postgres::config::Host::Tcp(name) if !is_loopback_host(name) => Some(name.clone()),
        _ => None,
    });
    named.or_else(|| {
        config
            .get_hostaddrs()
            .iter()
            .find(|address| !address.is_loopback())
            .map(IpAddr::to_string)
    })
}

fn is_type_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// serde_json's message without its own position suffix.
fn json_reason(error: &serde_json::Error) -> String {
    let text = error.to_string();
    match text.rsplit_once(" at line ") {
        Some((reason, _)) => reason.to_owned(),
        None => text,
    }
}

/// serde's text for one key, in the file's words.
fn field_message(message: &str) -> String {
    let message = one_line(message);
    if let Some(rest) = message.strip_prefix("unknown field ") {
        let expected = rest.split_once(", expected ").map(|(_, expected)| expected);
        return match expected {
            Some(expected) => format!("unknown key; expected {expected}"),
            None => "unknown key".to_owned(),
        };
    }
    message
}

/// Each `(type name, gap_alert_after)` of the types that set one.
type GapAlerts = Vec<(String, Duration)>;

/// A retention's text: `Some(None)` for `forever`, `Some(Some(d))` for a whole number of days,
/// hours, minutes, seconds or milliseconds up to [`MAX_RETENTION`], `None` for anything else.
fn retention_duration(text: &str) -> Option<Option<Duration>> {
    if text == "forever" {
        return Some(None);
    }
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let millis_per = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    let kept = Duration::from_millis(number.checked_mul(millis_per)?);
    (kept <= MAX_RETENTION).then_some(Some(kept))
}

/// The longest `gap_alert_after_ms` a type may set: thirty days.
const MAX_GAP_ALERT_AFTER_MS: u64 = 30 * 24 * 60 * 60 * 1000;

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A bound already checked to be at least 1.
fn non_zero(value: u64) -> NonZeroU32 {
    u32::try_from(value)
        .ok()
        .and_then(NonZeroU32::new)
        .unwrap_or(NonZeroU32::MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER_PLACED: &str = r#"[types."order.placed"]
schema = "order-placed.json"
"#;

    /// A directory with one valid schema file, `order-placed.json`.
    fn directory() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("a temp dir");
        std::fs::write(
            dir.path().join("order-placed.json"),
            r#"{"type": "object", "required": ["orderId"]}"#,
        )
        .expect("write the schema");
        dir
    }

    /// A self-signed CA certificate (PEM) at `name` in `dir`.
    fn write_ca(dir: &tempfile::TempDir, name: &str) {
        let key = rcgen::KeyPair::generate().expect("a key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let certificate = params.self_signed(&key).expect("a CA certificate");
        std::fs::write(dir.path().join(name), certificate.pem()).expect("write the CA");
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse(dir: &tempfile::TempDir, text: &str) -> Result<GateConfig, ConfigErrors> {
        GateConfig::parse(text, dir.path(), &no_env)
    }

    /// The error lines of a file that must be refused.
    fn refused(dir: &tempfile::TempDir, text: &str) -> Vec<String> {
        match parse(dir, text) {
            Ok(config) => panic!("accepted: {config:?}"),
            Err(errors) => errors.iter().map(ToString::to_string).collect(),
        }
    }

    fn assert_line(lines: &[String], expected: &str) {
        assert!(
            lines.iter().any(|line| line.starts_with(expected)),
            "no line starts with {expected:?} in {lines:#?}"
        );
    }

    #[test]
    fn a_file_with_only_its_types_takes_every_default() {
        let dir = directory();
        let config = parse(&dir, ORDER_PLACED).expect("valid");
        assert_eq!(config.listen.address, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(config.listen.trusted_proxy, None);
        assert_eq!(config.tls, None);
        assert_eq!(config.store, GateStore::Sqlite(dir.path().join("gate.db")));
        assert_eq!(
            config.auth,
            Auth {
                anonymous_writes: false,
                readers: vec![]
            }
        );
        assert_eq!(config.connection_limits(), ConnectionLimits::default());
        assert_eq!(config.limits.max_payload_bytes, 65_536);
        assert_eq!(config.limits.producer_rate_per_second.get(), 500);
        assert_eq!(config.limits.producer_burst.get(), 1000);
        assert_eq!(config.inbox_limits().max_open_dead_letters, 1000);
        assert_eq!(config.inbox_limits().max_held_per_aggregate, 1000);
        assert!(config.metrics.public);
        assert_eq!(config.log.format, LogFormat::Json);
        assert_eq!(config.nats, None);
        assert_eq!(
            config.types,
            vec![(
                "order.placed".to_owned(),
                serde_json::json!({"type": "object", "required": ["orderId"]})
            )]
        );
    }

    #[test]
    fn every_key_is_read_into_its_type() {
        let dir = directory();
        let text = format!(
            r#"
[listen]
address = "0.0.0.0:8443"
trusted_proxy = "10.0.0.2"
[store]
sqlite = "data/inbox.db"
[auth]
anonymous_writes = true
readers = [{{ name = "audit", token = "t0ken" }}, {{ name = "ops", token_env = "OPS_TOKEN" }}]
[limits]
max_payload_bytes = 1024
max_connections = 10
header_read_timeout_ms = 500
keep_alive_timeout_ms = 700
body_read_timeout_ms = 900
request_body_budget_bytes = 4194304
producer_rate_per_second = 5
producer_burst = 7
max_open_dead_letters = 3
max_held = 4
[metrics]
public = false
[log]
format = "text"
[nats]
urls = ["nats://127.0.0.1:4222", "tls://nats.example:4443"]
[nats.input]
stream = "IN"
subject_prefix = "in.orders"
durable = "gate-a"
batch = 8
[nats.output]
stream = "OUT"
subject_prefix = "out.orders"
{ORDER_PLACED}"#
        );
        let env = |name: &str| (name == "OPS_TOKEN").then(|| "ops-secret".to_owned());
        let config = GateConfig::parse(&text, dir.path(), &env).expect("valid");
        assert_eq!(
            config.listen.trusted_proxy,
            Some("10.0.0.2".parse().unwrap())
        );
        assert_eq!(
            config.store,
            GateStore::Sqlite(dir.path().join("data/inbox.db"))
        );
        assert!(config.auth.anonymous_writes);
        let tokens: Vec<(&str, &str)> = config
            .auth
            .readers
            .iter()
            .map(|reader| (reader.name.as_str(), reader.token.expose()))
            .collect();
        assert_eq!(tokens, [("audit", "t0ken"), ("ops", "ops-secret")]);
        assert_eq!(
            config.connection_limits(),
            ConnectionLimits {
                header_read_timeout: Duration::from_millis(500),
                body_read_timeout: Duration::from_millis(900),
                keep_alive_timeout: Duration::from_millis(700),
                max_connections: 10,
                request_body_budget: 4 * 1024 * 1024,
            }
        );
        assert_eq!(config.limits.max_payload_bytes, 1024);
        assert_eq!(
            (
                config.limits.producer_rate_per_second.get(),
                config.limits.producer_burst.get()
            ),
            (5, 7)
        );
        assert_eq!(
            (config.limits.max_open_dead_letters, config.limits.max_held),
            (3, 4)
        );
        assert!(!config.metrics.public);
        assert_eq!(config.log.format, LogFormat::Text);
        let nats = config.nats.expect("nats");
        assert_eq!(nats.urls.len(), 2);
        assert_eq!(
            nats.input,
            NatsInput {
                stream: "IN".to_owned(),
                subject_prefix: "in.orders".to_owned(),
                durable: "gate-a".to_owned(),
                batch: 8
            }
        );
        assert_eq!(nats.output.subject_prefix, "out.orders");
    }

    #[test]
    fn a_syntax_error_names_its_line() {
        let dir = directory();
        let lines = refused(&dir, "[listen]\naddress = \"127.0.0.1:1\"\nport 8080\n");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_line(&lines, "line 3, column 6: not valid TOML: ");
    }

    #[test]
    fn unknown_keys_are_named_with_their_table_path() {
        let dir = directory();
        let text = format!(
            "[listen]\nadress = \"127.0.0.1:1\"\n[limits]\nmax_conections = 3\n[nats]\nurls = [\"nats://127.0.0.1:4222\"]\n[nats.input]\nstrem = \"X\"\n[extra]\n{ORDER_PLACED}[types.\"order.placed\".more]\n"
        );
        let lines = refused(&dir, &text);
        assert_line(
            &lines,
            "listen.adress: unknown key; expected `address` or `trusted_proxy`",
        );
        assert_line(&lines, "limits.max_conections: unknown key; expected ");
        assert_line(&lines, "nats.input.strem: unknown key; expected ");
        assert_line(&lines, "extra: unknown key; expected ");
        assert_line(
            &lines,
            "types.\"order.placed\".more: unknown key; expected `schema`",
        );
        let text = format!("listen = 5\n{ORDER_PLACED}");
        assert_eq!(refused(&dir, &text), ["listen: must be a table"]);
    }

    #[test]
    fn values_of_the_wrong_type_or_range_are_named() {
        let dir = directory();
        let text = format!(
            "[limits]\nmax_connections = \"many\"\nheader_read_timeout_ms = 0\nproducer_burst = -1\n[log]\nformat = \"xml\"\n[metrics]\npublic = \"yes\"\n{ORDER_PLACED}"
        );
        let lines = refused(&dir, &text);
        assert_line(
            &lines,
            "limits.max_connections: invalid type: string \"many\"",
        );
        assert_line(&lines, "limits.producer_burst: invalid value: integer `-1`");
        assert_line(
            &lines,
            "log.format: unknown variant `xml`, expected `json` or `text`",
        );
        assert_line(
            &lines,
            "metrics.public: invalid type: string \"yes\", expected a boolean",
        );
        // A section with a type error is not checked further until it reads.
        let text =
            format!("[limits]\nheader_read_timeout_ms = 0\nmax_held = 2000000\n{ORDER_PLACED}");
        let lines = refused(&dir, &text);
        assert_eq!(
            lines,
            [
                "limits.header_read_timeout_ms: must be from 1 to 3600000 (found 0)",
                "limits.max_held: must be from 1 to 1000000 (found 2000000)",
            ]
        );
    }

    #[test]
    fn a_bad_address_or_proxy_is_named() {
        let dir = directory();
        let text = format!(
            "[listen]\naddress = \"localhost:80\"\ntrusted_proxy = \"proxy\"\n{ORDER_PLACED}"
        );
        let lines = refused(&dir, &text);
        assert_eq!(
            lines,
            [
                "listen.address: 'localhost:80' is not an IP address with a port, such as 127.0.0.1:8080 or [::1]:8443",
                "listen.trusted_proxy: 'proxy' is not an IP address, such as 10.0.0.2",
            ]
        );
    }

    #[test]
    fn plain_http_beyond_loopback_needs_tls_or_a_trusted_proxy() {
        let dir = directory();
        let exposed = format!("[listen]\naddress = \"0.0.0.0:8443\"\n{ORDER_PLACED}");
        assert_eq!(
            refused(&dir, &exposed),
            [
                "tls: required when listen.address (0.0.0.0:8443) is not loopback; or set listen.trusted_proxy"
            ]
        );
        let proxied = format!(
            "[listen]\naddress = \"0.0.0.0:8443\"\ntrusted_proxy = \"10.0.0.2\"\n{ORDER_PLACED}"
        );
        assert!(parse(&dir, &proxied).is_ok());
        let loopback = format!("[listen]\naddress = \"[::1]:8443\"\n{ORDER_PLACED}");
        assert!(parse(&dir, &loopback).is_ok());
    }

    #[test]
    fn tls_files_are_read_as_pem_and_each_bad_one_is_named() {
        let dir = directory();
        let key = rcgen::KeyPair::generate().expect("a key");
        let certificate = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("a certificate");
        std::fs::write(dir.path().join("cert.pem"), certificate.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("junk.pem"), "not pem at all").unwrap();
        let tls = |certificate: &str, key: &str| {
            format!(
                "[listen]\naddress = \"0.0.0.0:8443\"\n[tls]\ncertificate = \"{certificate}\"\nkey = \"{key}\"\n{ORDER_PLACED}"
            )
        };
        let config = parse(&dir, &tls("cert.pem", "key.pem")).expect("a good pair");
        assert_eq!(
            config.tls,
            Some(TlsFiles {
                certificate: dir.path().join("cert.pem"),
                key: dir.path().join("key.pem"),
            })
        );
        let lines = refused(&dir, &tls("junk.pem", "missing.pem"));
        let junk = dir.path().join("junk.pem");
        let missing = dir.path().join("missing.pem");
        assert_eq!(
            lines,
            [
                format!(
                    "tls.certificate: {}: not a PEM file with a CERTIFICATE block",
                    junk.display()
                ),
                format!(
                    "tls.key: {}: cannot read: No such file or directory (os error 2)",
                    missing.display()
                ),
            ]
        );
        // A key that is not the certificate's.
        let other = rcgen::KeyPair::generate().expect("a key");
        std::fs::write(dir.path().join("other.pem"), other.serialize_pem()).unwrap();
        assert_line(&refused(&dir, &tls("cert.pem", "other.pem")), "tls: ");
        let incomplete = format!("[tls]\ncertificate = \"cert.pem\"\n{ORDER_PLACED}");
        assert_eq!(refused(&dir, &incomplete), ["tls.key: required"]);
    }

    #[test]
    fn a_missing_or_non_json_schema_is_named_under_its_type() {
        let dir = directory();
        std::fs::write(dir.path().join("broken.json"), "{\"type\": ").unwrap();
        std::fs::write(dir.path().join("odd.json"), r#"{"type": 5}"#).unwrap();
        let text = "[types.\"order.placed\"]\nschema = \"order-placed.json\"\n[types.\"order.shipped\"]\nschema = \"missing.json\"\n[types.\"order.cancelled\"]\nschema = \"broken.json\"\n[types.\"bad name\"]\nschema = \"order-placed.json\"\n[types.\"order.noted\"]\n[types.\"order.odd\"]\nschema = \"odd.json\"\n";
        let lines = refused(&dir, text);
        assert_line(
            &lines,
            &format!(
                "types.\"order.shipped\".schema: {}: cannot read: ",
                dir.path().join("missing.json").display()
            ),
        );
        assert_line(
            &lines,
            &format!(
                "types.\"order.cancelled\".schema: {}: not JSON (line 1, column 9: EOF while parsing a value)",
                dir.path().join("broken.json").display()
            ),
        );
        assert_line(
            &lines,
            "types.\"bad name\": a type name is 1 to 64 characters",
        );
        assert_line(&lines, "types.\"order.noted\".schema: required");
        assert_line(
            &lines,
            &format!(
                "types.\"order.odd\".schema: {}: the schema does not compile: ",
                dir.path().join("odd.json").display()
            ),
        );
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert_eq!(
            refused(&dir, "[listen]\naddress = \"127.0.0.1:1\"\n"),
            [
                "types: at least one message type is required, e.g. [types.\"order.placed\"] schema = \"schemas/order-placed.json\""
            ]
        );
    }

    #[test]
    fn an_environment_variable_named_but_unset_is_named() {
        let dir = directory();
        let text = format!(
            "[store]\npostgres_url_env = \"GATE_DATABASE_URL\"\nsslmode = \"verify-full\"\nsslrootcert = \"ca.pem\"\n[auth]\nreaders = [{{ name = \"audit\", token_env = \"GATE_READER_TOKEN\" }}]\n{ORDER_PLACED}"
        );
        // The URL names a host beyond loopback: it is taken with verify-full and a CA.
        write_ca(&dir, "ca.pem");
        assert_eq!(
            refused(&dir, &text),
            [
                "store.postgres_url_env: GATE_DATABASE_URL is not set",
                "auth.readers[0].token_env: GATE_READER_TOKEN is not set",
            ]
        );
        let env = |name: &str| match name {
            "GATE_DATABASE_URL" => Some("postgres://gate:pw@db.internal:5432/gate".to_owned()),
            "GATE_READER_TOKEN" => Some("reader-secret".to_owned()),
            _ => None,
        };
        let config = GateConfig::parse(&text, dir.path(), &env).expect("valid");
        let GateStore::Postgres { url, env, .. } = &config.store else {
            panic!("{:?}", config.store);
        };
        assert_eq!(
            (url.expose(), env.as_str()),
            (
                "postgres://gate:pw@db.internal:5432/gate",
                "GATE_DATABASE_URL"
            )
        );
        let shown = format!("{config:?}");
        assert!(
            !shown.contains("pw@") && !shown.contains("reader-secret"),
            "{shown}"
        );
        let not_a_url = |_: &str| Some("postgres://[broken".to_owned());
        let errors = GateConfig::parse(&text, dir.path(), &not_a_url).unwrap_err();
        assert_eq!(
            errors.to_string(),
            "store.postgres_url_env: GATE_DATABASE_URL does not hold a PostgreSQL connection URL (postgres://USER@HOST:PORT/DB)"
        );
    }

    #[test]
    fn postgres_beyond_loopback_needs_verify_full_or_an_explicit_allow_insecure() {
        let dir = directory();
        let env = |name: &str| match name {
            "URL" => Some("postgres://gate@db.internal:5432/gate".to_owned()),
            "PW" => Some("pw".to_owned()),
            _ => None,
        };
        let store =
            |keys: &str| format!("[store]\npostgres_url_env = \"URL\"\n{keys}\n{ORDER_PLACED}");
        let refused = |text: String| -> Vec<String> {
            match GateConfig::parse(&text, dir.path(), &env) {
                Ok(config) => panic!("accepted: {config:?}"),
                Err(errors) => errors.iter().map(ToString::to_string).collect(),
            }
        };
        assert_eq!(
            refused(store("")),
            [
                "store.sslmode: 'disable' to db.internal, beyond loopback: only verify-full is accepted there, unless store.allow_insecure = true"
            ]
        );
        assert_line(
            &refused(store("sslmode = \"require\"")),
            "store.sslmode: 'require' to db.internal",
        );
        assert_line(
            &refused(store("sslmode = \"verify-full\"")),
            "store.sslrootcert: required by sslmode verify-full",
        );
        assert_line(
            &refused(store("sslmode = \"prefer\"")),
            "store.sslmode: 'prefer' is not one of",
        );
        assert_line(
            &refused(store("sslmode = \"require\"\nsslrootcert = \"ca.pem\"")),
            "store.sslrootcert: only with sslmode verify-ca or verify-full",
        );
        assert_line(
            &refused(store("sslrootcert_file = \"ca.pem\"")),
            "store.sslrootcert_file: unknown key",
        );
        assert_line(
            &refused(store("password_env = \"PW\"\npassword_file = \"pw\"")),
            "store: give at most one of password_env and password_file",
        );
        write_ca(&dir, "ca.pem");
        let text =
            store("sslmode = \"verify-full\"\nsslrootcert = \"ca.pem\"\npassword_env = \"PW\"");
        let config = GateConfig::parse(&text, dir.path(), &env).expect("valid");
        let GateStore::Postgres { access, .. } = &config.store else {
            panic!("{:?}", config.store);
        };
        assert_eq!(access.remote.sslmode, SslMode::VerifyFull);
        assert_eq!(access.remote.password.as_deref(), Some("pw"));
        assert_eq!(access.password_key, Some("store.password_env"));
        assert!(config.insecure_settings().is_empty());
        assert!(!format!("{config:?}").contains("\"pw\""));
        let insecure = store("sslmode = \"require\"\nallow_insecure = true");
        let config = GateConfig::parse(&insecure, dir.path(), &env).expect("valid");
        assert_eq!(
            config.insecure_settings(),
            [
                "store.allow_insecure = true: PostgreSQL is reached with sslmode require at db.internal, beyond loopback"
            ]
        );
    }

    #[test]
    fn nats_beyond_loopback_needs_tls_and_each_credential_is_read_at_start() {
        let dir = directory();
        let nats = |extra: &str| {
            format!(
                "[nats]\nurls = [\"nats://127.0.0.1:4222\", \"nats://nats.internal:4222\"]\n{extra}\n{ORDER_PLACED}"
            )
        };
        assert_eq!(
            refused(&dir, &nats("")),
            [
                "nats.urls[1]: plain nats:// to nats.internal, beyond loopback: add [nats.tls] or set nats.allow_insecure = true"
            ]
        );
        let config = parse(&dir, &nats("allow_insecure = true")).expect("valid");
        assert_line(
            &config.insecure_settings(),
            "nats.allow_insecure = true: NATS is reached without TLS",
        );
        assert_eq!(
            refused(
                &dir,
                &nats("[nats.tls]\nca = \"ca.pem\"\n[nats.auth]\ncreds_file = \"gate.creds\"")
            ),
            [
                format!(
                    "nats.tls.ca: {}",
                    tls::load_certificate_chain(&dir.path().join("ca.pem")).unwrap_err()
                ),
                format!(
                    "nats.auth.creds_file: cannot read {}: No such file or directory (os error 2)",
                    dir.path().join("gate.creds").display()
                ),
            ]
        );
        write_ca(&dir, "ca.pem");
        assert_eq!(
            refused(
                &dir,
                &nats(
                    "[nats.tls]\nca = \"ca.pem\"\ncert = \"c.pem\"\n[nats.auth]\nuser = \"gate\"\ntoken_env = \"T\""
                )
            ),
            [
                "nats.tls.key: required with nats.tls.cert",
                "nats.auth: give exactly one of creds_file, nkey_seed_file, user with password_env, token_env",
            ]
        );
        assert_eq!(
            refused(
                &dir,
                &nats("[nats.auth]\nuser = \"gate\"\n[nats.tls]\nca = \"ca.pem\"\ncafile = \"x\"")
            ),
            [
                "nats.tls.cafile: unknown key; expected one of `ca`, `cert`, `key`",
                "nats.auth.password_env: required"
            ]
        );
        let env = |name: &str| (name == "NATS_PW").then(|| "secret".to_owned());
        let text = nats(
            "[nats.tls]\nca = \"ca.pem\"\n[nats.auth]\nuser = \"gate\"\npassword_env = \"NATS_PW\"",
        );
        let config = GateConfig::parse(&text, dir.path(), &env).expect("valid");
        let access = &config.nats.as_ref().expect("nats").access;
        assert_eq!(
            access.tls.as_ref().map(|tls| tls.ca.clone()),
            Some(dir.path().join("ca.pem"))
        );
        assert_eq!(
            access.auth,
            Some(NatsAuth::UserPassword {
                user: "gate".to_owned(),
                password: "secret".to_owned()
            })
        );
        assert!(!format!("{config:?}").contains("secret"));
    }

    #[test]
    fn a_store_needs_exactly_one_backend_and_a_reader_exactly_one_token() {
        let dir = directory();
        let both = format!(
            "[store]\nsqlite = \"a.db\"\npostgres_url_env = \"URL\"\n[auth]\nreaders = [{{ name = \"a\" }}, {{ name = \"b\", token = \"x\", token_env = \"Y\" }}, {{ token = \"z\" }}, {{ name = \"d\", token = \"w\" }}, {{ name = \"d\", token = \"v\" }}]\n{ORDER_PLACED}"
        );
        assert_eq!(
            refused(&dir, &both),
            [
                "store: give exactly one of sqlite = \"FILE\" and postgres_url_env = \"VARIABLE\"",
                "auth.readers[0]: give exactly one of token and token_env",
                "auth.readers[1]: give exactly one of token and token_env",
                "auth.readers[2].name: required",
                "auth.readers[4].name: 'd' names another reader too",
            ]
        );
        let none = format!("[store]\n{ORDER_PLACED}");
        assert_line(&refused(&dir, &none), "store: give exactly one of");
    }

    #[test]
    fn retention_defaults_to_a_week_of_identities_and_output_and_names_each_wrong_key() {
        let dir = directory();
        let defaults = parse(&dir, ORDER_PLACED).expect("accepted").retention;
        assert_eq!(
            defaults.inbox.identities,
            Some(Duration::from_secs(7 * 86_400))
        );
        assert_eq!(defaults.output, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(
            (defaults.inbox.timeline, defaults.inbox.dead_letters),
            (None, None)
        );
        let set = parse(
            &dir,
            &format!(
                "[retention]\nidentities = \"36h\"\ntimeline = 50\noutput = \"forever\"\n\
                 dead_letters = \"30d\"\ninterval_ms = 250\nbatch = 100\n{ORDER_PLACED}"
            ),
        )
        .expect("accepted")
        .retention;
        assert_eq!(set.inbox.identities, Some(Duration::from_secs(36 * 3600)));
        assert_eq!(set.inbox.timeline, Some(50));
        assert_eq!(set.output, None);
        assert_eq!(
            set.inbox.dead_letters,
            Some(Duration::from_secs(30 * 86_400))
        );
        assert_eq!((set.interval, set.batch), (Duration::from_millis(250), 100));
        let wrong = refused(
            &dir,
            &format!(
                "[retention]\nidentities = \"7 days\"\ntimeline = 0\noutput = \"99999d\"\n\
                 batch = 0\n{ORDER_PLACED}"
            ),
        );
        for key in ["identities", "timeline", "output", "batch"] {
            assert_line(&wrong, &format!("retention.{key}: must be"));
        }
        let unknown = refused(
            &dir,
            &format!("[retention]\nidentity = \"1d\"\n{ORDER_PLACED}"),
        );
        assert_line(&unknown, "retention.identity: unknown key");
    }

    #[test]
    fn the_publishers_lease_defaults_to_five_seconds_and_is_bounded() {
        let dir = directory();
        let defaults = parse(&dir, ORDER_PLACED).expect("accepted");
        assert_eq!(defaults.publisher.lease, Duration::from_secs(5));
        let short = parse(
            &dir,
            &format!("[publisher]\nlease_ms = 1000\n{ORDER_PLACED}"),
        )
        .expect("accepted");
        assert_eq!(short.publisher.lease, Duration::from_secs(1));
        assert_eq!(
            refused(&dir, &format!("[publisher]\nlease_ms = 10\n{ORDER_PLACED}")),
            ["publisher.lease_ms: must be from 300 to 600000 (found 10)"]
        );
        let unknown = refused(&dir, &format!("[publisher]\nlease = 1\n{ORDER_PLACED}"));
        assert_line(
            &unknown,
            "publisher.lease: unknown key; expected `lease_ms`",
        );
    }

    #[test]
    fn a_types_gap_alert_after_ms_is_read_and_bounded() {
        let dir = directory();
        let none = parse(&dir, ORDER_PLACED).expect("accepted");
        assert!(none.gap_alerts.is_empty());
        let text = ORDER_PLACED.replace("schema = ", "gap_alert_after_ms = 1500\nschema = ");
        let set = parse(&dir, &text).expect("accepted");
        assert_eq!(
            set.gap_alerts,
            [("order.placed".to_owned(), Duration::from_millis(1500))]
        );
        let zero = ORDER_PLACED.replace("schema = ", "gap_alert_after_ms = 0\nschema = ");
        assert_eq!(
            refused(&dir, &zero),
            ["types.\"order.placed\".gap_alert_after_ms: must be from 1 to 2592000000 (found 0)"]
        );
    }

    #[test]
    fn nats_urls_and_names_are_checked() {
        let dir = directory();
        let text = format!(
            "[nats]\nurls = [\"nats://127.0.0.1:4222\", \"http://user:secret@127.0.0.1:80\", \"nats://[::1\"]\n[nats.input]\nstream = \"IN.PUT\"\nbatch = 0\n[nats.output]\nsubject_prefix = \"gate.in.out\"\n{ORDER_PLACED}"
        );
        let lines = refused(&dir, &text);
        assert_line(
            &lines,
            "nats.urls[1]: not a NATS server URL such as nats://HOST:PORT (invalid scheme for NATS server URL: http)",
        );
        assert_line(
            &lines,
            "nats.urls[2]: not a NATS server URL such as nats://HOST:PORT (",
        );
        assert_line(
            &lines,
            "nats.input.stream: 'IN.PUT' must be 1 to 64 characters",
        );
        assert_line(
            &lines,
            "nats.input.batch: must be from 1 to 10000 (found 0)",
        );
        assert!(
            !lines.iter().any(|line| line.contains("secret")),
            "{lines:?}"
        );
        let looping = format!(
            "[nats]\nurls = [\"nats://127.0.0.1:4222\"]\n[nats.output]\nsubject_prefix = \"gate.in.out\"\nstream = \"GATE_IN\"\n{ORDER_PLACED}"
        );
        assert_eq!(
            refused(&dir, &looping),
            [
                "nats.output.stream: 'GATE_IN' is nats.input.stream too",
                "nats.output.subject_prefix: 'gate.in.out' overlaps nats.input.subject_prefix 'gate.in'",
            ]
        );
        assert_eq!(
            refused(&dir, &format!("[nats]\n{ORDER_PLACED}")),
            ["nats.urls: at least one server URL (nats://HOST:PORT) is required"]
        );
    }

    #[test]
    fn mistakes_in_several_tables_are_reported_together() {
        let dir = directory();
        let text = "[listen]\naddress = \"nowhere\"\nport = 1\n[auth]\nreaders = [{ name = \"a\", token_env = \"UNSET\" }]\n[limits]\nmax_connections = 0\n[types.\"order.placed\"]\nschema = \"missing.json\"\n";
        let errors = parse(&dir, text).unwrap_err();
        let keys: Vec<&str> = errors.iter().map(|error| error.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "listen.port",
                "listen.address",
                "auth.readers[0].token_env",
                "limits.max_connections",
                "types.\"order.placed\".schema",
            ]
        );
        assert_eq!(errors.to_string().lines().count(), 5);
    }

    #[test]
    fn load_resolves_paths_against_the_file_s_directory() {
        let dir = directory();
        let file = dir.path().join("gate.toml");
        std::fs::write(&file, ORDER_PLACED).unwrap();
        let config = GateConfig::load(&file).expect("valid");
        assert_eq!(config.store, GateStore::Sqlite(dir.path().join("gate.db")));
        let missing = dir.path().join("absent.toml");
        let errors = GateConfig::load(&missing).unwrap_err();
        assert!(
            errors
                .to_string()
                .starts_with(&format!("{}: cannot read: ", missing.display())),
            "{errors}"
        );
    }
}
