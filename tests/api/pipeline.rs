//! The idempotent conditional pipeline over real HTTP: preconditions, receipts, the lost-success
//! retry and the rows behind them (documents, pipeline_requests, outbox).

use serde_json::{Value, json};

use crate::helpers::{TestApp, assert_bad_request, spawn_app, status_and_json};

/// Sends `POST /pipeline{query}` with the given key and If-Match (either may be omitted).
async fn send(
    app: &TestApp,
    query: &str,
    key: Option<&str>,
    if_match: Option<&str>,
    quantity: i64,
) -> reqwest::Response {
    let mut request = app
        .client
        .post(app.url(&format!("/pipeline{query}")))
        .json(&json!({"quantity": quantity}));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(if_match) = if_match {
        request = request.header("If-Match", if_match);
    }
    request.send().await.expect("POST reaches the server")
}

async fn pipeline(
    app: &TestApp,
    key: &str,
    if_match: &str,
    quantity: i64,
) -> (u16, Option<String>, Value) {
    let response = send(app, "", Some(key), Some(if_match), quantity).await;
    let etag = response
        .headers()
        .get("etag")
        .map(|value| value.to_str().unwrap().to_owned());
    let (status, body) = status_and_json(response).await;
    (status, etag, body)
}

async fn state(app: &TestApp) -> Value {
    let (status, body) = status_and_json(app.get("/pipeline/state").await).await;
    assert_eq!(status, 200);
    body
}

fn document(app: &TestApp) -> (String, i64) {
    app.db()
        .query_row(
            "SELECT body, version FROM documents WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
}

fn receipts(app: &TestApp) -> Vec<(String, String, i64)> {
    app.rows(
        "SELECT request_id, payload, result_version FROM pipeline_requests ORDER BY request_id",
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
}

fn events(app: &TestApp) -> Vec<(String, String, i64, String)> {
    app.rows(
        "SELECT event_key, aggregate_id, sequence, payload FROM outbox ORDER BY id",
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )
}

/// The receipt the seed stores for `{"quantity":1}` with `If-Match: "v1"`.
const RECEIPT_Q1_V1: &str = r#"{"Quantity":1,"condition":"\u0022v1\u0022"}"#;

#[tokio::test]
async fn a_matching_request_updates_the_document_with_its_receipt_and_event() {
    let app = spawn_app().await;
    assert_eq!(
        state(&app).await,
        json!({"version": 1, "requests": 0, "events": 0})
    );

    let (status, etag, body) = pipeline(&app, "demo", "\"v1\"", 1).await;
    assert_eq!(status, 200);
    assert_eq!(etag.as_deref(), Some("\"v2\""));
    assert_eq!(body, json!({"version": 2, "replay": false}));

    assert_eq!(document(&app), ("quantity:1".to_owned(), 2));
    assert_eq!(
        receipts(&app),
        [("demo".to_owned(), RECEIPT_Q1_V1.to_owned(), 2)]
    );
    assert_eq!(
        events(&app),
        [(
            "document-1-v2".to_owned(),
            "document-1".to_owned(),
            2,
            RECEIPT_Q1_V1.to_owned()
        )]
    );
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );
}

#[tokio::test]
async fn an_exact_retry_is_a_replay_that_changes_nothing() {
    let app = spawn_app().await;
    assert_eq!(pipeline(&app, "demo", "\"v1\"", 1).await.0, 200);

    let (status, etag, body) = pipeline(&app, "demo", "\"v1\"", 1).await;
    assert_eq!(status, 200);
    assert_eq!(etag, None);
    assert_eq!(body, json!({"version": 2, "replay": true}));
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );
}

#[tokio::test]
async fn a_lost_success_is_committed_and_recovered_by_an_exact_retry() {
    let app = spawn_app().await;

    let response = send(
        &app,
        "?failAfterCommit=true",
        Some("demo"),
        Some("\"v1\""),
        1,
    )
    .await;
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("etag").is_none());
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["title"],
        "Controlled lost-success response after commit"
    );
    // The work was committed although the caller was told it failed.
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );

    let (status, _, body) = pipeline(&app, "demo", "\"v1\"", 1).await;
    assert_eq!((status, body), (200, json!({"version": 2, "replay": true})));
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );
}

#[tokio::test]
async fn a_changed_request_under_a_used_key_is_a_conflict() {
    let app = spawn_app().await;
    assert_eq!(pipeline(&app, "demo", "\"v1\"", 1).await.0, 200);

    let conflict = json!({"error": "Request changed or the saved receipt is no longer current"});
    // Other quantity, or other condition text (even one that would pass): not the same request.
    assert_eq!(
        pipeline(&app, "demo", "\"v1\"", 2).await,
        (409, None, conflict.clone())
    );
    assert_eq!(
        pipeline(&app, "demo", "\"v2\"", 1).await,
        (409, None, conflict.clone())
    );
    assert_eq!(pipeline(&app, "demo", "*", 1).await, (409, None, conflict));
    assert_eq!(document(&app), ("quantity:1".to_owned(), 2));
}

#[tokio::test]
async fn a_receipt_is_not_replayed_once_the_document_has_moved_on() {
    let app = spawn_app().await;
    assert_eq!(pipeline(&app, "demo", "\"v1\"", 1).await.0, 200);
    assert_eq!(
        pipeline(&app, "second", "\"v2\"", 3).await.1.as_deref(),
        Some("\"v3\"")
    );

    let (status, _, body) = pipeline(&app, "demo", "\"v1\"", 1).await;
    assert_eq!(status, 409);
    assert_eq!(
        body,
        json!({"error": "Request changed or the saved receipt is no longer current"})
    );
    assert_eq!(document(&app), ("quantity:3".to_owned(), 3));
    assert_eq!(
        state(&app).await,
        json!({"version": 3, "requests": 2, "events": 2})
    );
}

#[tokio::test]
async fn a_stale_or_weak_tag_fails_the_precondition_and_writes_nothing() {
    let app = spawn_app().await;
    for stale in ["\"v0\"", "\"v2\"", "W/\"v1\"", "\"V1\""] {
        let response = send(&app, "", Some("second"), Some(stale), 1).await;
        assert_eq!(response.status(), 412, "{stale}");
    }
    assert_eq!(
        state(&app).await,
        json!({"version": 1, "requests": 0, "events": 0})
    );
    assert_eq!(document(&app), ("rune".to_owned(), 1));
}

#[tokio::test]
async fn a_list_or_a_star_passes_and_is_recorded_as_sent() {
    let app = spawn_app().await;
    let (status, etag, _) = pipeline(&app, "demo", "\"v0\", W/\"v1\" ,\"v1\"", 2).await;
    assert_eq!((status, etag.as_deref()), (200, Some("\"v2\"")));
    let (status, etag, _) = pipeline(&app, "second", "*", 4).await;
    assert_eq!((status, etag.as_deref()), (200, Some("\"v3\"")));

    assert_eq!(
        receipts(&app),
        [
            (
                "demo".to_owned(),
                r#"{"Quantity":2,"condition":"\u0022v0\u0022,W/\u0022v1\u0022,\u0022v1\u0022"}"#
                    .to_owned(),
                2
            ),
            (
                "second".to_owned(),
                r#"{"Quantity":4,"condition":"*"}"#.to_owned(),
                3
            ),
        ]
    );
    assert_eq!(
        events(&app)
            .into_iter()
            .map(|event| event.0)
            .collect::<Vec<_>>(),
        ["document-1-v2", "document-1-v3"]
    );
}

#[tokio::test]
async fn a_missing_if_match_is_precondition_required() {
    let app = spawn_app().await;
    let response = send(&app, "", Some("demo"), None, 1).await;
    assert_eq!(response.status(), 428);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], 428);
    // An empty list is no condition either.
    assert_eq!(
        send(&app, "", Some("demo"), Some(" , "), 1).await.status(),
        428
    );
    assert_eq!(state(&app).await["requests"], 0);
}

#[tokio::test]
async fn bad_requests_are_checked_in_the_seed_order() {
    let app = spawn_app().await;
    // Quantity first: even without a key or a condition.
    assert_bad_request(send(&app, "", None, None, 0).await).await;
    assert_bad_request(send(&app, "", Some("demo"), Some("\"v1\""), 11).await).await;
    // Then the key, before If-Match is looked at.
    assert_bad_request(send(&app, "", None, None, 1).await).await;
    assert_bad_request(send(&app, "", Some("third"), Some("\"v1\""), 1).await).await;
    assert_bad_request(send(&app, "", Some("Demo"), Some("\"v1\""), 1).await).await;
    // Then the condition's syntax, before its absence would be 428.
    for malformed in ["v1", "\"v1", "*, \"v1\"", "w/\"v1\""] {
        assert_bad_request(send(&app, "", Some("demo"), Some(malformed), 1).await).await;
    }
    // Two keys are not one key.
    let response = app
        .client
        .post(app.url("/pipeline"))
        .json(&json!({"quantity": 1}))
        .header("Idempotency-Key", "demo")
        .header("Idempotency-Key", "demo")
        .header("If-Match", "\"v1\"")
        .send()
        .await
        .unwrap();
    assert_bad_request(response).await;
    // Body and query shape.
    let response = app
        .client
        .post(app.url("/pipeline"))
        .header("Idempotency-Key", "demo")
        .header("If-Match", "\"v1\"")
        .header("content-type", "application/json")
        .body(r#"{"quantity":"one"}"#)
        .send()
        .await
        .unwrap();
    assert_bad_request(response).await;
    assert_bad_request(
        send(
            &app,
            "?failAfterCommit=sometimes",
            Some("demo"),
            Some("\"v1\""),
            1,
        )
        .await,
    )
    .await;

    assert_eq!(
        state(&app).await,
        json!({"version": 1, "requests": 0, "events": 0})
    );
}

#[tokio::test]
async fn concurrent_requests_with_the_same_tag_succeed_exactly_once() {
    let app = spawn_app().await;

    let (first, second) = tokio::join!(
        pipeline(&app, "demo", "\"v1\"", 1),
        pipeline(&app, "second", "\"v1\"", 2)
    );
    let mut statuses = [first.0, second.0];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 412], "{first:?} {second:?}");
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );
    let winner_quantity = if first.0 == 200 { 1 } else { 2 };
    assert_eq!(document(&app), (format!("quantity:{winner_quantity}"), 2));
}

#[tokio::test]
async fn concurrent_identical_requests_apply_once_and_replay_the_rest() {
    let app = spawn_app().await;

    let requests = (0..6).map(|_| pipeline(&app, "demo", "\"v1\"", 1));
    let results = futures_util::future::join_all(requests).await;
    let applied = results
        .iter()
        .filter(|result| result.2 == json!({"version": 2, "replay": false}))
        .count();
    let replayed = results
        .iter()
        .filter(|result| result.2 == json!({"version": 2, "replay": true}))
        .count();
    assert_eq!((applied, replayed), (1, 5), "{results:?}");
    assert_eq!(
        state(&app).await,
        json!({"version": 2, "requests": 1, "events": 1})
    );
}
