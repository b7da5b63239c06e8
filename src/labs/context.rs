//! What a lab may use while it builds its state at start-up. It lives apart from [`crate::app`]
//! so that the labs can see it without depending on the application that assembles them.

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, LiveSettings};
use crate::store::Store;

/// Borrowed by each lab's `new` while the application is being built.
pub struct StartupContext<'a> {
    pub config: &'a Config,
    pub store: &'a Store,
    /// The settings file's content, already validated.
    pub settings: &'a LiveSettings,
    /// Cancelled when shutdown begins; background work watches it.
    pub shutdown: &'a CancellationToken,
    /// Background tasks that shutdown waits for.
    pub tasks: &'a TaskTracker,
}
