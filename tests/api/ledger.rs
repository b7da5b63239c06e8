//! The lesson's ledger as the inbox's handler: its failures over real HTTP on both backends.
//! The ledger is made to fail from outside the server, as a real database would: a trigger of
//! the test's refuses the ledger's write of the aggregate's total.

use serde_json::{Value, json};

use crate::helpers::{Backend, TestApp, spawn_app_on, status_and_json};

/// Refuses every change of `aggregate_state.total` (the ledger's write; the inbox's own writes
/// of that row leave the total alone).
pub fn close_the_ledger(app: &TestApp) {
    app.inbox_execute(match app.backend() {
        Backend::Sqlite => {
            "CREATE TRIGGER ledger_closed BEFORE UPDATE OF total ON aggregate_state
             BEGIN SELECT RAISE(ABORT, 'the ledger is closed'); END;"
        }
        Backend::Postgres => {
            "CREATE FUNCTION ledger_closed() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'the ledger is closed'; END $$;
             CREATE TRIGGER ledger_closed BEFORE UPDATE OF total ON aggregate_state
                 FOR EACH ROW EXECUTE FUNCTION ledger_closed();"
        }
    });
}

pub fn reopen_the_ledger(app: &TestApp) {
    app.inbox_execute(match app.backend() {
        Backend::Sqlite => "DROP TRIGGER ledger_closed;",
        Backend::Postgres => "DROP TRIGGER ledger_closed ON aggregate_state;",
    });
}

async fn deliver(app: &TestApp, message_id: &str, sequence: i64, amount: i64) -> (u16, Value) {
    let body = json!({"messageId": message_id, "sequence": sequence, "amount": amount});
    status_and_json(app.post_json("/aggregates/acct/messages", &body).await).await
}

async fn a_ledger_failure_answers_503_records_nothing_and_applies_once_when_delivered_again(
    backend: Backend,
) {
    let app = spawn_app_on(backend).await;
    assert_eq!(deliver(&app, "m-1", 1, 4).await.0, 200);
    close_the_ledger(&app);

    let response = app
        .post_json(
            "/aggregates/acct/messages",
            &json!({"messageId": "m-2", "sequence": 2, "amount": 3}),
        )
        .await;
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(response.headers()["retry-after"], "1");
    let problem: Value = response.json().await.expect("a problem");
    assert_eq!(problem["title"], "The message could not be applied");
    assert!(
        !problem.to_string().contains("ledger is closed"),
        "the cause stays in the log: {problem}"
    );
    // Nothing of the failed delivery: no row, no position, no total, no timeline entry.
    assert_eq!(app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox"), 1);
    let (_, view) = status_and_json(app.get("/aggregates/acct").await).await;
    assert_eq!(
        (view["last"].clone(), view["total"].clone()),
        (json!(1), json!(4))
    );
    let (_, timeline) = status_and_json(app.get("/aggregates/acct/timeline").await).await;
    assert_eq!(
        timeline["events"].as_array().map(Vec::len),
        Some(1),
        "{timeline}"
    );

    reopen_the_ledger(&app);
    let (status, applied) = deliver(&app, "m-2", 2, 3).await;
    assert_eq!(
        (status, applied["total"].clone()),
        (200, json!(7)),
        "{applied}"
    );
    let (status, replay) = deliver(&app, "m-2", 2, 3).await;
    assert_eq!((status, replay["outcome"].clone()), (200, json!("replay")));
    assert_eq!(
        app.inbox_scalar("SELECT total FROM aggregate_state WHERE aggregate_id = 'acct'"),
        7
    );
    assert_eq!(
        app.inbox_scalar("SELECT COUNT(*) FROM ordered_inbox WHERE message_id = 'm-2'"),
        1
    );
}

crate::on_both_backends!(
    a_ledger_failure_answers_503_records_nothing_and_applies_once_when_delivered_again
);
