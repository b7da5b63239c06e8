//! Hosts made of network namespaces, for tests across hosts on one machine.
//!
//! A [`Topology`] makes one namespace per host and a hub namespace holding a Linux bridge; each
//! host's `eth0` is a veth whose peer is a port of that bridge, with an address from
//! 10.213.0.0/24 ([`Topology::host`]). [`Topology::link`] adds a point-to-point veth between two
//! hosts (10.213.K.1 and .2/24, K from 1), a path that can be cut alone
//! ([`Topology::set_link`]). The addresses exist inside the namespaces only: nothing outside
//! them is reachable, nor a target.
//!
//! A process runs on a host with `ip netns exec` ([`Topology::command`]), which execs the
//! program in place (the child's pid is the program's). A thread of this process may enter a
//! host ([`enter`]); sockets it and the threads it spawns open are that host's.
//!
//! Nothing is left behind: dropping the topology kills the processes still inside its
//! namespaces and deletes them (a namespace's veths go with it). A watchdog (`sh`) reading a
//! pipe from this process does the same when this process ends without dropping it (a panic in
//! a static, SIGKILL). Namespaces need root: without it the topology is refused with a message
//! saying so.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Why a topology could not be made or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "network namespaces need root (ip netns add): run the test as root, as scripts/test does in CI"
    )]
    NotRoot,
    #[error("`ip` (iproute2) not found: install the Debian package `iproute2`")]
    MissingIp,
    #[error("{command}: {detail}")]
    Step { command: String, detail: String },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// One host: its namespace and its address on the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    pub namespace: String,
    pub address: Ipv4Addr,
}

/// A point-to-point veth between two hosts: each end's device and address.
#[derive(Debug, Clone)]
pub struct Link {
    pub ends: [(String, String, Ipv4Addr); 2],
}

impl Link {
    /// The address of the end in `host`.
    pub fn address_in(&self, host: &Host) -> Option<Ipv4Addr> {
        self.ends
            .iter()
            .find(|(namespace, _, _)| *namespace == host.namespace)
            .map(|(_, _, address)| *address)
    }
}

/// Hosts as network namespaces around one bridge; deleted when dropped.
pub struct Topology {
    prefix: String,
    hub: String,
    namespaces: Vec<String>,
    links: u8,
    watchdog: Option<(Child, ChildStdin)>,
}

/// Deletes every namespace whose name starts with `$1`, once standard input closes, after
/// killing the processes inside. Terminal signals are ignored so that a Ctrl+C of the test run
/// still ends with the cleanup.
const WATCHDOG: &str = r#"trap '' INT HUP TERM
cat >/dev/null
for ns in $(ip netns list | cut -d' ' -f1); do
  case "$ns" in
    "$1"*)
      for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null ;;
  esac
done
"#;

fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => NetnsError::MissingIp,
            _ => NetnsError::Io(error),
        })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(NetnsError::Step {
            command: format!("ip {}", args.join(" ")),
            detail: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

impl Topology {
    /// An empty topology: the hub namespace and its bridge. Names start with `pl` and this
    /// process's id, so that concurrent tests and test binaries never share one.
    pub fn new() -> Result<Topology, NetnsError> {
        if std::fs::metadata("/proc/self").map(|meta| meta.uid())? != 0 {
            return Err(NetnsError::NotRoot);
        }
        static MADE: AtomicU32 = AtomicU32::new(0);
        let prefix = format!(
            "pl{}x{}-",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("production-lab-netns-watchdog")
            .arg(&prefix)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take().ok_or_else(|| NetnsError::Step {
            command: "watchdog".to_owned(),
            detail: "no stdin pipe".to_owned(),
        })?;
        let mut topology = Topology {
            hub: format!("{prefix}hub"),
            prefix,
            namespaces: Vec::new(),
            links: 0,
            watchdog: Some((child, stdin)),
        };
        let hub = topology.hub.clone();
        topology.add_namespace(&hub)?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        Ok(topology)
    }

    fn add_namespace(&mut self, namespace: &str) -> Result<(), NetnsError> {
        ip(&["netns", "add", namespace])?;
        self.namespaces.push(namespace.to_owned());
        ip(&["-n", namespace, "link", "set", "lo", "up"])
    }

    /// A new host named `name` (a short word), on the bridge at the next address.
    pub fn host(&mut self, name: &str) -> Result<Host, NetnsError> {
        let namespace = format!("{}{name}", self.prefix);
        // The hub is the first namespace; hosts take 10.213.0.1, .2, … in order.
        let index = self.namespaces.len();
        let address = Ipv4Addr::new(10, 213, 0, u8::try_from(index).unwrap_or(u8::MAX));
        self.add_namespace(&namespace)?;
        let port = format!("h{index}");
        ip(&[
            "-n", &self.hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
            &namespace,
        ])?;
        ip(&["-n", &self.hub, "link", "set", &port, "master", "br0"])?;
        ip(&["-n", &self.hub, "link", "set", &port, "up"])?;
        ip(&[
            "-n",
            &namespace,
            "addr",
            "add",
            &format!("{address}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &namespace, "link", "set", "eth0", "up"])?;
        Ok(Host { namespace, address })
    }

    /// A point-to-point veth `pK` between `a` (10.213.K.1) and `b` (10.213.K.2).
    pub fn link(&mut self, a: &Host, b: &Host) -> Result<Link, NetnsError> {
        self.links += 1;
        let k = self.links;
        let device = format!("p{k}");
        ip(&[
            "-n",
            &a.namespace,
            "link",
            "add",
            &device,
            "type",
            "veth",
            "peer",
            "name",
            &device,
            "netns",
            &b.namespace,
        ])?;
        let ends = [
            (
                a.namespace.clone(),
                device.clone(),
                Ipv4Addr::new(10, 213, k, 1),
            ),
            (
                b.namespace.clone(),
                device.clone(),
                Ipv4Addr::new(10, 213, k, 2),
            ),
        ];
        for (namespace, device, address) in &ends {
            ip(&[
                "-n",
                namespace,
                "addr",
                "add",
                &format!("{address}/24"),
                "dev",
                device,
            ])?;
            ip(&["-n", namespace, "link", "set", device, "up"])?;
        }
        Ok(Link { ends })
    }

    /// Takes both ends of `link` down (`up == false`: packets on it are lost, as on a cut
    /// cable) or up again.
    pub fn set_link(&self, link: &Link, up: bool) -> Result<(), NetnsError> {
        let state = if up { "up" } else { "down" };
        for (namespace, device, _) in &link.ends {
            ip(&["-n", namespace, "link", "set", device, state])?;
        }
        Ok(())
    }

    /// Drops every packet `from` sends to `to`'s bridge address (a blackhole route in `from`'s
    /// namespace, more specific than the bridge's network), or lets them pass again. Both
    /// directions cut ([`Topology::set_reachable`]) make a partition between two hosts of the
    /// bridge while each still reaches the others.
    pub fn set_route(&self, from: &Host, to: &Host, reachable: bool) -> Result<(), NetnsError> {
        let target = format!("{}/32", to.address);
        if reachable {
            match ip(&["-n", &from.namespace, "route", "del", "blackhole", &target]) {
                // Not cut: nothing to heal.
                Err(NetnsError::Step { detail, .. }) if detail.contains("No such process") => {
                    Ok(())
                }
                other => other,
            }
        } else {
            ip(&[
                "-n",
                &from.namespace,
                "route",
                "replace",
                "blackhole",
                &target,
            ])
        }
    }

    /// [`Topology::set_route`] both ways between `a` and `b`.
    pub fn set_reachable(&self, a: &Host, b: &Host, reachable: bool) -> Result<(), NetnsError> {
        self.set_route(a, b, reachable)?;
        self.set_route(b, a, reachable)
    }

    /// The processes running in `host`'s namespace.
    pub fn pids(&self, host: &Host) -> Vec<u32> {
        Command::new("ip")
            .args(["netns", "pids", &host.namespace])
            .output()
            .map(|output| {
                String::from_utf8_lossy(&output.stdout)
                    .split_whitespace()
                    .filter_map(|pid| pid.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `program` to be run on `host`.
    pub fn command(&self, host: &Host, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &host.namespace])
            .arg(program);
        command
    }

    fn remove(&mut self) {
        for namespace in self.namespaces.iter().rev() {
            let pids = Command::new("ip")
                .args(["netns", "pids", namespace])
                .output()
                .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
                .unwrap_or_default();
            for pid in pids.split_whitespace() {
                if pid != std::process::id().to_string() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", namespace]);
        }
        self.namespaces.clear();
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        self.remove();
        if let Some((mut child, stdin)) = self.watchdog.take() {
            drop(stdin);
            let _ = child.wait();
        }
    }
}

/// Moves the calling thread into `host`'s network namespace: sockets it opens from now on, and
/// those of the threads and processes it starts, are that host's. Other threads are unchanged.
pub fn enter(host: &Host) -> Result<(), NetnsError> {
    let file = std::fs::File::open(format!("/var/run/netns/{}", host.namespace))?;
    // SAFETY: setns only reads the descriptor, which `file` keeps open for the call; it
    // changes the calling thread's network namespace and nothing of this process's memory.
    let result = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if result == 0 {
        Ok(())
    } else {
        Err(NetnsError::Io(std::io::Error::last_os_error()))
    }
}
