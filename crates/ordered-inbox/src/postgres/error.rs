//! Why the PostgreSQL inbox could not be opened: its own module, so that the connection target
//! and the TLS settings it reads both name it without importing each other.

/// Why the PostgreSQL inbox could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostgresError {
    #[error(
        "invalid PostgreSQL URL: {0} (expected postgres://USER@127.0.0.1:PORT/DATABASE or a Unix socket directory)"
    )]
    /// The URL cannot be read.
    BadUrl(String),
    #[error(
        "refusing to use PostgreSQL at '{0}': only loopback hosts (127.0.0.1, ::1, localhost) or a Unix socket directory are accepted"
    )]
    /// The URL names a host beyond loopback, which needs [`crate::postgres::Remote`].
    NotLocal(String),
    /// The server cannot be reached, or failed a statement while the inbox opened.
    #[error("PostgreSQL at {target}: {reason}")]
    Connect {
        /// Where, without credentials.
        target: String,
        /// What failed.
        reason: String,
    },
    /// A certificate or key file of the TLS settings cannot be read.
    #[error("{file}: {reason}")]
    TlsFile {
        /// The file.
        file: String,
        /// What failed.
        reason: String,
    },
    /// The server's certificate was refused (a wrong CA, a host name it does not name).
    #[error("PostgreSQL at {target}: the server's certificate is refused: {reason}")]
    Certificate {
        /// Where, without credentials.
        target: String,
        /// Why it was refused.
        reason: String,
    },
    /// The server refused the password (or asked for one and none was given).
    #[error("PostgreSQL at {target}: authentication failed: {reason}")]
    Authentication {
        /// Where, without credentials.
        target: String,
        /// What the server said.
        reason: String,
    },
    #[error(
        "PostgreSQL at {target}: the ordered inbox has schema version {found}, newer than this build's {known}"
    )]
    /// The database's inbox schema is newer than this build knows.
    NewerSchema {
        /// Where, without credentials.
        target: String,
        /// The version found.
        found: i64,
        /// The newest version this build knows.
        known: i64,
    },
}
