//! The campaign's services as processes it can pause, kill and start again: the gates (this
//! binary's `gate` subcommand on their hosts), the NATS nodes, PostgreSQL.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::netns::{Host, Topology};
use crate::server::listening_address;

use super::ChaosError;
use super::topology::{GateFiles, gate_command};

/// How long a gate may take from its start to its listening line.
const GATE_START: Duration = Duration::from_secs(60);

/// A gate on its host: started, killed and started again on the same files.
pub struct GateNode {
    pub host: Host,
    program: PathBuf,
    pub files: GateFiles,
    /// Extra environment (a planted bug).
    env: Vec<(String, String)>,
    child: Option<Child>,
    /// `https://ADDRESS:8443`, once it listened.
    pub url: String,
}

impl GateNode {
    pub fn new(
        host: Host,
        program: PathBuf,
        files: GateFiles,
        env: Vec<(String, String)>,
    ) -> GateNode {
        GateNode {
            host,
            program,
            files,
            env,
            child: None,
            url: String::new(),
        }
    }

    /// Starts the gate and waits for its listening line; its standard error goes to its log.
    pub fn start(&mut self, topology: &Topology) -> Result<(), ChaosError> {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.files.log())?;
        let mut command: Command = gate_command(topology, &self.host, &self.program, &self.files);
        command.envs(self.env.iter().map(|(key, value)| (key, value)));
        let mut child = command
            .arg("gate")
            .arg("--config")
            .arg(&self.files.config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| ChaosError::Setup("the gate's stdout".to_owned()))?;
        let (listening, heard) = mpsc::channel();
        // Reads every line for the gate's whole life, so that it never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(address) = listening_address(&line) {
                    let _ = listening.send(address.to_owned());
                }
            }
        });
        self.child = Some(child);
        match heard.recv_timeout(GATE_START) {
            Ok(address) => {
                self.url = address;
                Ok(())
            }
            Err(_) => {
                self.kill();
                let log = std::fs::read_to_string(self.files.log()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                Err(ChaosError::Setup(format!(
                    "the gate on {} did not listen: {}",
                    self.host.namespace,
                    tail.join(" | ")
                )))
            }
        }
    }

    /// Kills the gate at once (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is there (not killed, not exited).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| child.try_wait().ok().flatten().is_none())
    }
}

impl Drop for GateNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to `pids`.
pub fn signal(pids: &[u32], signal: &str) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .args(pids.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
