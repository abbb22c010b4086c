//! What a request is answered, whatever asked it: a status, a JSON body and header fields,
//! made by [`crate::engine`] and turned into an HTTP response in one place (the
//! `IntoResponse` impl); a refusal that leaves a body unread closes its connection.

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

/// What a request is answered: status, JSON body, header fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The HTTP status.
    pub status: StatusCode,
    /// The JSON body.
    pub body: Body,
    /// `RateLimit-Policy`, `RateLimit` and `Retry-After`, when they apply.
    pub headers: Vec<(HeaderName, String)>,
    /// How the request went, for metrics: `ok`, `refused`, `invalid`, `not_defined`, `store_error`.
    pub outcome: &'static str,
}

/// An answer's JSON body: most are built as a [`Value`]; a decision, the answer to almost
/// every request, is written straight to its text.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// Any JSON.
    Json(Value),
    /// `{ ok, retryAfter? }`.
    Decision {
        /// Granted or not.
        ok: bool,
        /// The wait, if any.
        retry_after: Option<f64>,
    },
}

impl Body {
    /// The body as a JSON value.
    pub fn into_value(self) -> Value {
        match self {
            Body::Json(value) => value,
            Body::Decision { ok, retry_after } => decision_json(ok, retry_after),
        }
    }

    /// Whether it grants the request, if it is a decision (of a limit, a check, a
    /// transaction).
    pub fn ok(&self) -> Option<bool> {
        match self {
            Body::Json(value) => value.get("ok")?.as_bool(),
            Body::Decision { ok, .. } => Some(*ok),
        }
    }

    /// The body's JSON text.
    pub fn to_json(&self) -> String {
        match self {
            Body::Json(value) => value.to_string(),
            Body::Decision { ok, retry_after } => {
                let mut text = String::with_capacity(40);
                text.push_str(if *ok { "{\"ok\":true" } else { "{\"ok\":false" });
                if let Some(wait) = retry_after {
                    text.push_str(",\"retryAfter\":");
                    text.push_str(&number(*wait).to_string());
                }
                text.push('}');
                text
            }
        }
    }
}

impl Answer {
    /// A 200 answer of `body`.
    pub fn ok(body: Value) -> Self {
        Answer {
            status: StatusCode::OK,
            body: Body::Json(body),
            headers: Vec::new(),
            outcome: "ok",
        }
    }

    /// An error answer: `{ "error": message }`.
    pub fn error(status: StatusCode, message: impl Into<String>) -> Self {
        let outcome = match status {
            StatusCode::NOT_FOUND => "not_defined",
            StatusCode::SERVICE_UNAVAILABLE => "store_error",
            _ => "invalid",
        };
        Answer {
            status,
            body: Body::Json(json!({ "error": message.into() })),
            headers: Vec::new(),
            outcome,
        }
    }
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

/// `Connection: close`, on answers after which the connection is closed (the body was not
/// read to its end), so that a client does not send its next request on it.
pub const CLOSE: (HeaderName, &str) = (header::CONNECTION, "close");

/// A refusal of a request whose body it did not read: if the request has one (by
/// `Transfer-Encoding` or a `Content-Length` other than 0), the connection is closed after
/// the answer, and the answer says so, so that a client does not send its next request on it.
pub fn close_if_unread(refusal: &mut Response, request: &axum::http::HeaderMap) {
    let body = request.contains_key(header::TRANSFER_ENCODING)
        || request.get(header::CONTENT_LENGTH).is_some_and(|length| length.as_bytes() != b"0");
    if body {
        refusal.headers_mut().insert(CLOSE.0, HeaderValue::from_static(CLOSE.1));
    }
}

/// `{ ok, retryAfter? }`.
pub fn decision_json(ok: bool, retry_after: Option<f64>) -> Value {
    let mut body = Map::new();
    body.insert("ok".into(), Value::Bool(ok));
    if let Some(wait) = retry_after {
        body.insert("retryAfter".into(), number(wait));
    }
    Value::Object(body)
}

/// A number in its shortest JSON form: `60000`, not `60000.0`.
pub fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9_007_199_254_740_992.0 {
        Value::from(x as i64)
    } else {
        Value::from(x)
    }
}
