//! `envoy.service.ratelimit.v3.RateLimitService` over gRPC (tonic), with the standard gRPC
//! health service beside it.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus as PbStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::connection::{Connection, Frames, OpenCall, WATCHES_PER_CONNECTION};
use super::{Descriptor, Rls, RlsAnswer, RlsError, RlsRequest, Unit};
use crate::auth::{Credential, Tokens};
use crate::config::HttpLimits;
use crate::error_log::ErrorLog;

/// The largest `ShouldRateLimit` request accepted, in bytes: the HTTP API's body limit.
/// Envoy's requests are a few hundred bytes; tonic's own default, 4 MiB, would let one call
/// carry some 250,000 descriptors, all taken in one transaction (on Redis, one script that
/// every other client waits for). A larger request is refused with `OUT_OF_RANGE` as soon as
/// its length prefix is read, and takes nothing.
pub const MAX_REQUEST: usize = crate::engine::MAX_BODY;

/// The gRPC service: [`Rls`], the bearer tokens it asks for (none: open), and the log of
/// failed calls it shares with the HTTP side.
pub struct Service {
    rls: Arc<Rls>,
    tokens: Tokens,
    errors: Arc<ErrorLog>,
}

impl Service {
    /// The service answering from `rls`; with `tokens`, a call must carry
    /// `authorization: Bearer <token>` metadata with a full token (checked by [`serve`], on
    /// the call's headers): a call takes tokens, so a read token is refused.
    /// Calls the store failed go to `errors` (summed up, not a line each).
    pub fn new(rls: Arc<Rls>, tokens: Tokens, errors: Arc<ErrorLog>) -> Self {
        Service { rls, tokens, errors }
    }
}

/// A request in the service's own terms.
///
/// # Errors
///
/// A descriptor `limit` with an unknown unit.
pub fn from_proto(request: RateLimitRequest) -> Result<RlsRequest, RlsError> {
    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(o) => match Unit::from_limit_unit_number(o.unit) {
                Some(unit) => Some((o.requests_per_unit, unit)),
                None => {
                    return Err(RlsError::Invalid(format!(
                        "descriptors[{i}].limit.unit: {} is not a unit (1 second .. 6 year)",
                        o.unit
                    )));
                }
            },
        };
        descriptors.push(Descriptor {
            entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
            limit,
            hits_addend: d.hits_addend.map(|h| h.value),
        });
    }
    Ok(RlsRequest { domain: request.domain, descriptors, hits_addend: request.hits_addend })
}

/// The answer in the API's message.
pub fn to_proto(answer: RlsAnswer) -> RateLimitResponse {
    let code = |over: bool| if over { Code::OverLimit as i32 } else { Code::Ok as i32 };
    RateLimitResponse {
        overall_code: code(answer.over_limit),
        statuses: answer
            .statuses
            .into_iter()
            .map(|s| PbStatus {
                code: code(s.over_limit),
                current_limit: s.current_limit.map(|(name, requests_per_unit, unit)| RateLimit {
                    name,
                    requests_per_unit,
                    unit: unit.response_number(),
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset.map(duration),
                ..PbStatus::default()
            })
            .collect(),
        response_headers_to_add: answer
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue { key, value, ..HeaderValue::default() })
            .collect(),
        ..RateLimitResponse::default()
    }
}

/// Milliseconds as a protobuf duration, rounded up to whole milliseconds.
pub fn duration(ms: f64) -> PbDuration {
    let (seconds, nanos) = super::until_reset(ms);
    PbDuration { seconds, nanos }
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // The caller's trace context, kept only when there is a span to give it to.
        let metadata = crate::otel::on().then(|| request.metadata().clone());
        let request = from_proto(request.into_inner());
        let headers =
            || metadata.map(tonic::metadata::MetadataMap::into_headers).unwrap_or_default();
        match self.rls.traced(super::Via::Grpc, headers, request).await {
            Ok(answer) => Ok(Response::new(to_proto(answer))),
            Err(e) => {
                if let RlsError::Store(_) = &e {
                    self.errors.record(
                        "rls",
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        &e.to_string(),
                    );
                }
                Err(status(e))
            }
        }
    }
}

fn status(e: RlsError) -> Status {
    match e {
        RlsError::Invalid(message) => Status::invalid_argument(message),
        e @ RlsError::Store(_) => Status::unavailable(e.to_string()),
    }
}

/// The most calls one connection may have open at a time (HTTP/2 `MAX_CONCURRENT_STREAMS`):
/// Envoy keeps a few connections and sends each call whole, so a few hundred is plenty; a
/// client that opens more is refused the rest (`REFUSED_STREAM`).
pub const MAX_STREAMS: u32 = 256;

/// The most calls open at a time over every connection: past it a call is answered
/// `RESOURCE_EXHAUSTED` at once, so that held calls (headers without a body, say) cost a
/// bounded amount of memory (about 37 KB each, measured: 38 MB for 1,024), however many connections bring
/// them. Envoy has a few dozen open under heavy load (a call takes a millisecond or less).
pub const MAX_CALLS: usize = 1_024;

/// The most bytes of a call's header block: the metadata of a call is a few hundred bytes.
const MAX_HEADER_BYTES: u32 = 16 * 1024;

/// How much of calls' bodies a connection may send before they are read: a call is read
/// whole at once, up to [`MAX_REQUEST`].
const STREAM_WINDOW: u32 = 128 * 1024;
const CONNECTION_WINDOW: u32 = 1024 * 1024;

/// Serves the rate limit service and gRPC health on `listener` until `stop` resolves, within
/// `limits`: at most `max_connections` connections, each closed if it sends nothing for
/// `header_timeout` (before its preface, or between calls; gracefully, with `GOAWAY`), with
/// at most [`MAX_STREAMS`] calls open, and every call answered within `call_deadline`
/// (`DEADLINE_EXCEEDED` if its body or the store is slower). With tokens, a call without a
/// good one is refused on its headers, before its body is read. Once `stop` resolves, calls
/// in flight get `limits.shutdown_deadline` to finish. Once `draining` resolves (before
/// `stop`), gRPC health says `NOT_SERVING`.
///
/// # Errors
///
/// The listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Service,
    limits: HttpLimits,
    call_deadline: Duration,
    accept_errors: Arc<ErrorLog>,
    draining: impl std::future::Future<Output = ()> + Send + 'static,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<Service>>().await;
    // Draining: health says NOT_SERVING at once (the service's name and the server's, ""),
    // while calls are still answered until `stop`.
    tokio::spawn(async move {
        draining.await;
        reporter.set_not_serving::<RateLimitServiceServer<Service>>().await;
        reporter.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    });
    let tokens = service.tokens.clone();
    let service_tokens = service.tokens.clone();
    let rls = InterceptedService::new(
        RateLimitServiceServer::new(service).max_decoding_message_size(MAX_REQUEST),
        move |request: Request<()>| authorize(&tokens, request),
    );
    let routes = tonic::service::Routes::new(health).add_service(rls).prepare();
    let calls = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS));
    let watches = Arc::new(tokio::sync::Semaphore::new(MAX_WATCHES));
    let bounded = Bounded {
        routes,
        deadline: call_deadline,
        calls,
        watches,
        tokens: service_tokens,
        connection: Connection::new(),
    };
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(MAX_HEADER_BYTES)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW);
    let idle = limits.header_timeout;
    let grace = limits.shutdown_deadline;
    crate::listen::serve_connections(
        listener,
        "rls",
        limits,
        b"",
        accept_errors,
        stop,
        move |tcp, mut stopping| {
            let http2 = http2.clone();
            let state = Connection::new();
            let service = TowerToHyperService::new(Bounded {
                connection: Arc::clone(&state),
                ..bounded.clone()
            });
            async move {
                // A client that sends nothing, not even its preface, is not kept. (A peek:
                // `readable` may answer before anything has arrived.)
                match tokio::time::timeout(idle, tcp.peek(&mut [0; 1])).await {
                    Ok(Ok(1..)) => {}
                    _ => return,
                }
                let io = Frames::new(tcp, Arc::clone(&state));
                let connection = http2.serve_connection(TokioIo::new(io), service);
                let mut connection = std::pin::pin!(connection);
                // Idle: no call open, and none started over a whole `idle` (PINGs and
                // SETTINGS do not count: they ask for nothing).
                let mut seen = 0;
                let grace = loop {
                    tokio::select! {
                        biased;
                        _ = connection.as_mut() => return,
                        () = tokio::time::sleep(idle) => {
                            if state.quiet_since(&mut seen) {
                                break idle;
                            }
                        }
                        () = stopping.wait() => break grace,
                    }
                };
                // GOAWAY: calls already sent are answered, then the connection closes; one
                // whose client does not take part in that (its PING answered) is cut.
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(grace, connection).await;
            }
        },
    )
    .await
}

/// With tokens, a call must carry `authorization: Bearer <token>` with one of them, checked
/// on the call's headers (before its body is read).
fn authorize(tokens: &Tokens, request: Request<()>) -> Result<Request<()>, Status> {
    if !tokens.required() {
        return Ok(request);
    }
    let values = request.metadata().get_all("authorization").iter().map(|v| v.to_str().ok());
    match crate::auth::credential(tokens, values) {
        Credential::Good => Ok(request),
        Credential::Missing | Credential::Several => Err(Status::unauthenticated(
            "send one authorization: Bearer <token> (none, or more than one, was sent)",
        )),
        Credential::NotBearer => {
            Err(Status::unauthenticated("expected authorization: Bearer <token>"))
        }
        Credential::Wrong => Err(Status::unauthenticated("wrong bearer token")),
        Credential::Read => Err(Status::permission_denied(
            "a read token cannot take from limits; use a token of [server] tokens",
        )),
    }
}

/// The path of gRPC health's `Watch`, a stream that lasts as long as its client wants.
const WATCH: &str = "/grpc.health.v1.Health/Watch";

/// The most `Watch` streams open at a time over every connection (each holds about 11 KB
/// while it lasts; [`WATCHES_PER_CONNECTION`] on one connection). Past it a `Watch` is
/// answered `RESOURCE_EXHAUSTED`; other calls do not count against it, nor it against them.
/// Load balancers and Kubernetes probe with `Check`.
pub const MAX_WATCHES: usize = 64;

/// The gRPC routes, each call within a deadline and within [`MAX_CALLS`] open at a time
/// (counted until its answer has ended), `Watch` streams within [`MAX_WATCHES`] and
/// [`WATCHES_PER_CONNECTION`] (and, with tokens, only with one).
#[derive(Clone)]
struct Bounded {
    routes: tonic::service::Routes,
    deadline: Duration,
    calls: Arc<tokio::sync::Semaphore>,
    watches: Arc<tokio::sync::Semaphore>,
    tokens: Tokens,
    /// The connection this service answers (one per connection).
    connection: Arc<Connection>,
}

/// What an open call holds: its place among the open calls, or a `Watch` stream's places
/// (among all and on its connection), and the connection's count of open calls. A call's
/// answer is whole when it is sent, so it holds them until then; a stream's, until it ends.
enum Held {
    Call {
        _place: tokio::sync::OwnedSemaphorePermit,
        _open: OpenCall,
    },
    Watch {
        _place: tokio::sync::OwnedSemaphorePermit,
        _own: tokio::sync::OwnedSemaphorePermit,
        _open: OpenCall,
    },
}

impl Bounded {
    /// What a call may hold, or the answer that refuses it.
    fn admit(&self, request: &http::Request<hyper::body::Incoming>) -> Result<Held, Status> {
        if request.uri().path() != WATCH {
            let Ok(call) = Arc::clone(&self.calls).try_acquire_owned() else {
                return Err(Status::resource_exhausted(format!(
                    "more than {MAX_CALLS} calls are open; try again"
                )));
            };
            return Ok(Held::Call { _place: call, _open: self.connection.call() });
        }
        if self.tokens.required() {
            let values = request.headers().get_all("authorization").iter().map(|v| v.to_str().ok());
            if !matches!(
                crate::auth::credential(&self.tokens, values),
                Credential::Good | Credential::Read
            ) {
                return Err(Status::unauthenticated(
                    "Watch needs authorization: Bearer <token> (a read token will do); Check needs none",
                ));
            }
        }
        let Ok(watch) = Arc::clone(&self.watches).try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "more than {MAX_WATCHES} Watch streams are open; use Check"
            )));
        };
        let Ok(own) = Arc::clone(&self.connection.watches).try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "more than {WATCHES_PER_CONNECTION} Watch streams are open on this connection"
            )));
        };
        Ok(Held::Watch { _place: watch, _own: own, _open: self.connection.call() })
    }
}

impl tower_service::Service<http::Request<hyper::body::Incoming>> for Bounded {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        tower_service::Service::<http::Request<hyper::body::Incoming>>::poll_ready(
            &mut self.routes,
            cx,
        )
    }

    fn call(&mut self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        let held = match self.admit(&request) {
            Ok(held) => held,
            Err(refused) => return Box::pin(std::future::ready(Ok(refused.into_http()))),
        };
        let deadline = self.deadline;
        let answer = self.routes.call(request);
        Box::pin(async move {
            let answer = match tokio::time::timeout(deadline, answer).await {
                Ok(answer) => answer,
                Err(_) => Ok(Status::deadline_exceeded(format!(
                    "the call was not answered within {deadline:?} (its body, or the store, \
                     was too slow)"
                ))
                .into_http()),
            };
            match held {
                Held::Call { .. } => answer,
                // A stream counts for as long as it lasts, not only until its headers: held
                // until its body has ended (or is dropped).
                Held::Watch { .. } => answer.map(|response| {
                    response.map(|body| {
                        use http_body_util::BodyExt as _;
                        tonic::body::Body::new(body.map_frame(move |frame| {
                            let _ = &held;
                            frame
                        }))
                    })
                }),
            }
        })
    }
}
