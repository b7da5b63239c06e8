//! The privacy lab (not built yet).

use axum::Router;

use crate::app::{AppState, StartupContext};
use crate::config::StartupError;

/// The privacy lab's own state.
#[derive(Clone)]
pub struct PrivacyLab {}

impl PrivacyLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(PrivacyLab {})
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
}
