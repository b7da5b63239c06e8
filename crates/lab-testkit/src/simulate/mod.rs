//! `production-lab simulate`: the ordered inbox checked against a reference model under faults.
//! A seed decides a whole history — deliveries shuffled, duplicated, conflicting and poisoned, on
//! the general or the broker door, batches, operators' resolutions (some with a stale
//! `expectedLast`), producers' sessions, operators' ownership transfers (some naming a wrong
//! owner), and crashes of the inbox's process before, during and after a COMMIT — and the real
//! library runs it on a real store, compared with the model after every step.
//!
//! - [`model`]: the reference model, sharing no code with the library's decisions;
//! - [`history`]: the histories, a pure function of their seed;
//! - [`system`]: the real inbox with the simulator's handler, which writes a row per apply;
//! - [`host`]: the inbox in a child process, so that a crash is a real SIGKILL;
//! - [`run`]: one history, step by step, and what a crash may leave;
//! - [`campaign`]: many seeds, the report, and the shrink of a divergent history.

pub mod campaign;
pub mod history;
pub mod host;
pub mod model;
pub mod run;
pub mod system;
