//! `X-Forwarded-For` / `X-Forwarded-Proto`, believed only from the one known proxy.
//!
//! Anyone can send these headers; they mean something only when the TCP peer is the proxy that
//! wrote them. With a forward limit of 1 only the right-most entry — the one the proxy itself
//! appended — is taken; entries further left were supplied by whoever talked to the proxy.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, HeaderName};

/// The client as the application should see it, after the forwarded headers were considered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOrigin {
    pub scheme: String,
    /// `None` only when the connection's peer address is unknown.
    pub remote: Option<IpAddr>,
}

/// Resolves the client for a request from `peer` carrying `headers`.
pub fn resolve(known_proxy: IpAddr, peer: Option<IpAddr>, headers: &HeaderMap) -> ClientOrigin {
    let peer = peer.map(|ip| ip.to_canonical());
    let mut origin = ClientOrigin {
        scheme: "http".to_owned(),
        remote: peer,
    };
    if peer != Some(known_proxy.to_canonical()) {
        return origin;
    }
    if let Some(forwarded_for) =
        rightmost(headers, "x-forwarded-for").and_then(|entry| parse_forwarded_for(&entry))
    {
        origin.remote = Some(forwarded_for);
    }
    if let Some(proto) = rightmost(headers, "x-forwarded-proto").filter(|p| is_scheme(p)) {
        origin.scheme = proto;
    }
    origin
}

/// The right-most comma-separated entry across every line of the header, if not blank.
fn rightmost(headers: &HeaderMap, name: &'static str) -> Option<String> {
    let name = HeaderName::from_static(name);
    let last_line = headers.get_all(&name).iter().next_back()?;
    let text = String::from_utf8_lossy(last_line.as_bytes());
    let entry = text.rsplit(',').next()?.trim();
    (!entry.is_empty()).then(|| entry.to_owned())
}

/// `203.0.113.7`, `203.0.113.7:4711`, `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:4711`.
fn parse_forwarded_for(entry: &str) -> Option<IpAddr> {
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(socket) = entry.parse::<SocketAddr>() {
        return Some(socket.ip());
    }
    entry
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .and_then(|inner| inner.parse::<IpAddr>().ok())
}

/// RFC 3986 scheme: ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ).
fn is_scheme(value: &str) -> bool {
    let mut chars = value.chars();
    chars
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const PROXY: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 10));

    fn forwarded(lines: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in lines {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn headers_from_an_unknown_peer_are_ignored() {
        let peer: IpAddr = "127.0.0.1".parse().unwrap();
        let headers = forwarded(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("x-forwarded-proto", "https"),
        ]);
        let origin = resolve(PROXY, Some(peer), &headers);
        assert_eq!(origin.remote, Some(peer));
        assert_eq!(origin.scheme, "http");
    }

    #[test]
    fn only_the_rightmost_entry_is_taken_from_the_proxy() {
        let headers = forwarded(&[
            ("x-forwarded-for", "192.0.2.1, 192.0.2.2"),
            ("x-forwarded-for", "198.51.100.9, 198.51.100.7"),
            ("x-forwarded-proto", "http, https"),
        ]);
        let origin = resolve(PROXY, Some(PROXY), &headers);
        assert_eq!(origin.remote, Some("198.51.100.7".parse().unwrap()));
        assert_eq!(origin.scheme, "https");
    }

    #[test]
    fn a_mapped_ipv6_peer_is_the_same_proxy() {
        let mapped: IpAddr = "::ffff:203.0.113.10".parse().unwrap();
        let headers = forwarded(&[("x-forwarded-for", "[2001:db8::5]:4711")]);
        let origin = resolve(PROXY, Some(mapped), &headers);
        assert_eq!(origin.remote, Some("2001:db8::5".parse().unwrap()));
    }

    #[test]
    fn unusable_entries_leave_the_connection_values() {
        let headers = forwarded(&[
            ("x-forwarded-for", "198.51.100.7, unknown"),
            ("x-forwarded-proto", "ht tp"),
        ]);
        let origin = resolve(PROXY, Some(PROXY), &headers);
        assert_eq!(origin.remote, Some(PROXY));
        assert_eq!(origin.scheme, "http");
        assert!(is_scheme("https") && is_scheme("coap+tcp") && !is_scheme("1http"));
        assert_eq!(
            parse_forwarded_for("203.0.113.7:80"),
            "203.0.113.7".parse().ok()
        );
    }
}
