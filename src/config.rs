//! Start-up configuration: where to listen, which database file, which settings file, and the
//! guards that keep this fault-injecting fixture on a developer's own loopback interface.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

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
            inbox: None,
        }
    }

    /// The bounds the ordered inbox keeps.
    pub fn inbox_limits(&self) -> ordered_inbox::Limits {
        ordered_inbox::Limits {
            max_open_dead_letters: self.max_open_dead_letters,
        }
    }
}

/// The default of `--max-open-dead-letters`.
pub const DEFAULT_MAX_OPEN_DEAD_LETTERS: u32 = 1000;

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
    #[error("invalid --allowed-hosts '{value}': {reason}")]
    AllowedHosts { value: String, reason: String },
    /// `--inbox` names no loopback PostgreSQL, or the database could not be reached or migrated.
    #[error("--inbox: {0}")]
    Inbox(String),
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

/// Parses `http://HOST:PORT[/]` and insists the host is loopback. `localhost` means 127.0.0.1.
pub fn parse_listen_url(url: &str) -> Result<SocketAddr, StartupError> {
    let bad = |reason: &str| StartupError::BadUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    if url.contains(';') {
        return Err(bad("give exactly one URL"));
    }
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        bad("only http:// URLs are served (this is a plain-HTTP loopback fixture)")
    })?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') || authority.contains('@') || authority.contains('?') {
        return Err(bad(
            "expected http://HOST:PORT with no path, user info or query",
        ));
    }
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| bad("unclosed '[' in IPv6 address"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| bad("missing :PORT"))?;
        (host, port)
    } else {
        authority
            .rsplit_once(':')
            .ok_or_else(|| bad("missing :PORT"))?
    };
    let port: u16 = port
        .parse()
        .map_err(|_| bad("the port must be a number from 0 to 65535"))?;
    let ip: IpAddr = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        match host.parse() {
            Ok(ip) => ip,
            // `*`, `+`, host names and anything else that is not a literal loopback address.
            Err(_) => return Err(StartupError::NotLoopback(url.to_owned())),
        }
    };
    if !ip.is_loopback() {
        return Err(StartupError::NotLoopback(url.to_owned()));
    }
    Ok(SocketAddr::new(ip, port))
}

/// The `Live` section of the runtime settings file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct LiveSettings {
    pub label: String,
    pub maximum: i64,
    #[serde(default)]
    pub secret: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SettingsFile {
    live: Option<LiveSettings>,
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

/// Validates settings text; the `Err` is a short reason naming the offending field.
pub fn parse_settings(text: &str) -> Result<LiveSettings, String> {
    let file: SettingsFile = serde_json::from_str(text).map_err(|e| {
        // serde_json's message can quote input; keep only its category and position.
        format!(
            "not valid settings JSON (line {}, column {}): expected {{\"Live\":{{\"Label\":text,\"Maximum\":1..10,\"Secret\":text}}}}",
            e.line(),
            e.column()
        )
    })?;
    let live = file
        .live
        .ok_or_else(|| "missing the \"Live\" section".to_owned())?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
