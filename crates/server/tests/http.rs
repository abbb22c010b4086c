//! Every endpoint and every error of SPEC §6, through the router with `oneshot`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tollgate::store::Unavailable;
use tollgate::{Config, MINUTE, ManualClock, MemoryStore, RateLimiter};
use tollgate_server::auth::Tokens;
use tollgate_server::browsers::BrowserRules;
use tollgate_server::engine::{Engine, Permissions};
use tollgate_server::http::{App, Service, router};
use tollgate_server::store::DynStore;
use tower::ServiceExt;

const T0: f64 = 1_700_000_000_000.0;

fn app_with(store: DynStore, tokens: &[&str], permissions: Permissions) -> Service {
    let limiter = RateLimiter::builder(store)
        .define("example", Config::token_bucket(10.0, MINUTE).with_capacity(3.0))
        .define("small", Config::token_bucket(3.0, MINUTE))
        .build();
    serve(limiter, full(tokens), permissions, false)
}

/// `tokens` as full tokens.
fn full(tokens: &[&str]) -> Tokens {
    Tokens { full: tokens.iter().map(|t| t.to_string()).collect(), read: Vec::new() }
}

/// The router over `limiter`, with `tokens`, and `/metrics` open with `public_metrics`.
fn serve(
    limiter: RateLimiter<DynStore>,
    tokens: Tokens,
    permissions: Permissions,
    public_metrics: bool,
) -> Service {
    let required = tokens.required();
    router(Arc::new(App {
        engine: Arc::new(Engine::new(limiter, permissions)),
        tokens,
        metrics: std::sync::Arc::default(),
        memory: None,
        breaker: None,
        leases: None,
        health_deadline: std::time::Duration::from_millis(250),
        errors: Arc::default(),
        accept_errors: Arc::default(),
        body_timeout: std::time::Duration::from_secs(10),
        sqlite_states: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
        rls: None,
        browsers: BrowserRules::new(
            required,
            "127.0.0.1:8787".parse().unwrap(),
            &["https://app.example".to_owned()],
            &[],
        )
        .shared(),
        public_metrics,
        sqlite: None,
        live: Arc::default(),
    }))
}

fn app() -> (Service, ManualClock) {
    let clock = ManualClock::new(T0);
    (app_with(Arc::new(MemoryStore::with_clock(clock.clone())), &[], Permissions::default()), clock)
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

async fn send(app: &Service, request: Request<Body>) -> Reply {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    Reply { status, headers, body }
}

async fn post(app: &Service, path: &str, body: impl Into<String>) -> Reply {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.into()))
        .unwrap();
    send(app, request).await
}

async fn get(app: &Service, path: &str) -> Reply {
    send(app, Request::get(path).body(Body::empty()).unwrap()).await
}

#[tokio::test]
async fn limit_answers_with_the_header_fields() {
    let (app, _) = app();
    let r = post(&app, "/v1/limit", r#"{"name":"example","key":"alice"}"#).await;
    assert_eq!((r.status, r.body.clone()), (StatusCode::OK, json!({ "ok": true })));
    assert_eq!(r.header("ratelimit-policy"), Some("\"example\";q=10;w=60"));
    assert_eq!(r.header("ratelimit"), Some("\"example\";r=2;t=6"));
    post(&app, "/v1/limit", r#"{"name":"example","key":"alice","count":2}"#).await;
    let refused = post(&app, "/v1/limit", r#"{"name":"example","key":"alice"}"#).await;
    assert_eq!(refused.body, json!({ "ok": false, "retryAfter": 6000 }));
    assert_eq!(refused.header("retry-after"), Some("6"));
    assert_eq!(refused.header("ratelimit"), Some("\"example\";r=0;t=18"));
}

#[tokio::test]
async fn throws_turns_a_refusal_into_429() {
    let (app, _) = app();
    post(&app, "/v1/limit", r#"{"name":"example","count":3}"#).await;
    let r = post(&app, "/v1/limit", r#"{"name":"example","throws":true}"#).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.body, json!({ "kind": "RateLimited", "name": "example", "retryAfter": 6000 }));
    assert_eq!(r.header("retry-after"), Some("6"));
    assert_eq!(r.header("ratelimit"), Some("\"example\";r=0;t=18"));
    // A granted reservation is not an error.
    let r = post(&app, "/v1/limit", r#"{"name":"example","throws":true,"reserve":true}"#).await;
    assert_eq!((r.status, r.body), (StatusCode::OK, json!({ "ok": true, "retryAfter": 6000 })));
}

#[tokio::test]
async fn the_spec_numbers_over_http() {
    let (app, clock) = app();
    let config = r#""config":{"kind":"token bucket","rate":10,"period":"1m"}"#;
    let limit = |count: u32| format!(r#"{{"name":"inline","count":{count},{config}}}"#);
    assert_eq!(post(&app, "/v1/limit", limit(5)).await.body, json!({ "ok": true }));
    clock.advance(6_000.0);
    assert_eq!(post(&app, "/v1/limit", limit(6)).await.body, json!({ "ok": true }));
    assert_eq!(
        post(&app, "/v1/limit", limit(10)).await.body,
        json!({ "ok": false, "retryAfter": 60000 })
    );
    let v = post(&app, "/v1/value", format!(r#"{{"name":"inline",{config}}}"#)).await;
    assert_eq!(
        v.body,
        json!({ "value": 0, "ts": T0 as i64 + 6000, "shard": 0,
        "config": { "kind": "token bucket", "rate": 10, "period": 60000, "capacity": 10, "shards": 1 } })
    );
}

#[tokio::test]
async fn check_consumes_nothing() {
    let (app, _) = app();
    for _ in 0..5 {
        assert_eq!(
            post(&app, "/v1/check", r#"{"name":"example","count":3}"#).await.body,
            json!({ "ok": true })
        );
    }
    let v = post(&app, "/v1/value", r#"{"name":"example"}"#).await;
    assert_eq!(v.body["value"], json!(3));
}

#[tokio::test]
async fn transactions_are_all_or_nothing() {
    let (app, _) = app();
    post(&app, "/v1/limit", r#"{"name":"small","count":2}"#).await;
    let t = post(
        &app,
        "/v1/transaction",
        r#"{"limits":[{"name":"example","count":3},{"name":"small","count":2}]}"#,
    )
    .await;
    assert_eq!(t.status, StatusCode::OK);
    assert_eq!(
        t.body,
        json!({ "ok": false, "retryAfter": 20000,
        "results": [{ "ok": true }, { "ok": false, "retryAfter": 20000 }] })
    );
    assert_eq!(t.header("retry-after"), Some("20"));
    assert_eq!(t.header("ratelimit-policy"), Some("\"example\";q=10;w=60, \"small\";q=3;w=60"));
    assert_eq!(
        post(&app, "/v1/value", r#"{"name":"example"}"#).await.body["value"],
        json!(3),
        "nothing taken"
    );
    let t = post(
        &app,
        "/v1/transaction",
        r#"{"limits":[{"name":"example","count":3},{"name":"small","count":2,"throws":true}]}"#,
    )
    .await;
    assert_eq!(t.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(t.body, json!({ "kind": "RateLimited", "name": "small", "retryAfter": 20000 }));
    // Invalid anywhere: 400, nothing taken.
    let t = post(
        &app,
        "/v1/transaction",
        r#"{"limits":[{"name":"example"},{"name":"small","count":-1}]}"#,
    )
    .await;
    assert_eq!(t.status, StatusCode::BAD_REQUEST);
    assert_eq!(post(&app, "/v1/value", r#"{"name":"example"}"#).await.body["value"], json!(3));
    assert_eq!(
        post(&app, "/v1/transaction", r#"{"limits":[]}"#).await.status,
        StatusCode::BAD_REQUEST
    );
    // A limit as an array (serde's positional form of a struct) is not one.
    let t = post(&app, "/v1/transaction", r#"{"limits":[["example"]]}"#).await;
    assert_eq!(
        (t.status, t.body),
        (
            StatusCode::BAD_REQUEST,
            json!({ "error": "limits[0]: invalid type: sequence, expected an object at line 1 column 11" })
        )
    );
    assert_eq!(post(&app, "/v1/value", r#"{"name":"example"}"#).await.body["value"], json!(3));
}

/// `POST /v1/adjust` (SPEC §4): a cost settled after the work, signed, never refused, never
/// above capacity; a debt shows as a negative value and the wait until it is paid, and
/// delays the next requests by exactly that.
#[tokio::test]
async fn adjust_settles_a_cost_after_the_work() {
    let (app, clock) = app();
    // `example`: 10 a minute, capacity 3. The estimate: 2.
    let r = post(&app, "/v1/limit", r#"{"name":"example","key":"u","count":2}"#).await;
    assert_eq!(r.body, json!({ "ok": true }));
    // The work used 4: 2 more, 1 short (6 s at a token each 6 s).
    let r = post(&app, "/v1/adjust", r#"{"name":"example","key":"u","count":2}"#).await;
    assert_eq!((r.status, r.body), (StatusCode::OK, json!({ "value": -1, "retryAfter": 6000 })));
    let r = post(&app, "/v1/limit", r#"{"name":"example","key":"u"}"#).await;
    assert_eq!(r.body, json!({ "ok": false, "retryAfter": 12000 }), "the debt comes first");
    // Given back: never above capacity.
    clock.advance(3_000.0);
    let r = post(&app, "/v1/adjust", r#"{"name":"example","key":"u","count":-10}"#).await;
    assert_eq!(r.body, json!({ "value": 3 }));
    let r = post(&app, "/v1/value", r#"{"name":"example","key":"u"}"#).await;
    assert_eq!(r.body["value"], json!(3));
    // Inline configs, as for any operation.
    let inline = r#"{"name":"tokens","key":"u","count":1500,"config":{"kind":"fixed window","rate":1000,"period":"1m","start":0}}"#;
    let r = post(&app, "/v1/adjust", inline).await;
    assert_eq!(r.body["value"], json!(-500));
    // Bad input: 400, nothing settled.
    for body in [
        r#"{"name":"example","key":"u"}"#,
        r#"{"name":"example","key":"u","count":"2"}"#,
        r#"{"name":"example","key":"u","count":1e300}"#,
        r#"{"name":"example","key":"u","count":1,"reserve":true}"#,
    ] {
        let r = post(&app, "/v1/adjust", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.body);
    }
    let r = post(&app, "/v1/adjust", r#"{"name":"nope","count":1}"#).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = post(&app, "/v1/value", r#"{"name":"example","key":"u"}"#).await;
    assert_eq!(r.body["value"], json!(3), "nothing settled by the refused bodies");
    let m = get(&app, "/metrics").await;
    let text = m.body.as_str().unwrap();
    let line = "tollgate_requests_total{op=\"adjust\",outcome=\"ok\",protocol=\"http\"} 3";
    assert!(text.contains(line), "{line} in\n{text}");
}

/// Calendar windows (SPEC §1, §2) over HTTP: a day of Europe/Berlin, refilled at local
/// midnight (T0 is 23:13:20 there); `value` reports `calendar` and `timeZone` in place of
/// `period` and `start`; bad calendars are 400 naming the field.
#[tokio::test]
async fn calendar_windows_in_a_time_zone() {
    let (app, clock) = app();
    let daily = r#"{"kind":"fixed window","rate":2,"calendar":"day","timeZone":"Europe/Berlin"}"#;
    let body = format!(r#"{{"name":"daily","key":"u","config":{daily}}}"#);
    for _ in 0..2 {
        assert_eq!(post(&app, "/v1/limit", body.clone()).await.body, json!({ "ok": true }));
    }
    let r = post(&app, "/v1/limit", body.clone()).await;
    assert_eq!(r.body, json!({ "ok": false, "retryAfter": 2_800_000 }));
    assert_eq!(r.header("retry-after"), Some("2800"));
    let r = post(&app, "/v1/value", body.clone()).await;
    assert_eq!(
        r.body,
        json!({
            "value": 0,
            "ts": 1_699_916_400_000_i64,
            "shard": 0,
            "config": {
                "kind": "fixed window",
                "rate": 2,
                "capacity": 2,
                "shards": 1,
                "calendar": "day",
                "timeZone": "Europe/Berlin"
            }
        })
    );
    clock.advance(2_800_000.0);
    assert_eq!(post(&app, "/v1/limit", body.clone()).await.body, json!({ "ok": true }));
    for (config, error) in [
        (
            r#"{"kind":"token bucket","rate":2,"calendar":"day"}"#,
            "invalid config: calendar is \"day\"; it applies to fixed windows only",
        ),
        (
            r#"{"kind":"fixed window","rate":2,"calendar":"fortnight"}"#,
            "invalid config: calendar is \"fortnight\"; it must be \"day\", \"week\", \"month\" or \"year\"",
        ),
        (
            r#"{"kind":"fixed window","rate":2,"calendar":"day","timeZone":"Mars/Olympus"}"#,
            "invalid config: timeZone is \"Mars/Olympus\"; it must be a zone of the IANA time zone database",
        ),
        (
            r#"{"kind":"fixed window","rate":2,"period":"1d","calendar":"day"}"#,
            "invalid config: period is given; it must not be given with calendar (a calendar window's length is its own)",
        ),
        (
            r#"{"kind":"fixed window","rate":2,"period":"1d","timeZone":"UTC"}"#,
            "invalid config: timeZone is \"UTC\"; it applies to calendar windows only (set calendar too)",
        ),
        (
            r#"{"kind":"fixed window","rate":2}"#,
            "invalid config: period is missing; it is required (milliseconds or a duration such as \"1m\"), unless a fixed window has a calendar",
        ),
    ] {
        let r = post(&app, "/v1/limit", format!(r#"{{"name":"bad","config":{config}}}"#)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{config}");
        assert_eq!(r.body["error"], json!(error), "{config}");
    }
}

#[tokio::test]
async fn reset_value_time_config() {
    let (app, _) = app();
    post(&app, "/v1/limit", r#"{"name":"example","key":"k","count":3}"#).await;
    assert_eq!(post(&app, "/v1/reset", r#"{"name":"example","key":"k"}"#).await.body, json!({}));
    assert_eq!(
        post(&app, "/v1/limit", r#"{"name":"example","key":"k","count":3}"#).await.body,
        json!({ "ok": true })
    );
    let v = post(&app, "/v1/value", r#"{"name":"example","key":"k"}"#).await;
    assert_eq!((v.body["value"].clone(), v.body["ts"].clone()), (json!(0), json!(T0 as i64)));
    assert_eq!(get(&app, "/v1/time").await.body, json!({ "now": T0 as i64 }));
    let c = get(&app, "/v1/config").await.body;
    assert_eq!(
        c["example"],
        json!({ "kind": "token bucket", "rate": 10, "period": 60000, "capacity": 3, "shards": 1 })
    );
    assert_eq!(c.as_object().unwrap().len(), 2);
    let v = post(&app, "/v1/value", r#"{"name":"example","sampleShards":0}"#).await;
    assert_eq!(v.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn bad_input_is_400_and_consumes_nothing() {
    let (app, _) = app();
    let cases: &[(&str, &str)] = &[
        (r#"{"name":"example","#, "malformed JSON: EOF while parsing a value at line 1 column 18"),
        ("", "malformed JSON: EOF while parsing a value at line 1 column 0"),
        (
            r#"{"name":"example","count":"3"}"#,
            "count: invalid type: string \"3\", expected a number at line 1 column 29",
        ),
        (r#"{"name":"example","count":1e999}"#, "count: number out of range (it must be finite)"),
        (
            "{\"name\":\"x\",\n \"config\":{\"kind\":\"token bucket\",\"rate\":-1e400,\"period\":1}}",
            "rate: number out of range (it must be finite)",
        ),
        (
            r#"{"name":"example","burst":1}"#,
            "burst: unknown field `burst`, expected one of `name`, `key`, `count`, `reserve`, `throws`, `config` at line 1 column 25",
        ),
        (
            r#"{"name":"example","count":-1}"#,
            "Rate limit example count -1 must be a finite number >= 0.",
        ),
        (r#"{"name":"example","count":4}"#, "Rate limit example count 4 exceeds 3."),
        (
            r#"{"name":"x","config":{"kind":"leaky bucket","rate":1,"period":1}}"#,
            "invalid config: kind is \"leaky bucket\"; it must be \"token bucket\" or \"fixed window\"",
        ),
        (
            r#"{"name":"x","config":{"kind":"token bucket","rate":0,"period":1}}"#,
            "invalid config: rate is 0; it must be finite, at least 1e-9 and at most 1e15",
        ),
        (
            r#"{"name":"","config":{"kind":"token bucket","rate":1,"period":1}}"#,
            "Rate limit name must not be empty.",
        ),
        (r#"{"key":"k"}"#, "invalid request body: missing field `name` at line 1 column 11"),
        // The API's words, not Rust's types.
        (
            r#"["example"]"#,
            "invalid request body: invalid type: sequence, expected an object at line 1 column 0",
        ),
        (
            r#"{"name":"x","config":["token bucket",1,1]}"#,
            "config: invalid type: sequence, expected an object at line 1 column 21",
        ),
        (
            r#"{"name":"x","config":{"kind":"token bucket","rate":1,"period":true}}"#,
            "config.period: invalid type: boolean `true`, expected a number (ms) or a duration such as \"1m\" at line 1 column 66",
        ),
    ];
    for (body, error) in cases {
        let r = post(&app, "/v1/limit", *body).await;
        assert_eq!(
            (r.status, r.body),
            (StatusCode::BAD_REQUEST, json!({ "error": error })),
            "{body}"
        );
    }
    assert_eq!(post(&app, "/v1/value", r#"{"name":"example"}"#).await.body["value"], json!(3));
}

#[tokio::test]
async fn undefined_names_are_404() {
    let (app, _) = app();
    let r = post(&app, "/v1/limit", r#"{"name":"nope","key":"k"}"#).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.body["error"],
        json!(
            "Rate limit nope not defined. Define it in a [limits.nope] table of the server's config file, or send a config with the request."
        )
    );
    // A reset needs no config (SPEC §6): there is nothing to forget, and that is no error.
    let r = post(&app, "/v1/reset", r#"{"name":"nope"}"#).await;
    assert_eq!((r.status, r.body), (StatusCode::OK, json!({})));
}

/// A body with anything after its JSON value is malformed: 400, and nothing is taken.
/// (Before, such a body failed the first parse and passed the second, which words errors,
/// and was served.)
#[tokio::test]
async fn trailing_data_after_the_body_is_400_and_takes_nothing() {
    let (app, _) = app();
    let bodies = [
        (r#"{"name":"example","key":"k"} garbage"#, "/v1/limit"),
        (r#"{"name":"example","key":"k"}{"name":"example","key":"k"}"#, "/v1/limit"),
        (r#"{"name":"example","key":"k"} 1"#, "/v1/check"),
        (r#"{"limits":[{"name":"example","key":"k"}]} x"#, "/v1/transaction"),
        (r#"{"name":"example","key":"k"} ]"#, "/v1/reset"),
        (r#"{"name":"example","key":"k"} {}"#, "/v1/value"),
    ];
    for (body, path) in bodies {
        let r = post(&app, path, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} {body}: {}", r.body);
        let error = r.body["error"].as_str().unwrap();
        assert!(error.starts_with("malformed JSON: trailing characters"), "{body}: {error}");
    }
    let v = post(&app, "/v1/value", r#"{"name":"example","key":"k"}"#).await;
    assert_eq!(v.body["value"], json!(3), "nothing was taken");
    // Whitespace after the value is fine.
    let r = post(&app, "/v1/limit", "{\"name\":\"example\",\"key\":\"k\"} \n\t ").await;
    assert_eq!(r.body, json!({ "ok": true }));
}

/// A name the server defines keeps the server's config: a request that brings its own is
/// refused (it could lift the limit), unless `allowConfigOverride` says otherwise.
#[tokio::test]
async fn a_defined_limit_cannot_be_lifted_by_a_request() {
    let (app, _) = app();
    let config = r#"{"kind":"token bucket","rate":1000000,"period":1000}"#;
    let lifted = format!(r#"{{"name":"small","key":"k","count":100,"config":{config}}}"#);
    let lifted = lifted.as_str();
    let read = format!(r#"{{"name":"small","key":"k","config":{config}}}"#);
    for (path, body) in [("/v1/limit", lifted), ("/v1/check", lifted), ("/v1/value", &read)] {
        let r = post(&app, path, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(
            r.body["error"],
            json!("Rate limit small is defined by the server; send no config for it.")
        );
    }
    let tx = format!(r#"{{"limits":[{{"name":"example","key":"k"}},{lifted}]}}"#);
    assert_eq!(post(&app, "/v1/transaction", tx).await.status, StatusCode::BAD_REQUEST);
    let v = post(&app, "/v1/value", r#"{"name":"small","key":"k"}"#).await;
    assert_eq!(v.body["value"], json!(3), "nothing was taken");
    let v = post(&app, "/v1/value", r#"{"name":"example","key":"k"}"#).await;
    assert_eq!(v.body["value"], json!(3), "nothing was taken by the refused transaction");

    let open = Permissions { inline_config: true, config_override: true };
    let app = app_with(Arc::new(MemoryStore::with_clock(ManualClock::new(T0))), &[], open);
    assert_eq!(post(&app, "/v1/limit", lifted).await.body, json!({ "ok": true }));
}

/// A reset forgets every shard's state of (name, key), whatever config made them: a name
/// that only ever came with inline configs, sharded, and a defined name whose states were
/// made with more shards than its config has now.
#[tokio::test]
async fn reset_forgets_every_shard_whatever_config_made_them() {
    let (app, _) = app();
    let sharded = r#"{"kind":"token bucket","rate":40,"period":60000,"shards":8}"#;
    // Two shards drawn at random for each take (the power of two choices): a take whose two
    // are both empty is refused, so how many of the 30 were admitted varies.
    let mut admitted = 0.0;
    for _ in 0..30 {
        let body = format!(r#"{{"name":"inline","key":"k","config":{sharded}}}"#);
        let r = post(&app, "/v1/limit", body).await;
        assert_eq!(r.status, StatusCode::OK);
        if r.body["ok"] == json!(true) {
            admitted += 1.0;
        }
    }
    let value = |app: Service| async move {
        let body = format!(r#"{{"name":"inline","key":"k","sampleShards":8,"config":{sharded}}}"#);
        post(&app, "/v1/value", body).await.body["value"].as_f64().unwrap()
    };
    assert!(admitted >= 20.0, "{admitted} of 30 admitted");
    assert!(value(app.clone()).await < 41.0 - admitted, "{admitted} of 40 taken");
    let r = post(&app, "/v1/reset", r#"{"name":"inline","key":"k"}"#).await;
    assert_eq!((r.status, r.body), (StatusCode::OK, json!({})));
    assert_eq!(value(app.clone()).await, 40.0, "every shard forgotten");
    // A config in a reset is not needed, but a bad one is still an error.
    let bad = r#"{"name":"inline","config":{"kind":"token bucket","rate":0,"period":1}}"#;
    assert_eq!(post(&app, "/v1/reset", bad).await.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn big_bodies_wrong_methods_and_paths() {
    let (app, _) = app();
    let big = format!(r#"{{"name":"example","key":"{}"}}"#, "k".repeat(70_000));
    let r = post(&app, "/v1/limit", big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(r.body["error"].as_str().unwrap().contains("65536"), "{}", r.body);
    let r = get(&app, "/v1/limit").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(r.body["error"].is_string());
    assert_eq!(get(&app, "/v2/nothing").await.status, StatusCode::NOT_FOUND);
    let long_key = format!(r#"{{"name":"example","key":"{}"}}"#, "k".repeat(1025));
    assert_eq!(post(&app, "/v1/limit", long_key).await.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn inline_configs_can_be_forbidden() {
    let no_inline = Permissions { inline_config: false, config_override: false };
    let app = app_with(Arc::new(MemoryStore::new()), &[], no_inline);
    let r = post(
        &app,
        "/v1/limit",
        r#"{"name":"x","config":{"kind":"token bucket","rate":1,"period":1000}}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body["error"].as_str().unwrap().starts_with("inline configs are not allowed"));
    assert_eq!(post(&app, "/v1/limit", r#"{"name":"example"}"#).await.status, StatusCode::OK);
}

#[tokio::test]
async fn tokens_guard_the_api_but_not_health() {
    let app = app_with(Arc::new(MemoryStore::new()), &["s3cret", "other"], Permissions::default());
    let with = |token: Option<&str>| {
        let mut r = Request::post("/v1/limit");
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        r.body(Body::from(r#"{"name":"example"}"#)).unwrap()
    };
    let missing = send(&app, with(None)).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    assert_eq!(send(&app, with(Some("wrong"))).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(send(&app, with(Some("s3cret"))).await.status, StatusCode::OK);
    assert_eq!(send(&app, with(Some("other"))).await.status, StatusCode::OK);
    assert_eq!(get(&app, "/v1/time").await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get(&app, "/healthz").await.status, StatusCode::OK);
    // Another scheme is not a missing token; two headers are a malformed request.
    let basic = Request::post("/v1/limit")
        .header("authorization", "Basic czNjcmV0")
        .body(Body::from(r#"{"name":"example"}"#))
        .unwrap();
    let r = send(&app, basic).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.body["error"], "expected a Bearer token: Authorization: Bearer <token>");
    let two = Request::post("/v1/limit")
        .header("authorization", "Bearer s3cret")
        .header("authorization", "Bearer wrong")
        .body(Body::from(r#"{"name":"example"}"#))
        .unwrap();
    let r = send(&app, two).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body["error"].as_str().unwrap().contains("more than one Authorization"));
    // /metrics (whose labels may hold descriptor values) asks for the token too...
    assert_eq!(get(&app, "/metrics").await.status, StatusCode::UNAUTHORIZED);
    let scrape = Request::get("/metrics")
        .header("authorization", "Bearer s3cret")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, scrape).await.status, StatusCode::OK);
}

/// A read token may call `value`, `check`, `time` and `config`: anything else is 403, and
/// nothing is taken.
#[tokio::test]
async fn read_tokens_read_and_nothing_else() {
    let limiter = RateLimiter::builder(Arc::new(MemoryStore::new()) as DynStore)
        .define("small", Config::token_bucket(3.0, MINUTE))
        .build();
    let tokens = Tokens { full: vec!["s3cret".into()], read: vec!["r3ad".into()] };
    let app = serve(limiter, tokens, Permissions::default(), false);
    let call = |method: &str, path: &str, token: &str, body: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {token}"))
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let one = r#"{"name":"small","key":"k"}"#;
    for (method, path, body) in [
        ("POST", "/v1/check", one),
        ("POST", "/v1/value", one),
        ("GET", "/v1/time", ""),
        ("GET", "/v1/config", ""),
    ] {
        let r = send(&app, call(method, path, "r3ad", body)).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {:?}", r.body);
    }
    let transaction = r#"{"limits":[{"name":"small","key":"k"}]}"#;
    for (method, path, body) in [
        ("POST", "/v1/limit", one),
        ("POST", "/v1/reset", one),
        ("POST", "/v1/transaction", transaction),
        ("POST", "/v1/adjust", r#"{"name":"small","key":"k","count":-1}"#),
        ("GET", "/v1/stats", ""),
        ("GET", "/metrics", ""),
        ("POST", "/json", "{}"),
    ] {
        let r = send(&app, call(method, path, "r3ad", body)).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}");
        let error = r.body["error"].as_str().unwrap();
        assert!(error.starts_with("a read token may call /v1/value, /v1/check"), "{error}");
    }
    // Nothing was taken by the refused writes: the full token finds all three tokens.
    let r = send(&app, call("POST", "/v1/value", "s3cret", one)).await;
    assert_eq!(r.body["value"], json!(3));
    for _ in 0..3 {
        let r = send(&app, call("POST", "/v1/limit", "s3cret", one)).await;
        assert_eq!(r.body["ok"], json!(true));
    }
    let r = send(&app, call("POST", "/v1/check", "r3ad", one)).await;
    assert_eq!(r.body["ok"], json!(false));
    assert_eq!(send(&app, call("POST", "/v1/value", "wrong", one)).await.status, 401);
}

/// ... unless `publicMetrics = true`; and a server without tokens has it open.
#[tokio::test]
async fn public_metrics_need_no_token() {
    let limiter = RateLimiter::builder(Arc::new(MemoryStore::new()) as DynStore).build();
    let public = serve(limiter, full(&["s3cret"]), Permissions::default(), true);
    assert_eq!(get(&public, "/metrics").await.status, StatusCode::OK);
    assert_eq!(get(&public, "/v1/config").await.status, StatusCode::UNAUTHORIZED);
    // Its document says so.
    let doc = get(&public, "/openapi.json").await.body;
    let metrics = &doc["paths"]["/metrics"]["get"];
    assert_eq!((&metrics["security"], &metrics["responses"]["401"]), (&json!([]), &Value::Null));
    assert_eq!(doc["paths"]["/v1/config"]["get"]["security"], json!([{ "bearer": [] }]));
    let (open, _) = app();
    assert_eq!(get(&open, "/metrics").await.status, StatusCode::OK);
}

/// A body whose declared length (`Content-Length`) is over 64 KiB is refused at once, none
/// of it read: the request below would otherwise wait for a body that never comes.
#[tokio::test]
async fn a_declared_length_over_the_limit_is_413_at_once() {
    /// A body that never sends anything.
    struct Never;
    impl axum::body::HttpBody for Never {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            std::task::Poll::Pending
        }
    }
    let (app, _) = app();
    for path in ["/v1/limit", "/v1/transaction", "/v1/reset"] {
        let request = Request::post(path)
            .header("content-length", "100000")
            .header("expect", "100-continue")
            .body(Body::new(Never))
            .unwrap();
        let r = tokio::time::timeout(std::time::Duration::from_secs(2), send(&app, request))
            .await
            .expect("answered at once");
        assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        assert_eq!(r.header("connection"), Some("close"));
        assert_eq!(r.body["error"], "request body is 100000 bytes; the most is 65536");
    }
}

/// An empty name is a 400, with a config or without (not a 404 of the limit "").
#[tokio::test]
async fn an_empty_name_is_400() {
    let (app, _) = app();
    for body in
        [r#"{"name":""}"#, r#"{"name":"","config":{"kind":"token bucket","rate":1,"period":1000}}"#]
    {
        for path in ["/v1/limit", "/v1/check", "/v1/value", "/v1/reset"] {
            let r = post(&app, path, body).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} {body}");
            assert_eq!(r.body["error"], "Rate limit name must not be empty.", "{path} {body}");
        }
    }
    let r = post(&app, "/v1/transaction", r#"{"limits":[{"name":"example"},{"name":""}]}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

/// A transaction whose takes of one limit and key add up past its capacity is the 400 of
/// a count past it, not a refusal with a wait that never helps.
#[tokio::test]
async fn a_transaction_that_can_never_fit_is_400() {
    let (app, _) = app();
    let limits: Vec<Value> = (0..4).map(|_| json!({ "name": "example", "key": "a" })).collect();
    let r = post(&app, "/v1/transaction", json!({ "limits": limits }).to_string()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.body["error"],
        "Rate limit example count 4 exceeds 3: a transaction's takes of one key add up."
    );
    // Nothing taken: three still fit.
    let limits: Vec<Value> = (0..3).map(|_| json!({ "name": "example", "key": "a" })).collect();
    let r = post(&app, "/v1/transaction", json!({ "limits": limits }).to_string()).await;
    assert_eq!(r.body["ok"], true);
}

/// The header fields of a transaction of many limits list the tightest few, bounded in
/// size (a 64 KiB request could otherwise make 100 KB of them, which proxies reject).
#[tokio::test]
async fn the_header_fields_of_many_limits_are_bounded() {
    let (app, _) = app();
    let config = json!({ "kind": "token bucket", "rate": 10, "period": "1m" });
    let mut limits: Vec<Value> =
        (0..500).map(|i| json!({ "name": format!("many{i:03}"), "config": config })).collect();
    // One of them nearly spent.
    limits[250]["count"] = json!(9);
    let r = post(&app, "/v1/transaction", json!({ "limits": limits }).to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    let (policy, current) = (r.header("ratelimit-policy").unwrap(), r.header("ratelimit").unwrap());
    assert!(policy.len() <= 1024 && current.len() <= 1024, "{policy}\n{current}");
    assert_eq!(current.split(", ").count(), 8, "{current}");
    assert!(current.contains("\"many250\";r=1;"), "{current}");
}

#[tokio::test]
async fn a_failing_store_is_503() {
    let app =
        app_with(Arc::new(Unavailable::new("connection refused")), &[], Permissions::default());
    for path in ["/v1/limit", "/v1/check", "/v1/value", "/v1/reset"] {
        let r = post(&app, path, r#"{"name":"example"}"#).await;
        assert_eq!(
            (r.status, r.body),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "error": "rate limit store: connection refused", "mayHaveTaken": false })
            ),
            "{path}"
        );
    }
    assert_eq!(get(&app, "/healthz").await.status, StatusCode::SERVICE_UNAVAILABLE);
    let m = get(&app, "/metrics").await.body;
    assert!(m.as_str().unwrap().contains("tollgate_store_errors_total 4"), "{m}");
}

#[tokio::test]
async fn metrics_and_openapi() {
    let (app, _) = app();
    post(&app, "/v1/limit", r#"{"name":"example","count":3}"#).await;
    post(&app, "/v1/limit", r#"{"name":"example"}"#).await;
    post(&app, "/v1/limit", r#"{"name":"nope"}"#).await;
    let m = get(&app, "/metrics").await;
    let text = m.body.as_str().unwrap();
    for line in [
        "tollgate_requests_total{op=\"limit\",outcome=\"ok\",protocol=\"http\"} 1",
        "tollgate_requests_total{op=\"limit\",outcome=\"refused\",protocol=\"http\"} 1",
        "tollgate_requests_total{op=\"limit\",outcome=\"not_defined\",protocol=\"http\"} 1",
        "tollgate_request_duration_seconds_count{op=\"limit\",protocol=\"http\"} 3",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    let doc = get(&app, "/openapi.json").await.body;
    assert_eq!(doc["openapi"], json!("3.0.3"));
    for path in [
        "/v1/limit",
        "/v1/check",
        "/v1/transaction",
        "/v1/reset",
        "/v1/value",
        "/v1/adjust",
        "/v1/time",
        "/v1/config",
        "/healthz",
        "/metrics",
    ] {
        assert!(doc["paths"][path].is_object(), "{path}");
    }
    // This server has no tokens: its document asks for none, and never answers 401.
    let limit = &doc["paths"]["/v1/limit"]["post"];
    assert_eq!((&limit["security"], &limit["responses"]["401"]), (&json!([]), &Value::Null));
    let guarded = app_with(Arc::new(MemoryStore::new()), &["s3cret"], Permissions::default());
    let doc = get(&guarded, "/openapi.json").await.body;
    let limit = &doc["paths"]["/v1/limit"]["post"];
    assert_eq!(limit["security"], json!([{ "bearer": [] }]));
    assert!(limit["responses"]["401"].is_object());
    assert_eq!(doc["paths"]["/healthz"]["get"]["security"], json!([]), "open with tokens too");
    assert_eq!(doc["paths"]["/metrics"]["get"]["security"], json!([{ "bearer": [] }]));
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], json!("bearer"));
}

/// `failOpen = true` in a `[limits.*]` table: that limit is granted while the store is down
/// (here a Redis on a loopback port where nothing listens), the others still fail closed,
/// and `/metrics` counts the requests that failed open.
#[tokio::test]
async fn a_limit_can_fail_open() {
    use tollgate_server::config::{FileConfig, Overrides};
    let file = FileConfig::parse(
        r#"
        [server]
        store = "redis://127.0.0.1:1"

        [limits.search]
        kind = "token bucket"
        rate = 100
        period = "1m"
        failOpen = true

        [limits.signup]
        kind = "token bucket"
        rate = 3
        period = "1h"
        "#,
    )
    .unwrap();
    let settings = file.settings(&Overrides::default(), true).unwrap();
    assert_eq!(settings.fail_open, vec!["search".to_string()]);
    let (state, _) = tollgate_server::app(&settings).await.unwrap();
    let app = router(state);
    let r = post(&app, "/v1/limit", r#"{"name":"search","key":"alice"}"#).await;
    // No header fields: nothing is known of the limit while the store is down (they once
    // claimed a full bucket).
    assert_eq!(r.headers.get("ratelimit"), None, "{:?}", r.headers);
    assert_eq!((r.status, r.body), (StatusCode::OK, json!({ "ok": true })));
    let r = post(&app, "/v1/transaction", r#"{"limits":[{"name":"search","key":"alice"}]}"#).await;
    assert_eq!((r.status, &r.body["ok"]), (StatusCode::OK, &json!(true)), "{}", r.body);
    assert_eq!(r.headers.get("ratelimit"), None, "{:?}", r.headers);
    let r = post(&app, "/v1/limit", r#"{"name":"signup","key":"alice"}"#).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    let m = get(&app, "/metrics").await.body;
    assert!(m.as_str().unwrap().contains("tollgate_failed_open_total 2"), "{m}");

    // Anything but true or false is refused, naming the field.
    let err = FileConfig::parse(
        "[limits.x]\nkind = \"token bucket\"\nrate = 1\nperiod = 1000\nfailOpen = \"yes\"\n",
    )
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("failOpen is \"yes\"; it must be true or false"),
        "{err:#}"
    );
    // Unknown fields are still refused.
    let err = FileConfig::parse(
        "[limits.x]\nkind = \"token bucket\"\nrate = 1\nperiod = 1000\nfailopen = true\n",
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("failopen"), "{err:#}");
}

/// The dashboard's data: per name, what limit and transaction requests took, in the bucket
/// under way; every defined limit listed with its config in words; checks not counted.
#[tokio::test]
async fn stats_count_what_requests_took() {
    let (app, _) = app();
    for _ in 0..3 {
        post(&app, "/v1/limit", r#"{"name":"example","key":"a"}"#).await;
    }
    post(&app, "/v1/limit", r#"{"name":"example","key":"a"}"#).await;
    post(&app, "/v1/limit", r#"{"name":"example","key":"b","count":3}"#).await;
    post(&app, "/v1/limit", r#"{"name":"example","key":"b","count":3,"reserve":true}"#).await;
    post(&app, "/v1/check", r#"{"name":"example","key":"c"}"#).await;
    // A transaction refused by small: only small's refusal counts (example took nothing).
    post(&app, "/v1/limit", r#"{"name":"small","key":"t","count":3}"#).await;
    let t = r#"{"limits":[{"name":"example","key":"t"},{"name":"small","key":"t"}]}"#;
    assert_eq!(post(&app, "/v1/transaction", t).await.body["ok"], json!(false));
    let inline = r#"{"name":"adhoc","config":{"kind":"token bucket","rate":1,"period":1000}}"#;
    post(&app, "/v1/limit", inline).await;
    let stats = get(&app, "/v1/stats").await;
    assert_eq!(stats.status, StatusCode::OK);
    assert_eq!(stats.body["bucketMs"], json!(10_000));
    let limits = stats.body["limits"].as_array().unwrap();
    let names: Vec<&str> = limits.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["example", "small", "adhoc"]);
    let sum = |l: &serde_json::Value, kind: &str| -> u64 {
        l[kind].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).sum()
    };
    let totals = |l: &serde_json::Value| (sum(l, "granted"), sum(l, "refused"), sum(l, "reserved"));
    assert_eq!(limits[0]["words"], json!("token bucket: 10 a minute, bursts of 3"));
    assert_eq!(limits[0]["granted"].as_array().unwrap().len(), 60);
    assert_eq!(totals(&limits[0]), (4, 1, 1));
    assert_eq!(totals(&limits[1]), (1, 1, 0));
    assert_eq!(totals(&limits[2]), (1, 0, 0));
    assert_eq!(limits[2]["config"], serde_json::Value::Null);
    let page = get(&app, "/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.header("content-type"), Some("text/html; charset=utf-8"));
}

/// `/v1/stats` answers a page at a time: at most 1,000 limits (the default page), from an
/// offset, with how many there are in all; a bad parameter is a 400.
#[tokio::test]
async fn stats_are_answered_a_page_at_a_time() {
    let mut builder = RateLimiter::builder(Arc::new(MemoryStore::new()) as DynStore);
    for i in 0..2_500 {
        builder = builder.define(format!("l{i:04}"), Config::token_bucket(1.0, MINUTE));
    }
    let app = serve(builder.build(), full(&[]), Permissions::default(), false);
    post(
        &app,
        "/v1/limit",
        r#"{"name":"zz","config":{"kind":"token bucket","rate":1,"period":1000}}"#,
    )
    .await;
    let names = |reply: &Reply| -> Vec<String> {
        let limits = reply.body["limits"].as_array().unwrap();
        limits.iter().map(|l| l["name"].as_str().unwrap().to_owned()).collect()
    };
    let first = get(&app, "/v1/stats").await;
    assert_eq!(
        (first.body["total"].clone(), first.body["offset"].clone()),
        (json!(2_501), json!(0))
    );
    assert_eq!(names(&first).len(), 1_000);
    assert_eq!(names(&first)[0], "l0000");
    let last = get(&app, "/v1/stats?offset=2000&limit=1000").await;
    let last = names(&last);
    assert_eq!((last.len(), last[0].as_str(), last[500].as_str()), (501, "l2000", "zz"));
    assert_eq!(names(&get(&app, "/v1/stats?limit=5000&offset=10").await).len(), 1_000);
    assert_eq!(names(&get(&app, "/v1/stats?limit=3").await), ["l0000", "l0001", "l0002"]);
    assert!(names(&get(&app, "/v1/stats?offset=9999").await).is_empty());
    let too_far = "/v1/stats?offset=9007199254740992";
    for bad in ["/v1/stats?offset=-1", "/v1/stats?limit=x", "/v1/stats?page=2", too_far] {
        assert_eq!(get(&app, bad).await.status, StatusCode::BAD_REQUEST, "{bad}");
    }
}

/// A request with these headers (`Host`, `Origin`, ...).
fn request_with(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

/// A web page of another site cannot use the API of a server it can reach: a `text/plain`
/// POST (no CORS preflight) with an `Origin` that is neither the server's own nor one of
/// `corsOrigins` is refused with 403 and takes nothing; the server's own pages (the
/// dashboard), an allowed origin (with the CORS fields, and its preflight answered), and
/// clients that send no `Origin` are served.
#[tokio::test]
async fn requests_of_web_pages_of_other_origins_are_refused() {
    let (app, _) = app();
    let host = ("host", "127.0.0.1:8787");
    post(&app, "/v1/limit", r#"{"name":"example","key":"alice"}"#).await;
    let reset = r#"{"name":"example","key":"alice"}"#;
    let evil = [host, ("origin", "http://evil.example"), ("content-type", "text/plain")];
    let r = send(&app, request_with("POST", "/v1/reset", &evil, reset)).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(r.body["error"].as_str().unwrap().contains("corsOrigins"), "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), None);
    let r = send(&app, request_with("POST", "/v1/limit", &evil, reset)).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // Nothing was reset, nor taken: alice has 2 of 3 left.
    let r = post(&app, "/v1/value", r#"{"name":"example","key":"alice"}"#).await;
    assert_eq!(r.body["value"], 2);
    // The server's own page, over http or https (behind a proxy).
    for origin in ["http://127.0.0.1:8787", "https://127.0.0.1:8787"] {
        let own = [host, ("origin", origin), ("content-type", "application/json")];
        let r = send(&app, request_with("POST", "/v1/check", &own, reset)).await;
        assert_eq!(r.status, StatusCode::OK, "{origin}");
        assert_eq!(r.header("access-control-allow-origin"), None);
    }
    // An origin of corsOrigins: served, with the CORS fields; its preflight answered.
    let allowed = [host, ("origin", "https://app.example")];
    let r = send(&app, request_with("POST", "/v1/check", &allowed, reset)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("access-control-allow-origin"), Some("https://app.example"));
    assert_eq!(r.header("vary"), Some("Origin"));
    assert!(r.header("access-control-expose-headers").unwrap().contains("Retry-After"));
    let preflight =
        [host, ("origin", "https://app.example"), ("access-control-request-method", "POST")];
    let r = send(&app, request_with("OPTIONS", "/v1/limit", &preflight, "")).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(r.header("access-control-allow-methods"), Some("GET, POST"));
    assert_eq!(r.header("access-control-allow-headers"), Some("authorization, content-type"));
    let preflight =
        [host, ("origin", "http://evil.example"), ("access-control-request-method", "POST")];
    let r = send(&app, request_with("OPTIONS", "/v1/limit", &preflight, "")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // curl, the CLI, the clients: no Origin.
    let r = send(&app, request_with("POST", "/v1/reset", &[host], reset)).await;
    assert_eq!(r.status, StatusCode::OK);
}

/// DNS rebinding: a page of the attacker's name, resolved to loopback, sends its requests
/// with that name in `Host`. A server without tokens answers only a `Host` that names it
/// (loopback names and addresses, its listen address); one with tokens checks the token.
#[tokio::test]
async fn a_host_that_does_not_name_a_server_without_tokens_is_refused() {
    let (app, _) = app();
    let rebound = [("host", "rebind.attacker.example:8787")];
    for path in ["/v1/config", "/metrics", "/healthz", "/"] {
        let r = send(&app, request_with("GET", path, &rebound, "")).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}");
    }
    let r = send(&app, request_with("POST", "/v1/value", &rebound, r#"{"name":"example"}"#)).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(r.body["error"].as_str().unwrap().contains("allowedHosts"), "{}", r.body);
    for host in ["127.0.0.1:8787", "localhost:8787", "[::1]:8787", "127.0.0.53"] {
        let r = send(&app, request_with("GET", "/v1/config", &[("host", host)], "")).await;
        assert_eq!(r.status, StatusCode::OK, "{host}");
    }
    // With tokens, the token decides.
    let tokens = app_with(Arc::new(MemoryStore::new()), &["s3cret"], Permissions::default());
    let r = send(&tokens, request_with("GET", "/v1/config", &rebound, "")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let with_token = [rebound[0], ("authorization", "Bearer s3cret")];
    let r = send(&tokens, request_with("GET", "/v1/config", &with_token, "")).await;
    assert_eq!(r.status, StatusCode::OK);
}
