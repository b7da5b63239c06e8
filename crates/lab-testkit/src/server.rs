//! The server under test as a child process (`production-lab serve` on a fresh database in its
//! own temp directory), and the lines of its standard output a client reads (docs/operating.md,
//! docs/postgres.md): the listening line that names its address, and the figures line a server
//! with a PostgreSQL inbox prints when it stops.

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use ordered_inbox::sqlite::Synchronous;

use crate::process::{ProcessUsage, peak_rss_kib, process_cpu_ticks};

/// The connection cap `serve` has when `--max-connections` is not given.
pub const SERVER_DEFAULT_MAX_CONNECTIONS: usize = 1024;

const LISTENING_PREFIX: &str = "Now listening on: ";
const POSTGRES_FIGURES_PREFIX: &str = "Ordered inbox figures: ";

/// The root URL announced by the server's start-up line `Now listening on: URL`, if `line` is
/// that line.
pub fn listening_address(line: &str) -> Option<&str> {
    line.strip_prefix(LISTENING_PREFIX).map(str::trim)
}

/// What a server's PostgreSQL inbox cost, from the line it prints when it stops:
/// `Ordered inbox figures: N operations, N round trips, N retries, N group commits, N grouped
/// deliveries, N replays` (a build without the group commit prints the first three).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PostgresFigures {
    pub operations: u64,
    pub round_trips: u64,
    pub retries: u64,
    pub group_commits: u64,
    pub grouped_deliveries: u64,
    pub replays: u64,
}

impl PostgresFigures {
    /// The figures of `line`, if it is the figures line.
    pub fn parse(line: &str) -> Option<PostgresFigures> {
        let rest = line.strip_prefix(POSTGRES_FIGURES_PREFIX)?;
        let numbers: Vec<u64> = rest
            .split(", ")
            .filter_map(|part| part.split(' ').next()?.parse().ok())
            .collect();
        match numbers[..] {
            [operations, round_trips, retries] => Some(PostgresFigures {
                operations,
                round_trips,
                retries,
                ..PostgresFigures::default()
            }),
            [
                operations,
                round_trips,
                retries,
                group_commits,
                grouped_deliveries,
                replays,
            ] => Some(PostgresFigures {
                operations,
                round_trips,
                retries,
                group_commits,
                grouped_deliveries,
                replays,
            }),
            _ => None,
        }
    }
}

/// `serve --synchronous`'s value for `synchronous`.
pub fn synchronous_flag(synchronous: Synchronous) -> &'static str {
    match synchronous {
        Synchronous::Normal => "normal",
        Synchronous::Full => "full",
    }
}

/// Why the server under test could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("could not start the server under test: {0}")]
    Startup(String),
    #[error("the server under test: io: {0}")]
    Io(#[from] std::io::Error),
}

/// The server binary as a child process on a fresh database in its own temp directory.
pub struct ServerUnderTest {
    child: Child,
    pub address: String,
    pub database: PathBuf,
    dir: tempfile::TempDir,
    /// What the server printed after its listening line.
    output: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

/// A stopped server: its database file (kept until `dir` is dropped) and what it printed.
pub struct StoppedServer {
    pub database: PathBuf,
    pub dir: tempfile::TempDir,
    pub output: Vec<String>,
}

impl StoppedServer {
    /// The figures of its PostgreSQL inbox, if it printed them.
    pub fn postgres_figures(&self) -> Option<PostgresFigures> {
        self.output
            .iter()
            .find_map(|line| PostgresFigures::parse(line))
    }
}

impl ServerUnderTest {
    /// Starts `serve` of the running binary on port 0 with the given synchronous mode, room for
    /// `clients` connections at once (all of them may be busy, which the connection cap would
    /// answer 503), and waits for its listening line.
    pub fn start(synchronous: Synchronous, clients: usize) -> Result<ServerUnderTest, ServerError> {
        ServerUnderTest::start_with(synchronous, clients, &[])
    }

    /// Like [`ServerUnderTest::start`], with extra `serve` arguments.
    pub fn start_with(
        synchronous: Synchronous,
        clients: usize,
        extra: &[String],
    ) -> Result<ServerUnderTest, ServerError> {
        ServerUnderTest::start_binary(&std::env::current_exe()?, synchronous, clients, extra)
    }

    /// Like [`ServerUnderTest::start_with`], running `serve` of another build of the server
    /// (e.g. the previous commit's, to compare two builds back to back under one load).
    pub fn start_binary(
        binary: &Path,
        synchronous: Synchronous,
        clients: usize,
        extra: &[String],
    ) -> Result<ServerUnderTest, ServerError> {
        let dir = tempfile::tempdir()?;
        let database = dir.path().join("bench.db");
        let settings = write_settings(dir.path())?;
        let mut arguments = serve_arguments(&database, &settings, synchronous, clients);
        arguments.extend(extra.iter().map(Into::into));
        ServerUnderTest::start_command(binary, &arguments, dir, database)
    }

    /// Runs `binary` with `arguments` (any subcommand that prints the listening line, such as
    /// `gate --config FILE`), in `dir`, whose `database` file it writes, and waits for its
    /// listening line.
    pub fn start_command(
        binary: &Path,
        arguments: &[std::ffi::OsString],
        dir: tempfile::TempDir,
        database: PathBuf,
    ) -> Result<ServerUnderTest, ServerError> {
        ServerUnderTest::start_command_with_env(binary, arguments, &[], dir, database)
    }

    /// [`ServerUnderTest::start_command`] with environment variables `env` for the process.
    pub fn start_command_with_env(
        binary: &Path,
        arguments: &[std::ffi::OsString],
        env: &[(&str, &str)],
        dir: tempfile::TempDir,
        database: PathBuf,
    ) -> Result<ServerUnderTest, ServerError> {
        // A bench prints its own figures: the servers log only warnings (the gate's JSON lines
        // would bury them).
        let mut child = Command::new(binary)
            .args(arguments)
            .envs(env.iter().copied())
            .env_remove("LAB_LOG")
            .env("GATE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let (address, lines) = match wait_for_listening(&mut child) {
            Ok(found) => found,
            Err(error) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(error);
            }
        };
        let (output, reader) = keep_draining(lines);
        Ok(ServerUnderTest {
            child,
            address,
            database,
            dir,
            output,
            reader: Some(reader),
        })
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time (user + system, clock ticks) the server used so far, where /proc tells it.
    pub fn cpu_ticks(&self) -> Option<u64> {
        process_cpu_ticks(self.child.id())
    }

    /// The server's peak resident set (VmHWM) in KiB, where /proc tells it.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        peak_rss_kib(self.child.id())
    }

    /// The server process's CPU time so far and the bytes it caused to be written to storage.
    pub fn usage(&self) -> Option<ProcessUsage> {
        ProcessUsage::read(self.child.id())
    }

    /// SIGTERM and wait (graceful shutdown closes the database cleanly).
    pub fn stop(mut self) -> Result<StoppedServer, ServerError> {
        terminate(&mut self.child, Duration::from_secs(15))?;
        // The process is gone, so its stdout is at its end: the reader finishes.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let output = self
            .output
            .lock()
            .map(|lines| lines.clone())
            .unwrap_or_default();
        // Move the temp dir out so the file outlives the process handle.
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir()?);
        Ok(StoppedServer {
            database: self.database.clone(),
            dir,
            output,
        })
    }
}

impl Drop for ServerUnderTest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A runtime-settings file the Development server accepts, in `dir`.
fn write_settings(dir: &Path) -> Result<PathBuf, ServerError> {
    let settings = dir.join("runtime-settings.json");
    std::fs::write(
        &settings,
        r#"{"Live":{"Label":"bench","Maximum":3,"Secret":"bench-not-a-secret"}}"#,
    )?;
    Ok(settings)
}

/// `serve` on an ephemeral loopback port, in Development, on `database`.
fn serve_arguments(
    database: &Path,
    settings: &Path,
    synchronous: Synchronous,
    clients: usize,
) -> Vec<std::ffi::OsString> {
    let mut arguments: Vec<std::ffi::OsString> = [
        "serve",
        "--urls",
        "http://127.0.0.1:0",
        "--environment",
        "Development",
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    arguments.extend(["--database".into(), database.as_os_str().to_owned()]);
    arguments.extend(["--settings".into(), settings.as_os_str().to_owned()]);
    arguments.extend(["--synchronous".into(), synchronous_flag(synchronous).into()]);
    arguments.extend(
        connection_cap_arguments(clients)
            .into_iter()
            .map(Into::into),
    );
    arguments
}

/// `--max-connections` only when the default is too small for `clients`, so that a build from
/// before the flag existed can be benched too.
fn connection_cap_arguments(clients: usize) -> Vec<String> {
    let cap = clients + 16;
    if cap > SERVER_DEFAULT_MAX_CONNECTIONS {
        vec!["--max-connections".to_owned(), cap.min(65_536).to_string()]
    } else {
        Vec::new()
    }
}

/// Reads the child's stdout up to its listening line: the address, and the rest of the lines.
fn wait_for_listening(
    child: &mut Child,
) -> Result<(String, Lines<BufReader<ChildStdout>>), ServerError> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| ServerError::Startup("no stdout".to_owned()))?;
    let mut lines = BufReader::new(stdout).lines();
    while let Some(Ok(line)) = lines.next() {
        if let Some(address) = listening_address(&line) {
            return Ok((address.to_owned(), lines));
        }
    }
    Err(ServerError::Startup(
        "the server exited before listening".to_owned(),
    ))
}

/// Keeps draining stdout so the server never blocks on a full pipe, and keeps the lines.
fn keep_draining(
    lines: Lines<BufReader<ChildStdout>>,
) -> (Arc<Mutex<Vec<String>>>, JoinHandle<()>) {
    let output = Arc::new(Mutex::new(Vec::new()));
    let sink = output.clone();
    let reader = std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if let Ok(mut sink) = sink.lock() {
                sink.push(line);
            }
        }
    });
    (output, reader)
}

/// SIGTERM, then up to `grace` for the process to end, then SIGKILL.
pub(crate) fn terminate(child: &mut Child, grace: Duration) -> std::io::Result<()> {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + grace;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.wait();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_line_gives_the_address() {
        assert_eq!(
            listening_address("Now listening on: http://127.0.0.1:5080"),
            Some("http://127.0.0.1:5080")
        );
        assert_eq!(listening_address("Database: /tmp/x.db"), None);
    }

    #[test]
    fn the_postgres_figures_line_gives_its_numbers_with_or_without_the_group_commits() {
        assert_eq!(
            PostgresFigures::parse(
                "Ordered inbox figures: 10 operations, 21 round trips, 2 retries"
            ),
            Some(PostgresFigures {
                operations: 10,
                round_trips: 21,
                retries: 2,
                ..PostgresFigures::default()
            })
        );
        assert_eq!(
            PostgresFigures::parse(
                "Ordered inbox figures: 10 operations, 4 round trips, 0 retries, 2 group commits, 10 grouped deliveries, 1 replays"
            ),
            Some(PostgresFigures {
                operations: 10,
                round_trips: 4,
                retries: 0,
                group_commits: 2,
                grouped_deliveries: 10,
                replays: 1,
            })
        );
        assert_eq!(PostgresFigures::parse("Database: x"), None);
        assert_eq!(
            PostgresFigures::parse("Ordered inbox figures: 10 operations"),
            None
        );
    }

    #[test]
    fn the_connection_cap_is_named_only_past_the_servers_default() {
        assert!(connection_cap_arguments(32).is_empty());
        assert_eq!(
            connection_cap_arguments(2_000),
            ["--max-connections", "2016"]
        );
        assert_eq!(
            connection_cap_arguments(100_000),
            ["--max-connections", "65536"]
        );
    }
}
