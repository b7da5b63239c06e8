//! Connection limits over raw sockets: the header-read timeout, the body-read timeout, the idle
//! keep-alive timeout and the connection cap. Each test sets small limits of its own and waits
//! for the fact (the server closing the socket, an answer arriving) under a generous outer bound.

use std::time::{Duration, Instant};

use production_lab::config::ConnectionLimits;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{TestApp, poll_until, spawn_app_with};

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
