//! The privacy lab over real HTTP: bounded operation labels, redacted identities, the last 32
//! log lines, and an email that never leaves the request.

use serde_json::{Value, json};

use crate::helpers::{
    ServerProcess, TestApp, client, poll_until, settings_dir, spawn_app, status_and_json,
};

const EMAIL: &str = "ada.lovelace+private@example.com";

async fn observe(app: &TestApp, query: &[(&str, &str)]) -> (Value, String) {
    let response = app
        .client
        .get(reqwest::Url::parse_with_params(&app.url("/privacy/observe"), query).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    (serde_json::from_str(&text).unwrap(), text)
}

async fn evidence(app: &TestApp) -> (Value, String) {
    let response = app.get("/privacy/evidence").await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    (serde_json::from_str(&text).unwrap(), text)
}

#[tokio::test]
async fn observations_keep_only_bounded_operations_and_redacted_identities() {
    let app = spawn_app().await;
    let cases = [
        (
            vec![("email", EMAIL), ("operation", "quote")],
            json!({"operation": "quote", "identity": "redacted"}),
        ),
        (
            vec![("operation", "search")],
            json!({"operation": "search", "identity": "anonymous"}),
        ),
        (
            vec![("email", ""), ("operation", "search")],
            json!({"operation": "search", "identity": "anonymous"}),
        ),
        (
            vec![("email", EMAIL), ("operation", "Quote")],
            json!({"operation": "other", "identity": "redacted"}),
        ),
        (
            vec![("email", EMAIL), ("operation", EMAIL)],
            json!({"operation": "other", "identity": "redacted"}),
        ),
        (
            vec![],
            json!({"operation": "other", "identity": "anonymous"}),
        ),
    ];
    for (query, expected) in cases {
        let (body, text) = observe(&app, &query).await;
        assert_eq!(body, expected, "{query:?}");
        assert!(!text.contains("lovelace"), "{text}");
    }
    let (body, text) = evidence(&app).await;
    assert_eq!(
        body,
        json!({
            "messages": [
                "Handled quote for redacted",
                "Handled search for anonymous",
                "Handled search for anonymous",
                "Handled other for redacted",
                "Handled other for redacted",
                "Handled other for anonymous",
            ],
            "metricLabels": ["other", "quote", "search"],
        })
    );
    assert!(!text.contains("lovelace"), "{text}");
}

#[tokio::test]
async fn many_distinct_operations_still_make_three_labels() {
    let app = spawn_app().await;
    for n in 0..25 {
        observe(&app, &[("operation", &format!("op-{n}"))]).await;
    }
    observe(&app, &[("operation", "quote")]).await;
    let (body, _) = evidence(&app).await;
    assert_eq!(body["metricLabels"], json!(["other", "quote"]));
}

#[tokio::test]
async fn forty_observations_keep_the_last_thirty_two_messages() {
    let app = spawn_app().await;
    // 8 that must be evicted, then 32 that must be kept, in order.
    for _ in 0..8 {
        observe(&app, &[("operation", "quote"), ("email", EMAIL)]).await;
    }
    let mut expected = Vec::new();
    for n in 0..32 {
        if n % 2 == 0 {
            observe(&app, &[("operation", "search")]).await;
            expected.push("Handled search for anonymous");
        } else {
            observe(&app, &[("operation", "other"), ("email", EMAIL)]).await;
            expected.push("Handled other for redacted");
        }
    }
    let (body, _) = evidence(&app).await;
    assert_eq!(body["messages"], json!(expected));
    // The evicted messages' label stays: labels are everything ever counted.
    assert_eq!(body["metricLabels"], json!(["other", "quote", "search"]));
}

#[tokio::test]
async fn concurrent_observations_keep_exactly_thirty_two_messages() {
    let app = spawn_app().await;
    let observations = (0..40).map(|n| {
        let operation = if n % 2 == 0 { "quote" } else { "search" };
        let app = &app;
        async move { observe(app, &[("operation", operation), ("email", EMAIL)]).await }
    });
    futures_util::future::join_all(observations).await;
    let (body, _) = evidence(&app).await;
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 32);
    for message in messages {
        assert!(
            message == "Handled quote for redacted" || message == "Handled search for redacted",
            "{message}"
        );
    }
    assert_eq!(body["metricLabels"], json!(["quote", "search"]));
}

#[tokio::test]
async fn each_application_keeps_its_own_evidence() {
    let first = spawn_app().await;
    let second = spawn_app().await;
    observe(&first, &[("operation", "quote")]).await;
    let (untouched, _) = evidence(&second).await;
    assert_eq!(untouched, json!({"messages": [], "metricLabels": []}));
    let (touched, _) = evidence(&first).await;
    assert_eq!(touched["messages"], json!(["Handled quote for anonymous"]));
}

#[tokio::test]
async fn the_email_never_reaches_the_console() {
    let (dir, settings) = settings_dir();
    let mut server = ServerProcess::start(&dir.path().join("lab.db"), &settings, &[]);
    let http = client();
    let response = http
        .get(
            reqwest::Url::parse_with_params(
                &server.url("/privacy/observe"),
                [("email", EMAIL), ("operation", "quote")],
            )
            .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let (status, body) = status_and_json(response).await;
    assert_eq!(status, 200);
    assert_eq!(body["identity"], "redacted");
    let evidence = http
        .get(server.url("/privacy/evidence"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        evidence.contains("Handled quote for redacted"),
        "{evidence}"
    );

    // The privacy line is printed to the console, as the seed's log provider does.
    poll_until(
        "the privacy line reaches stdout",
        || {
            let printed = server
                .stdout_rest
                .lock()
                .unwrap()
                .iter()
                .any(|line| line == "Handled quote for redacted");
            std::future::ready(printed)
        },
        |printed| *printed,
    )
    .await;
    let (stdout, stderr) = server.stop_and_collect_output().await;
    for text in [&stdout, &stderr, &evidence] {
        assert!(!text.contains("lovelace"), "the email leaked: {text}");
    }
}
