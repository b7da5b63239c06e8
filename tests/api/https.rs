//! The gate's TLS tests' HTTPS client: reqwest's builder shape over lab-testkit's client (hyper's
//! HTTP/1.1 over tokio-rustls, ring), trusting only the certificate the test made, one connection
//! per request. reqwest is not used here on purpose: its rustls features, switched on for a test
//! build, would apply to every reqwest client the workspace builds (features unify), each of which
//! would then need a crypto provider installed first.

use std::time::Duration;

use axum::http::{HeaderName, Method, StatusCode, header};
use hyper::body::Bytes;
use lab_testkit::chaos::https::HttpsClient as Connections;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Clones share one TLS configuration.
#[derive(Clone)]
pub struct HttpsClient {
    connections: Connections,
}

/// A request being built, as reqwest's builder reads.
pub struct RequestBuilder {
    client: HttpsClient,
    method: Method,
    url: String,
    headers: Vec<(HeaderName, String)>,
    body: Option<Vec<u8>>,
}

/// A whole response.
#[derive(Debug)]
pub struct Response {
    status: StatusCode,
    body: Bytes,
}

/// Why a request got no response.
pub type Error = lab_testkit::chaos::https::Error;

impl HttpsClient {
    /// A client that trusts only `certificate_pem`.
    pub fn trusting(certificate_pem: &str) -> HttpsClient {
        HttpsClient {
            connections: Connections::trusting(certificate_pem).expect("trust the certificate"),
        }
    }

    pub fn get(&self, url: impl Into<String>) -> RequestBuilder {
        self.request(Method::GET, url)
    }

    pub fn post(&self, url: impl Into<String>) -> RequestBuilder {
        self.request(Method::POST, url)
    }

    pub fn request(&self, method: Method, url: impl Into<String>) -> RequestBuilder {
        RequestBuilder {
            client: self.clone(),
            method,
            url: url.into(),
            headers: Vec::new(),
            body: None,
        }
    }
}

impl RequestBuilder {
    pub fn bearer_auth(self, token: impl std::fmt::Display) -> RequestBuilder {
        self.header(header::AUTHORIZATION.as_str(), format!("Bearer {token}"))
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> RequestBuilder {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("a header name");
        self.headers.push((name, value.into()));
        self
    }

    pub fn json(mut self, body: &impl Serialize) -> RequestBuilder {
        self.body = Some(serde_json::to_vec(body).expect("a JSON body"));
        self.header(header::CONTENT_TYPE.as_str(), "application/json")
    }

    /// A JSON body sent as the text given, byte for byte.
    pub fn json_text(mut self, text: &str) -> RequestBuilder {
        self.body = Some(text.as_bytes().to_vec());
        self.header(header::CONTENT_TYPE.as_str(), "application/json")
    }

    /// Sends the request on a new TLS connection and reads the whole answer (30 s at most).
    pub async fn send(self) -> Result<Response, Error> {
        let headers: Vec<(&str, String)> = self
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.clone()))
            .collect();
        let answer = self
            .client
            .connections
            .send_bytes(
                self.method,
                &self.url,
                &headers,
                self.body.unwrap_or_default(),
                Duration::from_secs(30),
            )
            .await?;
        Ok(Response {
            status: StatusCode::from_u16(answer.status)?,
            body: answer.body,
        })
    }
}

impl Response {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub async fn json<T: DeserializeOwned>(self) -> Result<T, Error> {
        Ok(serde_json::from_slice(&self.body)?)
    }

    pub async fn text(self) -> Result<String, Error> {
        Ok(String::from_utf8(self.body.to_vec())?)
    }
}
