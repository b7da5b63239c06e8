//! The gate's edge over TLS: the real gate (`GateApplication`, its connection server and
//! middleware) in this process, with a self-signed certificate for 127.0.0.1, a SQLite file and
//! no NATS. Requests are written by hand on a raw TLS stream, so that their framing, their
//! `Expect` header and the pace of their body are the test's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ordering_gate::app::GateApplication;
use ordering_gate::config::GateConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;

use crate::helpers::{client, poll_until};

const READER_TOKEN: &str = "reader-token-for-the-edge";
/// The gate's `limits.max_payload_bytes` in these tests.
const MAX_PAYLOAD: usize = 1024;
const ONE_MIB: usize = 1024 * 1024;
/// Longest a test waits for an answer the gate owes it: past it the test fails rather than hangs
/// (the gate's body-read timeout is longer).
const OUTER_BOUND: Duration = Duration::from_secs(10);
const DELIVER: &str = "/v1/aggregates/a-1/messages";

const PLACED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "amount"]
}"#;

/// How the gate of a test is configured.
#[derive(Clone, Copy)]
struct Settings {
    tls: bool,
    anonymous_writes: bool,
    max_connections: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            tls: true,
            anonymous_writes: true,
            max_connections: 64,
        }
    }
}

/// The gate serving on 127.0.0.1, until [`EdgeGate::stop`].
struct EdgeGate {
    address: SocketAddr,
    /// `None` when the gate serves plain HTTP.
    connector: Option<TlsConnector>,
    stop: CancellationToken,
    served: JoinHandle<std::io::Result<()>>,
    _dir: TempDir,
}

/// One response as read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!("{error}: {}", String::from_utf8_lossy(&self.body));
        })
    }

    fn detail(&self) -> String {
        self.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

async fn spawn_gate(settings: Settings) -> EdgeGate {
    let dir = tempfile::tempdir().expect("a temp dir");
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    write("placed.json", PLACED_SCHEMA);
    let mut tls = String::new();
    let mut connector = None;
    if settings.tls {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()])
            .expect("a self-signed certificate");
        write("cert.pem", &made.cert.pem());
        write("key.pem", &made.signing_key.serialize_pem());
        tls = "[tls]\ncertificate = \"cert.pem\"\nkey = \"key.pem\"\n".to_owned();
        connector = Some(trusting(&made.cert.pem()));
    }
    let text = format!(
        r#"
[listen]
address = "127.0.0.1:0"

{tls}
[store]
sqlite = "gate.db"

[auth]
anonymous_writes = {anonymous}
readers = [{{ name = "dashboard", token = "{READER_TOKEN}" }}]

[limits]
max_payload_bytes = {MAX_PAYLOAD}
max_connections = {max_connections}
body_read_timeout_ms = 60000

[types."order.placed"]
schema = "placed.json"
"#,
        anonymous = settings.anonymous_writes,
        max_connections = settings.max_connections,
    );
    let config = GateConfig::parse(&text, dir.path(), &|_| None).expect("a valid configuration");
    let gate = GateApplication::build(config)
        .await
        .expect("the gate starts");
    let address = gate.address();
    let stop = CancellationToken::new();
    let served = tokio::spawn(gate.run_until_stopped(stop.clone().cancelled_owned()));
    EdgeGate {
        address,
        connector,
        stop,
        served,
        _dir: dir,
    }
}

fn trusting(certificate_pem: &str) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes()).expect("the PEM");
    roots.add(der).expect("trust the certificate");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

impl EdgeGate {
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.served.await;
    }

    /// A TLS connection to the gate, its handshake done.
    async fn connect(&self) -> TlsStream<TcpStream> {
        let tcp = TcpStream::connect(self.address).await.expect("connect");
        self.handshake(tcp).await
    }

    /// [`EdgeGate::connect`] with a small send buffer: a body cannot sit in the client's kernel
    /// while the gate answers (on loopback the whole of it would), so the client is still
    /// sending when the answer comes, as across a network.
    async fn connect_with_small_send_buffer(&self) -> TlsStream<TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket.set_send_buffer_size(4096).expect("SO_SNDBUF");
        let tcp = socket.connect(self.address).await.expect("connect");
        self.handshake(tcp).await
    }

    async fn handshake(&self, tcp: TcpStream) -> TlsStream<TcpStream> {
        let connector = self.connector.as_ref().expect("a gate serving TLS");
        connector
            .connect(ServerName::IpAddress(self.address.ip().into()), tcp)
            .await
            .expect("the TLS handshake")
    }

    /// `GET path` on a connection of its own, with a bearer token when given.
    async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        let authorization = token
            .map(|token| format!("Authorization: Bearer {token}\r\n"))
            .unwrap_or_default();
        let mut stream = self.connect().await;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{authorization}Connection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        read_answer(&mut stream).await
    }
}

/// A delivery's head for `body_length` bytes of JSON, with `extra` header lines.
fn delivery_head(body_length: usize, extra: &str) -> String {
    format!(
        "POST {DELIVER} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {body_length}\r\n{extra}\r\n"
    )
}

fn placed(sequence: i64) -> String {
    json!({
        "messageId": format!("m-{sequence}"),
        "sequence": sequence,
        "type": "order.placed",
        "payload": {"orderId": "o-1", "amount": 5},
    })
    .to_string()
}

/// One response: its head, then a body of its `Content-Length`; within [`OUTER_BOUND`].
async fn read_answer<S: AsyncRead + Unpin>(stream: &mut S) -> Answer {
    tokio::time::timeout(OUTER_BOUND, read_answer_unbounded(stream))
        .await
        .expect("an answer within the bound")
}

async fn read_answer_unbounded<S: AsyncRead + Unpin>(stream: &mut S) -> Answer {
    let mut received = Vec::new();
    let head_end = loop {
        if let Some(at) = received.windows(4).position(|window| window == b"\r\n\r\n") {
            break at + 4;
        }
        read_more(stream, &mut received).await;
    };
    let head = String::from_utf8_lossy(&received[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {head}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
        .collect();
    let mut answer = Answer {
        status,
        headers,
        body: Vec::new(),
    };
    let length: usize = answer
        .header("content-length")
        .map_or(0, |length| length.parse().expect("a Content-Length"));
    while received.len() < head_end + length {
        read_more(stream, &mut received).await;
    }
    answer.body = received[head_end..head_end + length].to_vec();
    answer
}

async fn read_more<S: AsyncRead + Unpin>(stream: &mut S, received: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let read = stream.read(&mut chunk).await.unwrap_or_else(|error| {
        panic!(
            "{error} after {:?}",
            String::from_utf8_lossy(received.as_slice())
        )
    });
    assert!(
        read > 0,
        "the connection ended after {:?}",
        String::from_utf8_lossy(received.as_slice())
    );
    received.extend_from_slice(&chunk[..read]);
}

fn assert_payload_too_large(answer: &Answer) {
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json")
    );
    assert!(
        answer.detail().contains(&format!("{MAX_PAYLOAD} bytes")),
        "{answer:?}"
    );
}

#[tokio::test]
async fn a_declared_length_past_the_payload_limit_is_answered_413_before_the_body_is_sent() {
    let gate = spawn_gate(Settings::default()).await;
    let mut stream = gate.connect().await;
    stream
        .write_all(delivery_head(ONE_MIB, "").as_bytes())
        .await
        .expect("write the head");
    // Not a byte of the body: the answer comes from the head alone.
    let answer = read_answer(&mut stream).await;
    assert_payload_too_large(&answer);
    assert_eq!(answer.header("connection"), Some("close"));
    // Any route: a length past the most the server reads of any body.
    let largest = production_lab::config::MAX_REQUEST_BODY_BYTES;
    let mut stream = gate.connect().await;
    let head = format!(
        "POST /v1/producers HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        largest + 1
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let answer = read_answer(&mut stream).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert!(
        answer.detail().contains(&format!("{largest} bytes")),
        "{answer:?}"
    );
    gate.stop().await;
}

#[tokio::test]
async fn an_expect_100_continue_past_the_payload_limit_is_answered_413_never_100_continue() {
    let gate = spawn_gate(Settings::default()).await;
    let mut stream = gate.connect().await;
    stream
        .write_all(delivery_head(ONE_MIB, "Expect: 100-continue\r\n").as_bytes())
        .await
        .expect("write the head");
    let answer = read_answer(&mut stream).await;
    assert_payload_too_large(&answer);
    gate.stop().await;
}

#[tokio::test]
async fn a_client_that_sends_a_whole_oversized_body_at_once_reads_its_413() {
    let gate = spawn_gate(Settings::default()).await;
    for framing in ["length", "chunked"] {
        let mut stream = gate.connect_with_small_send_buffer().await;
        let body = vec![b' '; ONE_MIB];
        let request = if framing == "length" {
            let mut request = delivery_head(ONE_MIB, "").into_bytes();
            request.extend_from_slice(&body);
            request
        } else {
            let head = format!(
                "POST {DELIVER} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
                body.len()
            );
            let mut request = head.into_bytes();
            request.extend_from_slice(&body);
            request.extend_from_slice(b"\r\n0\r\n\r\n");
            request
        };
        // The whole request before reading anything, as a naive client does.
        stream
            .write_all(&request)
            .await
            .unwrap_or_else(|error| panic!("{framing}: the whole request is taken: {error}"));
        stream.flush().await.expect("flush");
        let answer = read_answer(&mut stream).await;
        assert_payload_too_large(&answer);
        assert_eq!(answer.header("connection"), Some("close"), "{framing}");
    }
    gate.stop().await;
}

#[tokio::test]
async fn a_delivery_without_a_valid_credential_is_answered_401_from_its_head_and_its_connection_makes_room()
 {
    let gate = spawn_gate(Settings {
        anonymous_writes: false,
        max_connections: 1,
        ..Settings::default()
    })
    .await;
    let mut refused = Vec::new();
    for credential in [
        "",
        "Authorization: Bearer not-a-producers-token\r\nProducer-Epoch: 1\r\n",
    ] {
        // One connection at most: each new one takes the place of the one answered before.
        let mut trickling = gate.connect().await;
        trickling
            .write_all(delivery_head(1000, credential).as_bytes())
            .await
            .expect("write the head");
        trickling
            .write_all(&[b' '; 10])
            .await
            .expect("ten bytes of the body");
        // Ten bytes of a thousand: the answer cannot have waited for the body.
        let answer = read_answer(&mut trickling).await;
        assert_eq!(answer.status, 401, "{credential}: {answer:?}");
        assert!(
            answer
                .header("www-authenticate")
                .is_some_and(|challenge| challenge.starts_with("Bearer")),
            "{answer:?}"
        );
        assert_eq!(answer.header("connection"), Some("close"));
        refused.push(trickling);
    }
    // The gate holds one connection at most, and the refused clients are still connected.
    let live = poll_until(
        "a new connection is served beside the refused ones",
        || gate.get("/live", None),
        |answer| answer.status == 200,
    )
    .await;
    assert_eq!(live.status, 200);
    drop(refused);
    gate.stop().await;
}

#[tokio::test]
async fn a_request_with_both_content_length_and_transfer_encoding_is_refused_400_and_applies_nothing()
 {
    let gate = spawn_gate(Settings::default()).await;
    let body = placed(1);
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let length = format!("Content-Length: {}", chunked.len());
    for (first, second) in [
        (length.as_str(), "Transfer-Encoding: chunked"),
        ("Transfer-Encoding: chunked", length.as_str()),
    ] {
        let mut stream = gate.connect().await;
        let request = format!(
            "POST {DELIVER} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{first}\r\n{second}\r\n\r\n{chunked}"
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let answer = read_answer(&mut stream).await;
        assert_eq!(answer.status, 400, "{first}, {second}: {answer:?}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json")
        );
        let detail = answer.detail();
        assert!(
            detail.contains("Content-Length") && detail.contains("Transfer-Encoding"),
            "{detail}"
        );
    }
    // The same delivery framed once is the aggregate's first: the refused ones wrote nothing.
    let mut stream = gate.connect().await;
    let request = format!("{}{body}", delivery_head(body.len(), ""));
    stream.write_all(request.as_bytes()).await.expect("write");
    let answer = read_answer(&mut stream).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["outcome"], "applied", "{answer:?}");
    assert_ne!(
        answer.header("connection"),
        Some("close"),
        "a body read whole keeps its connection"
    );
    gate.stop().await;
}

#[tokio::test]
async fn https_answers_carry_hsts_and_v1_answers_carry_no_store() {
    let gate = spawn_gate(Settings::default()).await;
    let live = gate.get("/live", None).await;
    assert_eq!(live.status, 200, "{live:?}");
    assert_eq!(
        live.header("strict-transport-security"),
        Some("max-age=31536000")
    );
    assert_ne!(live.header("cache-control"), Some("no-store"));
    for (token, status) in [(Some(READER_TOKEN), 200), (None, 401)] {
        let answer = gate.get("/v1/deadletters", token).await;
        assert_eq!(answer.status, status, "{answer:?}");
        assert_eq!(
            answer.header("cache-control"),
            Some("no-store"),
            "{answer:?}"
        );
        assert_eq!(
            answer.header("strict-transport-security"),
            Some("max-age=31536000")
        );
    }
    gate.stop().await;
    // Plain HTTP (loopback, or behind the proxy that terminates TLS): no HSTS of the gate's.
    let plain = spawn_gate(Settings {
        tls: false,
        ..Settings::default()
    })
    .await;
    let answer = client()
        .get(format!("http://{}/v1/deadletters", plain.address))
        .bearer_auth(READER_TOKEN)
        .send()
        .await
        .expect("a read");
    assert_eq!(answer.status(), 200);
    assert!(answer.headers().get("strict-transport-security").is_none());
    assert_eq!(
        answer
            .headers()
            .get("cache-control")
            .and_then(|value| value.to_str().ok()),
        Some("no-store")
    );
    plain.stop().await;
}
