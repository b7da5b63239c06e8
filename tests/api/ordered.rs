//! The lesson: `POST /ordered/apply` and `GET /ordered/state` over real HTTP and real rows.

use serde_json::{Value, json};

use crate::helpers::{Backend, TestApp, assert_bad_request, spawn_app_on, status_and_json};

fn delivery(message_id: &str, sequence: i64, amount: i64) -> Value {
    json!({"messageId": message_id, "aggregateId": "demo", "sequence": sequence, "amount": amount})
}

async fn apply(app: &TestApp, message_id: &str, sequence: i64, amount: i64) -> (u16, Value) {
    status_and_json(
        app.post_json("/ordered/apply", &delivery(message_id, sequence, amount))
            .await,
    )
    .await
}

async fn state(app: &TestApp) -> Value {
    status_and_json(app.get("/ordered/state").await).await.1
}

async fn the_lesson_progression_quarantines_poison_without_advancing(backend: Backend) {
    let app = spawn_app_on(backend).await;

    assert_eq!(
        apply(&app, "m-2", 2, 1).await,
        (409, json!({"outcome": "gap", "expected": 1}))
    );
    assert_eq!(
        apply(&app, "m-1", 1, 1).await,
        (200, json!({"outcome": "applied", "sequence": 1}))
    );
    assert_eq!(
        apply(&app, "poison-2", 2, -1).await,
        (422, json!({"outcome": "quarantined", "expected": 2}))
    );
    assert_eq!(
        apply(&app, "m-3", 3, 1).await,
        (409, json!({"outcome": "gap", "expected": 2}))
    );
    assert_eq!(
        apply(&app, "corrected-2", 2, 1).await,
        (200, json!({"outcome": "applied", "sequence": 2}))
    );
    assert_eq!(
        state(&app).await,
        json!({"applied": 2, "deadletters": 1, "last": 2})
    );

    assert_eq!(
        app.inbox_rows("SELECT message_id, payload FROM ordered_inbox ORDER BY message_id"),
        [
            r#"corrected-2|{"AggregateId":"demo","Sequence":2,"Amount":1}"#,
            r#"m-1|{"AggregateId":"demo","Sequence":1,"Amount":1}"#,
        ]
    );
    // The seed's three columns come first, as the seed declared them.
    let aggregate = app.inbox_rows("SELECT * FROM aggregate_state");
    assert_eq!(aggregate.len(), 1);
    assert!(aggregate[0].starts_with("demo|2|2|"), "{aggregate:?}");
    assert_eq!(
        app.inbox_rows("SELECT message_id, reason FROM deadletters"),
        ["poison-2|negative amount"]
    );
}

async fn an_exact_replay_changes_nothing(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "m-1", 1, 5).await.0, 200);
    let before = state(&app).await;
    assert_eq!(
        apply(&app, "m-1", 1, 5).await,
        (200, json!({"outcome": "replay"}))
    );
    assert_eq!(state(&app).await, before);
    assert_eq!(app.inbox_scalar("SELECT total FROM aggregate_state"), 5);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
}

async fn a_reused_id_with_another_payload_is_a_payload_conflict(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "m-1", 1, 5).await.0, 200);
    assert_eq!(
        apply(&app, "m-1", 1, 6).await,
        (409, json!({"outcome": "payload conflict"}))
    );
    assert_eq!(
        apply(&app, "m-1", 2, 5).await,
        (409, json!({"outcome": "payload conflict"}))
    );
    assert_eq!(app.inbox_scalar("SELECT total FROM aggregate_state"), 5);
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        1
    );
}

async fn a_new_id_with_an_old_sequence_is_stale_and_writes_nothing(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "m-1", 1, 1).await.0, 200);
    assert_eq!(apply(&app, "m-2", 2, 1).await.0, 200);
    assert_eq!(
        apply(&app, "late-1", 1, 1).await,
        (409, json!({"outcome": "stale", "expected": 3}))
    );
    assert_eq!(
        apply(&app, "late-2", 2, -1).await,
        (409, json!({"outcome": "stale", "expected": 3}))
    );
    assert_eq!(
        state(&app).await,
        json!({"applied": 2, "deadletters": 0, "last": 2})
    );
}

async fn a_gap_writes_no_rows_at_all(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "m-5", 5, 1).await.0, 409);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM aggregate_state"), 0);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
}

async fn a_quarantined_id_resent_is_quarantined_again_with_one_row(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "poison", 1, -1).await.0, 422);
    assert_eq!(
        apply(&app, "poison", 1, -1).await,
        (422, json!({"outcome": "quarantined", "expected": 1}))
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM deadletters"), 1);
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        0
    );
}

async fn pascal_case_property_names_bind_like_camel_case(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let (status, body) = status_and_json(
        app.post_json(
            "/ordered/apply",
            &json!({"MessageId": "m-1", "AggregateId": "demo", "Sequence": 1, "Amount": 3}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, body),
        (200, json!({"outcome": "applied", "sequence": 1}))
    );
}

async fn every_request_shape_error_is_a_400_problem_never_422(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let invalid = [
        json!({"messageId": "", "aggregateId": "demo", "sequence": 1, "amount": 1}),
        json!({"messageId": "   ", "aggregateId": "demo", "sequence": 1, "amount": 1}),
        json!({"messageId": "x".repeat(21), "aggregateId": "demo", "sequence": 1, "amount": 1}),
        json!({"messageId": null, "aggregateId": "demo", "sequence": 1, "amount": 1}),
        json!({"messageId": "m", "aggregateId": "other", "sequence": 1, "amount": 1}),
        json!({"messageId": "m", "sequence": 1, "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": 0, "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": 11, "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": "1", "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": 1.5, "amount": 1}),
        json!({"messageId": "m", "aggregateId": "demo", "sequence": 1, "amount": 3_000_000_000i64}),
        json!({"messageId": 7, "aggregateId": "demo", "sequence": 1, "amount": 1}),
        json!([1, 2]),
    ];
    for body in &invalid {
        let problem = assert_bad_request(app.post_json("/ordered/apply", body).await).await;
        assert_eq!(problem["title"], "Bad Request", "{body}");
    }
    assert_bad_request(
        app.post_raw("/ordered/apply", "application/json", r#"{"messageId":"m","#)
            .await,
    )
    .await;
    assert_bad_request(
        app.post_raw(
            "/ordered/apply",
            "text/plain",
            &delivery("m", 1, 1).to_string(),
        )
        .await,
    )
    .await;
    // A message id of exactly 20 characters is valid.
    assert_eq!(apply(&app, &"x".repeat(20), 1, 1).await.0, 200);
    // Nothing else was written by the rejected requests.
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM deadletters"), 0);
}

async fn sixteen_ids_racing_for_one_sequence_apply_exactly_once(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let racers = (0..16).map(|i| {
        let app = &app;
        async move { apply(app, &format!("racer-{i}"), 1, 1).await }
    });
    let results = futures_util::future::join_all(racers).await;
    let applied = results.iter().filter(|(status, _)| *status == 200).count();
    assert_eq!(applied, 1, "{results:?}");
    for (status, body) in &results {
        assert!(
            *status == 200 || (*status == 409 && body["outcome"] == "stale"),
            "unexpected answer {status} {body}"
        );
    }
    assert_eq!(
        state(&app).await,
        json!({"applied": 1, "deadletters": 0, "last": 1})
    );
    assert_eq!(app.inbox_scalar("SELECT total FROM aggregate_state"), 1);
}

async fn sixteen_identical_deliveries_at_once_leave_one_row(backend: Backend) {
    let app = spawn_app_on(backend).await;
    // First wave: nobody has applied it yet, so exactly one applies and the rest replay.
    let first = futures_util::future::join_all((0..16).map(|_| apply(&app, "same", 1, 4))).await;
    assert_eq!(
        first.iter().filter(|r| r.1["outcome"] == "applied").count(),
        1
    );
    assert_eq!(
        first.iter().filter(|r| r.1["outcome"] == "replay").count(),
        15
    );
    assert!(first.iter().all(|r| r.0 == 200), "{first:?}");
    // Second wave: all replays.
    let second = futures_util::future::join_all((0..16).map(|_| apply(&app, "same", 1, 4))).await;
    assert!(
        second
            .iter()
            .all(|r| *r == (200, json!({"outcome": "replay"}))),
        "{second:?}"
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
    assert_eq!(app.inbox_scalar("SELECT total FROM aggregate_state"), 4);
}

async fn state_survives_a_restart_on_the_same_file(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(apply(&app, "m-1", 1, 1).await.0, 200);
    assert_eq!(apply(&app, "poison", 2, -1).await.0, 422);
    let app = app.restart().await;
    assert_eq!(
        state(&app).await,
        json!({"applied": 1, "deadletters": 1, "last": 1})
    );
    assert_eq!(
        apply(&app, "m-1", 1, 1).await,
        (200, json!({"outcome": "replay"}))
    );
    assert_eq!(
        apply(&app, "m-2", 2, 1).await,
        (200, json!({"outcome": "applied", "sequence": 2}))
    );
}

/// Every row of `demo` the classroom door could write, to prove it wrote none.
fn demo_rows(app: &TestApp) -> Vec<String> {
    [
        "SELECT 's', last_sequence, total, status, owner FROM aggregate_state",
        "SELECT 'i', producer, message_id, payload FROM ordered_inbox ORDER BY producer, message_id",
        "SELECT 'd', producer, message_id, observations FROM deadletters ORDER BY producer, message_id",
        "SELECT 't', kind, message_id FROM aggregate_timeline ORDER BY id",
    ]
    .into_iter()
    .flat_map(|sql| app.inbox_rows(sql))
    .collect()
}

async fn a_demo_owned_by_a_producer_answers_the_classroom_door_401_and_writes_nothing(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let token = crate::producers::add_producer(&app, "billing");
    let epoch = crate::producers::epoch(&app, &token).await;
    let claimed = app
        .client
        .post(app.url("/aggregates/demo/messages"))
        .bearer_auth(&token)
        .header("producer-epoch", epoch.to_string())
        .json(&json!({"messageId": "b-1", "sequence": 1, "amount": 1}))
        .send()
        .await
        .expect("POST reaches the server");
    assert_eq!(claimed.status(), 200);
    let before = demo_rows(&app);
    assert!(
        before.iter().any(|row| row.ends_with("|billing")),
        "{before:?}"
    );

    // The next sequence, a poison message and a gap: each refused before it is decided.
    for (message_id, sequence, amount) in [("m-2", 2, 1), ("poison-2", 2, -1), ("m-5", 5, 1)] {
        let response = app
            .post_json("/ordered/apply", &delivery(message_id, sequence, amount))
            .await;
        assert_eq!(response.status(), 401, "{message_id}");
        assert!(response.headers().contains_key("www-authenticate"));
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            content_type.starts_with("application/problem+json"),
            "{content_type}"
        );
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["status"], 401, "{problem}");
        assert_eq!(problem["title"], "Producer authentication required");
    }
    assert_eq!(demo_rows(&app), before);
    assert_eq!(
        state(&app).await,
        json!({"applied": 1, "deadletters": 0, "last": 1})
    );
}

/// The seed's own columns of its three tables, in a stable order.
const SEED_ROWS: &str = "
SELECT 's|' || aggregate_id || '|' || last_sequence || '|' || total FROM aggregate_state
UNION ALL SELECT 'i|' || message_id || '|' || payload FROM ordered_inbox
UNION ALL SELECT 'd|' || message_id || '|' || reason FROM deadletters
ORDER BY 1";

// SQLite only: files written by earlier releases (a PostgreSQL inbox has no seed tables).
#[tokio::test]
async fn an_older_file_keeps_every_seed_row_and_is_keyed_by_the_seeds_column_first() {
    for fixture in ["seed-v0.db", "release-v2.db"] {
        let (_copy, path) = crate::aggregates::fixture_copy(fixture);
        let before: Vec<String> = rusqlite::Connection::open(&path)
            .and_then(|db| {
                db.prepare(SEED_ROWS)?
                    .query_map([], |row| row.get(0))?
                    .collect()
            })
            .expect("the fixture's seed rows");
        assert!(!before.is_empty(), "{fixture}");
        let (_dir, app) = crate::aggregates::spawn_on_fixture(fixture).await;
        let after: Vec<String> = app.rows(SEED_ROWS, |row| row.get(0));
        assert_eq!(after, before, "{fixture}");
        for table in ["ordered_inbox", "deadletters"] {
            let key: Vec<String> = app.rows(
                &format!("SELECT name FROM pragma_table_info('{table}') WHERE pk > 0 ORDER BY pk"),
                |row| row.get(0),
            );
            assert_eq!(key, ["message_id", "producer"], "{fixture}: {table}");
        }
        assert_eq!(
            app.rows("PRAGMA integrity_check", |row| row.get::<_, String>(0)),
            ["ok"]
        );
    }
}

crate::on_both_backends!(
    the_lesson_progression_quarantines_poison_without_advancing,
    an_exact_replay_changes_nothing,
    a_reused_id_with_another_payload_is_a_payload_conflict,
    a_new_id_with_an_old_sequence_is_stale_and_writes_nothing,
    a_gap_writes_no_rows_at_all,
    a_quarantined_id_resent_is_quarantined_again_with_one_row,
    pascal_case_property_names_bind_like_camel_case,
    every_request_shape_error_is_a_400_problem_never_422,
    sixteen_ids_racing_for_one_sequence_apply_exactly_once,
    sixteen_identical_deliveries_at_once_leave_one_row,
    state_survives_a_restart_on_the_same_file,
    a_demo_owned_by_a_producer_answers_the_classroom_door_401_and_writes_nothing,
);
