//! The DebitCredit database: relations, keys and tuples, as stored by the
//! access manager (a weft KV store).
//!
//! Tuples of account, teller and branch are 100 bytes (a signed 64-bit
//! balance, then filler), history tuples 50 bytes, as in the benchmark's
//! definition. Owns the byte layout. Must never depend on a site.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use weft_wire::Tid;

/// Bytes of an account, teller or branch tuple.
pub const TUPLE_BYTES: usize = 100;
/// Bytes of a history tuple.
pub const HISTORY_BYTES: usize = 50;
/// Transactions (by sequence number) whose history rows share a key prefix
/// (see [`HistoryRow::key`]).
pub const HISTORY_BLOCK: u64 = 256;

/// A relation of the DebitCredit database.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Relation {
    /// Accounts: 100 000 per scale unit in tpcb mode.
    Account,
    /// Tellers: 10 per scale unit.
    Teller,
    /// Branches: 1 per scale unit.
    Branch,
    /// The append-only history: one row per update.
    History,
    /// Markers of shipped transactions: one per committed request id,
    /// holding the transaction's answer (see `Ad::run_shipped`).
    Request,
}

impl Relation {
    /// The balance relations.
    pub const BALANCES: [Relation; 3] = [Relation::Account, Relation::Teller, Relation::Branch];

    /// The key prefix byte of the relation.
    pub fn prefix(self) -> u8 {
        match self {
            Relation::Account => b'a',
            Relation::Teller => b't',
            Relation::Branch => b'b',
            Relation::History => b'h',
            Relation::Request => b'r',
        }
    }

    /// The relation's name.
    pub fn name(self) -> &'static str {
        match self {
            Relation::Account => "account",
            Relation::Teller => "teller",
            Relation::Branch => "branch",
            Relation::History => "history",
            Relation::Request => "request",
        }
    }
}

/// A data item: what the concurrency controller locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Item {
    /// The relation.
    pub rel: Relation,
    /// The tuple key (a history key is a hash of its transaction and index).
    pub key: u64,
}

impl Item {
    /// The KV key of the item: prefix byte, then the key big-endian.
    pub fn kv_key(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(9);
        b.put_u8(self.rel.prefix());
        b.put_u64(self.key);
        b.freeze()
    }
}

/// A balance tuple with `balance`.
pub fn tuple(balance: i64) -> Bytes {
    let mut b = BytesMut::with_capacity(TUPLE_BYTES);
    b.put_i64_le(balance);
    b.resize(TUPLE_BYTES, b' ');
    b.freeze()
}

/// The balance of a tuple; `None` when the bytes are not a tuple.
pub fn balance(tuple: &[u8]) -> Option<i64> {
    (tuple.len() == TUPLE_BYTES)
        .then(|| i64::from_le_bytes(tuple[..8].try_into().expect("8 bytes")))
}

/// A history row: which tuples an update touched and by how much.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryRow {
    /// The transaction.
    pub tid: Tid,
    /// The relation updated (raid mode) or Account (tpcb mode).
    pub rel: Relation,
    /// Account (tpcb) or tuple (raid) key.
    pub aid: u64,
    /// Teller (tpcb).
    pub tid_key: u64,
    /// Branch (tpcb).
    pub bid: u64,
    /// The amount.
    pub delta: i64,
}

impl HistoryRow {
    /// The 50-byte stored form.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(HISTORY_BYTES);
        b.put_u32_le(self.tid.node.0);
        b.put_u32_le(self.tid.incarnation.0);
        b.put_u64_le(self.tid.seq);
        b.put_u8(self.rel.prefix());
        b.put_u64_le(self.aid);
        b.put_u32_le(self.tid_key as u32);
        b.put_u32_le(self.bid as u32);
        b.put_i64_le(self.delta);
        b.resize(HISTORY_BYTES, b' ');
        b.freeze()
    }

    /// Reads a stored row; `None` when malformed.
    pub fn decode(bytes: &[u8]) -> Option<HistoryRow> {
        if bytes.len() != HISTORY_BYTES {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8"));
        let rel = match bytes[16] {
            b'a' => Relation::Account,
            b't' => Relation::Teller,
            b'b' => Relation::Branch,
            b'h' => Relation::History,
            _ => return None,
        };
        Some(HistoryRow {
            tid: Tid::new(
                weft_wire::NodeId(u32_at(0)),
                weft_wire::Incarnation(u32_at(4)),
                u64_at(8),
            ),
            rel,
            aid: u64_at(17),
            tid_key: u32_at(25) as u64,
            bid: u32_at(29) as u64,
            delta: u64_at(33) as i64,
        })
    }

    /// The history key of update number `index` of transaction `tid`: unique
    /// per update, identical at every replica (a retried transaction has a
    /// new tid, so it can never duplicate a row).
    ///
    /// The top 16 bits are the transaction's sequence number in blocks of
    /// [`HISTORY_BLOCK`] (wrapping), the low 48 a hash of the identifying
    /// fields: rows written close in time share a key prefix, so the store
    /// inserts them into a few neighbouring leaves of its B-tree instead of
    /// one random leaf each. With a hash over the whole key, every row of a
    /// merge rewrote a leaf of an ever larger history table (the cost of a
    /// merge grew with the rows kept, and throughput sagged over a long
    /// run). Two rows share a key only if they share a prefix and a 48-bit
    /// hash: about one chance in 10^5 over fifty million rows.
    pub fn key(tid: Tid, index: u32) -> u64 {
        // FNV-1a over the identifying fields; its low 48 bits depend on
        // every byte (the multiplication carries only upwards).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in tid
            .node
            .0
            .to_le_bytes()
            .iter()
            .chain(&tid.incarnation.0.to_le_bytes())
            .chain(&tid.seq.to_le_bytes())
            .chain(&index.to_le_bytes())
        {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let block = (tid.seq / HISTORY_BLOCK) & 0xffff;
        (block << 48) | (h & 0xffff_ffff_ffff)
    }
}

/// Sizes of the tpcb database at a scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sizes {
    /// Accounts.
    pub accounts: u64,
    /// Tellers.
    pub tellers: u64,
    /// Branches.
    pub branches: u64,
}

impl Sizes {
    /// pgbench's sizes: per scale unit 1 branch, 10 tellers, 100 000 accounts.
    pub fn tpcb(scale: u32) -> Sizes {
        let s = u64::from(scale.max(1));
        Sizes {
            accounts: 100_000 * s,
            tellers: 10 * s,
            branches: s,
        }
    }

    /// The Raid paper's extended benchmark: every relation 100 tuples.
    pub fn raid() -> Sizes {
        Sizes {
            accounts: 100,
            tellers: 100,
            branches: 100,
        }
    }

    /// Tuples of a balance relation.
    pub fn of(&self, rel: Relation) -> u64 {
        match rel {
            Relation::Account => self.accounts,
            Relation::Teller => self.tellers,
            Relation::Branch => self.branches,
            Relation::History | Relation::Request => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::{Incarnation, NodeId};

    #[test]
    fn layouts() {
        let t = tuple(-42);
        assert_eq!(t.len(), TUPLE_BYTES);
        assert_eq!(balance(&t), Some(-42));
        let row = HistoryRow {
            tid: Tid::new(NodeId(3), Incarnation(2), 99),
            rel: Relation::Account,
            aid: 12345,
            tid_key: 7,
            bid: 1,
            delta: -4999,
        };
        let b = row.encode();
        assert_eq!(b.len(), HISTORY_BYTES);
        assert_eq!(HistoryRow::decode(&b), Some(row.clone()));
        assert_ne!(HistoryRow::key(row.tid, 0), HistoryRow::key(row.tid, 1));
        let item = Item {
            rel: Relation::Branch,
            key: 1,
        };
        assert_eq!(&item.kv_key()[..], &[b'b', 0, 0, 0, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn history_keys_are_unique_and_local() {
        let mut seen = std::collections::HashSet::new();
        for node in 1..=3 {
            for inc in 1..=2 {
                for seq in 0..20_000u64 {
                    let tid = Tid::new(NodeId(node), Incarnation(inc), seq);
                    for i in 0..3 {
                        assert!(seen.insert(HistoryRow::key(tid, i)), "{tid:?} {i}");
                    }
                }
            }
        }
        // Rows of neighbouring transactions share their key's prefix, so
        // they land next to each other in the store.
        let key = |seq| HistoryRow::key(Tid::new(NodeId(1), Incarnation(1), seq), 0);
        assert_eq!(key(512) >> 48, key(767) >> 48);
        assert_eq!(key(768) >> 48, (key(512) >> 48) + 1);
    }
}
