//! Known bugs the chaos campaign (`production-lab chaos --plant …`) plants in a gate, to show
//! that its checker catches each. They exist only in a build with the `planted-bugs` feature,
//! which only the campaign's builds enable: without it [`planted`] is always `None`, the
//! environment is never read and the compiler removes every site.

/// The environment variable naming the bug a gate built with `planted-bugs` plants.
pub const PLANTED_BUG_ENV: &str = "GATE_PLANTED_BUG";

/// A bug the campaign must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// The publisher without its fence: no `Nats-Expected-Last-Subject-Sequence` on its
    /// publishes, and no lease check (every gate publishes, whether it holds the lease or not).
    FenceOff,
    /// The NATS input acked before the COMMIT that records it.
    AckBeforeCommit,
}

/// The bug this process plants, from [`PLANTED_BUG_ENV`] (`fence-off`, `ack-before-commit`).
#[cfg(feature = "planted-bugs")]
pub fn planted() -> Option<PlantedBug> {
    static PLANTED: std::sync::OnceLock<Option<PlantedBug>> = std::sync::OnceLock::new();
    *PLANTED.get_or_init(|| match std::env::var(PLANTED_BUG_ENV).as_deref() {
        Ok("fence-off") => Some(PlantedBug::FenceOff),
        Ok("ack-before-commit") => Some(PlantedBug::AckBeforeCommit),
        _ => None,
    })
}

/// No bug: this build has none.
#[cfg(not(feature = "planted-bugs"))]
#[inline(always)]
pub fn planted() -> Option<PlantedBug> {
    None
}

/// Whether `bug` is planted in this process.
#[inline(always)]
pub fn active(bug: PlantedBug) -> bool {
    planted() == Some(bug)
}

/// Warns that a bug is planted, and plants what it needs in the inbox library (whose consumer
/// acks the NATS input).
pub fn announce() {
    let Some(bug) = planted() else {
        return;
    };
    tracing::warn!(target: "production_lab::gate", ?bug, "a known bug is planted in this gate (GATE_PLANTED_BUG): it must not serve anything real");
    #[cfg(feature = "planted-bugs")]
    if bug == PlantedBug::AckBeforeCommit {
        ordered_inbox::planted::plant(Some(ordered_inbox::planted::Bug::AckBeforeCommit));
    }
}
