//! A lab switch that holds work until it is opened again, shared by the labs that let a learner
//! watch work wait (the cache's factory, the worker's items).

use std::sync::Arc;

use tokio::sync::watch;

use crate::http::error::AppError;

/// What a latch route may do, for the OpenAPI document.
#[derive(utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum GateAction {
    Close,
    Open,
}

/// Open at start. Clones share one switch.
#[derive(Clone)]
pub struct WorkLatch {
    open: Arc<watch::Sender<bool>>,
}

impl Default for WorkLatch {
    fn default() -> Self {
        WorkLatch {
            open: Arc::new(watch::Sender::new(true)),
        }
    }
}

impl WorkLatch {
    /// Applies the path's action: `close` or `open` (exactly); anything else is a 400.
    pub fn apply(&self, action: &str) -> Result<(), AppError> {
        match action {
            "close" => self.open.send_replace(false),
            "open" => self.open.send_replace(true),
            other => {
                return Err(AppError::bad_request(format!(
                    "gate action must be 'close' or 'open', not '{other}'"
                )));
            }
        };
        Ok(())
    }

    pub fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Resolves once the gate is open (at once if it already is).
    pub async fn passed(&self) {
        let mut open = self.open.subscribe();
        // Err only if the sender is gone, and `self` holds it.
        let _ = open.wait_for(|open| *open).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_knows_only_close_and_open() {
        let gate = WorkLatch::default();
        assert!(gate.is_open());
        gate.apply("close").unwrap();
        assert!(!gate.is_open());
        assert!(gate.apply("Close").is_err());
        assert!(gate.apply("shut").is_err());
        assert!(!gate.is_open());
        gate.apply("open").unwrap();
        assert!(gate.is_open());
    }
}
