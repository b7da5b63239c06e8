//! The security lab (not built yet).

use axum::Router;

use crate::app::{AppState, StartupContext};
use crate::config::StartupError;

/// The security lab's own state.
#[derive(Clone)]
pub struct SecurityLab {}

impl SecurityLab {
    pub fn new(_context: &StartupContext<'_>) -> Result<Self, StartupError> {
        Ok(SecurityLab {})
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
}

/// The middleware that wraps every route, outermost first as in the seed: host filtering,
/// forwarded headers, CORS, antiforgery. (Not built yet: the router passes through.)
pub fn wrap(router: Router, _state: &AppState) -> Router {
    router
}
