//! The gate's configuration file through the real binary (`gate --check-config`, and a refused
//! start), and its TLS: the connection server's `serve_tls` over a real socket with a
//! self-signed certificate for 127.0.0.1, answered over HTTP/1.1, reloaded in place.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use production_lab::config::ConnectionLimits;
use production_lab::http::server::serve_tls;
use production_lab::http::tls::{ReloadingTls, TlsFiles};
use rustls_pki_types::{CertificateDer, ServerName};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;

use crate::helpers::{command, poll_until};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/gate.example.toml");
/// Longest a test waits for the server to close a socket.
const OUTER_BOUND: Duration = Duration::from_secs(10);

fn gate(args: &[&str]) -> Output {
    command()
        .arg("gate")
        .args(args)
        .env_remove("GATE_READER_TOKEN")
        .output()
        .expect("run production-lab gate")
}

fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A directory with `gate.toml` holding `text` and the example's schemas beside it.
fn config_dir(text: &str) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let schemas = dir.path().join("gate-schemas");
    std::fs::create_dir(&schemas).expect("schemas dir");
    for name in ["order-placed.json", "order-shipped.json"] {
        let example = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("gate-schemas")
            .join(name);
        std::fs::copy(example, schemas.join(name)).expect("copy a schema");
    }
    let file = dir.path().join("gate.toml");
    std::fs::write(&file, text).expect("write gate.toml");
    (dir, file)
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

#[test]
fn the_example_configuration_passes_its_check() {
    let output = gate(&["--check-config", "--config", EXAMPLE]);
    assert_eq!(output.status.code(), Some(0), "{:?}", stderr_lines(&output));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("configuration OK: {EXAMPLE}")
    );
}

#[test]
fn a_file_with_several_mistakes_is_refused_with_exit_2_and_a_line_per_key() {
    let (dir, file) = config_dir(
        r#"
[listen]
address = "0.0.0.0:8443"
[store]
sqlite = "gate.db"
postgres_url_env = "GATE_DATABASE_URL"
[auth]
readers = [{ name = "dashboard", token_env = "GATE_READER_TOKEN" }]
[limits]
max_connectons = 10
[nats]
urls = ["http://127.0.0.1:4222"]
[types."order.placed"]
schema = "gate-schemas/order-placed.json"
[types."order.refunded"]
schema = "gate-schemas/order-refunded.json"
"#,
    );
    let output = gate(&["--check-config", "--config", path_arg(&file)]);
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty(), "nothing claims the file is OK");
    let lines = stderr_lines(&output);
    let refunded = dir.path().join("gate-schemas/order-refunded.json");
    let expected = [
        "tls: required when listen.address (0.0.0.0:8443) is not loopback; or set listen.trusted_proxy".to_owned(),
        "store: give exactly one of sqlite = \"FILE\" and postgres_url_env = \"VARIABLE\"".to_owned(),
        "auth.readers[0].token_env: GATE_READER_TOKEN is not set".to_owned(),
        "limits.max_connectons: unknown key; expected ".to_owned(),
        "nats.urls[0]: not a NATS server URL such as nats://HOST:PORT ".to_owned(),
        format!(
            "types.\"order.refunded\".schema: {}: cannot read: ",
            refunded.display()
        ),
    ];
    assert_eq!(lines.len(), expected.len(), "{lines:#?}");
    for (line, start) in lines.iter().zip(&expected) {
        assert!(
            line.starts_with(start.as_str()),
            "{line:?} should start with {start:?}"
        );
    }
}

#[test]
fn a_start_with_a_bad_file_is_refused_with_the_same_lines_before_anything_listens() {
    let (_dir, file) = config_dir("[listen]\naddress = \"127.0.0.1:0\"\nport = 1\n");
    let output = gate(&["--config", path_arg(&file)]);
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty(), "no listening line");
    assert_eq!(
        stderr_lines(&output),
        [
            "listen.port: unknown key; expected `address` or `trusted_proxy`",
            "types: at least one message type is required, e.g. [types.\"order.placed\"] schema = \"schemas/order-placed.json\"",
        ]
    );
}

#[test]
fn a_file_that_is_not_toml_or_not_there_is_named_by_its_line_or_its_path() {
    let (dir, file) = config_dir("[listen]\naddress = 127.0.0.1:8080\n");
    let output = gate(&["--check-config", "--config", path_arg(&file)]);
    assert_eq!(output.status.code(), Some(2));
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("line 2, column 16: not valid TOML: invalid float"),
        "{lines:?}"
    );
    let missing = dir.path().join("absent.toml");
    let output = gate(&["--check-config", "--config", path_arg(&missing)]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        stderr_lines(&output),
        [format!(
            "{}: cannot read: No such file or directory (os error 2)",
            missing.display()
        )]
    );
}

#[test]
fn a_reader_token_named_in_the_file_is_read_from_the_process_environment() {
    let (_dir, file) = config_dir(
        "[auth]\nreaders = [{ name = \"dashboard\", token_env = \"GATE_READER_TOKEN\" }]\n[types.\"order.placed\"]\nschema = \"gate-schemas/order-placed.json\"\n",
    );
    let unset = gate(&["--check-config", "--config", path_arg(&file)]);
    assert_eq!(
        stderr_lines(&unset),
        ["auth.readers[0].token_env: GATE_READER_TOKEN is not set"]
    );
    let set = command()
        .args(["gate", "--check-config", "--config", path_arg(&file)])
        .env("GATE_READER_TOKEN", "a-reader-token")
        .output()
        .expect("run production-lab gate");
    assert_eq!(set.status.code(), Some(0), "{:?}", stderr_lines(&set));
}

// ---------------------------------------------------------------------------------------------
// TLS over a real socket

/// A self-signed certificate for 127.0.0.1 and its key, written as PEM files.
struct Pair {
    certificate: CertificateDer<'static>,
}

fn write_pair(files: &TlsFiles) -> Pair {
    let key = rcgen::KeyPair::generate().expect("a key");
    let certificate = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .expect("certificate parameters")
        .self_signed(&key)
        .expect("a self-signed certificate");
    std::fs::write(&files.certificate, certificate.pem()).expect("write the certificate");
    std::fs::write(&files.key, key.serialize_pem()).expect("write the key");
    Pair {
        certificate: certificate.der().clone(),
    }
}

/// A gate-like server on an ephemeral port: `serve_tls` with a two-route router.
struct TlsServer {
    port: u16,
    tls: ReloadingTls,
    stop: CancellationToken,
    _dir: TempDir,
    files: TlsFiles,
}

async fn start_tls_server(limits: ConnectionLimits) -> (TlsServer, Pair) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let files = TlsFiles {
        certificate: dir.path().join("gate.crt"),
        key: dir.path().join("gate.key"),
    };
    let pair = write_pair(&files);
    let tls = ReloadingTls::load(&files).expect("a good pair loads");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    let router = Router::new()
        .route("/", get(|| async { "hello over TLS" }))
        .route("/again", get(|| async { "still here" }));
    let stop = CancellationToken::new();
    tokio::spawn(serve_tls(
        listener,
        router,
        limits,
        stop.clone(),
        Duration::from_secs(1),
        tls.clone(),
    ));
    let server = TlsServer {
        port,
        tls,
        stop,
        _dir: dir,
        files,
    };
    (server, pair)
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A TLS client that trusts only `root`, offering HTTP/1.1.
fn connector(root: &CertificateDer<'static>) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone()).expect("a usable root");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    TlsConnector::from(Arc::new(config))
}

async fn handshake(
    port: u16,
    root: &CertificateDer<'static>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let socket = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("127.0.0.1").expect("an IP server name");
    connector(root).connect(name, socket).await
}

/// The certificate the server showed on this connection.
fn shown_certificate(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    let (_, session) = stream.get_ref();
    session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .expect("the server's certificate")
        .clone()
        .into_owned()
}

/// An HTTP/1.1 client connection over `stream`.
async fn http(stream: TlsStream<TcpStream>) -> SendRequest<Body> {
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 over TLS");
    tokio::spawn(connection);
    sender
}

async fn get_text(sender: &mut SendRequest<Body>, path: &str) -> (u16, String) {
    let request = axum::http::Request::get(path)
        .header("host", "127.0.0.1")
        .body(Body::empty())
        .expect("a request");
    let response = sender.send_request(request).await.expect("an answer");
    let status = response.status().as_u16();
    assert_eq!(response.version(), axum::http::Version::HTTP_11);
    let body = axum::body::to_bytes(Body::new(response.into_body()), 1 << 16)
        .await
        .expect("the body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn serve_tls_answers_http_1_1_over_a_handshake_with_its_certificate() {
    let (server, pair) = start_tls_server(ConnectionLimits::default()).await;
    let stream = handshake(server.port, &pair.certificate)
        .await
        .expect("the handshake succeeds with the certificate as root");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    assert_eq!(shown_certificate(&stream), pair.certificate);
    let mut sender = http(stream).await;
    assert_eq!(
        get_text(&mut sender, "/").await,
        (200, "hello over TLS".to_owned())
    );
    // Keep-alive: a second request on the same connection.
    assert_eq!(
        get_text(&mut sender, "/again").await,
        (200, "still here".to_owned())
    );
}

#[tokio::test]
async fn a_reload_shows_new_connections_the_new_certificate_while_an_open_one_keeps_working() {
    let (server, old) = start_tls_server(ConnectionLimits::default()).await;
    let before = handshake(server.port, &old.certificate)
        .await
        .expect("handshake");
    let mut open = http(before).await;
    assert_eq!(get_text(&mut open, "/").await.0, 200);

    let new = write_pair(&server.files);
    assert!(
        handshake(server.port, &new.certificate).await.is_err(),
        "the new certificate is not served before the reload"
    );
    server.tls.reload().expect("the new pair loads");
    let after = handshake(server.port, &new.certificate)
        .await
        .expect("a new connection trusts the new certificate");
    assert_eq!(shown_certificate(&after), new.certificate);
    let mut fresh = http(after).await;
    assert_eq!(get_text(&mut fresh, "/").await.0, 200);
    assert!(
        handshake(server.port, &old.certificate).await.is_err(),
        "new connections no longer see the old certificate"
    );
    // The connection opened before the reload still answers.
    assert_eq!(
        get_text(&mut open, "/again").await,
        (200, "still here".to_owned())
    );
}

#[tokio::test]
async fn a_bad_pair_on_reload_is_refused_and_the_old_certificate_stays() {
    let (server, old) = start_tls_server(ConnectionLimits::default()).await;
    std::fs::write(&server.files.key, "-----BEGIN PRIVATE KEY-----\nbroken\n")
        .expect("spoil the key");
    let error = server.tls.reload().expect_err("a broken key is refused");
    assert!(
        error
            .to_string()
            .starts_with(&server.files.key.display().to_string()),
        "{error}"
    );
    // A key that is not the certificate's.
    let other = rcgen::KeyPair::generate().expect("a key");
    std::fs::write(&server.files.key, other.serialize_pem()).expect("write another key");
    assert!(server.tls.reload().is_err(), "a mismatched key is refused");
    let stream = handshake(server.port, &old.certificate)
        .await
        .expect("the old certificate is still served");
    assert_eq!(shown_certificate(&stream), old.certificate);
    assert_eq!(get_text(&mut http(stream).await, "/").await.0, 200);
}

#[tokio::test]
async fn sighup_reloads_the_certificate() {
    let (server, _old) = start_tls_server(ConnectionLimits::default()).await;
    let _watch = server
        .tls
        .spawn_reload_on_sighup(server.stop.clone())
        .expect("watch SIGHUP");
    let new = write_pair(&server.files);
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let port = server.port;
    poll_until(
        "a new connection shows the new certificate",
        || async { handshake(port, &new.certificate).await.is_ok() },
        |ok| *ok,
    )
    .await;
}

/// Reads until the server closes the socket; panics if it stays open past the outer bound.
async fn read_until_closed(socket: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let closed = tokio::time::timeout(OUTER_BOUND, async {
        loop {
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the server kept the socket open");
    received
}

#[tokio::test]
async fn plain_http_to_the_tls_port_is_closed_and_tls_still_answers() {
    let (server, pair) = start_tls_server(ConnectionLimits::default()).await;
    let mut plain = TcpStream::connect(("127.0.0.1", server.port))
        .await
        .expect("connect");
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("send plain HTTP");
    let received = read_until_closed(&mut plain).await;
    assert!(
        !String::from_utf8_lossy(&received).contains("hello over TLS"),
        "plain HTTP is never answered"
    );
    let stream = handshake(server.port, &pair.certificate)
        .await
        .expect("handshake");
    assert_eq!(get_text(&mut http(stream).await, "/").await.0, 200);
}

#[tokio::test]
async fn a_handshake_that_never_starts_is_closed_at_the_header_read_deadline() {
    let limits = ConnectionLimits {
        header_read_timeout: Duration::from_millis(300),
        keep_alive_timeout: Duration::from_secs(600),
        ..ConnectionLimits::default()
    };
    let (server, _pair) = start_tls_server(limits).await;
    let mut silent = TcpStream::connect(("127.0.0.1", server.port))
        .await
        .expect("connect");
    let started = tokio::time::Instant::now();
    assert!(read_until_closed(&mut silent).await.is_empty());
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "closed by the header-read deadline, not at once ({:?})",
        started.elapsed()
    );
}

#[tokio::test]
async fn at_the_connection_cap_a_silent_handshake_makes_room_for_a_live_one() {
    let limits = ConnectionLimits {
        max_connections: 1,
        header_read_timeout: Duration::from_secs(600),
        ..ConnectionLimits::default()
    };
    let (server, pair) = start_tls_server(limits).await;
    let mut silent = TcpStream::connect(("127.0.0.1", server.port))
        .await
        .expect("connect");
    // The silent socket holds the one place until the next connection takes it.
    let stream = handshake(server.port, &pair.certificate)
        .await
        .expect("handshake");
    assert_eq!(get_text(&mut http(stream).await, "/").await.0, 200);
    assert!(read_until_closed(&mut silent).await.is_empty());
}
