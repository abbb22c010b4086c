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
//! s and the count of the others when the 10 s are over, never to the client) unless the
//! limit or the layer was made to [fail open](RateLimitLayer::fail_open): `mayHaveTaken` is
//! true only when the request reached the store and no answer came back, so that its tokens
//! may be spent (a client that retries it may pay twice); false means nothing was taken,
//! and a retry is safe. Put a networked store behind a `tollgate::store::CircuitBreaker` so
//! that a store that hangs fails fast.
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
//! # Options
//!
//! What users of express-rate-limit, @fastify/rate-limit and slowapi configure, as builder
//! methods of [`RateLimitLayer`], resolved when the layer is made:
//! [`skip`](RateLimitLayer::skip) (health checks, an allow-list),
//! [`on_refused`](RateLimitLayer::on_refused) (the refusal's status, body and fields),
//! [`insert_info`](RateLimitLayer::insert_info) (the decision, a [`RateLimitInfo`], in the
//! request's extensions for the handler), [`legacy_headers`](RateLimitLayer::legacy_headers)
//! (`X-RateLimit-Limit`, `-Remaining`, `-Reset`), [`fail_open`](RateLimitLayer::fail_open)
//! (this layer's requests pass when the store fails). A limit name the limiter does not
//! define fails when the layer is made ([`RateLimitLayer::try_new`]).
//!
//! # Concurrency limits
//!
//! [`RateLimitLayer::with_concurrency`] (or [`RateLimitLayer::concurrency`], for a layer of
//! slots alone) holds a slot of a concurrency limit ([`ConcurrencySpec`]) while each request
//! is answered: acquired before the rate limits, released when the response body ends (or
//! is dropped: a client gone), or when the service fails or its future is dropped. A refusal
//! is `429` (or the spec's status) with `Retry-After`, and takes no rate limit's token.
//!
//! # The header fields
//!
//! For each limit, named by its name: `RateLimit-Policy: "name";q=<rate>;w=<period in s>`
//! and `RateLimit: "name";r=<tokens remaining>;t=<seconds until full again>`. `w` is the
//! period rounded up to whole seconds and `q` the rate over that window; `r` is rounded
//! down and `t` up, so a client that trusts them is never refused for it. A name that is
//! not printable ASCII is written with `?` for the other characters.

mod info;
mod key;
mod log;

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use info::{LimitInfo, RateLimitInfo};
pub use key::{DEFAULT_IPV6_SUBNET, Key, MissingKey, TrustedProxies};

use crate::concurrency::{Acquire, Acquired, HeldAsync, SlotsTarget};
use crate::core::Inline;
use crate::limiter::{Call, RateLimiter, Target};
use crate::store::AsyncStore;
use crate::{Concurrency, Config, Error, Limits, Status, Taken};

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
    /// Its config and header field parts, once a layer has resolved it.
    resolved: Option<Resolved>,
}

/// What a layer knows of a limit once it is made.
#[derive(Clone)]
struct Resolved {
    config: Config,
    /// The limit's `RateLimit-Policy` member (`"name";q=..;w=..`).
    policy: Arc<str>,
    /// The length of its quoted name, the member's start.
    name_len: usize,
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
            resolved: None,
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
    /// invalid requests are still refused. With several limits, a request passes only if all
    /// of them fail open; [`RateLimitLayer::fail_open`] makes every limit of a layer do so.
    /// The failure is logged either way.
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

/// The concurrency limit (SPEC §6f) a [`RateLimitLayer`] holds a slot of while each request
/// is answered: acquired before the rate limits and the service, released when the
/// response's body ends (its last frame or an error, or the body dropped unread: a client
/// gone), or when the service's future fails or is dropped before that.
///
/// Why the body's end and not the future's: a streamed body (a download, server-sent
/// events) is work in flight long after the service's future resolves, and a limit of
/// "4 exports at once" that counted only until the headers would let a fifth start while
/// four are still streaming. The guard rides in the layer's [`ResponseBody`], which the
/// server drops when it has sent the last frame or the connection is gone, so the slot
/// lasts exactly as long as the response does.
///
/// A refusal is `429` (or [`status`](ConcurrencySpec::status), such as `503` for a server
/// that says it is busy) with `Retry-After` (the wait until the earliest holder's expiry,
/// in whole seconds rounded up; a release may free a slot sooner) and the layer's JSON body,
/// `{"kind": "RateLimited", "name", "retryAfter": <ms>}` ([`on_refused`](RateLimitLayer::on_refused)
/// answers the rate limits' refusals only); a request refused so takes no rate limit's
/// token, and one the rate limits refuse gives its slot back at once. When the store fails,
/// the answer is the rate limits' `503`, or the request passes without a slot if the layer
/// [fails open](RateLimitLayer::fail_open).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use tollgate::tower::{ConcurrencySpec, Key, LimitSpec, RateLimitLayer};
/// use tollgate::{Concurrency, Config, MemoryStore, RateLimiter, MINUTE};
///
/// let limiter = RateLimiter::builder(MemoryStore::new())
///     .define("exports", Config::token_bucket(60.0, MINUTE))
///     .define_concurrency("exports at once", Concurrency::new(4))
///     .build();
/// let tenant = Key::header("x-tenant");
/// let layer = RateLimitLayer::new(Arc::new(limiter), LimitSpec::new("exports").key(tenant.clone()))
///     .with_concurrency(ConcurrencySpec::new("exports at once").key(tenant));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct ConcurrencySpec {
    name: Arc<str>,
    key: Key,
    count: Option<u32>,
    ttl: Option<f64>,
    status: StatusCode,
    /// The limit, once a layer has resolved it.
    limit: Option<Concurrency>,
}

impl ConcurrencySpec {
    /// A concurrency limit defined on the limiter
    /// ([`define_concurrency`](crate::RateLimiterBuilder::define_concurrency)), global until
    /// a [`key`](ConcurrencySpec::key) is set; one slot per request, held at most the
    /// limit's `ttl`.
    pub fn new(name: &str) -> Self {
        ConcurrencySpec {
            name: name.into(),
            key: Key::global(),
            count: None,
            ttl: None,
            status: StatusCode::TOO_MANY_REQUESTS,
            limit: None,
        }
    }

    /// Where each request's key comes from (default: [`Key::global`]). A request without
    /// one is refused with 400.
    #[must_use]
    pub fn key(mut self, key: Key) -> Self {
        self.key = key;
        self
    }

    /// Takes `count` slots per request instead of one.
    #[must_use]
    pub fn count(mut self, count: u32) -> Self {
        self.count = Some(count);
        self
    }

    /// Holds them at most `ttl` ms (a request whose server died frees them then), instead
    /// of the limit's `ttl`.
    #[must_use]
    pub fn ttl(mut self, ttl: f64) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The status of a refusal, instead of `429`: `503` says the server is busy rather
    /// than that the client asked too often.
    #[must_use]
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    fn acquire<'k>(&self, key: Option<&'k str>) -> Acquire<'k> {
        let mut request = Acquire::new();
        if let Some(key) = key {
            request = request.key(key);
        }
        if let Some(count) = self.count {
            request = request.count(count);
        }
        if let Some(ttl) = self.ttl {
            request = request.ttl(ttl);
        }
        request
    }
}

/// A tower [`Layer`] that rate limits every request of the service it wraps.
///
/// With one [`LimitSpec`], each request takes from that limit; with several
/// ([`RateLimitLayer::with`]), from all of them as one all-or-nothing transaction. Its
/// options ([`skip`](RateLimitLayer::skip), [`on_refused`](RateLimitLayer::on_refused),
/// [`insert_info`](RateLimitLayer::insert_info),
/// [`legacy_headers`](RateLimitLayer::legacy_headers),
/// [`fail_open`](RateLimitLayer::fail_open)) are builder methods, resolved when the layer is
/// made. With a [`ConcurrencySpec`] ([`RateLimitLayer::with_concurrency`]) it also holds a
/// slot of a concurrency limit for each request, until its response ends.
pub struct RateLimitLayer<S> {
    limiter: Arc<RateLimiter<S>>,
    setup: Arc<Setup>,
}

type SkipFn = dyn Fn(&http::request::Parts) -> bool + Send + Sync;
type RefusalFn = dyn Fn(&http::request::Parts, &RateLimitInfo) -> Response<Bytes> + Send + Sync;

/// Everything a layer was told besides its limiter, shared by its services.
#[derive(Clone)]
struct Setup {
    specs: Vec<LimitSpec>,
    slots: Option<ConcurrencySpec>,
    skip: Option<Arc<SkipFn>>,
    on_refused: Option<Arc<RefusalFn>>,
    insert_info: bool,
    legacy_headers: bool,
    fail_open: bool,
}

impl Setup {
    /// The rate limits `specs`, every option at its default.
    fn of(specs: Vec<LimitSpec>) -> Self {
        Setup {
            specs,
            slots: None,
            skip: None,
            on_refused: None,
            insert_info: false,
            legacy_headers: false,
            fail_open: false,
        }
    }
}

/// The header fields' names, parsed once.
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

// Not derived: the store is shared behind an `Arc` and need not be `Clone` itself.
impl<S> Clone for RateLimitLayer<S> {
    fn clone(&self) -> Self {
        RateLimitLayer { limiter: Arc::clone(&self.limiter), setup: Arc::clone(&self.setup) }
    }
}

impl<S> RateLimitLayer<S> {
    /// A layer taking `spec` for each request.
    ///
    /// # Panics
    ///
    /// If `spec` names a limit that the limiter does not define and gives no config for it
    /// (a misspelled name, say): the message names it and says how to define it. The
    /// limiter's names are fixed when it is built, so such a layer could only ever answer
    /// 500. [`RateLimitLayer::try_new`] returns the error instead.
    pub fn new(limiter: Arc<RateLimiter<S>>, spec: LimitSpec) -> Self {
        Self::try_new(limiter, spec).unwrap_or_else(|err| panic!("RateLimitLayer: {err}"))
    }

    /// A layer taking `spec` for each request, or [`Error::NotDefined`] if `spec` names a
    /// limit the limiter does not define: for layers built from names read at run time.
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`], whose message names the limit and says how to define it.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::tower::{LimitSpec, RateLimitLayer};
    /// use tollgate::{Config, Error, RateLimiter, MINUTE};
    ///
    /// let limiter = RateLimiter::builder(tollgate::MemoryStore::new())
    ///     .define("search", Config::token_bucket(100.0, MINUTE))
    ///     .build();
    /// let limiter = Arc::new(limiter);
    /// assert!(RateLimitLayer::try_new(Arc::clone(&limiter), LimitSpec::new("search")).is_ok());
    /// let misspelled = RateLimitLayer::try_new(limiter, LimitSpec::new("serch"));
    /// assert!(matches!(misspelled, Err(Error::NotDefined { name }) if name == "serch"));
    /// ```
    pub fn try_new(limiter: Arc<RateLimiter<S>>, spec: LimitSpec) -> Result<Self, Error> {
        let spec = spec.resolve(&limiter)?;
        Ok(RateLimitLayer { limiter, setup: Arc::new(Setup::of(vec![spec])) })
    }

    /// Also takes `spec`, in the same transaction as the others.
    ///
    /// # Panics
    ///
    /// As [`RateLimitLayer::new`], for a name the limiter does not define.
    #[must_use]
    pub fn with(self, spec: LimitSpec) -> Self {
        self.try_with(spec).unwrap_or_else(|err| panic!("RateLimitLayer: {err}"))
    }

    /// Also takes `spec`, or [`Error::NotDefined`] as [`RateLimitLayer::try_new`].
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for a name the limiter does not define.
    pub fn try_with(mut self, spec: LimitSpec) -> Result<Self, Error> {
        let spec = spec.resolve(&self.limiter)?;
        Arc::make_mut(&mut self.setup).specs.push(spec);
        Ok(self)
    }

    /// A layer that holds a slot of the concurrency limit `spec` for each request, and
    /// takes no rate limit (add some with [`RateLimitLayer::with`]).
    ///
    /// # Panics
    ///
    /// As [`RateLimitLayer::with_concurrency`].
    pub fn concurrency(limiter: Arc<RateLimiter<S>>, spec: ConcurrencySpec) -> Self {
        RateLimitLayer { limiter, setup: Arc::new(Setup::of(Vec::new())) }.with_concurrency(spec)
    }

    /// Also holds a slot of the concurrency limit `spec` while each request is answered
    /// (see [`ConcurrencySpec`]); it replaces the one given before, if any.
    ///
    /// # Panics
    ///
    /// If the limiter defines no concurrency limit of that name, or its count is above the
    /// limit's `max`; [`RateLimitLayer::try_with_concurrency`] returns the error instead.
    #[must_use]
    pub fn with_concurrency(self, spec: ConcurrencySpec) -> Self {
        self.try_with_concurrency(spec).unwrap_or_else(|err| panic!("RateLimitLayer: {err}"))
    }

    /// [`RateLimitLayer::with_concurrency`], or the error.
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for a name the limiter does not define as a concurrency limit,
    /// [`Error::Invalid`] for a count above its `max` or a ttl that is not positive.
    pub fn try_with_concurrency(mut self, spec: ConcurrencySpec) -> Result<Self, Error> {
        let limit = self.limiter.concurrency_of(SlotsTarget::Named(&spec.name))?;
        // The acquire's own checks (count, ttl), made once here, not per request.
        spec.acquire(None).op(&limit).validate(&limit)?;
        Arc::make_mut(&mut self.setup).slots = Some(ConcurrencySpec { limit: Some(limit), ..spec });
        Ok(self)
    }

    /// Lets the requests for which `skip` is true pass untouched: nothing is taken, no
    /// header field is written, and no [`RateLimitInfo`] is inserted. For health checks,
    /// CORS preflight requests or an allow-list (express-rate-limit's `skip`,
    /// @fastify/rate-limit's `allowList`, slowapi's `exempt`). It sees the request's head:
    /// method, URI, headers and the extensions earlier layers put there.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::tower::{LimitSpec, RateLimitLayer};
    /// use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
    ///
    /// let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    /// let api = LimitSpec::new(("api", Config::token_bucket(60.0, MINUTE)));
    /// let layer = RateLimitLayer::new(limiter, api)
    ///     .skip(|head| head.uri.path() == "/healthz" || head.method == http::Method::OPTIONS);
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn skip(
        mut self,
        skip: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.setup).skip = Some(Arc::new(skip));
        self
    }

    /// Answers a refused request with the response `refused` builds, instead of the layer's
    /// `429` with its JSON body (express-rate-limit's `handler`, @fastify/rate-limit's
    /// `errorResponseBuilder`).
    ///
    /// `refused` gets the request's head and the decision ([`RateLimitInfo`]: the limit that
    /// refused, the wait, each limit's numbers), and sets the status, body and header
    /// fields. The layer then adds `Retry-After` and the RateLimit fields (and the
    /// [legacy ones](RateLimitLayer::legacy_headers)) that the response does not set itself.
    /// Only refusals go to it: a missing key (400) or a failed store (503) are answered as
    /// before. A gRPC request's refusal goes to it too (its `content-type` says
    /// `application/grpc`: answer those with a `grpc-status`, or leave the layer's).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use http::{Response, StatusCode};
    /// use tollgate::tower::{LimitSpec, RateLimitLayer};
    /// use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
    ///
    /// let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    /// let api = LimitSpec::new(("api", Config::token_bucket(60.0, MINUTE)));
    /// let layer = RateLimitLayer::new(limiter, api).on_refused(|_head, info| {
    ///     let seconds = (info.retry_after.unwrap_or(0.0) / 1_000.0).ceil();
    ///     Response::builder()
    ///         .status(StatusCode::SERVICE_UNAVAILABLE)
    ///         .header("content-type", "text/plain")
    ///         .body(format!("Slow down: try again in {seconds} s."))
    ///         .unwrap()
    /// });
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn on_refused<B, F>(mut self, refused: F) -> Self
    where
        B: Into<Bytes>,
        F: Fn(&http::request::Parts, &RateLimitInfo) -> Response<B> + Send + Sync + 'static,
    {
        let refused = move |head: &http::request::Parts, info: &RateLimitInfo| {
            refused(head, info).map(Into::into)
        };
        Arc::make_mut(&mut self.setup).on_refused = Some(Arc::new(refused));
        self
    }

    /// Puts the decision ([`RateLimitInfo`]: each limit's numbers) in the extensions of each
    /// request the layer admits, for the handler: axum's `Option<Extension<RateLimitInfo>>`,
    /// or `request.extensions().get::<RateLimitInfo>()` (express-rate-limit's
    /// `req.rateLimit`). Off by default, since it costs each request an allocation.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use axum::{routing::get, Extension, Router};
    /// use tollgate::tower::{LimitSpec, RateLimitInfo, RateLimitLayer};
    /// use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
    ///
    /// async fn search(info: Option<Extension<RateLimitInfo>>) -> String {
    ///     let left = info.map_or(0.0, |Extension(info)| info.limits[0].remaining);
    ///     format!("{left} searches left")
    /// }
    ///
    /// let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    /// let spec = LimitSpec::new(("search", Config::token_bucket(60.0, MINUTE)));
    /// let app: Router = Router::new()
    ///     .route("/search", get(search))
    ///     .layer(RateLimitLayer::new(limiter, spec).insert_info());
    /// # let _ = app;
    /// ```
    #[must_use]
    pub fn insert_info(mut self) -> Self {
        Arc::make_mut(&mut self.setup).insert_info = true;
        self
    }

    /// Also writes `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`,
    /// the fields clients of express-rate-limit (`legacyHeaders`), slowapi and GitHub's API
    /// read, beside the IETF `RateLimit` and `RateLimit-Policy`.
    ///
    /// They carry one limit: the one that refused, or else the one with the fewest tokens
    /// left (of equals, the first). `Limit` is its capacity, `Remaining` its tokens left
    /// (rounded down), `Reset` the Unix time in seconds (rounded up) at which it is full
    /// again, as express-rate-limit and GitHub write it. Like the IETF fields, they are left
    /// out when the numbers are unknown (the store failed and the limit fails open).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::tower::{LimitSpec, RateLimitLayer};
    /// use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
    ///
    /// let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    /// let spec = LimitSpec::new(("api", Config::token_bucket(60.0, MINUTE)));
    /// let layer = RateLimitLayer::new(limiter, spec).legacy_headers();
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn legacy_headers(mut self) -> Self {
        Arc::make_mut(&mut self.setup).legacy_headers = true;
        self
    }

    /// Lets every request of this layer through when the store fails, instead of answering
    /// 503 (express-rate-limit's `passOnStoreError`): each of its limits as
    /// [`LimitSpec::fail_open`] makes one. The failure is still logged (`tracing`, target
    /// `tollgate::tower`, a line at most every 10 s, and the count of the others when the
    /// 10 s are over).
    ///
    /// The limiter's own [`fail_open`](crate::RateLimiterBuilder::fail_open) is decided
    /// first, inside the limiter, for every caller of that limit (this layer, other layers,
    /// direct calls), and counted by [`RateLimiter::failed_open`]; the layer then sees a
    /// grant with no numbers, and logs nothing. This option is decided after it, for the
    /// requests of this layer only, on the store errors the limiter returns: it is not
    /// counted by `failed_open`. Invalid requests (a missing key, a bad count) are still
    /// refused. See [`LimitSpec::fail_open`] for the trade.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::tower::{LimitSpec, RateLimitLayer};
    /// use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
    ///
    /// let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    /// let search = LimitSpec::new(("search", Config::token_bucket(60.0, MINUTE)));
    /// let layer = RateLimitLayer::new(limiter, search).fail_open();
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn fail_open(mut self) -> Self {
        Arc::make_mut(&mut self.setup).fail_open = true;
        self
    }
}

impl LimitSpec {
    /// Resolves the spec's config once: its inline one or the limiter's definition, with its
    /// policy member; a name with neither is an error of the app's setup.
    fn resolve<S>(mut self, limiter: &RateLimiter<S>) -> Result<Self, Error> {
        let config = self
            .config
            .or_else(|| limiter.defined_config(&self.name))
            .ok_or_else(|| Error::NotDefined { name: self.name.to_string() })?;
        let policy = fields::policy_member(&self.name, &config).into();
        self.resolved = Some(Resolved { config, policy, name_len: sf_string(&self.name).len() });
        Ok(self)
    }
}

impl<S, Inner> Layer<Inner> for RateLimitLayer<S> {
    type Service = RateLimit<S, Inner>;

    fn layer(&self, inner: Inner) -> Self::Service {
        RateLimit { inner, limiter: Arc::clone(&self.limiter), setup: Arc::clone(&self.setup) }
    }
}

/// The service of a [`RateLimitLayer`].
pub struct RateLimit<S, Inner> {
    inner: Inner,
    limiter: Arc<RateLimiter<S>>,
    setup: Arc<Setup>,
}

impl<S, Inner: Clone> Clone for RateLimit<S, Inner> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            limiter: Arc::clone(&self.limiter),
            setup: Arc::clone(&self.setup),
        }
    }
}

/// What the limits said about one request.
enum Verdict {
    /// Pass it on, with the decision for its extensions (if asked for); add these header
    /// fields to the response.
    Pass(Fields, Option<RateLimitInfo>),
    /// Answer at once: refused (with its wait), or an error, with the header fields.
    Answer(Refusal, Fields),
}

/// The header fields a response gets from the layer.
#[derive(Default)]
struct Fields {
    /// `RateLimit-Policy` and `RateLimit`.
    ietf: Option<(HeaderValue, HeaderValue)>,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`, if asked for (boxed: the future of
    /// every request carries `Fields`, and most have none).
    legacy: Option<Box<[HeaderValue; 3]>>,
}

/// Why a request is answered by the layer instead of the service.
enum Refusal {
    /// Refused by a limit: retry after this many ms; the decision, for a custom refusal.
    Limited { name: Arc<str>, retry_after: f64, info: Option<RateLimitInfo> },
    /// Refused by the concurrency limit: no slot free for this many ms at most; answered
    /// with its status.
    Busy { name: Arc<str>, retry_after: f64, status: StatusCode },
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

/// One limit of a request: its spec, key and count.
type Taking<'p> = (&'p LimitSpec, Option<Cow<'p, str>>, f64);

/// What the limiter answered for a request: granted, the longest wait, per limit its
/// decision and status.
type Decided = (bool, Option<f64>, Inline<crate::Decision>, Inline<Status>);

/// Every spec's key and count for a request; a missing key that refuses the request is its
/// answer, given before anything is taken.
fn gather<'p>(
    specs: &'p [LimitSpec],
    parts: &'p http::request::Parts,
) -> Result<Inline<Taking<'p>>, Refusal> {
    let mut keys: Inline<_> = Inline::new();
    for spec in specs {
        let key = match spec.key.of(parts) {
            Ok(key) => key,
            Err(missing) => match spec.missing_key {
                MissingKey::Reject => {
                    let message = format!("Rate limit {}: {}.", spec.name, missing.0);
                    return Err(Refusal::Error(StatusCode::BAD_REQUEST, message));
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
fn verdict(setup: &Setup, keys: &[Taking<'_>], outcome: Result<Decided, Error>) -> Verdict {
    match outcome {
        Ok((ok, retry_after, results, statuses)) => {
            let refused = (!ok).then(|| crate::core::longest_refusal(&results).unwrap_or(0));
            let wait =
                refused.and_then(|i| results.get(i)?.retry_after).or(retry_after).unwrap_or(0.0);
            let known = statuses.iter().all(Status::is_known);
            let fields = Fields {
                ietf: if known { headers(keys.iter().map(|k| k.0), &statuses) } else { None },
                legacy: (setup.legacy_headers && known)
                    .then(|| legacy_headers(keys, &statuses, refused))
                    .flatten(),
            };
            let wants_info = if ok { setup.insert_info } else { setup.on_refused.is_some() };
            let info = (wants_info && known).then(|| RateLimitInfo {
                ok,
                retry_after: refused.map(|_| wait),
                limits: keys
                    .iter()
                    .zip(&statuses)
                    .filter_map(|((spec, ..), status)| {
                        let config = spec.resolved.as_ref()?.config;
                        Some(LimitInfo {
                            name: Arc::clone(&spec.name),
                            config,
                            limit: config.capacity(),
                            remaining: status.remaining,
                            reset_after: status.reset_after,
                        })
                    })
                    .collect(),
                refused,
            });
            let Some(i) = refused else {
                return Verdict::Pass(fields, info);
            };
            let name = Arc::clone(&keys.get(i).unwrap_or(&keys[0]).0.name);
            Verdict::Answer(Refusal::Limited { name, retry_after: wait, info }, fields)
        }
        Err(Error::Store(err)) => {
            log::STORE_FAILURES.note(&err);
            if setup.fail_open || keys.iter().all(|k| k.0.fail_open) {
                return Verdict::Pass(Fields::default(), None);
            }
            Verdict::Answer(Refusal::Store(err.may_have_taken()), Fields::default())
        }
        // A name the limiter does not know is a setup error of the app, not the client's
        // (the layer refuses to be built with one, so this is only a safeguard).
        Err(err @ Error::NotDefined { .. }) => Verdict::Answer(
            Refusal::Error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
            Fields::default(),
        ),
        Err(err) => Verdict::Answer(
            Refusal::Error(StatusCode::BAD_REQUEST, err.to_string()),
            Fields::default(),
        ),
    }
}

impl<S: AsyncStore + 'static> RateLimit<S, ()> {
    /// The verdict on a request, on a store that answers at once (see
    /// [`AsyncStore::immediate`]), or `None` for a store that must be awaited.
    fn decide_now(
        limiter: &RateLimiter<S>,
        setup: &Setup,
        parts: &http::request::Parts,
    ) -> Option<Verdict> {
        let store = limiter.store().immediate()?;
        let keys = match gather(&setup.specs, parts) {
            Ok(keys) => keys,
            Err(refusal) => return Some(Verdict::Answer(refusal, Fields::default())),
        };
        if keys.is_empty() {
            return Some(Verdict::Pass(Fields::default(), None));
        }
        let calls = calls(&keys);
        let outcome = match calls.as_slice() {
            [call] => limiter.limit_call_with_status_on(&store, call).map(one_decided),
            _ => limiter.transaction_with_status_on(&store, &calls).map(all_decided),
        };
        Some(verdict(setup, &keys, outcome))
    }

    /// The request's slot of the layer's concurrency limit (None: it has none, or the store
    /// failed and the layer fails open), or the answer to give instead.
    async fn hold(
        limiter: &Arc<RateLimiter<S>>,
        setup: &Setup,
        parts: &http::request::Parts,
    ) -> Result<Option<HeldAsync<S>>, Refusal> {
        let Some(spec) = &setup.slots else { return Ok(None) };
        let key = spec.key.of(parts).map_err(|missing| {
            let message = format!("Concurrency limit {}: {}.", spec.name, missing.0);
            Refusal::Error(StatusCode::BAD_REQUEST, message)
        })?;
        let Some(limit) = spec.limit else { return Ok(None) }; // resolved when the layer was made
        let target = SlotsTarget::Inline(&spec.name, limit);
        match limiter.acquire_async(target, spec.acquire(key.as_deref())).await {
            // No await from here: a future dropped now has the guard, which releases.
            Ok(Acquired::Granted(ticket)) => Ok(Some(HeldAsync::new(
                Arc::clone(limiter),
                &spec.name,
                key.as_deref(),
                limit,
                ticket,
            ))),
            Ok(Acquired::Refused { retry_after }) => Err(Refusal::Busy {
                name: Arc::clone(&spec.name),
                retry_after,
                status: spec.status,
            }),
            Err(Error::Store(err)) => {
                log::STORE_FAILURES.note(&err);
                if setup.fail_open {
                    return Ok(None);
                }
                Err(Refusal::Store(err.may_have_taken()))
            }
            Err(err @ Error::NotDefined { .. }) => {
                Err(Refusal::Error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))
            }
            Err(err) => Err(Refusal::Error(StatusCode::BAD_REQUEST, err.to_string())),
        }
    }

    /// The verdict on a request, awaiting the store.
    async fn decide(
        limiter: &RateLimiter<S>,
        setup: &Setup,
        parts: &http::request::Parts,
    ) -> Verdict {
        let keys = match gather(&setup.specs, parts) {
            Ok(keys) => keys,
            Err(refusal) => return Verdict::Answer(refusal, Fields::default()),
        };
        if keys.is_empty() {
            return Verdict::Pass(Fields::default(), None);
        }
        let calls = calls(&keys);
        let outcome = match calls.as_slice() {
            [call] => {
                limiter.limit_with_status_async(call.target, call.request).await.map(one_decided)
            }
            _ => limiter.transaction_with_status_async(&calls).await.map(all_decided),
        };
        verdict(setup, &keys, outcome)
    }
}

/// The header field values for the limits of a request, whose numbers are known:
/// `RateLimit-Policy`, `RateLimit`.
fn headers<'s>(
    specs: impl Iterator<Item = &'s LimitSpec>,
    statuses: &[Status],
) -> Option<(HeaderValue, HeaderValue)> {
    use std::fmt::Write as _;
    let mut policy = String::with_capacity(64);
    let mut current = String::with_capacity(64);
    for (spec, status) in specs.zip(statuses) {
        let sep = if policy.is_empty() { "" } else { ", " };
        let resolved = spec.resolved.as_ref()?;
        let _ = write!(policy, "{sep}{}", resolved.policy);
        current.push_str(sep);
        fields::write_status_member(&mut current, &resolved.policy[..resolved.name_len], status);
    }
    // From a String, the value takes the buffer over: no copy.
    Some((HeaderValue::try_from(policy).ok()?, HeaderValue::try_from(current).ok()?))
}

/// `X-RateLimit-Limit`, `-Remaining`, `-Reset` for the limit that refused, or else the one
/// with the fewest tokens left: its capacity, its tokens left rounded down, and the Unix
/// time in seconds, rounded up, at which it is full again.
fn legacy_headers(
    keys: &[Taking<'_>],
    statuses: &[Status],
    refused: Option<usize>,
) -> Option<Box<[HeaderValue; 3]>> {
    let i = refused.unwrap_or_else(|| {
        (0..statuses.len())
            .min_by(|&a, &b| statuses[a].remaining.total_cmp(&statuses[b].remaining))
            .unwrap_or(0)
    });
    let (status, config) = (statuses.get(i)?, keys.get(i)?.0.resolved.as_ref()?.config);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
    let reset = ((now.as_millis() as f64 + status.reset_after) / 1_000.0).ceil() as u64;
    Some(Box::new([
        HeaderValue::from(config.capacity().floor() as u64),
        HeaderValue::from(status.remaining.floor() as u64),
        HeaderValue::from(reset),
    ]))
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
        let (mut parts, body) = request.into_parts();
        if self.setup.skip.as_ref().is_some_and(|skip| skip(&parts)) {
            let future = self.inner.call(Request::from_parts(parts, body));
            return ResponseFuture { state: State::Inner { future, fields: Fields::default() } };
        }
        // The memory store answers at once: decided here, with no future of its own (unless
        // a slot is to be held, whose guard the future keeps until the response is made).
        let now = if self.setup.slots.is_none() {
            RateLimit::<S, ()>::decide_now(&self.limiter, &self.setup, &parts)
        } else {
            None
        };
        if let Some(verdict) = now {
            let state = match verdict {
                Verdict::Pass(fields, info) => {
                    if let Some(info) = info {
                        parts.extensions.insert(info);
                    }
                    State::Inner {
                        future: self.inner.call(Request::from_parts(parts, body)),
                        fields,
                    }
                }
                Verdict::Answer(refusal, fields) => {
                    State::Ready { response: Some(answer(&self.setup, &parts, refusal, fields)) }
                }
            };
            return ResponseFuture { state };
        }
        // A store to await: the service that was made ready goes into the future, and a
        // clone of it stays for the next request (tower's rule for services that wait).
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let (limiter, setup) = (Arc::clone(&self.limiter), Arc::clone(&self.setup));
        let future = async move {
            // The slot first: a request refused by it takes no token. Dropped with this
            // future (the client gone) or with the inner service's error, it is released.
            let held = match RateLimit::<S, ()>::hold(&limiter, &setup, &parts).await {
                Ok(held) => held,
                Err(refusal) => return Ok(answer(&setup, &parts, refusal, Fields::default())),
            };
            match RateLimit::<S, ()>::decide(&limiter, &setup, &parts).await {
                Verdict::Pass(fields, info) => {
                    if let Some(info) = info {
                        parts.extensions.insert(info);
                    }
                    let mut response = inner.call(Request::from_parts(parts, body)).await?;
                    insert_fields(response.headers_mut(), fields, false);
                    Ok(response.map(|body| ResponseBody::holding(body, held)))
                }
                Verdict::Answer(refusal, fields) => {
                    drop(held); // refused by the rate limits: the slot goes back at once
                    Ok(answer(&setup, &parts, refusal, fields))
                }
            }
        };
        ResponseFuture { state: State::Deciding { future: Box::pin(future) } }
    }
}

/// The layer's own answer to a request: for HTTP, `429` with `Retry-After` and a JSON body
/// (or the error's status and `{"error": ...}`); for gRPC (`content-type: application/grpc`),
/// a trailers-only response whose `grpc-status` says the same (`RESOURCE_EXHAUSTED` when
/// refused, `UNAVAILABLE` when the store fails, `INVALID_ARGUMENT`, `INTERNAL`). A refusal
/// is the app's own response instead when it gave one ([`RateLimitLayer::on_refused`]).
fn answer<B>(
    setup: &Setup,
    parts: &http::request::Parts,
    refusal: Refusal,
    fields: Fields,
) -> Response<ResponseBody<B>> {
    if let (Some(on_refused), Refusal::Limited { retry_after, info: Some(info), .. }) =
        (&setup.on_refused, &refusal)
    {
        let mut response = on_refused(parts, info).map(ResponseBody::bytes);
        let h = response.headers_mut();
        if !h.contains_key(http::header::RETRY_AFTER) {
            h.insert(http::header::RETRY_AFTER, retry_after_header(*retry_after));
        }
        insert_fields(h, fields, true);
        return response;
    }
    let grpc = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let (status, retry_after, message, body) = match refusal {
        Refusal::Limited { name, retry_after, .. } => {
            let body = serde_json::json!({ "kind": "RateLimited", "name": &*name, "retryAfter": retry_after })
                .to_string();
            let message = format!(
                "Rate limit {name} exceeded; retry after {} ms.",
                crate::core::fmt_number(retry_after.ceil())
            );
            (StatusCode::TOO_MANY_REQUESTS, Some(retry_after_header(retry_after)), message, body)
        }
        Refusal::Busy { name, retry_after, status } => {
            let body = serde_json::json!({ "kind": "RateLimited", "name": &*name, "retryAfter": retry_after })
                .to_string();
            let message = format!(
                "Concurrency limit {name}: no slot free; retry after {} ms.",
                crate::core::fmt_number(retry_after.ceil())
            );
            (status, Some(retry_after_header(retry_after)), message, body)
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
    insert_fields(response.headers_mut(), fields, false);
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

/// Adds the layer's header fields to a response; with `keep`, not those it already has
/// (a custom refusal's own).
fn insert_fields(h: &mut http::HeaderMap, fields: Fields, keep: bool) {
    let mut put = |name: HeaderName, value: HeaderValue| {
        if !keep || !h.contains_key(&name) {
            h.insert(name, value);
        }
    };
    if let Some((policy, current)) = fields.ietf {
        put(RATELIMIT_POLICY, policy);
        put(RATELIMIT, current);
    }
    if let Some([limit, remaining, reset]) = fields.legacy.map(|b| *b) {
        put(X_RATELIMIT_LIMIT, limit);
        put(X_RATELIMIT_REMAINING, remaining);
        put(X_RATELIMIT_RESET, reset);
    }
}

/// The future of a store that must be awaited: the decision, then the inner service.
type Deciding<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project_lite::pin_project! {
    /// The body of a [`RateLimit`] response: the inner service's, or the layer's own answer
    /// (a JSON body for HTTP, an empty one for gRPC). Any body the service's own would do
    /// for axum, hyper or tonic does. With a [`ConcurrencySpec`], the service's body holds
    /// the request's slot until its last frame, an error, or its drop.
    pub struct ResponseBody<B> {
        #[pin]
        kind: BodyKind<B>,
        // The slot of the layer's concurrency limit that the response holds until its last
        // frame, an error, or its drop (a client gone).
        held: Option<Box<dyn std::any::Any + Send + Sync>>,
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
        ResponseBody { kind: BodyKind::Inner { body }, held: None }
    }

    fn holding<S: AsyncStore + 'static>(body: B, held: Option<HeldAsync<S>>) -> Self {
        let held = held.map(|held| Box::new(held) as Box<dyn std::any::Any + Send + Sync>);
        ResponseBody { kind: BodyKind::Inner { body }, held }
    }

    fn full(text: String) -> Self {
        Self::bytes(Bytes::from(text))
    }

    fn bytes(bytes: Bytes) -> Self {
        let bytes = (!bytes.is_empty()).then_some(bytes);
        ResponseBody { kind: BodyKind::Full { bytes }, held: None }
    }
}

impl<B: http_body::Body<Data = Bytes>> http_body::Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        let this = self.project();
        match this.kind.project() {
            BodyKindProj::Inner { body } => {
                let frame = std::task::ready!(body.poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    // The last frame was sent, or the body failed: the work is over.
                    *this.held = None;
                }
                Poll::Ready(frame)
            }
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
        Inner { #[pin] future: F, fields: Fields },
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
            StateProj::Inner { future, fields } => {
                let mut response = std::task::ready!(future.poll(cx))?;
                insert_fields(response.headers_mut(), std::mem::take(fields), false);
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

    /// A store error that fails open is logged as one that fails closed (before, a
    /// `LimitSpec::fail_open` pass left no trace).
    #[test]
    fn store_errors_that_fail_open_are_logged() {
        let spec = LimitSpec::new(("x", Config::token_bucket(1.0, 1_000.0)));
        let setup = Setup::of(vec![spec.clone().fail_open()]);
        let layer_open = Setup { specs: vec![spec], fail_open: true, ..setup.clone() };
        for setup in [setup, layer_open] {
            let keys = [(&setup.specs[0], None, 1.0)];
            let before = log::STORE_FAILURES.noted();
            let failed = Err(Error::Store(crate::StoreError::new("connection refused")));
            assert!(matches!(verdict(&setup, &keys, failed), Verdict::Pass(_, None)));
            assert_ne!(log::STORE_FAILURES.noted(), before, "logged or counted for the log");
        }
    }

    #[test]
    fn names_are_structured_field_strings() {
        assert_eq!(sf_string("send"), "\"send\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("café"), "\"caf?\"");
    }
}
