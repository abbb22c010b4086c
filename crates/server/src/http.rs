//! The HTTP API of SPEC §6 on axum.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::engine::{Answer, Engine, MAX_BODY, Op};
use crate::metrics::Metrics;

/// What every handler shares.
pub struct App {
    /// The operations.
    pub engine: Arc<Engine>,
    /// Accepted bearer tokens; empty: no authentication.
    pub tokens: Vec<String>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The memory store, if that is the store: its live states are a metric.
    pub memory: Option<Arc<tollgate::MemoryStore>>,
}

/// The one place where answers (including errors) become HTTP responses.
impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let content_type = [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))];
        let mut response = (self.status, content_type, self.body.to_json()).into_response();
        for (name, value) in self.headers {
            // From a String, the value takes the buffer over: no copy.
            if let Ok(value) = HeaderValue::try_from(value) {
                response.headers_mut().insert(name, value);
            }
        }
        response
    }
}

/// The router: `/v1/*` behind the bearer tokens, `/healthz`, `/metrics` and
/// `/openapi.json` open.
pub fn router(app: Arc<App>) -> Router {
    let document: Arc<str> = openapi_document(!app.tokens.is_empty()).into();
    let api = Router::new()
        .route("/v1/limit", post(|s, b| operation(s, Op::Limit, b)))
        .route("/v1/check", post(|s, b| operation(s, Op::Check, b)))
        .route("/v1/transaction", post(|s, b| operation(s, Op::Transaction, b)))
        .route("/v1/reset", post(|s, b| operation(s, Op::Reset, b)))
        .route("/v1/value", post(|s, b| operation(s, Op::Value, b)))
        .route(
            "/v1/time",
            get(|State(app): State<Arc<App>>| async move { app.engine.time().await }),
        )
        .route("/v1/config", get(|State(app): State<Arc<App>>| async move { app.engine.config() }));
    // Without tokens there is nothing to check: no middleware on the hot path at all.
    let api = if app.tokens.is_empty() {
        api
    } else {
        api.route_layer(middleware::from_fn_with_state(Arc::clone(&app), authenticate))
    };
    Router::new()
        .merge(api)
        .route("/healthz", get(healthz))
        .route("/metrics", get(|State(app): State<Arc<App>>| async move { metrics(&app) }))
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

async fn operation(
    State(app): State<Arc<App>>,
    op: Op,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let start = Instant::now();
    let answer = match body {
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => Answer::error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is over {MAX_BODY} bytes"),
        ),
        Err(rejection) => Answer::error(rejection.status(), rejection.body_text()),
        Ok(body) => app.engine.run(op, &body).await,
    };
    app.metrics.record(op.name(), answer.outcome, start.elapsed());
    if answer.status.is_server_error() {
        tracing::warn!(op = op.name(), status = %answer.status, body = %answer.body.to_json(), "request failed");
    }
    answer
}

async fn authenticate(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(token) if app.tokens.iter().any(|t| same(t.as_bytes(), token.as_bytes())) => {
            next.run(request).await
        }
        Some(_) => unauthorized("wrong bearer token"),
        None => unauthorized("missing Authorization: Bearer <token>"),
    }
}

fn unauthorized(message: &str) -> Response {
    let mut response = Answer::error(StatusCode::UNAUTHORIZED, message).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Compares without stopping at the first difference, so timing does not reveal a token.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long `/healthz` waits for the store before it says the store does not answer.
const HEALTH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

async fn healthz(State(app): State<Arc<App>>) -> Response {
    let probe = app.engine.limiter().store().read_boxed(&[]);
    let result = match tokio::time::timeout(HEALTH_DEADLINE, probe).await {
        Ok(read) => read.map(drop),
        Err(_) => Err(tollgate::StoreError::new(format!(
            "the store did not answer within {HEALTH_DEADLINE:?}"
        ))),
    };
    match result {
        Ok(()) => {
            (StatusCode::OK, axum::Json(serde_json::json!({ "status": "ok", "store": "ok" })))
                .into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "status": "degraded", "store": e.to_string() })),
        )
            .into_response(),
    }
}

fn metrics(app: &App) -> Response {
    let live = app.memory.as_ref().map(|m| m.len());
    let mut response = app.metrics.render(app.engine.limiter().failed_open(), live).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// The OpenAPI document of this server: `/v1/*` asks for a bearer token (and may answer
/// 401) only when the server has tokens.
fn openapi_document(tokens: bool) -> String {
    const DOCUMENT: &str = include_str!("openapi.json");
    if tokens {
        return DOCUMENT.to_owned();
    }
    let Ok(mut document) = serde_json::from_str::<serde_json::Value>(DOCUMENT) else {
        return DOCUMENT.to_owned();
    };
    if let Some(paths) = document.get_mut("paths").and_then(|p| p.as_object_mut()) {
        for operation in
            paths.values_mut().filter_map(|p| p.as_object_mut()).flat_map(|p| p.values_mut())
        {
            operation["security"] = serde_json::json!([]);
            if let Some(responses) = operation.get_mut("responses").and_then(|r| r.as_object_mut())
            {
                responses.remove("401");
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
