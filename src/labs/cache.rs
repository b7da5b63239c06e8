//! The cache lab (not built yet).

use axum::Router;

use crate::app::{AppState, StartupContext};
use crate::config::StartupError;

/// The cache lab's own state.
#[derive(Clone)]
pub struct CacheLab {}

impl CacheLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(CacheLab {})
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
}
