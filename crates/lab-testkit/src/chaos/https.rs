//! A small HTTPS client for the campaign's producers and the gate's TLS tests: hyper's HTTP/1.1
//! client over a tokio-rustls connection (ring), trusting only one CA or certificate, one
//! connection per request, every exchange bounded in time. reqwest is not used on purpose: its rustls features would apply to
//! every reqwest client the workspace builds (features unify), each of which would then need a
//! crypto provider installed first.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, header};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Why a request got no answer (a timeout, a refused or broken connection, a bad URL).
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Clones share one TLS configuration.
#[derive(Clone)]
pub struct HttpsClient {
    tls: TlsConnector,
}

/// A whole answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON (`Null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl HttpsClient {
    /// A client that trusts only the CA `ca_pem`.
    pub fn trusting(ca_pem: &str) -> Result<HttpsClient, Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(HttpsClient {
            tls: TlsConnector::from(Arc::new(config)),
        })
    }

    /// Sends `method url` with `headers` and `body` (JSON when given) on a new TLS connection
    /// and reads the whole answer, all within `within`.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Option<&Value>,
        within: Duration,
    ) -> Result<Answer, Error> {
        let mut headers = headers.to_vec();
        let bytes = match body {
            Some(body) => {
                headers.push((header::CONTENT_TYPE.as_str(), "application/json".to_owned()));
                serde_json::to_vec(body)?
            }
            None => Vec::new(),
        };
        self.send_bytes(method, url, &headers, bytes, within).await
    }

    /// [`HttpsClient::send`] with the body's bytes as given, byte for byte (`headers` name its
    /// content type, if any).
    pub async fn send_bytes(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
        within: Duration,
    ) -> Result<Answer, Error> {
        tokio::time::timeout(within, self.exchange(method, url, headers, body)).await?
    }

    async fn exchange(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
    ) -> Result<Answer, Error> {
        let uri: hyper::Uri = url.parse()?;
        let host = uri.host().ok_or("no host in the URL")?.to_owned();
        let port = uri.port_u16().unwrap_or(443);
        let tcp = TcpStream::connect((host.as_str(), port)).await?;
        let name = ServerName::try_from(host.clone())?;
        let tls = self.tls.connect(name, tcp).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(connection);
        let path = uri.path_and_query().map_or("/", |path| path.as_str());
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, format!("{host}:{port}"));
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let response = sender
            .send_request(request.body(Full::new(Bytes::from(body)))?)
            .await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Answer { status, body })
    }
}
