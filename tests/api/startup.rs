//! The command line: refusals, the listening line, graceful shutdown, `/live`, `practice`.

use crate::helpers::{ServerProcess, client, command, settings_dir, spawn_app};

/// Runs `serve` with the given arguments (plus a temp database) and expects a refusal.
fn refused(args: &[&str], environment: Option<&str>) -> String {
    let (dir, settings) = settings_dir();
    let mut command = command();
    command
        .arg("serve")
        .arg("--database")
        .arg(dir.path().join("lab.db"))
        .args(args);
    if !args.contains(&"--settings") {
        command.arg("--settings").arg(&settings);
    }
    if let Some(environment) = environment {
        command.env("LAB_ENVIRONMENT", environment);
    }
    let output = command.output().expect("run the binary");
    assert!(
        !output.status.success(),
        "the server should refuse {args:?}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one readable line, not a backtrace: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn serve_refuses_to_start_outside_development() {
    let by_default = refused(&["--urls", "http://127.0.0.1:0"], None);
    assert!(
        by_default.contains("Production") && by_default.contains("only in Development"),
        "{by_default}"
    );
    let staging = refused(&["--urls", "http://127.0.0.1:0"], Some("Staging"));
    assert!(staging.contains("'Staging'"), "{staging}");
    let flag = refused(
        &[
            "--urls",
            "http://127.0.0.1:0",
            "--environment",
            "Production",
        ],
        Some("Development"),
    );
    assert!(flag.contains("fault controls"), "{flag}");
}

#[test]
fn bad_arguments_are_one_line_with_a_hint() {
    for args in [
        &["serve", "--known-proxy", "not-an-address"][..],
        &["serve", "--bogus"],
        &["practice", "--last", "x"],
        &["serve", "--header-timeout", "0"],
        &["serve", "--keep-alive-timeout", "soon"],
        &["serve", "--max-connections", "0"],
        &["serve", "--worker-threads", "0"],
    ] {
        let output = command().args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains("--help"), "{stderr}");
    }
    let help = command().args(["serve", "--help"]).output().unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--database"));
}

#[test]
fn the_operator_and_producer_commands_each_describe_themselves_in_their_own_words() {
    let help = |args: &[&str]| {
        let output = command().args(args).arg("--help").output().unwrap();
        assert!(output.status.success(), "{args:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let expected = [
        (
            "operator",
            [
                "add     Register an operator and print their new token once (only its hash is stored)",
                "list    List operators with their created and revoked times (never tokens)",
                "revoke  Revoke an operator: their token stops working at once",
            ],
            "<NAME>  1..64 letters, digits, '.', '_', '-' or '@'\n",
        ),
        (
            "producer",
            [
                "add     Register a producer and print its new token once (only its hash is stored)",
                "list    List producers with their created and revoked times (never tokens)",
                "revoke  Revoke a producer: its token stops working at once, its deliveries get 401",
            ],
            "<NAME>  1..64 letters, digits, '.', '_', '-' or '@'; never reused after revocation\n",
        ),
    ];
    for (registry, commands, add_name) in expected {
        let listed = help(&[registry]);
        for line in commands {
            assert!(listed.contains(line), "{line}: {listed}");
        }
        let add = help(&[registry, "add"]);
        assert!(add.contains(add_name), "{add}");
    }
}

#[test]
fn serve_refuses_to_bind_anything_but_loopback() {
    for url in ["http://0.0.0.0:0", "http://192.168.1.10:0", "http://[::]:0"] {
        let message = refused(&["--urls", url], Some("Development"));
        assert!(message.contains("loopback"), "{url}: {message}");
    }
}

#[test]
fn serve_refuses_missing_or_invalid_settings_naming_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.json");
    let message = refused(
        &[
            "--urls",
            "http://127.0.0.1:0",
            "--settings",
            missing.to_str().unwrap(),
        ],
        Some("Development"),
    );
    assert!(message.contains("absent.json"), "{message}");

    for (content, field) in [
        (r#"{"Live":{"Label":"  ","Maximum":3}}"#, "Label"),
        (r#"{"Live":{"Label":"x","Maximum":0}}"#, "Maximum"),
        (r#"{"Live":{"Label":"x","Maximum":11}}"#, "Maximum"),
        (r#"{"Live":{"Label":"x""#, "JSON"),
    ] {
        let path = dir.path().join("bad.json");
        std::fs::write(&path, content).unwrap();
        let message = refused(
            &[
                "--urls",
                "http://127.0.0.1:0",
                "--settings",
                path.to_str().unwrap(),
            ],
            Some("Development"),
        );
        assert!(
            message.contains("bad.json") && message.contains(field),
            "{content}: {message}"
        );
    }
}

#[tokio::test]
async fn the_listening_line_names_the_real_port_and_live_answers() {
    let (dir, settings) = settings_dir();
    let server = ServerProcess::start(&dir.path().join("lab.db"), &settings, &[]);
    assert!(server.address.starts_with("http://127.0.0.1:"));
    assert!(!server.address.ends_with(":0"), "{}", server.address);
    let response = client().get(server.url("/live")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    assert_eq!(response.text().await.unwrap(), "live");
}

#[tokio::test]
async fn sigterm_and_sigint_shut_down_gracefully_with_exit_code_zero() {
    for signal in ["TERM", "INT"] {
        let (dir, settings) = settings_dir();
        let mut server = ServerProcess::start(&dir.path().join("lab.db"), &settings, &[]);
        server.signal(signal);
        let status = server.exit_status().await;
        assert_eq!(status.code(), Some(0), "SIG{signal}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_request_thread_or_three_concurrent_deliveries_all_apply() {
    for threads in ["1", "3"] {
        let (dir, settings) = settings_dir();
        let server = ServerProcess::start(
            &dir.path().join("lab.db"),
            &settings,
            &["--worker-threads", threads],
        );
        let client = client();
        let deliveries = (1..=32).map(|n| {
            let client = client.clone();
            let url = server.url(&format!("/aggregates/threads-{}/messages", n % 4));
            async move {
                let body = serde_json::json!({
                    "messageId": format!("m-{n}"),
                    "sequence": (n - 1) / 4 + 1,
                    "amount": 1,
                });
                client.post(url).json(&body).send().await.unwrap().status()
            }
        });
        let statuses = futures_util::future::join_all(deliveries).await;
        let applied = statuses.iter().filter(|status| **status == 200).count();
        // Four aggregates, eight sequences each, sent at once: some arrive ahead of their turn
        // and answer 409 gap; what applies is never more than one per sequence.
        assert!(
            statuses.iter().all(|s| *s == 200 || *s == 409),
            "{statuses:?}"
        );
        assert!(applied >= 4, "{threads} threads: {statuses:?}");
        let mut last = 0;
        for aggregate in 0..4 {
            let view: serde_json::Value = client
                .get(server.url(&format!("/aggregates/threads-{aggregate}")))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            last += view["last"].as_i64().unwrap();
        }
        assert_eq!(
            last as usize, applied,
            "{threads} threads: every 200 moved one position"
        );
    }
}

#[tokio::test]
async fn in_process_servers_answer_live() {
    let app = spawn_app().await;
    assert_eq!(app.get("/live").await.text().await.unwrap(), "live");
}

fn practice(args: &[&str]) -> (bool, String, String) {
    let output = command().arg("practice").args(args).output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn practice_prints_the_lesson_exactly() {
    let (ok, stdout, _) = practice(&[]);
    assert!(ok);
    assert_eq!(stdout, "gap:1\napplied:1\nquarantined\ngap:2\napplied:2\n");
}

#[test]
fn practice_takes_a_progression_and_a_starting_last() {
    let (ok, stdout, _) = practice(&["3:1", "1:1", "3:1", "2:1", "3:1"]);
    assert!(ok);
    assert_eq!(stdout, "gap:1\napplied:1\ngap:2\napplied:2\napplied:3\n");

    let (ok, stdout, _) = practice(&["--last", "4", "5:-1", "4:1", "5:2"]);
    assert!(ok);
    assert_eq!(stdout, "quarantined\nstale:5\napplied:5\n");

    let (ok, _, stderr) = practice(&["2"]);
    assert!(!ok);
    assert!(stderr.contains("SEQUENCE:AMOUNT"), "{stderr}");
}

#[test]
fn serve_refuses_an_inbox_that_is_not_a_loopback_postgresql_in_one_line() {
    let base = [
        "--urls",
        "http://127.0.0.1:0",
        "--environment",
        "Development",
    ];
    for (inbox, says) in [
        (
            "postgres://lab:secret@db.example.com:5432/inbox",
            "only loopback hosts",
        ),
        (
            "postgres://lab:secret@10.1.2.3/inbox",
            "only loopback hosts",
        ),
        ("mysql://lab@127.0.0.1/inbox", "postgres://"),
        ("postgres://lab@/inbox", "names no host"),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(["--inbox", inbox]).collect();
        let line = refused(&args, None);
        assert!(line.contains("--inbox") && line.contains(says), "{line}");
        assert!(!line.contains("secret"), "the password stays out: {line}");
    }
    // A loopback PostgreSQL that is not there: one line naming it, not a hang or a panic.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://lab@127.0.0.1:{port}/inbox");
    let args: Vec<&str> = base.iter().copied().chain(["--inbox", &url]).collect();
    let line = refused(&args, None);
    assert!(line.contains(&format!("127.0.0.1:{port}")), "{line}");
}
