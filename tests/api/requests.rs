//! Rules every route shares for the shape of a request: body size, JSON members, media type
//! and charset, unknown routes and methods.

use serde_json::json;

use crate::helpers::{assert_bad_request, spawn_app, status_and_json};

/// One more byte than the server reads of any body.
const TOO_LARGE: usize = production_lab::config::MAX_REQUEST_BODY_BYTES + 1;

#[tokio::test]
async fn a_body_over_the_limit_answers_413_problem_json() {
    let app = spawn_app().await;
    for path in ["/ordered/apply", "/aggregates/acct-1/messages", "/worker"] {
        let padding = "a".repeat(TOO_LARGE);
        let body = format!(r#"{{"messageId":"m-1","padding":"{padding}"}}"#);
        let response = app.post_raw(path, "application/json", &body).await;
        assert_eq!(response.status(), 413, "{path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let (_, problem) = status_and_json(response).await;
        assert_eq!(problem["status"], 413, "{path}");
        assert_eq!(problem["title"], "Content Too Large", "{path}");
    }
    assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
}

/// Every route that binds a JSON body, with its method.
const JSON_ROUTES: [(&str, &str); 9] = [
    ("POST", "/ordered/apply"),
    ("POST", "/aggregates/acct/messages"),
    ("POST", "/outbox/orders"),
    ("POST", "/inbox/apply"),
    ("POST", "/cache/catalog"),
    ("POST", "/pipeline"),
    ("POST", "/worker"),
    ("PUT", "/documents/1"),
    ("POST", "/deadletters/poison-2/resolution"),
];

/// Sends `body` as `application/json` (or `content_type`) to a route, as an operator.
async fn send_json(
    app: &crate::helpers::TestApp,
    token: &str,
    (method, path): (&str, &str),
    content_type: &str,
    body: &str,
) -> reqwest::Response {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    app.client
        .request(method, app.url(path))
        .bearer_auth(token)
        .header("content-type", content_type)
        .header("idempotency-key", "demo")
        .header("if-match", "\"v1\"")
        .body(body.to_owned())
        .send()
        .await
        .expect("the request reaches the server")
}

#[tokio::test]
async fn a_member_given_twice_is_refused_on_every_json_route() {
    let app = spawn_app().await;
    let token = ordered_inbox::sqlite::operators::add(&app.database, "alice").expect("an operator");
    for route in JSON_ROUTES {
        for body in [
            r#"{"value":1,"value":2}"#,
            r#"{"value":1,"VALUE":2}"#,
            r#"{"outer":{"Inner":1,"inner":2}}"#,
        ] {
            let problem =
                assert_bad_request(send_json(&app, &token, route, "application/json", body).await)
                    .await;
            let detail = problem["detail"].as_str().unwrap();
            assert!(
                detail.contains("more than once"),
                "{route:?} {body}: {detail}"
            );
        }
    }
}

#[tokio::test]
async fn the_audit_example_is_refused_instead_of_applying_the_last_amount() {
    let app = spawn_app().await;
    // A proxy that reads the first amount sees a poison message; serde alone would apply 5.
    let body = r#"{"messageId":"d","sequence":1,"amount":-5,"amount":5}"#;
    let problem = assert_bad_request(
        app.post_raw("/aggregates/acct/messages", "application/json", body)
            .await,
    )
    .await;
    assert!(
        problem["detail"].as_str().unwrap().contains("'amount'"),
        "{problem}"
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM deadletters"), 0);
}

#[tokio::test]
async fn a_replacement_naming_a_member_twice_is_refused_and_resolves_nothing() {
    let app = spawn_app().await;
    let token = ordered_inbox::sqlite::operators::add(&app.database, "alice").expect("an operator");
    for (sequence, message, amount) in [(1, "m-1", 5), (2, "poison-2", -1)] {
        let body = json!({"messageId": message, "sequence": sequence, "amount": amount});
        app.post_json("/aggregates/acct/messages", &body).await;
    }
    let body = r#"{"action":"replace","expectedLast":1,"reason":"r",
        "replacement":{"messageId":"fix-2","amount":-1,"amount":2}}"#;
    let route = ("POST", "/deadletters/poison-2/resolution");
    let problem =
        assert_bad_request(send_json(&app, &token, route, "application/json", body).await).await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("more than once"),
        "{problem}"
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM resolutions"), 0);
}

#[tokio::test]
async fn a_json_body_in_a_charset_other_than_utf8_answers_415_problem_json() {
    let app = spawn_app().await;
    let token = ordered_inbox::sqlite::operators::add(&app.database, "alice").expect("an operator");
    for route in JSON_ROUTES {
        for content_type in [
            "application/json; charset=utf-16",
            "application/json;charset=\"ISO-8859-1\"",
        ] {
            let response = send_json(&app, &token, route, content_type, r#"{"value":1}"#).await;
            assert_eq!(response.status(), 415, "{route:?} {content_type}");
            assert_eq!(
                response.headers()["content-type"],
                "application/problem+json"
            );
            let (_, problem) = status_and_json(response).await;
            assert!(
                problem["detail"].as_str().unwrap().contains("UTF-8"),
                "{problem}"
            );
        }
    }
    // UTF-8, named in any letter case, is read as before.
    let response = app
        .post_raw(
            "/worker",
            "application/json; charset=UTF-8",
            r#"{"value":2}"#,
        )
        .await;
    assert_eq!(status_and_json(response).await.1["value"], 4);
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_answer_problem_json() {
    let app = spawn_app().await;
    let response = app.get("/no/such/route").await;
    assert_eq!(response.status(), 404);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let (_, problem) = status_and_json(response).await;
    assert_eq!(
        (problem["status"].clone(), problem["title"].clone()),
        (json!(404), json!("Not Found"))
    );

    let response = app.client.delete(app.url("/live")).send().await.unwrap();
    assert_eq!(response.status(), 405);
    let allow = response.headers()["allow"].to_str().unwrap().to_owned();
    assert!(allow.contains("GET"), "{allow}");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let (_, problem) = status_and_json(response).await;
    assert_eq!(problem["status"], 405);
    assert!(
        problem["detail"].as_str().unwrap().contains("DELETE"),
        "{problem}"
    );
    // A route's own 404 keeps its own problem.
    let (status, problem) = status_and_json(app.get("/aggregates/never-seen").await).await;
    assert_eq!(
        (status, problem["title"].clone()),
        (404, json!("Unknown aggregate"))
    );
}
