//! lab-testkit: the production lab's tooling, outside the server's runtime library. The tests
//! (`tests/api`) and the server binary's `bench` subcommand use it; it depends on the server only
//! through its documented interfaces (the command line, the lines it prints, the HTTP routes, the
//! broker door's wire format, the tables of its SQLite file) and on the `ordered-inbox` library.
//!
//! # Layout
//!
//! - [`server`]: the server under test as a child process (`serve` on a fresh database), the
//!   listening line and the PostgreSQL figures line it prints;
//! - [`process`]: what `/proc` tells about a process (CPU time, storage writes, peak RSS);
//! - [`pg`]: a private PostgreSQL cluster (`initdb`, `pg_ctl`), removed by a watchdog;
//! - [`nats`]: a private `nats-server` with JetStream, and the subject and header a publisher
//!   writes;
//! - [`netns`]: hosts as network namespaces around a bridge, and links between them to cut;
//! - [`lazyfs`]: a FUSE passthrough file system that forgets unsynced writes on command (a
//!   power failure for the store on it);
//! - [`progress`]: progress of a long command on stderr;
//! - [`mod@bench`]: the workloads of `production-lab bench` (ordered, PostgreSQL, stampede, broker,
//!   relay) and their reports;
//! - [`simulate`]: the inbox run against a reference model under faults (`production-lab
//!   simulate`), with crashes of a child process hosting it;
//! - [`chaos`]: the gate's deployment across network namespaces under a seeded nemesis, its
//!   history and an independent checker (`production-lab chaos`).
//!
//! A missing PostgreSQL or nats-server fails with a message naming the Debian package.

pub mod bench;
pub mod chaos;
pub mod lazyfs;
pub mod nats;
pub mod netns;
pub mod pg;
pub mod process;
pub mod progress;
pub mod server;
pub mod simulate;

pub use server::Synchronous;
