//! The worker lab over real HTTP: a bounded queue of four in front of one background worker,
//! 429 when full, a scope per item that is always disposed, client disconnects that cancel the
//! item, and a shutdown that answers everything still queued.

use std::collections::HashSet;

use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::helpers::{TestApp, assert_bad_request, client, poll_until, spawn_app, status_and_json};

async fn evidence_at(client: &reqwest::Client, url: &str) -> Value {
    status_and_json(
        client
            .get(format!("{url}/worker/evidence"))
            .send()
            .await
            .expect("evidence"),
    )
    .await
    .1
}

async fn queue_at(client: &reqwest::Client, url: &str) -> Value {
    status_and_json(
        client
            .get(format!("{url}/lab/worker/queue"))
            .send()
            .await
            .expect("queue state"),
    )
    .await
    .1
}

async fn evidence(app: &TestApp) -> Value {
    evidence_at(&app.client, &app.address).await
}

/// Sends `POST /worker` as a task of its own, so the test can wait for it, or drop it to
/// disconnect.
fn spawn_post(client: &reqwest::Client, url: &str, value: i64) -> JoinHandle<(u16, Value)> {
    let request = client
        .post(format!("{url}/worker"))
        .json(&json!({"value": value}));
    tokio::spawn(async move { status_and_json(request.send().await.expect("POST /worker")).await })
}

fn balanced(evidence: &Value) -> bool {
    evidence["created"] == evidence["disposed"] && evidence["live"] == 0
}

#[tokio::test]
async fn a_value_is_doubled_inside_a_scope_of_its_own() {
    let app = spawn_app().await;
    assert_eq!(
        status_and_json(app.post_json("/worker", &json!({"value": 3})).await).await,
        (200, json!({"value": 6, "scopeId": 1}))
    );
    assert_eq!(
        status_and_json(app.post_json("/worker", &json!({"Value": 10})).await).await,
        (200, json!({"value": 20, "scopeId": 2}))
    );
    assert_eq!(
        evidence(&app).await,
        json!({"created": 2, "disposed": 2, "live": 0})
    );
}

#[tokio::test]
async fn every_bad_work_request_is_a_400_problem_and_never_reaches_the_worker() {
    let app = spawn_app().await;
    for body in [
        json!({"value": 0}),
        json!({"value": 11}),
        json!({"value": -1}),
        json!({"value": "3"}),
        json!({"value": 2.5}),
        json!({"value": null}),
        json!({}),
        json!([3]),
    ] {
        assert_bad_request(app.post_json("/worker", &body).await).await;
    }
    assert_bad_request(
        app.post_raw("/worker", "application/json", r#"{"value":"#)
            .await,
    )
    .await;
    assert_bad_request(
        app.post_raw("/worker", "text/plain", r#"{"value":3}"#)
            .await,
    )
    .await;
    assert_bad_request(app.post("/lab/worker/gate/shut").await).await;
    assert_eq!(
        evidence(&app).await,
        json!({"created": 0, "disposed": 0, "live": 0})
    );
}

#[tokio::test]
async fn a_burst_of_forty_gets_only_200_or_429_and_every_scope_is_disposed() {
    let app = spawn_app().await;
    let posts: Vec<_> = (0..40)
        .map(|i| spawn_post(&app.client, &app.address, i % 10 + 1))
        .collect();
    let mut accepted = 0;
    let mut scope_ids = HashSet::new();
    for (i, post) in posts.into_iter().enumerate() {
        let (status, body) = post.await.expect("post task");
        match status {
            200 => {
                accepted += 1;
                let sent = i64::try_from(i % 10 + 1).unwrap();
                assert_eq!(body["value"], sent * 2, "{body}");
                assert!(
                    scope_ids.insert(body["scopeId"].as_u64().expect("scopeId")),
                    "each item gets a scope of its own: {body}"
                );
            }
            429 => assert_eq!(body["status"], 429, "a 429 is a problem: {body}"),
            other => panic!("a burst answers only 200 or 429, got {other} {body}"),
        }
    }
    assert!(accepted >= 1, "the worker accepts at least one item");
    let evidence = poll_until("the evidence balances", || evidence(&app), balanced).await;
    assert_eq!(evidence["created"], accepted, "{evidence}");
}

#[tokio::test]
async fn with_the_gate_closed_one_held_item_and_four_queued_make_the_sixth_a_429() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/worker/gate/close").await.status(), 204);

    let held = spawn_post(&app.client, &app.address, 1);
    poll_until(
        "the worker holds the first item in its scope",
        || evidence(&app),
        |e| e["live"] == 1,
    )
    .await;
    let queued: Vec<_> = (2..=5)
        .map(|value| spawn_post(&app.client, &app.address, value))
        .collect();
    let queue = poll_until(
        "four items wait in the queue",
        || queue_at(&app.client, &app.address),
        |q| q["queued"] == 4,
    )
    .await;
    assert_eq!(queue, json!({"capacity": 4, "queued": 4, "gate": "closed"}));

    let full = app.post_json("/worker", &json!({"value": 6})).await;
    assert_eq!(
        full.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let (status, problem) = status_and_json(full).await;
    assert_eq!(status, 429, "{problem}");
    assert_eq!(problem["title"], "The work queue is full");
    assert!(!held.is_finished() && queued.iter().all(|post| !post.is_finished()));

    assert_eq!(app.post("/lab/worker/gate/open").await.status(), 204);
    let mut scope_ids = HashSet::new();
    for (value, post) in (1..=5).zip(std::iter::once(held).chain(queued)) {
        let (status, body) = post.await.expect("post task");
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["value"], value * 2);
        scope_ids.insert(body["scopeId"].as_u64().expect("scopeId"));
    }
    assert_eq!(scope_ids, (1..=5).collect(), "one scope per accepted item");
    assert_eq!(
        evidence(&app).await,
        json!({"created": 5, "disposed": 5, "live": 0})
    );
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_item_and_the_scope_is_still_disposed() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/worker/gate/close").await.status(), 204);

    // The first item is held by the worker, inside its scope, behind the closed gate.
    let held = spawn_post(&app.client, &app.address, 1);
    poll_until(
        "the worker holds the item",
        || evidence(&app),
        |e| e["live"] == 1,
    )
    .await;
    // Dropping the request future closes the connection: a disconnecting client.
    held.abort();
    // With the gate still closed, only the cancellation can end the work.
    let evidence_after = poll_until(
        "the held item is cancelled and its scope disposed",
        || evidence(&app),
        |e| e["disposed"] == 1,
    )
    .await;
    assert_eq!(
        evidence_after,
        json!({"created": 1, "disposed": 1, "live": 0})
    );

    // Two more hold the worker and wait in the queue, then disconnect too.
    let first = spawn_post(&app.client, &app.address, 2);
    poll_until(
        "the worker holds the next item",
        || evidence(&app),
        |e| e["live"] == 1,
    )
    .await;
    let second = spawn_post(&app.client, &app.address, 3);
    poll_until(
        "one item waits in the queue",
        || queue_at(&app.client, &app.address),
        |q| q["queued"] == 1,
    )
    .await;
    first.abort();
    second.abort();
    let evidence_after = poll_until(
        "both cancelled items have come and gone",
        || evidence(&app),
        |e| e["created"] == 3 && balanced(e),
    )
    .await;
    assert_eq!(
        evidence_after,
        json!({"created": 3, "disposed": 3, "live": 0})
    );

    // The worker is still alive for the next client.
    assert_eq!(app.post("/lab/worker/gate/open").await.status(), 204);
    assert_eq!(
        status_and_json(app.post_json("/worker", &json!({"value": 4})).await).await,
        (200, json!({"value": 8, "scopeId": 4}))
    );
    assert_eq!(
        evidence(&app).await,
        json!({"created": 4, "disposed": 4, "live": 0})
    );
}

#[tokio::test]
async fn shutdown_answers_the_held_and_queued_items_and_disposes_every_scope() {
    let server = spawn_app().await;
    let client = client();
    let url = server.address.clone();
    let closed = client
        .post(server.url("/lab/worker/gate/close"))
        .send()
        .await
        .expect("close the gate");
    assert_eq!(closed.status(), 204);

    let held = spawn_post(&client, &url, 1);
    poll_until(
        "the worker holds the item",
        || evidence_at(&client, &url),
        |e| e["live"] == 1,
    )
    .await;
    let queued: Vec<_> = (2..=5)
        .map(|value| spawn_post(&client, &url, value))
        .collect();
    poll_until(
        "four items wait in the queue",
        || queue_at(&client, &url),
        |q| q["queued"] == 4,
    )
    .await;

    let state = server.state.clone();
    server.stop().await;

    for post in std::iter::once(held).chain(queued) {
        let (status, problem) = post.await.expect("post task");
        assert_eq!(status, 503, "{problem}");
        assert_eq!(problem["title"], "The worker is shutting down");
    }
    let evidence = state.worker.evidence();
    assert_eq!(
        (evidence.created, evidence.disposed, evidence.live),
        (1, 1, 0)
    );
    // The worker ended by itself, not by running out the shutdown grace period.
    assert!(state.tasks.is_empty(), "background tasks still running");
}
