//! Antiforgery as a double-submit pair bound by a server key: the cookie carries a random token,
//! the request token is HMAC-SHA256(key, cookie token). A page can read the request token from
//! `GET /antiforgery/token` and echo it in a header; a cross-site form cannot, because it can
//! neither read the response nor compute the MAC. The key lives only in memory, so a restart
//! invalidates every token issued before it.

use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cookie::{Cookie, SameSite};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

pub const COOKIE_NAME: &str = "ProductionLab.Csrf";
pub const HEADER_NAME: &str = "x-csrf-token";
const TOKEN_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// Why a submission was refused. Every reason answers the same 400 to the client; the reason is
/// for the server log only.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AntiforgeryFailure {
    #[error("the {COOKIE_NAME} cookie is missing")]
    MissingCookie,
    #[error("the {COOKIE_NAME} cookie is not a token this server issues")]
    MalformedCookie,
    #[error("the X-CSRF-TOKEN header is missing or given more than once")]
    MissingHeader,
    #[error("the X-CSRF-TOKEN header is not base64url")]
    MalformedHeader,
    #[error("the request token does not pair with the cookie")]
    Mismatch,
}

/// What `GET /antiforgery/token` hands out.
pub struct IssuedTokens {
    pub request_token: String,
    /// A `Set-Cookie` value when a new cookie token was made; `None` when the request already
    /// carried a well-formed one, which is reused (as ASP.NET does), so that every tab of one
    /// browser keeps a working request token.
    pub set_cookie: Option<String>,
}

/// The application's ephemeral antiforgery key, held as an HMAC already keyed with it (cloned
/// for each token). The raw key is never stored or printed.
pub struct Antiforgery {
    keyed: HmacSha256,
}

impl Antiforgery {
    /// A fresh random key, never written anywhere.
    pub fn with_ephemeral_key() -> Self {
        let mut key = [0u8; 32];
        rand::fill(&mut key);
        let keyed = HmacSha256::new_from_slice(&key).expect("HMAC accepts keys of every length");
        Antiforgery { keyed }
    }

    fn request_token_for(&self, cookie_token: &[u8]) -> String {
        let mut mac = self.keyed.clone();
        mac.update(cookie_token);
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    }

    /// Tokens for a request: reuses its cookie token when well formed, else makes a new one.
    pub fn issue(&self, headers: &HeaderMap) -> IssuedTokens {
        if let Some(existing) = cookie_value(headers, COOKIE_NAME)
            .as_deref()
            .and_then(decode_cookie_token)
        {
            return IssuedTokens {
                request_token: self.request_token_for(&existing),
                set_cookie: None,
            };
        }
        let mut cookie_token = [0u8; TOKEN_BYTES];
        rand::fill(&mut cookie_token);
        IssuedTokens {
            request_token: self.request_token_for(&cookie_token),
            set_cookie: Some(set_cookie(URL_SAFE_NO_PAD.encode(cookie_token))),
        }
    }

    /// Checks that the header's request token is the MAC of the cookie's token, in constant time.
    pub fn validate(&self, headers: &HeaderMap) -> Result<(), AntiforgeryFailure> {
        let cookie = cookie_value(headers, COOKIE_NAME).ok_or(AntiforgeryFailure::MissingCookie)?;
        let cookie_token =
            decode_cookie_token(&cookie).ok_or(AntiforgeryFailure::MalformedCookie)?;
        let mut values = headers.get_all(HEADER_NAME).iter();
        let (Some(header), None) = (values.next(), values.next()) else {
            return Err(AntiforgeryFailure::MissingHeader);
        };
        let request_token = URL_SAFE_NO_PAD
            .decode(header.as_bytes().trim_ascii())
            .map_err(|_| AntiforgeryFailure::MalformedHeader)?;
        let mut mac = self.keyed.clone();
        mac.update(&cookie_token);
        // `verify_slice` compares in constant time and refuses a tag of the wrong length.
        mac.verify_slice(&request_token)
            .map_err(|_| AntiforgeryFailure::Mismatch)
    }
}

fn decode_cookie_token(value: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD
        .decode(value)
        .ok()
        .filter(|bytes| bytes.len() == TOKEN_BYTES)
}

/// The `Set-Cookie` value that hands out a new cookie token: the whole site, never sent from
/// another site, out of reach of scripts. Not `Secure`: the fixture is plain http on loopback
/// and the browser would drop it.
fn set_cookie(token: String) -> String {
    Cookie::build((COOKIE_NAME, token))
        .path("/")
        .same_site(SameSite::Strict)
        .http_only(true)
        .build()
        .to_string()
}

/// The first cookie called `name` across all `Cookie` headers (RFC 6265 `name=value; ...`);
/// pairs that do not parse are skipped.
fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|cookie| cookie.name() == name)
        .map(|cookie| cookie.value().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn cookie_of(issued: &IssuedTokens) -> String {
        let set_cookie = issued.set_cookie.as_deref().expect("a new cookie");
        set_cookie
            .split(';')
            .next()
            .expect("name=value first")
            .to_owned()
    }

    fn headers(cookie: Option<&str>, token: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(cookie) = cookie {
            headers.insert("cookie", HeaderValue::from_str(cookie).expect("cookie"));
        }
        if let Some(token) = token {
            headers.insert(HEADER_NAME, HeaderValue::from_str(token).expect("token"));
        }
        headers
    }

    #[test]
    fn a_pair_validates_and_every_broken_pair_fails() {
        let anti = Antiforgery::with_ephemeral_key();
        let issued = anti.issue(&HeaderMap::new());
        let cookie = cookie_of(&issued);
        let token = issued.request_token.as_str();
        assert_eq!(anti.validate(&headers(Some(&cookie), Some(token))), Ok(()));
        assert_eq!(
            anti.validate(&headers(None, Some(token))),
            Err(AntiforgeryFailure::MissingCookie)
        );
        assert_eq!(
            anti.validate(&headers(Some(&cookie), None)),
            Err(AntiforgeryFailure::MissingHeader)
        );
        assert_eq!(
            anti.validate(&headers(Some(&cookie), Some("not base64!"))),
            Err(AntiforgeryFailure::MalformedHeader)
        );
        assert_eq!(
            anti.validate(&headers(Some(&cookie), Some(&token[..20]))),
            Err(AntiforgeryFailure::Mismatch),
            "a truncated tag is refused"
        );
        let other_key = Antiforgery::with_ephemeral_key();
        assert_eq!(
            other_key.validate(&headers(Some(&cookie), Some(token))),
            Err(AntiforgeryFailure::Mismatch),
            "a token from another key (before a restart) is refused"
        );
        assert_eq!(
            anti.validate(&headers(Some("ProductionLab.Csrf=short"), Some(token))),
            Err(AntiforgeryFailure::MalformedCookie)
        );
    }

    #[test]
    fn a_well_formed_cookie_is_reused() {
        let anti = Antiforgery::with_ephemeral_key();
        let first = anti.issue(&HeaderMap::new());
        let cookie = cookie_of(&first);
        let again = anti.issue(&headers(Some(&format!("theme=dark; {cookie}")), None));
        assert!(again.set_cookie.is_none());
        assert_eq!(again.request_token, first.request_token);
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.append("cookie", HeaderValue::from_static("a=1; b=2"));
        headers.append(
            "cookie",
            HeaderValue::from_static("ProductionLab.Csrf=x ; c=3"),
        );
        assert_eq!(cookie_value(&headers, COOKIE_NAME).as_deref(), Some("x"));
        assert_eq!(cookie_value(&headers, "ProductionLab"), None);

        let mut headers = HeaderMap::new();
        headers.append(
            "cookie",
            HeaderValue::from_static("garbage; =empty; ProductionLab.Csrf=y"),
        );
        assert_eq!(
            cookie_value(&headers, COOKIE_NAME).as_deref(),
            Some("y"),
            "pairs that do not parse are skipped"
        );
    }

    #[test]
    fn a_new_cookie_is_site_wide_strict_and_out_of_reach_of_scripts() {
        let set_cookie = set_cookie("token".to_owned());
        let mut parts = set_cookie.split(';').map(str::trim);
        assert_eq!(parts.next(), Some("ProductionLab.Csrf=token"));
        let mut attributes: Vec<&str> = parts.collect();
        attributes.sort_unstable();
        assert_eq!(attributes, ["HttpOnly", "Path=/", "SameSite=Strict"]);
    }
}
