//! Start-up configuration: where to listen, which database file, which settings file, and the
//! guards that keep this fault-injecting fixture on a developer's own loopback interface; every
//! component's settings (the broker door's in [`broker`]) and the start-up refusals
//! ([`StartupError`]). The lowest floor of the server: it imports none of the others.

pub mod broker;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};
use url::{Host, Url};

/// Everything `serve` needs; tests build one directly with [`Config::for_tests`].
#[derive(Debug, Clone)]
pub struct Config {
    /// The single `http://host:port` root to listen on.
    pub urls: String,
    pub database: PathBuf,
    pub settings: PathBuf,
    /// The environment name as given; only `Development` may start.
    pub environment: String,
    /// The one proxy whose `X-Forwarded-*` headers are believed.
    pub known_proxy: IpAddr,
    /// `*` or `;`-separated host names (ports ignored).
    pub allowed_hosts: String,
    pub synchronous: Synchronous,
    /// Open dead letters one aggregate may hold before a new poison message is refused (429).
    pub max_open_dead_letters: usize,
    /// Messages one aggregate may hold ahead of its turn (broker deliveries) before a further one
    /// is nak'd back to the broker with a delay.
    pub max_held_per_aggregate: usize,
    /// The NATS JetStream consumer, when `--nats` is given.
    pub nats: Option<broker::BrokerConfig>,
    /// How long an outbox claim holds its event; the seed's 500 ms unless a test shortens it.
    pub outbox_lease: Duration,
    /// Connection timeouts and the connection cap.
    pub limits: ConnectionLimits,
    /// `postgres://USER@127.0.0.1:PORT/DB`: keep the ordered inbox in this PostgreSQL database
    /// (shared by any number of servers) instead of the SQLite file. Every other lab stays on
    /// the SQLite file.
    pub inbox: Option<String>,
}

/// How long a client may take and how many connections it may hold open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// From accept (or the first byte after an idle pause) until the request head is complete.
    pub header_read_timeout: Duration,
    /// From the request head until the whole body has arrived.
    pub body_read_timeout: Duration,
    /// How long a connection may wait between a response and the next request.
    pub keep_alive_timeout: Duration,
    /// Open connections at most; keep it below the process's open-file limit (`ulimit -n`).
    pub max_connections: usize,
    /// Bytes of request bodies all connections together may be receiving at once; past it a new
    /// body waits briefly for room, then answers 503.
    pub request_body_budget: usize,
}

pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// The largest request body any route reads; a larger one answers 413.
pub const MAX_REQUEST_BODY_BYTES: usize = 2 * MIB;
/// 64 MiB: 32 bodies of the largest size at once.
pub const DEFAULT_REQUEST_BODY_BUDGET: usize = 64 * MIB;
/// The largest body budget `serve` accepts.
const MAX_REQUEST_BODY_BUDGET: usize = 64 * 1024 * MIB;
const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// The longest timeout `serve` accepts.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            keep_alive_timeout: DEFAULT_KEEP_ALIVE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            request_body_budget: DEFAULT_REQUEST_BODY_BUDGET,
        }
    }
}

/// A timeout flag: `500ms`, `10s`, or a bare number of seconds; from 1 ms to one hour.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1000)
    } else {
        (text, 1000)
    };
    let duration = number
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|value| value.checked_mul(unit))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("'{text}' is not a duration such as 500ms, 10s or 10"))?;
    if duration.is_zero() || duration > MAX_TIMEOUT {
        return Err(format!("'{text}' must be from 1ms to 3600s"));
    }
    Ok(duration)
}

/// The connection cap flag: 1 to 65536.
pub fn parse_max_connections(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(value) if (1..=65_536).contains(&value) => Ok(value),
        _ => Err(format!("'{text}' must be a whole number from 1 to 65536")),
    }
}

/// The request-body budget flag: bytes, or a number with `KiB`, `MiB` or `GiB`; from the largest
/// request body (so that one always fits) to 64 GiB.
pub fn parse_request_body_budget(text: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let (number, unit) = [("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)]
        .into_iter()
        .find_map(|(suffix, unit)| trimmed.strip_suffix(suffix).map(|number| (number, unit)))
        .unwrap_or((trimmed, 1));
    let lowest = MAX_REQUEST_BODY_BYTES;
    match number
        .trim()
        .parse::<usize>()
        .ok()
        .and_then(|value| value.checked_mul(unit))
    {
        Some(bytes) if (lowest..=MAX_REQUEST_BODY_BUDGET).contains(&bytes) => Ok(bytes),
        _ => Err(format!(
            "'{text}' must be a size such as 64MiB, 512KiB or 67108864 (bytes), from 2MiB to 64GiB"
        )),
    }
}

/// SQLite's `synchronous` pragma for the write connection. FULL is the durable default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Synchronous {
    Normal,
    Full,
}

impl Synchronous {
    pub fn pragma_value(self) -> &'static str {
        ordered_inbox::sqlite::Synchronous::from(self).pragma_value()
    }
}

impl From<Synchronous> for ordered_inbox::sqlite::Synchronous {
    fn from(synchronous: Synchronous) -> Self {
        match synchronous {
            Synchronous::Normal => ordered_inbox::sqlite::Synchronous::Normal,
            Synchronous::Full => ordered_inbox::sqlite::Synchronous::Full,
        }
    }
}

pub const DEFAULT_URLS: &str = "http://127.0.0.1:5080";
pub const DEFAULT_KNOWN_PROXY: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10));
pub const DEFAULT_OUTBOX_LEASE: Duration = Duration::from_millis(500);

impl Config {
    /// A Development configuration on an ephemeral loopback port, for tests and benchmarks.
    pub fn for_tests(database: PathBuf, settings: PathBuf) -> Self {
        Config {
            urls: "http://127.0.0.1:0".to_owned(),
            database,
            settings,
            environment: "Development".to_owned(),
            known_proxy: DEFAULT_KNOWN_PROXY,
            allowed_hosts: "*".to_owned(),
            synchronous: Synchronous::Full,
            max_open_dead_letters: DEFAULT_MAX_OPEN_DEAD_LETTERS as usize,
            max_held_per_aggregate: DEFAULT_MAX_HELD_PER_AGGREGATE as usize,
            nats: None,
            outbox_lease: DEFAULT_OUTBOX_LEASE,
            limits: ConnectionLimits::default(),
            inbox: None,
        }
    }

    /// The bounds the ordered inbox keeps.
    pub fn inbox_limits(&self) -> ordered_inbox::Limits {
        ordered_inbox::Limits {
            max_open_dead_letters: self.max_open_dead_letters,
            max_held_per_aggregate: self.max_held_per_aggregate,
        }
    }
}

/// The default of `--max-open-dead-letters`.
pub const DEFAULT_MAX_OPEN_DEAD_LETTERS: u32 = 1000;
/// The default of `--max-held-per-aggregate`.
pub const DEFAULT_MAX_HELD_PER_AGGREGATE: u32 = 1000;

/// A fresh database path in the temp directory, as the seed picks when none is given.
pub fn default_database_path() -> PathBuf {
    let nonce: u64 = rand::random();
    std::env::temp_dir().join(format!("production-lab-{nonce:016x}.db"))
}

/// Why `serve` refused to start. Each is one readable line.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(
        "refusing to start in environment '{0}': this fixture exposes fault controls and runs only in Development (pass --environment Development or set LAB_ENVIRONMENT=Development)"
    )]
    NotDevelopment(String),
    #[error(
        "refusing to listen on {0}: this fixture binds only loopback addresses (127.0.0.1, ::1, localhost)"
    )]
    NotLoopback(String),
    #[error("invalid --urls '{url}': {reason}")]
    BadUrl { url: String, reason: String },
    #[error("settings file {path}: {reason}")]
    Settings { path: String, reason: String },
    #[error("database {path}: {reason}")]
    Database { path: String, reason: String },
    #[error("cannot listen on {address}: {reason}")]
    Bind { address: String, reason: String },
    #[error(
        "refusing to connect to NATS at {0}: this fixture talks only to loopback addresses (nats://127.0.0.1:PORT, nats://localhost:PORT, nats://[::1]:PORT)"
    )]
    NatsNotLoopback(String),
    #[error("broker consumer: {0}")]
    Broker(String),
    #[error("invalid --allowed-hosts '{value}': {reason}")]
    AllowedHosts { value: String, reason: String },
    /// `--inbox` names no loopback PostgreSQL, or the database could not be reached or migrated.
    #[error("--inbox: {0}")]
    Inbox(String),
    /// The gate could not start: the line names the configuration key or the part that failed.
    #[error("{0}")]
    Gate(String),
}

impl From<ordered_inbox::postgres::PostgresError> for StartupError {
    fn from(error: ordered_inbox::postgres::PostgresError) -> Self {
        // Kept as text: the one line says it all, with no cause chain to repeat it.
        StartupError::Inbox(error.to_string())
    }
}

pub fn require_development(environment: &str) -> Result<(), StartupError> {
    if environment == "Development" {
        Ok(())
    } else {
        Err(StartupError::NotDevelopment(environment.to_owned()))
    }
}

/// Parses `http://HOST:PORT[/]` with the `url` crate and insists the host is loopback.
/// `localhost` means 127.0.0.1.
pub fn parse_listen_url(text: &str) -> Result<SocketAddr, StartupError> {
    let bad = |reason: &str| StartupError::BadUrl {
        url: text.to_owned(),
        reason: reason.to_owned(),
    };
    if text.contains(';') {
        return Err(bad("give exactly one URL"));
    }
    // On the text itself: the URL standard would also read `HTTP://…` and `http:127.0.0.1:1`.
    if !text.starts_with("http://") {
        return Err(bad(
            "only http:// URLs are served (this is a plain-HTTP loopback fixture)",
        ));
    }
    let url = Url::parse(text).map_err(|error| match error {
        url::ParseError::InvalidPort => bad("the port must be a number from 0 to 65535"),
        url::ParseError::InvalidIpv6Address => bad("not a valid IPv6 address in '[…]'"),
        other => bad(&format!("not a valid URL ({other})")),
    })?;
    if !url.username().is_empty()
        || url.password().is_some()
        || url.path() != "/"
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(bad(
            "expected http://HOST:PORT with no path, user info or query",
        ));
    }
    // `url` leaves out a scheme's default port, so a written `:80` and no port at all look
    // alike there; only the text tells them apart.
    let port = match url.port() {
        Some(port) => port,
        None if ends_with_a_port(text) => url
            .port_or_known_default()
            .ok_or_else(|| bad("missing :PORT"))?,
        None => return Err(bad("missing :PORT")),
    };
    let ip = match url.host() {
        Some(Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(Host::Ipv6(ip)) => IpAddr::V6(ip),
        // Host names arrive lower-cased.
        Some(Host::Domain("localhost")) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        // `*`, `+`, other host names: nothing that is a literal loopback address.
        Some(Host::Domain(_)) | None => return Err(StartupError::NotLoopback(text.to_owned())),
    };
    if !ip.is_loopback() {
        return Err(StartupError::NotLoopback(text.to_owned()));
    }
    Ok(SocketAddr::new(ip, port))
}

/// Whether `http://HOST:PORT[/]` ends with a written port (digits after the last `:`; an IPv6
/// host's colons are followed by `]`).
fn ends_with_a_port(text: &str) -> bool {
    text.trim_end_matches('/')
        .rsplit_once(':')
        .is_some_and(|(_, port)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

/// The `Live` section of the runtime settings file. A missing section or member keeps the
/// seed's class defaults (label `initial`, maximum 3, no secret), as ASP.NET's binder does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSettings {
    pub label: String,
    pub maximum: i64,
    pub secret: String,
}

impl Default for LiveSettings {
    fn default() -> Self {
        LiveSettings {
            label: "initial".to_owned(),
            maximum: 3,
            secret: String::new(),
        }
    }
}

/// Reads and validates the settings file. The error names the file and the bad field, and never
/// echoes the secret.
pub fn load_settings(path: &Path) -> Result<LiveSettings, StartupError> {
    let fail = |reason: String| StartupError::Settings {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    parse_settings(&text).map_err(fail)
}

/// Validates settings text; the `Err` is a short reason naming the offending field, never a
/// value (it could be the secret). Section and member names match in any letter case, as
/// configuration keys do in ASP.NET; other sections and members are ignored.
pub fn parse_settings(text: &str) -> Result<LiveSettings, String> {
    let file: Value = serde_json::from_str(text).map_err(|e| {
        // serde_json's message can quote input; keep only its position.
        format!(
            "not valid settings JSON (line {}, column {}): expected {{\"Live\":{{\"Label\":text,\"Maximum\":1..10,\"Secret\":text}}}}",
            e.line(),
            e.column()
        )
    })?;
    let Value::Object(file) = file else {
        return Err("the settings file must be a JSON object".to_owned());
    };
    let live = match member(&file, "Live")? {
        None | Some(Value::Null) => LiveSettings::default(),
        Some(Value::Object(section)) => bind_live(section)?,
        Some(_) => return Err("the \"Live\" section must be an object".to_owned()),
    };
    if live.label.trim().is_empty() {
        return Err("Live:Label must not be blank".to_owned());
    }
    if !(1..=10).contains(&live.maximum) {
        return Err(format!(
            "Live:Maximum must be from 1 to 10 (found {})",
            live.maximum
        ));
    }
    Ok(live)
}

/// The member called `name` in any letter case; two spellings of one name are refused.
fn member<'a>(object: &'a Map<String, Value>, name: &str) -> Result<Option<&'a Value>, String> {
    let mut found = object
        .iter()
        .filter(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value);
    let first = found.next();
    if found.next().is_some() {
        return Err(format!("\"{name}\" is given more than once"));
    }
    Ok(first)
}

fn bind_live(section: &Map<String, Value>) -> Result<LiveSettings, String> {
    let defaults = LiveSettings::default();
    let text = |name: &str, default: String| match member(section, name)? {
        None => Ok(default),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(_) => Err(format!("Live:{name} must be text")),
    };
    let maximum = match member(section, "Maximum")? {
        None => defaults.maximum,
        Some(value) => value
            .as_i64()
            .ok_or_else(|| "Live:Maximum must be a whole number".to_owned())?,
    };
    Ok(LiveSettings {
        label: text("Label", defaults.label)?,
        maximum,
        secret: text("Secret", defaults.secret)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_take_a_unit_or_seconds() {
        assert_eq!(parse_timeout("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_timeout("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_timeout("7"), Ok(Duration::from_secs(7)));
        for bad in ["0", "0ms", "-1", "1.5s", "ten", "", "3601s"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_max_connections("2"), Ok(2));
        assert!(parse_max_connections("0").is_err());
        assert!(parse_max_connections("many").is_err());
        assert_eq!(parse_request_body_budget("64MiB"), Ok(64 * 1024 * 1024));
        assert_eq!(parse_request_body_budget(" 4096KiB "), Ok(4 * 1024 * 1024));
        assert_eq!(parse_request_body_budget("1GiB"), Ok(1024 * 1024 * 1024));
        assert_eq!(parse_request_body_budget("2097152"), Ok(2 * 1024 * 1024));
        for refused in ["1MiB", "2097151", "65GiB", "lots", "-1MiB", "64MB", ""] {
            assert!(parse_request_body_budget(refused).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn loopback_urls_are_accepted() {
        assert_eq!(
            parse_listen_url("http://127.0.0.1:0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            parse_listen_url("http://localhost:5080/").unwrap(),
            "127.0.0.1:5080".parse().unwrap()
        );
        assert_eq!(
            parse_listen_url("http://[::1]:81").unwrap(),
            "[::1]:81".parse().unwrap()
        );
    }

    #[test]
    fn non_loopback_urls_are_refused() {
        for url in [
            "http://0.0.0.0:5080",
            "http://192.168.1.4:80",
            "http://[::]:80",
            "http://*:80",
            "http://example.com:80",
        ] {
            assert!(
                matches!(parse_listen_url(url), Err(StartupError::NotLoopback(_))),
                "{url}"
            );
        }
        assert!(matches!(
            parse_listen_url("https://127.0.0.1:1"),
            Err(StartupError::BadUrl { .. })
        ));
        assert!(matches!(
            parse_listen_url("http://127.0.0.1"),
            Err(StartupError::BadUrl { .. })
        ));
    }

    #[test]
    fn a_written_default_port_is_kept_apart_from_a_missing_one() {
        assert_eq!(
            parse_listen_url("http://127.0.0.1:80").unwrap(),
            "127.0.0.1:80".parse().unwrap()
        );
        assert_eq!(
            parse_listen_url("http://[::1]:80/").unwrap(),
            "[::1]:80".parse().unwrap()
        );
        for url in ["http://127.0.0.1/", "http://[::1]", "http://localhost"] {
            assert!(
                matches!(
                    parse_listen_url(url),
                    Err(StartupError::BadUrl { ref reason, .. }) if reason == "missing :PORT"
                ),
                "{url}"
            );
        }
    }

    #[test]
    fn anything_but_a_bare_loopback_root_is_a_bad_url() {
        for url in [
            "HTTP://127.0.0.1:1",
            "http:127.0.0.1:1",
            "http://127.0.0.1:1;http://[::1]:1",
            "http://user@127.0.0.1:1",
            "http://127.0.0.1:1/path",
            "http://127.0.0.1:1?query",
            "http://127.0.0.1:1#fragment",
            "http://127.0.0.1:65536",
            "http://127.0.0.1:port",
            "http://[::1:80",
        ] {
            assert!(
                matches!(parse_listen_url(url), Err(StartupError::BadUrl { .. })),
                "{url}"
            );
        }
    }

    #[test]
    fn settings_validation_names_the_field() {
        let ok = parse_settings(r#"{"Live":{"Label":"x","Maximum":3,"Secret":"s"}}"#).unwrap();
        assert_eq!(ok.maximum, 3);
        let blank = parse_settings(r#"{"Live":{"Label":" ","Maximum":3}}"#).unwrap_err();
        assert!(blank.contains("Label"), "{blank}");
        let big = parse_settings(r#"{"Live":{"Label":"x","Maximum":11}}"#).unwrap_err();
        assert!(big.contains("Maximum"), "{big}");
        let secret =
            parse_settings(r#"{"Live":{"Label":"x","Maximum":"classified"}}"#).unwrap_err();
        assert!(!secret.contains("classified"), "{secret}");
        let secret = parse_settings(r#"{"Live":{"Secret":12345}}"#).unwrap_err();
        assert!(
            secret.contains("Secret") && !secret.contains("12345"),
            "{secret}"
        );
        assert!(parse_settings(r#"{"Live":{"Label":"a","label":"b"}}"#).is_err());
        assert!(parse_settings(r#"{"Live":"initial"}"#).is_err());
        assert!(parse_settings("[]").is_err());
    }

    #[test]
    fn missing_sections_and_members_take_the_seed_defaults() {
        let defaults = LiveSettings {
            label: "initial".to_owned(),
            maximum: 3,
            secret: String::new(),
        };
        for text in [
            "{}",
            r#"{"Other":{}}"#,
            r#"{"Live":null}"#,
            r#"{"Live":{}}"#,
        ] {
            assert_eq!(parse_settings(text), Ok(defaults.clone()), "{text}");
        }
        let partial = parse_settings(r#"{"live":{"maximum":7}}"#).unwrap();
        assert_eq!((partial.label.as_str(), partial.maximum), ("initial", 7));
    }
}
