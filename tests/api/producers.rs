//! Producers, epochs and ownership on the general door: sessions issue epochs, an
//! older epoch is fenced, an aggregate belongs to the producer that claimed it, an operator may
//! transfer it; over real HTTP, real files and the real CLI.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{Value, json};

use crate::aggregates::{RELEASE_V2_ALICE, add_operator, spawn_on_fixture};
use crate::helpers::{Backend, TestApp, command, poll_until, spawn_app_on, status_and_json};

/// Runs `production-lab producer ARGS` as a process on the app's inbox (`--database PATH` or
/// `--inbox URL`).
pub(crate) fn producer_command(args: &[&str], app: &TestApp) -> std::process::Output {
    command()
        .arg("producer")
        .args(args)
        .args(app.operator_store_args())
        .output()
        .expect("run the producer command")
}

/// Registers a producer through the CLI and returns the token it printed.
pub(crate) fn add_producer(app: &TestApp, name: &str) -> String {
    let output = producer_command(&["add", name], app);
    assert!(
        output.status.success(),
        "producer add failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let token = String::from_utf8(output.stdout).expect("utf-8 token");
    let token = token.trim().to_owned();
    assert_eq!(token.lines().count(), 1, "stdout is the token alone");
    token
}

/// `POST /producers/session` with `token`.
async fn session(app: &TestApp, token: &str) -> (u16, Value) {
    let response = app
        .client
        .post(app.url("/producers/session"))
        .bearer_auth(token)
        .send()
        .await
        .expect("POST reaches the server");
    status_and_json(response).await
}

/// A new session's epoch.
pub(crate) async fn epoch(app: &TestApp, token: &str) -> i64 {
    let (status, body) = session(app, token).await;
    assert_eq!(status, 200, "{body}");
    body["epoch"].as_i64().expect("an epoch")
}

/// A delivery of amount 1 with the producer's token and epoch (`None`: anonymous).
async fn send(
    app: &TestApp,
    producer: Option<(&str, i64)>,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
) -> (u16, Value) {
    send_amount(app, producer, aggregate, message_id, sequence, 1).await
}

/// A delivery with the producer's token and epoch (`None`: anonymous).
async fn send_amount(
    app: &TestApp,
    producer: Option<(&str, i64)>,
    aggregate: &str,
    message_id: &str,
    sequence: i64,
    amount: i64,
) -> (u16, Value) {
    let body = json!({"messageId": message_id, "sequence": sequence, "amount": amount});
    let mut request = app
        .client
        .post(app.url(&format!("/aggregates/{aggregate}/messages")))
        .json(&body);
    if let Some((token, epoch)) = producer {
        request = request
            .bearer_auth(token)
            .header("producer-epoch", epoch.to_string());
    }
    status_and_json(request.send().await.expect("POST reaches the server")).await
}

/// A delivery of amount 1 to `acct` with the producer's token and a `Producer-Epoch` header
/// spelled exactly `epoch`.
async fn send_epoch_spelled(
    app: &TestApp,
    token: &str,
    epoch: &str,
    message_id: &str,
    sequence: i64,
) -> reqwest::Response {
    app.client
        .post(app.url("/aggregates/acct/messages"))
        .bearer_auth(token)
        .header("producer-epoch", epoch)
        .json(&json!({"messageId": message_id, "sequence": sequence, "amount": 1}))
        .send()
        .await
        .expect("POST reaches the server")
}

async fn get(app: &TestApp, path: &str) -> (u16, Value) {
    status_and_json(app.get(path).await).await
}

async fn transfer(
    app: &TestApp,
    token: Option<&str>,
    aggregate: &str,
    body: &Value,
) -> (u16, Value) {
    let mut request = app
        .client
        .post(app.url(&format!("/aggregates/{aggregate}/owner")))
        .json(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    status_and_json(request.send().await.expect("POST reaches the server")).await
}

fn applied_count(app: &TestApp, aggregate: &str) -> i64 {
    // Test aggregate ids are plain words; the quote check keeps this literal honest.
    assert!(!aggregate.contains('\''));
    app.inbox_scalar(&format!(
        "SELECT COUNT(*) FROM ordered_inbox WHERE aggregate_id = '{aggregate}'"
    ))
}

async fn a_session_issues_the_next_epoch_and_the_first_delivery_claims_a_fresh_aggregate(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    let (status, first) = session(&app, &billing).await;
    assert_eq!(
        (status, first),
        (200, json!({"producer": "billing", "epoch": 1}))
    );
    let current = epoch(&app, &billing).await;
    assert_eq!(current, 2);

    let (status, applied) = send(&app, Some((&billing, 2)), "acct", "m-1", 1).await;
    assert_eq!(status, 200, "{applied}");
    let (_, view) = get(&app, "/aggregates/acct").await;
    assert_eq!(view["owner"], json!({"producer": "billing", "epoch": 2}));
    let (_, timeline) = get(&app, "/aggregates/acct/timeline").await;
    let claimed = &timeline["events"][0];
    assert_eq!(claimed["kind"], "claimed", "{timeline}");
    assert_eq!(
        claimed["detail"],
        json!({"producer": "billing", "epoch": 2})
    );

    let (status, listed) = get(&app, "/producers").await;
    assert_eq!(status, 200);
    let entry = &listed["producers"][0];
    assert_eq!(entry["name"], "billing");
    assert_eq!(entry["currentEpoch"], 2);
    assert_eq!(entry["ownedAggregates"], 1);
    assert!(entry["lastDeliveryAt"].is_string(), "{listed}");
    assert!(!listed.to_string().contains(&billing), "never a token");

    // Anonymous deliveries to unowned aggregates keep working exactly as before.
    assert_eq!(send(&app, None, "open", "o-1", 1).await.0, 200);
    let (_, open) = get(&app, "/aggregates/open").await;
    assert_eq!(open["owner"], Value::Null);
}

async fn each_ownership_and_epoch_rule_answers_its_own_status_and_writes_nothing(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    let shipping = add_producer(&app, "shipping");
    // A token without a session: 409, documented.
    let (status, problem) = send(&app, Some((&billing, 1)), "acct", "m-1", 1).await;
    assert_eq!(
        (status, problem["outcome"].clone()),
        (409, json!("no session"))
    );
    assert_eq!(epoch(&app, &billing).await, 1);
    assert_eq!(epoch(&app, &billing).await, 2);
    assert_eq!(epoch(&app, &shipping).await, 1);
    assert_eq!(
        send(&app, Some((&billing, 2)), "acct", "m-1", 1).await.0,
        200
    );

    // A token without Producer-Epoch, or with a malformed one: 400.
    let bare = app
        .client
        .post(app.url("/aggregates/acct/messages"))
        .bearer_auth(&billing)
        .json(&json!({"messageId": "m-2", "sequence": 2, "amount": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 400);
    for malformed in ["two", "0", "-1", "1.5", ""] {
        let response = send_epoch_spelled(&app, &billing, malformed, "m-2", 2).await;
        assert_eq!(response.status(), 400, "{malformed:?}");
    }
    // Two Authorization headers are an ambiguous credential: 400, as for operators.
    let twice = app
        .client
        .post(app.url("/aggregates/acct/messages"))
        .header("authorization", format!("Bearer {billing}"))
        .header("authorization", format!("Bearer {shipping}"))
        .header("producer-epoch", "2")
        .json(&json!({"messageId": "m-2", "sequence": 2, "amount": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 400);
    // An epoch never issued: 400.
    let (status, problem) = send(&app, Some((&billing, 3)), "acct", "m-2", 2).await;
    assert_eq!((status, problem["currentEpoch"].clone()), (400, json!(2)));
    // An older epoch: fenced, not retryable, with the current epoch.
    let (status, fenced) = send(&app, Some((&billing, 1)), "acct", "m-2", 2).await;
    assert_eq!(status, 409, "{fenced}");
    assert_eq!(fenced["outcome"], "fenced");
    assert_eq!(fenced["retryable"], false);
    assert_eq!(fenced["currentEpoch"], 2);
    // Another producer: 403 with the owner's name.
    let (status, forbidden) = send(&app, Some((&shipping, 1)), "acct", "s-2", 2).await;
    assert_eq!(
        (status, forbidden["owner"].clone()),
        (403, json!("billing"))
    );
    // Anonymous to an owned aggregate: 401 with a challenge.
    let anonymous = app
        .post_json(
            "/aggregates/acct/messages",
            &json!({"messageId": "x-2", "sequence": 2, "amount": 1}),
        )
        .await;
    assert_eq!(anonymous.status(), 401);
    assert!(anonymous.headers().contains_key("www-authenticate"));
    // An aggregate with history but no owner is claimed only by an operator.
    assert_eq!(send(&app, None, "legacy", "l-1", 1).await.0, 200);
    let (status, problem) = send(&app, Some((&billing, 2)), "legacy", "l-2", 2).await;
    assert_eq!(
        (status, problem["outcome"].clone()),
        (403, json!("claim requires operator"))
    );
    assert_eq!(applied_count(&app, "acct"), 1);
    assert_eq!(applied_count(&app, "legacy"), 1);

    // A revoked producer: 401 on deliveries and sessions, and its name is never reused.
    assert!(
        producer_command(&["revoke", "billing"], &app)
            .status
            .success()
    );
    assert_eq!(
        send(&app, Some((&billing, 2)), "acct", "m-2", 2).await.0,
        401
    );
    assert_eq!(session(&app, &billing).await.0, 401);
    let again = producer_command(&["add", "billing"], &app);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("names are not reused"));
    let listed = producer_command(&["list"], &app);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(
        text.contains("billing") && text.contains("revoked"),
        "{text}"
    );
    assert_eq!(applied_count(&app, "acct"), 1);
}

async fn a_restarted_producer_fences_every_later_delivery_of_its_old_instance(backend: Backend) {
    let app = Arc::new(spawn_app_on(backend).await);
    let token = Arc::new(add_producer(&app, "billing"));
    let old = epoch(&app, &token).await;
    let started_new = Arc::new(AtomicBool::new(false));
    let aggregates = ["r-0", "r-1", "r-2", "r-3"];
    let mut senders = Vec::new();
    for aggregate in aggregates {
        let (app, token, started_new) = (app.clone(), token.clone(), started_new.clone());
        senders.push(tokio::spawn(async move {
            // The old instance keeps sending until it has seen a fence for a while.
            let mut results = Vec::new();
            let mut sequence = 1;
            loop {
                let after_new = started_new.load(Ordering::SeqCst);
                let id = format!("{aggregate}-{sequence}");
                let (status, _) = send(&app, Some((&token, old)), aggregate, &id, sequence).await;
                results.push((after_new, status));
                if status == 200 {
                    sequence += 1;
                }
                if after_new && results.iter().filter(|(after, _)| *after).count() >= 5 {
                    return results;
                }
            }
        }));
    }
    // Let the old instance get going, then start the new one.
    poll_until(
        "the old instance applied a few messages",
        || async { app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox") },
        |count| *count >= 8,
    )
    .await;
    let new = epoch(&app, &token).await;
    started_new.store(true, Ordering::SeqCst);
    assert_eq!(new, old + 1);
    let mut applied_by_old = 0;
    for sender in senders {
        let results = sender.await.unwrap();
        for (after_new, status) in &results {
            if *after_new {
                assert_eq!(
                    *status, 409,
                    "every old-epoch delivery after the new session"
                );
            }
        }
        applied_by_old += results.iter().filter(|(_, status)| *status == 200).count() as i64;
    }
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"),
        applied_by_old
    );
    // The new instance carries on where the old one stopped.
    for aggregate in aggregates {
        let (_, view) = get(&app, &format!("/aggregates/{aggregate}")).await;
        let next = view["last"].as_i64().unwrap() + 1;
        let (status, body) = send(
            &app,
            Some((&token, new)),
            aggregate,
            &format!("{aggregate}-new-{next}"),
            next,
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
}

async fn two_producers_racing_to_claim_a_fresh_aggregate_leave_exactly_one_owner(backend: Backend) {
    let app = Arc::new(spawn_app_on(backend).await);
    let billing = add_producer(&app, "billing");
    let shipping = add_producer(&app, "shipping");
    let (b, s) = (epoch(&app, &billing).await, epoch(&app, &shipping).await);
    for round in 0..20 {
        let aggregate = format!("fresh-{round}");
        let (b_id, s_id) = (format!("{aggregate}-b-1"), format!("{aggregate}-s-1"));
        let one = send(&app, Some((&billing, b)), &aggregate, &b_id, 1);
        let two = send(&app, Some((&shipping, s)), &aggregate, &s_id, 1);
        let ((first, _), (second, _)) = tokio::join!(one, two);
        let mut statuses = [first, second];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 403], "{aggregate}");
        let (_, view) = get(&app, &format!("/aggregates/{aggregate}")).await;
        let owner = view["owner"]["producer"].as_str().unwrap().to_owned();
        let winner = if first == 200 { "billing" } else { "shipping" };
        assert_eq!(owner, winner);
        assert_eq!(applied_count(&app, &aggregate), 1);
    }
}

async fn a_refused_delivery_to_a_fresh_aggregate_leaves_it_unowned_for_the_next_producer(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    let shipping = add_producer(&app, "shipping");
    let (b, s) = (epoch(&app, &billing).await, epoch(&app, &shipping).await);
    // A gap: sequence 3 first.
    let (status, gap) = send(&app, Some((&billing, b)), "fresh", "b-3", 3).await;
    assert_eq!(
        (status, gap["outcome"].clone(), gap["expected"].clone()),
        (409, json!("gap"), json!(1))
    );
    // A payload conflict: billing's m-1 is a message of another aggregate.
    assert_eq!(
        send(&app, Some((&billing, b)), "other", "m-1", 1).await.0,
        200
    );
    let (status, conflict) = send(&app, Some((&billing, b)), "fresh", "m-1", 1).await;
    assert_eq!(
        (status, conflict["outcome"].clone()),
        (409, json!("payload conflict"))
    );
    // Neither left a trace: no owner, no row, no event.
    let (status, _) = get(&app, "/aggregates/fresh").await;
    assert_eq!(status, 404);
    let (_, timeline) = get(&app, "/aggregates/fresh/timeline").await;
    assert_eq!(timeline["events"], json!([]), "{timeline}");
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'fresh'"),
        0
    );
    let (_, listed) = get(&app, "/producers").await;
    assert_eq!(listed["producers"][0]["ownedAggregates"], 1, "{listed}");
    // So another producer's first message claims it.
    let (status, applied) = send(&app, Some((&shipping, s)), "fresh", "s-1", 1).await;
    assert_eq!(status, 200, "{applied}");
    let (_, view) = get(&app, "/aggregates/fresh").await;
    assert_eq!(view["owner"], json!({"producer": "shipping", "epoch": s}));
    let (_, timeline) = get(&app, "/aggregates/fresh/timeline").await;
    let kinds: Vec<&str> = timeline["events"]
        .as_array()
        .map(|events| events.iter().filter_map(|e| e["kind"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(kinds, ["claimed", "applied"], "{timeline}");
    assert_eq!(
        send(&app, Some((&billing, b)), "fresh", "b-2", 2).await.0,
        403
    );
}

async fn a_transfer_racing_deliveries_cuts_the_old_owner_off_after_it_commits(backend: Backend) {
    let app = Arc::new(spawn_app_on(backend).await);
    let billing = Arc::new(add_producer(&app, "billing"));
    let shipping = add_producer(&app, "shipping");
    let alice = add_operator(&app, "alice");
    let b = epoch(&app, &billing).await;
    let s = epoch(&app, &shipping).await;
    assert_eq!(
        send(&app, Some((&billing, b)), "acct", "b-1", 1).await.0,
        200
    );

    let transferred = Arc::new(AtomicBool::new(false));
    let sender = {
        let (app, billing, transferred) = (app.clone(), billing.clone(), transferred.clone());
        tokio::spawn(async move {
            let mut results = Vec::new();
            let mut sequence = 2;
            loop {
                let after = transferred.load(Ordering::SeqCst);
                let (status, _) = send(
                    &app,
                    Some((&billing, b)),
                    "acct",
                    &format!("b-{sequence}"),
                    sequence,
                )
                .await;
                results.push((after, status));
                if status == 200 {
                    sequence += 1;
                }
                if after && results.iter().filter(|(after, _)| *after).count() >= 5 {
                    return results;
                }
            }
        })
    };
    // The operator reads the state and transfers; a delivery in between is a 409 to review.
    let record = loop {
        let (_, view) = get(&app, "/aggregates/acct").await;
        let body = json!({
            "producer": "shipping",
            "expectedOwner": "billing",
            "expectedLast": view["last"],
            "reason": "billing hands acct over",
        });
        let (status, answer) = transfer(&app, Some(&alice), "acct", &body).await;
        if status == 200 {
            break answer;
        }
        assert_eq!(status, 409, "{answer}");
        assert_eq!(answer["current"]["owner"]["producer"], "billing");
    };
    transferred.store(true, Ordering::SeqCst);
    assert_eq!(record["transfer"]["fromOwner"], "billing");
    let results = sender.await.unwrap();
    for (after, status) in &results {
        if *after {
            assert_eq!(*status, 403);
        }
    }
    let by_billing = results.iter().filter(|(_, status)| *status == 200).count() as i64;
    assert_eq!(applied_count(&app, "acct"), 1 + by_billing);
    let (_, view) = get(&app, "/aggregates/acct").await;
    assert_eq!(view["owner"]["producer"], "shipping");
    let next = view["last"].as_i64().unwrap() + 1;
    assert_eq!(
        send(&app, Some((&shipping, s)), "acct", "s-n", next)
            .await
            .0,
        200
    );
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM ownership_transfers"),
        1
    );
    assert_eq!(
        app.inbox_scalar(
            "SELECT COUNT(*) FROM aggregate_timeline WHERE aggregate_id = 'acct'
               AND kind = 'owner transferred' AND detail LIKE '%\"operator\":\"alice\"%'"
        ),
        1
    );
}

async fn a_transfer_needs_an_operator_and_its_preconditions(backend: Backend) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    add_producer(&app, "shipping");
    let alice = add_operator(&app, "alice");
    let b = epoch(&app, &billing).await;
    assert_eq!(
        send(&app, Some((&billing, b)), "acct", "b-1", 1).await.0,
        200
    );
    let body = |owner: Value, last: i64| json!({"producer": "shipping", "expectedOwner": owner, "expectedLast": last, "reason": "why"});
    // A producer's token is not an operator's.
    assert_eq!(
        transfer(&app, Some(&billing), "acct", &body(json!("billing"), 1))
            .await
            .0,
        401
    );
    assert_eq!(
        transfer(&app, None, "acct", &body(json!("billing"), 1))
            .await
            .0,
        401
    );
    let (status, conflict) = transfer(&app, Some(&alice), "acct", &body(Value::Null, 1)).await;
    assert_eq!(status, 409);
    assert_eq!(conflict["current"]["owner"]["producer"], "billing");
    let (status, conflict) = transfer(&app, Some(&alice), "acct", &body(json!("billing"), 0)).await;
    assert_eq!(
        (status, conflict["current"]["last"].clone()),
        (409, json!(1))
    );
    let missing = json!({"producer": "shipping", "expectedLast": 1, "reason": "why"});
    assert_eq!(transfer(&app, Some(&alice), "acct", &missing).await.0, 400);
    let nobody = json!({"producer": "nobody", "expectedOwner": "billing", "expectedLast": 1, "reason": "why"});
    assert_eq!(transfer(&app, Some(&alice), "acct", &nobody).await.0, 422);
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM ownership_transfers"),
        0
    );
    assert_eq!(
        transfer(&app, Some(&alice), "acct", &body(json!("billing"), 1))
            .await
            .0,
        200
    );
    assert_eq!(
        send(&app, Some((&billing, b)), "acct", "b-2", 2).await.0,
        403
    );
}

#[tokio::test]
async fn a_database_from_the_current_release_migrates_with_every_aggregate_unowned() {
    let (_dir, app) = spawn_on_fixture("release-v2.db").await;
    assert_eq!(app.scalar("SELECT COUNT(*) FROM producers"), 0);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM aggregate_state WHERE owner IS NOT NULL"),
        0
    );
    let (_, acct1) = get(&app, "/aggregates/acct-1").await;
    assert_eq!(
        (acct1["owner"].clone(), acct1["last"].clone()),
        (Value::Null, json!(3))
    );
    let billing = add_producer(&app, "billing");
    let b = epoch(&app, &billing).await;
    // Old aggregates have history: a producer cannot claim one by delivering.
    assert_eq!(
        send(&app, Some((&billing, b)), "acct-1", "b-4", 4).await.0,
        403
    );
    let body = json!({"producer": "billing", "expectedOwner": null, "expectedLast": 3, "reason": "billing takes acct-1 over"});
    let (status, answer) = transfer(&app, Some(RELEASE_V2_ALICE), "acct-1", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        send(&app, Some((&billing, b)), "acct-1", "b-4", 4).await.0,
        200
    );
    assert_eq!(send(&app, None, "acct-1", "anon-5", 5).await.0, 401);
    // Unowned old aggregates keep today's anonymous behaviour.
    let (_, acct2) = get(&app, "/aggregates/acct-2").await;
    let next = acct2["last"].as_i64().unwrap() + 1;
    assert_eq!(send(&app, None, "acct-2", "a2-anon", next).await.0, 200);
}

#[tokio::test]
async fn a_database_from_the_current_release_keeps_every_existing_message_in_the_anonymous_namespace()
 {
    let (_dir, app) = spawn_on_fixture("release-v2.db").await;
    // Every row was kept, in the anonymous namespace ('').
    for (table, rows) in [("ordered_inbox", 6), ("deadletters", 4), ("resolutions", 1)] {
        assert_eq!(
            app.scalar(&format!("SELECT COUNT(*) FROM {table} WHERE producer = ''")),
            rows,
            "{table}"
        );
        assert_eq!(app.scalar(&format!("SELECT COUNT(*) FROM {table}")), rows);
    }
    // Every stored payload is the fixture's exact string.
    let fixture = rusqlite::Connection::open(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/release-v2.db"),
    )
    .expect("open the fixture");
    let payloads = "SELECT message_id, payload FROM ordered_inbox ORDER BY message_id";
    let before: Vec<(String, String)> = fixture
        .prepare(payloads)
        .and_then(|mut statement| {
            statement
                .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                .collect()
        })
        .expect("the fixture's payloads");
    assert_eq!(
        app.rows(payloads, |row| Ok((row.get(0)?, row.get(1)?))),
        before
    );
    // An existing message re-sent anonymously is still a replay; its dead letters still answer.
    let (status, replay) = send_amount(&app, None, "acct-1", "a1-1", 1, 5).await;
    assert_eq!((status, replay["outcome"].clone()), (200, json!("replay")));
    let (status, letter) = get(&app, "/console/api/deadletters/a1-p2").await;
    assert_eq!(
        (status, letter["resolution"]["operator"].clone()),
        (200, json!("alice"))
    );
    assert!(letter.get("producer").is_none(), "{letter}");
    // A producer's a1-1 is another message: its own aggregate applies it.
    let billing = add_producer(&app, "billing");
    let b = epoch(&app, &billing).await;
    let (status, applied) = send(&app, Some((&billing, b)), "acct-new", "a1-1", 1).await;
    assert_eq!(
        (status, applied["outcome"].clone()),
        (200, json!("applied"))
    );
    assert_eq!(
        identities(&app, "ordered_inbox", "a1-1"),
        ["|a1-1", "billing|a1-1"]
    );
}

/// The `(producer, message id)` pairs stored for `message_id` (anonymous: an empty producer).
fn identities(app: &TestApp, table: &str, message_id: &str) -> Vec<String> {
    assert!(!message_id.contains('\''));
    app.inbox_rows(&format!(
        "SELECT producer, message_id FROM {table} WHERE message_id = '{message_id}'
          ORDER BY producer"
    ))
}

async fn the_same_message_id_from_two_producers_is_two_messages_and_each_keeps_its_own_rules(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    let shipping = add_producer(&app, "shipping");
    let (b, s) = (epoch(&app, &billing).await, epoch(&app, &shipping).await);
    let billing_at = Some((billing.as_str(), b));
    let shipping_at = Some((shipping.as_str(), s));

    let (status, first) = send_amount(&app, billing_at, "acct-b", "order-1", 1, 5).await;
    assert_eq!((status, first["outcome"].clone()), (200, json!("applied")));
    // Another producer's order-1, another message: applied, no conflict.
    let (status, second) = send_amount(&app, shipping_at, "acct-s", "order-1", 1, 7).await;
    assert_eq!(
        (status, second["outcome"].clone()),
        (200, json!("applied")),
        "{second}"
    );
    // An anonymous order-1 is in the anonymous namespace: a third message.
    let (status, third) = send_amount(&app, None, "acct-a", "order-1", 1, 9).await;
    assert_eq!((status, third["outcome"].clone()), (200, json!("applied")));
    assert_eq!(
        identities(&app, "ordered_inbox", "order-1"),
        ["|order-1", "billing|order-1", "shipping|order-1"]
    );

    // Each re-sends its own id: a replay, within its own namespace.
    let (status, replay) = send_amount(&app, billing_at, "acct-b", "order-1", 1, 5).await;
    assert_eq!((status, replay["outcome"].clone()), (200, json!("replay")));
    let (status, replay) = send_amount(&app, None, "acct-a", "order-1", 1, 9).await;
    assert_eq!((status, replay["outcome"].clone()), (200, json!("replay")));
    // The same id with other content from the same producer: a payload conflict.
    let (status, conflict) = send_amount(&app, shipping_at, "acct-s", "order-1", 1, 8).await;
    assert_eq!(
        (status, conflict["outcome"].clone()),
        (409, json!("payload conflict"))
    );
    let mut totals = Vec::new();
    for aggregate in ["acct-b", "acct-s", "acct-a"] {
        let (_, view) = get(&app, &format!("/aggregates/{aggregate}")).await;
        totals.push(json!([view["last"], view["total"]]));
    }
    assert_eq!(totals, [json!([1, 5]), json!([1, 7]), json!([1, 9])]);
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 3);

    // The console lists a producer's applied message with its producer, an anonymous one without.
    let (_, listed) = get(&app, "/console/api/aggregates/acct-b/messages").await;
    assert_eq!(listed["messages"][0]["producer"], "billing", "{listed}");
    let (_, listed) = get(&app, "/console/api/aggregates/acct-a/messages").await;
    assert!(listed["messages"][0].get("producer").is_none(), "{listed}");
}

async fn a_producers_quarantined_message_is_its_own_dead_letter_addressed_with_its_producer(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let billing = add_producer(&app, "billing");
    let shipping = add_producer(&app, "shipping");
    let alice = add_operator(&app, "alice");
    let (b, s) = (epoch(&app, &billing).await, epoch(&app, &shipping).await);
    let billing_at = Some((billing.as_str(), b));
    let shipping_at = Some((shipping.as_str(), s));
    assert_eq!(send(&app, billing_at, "acct-b", "m-1", 1).await.0, 200);
    let (status, poison) = send_amount(&app, billing_at, "acct-b", "bad-2", 2, -1).await;
    assert_eq!(
        (status, poison["outcome"].clone()),
        (422, json!("quarantined"))
    );
    // Shipping's bad-2 is its own dead letter, not a conflict with billing's.
    let (status, other) = send_amount(&app, shipping_at, "acct-s", "bad-2", 1, -3).await;
    assert_eq!(
        (status, other["outcome"].clone()),
        (422, json!("quarantined"))
    );
    // Billing re-sends its own: quarantined again, one more observation, no new row.
    let (status, again) = send_amount(&app, billing_at, "acct-b", "bad-2", 2, -1).await;
    assert_eq!(status, 422, "{again}");
    assert_eq!(
        identities(&app, "deadletters", "bad-2"),
        ["billing|bad-2", "shipping|bad-2"]
    );
    // The same id with other content from billing: a payload conflict.
    let (status, conflict) = send_amount(&app, billing_at, "acct-b", "bad-2", 2, -2).await;
    assert_eq!(
        (status, conflict["outcome"].clone()),
        (409, json!("payload conflict"))
    );

    // A dead letter is addressed by its producer and message id.
    let (status, letter) = get(&app, "/console/api/deadletters/bad-2?producer=billing").await;
    assert_eq!(status, 200, "{letter}");
    assert_eq!(
        (letter["producer"].clone(), letter["observations"].clone()),
        (json!("billing"), json!(2))
    );
    let (_, letter) = get(&app, "/console/api/deadletters/bad-2?producer=shipping").await;
    assert_eq!(
        (
            letter["aggregateId"].clone(),
            letter["observations"].clone()
        ),
        (json!("acct-s"), json!(1))
    );
    assert_eq!(get(&app, "/console/api/deadletters/bad-2").await.0, 404);
    let (status, missing) = get(&app, "/console/api/deadletters/bad-9?producer=billing").await;
    assert_eq!(
        (status, missing["detail"].clone()),
        (
            404,
            json!("no dead letter has message id 'bad-9' of producer 'billing'")
        )
    );
    assert_eq!(
        get(&app, "/console/api/deadletters/bad-2?producer=no%20such")
            .await
            .0,
        400
    );
    let (_, page) = get(&app, "/deadletters?aggregateId=acct-b").await;
    assert_eq!(page["deadLetters"][0]["producer"], "billing", "{page}");

    // An operator resolves billing's bad-2 with ?producer=billing; without it there is none.
    let skip = json!({"action": "skip", "expectedLast": 1, "reason": "cancelled upstream"});
    let (status, _) =
        crate::aggregates::resolve_at(&app, Some(&alice), "/deadletters/bad-2/resolution", &skip)
            .await;
    assert_eq!(status, 404);
    let (status, resolved) = crate::aggregates::resolve_at(
        &app,
        Some(&alice),
        "/deadletters/bad-2/resolution?producer=billing",
        &skip,
    )
    .await;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(
        (
            resolved["producer"].clone(),
            resolved["after"]["last"].clone()
        ),
        (json!("billing"), json!(2))
    );
    let (_, shipping_letter) = get(&app, "/console/api/deadletters/bad-2?producer=shipping").await;
    assert_eq!(shipping_letter["status"], "open");
    let (_, trail) = get(&app, "/resolutions?aggregateId=acct-b").await;
    assert_eq!(trail["resolutions"][0]["producer"], "billing", "{trail}");
    assert_eq!(send(&app, billing_at, "acct-b", "m-3", 3).await.0, 200);
}

async fn two_producers_hammering_the_same_ids_apply_each_message_once_and_never_fail(
    backend: Backend,
) {
    let app = Arc::new(spawn_app_on(backend).await);
    const MESSAGES: i64 = 15;
    let mut senders = Vec::new();
    for (name, aggregate) in [("billing", "hammer-b"), ("shipping", "hammer-s")] {
        let token = Arc::new(add_producer(&app, name));
        let current = epoch(&app, &token).await;
        // Three instances of one producer's sender (same epoch), each sending every id in
        // order: the same ids as the other producer's, concurrently.
        for _ in 0..3 {
            let (app, token) = (app.clone(), token.clone());
            senders.push(tokio::spawn(async move {
                let mut statuses = Vec::new();
                for sequence in 1..=MESSAGES {
                    let id = format!("h-{sequence}");
                    let producer = Some((token.as_str(), current));
                    let (status, body) = send(&app, producer, aggregate, &id, sequence).await;
                    // Each sender saw its previous id applied (or replayed) before sending the
                    // next, so every answer is an apply or a replay of this producer's own id.
                    assert!(
                        body["outcome"] == "applied" || body["outcome"] == "replay",
                        "{body}"
                    );
                    statuses.push(status);
                }
                statuses
            }));
        }
    }
    for sender in senders {
        let statuses = sender.await.unwrap();
        assert!(statuses.iter().all(|status| *status == 200), "{statuses:?}");
    }
    for (producer, aggregate) in [("billing", "hammer-b"), ("shipping", "hammer-s")] {
        let (_, view) = get(&app, &format!("/aggregates/{aggregate}")).await;
        assert_eq!(
            (view["last"].clone(), view["total"].clone()),
            (json!(MESSAGES), json!(MESSAGES)),
            "{view}"
        );
        assert_eq!(
            app.inbox_scalar(&format!(
                "SELECT COUNT(*) FROM ordered_inbox WHERE producer = '{producer}'
                   AND aggregate_id = '{aggregate}'"
            )),
            MESSAGES
        );
    }
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"),
        2 * MESSAGES
    );
}

async fn resolving_a_producers_dead_letter_supersedes_an_anonymous_one_with_the_same_id(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    let alice = add_operator(&app, "alice");
    // An anonymous history: m-1 applied, bad-2 quarantined at sequence 2.
    assert_eq!(send(&app, None, "shared", "m-1", 1).await.0, 200);
    assert_eq!(
        send_amount(&app, None, "shared", "bad-2", 2, -1).await.0,
        422
    );
    // The operator hands the aggregate to billing, whose own bad-2 is quarantined there too.
    let billing = add_producer(&app, "billing");
    let b = epoch(&app, &billing).await;
    let body = json!({"producer": "billing", "expectedOwner": null, "expectedLast": 1, "reason": "billing takes over"});
    assert_eq!(transfer(&app, Some(&alice), "shared", &body).await.0, 200);
    let (status, poison) = send_amount(&app, Some((&billing, b)), "shared", "bad-2", 2, -5).await;
    assert_eq!(
        (status, poison["outcome"].clone()),
        (422, json!("quarantined"))
    );
    assert_eq!(
        identities(&app, "deadletters", "bad-2"),
        ["|bad-2", "billing|bad-2"]
    );
    // Resolving billing's bad-2 with a replacement takes sequence 2: the anonymous bad-2 waiting
    // there is superseded by it, not left open behind the aggregate's last.
    let replace = json!({
        "action": "replace",
        "expectedLast": 1,
        "reason": "billing confirmed the amount",
        "replacement": {"messageId": "fix-2", "amount": 5},
    });
    let (status, resolved) = crate::aggregates::resolve_at(
        &app,
        Some(&alice),
        "/deadletters/bad-2/resolution?producer=billing",
        &replace,
    )
    .await;
    assert_eq!(status, 200, "{resolved}");
    let (_, anonymous) = get(&app, "/console/api/deadletters/bad-2").await;
    assert_eq!(
        (
            anonymous["status"].clone(),
            anonymous["supersededBy"].clone()
        ),
        (json!("superseded"), json!("fix-2")),
        "{anonymous}"
    );
    let (_, view) = get(&app, "/aggregates/shared").await;
    assert_eq!(
        (view["last"].clone(), view["status"].clone()),
        (json!(2), json!("flowing"))
    );
    // The replacement is billing's message.
    assert_eq!(
        identities(&app, "ordered_inbox", "fix-2"),
        ["billing|fix-2"]
    );
}

crate::on_both_backends!(
    resolving_a_producers_dead_letter_supersedes_an_anonymous_one_with_the_same_id,
    a_session_issues_the_next_epoch_and_the_first_delivery_claims_a_fresh_aggregate,
    each_ownership_and_epoch_rule_answers_its_own_status_and_writes_nothing,
    a_restarted_producer_fences_every_later_delivery_of_its_old_instance,
    two_producers_racing_to_claim_a_fresh_aggregate_leave_exactly_one_owner,
    a_refused_delivery_to_a_fresh_aggregate_leaves_it_unowned_for_the_next_producer,
    a_transfer_racing_deliveries_cuts_the_old_owner_off_after_it_commits,
    a_transfer_needs_an_operator_and_its_preconditions,
    the_same_message_id_from_two_producers_is_two_messages_and_each_keeps_its_own_rules,
    a_producers_quarantined_message_is_its_own_dead_letter_addressed_with_its_producer,
    two_producers_hammering_the_same_ids_apply_each_message_once_and_never_fail,
);

#[tokio::test]
async fn a_postgresql_inbox_of_the_current_release_migrates_with_every_message_anonymous() {
    // A database as the current release leaves it: schema 2, one applied message, a resolved
    // dead letter with its audit row.
    let url = crate::postgres::fresh_database();
    let mut setup = String::from(
        r#"CREATE TABLE ordered_inbox_schema(version integer PRIMARY KEY,
                                             applied_at text COLLATE "C" NOT NULL);"#,
    );
    for script in &ordered_inbox::postgres::schema::MIGRATIONS[..2] {
        setup.push_str(script);
    }
    setup.push_str(
        r#"INSERT INTO ordered_inbox_schema VALUES (1, 't'), (2, 't');
        INSERT INTO operators VALUES ('alice', 'h', 't', NULL);
        INSERT INTO aggregate_state VALUES ('acct', 1, 5, 'flowing', 't');
        INSERT INTO ordered_inbox VALUES
            ('m-1', '{"AggregateId":"acct","Sequence":1,"Amount":5}',
             'acct', 1, 5, 't1');
        INSERT INTO deadletters(message_id, reason, aggregate_id, sequence, payload, first_seen,
                                last_seen, status, resolution_id, id)
        VALUES ('bad-2', 'negative amount', 'legacy', 1, '{}', 't2', 't2', 'resolved', 1, 1);
        INSERT INTO resolutions VALUES (1, 'bad-2', 'legacy', 1, 'skip', 'alice', 'why', 0,
                                        NULL, NULL, 0, 0, 1, 0, 't3');"#,
    );
    crate::postgres::query_text(&url, &setup);
    let app = crate::helpers::spawn_app_on_with(Backend::Postgres, |config| {
        config.inbox = Some(url.clone())
    })
    .await;
    assert_eq!(
        app.inbox_rows(
            "SELECT 'i', producer, message_id FROM ordered_inbox
             UNION ALL SELECT 'd', producer, message_id FROM deadletters
             UNION ALL SELECT 'r', producer, message_id FROM resolutions"
        ),
        ["i||m-1", "d||bad-2", "r||bad-2"]
    );
    // The anonymous m-1 is still known: a replay; its aggregate stays unowned.
    let (status, replay) = send_amount(&app, None, "acct", "m-1", 1, 5).await;
    assert_eq!((status, replay["outcome"].clone()), (200, json!("replay")));
    let (_, letter) = get(&app, "/console/api/deadletters/bad-2").await;
    assert_eq!(letter["resolution"]["operator"], "alice", "{letter}");
    // A producer's m-1 is another message.
    let billing = add_producer(&app, "billing");
    let b = epoch(&app, &billing).await;
    let (status, applied) = send(&app, Some((&billing, b)), "fresh", "m-1", 1).await;
    assert_eq!(
        (status, applied["outcome"].clone()),
        (200, json!("applied")),
        "{applied}"
    );
    assert_eq!(
        identities(&app, "ordered_inbox", "m-1"),
        ["|m-1", "billing|m-1"]
    );
}

#[tokio::test]
async fn on_postgresql_a_producers_deliveries_share_its_row_and_a_session_waits_for_them() {
    let app = spawn_app_on(Backend::Postgres).await;
    let billing = add_producer(&app, "billing");
    let b = epoch(&app, &billing).await;
    let url = app.inbox_url.clone().expect("a PostgreSQL inbox");
    // Another transaction holds billing's row as a delivery in flight does: FOR SHARE.
    let (holder, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    holder
        .batch_execute("BEGIN; SELECT 1 FROM producers WHERE name = 'billing' FOR SHARE")
        .await
        .expect("share billing's row");
    // Deliveries of the same producer are not held up by it, on any aggregate.
    for aggregate in ["par-1", "par-2"] {
        let id = format!("{aggregate}-1");
        let (status, body) = send(&app, Some((&billing, b)), aggregate, &id, 1).await;
        assert_eq!(status, 200, "{body}");
    }
    // A new session updates the row: it waits for the delivery in flight to commit.
    let session = {
        let (client, url, token) = (
            app.client.clone(),
            app.url("/producers/session"),
            billing.clone(),
        );
        tokio::spawn(async move {
            let response = client
                .post(url)
                .bearer_auth(token)
                .send()
                .await
                .expect("POST");
            status_and_json(response).await
        })
    };
    poll_until(
        "the session waits for billing's row",
        || async {
            crate::postgres::query_text(
                &url,
                "SELECT COUNT(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
        },
        |rows| rows.first().and_then(|row| row[0].as_deref()) == Some("1"),
    )
    .await;
    assert!(
        !session.is_finished(),
        "the session went past a delivery in flight"
    );
    holder.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(
        session.await.expect("the session task"),
        (200, json!({"producer": "billing", "epoch": b + 1}))
    );
    let (status, fenced) = send(&app, Some((&billing, b)), "par-1", "p-2", 2).await;
    assert_eq!((status, fenced["outcome"].clone()), (409, json!("fenced")));
    let (_, listed) = get(&app, "/producers").await;
    assert!(
        listed["producers"][0]["lastDeliveryAt"].is_string(),
        "{listed}"
    );
}

// ---------------------------------------------------------------- the Producer-Epoch header

/// A producer with `sessions` sessions started: its token and its current epoch.
async fn producer_at_epoch(app: &TestApp, name: &str, sessions: i64) -> (String, i64) {
    let token = add_producer(app, name);
    let mut current = 0;
    for _ in 0..sessions {
        current = epoch(app, &token).await;
    }
    (token, current)
}

/// Spellings of epoch 4 that are not how a session writes it.
const NOT_HOW_A_SESSION_WRITES_4: [&str; 3] = ["+4", "04", "000004"];

#[tokio::test]
async fn an_epoch_with_a_sign_or_a_leading_zero_is_refused_on_the_http_door() {
    let app = spawn_app_on(Backend::Sqlite).await;
    let (token, current) = producer_at_epoch(&app, "billing", 4).await;
    assert_eq!(current, 4);
    for spelling in NOT_HOW_A_SESSION_WRITES_4 {
        let response = send_epoch_spelled(&app, &token, spelling, "m-1", 1).await;
        let problem = crate::helpers::assert_bad_request(response).await;
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|detail| detail.contains("no leading zero")),
            "{spelling}: {problem}"
        );
    }
    assert_eq!(applied_count(&app, "acct"), 0);
    let (status, body) = send(&app, Some((&token, 4)), "acct", "m-1", 1).await;
    assert_eq!((status, body["outcome"].clone()), (200, json!("applied")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_with_a_sign_or_a_leading_zero_is_a_malformed_message_on_the_broker_door() {
    use crate::broker::{jetstream_of, publish_acked, spawn_consumer, start_nats};
    use production_lab::broker::wire;

    let nats = start_nats(None);
    let app = spawn_consumer(&nats, |_| {}).await;
    let js = jetstream_of(&nats).await;
    let (token, current) = producer_at_epoch(&app, "billing", 4).await;
    let bearer = format!("Bearer {token}");
    let publish = |message_id: &str, epoch: &str| {
        let mut headers = async_nats::HeaderMap::new();
        let nats_id = wire::nats_message_id(Some("billing"), message_id);
        headers.insert(wire::MESSAGE_ID_HEADER, nats_id.as_str());
        headers.insert(wire::AUTHORIZATION_HEADER, bearer.as_str());
        headers.insert(wire::PRODUCER_EPOCH_HEADER, epoch);
        let body = json!({"messageId": message_id, "sequence": 1, "amount": 1}).to_string();
        let subject = wire::subject_for("ordered", "acct");
        let js = js.clone();
        async move {
            publish_acked(&js, subject, headers, body).await;
        }
    };
    for (index, spelling) in NOT_HOW_A_SESSION_WRITES_4.iter().enumerate() {
        publish(&format!("bad-{index}"), spelling).await;
    }
    let rejected = poll_until(
        "three malformed epochs listed",
        || async { status_and_json(app.get("/broker/rejected").await).await.1 },
        |body| {
            body["rejected"]
                .as_array()
                .is_some_and(|list| list.len() == 3)
        },
    )
    .await;
    for entry in rejected["rejected"].as_array().into_iter().flatten() {
        assert_eq!(entry["outcome"], "malformed", "{rejected}");
        assert!(
            entry["reason"]
                .as_str()
                .is_some_and(|reason| reason.contains("no leading zero")),
            "{rejected}"
        );
    }
    publish("good", &current.to_string()).await;
    poll_until(
        "the well-written epoch's message applied",
        || async { applied_count(&app, "acct") },
        |count| *count == 1,
    )
    .await;
    assert_eq!(
        app.inbox_rows("SELECT message_id FROM ordered_inbox WHERE aggregate_id = 'acct'"),
        ["good"]
    );
    app.stop().await;
}
