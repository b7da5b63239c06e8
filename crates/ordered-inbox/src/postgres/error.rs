//! Why the PostgreSQL inbox could not be opened: its own module, so that the connection target
//! and the TLS settings it reads both name it without importing each other.

/// Why the PostgreSQL inbox could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostgresError {
    #[error(
        "invalid PostgreSQL URL: {0} (expected postgres://USER@127.0.0.1:PORT/DATABASE or a Unix socket directory)"
    )]
    BadUrl(String),
    #[error(
        "refusing to use PostgreSQL at '{0}': only loopback hosts (127.0.0.1, ::1, localhost) or a Unix socket directory are accepted"
    )]
    NotLocal(String),
    #[error("PostgreSQL at {target}: {reason}")]
    Connect { target: String, reason: String },
    /// A certificate or key file of the TLS settings cannot be read.
    #[error("{file}: {reason}")]
    TlsFile { file: String, reason: String },
    /// The server's certificate was refused (a wrong CA, a host name it does not name).
    #[error("PostgreSQL at {target}: the server's certificate is refused: {reason}")]
    Certificate { target: String, reason: String },
    /// The server refused the password (or asked for one and none was given).
    #[error("PostgreSQL at {target}: authentication failed: {reason}")]
    Authentication { target: String, reason: String },
    #[error(
        "PostgreSQL at {target}: the ordered inbox has schema version {found}, newer than this build's {known}"
    )]
    NewerSchema {
        target: String,
        found: i64,
        known: i64,
    },
}
