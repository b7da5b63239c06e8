//! The gate's `/v1` routes over a real socket: the router served by axum on 127.0.0.1:0 with a
//! state assembled from real parts (the inbox with the gate's handler on a real SQLite file or a
//! private PostgreSQL database, observed; its output table; the registry in the same store).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use ordered_inbox::postgres::{PostgresInbox, Target};
use ordered_inbox::sqlite::{SqliteInbox, Store, Synchronous, schema};
use ordered_inbox::{Door, Inbox, Limits, Outcome};
use ordering_gate::auth::{Access, DeliveryRate};
use ordering_gate::handler::{GateHandler, SharedTypes};
use ordering_gate::health::{self, Health};
use ordering_gate::output::{self, OutputStore};
use ordering_gate::reload::ConfigGeneration;
use ordering_gate::routes::{GateMessageInput, GateParts, GateState, RegistryStore, router};
use ordering_gate::schemas::MessageTypes;
use production_lab::inbox::changes::InboxChanges;
use production_lab::inbox::observed::ObservedInbox;
use production_lab::telemetry::metrics::Metrics;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::helpers::{Backend, client, content_type, poll_until, status_and_json};
use crate::on_both_backends;

const PLACED: &str = "order.placed";
/// A type without a `gap_alert_after_ms` in [`Options::gap_alerts`]' tests.
const NOTED: &str = "order.noted";
const READER_TOKEN: &str = "reader-token-for-the-dashboard";

/// How a test's gate is set up.
struct Options {
    anonymous_writes: bool,
    rate: DeliveryRate,
    max_payload_bytes: usize,
    limits: Limits,
    /// Each type's `gap_alert_after_ms`, for the types that set one.
    gap_alerts: Vec<(String, Duration)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            anonymous_writes: false,
            rate: rate(10_000, 10_000),
            max_payload_bytes: 65_536,
            limits: Limits::default(),
            gap_alerts: Vec::new(),
        }
    }
}

fn rate(per_second: u32, burst: u32) -> DeliveryRate {
    DeliveryRate {
        per_second: NonZeroU32::new(per_second).expect("a rate"),
        burst: NonZeroU32::new(burst).expect("a burst"),
    }
}

/// A gate serving its routes on a loopback port, with one operator registered.
struct TestGate {
    address: String,
    client: reqwest::Client,
    operator_token: String,
    /// Requests with a `waitMs` the gate has received: a long poll is open once it counts one.
    long_polls_received: Arc<AtomicUsize>,
    /// The observed inbox the routes use, for deliveries through the broker's door.
    inbox: Arc<dyn Inbox>,
    stop: CancellationToken,
    server: JoinHandle<()>,
    _dir: Option<TempDir>,
}

fn types() -> MessageTypes {
    let schema = json!({
        "type": "object",
        "required": ["orderId", "amount"],
        "properties": {
            "orderId": {"type": "string"},
            "amount": {"type": "integer", "minimum": 0}
        }
    });
    MessageTypes::compile(vec![
        (PLACED.to_owned(), schema),
        (NOTED.to_owned(), json!({"type": "object"})),
    ])
    .expect("the schemas")
}

/// The inbox with `limits`, its output and its registry on `backend`, and the first operator's
/// token.
async fn open_store(
    backend: Backend,
    limits: Limits,
) -> (
    Arc<dyn Inbox>,
    OutputStore,
    RegistryStore,
    String,
    Option<TempDir>,
) {
    let handler = Arc::new(GateHandler::new(types()));
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().expect("a temp dir");
            let path = dir.path().join("gate.db");
            let store = Store::open(&path, Synchronous::Full, |connection| {
                schema::migrate(connection)?;
                output::migrate_sqlite(connection)
            })
            .expect("the gate's SQLite file");
            let token = ordered_inbox::sqlite::operators::add(&path, "ops").expect("an operator");
            let inbox = SqliteInbox::with_handler(store.clone(), limits, handler);
            let output = OutputStore::sqlite(store);
            (
                Arc::new(inbox),
                output,
                RegistryStore::Sqlite(path),
                token,
                Some(dir),
            )
        }
        Backend::Postgres => {
            let url = crate::postgres::fresh_database();
            let target = Target::parse(&url).expect("the database's URL");
            let inbox = PostgresInbox::open_with_handler(target.clone(), limits, handler)
                .await
                .expect("the gate's PostgreSQL inbox");
            output::install_postgres(&inbox)
                .await
                .expect("the output table");
            let token = ordered_inbox::postgres::operators::add(&url, "ops")
                .await
                .expect("an operator");
            let output = OutputStore::postgres(&inbox);
            (
                Arc::new(inbox),
                output,
                RegistryStore::Postgres(Box::new(target)),
                token,
                None,
            )
        }
    }
}

async fn spawn_gate(backend: Backend, options: Options) -> TestGate {
    let (inbox, output, registry, operator_token, dir) = open_store(backend, options.limits).await;
    let metrics = Metrics::new();
    let changes = InboxChanges::new();
    let observed = ObservedInbox::new(inbox, metrics.clone(), changes.clone());
    let access = Access::new(
        options.anonymous_writes,
        [("dashboard".to_owned(), READER_TOKEN.to_owned())],
        options.rate,
    );
    let inbox: Arc<dyn Inbox> = Arc::new(observed);
    let types: SharedTypes = Arc::new(ArcSwap::from_pointee(
        types().with_gap_alerts(options.gap_alerts),
    ));
    let health = Health {
        inbox: inbox.clone(),
        metrics: metrics.clone(),
        store: None,
        nats: None,
        access: access.clone(),
        generation: ConfigGeneration::new(),
        output: output.clone(),
        publisher: None,
        types: types.clone(),
    };
    let state = GateState::new(GateParts {
        inbox: inbox.clone(),
        output,
        access,
        registry,
        changes,
        metrics,
        types,
        max_payload_bytes: options.max_payload_bytes,
    });
    let (routes, _document) = router(state);
    let (health_routes, _) = health::routes(health, true).split_for_parts();
    let routes = routes.merge(health_routes);
    let long_polls_received = Arc::new(AtomicUsize::new(0));
    let counted = long_polls_received.clone();
    let routes = routes.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let counted = counted.clone();
            async move {
                if request
                    .uri()
                    .query()
                    .is_some_and(|query| query.contains("waitMs="))
                {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                next.run(request).await
            }
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let address = format!("http://{}", listener.local_addr().expect("its address"));
    let stop = CancellationToken::new();
    let stopped = stop.clone().cancelled_owned();
    let server = tokio::spawn(async move {
        axum::serve(listener, routes)
            .with_graceful_shutdown(stopped)
            .await
            .expect("the gate serves");
    });
    TestGate {
        address,
        client: client(),
        operator_token,
        long_polls_received,
        inbox,
        stop,
        server,
        _dir: dir,
    }
}

/// A registered producer's token and its session's epoch.
struct Producer {
    token: String,
    epoch: i64,
}

impl TestGate {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.server.await;
    }

    async fn as_operator(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut request = self
            .client
            .request(method, self.url(path))
            .bearer_auth(&self.operator_token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        status_and_json(request.send().await.expect("the request")).await
    }

    /// Registers `name` through `POST /v1/producers` and starts its first session.
    async fn producer(&self, name: &str) -> Producer {
        let (status, added) = self
            .as_operator(
                reqwest::Method::POST,
                "/v1/producers",
                Some(json!({"name": name})),
            )
            .await;
        assert_eq!(status, 201, "{added}");
        let token = added["token"].as_str().expect("a token").to_owned();
        let epoch = self.session(&token).await;
        Producer { token, epoch }
    }

    async fn session(&self, token: &str) -> i64 {
        let response = self
            .client
            .post(self.url("/v1/producers/session"))
            .bearer_auth(token)
            .send()
            .await
            .expect("a session");
        let (status, body) = status_and_json(response).await;
        assert_eq!(status, 200, "{body}");
        body["epoch"].as_i64().expect("an epoch")
    }

    async fn deliver_as(
        &self,
        producer: &Producer,
        epoch: i64,
        aggregate: &str,
        body: &Value,
    ) -> reqwest::Response {
        self.client
            .post(self.url(&format!("/v1/aggregates/{aggregate}/messages")))
            .bearer_auth(&producer.token)
            .header("Producer-Epoch", epoch.to_string())
            .json(body)
            .send()
            .await
            .expect("a delivery")
    }

    async fn deliver(&self, producer: &Producer, aggregate: &str, body: &Value) -> (u16, Value) {
        status_and_json(
            self.deliver_as(producer, producer.epoch, aggregate, body)
                .await,
        )
        .await
    }

    async fn read(&self, path: &str) -> (u16, Value) {
        let response = self
            .client
            .get(self.url(path))
            .bearer_auth(READER_TOKEN)
            .send()
            .await
            .expect("a read");
        status_and_json(response).await
    }

    async fn applied_sequences(&self, aggregate: &str) -> Vec<i64> {
        let (status, feed) = self
            .read(&format!("/v1/aggregates/{aggregate}/applied?limit=1000"))
            .await;
        assert_eq!(status, 200, "{feed}");
        sequences(&feed)
    }
}

fn sequences(feed: &Value) -> Vec<i64> {
    feed["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|entry| entry["sequence"].as_i64())
        .collect()
}

fn placed(aggregate: &str, sequence: i64, amount: i64) -> Value {
    json!({
        "messageId": format!("{aggregate}-m{sequence}"),
        "sequence": sequence,
        "type": PLACED,
        "payload": {"orderId": format!("o-{sequence}"), "amount": amount},
    })
}

on_both_backends!(
    a_producers_delivery_applies_and_its_entry_is_in_the_applied_feed,
    a_message_ahead_of_its_turn_is_a_gap_and_applies_once_its_predecessor_did,
    a_payload_its_schema_refuses_is_quarantined_with_the_validators_reason,
    a_delivery_under_a_fenced_epoch_is_refused_and_writes_nothing,
    an_operators_replacement_applies_the_quarantined_message_and_the_held_back_next_then_applies,
    the_applied_feed_long_poll_answers_as_soon_as_a_message_applies_and_after_pages_on,
    sixteen_concurrent_producer_tasks_never_see_a_5xx_and_the_feed_is_exactly_one_to_n,
    a_dead_letters_skip_and_a_gap_skip_of_three_come_out_as_skip_markers_in_the_applied_feed,
    a_gap_skip_of_more_than_ten_thousand_sequences_is_refused_and_writes_nothing,
    a_waiting_aggregate_past_its_held_successors_gap_alert_is_marked_overdue_and_counted,
);

#[tokio::test]
async fn an_anonymous_write_is_refused_with_401_saying_anonymous_writes_are_off() {
    let gate = spawn_gate(Backend::Sqlite, Options::default()).await;
    let response = gate
        .client
        .post(gate.url("/v1/aggregates/a-1/messages"))
        .json(&placed("a-1", 1, 5))
        .send()
        .await
        .expect("a delivery");
    assert_eq!(response.status(), 401);
    assert_eq!(content_type(&response), "application/problem+json");
    assert!(
        response
            .headers()
            .get("www-authenticate")
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("Bearer")),
        "a Bearer challenge"
    );
    let (_, body) = status_and_json(response).await;
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("anonymous writes are off"), "{body}");
    assert!(gate.applied_sequences("a-1").await.is_empty());
    gate.stop().await;
}

#[tokio::test]
async fn an_anonymous_write_applies_when_the_gate_allows_anonymous_writes() {
    let options = Options {
        anonymous_writes: true,
        ..Options::default()
    };
    let gate = spawn_gate(Backend::Sqlite, options).await;
    let response = gate
        .client
        .post(gate.url("/v1/aggregates/a-1/messages"))
        .json(&placed("a-1", 1, 5))
        .send()
        .await
        .expect("a delivery");
    let (status, body) = status_and_json(response).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    gate.stop().await;
}

async fn a_producers_delivery_applies_and_its_entry_is_in_the_applied_feed(backend: Backend) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, body) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"outcome": "applied", "aggregateId": "a-1", "messageId": "a-1-m1", "sequence": 1, "superseded": []})
    );
    let (status, again) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(
        (status, again["outcome"].as_str()),
        (200, Some("replay")),
        "{again}"
    );
    let (_, feed) = gate.read("/v1/aggregates/a-1/applied").await;
    assert_eq!(feed["messages"][0]["type"], PLACED);
    assert_eq!(
        feed["messages"][0]["payload"],
        json!({"amount": 5, "orderId": "o-1"})
    );
    assert_eq!(feed["next"], 1);
    gate.stop().await;
}

async fn a_message_ahead_of_its_turn_is_a_gap_and_applies_once_its_predecessor_did(
    backend: Backend,
) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200);
    let (status, gap) = gate.deliver(&producer, "a-1", &placed("a-1", 3, 5)).await;
    assert_eq!(status, 409, "{gap}");
    assert_eq!(
        (gap["outcome"].as_str(), gap["expected"].as_i64()),
        (Some("gap"), Some(2))
    );
    assert_eq!(gap["retryable"], true);
    let (_, gaps) = gate.read("/v1/aggregates/a-1/gaps").await;
    assert_eq!(gaps["missing"], json!({"from": 2, "through": 2}), "{gaps}");
    for sequence in [2, 3] {
        let (status, body) = gate
            .deliver(&producer, "a-1", &placed("a-1", sequence, 5))
            .await;
        assert_eq!(
            (status, body["outcome"].as_str()),
            (200, Some("applied")),
            "{body}"
        );
    }
    assert_eq!(gate.applied_sequences("a-1").await, vec![1, 2, 3]);
    gate.stop().await;
}

async fn a_payload_its_schema_refuses_is_quarantined_with_the_validators_reason(backend: Backend) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, body) = gate.deliver(&producer, "a-1", &placed("a-1", 1, -5)).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["outcome"], "quarantined");
    let reason = body["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("payload does not match the schema of 'order.placed': at '/amount'"),
        "{reason}"
    );
    let (status, dead_letters) = gate.read("/v1/deadletters?status=open").await;
    assert_eq!(status, 200);
    let dead_letter = &dead_letters["deadLetters"][0];
    assert_eq!(dead_letter["reason"].as_str(), Some(reason));
    assert_eq!(
        dead_letter["payload"],
        json!({"type": PLACED, "payload": {"orderId": "o-1", "amount": -5}}),
        "the stored envelope"
    );
    assert!(gate.applied_sequences("a-1").await.is_empty());
    gate.stop().await;
}

#[tokio::test]
async fn a_body_over_the_payload_limit_is_413_naming_the_limit() {
    let options = Options {
        max_payload_bytes: 512,
        ..Options::default()
    };
    let gate = spawn_gate(Backend::Sqlite, options).await;
    let producer = gate.producer("orders").await;
    let mut body = placed("a-1", 1, 5);
    body["payload"]["note"] = json!("x".repeat(600));
    let response = gate
        .deliver_as(&producer, producer.epoch, "a-1", &body)
        .await;
    assert_eq!(content_type(&response), "application/problem+json");
    let (status, problem) = status_and_json(response).await;
    assert_eq!(status, 413, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("512 bytes")),
        "{problem}"
    );
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200, "a body within the limit still applies");
    gate.stop().await;
}

#[tokio::test]
async fn a_request_shape_error_names_the_member_that_is_wrong() {
    let gate = spawn_gate(Backend::Sqlite, Options::default()).await;
    let producer = gate.producer("orders").await;
    for (body, member) in [
        (
            json!({"messageId": "m", "sequence": 0, "type": PLACED, "payload": {}}),
            "sequence",
        ),
        (
            json!({"messageId": "m", "sequence": 1, "type": "has space", "payload": {}}),
            "type",
        ),
        (
            json!({"messageId": "m", "sequence": 1, "type": PLACED}),
            "payload",
        ),
        (
            json!({"messageId": "", "sequence": 1, "type": PLACED, "payload": {}}),
            "messageId",
        ),
    ] {
        let (status, problem) = gate.deliver(&producer, "a-1", &body).await;
        assert_eq!(status, 400, "{problem}");
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|detail| detail.contains(member)),
            "{member}: {problem}"
        );
    }
    gate.stop().await;
}

async fn a_delivery_under_a_fenced_epoch_is_refused_and_writes_nothing(backend: Backend) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let newer = gate.session(&producer.token).await;
    assert_eq!(newer, producer.epoch + 1);
    let response = gate
        .deliver_as(&producer, producer.epoch, "a-1", &placed("a-1", 1, 5))
        .await;
    assert_eq!(content_type(&response), "application/problem+json");
    let (status, problem) = status_and_json(response).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["outcome"], "fenced");
    assert_eq!(problem["currentEpoch"], newer);
    assert!(gate.applied_sequences("a-1").await.is_empty());
    gate.stop().await;
}

#[tokio::test]
async fn a_producer_over_its_rate_gets_429_with_a_retry_after_of_whole_seconds() {
    let options = Options {
        rate: rate(1, 2),
        ..Options::default()
    };
    let gate = spawn_gate(Backend::Sqlite, options).await;
    let producer = gate.producer("orders").await;
    for sequence in [1, 2] {
        let (status, body) = gate
            .deliver(&producer, "a-1", &placed("a-1", sequence, 5))
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let response = gate
        .deliver_as(&producer, producer.epoch, "a-1", &placed("a-1", 3, 5))
        .await;
    assert_eq!(response.status(), 429);
    let retry_after: u64 = response
        .headers()
        .get("retry-after")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .expect("a Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let (_, problem) = status_and_json(response).await;
    assert_eq!(problem["outcome"], "rate limited");
    assert_eq!(gate.applied_sequences("a-1").await, vec![1, 2]);
    gate.stop().await;
}

#[tokio::test]
async fn reader_routes_answer_401_without_a_token_and_200_with_a_readers_or_an_operators() {
    let gate = spawn_gate(Backend::Sqlite, Options::default()).await;
    let producer = gate.producer("orders").await;
    gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    let routes = [
        "/v1/aggregates?status=flowing",
        "/v1/aggregates/a-1",
        "/v1/aggregates/a-1/timeline",
        "/v1/aggregates/a-1/gaps",
        "/v1/aggregates/a-1/applied",
        "/v1/deadletters",
        "/v1/resolutions",
    ];
    for route in routes {
        let anonymous = gate
            .client
            .get(gate.url(route))
            .send()
            .await
            .expect("a read");
        assert_eq!(anonymous.status(), 401, "{route}");
        assert!(
            anonymous.headers().contains_key("www-authenticate"),
            "{route}"
        );
        let wrong = gate
            .client
            .get(gate.url(route))
            .bearer_auth("not-a-token")
            .send()
            .await
            .expect("a read");
        assert_eq!(wrong.status(), 401, "{route}");
        let (status, body) = gate.read(route).await;
        assert_eq!(status, 200, "{route}: {body}");
        let (status, body) = gate.as_operator(reqwest::Method::GET, route, None).await;
        assert_eq!(status, 200, "{route}: {body}");
    }
    let (_, inventory) = gate.read("/v1/aggregates?status=flowing").await;
    assert_eq!(
        inventory["aggregates"][0]["aggregateId"], "a-1",
        "{inventory}"
    );
    let (_, aggregate) = gate.read("/v1/aggregates/a-1").await;
    assert_eq!(aggregate["owner"]["producer"], "orders", "{aggregate}");
    let (status, _) = status_and_json(
        gate.client
            .get(gate.url("/v1/producers"))
            .bearer_auth(READER_TOKEN)
            .send()
            .await
            .expect("a read"),
    )
    .await;
    assert_eq!(status, 401, "a reader does not administer");
    gate.stop().await;
}

async fn an_operators_replacement_applies_the_quarantined_message_and_the_held_back_next_then_applies(
    backend: Backend,
) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, -5)).await;
    assert_eq!(status, 422);
    let (status, held_back) = gate.deliver(&producer, "a-1", &placed("a-1", 2, 5)).await;
    assert_eq!(
        status, 409,
        "the aggregate waits for its sequence 1: {held_back}"
    );
    let decision = json!({
        "action": "replace",
        "expectedLast": 0,
        "reason": "the amount was negated upstream",
        "replacement": {"type": PLACED, "payload": {"orderId": "o-1", "amount": 5}},
    });
    let (status, resolved) = gate
        .as_operator(
            reqwest::Method::POST,
            "/v1/deadletters/resolution?messageId=a-1-m1&producer=orders",
            Some(decision),
        )
        .await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["outcome"], "resolved");
    assert_eq!(resolved["operator"], "ops");
    assert_eq!(resolved["replacement"]["messageId"], "a-1-m1:replaced");
    let (status, body) = gate.deliver(&producer, "a-1", &placed("a-1", 2, 5)).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    let (_, feed) = gate.read("/v1/aggregates/a-1/applied").await;
    assert_eq!(sequences(&feed), vec![1, 2]);
    assert_eq!(feed["messages"][0]["messageId"], "a-1-m1:replaced");
    assert_eq!(feed["messages"][0]["payload"]["amount"], 5);
    let (_, trail) = gate.read("/v1/resolutions").await;
    assert_eq!(trail["resolutions"][0]["action"], "replace", "{trail}");
    gate.stop().await;
}

/// A skip's resolution by the operator: its status and body.
async fn skip_as_operator(gate: &TestGate, path: &str, decision: Value) -> (u16, i64) {
    let (status, resolved) = gate
        .as_operator(reqwest::Method::POST, path, Some(decision))
        .await;
    assert_eq!(status, 200, "{resolved}");
    let id = resolved["resolutionId"].as_i64();
    (
        status,
        id.unwrap_or_else(|| panic!("a resolution id: {resolved}")),
    )
}

async fn a_dead_letters_skip_and_a_gap_skip_of_three_come_out_as_skip_markers_in_the_applied_feed(
    backend: Backend,
) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200);
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 2, -5)).await;
    assert_eq!(status, 422);
    let (_, dead_letter_skip) = skip_as_operator(
        &gate,
        "/v1/deadletters/resolution?messageId=a-1-m2&producer=orders",
        json!({"action": "skip", "expectedLast": 1, "reason": "a test order"}),
    )
    .await;
    let (status, gap) = gate.deliver(&producer, "a-1", &placed("a-1", 6, 5)).await;
    assert_eq!(status, 409, "{gap}");
    let (_, gap_skip) = skip_as_operator(
        &gate,
        "/v1/aggregates/a-1/gaps/resolution",
        json!({"action": "skip", "from": 3, "through": 5, "expectedLast": 2,
               "reason": "lost upstream"}),
    )
    .await;
    let (status, body) = gate.deliver(&producer, "a-1", &placed("a-1", 6, 5)).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    // A late message for a skipped sequence is still stale, naming the skip.
    let (status, late) = gate.deliver(&producer, "a-1", &placed("a-1", 4, 5)).await;
    assert_eq!(
        (status, late["outcome"].as_str()),
        (409, Some("stale")),
        "{late}"
    );
    assert_eq!(late["skippedBy"], gap_skip, "{late}");

    let (_, feed) = gate.read("/v1/aggregates/a-1/applied?limit=1000").await;
    assert_eq!(sequences(&feed), vec![1, 2, 3, 4, 5, 6], "{feed}");
    let messages = feed["messages"].as_array().expect("messages");
    let types: Vec<&str> = messages
        .iter()
        .map(|message| message["type"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        types,
        [
            PLACED,
            "gate.skipped",
            "gate.skipped",
            "gate.skipped",
            "gate.skipped",
            PLACED
        ]
    );
    assert_eq!(
        messages[1]["messageId"],
        format!("skip:{dead_letter_skip}:2")
    );
    assert_eq!(
        messages[1]["payload"],
        json!({"resolutionId": dead_letter_skip, "operator": "ops", "reason": "a test order"})
    );
    for (index, sequence) in [(2, 3), (3, 4), (4, 5)] {
        assert_eq!(
            messages[index]["messageId"],
            format!("skip:{gap_skip}:{sequence}")
        );
        assert_eq!(
            messages[index]["payload"],
            json!({"resolutionId": gap_skip, "operator": "ops", "reason": "lost upstream"})
        );
    }
    gate.stop().await;
}

async fn a_gap_skip_of_more_than_ten_thousand_sequences_is_refused_and_writes_nothing(
    backend: Backend,
) {
    let gate = spawn_gate(backend, Options::default()).await;
    let producer = gate.producer("orders").await;
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200);
    let path = "/v1/aggregates/a-1/gaps/resolution";
    let skip = |through: i64| {
        json!({"action": "skip", "from": 2, "through": through, "expectedLast": 1,
               "reason": "lost upstream"})
    };
    let (status, refused) = gate
        .as_operator(reqwest::Method::POST, path, Some(skip(10_002)))
        .await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("at most 10000")),
        "{refused}"
    );
    let (_, feed) = gate.read("/v1/aggregates/a-1/applied?limit=1000").await;
    assert_eq!(sequences(&feed), vec![1], "nothing was skipped: {feed}");
    let (_, trail) = gate.read("/v1/resolutions").await;
    assert_eq!(trail["resolutions"], json!([]), "{trail}");
    let (status, resolved) = gate
        .as_operator(reqwest::Method::POST, path, Some(skip(10_001)))
        .await;
    assert_eq!(status, 200, "ten thousand exactly is taken: {resolved}");
    gate.stop().await;
}

async fn the_applied_feed_long_poll_answers_as_soon_as_a_message_applies_and_after_pages_on(
    backend: Backend,
) {
    let gate = Arc::new(spawn_gate(backend, Options::default()).await);
    let producer = gate.producer("orders").await;
    let poll = tokio::spawn({
        let gate = gate.clone();
        async move {
            gate.read("/v1/aggregates/a-1/applied?after=0&waitMs=20000")
                .await
        }
    });
    // Deliver only once the gate holds the poll's request.
    poll_until(
        "the gate received the long poll",
        || async { gate.long_polls_received.load(Ordering::SeqCst) },
        |received| *received >= 1,
    )
    .await;
    assert!(!poll.is_finished(), "nothing applied yet: the poll waits");
    let started = tokio::time::Instant::now();
    let (status, _) = gate.deliver(&producer, "a-1", &placed("a-1", 1, 5)).await;
    assert_eq!(status, 200);
    let (status, feed) = poll.await.expect("the poll");
    assert_eq!(status, 200, "{feed}");
    assert_eq!(sequences(&feed), vec![1], "{feed}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "answered when the message applied, not at the wait's end"
    );
    for sequence in [2, 3] {
        gate.deliver(&producer, "a-1", &placed("a-1", sequence, 5))
            .await;
    }
    let (_, page) = gate
        .read("/v1/aggregates/a-1/applied?after=1&limit=1")
        .await;
    assert_eq!(
        (sequences(&page), page["next"].as_i64()),
        (vec![2], Some(2))
    );
    let (_, page) = gate
        .read("/v1/aggregates/a-1/applied?after=2&waitMs=1")
        .await;
    assert_eq!(
        (sequences(&page), page["next"].as_i64()),
        (vec![3], Some(3))
    );
    let (_, empty) = gate
        .read("/v1/aggregates/a-1/applied?after=3&waitMs=50")
        .await;
    assert_eq!(
        (sequences(&empty), empty["next"].as_i64()),
        (vec![], Some(3))
    );
    let (status, _) = gate.read("/v1/aggregates/a-1/applied?waitMs=30001").await;
    assert_eq!(status, 400);
    if let Ok(gate) = Arc::try_unwrap(gate) {
        gate.stop().await;
    }
}

async fn sixteen_concurrent_producer_tasks_never_see_a_5xx_and_the_feed_is_exactly_one_to_n(
    backend: Backend,
) {
    const TASKS: i64 = 16;
    const EACH: i64 = 4;
    let gate = Arc::new(spawn_gate(backend, Options::default()).await);
    let producer = Arc::new(gate.producer("orders").await);
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (gate, producer) = (gate.clone(), producer.clone());
            tokio::spawn(async move {
                for round in 0..EACH {
                    deliver_until_applied(&gate, &producer, round * TASKS + task + 1).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a producer task");
    }
    let expected: Vec<i64> = (1..=TASKS * EACH).collect();
    assert_eq!(gate.applied_sequences("a-1").await, expected);
    if let Ok(gate) = Arc::try_unwrap(gate) {
        gate.stop().await;
    }
}

/// Delivers `sequence` of `a-1` until it applies; after a gap it waits, on the applied feed's
/// long poll, for the sequence before it.
async fn deliver_until_applied(gate: &TestGate, producer: &Producer, sequence: i64) {
    loop {
        let (status, body) = gate
            .deliver(producer, "a-1", &placed("a-1", sequence, 1))
            .await;
        assert!(status < 500, "{status}: {body}");
        match body["outcome"].as_str() {
            Some("applied") | Some("replay") => return,
            Some("gap") => {
                let previous = sequence - 1;
                let path = format!(
                    "/v1/aggregates/a-1/applied?after={}&limit=1&waitMs=5000",
                    previous - 1
                );
                let (status, feed) = gate.read(&path).await;
                assert_eq!(status, 200, "{feed}");
            }
            _ => panic!("{status}: {body}"),
        }
    }
}

#[tokio::test]
async fn a_poison_message_over_a_full_quarantine_gets_429_with_a_retry_after() {
    let options = Options {
        limits: Limits {
            max_open_dead_letters: 1,
            ..Limits::default()
        },
        ..Options::default()
    };
    let gate = spawn_gate(Backend::Sqlite, options).await;
    let producer = gate.producer("orders").await;
    let (status, body) = gate
        .deliver(&producer, "full", &placed("full", 1, -1))
        .await;
    assert_eq!(status, 422, "{body}");
    let mut second = placed("full", 1, -2);
    second["messageId"] = json!("full-m1-again");
    let response = gate
        .deliver_as(&producer, producer.epoch, "full", &second)
        .await;
    assert_eq!(response.status(), 429);
    let retry_after: u64 = response
        .headers()
        .get("retry-after")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .expect("a Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let (_, problem) = status_and_json(response).await;
    assert_eq!(problem["outcome"], "quarantine full", "{problem}");
    gate.stop().await;
}

/// The aggregate ids of an inventory page, in its order.
fn listed(page: &Value) -> Vec<&str> {
    page["aggregates"]
        .as_array()
        .expect("aggregates")
        .iter()
        .filter_map(|entry| entry["aggregateId"].as_str())
        .collect()
}

#[tokio::test]
async fn the_inventory_without_a_status_lists_blocked_then_waiting_then_flowing_paged() {
    let gate = spawn_gate(Backend::Sqlite, Options::default()).await;
    let producer = gate.producer("orders").await;
    // Each status's aggregates in the order they entered it: the longest-standing first.
    let deliveries = [
        ("flowing-1", 1, 5, 200),
        ("waiting-1", 1, 5, 200),
        ("waiting-1", 3, 5, 409),
        ("blocked-1", 1, 5, 200),
        ("blocked-1", 2, -1, 422),
        ("flowing-2", 1, 5, 200),
        ("blocked-2", 1, 5, 200),
        ("blocked-2", 2, -1, 422),
        ("waiting-2", 1, 5, 200),
        ("waiting-2", 3, 5, 409),
    ];
    for (aggregate, sequence, amount, verdict) in deliveries {
        let (status, body) = gate
            .deliver(&producer, aggregate, &placed(aggregate, sequence, amount))
            .await;
        assert_eq!(status, verdict, "{aggregate} {sequence}: {body}");
    }
    let (status, all) = gate.read("/v1/aggregates").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(
        listed(&all),
        [
            "blocked-1",
            "blocked-2",
            "waiting-1",
            "waiting-2",
            "flowing-1",
            "flowing-2"
        ]
    );
    assert_eq!(all["status"], Value::Null);
    assert_eq!(all["next"], Value::Null);

    // Paged as with a status: `next` is the following page's `after`.
    let (_, first) = gate.read("/v1/aggregates?limit=4").await;
    assert_eq!(
        listed(&first),
        ["blocked-1", "blocked-2", "waiting-1", "waiting-2"]
    );
    assert_eq!(first["next"], 4);
    let (_, rest) = gate.read("/v1/aggregates?limit=4&after=4").await;
    assert_eq!(listed(&rest), ["flowing-1", "flowing-2"]);
    assert_eq!(rest["next"], Value::Null);

    // A status still filters, and an unknown one is still a 400.
    let (_, waiting) = gate.read("/v1/aggregates?status=waiting").await;
    assert_eq!(listed(&waiting), ["waiting-1", "waiting-2"]);
    let (status, problem) = gate.read("/v1/aggregates?status=stuck").await;
    assert_eq!(status, 400, "{problem}");
    gate.stop().await;
}

/// The gate's input over NATS as its consumer delivers: through the broker's door, where a
/// message ahead of its turn is held. Asserts it applied (`held`: false) or was held (true).
async fn deliver_through_the_broker(gate: &TestGate, aggregate: &str, message: Value, held: bool) {
    let input: GateMessageInput = serde_json::from_value(message).expect("a message's body");
    let message = input
        .validate(aggregate.to_owned())
        .expect("a valid message");
    let outcome = gate
        .inbox
        .deliver_as(message, Door::Broker, None)
        .await
        .expect("the store answers")
        .expect("an anonymous delivery is admitted");
    let as_expected = if held {
        matches!(outcome, Outcome::Held { .. })
    } else {
        matches!(outcome, Outcome::Applied { .. })
    };
    assert!(as_expected, "{aggregate}: {outcome:?}");
}

fn typed(aggregate: &str, sequence: i64, message_type: &str) -> Value {
    let mut message = placed(aggregate, sequence, 5);
    message["type"] = json!(message_type);
    message
}

/// The inventory's `overdue` for each aggregate it lists.
fn overdue_flags(inventory: &Value) -> Vec<(String, bool)> {
    inventory["aggregates"]
        .as_array()
        .expect("aggregates")
        .iter()
        .map(|entry| {
            (
                entry["aggregateId"].as_str().unwrap_or_default().to_owned(),
                entry["overdue"].as_bool().expect("overdue is a boolean"),
            )
        })
        .collect()
}

/// `gate_aggregates_overdue` on `/metrics`, if the scrape has it.
async fn overdue_gauge(gate: &TestGate) -> Option<f64> {
    let text = gate
        .client
        .get(gate.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("gate_aggregates_overdue "))
        .and_then(|value| value.trim().parse().ok())
}

async fn a_waiting_aggregate_past_its_held_successors_gap_alert_is_marked_overdue_and_counted(
    backend: Backend,
) {
    let options = Options {
        gap_alerts: vec![
            (PLACED.to_owned(), Duration::from_millis(1)),
            ("order.audited".to_owned(), Duration::from_secs(3600)),
        ],
        ..Options::default()
    };
    let gate = spawn_gate(backend, options).await;
    // late: its lowest held successor is an order.placed, whose alert is 1 ms.
    // untimed: its lowest held successor's type sets no alert (the order.placed above it does
    // not count: the lowest decides).
    // refused: waits after the HTTP door refused the gap, so nothing is held.
    for aggregate in ["late", "untimed"] {
        deliver_through_the_broker(&gate, aggregate, placed(aggregate, 1, 5), false).await;
    }
    deliver_through_the_broker(&gate, "late", placed("late", 3, 5), true).await;
    deliver_through_the_broker(&gate, "untimed", typed("untimed", 3, NOTED), true).await;
    deliver_through_the_broker(&gate, "untimed", placed("untimed", 4, 5), true).await;
    let producer = gate.producer("orders").await;
    let (status, _) = gate
        .deliver(&producer, "refused", &placed("refused", 1, 5))
        .await;
    assert_eq!(status, 200);
    let (status, _) = gate
        .deliver(&producer, "refused", &placed("refused", 3, 5))
        .await;
    assert_eq!(status, 409, "the HTTP door refuses a gap");

    let inventory = poll_until(
        "the late aggregate is overdue",
        || async { gate.read("/v1/aggregates?status=waiting").await.1 },
        |inventory| {
            overdue_flags(inventory)
                .iter()
                .any(|(id, overdue)| id == "late" && *overdue)
        },
    )
    .await;
    let mut flags = overdue_flags(&inventory);
    flags.sort();
    assert_eq!(
        flags,
        [
            ("late".to_owned(), true),
            ("refused".to_owned(), false),
            ("untimed".to_owned(), false)
        ],
        "{inventory}"
    );
    let counted = poll_until(
        "the scrape counts the overdue aggregate",
        || overdue_gauge(&gate),
        |gauge| gauge.is_some(),
    )
    .await;
    assert_eq!(counted, Some(1.0));
    gate.stop().await;
}

#[tokio::test]
async fn an_aggregate_within_its_successors_gap_alert_is_not_overdue_nor_counted() {
    let options = Options {
        gap_alerts: vec![(PLACED.to_owned(), Duration::from_secs(3600))],
        ..Options::default()
    };
    let gate = spawn_gate(Backend::Sqlite, options).await;
    deliver_through_the_broker(&gate, "patient", placed("patient", 1, 5), false).await;
    deliver_through_the_broker(&gate, "patient", placed("patient", 3, 5), true).await;
    let (status, inventory) = gate.read("/v1/aggregates?status=waiting").await;
    assert_eq!(status, 200, "{inventory}");
    assert_eq!(
        overdue_flags(&inventory),
        [("patient".to_owned(), false)],
        "{inventory}"
    );
    assert_eq!(inventory["aggregates"][0]["held"], 1, "{inventory}");
    assert_eq!(overdue_gauge(&gate).await, Some(0.0));
    let (_, document) = gate.read("/v1/openapi.json").await;
    let entry = &document["components"]["schemas"]["GateInventoryEntry"];
    assert!(
        entry.to_string().contains(r#""overdue":{"#),
        "the document describes overdue: {entry}"
    );
    gate.stop().await;
}
