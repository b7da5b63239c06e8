//! What `/proc` tells about a process: CPU time, storage writes, peak resident set, parent.
//! Every reading is `None` where `/proc` does not tell it (another kernel, a process gone).

use serde::Serialize;

/// Linux reports CPU time in `USER_HZ` ticks, which is 100 per second on every architecture the
/// kernel exposes to user space.
pub const TICKS_PER_SECOND: f64 = 100.0;

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and
/// parentheses, so fields are counted after its last `)`): index 0 is the state, 1 the parent
/// pid, 11 and 12 user and system time in clock ticks.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

fn tick_field(fields: &[String], index: usize) -> Option<u64> {
    fields.get(index)?.parse().ok()
}

/// The parent of a process.
pub fn parent_pid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// User + system CPU time of one process, in clock ticks.
pub fn process_cpu_ticks(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    Some(tick_field(&fields, 11)? + tick_field(&fields, 12)?)
}

/// User + system CPU time of a process's children that ended and were waited for, in clock
/// ticks (`cutime` and `cstime`, fields 13 and 14).
pub fn reaped_children_cpu_ticks(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    Some(tick_field(&fields, 13)? + tick_field(&fields, 14)?)
}

/// A process's peak resident set (`VmHWM`) in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The clock ticks spent between two readings, where both are known.
pub fn ticks_since(after: Option<u64>, before: Option<u64>) -> Option<u64> {
    after
        .zip(before)
        .map(|(after, before)| after.saturating_sub(before))
}

/// Microseconds of CPU per message from clock ticks spent during a load.
pub fn cpu_us_per_message(ticks: Option<u64>, messages: usize) -> Option<f64> {
    let seconds = ticks? as f64 / TICKS_PER_SECOND;
    Some(seconds * 1e6 / messages.max(1) as f64)
}

/// A process's CPU time (user and system) and storage writes, from `/proc/PID/stat` and
/// `/proc/PID/io`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub user_ticks: u64,
    pub system_ticks: u64,
    pub write_bytes: Option<u64>,
}

impl ProcessUsage {
    pub fn read(pid: u32) -> Option<ProcessUsage> {
        let fields = stat_fields(pid)?;
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok();
        let write_bytes = io.as_deref().and_then(|io| {
            io.lines()
                .find_map(|line| line.strip_prefix("write_bytes:"))
                .and_then(|value| value.trim().parse().ok())
        });
        Some(ProcessUsage {
            // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
            user_ticks: tick_field(&fields, 11)?,
            system_ticks: tick_field(&fields, 12)?,
            write_bytes,
        })
    }

    /// What was spent between `earlier` and `self`, per message, in µs of CPU and bytes.
    pub fn per_message(&self, earlier: &ProcessUsage, messages: usize) -> CostPerMessage {
        let per = |ticks: u64| ticks as f64 / TICKS_PER_SECOND * 1e6 / messages.max(1) as f64;
        CostPerMessage {
            user_us: per(self.user_ticks.saturating_sub(earlier.user_ticks)),
            system_us: per(self.system_ticks.saturating_sub(earlier.system_ticks)),
            storage_bytes: self
                .write_bytes
                .zip(earlier.write_bytes)
                .map(|(now, then)| now.saturating_sub(then) as f64 / messages.max(1) as f64),
        }
    }
}

/// A process's cost of one message during a load.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CostPerMessage {
    pub user_us: f64,
    pub system_us: f64,
    /// Bytes written to storage (WAL, checkpoints), from `/proc/PID/io`; unknown where the
    /// kernel does not account it.
    pub storage_bytes: Option<f64>,
}

/// Where the CPU of a load went, per message: the broker, the servers under test, and the bench
/// process itself (the load generator and the downstream reader). A figure is `None` where
/// `/proc` does not tell it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuSplit {
    pub nats_server_us: Option<f64>,
    pub servers_us: Option<f64>,
    pub bench_us: Option<f64>,
    /// Bytes the servers under test wrote to storage (`write_bytes` of `/proc/PID/io`: their
    /// WAL, checkpoints and database files), per message.
    pub servers_storage_bytes: Option<f64>,
}

impl std::fmt::Display for CpuSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |us: Option<f64>| us.map_or("unknown".to_owned(), |us| format!("{us:.1} µs"));
        write!(
            f,
            "nats-server {}, server(s) {}, bench {}",
            show(self.nats_server_us),
            show(self.servers_us),
            show(self.bench_us)
        )?;
        match self.servers_storage_bytes {
            Some(bytes) => write!(f, "; server(s) wrote {:.1} KB", bytes / 1000.0),
            None => Ok(()),
        }
    }
}

/// The CPU ticks of a load's processes when it started, to split what it spent
/// ([`CpuSplit`]).
pub struct CpuMeter {
    nats_server: Option<u32>,
    servers: Vec<u32>,
    at_start: [Option<u64>; 3],
    servers_written_at_start: Option<u64>,
}

impl CpuMeter {
    /// Reads the ticks so far of `nats_server`, of every process of `servers` and of this one.
    pub fn start(nats_server: Option<u32>, servers: Vec<u32>) -> CpuMeter {
        let mut meter = CpuMeter {
            nats_server,
            servers,
            at_start: [None; 3],
            servers_written_at_start: None,
        };
        meter.at_start = meter.ticks();
        meter.servers_written_at_start = meter.servers_written();
        meter
    }

    /// The bytes every server process wrote to storage so far, where `/proc` tells all of them.
    fn servers_written(&self) -> Option<u64> {
        self.servers
            .iter()
            .map(|pid| ProcessUsage::read(*pid).and_then(|usage| usage.write_bytes))
            .sum()
    }

    fn ticks(&self) -> [Option<u64>; 3] {
        let servers = self
            .servers
            .iter()
            .map(|pid| process_cpu_ticks(*pid))
            .sum::<Option<u64>>();
        [
            self.nats_server.and_then(process_cpu_ticks),
            servers,
            process_cpu_ticks(std::process::id()),
        ]
    }

    /// What each part spent since [`CpuMeter::start`], per message of `messages`.
    pub fn per_message(&self, messages: usize) -> CpuSplit {
        let now = self.ticks();
        let spent =
            |part: usize| cpu_us_per_message(ticks_since(now[part], self.at_start[part]), messages);
        let written = self
            .servers_written()
            .zip(self.servers_written_at_start)
            .map(|(now, then)| now.saturating_sub(then) as f64 / messages.max(1) as f64);
        CpuSplit {
            nats_server_us: spent(0),
            servers_us: spent(1),
            bench_us: spent(2),
            servers_storage_bytes: written.filter(|_| !self.servers.is_empty()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn this_process_usage_is_readable_and_grows_with_work() {
        let before = ProcessUsage::read(std::process::id()).expect("/proc/self/stat");
        let started = Instant::now();
        let mut spin = 0u64;
        while started.elapsed() < Duration::from_millis(60) {
            spin = spin.wrapping_add(std::hint::black_box(1));
        }
        let after = ProcessUsage::read(std::process::id()).expect("/proc/self/stat");
        assert!(spin > 0);
        assert!(after.user_ticks + after.system_ticks > before.user_ticks + before.system_ticks);
        assert_eq!(
            process_cpu_ticks(std::process::id()).map(|ticks| ticks >= before.user_ticks),
            Some(true)
        );
        assert!(peak_rss_kib(std::process::id()).is_some_and(|kib| kib > 0));
        assert_eq!(
            parent_pid(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
    }

    #[test]
    fn costs_are_divided_per_message_in_microseconds() {
        let before = ProcessUsage {
            user_ticks: 100,
            system_ticks: 50,
            write_bytes: Some(1000),
        };
        let after = ProcessUsage {
            user_ticks: 102,
            system_ticks: 53,
            write_bytes: Some(5000),
        };
        let cost = after.per_message(&before, 1000);
        assert_eq!((cost.user_us, cost.system_us), (20.0, 30.0));
        assert_eq!(cost.storage_bytes, Some(4.0));
        assert_eq!(cpu_us_per_message(Some(5), 1000), Some(50.0));
        assert_eq!(cpu_us_per_message(None, 1000), None);
    }

    #[test]
    fn a_meter_splits_what_each_process_spent_and_tells_what_it_cannot_read() {
        let gone = u32::MAX;
        let meter = CpuMeter::start(Some(gone), Vec::new());
        let started = Instant::now();
        let mut spin = 0u64;
        while started.elapsed() < Duration::from_millis(60) {
            spin = spin.wrapping_add(std::hint::black_box(1));
        }
        let split = meter.per_message(10);
        assert!(spin > 0);
        assert_eq!(split.nats_server_us, None, "no such process");
        assert_eq!(split.servers_us, Some(0.0), "no servers spend nothing");
        assert!(split.bench_us.is_some_and(|us| us > 0.0), "{split:?}");
        assert!(
            split
                .to_string()
                .starts_with("nats-server unknown, server(s) 0.0 µs")
        );
    }

    #[test]
    fn a_meter_counts_what_the_servers_wrote_to_storage() {
        // In the workspace's target directory: a tmpfs /tmp would write nothing to storage.
        let scratch = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
        std::fs::create_dir_all(&scratch).expect("target/tmp");
        let dir = tempfile::tempdir_in(&scratch).expect("a scratch directory");
        let meter = CpuMeter::start(None, vec![std::process::id()]);
        let file = dir.path().join("written");
        std::fs::write(&file, vec![7u8; 1_000_000]).expect("a file of 1 MB");
        std::fs::File::open(&file)
            .and_then(|file| file.sync_all())
            .expect("its sync");
        let split = meter.per_message(1000);
        assert!(
            split
                .servers_storage_bytes
                .is_some_and(|bytes| bytes >= 1000.0),
            "{split:?}"
        );
        assert!(split.to_string().contains("server(s) wrote"), "{split}");
        let nobody = CpuMeter::start(None, Vec::new()).per_message(1000);
        assert_eq!(nobody.servers_storage_bytes, None, "no servers, no figure");
    }
}
