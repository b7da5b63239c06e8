//! Progress of a long command on stderr, so that stdout keeps only the result: a progress bar
//! when stderr is a terminal, otherwise (a log file, CI) a plain line at the start, every few
//! seconds while it runs, and at the end.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the plain form prints a line.
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// One counted phase of a command, e.g. "bench ordered: HTTP" over 20,000 messages.
pub struct Progress {
    label: String,
    total: u64,
    done: Arc<AtomicU64>,
    started: Instant,
    display: Display,
}

enum Display {
    Bar(ProgressBar),
    Lines {
        stop: mpsc::Sender<()>,
        printer: Option<JoinHandle<()>>,
    },
}

impl Progress {
    /// Starts showing `label` with `total` units (`unit`: "messages", "callers" …) on stderr.
    pub fn start(label: &str, total: u64, unit: &str) -> Progress {
        Progress::start_on(
            label,
            total,
            unit,
            std::io::stderr().is_terminal(),
            LINE_EVERY,
        )
    }

    /// [`Progress::start`] with the form chosen by the caller (tests use lines).
    pub fn start_on(
        label: &str,
        total: u64,
        unit: &str,
        terminal: bool,
        every: Duration,
    ) -> Progress {
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let display = if terminal {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            // `wide_bar` takes what the terminal's width leaves, so the line never wraps.
            let template =
                format!("{{msg}} [{{wide_bar}}] {{pos}}/{{len}} {unit} ({{per_sec}}, eta {{eta}})");
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(label.to_owned());
            Display::Bar(bar)
        } else {
            eprintln!("{label}: 0/{total} {unit}");
            let (stop, stopped) = mpsc::channel();
            let (label_, unit_, done_) = (label.to_owned(), unit.to_owned(), done.clone());
            let printer = std::thread::Builder::new()
                .name("progress".to_owned())
                .spawn(move || {
                    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                        let count = done_.load(Ordering::Relaxed);
                        eprintln!(
                            "{label_}: {} {unit_}, {:.1} s",
                            fraction(count, total),
                            started.elapsed().as_secs_f64()
                        );
                    }
                })
                .ok();
            Display::Lines { stop, printer }
        };
        Progress {
            label: label.to_owned(),
            total,
            done,
            started,
            display,
        }
    }

    /// A handle that counts done units from any thread or task.
    pub fn counter(&self) -> ProgressCounter {
        ProgressCounter {
            done: self.done.clone(),
            bar: match &self.display {
                Display::Bar(bar) => Some(bar.clone()),
                Display::Lines { .. } => None,
            },
        }
    }

    /// Stops the display and prints where it ended.
    pub fn finish(mut self) {
        self.stop();
        let count = self.done.load(Ordering::Relaxed);
        eprintln!(
            "{}: {} in {:.1} s",
            self.label,
            fraction(count, self.total),
            self.started.elapsed().as_secs_f64()
        );
    }

    fn stop(&mut self) {
        match &mut self.display {
            Display::Bar(bar) => bar.finish_and_clear(),
            Display::Lines { stop, printer } => {
                let _ = stop.send(());
                if let Some(printer) = printer.take() {
                    let _ = printer.join();
                }
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An early return (an error) still stops the printer thread and clears the bar.
        self.stop();
    }
}

/// Counts done units of a [`Progress`]; cheap to clone.
#[derive(Clone)]
pub struct ProgressCounter {
    done: Arc<AtomicU64>,
    bar: Option<ProgressBar>,
}

impl ProgressCounter {
    pub fn add(&self, units: u64) {
        self.done.fetch_add(units, Ordering::Relaxed);
        if let Some(bar) = &self.bar {
            bar.inc(units);
        }
    }

    /// Sets the count to `done`, for a phase that polls a total rather than counting steps.
    pub fn reach(&self, done: u64) {
        self.done.fetch_max(done, Ordering::Relaxed);
        if let Some(bar) = &self.bar {
            bar.set_position(self.done.load(Ordering::Relaxed));
        }
    }
}

/// `done/total (p%)`.
fn fraction(done: u64, total: u64) -> String {
    let percent = if total == 0 {
        100.0
    } else {
        done as f64 * 100.0 / total as f64
    };
    format!("{done}/{total} ({percent:.0}%)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_counts_from_other_threads_and_the_fraction_reads_well() {
        let progress = Progress::start_on("test", 10, "units", false, Duration::from_secs(60));
        let counter = progress.counter();
        std::thread::scope(|scope| {
            for _ in 0..5 {
                let counter = counter.clone();
                scope.spawn(move || counter.add(2));
            }
        });
        assert_eq!(progress.done.load(Ordering::Relaxed), 10);
        progress.finish();
        assert_eq!(fraction(5, 20), "5/20 (25%)");
        assert_eq!(fraction(0, 0), "0/0 (100%)");
    }
}
