//! Requests, sharding (SPEC §3) and all-or-nothing transactions (SPEC §4), as a [`Plan`]
//! that a store executes: load the plan's slots, call [`Plan::decide`], save what changed.

use smallvec::SmallVec;

use crate::config::Config;
use crate::eval::{
    Decision, Evaluation, InvalidRequest, State, Status, alignment, evaluate, evaluate_adjust,
    splitmix64, validate_adjust_count, validate_count, validate_name_key,
};

/// One request to take (or check) tokens from a limit.
#[derive(Clone, Copy, Debug)]
pub struct Take<'a> {
    /// The limit's name.
    pub name: &'a str,
    /// The key; `None` is the one global value of the name (distinct from `Some("")`).
    pub key: Option<&'a str>,
    /// The limit's config.
    pub config: Config,
    /// Tokens asked for.
    pub count: f64,
    /// Whether a shortfall may be booked ahead (SPEC §2, reservations).
    pub reserve: bool,
}

/// One (name, key, shard) state that a plan reads and may write.
#[derive(Clone, Copy, Debug)]
pub struct Slot<'a> {
    /// The limit's name.
    pub name: &'a str,
    /// The key, if any.
    pub key: Option<&'a str>,
    /// The shard index, `0..shards`.
    pub shard: u16,
    /// The shard's own parameters ([`Config::per_shard`]).
    pub config: Config,
    /// The fixed-window alignment of this slot (see [`alignment`]).
    pub alignment: f64,
}

impl<'a> Slot<'a> {
    /// Whether two slots name the same stored state.
    #[inline]
    pub fn same_state(&self, other: &Slot<'_>) -> bool {
        self.shard == other.shard && self.key == other.key && self.name == other.name
    }

    /// The same slot with its name and key taken from `text`, which is given the name, then
    /// the key if there is one: for a store that hands a request to another thread with
    /// copies of its strings (see [`Plan::with_text`]).
    pub fn with_text<'b>(&self, mut text: impl FnMut(&'a str) -> &'b str) -> Slot<'b> {
        let name = text(self.name);
        Slot { name, key: self.key.map(text), ..*self }
    }
}

/// A decision with the limit's status after it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Taken {
    /// Granted or refused, and the wait.
    pub decision: Decision,
    /// What the limit has left.
    pub status: Status,
}

/// One take from an unsharded limit: the common request, which a store may serve without
/// building a [`Plan`] (see `Store::execute_one` in the `tollgate` crate).
#[derive(Clone, Copy, Debug)]
pub struct OneTake<'a> {
    /// The one slot.
    pub slot: Slot<'a>,
    /// Tokens asked for.
    pub count: f64,
    /// Whether a shortfall may be booked ahead.
    pub reserve: bool,
    /// Whether the new state is saved when granted (`limit`) or not (`check`).
    pub writes: bool,
}

impl<'a> OneTake<'a> {
    /// Validates `take` as [`Plan::push`] does.
    ///
    /// # Errors
    ///
    /// The validation errors of [`Plan::push`], and a sharded limit, which needs a [`Plan`].
    #[inline(always)]
    pub fn new(take: &Take<'a>, seed: u64, writes: bool) -> Result<Self, InvalidRequest> {
        Self::check(take)?;
        Ok(Self::of_valid(take, seed, writes))
    }

    /// The validation of [`OneTake::new`] alone.
    ///
    /// # Errors
    ///
    /// As for [`OneTake::new`].
    #[inline(always)]
    pub fn check(take: &Take<'_>) -> Result<(), InvalidRequest> {
        Self::check_parts(take.name, take.key, &take.config, take.count, take.reserve)
    }

    /// [`OneTake::check`] of a take given by its fields, for a caller that has them apart:
    /// a `Take` built only to be checked and copied is read back in other pieces than it was
    /// written in, which stalls the processor.
    ///
    /// # Errors
    ///
    /// As for [`OneTake::new`].
    #[inline(always)]
    pub fn check_parts(
        name: &str,
        key: Option<&str>,
        config: &Config,
        count: f64,
        reserve: bool,
    ) -> Result<(), InvalidRequest> {
        if config.shards() != 1 {
            return Err(sharded_one_take(name));
        }
        validate_name_key(name, key)?;
        validate_count(name, config, count, reserve)
    }

    /// The take of [`OneTake::new`] for a `take` that [`OneTake::check`] accepted. (Apart, so
    /// that a caller that inlines both keeps the take in registers: a `Result<OneTake, _>`
    /// keeps its variant in one of the take's flags, and is copied through memory.)
    #[inline(always)]
    pub fn of_valid(take: &Take<'a>, seed: u64, writes: bool) -> Self {
        let (name, key, count, reserve) = (take.name, take.key, take.count, take.reserve);
        Self::of_valid_parts(name, key, &take.config, count, reserve, seed, writes)
    }

    /// [`OneTake::of_valid`] of a take given by its fields (see [`OneTake::check_parts`]).
    #[inline(always)]
    pub fn of_valid_parts(
        name: &'a str,
        key: Option<&'a str>,
        config: &Config,
        count: f64,
        reserve: bool,
        seed: u64,
        writes: bool,
    ) -> Self {
        let alignment = alignment(config, seed, name, key, 0);
        let slot = Slot { name, key, shard: 0, config: *config, alignment };
        OneTake { slot, count, reserve, writes }
    }

    /// Evaluates the take against the slot's loaded state: the decision with the limit's
    /// status after it, and the state to save if any.
    #[inline(always)]
    pub fn decide(&self, now: f64, state: Option<State>) -> (Taken, Option<State>) {
        let s = &self.slot;
        let e = evaluate(&s.config, state, s.alignment, now, self.count, self.reserve);
        let taken = Taken { decision: e.decision, status: e.status(&s.config, self.count, now) };
        (taken, (e.decision.ok && self.writes).then_some(e.state))
    }

    /// The same take with its name and key taken from `text` (see [`Slot::with_text`]).
    pub fn with_text<'b>(&self, text: impl FnMut(&'a str) -> &'b str) -> OneTake<'b> {
        OneTake { slot: self.slot.with_text(text), ..*self }
    }

    /// The same request as a [`Plan`], for stores that serve everything through plans.
    pub fn to_plan(&self) -> Plan<'a> {
        let item = Item {
            count: self.count,
            reserve: self.reserve,
            adjust: false,
            shards: 1,
            a: 0,
            b: None,
        };
        Plan {
            writes: self.writes,
            items: smallvec::smallvec![item],
            slots: smallvec::smallvec![self.slot],
        }
    }
}

#[cold]
#[inline(never)]
fn sharded_one_take(name: &str) -> InvalidRequest {
    InvalidRequest::new(format!("Rate limit {name} is sharded: it needs a Plan, not a OneTake."))
}

/// A small vector held inline up to four elements: a plan's takes and slots, and what a
/// store keeps per slot. Transactions of up to four limits (or a sharded take's two slots)
/// then need no allocation.
pub type Inline<T> = SmallVec<[T; 4]>;

/// One take of a [`Plan`] as a store that runs the algebra itself sees it (SPEC §3): decide
/// slot `a` alone when `b` is `None` or `a` has no state yet, else the power of two choices
/// between `a` and `b`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlannedTake {
    /// Tokens asked for.
    pub count: f64,
    /// Whether a shortfall may be booked ahead.
    pub reserve: bool,
    /// The limit's shard count.
    pub shards: u16,
    /// The index in [`Plan::slots`] of shard A.
    pub a: usize,
    /// The index of shard B, with three or more shards (with two or more for an adjust).
    pub b: Option<usize>,
    /// Whether this is an `adjust` (SPEC §4; see [`Plan::adjust`]): `count` is signed and
    /// settled on the fuller of A and B when positive, the emptier otherwise, never refused.
    pub adjust: bool,
}

#[derive(Clone, Copy, Debug)]
struct Item {
    count: f64,
    reserve: bool,
    adjust: bool,
    shards: u16,
    a: usize,
    b: Option<usize>,
}

/// What a store does for one request: the slots to load, and how to decide.
///
/// A plan holds one [`Take`] for `limit` and `check`, or several for a transaction. The random
/// shard choices are made when a take is pushed, so deciding is a pure function of the loaded
/// states and the time, and a store may run it again after a lost race.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{Config, Plan, Take, MINUTE};
///
/// let mut plan = Plan::new(true);
/// let take = Take { name: "send", key: Some("alice"), config: Config::token_bucket(10.0, MINUTE), count: 4.0, reserve: false };
/// plan.push(&take, 0, 42).unwrap();
/// // A store loads the states of plan.slots() (none here), decides, saves what changed.
/// let mut states = vec![None; plan.slots().len()];
/// let outcome = plan.decide(0.0, &mut states);
/// assert!(outcome.ok);
/// assert_eq!(states[0].unwrap().value, 6.0);
/// ```
#[derive(Clone, Debug)]
pub struct Plan<'a> {
    writes: bool,
    items: Inline<Item>,
    slots: Inline<Slot<'a>>,
}

/// The result of deciding a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Whether every take was granted.
    pub ok: bool,
    /// The largest `retry_after` of the takes.
    pub retry_after: Option<f64>,
    /// One decision per take, in order.
    pub results: Inline<Decision>,
    /// Per take, what its limit has left afterwards.
    pub statuses: Inline<Status>,
    /// Per slot: whether its new state must be saved.
    pub changed: Inline<bool>,
    /// For the plan of an adjust ([`Plan::adjust`]): the value it left, signed (the adjusted
    /// shard's times the shard count, an estimate for the whole limit as
    /// [`Status::remaining`] is); `None` for takes.
    pub value: Option<f64>,
}

impl Outcome {
    /// The single decision of a one-take plan (or the combined one of a transaction).
    #[inline]
    pub fn decision(&self) -> Decision {
        Decision { ok: self.ok, retry_after: self.retry_after }
    }

    /// Whether any slot must be saved.
    pub fn any_changed(&self) -> bool {
        self.changed.iter().any(|&c| c)
    }
}

impl<'a> Plan<'a> {
    /// An empty plan; `writes` is true for `limit` and transactions, false for `check`.
    #[inline]
    pub fn new(writes: bool) -> Self {
        Plan { writes, items: SmallVec::new(), slots: SmallVec::new() }
    }

    /// The plan of a transaction of one-takes, all or nothing, writing if the first take
    /// does (a transaction's takes all share it). Takes of one state share its slot, as with
    /// [`Plan::push`]. A store may decide takes of distinct slots one by one instead: for
    /// them, [`Plan::decide`] gives take `i` exactly [`OneTake::decide`]'s answer for its own
    /// state, all granted or nothing saved.
    pub fn of_one_takes(takes: &[OneTake<'a>]) -> Self {
        let mut plan = Plan::new(takes.first().is_none_or(|t| t.writes));
        for take in takes {
            let a = match plan.slots.iter().position(|s| s.same_state(&take.slot)) {
                Some(i) => i,
                None => {
                    plan.slots.push(take.slot);
                    plan.slots.len() - 1
                }
            };
            plan.items.push(Item {
                count: take.count,
                reserve: take.reserve,
                adjust: false,
                shards: 1,
                a,
                b: None,
            });
        }
        plan
    }

    /// The same plan with its names and keys taken from `text`, which is given them slot by
    /// slot in [`Plan::slots`] order, each slot's name before its key (see
    /// [`Slot::with_text`]). A store that hands a plan to another thread sends a copy made
    /// with placeholders and the strings it collected, and puts them back in the same order.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_algebra::{Config, Plan, Take, MINUTE};
    ///
    /// let mut plan = Plan::new(true);
    /// let take = Take { name: "send", key: Some("alice"), config: Config::token_bucket(10.0, MINUTE), count: 1.0, reserve: false };
    /// plan.push(&take, 0, 0).unwrap();
    /// let mut strings: Vec<String> = Vec::new();
    /// let shape: Plan<'static> = plan.with_text(|s| { strings.push(s.to_owned()); "" });
    /// // ... on another thread:
    /// let mut next = strings.iter();
    /// let again = shape.with_text(|_| next.next().unwrap().as_str());
    /// assert_eq!((again.slots()[0].name, again.slots()[0].key), ("send", Some("alice")));
    /// ```
    pub fn with_text<'b>(&self, mut text: impl FnMut(&'a str) -> &'b str) -> Plan<'b> {
        Plan {
            writes: self.writes,
            items: self.items.clone(),
            slots: self.slots.iter().map(|slot| slot.with_text(&mut text)).collect(),
        }
    }

    /// The same plan as a check: decided alike, nothing saved. A store answers with it for
    /// the rate limits beside an acquire that was refused (SPEC §6f), which must not be taken.
    #[must_use]
    pub fn checking(&self) -> Plan<'a> {
        Plan { writes: false, ..self.clone() }
    }

    /// Whether deciding this plan may change states.
    pub fn writes(&self) -> bool {
        self.writes
    }

    /// The slots to load, in a fixed order; [`Plan::decide`] takes their states in that order.
    pub fn slots(&self) -> &[Slot<'a>] {
        &self.slots
    }

    /// The takes, in order, with their shard choices already made: for stores that run the
    /// algebra themselves, such as a Redis script.
    pub fn takes(&self) -> impl Iterator<Item = PlannedTake> + '_ {
        self.items.iter().map(|item| PlannedTake {
            count: item.count,
            reserve: item.reserve,
            shards: item.shards,
            a: item.a,
            b: item.b,
            adjust: item.adjust,
        })
    }

    /// Adds a take. `seed` fixes fixed-window alignments; `random` supplies the shard choice.
    ///
    /// # Errors
    ///
    /// The validation errors of SPEC §1 and §2: a bad name or key, a count that is not finite
    /// and >= 0, or a count the limit can never grant.
    #[inline]
    pub fn push(&mut self, take: &Take<'a>, seed: u64, random: u64) -> Result<(), InvalidRequest> {
        validate_name_key(take.name, take.key)?;
        validate_count(take.name, &take.config, take.count, take.reserve)?;
        let shards = take.config.shards();
        let per_shard = take.config.per_shard();
        let (a, b) = pick_shards(shards, random);
        let a = self.slot(take, per_shard, seed, a);
        let b = b.map(|b| self.slot(take, per_shard, seed, b));
        let (count, reserve) = (take.count, take.reserve);
        self.items.push(Item { count, reserve, adjust: false, shards, a, b });
        Ok(())
    }

    #[inline]
    fn slot(&mut self, take: &Take<'a>, config: Config, seed: u64, shard: u16) -> usize {
        let slot = Slot {
            name: take.name,
            key: take.key,
            shard,
            config,
            alignment: alignment(&config, seed, take.name, take.key, shard),
        };
        // Two takes of one state in a transaction share its slot, so they add up.
        if let Some(i) = self.slots.iter().position(|s| s.same_state(&slot)) {
            return i;
        }
        self.slots.push(slot);
        self.slots.len() - 1
    }

    /// The plan of an `adjust` (SPEC §4): settles `take.count`, signed, on (name, key), never
    /// refused. `take.reserve` is ignored. With shards, two distinct shards are sampled
    /// (`random` picks them) and a positive count is taken from the fuller, a negative one
    /// given to the emptier; what a shard cannot hold above its capacity is dropped.
    /// [`Outcome::value`] is the value it left.
    ///
    /// # Errors
    ///
    /// A bad name or key, or a count that is not finite (or past [`MAX_AMOUNT`] either way).
    ///
    /// [`MAX_AMOUNT`]: crate::MAX_AMOUNT
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_algebra::{Config, Plan, State, Take, MINUTE};
    ///
    /// let config = Config::token_bucket(10.0, MINUTE);
    /// let used = Take { name: "tokens", key: Some("alice"), config, count: 3.0, reserve: false };
    /// let plan = Plan::adjust(&used, 0, 7).unwrap();
    /// let mut states = vec![Some(State { value: 1.0, ts: 0.0 })];
    /// let outcome = plan.decide(0.0, &mut states);
    /// assert!(outcome.ok); // never refused: a debt of 2 delays the next requests instead
    /// assert_eq!(outcome.value, Some(-2.0));
    /// assert_eq!(outcome.retry_after, Some(12_000.0));
    /// assert_eq!(states[0].unwrap().value, -2.0);
    /// ```
    pub fn adjust(take: &Take<'a>, seed: u64, random: u64) -> Result<Plan<'a>, InvalidRequest> {
        validate_name_key(take.name, take.key)?;
        validate_adjust_count(take.name, take.count)?;
        let mut plan = Plan::new(true);
        let shards = take.config.shards();
        let per_shard = take.config.per_shard();
        let (a, b) = pick_two(shards, random);
        let a = plan.slot(take, per_shard, seed, a);
        let b = b.map(|b| plan.slot(take, per_shard, seed, b));
        let count = take.count;
        plan.items.push(Item { count, reserve: false, adjust: true, shards, a, b });
        Ok(plan)
    }

    /// An adjust's plan decided: the shard it settles on (see [`Plan::adjust`]), always
    /// granted and written.
    fn decide_adjust(
        &self,
        item: &Item,
        now: f64,
        states: &mut [Option<State>],
        caps: &[f64],
    ) -> Outcome {
        let value_now = |slot: usize| self.eval(slot, states, now, 0.0, false).state.value;
        let slot = match item.b {
            Some(b) if item.shards > 1 => {
                let (va, vb) = (value_now(item.a), value_now(b));
                let b_wins = if item.count > 0.0 { vb > va } else { vb < va };
                if b_wins { b } else { item.a }
            }
            _ => item.a,
        };
        let s = &self.slots[slot];
        let cap = caps.get(slot).map_or(s.config.capacity(), |&c| c.min(s.config.capacity()));
        let e = evaluate_adjust(&s.config, states[slot], s.alignment, now, item.count, cap);
        states[slot] = Some(e.state);
        let mut changed: Inline<bool> = SmallVec::from_elem(false, self.slots.len());
        changed[slot] = true;
        let n = f64::from(item.shards);
        let mut status = e.status(&s.config, 0.0, now);
        status.remaining *= n;
        Outcome {
            ok: true,
            retry_after: e.decision.retry_after,
            results: smallvec::smallvec![e.decision],
            statuses: smallvec::smallvec![status],
            changed,
            value: Some(e.state.value * n),
        }
    }

    /// Decides every take against `states` (the loaded states of [`Plan::slots`], in order) at
    /// `now`, all or nothing.
    ///
    /// When every take is granted and the plan writes, `states` holds the new states and
    /// `changed` marks the slots to save; otherwise `states` is left as loaded and nothing
    /// is marked. Takes in one plan see each other's effects in order, so two takes from the
    /// same limit add up.
    ///
    /// # Panics
    ///
    /// If `states` is shorter than [`Plan::slots`].
    #[inline]
    pub fn decide(&self, now: f64, states: &mut [Option<State>]) -> Outcome {
        self.decide_under(now, states, &[])
    }

    /// [`Plan::decide`] where some states may not be raised to their capacity: `caps[i]`, if
    /// given, is the most an adjust may raise slot `i` to (a leased state's `capacity -
    /// outstanding`, which a take never passes anyway). A store that keeps leases decides
    /// with it; with no caps it is [`Plan::decide`].
    ///
    /// # Panics
    ///
    /// If `states` is shorter than [`Plan::slots`].
    #[inline]
    pub fn decide_under(&self, now: f64, states: &mut [Option<State>], caps: &[f64]) -> Outcome {
        assert!(states.len() >= self.slots.len(), "one state per slot");
        if let [item] = self.items.as_slice()
            && item.adjust
        {
            return self.decide_adjust(item, now, states, caps);
        }
        if let ([item], [_]) = (self.items.as_slice(), self.slots.as_slice()) {
            // One take from one shard: the common case, without the transaction's bookkeeping.
            let e = self.eval(0, states, now, item.count, item.reserve);
            let changed = e.decision.ok && self.writes;
            if changed {
                states[0] = Some(e.state);
            }
            let Decision { ok, retry_after } = e.decision;
            // A shard's status, scaled to all of the limit's shards (two shards: one slot).
            let mut status = e.status(&self.slots[0].config, item.count, now);
            status.remaining *= f64::from(item.shards);
            return Outcome {
                ok,
                retry_after,
                results: smallvec::smallvec![e.decision],
                statuses: smallvec::smallvec![status],
                changed: smallvec::smallvec![changed],
                value: None,
            };
        }
        let mut working: Inline<Option<State>> = SmallVec::from_slice(&states[..self.slots.len()]);
        let mut changed: Inline<bool> = SmallVec::from_elem(false, self.slots.len());
        let mut results: Inline<Decision> = SmallVec::with_capacity(self.items.len());
        let mut statuses: Inline<Status> = SmallVec::with_capacity(self.items.len());
        let (mut ok, mut retry_after) = (true, None::<f64>);
        for item in &self.items {
            let (decision, status, writes) = self.decide_item(item, now, &working);
            if decision.ok {
                for (slot, state) in writes.into_iter().flatten() {
                    working[slot] = Some(state);
                    changed[slot] = true;
                }
            }
            ok &= decision.ok;
            retry_after = max_option(retry_after, decision.retry_after);
            results.push(decision);
            statuses.push(status);
        }
        if ok && self.writes {
            states[..self.slots.len()].copy_from_slice(&working);
        } else {
            changed.iter_mut().for_each(|c| *c = false);
        }
        if !ok {
            // Refused: nothing is taken, so a take that alone was granted reports its limit
            // as it stands, as a refused one does (a take of nothing, on the loaded states).
            for (i, item) in self.items.iter().enumerate() {
                if results[i].ok {
                    let nothing = Item { count: 0.0, reserve: false, ..*item };
                    statuses[i] = self.decide_item(&nothing, now, states).1;
                }
            }
        }
        Outcome { ok, retry_after, results, statuses, changed, value: None }
    }

    #[inline]
    fn eval(
        &self,
        slot: usize,
        states: &[Option<State>],
        now: f64,
        count: f64,
        reserve: bool,
    ) -> Evaluation {
        let s = &self.slots[slot];
        evaluate(&s.config, states[slot], s.alignment, now, count, reserve)
    }

    /// One take: a single shard, or the power of two choices (SPEC §3). Returns the
    /// decision, the limit's status (scaled from the shards used to all shards), and the
    /// states to write if granted.
    #[inline]
    fn decide_item(
        &self,
        item: &Item,
        now: f64,
        states: &[Option<State>],
    ) -> (Decision, Status, [Option<(usize, State)>; 2]) {
        let n = f64::from(item.shards);
        // A shard's status scaled to all n shards.
        let status_of = |slot: usize, e: &Evaluation, count: f64| {
            let Status { remaining, reset_after } = e.status(&self.slots[slot].config, count, now);
            Status { remaining: remaining * n, reset_after }
        };
        let alone = |slot: usize, e: Evaluation| {
            (e.decision, status_of(slot, &e, item.count), [Some((slot, e.state)), None])
        };
        let ea = self.eval(item.a, states, now, item.count, item.reserve);
        let b = match item.b {
            // With fewer than three shards, or a shard A never used, A decides alone.
            Some(b) if item.shards > 1 && states[item.a].is_some() => b,
            _ => return alone(item.a, ea),
        };
        let eb = self.eval(b, states, now, item.count, item.reserve);
        match (ea.decision.ok, eb.decision.ok) {
            (true, true) if eb.state.value > ea.state.value => alone(b, eb),
            (true, _) => alone(item.a, ea),
            (false, true) => alone(b, eb),
            (false, false) => {
                let (count_a, count_b) = together(&ea, &eb, item.count);
                let ca = self.eval(item.a, states, now, count_a, item.reserve);
                let cb = self.eval(b, states, now, count_b, item.reserve);
                let retry_after = max_option(ca.decision.retry_after, cb.decision.retry_after);
                if ca.decision.ok && cb.decision.ok {
                    (
                        Decision { ok: true, retry_after },
                        pair(status_of(item.a, &ca, count_a), status_of(b, &cb, count_b)),
                        [Some((item.a, ca.state)), Some((b, cb.state))],
                    )
                } else {
                    let status =
                        pair(status_of(item.a, &ea, item.count), status_of(b, &eb, item.count));
                    (Decision { ok: false, retry_after }, status, [None, None])
                }
            }
        }
    }
}

/// The counts to take from shards A and B together so that they end equal (SPEC §3):
/// `balance = valueA' + valueB' + count`; `count_i = value_i' + count - balance / 2`.
fn together(ea: &Evaluation, eb: &Evaluation, count: f64) -> (f64, f64) {
    let balance = ea.state.value + eb.state.value + count;
    (ea.state.value + count - balance / 2.0, eb.state.value + count - balance / 2.0)
}

/// Two shards' statuses, each already scaled to all shards, as the limit's.
fn pair(a: Status, b: Status) -> Status {
    Status {
        remaining: (a.remaining + b.remaining) / 2.0,
        reset_after: a.reset_after.max(b.reset_after),
    }
}

/// How a sharded take runs when its two shards cannot be loaded and saved in one atomic step
/// (on Redis Cluster they may live on different nodes): as atomic steps on one shard each,
/// chosen by [`Plan::split`] from states read beforehand. Each step re-decides on the
/// shard's state as it is then, so a race can only refuse more, never admit more.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant, reason = "made once per request, on a cluster's slow path")]
pub enum Split<'a> {
    /// Decided from the read states without writing anything: a refusal, or a check.
    Done(Outcome),
    /// Run this one-slot plan atomically; its outcome, mapped back with [`Split::outcome`],
    /// is the answer.
    One {
        /// The index in the original plan's slots of the shard used.
        slot: usize,
        /// The one-shard plan.
        plan: Plan<'a>,
    },
    /// Neither shard alone suffices, both together do (SPEC §3): take `count_a` from A,
    /// then `count_b` from B, each atomically. If B refuses, A's take must be given back.
    Both {
        /// The indexes in the original plan's slots of A and B.
        slots: [usize; 2],
        /// The one-shard plans of A and B, in that order.
        plans: [Plan<'a>; 2],
    },
}

impl Split<'_> {
    /// The answer of the original plan from the outcomes of the steps run (one for
    /// [`Split::One`]; for [`Split::Both`] two, or one if A refused; for `Done`, none). `slots` is the
    /// original plan's slot count, for [`Outcome::changed`].
    ///
    /// # Panics
    ///
    /// If `steps` holds fewer outcomes than the split has steps.
    pub fn outcome(&self, slots: usize, steps: &[Outcome]) -> Outcome {
        let mut changed: Inline<bool> = SmallVec::from_elem(false, slots);
        match self {
            Split::Done(outcome) => outcome.clone(),
            Split::One { slot, .. } => {
                let step = &steps[0];
                changed[*slot] = step.changed[0];
                Outcome { changed, ..step.clone() }
            }
            Split::Both { slots: [a, b], .. } => {
                // Only A's step when A refused (B was then not run).
                let (sa, sb) = (&steps[0], steps.get(1).unwrap_or(&steps[0]));
                let ok = sa.ok && sb.ok;
                let retry_after = max_option(sa.retry_after, sb.retry_after);
                // Each step's status is scaled to all shards as if alone, as in Plan::decide.
                let status = pair(sa.statuses[0], sb.statuses[0]);
                changed[*a] = ok && sa.changed[0];
                changed[*b] = ok && sb.changed[0];
                Outcome {
                    ok,
                    retry_after,
                    results: smallvec::smallvec![Decision { ok, retry_after }],
                    statuses: smallvec::smallvec![status],
                    changed,
                    value: None,
                }
            }
        }
    }
}

impl<'a> Plan<'a> {
    /// The plan of one take of `count` from `slot` alone, with this plan's take's reserve flag
    /// and shard count (so its status is scaled to all shards) and its `writes`.
    fn single(&self, item: &Item, slot: usize, count: f64) -> Plan<'a> {
        let one = Item { count, a: 0, b: None, ..*item };
        Plan {
            writes: self.writes,
            items: smallvec::smallvec![one],
            slots: smallvec::smallvec![self.slots[slot]],
        }
    }

    /// For a plan of one sharded take over two slots, the steps that run it one shard at a
    /// time (see [`Split`]), given its slots' states read at `now`; `None` for any other plan.
    ///
    /// Run without interference, the steps give exactly the answer and states of
    /// [`Plan::decide`]. Each step decides again on its shard's state as it then is, so a
    /// concurrent request can make a step refuse but never make the limit over-admit.
    ///
    /// # Panics
    ///
    /// If `states` is shorter than [`Plan::slots`].
    pub fn split(&self, now: f64, states: &[Option<State>]) -> Option<Split<'a>> {
        let ([item], [_, _]) = (self.items.as_slice(), self.slots.as_slice()) else {
            return None;
        };
        let b = item.b?;
        if item.adjust {
            // Settled on one shard, chosen from the states read: a race can only make the
            // choice less good, never move a token past its shard's capacity.
            let mut after: Inline<Option<State>> = SmallVec::from_slice(&states[..2]);
            let outcome = self.decide(now, &mut after);
            let slot = if outcome.changed[b] { b } else { item.a };
            return Some(Split::One { slot, plan: self.single(item, slot, item.count) });
        }
        if item.shards <= 1 || states[item.a].is_none() {
            return Some(Split::One { slot: item.a, plan: self.single(item, item.a, item.count) });
        }
        let mut after: Inline<Option<State>> = SmallVec::from_slice(&states[..2]);
        let outcome = self.decide(now, &mut after);
        if !outcome.ok || !self.writes {
            return Some(Split::Done(outcome));
        }
        Some(match (outcome.changed[item.a], outcome.changed[b]) {
            (true, true) => {
                let ea = self.eval(item.a, states, now, item.count, item.reserve);
                let eb = self.eval(b, states, now, item.count, item.reserve);
                let (count_a, count_b) = together(&ea, &eb, item.count);
                Split::Both {
                    slots: [item.a, b],
                    plans: [self.single(item, item.a, count_a), self.single(item, b, count_b)],
                }
            }
            (false, true) => Split::One { slot: b, plan: self.single(item, b, item.count) },
            _ => Split::One { slot: item.a, plan: self.single(item, item.a, item.count) },
        })
    }
}

/// Shard A uniform in `0..n`, and B uniform among the others when `n >= 2`: an adjust's two
/// samples (with two shards, both).
#[inline]
fn pick_two(n: u16, random: u64) -> (u16, Option<u16>) {
    let (a, _) = pick_shards(n, random);
    if n < 2 {
        return (a, None);
    }
    let n = u64::from(n);
    let offset = ((random >> 32) * (n - 1)) >> 32;
    (a, Some(((u64::from(a) + 1 + offset) % n) as u16))
}

/// Shard A uniform in `0..n`; shard B uniform among the others when `n >= 3`.
#[inline]
fn pick_shards(n: u16, random: u64) -> (u16, Option<u16>) {
    if n == 1 {
        return (0, None);
    }
    let n = u64::from(n);
    // Multiply-shift maps 32 random bits onto 0..n without the bias of `%`.
    let a = ((random & 0xffff_ffff) * n) >> 32;
    if n < 3 {
        return (a as u16, None);
    }
    let offset = ((random >> 32) * (n - 1)) >> 32;
    (a as u16, Some(((a + 1 + offset) % n) as u16))
}

/// Which refused request of a transaction to name in its refusal: the one with the longest
/// wait (the first of those, if several wait as long). `None` if none was refused.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{longest_refusal, Decision};
///
/// let results = [
///     Decision { ok: false, retry_after: Some(1_000.0) },
///     Decision::ADMIT,
///     Decision { ok: false, retry_after: Some(20_000.0) },
/// ];
/// assert_eq!(longest_refusal(&results), Some(2));
/// assert_eq!(longest_refusal(&[Decision::ADMIT]), None);
/// ```
pub fn longest_refusal(results: &[Decision]) -> Option<usize> {
    let mut longest: Option<(usize, f64)> = None;
    for (i, d) in results.iter().enumerate().filter(|(_, d)| !d.ok) {
        let wait = d.retry_after.unwrap_or(0.0);
        if longest.is_none_or(|(_, w)| wait > w) {
            longest = Some((i, wait));
        }
    }
    longest.map(|(i, _)| i)
}

/// The larger of two optional waits.
#[inline]
pub fn max_option(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// What an `adjust` (SPEC §4) left: the limit's value, signed, and while it is negative the
/// wait until it is back at 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjusted {
    /// Tokens available after the adjust: negative while the limit is in debt. For a sharded
    /// limit, the adjusted shard's value times the shard count (an estimate for the limit).
    pub value: f64,
    /// Milliseconds until the value is back at 0, when it is negative (SPEC §2's `retryAfter`
    /// for the value left): a request for one token waits at least this long.
    pub retry_after: Option<f64>,
}

impl Outcome {
    /// What the plan of an adjust ([`Plan::adjust`]) left; `None` for a plan of takes.
    pub fn adjusted(&self) -> Option<Adjusted> {
        Some(Adjusted { value: self.value?, retry_after: self.retry_after })
    }
}

/// A limit's value as the `value` operation reports it (SPEC §4).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    /// Tokens available: the stored value of an unsharded limit, or the estimated total of a
    /// sharded one at `ts`.
    pub value: f64,
    /// The stored `ts`, or the time the estimate was made.
    pub ts: f64,
    /// The shard read (the fullest sampled one).
    pub shard: u16,
    /// The config with every default filled in and a fixed window's `start` set.
    pub config: Config,
}

/// One sampled shard for [`read`]: its index, stored state and alignment.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// The shard index.
    pub shard: u16,
    /// Its stored state.
    pub state: Option<State>,
    /// Its fixed-window alignment.
    pub alignment: f64,
}

/// Computes the `value` answer from sampled shards (SPEC §4).
///
/// One shard: its stored state, or `capacity` at ts 0 when it has none. Several: each sampled
/// shard is evaluated at `now` without taking anything, and the total is their sum scaled up
/// to all shards.
///
/// # Panics
///
/// If `samples` is empty.
pub fn read(config: &Config, samples: &[Sample], now: f64) -> Reading {
    assert!(!samples.is_empty(), "at least one sample");
    let per_shard = config.per_shard();
    if config.shards() == 1 {
        let s = samples[0];
        let state = s.state.unwrap_or(State { value: config.capacity(), ts: 0.0 });
        return Reading {
            value: state.value,
            ts: state.ts,
            shard: 0,
            config: config.with_alignment(s.alignment),
        };
    }
    let mut total = 0.0;
    let mut fullest = (f64::NEG_INFINITY, samples[0]);
    for s in samples {
        let v = evaluate(&per_shard, s.state, s.alignment, now, 0.0, false).state.value;
        total += v;
        if v > fullest.0 {
            fullest = (v, *s);
        }
    }
    let scale = f64::from(config.shards()) / samples.len() as f64;
    Reading {
        value: total * scale,
        ts: now,
        shard: fullest.1.shard,
        config: config.with_alignment(fullest.1.alignment),
    }
}

/// Picks `k` distinct shards of `n` from a random stream (for `value`'s sampling).
pub fn sample_shards(n: u16, k: u16, mut random: u64) -> SmallVec<[u16; 4]> {
    let k = k.clamp(1, n);
    let mut picked: SmallVec<[u16; 4]> = SmallVec::new();
    if k == n {
        picked.extend(0..n);
        return picked;
    }
    while picked.len() < usize::from(k) {
        random = splitmix64(random);
        let shard = (((random & 0xffff_ffff) * u64::from(n)) >> 32) as u16;
        if !picked.contains(&shard) {
            picked.push(shard);
        }
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MINUTE;

    fn take(config: Config, count: f64) -> Take<'static> {
        Take { name: "n", key: Some("k"), config, count, reserve: false }
    }

    #[test]
    fn picks_are_uniform_and_distinct() {
        let mut hits = [0u32; 5];
        for r in 0..50_000u64 {
            let (a, b) = pick_shards(5, splitmix64(r));
            let b = b.unwrap();
            assert_ne!(a, b);
            assert!(a < 5 && b < 5);
            hits[usize::from(a)] += 1;
        }
        assert!(hits.iter().all(|&h| (9_000..11_000).contains(&h)), "{hits:?}");
        assert_eq!(pick_shards(2, u64::MAX).1, None);
        assert_eq!(pick_shards(1, u64::MAX), (0, None));
    }

    /// Shards A=0 and B=1 of 4, preloaded with the given values at time 0.
    fn two_shards(va: f64, vb: f64, count: f64, reserve: bool) -> (Outcome, Inline<Option<State>>) {
        // 10 per shard; at most 2 reserved per shard.
        let config = Config::token_bucket(40.0, MINUTE).with_shards(4).with_max_reserved(8.0);
        let mut plan = Plan::new(true);
        // random = 0 picks a = 0 and b = 1.
        plan.push(&Take { reserve, ..take(config, count) }, 0, 0).unwrap();
        assert_eq!((plan.slots()[0].shard, plan.slots()[1].shard), (0, 1));
        let mut states: Inline<Option<State>> = SmallVec::from_slice(&[
            Some(State { value: va, ts: 0.0 }),
            Some(State { value: vb, ts: 0.0 }),
        ]);
        let out = plan.decide(0.0, &mut states);
        (out, states)
    }

    #[test]
    fn power_of_two_uses_the_fuller_shard() {
        let (out, states) = two_shards(3.0, 7.0, 2.0, false);
        assert!(out.ok);
        assert_eq!(out.changed.as_slice(), &[false, true]);
        assert_eq!(states[1].unwrap().value, 5.0);
    }

    #[test]
    fn power_of_two_uses_the_only_ok_shard() {
        let (out, states) = two_shards(6.0, 1.0, 5.0, false);
        assert!(out.ok);
        assert_eq!(states[0].unwrap().value, 1.0);
        assert_eq!(states[1].unwrap().value, 1.0);
        assert_eq!(out.changed.as_slice(), &[true, false]);
    }

    #[test]
    fn power_of_two_combines_two_shards() {
        // Neither 4 nor 3 covers 5; together they do, and end equal at 1.
        let (out, states) = two_shards(4.0, 3.0, 5.0, false);
        assert_eq!(out.decision(), Decision::ADMIT);
        assert_eq!(states[0].unwrap().value, 1.0);
        assert_eq!(states[1].unwrap().value, 1.0);
        assert_eq!(out.changed.as_slice(), &[true, true]);
    }

    #[test]
    fn power_of_two_refuses_when_two_shards_are_not_enough() {
        // 2 + 1 < 5: refused, nothing written; each shard would need 1 more token (1.5 s).
        let (out, states) = two_shards(2.0, 1.0, 5.0, false);
        assert!(!out.ok);
        assert_eq!(out.retry_after, Some(6_000.0));
        assert_eq!(states[0].unwrap().value, 2.0);
        assert!(!out.any_changed());
    }

    #[test]
    fn power_of_two_combined_reservation_waits_for_the_later_shard() {
        // Alone, A would go to -3 and B to -4, past the 2 each may reserve; together both
        // end at -1, each waiting for one token: 6 s at 10 per minute.
        let (out, states) = two_shards(2.0, 1.0, 5.0, true);
        assert_eq!(out.decision(), Decision { ok: true, retry_after: Some(6_000.0) });
        assert_eq!(states[0].unwrap().value, -1.0);
        assert_eq!(states[1].unwrap().value, -1.0);
    }

    #[test]
    fn fresh_shard_a_decides_alone() {
        let config = Config::token_bucket(40.0, MINUTE).with_shards(4);
        let mut plan = Plan::new(true);
        plan.push(&take(config, 1.0), 0, 0).unwrap();
        let mut states = [None, Some(State { value: 10.0, ts: 0.0 })];
        let out = plan.decide(0.0, &mut states);
        assert_eq!(out.changed.as_slice(), &[true, false]);
        assert_eq!(states[0].unwrap().value, 9.0);
    }

    #[test]
    fn transaction_is_all_or_nothing() {
        let a = Take { name: "a", ..take(Config::token_bucket(10.0, MINUTE), 4.0) };
        let b = Take { name: "b", ..take(Config::token_bucket(3.0, MINUTE), 3.0) };
        let mut plan = Plan::new(true);
        plan.push(&a, 0, 0).unwrap();
        plan.push(&b, 0, 0).unwrap();
        let mut states = [None, Some(State { value: 1.0, ts: 0.0 })];
        let out = plan.decide(0.0, &mut states);
        assert!(!out.ok);
        assert_eq!(
            out.results.as_slice(),
            &[Decision::ADMIT, Decision { ok: false, retry_after: Some(40_000.0) }]
        );
        assert_eq!(out.retry_after, Some(40_000.0));
        assert_eq!(states, [None, Some(State { value: 1.0, ts: 0.0 })], "nothing written");
    }

    #[test]
    fn takes_from_one_limit_in_a_transaction_add_up() {
        let t = take(Config::token_bucket(10.0, MINUTE), 6.0);
        let mut plan = Plan::new(true);
        plan.push(&t, 0, 0).unwrap();
        plan.push(&t, 0, 0).unwrap();
        assert_eq!(plan.slots().len(), 1);
        let mut states = [None];
        let out = plan.decide(0.0, &mut states);
        assert_eq!(out.results[1], Decision { ok: false, retry_after: Some(12_000.0) });
        assert_eq!(states, [None]);
    }

    #[test]
    fn check_never_changes_states() {
        let mut plan = Plan::new(false);
        plan.push(&take(Config::token_bucket(10.0, MINUTE), 6.0), 0, 0).unwrap();
        let mut states = [None];
        assert!(plan.decide(0.0, &mut states).ok);
        assert_eq!(states, [None]);
    }

    #[test]
    fn read_reports_state_or_estimate() {
        let one = Config::fixed_window(10.0, MINUTE);
        let r = read(&one, &[Sample { shard: 0, state: None, alignment: 123.0 }], 5.0);
        assert_eq!((r.value, r.ts, r.shard), (10.0, 0.0, 0));
        assert_eq!(r.config.start(), Some(123.0));
        let four = Config::token_bucket(40.0, MINUTE).with_shards(4);
        let samples = [
            Sample { shard: 2, state: Some(State { value: 4.0, ts: 0.0 }), alignment: 0.0 },
            Sample { shard: 3, state: None, alignment: 0.0 },
        ];
        let r = read(&four, &samples, 6_000.0);
        // Shard 2 refilled to 5, shard 3 is full at 10: (5 + 10) * 4 / 2.
        assert_eq!((r.value, r.ts, r.shard), (30.0, 6_000.0, 3));
    }

    #[test]
    fn sampled_shards_are_distinct() {
        let s = sample_shards(10, 4, 7);
        assert_eq!(s.len(), 4);
        let mut d = s.to_vec();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), 4);
        assert_eq!(sample_shards(3, 9, 1).as_slice(), &[0, 1, 2]);
    }
}

#[cfg(test)]
mod split_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::config::MINUTE;

    /// Runs a split's steps one after the other on `states`, as a store without concurrent
    /// requests would.
    fn run_split(plan: &Plan<'_>, now: f64, states: &mut [Option<State>]) -> Outcome {
        let split = plan.split(now, states).expect("a sharded take over two slots");
        let mut steps = Vec::new();
        let step = |slot: usize, p: &Plan<'_>, states: &mut [Option<State>]| {
            let mut one = [states[slot]];
            let outcome = p.decide(now, &mut one);
            if outcome.changed[0] {
                states[slot] = one[0];
            }
            outcome
        };
        match &split {
            Split::Done(_) => {}
            Split::One { slot, plan } => steps.push(step(*slot, plan, states)),
            Split::Both { slots, plans } => {
                let before = states[slots[0]];
                steps.push(step(slots[0], &plans[0], states));
                steps.push(step(slots[1], &plans[1], states));
                if !steps[1].ok {
                    states[slots[0]] = before;
                }
            }
        }
        split.outcome(plan.slots().len(), &steps)
    }

    fn state() -> impl Strategy<Value = Option<State>> {
        prop::option::weighted(
            0.9,
            (-20i32..=25, 0u32..120).prop_map(|(v, age)| State {
                value: f64::from(v) / 2.0,
                ts: 1_000_000.0 - f64::from(age) * 500.0,
            }),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4_000, ..ProptestConfig::default() })]

        /// Run step by step, a split gives exactly what deciding the whole plan gives.
        #[test]
        fn steps_answer_as_the_whole_plan(
            fixed in any::<bool>(),
            shards in 3u16..8,
            reserve in any::<bool>(),
            count in (0u32..40).prop_map(|c| f64::from(c) / 2.0),
            random in any::<u64>(),
            writes in any::<bool>(),
            a in state(),
            b in state(),
        ) {
            let base = if fixed {
                Config::fixed_window(10.0 * f64::from(shards), MINUTE)
            } else {
                Config::token_bucket(10.0 * f64::from(shards), MINUTE).with_max_reserved(f64::from(shards) * 8.0)
            };
            let config = base.with_shards(shards);
            let take = Take { name: "hot", key: None, config, count, reserve };
            let mut plan = Plan::new(writes);
            if plan.push(&take, 0, random).is_err() {
                return Ok(());
            }
            let now = 1_000_000.0;
            let mut whole = [a, b];
            let expected = plan.decide(now, &mut whole);
            let mut stepped = [a, b];
            let got = run_split(&plan, now, &mut stepped);
            prop_assert_eq!(&got, &expected);
            prop_assert_eq!(stepped, whole);
        }
    }

    /// One step of a sequence on one limit: a take (`limit`, maybe reserving) or an adjust,
    /// after a wait.
    #[derive(Clone, Copy, Debug)]
    enum Act {
        Take { count: f64, reserve: bool },
        Adjust { count: f64 },
    }

    fn act() -> impl Strategy<Value = (f64, Act)> {
        let take = ((0u32..12), any::<bool>())
            .prop_map(|(c, reserve)| Act::Take { count: f64::from(c) / 2.0, reserve });
        let adjust = (-16i32..=16).prop_map(|c| Act::Adjust { count: f64::from(c) / 2.0 });
        ((0u32..4_000).prop_map(f64::from), prop_oneof![take, adjust])
    }

    fn limit() -> impl Strategy<Value = Config> {
        (any::<bool>(), 1u32..10, 1u32..4, prop::option::of(0u32..8), 1u16..6).prop_map(
            |(bucket, rate, burst, reserved, shards)| {
                let rate = f64::from(rate * u32::from(shards));
                let base = if bucket {
                    Config::token_bucket(rate, 1_000.0)
                } else {
                    Config::fixed_window(rate, 1_000.0).with_start(0.0)
                };
                let config = base.with_capacity(rate * f64::from(burst)).with_shards(shards);
                match reserved {
                    Some(most) => config.with_max_reserved(f64::from(most * u32::from(shards))),
                    None => config,
                }
            },
        )
    }

    /// Runs `acts` on one (name, key) of `config` from time 0: each state after each step,
    /// per shard; the grants (time, count); and the give-backs (time, tokens given).
    #[allow(clippy::type_complexity)]
    fn run_acts(
        config: &Config,
        acts: &[(f64, Act)],
        random: u64,
    ) -> (Vec<Vec<Option<State>>>, Vec<(f64, f64)>, Vec<(f64, f64)>) {
        let shards = usize::from(config.shards());
        let mut states: Vec<Option<State>> = vec![None; shards];
        let (mut after, mut granted, mut given) = (Vec::new(), Vec::new(), Vec::new());
        let mut now = 0.0;
        for (i, &(wait, act)) in acts.iter().enumerate() {
            now += wait;
            let random = splitmix64(random ^ i as u64);
            let plan = match act {
                Act::Take { count, reserve } => {
                    // Reservations without a bound book without one: not this test's bound.
                    let reserve = reserve && config.max_reserved().is_some();
                    let take = Take { name: "n", key: None, config: *config, count, reserve };
                    let mut plan = Plan::new(true);
                    if plan.push(&take, 0, random).is_err() {
                        continue;
                    }
                    plan
                }
                Act::Adjust { count } => {
                    let take =
                        Take { name: "n", key: None, config: *config, count, reserve: false };
                    Plan::adjust(&take, 0, random).unwrap()
                }
            };
            let mut loaded: Vec<Option<State>> =
                plan.slots().iter().map(|s| states[usize::from(s.shard)]).collect();
            let outcome = plan.decide(now, &mut loaded);
            for ((slot, state), changed) in plan.slots().iter().zip(loaded).zip(&outcome.changed) {
                if *changed {
                    states[usize::from(slot.shard)] = state;
                }
            }
            match act {
                Act::Take { count, .. } if outcome.ok => granted.push((now, count)),
                Act::Adjust { count } if count < 0.0 => given.push((now, -count)),
                _ => {}
            }
            after.push(states.clone());
        }
        (after, granted, given)
    }

    /// The most one unsharded limit of `config` may grant in `[a, b]` (SPEC §2): its
    /// capacity, what flows in meanwhile, and what reservations may book ahead.
    fn limit_bound(config: &Config, a: f64, b: f64) -> f64 {
        let reserved = config.max_reserved().unwrap_or(0.0);
        let inflow = match config.kind() {
            crate::Kind::TokenBucket => config.rate() * (b - a) / config.period(),
            // One allowance per window that begins within (a, b].
            crate::Kind::FixedWindow => {
                config.rate() * ((b / config.period()).floor() - (a / config.period()).floor())
            }
        };
        config.capacity() + reserved + inflow
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3_000, ..ProptestConfig::default() })]

        /// An adjust never raises a shard above its capacity, however much it gives back.
        #[test]
        fn adjust_never_raises_a_state_above_capacity(
            config in limit(),
            acts in prop::collection::vec(act(), 1..60),
            random in any::<u64>(),
        ) {
            let cap = config.per_shard().capacity();
            let (after, _, _) = run_acts(&config, &acts, random);
            for states in after {
                for state in states.into_iter().flatten() {
                    prop_assert!(state.value <= cap, "{} over {cap}", state.value);
                }
            }
        }

        /// Any sequence of takes and adjusts grants, over every interval, at most what the
        /// limit grants without adjusts (capacity, inflow, reservations) plus what was given
        /// back within the interval.
        #[test]
        fn takes_and_adjusts_grant_at_most_the_bound_plus_what_was_given_back(
            config in limit().prop_map(|c| c.with_shards(1)),
            acts in prop::collection::vec(act(), 1..80),
            random in any::<u64>(),
        ) {
            let (_, granted, given) = run_acts(&config, &acts, random);
            for (i, &(a, _)) in granted.iter().enumerate() {
                let mut sum = 0.0;
                for &(b, count) in &granted[i..] {
                    sum += count;
                    let back: f64 =
                        given.iter().filter(|(t, _)| (a..=b).contains(t)).map(|(_, g)| g).sum();
                    let bound = limit_bound(&config, a, b) + back;
                    prop_assert!(sum <= bound + 1e-9, "{sum} granted in [{a}, {b}], bound {bound}");
                }
            }
        }

        /// Split into steps (Redis Cluster), an adjust settles on the same shard and leaves
        /// the same states as the whole plan decided at once.
        #[test]
        fn an_adjust_split_answers_as_the_whole_plan(
            config in limit().prop_map(|c| c.with_shards(3)),
            count in (-16i32..=16).prop_map(|c| f64::from(c) / 2.0),
            random in any::<u64>(),
            a in state(),
            b in state(),
        ) {
            let take = Take { name: "hot", key: None, config, count, reserve: false };
            let plan = Plan::adjust(&take, 0, random).unwrap();
            let now = 1_000_000.0;
            let mut whole = [a, b];
            let expected = plan.decide(now, &mut whole);
            let mut stepped = [a, b];
            let got = run_split(&plan, now, &mut stepped);
            prop_assert_eq!(got.value, expected.value);
            prop_assert_eq!(got.decision(), expected.decision());
            prop_assert_eq!(stepped, whole);
        }
    }

    #[test]
    fn adjust_settles_on_the_fuller_shard_or_gives_to_the_emptier() {
        let config = Config::token_bucket(40.0, MINUTE).with_shards(4); // 10 a shard
        let take = |count| Take { name: "n", key: None, config, count, reserve: false };
        let full = |v| Some(State { value: v, ts: 0.0 });
        for random in 0..50u64 {
            let plan = Plan::adjust(&take(3.0), 0, random).unwrap();
            assert_eq!(plan.slots().len(), 2, "two sampled shards");
            let mut states = [full(2.0), full(8.0)];
            let outcome = plan.decide(0.0, &mut states);
            assert_eq!(states, [full(2.0), full(5.0)], "taken from the fuller");
            assert_eq!(outcome.value, Some(20.0));
            assert_eq!(outcome.changed.as_slice(), &[false, true]);
            let plan = Plan::adjust(&take(-9.0), 0, random).unwrap();
            let mut states = [full(2.0), full(8.0)];
            plan.decide(0.0, &mut states);
            assert_eq!(states, [full(10.0), full(8.0)], "given to the emptier; 1 dropped");
        }
        // Two shards: both sampled.
        let two = Config::token_bucket(20.0, MINUTE).with_shards(2);
        let plan = Plan::adjust(&Take { config: two, ..take(1.0) }, 0, 3).unwrap();
        assert_eq!(plan.slots().len(), 2);
    }

    #[test]
    fn adjust_counts_must_be_finite() {
        let config = Config::token_bucket(10.0, MINUTE);
        for count in [f64::NAN, f64::INFINITY, -2e15] {
            let take = Take { name: "n", key: None, config, count, reserve: false };
            let err = Plan::adjust(&take, 0, 0).unwrap_err();
            assert!(err.to_string().starts_with("Rate limit n adjust count "), "{err}");
        }
    }

    #[test]
    fn a_leased_cap_bounds_what_an_adjust_gives_back() {
        let config = Config::fixed_window(10.0, MINUTE).with_start(0.0);
        let take = Take { name: "n", key: None, config, count: -8.0, reserve: false };
        let plan = Plan::adjust(&take, 0, 0).unwrap();
        let mut states = [Some(State { value: 1.0, ts: 0.0 })];
        // 6 tokens leased out: the state may hold at most 4.
        let outcome = plan.decide_under(1.0, &mut states, &[4.0]);
        assert_eq!(states[0].unwrap().value, 4.0);
        assert_eq!(outcome.value, Some(4.0));
        // A fixed window's debt waits for whole windows.
        let debt = Plan::adjust(&Take { count: 25.0, ..take }, 0, 0).unwrap();
        let outcome = debt.decide(30_000.0, &mut states);
        assert_eq!(outcome.value, Some(-21.0));
        assert_eq!(outcome.retry_after, Some(3.0 * MINUTE - 30_000.0));
    }

    #[test]
    fn only_sharded_takes_over_two_slots_split() {
        let mut one = Plan::new(true);
        let t = Take {
            name: "n",
            key: None,
            config: Config::token_bucket(1.0, MINUTE),
            count: 1.0,
            reserve: false,
        };
        one.push(&t, 0, 1).unwrap();
        assert!(one.split(0.0, &[None]).is_none());
        let mut two = Plan::new(true);
        let sharded = Take { config: Config::token_bucket(30.0, MINUTE).with_shards(3), ..t };
        two.push(&sharded, 0, 1).unwrap();
        two.push(&t, 0, 1).unwrap();
        assert!(two.split(0.0, &[None, None, None]).is_none(), "a transaction does not split");
    }
}
