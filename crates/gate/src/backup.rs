//! `production-lab gate backup`: a consistent copy of a gate's SQLite store, taken while the
//! gate serves, with SQLite's online backup API.
//!
//! The copy is read inside one read transaction on the store. In WAL mode that transaction sees
//! one snapshot whatever the gate's writer commits meanwhile, so the copy is consistent and
//! finishes: a backup that reads each step in a transaction of its own starts over at every
//! write from another connection, and under a steady load never ends. The gate's writer is not
//! held up by the reader (WAL readers block no writer); the copy goes `pages_per_step` pages at a
//! time with a pause between steps so that it does not crowd the gate's disk either.
//!
//! The copy is written to `DIR/.NAME.partial` beside the target, checked with
//! `PRAGMA integrity_check`, synced, and linked to the target in one step that fails if the
//! target exists: a reader of the target never sees half a copy, and nothing is overwritten.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::backup::{Backup, StepResult};
use rusqlite::{Connection, OpenFlags};

use crate::config::GateStore;

/// Pages copied per step unless told otherwise.
pub const DEFAULT_PAGES_PER_STEP: u32 = 256;
/// The pause between steps unless told otherwise.
pub const DEFAULT_PAUSE: Duration = Duration::from_millis(5);
/// How long the store's reader waits for a lock (a WAL recovery by another connection).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// The files SQLite may keep beside a database, by suffix.
const SIDE_FILES: [&str; 3] = ["-wal", "-shm", "-journal"];

/// How the copy paces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackupPace {
    /// Pages copied per step (at least one).
    pub pages_per_step: u32,
    /// The pause after each step.
    pub pause: Duration,
}

impl Default for BackupPace {
    fn default() -> BackupPace {
        BackupPace {
            pages_per_step: DEFAULT_PAGES_PER_STEP,
            pause: DEFAULT_PAUSE,
        }
    }
}

/// What a finished backup copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupSummary {
    pub source: PathBuf,
    pub target: PathBuf,
    pub pages: u64,
    pub bytes: u64,
    pub elapsed: Duration,
}

impl std::fmt::Display for BackupSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "backup of {} to {}: {} pages, {} bytes, {} ms",
            self.source.display(),
            self.target.display(),
            self.pages,
            self.bytes,
            self.elapsed.as_millis()
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{0} exists already: a backup never overwrites a file; give a new path")]
    TargetExists(PathBuf),
    #[error(
        "{partial} exists: another backup to {target} is running, or one was interrupted (remove {partial} once none runs)"
    )]
    PartialExists { partial: PathBuf, target: PathBuf },
    #[error("{0} names no file to write the copy to")]
    NoFileName(PathBuf),
    #[error(
        "the store is in PostgreSQL (store.postgres_url_env = {env}): this command copies a SQLite store only; back PostgreSQL up with pg_dump of the gate's tables or with point-in-time recovery, see docs/gate.md, Backup and restore"
    )]
    Postgres { env: String },
    #[error("no store at {0} (store.sqlite)")]
    NoStore(PathBuf),
    #[error("reading the store {path}: {error}")]
    Source {
        path: PathBuf,
        error: rusqlite::Error,
    },
    #[error("writing the copy {path}: {error}")]
    Copy {
        path: PathBuf,
        error: rusqlite::Error,
    },
    #[error("the copy {path} failed its integrity check: {report}")]
    Integrity { path: PathBuf, report: String },
    #[error("{action} {path}: {error}")]
    Io {
        action: &'static str,
        path: PathBuf,
        error: io::Error,
    },
}

/// Copies the gate's store to `target`; a PostgreSQL store is refused (pg_dump's job).
pub fn back_up(
    store: &GateStore,
    target: &Path,
    pace: BackupPace,
) -> Result<BackupSummary, BackupError> {
    match store {
        GateStore::Sqlite(path) => back_up_sqlite(path, target, pace),
        GateStore::Postgres { env, .. } => Err(BackupError::Postgres { env: env.clone() }),
    }
}

/// Copies the SQLite store at `source` to `target`, which must not exist.
pub fn back_up_sqlite(
    source: &Path,
    target: &Path,
    pace: BackupPace,
) -> Result<BackupSummary, BackupError> {
    let started = Instant::now();
    refuse_existing(target)?;
    if !source.is_file() {
        return Err(BackupError::NoStore(source.to_owned()));
    }
    let partial = Partial::create(target)?;
    let pages = copy_pages(source, &partial.path, pace)?;
    check_integrity(&partial.path)?;
    sync_file(&partial.path)?;
    partial.link_to(target)?;
    let bytes = std::fs::metadata(target)
        .map_err(|error| io_error("cannot read the size of", target, error))?
        .len();
    Ok(BackupSummary {
        source: source.to_owned(),
        target: target.to_owned(),
        pages,
        bytes,
        elapsed: started.elapsed(),
    })
}

/// Where the copy is written before it is linked to `target`: `DIR/.NAME.partial`, in the
/// target's directory so that the link stays on one file system.
pub fn partial_path(target: &Path) -> Result<PathBuf, BackupError> {
    let name = target
        .file_name()
        .ok_or_else(|| BackupError::NoFileName(target.to_owned()))?;
    let mut partial = std::ffi::OsString::from(".");
    partial.push(name);
    partial.push(".partial");
    Ok(directory_of(target).join(partial))
}

/// The directory `path` is in (`.` for a bare file name).
fn directory_of(path: &Path) -> &Path {
    path.parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Refuses a target that exists, whatever it is (a file, a directory, a dangling link).
fn refuse_existing(target: &Path) -> Result<(), BackupError> {
    match std::fs::symlink_metadata(target) {
        Ok(_) => Err(BackupError::TargetExists(target.to_owned())),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_error("cannot look at", target, error)),
    }
}

/// Copies every page of `source` into the empty database at `partial` from one read
/// transaction on `source`; answers the pages copied.
fn copy_pages(source: &Path, partial: &Path, pace: BackupPace) -> Result<u64, BackupError> {
    let read_error = |error| BackupError::Source {
        path: source.to_owned(),
        error,
    };
    let write_error = |error| BackupError::Copy {
        path: partial.to_owned(),
        error,
    };
    let reader = open_reader(source).map_err(read_error)?;
    let mut copy = Connection::open(partial).map_err(write_error)?;
    let pages = {
        let backup = Backup::new(&reader, &mut copy).map_err(write_error)?;
        let pages_per_step = i32::try_from(pace.pages_per_step.max(1)).unwrap_or(i32::MAX);
        loop {
            match backup.step(pages_per_step).map_err(write_error)? {
                StepResult::Done => break,
                // Busy or locked: the same step again after the pause.
                _ => std::thread::sleep(pace.pause),
            }
        }
        u64::try_from(backup.progress().pagecount).unwrap_or(0)
    };
    copy.close().map_err(|(_, error)| write_error(error))?;
    reader.close().map_err(|(_, error)| read_error(error))?;
    Ok(pages)
}

/// A read-only connection to `source` inside a read transaction that has read the schema: from
/// here on it sees one snapshot of the store, which the backup copies.
fn open_reader(source: &Path) -> rusqlite::Result<Connection> {
    let reader = Connection::open_with_flags(
        source,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    reader.busy_timeout(BUSY_TIMEOUT)?;
    // A deferred BEGIN takes no snapshot until the first read; the read of the schema takes it.
    reader.execute_batch("BEGIN DEFERRED")?;
    reader.query_row("SELECT count(*) FROM sqlite_schema", [], |row| {
        row.get::<_, i64>(0)
    })?;
    Ok(reader)
}

/// `PRAGMA integrity_check` on the copy must answer `ok`.
fn check_integrity(copy: &Path) -> Result<(), BackupError> {
    let failed = |error| BackupError::Copy {
        path: copy.to_owned(),
        error,
    };
    let connection = Connection::open(copy).map_err(failed)?;
    let report = {
        let mut statement = connection
            .prepare("PRAGMA integrity_check")
            .map_err(failed)?;
        let lines = statement
            .query_map([], |row| row.get::<_, String>(0))
            .map_err(failed)?;
        lines.collect::<rusqlite::Result<Vec<String>>>()
    }
    .map_err(failed)?;
    connection.close().map_err(|(_, error)| failed(error))?;
    if integrity_ok(&report) {
        Ok(())
    } else {
        Err(BackupError::Integrity {
            path: copy.to_owned(),
            report: report.join("; "),
        })
    }
}

/// Whether an integrity check's lines say the database is sound.
fn integrity_ok(report: &[String]) -> bool {
    matches!(report, [only] if only == "ok")
}

/// Writes `path`'s data to disk.
fn sync_file(path: &Path) -> Result<(), BackupError> {
    File::open(path)
        .and_then(|file| file.sync_all())
        .map_err(|error| io_error("cannot sync", path, error))
}

fn io_error(action: &'static str, path: &Path, error: io::Error) -> BackupError {
    BackupError::Io {
        action,
        path: path.to_owned(),
        error,
    }
}

/// The copy being written, removed (with SQLite's side files) unless it was linked into place.
struct Partial {
    path: PathBuf,
    linked: bool,
}

impl Partial {
    /// Creates the empty partial file for `target`; one that exists is another backup's, or an
    /// interrupted one's, and is left alone.
    fn create(target: &Path) -> Result<Partial, BackupError> {
        let path = partial_path(target)?;
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(_) => Ok(Partial {
                path,
                linked: false,
            }),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                Err(BackupError::PartialExists {
                    partial: path,
                    target: target.to_owned(),
                })
            }
            Err(error) => Err(io_error("cannot create", &path, error)),
        }
    }

    /// Gives the copy its name: a hard link, which fails if `target` appeared meanwhile (a
    /// rename would replace it), then the partial name removed and the directory synced.
    fn link_to(mut self, target: &Path) -> Result<(), BackupError> {
        match std::fs::hard_link(&self.path, target) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                return Err(BackupError::TargetExists(target.to_owned()));
            }
            Err(error) => return Err(io_error("cannot link the copy to", target, error)),
        }
        self.linked = true;
        std::fs::remove_file(&self.path)
            .map_err(|error| io_error("cannot remove", &self.path, error))?;
        let directory = directory_of(target);
        sync_file(directory)
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if self.linked {
            return;
        }
        let _ = std::fs::remove_file(&self.path);
        for suffix in SIDE_FILES {
            let mut side = self.path.clone().into_os_string();
            side.push(suffix);
            let _ = std::fs::remove_file(side);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partial_copy_is_a_hidden_file_beside_the_target() {
        assert_eq!(
            partial_path(Path::new("/var/backups/gate-2026.db")).unwrap(),
            Path::new("/var/backups/.gate-2026.db.partial")
        );
        assert_eq!(
            partial_path(Path::new("gate.db")).unwrap(),
            Path::new("./.gate.db.partial")
        );
        assert!(matches!(
            partial_path(Path::new("/")),
            Err(BackupError::NoFileName(_))
        ));
    }

    #[test]
    fn only_a_single_ok_line_passes_the_integrity_check() {
        assert!(integrity_ok(&["ok".to_owned()]));
        assert!(!integrity_ok(&[]));
        assert!(!integrity_ok(&["row 3 missing from index x".to_owned()]));
        assert!(!integrity_ok(&["ok".to_owned(), "ok".to_owned()]));
    }

    #[test]
    fn the_summary_is_one_line_with_pages_bytes_and_milliseconds() {
        let summary = BackupSummary {
            source: "gate.db".into(),
            target: "copy.db".into(),
            pages: 12,
            bytes: 49_152,
            elapsed: Duration::from_millis(34),
        };
        assert_eq!(
            summary.to_string(),
            "backup of gate.db to copy.db: 12 pages, 49152 bytes, 34 ms"
        );
    }

    /// A WAL store with `rows` rows in `t`, its connection kept open as a gate's writer is.
    fn store(dir: &Path, rows: i64) -> Connection {
        let connection = Connection::open(dir.join("gate.db")).unwrap();
        connection
            .query_row("PRAGMA journal_mode=WAL", [], |row| row.get::<_, String>(0))
            .unwrap();
        connection
            .execute_batch("CREATE TABLE t(n INTEGER PRIMARY KEY, body TEXT)")
            .unwrap();
        insert(&connection, 1, rows);
        connection
    }

    fn insert(connection: &Connection, from: i64, to: i64) {
        connection
            .execute(
                "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
                 INSERT INTO t SELECT i, printf('%.500c', 'x') FROM n",
                [from, to],
            )
            .unwrap();
    }

    fn count(path: &Path) -> i64 {
        Connection::open(path)
            .unwrap()
            .query_row("SELECT count(*) FROM t", [], |row| row.get(0))
            .unwrap()
    }

    #[test]
    fn a_copy_holds_the_store_and_leaves_no_partial_file() {
        let dir = tempfile::tempdir().unwrap();
        let _writer = store(dir.path(), 200);
        let target = dir.path().join("copy.db");
        let pace = BackupPace {
            pages_per_step: 3,
            pause: Duration::ZERO,
        };
        let summary = back_up_sqlite(&dir.path().join("gate.db"), &target, pace).unwrap();
        assert_eq!(count(&target), 200);
        assert!(summary.pages > 3, "{summary}");
        assert_eq!(summary.bytes, std::fs::metadata(&target).unwrap().len());
        assert!(!partial_path(&target).unwrap().exists());
    }

    #[test]
    fn the_copy_is_the_snapshot_its_read_transaction_took_whatever_is_written_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let writer = store(dir.path(), 200);
        let copy = dir.path().join("copy.db");
        let reader = open_reader(&dir.path().join("gate.db")).unwrap();
        let mut destination = Connection::open(&copy).unwrap();
        let backup = Backup::new(&reader, &mut destination).unwrap();
        let mut steps = 0;
        // A write from the gate's connection between every step: without the read transaction
        // the backup would start over after each and never end.
        while backup.step(2).unwrap() != StepResult::Done {
            steps += 1;
            insert(&writer, 1000 + steps, 1000 + steps);
            assert!(steps < 10_000, "the backup never finishes");
        }
        drop(backup);
        drop(destination);
        assert!(steps > 1);
        assert_eq!(count(&copy), 200, "the copy holds the snapshot, not a mix");
    }

    #[test]
    fn an_existing_target_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let _writer = store(dir.path(), 10);
        let target = dir.path().join("copy.db");
        std::fs::write(&target, "keep me").unwrap();
        let refused = back_up_sqlite(&dir.path().join("gate.db"), &target, BackupPace::default());
        assert!(
            matches!(refused, Err(BackupError::TargetExists(_))),
            "{refused:?}"
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    }

    #[test]
    fn a_partial_file_left_behind_is_refused_and_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let _writer = store(dir.path(), 10);
        let target = dir.path().join("copy.db");
        let partial = partial_path(&target).unwrap();
        std::fs::write(&partial, "another backup's").unwrap();
        let refused = back_up_sqlite(&dir.path().join("gate.db"), &target, BackupPace::default());
        assert!(
            matches!(refused, Err(BackupError::PartialExists { .. })),
            "{refused:?}"
        );
        assert_eq!(
            std::fs::read_to_string(&partial).unwrap(),
            "another backup's"
        );
        assert!(!target.exists());
    }

    #[test]
    fn a_missing_store_is_named_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("copy.db");
        let refused = back_up_sqlite(&dir.path().join("none.db"), &target, BackupPace::default());
        assert!(
            matches!(refused, Err(BackupError::NoStore(_))),
            "{refused:?}"
        );
        assert!(!target.exists());
        assert!(!partial_path(&target).unwrap().exists());
    }
}
