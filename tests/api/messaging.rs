//! The messaging lab over real HTTP: the transactional outbox with leases, the idempotent inbox
//! and the counts, checked against the rows.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::helpers::{
    TestApp, assert_bad_request, poll_until, spawn_app, spawn_app_with, status_and_json,
};

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn counts(app: &TestApp) -> Value {
    let (status, body) = status_and_json(app.get("/messaging/counts").await).await;
    assert_eq!(status, 200);
    body
}

async fn create_order(app: &TestApp, query: &str, quantity: i64) -> reqwest::Response {
    app.post_json(
        &format!("/outbox/orders{query}"),
        &json!({"orderId": "demo", "quantity": quantity}),
    )
    .await
}

async fn claim(app: &TestApp, owner: &str) -> (u16, Value) {
    status_and_json(app.post(&format!("/outbox/claim/{owner}")).await).await
}

async fn ack(app: &TestApp, id: i64, owner: &str, generation: i64) -> (u16, Value) {
    status_and_json(
        app.post(&format!("/outbox/ack/{id}/{owner}?generation={generation}"))
            .await,
    )
    .await
}

async fn deliver(app: &TestApp, query: &str, payload: &str, amount: i64) -> (u16, Value) {
    status_and_json(
        app.post_json(
            &format!("/inbox/apply{query}"),
            &json!({"messageId": "demo", "payload": payload, "amount": amount}),
        )
        .await,
    )
    .await
}

/// Adds pending events straight to the table, as a producer would have committed them.
fn insert_events(app: &TestApp, count: i64) {
    let db = app.db();
    for sequence in 1..=count {
        db.execute(
            "INSERT INTO outbox(event_key, aggregate_id, sequence, payload) VALUES (?1, 'test', ?2, ?3)",
            rusqlite::params![format!("test-{sequence}"), sequence, format!("event:{sequence}")],
        )
        .unwrap();
    }
}

/// Moves an event's lease far into the future, so a step that must happen while the lease is held
/// does not depend on how quickly the test machine schedules it.
fn pin_lease(app: &TestApp, id: i64) {
    app.db()
        .execute(
            "UPDATE outbox SET lease_until = ?1 WHERE id = ?2",
            rusqlite::params![now_millis() + 60_000, id],
        )
        .unwrap();
}

/// A lease short enough for a test to see it run out (the server's default is 500 ms).
const SHORT_LEASE: Duration = Duration::from_millis(50);

/// A fresh server whose claims hold their event for [`SHORT_LEASE`].
async fn spawn_app_with_short_lease() -> TestApp {
    spawn_app_with(|config| config.outbox_lease = SHORT_LEASE).await
}

/// Waits until the lease on event `id` has run out, by the clock the server reads too.
async fn wait_until_lease_expires(app: &TestApp, id: i64) {
    let lease_until = app.scalar(&format!("SELECT lease_until FROM outbox WHERE id = {id}"));
    poll_until(
        "the lease runs out",
        || std::future::ready(now_millis()),
        |now| *now >= lease_until,
    )
    .await;
}

fn outbox_row(app: &TestApp, id: i64) -> (String, Option<String>, i64) {
    app.db()
        .query_row(
            "SELECT status, owner, attempts FROM outbox WHERE id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
}

#[tokio::test]
async fn creating_an_order_commits_the_order_and_its_event_together() {
    let app = spawn_app().await;

    let response = create_order(&app, "", 3).await;
    assert_eq!(response.status(), 201);
    assert_eq!(
        response.headers()["location"].to_str().unwrap(),
        "/outbox/orders/demo"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body, json!({"orderId": "demo", "quantity": 3}));

    let order: (String, i64) = app
        .db()
        .query_row("SELECT order_id, quantity FROM orders", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(order, ("demo".to_owned(), 3));
    let event: (String, String, i64, String, String, Option<String>, Option<i64>, i64) = app
        .db()
        .query_row(
            "SELECT event_key, aggregate_id, sequence, payload, status, owner, lease_until, attempts FROM outbox",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?)),
        )
        .unwrap();
    assert_eq!(
        event,
        (
            "order-demo-v1".to_owned(),
            "demo".to_owned(),
            1,
            "quantity:3".to_owned(),
            "pending".to_owned(),
            None,
            None,
            0
        )
    );
    assert_eq!(
        counts(&app).await,
        json!({"orders": 1, "outbox": 1, "inbox": 0, "effects": 0})
    );
}

#[tokio::test]
async fn a_second_order_create_is_a_conflict_that_changes_nothing() {
    let app = spawn_app().await;
    assert_eq!(create_order(&app, "", 2).await.status(), 201);

    let (status, body) = status_and_json(create_order(&app, "", 5).await).await;
    assert_eq!(status, 409);
    assert_eq!(
        body,
        json!({"error": "Order or event identity already exists"})
    );
    assert_eq!(app.scalar("SELECT quantity FROM orders"), 2);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM outbox"), 1);
}

#[tokio::test]
async fn an_existing_event_key_rolls_back_the_new_order_row() {
    let app = spawn_app().await;
    // The event exists but the order does not: the order insert succeeds, the event insert fails,
    // and the order must not survive on its own.
    app.db()
        .execute(
            "INSERT INTO outbox(event_key, aggregate_id, sequence, payload) VALUES ('order-demo-v1', 'demo', 1, 'quantity:9')",
            [],
        )
        .unwrap();

    let (status, body) = status_and_json(create_order(&app, "", 1).await).await;
    assert_eq!(status, 409);
    assert_eq!(body["error"], "Order or event identity already exists");
    assert_eq!(app.scalar("SELECT COUNT(*) FROM orders"), 0);
}

#[tokio::test]
async fn a_failure_before_commit_leaves_neither_the_order_nor_the_event() {
    let app = spawn_app().await;

    let response = create_order(&app, "?failBeforeCommit=true", 4).await;
    assert_eq!(response.status(), 503);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/problem+json")
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["title"], "Controlled pre-commit failure");
    assert_eq!(
        counts(&app).await,
        json!({"orders": 0, "outbox": 0, "inbox": 0, "effects": 0})
    );

    // The same request without the fault now succeeds: nothing was half-written.
    assert_eq!(
        create_order(&app, "?failBeforeCommit=false", 4)
            .await
            .status(),
        201
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM outbox"), 1);
}

#[tokio::test]
async fn invalid_orders_are_bad_requests() {
    let app = spawn_app().await;
    for body in [
        json!({"orderId": "other", "quantity": 1}),
        json!({"orderId": "demo", "quantity": 0}),
        json!({"orderId": "demo", "quantity": 11}),
        json!({"orderId": "demo"}),
        json!({"orderId": null, "quantity": 1}),
        json!({"orderId": "demo", "quantity": "1"}),
    ] {
        assert_bad_request(app.post_json("/outbox/orders", &body).await).await;
    }
    assert_bad_request(app.post_raw("/outbox/orders", "text/plain", "{}").await).await;
    assert_bad_request(
        app.post_json(
            "/outbox/orders?failBeforeCommit=maybe",
            &json!({"orderId": "demo", "quantity": 1}),
        )
        .await,
    )
    .await;
    assert_eq!(app.scalar("SELECT COUNT(*) FROM orders"), 0);
}

#[tokio::test]
async fn a_claim_leases_the_oldest_pending_event_for_half_a_second() {
    let app = spawn_app().await;
    insert_events(&app, 2);

    let before = now_millis();
    let (status, body) = claim(&app, "one").await;
    let after = now_millis();
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"id": 1, "payload": "event:1", "attempts": 1, "owner": "one"})
    );
    let (owner, lease_until): (String, i64) = app
        .db()
        .query_row(
            "SELECT owner, lease_until FROM outbox WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(owner, "one");
    assert!(
        (before + 500..=after + 500).contains(&lease_until),
        "lease_until {lease_until} is 500 ms after the claim ({before}..{after})"
    );
    assert_eq!(outbox_row(&app, 2), ("pending".to_owned(), None, 0));
}

#[tokio::test]
async fn a_claim_holds_its_event_for_the_configured_lease() {
    let app = spawn_app_with_short_lease().await;
    insert_events(&app, 1);

    let before = now_millis();
    assert_eq!(claim(&app, "one").await.0, 200);
    let after = now_millis();
    let lease_until = app.scalar("SELECT lease_until FROM outbox WHERE id = 1");
    assert!(
        (before + 50..=after + 50).contains(&lease_until),
        "lease_until {lease_until} is 50 ms after the claim ({before}..{after})"
    );
}

#[tokio::test]
async fn a_held_lease_is_not_claimable_and_only_its_holder_can_ack_it() {
    let app = spawn_app().await;
    assert_eq!(create_order(&app, "", 1).await.status(), 201);
    let (status, claimed) = claim(&app, "one").await;
    assert_eq!(status, 200);
    assert_eq!(
        claimed,
        json!({"id": 1, "payload": "quantity:1", "attempts": 1, "owner": "one"})
    );
    pin_lease(&app, 1);

    let (status, body) = claim(&app, "two").await;
    assert_eq!((status, body), (204, Value::Null));

    let refused = json!({"error": "Lease is not currently owned"});
    assert_eq!(ack(&app, 1, "two", 1).await, (409, refused.clone()));
    assert_eq!(ack(&app, 1, "one", 2).await, (409, refused.clone()));
    assert_eq!(ack(&app, 2, "one", 1).await, (409, refused.clone()));
    assert_eq!(outbox_row(&app, 1).0, "pending");

    assert_eq!(ack(&app, 1, "one", 1).await, (204, Value::Null));
    assert_eq!(
        outbox_row(&app, 1),
        ("sent".to_owned(), Some("one".to_owned()), 1)
    );
    // Sent is final: a second ack and further claims find nothing.
    assert_eq!(ack(&app, 1, "one", 1).await, (409, refused));
    assert_eq!(claim(&app, "one").await.0, 204);
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_and_the_stale_owner_is_fenced() {
    let app = spawn_app_with_short_lease().await;
    assert_eq!(create_order(&app, "", 1).await.status(), 201);
    let (status, first) = claim(&app, "one").await;
    assert_eq!(status, 200);
    assert_eq!(first["attempts"], 1);

    wait_until_lease_expires(&app, 1).await;
    let (status, second) = claim(&app, "two").await;
    assert_eq!(status, 200);
    assert_eq!(
        second,
        json!({"id": 1, "payload": "quantity:1", "attempts": 2, "owner": "two"})
    );
    pin_lease(&app, 1);

    // The first owner wakes up and acknowledges with its old generation: refused, whether it
    // names itself or forges the new holder's name with its stale generation.
    let refused = json!({"error": "Lease is not currently owned"});
    assert_eq!(ack(&app, 1, "one", 1).await, (409, refused.clone()));
    assert_eq!(ack(&app, 1, "two", 1).await, (409, refused));
    assert_eq!(
        outbox_row(&app, 1),
        ("pending".to_owned(), Some("two".to_owned()), 2)
    );

    assert_eq!(ack(&app, 1, "two", 2).await, (204, Value::Null));
    assert_eq!(outbox_row(&app, 1).0, "sent");
}

#[tokio::test]
async fn an_expired_lease_cannot_be_acked_even_by_its_owner() {
    let app = spawn_app_with_short_lease().await;
    insert_events(&app, 1);
    assert_eq!(claim(&app, "one").await.0, 200);

    wait_until_lease_expires(&app, 1).await;
    assert_eq!(ack(&app, 1, "one", 1).await.0, 409);
    assert_eq!(outbox_row(&app, 1).0, "pending");
}

#[tokio::test]
async fn concurrent_claims_never_hand_out_the_same_lease_twice() {
    let app = spawn_app().await;
    insert_events(&app, 3);

    let claims = (0..6).map(|index| {
        let owner = if index % 2 == 0 { "one" } else { "two" };
        claim(&app, owner)
    });
    let results = futures_util::future::join_all(claims).await;

    let mut leases = Vec::new();
    for (status, body) in &results {
        match status {
            200 => leases.push((
                body["id"].as_i64().unwrap(),
                body["attempts"].as_i64().unwrap(),
            )),
            204 => {}
            other => panic!("unexpected claim status {other}: {body}"),
        }
    }
    // Three events, so the first three claims to run each find one.
    assert!(leases.len() >= 3, "{results:?}");
    // An (event, generation) pair is one lease: no two claims may share it.
    let mut distinct = leases.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), leases.len(), "{results:?}");
    // Every lease handed out is counted in the rows.
    assert_eq!(
        app.scalar("SELECT SUM(attempts) FROM outbox"),
        leases.len() as i64
    );
}

#[tokio::test]
async fn two_owners_claiming_one_event_at_once_get_it_once() {
    let app = spawn_app().await;
    assert_eq!(create_order(&app, "", 1).await.status(), 201);

    let ((first_status, first), (second_status, second)) =
        tokio::join!(claim(&app, "one"), claim(&app, "two"));
    let mut statuses = [first_status, second_status];
    statuses.sort_unstable();
    if statuses == [200, 200] {
        // Only possible if the first lease had already expired: then it is a new generation.
        assert_ne!(first["attempts"], second["attempts"], "{first} {second}");
    } else {
        assert_eq!(statuses, [200, 204], "{first} {second}");
        assert_eq!(app.scalar("SELECT attempts FROM outbox WHERE id = 1"), 1);
    }
}

#[tokio::test]
async fn bad_claim_and_ack_requests_are_bad_requests() {
    let app = spawn_app().await;
    insert_events(&app, 1);
    assert_bad_request(app.post("/outbox/claim/three").await).await;
    assert_bad_request(app.post("/outbox/ack/1/one").await).await;
    assert_bad_request(app.post("/outbox/ack/1/one?generation=x").await).await;
    assert_eq!(outbox_row(&app, 1), ("pending".to_owned(), None, 0));
}

#[tokio::test]
async fn an_ack_id_that_is_not_a_64_bit_integer_matches_no_route() {
    let app = spawn_app().await;
    insert_events(&app, 1);
    // The seed's route is /outbox/ack/{id:long}/{owner}: anything else is not that route, so
    // the answer is 404, before the generation is even looked at.
    for id in ["first", "1.0", "1e3", "9223372036854775808", "0x1", "%20"] {
        for query in ["?generation=1", ""] {
            let response = app.post(&format!("/outbox/ack/{id}/one{query}")).await;
            let (status, problem) = status_and_json(response).await;
            assert_eq!(status, 404, "{id}{query}: {problem}");
            assert_eq!(problem["title"], "Not Found", "{id}{query}");
        }
    }
    // What long.TryParse accepts does match: a sign, white space around the digits.
    for id in ["%2B1", "%201%20", "-1"] {
        let (status, body) = status_and_json(
            app.post(&format!("/outbox/ack/{id}/one?generation=1"))
                .await,
        )
        .await;
        assert_eq!(status, 409, "{id}: {body}");
    }
    assert_eq!(outbox_row(&app, 1), ("pending".to_owned(), None, 0));
}

#[tokio::test]
async fn the_inbox_applies_a_message_once_and_replays_it_after() {
    let app = spawn_app().await;

    assert_eq!(
        deliver(&app, "", "hello", 2).await,
        (200, json!({"replay": false}))
    );
    assert_eq!(
        deliver(&app, "", "hello", 2).await,
        (200, json!({"replay": true}))
    );
    let stored: (String, String) = app
        .db()
        .query_row("SELECT message_id, payload FROM inbox", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(
        stored,
        (
            "demo".to_owned(),
            r#"{"Payload":"hello","Amount":2}"#.to_owned()
        )
    );
    assert_eq!(
        counts(&app).await,
        json!({"orders": 0, "outbox": 0, "inbox": 1, "effects": 2})
    );
}

#[tokio::test]
async fn the_same_message_id_with_other_content_is_a_conflict() {
    let app = spawn_app().await;
    assert_eq!(deliver(&app, "", "hello", 2).await.0, 200);

    let conflict = (409, json!({"error": "Payload conflict"}));
    assert_eq!(deliver(&app, "", "hello", 3).await, conflict);
    assert_eq!(deliver(&app, "", "Hello", 2).await, conflict);
    assert_eq!(app.scalar("SELECT total FROM effects WHERE id = 1"), 2);
}

#[tokio::test]
async fn a_failed_inbox_delivery_stores_nothing_and_can_be_redelivered() {
    let app = spawn_app().await;

    let (status, body) = deliver(&app, "?failBeforeCommit=True", "hello", 2).await;
    assert_eq!(status, 503);
    assert_eq!(body["title"], "Controlled inbox failure");
    assert_eq!(app.scalar("SELECT COUNT(*) FROM inbox"), 0);
    assert_eq!(app.scalar("SELECT total FROM effects WHERE id = 1"), 0);

    assert_eq!(
        deliver(&app, "", "hello", 2).await,
        (200, json!({"replay": false}))
    );
    assert_eq!(app.scalar("SELECT total FROM effects WHERE id = 1"), 2);
}

#[tokio::test]
async fn payloads_are_stored_with_the_seed_serializer_escaping() {
    let app = spawn_app().await;
    let payload = "<b>\"café\" & 'tea' + `x`</b> 😀";

    assert_eq!(
        deliver(&app, "", payload, 1).await,
        (200, json!({"replay": false}))
    );
    let stored: String = app
        .db()
        .query_row("SELECT payload FROM inbox", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        stored,
        r#"{"Payload":"\u003Cb\u003E\u0022caf\u00E9\u0022 \u0026 \u0027tea\u0027 \u002B \u0060x\u0060\u003C/b\u003E \uD83D\uDE00","Amount":1}"#
    );
    // The same text again is recognised as the same message.
    assert_eq!(
        deliver(&app, "", payload, 1).await,
        (200, json!({"replay": true}))
    );
}

#[tokio::test]
async fn a_row_written_by_the_original_lab_is_replayed_not_conflicted() {
    let app = spawn_app().await;
    // What the .NET fixture stores for payload "a<b" and amount 1.
    app.db()
        .execute(
            r#"INSERT INTO inbox(message_id, payload) VALUES ('demo', '{"Payload":"a\u003Cb","Amount":1}')"#,
            [],
        )
        .unwrap();
    assert_eq!(
        deliver(&app, "", "a<b", 1).await,
        (200, json!({"replay": true}))
    );
}

#[tokio::test]
async fn concurrent_identical_deliveries_have_exactly_one_effect() {
    let app = spawn_app().await;

    let deliveries = (0..8).map(|_| deliver(&app, "", "hello", 3));
    let results = futures_util::future::join_all(deliveries).await;

    let applied = results
        .iter()
        .filter(|result| **result == (200, json!({"replay": false})))
        .count();
    let replayed = results
        .iter()
        .filter(|result| **result == (200, json!({"replay": true})))
        .count();
    assert_eq!((applied, replayed), (1, 7), "{results:?}");
    assert_eq!(app.scalar("SELECT total FROM effects WHERE id = 1"), 3);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM inbox"), 1);
}

#[tokio::test]
async fn invalid_inbox_deliveries_are_bad_requests() {
    let app = spawn_app().await;
    let long = "x".repeat(51);
    for body in [
        json!({"messageId": "other", "payload": "hello", "amount": 1}),
        json!({"messageId": "demo", "payload": "   ", "amount": 1}),
        json!({"messageId": "demo", "payload": long, "amount": 1}),
        json!({"messageId": "demo", "payload": "hello", "amount": 0}),
        json!({"messageId": "demo", "payload": "hello", "amount": 11}),
        json!({"messageId": "demo", "payload": "hello"}),
        json!({"messageId": "demo", "amount": 1}),
    ] {
        assert_bad_request(app.post_json("/inbox/apply", &body).await).await;
    }
    // Fifty characters is the limit, counted as .NET counts them.
    assert_eq!(deliver(&app, "", &"é".repeat(50), 1).await.0, 200);
    assert_eq!(
        counts(&app).await,
        json!({"orders": 0, "outbox": 0, "inbox": 1, "effects": 1})
    );
}
