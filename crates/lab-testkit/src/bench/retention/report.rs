//! What `bench retention` reports: the size samples of each run, the bound of the size after
//! the warm-up, and the verdict, as printed and as JSON.

use serde::Serialize;

use super::probe::{PrunedRows, StoreRows, StoreSize};
use super::{RetentionBenchOptions, RetentionSettings, TOLERANCE, WARM_UP_FRACTION};

/// One size sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SizeSample {
    /// Messages delivered when it was taken.
    pub messages: u64,
    pub elapsed_seconds: f64,
    /// Messages per second since the sample before.
    pub interval_per_second: f64,
    #[serde(flatten)]
    pub size: StoreSize,
    /// What the pruner had deleted by then.
    pub pruned: PrunedRows,
}

/// One run: retention off or on.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseReport {
    pub retention: bool,
    pub messages: u64,
    pub seconds: f64,
    pub messages_per_second: f64,
    pub samples: Vec<SizeSample>,
    pub pruned: PrunedRows,
    /// What the store held at the end.
    pub retained: StoreRows,
    /// Output rows marked published.
    pub published: u64,
    /// Writer units (delivery batches, publishing rounds, pruning batches) per SQLite commit.
    pub units_per_commit: Option<f64>,
}

/// The size after the warm-up.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SizeBound {
    /// The warm-up ended at the first sample at or past this many messages.
    pub warm_up_messages: u64,
    /// Samples from there on.
    pub samples: usize,
    /// The size when the warm-up ended.
    pub reference_bytes: u64,
    pub min_bytes: u64,
    pub max_bytes: u64,
    /// `max / min`.
    pub spread: f64,
    /// `min / reference` and `max / reference`.
    pub low: f64,
    pub high: f64,
    /// Both within ±[`TOLERANCE`].
    pub bounded: bool,
}

impl SizeBound {
    /// The bound of `samples` (in message order) of a run of `messages`: the warm-up lasts
    /// [`WARM_UP_FRACTION`] of the run, or until the first sample by which the pruner deleted
    /// identities and output rows if that comes later. `None` without pruning or with fewer
    /// than two samples after the warm-up.
    pub fn of(samples: &[SizeSample], messages: u64) -> Option<SizeBound> {
        let pruning_from = samples
            .iter()
            .find(|sample| sample.pruned.identities > 0 && sample.pruned.output > 0)?
            .messages;
        let warm_up_messages = pruning_from.max((messages as f64 * WARM_UP_FRACTION) as u64);
        let after: Vec<u64> = samples
            .iter()
            .filter(|sample| sample.messages >= warm_up_messages)
            .map(|sample| sample.size.bytes)
            .collect();
        let (&reference_bytes, _) = after.split_first()?;
        if after.len() < 2 || reference_bytes == 0 {
            return None;
        }
        let min_bytes = after.iter().copied().min().unwrap_or(reference_bytes);
        let max_bytes = after.iter().copied().max().unwrap_or(reference_bytes);
        let low = min_bytes as f64 / reference_bytes as f64;
        let high = max_bytes as f64 / reference_bytes as f64;
        Some(SizeBound {
            warm_up_messages,
            samples: after.len(),
            reference_bytes,
            min_bytes,
            max_bytes,
            spread: max_bytes as f64 / min_bytes.max(1) as f64,
            low,
            high,
            bounded: low >= 1.0 - TOLERANCE && high <= 1.0 + TOLERANCE,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetentionReport {
    pub backend: &'static str,
    pub aggregates: usize,
    pub batch: usize,
    pub consumers: usize,
    pub sample_every: usize,
    pub settings: RetentionSettings,
    pub off: PhaseReport,
    pub on: PhaseReport,
    /// The on run's size after its warm-up (`None`: nothing was pruned, or too few samples).
    pub bound: Option<SizeBound>,
    /// The on run's size stayed within ±10% after its warm-up.
    pub bounded: bool,
    /// The on run's throughput over the off run's.
    pub throughput_ratio: f64,
}

impl RetentionReport {
    pub(super) fn new(options: &RetentionBenchOptions, off: PhaseReport, on: PhaseReport) -> Self {
        let bound = SizeBound::of(&on.samples, on.messages);
        RetentionReport {
            backend: if options.postgres {
                "postgres"
            } else {
                "sqlite"
            },
            aggregates: options.aggregates,
            batch: options.batch,
            consumers: options.consumers,
            sample_every: options.sample_every,
            settings: options.retention,
            bounded: bound.as_ref().is_some_and(|bound| bound.bounded),
            throughput_ratio: on.messages_per_second / off.messages_per_second,
            bound,
            off,
            on,
        }
    }
}

pub(super) fn mebibytes(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl std::fmt::Display for RetentionReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings = &self.settings;
        writeln!(
            f,
            "bench retention: {}, {} messages over {} aggregates (retention off: {}), batches of {} from {} consumers",
            self.backend,
            self.on.messages,
            self.aggregates,
            self.off.messages,
            self.batch,
            self.consumers
        )?;
        writeln!(
            f,
            "  policy: identities, output and dead letters kept {} ms, timeline {} per aggregate; pruner rests {} ms, {} rows a batch",
            settings.kept_ms, settings.timeline, settings.interval_ms, settings.batch
        )?;
        for phase in [&self.off, &self.on] {
            write_phase(f, phase)?;
        }
        match &self.bound {
            Some(bound) => writeln!(
                f,
                "  size after warm-up (from {} messages, {} samples): min {}, max {}, max/min {:.3}; {:+.1}% / {:+.1}% of {} when the warm-up ended",
                bound.warm_up_messages,
                bound.samples,
                mebibytes(bound.min_bytes),
                mebibytes(bound.max_bytes),
                bound.spread,
                (bound.low - 1.0) * 100.0,
                (bound.high - 1.0) * 100.0,
                mebibytes(bound.reference_bytes)
            )?,
            None => writeln!(
                f,
                "  size after warm-up: unknown (nothing pruned, or fewer than two samples after the warm-up)"
            )?,
        }
        let off_bytes = self.off.samples.last().map_or(0, |s| s.size.bytes);
        let on_bytes = self.on.samples.last().map_or(0, |s| s.size.bytes);
        writeln!(
            f,
            "  verdict: {} (retention off ended at {}, retention on at {})",
            if self.bounded {
                "BOUNDED, within ±10% after warm-up"
            } else {
                "NOT BOUNDED within ±10% after warm-up"
            },
            mebibytes(off_bytes),
            mebibytes(on_bytes)
        )?;
        write!(
            f,
            "  throughput: on {:.0} msg/s, off {:.0} msg/s, on/off {:.3} (target ≥ 0.90: {})",
            self.on.messages_per_second,
            self.off.messages_per_second,
            self.throughput_ratio,
            if self.throughput_ratio >= 0.90 {
                "met"
            } else {
                "missed"
            }
        )
    }
}

fn write_phase(f: &mut std::fmt::Formatter<'_>, phase: &PhaseReport) -> std::fmt::Result {
    let unknown = |figure: Option<u64>| figure.map_or("-".to_owned(), mebibytes);
    writeln!(
        f,
        "  retention {}: {:.0} msg/s over {:.1} s; writer units per commit {}",
        if phase.retention { "on" } else { "off" },
        phase.messages_per_second,
        phase.seconds,
        phase
            .units_per_commit
            .map_or("unknown".to_owned(), |units| format!("{units:.1}"))
    )?;
    writeln!(
        f,
        "    {:>9} {:>8} {:>9} {:>11} {:>11} {:>10} {:>10}  pruned: identities / output / timeline",
        "messages", "s", "msg/s", "size", "file", "WAL", "live"
    )?;
    for sample in &phase.samples {
        writeln!(
            f,
            "    {:>9} {:>8.1} {:>9.0} {:>11} {:>11} {:>10} {:>10}  {} / {} / {}",
            sample.messages,
            sample.elapsed_seconds,
            sample.interval_per_second,
            mebibytes(sample.size.bytes),
            unknown(sample.size.file_bytes),
            unknown(sample.size.wal_bytes),
            unknown(sample.size.live_bytes),
            sample.pruned.identities,
            sample.pruned.output,
            sample.pruned.timeline
        )?;
    }
    let retained = &phase.retained;
    writeln!(
        f,
        "    at the end: retained {} identities, {} output rows, {} timeline events; pruned {} identities, {} output rows, {} timeline events",
        retained.identities,
        retained.output,
        retained.timeline,
        phase.pruned.identities,
        phase.pruned.output,
        phase.pruned.timeline
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(messages: u64, bytes: u64, pruned: u64) -> SizeSample {
        SizeSample {
            messages,
            elapsed_seconds: messages as f64 / 1000.0,
            interval_per_second: 1000.0,
            size: StoreSize {
                bytes,
                ..StoreSize::default()
            },
            pruned: PrunedRows {
                identities: pruned,
                output: pruned,
                ..PrunedRows::default()
            },
        }
    }

    #[test]
    fn a_size_within_ten_percent_of_its_size_after_the_warm_up_is_bounded() {
        let samples: Vec<SizeSample> = [10, 20, 30, 40, 50, 54, 49, 51]
            .iter()
            .enumerate()
            .map(|(i, mib)| sample((i as u64 + 1) * 100, mib << 20, i as u64 * 10))
            .collect();
        let bound = SizeBound::of(&samples, 800).expect("a bound");
        // A quarter of 800 is 200, but nothing was pruned before the second sample either.
        assert_eq!(bound.warm_up_messages, 200);
        assert_eq!(bound.samples, 7);
        assert_eq!(bound.reference_bytes, 20 << 20);
        assert!(!bound.bounded, "{bound:?}");

        let steady = &samples[4..];
        let bound = SizeBound::of(steady, 800).expect("a bound");
        assert_eq!(bound.reference_bytes, 50 << 20);
        assert_eq!((bound.min_bytes, bound.max_bytes), (49 << 20, 54 << 20));
        assert!((bound.high - 1.08).abs() < 1e-9, "{bound:?}");
        assert!(bound.bounded, "{bound:?}");
    }

    #[test]
    fn the_warm_up_lasts_until_the_pruner_started_and_a_size_past_ten_percent_is_not_bounded() {
        let samples: Vec<SizeSample> = (1..=8)
            .map(|i| sample(i * 100, 100 << 20, if i >= 5 { 1 } else { 0 }))
            .chain([sample(900, 111 << 20, 1)])
            .collect();
        let bound = SizeBound::of(&samples, 900).expect("a bound");
        assert_eq!(bound.warm_up_messages, 500);
        assert_eq!(bound.samples, 5);
        assert!(!bound.bounded, "{bound:?}");
        let shrinking: Vec<SizeSample> = (1..=8)
            .map(|i| sample(i * 100, (200 - i * 10) << 20, 1))
            .collect();
        assert!(!SizeBound::of(&shrinking, 800).expect("a bound").bounded);
    }

    #[test]
    fn without_pruning_or_samples_after_the_warm_up_there_is_no_bound() {
        let unpruned: Vec<SizeSample> = (1..=8).map(|i| sample(i * 100, 1 << 20, 0)).collect();
        assert_eq!(SizeBound::of(&unpruned, 800), None);
        let early: Vec<SizeSample> = (1..=8).map(|i| sample(i * 100, 1 << 20, 1)).collect();
        assert_eq!(SizeBound::of(&early, 100_000), None);
    }
}
