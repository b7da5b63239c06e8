//! The http lab (not built yet).

use axum::Router;

use crate::app::{AppState, StartupContext};
use crate::config::StartupError;

/// The http lab's own state.
#[derive(Clone)]
pub struct HttpLab {}

impl HttpLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(HttpLab {})
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
}
