//! The gate's configuration reloaded on SIGHUP, on the real `production-lab gate` process: new
//! message types and readers' tokens take effect together, a file with a mistake changes
//! nothing (the log names the file and its key), keys only a restart takes up are logged as
//! such, and with `[tls]` the certificate is reloaded in the same step.

use std::path::PathBuf;

use serde_json::{Value, json};
use tempfile::TempDir;

use crate::gate::{Certificate, GateProcess, PLACED_SCHEMA, SHIPPED_SCHEMA};
use crate::helpers::poll_until;

const FIRST_TOKEN: &str = "the-dashboards-first-token";
const SECOND_TOKEN: &str = "the-dashboards-second-token";

/// A loopback gate's directory: `order.placed` always, the readers and the rest as given.
struct ReloadFiles {
    dir: TempDir,
}

/// What a version of the file says.
struct Settings<'a> {
    reader_token: &'a str,
    store: &'a str,
    /// `[tls]` with `cert.pem` and `key.pem` beside the file.
    tls: bool,
    shipped: bool,
}

impl Default for Settings<'_> {
    fn default() -> Self {
        Settings {
            reader_token: FIRST_TOKEN,
            store: "gate.db",
            tls: false,
            shipped: false,
        }
    }
}

impl ReloadFiles {
    fn new(settings: &Settings) -> ReloadFiles {
        let files = ReloadFiles {
            dir: tempfile::tempdir().expect("a temp dir"),
        };
        files.write("placed.json", PLACED_SCHEMA);
        files.write("shipped.json", SHIPPED_SCHEMA);
        files.configure(settings);
        files
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.path(name), text).expect("write a gate file");
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn config(&self) -> PathBuf {
        self.path("gate.toml")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("gate.log")).unwrap_or_default()
    }

    /// Writes the configuration file; text logs, so that keys read as in the file.
    fn configure(&self, settings: &Settings) {
        let tls = if settings.tls {
            "[tls]\ncertificate = \"cert.pem\"\nkey = \"key.pem\"\n"
        } else {
            ""
        };
        let shipped = if settings.shipped {
            "[types.\"order.shipped\"]\nschema = \"shipped.json\"\n"
        } else {
            ""
        };
        self.write(
            "gate.toml",
            &format!(
                r#"
[listen]
address = "127.0.0.1:0"

{tls}
[store]
sqlite = "{store}"

[auth]
anonymous_writes = true
readers = [{{ name = "dashboard", token = "{token}" }}]

[metrics]
public = false

[log]
format = "text"

[types."order.placed"]
schema = "placed.json"

{shipped}"#,
                store = settings.store,
                token = settings.reader_token,
            ),
        );
    }
}

fn placed() -> Value {
    json!({"orderId": "o-1", "amount": 3})
}

fn shipped() -> Value {
    json!({"orderId": "o-1", "carrier": "post"})
}

/// The status of a delivery of sequence 1 of `aggregate`.
async fn deliver(gate: &GateProcess, aggregate: &str, message_type: &str, payload: Value) -> u16 {
    crate::helpers::client()
        .post(gate.url(&format!("/v1/aggregates/{aggregate}/messages")))
        .json(&json!({
            "messageId": format!("{aggregate}-1"),
            "sequence": 1,
            "type": message_type,
            "payload": payload,
        }))
        .send()
        .await
        .expect("POST a message")
        .status()
        .as_u16()
}

/// `/ready`'s configuration generation.
async fn generation(gate: &GateProcess) -> Option<u64> {
    let response = crate::helpers::client()
        .get(gate.url("/ready"))
        .send()
        .await
        .ok()?;
    let body: Value = response.json().await.ok()?;
    body["generation"].as_u64()
}

async fn wait_for_generation(gate: &GateProcess, expected: u64) {
    poll_until(
        &format!("/ready shows configuration generation {expected}"),
        || generation(gate),
        |seen| *seen == Some(expected),
    )
    .await;
}

async fn wait_for_log(files: &ReloadFiles, what: &str) -> String {
    poll_until(
        &format!("the gate logs '{what}'"),
        || std::future::ready(files.log()),
        |text| text.contains(what),
    )
    .await
}

/// The status of `GET /metrics` with `token`, and its text.
async fn scrape(gate: &GateProcess, token: &str) -> (u16, String) {
    let response = crate::helpers::client()
        .get(gate.url("/metrics"))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET /metrics");
    let status = response.status().as_u16();
    (status, response.text().await.expect("the body"))
}

#[tokio::test]
async fn a_reload_with_a_broken_schema_keeps_the_previous_set_names_the_file_and_its_key_and_the_gate_serves_on()
 {
    let files = ReloadFiles::new(&Settings::default());
    let mut gate = GateProcess::start(&files.config());
    assert_eq!(generation(&gate).await, Some(1));
    // A new type beside a broken schema: all or nothing, so neither is taken.
    files.configure(&Settings {
        shipped: true,
        reader_token: SECOND_TOKEN,
        ..Settings::default()
    });
    files.write("placed.json", r#"{"type": "object", "required": "#);
    gate.hang_up();
    let log = wait_for_log(&files, "configuration not reloaded").await;
    let refusal = log
        .lines()
        .find(|line| line.contains("configuration not reloaded"))
        .expect("the refusal's line");
    assert!(
        refusal.contains(r#"types."order.placed".schema"#),
        "{refusal}"
    );
    assert!(
        refusal.contains(&files.path("placed.json").display().to_string()),
        "{refusal}"
    );
    assert!(gate.is_running(), "the gate still runs");
    assert_eq!(generation(&gate).await, Some(1));
    assert_eq!(
        deliver(&gate, "order-a", "order.placed", placed()).await,
        200
    );
    assert_eq!(
        deliver(&gate, "order-b", "order.shipped", shipped()).await,
        422,
        "the new type of the refused file is not taken"
    );
    assert_eq!(scrape(&gate, FIRST_TOKEN).await.0, 200);
    assert_eq!(scrape(&gate, SECOND_TOKEN).await.0, 401);
}

#[tokio::test]
async fn a_reload_with_a_new_type_makes_that_type_valid_from_the_next_delivery_on() {
    let files = ReloadFiles::new(&Settings::default());
    let gate = GateProcess::start(&files.config());
    assert_eq!(
        deliver(&gate, "order-before", "order.shipped", shipped()).await,
        422,
        "an unknown type is poison"
    );
    files.configure(&Settings {
        shipped: true,
        ..Settings::default()
    });
    gate.hang_up();
    wait_for_generation(&gate, 2).await;
    assert_eq!(
        deliver(&gate, "order-after", "order.shipped", shipped()).await,
        200
    );
    assert_eq!(
        deliver(
            &gate,
            "order-refused",
            "order.shipped",
            json!({"orderId": "o-2"})
        )
        .await,
        422,
        "the new type's schema is checked"
    );
    let (status, metrics) = scrape(&gate, FIRST_TOKEN).await;
    assert_eq!(status, 200);
    assert!(
        metrics
            .lines()
            .any(|line| line == "gate_config_generation 2"),
        "{metrics}"
    );
    assert!(files.log().contains("configuration reloaded"));
}

#[tokio::test]
async fn a_readers_token_replaced_in_the_file_takes_effect_after_sighup() {
    let files = ReloadFiles::new(&Settings::default());
    let gate = GateProcess::start(&files.config());
    assert_eq!(scrape(&gate, FIRST_TOKEN).await.0, 200);
    assert_eq!(scrape(&gate, SECOND_TOKEN).await.0, 401);
    files.configure(&Settings {
        reader_token: SECOND_TOKEN,
        ..Settings::default()
    });
    gate.hang_up();
    wait_for_generation(&gate, 2).await;
    assert_eq!(scrape(&gate, FIRST_TOKEN).await.0, 401, "the removed token");
    assert_eq!(scrape(&gate, SECOND_TOKEN).await.0, 200, "the added token");
}

#[tokio::test]
async fn a_key_only_a_restart_takes_up_is_logged_as_such_and_keeps_its_running_value() {
    let files = ReloadFiles::new(&Settings::default());
    let mut gate = GateProcess::start(&files.config());
    files.configure(&Settings {
        store: "elsewhere.db",
        ..Settings::default()
    });
    gate.hang_up();
    wait_for_generation(&gate, 2).await;
    let log = wait_for_log(&files, "only a restart takes it up").await;
    let warning = log
        .lines()
        .find(|line| line.contains("only a restart takes it up"))
        .expect("the warning's line");
    assert!(warning.contains("\"store\""), "{warning}");
    assert!(gate.is_running());
    assert_eq!(
        deliver(&gate, "order-a", "order.placed", placed()).await,
        200
    );
    assert!(
        !files.path("elsewhere.db").exists(),
        "the store stays the running one"
    );
}

#[tokio::test]
async fn sighup_reloads_the_tls_pair_with_the_rest_of_the_configuration() {
    let first = Certificate::new();
    let second = Certificate::new();
    let files = ReloadFiles::new(&Settings {
        tls: true,
        ..Settings::default()
    });
    let install = |certificate: &Certificate| {
        files.write("cert.pem", &certificate.certificate_pem);
        files.write("key.pem", &certificate.key_pem);
    };
    install(&first);
    let gate = GateProcess::start(&files.config());
    let live = |certificate: &Certificate| {
        let client = certificate.client();
        let url = gate.url("/live");
        async move {
            client
                .get(url)
                .send()
                .await
                .map(|response| response.status().as_u16())
        }
    };
    assert_eq!(live(&first).await.ok(), Some(200));
    assert!(
        live(&second).await.is_err(),
        "the second certificate is not served yet"
    );
    install(&second);
    files.configure(&Settings {
        tls: true,
        shipped: true,
        ..Settings::default()
    });
    gate.hang_up();
    let _served = poll_until(
        "new connections are served the second certificate",
        || live(&second),
        |status| matches!(status, Ok(200)),
    )
    .await;
    assert!(
        live(&first).await.is_err(),
        "the first certificate is no longer served"
    );
    assert_eq!(generation_over_https(&gate, &second).await, Some(2));
}

/// `/ready`'s generation over HTTPS, trusting `certificate`.
async fn generation_over_https(gate: &GateProcess, certificate: &Certificate) -> Option<u64> {
    let response = certificate
        .client()
        .get(gate.url("/ready"))
        .send()
        .await
        .ok()?;
    let body: Value = response.json().await.ok()?;
    body["generation"].as_u64()
}

#[tokio::test]
async fn a_reload_whose_key_does_not_load_keeps_the_certificate_and_the_types_and_names_the_key_file()
 {
    let certificate = Certificate::new();
    let files = ReloadFiles::new(&Settings {
        tls: true,
        ..Settings::default()
    });
    files.write("cert.pem", &certificate.certificate_pem);
    files.write("key.pem", &certificate.key_pem);
    let gate = GateProcess::start(&files.config());
    files.write("key.pem", "not a key");
    files.configure(&Settings {
        tls: true,
        shipped: true,
        ..Settings::default()
    });
    gate.hang_up();
    let log = wait_for_log(&files, "configuration not reloaded").await;
    let refusal = log
        .lines()
        .find(|line| line.contains("configuration not reloaded"))
        .expect("the refusal's line");
    assert!(refusal.contains("tls.key"), "{refusal}");
    assert!(
        refusal.contains(&files.path("key.pem").display().to_string()),
        "{refusal}"
    );
    assert_eq!(generation_over_https(&gate, &certificate).await, Some(1));
    let shipped_status = certificate
        .client()
        .post(gate.url("/v1/aggregates/order-b/messages"))
        .json(&json!({
            "messageId": "order-b-1",
            "sequence": 1,
            "type": "order.shipped",
            "payload": shipped(),
        }))
        .send()
        .await
        .expect("POST a message over HTTPS")
        .status()
        .as_u16();
    assert_eq!(
        shipped_status, 422,
        "the new type of the refused file is not taken"
    );
}
