//! The gate reaching its PostgreSQL store and its NATS servers over TLS with credentials: a
//! private PostgreSQL with `ssl = on` and `hostssl … scram-sha-256`, a private nats-server with
//! TLS and user/password or nkey users, each with a certificate from a CA the test makes. The
//! right CA and credential start the gate; a wrong CA, a wrong password, a missing creds file
//! or plain TCP beyond loopback refuse the start with one line naming the key.

use std::path::{Path, PathBuf};
use std::process::Output;

use lab_testkit::nats::NatsServer;
use lab_testkit::pg::{ClusterOptions, PrivateCluster};
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::gate::GateProcess;
use crate::helpers::{client, command, poll_until};

const GATE_PASSWORD: &str = "gate-password-of-the-test";

/// A CA and a server certificate it signed for 127.0.0.1 alone (not `localhost`: a URL naming
/// `localhost` reaches the server under a name its certificate does not carry), as PEM.
struct Authority {
    ca_pem: String,
    server_pem: String,
    server_key_pem: String,
    /// A client certificate it signed, for servers that verify clients.
    client_pem: String,
    client_key_pem: String,
}

impl Authority {
    fn new() -> Authority {
        let ca_key = rcgen::KeyPair::generate().expect("a CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // Distinct names: OpenSSL takes a certificate whose subject is its issuer's name for a
        // self-signed one (rcgen gives every certificate the same name by default).
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "production-lab test CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("the CA");
        let server_key = rcgen::KeyPair::generate().expect("a server key");
        let server = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .signed_by(&server_key, &ca)
            .expect("the server's certificate");
        let client_key = rcgen::KeyPair::generate().expect("a client key");
        let mut client_params =
            rcgen::CertificateParams::new(vec!["gate".to_owned()]).expect("params");
        client_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "gate");
        let client = client_params
            .signed_by(&client_key, &ca)
            .expect("the client's certificate");
        Authority {
            ca_pem: ca.pem(),
            server_pem: server.pem(),
            server_key_pem: server_key.serialize_pem(),
            client_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
        }
    }
}

/// A gate directory: one message type, anonymous writes, plain HTTP on loopback, `store` and
/// `extra` as given; `files` written beside it.
fn gate_dir(store: &str, extra: &str, files: &[(&str, &str)]) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temp dir");
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("a file");
    }
    std::fs::write(dir.path().join("placed.json"), r#"{"type": "object"}"#).expect("schema");
    let config = dir.path().join("gate.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\naddress = \"127.0.0.1:0\"\n\n[store]\n{store}\n\n[auth]\nanonymous_writes = true\n\n{extra}\n\n[types.\"order.placed\"]\nschema = \"placed.json\"\n"
        ),
    )
    .expect("gate.toml");
    (dir, config)
}

/// Runs the gate on `config` with `env` until it exits (a refused start).
fn refused_start(config: &Path, env: &[(&str, &str)]) -> Output {
    let output = command()
        .envs(env.iter().copied())
        .arg("gate")
        .arg("--config")
        .arg(config)
        .output()
        .expect("run the gate");
    assert!(!output.status.success(), "the gate started");
    output
}

/// The one stderr line that names `key`.
fn line_naming(output: &Output, key: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains(&format!("{key}:")))
        .collect();
    assert_eq!(lines.len(), 1, "one line naming {key} in: {stderr}");
    lines[0].to_owned()
}

/// A private cluster serving TLS with `authority`'s certificate and asking for passwords, with
/// a role `gate` owning a database `gate`. Answers the cluster and the gate's URL (127.0.0.1).
async fn tls_cluster(authority: &Authority) -> (PrivateCluster, String) {
    tls_cluster_verifying(authority, false).await
}

/// [`tls_cluster`], asking also for a client certificate `authority` signed when
/// `verify_clients`.
async fn tls_cluster_verifying(
    authority: &Authority,
    verify_clients: bool,
) -> (PrivateCluster, String) {
    let cluster =
        PrivateCluster::start(ClusterOptions::for_tests()).unwrap_or_else(|e| panic!("{e}"));
    let (admin, connection) =
        tokio_postgres::connect(&cluster.url("postgres"), tokio_postgres::NoTls)
            .await
            .expect("the superuser connects");
    tokio::spawn(connection);
    // CREATE DATABASE cannot share a transaction (a multi-statement batch is one).
    for statement in [
        "SET password_encryption = 'scram-sha-256'".to_owned(),
        format!("CREATE ROLE gate LOGIN PASSWORD '{GATE_PASSWORD}'"),
        "CREATE DATABASE gate OWNER gate".to_owned(),
    ] {
        admin
            .batch_execute(&statement)
            .await
            .expect("the gate's role and database");
    }
    drop(admin);
    cluster
        .require_tls_and_password(
            &authority.server_pem,
            &authority.server_key_pem,
            verify_clients.then_some(authority.ca_pem.as_str()),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!("postgres://gate@127.0.0.1:{}/gate", cluster.port());
    (cluster, url)
}

/// `[store]` with the URL in `GATE_DATABASE_URL` reached with `sslmode`, the CA `ca.pem` and
/// the password in `GATE_DATABASE_PASSWORD`.
fn store_with(sslmode: &str) -> String {
    format!(
        "postgres_url_env = \"GATE_DATABASE_URL\"\nsslmode = \"{sslmode}\"\nsslrootcert = \"ca.pem\"\npassword_env = \"GATE_DATABASE_PASSWORD\""
    )
}

const VERIFY_FULL: &str = "postgres_url_env = \"GATE_DATABASE_URL\"\nsslmode = \"verify-full\"\nsslrootcert = \"ca.pem\"\npassword_env = \"GATE_DATABASE_PASSWORD\"";

async fn ready(gate: &GateProcess) -> Value {
    client()
        .get(gate.url("/ready"))
        .send()
        .await
        .expect("GET /ready")
        .json()
        .await
        .expect("a JSON body")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_applies_a_message_on_postgresql_over_verify_full_with_its_ca_and_a_scram_password()
 {
    let authority = Authority::new();
    let (_cluster, url) = tls_cluster(&authority).await;
    let (_dir, config) = gate_dir(VERIFY_FULL, "", &[("ca.pem", &authority.ca_pem)]);
    let gate = GateProcess::start_with_env(
        &config,
        &[
            ("GATE_DATABASE_URL", &url),
            ("GATE_DATABASE_PASSWORD", GATE_PASSWORD),
        ],
    );
    let applied = client()
        .post(gate.url("/v1/aggregates/order-1/messages"))
        .json(&json!({
            "messageId": "order-1-m1",
            "sequence": 1,
            "type": "order.placed",
            "payload": {"orderId": "order-1"},
        }))
        .send()
        .await
        .expect("POST a message");
    assert_eq!(applied.status(), 200);
    let body: Value = applied.json().await.expect("a JSON body");
    assert_eq!(body["outcome"], "applied", "{body}");
    assert_eq!(ready(&gate).await["checks"]["store"], "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_takes_a_certificate_that_does_not_name_the_host_and_allow_insecure_is_a_warning_at_start()
 {
    let authority = Authority::new();
    let (_cluster, url) = tls_cluster(&authority).await;
    // The certificate names 127.0.0.1 only: verify-ca checks the chain, not the name.
    let by_name = url.replace("127.0.0.1", "localhost");
    let (_dir, config) = gate_dir(
        &store_with("verify-ca"),
        "",
        &[("ca.pem", &authority.ca_pem)],
    );
    let env = [
        ("GATE_DATABASE_URL", by_name.as_str()),
        ("GATE_DATABASE_PASSWORD", GATE_PASSWORD),
    ];
    let gate = GateProcess::start_with_env(&config, &env);
    assert_eq!(ready(&gate).await["checks"]["store"], "ok");
    drop(gate);
    // `require` checks no certificate at all (a CA file is refused with it); the switch that
    // lets it reach a host is logged as a warning at start.
    let (dir, config) = gate_dir(
        "postgres_url_env = \"GATE_DATABASE_URL\"\nsslmode = \"require\"\npassword_env = \"GATE_DATABASE_PASSWORD\"\nallow_insecure = true",
        "",
        &[],
    );
    let gate = GateProcess::start_with_env(&config, &env);
    assert_eq!(ready(&gate).await["checks"]["store"], "ok");
    let log = dir.path().join("gate.log");
    poll_until(
        "the gate warns of store.allow_insecure",
        || std::future::ready(std::fs::read_to_string(&log).unwrap_or_default()),
        |text| {
            text.lines().any(|line| {
                line.contains("WARN")
                    && line.contains(
                        "store.allow_insecure = true: PostgreSQL is reached with sslmode require",
                    )
            })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_a_wrong_password_for_postgresql_refuses_the_start_naming_its_key() {
    let authority = Authority::new();
    let (_cluster, url) = tls_cluster(&authority).await;
    let other = Authority::new();
    let (_dir, config) = gate_dir(VERIFY_FULL, "", &[("ca.pem", &other.ca_pem)]);
    let env = [
        ("GATE_DATABASE_URL", url.as_str()),
        ("GATE_DATABASE_PASSWORD", GATE_PASSWORD),
    ];
    let line = line_naming(&refused_start(&config, &env), "store.sslrootcert");
    assert!(line.contains("certificate is refused"), "{line}");
    std::fs::write(config.with_file_name("ca.pem"), &authority.ca_pem).expect("the right CA");
    // The right CA, but a host name the certificate does not carry: verify-full refuses it.
    let by_name = url.replace("127.0.0.1", "localhost");
    let env = [
        ("GATE_DATABASE_URL", by_name.as_str()),
        ("GATE_DATABASE_PASSWORD", GATE_PASSWORD),
    ];
    let line = line_naming(&refused_start(&config, &env), "store.sslrootcert");
    assert!(line.contains("certificate not valid for name"), "{line}");
    let env = [
        ("GATE_DATABASE_URL", url.as_str()),
        ("GATE_DATABASE_PASSWORD", "not-the-password"),
    ];
    let output = refused_start(&config, &env);
    let line = line_naming(&output, "store.password_env");
    assert!(line.contains("authentication failed"), "{line}");
    assert!(!line.contains("not-the-password"), "{line}");
}

#[test]
fn plain_tcp_to_a_postgresql_or_nats_beyond_loopback_is_refused_before_any_connection() {
    // Refused by the configuration's check: nothing is sent to these addresses.
    let (_dir, config) = gate_dir(
        "postgres_url_env = \"GATE_DATABASE_URL\"",
        "[nats]\nurls = [\"nats://192.0.2.7:4222\"]",
        &[],
    );
    let output = refused_start(
        &config,
        &[("GATE_DATABASE_URL", "postgres://gate@192.0.2.8:5432/gate")],
    );
    assert_eq!(output.status.code(), Some(2));
    let line = line_naming(&output, "store.sslmode");
    assert!(line.contains("store.allow_insecure = true"), "{line}");
    let line = line_naming(&output, "nats.urls[0]");
    assert!(line.contains("nats.allow_insecure = true"), "{line}");
}

/// A nats-server with TLS (`authority`'s certificate) and two users: `gate` with a password,
/// and the nkey user `nkey_user`; with `verify_clients`, a client must show a certificate
/// `authority` signed (mTLS).
fn tls_nats(
    authority: &Authority,
    dir: &Path,
    nkey_user: &str,
    verify_clients: bool,
) -> NatsServer {
    let certificate = dir.join("nats-server.crt");
    let key = dir.join("nats-server.key");
    let ca = dir.join("nats-ca.crt");
    std::fs::write(&certificate, &authority.server_pem).expect("the server's certificate");
    std::fs::write(&key, &authority.server_key_pem).expect("the server's key");
    std::fs::write(&ca, &authority.ca_pem).expect("the CA");
    let verify = if verify_clients {
        format!("  ca_file: \"{}\"\n  verify: true\n", ca.display())
    } else {
        String::new()
    };
    let config = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n{verify}}}\nauthorization {{\n  users = [\n    {{ user: gate, password: \"{GATE_PASSWORD}\" }}\n    {{ nkey: {nkey_user} }}\n  ]\n}}\n",
        certificate.display(),
        key.display()
    );
    NatsServer::start(Some(&config)).unwrap_or_else(|e| panic!("{e}"))
}

fn nats_table(nats: &NatsServer, auth: &str) -> String {
    format!(
        "[nats]\nurls = [\"nats://127.0.0.1:{}\"]\n\n[nats.tls]\nca = \"ca.pem\"\n\n[nats.auth]\n{auth}",
        nats.port
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_connects_to_nats_over_tls_with_a_password_or_an_nkey_and_reports_each_connection()
{
    let authority = Authority::new();
    let server_dir = tempfile::tempdir().expect("a temp dir");
    let user = nkeys::KeyPair::new_user();
    let nats = tls_nats(&authority, server_dir.path(), &user.public_key(), false);
    let seed = user.seed().expect("the user's seed");
    for auth in [
        "user = \"gate\"\npassword_env = \"GATE_NATS_PASSWORD\"",
        "nkey_seed_file = \"gate.nk\"",
    ] {
        let (_dir, config) = gate_dir(
            "sqlite = \"gate.db\"",
            &nats_table(&nats, auth),
            &[("ca.pem", &authority.ca_pem), ("gate.nk", &seed)],
        );
        let gate = GateProcess::start_with_env(&config, &[("GATE_NATS_PASSWORD", GATE_PASSWORD)]);
        let checks = ready(&gate).await["checks"].clone();
        assert_eq!(
            (
                &checks["natsInput"],
                &checks["natsOutput"],
                &checks["store"]
            ),
            (&json!("ok"), &json!("ok"), &json!("ok")),
            "{auth}: {checks}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_password_or_a_missing_creds_file_for_nats_refuses_the_start_naming_its_key()
 {
    let authority = Authority::new();
    let server_dir = tempfile::tempdir().expect("a temp dir");
    let nats = tls_nats(
        &authority,
        server_dir.path(),
        &nkeys::KeyPair::new_user().public_key(),
        false,
    );
    let password = "user = \"gate\"\npassword_env = \"GATE_NATS_PASSWORD\"";
    let other = Authority::new();
    let (_dir, config) = gate_dir(
        "sqlite = \"gate.db\"",
        &nats_table(&nats, password),
        &[("ca.pem", &other.ca_pem)],
    );
    let right = [("GATE_NATS_PASSWORD", GATE_PASSWORD)];
    let line = line_naming(&refused_start(&config, &right), "nats.tls.ca");
    assert!(line.contains("certificate"), "{line}");
    std::fs::write(config.with_file_name("ca.pem"), &authority.ca_pem).expect("the right CA");
    let wrong = [("GATE_NATS_PASSWORD", "not-the-password")];
    let line = line_naming(&refused_start(&config, &wrong), "nats.auth.password_env");
    assert!(line.contains("authorization violation"), "{line}");
    let (_dir, config) = gate_dir(
        "sqlite = \"gate.db\"",
        &nats_table(&nats, "creds_file = \"gate.creds\""),
        &[("ca.pem", &authority.ca_pem)],
    );
    let output = refused_start(&config, &[]);
    assert_eq!(output.status.code(), Some(2));
    let line = line_naming(&output, "nats.auth.creds_file");
    assert!(line.contains("cannot read"), "{line}");
    assert!(
        !config.with_file_name("gate.db").exists(),
        "nothing was started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_that_verifies_clients_takes_the_gate_with_its_client_certificate() {
    let authority = Authority::new();
    let server_dir = tempfile::tempdir().expect("a temp dir");
    let nats = tls_nats(
        &authority,
        server_dir.path(),
        &nkeys::KeyPair::new_user().public_key(),
        true,
    );
    let password = "user = \"gate\"\npassword_env = \"GATE_NATS_PASSWORD\"";
    let env = [("GATE_NATS_PASSWORD", GATE_PASSWORD)];
    let files = [
        ("ca.pem", authority.ca_pem.as_str()),
        ("gate.crt", authority.client_pem.as_str()),
        ("gate.key", authority.client_key_pem.as_str()),
    ];
    // Without a client certificate the server ends the handshake.
    let (_dir, config) = gate_dir("sqlite = \"gate.db\"", &nats_table(&nats, password), &files);
    let output = refused_start(&config, &env);
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("NATS at"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let with_certificate = nats_table(&nats, password).replace(
        "ca = \"ca.pem\"",
        "ca = \"ca.pem\"\ncert = \"gate.crt\"\nkey = \"gate.key\"",
    );
    let (_dir, config) = gate_dir("sqlite = \"gate.db\"", &with_certificate, &files);
    let gate = GateProcess::start_with_env(&config, &env);
    let checks = ready(&gate).await["checks"].clone();
    assert_eq!(
        (&checks["natsInput"], &checks["natsOutput"]),
        (&json!("ok"), &json!("ok")),
        "{checks}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_that_asks_for_a_client_certificate_takes_the_gate_with_sslcert_and_sslkey() {
    let authority = Authority::new();
    let (_cluster, url) = tls_cluster_verifying(&authority, true).await;
    let env = [
        ("GATE_DATABASE_URL", url.as_str()),
        ("GATE_DATABASE_PASSWORD", GATE_PASSWORD),
    ];
    let files = [
        ("ca.pem", authority.ca_pem.as_str()),
        ("gate.crt", authority.client_pem.as_str()),
        ("gate.key", authority.client_key_pem.as_str()),
    ];
    let (_dir, config) = gate_dir(VERIFY_FULL, "", &files);
    let line = line_naming(
        &refused_start(&config, &env),
        "store.postgres_url_env (GATE_DATABASE_URL)",
    );
    assert!(line.contains("certificate"), "{line}");
    let with_certificate = format!("{VERIFY_FULL}\nsslcert = \"gate.crt\"\nsslkey = \"gate.key\"");
    let (_dir, config) = gate_dir(&with_certificate, "", &files);
    let gate = GateProcess::start_with_env(&config, &env);
    assert_eq!(ready(&gate).await["checks"]["store"], "ok");
}
