//! A server's connection limits and their flags' parsers, and the inbox's default bounds, shared
//! by both products' configuration.

use std::time::Duration;

/// How long a client may take and how many connections it may hold open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// From accept (or the first byte after an idle pause) until the request head is complete.
    pub header_read_timeout: Duration,
    /// From the request head until the whole body has arrived.
    pub body_read_timeout: Duration,
    /// How long a connection may wait between a response and the next request.
    pub keep_alive_timeout: Duration,
    /// Open connections at most; keep it below the process's open-file limit (`ulimit -n`).
    pub max_connections: usize,
    /// Bytes of request bodies all connections together may be receiving at once; past it a new
    /// body waits briefly for room, then answers 503.
    pub request_body_budget: usize,
}

pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// The largest request body any route reads; a larger one answers 413.
pub const MAX_REQUEST_BODY_BYTES: usize = 2 * MIB;
/// 64 MiB: 32 bodies of the largest size at once.
pub const DEFAULT_REQUEST_BODY_BUDGET: usize = 64 * MIB;
/// The largest body budget `serve` accepts.
const MAX_REQUEST_BODY_BUDGET: usize = 64 * 1024 * MIB;
const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// The longest timeout `serve` accepts.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            keep_alive_timeout: DEFAULT_KEEP_ALIVE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            request_body_budget: DEFAULT_REQUEST_BODY_BUDGET,
        }
    }
}

/// A timeout flag: `500ms`, `10s`, or a bare number of seconds; from 1 ms to one hour.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1000)
    } else {
        (text, 1000)
    };
    let duration = number
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|value| value.checked_mul(unit))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("'{text}' is not a duration such as 500ms, 10s or 10"))?;
    if duration.is_zero() || duration > MAX_TIMEOUT {
        return Err(format!("'{text}' must be from 1ms to 3600s"));
    }
    Ok(duration)
}

/// The connection cap flag: 1 to 65536.
pub fn parse_max_connections(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(value) if (1..=65_536).contains(&value) => Ok(value),
        _ => Err(format!("'{text}' must be a whole number from 1 to 65536")),
    }
}

/// The request-body budget flag: bytes, or a number with `KiB`, `MiB` or `GiB`; from the largest
/// request body (so that one always fits) to 64 GiB.
pub fn parse_request_body_budget(text: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let (number, unit) = [("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)]
        .into_iter()
        .find_map(|(suffix, unit)| trimmed.strip_suffix(suffix).map(|number| (number, unit)))
        .unwrap_or((trimmed, 1));
    let lowest = MAX_REQUEST_BODY_BYTES;
    match number
        .trim()
        .parse::<usize>()
        .ok()
        .and_then(|value| value.checked_mul(unit))
    {
        Some(bytes) if (lowest..=MAX_REQUEST_BODY_BUDGET).contains(&bytes) => Ok(bytes),
        _ => Err(format!(
            "'{text}' must be a size such as 64MiB, 512KiB or 67108864 (bytes), from 2MiB to 64GiB"
        )),
    }
}

/// The default of `--max-open-dead-letters`.
pub const DEFAULT_MAX_OPEN_DEAD_LETTERS: u32 = 1000;
/// The default of `--max-held-per-aggregate`.
pub const DEFAULT_MAX_HELD_PER_AGGREGATE: u32 = 1000;
