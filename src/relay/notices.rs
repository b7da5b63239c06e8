//! The relay's answer to gap notices: it subscribes (core NATS) to `gaps.PREFIX.*`, the notices
//! of the consumer it feeds ([`crate::broker::notices`]), and for each one takes the aggregate's
//! events again from the missing sequence (`POST /outbox/leases/resend`, at most `resend_max`),
//! publishes them in order as resends (`Resend-Msg-Id` instead of `Nats-Msg-Id`, so that
//! JetStream's duplicate window cannot drop the one that fills the gap), awaits their PubAcks and
//! acks them. The consumer's identity check makes the copies of what it already has harmless.
//!
//! Bounded: one resend per aggregate in flight (a notice for an aggregate already queued or being
//! resent is dropped), at most [`QUEUED_NOTICES`] waiting, one resend at a time. A dropped notice
//! costs nothing: the consumer repeats it while the aggregate waits.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{AckAnswer, LeaseAnswer, Peers, RelayError, RelayOptions, post, publish_batch};
use crate::broker::wire::{self, GapNotice};

/// Notices accepted and not yet answered, at most.
const QUEUED_NOTICES: usize = 64;

/// What answering notices came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct NoticeFigures {
    pub notices: u64,
    pub resent: u64,
}

#[derive(Default)]
struct Counts {
    notices: AtomicU64,
    resent: AtomicU64,
}

/// The aggregates with a notice queued or a resend under way.
type InFlight = Arc<Mutex<HashSet<String>>>;

/// The running answer to notices: a reader of the subscription and one worker.
pub(super) struct Answering {
    stop: CancellationToken,
    reader: JoinHandle<()>,
    worker: JoinHandle<()>,
    counts: Arc<Counts>,
}

impl Answering {
    /// Stops reading notices, lets the resend in hand finish, and says what was done.
    pub async fn finish(self) -> NoticeFigures {
        self.stop.cancel();
        let _ = self.reader.await;
        let _ = self.worker.await;
        NoticeFigures {
            notices: self.counts.notices.load(Ordering::Relaxed),
            resent: self.counts.resent.load(Ordering::Relaxed),
        }
    }
}

/// Subscribes to the notices (before the relay's first lease, so none of its run is missed) and
/// starts answering them until `stop`.
pub(super) async fn answer(
    peers: Arc<Peers>,
    options: RelayOptions,
    stop: CancellationToken,
) -> Result<Answering, RelayError> {
    let subject = wire::gap_subjects(&options.subject_prefix);
    let subscriber = peers
        .client
        .subscribe(subject.clone())
        .await
        .map_err(|error| RelayError::Nats {
            urls: peers.urls.clone(),
            reason: format!("cannot subscribe to {subject}: {error}"),
        })?;
    let (queue, queued) = mpsc::channel(QUEUED_NOTICES);
    let in_flight = InFlight::default();
    let counts = Arc::new(Counts::default());
    let reader = tokio::spawn(read_notices(
        subscriber,
        queue,
        in_flight.clone(),
        counts.clone(),
        stop.clone(),
    ));
    let worker = tokio::spawn(resend_each(
        peers,
        options,
        queued,
        in_flight,
        counts.clone(),
        stop.clone(),
    ));
    Ok(Answering {
        stop,
        reader,
        worker,
        counts,
    })
}

/// Queues each readable notice whose aggregate has none queued or under way.
async fn read_notices(
    mut subscriber: async_nats::Subscriber,
    queue: mpsc::Sender<GapNotice>,
    in_flight: InFlight,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            message = subscriber.next() => message,
        };
        let Some(message) = message else { return };
        let notice: GapNotice = match serde_json::from_slice(&message.payload) {
            Ok(notice) => notice,
            Err(error) => {
                tracing::warn!(subject = %message.subject, %error, "unreadable gap notice ignored");
                continue;
            }
        };
        counts.notices.fetch_add(1, Ordering::Relaxed);
        let aggregate_id = notice.aggregate_id.clone();
        let fresh = in_flight
            .lock()
            .is_ok_and(|mut in_flight| in_flight.insert(aggregate_id.clone()));
        if fresh && queue.try_send(notice).is_err() {
            // Full: this notice is dropped, the consumer repeats it.
            if let Ok(mut in_flight) = in_flight.lock() {
                in_flight.remove(&aggregate_id);
            }
        }
    }
}

/// Answers the queued notices one at a time until `stop`.
async fn resend_each(
    peers: Arc<Peers>,
    options: RelayOptions,
    mut queued: mpsc::Receiver<GapNotice>,
    in_flight: InFlight,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    loop {
        let notice = tokio::select! {
            () = stop.cancelled() => return,
            notice = queued.recv() => notice,
        };
        let Some(notice) = notice else { return };
        let resent = resend(&peers, &options, &notice).await;
        counts.resent.fetch_add(resent, Ordering::Relaxed);
        if let Ok(mut in_flight) = in_flight.lock() {
            in_flight.remove(&notice.aggregate_id);
        }
    }
}

/// Takes the aggregate's events again from the missing sequence, publishes them as resends and
/// acks them; returns how many were PubAcked. Nothing a notice says stops the relay: a refused
/// or failed resend is logged, and the notice comes again.
async fn resend(peers: &Peers, options: &RelayOptions, notice: &GapNotice) -> u64 {
    let from = notice.missing.from;
    let owner = &options.owner;
    let lease = post::<LeaseAnswer>(
        peers,
        "/outbox/leases/resend",
        &json!({
            "owner": owner,
            "aggregateId": notice.aggregate_id,
            "fromSequence": from,
            "max": options.resend_max,
            "leaseMs": u64::try_from(options.lease.as_millis()).unwrap_or(u64::MAX),
        }),
    )
    .await;
    let events = match lease {
        Ok(lease) => lease.events,
        Err(reason) => {
            eprintln!(
                "relay {owner}: the resend of {} failed: {reason}",
                notice.aggregate_id
            );
            return 0;
        }
    };
    if events.is_empty() {
        eprintln!(
            "relay {owner}: gap notice for {} from sequence {from}: nothing to resend (the outbox has no event {from} of it, or it is on its way under a lease)",
            notice.aggregate_id
        );
        return 0;
    }
    let sent = publish_batch(peers, options, &events, wire::RESEND_HEADER).await;
    let items: Vec<serde_json::Value> = sent
        .published
        .iter()
        .map(|event| json!({"id": event.id, "generation": event.generation}))
        .collect();
    let acked = if items.is_empty() {
        Ok(None)
    } else {
        post::<AckAnswer>(
            peers,
            "/outbox/leases/ack",
            &json!({"owner": owner, "events": items}),
        )
        .await
        .map(Some)
    };
    // An unacked resend's lease expires and an ordinary lease publishes it again.
    let acked = match acked {
        Ok(answer) => answer.map_or(0, |answer| answer.acked),
        Err(reason) => {
            eprintln!("relay {owner}: the ack of a resend failed: {reason}");
            0
        }
    };
    eprintln!(
        "relay {owner}: resent {} events of {} from sequence {from} on a gap notice ({} without PubAck), acked {acked}",
        sent.published.len(),
        notice.aggregate_id,
        sent.unpublished
    );
    sent.published.len() as u64
}
