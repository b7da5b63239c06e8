//! Known bugs, planted one at a time by the simulator's tests to show that its checker catches
//! each. Public with the `planted-bugs` feature only, which only tests enable; without it the
//! module is private, [`active`] is always false and the compiler removes every site. Never
//! enabled in a build of the server.

/// A bug the simulator must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[cfg_attr(
    not(feature = "planted-bugs"),
    allow(
        dead_code,
        reason = "a bug's site may be in a backend that is not built"
    )
)]
pub enum Bug {
    /// A quarantine advances the aggregate's position past the poison.
    AdvanceOnQuarantine = 1,
    /// A replay runs the handler's `apply` again.
    ApplyReplayTwice = 2,
    /// Held messages drain highest sequence first.
    DrainOutOfOrder = 3,
    /// The writer's replay of a batch (after a unit failed) rolls back the first unit's writes
    /// and still answers it as committed.
    LoseReplayedUnit = 4,
    /// An older epoch of a producer is accepted.
    AcceptFencedEpoch = 5,
    /// A transfer from an owner is recorded and answered, but the aggregate's owner columns
    /// keep the old owner, who may still deliver.
    TransferKeepsOldOwner = 6,
    /// The JetStream consumer acks every message of a batch before delivering it (before its
    /// COMMIT): a batch whose COMMIT fails, or a consumer that dies in between, loses messages
    /// the broker will not redeliver. Planted by the gate's chaos campaign.
    AckBeforeCommit = 7,
}

#[cfg(feature = "planted-bugs")]
static PLANTED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Plants `bug` (`None`: none) for the whole process.
#[cfg(feature = "planted-bugs")]
pub fn plant(bug: Option<Bug>) {
    PLANTED.store(
        bug.map_or(0, |bug| bug as u8),
        std::sync::atomic::Ordering::SeqCst,
    );
}

/// Whether `bug` is planted.
#[inline(always)]
pub fn active(bug: Bug) -> bool {
    #[cfg(feature = "planted-bugs")]
    {
        PLANTED.load(std::sync::atomic::Ordering::Relaxed) == bug as u8
    }
    #[cfg(not(feature = "planted-bugs"))]
    {
        let _ = bug;
        false
    }
}
