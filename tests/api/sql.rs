//! The SQL labs over real HTTP, checked against the rows they leave behind.

use serde_json::{Value, json};

use crate::helpers::{TestApp, client, spawn_app, status_and_json};

fn counter(app: &TestApp) -> i64 {
    app.scalar("SELECT value FROM counters WHERE id = 1")
}

/// Every row of `sql_values` and the number of `sql_required` rows.
fn null_tables(app: &TestApp) -> (Vec<(i64, Option<i64>)>, i64) {
    let values = app.rows("SELECT id, amount FROM sql_values ORDER BY id", |r| {
        Ok((r.get(0)?, r.get(1)?))
    });
    (values, app.scalar("SELECT COUNT(*) FROM sql_required"))
}

fn seed_null_tables() -> (Vec<(i64, Option<i64>)>, i64) {
    (
        vec![
            (1, None),
            (2, None),
            (3, Some(1)),
            (4, Some(2)),
            (5, Some(3)),
        ],
        0,
    )
}

#[tokio::test]
async fn null_comparisons_count_as_sqlite_counts_them() {
    let app = spawn_app().await;

    let response = app.get("/sql/nulls").await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.text().await.unwrap(),
        r#"{"equalsNull":0,"isNull":2,"all":5,"known":3,"sum":6}"#
    );
}

#[tokio::test]
async fn the_null_check_observes_both_constraints_and_rolls_everything_back() {
    let app = spawn_app().await;

    for _ in 0..2 {
        let (status, body) = status_and_json(app.post("/lab/sql/null-check").await).await;
        assert_eq!(
            (status, body),
            (
                200,
                json!({"checkAllowedNull": true, "notNullRejected": true})
            )
        );
        assert_eq!(null_tables(&app), seed_null_tables());
    }
    assert_eq!(
        status_and_json(app.get("/sql/nulls").await).await.1,
        json!({"equalsNull": 0, "isNull": 2, "all": 5, "known": 3, "sum": 6})
    );
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("{value} is not an array"))
        .iter()
        .map(|row| row.as_str().expect("a plan row is a string").to_owned())
        .collect()
}

#[tokio::test]
async fn the_plans_show_which_index_each_query_uses() {
    let app = spawn_app().await;

    let (status, plans) = status_and_json(app.get("/sql/plans").await).await;
    assert_eq!(status, 200);
    assert_eq!(plans["ids"], json!([2, 3, 1]));

    let composite = strings(&plans["composite"]).join(" | ");
    assert!(
        composite.contains("ix_products_category_price_id"),
        "{composite}"
    );
    assert!(
        !composite.contains("TEMP B-TREE"),
        "the index already gives the order: {composite}"
    );
    let expression = strings(&plans["expression"]).join(" | ");
    assert!(
        expression.contains("ix_products_lower_name"),
        "{expression}"
    );
    let partial = strings(&plans["partial"]).join(" | ");
    assert!(partial.contains("ix_products_active_price"), "{partial}");
    // No index covers `name COLLATE NOCASE`: the collated query reads the whole table, which is
    // the lesson's point (the expression index on lower(name) does not apply to it).
    let collated = strings(&plans["collated"]).join(" | ");
    assert!(collated.starts_with("SCAN products"), "{collated}");
    assert!(!collated.contains("ix_products_lower_name"), "{collated}");
}

#[tokio::test]
async fn a_deferred_reader_keeps_its_snapshot_while_another_connection_commits() {
    let app = spawn_app().await;

    let (status, body) = status_and_json(app.post("/lab/sql/snapshot").await).await;
    assert_eq!(
        (status, body),
        (200, json!({"before": 10, "during": 10, "after": 20}))
    );
    assert_eq!(counter(&app), 20);

    // The lab resets the counter itself, so it answers the same way every time.
    let (_, again) = status_and_json(app.post("/lab/sql/snapshot").await).await;
    assert_eq!(again, json!({"before": 10, "during": 10, "after": 20}));
}

#[tokio::test]
async fn a_stale_writer_gets_busy_snapshot_and_a_fresh_transaction_wins() {
    let app = spawn_app().await;

    let response = app.post("/lab/sql/retry").await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.text().await.unwrap(),
        r#"{"attempts":2,"error":5,"extended":517,"value":21}"#
    );
    assert_eq!(counter(&app), 21);
}

#[tokio::test]
async fn concurrent_counter_labs_do_not_spoil_each_other() {
    let app = spawn_app().await;

    // Each lab resets the counter to 10 and expects to be alone with it; unserialized, one
    // run's reset or commit lands inside another's window and its figures change.
    for _round in 0..5 {
        let runs = (0..16).map(|n| {
            let client = client();
            let path = if n % 2 == 0 {
                "/lab/sql/snapshot"
            } else {
                "/lab/sql/retry"
            };
            let url = app.url(path);
            tokio::spawn(async move {
                let response = client.post(url).send().await.unwrap();
                (path, status_and_json(response).await)
            })
        });
        for outcome in futures_util::future::join_all(runs).await {
            let (path, (status, body)) = outcome.unwrap();
            let expected = if path == "/lab/sql/snapshot" {
                json!({"before": 10, "during": 10, "after": 20})
            } else {
                json!({"attempts": 2, "error": 5, "extended": 517, "value": 21})
            };
            assert_eq!((status, body), (200, expected), "{path}");
        }
        let last = counter(&app);
        assert!(last == 20 || last == 21, "counter {last}");
    }
}

#[tokio::test]
async fn normal_writes_wait_for_the_side_connections_instead_of_failing() {
    let app = spawn_app().await;

    // Ordered deliveries go through the store's writer while the SQL labs hold their own
    // connections' write locks; neither side may fail for the other.
    let labs = (0..4).map(|n| {
        let client = client();
        let path = if n % 2 == 0 {
            "/lab/sql/retry"
        } else {
            "/lab/sql/snapshot"
        };
        let url = app.url(path);
        tokio::spawn(async move { client.post(url).send().await.unwrap().status().as_u16() })
    });
    let deliveries = (1..=10).map(|sequence| {
        let client = client();
        let url = app.url("/ordered/apply");
        tokio::spawn(async move {
            let body = json!({
                "messageId": format!("m-{sequence}"),
                "aggregateId": "demo",
                "sequence": sequence,
                "amount": 1,
            });
            client
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    });
    let lab_statuses: Vec<u16> = futures_util::future::join_all(labs)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let delivery_statuses: Vec<u16> = futures_util::future::join_all(deliveries)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

    assert!(lab_statuses.iter().all(|s| *s == 200), "{lab_statuses:?}");
    // Deliveries arrive in any order, so some are gaps (409); none may be a 5xx.
    assert!(
        delivery_statuses.iter().all(|s| *s == 200 || *s == 409),
        "{delivery_statuses:?}"
    );
    let applied = delivery_statuses.iter().filter(|s| **s == 200).count() as i64;
    assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox"), applied);
    assert_eq!(null_tables(&app), seed_null_tables());
}
