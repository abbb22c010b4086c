//! The HTTP API of SPEC §6 on axum.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::answer::{Answer, CLOSE, close_if_unread};
use crate::auth::{Credential, READ_PATHS, Tokens, credential};
use crate::engine::{Engine, MAX_BODY, Op};
use crate::error_log::ErrorLog;
use crate::metrics::{Metrics, Protocol};

/// What every handler shares.
pub struct App {
    /// The operations.
    pub engine: Arc<Engine>,
    /// Accepted bearer tokens; none: no authentication.
    pub tokens: Tokens,
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The memory store, if that is the store: its live states are a metric.
    pub memory: Option<Arc<tollgate::MemoryStore>>,
    /// The circuit breaker of a networked store, for its metrics.
    pub breaker: Option<Arc<crate::store::Breaker>>,
    /// The store when it serves leased limits, for their metrics.
    pub leases: Option<crate::store::Leasing>,
    /// How long `/healthz` waits for the store.
    pub health_deadline: Duration,
    /// Failed requests, logged without flooding.
    pub errors: Arc<ErrorLog>,
    /// Connections either listener could not accept, logged without flooding.
    pub accept_errors: Arc<ErrorLog>,
    /// How long a request's body may take to arrive.
    pub body_timeout: Duration,
    /// The SQLite file's states after its last sweep (`usize::MAX`: not counted yet, or
    /// not SQLite).
    pub sqlite_states: Arc<std::sync::atomic::AtomicUsize>,
    /// The rate limit service, with `--rls-config`: `POST /json` and its metrics.
    pub rls: Option<Arc<crate::rls::Rls>>,
    /// What web pages may ask (`Origin`, and without tokens `Host`); swapped by a reload.
    pub browsers: crate::browsers::SharedRules,
    /// `/metrics` without a token even when the API asks for one (`publicMetrics`).
    pub public_metrics: bool,
    /// The SQLite store, if that is the store: `/healthz` checks that it can still write.
    pub sqlite: Option<Arc<tollgate::store::SqliteStore>>,
    /// Reloads of the config, and whether the server is draining.
    pub live: Arc<crate::live::Status>,
}

/// What serves every HTTP request: the router, behind the checks of what web pages may ask
/// ([`crate::browsers`]).
pub type Service = crate::browsers::Guard<Router>;

/// The router: `/v1/*` (and `/metrics`, unless `publicMetrics`) behind the bearer tokens;
/// `/healthz`, `/openapi.json` and the dashboard's page open; all of it behind the checks of
/// what web pages may ask.
pub fn router(app: Arc<App>) -> Service {
    use tower_layer::Layer as _;
    crate::browsers::GuardLayer(Arc::clone(&app.browsers)).layer(routes(app))
}

fn routes(app: Arc<App>) -> Router {
    let document: Arc<str> = openapi_document(app.tokens.required(), app.public_metrics).into();
    let api = Router::new()
        .route("/v1/limit", post(|s, b| operation(s, Op::Limit, b)))
        .route("/v1/check", post(|s, b| operation(s, Op::Check, b)))
        .route("/v1/transaction", post(|s, b| operation(s, Op::Transaction, b)))
        .route("/v1/reset", post(|s, b| operation(s, Op::Reset, b)))
        .route("/v1/value", post(|s, b| operation(s, Op::Value, b)))
        .route("/v1/adjust", post(|s, b| operation(s, Op::Adjust, b)))
        .route("/v1/acquire", post(|s, b| operation(s, Op::Acquire, b)))
        .route("/v1/release", post(|s, b| operation(s, Op::Release, b)))
        .route("/v1/renew", post(|s, b| operation(s, Op::Renew, b)))
        .route(
            "/v1/time",
            get(|State(app): State<Arc<App>>| async move { app.engine.time().await }),
        )
        .route("/v1/config", get(|State(app): State<Arc<App>>| async move { app.engine.config() }))
        .route("/json", post(rls_json))
        .route(
            "/v1/stats",
            get(|State(app): State<Arc<App>>, uri: axum::http::Uri| async move {
                app.engine.stats(uri.query())
            }),
        );
    // With tokens, /metrics asks for one too (its labels may hold descriptor values, such as
    // API keys), unless the config says it is public.
    let scrape = get(|State(app): State<Arc<App>>| async move { metrics(&app) });
    let (api, open) = if app.public_metrics || !app.tokens.required() {
        (api, Router::new().route("/metrics", scrape))
    } else {
        (api.route("/metrics", scrape), Router::new())
    };
    // Without tokens there is nothing to check: no middleware on the hot path at all.
    let api = if !app.tokens.required() {
        api
    } else {
        api.route_layer(middleware::from_fn_with_state(Arc::clone(&app), authenticate))
    };
    Router::new()
        .merge(api)
        .merge(open)
        // The dashboard: the page itself is open; it asks for a token when the API does.
        .route("/", get(dashboard))
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(move || openapi(Arc::clone(&document))))
        .fallback(|| async {
            Answer::error(StatusCode::NOT_FOUND, "no such endpoint; see /openapi.json")
        })
        .method_not_allowed_fallback(|| async {
            Answer::error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed; see /openapi.json")
        })
        // Bodies over the limit are refused before they are read to the end.
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

async fn operation(State(app): State<Arc<App>>, op: Op, request: Request) -> Answer {
    if crate::otel::on() {
        let span = crate::otel::span(op.route(), op.name(), request.headers());
        return crate::otel::traced(span, operate(app, op, request), |span, answer: &Answer| {
            span.set("http.response.status_code", i64::from(answer.status.as_u16()));
            span.set("tollgate.outcome", answer.outcome);
            if let Some(ok) = answer.body.ok() {
                span.set("tollgate.granted", ok);
            }
            if answer.status.is_server_error() {
                span.failed();
            }
        })
        .await;
    }
    operate(app, op, request).await
}

async fn operate(app: Arc<App>, op: Op, request: Request) -> Answer {
    let start = Instant::now();
    let answer = match read_body(&app, request).await {
        Ok(body) => app.engine.run(op, &body).await,
        Err(answer) => answer,
    };
    app.metrics.record(Protocol::Http, op.name(), answer.outcome, start.elapsed());
    if answer.status.is_server_error() {
        let body = answer.body.to_json();
        app.errors.record(op.name(), answer.status, &body);
    }
    answer
}

/// A request's body, read within the body timeout: or the answer that says why not (413,
/// 408, 400), each closing the connection, whose rest was not read. A body declared larger
/// than the limit (`Content-Length`) is refused before any of it is read (nor is a client
/// that sent `Expect: 100-continue` told to send it).
async fn read_body(app: &App, request: Request) -> Result<axum::body::Bytes, Answer> {
    let declared = request.headers().get(header::CONTENT_LENGTH);
    let declared = declared.and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (status, message) = match declared {
        Some(length) if length > MAX_BODY as u64 => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is {length} bytes; the most is {MAX_BODY}"),
        ),
        _ => match read_within(app.body_timeout, request.into_body()).await {
            Ok(body) => return Ok(body),
            Err(refusal) => refusal,
        },
    };
    let mut answer = Answer::error(status, message);
    answer.headers.push((CLOSE.0, CLOSE.1.into()));
    Err(answer)
}

/// A body read whole within `timeout`, or the status and message that say why not.
async fn read_within(
    timeout: Duration,
    body: Body,
) -> Result<axum::body::Bytes, (StatusCode, String)> {
    Err(match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(body)) => return Ok(body),
        Ok(Err(e)) if too_large(&e) => {
            (StatusCode::PAYLOAD_TOO_LARGE, format!("request body is over {MAX_BODY} bytes"))
        }
        Ok(Err(e)) => (StatusCode::BAD_REQUEST, format!("cannot read the body: {e}")),
        Err(_) => {
            (StatusCode::REQUEST_TIMEOUT, format!("the body did not arrive within {timeout:?}"))
        }
    })
}

/// Whether reading a body failed for its size.
fn too_large(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = source {
        if error.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = error.source();
    }
    false
}

async fn authenticate(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let values = request.headers().get_all(header::AUTHORIZATION).iter().map(|v| v.to_str().ok());
    let mut refusal = match credential(&app.tokens, values) {
        Credential::Good => return next.run(request).await,
        Credential::Read if READ_PATHS.contains(&request.uri().path()) => {
            return next.run(request).await;
        }
        Credential::Read => Answer::error(
            StatusCode::FORBIDDEN,
            format!(
                "a read token may call {} only; {} needs a token of [server] tokens",
                READ_PATHS.join(", "),
                request.uri().path()
            ),
        )
        .into_response(),
        Credential::Several => Answer::error(
            StatusCode::BAD_REQUEST,
            "more than one Authorization header; send one: Authorization: Bearer <token>",
        )
        .into_response(),
        Credential::Missing => unauthorized("missing Authorization: Bearer <token>"),
        Credential::NotBearer => {
            unauthorized("expected a Bearer token: Authorization: Bearer <token>")
        }
        Credential::Wrong => unauthorized("wrong bearer token"),
    };
    close_if_unread(&mut refusal, request.headers());
    refusal
}

fn unauthorized(message: &str) -> Response {
    let mut response = Answer::error(StatusCode::UNAUTHORIZED, message).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// `/healthz`: the store answers (a read of nothing) within the store deadline, or 503;
/// SQLite must also still be able to write to the file at its path (see
/// `SqliteStore::check`). 503 `draining` at once after SIGTERM. The body says which config
/// is serving (its version, and when it was loaded).
async fn healthz(State(app): State<Arc<App>>) -> Response {
    let defined = app.engine.current();
    let config = serde_json::json!({ "version": defined.version, "loadedAt": defined.loaded_at });
    let answer = |status: StatusCode, body: serde_json::Value| {
        let mut body = body;
        body["config"] = config.clone();
        (status, axum::Json(body)).into_response()
    };
    if app.live.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "status": "draining", "store": "not checked" }),
        );
    }
    let late = || {
        tollgate::StoreError::new(format!(
            "the store did not answer within {:?}",
            app.health_deadline
        ))
    };
    let result = match &app.sqlite {
        Some(sqlite) => {
            let sqlite = Arc::clone(sqlite);
            let check = tokio::task::spawn_blocking(move || sqlite.check());
            match tokio::time::timeout(app.health_deadline, check).await {
                Ok(Ok(checked)) => checked,
                Ok(Err(_)) => Err(tollgate::StoreError::new("the store's check panicked")),
                Err(_) => Err(late()),
            }
        }
        None => {
            let probe = defined.limiter().store().read_async(&[]);
            match tokio::time::timeout(app.health_deadline, probe).await {
                Ok(read) => read.map(drop),
                Err(_) => Err(late()),
            }
        }
    };
    match result {
        Ok(()) => answer(StatusCode::OK, serde_json::json!({ "status": "ok", "store": "ok" })),
        Err(e) => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "status": "degraded", "store": e.to_string() }),
        ),
    }
}

/// The dashboard: one page, its script and styles inside (no CDN, nothing fetched but the
/// API).
async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(
                    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                     connect-src 'self'; img-src 'self' data:",
                ),
            ),
        ],
        include_str!("dashboard.html"),
    )
        .into_response()
}

/// envoyproxy/ratelimit's `POST /json`: 200 or 429 with the response in proto3 JSON; 404
/// without `--rls-config`.
async fn rls_json(State(app): State<Arc<App>>, request: Request) -> Response {
    let Some(rls) = &app.rls else {
        return Answer::error(
            StatusCode::NOT_FOUND,
            "no rate limit service configuration: start the server with --rls-config",
        )
        .into_response();
    };
    // The caller's trace context, kept only when there is a span to give it to.
    let headers = crate::otel::on().then(|| request.headers().clone());
    let body = match read_body(&app, request).await {
        Ok(body) => body,
        Err(answer) => return answer.into_response(),
    };
    let answer = rls
        .traced(
            crate::rls::Via::Json,
            || headers.unwrap_or_default(),
            crate::rls::json::parse(&body),
        )
        .await;
    match answer {
        Ok(answer) => {
            let status =
                if answer.over_limit { StatusCode::TOO_MANY_REQUESTS } else { StatusCode::OK };
            (status, axum::Json(crate::rls::json::render(&answer))).into_response()
        }
        Err(crate::rls::RlsError::Store(e)) => {
            let answer = crate::engine::store_failed(&e);
            app.errors.record("json", answer.status, &answer.body.to_json());
            answer.into_response()
        }
        Err(e) => Answer::error(StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

fn metrics(app: &App) -> Response {
    let sqlite = app.sqlite_states.load(std::sync::atomic::Ordering::Relaxed);
    let live = app.memory.as_ref().map(|m| m.len()).or((sqlite != usize::MAX).then_some(sqlite));
    let breaker = app.breaker.as_ref().map(|b| b.stats());
    let failed_open = app.engine.failed_open();
    let names = app.memory.as_ref().map(|m| m.names());
    let mut text = app.metrics.render(failed_open, live, names, breaker);
    if let Some(leasing) = &app.leases {
        crate::metrics::render_leases(&mut text, &leasing.stats());
        crate::metrics::render_leased_names(&mut text, &leasing.names());
    }
    config_metrics(app, &mut text);
    if let Some(rls) = &app.rls {
        rls.metrics.render(&mut text);
    }
    let mut response = text.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// The config serving, and its reloads.
fn config_metrics(app: &App, out: &mut String) {
    use std::fmt::Write as _;
    use std::sync::atomic::Ordering::Relaxed;
    let defined = app.engine.current();
    let _ = write!(
        out,
        "# HELP tollgate_config_info The config serving: its version (a digest of its files).\n\
         # TYPE tollgate_config_info gauge\n\
         tollgate_config_info{{version=\"{}\"}} 1\n\
         # HELP tollgate_config_loaded_timestamp_seconds When the config serving was loaded.\n\
         # TYPE tollgate_config_loaded_timestamp_seconds gauge\n\
         tollgate_config_loaded_timestamp_seconds {}\n\
         # HELP tollgate_config_reloads_total Reloads of the config applied.\n\
         # TYPE tollgate_config_reloads_total counter\n\
         tollgate_config_reloads_total {}\n\
         # HELP tollgate_config_reload_errors_total Reloads of the config refused (the old one \
         went on serving).\n\
         # TYPE tollgate_config_reload_errors_total counter\n\
         tollgate_config_reload_errors_total {}\n",
        defined.version,
        defined.loaded_at as f64 / 1_000.0,
        app.live.reloads.load(Relaxed),
        app.live.reload_errors.load(Relaxed),
    );
}

/// The OpenAPI document of this server: `/v1/*` (and `/metrics`, unless `public_metrics`)
/// asks for a bearer token (and may answer 401) only when the server has tokens.
fn openapi_document(tokens: bool, public_metrics: bool) -> String {
    const DOCUMENT: &str = include_str!("openapi.json");
    if tokens && !public_metrics {
        return DOCUMENT.to_owned();
    }
    let Ok(mut document) = serde_json::from_str::<serde_json::Value>(DOCUMENT) else {
        return DOCUMENT.to_owned();
    };
    if let Some(paths) = document.get_mut("paths").and_then(|p| p.as_object_mut()) {
        for (path, operations) in paths.iter_mut() {
            if tokens && path != "/metrics" {
                continue;
            }
            let Some(operations) = operations.as_object_mut() else { continue };
            for operation in operations.values_mut() {
                operation["security"] = serde_json::json!([]);
                if let Some(responses) =
                    operation.get_mut("responses").and_then(|r| r.as_object_mut())
                {
                    responses.remove("401");
                    if path == "/metrics" {
                        responses.remove("400");
                    }
                }
            }
        }
    }
    document.to_string()
}

async fn openapi(document: Arc<str>) -> Response {
    let mut response = document.to_string().into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
