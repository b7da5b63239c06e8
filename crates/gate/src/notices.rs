//! On PostgreSQL, a gate's own connection listening on [`OUTPUT_CHANNEL`], on which the other
//! gates of the store announce their commits of output rows ([`crate::handler`]). Each
//! notification wakes this gate's publisher, so that a row applied by another gate leaves as
//! soon as one applied here rather than at the publisher's next tick. The tick still covers what
//! no notification announced: a connection being opened again, or a network dropping it silently.

use std::sync::Arc;
use std::time::Duration;

use http_edge::metrics::Metrics;
use ordered_inbox::postgres::Target;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::publisher::HeldEpoch;

/// The PostgreSQL channel on which a gate's commit of output rows is announced to the others.
pub const OUTPUT_CHANNEL: &str = "gate_output";

/// The first pause before the listening connection is opened again; it doubles to the last.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_LAST: Duration = Duration::from_secs(5);

/// What a gate's handler announces its output rows with: its name on the channel, while its
/// publisher does not hold the store's lease.
#[derive(Clone, Debug)]
pub struct Announcer {
    held: HeldEpoch,
    /// Unique to the process, so that its own listener leaves its own notifications out.
    name: String,
}

impl Announcer {
    /// The announcer of a gate whose publisher shows the lease it holds in `held`.
    pub fn new(held: HeldEpoch) -> Announcer {
        let name = format!("gate-{}-{:016x}", std::process::id(), rand::random::<u64>());
        Announcer { held, name }
    }

    /// The notification's payload while another gate may be publishing; `None` while this
    /// gate's publisher holds the lease (its own applies wake it within the process).
    pub fn payload(&self) -> Option<&str> {
        self.held.get().is_none().then_some(self.name.as_str())
    }
}

/// Listens on `target` until `stop`, waking the publisher at each notification of another gate
/// (not of `announcer`, this gate), and opens the connection again after a growing pause
/// whenever it fails or ends.
pub async fn wake_on_notifications(
    target: Target,
    announcer: Announcer,
    wake: Arc<Notify>,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let mut pause = RETRY_FIRST;
    while !stop.is_cancelled() {
        match target
            .listen(OUTPUT_CHANNEL, Some(announcer.name.clone()))
            .await
        {
            Ok(mut listening) => {
                pause = RETRY_FIRST;
                // Whatever was committed while nobody listened is announced by this wake-up.
                wake.notify_one();
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        heard = listening.notified() => if heard {
                            metrics.gate_output_notification();
                            wake.notify_one();
                        } else {
                            tracing::warn!(retry_in_ms = pause.as_millis(),
                                "gate: the connection listening for other gates' output ended");
                            break;
                        },
                    }
                }
            }
            Err(error) => tracing::warn!(%error, retry_in_ms = pause.as_millis(),
                "gate: no connection listening for other gates' output"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(RETRY_LAST);
    }
}
