//! The one way tests start the server: in process on an ephemeral loopback port with a fresh
//! database file and a copy of the settings file, or as a child process of the real binary.
//!
//! The ordered inbox's tests run on both backends: [`spawn_app_on`] takes a [`Backend`], and
//! [`on_both_backends!`](crate::on_both_backends) turns `async fn name(backend: Backend)` into a
//! `sqlite::name` and a `postgres::name` test. Such tests read the inbox's rows through
//! [`TestApp::inbox_scalar`] and [`TestApp::inbox_rows`], which ask whichever database holds them.
// Each lab's tests use a different part of these helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use production_lab::{AppState, Application, Config};
use serde_json::Value;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The settings every test server starts with: the seed's values.
pub const SEED_SETTINGS: &str =
    r#"{"Live":{"Label":"initial","Maximum":3,"Secret":"classroom-not-a-secret"}}"#;

/// Where a test server keeps the ordered inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The SQLite file, beside every other lab (the default).
    Sqlite,
    /// A fresh database of the test run's private PostgreSQL (`--inbox`).
    Postgres,
}

/// Generates, for each `async fn name(backend: Backend)` listed, the tests `sqlite::name` and
/// `postgres::name`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::helpers::Backend::Sqlite).await
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::helpers::Backend::Postgres).await
                }
            )+
        }
    };
}

/// A server running inside the test process.
pub struct TestApp {
    /// The root URL, e.g. `http://127.0.0.1:41234`.
    pub address: String,
    pub port: u16,
    pub client: reqwest::Client,
    pub database: PathBuf,
    pub settings: PathBuf,
    /// The server's shared state, for lab evidence a test watches (and reads after a stop).
    pub state: AppState,
    /// Keeps the database and settings files alive for the test's duration.
    pub dir: TempDir,
    /// The PostgreSQL database holding the ordered inbox, when the backend is PostgreSQL.
    pub inbox_url: Option<String>,
    stop: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("test HTTP client")
}

/// A fresh server on a fresh database.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// A fresh server whose configuration the test adjusts first.
pub async fn spawn_app_with(configure: impl FnOnce(&mut Config)) -> TestApp {
    spawn_app_on_with(Backend::Sqlite, configure).await
}

/// A fresh server with its ordered inbox on `backend`.
pub async fn spawn_app_on(backend: Backend) -> TestApp {
    spawn_app_on_with(backend, |_| {}).await
}

/// A fresh server with its ordered inbox on `backend`, configured by the test first.
pub async fn spawn_app_on_with(backend: Backend, configure: impl FnOnce(&mut Config)) -> TestApp {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = dir.path().join("runtime-settings.json");
    std::fs::write(&settings, SEED_SETTINGS).expect("write settings");
    let mut config = Config::for_tests(dir.path().join("lab.db"), settings);
    if backend == Backend::Postgres {
        config.inbox = Some(crate::postgres::fresh_database());
    }
    configure(&mut config);
    start(dir, config).await
}

/// Starts a server on `config`, its files in `dir`: a stopped server's (see [`TestApp::stop`]),
/// to start it again with settings of the test's choosing.
pub async fn start(dir: TempDir, config: Config) -> TestApp {
    let database = config.database.clone();
    let settings = config.settings.clone();
    let inbox_url = config.inbox.clone();
    let application = Application::build(config).await.expect("server starts");
    let port = application.port();
    let address = application.url();
    let state = application.state().clone();
    let stop = CancellationToken::new();
    let server = tokio::spawn(application.run_until_stopped(stop.clone().cancelled_owned()));
    TestApp {
        address,
        port,
        client: client(),
        database,
        settings,
        state,
        dir,
        inbox_url,
        stop,
        server,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .send()
            .await
            .expect("GET reaches the server")
    }

    pub async fn post(&self, path: &str) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .send()
            .await
            .expect("POST reaches the server")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("POST reaches the server")
    }

    /// Posts a raw body with the given content type.
    pub async fn post_raw(&self, path: &str, content_type: &str, body: &str) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .header("content-type", content_type)
            .body(body.to_owned())
            .send()
            .await
            .expect("POST reaches the server")
    }

    /// A connection of the test's own to the server's database file, for reading the rows.
    pub fn db(&self) -> rusqlite::Connection {
        let connection = rusqlite::Connection::open(&self.database).expect("open test database");
        connection
            .busy_timeout(Duration::from_secs(5))
            .expect("busy timeout");
        connection
    }

    /// Counts rows with a query returning one integer.
    pub fn scalar(&self, sql: &str) -> i64 {
        self.db()
            .query_row(sql, [], |row| row.get(0))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Every row a query returns, each mapped by `map`.
    pub fn rows<T>(
        &self,
        sql: &str,
        map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Vec<T> {
        let db = self.db();
        let mut statement = db.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        statement
            .query_map([], map)
            .and_then(Iterator::collect)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Which backend holds the ordered inbox.
    pub fn backend(&self) -> Backend {
        if self.inbox_url.is_some() {
            Backend::Postgres
        } else {
            Backend::Sqlite
        }
    }

    /// The first column of the first row of a query on the ordered inbox's tables, wherever
    /// they are, as an integer.
    pub fn inbox_scalar(&self, sql: &str) -> i64 {
        let rows = self.inbox_rows(sql);
        let first = rows
            .first()
            .and_then(|row| row.split('|').next())
            .unwrap_or_else(|| panic!("{sql}: no row"));
        first
            .parse()
            .unwrap_or_else(|e| panic!("{sql}: {first:?} is not an integer: {e}"))
    }

    /// Every row of a query on the ordered inbox's tables, wherever they are, as its values
    /// joined by `|` (`NULL` for null), as `sqlite3` prints them.
    pub fn inbox_rows(&self, sql: &str) -> Vec<String> {
        let join = |values: Vec<Option<String>>| {
            values
                .into_iter()
                .map(|value| value.unwrap_or_else(|| "NULL".to_owned()))
                .collect::<Vec<_>>()
                .join("|")
        };
        match &self.inbox_url {
            Some(url) => crate::postgres::query_text(url, sql)
                .into_iter()
                .map(join)
                .collect(),
            None => {
                let db = self.db();
                let mut statement = db.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
                let columns = statement.column_count();
                let mut query = statement.query([]).unwrap_or_else(|e| panic!("{sql}: {e}"));
                let mut rows = Vec::new();
                while let Some(row) = query.next().unwrap_or_else(|e| panic!("{sql}: {e}")) {
                    let values = (0..columns)
                        .map(|i| match row.get_ref(i).expect("a column") {
                            rusqlite::types::ValueRef::Null => None,
                            rusqlite::types::ValueRef::Integer(n) => Some(n.to_string()),
                            rusqlite::types::ValueRef::Real(x) => Some(x.to_string()),
                            rusqlite::types::ValueRef::Text(t)
                            | rusqlite::types::ValueRef::Blob(t) => {
                                Some(String::from_utf8_lossy(t).into_owned())
                            }
                        })
                        .collect();
                    rows.push(join(values));
                }
                rows
            }
        }
    }

    /// Runs statements on the ordered inbox's tables, wherever they are.
    pub fn inbox_execute(&self, sql: &str) {
        match &self.inbox_url {
            Some(url) => {
                crate::postgres::query_text(url, sql);
            }
            None => self
                .db()
                .execute_batch(sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
        }
    }

    /// The `operator` command's arguments that name this server's operator store.
    pub fn operator_store_args(&self) -> Vec<std::ffi::OsString> {
        match &self.inbox_url {
            Some(url) => vec!["--inbox".into(), url.into()],
            None => vec!["--database".into(), self.database.clone().into()],
        }
    }

    /// Stops the server gracefully and waits for it, keeping the files (and the PostgreSQL
    /// database).
    pub async fn stop(self) -> (TempDir, Config) {
        self.stop.cancel();
        self.server
            .await
            .expect("server task")
            .expect("server stops cleanly");
        let mut config = Config::for_tests(self.database, self.settings);
        config.inbox = self.inbox_url;
        (self.dir, config)
    }

    /// Stops this server and starts a new one on the same database file.
    pub async fn restart(self) -> TestApp {
        let (dir, config) = self.stop().await;
        start(dir, config).await
    }
}

/// How often [`poll_until_with`] looks, and for how long before it gives up.
#[derive(Debug, Clone, Copy)]
pub struct Patience {
    pub every: Duration,
    pub within: Duration,
}

impl Patience {
    /// Every 25 ms for ten seconds: what most waits need.
    pub const DEFAULT: Patience = Patience {
        every: Duration::from_millis(25),
        within: Duration::from_secs(10),
    };
}

/// Polls `probe` until `done` holds, every 25 ms for at most ten seconds, and returns the last
/// value. Tests wait on a fact this way, never on a fixed time.
pub async fn poll_until<T, F, Fut>(what: &str, probe: F, done: impl Fn(&T) -> bool) -> T
where
    T: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    poll_until_with(what, Patience::DEFAULT, probe, done).await
}

/// [`poll_until`] with another limit than ten seconds, at the same 25 ms pace.
pub async fn poll_until_within<T, F, Fut>(
    what: &str,
    within: Duration,
    probe: F,
    done: impl Fn(&T) -> bool,
) -> T
where
    T: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let patience = Patience {
        within,
        ..Patience::DEFAULT
    };
    poll_until_with(what, patience, probe, done).await
}

/// [`poll_until`] with its own pace: the one polling loop of the test suite.
pub async fn poll_until_with<T, F, Fut>(
    what: &str,
    patience: Patience,
    mut probe: F,
    done: impl Fn(&T) -> bool,
) -> T
where
    T: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = tokio::time::Instant::now() + patience.within;
    let mut last = probe().await;
    while !done(&last) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: never reached within {:?}; last seen {last:?}",
            patience.within
        );
        tokio::time::sleep(patience.every).await;
        last = probe().await;
    }
    last
}

/// The response's `Content-Type`, empty when it has none (or one that is not text).
pub fn content_type(response: &reqwest::Response) -> String {
    response
        .headers()
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// Asserts a 400 problem+json response and returns its body.
pub async fn assert_bad_request(response: reqwest::Response) -> Value {
    assert_eq!(
        response.status(),
        400,
        "expected 400 for a request-shape error"
    );
    let content_type = content_type(&response);
    assert!(
        content_type.starts_with("application/problem+json"),
        "content type was {content_type}"
    );
    let body: Value = response.json().await.expect("problem body is JSON");
    assert_eq!(body["status"], 400);
    assert!(
        body["detail"].as_str().is_some_and(|d| !d.is_empty()),
        "the problem says what is wrong: {body}"
    );
    body
}

/// Reads a response as (status, JSON body).
pub async fn status_and_json(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("body {text:?} is not JSON: {e}"))
    };
    (status, body)
}

/// The built `production-lab` binary.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_production-lab")
}

/// A `production-lab` command with a clean environment for the lab's own variables.
pub fn command() -> Command {
    let mut command = Command::new(binary());
    command.env_remove("LAB_ENVIRONMENT").env_remove("LAB_LOG");
    command
}

/// The server as a child process; killed when dropped.
pub struct ServerProcess {
    pub child: Child,
    pub address: String,
    /// Everything the process printed to stdout after the listening line, collected by a thread.
    pub stdout_rest: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Starts `serve --urls http://127.0.0.1:0 --environment Development` on `database`, with
    /// `settings` and any extra arguments, and waits for its listening line.
    pub fn start(database: &Path, settings: &Path, extra: &[&str]) -> ServerProcess {
        ServerProcess::start_with_env(database, settings, extra, &[])
    }

    /// [`ServerProcess::start`] with environment variables set for the process (e.g. `LAB_LOG`).
    pub fn start_with_env(
        database: &Path,
        settings: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> ServerProcess {
        let mut child = command()
            .envs(env.iter().copied())
            .arg("serve")
            .args([
                "--urls",
                "http://127.0.0.1:0",
                "--environment",
                "Development",
            ])
            .arg("--database")
            .arg(database)
            .arg("--settings")
            .arg(settings)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let address = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(address) = lab_testkit::server::listening_address(&line) {
                        break address.to_owned();
                    }
                }
                _ => {
                    let output = child
                        .wait_with_output()
                        .expect("wait for the failed server");
                    panic!(
                        "the server exited before listening: {}",
                        String::from_utf8_lossy(&output.stderr)
                    );
                }
            }
        };
        let stdout_rest = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = stdout_rest.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(mut sink) = sink.lock() {
                    sink.push(line);
                }
            }
        });
        ServerProcess {
            child,
            address,
            stdout_rest,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// Sends a signal to the process (unix).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Stops the process with SIGTERM, waits for it to exit, and returns everything it printed
    /// after its listening line: (stdout, stderr).
    pub async fn stop_and_collect_output(&mut self) -> (String, String) {
        self.signal("TERM");
        self.exit_status().await;
        let mut stderr = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("read stderr");
        }
        // The stdout reader thread ends with the process; its lines are all collected.
        let stdout = self.stdout_rest.lock().expect("stdout lines").join("\n");
        (stdout, stderr)
    }

    /// Waits for the process to exit (at most ten seconds) and returns how it ended.
    pub async fn exit_status(&mut self) -> std::process::ExitStatus {
        let child = &mut self.child;
        poll_until(
            "the server process exits",
            || std::future::ready(child.try_wait().ok().flatten()),
            Option::is_some,
        )
        .await
        .expect("poll_until returns only once the process has exited")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temp dir holding a seed settings file, for process tests.
pub fn settings_dir() -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = dir.path().join("runtime-settings.json");
    std::fs::write(&settings, SEED_SETTINGS).expect("write settings");
    (dir, settings)
}
