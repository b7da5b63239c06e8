//! `production-lab verify-base URL`: the consumer-contract verifier, as a real HTTP client of a
//! running fixture.
//!
//! It refuses any address but an `http` loopback root, then runs seven checks in order: the
//! compatible shape is accepted, the breaking shape is rejected, the fixture is fresh (effect 0), a
//! failure before commit answers 503 and leaves the effect at 0, an uncertain failure after commit
//! answers 503 and leaves the effect at 1. The first failed expectation stops the run and names
//! its check. Refusals and failed expectations start with the seed's own words (`Owned loopback
//! root required`, `Use a fresh fixture`, ...), then say what was wrong.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use reqwest::{Client, StatusCode, Url};
use serde::Serialize;
use serde_json::Value;

/// How long one request may take before its check fails.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What a successful run prints, as one JSON line:
/// `{"checks":7,"transport":"real owned loopback HTTP"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub checks: u32,
    pub transport: &'static str,
}

impl fmt::Display for Summary {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_string(self).map_err(|_| fmt::Error)?;
        formatter.write_str(&text)
    }
}

/// The seed's message when the address is refused.
pub const OWNED_ROOT_REQUIRED: &str = "Owned loopback root required";

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The address is not one the verifier may talk to.
    #[error("{OWNED_ROOT_REQUIRED}: refusing {url:?}: {reason}")]
    Address { url: String, reason: &'static str },
    /// The HTTP client or its runtime could not be set up.
    #[error("cannot start the HTTP client: {0}")]
    Setup(String),
    /// A check could not be run (no answer, not JSON, ...).
    #[error("check {number} ({name}) failed: {reason}")]
    Check {
        number: u32,
        name: &'static str,
        reason: String,
    },
    /// A check ran and its expectation did not hold; `seed` is the seed's message for it.
    #[error("{seed}: check {number} ({name}) failed: {reason}")]
    Expectation {
        seed: &'static str,
        number: u32,
        name: &'static str,
        reason: String,
    },
}

impl VerifyError {
    /// Whether the message starts with the seed's own words, so that it can be printed as is.
    pub fn starts_with_seed_words(&self) -> bool {
        matches!(
            self,
            VerifyError::Address { .. } | VerifyError::Expectation { .. }
        )
    }
}

/// Accepts only `http://<loopback>[:port][/]`: no user info, path, query or fragment. Loopback is
/// `localhost`, 127.0.0.0/8 or `::1`, so the verifier cannot be aimed at anyone else's server.
pub fn parse_base_url(text: &str) -> Result<Url, VerifyError> {
    let refuse = |reason| VerifyError::Address {
        url: text.to_owned(),
        reason,
    };
    let url = Url::parse(text).map_err(|_| refuse("not an absolute URL"))?;
    if url.scheme() != "http" {
        return Err(refuse(
            "only http is accepted (an owned loopback fixture has no TLS)",
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(refuse("user information is not accepted"));
    }
    // host_str is normalised: lower-case names, dotted IPv4, bracketed IPv6.
    let loopback = url.host_str().is_some_and(|host| {
        host == "localhost"
            || host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
                .is_ok_and(|address| address.is_loopback())
    });
    if !loopback {
        return Err(refuse(
            "the host must be loopback (localhost, 127.0.0.1 or [::1])",
        ));
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(refuse(
            "the URL must be the server's root, with no path, query or fragment",
        ));
    }
    Ok(url)
}

/// The consumer's acceptance rule: an object with a positive 32-bit integer `id` and a non-blank
/// string `name`; any other member is ignored (so adding one is compatible).
pub fn accepts(document: &Value) -> bool {
    let id_ok = document
        .get("id")
        .and_then(Value::as_i64)
        .and_then(|id| i32::try_from(id).ok())
        .is_some_and(|id| id > 0);
    let name_ok = document
        .get("name")
        .and_then(Value::as_str)
        .is_some_and(|name| !name.trim().is_empty());
    document.is_object() && id_ok && name_ok
}

/// Parses the address, then runs the checks on a runtime of its own.
pub fn run(base: &str) -> Result<Summary, VerifyError> {
    let base = parse_base_url(base)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| VerifyError::Setup(error.to_string()))?;
    runtime.block_on(verify(base))
}

/// Runs the seven checks against an already validated root URL.
pub async fn verify(base: Url) -> Result<Summary, VerifyError> {
    let client = Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .map_err(|error| VerifyError::Setup(error.to_string()))?;
    let verifier = Verifier { client, base };
    let mut checks = 0;

    checks += 1;
    let compatible = verifier
        .get_json(checks, COMPATIBLE, "contracts/compatible")
        .await?;
    if !accepts(&compatible) {
        return Err(expectation(
            checks,
            COMPATIBLE,
            format!("the consumer rejected {compatible}"),
        ));
    }

    checks += 1;
    let breaking = verifier
        .get_json(checks, BREAKING, "contracts/breaking")
        .await?;
    if accepts(&breaking) {
        return Err(expectation(
            checks,
            BREAKING,
            format!("the consumer accepted {breaking}"),
        ));
    }

    checks += 1;
    expect_effect(&verifier, checks, FRESH, 0).await?;

    checks += 1;
    verifier
        .expect_unavailable(checks, BEFORE, "contracts/change/before")
        .await?;

    checks += 1;
    expect_effect(&verifier, checks, ROLLED_BACK, 0).await?;

    checks += 1;
    verifier
        .expect_unavailable(checks, AFTER, "contracts/change/after")
        .await?;

    checks += 1;
    expect_effect(&verifier, checks, COMMITTED, 1).await?;

    Ok(Summary {
        checks,
        transport: "real owned loopback HTTP",
    })
}

const COMPATIBLE: &str = "compatible shape is accepted";
const BREAKING: &str = "breaking shape is rejected";
const FRESH: &str = "fixture is fresh";
const BEFORE: &str = "failure before commit answers 503";
const ROLLED_BACK: &str = "failure before commit left no effect";
const AFTER: &str = "uncertain failure after commit answers 503";
const COMMITTED: &str = "failure after commit kept its effect";

/// The seed's message when a check's expectation fails, by check name.
fn seed_message(name: &'static str) -> &'static str {
    match name {
        FRESH => "Use a fresh fixture",
        BEFORE => "Expected failure",
        ROLLED_BACK => "Rollback failed",
        AFTER => "Expected uncertain response",
        COMMITTED => "Commit state missing",
        _ => "Consumer contract expectation failed",
    }
}

fn check(number: u32, name: &'static str, reason: impl Into<String>) -> VerifyError {
    VerifyError::Check {
        number,
        name,
        reason: reason.into(),
    }
}

fn expectation(number: u32, name: &'static str, reason: impl Into<String>) -> VerifyError {
    VerifyError::Expectation {
        seed: seed_message(name),
        number,
        name,
        reason: reason.into(),
    }
}

async fn expect_effect(
    verifier: &Verifier,
    number: u32,
    name: &'static str,
    expected: i64,
) -> Result<(), VerifyError> {
    let document = verifier.get_json(number, name, "contracts/effect").await?;
    match document.get("value").and_then(Value::as_i64) {
        Some(value) if value == expected => Ok(()),
        Some(value) => Err(expectation(
            number,
            name,
            format!("the effect is {value}, expected {expected}"),
        )),
        None => Err(check(
            number,
            name,
            format!("the effect body has no integer value: {document}"),
        )),
    }
}

/// An error with its causes, e.g. "error sending request: client error (Connect): Connection
/// refused": reqwest's own message alone does not say why.
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

struct Verifier {
    client: Client,
    base: Url,
}

impl Verifier {
    fn url(&self, number: u32, name: &'static str, path: &str) -> Result<Url, VerifyError> {
        self.base
            .join(path)
            .map_err(|error| check(number, name, format!("cannot build the URL: {error}")))
    }

    /// GET that must succeed with a JSON body.
    async fn get_json(
        &self,
        number: u32,
        name: &'static str,
        path: &str,
    ) -> Result<Value, VerifyError> {
        let url = self.url(number, name, path)?;
        let response = self
            .client
            .get(url.clone())
            .send()
            .await
            .map_err(|error| check(number, name, format!("GET {url}: {}", describe(&error))))?;
        let status = response.status();
        if !status.is_success() {
            return Err(check(number, name, format!("GET {url} answered {status}")));
        }
        let text = response
            .text()
            .await
            .map_err(|error| check(number, name, format!("GET {url}: {}", describe(&error))))?;
        serde_json::from_str(&text).map_err(|error| {
            check(
                number,
                name,
                format!("GET {url} did not answer JSON ({error})"),
            )
        })
    }

    /// POST with no body that must answer exactly 503.
    async fn expect_unavailable(
        &self,
        number: u32,
        name: &'static str,
        path: &str,
    ) -> Result<(), VerifyError> {
        let url = self.url(number, name, path)?;
        let response = self
            .client
            .post(url.clone())
            .send()
            .await
            .map_err(|error| check(number, name, format!("POST {url}: {}", describe(&error))))?;
        match response.status() {
            StatusCode::SERVICE_UNAVAILABLE => Ok(()),
            status => Err(expectation(
                number,
                name,
                format!("POST {url} answered {status}, expected 503"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn loopback_http_roots_are_accepted() {
        for url in [
            "http://127.0.0.1:5080",
            "http://127.0.0.1:5080/",
            "http://127.1.2.3/",
            "http://localhost:5080/",
            "http://LOCALHOST:5080",
            "http://[::1]:5080/",
        ] {
            assert!(parse_base_url(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn everything_else_is_refused_with_a_reason() {
        for (url, reason) in [
            ("https://127.0.0.1:5080/", "only http"),
            ("ftp://127.0.0.1/", "only http"),
            ("http://example.com/", "loopback"),
            ("http://10.0.0.1:5080/", "loopback"),
            ("http://0.0.0.0:5080/", "loopback"),
            ("http://localhost.example.com/", "loopback"),
            ("http://127.0.0.1:5080/api", "root"),
            ("http://127.0.0.1:5080/?x=1", "root"),
            ("http://127.0.0.1:5080/#top", "root"),
            ("http://user@127.0.0.1:5080/", "user information"),
            ("http://user:secret@127.0.0.1:5080/", "user information"),
            ("127.0.0.1:5080", ""),
            ("not a url", "absolute URL"),
        ] {
            let error = parse_base_url(url).expect_err(url).to_string();
            assert!(error.contains(reason), "{url}: {error}");
            assert!(
                error.starts_with("Owned loopback root required: "),
                "{error}"
            );
        }
    }

    #[test]
    fn the_acceptance_rule_needs_a_positive_int32_id_and_a_non_blank_name() {
        assert!(accepts(
            &json!({"id": 1, "name": "rune", "optional": "new"})
        ));
        assert!(accepts(&json!({"id": 2147483647, "name": "x"})));
        for rejected in [
            json!({"id": 1, "name": 42}),
            json!({"id": 0, "name": "rune"}),
            json!({"id": -1, "name": "rune"}),
            json!({"id": 2147483648_i64, "name": "rune"}),
            json!({"id": 1.5, "name": "rune"}),
            json!({"id": "1", "name": "rune"}),
            json!({"id": 1, "name": "  "}),
            json!({"id": 1, "name": null}),
            json!({"name": "rune"}),
            json!({"id": 1}),
            json!({"Id": 1, "Name": "rune"}),
            json!([1, "rune"]),
            json!("rune"),
        ] {
            assert!(!accepts(&rejected), "{rejected}");
        }
    }

    #[test]
    fn the_summary_is_the_seed_line() {
        let summary = Summary {
            checks: 7,
            transport: "real owned loopback HTTP",
        };
        assert_eq!(
            summary.to_string(),
            r#"{"checks":7,"transport":"real owned loopback HTTP"}"#
        );
    }
}
