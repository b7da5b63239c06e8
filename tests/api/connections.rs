//! Connection limits over raw sockets: the header-read timeout, the body-read timeout, the idle
//! keep-alive timeout and the connection cap. Each test sets small limits of its own and waits
//! for the fact (the server closing the socket, an answer arriving) under a generous outer bound.

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use production_lab::config::ConnectionLimits;
use production_lab::config::MAX_REQUEST_BODY_BYTES;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{ServerProcess, TestApp, poll_until, spawn_app_with};

/// Longest any test waits for the server to close a socket or answer.
const OUTER_BOUND: Duration = Duration::from_secs(10);
/// A timeout no test reaches: it shows which timeout closed a socket.
const NEVER: Duration = Duration::from_secs(600);

async fn app_with_limits(limits: ConnectionLimits) -> TestApp {
    spawn_app_with(|config| config.limits = limits).await
}

fn limits(header: Duration, body: Duration, keep_alive: Duration, max: usize) -> ConnectionLimits {
    ConnectionLimits {
        header_read_timeout: header,
        body_read_timeout: body,
        keep_alive_timeout: keep_alive,
        max_connections: max,
        ..ConnectionLimits::default()
    }
}

async fn connect(app: &TestApp) -> TcpStream {
    TcpStream::connect(("127.0.0.1", app.port))
        .await
        .expect("connect to the server")
}

/// Reads until the server closes the socket; panics if it is still open after the outer bound.
/// Returns what was read.
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
    assert!(
        closed.is_ok(),
        "the server kept the socket open for {OUTER_BOUND:?}; read so far: {:?}",
        String::from_utf8_lossy(&received)
    );
    received
}

/// Reads one response with a Content-Length body, leaving the connection open.
async fn read_response(socket: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(OUTER_BOUND, async {
        loop {
            let n = socket.read(&mut chunk).await.expect("read a response");
            assert!(n > 0, "closed before a whole response arrived");
            received.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&received);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|line| {
                        let (name, value) = line.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .expect("a Content-Length");
                if body.len() >= length {
                    return;
                }
            }
        }
    })
    .await
    .expect("a whole response within the outer bound");
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_header_timeout() {
    let header = Duration::from_millis(300);
    let app = app_with_limits(limits(header, NEVER, NEVER, 100)).await;
    let mut socket = connect(&app).await;
    let opened = Instant::now();
    let received = read_until_closed(&mut socket).await;
    assert!(
        received.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&received)
    );
    assert!(opened.elapsed() >= header - Duration::from_millis(50));
}

#[tokio::test]
async fn a_request_head_sent_byte_by_byte_is_cut_off_at_the_header_deadline() {
    let header = Duration::from_millis(500);
    let app = app_with_limits(limits(header, NEVER, NEVER, 100)).await;
    let socket = connect(&app).await;
    let opened = Instant::now();
    let (mut reader, mut writer) = socket.into_split();
    // Half a head, then one more byte every 50 ms: arriving bytes never extend the deadline.
    let trickle = tokio::spawn(async move {
        let _ = writer.write_all(b"GET /live HTTP/1.1\r\nHost: x\r\n").await;
        for _ in 0..200 {
            if writer.write_all(b"X").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(OUTER_BOUND, reader.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the half head kept its connection open");
    let elapsed = opened.elapsed();
    assert!(
        elapsed < Duration::from_secs(5),
        "closed only after {elapsed:?}, while bytes kept arriving"
    );
    assert!(elapsed >= header - Duration::from_millis(50), "{elapsed:?}");
    trickle.abort();
}

#[tokio::test]
async fn a_body_short_of_its_content_length_answers_408_and_closes() {
    let app = app_with_limits(limits(NEVER, Duration::from_millis(300), NEVER, 100)).await;
    let mut socket = connect(&app).await;
    socket
        .write_all(
            b"POST /worker HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 40\r\n\r\n{\"value\":",
        )
        .await
        .unwrap();
    let answer = String::from_utf8(read_until_closed(&mut socket).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    let body: Value = serde_json::from_str(answer.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(body["status"], 408);
    assert_eq!(
        app.state.worker.evidence().created,
        0,
        "no work was started"
    );
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout() {
    let keep_alive = Duration::from_millis(300);
    let app = app_with_limits(limits(NEVER, NEVER, keep_alive, 100)).await;
    let mut socket = connect(&app).await;
    // Two requests on one connection: keep-alive works within its timeout.
    for _ in 0..2 {
        socket
            .write_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let response = read_response(&mut socket).await;
        assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
        assert!(response.ends_with("live"), "{response}");
    }
    let answered = Instant::now();
    let rest = read_until_closed(&mut socket).await;
    assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
    assert!(answered.elapsed() >= keep_alive - Duration::from_millis(50));
}

#[tokio::test]
async fn at_the_cap_silent_sockets_make_room_and_live_answers_within_a_second() {
    let app = app_with_limits(limits(NEVER, NEVER, NEVER, 3)).await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(connect(&app).await);
    }
    let asked = Instant::now();
    let response = app.get("/live").await;
    let took = asked.elapsed();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "live");
    assert!(took < Duration::from_secs(1), "/live took {took:?}");
    // The socket that waited longest made room, long before any timeout.
    let oldest = read_until_closed(&mut silent[0]).await;
    assert!(oldest.is_empty());
}

#[tokio::test]
async fn when_every_connection_is_busy_a_new_one_is_refused_at_once_with_503() {
    let app = app_with_limits(limits(NEVER, NEVER, NEVER, 2)).await;
    let arm = app.post("/lab/condition/arm").await;
    assert_eq!(arm.status(), 204);
    // Two writers parked at the armed probe hold both connections with a request in progress.
    let mut parked = Vec::new();
    for body in ["one", "two"] {
        let url = app.url("/documents/1");
        parked.push(tokio::spawn(async move {
            crate::helpers::client()
                .put(url)
                .header("if-match", "\"v1\"")
                .header("x-lab-pause", "true")
                .json(&serde_json::json!({"body": body}))
                .send()
                .await
                .map(|response| response.status().as_u16())
        }));
    }
    poll_until(
        "both writers parked",
        || async { app.state.http.parked_writers() },
        |parked| *parked == 2,
    )
    .await;

    let asked = Instant::now();
    let response = crate::helpers::client()
        .get(app.url("/live"))
        .send()
        .await
        .expect("an answer, not a stall");
    let took = asked.elapsed();
    assert_eq!(response.status(), 503);
    assert!(took < Duration::from_secs(1), "the refusal took {took:?}");
    assert_eq!(response.headers()["connection"], "close");
    assert_eq!(response.headers()["retry-after"], "1");
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["title"], "Too many connections");

    // Shutdown lets the parked writers go with a 503 of their own, and stops in time.
    app.stop().await;
    for writer in parked {
        assert_eq!(writer.await.unwrap().ok(), Some(503));
    }
}

#[tokio::test]
async fn shutdown_closes_waiting_connections_at_once_instead_of_using_its_grace() {
    let app = app_with_limits(limits(NEVER, NEVER, NEVER, 100)).await;
    let mut silent = connect(&app).await;
    let mut idle = connect(&app).await;
    idle.write_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(read_response(&mut idle).await.ends_with("live"));
    let stopping = Instant::now();
    app.stop().await;
    let took = stopping.elapsed();
    assert!(
        took < production_lab::app::SHUTDOWN_GRACE,
        "shutdown waited {took:?} for connections with no request"
    );
    assert!(read_until_closed(&mut silent).await.is_empty());
    assert!(read_until_closed(&mut idle).await.is_empty());
}

#[tokio::test]
async fn the_real_binary_takes_its_limits_on_the_command_line() {
    let (dir, settings) = crate::helpers::settings_dir();
    let server = crate::helpers::ServerProcess::start(
        &dir.path().join("lab.db"),
        &settings,
        &[
            "--header-timeout",
            "200ms",
            "--body-timeout",
            "1s",
            "--keep-alive-timeout",
            "1",
            "--max-connections",
            "8",
        ],
    );
    let host = server.address.trim_start_matches("http://");
    let mut socket = TcpStream::connect(host).await.unwrap();
    let opened = Instant::now();
    assert!(read_until_closed(&mut socket).await.is_empty());
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "{:?}",
        opened.elapsed()
    );
}

// ---------------------------------------------------------------- the body budget

/// A server process's stderr as it arrives, read by a thread of its own; the server writes its
/// log in the JSON format (`--log-format json`), one entry per line.
pub(crate) struct StderrLines {
    lines: Arc<Mutex<Vec<String>>>,
    reader: std::thread::JoinHandle<()>,
}

impl StderrLines {
    pub(crate) fn collect(server: &mut ServerProcess) -> StderrLines {
        let pipe = server
            .child
            .stderr
            .take()
            .expect("the server's stderr is piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                sink.lock().expect("the stderr lines").push(line);
            }
        });
        StderrLines { lines, reader }
    }

    /// The log entries so far with this message whose fields `accept` takes.
    pub(crate) fn count(&self, message: &str, accept: impl Fn(&Value) -> bool) -> usize {
        let lines = self.lines.lock().expect("the stderr lines");
        lines
            .iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|entry| entry["fields"]["message"] == message && accept(&entry["fields"]))
            .count()
    }

    /// Waits until the server has logged `count` entries with this message that `accept` takes.
    pub(crate) async fn wait_for(
        &self,
        count: usize,
        message: &str,
        accept: impl Fn(&Value) -> bool,
    ) {
        poll_until(
            &format!("{count} log entries '{message}'"),
            || std::future::ready(self.count(message, &accept)),
            |seen| *seen >= count,
        )
        .await;
    }

    /// Everything the process wrote to stderr; call once it has exited.
    pub(crate) fn all(self) -> String {
        self.reader.join().expect("the stderr reader");
        self.lines.lock().expect("the stderr lines").join("\n")
    }
}

const BUDGET: usize = 8 * 1024 * 1024;
/// The largest body a route reads.
const LARGEST: usize = MAX_REQUEST_BODY_BYTES - 1;
const RESERVED: &str = "a request body reserved its length from the body budget";
const WAITS: &str = "a request body waits for room in the body budget";

/// A server process with an 8 MiB body budget that logs its budget lines.
fn budgeted_server(dir: &tempfile::TempDir, settings: &std::path::Path) -> ServerProcess {
    ServerProcess::start_with_env(
        &dir.path().join("lab.db"),
        settings,
        &[
            "--request-body-budget",
            "8MiB",
            "--body-timeout",
            "120s",
            "--log-format",
            "json",
        ],
        &[("LAB_LOG", "warn,production_lab::server=debug")],
    )
}

/// A delivery's JSON padded with spaces to `length` bytes.
fn padded_delivery(message_id: &str, length: usize) -> Vec<u8> {
    let mut body =
        format!(r#"{{"messageId":"{message_id}","sequence":1,"amount":1}}"#).into_bytes();
    assert!(body.len() <= length);
    body.resize(length, b' ');
    body
}

/// The head of a delivery to `aggregate` with a `length`-byte body.
fn delivery_head(aggregate: &str, length: usize) -> Vec<u8> {
    format!(
        "POST /aggregates/{aggregate}/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    .into_bytes()
}

async fn connect_to(server: &ServerProcess) -> TcpStream {
    TcpStream::connect(server.address.trim_start_matches("http://"))
        .await
        .expect("connect to the server process")
}

/// A connection that sent a delivery's head and all of its `length`-byte body but the last byte.
struct HeldBody {
    socket: TcpStream,
    last_byte: u8,
}

impl HeldBody {
    async fn start(server: &ServerProcess, aggregate: &str, length: usize) -> HeldBody {
        let mut socket = connect_to(server).await;
        let mut body = padded_delivery(&format!("{aggregate}-1"), length);
        let last_byte = body.pop().expect("a body");
        socket
            .write_all(&delivery_head(aggregate, length))
            .await
            .expect("write the head");
        socket
            .write_all(&body)
            .await
            .expect("write most of the body");
        HeldBody { socket, last_byte }
    }

    /// Sends the last byte and reads the answer.
    async fn finish(mut self) -> String {
        self.socket
            .write_all(&[self.last_byte])
            .await
            .expect("write the last byte");
        read_response(&mut self.socket).await
    }
}

/// Sends a request head and as much of its body as the server takes, and returns what the
/// server answered before it closed the connection.
fn answer_to(socket: TcpStream, head: Vec<u8>, body: Vec<u8>) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let (mut reader, mut writer) = socket.into_split();
        let sending = tokio::spawn(async move {
            if writer.write_all(&head).await.is_ok() {
                // Refused bodies are never read: this write ends when the server closes.
                let _ = writer.write_all(&body).await;
            }
            writer
        });
        let mut received = Vec::new();
        let mut chunk = [0u8; 4096];
        let closed = tokio::time::timeout(OUTER_BOUND, async {
            loop {
                match reader.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => received.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await;
        sending.abort();
        assert!(
            closed.is_ok(),
            "the server kept a refused body's connection open"
        );
        String::from_utf8_lossy(&received).into_owned()
    })
}

/// Asserts a raw answer is the budget's 503 problem with `Retry-After`.
fn assert_budget_refusal(answer: &str) {
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("\r\nretry-after: 1\r\n"), "{answer}");
    assert!(
        lower.contains("content-type: application/problem+json"),
        "{answer}"
    );
    assert!(lower.contains("connection: close"), "{answer}");
    let body: Value = serde_json::from_str(answer.split_once("\r\n\r\n").map_or("", |(_, b)| b))
        .unwrap_or_else(|error| panic!("a JSON body: {error}: {answer}"));
    assert_eq!(body["status"], 503, "{answer}");
    assert_eq!(body["title"], "Too many request bodies at once", "{answer}");
}

/// A process's resident memory now and at its peak, in bytes, from `/proc/PID/status`.
fn resident_memory(pid: u32) -> (usize, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let kib = |field: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{field} in {status}"))
            * 1024
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_body_budget_a_new_body_answers_503_and_the_server_stays_within_its_memory() {
    let (dir, settings) = crate::helpers::settings_dir();
    let mut server = budgeted_server(&dir, &settings);
    let stderr = StderrLines::collect(&mut server);
    let http = crate::helpers::client();
    let warm_up = http
        .get(server.url("/documents/1"))
        .send()
        .await
        .expect("GET");
    assert_eq!(warm_up.status(), 200);
    let (baseline, _) = resident_memory(server.child.id());

    // Four bodies of the largest size fill the 8 MiB budget; each holds back its last byte.
    let holders_count = BUDGET / LARGEST;
    assert_eq!(holders_count, 4);
    let mut holders = Vec::new();
    for index in 0..holders_count {
        holders.push(HeldBody::start(&server, &format!("held-{index}"), LARGEST).await);
    }
    stderr
        .wait_for(holders_count, RESERVED, |fields| fields["bytes"] == LARGEST)
        .await;

    // Every later large body, with a length or chunked, waits its second and answers 503.
    let mut refused = Vec::new();
    for index in 0..36 {
        let socket = connect_to(&server).await;
        let aggregate = format!("late-{index}");
        refused.push(answer_to(
            socket,
            delivery_head(&aggregate, LARGEST),
            padded_delivery(&format!("{aggregate}-1"), LARGEST - 1),
        ));
    }
    let chunked_head = "POST /aggregates/late-chunked/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut chunks = Vec::new();
    for _ in 0..16 {
        chunks.extend_from_slice(format!("{:x}\r\n", 64 * 1024).as_bytes());
        chunks.extend_from_slice(&vec![b' '; 64 * 1024]);
        chunks.extend_from_slice(b"\r\n");
    }
    refused.push(answer_to(
        connect_to(&server).await,
        chunked_head.as_bytes().to_vec(),
        chunks,
    ));
    for answer in refused {
        assert_budget_refusal(&answer.await.expect("the refused connection's task"));
    }

    // While 41 connections sent large bodies, the server held about one budget's worth.
    let (now, peak) = resident_memory(server.child.id());
    let bound = baseline + 2 * BUDGET + 24 * 1024 * 1024;
    assert!(
        peak <= bound,
        "peak resident memory {peak} (now {now}) exceeds {bound}: {baseline} at rest plus twice the budget and 24 MiB for buffers"
    );

    // The held bodies complete and apply; then the budget is free again for a large body.
    for holder in holders {
        let answer = holder.finish().await;
        assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
        assert!(answer.contains(r#""outcome":"applied""#), "{answer}");
    }
    let after = http
        .post(server.url("/aggregates/after/messages"))
        .header("content-type", "application/json")
        .body(padded_delivery("after-1", LARGEST))
        .send()
        .await
        .expect("POST");
    assert_eq!(after.status(), 200);
    server.stop_and_collect_output().await;
    assert!(stderr.all().contains(WAITS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_body_is_not_held_up_by_a_large_one_waiting_for_the_body_budget() {
    let (dir, settings) = crate::helpers::settings_dir();
    let mut server = budgeted_server(&dir, &settings);
    let stderr = StderrLines::collect(&mut server);
    // Four bodies leave less room than a large body needs, and more than a small one does.
    let held_length = 2_000_000;
    let mut holders = Vec::new();
    for index in 0..4 {
        holders.push(HeldBody::start(&server, &format!("held-{index}"), held_length).await);
    }
    stderr
        .wait_for(4, RESERVED, |fields| fields["bytes"] == held_length)
        .await;
    let large = answer_to(
        connect_to(&server).await,
        delivery_head("large", LARGEST),
        padded_delivery("large-1", LARGEST - 1),
    );
    stderr
        .wait_for(1, WAITS, |fields| fields["bytes"] == LARGEST)
        .await;

    let small = serde_json::json!({"messageId": "small-1", "sequence": 1, "amount": 1}).to_string();
    let response = crate::helpers::client()
        .post(server.url("/aggregates/small/messages"))
        .header("content-type", "application/json")
        .body(small.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 200);
    assert!(
        !large.is_finished(),
        "the small body was answered only after the large one gave up"
    );
    assert_eq!(
        stderr.count(WAITS, |fields| fields["bytes"] == small.len()),
        0,
        "the small body waited"
    );
    assert_budget_refusal(&large.await.expect("the large body's task"));
    for holder in holders {
        assert!(holder.finish().await.starts_with("HTTP/1.1 200 "));
    }
}
