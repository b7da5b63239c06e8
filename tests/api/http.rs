//! HTTP semantics over real HTTP: entity tags and conditional writes, the race probe, versioned
//! representations and the NDJSON stream.

use futures_util::StreamExt;
use production_lab::labs::http::HttpLab;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::helpers::{
    TestApp, assert_bad_request, client, content_type, poll_until, spawn_app, status_and_json,
};

/// The document row as stored: (body, version).
fn document_row(app: &TestApp) -> (String, i64) {
    app.db()
        .query_row(
            "SELECT body, version FROM documents WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("the document row")
}

fn etag_of(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn get_with_if_none_match(app: &TestApp, tag: &str) -> reqwest::Response {
    app.client
        .get(app.url("/documents/1"))
        .header("if-none-match", tag)
        .send()
        .await
        .expect("GET reaches the server")
}

/// A PUT of `{"body": body}` with an optional If-Match, from the given client.
async fn put_document(
    client: &reqwest::Client,
    app_url: &str,
    body: &str,
    if_match: Option<&str>,
    pause: bool,
) -> reqwest::Response {
    let mut request = client
        .put(format!("{app_url}/documents/1"))
        .json(&json!({"body": body}));
    if let Some(tag) = if_match {
        request = request.header("if-match", tag);
    }
    if pause {
        request = request.header("x-lab-pause", "true");
    }
    request.send().await.expect("PUT reaches the server")
}

/// Polls the probe's evidence until a writer has entered it.
async fn wait_until_entered(app: &TestApp) {
    poll_until(
        "the paused writer reaches the probe",
        || async {
            status_and_json(app.get("/lab/condition/evidence").await)
                .await
                .1
        },
        |evidence| *evidence == json!({"entered": true}),
    )
    .await;
}

#[tokio::test]
async fn the_document_is_served_with_its_version_as_entity_tag() {
    let app = spawn_app().await;

    let response = app.get("/documents/1").await;
    assert_eq!(response.status(), 200);
    assert_eq!(etag_of(&response).as_deref(), Some("\"v1\""));
    assert_eq!(
        response.text().await.unwrap(),
        r#"{"id":1,"body":"rune","version":1}"#
    );
}

#[tokio::test]
async fn a_matching_if_none_match_answers_304_with_the_etag_and_no_body() {
    let app = spawn_app().await;

    for tag in ["\"v1\"", "W/\"v1\"", "*", "\"v7\", W/\"v1\""] {
        let response = get_with_if_none_match(&app, tag).await;
        assert_eq!(response.status(), 304, "If-None-Match: {tag}");
        assert_eq!(etag_of(&response).as_deref(), Some("\"v1\""), "{tag}");
        assert_eq!(response.text().await.unwrap(), "", "{tag}");
    }

    let changed = get_with_if_none_match(&app, "\"v0\"").await;
    assert_eq!(changed.status(), 200);
    assert_eq!(
        status_and_json(changed).await.1,
        json!({"id": 1, "body": "rune", "version": 1})
    );
}

#[tokio::test]
async fn a_malformed_if_none_match_is_a_bad_request_with_the_seed_body() {
    let app = spawn_app().await;

    for tag in ["v1", "\"v1", "*, \"v1\"", "w/\"v1\""] {
        let response = get_with_if_none_match(&app, tag).await;
        assert_eq!(
            status_and_json(response).await,
            (400, json!({"error": "Malformed conditional header"})),
            "If-None-Match: {tag}"
        );
    }
}

#[tokio::test]
async fn a_write_without_if_match_is_refused_with_428() {
    let app = spawn_app().await;

    let response = put_document(&app.client, &app.address, "new", None, false).await;
    assert_eq!(response.status(), 428);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["title"], "If-Match is required");
    assert_eq!(problem["status"], 428);
    assert_eq!(document_row(&app), ("rune".to_owned(), 1));
}

#[tokio::test]
async fn a_malformed_if_match_is_a_bad_request() {
    let app = spawn_app().await;

    for tag in ["v1", "\"v1\" \"v2\"", "*, \"v1\""] {
        let response = put_document(&app.client, &app.address, "new", Some(tag), false).await;
        let problem = assert_bad_request(response).await;
        assert!(
            problem["detail"].as_str().unwrap().contains("If-Match"),
            "{problem}"
        );
    }
    assert_eq!(document_row(&app), ("rune".to_owned(), 1));
}

#[tokio::test]
async fn a_weak_or_stale_if_match_fails_the_precondition() {
    let app = spawn_app().await;

    for tag in ["W/\"v1\"", "\"v2\"", "\"v0\", W/\"v1\""] {
        let response = put_document(&app.client, &app.address, "new", Some(tag), false).await;
        assert_eq!(response.status(), 412, "If-Match: {tag}");
    }
    assert_eq!(document_row(&app), ("rune".to_owned(), 1));
}

#[tokio::test]
async fn a_matching_write_moves_to_the_next_version_and_tag() {
    let app = spawn_app().await;

    let response = put_document(&app.client, &app.address, "first", Some("\"v1\""), false).await;
    assert_eq!(response.status(), 200);
    assert_eq!(etag_of(&response).as_deref(), Some("\"v2\""));
    assert_eq!(
        response.text().await.unwrap(),
        r#"{"id":1,"body":"first","version":2}"#
    );
    assert_eq!(document_row(&app), ("first".to_owned(), 2));

    // The old tag no longer matches; a list containing the current one does; so does `*`.
    let stale = put_document(&app.client, &app.address, "lost", Some("\"v1\""), false).await;
    assert_eq!(stale.status(), 412);
    let listed = put_document(
        &app.client,
        &app.address,
        "second",
        Some("\"v1\", \"v2\""),
        false,
    )
    .await;
    assert_eq!(
        status_and_json(listed).await,
        (200, json!({"id": 1, "body": "second", "version": 3}))
    );
    let any = put_document(&app.client, &app.address, "third", Some("*"), false).await;
    assert_eq!(etag_of(&any).as_deref(), Some("\"v4\""));
    assert_eq!(any.status(), 200);
    assert_eq!(document_row(&app), ("third".to_owned(), 4));

    let current = app.get("/documents/1").await;
    assert_eq!(etag_of(&current).as_deref(), Some("\"v4\""));
}

#[tokio::test]
async fn invalid_document_bodies_are_bad_requests() {
    let app = spawn_app().await;

    for body in [
        json!({"body": ""}),
        json!({"body": "   "}),
        json!({}),
        json!({"body": 5}),
    ] {
        let response = app
            .client
            .put(app.url("/documents/1"))
            .header("if-match", "\"v1\"")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_bad_request(response).await;
    }
    let too_long = put_document(
        &app.client,
        &app.address,
        &"x".repeat(51),
        Some("\"v1\""),
        false,
    )
    .await;
    assert_bad_request(too_long).await;
    let not_json = app
        .client
        .put(app.url("/documents/1"))
        .header("if-match", "\"v1\"")
        .header("content-type", "text/plain")
        .body("rune")
        .send()
        .await
        .unwrap();
    assert_bad_request(not_json).await;
    assert_eq!(document_row(&app), ("rune".to_owned(), 1));

    let longest = "x".repeat(50);
    let fits = put_document(&app.client, &app.address, &longest, Some("\"v1\""), false).await;
    assert_eq!(fits.status(), 200);
    assert_eq!(document_row(&app), (longest, 2));
}

#[tokio::test]
async fn concurrent_writers_with_the_same_tag_produce_exactly_one_new_version() {
    let app = spawn_app().await;

    let writers = (0..8).map(|n| {
        let client = client();
        let address = app.address.clone();
        tokio::spawn(async move {
            let body = format!("writer-{n}");
            let response = put_document(&client, &address, &body, Some("\"v1\""), false).await;
            (response.status().as_u16(), body)
        })
    });
    let outcomes: Vec<(u16, String)> = futures_util::future::join_all(writers)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

    let winners: Vec<&String> = outcomes
        .iter()
        .filter(|(status, _)| *status == 200)
        .map(|(_, body)| body)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    assert!(
        outcomes.iter().all(|(s, _)| *s == 200 || *s == 412),
        "{outcomes:?}"
    );
    assert_eq!(document_row(&app), (winners[0].clone(), 2));
}

#[tokio::test]
async fn a_parked_writer_loses_to_the_writer_that_committed_meanwhile() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/condition/arm").await.status(), 204);
    assert_eq!(
        status_and_json(app.get("/lab/condition/evidence").await).await,
        (200, json!({"entered": false}))
    );

    // The first client read version 1 and sends its write, which parks before the transaction.
    let parked = {
        let client = client();
        let address = app.address.clone();
        tokio::spawn(async move {
            let response = put_document(&client, &address, "parked", Some("\"v1\""), true).await;
            status_and_json(response).await
        })
    };
    wait_until_entered(&app).await;

    // A second client, holding the same tag, writes while the first is parked.
    let second = client();
    let response = put_document(&second, &app.address, "second", Some("\"v1\""), false).await;
    assert_eq!(
        status_and_json(response).await,
        (200, json!({"id": 1, "body": "second", "version": 2}))
    );
    assert!(!parked.is_finished(), "the first writer is still parked");

    assert_eq!(app.post("/lab/condition/release").await.status(), 204);
    let (status, problem) = parked.await.unwrap();
    assert_eq!(status, 412, "{problem}");
    assert_eq!(problem["status"], 412);

    // Not a lost update: the second writer's body stands.
    assert_eq!(document_row(&app), ("second".to_owned(), 2));
    assert_eq!(
        status_and_json(app.get("/documents/1").await).await.1,
        json!({"id": 1, "body": "second", "version": 2})
    );
}

#[tokio::test]
async fn without_arming_the_pause_header_does_nothing() {
    let app = spawn_app().await;

    let response = put_document(&app.client, &app.address, "straight", Some("\"v1\""), true).await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        status_and_json(app.get("/lab/condition/evidence").await)
            .await
            .1,
        json!({"entered": false})
    );
    assert_eq!(document_row(&app), ("straight".to_owned(), 2));
}

/// A PUT of `{"body": body}` with `If-Match: *` and one `X-Lab-Pause` header per value.
async fn put_with_pause_headers(app: &TestApp, body: &str, values: &[&str]) -> reqwest::Response {
    let mut request = app
        .client
        .put(app.url("/documents/1"))
        .header("if-match", "*")
        .json(&json!({"body": body}));
    for value in values {
        request = request.header("x-lab-pause", *value);
    }
    request.send().await.expect("PUT reaches the server")
}

#[tokio::test]
async fn only_one_exact_true_parks_a_writer_and_any_other_pause_value_writes_at_once() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/condition/arm").await.status(), 204);
    // The seed compares the header with "true" ordinally: no other value is an error, none
    // parks, and the write goes ahead at once.
    let others: [&[&str]; 7] = [
        &["TRUE"],
        &["True"],
        &["tRuE"],
        &["yes"],
        &["maybe"],
        &[""],
        &["true", "true"],
    ];
    for (written, values) in others.iter().enumerate() {
        let body = format!("write-{written}");
        let response = put_with_pause_headers(&app, &body, values).await;
        let (status, view) = status_and_json(response).await;
        assert_eq!(status, 200, "{values:?}: {view}");
        let version = i64::try_from(written).expect("a small count") + 2;
        assert_eq!(view["version"], version, "{values:?}: {view}");
        assert_eq!(document_row(&app), (body, version), "{values:?}");
    }
    assert_eq!(app.state.http.parked_writers(), 0);
    assert_eq!(
        status_and_json(app.get("/lab/condition/evidence").await)
            .await
            .1,
        json!({"entered": false})
    );

    // The one exact value still parks at the armed probe.
    let parked = {
        let (client, url) = (app.client.clone(), app.address.clone());
        tokio::spawn(async move { put_document(&client, &url, "parked", Some("*"), true).await })
    };
    wait_for_parked(&app.state.http, 1).await;
    assert_eq!(app.post("/lab/condition/release").await.status(), 204);
    assert_eq!(parked.await.expect("the parked writer").status(), 200);
}

async fn wait_for_parked(lab: &HttpLab, expected: usize) {
    poll_until(
        &format!("{expected} parked writers"),
        || std::future::ready(lab.parked_writers()),
        |parked| *parked == expected,
    )
    .await;
}

#[tokio::test]
async fn a_parked_writer_whose_client_disconnects_is_abandoned() {
    let server = spawn_app().await;
    let http = client();
    let arm = http
        .post(format!("{}/lab/condition/arm", server.address))
        .send()
        .await
        .unwrap();
    assert_eq!(arm.status(), 204);

    // A raw connection, so the test decides exactly when the client goes away.
    let host = server.address.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(host).await.unwrap();
    let body = r#"{"body":"abandoned"}"#;
    let request = format!(
        "PUT /documents/1 HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         If-Match: \"v1\"\r\nX-Lab-Pause: true\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    wait_for_parked(&server.state.http, 1).await;
    drop(socket);
    wait_for_parked(&server.state.http, 0).await;

    // Releasing now lets nobody through: the abandoned write never reaches the store.
    let release = http
        .post(format!("{}/lab/condition/release", server.address))
        .send()
        .await
        .unwrap();
    assert_eq!(release.status(), 204);
    let next = put_document(&http, &server.address, "kept", Some("\"v1\""), false).await;
    assert_eq!(next.status(), 200, "version 1 was still current");
    let db = rusqlite::Connection::open(&server.database).unwrap();
    let row: (String, i64) = db
        .query_row(
            "SELECT body, version FROM documents WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(row, ("kept".to_owned(), 2));

    server.stop().await;
}

#[tokio::test]
async fn the_versioned_representations_keep_the_seed_bodies() {
    let app = spawn_app().await;

    for (path, expected) in [
        ("/api/v1/item", r#"{"id":1,"name":"rune"}"#),
        (
            "/api/v1/item-extra",
            r#"{"id":1,"name":"rune","state":"active"}"#,
        ),
        (
            "/api/v2/item",
            r#"{"id":1,"displayName":"rune","state":"active"}"#,
        ),
    ] {
        let response = app.get(path).await;
        assert_eq!(response.status(), 200, "{path}");
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        assert_eq!(response.text().await.unwrap(), expected, "{path}");
    }
}

/// Reads a response body chunk by chunk: the text received, and whether it ended in an error.
async fn read_stream(response: reqwest::Response) -> (String, Option<reqwest::Error>) {
    let mut chunks = response.bytes_stream();
    let mut received = Vec::new();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(bytes) => received.extend_from_slice(&bytes),
            Err(error) => return (String::from_utf8(received).unwrap(), Some(error)),
        }
    }
    (String::from_utf8(received).unwrap(), None)
}

fn assert_ndjson(response: &reqwest::Response) {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/x-ndjson");
}

#[tokio::test]
async fn the_stream_sends_two_items_and_a_completion_line() {
    let app = spawn_app().await;

    let response = app.get("/stream").await;
    assert_ndjson(&response);
    let (text, error) = read_stream(response).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        text,
        "{\"type\":\"item\",\"id\":1}\n{\"type\":\"item\",\"id\":2}\n{\"type\":\"complete\",\"count\":2}\n"
    );
}

#[tokio::test]
async fn a_failing_stream_reports_the_error_in_band_and_never_completes() {
    let app = spawn_app().await;

    let response = app.get("/stream?fail=true").await;
    assert_ndjson(&response);
    let (text, error) = read_stream(response).await;
    assert!(error.is_none(), "the body itself ends cleanly: {error:?}");
    assert_eq!(
        text,
        "{\"type\":\"item\",\"id\":1}\n{\"type\":\"error\",\"code\":\"controlled-failure\"}\n"
    );

    let (_, normal) = read_stream(app.get("/stream?fail=false").await).await;
    assert!(normal.is_none());
}

#[tokio::test]
async fn an_aborted_stream_is_truncated_after_the_first_item() {
    let app = spawn_app().await;

    let response = app.get("/stream?abortAfter=1").await;
    assert_ndjson(&response);
    let (text, error) = read_stream(response).await;
    assert_eq!(text, "{\"type\":\"item\",\"id\":1}\n");
    assert!(
        error.is_some(),
        "the body must end in an error, not a clean end of the chunked response"
    );

    // The server is unharmed: the next request on a new connection works.
    let after = app.get("/stream").await;
    assert!(
        read_stream(after)
            .await
            .0
            .ends_with("\"complete\",\"count\":2}\n")
    );
}

#[tokio::test]
async fn other_stream_parameters_are_bad_requests() {
    let app = spawn_app().await;

    for query in [
        "abortAfter=2",
        "abortAfter=0",
        "abortAfter=-1",
        "abortAfter=one",
        "abortAfter=1.5",
        "fail=yes",
        "fail=1",
    ] {
        let response = app.get(&format!("/stream?{query}")).await;
        assert_bad_request(response).await;
    }
}

// ---------------------------------------------------------------- content sniffing

#[tokio::test]
async fn every_json_and_problem_answer_forbids_content_sniffing() {
    let app = spawn_app().await;
    let json_body = |body: &str| {
        app.client
            .post(app.url("/aggregates/acct/messages"))
            .header("content-type", "application/json")
            .body(body.to_owned())
    };
    let answers = [
        ("a JSON document", app.client.get(app.url("/documents/1"))),
        (
            "an applied delivery",
            json_body(r#"{"messageId":"m-1","sequence":1,"amount":1}"#),
        ),
        ("a 400 problem", json_body("{not json")),
        (
            "a 404 of a handler",
            app.client.get(app.url("/aggregates/nobody")),
        ),
        (
            "the router's 404",
            app.client.get(app.url("/no/such/route")),
        ),
        (
            "the router's 405",
            app.client.delete(app.url("/documents/1")),
        ),
        (
            "the body limit's 413",
            json_body(&" ".repeat(production_lab::config::MAX_REQUEST_BODY_BYTES + 1)),
        ),
        (
            "the OpenAPI document",
            app.client.get(app.url("/openapi.json")),
        ),
        (
            "a 428 problem",
            app.client
                .put(app.url("/documents/1"))
                .json(&json!({"body": "x"})),
        ),
    ];
    let mut statuses = Vec::new();
    for (what, request) in answers {
        let response = request
            .send()
            .await
            .expect("the request reaches the server");
        statuses.push(response.status().as_u16());
        let content_type = content_type(&response);
        assert!(
            content_type.starts_with("application/json")
                || content_type.starts_with("application/problem+json"),
            "{what}: {content_type}"
        );
        assert_eq!(
            response
                .headers()
                .get("x-content-type-options")
                .and_then(|value| value.to_str().ok()),
            Some("nosniff"),
            "{what}"
        );
    }
    assert_eq!(statuses, [200, 200, 400, 404, 404, 405, 413, 200, 428]);
}
