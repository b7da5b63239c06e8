//! lab-testkit is a client of the server's documented interfaces and keeps its own copy of what
//! it reads and writes (the lines the server prints, its flags and limits, the broker door's
//! subject and header). These tests hold each copy against the server, so the two cannot drift.

use clap::ValueEnum;
use lab_testkit::server::{ServerUnderTest, StoppedServer, Synchronous, synchronous_flag};
use serde_json::json;

use crate::helpers::{binary, client};

/// Starts the real server binary the way the benches do, with `extra` `serve` arguments.
fn start_server(extra: &[String]) -> ServerUnderTest {
    ServerUnderTest::start_binary(std::path::Path::new(binary()), Synchronous::Full, 4, extra)
        .unwrap_or_else(|error| panic!("{error}"))
}

async fn stop(server: ServerUnderTest) -> StoppedServer {
    tokio::task::spawn_blocking(move || server.stop())
        .await
        .expect("the stopping thread")
        .unwrap_or_else(|error| panic!("{error}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testkit_reads_the_address_from_the_listening_line_the_server_prints() {
    let server = start_server(&[]);
    let live = client()
        .get(format!("{}/live", server.address))
        .send()
        .await
        .expect("GET /live at the address the testkit read");
    assert_eq!(live.status(), 200);
    let stopped = stop(server).await;
    assert!(
        stopped.database.is_file(),
        "the server wrote its database where the testkit pointed it"
    );
    assert_eq!(
        stopped.postgres_figures(),
        None,
        "a SQLite server prints no PostgreSQL figures"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testkit_reads_the_postgres_figures_line_a_stopping_server_prints() {
    let url = crate::postgres::fresh_database();
    let server = start_server(&["--inbox".to_owned(), url]);
    let applied = client()
        .post(format!("{}/aggregates/acct-7/messages", server.address))
        .json(&json!({"messageId": "m-1", "sequence": 1, "amount": 5}))
        .send()
        .await
        .expect("a delivery");
    assert_eq!(applied.status(), 200);
    let figures = stop(server)
        .await
        .postgres_figures()
        .expect("the figures line among what the server printed");
    assert!(
        figures.operations >= 1 && figures.round_trips >= figures.operations,
        "{figures:?}"
    );
}

#[test]
fn the_testkit_parses_the_servers_figures_line_into_its_numbers() {
    let stats = ordered_inbox::postgres::PostgresStats {
        operations: 10,
        round_trips: 21,
        retries: 2,
        group_commits: 3,
        grouped_deliveries: 9,
        replays: 1,
    };
    let line = production_lab::app::postgres_figures_line(stats);
    assert_eq!(
        lab_testkit::server::PostgresFigures::parse(&line),
        Some(lab_testkit::server::PostgresFigures {
            operations: 10,
            round_trips: 21,
            retries: 2,
            group_commits: 3,
            grouped_deliveries: 9,
            replays: 1,
        })
    );
}

#[test]
fn the_testkits_synchronous_flag_is_the_value_serve_accepts() {
    for setting in production_lab::config::Synchronous::value_variants() {
        let flag = synchronous_flag((*setting).into());
        let parsed = production_lab::config::Synchronous::from_str(flag, false);
        assert_eq!(parsed.as_ref(), Ok(setting), "--synchronous {flag}");
    }
}

#[test]
fn the_testkits_copies_of_the_servers_limits_match_the_server() {
    assert_eq!(
        lab_testkit::server::SERVER_DEFAULT_MAX_CONNECTIONS,
        production_lab::config::DEFAULT_MAX_CONNECTIONS
    );
    assert_eq!(
        lab_testkit::bench::relay::OUTBOX_MAX_BATCH as i64,
        production_lab::labs::outbox::MAX_BATCH
    );
    assert_eq!(
        lab_testkit::bench::relay::OUTBOX_MIN_LEASE_MS,
        production_lab::labs::outbox::MIN_LEASE_MS
    );
}

#[test]
fn the_testkit_publishes_on_the_broker_doors_subjects_and_header() {
    use production_lab::broker::wire;
    assert_eq!(
        lab_testkit::nats::MESSAGE_ID_HEADER,
        wire::MESSAGE_ID_HEADER
    );
    for aggregate in ["acct-7", "a.b", "50%", "%2E", "x.%.y"] {
        assert_eq!(
            lab_testkit::nats::subject_for("ordered", aggregate),
            wire::subject_for("ordered", aggregate),
            "the subject of {aggregate:?}"
        );
    }
}
