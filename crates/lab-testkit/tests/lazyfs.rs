//! The lazy file system against a real FUSE mount (root, /dev/fuse): what a power loss keeps
//! and what it takes, and a real nats-server on it, with and without `sync_interval: always`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use lab_testkit::lazyfs::LazyFs;
use lab_testkit::nats::{NatsServer, current_nats_binary};
use tempfile::TempDir;

/// A lazy file system over a backing directory of its own.
struct Mounted {
    fs: LazyFs,
    _dir: TempDir,
}

impl Mounted {
    fn new() -> Mounted {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let backing = dir.path().join("backing");
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&backing).expect("the backing directory");
        std::fs::create_dir(&mountpoint).expect("the mount point");
        let fs = LazyFs::mount(&backing, &mountpoint).expect("mounting the lazy file system");
        Mounted { fs, _dir: dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.fs.mountpoint().join(name)
    }
}

fn mounted(mountpoint: &Path) -> bool {
    let table = std::fs::read_to_string("/proc/self/mountinfo").expect("the mount table");
    let needle = format!(" {} ", mountpoint.display());
    table.lines().any(|line| line.contains(&needle))
}

#[test]
fn a_write_that_was_fsynced_survives_a_power_loss_and_one_that_was_not_is_gone() {
    let fs = Mounted::new();
    let path = fs.path("log");
    let mut file = File::create(&path).unwrap();
    file.write_all(b"synced").unwrap();
    file.sync_all().unwrap();
    file.write_all(b" and not synced").unwrap();
    drop(file);
    assert_eq!(std::fs::read(&path).unwrap(), b"synced and not synced");

    let loss = fs.fs.lose_unsynced().unwrap();

    assert_eq!(std::fs::read(&path).unwrap(), b"synced");
    assert_eq!(loss.files, 1);
    assert_eq!(loss.bytes_cut, 15);
}

#[test]
fn a_file_created_and_never_synced_is_empty_after_a_power_loss() {
    let fs = Mounted::new();
    std::fs::write(fs.path("fresh"), b"never synced").unwrap();
    std::fs::create_dir(fs.path("dir")).unwrap();
    std::fs::write(fs.path("dir/inner"), b"nor this").unwrap();

    fs.fs.lose_unsynced().unwrap();

    assert_eq!(std::fs::read(fs.path("fresh")).unwrap(), b"");
    assert_eq!(std::fs::read(fs.path("dir/inner")).unwrap(), b"");
}

#[test]
fn overwrites_since_the_last_sync_are_undone_by_a_power_loss() {
    let fs = Mounted::new();
    let path = fs.path("blocks");
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    file.write_all_at(b"abcdefghij", 0).unwrap();
    file.sync_data().unwrap();
    file.write_all_at(b"XY", 2).unwrap();
    file.write_all_at(b"1234", 1).unwrap();
    file.write_all_at(b"tail past the end", 8).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"a1234fghtail past the end");

    let loss = fs.fs.lose_unsynced().unwrap();

    assert_eq!(std::fs::read(&path).unwrap(), b"abcdefghij");
    assert_eq!(
        loss.bytes_restored, 6,
        "bytes 1..5 and 8..10, each saved once"
    );
    assert_eq!(fs.fs.unsynced_files(), 0);
}

#[test]
fn a_truncation_since_the_last_sync_is_undone_by_a_power_loss() {
    let fs = Mounted::new();
    let path = fs.path("truncated");
    let original: Vec<u8> = (0..=255).collect();
    let file = File::create(&path).unwrap();
    file.write_all_at(&original, 0).unwrap();
    file.sync_all().unwrap();
    file.set_len(10).unwrap();
    file.write_all_at(b"new", 10).unwrap();
    drop(file);
    // Truncating by path (setattr without a handle) too.
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"");

    fs.fs.lose_unsynced().unwrap();

    assert_eq!(std::fs::read(&path).unwrap(), original);
}

#[test]
fn a_renamed_file_keeps_what_was_synced_under_its_new_name() {
    let fs = Mounted::new();
    let mut file = File::create(fs.path("a")).unwrap();
    file.write_all(b"one").unwrap();
    file.sync_all().unwrap();
    file.write_all(b"two").unwrap();
    drop(file);
    std::fs::rename(fs.path("a"), fs.path("b")).unwrap();
    // The replace-by-rename pattern: a synced temporary file over an unsynced one.
    std::fs::write(fs.path("target"), b"old unsynced").unwrap();
    let mut temporary = File::create(fs.path("target.tmp")).unwrap();
    temporary.write_all(b"replacement").unwrap();
    temporary.sync_all().unwrap();
    drop(temporary);
    std::fs::rename(fs.path("target.tmp"), fs.path("target")).unwrap();

    fs.fs.lose_unsynced().unwrap();

    assert!(!fs.path("a").exists(), "a rename is durable");
    assert_eq!(std::fs::read(fs.path("b")).unwrap(), b"one");
    assert_eq!(std::fs::read(fs.path("target")).unwrap(), b"replacement");
}

#[test]
fn directories_list_and_remove_through_the_mount_and_the_mount_goes_when_dropped() {
    let fs = Mounted::new();
    std::fs::create_dir_all(fs.path("x/y")).unwrap();
    std::fs::write(fs.path("x/y/f"), b"f").unwrap();
    std::fs::write(fs.path("x/g"), b"g").unwrap();
    std::fs::remove_file(fs.path("x/g")).unwrap();
    let names: Vec<String> = std::fs::read_dir(fs.path("x/y"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["f"]);
    assert!(std::fs::remove_dir(fs.path("x/y")).is_err(), "not empty");
    std::fs::remove_file(fs.path("x/y/f")).unwrap();
    std::fs::remove_dir(fs.path("x/y")).unwrap();
    let mountpoint = fs.fs.mountpoint().to_path_buf();
    assert!(mounted(&mountpoint));

    drop(fs);

    assert!(!mounted(&mountpoint));
}

/// A current nats-server with its store on a lazy file system: `messages` published to a
/// one-replica file stream, each acknowledged, then SIGKILL, a power loss, a restart. How many
/// of the acknowledged messages the stream holds then.
async fn acknowledged_messages_after_a_power_loss(sync_always: bool, messages: u64) -> u64 {
    let fs = Mounted::new();
    let store = fs.path("store");
    let sync = if sync_always {
        "\n  sync_interval: always"
    } else {
        ""
    };
    let config =
        format!("host: 127.0.0.1\nport: -1\njetstream {{\n  store_dir: \"{{store}}\"{sync}\n}}\n");
    let binary = current_nats_binary().expect("a current nats-server");
    let mut server = NatsServer::start_node_on(Command::new(binary), &config, Some(&store))
        .expect("nats-server on the lazy file system");
    let js = jetstream::new(server.connect().await.expect("a client"));
    js.get_or_create_stream(StreamConfig {
        name: "LAZY".to_owned(),
        subjects: vec!["lazy.>".to_owned()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await
    .expect("the stream");
    for index in 0..messages {
        js.publish(format!("lazy.{index}"), format!("message {index}").into())
            .await
            .expect("published")
            .await
            .expect("acknowledged");
    }
    server.kill();
    let loss = fs.fs.lose_unsynced().expect("the power loss");
    eprintln!("sync always {sync_always}: {loss}");
    server.start_again().expect("nats-server restarts");
    let js = jetstream::new(server.connect().await.expect("a client after the restart"));
    // The stream's state once the server has recovered it (or found it gone).
    let mut kept = None;
    for _ in 0..100 {
        match js.get_stream("LAZY").await {
            Ok(mut stream) => match stream.info().await {
                Ok(info) => {
                    kept = Some(info.state.messages);
                    break;
                }
                Err(error) => eprintln!("stream info: {error}"),
            },
            Err(error) => match error.kind() {
                GetStreamErrorKind::JetStream(error)
                    if error.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    // JetStream restored its streams before the server took clients.
                    eprintln!("sync always {sync_always}: the stream is gone");
                    kept = Some(0);
                    break;
                }
                _ => eprintln!("stream: {error}"),
            },
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(server.directory().join("server.log")).unwrap_or_default();
    for line in log
        .lines()
        .filter(|line| line.contains("[ERR]") || line.contains("[WRN]"))
    {
        eprintln!("nats-server: {line}");
    }
    kept.unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_with_lazy_fsync_loses_acknowledged_messages_in_a_power_loss() {
    let kept = acknowledged_messages_after_a_power_loss(false, 200).await;
    assert!(kept < 200, "all 200 acknowledged messages survived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_that_syncs_always_keeps_every_acknowledged_message_in_a_power_loss() {
    let kept = acknowledged_messages_after_a_power_loss(true, 200).await;
    assert_eq!(kept, 200);
}
