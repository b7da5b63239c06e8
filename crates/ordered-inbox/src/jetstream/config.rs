//! The broker door's settings (`serve --nats …`): where the NATS server is, which stream and
//! durable consumer to use, how large a fetch is and how long an unacknowledged message waits.
//! Checked once at start-up; each refusal is one line naming the flag.

use std::path::PathBuf;
use std::time::Duration;

/// Why a consumer could not start: one line that names what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StartError(pub String);

/// Defaults of the `--nats-*` flags.
pub const DEFAULT_STREAM: &str = "ORDERED";
/// The subjects' first token: `ordered.<aggregate>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "ordered";
/// The durable consumer's base name.
pub const DEFAULT_DURABLE: &str = "production-lab";
/// The most messages one fetch carries.
pub const DEFAULT_BATCH: usize = 256;
/// How long JetStream waits for an answer before it delivers a message again.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// The first back-off of a nak.
pub const DEFAULT_NAK_DELAY: Duration = Duration::from_secs(1);
/// How often the gap notices of waiting aggregates are published again.
pub const DEFAULT_GAP_NOTICE_INTERVAL: Duration = Duration::from_secs(30);
/// The most gap notices one tick publishes.
pub const DEFAULT_GAP_NOTICES_PER_TICK: usize = 100;

/// The first token of every gap notice's subject, `gaps.PREFIX.AGGREGATE`: a root of its own, so
/// that a notice never falls into the stream of the messages (`PREFIX.*`, or `PREFIX.*.*` with
/// partitions) whatever the prefix (see [`BrokerConfig::validate`] for the one prefix that would).
pub const GAP_SUBJECT_ROOT: &str = "gaps";

/// The subject prefix of the gap notices about the messages published under `subject_prefix`.
pub fn gap_subject_prefix(subject_prefix: &str) -> String {
    format!("{GAP_SUBJECT_ROOT}.{subject_prefix}")
}

/// Where and how to consume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Loopback `nats://HOST:PORT` URLs of one NATS server or cluster.
    pub urls: Vec<String>,
    /// The JetStream stream's name.
    pub stream: String,
    /// The subjects' first token.
    pub subject_prefix: String,
    /// The durable consumer's base name; with partitions, `-pK` is appended.
    pub durable: String,
    /// How many partitions the subjects are mapped into (1: none).
    pub partitions: u32,
    /// This consumer's partition, from 0.
    pub partition: u32,
    /// The most messages one fetch (and so one commit) carries.
    pub batch: usize,
    /// How long JetStream waits for an answer before it delivers a message again.
    pub ack_wait: Duration,
    /// The first back-off of a nak; it grows with each redelivery, up to 30 s.
    pub nak_delay: Duration,
    /// How often the gap notices of the aggregates still waiting are published again.
    pub gap_notice_interval: Duration,
    /// The most gap notices one tick of that timer (or one batch) publishes.
    pub gap_notices_per_tick: usize,
    /// TLS and credentials (the gate's `[nats.tls]` and `[nats.auth]`); none for `serve`.
    pub access: NatsAccess,
}

/// How a client proves the server and itself: TLS with a CA (and a client certificate), and one
/// kind of credential. `Debug` hides the secrets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAccess {
    /// TLS to the server, if any.
    pub tls: Option<NatsTls>,
    /// The client's credential, if any.
    pub auth: Option<NatsAuth>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// TLS to a NATS server: its CA and an optional client certificate.
pub struct NatsTls {
    /// The CA file (PEM) the server's certificate must chain to.
    pub ca: PathBuf,
    /// A client certificate and its key (PEM), for a server that asks for one (mTLS).
    pub client: Option<(PathBuf, PathBuf)>,
}

/// One kind of NATS credential.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    /// A `.creds` file: a user JWT and its nkey seed.
    CredsFile(PathBuf),
    /// A user nkey's seed (`SU…`).
    NkeySeed(String),
    /// A user and a password.
    UserPassword {
        /// The user's name.
        user: String,
        /// The password.
        password: String,
    },
    /// A token.
    Token(String),
}

impl NatsAuth {
    /// The configuration key a refusal of this credential is about.
    pub fn key(&self) -> &'static str {
        match self {
            NatsAuth::CredsFile(_) => "nats.auth.creds_file",
            NatsAuth::NkeySeed(_) => "nats.auth.nkey_seed_file",
            NatsAuth::UserPassword { .. } => "nats.auth.password_env",
            NatsAuth::Token(_) => "nats.auth.token_env",
        }
    }
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::CredsFile(path) => f.debug_tuple("CredsFile").field(path).finish(),
            NatsAuth::NkeySeed(_) => f.write_str("NkeySeed(…)"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"…")
                .finish(),
            NatsAuth::Token(_) => f.write_str("Token(…)"),
        }
    }
}

impl BrokerConfig {
    /// The defaults for URLs its caller has already checked by its own rule (the gate's
    /// configuration allows any host).
    pub fn with_checked_urls(urls: Vec<String>) -> BrokerConfig {
        BrokerConfig {
            urls,
            stream: DEFAULT_STREAM.to_owned(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            durable: DEFAULT_DURABLE.to_owned(),
            partitions: 1,
            partition: 0,
            batch: DEFAULT_BATCH,
            ack_wait: DEFAULT_ACK_WAIT,
            nak_delay: DEFAULT_NAK_DELAY,
            gap_notice_interval: DEFAULT_GAP_NOTICE_INTERVAL,
            gap_notices_per_tick: DEFAULT_GAP_NOTICES_PER_TICK,
            access: NatsAccess::default(),
        }
    }

    /// Checks the names and the partition; each refusal is one line.
    pub fn validate(&self) -> Result<(), StartError> {
        let bad = |reason: String| StartError(reason);
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
        self.validate_gap_notices()
    }

    /// The notices' timer and their subjects, which must stay out of the stream.
    fn validate_gap_notices(&self) -> Result<(), StartError> {
        let bad = |reason: String| StartError(reason);
        if !(Duration::from_millis(100)..=Duration::from_secs(3600))
            .contains(&self.gap_notice_interval)
        {
            return Err(bad(
                "--nats-gap-notice-interval-ms must be from 100 to 3600000".to_owned(),
            ));
        }
        if !(1..=10_000).contains(&self.gap_notices_per_tick) {
            return Err(bad(
                "--nats-gap-notices-per-tick must be from 1 to 10000".to_owned()
            ));
        }
        let notice = format!("{}.x", gap_subject_prefix(&self.subject_prefix));
        if let Some(taken) = self
            .stream_subjects()
            .into_iter()
            .find(|subject| subject_matches(subject, &notice))
        {
            return Err(bad(format!(
                "--nats-subject-prefix '{}': the gap notices' subject '{notice}' would be stored in the stream's '{taken}'",
                self.subject_prefix
            )));
        }
        Ok(())
    }

    /// The subject of the gap notices about one aggregate's messages is
    /// `gaps.PREFIX.AGGREGATE_TOKEN`; this is its prefix.
    pub fn gap_subject_prefix(&self) -> String {
        gap_subject_prefix(&self.subject_prefix)
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

/// Whether `subject` matches the stream subject `pattern` (tokens, `*` any one token, `>` the
/// rest).
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in pattern.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            (_, None) => return false,
            ("*", Some(_)) => {}
            (literal, Some(given)) if literal == given => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gap_notices_stay_out_of_the_stream_of_the_messages() {
        let mut config = BrokerConfig::with_checked_urls(vec!["nats://127.0.0.1:4222".to_owned()]);
        assert_eq!(config.gap_subject_prefix(), "gaps.ordered");
        assert!(config.validate().is_ok());
        config.partitions = 2;
        assert!(config.validate().is_ok());
        // The one prefix whose partitioned stream, PREFIX.*.*, would take gaps.PREFIX.X.
        config.subject_prefix = "gaps".to_owned();
        let refused = config.validate().unwrap_err().to_string();
        assert!(refused.contains("gaps.gaps.x"), "{refused}");
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(!subject_matches("a.*.*", "a.b"));
    }
}
