//! Host filtering: `--allowed-hosts` is `*` (any host) or `;`-separated names compared without
//! their port and without regard to case; `*.example.com` allows the subdomains of example.com
//! (not example.com itself), as ASP.NET's host filtering does.

/// The parsed `--allowed-hosts` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedHosts {
    Any,
    Listed(Vec<HostPattern>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// A lower-cased host name or bracketed IPv6 literal.
    Exact(String),
    /// A lower-cased `.suffix` from `*.suffix`.
    Subdomains(String),
}

impl AllowedHosts {
    /// Parses the `;`-separated list; blank entries are skipped, a list with no entry is refused.
    pub fn parse(spec: &str) -> Result<AllowedHosts, String> {
        let entries: Vec<&str> = spec
            .split(';')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .collect();
        if entries.is_empty() {
            return Err(
                "give * or at least one host name (e.g. localhost;example.test)".to_owned(),
            );
        }
        if entries.contains(&"*") {
            return Ok(AllowedHosts::Any);
        }
        let patterns = entries
            .into_iter()
            .map(|entry| {
                let name = without_port(entry).to_ascii_lowercase();
                match name.strip_prefix('*') {
                    Some(suffix) if suffix.starts_with('.') => {
                        HostPattern::Subdomains(suffix.to_owned())
                    }
                    _ => HostPattern::Exact(name),
                }
            })
            .collect();
        Ok(AllowedHosts::Listed(patterns))
    }

    /// Whether a request with this `Host` value may pass. A missing or empty Host passes only `*`.
    pub fn allows(&self, host: Option<&str>) -> bool {
        let patterns = match self {
            AllowedHosts::Any => return true,
            AllowedHosts::Listed(patterns) => patterns,
        };
        let Some(name) = host.map(without_port).filter(|name| !name.is_empty()) else {
            return false;
        };
        let name = name.to_ascii_lowercase();
        patterns.iter().any(|pattern| match pattern {
            HostPattern::Exact(exact) => *exact == name,
            HostPattern::Subdomains(suffix) => {
                name.len() > suffix.len() && name.ends_with(suffix.as_str())
            }
        })
    }
}

/// Whether a `Host` value has a well-formed port, if any: digits from 0 to 65535 after the name
/// or after a bracketed IPv6 literal (RFC 9110 §7.2, RFC 3986 §3.2.3; an empty port is allowed).
/// An unbracketed value with two colons, or an unclosed bracket, has no readable port either.
pub fn has_valid_port(host: &str) -> bool {
    let port = if let Some(bracketed) = host.strip_prefix('[') {
        match bracketed.split_once(']') {
            Some((_, "")) => return true,
            Some((_, after)) => match after.strip_prefix(':') {
                Some(port) => port,
                None => return false,
            },
            None => return false,
        }
    } else {
        match host.split_once(':') {
            None => return true,
            Some((_, port)) => port,
        }
    };
    port.is_empty()
        || (port.len() <= 5
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u32>().is_ok_and(|port| port <= 65_535))
}

/// `example.com:5080` → `example.com`, `[::1]:5080` → `[::1]`; anything else unchanged.
fn without_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.split_once(':') {
        Some((name, port)) if !port.contains(':') => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_allows_everything_even_no_host() {
        let any = AllowedHosts::parse("*").unwrap();
        assert!(any.allows(Some("evil.example")));
        assert!(any.allows(None));
        assert_eq!(
            AllowedHosts::parse("localhost;*").unwrap(),
            AllowedHosts::Any
        );
    }

    #[test]
    fn names_match_without_port_or_case() {
        let hosts = AllowedHosts::parse("localhost; Example.TEST:8080 ;[::1]").unwrap();
        assert!(hosts.allows(Some("localhost:5080")));
        assert!(hosts.allows(Some("LOCALHOST")));
        assert!(hosts.allows(Some("example.test:1")));
        assert!(hosts.allows(Some("[::1]:5080")));
        assert!(!hosts.allows(Some("127.0.0.1:5080")));
        assert!(!hosts.allows(Some("example.test.evil")));
        assert!(!hosts.allows(Some("")));
        assert!(!hosts.allows(None));
    }

    #[test]
    fn a_wildcard_allows_subdomains_only() {
        let hosts = AllowedHosts::parse("*.lab.test").unwrap();
        assert!(hosts.allows(Some("a.lab.test:80")));
        assert!(!hosts.allows(Some("lab.test")));
        assert!(!hosts.allows(Some("evillab.test")));
    }

    #[test]
    fn ports_must_be_numbers_up_to_65535() {
        for good in [
            "localhost",
            "localhost:5080",
            "localhost:",
            "[::1]",
            "[::1]:80",
            "a.b:65535",
        ] {
            assert!(has_valid_port(good), "{good}");
        }
        for bad in [
            "localhost:abc",
            "localhost:80a",
            "localhost:65536",
            "localhost:+80",
            "localhost:1:2",
            "::1",
            "[::1]x",
            "[::1]:http",
            "[::1",
        ] {
            assert!(!has_valid_port(bad), "{bad}");
        }
    }

    #[test]
    fn an_empty_list_is_refused() {
        assert!(AllowedHosts::parse("").is_err());
        assert!(AllowedHosts::parse(" ; ").is_err());
    }
}
