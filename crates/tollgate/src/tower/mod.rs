//! Rate limiting for tower services (axum, tonic, hyper): [`RateLimitLayer`].
//!
//! Admitted requests pass through and their responses carry the `RateLimit-Policy` and
//! `RateLimit` header fields of the IETF draft (draft-ietf-httpapi-ratelimit-headers, as
//! structured fields). Refused requests get `429 Too Many Requests` with `Retry-After` in
//! whole seconds rounded up (a 0.4 s wait is `1`, never `0`), the same header fields, and a
//! JSON body `{"kind": "RateLimited", "name": ..., "retryAfter": <ms>}`. When the store
//! fails, the answer is `503 {"error": "rate limit store unavailable", "mayHaveTaken":
//! <bool>}` (fail closed; the store's own message, which may name its host, user or
//! database, goes to the log, `tracing`'s target `tollgate::tower`, at most a line every 10
//! s with the count since, never to the client) unless
//! the limit was made to [fail open](LimitSpec::fail_open): `mayHaveTaken` is true only when
//! the request reached the store and no answer came back, so that its tokens may be spent
//! (a client that retries it may pay twice); false means nothing was taken, and a retry is
//! safe. Put a networked store behind a `tollgate::store::CircuitBreaker` so that a
//! store that hangs fails fast.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::tower::{Key, LimitSpec, RateLimitLayer};
//! use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
//!
//! let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
//! let per_ip = LimitSpec::new(("perIp", Config::token_bucket(60.0, MINUTE))).key(Key::peer_ip());
//! let layer = RateLimitLayer::new(limiter, per_ip);
//! // axum: Router::new().route("/", get(handler)).layer(layer)
//! # let _ = layer;
//! ```
//!
//! # The header fields
//!
//! For each limit, named by its name: `RateLimit-Policy: "name";q=<rate>;w=<period in s>`
//! and `RateLimit: "name";r=<tokens remaining>;t=<seconds until full again>`. `w` is the
//! period rounded up to whole seconds and `q` the rate over that window; `r` is rounded
//! down and `t` up, so a client that trusts them is never refused for it. A name that is
//! not printable ASCII is written with `?` for the other characters.

mod key;

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use key::{DEFAULT_IPV6_SUBNET, Key, MissingKey, TrustedProxies};

use crate::core::Inline;
use crate::limiter::{Call, RateLimiter, Target};
use crate::store::AsyncStore;
use crate::{Config, Error, Limits, Status, Taken};

type CountFn = dyn Fn(&http::request::Parts) -> f64 + Send + Sync;

/// One limit that a [`RateLimitLayer`] takes for each request: which limit, its key, its count.
#[derive(Clone)]
pub struct LimitSpec {
    name: Arc<str>,
    config: Option<Config>,
    key: Key,
    count: Option<Arc<CountFn>>,
    missing_key: MissingKey,
    fail_open: bool,
    /// This limit's `RateLimit-Policy` member (`"name";q=..;w=..`) and the length of its
    /// quoted name, once its config is known.
    policy: Option<(Arc<str>, usize)>,
}

impl LimitSpec {
    /// A limit, global until a [`key`](LimitSpec::key) is set: a value of your
    /// [`Limits`] type, an inline `("name", config)`, or the name of a limit defined on the
    /// limiter (`"name"`).
    pub fn new<'a>(limit: impl Into<Target<'a>>) -> Self {
        let (name, config) = match limit.into() {
            Target::Named(name) => (name, None),
            Target::Inline(name, config) => (name, Some(config)),
        };
        LimitSpec {
            name: name.into(),
            config,
            key: Key::global(),
            count: None,
            missing_key: MissingKey::default(),
            fail_open: false,
            policy: None,
        }
    }

    /// A typed limit (the same as [`LimitSpec::new`]).
    pub fn limit<L: Limits>(limit: L) -> Self {
        Self::new(limit)
    }

    /// Where each request's key comes from (default: [`Key::global`]).
    #[must_use]
    pub fn key(mut self, key: Key) -> Self {
        self.key = key;
        self
    }

    /// How many tokens a request takes (default 1), from its head: for example the tokens
    /// an LLM request declares in a header.
    #[must_use]
    pub fn count(
        mut self,
        count: impl Fn(&http::request::Parts) -> f64 + Send + Sync + 'static,
    ) -> Self {
        self.count = Some(Arc::new(count));
        self
    }

    /// What to do when a request has no key (default: refuse it with 400).
    #[must_use]
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing_key = missing;
        self
    }

    /// Lets requests through when the store fails, instead of answering 503.
    ///
    /// The trade: failing closed protects what is behind the limit when the limiter cannot
    /// decide (and when the store is your database, the request would likely fail anyway);
    /// failing open keeps serving when the limiter's store is an extra service that is down,
    /// at the price of no limit at all while it is. Only admitted requests are affected;
    /// invalid requests are still refused.
    #[must_use]
    pub fn fail_open(mut self) -> Self {
        self.fail_open = true;
        self
    }

    fn target(&self) -> Target<'_> {
        match self.config {
            Some(config) => Target::Inline(&self.name, config),
            None => Target::Named(&self.name),
        }
    }
}

/// A tower [`Layer`] that rate limits every request of the service it wraps.
///
/// With one [`LimitSpec`], each request takes from that limit; with several
/// ([`RateLimitLayer::with`]), from all of them as one all-or-nothing transaction.
pub struct RateLimitLayer<S> {
    limiter: Arc<RateLimiter<S>>,
    specs: Arc<[LimitSpec]>,
}

/// The header fields' names, parsed once.
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

// Not derived: the store is shared behind an `Arc` and need not be `Clone` itself.
impl<S> Clone for RateLimitLayer<S> {
    fn clone(&self) -> Self {
        RateLimitLayer { limiter: Arc::clone(&self.limiter), specs: Arc::clone(&self.specs) }
    }
}

impl<S> RateLimitLayer<S> {
    /// A layer taking `spec` for each request.
    pub fn new(limiter: Arc<RateLimiter<S>>, spec: LimitSpec) -> Self {
        let spec = spec.with_policy(&limiter);
        RateLimitLayer { limiter, specs: Arc::from([spec]) }
    }

    /// Also takes `spec`, in the same transaction as the others.
    #[must_use]
    pub fn with(self, spec: LimitSpec) -> Self {
        let mut specs = self.specs.to_vec();
        specs.push(spec.with_policy(&self.limiter));
        RateLimitLayer { limiter: self.limiter, specs: specs.into() }
    }
}

impl LimitSpec {
    /// Computes the policy member once; a name the limiter does not define has none (its
    /// requests are answered with an error anyway).
    fn with_policy<S>(mut self, limiter: &RateLimiter<S>) -> Self {
        let config = self.config.or_else(|| limiter.defined_config(&self.name));
        self.policy = config.map(|config| {
            (fields::policy_member(&self.name, &config).into(), sf_string(&self.name).len())
        });
        self
    }
}

impl<S, Inner> Layer<Inner> for RateLimitLayer<S> {
    type Service = RateLimit<S, Inner>;

    fn layer(&self, inner: Inner) -> Self::Service {
        RateLimit { inner, limiter: Arc::clone(&self.limiter), specs: Arc::clone(&self.specs) }
    }
}

/// The service of a [`RateLimitLayer`].
pub struct RateLimit<S, Inner> {
    inner: Inner,
    limiter: Arc<RateLimiter<S>>,
    specs: Arc<[LimitSpec]>,
}

impl<S, Inner: Clone> Clone for RateLimit<S, Inner> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            limiter: Arc::clone(&self.limiter),
            specs: Arc::clone(&self.specs),
        }
    }
}

/// What the limits said about one request.
enum Verdict {
    /// Pass it on; add these header values to the response.
    Pass(Option<(HeaderValue, HeaderValue)>),
    /// Answer at once: refused (with its wait), or an error, with the header fields.
    Answer(Refusal, Option<(HeaderValue, HeaderValue)>),
}

/// Why a request is answered by the layer instead of the service.
enum Refusal {
    /// Refused by a limit: retry after this many ms.
    Limited { name: Arc<str>, retry_after: f64 },
    /// An error (400 for a bad request, 500 for the app's setup).
    Error(StatusCode, String),
    /// The store failed (503): nothing admitted; whether the request may still have taken
    /// its tokens ([`crate::StoreError::may_have_taken`]). The store's message is logged,
    /// not sent.
    Store(bool),
}

/// What a client is told when the store fails: the store's own message may name its host,
/// port, user or database, which are no client's business.
const STORE_UNAVAILABLE: &str = "rate limit store unavailable";

/// Logs a store failure, without flooding: the first at once, then at most one line every
/// 10 s, which says how many failed since the last.
fn log_store_failure(error: &crate::StoreError) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    /// When the next line may be written, in ms after `STARTED`.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    /// Failures not logged since the last line.
    static UNLOGGED: AtomicU64 = AtomicU64::new(0);
    let now = STARTED.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64;
    let next = NEXT.load(Ordering::Relaxed);
    if now < next
        || NEXT.compare_exchange(next, now + 10_000, Ordering::Relaxed, Ordering::Relaxed).is_err()
    {
        UNLOGGED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let more = UNLOGGED.swap(0, Ordering::Relaxed);
    if more == 0 {
        tracing::warn!(target: "tollgate::tower", "rate limit store failed: {error}");
    } else {
        tracing::warn!(
            target: "tollgate::tower",
            "rate limit store failed: {error} (and {more} more failures since the last line)"
        );
    }
}

/// One limit of a request: its spec, key and count.
type Taking<'p> = (&'p LimitSpec, Option<Cow<'p, str>>, f64);

/// What the limiter answered for a request: granted, the longest wait, per limit its
/// decision and status.
type Decided = (bool, Option<f64>, Inline<crate::Decision>, Inline<Status>);

/// Every spec's key and count for a request; a missing key that refuses the request is its
/// verdict, taken before anything is taken.
fn gather<'p>(
    specs: &'p [LimitSpec],
    parts: &'p http::request::Parts,
) -> Result<Inline<Taking<'p>>, Verdict> {
    let mut keys: Inline<_> = Inline::new();
    for spec in specs {
        let key = match spec.key.of(parts) {
            Ok(key) => key,
            Err(missing) => match spec.missing_key {
                MissingKey::Reject => {
                    let message = format!("Rate limit {}: {}.", spec.name, missing.0);
                    return Err(Verdict::Answer(
                        Refusal::Error(StatusCode::BAD_REQUEST, message),
                        None,
                    ));
                }
                MissingKey::Shared => None,
                MissingKey::Skip => continue,
            },
        };
        let count = spec.count.as_ref().map_or(1.0, |count| count(parts));
        keys.push((spec, key, count));
    }
    Ok(keys)
}

/// The limiter's calls for `keys`.
fn calls<'a>(keys: &'a [Taking<'_>]) -> Inline<Call<'a>> {
    keys.iter()
        .map(|(spec, key, count)| {
            let mut request = crate::Request::new().count(*count);
            if let Some(key) = key {
                request = request.key(key);
            }
            spec.target().with(request)
        })
        .collect()
}

fn one_decided(t: Taken) -> Decided {
    (
        t.decision.ok,
        t.decision.retry_after,
        Inline::from_elem(t.decision, 1),
        Inline::from_elem(t.status, 1),
    )
}

fn all_decided(t: crate::TransactionTaken) -> Decided {
    let d = t.decision;
    (d.ok, d.retry_after, d.results, t.statuses)
}

/// The verdict on a request whose limits `keys` answered `outcome`.
fn verdict(keys: &[Taking<'_>], outcome: Result<Decided, Error>) -> Verdict {
    match outcome {
        Ok((ok, retry_after, results, statuses)) => {
            let headers = headers(keys.iter().map(|k| k.0), &statuses);
            if ok {
                return Verdict::Pass(headers);
            }
            let (spec, wait) = match crate::core::longest_refusal(&results) {
                Some(i) => (keys[i].0, results[i].retry_after.unwrap_or(0.0)),
                None => (keys[0].0, retry_after.unwrap_or(0.0)),
            };
            Verdict::Answer(
                Refusal::Limited { name: Arc::clone(&spec.name), retry_after: wait },
                headers,
            )
        }
        Err(Error::Store(_)) if keys.iter().all(|k| k.0.fail_open) => Verdict::Pass(None),
        Err(Error::Store(err)) => {
            log_store_failure(&err);
            Verdict::Answer(Refusal::Store(err.may_have_taken()), None)
        }
        // A name the limiter does not know is a setup error of the app, not the client's.
        Err(err @ Error::NotDefined { .. }) => Verdict::Answer(
            Refusal::Error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
            None,
        ),
        Err(err) => Verdict::Answer(Refusal::Error(StatusCode::BAD_REQUEST, err.to_string()), None),
    }
}

impl<S: AsyncStore> RateLimit<S, ()> {
    /// The verdict on a request, on a store that answers at once (see
    /// [`AsyncStore::immediate`]), or `None` for a store that must be awaited.
    fn decide_now(
        limiter: &RateLimiter<S>,
        specs: &[LimitSpec],
        parts: &http::request::Parts,
    ) -> Option<Verdict> {
        let store = limiter.store().immediate()?;
        let keys = match gather(specs, parts) {
            Ok(keys) => keys,
            Err(verdict) => return Some(verdict),
        };
        if keys.is_empty() {
            return Some(Verdict::Pass(None));
        }
        let calls = calls(&keys);
        let outcome = match calls.as_slice() {
            [call] => limiter.limit_call_with_status_on(&store, call).map(one_decided),
            _ => limiter.transaction_with_status_on(&store, &calls).map(all_decided),
        };
        Some(verdict(&keys, outcome))
    }

    /// The verdict on a request, awaiting the store.
    async fn decide(
        limiter: &RateLimiter<S>,
        specs: &[LimitSpec],
        parts: &http::request::Parts,
    ) -> Verdict {
        let keys = match gather(specs, parts) {
            Ok(keys) => keys,
            Err(verdict) => return verdict,
        };
        if keys.is_empty() {
            return Verdict::Pass(None);
        }
        let calls = calls(&keys);
        let outcome = match calls.as_slice() {
            [call] => {
                limiter.limit_with_status_async(call.target, call.request).await.map(one_decided)
            }
            _ => limiter.transaction_with_status_async(&calls).await.map(all_decided),
        };
        verdict(&keys, outcome)
    }
}

/// The header field values for the limits of a request: `RateLimit-Policy`, `RateLimit`.
fn headers<'s>(
    specs: impl Iterator<Item = &'s LimitSpec>,
    statuses: &[Status],
) -> Option<(HeaderValue, HeaderValue)> {
    use std::fmt::Write as _;
    let mut policy = String::with_capacity(64);
    let mut current = String::with_capacity(64);
    for (spec, status) in specs.zip(statuses) {
        // Granted because the store failed (fail open): no numbers to report.
        if !status.is_known() {
            return None;
        }
        let sep = if policy.is_empty() { "" } else { ", " };
        let (member, name_len) = spec.policy.as_ref()?;
        let _ = write!(policy, "{sep}{member}");
        current.push_str(sep);
        fields::write_status_member(&mut current, &member[..*name_len], status);
    }
    // From a String, the value takes the buffer over: no copy.
    Some((HeaderValue::try_from(policy).ok()?, HeaderValue::try_from(current).ok()?))
}

/// The IETF RateLimit header fields, formatted as the layer does, for servers that write
/// them themselves (the `tollgate` server does).
pub mod fields {
    use crate::{Config, Status};

    /// One member of `RateLimit-Policy`: `"name";q=<quota>;w=<window in s>`.
    pub fn policy_member(name: &str, config: &Config) -> String {
        let (q, w) = super::quota_window(config);
        format!("{};q={q};w={w}", super::sf_string(name))
    }

    /// One member of `RateLimit`: `"name";r=<remaining, rounded down>;t=<s until full, rounded up>`.
    pub fn status_member(name: &str, status: &Status) -> String {
        let mut out = String::new();
        write_status_member(&mut out, &super::sf_string(name), status);
        out
    }

    /// Appends the member of `RateLimit` for an already quoted name.
    pub(super) fn write_status_member(out: &mut String, quoted_name: &str, status: &Status) {
        use std::fmt::Write as _;
        let r = status.remaining.floor() as u64;
        let t = (status.reset_after / 1_000.0).ceil() as u64;
        let _ = write!(out, "{quoted_name};r={r};t={t}");
    }

    /// `Retry-After` in whole seconds, rounded up: never 0 for a positive wait.
    pub fn retry_after_seconds(ms: f64) -> u64 {
        (ms / 1_000.0).ceil().max(0.0) as u64
    }
}

/// `q` and `w` of a policy: the window is the period rounded up to whole seconds, and the
/// quota the rate over that window, rounded down.
/// A calendar window's `w` is its unit's usual length (a day of 24 hours, a month of 30 days,
/// a year of 365) and `q` its rate: the field has no way to say "until the 1st".
fn quota_window(config: &Config) -> (u64, u64) {
    if let Some(calendar) = config.calendar() {
        return (config.rate().floor() as u64, (calendar.unit().usual() / 1_000.0) as u64);
    }
    let w = (config.period() / 1_000.0).ceil().max(1.0);
    let q = (config.rate() * w * 1_000.0 / config.period()).floor();
    (q as u64, w as u64)
}

/// A structured-field string: printable ASCII, with `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}

/// `Retry-After` in whole seconds, rounded up: never 0 for a positive wait.
fn retry_after_header(ms: f64) -> HeaderValue {
    HeaderValue::from(fields::retry_after_seconds(ms))
}

fn error_body(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}

impl<S, Inner, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, Inner>
where
    S: AsyncStore + 'static,
    Inner: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    Inner::Future: Send,
    ReqBody: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = Inner::Error;
    type Future = ResponseFuture<Inner::Future, ResBody, Inner::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        // The memory store answers at once: decided here, with no future of its own.
        if let Some(verdict) = RateLimit::<S, ()>::decide_now(&self.limiter, &self.specs, &parts) {
            let state = match verdict {
                Verdict::Pass(headers) => State::Inner {
                    future: self.inner.call(Request::from_parts(parts, body)),
                    headers,
                },
                Verdict::Answer(refusal, headers) => {
                    State::Ready { response: Some(answer(&parts, refusal, headers)) }
                }
            };
            return ResponseFuture { state };
        }
        // A store to await: the service that was made ready goes into the future, and a
        // clone of it stays for the next request (tower's rule for services that wait).
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let (limiter, specs) = (Arc::clone(&self.limiter), Arc::clone(&self.specs));
        let future = async move {
            match RateLimit::<S, ()>::decide(&limiter, &specs, &parts).await {
                Verdict::Pass(headers) => {
                    let mut response = inner.call(Request::from_parts(parts, body)).await?;
                    insert_rate_limit_headers(response.headers_mut(), headers);
                    Ok(response.map(ResponseBody::inner))
                }
                Verdict::Answer(refusal, headers) => Ok(answer(&parts, refusal, headers)),
            }
        };
        ResponseFuture { state: State::Deciding { future: Box::pin(future) } }
    }
}

/// The layer's own answer to a request: for HTTP, `429` with `Retry-After` and a JSON body
/// (or the error's status and `{"error": ...}`); for gRPC (`content-type: application/grpc`),
/// a trailers-only response whose `grpc-status` says the same (`RESOURCE_EXHAUSTED` when
/// refused, `UNAVAILABLE` when the store fails, `INVALID_ARGUMENT`, `INTERNAL`).
fn answer<B>(
    parts: &http::request::Parts,
    refusal: Refusal,
    headers: Option<(HeaderValue, HeaderValue)>,
) -> Response<ResponseBody<B>> {
    let grpc = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let (status, retry_after, message, body) = match refusal {
        Refusal::Limited { name, retry_after } => {
            let body = serde_json::json!({ "kind": "RateLimited", "name": &*name, "retryAfter": retry_after })
                .to_string();
            let message = format!(
                "Rate limit {name} exceeded; retry after {} ms.",
                crate::core::fmt_number(retry_after.ceil())
            );
            (StatusCode::TOO_MANY_REQUESTS, Some(retry_after_header(retry_after)), message, body)
        }
        Refusal::Error(status, message) => {
            let body = error_body(&message);
            (status, None, message, body)
        }
        Refusal::Store(may_have_taken) => {
            let message = STORE_UNAVAILABLE.to_owned();
            let body = serde_json::json!({ "error": &message, "mayHaveTaken": may_have_taken })
                .to_string();
            (StatusCode::SERVICE_UNAVAILABLE, None, message, body)
        }
    };
    let mut response = Response::new(ResponseBody::full(if grpc { String::new() } else { body }));
    if !grpc {
        *response.status_mut() = status;
    }
    let h = response.headers_mut();
    if grpc {
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS, HeaderValue::from(grpc_code(status)));
        if let Ok(message) = HeaderValue::try_from(grpc_message(&message)) {
            h.insert(GRPC_MESSAGE, message);
        }
    } else {
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    if let Some(retry_after) = retry_after {
        h.insert(http::header::RETRY_AFTER, retry_after);
    }
    insert_rate_limit_headers(response.headers_mut(), headers);
    response
}

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// The gRPC status code of the layer's answer with HTTP status `status`.
fn grpc_code(status: StatusCode) -> u16 {
    match status {
        StatusCode::TOO_MANY_REQUESTS => 8,    // RESOURCE_EXHAUSTED
        StatusCode::SERVICE_UNAVAILABLE => 14, // UNAVAILABLE
        StatusCode::BAD_REQUEST => 3,          // INVALID_ARGUMENT
        _ => 13,                               // INTERNAL
    }
}

/// A `grpc-message`: percent-encoded, as the gRPC protocol asks for every byte outside
/// printable ASCII and for `%`.
fn grpc_message(message: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn insert_rate_limit_headers(h: &mut http::HeaderMap, headers: Option<(HeaderValue, HeaderValue)>) {
    if let Some((policy, current)) = headers {
        h.insert(RATELIMIT_POLICY, policy);
        h.insert(RATELIMIT, current);
    }
}

/// The future of a store that must be awaited: the decision, then the inner service.
type Deciding<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project_lite::pin_project! {
    /// The body of a [`RateLimit`] response: the inner service's, or the layer's own answer
    /// (a JSON body for HTTP, an empty one for gRPC). Any body the service's own would do
    /// for axum, hyper or tonic does.
    pub struct ResponseBody<B> {
        #[pin]
        kind: BodyKind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = BodyKindProj]
    enum BodyKind<B> {
        Inner { #[pin] body: B },
        Full { bytes: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    fn inner(body: B) -> Self {
        ResponseBody { kind: BodyKind::Inner { body } }
    }

    fn full(text: String) -> Self {
        let bytes = (!text.is_empty()).then(|| Bytes::from(text));
        ResponseBody { kind: BodyKind::Full { bytes } }
    }
}

impl<B: http_body::Body<Data = Bytes>> http_body::Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            BodyKindProj::Inner { body } => body.poll_frame(cx),
            BodyKindProj::Full { bytes } => {
                Poll::Ready(bytes.take().map(|b| Ok(http_body::Frame::data(b))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            BodyKind::Inner { body } => body.is_end_stream(),
            BodyKind::Full { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.kind {
            BodyKind::Inner { body } => body.size_hint(),
            BodyKind::Full { bytes } => {
                http_body::SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`RateLimit`]: the inner service's, with the header fields added, or a
    /// ready refusal; on a store that must be awaited, the decision and then either.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        Inner { #[pin] future: F, headers: Option<(HeaderValue, HeaderValue)> },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Deciding { future: Deciding<B, E> },
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, headers } => {
                let mut response = std::task::ready!(future.poll(cx))?;
                insert_rate_limit_headers(response.headers_mut(), headers.take());
                Poll::Ready(Ok(response.map(ResponseBody::inner)))
            }
            StateProj::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("ResponseFuture polled after completion")))
            }
            StateProj::Deciding { future } => future.as_mut().poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero_for_a_wait() {
        assert_eq!(retry_after_header(400.0), "1");
        assert_eq!(retry_after_header(1_000.0), "1");
        assert_eq!(retry_after_header(1_000.1), "2");
        assert_eq!(retry_after_header(59_999.0), "60");
        assert_eq!(retry_after_header(0.0), "0");
    }

    #[test]
    fn policy_quota_and_window() {
        assert_eq!(quota_window(&Config::token_bucket(10.0, 60_000.0)), (10, 60));
        assert_eq!(quota_window(&Config::token_bucket(5.0, 500.0)), (10, 1));
        assert_eq!(quota_window(&Config::fixed_window(100.0, 90_500.0)), (100, 91));
    }

    #[test]
    fn names_are_structured_field_strings() {
        assert_eq!(sf_string("send"), "\"send\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("café"), "\"caf?\"");
    }
}
