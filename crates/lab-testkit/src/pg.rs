//! A private PostgreSQL cluster for the tests and `bench ordered --backend postgres`: `initdb`
//! into a fresh temp directory, started with `pg_ctl` on a free loopback port (and a Unix socket
//! in the same directory), one database per user of it.
//!
//! As root (CI, this lab's machines) the server binaries refuse to run, so every step runs as the
//! `postgres` system user (`runuser -u postgres --`) in a directory that user owns.
//!
//! Nothing is left behind: each cluster has a watchdog process (`sh`) whose standard input is a
//! pipe from this process. When this process ends, however it ends (a finished test binary whose
//! statics are never dropped, a panic, SIGKILL), the kernel closes the pipe, the watchdog's `cat`
//! returns, and it stops the cluster and removes its directory. Dropping the handle does the same
//! at once.

use std::io::Write as _;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::process::{parent_pid, process_cpu_ticks, reaped_children_cpu_ticks};

/// The database superuser of a private cluster (trust authentication, loopback only).
pub const SUPERUSER: &str = "postgres";

/// Why a private cluster could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found under /usr/lib/postgresql/*/bin nor in `pg_config --bindir`: install the Debian package `postgresql` (apt-get install postgresql)"
    )]
    MissingBinaries,
    #[error(
        "running as root, but there is no `postgres` system user to run the PostgreSQL server as: install the Debian package `postgresql`, which creates it"
    )]
    NoPostgresUser,
    #[error("{step}: {detail}")]
    Step { step: String, detail: String },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// How the cluster runs.
#[derive(Debug, Clone, Copy)]
pub struct ClusterOptions {
    /// `fsync` of the server: off makes tests fast; a stopped or killed server still keeps
    /// every committed transaction (only an operating-system crash could lose them).
    pub fsync: bool,
    pub max_connections: u32,
    /// Loads `pg_stat_statements` (every statement, nested and utility ones included), so that
    /// a bench can tell what each statement costs.
    pub statement_statistics: bool,
}

impl ClusterOptions {
    /// For tests: no fsync, room for many pools.
    pub fn for_tests() -> ClusterOptions {
        ClusterOptions {
            fsync: false,
            max_connections: 300,
            statement_statistics: false,
        }
    }

    /// For the bench: durable commits, as SQLite's `synchronous=full`.
    pub fn durable() -> ClusterOptions {
        ClusterOptions {
            fsync: true,
            max_connections: 100,
            statement_statistics: true,
        }
    }
}

/// A running private cluster; stopped and removed on drop (or by its watchdog).
pub struct PrivateCluster {
    bindir: PathBuf,
    root: PathBuf,
    data: PathBuf,
    port: u16,
    /// Run the server binaries as the `postgres` user.
    as_postgres: bool,
    /// The network namespace the server runs in (`ip netns exec`), if not this process's.
    netns: Option<String>,
    /// `listen_addresses`, and the network `hostssl` lines admit.
    listen: String,
    clients: String,
    watchdog: Option<(Child, ChildStdin)>,
}

impl std::fmt::Debug for PrivateCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PrivateCluster({}:{}, {})",
            self.listen,
            self.port,
            self.root.display()
        )
    }
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: the newest
/// `/usr/lib/postgresql/*/bin`, else `pg_config --bindir`.
pub fn find_bindir() -> Result<PathBuf, ClusterError> {
    let complete = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres", "createdb"]
            .iter()
            .all(|name| dir.join(name).is_file())
    };
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| complete(dir))
        .collect();
    versions.sort();
    if let Some((_, dir)) = versions.pop() {
        return Ok(dir);
    }
    let configured = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    match configured {
        Some(dir) if complete(&dir) => Ok(dir),
        _ => Err(ClusterError::MissingBinaries),
    }
}

/// The live processes whose parent is `parent`, from /proc.
fn children_of(parent: u32) -> Option<Vec<u32>> {
    let children = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| parent_pid(*pid) == Some(parent))
        .collect();
    Some(children)
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}

fn free_port() -> Result<u16, ClusterError> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn checked(step: &str, output: std::io::Result<Output>) -> Result<Output, ClusterError> {
    let output = output.map_err(|error| ClusterError::Step {
        step: step.to_owned(),
        detail: error.to_string(),
    })?;
    if output.status.success() {
        Ok(output)
    } else {
        let text = format!(
            "{} {}",
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Err(ClusterError::Step {
            step: step.to_owned(),
            detail: format!("{} ({})", text.trim(), output.status),
        })
    }
}

/// Stops the cluster in `$1` with pg_ctl `$2` (as user `$4` when given) once standard input
/// closes, then removes `$3`. Terminal signals are ignored, so that a Ctrl+C of the test run
/// still ends with the cleanup rather than skipping it.
const WATCHDOG: &str = r#"trap '' INT HUP TERM
cat >/dev/null
if [ -n "$4" ]; then
  runuser -u "$4" -- "$2" -D "$1" stop -m immediate -w >/dev/null 2>&1
else
  "$2" -D "$1" stop -m immediate -w >/dev/null 2>&1
fi
rm -rf "$3"
"#;

impl PrivateCluster {
    /// Creates and starts a cluster. Fails with a message naming the Debian package when the
    /// binaries are missing.
    pub fn start(options: ClusterOptions) -> Result<PrivateCluster, ClusterError> {
        PrivateCluster::start_placed(options, None, "127.0.0.1", "127.0.0.1/32")
    }

    /// [`PrivateCluster::start`] in the network namespace `netns`, listening on `listen`
    /// (PostgreSQL's `listen_addresses`: addresses of that namespace) at port 5432, the only
    /// server there; TCP clients from `clients` (a network) are the ones
    /// [`PrivateCluster::require_tls_and_password`] admits. The Unix socket is reachable from
    /// any namespace ([`PrivateCluster::socket_url`]).
    pub fn start_in_namespace(
        options: ClusterOptions,
        netns: &str,
        listen: &str,
        clients: &str,
    ) -> Result<PrivateCluster, ClusterError> {
        PrivateCluster::start_placed(options, Some(netns), listen, clients)
    }

    fn start_placed(
        options: ClusterOptions,
        netns: Option<&str>,
        listen: &str,
        clients: &str,
    ) -> Result<PrivateCluster, ClusterError> {
        let bindir = find_bindir()?;
        let as_postgres = running_as_root();
        let has_user = || {
            Command::new("id")
                .arg("-u")
                .arg(SUPERUSER)
                .output()
                .is_ok_and(|output| output.status.success())
        };
        if as_postgres && !has_user() {
            return Err(ClusterError::NoPostgresUser);
        }
        let root = tempfile::Builder::new()
            .prefix("production-lab-pg-")
            .tempdir()?
            .keep();
        let data = root.join("data");
        let mut cluster = PrivateCluster {
            bindir,
            data,
            port: 0,
            as_postgres,
            netns: netns.map(str::to_owned),
            listen: listen.to_owned(),
            clients: clients.to_owned(),
            watchdog: None,
            root,
        };
        // From here on the watchdog removes the directory whatever happens.
        cluster.start_watchdog()?;
        if as_postgres {
            checked(
                "chown the cluster directory to postgres",
                Command::new("chown")
                    .arg(format!("{SUPERUSER}:{SUPERUSER}"))
                    .arg(&cluster.root)
                    .output(),
            )?;
        }
        cluster.initdb(options)?;
        let mut last_error = None;
        for _ in 0..5 {
            cluster.port = if cluster.netns.is_some() {
                5432
            } else {
                free_port()?
            };
            cluster.write_port()?;
            match cluster.start_server() {
                Ok(()) => return Ok(cluster),
                // Another process may have taken the port between the probe and the start.
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or(ClusterError::Step {
            step: "pg_ctl start".to_owned(),
            detail: "no attempt was made".to_owned(),
        }))
    }

    fn start_watchdog(&mut self) -> Result<(), ClusterError> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("production-lab-pg-watchdog")
            .arg(&self.data)
            .arg(self.bindir.join("pg_ctl"))
            .arg(&self.root)
            .arg(if self.as_postgres { SUPERUSER } else { "" })
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take().ok_or_else(|| ClusterError::Step {
            step: "watchdog".to_owned(),
            detail: "no stdin pipe".to_owned(),
        })?;
        self.watchdog = Some((child, stdin));
        Ok(())
    }

    /// A command for one of the server binaries, as the right user.
    fn server_command(&self, binary: &str) -> Command {
        let mut words: Vec<std::ffi::OsString> = Vec::new();
        if let Some(netns) = &self.netns {
            words.extend(["ip", "netns", "exec", netns.as_str()].map(Into::into));
        }
        if self.as_postgres {
            words.extend(["runuser", "-u", SUPERUSER, "--"].map(Into::into));
        }
        words.push(self.bindir.join(binary).into());
        let mut command = Command::new(&words[0]);
        command.args(&words[1..]);
        command
    }

    fn initdb(&self, options: ClusterOptions) -> Result<(), ClusterError> {
        checked(
            "initdb",
            self.server_command("initdb")
                .arg("-D")
                .arg(&self.data)
                .args(["-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--no-locale"])
                .arg("--no-sync")
                .stdin(Stdio::null())
                .output(),
        )?;
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))?;
        writeln!(
            conf,
            "\n# production-lab private cluster\nlisten_addresses = '{}'\nunix_socket_directories = '{}'\nmax_connections = {}\nfsync = {}\nlogging_collector = off",
            self.listen,
            self.root.display(),
            options.max_connections,
            if options.fsync { "on" } else { "off" },
        )?;
        if options.statement_statistics {
            writeln!(
                conf,
                "shared_preload_libraries = 'pg_stat_statements'\npg_stat_statements.track = all\npg_stat_statements.track_utility = on"
            )?;
        }
        Ok(())
    }

    /// The port goes into `postgresql.auto.conf`, so that `start_again` reuses it.
    fn write_port(&self) -> Result<(), ClusterError> {
        let path = self.data.join("postgresql.auto.conf");
        std::fs::write(&path, format!("port = {}\n", self.port))?;
        if self.as_postgres {
            checked(
                "chown postgresql.auto.conf",
                Command::new("chown")
                    .arg(format!("{SUPERUSER}:{SUPERUSER}"))
                    .arg(&path)
                    .output(),
            )?;
        }
        Ok(())
    }

    fn start_server(&self) -> Result<(), ClusterError> {
        checked(
            "pg_ctl start",
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(self.root.join("server.log"))
                .args(["-w", "-t", "60", "start"])
                .stdin(Stdio::null())
                .output(),
        )
        .map_err(|error| ClusterError::Step {
            step: "pg_ctl start".to_owned(),
            detail: format!("{error}; server log: {}", self.log_tail()),
        })?;
        Ok(())
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.root.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the cluster's binaries are (`pgbench` among them).
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// The URL of `database` over loopback TCP.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// The URL of `database` over the cluster's Unix socket.
    pub fn socket_url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}@/{database}?host={}&port={}",
            self.root.display(),
            self.port
        )
    }

    /// Creates an empty database and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, ClusterError> {
        checked(
            "createdb",
            Command::new(self.bindir.join("createdb"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", SUPERUSER, name])
                .stdin(Stdio::null())
                .output(),
        )?;
        Ok(self.url(name))
    }

    /// Stops the server (fast shutdown: sessions are ended, committed work is kept).
    pub fn stop(&self) -> Result<(), ClusterError> {
        checked(
            "pg_ctl stop",
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "fast", "-w", "stop"])
                .stdin(Stdio::null())
                .output(),
        )?;
        Ok(())
    }

    /// CPU time (user + system, in clock ticks) used so far by the postmaster and its
    /// children: the live ones (the backends serving connections) and those that ended (the
    /// backends of clients that disconnected, such as pgbench's), where /proc tells it.
    ///
    /// A backend that ends while this reads is in neither sum: read after the clients that
    /// disconnected have had their backends reaped ([`PrivateCluster::wait_for_children`]).
    pub fn cpu_ticks(&self) -> Option<u64> {
        let postmaster = self.postmaster()?;
        let mut total =
            process_cpu_ticks(postmaster)? + reaped_children_cpu_ticks(postmaster).unwrap_or(0);
        for pid in children_of(postmaster)? {
            total += process_cpu_ticks(pid).unwrap_or(0);
        }
        Some(total)
    }

    /// The postmaster's live child processes (backends and background workers), if known.
    pub fn child_count(&self) -> Option<usize> {
        Some(children_of(self.postmaster()?)?.len())
    }

    /// Waits, at most `limit`, until the postmaster has at most `count` children: the
    /// backends of clients that disconnected have ended and been reaped, so their CPU is in
    /// the postmaster's count of reaped children. Answers whether it came to that.
    pub fn wait_for_children(&self, count: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.child_count().is_some_and(|now| now <= count) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn postmaster(&self) -> Option<u32> {
        let pid_file = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        pid_file.lines().next()?.trim().parse().ok()
    }

    /// Serves TLS with `certificate_pem` and `key_pem`, and asks every TCP client for a
    /// SCRAM-SHA-256 password over TLS (`hostssl all all 127.0.0.1/32 scram-sha-256`, or the
    /// namespace's client network); plain TCP
    /// is refused and the Unix socket stays trusted. Restarts the server. Set the roles'
    /// passwords before (the superuser's TCP trust ends here).
    /// With `client_ca_pem`, a client must also show a certificate that CA signed
    /// (`clientcert=verify-ca`).
    pub fn require_tls_and_password(
        &self,
        certificate_pem: &str,
        key_pem: &str,
        client_ca_pem: Option<&str>,
    ) -> Result<(), ClusterError> {
        let certificate = self.data.join("server.crt");
        let key = self.data.join("server.key");
        std::fs::write(&certificate, certificate_pem)?;
        std::fs::write(&key, key_pem)?;
        // PostgreSQL refuses a key file others can read.
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let client_ca = self.data.join("client-ca.crt");
        std::fs::write(&client_ca, client_ca_pem.unwrap_or(""))?;
        let (client_check, ca_line) = match client_ca_pem {
            Some(_) => (" clientcert=verify-ca", "\nssl_ca_file = 'client-ca.crt'"),
            None => ("", ""),
        };
        let hba = self.data.join("pg_hba.conf");
        std::fs::write(
            &hba,
            format!(
                "local all all trust\nhostssl all all {} scram-sha-256{client_check}\n",
                self.clients
            ),
        )?;
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))?;
        writeln!(
            conf,
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\npassword_encryption = 'scram-sha-256'{ca_line}"
        )?;
        if self.as_postgres {
            checked(
                "chown the TLS files to postgres",
                Command::new("chown")
                    .arg(format!("{SUPERUSER}:{SUPERUSER}"))
                    .args([&certificate, &key, &hba, &client_ca])
                    .output(),
            )?;
        }
        self.stop()?;
        self.start_server()
    }

    /// Stops the server at once (`-m immediate`: no checkpoint, recovery from the WAL at the
    /// next start), as a crash would.
    pub fn stop_immediately(&self) -> Result<(), ClusterError> {
        checked(
            "pg_ctl stop -m immediate",
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "stop"])
                .stdin(Stdio::null())
                .output(),
        )?;
        Ok(())
    }

    /// Starts the stopped server again on the same port and data.
    pub fn start_again(&self) -> Result<(), ClusterError> {
        self.start_server()
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        if let Some((mut child, stdin)) = self.watchdog.take() {
            // Closing the pipe is the watchdog's signal: it stops the server and removes the
            // directory; wait for it, so that nothing outlives the handle.
            drop(stdin);
            let _ = child.wait();
        }
    }
}
