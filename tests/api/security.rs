//! The security lab over real HTTP: live configuration, CORS, antiforgery, HTML encoding,
//! forwarded headers, canonical URLs and host filtering.

use std::collections::BTreeSet;

use production_lab::{Application, Config};
use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::{
    ServerProcess, TestApp, assert_bad_request, client, poll_until, settings_dir, spawn_app,
    spawn_app_with, status_and_json,
};

const ORIGIN: &str = "https://client.example";
const SEED_SECRET: &str = "classroom-not-a-secret";

/// The `GET /configuration` answer once it satisfies `accept`.
async fn configuration_when(
    client: &reqwest::Client,
    url: &str,
    what: &str,
    accept: impl Fn(u16, &Value) -> bool,
) -> (u16, Value) {
    poll_until(
        what,
        || async {
            let response = client.get(url).send().await.expect("GET /configuration");
            status_and_json(response).await
        },
        |(status, body)| accept(*status, body),
    )
    .await
}

fn live_settings(label: &str, maximum: i64, secret: &str) -> String {
    json!({"Live": {"Label": label, "Maximum": maximum, "Secret": secret}}).to_string()
}

fn is_invalid_configuration(status: u16, body: &Value) -> bool {
    status == 503 && body["title"] == "Current configuration is invalid"
}

// ---------------------------------------------------------------- live configuration

#[tokio::test]
async fn configuration_reports_the_settings_but_never_the_secret() {
    let app = spawn_app().await;
    let response = app.get("/configuration").await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(!text.contains(SEED_SECRET), "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body,
        json!({"label": "initial", "maximum": 3, "hasSecret": true})
    );
}

#[tokio::test]
async fn an_edited_settings_file_is_served_within_seconds() {
    let app = spawn_app().await;
    std::fs::write(&app.settings, r#"{"Live":{"Label":"edited","Maximum":7}}"#).unwrap();
    let url = app.url("/configuration");
    let (_, body) = configuration_when(&app.client, &url, "the edit", |status, body| {
        status == 200 && body["label"] == "edited"
    })
    .await;
    assert_eq!(
        body,
        json!({"label": "edited", "maximum": 7, "hasSecret": false})
    );
}

#[tokio::test]
async fn a_settings_file_without_a_live_section_serves_the_seed_defaults() {
    let app = spawn_app_with(|config| {
        let path = config.settings.clone();
        std::fs::write(path, r#"{"Other":{"Label":"not this one"}}"#).unwrap();
    })
    .await;
    let (status, body) = status_and_json(app.get("/configuration").await).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"label": "initial", "maximum": 3, "hasSecret": false})
    );
    // A reload that loses the section, or a member, falls back the same way.
    std::fs::write(&app.settings, live_settings("edited", 8, "s")).unwrap();
    let url = app.url("/configuration");
    configuration_when(&app.client, &url, "the edit", |status, body| {
        status == 200 && body["label"] == "edited"
    })
    .await;
    std::fs::write(&app.settings, r#"{"Live":{"Maximum":9}}"#).unwrap();
    let (_, body) = configuration_when(&app.client, &url, "the partial section", |status, body| {
        status == 200 && body["maximum"] == 9
    })
    .await;
    assert_eq!(
        body,
        json!({"label": "initial", "maximum": 9, "hasSecret": false})
    );
}

#[tokio::test]
async fn writes_to_the_database_beside_the_settings_file_never_reach_the_watch() {
    let app = spawn_app().await;
    assert_eq!(app.database.parent(), app.settings.parent());
    let watch = || async { app.state.security.settings_watch() };
    poll_until("the first read", watch, |seen| seen.reads >= 1).await;
    // Every delivery writes the WAL beside the settings file.
    for sequence in 1..=50 {
        let body = json!({"messageId": format!("w-{sequence}"), "sequence": sequence, "amount": 1});
        let response = app.post_json("/aggregates/acct-w/messages", &body).await;
        assert_eq!(response.status(), 200);
    }
    // A file written whole: created, then closed after writing, two events. Once both are
    // counted, every earlier event has been too.
    std::fs::write(app.dir.path().join("unrelated.txt"), "x").unwrap();
    let seen = poll_until("the unrelated file's events", watch, |seen| {
        seen.unrelated_events >= 2
    })
    .await;
    assert_eq!(
        seen.unrelated_events, 2,
        "the watch was woken by the database's writes: {seen:?}"
    );
    assert_eq!(seen.reloads, 1, "{seen:?}");
}

#[tokio::test]
async fn an_idle_server_does_not_reload_its_settings_after_its_own_read() {
    let app = spawn_app().await;
    let watch = || async { app.state.security.settings_watch() };
    // The watch reads the file once when it starts; that read opens the file.
    let started = poll_until("the first read", watch, |seen| seen.reads >= 1).await;
    assert_eq!(started.reloads, 1, "{started:?}");
    // Any event the watch saw before this unrelated file's is handled once this one is.
    std::fs::write(app.dir.path().join("unrelated.txt"), "x").unwrap();
    let later = poll_until("the unrelated event", watch, |seen| {
        seen.unrelated_events >= 1
    })
    .await;
    assert_eq!(
        later.reloads, 1,
        "the watch reloaded after its own read: {later:?}"
    );
    assert_eq!(later.reads, 1, "{later:?}");
    // A real edit is still one reload.
    std::fs::write(&app.settings, live_settings("edited", 4, "s")).unwrap();
    let url = app.url("/configuration");
    configuration_when(&app.client, &url, "the edit", |status, body| {
        status == 200 && body["label"] == "edited"
    })
    .await;
    assert!(app.state.security.settings_watch().reloads >= 2);
}

#[tokio::test]
async fn a_settings_file_replaced_by_rename_is_reloaded() {
    let app = spawn_app().await;
    // What editors do: write a new file beside the old one, then rename it over.
    let staged = app.dir.path().join("runtime-settings.json.tmp");
    std::fs::write(&staged, live_settings("renamed", 9, "s")).unwrap();
    std::fs::rename(&staged, &app.settings).unwrap();
    let url = app.url("/configuration");
    let (_, body) = configuration_when(&app.client, &url, "the renamed file", |status, body| {
        status == 200 && body["label"] == "renamed"
    })
    .await;
    assert_eq!(body["maximum"], 9);
    // A second replacement is seen too: the watch survives the first rename.
    std::fs::write(&staged, live_settings("renamed again", 2, "s")).unwrap();
    std::fs::rename(&staged, &app.settings).unwrap();
    configuration_when(&app.client, &url, "the second rename", |status, body| {
        status == 200 && body["label"] == "renamed again" && body["maximum"] == 2
    })
    .await;
}

#[tokio::test]
async fn an_invalid_settings_file_answers_503_until_it_is_fixed() {
    let app = spawn_app().await;
    let url = app.url("/configuration");
    let secret = "do-not-show-4417";
    let invalid = [
        ("blank label", live_settings("   ", 3, secret)),
        ("maximum below 1", live_settings("x", 0, secret)),
        ("maximum above 10", live_settings("x", 11, secret)),
        (
            "broken JSON",
            format!(r#"{{"Live":{{"Label":"x","Maximum":3,"Secret":"{secret}""#),
        ),
        ("Live not an object", r#"{"Live":"initial"}"#.to_owned()),
    ];
    for (round, (case, text)) in invalid.iter().enumerate() {
        std::fs::write(&app.settings, text).unwrap();
        let (_, problem) = configuration_when(&app.client, &url, case, |status, body| {
            is_invalid_configuration(status, body)
        })
        .await;
        assert_eq!(problem["status"], 503, "{case}");
        assert!(!problem.to_string().contains(secret), "{case}: {problem}");
        // Stays refused: a second look still sees the problem, not the last good value.
        let (status, _) = status_and_json(app.get("/configuration").await).await;
        assert_eq!(status, 503, "{case}");

        let label = format!("fixed {round}");
        std::fs::write(&app.settings, live_settings(&label, 5, secret)).unwrap();
        let (_, body) = configuration_when(&app.client, &url, "the fix", |status, body| {
            status == 200 && body["label"] == label.as_str()
        })
        .await;
        assert_eq!(
            body,
            json!({"label": label, "maximum": 5, "hasSecret": true}),
            "{case}"
        );
    }
}

#[tokio::test]
async fn configuration_errors_are_logged_once_each_and_never_with_the_secret() {
    let (dir, settings) = settings_dir();
    let mut server = ServerProcess::start_with_env(
        &dir.path().join("lab.db"),
        &settings,
        &["--log-format", "json"],
        &[("LAB_LOG", "warn,production_lab::configuration=debug")],
    );
    let stderr = crate::connections::StderrLines::collect(&mut server);
    let http = client();
    let url = server.url("/configuration");
    let secret = "process-secret-7731";

    std::fs::write(&settings, live_settings("", 3, secret)).unwrap();
    configuration_when(&http, &url, "the blank label", |status, body| {
        is_invalid_configuration(status, body)
            && body["detail"].as_str().unwrap_or("").contains("Label")
    })
    .await;
    // The same error again, rewritten twice (each write a byte longer, so the server's read of
    // each one is seen), must not be logged again.
    for blank in [" ", "  "] {
        let rewritten = live_settings(blank, 3, secret);
        std::fs::write(&settings, &rewritten).unwrap();
        stderr
            .wait_for(1, "settings file read", |fields| {
                fields["bytes"] == rewritten.len()
            })
            .await;
    }
    std::fs::write(&settings, live_settings("x", 11, secret)).unwrap();
    configuration_when(&http, &url, "the second error", |status, body| {
        is_invalid_configuration(status, body)
            && body["detail"].as_str().unwrap_or("").contains("Maximum")
    })
    .await;
    std::fs::write(&settings, live_settings("recovered", 4, secret)).unwrap();
    configuration_when(&http, &url, "the recovery", |status, body| {
        status == 200 && body["label"] == "recovered"
    })
    .await;

    let (stdout, _) = server.stop_and_collect_output().await;
    let stderr = stderr.all();
    let logged: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("Current configuration is invalid"))
        .collect();
    assert_eq!(logged.len(), 2, "one line per distinct error: {stderr}");
    assert!(logged[0].contains("Label"), "{stderr}");
    assert!(logged[1].contains("Maximum"), "{stderr}");
    assert!(!stderr.contains(secret), "{stderr}");
    assert!(!stdout.contains(secret), "{stdout}");
}

// ---------------------------------------------------------------- CORS

async fn preflight(
    app: &TestApp,
    origin: &str,
    method: &str,
    headers: &[&str],
) -> reqwest::Response {
    let mut request = app
        .client
        .request(Method::OPTIONS, app.url("/cors/data"))
        .header("Origin", origin)
        .header("Access-Control-Request-Method", method);
    if !headers.is_empty() {
        request = request.header("Access-Control-Request-Headers", headers.join(","));
    }
    request.send().await.expect("preflight reaches the server")
}

fn header_text(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .map(|value| value.to_str().expect("ASCII header").to_owned())
}

fn listed(response: &reqwest::Response, name: &str) -> Vec<String> {
    header_text(response, name)
        .unwrap_or_default()
        .split(',')
        .map(|item| item.trim().to_ascii_lowercase())
        .filter(|item| !item.is_empty())
        .collect()
}

/// The browser's CORS-preflight check (Fetch standard): the origin must be echoed, the method
/// must be CORS-safelisted or listed, and every requested header must be listed. The layer
/// answers every preflight 200, so the status alone says nothing.
fn browser_grants(
    response: &reqwest::Response,
    origin: &str,
    method: &str,
    headers: &[&str],
) -> bool {
    let origin_ok = header_text(response, "access-control-allow-origin").as_deref() == Some(origin);
    let methods = listed(response, "access-control-allow-methods");
    let method_ok = matches!(method, "GET" | "HEAD" | "POST")
        || methods
            .iter()
            .any(|m| m == &method.to_ascii_lowercase() || m == "*");
    let allowed_headers = listed(response, "access-control-allow-headers");
    let headers_ok = headers.iter().all(|asked| {
        allowed_headers
            .iter()
            .any(|h| h == &asked.to_ascii_lowercase() || h == "*")
    });
    response.status().is_success() && origin_ok && method_ok && headers_ok
}

#[tokio::test]
async fn the_classroom_origin_may_read_cors_data() {
    let app = spawn_app().await;
    let response = app
        .client
        .get(app.url("/cors/data"))
        .header("Origin", ORIGIN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        header_text(&response, "access-control-allow-origin").as_deref(),
        Some(ORIGIN)
    );
    assert_eq!(
        header_text(&response, "access-control-allow-credentials"),
        None
    );
    assert!(listed(&response, "vary").contains(&"origin".to_owned()));
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body,
        json!({"value": "public classroom data", "authenticated": false})
    );
}

#[tokio::test]
async fn a_foreign_origin_gets_the_data_but_no_permission_to_read_it() {
    let app = spawn_app().await;
    let response = app
        .client
        .get(app.url("/cors/data"))
        .header("Origin", "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header_text(&response, "access-control-allow-origin"), None);
}

#[tokio::test]
async fn a_preflight_for_post_with_content_type_is_granted_to_the_classroom_origin() {
    let app = spawn_app().await;
    let response = preflight(&app, ORIGIN, "POST", &["content-type"]).await;
    assert!(browser_grants(&response, ORIGIN, "POST", &["content-type"]));
    assert_eq!(
        header_text(&response, "access-control-allow-credentials"),
        None
    );
    assert!(listed(&response, "access-control-allow-methods").contains(&"get".to_owned()));
}

#[tokio::test]
async fn preflights_outside_the_policy_are_not_granted() {
    let app = spawn_app().await;

    let foreign = preflight(&app, "https://evil.example", "GET", &[]).await;
    assert_eq!(header_text(&foreign, "access-control-allow-origin"), None);
    assert!(!browser_grants(
        &foreign,
        "https://evil.example",
        "GET",
        &[]
    ));

    let delete = preflight(&app, ORIGIN, "DELETE", &[]).await;
    assert!(!listed(&delete, "access-control-allow-methods").contains(&"delete".to_owned()));
    assert!(!browser_grants(&delete, ORIGIN, "DELETE", &[]));

    let csrf_header = preflight(&app, ORIGIN, "POST", &["x-csrf-token"]).await;
    assert!(
        !listed(&csrf_header, "access-control-allow-headers").contains(&"x-csrf-token".to_owned())
    );
    assert!(!browser_grants(
        &csrf_header,
        ORIGIN,
        "POST",
        &["x-csrf-token"]
    ));
}

// ---------------------------------------------------------------- antiforgery

struct Session {
    /// `ProductionLab.Csrf=...`, ready for a Cookie header.
    cookie: String,
    token: String,
}

async fn new_session(app: &TestApp) -> Session {
    let response = app.get("/antiforgery/token").await;
    assert_eq!(response.status(), 200);
    let set_cookie = header_text(&response, "set-cookie").expect("a new antiforgery cookie");
    let cookie = set_cookie.split(';').next().unwrap().trim().to_owned();
    assert!(cookie.starts_with("ProductionLab.Csrf="), "{set_cookie}");
    let body: Value = response.json().await.unwrap();
    let token = body["requestToken"]
        .as_str()
        .expect("requestToken")
        .to_owned();
    Session { cookie, token }
}

async fn submit(app: &TestApp, cookie: Option<&str>, token: Option<&str>) -> (u16, Value) {
    let mut request = app.client.post(app.url("/antiforgery/submit"));
    if let Some(cookie) = cookie {
        request = request.header("Cookie", cookie);
    }
    if let Some(token) = token {
        request = request.header("X-CSRF-TOKEN", token);
    }
    status_and_json(request.send().await.unwrap()).await
}

async fn submission_count(app: &TestApp) -> Value {
    let (status, body) = status_and_json(app.get("/antiforgery/count").await).await;
    assert_eq!(status, 200);
    body["count"].clone()
}

fn refused() -> (u16, Value) {
    (400, json!({"error": "Antiforgery validation failed"}))
}

#[tokio::test]
async fn the_token_response_sets_a_strict_http_only_cookie_and_is_not_cached() {
    let app = spawn_app().await;
    let response = app.get("/antiforgery/token").await;
    assert_eq!(response.status(), 200);
    assert!(
        header_text(&response, "cache-control")
            .unwrap_or_default()
            .contains("no-store")
    );
    let set_cookie = header_text(&response, "set-cookie").unwrap();
    let attributes: Vec<String> = set_cookie
        .split(';')
        .skip(1)
        .map(|a| a.trim().to_ascii_lowercase())
        .collect();
    assert!(attributes.contains(&"httponly".to_owned()), "{set_cookie}");
    assert!(
        attributes.contains(&"samesite=strict".to_owned()),
        "{set_cookie}"
    );
    assert!(attributes.contains(&"path=/".to_owned()), "{set_cookie}");
    assert!(!attributes.contains(&"secure".to_owned()), "{set_cookie}");
    let body: Value = response.json().await.unwrap();
    let token = body["requestToken"].as_str().unwrap();
    assert!(!token.is_empty());
    assert!(
        !set_cookie.contains(token),
        "the request token is not the cookie"
    );
}

#[tokio::test]
async fn a_paired_token_is_accepted_and_counted() {
    let app = spawn_app().await;
    let session = new_session(&app).await;
    let paired = (Some(session.cookie.as_str()), Some(session.token.as_str()));
    assert_eq!(
        submit(&app, paired.0, paired.1).await,
        (200, json!({"accepted": 1}))
    );
    assert_eq!(
        submit(&app, paired.0, paired.1).await,
        (200, json!({"accepted": 2}))
    );
    assert_eq!(submission_count(&app).await, 2);
}

#[tokio::test]
async fn every_unpaired_submission_is_refused() {
    let app = spawn_app().await;
    let mine = new_session(&app).await;
    let theirs = new_session(&app).await;
    let forged = "A".repeat(43);
    // The request token is well-formed as a cookie token too; echoing it in both places is not
    // a pair, because a pair needs the server's key.
    let token_as_cookie = format!("ProductionLab.Csrf={}", mine.token);
    let cases: [(&str, Option<&str>, Option<&str>); 8] = [
        ("no token", Some(&mine.cookie), None),
        ("no cookie", None, Some(&mine.token)),
        ("neither", None, None),
        ("forged token", Some(&mine.cookie), Some(&forged)),
        ("not base64", Some(&mine.cookie), Some("%%%not-a-token%%%")),
        (
            "another session's token",
            Some(&mine.cookie),
            Some(&theirs.token),
        ),
        (
            "malformed cookie",
            Some("ProductionLab.Csrf=x"),
            Some(&mine.token),
        ),
        (
            "the request token as both cookie and header",
            Some(&token_as_cookie),
            Some(&mine.token),
        ),
    ];
    for (case, cookie, token) in cases {
        assert_eq!(submit(&app, cookie, token).await, refused(), "{case}");
    }
    assert_eq!(submission_count(&app).await, 0);
    // Both real sessions still work with their own pairs.
    assert_eq!(
        submit(&app, Some(&mine.cookie), Some(&mine.token)).await.0,
        200
    );
    assert_eq!(
        submit(&app, Some(&theirs.cookie), Some(&theirs.token))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn a_request_carrying_the_cookie_gets_a_token_for_that_cookie() {
    let app = spawn_app().await;
    let session = new_session(&app).await;
    let response = app
        .client
        .get(app.url("/antiforgery/token"))
        .header("Cookie", &session.cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        header_text(&response, "set-cookie"),
        None,
        "the cookie is reused"
    );
    let body: Value = response.json().await.unwrap();
    let token = body["requestToken"].as_str().unwrap();
    assert_eq!(
        submit(&app, Some(&session.cookie), Some(token)).await.0,
        200
    );
}

#[tokio::test]
async fn tokens_issued_before_a_restart_fail_after_it() {
    let app = spawn_app().await;
    let session = new_session(&app).await;
    assert_eq!(
        submit(&app, Some(&session.cookie), Some(&session.token)).await,
        (200, json!({"accepted": 1}))
    );
    let app = app.restart().await;
    assert_eq!(
        submit(&app, Some(&session.cookie), Some(&session.token)).await,
        refused()
    );
    assert_eq!(submission_count(&app).await, 0);
    let fresh = new_session(&app).await;
    assert_eq!(
        submit(&app, Some(&fresh.cookie), Some(&fresh.token))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn concurrent_submissions_each_get_their_own_number() {
    let app = spawn_app().await;
    let session = new_session(&app).await;
    let submissions = (0..20).map(|_| submit(&app, Some(&session.cookie), Some(&session.token)));
    let results = futures_util::future::join_all(submissions).await;
    let numbers: BTreeSet<i64> = results
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, 200, "{body}");
            body["accepted"].as_i64().unwrap()
        })
        .collect();
    assert_eq!(numbers, (1..=20).collect::<BTreeSet<i64>>());
    assert_eq!(submission_count(&app).await, 20);
}

// ---------------------------------------------------------------- encoding

#[tokio::test]
async fn hostile_names_round_trip_through_an_html_parser() {
    let app = spawn_app().await;
    let hostile = [
        r#"<script>alert("owned")</script>"#,
        r#"" onmouseover="alert(1)"#,
        "' single & double \" quotes",
        "Tom & Jerry &amp; &lt;escaped&gt;",
        "</p><img src=x onerror=alert(1)><p>",
        "Zoë — naïve 日本語 ✓ 🎉",
        "",
    ];
    let paragraph = scraper::Selector::parse("p").unwrap();
    let active = scraper::Selector::parse("script, img, [onmouseover], [onerror]").unwrap();
    for name in hostile {
        let response = app
            .client
            .get(reqwest::Url::parse_with_params(&app.url("/encoded"), [("name", name)]).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(
            header_text(&response, "content-type").as_deref(),
            Some("text/html; charset=utf-8")
        );
        let page = response.text().await.unwrap();
        let document = scraper::Html::parse_document(&page);
        let paragraphs: Vec<_> = document.select(&paragraph).collect();
        assert_eq!(paragraphs.len(), 1, "{name}: {page}");
        assert_eq!(paragraphs[0].text().collect::<String>(), name, "{page}");
        assert_eq!(document.select(&active).count(), 0, "{name}: {page}");
        if name.contains(['<', '>', '&', '"', '\'']) {
            assert!(!page.contains(name), "{name} appears unencoded: {page}");
        }
    }
}

#[tokio::test]
async fn the_encoded_page_forbids_scripts_and_sniffing() {
    let app = spawn_app().await;
    let response = app.get("/encoded?name=%3Cscript%3E").await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        header_text(&response, "x-content-type-options").as_deref(),
        Some("nosniff")
    );
    let policy = header_text(&response, "content-security-policy").unwrap_or_default();
    let directives: Vec<&str> = policy.split(';').map(str::trim).collect();
    assert!(directives.contains(&"default-src 'none'"), "{policy}");
    assert!(directives.contains(&"frame-ancestors 'none'"), "{policy}");
}

#[tokio::test]
async fn a_missing_name_is_an_empty_paragraph() {
    let app = spawn_app().await;
    let page = app.get("/encoded").await.text().await.unwrap();
    assert!(page.contains("<p></p>"), "{page}");
}

// ---------------------------------------------------------------- forwarded headers

async fn proxy_view(app: &TestApp, headers: &[(&str, &str)]) -> Value {
    let mut request = app.client.get(app.url("/proxy"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (status, body) = status_and_json(request.send().await.unwrap()).await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test]
async fn forwarded_headers_from_loopback_are_ignored_by_default() {
    let app = spawn_app().await;
    let body = proxy_view(
        &app,
        &[
            ("X-Forwarded-For", "198.51.100.7"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "evil.example"),
        ],
    )
    .await;
    assert_eq!(
        body,
        json!({"scheme": "http", "remote": "127.0.0.1", "host": format!("127.0.0.1:{}", app.port)})
    );
}

#[tokio::test]
async fn the_known_proxy_is_believed_for_its_rightmost_entry_only() {
    let app = spawn_app_with(|config| config.known_proxy = "127.0.0.1".parse().unwrap()).await;
    let body = proxy_view(
        &app,
        &[
            ("X-Forwarded-For", "203.0.113.99, 198.51.100.7"),
            ("X-Forwarded-Proto", "http, https"),
            ("X-Forwarded-Host", "evil.example"),
        ],
    )
    .await;
    assert_eq!(
        body,
        json!({"scheme": "https", "remote": "198.51.100.7", "host": format!("127.0.0.1:{}", app.port)})
    );
    let plain = proxy_view(&app, &[]).await;
    assert_eq!(plain["remote"], "127.0.0.1");
    assert_eq!(plain["scheme"], "http");
    let unusable = proxy_view(&app, &[("X-Forwarded-For", "not-an-address")]).await;
    assert_eq!(unusable["remote"], "127.0.0.1");
}

#[tokio::test]
async fn the_known_proxy_is_believed_only_when_both_headers_are_usable() {
    let app = spawn_app_with(|config| config.known_proxy = "127.0.0.1".parse().unwrap()).await;
    for (forwarded_for, proto) in [
        ("198.51.100.7", "gopher"),
        ("198.51.100.7", "javascript"),
        ("not-an-address", "https"),
    ] {
        let body = proxy_view(
            &app,
            &[
                ("X-Forwarded-For", forwarded_for),
                ("X-Forwarded-Proto", proto),
            ],
        )
        .await;
        assert_eq!(
            (body["remote"].clone(), body["scheme"].clone()),
            (json!("127.0.0.1"), json!("http")),
            "{forwarded_for} / {proto}"
        );
    }
    let both = proxy_view(
        &app,
        &[
            ("X-Forwarded-For", "198.51.100.7"),
            ("X-Forwarded-Proto", "HTTPS"),
        ],
    )
    .await;
    assert_eq!(
        (both["remote"].clone(), both["scheme"].clone()),
        (json!("198.51.100.7"), json!("https"))
    );
}

#[tokio::test]
async fn the_real_binary_accepts_known_proxy_on_the_command_line() {
    let (dir, settings) = settings_dir();
    let server = ServerProcess::start(
        &dir.path().join("lab.db"),
        &settings,
        &["--known-proxy", "127.0.0.1"],
    );
    let response = client()
        .get(server.url("/proxy"))
        .header("X-Forwarded-For", "192.0.2.1, 198.51.100.23")
        .header("X-Forwarded-Proto", "https")
        .send()
        .await
        .unwrap();
    let (status, body) = status_and_json(response).await;
    assert_eq!(status, 200);
    assert_eq!(body["remote"], "198.51.100.23");
    assert_eq!(body["scheme"], "https");
}

// ---------------------------------------------------------------- canonical URLs and hosts

#[tokio::test]
async fn the_canonical_url_ignores_a_hostile_host() {
    let app = spawn_app().await;
    let response = app
        .client
        .get(app.url("/canonical"))
        .header("Host", "evil.example")
        .header("X-Forwarded-Host", "evil2.example")
        .send()
        .await
        .unwrap();
    let (status, body) = status_and_json(response).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"observedHost": "evil.example", "url": "https://public.example.test/items/7"})
    );
}

async fn with_host(app: &TestApp, method: Method, path: &str, host: &str) -> reqwest::Response {
    app.client
        .request(method, app.url(path))
        .header("Host", host)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn only_allowed_hosts_are_served() {
    let app = spawn_app_with(|config| config.allowed_hosts = "localhost;Example.TEST".into()).await;
    let port = app.port;
    for host in [
        format!("localhost:{port}"),
        "EXAMPLE.test:9999".to_owned(),
        "example.test".to_owned(),
    ] {
        let response = with_host(&app, Method::GET, "/live", &host).await;
        assert_eq!(response.status(), 200, "{host}");
    }
    for host in [
        format!("127.0.0.1:{port}"),
        "evil.example".to_owned(),
        "localhost.evil".to_owned(),
    ] {
        assert_bad_request(with_host(&app, Method::GET, "/live", &host).await).await;
    }
    // Host filtering runs first: before routing (no 404) and before CORS answers a preflight.
    assert_bad_request(with_host(&app, Method::GET, "/no/such/route", "evil.example").await).await;
    let preflight = app
        .client
        .request(Method::OPTIONS, app.url("/cors/data"))
        .header("Host", "evil.example")
        .header("Origin", ORIGIN)
        .header("Access-Control-Request-Method", "POST")
        .send()
        .await
        .unwrap();
    assert_bad_request(preflight).await;
    // X-Forwarded-Host never stands in for the Host.
    let forwarded = app
        .client
        .get(app.url("/live"))
        .header("Host", "evil.example")
        .header("X-Forwarded-Host", "localhost")
        .send()
        .await
        .unwrap();
    assert_bad_request(forwarded).await;
}

#[tokio::test]
async fn a_host_with_a_malformed_port_is_refused_whatever_hosts_are_allowed() {
    for allowed in ["*", "localhost"] {
        let app = spawn_app_with(|config| config.allowed_hosts = allowed.into()).await;
        for host in [
            "localhost:abc",
            "localhost:65536",
            "localhost:80:81",
            "[::1]:x",
        ] {
            let problem =
                assert_bad_request(with_host(&app, Method::GET, "/live", host).await).await;
            assert!(
                problem["detail"].as_str().unwrap().contains("port"),
                "{allowed} {host}: {problem}"
            );
        }
        let response = with_host(
            &app,
            Method::GET,
            "/live",
            &format!("localhost:{}", app.port),
        )
        .await;
        assert_eq!(response.status(), 200, "{allowed}");
    }
}

#[tokio::test]
async fn an_empty_allowed_hosts_list_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("runtime-settings.json");
    std::fs::write(&settings, crate::helpers::SEED_SETTINGS).unwrap();
    let mut config = Config::for_tests(dir.path().join("lab.db"), settings);
    config.allowed_hosts = " ; ".to_owned();
    let error = match Application::build(config).await {
        Ok(_) => panic!("an empty host list must be refused"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("--allowed-hosts"), "{error}");
}
