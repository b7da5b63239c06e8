//! `X-Forwarded-For` / `X-Forwarded-Proto`, believed only from the one known proxy.
//!
//! Anyone can send these headers; they mean something only when the TCP peer is the proxy that
//! wrote them. With a forward limit of 1 only the right-most entry — the one the proxy itself
//! appended — is taken; entries further left were supplied by whoever talked to the proxy.

use std::net::IpAddr;

use axum::http::HeaderMap;

use crate::http::forwarded::{parse_forwarded_for, rightmost};

/// The client as the application should see it, after the forwarded headers were considered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOrigin {
    pub scheme: String,
    /// `None` only when the connection's peer address is unknown.
    pub remote: Option<IpAddr>,
}

/// Resolves the client for a request from `peer` carrying `headers`. From the known proxy, each
/// of the two headers that is present must be usable (an address; `http` or `https`), or neither
/// is applied: a proxy that wrote one value nobody can read cannot be trusted for the other.
pub fn resolve(known_proxy: IpAddr, peer: Option<IpAddr>, headers: &HeaderMap) -> ClientOrigin {
    let peer = peer.map(|ip| ip.to_canonical());
    let connection = ClientOrigin {
        scheme: "http".to_owned(),
        remote: peer,
    };
    if peer != Some(known_proxy.to_canonical()) {
        return connection;
    }
    let remote = match rightmost(headers, "x-forwarded-for") {
        None => None,
        Some(entry) => match entry.as_deref().and_then(parse_forwarded_for) {
            Some(address) => Some(address),
            None => return connection,
        },
    };
    let scheme = match rightmost(headers, "x-forwarded-proto") {
        None => None,
        Some(entry) => match entry.as_deref().and_then(forwarded_scheme) {
            Some(scheme) => Some(scheme),
            None => return connection,
        },
    };
    ClientOrigin {
        scheme: scheme.map_or(connection.scheme, str::to_owned),
        remote: remote.or(connection.remote),
    }
}

/// The only schemes this server can have been reached by, in any letter case.
fn forwarded_scheme(value: &str) -> Option<&'static str> {
    if value.eq_ignore_ascii_case("http") {
        Some("http")
    } else if value.eq_ignore_ascii_case("https") {
        Some("https")
    } else {
        None
    }
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
        assert_eq!(
            parse_forwarded_for("203.0.113.7:80"),
            "203.0.113.7".parse().ok()
        );
    }

    #[test]
    fn one_unusable_header_means_neither_is_applied() {
        for (forwarded_for, proto) in [
            ("198.51.100.7", "gopher"),
            ("198.51.100.7", "javascript"),
            ("198.51.100.7", "https, "),
            ("not-an-address", "https"),
            ("198.51.100.7, ", "https"),
        ] {
            let headers = forwarded(&[
                ("x-forwarded-for", forwarded_for),
                ("x-forwarded-proto", proto),
            ]);
            let origin = resolve(PROXY, Some(PROXY), &headers);
            assert_eq!(origin.remote, Some(PROXY), "{forwarded_for} / {proto}");
            assert_eq!(origin.scheme, "http", "{forwarded_for} / {proto}");
        }
        // Either header alone, when usable, is applied; schemes in any case become lower case.
        let proto_only = resolve(
            PROXY,
            Some(PROXY),
            &forwarded(&[("x-forwarded-proto", "HTTPS")]),
        );
        assert_eq!(
            (proto_only.scheme.as_str(), proto_only.remote),
            ("https", Some(PROXY))
        );
        let for_only = resolve(
            PROXY,
            Some(PROXY),
            &forwarded(&[("x-forwarded-for", "192.0.2.4")]),
        );
        assert_eq!(for_only.remote, "192.0.2.4".parse().ok());
        assert_eq!(for_only.scheme, "http");
    }
}
