//! The client behind a reverse proxy: the right-most `Forwarded` (RFC 7239) or `X-Forwarded-For`
//! entry, believed only when the connection's peer is the one trusted proxy.
//!
//! Anyone can send these headers; they mean something only when the TCP peer is the proxy that
//! wrote them. Only the right-most entry — the one that proxy itself appended — is taken:
//! entries further left were supplied by whoever talked to the proxy, and a client that wants
//! another client's budget or log lines would write them.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, HeaderName};

/// The client's address as logs, metrics and rate limits see it, as a request extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddress(pub IpAddr);

/// The client of a request from `peer` carrying `headers`: from `trusted_proxy`, the right-most
/// `Forwarded` `for=` entry when that header is present, else the right-most `X-Forwarded-For`
/// entry; from any other peer, or when the entry taken is unusable (`unknown`, an obfuscated
/// name, not an address), the peer itself. `None` only when the peer is unknown.
pub fn client_address(
    trusted_proxy: Option<IpAddr>,
    peer: Option<IpAddr>,
    headers: &HeaderMap,
) -> Option<IpAddr> {
    let peer = peer.map(|ip| ip.to_canonical());
    let from_proxy = trusted_proxy.is_some_and(|proxy| peer == Some(proxy.to_canonical()));
    if !from_proxy {
        return peer;
    }
    let forwarded = match rightmost(headers, "forwarded") {
        Some(element) => element.as_deref().and_then(forwarded_for),
        None => rightmost(headers, "x-forwarded-for")
            .flatten()
            .as_deref()
            .and_then(parse_forwarded_for),
    };
    forwarded.map(|ip| ip.to_canonical()).or(peer)
}

/// `None` when the header is absent; else its right-most comma-separated entry across every
/// line, `None` inside when that entry is blank.
pub fn rightmost(headers: &HeaderMap, name: &'static str) -> Option<Option<String>> {
    let name = HeaderName::from_static(name);
    let last_line = headers.get_all(&name).iter().next_back()?;
    let text = String::from_utf8_lossy(last_line.as_bytes());
    let entry = text.rsplit(',').next().unwrap_or_default().trim();
    Some((!entry.is_empty()).then(|| entry.to_owned()))
}

/// `203.0.113.7`, `203.0.113.7:4711`, `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:4711`.
pub fn parse_forwarded_for(entry: &str) -> Option<IpAddr> {
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

/// The address of one `Forwarded` element's `for=` pair (`for=192.0.2.60;proto=https`,
/// `For="[2001:db8::17]:4711"`).
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|rest| rest.strip_suffix('"'))
            .unwrap_or(value);
        parse_forwarded_for(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const PROXY: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 10));

    fn headers(lines: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in lines {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    fn ip(text: &str) -> Option<IpAddr> {
        text.parse().ok()
    }

    #[test]
    fn the_rightmost_x_forwarded_for_entry_is_taken_only_from_the_trusted_proxy() {
        let sent = headers(&[
            ("x-forwarded-for", "192.0.2.1, 192.0.2.2"),
            ("x-forwarded-for", "198.51.100.9, 198.51.100.7"),
        ]);
        assert_eq!(
            client_address(Some(PROXY), Some(PROXY), &sent),
            ip("198.51.100.7")
        );
        let other = ip("127.0.0.1");
        assert_eq!(client_address(Some(PROXY), other, &sent), other);
        assert_eq!(client_address(None, Some(PROXY), &sent), Some(PROXY));
    }

    #[test]
    fn the_rightmost_forwarded_element_names_the_client_before_x_forwarded_for() {
        let sent = headers(&[
            (
                "forwarded",
                "for=192.0.2.1, For=\"[2001:db8:cafe::17]:4711\";proto=https",
            ),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        assert_eq!(
            client_address(Some(PROXY), Some(PROXY), &sent),
            ip("2001:db8:cafe::17")
        );
        let plain = headers(&[("forwarded", "proto=https;for=198.51.100.8")]);
        assert_eq!(
            client_address(Some(PROXY), Some(PROXY), &plain),
            ip("198.51.100.8")
        );
    }

    #[test]
    fn an_unusable_rightmost_entry_leaves_the_proxys_address() {
        for sent in [
            headers(&[("x-forwarded-for", "198.51.100.7, unknown")]),
            headers(&[("x-forwarded-for", "198.51.100.7, ")]),
            headers(&[("forwarded", "for=198.51.100.7, for=_hidden")]),
            headers(&[
                ("forwarded", "proto=https"),
                ("x-forwarded-for", "198.51.100.7"),
            ]),
        ] {
            assert_eq!(
                client_address(Some(PROXY), Some(PROXY), &sent),
                Some(PROXY),
                "{sent:?}"
            );
        }
    }

    #[test]
    fn a_mapped_ipv6_peer_is_the_same_proxy_and_addresses_come_out_canonical() {
        let mapped = ip("::ffff:203.0.113.10");
        let sent = headers(&[("x-forwarded-for", "::ffff:198.51.100.7")]);
        assert_eq!(
            client_address(Some(PROXY), mapped, &sent),
            ip("198.51.100.7")
        );
        assert_eq!(
            client_address(Some(PROXY), mapped, &HeaderMap::new()),
            Some(PROXY)
        );
    }
}
