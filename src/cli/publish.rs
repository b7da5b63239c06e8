//! `production-lab publish`: one ordered message to NATS JetStream on the broker door's wire
//! format, waiting for its PubAck.

use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub struct PublishArgs {
    /// Loopback nats://HOST:PORT[,…].
    #[arg(long, value_name = "URLS", default_value = "nats://127.0.0.1:4222")]
    pub nats: String,
    #[arg(long, default_value = production_lab::broker::DEFAULT_SUBJECT_PREFIX)]
    pub subject_prefix: String,
    pub aggregate_id: String,
    pub message_id: String,
    #[arg(allow_negative_numbers = true)]
    pub sequence: i64,
    #[arg(allow_negative_numbers = true)]
    pub amount: i64,
    /// Publish as this registered producer (with --epoch and the token in
    /// PRODUCTION_LAB_PRODUCER_TOKEN): Authorization and Producer-Epoch headers, and
    /// Nats-Msg-Id PRODUCER/MESSAGE_ID.
    #[arg(long, value_name = "NAME", requires = "epoch")]
    pub producer: Option<String>,
    /// The epoch POST /producers/session answered.
    #[arg(long, value_name = "N", requires = "producer")]
    pub epoch: Option<i64>,
    /// The producer's token; from the environment only, so that it stays out of `ps`.
    #[arg(
        long = "token",
        env = "PRODUCTION_LAB_PRODUCER_TOKEN",
        hide_env_values = true,
        hide = true
    )]
    pub token: Option<String>,
}

pub fn run(args: PublishArgs) -> anyhow::Result<()> {
    let message = production_lab::inbox::ledger::message(
        args.message_id,
        args.aggregate_id,
        args.sequence,
        args.amount,
    );
    let producer = match (args.producer, args.epoch) {
        (Some(producer), Some(epoch)) => Some(production_lab::broker::ProducerHeaders {
            producer,
            epoch,
            token: args.token.context(
                "--producer needs the producer's token in PRODUCTION_LAB_PRODUCER_TOKEN",
            )?,
        }),
        _ => None,
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let published = runtime.block_on(production_lab::broker::publish_one(
        &args.nats,
        &args.subject_prefix,
        &message,
        producer.as_ref(),
    ))?;
    println!(
        "{} -> stream {} sequence {}{}",
        published.subject,
        published.stream,
        published.stream_sequence,
        if published.duplicate {
            " (duplicate: dropped by the duplicate window)"
        } else {
            ""
        }
    );
    Ok(())
}
