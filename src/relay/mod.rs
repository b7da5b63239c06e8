//! `production-lab relay`: moves events from one service's general outbox to JetStream. A real
//! client of the outbox's HTTP routes (no database access) and of NATS:
//!
//! 1. `POST /outbox/leases` — a batch, each event with its generation;
//! 2. publish each, in order, to `ordered.<aggregate>` on the broker door's wire format
//!    ([`crate::broker::wire`]: `Nats-Msg-Id` = the event key), then await every PubAck;
//! 3. `POST /outbox/leases/ack` with the generations of the events whose PubAck came back.
//!
//! A fenced ack (the lease expired, or another relay holds a newer generation) is logged and
//! counted, never retried as this relay's: the event is the newer lease's now. Whatever was not
//! acked is leased again once its lease expires and published again; JetStream's duplicate window
//! drops that copy, and past the window the inbox's identity check does.
//!
//! Beside that loop the relay answers the consumer's gap notices (`notices`): it takes the
//! aggregate's events again from the missing sequence and publishes them as resends.

mod notices;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::broker::{parse_nats_urls, wire};

/// Why the relay stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("{0}")]
    Refused(String),
    #[error("NATS at {urls}: {reason}")]
    Nats { urls: String, reason: String },
    #[error("the outbox at {base}: {reason}")]
    Outbox { base: String, reason: String },
}

/// How the relay runs.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// The outbox service's root, `http://127.0.0.1:PORT` (loopback only).
    pub base: String,
    /// Loopback `nats://HOST:PORT` URLs, comma-separated.
    pub nats: String,
    pub owner: String,
    pub subject_prefix: String,
    /// Events per lease.
    pub batch: usize,
    pub lease: Duration,
    /// Drain what is pending, then exit.
    pub once: bool,
    /// The longest idle back-off.
    pub max_idle: Duration,
    /// Test hook: after a batch's PubAcks and before its ack, print a line and wait this long
    /// (so a test can kill or stop the relay exactly there).
    pub hold_before_ack: Option<Duration>,
    /// The most events one gap notice has resent.
    pub resend_max: usize,
}

impl RelayOptions {
    pub fn new(base: &str, nats: &str, owner: &str) -> RelayOptions {
        RelayOptions {
            base: base.to_owned(),
            nats: nats.to_owned(),
            owner: owner.to_owned(),
            subject_prefix: crate::broker::DEFAULT_SUBJECT_PREFIX.to_owned(),
            batch: 256,
            lease: Duration::from_secs(10),
            once: false,
            max_idle: Duration::from_secs(1),
            hold_before_ack: None,
            resend_max: 256,
        }
    }
}

/// What the relay did, printed when it exits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayReport {
    pub batches: u64,
    /// Events published with a PubAck (copies the broker dropped included).
    pub published: u64,
    /// PubAcks that said "duplicate": the broker already had this message id.
    pub duplicates: u64,
    pub acked: u64,
    pub fenced: u64,
    /// Publishes that got no PubAck after the retries; left for the next lease.
    pub unpublished: u64,
    /// Gap notices received (see `notices`).
    pub notices: u64,
    /// Events published again, PubAcked, on a gap notice.
    pub resent: u64,
}

impl std::fmt::Display for RelayReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "published {}, broker-reported duplicates {}, acked {}, fenced acks {}, unpublished {} in {} batches, gap notices {}, resent {}",
            self.published,
            self.duplicates,
            self.acked,
            self.fenced,
            self.unpublished,
            self.batches,
            self.notices,
            self.resent
        )
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Leased {
    id: i64,
    event_key: String,
    aggregate_id: String,
    sequence: i64,
    amount: i64,
    generation: i64,
}

#[derive(Debug, Deserialize)]
struct LeaseAnswer {
    events: Vec<Leased>,
}

#[derive(Debug, Deserialize)]
struct AckAnswer {
    acked: u64,
    fenced: u64,
    events: Vec<AckResult>,
}

#[derive(Debug, Deserialize)]
struct AckResult {
    id: i64,
    generation: i64,
    verdict: String,
}

#[derive(Debug, Deserialize)]
struct Counts {
    pending: i64,
}

#[derive(Debug, Deserialize)]
struct EventPage {
    counts: Counts,
}

/// The relay's two peers.
struct Peers {
    http: reqwest::Client,
    base: String,
    jetstream: jetstream::Context,
    client: async_nats::Client,
    urls: String,
}

/// Transport failures of one HTTP call are retried this many times before the batch is given up.
const HTTP_ATTEMPTS: u32 = 5;
/// Publishes without a PubAck are retried this many times within a batch.
const PUBLISH_ATTEMPTS: u32 = 5;

/// Runs until `stop` is cancelled (the batch in hand is finished first) or, with `once`, until
/// the outbox has nothing pending.
pub async fn run(
    options: &RelayOptions,
    stop: CancellationToken,
) -> Result<RelayReport, RelayError> {
    let peers = Arc::new(connect(options).await?);
    // `--once` drains and exits: it answers no notice.
    let answering = if options.once {
        None
    } else {
        Some(notices::answer(peers.clone(), options.clone(), stop.child_token()).await?)
    };
    let mut report = RelayReport::default();
    let mut idle = Duration::from_millis(10);
    let mut failures = 0u32;
    while !stop.is_cancelled() {
        let events = match lease(&peers, options).await {
            Ok(events) => {
                failures = 0;
                events
            }
            Err(PostError::Refused(reason)) => {
                // A 4xx: the outbox refuses this relay's request as it is (its owner name, its
                // batch); asking again cannot help.
                return Err(RelayError::Outbox {
                    base: peers.base.clone(),
                    reason,
                });
            }
            Err(PostError::Failed(reason)) => {
                failures += 1;
                tracing::warn!(owner = %options.owner, %reason, "lease failed");
                eprintln!("relay {}: lease failed: {reason}", options.owner);
                if options.once && failures >= HTTP_ATTEMPTS * 4 {
                    return Err(RelayError::Outbox {
                        base: peers.base.clone(),
                        reason,
                    });
                }
                pause(&stop, options.max_idle).await;
                continue;
            }
        };
        if events.is_empty() {
            if options.once && nothing_pending(&peers).await? {
                break;
            }
            // Idle (or every pending event is under another relay's live lease): back off,
            // doubling up to the bound, so an idle relay costs almost nothing.
            pause(&stop, idle).await;
            idle = (idle * 2).min(options.max_idle);
            continue;
        }
        idle = Duration::from_millis(10);
        relay_batch(&peers, options, events, &mut report).await;
    }
    if let Some(answering) = answering {
        let figures = answering.finish().await;
        report.notices = figures.notices;
        report.resent = figures.resent;
    }
    let _ = peers.client.flush().await;
    Ok(report)
}

async fn pause(stop: &CancellationToken, duration: Duration) {
    tokio::select! {
        () = stop.cancelled() => {},
        () = tokio::time::sleep(duration) => {},
    }
}

async fn connect(options: &RelayOptions) -> Result<Peers, RelayError> {
    let base = crate::labs::contracts::verify::parse_base_url(&options.base)
        .map_err(|error| RelayError::Refused(format!("--base: {error}")))?;
    let base = base.as_str().trim_end_matches('/').to_owned();
    let urls =
        parse_nats_urls(&options.nats).map_err(|error| RelayError::Refused(error.to_string()))?;
    if options.batch == 0 || options.batch > 1000 {
        return Err(RelayError::Refused(
            "--batch must be from 1 to 1000".to_owned(),
        ));
    }
    if options.resend_max == 0 || options.resend_max > 1000 {
        return Err(RelayError::Refused(
            "--resend-max must be from 1 to 1000".to_owned(),
        ));
    }
    let joined = urls.join(",");
    let failed = |reason: String| RelayError::Nats {
        urls: joined.clone(),
        reason,
    };
    let addresses = crate::broker::server_addresses(&urls)
        .map_err(|error| failed(format!("invalid address: {error}")))?;
    let client =
        crate::broker::reconnecting_client(format!("production-lab relay {}", options.owner))
            .connect(addresses)
            .await
            .map_err(|error| failed(format!("cannot connect: {error}")))?;
    let mut jetstream = jetstream::new(client.clone());
    // A PubAck that has not come within this is retried (a cluster electing a new leader).
    jetstream.set_timeout(Duration::from_secs(2));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|error| RelayError::Refused(format!("cannot build the HTTP client: {error}")))?;
    Ok(Peers {
        http,
        base,
        jetstream,
        client,
        urls: joined,
    })
}

/// Why a POST to the outbox gave no answer.
#[derive(Debug)]
enum PostError {
    /// Transport failures or 5xx, after the retries: worth trying again later.
    Failed(String),
    /// A 4xx: the request itself is refused.
    Refused(String),
}

impl std::fmt::Display for PostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PostError::Failed(reason) | PostError::Refused(reason) => f.write_str(reason),
        }
    }
}

/// POSTs `body` to `path` and reads the JSON answer; transport failures are retried (leases and
/// acks are safe to repeat: a repeated lease of the same owner finds its own events under a live
/// lease and skips them, a repeated ack answers acked again).
async fn post<T: for<'de> Deserialize<'de>>(
    peers: &Peers,
    path: &str,
    body: &serde_json::Value,
) -> Result<T, PostError> {
    let mut last = String::new();
    for attempt in 0..HTTP_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
        }
        let response = match peers
            .http
            .post(format!("{}{path}", peers.base))
            .json(body)
            .send()
            .await
        {
            Ok(response) => response,
            Err(error) => {
                last = format!("POST {path}: {error}");
                continue;
            }
        };
        let status = response.status();
        if status.is_server_error() {
            last = format!("POST {path}: {status}");
            continue;
        }
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(PostError::Refused(format!("POST {path}: {status}: {text}")));
        }
        return response.json::<T>().await.map_err(|error| {
            PostError::Failed(format!("POST {path}: unreadable answer: {error}"))
        });
    }
    Err(PostError::Failed(last))
}

async fn lease(peers: &Peers, options: &RelayOptions) -> Result<Vec<Leased>, PostError> {
    let answer: LeaseAnswer = post(
        peers,
        "/outbox/leases",
        &json!({
            "owner": options.owner,
            "max": options.batch,
            "leaseMs": u64::try_from(options.lease.as_millis()).unwrap_or(u64::MAX),
        }),
    )
    .await?;
    Ok(answer.events)
}

async fn nothing_pending(peers: &Peers) -> Result<bool, RelayError> {
    let failed = |reason: String| RelayError::Outbox {
        base: peers.base.clone(),
        reason,
    };
    let page: EventPage = peers
        .http
        .get(format!(
            "{}/outbox/events?status=pending&limit=1",
            peers.base
        ))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|error| failed(error.to_string()))?
        .json()
        .await
        .map_err(|error| failed(error.to_string()))?;
    Ok(page.counts.pending == 0)
}

/// Publishes one leased batch in order, awaits the PubAcks, and acks the published events.
async fn relay_batch(
    peers: &Peers,
    options: &RelayOptions,
    events: Vec<Leased>,
    report: &mut RelayReport,
) {
    report.batches += 1;
    let sent = publish_batch(peers, options, &events, wire::MESSAGE_ID_HEADER).await;
    report.published += sent.published.len() as u64;
    report.duplicates += sent.duplicates;
    report.unpublished += sent.unpublished as u64;
    if sent.unpublished > 0 {
        eprintln!(
            "relay {}: {} events got no PubAck from {} (connection {:?}); they stay pending for the next lease",
            options.owner,
            sent.unpublished,
            peers.urls,
            peers.client.connection_state()
        );
    }
    if sent.published.is_empty() {
        return;
    }
    if let Some(hold) = options.hold_before_ack {
        eprintln!(
            "relay {}: holding the ack of {} PubAcked events for {} ms",
            options.owner,
            sent.published.len(),
            hold.as_millis()
        );
        tokio::time::sleep(hold).await;
    }
    ack_published(peers, options, &sent, report).await;
}

/// What publishing one leased batch came to.
struct SentBatch<'a> {
    /// The events the broker PubAcked, in the order they were published.
    published: Vec<&'a Leased>,
    /// How many of them the broker's duplicate window dropped as copies.
    duplicates: u64,
    /// How many got no PubAck in [`PUBLISH_ATTEMPTS`] attempts.
    unpublished: usize,
    /// The header the event key travels in: `Nats-Msg-Id`, or a resend's `Resend-Msg-Id`.
    id_header: &'static str,
}

/// Publishes the events, and again those without a PubAck, up to [`PUBLISH_ATTEMPTS`] times
/// with a growing pause between attempts.
async fn publish_batch<'a>(
    peers: &Peers,
    options: &RelayOptions,
    events: &'a [Leased],
    id_header: &'static str,
) -> SentBatch<'a> {
    let mut sent = SentBatch {
        published: Vec::with_capacity(events.len()),
        duplicates: 0,
        unpublished: 0,
        id_header,
    };
    let mut remaining: Vec<&Leased> = events.iter().collect();
    for attempt in 0..PUBLISH_ATTEMPTS {
        if remaining.is_empty() {
            break;
        }
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        remaining = publish_attempt(peers, options, remaining, &mut sent).await;
    }
    sent.unpublished = remaining.len();
    sent
}

/// One attempt at publishing `events`: the PubAcked ones go into `sent`; the others are
/// returned, for the next attempt.
async fn publish_attempt<'a>(
    peers: &Peers,
    options: &RelayOptions,
    events: Vec<&'a Leased>,
    sent: &mut SentBatch<'a>,
) -> Vec<&'a Leased> {
    let mut failed = Vec::new();
    // Sent in order on one connection, so each aggregate's events reach the stream in
    // sequence order; the PubAcks are awaited afterwards, all together. Together, not one after
    // another: a PubAck's timeout starts when it is awaited, so a batch whose PubAcks were lost
    // (its stream's leader killed) would wait the timeout once per event, minutes for a batch.
    let mut pending = Vec::with_capacity(events.len());
    for event in events {
        pending.push((event, publish(peers, options, event, sent.id_header).await));
    }
    let answers = join_all(pending.into_iter().map(|(event, ack)| async move {
        let ack = match ack {
            Ok(future) => future.await.map_err(|error| error.to_string()),
            Err(error) => Err(error),
        };
        (event, ack)
    }))
    .await;
    for (event, ack) in answers {
        match ack {
            Ok(ack) => {
                if ack.duplicate {
                    sent.duplicates += 1;
                }
                sent.published.push(event);
            }
            Err(reason) => {
                tracing::warn!(owner = %options.owner, event = %event.event_key, %reason, "no PubAck");
                failed.push(event);
            }
        }
    }
    failed
}

/// Acks the published events with the generations they were leased under.
async fn ack_published(
    peers: &Peers,
    options: &RelayOptions,
    sent: &SentBatch<'_>,
    report: &mut RelayReport,
) {
    let items: Vec<serde_json::Value> = sent
        .published
        .iter()
        .map(|event| json!({"id": event.id, "generation": event.generation}))
        .collect();
    match post::<AckAnswer>(
        peers,
        "/outbox/leases/ack",
        &json!({"owner": options.owner, "events": items}),
    )
    .await
    {
        Ok(answer) => {
            report.acked += answer.acked;
            report.fenced += answer.fenced;
            for fenced in answer.events.iter().filter(|r| r.verdict != "acked") {
                // Never retried as this relay's: a newer lease owns the event now, or it will be
                // leased again; its copy on the broker is harmless (duplicate window, inbox).
                tracing::warn!(owner = %options.owner, id = fenced.id, generation = fenced.generation, verdict = %fenced.verdict, "ack fenced");
            }
            eprintln!(
                "relay {}: batch of {} published ({} broker duplicates), acked {}, fenced {}",
                options.owner,
                sent.published.len(),
                sent.duplicates,
                answer.acked,
                answer.fenced
            );
        }
        Err(reason) => {
            // The leases expire and the events are published again by whoever leases them.
            eprintln!(
                "relay {}: the ack of {} events failed: {reason}",
                options.owner,
                sent.published.len()
            );
        }
    }
}

async fn publish(
    peers: &Peers,
    options: &RelayOptions,
    event: &Leased,
    id_header: &'static str,
) -> Result<jetstream::context::PublishAckFuture, String> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(id_header, event.event_key.as_str());
    let body = json!({
        "messageId": event.event_key,
        "sequence": event.sequence,
        "amount": event.amount,
    });
    peers
        .jetstream
        .publish_with_headers(
            wire::subject_for(&options.subject_prefix, &event.aggregate_id),
            headers,
            body.to_string().into(),
        )
        .await
        .map_err(|error| error.to_string())
}
