//! The tower layer on stores that must be awaited: the same answers as on the memory store
//! (whose decisions are made inline), on axum and on tonic (a refused gRPC call gets
//! `RESOURCE_EXHAUSTED`), and with Redis and PostgreSQL opened and used inside
//! `#[tokio::main]`.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use tollgate::core::{OneTake, Outcome, Plan, Slot, State, Taken};
use tollgate::store::{BoxFuture, Unavailable};
use tollgate::tower::{Key, LimitSpec, RateLimitInfo, RateLimitLayer};
use tollgate::{AsyncStore, Config, MINUTE, ManualClock, MemoryStore, RateLimiter, Store};
use tower::{Layer, ServiceExt};

mod common;

/// A store that must be awaited: the memory store (or any sync store) answering after a
/// yield to the runtime, as a networked store answers after its round trip.
struct Awaited<S>(S);

impl<S: Store + Send + Sync> AsyncStore for Awaited<S> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.0.execute(plan)
        })
    }
    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.0.execute_one(take)
        })
    }
    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.0.read(slots)
        })
    }
    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.0.delete(name, key, shards)
        })
    }
}

fn send() -> LimitSpec {
    LimitSpec::new(("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0)))
}

/// `request` through the layer to an app that answers 200 "ok": the response, its body read.
async fn call<S: AsyncStore + 'static>(
    layer: &RateLimitLayer<S>,
    request: Request<String>,
) -> Response<String> {
    let app = layer.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::from("ok")))
    }));
    let (parts, body) = app.oneshot(request).await.unwrap().into_parts();
    let bytes = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
    Response::from_parts(parts, String::from_utf8(bytes.to_vec()).unwrap())
}

fn header<'r>(r: &'r Response<String>, name: &str) -> Option<&'r str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

fn get() -> Request<String> {
    Request::new(String::new())
}

/// Every header field and body of a run of requests, on the memory store (decided inline)
/// and on the same store awaited: the same, field for field.
#[tokio::test]
async fn an_awaited_store_answers_as_the_memory_store_does() {
    type Seen = Vec<(StatusCode, [Option<String>; 4], String)>;
    async fn run<S: AsyncStore + 'static>(layer: RateLimitLayer<S>) -> Seen {
        let mut seen = Vec::new();
        for _ in 0..5 {
            let r = call(&layer, get()).await;
            let fields = ["ratelimit", "ratelimit-policy", "retry-after", "content-type"]
                .map(|name| header(&r, name).map(str::to_owned));
            seen.push((r.status(), fields, r.body().clone()));
        }
        seen
    }
    let clock = ManualClock::new(1_700_000_000_000.0);
    let limits = || {
        (LimitSpec::new(("perUser", Config::token_bucket(10.0, MINUTE).with_capacity(2.0))), send())
    };
    let memory = Arc::new(RateLimiter::new(MemoryStore::with_clock(clock.clone())));
    let (a, b) = limits();
    let inline = run(RateLimitLayer::new(memory, a).with(b)).await;
    let awaited = Arc::new(RateLimiter::new(Awaited(MemoryStore::with_clock(clock.clone()))));
    let (a, b) = limits();
    let deferred = run(RateLimitLayer::new(awaited, a).with(b)).await;
    assert_eq!(inline, deferred);
    // Two granted, then refused by the per-user limit (all or nothing: send keeps 1).
    assert_eq!(inline[1].0, StatusCode::OK);
    assert_eq!(inline[2].0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(inline[2].1[0].as_deref(), Some("\"perUser\";r=0;t=12, \"send\";r=1;t=12"));
    assert!(inline[2].2.contains("\"name\":\"perUser\""), "{}", inline[2].2);
}

#[tokio::test]
async fn an_awaited_store_that_fails_fails_closed_unless_told_otherwise() {
    let limiter = Arc::new(RateLimiter::new(Awaited(Unavailable::new("connection refused"))));
    let layer = RateLimitLayer::new(Arc::clone(&limiter), send());
    let r = call(&layer, get()).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.body(), r#"{"error":"rate limit store unavailable","mayHaveTaken":false}"#);
    let open = RateLimitLayer::new(limiter, send().fail_open());
    let r = call(&open, get()).await;
    assert_eq!((r.status(), r.body().as_str()), (StatusCode::OK, "ok"));
}

/// The options on an awaited store, as on the memory store: a skipped request, the decision
/// in the extensions, legacy fields, a custom refusal; and the layer's fail-open.
#[tokio::test]
async fn an_awaited_store_applies_the_options_as_the_memory_store_does() {
    type Seen = Vec<(StatusCode, [Option<String>; 3], String)>;
    async fn run<S: AsyncStore + 'static>(limiter: Arc<RateLimiter<S>>) -> Seen {
        let layer = RateLimitLayer::new(limiter, send())
            .skip(|head| head.uri.path() == "/healthz")
            .insert_info()
            .legacy_headers()
            .on_refused(|_, info| {
                let wait = info.retry_after.unwrap();
                Response::builder().status(StatusCode::FORBIDDEN).body(format!("{wait}")).unwrap()
            });
        let app = layer.layer(tower::service_fn(|req: Request<String>| async move {
            let info = req.extensions().get::<RateLimitInfo>();
            let body = info.map_or("none".to_owned(), |i| format!("{:?}", i.limits[0].remaining));
            Ok::<_, Infallible>(Response::new(body))
        }));
        let mut seen = Vec::new();
        for path in ["/", "/healthz", "/", "/", "/", "/healthz"] {
            let request = Request::builder().uri(path).body(String::new()).unwrap();
            let (parts, body) = app.clone().oneshot(request).await.unwrap().into_parts();
            let bytes = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
            let fields = ["ratelimit", "x-ratelimit-remaining", "retry-after"]
                .map(|name| parts.headers.get(name).map(|v| v.to_str().unwrap().to_owned()));
            seen.push((parts.status, fields, String::from_utf8(bytes.to_vec()).unwrap()));
        }
        seen
    }
    let clock = ManualClock::new(1_700_000_000_000.0);
    let inline = run(Arc::new(RateLimiter::new(MemoryStore::with_clock(clock.clone())))).await;
    let awaited = Arc::new(RateLimiter::new(Awaited(MemoryStore::with_clock(clock.clone()))));
    assert_eq!(run(awaited).await, inline);
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(
        inline[0],
        (StatusCode::OK, [some("\"send\";r=2;t=6"), some("2"), None], "2.0".to_owned())
    );
    assert_eq!(inline[1], (StatusCode::OK, [None, None, None], "none".to_owned()));
    assert_eq!(
        inline[4],
        (
            StatusCode::FORBIDDEN,
            [some("\"send\";r=0;t=18"), some("0"), some("6")],
            "6000".to_owned()
        )
    );

    let down = Arc::new(RateLimiter::new(Awaited(Unavailable::new("connection refused"))));
    let open = RateLimitLayer::new(down, send()).fail_open();
    let r = call(&open, get()).await;
    assert_eq!((r.status(), r.body().as_str()), (StatusCode::OK, "ok"));
}

/// tonic's health service behind the layer, served on a loopback port and called by a
/// tonic client: a refused call is `RESOURCE_EXHAUSTED` with the wait in its message, on
/// the memory store and on an awaited one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_grpc_call_gets_resource_exhausted() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    async fn serve<S: AsyncStore + 'static>(layer: RateLimitLayer<S>) -> String {
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
        let incoming =
            tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = incoming.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(layer)
                .add_service(health)
                .serve_with_incoming(incoming),
        );
        format!("http://{addr}")
    }

    let twice = || LimitSpec::new(("checks", Config::token_bucket(2.0, MINUTE)));
    let clock = ManualClock::new(1_700_000_000_000.0);
    let memory = Arc::new(RateLimiter::new(MemoryStore::with_clock(clock.clone())));
    let awaited = Arc::new(RateLimiter::new(Awaited(MemoryStore::with_clock(clock.clone()))));
    for url in [
        serve(RateLimitLayer::new(memory, twice())).await,
        serve(RateLimitLayer::new(awaited, twice())).await,
    ] {
        let channel = tonic::transport::Channel::from_shared(url).unwrap().connect().await;
        let mut client = HealthClient::new(channel.unwrap());
        for _ in 0..2 {
            client.check(HealthCheckRequest { service: String::new() }).await.unwrap();
        }
        let refused = client.check(HealthCheckRequest { service: String::new() }).await;
        let status = refused.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert_eq!(status.message(), "Rate limit checks exceeded; retry after 30000 ms.");
        let retry_after = status.metadata().get("retry-after").unwrap();
        assert_eq!(retry_after.to_str().unwrap(), "30");
    }
}

/// What `#[tokio::main]` gives an app: a runtime that the functions below run in.
#[cfg(all(feature = "redis", feature = "postgres"))]
mod in_tokio_main {
    use std::time::Duration;

    use axum::body::Body;
    use tollgate::store::{PgStore, RedisStore};

    use super::*;

    /// 60 concurrent requests through an axum app whose layer takes from a limit of 20: 20
    /// pass and 40 are refused, with the layer awaiting the store inside the app's runtime.
    async fn exactly_twenty_of_sixty<S: AsyncStore + 'static>(store: S, name: &'static str) {
        let limiter = Arc::new(RateLimiter::new(store));
        let spec = LimitSpec::new((name, Config::token_bucket(20.0, 24.0 * 60.0 * MINUTE)))
            .key(Key::header("x-user"));
        let app = axum::Router::new()
            .route("/", axum::routing::get(|| async { "hello" }))
            .layer(RateLimitLayer::new(limiter, spec));
        let user = format!("u{}", std::process::id());
        let requests: Vec<_> = (0..60)
            .map(|_| {
                let (app, user) = (app.clone(), user.clone());
                tokio::spawn(async move {
                    let request =
                        axum::http::Request::get("/").header("x-user", user).body(Body::empty());
                    app.oneshot(request.unwrap()).await.unwrap().status()
                })
            })
            .collect();
        let mut statuses = Vec::new();
        for request in requests {
            statuses.push(request.await.unwrap());
        }
        let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
        let refused = statuses.iter().filter(|s| **s == StatusCode::TOO_MANY_REQUESTS).count();
        assert_eq!((ok, refused), (20, 40), "{name}: {statuses:?}");
    }

    #[tokio::main]
    async fn redis_app(url: String) {
        let prefix = format!("tollgate-main:{}:", std::process::id());
        let store = RedisStore::builder().prefix(prefix).open(&url).unwrap();
        exactly_twenty_of_sixty(store, "redisMain").await;
    }

    #[tokio::main]
    async fn postgres_app(url: String) {
        let table = common::DropTable::new(&url, "tollgate_main");
        let store = PgStore::builder()
            .table(&table.table)
            .timeout(Duration::from_secs(5))
            .open(&url)
            .await
            .unwrap();
        exactly_twenty_of_sixty(store, "pgMain").await;
    }

    #[test]
    fn redis_store_inside_tokio_main_through_the_layer() {
        if let Some(url) = common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379") {
            redis_app(url);
        }
    }

    #[test]
    fn postgres_store_inside_tokio_main_through_the_layer() {
        let example = "postgres://postgres@127.0.0.1/test";
        if let Some(url) = common::backend_url("TOLLGATE_POSTGRES_URL", example) {
            postgres_app(url);
        }
    }
}
