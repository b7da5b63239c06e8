//! The failures an inbox operation reports: the store's, and the application handler's.

/// A store failure underneath an inbox operation, or a handler's failure that kept a delivery
/// from being recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboxError {
    /// A condition a retry can clear: lock contention past its retries, a stopped writer, a
    /// database that is down or restarting.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// Anything else: the detail belongs in the server's log, not in an answer.
    #[error("store failure: {0}")]
    Failed(String),
    /// The application's handler failed while applying the delivery: nothing of it was
    /// recorded (neither the inbox's rows nor the handler's), and delivering it again retries.
    #[error("handler failure: {0}")]
    Handler(HandlerError),
}

/// A failure of an application handler's `apply` (a query of its own tables that failed, a
/// resource it could not reach). It fails that delivery alone: the delivery records nothing and
/// may be delivered again. A verdict about the message itself is a poison, not an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HandlerError(pub String);

impl HandlerError {
    /// A handler failure that says `text`.
    pub fn new(text: impl Into<String>) -> HandlerError {
        HandlerError(text.into())
    }
}

#[cfg(feature = "sqlite")]
impl From<rusqlite::Error> for HandlerError {
    fn from(error: rusqlite::Error) -> Self {
        HandlerError(format!("sqlite: {error}"))
    }
}

#[cfg(feature = "postgres")]
impl From<tokio_postgres::Error> for HandlerError {
    fn from(error: tokio_postgres::Error) -> Self {
        // tokio-postgres's `Display` of a database error is only "db error": name its cause.
        match error.as_db_error() {
            Some(db) => HandlerError(format!("postgres: {} ({})", db.message(), db.code().code())),
            None => HandlerError(format!("postgres: {error}")),
        }
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(error: serde_json::Error) -> Self {
        HandlerError(format!("json: {error}"))
    }
}
