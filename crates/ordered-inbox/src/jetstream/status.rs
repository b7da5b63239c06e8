//! What a consumer and its server share: its evidence ([`ConsumerStatus`]), the hooks a server
//! fills ([`ConsumerObserver`], [`AfterCommit`]), and the inbox it delivers to ([`SharedInbox`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use async_nats::jetstream::consumer::PullConsumer;
use serde::Serialize;

use super::config::BrokerConfig;
use crate::inbox::Inbox;
use crate::records::ProducerRefusal;

/// The inbox the consumer delivers to, whatever store is underneath.
pub type SharedInbox = Arc<dyn Inbox>;

/// Where the consumer counts what it refuses itself, before the inbox sees a message (a server's
/// metrics, say).
pub trait ConsumerObserver: Send + Sync {
    /// A message's producer headers could not be read: it is malformed.
    fn producer_headers_malformed(&self);
    /// A producer's message the consumer refused itself (an unknown token).
    fn producer_refusal(&self, refusal: &ProducerRefusal);
}

/// What the consumer did so far, for a server's evidence.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Counters {
    /// Batches fetched and answered.
    pub batches: u64,
    /// Messages in those batches.
    pub messages: u64,
    /// Verdicts by name (`applied`, `replay`, `held`, `held again`, …, `malformed`).
    pub outcomes: BTreeMap<&'static str, u64>,
    /// Messages acknowledged.
    pub acked: u64,
    /// Messages nak'd for a redelivery.
    pub nakd: u64,
    /// Messages terminated.
    pub terminated: u64,
    /// Fetches that failed.
    pub fetch_errors: u64,
    /// Deliveries the store failed.
    pub store_errors: u64,
    /// Gap notices published (see [`super::notices`]).
    pub gap_notices: u64,
    /// The last error, in one line.
    pub last_error: Option<String>,
    /// The fault switch stopped the consumer after a COMMIT, before its acks.
    pub paused_after_commit: bool,
}

/// Asked after each batch's COMMIT, before its acks. A test's fault switch stops the consumer
/// there, as a crash between the COMMIT and the acks would; a deployment sets none.
pub trait AfterCommit: Send + Sync {
    /// `true`: stop now, before this batch's acks.
    fn stop_before_acks(&self) -> bool;
}

/// The consumer's shared evidence. Cheap to clone.
#[derive(Clone, Default)]
pub struct ConsumerStatus {
    pub(super) inner: Arc<Shared>,
}

#[derive(Default)]
pub(super) struct Shared {
    pub(super) config: OnceLock<BrokerConfig>,
    pub(super) client: OnceLock<async_nats::Client>,
    pub(super) consumer: OnceLock<PullConsumer>,
    pub(super) counters: Mutex<Counters>,
    pub(super) after_commit: OnceLock<Arc<dyn AfterCommit>>,
    /// Where a refusal the consumer decides itself (a token that is no active producer's) is
    /// counted, like the inbox's own refusals.
    pub(super) observer: OnceLock<Arc<dyn ConsumerObserver>>,
}

impl ConsumerStatus {
    /// The evidence of a consumer whose own refusals are counted by `observer`.
    pub fn with_observer(observer: Arc<dyn ConsumerObserver>) -> ConsumerStatus {
        let lab = ConsumerStatus::default();
        let _ = lab.inner.observer.set(observer);
        lab
    }

    pub(super) fn count(&self, update: impl FnOnce(&mut Counters)) {
        if let Ok(mut counters) = self.inner.counters.lock() {
            update(&mut counters);
        }
    }

    /// What the consumer did so far.
    pub fn counters(&self) -> Counters {
        self.inner
            .counters
            .lock()
            .map(|counters| counters.clone())
            .unwrap_or_default()
    }

    /// The check the consumer makes after each COMMIT, before its acks (see [`AfterCommit`]).
    pub fn with_after_commit(self, check: Arc<dyn AfterCommit>) -> ConsumerStatus {
        let _ = self.inner.after_commit.set(check);
        self
    }

    /// The consumer's settings, once it connected.
    pub fn config(&self) -> Option<&BrokerConfig> {
        self.inner.config.get()
    }

    /// Whether its NATS connection is up now; `None` before it connected.
    pub fn is_connected(&self) -> Option<bool> {
        self.inner
            .client
            .get()
            .map(|client| client.connection_state() == async_nats::connection::State::Connected)
    }

    /// The consumer's pending and un-acked counts, as the NATS server reports them now.
    pub async fn consumer_info(&self) -> Option<Result<(u64, usize), String>> {
        let consumer = self.inner.consumer.get()?;
        Some(
            consumer
                .get_info()
                .await
                .map(|info| (info.num_pending, info.num_ack_pending))
                .map_err(|error| error.to_string()),
        )
    }
}
