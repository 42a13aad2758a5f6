//! Model-based property test: a random sequence of file operations (files
//! and directories renamed too) inside
//! one transaction is checked against a model of the volume (in the
//! transaction's view, then on disk after commit, or unchanged after
//! abort). Seeded by proptest; a failure prints the minimal sequence.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use weft::Node;
use weft_fs::{Fs, FsConfig, ReadMode};

const NAMES: [&str; 6] = ["a", "b", "d", "d/a", "d/b", "e/a"];

#[derive(Clone, Debug)]
enum Op {
    Create(usize),
    Write(usize, u8, u8),
    Truncate(usize, u8),
    Delete(usize),
    Rename(usize, usize),
    Mkdir(usize),
    Rmdir(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let n = 0..NAMES.len();
    prop_oneof![
        n.clone().prop_map(Op::Create),
        (n.clone(), 0u8..40, 1u8..20).prop_map(|(p, o, l)| Op::Write(p, o, l)),
        (n.clone(), 0u8..40).prop_map(|(p, l)| Op::Truncate(p, l)),
        n.clone().prop_map(Op::Delete),
        (n.clone(), n.clone()).prop_map(|(a, b)| Op::Rename(a, b)),
        n.clone().prop_map(Op::Mkdir),
        n.prop_map(Op::Rmdir),
    ]
}

#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
}

impl Model {
    fn parent_ok(&self, p: &str) -> bool {
        match p.rfind('/') {
            None => true,
            Some(i) => self.dirs.contains(&p[..i]),
        }
    }
    fn exists(&self, p: &str) -> bool {
        self.files.contains_key(p) || self.dirs.contains(p)
    }
    /// Applies `op`; false when the store must refuse it.
    fn apply(&mut self, op: &Op, stamp: u8) -> bool {
        match *op {
            Op::Create(i) => {
                let p = NAMES[i];
                if !self.parent_ok(p) || self.dirs.contains(p) {
                    return false;
                }
                self.files.insert(p.into(), vec![]);
                true
            }
            Op::Write(i, o, l) => {
                let Some(f) = self.files.get_mut(NAMES[i]) else {
                    return false;
                };
                let (o, l) = (o as usize, l as usize);
                if f.len() < o + l {
                    f.resize(o + l, 0);
                }
                f[o..o + l].fill(stamp);
                true
            }
            Op::Truncate(i, l) => {
                let Some(f) = self.files.get_mut(NAMES[i]) else {
                    return false;
                };
                f.resize(l as usize, 0);
                true
            }
            Op::Delete(i) => self.files.remove(NAMES[i]).is_some(),
            Op::Rename(a, b) if self.dirs.contains(NAMES[a]) => {
                // A directory, with everything in it.
                let (a, b) = (NAMES[a], NAMES[b]);
                if a == b {
                    return true;
                }
                let (pa, pb) = (format!("{a}/"), format!("{b}/"));
                let empty_dir = |m: &Model| {
                    m.dirs.contains(b)
                        && !m
                            .files
                            .keys()
                            .chain(m.dirs.iter())
                            .any(|k| k.starts_with(&pb))
                };
                if b.starts_with(&pa)
                    || !self.parent_ok(b)
                    || self.files.contains_key(b)
                    || (self.dirs.contains(b) && !empty_dir(self))
                {
                    return false;
                }
                self.dirs.remove(b);
                let moved = |k: &String| match k.strip_prefix(&pa) {
                    Some(rest) => format!("{b}/{rest}"),
                    None if k == a => b.to_string(),
                    None => k.clone(),
                };
                self.files = std::mem::take(&mut self.files)
                    .into_iter()
                    .map(|(k, v)| (moved(&k), v))
                    .collect();
                self.dirs = std::mem::take(&mut self.dirs).iter().map(moved).collect();
                true
            }
            Op::Rename(a, b) => {
                let (a, b) = (NAMES[a], NAMES[b]);
                if !self.files.contains_key(a) || !self.parent_ok(b) || self.dirs.contains(b) {
                    return false;
                }
                if a != b {
                    let f = self.files.remove(a).unwrap();
                    self.files.insert(b.into(), f);
                }
                true
            }
            Op::Mkdir(i) => {
                let p = NAMES[i];
                if !self.parent_ok(p) || self.exists(p) {
                    return false;
                }
                self.dirs.insert(p.into());
                true
            }
            Op::Rmdir(i) => {
                let p = NAMES[i];
                let prefix = format!("{p}/");
                if !self.dirs.contains(p)
                    || self.files.keys().any(|k| k.starts_with(&prefix))
                    || self.dirs.iter().any(|k| k.starts_with(&prefix))
                {
                    return false;
                }
                self.dirs.remove(p);
                true
            }
        }
    }
}

fn on_disk(root: &Path) -> Model {
    let mut m = Model::default();
    fn walk(root: &Path, dir: &Path, m: &mut Model) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            if rel == ".weft-fs" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                m.dirs.insert(rel);
                walk(root, &e.path(), m);
            } else {
                m.files.insert(rel, std::fs::read(e.path()).unwrap());
            }
        }
    }
    walk(root, root, &mut m);
    m
}

fn seed_disk(root: &Path) -> Model {
    std::fs::create_dir(root.join("d")).unwrap();
    std::fs::write(root.join("a"), b"committed a").unwrap();
    std::fs::write(root.join("d/b"), b"committed d/b").unwrap();
    on_disk(root)
}

async fn run_case(ops: Vec<Op>, commit: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let initial = seed_disk(dir.path());
    let fs = Fs::new(FsConfig::default().volume("v", dir.path())).unwrap();
    let node = Node::builder(1)
        .plugin(Arc::new(fs.clone()))
        .start()
        .await
        .unwrap();
    let v = fs.local("v").unwrap();
    let tx = node.begin();
    let c = tx.context().clone();
    let mut model = initial.clone();
    for (n, op) in ops.iter().enumerate() {
        let stamp = b'A' + (n % 26) as u8;
        let want = model.clone().apply(op, stamp);
        let got = match *op {
            Op::Create(i) => v.create(&c, NAMES[i], false).await,
            Op::Write(i, o, l) => {
                v.write(&c, NAMES[i], o as u64, Bytes::from(vec![stamp; l as usize]))
                    .await
            }
            Op::Truncate(i, l) => v.truncate(&c, NAMES[i], l as u64).await,
            Op::Delete(i) => v.delete(&c, NAMES[i]).await,
            Op::Rename(a, b) => v.rename(&c, NAMES[a], NAMES[b]).await,
            Op::Mkdir(i) => v.mkdir(&c, NAMES[i]).await,
            Op::Rmdir(i) => v.rmdir(&c, NAMES[i]).await,
        };
        prop_assert_eq!(got.is_ok(), want, "step {} {:?}: {:?}", n, op, got);
        if want {
            model.apply(op, stamp);
        }
        // The transaction's view matches the model.
        for p in NAMES {
            let m = v.stat(&c, p, ReadMode::NoLock).await.unwrap();
            prop_assert_eq!(m.is_some(), model.exists(p), "step {} stat {}", n, p);
            if let Some(f) = model.files.get(p) {
                let d = v.read(&c, p, 0, 1000, ReadMode::NoLock).await.unwrap();
                prop_assert_eq!(&d[..], &f[..], "step {} read {}", n, p);
            }
        }
    }
    // Nothing is visible on disk before the end.
    prop_assert_eq!(on_disk(dir.path()), initial.clone());
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.abort("model").await.unwrap();
    }
    let staging = || {
        std::fs::read_dir(dir.path().join(".weft-fs/stage"))
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
    };
    let ended = fs.wait_until(|fs| !(fs.volumes().any(|v| v.stats().prepared > 0) || staging()));
    tokio::time::timeout(Duration::from_secs(60), ended)
        .await
        .expect("the transaction never ended on the volume");
    let want = if commit { model } else { initial };
    prop_assert_eq!(on_disk(dir.path()), want);
    node.shutdown().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn a_transaction_matches_the_model_then_commits_or_aborts_exactly(
        ops in proptest::collection::vec(op(), 1..24),
        commit in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(run_case(ops, commit))?;
    }
}
