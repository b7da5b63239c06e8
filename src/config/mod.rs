//! Start-up configuration: where to listen, which database file, which settings file, and the
//! guards that keep this fault-injecting fixture on a developer's own loopback interface; every
//! component's settings (the broker door's in [`broker`]) and the start-up refusals
//! ([`StartupError`]). The lowest floor of the server: it imports none of the others.

pub use http_edge::jetstream::config as broker;
pub use http_edge::limits::*;
pub use http_edge::startup::StartupError;

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

/// A fresh database path in the temp directory, as the seed picks when none is given.
pub fn default_database_path() -> PathBuf {
    let nonce: u64 = rand::random();
    std::env::temp_dir().join(format!("production-lab-{nonce:016x}.db"))
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
