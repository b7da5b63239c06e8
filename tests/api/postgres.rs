//! The ordered inbox in PostgreSQL: the test run's private cluster, and the multi-server faults
//! over real processes and HTTP.
//!
//! One private PostgreSQL serves the whole test binary run: started lazily by the first test that
//! needs it ([`production_lab::pg_cluster`]: `initdb` into a temp dir, `pg_ctl start` on a free
//! loopback port, as the `postgres` user when the tests run as root), one fresh database per
//! test, and stopped by its watchdog when the test process exits. A test that stops PostgreSQL
//! on purpose starts a cluster of its own. A machine without the server binaries fails these
//! tests with a message naming the Debian package `postgresql`; they are never skipped.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use production_lab::pg_cluster::{ClusterOptions, PrivateCluster};
use tokio_postgres::{NoTls, SimpleQueryMessage};

static CLUSTER: OnceLock<Result<PrivateCluster, String>> = OnceLock::new();
static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// The test run's shared cluster, started on first use.
pub fn shared_cluster() -> &'static PrivateCluster {
    let cluster = CLUSTER.get_or_init(|| {
        PrivateCluster::start(ClusterOptions::for_tests()).map_err(|error| error.to_string())
    });
    match cluster {
        Ok(cluster) => cluster,
        Err(error) => panic!("cannot start the private PostgreSQL for these tests: {error}"),
    }
}

/// A new, empty database on the shared cluster; returns its URL.
pub fn fresh_database() -> String {
    create_database(shared_cluster())
}

/// A new, empty database on `cluster`; returns its URL.
pub fn create_database(cluster: &PrivateCluster) -> String {
    let number = DATABASES.fetch_add(1, Ordering::Relaxed);
    let name = format!("inbox_{}_{number}", std::process::id());
    cluster
        .create_database(&name)
        .unwrap_or_else(|error| panic!("create database {name}: {error}"))
}

/// Runs SQL text (one or more statements, no parameters) and returns every row's values as text,
/// as PostgreSQL's simple query protocol gives them. Blocking: it runs on a thread of its own,
/// so it may be called from a test's async body.
pub fn query_text(url: &str, sql: &str) -> Vec<Vec<Option<String>>> {
    let (url, sql) = (url.to_owned(), sql.to_owned());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the query");
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&url, NoTls)
                .await
                .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
            tokio::spawn(connection);
            let messages = client
                .simple_query(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
            messages
                .into_iter()
                .filter_map(|message| match message {
                    SimpleQueryMessage::Row(row) => Some(
                        (0..row.len())
                            .map(|i| row.get(i).map(str::to_owned))
                            .collect(),
                    ),
                    _ => None,
                })
                .collect()
        })
    })
    .join()
    .expect("the query thread")
}

#[tokio::test]
async fn the_private_cluster_serves_a_database_per_test() {
    let first = fresh_database();
    let second = fresh_database();
    assert_ne!(first, second);
    assert_eq!(query_text(&first, "SELECT 1 + 1"), [[Some("2".to_owned())]]);
}
