//! Gap notices on the broker door and the relay's resend: a real `nats-server`, server B
//! consuming it, and for the loop a real `production-lab relay` process feeding B from server A's
//! general outbox. An event deleted from the stream before B read it is resent on B's notice and
//! the aggregate flows again without an operator.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use futures_util::StreamExt;
use lab_testkit::nats::NatsServer;
use production_lab::broker::loopback_config;
use production_lab::broker::wire::{self, GapNotice};
use serde_json::{Value, json};

use crate::broker::{jetstream_of, publish_ordered, start_nats};
use crate::helpers::{
    Backend, TestApp, command, poll_until, spawn_app, spawn_app_on_with, status_and_json,
};

/// Every gap notice published on `gaps.ordered.*`, with when it arrived.
#[derive(Clone, Default)]
struct Notices(Arc<Mutex<Vec<(Instant, GapNotice)>>>);

impl Notices {
    /// Subscribes (and waits until the server has the subscription) and collects from then on.
    async fn listen(nats: &NatsServer) -> Notices {
        let client = nats.connect().await.expect("connect to nats-server");
        let mut subscriber = client
            .subscribe(wire::gap_subjects("ordered"))
            .await
            .expect("subscribe to the gap notices");
        client.flush().await.expect("flush the subscription");
        let notices = Notices::default();
        let sink = notices.0.clone();
        tokio::spawn(async move {
            let _client = client;
            while let Some(message) = subscriber.next().await {
                let notice: GapNotice =
                    serde_json::from_slice(&message.payload).expect("a gap notice's JSON");
                assert_eq!(
                    message.subject.as_str(),
                    wire::gap_subject_for("ordered", &notice.aggregate_id)
                );
                if let Ok(mut sink) = sink.lock() {
                    sink.push((Instant::now(), notice));
                }
            }
        });
        notices
    }

    /// The notices about `aggregate_id` so far, in arrival order.
    fn about(&self, aggregate_id: &str) -> Vec<(Instant, GapNotice)> {
        self.0
            .lock()
            .map(|all| {
                all.iter()
                    .filter(|(_, notice)| notice.aggregate_id == aggregate_id)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `count` notices about `aggregate_id` arrived; answers them.
    async fn wait_for(&self, aggregate_id: &str, count: usize) -> Vec<(Instant, GapNotice)> {
        poll_until(
            &format!("{count} gap notices about {aggregate_id}"),
            || std::future::ready(self.about(aggregate_id)),
            |notices| notices.len() >= count,
        )
        .await
    }
}

/// B consuming `nats`, on `backend`, its notices repeated every `interval`.
async fn consumer(nats: &NatsServer, backend: Backend, interval: Duration) -> TestApp {
    let mut broker = loopback_config(&nats.url).expect("a loopback NATS URL");
    broker.gap_notice_interval = interval;
    spawn_app_on_with(backend, move |config| config.nats = Some(broker)).await
}

async fn get_json(app: &TestApp, path: &str) -> Value {
    let (status, body) = status_and_json(app.get(path).await).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// The notice an aggregate missing `from..=through` and holding `held` is sent.
fn assert_notice(notice: &GapNotice, aggregate_id: &str, from: i64, through: i64, held: &[i64]) {
    assert_eq!(notice.aggregate_id, aggregate_id);
    assert_eq!(
        (notice.missing.from, notice.missing.through),
        (from, through)
    );
    assert_eq!(notice.held_sequences, held);
    assert!(notice.waiting_since.is_some(), "{notice:?}");
}

async fn publish_anonymous(nats: &NatsServer, aggregate_id: &str, sequence: i64) {
    let js = jetstream_of(nats).await;
    let message_id = format!("{aggregate_id}-{sequence}");
    publish_ordered(&js, None, aggregate_id, &message_id, sequence, 1).await;
}

/// A `production-lab relay` child process, its stderr collected; killed when dropped.
struct RelayProcess {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl RelayProcess {
    fn start(base: &str, nats: &str) -> RelayProcess {
        let mut child = command()
            .args(["relay", "--base", base, "--nats", nats, "--owner", "one"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the relay");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        let pipe = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if let Ok(mut sink) = sink.lock() {
                    sink.push(line);
                }
            }
        });
        RelayProcess { child, stderr }
    }

    /// Waits for a stderr line containing `needle`.
    async fn said(&self, needle: &str) -> String {
        poll_until(
            &format!("the relay says '{needle}'"),
            || {
                std::future::ready(
                    self.stderr
                        .lock()
                        .ok()
                        .and_then(|lines| lines.iter().find(|line| line.contains(needle)).cloned()),
                )
            },
            Option::is_some,
        )
        .await
        .unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The stream position holding the message whose `Nats-Msg-Id` is `id`, among the first `upto`.
async fn stream_position_of(
    stream: &async_nats::jetstream::stream::Stream,
    id: &str,
    upto: u64,
) -> u64 {
    for position in 1..=upto {
        let stored = stream
            .get_raw_message(position)
            .await
            .expect("a stored message");
        if stored
            .headers
            .get(wire::MESSAGE_ID_HEADER)
            .is_some_and(|value| value.as_str() == id)
        {
            return position;
        }
    }
    panic!("no message {id} in the first {upto} of the stream");
}

// ---------------------------------------------------------------------------------------------
// The loop: a lost event resent on the notice

async fn an_event_deleted_from_the_stream_before_b_read_it_is_resent_on_bs_gap_notice_and_the_aggregate_flows_again(
    backend: Backend,
) {
    let nats = start_nats(None);
    let js = jetstream_of(&nats).await;
    // The stream B would create (2-minute duplicate window), made first so that A's events are in
    // it before B reads any.
    let stream = js
        .get_or_create_stream(StreamConfig {
            name: "ORDERED".to_owned(),
            subjects: vec!["ordered.*".to_owned()],
            storage: StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let a = spawn_app().await;
    for sequence in 1..=4 {
        let event = json!({"eventKey": format!("gap-{sequence}"), "aggregateId": "gap",
                           "sequence": sequence, "amount": sequence});
        let (status, body) = status_and_json(a.post_json("/outbox/events", &event).await).await;
        assert_eq!(status, 201, "{body}");
    }
    let notices = Notices::listen(&nats).await;
    let relay = RelayProcess::start(&a.address, &nats.url);
    poll_until(
        "the relay published and acked A's four events",
        || async { get_json(&a, "/outbox/events?status=sent").await["counts"]["sent"].clone() },
        |sent| *sent == 4,
    )
    .await;
    let lost = stream_position_of(&stream, "gap-2", 4).await;
    assert!(
        stream.delete_message(lost).await.expect("delete gap-2"),
        "deleted"
    );

    let b = consumer(&nats, backend, Duration::from_secs(30)).await;
    let view = poll_until(
        "B applied the aggregate through 4",
        || async { status_and_json(b.get("/aggregates/gap").await).await.1 },
        |view| view["last"] == 4,
    )
    .await;
    assert_eq!(
        (
            view["status"].clone(),
            view["heldCount"].clone(),
            view["total"].clone()
        ),
        (json!("flowing"), json!(0), json!(10)),
        "{view}"
    );

    // B held 3 and 4 behind the lost 2 and said so; the relay resent 2, 3, 4.
    let first = notices.wait_for("gap", 1).await;
    assert_notice(&first[0].1, "gap", 2, 2, &[3, 4]);
    relay.said("resent 3 events of gap from sequence 2").await;
    let timeline = get_json(&b, "/aggregates/gap/timeline").await;
    let applied: Vec<i64> = timeline["events"]
        .as_array()
        .expect("timeline events")
        .iter()
        .filter(|entry| entry["kind"] == "applied")
        .filter_map(|entry| entry["sequence"].as_i64())
        .collect();
    assert_eq!(applied, [1, 2, 3, 4], "{timeline}");
    // The copies of 3 and 4 are replays; no operator did anything.
    poll_until(
        "B answered the resent 3 and 4 as replays",
        || async { get_json(&b, "/broker").await["counters"].clone() },
        |counters| counters["outcomes"]["replay"] == 2,
    )
    .await;
    let resolutions = get_json(&b, "/resolutions").await;
    assert_eq!(
        resolutions["resolutions"].as_array().map(Vec::len),
        Some(0),
        "{resolutions}"
    );
    let events = get_json(&a, "/outbox/events?status=sent").await;
    let generations: Vec<(String, i64)> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            (
                e["eventKey"].as_str().unwrap_or("").to_owned(),
                e["generation"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        generations,
        [
            ("gap-1".to_owned(), 1),
            ("gap-2".to_owned(), 2),
            ("gap-3".to_owned(), 2),
            ("gap-4".to_owned(), 2)
        ],
        "2..4 taken again, all sent"
    );
    // Why the resend carries Resend-Msg-Id: the window still drops the deleted message's id.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(wire::MESSAGE_ID_HEADER, "gap-2");
    let ack = crate::broker::publish_acked(
        &js,
        wire::subject_for("ordered", "gap"),
        headers,
        json!({"messageId": "gap-2", "sequence": 2, "amount": 2}).to_string(),
    )
    .await;
    assert!(ack.duplicate, "JetStream remembers a deleted message's id");
}

// ---------------------------------------------------------------------------------------------
// When notices are published

async fn a_waiting_aggregates_notice_repeats_at_the_interval_and_stops_once_it_flows(
    backend: Backend,
) {
    let nats = start_nats(None);
    let interval = Duration::from_millis(300);
    let b = consumer(&nats, backend, interval).await;
    let notices = Notices::listen(&nats).await;
    for sequence in [2, 3] {
        publish_anonymous(&nats, "late", sequence).await;
    }
    publish_anonymous(&nats, "still", 2).await;

    let repeated = notices.wait_for("late", 4).await;
    // The first, when 2 was held (3 perhaps in the same batch); then the timer's.
    assert_eq!(repeated[0].1.missing.from, 1);
    for (_, notice) in &repeated[1..] {
        assert_notice(notice, "late", 1, 1, &[2, 3]);
    }
    // The timer's notices come an interval apart, not in a flood.
    for pair in repeated[1..].windows(2) {
        let apart = pair[1].0.duration_since(pair[0].0);
        assert!(apart >= interval / 2, "notices {apart:?} apart");
    }
    assert_notice(
        &notices.wait_for("still", 1).await[0].1,
        "still",
        1,
        1,
        &[2],
    );

    publish_anonymous(&nats, "late", 1).await;
    poll_until(
        "late flows again",
        || async { get_json(&b, "/aggregates/late").await },
        |view| view["last"] == 3 && view["status"] == "flowing",
    )
    .await;
    // A tick under way may still have read "late" waiting; the ones after it never do.
    let seen = notices.about("still").len();
    let after = notices.wait_for("still", seen + 3).await;
    let second_tick = after[seen + 1].0;
    let late_after: Vec<_> = notices
        .about("late")
        .into_iter()
        .filter(|(at, _)| *at > second_tick)
        .collect();
    assert!(late_after.is_empty(), "{late_after:?}");
}

async fn a_flowing_aggregate_gets_no_gap_notice(backend: Backend) {
    let nats = start_nats(None);
    let b = consumer(&nats, backend, Duration::from_millis(200)).await;
    let notices = Notices::listen(&nats).await;
    for sequence in 1..=3 {
        publish_anonymous(&nats, "flow", sequence).await;
    }
    publish_anonymous(&nats, "gap", 3).await;
    // Three notices about "gap": the timer ran at least twice while "flow" was in the inbox.
    assert_notice(&notices.wait_for("gap", 3).await[0].1, "gap", 1, 2, &[3]);
    let flow = get_json(&b, "/aggregates/flow").await;
    assert_eq!(
        (flow["last"].clone(), flow["status"].clone()),
        (json!(3), json!("flowing"))
    );
    assert!(
        notices.about("flow").is_empty(),
        "{:?}",
        notices.about("flow")
    );
    let counters = get_json(&b, "/broker").await["counters"].clone();
    assert!(
        counters["gapNotices"].as_u64().unwrap_or(0) >= 3,
        "{counters}"
    );
}

crate::on_both_backends!(
    an_event_deleted_from_the_stream_before_b_read_it_is_resent_on_bs_gap_notice_and_the_aggregate_flows_again,
    a_waiting_aggregates_notice_repeats_at_the_interval_and_stops_once_it_flows,
    a_flowing_aggregate_gets_no_gap_notice,
);
