//! The gate's deployment across hosts on one machine: network namespaces around a bridge
//! ([`crate::netns`]), addresses from 10.213.0.0/16 that exist inside them only. PostgreSQL
//! serves TLS with a CA made here and asks for SCRAM; three NATS servers serve TLS, know the
//! gates by an nkey and the producers by a password, and (unless told otherwise) sync every
//! write (`sync_interval: always`, a current nats-server). Each gate reaches PostgreSQL over a
//! link of its own, so that one can be cut alone; everything else travels on the bridge.
//!
//! `tests/api/gate_netns.rs` and the chaos campaign ([`super`]) both build on it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use tempfile::TempDir;

use crate::lazyfs::LazyFs;
use crate::nats::{NatsServer, current_nats_binary};
use crate::netns::{Host, Link, Topology};
use crate::pg::{ClusterOptions, PrivateCluster};

use super::ChaosError;

pub const DATABASE_PASSWORD: &str = "gate-password-across-hosts";
pub const PRODUCER_USER: &str = "shop";
pub const PRODUCER_PASSWORD: &str = "shop-password-across-hosts";
pub const INPUT_STREAM: &str = "GATE_IN";
pub const INPUT_PREFIX: &str = "gate.in";
pub const OUTPUT_STREAM: &str = "GATE_OUT";
pub const OUTPUT_PREFIX: &str = "gate.out";
/// The subjects the gates' gap notices go to (`gaps.` and the input's prefix).
pub const GAP_SUBJECTS: &str = "gaps.gate.in.*";
/// The network every host's addresses are in.
pub const NETWORK: &str = "10.213.0.0/16";

pub const PLACED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "amount"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "amount": {"type": "integer", "minimum": 0}
  }
}"#;

pub const SHIPPED_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["orderId", "carrier"],
  "properties": {
    "orderId": {"type": "string", "minLength": 1},
    "carrier": {"type": "string", "minLength": 1}
  }
}"#;

/// A CA made for one run, and the certificates it signs for every address a server is reached
/// at.
pub struct Authority {
    pub ca_pem: String,
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Authority {
    pub fn new() -> Result<Authority, ChaosError> {
        let setup = |error: rcgen::Error| ChaosError::setup("the test CA", error);
        let ca_key = rcgen::KeyPair::generate().map_err(setup)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(setup)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "production-lab netns CA");
        let issuer = rcgen::CertifiedIssuer::self_signed(params, ca_key).map_err(setup)?;
        Ok(Authority {
            ca_pem: issuer.pem(),
            issuer,
        })
    }

    /// A certificate and its key (PEM) naming `addresses`.
    pub fn server(&self, addresses: &[String]) -> Result<(String, String), ChaosError> {
        let setup = |error: rcgen::Error| ChaosError::setup("a server certificate", error);
        let key = rcgen::KeyPair::generate().map_err(setup)?;
        let mut params = rcgen::CertificateParams::new(addresses.to_vec()).map_err(setup)?;
        let name = addresses.first().map_or("server", String::as_str);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let certificate = params.signed_by(&key, &self.issuer).map_err(setup)?;
        Ok((certificate.pem(), key.serialize_pem()))
    }
}

/// The hosts: one bridge for all, and a link of its own from each gate to PostgreSQL.
pub struct Hosts {
    pub postgres: Host,
    pub nats: [Host; 3],
    pub gates: [Host; 2],
    /// Where the campaign's own clients run: the output's reader, the setup's requests.
    pub client: Host,
    /// One host per producer.
    pub producers: Vec<Host>,
    /// Each gate's link to PostgreSQL.
    pub store_links: [Link; 2],
}

/// Makes the hosts in `topology`, with `producers` producer hosts.
pub fn hosts(topology: &mut Topology, producers: usize) -> Result<Hosts, ChaosError> {
    let mut host = |name: &str| topology.host(name);
    let postgres = host("pg")?;
    let nats = [host("n1")?, host("n2")?, host("n3")?];
    let gates = [host("ga")?, host("gb")?];
    let client = host("cl")?;
    let producers = (0..producers)
        .map(|index| host(&format!("p{index}")))
        .collect::<Result<Vec<_>, _>>()?;
    let store_links = [
        topology.link(&gates[0], &postgres)?,
        topology.link(&gates[1], &postgres)?,
    ];
    Ok(Hosts {
        postgres,
        nats,
        gates,
        client,
        producers,
        store_links,
    })
}

impl Hosts {
    /// PostgreSQL's address on gate `index`'s link.
    pub fn postgres_address_for(&self, index: usize) -> Result<String, ChaosError> {
        self.store_links[index]
            .address_in(&self.postgres)
            .map(|address| address.to_string())
            .ok_or_else(|| ChaosError::Setup("PostgreSQL's end of a gate's link".to_owned()))
    }

    pub fn nats_urls(&self) -> Vec<String> {
        self.nats
            .iter()
            .map(|host| format!("nats://{}:4222", host.address))
            .collect()
    }
}

/// PostgreSQL on its host, on both its link addresses, TLS with `authority`'s certificate and
/// SCRAM for the role `gate` owning the database `gate`. Set up over its Unix socket, which is
/// reachable from any namespace.
pub async fn postgres(
    hosts: &Hosts,
    authority: &Authority,
    options: ClusterOptions,
) -> Result<PrivateCluster, ChaosError> {
    let addresses = vec![
        hosts.postgres_address_for(0)?,
        hosts.postgres_address_for(1)?,
    ];
    let cluster = PrivateCluster::start_in_namespace(
        options,
        &hosts.postgres.namespace,
        &addresses.join(","),
        NETWORK,
    )?;
    let (admin, connection) =
        tokio_postgres::connect(&cluster.socket_url("postgres"), tokio_postgres::NoTls)
            .await
            .map_err(|error| ChaosError::setup("the superuser over the socket", error))?;
    tokio::spawn(connection);
    for statement in [
        "SET password_encryption = 'scram-sha-256'".to_owned(),
        format!("CREATE ROLE gate LOGIN PASSWORD '{DATABASE_PASSWORD}'"),
        "CREATE DATABASE gate OWNER gate".to_owned(),
    ] {
        admin
            .batch_execute(&statement)
            .await
            .map_err(|error| ChaosError::setup("the gate's role and database", error))?;
    }
    drop(admin);
    let (certificate, key) = authority.server(&addresses)?;
    cluster.require_tls_and_password(&certificate, &key, None)?;
    Ok(cluster)
}

/// How the NATS servers write to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsSync {
    /// `sync_interval: always`: every write flushed before it is acknowledged.
    Always,
    /// The server's default: flushed every two minutes, acknowledged before.
    Lazy,
}

/// The configuration of NATS node `index` on `host`.
fn nats_config(
    index: usize,
    host: &Host,
    tls: &str,
    gate_key: &str,
    routes: &[String],
    sync: NatsSync,
) -> String {
    let sync_line = match sync {
        NatsSync::Always => "\n  sync_interval: always",
        NatsSync::Lazy => "",
    };
    format!(
        r#"server_name: n{index}
listen: "{address}:4222"
{tls}
authorization {{
  users = [
    {{ nkey: {gate_key} }}
    {{ user: {PRODUCER_USER}, password: "{PRODUCER_PASSWORD}" }}
  ]
}}
jetstream {{
  store_dir: "{{store}}"{sync_line}
}}
cluster {{
  name: gate-nats
  listen: "{address}:6222"
  {tls}
  routes: [{routes}]
}}
"#,
        address = host.address,
        routes = routes.join(", ")
    )
}

/// A lazy file system for each of `nodes` NATS nodes' stores, mounted under `dir` (`nN-store`
/// over `nN-backing`): a power loss of a node forgets what it did not sync. Made before the
/// servers start, so that `ip netns exec` finds them in the mount namespace it copies.
pub fn lazy_stores(dir: &Path, nodes: usize) -> Result<Vec<LazyFs>, ChaosError> {
    (0..nodes)
        .map(|index| {
            let backing = dir.join(format!("n{index}-backing"));
            let mountpoint = dir.join(format!("n{index}-store"));
            std::fs::create_dir_all(&backing)?;
            std::fs::create_dir_all(&mountpoint)?;
            Ok(LazyFs::mount(&backing, &mountpoint)?)
        })
        .collect()
}

/// The three NATS servers: TLS for clients and routes, the gates' nkey user and the producers'
/// password user, every write synced unless `sync` is [`NatsSync::Lazy`]. `dir` gets the CA
/// (`ca.pem`) and the servers' certificates. Node N's store is on `stores[N]` if there is one
/// (see [`lazy_stores`]), else in its own directory.
pub fn nats_cluster(
    topology: &Topology,
    hosts: &Hosts,
    authority: &Authority,
    dir: &Path,
    gate_key: &str,
    sync: NatsSync,
    stores: &[LazyFs],
) -> Result<Vec<NatsServer>, ChaosError> {
    let binary = current_nats_binary()?;
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &authority.ca_pem)?;
    let routes: Vec<String> = hosts
        .nats
        .iter()
        .map(|host| format!("\"nats-route://{}:6222\"", host.address))
        .collect();
    let mut servers = Vec::with_capacity(hosts.nats.len());
    for (index, host) in hosts.nats.iter().enumerate() {
        let (certificate, key) = authority.server(&[host.address.to_string()])?;
        let certificate_file = dir.join(format!("n{index}.crt"));
        let key_file = dir.join(format!("n{index}.key"));
        std::fs::write(&certificate_file, certificate)?;
        std::fs::write(&key_file, key)?;
        let tls = format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  timeout: 5\n}}",
            certificate_file.display(),
            key_file.display(),
            ca.display()
        );
        let config = nats_config(index, host, &tls, gate_key, &routes, sync);
        let store = stores.get(index).map(|fs| fs.mountpoint().join("store"));
        servers.push(NatsServer::start_node_on(
            topology.command(host, &binary),
            &config,
            store.as_deref(),
        )?);
    }
    Ok(servers)
}

/// Retries `attempt` every 250 ms until it succeeds or `within` passed; the last error names
/// `what`.
pub async fn retry_within<T, E: std::fmt::Display, F, Fut>(
    what: &str,
    within: Duration,
    mut attempt: F,
) -> Result<T, ChaosError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if Instant::now() >= deadline => {
                return Err(ChaosError::Setup(format!("{what}: {error}")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// A NATS client of the producers' user (TLS with the CA in `ca`, the password), reconnecting
/// for ever, connected to any of the cluster's servers.
pub async fn producer_client(hosts: &Hosts, ca: &Path) -> Result<async_nats::Client, ChaosError> {
    let urls: Vec<async_nats::ServerAddr> = hosts
        .nats_urls()
        .iter()
        .filter_map(|url| url.parse().ok())
        .collect();
    retry_within(
        "the producers connect to the NATS cluster",
        Duration::from_secs(30),
        || {
            let urls = urls.clone();
            async move {
                async_nats::ConnectOptions::new()
                    .add_root_certificates(ca.to_path_buf())
                    .require_tls(true)
                    .user_and_password(PRODUCER_USER.to_owned(), PRODUCER_PASSWORD.to_owned())
                    .connection_timeout(Duration::from_secs(3))
                    .max_reconnects(None)
                    .connect(urls)
                    .await
            }
        },
    )
    .await
}

/// The producers' JetStream context (see [`producer_client`]), answers awaited 10 s at most.
pub async fn producer_jetstream(
    hosts: &Hosts,
    ca: &Path,
) -> Result<jetstream::Context, ChaosError> {
    let mut context = jetstream::new(producer_client(hosts, ca).await?);
    context.set_timeout(Duration::from_secs(10));
    Ok(context)
}

/// The input and output streams, three replicas on file, before any gate starts; the output's
/// duplicate window is `output_window`. Retried until the cluster has its JetStream leader.
pub async fn create_streams(
    js: &jetstream::Context,
    output_window: Duration,
) -> Result<(), ChaosError> {
    for (name, subjects, window) in [
        (
            INPUT_STREAM,
            format!("{INPUT_PREFIX}.*"),
            Duration::from_secs(120),
        ),
        (OUTPUT_STREAM, format!("{OUTPUT_PREFIX}.>"), output_window),
    ] {
        let config = StreamConfig {
            name: name.to_owned(),
            subjects: vec![subjects],
            storage: StorageType::File,
            num_replicas: 3,
            duplicate_window: window,
            allow_direct: true,
            ..Default::default()
        };
        retry_within(
            &format!("the cluster creates {name} with three replicas"),
            Duration::from_secs(30),
            || async { js.get_or_create_stream(config.clone()).await.map(|_| ()) },
        )
        .await?;
    }
    Ok(())
}

/// A gate's directory: its configuration, schemas, TLS files and NATS seed.
pub struct GateFiles {
    pub dir: TempDir,
    pub config: PathBuf,
    /// `GATE_DATABASE_URL`: PostgreSQL over the gate's own link.
    pub database_url: String,
}

impl GateFiles {
    /// The gate's log file (its standard error), beside the configuration.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("gate.log")
    }
}

/// A gate's directory on `host`: HTTPS on its bridge address with `https` (certificate, key),
/// PostgreSQL at `postgres_address` with verify-full and SCRAM, the NATS cluster over TLS with
/// the nkey `seed`, a lease of one second, and room for every producer's rate.
pub fn gate_files(
    host: &Host,
    postgres_address: &str,
    hosts: &Hosts,
    authority: &Authority,
    https: &(String, String),
    seed: &str,
) -> Result<GateFiles, ChaosError> {
    let dir = tempfile::tempdir()?;
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text);
    write("placed.json", PLACED_SCHEMA)?;
    write("shipped.json", SHIPPED_SCHEMA)?;
    write("ca.pem", &authority.ca_pem)?;
    write("cert.pem", &https.0)?;
    write("key.pem", &https.1)?;
    write("gate.nk", seed)?;
    let urls: Vec<String> = hosts
        .nats_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    write(
        "gate.toml",
        &format!(
            r#"[listen]
address = "{address}:8443"

[tls]
certificate = "cert.pem"
key = "key.pem"

[store]
postgres_url_env = "GATE_DATABASE_URL"
sslmode = "verify-full"
sslrootcert = "ca.pem"
password_env = "GATE_DATABASE_PASSWORD"

[limits]
producer_rate_per_second = 100000
producer_burst = 100000

[nats]
urls = [{urls}]

[nats.tls]
ca = "ca.pem"

[nats.auth]
nkey_seed_file = "gate.nk"

[nats.input]
stream = "{INPUT_STREAM}"
subject_prefix = "{INPUT_PREFIX}"
durable = "gate"

[nats.output]
stream = "{OUTPUT_STREAM}"
subject_prefix = "{OUTPUT_PREFIX}"

[publisher]
lease_ms = 1000

[types."order.placed"]
schema = "placed.json"

[types."order.shipped"]
schema = "shipped.json"
"#,
            address = host.address,
            urls = urls.join(", ")
        ),
    )?;
    let config = dir.path().join("gate.toml");
    let database_url = format!("postgres://gate@{postgres_address}:5432/gate");
    Ok(GateFiles {
        dir,
        config,
        database_url,
    })
}

/// `binary` (`production-lab`) as a gate on `host` with `files`' secrets in its environment;
/// `gate --config FILE` is for the caller to add.
pub fn gate_command(topology: &Topology, host: &Host, binary: &Path, files: &GateFiles) -> Command {
    let mut program = topology.command(host, binary);
    program
        .env_remove("LAB_ENVIRONMENT")
        .env_remove("LAB_LOG")
        .env("GATE_DATABASE_URL", &files.database_url)
        .env("GATE_DATABASE_PASSWORD", DATABASE_PASSWORD);
    program
}
