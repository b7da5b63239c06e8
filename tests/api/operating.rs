//! What an operator can watch: `GET /metrics`, `GET /ready`, request ids, and the request and
//! domain-event log lines.

use std::collections::BTreeMap;

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::helpers::{
    Backend, ServerProcess, TestApp, client, command, content_type, poll_until, settings_dir,
    spawn_app, spawn_app_on, status_and_json,
};

// The inbox's figures come from `Inbox::health`, which each backend implements.
crate::on_both_backends!(
    metrics_count_deliveries_by_door_and_verdict_and_read_the_inbox_gauges_at_scrape_time,
    resolutions_are_counted_by_action_and_outcome,
    ready_answers_503_naming_the_store_when_it_cannot_answer_a_read,
);

/// Every series of a Prometheus text body with its value, keyed by `name{labels}`.
pub(crate) fn series(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            Some((key.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn scrape(app: &TestApp) -> (String, BTreeMap<String, f64>) {
    let response = app.get("/metrics").await;
    assert_eq!(response.status(), 200);
    let content_type = content_type(&response);
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = response.text().await.expect("metrics body");
    let parsed = series(&text);
    (text, parsed)
}

fn value(series: &BTreeMap<String, f64>, key: &str) -> f64 {
    *series
        .get(key)
        .unwrap_or_else(|| panic!("no series {key} in {series:#?}"))
}

async fn deliver(app: &TestApp, aggregate: &str, id: &str, sequence: i64, amount: i64) -> u16 {
    app.post_json(
        &format!("/aggregates/{aggregate}/messages"),
        &json!({"messageId": id, "sequence": sequence, "amount": amount}),
    )
    .await
    .status()
    .as_u16()
}

async fn metrics_count_deliveries_by_door_and_verdict_and_read_the_inbox_gauges_at_scrape_time(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    assert_eq!(deliver(&app, "acct-1", "m-1", 1, 5).await, 200);
    assert_eq!(deliver(&app, "acct-1", "m-3", 3, 5).await, 409);
    assert_eq!(deliver(&app, "acct-2", "poison-1", 1, -1).await, 422);
    let classroom = app
        .post_json(
            "/ordered/apply",
            &json!({"messageId": "c-1", "aggregateId": "demo", "sequence": 1, "amount": 1}),
        )
        .await;
    assert_eq!(classroom.status(), 200);

    let (_, metrics) = scrape(&app).await;
    let deliveries = |door: &str, verdict: &str| {
        value(
            &metrics,
            &format!(r#"inbox_deliveries_total{{door="{door}",verdict="{verdict}"}}"#),
        )
    };
    assert_eq!(deliveries("general", "applied"), 1.0);
    assert_eq!(deliveries("general", "gap"), 1.0);
    assert_eq!(deliveries("general", "quarantined"), 1.0);
    assert_eq!(deliveries("classroom", "applied"), 1.0);
    assert_eq!(
        deliveries("general", "stale"),
        0.0,
        "every verdict starts at 0"
    );

    // acct-1 is waiting (a gap was refused), acct-2 blocked, demo flowing.
    assert_eq!(
        value(&metrics, r#"inbox_aggregates{status="waiting"}"#),
        1.0
    );
    assert_eq!(
        value(&metrics, r#"inbox_aggregates{status="blocked"}"#),
        1.0
    );
    assert_eq!(
        value(&metrics, r#"inbox_aggregates{status="flowing"}"#),
        1.0
    );
    assert_eq!(value(&metrics, "inbox_dead_letters_open"), 1.0);
    assert_eq!(value(&metrics, "inbox_held_messages"), 0.0);
    let blocked_for = value(&metrics, "inbox_longest_blocked_seconds");
    assert!((0.0..60.0).contains(&blocked_for), "{blocked_for}");
    assert_eq!(value(&metrics, "inbox_store_readable"), 1.0);
    assert_eq!(value(&metrics, "inbox_writer_queue_depth"), 0.0);

    // Group commit: with the inbox in SQLite, every delivery went through the store's writer, in
    // batches of at least one (a PostgreSQL inbox has no writer thread).
    if backend == Backend::Sqlite {
        let batches = value(&metrics, "inbox_writer_batch_size_count");
        let units = value(&metrics, "inbox_writer_batch_size_sum");
        assert!(
            batches >= 1.0 && units >= 4.0,
            "{batches} batches, {units} units"
        );
        assert_eq!(
            value(&metrics, "inbox_writer_commit_seconds_count"),
            batches
        );
        assert_eq!(
            value(&metrics, r#"inbox_writer_commit_seconds_bucket{le="+Inf"}"#),
            batches
        );
    }

    // HTTP: by route template, method and status class; latency by route and method.
    let route = "/aggregates/{aggregate_id}/messages";
    let requests = |status: &str| {
        value(
            &metrics,
            &format!(r#"http_requests_total{{route="{route}",method="POST",status="{status}"}}"#),
        )
    };
    assert_eq!(requests("2xx"), 1.0);
    assert_eq!(requests("4xx"), 2.0);
    assert_eq!(
        value(
            &metrics,
            &format!(r#"http_request_duration_seconds_count{{route="{route}",method="POST"}}"#)
        ),
        3.0
    );
}

async fn resolutions_are_counted_by_action_and_outcome(backend: Backend) {
    let app = spawn_app_on(backend).await;
    assert_eq!(deliver(&app, "acct", "m-1", 1, 1).await, 200);
    assert_eq!(deliver(&app, "acct", "poison-2", 2, -1).await, 422);
    let added = command()
        .args(["operator", "add", "alice"])
        .args(app.operator_store_args())
        .output()
        .expect("run operator add");
    assert!(added.status.success());
    let token = String::from_utf8(added.stdout)
        .expect("token")
        .trim()
        .to_owned();
    let resolve = |dry_run: bool| {
        let path = if dry_run {
            "/deadletters/poison-2/resolution?dryRun=true"
        } else {
            "/deadletters/poison-2/resolution"
        };
        app.client
            .post(app.url(path))
            .bearer_auth(&token)
            .json(&json!({"action": "skip", "expectedLast": 1, "reason": "cancelled upstream"}))
            .send()
    };
    assert_eq!(resolve(true).await.expect("dry run").status(), 200);
    assert_eq!(resolve(false).await.expect("resolution").status(), 200);
    let missing = app
        .client
        .post(app.url("/deadletters/nobody/resolution"))
        .bearer_auth(&token)
        .json(&json!({"action": "skip", "expectedLast": 1, "reason": "typo"}))
        .send()
        .await
        .expect("resolution of nothing");
    assert_eq!(missing.status(), 404);

    let (_, metrics) = scrape(&app).await;
    let resolutions = |outcome: &str| {
        value(
            &metrics,
            &format!(r#"inbox_resolutions_total{{action="skip",outcome="{outcome}"}}"#),
        )
    };
    assert_eq!(resolutions("dry_run"), 1.0);
    assert_eq!(resolutions("resolved"), 1.0);
    assert_eq!(resolutions("not_found"), 1.0);
    assert_eq!(
        value(
            &metrics,
            r#"inbox_resolutions_total{action="replace",outcome="resolved"}"#
        ),
        0.0
    );
    assert_eq!(value(&metrics, "inbox_dead_letters_open"), 0.0);
    assert_eq!(value(&metrics, "inbox_longest_blocked_seconds"), 0.0);
}

#[tokio::test]
async fn a_thousand_distinct_aggregate_ids_add_no_series() {
    let app = spawn_app().await;
    // One of each answer the loop below gives, so that every series it touches exists.
    assert_eq!(deliver(&app, "warm-up", "w-1", 1, 1).await, 200);
    assert_eq!(deliver(&app, "warm-up-poison", "w-p", 1, -1).await, 422);
    // The first scrape is counted after it answers, so the second one shows its own series.
    scrape(&app).await;
    let (_, before) = scrape(&app).await;

    let statuses: Vec<u16> = futures_util::stream::iter(0..1000)
        .map(|n| {
            let app = &app;
            async move {
                let aggregate = format!("tenant-{n:04}");
                // Every fourth one is poison: a second verdict and a second status class.
                let amount = if n % 4 == 0 { -1 } else { 1 };
                deliver(app, &aggregate, &format!("msg-{n:04}"), 1, amount).await
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert_eq!(
        statuses.iter().filter(|status| **status == 200).count(),
        750
    );
    assert_eq!(
        statuses.iter().filter(|status| **status == 422).count(),
        250
    );

    let (text, after) = scrape(&app).await;
    let names = |series: &BTreeMap<String, f64>| series.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&before),
        names(&after),
        "the same series before and after 1,000 aggregate ids"
    );
    assert!(
        !text.contains("tenant-") && !text.contains("msg-"),
        "an id reached a label"
    );
    assert_eq!(
        value(
            &after,
            r#"inbox_deliveries_total{door="general",verdict="quarantined"}"#
        ),
        251.0
    );
    assert_eq!(
        value(&after, r#"inbox_aggregates{status="blocked"}"#),
        251.0
    );
}

#[tokio::test]
async fn two_servers_in_one_process_count_only_their_own_traffic() {
    let first = spawn_app().await;
    let second = spawn_app().await;
    assert_eq!(deliver(&first, "a", "m-1", 1, 1).await, 200);
    let (_, untouched) = scrape(&second).await;
    assert_eq!(
        value(
            &untouched,
            r#"inbox_deliveries_total{door="general",verdict="applied"}"#
        ),
        0.0
    );
    let (_, touched) = scrape(&first).await;
    assert_eq!(
        value(
            &touched,
            r#"inbox_deliveries_total{door="general",verdict="applied"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn ready_answers_503_naming_invalid_live_settings_until_they_are_fixed() {
    let app = spawn_app().await;
    let (status, body) = status_and_json(app.get("/ready").await).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"status": "ready", "checks": {"store": "ok", "configuration": "ok"}})
    );

    std::fs::write(&app.settings, r#"{"Live":{"Label":" ","Maximum":3}}"#).expect("write");
    let not_ready = poll_until(
        "readiness notices the invalid settings",
        || async { status_and_json(app.get("/ready").await).await },
        |(status, _)| *status == 503,
    )
    .await
    .1;
    assert_eq!(not_ready["title"], "Not ready");
    let detail = not_ready["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("live settings") && detail.contains("Live:Label"),
        "{detail}"
    );
    assert_eq!(
        not_ready["checks"],
        json!({"store": "ok", "configuration": "failed"})
    );
    // Liveness is not readiness: the process still answers.
    assert_eq!(app.get("/live").await.text().await.unwrap(), "live");

    std::fs::write(&app.settings, crate::helpers::SEED_SETTINGS).expect("write");
    poll_until(
        "readiness recovers with the settings",
        || async { app.get("/ready").await.status().as_u16() },
        |status| *status == 200,
    )
    .await;
}

async fn ready_answers_503_naming_the_store_when_it_cannot_answer_a_read(backend: Backend) {
    let app = spawn_app_on(backend).await;
    app.inbox_execute("ALTER TABLE aggregate_state RENAME TO aggregate_state_away");
    let (status, body) = status_and_json(app.get("/ready").await).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("the store does not answer a read")),
        "{body}"
    );
    assert_eq!(body["checks"]["store"], "failed");
    let (_, metrics) = scrape(&app).await;
    assert_eq!(value(&metrics, "inbox_store_readable"), 0.0);

    app.inbox_execute("ALTER TABLE aggregate_state_away RENAME TO aggregate_state");
    assert_eq!(app.get("/ready").await.status(), 200);
}

#[tokio::test]
async fn a_sane_request_id_is_echoed_in_the_header_and_in_every_problem() {
    let app = spawn_app().await;
    let response = app
        .client
        .post(app.url("/aggregates/acct/messages"))
        .header("x-request-id", "order-svc:7f3a-01")
        .header("content-type", "application/json")
        .body("{broken")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["x-request-id"], "order-svc:7f3a-01");
    let body: Value = response.json().await.expect("problem");
    assert_eq!(body["requestId"], "order-svc:7f3a-01");
    assert_eq!(body["status"], 400);

    // A 404 problem carries it too; a success carries the header only.
    let missing = app
        .client
        .get(app.url("/aggregates/nobody"))
        .header("x-request-id", "lookup-1")
        .send()
        .await
        .expect("request");
    assert_eq!(missing.status(), 404);
    let problem: Value = missing.json().await.expect("problem");
    assert_eq!(problem["requestId"], "lookup-1");
    let live = app
        .client
        .get(app.url("/live"))
        .header("x-request-id", "probe-1")
        .send()
        .await
        .expect("request");
    assert_eq!(live.headers()["x-request-id"], "probe-1");
    // A path no route matches gets one too.
    let unmatched = app.get("/no/such/route").await;
    assert_eq!(unmatched.status(), 404);
    assert!(unmatched.headers().contains_key("x-request-id"));
}

#[tokio::test]
async fn a_missing_or_insane_request_id_is_replaced_by_a_generated_one() {
    let app = spawn_app().await;
    let long = "x".repeat(129);
    for sent in [None, Some("has space"), Some(long.as_str()), Some("")] {
        let mut request = app.client.get(app.url("/aggregates?status=nonsense"));
        if let Some(sent) = sent {
            request = request.header("x-request-id", sent);
        }
        let response = request.send().await.expect("request");
        assert_eq!(response.status(), 400);
        let echoed = response.headers()["x-request-id"]
            .to_str()
            .expect("ascii")
            .to_owned();
        assert_eq!(echoed.len(), 32, "{echoed}");
        assert!(echoed.bytes().all(|b| b.is_ascii_hexdigit()), "{echoed}");
        let body: Value = response.json().await.expect("problem");
        assert_eq!(body["requestId"], echoed.as_str());
    }
    let a = app.get("/live").await.headers()["x-request-id"].clone();
    let b = app.get("/live").await.headers()["x-request-id"].clone();
    assert_ne!(a, b, "each request gets its own id");
}

#[tokio::test]
async fn json_logs_carry_the_route_template_the_request_id_and_domain_events_but_no_payloads() {
    let (dir, settings) = settings_dir();
    let database = dir.path().join("lab.db");
    let mut server = ServerProcess::start_with_env(
        &database,
        &settings,
        &["--log-format", "json"],
        &[("LAB_LOG", "info")],
    );
    let http = client();
    let post = |path: &str, request_id: &str, body: Value| {
        http.post(server.url(path))
            .header("x-request-id", request_id)
            .json(&body)
            .send()
    };
    // A poison message (quarantined), then a corrected one under a new id (supersedes it).
    let poison = post(
        "/aggregates/acct-log/messages",
        "trace-me-1",
        json!({"messageId": "poison-1", "sequence": 1, "amount": -4242}),
    )
    .await
    .expect("poison");
    assert_eq!(poison.status(), 422);
    let fixed = post(
        "/aggregates/acct-log/messages",
        "trace-me-2",
        json!({"messageId": "fixed-1", "sequence": 1, "amount": 7}),
    )
    .await
    .expect("fix");
    assert_eq!(fixed.status(), 200);
    // A second poison, resolved by an operator with a skip.
    let second = post(
        "/aggregates/acct-log/messages",
        "trace-me-3",
        json!({"messageId": "poison-2", "sequence": 2, "amount": -1}),
    )
    .await
    .expect("poison");
    assert_eq!(second.status(), 422);
    let added = command()
        .args(["operator", "add", "alice", "--database"])
        .arg(&database)
        .output()
        .expect("operator add");
    assert!(added.status.success());
    let token = String::from_utf8(added.stdout)
        .expect("token")
        .trim()
        .to_owned();
    let resolved = http
        .post(server.url("/deadletters/poison-2/resolution"))
        .bearer_auth(&token)
        .json(&json!({"action": "skip", "expectedLast": 1, "reason": "secret-reason-text"}))
        .send()
        .await
        .expect("resolution");
    assert_eq!(resolved.status(), 200);
    // An email in a query string, and an invalid then a fixed settings file.
    let observed = http
        .get(server.url("/privacy/observe?email=ada%40example.com&operation=quote"))
        .send()
        .await
        .expect("observe");
    assert_eq!(observed.status(), 200);
    std::fs::write(&settings, r#"{"Live":{"Label":"","Maximum":3}}"#).expect("write");
    poll_until(
        "the server sees the invalid settings",
        || async {
            http.get(server.url("/ready"))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .ok()
        },
        |status| *status == Some(503),
    )
    .await;
    std::fs::write(&settings, crate::helpers::SEED_SETTINGS).expect("write");
    poll_until(
        "the server sees the fixed settings",
        || async {
            http.get(server.url("/ready"))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .ok()
        },
        |status| *status == Some(200),
    )
    .await;

    let (_, stderr) = server.stop_and_collect_output().await;
    let lines: Vec<Value> = stderr
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"))
        })
        .collect();
    let find = |what: &str, matches: &dyn Fn(&Value) -> bool| {
        lines
            .iter()
            .find(|line| matches(line))
            .unwrap_or_else(|| panic!("no {what} line in:\n{stderr}"))
            .clone()
    };

    let request = find("request", &|line| {
        line["span"]["request_id"] == "trace-me-1"
            && line["fields"]["message"] == "request finished"
    });
    assert_eq!(request["level"], "INFO");
    assert_eq!(
        request["span"]["route"],
        "/aggregates/{aggregate_id}/messages"
    );
    assert_eq!(request["span"]["method"], "POST");
    assert_eq!(request["fields"]["status"], 422);
    assert!(
        request["fields"]["latency_ms"].as_f64().is_some(),
        "{request}"
    );

    let quarantined = find("quarantined", &|line| {
        line["fields"]["event"] == "quarantined"
    });
    assert_eq!(quarantined["fields"]["aggregate_id"], "acct-log");
    assert_eq!(quarantined["fields"]["message_id"], "poison-1");
    assert_eq!(
        quarantined["span"]["request_id"], "trace-me-1",
        "in its request's span"
    );
    let superseded = find("superseded", &|line| {
        line["fields"]["event"] == "superseded"
    });
    assert_eq!(superseded["fields"]["message_id"], "poison-1");
    assert_eq!(superseded["fields"]["superseded_by"], "fixed-1");
    let resolved = find("resolved", &|line| line["fields"]["event"] == "resolved");
    assert_eq!(resolved["fields"]["aggregate_id"], "acct-log");
    assert_eq!(resolved["fields"]["message_id"], "poison-2");
    assert_eq!(resolved["fields"]["operator"], "alice");
    assert_eq!(resolved["fields"]["action"], "skip");
    find("configuration invalid", &|line| {
        line["target"] == "production_lab::configuration" && line["level"] == "WARN"
    });
    find("configuration valid again", &|line| {
        line["target"] == "production_lab::configuration"
            && line["fields"]["message"] == "Configuration is valid again"
    });

    for secret in [
        token.as_str(),
        "secret-reason-text",
        "-4242",
        "ada@example.com",
        "ada%40example.com",
        "/aggregates/acct-log/messages",
    ] {
        assert!(
            !stderr.contains(secret),
            "{secret} reached the log:\n{stderr}"
        );
    }
}

#[tokio::test]
async fn a_fenced_producer_delivery_is_counted_by_reason_and_as_a_refused_verdict() {
    let app = spawn_app().await;
    let added = command()
        .args(["producer", "add", "orders"])
        .arg("--database")
        .arg(&app.database)
        .output()
        .expect("run producer add");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let token = String::from_utf8(added.stdout)
        .expect("token")
        .trim()
        .to_owned();
    let session = || async {
        let response = app
            .client
            .post(app.url("/producers/session"))
            .bearer_auth(&token)
            .send()
            .await
            .expect("session");
        status_and_json(response).await.1["epoch"]
            .as_i64()
            .expect("an epoch")
    };
    let old = session().await;
    let new = session().await;
    assert!(new > old);
    let send = |epoch: i64, id: &'static str, sequence: i64| {
        app.client
            .post(app.url("/aggregates/acct-owned/messages"))
            .bearer_auth(&token)
            .header("producer-epoch", epoch.to_string())
            .json(&json!({"messageId": id, "sequence": sequence, "amount": 1}))
            .send()
    };
    assert_eq!(send(new, "m-1", 1).await.expect("delivery").status(), 200);
    assert_eq!(send(old, "m-2", 2).await.expect("delivery").status(), 409);

    let (_, metrics) = scrape(&app).await;
    assert_eq!(
        value(
            &metrics,
            r#"inbox_producer_refusals_total{reason="fenced"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &metrics,
            r#"inbox_producer_refusals_total{reason="not_owner"}"#
        ),
        0.0
    );
    assert_eq!(
        value(
            &metrics,
            r#"inbox_deliveries_total{door="general",verdict="refused"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &metrics,
            r#"inbox_deliveries_total{door="general",verdict="applied"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn bench_reports_progress_on_stderr_and_keeps_stdout_and_json_for_the_figures() {
    let dir = tempfile::tempdir().expect("temp dir");
    let json_path = dir.path().join("figures.json");
    let output = tokio::task::spawn_blocking({
        let json_path = json_path.clone();
        move || {
            command()
                .args(["bench", "ordered", "--aggregates", "4", "--messages", "120"])
                .args(["--concurrency", "2", "--synchronous", "normal", "--json"])
                .arg(&json_path)
                .output()
                .expect("run the bench")
        }
    })
    .await
    .expect("the bench process");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");

    // Not a terminal here: plain lines, one at the start and one at the end of each phase.
    for line in [
        "bench ordered: HTTP: 0/120 messages",
        "bench ordered: HTTP: 120/120 (100%) in ",
        "bench ordered: raw baseline: 120/120 (100%) in ",
    ] {
        assert!(stderr.contains(line), "no {line:?} in stderr:\n{stderr}");
    }
    assert!(
        !stdout.contains("(100%)"),
        "progress reached stdout:\n{stdout}"
    );
    assert!(
        stdout.starts_with("bench ordered: 120 messages over 4 aggregates"),
        "{stdout}"
    );
    let figures: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("the JSON file"))
            .expect("JSON figures");
    assert_eq!(figures["messages"], 120);
    assert!(
        figures["httpMessagesPerSecond"]
            .as_f64()
            .is_some_and(|rate| rate > 0.0)
    );
}

/// A sample's size in bytes, from `bench retention`'s JSON.
fn sample_bytes(sample: &Value) -> u64 {
    sample["bytes"].as_u64().expect("a sample's bytes")
}

/// How much the store grew from the first sample at or past `messages` to the largest from there on.
fn growth_from(samples: &[Value], messages: u64) -> u64 {
    let after: Vec<u64> = samples
        .iter()
        .filter(|sample| sample["messages"].as_u64().is_some_and(|m| m >= messages))
        .map(sample_bytes)
        .collect();
    let first = *after.first().expect("samples after the warm-up");
    after.into_iter().max().unwrap_or(first) - first
}

/// A small `bench retention`: after the warm-up, the gate's store with a short retention grows
/// by less than a third of what the same messages add without retention, and the pruner deleted
/// identities, output rows and timeline events.
///
/// A window of time holds as many rows as the rate of the moment puts in it, so a comparison of
/// sizes alone would depend on how busy the machine is during the run: a run slowed at its
/// warm-up and fast after it would hold more at its end. What the same messages add without
/// retention depends only on their number, and what a 200 ms window adds at most is far below
/// it at any rate this bench reaches.
#[tokio::test]
async fn bench_retention_keeps_the_gate_store_bounded_where_the_same_load_without_retention_grows()
{
    let dir = tempfile::tempdir().expect("temp dir");
    let json_path = dir.path().join("retention.json");
    let output = tokio::task::spawn_blocking({
        let json_path = json_path.clone();
        move || {
            command()
                .args(["bench", "retention", "--messages", "40000"])
                .args(["--aggregates", "100", "--sample-every", "2000"])
                .args([
                    "--retention-ms",
                    "200",
                    "--prune-interval-ms",
                    "100",
                    "--json",
                ])
                .arg(&json_path)
                .output()
                .expect("run the bench")
        }
    })
    .await
    .expect("the bench process");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("bench retention: sqlite, 40000 messages over 100 aggregates"),
        "{stdout}"
    );
    assert!(stdout.contains("  verdict: "), "{stdout}");
    let figures: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("the JSON file"))
            .expect("JSON figures");
    let on = figures["on"]["samples"].as_array().expect("on samples");
    let off = figures["off"]["samples"].as_array().expect("off samples");
    assert_eq!((on.len(), off.len()), (20, 20), "{figures}");
    assert!(on.iter().chain(off).all(|sample| sample_bytes(sample) > 0));

    let warm_up = figures["bound"]["warmUpMessages"]
        .as_u64()
        .unwrap_or_else(|| panic!("no bound after warm-up: nothing pruned?\n{stdout}"));
    let (on_growth, off_growth) = (growth_from(on, warm_up), growth_from(off, warm_up));
    assert!(
        off_growth > 4 << 20,
        "without retention the store should grow by megabytes past the warm-up:\n{stdout}"
    );
    assert!(
        on_growth * 3 < off_growth,
        "with retention the store grew by {on_growth} bytes past the warm-up, \
         without it by {off_growth}:\n{stdout}"
    );
    let pruned = &figures["on"]["pruned"];
    for kind in ["identities", "output", "timeline"] {
        assert!(
            pruned[kind].as_u64().is_some_and(|n| n > 0),
            "{kind}: {pruned}"
        );
    }
    assert_eq!(figures["off"]["pruned"]["identities"], 0);
    assert!(
        figures["bound"]["samples"].as_u64().is_some_and(|n| n >= 2),
        "{stdout}"
    );
}

/// Failing units among concurrent deliveries: each failure replays its batch with a savepoint per
/// unit, the metric counts those replays, and the deliveries that shared a batch with a failure
/// are applied exactly once while the failures leave nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_unit_replays_its_batch_and_its_neighbours_apply_exactly_once() {
    let app = spawn_app().await;
    let (_, before) = scrape(&app).await;
    assert_eq!(value(&before, "inbox_writer_replayed_batches_total"), 0.0);
    let deliveries = (1..=40).map(|n| {
        let app = &app;
        async move { deliver(app, &format!("replay-{n}"), &format!("m-{n}"), 1, n).await }
    });
    let failures =
        (0..10).map(|_| async { app.post("/contracts/change/before").await.status().as_u16() });
    let (delivered, failed) = tokio::join!(
        futures_util::future::join_all(deliveries),
        futures_util::future::join_all(failures)
    );
    assert!(
        delivered.iter().all(|status| *status == 200),
        "{delivered:?}"
    );
    assert!(failed.iter().all(|status| *status == 503), "{failed:?}");
    assert_eq!(
        app.scalar("SELECT value FROM contract_effect WHERE id = 1"),
        0,
        "a failed unit's change was kept"
    );
    for n in 1..=40 {
        let aggregate = format!("replay-{n}");
        let (status, view) =
            status_and_json(app.get(&format!("/aggregates/{aggregate}")).await).await;
        assert_eq!(
            (status, view["last"].clone(), view["total"].clone()),
            (200, json!(1), json!(n))
        );
        let (_, timeline) =
            status_and_json(app.get(&format!("/aggregates/{aggregate}/timeline")).await).await;
        let kinds: Vec<&str> = timeline["events"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|event| event["kind"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(kinds, ["applied"], "{aggregate}: {timeline}");
    }
    let (_, after) = scrape(&app).await;
    let replayed = value(&after, "inbox_writer_replayed_batches_total");
    assert!(
        (1.0..=10.0).contains(&replayed),
        "{replayed} replayed batches"
    );
}
