//! Timestamps as the rows store them: RFC 3339 UTC with milliseconds
//! (`2025-01-31T09:30:00.125Z`). Fixed width, so text order is time order, and both SQLite's
//! `julianday()` and PostgreSQL's `timestamptz` read them.

use jiff::Timestamp;

/// The current time as stored in the rows.
pub fn now() -> String {
    format_timestamp(Timestamp::now())
}

/// Formats milliseconds since the Unix epoch; out-of-range values clamp to jiff's range.
pub fn format_millis(millis: i64) -> String {
    let instant = Timestamp::from_millisecond(millis).unwrap_or(if millis < 0 {
        Timestamp::MIN
    } else {
        Timestamp::MAX
    });
    format_timestamp(instant)
}

/// An RFC 3339 instant (at any offset) in the stored format, to compare with stored times as
/// text; `None` for text that is not one.
pub fn stored_instant(text: &str) -> Option<String> {
    text.parse::<Timestamp>().ok().map(format_timestamp)
}

fn format_timestamp(instant: Timestamp) -> String {
    // Truncate to the millisecond first: jiff's `{:.3}` would otherwise round.
    let millis = instant.as_millisecond();
    let truncated = Timestamp::from_millisecond(millis).unwrap_or(instant);
    format!("{truncated:.3}")
}

/// Whole seconds from `since` to `now`, both in the stored format; 0 when either is unreadable
/// or `since` lies in the future.
pub fn seconds_between(since: &str, now: &str) -> i64 {
    match (since.parse::<Timestamp>(), now.parse::<Timestamp>()) {
        (Ok(since), Ok(now)) => {
            let millis = now.as_millisecond() - since.as_millisecond();
            // Rounded to the nearest second, as SQLite's ROUND(julianday difference) did.
            ((millis + 500).div_euclid(1000)).max(0)
        }
        _ => 0,
    }
}

/// Milliseconds from `since` to `now`, both in the stored format; `None` when either is
/// unreadable.
pub fn millis_between(since: &str, now: &str) -> Option<i64> {
    let since = since.parse::<Timestamp>().ok()?;
    let now = now.parse::<Timestamp>().ok()?;
    Some(now.as_millisecond() - since.as_millisecond())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants_format_as_rfc3339_utc_with_milliseconds() {
        assert_eq!(format_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_millis(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_millis(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(format_millis(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn now_has_the_stored_width() {
        let now = now();
        assert_eq!(now.len(), 24, "{now}");
        assert!(now.ends_with('Z'));
    }

    #[test]
    fn ages_round_to_whole_seconds_and_never_go_negative() {
        assert_eq!(
            seconds_between("2025-01-01T00:00:00.000Z", "2025-01-01T00:01:00.600Z"),
            61
        );
        assert_eq!(
            seconds_between("2025-01-01T00:00:10.000Z", "2025-01-01T00:00:00.000Z"),
            0
        );
        assert_eq!(seconds_between("garbage", "2025-01-01T00:00:00.000Z"), 0);
    }

    #[test]
    fn millis_between_keeps_milliseconds_and_refuses_what_it_cannot_read() {
        assert_eq!(
            millis_between("2025-01-01T00:00:00.000Z", "2025-01-01T00:00:01.250Z"),
            Some(1250)
        );
        assert_eq!(millis_between("garbage", "2025-01-01T00:00:00.000Z"), None);
    }
}
