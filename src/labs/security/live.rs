//! Live configuration: the settings file is watched, and `GET /configuration` answers from the
//! last settings that passed validation — or 503 while the file on disk is invalid.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{PollWatcher, RecommendedWatcher, RecursiveMode, Watcher};
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache, new_debouncer_opt};

use crate::config::{LiveSettings, parse_settings};

/// How long the file must be quiet before a burst of events (an editor's write, rename, chmod)
/// triggers one reload.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// How often the fallback polling watcher looks at the directory when inotify is unavailable.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// What `GET /configuration` answers from. Swapped as a whole so a reader never sees a value
/// from one reload and an error from another.
pub struct LiveStatus {
    /// The last settings that passed validation (the start-up settings until a reload).
    pub last_good: LiveSettings,
    /// Why the file on disk is rejected right now; `None` while it is valid.
    pub error: Option<String>,
}

/// The settings file, its last good value, and its current status.
pub struct LiveConfiguration {
    path: PathBuf,
    status: ArcSwap<LiveStatus>,
}

impl LiveConfiguration {
    pub fn new(path: PathBuf, initial: LiveSettings) -> Self {
        LiveConfiguration {
            path,
            status: ArcSwap::from_pointee(LiveStatus {
                last_good: initial,
                error: None,
            }),
        }
    }

    pub fn status(&self) -> Arc<LiveStatus> {
        self.status.load_full()
    }

    /// Reads and validates the file again, and logs a newly seen error once. Called from the
    /// watcher's own thread (never on the async runtime), one reload at a time.
    pub fn reload(&self) {
        let outcome = std::fs::read_to_string(&self.path)
            .map_err(|error| format!("cannot read the settings file: {error}"))
            .and_then(|text| parse_settings(&text));
        match self.apply(outcome) {
            Transition::NewError(reason) => tracing::warn!(
                target: "production_lab::configuration",
                path = %self.path.display(),
                "Current configuration is invalid: {reason} (GET /configuration answers 503 until the file is fixed)"
            ),
            Transition::Recovered => tracing::info!(
                target: "production_lab::configuration",
                path = %self.path.display(),
                "Configuration is valid again"
            ),
            Transition::Unchanged => {}
        }
    }

    /// Records one reload's outcome and says what changed. The reason never contains the secret:
    /// `parse_settings` reports only positions and field names.
    fn apply(&self, outcome: Result<LiveSettings, String>) -> Transition {
        let previous = self.status.load();
        let (next, transition) = match outcome {
            Ok(settings) => {
                let transition = if previous.error.is_some() {
                    Transition::Recovered
                } else {
                    Transition::Unchanged
                };
                let status = LiveStatus {
                    last_good: settings,
                    error: None,
                };
                (status, transition)
            }
            Err(reason) => {
                let transition = if previous.error.as_deref() == Some(reason.as_str()) {
                    Transition::Unchanged
                } else {
                    Transition::NewError(reason.clone())
                };
                let status = LiveStatus {
                    last_good: previous.last_good.clone(),
                    error: Some(reason),
                };
                (status, transition)
            }
        };
        self.status.store(Arc::new(next));
        transition
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Transition {
    /// The file became invalid, or invalid in a new way: worth one log line.
    NewError(String),
    /// The file was invalid and is valid again.
    Recovered,
    Unchanged,
}

/// Keeps the file watch running; dropping it stops the watcher and its debounce thread.
pub struct SettingsWatch {
    // Held only to be dropped; native or polling, whichever started.
    _debouncer: Box<dyn std::any::Any + Send + Sync>,
}

/// Starts watching the settings file's directory (editors save by writing a new file and
/// renaming it over the old one, which an OS watch on the file itself would lose) and reloads on
/// any event that names the file. Falls back to polling the file when the OS watcher cannot
/// start (e.g. the inotify instance limit is reached).
pub fn watch(live: Arc<LiveConfiguration>) -> Result<SettingsWatch, String> {
    let directory = watched_directory(&live.path);
    match start::<RecommendedWatcher>(&live, &directory, notify::Config::default()) {
        Ok(debouncer) => Ok(SettingsWatch {
            _debouncer: Box::new(debouncer),
        }),
        Err(native) => {
            tracing::warn!(
                target: "production_lab::configuration",
                "cannot start the file watcher ({native}); polling the settings directory instead"
            );
            let debouncer = start::<PollWatcher>(&live, &live.path, polling_config(POLL_INTERVAL))
                .map_err(|polling| format!("cannot watch for changes: {native}; {polling}"))?;
            Ok(SettingsWatch {
                _debouncer: Box::new(debouncer),
            })
        }
    }
}

/// Polling re-reads the path itself each time, so it survives a rename without watching the
/// directory. Its modification times have whole-second resolution, so it compares the content
/// too, or two edits within one second would look like one.
fn polling_config(interval: Duration) -> notify::Config {
    notify::Config::default()
        .with_poll_interval(interval)
        .with_compare_contents(true)
}

fn start<W: Watcher>(
    live: &Arc<LiveConfiguration>,
    watched: &Path,
    config: notify::Config,
) -> Result<Debouncer<W, RecommendedCache>, notify::Error> {
    let file_name = live.path.file_name().map(ToOwned::to_owned);
    let target = live.clone();
    let handler = move |result: DebounceEventResult| match result {
        Ok(events) => {
            let touches_file = events.iter().any(|event| {
                event
                    .paths
                    .iter()
                    .any(|path| path.file_name() == file_name.as_deref())
            });
            if touches_file {
                target.reload();
            }
        }
        Err(errors) => {
            for error in errors {
                tracing::warn!(target: "production_lab::configuration", %error, "settings watch error");
            }
        }
    };
    let mut debouncer = new_debouncer_opt::<_, W, RecommendedCache>(
        DEBOUNCE,
        None,
        handler,
        RecommendedCache::new(),
        config,
    )?;
    debouncer.watch(watched, RecursiveMode::NonRecursive)?;
    // The file may have changed between the start-up read and the watch starting.
    live.reload();
    Ok(debouncer)
}

/// The directory holding the settings file; `.` for a bare file name.
fn watched_directory(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn settings(label: &str) -> LiveSettings {
        LiveSettings {
            label: label.to_owned(),
            maximum: 3,
            secret: "s".to_owned(),
        }
    }

    #[test]
    fn an_error_is_reported_once_until_it_changes_or_is_fixed() {
        let live = LiveConfiguration::new(PathBuf::from("unused.json"), settings("initial"));
        let blank = || Err("Live:Label must not be blank".to_owned());
        assert!(matches!(live.apply(blank()), Transition::NewError(_)));
        assert_eq!(live.apply(blank()), Transition::Unchanged);
        assert!(matches!(
            live.apply(Err(
                "Live:Maximum must be from 1 to 10 (found 11)".to_owned()
            )),
            Transition::NewError(_)
        ));
        assert_eq!(live.status().last_good.label, "initial", "last good kept");
        assert_eq!(live.apply(Ok(settings("fixed"))), Transition::Recovered);
        assert_eq!(live.status().error, None);
        assert_eq!(live.status().last_good.label, "fixed");
        assert!(matches!(live.apply(blank()), Transition::NewError(_)));
    }

    #[test]
    fn a_bare_file_name_watches_the_working_directory() {
        assert_eq!(
            watched_directory(Path::new("runtime-settings.json")),
            PathBuf::from(".")
        );
        assert_eq!(
            watched_directory(Path::new("/etc/lab/settings.json")),
            PathBuf::from("/etc/lab")
        );
    }

    #[test]
    fn the_polling_fallback_also_sees_an_edit() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("runtime-settings.json");
        std::fs::write(&path, r#"{"Live":{"Label":"initial","Maximum":3}}"#).expect("write");
        let live = Arc::new(LiveConfiguration::new(path.clone(), settings("initial")));
        let _watch = start::<PollWatcher>(&live, &path, polling_config(Duration::from_millis(100)))
            .expect("polling watcher starts");
        std::fs::write(&path, r#"{"Live":{"Label":"polled","Maximum":4}}"#).expect("write");
        let deadline = Instant::now() + Duration::from_secs(10);
        while live.status().last_good.label != "polled" {
            assert!(Instant::now() < deadline, "the edit was never seen");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(live.status().last_good.maximum, 4);
    }
}
