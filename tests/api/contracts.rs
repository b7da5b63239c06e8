//! The consumer-contract lab over real HTTP, and `production-lab verify-base` run as a process
//! against a live server.

use std::net::TcpListener;
use std::process::Output;

use serde_json::{Value, json};

use crate::helpers::{
    ServerProcess, TestApp, assert_bad_request, command, settings_dir, spawn_app, status_and_json,
};

async fn effect(app: &TestApp) -> i64 {
    let (status, body) = status_and_json(app.get("/contracts/effect").await).await;
    assert_eq!(status, 200);
    body["value"].as_i64().expect("an integer effect")
}

fn contract_effect_row(app: &TestApp) -> i64 {
    app.scalar("SELECT value FROM contract_effect WHERE id = 1")
}

#[tokio::test]
async fn the_two_shapes_differ_by_an_added_member_and_a_changed_type() {
    let app = spawn_app().await;
    assert_eq!(
        status_and_json(app.get("/contracts/compatible").await).await,
        (200, json!({"id": 1, "name": "rune", "optional": "new"}))
    );
    assert_eq!(
        status_and_json(app.get("/contracts/breaking").await).await,
        (200, json!({"id": 1, "name": 42}))
    );
}

#[tokio::test]
async fn a_failure_before_commit_rolls_back_and_one_after_commit_keeps_the_effect() {
    let app = spawn_app().await;
    assert_eq!(effect(&app).await, 0);

    let (status, body) = status_and_json(app.post("/contracts/change/before").await).await;
    assert_eq!(status, 503);
    assert_eq!(body["title"], "Controlled failure before commit");
    assert_eq!(effect(&app).await, 0);
    assert_eq!(contract_effect_row(&app), 0);

    let (status, body) = status_and_json(app.post("/contracts/change/after").await).await;
    assert_eq!(status, 503);
    assert_eq!(body["title"], "Controlled uncertain response after commit");
    assert_eq!(effect(&app).await, 1);
    assert_eq!(contract_effect_row(&app), 1);
}

#[tokio::test]
async fn an_unknown_phase_is_a_bad_request_that_changes_nothing() {
    let app = spawn_app().await;
    for phase in ["during", "Before", "AFTER"] {
        let body = assert_bad_request(app.post(&format!("/contracts/change/{phase}")).await).await;
        assert!(
            body["detail"].as_str().unwrap().contains("before"),
            "{body}"
        );
    }
    assert_eq!(contract_effect_row(&app), 0);
}

#[tokio::test]
async fn concurrent_changes_after_commit_each_count_once() {
    let app = spawn_app().await;
    let changes = (0..5).map(|index| {
        let path = if index % 2 == 0 {
            "/contracts/change/after"
        } else {
            "/contracts/change/before"
        };
        app.post(path)
    });
    let responses = futures_util::future::join_all(changes).await;
    assert!(responses.iter().all(|response| response.status() == 503));
    // Three "after" changes committed; the two "before" changes rolled back only themselves.
    assert_eq!(contract_effect_row(&app), 3);
}

// ---------------------------------------------------------------------------------------------
// verify-base as a process

fn verify_base(url: &str) -> Output {
    command()
        .args(["verify-base", url])
        .output()
        .expect("run production-lab verify-base")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A live server process on a fresh database.
fn fresh_server() -> (tempfile::TempDir, ServerProcess) {
    let (dir, settings) = settings_dir();
    let server = ServerProcess::start(&dir.path().join("lab.db"), &settings, &[]);
    (dir, server)
}

fn effect_in(dir: &tempfile::TempDir) -> i64 {
    rusqlite::Connection::open(dir.path().join("lab.db"))
        .unwrap()
        .query_row("SELECT value FROM contract_effect WHERE id = 1", [], |r| {
            r.get(0)
        })
        .unwrap()
}

#[test]
fn verify_base_passes_its_seven_checks_against_a_fresh_fixture() {
    let (dir, server) = fresh_server();

    let output = verify_base(&server.address);
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    assert_eq!(
        stdout(&output),
        "{\"checks\":7,\"transport\":\"real owned loopback HTTP\"}\n"
    );
    // It drove the real change: exactly one committed effect.
    assert_eq!(effect_in(&dir), 1);
    let summary: Value = serde_json::from_str(stdout(&output).trim()).unwrap();
    assert_eq!(summary["checks"], 7);
}

#[test]
fn verify_base_accepts_the_root_with_a_slash_and_localhost() {
    let (_dir, server) = fresh_server();
    let port = server.address.rsplit(':').next().unwrap().to_owned();

    let output = verify_base(&format!("http://localhost:{port}/"));
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    assert!(stdout(&output).contains("\"checks\":7"));
}

#[test]
fn verify_base_fails_on_a_fixture_that_is_not_fresh() {
    let (dir, server) = fresh_server();
    assert!(verify_base(&server.address).status.success());

    let output = verify_base(&server.address);
    assert!(!output.status.success());
    assert_eq!(stdout(&output), "");
    let message = stderr(&output);
    assert!(message.starts_with("Use a fresh fixture: "), "{message}");
    assert!(message.contains("check 3 (fixture is fresh)"), "{message}");
    assert!(message.contains("the effect is 1, expected 0"), "{message}");
    assert_eq!(message.trim().lines().count(), 1, "{message}");
    // It stopped at the failed check: no further change was driven.
    assert_eq!(effect_in(&dir), 1);
}

#[test]
fn verify_base_names_the_first_check_when_nothing_answers() {
    // A port that was just free: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let output = verify_base(&format!("http://127.0.0.1:{port}/"));
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(
        message.contains("check 1 (compatible shape is accepted)"),
        "{message}"
    );
}

#[test]
fn verify_base_refuses_addresses_that_are_not_an_http_loopback_root() {
    for (url, reason) in [
        ("https://127.0.0.1:5080/", "only http"),
        ("http://example.com:5080/", "loopback"),
        ("http://192.0.2.1:5080/", "loopback"),
        ("http://127.0.0.1:5080/contracts", "root"),
        ("http://127.0.0.1:5080/?fresh=1", "root"),
        ("http://user@127.0.0.1:5080/", "user information"),
        ("http://user:secret@127.0.0.1:5080/", "user information"),
        ("127.0.0.1:5080", "absolute URL"),
    ] {
        let output = verify_base(url);
        assert!(!output.status.success(), "{url} was accepted");
        assert_eq!(stdout(&output), "", "{url}");
        let message = stderr(&output);
        assert!(
            message.starts_with("Owned loopback root required: "),
            "{url}: {message}"
        );
        assert!(message.contains(reason), "{url}: {message}");
        assert_eq!(message.trim().lines().count(), 1, "{url}: {message}");
    }
}

#[test]
fn verify_base_without_a_url_is_a_usage_error() {
    let output = command().arg("verify-base").output().unwrap();
    assert!(!output.status.success());
    assert!(stderr(&output).contains("<URL>"), "{}", stderr(&output));
}
