//! A lazy file system: a FUSE passthrough over a backing directory that can forget every write
//! not yet synced, as a power failure would (the same idea as Jepsen's LazyFS). A process killed
//! with SIGKILL loses nothing on an ordinary file system, because the kernel's page cache keeps
//! what it wrote; a store mounted here loses what it never fsynced once the test calls
//! [`LazyFs::lose_unsynced`].
//!
//! Every operation passes through to the backing directory, so reads see what was written. What
//! the file system keeps aside, per file and only since that file's last `fsync`/`fdatasync`:
//!
//! - the file's length at that sync (0 for a file created since: it was never synced);
//! - the bytes at that sync of every range a write or a truncation has changed since, each range
//!   saved once, the first time it changes (an undo log; appends need nothing but the length).
//!
//! [`LazyFs::lose_unsynced`] gives every such file its synced length back and writes the saved
//! bytes over it: each file is as it was at its last sync, a file never synced is empty. The
//! undo log of a file is dropped when it is synced, so memory holds only what was written since.
//!
//! Simplifications, on purpose: metadata operations (create, mkdir, rename, unlink, rmdir,
//! permissions, times) are durable at once, so a file created and never synced survives the loss
//! empty, and a rename is never undone. Syncs are bookkeeping only: the backing directory is
//! never really fsynced (its page cache is the "disk", which no test power failure touches).
//! Files are opened with direct I/O and attributes are never cached, so the kernel keeps no copy
//! of a file's pages that a loss would leave stale. Hard links, symbolic links, special files,
//! extended attributes and `fallocate` are not supported (nats-server's file store needs none).
//!
//! Mounting needs `/dev/fuse` and root (the mount is made with mount(2) directly). It is
//! unmounted when the [`LazyFs`] is dropped.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    TimeOrNow, WriteFlags,
};

/// Why a lazy file system could not be mounted, or could not forget.
#[derive(Debug, thiserror::Error)]
pub enum LazyFsError {
    #[error(
        "no /dev/fuse: the kernel's FUSE module is missing (modprobe fuse); as another user than root mounting also needs fusermount3 from the Debian package `fuse3`"
    )]
    NoFuseDevice,
    #[error(
        "cannot mount a lazy file system on {mountpoint}: {error} (this needs root, or fusermount3 from the Debian package `fuse3`)"
    )]
    Mount {
        mountpoint: String,
        error: std::io::Error,
    },
    #[error("lazy file system, reverting {path}: {error}")]
    Revert { path: String, error: std::io::Error },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// What a [`LazyFs::lose_unsynced`] took away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Loss {
    /// Files that had changed since their last sync, now as they were then.
    pub files: usize,
    /// Bytes cut off the ends of files (written past their synced length).
    pub bytes_cut: u64,
    /// Bytes written back over ranges changed since the last sync.
    pub bytes_restored: u64,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} file(s) reverted to their last sync: {} byte(s) cut, {} restored",
            self.files, self.bytes_cut, self.bytes_restored
        )
    }
}

/// A mounted lazy file system. Dropping it unmounts it.
pub struct LazyFs {
    state: Arc<Mutex<State>>,
    mountpoint: PathBuf,
    session: Option<BackgroundSession>,
    /// The kernel's number for the FUSE connection (the mount's device), to abort it.
    connection: u64,
}

impl LazyFs {
    /// Mounts a lazy file system over `backing` (a directory) at `mountpoint` (an empty
    /// directory).
    pub fn mount(backing: &Path, mountpoint: &Path) -> Result<LazyFs, LazyFsError> {
        if !Path::new("/dev/fuse").exists() {
            return Err(LazyFsError::NoFuseDevice);
        }
        let backing = backing.canonicalize()?;
        let mountpoint = mountpoint.canonicalize()?;
        let state = Arc::new(Mutex::new(State::new(backing)?));
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("lazyfs".to_owned()),
            MountOption::Subtype("lazyfs".to_owned()),
        ];
        let filesystem = Passthrough {
            state: state.clone(),
        };
        let session = fuser::spawn_mount(filesystem, &mountpoint, &config).map_err(|error| {
            LazyFsError::Mount {
                mountpoint: mountpoint.display().to_string(),
                error,
            }
        })?;
        let connection = std::fs::metadata(&mountpoint)?.dev();
        Ok(LazyFs {
            state,
            mountpoint,
            session: Some(session),
            connection,
        })
    }

    /// Where the file system is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// A power failure: every file back to its state at its last sync (see the module's doc).
    /// Call it while no process uses the file system (after it was killed), since the kernel
    /// would not see a change under a file it has open.
    pub fn lose_unsynced(&self) -> Result<Loss, LazyFsError> {
        let mut state = lock(&self.state);
        let unsynced = std::mem::take(&mut state.unsynced);
        let mut loss = Loss::default();
        for (key, file) in unsynced {
            let Some(path) = state.path_of_backing(key) else {
                continue;
            };
            file.revert(&path, &mut loss)
                .map_err(|error| LazyFsError::Revert {
                    path: path.display().to_string(),
                    error,
                })?;
        }
        Ok(loss)
    }

    /// How many files have writes since their last sync.
    pub fn unsynced_files(&self) -> usize {
        lock(&self.state).unsynced.len()
    }
}

impl Drop for LazyFs {
    /// Unmounts without waiting for the session's thread. A mount namespace made while the
    /// file system was mounted (`ip netns exec` makes one per process, other programs' too)
    /// holds a copy of the mount that the unmount here does not remove, and the connection,
    /// with the thread serving it, lives until the last copy goes. Aborting the connection
    /// (where `/sys/fs/fuse/connections` is mounted) ends it at once; the copies then answer
    /// ENOTCONN to whoever still looks.
    fn drop(&mut self) {
        if let Ok(path) = CString::new(self.mountpoint.as_os_str().as_bytes()) {
            // SAFETY: a valid NUL-terminated path; umount2 reads it only.
            unsafe {
                libc::umount2(path.as_ptr(), libc::MNT_DETACH);
            }
        }
        let abort = format!("/sys/fs/fuse/connections/{}/abort", self.connection);
        let _ = std::fs::write(abort, "1");
        // Detaches the thread; its own unmount finds nothing left to unmount.
        drop(self.session.take());
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A backing file's identity: device and inode number.
type BackingKey = (u64, u64);

fn backing_key(metadata: &std::fs::Metadata) -> BackingKey {
    (metadata.dev(), metadata.ino())
}

/// What a file needs to go back to its last sync.
#[derive(Debug, Default)]
struct Unsynced {
    /// The length at the last sync.
    synced_len: u64,
    /// The bytes at the last sync of each range changed since, by offset; the ranges do not
    /// overlap and all lie below `synced_len`.
    saved: BTreeMap<u64, Vec<u8>>,
}

impl Unsynced {
    /// Saves the bytes of `[start, end)` (clipped to the synced length) that no earlier change
    /// saved, reading them from `file` before they change. Bytes past the file's current end
    /// were saved by the truncation that cut them.
    fn save(&mut self, file: &File, start: u64, end: u64) -> std::io::Result<()> {
        let end = end.min(self.synced_len);
        let mut at = start;
        let mut gaps = Vec::new();
        for (&offset, bytes) in self.saved.range(..end) {
            let saved_end = offset + bytes.len() as u64;
            if saved_end <= at {
                continue;
            }
            if offset > at {
                gaps.push((at, offset));
            }
            at = at.max(saved_end);
        }
        if at < end {
            gaps.push((at, end));
        }
        for (from, to) in gaps {
            let bytes = read_at(file, from, (to - from) as usize)?;
            if !bytes.is_empty() {
                self.saved.insert(from, bytes);
            }
        }
        Ok(())
    }

    fn revert(self, path: &Path, loss: &mut Loss) -> std::io::Result<()> {
        let file = OpenOptions::new().write(true).open(path)?;
        let current = file.metadata()?.len();
        loss.files += 1;
        loss.bytes_cut += current.saturating_sub(self.synced_len);
        file.set_len(self.synced_len)?;
        for (offset, bytes) in self.saved {
            file.write_all_at(&bytes, offset)?;
            loss.bytes_restored += bytes.len() as u64;
        }
        Ok(())
    }
}

/// Reads up to `len` bytes at `offset` (fewer at the end of the file).
fn read_at(file: &File, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut buffer = vec![0; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut buffer[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(read) => filled += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    buffer.truncate(filled);
    Ok(buffer)
}

/// An open file: its backing file and identity, and whether it was opened with `O_SYNC` or
/// `O_DSYNC` (each write synced before it returns).
struct Handle {
    file: File,
    key: BackingKey,
    synchronous: bool,
}

/// The file system's tables. Inode numbers are the file system's own (the kernel's root is 1),
/// each bound to one backing file and the path it has now.
struct State {
    backing: PathBuf,
    paths: HashMap<u64, PathBuf>,
    inodes: HashMap<BackingKey, u64>,
    next_inode: u64,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
    unsynced: HashMap<BackingKey, Unsynced>,
}

impl State {
    fn new(backing: PathBuf) -> std::io::Result<State> {
        let root = std::fs::metadata(&backing)?;
        Ok(State {
            paths: HashMap::from([(INodeNo::ROOT.0, backing.clone())]),
            inodes: HashMap::from([(backing_key(&root), INodeNo::ROOT.0)]),
            backing,
            next_inode: INodeNo::ROOT.0 + 1,
            handles: HashMap::new(),
            next_handle: 1,
            unsynced: HashMap::new(),
        })
    }

    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        self.paths.get(&ino.0).cloned().ok_or(Errno::ENOENT)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.path(parent)?.join(name))
    }

    fn path_of_backing(&self, key: BackingKey) -> Option<PathBuf> {
        self.inodes
            .get(&key)
            .and_then(|ino| self.paths.get(ino))
            .cloned()
    }

    /// The inode of the backing file at `path` (which has `metadata`), made if new.
    fn inode(&mut self, path: &Path, metadata: &std::fs::Metadata) -> INodeNo {
        let key = backing_key(metadata);
        let ino = match self.inodes.get(&key) {
            Some(&ino) => ino,
            None => {
                let ino = self.next_inode;
                self.next_inode += 1;
                self.inodes.insert(key, ino);
                ino
            }
        };
        self.paths.insert(ino, path.to_path_buf());
        INodeNo(ino)
    }

    /// Forgets the backing file at `path`, which is being removed or replaced.
    fn forget_backing(&mut self, path: &Path) {
        let Ok(metadata) = std::fs::symlink_metadata(path) else {
            return;
        };
        if metadata.is_dir() || metadata.nlink() > 1 {
            return;
        }
        let key = backing_key(&metadata);
        self.unsynced.remove(&key);
        if let Some(ino) = self.inodes.remove(&key) {
            self.paths.remove(&ino);
        }
    }

    fn attr_of(&mut self, path: &Path) -> Result<FileAttr, Errno> {
        let metadata = std::fs::symlink_metadata(path).map_err(Errno::from)?;
        let ino = self.inode(path, &metadata);
        Ok(attr(ino, &metadata))
    }

    fn unsynced_for(&mut self, key: BackingKey, file: &File) -> std::io::Result<&mut Unsynced> {
        match self.unsynced.entry(key) {
            Entry::Occupied(entry) => Ok(entry.into_mut()),
            Entry::Vacant(entry) => {
                let synced_len = file.metadata()?.len();
                Ok(entry.insert(Unsynced {
                    synced_len,
                    saved: BTreeMap::new(),
                }))
            }
        }
    }

    /// Truncates (or extends) `file` to `size`, saving what it cuts below the synced length.
    fn set_len(&mut self, key: BackingKey, file: &File, size: u64) -> std::io::Result<()> {
        let current = file.metadata()?.len();
        if size < current {
            self.unsynced_for(key, file)?.save(file, size, current)?;
        } else {
            self.unsynced_for(key, file)?;
        }
        file.set_len(size)
    }

    fn write(
        &mut self,
        key: BackingKey,
        file: &File,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        let end = offset + data.len() as u64;
        self.unsynced_for(key, file)
            .and_then(|unsynced| unsynced.save(file, offset, end))
            .map_err(Errno::from)?;
        file.write_all_at(data, offset).map_err(Errno::from)
    }

    fn open_handle(&mut self, file: File, flags: i32) -> Result<u64, Errno> {
        let key = backing_key(&file.metadata().map_err(Errno::from)?);
        let handle = self.next_handle;
        self.next_handle += 1;
        let synchronous = flags & libc::O_DSYNC != 0;
        self.handles.insert(
            handle,
            Handle {
                file,
                key,
                synchronous,
            },
        );
        Ok(handle)
    }

    /// Rewrites the paths at or under `from` to lie under `to`.
    fn renamed(&mut self, from: &Path, to: &Path) {
        for path in self.paths.values_mut() {
            if let Ok(rest) = path.strip_prefix(from) {
                *path = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
            }
        }
    }
}

/// Attributes are never cached by the kernel: a loss changes files under it.
const TTL: Duration = Duration::ZERO;

fn time(seconds: i64, nanoseconds: i64) -> SystemTime {
    let nanoseconds = u32::try_from(nanoseconds).unwrap_or(0);
    match u64::try_from(seconds) {
        Ok(seconds) => UNIX_EPOCH + Duration::new(seconds, nanoseconds),
        Err(_) => UNIX_EPOCH,
    }
}

fn attr(ino: INodeNo, metadata: &std::fs::Metadata) -> FileAttr {
    let kind = FileType::from_std(metadata.file_type()).unwrap_or(FileType::RegularFile);
    FileAttr {
        ino,
        size: metadata.size(),
        blocks: metadata.blocks(),
        atime: time(metadata.atime(), metadata.atime_nsec()),
        mtime: time(metadata.mtime(), metadata.mtime_nsec()),
        ctime: time(metadata.ctime(), metadata.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind,
        perm: (metadata.mode() & 0o7777) as u16,
        nlink: u32::try_from(metadata.nlink()).unwrap_or(u32::MAX),
        uid: metadata.uid(),
        gid: metadata.gid(),
        rdev: u32::try_from(metadata.rdev()).unwrap_or(0),
        blksize: u32::try_from(metadata.blksize()).unwrap_or(4096),
        flags: 0,
    }
}

/// Opens the backing file at `path` for `flags`' access mode, readable also when opened for
/// writing only (the undo log reads what a write replaces). Appending and truncating are the
/// file system's to do (writes come with their offsets; a truncation is saved first).
fn open_backing(path: &Path, flags: i32, create_mode: Option<u32>) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    if flags & libc::O_ACCMODE != libc::O_RDONLY {
        options.write(true);
    }
    if let Some(mode) = create_mode {
        options.create(true).mode(mode);
        if flags & libc::O_EXCL != 0 {
            options.create_new(true);
        }
    }
    options.open(path)
}

struct Passthrough {
    state: Arc<Mutex<State>>,
}

impl Passthrough {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn setattr_size(&self, ino: INodeNo, fh: Option<FileHandle>, size: u64) -> Result<(), Errno> {
        let mut state = self.state();
        if let Some(handle) = fh.and_then(|fh| state.handles.get(&fh.0)) {
            let key = handle.key;
            let file = handle.file.try_clone().map_err(Errno::from)?;
            return state.set_len(key, &file, size).map_err(Errno::from);
        }
        let path = state.path(ino)?;
        // Readable too: the undo log reads what the truncation cuts.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(Errno::from)?;
        let key = backing_key(&file.metadata().map_err(Errno::from)?);
        state.set_len(key, &file, size).map_err(Errno::from)
    }

    fn reply_attr(&self, path: &Path, reply: ReplyAttr) {
        match self.state().attr_of(path) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(error) => reply.error(error),
        }
    }
}

fn system_time(time: TimeOrNow) -> SystemTime {
    match time {
        TimeOrNow::SpecificTime(time) => time,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for Passthrough {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut state = self.state();
        match state
            .child(parent, name)
            .and_then(|path| state.attr_of(&path))
        {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(error) => reply.error(error),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let state = self.state();
        if let Some(handle) = fh.and_then(|fh| state.handles.get(&fh.0)) {
            match handle.file.metadata() {
                Ok(metadata) => reply.attr(&TTL, &attr(ino, &metadata)),
                Err(error) => reply.error(error.into()),
            }
            return;
        }
        match state.path(ino) {
            Ok(path) => {
                drop(state);
                self.reply_attr(&path, reply);
            }
            Err(error) => reply.error(error),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let path = match self.state().path(ino) {
            Ok(path) => path,
            Err(error) => return reply.error(error),
        };
        let result = (|| {
            if let Some(size) = size {
                self.setattr_size(ino, fh, size)?;
            }
            if let Some(mode) = mode {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .map_err(Errno::from)?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::lchown(&path, uid, gid).map_err(Errno::from)?;
            }
            if atime.is_some() || mtime.is_some() {
                let mut times = std::fs::FileTimes::new();
                if let Some(atime) = atime {
                    times = times.set_accessed(system_time(atime));
                }
                if let Some(mtime) = mtime {
                    times = times.set_modified(system_time(mtime));
                }
                File::open(&path)
                    .and_then(|file| file.set_times(times))
                    .map_err(Errno::from)?;
            }
            Ok(())
        })();
        match result {
            Ok(()) => self.reply_attr(&path, reply),
            Err(error) => reply.error(error),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut state = self.state();
        let result = state.child(parent, name).and_then(|path| {
            std::fs::DirBuilder::new()
                .mode(mode & !umask)
                .create(&path)
                .map_err(Errno::from)?;
            state.attr_of(&path)
        });
        match result {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(error) => reply.error(error),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut state = self.state();
        let result = state.child(parent, name).and_then(|path| {
            state.forget_backing(&path);
            std::fs::remove_file(&path).map_err(Errno::from)
        });
        match result {
            Ok(()) => reply.ok(),
            Err(error) => reply.error(error),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let state = self.state();
        let result = state
            .child(parent, name)
            .and_then(|path| std::fs::remove_dir(&path).map_err(Errno::from));
        match result {
            Ok(()) => reply.ok(),
            Err(error) => reply.error(error),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if !flags.is_empty() {
            return reply.error(Errno::EINVAL);
        }
        let mut state = self.state();
        let result = state.child(parent, name).and_then(|from| {
            let to = state.child(newparent, newname)?;
            state.forget_backing(&to);
            std::fs::rename(&from, &to).map_err(Errno::from)?;
            state.renamed(&from, &to);
            Ok(())
        });
        match result {
            Ok(()) => reply.ok(),
            Err(error) => reply.error(error),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut state = self.state();
        let result = state.path(ino).and_then(|path| {
            let file = open_backing(&path, flags.0, None).map_err(Errno::from)?;
            let handle = state.open_handle(file, flags.0)?;
            if flags.0 & libc::O_TRUNC != 0
                && let Some(open) = state.handles.get(&handle)
            {
                let key = open.key;
                let file = open.file.try_clone().map_err(Errno::from)?;
                state.set_len(key, &file, 0).map_err(Errno::from)?;
            }
            Ok(handle)
        });
        match result {
            Ok(handle) => reply.opened(FileHandle(handle), FopenFlags::FOPEN_DIRECT_IO),
            Err(error) => reply.error(error),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut state = self.state();
        let result = state.child(parent, name).and_then(|path| {
            let existed = std::fs::symlink_metadata(&path).is_ok();
            let file = open_backing(&path, flags, Some(mode & !umask)).map_err(Errno::from)?;
            let handle = state.open_handle(file, flags)?;
            let key = state.handles.get(&handle).map(|open| open.key);
            if let Some(key) = key
                && !existed
            {
                // Never synced: a loss leaves it empty.
                state.unsynced.insert(key, Unsynced::default());
            }
            let attr = state.attr_of(&path)?;
            Ok((attr, handle))
        });
        match result {
            Ok((attr, handle)) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(handle),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(error) => reply.error(error),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let state = self.state();
        let Some(handle) = state.handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        match read_at(&handle.file, offset, size as usize) {
            Ok(bytes) => reply.data(&bytes),
            Err(error) => reply.error(error.into()),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut state = self.state();
        let Some(handle) = state.handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let (key, synchronous) = (handle.key, handle.synchronous);
        let result = handle
            .file
            .try_clone()
            .map_err(Errno::from)
            .and_then(|file| state.write(key, &file, offset, data));
        if result.is_ok() && synchronous {
            state.unsynced.remove(&key);
        }
        match result {
            Ok(()) => reply.written(u32::try_from(data.len()).unwrap_or(u32::MAX)),
            Err(error) => reply.error(error),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.state().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut state = self.state();
        let key = match state.handles.get(&fh.0) {
            Some(handle) => Some(handle.key),
            None => state
                .path(ino)
                .ok()
                .and_then(|path| std::fs::metadata(path).ok())
                .map(|metadata| backing_key(&metadata)),
        };
        // What the file holds now is what a loss leaves of it.
        if let Some(key) = key {
            state.unsynced.remove(&key);
        }
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut state = self.state();
        let path = match state.path(ino) {
            Ok(path) => path,
            Err(error) => return reply.error(error),
        };
        let children = match std::fs::read_dir(&path) {
            Ok(children) => children,
            Err(error) => return reply.error(error.into()),
        };
        let mut entries = vec![
            (ino, FileType::Directory, OsStr::new(".").to_owned()),
            (ino, FileType::Directory, OsStr::new("..").to_owned()),
        ];
        for child in children.flatten() {
            let child_path = child.path();
            let Ok(metadata) = std::fs::symlink_metadata(&child_path) else {
                continue;
            };
            let kind = FileType::from_std(metadata.file_type()).unwrap_or(FileType::RegularFile);
            let child_ino = state.inode(&child_path, &metadata);
            entries.push((child_ino, kind, child.file_name()));
        }
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (index, (entry_ino, kind, name)) in entries.into_iter().enumerate().skip(skip) {
            if reply.add(entry_ino, index as u64 + 1, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Metadata is durable at once.
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let backing = self.state().backing.clone();
        let Ok(path) = CString::new(backing.as_os_str().as_bytes()) else {
            return reply.error(Errno::EINVAL);
        };
        // SAFETY: statvfs writes the struct it is given, which is plain data; the path is a
        // valid NUL-terminated string.
        let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
            return reply.error(std::io::Error::last_os_error().into());
        }
        reply.statfs(
            stats.f_blocks,
            stats.f_bfree,
            stats.f_bavail,
            stats.f_files,
            stats.f_ffree,
            u32::try_from(stats.f_bsize).unwrap_or(4096),
            u32::try_from(stats.f_namemax).unwrap_or(255),
            u32::try_from(stats.f_frsize).unwrap_or(4096),
        );
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        match self.state().path(ino) {
            Ok(path) if path.exists() => reply.ok(),
            Ok(_) => reply.error(Errno::ENOENT),
            Err(error) => reply.error(error),
        }
    }
}
