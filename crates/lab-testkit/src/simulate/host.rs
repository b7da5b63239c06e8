//! The inbox in a child process, so that a crash is a real SIGKILL: the child serves one JSON
//! request per line on its standard input and answers one JSON line on its standard output.
//! `production-lab simulate --host BACKEND` (and the `sim-host` binary of the tests) run
//! [`serve`]; [`Hosted`] starts, drives, kills and restarts it.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command as Process};

use super::history::CrashPoint;
use super::model::{Stored, Verdict};
use super::system::{Backend, Command, Direct};

/// The line the child prints once its inbox is open.
const READY: &str = "ready";
/// Bounds every wait for the child: a start, one answer.
const PATIENCE: Duration = Duration::from_secs(60);

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Run(Command),
    Stored(String),
    Epochs(Vec<String>),
}

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Verdicts(Vec<Verdict>),
    Stored(Stored),
    Epochs(Vec<i64>),
    Error(String),
}

/// Serves the inbox on `backend` (JSON, as [`Hosted`] passes it) until standard input closes.
pub async fn serve(backend: &str) -> Result<(), String> {
    let backend: Backend = serde_json::from_str(backend).map_err(|e| e.to_string())?;
    let mut direct = Direct::open(&backend).await?;
    let mut stdout = tokio::io::stdout();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    write_line(&mut stdout, READY).await?;
    while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Run(command)) => match direct.run(&command).await {
                Ok(verdicts) => Response::Verdicts(verdicts),
                Err(error) => Response::Error(error),
            },
            Ok(Request::Stored(aggregate_id)) => match direct.stored(&aggregate_id).await {
                Ok(stored) => Response::Stored(stored),
                Err(error) => Response::Error(error),
            },
            Ok(Request::Epochs(producers)) => match direct.epochs(&producers).await {
                Ok(epochs) => Response::Epochs(epochs),
                Err(error) => Response::Error(error),
            },
            Err(error) => Response::Error(format!("not a request: {error}")),
        };
        let text = serde_json::to_string(&response).map_err(|e| e.to_string())?;
        write_line(&mut stdout, &text).await?;
    }
    direct.close().await;
    Ok(())
}

async fn write_line(stdout: &mut tokio::io::Stdout, line: &str) -> Result<(), String> {
    stdout
        .write_all(format!("{line}\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    stdout.flush().await.map_err(|e| e.to_string())
}

/// How to start the host: a program and the arguments before the backend's JSON.
#[derive(Debug, Clone)]
pub struct HostProgram {
    pub program: PathBuf,
    pub arguments: Vec<String>,
}

/// The inbox in a child process.
pub struct Hosted {
    host: HostProgram,
    backend: Backend,
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Hosted {
    pub async fn start(host: &HostProgram, backend: &Backend) -> Result<Hosted, String> {
        let json = serde_json::to_string(backend).map_err(|e| e.to_string())?;
        let mut child = Process::new(&host.program)
            .args(&host.arguments)
            .arg(json)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", host.program.display()))?;
        let stdin = child.stdin.take().ok_or("the host has no stdin")?;
        let stdout = child.stdout.take().ok_or("the host has no stdout")?;
        let mut hosted = Hosted {
            host: host.clone(),
            backend: backend.clone(),
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        };
        let first = hosted.read_line().await?;
        if first != READY {
            return Err(format!("the host said {first:?} instead of {READY:?}"));
        }
        Ok(hosted)
    }

    pub async fn run(&mut self, command: &Command) -> Result<Vec<Verdict>, String> {
        self.send(&Request::Run(command.clone())).await?;
        match self.receive().await? {
            Response::Verdicts(verdicts) => Ok(verdicts),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    pub async fn stored(&mut self, aggregate_id: &str) -> Result<Stored, String> {
        self.send(&Request::Stored(aggregate_id.to_owned())).await?;
        match self.receive().await? {
            Response::Stored(stored) => Ok(stored),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    pub async fn epochs(&mut self, producers: &[String]) -> Result<Vec<i64>, String> {
        self.send(&Request::Epochs(producers.to_vec())).await?;
        match self.receive().await? {
            Response::Epochs(epochs) => Ok(epochs),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    /// Runs `command` with the child killed at `point`, then starts it again on the same
    /// store. The verdicts are the ones answered before the kill (`After` only).
    pub async fn crash(
        &mut self,
        command: &Command,
        point: CrashPoint,
    ) -> Result<Option<Vec<Verdict>>, String> {
        let answered = match point {
            CrashPoint::Before => None,
            CrashPoint::During { after_micros } => {
                self.send(&Request::Run(command.clone())).await?;
                tokio::time::sleep(Duration::from_micros(u64::from(after_micros))).await;
                None
            }
            CrashPoint::After => Some(self.run(command).await?),
        };
        self.child.start_kill().map_err(|e| e.to_string())?;
        self.child.wait().await.map_err(|e| e.to_string())?;
        *self = Hosted::start(&self.host, &self.backend).await?;
        Ok(answered)
    }

    /// Closes the child's input and waits for it to stop.
    pub async fn stop(mut self) -> Result<(), String> {
        drop(self.stdin);
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .map_err(|_| "the host did not stop".to_owned())?
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    async fn send(&mut self, request: &Request) -> Result<(), String> {
        let mut text = serde_json::to_string(request).map_err(|e| e.to_string())?;
        text.push('\n');
        self.stdin
            .write_all(text.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        self.stdin.flush().await.map_err(|e| e.to_string())
    }

    async fn receive(&mut self) -> Result<Response, String> {
        let line = self.read_line().await?;
        match serde_json::from_str(&line).map_err(|e| e.to_string())? {
            Response::Error(error) => Err(error),
            response => Ok(response),
        }
    }

    async fn read_line(&mut self) -> Result<String, String> {
        match tokio::time::timeout(PATIENCE, self.lines.next_line()).await {
            Ok(Ok(Some(line))) => Ok(line),
            Ok(Ok(None)) => Err("the host closed its output".to_owned()),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("the host did not answer in time".to_owned()),
        }
    }
}
