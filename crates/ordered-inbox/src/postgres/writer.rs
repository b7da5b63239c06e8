//! The group commit on PostgreSQL: every delivery of a server (the doors' `deliver_as`, a
//! broker's `deliver_batch`, `deliver`) is a job on one bounded queue, and the writer task
//! ([`WRITERS`]) takes every job waiting (up to [`GROUP_CAP`] deliveries; a job is never split)
//! into one transaction (`batch`), and answers each job only after its COMMIT.
//!
//! A group that PostgreSQL asks to retry (a deadlock, a serialization failure, a unique
//! violation, a pooled connection found closed before COMMIT) is attempted again whole, at most
//! [`ATTEMPTS`] times with a short random pause; one that the handler's applies or a refused
//! value abandon is rolled back and replayed one delivery at a time in savepoints, in the same
//! attempt. A database that cannot be reached answers every delivery of the group
//! [`InboxError::Unavailable`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::batch::{self, Answer, Delivery, Means};
use super::connection::{ATTEMPTS, Client, Counters, Failure, release_after_failure};
use super::handler::PostgresHandler;
use crate::error::InboxError;
use crate::model::Limits;

/// Deliveries one transaction takes at most (a larger job is taken alone).
pub const GROUP_CAP: usize = 256;
/// Writer tasks per inbox: one, so that every delivery waiting goes into one group. A group
/// costs PostgreSQL about as much CPU again as eight of its deliveries (its statements, BEGIN
/// and COMMIT), so larger groups are cheaper per delivery: in `bench ordered --backend
/// postgres`, one writer per server kept one server's throughput at about three quarters of
/// PostgreSQL's CPU per message, and gave two servers (whose groups two writers each halved)
/// 1.3× their throughput; two writers taking turns to form groups (one forming while the other
/// commits) did no better than two free ones. Several servers on one database are several
/// writers.
pub const WRITERS: usize = 1;
/// Jobs waiting at most; a caller beyond it waits for room.
const QUEUE: usize = 4096;

/// Deliveries submitted together, and where their answers go.
struct Job {
    deliveries: Vec<Delivery>,
    reply: oneshot::Sender<Result<Vec<Answer>, InboxError>>,
}

/// The queue in front of the writer tasks; they stop when it is dropped.
pub(super) struct Writer {
    queue: mpsc::Sender<Job>,
}

/// What the writer tasks share with the inbox.
#[derive(Clone)]
pub(super) struct Resources {
    pub pool: Pool,
    pub counters: Arc<Counters>,
    pub handler: Arc<dyn PostgresHandler>,
    pub limits: Limits,
}

impl Writer {
    /// Starts the writer tasks on the current runtime.
    pub(super) fn start(resources: Resources) -> Writer {
        let (queue, jobs) = mpsc::channel(QUEUE);
        let jobs = Arc::new(Mutex::new(jobs));
        for _ in 0..WRITERS {
            tokio::spawn(write_groups(jobs.clone(), resources.clone()));
        }
        Writer { queue }
    }

    /// Decides and records `deliveries` in order, in a group commit with whatever else is
    /// waiting: one answer per delivery, after the COMMIT.
    pub(super) async fn submit(
        &self,
        deliveries: Vec<Delivery>,
    ) -> Result<Vec<Answer>, InboxError> {
        let stopped = || InboxError::Unavailable("the inbox's writer stopped".into());
        let (reply, answers) = oneshot::channel();
        self.queue
            .send(Job { deliveries, reply })
            .await
            .map_err(|_| stopped())?;
        answers.await.map_err(|_| stopped())?
    }
}

/// One writer task: takes every job waiting into a group, commits it, answers, until the queue
/// closes.
async fn write_groups(jobs: Arc<Mutex<mpsc::Receiver<Job>>>, resources: Resources) {
    while let Some(group) = next_group(&jobs).await {
        let (deliveries, replies): (Vec<Vec<Delivery>>, Vec<_>) = group
            .into_iter()
            .map(|job| (job.deliveries, job.reply))
            .unzip();
        let sizes: Vec<usize> = deliveries.iter().map(Vec::len).collect();
        let deliveries: Vec<Delivery> = deliveries.into_iter().flatten().collect();
        let answered = commit_group(&resources, &deliveries).await;
        answer(replies, &sizes, answered);
    }
}

/// The next job, and every job already waiting behind it up to [`GROUP_CAP`] deliveries; `None`
/// once the queue is closed and empty.
async fn next_group(jobs: &Mutex<mpsc::Receiver<Job>>) -> Option<Vec<Job>> {
    let mut jobs = jobs.lock().await;
    let first = jobs.recv().await?;
    let mut taken = first.deliveries.len();
    let mut group = vec![first];
    while taken < GROUP_CAP {
        let Ok(job) = jobs.try_recv() else { break };
        taken += job.deliveries.len();
        group.push(job);
    }
    Some(group)
}

/// Each job its own answers, in order (a caller that went away is not waited for).
fn answer(
    replies: Vec<oneshot::Sender<Result<Vec<Answer>, InboxError>>>,
    sizes: &[usize],
    answered: Result<Vec<Answer>, InboxError>,
) {
    match answered {
        Ok(answers) => {
            let mut answers = answers.into_iter();
            for (reply, size) in replies.into_iter().zip(sizes) {
                let _ = reply.send(Ok(answers.by_ref().take(*size).collect()));
            }
        }
        Err(error) => {
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}

/// The group's transaction on a pooled connection, attempted again while PostgreSQL asks for
/// it.
async fn commit_group(
    resources: &Resources,
    deliveries: &[Delivery],
) -> Result<Vec<Answer>, InboxError> {
    let counters = resources.counters.as_ref();
    let count = u64::try_from(deliveries.len()).unwrap_or(u64::MAX);
    counters.operations.fetch_add(count, Ordering::Relaxed);
    let mut attempt = 1;
    loop {
        let failure = match resources.pool.get().await.map_err(Failure::Pool) {
            Ok(client) => match attempt_group(&client, resources, deliveries).await {
                Ok(answers) => {
                    counters.group_commits.fetch_add(1, Ordering::Relaxed);
                    counters
                        .grouped_deliveries
                        .fetch_add(count, Ordering::Relaxed);
                    return Ok(answers);
                }
                Err(failure) => {
                    release_after_failure(client).await;
                    failure
                }
            },
            Err(failure) => failure,
        };
        if attempt >= ATTEMPTS || !failure.retryable() {
            return Err(failure.into_inbox_error());
        }
        counters.retries.fetch_add(1, Ordering::Relaxed);
        attempt += 1;
        // As for a single operation: a short random pause, growing with the attempts, so that
        // the groups that collided do not collide again in lock step.
        let ceiling = 2u64 << attempt.min(6);
        tokio::time::sleep(Duration::from_millis(rand::random_range(1..=ceiling))).await;
    }
}

/// The group at once, or, when its attempt is abandoned, rolled back and replayed one delivery
/// at a time.
async fn attempt_group(
    client: &Client,
    resources: &Resources,
    deliveries: &[Delivery],
) -> Result<Vec<Answer>, Failure> {
    let means = Means {
        client,
        counters: resources.counters.as_ref(),
        handler: resources.handler.as_ref(),
        limits: &resources.limits,
    };
    match batch::attempt(means, deliveries).await {
        Ok(Some(answers)) => return Ok(answers),
        Ok(None) => {}
        Err(failure) if failure.concerns_one_unit() => {}
        Err(failure) => return Err(failure),
    }
    client.batch_execute("ROLLBACK").await?;
    means.counters.trip();
    means.counters.replays.fetch_add(1, Ordering::Relaxed);
    batch::replay(means, deliveries).await
}
