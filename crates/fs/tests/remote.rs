//! A remote volume (QuickSilver's DFS) in one transaction with a local
//! volume and the KV store: all three commit together, or none does.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use weft::kv::{Kv, KvConfig, KvRequest, KvResponse, Op};
use weft::{Address, Node, NodeId, Status};
use weft_fs::{Fs, FsConfig, FsError, ReadMode, VolumeLimits, VolumeRef};

struct Two {
    n1: Node,
    _n2: Node,
    kv: Kv,
    fs1: Fs,
    fs2: Fs,
    local: VolumeRef,
    remote: VolumeRef,
    v1: tempfile::TempDir,
    v2: tempfile::TempDir,
}

async fn two(remote_limits: VolumeLimits) -> Two {
    let hub = weft::InprocHub::new();
    let v1 = tempfile::tempdir().unwrap();
    let v2 = tempfile::tempdir().unwrap();
    let fs1 = Fs::new(FsConfig::default().volume("v1", v1.path())).unwrap();
    let fs2 = Fs::new(
        FsConfig {
            limits: remote_limits,
            ..FsConfig::default()
        }
        .volume("v2", v2.path()),
    )
    .unwrap();
    let kv = Kv::new(KvConfig::default());
    let n1 = Node::builder(1)
        .hub(hub.clone())
        .secret("fs-test")
        .plugin(Arc::new(fs1.clone()))
        .plugin(Arc::new(kv.clone()))
        .start()
        .await
        .unwrap();
    let n2 = Node::builder(2)
        .hub(hub.clone())
        .secret("fs-test")
        .join(weft::Seed::Inproc(NodeId(1)))
        .plugin(Arc::new(fs2.clone()))
        .start()
        .await
        .unwrap();
    let local = fs1.local("v1").unwrap();
    let remote = VolumeRef::remote(n1.rpc(), NodeId(2), "v2");
    Two {
        n1,
        _n2: n2,
        kv,
        fs1,
        fs2,
        local,
        remote,
        v1,
        v2,
    }
}

async fn settled(fs: &[&Fs]) {
    let busy = |f: &Fs| {
        f.volumes()
            .any(|v| v.stats().prepared > 0 || v.stats().locked_paths > 0)
    };
    // Branches only end from here on, so each store, once settled, stays so.
    for f in fs {
        tokio::time::timeout(Duration::from_secs(60), f.wait_until(|f| !busy(f)))
            .await
            .expect("never settled");
    }
}

fn kv_addr() -> Address {
    Address::new("kv", NodeId(1)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_and_local_volumes_and_kv_commit_together() {
    let t = two(VolumeLimits::default()).await;
    let tx = t.n1.begin();
    let c = tx.context().clone();
    t.local.create(&c, "l.txt", true).await.unwrap();
    t.local
        .write(&c, "l.txt", 0, Bytes::from_static(b"local"))
        .await
        .unwrap();
    t.remote.mkdir(&c, "dir").await.unwrap();
    t.remote.create(&c, "dir/r.txt", true).await.unwrap();
    t.remote
        .write(&c, "dir/r.txt", 0, Bytes::from_static(b"remote"))
        .await
        .unwrap();
    let _: KvResponse = tx
        .call(
            &kv_addr(),
            KvRequest(vec![Op::Put(
                Bytes::from_static(b"k"),
                Bytes::from_static(b"v"),
            )]),
        )
        .await
        .unwrap();
    // The remote volume serves the transaction's own view.
    assert_eq!(
        &t.remote
            .read(&c, "dir/r.txt", 0, 99, ReadMode::Degree2)
            .await
            .unwrap()[..],
        b"remote"
    );
    let names: Vec<String> = t
        .remote
        .list(&c, "")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["dir"]);
    assert!(!t.v2.path().join("dir").exists());
    tx.commit().await.unwrap();
    settled(&[&t.fs1, &t.fs2]).await;
    assert_eq!(std::fs::read(t.v1.path().join("l.txt")).unwrap(), b"local");
    assert_eq!(
        std::fs::read(t.v2.path().join("dir/r.txt")).unwrap(),
        b"remote"
    );
    assert_eq!(t.kv.committed(b"k").as_deref(), Some(&b"v"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_vote_of_the_remote_volume_undoes_the_local_volume_and_kv() {
    // The remote volume's file system "has no space" for this commit.
    let t = two(VolumeLimits {
        reserve_bytes: u64::MAX / 2,
        ..VolumeLimits::default()
    })
    .await;
    std::fs::write(t.v1.path().join("keep.txt"), "kept").unwrap();
    let tx = t.n1.begin();
    let c = tx.context().clone();
    t.local
        .write(&c, "keep.txt", 0, Bytes::from_static(b"XXXX"))
        .await
        .unwrap();
    t.remote.create(&c, "r.txt", true).await.unwrap();
    let _: KvResponse = tx
        .call(
            &kv_addr(),
            KvRequest(vec![Op::Put(
                Bytes::from_static(b"k"),
                Bytes::from_static(b"v"),
            )]),
        )
        .await
        .unwrap();
    let e = tx.commit().await.unwrap_err();
    assert_eq!(e.status, Status::Aborted, "{e}");
    settled(&[&t.fs1, &t.fs2]).await;
    assert_eq!(
        std::fs::read(t.v1.path().join("keep.txt")).unwrap(),
        b"kept"
    );
    assert!(!t.v2.path().join("r.txt").exists());
    assert_eq!(t.kv.committed(b"k"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_belong_to_the_transaction_across_nodes() {
    let t = two(VolumeLimits {
        lock_wait: Duration::ZERO,
        ..VolumeLimits::default()
    })
    .await;
    std::fs::write(t.v2.path().join("f"), "0").unwrap();
    let tx = t.n1.begin();
    let c = tx.context().clone();
    // The transaction writes through the remote handle; its local process
    // on node 2 (a local handle there) shares the lock and sees the write.
    t.remote
        .write(&c, "f", 0, Bytes::from_static(b"1"))
        .await
        .unwrap();
    let other = t.n1.begin();
    let e = t
        .remote
        .write(other.context(), "f", 0, Bytes::from_static(b"2"))
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::LockConflict(_)), "{e}");
    assert_eq!(e.status(), Status::LockConflict);
    other.abort("conflict").await.unwrap();
    let v2 = t.fs2.volume("v2").unwrap();
    let seen = v2
        .read(&c.xid(), "f", 0, 1, ReadMode::Degree2)
        .await
        .unwrap();
    assert_eq!(&seen[..], b"1");
    tx.commit().await.unwrap();
    settled(&[&t.fs1, &t.fs2]).await;
    assert_eq!(std::fs::read(t.v2.path().join("f")).unwrap(), b"1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_a_local_file_to_a_remote_volume() {
    let t = two(VolumeLimits::default()).await;
    let src = tempfile::NamedTempFile::new().unwrap();
    let data: Vec<u8> = (0..(3 * weft_fs::REMOTE_CHUNK + 17))
        .map(|i| (i % 253) as u8)
        .collect();
    std::fs::write(src.path(), &data).unwrap();
    let tx = t.n1.begin();
    let c = tx.context().clone();
    let n = t.remote.put_file(&c, "copy.bin", src.path()).await.unwrap();
    assert_eq!(n, data.len() as u64);
    let mut back = Vec::new();
    t.remote
        .read_to(&c, "copy.bin", ReadMode::Degree2, &mut back)
        .await
        .unwrap();
    assert_eq!(back, data);
    tx.commit().await.unwrap();
    settled(&[&t.fs1, &t.fs2]).await;
    assert_eq!(std::fs::read(t.v2.path().join("copy.bin")).unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_small_files_runs_in_order_and_stops_at_its_first_failure() {
    use weft_fs::{FsOp, FsReply};
    let t = two(VolumeLimits::default()).await;
    let put = |path: &str, data: &'static [u8]| FsOp::Put {
        path: path.into(),
        data: Bytes::from_static(data),
    };
    // Made in order: the directory, then the files in it; a put replaces.
    let tx = t.n1.begin();
    let c = tx.context().clone();
    let r = t
        .remote
        .batch(
            &c,
            vec![
                FsOp::Mkdir { path: "d".into() },
                put("d/a", b"one"),
                put("d/b", b"two"),
                put("d/a", b"three"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(r, vec![FsReply::Done; 4]);
    assert_eq!(
        t.remote
            .read(&c, "d/a", 0, 16, ReadMode::Degree2)
            .await
            .unwrap(),
        Bytes::from_static(b"three")
    );
    tx.commit().await.unwrap();
    settled(&[&t.fs1, &t.fs2]).await;
    assert_eq!(std::fs::read(t.v2.path().join("d/a")).unwrap(), b"three");
    assert_eq!(std::fs::read(t.v2.path().join("d/b")).unwrap(), b"two");
    // The first failure ends the batch (what ran before it stays done in
    // the transaction); an abort undoes it; a batch in a batch is refused.
    let tx = t.n1.begin();
    let c = tx.context().clone();
    let e = t
        .remote
        .batch(
            &c,
            vec![put("d/c", b"x"), put("missing/e", b"y"), put("d/f", b"z")],
        )
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::NotFound(_)), "{e:?}");
    assert!(t
        .remote
        .stat(&c, "d/c", ReadMode::Degree2)
        .await
        .unwrap()
        .is_some());
    assert!(t
        .remote
        .stat(&c, "d/f", ReadMode::Degree2)
        .await
        .unwrap()
        .is_none());
    let e = t
        .remote
        .batch(&c, vec![FsOp::Batch { ops: vec![] }])
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::Unsupported(_)), "{e:?}");
    let e = t
        .remote
        .batch(&c, vec![put("../x", b"y")])
        .await
        .unwrap_err();
    assert!(matches!(e, FsError::Escape(_)), "{e:?}");
    tx.abort("test").await.unwrap();
    settled(&[&t.fs1, &t.fs2]).await;
    assert!(!t.v2.path().join("d/c").exists());
    assert!(!t.v2.path().join("d/f").exists());
}
