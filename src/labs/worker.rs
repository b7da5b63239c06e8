//! The worker lab (not built yet).

use axum::Router;

use crate::app::{AppState, StartupContext};
use crate::config::StartupError;

/// The worker lab's own state.
#[derive(Clone)]
pub struct WorkerLab {}

impl WorkerLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(WorkerLab {})
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
}
