//! The tower layer's concurrency limit ([`ConcurrencySpec`]), driven without a socket: a
//! slot held from the acquire to the response body's end, and let go however the request
//! ends (the body read to its end, the body dropped unread, the service failing, the
//! future dropped: a client gone); a refusal's status and `Retry-After`; the order with the
//! rate limits (a refusal by the slot takes no token, one by the rate limits gives the slot
//! back).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::tower::{ConcurrencySpec, Key, LimitSpec, RateLimitLayer, ResponseBody};
use tollgate::{Concurrency, Config, Error, MINUTE, ManualClock, MemoryStore, RateLimiter};
use tower::{Layer, Service, ServiceExt};

mod common;

type Limiter = RateLimiter<MemoryStore<ManualClock>>;

/// One slot per user, held 30 s at most; a rate limit of 2 a minute.
fn limiter() -> Arc<Limiter> {
    let clock = ManualClock::new(1_700_000_000_000.0);
    let limiter = RateLimiter::builder(MemoryStore::with_clock(clock))
        .define_concurrency("exports", Concurrency::new(1).with_ttl(30_000.0))
        .define("per minute", Config::token_bucket(2.0, MINUTE))
        .build();
    Arc::new(limiter)
}

fn user() -> Key {
    Key::header("x-user")
}

fn slot() -> ConcurrencySpec {
    ConcurrencySpec::new("exports").key(user())
}

fn alice() -> Request<String> {
    Request::builder().header("x-user", "alice").body(String::new()).unwrap()
}

fn in_flight(limiter: &Limiter) -> u64 {
    limiter.slots_value("exports", Some("alice")).unwrap().in_flight
}

/// The app: a body of two chunks, a frame at a time, as a streamed one is sent.
fn app(
    layer: &RateLimitLayer<MemoryStore<ManualClock>>,
) -> impl Service<Request<String>, Response = Response<ResponseBody<Chunks>>, Error = Infallible> + Clone
{
    layer.layer(tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(Chunks(vec!["two", "one "])))
    }))
}

/// A body of chunks, the last one first.
struct Chunks(Vec<&'static str>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop().map(|c| Ok(http_body::Frame::data(Bytes::from(c)))))
    }
}

fn header<B>(r: &Response<B>, name: &str) -> Option<String> {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_owned())
}

async fn body_of<B: http_body::Body<Data = Bytes>>(body: B) -> String
where
    B::Error: std::fmt::Debug,
{
    String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test]
async fn a_slot_is_held_until_the_body_ends_and_a_second_request_is_refused() {
    let limiter = limiter();
    let layer = RateLimitLayer::concurrency(Arc::clone(&limiter), slot());
    let first = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(in_flight(&limiter), 1, "the service answered; its body is still to come");

    let refused = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "retry-after").as_deref(), Some("30"));
    assert_eq!(header(&refused, "ratelimit"), None, "no rate limit was taken from");
    let body = body_of(refused.into_body()).await;
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({ "kind": "RateLimited", "name": "exports", "retryAfter": 30000.0 })
    );
    let bob = Request::builder().header("x-user", "bob").body(String::new()).unwrap();
    assert_eq!(
        app(&layer).oneshot(bob).await.unwrap().status(),
        StatusCode::OK,
        "a key of its own"
    );

    let mut body = first.into_body();
    let one = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(one, "one ");
    assert_eq!(in_flight(&limiter), 1, "mid-body");
    let two = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(two, "two");
    assert!(body.frame().await.is_none());
    assert_eq!(in_flight(&limiter), 0, "the body ended: released before the body is dropped");
    drop(body);
    assert_eq!(app(&layer).oneshot(alice()).await.unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn the_refusal_status_is_an_option() {
    let limiter = limiter();
    let layer = RateLimitLayer::concurrency(
        Arc::clone(&limiter),
        slot().status(StatusCode::SERVICE_UNAVAILABLE),
    );
    let _first = app(&layer).oneshot(alice()).await.unwrap();
    let refused = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&refused, "retry-after").as_deref(), Some("30"));
}

#[tokio::test]
async fn the_slot_is_let_go_when_the_body_is_dropped_unread() {
    let limiter = limiter();
    let layer = RateLimitLayer::concurrency(Arc::clone(&limiter), slot());
    let first = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(in_flight(&limiter), 1);
    drop(first); // the client left before the body was sent
    assert_eq!(in_flight(&limiter), 0);
}

#[tokio::test]
async fn the_slot_is_let_go_when_the_service_fails() {
    let limiter = limiter();
    let layer = RateLimitLayer::concurrency(Arc::clone(&limiter), slot());
    let failing = layer.layer(tower::service_fn(|_req: Request<String>| async {
        Err::<Response<String>, _>("the handler failed")
    }));
    assert!(matches!(failing.oneshot(alice()).await, Err("the handler failed")));
    assert_eq!(in_flight(&limiter), 0);
}

#[tokio::test]
async fn the_slot_is_let_go_when_the_future_is_dropped() {
    let limiter = limiter();
    let layer = RateLimitLayer::concurrency(Arc::clone(&limiter), slot());
    // A handler that never answers, and a client that leaves while it runs.
    let mut pending = layer.layer(tower::service_fn(|_req: Request<String>| {
        std::future::pending::<Result<Response<String>, Infallible>>()
    }));
    let mut future = Box::pin(pending.call(alice()));
    assert!(future.as_mut().poll(&mut Context::from_waker(std::task::Waker::noop())).is_pending());
    assert_eq!(in_flight(&limiter), 1, "acquired before the handler");
    drop(future);
    assert_eq!(in_flight(&limiter), 0);
    assert!(matches!(future_ready(&mut pending), Poll::Ready(Ok(()))));
}

fn future_ready<S: Service<Request<String>>>(s: &mut S) -> Poll<Result<(), S::Error>> {
    s.poll_ready(&mut Context::from_waker(std::task::Waker::noop()))
}

#[tokio::test]
async fn with_rate_limits_the_slot_is_taken_first() {
    let limiter = limiter();
    let layer = RateLimitLayer::new(Arc::clone(&limiter), LimitSpec::new("per minute").key(user()))
        .with_concurrency(slot());
    let first = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(header(&first, "ratelimit").as_deref(), Some("\"per minute\";r=1;t=30"));
    // Refused by the slot: no token taken.
    let refused = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body_of(refused.into_body()).await.contains("\"exports\""));
    assert_eq!(body_of(first.into_body()).await, "one two");
    let second = app(&layer).oneshot(alice()).await.unwrap();
    assert_eq!(header(&second, "ratelimit").as_deref(), Some("\"per minute\";r=0;t=60"));
    drop(second);
    // Refused by the rate limit: the slot given back at once, so the next is refused by
    // the rate limit again, not by a slot still held.
    for _ in 0..2 {
        let refused = app(&layer).oneshot(alice()).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(body_of(refused.into_body()).await.contains("\"per minute\""));
        assert_eq!(in_flight(&limiter), 0);
    }
}

#[test]
fn a_slot_the_limiter_does_not_define_fails_when_the_layer_is_made() {
    let limiter = limiter();
    let missing = RateLimitLayer::new(Arc::clone(&limiter), LimitSpec::new("per minute"))
        .try_with_concurrency(ConcurrencySpec::new("exprots"));
    assert!(matches!(missing, Err(Error::NotDefined { name }) if name == "exprots"));
    let too_many = RateLimitLayer::new(Arc::clone(&limiter), LimitSpec::new("per minute"))
        .try_with_concurrency(ConcurrencySpec::new("exports").count(2));
    assert!(matches!(too_many, Err(Error::Invalid(_))), "2 slots of a max of 1");
}

/// Over a real socket, on Redis, whose release of a dropped guard is a task of the app's
/// runtime: an axum app whose handler never answers, a client that leaves mid-request.
#[cfg(feature = "redis")]
mod on_redis {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tollgate::store::RedisStore;

    use super::*;
    use crate::common;

    async fn slots_in_flight(limiter: &RateLimiter<RedisStore>) -> u64 {
        limiter.slots_value_async("exports", Some("alice")).await.unwrap().in_flight
    }

    async fn request(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = "GET / HTTP/1.1\r\nhost: x\r\nx-user: alice\r\n\r\n";
        stream.write_all(head.as_bytes()).await.unwrap();
        stream
    }

    #[tokio::test]
    async fn a_client_gone_mid_request_frees_its_slot() {
        let Some(url) = common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379") else {
            return;
        };
        let prefix = format!("tollgate-tower-slots:{}:{}:", std::process::id(), line!());
        let limiter =
            RateLimiter::builder(RedisStore::builder().prefix(prefix).open(&url).unwrap())
                .define_concurrency("exports", Concurrency::new(1).with_ttl(30_000.0))
                .build();
        let limiter = Arc::new(limiter);
        let layer = RateLimitLayer::concurrency(Arc::clone(&limiter), slot());
        let app = axum::Router::new()
            .route("/", axum::routing::get(std::future::pending::<&'static str>))
            .layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });

        let first = request(addr).await;
        let mut waited = 0;
        while slots_in_flight(&limiter).await != 1 {
            assert!(waited < 500, "the slot was never taken");
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
        }
        let mut second = request(addr).await;
        let mut answer = vec![0; 4096];
        let n = second.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).to_lowercase();
        assert!(answer.starts_with("http/1.1 429"), "{answer}");
        assert!(answer.contains("retry-after: 30\r\n"), "{answer}");

        drop(first); // the client leaves; hyper drops the request's future
        let mut waited = 0;
        while slots_in_flight(&limiter).await != 0 {
            assert!(waited < 500, "the slot was never let go");
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
        }
    }
}
