//! The in-process store: a segmented hash table of states behind short-held locks.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use hashbrown::hash_table::OccupiedEntry;
use spin::mutex::{SpinMutex, SpinMutexGuard};
use spin::relax::Yield;
use tollgate_algebra::{
    Clock, Config, Inline, Kind, OneTake, Outcome, Plan, Slot, State, SystemClock, Taken, full_at,
};

use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};

use super::seam::Store;
use crate::error::StoreError;

/// Shard indices take the low 10 bits of an entry's id (shards <= 1024), names the rest.
const SHARD_BITS: u32 = 10;
const MAX_NAMES: u32 = 1 << (32 - SHARD_BITS);
/// The most takes a transaction may have to be decided one by one, without a plan.
const EACH: usize = 4;
/// A segment is swept of full states once it has doubled in size since the last sweep.
const MIN_SWEEP_LEN: usize = 64;
/// A segment gives back the names no state uses once it holds at least this many.
const MIN_NAMES_AT: usize = 64;

/// A key as stored: short keys (user ids, IPv4 addresses) inside the entry itself, so that
/// finding a state costs one cache miss fewer; longer ones on the heap. 24 bytes.
enum StoredKey {
    None,
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

const INLINE_KEY: usize = 22;

impl StoredKey {
    fn new(key: Option<&str>) -> Self {
        match key {
            None => StoredKey::None,
            Some(k) if k.len() <= INLINE_KEY => {
                let mut bytes = [0; INLINE_KEY];
                bytes[..k.len()].copy_from_slice(k.as_bytes());
                StoredKey::Inline { len: k.len() as u8, bytes }
            }
            Some(k) => StoredKey::Heap(k.as_bytes().into()),
        }
    }

    /// The key's bytes; `None` for no key (which differs from the empty key).
    #[inline]
    fn get(&self) -> Option<&[u8]> {
        match self {
            StoredKey::None => None,
            StoredKey::Inline { len, bytes } => Some(&bytes[..usize::from(*len)]),
            StoredKey::Heap(bytes) => Some(bytes),
        }
    }
}

/// One stored state: 48 bytes, plus the key's own bytes when it is longer than 22.
struct Entry {
    key: StoredKey,
    value: f64,
    ts: f64,
    /// Interned name << 10 | shard.
    id: u32,
    /// Whole seconds since the Unix epoch at or after which the state is full again and
    /// can be dropped (rounded up, so never early).
    expires: u32,
}

impl Entry {
    /// The entry of `slot`'s new `state`, its name's entry id `id`, to expire at `expires`.
    fn new(slot: &Slot<'_>, id: u32, state: State, expires: u32) -> Self {
        Entry { key: StoredKey::new(slot.key), value: state.value, ts: state.ts, id, expires }
    }

    #[inline]
    fn is(&self, id: u32, key: Option<&str>) -> bool {
        self.id == id
            && match (self.key.get(), key) {
                (Some(stored), Some(key)) => same_bytes(stored, key.as_bytes()),
                (None, None) => true,
                _ => false,
            }
    }
}

/// Whether two byte strings are equal: for the short names and keys of the hot path, a couple
/// of word compares inline instead of a call to `memcmp`.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    let half = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().expect("4 bytes"));
    match n {
        // Two overlapping windows cover the whole string.
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        4..=7 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        _ => a == b,
    }
}

/// Where a slot's entry lives: its hashes and segment, computed before any lock is taken.
#[derive(Clone, Copy)]
struct Located {
    hash: u64,
    segment: usize,
}

/// A segment: its table behind its own lock.
///
/// The lock is a spin lock, which leaves with a plain store; a lock that can put a waiter to
/// sleep (parking_lot's, std's) leaves with a second atomic read-modify-write, to see whether
/// anyone sleeps. A segment is held for tens of nanoseconds, and that second atomic was 8% of
/// a one-key request's time and 13% of a transaction of three's (BENCHMARKS.md, "Fourteenth
/// session"). A thread that finds the segment held yields its core (`Yield`) between looks
/// instead of spinning on the lock's cache line: a holder that was preempted, or is busy with
/// a rare long step (the table growing, a sweep), gets to run, and the thread that holds the
/// line runs its requests on it while it is warm.
#[repr(align(64))] // one cache line per segment lock: segments do not contend falsely
struct Segment(SpinMutex<Table, Yield>);

/// A locked segment's table.
type Locked<'a> = SpinMutexGuard<'a, Table, Yield>;

struct Table {
    entries: HashTable<Entry>,
    /// The names this segment has stored, interned: an entry keeps the name's index here.
    /// Each segment keeps its own, so a request resolves its name under the lock it takes
    /// anyway, with no shared structure to contend on.
    names: Vec<Box<str>>,
    /// The indexes of `names`, found by a name's hash.
    by_name: HashTable<u32>,
    /// The indexes of the two names found last, the latest first: most requests to a segment
    /// name the same few limits, so comparing with them first mostly saves hashing the name
    /// and a lookup. (Two, so that two limits of a transaction that share a segment do not
    /// push each other out on every request.)
    last: [u32; 2],
    /// Sweep when `entries.len()` reaches this.
    sweep_at: usize,
    /// Give back the names no state uses (see [`MemoryStore::compact_names`]) before
    /// interning one more once `names.len()` reaches this.
    names_at: usize,
}

impl Table {
    /// The index of `name` in this segment, if it was stored here.
    #[inline(always)]
    fn name_id(&mut self, name: &str, hasher: &RandomState) -> Option<u32> {
        let is = |id: u32| {
            self.names.get(id as usize).is_some_and(|n| same_bytes(n.as_bytes(), name.as_bytes()))
        };
        match self.last {
            [id, _] | [_, id] if is(id) => Some(id),
            _ => self.look_up_name(name, hasher),
        }
    }

    #[inline(never)]
    fn look_up_name(&mut self, name: &str, hasher: &RandomState) -> Option<u32> {
        let names = &self.names;
        let found = self.by_name.find(hasher.hash_one(name), |&id| {
            same_bytes(names[id as usize].as_bytes(), name.as_bytes())
        });
        let id = *found?;
        self.found(id);
        Some(id)
    }

    /// Remembers `id` as the name found last.
    fn found(&mut self, id: u32) {
        self.last = [id, self.last[0]];
    }

    /// The entry id of (name, shard) in this segment; `None` if the name was never stored here.
    #[inline]
    fn entry_id(&mut self, slot: &Slot<'_>, hasher: &RandomState) -> Option<u32> {
        Some(self.name_id(slot.name, hasher)? << SHARD_BITS | u32::from(slot.shard))
    }

    fn find(&mut self, at: Located, slot: &Slot<'_>, hasher: &RandomState) -> Option<State> {
        let id = self.entry_id(slot, hasher)?;
        let e = self.entries.find(at.hash, |e| e.is(id, slot.key))?;
        Some(State { value: e.value, ts: e.ts })
    }
}

/// The in-process store: fast, exact, bounded, and usable without an async runtime.
///
/// States live in a hash table split into segments, each behind its own lock, so requests
/// for different keys rarely meet; a request holds its segments' locks only while it
/// evaluates, and a transaction locks its segments in ascending order, so it is atomic and
/// cannot deadlock. The locks are spin locks (held for tens of nanoseconds, they leave with a
/// plain store): a thread that finds a segment held yields its core until it is free, rather
/// than sleeping. With many more threads than cores on one hot key, that trades a higher 99th
/// percentile for a lower 99.99th than a sleeping lock (BENCHMARKS.md, "Fourteenth session").
/// (Real-time threads of different priorities pinned to one core should not share a store:
/// yielding does not let a lower-priority holder run there.)
///
/// Memory follows active keys: a state that has refilled to capacity carries no
/// information, so it is dropped, either at once when a request leaves it full or by a
/// sweep that runs whenever a segment has doubled in size since the last one (amortized
/// O(1) per new key). A live key costs a 48-byte entry (keys of up to 22 bytes are kept
/// inside it; longer ones add their own bytes) plus the hash table's slack (see
/// BENCHMARKS.md for the measured figure).
///
/// Names are interned: a segment keeps each distinct name of its states once, and gives it
/// back once no state of it is left (by [`MemoryStore::sweep`], or when the segment's names
/// have doubled since it last did). A name costs its bytes plus about 40 while it has states,
/// and no more than twice as many names as states are ever kept (plus 64 a segment), so a
/// bound on keys bounds names too. Still, put unbounded values (user ids, IPs) in keys: a key
/// is cheaper than a name.
///
/// # Examples
///
/// ```
/// use tollgate::{MemoryStore, RateLimiter, Request};
/// use tollgate::{Config, MINUTE};
///
/// let limiter = RateLimiter::new(MemoryStore::builder().max_keys(1_000_000).build());
/// let config = Config::token_bucket(10.0, MINUTE);
/// assert!(limiter.limit(("upload", config), Request::new().key("alice")).unwrap().ok);
/// ```
pub struct MemoryStore<C: Clock = SystemClock> {
    segments: Box<[Segment]>,
    mask: usize,
    hasher: RandomState,
    clock: C,
    len: AtomicUsize,
    /// Names interned, over every segment.
    names: AtomicUsize,
    max_keys: Option<usize>,
    /// The holders of concurrency limits.
    holders: super::holders::Holders,
    /// One more than the second (of the store's clock, as states expire) of the last sweep
    /// of every segment; 0 before the first. See [`MemoryStore::sweep_for_room`].
    swept: AtomicU32,
}

/// Options for a [`MemoryStore`].
#[derive(Debug, Default)]
pub struct MemoryStoreBuilder {
    max_keys: Option<usize>,
    segments: Option<usize>,
}

impl MemoryStoreBuilder {
    /// Bounds the number of live states.
    ///
    /// At the bound, every segment is swept of full states first (at most once a second of
    /// the store's clock: states expire in whole seconds, so a second sweep within one finds
    /// nothing); if the store is still at the bound, a request that needs a new state gets a
    /// [`StoreError`] and nothing is admitted (fail closed), while requests for states that
    /// already exist go on as usual. Such a refusal keeps nothing: not even the request's
    /// name. Evicting a live state instead would reset that limit and let its key
    /// over-consume, so the store never does.
    #[must_use]
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// The number of segments (rounded up to a power of two); by default four per core,
    /// at least 16.
    #[must_use]
    pub fn segments(mut self, segments: usize) -> Self {
        self.segments = Some(segments);
        self
    }

    /// Builds the store on the system clock.
    pub fn build(self) -> MemoryStore {
        self.build_with_clock(SystemClock)
    }

    /// Builds the store on `clock` (a [`tollgate_algebra::ManualClock`] in tests).
    pub fn build_with_clock<C: Clock>(self, clock: C) -> MemoryStore<C> {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let n = self.segments.unwrap_or(cores * 4).max(1).next_power_of_two();
        let n = if self.segments.is_some() { n } else { n.max(16) };
        let segments = (0..n)
            .map(|_| {
                Segment(SpinMutex::new(Table {
                    entries: HashTable::new(),
                    names: Vec::new(),
                    by_name: HashTable::new(),
                    last: [u32::MAX; 2],
                    sweep_at: MIN_SWEEP_LEN,
                    names_at: MIN_NAMES_AT,
                }))
            })
            .collect();
        MemoryStore {
            segments,
            mask: n - 1,
            hasher: RandomState::default(),
            clock,
            len: AtomicUsize::new(0),
            names: AtomicUsize::new(0),
            max_keys: self.max_keys,
            holders: super::holders::Holders::default(),
            swept: AtomicU32::new(0),
        }
    }
}

impl MemoryStore {
    /// A store on the system clock with no bound on keys.
    pub fn new() -> Self {
        MemoryStoreBuilder::default().build()
    }

    /// Options: a bound on keys, the number of segments.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store on `clock` with no bound on keys.
    pub fn with_clock(clock: C) -> Self {
        MemoryStoreBuilder::default().build_with_clock(clock)
    }

    /// The number of live states.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no state is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of distinct names kept (a name with states in several segments counts
    /// once in each).
    pub fn names(&self) -> usize {
        self.names.load(Ordering::Relaxed)
    }

    /// The key and shard of every state stored for `name` (for
    /// [`RateLimiter::carry`](crate::RateLimiter::carry) after its config changed). Reads
    /// every segment, one at a time: O(states), a pause of each segment's requests for the
    /// time it takes to read it.
    pub fn keys_of(&self, name: &str) -> Vec<(Option<String>, u16)> {
        let mut found = Vec::new();
        for segment in &self.segments {
            let mut table = segment.0.lock();
            let Some(id) = table.look_up_name(name, &self.hasher) else { continue };
            for e in table.entries.iter().filter(|e| e.id >> SHARD_BITS == id) {
                // A key was a `str` when it was stored.
                let key = e.key.get().map(|k| String::from_utf8_lossy(k).into_owned());
                found.push((key, (e.id & ((1 << SHARD_BITS) - 1)) as u16));
            }
        }
        found
    }

    /// Drops every state that is full at the store's current time, and gives back the names
    /// no state uses any more; returns how many states it dropped.
    ///
    /// Sweeps also run by themselves as segments grow; call this to reclaim memory at once.
    pub fn sweep(&self) -> usize {
        self.sweep_every_segment(expiry_now(self.clock.now()))
    }

    /// The sweep a request runs when the store is at `max_keys`: at most one a second of
    /// the store's clock. States expire in whole seconds, and a state saved in second `s`
    /// expires after it, so a sweep in the second of the last one finds nothing to drop;
    /// without this, each request refused at the bound walked every state, and a flood of
    /// new keys at the bound cost O(`max_keys`) a request (80,000 new keys at a bound of
    /// 50,000: 124 s in a debug build, the sweeps all but all of it). Should the clock step
    /// back, states saved then are reclaimed by the first sweep once it has passed this
    /// second again.
    #[cold]
    #[inline(never)]
    fn sweep_for_room(&self) {
        let now = expiry_now(self.clock.now());
        if now < self.swept.load(Ordering::Relaxed) {
            return;
        }
        self.sweep_every_segment(now);
    }

    fn sweep_every_segment(&self, now: u32) -> usize {
        self.swept.fetch_max(now.saturating_add(1), Ordering::Relaxed);
        self.segments
            .iter()
            .map(|s| {
                let mut table = s.0.lock();
                let dropped = self.sweep_table(&mut table, now);
                self.compact_names(&mut table);
                dropped
            })
            .sum()
    }

    /// Gives back the names of a segment that no state of it uses, and numbers the rest
    /// afresh (rewriting its entries' ids). Only where no entry id of the segment is held
    /// outside it: before a request looks up or interns anything, or in a full sweep.
    /// O(entries + names); run when the names have doubled (or by a sweep), so each name
    /// interned pays a few steps of it.
    fn compact_names(&self, table: &mut Table) {
        let Table { entries, names, by_name, last, names_at, .. } = table;
        const GONE: u32 = u32::MAX;
        let mut new_ids = vec![GONE; names.len()];
        for e in entries.iter() {
            new_ids[(e.id >> SHARD_BITS) as usize] = 0;
        }
        let mut kept = Vec::with_capacity(new_ids.iter().filter(|&&id| id != GONE).count());
        let before = names.len();
        if kept.capacity() < before {
            for (old, name) in std::mem::take(names).into_iter().enumerate() {
                if new_ids[old] != GONE {
                    new_ids[old] = kept.len() as u32;
                    kept.push(name);
                }
            }
            for e in entries.iter_mut() {
                let new = new_ids[(e.id >> SHARD_BITS) as usize];
                e.id = new << SHARD_BITS | (e.id & ((1 << SHARD_BITS) - 1));
            }
            let mut index = HashTable::with_capacity(kept.len());
            for (id, name) in kept.iter().enumerate() {
                index.insert_unique(self.hasher.hash_one(&**name), id as u32, |&i| {
                    self.hasher.hash_one(&*kept[i as usize])
                });
            }
            (*names, *by_name, *last) = (kept, index, [u32::MAX; 2]);
            self.names.fetch_sub(before - names.len(), Ordering::Relaxed);
        }
        *names_at = (2 * names.len()).max(MIN_NAMES_AT).max(entries.len() / 4);
    }

    fn sweep_table(&self, table: &mut Table, now_secs: u32) -> usize {
        let before = table.entries.len();
        table.entries.retain(|e| e.expires > now_secs);
        let dropped = before - table.entries.len();
        if table.entries.capacity() > 4 * table.entries.len().max(MIN_SWEEP_LEN) {
            let Table { entries, names, .. } = table;
            entries.shrink_to(2 * entries.len(), |e| self.rehash(names, e));
        }
        table.sweep_at = (2 * table.entries.len()).max(MIN_SWEEP_LEN);
        self.len.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    /// The hash of a slot's entry: of its name, shard and key, in one pass. The lengths, the
    /// shard and whether there is a key go in as one word, so that `("ab", "c")` and
    /// `("a", "bc")`, or no key and the empty key, hash apart; that word and the two byte
    /// strings are three rounds of the hasher where hashing the tuple took seven.
    #[inline(always)]
    fn hash(&self, name: &str, shard: u16, key: Option<&[u8]>) -> u64 {
        use std::hash::Hasher;
        let key_bytes = key.unwrap_or_default();
        let shape = name.len() as u64
            | (key_bytes.len() as u64) << 16
            | u64::from(shard) << 32
            | u64::from(key.is_some()) << 48;
        let mut h = self.hasher.build_hasher();
        h.write_u64(shape);
        h.write(name.as_bytes());
        h.write(key_bytes);
        h.finish()
    }

    fn rehash(&self, names: &[Box<str>], e: &Entry) -> u64 {
        let shard = (e.id & ((1 << SHARD_BITS) - 1)) as u16;
        self.hash(&names[(e.id >> SHARD_BITS) as usize], shard, e.key.get())
    }

    #[inline]
    fn locate(&self, slot: &Slot<'_>) -> Located {
        self.locate_state(slot.name, slot.key, slot.shard)
    }

    /// Where the state of (name, key, shard) lives; only those three locate a state.
    #[inline]
    fn locate_state(&self, name: &str, key: Option<&str>, shard: u16) -> Located {
        let hash = self.hash(name, shard, key.map(str::as_bytes));
        // hashbrown takes its bucket index from the low bits and its tag from the top 7:
        // the segment comes from bits in between so the three stay independent.
        Located { hash, segment: (hash >> 40) as usize & self.mask }
    }

    /// Inserts a new entry (of a state that is not full: a full one carries nothing) in its
    /// locked table. Its name was interned and room reserved in `len` by [`Self::reserve`]
    /// beforehand, so inserting cannot fail half way through a transaction.
    fn insert_new(&self, table: &mut Table, at: Located, entry: Entry, now: f64) {
        if table.entries.len() >= table.sweep_at {
            self.sweep_table(table, expiry_now(now));
        }
        let Table { entries, names, .. } = table;
        entries.insert_unique(at.hash, entry, |e| self.rehash(names, e));
    }

    /// Writes `state` over a found entry, to expire at `expires`; with `None` (the state is
    /// full again) the entry is dropped instead.
    #[inline(always)]
    fn overwrite(&self, entry: OccupiedEntry<'_, Entry>, state: State, expires: Option<u32>) {
        match expires {
            Some(expires) => {
                let e = entry.into_mut();
                (e.value, e.ts, e.expires) = (state.value, state.ts, expires);
            }
            None => {
                entry.remove();
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// The entry id of a slot, interning its name in the segment if it is new there (room
    /// for its state is reserved first, so that a request refused for want of room keeps
    /// nothing).
    fn entry_id_or_intern(&self, table: &mut Table, slot: &Slot<'_>) -> Result<u32, StoreError> {
        match table.entry_id(slot, &self.hasher) {
            Some(id) => Ok(id),
            None => Ok(self.intern(table, slot.name)? << SHARD_BITS | u32::from(slot.shard)),
        }
    }

    fn intern(&self, table: &mut Table, name: &str) -> Result<u32, StoreError> {
        if let Some(id) = table.name_id(name, &self.hasher) {
            return Ok(id);
        }
        let id = table.names.len() as u32;
        if id >= MAX_NAMES {
            return Err(StoreError::new(format!(
                "the memory store holds at most {MAX_NAMES} distinct names; put unbounded values in keys"
            )));
        }
        table.names.push(name.into());
        self.names.fetch_add(1, Ordering::Relaxed);
        let Table { names, by_name, .. } = table;
        by_name.insert_unique(self.hasher.hash_one(name), id, |&i| {
            self.hasher.hash_one(&*names[i as usize])
        });
        table.found(id);
        Ok(id)
    }

    /// Gives back room reserved for `new` states that will not be saved.
    fn unreserve(&self, new: usize) {
        self.len.fetch_sub(new, Ordering::Relaxed);
    }

    /// Reserves room for `new` states; false if that would pass `max_keys`.
    fn reserve(&self, new: usize) -> bool {
        if new == 0 {
            return true;
        }
        let before = self.len.fetch_add(new, Ordering::Relaxed);
        if self.max_keys.is_some_and(|max| before + new > max) {
            self.len.fetch_sub(new, Ordering::Relaxed);
            return false;
        }
        true
    }

    #[cold]
    #[inline(never)]
    fn full_error(&self) -> StoreError {
        StoreError::new(format!(
            "the memory store is full ({} live states, max_keys); nothing was admitted",
            self.max_keys.unwrap_or_default()
        ))
    }

    /// Runs `attempt`; if the store was full, sweeps every segment and runs it once more.
    /// Deciding is pure, so running a request again is safe.
    fn with_room<R>(
        &self,
        mut attempt: impl FnMut() -> Result<Option<R>, StoreError>,
    ) -> Result<R, StoreError> {
        if let Some(result) = attempt()? {
            return Ok(result);
        }
        self.after_sweep(attempt)
    }

    /// The second half of [`Self::with_room`]: sweeps every segment and runs `attempt` once
    /// more; if the store is still full, a [`StoreError`]. Apart, for a caller that runs its
    /// first attempt inline.
    #[cold]
    #[inline(never)]
    fn after_sweep<R>(
        &self,
        mut attempt: impl FnMut() -> Result<Option<R>, StoreError>,
    ) -> Result<R, StoreError> {
        self.sweep_for_room();
        attempt()?.ok_or_else(|| self.full_error())
    }

    /// One slot under one lock, with one lookup: the request decides on the time and the
    /// stored state, which is then updated in place (or dropped when full, or inserted).
    /// Without room for an insert, every segment is swept and the request runs once more
    /// (deciding is pure, so running it again is safe); if there is still no room, the store
    /// is full. (What [`Self::with_room`] does, as a loop here: through a closure the result
    /// would leave this function through memory, which costs more than the rest of a call.)
    ///
    /// `answer` picks what the caller keeps of the result, before it leaves the store: so
    /// that what the caller drops is never worked out (see [`Store::execute_one_then`]).
    #[inline(always)]
    fn with_slot<R: OneSlot, T>(
        &self,
        request: &R,
        answer: impl FnOnce(R::Result) -> T,
    ) -> Result<T, StoreError> {
        let slot = request.slot();
        let at = self.locate(slot);
        let mut swept = false;
        loop {
            let now = self.clock.now();
            let mut table = self.segments[at.segment].0.lock();
            prefetch_home(&table.entries, at.hash);
            let id = table.entry_id(slot, &self.hasher);
            let found =
                id.and_then(|id| table.entries.find_entry(at.hash, |e| e.is(id, slot.key)).ok());
            let stored = found.as_ref().map(|e| State { value: e.get().value, ts: e.get().ts });
            let (result, save) = request.decide(now, stored);
            if let Some((state, until_full)) = save {
                match found {
                    Some(entry) => self.overwrite(entry, state, expires_in(now, until_full)),
                    None => {
                        if !self.insert(&mut table, at, slot, state, until_full, now)? {
                            drop(table);
                            if swept {
                                return Err(self.full_error());
                            }
                            self.sweep_for_room();
                            swept = true;
                            continue;
                        }
                    }
                }
            }
            return Ok(answer(result));
        }
    }

    /// Saves a new state for `slot`, full again `until_full` ms after `now` (if it is full
    /// already there is nothing to keep): false if there is no room for it.
    #[inline(never)]
    fn insert(
        &self,
        table: &mut Table,
        at: Located,
        slot: &Slot<'_>,
        state: State,
        until_full: f64,
        now: f64,
    ) -> Result<bool, StoreError> {
        let Some(expires) = expires_in(now, until_full) else { return Ok(true) };
        if !self.reserve(1) {
            return Ok(false);
        }
        // No entry id of this segment is held now: names may be given back.
        if table.names.len() >= table.names_at {
            self.compact_names(table);
        }
        let id = self.entry_id_or_intern(table, slot).inspect_err(|_| self.unreserve(1))?;
        self.insert_new(table, at, Entry::new(slot, id, state, expires), now);
        Ok(true)
    }

    /// A transaction of `N` (up to [`EACH`]) one-takes from distinct states (`located[i]`:
    /// where take i's state lives, worked out before any lock is taken): their segments
    /// locked once each, in ascending order; each take decided on its own state (which is
    /// what a plan of them decides); all saved, or nothing. False if there was no room for a
    /// new state (nothing saved).
    ///
    /// Each entry is found once: updates and removals go by the bucket found, and inserts,
    /// which may move buckets, come last. What it keeps per take is in arrays on the stack of
    /// exactly `N` elements: with the count known to the compiler, its loops over the takes
    /// are unrolled and their bounds checks are gone.
    #[inline(always)]
    fn execute_each_distinct<const N: usize, T>(
        &self,
        takes: &[OneTake<'_>; N],
        located: &[Located; N],
        answers: &mut [T; N],
        answer: &impl Fn(Taken) -> T,
        statuses: bool,
    ) -> Result<bool, StoreError> {
        /// No bucket: the take's state is not stored.
        const NONE: usize = usize::MAX;
        let mut order = [0; N];
        for (segment, at) in order.iter_mut().zip(located) {
            *segment = at.segment;
        }
        order.sort_unstable();
        let mut guards: [Option<Locked<'_>>; N] = [const { None }; N];
        for i in 0..N {
            if i == 0 || order[i] != order[i - 1] {
                guards[i] = Some(self.segments[order[i]].0.lock());
            }
        }
        // Per take, its segment's guard: at the segment's first position in `order`.
        let mut guard = [0; N];
        for (g, at) in guard.iter_mut().zip(located) {
            *g = order.iter().position(|&s| s == at.segment).expect("locked");
        }
        let now = self.clock.now();
        // Per take: the bucket of its entry, and the state to save.
        let (mut buckets, mut saves) = ([NONE; N], [None; N]);
        let mut ok = true;
        for i in 0..N {
            let (take, at) = (&takes[i], located[i]);
            let table = guards[guard[i]].as_mut().expect("locked");
            let found = table
                .entry_id(&take.slot, &self.hasher)
                .and_then(|id| table.entries.find_entry(at.hash, |e| e.is(id, take.slot.key)).ok());
            let state = found.as_ref().map(|e| State { value: e.get().value, ts: e.get().ts });
            let bucket = found.map_or(NONE, |e| e.bucket_index());
            let (taken, save) = take.decide(now, state);
            ok &= taken.decision.ok;
            answers[i] = answer(taken);
            (buckets[i], saves[i]) = (bucket, save);
        }
        if !ok {
            // Refused: nothing is taken, so a take that alone was granted reports its limit
            // as it stands, as a refused one does (a take of nothing). Deciding is pure: the
            // take decided again on its unchanged state gives its decision again, so a caller
            // that keeps no statuses has its answers already. (Its state is found again
            // rather than kept from above: keeping it added about 35 instructions to every
            // admitted transaction of three, the common case, to spare a refused one three
            // lookups.)
            if statuses {
                for i in 0..N {
                    let (take, at) = (&takes[i], located[i]);
                    let table = guards[guard[i]].as_mut().expect("locked");
                    let state = table.find(at, &take.slot, &self.hasher);
                    let (taken, _) = take.decide(now, state);
                    if taken.decision.ok {
                        let nothing = OneTake { count: 0.0, reserve: false, ..*take };
                        let status = nothing.decide(now, state).0.status;
                        answers[i] = answer(Taken { decision: taken.decision, status });
                    }
                }
            }
            return Ok(true); // nothing to save
        }
        // What can fail comes before the first write: room, then interning names. New states
        // that are full already are not kept.
        let (mut expiries, mut new) = ([None; N], 0);
        for i in 0..N {
            if let (Some(state), NONE) = (saves[i], buckets[i]) {
                expiries[i] = expires_in(now, until_full(&takes[i].slot.config, state, now));
                new += usize::from(expiries[i].is_some());
            }
        }
        if !self.reserve(new) {
            return Ok(false);
        }
        let mut ids = [0; N];
        if new > 0 {
            // No entry id is held yet (entries found are kept by bucket, which giving names
            // back does not move): names may be given back.
            for i in 0..N {
                let table = guards[guard[i]].as_mut().expect("locked");
                if expiries[i].is_some() && table.names.len() >= table.names_at {
                    self.compact_names(table);
                }
            }
            for i in 0..N {
                if expiries[i].is_some() {
                    let table = guards[guard[i]].as_mut().expect("locked");
                    ids[i] = self
                        .entry_id_or_intern(table, &takes[i].slot)
                        .inspect_err(|_| self.unreserve(new))?;
                }
            }
        }
        for i in 0..N {
            let (Some(state), bucket) = (saves[i], buckets[i]) else { continue };
            if bucket == NONE {
                continue;
            }
            let table = guards[guard[i]].as_mut().expect("locked");
            let Ok(entry) = table.entries.get_bucket_entry(bucket) else {
                unreachable!("a bucket found under the lock is still full")
            };
            let until_full = until_full(&takes[i].slot.config, state, now);
            self.overwrite(entry, state, expires_in(now, until_full));
        }
        if new > 0 {
            for i in 0..N {
                let (Some(state), Some(expires)) = (saves[i], expiries[i]) else { continue };
                let table = guards[guard[i]].as_mut().expect("locked");
                let entry = Entry::new(&takes[i].slot, ids[i], state, expires);
                self.insert_new(table, located[i], entry, now);
            }
        }
        Ok(true)
    }

    /// Several slots: their segments locked once each, in ascending order.
    fn execute_many(&self, plan: &Plan<'_>) -> Result<Option<Outcome>, StoreError> {
        let slots = plan.slots();
        let located: Inline<Located> = slots.iter().map(|s| self.locate(s)).collect();
        let mut order: Inline<usize> = located.iter().map(|l| l.segment).collect();
        order.sort_unstable();
        order.dedup();
        let now = self.clock.now();
        let mut guards: Inline<Locked<'_>> =
            order.iter().map(|&s| self.segments[s].0.lock()).collect();
        let guard_of = |segment: usize| order.binary_search(&segment).expect("locked");
        // No entry id is held yet: names may be given back.
        for table in &mut guards {
            if table.names.len() >= table.names_at {
                self.compact_names(table);
            }
        }
        // Each slot's entry id (None: its name is new to the segment) and stored state.
        let mut ids: Inline<Option<u32>> = Inline::with_capacity(slots.len());
        let mut states: Inline<Option<State>> = Inline::with_capacity(slots.len());
        for (slot, &at) in slots.iter().zip(&located) {
            let table = &mut guards[guard_of(at.segment)];
            let id = table.entry_id(slot, &self.hasher);
            let found = id.and_then(|id| table.entries.find(at.hash, |e| e.is(id, slot.key)));
            states.push(found.map(|e| State { value: e.value, ts: e.ts }));
            ids.push(id);
        }
        let found: Inline<bool> = states.iter().map(Option::is_some).collect();
        let outcome = plan.decide(now, &mut states);
        if !outcome.any_changed() {
            return Ok(Some(outcome)); // refused, or a check: nothing to save
        }
        // Everything that can fail happens before the first write: room, then interning (a
        // request refused for want of room keeps nothing). New states that are full already
        // are not kept.
        let expires = |i: usize, state: State| {
            expires_in(now, (full_at(&slots[i].config, state) - now).max(0.0))
        };
        let expiries: Inline<Option<u32>> = (0..slots.len())
            .map(|i| {
                let state = states[i].filter(|_| outcome.changed[i] && !found[i])?;
                expires(i, state)
            })
            .collect();
        let new = expiries.iter().filter(|e| e.is_some()).count();
        if !self.reserve(new) {
            return Ok(None);
        }
        for (i, (slot, &at)) in slots.iter().zip(&located).enumerate() {
            if expiries[i].is_some() && ids[i].is_none() {
                let table = &mut guards[guard_of(at.segment)];
                let id = self.entry_id_or_intern(table, slot).inspect_err(|_| self.unreserve(new));
                ids[i] = Some(id?);
            }
        }
        // The states found first, by their entries; then the new ones (which may move entries).
        for (i, (slot, &at)) in slots.iter().zip(&located).enumerate() {
            let (true, true, Some(state), Some(id)) =
                (outcome.changed[i], found[i], states[i], ids[i])
            else {
                continue;
            };
            let table = &mut guards[guard_of(at.segment)];
            if let Ok(entry) = table.entries.find_entry(at.hash, |e| e.is(id, slot.key)) {
                self.overwrite(entry, state, expires(i, state));
            }
        }
        for (i, (slot, &at)) in slots.iter().zip(&located).enumerate() {
            if let (Some(expires), Some(state), Some(id)) = (expiries[i], states[i], ids[i]) {
                let table = &mut guards[guard_of(at.segment)];
                self.insert_new(table, at, Entry::new(slot, id, state, expires), now);
            }
        }
        Ok(Some(outcome))
    }
}

/// A request over one slot, as [`MemoryStore::with_slot`] serves it. A trait rather than a
/// closure so that the common one-take request is inlined whole into the caller (a closure
/// cannot be marked `#[inline(always)]`, and returning its result through memory costs more
/// than the rest of the request).
trait OneSlot {
    type Result;

    fn slot(&self) -> &Slot<'_>;

    /// The result, and the state to save with how long until it is full again
    /// (`(full_at - now).max(0)`).
    fn decide(&self, now: f64, state: Option<State>) -> (Self::Result, Option<(State, f64)>);
}

impl OneSlot for OneTake<'_> {
    type Result = Taken;

    #[inline(always)]
    fn slot(&self) -> &Slot<'_> {
        &self.slot
    }

    #[inline(always)]
    fn decide(&self, now: f64, state: Option<State>) -> (Taken, Option<(State, f64)>) {
        let (taken, save) = OneTake::decide(self, now, state);
        (taken, save.map(|s| (s, until_full(&self.slot.config, s, now))))
    }
}

/// How long until `state`, saved at `now`, is full again: 0 exactly when
/// `full_at(config, state) <= now` (so the store drops exactly the states it would drop with
/// [`full_at`]); otherwise the time to the state's expiry, within a rounding error of
/// `full_at - now`, which the whole second of margin of [`expiry_secs`] covers.
///
/// For a token bucket this multiplies by `period / rate`, which does not depend on the state
/// and so is worked out while the request hashes and locks, instead of dividing after the
/// state is loaded: the division was a tenth of a one-key request's time. (The status that
/// `limit_with_status` returns still uses [`full_at`], exactly; `limit` drops the status, so
/// the compiler drops its division.)
#[inline(always)]
fn until_full(config: &Config, state: State, now: f64) -> f64 {
    /// Below this, `now + x > now` for every x of at least one millisecond.
    const ULP_BELOW_ONE_MS: f64 = (1u64 << 52) as f64;
    let missing = config.capacity() - state.value;
    if missing <= 0.0 {
        return (state.ts - now).max(0.0); // full_at is state.ts
    }
    if config.kind() == Kind::TokenBucket && now < ULP_BELOW_ONE_MS {
        // ts' = now for a token bucket, so full_at - now = missing * period / rate.
        let until = missing * (config.period() / config.rate());
        if until >= 1.0 {
            return until;
        }
    }
    exact_until_full(config, state, now)
}

/// `(full_at - now).max(0)`: apart, so that the compiler does not share the division with the
/// status's (which it then could not drop when the status is not used).
#[inline(never)]
fn exact_until_full(config: &Config, state: State, now: f64) -> f64 {
    (full_at(config, state) - now).max(0.0)
}

/// A plan over one slot (one or more takes from one state).
impl OneSlot for Plan<'_> {
    type Result = Outcome;

    fn slot(&self) -> &Slot<'_> {
        &self.slots()[0]
    }

    fn decide(&self, now: f64, state: Option<State>) -> (Outcome, Option<(State, f64)>) {
        let mut states = [state];
        let outcome = Plan::decide(self, now, &mut states);
        let save = states[0].filter(|_| outcome.changed[0]);
        (outcome, save.map(|s| (s, (full_at(&self.slots()[0].config, s) - now).max(0.0))))
    }
}

/// Starts loading the entries that `hash` most likely names, in its home bucket (where an
/// entry is put unless that bucket was taken) and the next (in a table 0.76 full, 63% and 15%
/// of the entries are in one of them), so that on a table larger than the caches the wait for
/// the entry overlaps the wait for the control bytes that the lookup reads first, instead of
/// following it. A hint only: if neither is the entry, the lookup finds it as usual, a little
/// later.
#[inline(always)]
fn prefetch_home(entries: &HashTable<Entry>, hash: u64) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // hashbrown probes from bucket `hash & (buckets - 1)`, and keeps bucket i + 1 just
        // below bucket i in memory (if it ever did otherwise, a prefetch would be wasted,
        // nothing more).
        let home = hash as usize & entries.num_buckets().wrapping_sub(1);
        if let Some(e) = entries.get_bucket(home) {
            let start: *const i8 = std::ptr::from_ref(e).cast();
            let size = size_of::<Entry>();
            // SAFETY: a prefetch is a hint that never faults, whatever the address, and SSE,
            // which it needs, is part of every x86_64 target.
            #[allow(unsafe_code)]
            unsafe {
                // Bucket i + 1, then both ends of bucket i (an entry may straddle two lines).
                _mm_prefetch::<_MM_HINT_T0>(start.wrapping_sub(size));
                _mm_prefetch::<_MM_HINT_T0>(start);
                _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(size - 1));
            }
        }
    }
}

/// Whole seconds after `ms`: a state is dropped at or after it is full, never before.
///
/// Multiplying by 0.001 (a division is a long wait on the hot path) may be off by a rounding
/// error either way; adding a whole second covers it. `as` saturates and maps NaN to 0.
#[inline]
fn expiry_secs(ms: f64) -> u32 {
    ((ms * 0.001) as u32).saturating_add(1)
}

/// The expiry of a state saved at `now` that is full again `until_full` ms later; `None` if
/// it is full already. (`until_full > 0` exactly when `full_at > now`: a difference of two
/// distinct finite doubles is never 0; `now + until_full` may round, which the whole second
/// of margin of [`expiry_secs`] covers.)
#[inline(always)]
fn expires_in(now: f64, until_full: f64) -> Option<u32> {
    if until_full <= 0.0 { None } else { Some(expiry_secs(now + until_full)) }
}

/// Whole seconds at `now_ms`, rounded down (give or take a rounding error, which the margin
/// of [`expiry_secs`] covers).
#[inline]
fn expiry_now(now_ms: f64) -> u32 {
    (now_ms * 0.001) as u32
}

super::seam::immediate_async_store! {
    impl[C: Clock] for MemoryStore<C>;
}

impl<C: Clock> Store for MemoryStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        if plan.slots().len() == 1 {
            self.with_slot(plan, |outcome| outcome)
        } else {
            self.with_room(|| self.execute_many(plan))
        }
    }

    #[inline(always)]
    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        self.with_slot(take, |taken| taken)
    }

    fn execute_each(&self, takes: &[OneTake<'_>], answers: &mut [Taken]) -> Result<(), StoreError> {
        /// `execute_each_of` of the first `N` takes and answers.
        fn of<C: Clock, const N: usize>(
            store: &MemoryStore<C>,
            takes: &[OneTake<'_>],
            answers: &mut [Taken],
        ) -> Result<(), StoreError> {
            let takes = takes.try_into().expect("N takes");
            let answers = (&mut answers[..N]).try_into().expect("N answers");
            store.execute_each_of::<N, Taken>(takes, answers, |taken| taken, true)
        }
        match takes.len() {
            0 => Ok(()),
            1 => of::<C, 1>(self, takes, answers),
            2 => of::<C, 2>(self, takes, answers),
            3 => of::<C, 3>(self, takes, answers),
            4 => of::<C, 4>(self, takes, answers),
            _ => super::seam::each_through_plan(self, takes, answers),
        }
    }

    /// Inlined into the limiter's transaction, so that the takes and their answers do not
    /// go through a call's memory, and what the caller does not keep of an answer is never
    /// worked out (BENCHMARKS.md, "Fifteenth session").
    #[inline(always)]
    fn execute_each_of<const N: usize, T>(
        &self,
        takes: &[OneTake<'_>; N],
        answers: &mut [T; N],
        answer: impl Fn(Taken) -> T,
        statuses: bool,
    ) -> Result<(), StoreError> {
        let mut located = [Located { hash: 0, segment: 0 }; N];
        for (at, take) in located.iter_mut().zip(takes) {
            *at = self.locate(&take.slot);
        }
        // One state has one hash: only takes of equal hashes need comparing.
        let distinct = (1..N).all(|j| {
            (0..j).all(|i| {
                located[i].hash != located[j].hash || !takes[i].slot.same_state(&takes[j].slot)
            })
        });
        if N > EACH || !distinct {
            // Takes of one state add up: the plan's bookkeeping does that.
            let mut taken = [super::seam::UNSET; N];
            super::seam::each_through_plan(self, takes, &mut taken)?;
            for (a, t) in answers.iter_mut().zip(taken) {
                *a = answer(t);
            }
            return Ok(());
        }
        // `with_room`, its first attempt inline: through its closure, the attempt was a call.
        if self.execute_each_distinct(takes, &located, answers, &answer, statuses)? {
            return Ok(());
        }
        self.after_sweep(|| {
            let done = self.execute_each_distinct(takes, &located, answers, &answer, statuses)?;
            Ok(done.then_some(()))
        })
    }

    #[inline(always)]
    fn execute_one_then<T>(
        &self,
        take: &OneTake<'_>,
        answer: impl FnOnce(Taken) -> T,
    ) -> Result<T, StoreError> {
        self.with_slot(take, answer)
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let now = self.clock.now();
        let states = slots
            .iter()
            .map(|slot| {
                let at = self.locate(slot);
                self.segments[at.segment].0.lock().find(at, slot, &self.hasher)
            })
            .collect();
        Ok((now, states))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        for shard in 0..shards {
            let at = self.locate_state(name, key, shard);
            let mut table = self.segments[at.segment].0.lock();
            let Some(id) = table.name_id(name, &self.hasher) else { continue };
            let id = id << SHARD_BITS | u32::from(shard);
            if let Ok(entry) = table.entries.find_entry(at.hash, |e| e.is(id, key)) {
                entry.remove();
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        self.holders.run(name, key, limit, op, self.clock.now())
    }

    /// Under the holders' lock, the plan is run as any plan is (a check if the slots are
    /// full), and the holder added only if both are granted.
    fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        self.holders.run_with(name, key, limit, op, self.clock.now(), |granted| {
            if granted { self.execute(plan) } else { self.execute(&plan.checking()) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_is_equality() {
        let samples: Vec<Vec<u8>> = (0..=24)
            .flat_map(|n| {
                let base: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
                let mut variants = vec![base.clone()];
                for at in 0..n {
                    let mut v = base.clone();
                    v[at] ^= 1;
                    variants.push(v);
                }
                variants
            })
            .collect();
        for a in &samples {
            for b in &samples {
                assert_eq!(same_bytes(a, b), a == b, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn entry_is_forty_eight_bytes() {
        assert_eq!(std::mem::size_of::<StoredKey>(), 24);
        assert_eq!(std::mem::size_of::<Entry>(), 48);
    }

    #[test]
    fn keys_keep_their_bytes_inline_or_not() {
        let long = "k".repeat(INLINE_KEY + 1);
        for key in
            [None, Some(""), Some("user-1"), Some(&"k".repeat(INLINE_KEY)[..]), Some(&long[..])]
        {
            assert_eq!(StoredKey::new(key).get(), key.map(str::as_bytes));
        }
        assert!(matches!(StoredKey::new(Some(&long)), StoredKey::Heap(_)));
    }

    /// A store on a manual clock at T0, of `segments` segments (16 if none) and `max_keys`.
    fn manual(
        segments: Option<usize>,
        max_keys: Option<usize>,
    ) -> (
        crate::RateLimiter<MemoryStore<tollgate_algebra::ManualClock>>,
        tollgate_algebra::ManualClock,
    ) {
        let clock = tollgate_algebra::ManualClock::new(1_700_000_000_000.0);
        let mut builder = MemoryStore::builder().segments(segments.unwrap_or(16));
        if let Some(max) = max_keys {
            builder = builder.max_keys(max);
        }
        (crate::RateLimiter::new(builder.build_with_clock(clock.clone())), clock)
    }

    /// One token a second, one at a time: full again a second after a take.
    const SECONDLY: Config = Config::token_bucket(1.0, 1_000.0);

    /// Names that came with inline configs are given back once their states are gone: at
    /// once by a sweep, and as names come and go by the store itself, never keeping more
    /// than twice as many names as states (plus 64 a segment).
    #[test]
    fn names_are_given_back_when_their_states_are_gone() {
        let (limiter, clock) = manual(None, None);
        let names: Vec<String> = (0..10_000).map(|i| format!("inline-{i}")).collect();
        for name in &names {
            assert!(limiter.limit((name.as_str(), SECONDLY), "k").unwrap().ok);
        }
        let store = limiter.store();
        assert_eq!((store.len(), store.names()), (10_000, 10_000));
        // A few live on, and keep their values.
        clock.advance(2_000.0);
        for name in &names[..10] {
            assert!(limiter.limit((name.as_str(), SECONDLY), "k").unwrap().ok);
        }
        assert_eq!(store.sweep(), 9_990);
        assert_eq!((store.len(), store.names()), (10, 10));
        for name in &names[..10] {
            let reading = limiter.value((name.as_str(), SECONDLY), Some("k")).unwrap();
            assert_eq!(reading.value, 0.0, "{name}");
        }
        // Names that come and go without a sweep: bounded all along.
        let segments = store.segments.len();
        for (i, name) in (0..50_000).map(|i| format!("passing-{i}")).enumerate() {
            assert!(limiter.limit((name.as_str(), SECONDLY), "k").unwrap().ok);
            clock.advance(10.0); // each is full again a second, 100 names, later
            if i % 1_000 == 999 {
                let bound = 2 * store.len() + 64 * segments + 2;
                assert!(
                    store.names() <= bound,
                    "{} names for {} states",
                    store.names(),
                    store.len()
                );
            }
        }
        clock.advance(2_000.0);
        store.sweep();
        assert_eq!((store.len(), store.names()), (0, 0));
    }

    /// A request refused because the store is full keeps nothing: not its name either; in a
    /// transaction of a few limits, or of many.
    #[test]
    fn a_refusal_for_want_of_room_keeps_no_name() {
        let (limiter, _clock) = manual(None, Some(10));
        for i in 0..10 {
            let name = format!("kept-{i}");
            assert!(limiter.limit((name.as_str(), SECONDLY), "k").unwrap().ok);
        }
        let store = limiter.store();
        assert_eq!(store.names(), 10);
        for i in 0..1_000 {
            let name = format!("refused-{i}");
            assert!(limiter.limit((name.as_str(), SECONDLY), "k").is_err());
            let names: Vec<String> = (0..3).map(|j| format!("refused-{i}-{j}")).collect();
            let calls: Vec<crate::Call<'_>> = names
                .iter()
                .map(|n| crate::Target::from((n.as_str(), SECONDLY)).with("k"))
                .collect();
            assert!(limiter.transaction(&calls).is_err());
            let names: Vec<String> = (0..6).map(|j| format!("refused-{i}-{j}")).collect();
            let calls: Vec<crate::Call<'_>> = names
                .iter()
                .map(|n| crate::Target::from((n.as_str(), SECONDLY)).with("k"))
                .collect();
            assert!(limiter.transaction(&calls).is_err());
        }
        assert_eq!((store.len(), store.names()), (10, 10));
    }

    /// At the bound a request sweeps at most once a second of the store's clock, and room
    /// comes back in the first second in which a state can be dropped (a state full again at
    /// `t` ms is kept until the whole second after `t`), for one take and for a transaction.
    #[test]
    fn at_the_bound_room_comes_back_the_second_a_state_expires() {
        let (limiter, clock) = manual(None, Some(2));
        let take = |name: &str| limiter.limit((name, SECONDLY), "k");
        let both = || {
            let calls = [
                crate::Target::from(("c", SECONDLY)).with("k"),
                crate::Target::from(("d", SECONDLY)).with("k"),
            ];
            limiter.transaction(&calls)
        };
        // 1,700,000,000,000 ms is a whole second: `a` and `b` are full again at +1,000 ms
        // and kept to the end of that second.
        assert!(take("a").unwrap().ok && take("b").unwrap().ok);
        assert!(take("c").is_err());
        clock.advance(1_500.0);
        assert!(take("c").is_err() && both().is_err());
        clock.advance(499.0);
        assert!(take("c").is_err() && both().is_err());
        assert_eq!(limiter.store().len(), 2);
        clock.advance(1.0);
        assert!(both().unwrap().ok);
        assert_eq!(limiter.store().len(), 2);
        assert!(take("e").is_err());
    }

    /// A take that leaves a new state full keeps nothing (a count of 0 on a new key).
    #[test]
    fn a_new_state_left_full_keeps_no_name() {
        let (limiter, _clock) = manual(None, None);
        for i in 0..100 {
            let name = format!("look-{i}");
            let zero = crate::Request::new().key("k").count(0.0);
            assert!(limiter.limit((name.as_str(), SECONDLY), zero).unwrap().ok);
        }
        assert_eq!((limiter.store().len(), limiter.store().names()), (0, 0));
    }

    /// Giving names back renumbers the rest: every state is still found, in transactions
    /// too, and the names given back are found nowhere.
    #[test]
    fn states_keep_their_names_when_others_are_given_back() {
        let (limiter, clock) = manual(Some(1), None);
        // 100 at once, then one a minute.
        let config = Config::token_bucket(1.0, 60_000.0).with_capacity(100.0);
        let live: Vec<String> = (0..200).map(|i| format!("live-{i}")).collect();
        for round in 0..5 {
            // Passing names, full again at once, between the live ones.
            for i in 0..300 {
                let name = format!("gone-{round}-{i}");
                assert!(limiter.limit((name.as_str(), SECONDLY), "k").unwrap().ok);
            }
            for name in &live {
                let calls = [
                    crate::Target::from((name.as_str(), config)).with("a"),
                    crate::Target::from((name.as_str(), config)).with("b"),
                    crate::Target::from(("other", config)).with(name.as_str()),
                ];
                assert!(limiter.transaction(&calls).unwrap().ok);
            }
            clock.advance(1_000.0); // the passing ones are full again
            limiter.store().sweep();
        }
        // As stored at the last take: five taken, four seconds of refill (a fifteenth) back.
        let left = 95.0 + 4_000.0 / 60_000.0;
        for name in &live {
            for (name, key) in [(name.as_str(), "a"), (name.as_str(), "b"), ("other", name)] {
                let reading = limiter.value((name, config), Some(key)).unwrap();
                assert!((reading.value - left).abs() < 1e-9, "{name} {key}: {}", reading.value);
            }
        }
        // Once the last passing ones have expired (a second after they are full, at most):
        // 200 live names with states, and "other".
        clock.advance(2_000.0);
        limiter.store().sweep();
        assert_eq!(limiter.store().names(), 201);
    }

    #[test]
    fn names_are_found_whatever_the_order() {
        // One segment, so every name is interned in the same table and the two names found
        // last are pushed out in turn.
        let store = MemoryStore::builder().segments(1).build();
        let hasher = &store.hasher;
        let mut table = store.segments[0].0.lock();
        let names = ["perUser", "perTeam", "global", "upload"];
        for name in names {
            assert_eq!(table.name_id(name, hasher), None);
            store.intern(&mut table, name).unwrap();
        }
        for order in [[0, 1, 0, 1, 2, 2, 3, 0, 3, 1, 2, 0], [3, 2, 1, 0, 0, 1, 2, 3, 1, 3, 1, 3]] {
            for i in order {
                assert_eq!(table.name_id(names[i], hasher), Some(i as u32), "{}", names[i]);
            }
            assert_eq!(table.name_id("perUse", hasher), None);
            assert_eq!(table.name_id("perUserX", hasher), None);
        }
    }

    proptest::proptest! {
        /// The one-take path's time until full drops exactly the states `full_at` would drop,
        /// and never expires a state before it is full.
        #[test]
        fn until_full_agrees_with_full_at(
            fixed in proptest::bool::ANY,
            rate in 0.001f64..1e6,
            period in 1.0f64..1e9,
            capacity in 0.001f64..1e9,
            value_part in -2.0f64..1.5,
            behind in 0.0f64..1e9,
            now in proptest::prop_oneof![0.0f64..1e13, 4e15f64..1e17],
        ) {
            let config = if fixed {
                Config::fixed_window(rate, period).with_capacity(capacity)
            } else {
                Config::token_bucket(rate, period).with_capacity(capacity)
            };
            // As a take leaves it: a token bucket's ts is now, a fixed window's its window's start.
            let ts = if fixed { now - behind } else { now };
            let state = State { value: capacity * value_part, ts };
            let until = until_full(&config, state, now);
            let exact = full_at(&config, state);
            proptest::prop_assert_eq!(until <= 0.0, exact <= now, "{} {}", until, exact);
            // (Expiry seconds are a u32: a state full after the year 2106 never expires.)
            if until > 0.0 && now < 4e12 {
                let secs = expiry_secs(now + until);
                proptest::prop_assert!(secs == u32::MAX || f64::from(secs) * 1_000.0 >= exact);
            }
        }
    }

    #[test]
    fn until_full_at_the_edges() {
        let config = Config::token_bucket(10.0, 60_000.0);
        // Full, and a hair short of full: dropped only when full_at says so.
        for value in [10.0, 10.0 - 1e-12, 9.0, -5.0] {
            let state = State { value, ts: 1.7e12 };
            assert_eq!(
                until_full(&config, state, 1.7e12) <= 0.0,
                full_at(&config, state) <= 1.7e12
            );
        }
        assert_eq!(until_full(&config, State { value: 9.0, ts: 1.7e12 }, 1.7e12), 6_000.0);
    }

    #[test]
    fn expiry_is_never_early() {
        for ms in [0.0, 999.0, 1_000.0, 1_000.5, 1_999.9, 1.7e12, 1.7e12 + 0.3, 4.2e12] {
            // A state full at `ms` may be dropped only once the clock has passed it.
            assert!(expiry_secs(ms) > expiry_now(ms), "{ms}");
            assert!(f64::from(expiry_secs(ms)) * 1_000.0 >= ms, "{ms}");
        }
        assert_eq!(expiry_secs(-5.0), 1);
        assert_eq!(expiry_secs(1e20), u32::MAX);
    }
}
