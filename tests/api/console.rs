//! The console: its pages, read routes and live updates over HTTP, and what a real headless
//! Chromium shows and does when a person clicks through it (see `browser.rs`).

use std::time::{Duration, Instant};

use axum::Router;
use axum::response::Html;
use axum::routing::get;
use futures_util::StreamExt;
use production_lab::broker::loopback_config;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::aggregates::{add_operator, dead_letter_status, resolve_at};
use crate::broker::{jetstream_of, publish_ordered, start_nats};
use crate::browser::{Browser, TlsOrigin};
use crate::helpers::{
    TestApp, assert_bad_request, poll_until, spawn_app, spawn_app_with, status_and_json,
};

/// A message id and a reason that would run script if the page parsed them as markup.
const INJECTION: &str = "<img src=x onerror=alert(1)>";

async fn deliver(app: &TestApp, aggregate: &str, id: &str, sequence: i64, amount: i64) -> u16 {
    let body = json!({"messageId": id, "sequence": sequence, "amount": amount});
    app.post_json(&format!("/aggregates/{aggregate}/messages"), &body)
        .await
        .status()
        .as_u16()
}

/// `(last, total, status)` of an aggregate's row.
fn aggregate_row(app: &TestApp, aggregate: &str) -> Option<(i64, i64, String)> {
    app.rows(
        &format!(
            "SELECT last_sequence, total, status FROM aggregate_state WHERE aggregate_id = '{aggregate}'"
        ),
        |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
    )
    .pop()
}

// ---------------------------------------------------------------------------------------------
// Over HTTP

#[tokio::test]
async fn every_console_response_forbids_inline_script_sniffing_and_referrers() {
    let app = spawn_app().await;
    assert_eq!(deliver(&app, "acct", "poison-1", 1, -1).await, 422);
    let paths = [
        "/console",
        "/console/aggregates",
        "/console/aggregate?id=acct",
        "/console/deadletter?id=poison-1",
        "/console/labs",
        "/console/assets/console.css",
        "/console/assets/common.js",
        "/console/assets/console.js",
        "/console/assets/deadletter.js",
        "/console/assets/nothing.js",
        "/console/api/aggregates/acct/messages",
        "/console/api/deadletters/poison-1",
        "/console/api/deadletters/unknown",
    ];
    for path in paths {
        let response = app.get(path).await;
        let headers = response.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let policy = header("content-security-policy");
        assert!(
            policy
                .split(';')
                .any(|directive| directive.trim() == "default-src 'self'"),
            "{path}: {policy}"
        );
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header("referrer-policy"), "no-referrer", "{path}");
    }
    // The pages load scripts from files only: an inline one would be refused by the policy anyway.
    for page in ["/console", "/console/aggregates", "/console/labs"] {
        let html = app.get(page).await.text().await.expect("page");
        let document = scraper::Html::parse_document(&html);
        let scripts = scraper::Selector::parse("script").expect("selector");
        let sources: Vec<_> = document
            .select(&scripts)
            .map(|script| (script.value().attr("src"), script.inner_html()))
            .collect();
        // The helpers both consoles share, the console's own, the page's.
        assert_eq!(sources.len(), 3, "{page}: {sources:?}");
        for (source, inline) in sources {
            assert!(source.is_some_and(|src| src.starts_with("/console/assets/")));
            assert!(inline.trim().is_empty(), "{page} has inline script");
        }
    }
}

#[tokio::test]
async fn the_console_passes_through_the_same_host_filter_as_every_route() {
    let app = spawn_app_with(|config| config.allowed_hosts = "localhost".to_owned()).await;
    let refused = app
        .client
        .get(app.url("/console"))
        .header("host", "evil.example")
        .send()
        .await
        .expect("GET");
    assert_eq!(refused.status(), 400);
    let allowed = app
        .client
        .get(app.url("/console"))
        .header("host", "localhost")
        .send()
        .await
        .expect("GET");
    assert_eq!(allowed.status(), 200);
}

#[tokio::test]
async fn the_read_routes_list_applied_messages_by_sequence_and_find_one_dead_letter() {
    let app = spawn_app().await;
    for (id, sequence, amount) in [("m-1", 1, 5), ("m-2", 2, 7), ("m-3", 3, 1)] {
        assert_eq!(deliver(&app, "acct", id, sequence, amount).await, 200);
    }
    assert_eq!(deliver(&app, "acct", "bad/4", 4, -1).await, 422);

    let (status, first) = status_and_json(
        app.get("/console/api/aggregates/acct/messages?limit=2")
            .await,
    )
    .await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = first["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["messageId"].as_str())
        .collect();
    assert_eq!(ids, ["m-1", "m-2"]);
    assert_eq!(first["messages"][1]["amount"], 7);
    assert_eq!(first["next"], 2);
    let (_, rest) = status_and_json(
        app.get("/console/api/aggregates/acct/messages?after=2")
            .await,
    )
    .await;
    assert_eq!(rest["messages"][0]["messageId"], "m-3");
    assert_eq!(rest["next"], Value::Null);

    // A message id with a slash reads back when its path segment is percent-encoded.
    let (status, letter) = status_and_json(app.get("/console/api/deadletters/bad%2F4").await).await;
    assert_eq!(status, 200, "{letter}");
    assert_eq!(letter["sequence"], 4);
    assert_eq!(letter["status"], "open");
    assert_eq!(letter["payload"]["Amount"], -1);
    let (status, missing) = status_and_json(app.get("/console/api/deadletters/m-1").await).await;
    assert_eq!(status, 404);
    assert_eq!(missing["title"], "No such dead letter");
    let (status, _) = status_and_json(
        app.get("/console/api/aggregates/has%20space/messages")
            .await,
    )
    .await;
    assert_eq!(status, 400);
}

/// Sends one request exactly as written on its own connection, so no URL parser on the way drops
/// a `.` or `..` segment (reqwest's would, as a browser's does); returns the status and the JSON
/// body.
async fn send_as_written(
    app: &TestApp,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Value) {
    let host = app.address.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to the server");
    let mut request = format!(
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    socket
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    socket
        .read_to_end(&mut answer)
        .await
        .expect("read the answer");
    let answer = String::from_utf8(answer).expect("a UTF-8 answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {head}"));
    let body = serde_json::from_str(body).unwrap_or_else(|_| panic!("a JSON body: {body}"));
    (status, body)
}

/// The skip the dot-id probes send.
fn probe_skip() -> Value {
    json!({"action": "skip", "expectedLast": 0, "reason": "probe"})
}

#[tokio::test]
async fn percent_encoded_dots_decode_to_the_id_and_the_query_forms_reach_dot_ids() {
    let app = spawn_app().await;
    let operator = add_operator(&app, "alice");
    for (aggregate, id) in [("dots-1", "a.b"), ("dots-2", "."), ("dots-3", "..")] {
        assert_eq!(deliver(&app, aggregate, id, 1, -1).await, 422, "{id}");
    }

    // The server decodes `%2E` in a path segment back to `.`, whatever the segment holds.
    for (target, id) in [
        ("/console/api/deadletters/a%2Eb", "a.b"),
        ("/console/api/deadletters/%2E", "."),
        ("/console/api/deadletters/%2e%2E", ".."),
    ] {
        let (status, letter) = send_as_written(&app, "GET", target, None, "").await;
        assert_eq!(
            (status, letter["messageId"].as_str()),
            (200, Some(id)),
            "{target}: {letter}"
        );
    }
    let (status, preview) = send_as_written(
        &app,
        "POST",
        "/deadletters/%2E%2E/resolution?dryRun=true",
        Some(&operator),
        &probe_skip().to_string(),
    )
    .await;
    assert_eq!(status, 200, "{preview}");
    assert_eq!(preview["messageId"], "..");

    // A browser drops such a segment before sending, so the same reads and resolutions take the
    // id in the query, where every id stays itself.
    for id in [".", "..", "a.b"] {
        let (status, letter) = status_and_json(
            app.get(&format!("/console/api/deadletter?messageId={id}"))
                .await,
        )
        .await;
        assert_eq!(
            (status, letter["messageId"].as_str()),
            (200, Some(id)),
            "{letter}"
        );
    }
    let (status, preview) = resolve_at(
        &app,
        Some(&operator),
        "/deadletters/resolution?messageId=.&dryRun=true",
        &probe_skip(),
    )
    .await;
    assert_eq!(
        (status, preview["outcome"].as_str()),
        (200, Some("dry run")),
        "{preview}"
    );
    assert_eq!(preview["messageId"], ".");
    assert_eq!(app.scalar("SELECT COUNT(*) FROM resolutions"), 0);

    // Without an id, the query forms say what is missing.
    let missing = assert_bad_request(app.get("/console/api/deadletter").await).await;
    assert!(
        missing["detail"]
            .as_str()
            .is_some_and(|d| d.contains("messageId")),
        "{missing}"
    );
    let missing = assert_bad_request(
        app.client
            .post(app.url("/deadletters/resolution"))
            .bearer_auth(&operator)
            .json(&probe_skip())
            .send()
            .await
            .expect("POST"),
    )
    .await;
    assert!(
        missing["detail"]
            .as_str()
            .is_some_and(|d| d.contains("messageId")),
        "{missing}"
    );

    // No door takes `.` or `..` as an aggregate id, so only message ids need the query form.
    let (status, refused) = send_as_written(
        &app,
        "POST",
        "/aggregates/%2E%2E/messages",
        None,
        r#"{"messageId":"m-1","sequence":1,"amount":1}"#,
    )
    .await;
    assert_eq!(status, 400, "{refused}");
}

/// Reads server-sent events off a response until one named `name` arrives; returns its data.
pub(crate) async fn next_event(
    stream: &mut (impl futures_util::Stream<Item = reqwest::Result<axum::body::Bytes>> + Unpin),
    buffer: &mut String,
    name: &str,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let mut event = "message";
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(value) = line.strip_prefix("event: ") {
                    event = value;
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data.push(value);
                }
            }
            if event == name {
                return data.join("\n");
            }
        }
        let chunk = tokio::time::timeout_at(deadline.into(), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no '{name}' event within ten seconds"))
            .expect("the stream is still open")
            .expect("a chunk");
        buffer.push_str(std::str::from_utf8(&chunk).expect("utf-8 events"));
    }
}

#[tokio::test]
async fn the_event_stream_reports_each_committed_change_and_ends_when_the_server_stops() {
    let app = spawn_app().await;
    let response = app.get("/console/events").await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().ok(),
        Some("text/event-stream")
    );
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    assert_eq!(next_event(&mut stream, &mut buffer, "hello").await, "live");

    assert_eq!(deliver(&app, "acct", "m-2", 2, 1).await, 409);
    let change: Value =
        serde_json::from_str(&next_event(&mut stream, &mut buffer, "change").await).expect("json");
    assert_eq!(
        change,
        json!({"aggregateId": "acct", "messageId": "m-2", "change": "gap"})
    );
    // A replay writes nothing and says nothing; the next real change is the next event.
    assert_eq!(deliver(&app, "acct", "m-1", 1, 1).await, 200);
    assert_eq!(deliver(&app, "acct", "m-1", 1, 1).await, 200);
    assert_eq!(deliver(&app, "acct", "m-2", 2, 1).await, 200);
    let applied: Vec<Value> = [
        next_event(&mut stream, &mut buffer, "change").await,
        next_event(&mut stream, &mut buffer, "change").await,
    ]
    .iter()
    .map(|data| serde_json::from_str(data).expect("json"))
    .collect();
    assert_eq!(applied[0]["messageId"], "m-1");
    assert_eq!(applied[1]["messageId"], "m-2");

    // An open page must not hold the graceful drain: the stream ends as shutdown begins.
    let reader = tokio::spawn(async move {
        while let Some(chunk) = stream.next().await {
            if chunk.is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    app.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the server took {:?} to stop with a stream open",
        started.elapsed()
    );
    tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the stream ended with the server")
        .expect("reader");
}

#[tokio::test]
async fn event_streams_are_capped_and_a_closed_one_frees_its_place() {
    let app = spawn_app().await;
    let cap = production_lab::console::events::MAX_STREAMS;
    let mut open = Vec::new();
    for _ in 0..cap {
        let response = app.get("/console/events").await;
        assert_eq!(response.status(), 200);
        let mut stream = response.bytes_stream();
        let mut buffer = String::new();
        next_event(&mut stream, &mut buffer, "hello").await;
        open.push(stream);
    }
    let (status, problem) = status_and_json(app.get("/console/events").await).await;
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["title"], "Too many console streams");

    drop(open.pop());
    poll_until(
        "a new stream is accepted once one page went away",
        || async { app.get("/console/events").await.status().as_u16() },
        |status| *status == 200,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// In a real browser

/// The console's base URL for the browser.
fn console(app: &TestApp, path: &str) -> String {
    app.url(path)
}

/// Waits until the page's live indicator says the event stream is connected.
async fn wait_live(browser: &Browser) {
    browser
        .wait_js::<String, _>(
            "the page's event stream connects",
            "return document.getElementById('live').dataset.state;",
            |state| state == "live",
        )
        .await;
}

#[tokio::test]
async fn the_lesson_walk_shows_each_verdict_and_the_rows_the_database_holds() {
    let app = spawn_app().await;
    let browser = Browser::start("lesson").await;
    browser
        .run(async {
            browser.goto(&console(&app, "/console")).await;
            let aggregate = browser
                .wait_text("#run-aggregate", |text| text.starts_with("lesson-"))
                .await;
            let expected = [
                (409, "gap"),
                (200, "applied"),
                (422, "quarantined"),
                (200, "replay"),
                (409, "payload conflict"),
                (409, "stale"),
                (200, "applied"),
            ];
            for (index, (status, outcome)) in expected.into_iter().enumerate() {
                let step = index + 1;
                browser
                    .click(&format!("#steps li[data-step=\"{step}\"] button"))
                    .await;
                let verdict = browser
                    .wait_text("#verdict", |text| text.starts_with(&format!("Step {step}:")))
                    .await;
                assert!(
                    verdict.starts_with(&format!("Step {step}: {status} {outcome}")),
                    "step {step}: {verdict}"
                );
                let change = browser.text("#change-line").await;

                // The rows the page shows are the rows in the database.
                let applied: Vec<Vec<String>> = app.rows(
                    &format!(
                        "SELECT message_id, sequence, amount FROM ordered_inbox
                          WHERE aggregate_id = '{aggregate}' ORDER BY sequence"
                    ),
                    |row| {
                        Ok(vec![
                            row.get::<_, String>(0)?,
                            row.get::<_, i64>(1)?.to_string(),
                            row.get::<_, i64>(2)?.to_string(),
                        ])
                    },
                );
                let shown: Vec<Vec<String>> = browser
                    .table("applied")
                    .await
                    .into_iter()
                    .map(|cells| cells[..3].to_vec())
                    .collect();
                assert_eq!(shown, applied, "step {step}: ordered_inbox");

                let state = aggregate_row(&app, &aggregate)
                    .map(|(last, total, status)| vec![last.to_string(), total.to_string(), status]);
                let shown_state: Vec<Vec<String>> = browser
                    .table("state")
                    .await
                    .into_iter()
                    .map(|cells| vec![cells[0].clone(), cells[1].clone(), cells[3].clone()])
                    .collect();
                assert_eq!(shown_state, state.into_iter().collect::<Vec<_>>(), "step {step}: aggregate_state");

                let dead: Vec<Vec<String>> = app.rows(
                    &format!(
                        "SELECT message_id, sequence, status, observations FROM deadletters
                          WHERE aggregate_id = '{aggregate}' ORDER BY id"
                    ),
                    |row| {
                        Ok(vec![
                            row.get::<_, String>(0)?,
                            row.get::<_, i64>(1)?.to_string(),
                            row.get::<_, String>(2)?,
                            row.get::<_, i64>(3)?.to_string(),
                        ])
                    },
                );
                let shown_dead: Vec<Vec<String>> = browser
                    .table("deadletters")
                    .await
                    .into_iter()
                    .map(|cells| cells[..4].to_vec())
                    .collect();
                assert_eq!(shown_dead, dead, "step {step}: deadletters");

                // One line says what changed and what did not.
                match step {
                    2 => assert!(change.contains(&format!("ordered_inbox +1 row ({aggregate}:m-1)")), "{change}"),
                    3 => {
                        assert!(change.contains("aggregate_state status flowing → blocked"), "{change}");
                        assert!(change.contains("deadletters +1 row"), "{change}");
                        assert!(change.contains("Unchanged: ordered_inbox"), "{change}");
                    }
                    4..=6 => assert!(change.starts_with("Nothing changed."), "step {step}: {change}"),
                    7 => {
                        assert!(change.contains("last 1 → 2"), "{change}");
                        assert!(change.contains(&format!("{aggregate}:poison-2 open → superseded")), "{change}");
                    }
                    _ => {}
                }
            }
            // Every step's button is spent and the classroom's demo was never touched.
            let results: Vec<String> = browser
                .js("return Array.from(document.querySelectorAll('#steps .result'), e => e.textContent);", vec![])
                .await;
            assert_eq!(results.len(), 7);
            assert_eq!(results[2], "422 quarantined");
            let (_, demo) = status_and_json(app.get("/ordered/state").await).await;
            assert_eq!(demo, json!({"applied": 0, "deadletters": 0, "last": 0}));

            // A new run is a new aggregate: the walk can be repeated.
            browser.click("#new-run").await;
            let second = browser
                .wait_text("#run-aggregate", |text| text.starts_with("lesson-") && text != aggregate)
                .await;
            browser.click("#steps li[data-step=\"1\"] button").await;
            browser
                .wait_text("#verdict", |text| text.starts_with("Step 1: 409 gap"))
                .await;
            assert!(aggregate_row(&app, &second).is_some_and(|(last, _, _)| last == 0));
        })
        .await;
    browser.close().await;
}

#[tokio::test]
async fn an_operator_previews_then_resolves_and_a_second_operators_stale_expected_last_is_refused_in_words()
 {
    let app = spawn_app().await;
    assert_eq!(deliver(&app, "acct-7", "m-1", 1, 5).await, 200);
    assert_eq!(deliver(&app, "acct-7", "poison-2", 2, -1).await, 422);
    let alice = add_operator(&app, "alice");
    let bob = add_operator(&app, "bob");
    let page = console(&app, "/console/deadletter?id=poison-2");
    let browser = Browser::start("resolution").await;
    browser
        .run(async {
            // Bob opens the dead letter first; both forms state expectedLast 1.
            browser.goto(&page).await;
            let (bob_tab, alice_tab) = {
                let (first, second) = browser.open_tab().await;
                (first, second)
            };
            browser.goto(&page).await;
            for tab in [&alice_tab, &bob_tab] {
                browser.switch_to(tab).await;
                wait_live(&browser).await;
                browser
                    .wait_js::<String, _>(
                        "expectedLast is pre-filled with the aggregate's last",
                        "return document.getElementById('expected-last').value;",
                        |value| value == "1",
                    )
                    .await;
            }
            browser.switch_to(&alice_tab).await;
            assert_eq!(browser.text("#dl-payload").await, "{\n  \"AggregateId\": \"acct-7\",\n  \"Sequence\": 2,\n  \"Amount\": -1\n}");

            // Without a token: 401, explained, nothing changed.
            browser.fill("#replacement-id", "fix-2").await;
            browser.fill("#replacement-amount", "2").await;
            browser.fill("#reason", "customer confirmed 2").await;
            browser.click("#resolve").await;
            let refused = resolution_result(&browser, "401").await;
            assert!(refused.contains("401 — not authorized, nothing was changed"), "{refused}");
            assert!(refused.contains("send Authorization: Bearer TOKEN"), "{refused}");

            // Preview: before → after, and not one row written.
            browser.fill("#token", &alice).await;
            browser.click("#preview").await;
            let preview = resolution_result(&browser, "preview").await;
            assert!(preview.contains("nothing was written"), "{preview}");
            assert!(preview.contains("replace poison-2 with fix-2 (amount 2)"), "{preview}");
            assert!(preview.contains("last 1 → 2, total 5 → 7"), "{preview}");
            assert_eq!(aggregate_row(&app, "acct-7"), Some((1, 5, "blocked".to_owned())));
            assert_eq!(app.scalar("SELECT COUNT(*) FROM resolutions"), 0);
            assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox WHERE message_id = 'fix-2'"), 0);
            assert_eq!(dead_letter_status(&app, "poison-2"), "open");

            // Resolve: the aggregate moves, the audit row appears on the page.
            browser.click("#resolve").await;
            let resolved = resolution_result(&browser, "resolved").await;
            assert!(resolved.contains("Resolved: resolution #1"), "{resolved}");
            assert_eq!(aggregate_row(&app, "acct-7"), Some((2, 7, "flowing".to_owned())));
            assert_eq!(dead_letter_status(&app, "poison-2"), "resolved");
            let audit: Vec<(i64, String, String)> = app.rows(
                "SELECT id, operator, reason FROM resolutions",
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
            );
            assert_eq!(audit, [(1, "alice".to_owned(), "customer confirmed 2".to_owned())]);
            let rows = browser
                .wait_table("the audit trail shows the new row", "audit", |rows| rows.len() == 1)
                .await;
            assert_eq!(rows[0][0], "1");
            assert_eq!(rows[0][2], "replace with fix-2 (amount 2)");
            assert_eq!(rows[0][3], "alice");
            assert_eq!(rows[0][4], "customer confirmed 2");
            assert_eq!(rows[0][5], "1 → 2");

            // The token stayed in the page: nothing was stored.
            let stored: (u32, u32, String) = browser
                .js("return [localStorage.length, sessionStorage.length, document.cookie];", vec![])
                .await;
            assert_eq!(stored, (0, 0, String::new()));

            // Bob's page followed the change live, but his form keeps what he stated.
            browser.switch_to(&bob_tab).await;
            let moved = browser
                .wait_text("#dl-moved", |text| text.contains("last sequence is now 2"))
                .await;
            assert!(moved.contains("the form says expectedLast 1"), "{moved}");
            browser.click("input[name=\"action\"][value=\"skip\"]").await;
            browser.fill("#reason", "duplicate, skip it").await;
            browser.fill("#token", &bob).await;
            browser.click("#resolve").await;
            let conflict = resolution_result(&browser, "409").await;
            assert!(conflict.contains("409 — refused, nothing was changed: The dead letter is already resolved"), "{conflict}");
            assert!(
                conflict.contains("the aggregate's last sequence is 2 (you sent expectedLast 1: someone moved it since you looked)"),
                "{conflict}"
            );
            assert!(conflict.contains("resolved by alice (replace, resolution #1)"), "{conflict}");
            assert_eq!(app.scalar("SELECT COUNT(*) FROM resolutions"), 1);
            assert_eq!(aggregate_row(&app, "acct-7"), Some((2, 7, "flowing".to_owned())));
        })
        .await;
    browser.close().await;
}

#[tokio::test]
async fn a_script_injection_payload_renders_as_text_and_runs_nothing() {
    let app = spawn_app().await;
    let operator = add_operator(&app, "alice");
    assert_eq!(deliver(&app, "inject", INJECTION, 1, -1).await, 422);
    let (status, body) = resolve_at(
        &app,
        Some(&operator),
        "/deadletters/%3Cimg%20src=x%20onerror=alert(1)%3E/resolution",
        &json!({"action": "skip", "expectedLast": 0, "reason": INJECTION}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let second = "<script>alert(2)</script>";
    assert_eq!(deliver(&app, "inject", second, 2, -1).await, 422);

    let browser = Browser::start("injection").await;
    browser
        .run(async {
            let pages = [
                ("/console/aggregates", second),
                ("/console/aggregate?id=inject", INJECTION),
                ("/console/deadletter?id=%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E", INJECTION),
                ("/console/deadletter?id=%3Cscript%3Ealert(2)%3C%2Fscript%3E", second),
            ];
            for (path, payload) in pages {
                browser.goto(&console(&app, path)).await;
                wait_live(&browser).await;
                // The payload is on the page as the very characters that were sent …
                let script = format!(
                    "return document.querySelector('main').textContent.includes({});",
                    Value::from(payload)
                );
                browser
                    .wait_js::<bool, _>(&format!("{path} shows the payload as text"), &script, |shown| *shown)
                    .await;
                // … and never became markup: no image, no inline script, no dialog.
                let (images, inline_scripts): (u32, u32) = browser
                    .js(
                        "return [document.querySelectorAll('img').length, document.querySelectorAll('script:not([src])').length];",
                        vec![],
                    )
                    .await;
                assert_eq!((images, inline_scripts), (0, 0), "{path}");
                assert!(!browser.dialog_open().await, "{path} opened a dialog");
            }
            // The reason is shown literally in the audit trail, and the id as the page's title.
            assert_eq!(browser.text("#dl-id").await, second);
            browser
                .goto(&console(&app, "/console/aggregate?id=inject"))
                .await;
            let audit = browser
                .wait_table("the audit trail is read", "audit", |rows| rows.len() == 1)
                .await;
            assert_eq!(audit[0][1], INJECTION);
            assert_eq!(audit[0][4], INJECTION);
            assert!(!browser.dialog_open().await);
        })
        .await;
    browser.close().await;
}

#[tokio::test]
async fn a_change_made_over_http_by_another_client_appears_on_an_open_page_without_reload() {
    let app = spawn_app().await;
    assert_eq!(deliver(&app, "steady", "s-1", 1, 1).await, 200);
    let browser = Browser::start("live").await;
    browser
        .run(async {
            browser.goto(&console(&app, "/console/aggregates")).await;
            wait_live(&browser).await;
            browser
                .wait_table("the inventory is read", "inventory", |rows| rows.len() == 1)
                .await;
            let _: Value = browser.js("window.stayed = 'the same page'; return null;", vec![]).await;

            // Another client blocks a new aggregate over HTTP.
            assert_eq!(deliver(&app, "other-client", "p-1", 1, -1).await, 422);
            let rows = browser
                .wait_table("the new blocked aggregate appears", "inventory", |rows| rows.len() == 2)
                .await;
            assert_eq!(rows[0][0], "other-client", "blocked comes first: {rows:?}");
            assert_eq!(rows[0][1], "blocked");
            assert_eq!(rows[0][5], "1");
            browser
                .wait_js::<bool, _>(
                    "its dead letter appears among the open ones",
                    "return document.getElementById('open-deadletters').textContent.includes('p-1');",
                    |shown| *shown,
                )
                .await;

            // The filter narrows the list, and still follows changes.
            browser.client.find(fantoccini::Locator::Css("#status-filter")).await.expect("filter")
                .select_by_value("waiting").await.expect("choose waiting");
            browser
                .wait_table("only waiting aggregates are listed", "inventory", |rows| rows.is_empty())
                .await;
            assert_eq!(deliver(&app, "late", "l-3", 3, 1).await, 409);
            let waiting = browser
                .wait_table("the waiting aggregate appears", "inventory", |rows| rows.len() == 1)
                .await;
            assert_eq!(waiting[0][0], "late");
            assert_eq!(waiting[0][1], "waiting");

            let stayed: Option<String> = browser.js("return window.stayed || null;", vec![]).await;
            assert_eq!(stayed.as_deref(), Some("the same page"), "the page was reloaded");
        })
        .await;
    browser.close().await;
}

/// Waits until the dead-letter page shows the result in state `state`; returns its text.
async fn resolution_result(browser: &Browser, state: &str) -> String {
    let script = format!(
        "const r = document.getElementById('resolve-result'); return r.dataset.state === {} ? r.textContent : '';",
        Value::from(state)
    );
    browser
        .wait_js::<String, _>(&format!("the {state} result is shown"), &script, |text| {
            !text.is_empty()
        })
        .await
}

#[tokio::test]
async fn dead_letters_whose_ids_are_dot_and_dot_dot_open_preview_and_resolve_in_the_console() {
    let app = spawn_app().await;
    let operator = add_operator(&app, "alice");
    assert_eq!(deliver(&app, "dot-one", ".", 1, -1).await, 422);
    assert_eq!(deliver(&app, "dot-two", "..", 1, -1).await, 422);
    let browser = Browser::start("dot_ids").await;
    browser
        .run(async {
            for (aggregate, id, page) in [
                ("dot-one", ".", "/console/deadletter?id=."),
                ("dot-two", "..", "/console/deadletter?id=.."),
            ] {
                browser.goto(&console(&app, page)).await;
                wait_live(&browser).await;
                // The record read is this dead letter's, not a neighbouring route's answer.
                let shown = browser
                    .wait_text("#dl-details dd[data-term=\"message id\"]", |text| {
                        !text.is_empty()
                    })
                    .await;
                assert_eq!(shown, id);
                assert_eq!(
                    browser
                        .text("#dl-details dd[data-term=\"aggregate\"]")
                        .await,
                    aggregate
                );
                browser
                    .wait_js::<String, _>(
                        "expectedLast is pre-filled with the aggregate's last",
                        "return document.getElementById('expected-last').value;",
                        |value| value == "0",
                    )
                    .await;
                assert!(
                    browser
                        .js::<bool>("return document.getElementById('dl-error').hidden;", vec![])
                        .await
                );

                browser
                    .click("input[name=\"action\"][value=\"skip\"]")
                    .await;
                browser
                    .fill("#reason", &format!("skip the dead letter {id}"))
                    .await;
                browser.fill("#token", &operator).await;
                browser.click("#preview").await;
                let preview = resolution_result(&browser, "preview").await;
                assert!(
                    preview.contains(&format!(
                        "skip {id} (sequence 1 taken with no effect) on {aggregate}"
                    )),
                    "{preview}"
                );
                assert_eq!(dead_letter_status(&app, id), "open");

                browser.click("#resolve").await;
                let resolved = resolution_result(&browser, "resolved").await;
                assert!(resolved.contains("Resolved: resolution #"), "{resolved}");
                assert_eq!(dead_letter_status(&app, id), "resolved");
                let audit = browser
                    .wait_table("the audit trail shows the resolution", "audit", |rows| {
                        rows.len() == 1
                    })
                    .await;
                assert_eq!(audit[0][1], id);
                assert_eq!(audit[0][2], "skip");
            }
            // The server's audit trail names each id resolved, on its own aggregate.
            let (status, audit) = status_and_json(app.get("/resolutions").await).await;
            assert_eq!(status, 200, "{audit}");
            let resolved: Vec<(String, String, String)> = audit["resolutions"]
                .as_array()
                .expect("resolutions")
                .iter()
                .map(|r| {
                    let text = |name: &str| r[name].as_str().unwrap_or_default().to_owned();
                    (text("messageId"), text("aggregateId"), text("action"))
                })
                .collect();
            assert_eq!(
                resolved,
                [
                    (".".to_owned(), "dot-one".to_owned(), "skip".to_owned()),
                    ("..".to_owned(), "dot-two".to_owned(), "skip".to_owned()),
                ]
            );
        })
        .await;
    browser.close().await;
}

/// Publishes one anonymous message on the broker door's wire format and waits for its PubAck.
async fn publish_on_broker(js: &async_nats::jetstream::Context, aggregate: &str, sequence: i64) {
    let message_id = format!("{aggregate}-{sequence}");
    publish_ordered(js, None, aggregate, &message_id, sequence, 1).await;
}

/// Waits until the inventory lists `aggregate` with cells that satisfy `done`; returns them.
async fn inventory_row(
    browser: &Browser,
    aggregate: &str,
    what: &str,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let row_of = |rows: &[Vec<String>]| {
        rows.iter()
            .find(|cells| cells.first().map(String::as_str) == Some(aggregate))
            .cloned()
    };
    let rows = browser
        .wait_table(what, "inventory", |rows| {
            row_of(rows).is_some_and(|row| done(&row))
        })
        .await;
    row_of(&rows).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_messages_ahead_of_their_turn_show_held_in_the_console_until_their_predecessor_applies()
 {
    let nats = start_nats(None);
    let broker = loopback_config(&nats.url).expect("a loopback NATS URL");
    let app = spawn_app_with(move |config| config.nats = Some(broker)).await;
    let js = jetstream_of(&nats).await;
    let aggregate = "held-acct";
    let browser = Browser::start("held").await;
    browser
        .run(async {
            browser.goto(&console(&app, "/console/aggregates")).await;
            wait_live(&browser).await;
            // 2 and 3 arrive first: the door holds them, and the open page says so.
            publish_on_broker(&js, aggregate, 2).await;
            publish_on_broker(&js, aggregate, 3).await;
            let held = inventory_row(&browser, aggregate, "the inventory shows two held", |row| {
                row[6] == "2"
            })
            .await;
            assert_eq!(
                (held[3].as_str(), held[4].as_str()),
                ("0", "1"),
                "last 0, expected 1: {held:?}"
            );
            let (_, view) =
                status_and_json(app.get(&format!("/aggregates/{aggregate}")).await).await;
            assert_eq!(view["heldSequences"], json!([2, 3]), "{view}");

            browser
                .goto(&console(
                    &app,
                    &format!("/console/aggregate?id={aggregate}"),
                ))
                .await;
            wait_live(&browser).await;
            let held = browser
                .wait_text("#summary dd[data-term=\"held\"]", |text| !text.is_empty())
                .await;
            assert_eq!(held, "2: 2, 3");

            // 1 arrives: it applies, 2 and 3 drain behind it, and nothing is held any more.
            publish_on_broker(&js, aggregate, 1).await;
            let held = browser
                .wait_text("#summary dd[data-term=\"held\"]", |text| text == "0")
                .await;
            assert_eq!(held, "0");
            assert_eq!(
                browser.text("#summary dd[data-term=\"status\"]").await,
                "flowing"
            );
            assert_eq!(browser.text("#summary dd[data-term=\"last\"]").await, "3");

            browser.goto(&console(&app, "/console/aggregates")).await;
            let flowing = inventory_row(
                &browser,
                aggregate,
                "the inventory shows it flowing",
                |row| row[1] == "flowing",
            )
            .await;
            assert_eq!(
                (flowing[3].as_str(), flowing[6].as_str()),
                ("3", "0"),
                "{flowing:?}"
            );
        })
        .await;
    browser.close().await;
    app.stop().await;
}

/// A second loopback origin, served by the test: pages that try the CORS and antiforgery labs
/// from another origin.
struct OtherOrigin {
    url: String,
    server: tokio::task::JoinHandle<()>,
}

impl OtherOrigin {
    async fn start(pages: Vec<(&'static str, String)>) -> OtherOrigin {
        let mut router = Router::new();
        for (path, html) in pages {
            router = router.route(path, get(move || std::future::ready(Html(html.clone()))));
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the second origin");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        OtherOrigin { url, server }
    }
}

impl Drop for OtherOrigin {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A page that fetches the URL in its fragment and shows what it could read.
const READER: &str = r#"<!doctype html><meta charset="utf-8"><p id="out">waiting</p><script>
fetch(decodeURIComponent(location.hash.slice(1)))
  .then(r => r.text()).then(t => { document.getElementById('out').textContent = 'read: ' + t; })
  .catch(e => { document.getElementById('out').textContent = 'blocked: ' + e; });
</script>"#;

#[tokio::test]
async fn the_cors_and_antiforgery_labs_hold_in_a_real_browser() {
    let app = spawn_app().await;
    let allowed = TlsOrigin::start("client.example").await;
    allowed.put("reader.html", READER);
    let forge = format!(
        r#"<!doctype html><meta charset="utf-8">
<form method="post" action="{target}/antiforgery/submit"><button id="forge" type="submit">win a prize</button></form>
<p id="steal">waiting</p><script>
fetch('{target}/antiforgery/token', {{credentials: 'include'}})
  .then(r => r.json()).then(b => {{ document.getElementById('steal').textContent = 'stolen: ' + b.requestToken; }})
  .catch(e => {{ document.getElementById('steal').textContent = 'blocked: ' + e; }});
</script>"#,
        target = app.address
    );
    let other = OtherOrigin::start(vec![
        ("/reader.html", READER.to_owned()),
        ("/forge.html", forge),
    ])
    .await;
    let browser = Browser::start_with("cors_antiforgery", &[allowed.resolver_rule()]).await;
    browser
        .run(async {
            let data = app.url("/cors/data");
            let fragment = data.replace(':', "%3A");

            // CORS: the policy's origin reads the data; another origin's script cannot.
            browser.goto(&format!("https://client.example/reader.html#{fragment}")).await;
            let read = browser.wait_text("#out", |text| text != "waiting").await;
            assert_eq!(read, r#"read: {"value":"public classroom data","authenticated":false}"#);
            let origin: String = browser.js("return location.origin;", vec![]).await;
            assert_eq!(origin, "https://client.example");

            browser.goto(&format!("{}/reader.html#{fragment}", other.url)).await;
            let blocked = browser.wait_text("#out", |text| text != "waiting").await;
            assert!(blocked.starts_with("blocked: TypeError"), "{blocked}");

            // Antiforgery, same origin: the page fetches a token (the browser keeps the HttpOnly
            // cookie) and echoes it in the header; without the header the server refuses.
            browser.goto(&console(&app, "/console/labs")).await;
            let outcome: (u16, String, u16) = browser
                .client
                .execute_async(
                    "const done = arguments[arguments.length - 1];
                     (async () => {
                       const token = (await (await fetch('/antiforgery/token')).json()).requestToken;
                       const good = await fetch('/antiforgery/submit', {method: 'POST', headers: {'X-CSRF-TOKEN': token}});
                       const bare = await fetch('/antiforgery/submit', {method: 'POST'});
                       return [good.status, await good.text(), bare.status];
                     })().then(done, e => done([0, String(e), 0]));",
                    vec![],
                )
                .await
                .map(|value| serde_json::from_value(value).expect("three values"))
                .expect("the script runs");
            assert_eq!(outcome, (200, r#"{"accepted":1}"#.to_owned(), 400));
            let cookie_visible: String = browser.js("return document.cookie;", vec![]).await;
            assert_eq!(cookie_visible, "", "the antiforgery cookie is out of reach of scripts");
            browser
                .wait_js::<String, _>(
                    "the labs page shows the accepted submission",
                    "const d = document.querySelector('[data-path=\"/antiforgery/count\"] dd[data-term=\"count\"]'); return d ? d.textContent : '';",
                    |count| count == "1",
                )
                .await;

            // Cross origin: the forger cannot read a token, and its form post (which carries the
            // cookie: same site, other port) is refused.
            browser.goto(&format!("{}/forge.html", other.url)).await;
            let steal = browser.wait_text("#steal", |text| text != "waiting").await;
            assert!(steal.starts_with("blocked: TypeError"), "{steal}");
            browser.click("#forge").await;
            let answer = browser
                .wait_js::<String, _>(
                    "the forged submission is answered",
                    "return location.pathname === '/antiforgery/submit' ? document.body.textContent : '';",
                    |text| !text.is_empty(),
                )
                .await;
            assert_eq!(answer, r#"{"error":"Antiforgery validation failed"}"#);
            let (_, count) = status_and_json(app.get("/antiforgery/count").await).await;
            assert_eq!(count, json!({"count": 1}));
        })
        .await;
    browser.close().await;
}

/// Everything on the page that sticks out of the viewport, overlaps a sibling or overflows its
/// own box, in words; empty when the layout holds.
const LAYOUT_PROBLEMS: &str = r#"
const problems = [];
const width = window.innerWidth;
const scroller = document.scrollingElement;
if (scroller.scrollWidth > width) problems.push(`the page scrolls sideways: ${scroller.scrollWidth} > ${width}`);
const name = (e) => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + (e.className && typeof e.className === 'string' ? '.' + e.className.split(' ').join('.') : '');
const boxed = (e) => {
  const s = getComputedStyle(e);
  const r = e.getBoundingClientRect();
  return s.display !== 'none' && s.display !== 'inline' && s.display !== 'contents' && s.visibility !== 'hidden' && r.width > 0 && r.height > 0;
};
for (const e of [document.body, ...document.querySelectorAll('body *')]) {
  if (!boxed(e)) continue;
  const r = e.getBoundingClientRect();
  if (r.left < -0.5 || r.right > width + 0.5) problems.push(`${name(e)} sticks out: ${Math.round(r.left)}..${Math.round(r.right)} of ${width}`);
  const s = getComputedStyle(e);
  if (s.overflowX === 'visible' && e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0) problems.push(`${name(e)} overflows its box: ${e.scrollWidth} > ${e.clientWidth}`);
  const kids = Array.from(e.children).filter(boxed).filter((k) => getComputedStyle(k).position === 'static');
  for (let i = 0; i < kids.length; i++) {
    const a = kids[i].getBoundingClientRect();
    for (let j = i + 1; j < kids.length; j++) {
      const b = kids[j].getBoundingClientRect();
      const overlapX = Math.min(a.right, b.right) - Math.max(a.left, b.left);
      const overlapY = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
      if (overlapX > 1 && overlapY > 1) problems.push(`${name(kids[i])} overlaps ${name(kids[j])} in ${name(e)}`);
    }
  }
}
return problems.slice(0, 20);
"#;

#[tokio::test]
async fn the_main_pages_fit_a_phone_and_a_wide_screen_without_overlap_or_sideways_scrolling() {
    let app = spawn_app().await;
    let long_id = format!("a-message-id-without-any-space-{}", "x".repeat(60));
    assert_eq!(deliver(&app, "acct-7", "m-1", 1, 5).await, 200);
    assert_eq!(deliver(&app, "acct-7", &long_id, 2, -1).await, 422);
    assert_eq!(deliver(&app, "acct-8", "w-2", 2, 1).await, 409);
    let encoded_id = long_id.clone();
    let browser = Browser::start("layout").await;
    browser
        .run(async {
            // Each page, and a fact that says it has drawn its data.
            let pages = [
                (
                    "/console".to_owned(),
                    "document.querySelectorAll('#steps li').length === 7",
                ),
                (
                    "/console/aggregates".to_owned(),
                    "document.querySelectorAll('#inventory tbody tr').length >= 2",
                ),
                (
                    "/console/aggregate?id=acct-7".to_owned(),
                    "document.querySelectorAll('#timeline tbody tr').length === 2",
                ),
                (
                    format!("/console/deadletter?id={encoded_id}"),
                    "document.getElementById('expected-last').value === '1'",
                ),
                (
                    "/console/labs".to_owned(),
                    "document.querySelectorAll('#lab-panels dd').length > 10",
                ),
            ];
            for (width, height) in [(390, 844), (1280, 900)] {
                browser.set_viewport(width, height).await;
                for (path, drawn) in &pages {
                    browser.goto(&console(&app, path)).await;
                    browser
                        .wait_js::<bool, _>(
                            &format!("{path} draws its data"),
                            &format!("return {drawn};"),
                            |done| *done,
                        )
                        .await;
                    if path == "/console" {
                        // The lesson with rows in its tables, not only its buttons.
                        for step in 1..=3 {
                            browser
                                .click(&format!("#steps li[data-step=\"{step}\"] button"))
                                .await;
                            browser
                                .wait_text("#verdict", |text| {
                                    text.starts_with(&format!("Step {step}:"))
                                })
                                .await;
                        }
                    }
                    let problems: Vec<String> = browser.js(LAYOUT_PROBLEMS, vec![]).await;
                    assert!(problems.is_empty(), "{path} at {width}px: {problems:#?}");
                }
            }
        })
        .await;
    browser.close().await;
}

#[test]
#[should_panic(expected = "install the Debian packages `chromium` and `chromium-driver`")]
fn a_missing_browser_fails_the_test_with_the_debian_packages_to_install() {
    crate::browser::required("no-such-browser-anywhere", &["/nonexistent/chromium"]);
}

async fn gap_result(browser: &Browser, state: &str) -> String {
    let script = format!(
        "const r = document.getElementById('gap-result'); return r.dataset.state === {} ? r.textContent : '';",
        Value::from(state)
    );
    browser
        .wait_js::<String, _>(
            &format!("the gap's {state} result is shown"),
            &script,
            |text| !text.is_empty(),
        )
        .await
}

#[tokio::test]
async fn an_operator_previews_then_skips_a_gap_from_the_aggregates_page_and_the_stream_flows_again()
{
    let app = spawn_app().await;
    assert_eq!(deliver(&app, "acct-9", "m-1", 1, 5).await, 200);
    assert_eq!(deliver(&app, "acct-9", "m-4", 4, 2).await, 409);
    let alice = add_operator(&app, "alice");
    let browser = Browser::start("gap-resolution").await;
    browser
        .run(async {
            browser.goto(&console(&app, "/console/aggregates?status=waiting")).await;
            let rows = browser
                .wait_table("the inventory shows the waiting aggregate", "inventory", |rows| {
                    rows.iter().any(|row| row[0] == "acct-9")
                })
                .await;
            let row = rows.iter().find(|row| row[0] == "acct-9").expect("its row");
            assert_eq!(row[7], "2–3", "the missing range: {row:?}");

            browser.goto(&console(&app, "/console/aggregate?id=acct-9")).await;
            wait_live(&browser).await;
            let range = browser.wait_text("#gap-range", |text| !text.is_empty()).await;
            assert_eq!(range, "2–3");
            let prefilled: (String, String, String) = browser
                .js(
                    "return ['gap-from', 'gap-through', 'gap-expected-last'].map((id) => document.getElementById(id).value);",
                    vec![],
                )
                .await;
            assert_eq!(prefilled, ("2".to_owned(), "3".to_owned(), "1".to_owned()));

            // Without a token: 401 in words, nothing changed.
            browser.fill("#gap-reason", "sequences 2 and 3 were purged upstream").await;
            browser.click("#gap-resolve").await;
            let refused = gap_result(&browser, "401").await;
            assert!(refused.contains("401"), "{refused}");
            assert!(refused.contains("nothing was changed"), "{refused}");

            // Preview: what the skip would do, and nothing written.
            browser.fill("#gap-token", &alice).await;
            browser.click("#gap-preview").await;
            let preview = gap_result(&browser, "preview").await;
            assert!(preview.contains("nothing was written"), "{preview}");
            assert!(preview.contains("last 1 → 3"), "{preview}");
            assert_eq!(aggregate_row(&app, "acct-9"), Some((1, 5, "waiting".to_owned())));

            // Skip: the position moves past the gap and the audit trail shows it.
            browser.click("#gap-resolve").await;
            let resolved = gap_result(&browser, "resolved").await;
            assert!(resolved.contains("Resolved: resolution #1, 2–3 skipped"), "{resolved}");
            assert_eq!(aggregate_row(&app, "acct-9"), Some((3, 5, "flowing".to_owned())));
            let audit = browser
                .wait_table("the audit trail shows the skip", "audit", |rows| rows.len() == 1)
                .await;
            assert_eq!(audit[0][2], "skip gap 2–3");
            assert_eq!(audit[0][3], "alice");
            assert_eq!(audit[0][5], "1 → 3");
        })
        .await;
    browser.close().await;
    // The stream flows again: the producer's resent 4 applies.
    assert_eq!(deliver(&app, "acct-9", "m-4", 4, 2).await, 200);
    // A late 2 is refused: it was skipped.
    assert_eq!(deliver(&app, "acct-9", "m-2", 2, 1).await, 409);
}
