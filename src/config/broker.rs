//! The broker door's settings (`serve --nats …`): where the NATS server is, which stream and
//! durable consumer to use, how large a fetch is and how long an unacknowledged message waits.
//! Checked once at start-up; each refusal is one line naming the flag.

use std::net::IpAddr;
use std::time::Duration;

use super::StartupError;

/// Defaults of the `--nats-*` flags.
pub const DEFAULT_STREAM: &str = "ORDERED";
pub const DEFAULT_SUBJECT_PREFIX: &str = "ordered";
pub const DEFAULT_DURABLE: &str = "production-lab";
pub const DEFAULT_BATCH: usize = 256;
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
pub const DEFAULT_NAK_DELAY: Duration = Duration::from_secs(1);

/// Where and how to consume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Loopback `nats://HOST:PORT` URLs of one NATS server or cluster.
    pub urls: Vec<String>,
    pub stream: String,
    pub subject_prefix: String,
    /// The durable consumer's base name; with partitions, `-pK` is appended.
    pub durable: String,
    pub partitions: u32,
    pub partition: u32,
    /// The most messages one fetch (and so one commit) carries.
    pub batch: usize,
    pub ack_wait: Duration,
    /// The first back-off of a nak; it grows with each redelivery, up to 30 s.
    pub nak_delay: Duration,
}

impl BrokerConfig {
    /// The defaults for `urls` (a comma-separated list), checked to be loopback.
    pub fn new(urls: &str) -> Result<BrokerConfig, StartupError> {
        Ok(BrokerConfig {
            urls: parse_nats_urls(urls)?,
            stream: DEFAULT_STREAM.to_owned(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            durable: DEFAULT_DURABLE.to_owned(),
            partitions: 1,
            partition: 0,
            batch: DEFAULT_BATCH,
            ack_wait: DEFAULT_ACK_WAIT,
            nak_delay: DEFAULT_NAK_DELAY,
        })
    }

    /// Checks the names and the partition; each refusal is one line.
    pub fn validate(&self) -> Result<(), StartupError> {
        let bad = |reason: String| StartupError::Broker(reason);
        if self.partitions == 0 || self.partition >= self.partitions {
            return Err(bad(format!(
                "--nats-partition must be from 0 to --nats-partitions - 1 (got partition {} of {})",
                self.partition, self.partitions
            )));
        }
        let name_ok = |name: &str| {
            !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        if !name_ok(&self.stream) || !name_ok(&self.durable) {
            return Err(bad(
                "--nats-stream and --nats-durable must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'"
                    .to_owned(),
            ));
        }
        let prefix_ok = self.subject_prefix.split('.').all(|token| {
            !token.is_empty()
                && token
                    .chars()
                    .all(|c| !c.is_whitespace() && !matches!(c, '*' | '>'))
        });
        if !prefix_ok {
            return Err(bad(format!(
                "--nats-subject-prefix '{}' must be dot-separated tokens without '*', '>' or whitespace",
                self.subject_prefix
            )));
        }
        if !(1..=10_000).contains(&self.batch) {
            return Err(bad("--nats-batch must be from 1 to 10000".to_owned()));
        }
        Ok(())
    }

    /// The durable consumer's name: the base name, or `BASE-pK` for partition K.
    pub fn durable_name(&self) -> String {
        if self.partitions > 1 {
            format!("{}-p{}", self.durable, self.partition)
        } else {
            self.durable.clone()
        }
    }

    /// The partition token this consumer expects in stored subjects.
    pub fn partition_token(&self) -> Option<u32> {
        (self.partitions > 1).then_some(self.partition)
    }

    /// The stream's subjects: `PREFIX.*`, or `PREFIX.*.*` when the server maps them to partitions.
    pub fn stream_subjects(&self) -> Vec<String> {
        if self.partitions > 1 {
            vec![format!("{}.*.*", self.subject_prefix)]
        } else {
            vec![format!("{}.*", self.subject_prefix)]
        }
    }

    /// The subjects this consumer takes: its partition's, or all.
    pub fn filter_subject(&self) -> String {
        if self.partitions > 1 {
            format!("{}.{}.*", self.subject_prefix, self.partition)
        } else {
            format!("{}.*", self.subject_prefix)
        }
    }
}

/// Splits `--nats` into URLs and refuses anything but `nats://` on a loopback host.
pub fn parse_nats_urls(urls: &str) -> Result<Vec<String>, StartupError> {
    let mut parsed = Vec::new();
    for url in urls.split(',').map(str::trim) {
        let refuse = || StartupError::NatsNotLoopback(url.to_owned());
        let authority = url.strip_prefix("nats://").ok_or_else(|| {
            StartupError::Broker(format!("--nats '{url}' must be nats://HOST:PORT"))
        })?;
        let authority = authority.strip_suffix('/').unwrap_or(authority);
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let (host, after) = bracketed.split_once(']').ok_or_else(refuse)?;
            (host, after.strip_prefix(':').unwrap_or(""))
        } else {
            authority.rsplit_once(':').ok_or_else(|| {
                StartupError::Broker(format!("--nats '{url}' must be nats://HOST:PORT"))
            })?
        };
        if port.parse::<u16>().map_or(true, |port| port == 0) {
            return Err(StartupError::Broker(format!(
                "--nats '{url}': the port must be a number from 1 to 65535"
            )));
        }
        let loopback = host.eq_ignore_ascii_case("localhost")
            || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        if !loopback {
            return Err(refuse());
        }
        parsed.push(url.to_owned());
    }
    Ok(parsed)
}
