//! The general ordered inbox: `POST /aggregates/{id}/messages`, the evidence routes, operator
//! tokens from the CLI and the audited poison resolution, over real HTTP and real rows.

use std::path::Path;

use serde_json::{Value, json};

use crate::helpers::{
    Backend, TestApp, assert_bad_request, command, spawn_app_on, spawn_app_on_with, spawn_app_with,
    status_and_json,
};

async fn deliver(
    app: &TestApp,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
    amount: i64,
) -> (u16, Value) {
    let body = json!({"messageId": message_id, "sequence": sequence, "amount": amount});
    status_and_json(
        app.post_json(&format!("/aggregates/{aggregate}/messages"), &body)
            .await,
    )
    .await
}

async fn get(app: &TestApp, path: &str) -> (u16, Value) {
    status_and_json(app.get(path).await).await
}

pub(crate) async fn resolve(
    app: &TestApp,
    token: Option<&str>,
    dead_letter: &str,
    body: &Value,
) -> (u16, Value) {
    resolve_at(
        app,
        token,
        &format!("/deadletters/{dead_letter}/resolution"),
        body,
    )
    .await
}

pub(crate) async fn resolve_at(
    app: &TestApp,
    token: Option<&str>,
    path: &str,
    body: &Value,
) -> (u16, Value) {
    let mut request = app.client.post(app.url(path)).json(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    status_and_json(request.send().await.expect("POST reaches the server")).await
}

pub(crate) fn skip(expected_last: i64, reason: &str) -> Value {
    json!({"action": "skip", "expectedLast": expected_last, "reason": reason})
}

fn replace(expected_last: i64, message_id: &str, amount: i64) -> Value {
    json!({
        "action": "replace",
        "expectedLast": expected_last,
        "reason": "customer confirmed the amount",
        "replacement": {"messageId": message_id, "amount": amount},
    })
}

/// Runs `production-lab operator ARGS` as a process on the app's operator store
/// (`--database PATH` or `--inbox URL`).
fn operator_command(args: &[&str], app: &TestApp) -> std::process::Output {
    operator_command_on(args, &app.operator_store_args())
}

fn operator_command_on(args: &[&str], store: &[std::ffi::OsString]) -> std::process::Output {
    command()
        .arg("operator")
        .args(args)
        .args(store)
        .output()
        .expect("run the operator command")
}

/// Registers an operator through the CLI and returns the token it printed.
pub(crate) fn add_operator(app: &TestApp, name: &str) -> String {
    add_operator_on(&app.operator_store_args(), name)
}

/// Registers an operator through the CLI in `store` (`--database PATH` or `--inbox URL`) and
/// returns the token it printed, its output alone.
pub(crate) fn add_operator_on(store: &[std::ffi::OsString], name: &str) -> String {
    let output = operator_command_on(&["add", name], store);
    assert!(
        output.status.success(),
        "operator add failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let token = String::from_utf8(output.stdout).expect("utf-8 token");
    let token = token.trim().to_owned();
    assert_eq!(token.lines().count(), 1, "stdout is the token alone");
    token
}

/// An aggregate `a` at last 1 (total 5) with the poison `poison-2` quarantined at sequence 2.
async fn blocked_aggregate(app: &TestApp) {
    assert_eq!(deliver(app, "a", "m-1", 1, 5).await.0, 200);
    assert_eq!(deliver(app, "a", "poison-2", 2, -1).await.0, 422);
}

pub(crate) fn dead_letter_status(app: &TestApp, message_id: &str) -> String {
    // Test ids are plain words; the quote check keeps this literal honest.
    assert!(!message_id.contains('\''));
    let rows = app.inbox_rows(&format!(
        "SELECT status FROM deadletters WHERE message_id = '{message_id}'"
    ));
    rows.into_iter().next().expect("the dead letter row")
}

/// Every row of the tables a resolution could touch, to prove that nothing changed.
fn ordering_rows(app: &TestApp) -> Vec<String> {
    let mut rows = Vec::new();
    for table in [
        "aggregate_state",
        "ordered_inbox",
        "deadletters",
        "aggregate_timeline",
        "resolutions",
    ] {
        let mut table_rows: Vec<String> = app
            .inbox_rows(&format!("SELECT * FROM {table}"))
            .into_iter()
            .map(|row| format!("{table}: {row}"))
            .collect();
        // Physical row order is not part of the contract.
        table_rows.sort();
        rows.extend(table_rows);
    }
    rows
}

async fn many_aggregates_interleaved_keep_their_own_sequences(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let steps = [
        ("acct-1", "a1", 1, 10, 200),
        ("acct-2", "b1", 1, 1, 200),
        ("acct-1", "a3", 3, 1, 409),
        ("tenant:9.x", "c1", 1, 7, 200),
        ("acct-2", "b2", 2, 2, 200),
        ("acct-1", "a2", 2, 20, 200),
        ("acct-1", "a3", 3, 1, 200),
        ("acct-2", "b3", 3, 3, 200),
    ];
    for (aggregate, id, sequence, amount, status) in steps {
        let (got, body) = deliver(&app, aggregate, id, sequence, amount).await;
        assert_eq!(got, status, "{aggregate} {id}: {body}");
    }
    for (aggregate, last, total) in [("acct-1", 3, 31), ("acct-2", 3, 6), ("tenant:9.x", 1, 7)] {
        let (status, view) = get(&app, &format!("/aggregates/{aggregate}")).await;
        assert_eq!(status, 200);
        assert_eq!(
            (
                view["last"].as_i64(),
                view["total"].as_i64(),
                view["expected"].as_i64()
            ),
            (Some(last), Some(total), Some(last + 1)),
            "{view}"
        );
        assert_eq!(view["status"], "flowing");
    }
    // The inbox rows carry their aggregate and sequence, backed by the canonical payload.
    assert_eq!(
        app.inbox_rows(
            "SELECT aggregate_id, sequence, amount, payload FROM ordered_inbox WHERE message_id = 'a2'"
        ),
        [r#"acct-1|2|20|{"AggregateId":"acct-1","Sequence":2,"Amount":20}"#]
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 7);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM aggregate_state"), 3);
}

async fn each_verdict_says_what_the_caller_can_do(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let (status, applied) = deliver(&app, "acct", "m-1", 1, 4).await;
    assert_eq!(status, 200);
    assert_eq!(applied["outcome"], "applied");
    assert_eq!(applied["last"], 1);
    assert_eq!(applied["sequence"], 1);
    assert_eq!(applied["total"], 4);
    assert_eq!(applied["superseded"], json!([]));

    let (status, replay) = deliver(&app, "acct", "m-1", 1, 4).await;
    assert_eq!(status, 200);
    assert_eq!(replay["outcome"], "replay");
    assert_eq!(replay["original"]["outcome"], "applied");
    assert_eq!(replay["original"]["sequence"], 1);
    assert!(replay["original"]["appliedAt"].is_string(), "{replay}");

    let (status, gap) = deliver(&app, "acct", "m-3", 3, 1).await;
    assert_eq!(status, 409);
    assert_eq!(gap["outcome"], "gap");
    assert_eq!(gap["expected"], 2);
    assert_eq!(gap["retryable"], true);
    assert!(
        gap["action"].as_str().unwrap().contains("sequence 2"),
        "{gap}"
    );

    let (status, stale) = deliver(&app, "acct", "late-1", 1, 1).await;
    assert_eq!(status, 409);
    assert_eq!(stale["outcome"], "stale");
    assert_eq!(stale["expected"], 2);
    assert_eq!(stale["retryable"], false);

    let (status, conflict) = deliver(&app, "acct", "m-1", 1, 5).await;
    assert_eq!(status, 409);
    assert_eq!(conflict["outcome"], "payload conflict");
    assert_eq!(conflict["retryable"], false);

    let (status, quarantined) = deliver(&app, "acct", "poison-2", 2, -1).await;
    assert_eq!(status, 422);
    assert_eq!(quarantined["outcome"], "quarantined");
    assert_eq!(quarantined["reason"], "negative amount");
    assert_eq!(quarantined["expected"], 2);
    assert_eq!(quarantined["retryable"], false);
    assert_eq!(quarantined["resolution"]["requiresOperator"], true);
    assert_eq!(quarantined["deadLetter"]["status"], "open");
    assert_eq!(quarantined["deadLetter"]["observations"], 1);

    // Only the apply changed state.
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        1
    );
    assert_eq!(app.inbox_scalar("SELECT total FROM aggregate_state"), 4);
}

async fn a_quarantined_id_resent_unchanged_is_quarantined_again_with_a_growing_observation_count(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    blocked_aggregate(&app).await;
    for observations in 2..=3 {
        let (status, body) = deliver(&app, "a", "poison-2", 2, -1).await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["outcome"], "quarantined");
        assert_eq!(body["deadLetter"]["observations"], observations);
    }
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM deadletters"), 1);
    assert_eq!(
        app.inbox_scalar("SELECT observations FROM deadletters WHERE message_id = 'poison-2'"),
        3
    );
    // The same id with other content is not a correction: the id never changes meaning.
    let (status, body) = deliver(&app, "a", "poison-2", 2, 1).await;
    assert_eq!(
        (status, body["outcome"].clone()),
        (409, json!("payload conflict"))
    );
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        1
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
    assert_eq!(dead_letter_status(&app, "poison-2"), "open");
}

async fn concurrent_deliveries_at_the_general_door_apply_once_and_count_every_observation(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let racers = futures_util::future::join_all((0..16).map(|i| {
        let app = &app;
        async move { deliver(app, "race", &format!("racer-{i}"), 1, 1).await }
    }))
    .await;
    assert_eq!(
        racers.iter().filter(|(status, _)| *status == 200).count(),
        1,
        "{racers:?}"
    );
    assert!(
        racers
            .iter()
            .all(|(status, body)| *status == 200 || body["outcome"] == "stale"),
        "{racers:?}"
    );
    // The same poison sixteen times at once: one row, every delivery counted.
    let poison =
        futures_util::future::join_all((0..16).map(|_| deliver(&app, "race", "poison", 2, -1)))
            .await;
    assert!(
        poison.iter().all(|(status, _)| *status == 422),
        "{poison:?}"
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM deadletters"), 1);
    assert_eq!(app.inbox_scalar("SELECT observations FROM deadletters"), 16);
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE kind = 'quarantined'"),
        1
    );
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        1
    );
}

async fn a_corrected_message_under_a_new_id_supersedes_the_open_dead_letter(backend: Backend) {
    let app = spawn_app_on(backend).await;
    blocked_aggregate(&app).await;
    let (status, body) = deliver(&app, "a", "m-3", 3, 1).await;
    assert_eq!((status, body["expected"].clone()), (409, json!(2)));
    let (status, body) = deliver(&app, "a", "corrected-2", 2, 1).await;
    assert_eq!(status, 200);
    assert_eq!(body["superseded"], json!(["poison-2"]));
    assert_eq!(deliver(&app, "a", "m-3", 3, 1).await.0, 200);

    let (_, listed) = get(&app, "/deadletters?status=superseded").await;
    let letters = listed["deadLetters"].as_array().unwrap();
    assert_eq!(letters.len(), 1, "{listed}");
    assert_eq!(letters[0]["messageId"], "poison-2");
    assert_eq!(letters[0]["supersededBy"], "corrected-2");
    assert_eq!(letters[0]["sequence"], 2);
    assert_eq!(
        letters[0]["payload"],
        json!({"AggregateId": "a", "Sequence": 2, "Amount": -1})
    );
    assert!(letters[0]["closedAt"].is_string());
    let (_, open) = get(&app, "/deadletters?status=open").await;
    assert_eq!(open["deadLetters"], json!([]));
    // Kept, not deleted.
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM deadletters"), 1);
}

async fn blocked_and_waiting_aggregates_are_listed_oldest_first(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(deliver(&app, "first-blocked", "p1", 1, -1).await.0, 422);
    assert_eq!(deliver(&app, "waiting", "w2", 2, 1).await.0, 409);
    assert_eq!(deliver(&app, "second-blocked", "p2", 1, -1).await.0, 422);
    assert_eq!(deliver(&app, "flowing", "f1", 1, 1).await.0, 200);
    // A gap on a blocked aggregate leaves it blocked: the open dead letter is what it needs.
    assert_eq!(deliver(&app, "first-blocked", "later", 3, 1).await.0, 409);

    let (status, blocked) = get(&app, "/aggregates?status=blocked").await;
    assert_eq!(status, 200);
    let names: Vec<&str> = blocked["aggregates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["aggregateId"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["first-blocked", "second-blocked"]);
    let first = &blocked["aggregates"][0];
    assert_eq!(first["openDeadLetters"], 1);
    assert_eq!(first["expected"], 1);
    assert!(
        first["ageSeconds"].as_i64().is_some_and(|age| age >= 0),
        "{first}"
    );
    assert!(first["since"].is_string());

    let (_, waiting) = get(&app, "/aggregates?status=waiting").await;
    assert_eq!(
        waiting["aggregates"].as_array().unwrap().len(),
        1,
        "{waiting}"
    );
    assert_eq!(waiting["aggregates"][0]["aggregateId"], "waiting");

    let (status, view) = get(&app, "/aggregates/first-blocked").await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "blocked");
    assert_eq!(view["openDeadLetters"][0]["messageId"], "p1");

    // The predecessor arrives: the waiting aggregate flows again and leaves the inventory.
    assert_eq!(deliver(&app, "waiting", "w1", 1, 1).await.0, 200);
    let (_, waiting) = get(&app, "/aggregates?status=waiting").await;
    assert_eq!(waiting["aggregates"], json!([]));
    let (_, view) = get(&app, "/aggregates/waiting").await;
    assert_eq!(view["status"], "flowing");

    let (status, problem) = get(&app, "/aggregates/nobody").await;
    assert_eq!(status, 404, "{problem}");
    assert_bad_request(app.get("/aggregates?status=stuck").await).await;
    assert_bad_request(app.get("/aggregates").await).await;
}

async fn rejection_observations_are_bounded_per_aggregate_while_state_events_stay(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    assert_eq!(deliver(&app, "busy", "m-1", 1, 1).await.0, 200);
    for i in 0..130 {
        assert_eq!(deliver(&app, "busy", &format!("g-{i}"), 5, 1).await.0, 409);
    }
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'busy' AND observation_no IS NOT NULL"),
        100
    );
    assert_eq!(
        app.inbox_scalar(
            "SELECT MIN(observation_no) FROM aggregate_timeline WHERE aggregate_id = 'busy'"
        ),
        31
    );
    let (_, page) = get(&app, "/aggregates/busy/timeline?limit=1000").await;
    let events = page["events"].as_array().unwrap();
    assert_eq!(events.len(), 101);
    assert_eq!(events[0]["kind"], "applied");
    assert_eq!(events[0]["observation"], false);
    assert_eq!(events[1]["kind"], "gap");
    assert_eq!(events[1]["messageId"], "g-30");
    assert_eq!(events[100]["messageId"], "g-129");
    assert_eq!(page["next"], Value::Null);
}

async fn the_timeline_tells_the_story_in_order_and_pages(backend: Backend) {
    let app = spawn_app_on(backend).await;
    deliver(&app, "story", "m-1", 1, 1).await;
    deliver(&app, "story", "m-3", 3, 1).await;
    deliver(&app, "story", "poison-2", 2, -1).await;
    deliver(&app, "story", "poison-2", 2, -1).await;
    deliver(&app, "story", "fix-2", 2, 2).await;
    deliver(&app, "story", "late", 1, 1).await;
    deliver(&app, "story", "m-1", 1, 9).await;

    let (status, page) = get(&app, "/aggregates/story/timeline").await;
    assert_eq!(status, 200);
    let kinds: Vec<&str> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "applied",
            "gap",
            "quarantined",
            "quarantined again",
            "applied",
            "superseded",
            "stale",
            "payload conflict"
        ]
    );
    let superseded = &page["events"][5];
    assert_eq!(superseded["messageId"], "poison-2");
    assert_eq!(superseded["detail"]["by"], "fix-2");

    let (_, first) = get(&app, "/aggregates/story/timeline?limit=3").await;
    assert_eq!(first["events"].as_array().unwrap().len(), 3);
    let next = first["next"].as_i64().expect("a next page");
    let (_, second) = get(
        &app,
        &format!("/aggregates/story/timeline?after={next}&limit=3"),
    )
    .await;
    assert_eq!(second["events"][0]["kind"], "quarantined again");
    assert_bad_request(app.get("/aggregates/story/timeline?limit=0").await).await;
    assert_bad_request(app.get("/aggregates/story/timeline?after=x").await).await;
}

async fn every_request_shape_error_at_the_general_door_is_a_400_problem(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let post = |path: String, body: Value| {
        let app = &app;
        async move { app.post_json(&path, &body).await }
    };
    let ok = json!({"messageId": "m", "sequence": 1, "amount": 1});
    for aggregate in ["has space", &"x".repeat(65), "%C3%BC", "a%2Fb"] {
        assert_bad_request(post(format!("/aggregates/{aggregate}/messages"), ok.clone()).await)
            .await;
    }
    let bodies = [
        json!({"messageId": "", "sequence": 1, "amount": 1}),
        json!({"messageId": "  ", "sequence": 1, "amount": 1}),
        json!({"messageId": "x".repeat(101), "sequence": 1, "amount": 1}),
        json!({"messageId": null, "sequence": 1, "amount": 1}),
        json!({"sequence": 1, "amount": 1}),
        json!({"messageId": "m", "sequence": 0, "amount": 1}),
        json!({"messageId": "m", "sequence": 9_007_199_254_740_993i64, "amount": 1}),
        json!({"messageId": "m", "sequence": 1.5, "amount": 1}),
        json!({"messageId": "m", "sequence": "1", "amount": 1}),
        json!({"messageId": "m", "sequence": 1, "amount": 2_147_483_648i64}),
        json!({"messageId": "m", "sequence": 1}),
        json!({"messageId": "m", "sequence": 1, "amount": 1, "aggregateId": "other"}),
        json!([1]),
    ];
    for body in bodies {
        let problem =
            assert_bad_request(post("/aggregates/acct/messages".to_owned(), body.clone()).await)
                .await;
        assert_eq!(problem["title"], "Bad Request", "{body}");
    }
    assert_bad_request(
        app.post_raw("/aggregates/acct/messages", "text/plain", &ok.to_string())
            .await,
    )
    .await;
    for path in [
        "/deadletters?status=lost",
        "/deadletters?aggregateId=a%20b",
        "/deadletters?limit=1001",
        "/resolutions?after=-1",
        "/aggregates/a%20b",
    ] {
        assert_bad_request(app.get(path).await).await;
    }
    // The edges are valid: 100-character ids, sequence 2^53, the 32-bit extremes, a matching
    // body aggregateId, and 64-character aggregate ids.
    let edge = "z".repeat(64);
    let (status, body) = status_and_json(
        post(
            format!("/aggregates/{edge}/messages"),
            json!({"messageId": "é".repeat(100), "sequence": 1, "amount": i32::MIN, "aggregateId": edge}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 422, "{body}");
    let (status, body) = deliver(
        &app,
        "big",
        "huge",
        9_007_199_254_740_992,
        i64::from(i32::MAX),
    )
    .await;
    assert_eq!((status, body["expected"].clone()), (409, json!(1)));
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
}

async fn both_doors_share_one_identity_and_one_set_of_rows(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let classroom = json!({"messageId": "m-1", "aggregateId": "demo", "sequence": 1, "amount": 1});
    assert_eq!(
        app.post_json("/ordered/apply", &classroom).await.status(),
        200
    );
    let (status, body) = deliver(&app, "demo", "m-1", 1, 1).await;
    assert_eq!((status, body["outcome"].clone()), (200, json!("replay")));
    // Message ids are global: the same id on another aggregate is another payload.
    let (status, body) = deliver(&app, "other", "m-1", 1, 1).await;
    assert_eq!(
        (status, body["outcome"].clone()),
        (409, json!("payload conflict"))
    );

    // A classroom quarantine fills the lifecycle columns, and the general door sees it.
    let poison =
        json!({"messageId": "poison-2", "aggregateId": "demo", "sequence": 2, "amount": -1});
    assert_eq!(app.post_json("/ordered/apply", &poison).await.status(), 422);
    assert_eq!(app.post_json("/ordered/apply", &poison).await.status(), 422);
    assert_eq!(
        app.inbox_rows(
            "SELECT aggregate_id, sequence, payload, status, observations FROM deadletters"
        ),
        [r#"demo|2|{"AggregateId":"demo","Sequence":2,"Amount":-1}|open|2"#]
    );
    let (_, view) = get(&app, "/aggregates/demo").await;
    assert_eq!(view["status"], "blocked");
    let (status, body) = deliver(&app, "demo", "poison-2", 2, -1).await;
    assert_eq!(
        (status, body["deadLetter"]["observations"].clone()),
        (422, json!(3))
    );

    // /ordered/state describes the classroom aggregate only, however far others have gone.
    for sequence in 1..=5 {
        assert_eq!(
            deliver(&app, "far", &format!("far-{sequence}"), sequence, 1)
                .await
                .0,
            200
        );
    }
    let (_, state) = get(&app, "/ordered/state").await;
    assert_eq!(state, json!({"applied": 1, "deadletters": 1, "last": 1}));
}

async fn the_operator_cli_prints_a_token_once_and_keeps_only_its_hash(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    assert!(token.len() >= 43, "32 random bytes, base64url: {token}");
    let stored = app.inbox_rows("SELECT token_hash FROM operators WHERE name = 'alice'");
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].len(), 64);
    assert!(!stored[0].contains(&token));
    if backend == Backend::Sqlite {
        // The whole file, not only the column: no copy of the token anywhere.
        let dump = std::fs::read(&app.database).unwrap();
        assert!(!dump.windows(token.len()).any(|w| w == token.as_bytes()));
    }

    add_operator(&app, "bob");
    let duplicate = operator_command(&["add", "alice"], &app);
    assert!(!duplicate.status.success());
    assert!(String::from_utf8_lossy(&duplicate.stderr).contains("already exists"));

    let revoked = operator_command(&["revoke", "bob"], &app);
    assert!(revoked.status.success());
    let listed = operator_command(&["list"], &app);
    assert!(listed.status.success());
    let listing = String::from_utf8(listed.stdout).unwrap();
    let lines: Vec<&str> = listing.lines().collect();
    assert_eq!(lines.len(), 2, "{listing}");
    assert!(
        lines[0].starts_with("alice\t") && lines[0].ends_with("active"),
        "{listing}"
    );
    assert!(
        lines[1].starts_with("bob\t") && lines[1].contains("revoked"),
        "{listing}"
    );
    assert!(!listing.contains(&token));

    // A store that is not there is refused, not created.
    let (missing, says) = match backend {
        Backend::Sqlite => (
            vec!["--database".into(), app.dir.path().join("typo.db").into()],
            "does not exist",
        ),
        Backend::Postgres => (
            vec![
                "--inbox".into(),
                "postgres://lab:secret@db.example.com/inbox".into(),
            ],
            "only loopback hosts",
        ),
    };
    let missing = operator_command_on(&["list"], &missing);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains(says), "{stderr}");
    assert!(!stderr.contains("secret"), "{stderr}");
}

async fn resolution_without_an_operator_token_is_401_and_changes_nothing(backend: Backend) {
    let app = spawn_app_on(backend).await;
    blocked_aggregate(&app).await;
    let before = ordering_rows(&app);

    let (status, problem) = resolve(&app, None, "poison-2", &skip(1, "why")).await;
    assert_eq!(status, 401);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("production-lab operator add NAME --database PATH"),
        "{problem}"
    );

    let token = add_operator(&app, "alice");
    for credential in [None, Some("not-a-token")] {
        let (status, problem) = resolve(&app, credential, "poison-2", &skip(1, "why")).await;
        assert_eq!(status, 401, "{problem}");
        assert_eq!(problem["title"], "Operator authentication required");
        assert!(!problem["detail"].as_str().unwrap().contains("operator add"));
    }
    // Authority comes before the body: a broken body without a token is still a 401.
    let response = app
        .client
        .post(app.url("/deadletters/poison-2/resolution"))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert!(response.headers().contains_key("www-authenticate"));

    // A revoked operator's token stops working.
    assert!(
        operator_command(&["revoke", "alice"], &app)
            .status
            .success()
    );
    let (status, _) = resolve(&app, Some(&token), "poison-2", &skip(1, "why")).await;
    assert_eq!(status, 401);
    assert_eq!(ordering_rows(&app), before);
}

async fn replace_applies_the_replacement_and_only_then_is_the_next_sequence_eligible(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    // Not before: sequence 3 is a gap while 2 is quarantined.
    assert_eq!(deliver(&app, "a", "m-3", 3, 1).await.0, 409);

    let (status, resolved) = resolve(&app, Some(&token), "poison-2", &replace(1, "fix-2", 2)).await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["outcome"], "resolved");
    assert_eq!(resolved["dryRun"], false);
    assert_eq!(resolved["action"], "replace");
    assert_eq!(resolved["operator"], "alice");
    assert_eq!(resolved["sequence"], 2);
    assert_eq!(resolved["before"], json!({"last": 1, "total": 5}));
    assert_eq!(resolved["after"], json!({"last": 2, "total": 7}));
    assert_eq!(
        resolved["replacement"],
        json!({"messageId": "fix-2", "amount": 2})
    );

    // The replacement is an applied message like any other; the dead letter is resolved.
    assert_eq!(
        app.inbox_rows("SELECT sequence, payload FROM ordered_inbox WHERE message_id = 'fix-2'"),
        [r#"2|{"AggregateId":"a","Sequence":2,"Amount":2}"#]
    );
    assert_eq!(dead_letter_status(&app, "poison-2"), "resolved");
    let (_, letters) = get(&app, "/deadletters?status=resolved&aggregateId=a").await;
    let resolution = &letters["deadLetters"][0]["resolution"];
    assert_eq!(resolution["operator"], "alice");
    assert_eq!(resolution["action"], "replace");
    assert_eq!(resolution["reason"], "customer confirmed the amount");
    assert_eq!(resolution["replacementMessageId"], "fix-2");
    assert!(resolution["resolvedAt"].is_string());

    // After: sequence 3 applies.
    assert_eq!(deliver(&app, "a", "m-3", 3, 1).await.0, 200);
    // The poison itself, resent, is still quarantined, and says no operator is needed now.
    let (status, body) = deliver(&app, "a", "poison-2", 2, -1).await;
    assert_eq!(status, 422);
    assert_eq!(body["deadLetter"]["status"], "resolved");
    assert_eq!(body["resolution"]["requiresOperator"], false);

    let (_, trail) = get(&app, "/resolutions").await;
    let records = trail["resolutions"].as_array().unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["messageId"], "poison-2");
    assert_eq!(records[0]["before"]["last"], 1);
    assert_eq!(records[0]["after"]["last"], 2);
    let (_, timeline) = get(&app, "/aggregates/a/timeline").await;
    let kinds: Vec<&str> = timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "applied",
            "quarantined",
            "gap",
            "applied",
            "resolved",
            "applied",
            "quarantined again"
        ]
    );
}

async fn skip_records_an_explicit_skip_with_zero_effect_and_advances_by_one(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    let (status, resolved) = resolve(
        &app,
        Some(&token),
        "poison-2",
        &skip(1, "order was cancelled upstream"),
    )
    .await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["before"], json!({"last": 1, "total": 5}));
    assert_eq!(resolved["after"], json!({"last": 2, "total": 5}));
    assert_eq!(resolved["replacement"], Value::Null);
    // No message was applied at sequence 2: the skip is its own event, not an inbox row.
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE kind = 'skipped' AND sequence = 2 AND message_id = 'poison-2'"),
        1
    );
    assert_eq!(deliver(&app, "a", "late-2", 2, 1).await.0, 409);
    let (status, applied) = deliver(&app, "a", "m-3", 3, 1).await;
    assert_eq!((status, applied["total"].clone()), (200, json!(6)));
    let (_, view) = get(&app, "/aggregates/a").await;
    assert_eq!(view["status"], "flowing");
    assert_eq!(view["openDeadLetters"], json!([]));
}

async fn two_operators_racing_with_the_same_expected_last_resolve_exactly_once(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let alice = add_operator(&app, "alice");
    let bob = add_operator(&app, "bob");
    blocked_aggregate(&app).await;
    let alice_body = replace(1, "alice-fix", 3);
    let bob_body = skip(1, "bob thinks it is a duplicate");
    let (first, second) = tokio::join!(
        resolve(&app, Some(&alice), "poison-2", &alice_body),
        resolve(&app, Some(&bob), "poison-2", &bob_body),
    );
    let mut statuses = [first.0, second.0];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 409], "{first:?} {second:?}");
    let (winner, loser) = if first.0 == 200 {
        (first, second)
    } else {
        (second, first)
    };
    assert_eq!(loser.1["current"]["aggregate"]["last"], 2, "{}", loser.1);
    assert_eq!(loser.1["current"]["deadLetter"]["status"], "resolved");
    assert_eq!(
        loser.1["current"]["deadLetter"]["resolution"]["operator"],
        winner.1["operator"]
    );
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM resolutions"), 1);
    assert_eq!(
        app.inbox_scalar("SELECT last_sequence FROM aggregate_state"),
        2
    );
}

async fn an_identical_repeat_answers_the_original_result_and_a_different_one_conflicts(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    let body = replace(1, "fix-2", 2);
    let (status, original) = resolve(&app, Some(&token), "poison-2", &body).await;
    assert_eq!(status, 200);
    let rows = ordering_rows(&app);
    let (status, repeated) = resolve(&app, Some(&token), "poison-2", &body).await;
    assert_eq!((status, &repeated), (200, &original));
    assert_eq!(ordering_rows(&app), rows);

    let mut other = body.clone();
    other["reason"] = json!("a different story");
    let (status, problem) = resolve(&app, Some(&token), "poison-2", &other).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["title"], "The dead letter is already resolved");
    assert_eq!(problem["current"]["aggregate"]["last"], 2);
    // Another operator sending the same body is not a repeat of alice's decision.
    let bob = add_operator(&app, "bob");
    assert_eq!(resolve(&app, Some(&bob), "poison-2", &body).await.0, 409);
    assert_eq!(ordering_rows(&app), rows);
}

async fn a_dry_run_reports_the_resulting_state_and_writes_nothing(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    let before = ordering_rows(&app);
    let path = "/deadletters/poison-2/resolution?dryRun=true";
    let (status, rehearsal) = resolve_at(&app, Some(&token), path, &replace(1, "fix-2", 2)).await;
    assert_eq!(status, 200, "{rehearsal}");
    assert_eq!(rehearsal["outcome"], "dry run");
    assert_eq!(rehearsal["dryRun"], true);
    assert_eq!(rehearsal["resolutionId"], Value::Null);
    assert_eq!(rehearsal["after"], json!({"last": 2, "total": 7}));
    assert_eq!(ordering_rows(&app), before);
    // A dry run runs the real checks too.
    let (status, refused) = resolve_at(&app, Some(&token), path, &replace(1, "m-1", 2)).await;
    assert_eq!(status, 409, "{refused}");
    let (status, _) = resolve_at(&app, Some(&token), path, &replace(1, "fix-2", -3)).await;
    assert_eq!(status, 422);
    assert_eq!(ordering_rows(&app), before);

    let (status, real) = resolve(&app, Some(&token), "poison-2", &replace(1, "fix-2", 2)).await;
    assert_eq!(status, 200);
    assert_eq!(real["after"], rehearsal["after"]);
    assert_eq!(real["before"], rehearsal["before"]);
    assert!(real["resolutionId"].is_i64());
}

async fn resolution_preconditions_refuse_with_the_current_state(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let token = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    let before = ordering_rows(&app);

    let (status, problem) = resolve(&app, Some(&token), "poison-2", &skip(0, "stale view")).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["current"]["aggregate"]["last"], 1);
    assert_eq!(problem["current"]["deadLetter"]["status"], "open");

    let (status, _) = resolve(&app, Some(&token), "nobody", &skip(1, "x")).await;
    assert_eq!(status, 404);

    // The replacement must be a new, valid message.
    let (status, problem) = resolve(&app, Some(&token), "poison-2", &replace(1, "fix-2", -1)).await;
    assert_eq!(
        (status, problem["title"].clone()),
        (422, json!("The replacement would be quarantined"))
    );
    let (status, _) = resolve(&app, Some(&token), "poison-2", &replace(1, "poison-2", 1)).await;
    assert_eq!(status, 409);
    let (status, _) = resolve(&app, Some(&token), "poison-2", &replace(1, "m-1", 5)).await;
    assert_eq!(status, 409);

    for bad in [
        json!({"action": "undo", "expectedLast": 1, "reason": "x"}),
        json!({"action": "skip", "expectedLast": 1, "reason": "  "}),
        json!({"action": "skip", "expectedLast": -1, "reason": "x"}),
        json!({"action": "skip", "reason": "x"}),
        json!({"action": "replace", "expectedLast": 1, "reason": "x"}),
        json!({"action": "replace", "expectedLast": 1, "reason": "x", "replacement": {"messageId": "f"}}),
        json!({"action": "skip", "expectedLast": 1, "reason": "x", "replacement": {"messageId": "f", "amount": 1}}),
    ] {
        let response = app
            .client
            .post(app.url("/deadletters/poison-2/resolution"))
            .bearer_auth(&token)
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_bad_request(response).await;
    }
    assert_eq!(ordering_rows(&app), before);

    // A superseded dead letter cannot be resolved.
    assert_eq!(deliver(&app, "a", "corrected-2", 2, 1).await.0, 200);
    let (status, problem) = resolve(&app, Some(&token), "poison-2", &skip(2, "too late")).await;
    assert_eq!(status, 409);
    assert_eq!(problem["title"], "The dead letter is not open");
    assert_eq!(
        problem["current"]["deadLetter"]["supersededBy"],
        "corrected-2"
    );
}

/// A server on a copy of a fixture database, after checking that the server brought both the
/// labs' schema (`user_version`, the current one) and the inbox's (its own version table) up to date.
pub(crate) async fn spawn_on_fixture(name: &str) -> (tempfile::TempDir, TestApp) {
    let (dir, path) = fixture_copy(name);
    let app = spawn_app_with(move |config| config.database = path).await;
    assert_eq!(
        app.scalar("PRAGMA user_version"),
        production_lab::store::schema::current_version()
    );
    assert_eq!(
        app.scalar("SELECT version FROM ordered_inbox_schema"),
        ordered_inbox::sqlite::schema::current_version()
    );
    (dir, app)
}

/// The message ids of a `/deadletters` page, in order.
fn listed_ids(page: &Value) -> Vec<&str> {
    page["deadLetters"]
        .as_array()
        .map(|letters| {
            letters
                .iter()
                .filter_map(|letter| letter["messageId"].as_str())
                .collect()
        })
        .unwrap_or_default()
}

/// A copy of a database file made before the ordered inbox became a library, in a fresh temp dir.
pub(crate) fn fixture_copy(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::copy(&fixture, &path).expect("copy the fixture database");
    (dir, path)
}

// SQLite only: these two open database files written by earlier releases; a PostgreSQL inbox
// has no such history (its schema starts at its own version 1).
#[tokio::test]
async fn a_seed_schema_database_opens_and_upgrades_in_place() {
    // Made by the seed's Initialize script and the seed's own statements (user_version 0).
    let (_fixture, path) = fixture_copy("seed-v0.db");
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 0);
    let (_dir, app) = spawn_on_fixture("seed-v0.db").await;
    // The seed's rows keep their values and gain the backfilled columns.
    let (_, state) = get(&app, "/ordered/state").await;
    assert_eq!(state, json!({"applied": 2, "deadletters": 1, "last": 2}));
    assert_eq!(app.scalar("SELECT value FROM counters WHERE id = 1"), 10);
    let backfilled: Vec<(String, String, i64, i64)> = app.rows(
        "SELECT message_id, aggregate_id, sequence, amount FROM ordered_inbox ORDER BY sequence",
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    );
    assert_eq!(
        backfilled,
        [
            ("m-1".to_owned(), "demo".to_owned(), 1, 1),
            ("corrected-2".to_owned(), "demo".to_owned(), 2, 1)
        ]
    );
    let (_, letters) = get(&app, "/deadletters?aggregateId=demo").await;
    let letter = &letters["deadLetters"][0];
    assert_eq!(letter["messageId"], "poison-2");
    assert_eq!(letter["reason"], "negative amount");
    assert_eq!(letter["status"], "open");
    assert_eq!(letter["sequence"], Value::Null, "the seed never stored it");

    // Both doors work on the upgraded rows.
    let replay = json!({"messageId": "m-1", "aggregateId": "demo", "sequence": 1, "amount": 1});
    let (status, body) = status_and_json(app.post_json("/ordered/apply", &replay).await).await;
    assert_eq!((status, body), (200, json!({"outcome": "replay"})));
    let (status, body) = deliver(&app, "demo", "corrected-2", 2, 1).await;
    assert_eq!(
        (status, body["original"]["sequence"].clone()),
        (200, json!(2))
    );
    assert_eq!(deliver(&app, "demo", "m-3", 3, 1).await.0, 200);
    // The legacy dead letter has no stored payload: its id cannot take on a meaning now.
    let (status, body) = deliver(&app, "demo", "poison-2", 4, 1).await;
    assert_eq!(
        (status, body["outcome"].clone()),
        (409, json!("payload conflict"))
    );
    let token = add_operator(&app, "alice");
    let (status, problem) = resolve(&app, Some(&token), "poison-2", &skip(3, "old")).await;
    assert_eq!(
        (status, problem["title"].clone()),
        (409, json!("The dead letter's sequence is unknown"))
    );

    // A restart on the upgraded file runs no migration twice.
    let app = app.restart().await;
    assert_eq!(
        app.scalar("PRAGMA user_version"),
        production_lab::store::schema::current_version()
    );
    let (_, state) = get(&app, "/ordered/state").await;
    assert_eq!(state, json!({"applied": 3, "deadletters": 1, "last": 3}));
}

/// The token `operator add alice` printed when `release-v2.db` was made (only its hash is in the
/// file, as in any database).
pub(crate) const RELEASE_V2_ALICE: &str = "S2LvpZFmOl5E2cZW9YQsEhqXDvdgmCI8BhklzP9jMF4";

#[tokio::test]
async fn a_database_from_the_previous_release_opens_upgrades_and_keeps_its_evidence() {
    // Written by the release before the library (user_version 2): the classroom walk, acct-1
    // blocked and skipped by alice, acct-2 superseded by a corrected message, acct-3 blocked.
    let (_dir, app) = spawn_on_fixture("release-v2.db").await;
    let (_, state) = get(&app, "/ordered/state").await;
    assert_eq!(state, json!({"applied": 2, "deadletters": 1, "last": 2}));
    let (_, acct1) = get(&app, "/aggregates/acct-1").await;
    assert_eq!(
        (acct1["last"].clone(), acct1["total"].clone()),
        (json!(3), json!(10))
    );
    let (_, trail) = get(&app, "/resolutions").await;
    assert_eq!(trail["resolutions"][0]["operator"], "alice");
    assert_eq!(trail["resolutions"][0]["action"], "skip");

    // Existing dead letters are numbered in the order they were first seen, and page.
    let (_, first) = get(&app, "/deadletters?limit=2").await;
    assert_eq!(listed_ids(&first), ["poison-2", "a1-p2"]);
    let next = first["next"].as_i64().expect("a next page");
    let (_, second) = get(&app, &format!("/deadletters?limit=2&after={next}")).await;
    assert_eq!(listed_ids(&second), ["a2-p2", "a3-p1"]);
    assert_eq!(second["next"], Value::Null);

    // The old operator's token still works, and the blocked aggregate can be resolved.
    let (status, resolved) = resolve(
        &app,
        Some(RELEASE_V2_ALICE),
        "a3-p1",
        &replace(0, "a3-fix1", 4),
    )
    .await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["resolutionId"], 2);
    // Ids stay unique across old and new rows: a replay of an old message is still a replay.
    assert_eq!(deliver(&app, "acct-2", "a2-fix2", 2, 4).await.0, 200);
    assert_eq!(deliver(&app, "acct-3", "a3-p2", 2, -1).await.0, 422);
    let (_, letters) = get(&app, "/deadletters?aggregateId=acct-3").await;
    assert_eq!(letters["deadLetters"].as_array().unwrap().len(), 2);
}

async fn a_full_quarantine_refuses_new_poison_ids_with_429_and_writes_one_observation(
    backend: Backend,
) {
    let app = spawn_app_on_with(backend, |config| config.max_open_dead_letters = 3).await;
    assert_eq!(deliver(&app, "flood", "m-1", 1, 1).await.0, 200);
    for i in 0..3 {
        assert_eq!(
            deliver(&app, "flood", &format!("p-{i}"), 2, -1).await.0,
            422
        );
    }
    let rows_before = app.inbox_scalar("SELECT COUNT(*) FROM deadletters");
    for i in 3..10 {
        let response = app
            .post_json(
                "/aggregates/flood/messages",
                &json!({"messageId": format!("p-{i}"), "sequence": 2, "amount": -1}),
            )
            .await;
        assert_eq!(response.status(), 429);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(response.headers()["retry-after"], "60");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["outcome"], "quarantine full");
        assert_eq!(problem["openDeadLetters"], 3);
        assert_eq!(problem["limit"], 3);
    }
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM deadletters"),
        rows_before
    );
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'flood' AND kind = 'quarantine full'"),
        7
    );
    // A known poison id is still counted, and a valid message still takes the sequence.
    let (status, again) = deliver(&app, "flood", "p-0", 2, -1).await;
    assert_eq!(
        (status, again["deadLetter"]["observations"].clone()),
        (422, json!(2))
    );
    let (status, applied) = deliver(&app, "flood", "fix-2", 2, 1).await;
    assert_eq!(status, 200);
    assert_eq!(applied["superseded"].as_array().unwrap().len(), 3);
    // The classroom door keeps the same bound.
    let classroom = spawn_app_on_with(backend, |config| config.max_open_dead_letters = 1).await;
    let poison =
        |id: &str| json!({"messageId": id, "aggregateId": "demo", "sequence": 1, "amount": -1});
    assert_eq!(
        classroom
            .post_json("/ordered/apply", &poison("p-1"))
            .await
            .status(),
        422
    );
    let full = classroom.post_json("/ordered/apply", &poison("p-2")).await;
    assert_eq!(full.status(), 429);
    assert_eq!(full.headers()["retry-after"], "60");
}

async fn an_aggregate_says_when_its_list_of_open_dead_letters_is_cut(backend: Backend) {
    let app = spawn_app_on_with(backend, |config| config.max_open_dead_letters = 2000).await;
    assert_eq!(deliver(&app, "many", "m-1", 1, 1).await.0, 200);
    // Written straight into the store: 1,001 open dead letters through HTTP would be slow here.
    // The statements are the same in SQLite and PostgreSQL.
    app.inbox_execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1001)
         INSERT INTO deadletters(id, message_id, reason, aggregate_id, sequence, payload,
                                 first_seen, last_seen, observations, status)
         SELECT i, 'p-' || i, 'negative amount', 'many', 2, '{}', '2026-01-01T00:00:00.000Z',
                '2026-01-01T00:00:00.000Z', 1, 'open' FROM n;
         UPDATE aggregate_state SET status = 'blocked' WHERE aggregate_id = 'many';",
    );
    let (_, view) = get(&app, "/aggregates/many").await;
    assert_eq!(view["openDeadLetters"].as_array().unwrap().len(), 1000);
    assert_eq!(view["openDeadLetterCount"], 1001);
    assert_eq!(view["openDeadLettersTruncated"], true);
    let (_, page) = get(&app, "/deadletters?aggregateId=many&status=open&limit=1000").await;
    let next = page["next"].as_i64().expect("a next page");
    let (_, rest) = get(
        &app,
        &format!("/deadletters?aggregateId=many&status=open&after={next}"),
    )
    .await;
    assert_eq!(rest["deadLetters"].as_array().unwrap().len(), 1);
    assert_eq!(rest["deadLetters"][0]["messageId"], "p-1001");
    assert_eq!(rest["next"], Value::Null);
    assert_bad_request(app.get("/deadletters?after=-1").await).await;
}

/// Sends one request over a raw socket, path exactly as given (no client normalises it), and
/// returns the status and the body.
async fn raw_request(app: &TestApp, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", app.port))
        .await
        .expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        socket.read_to_string(&mut answer),
    )
    .await
    .expect("an answer within ten seconds")
    .expect("read the answer");
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn dot_segments_are_refused_as_aggregate_ids_in_every_spelling() {
    let app = spawn_app_on(Backend::Sqlite).await;
    let message = r#"{"messageId":"m-1","sequence":1,"amount":1}"#;
    for id in [".", "..", "%2e", "%2E", "%2e%2e", "%2E%2e", ".%2e", "%2e."] {
        for (method, path, body) in [
            ("POST", format!("/aggregates/{id}/messages"), message),
            ("GET", format!("/aggregates/{id}"), ""),
            ("GET", format!("/aggregates/{id}/timeline"), ""),
            ("GET", format!("/deadletters?aggregateId={id}"), ""),
            ("GET", format!("/resolutions?aggregateId={id}"), ""),
        ] {
            let (status, body) = raw_request(&app, method, &path, body).await;
            assert_eq!(status, 400, "{method} {path}: {body}");
            let problem: Value = serde_json::from_str(&body).expect("a problem body");
            assert!(
                problem["detail"].as_str().unwrap().contains("'.' or '..'"),
                "{method} {path}: {problem}"
            );
        }
    }
    assert_eq!(app.scalar("SELECT COUNT(*) FROM aggregate_state"), 0);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
}

#[tokio::test]
async fn two_authorization_headers_are_an_ambiguous_credential_and_resolve_nothing() {
    let app = spawn_app_on(Backend::Sqlite).await;
    let alice = add_operator(&app, "alice");
    blocked_aggregate(&app).await;
    let before = ordering_rows(&app);
    // A valid token first and a bogus one after, and the other way round: neither is guessed.
    for (first, second) in [
        (format!("Bearer {alice}"), "Bearer forged".to_owned()),
        ("Bearer forged".to_owned(), format!("Bearer {alice}")),
    ] {
        let response = app
            .client
            .post(app.url("/deadletters/poison-2/resolution"))
            .header("authorization", first)
            .header("authorization", second)
            .json(&skip(1, "two voices"))
            .send()
            .await
            .unwrap();
        let problem = assert_bad_request(response).await;
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("Authorization"),
            "{problem}"
        );
    }
    assert_eq!(ordering_rows(&app), before);
    assert_eq!(dead_letter_status(&app, "poison-2"), "open");
}

crate::on_both_backends!(
    many_aggregates_interleaved_keep_their_own_sequences,
    each_verdict_says_what_the_caller_can_do,
    a_quarantined_id_resent_unchanged_is_quarantined_again_with_a_growing_observation_count,
    concurrent_deliveries_at_the_general_door_apply_once_and_count_every_observation,
    a_corrected_message_under_a_new_id_supersedes_the_open_dead_letter,
    blocked_and_waiting_aggregates_are_listed_oldest_first,
    rejection_observations_are_bounded_per_aggregate_while_state_events_stay,
    the_timeline_tells_the_story_in_order_and_pages,
    every_request_shape_error_at_the_general_door_is_a_400_problem,
    both_doors_share_one_identity_and_one_set_of_rows,
    the_operator_cli_prints_a_token_once_and_keeps_only_its_hash,
    resolution_without_an_operator_token_is_401_and_changes_nothing,
    replace_applies_the_replacement_and_only_then_is_the_next_sequence_eligible,
    skip_records_an_explicit_skip_with_zero_effect_and_advances_by_one,
    two_operators_racing_with_the_same_expected_last_resolve_exactly_once,
    an_identical_repeat_answers_the_original_result_and_a_different_one_conflicts,
    a_dry_run_reports_the_resulting_state_and_writes_nothing,
    resolution_preconditions_refuse_with_the_current_state,
    a_full_quarantine_refuses_new_poison_ids_with_429_and_writes_one_observation,
    an_aggregate_says_when_its_list_of_open_dead_letters_is_cut,
);
