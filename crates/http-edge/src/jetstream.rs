//! The JetStream door's server side: the library's consumer ([`ordered_inbox::jetstream`], which
//! acks after the COMMIT) with how a server connects to NATS (TLS, credentials, reconnects), the
//! lab's loopback rule for its URLs, and its refusals as [`StartupError`]s.

use std::net::IpAddr;
use std::time::Duration;

pub use ordered_inbox::jetstream::*;

use crate::startup::StartupError;

impl From<StartError> for StartupError {
    fn from(error: StartError) -> Self {
        StartupError::Broker(error.0)
    }
}

/// The defaults for `urls` (a comma-separated list), checked to be loopback (`serve`'s rule).
pub fn loopback_config(urls: &str) -> Result<BrokerConfig, StartupError> {
    Ok(BrokerConfig::with_checked_urls(parse_nats_urls(urls)?))
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

/// The server addresses of checked NATS URLs (see [`parse_nats_urls`]).
pub fn server_addresses(
    urls: &[String],
) -> Result<Vec<async_nats::ServerAddr>, <async_nats::ServerAddr as std::str::FromStr>::Err> {
    urls.iter().map(|url| url.parse()).collect()
}

/// How a long-lived client of this binary (the consumer, a relay) connects to NATS: named, a
/// 3 s connection timeout, and reconnecting for ever, 100 ms more between attempts up to 1 s.
pub fn reconnecting_client(name: String) -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(3))
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((attempts as u64).saturating_mul(100).min(1_000))
        })
}

/// Doubling from 100 ms up to 5 s between reconnect attempts: a server that blinked is back
/// within a second, one that stays away (another host, a network between) is not hammered.
pub fn reconnect_backoff(attempts: usize) -> Duration {
    let doublings = attempts.saturating_sub(1).min(6) as u32;
    Duration::from_millis(100u64 << doublings).min(Duration::from_secs(5))
}

/// Why a NATS client could not connect, sorted so that a caller can name the setting at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NatsConnectError {
    /// The server's certificate was refused, or the TLS files could not be used.
    #[error("{0}")]
    Certificate(String),
    /// The credential could not be read, or the server refused it.
    #[error("{0}")]
    Credentials(String),
    #[error("{0}")]
    Other(String),
}

/// `options` with `access`'s TLS (required, with its CA and client certificate) and credential.
pub async fn with_access(
    options: async_nats::ConnectOptions,
    access: &NatsAccess,
) -> Result<async_nats::ConnectOptions, NatsConnectError> {
    let options = match &access.tls {
        None => options,
        Some(tls) => {
            let options = options
                .require_tls(true)
                .add_root_certificates(tls.ca.clone());
            match &tls.client {
                Some((certificate, key)) => {
                    options.add_client_certificate(certificate.clone(), key.clone())
                }
                None => options,
            }
        }
    };
    Ok(match &access.auth {
        None => options,
        Some(NatsAuth::CredsFile(path)) => {
            options.credentials_file(path).await.map_err(|error| {
                NatsConnectError::Credentials(format!("cannot read {}: {error}", path.display()))
            })?
        }
        Some(NatsAuth::NkeySeed(seed)) => options.nkey(seed.clone()),
        Some(NatsAuth::UserPassword { user, password }) => {
            options.user_and_password(user.clone(), password.clone())
        }
        Some(NatsAuth::Token(token)) => options.token(token.clone()),
    })
}

/// A client named `name` of `urls` with `access`'s TLS and credential, reconnecting for ever
/// with `reconnect_backoff`. Only the first connection must succeed at once.
pub async fn connect_client(
    name: String,
    urls: &[String],
    access: &NatsAccess,
) -> Result<async_nats::Client, NatsConnectError> {
    let addresses = server_addresses(urls)
        .map_err(|error| NatsConnectError::Other(format!("invalid address: {error}")))?;
    let options = reconnecting_client(name).reconnect_delay_callback(reconnect_backoff);
    with_access(options, access)
        .await?
        .connect(addresses)
        .await
        .map_err(sort_connect_error)
}

/// The refusal of a first connection, with its causes, sorted by what it is about.
fn sort_connect_error(error: async_nats::ConnectError) -> NatsConnectError {
    let mut text = error.to_string();
    let mut refused_certificate = false;
    let mut cause = std::error::Error::source(&error);
    while let Some(current) = cause {
        let shown = current.to_string();
        if !text.contains(&shown) {
            text = format!("{text}: {shown}");
        }
        let tls = current.downcast_ref::<rustls::Error>().or_else(|| {
            current
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        refused_certificate |= matches!(
            tls,
            Some(rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented)
        );
        cause = current.source();
    }
    match error.kind() {
        async_nats::ConnectErrorKind::AuthorizationViolation
        | async_nats::ConnectErrorKind::Authentication => NatsConnectError::Credentials(text),
        async_nats::ConnectErrorKind::Tls => NatsConnectError::Certificate(text),
        _ if refused_certificate => NatsConnectError::Certificate(text),
        _ => NatsConnectError::Other(text),
    }
}

/// Connects, creates the stream and the durable consumer if missing, and checks that an
/// existing stream takes this consumer's subjects. Every refusal is one line.
pub async fn connect_consumer(
    config: BrokerConfig,
    lab: ConsumerStatus,
    body: BodyReader,
) -> Result<Consumer, StartupError> {
    config.validate()?;
    let refuse = |what: &str, error: &dyn std::fmt::Display| {
        StartupError::Broker(format!(
            "NATS at {}: {what}: {error}",
            config.urls.join(",")
        ))
    };
    let addresses =
        server_addresses(&config.urls).map_err(|error| refuse("invalid address", &error))?;
    let client = with_access(
        reconnecting_client("production-lab".to_owned()),
        &config.access,
    )
    .await
    .map_err(|error| refuse("cannot connect", &error))?
    .connect(addresses)
    .await
    .map_err(|error| refuse("cannot connect", &error))?;
    Ok(Consumer::with_client(config, lab, client, body).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_nats_urls_are_accepted() {
        assert_eq!(
            parse_nats_urls("nats://127.0.0.1:4222,nats://localhost:4223").unwrap(),
            ["nats://127.0.0.1:4222", "nats://localhost:4223"]
        );
        assert!(parse_nats_urls("nats://[::1]:4222").is_ok());
        for url in [
            "nats://10.0.0.1:4222",
            "nats://demo.nats.io:4222",
            "nats://127.0.0.1:4222,nats://0.0.0.0:4222",
        ] {
            assert!(
                matches!(parse_nats_urls(url), Err(StartupError::NatsNotLoopback(_))),
                "{url}"
            );
        }
        for url in ["127.0.0.1:4222", "nats://127.0.0.1", "nats://127.0.0.1:0"] {
            assert!(
                matches!(parse_nats_urls(url), Err(StartupError::Broker(_))),
                "{url}"
            );
        }
    }

    #[test]
    fn reconnects_wait_twice_as_long_each_time_up_to_five_seconds() {
        let waits: Vec<u64> = [1, 2, 3, 4, 6, 7, 100, usize::MAX]
            .into_iter()
            .map(|attempts| reconnect_backoff(attempts).as_millis() as u64)
            .collect();
        assert_eq!(waits, [100, 200, 400, 800, 3200, 5000, 5000, 5000]);
    }
}
