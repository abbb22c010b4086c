//! Leases (issue 34), whichever store keeps them: the holder's side. A store that keeps leases
//! (Redis, PostgreSQL) runs one [`Step`] on a leased shard atomically and says what it loaded
//! and what it answered ([`LeaseStore::lease_call`]); everything else is here, the same for
//! every store: the answer is `tollgate_algebra::lease`'s on what the store loaded (a store that
//! disagrees is an error), and a process's holders answer `limit` from their leases, fetch
//! the next in the background and return them near the limit.
//!
//! The store seam does not widen: a leasing store's `execute_one_async` sends a leased
//! limit's takes here.

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tollgate_algebra::lease::{Grant, Holder, Leased};
use tollgate_algebra::{Config, Decision, OneTake, Slot, State, Status, Taken};

use crate::error::StoreError;
use crate::store::seam::BoxFuture;

/// A step on a leased shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Step {
    /// A direct take of `count` (a check when not `writes`).
    Take { count: f64, reserve: bool, writes: bool },
    /// See [`Leased::grant`].
    Grant { holder: u64, want: f64, unused: f64, term: f64, share: f64 },
    /// See [`Leased::release`].
    Release { holder: u64, unused: f64 },
    /// See [`Leased::forget`]: needs no config (the store ignores the slot's).
    Forget,
}

/// What a step answered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Answer {
    Taken(bool),
    Granted(Grant),
    Released,
}

/// A store that keeps leases.
pub(crate) trait LeaseStore: Send + Sync + 'static {
    /// The store's name in messages (`redis`, `postgres`).
    const NAME: &'static str;

    /// Runs `step` on the leased shard of `slot` in one atomic unit: loads the state and
    /// its records, refills it under the cap `capacity - outstanding` (each expired record
    /// dropped at its expiry), runs the step and saves the result, exactly as
    /// [`Leased`]'s methods do. Answers the time it used, what it loaded, and what it said:
    /// `[1]` or `[0]` for a take, `[kept, tokens, expiry]` for a grant, nothing otherwise.
    fn lease_call(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> impl Future<Output = Result<(f64, Leased, Vec<f64>), StoreError>> + Send;

    /// Says that this process leases `name` under the config `said` describes, for the next
    /// `ttl`, and answers what another process said of it before, if that has not expired:
    /// a limit leased under two configs mixes them, and neither holds.
    fn announce(
        &self,
        name: &str,
        said: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<String>, StoreError>> + Send;

    /// The leased limits, if the store has any.
    fn leases(&self) -> Option<&Leases>;

    /// The store's test clock, if it runs on one.
    fn clock_now(&self) -> Option<f64>;
}

/// Runs `step` on the leased shard of `slot`: the answer (tollgate-algebra's on what the store
/// loaded; one the store disagrees with is an error), the store's time, and the shard after.
pub(crate) async fn step<S: LeaseStore>(
    store: &S,
    slot: &Slot<'_>,
    step: Step,
) -> Result<(Answer, f64, Leased), StoreError> {
    let c = &slot.config;
    let (now, mut leased, said) = store.lease_call(slot, step).await?;
    let answer = match step {
        Step::Take { count, reserve, writes } => {
            let taken = leased.take(c, slot.alignment, now, count, reserve, writes);
            Answer::Taken(taken.ok)
        }
        Step::Grant { holder, want, unused, term, share } => {
            let grant = leased.grant(c, slot.alignment, now, holder, want, unused, term, share);
            Answer::Granted(grant)
        }
        Step::Release { holder, unused } => {
            leased.release(c, slot.alignment, now, holder, unused);
            Answer::Released
        }
        Step::Forget => {
            leased.forget();
            Answer::Released
        }
    };
    // Compared as numbers: the store's max and Rust's may differ on the sign of a zero.
    let agrees = match answer {
        Answer::Taken(ok) => said == [if ok { 1.0 } else { 0.0 }],
        Answer::Granted(g) => said == [g.kept, g.tokens, g.expiry],
        Answer::Released => said.is_empty(),
    };
    if !agrees {
        return Err(disagree(S::NAME));
    }
    Ok((answer, now, leased))
}

fn disagree(store: &str) -> StoreError {
    StoreError::new(format!(
        "{store}: the store's lease step and tollgate-algebra disagree (a store function or \
         script of another version?)"
    ))
}

/// The states of `slots` as a read sees them: as stored while no lease is out (as for a limit
/// that is not leased: SPEC's `value`, from which a client runs the algebra); with leases
/// out, refilled to now under its cap (so `value` is what may be taken directly, the leased
/// tokens apart, and the algebra run from it never passes the cap).
pub(crate) async fn read<S: LeaseStore>(
    store: &S,
    slots: &[Slot<'_>],
) -> Result<(f64, Vec<Option<State>>), StoreError> {
    let mut now = f64::NAN;
    let mut states = Vec::with_capacity(slots.len());
    for slot in slots {
        let look = Step::Take { count: 0.0, reserve: false, writes: false };
        let (at, mut leased, _) = store.lease_call(slot, look).await?;
        now = at;
        let state = match leased.state {
            Some(stored) if leased.leases.is_empty() => Some(stored),
            None if leased.leases.is_empty() => None,
            // With leases out (a forgotten state too): as full as they allow.
            _ => Some(leased.advance(&slot.config, slot.alignment, at)),
        };
        states.push(state);
    }
    Ok((now, states))
}

/// The tokens leased out of `slot` now, over every holder (records not yet expired).
pub(crate) async fn leased_out<S: LeaseStore>(
    store: &S,
    slot: &Slot<'_>,
) -> Result<f64, StoreError> {
    let look = Step::Take { count: 0.0, reserve: false, writes: false };
    let (now, leased, _) = store.lease_call(slot, look).await?;
    Ok(leased.leases.iter().filter(|(_, lease)| lease.expiry > now).map(|(_, l)| l.tokens).sum())
}

/// The slot of an unsharded (name, key) of `config`, for a look at its records.
pub(crate) fn look_slot<'a>(name: &'a str, key: Option<&'a str>, config: Config) -> Slot<'a> {
    // The alignment only places a fixed window's first state, which a look does not save.
    Slot { name, key, shard: 0, config, alignment: 0.0 }
}

/// A direct take from a leased shard: answered as any take (its `retryAfter` and status
/// too) on the state refilled under its cap; also the value it leaves.
async fn direct<S: LeaseStore>(store: &S, one: &OneTake<'_>) -> Result<(Taken, f64), StoreError> {
    let step = Step::Take { count: one.count, reserve: one.reserve, writes: one.writes };
    let (now, mut leased, said) = store.lease_call(&one.slot, step).await?;
    let state = leased.advance(&one.slot.config, one.slot.alignment, now);
    let (taken, new) = one.decide(now, Some(state));
    if said != [if taken.decision.ok { 1.0 } else { 0.0 }] {
        return Err(disagree(S::NAME));
    }
    Ok((taken, new.map_or(state.value, |s| s.value)))
}

/// How a leased limit is served (`RedisStoreBuilder::lease`, `PgStoreBuilder::lease`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaseOptions {
    pub(crate) term: Duration,
    pub(crate) share: f64,
    pub(crate) floor: f64,
    pub(crate) hot_after: u32,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions { term: Duration::from_secs(2), share: 0.5, floor: 0.25, hot_after: HOT_AFTER }
    }
}

/// Takes of one key within a term, in this process, after which the key is leased (see
/// [`LeaseOptions::hot_after`]). A lease costs the store a grant and a give-back, each about
/// six times a plain take's work on Redis (21.8 against 3.4 us of its CPU, measured with
/// `scripts/resp-bench`), and a key leased by any process makes every other process's direct
/// takes of it the dearer kind: leasing pays from some ten takes a term, and 16 leaves room.
pub const HOT_AFTER: u32 = 16;

impl LeaseOptions {
    /// The defaults: leases of 2 s, at most half the capacity leased out in all, none while
    /// the limit has less than a quarter of its capacity left.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a lease lasts at the store (default 2 s): a holder killed with its lease
    /// keeps those tokens from everyone for this long at most.
    #[must_use]
    pub fn term(mut self, term: Duration) -> Self {
        self.term = term;
        self
    }

    /// The most of the capacity leased out at once, over every holder (default 0.5).
    #[must_use]
    pub fn share(mut self, share: f64) -> Self {
        self.share = share.clamp(0.0, 1.0);
        self
    }

    /// A key is leased once this process takes from it this many times within one term
    /// (default [`HOT_AFTER`], 16); until then its takes go to the store as an unleased
    /// limit's do, and a key that stops coming gives its lease back after two idle terms. So
    /// a leased limit keyed by users leases its hot keys only: a cold key costs what it costs
    /// unleased. 1 leases every key from its first take. Exact either way: a direct take and
    /// a leased one are counted against one bound.
    #[must_use]
    pub fn hot_after(mut self, takes: u32) -> Self {
        self.hot_after = takes.max(1);
        self
    }

    /// Below this fraction of the capacity left (default 0.25), holders stop leasing and
    /// return what they hold: every request is a direct take, exact as without leases,
    /// until the limit has room again. Only near the store: a holder whose round trip to it
    /// is [`FAR_MS`] or more keeps leasing (another region's every request would wait a
    /// round trip), and while the limit is spent refuses from its lease what the lease
    /// cannot serve.
    #[must_use]
    pub fn floor(mut self, floor: f64) -> Self {
        self.floor = floor.clamp(0.0, 1.0);
        self
    }
}

/// What a leased limit did in this process: grants, returns, answers from the lease, direct
/// takes, and tokens held now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LeaseStats {
    /// Grants received (renewals included).
    pub grants: u64,
    /// Leases returned (near the limit, or by `release_leases`).
    pub returns: u64,
    /// Requests answered from a lease, with no store call.
    pub local: u64,
    /// Requests sent to the store as direct takes.
    pub direct: u64,
    /// Requests refused from the lease, with no store call: the key is leased from a store
    /// far away ([`FAR_MS`] or more), the limit was spent, and the lease could not serve
    /// them.
    pub refused: u64,
    /// Requests that found the lease spent and waited for the next one, on its way (a round
    /// trip at most), before their answer: the latency leases add.
    pub waited: u64,
    /// The round trip of a grant request, in milliseconds (a moving average; NaN before the
    /// first reply).
    pub round_trip: f64,
    /// Tokens held now.
    pub held: f64,
    /// Tokens the store counted out to the key's other holders (other processes) at this
    /// process's last grant: what the rest of the fleet held then.
    pub elsewhere: f64,
    /// Holders of the key at the store at the last grant, this process's included (0
    /// before a grant).
    pub holders: u64,
}

/// The leased limits of a store and their holders in this process.
pub(crate) struct Leases {
    names: HashMap<String, Named>,
    /// How often each key was taken in the current term, for the keys without an entry: a
    /// count-min sketch of two rows of [`HEAT_SLOTS`] counters, by two parts of the hash of
    /// (name, key), each counter the term's number (high 32 bits) and its count; a key's
    /// count is the smaller of its two. Keys that share both counters add up: a cold key
    /// may be leased early, never a hot one late. (One row of 4,096 leased a tenth of
    /// 10,000 keys taken evenly at 3 a second each, by their neighbours' takes.)
    heat: Box<[AtomicU64]>,
    /// A random number of this process's, from which each entry's holder id is drawn.
    id: u64,
    /// The holder's clock: milliseconds since this, unless the store runs on a test's clock.
    started: Instant,
    /// The entries by a hash of (name, key), copied on insert (a lookup takes no lock).
    entries: ArcSwap<Entries>,
    hasher: foldhash::fast::RandomState,
    inserting: parking_lot::Mutex<()>,
    /// How many entries there are (at most [`MOST_HELD`]).
    held_keys: AtomicUsize,
    /// Entries made so far (each entry's holder id comes from it).
    made: AtomicU64,
    /// When idle entries were last looked for (the bits of an `f64`, on the holder's clock).
    swept_at: AtomicU64,
    /// Per name: when this process next says its config to the store, and when it last
    /// warned of another's (on the holder's clock).
    announced: parking_lot::Mutex<HashMap<Box<str>, (f64, f64)>>,
}

type Entries = HashMap<u64, Vec<Arc<Entry>>>;

/// Counters of each row of [`Leases::heat`] (two rows of 16,384: 256 KiB a leasing store).
const HEAT_SLOTS: usize = 16_384;

/// A leased name in this process: its options, and the takes of its keys that no lease
/// served because the key was not hot (or no entry was left), sent as an unleased limit's.
struct Named {
    options: LeaseOptions,
    cold: AtomicU64,
}

/// One leased (name, key) in this process.
struct Entry {
    holder: Holder,
    /// Its holder id at the store (below 2^53): its own, so that an entry given back while
    /// idle (see [`Leases::entry`]) and one made again for the same key never share a
    /// record.
    id: u64,
    /// Given back: it asks for no more leases (a request that found it before it went still
    /// takes directly).
    retired: AtomicBool,
    /// Requests it answered (from the lease or directly) when idleness was last noted, and
    /// when that was (the bits of an `f64`, on the holder's clock; first, when it was made,
    /// with the take that made it).
    seen: AtomicU64,
    seen_at: AtomicU64,
    /// When it was made, on the holder's clock: its first lease is sized from the demand
    /// since then.
    made_at: f64,
    name: Box<str>,
    key: Option<Box<str>>,
    config: Config,
    alignment: f64,
    options: LeaseOptions,
    /// Near the limit: no leases until it has room again.
    near: AtomicBool,
    /// Tokens taken directly since the last request for a lease (the bits of an `f64`);
    /// with what was spent from the lease ([`Holder::spent`]), the next lease's size.
    spent: AtomicU64,
    grants: AtomicU64,
    returns: AtomicU64,
    local: AtomicU64,
    direct: AtomicU64,
    refused: AtomicU64,
    waited: AtomicU64,
    /// The store's round trip as this entry saw it (ms, the bits of an `f64`): a moving
    /// average of its grant requests and direct takes, NaN before the first.
    round_trip: AtomicU64,
    /// The last grant gave less than this process's demand asked for (or a direct take found
    /// the store empty). Far from the store, a take the lease cannot serve is then refused
    /// from here.
    short: AtomicBool,
    /// The last grant request (or direct take) failed. Far from the store, a take the lease
    /// cannot serve then fails at once (the limit's failure policy answers it) until a grant
    /// comes again.
    failing: AtomicBool,
    /// Holders of the key at the store, and the value it had left (the bits of an `f64`),
    /// at the last grant: a lease is sized to this process's share of the rate, and of what
    /// the others left (see [`fetch_if_low`]).
    holders: AtomicU64,
    left: AtomicU64,
    /// The tokens the store counted out to the key's other holders at the last grant (the
    /// bits of an `f64`): what the rest of the fleet held then.
    elsewhere: AtomicU64,
    /// A take of it is on its way to the store while its round trip is not known yet (the
    /// key's first), and told when it is back: the takes that come meanwhile wait for it
    /// rather than each go to the store (a region 150 ms away sent the store some 600
    /// direct takes a server that way, each waiting a round trip).
    probing: AtomicBool,
    probed: tokio::sync::Notify,
    /// Told when a grant request's answer (or failure) has come in, and again when its
    /// request is done with (`asking` back to 0).
    arrived: tokio::sync::Notify,
    /// Grant requests on their way, from the ask until a grant dropped on arrival is given
    /// back: [`release_all`] waits for them, and no other ask starts meanwhile.
    asking: AtomicUsize,
}

impl Entry {
    fn slot(&self) -> Slot<'_> {
        Slot {
            name: &self.name,
            key: self.key.as_deref(),
            shard: 0,
            config: self.config,
            alignment: self.alignment,
        }
    }

    /// Whether it has cooled: fewer than `hot_after` requests (none, with `hot_after(1)`:
    /// see [`LeaseOptions::hot_after`]) since the last look, at least two terms before `now`,
    /// and no lease on its way. A look two terms or more after the last notes what it saw.
    fn idle(&self, now: f64) -> bool {
        let answered = self.local.load(Ordering::Relaxed)
            + self.direct.load(Ordering::Relaxed)
            + self.refused.load(Ordering::Relaxed);
        let window = 2.0 * self.options.term.as_secs_f64() * 1e3;
        if now - f64::from_bits(self.seen_at.load(Ordering::Relaxed)) < window {
            return false;
        }
        let counted = answered.saturating_sub(self.seen.load(Ordering::Relaxed));
        // Not waiting for its lease to end: each take past half a term renews it, so a key
        // taken once a term would never be given back. What it holds is spent until then by
        // the takes that found it, and stays out at the store until it expires (fewer
        // admitted meanwhile, never more).
        if counted < u64::from(self.options.hot_after)
            && !self.holder.fetching()
            && self.asking.load(Ordering::Acquire) == 0
        {
            return true;
        }
        self.seen.store(answered, Ordering::Relaxed);
        self.seen_at.store(now.to_bits(), Ordering::Relaxed);
        false
    }

    /// The store's round trip as seen from here, in ms (NaN before the first).
    fn round_trip(&self) -> f64 {
        f64::from_bits(self.round_trip.load(Ordering::Relaxed))
    }

    /// Notes a round trip of `ms`: a moving average, a quarter of it the newest.
    fn saw_round_trip(&self, ms: f64) {
        let _ = self.round_trip.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            let was = f64::from_bits(bits);
            Some(if was.is_nan() { ms } else { 0.75 * was + 0.25 * ms }.to_bits())
        });
    }

    /// Far from its store: a round trip of [`FAR_MS`] or more. A direct take costs a request
    /// that much waiting, so near the limit such an entry keeps leasing rather than take
    /// every request directly (see [`LeaseOptions::floor`]).
    fn far(&self) -> bool {
        self.round_trip() >= FAR_MS
    }

    /// Whether a take it cannot serve is refused here rather than sent to the store: its
    /// last grant fell short of its demand (the limit spent, or its room leased out to the
    /// others), and it is a token bucket (a fixed window's refusal waits for its window's
    /// end, which the store knows).
    fn refuses_here(&self) -> bool {
        self.short.load(Ordering::Acquire)
            && self.config.kind() == tollgate_algebra::Kind::TokenBucket
    }

    fn spend(&self, count: f64) {
        let _ = self.spent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
            Some((f64::from_bits(bits) + count).to_bits())
        });
    }
}

impl Leases {
    pub(crate) fn new(names: HashMap<String, LeaseOptions>) -> Option<Leases> {
        if names.is_empty() {
            return None;
        }
        // Random enough to tell processes apart; below 2^53 so that Lua keeps it exactly.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        let id = tollgate_algebra::splitmix64(seed) >> 11;
        let names = names
            .into_iter()
            .map(|(name, options)| (name, Named { options, cold: AtomicU64::new(0) }))
            .collect();
        Some(Leases {
            names,
            heat: (0..2 * HEAT_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            id,
            started: Instant::now(),
            entries: ArcSwap::from_pointee(HashMap::new()),
            hasher: foldhash::fast::RandomState::default(),
            inserting: parking_lot::Mutex::new(()),
            held_keys: AtomicUsize::new(0),
            made: AtomicU64::new(0),
            swept_at: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
            announced: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn is_leased(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// The entry of `slot`'s (name, key), made if the key is hot (taken `hot_after` times
    /// within a term) and there is room (at most [`MOST_HELD`] in a store). On the way, at
    /// most once a second, the entries that cooled (fewer than `hot_after` requests over two
    /// terms, none on its way) are given back ([`Leases::sweep`]), so that
    /// a key hot once is not leased at a cold key's pace, and keys that stopped coming make
    /// room for those that come now. `now` is the holder's clock, read only on a miss.
    fn entry(&self, slot: &Slot<'_>, now: impl Fn() -> f64) -> Option<Arc<Entry>> {
        let hash = self.hash(slot.name, slot.key);
        if let Some(entry) = Self::find(&self.entries.load(), hash, slot.name, slot.key) {
            return Some(entry);
        }
        let named = &self.names[slot.name];
        let now = now();
        // Full: no lock, no count, for each request of the keys left out, until a sweep
        // makes room (the count is the cold path's largest cost: about 3% of a server's time
        // on 10,000 uniform keys, by perf, before it was skipped here).
        if self.held_keys.load(Ordering::Acquire) >= MOST_HELD && !self.sweep(now) {
            return None;
        }
        if !self.heated(hash, &named.options, now) {
            // Keys that cooled give their entries back (at most one look a second), so that
            // a key hot once is not leased for ever at a cold key's pace.
            if self.held_keys.load(Ordering::Relaxed) > 0 {
                self.sweep(now);
            }
            return None;
        }
        let _inserting = self.inserting.lock();
        let map = self.entries.load_full();
        if let Some(entry) = Self::find(&map, hash, slot.name, slot.key) {
            return Some(entry);
        }
        if self.held_keys.load(Ordering::Acquire) >= MOST_HELD {
            return None;
        }
        let made = self.made.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry {
            id: tollgate_algebra::splitmix64(self.id ^ made.rotate_left(29)) >> 11,
            retired: AtomicBool::new(false),
            // The take that makes it is counted (from the lease or directly), and is not one
            // of those that keep it.
            seen: AtomicU64::new(1),
            seen_at: AtomicU64::new(now.to_bits()),
            made_at: now,
            holder: Holder::new(MARGIN_MS),
            name: slot.name.into(),
            key: slot.key.map(Into::into),
            config: slot.config,
            alignment: slot.alignment,
            options: self.names[slot.name].options,
            near: AtomicBool::new(false),
            spent: AtomicU64::new(0f64.to_bits()),
            grants: AtomicU64::new(0),
            returns: AtomicU64::new(0),
            local: AtomicU64::new(0),
            direct: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            round_trip: AtomicU64::new(f64::NAN.to_bits()),
            short: AtomicBool::new(false),
            failing: AtomicBool::new(false),
            holders: AtomicU64::new(1),
            left: AtomicU64::new(f64::INFINITY.to_bits()),
            elsewhere: AtomicU64::new(0f64.to_bits()),
            probing: AtomicBool::new(false),
            probed: tokio::sync::Notify::new(),
            arrived: tokio::sync::Notify::new(),
            asking: AtomicUsize::new(0),
        });
        let mut next = (*map).clone();
        next.entry(hash).or_default().push(Arc::clone(&entry));
        self.entries.store(Arc::new(next));
        self.held_keys.fetch_add(1, Ordering::AcqRel);
        Some(entry)
    }

    fn hash(&self, name: &str, key: Option<&str>) -> u64 {
        self.hasher.hash_one((name, key))
    }

    /// Counts a take of the key of `hash` at `now`: whether it has come `hot_after` times
    /// within this term (the term's number on the holder's clock).
    fn heated(&self, hash: u64, options: &LeaseOptions, now: f64) -> bool {
        if options.hot_after <= 1 {
            return true;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let term = (now / (options.term.as_secs_f64() * 1e3)) as u64 & u64::from(u32::MAX);
        // A load and a store, not a read-modify-write (whose locked instruction each cold
        // take paid): two takes of one counter at once may count once, which a sketch that
        // counts approximately anyway allows (a key a little slower to be found hot).
        let bump = |counter: &AtomicU64| {
            let was = counter.load(Ordering::Relaxed);
            let count = if was >> 32 == term { (was & u64::from(u32::MAX)) + 1 } else { 1 };
            counter.store(term << 32 | count.min(u64::from(u32::MAX)), Ordering::Relaxed);
            count
        };
        #[allow(clippy::cast_possible_truncation)]
        let (a, b) = ((hash as usize) % HEAT_SLOTS, ((hash >> 32) as usize) % HEAT_SLOTS);
        let count = bump(&self.heat[a]).min(bump(&self.heat[HEAT_SLOTS + b]));
        count >= u64::from(options.hot_after)
    }

    /// Counts a take of `name` that no lease served (a cold key, or no entry left).
    fn cold(&self, name: &str) {
        if let Some(named) = self.names.get(name) {
            named.cold.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Gives back the entries idle at `now` (at most once a second): whether any went (see
    /// [`Entry::idle`]). It asks for nothing more; its record at the store, under its own
    /// holder id, expires there.
    fn sweep(&self, now: f64) -> bool {
        let last = f64::from_bits(self.swept_at.load(Ordering::Acquire));
        if now - last < 1_000.0 {
            return false;
        }
        let _inserting = self.inserting.lock();
        self.swept_at.store(now.to_bits(), Ordering::Release);
        let map = self.entries.load_full();
        let mut kept: Entries = HashMap::with_capacity(map.len());
        let mut gone = 0;
        for (hash, entries) in map.iter() {
            for entry in entries {
                if entry.idle(now) {
                    entry.retired.store(true, Ordering::Release);
                    gone += 1;
                } else {
                    kept.entry(*hash).or_default().push(Arc::clone(entry));
                }
            }
        }
        if gone > 0 {
            self.entries.store(Arc::new(kept));
            self.held_keys.fetch_sub(gone, Ordering::AcqRel);
        }
        gone > 0
    }

    /// The entry of (name, key) in `map`: found by the hash and compared, with no
    /// allocation on the way.
    fn lookup(&self, map: &Entries, name: &str, key: Option<&str>) -> Option<Arc<Entry>> {
        Self::find(map, self.hash(name, key), name, key)
    }

    fn find(map: &Entries, hash: u64, name: &str, key: Option<&str>) -> Option<Arc<Entry>> {
        let entries = map.get(&hash)?;
        entries.iter().find(|e| &*e.name == name && e.key.as_deref() == key).map(Arc::clone)
    }

    fn all(&self) -> Vec<Arc<Entry>> {
        self.entries.load().values().flatten().map(Arc::clone).collect()
    }

    /// The holder's clock: the store's test clock if it runs on one, else milliseconds
    /// since the store was made.
    fn now<S: LeaseStore>(&self, store: &S) -> f64 {
        store.clock_now().unwrap_or_else(|| self.started.elapsed().as_secs_f64() * 1e3)
    }
}

/// The most (name, key) pairs a store leases for: past it, a leased limit's other keys are
/// direct takes (exact; only not from a lease).
pub(crate) const MOST_HELD: usize = 1_024;

/// Milliseconds a holder's deadline keeps before its lease's end, besides the drift.
const MARGIN_MS: f64 = 5.0;

/// A store this many milliseconds away or more (a round trip, as a leased key's holder
/// measures it) is far: another region. Near the limit, a key leased from near takes every
/// request directly, exact as unleased, at the cost of a round trip each (a millisecond in
/// one region); one leased from far keeps leasing, in leases sized to its demand over the
/// round trip, and while the limit is spent (its last grant gave less than its demand
/// asked for) refuses from its lease what the lease cannot serve, with no store call and no
/// wait: a region 75 ms away would otherwise wait 150 ms for each refusal, and send the
/// store every request of a saturated limit.
pub const FAR_MS: f64 = 5.0;

/// Returns what `entry` holds (the holder stops spending it at once).
async fn release<S: LeaseStore>(store: &S, leases: &Leases, entry: &Entry) {
    let unused = entry.holder.release(leases.now(store));
    if step(store, &entry.slot(), Step::Release { holder: entry.id, unused }).await.is_ok() {
        entry.returns.fetch_add(1, Ordering::Relaxed);
    }
}

/// A take from a leased limit: from this process's lease if it holds enough, else a direct
/// take (as a lease step, a cold key's too); either way the next lease is fetched in the
/// background when this one runs low (one request on its way at a time).
///
/// What needs no waiting is decided when it is called (see [`take_if_leased`]), and a take
/// the lease serves is a ready future: the part that may wait (for the next lease, or on the
/// store) is a future of its own, made only when it is needed. As one future it held the
/// store's request inline, and each take from a lease allocated and copied all of it (a
/// sixth of a take from a lease in Node, by `perf`).
pub(crate) fn take<'a, S: LeaseStore>(
    store: &'a Arc<S>,
    leases: &'a Leases,
    one: &'a OneTake<'_>,
) -> BoxFuture<'a, Taken> {
    take_if_leased(store, leases, one).unwrap_or_else(|| Box::pin(direct_take(&**store, one)))
}

/// [`take`] for a store whose plain take is cheaper than a direct take as a lease step
/// (Redis: its one-take script, against the lease script): `None` when the key is cold (not
/// hot, a check, or no entry left), and the caller sends the take as an unleased limit's. If
/// the store answers that the state holds leases (another process leases the key, or this
/// one did until it cooled), the caller sends it again by [`direct_take`].
pub(crate) fn take_if_leased<'a, S: LeaseStore>(
    store: &'a Arc<S>,
    leases: &'a Leases,
    one: &'a OneTake<'_>,
) -> Option<BoxFuture<'a, Taken>> {
    match at_once(store, leases, one) {
        Ok(answer) => Some(Box::pin(std::future::ready(answer))),
        Err(None) => {
            leases.cold(one.slot.name);
            None
        }
        Err(Some(entry)) => Some(Box::pin(take_waiting(store, leases, one, entry))),
    }
}

/// A take of a leased limit as a lease step, served by no lease (see [`take_if_leased`]).
pub(crate) async fn direct_take<S: LeaseStore>(
    store: &S,
    one: &OneTake<'_>,
) -> Result<Taken, StoreError> {
    direct(store, one).await.map(|(taken, _)| taken)
}

/// What a leased take is answered without waiting: a refusal of a calendar window, or a take
/// served from the lease; else (`Err`) the entry whose lease did not serve it, if any.
fn at_once<S: LeaseStore>(
    store: &Arc<S>,
    leases: &Leases,
    one: &OneTake<'_>,
) -> Result<Result<Taken, StoreError>, Option<Arc<Entry>>> {
    if one.slot.config.calendar().is_some() {
        return Ok(Err(StoreError::new(format!(
            "{}: {:?} is leased, and leases do not serve calendar windows yet; nothing taken",
            S::NAME,
            one.slot.name
        ))));
    }
    // A check takes nothing: no lease, no entry (a read token's checks on many keys once
    // filled every entry, and their leases were granted for nothing).
    if !one.writes {
        return Err(None);
    }
    let Some(entry) = leases.entry(&one.slot, || leases.now(&**store)) else {
        return Err(None);
    };
    let mut now = f64::NAN;
    let read = || {
        now = leases.now(&**store);
        now
    };
    if !one.reserve && entry.holder.try_take(one.count, read) {
        return Ok(Ok(served(store, &entry, now)));
    }
    // Far from the store, or not reached yet (a process started while its store does not
    // answer: the key's first take failed), a take the lease cannot serve fails at once while
    // the last request to the store got no answer, and asks for a lease again: it would
    // wait a round trip or a timeout for what its store most likely cannot give.
    if !one.reserve
        && entry.failing.load(Ordering::Acquire)
        && (entry.far() || entry.round_trip().is_nan())
    {
        if now.is_nan() {
            now = leases.now(&**store);
        }
        fetch_if_low_at(store, &entry, now);
        return Ok(Err(StoreError::new(format!(
            "{}: the last request to the store for {:?} got no answer; this process serves \
             it from its lease until the store answers again, and its lease is spent",
            S::NAME,
            one.slot.name
        ))));
    }
    if !one.reserve && entry.far() {
        // While its last grant gave less than its demand asked for (the limit is spent, or
        // this process has its part of it), a request it cannot serve is refused here; one
        // that outran a lease the store gave in full waits for the next, on its way (a fixed
        // window's refusal waits for its window's end, which the store knows: it goes there).
        if entry.refuses_here() && (entry.holder.since().is_finite() || entry.holder.fetching()) {
            if now.is_nan() {
                now = leases.now(&**store);
            }
            return Ok(Ok(refused_here(store, &entry, one.count, now)));
        }
    }
    Err(Some(entry))
}

/// A refusal from `entry`'s lease at `now`, with no store call (see [`FAR_MS`]): the next
/// lease is asked for (sized by this demand too), and the wait is what the shared bucket,
/// empty, would say (the time its rate takes to bring `count`). Fewer admitted than one
/// shared bucket would only while tokens wait at the store, in other holders' leases or on
/// their way here; never more.
fn refused_here<S: LeaseStore>(store: &Arc<S>, entry: &Arc<Entry>, count: f64, now: f64) -> Taken {
    entry.refused.fetch_add(1, Ordering::Relaxed);
    entry.spend(count);
    fetch_if_low_at(store, entry, now);
    let per_token = entry.config.period() / entry.config.rate();
    Taken {
        decision: Decision { ok: false, retry_after: Some(count * per_token) },
        status: Status { remaining: 0.0, reset_after: entry.config.capacity() * per_token },
    }
}

/// The answer of a take `entry`'s lease served at `now` (the holder's clock, read once).
fn served<S: LeaseStore>(store: &Arc<S>, entry: &Arc<Entry>, now: f64) -> Taken {
    entry.local.fetch_add(1, Ordering::Relaxed);
    fetch_if_low_at(store, entry, now);
    let status = Status { remaining: entry.holder.held(), reset_after: 0.0 };
    Taken { decision: Decision { ok: true, retry_after: None }, status }
}

/// The rest of [`take`] for a key with an entry, after [`at_once`] did not answer: while the
/// key's first take to the store is on its way (its round trip not known yet), the others
/// wait for it; then the next lease awaited if the take is one a lease serves (rather than a
/// direct take: when demand outruns a lease, every request would go to the store
/// meanwhile), else a direct take that counts against the lease's cap.
async fn take_waiting<S: LeaseStore>(
    store: &Arc<S>,
    leases: &Leases,
    one: &OneTake<'_>,
    entry: Arc<Entry>,
) -> Result<Taken, StoreError> {
    let mut probe = None;
    if !one.reserve && entry.round_trip().is_nan() {
        if entry.probing.swap(true, Ordering::AcqRel) {
            // Another take measures the round trip: wait for it (at most half a term), then
            // decide as any take (served, refused here far from the store, or on below).
            entry.spend(one.count);
            let probed = entry.probed.notified();
            tokio::pin!(probed);
            probed.as_mut().enable();
            if entry.probing.load(Ordering::Acquire) {
                let _ = tokio::time::timeout(entry.options.term / 2, probed).await;
            }
            if let Ok(answer) = at_once(store, leases, one) {
                return answer;
            }
        } else {
            probe = Some(Probing(&entry));
        }
    }
    let answer = take_served_or_direct(store, leases, one, &entry).await;
    drop(probe);
    answer
}

/// The take that measures a fresh entry's round trip: when it is done (or dropped, its
/// request cancelled), the takes waiting for it are told.
struct Probing<'a>(&'a Entry);

impl Drop for Probing<'_> {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
        self.0.probed.notify_waiters();
    }
}

/// [`take_waiting`] once no probe is awaited.
async fn take_served_or_direct<S: LeaseStore>(
    store: &Arc<S>,
    leases: &Leases,
    one: &OneTake<'_>,
    entry: &Arc<Entry>,
) -> Result<Taken, StoreError> {
    let entry = Arc::clone(entry);
    if !one.reserve
        && awaited(&entry, one.count).await
        && entry.holder.try_take(one.count, || leases.now(&**store))
    {
        return Ok(served(store, &entry, leases.now(&**store)));
    }
    // The lease it waited for fell short (the limit spent, or its room leased out to the
    // others): far from the store, refused here as any take then (see `at_once`).
    if !one.reserve && entry.far() && entry.refuses_here() {
        return Ok(refused_here(store, &entry, one.count, leases.now(&**store)));
    }
    entry.direct.fetch_add(1, Ordering::Relaxed);
    let sent = leases.now(&**store);
    let (taken, value) = match direct(&**store, one).await {
        Ok(answer) => answer,
        Err(e) => {
            entry.failing.store(true, Ordering::Release);
            return Err(e);
        }
    };
    entry.saw_round_trip(leases.now(&**store) - sent);
    entry.failing.store(false, Ordering::Release);
    entry.short.store(value < 1.0, Ordering::Release);
    entry.left.store(value.max(0.0).to_bits(), Ordering::Release);
    if taken.decision.ok && one.writes {
        entry.spend(one.count);
    }
    let floor = entry.options.floor * entry.config.capacity();
    if entry.far() {
        // Far from the store: no direct takes near the limit (see `FAR_MS`).
        entry.near.store(false, Ordering::Release);
        fetch_if_low(store, leases, &entry);
    } else if value < floor {
        if !entry.near.swap(true, Ordering::AcqRel) {
            let (store, entry) = (Arc::clone(store), Arc::clone(&entry));
            tokio::spawn(async move {
                if let Some(leases) = store.leases() {
                    release(&*store, leases, &entry).await;
                }
            });
        }
    } else if value >= 2.0 * floor {
        entry.near.store(false, Ordering::Release);
        fetch_if_low(store, leases, &entry);
    }
    Ok(taken)
}

/// Waits for the grant request on its way, if one is (at most half a lease's term): whether
/// one was. A take of `count` that waits is demand the lease did not meet, and counts toward
/// the next lease's size: uncounted, a server whose takes outran its lease asked for what it
/// had spent, was given that in full (so it did not refuse from here), and its requests
/// waited a round trip each time (150 ms away, such a server answered 0.3-0.6x what it
/// answers on a memory store). Served from the lease it waited for, the take counts twice
/// (here, and as spent from that lease): the next lease is asked a little larger, within
/// the same share.
async fn awaited(entry: &Entry, count: f64) -> bool {
    let arrived = entry.arrived.notified();
    tokio::pin!(arrived);
    arrived.as_mut().enable();
    if !entry.holder.fetching() || entry.near.load(Ordering::Acquire) {
        return false;
    }
    entry.spend(count);
    entry.waited.fetch_add(1, Ordering::Relaxed);
    let most = entry.options.term / 2;
    tokio::time::timeout(most, arrived).await.is_ok()
}

/// Asks for the next lease in the background if the one held is below half of what was
/// spent since the last ask, or past half its length (a renewal, before it runs out), and
/// the limit is not near its bound.
fn fetch_if_low<S: LeaseStore>(store: &Arc<S>, leases: &Leases, entry: &Arc<Entry>) {
    fetch_if_low_at(store, entry, leases.now(&**store));
}

/// [`fetch_if_low`] at `now`, the holder's clock read by the caller.
fn fetch_if_low_at<S: LeaseStore>(store: &Arc<S>, entry: &Arc<Entry>, now: f64) {
    if entry.near.load(Ordering::Acquire)
        || entry.retired.load(Ordering::Acquire)
        || entry.asking.load(Ordering::Acquire) > 0
    {
        return;
    }
    let spent = entry.holder.spent() + f64::from_bits(entry.spent.load(Ordering::Acquire));
    let held = entry.holder.held();
    // What is spent a millisecond, since the lease in use was asked for; and the round trip
    // (0 before the first): a lease that would run out before the next one can come is
    // renewed now.
    let since = entry.holder.since();
    let since = if since.is_finite() { since } else { entry.made_at };
    let per_ms = spent / (now - since).max(1.0);
    let trip = entry.round_trip();
    let trip = if trip.is_nan() { 0.0 } else { trip };
    if held > spent / 2.0
        && held > 2.0 * trip * per_ms
        && held > 0.0
        && now < entry.holder.renew_at()
    {
        return;
    }
    let Some(asked) = entry.holder.ask(now) else { return };
    // A sweep that found the entry idle before this ask retired it: its lease would be held
    // where no take finds it (a sweep that looked just before the ask and retires just after
    // still strands one until it expires: fewer admitted meanwhile, never more).
    if entry.retired.load(Ordering::Acquire) {
        entry.holder.failed();
        // A take that saw this ask on its way waits for word of it (`awaited`).
        entry.arrived.notify_waiters();
        return;
    }
    // Sized from demand: twice what was asked for since the last ask (spent from the lease,
    // taken directly, refused here), and at least what is asked for over three round trips
    // at that pace (the store gives no more than the share allows, nor than it has). But no
    // more than this process's part of what the rate brings until its next lease (the time
    // since the last ask, or a round trip), among the holders at the last grant, and its
    // part of what was left then beyond the floor (`LeaseOptions::floor`): holders that ask
    // more often (nearer the store) would otherwise take all that flowed in each time, and
    // one far away would get what the near ones left. Under the floor, what the store holds
    // is what flows in for the holders still to ask; above it, what some holder did not want,
    // which the others take, a part at each ask.
    let direct = f64::from_bits(entry.spent.swap(0f64.to_bits(), Ordering::AcqRel));
    let demand = (2.0 * (entry.holder.spent() + direct)).max(3.0 * trip * per_ms).max(1.0);
    let horizon = (now - since).max(trip);
    #[allow(clippy::cast_precision_loss)]
    let holders = entry.holders.load(Ordering::Acquire).max(1) as f64;
    let part = entry.config.rate() / entry.config.period() * horizon / holders;
    let left = f64::from_bits(entry.left.load(Ordering::Acquire));
    let surplus = (left - entry.options.floor * entry.config.capacity()).max(0.0);
    let want = demand.min(part + surplus / holders).max(1.0);
    let (store, entry, id) = (Arc::clone(store), Arc::clone(entry), entry.id);
    entry.asking.fetch_add(1, Ordering::AcqRel);
    tokio::spawn(async move {
        let term = entry.options.term.as_secs_f64() * 1e3;
        let grant = Step::Grant {
            holder: id,
            want,
            unused: asked.unused,
            term,
            share: entry.options.share,
        };
        let Ok((Answer::Granted(grant), store_now, after)) =
            step(&*store, &entry.slot(), grant).await
        else {
            entry.failing.store(true, Ordering::Release);
            entry.holder.failed();
            entry.asking.fetch_sub(1, Ordering::AcqRel);
            entry.arrived.notify_waiters();
            return;
        };
        entry.grants.fetch_add(1, Ordering::Relaxed);
        if let Some(leases) = store.leases() {
            entry.saw_round_trip(leases.now(&*store) - asked.sent);
        }
        let left = after.state.map_or(entry.config.capacity(), |s| s.value);
        entry.failing.store(false, Ordering::Release);
        entry.short.store(grant.tokens < demand, Ordering::Release);
        entry.left.store(left.max(0.0).to_bits(), Ordering::Release);
        entry.holders.store(after.leases.len() as u64, Ordering::Release);
        let elsewhere: f64 = after
            .leases
            .iter()
            .filter(|(holder, lease)| *holder != id && lease.expiry > store_now)
            .map(|(_, lease)| lease.tokens)
            .sum();
        // Tokens are never negative: `abs` makes an empty sum (-0) read 0 (`/metrics` said -0).
        entry.elsewhere.store(elsewhere.abs().to_bits(), Ordering::Release);
        let kept = entry.holder.granted(asked, grant, store_now);
        if !kept {
            // The lease was given back while this grant was on its way (a limit near its
            // bound, a reset): the holder drops it, so its new tokens go back, or the store
            // would count them out until they expire. Not `kept`: that is what the holder
            // had left when it asked, and it went on spending it until its own give-back,
            // which returns what was left then; were this one to land first, it would
            // return tokens already spent. If the store saw the holder's give-back after
            // the grant, no record is left and this is nothing (fewer admitted, never
            // more). No ask starts until this is done (`asking`): a give-back landing after
            // a newer grant would return tokens the holder still spends.
            let unused = grant.tokens;
            let _ = step(&*store, &entry.slot(), Step::Release { holder: id, unused }).await;
        }
        entry.asking.fetch_sub(1, Ordering::AcqRel);
        entry.arrived.notify_waiters();
        if !kept {
            return;
        }
        if let Some(leases) = store.leases() {
            announce(&*store, leases, &entry).await;
        }
        if left < entry.options.floor * entry.config.capacity()
            && !entry.far()
            && !entry.near.swap(true, Ordering::AcqRel)
            && let Some(leases) = store.leases()
        {
            release(&*store, leases, &entry).await;
        }
    });
}

/// A leased limit's config in words, as processes say it to each other through the store:
/// two that lease one name under different configs mix their leases and takes, so that
/// neither's limit holds.
fn said(config: &Config) -> String {
    use tollgate_algebra::fmt_number;
    format!(
        "{} of {} per {} ms, capacity {}",
        config.kind(),
        fmt_number(config.rate()),
        fmt_number(config.period()),
        fmt_number(config.capacity())
    )
}

/// Says `entry`'s config to the store, at most once a term for its name, and warns (at most
/// once a minute) when another process said another for it within three terms.
async fn announce<S: LeaseStore>(store: &S, leases: &Leases, entry: &Entry) {
    let now = leases.now(store);
    let term = entry.options.term;
    {
        let mut announced = leases.announced.lock();
        let (next, _) =
            announced.entry(entry.name.clone()).or_insert((f64::NEG_INFINITY, f64::NEG_INFINITY));
        if now < *next {
            return;
        }
        *next = now + term.as_secs_f64() * 1e3;
    }
    let ours = said(&entry.config);
    let Ok(Some(theirs)) = store.announce(&entry.name, &ours, term * 3).await else { return };
    if theirs == ours {
        return;
    }
    let mut announced = leases.announced.lock();
    let Some((_, warned)) = announced.get_mut(&entry.name) else { return };
    if now - *warned < 60_000.0 {
        return;
    }
    *warned = now;
    tracing::warn!(
        limit = &*entry.name,
        "the leased limit {} is leased by another process as a {theirs}, and by this one as a \
         {ours}: their leases and takes mix, and neither limit holds; give every process the \
         same config",
        entry.name
    );
}

/// Returns every lease the store holds (for a graceful shutdown). The grant requests on
/// their way are waited for first (at most a term each): a give-back says what the holder
/// has not spent, and one sent while a grant is on its way cannot count that grant, so the
/// store, seeing the grant first, would count it spent (a first request's lease, lost for
/// good by a close right after it). The first error; the other leases are returned all the
/// same.
pub(crate) async fn release_all<S: LeaseStore>(store: &S) -> Result<(), StoreError> {
    let Some(leases) = store.leases() else { return Ok(()) };
    let mut first = Ok(());
    let entries = leases.all();
    for entry in &entries {
        let _ = tokio::time::timeout(entry.options.term, asked_all(entry)).await;
    }
    for entry in &entries {
        let unused = entry.holder.release(leases.now(store));
        match step(store, &entry.slot(), Step::Release { holder: entry.id, unused }).await {
            Ok(_) => {
                entry.returns.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if first.is_ok() => first = Err(e),
            Err(_) => {}
        }
    }
    first
}

/// Until `entry` has no grant request on its way.
async fn asked_all(entry: &Entry) {
    loop {
        let arrived = entry.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        if entry.asking.load(Ordering::Acquire) == 0 {
            return;
        }
        arrived.await;
    }
}

/// What a leased limit did in this process, over its keys: how many are leased now, and the
/// takes of keys served by no lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeasedName {
    /// The limit's name.
    pub name: String,
    /// Keys with a lease in this process (or one on its way): the hot ones, at most
    /// 1,024 over every leased limit of the store.
    pub keys: usize,
    /// Takes sent to the store as an unleased limit's, for a key not hot enough to lease (see
    /// [`LeaseOptions::hot_after`]), for a check, or with no room left for another key.
    pub cold: u64,
}

/// Per leased name, its keys leased now and its takes no lease served.
pub(crate) fn names(leases: Option<&Leases>) -> Vec<LeasedName> {
    let Some(leases) = leases else { return Vec::new() };
    let entries = leases.all();
    let mut keys: HashMap<&str, usize> = HashMap::new();
    for entry in entries.iter().filter(|e| !e.retired.load(Ordering::Relaxed)) {
        *keys.entry(&entry.name).or_default() += 1;
    }
    let mut out: Vec<LeasedName> = leases
        .names
        .iter()
        .map(|(name, named)| LeasedName {
            name: name.clone(),
            keys: keys.get(name.as_str()).copied().unwrap_or(0),
            cold: named.cold.load(Ordering::Relaxed),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// What each leased (name, key) did in this process.
pub(crate) fn stats(leases: Option<&Leases>) -> Vec<(String, Option<String>, LeaseStats)> {
    let Some(leases) = leases else { return Vec::new() };
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    leases
        .all()
        .iter()
        .map(|e| {
            let stats = LeaseStats {
                grants: load(&e.grants),
                returns: load(&e.returns),
                local: load(&e.local),
                direct: load(&e.direct),
                refused: load(&e.refused),
                waited: load(&e.waited),
                round_trip: e.round_trip(),
                held: e.holder.held(),
                elsewhere: f64::from_bits(e.elsewhere.load(Ordering::Acquire)),
                holders: if load(&e.grants) == 0 { 0 } else { load(&e.holders) },
            };
            (e.name.to_string(), e.key.as_deref().map(str::to_string), stats)
        })
        .collect()
}

/// A reset of a leased (name, key), which needs no config (as any reset): this process's own
/// lease goes back first, then the state is forgotten, its records kept, and starts again as
/// full as the leases out allow (see [`Leased::forget`]).
pub(crate) async fn reset<S: LeaseStore>(
    store: &S,
    leases: &Leases,
    name: &str,
    key: Option<&str>,
) -> Result<(), StoreError> {
    if let Some(entry) = leases.lookup(&leases.entries.load(), name, key) {
        let unused = entry.holder.release(leases.now(store));
        step(store, &entry.slot(), Step::Release { holder: entry.id, unused }).await?;
    }
    // Any config: the step reads none of it.
    let slot = look_slot(name, key, Config::token_bucket(1.0, 1_000.0));
    step(store, &slot, Step::Forget).await.map(drop)
}

/// What the leasing stores' tests share (Redis, PostgreSQL): random steps on one leased shard
/// against `tollgate_algebra`'s model, and several processes on one store checked against the
/// interval bound.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;

    use proptest::prelude::*;
    use tollgate_algebra::{Adjusted, Clock, Config, ManualClock, OneTake, Plan, Slot, Take};

    use super::{Answer, LeaseStats, LeaseStore, Leased, Step};
    use crate::store::seam::AsyncStore;
    use crate::store::testing::writing;

    #[derive(Clone, Copy, Debug)]
    pub(crate) enum Op {
        Wait(f64),
        Step(Step),
        /// A take through the store's plan path (a transaction of one take): the store
        /// refills the leased state under its cap as a direct take does.
        Transaction {
            count: f64,
            reserve: bool,
            writes: bool,
        },
    }

    pub(crate) fn op() -> impl Strategy<Value = Op> {
        let holder = 0..3u64;
        prop_oneof![
            2 => prop_oneof![0.0..300.0f64, 0.0..3_000.0f64].prop_map(Op::Wait),
            3 => (1.0..5.0f64, any::<bool>(), any::<bool>()).prop_map(|(count, reserve, writes)| {
                Op::Step(Step::Take { count: count.floor(), reserve, writes })
            }),
            3 => (holder.clone(), 0.0..30.0f64, 0.0..20.0f64, 50.0..3_000.0f64, prop_oneof![Just(0.5), Just(1.0)])
                .prop_map(|(holder, want, unused, term, share)| {
                    Op::Step(Step::Grant { holder, want: want.floor(), unused: unused.floor(), term, share })
                }),
            1 => (holder, 0.0..20.0f64).prop_map(|(holder, unused)| {
                Op::Step(Step::Release { holder, unused: unused.floor() })
            }),
            1 => Just(Op::Step(Step::Forget)),
            2 => (1.0..5.0f64, any::<bool>(), any::<bool>()).prop_map(|(count, reserve, writes)| {
                Op::Transaction { count: count.floor(), reserve, writes }
            }),
        ]
    }

    /// Runs `op` on the leased shard of `slot` (named `t`) on `store` (whose side that runs
    /// lease steps is `shared`) at `now`, and on the model: the store's answer and the
    /// model's.
    pub(crate) async fn run_op(
        store: &impl AsyncStore,
        shared: &impl LeaseStore,
        model: &mut Leased,
        slot: &Slot<'_>,
        now: f64,
        op: Op,
    ) -> (Answer, Answer) {
        match op {
            Op::Wait(_) => (Answer::Released, Answer::Released),
            Op::Step(step) => {
                let (answer, _, _) = super::step(shared, slot, step).await.unwrap();
                (answer, model_step(model, slot, now, step))
            }
            Op::Transaction { count, reserve, writes } => {
                // A plan refuses a count past the capacity as invalid, before any store.
                let count = count.min(slot.config.capacity());
                let take = Take { name: "t", key: None, config: slot.config, count, reserve };
                let mut plan = Plan::new(writes);
                plan.push(&take, 0, 0).unwrap();
                let ok = store.execute_async(&plan).await.unwrap().ok;
                let step = Step::Take { count, reserve, writes };
                (Answer::Taken(ok), model_step(model, slot, now, step))
            }
        }
    }

    pub(crate) fn config() -> impl Strategy<Value = Config> {
        (any::<bool>(), 1.0..40.0f64, 1.0..3.0f64, prop::option::of(0.0..10.0f64)).prop_map(
            |(bucket, rate, burst, reserved)| {
                let rate = rate.floor();
                let base = if bucket {
                    Config::token_bucket(rate, 1_000.0)
                } else {
                    Config::fixed_window(rate, 1_000.0)
                };
                let config = base.with_capacity((rate * burst).floor());
                match reserved {
                    Some(most) => config.with_max_reserved(most.floor()),
                    None => config,
                }
            },
        )
    }

    /// The most one bucket of `config` admits in `[a, b]` (capacity, inflow, reservations),
    /// its windows starting at `alignment`.
    pub(crate) fn bound(config: &Config, alignment: f64, a: f64, b: f64) -> f64 {
        let window = |t: f64| ((t - alignment) / config.period()).floor();
        let inflow = match config.kind() {
            tollgate_algebra::Kind::TokenBucket => config.rate() * (b - a) / config.period(),
            tollgate_algebra::Kind::FixedWindow => config.rate() * (window(b) - window(a)),
        };
        config.capacity() + config.max_reserved().unwrap_or(0.0) + inflow
    }

    #[derive(Clone, Copy, Debug)]
    pub(crate) enum Act {
        /// Process `p` takes `count`.
        Take { p: usize, count: f64 },
        /// Time passes.
        Wait(f64),
        /// The runtime runs what is ready (background fetches and returns).
        Yield,
        /// Process `p` is killed: its store (and lease) dropped, a new one started.
        Kill { p: usize },
        /// Process `p` returns its leases (a graceful shutdown, then it goes on).
        Release { p: usize },
        /// Process `p` takes `count` of the leased limit and 1 of a plain one in one
        /// transaction (a direct take, under the cap the leases out set).
        Transaction { p: usize, count: f64 },
    }

    pub(crate) fn act() -> impl Strategy<Value = Act> {
        prop_oneof![
            10 => (0..4usize, 1.0..3.0f64).prop_map(|(p, count)| Act::Take { p, count: count.floor() }),
            2 => prop_oneof![0.0..50.0f64, 0.0..1_500.0f64].prop_map(Act::Wait),
            4 => Just(Act::Yield),
            1 => (0..4usize).prop_map(|p| Act::Kill { p }),
            1 => (0..4usize).prop_map(|p| Act::Release { p }),
            2 => (0..4usize, 1.0..3.0f64).prop_map(|(p, count)| Act::Transaction { p, count: count.floor() }),
        ]
    }

    /// What `tollgate_algebra`'s model answers to `step` at `now` (it keeps only what the
    /// store would save: a take that did not write leaves it as it was).
    pub(crate) fn model_step(model: &mut Leased, slot: &Slot<'_>, now: f64, step: Step) -> Answer {
        let (c, a) = (&slot.config, slot.alignment);
        match step {
            Step::Take { count, reserve, writes } => {
                // The store saves only what it changed: the model keeps no more (a refill
                // saved or not may round apart).
                let before = model.clone();
                let ok = model.take(c, a, now, count, reserve, writes).ok;
                if !(ok && writes) {
                    *model = before;
                }
                Answer::Taken(ok)
            }
            Step::Grant { holder, want, unused, term, share } => {
                Answer::Granted(model.grant(c, a, now, holder, want, unused, term, share))
            }
            Step::Release { holder, unused } => {
                // With no record to return the store saves nothing: the model keeps no more.
                let mut advanced = model.clone();
                advanced.advance(c, a, now);
                if advanced.leases.iter().any(|(h, _)| *h == holder) {
                    model.release(c, a, now, holder, unused);
                }
                Answer::Released
            }
            Step::Forget => {
                model.forget();
                Answer::Released
            }
        }
    }

    /// A store that leases, as the processes below use it.
    pub(crate) trait Leasing: AsyncStore {
        fn stats(&self) -> Vec<LeaseStats>;
        fn names(&self) -> Vec<super::LeasedName>;
        async fn release(&self);
    }

    /// The worst interval of `admitted` (time, count) over the bound of `config`: at most 0
    /// when exact.
    pub(crate) fn worst(config: &Config, admitted: &[(f64, f64)]) -> f64 {
        let take = Take { name: "hot", key: None, config: *config, count: 1.0, reserve: false };
        let alignment = writing(&take).slot.alignment;
        let mut worst = f64::NEG_INFINITY;
        for (i, &(a, _)) in admitted.iter().enumerate() {
            let mut sum = 0.0;
            for &(b, count) in &admitted[i..] {
                sum += count;
                worst = worst.max(sum - bound(config, alignment, a, b));
            }
        }
        worst
    }

    /// Four processes, each its own store from `open` (leasing `hot`) on `clock`, run
    /// `acts`: what each admitted (time, count), and how many were answered from leases.
    pub(crate) async fn processes<S: Leasing>(
        clock: &ManualClock,
        config: Config,
        acts: &[Act],
        open: impl AsyncFn() -> S,
    ) -> (Vec<(f64, f64)>, u64) {
        let mut stores = Vec::new();
        for _ in 0..4 {
            stores.push(open().await);
        }
        let take = |count| Take { name: "hot", key: None, config, count, reserve: false };
        let local = |store: &S| store.stats().iter().map(|s| s.local).sum::<u64>();
        let mut admitted = Vec::new();
        let mut answered_locally = 0;
        for act in acts {
            match *act {
                Act::Take { p, count } => {
                    let take = take(count);
                    let one = writing(&take);
                    if stores[p].execute_one_async(&one).await.unwrap().decision.ok {
                        admitted.push((clock.now(), count));
                    }
                }
                Act::Wait(dt) => clock.advance(dt),
                Act::Yield => tokio::time::sleep(Duration::from_millis(1)).await,
                Act::Kill { p } => {
                    answered_locally += local(&stores[p]);
                    stores[p] = open().await;
                }
                Act::Release { p } => stores[p].release().await,
                Act::Transaction { p, count } => {
                    let (hot, plain) = (take(count), plain(1.0));
                    if stores[p].execute_async(&plan(&[&hot, &plain])).await.unwrap().ok {
                        admitted.push((clock.now(), count));
                    }
                }
            }
        }
        answered_locally += stores.iter().map(local).sum::<u64>();
        stores[0].delete_async("hot", None, 1).await.ok();
        stores[0].delete_async("plain", None, 1).await.ok();
        (admitted, answered_locally)
    }

    /// `store`, leasing the limit `hot` (`shared` its side that runs lease steps), on
    /// `clock`, having never taken from it: a reset needs no lease of its own nor a config;
    /// it forgets the state and keeps the records, so the limit starts again as full as the
    /// leases out allow, and whole once they have expired.
    pub(crate) async fn a_reset_needs_no_lease_of_its_own(
        store: &impl AsyncStore,
        shared: &impl LeaseStore,
        clock: &ManualClock,
    ) {
        let (three, six, ten) = (hot(3.0), hot(6.0), hot(10.0));
        let slot = writing(&three).slot;
        // Another holder leases 5 of the 10 for 1 s; 3 are taken directly: 2 left.
        let grant = Step::Grant { holder: 7, want: 5.0, unused: 0.0, term: 1_000.0, share: 1.0 };
        super::step(shared, &slot, grant).await.unwrap();
        assert!(store.execute_async(&plan(&[&three])).await.unwrap().ok);
        store.delete_async("hot", None, 1).await.unwrap();
        let (_, states) = store.read_async(&[slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 5.0, "as full as the lease out allows");
        assert!(!store.execute_async(&plan(&[&six])).await.unwrap().ok, "5 are leased out");
        // The lease expires: the limit is whole again.
        clock.advance(1_000.0);
        assert!(store.execute_async(&plan(&[&ten])).await.unwrap().ok);
    }

    /// `store`, leasing the limit `hot` with the default [`super::HOT_AFTER`] on `clock`:
    /// 300 keys taken once each are cold (no entry, no lease, each take an unleased limit's);
    /// a key taken 16 times within a term is leased from then on; 15 takes in one term and
    /// 15 in the next leave a key cold; a cold key whose state holds another process's lease
    /// is taken under that lease's cap (Redis: its one-take script refuses the state, and
    /// the take goes again as a lease step); a leased key that cools gives its entry back,
    /// though a take a term still renews its lease.
    pub(crate) async fn only_hot_keys_are_leased(
        store: &impl Leasing,
        shared: &impl LeaseStore,
        clock: &ManualClock,
    ) {
        let config = Config::token_bucket(10.0, 1_000.0).with_capacity(100.0);
        let take = |key| Take { name: "hot", key: Some(key), config, count: 1.0, reserve: false };
        let keys: Vec<String> = (0..300).map(|i| format!("cold-{i}")).collect();
        for key in &keys {
            assert!(store.execute_one_async(&writing(&take(key))).await.unwrap().decision.ok);
        }
        let names = store.names();
        assert_eq!((names[0].keys, names[0].cold), (0, 300), "{names:?}");
        assert!(store.stats().is_empty(), "cold keys have no entry");
        let (_, states) = store.read_async(&[writing(&take(&keys[7])).slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 99.0);

        let term = super::LeaseOptions::default().term.as_secs_f64() * 1e3;
        clock.set((crate::store::testing::T0 / term).ceil() * term + term);
        for _ in 0..15 {
            assert!(store.execute_one_async(&writing(&take("warm"))).await.unwrap().decision.ok);
        }
        clock.advance(term);
        for _ in 0..15 {
            assert!(store.execute_one_async(&writing(&take("warm"))).await.unwrap().decision.ok);
        }
        assert_eq!(store.names()[0].keys, 0, "15 takes a term are not hot");
        for _ in 0..20 {
            assert!(store.execute_one_async(&writing(&take("hot"))).await.unwrap().decision.ok);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let names = store.names();
        assert_eq!(names[0].keys, 1, "{names:?}");
        let stats = store.stats();
        assert!(stats[0].grants >= 1, "{stats:?}");

        // Another holder leases 90 of "theirs": a cold take here is taken under their cap.
        let slot = writing(&take("theirs")).slot;
        let grant = Step::Grant { holder: 7, want: 90.0, unused: 0.0, term, share: 1.0 };
        super::step(shared, &slot, grant).await.unwrap();
        for i in 0..10 {
            let ok = store.execute_one_async(&writing(&take("theirs"))).await.unwrap().decision.ok;
            assert!(ok, "take {i} of the 10 left");
        }
        assert!(!store.execute_one_async(&writing(&take("theirs"))).await.unwrap().decision.ok);
        // Taken once a term for three terms (each take past half a term renews its lease),
        // it cooled all the same: the next cold take's look gives its entry back.
        for _ in 0..3 {
            clock.advance(term);
            assert!(store.execute_one_async(&writing(&take("hot"))).await.unwrap().decision.ok);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(store.stats()[0].grants >= 2, "renewed: {:?}", store.stats());
        assert!(store.execute_one_async(&writing(&take(&keys[0]))).await.unwrap().decision.ok);
        assert_eq!(store.names()[0].keys, 0, "the key that cooled gave its entry back");
        store.release().await;
        for key in keys.iter().map(String::as_str).chain(["warm", "hot", "theirs"]) {
            store.delete_async("hot", Some(key), 1).await.unwrap();
        }
    }

    /// `store`, leasing the limit `hot`: a lease given back at once after the take that asked
    /// for it (a close right after a first request) leaves nothing out, on each of 30 keys:
    /// the grant still on its way when the leases were given back goes back when it lands,
    /// before the give-back returns (a Node test once found 3 of 10 still leased).
    pub(crate) async fn a_grant_on_its_way_at_a_release_goes_back(store: &impl Leasing) {
        let config = Config::token_bucket(10.0, 1_000.0);
        for i in 0..30 {
            let key = format!("close-{i}");
            let take = Take { name: "hot", key: Some(&key), config, count: 1.0, reserve: false };
            let one = writing(&take);
            assert!(store.execute_one_async(&one).await.unwrap().decision.ok);
            store.release().await;
            let (_, states) = store.read_async(&[one.slot]).await.unwrap();
            assert_eq!(states[0].unwrap().value, 9.0, "key {i}: a lease is still out");
            store.delete_async("hot", Some(&key), 1).await.unwrap();
        }
    }

    /// `store`, leasing the limit `hot` on `clock` (with the default options: leases of 2 s):
    /// checks take no lease and no entry (1,100 of them on as many keys, as a read token
    /// may send, once filled every entry, and granted leases for nothing); takes on more
    /// keys than [`super::MOST_HELD`] fill the entries, the rest taken directly; once the
    /// keys have been idle for two terms, their entries come back for the keys that come
    /// now.
    pub(crate) async fn checks_take_no_lease_and_idle_keys_make_room(
        store: &impl Leasing,
        clock: &ManualClock,
    ) {
        let config = Config::token_bucket(10.0, 1_000.0);
        let keys: Vec<String> = (0..super::MOST_HELD + 76).map(|i| format!("user-{i}")).collect();
        let take = |key| Take { name: "hot", key: Some(key), config, count: 1.0, reserve: false };
        for key in &keys {
            let check = OneTake { writes: false, ..writing(&take(key)) };
            assert!(store.execute_one_async(&check).await.unwrap().decision.ok);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(store.stats().is_empty(), "checks made entries: {:?}", store.stats().len());
        for key in &keys[..=super::MOST_HELD] {
            assert!(store.execute_one_async(&writing(&take(key))).await.unwrap().decision.ok);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.stats().len(), super::MOST_HELD, "one entry a key, up to the bound");
        assert!(store.stats().iter().any(|s| s.grants > 0));
        // Two terms (and more) without a request: the next key finds room.
        clock.advance(10_000.0);
        let new = &keys[super::MOST_HELD + 1];
        assert!(store.execute_one_async(&writing(&take(new))).await.unwrap().decision.ok);
        let stats = store.stats();
        assert_eq!(stats.len(), 1, "the idle entries went, the new key's came");
        assert_eq!(stats[0].direct + stats[0].local, 1);
        store.release().await;
        for key in &keys {
            store.delete_async("hot", Some(key), 1).await.ok();
        }
    }

    /// A take of `count` from the leased limit of the tests here (10 a second).
    fn hot(count: f64) -> Take<'static> {
        let config = Config::token_bucket(10.0, 1_000.0);
        Take { name: "hot", key: None, config, count, reserve: false }
    }

    /// A take of `count` from the plain (not leased) limit of the transactions here.
    fn plain(count: f64) -> Take<'static> {
        let config = Config::token_bucket(50.0, 1_000.0);
        Take { name: "plain", key: None, config, count, reserve: false }
    }

    /// A transaction of `takes`, all or nothing.
    fn plan<'a>(takes: &[&'a Take<'a>]) -> Plan<'a> {
        let mut plan = Plan::new(true);
        for take in takes {
            plan.push(take, 0, 0).unwrap();
        }
        plan
    }

    /// `store`, leasing the limit `hot` (`shared` is its side that runs lease steps), on
    /// `clock`: a transaction takes the leased limit directly (not from a lease), all or
    /// nothing with the others, and never past what the leases out leave; the records are
    /// kept, and an unreturned lease stops counting at its expiry.
    pub(crate) async fn transaction_takes_a_leased_limit_directly(
        store: &impl AsyncStore,
        shared: &impl LeaseStore,
        clock: &ManualClock,
    ) {
        let (four, six, ten) = (hot(4.0), hot(6.0), hot(10.0));
        let slot = writing(&four).slot;
        // Another holder leases 5 of the 10: 5 left to take directly.
        let grant = Step::Grant { holder: 7, want: 5.0, unused: 0.0, term: 60_000.0, share: 1.0 };
        super::step(shared, &slot, grant).await.unwrap();
        // 4 of hot and 2 of plain, once plain is empty: refused, nothing taken.
        let (all_plain, two_plain) = (plain(50.0), plain(2.0));
        assert!(store.execute_async(&plan(&[&all_plain])).await.unwrap().ok);
        assert!(!store.execute_async(&plan(&[&four, &two_plain])).await.unwrap().ok);
        let (_, states) = store.read_async(&[slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 5.0);
        // A second later the bucket has refilled only to 10 - 5 leased: 6 are refused (a
        // transaction blind to the records would refill to 10 and grant them).
        clock.advance(1_000.0);
        assert!(!store.execute_async(&plan(&[&six])).await.unwrap().ok);
        // 4 of hot with 2 of plain (refilled by now): granted, from the 5 the lease left.
        assert!(store.execute_async(&plan(&[&four, &two_plain])).await.unwrap().ok);
        let (_, states) = store.read_async(&[slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 1.0);
        // 4 more: refused, though the bucket's capacity is 10 (5 are leased out).
        assert!(!store.execute_async(&plan(&[&four])).await.unwrap().ok);
        // The lease record is still there: its 5 come back when it is returned.
        let back = Step::Release { holder: 7, unused: 5.0 };
        super::step(shared, &slot, back).await.unwrap();
        assert!(store.execute_async(&plan(&[&four])).await.unwrap().ok);
        // An unreturned lease stops counting at its expiry: the 2 left are leased for 1 s;
        // 1.2 s later the bucket is full again (under a cap of 8 until the expiry, 10
        // after), and a transaction takes all 10.
        let short = Step::Grant { holder: 8, want: 5.0, unused: 0.0, term: 1_000.0, share: 1.0 };
        super::step(shared, &slot, short).await.unwrap();
        clock.advance(1_200.0);
        assert!(store.execute_async(&plan(&[&ten])).await.unwrap().ok);
        store.delete_async("plain", None, 1).await.ok();
    }

    /// `store`, leasing `hot` as for [`transaction_takes_a_leased_limit_directly`]: an
    /// adjust settles on the store's state directly, and gives back no more than the leases
    /// out leave room for (`capacity - outstanding`), else the tokens leased and those given
    /// back could both be spent; a debt is kept with the records.
    pub(crate) async fn an_adjust_gives_back_no_more_than_the_leases_leave(
        store: &impl AsyncStore,
        shared: &impl LeaseStore,
    ) {
        let slot = writing(&hot(1.0)).slot;
        let grant = Step::Grant { holder: 7, want: 5.0, unused: 0.0, term: 60_000.0, share: 1.0 };
        super::step(shared, &slot, grant).await.unwrap();
        let adjust = |count| Plan::adjust(&hot(count), 0, 0).unwrap();
        // 5 leased out: giving 8 back raises the rest to 5, not 10.
        let given = store.execute_async(&adjust(-8.0)).await.unwrap();
        assert_eq!(given.adjusted(), Some(Adjusted { value: 5.0, retry_after: None }));
        // The work used 7 more: 2 in debt, 200 ms at 10 a second.
        let taken = store.execute_async(&adjust(7.0)).await.unwrap();
        assert_eq!(taken.adjusted(), Some(Adjusted { value: -2.0, retry_after: Some(200.0) }));
        let (_, states) = store.read_async(&[slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, -2.0);
        // The record is still there: its 5 come back when it is returned.
        let back = Step::Release { holder: 7, unused: 5.0 };
        super::step(shared, &slot, back).await.unwrap();
        let (_, states) = store.read_async(&[slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 3.0);
    }
}
