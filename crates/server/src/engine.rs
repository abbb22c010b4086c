//! The operations of SPEC §4 on JSON bodies, shared by the HTTP server and the simulator:
//! one place decides what every request answers, with which status and header fields.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;

use axum::http::{HeaderName, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use tollgate::tower::fields;
use tollgate::{Call, Config, Error, RateLimiter, RawConfig, Request, Status, Target};

use crate::answer::decision_json;
use crate::answer::{Answer, Body, number};
use crate::store::DynStore;

const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RETRY_AFTER: HeaderName = HeaderName::from_static("retry-after");
/// The version of the config a `GET /v1/config` shows.
pub const CONFIG_VERSION: HeaderName = HeaderName::from_static("tollgate-config-version");

/// The largest request body accepted, in bytes.
pub const MAX_BODY: usize = 64 * 1024;

/// An operation of the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `POST /v1/limit`.
    Limit,
    /// `POST /v1/check`.
    Check,
    /// `POST /v1/transaction`.
    Transaction,
    /// `POST /v1/reset`.
    Reset,
    /// `POST /v1/value`.
    Value,
    /// `POST /v1/adjust`.
    Adjust,
    /// `POST /v1/acquire`: slots of a concurrency limit (SPEC §6f).
    Acquire,
    /// `POST /v1/release`.
    Release,
    /// `POST /v1/renew`.
    Renew,
}

impl Op {
    /// The name used in paths, the simulator's `op` and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Op::Limit => "limit",
            Op::Check => "check",
            Op::Transaction => "transaction",
            Op::Reset => "reset",
            Op::Value => "value",
            Op::Adjust => "adjust",
            Op::Acquire => "acquire",
            Op::Release => "release",
            Op::Renew => "renew",
        }
    }

    /// The method and path it is asked on, which names its span when tracing.
    pub fn route(self) -> &'static str {
        match self {
            Op::Limit => "POST /v1/limit",
            Op::Check => "POST /v1/check",
            Op::Transaction => "POST /v1/transaction",
            Op::Reset => "POST /v1/reset",
            Op::Value => "POST /v1/value",
            Op::Adjust => "POST /v1/adjust",
            Op::Acquire => "POST /v1/acquire",
            Op::Release => "POST /v1/release",
            Op::Renew => "POST /v1/renew",
        }
    }

    /// The operation named `name`.
    pub fn parse(name: &str) -> Option<Op> {
        [
            Op::Limit,
            Op::Check,
            Op::Transaction,
            Op::Reset,
            Op::Value,
            Op::Adjust,
            Op::Acquire,
            Op::Release,
            Op::Renew,
        ]
        .into_iter()
        .find(|op| op.name() == name)
    }
}

/// One limit request as sent: SPEC §6's `{ name, key?, count?, reserve?, throws?, config? }`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LimitBody<'b> {
    // Borrowed from the request body unless the JSON string has escapes.
    #[serde(borrow)]
    name: Cow<'b, str>,
    #[serde(default, borrow)]
    key: Option<Cow<'b, str>>,
    #[serde(default)]
    count: Option<f64>,
    #[serde(default)]
    reserve: bool,
    #[serde(default)]
    throws: bool,
    #[serde(default, deserialize_with = "object_or_null")]
    config: Option<RawConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TransactionBody<'b> {
    #[serde(borrow, deserialize_with = "objects")]
    limits: Vec<LimitBody<'b>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ResetBody {
    name: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default, deserialize_with = "object_or_null")]
    config: Option<RawConfig>,
}

/// SPEC §6's `{ name, key?, count, config? }` of `POST /v1/adjust`: `count` is required
/// and signed.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AdjustBody {
    name: String,
    #[serde(default)]
    key: Option<String>,
    count: f64,
    #[serde(default, deserialize_with = "object_or_null")]
    config: Option<RawConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ValueBody {
    name: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    sample_shards: Option<f64>,
    #[serde(default, deserialize_with = "object_or_null")]
    config: Option<RawConfig>,
}

/// SPEC §6f's `{ name, key?, count?, ttl?, throws? }` of `POST /v1/acquire`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AcquireBody {
    name: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    count: Option<f64>,
    #[serde(default)]
    ttl: Option<f64>,
    #[serde(default)]
    throws: bool,
}

/// `{ name, key?, ticket }` of `POST /v1/release`, and `{ name, key?, ticket, ttl? }` of
/// `POST /v1/renew`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TicketBody {
    name: String,
    #[serde(default)]
    key: Option<String>,
    ticket: TicketId,
    #[serde(default)]
    ttl: Option<f64>,
}

/// A ticket as a client sends it back: the string an acquire answered, or its number.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TicketId {
    Text(String),
    Number(f64),
}

impl TicketId {
    fn id(&self) -> Result<u64, Answer> {
        let id = match self {
            TicketId::Text(text) => text.parse::<u64>().ok(),
            TicketId::Number(n)
                if n.fract() == 0.0 && (0.0..9.007_199_254_740_992e15).contains(n) =>
            {
                Some(*n as u64)
            }
            TicketId::Number(_) => None,
        };
        id.ok_or_else(|| {
            Answer::error(
                StatusCode::BAD_REQUEST,
                "ticket: it must be the ticket an acquire answered (a string of digits)",
            )
        })
    }
}

/// A count of slots as a body carries it (a JSON number): a whole number from 1 to the
/// most a limit may have, or the error that says so.
fn slot_count(count: Option<f64>) -> Result<Option<u32>, Answer> {
    match count {
        None => Ok(None),
        Some(n)
            if n.fract() == 0.0
                && (1.0..=f64::from(tollgate::core::slots::MAX_SLOTS)).contains(&n) =>
        {
            Ok(Some(n as u32))
        }
        Some(n) => Err(Answer::error(
            StatusCode::BAD_REQUEST,
            format!("count is {}; it must be a whole number of at least 1", number(n)),
        )),
    }
}

/// An acquire (or its check) of `count` slots (one if none) of `key`, or the answer that
/// says the count is not one.
fn acquire_request(key: Option<&str>, count: Option<f64>) -> Result<tollgate::Acquire<'_>, Answer> {
    let mut request = tollgate::Acquire::new();
    if let Some(key) = key {
        request = request.key(key);
    }
    if let Some(count) = slot_count(count)? {
        request = request.count(count);
    }
    Ok(request)
}

/// A JSON object read into `T`, and nothing else: serde reads a struct from an array too
/// (its fields in order), which the API does not take (`["api"]` is not a request for
/// the limit `api`).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Fields<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                // The same map, read by T: strings are still borrowed from the body.
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        deserializer.deserialize_map(Fields(std::marker::PhantomData)).map(Object)
    }
}

/// An optional field that, when present, is an object (or `null`).
fn object_or_null<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    Ok(Option::<Object<T>>::deserialize(deserializer)?.map(|o| o.0))
}

/// An array of objects.
fn objects<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Vec<T>, D::Error> {
    Ok(Vec::<Object<T>>::deserialize(deserializer)?.into_iter().map(|o| o.0).collect())
}

/// What a request may carry besides the name of a limit the server defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permissions {
    /// A config of its own for a name the server does not define (`allowInlineConfig`).
    pub inline_config: bool,
    /// A config of its own for a name the server defines (`allowConfigOverride`): without
    /// it, a defined limit's config belongs to the server, and any client could lift it.
    pub config_override: bool,
}

impl Default for Permissions {
    fn default() -> Self {
        Permissions { inline_config: true, config_override: false }
    }
}

/// Runs the operations of the API over the limits defined now: a reload of the config
/// ([`Engine::replace`]) swaps them at once, and a request finishes under the ones it
/// started with (one atomic load of an `Arc` per request, no lock).
pub struct Engine {
    current: ArcSwap<Defined>,
    /// Requests granted by limiters replaced since (each counts its own).
    failed_open_before: AtomicU64,
    /// Per name, what `limit` and `transaction` requests took, for the dashboard.
    pub stats: crate::stats::Stats,
    /// The store's leased limits, if it has any: `/v1/value` and `/v1/stats` report them.
    pub leases: Option<crate::store::Leasing>,
    /// The store whose states a reload carries to a changed config (none: nothing is
    /// carried, as in the simulator, whose states live no longer than a run).
    pub stored: Option<crate::store::Stored>,
    /// The largest body [`Engine::run`] takes: [`MAX_BODY`] for a body read from a network;
    /// none in process ([`Engine::in_process`]), where the application builds its bodies
    /// itself (a transaction of thousands of limits is a body of 100 KB).
    max_body: Option<usize>,
}

/// The limits of one config: the limiter with its defined names, what requests may carry,
/// and the `RateLimit-Policy` members of the names.
pub struct Defined {
    limiter: RateLimiter<DynStore>,
    permissions: Permissions,
    /// `RateLimit-Policy` members of the defined limits, made once, with their capacities.
    policies: std::collections::HashMap<String, (String, f64)>,
    /// The version of the config they come from (a digest of what was read), if any.
    pub version: String,
    /// When they were loaded (Unix ms).
    pub loaded_at: u64,
}

impl Defined {
    /// The limits of `limiter`, with what requests may carry as the config file's
    /// `[server]` says.
    pub fn new(limiter: RateLimiter<DynStore>, permissions: Permissions) -> Self {
        let policies = limiter
            .defined()
            .map(|(name, config)| {
                (name.to_owned(), (fields::policy_member(name, config), config.capacity()))
            })
            .collect();
        Defined { limiter, permissions, policies, version: String::new(), loaded_at: now_ms() }
    }

    /// The limits of `settings` over `store`, marked with `version`: what the server serves
    /// at start and after a reload.
    pub fn of_settings(
        store: DynStore,
        settings: &crate::config::Settings,
        version: String,
    ) -> Self {
        let mut builder = RateLimiter::builder(store);
        for (name, config) in &settings.limits {
            builder = builder.define(name.as_str(), *config);
        }
        for name in &settings.fail_open {
            builder = builder.fail_open(name.as_str());
        }
        for (name, limit) in &settings.concurrency {
            builder = builder.define_concurrency(name.as_str(), *limit);
        }
        let permissions = Permissions {
            inline_config: settings.allow_inline_config,
            config_override: settings.allow_config_override,
        };
        Defined::new(builder.build(), permissions).with_version(version)
    }

    /// The same, marked as the config of `version`.
    #[must_use]
    pub fn with_version(mut self, version: String) -> Self {
        self.version = version;
        self
    }

    /// The limiter.
    pub fn limiter(&self) -> &RateLimiter<DynStore> {
        &self.limiter
    }

    /// What requests may carry besides a defined name.
    pub fn permissions(&self) -> Permissions {
        self.permissions
    }
}

impl Engine {
    /// An engine over `limiter`, with what requests may carry as the config file's
    /// `[server]` says.
    pub fn new(limiter: RateLimiter<DynStore>, permissions: Permissions) -> Self {
        Self::serving(Defined::new(limiter, permissions))
    }

    /// An engine over `store` (the store `opened` gave, or that store wrapped) with the
    /// limits of `settings`, reporting `opened`'s leases and carrying its states on a reload.
    pub fn opened(
        store: DynStore,
        opened: &crate::store::Opened,
        settings: &crate::config::Settings,
        version: String,
    ) -> Self {
        let mut engine = Self::serving(Defined::of_settings(store, settings, version));
        engine.leases = opened.leases.clone();
        engine.stored = Some(opened.stored.clone());
        engine
    }

    /// The engine of an in-process package (Node, Python) over the store `opened` gave, with
    /// the limits of `settings`: as [`Engine::opened`], counting no stats (no dashboard
    /// reads them there, and a count's lock, lookup and clock read were a tenth of a call).
    pub fn in_process(opened: &crate::store::Opened, settings: &crate::config::Settings) -> Self {
        let mut engine = Self::opened(opened.store.clone(), opened, settings, String::new());
        engine.stats = crate::stats::Stats::off();
        engine.max_body = None;
        engine
    }

    /// An engine serving `defined`.
    pub fn serving(defined: Defined) -> Self {
        Engine {
            current: ArcSwap::from_pointee(defined),
            failed_open_before: AtomicU64::new(0),
            stats: crate::stats::Stats::default(),
            leases: None,
            stored: None,
            max_body: Some(MAX_BODY),
        }
    }

    /// The limits defined now.
    pub fn current(&self) -> Arc<Defined> {
        self.current.load_full()
    }

    /// Serves `defined` from the next request on (requests in flight finish under
    /// the old ones); every state in the store is kept.
    pub fn replace(&self, defined: Defined) {
        let old = self.current.swap(Arc::new(defined));
        self.failed_open_before.fetch_add(old.limiter.failed_open(), Ordering::Relaxed);
    }

    /// How many requests were granted because the store failed and their limits fail open,
    /// under every config served.
    pub fn failed_open(&self) -> u64 {
        self.failed_open_before.load(Ordering::Relaxed) + self.current().limiter.failed_open()
    }

    /// `GET /v1/stats?offset=N&limit=M`: the defined limits (their config, and in words),
    /// then the other names requests came for, with what `limit` and `transaction` took per
    /// 10 s over the last 10 minutes (oldest first): `limit` of them (at most
    /// [`STATS_PAGE`], the default) from the `offset`-th (default 0), and how many there are
    /// in all (`total`). A config of a million limits once answered 534 MB in 29 s here, and
    /// the dashboard polls it.
    pub fn stats(&self, query: Option<&str>) -> Answer {
        let (offset, page) = match stats_page(query) {
            Ok(page) => page,
            Err(message) => return Answer::error(StatusCode::BAD_REQUEST, message),
        };
        let now = now_ms();
        let mut counted: std::collections::BTreeMap<String, crate::stats::Counts> =
            self.stats.snapshot(now).into_iter().collect();
        let zeros = || vec![0u64; crate::stats::BUCKETS];
        let mut limits = Vec::new();
        let current = self.current();
        let mut defined: Vec<(&str, &Config)> = current.limiter.defined().collect();
        let leased = self.lease_stats();
        defined.sort_by_key(|(name, _)| *name);
        let others: Vec<String> = counted
            .keys()
            .filter(|name| current.limiter.defined_config(name).is_none())
            .cloned()
            .collect();
        let total = defined.len() + others.len();
        let entry = |name: &str, config: Option<&Config>, counts: Option<crate::stats::Counts>| {
            let counts = counts.unwrap_or(crate::stats::Counts {
                granted: zeros(),
                refused: zeros(),
                reserved: zeros(),
            });
            let mut entry = json!({
                "name": name,
                "config": config.map(Config::to_raw),
                "words": config.map(crate::plot::describe),
                "granted": counts.granted,
                "refused": counts.refused,
                "reserved": counts.reserved,
            });
            if let Some(lease) = leased.get(name) {
                entry["lease"] = lease.clone();
            }
            entry
        };
        let first_other = offset.saturating_sub(defined.len());
        for (name, config) in defined.into_iter().skip(offset).take(page) {
            limits.push(entry(name, Some(config), counted.remove(name)));
        }
        let left = page - limits.len();
        for name in others.iter().skip(first_other).take(left) {
            limits.push(entry(name, None, counted.remove(name.as_str())));
        }
        Answer::ok(json!({
            "now": now,
            "bucketMs": crate::stats::BUCKET_MS,
            "offset": offset,
            "total": total,
            "limits": limits,
        }))
    }

    /// Per leased name, what its leases did in this process, summed over its keys.
    fn lease_stats(&self) -> std::collections::HashMap<String, Value> {
        let Some(leasing) = &self.leases else { return std::collections::HashMap::new() };
        let mut sums: std::collections::HashMap<String, tollgate::store::LeaseStats> =
            std::collections::HashMap::new();
        for (name, _, s) in leasing.stats() {
            let sum = sums.entry(name).or_default();
            sum.grants += s.grants;
            sum.returns += s.returns;
            sum.local += s.local;
            sum.direct += s.direct;
            sum.refused += s.refused;
            sum.waited += s.waited;
            sum.held += s.held;
            sum.elsewhere += s.elsewhere;
            sum.holders = sum.holders.max(s.holders);
            // The farthest any key of it saw (NaN, the sum's start, loses to any number).
            sum.round_trip = sum.round_trip.max(s.round_trip);
        }
        for (name, _) in self.current().limiter.defined() {
            if leasing.leases(name) {
                sums.entry(name.to_owned()).or_default();
            }
        }
        let names: std::collections::HashMap<String, tollgate::store::LeasedName> =
            leasing.names().into_iter().map(|n| (n.name.clone(), n)).collect();
        let lease = |name: &str, s: tollgate::store::LeaseStats| {
            let named = names.get(name);
            json!({
                "grants": s.grants,
                "returns": s.returns,
                "local": s.local,
                "direct": s.direct,
                "refused": s.refused,
                "waited": s.waited,
                "held": number(s.held),
                "roundTrip": number(s.round_trip),
                "elsewhere": number(s.elsewhere),
                "holders": s.holders,
                "keys": named.map_or(0, |n| n.keys),
                "cold": named.map_or(0, |n| n.cold),
            })
        };
        sums.into_iter().map(|(name, s)| (name.clone(), lease(&name, s))).collect()
    }

    /// Answers `op` with the JSON `body`. Nothing is consumed by a request answered with an
    /// error. A body over [`MAX_BODY`] is refused (413), but by an in-process engine
    /// ([`Engine::in_process`]).
    pub async fn run(&self, op: Op, body: &[u8]) -> Answer {
        if let Some(max) = self.max_body.filter(|&max| body.len() > max) {
            return Answer::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is {} bytes; the most is {max}", body.len()),
            );
        }
        self.run_in_process(op, body).await
    }

    /// [`Engine::run`] without [`MAX_BODY`], whatever the engine. An in-process engine's
    /// [`Engine::run`] takes any size already: call that.
    pub async fn run_in_process(&self, op: Op, body: &[u8]) -> Answer {
        let defined = self.current();
        let (d, stats) = (&*defined, &self.stats);
        let result = match op {
            Op::Limit => match parse(body) {
                Ok(b) => d.single(b, true, stats).await,
                Err(answer) => Err(answer),
            },
            Op::Check => match parse(body) {
                Ok(b) => d.single(b, false, stats).await,
                Err(answer) => Err(answer),
            },
            Op::Transaction => match parse(body) {
                Ok(b) => d.transaction(b, stats).await,
                Err(answer) => Err(answer),
            },
            Op::Reset => match parse(body) {
                Ok(b) => d.reset(b).await,
                Err(answer) => Err(answer),
            },
            Op::Value => match parse(body) {
                Ok(b) => d.value(b, self.leases.as_ref()).await,
                Err(answer) => Err(answer),
            },
            Op::Adjust => match parse(body) {
                Ok(b) => d.adjust(b).await,
                Err(answer) => Err(answer),
            },
            Op::Acquire => match parse(body) {
                Ok(b) => d.acquire(b).await,
                Err(answer) => Err(answer),
            },
            Op::Release => match parse(body) {
                Ok(b) => d.release(b).await,
                Err(answer) => Err(answer),
            },
            Op::Renew => match parse(body) {
                Ok(b) => d.renew(b).await,
                Err(answer) => Err(answer),
            },
        };
        result.unwrap_or_else(|answer| answer)
    }

    /// A `limit` (`writes`) or `check` of a limit defined here, without a body: what the
    /// in-process packages (Node, Python) call for their most frequent calls. The same
    /// decision, stats and errors as [`Engine::run`] with `{name, key, count, reserve}`; no
    /// header fields.
    ///
    /// # Errors
    ///
    /// The answer [`Engine::run`] would give: a name not defined, a bad count, the store's
    /// failure.
    pub async fn take(
        &self,
        name: &str,
        key: Option<&str>,
        count: Option<f64>,
        reserve: bool,
        writes: bool,
    ) -> Result<tollgate::Decision, Answer> {
        let defined = self.current();
        let target = defined.target(name, None)?;
        let decision = defined.take(target, key, count, reserve, writes).await?;
        if writes && self.stats.counts() {
            let taken = crate::stats::Taken::of(decision.ok, decision.retry_after);
            self.stats.record(name, taken, now_ms());
        }
        Ok(decision)
    }

    /// The limit defined as `name`, its config looked up now rather than at each take:
    /// what the in-process packages take by. `None` if no limit has that name.
    ///
    /// It keeps the limits of when it was made (a reload by [`Engine::replace`] does not
    /// reach it) and counts no stats: it is for the in-process engines
    /// ([`Engine::in_process`]), which do neither.
    pub fn named(&self, name: &str) -> Option<Named> {
        let defined = self.current();
        let config = defined.limiter.defined_config(name)?;
        let memory = match &self.stored {
            Some(crate::store::Stored::Memory(memory)) => {
                Some(defined.limiter.on(Arc::clone(memory)))
            }
            _ => None,
        };
        Some(Named { defined, name: name.into(), config, memory })
    }

    /// The limits `limits` (each a defined name, and the count taken from it: 1 if none),
    /// taken together all or nothing with one key, their configs looked up now: what the
    /// in-process packages' middleware takes by. `None` if a name is not defined.
    ///
    /// As [`Engine::named`], it keeps the limits of when it was made and counts no stats.
    pub fn named_limits(&self, limits: &[(&str, Option<f64>)]) -> Option<NamedLimits> {
        let defined = self.current();
        let mut named = Vec::with_capacity(limits.len());
        for &(name, count) in limits {
            let config = defined.limiter.defined_config(name)?;
            named.push((Arc::<str>::from(name), config, count.unwrap_or(1.0)));
        }
        let memory = match &self.stored {
            Some(crate::store::Stored::Memory(memory)) => {
                Some(defined.limiter.on(Arc::clone(memory)))
            }
            _ => None,
        };
        Some(NamedLimits { defined, limits: named, memory })
    }

    /// A decision of [`Engine::take`] as one number, what the in-process packages hand
    /// across: `-1` granted with tokens on hand, `w >= 0` granted after a wait of `w` ms (a
    /// reservation), `-2 - w` refused, retry in `w` ms.
    pub fn decision_number(decision: tollgate::Decision) -> f64 {
        match (decision.ok, decision.retry_after) {
            (true, None) => -1.0,
            (true, Some(wait)) => wait,
            (false, wait) => -2.0 - wait.unwrap_or(0.0),
        }
    }

    /// `GET /v1/time`: the store's clock.
    pub async fn time(&self) -> Answer {
        match self.current().limiter.store().read_async(&[]).await {
            Ok((now, _)) => Answer::ok(json!({ "now": number(now) })),
            Err(err) => store_failed(&err),
        }
    }

    /// `GET /v1/config`: the named limits, every default filled in, and the version of the
    /// config they come from (`Tollgate-Config-Version`).
    pub fn config(&self) -> Answer {
        let current = self.current();
        let mut limits: BTreeMap<&str, Value> = current
            .limiter
            .defined()
            .map(|(name, config)| (name, serde_json::to_value(config).unwrap_or_default()))
            .collect();
        for (name, limit) in current.limiter.defined_concurrency() {
            let config =
                json!({ "kind": "concurrency", "max": limit.max(), "ttl": number(limit.ttl()) });
            limits.insert(name, config);
        }
        let mut answer = Answer::ok(serde_json::to_value(limits).unwrap_or_default());
        if !current.version.is_empty() {
            answer.headers.push((CONFIG_VERSION, current.version.clone()));
        }
        answer
    }
}

/// A limit defined in an engine, its config looked up once (see [`Engine::named`]).
pub struct Named {
    defined: Arc<Defined>,
    name: Arc<str>,
    config: Config,
    /// The limiter on the memory store as itself, when that is the store: its takes are
    /// made there without a future ([`Named::take_now`]).
    memory: Option<RateLimiter<Arc<tollgate::MemoryStore>>>,
}

impl Named {
    /// [`Named::take`] on the memory store, answered now, through the store's own type (no
    /// future is made, and the store's code is inlined here); `None` on another store.
    ///
    /// # Errors
    ///
    /// As for [`Engine::take`].
    #[inline]
    pub fn take_now(
        &self,
        key: Option<&str>,
        count: Option<f64>,
        reserve: bool,
        writes: bool,
    ) -> Option<Result<tollgate::Decision, Answer>> {
        let memory = self.memory.as_ref()?;
        let target = Target::Inline(&self.name, self.config);
        let request = Defined::request_of(key, count, reserve);
        let decision =
            if writes { memory.limit(target, request) } else { memory.check(target, request) };
        Some(decision.map_err(|e| self.defined.error(e)))
    }

    /// [`Engine::take`] of this limit: the same decision and errors.
    ///
    /// # Errors
    ///
    /// As for [`Engine::take`].
    pub async fn take(
        &self,
        key: Option<&str>,
        count: Option<f64>,
        reserve: bool,
        writes: bool,
    ) -> Result<tollgate::Decision, Answer> {
        let target = Target::Inline(&self.name, self.config);
        self.defined.take(target, key, count, reserve, writes).await
    }
}

/// Limits defined in an engine, taken together (see [`Engine::named_limits`]).
pub struct NamedLimits {
    defined: Arc<Defined>,
    /// Each limit's name, config and count.
    limits: Vec<(Arc<str>, Config, f64)>,
    /// As [`Named`]'s: the limiter on the memory store as itself, when that is the store.
    memory: Option<RateLimiter<Arc<tollgate::MemoryStore>>>,
}

impl NamedLimits {
    /// How many limits are taken.
    pub fn len(&self) -> usize {
        self.limits.len()
    }

    /// Whether no limit is taken.
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// [`NamedLimits::take`] on the memory store, answered now (no future is made); `None`
    /// on another store.
    ///
    /// # Errors
    ///
    /// As for [`NamedLimits::take`].
    pub fn take_now(
        &self,
        key: Option<&str>,
    ) -> Option<Result<tollgate::TransactionTaken, Answer>> {
        let memory = self.memory.as_ref()?;
        let taken = match &*self.limits {
            [(name, config, count)] => memory
                .limit_with_status(
                    Target::Inline(name, *config),
                    Defined::request_of(key, Some(*count), false),
                )
                .map(transaction_of_one),
            _ => memory.transaction_with_status(&self.calls(key)),
        };
        Some(taken.map_err(|e| self.defined.error(e)))
    }

    /// The transaction of every limit with `key` (or none), all or nothing, with what each
    /// limit has left: the decision and statuses of a `transaction` of [`Engine::run`] with
    /// the same limits, key and counts, and its errors.
    ///
    /// # Errors
    ///
    /// The answer [`Engine::run`] would give: a bad count, the store's failure.
    pub async fn take(&self, key: Option<&str>) -> Result<tollgate::TransactionTaken, Answer> {
        let limiter = &self.defined.limiter;
        let taken = match &*self.limits {
            [(name, config, count)] => limiter
                .limit_with_status_async(
                    Target::Inline(name, *config),
                    Defined::request_of(key, Some(*count), false),
                )
                .await
                .map(transaction_of_one),
            _ => limiter.transaction_with_status_async(&self.calls(key)).await,
        };
        taken.map_err(|e| self.defined.error(e))
    }

    /// The call of each limit with `key`.
    fn calls<'a>(&'a self, key: Option<&'a str>) -> Vec<Call<'a>> {
        let call = |(name, config, count): &'a (Arc<str>, Config, f64)| {
            Target::Inline(name, *config).with(Defined::request_of(key, Some(*count), false))
        };
        self.limits.iter().map(call).collect()
    }
}

/// One limit's take as the transaction of it alone: the same decision and status. A take
/// of one limit goes the store's single path, which on Redis is a lighter script than a
/// transaction's (half the cost of a middleware's decision, by `bench.mjs`).
fn transaction_of_one(taken: tollgate::Taken) -> tollgate::TransactionTaken {
    let decision = taken.decision;
    // Pushed: a collect of one went through the vector's general extend (3% of a decision).
    let (mut results, mut statuses) =
        (tollgate::core::Inline::new(), tollgate::core::Inline::new());
    results.push(decision);
    statuses.push(taken.status);
    tollgate::TransactionTaken {
        decision: tollgate::TransactionDecision {
            ok: decision.ok,
            retry_after: decision.retry_after,
            results,
        },
        statuses,
    }
}

impl Defined {
    /// A `limit` (`writes`) or `check` of `target`, as [`Engine::take`] and [`Named::take`]
    /// make it.
    async fn take(
        &self,
        target: Target<'_>,
        key: Option<&str>,
        count: Option<f64>,
        reserve: bool,
        writes: bool,
    ) -> Result<tollgate::Decision, Answer> {
        let request = Defined::request_of(key, count, reserve);
        let decision = if writes {
            self.limiter.limit_async(target, request).await
        } else {
            self.limiter.check_async(target, request).await
        };
        decision.map_err(|e| self.error(e))
    }

    fn target<'a>(&self, name: &'a str, config: Option<&RawConfig>) -> Result<Target<'a>, Answer> {
        if name.is_empty() {
            // With a config or without: no limit has no name.
            return Err(Answer::error(
                StatusCode::BAD_REQUEST,
                "Rate limit name must not be empty.",
            ));
        }
        let defined = self.limiter.defined_config(name).is_some();
        match config {
            None if defined => Ok(Target::Named(name)),
            None => Err(not_defined(name)),
            Some(_) if defined && !self.permissions.config_override => Err(Answer::error(
                StatusCode::BAD_REQUEST,
                format!("Rate limit {name} is defined by the server; send no config for it."),
            )),
            Some(_) if !defined && !self.permissions.inline_config => Err(Answer::error(
                StatusCode::BAD_REQUEST,
                "inline configs are not allowed on this server (allowInlineConfig = false); \
                 use a limit defined in its config file",
            )),
            Some(raw) => Config::try_from(raw)
                .map(|config| Target::Inline(name, config))
                .map_err(|e| Answer::error(StatusCode::BAD_REQUEST, e.to_string())),
        }
    }

    fn request<'a>(body: &'a LimitBody<'_>) -> Request<'a> {
        // `throws` is applied after the decision, so a 429 carries the same header fields as
        // any refusal.
        Self::request_of(body.key.as_deref(), body.count, body.reserve)
    }

    fn request_of(key: Option<&str>, count: Option<f64>, reserve: bool) -> Request<'_> {
        let mut request = Request::new().count(count.unwrap_or(1.0));
        if let Some(key) = key {
            request = request.key(key);
        }
        if reserve {
            request = request.reserve();
        }
        request
    }

    /// The targets of a transaction's rate limits and their calls, in the body's order (or
    /// the answer that says which limit is unknown or badly configured).
    #[allow(clippy::type_complexity)]
    fn calls<'l>(
        &self,
        limits: &[&'l LimitBody<'_>],
    ) -> Result<(Vec<(&'l str, Target<'l>)>, Vec<Call<'l>>), Answer> {
        let targets = limits
            .iter()
            .map(|l| Ok((&*l.name, self.target(&l.name, l.config.as_ref())?)))
            .collect::<Result<Vec<_>, Answer>>()?;
        let calls =
            limits.iter().zip(&targets).map(|(l, (_, t))| t.with(Self::request(l))).collect();
        Ok((targets, calls))
    }

    async fn single(
        &self,
        body: LimitBody<'_>,
        writes: bool,
        stats: &crate::stats::Stats,
    ) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.to_string());
        if let Some(limit) = self.concurrency(&body.name, body.config.is_some())? {
            return self.check_slots(&body, limit, writes).await;
        }
        let target = self.target(&body.name, body.config.as_ref())?;
        let request = Self::request(&body);
        let taken = if writes {
            self.limiter.limit_with_status_async(target, request).await
        } else {
            self.limiter.check_with_status_async(target, request).await
        };
        let taken = taken.map_err(|e| self.error(e))?;
        let (ok, retry_after) = (taken.decision.ok, taken.decision.retry_after);
        if writes && stats.counts() {
            stats.record(&body.name, crate::stats::Taken::of(ok, retry_after), now_ms());
        }
        let mut answer = if !ok && body.throws {
            rate_limited(&body.name, retry_after.unwrap_or(0.0))
        } else {
            Answer {
                status: StatusCode::OK,
                body: Body::Decision { ok, retry_after },
                headers: Vec::new(),
                outcome: "ok",
            }
        };
        self.rate_limit_headers(
            &mut answer,
            &[(&body.name, target)],
            &[taken.status],
            retry_after,
            ok,
        );
        Ok(answer)
    }

    async fn transaction(
        &self,
        body: TransactionBody<'_>,
        stats: &crate::stats::Stats,
    ) -> Result<Answer, Answer> {
        if body.limits.is_empty() {
            return Err(Answer::error(
                StatusCode::BAD_REQUEST,
                "limits: a transaction needs at least one limit",
            ));
        }
        crate::otel::note("tollgate.limits", || {
            body.limits.iter().map(|l| &*l.name).collect::<Vec<_>>().join(",")
        });
        let mut slots = body.limits.iter().enumerate().filter(|(_, l)| {
            l.config.is_none() && self.limiter.concurrency_limit(&l.name).is_some()
        });
        if let Some((at, _)) = slots.next() {
            if let Some((_, second)) = slots.next() {
                return Err(Answer::error(
                    StatusCode::BAD_REQUEST,
                    format!("{}: a transaction takes at most one concurrency limit", second.name),
                ));
            }
            return self.transaction_with_slot(&body, at, stats).await;
        }
        let limits: Vec<&LimitBody<'_>> = body.limits.iter().collect();
        let (targets, calls) = self.calls(&limits)?;
        let taken =
            self.limiter.transaction_with_status_async(&calls).await.map_err(|e| self.error(e))?;
        let t = &taken.decision;
        record_transaction(stats, &limits, &t.results, t.ok);
        let mut answer = if let Some(refusal) = thrown(&body.limits, &t.results, t.ok) {
            refusal
        } else {
            let results: Vec<Value> =
                t.results.iter().map(|d| decision_json(d.ok, d.retry_after)).collect();
            let mut body = decision_json(t.ok, t.retry_after);
            body["results"] = Value::Array(results);
            Answer::ok(body)
        };
        self.rate_limit_headers(&mut answer, &targets, &taken.statuses, t.retry_after, t.ok);
        Ok(answer)
    }

    /// A transaction with a concurrency limit at `at` (SPEC §6f): its slot and the rate
    /// limits' tokens taken all or nothing. Its result carries the ticket (`ticket`,
    /// `expiresAt`) when every limit granted; it is held for the limit's `ttl`.
    async fn transaction_with_slot(
        &self,
        body: &TransactionBody<'_>,
        at: usize,
        stats: &crate::stats::Stats,
    ) -> Result<Answer, Answer> {
        let slot = &body.limits[at];
        let limit = self.concurrency_named(&slot.name)?;
        if slot.reserve {
            let said = format!("{}: a concurrency limit takes no reserve", slot.name);
            return Err(Answer::error(StatusCode::BAD_REQUEST, said));
        }
        let request = acquire_request(slot.key.as_deref(), slot.count)?;
        let rates: Vec<&LimitBody<'_>> =
            body.limits.iter().enumerate().filter(|(i, _)| *i != at).map(|(_, l)| l).collect();
        let (targets, calls) = self.calls(&rates)?;
        let taken = self
            .limiter
            .acquire_with_async((&*slot.name, limit), request, &calls)
            .await
            .map_err(|e| self.error(e))?;
        record_transaction(stats, &rates, &taken.limits.decision.results, taken.ok);
        // The results in the body's order, the slot's at its place.
        let mut results: Vec<tollgate::Decision> = taken.limits.decision.results.to_vec();
        results.insert(at, taken.slot);
        let mut answer = if let Some(refusal) = thrown(&body.limits, &results, taken.ok) {
            refusal
        } else {
            let mut json: Vec<Value> =
                results.iter().map(|d| decision_json(d.ok, d.retry_after)).collect();
            if let Some(ticket) = taken.ticket {
                json[at]["ticket"] = Value::String(ticket.id.to_string());
                json[at]["expiresAt"] = number(ticket.expires_at);
            }
            let mut answer = decision_json(taken.ok, taken.retry_after);
            if let Some(ticket) = taken.ticket {
                answer["ticket"] = Value::String(ticket.id.to_string());
                answer["expiresAt"] = number(ticket.expires_at);
            }
            answer["results"] = Value::Array(json);
            Answer::ok(answer)
        };
        let statuses = &taken.limits.statuses;
        self.rate_limit_headers(&mut answer, &targets, statuses, taken.retry_after, taken.ok);
        Ok(answer)
    }

    /// Forgets every shard's state of (name, key), whatever config made them (SPEC §6): a
    /// name that only ever came with inline configs, or whose shards changed, is reset too.
    /// A config in the body is not needed; if there is one, it must be valid.
    async fn reset(&self, body: ResetBody) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        if let Some(raw) = &body.config {
            Config::try_from(raw)
                .map_err(|e| Answer::error(StatusCode::BAD_REQUEST, e.to_string()))?;
        }
        let key = body.key.as_deref();
        if self.concurrency(&body.name, body.config.is_some())?.is_some() {
            let name = body.name.as_str();
            self.limiter.reset_slots_async(name, key).await.map_err(|e| self.error(e))?;
            return Ok(Answer::ok(json!({})));
        }
        self.limiter.forget_async(&body.name, key).await.map_err(|e| self.error(e))?;
        Ok(Answer::ok(json!({})))
    }

    /// The concurrency limit defined as `name`, if it is one (a request with a config of
    /// its own is about a rate limit, and may not name a concurrency limit).
    fn concurrency(
        &self,
        name: &str,
        has_config: bool,
    ) -> Result<Option<tollgate::Concurrency>, Answer> {
        match self.limiter.concurrency_limit(name) {
            Some(_) if has_config => Err(Answer::error(
                StatusCode::BAD_REQUEST,
                format!(
                    "{name} is a concurrency limit defined by the server; send no config for it."
                ),
            )),
            found => Ok(found),
        }
    }

    /// The concurrency limit a slots request names, or the answer that says why not: a rate
    /// limit's name, or no limit's.
    fn concurrency_named(&self, name: &str) -> Result<tollgate::Concurrency, Answer> {
        if let Some(limit) = self.limiter.concurrency_limit(name) {
            return Ok(limit);
        }
        if self.limiter.defined_config(name).is_some() {
            return Err(Answer::error(
                StatusCode::BAD_REQUEST,
                format!(
                    "{name} is a rate limit; acquire, release and renew take a concurrency limit (kind = \"concurrency\")"
                ),
            ));
        }
        Err(Answer::error(
            StatusCode::NOT_FOUND,
            format!(
                "Concurrency limit {name} not defined. Define it in a {} table of the server's \
                 config file, with kind = \"concurrency\" and max.",
                crate::names::limits_table(name)
            ),
        ))
    }

    /// `check` of a concurrency limit (`limit` of one is an error: acquire it).
    async fn check_slots(
        &self,
        body: &LimitBody<'_>,
        limit: tollgate::Concurrency,
        writes: bool,
    ) -> Result<Answer, Answer> {
        let name = &*body.name;
        if writes {
            return Err(Answer::error(
                StatusCode::BAD_REQUEST,
                format!("{name} is a concurrency limit: take its slots with /v1/acquire"),
            ));
        }
        if body.reserve {
            return Err(Answer::error(
                StatusCode::BAD_REQUEST,
                "a concurrency limit has no reserve",
            ));
        }
        let request = acquire_request(body.key.as_deref(), body.count)?;
        let target = (name, limit);
        let decision =
            self.limiter.check_slots_async(target, request).await.map_err(|e| self.error(e))?;
        let mut answer = Answer {
            status: StatusCode::OK,
            body: Body::Decision { ok: decision.ok, retry_after: decision.retry_after },
            headers: Vec::new(),
            outcome: "ok",
        };
        refused_slots(&mut answer, decision.ok, decision.retry_after);
        Ok(answer)
    }

    /// `POST /v1/acquire`: `{ ok: true, ticket, expiresAt }`, or `{ ok: false, retryAfter }`
    /// (429 with `throws`).
    async fn acquire(&self, body: AcquireBody) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        let limit = self.concurrency_named(&body.name)?;
        let mut request = acquire_request(body.key.as_deref(), body.count)?;
        if let Some(ttl) = body.ttl {
            request = request.ttl(ttl);
        }
        let target = (body.name.as_str(), limit);
        let acquired =
            self.limiter.acquire_async(target, request).await.map_err(|e| self.error(e))?;
        Ok(match acquired {
            tollgate::Acquired::Granted(ticket) => Answer::ok(json!({
                "ok": true,
                "ticket": ticket.id.to_string(),
                "expiresAt": number(ticket.expires_at),
            })),
            tollgate::Acquired::Refused { retry_after } => {
                let mut answer = if body.throws {
                    rate_limited(&body.name, retry_after)
                } else {
                    Answer::ok(json!({ "ok": false, "retryAfter": number(retry_after) }))
                };
                refused_slots(&mut answer, false, Some(retry_after));
                answer
            }
        })
    }

    /// `POST /v1/release`: `{ released }`, false for a ticket unknown or expired.
    async fn release(&self, body: TicketBody) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        let limit = self.concurrency_named(&body.name)?;
        if body.ttl.is_some() {
            return Err(Answer::error(StatusCode::BAD_REQUEST, "ttl: a release takes none"));
        }
        let ticket = body.ticket.id()?;
        let target = (body.name.as_str(), limit);
        let released = self
            .limiter
            .release_async(target, body.key.as_deref(), ticket)
            .await
            .map_err(|e| self.error(e))?;
        Ok(Answer::ok(json!({ "released": released })))
    }

    /// `POST /v1/renew`: `{ ok: true, expiresAt }`, or `{ ok: false }` for a ticket that
    /// had expired (its slots may be someone else's now).
    async fn renew(&self, body: TicketBody) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        let limit = self.concurrency_named(&body.name)?;
        let ticket = body.ticket.id()?;
        let target = (body.name.as_str(), limit);
        let renewed = self
            .limiter
            .renew_async(target, body.key.as_deref(), ticket, body.ttl)
            .await
            .map_err(|e| self.error(e))?;
        Ok(Answer::ok(match renewed {
            Some(expires_at) => json!({ "ok": true, "expiresAt": number(expires_at) }),
            None => json!({ "ok": false }),
        }))
    }

    /// Settles a cost known only after the work (SPEC §4): `{ value, retryAfter? }`, never
    /// refused (a debt shows as a negative value and the wait until it is paid).
    async fn adjust(&self, body: AdjustBody) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        let target = self.target(&body.name, body.config.as_ref())?;
        let key = body.key.as_deref();
        let adjusted =
            self.limiter.adjust_async(target, key, body.count).await.map_err(|e| self.error(e))?;
        let mut answer = json!({ "value": number(adjusted.value) });
        if let Some(wait) = adjusted.retry_after {
            answer["retryAfter"] = number(wait);
        }
        Ok(Answer::ok(answer))
    }

    async fn value(
        &self,
        body: ValueBody,
        leases: Option<&crate::store::Leasing>,
    ) -> Result<Answer, Answer> {
        crate::otel::note("tollgate.limits", || body.name.clone());
        if let Some(limit) = self.concurrency(&body.name, body.config.is_some())? {
            let target = (body.name.as_str(), limit);
            let value = self
                .limiter
                .slots_value_async(target, body.key.as_deref())
                .await
                .map_err(|e| self.error(e))?;
            return Ok(Answer::ok(json!({
                "inFlight": value.in_flight,
                "max": value.max,
                "holders": value.holders,
            })));
        }
        let target = self.target(&body.name, body.config.as_ref())?;
        let sample = match body.sample_shards {
            None => 1,
            Some(n) if n.fract() == 0.0 && (1.0..=1024.0).contains(&n) => n as u16,
            Some(n) => {
                return Err(Answer::error(
                    StatusCode::BAD_REQUEST,
                    format!("sampleShards is {n}; it must be an integer in 1..=1024"),
                ));
            }
        };
        let reading = self
            .limiter
            .value_sampled_async(target, body.key.as_deref(), sample)
            .await
            .map_err(|e| self.error(e))?;
        let mut answer = json!({
            "value": number(reading.value),
            "ts": number(reading.ts),
            "shard": reading.shard,
            "config": reading.config,
        });
        // A leased limit: the tokens leased out to every process, apart from the value
        // (what a direct take may take now).
        if let Some(leasing) = leases.filter(|l| l.leases(&body.name)) {
            let leased = leasing
                .leased_out(&body.name, body.key.as_deref(), &reading.config)
                .await
                .map_err(|e| self.error(tollgate::Error::Store(e)))?;
            answer["leased"] = number(leased);
        }
        Ok(Answer::ok(answer))
    }

    /// The IETF header fields for the limits of a request (the tightest, if they are many:
    /// see [`crate::fields`]), and `Retry-After` when refused.
    fn rate_limit_headers(
        &self,
        answer: &mut Answer,
        targets: &[(&str, Target<'_>)],
        statuses: &[Status],
        retry_after: Option<f64>,
        ok: bool,
    ) {
        let members: Vec<crate::fields::Member<'_>> = targets
            .iter()
            .zip(statuses)
            .filter_map(|((name, target), status)| {
                let (policy, capacity) = match target {
                    Target::Named(name) => {
                        let (policy, capacity) = self.policies.get(*name)?;
                        (Cow::Borrowed(policy.as_str()), *capacity)
                    }
                    Target::Inline(name, config) => {
                        (Cow::Owned(fields::policy_member(name, config)), config.capacity())
                    }
                };
                Some(crate::fields::Member { name, policy, capacity, status: *status })
            })
            .collect();
        if let Some((policy, current)) = crate::fields::rate_limit_fields(&members) {
            answer.headers.push((RATELIMIT_POLICY, policy));
            answer.headers.push((RATELIMIT, current));
        }
        if !ok {
            answer.outcome = "refused";
            if let Some(wait) = retry_after {
                answer.headers.push((RETRY_AFTER, fields::retry_after_seconds(wait).to_string()));
            }
        }
    }

    fn error(&self, err: Error) -> Answer {
        match err {
            Error::Invalid(e) => Answer::error(StatusCode::BAD_REQUEST, e.to_string()),
            Error::NotDefined { name } => not_defined(&name),
            Error::Store(e) => store_failed(&e),
            other => Answer::error(StatusCode::INTERNAL_SERVER_ERROR, other.to_string()),
        }
    }
}

/// The store failed: `503 { error, mayHaveTaken }`. `mayHaveTaken` is true only when the
/// request reached the store and its answer never came back (it may have run, and a retry
/// may pay twice); false when the store never saw it, or refused it whole: nothing was
/// taken, and a retry is safe.
pub fn store_failed(e: &tollgate::StoreError) -> Answer {
    let mut answer = Answer::error(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    if let Body::Json(body) = &mut answer.body {
        body["mayHaveTaken"] = Value::Bool(e.may_have_taken());
    }
    answer
}

/// Wall-clock Unix milliseconds, for the dashboard's buckets.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Counts a transaction's rate limits in `stats`: each taken if the whole was (`ok`), else
/// only those that refused it (a refused transaction takes nothing).
fn record_transaction(
    stats: &crate::stats::Stats,
    limits: &[&LimitBody<'_>],
    results: &[tollgate::Decision],
    ok: bool,
) {
    let now = now_ms();
    for (l, result) in limits.iter().zip(results) {
        if ok || !result.ok {
            stats.record(
                &l.name,
                crate::stats::Taken::of(result.ok && ok, result.retry_after),
                now,
            );
        }
    }
}

/// The 429 of a refused transaction any of whose limits `throws`: named after the limit
/// with the longest wait (`results` in the body's order).
fn thrown(limits: &[LimitBody<'_>], results: &[tollgate::Decision], ok: bool) -> Option<Answer> {
    if ok || !limits.iter().any(|l| l.throws) {
        return None;
    }
    let i = tollgate::core::longest_refusal(results).unwrap_or(0);
    Some(rate_limited(&limits[i].name, results[i].retry_after.unwrap_or(0.0)))
}

/// A refusal as an error, for requests with `throws`: `429 { kind, name, retryAfter }`.
fn rate_limited(name: &str, retry_after: f64) -> Answer {
    Answer {
        status: StatusCode::TOO_MANY_REQUESTS,
        body: Body::Json(
            json!({ "kind": "RateLimited", "name": name, "retryAfter": number(retry_after) }),
        ),
        headers: Vec::new(),
        outcome: "refused",
    }
}

/// A refusal of slots: counted as refused, with `Retry-After` (whole seconds, up).
fn refused_slots(answer: &mut Answer, ok: bool, retry_after: Option<f64>) {
    if !ok {
        answer.outcome = "refused";
        if let Some(wait) = retry_after {
            answer.headers.push((RETRY_AFTER, fields::retry_after_seconds(wait).to_string()));
        }
    }
}

/// The most limits one `GET /v1/stats` answers, and how many it answers by default.
pub const STATS_PAGE: usize = 1_000;

/// `offset` and `limit` of a `GET /v1/stats` query (`None`: the first page).
fn stats_page(query: Option<&str>) -> Result<(usize, usize), String> {
    let (mut offset, mut page) = (0, STATS_PAGE);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        // A whole number a JSON client keeps exactly (below 2^53), as the OpenAPI document
        // says.
        let number = || match value.parse::<u64>() {
            Ok(n) if n < 1 << 53 => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => Err(format!("{name} is {value:?}; it must be a whole number below 2^53")),
        };
        match name {
            "offset" => offset = number()?,
            "limit" => page = number()?.min(STATS_PAGE),
            _ => {
                return Err(format!(
                    "unknown parameter {name:?}; the parameters are offset and limit"
                ));
            }
        }
    }
    Ok((offset, page))
}

fn not_defined(name: &str) -> Answer {
    Answer::error(
        StatusCode::NOT_FOUND,
        format!(
            "Rate limit {name} not defined. Define it in a {} table of the server's config \
             file, or send a config with the request.",
            crate::names::limits_table(name)
        ),
    )
}

/// Parses a body, naming the field of any error: `count: invalid type: string "x", expected a number`;
/// anything after the body's JSON value is an error too.
///
/// The plain parser runs first; only a body that fails is parsed again, tracking the path, to
/// word the error.
fn parse<'b, T: Deserialize<'b>>(body: &'b [u8]) -> Result<T, Answer> {
    if let Ok(Object(value)) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = serde_path_to_error::deserialize::<_, Object<T>>(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let message = if inner.to_string().starts_with("number out of range") {
            // The lexer fails before serde knows the field: find the key just before it.
            match field_before(body, inner.line(), inner.column()) {
                Some(field) => format!("{field}: number out of range (it must be finite)"),
                None => format!("number out of range: {inner}"),
            }
        } else if inner.is_syntax() || inner.is_eof() {
            format!("malformed JSON: {inner}")
        } else if path == "." {
            format!("invalid request body: {}", api_words(&inner.to_string()))
        } else {
            format!("{path}: {}", api_words(&inner.to_string()))
        };
        Answer::error(StatusCode::BAD_REQUEST, message)
    })?;
    // The plain parse failed, so something is wrong; if not the value itself, what follows
    // it: a body with anything after its JSON value is malformed (SPEC §6), and nothing of
    // it is run.
    de.end().map_err(|e| Answer::error(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")))?;
    Ok(parsed.0)
}

/// serde's message in the API's words: the JSON types a client sends, not the Rust types
/// they are read into (`expected f64` is `expected a number`).
fn api_words(message: &str) -> String {
    const WORDS: [(&str, &str); 6] = [
        ("expected f64", "expected a number"),
        ("expected u16", "expected an integer"),
        ("expected u64", "expected an integer"),
        ("expected usize", "expected an integer"),
        ("expected a borrowed string", "expected a string"),
        ("expected a sequence", "expected an array"),
    ];
    let mut message = message.to_owned();
    for (rust, api) in WORDS {
        message = message.replace(rust, api);
    }
    message
}

/// The name of the last object key that starts before (line, column) of `body`: the field a
/// lexer error is about. Good enough for error messages, not a JSON parser.
fn field_before(body: &[u8], line: usize, column: usize) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let offset: usize =
        text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum::<usize>()
            + column;
    let before = text.get(..offset.min(text.len()))?;
    let colon = before.rfind(':')?;
    let key_end = before[..colon].trim_end().strip_suffix('"')?;
    let key_start = key_end.rfind('"')?;
    Some(key_end[key_start + 1..].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-process engine over `store` with the limit `tb` (3 tokens, one an hour).
    async fn in_process(store: &str) -> Engine {
        let config = json!({
            "server": { "store": store },
            "limits": {
                "tb": { "kind": "token bucket", "rate": 1, "period": 3_600_000, "capacity": 3 },
            },
        });
        let settings = crate::config::Settings::from_json(&config.to_string()).expect("settings");
        let opened = crate::store::open(
            &settings.store,
            settings.max_keys,
            settings.store_deadline,
            &settings.lease,
        )
        .await
        .expect("store");
        Engine::in_process(&opened, &settings)
    }

    #[tokio::test]
    async fn an_in_process_engine_takes_a_body_of_any_size_a_serving_one_refuses_past_max_body() {
        let engine = in_process("memory").await;
        let one = json!({ "name": "tb", "key": "k", "count": 0 });
        let limits: Vec<Value> = std::iter::repeat_n(one, MAX_BODY / 30).collect();
        let body = json!({ "limits": limits }).to_string();
        assert!(body.len() > MAX_BODY);
        let answer = engine.run(Op::Transaction, body.as_bytes()).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body.to_json());
        let store: DynStore = Arc::new(tollgate::MemoryStore::new());
        let tb = Config::token_bucket(1.0, 3_600_000.0).with_capacity(3.0);
        let serving = Engine::new(
            RateLimiter::builder(store).define("tb", tb).build(),
            Permissions::default(),
        );
        let answer = serving.run(Op::Transaction, body.as_bytes()).await;
        assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn named_limits_take_as_a_transaction_of_run_does() {
        let engine = in_process("memory").await;
        assert!(engine.named_limits(&[("tb", None), ("nope", None)]).is_none());
        let limits = engine.named_limits(&[("tb", Some(2.0))]).expect("tb is defined");
        let now = limits.take_now(Some("k")).expect("memory").expect("taken");
        assert!(now.decision.ok);
        assert_eq!(now.statuses[0].remaining, 1.0);
        // Refused (1 left of the 2 asked), as run's transaction of the same is.
        let taken = limits.take(Some("k")).await.expect("taken");
        assert!(!taken.decision.ok);
        assert_eq!(taken.statuses[0].remaining.floor(), 1.0);
        let body = json!({ "limits": [{ "name": "tb", "key": "k", "count": 2 }] }).to_string();
        let answer = engine.run(Op::Transaction, body.as_bytes()).await;
        let answer: Value = serde_json::from_str(&answer.body.to_json()).expect("json");
        assert_eq!(answer["ok"], false);
        // The same wait for the one token missing (an hour), a moment later.
        let (wait, by_run) = (
            taken.decision.retry_after.expect("a wait"),
            answer["retryAfter"].as_f64().expect("a wait"),
        );
        assert!(by_run <= wait && wait - by_run < 1_000.0, "{wait} {by_run}");
    }

    fn answered(taken: Result<tollgate::Decision, Answer>) -> Result<bool, (u16, String)> {
        taken.map(|d| d.ok).map_err(|a| (a.status.as_u16(), a.body.to_json()))
    }

    #[tokio::test]
    async fn a_named_limit_takes_from_the_same_states_with_the_same_errors() {
        let dir = tempfile::tempdir().expect("dir");
        let sqlite = format!("sqlite://{}", dir.path().join("named.db").display());
        for store in ["memory", sqlite.as_str()] {
            let engine = in_process(store).await;
            assert!(engine.named("nope").is_none());
            assert!(engine.named("").is_none());
            let named = engine.named("tb").expect("tb is defined");
            // Now on the memory store only; the async take on either.
            let now = |count, writes| named.take_now(Some("k"), Some(count), false, writes);
            assert_eq!(now(1.0, true).is_some(), store == "memory", "{store}");
            if store != "memory" {
                assert_eq!(answered(named.take(Some("k"), Some(1.0), false, true).await), Ok(true));
            }
            // One state: 1 taken above, 1 by the engine's name, then 1 is left.
            let by_name = engine.take("tb", Some("k"), Some(1.0), false, true).await;
            assert_eq!(answered(by_name), Ok(true), "{store}");
            assert_eq!(answered(named.take(Some("k"), Some(2.0), false, false).await), Ok(false));
            assert_eq!(answered(named.take(Some("k"), Some(1.0), false, true).await), Ok(true));
            let refused = engine.take("tb", Some("k"), None, false, true).await;
            assert_eq!(answered(refused), Ok(false), "{store}");
            // The same error as by name (but the name's own wording: the same name).
            for count in [-1.0, 4.0, f64::NAN] {
                let by_name =
                    answered(engine.take("tb", Some("k"), Some(count), false, true).await);
                let named_now = named.take_now(Some("k"), Some(count), false, true).map(answered);
                let named_async = answered(named.take(Some("k"), Some(count), false, true).await);
                assert!(by_name.is_err(), "{store} {count}");
                assert_eq!(named_async, by_name, "{store} {count}");
                if let Some(now) = named_now {
                    assert_eq!(now, by_name, "{store} {count}");
                }
            }
        }
    }
}
