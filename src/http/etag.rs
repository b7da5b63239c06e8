//! Entity tags and the `If-Match` / `If-None-Match` preconditions (RFC 9110 §8.8.3, §13.1).
//!
//! Comparison is the `headers` crate's (strong for If-Match, weak for If-None-Match). Its decoder
//! silently drops malformed list members, though, and this lab must answer 400 for a malformed
//! condition, so each header is first checked here against the RFC's grammar.

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use headers::{ETag, HeaderMapExt, IfMatch, IfNoneMatch};

/// A conditional header that does not follow RFC 9110's grammar.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "malformed {0} header: expected * or a comma-separated list of entity tags like \"v1\" or W/\"v1\""
)]
pub struct MalformedCondition(pub &'static str);

/// The entity tag of a document version: `"v{version}"`.
pub fn version_etag(version: i64) -> ETag {
    // Digits between quotes always form a valid strong tag.
    format!("\"v{version}\"")
        .parse()
        .expect("a version number makes a valid entity tag")
}

/// The header value for a version's entity tag.
pub fn version_etag_value(version: i64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"v{version}\""))
        .expect("a version number makes a valid header value")
}

/// A present, well-formed `If-Match`.
#[derive(Debug, Clone)]
pub struct IfMatchCondition {
    header: IfMatch,
    canonical: String,
}

impl IfMatchCondition {
    /// Strong comparison: a weak tag never matches; `*` matches any current representation.
    pub fn passes(&self, current: &ETag) -> bool {
        self.header.precondition_passes(current)
    }

    /// The members as sent, normalised: `*`, or tags joined by `,` (e.g. `"v1",W/"v2"`).
    pub fn canonical(&self) -> &str {
        &self.canonical
    }
}

/// A present, well-formed `If-None-Match`.
#[derive(Debug, Clone)]
pub struct IfNoneMatchCondition {
    header: IfNoneMatch,
}

impl IfNoneMatchCondition {
    /// Weak comparison, or `*`: true means the client's copy is current (answer 304).
    pub fn matches(&self, current: &ETag) -> bool {
        !self.header.precondition_passes(current)
    }
}

/// Reads `If-Match`. `Ok(None)` when absent or an empty list.
pub fn if_match(headers: &HeaderMap) -> Result<Option<IfMatchCondition>, MalformedCondition> {
    let Some(members) = members(headers, &header::IF_MATCH, "If-Match")? else {
        return Ok(None);
    };
    let header = headers
        .typed_get::<IfMatch>()
        .ok_or(MalformedCondition("If-Match"))?;
    Ok(Some(IfMatchCondition {
        header,
        canonical: members.join(","),
    }))
}

/// Reads `If-None-Match`. `Ok(None)` when absent or an empty list.
pub fn if_none_match(
    headers: &HeaderMap,
) -> Result<Option<IfNoneMatchCondition>, MalformedCondition> {
    if members(headers, &header::IF_NONE_MATCH, "If-None-Match")?.is_none() {
        return Ok(None);
    }
    let header = headers
        .typed_get::<IfNoneMatch>()
        .ok_or(MalformedCondition("If-None-Match"))?;
    Ok(Some(IfNoneMatchCondition { header }))
}

/// Validates every line of a conditional header and returns its members (`*` or entity tags),
/// or `None` when there is no member at all.
fn members(
    headers: &HeaderMap,
    name: &HeaderName,
    label: &'static str,
) -> Result<Option<Vec<String>>, MalformedCondition> {
    let mut members = Vec::new();
    for value in headers.get_all(name) {
        let text = value.to_str().map_err(|_| MalformedCondition(label))?;
        parse_list(text, &mut members).ok_or(MalformedCondition(label))?;
    }
    let star = members.iter().any(|member| member == "*");
    if star && members.len() > 1 {
        // `*` stands alone: it is not a member of a list of tags.
        return Err(MalformedCondition(label));
    }
    Ok((!members.is_empty()).then_some(members))
}

/// Parses `* / #entity-tag` (empty list elements allowed, as RFC 9110 §5.6.1 asks of
/// recipients). `None` on any syntax error.
fn parse_list(text: &str, members: &mut Vec<String>) -> Option<()> {
    let mut rest = text.trim_matches([' ', '\t']);
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix(',') {
            rest = after.trim_start_matches([' ', '\t']);
            continue;
        }
        let (member, after) = if let Some(after) = rest.strip_prefix('*') {
            ("*".to_owned(), after)
        } else {
            entity_tag(rest)?
        };
        members.push(member);
        rest = after.trim_start_matches([' ', '\t']);
        if !rest.is_empty() {
            rest = rest.strip_prefix(',')?.trim_start_matches([' ', '\t']);
        }
    }
    Some(())
}

/// `[W/] DQUOTE *etagc DQUOTE` where etagc is `%x21 / %x23-7E / obs-text`. Returns the tag and
/// the remaining input.
fn entity_tag(input: &str) -> Option<(String, &str)> {
    let (weak, quoted) = match input.strip_prefix("W/") {
        Some(after) => (true, after),
        None => (false, input),
    };
    let body = quoted.strip_prefix('"')?;
    let end = body.find('"')?;
    let opaque = &body[..end];
    if !opaque
        .bytes()
        .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b) || b >= 0x80)
    {
        return None;
    }
    let tag = format!("{}\"{opaque}\"", if weak { "W/" } else { "" });
    Some((tag, &body[end + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(name: HeaderName, values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(name.clone(), HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn if_match_is_strong() {
        let v2 = version_etag(2);
        let strong = if_match(&map(header::IF_MATCH, &["\"v2\""]))
            .unwrap()
            .unwrap();
        assert!(strong.passes(&v2));
        assert!(!strong.passes(&version_etag(3)));
        let weak = if_match(&map(header::IF_MATCH, &["W/\"v2\""]))
            .unwrap()
            .unwrap();
        assert!(!weak.passes(&v2));
        let any = if_match(&map(header::IF_MATCH, &["*"])).unwrap().unwrap();
        assert!(any.passes(&v2));
        let list = if_match(&map(header::IF_MATCH, &["\"v1\", W/\"v9\"", "\"v2\""]))
            .unwrap()
            .unwrap();
        assert!(list.passes(&v2));
        assert_eq!(list.canonical(), "\"v1\",W/\"v9\",\"v2\"");
    }

    #[test]
    fn if_none_match_is_weak() {
        let v2 = version_etag(2);
        for value in ["\"v2\"", "W/\"v2\"", "*", "\"v1\", W/\"v2\""] {
            let condition = if_none_match(&map(header::IF_NONE_MATCH, &[value]))
                .unwrap()
                .unwrap();
            assert!(condition.matches(&v2), "{value}");
        }
        let other = if_none_match(&map(header::IF_NONE_MATCH, &["\"v1\""]))
            .unwrap()
            .unwrap();
        assert!(!other.matches(&v2));
    }

    #[test]
    fn malformed_conditions_are_errors_not_silent_mismatches() {
        for value in [
            "abc",
            "v1",
            "\"v1",
            "\"v1\" \"v2\"",
            "w/\"v1\"",
            "\"v 1\"",
            "*, \"v1\"",
            "\"v1\"x",
        ] {
            assert!(
                if_match(&map(header::IF_MATCH, &[value])).is_err(),
                "{value}"
            );
            assert!(
                if_none_match(&map(header::IF_NONE_MATCH, &[value])).is_err(),
                "{value}"
            );
        }
    }

    #[test]
    fn absent_or_empty_lists_are_no_condition() {
        assert!(if_match(&HeaderMap::new()).unwrap().is_none());
        assert!(if_match(&map(header::IF_MATCH, &[""])).unwrap().is_none());
        assert!(
            if_match(&map(header::IF_MATCH, &[" , "]))
                .unwrap()
                .is_none()
        );
    }
}
