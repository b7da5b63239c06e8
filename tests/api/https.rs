//! A small HTTPS client for the gate's TLS tests: hyper's HTTP/1.1 client over a tokio-rustls
//! connection (ring), trusting only the certificate the test made. One connection per request.
//! reqwest is not used here on purpose: its rustls features, switched on for a test build, would
//! apply to every reqwest client the workspace builds (features unify), each of which would then
//! need a crypto provider installed first.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Clones share one TLS configuration.
#[derive(Clone)]
pub struct HttpsClient {
    tls: TlsConnector,
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
pub type Error = Box<dyn std::error::Error + Send + Sync>;

impl HttpsClient {
    /// A client that trusts only `certificate_pem`.
    pub fn trusting(certificate_pem: &str) -> HttpsClient {
        let mut roots = rustls::RootCertStore::empty();
        let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes())
            .expect("the certificate's PEM");
        roots.add(der).expect("trust the certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        HttpsClient {
            tls: TlsConnector::from(Arc::new(config)),
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
        tokio::time::timeout(Duration::from_secs(30), self.exchange()).await?
    }

    async fn exchange(self) -> Result<Response, Error> {
        let uri: axum::http::Uri = self.url.parse()?;
        let host = uri.host().ok_or("no host in the URL")?.to_owned();
        let port = uri.port_u16().unwrap_or(443);
        let tcp = TcpStream::connect((host.as_str(), port)).await?;
        let name = ServerName::try_from(host.clone())?;
        let tls = self.client.tls.connect(name, tcp).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(connection);
        let path = uri.path_and_query().map_or("/", |path| path.as_str());
        let mut request = Request::builder()
            .method(self.method)
            .uri(path)
            .header(header::HOST, format!("{host}:{port}"));
        for (name, value) in self.headers {
            request = request.header(name, HeaderValue::from_str(&value)?);
        }
        let request = request.body(Full::new(Bytes::from(self.body.unwrap_or_default())))?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Response { status, body })
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
