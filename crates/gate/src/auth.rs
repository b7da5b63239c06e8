//! Who may do what at the gate: a producer writes (its token and session epoch, or anonymously
//! when the configuration allows it), a reader reads (a reader token from the configuration, or
//! any active operator's token), an operator resolves and administers (an active operator's
//! token). Each refusal is a 401 problem with a `WWW-Authenticate: Bearer` challenge that says
//! what is missing.
//!
//! Producers' deliveries are rate limited per producer, anonymous deliveries per client address
//! (behind `listen.trusted_proxy`, the address the proxy forwarded, so that one client's burst
//! does not spend everybody's budget): a delivery over the budget answers 429 with
//! `Retry-After`, and nothing of it is written.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use ordered_inbox::operators::token_hash;
use ordered_inbox::records::ProducerClaim;
use serde_json::json;
use subtle::ConstantTimeEq;

use http_edge::credential::{Credential, credential};
use http_edge::error::{AppError, problem_response_with};
use http_edge::forwarded::ClientAddress;
use http_edge::inbox::SharedInbox;

/// The header a producer's delivery names its session's epoch in.
pub const PRODUCER_EPOCH: HeaderName = HeaderName::from_static("producer-epoch");

/// The budget of each producer's deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryRate {
    pub per_second: NonZeroU32,
    pub burst: NonZeroU32,
}

/// The gate's credentials and producers' budgets. Cheap to clone.
#[derive(Clone)]
pub struct Access {
    inner: Arc<AccessInner>,
}

struct AccessInner {
    anonymous_writes: bool,
    /// Swapped whole by a configuration reload ([`Access::replace_readers`]); the producers'
    /// budgets beside them stay as they are.
    readers: ArcSwap<Vec<ReaderToken>>,
    rate: DeliveryRate,
    limiter: DefaultKeyedRateLimiter<Budget>,
}

/// Whose budget a delivery takes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Budget {
    Producer(String),
    /// Anonymous deliveries from one client address (`None`: the peer is unknown).
    Anonymous(Option<IpAddr>),
}

/// Past this many budgets, those that are full again are dropped before the next is kept: the
/// anonymous budgets are one per client address, and addresses are many.
const BUDGETS_KEPT: usize = 10_000;

/// A configured reader: its name and the SHA-256 of its token (the token itself is not kept).
struct ReaderToken {
    name: String,
    hash: String,
}

impl Access {
    /// `readers` are `(name, token)` pairs from the configuration.
    pub fn new(
        anonymous_writes: bool,
        readers: impl IntoIterator<Item = (String, String)>,
        rate: DeliveryRate,
    ) -> Access {
        let readers = ArcSwap::from_pointee(reader_tokens(readers));
        let quota = Quota::per_second(rate.per_second).allow_burst(rate.burst);
        Access {
            inner: Arc::new(AccessInner {
                anonymous_writes,
                readers,
                rate,
                limiter: RateLimiter::keyed(quota),
            }),
        }
    }

    /// Puts `readers` (`(name, token)` pairs) in place of the configured readers, all at once:
    /// a request checks its token against either the old set or the new one, never a mix.
    pub fn replace_readers(&self, readers: impl IntoIterator<Item = (String, String)>) {
        self.inner.readers.store(Arc::new(reader_tokens(readers)));
    }

    /// The configured reader `token` belongs to. Every reader's hash is compared in constant
    /// time, and all of them are compared, so the answer's timing says nothing of the tokens.
    fn reader(&self, token: &str) -> Option<String> {
        let offered = token_hash(token);
        self.inner
            .readers
            .load()
            .iter()
            .fold(None, |found, reader| {
                let equal = bool::from(reader.hash.as_bytes().ct_eq(offered.as_bytes()));
                found.or(equal.then_some(reader))
            })
            .map(|reader| reader.name.clone())
    }

    /// Takes one delivery from `producer`'s budget (`None`: the anonymous budget of `client`), or
    /// says when to come back.
    pub fn admit(&self, producer: Option<&str>, client: Option<IpAddr>) -> Result<(), RateLimited> {
        let key = match producer {
            Some(producer) => Budget::Producer(producer.to_owned()),
            None => Budget::Anonymous(client),
        };
        if self.inner.limiter.len() >= BUDGETS_KEPT {
            self.inner.limiter.retain_recent();
        }
        self.inner.limiter.check_key(&key).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.inner.limiter.clock().now());
            RateLimited {
                producer: producer.map(str::to_owned),
                rate: self.inner.rate,
                // Whole seconds, at least one: a client that retries at once is refused again.
                retry_after: wait.as_secs_f64().ceil().max(1.0) as u64,
            }
        })
    }
}

/// The readers' names with their tokens' hashes (the tokens themselves are not kept).
fn reader_tokens(readers: impl IntoIterator<Item = (String, String)>) -> Vec<ReaderToken> {
    readers
        .into_iter()
        .map(|(name, token)| ReaderToken {
            name,
            hash: token_hash(&token),
        })
        .collect()
}

/// A delivery over its producer's budget: nothing of it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    producer: Option<String>,
    rate: DeliveryRate,
    retry_after: u64,
}

/// 429 with `Retry-After` in whole seconds.
impl IntoResponse for RateLimited {
    fn into_response(self) -> Response {
        let seconds = self.retry_after;
        let who = self.producer.map_or_else(
            || "anonymous deliveries".to_owned(),
            |name| format!("producer '{name}'"),
        );
        let mut response = problem_response_with(
            StatusCode::TOO_MANY_REQUESTS,
            "Too many deliveries",
            Some(&format!(
                "{who} may deliver {} messages a second (bursts of {}); nothing was written: deliver it again after {seconds} s",
                self.rate.per_second, self.rate.burst
            )),
            json!({"outcome": "rate limited", "retryable": true, "retryAfter": seconds}),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        response
    }
}

/// 401 with a `WWW-Authenticate: Bearer` challenge; nothing was changed.
fn unauthorized(title: &str, detail: impl Into<String>) -> Response {
    http_edge::credential::unauthorized(title, detail.into())
}

/// A caller allowed to read the evidence: a reader's name or an operator's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reader(pub String);

impl<S> FromRequestParts<S> for Reader
where
    S: Send + Sync,
    Access: FromRef<S>,
    SharedInbox: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        const TITLE: &str = "Reader authentication required";
        let token = match credential(&parts.headers).map_err(IntoResponse::into_response)? {
            Credential::Bearer(token) => token,
            Credential::Missing | Credential::Unusable => {
                return Err(unauthorized(
                    TITLE,
                    "send Authorization: Bearer TOKEN with a reader's or an operator's token",
                ));
            }
        };
        if let Some(name) = Access::from_ref(state).reader(&token) {
            return Ok(Reader(name));
        }
        let check = SharedInbox::from_ref(state)
            .reads()
            .check_operator(Some(token))
            .await
            .map_err(|error| AppError::from(error).into_response())?;
        check.operator.map(Reader).ok_or_else(|| {
            unauthorized(
                TITLE,
                "the token is neither a configured reader's nor an active operator's",
            )
        })
    }
}

/// An active operator, by name: who resolves, administers, and is named in the audit trail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator(pub String);

/// The title of every operator's 401.
pub const OPERATOR_REQUIRED: &str = "Operator authentication required";

impl<S> FromRequestParts<S> for Operator
where
    S: Send + Sync,
    SharedInbox: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let credential = credential(&parts.headers).map_err(IntoResponse::into_response)?;
        let check = SharedInbox::from_ref(state)
            .reads()
            .check_operator(credential.token().map(str::to_owned))
            .await
            .map_err(|error| AppError::from(error).into_response())?;
        if let Some(operator) = check.operator {
            return Ok(Operator(operator));
        }
        let detail = match credential {
            _ if check.active == 0 => {
                "no operator is registered yet: run `production-lab operator add NAME --database FILE` (or --inbox URL) on the gate's store, then send Authorization: Bearer TOKEN with the printed token"
            }
            Credential::Missing => "send Authorization: Bearer TOKEN with an operator's token",
            Credential::Unusable => {
                "the Authorization header must be Bearer TOKEN with an operator's token"
            }
            Credential::Bearer(_) => "the token is not an active operator's token",
        };
        Err(unauthorized(OPERATOR_REQUIRED, detail))
    }
}

/// The 401 of an operator whose token was revoked between its check and the change.
pub fn operator_revoked() -> Response {
    unauthorized(
        OPERATOR_REQUIRED,
        "the operator's token was revoked before the change",
    )
}

/// 401 for a producer: what its credential lacks; nothing was changed. Every door words it
/// alike.
pub use http_edge::inbox::verdicts::producer_unauthorized;

/// Who makes a delivery, read from the request's head as an extractor, so that a delivery
/// without a valid credential is answered before its body is read (a client without one cannot
/// hold a connection by trickling a body): anonymous (only when the gate allows anonymous
/// writes), or the producer and its session's epoch when it carries a producer's token and one
/// `Producer-Epoch`. The producer's budget is taken once the body is known to be well formed
/// ([`DeliveryCredential::admit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryCredential {
    claim: Option<ProducerClaim>,
    /// The client's address, whose budget an anonymous delivery takes from.
    client: Option<IpAddr>,
}

impl DeliveryCredential {
    /// Takes one delivery from the producer's budget (its client's anonymous budget for an
    /// anonymous one): the claim, or why it must wait.
    pub fn admit(self, access: &Access) -> Result<Option<ProducerClaim>, RateLimited> {
        let producer = self.claim.as_ref().map(|claim| claim.producer.as_str());
        access.admit(producer, self.client)?;
        Ok(self.claim)
    }
}

impl<S> FromRequestParts<S> for DeliveryCredential
where
    S: Send + Sync,
    Access: FromRef<S>,
    SharedInbox: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let access = Access::from_ref(state);
        let inbox = SharedInbox::from_ref(state);
        let client = parts
            .extensions
            .get::<ClientAddress>()
            .map(|client| client.0);
        let claim = delivery_claim(&access, &inbox, &parts.headers).await?;
        Ok(DeliveryCredential { claim, client })
    }
}

/// The claim of a delivery's credential, or the answer that refuses it.
async fn delivery_claim(
    access: &Access,
    inbox: &SharedInbox,
    headers: &HeaderMap,
) -> Result<Option<ProducerClaim>, Response> {
    Ok(
        match credential(headers).map_err(IntoResponse::into_response)? {
            Credential::Missing if access.inner.anonymous_writes => None,
            Credential::Missing => {
                return Err(producer_unauthorized(
                    "anonymous writes are off at this gate: deliver with a producer's token (Authorization: Bearer TOKEN) and Producer-Epoch",
                ));
            }
            Credential::Unusable => {
                return Err(producer_unauthorized(
                    "the Authorization header must be Bearer TOKEN with a producer's token",
                ));
            }
            Credential::Bearer(token) => Some(producer_of(inbox, token, headers).await?),
        },
    )
}

/// The active producer `token` belongs to, with the epoch its delivery names.
async fn producer_of(
    inbox: &SharedInbox,
    token: String,
    headers: &HeaderMap,
) -> Result<ProducerClaim, Response> {
    let producer = active_producer(inbox, token).await?;
    let epoch = epoch_header(headers).map_err(IntoResponse::into_response)?;
    Ok(ProducerClaim { producer, epoch })
}

/// The active producer `token` belongs to, or the 401 that says it is not one.
pub async fn active_producer(inbox: &SharedInbox, token: String) -> Result<String, Response> {
    inbox
        .reads()
        .check_producer(token)
        .await
        .map_err(|error| AppError::from(error).into_response())?
        .ok_or_else(|| {
            producer_unauthorized(
                "the token is not an active producer's token (unknown or revoked)",
            )
        })
}

/// `Producer-Epoch: N`, exactly one, written as [`http_edge::producer_epoch::parse`] reads it.
fn epoch_header(headers: &HeaderMap) -> Result<i64, AppError> {
    const ADVICE: &str = "a producer's delivery needs one Producer-Epoch header: the epoch POST /v1/producers/session answered";
    let mut values = headers.get_all(&PRODUCER_EPOCH).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(AppError::bad_request(ADVICE));
    };
    value
        .to_str()
        .ok()
        .and_then(http_edge::producer_epoch::parse)
        .ok_or_else(|| {
            AppError::bad_request(format!(
                "{ADVICE}, a whole number from 1 in digits only (no sign, no leading zero)"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(per_second: u32, burst: u32) -> Access {
        let rate = DeliveryRate {
            per_second: NonZeroU32::new(per_second).expect("a rate"),
            burst: NonZeroU32::new(burst).expect("a burst"),
        };
        Access::new(
            false,
            [
                ("dashboard".to_owned(), "reader-one".to_owned()),
                ("audit".to_owned(), "reader-two".to_owned()),
            ],
            rate,
        )
    }

    #[test]
    fn a_reader_token_names_its_reader_and_any_other_token_names_none() {
        let access = access(1, 1);
        assert_eq!(access.reader("reader-two").as_deref(), Some("audit"));
        assert_eq!(access.reader("reader-one").as_deref(), Some("dashboard"));
        assert_eq!(access.reader("reader-three"), None);
        assert_eq!(access.reader(""), None);
    }

    #[test]
    fn replaced_readers_answer_for_every_clone_and_the_old_tokens_no_longer_do() {
        let access = access(1, 1);
        let shared = access.clone();
        access.replace_readers([("audit".to_owned(), "reader-four".to_owned())]);
        assert_eq!(shared.reader("reader-four").as_deref(), Some("audit"));
        assert_eq!(shared.reader("reader-two"), None);
        assert_eq!(shared.reader("reader-one"), None);
    }

    #[test]
    fn a_producer_over_its_burst_waits_at_least_a_whole_second_and_others_do_not() {
        let access = access(1, 2);
        assert!(access.admit(Some("p"), None).is_ok());
        assert!(access.admit(Some("p"), None).is_ok());
        let refused = access
            .admit(Some("p"), None)
            .expect_err("over the burst")
            .into_response();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            refused.headers().get(header::RETRY_AFTER),
            Some(&HeaderValue::from(1))
        );
        assert!(access.admit(Some("q"), None).is_ok());
        assert!(access.admit(None, None).is_ok());
    }

    #[test]
    fn each_client_address_has_its_own_anonymous_budget_apart_from_the_producers() {
        let access = access(1, 1);
        let client = "198.51.100.7".parse().ok();
        assert!(access.admit(None, client).is_ok());
        assert!(access.admit(None, client).is_err(), "over its burst");
        assert!(access.admit(None, "198.51.100.8".parse().ok()).is_ok());
        assert!(access.admit(Some("198.51.100.7"), None).is_ok());
        assert!(access.admit(Some(""), None).is_ok());
        assert!(access.admit(None, None).is_ok());
    }
}
