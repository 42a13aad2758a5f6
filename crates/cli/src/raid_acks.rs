//! What a chaos run checks the copies against: the acknowledgement log that
//! `weft raid run --acks FILE` writes (one JSON line per transaction the
//! client was told committed), and the history rows of one copy, read
//! through the `raid-history` service that `weft raid site` adds and printed
//! by `weft raid history`.
//!
//! A DebitCredit transaction's answer does not carry its tid, so an
//! acknowledgement records the request itself: a tpcb request appends
//! exactly one history row holding its account, teller, branch and delta,
//! and the checker matches acknowledgements to rows by those fields (as a
//! multiset: every acknowledged request needs a row of its own).
//!
//! Owns the two line formats and the read path. Must only ever read
//! committed state, and keep every reply within one frame (pages of at
//! most [`PAGE_MAX`] rows).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weft::ServiceOptions;
use weft_raid::schema::HistoryRow;
use weft_raid::{AdRequest, RaidSite, Relation};
use weft_wire::{Failure, NodeId, Status};

use crate::client::Client;

/// The service of a site that pages through its committed history rows.
pub const HISTORY_SERVICE: &str = "raid-history";
/// Most rows in one page (50-byte rows: far below a frame).
pub const PAGE_MAX: u32 = 4096;

/// A request for the history rows whose key is above `after`, in key order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryPage {
    /// Rows with keys above this one (all rows when `None`).
    pub after: Option<u64>,
    /// At most this many (clamped to [`PAGE_MAX`]).
    pub limit: u32,
}

/// One committed history row of a copy, as `weft raid history` prints it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryLine {
    /// The history key (a hash of the tid and the update's index).
    pub key: u64,
    /// The transaction that wrote it.
    pub tid: String,
    /// `history` for a tpcb row, else the relation a raid-mode row updated.
    pub rel: String,
    /// Account (tpcb) or tuple (raid mode).
    pub aid: u64,
    /// Teller (tpcb).
    pub teller: u64,
    /// Branch (tpcb).
    pub branch: u64,
    /// The amount.
    pub delta: i64,
}

/// One acknowledged transaction, as `weft raid run --acks` writes it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AckLine {
    /// When the client got the answer, ms since the Unix epoch.
    pub ms: u64,
    /// The site whose action driver answered.
    pub site: NodeId,
    /// What committed.
    pub req: AdRequest,
}

/// The history service of a site, registered with the site's other
/// services before the node becomes reachable (a plugin, like the site).
pub struct HistoryService(pub RaidSite);

impl weft::Plugin for HistoryService {
    fn name(&self) -> &str {
        HISTORY_SERVICE
    }

    /// Fails like `Rpc::register`.
    fn serve(&self, rpc: &weft::Rpc) -> Result<(), Failure> {
        let site = self.0.clone();
        rpc.register(
            HISTORY_SERVICE,
            ServiceOptions::no_state(),
            move |_ctx, page: HistoryPage| {
                let site = site.clone();
                async move { history_page(&site, &page) }
            },
        )
    }
}

fn history_page(site: &RaidSite, page: &HistoryPage) -> Result<Vec<(u64, HistoryRow)>, Failure> {
    let limit = page.limit.clamp(1, PAGE_MAX) as usize;
    // Keys are the prefix byte, then the key big-endian: key order. The
    // store streams them and stops at the page's end.
    let mut out = Vec::new();
    site.store()
        .visit_committed_with_prefix(&[Relation::History.prefix()], |k, v| {
            let Some(key) = k
                .get(1..9)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_be_bytes)
            else {
                return true;
            };
            if page.after.is_none_or(|a| key > a) {
                if let Some(row) = HistoryRow::decode(v) {
                    out.push((key, row));
                }
            }
            out.len() < limit
        })?;
    Ok(out)
}

/// Prints every committed history row of the site `client` is connected to,
/// one JSON line each, in key order.
///
/// Fails when a page cannot be had.
pub async fn print_history(client: &Client) -> anyhow::Result<u64> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut after = None;
    let mut rows = 0;
    loop {
        let page: Vec<(u64, HistoryRow)> = client
            .call_here(
                HISTORY_SERVICE,
                HistoryPage {
                    after,
                    limit: PAGE_MAX,
                },
            )
            .await
            .map_err(|f| {
                if f.status == Status::NoSuchService {
                    anyhow::anyhow!("{f} (is it a `weft raid site`?)")
                } else {
                    f.into()
                }
            })?;
        let Some((last, _)) = page.last() else {
            break;
        };
        after = Some(*last);
        for (key, row) in page {
            rows += 1;
            let line = HistoryLine {
                key,
                tid: row.tid.to_string(),
                rel: row.rel.name().to_string(),
                aid: row.aid,
                teller: row.tid_key,
                branch: row.bid,
                delta: row.delta,
            };
            serde_json::to_writer(&mut out, &line)?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()?;
    Ok(rows)
}

/// Failures of one status at one site, as `weft raid run --acks` writes
/// them among the acknowledgements: at most one line per site and status
/// every [`FAILURE_EVERY_MS`], counting the failures since the last.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FailLine {
    /// When the last of them ended, ms since the Unix epoch.
    pub ms: u64,
    /// The site whose action driver the client called.
    pub site: NodeId,
    /// How the attempts ended.
    pub failed: String,
    /// How many since the previous line for this site and status.
    pub n: u64,
    /// The last one's detail.
    pub detail: String,
}

/// Least time between two failure lines of one site and status.
pub const FAILURE_EVERY_MS: u64 = 250;

/// Where `weft raid run --acks` writes its acknowledgements (and, bounded,
/// its failures).
pub struct Acks {
    out: Mutex<std::io::BufWriter<std::fs::File>>,
    /// The first write error, reported by `finish`.
    error: Mutex<Option<String>>,
    /// Per site and status: when its last line was written, failures since.
    failures: Mutex<std::collections::BTreeMap<(NodeId, String), (u64, u64)>>,
}

impl Acks {
    /// Creates (truncates) `path`.
    ///
    /// Fails when the file cannot be created.
    pub fn create(path: &Path) -> anyhow::Result<Arc<Acks>> {
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Arc::new(Acks {
            out: Mutex::new(std::io::BufWriter::new(f)),
            error: Mutex::new(None),
            failures: Mutex::new(Default::default()),
        }))
    }

    /// Records that `site` answered `req` committed.
    pub fn record(&self, site: NodeId, req: &AdRequest) {
        self.write(&AckLine {
            ms: now_ms(),
            site,
            req: req.clone(),
        });
    }

    /// Records an attempt at `site` that failed (a line at most every
    /// [`FAILURE_EVERY_MS`] per site and status).
    pub fn failed(&self, site: NodeId, f: &Failure) {
        let ms = now_ms();
        let n = {
            let mut map = self.failures.lock();
            let (last, n) = map.entry((site, f.status.to_string())).or_insert((0, 0));
            *n += 1;
            if ms < *last + FAILURE_EVERY_MS {
                return;
            }
            *last = ms;
            std::mem::take(n)
        };
        self.write(&FailLine {
            ms,
            site,
            failed: f.status.to_string(),
            n,
            detail: f.detail.clone(),
        });
    }

    fn write(&self, line: &impl Serialize) {
        let mut out = self.out.lock();
        // Each line reaches the file at once, so that a reader sees every
        // acknowledgement so far even if this process is killed.
        let written = serde_json::to_writer(&mut *out, line)
            .map_err(|e| e.to_string())
            .and_then(|()| out.write_all(b"\n").map_err(|e| e.to_string()))
            .and_then(|()| out.flush().map_err(|e| e.to_string()));
        if let Err(e) = written {
            self.error.lock().get_or_insert(e);
        }
    }

    /// Flushes the file (and the failures not yet written).
    ///
    /// Fails when a write failed.
    pub fn finish(&self) -> anyhow::Result<()> {
        let left: Vec<((NodeId, String), u64)> = self
            .failures
            .lock()
            .iter()
            .filter(|(_, (_, n))| *n > 0)
            .map(|(k, (_, n))| (k.clone(), *n))
            .collect();
        for ((site, failed), n) in left {
            self.write(&FailLine {
                ms: now_ms(),
                site,
                failed,
                n,
                detail: String::new(),
            });
        }
        self.flush()
    }

    /// Flushes the file.
    ///
    /// Fails when a write failed.
    fn flush(&self) -> anyhow::Result<()> {
        if let Some(e) = self.error.lock().clone() {
            anyhow::bail!("writing the acks file: {e}");
        }
        self.out.lock().flush().context("writing the acks file")
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn acks_are_lines_at_once_and_failures_are_counted_not_listed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("acks.jsonl");
        let acks = Acks::create(&path).unwrap();
        let req = AdRequest::Tpcb {
            aid: 7,
            teller: 3,
            branch: 1,
            delta: -42,
        };
        acks.record(NodeId(2), &req);
        // On disk before `finish`: a killed client loses no acknowledgement.
        let got = lines(&path);
        assert_eq!(got.len(), 1);
        let line: AckLine = serde_json::from_value(got[0].clone()).unwrap();
        assert_eq!((line.site, line.req), (NodeId(2), req));

        let f = Failure::new(Status::ProcDead, "gone");
        for _ in 0..1000 {
            acks.failed(NodeId(1), &f);
        }
        acks.failed(NodeId(3), &Failure::new(Status::Aborted, "cascade"));
        acks.finish().unwrap();
        let fails: Vec<FailLine> = lines(&path)
            .into_iter()
            .skip(1)
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();
        // A thousand failures in well under a second: a first line, then
        // the rest counted in the line `finish` writes.
        let at1: Vec<&FailLine> = fails.iter().filter(|l| l.site == NodeId(1)).collect();
        assert!(at1.len() <= 4, "{at1:?}");
        assert_eq!(at1.iter().map(|l| l.n).sum::<u64>(), 1000);
        assert!(at1.iter().all(|l| l.failed == "ProcDead"));
        let at3: Vec<&FailLine> = fails.iter().filter(|l| l.site == NodeId(3)).collect();
        assert_eq!((at3.len(), at3[0].n), (1, 1));
        assert_eq!(at3[0].detail, "cascade");
    }
}
