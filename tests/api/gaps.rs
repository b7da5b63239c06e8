//! Gaps that never fill, over real HTTP (and a real nats-server for the broker door) on both
//! backends: a waiting aggregate says what it misses, an operator skips it with an audited gap
//! resolution that drains the held successors in its own transaction, and a skipped sequence
//! that arrives late is never applied.

use async_nats::jetstream;
use serde_json::{Value, json};

use crate::aggregates::{add_operator, resolve_at};
use crate::broker::{jetstream_of, publish_ordered, spawn_consumer_on, start_nats};
use crate::console::next_event;
use crate::helpers::{
    Backend, TestApp, assert_bad_request, command, content_type, poll_until, spawn_app_on,
    status_and_json,
};

async fn deliver(app: &TestApp, aggregate: &str, id: &str, sequence: i64) -> (u16, Value) {
    let body = json!({"messageId": id, "sequence": sequence, "amount": sequence});
    status_and_json(
        app.post_json(&format!("/aggregates/{aggregate}/messages"), &body)
            .await,
    )
    .await
}

async fn get(app: &TestApp, path: &str) -> Value {
    let (status, body) = status_and_json(app.get(path).await).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

fn skip(from: i64, through: i64, expected_last: i64) -> Value {
    json!({
        "action": "skip",
        "from": from,
        "through": through,
        "expectedLast": expected_last,
        "reason": "lost upstream: the producer crashed before sending it",
    })
}

/// `POST /aggregates/{aggregate}/gaps/resolution{query}`.
async fn resolve_gap(
    app: &TestApp,
    token: Option<&str>,
    aggregate: &str,
    query: &str,
    body: &Value,
) -> (u16, Value) {
    let path = format!("/aggregates/{aggregate}/gaps/resolution{query}");
    resolve_at(app, token, &path, body).await
}

/// An aggregate at last 4 through the general door, with 6, 7 and 8 refused as gaps (5 lost).
async fn waiting_without_5(app: &TestApp, aggregate: &str) {
    for sequence in 1..=4 {
        let id = format!("{aggregate}-{sequence}");
        assert_eq!(deliver(app, aggregate, &id, sequence).await.0, 200);
    }
    for sequence in [8, 6, 7] {
        let (status, body) =
            deliver(app, aggregate, &format!("{aggregate}-{sequence}"), sequence).await;
        assert_eq!((status, body["outcome"].as_str()), (409, Some("gap")));
    }
}

/// Every row a gap resolution could write, to prove that nothing changed.
fn gap_rows(app: &TestApp) -> Vec<String> {
    let mut rows = Vec::new();
    for table in [
        "aggregate_state",
        "ordered_inbox",
        "deadletters",
        "held_messages",
        "aggregate_timeline",
        "resolutions",
        "gap_resolutions",
        "refused_gaps",
    ] {
        let mut table_rows: Vec<String> = app
            .inbox_rows(&format!("SELECT * FROM {table}"))
            .into_iter()
            .map(|row| format!("{table}: {row}"))
            .collect();
        table_rows.sort();
        rows.extend(table_rows);
    }
    rows
}

/// The timeline's kinds with their sequences, oldest first.
async fn timeline(app: &TestApp, aggregate: &str) -> Vec<Value> {
    let body = get(app, &format!("/aggregates/{aggregate}/timeline?limit=1000")).await;
    body["events"].as_array().cloned().unwrap_or_default()
}

fn kinds_from(events: &[Value], kind: &str) -> Vec<String> {
    let start = events
        .iter()
        .position(|event| event["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} event in {events:#?}"));
    events[start..]
        .iter()
        .map(|event| {
            format!(
                "{} {}",
                event["kind"].as_str().unwrap_or(""),
                event["sequence"]
            )
        })
        .collect()
}

/// One series' value in the metrics page.
async fn metric(app: &TestApp, series: &str) -> f64 {
    let response = app.get("/metrics").await;
    let text = response.text().await.expect("metrics text");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
}

async fn a_lost_sequence_on_the_general_door_is_told_skipped_and_its_successors_apply_when_resent(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let operator = add_operator(&app, "alice");
    waiting_without_5(&app, "acct").await;

    let view = get(&app, "/aggregates/acct").await;
    assert_eq!(view["status"], "waiting");
    assert_eq!(view["missing"], json!({"from": 5, "through": 5}), "{view}");
    assert_eq!(view["waitingSince"], view["since"]);
    let gaps = get(&app, "/aggregates/acct/gaps").await;
    assert_eq!(
        gaps,
        json!({"aggregateId": "acct", "missing": {"from": 5, "through": 5},
               "waitingSince": view["since"], "heldSequences": []})
    );
    let inventory = get(&app, "/aggregates?status=waiting").await;
    assert_eq!(
        inventory["aggregates"][0]["missing"],
        json!({"from": 5, "through": 5})
    );
    assert_eq!(
        metric(&app, "inbox_aggregates{status=\"waiting\"}").await,
        1.0
    );
    assert!(metric(&app, "inbox_longest_waiting_seconds").await >= 0.0);

    // A dry run writes nothing.
    let before = gap_rows(&app);
    let (status, dry) = resolve_gap(
        &app,
        Some(&operator),
        "acct",
        "?dryRun=true",
        &skip(5, 5, 4),
    )
    .await;
    assert_eq!(
        (status, dry["outcome"].as_str()),
        (200, Some("dry run")),
        "{dry}"
    );
    assert_eq!(dry["resolutionId"], Value::Null);
    assert_eq!(gap_rows(&app), before, "a dry run writes nothing");

    let (status, resolved) = resolve_gap(&app, Some(&operator), "acct", "", &skip(5, 5, 4)).await;
    assert_eq!(
        (status, resolved["outcome"].as_str()),
        (200, Some("resolved")),
        "{resolved}"
    );
    let id = resolved["resolutionId"].as_i64().expect("a resolution id");
    assert_eq!(resolved["before"], json!({"last": 4, "total": 10}));
    assert_eq!(resolved["after"], json!({"last": 5, "total": 10}));
    assert_eq!(
        (resolved["from"].as_i64(), resolved["through"].as_i64()),
        (Some(5), Some(5))
    );
    assert_eq!(
        resolved["drained"],
        json!([]),
        "the general door held nothing"
    );
    let view = get(&app, "/aggregates/acct").await;
    assert_eq!(
        (view["last"].as_i64(), view["status"].as_str()),
        (Some(5), Some("flowing"))
    );
    assert_eq!(view["missing"], Value::Null);

    // The refused successors apply when the producer resends them; the late 5 never does.
    for sequence in 6..=8 {
        assert_eq!(
            deliver(&app, "acct", &format!("acct-{sequence}"), sequence)
                .await
                .0,
            200
        );
    }
    let (status, late) = deliver(&app, "acct", "late-5", 5).await;
    assert_eq!(
        (status, late["outcome"].as_str()),
        (409, Some("stale")),
        "{late}"
    );
    assert_eq!(late["skippedBy"], id);
    assert_eq!(get(&app, "/aggregates/acct").await["total"], 31);
    let events = timeline(&app, "acct").await;
    let stale = events.last().expect("the late arrival's observation");
    assert_eq!(stale["kind"], "stale");
    assert_eq!(stale["detail"], json!({"expected": 9, "skippedBy": id}));
    let skipped = events
        .iter()
        .find(|e| e["kind"] == "gap skipped")
        .expect("gap skipped");
    assert_eq!(skipped["detail"]["resolutionId"], id);
    assert_eq!(skipped["detail"]["operator"], "alice");

    // The audit trail lists it, and an identical repeat answers the same resolution.
    let trail = get(&app, "/resolutions?aggregateId=acct").await;
    let row = &trail["resolutions"][0];
    assert_eq!(
        (row["resolutionId"].as_i64(), row["from"].as_i64()),
        (Some(id), Some(5))
    );
    assert_eq!(
        row["reason"],
        "lost upstream: the producer crashed before sending it"
    );
    assert_eq!(row["operator"], "alice");
    let rows = gap_rows(&app);
    let (status, repeat) = resolve_gap(&app, Some(&operator), "acct", "", &skip(5, 5, 4)).await;
    assert_eq!((status, &repeat), (200, &resolved), "an identical repeat");
    assert_eq!(gap_rows(&app), rows, "a repeat changes nothing");
    let mut other = skip(5, 5, 4);
    other["reason"] = json!("changed my mind");
    let (status, refused) = resolve_gap(&app, Some(&operator), "acct", "", &other).await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap_or("")
            .contains(&format!("resolution {id}"))
    );
}

async fn consumer(
    backend: Backend,
) -> (lab_testkit::nats::NatsServer, TestApp, jetstream::Context) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    (nats, app, js)
}

async fn a_lost_sequence_on_the_broker_door_is_skipped_and_the_held_successors_apply_in_its_transaction(
    backend: Backend,
) {
    let (_nats, app, js) = consumer(backend).await;
    let operator = add_operator(&app, "alice");
    for sequence in [1, 2, 3, 4, 6, 7, 8] {
        publish_ordered(
            &js,
            None,
            "acct",
            &format!("m-{sequence}"),
            sequence,
            sequence,
        )
        .await;
    }
    let (_, view) = poll_until(
        "acct holds 6, 7 and 8",
        || async { status_and_json(app.get("/aggregates/acct").await).await },
        |(_, view)| view["heldSequences"] == json!([6, 7, 8]) && view["last"] == 4,
    )
    .await;
    assert_eq!(view["missing"], json!({"from": 5, "through": 5}), "{view}");
    assert_eq!(
        get(&app, "/aggregates/acct/gaps").await["heldSequences"],
        json!([6, 7, 8])
    );
    assert_eq!(metric(&app, "inbox_held_messages").await, 3.0);

    // A held message is not missing.
    let (status, refused) = resolve_gap(&app, Some(&operator), "acct", "", &skip(5, 6, 4)).await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["detail"].as_str().unwrap_or("").contains("m-6"),
        "{refused}"
    );
    assert_eq!(refused["current"]["heldSequences"], json!([6, 7, 8]));

    let before = gap_rows(&app);
    let (status, dry) = resolve_gap(
        &app,
        Some(&operator),
        "acct",
        "?dryRun=true",
        &skip(5, 5, 4),
    )
    .await;
    assert_eq!(status, 200, "{dry}");
    let sequences = |answer: &Value| -> Vec<i64> {
        answer["drained"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["sequence"].as_i64())
            .collect()
    };
    assert_eq!(
        sequences(&dry),
        [6, 7, 8],
        "the dry run tells what would drain"
    );
    assert_eq!(gap_rows(&app), before, "a dry run writes nothing");

    let (status, resolved) = resolve_gap(&app, Some(&operator), "acct", "", &skip(5, 5, 4)).await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(sequences(&resolved), [6, 7, 8]);
    assert!(
        resolved["drained"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|d| d["outcome"] == "applied")
    );
    let view = get(&app, "/aggregates/acct").await;
    assert_eq!(
        (view["last"].as_i64(), view["total"].as_i64()),
        (Some(8), Some(31))
    );
    assert_eq!(
        (view["status"].as_str(), &view["heldSequences"]),
        (Some("flowing"), &json!([]))
    );
    // Decided and written together: each drained message carries the resolution's time.
    let applied_at = app.inbox_rows(
        "SELECT applied_at FROM ordered_inbox WHERE aggregate_id = 'acct' AND sequence >= 6",
    );
    assert_eq!(
        applied_at,
        vec![resolved["resolvedAt"].as_str().unwrap_or("").to_owned(); 3]
    );
    let events = timeline(&app, "acct").await;
    assert_eq!(
        kinds_from(&events, "gap skipped"),
        [
            "gap skipped 5",
            "drained 6",
            "applied 6",
            "drained 7",
            "applied 7",
            "drained 8",
            "applied 8"
        ]
    );

    // The late 5 is terminated and listed as rejected, naming the skip.
    publish_ordered(&js, None, "acct", "m-5", 5, 5).await;
    let rejected = poll_until(
        "the late 5 is rejected",
        || get(&app, "/broker/rejected"),
        |body| {
            body["rejected"]
                .as_array()
                .is_some_and(|list| !list.is_empty())
        },
    )
    .await;
    let entry = &rejected["rejected"][0];
    assert_eq!(
        (entry["messageId"].as_str(), entry["outcome"].as_str()),
        (Some("m-5"), Some("stale"))
    );
    let id = resolved["resolutionId"].as_i64().unwrap_or_default();
    assert!(
        entry["reason"]
            .as_str()
            .unwrap_or("")
            .contains(&format!("gap resolution {id}")),
        "{entry}"
    );
    let last = timeline(&app, "acct").await.pop().expect("an observation");
    assert_eq!(last["detail"], json!({"expected": 9, "skippedBy": id}));
    assert_eq!(
        get(&app, "/aggregates/acct").await["total"],
        31,
        "never applied"
    );
}

async fn a_late_message_racing_the_skip_of_its_sequence_loses_or_wins_whole_naming_the_winner(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let operator = add_operator(&app, "alice");
    let (mut message_won, mut skip_won) = (0, 0);
    for round in 0..8 {
        let aggregate = format!("race-{round}");
        waiting_without_5(&app, &aggregate).await;
        let body = skip(5, 5, 4);
        let late = format!("{aggregate}-late-5");
        let ((delivered, answer), (resolved, resolution)) = tokio::join!(
            deliver(&app, &aggregate, &late, 5),
            resolve_gap(&app, Some(&operator), &aggregate, "", &body),
        );
        match (delivered, resolved) {
            (200, 409) => {
                message_won += 1;
                let detail = resolution["detail"].as_str().unwrap_or("");
                assert!(
                    detail.contains(&late),
                    "the refusal names the winner: {resolution}"
                );
                assert_eq!(resolution["current"]["last"], 5);
            }
            (409, 200) => {
                skip_won += 1;
                assert_eq!(answer["outcome"], "stale");
                assert_eq!(answer["skippedBy"], resolution["resolutionId"], "{answer}");
                assert_eq!(
                    get(&app, &format!("/aggregates/{aggregate}")).await["total"],
                    10
                );
            }
            other => panic!("exactly one wins, got {other:?}: {answer} {resolution}"),
        }
    }
    assert_eq!(message_won + skip_won, 8);
}

async fn a_gap_resolution_needs_an_active_operators_token(backend: Backend) {
    let app = spawn_app_on(backend).await;
    waiting_without_5(&app, "acct").await;
    let (status, body) = resolve_gap(&app, None, "acct", "", &skip(5, 5, 4)).await;
    assert_eq!(status, 401, "no operator yet: {body}");
    let token = add_operator(&app, "alice");
    let response = app
        .client
        .post(app.url("/aggregates/acct/gaps/resolution"))
        .json(&skip(5, 5, 4))
        .send()
        .await
        .expect("POST reaches the server");
    assert_eq!(response.status(), 401);
    assert!(response.headers().contains_key("www-authenticate"));
    assert!(content_type(&response).starts_with("application/problem+json"));
    let (status, _) = resolve_gap(&app, Some("not-a-token"), "acct", "", &skip(5, 5, 4)).await;
    assert_eq!(status, 401);
    let revoked = command()
        .args(["operator", "revoke", "alice"])
        .args(app.operator_store_args())
        .output()
        .expect("run operator revoke");
    assert!(revoked.status.success());
    let (status, _) = resolve_gap(&app, Some(&token), "acct", "?dryRun=true", &skip(5, 5, 4)).await;
    assert_eq!(status, 401, "a revoked token");
    assert_eq!(
        get(&app, "/aggregates/acct").await["last"],
        4,
        "nothing changed"
    );
}

async fn a_gap_resolution_against_the_state_answers_409_with_the_current_state(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let operator = add_operator(&app, "alice");
    waiting_without_5(&app, "acct").await;
    let before = gap_rows(&app);
    let cases = [
        (skip(5, 5, 3), "expectedLast is 3"),
        (skip(6, 7, 4), "expects sequence 5"),
        (skip(3, 5, 4), "acct-3"),
    ];
    for (body, says) in cases {
        let (status, refused) = resolve_gap(&app, Some(&operator), "acct", "", &body).await;
        assert_eq!(status, 409, "{body}: {refused}");
        assert!(
            refused["detail"].as_str().unwrap_or("").contains(says),
            "{refused}"
        );
        assert_eq!(refused["current"]["last"], 4);
        assert_eq!(
            refused["current"]["missing"],
            json!({"from": 5, "through": 5})
        );
    }
    assert_eq!(gap_rows(&app), before, "the refusals wrote nothing");
    // A dead letter at `from` is a dead letter's resolution.
    assert_eq!(deliver(&app, "b", "b-1", 1).await.0, 200);
    let poison = json!({"messageId": "poison-2", "sequence": 2, "amount": -1});
    assert_eq!(
        app.post_json("/aggregates/b/messages", &poison)
            .await
            .status(),
        422
    );
    let (status, refused) = resolve_gap(&app, Some(&operator), "b", "", &skip(2, 2, 1)).await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap_or("")
            .contains("poison-2")
    );
    let (status, _) = resolve_gap(&app, Some(&operator), "nobody", "", &skip(1, 1, 0)).await;
    assert_eq!(status, 404);
}

async fn a_malformed_gap_resolution_answers_400_problems(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let operator = add_operator(&app, "alice");
    waiting_without_5(&app, "acct").await;
    let bodies = [
        json!({"action": "skip", "from": 6, "through": 5, "expectedLast": 4, "reason": "r"}),
        json!({"action": "skip", "from": 0, "through": 5, "expectedLast": 4, "reason": "r"}),
        json!({"action": "replace", "from": 5, "through": 5, "expectedLast": 4, "reason": "r"}),
        json!({"action": "skip", "from": 5, "through": 5, "expectedLast": -1, "reason": "r"}),
        json!({"action": "skip", "from": 5, "through": 5, "expectedLast": 4, "reason": "  "}),
        json!({"action": "skip", "from": 5, "expectedLast": 4, "reason": "r"}),
        json!({"action": "skip", "from": "5", "through": 5, "expectedLast": 4, "reason": "r"}),
        json!({"action": "skip", "from": 5, "through": 9007199254740993_i64, "expectedLast": 4, "reason": "r"}),
        json!([1, 2]),
    ];
    for body in bodies {
        let response = app
            .client
            .post(app.url("/aggregates/acct/gaps/resolution"))
            .bearer_auth(&operator)
            .json(&body)
            .send()
            .await
            .expect("POST reaches the server");
        assert_bad_request(response).await;
    }
    let response = app
        .client
        .post(app.url("/aggregates/acct/gaps/resolution"))
        .bearer_auth(&operator)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("POST reaches the server");
    assert_bad_request(response).await;
    let response = app
        .client
        .post(app.url("/aggregates/bad%20id/gaps/resolution"))
        .bearer_auth(&operator)
        .json(&skip(5, 5, 4))
        .send()
        .await
        .expect("POST reaches the server");
    assert_bad_request(response).await;
    assert_bad_request(app.get("/aggregates/bad%20id/gaps").await).await;
    assert_eq!(get(&app, "/aggregates/acct").await["last"], 4);
}

crate::on_both_backends!(
    a_lost_sequence_on_the_general_door_is_told_skipped_and_its_successors_apply_when_resent,
    a_lost_sequence_on_the_broker_door_is_skipped_and_the_held_successors_apply_in_its_transaction,
    a_late_message_racing_the_skip_of_its_sequence_loses_or_wins_whole_naming_the_winner,
    a_gap_resolution_needs_an_active_operators_token,
    a_gap_resolution_against_the_state_answers_409_with_the_current_state,
    a_malformed_gap_resolution_answers_400_problems,
);

#[tokio::test]
async fn a_gap_resolution_is_counted_and_told_to_the_console_event_stream() {
    let app = spawn_app_on(Backend::Sqlite).await;
    let operator = add_operator(&app, "alice");
    waiting_without_5(&app, "acct").await;
    let events = app.get("/console/events").await;
    assert_eq!(events.status(), 200);
    let mut stream = events.bytes_stream();
    let mut buffer = String::new();
    assert_eq!(next_event(&mut stream, &mut buffer, "hello").await, "live");

    let (status, preview) = resolve_gap(
        &app,
        Some(&operator),
        "acct",
        "?dryRun=true",
        &skip(5, 5, 4),
    )
    .await;
    assert_eq!(status, 200, "{preview}");
    let (status, resolved) = resolve_gap(&app, Some(&operator), "acct", "", &skip(5, 5, 4)).await;
    assert_eq!(status, 200, "{resolved}");
    // The dry run wrote nothing and says nothing: the first change is the resolution.
    let change: Value =
        serde_json::from_str(&next_event(&mut stream, &mut buffer, "change").await).expect("json");
    assert_eq!(
        change,
        json!({"aggregateId": "acct", "messageId": "", "change": "gap resolved"})
    );

    let counted = |outcome: &str| {
        format!(r#"inbox_resolutions_total{{action="skip_gap",outcome="{outcome}"}}"#)
    };
    assert_eq!(metric(&app, &counted("dry_run")).await, 1.0);
    assert_eq!(metric(&app, &counted("resolved")).await, 1.0);
    assert_eq!(metric(&app, &counted("conflict")).await, 0.0);
}
