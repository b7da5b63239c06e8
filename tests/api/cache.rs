//! The cache lab over real HTTP: the catalog read through the cache and invalidated only after a
//! committed write, and the shared value whose concurrent callers share one factory run, even
//! when one of them disconnects.

use production_lab::labs::cache::CallerCounts;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::helpers::{TestApp, assert_bad_request, client, poll_until, spawn_app, status_and_json};

async fn stats(app: &TestApp) -> Value {
    status_and_json(app.get("/cache/stats").await).await.1
}

async fn catalog(app: &TestApp) -> (u16, Value) {
    status_and_json(app.get("/cache/catalog").await).await
}

fn catalog_row(app: &TestApp) -> (String, i64) {
    app.db()
        .query_row(
            "SELECT name, version FROM catalog_cache WHERE id = 1",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .expect("the catalog row")
}

/// Waits until the server's count of `GET /cache/shared` callers (waiting, and dropped before
/// their answer) satisfies `done`.
async fn wait_for_shared_callers(
    app: &TestApp,
    what: &str,
    done: impl Fn(&CallerCounts) -> bool,
) -> CallerCounts {
    let lab = &app.state.cache;
    poll_until(what, || std::future::ready(lab.shared_callers()), done).await
}

/// `GET /cache/shared` as a task of its own, so the test can wait for it or drop it.
fn spawn_shared_get(app: &TestApp) -> JoinHandle<(u16, Value)> {
    let request = app.client.get(app.url("/cache/shared"));
    tokio::spawn(
        async move { status_and_json(request.send().await.expect("GET /cache/shared")).await },
    )
}

#[tokio::test]
async fn the_catalog_is_read_once_while_it_is_cached() {
    let app = spawn_app().await;
    assert_eq!(stats(&app).await, json!({"reads": 0, "factories": 0}));
    for _ in 0..3 {
        assert_eq!(
            catalog(&app).await,
            (200, json!({"name": "rune", "version": 1}))
        );
    }
    assert_eq!(stats(&app).await, json!({"reads": 1, "factories": 0}));
}

#[tokio::test]
async fn twenty_concurrent_cold_reads_share_one_catalog_read() {
    let app = spawn_app().await;
    let reads = futures_util::future::join_all((0..20).map(|_| catalog(&app))).await;
    assert!(
        reads
            .iter()
            .all(|read| *read == (200, json!({"name": "rune", "version": 1}))),
        "{reads:?}"
    );
    assert_eq!(stats(&app).await["reads"], 1);
}

#[tokio::test]
async fn a_committed_write_invalidates_and_the_next_read_loads_the_new_row_once() {
    let app = spawn_app().await;
    assert_eq!(catalog(&app).await.0, 200);
    assert_eq!(stats(&app).await["reads"], 1);

    let response = app
        .post_json(
            "/cache/catalog?failBeforeCommit=false",
            &json!({"name": "ember"}),
        )
        .await;
    assert_eq!(response.status(), 204);
    assert_eq!(catalog_row(&app), ("ember".to_owned(), 2));

    assert_eq!(
        catalog(&app).await,
        (200, json!({"name": "ember", "version": 2}))
    );
    assert_eq!(
        catalog(&app).await,
        (200, json!({"name": "ember", "version": 2}))
    );
    assert_eq!(stats(&app).await["reads"], 2);
}

#[tokio::test]
async fn a_rolled_back_write_keeps_the_row_and_the_cached_value() {
    let app = spawn_app().await;
    assert_eq!(catalog(&app).await.0, 200);

    let (status, problem) = status_and_json(
        app.post_json(
            "/cache/catalog?failBeforeCommit=true",
            &json!({"name": "ember"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["title"], "Controlled cache-write rollback");
    assert_eq!(catalog_row(&app), ("rune".to_owned(), 1));

    // Still served from the cache: no second read of the row.
    assert_eq!(
        catalog(&app).await,
        (200, json!({"name": "rune", "version": 1}))
    );
    assert_eq!(stats(&app).await["reads"], 1);
}

#[tokio::test]
async fn every_bad_catalog_write_is_a_400_problem_and_changes_nothing() {
    let app = spawn_app().await;
    for body in [
        json!({"name": ""}),
        json!({"name": "   "}),
        json!({"name": "x".repeat(31)}),
        // 16 characters outside the BMP are 32 UTF-16 code units, as .NET counts them.
        json!({"name": "🦀".repeat(16)}),
        json!({"name": null}),
        json!({"name": 5}),
        json!({}),
        json!(["ember"]),
    ] {
        assert_bad_request(app.post_json("/cache/catalog", &body).await).await;
    }
    assert_bad_request(
        app.post_raw("/cache/catalog", "application/json", r#"{"name":"#)
            .await,
    )
    .await;
    assert_bad_request(
        app.post_raw("/cache/catalog", "text/plain", r#"{"name":"ember"}"#)
            .await,
    )
    .await;
    assert_bad_request(
        app.post_json(
            "/cache/catalog?failBeforeCommit=maybe",
            &json!({"name": "ember"}),
        )
        .await,
    )
    .await;
    assert_eq!(catalog_row(&app), ("rune".to_owned(), 1));

    // Thirty characters is the longest valid name.
    let longest = "x".repeat(30);
    assert_eq!(
        app.post_json("/cache/catalog", &json!({"Name": longest}))
            .await
            .status(),
        204
    );
    assert_eq!(catalog_row(&app), (longest, 2));
}

#[tokio::test]
async fn twenty_callers_behind_a_closed_gate_share_one_factory_run() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/cache/gate/close").await.status(), 204);
    let callers: Vec<_> = (0..20).map(|_| spawn_shared_get(&app)).collect();

    poll_until(
        "the factory starts",
        || stats(&app),
        |s| s["factories"] == 1,
    )
    .await;
    wait_for_shared_callers(&app, "all twenty callers wait", |callers| {
        callers.waiting == 20
    })
    .await;
    // All of them are waiting: still one run, nobody answered.
    assert_eq!(stats(&app).await, json!({"reads": 0, "factories": 1}));
    assert!(callers.iter().all(|caller| !caller.is_finished()));

    assert_eq!(app.post("/lab/cache/gate/open").await.status(), 204);
    for caller in callers {
        assert_eq!(
            caller.await.expect("caller task"),
            (200, json!({"value": "shared", "generation": 1}))
        );
    }
    assert_eq!(stats(&app).await["factories"], 1);

    // A reset forces the next call to run a new generation, once.
    assert_eq!(app.post("/lab/cache/reset").await.status(), 204);
    for _ in 0..2 {
        assert_eq!(
            status_and_json(app.get("/cache/shared").await).await,
            (200, json!({"value": "shared", "generation": 2}))
        );
    }
    assert_eq!(stats(&app).await["factories"], 2);
}

#[tokio::test]
async fn a_caller_that_disconnects_while_waiting_does_not_break_the_others() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/cache/gate/close").await.status(), 204);

    // The first caller runs the cache's init future; the others queue behind it.
    let leaver = spawn_shared_get(&app);
    poll_until(
        "the factory starts",
        || stats(&app),
        |s| s["factories"] == 1,
    )
    .await;
    let stayers: Vec<_> = (0..5).map(|_| spawn_shared_get(&app)).collect();
    wait_for_shared_callers(&app, "the five others wait behind it", |callers| {
        callers.waiting == 6
    })
    .await;

    // Dropping its request future closes its connection; the server drops its handler soon
    // after, and counts it.
    leaver.abort();
    let callers = wait_for_shared_callers(&app, "the server drops the leaver", |callers| {
        callers.dropped == 1
    })
    .await;
    assert_eq!(callers.waiting, 5, "the others still wait");
    assert_eq!(
        stats(&app).await["factories"],
        1,
        "a waiter taking over must join the running factory, not start another"
    );

    assert_eq!(app.post("/lab/cache/gate/open").await.status(), 204);
    for stayer in stayers {
        assert_eq!(
            stayer.await.expect("caller task"),
            (200, json!({"value": "shared", "generation": 1}))
        );
    }
    assert_eq!(
        status_and_json(app.get("/cache/shared").await).await,
        (200, json!({"value": "shared", "generation": 1}))
    );
    assert_eq!(stats(&app).await["factories"], 1);
}

#[tokio::test]
async fn a_lone_caller_that_disconnects_leaves_the_key_usable() {
    let app = spawn_app().await;
    assert_eq!(app.post("/lab/cache/gate/close").await.status(), 204);
    let leaver = spawn_shared_get(&app);
    poll_until(
        "the factory starts",
        || stats(&app),
        |s| s["factories"] == 1,
    )
    .await;
    leaver.abort();
    wait_for_shared_callers(&app, "the server drops the leaver", |callers| {
        *callers
            == CallerCounts {
                waiting: 0,
                dropped: 1,
            }
    })
    .await;

    // Nobody waits any more, but the shared run goes on and its value is kept.
    assert_eq!(app.post("/lab/cache/gate/open").await.status(), 204);
    assert_eq!(
        status_and_json(app.get("/cache/shared").await).await,
        (200, json!({"value": "shared", "generation": 1}))
    );
    assert_eq!(stats(&app).await["factories"], 1);
}

#[tokio::test]
async fn gate_actions_other_than_close_and_open_are_400() {
    let app = spawn_app().await;
    for action in ["shut", "Close", "OPEN", "reset"] {
        assert_bad_request(app.post(&format!("/lab/cache/gate/{action}")).await).await;
    }
    assert_eq!(app.post("/lab/cache/gate/open").await.status(), 204);
    assert_eq!(app.post("/lab/cache/reset").await.status(), 204);
}

#[tokio::test]
async fn shutdown_releases_a_caller_held_at_the_gate() {
    let server = spawn_app().await;
    let client = client();
    let closed = client
        .post(server.url("/lab/cache/gate/close"))
        .send()
        .await
        .expect("close the gate");
    assert_eq!(closed.status(), 204);
    let request = client.get(server.url("/cache/shared"));
    let waiting =
        tokio::spawn(async move { status_and_json(request.send().await.expect("GET")).await });
    let stats_url = server.url("/cache/stats");
    poll_until(
        "the factory starts",
        || async {
            status_and_json(client.get(&stats_url).send().await.expect("stats"))
                .await
                .1
        },
        |s| s["factories"] == 1,
    )
    .await;

    let state = server.state.clone();
    server.stop().await;

    let (status, problem) = waiting.await.expect("caller task");
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["title"], "The server is shutting down");
    assert!(state.tasks.is_empty(), "the factory task is still running");
}
