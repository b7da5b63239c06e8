//! Input rules the seed gets from ASP.NET, where the labs must bind and check as it does:
//! text limits counted in UTF-16 code units, query parameters named in any letter case, and
//! `bool?` switches such as `?failBeforeCommit=true`.

use serde::{Deserialize, Deserializer};

use crate::http::error::AppError;

/// The seed's text check: `string.IsNullOrWhiteSpace(text) || text.Length > max`, where .NET's
/// `Length` counts UTF-16 code units.
pub fn is_blank_or_longer_than(text: &str, max_utf16_units: usize) -> bool {
    text.trim().is_empty() || text.encode_utf16().count() > max_utf16_units
}

/// The value of a query parameter whose name matches in any letter case; a second value is a
/// 400, since ASP.NET would bind the two joined by a comma to a scalar.
pub fn single_query_value<'q>(
    query: &'q [(String, String)],
    name: &str,
) -> Result<Option<&'q str>, AppError> {
    let mut values = query
        .iter()
        .filter(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str());
    let first = values.next();
    if values.next().is_some() {
        return Err(AppError::bad_request(format!(
            "query parameter '{name}' is given more than once"
        )));
    }
    Ok(first)
}

/// A `bool?` value as ASP.NET binds it: `true`/`false` in any letter case, absent or empty as
/// `None`. The error names what was found.
pub fn parse_nullable_bool(value: Option<&str>) -> Result<Option<bool>, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(value) if value.eq_ignore_ascii_case("true") => Ok(Some(true)),
        Some(value) if value.eq_ignore_ascii_case("false") => Ok(Some(false)),
        Some(value) => Err(format!("must be true or false, not '{value}'")),
    }
}

/// A `bool?` query switch, its name matched in any letter case.
pub fn query_flag(query: &[(String, String)], name: &str) -> Result<Option<bool>, AppError> {
    parse_nullable_bool(single_query_value(query, name)?)
        .map_err(|reason| AppError::bad_request(format!("query parameter '{name}' {reason}")))
}

/// A serde field deserializer for a `bool?` query switch (use with `#[serde(default)]`).
pub fn optional_flag<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<bool>, D::Error> {
    let text = Option::<String>::deserialize(deserializer)?;
    parse_nullable_bool(text.as_deref()).map_err(serde::de::Error::custom)
}

/// A `{name:long}` route value, bound as ASP.NET's `long` route constraint does:
/// `long.TryParse(value, NumberStyles.Integer, CultureInfo.InvariantCulture)`, that is optional
/// white space, an optional `+` or `-`, decimal digits, optional white space, within `i64`. Use
/// it inside [`crate::http::error::ConstrainedPath`] so that anything else does not match the route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteLong(pub i64);

impl RouteLong {
    pub fn parse(value: &str) -> Option<RouteLong> {
        // .NET's white space for NumberStyles.AllowLeading/TrailingWhite: U+0009..U+000D, U+0020.
        let trimmed = value.trim_matches(|c: char| matches!(c, '\u{9}'..='\u{d}' | ' '));
        let digits = trimmed.strip_prefix(['+', '-']).unwrap_or(trimmed);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        trimmed.parse().ok().map(RouteLong)
    }
}

impl<'de> Deserialize<'de> for RouteLong {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        RouteLong::parse(&text).ok_or_else(|| serde::de::Error::custom("not a 64-bit integer"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn text_limits_count_utf16_units_and_refuse_blanks() {
        assert!(is_blank_or_longer_than("", 5));
        assert!(is_blank_or_longer_than(" \t", 5));
        assert!(!is_blank_or_longer_than("abcde", 5));
        assert!(is_blank_or_longer_than("abcdef", 5));
        // One character outside the basic plane is two UTF-16 units, as .NET counts it.
        assert!(is_blank_or_longer_than("abcd😀", 5));
    }

    #[test]
    fn route_longs_parse_as_dotnet_long_try_parse() {
        for (text, value) in [
            ("1", 1),
            ("+7", 7),
            ("-3", -3),
            (" 42\t", 42),
            ("007", 7),
            ("9223372036854775807", i64::MAX),
            ("-9223372036854775808", i64::MIN),
        ] {
            assert_eq!(RouteLong::parse(text), Some(RouteLong(value)), "{text:?}");
        }
        for text in [
            "",
            " ",
            "abc",
            "1.0",
            "1e3",
            "0x10",
            "+",
            "--1",
            "+-1",
            "1 2",
            "9223372036854775808",
            "١",
        ] {
            assert_eq!(RouteLong::parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn flags_bind_like_a_nullable_bool() {
        let flag = |items: &[(&str, &str)]| query_flag(&pairs(items), "failBeforeCommit");
        assert_eq!(flag(&[]).unwrap(), None);
        assert_eq!(flag(&[("failBeforeCommit", "")]).unwrap(), None);
        assert_eq!(flag(&[("FAILBEFORECOMMIT", "True")]).unwrap(), Some(true));
        assert_eq!(flag(&[("failBeforeCommit", "true")]).unwrap(), Some(true));
        assert_eq!(flag(&[("failBeforeCommit", "false")]).unwrap(), Some(false));
        assert_eq!(flag(&[("other", "true")]).unwrap(), None);
        assert!(flag(&[("failBeforeCommit", "yes")]).is_err());
        assert!(flag(&[("failBeforeCommit", "1")]).is_err());
        assert!(flag(&[("failBeforeCommit", "true"), ("failBeforeCommit", "false")]).is_err());
    }
}
