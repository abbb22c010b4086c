//! The tower layer's overhead: the same trivial handler bare and behind `RateLimitLayer`
//! (memory store, one keyed limit), and behind it with the options that cost an admitted
//! request something (`skip`, `legacy_headers`, `insert_info`), called and polled to
//! completion per iteration. The futures are ready at once, so they are polled with a no-op
//! waker: no runtime in the way.
//!
//! `cargo bench -p tollgate-bench --bench tower`

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use tollgate::tower::{Key, LimitSpec, RateLimitLayer};
use tollgate_bench::{Limit, tollgate};
use tower::{Layer, Service};

fn ready<F: Future>(future: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut cx) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the bench's futures are ready at once"),
    }
}

fn handler()
-> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    })
}

fn request() -> Request<String> {
    Request::builder().header("x-api-key", "user-00000001").body(String::new()).unwrap()
}

fn layer_overhead(c: &mut Criterion) {
    let mut g = c.benchmark_group("tower_layer");
    let mut bare = handler();
    g.bench_function("bare_handler", |b| {
        b.iter(|| ready(bare.call(black_box(request()))).unwrap())
    });
    let spec = LimitSpec::limit(Limit::PerUser).key(Key::header("x-api-key"));
    let mut limited = RateLimitLayer::new(Arc::new(tollgate()), spec).layer(handler());
    g.bench_function("with_rate_limit", |b| {
        b.iter(|| {
            let response = ready(limited.call(black_box(request()))).unwrap();
            assert_eq!(response.status(), 200);
            response
        })
    });
    // Every option that costs an admitted request something: a skip predicate that is
    // false, the X-RateLimit-* fields, the decision in the request's extensions.
    let spec = LimitSpec::limit(Limit::PerUser).key(Key::header("x-api-key"));
    let layer = RateLimitLayer::new(Arc::new(tollgate()), spec)
        .skip(|head| head.uri.path() == "/healthz")
        .legacy_headers()
        .insert_info();
    let mut options = layer.layer(handler());
    g.bench_function("with_options", |b| {
        b.iter(|| {
            let response = ready(options.call(black_box(request()))).unwrap();
            assert_eq!(response.status(), 200);
            response
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = layer_overhead
}
criterion_main!(benches);
