//! Live configuration: the settings file is watched, and `GET /configuration` answers from the
//! last settings that passed validation — or 503 while the file on disk is invalid.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::event::{AccessKind, AccessMode, EventKind, MetadataKind, ModifyKind};
use notify::{PollWatcher, RecursiveMode, Watcher};
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache, new_debouncer_opt};

use crate::config::{LiveSettings, parse_settings};

/// How long the file must be quiet before a burst of events (an editor's write, rename, chmod)
/// triggers one reload.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// How often the fallback polling watcher looks at the directory when inotify is unavailable.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// The first retry after a transient read error, doubled up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(5);

/// What `GET /configuration` answers from. Swapped as a whole so a reader never sees a value
/// from one reload and an error from another.
pub struct LiveStatus {
    /// The last settings that passed validation (the start-up settings until a reload).
    pub last_good: LiveSettings,
    /// Why the file on disk is rejected right now; `None` while it is valid.
    pub error: Option<String>,
}

/// Reads the settings file; replaced in tests to produce read errors.
type Reader = Box<dyn Fn(&Path) -> io::Result<String> + Send + Sync>;

/// The settings file, its last good value, and its current status.
pub struct LiveConfiguration {
    path: PathBuf,
    status: ArcSwap<LiveStatus>,
    read: Reader,
    evidence: Counters,
}

/// What the watch did, for tests and the curious: it reloads only when the file's content may
/// have changed, never because of its own reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchEvidence {
    /// Reloads the watch asked for: one at start, then one per batch of content changes.
    pub reloads: u64,
    /// Times the file was read (a retried read counts each time).
    pub reads: u64,
    /// Events about other files in the settings directory, ignored.
    pub unrelated_events: u64,
}

#[derive(Default)]
struct Counters {
    reloads: AtomicU64,
    reads: AtomicU64,
    unrelated_events: AtomicU64,
}

/// What one reload did.
#[derive(Debug, PartialEq, Eq)]
enum Reloaded {
    /// The file was read; its settings or its error are now current.
    Read,
    /// The file could not be read for a reason that says nothing about it (too many open files,
    /// an interrupted call): the last status stays, and the read is retried.
    Transient(String),
}

impl LiveConfiguration {
    pub fn new(path: PathBuf, initial: LiveSettings) -> Self {
        Self::with_reader(
            path,
            initial,
            Box::new(|path| std::fs::read_to_string(path)),
        )
    }

    fn with_reader(path: PathBuf, initial: LiveSettings, read: Reader) -> Self {
        LiveConfiguration {
            path,
            status: ArcSwap::from_pointee(LiveStatus {
                last_good: initial,
                error: None,
            }),
            read,
            evidence: Counters::default(),
        }
    }

    pub fn status(&self) -> Arc<LiveStatus> {
        self.status.load_full()
    }

    pub fn evidence(&self) -> WatchEvidence {
        WatchEvidence {
            reloads: self.evidence.reloads.load(Ordering::Relaxed),
            reads: self.evidence.reads.load(Ordering::Relaxed),
            unrelated_events: self.evidence.unrelated_events.load(Ordering::Relaxed),
        }
    }

    /// Reads and validates the file again, and logs a newly seen error once. Called from the
    /// reload thread (never on the async runtime), one reload at a time.
    fn reload(&self) -> Reloaded {
        self.evidence.reads.fetch_add(1, Ordering::Relaxed);
        let text = match (self.read)(&self.path) {
            Ok(text) => Ok(text),
            Err(error) if is_transient(&error) => return Reloaded::Transient(error.to_string()),
            Err(error) => Err(format!("cannot read the settings file: {error}")),
        };
        if let Ok(text) = &text {
            // The length says which write was read (never the content: it holds the secret).
            tracing::debug!(
                target: "production_lab::configuration",
                path = %self.path.display(),
                bytes = text.len(),
                "settings file read"
            );
        }
        let outcome = text.and_then(|text| parse_settings(&text));
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
        Reloaded::Read
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

/// Errors that describe the file itself (missing, not readable by us, not UTF-8, a directory)
/// make the settings invalid; any other read error is about the process or the moment (EMFILE,
/// ENFILE, ENOMEM, EINTR, ...) and is retried with the last settings kept.
fn is_transient(error: &io::Error) -> bool {
    !matches!(
        error.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::InvalidData
            | io::ErrorKind::IsADirectory
    )
}

/// Events that can mean the file's content changed: written, created, removed or renamed. Not
/// opens or reads (the watch's own reload opens the file, which used to trigger the next reload,
/// forever) and not permission or access-time changes.
fn is_content_change(kind: &EventKind) -> bool {
    match kind {
        EventKind::Create(_) | EventKind::Remove(_) => true,
        EventKind::Modify(ModifyKind::Metadata(metadata)) => {
            // The polling watcher reports a newer modification time this way.
            *metadata == MetadataKind::WriteTime
        }
        EventKind::Modify(_) => true,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) | EventKind::Any | EventKind::Other => false,
    }
}

/// Asks the reload thread for a reload; every watch asks through it, so the evidence counts each
/// reload asked for.
#[derive(Clone)]
struct Reloads {
    live: Arc<LiveConfiguration>,
    requests: mpsc::Sender<()>,
}

impl Reloads {
    fn ask(&self) {
        self.live.evidence.reloads.fetch_add(1, Ordering::Relaxed);
        let _ = self.requests.send(());
    }
}

/// Runs reloads on a thread of its own, one at a time, and retries a transient read error with
/// a growing pause until the file reads. Requests that arrive during a reload are merged into
/// one. The thread ends when every [`Reloads`] is gone (the watch was dropped).
fn spawn_reloader(live: Arc<LiveConfiguration>) -> Result<Reloads, String> {
    let (requests, received) = mpsc::channel::<()>();
    let reloads = Reloads {
        live: live.clone(),
        requests,
    };
    std::thread::Builder::new()
        .name("settings-reload".to_owned())
        .spawn(move || {
            let mut retry: Option<Duration> = None;
            loop {
                let next = match retry {
                    None => received.recv().map_err(|_| ()),
                    Some(pause) => match received.recv_timeout(pause) {
                        Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => Ok(()),
                        Err(mpsc::RecvTimeoutError::Disconnected) => Err(()),
                    },
                };
                if next.is_err() {
                    return;
                }
                while received.try_recv().is_ok() {}
                retry = match live.reload() {
                    Reloaded::Read => {
                        if retry.is_some() {
                            tracing::info!(
                                target: "production_lab::configuration",
                                path = %live.path.display(),
                                "the settings file reads again"
                            );
                        }
                        None
                    }
                    Reloaded::Transient(reason) => {
                        if retry.is_none() {
                            tracing::warn!(
                                target: "production_lab::configuration",
                                path = %live.path.display(),
                                "cannot read the settings file for now ({reason}); keeping the last settings and retrying"
                            );
                        }
                        Some(retry.map_or(FIRST_RETRY, |pause| (pause * 2).min(MAX_RETRY)))
                    }
                };
            }
        })
        .map_err(|error| format!("cannot start the reload thread: {error}"))?;
    Ok(reloads)
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
/// renaming it over the old one, which an OS watch on the file itself would lose) and reloads
/// when an event says the file's content may have changed. Falls back to polling the file when
/// the OS watcher cannot start (e.g. the inotify instance limit is reached).
pub fn watch(live: Arc<LiveConfiguration>) -> Result<SettingsWatch, String> {
    let directory = watched_directory(&live.path);
    match native_watch(&live, &directory) {
        Ok(watch) => Ok(watch),
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

/// On Linux, inotify asked only for whole-file events ([`inotify_watch`]).
#[cfg(target_os = "linux")]
fn native_watch(live: &Arc<LiveConfiguration>, directory: &Path) -> Result<SettingsWatch, String> {
    let watch = inotify_watch::start(live, directory)?;
    Ok(SettingsWatch {
        _debouncer: Box::new(watch),
    })
}

/// Elsewhere, the platform's watcher through `notify`.
#[cfg(not(target_os = "linux"))]
fn native_watch(live: &Arc<LiveConfiguration>, directory: &Path) -> Result<SettingsWatch, String> {
    let debouncer = start::<notify::RecommendedWatcher>(live, directory, notify::Config::default())
        .map_err(|error| error.to_string())?;
    Ok(SettingsWatch {
        _debouncer: Box::new(debouncer),
    })
}

/// The settings directory watched with inotify for the events that end a change to a whole
/// file: a write closed, a file created, deleted or renamed in or out.
///
/// Not `notify`'s inotify watcher: it always asks for `IN_MODIFY` and `IN_OPEN`, so every
/// `write` to any file in the directory queues an event and wakes its thread. The database and
/// its WAL usually sit next to the settings file, and under load that was about 9% of the
/// server's CPU per delivery, the kernel's share included. A writer that edits the file in place
/// and keeps it open is seen when it closes the file.
#[cfg(target_os = "linux")]
mod inotify_watch {
    use std::sync::atomic::AtomicBool;

    use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};

    use super::*;

    const WHOLE_FILE_EVENTS: WatchMask = WatchMask::CLOSE_WRITE
        .union(WatchMask::CREATE)
        .union(WatchMask::DELETE)
        .union(WatchMask::MOVED_FROM)
        .union(WatchMask::MOVED_TO)
        .union(WatchMask::DELETE_SELF)
        .union(WatchMask::MOVE_SELF);

    /// Dropping it removes the watch, which wakes the reading thread to end.
    pub struct DirectoryWatch {
        watches: Watches,
        descriptor: WatchDescriptor,
        stopping: Arc<AtomicBool>,
    }

    impl Drop for DirectoryWatch {
        fn drop(&mut self) {
            self.stopping.store(true, Ordering::Relaxed);
            // Queues IN_IGNORED, the reading thread's signal to end.
            let _ = self.watches.remove(self.descriptor.clone());
        }
    }

    pub fn start(
        live: &Arc<LiveConfiguration>,
        directory: &Path,
    ) -> Result<DirectoryWatch, String> {
        let inotify = Inotify::init().map_err(|error| format!("inotify: {error}"))?;
        let mut watches = inotify.watches();
        let descriptor = watches
            .add(directory, WHOLE_FILE_EVENTS)
            .map_err(|error| format!("inotify on {}: {error}", directory.display()))?;
        let reloads = spawn_reloader(live.clone())?;
        let changes = spawn_debouncer(reloads.clone())?;
        let stopping = Arc::new(AtomicBool::new(false));
        spawn_reader(live.clone(), inotify, changes, stopping.clone())?;
        // The file may have changed between the start-up read and the watch starting.
        reloads.ask();
        Ok(DirectoryWatch {
            watches,
            descriptor,
            stopping,
        })
    }

    /// Reads the directory's events; tells the debouncer of each batch that names the file and
    /// counts the others. Ends when the watch is removed.
    fn spawn_reader(
        live: Arc<LiveConfiguration>,
        mut inotify: Inotify,
        changes: mpsc::Sender<()>,
        stopping: Arc<AtomicBool>,
    ) -> Result<(), String> {
        let file_name = live.path.file_name().map(ToOwned::to_owned);
        std::thread::Builder::new()
            .name("settings-watch".to_owned())
            .spawn(move || {
                let mut buffer = [0u8; 4096];
                loop {
                    let events = match inotify.read_events_blocking(&mut buffer) {
                        Ok(events) => events,
                        Err(error) => {
                            tracing::warn!(target: "production_lab::configuration", %error, "settings watch error; the watch stops");
                            return;
                        }
                    };
                    let (mut changed, mut unrelated, mut removed) = (false, 0, false);
                    for event in events {
                        if event.mask.contains(EventMask::IGNORED) {
                            removed = true;
                        } else if event.name.is_none() || event.name == file_name.as_deref() {
                            // A named event for the file, or the directory itself deleted or
                            // moved (the file went with it).
                            changed = true;
                        } else {
                            unrelated += 1;
                        }
                    }
                    if changed {
                        let _ = changes.send(());
                    }
                    // Counted after the change was passed on: a test that sees an unrelated
                    // event knows every earlier event was handled.
                    live.evidence
                        .unrelated_events
                        .fetch_add(unrelated, Ordering::Relaxed);
                    if removed {
                        if !stopping.load(Ordering::Relaxed) {
                            tracing::warn!(target: "production_lab::configuration", "the settings directory is gone; the watch stops");
                        }
                        return;
                    }
                }
            })
            .map(drop)
            .map_err(|error| format!("cannot start the settings watch thread: {error}"))
    }

    /// Turns each burst of changes (an editor's write, rename, chmod) into one reload once the
    /// file has been quiet for [`DEBOUNCE`]. Ends when the reader does.
    fn spawn_debouncer(reloads: Reloads) -> Result<mpsc::Sender<()>, String> {
        let (changes, received) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("settings-debounce".to_owned())
            .spawn(move || {
                while received.recv().is_ok() {
                    while let Ok(()) = received.recv_timeout(DEBOUNCE) {}
                    reloads.ask();
                }
            })
            .map_err(|error| format!("cannot start the settings debounce thread: {error}"))?;
        Ok(changes)
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
    let reloads = spawn_reloader(live.clone()).map_err(|reason| notify::Error::generic(&reason))?;
    let file_name = live.path.file_name().map(ToOwned::to_owned);
    let target = live.clone();
    let reload = reloads.clone();
    let handler = move |result: DebounceEventResult| match result {
        Ok(events) => {
            let mut changed = false;
            let mut unrelated = 0;
            for event in &events {
                let names_file = event
                    .paths
                    .iter()
                    .any(|path| path.file_name() == file_name.as_deref());
                if !names_file {
                    unrelated += 1;
                } else if is_content_change(&event.kind) {
                    changed = true;
                }
            }
            if changed {
                reload.ask();
            }
            // Counted after the reload was asked for: a test that sees an unrelated event knows
            // every earlier event was handled.
            target
                .evidence
                .unrelated_events
                .fetch_add(unrelated, Ordering::Relaxed);
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
    reloads.ask();
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

    /// The error a process out of file descriptors gets from open(2).
    fn too_many_open_files() -> io::Error {
        io::Error::from_raw_os_error(24)
    }

    #[test]
    fn a_transient_read_error_keeps_the_last_good_settings() {
        let live = LiveConfiguration::with_reader(
            PathBuf::from("unused.json"),
            settings("initial"),
            Box::new(|_| Err(too_many_open_files())),
        );
        assert!(matches!(live.reload(), Reloaded::Transient(_)));
        assert_eq!(live.status().error, None, "still serving, not 503");
        assert_eq!(live.status().last_good.label, "initial");
        // An error that describes the file itself still makes the settings invalid.
        let missing = LiveConfiguration::with_reader(
            PathBuf::from("unused.json"),
            settings("initial"),
            Box::new(|_| Err(io::ErrorKind::NotFound.into())),
        );
        assert_eq!(missing.reload(), Reloaded::Read);
        assert!(missing.status().error.is_some());
    }

    #[test]
    fn a_transient_read_error_is_retried_until_the_file_reads() {
        let failures = Arc::new(AtomicU64::new(0));
        let counted = failures.clone();
        let live = Arc::new(LiveConfiguration::with_reader(
            PathBuf::from("unused.json"),
            settings("initial"),
            Box::new(move |_| {
                if counted.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(too_many_open_files())
                } else {
                    Ok(r#"{"Live":{"Label":"read at last","Maximum":4}}"#.to_owned())
                }
            }),
        ));
        let reloads = spawn_reloader(live.clone()).expect("reload thread");
        reloads.ask();
        let deadline = Instant::now() + Duration::from_secs(10);
        while live.status().last_good.label != "read at last" {
            assert_eq!(live.status().error, None, "a transient error never shows");
            assert!(Instant::now() < deadline, "the read was never retried");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(live.evidence().reads, 3, "two failures, then the read");
    }

    #[test]
    fn only_content_changes_reload() {
        use notify::event::{CreateKind, DataChange, RemoveKind, RenameMode};
        for change in [
            EventKind::Create(CreateKind::File),
            EventKind::Remove(RemoveKind::File),
            EventKind::Modify(ModifyKind::Data(DataChange::Content)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::WriteTime)),
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
        ] {
            assert!(is_content_change(&change), "{change:?}");
        }
        for not_a_change in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::Permissions)),
            EventKind::Any,
        ] {
            assert!(!is_content_change(&not_a_change), "{not_a_change:?}");
        }
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
