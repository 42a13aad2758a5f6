//! The sans-IO lock table: per-key holders and FIFO wait queues.
//!
//! Owns every grant decision of the lock manager. It must never read a
//! clock, spawn, block, do I/O or change state other than through the call
//! being made; every call that grants or cancels queued requests says so in
//! its return value.
//!
//! Rules, in the words of strict 2PL and Moss's nested transactions:
//!
//! - **Compatibility.** A request by owner R in mode M is compatible with the
//!   holders of a key if every holder whose mode conflicts with M is R or an
//!   ancestor of R.
//! - **FIFO.** A compatible request is still queued if an earlier waiter on
//!   the key wants a conflicting mode, unless R's family already holds the
//!   key (it may be what that waiter waits for; queueing would deadlock).
//! - **Upgrades first.** A request queued while R's family holds the key (an
//!   upgrade, S to X, or a sub-transaction extending its family's lock) goes
//!   ahead of every ordinary waiter, behind earlier upgrades.
//! - **Settled.** After every call, no queued request is grantable.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;

use super::{LockError, LockMode, LockOwner, WaitId};

/// The answer to [`LockTable::acquire`].
#[must_use = "a queued request must be waited for or cancelled"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquire {
    /// The lock is held (now, or it already was in a covering mode).
    Granted,
    /// The request waits in the key's queue; a later call's [`Wakeups`]
    /// will name this id when it is granted or cancelled.
    Queued(WaitId),
}

/// Queued requests whose state a call changed; the caller wakes them.
#[must_use = "waiters named here must be woken"]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wakeups {
    /// Requests granted by this call, in grant order (keys in ascending
    /// order, each key's queue front to back).
    pub granted: Vec<WaitId>,
    /// Requests removed ungranted because their owner's (sub)transaction
    /// ended in this call (`release_all`, `commit_sub`, `abort_sub`).
    pub cancelled: Vec<WaitId>,
}

impl Wakeups {
    /// True if no request was granted or cancelled.
    pub fn is_empty(&self) -> bool {
        self.granted.is_empty() && self.cancelled.is_empty()
    }
}

/// Limits of a [`LockTable`]; `None` means unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockLimits {
    /// Most keys with an entry (holders or waiters) at once; a request for a
    /// new key beyond it fails with [`LockError::TableFull`].
    pub max_keys: Option<usize>,
    /// Most queued requests at once, over all keys; a request that would
    /// have to wait beyond it fails with [`LockError::QueueFull`].
    pub max_waiters: Option<usize>,
}

/// One granted lock on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder<O> {
    /// Who holds it.
    pub owner: O,
    /// In which mode.
    pub mode: LockMode,
}

/// One queued request on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter<O> {
    /// Its id, named again in [`Wakeups`] when it is granted or cancelled.
    pub id: WaitId,
    /// Who asked.
    pub owner: O,
    /// For which mode.
    pub mode: LockMode,
    /// Queued as an upgrade: the owner's family held the key when it asked,
    /// so it went ahead of ordinary waiters.
    pub upgrade: bool,
}

/// One granted lock, with its key (see [`LockTable::locks_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock<K, O> {
    /// The locked key.
    pub key: K,
    /// Who holds it.
    pub owner: O,
    /// In which mode.
    pub mode: LockMode,
}

/// The holders and waiters of one key. Never empty while in the table.
#[derive(Debug)]
struct Entry<O> {
    /// Granted locks, in grant order; at most one per owner.
    holders: Vec<Holder<O>>,
    /// Queued requests: upgrades first, then ordinary requests, each FIFO.
    queue: VecDeque<Waiter<O>>,
}

/// What a family has in the table, so that ending it touches only its keys.
#[derive(Debug)]
struct FamilyIndex<K> {
    /// Keys on which some owner of the family holds a lock.
    held: BTreeSet<K>,
    /// The family's queued requests.
    waiting: BTreeSet<WaitId>,
}

impl<K> Default for FamilyIndex<K> {
    fn default() -> Self {
        FamilyIndex {
            held: BTreeSet::new(),
            waiting: BTreeSet::new(),
        }
    }
}

impl<K> FamilyIndex<K> {
    fn is_empty(&self) -> bool {
        self.held.is_empty() && self.waiting.is_empty()
    }
}

/// The sans-IO lock table (see the module docs for the rules).
///
/// `K` is the locked key; `O` the owner. Keys are kept in a hash map and
/// ordered (`Ord`) wherever the table walks several of them, so results are
/// deterministic.
///
/// ```
/// use weft_kv::lock::{Acquire, LockMode, LockTable, TestOwner};
///
/// let mut table = LockTable::<&str, TestOwner>::new();
/// let (t1, t2) = (TestOwner::top(1), TestOwner::top(2));
/// assert_eq!(table.acquire(t1.clone(), "k", LockMode::Exclusive)?, Acquire::Granted);
/// // A sub-transaction of t1 may use its parent's lock; t2 must wait.
/// assert_eq!(table.acquire(t1.child(0), "k", LockMode::Shared)?, Acquire::Granted);
/// let Acquire::Queued(wait) = table.acquire(t2, "k", LockMode::Shared)? else {
///     unreachable!()
/// };
/// // Ending t1 grants t2's request; the caller wakes whoever waits on it.
/// assert_eq!(table.release_all(&1).granted, vec![wait]);
/// # Ok::<(), weft_kv::lock::LockError>(())
/// ```
#[derive(Debug)]
pub struct LockTable<K, O: LockOwner> {
    entries: HashMap<K, Entry<O>>,
    families: HashMap<O::Family, FamilyIndex<K>>,
    /// Every queued request, to the key it waits on.
    waits: HashMap<WaitId, K>,
    next_wait: u64,
    limits: LockLimits,
}

impl<K, O> Default for LockTable<K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    fn default() -> Self {
        Self::new()
    }
}

/// True if `owner` asking for `mode` is compatible with `holders`: every
/// conflicting holder is `owner` itself or one of its ancestors.
fn compatible<O: LockOwner>(holders: &[Holder<O>], owner: &O, mode: LockMode) -> bool {
    holders
        .iter()
        .all(|h| !h.mode.conflicts_with(mode) || h.owner.is_ancestor_of(owner))
}

/// True if some holder belongs to `family`.
fn family_holds<O: LockOwner>(holders: &[Holder<O>], family: &O::Family) -> bool {
    holders.iter().any(|h| h.owner.family() == *family)
}

/// True if a request by `owner` for `mode`, standing behind `earlier`
/// waiters, may be granted now.
fn grantable<'a, O: LockOwner + 'a>(
    holders: &[Holder<O>],
    earlier: impl IntoIterator<Item = &'a Waiter<O>>,
    owner: &O,
    mode: LockMode,
) -> bool {
    compatible(holders, owner, mode)
        && (family_holds(holders, &owner.family())
            || !earlier.into_iter().any(|w| w.mode.conflicts_with(mode)))
}

/// Adds `mode` to `owner`'s lock in `holders` (the union: exclusive wins).
fn hold<O: LockOwner>(holders: &mut Vec<Holder<O>>, owner: O, mode: LockMode) {
    match holders.iter_mut().find(|h| h.owner == owner) {
        Some(h) => h.mode = h.mode.max(mode),
        None => holders.push(Holder { owner, mode }),
    }
}

/// Grants every grantable waiter of `entry`, front to back; returns them in
/// grant order.
///
/// One pass suffices: a grant adds a holder, which makes no earlier waiter
/// compatible; it could only lift FIFO for an earlier waiter E of the same
/// family, but a family member behind E is itself blocked by E or by what
/// blocks E (one of those two is exclusive), so it is never granted first.
/// The settled invariant (checked in debug builds) would catch a miss.
fn settle<O: LockOwner>(entry: &mut Entry<O>) -> Vec<Waiter<O>> {
    let mut granted = Vec::new();
    // Modes among the waiters kept so far (those ahead of position `i`).
    let (mut ahead, mut exclusive_ahead) = (false, false);
    let mut i = 0;
    while i < entry.queue.len() {
        let w = &entry.queue[i];
        let fifo_blocked = match w.mode {
            LockMode::Exclusive => ahead,
            LockMode::Shared => exclusive_ahead,
        };
        if compatible(&entry.holders, &w.owner, w.mode)
            && (!fifo_blocked || family_holds(&entry.holders, &w.owner.family()))
        {
            let w = entry.queue.remove(i).expect("index is in range");
            hold(&mut entry.holders, w.owner.clone(), w.mode);
            granted.push(w);
        } else {
            ahead = true;
            exclusive_ahead |= w.mode == LockMode::Exclusive;
            i += 1;
        }
    }
    granted
}

impl<K, O> LockTable<K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    /// An empty, unbounded table.
    pub fn new() -> Self {
        Self::with_limits(LockLimits::default())
    }

    /// An empty table with the given limits.
    pub fn with_limits(limits: LockLimits) -> Self {
        LockTable {
            entries: HashMap::new(),
            families: HashMap::new(),
            waits: HashMap::new(),
            next_wait: 0,
            limits,
        }
    }

    /// The table's limits.
    pub fn limits(&self) -> LockLimits {
        self.limits
    }

    /// Asks for `key` in `mode` on behalf of `owner`.
    ///
    /// Returns [`Acquire::Granted`] if the owner already holds a covering
    /// lock or the request is grantable now (it then holds the union of its
    /// old and new modes), else queues it and returns [`Acquire::Queued`].
    ///
    /// Fails, changing nothing, with [`LockError::TableFull`] if `key` is new
    /// and the table has [`LockLimits::max_keys`] keys, or with
    /// [`LockError::QueueFull`] if the request would wait and the table has
    /// [`LockLimits::max_waiters`] waiters.
    pub fn acquire(&mut self, owner: O, key: K, mode: LockMode) -> Result<Acquire, LockError> {
        let Some(entry) = self.entries.get_mut(&key) else {
            if let Some(limit) = self.limits.max_keys {
                if self.entries.len() >= limit {
                    return Err(LockError::TableFull { limit });
                }
            }
            let family = self.families.entry(owner.family()).or_default();
            family.held.insert(key.clone());
            self.entries.insert(
                key.clone(),
                Entry {
                    holders: vec![Holder { owner, mode }],
                    queue: VecDeque::new(),
                },
            );
            self.debug_check_key(&key);
            return Ok(Acquire::Granted);
        };
        if entry
            .holders
            .iter()
            .any(|h| h.owner == owner && h.mode.covers(mode))
        {
            return Ok(Acquire::Granted);
        }
        if grantable(&entry.holders, &entry.queue, &owner, mode) {
            self.families
                .entry(owner.family())
                .or_default()
                .held
                .insert(key.clone());
            hold(&mut entry.holders, owner, mode);
            self.debug_check_key(&key);
            return Ok(Acquire::Granted);
        }
        if let Some(limit) = self.limits.max_waiters {
            if self.waits.len() >= limit {
                return Err(LockError::QueueFull { limit });
            }
        }
        let id = WaitId(self.next_wait);
        self.next_wait += 1;
        let upgrade = family_holds(&entry.holders, &owner.family());
        let at = if upgrade {
            // Behind earlier upgrades, ahead of every ordinary waiter.
            entry
                .queue
                .iter()
                .position(|w| !w.upgrade)
                .unwrap_or(entry.queue.len())
        } else {
            entry.queue.len()
        };
        self.families
            .entry(owner.family())
            .or_default()
            .waiting
            .insert(id);
        entry.queue.insert(
            at,
            Waiter {
                id,
                owner,
                mode,
                upgrade,
            },
        );
        self.waits.insert(id, key.clone());
        self.debug_check_key(&key);
        Ok(Acquire::Queued(id))
    }

    /// Asks for `key` in `mode` on behalf of `owner` without waiting: grants
    /// it as [`acquire`](Self::acquire) would, or changes nothing.
    ///
    /// Fails with [`LockError::Conflict`] (naming the key's holders) where
    /// `acquire` would have queued, and with [`LockError::TableFull`] as
    /// `acquire` does.
    pub fn try_acquire(&mut self, owner: O, key: K, mode: LockMode) -> Result<(), LockError> {
        if let Some(entry) = self.entries.get(&key) {
            let held = entry
                .holders
                .iter()
                .any(|h| h.owner == owner && h.mode.covers(mode));
            if !held && !grantable(&entry.holders, &entry.queue, &owner, mode) {
                return Err(self.conflict_error(&key));
            }
        }
        match self.acquire(owner, key, mode)? {
            Acquire::Granted => Ok(()),
            Acquire::Queued(_) => unreachable!("checked grantable above"),
        }
    }

    /// Removes the queued request `wait` (its wait timed out, or its caller
    /// gave up). Returns the requests that its removal unblocked, now granted
    /// (`cancelled` is empty: the caller knows about `wait`).
    ///
    /// Fails with [`LockError::NoSuchWait`], changing nothing, if `wait` is
    /// not queued: already granted or cancelled, or never issued.
    pub fn cancel(&mut self, wait: WaitId) -> Result<Wakeups, LockError> {
        let key = self
            .waits
            .get(&wait)
            .cloned()
            .ok_or(LockError::NoSuchWait(wait))?;
        self.unqueue(wait, &key);
        let mut wake = Wakeups::default();
        self.settle_key(&key, None, &mut wake);
        Ok(wake)
    }

    /// Releases every lock held by any owner of `family` and cancels all of
    /// the family's queued requests (the top-level transaction ended, by
    /// commit or abort). Never fails; an unknown family is a no-op.
    pub fn release_all(&mut self, family: &O::Family) -> Wakeups {
        let mut wake = Wakeups::default();
        let Some(index) = self.families.remove(family) else {
            return wake;
        };
        let mut touched = BTreeSet::new();
        for id in index.waiting {
            let key = self.waits.remove(&id).expect("family waits are queued");
            let entry = self.entries.get_mut(&key).expect("queued on a live key");
            entry.queue.retain(|w| w.id != id);
            wake.cancelled.push(id);
            touched.insert(key);
        }
        for key in index.held {
            let entry = self.entries.get_mut(&key).expect("held key is live");
            entry.holders.retain(|h| h.owner.family() != *family);
            touched.insert(key);
        }
        for key in &touched {
            self.settle_key(key, None, &mut wake);
        }
        wake
    }

    /// Releases the shared locks held by `owner` and its descendants,
    /// keeping exclusive ones (a read-only participant voting READ-ONLY, or
    /// degree-2 consistency). Never fails; holding nothing is a no-op.
    pub fn release_shared(&mut self, owner: &O) -> Wakeups {
        let keys = self.held_keys(&owner.family());
        self.release_shared_on(owner, keys)
    }

    /// Releases the shared lock on `key` held by `owner` or its descendants,
    /// keeping exclusive ones (degree-2 consistency: release a read lock
    /// once the read is done). Never fails; holding nothing is a no-op.
    pub fn release_shared_key(&mut self, owner: &O, key: &K) -> Wakeups {
        let held = self
            .families
            .get(&owner.family())
            .is_some_and(|f| f.held.contains(key));
        let keys = if held { vec![key.clone()] } else { Vec::new() };
        self.release_shared_on(owner, keys)
    }

    /// Commits the sub-transaction `child`: every lock held by it or its
    /// descendants passes to its parent, which then holds the union of its
    /// own and the passed modes (exclusive wins). Queued requests of `child`
    /// and its descendants are cancelled (a committed transaction waits for
    /// nothing). Requests that could not share a lock with `child` but can
    /// with its parent (its siblings, typically) are granted.
    ///
    /// Fails with [`LockError::NotSubTransaction`], changing nothing, if
    /// `child` is top-level (end those with [`release_all`](Self::release_all)).
    pub fn commit_sub(&mut self, child: &O) -> Result<Wakeups, LockError> {
        let parent = child.parent().ok_or_else(|| LockError::NotSubTransaction {
            owner: format!("{child:?}"),
        })?;
        let mut wake = Wakeups::default();
        let mut touched = self.cancel_subtree_waits(child, &mut wake);
        for key in self.held_keys(&child.family()) {
            let entry = self.entries.get_mut(&key).expect("held key is live");
            let mut passed: Option<LockMode> = None;
            entry.holders.retain(|h| {
                let mine = child.is_ancestor_of(&h.owner);
                if mine {
                    passed = passed.max(Some(h.mode));
                }
                !mine
            });
            if let Some(mode) = passed {
                hold(&mut entry.holders, parent.clone(), mode);
                touched.insert(key);
            }
        }
        for key in &touched {
            self.settle_key(key, None, &mut wake);
        }
        Ok(wake)
    }

    /// Aborts the sub-transaction `child`: releases every lock held by it or
    /// its descendants (its ancestors' own locks stay) and cancels their
    /// queued requests.
    ///
    /// Fails with [`LockError::NotSubTransaction`], changing nothing, if
    /// `child` is top-level (end those with [`release_all`](Self::release_all)).
    pub fn abort_sub(&mut self, child: &O) -> Result<Wakeups, LockError> {
        if child.parent().is_none() {
            return Err(LockError::NotSubTransaction {
                owner: format!("{child:?}"),
            });
        }
        let mut wake = Wakeups::default();
        let mut touched = self.cancel_subtree_waits(child, &mut wake);
        for key in self.held_keys(&child.family()) {
            let entry = self.entries.get_mut(&key).expect("held key is live");
            let before = entry.holders.len();
            entry.holders.retain(|h| !child.is_ancestor_of(&h.owner));
            if entry.holders.len() != before {
                touched.insert(key);
            }
        }
        let family = child.family();
        for key in &touched {
            self.settle_key(key, Some(&family), &mut wake);
        }
        Ok(wake)
    }

    /// The holders of `key`, in grant order (empty if it is not locked).
    pub fn holders(&self, key: &K) -> Vec<Holder<O>> {
        self.entries
            .get(key)
            .map(|e| e.holders.clone())
            .unwrap_or_default()
    }

    /// The queued requests on `key`, front first (empty if none).
    pub fn waiters(&self, key: &K) -> Vec<Waiter<O>> {
        self.entries
            .get(key)
            .map(|e| e.queue.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every lock held by an owner of `family`, by ascending key (and grant
    /// order within a key).
    pub fn locks_of(&self, family: &O::Family) -> Vec<HeldLock<K, O>> {
        let Some(index) = self.families.get(family) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for key in &index.held {
            for h in &self.entries[key].holders {
                if h.owner.family() == *family {
                    out.push(HeldLock {
                        key: key.clone(),
                        owner: h.owner.clone(),
                        mode: h.mode,
                    });
                }
            }
        }
        out
    }

    /// Every family that holds a lock now, with the number of keys it
    /// holds (in no particular order).
    pub fn families_holding(&self) -> Vec<(O::Family, usize)> {
        self.families
            .iter()
            .filter(|(_, index)| !index.held.is_empty())
            .map(|(family, index)| (family.clone(), index.held.len()))
            .collect()
    }

    /// The key that queued request `wait` waits on, or `None` if it is not
    /// queued.
    pub fn waiting_key(&self, wait: WaitId) -> Option<&K> {
        self.waits.get(&wait)
    }

    /// The number of keys with holders or waiters.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if no key has holders or waiters.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The number of queued requests over all keys.
    pub fn waiter_count(&self) -> usize {
        self.waits.len()
    }

    /// A [`LockError::Conflict`] for `key` naming its current holders, as
    /// returned to a request that could not be granted.
    pub fn conflict_error(&self, key: &K) -> LockError {
        LockError::Conflict {
            key: format!("{key:?}"),
            holders: self
                .entries
                .get(key)
                .map(|e| {
                    e.holders
                        .iter()
                        .map(|h| format!("{:?}:{}", h.owner, h.mode))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Checks every invariant of the whole table (O(size)): for tests and
    /// debugging. Returns a description of the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        for key in self.entries.keys() {
            self.check_key(key)?;
        }
        for (id, key) in &self.waits {
            let queued = self
                .entries
                .get(key)
                .is_some_and(|e| e.queue.iter().any(|w| w.id == *id));
            if !queued {
                return Err(format!("{id} indexed on {key:?} but not queued there"));
            }
        }
        let queued: usize = self.entries.values().map(|e| e.queue.len()).sum();
        if queued != self.waits.len() {
            return Err(format!(
                "{queued} queued requests but {} indexed",
                self.waits.len()
            ));
        }
        for (family, index) in &self.families {
            if index.is_empty() {
                return Err(format!("empty family index left for {family:?}"));
            }
            for key in &index.held {
                let holds = self
                    .entries
                    .get(key)
                    .is_some_and(|e| family_holds(&e.holders, family));
                if !holds {
                    return Err(format!(
                        "{family:?} indexed as holding {key:?} but does not"
                    ));
                }
            }
            for id in &index.waiting {
                let Some(key) = self.waits.get(id) else {
                    return Err(format!("{family:?} indexed as waiting in {id}, not queued"));
                };
                let ok = self.entries[key]
                    .queue
                    .iter()
                    .any(|w| w.id == *id && w.owner.family() == *family);
                if !ok {
                    return Err(format!("{id} indexed under the wrong family {family:?}"));
                }
            }
        }
        let waiting: usize = self.families.values().map(|f| f.waiting.len()).sum();
        if waiting != self.waits.len() {
            return Err(format!(
                "{waiting} requests indexed by family, {} queued",
                self.waits.len()
            ));
        }
        if let Some(limit) = self.limits.max_keys {
            if self.entries.len() > limit {
                return Err(format!(
                    "{} keys over the limit {limit}",
                    self.entries.len()
                ));
            }
        }
        Ok(())
    }

    // ---- internals ----

    /// Checks the invariants of one key's entry and its index records.
    fn check_key(&self, key: &K) -> Result<(), String> {
        let Some(entry) = self.entries.get(key) else {
            return Ok(());
        };
        if entry.holders.is_empty() && entry.queue.is_empty() {
            return Err(format!("empty entry left for {key:?}"));
        }
        for (i, a) in entry.holders.iter().enumerate() {
            for b in &entry.holders[i + 1..] {
                if a.owner == b.owner {
                    return Err(format!("{key:?}: {:?} holds twice", a.owner));
                }
                let related = a.owner.is_ancestor_of(&b.owner) || b.owner.is_ancestor_of(&a.owner);
                if a.mode.conflicts_with(b.mode) && !related {
                    return Err(format!(
                        "{key:?}: incompatible holders {:?}:{} and {:?}:{}",
                        a.owner, a.mode, b.owner, b.mode
                    ));
                }
            }
            let indexed = self
                .families
                .get(&a.owner.family())
                .is_some_and(|f| f.held.contains(key));
            if !indexed {
                return Err(format!("{key:?}: holder {:?} not indexed", a.owner));
            }
        }
        let mut seen_ordinary = false;
        for (i, w) in entry.queue.iter().enumerate() {
            if grantable(&entry.holders, entry.queue.range(..i), &w.owner, w.mode) {
                return Err(format!("{key:?}: {} is grantable but queued", w.id));
            }
            if self.waits.get(&w.id) != Some(key) {
                return Err(format!("{key:?}: {} not indexed", w.id));
            }
            let indexed = self
                .families
                .get(&w.owner.family())
                .is_some_and(|f| f.waiting.contains(&w.id));
            if !indexed {
                return Err(format!("{key:?}: {} not indexed by family", w.id));
            }
            if w.upgrade && seen_ordinary {
                return Err(format!(
                    "{key:?}: upgrade {} behind an ordinary waiter",
                    w.id
                ));
            }
            seen_ordinary |= !w.upgrade;
        }
        Ok(())
    }

    fn debug_check_key(&self, key: &K) {
        if cfg!(debug_assertions) {
            if let Err(violation) = self.check_key(key) {
                panic!("lock table invariant violated: {violation}");
            }
        }
    }

    /// The keys on which `family` holds locks, ascending.
    fn held_keys(&self, family: &O::Family) -> Vec<K> {
        self.families
            .get(family)
            .map(|f| f.held.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Removes the queued request `wait` on `key` from the queue and the
    /// indices, without settling.
    fn unqueue(&mut self, wait: WaitId, key: &K) {
        self.waits.remove(&wait);
        let entry = self.entries.get_mut(key).expect("queued on a live key");
        let at = entry
            .queue
            .iter()
            .position(|w| w.id == wait)
            .expect("indexed wait is queued");
        let w = entry.queue.remove(at).expect("index is in range");
        let family = w.owner.family();
        if let Some(index) = self.families.get_mut(&family) {
            index.waiting.remove(&wait);
            if index.is_empty() {
                self.families.remove(&family);
            }
        }
    }

    /// Cancels the queued requests of `root` and its descendants; returns the
    /// keys they waited on.
    fn cancel_subtree_waits(&mut self, root: &O, wake: &mut Wakeups) -> BTreeSet<K> {
        let mut touched = BTreeSet::new();
        let Some(index) = self.families.get(&root.family()) else {
            return touched;
        };
        let doomed: Vec<(WaitId, K)> = index
            .waiting
            .iter()
            .filter_map(|id| {
                let key = &self.waits[id];
                let entry = &self.entries[key];
                let w = entry.queue.iter().find(|w| w.id == *id)?;
                root.is_ancestor_of(&w.owner).then(|| (*id, key.clone()))
            })
            .collect();
        for (id, key) in doomed {
            self.unqueue(id, &key);
            wake.cancelled.push(id);
            touched.insert(key);
        }
        touched
    }

    /// Drops the shared locks of `owner`'s subtree on `keys`, then settles.
    fn release_shared_on(&mut self, owner: &O, keys: Vec<K>) -> Wakeups {
        let mut wake = Wakeups::default();
        let family = owner.family();
        for key in keys {
            let entry = self.entries.get_mut(&key).expect("held key is live");
            let before = entry.holders.len();
            entry
                .holders
                .retain(|h| h.mode != LockMode::Shared || !owner.is_ancestor_of(&h.owner));
            if entry.holders.len() != before {
                self.settle_key(&key, Some(&family), &mut wake);
            }
        }
        wake
    }

    /// After holders or waiters of `key` were removed: grants what became
    /// grantable, brings the indices up to date and drops the entry if it is
    /// empty. `maybe_lost` is the family whose holders were removed, if any:
    /// its index stops naming `key` if it no longer holds it.
    fn settle_key(&mut self, key: &K, maybe_lost: Option<&O::Family>, wake: &mut Wakeups) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        let granted = settle(entry);
        let still_holds = maybe_lost.map(|family| family_holds(&entry.holders, family));
        let empty = entry.holders.is_empty() && entry.queue.is_empty();
        if empty {
            self.entries.remove(key);
        }
        for w in granted {
            self.waits.remove(&w.id);
            let index = self.families.entry(w.owner.family()).or_default();
            index.waiting.remove(&w.id);
            index.held.insert(key.clone());
            wake.granted.push(w.id);
        }
        if let (Some(family), Some(false)) = (maybe_lost, still_holds) {
            if let Some(index) = self.families.get_mut(family) {
                index.held.remove(key);
                if index.is_empty() {
                    self.families.remove(family);
                }
            }
        }
        self.debug_check_key(key);
    }
}
