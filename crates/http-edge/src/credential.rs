//! The bearer credential, read the same way wherever a caller proves who it is: a producer's
//! delivery and session, an operator's resolution and transfer (HTTP `Authorization`), and a
//! producer's message on the broker door (a NATS `Authorization` header). One `Bearer TOKEN`
//! value, the scheme in any letter case; two values are ambiguous (which one counts is a guess a
//! proxy might make differently), and each door words that refusal its own way.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::AppError;

/// What the `Authorization` header offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    Missing,
    /// Present but not `Bearer TOKEN`.
    Unusable,
    Bearer(String),
}

/// Two `Authorization` values: an ambiguous credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ambiguous;

impl Credential {
    /// The credential of every value of a request's or a message's `Authorization` header.
    pub fn of_values(values: &[&str]) -> Result<Credential, Ambiguous> {
        match values {
            [] => Ok(Credential::Missing),
            [value] => Ok(bearer_token(value).map_or(Credential::Unusable, |token| {
                Credential::Bearer(token.to_owned())
            })),
            _ => Err(Ambiguous),
        }
    }

    /// The bearer token, if one was offered.
    pub fn token(&self) -> Option<&str> {
        match self {
            Credential::Bearer(token) => Some(token),
            Credential::Missing | Credential::Unusable => None,
        }
    }
}

pub use ordered_inbox::jetstream::wire::bearer_token;

/// The credential of an HTTP request; 400 problem+json for two values or one that is not
/// visible ASCII.
pub fn credential(headers: &HeaderMap) -> Result<Credential, AppError> {
    let values = headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .map(|value| {
            value.to_str().map_err(|_| {
                AppError::bad_request("the Authorization header must be visible ASCII text")
            })
        })
        .collect::<Result<Vec<&str>, AppError>>();
    let values = match values {
        Ok(values) => values,
        // Two headers are refused as ambiguous whatever their text.
        Err(_) if headers.get_all(header::AUTHORIZATION).iter().count() > 1 => {
            return Err(ambiguous());
        }
        Err(error) => return Err(error),
    };
    Credential::of_values(&values).map_err(|Ambiguous| ambiguous())
}

fn ambiguous() -> AppError {
    AppError::bad_request("send one Authorization header: two are an ambiguous credential")
}

/// A handler may take the credential as an extractor; one that must check the body's shape first
/// takes `Result<Credential, AppError>` and decides when to answer the error.
impl<S: Send + Sync> FromRequestParts<S> for Credential {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        credential(&parts.headers)
    }
}

/// 401 with a `WWW-Authenticate` challenge and this title; nothing was changed.
pub fn unauthorized(title: &str, detail: String) -> Response {
    let mut response =
        AppError::problem_with_detail(StatusCode::UNAUTHORIZED, title, detail).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"production-lab\""),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bearer_value_is_a_token_in_any_letter_case_and_anything_else_is_unusable() {
        assert_eq!(bearer_token("Bearer s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("  bearer  s3cret "), Some("s3cret"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(Credential::of_values(&[]), Ok(Credential::Missing));
        assert_eq!(
            Credential::of_values(&["Token x"]),
            Ok(Credential::Unusable)
        );
        assert_eq!(
            Credential::of_values(&["Bearer a", "Bearer b"]),
            Err(Ambiguous)
        );
    }
}
