//! The tower layer, driven with `oneshot`: admitted and refused paths with exact header
//! values, Retry-After rounding, every key source, missing keys, transactions, store failure,
//! and the layer's options (skip, a custom refusal, the decision in the extensions, the
//! X-RateLimit-* fields, fail-open, an undefined name refused when the layer is made).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use tollgate::store::Unavailable;
use tollgate::tower::{
    Key, LimitSpec, MissingKey, RateLimitInfo, RateLimitLayer, ResponseBody, TrustedProxies,
};
use tollgate::{AsyncStore, Config, MINUTE, ManualClock, MemoryStore, RateLimiter, SECOND};
use tower::{Layer, Service, ServiceExt};

type Limiter = RateLimiter<MemoryStore<ManualClock>>;

fn limiter() -> (Arc<Limiter>, ManualClock) {
    let clock = ManualClock::new(1_700_000_000_000.0);
    let limiter = RateLimiter::builder(MemoryStore::with_clock(clock.clone()))
        .define("defined", Config::token_bucket(2.0, SECOND))
        .build();
    (Arc::new(limiter), clock)
}

fn send() -> LimitSpec {
    LimitSpec::new(("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0)))
}

/// The app behind the layer: answers 200 "ok".
fn app<S: AsyncStore + 'static>(
    layer: &RateLimitLayer<S>,
) -> impl Service<Request<String>, Response = Response<ResponseBody<String>>, Error = Infallible> + Clone
{
    layer.layer(tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::from("ok")))
    }))
}

/// `request` through the layer to the app; the response with its body read.
async fn call<S: AsyncStore + 'static>(
    layer: &RateLimitLayer<S>,
    request: Request<String>,
) -> Response<String> {
    let (parts, body) = app(layer).oneshot(request).await.unwrap().into_parts();
    let bytes = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
    Response::from_parts(parts, String::from_utf8(bytes.to_vec()).unwrap())
}

fn get() -> Request<String> {
    Request::new(String::new())
}

fn header<'r>(r: &'r Response<String>, name: &str) -> Option<&'r str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn admitted_requests_carry_exact_header_fields() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(l, send());
    let first = call(&layer, get()).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.body(), "ok");
    assert_eq!(header(&first, "ratelimit-policy"), Some("\"send\";q=10;w=60"));
    assert_eq!(header(&first, "ratelimit"), Some("\"send\";r=2;t=6"));
    // Capacity 3, 2 used, 10 a minute: 1 left, full again in 12 s.
    let second = call(&layer, get()).await;
    assert_eq!(header(&second, "ratelimit"), Some("\"send\";r=1;t=12"));
    assert_eq!(header(&second, "retry-after"), None);
}

#[tokio::test]
async fn refused_requests_get_429_with_retry_after_and_a_body() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(l, send());
    for _ in 0..3 {
        assert_eq!(call(&layer, get()).await.status(), StatusCode::OK);
    }
    let refused = call(&layer, get()).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "retry-after"), Some("6"));
    assert_eq!(header(&refused, "content-type"), Some("application/json"));
    assert_eq!(header(&refused, "ratelimit"), Some("\"send\";r=0;t=18"));
    assert_eq!(header(&refused, "ratelimit-policy"), Some("\"send\";q=10;w=60"));
    let body: serde_json::Value = serde_json::from_str(refused.body()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({ "kind": "RateLimited", "name": "send", "retryAfter": 6000.0 })
    );
}

#[tokio::test]
async fn retry_after_is_rounded_up_never_to_zero() {
    let (l, clock) = limiter();
    // One token every 400 ms.
    let layer = RateLimitLayer::new(
        l,
        LimitSpec::new(("fast", Config::token_bucket(5.0, 2.0 * SECOND).with_capacity(1.0))),
    );
    call(&layer, get()).await;
    let refused = call(&layer, get()).await;
    let body: serde_json::Value = serde_json::from_str(refused.body()).unwrap();
    assert_eq!(body["retryAfter"], 400.0);
    assert_eq!(header(&refused, "retry-after"), Some("1"), "0.4 s is 1, not 0");
    clock.advance(400.0);
    assert_eq!(call(&layer, get()).await.status(), StatusCode::OK, "and it is true at 400 ms");
}

fn from_peer(ip: &str) -> Request<String> {
    let mut r = get();
    r.extensions_mut().insert(format!("{ip}:5000").parse::<SocketAddr>().unwrap());
    r
}

#[tokio::test]
async fn keys_from_the_peer_address() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(Arc::clone(&l), send().key(Key::peer_ip()));
    for _ in 0..3 {
        call(&layer, from_peer("203.0.113.1")).await;
    }
    assert_eq!(
        call(&layer, from_peer("203.0.113.1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(call(&layer, from_peer("203.0.113.2")).await.status(), StatusCode::OK);
    assert_eq!(
        l.value(
            ("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0)),
            Some("203.0.113.2")
        )
        .unwrap()
        .value,
        2.0
    );
}

/// One host owns a /64 at least: 20 of its addresses share one limit of 3, keyed by their
/// /56 by default; another /56 has its own (issue 57, item 4: all 20 were admitted).
#[tokio::test]
async fn ipv6_peers_are_keyed_by_their_subnet() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(Arc::clone(&l), send().key(Key::peer_ip()));
    let mut admitted = 0;
    for i in 1..=20 {
        let mut r = get();
        let peer = format!("[2001:db8:7:1200::{i:x}]:5000").parse::<SocketAddr>().unwrap();
        r.extensions_mut().insert(peer);
        admitted += usize::from(call(&layer, r).await.status() == StatusCode::OK);
    }
    assert_eq!(admitted, 3);
    let mut other = get();
    other.extensions_mut().insert("[2001:db8:7:1300::1]:5000".parse::<SocketAddr>().unwrap());
    assert_eq!(call(&layer, other).await.status(), StatusCode::OK);
    let config = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
    assert_eq!(l.value(("send", config), Some("2001:db8:7:1200::/56")).unwrap().value, 0.0);
}

#[tokio::test]
async fn keys_from_forwarded_headers_only_behind_trusted_proxies() {
    let (l, _) = limiter();
    let key = Key::peer_ip_behind(TrustedProxies::parse(["10.0.0.0/8"]).unwrap());
    let layer = RateLimitLayer::new(l, send().key(key));
    let via_proxy = |client: &str| {
        let mut r = from_peer("10.0.0.1");
        r.headers_mut().insert("x-forwarded-for", format!("6.6.6.6, {client}").parse().unwrap());
        r
    };
    for _ in 0..3 {
        call(&layer, via_proxy("198.51.100.7")).await;
    }
    assert_eq!(
        call(&layer, via_proxy("198.51.100.7")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(call(&layer, via_proxy("198.51.100.8")).await.status(), StatusCode::OK);
    // A client talking to us directly cannot pick its key with the header: not to escape
    // its own spent key...
    let mut direct = from_peer("198.51.100.7");
    direct.headers_mut().insert("x-forwarded-for", "1.2.3.4".parse().unwrap());
    assert_eq!(call(&layer, direct).await.status(), StatusCode::TOO_MANY_REQUESTS);
    // ...nor to spend someone else's.
    let mut direct = from_peer("198.51.100.9");
    direct.headers_mut().insert("x-forwarded-for", "198.51.100.7".parse().unwrap());
    assert_eq!(call(&layer, direct).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn keys_from_a_header_an_extension_and_a_closure() {
    #[derive(Clone)]
    struct User(u32);
    let (l, _) = limiter();
    let specs = [
        send().key(Key::header("x-api-key")),
        send().key(Key::extension(|u: &User| format!("user-{}", u.0))),
        send().key(Key::from_fn(|parts| {
            parts.uri.path().strip_prefix("/t/").map(|k| format!("path-{k}"))
        })),
    ];
    let requests: [fn(&str) -> Request<String>; 3] = [
        |k| Request::builder().header("x-api-key", format!("api-{k}")).body(String::new()).unwrap(),
        |k| {
            let mut r = get();
            r.extensions_mut().insert(User(k.parse().unwrap()));
            r
        },
        |k| Request::builder().uri(format!("/t/{k}")).body(String::new()).unwrap(),
    ];
    for (spec, request) in specs.into_iter().zip(requests) {
        let layer = RateLimitLayer::new(Arc::clone(&l), spec);
        for _ in 0..3 {
            assert_eq!(call(&layer, request("1")).await.status(), StatusCode::OK);
        }
        assert_eq!(call(&layer, request("1")).await.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(call(&layer, request("2")).await.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn a_missing_key_is_refused_shared_or_skipped_as_configured() {
    let (l, _) = limiter();
    let reject = RateLimitLayer::new(Arc::clone(&l), send().key(Key::header("x-api-key")));
    let r = call(&reject, get()).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(r.body(), r#"{"error":"Rate limit send: the key header is missing."}"#);
    assert!(l.store().is_empty(), "nothing taken");

    let shared = RateLimitLayer::new(
        Arc::clone(&l),
        send().key(Key::header("x-api-key")).on_missing_key(MissingKey::Shared),
    );
    for _ in 0..3 {
        assert_eq!(call(&shared, get()).await.status(), StatusCode::OK);
    }
    assert_eq!(call(&shared, get()).await.status(), StatusCode::TOO_MANY_REQUESTS);

    let skip = RateLimitLayer::new(l, send().key(Key::peer_ip()).on_missing_key(MissingKey::Skip));
    for _ in 0..5 {
        let r = call(&skip, get()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(header(&r, "ratelimit"), None);
    }
}

#[tokio::test]
async fn counts_come_from_the_request() {
    let (l, _) = limiter();
    let tokens = LimitSpec::new(("llm", Config::token_bucket(1_000.0, MINUTE))).count(|parts| {
        parts.headers.get("x-tokens").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1.0)
    });
    let layer = RateLimitLayer::new(l, tokens);
    let ask = |n: &str| Request::builder().header("x-tokens", n).body(String::new()).unwrap();
    assert_eq!(header(&call(&layer, ask("600")).await, "ratelimit"), Some("\"llm\";r=400;t=36"));
    assert_eq!(call(&layer, ask("600")).await.status(), StatusCode::TOO_MANY_REQUESTS);
    let invalid = call(&layer, ask("-1")).await;
    assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        invalid.body(),
        r#"{"error":"Rate limit llm count -1 must be a finite number >= 0."}"#
    );
}

#[tokio::test]
async fn several_limits_are_one_transaction() {
    let (l, _) = limiter();
    let global = LimitSpec::new(("global", Config::token_bucket(2.0, MINUTE)));
    let layer = RateLimitLayer::new(Arc::clone(&l), send().key(Key::peer_ip())).with(global);
    let ok = call(&layer, from_peer("203.0.113.1")).await;
    assert_eq!(header(&ok, "ratelimit-policy"), Some("\"send\";q=10;w=60, \"global\";q=2;w=60"));
    assert_eq!(header(&ok, "ratelimit"), Some("\"send\";r=2;t=6, \"global\";r=1;t=30"));
    call(&layer, from_peer("203.0.113.2")).await;
    // The global limit is spent: refused, and the per-peer limit is not taken.
    let refused = call(&layer, from_peer("203.0.113.3")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.body().contains("\"name\":\"global\""), "{}", refused.body());
    assert_eq!(header(&refused, "retry-after"), Some("30"));
    let per_peer = ("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
    assert_eq!(l.value(per_peer, Some("203.0.113.3")).unwrap().value, 3.0);
}

#[tokio::test]
async fn names_defined_on_the_limiter_work_too() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(Arc::clone(&l), LimitSpec::new("defined"));
    assert_eq!(header(&call(&layer, get()).await, "ratelimit-policy"), Some("\"defined\";q=2;w=1"));
}

/// A misspelled name fails when the layer is made, naming it and the fix (before, the
/// layer was made and answered every request with 500).
#[test]
fn an_undefined_name_fails_when_the_layer_is_made() {
    let (l, _) = limiter();
    let err = RateLimitLayer::try_new(Arc::clone(&l), LimitSpec::new("defnied")).err().unwrap();
    assert!(matches!(&err, tollgate::Error::NotDefined { name } if name == "defnied"), "{err}");
    let err = RateLimitLayer::new(Arc::clone(&l), send()).try_with(LimitSpec::new("nope"));
    assert!(matches!(err, Err(tollgate::Error::NotDefined { .. })));
    let build = std::panic::AssertUnwindSafe(|| RateLimitLayer::new(l, LimitSpec::new("defnied")));
    let panic = std::panic::catch_unwind(build);
    let message = *panic.err().unwrap().downcast::<String>().unwrap();
    assert_eq!(
        message,
        "RateLimitLayer: Rate limit defnied not defined. Define it with \
         RateLimiter::builder().define(..), declare it in a type that implements Limits, or \
         pass an inline config."
    );
}

#[tokio::test]
async fn store_failure_fails_closed_unless_told_otherwise() {
    let down = Arc::new(RateLimiter::new(Unavailable::new("connection refused")));
    let closed = RateLimitLayer::new(Arc::clone(&down), send());
    let r = call(&closed, get()).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.body(), r#"{"error":"rate limit store unavailable","mayHaveTaken":false}"#);
    let open = RateLimitLayer::new(Arc::clone(&down), send().fail_open());
    let r = call(&open, get()).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "ratelimit"), None, "no numbers to report");
    // In a transaction, every limit must fail open for the request to pass.
    let mixed = RateLimitLayer::new(down, send().fail_open())
        .with(LimitSpec::new(("other", Config::token_bucket(1.0, SECOND))));
    assert_eq!(call(&mixed, get()).await.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn works_in_an_axum_router() {
    let (l, _) = limiter();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(RateLimitLayer::new(l, send()));
    let request = || axum::http::Request::new(axum::body::Body::empty());
    for _ in 0..3 {
        assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    }
    let refused = app.oneshot(request()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = http_body_util::BodyExt::collect(refused.into_body()).await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"kind":"RateLimited","name":"send","retryAfter":6000.0}"#);
}

/// Health checks and an allow-list pass untouched: nothing taken, no header fields.
#[tokio::test]
async fn skipped_requests_pass_untouched() {
    let (l, _) = limiter();
    let layer = RateLimitLayer::new(Arc::clone(&l), send().key(Key::peer_ip())).skip(|head| {
        head.uri.path() == "/healthz"
            || head.extensions.get::<SocketAddr>().is_some_and(|a| a.ip().is_loopback())
    });
    for _ in 0..10 {
        let mut health = from_peer("203.0.113.1");
        *health.uri_mut() = "/healthz".parse().unwrap();
        let r = call(&layer, health).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers().len(), 0, "{:?}", r.headers());
        assert_eq!(call(&layer, from_peer("127.0.0.1")).await.status(), StatusCode::OK);
    }
    assert!(l.store().is_empty(), "nothing taken");
    for _ in 0..3 {
        assert_eq!(call(&layer, from_peer("203.0.113.1")).await.status(), StatusCode::OK);
    }
    assert_eq!(
        call(&layer, from_peer("203.0.113.1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A custom refusal sets status, body and its own fields; the layer adds `Retry-After` and
/// the RateLimit fields it did not set. Errors other than refusals keep the layer's answer.
#[tokio::test]
async fn a_custom_refusal_builds_the_response_from_the_decision() {
    let (l, _) = limiter();
    let global = LimitSpec::new(("global", Config::token_bucket(2.0, MINUTE)));
    let layer = RateLimitLayer::new(l, send().key(Key::header("x-user")))
        .with(global)
        .legacy_headers()
        .on_refused(|head, info| {
            let refused = info.refused_by().unwrap();
            let body = format!(
                "{} {}: {} refused, {} ms, {} of {} left",
                head.method,
                head.uri.path(),
                refused.name,
                info.retry_after.unwrap(),
                refused.remaining,
                refused.limit,
            );
            Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .header("content-type", "text/plain")
                .header("x-ratelimit-limit", "mine")
                .body(body)
                .unwrap()
        });
    let user =
        |u: &str| Request::builder().uri("/send").header("x-user", u).body(String::new()).unwrap();
    call(&layer, user("a")).await;
    call(&layer, user("b")).await;
    let refused = call(&layer, user("c")).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.body(), "GET /send: global refused, 30000 ms, 0 of 2 left");
    assert_eq!(header(&refused, "content-type"), Some("text/plain"));
    assert_eq!(header(&refused, "retry-after"), Some("30"));
    assert_eq!(header(&refused, "ratelimit"), Some("\"send\";r=3;t=0, \"global\";r=0;t=60"));
    assert_eq!(header(&refused, "x-ratelimit-limit"), Some("mine"), "its own is kept");
    assert_eq!(header(&refused, "x-ratelimit-remaining"), Some("0"));
    // A missing key is not a refusal: the layer's 400.
    let missing = call(&layer, get()).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert!(missing.body().starts_with("{\"error\""), "{}", missing.body());
}

/// The handler reads the decision from the request's extensions, with `insert_info`.
#[tokio::test]
async fn the_decision_is_in_the_request_extensions() {
    use axum::Extension;

    async fn show(info: Option<Extension<RateLimitInfo>>) -> String {
        let Some(Extension(info)) = info else { return "none".to_owned() };
        let limits: Vec<_> = info
            .limits
            .iter()
            .map(|l| format!("{} {}/{} full in {} ms", l.name, l.remaining, l.limit, l.reset_after))
            .collect();
        format!("ok={} {}", info.ok, limits.join(", "))
    }
    let (l, _) = limiter();
    let global = LimitSpec::new(("global", Config::token_bucket(5.0, MINUTE)));
    let layer = RateLimitLayer::new(Arc::clone(&l), send()).with(global);
    let app = |layer: RateLimitLayer<_>| {
        axum::Router::new().route("/", axum::routing::get(show)).layer(layer)
    };
    let body = |app: axum::Router| async move {
        let r = app.oneshot(axum::http::Request::new(axum::body::Body::empty())).await.unwrap();
        let bytes = http_body_util::BodyExt::collect(r.into_body()).await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    };
    assert_eq!(body(app(layer.clone())).await, "none", "off by default");
    assert_eq!(
        body(app(layer.insert_info())).await,
        "ok=true send 1/3 full in 12000 ms, global 3/5 full in 24000 ms"
    );
    // In a plain tower service: `req.extensions().get()`.
    let layer = RateLimitLayer::new(l, LimitSpec::new("defined")).insert_info();
    let app = layer.layer(tower::service_fn(|req: Request<String>| async move {
        let info = req.extensions().get::<RateLimitInfo>().unwrap();
        let summary = format!("{:?} {:?} {:?}", info.ok, info.retry_after, info.limits[0].config);
        Ok::<_, Infallible>(Response::new(summary))
    }));
    let body = app.oneshot(get()).await.unwrap().into_body();
    let bytes = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
    let config = Config::token_bucket(2.0, SECOND);
    assert_eq!(String::from_utf8(bytes.to_vec()).unwrap(), format!("true None {config:?}"));
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

/// `X-RateLimit-*` beside the IETF fields, for the limit with the fewest tokens left, or the
/// one that refused; `Reset` is the Unix time at which it is full again, rounded up.
#[tokio::test]
async fn legacy_header_fields_on_request() {
    let (l, _) = limiter();
    let plain = RateLimitLayer::new(Arc::clone(&l), send());
    assert_eq!(header(&call(&plain, get()).await, "x-ratelimit-limit"), None, "off by default");

    let global = LimitSpec::new(("global", Config::token_bucket(5.0, MINUTE).with_capacity(2.0)));
    let layer = RateLimitLayer::new(l, send()).with(global).legacy_headers();
    let before = unix_seconds();
    let first = call(&layer, get()).await;
    // send: 3 - 2 = 1 left (the plain layer took one); global: 2 - 1 = 1 left, full in 12 s.
    assert_eq!(header(&first, "ratelimit"), Some("\"send\";r=1;t=12, \"global\";r=1;t=12"));
    assert_eq!(header(&first, "x-ratelimit-limit"), Some("3"), "of equals, the first");
    assert_eq!(header(&first, "x-ratelimit-remaining"), Some("1"));
    let reset: f64 = header(&first, "x-ratelimit-reset").unwrap().parse().unwrap();
    assert!((before + 12.0..=unix_seconds() + 13.0).contains(&reset), "{reset} at {before}");
    let second = call(&layer, get()).await;
    assert_eq!(header(&second, "ratelimit"), Some("\"send\";r=0;t=18, \"global\";r=0;t=24"));
    assert_eq!(header(&second, "x-ratelimit-limit"), Some("3"));
    // Refused by global (send has none left either, but would refill sooner):
    let refused = call(&layer, get()).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.body().contains("\"name\":\"global\""), "{}", refused.body());
    assert_eq!(header(&refused, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&refused, "x-ratelimit-remaining"), Some("0"));
    let reset: f64 = header(&refused, "x-ratelimit-reset").unwrap().parse().unwrap();
    assert!((before + 24.0..=unix_seconds() + 25.0).contains(&reset), "{reset} at {before}");
}

/// The layer's `fail_open` passes every request of the layer when the store fails, each of
/// its limits as one; the limiter's `fail_open` is decided before it, inside the limiter.
#[tokio::test]
async fn a_layer_fails_open_for_all_its_limits() {
    let down = Arc::new(RateLimiter::new(Unavailable::new("connection refused")));
    let other = LimitSpec::new(("other", Config::token_bucket(1.0, SECOND)));
    let closed = RateLimitLayer::new(Arc::clone(&down), send()).with(other.clone());
    assert_eq!(call(&closed, get()).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    let open = closed.clone().fail_open().legacy_headers().insert_info();
    let r = call(&open, get()).await;
    assert_eq!((r.status(), r.body().as_str()), (StatusCode::OK, "ok"));
    assert_eq!(r.headers().len(), 0, "no numbers to report: {:?}", r.headers());
    assert_eq!(down.failed_open(), 0, "the layer's, not the limiter's");
    // Invalid requests are still refused.
    let keyed = RateLimitLayer::new(Arc::clone(&down), send().key(Key::header("x-user")));
    assert_eq!(call(&keyed.fail_open(), get()).await.status(), StatusCode::BAD_REQUEST);
    // The limiter's own fail_open: granted inside the limiter, counted there.
    let limiter = RateLimiter::builder(Unavailable::new("connection refused"))
        .fail_open("send")
        .fail_open("other")
        .build();
    let limiter = Arc::new(limiter);
    let layer = RateLimitLayer::new(Arc::clone(&limiter), send()).with(other);
    let r = call(&layer, get()).await;
    assert_eq!((r.status(), header(&r, "ratelimit")), (StatusCode::OK, None));
    assert_eq!(limiter.failed_open(), 1);
}
