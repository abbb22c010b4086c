//! tollgate as Envoy's rate limit service (RLS v3): `ShouldRateLimit` over gRPC, and
//! envoyproxy/ratelimit's `POST /json` over HTTP, both answered from an
//! envoyproxy/ratelimit configuration ([`config`]).
//!
//! One request is one tollgate transaction over every descriptor that matched a limit: all
//! of them are taken, or none. A descriptor in `shadow_mode` is taken only when the request
//! is admitted and never refuses it; an `unlimited` one never reaches the store; one that
//! matches nothing is OK. The answer has one status per request descriptor, in order, and
//! `response_headers_to_add` with the IETF `RateLimit-Policy` and `RateLimit` fields (and
//! `Retry-After` when over the limit). A store that fails is gRPC `UNAVAILABLE`.
//!
//! Nothing a client sends through a proxy can fail a call: descriptor values come from its
//! headers and paths. A value too long for a state's key or name is stored under its SHA-256
//! digest and counted like any other; a cost (`hits_addend`) that the limit can never grant is
//! `OVER_LIMIT`, with nothing taken and no `Retry-After`. (An error would let the request
//! through: Envoy's default is `failure_mode_deny: false`.)

pub mod config;
pub mod connection;
pub mod json;
pub mod service;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tollgate::core::{MAX_KEY_BYTES, MAX_NAME_BYTES, Status};
use tollgate::{Call, Error, Request, Target};

use crate::digest::digest;
use crate::engine::Engine;
use crate::metrics::label;
pub use config::{Limit, RlsConfig, Rule, Unit};

/// A request, from gRPC or JSON.
#[derive(Debug, Default)]
pub struct RlsRequest {
    /// The domain.
    pub domain: String,
    /// The descriptors, each a list of (key, value) entries.
    pub descriptors: Vec<Descriptor>,
    /// Hits for every descriptor without its own (0 means 1).
    pub hits_addend: u32,
}

/// One descriptor of a request.
#[derive(Debug, Default)]
pub struct Descriptor {
    /// (key, value) entries.
    pub entries: Vec<(String, String)>,
    /// `limit`: the request's own limit for it, in place of the configuration's.
    pub limit: Option<(u32, Unit)>,
    /// `hits_addend`: its own count (0 allowed: a check that takes nothing).
    pub hits_addend: Option<u64>,
}

/// The answer: whether the request is over the limit, one status per request descriptor,
/// and the header fields to add to the response.
#[derive(Debug, PartialEq)]
pub struct RlsAnswer {
    /// Whether some descriptor refused the request.
    pub over_limit: bool,
    /// One per request descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// `RateLimit-Policy`, `RateLimit`, and `Retry-After` when over the limit.
    pub headers: Vec<(String, String)>,
}

/// The status of one request descriptor.
#[derive(Debug, PartialEq)]
pub struct DescriptorStatus {
    /// Whether this descriptor is over its limit (never for `shadow_mode`).
    pub over_limit: bool,
    /// The limit it matched: (name, requests per unit, unit); none if it matched none.
    pub current_limit: Option<(String, u32, Unit)>,
    /// Whole tokens left (`u32::MAX` for `unlimited`, 0 without a limit).
    pub limit_remaining: u32,
    /// Milliseconds until the limit is full again (when over: until the request could be
    /// admitted); none without a limit.
    pub duration_until_reset: Option<f64>,
}

/// Sets descriptor `index`'s status to `new`, or, when another of its limits (`rate_limits`)
/// set one already, to the tighter of the two: over its limit before within it, then the one
/// with fewer tokens left, then the longer wait.
fn put(statuses: &mut [DescriptorStatus], index: usize, new: DescriptorStatus) {
    let old = &statuses[index];
    let tighter = old.current_limit.is_none()
        || (
            new.over_limit,
            std::cmp::Reverse(new.limit_remaining),
            new.duration_until_reset.map(|w| w.max(0.0).to_bits()),
        ) > (
            old.over_limit,
            std::cmp::Reverse(old.limit_remaining),
            old.duration_until_reset.map(|w| w.max(0.0).to_bits()),
        );
    if tighter {
        statuses[index] = new;
    }
}

impl DescriptorStatus {
    fn no_limit() -> Self {
        DescriptorStatus {
            over_limit: false,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset: None,
        }
    }
}

/// How a request of the rate limit service came: over gRPC or as `POST /json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// `ShouldRateLimit`, on the rate limit service's port.
    Grpc,
    /// `POST /json`, on the HTTP port.
    Json,
}

/// Why a request could not be answered.
#[derive(Debug)]
pub enum RlsError {
    /// The request is malformed (gRPC `INVALID_ARGUMENT`, HTTP 400).
    Invalid(String),
    /// The store failed (gRPC `UNAVAILABLE`, HTTP 503); nothing admitted.
    Store(tollgate::StoreError),
}

impl std::fmt::Display for RlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RlsError::Invalid(message) => f.write_str(message),
            RlsError::Store(e) => write!(f, "rate limit store: {e}"),
        }
    }
}

/// Counts per (domain, descriptor) and outcome, for `/metrics`.
#[derive(Default)]
pub struct RlsMetrics {
    series: Mutex<BTreeMap<(String, String), Counts>>,
}

#[derive(Default)]
struct Counts {
    total_hits: AtomicU64,
    over_limit: AtomicU64,
    within_limit: AtomicU64,
    shadow_mode: AtomicU64,
}

/// The most series `detailed_metric` may add (one per value seen): beyond, values count
/// under their rule.
const MAX_SERIES: usize = 10_000;

impl RlsMetrics {
    fn record(&self, domain: &str, descriptor: &str, rule_key: &str, hits: u64, outcome: Outcome) {
        let mut series = self.series.lock();
        let key = if series.len() >= MAX_SERIES
            && !series.contains_key(&(domain.to_owned(), descriptor.to_owned()))
        {
            (domain.to_owned(), rule_key.to_owned())
        } else {
            (domain.to_owned(), descriptor.to_owned())
        };
        let counts = series.entry(key).or_default();
        counts.total_hits.fetch_add(hits, Ordering::Relaxed);
        let counter = match outcome {
            Outcome::Over => &counts.over_limit,
            Outcome::Within => &counts.within_limit,
            Outcome::Shadow => &counts.shadow_mode,
        };
        counter.fetch_add(hits, Ordering::Relaxed);
    }

    /// The Prometheus text of the counts.
    pub fn render(&self, out: &mut String) {
        let series = self.series.lock();
        if series.is_empty() {
            return;
        }
        out.push_str(
            "# HELP tollgate_rls_hits_total Hits asked of each rate limit service descriptor, \
             by outcome (total, over_limit, within_limit, shadow_mode).\n",
        );
        out.push_str("# TYPE tollgate_rls_hits_total counter\n");
        for ((domain, descriptor), counts) in series.iter() {
            for (outcome, counter) in [
                ("total", &counts.total_hits),
                ("over_limit", &counts.over_limit),
                ("within_limit", &counts.within_limit),
                ("shadow_mode", &counts.shadow_mode),
            ] {
                let _ = writeln!(
                    out,
                    "tollgate_rls_hits_total{{domain=\"{}\",descriptor=\"{}\",outcome=\"{outcome}\"}} {}",
                    label(domain),
                    label(descriptor),
                    counter.load(Ordering::Relaxed)
                );
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Outcome {
    Over,
    Within,
    Shadow,
}

/// A `duration_until_reset` of `ms` milliseconds as the service answers it over either
/// transport: rounded up to whole milliseconds, as (seconds, nanoseconds).
pub fn until_reset(ms: f64) -> (i64, i32) {
    let ms = ms.max(0.0).ceil();
    let seconds = (ms / 1_000.0).floor();
    (seconds as i64, ((ms - seconds * 1_000.0) * 1_000_000.0) as i32)
}

/// The rate limit service: a configuration and the server's limiter.
pub struct Rls {
    engine: Arc<Engine>,
    /// Swapped whole by a reload ([`Rls::replace`]); a request keeps the one it started with.
    config: arc_swap::ArcSwap<RlsConfig>,
    /// Counts for `/metrics`.
    pub metrics: RlsMetrics,
}

/// A descriptor that matched a limit, ready to take.
struct Matched<'r> {
    /// Its index in the request.
    index: usize,
    rule: Cow<'r, Rule>,
    /// The name of its states in the store (see [`state_name`]).
    name: String,
    /// Its key: the request's values (each with its length, so no two differ only in
    /// where one ends), or their digest when that is too long (see [`state_key`]).
    key: String,
    hits: u64,
    /// The series of its metrics.
    metric: String,
}

impl Matched<'_> {
    /// Its take under `config`: the limit, and its key and hits.
    fn ask(&self, config: tollgate::Config) -> (Target<'_>, Request<'_>) {
        (Target::Inline(&self.name, config), Request::new().key(&self.key).count(self.hits as f64))
    }
}

impl Rls {
    /// The service over the store of `engine`'s limiter, with `config`.
    pub fn new(engine: Arc<Engine>, config: RlsConfig) -> Self {
        Rls {
            engine,
            config: arc_swap::ArcSwap::from_pointee(config),
            metrics: RlsMetrics::default(),
        }
    }

    /// Serves `config` from the next request on.
    pub fn replace(&self, config: RlsConfig) {
        self.config.store(Arc::new(config));
    }

    /// Answers `request` (or the reason it could not be read) as [`Rls::should_rate_limit`]
    /// does; when tracing is on, inside a span named for `via` whose parent is the caller's
    /// (the trace context in `headers`).
    ///
    /// # Errors
    ///
    /// As [`Rls::should_rate_limit`].
    pub async fn traced(
        &self,
        via: Via,
        headers: impl FnOnce() -> axum::http::HeaderMap,
        request: Result<RlsRequest, RlsError>,
    ) -> Result<RlsAnswer, RlsError> {
        let answer = async {
            match request {
                Ok(request) => self.should_rate_limit(&request).await,
                Err(e) => Err(e),
            }
        };
        if !crate::otel::on() {
            return answer.await;
        }
        let name = match via {
            Via::Grpc => "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            Via::Json => "POST /json",
        };
        let span = crate::otel::span(name, "should_rate_limit", &headers());
        crate::otel::traced(span, answer, move |span, answer: &Result<RlsAnswer, RlsError>| {
            // The outcome, and the gRPC and HTTP statuses that say it.
            let (outcome, granted, grpc, http) = match answer {
                Ok(answer) if answer.over_limit => ("over_limit", Some(false), 0_i64, 429_i64),
                Ok(_) => ("ok", Some(true), 0, 200),
                Err(RlsError::Invalid(_)) => ("invalid", None, 3, 400),
                Err(RlsError::Store(_)) => ("store_error", None, 14, 503),
            };
            match via {
                Via::Grpc => span.set("rpc.grpc.status_code", grpc),
                Via::Json => span.set("http.response.status_code", http),
            }
            span.set("tollgate.outcome", outcome);
            if let Some(granted) = granted {
                span.set("tollgate.granted", granted);
            }
            if outcome == "store_error" {
                span.failed();
            }
        })
        .await
    }

    /// Answers one request: every matched descriptor taken all or nothing.
    ///
    /// # Errors
    ///
    /// No domain or no descriptors ([`RlsError::Invalid`]); the store failed.
    pub async fn should_rate_limit(&self, request: &RlsRequest) -> Result<RlsAnswer, RlsError> {
        if request.domain.is_empty() {
            return Err(RlsError::Invalid("rate limit domain must not be empty".into()));
        }
        if request.descriptors.is_empty() {
            return Err(RlsError::Invalid("rate limit descriptor list must not be empty".into()));
        }
        crate::otel::note("tollgate.domain", || request.domain.clone());
        let mut statuses: Vec<DescriptorStatus> =
            request.descriptors.iter().map(|_| DescriptorStatus::no_limit()).collect();
        // One configuration, and one set of defined limits, for the whole request.
        let config = self.config.load_full();
        let defined = self.engine.current();
        let limiter = defined.limiter();
        let mut matched = Vec::new();
        for (index, descriptor) in request.descriptors.iter().enumerate() {
            if let Some(m) = Self::matched(&config, request, index, descriptor)? {
                // A descriptor's other limits (`rate_limits`), each its own take of the
                // same key and hits: all of them in the request's all or nothing.
                let also: Vec<Matched<'_>> = match &m.rule {
                    Cow::Borrowed(rule) => rule
                        .also
                        .iter()
                        .map(|rule| Matched {
                            index,
                            name: state_name(
                                &request.domain,
                                &rule.full_key[request.domain.len()..],
                            ),
                            rule: Cow::Borrowed(rule),
                            key: m.key.clone(),
                            hits: m.hits,
                            metric: if rule.detailed_metric {
                                format!(
                                    "{}#{}",
                                    m.metric,
                                    &rule.full_key[rule.full_key.rfind('#').map_or(0, |i| i + 1)..]
                                )
                            } else {
                                rule.full_key.clone()
                            },
                        })
                        .collect(),
                    Cow::Owned(_) => Vec::new(),
                };
                matched.push(m);
                matched.extend(also);
            }
        }
        // `replaces`: a limit named by another matched limit does not count.
        let replaced: HashSet<&str> =
            matched.iter().flat_map(|m| m.rule.replaces.iter().map(String::as_str)).collect();
        let matched: Vec<&Matched<'_>> = matched
            .iter()
            .filter(|m| m.rule.name.is_empty() || !replaced.contains(m.rule.name.as_str()))
            .collect();

        crate::otel::note("tollgate.limits", || {
            matched.iter().map(|m| &*m.name).collect::<Vec<_>>().join(",")
        });
        let mut over_limit = false;
        let mut retry_after: f64 = 0.0;
        let mut taken: Vec<(&Matched<'_>, Numbers, Status)> = Vec::new();
        // The limits that decide, all or nothing; then the shadows; and the costs that no
        // state of their limit can ever grant.
        let mut enforced = Vec::new();
        let mut shadows = Vec::new();
        let mut never = Vec::new();
        for m in &matched {
            match &m.rule.limit {
                Limit::Unlimited => {
                    put(
                        &mut statuses,
                        m.index,
                        DescriptorStatus {
                            over_limit: false,
                            current_limit: None,
                            limit_remaining: u32::MAX,
                            duration_until_reset: None,
                        },
                    );
                }
                Limit::Blocked { unit } => {
                    let wait = until_window_end(unit.millis());
                    let over = !m.rule.shadow;
                    over_limit |= over;
                    if over {
                        retry_after = retry_after.max(wait);
                    }
                    put(
                        &mut statuses,
                        m.index,
                        DescriptorStatus {
                            over_limit: over,
                            current_limit: Some((m.rule.name.clone(), 0, *unit)),
                            limit_remaining: 0,
                            duration_until_reset: Some(wait),
                        },
                    );
                    let outcome = if over { Outcome::Over } else { Outcome::Shadow };
                    self.metrics.record(
                        &request.domain,
                        &m.metric,
                        &m.rule.full_key,
                        m.hits,
                        outcome,
                    );
                }
                Limit::Limited { requests_per_unit, unit, config } => {
                    let c = Numbers {
                        requests_per_unit: *requests_per_unit,
                        unit: *unit,
                        config: *config,
                    };
                    if !fits(&m.name, &c.config, m.hits as f64) {
                        never.push((*m, c));
                    } else if m.rule.shadow {
                        shadows.push((*m, c));
                    } else {
                        enforced.push((*m, c));
                    }
                }
            }
        }
        // Enforced descriptors of one state add up in the transaction: past the limit's
        // capacity together, the one that crosses it can never be granted either.
        let mut together: HashMap<(&str, &str), f64> = HashMap::new();
        enforced.retain(|(m, c)| {
            if c.config.shards() != 1 {
                return true; // takes of a sharded limit may go to different shards
            }
            let sum = together.entry((m.name.as_str(), m.key.as_str())).or_default();
            *sum += m.hits as f64;
            let fits = *sum <= c.config.capacity();
            if !fits {
                *sum -= m.hits as f64;
                never.push((*m, *c));
            }
            fits
        });
        // A cost that can never be granted refuses the request (unless in shadow mode), and
        // no wait would change that: no `Retry-After`.
        let mut can_never = false;
        for (m, c) in &never {
            let (target, _) = m.ask(c.config);
            let look = Request::new().key(&m.key).count(0.0);
            let t = limiter.check_with_status_async(target, look).await.map_err(store_error)?;
            let over = !m.rule.shadow;
            over_limit |= over;
            can_never |= over;
            taken.push((m, *c, t.status));
            let outcome = if over { Outcome::Over } else { Outcome::Shadow };
            self.metrics.record(&request.domain, &m.metric, &m.rule.full_key, m.hits, outcome);
            put(
                &mut statuses,
                m.index,
                DescriptorStatus {
                    over_limit: over,
                    current_limit: Some((m.rule.name.clone(), c.requests_per_unit, c.unit)),
                    limit_remaining: 0,
                    duration_until_reset: Some(t.status.reset_after),
                },
            );
        }
        let enforced_calls: Vec<Call<'_>> = enforced
            .iter()
            .map(|(m, c)| {
                let (target, ask) = m.ask(c.config);
                target.with(ask)
            })
            .collect();
        // A blocked limit, or a cost that can never fit, refuses the request: the others are
        // only looked at, below.
        let blocked = over_limit;
        let admitted = if blocked {
            false
        } else if enforced_calls.is_empty() {
            true
        } else {
            let t = limiter
                .transaction_with_status_async(&enforced_calls)
                .await
                .map_err(store_error)?;
            for (((m, c), result), status) in
                enforced.iter().zip(&t.decision.results).zip(&t.statuses)
            {
                taken.push((m, *c, *status));
                self.status(&mut statuses, request, m, c, result.ok, result.retry_after, *status);
            }
            if !t.decision.ok {
                over_limit = true;
                retry_after = retry_after.max(t.decision.retry_after.unwrap_or(0.0));
            }
            t.decision.ok
        };
        let looked_at = if blocked { &enforced[..] } else { &[] };
        for (m, c) in looked_at.iter().chain(&shadows) {
            let (target, ask) = m.ask(c.config);
            // Shadows are counted when the request is admitted; only looked at when it is
            // not, as are the enforced limits when one was blocked.
            let t = if admitted {
                limiter.limit_with_status_async(target, ask).await
            } else {
                limiter.check_with_status_async(target, ask).await
            }
            .map_err(store_error)?;
            taken.push((m, *c, t.status));
            self.status(
                &mut statuses,
                request,
                m,
                c,
                t.decision.ok,
                t.decision.retry_after,
                t.status,
            );
        }

        let mut headers = Vec::new();
        taken.sort_by_key(|(m, _, _)| m.index);
        let members: Vec<crate::fields::Member<'_>> = taken
            .iter()
            .map(|(m, c, status)| {
                let name = if m.rule.name.is_empty() { &m.rule.full_key } else { &m.rule.name };
                crate::fields::Member {
                    name,
                    policy: tollgate::tower::fields::policy_member(name, &c.config).into(),
                    capacity: c.config.capacity(),
                    status: *status,
                }
            })
            .collect();
        if let Some((policy, current)) = crate::fields::rate_limit_fields(&members) {
            headers.push(("RateLimit-Policy".to_owned(), policy));
            headers.push(("RateLimit".to_owned(), current));
        }
        if over_limit && !can_never {
            headers.push((
                "Retry-After".to_owned(),
                tollgate::tower::fields::retry_after_seconds(retry_after).to_string(),
            ));
        }
        Ok(RlsAnswer { over_limit, statuses, headers })
    }

    /// The descriptor's limit, if it has one: the request's own (`limit`), or the
    /// configuration's.
    fn matched<'r>(
        config: &'r RlsConfig,
        request: &RlsRequest,
        index: usize,
        descriptor: &Descriptor,
    ) -> Result<Option<Matched<'r>>, RlsError> {
        if !config.has_domain(&request.domain) {
            return Ok(None);
        }
        let hits = descriptor.hits_addend.unwrap_or(u64::from(request.hits_addend.max(1)));
        if hits > 1_000_000_000_000_000 {
            return Err(RlsError::Invalid(format!("hits_addend {hits} is over 1e15")));
        }
        let entries: Vec<(&str, &str)> =
            descriptor.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        // The request's own path, `domain.key_value.key` (bounded: it names metrics and
        // header fields), and the key of its states (the values, each with its length, so that
        // no two differ only in where one ends): made only where they are used.
        let detailed = || {
            let mut path = request.domain.clone();
            for (k, v) in &entries {
                let _ = if v.is_empty() { write!(path, ".{k}") } else { write!(path, ".{k}_{v}") };
            }
            path
        };
        let key = || {
            let mut key = String::new();
            for (_, value) in &entries {
                let _ = write!(key, "{}:{value}|", value.len());
            }
            state_key(key)
        };
        if let Some((requests_per_unit, unit)) = descriptor.limit {
            let limit = if requests_per_unit == 0 {
                Limit::Blocked { unit }
            } else {
                let config =
                    tollgate::Config::fixed_window(f64::from(requests_per_unit), unit.millis())
                        .with_start(0.0);
                Limit::Limited { requests_per_unit, unit, config }
            };
            let detailed = detailed();
            let name = state_name(
                &request.domain,
                &format!(
                    "{}:{requests_per_unit}/{}",
                    &detailed[request.domain.len()..],
                    unit.name()
                ),
            );
            let detailed = bounded_label(detailed);
            // Its metrics count under its keys, not its values (a request's own limits are as
            // many as the values clients send), apart from a configured rule's:
            // `domain.key:own_limit`.
            let mut keys = request.domain.clone();
            for (k, _) in &entries {
                let _ = write!(keys, ".{k}");
            }
            keys.push_str(":own_limit");
            let rule = Rule {
                full_key: detailed,
                name: String::new(),
                limit,
                shadow: false,
                detailed_metric: false,
                replaces: Vec::new(),
                share_threshold: false,
                also: Vec::new(),
            };
            return Ok(Some(Matched {
                index,
                rule: Cow::Owned(rule),
                name,
                key: key(),
                hits,
                metric: bounded_label(keys),
            }));
        }
        let Some(rule) = config.find(&request.domain, &entries) else { return Ok(None) };
        // With share_threshold, every value that matches the wildcard shares one state.
        let key = if rule.share_threshold { "shared".to_owned() } else { key() };
        let metric =
            if rule.detailed_metric { bounded_label(detailed()) } else { rule.full_key.clone() };
        Ok(Some(Matched {
            index,
            name: state_name(&request.domain, &rule.full_key[request.domain.len()..]),
            rule: Cow::Borrowed(rule),
            key,
            hits,
            metric,
        }))
    }

    #[expect(clippy::too_many_arguments, reason = "one status from the parts of a take")]
    fn status(
        &self,
        statuses: &mut [DescriptorStatus],
        request: &RlsRequest,
        m: &Matched<'_>,
        c: &Numbers,
        ok: bool,
        retry_after: Option<f64>,
        status: Status,
    ) {
        let over = !ok && !m.rule.shadow;
        let outcome = match (ok, m.rule.shadow) {
            (true, _) => Outcome::Within,
            (false, false) => Outcome::Over,
            (false, true) => Outcome::Shadow,
        };
        self.metrics.record(&request.domain, &m.metric, &m.rule.full_key, m.hits, outcome);
        let wait = if ok { status.reset_after } else { retry_after.unwrap_or(status.reset_after) };
        // Granted because the store failed (fail open): nothing to report but the verdict.
        let known = status.is_known();
        put(
            statuses,
            m.index,
            DescriptorStatus {
                over_limit: over,
                current_limit: known.then(|| (m.rule.name.clone(), c.requests_per_unit, c.unit)),
                limit_remaining: if ok && known {
                    status.remaining.floor().min(f64::from(u32::MAX)) as u32
                } else {
                    0
                },
                duration_until_reset: known.then_some(wait),
            },
        );
    }
}

/// A matched limit's numbers.
#[derive(Clone, Copy)]
struct Numbers {
    requests_per_unit: u32,
    unit: Unit,
    config: tollgate::Config,
}

/// The longest domain kept whole in its states' names; a longer one is replaced there by its
/// digest, in every name of the domain alike (it is their Redis Cluster hash tag).
const MAX_TAG: usize = 128;

/// The longest label of a metric, or name in a header field, made from a request's values;
/// a longer one is cut and ends with part of its digest.
const MAX_LABEL: usize = 256;

/// The name of a rule's states: `rls:{domain}` and the rest of its path (`.key_value...`,
/// and for a request's own limit `:N/UNIT`). The domain is a hash tag, so that on a Redis
/// Cluster every state of a domain is in one hash slot and a request's descriptors are taken
/// atomically (a domain is the unit that spreads over a cluster). A name longer than a limit
/// name may be (its path holds a request's values) ends with the digest of its path instead,
/// `rls:{domain}#<sha-256>`, which no path (they start with `.`) can spell.
fn state_name(domain: &str, rest: &str) -> String {
    let tag: Cow<'_, str> =
        if domain.len() <= MAX_TAG { domain.into() } else { format!("#{}", digest(domain)).into() };
    let name = format!("rls:{{{tag}}}{rest}");
    if name.len() <= MAX_NAME_BYTES { name } else { format!("rls:{{{tag}}}#{}", digest(rest)) }
}

/// A state's key: the request's values as made, or, if that is longer than a key may be,
/// `#<sha-256>` of it (a key as made starts with a digit, or is `shared`).
fn state_key(key: String) -> String {
    if key.len() <= MAX_KEY_BYTES { key } else { format!("#{}", digest(&key)) }
}

/// A label made from a request's values, bounded: cut at a character boundary and ended with
/// 16 hex digits of its digest, so that two long values still count apart.
fn bounded_label(label: String) -> String {
    if label.len() <= MAX_LABEL {
        return label;
    }
    let mut cut = MAX_LABEL - 20;
    while !label.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...#{}", &label[..cut], &digest(&label)[..16])
}

/// Whether `count` could ever be taken from a state of `config` (a cost past its capacity
/// never can; `name` only words the check).
fn fits(name: &str, config: &tollgate::Config, count: f64) -> bool {
    tollgate::core::validate_count(name, config, count, false).is_ok()
}

fn store_error(e: Error) -> RlsError {
    match e {
        Error::Store(e) => RlsError::Store(e),
        other => RlsError::Invalid(other.to_string()),
    }
}

/// Milliseconds from now to the end of the window of `period` ms that holds now (windows
/// from the Unix epoch).
fn until_window_end(period: f64) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1_000.0);
    period - now % period
}
