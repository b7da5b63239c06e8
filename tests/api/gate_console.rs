//! The gate's console: the real `production-lab gate` process on a plain-HTTP loopback
//! configuration (a reader token in the file, an operator in its registry), its pages over
//! HTTP, and headless Chromium signing in with an operator's or a reader's token and driving the
//! pages against the gate's `/v1` routes.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::browser::Browser;
use crate::gate::{GateProcess, add_operator};
use crate::helpers::{client, poll_until_within};

const READER_TOKEN: &str = "reader-token-for-the-gate-console";
const AGGREGATE: &str = "order-1";

const PLACED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "amount"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "amount": {"type": "integer", "minimum": 0}
  }
}"#;

/// The gate's directory: a loopback configuration without TLS or NATS, one message type, one
/// reader, and the SQLite file.
struct ConsoleGate {
    _dir: TempDir,
    gate: GateProcess,
    operator: String,
    http: reqwest::Client,
}

impl ConsoleGate {
    fn start() -> ConsoleGate {
        let dir = tempfile::tempdir().expect("a temp dir");
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("placed.json", PLACED_SCHEMA);
        write(
            "gate.toml",
            &format!(
                r#"
[listen]
address = "127.0.0.1:0"

[store]
sqlite = "gate.db"

[auth]
readers = [{{ name = "dashboard", token = "{READER_TOKEN}" }}]

[types."order.placed"]
schema = "placed.json"
"#
            ),
        );
        let config = dir.path().join("gate.toml");
        let gate = GateProcess::start(&config);
        let operator = add_operator(&database(&dir), "alice");
        ConsoleGate {
            _dir: dir,
            gate,
            operator,
            http: client(),
        }
    }

    fn url(&self, path: &str) -> String {
        self.gate.url(path)
    }

    /// `GET path` with `token` (none: no Authorization header).
    async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let request = self.http.get(self.url(path));
        let request = match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        request.send().await.expect("a GET to the gate")
    }

    /// Registers the producer `shop`, starts its session and delivers `order-1`'s sequences 1
    /// and 2, the second refused by the schema (a negative amount): the aggregate is blocked at
    /// 1 and its dead letter holds 2. Answers the producer's token and epoch.
    async fn quarantine_the_second_message(&self) -> (String, i64) {
        let added: Value = self
            .http
            .post(self.url("/v1/producers"))
            .bearer_auth(&self.operator)
            .json(&json!({"name": "shop"}))
            .send()
            .await
            .expect("add a producer")
            .json()
            .await
            .expect("the new producer");
        let token = added["token"].as_str().expect("its token").to_owned();
        let session: Value = self
            .http
            .post(self.url("/v1/producers/session"))
            .bearer_auth(&token)
            .send()
            .await
            .expect("start a session")
            .json()
            .await
            .expect("the session");
        let epoch = session["epoch"].as_i64().expect("an epoch");
        for (sequence, amount, verdict) in [(1, 10, 200), (2, -1, 422)] {
            let status = self.deliver(&token, epoch, sequence, amount).await;
            assert_eq!(status, verdict, "sequence {sequence}");
        }
        (token, epoch)
    }

    /// Delivers `order-1`'s message `m-SEQUENCE` with `amount`; answers the status.
    async fn deliver(&self, token: &str, epoch: i64, sequence: i64, amount: i64) -> u16 {
        self.http
            .post(self.url(&format!("/v1/aggregates/{AGGREGATE}/messages")))
            .bearer_auth(token)
            .header("Producer-Epoch", epoch.to_string())
            .json(&json!({
                "messageId": format!("m-{sequence}"),
                "sequence": sequence,
                "type": "order.placed",
                "payload": {"orderId": AGGREGATE, "amount": amount},
            }))
            .send()
            .await
            .expect("a delivery")
            .status()
            .as_u16()
    }
}

fn database(dir: &TempDir) -> PathBuf {
    dir.path().join("gate.db")
}

/// Signs in on `/console` with `token` and waits for the inventory to list the blocked
/// aggregate.
async fn sign_in(browser: &Browser, gate: &ConsoleGate, token: &str) {
    browser.goto(&gate.url("/console")).await;
    browser.fill("#token", token).await;
    browser.click("#sign-in-button").await;
    browser
        .wait_table(
            "the inventory lists the blocked aggregate",
            "aggregates",
            |rows| {
                rows.iter()
                    .any(|row| row[0] == AGGREGATE && row[1] == "blocked" && row[2] == "1")
            },
        )
        .await;
}

/// The `dd` of the term `term` in the `<dl>` with id `list` ("" when absent).
fn fact_script(list: &str, term: &str) -> String {
    format!(
        "const d = document.querySelector('#{list} dd[data-term=\"{term}\"]'); return d ? d.textContent : '';"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_pages_load_without_a_token_with_strict_headers_but_every_data_call_without_one_is_401()
 {
    let gate = ConsoleGate::start();
    gate.quarantine_the_second_message().await;
    for page in [
        "/console",
        "/console/aggregate?id=order-1",
        "/console/deadletter?messageId=m-2&producer=shop",
        "/console/producers",
        "/console/assets/common.js",
        "/console/recheck",
        "/console/assets/recheck.js",
        "/console/assets/gate.js",
        "/console/assets/console.css",
    ] {
        let response = gate.get(page, None).await;
        assert_eq!(response.status(), StatusCode::OK, "{page}");
        let headers = response.headers();
        assert_eq!(
            headers["content-security-policy"],
            "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
            "{page}"
        );
        assert_eq!(headers["x-content-type-options"], "nosniff", "{page}");
        assert_eq!(headers["referrer-policy"], "no-referrer", "{page}");
        assert_eq!(headers["x-frame-options"], "DENY", "{page}");
    }
    let sign_in = gate.get("/console", None).await.text().await.unwrap();
    assert!(sign_in.contains("gate console"), "{sign_in}");
    assert!(
        !sign_in.contains(READER_TOKEN) && !sign_in.contains("order-1"),
        "a page carries no data: {sign_in}"
    );
    let missing = gate.get("/console/assets/lesson.js", None).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND, "no lab file");
    assert_eq!(
        missing.headers()["content-security-policy"],
        "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    );

    for path in [
        "/v1/aggregates?status=blocked",
        "/v1/aggregates/order-1",
        "/v1/aggregates/order-1/timeline",
        "/v1/aggregates/order-1/gaps",
        "/v1/aggregates/order-1/applied",
        "/v1/deadletters",
        "/v1/deadletter?messageId=m-2&producer=shop",
        "/v1/resolutions",
        "/v1/producers",
        "/v1/operators",
    ] {
        let response = gate.get(path, None).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "GET {path}");
    }
    for path in [
        "/v1/deadletters/resolution?messageId=m-2&producer=shop",
        "/v1/aggregates/order-1/gaps/resolution",
        "/v1/deadletters/recheck",
        "/v1/deadletters/skip?dryRun=true",
        "/v1/producers",
    ] {
        let response = gate
            .http
            .post(gate.url(path))
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "POST {path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_dead_letter_is_read_by_its_message_id_and_producer_in_the_query() {
    let gate = ConsoleGate::start();
    gate.quarantine_the_second_message().await;
    let found = gate
        .get(
            "/v1/deadletter?messageId=m-2&producer=shop",
            Some(READER_TOKEN),
        )
        .await;
    assert_eq!(found.status(), StatusCode::OK);
    let letter: Value = found.json().await.unwrap();
    assert_eq!(
        (
            &letter["messageId"],
            &letter["producer"],
            &letter["sequence"],
            &letter["status"]
        ),
        (&json!("m-2"), &json!("shop"), &json!(2), &json!("open"))
    );
    assert!(
        letter["reason"]
            .as_str()
            .is_some_and(|reason| reason.starts_with("payload does not match the schema")),
        "{letter}"
    );
    let anonymous = gate
        .get("/v1/deadletter?messageId=m-2", Some(READER_TOKEN))
        .await;
    assert_eq!(
        anonymous.status(),
        StatusCode::NOT_FOUND,
        "a message id belongs to its producer"
    );
    let unnamed = gate.get("/v1/deadletter", Some(READER_TOKEN)).await;
    assert_eq!(unnamed.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        unnamed.headers()["content-type"],
        "application/problem+json"
    );
    let document: Value = gate
        .get("/v1/openapi.json", None)
        .await
        .json()
        .await
        .unwrap();
    assert!(
        document["paths"]["/v1/deadletter"]["get"].is_object(),
        "the route is in the gate's document"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_replaces_a_quarantined_message_after_a_dry_run_and_sees_the_aggregate_applied_through_the_next_sequence()
 {
    let gate = ConsoleGate::start();
    let (producer, epoch) = gate.quarantine_the_second_message().await;
    let browser = Browser::start("gate-console-operator").await;
    browser
        .run(async {
            sign_in(&browser, &gate, &gate.operator).await;
            let kept: (String, String, String) = browser
                .js(
                    "return [sessionStorage.getItem('gate-console.role'), document.cookie, location.href];",
                    vec![],
                )
                .await;
            assert_eq!(kept.0, "operator");
            assert!(
                kept.1.is_empty() && !kept.2.contains(&gate.operator),
                "the token is in no cookie or address: {kept:?}"
            );

            browser.click("#aggregates a").await;
            browser
                .wait_table("the aggregate's open dead letter", "dead-letters", |rows| {
                    rows.iter().any(|row| row[0] == "m-2" && row[2] == "2")
                })
                .await;
            browser.click("#dead-letters a").await;
            browser
                .wait_text("#dl-reason", |text| {
                    text.starts_with("payload does not match the schema of 'order.placed'")
                })
                .await;
            // The page fills the form after it showed the reason: wait for the fact.
            let form: (String, bool) = browser
                .wait_js(
                    "the replacement form filled from the dead letter",
                    "return [document.getElementById('replacement-type').value, document.getElementById('resolve-button').disabled];",
                    |(kind, _): &(String, bool)| !kind.is_empty(),
                )
                .await;
            assert_eq!(
                form,
                ("order.placed".to_owned(), true),
                "the type is the dead letter's; resolving waits for a preview"
            );

            browser
                .fill(
                    "#replacement-payload",
                    r#"{"orderId": "order-1", "amount": 5}"#,
                )
                .await;
            browser
                .fill("#reason", "the shop sent a negative amount; 5 was meant")
                .await;
            browser.click("#preview").await;
            browser
                .wait_js::<String, _>(
                    "the dry run's preview",
                    "return document.getElementById('resolve-result').dataset.state;",
                    |state| state == "preview",
                )
                .await;
            let preview = browser.text("#resolve-result").await;
            assert!(
                preview.contains("nothing was written") && preview.contains("last 1 → 2"),
                "{preview}"
            );
            let still_open = gate
                .get("/v1/deadletter?messageId=m-2&producer=shop", Some(READER_TOKEN))
                .await
                .json::<Value>()
                .await
                .unwrap();
            assert_eq!(still_open["status"], "open", "a dry run changes nothing");

            browser.click("#resolve-button").await;
            browser
                .wait_js::<String, _>(
                    "the resolution",
                    "return document.getElementById('resolve-result').dataset.state;",
                    |state| state == "resolved",
                )
                .await;
            browser
                .wait_js::<String, _>(
                    "the dead letter reads as resolved",
                    &fact_script("dl-details", "status"),
                    |status| status == "resolved",
                )
                .await;

            browser
                .goto(&gate.url("/console/aggregate?id=order-1"))
                .await;
            browser
                .wait_js::<String, _>(
                    "the aggregate applied through sequence 2",
                    &fact_script("state", "last"),
                    |last| last == "2",
                )
                .await;
            let feed = browser
                .wait_table("the applied feed", "applied", |rows| rows.len() == 2)
                .await;
            assert_eq!((feed[0][0].as_str(), feed[1][0].as_str()), ("1", "2"));
            assert_eq!(feed[1][1], "m-2:replaced");
            assert_eq!(feed[1][3], r#"{"amount":5,"orderId":"order-1"}"#);

            // The page follows the feed: the producer's next message shows without a reload.
            browser
                .wait_text("#follow", |text| text == "following the applied feed")
                .await;
            assert_eq!(gate.deliver(&producer, epoch, 3, 30).await, 200);
            browser
                .wait_table("the next message in the feed", "applied", |rows| {
                    rows.len() == 3 && rows[2][0] == "3"
                })
                .await;

            browser.goto(&gate.url("/console/producers")).await;
            browser
                .wait_table("the registry lists the producer", "producers", |rows| {
                    rows.iter().any(|row| row[0] == "shop")
                })
                .await;
            browser.fill("#producer-name", "billing").await;
            browser.click("#producer-add").await;
            let shown = browser
                .wait_text("#producer-result .token", |token| !token.is_empty())
                .await;
            let accepted = gate
                .http
                .post(gate.url("/v1/producers/session"))
                .bearer_auth(&shown)
                .send()
                .await
                .unwrap();
            assert_eq!(accepted.status(), StatusCode::OK, "the token shown works");
        })
        .await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_sees_the_pages_without_a_resolution_form_and_a_refused_token_is_sent_back_to_sign_in()
 {
    let gate = ConsoleGate::start();
    gate.quarantine_the_second_message().await;
    let browser = Browser::start("gate-console-reader").await;
    browser
        .run(async {
            sign_in(&browser, &gate, READER_TOKEN).await;
            browser
                .goto(&gate.url("/console/deadletter?messageId=m-2&producer=shop"))
                .await;
            browser
                .wait_text("#dl-reason", |text| text.starts_with("payload does not match"))
                .await;
            let hidden: (bool, bool) = browser
                .js(
                    "return [document.getElementById('resolve').hidden, document.getElementById('resolve-reader').hidden];",
                    vec![],
                )
                .await;
            assert_eq!(
                hidden,
                (true, false),
                "no form, and the words that say why"
            );
            browser.goto(&gate.url("/console/producers")).await;
            browser
                .wait_js::<bool, _>(
                    "the registry says it is for operators",
                    "return !document.getElementById('reader-notice').hidden && document.getElementById('registry').hidden;",
                    |shown| *shown,
                )
                .await;

            // A token the gate no longer takes: the next data call sends the user to sign-in.
            browser
                .js::<Value>(
                    "sessionStorage.setItem('gate-console.token', 'a-token-nobody-has'); return null;",
                    vec![],
                )
                .await;
            browser
                .goto(&gate.url("/console/aggregate?id=order-1"))
                .await;
            browser
                .wait_js::<String, _>(
                    "back at sign-in with the problem's words",
                    "return location.pathname + ' ' + document.getElementById('sign-in-problem').textContent;",
                    |text| {
                        text.starts_with("/console ")
                            && text.contains("neither a configured reader's nor an active operator's")
                    },
                )
                .await;
        })
        .await;
    browser.close().await;

    let refused = gate
        .http
        .post(gate.url("/v1/deadletters/resolution?messageId=m-2&producer=shop"))
        .bearer_auth(READER_TOKEN)
        .json(&json!({"action": "skip", "expectedLast": 1, "reason": "a reader tries"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["title"], "Operator authentication required");
    let untouched: Value = gate
        .get(
            "/v1/deadletter?messageId=m-2&producer=shop",
            Some(READER_TOKEN),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(untouched["status"], "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_recheck_in_the_console_previews_first_then_applies_what_the_reloaded_schema_now_accepts()
 {
    let gate = ConsoleGate::start();
    gate.quarantine_the_second_message().await;
    // The schema is corrected to allow the refund's negative amount, and reloaded.
    std::fs::write(
        gate._dir.path().join("placed.json"),
        PLACED_SCHEMA.replace(", \"minimum\": 0", ""),
    )
    .unwrap();
    gate.gate.hang_up();
    crate::helpers::poll_until(
        "the corrected schema reloaded (generation 2)",
        || async {
            let ready: Value = gate
                .get("/ready", None)
                .await
                .json()
                .await
                .unwrap_or(Value::Null);
            ready["generation"].as_u64()
        },
        |generation| *generation == Some(2),
    )
    .await;

    let browser = Browser::start("gate-console-recheck").await;
    browser
        .run(async {
            sign_in(&browser, &gate, &gate.operator).await;
            browser.click("a[data-nav=\"recheck\"]").await;
            browser.wait_for("#recheck-form").await;
            let run_disabled: bool = browser
                .wait_js(
                    "the recheck form shown to an operator",
                    "return document.getElementById('recheck').hidden ? null : document.getElementById('run').disabled;",
                    |disabled: &Option<bool>| disabled.is_some(),
                )
                .await
                .unwrap_or(false);
            assert!(run_disabled, "running waits for a preview");
            browser.fill("#filter-type", "order.placed").await;
            browser
                .fill("#reason", "refunds are negative amounts: schema corrected")
                .await;

            browser.click("#preview").await;
            browser
                .wait_js::<String, _>(
                    "the dry run's preview",
                    "return document.getElementById('recheck-result').dataset.state;",
                    |state| state == "preview",
                )
                .await;
            let preview = browser.text("#recheck-result").await;
            assert!(
                preview.contains("nothing was written")
                    && preview.contains("1 applied")
                    && preview.contains("generation 2"),
                "{preview}"
            );
            let rows = browser.table("recheck-aggregates").await;
            assert_eq!(rows.len(), 1, "{rows:?}");
            assert_eq!(rows[0][0], AGGREGATE);
            assert!(rows[0][1].contains("m-2 (2)"), "{rows:?}");
            let still_open = gate
                .get("/v1/deadletter?messageId=m-2&producer=shop", Some(READER_TOKEN))
                .await
                .json::<Value>()
                .await
                .unwrap();
            assert_eq!(still_open["status"], "open", "a dry run changes nothing");

            browser.click("#run").await;
            browser
                .wait_js::<String, _>(
                    "the recheck's result",
                    "return document.getElementById('recheck-result').dataset.state;",
                    |state| state == "done",
                )
                .await;
            let done = browser.text("#recheck-result").await;
            assert!(done.contains("1 applied"), "{done}");
            let rows = browser.table("recheck-aggregates").await;
            assert!(rows[0][1].contains("m-2 (2)"), "{rows:?}");
            let run_disabled: bool = browser
                .js("return document.getElementById('run').disabled;", vec![])
                .await;
            assert!(run_disabled, "another run needs another preview");
        })
        .await;
    browser.close().await;

    let aggregate: Value = gate
        .get("/v1/aggregates/order-1", Some(READER_TOKEN))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&aggregate["last"], &aggregate["status"]),
        (&json!(2), &json!("flowing"))
    );
    let trail: Value = gate
        .get("/v1/resolutions", Some(READER_TOKEN))
        .await
        .json()
        .await
        .unwrap();
    let record = &trail["resolutions"][0];
    assert_eq!(
        (&record["action"], &record["operator"]),
        (&json!("accept"), &json!("alice"))
    );
    assert!(
        record["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("configuration generation 2")),
        "{record}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inventory_shows_the_output_lag_and_a_chart_of_the_gates_samples() {
    let gate = ConsoleGate::start();
    // Without NATS nothing publishes: the applied message waits in the output.
    gate.quarantine_the_second_message().await;
    poll_until_within(
        "the gate has a sample of the waiting row",
        Duration::from_secs(20),
        || async {
            let response = gate.get("/v1/lag", Some(READER_TOKEN)).await;
            response.json::<Value>().await.unwrap_or(Value::Null)
        },
        |lag| {
            lag["samples"]
                .as_array()
                .is_some_and(|samples| !samples.is_empty())
        },
    )
    .await;
    let browser = Browser::start("gate-console-lag").await;
    browser
        .run(async {
            sign_in(&browser, &gate, READER_TOKEN).await;
            browser
                .wait_text("#lag-unpublished", |text| text == "1")
                .await;
            let publisher: String = browser
                .js(&fact_script("lag-facts", "publisher"), vec![])
                .await;
            assert_eq!(publisher, "absent");
            let chart: (u64, u64, u64) = browser
                .wait_js(
                    "the chart draws the samples",
                    "const chart = document.querySelector('svg#lag-chart'); \
                     return [Number(chart.dataset.points), \
                       chart.querySelectorAll('circle[data-series=\"backlog\"]').length, \
                       chart.querySelectorAll('polyline').length];",
                    |(points, _, _)| *points >= 1,
                )
                .await;
            assert_eq!(chart.1, chart.0, "a backlog point per sample: {chart:?}");
            assert_eq!(chart.2, 3, "applied, published and backlog lines");
            let legend = browser.text("#lag-legend").await;
            assert!(legend.contains("applied/s"), "{legend}");
        })
        .await;
    browser.close().await;
}
