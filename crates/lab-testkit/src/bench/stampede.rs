//! `bench stampede`: concurrent callers parked on the cache's shared key behind the lab gate;
//! the gate opens, and exactly one factory must have run, every caller getting its generation.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde::Serialize;
use serde_json::Value;
use tokio::task::JoinSet;

use super::{BenchError, http_client, mib};
use crate::progress::Progress;
use crate::server::{ServerUnderTest, Synchronous};

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StampedeReport {
    pub callers: usize,
    pub factories: i64,
    pub generations: Vec<i64>,
    pub open_to_last_answer_ms: f64,
    pub server_peak_rss_mib: Option<f64>,
}

impl std::fmt::Display for StampedeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench stampede: {} concurrent GET /cache/shared behind a closed gate",
            self.callers
        )?;
        writeln!(
            f,
            "  factory runs: {} (generations seen: {:?})",
            self.factories, self.generations
        )?;
        writeln!(
            f,
            "  gate opened → last answer: {:.2} ms",
            self.open_to_last_answer_ms
        )?;
        match self.server_peak_rss_mib {
            Some(mib) => write!(f, "  server peak RSS: {mib:.1} MiB"),
            None => write!(f, "  server peak RSS: unknown (no /proc)"),
        }
    }
}

/// One caller's answer and when it came.
type Answer = Result<(StatusCode, Value, Instant), reqwest::Error>;

/// Parks `callers` concurrent requests on the shared key behind the closed gate, opens it, and
/// checks that exactly one factory ran and every caller got its generation.
pub async fn stampede(callers: usize) -> Result<StampedeReport, BenchError> {
    let server = ServerUnderTest::start(Synchronous::Full, callers)?;
    let address = server.address.clone();
    let client = http_client(callers, Duration::from_secs(60))?;
    expect_status(&client, &format!("{address}/lab/cache/gate/close"), 204).await?;
    let progress = Progress::start("bench stampede: answered", callers as u64, "callers");
    let waiting = park_callers(&client, &address, callers, &progress);
    wait_for_the_factory(&client, &address).await?;
    // Give the remaining callers time to connect and join the waiting factory.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let opened = Instant::now();
    expect_status(&client, &format!("{address}/lab/cache/gate/open"), 204).await?;
    let (generations, last_answer) = collect_answers(waiting, opened).await?;
    progress.finish();
    let factories = factory_runs(&client, &address).await?.unwrap_or(-1);
    let peak = server.peak_rss_kib();
    drop(server);
    if factories != 1 || generations != [1] {
        return Err(BenchError::Verification(format!(
            "expected one factory run and generation [1]; got {factories} runs, generations {generations:?}"
        )));
    }
    Ok(StampedeReport {
        callers,
        factories,
        generations,
        open_to_last_answer_ms: last_answer.duration_since(opened).as_secs_f64() * 1e3,
        server_peak_rss_mib: mib(peak),
    })
}

/// `callers` concurrent `GET /cache/shared`, each counted on `progress` when answered.
fn park_callers(
    client: &reqwest::Client,
    address: &str,
    callers: usize,
    progress: &Progress,
) -> JoinSet<Answer> {
    let mut waiting = JoinSet::new();
    for _ in 0..callers {
        let client = client.clone();
        let url = format!("{address}/cache/shared");
        let counter = progress.counter();
        waiting.spawn(async move {
            let response = client.get(url).send().await?;
            let status = response.status();
            let body: Value = response.json().await?;
            counter.add(1);
            Ok((status, body, Instant::now()))
        });
    }
    waiting
}

/// The factory runs `GET /cache/stats` counts (`None` when it has no such figure).
async fn factory_runs(client: &reqwest::Client, address: &str) -> Result<Option<i64>, BenchError> {
    let stats: Value = client
        .get(format!("{address}/cache/stats"))
        .send()
        .await?
        .json()
        .await?;
    Ok(stats["factories"].as_i64())
}

/// Waits (30 s at most) until the factory started once: the first caller is in and parked.
async fn wait_for_the_factory(client: &reqwest::Client, address: &str) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while factory_runs(client, address).await?.unwrap_or(0) < 1 {
        if Instant::now() > deadline {
            return Err(BenchError::Verification(
                "the factory never started".to_owned(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Every caller's answer must be 200: the distinct generations they got, in order of arrival,
/// and when the last answer came (`opened` if none came after it).
async fn collect_answers(
    mut waiting: JoinSet<Answer>,
    opened: Instant,
) -> Result<(Vec<i64>, Instant), BenchError> {
    let mut generations = Vec::new();
    let mut last_answer = opened;
    while let Some(joined) = waiting.join_next().await {
        let (status, body, at) = joined.map_err(|e| BenchError::task("a caller task", e))??;
        if status != StatusCode::OK {
            return Err(BenchError::Verification(format!(
                "a caller got {status} {body}"
            )));
        }
        let generation = body["generation"].as_i64().unwrap_or(-1);
        if !generations.contains(&generation) {
            generations.push(generation);
        }
        last_answer = last_answer.max(at);
    }
    Ok((generations, last_answer))
}

async fn expect_status(
    client: &reqwest::Client,
    url: &str,
    expected: u16,
) -> Result<(), BenchError> {
    let status = client.post(url).send().await?.status();
    if status.as_u16() == expected {
        Ok(())
    } else {
        Err(BenchError::Verification(format!(
            "POST {url} answered {status}, expected {expected}"
        )))
    }
}
