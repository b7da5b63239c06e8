//! Why a server refused to start: one readable line each.

/// Why a server refused to start. Each is one readable line.
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
