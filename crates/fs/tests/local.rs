//! A volume embedded in one node: isolation, commit, abort, degree
//! semantics, conflicts, path escapes, restarts.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use weft::Node;
use weft_fs::{FileKind, Fs, FsConfig, FsError, ReadMode, VolumeLimits, VolumeRef};

struct Setup {
    node: Node,
    fs: Fs,
    vol: VolumeRef,
    _data: tempfile::TempDir,
    dir: tempfile::TempDir,
}

async fn setup_with(
    limits: VolumeLimits,
    data: Option<tempfile::TempDir>,
    dir: Option<tempfile::TempDir>,
) -> Setup {
    let data = data.unwrap_or_else(|| tempfile::tempdir().unwrap());
    let dir = dir.unwrap_or_else(|| tempfile::tempdir().unwrap());
    let fs = Fs::new(
        FsConfig {
            limits,
            ..FsConfig::default()
        }
        .volume("v", dir.path()),
    )
    .unwrap();
    let node = Node::builder(1)
        .data_dir(data.path())
        .plugin(Arc::new(fs.clone()))
        .start()
        .await
        .unwrap();
    let vol = fs.local("v").unwrap();
    Setup {
        node,
        fs,
        vol,
        _data: data,
        dir,
    }
}

async fn setup() -> Setup {
    setup_with(VolumeLimits::default(), None, None).await
}

fn read(dir: &Path, p: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(p)).ok()
}

/// Nothing but the reserved area's empty stage directory remains.
fn no_staging_left(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir.join(".weft-fs/stage"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "staging left behind: {left:?}");
}

#[tokio::test]
async fn changes_are_private_until_commit_then_all_visible() {
    let s = setup().await;
    std::fs::write(s.dir.path().join("old"), "committed").unwrap();
    std::fs::write(s.dir.path().join("gone"), "x").unwrap();
    let tx = s.node.begin();
    let c = tx.context().clone();
    s.vol.mkdir(&c, "d").await.unwrap();
    s.vol.create(&c, "d/a", true).await.unwrap();
    s.vol
        .write(&c, "d/a", 0, Bytes::from_static(b"hello"))
        .await
        .unwrap();
    s.vol
        .write(&c, "old", 0, Bytes::from_static(b"COMM"))
        .await
        .unwrap();
    s.vol.rename(&c, "gone", "d/moved").await.unwrap();
    // The transaction sees its changes; the disk does not have them.
    assert_eq!(
        &s.vol
            .read(&c, "d/a", 0, 100, ReadMode::Degree2)
            .await
            .unwrap()[..],
        b"hello"
    );
    assert_eq!(
        &s.vol
            .read(&c, "old", 0, 100, ReadMode::Degree2)
            .await
            .unwrap()[..],
        b"COMMitted"
    );
    assert!(s
        .vol
        .stat(&c, "gone", ReadMode::Degree2)
        .await
        .unwrap()
        .is_none());
    let names: Vec<String> = s
        .vol
        .list(&c, "d")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a", "moved"]);
    assert!(!s.dir.path().join("d").exists());
    assert_eq!(read(s.dir.path(), "old").unwrap(), "committed");
    // Another transaction sees the committed state (list takes no lock).
    let other = s.node.begin();
    let root: Vec<String> = s
        .vol
        .list(other.context(), "")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(root, ["gone", "old"]);
    other.abort("done").await.unwrap();
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    assert_eq!(read(s.dir.path(), "d/a").unwrap(), "hello");
    assert_eq!(read(s.dir.path(), "old").unwrap(), "COMMitted");
    assert_eq!(read(s.dir.path(), "d/moved").unwrap(), "x");
    assert!(!s.dir.path().join("gone").exists());
    no_staging_left(s.dir.path());
}

/// Phase two runs in the background after commit returns: wait for it.
async fn wait_applied(fs: &Fs) {
    // The staging area goes once the record that the commit is applied is
    // durable, just after the branch ends.
    let staging = |v: &weft_fs::Volume| {
        std::fs::read_dir(v.root().join(".weft-fs/stage"))
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
    };
    let applied = fs.wait_until(|fs| !fs.volumes().any(|v| v.stats().prepared > 0 || staging(v)));
    tokio::time::timeout(Duration::from_secs(60), applied)
        .await
        .expect("commit never applied");
}

#[tokio::test]
async fn abort_leaves_no_trace() {
    let s = setup().await;
    std::fs::write(s.dir.path().join("f"), "keep").unwrap();
    std::fs::create_dir(s.dir.path().join("sub")).unwrap();
    let tx = s.node.begin();
    let c = tx.context().clone();
    s.vol.create(&c, "new", false).await.unwrap();
    s.vol
        .write(&c, "f", 2, Bytes::from_static(b"XXXXXX"))
        .await
        .unwrap();
    s.vol.rmdir(&c, "sub").await.unwrap();
    s.vol.rename(&c, "f", "g").await.unwrap();
    tx.abort("test").await.unwrap();
    wait_applied(&s.fs).await;
    assert_eq!(read(s.dir.path(), "f").unwrap(), "keep");
    assert!(s.dir.path().join("sub").is_dir());
    assert!(!s.dir.path().join("new").exists());
    assert!(!s.dir.path().join("g").exists());
    no_staging_left(s.dir.path());
}

#[tokio::test]
async fn degree_two_read_locks_end_with_the_read_write_locks_with_the_transaction() {
    let s = setup_with(
        VolumeLimits {
            lock_wait: Duration::ZERO,
            ..VolumeLimits::default()
        },
        None,
        None,
    )
    .await;
    std::fs::write(s.dir.path().join("f"), "v1").unwrap();
    let t1 = s.node.begin();
    let t2 = s.node.begin();
    // Degree 2: t1's read lock is gone after the read, so t2 may write.
    s.vol
        .read(t1.context(), "f", 0, 10, ReadMode::Degree2)
        .await
        .unwrap();
    s.vol
        .write(t2.context(), "f", 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    // t2's write lock is held to its end: t1 cannot read with a lock
    // (QuickSilver's immediate error with a zero bound)...
    let e = s
        .vol
        .read(t1.context(), "f", 0, 10, ReadMode::Degree2)
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    // ...but can read the committed state without one.
    let r = s
        .vol
        .read(t1.context(), "f", 0, 10, ReadMode::NoLock)
        .await
        .unwrap();
    assert_eq!(&r[..], b"v1");
    t2.commit().await.unwrap();
    wait_applied(&s.fs).await;
    // Degree 3: the read lock is held to the end.
    s.vol
        .read(t1.context(), "f", 0, 10, ReadMode::Degree3)
        .await
        .unwrap();
    let t3 = s.node.begin();
    let e = s
        .vol
        .write(t3.context(), "f", 0, Bytes::from_static(b"v3"))
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    // An open handle holds its read lock until closed.
    let t4 = s.node.begin();
    s.vol.open_file(t4.context(), "f").await.unwrap();
    t1.commit().await.unwrap();
    wait_applied(&s.fs).await;
    let e = s
        .vol
        .write(t3.context(), "f", 0, Bytes::from_static(b"v3"))
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    s.vol.close_file(t4.context(), "f").await.unwrap();
    s.vol
        .write(t3.context(), "f", 0, Bytes::from_static(b"v3"))
        .await
        .unwrap();
    t3.commit().await.unwrap();
    t4.commit().await.unwrap();
    wait_applied(&s.fs).await;
    assert_eq!(read(s.dir.path(), "f").unwrap(), "v3");
}

#[tokio::test]
async fn degree_one_directories_list_without_locks_entry_writes_conflict() {
    let s = setup_with(
        VolumeLimits {
            lock_wait: Duration::ZERO,
            ..VolumeLimits::default()
        },
        None,
        None,
    )
    .await;
    std::fs::create_dir(s.dir.path().join("d")).unwrap();
    let t1 = s.node.begin();
    let t2 = s.node.begin();
    s.vol.create(t1.context(), "d/x", true).await.unwrap();
    // Listing takes no lock and does not see t1's uncommitted entry.
    assert!(s.vol.list(t2.context(), "d").await.unwrap().is_empty());
    // Another entry of the same directory: no conflict.
    s.vol.create(t2.context(), "d/y", true).await.unwrap();
    // The same entry: conflict.
    let e = s.vol.create(t2.context(), "d/x", true).await.unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    // Removing the directory conflicts with entries being written in it.
    let t3 = s.node.begin();
    let e = s.vol.rmdir(t3.context(), "d").await.unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    t1.commit().await.unwrap();
    t2.commit().await.unwrap();
    t3.abort("done").await.unwrap();
    wait_applied(&s.fs).await;
    let t4 = s.node.begin();
    let names: Vec<String> = s
        .vol
        .list(t4.context(), "d")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["x", "y"]);
    t4.commit().await.unwrap();
}

#[tokio::test]
async fn conflicting_writers_wait_within_the_bound_then_one_commits() {
    let s = setup_with(
        VolumeLimits {
            lock_wait: Duration::from_secs(30),
            ..VolumeLimits::default()
        },
        None,
        None,
    )
    .await;
    std::fs::write(s.dir.path().join("f"), "0").unwrap();
    let t1 = s.node.begin();
    s.vol
        .write(t1.context(), "f", 0, Bytes::from_static(b"1"))
        .await
        .unwrap();
    let t2 = s.node.begin();
    let vol = s.vol.clone();
    let c2 = t2.context().clone();
    let waiter =
        tokio::spawn(async move { vol.write(&c2, "f", 0, Bytes::from_static(b"2")).await });
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    t1.commit().await.unwrap();
    waiter.await.unwrap().unwrap();
    // t2 sees t1's committed write under its lock, then overwrites it.
    assert_eq!(
        &s.vol
            .read(t2.context(), "f", 0, 1, ReadMode::Degree2)
            .await
            .unwrap()[..],
        b"2"
    );
    t2.commit().await.unwrap();
    wait_applied(&s.fs).await;
    assert_eq!(read(s.dir.path(), "f").unwrap(), "2");
}

#[tokio::test]
async fn path_escapes_are_refused() {
    let s = setup().await;
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    std::os::unix::fs::symlink(outside.path(), s.dir.path().join("out")).unwrap();
    std::fs::create_dir(s.dir.path().join("in")).unwrap();
    std::os::unix::fs::symlink(s.dir.path().join("in"), s.dir.path().join("alias")).unwrap();
    let tx = s.node.begin();
    let c = tx.context().clone();
    for bad in ["../x", "/etc/passwd", "a/../../x", ".weft-fs/stage/x"] {
        let e = s.vol.create(&c, bad, false).await.unwrap_err();
        assert!(matches!(e, FsError::Escape(_)), "{bad}: {e}");
        let e = s
            .vol
            .read(&c, bad, 0, 1, ReadMode::Degree2)
            .await
            .unwrap_err();
        assert!(matches!(e, FsError::Escape(_)), "{bad}: {e}");
    }
    let e = s
        .vol
        .read(&c, "out/secret", 0, 10, ReadMode::Degree2)
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::Escape(_)), "{e}");
    let e = s.vol.create(&c, "out/new", false).await.unwrap_err();
    assert!(matches!(e, FsError::Escape(_)), "{e}");
    let e = s.vol.create(&c, "alias/new", false).await.unwrap_err();
    assert!(matches!(e, FsError::Unsupported(_)), "{e}");
    // A final symbolic link is never followed.
    let e = s
        .vol
        .read(&c, "out", 0, 10, ReadMode::Degree2)
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::Unsupported(_)), "{e}");
    assert_eq!(e.status(), weft::Status::BadRequest);
    tx.commit().await.unwrap();
    assert!(!outside.path().join("new").exists());
}

#[tokio::test]
async fn no_space_at_prepare_votes_no_and_changes_nothing() {
    let s = setup_with(
        VolumeLimits {
            reserve_bytes: u64::MAX / 2,
            ..VolumeLimits::default()
        },
        None,
        None,
    )
    .await;
    let tx = s.node.begin();
    s.vol.create(tx.context(), "f", true).await.unwrap();
    let e = tx.commit().await.unwrap_err();
    assert_eq!(e.status, weft::Status::Aborted, "{e}");
    assert!(e.detail.contains("no space"), "{e}");
    wait_applied(&s.fs).await;
    assert!(!s.dir.path().join("f").exists());
    no_staging_left(s.dir.path());
}

#[tokio::test]
async fn truncate_and_range_writes_compose() {
    let s = setup().await;
    std::fs::write(s.dir.path().join("f"), "0123456789").unwrap();
    let tx = s.node.begin();
    let c = tx.context().clone();
    s.vol
        .write(&c, "f", 8, Bytes::from_static(b"AB"))
        .await
        .unwrap();
    s.vol.truncate(&c, "f", 4).await.unwrap();
    s.vol
        .write(&c, "f", 6, Bytes::from_static(b"Z"))
        .await
        .unwrap();
    let want = b"0123\0\0Z";
    assert_eq!(
        &s.vol
            .read(&c, "f", 0, 100, ReadMode::Degree2)
            .await
            .unwrap()[..],
        want
    );
    let m = s
        .vol
        .stat(&c, "f", ReadMode::Degree2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((m.kind, m.len, m.changed), (FileKind::File, 7, true));
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    assert_eq!(std::fs::read(s.dir.path().join("f")).unwrap(), want);
}

#[tokio::test]
async fn a_committed_transaction_survives_a_restart_and_orphans_are_cleaned() {
    let s = setup().await;
    let tx = s.node.begin();
    s.vol.create(tx.context(), "a", true).await.unwrap();
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    // A live transaction with staged data when the node dies.
    let live = s.node.begin();
    s.vol.create(live.context(), "b", true).await.unwrap();
    s.vol
        .write(live.context(), "b", 0, Bytes::from_static(b"zz"))
        .await
        .unwrap();
    s.node.crash();
    std::mem::forget(live);
    let Setup { _data, dir, .. } = s;
    let s = setup_with(VolumeLimits::default(), Some(_data), Some(dir)).await;
    assert!(s.dir.path().join("a").exists());
    assert!(!s.dir.path().join("b").exists());
    no_staging_left(s.dir.path());
}

/// A directory renamed (across directories, with a tree in it, some of it
/// changed by the transaction): the transaction sees the new tree at once,
/// others the old one until commit; abort leaves the old; commit moves it.
#[tokio::test]
async fn a_directory_is_renamed_with_everything_in_it() {
    let s = setup().await;
    let d = s.dir.path();
    std::fs::create_dir_all(d.join("a/deep/er")).unwrap();
    std::fs::create_dir_all(d.join("dst")).unwrap();
    std::fs::write(d.join("a/one"), "1").unwrap();
    std::fs::write(d.join("a/deep/two"), "22").unwrap();
    std::fs::write(d.join("a/deep/er/three"), "333").unwrap();
    std::fs::write(d.join("a/gone"), "g").unwrap();
    std::os::unix::fs::symlink("one", d.join("a/link")).unwrap();
    let v = &s.vol;
    for commit in [false, true] {
        let tx = s.node.begin();
        let c = tx.context();
        // Changes inside before the move: a patch, a new file, a delete.
        v.write(c, "a/one", 1, Bytes::from_static(b"+"))
            .await
            .unwrap();
        v.create(c, "a/deep/new", true).await.unwrap();
        v.write(c, "a/deep/new", 0, Bytes::from_static(b"n"))
            .await
            .unwrap();
        v.delete(c, "a/gone").await.unwrap();
        // Refused: into itself, onto a directory that is not empty.
        let e = v.rename(c, "a", "a/deep/x").await.unwrap_err();
        assert!(matches!(e, FsError::BadPath(_)), "{e}");
        std::fs::write(d.join("dst/full"), "f").unwrap();
        let e = v.rename(c, "a", "dst").await.unwrap_err();
        assert!(matches!(e, FsError::AlreadyExists(_)), "{e}");
        std::fs::remove_file(d.join("dst/full")).unwrap();
        v.rename(c, "a", "dst/b").await.unwrap();
        // Changes inside after the move.
        v.write(c, "dst/b/deep/two", 2, Bytes::from_static(b"!"))
            .await
            .unwrap();
        let rd = |p: &'static str| async move {
            String::from_utf8(
                v.read(c, p, 0, 100, ReadMode::NoLock)
                    .await
                    .unwrap()
                    .to_vec(),
            )
            .unwrap()
        };
        assert_eq!(rd("dst/b/one").await, "1+");
        assert_eq!(rd("dst/b/deep/two").await, "22!");
        assert_eq!(rd("dst/b/deep/new").await, "n");
        assert_eq!(rd("dst/b/deep/er/three").await, "333");
        assert!(v.stat(c, "a", ReadMode::NoLock).await.unwrap().is_none());
        let names: Vec<String> = v
            .list(c, "dst/b")
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["deep", "link", "one"]);
        // Others still see the old tree.
        let other = s.node.begin();
        let names: Vec<String> = v
            .list(other.context(), "a")
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["deep", "gone", "link", "one"]);
        other.abort("done").await.unwrap();
        if !commit {
            tx.abort("test").await.unwrap();
            wait_applied(&s.fs).await;
            assert_eq!(read(d, "a/one").as_deref(), Some("1"));
            assert_eq!(read(d, "a/gone").as_deref(), Some("g"));
            assert!(!d.join("dst/b").exists());
            no_staging_left(d);
            continue;
        }
        tx.commit().await.unwrap();
        wait_applied(&s.fs).await;
    }
    assert!(!d.join("a").exists());
    assert_eq!(read(d, "dst/b/one").as_deref(), Some("1+"));
    assert_eq!(read(d, "dst/b/deep/two").as_deref(), Some("22!"));
    assert_eq!(read(d, "dst/b/deep/new").as_deref(), Some("n"));
    assert_eq!(read(d, "dst/b/deep/er/three").as_deref(), Some("333"));
    assert!(!d.join("dst/b/gone").exists());
    assert_eq!(
        std::fs::read_link(d.join("dst/b/link")).unwrap(),
        Path::new("one")
    );
    no_staging_left(d);
    // A directory the transaction made, renamed before it ever existed on
    // disk; and renamed back and forth.
    let tx = s.node.begin();
    let c = tx.context();
    v.mkdir(c, "made").await.unwrap();
    v.create(c, "made/f", true).await.unwrap();
    v.rename(c, "made", "moved").await.unwrap();
    v.rename(c, "dst/b", "b2").await.unwrap();
    v.rename(c, "b2", "dst/b").await.unwrap();
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    assert!(d.join("moved/f").is_file() && !d.join("made").exists());
    assert_eq!(read(d, "dst/b/deep/er/three").as_deref(), Some("333"));
    assert!(!d.join("b2").exists());
    no_staging_left(d);
}

/// QuickSilver's nested transactions: a failed step's file changes vanish
/// alone (every kind of change, nested steps too), its parent goes on and
/// commits the rest; a step that succeeds passes its changes up.
#[tokio::test]
async fn an_aborted_sub_transaction_undoes_its_file_changes_alone() {
    let s = setup().await;
    for (name, text) in [("base", "0123456789"), ("gone", "g"), ("mv", "m")] {
        std::fs::write(s.dir.path().join(name), text).unwrap();
    }
    let (v, tx) = (&s.vol, s.node.begin());
    let c = tx.context();
    let rd = |c: &weft::TxContext, p: &'static str| {
        let c = c.clone();
        async move {
            v.read(&c, p, 0, 1 << 20, ReadMode::NoLock)
                .await
                .map(|b| String::from_utf8(b.to_vec()).unwrap())
        }
    };
    // The transaction's own changes before the steps.
    v.create(c, "kept", true).await.unwrap();
    v.write(c, "kept", 0, Bytes::from_static(b"top"))
        .await
        .unwrap();
    v.write(c, "base", 0, Bytes::from_static(b"AB"))
        .await
        .unwrap();
    // A step that only read and aborted changes nothing.
    let sub = tx.sub().unwrap();
    let _ = v.list(sub.context(), "").await.unwrap();
    sub.abort().unwrap();
    // A step that changes every kind of thing, then fails.
    let sub = tx.sub().unwrap();
    let sc = sub.context();
    v.create(sc, "sub", true).await.unwrap();
    v.write(sc, "kept", 1, Bytes::from_static(b"XYZW"))
        .await
        .unwrap();
    v.write(sc, "base", 8, Bytes::from_static(b"st"))
        .await
        .unwrap();
    v.truncate(sc, "base", 9).await.unwrap();
    v.delete(sc, "gone").await.unwrap();
    v.rename(sc, "mv", "mv2").await.unwrap();
    v.mkdir(sc, "d").await.unwrap();
    v.create(sc, "d/f", true).await.unwrap();
    // A step of the step that succeeds into it: undone with it.
    let inner = sub.sub().unwrap();
    v.create(inner.context(), "deep", true).await.unwrap();
    v.delete(inner.context(), "kept").await.unwrap();
    inner.commit().unwrap();
    assert_eq!(rd(sc, "base").await.unwrap(), "AB234567s");
    sub.abort().unwrap();
    // The parent sees its own state again.
    assert_eq!(rd(c, "kept").await.unwrap(), "top");
    assert_eq!(rd(c, "base").await.unwrap(), "AB23456789");
    assert_eq!(rd(c, "gone").await.unwrap(), "g");
    assert_eq!(rd(c, "mv").await.unwrap(), "m");
    for gone in ["sub", "mv2", "d", "deep"] {
        assert!(
            v.stat(c, gone, ReadMode::NoLock).await.unwrap().is_none(),
            "{gone}"
        );
    }
    // It goes on: writes after the undo land where they should (the redo
    // file was cut back), a step that succeeds passes its changes up.
    v.write(c, "base", 9, Bytes::from_static(b"!"))
        .await
        .unwrap();
    let sub = tx.sub().unwrap();
    v.create(sub.context(), "from-sub", true).await.unwrap();
    v.write(sub.context(), "kept", 3, Bytes::from_static(b"+"))
        .await
        .unwrap();
    sub.commit().unwrap();
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    let on_disk = |p: &str| read(s.dir.path(), p);
    assert_eq!(on_disk("kept").as_deref(), Some("top+"));
    assert_eq!(on_disk("base").as_deref(), Some("AB2345678!"));
    assert_eq!(on_disk("gone").as_deref(), Some("g"));
    assert_eq!(on_disk("mv").as_deref(), Some("m"));
    assert_eq!(on_disk("from-sub").as_deref(), Some(""));
    for gone in ["sub", "mv2", "d", "deep"] {
        assert!(!s.dir.path().join(gone).exists(), "{gone}");
    }
    no_staging_left(s.dir.path());
}

/// A commit returns once the changes show under their names (plain readers
/// see them); forcing them and dropping the staging area may come after.
#[tokio::test]
async fn a_commit_returns_once_its_changes_are_visible() {
    let s = setup().await;
    std::fs::write(s.dir.path().join("old"), "o").unwrap();
    let tx = s.node.begin();
    let c = tx.context();
    s.vol.create(c, "new", true).await.unwrap();
    s.vol
        .write(c, "new", 0, Bytes::from_static(b"n"))
        .await
        .unwrap();
    s.vol
        .write(c, "old", 1, Bytes::from_static(b"+"))
        .await
        .unwrap();
    s.vol.mkdir(c, "dir").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(read(s.dir.path(), "new").as_deref(), Some("n"));
    assert_eq!(read(s.dir.path(), "old").as_deref(), Some("o+"));
    assert!(s.dir.path().join("dir").is_dir());
    wait_applied(&s.fs).await;
    no_staging_left(s.dir.path());
}

/// A real full file system (a 2 MiB tmpfs, mounted as root): staging past
/// the space fails with NoSpace, the transaction can still end cleanly, and
/// a commit whose growth does not fit votes No, leaving the volume intact.
#[tokio::test]
async fn a_full_file_system_gives_no_space_and_votes_no() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: mounting a small tmpfs needs root (CI runs as root)");
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        println!("skipped: cannot mount a tmpfs here (no mount permission in this container)");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(mnt.path().to_path_buf());
    std::fs::write(mnt.path().join("f"), vec![1u8; 512 << 10]).unwrap();
    let data = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        FsConfig {
            limits: VolumeLimits {
                reserve_bytes: 0,
                ..VolumeLimits::default()
            },
            ..FsConfig::default()
        }
        .volume("v", mnt.path()),
    )
    .unwrap();
    let node = Node::builder(1)
        .data_dir(data.path())
        .plugin(Arc::new(fs.clone()))
        .start()
        .await
        .unwrap();
    let v = fs.local("v").unwrap();
    // Staging 4 MiB on a 2 MiB file system fails with NoSpace.
    let tx = node.begin();
    v.create(tx.context(), "big", true).await.unwrap();
    let e = v
        .write(tx.context(), "big", 0, Bytes::from(vec![2u8; 4 << 20]))
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::NoSpace(_)), "{e}");
    tx.abort("full").await.unwrap();
    wait_applied(&fs).await;
    // A range write whose redo fits but whose growth at commit does not:
    // prepare votes No.
    let tx = node.begin();
    v.write(
        tx.context(),
        "f",
        1 << 20,
        Bytes::from(vec![3u8; 600 << 10]),
    )
    .await
    .unwrap();
    let e = tx.commit().await.unwrap_err();
    assert_eq!(e.status, weft::Status::Aborted, "{e}");
    wait_applied(&fs).await;
    assert_eq!(
        std::fs::read(mnt.path().join("f")).unwrap(),
        vec![1u8; 512 << 10]
    );
    assert!(!mnt.path().join("big").exists());
    node.shutdown().await;
}

/// The machine loses what was never forced (simulated: the staging copies
/// of inline data are emptied) after the commit record is durable and
/// before anything was applied: recovery applies the commit from the
/// record's inline data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_rewrites_inline_data_lost_with_the_machine() {
    let data = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("patched"), "0123456789").unwrap();
    let fs = Fs::new(FsConfig::default().volume("v", dir.path())).unwrap();
    let (tx_hit, mut rx_hit) = tokio::sync::mpsc::unbounded_channel();
    let hook: weft_tx::CrashHook = Arc::new(move |_, tid| {
        let _ = tx_hit.send(tid);
    });
    let node = Node::builder(1)
        .data_dir(data.path())
        .tm_config(weft::TmConfig {
            crash_at: Some((weft_tx::CrashPoint::CoordinatorAfterCommitForce, hook)),
            ..weft::TmConfig::default()
        })
        .plugin(Arc::new(fs.clone()))
        .start()
        .await
        .unwrap();
    let v = fs.local("v").unwrap();
    let tx = node.begin();
    let c = tx.context().clone();
    v.create(&c, "new", true).await.unwrap();
    v.write(&c, "new", 0, Bytes::from_static(b"inline content"))
        .await
        .unwrap();
    v.write(&c, "patched", 2, Bytes::from_static(b"AB"))
        .await
        .unwrap();
    let committing = tokio::spawn(async move { tx.commit().await });
    rx_hit.recv().await.expect("the crash point is reached");
    node.crash();
    committing.abort();
    // Unforced data is gone: every staging copy is empty.
    let stage = dir.path().join(".weft-fs/stage");
    for t in std::fs::read_dir(&stage).unwrap() {
        for f in std::fs::read_dir(t.unwrap().path()).unwrap() {
            std::fs::File::create(f.unwrap().path()).unwrap();
        }
    }
    drop(node);
    let s = setup_with(VolumeLimits::default(), Some(data), Some(dir)).await;
    wait_applied(&s.fs).await;
    assert_eq!(read(s.dir.path(), "new").unwrap(), "inline content");
    assert_eq!(read(s.dir.path(), "patched").unwrap(), "01AB456789");
}

#[tokio::test]
async fn symbolic_links_are_made_and_moved_never_followed() {
    let s = setup().await;
    std::os::unix::fs::symlink("somewhere", s.dir.path().join("old-link")).unwrap();
    let tx = s.node.begin();
    let c = tx.context().clone();
    s.vol.symlink(&c, "link", "target/file").await.unwrap();
    let e = s.vol.symlink(&c, "link", "x").await.unwrap_err();
    assert!(matches!(e, FsError::AlreadyExists(_)), "{e}");
    let m = s
        .vol
        .stat(&c, "link", ReadMode::Degree2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.kind, FileKind::Symlink);
    let e = s
        .vol
        .read(&c, "link", 0, 1, ReadMode::Degree2)
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::Unsupported(_)), "{e}");
    s.vol.mkdir(&c, "d").await.unwrap();
    s.vol.rename(&c, "link", "d/link").await.unwrap();
    s.vol.rename(&c, "old-link", "d/old-link").await.unwrap();
    let kinds: Vec<(String, FileKind)> = s
        .vol
        .list(&c, "d")
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.meta.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("link".to_string(), FileKind::Symlink),
            ("old-link".to_string(), FileKind::Symlink)
        ]
    );
    assert!(s.dir.path().join("old-link").symlink_metadata().is_ok());
    tx.commit().await.unwrap();
    wait_applied(&s.fs).await;
    let link = std::fs::read_link(s.dir.path().join("d/link")).unwrap();
    assert_eq!(link, Path::new("target/file"));
    let old = std::fs::read_link(s.dir.path().join("d/old-link")).unwrap();
    assert_eq!(old, Path::new("somewhere"));
    assert!(s.dir.path().join("old-link").symlink_metadata().is_err());
    assert!(s.dir.path().join("link").symlink_metadata().is_err());
}
