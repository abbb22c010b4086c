//! Concurrency limits over HTTP (SPEC §6f): `POST /v1/acquire|release|renew`, and `check`,
//! `value` and `reset` of a concurrency limit's name, with exact numbers on a stopped clock;
//! the config file's `kind = "concurrency"`; the simulator's lines; a read token refused.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tollgate::{Concurrency, Config, MINUTE, ManualClock, MemoryStore, RateLimiter};
use tollgate_server::auth::Tokens;
use tollgate_server::browsers::BrowserRules;
use tollgate_server::engine::{Engine, Permissions};
use tollgate_server::http::{App, Service, router};
use tollgate_server::store::DynStore;
use tower::ServiceExt;

const T0: f64 = 1_700_000_000_000.0;

/// A time after `T0`, as the JSON answers write it (a whole number).
fn at(ms: f64) -> Value {
    json!((T0 + ms) as u64)
}

fn app(tokens: Tokens) -> (Service, ManualClock) {
    let clock = ManualClock::new(T0);
    let store: DynStore = Arc::new(MemoryStore::with_clock(clock.clone()));
    let limiter = RateLimiter::builder(store)
        .define("api", Config::token_bucket(10.0, MINUTE))
        .define_concurrency("gpu", Concurrency::new(3).with_ttl(10_000.0))
        .build();
    let required = tokens.required();
    let app = router(Arc::new(App {
        engine: Arc::new(Engine::new(limiter, Permissions::default())),
        tokens,
        metrics: Arc::default(),
        memory: None,
        breaker: None,
        leases: None,
        health_deadline: std::time::Duration::from_millis(250),
        errors: Arc::default(),
        accept_errors: Arc::default(),
        body_timeout: std::time::Duration::from_secs(10),
        sqlite_states: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
        rls: None,
        browsers: BrowserRules::new(required, "127.0.0.1:8787".parse().unwrap(), &[], &[]).shared(),
        public_metrics: false,
        sqlite: None,
        live: Arc::default(),
    }));
    (app, clock)
}

struct Reply {
    status: StatusCode,
    retry_after: Option<String>,
    body: Value,
}

async fn post(app: &Service, path: &str, body: Value, token: Option<&str>) -> Reply {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = app.clone().oneshot(request.body(Body::from(body.to_string())).unwrap());
    let response = response.await.unwrap();
    let status = response.status();
    let retry_after =
        response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Reply { status, retry_after, body: serde_json::from_slice(&bytes).unwrap_or(Value::Null) }
}

#[tokio::test]
async fn acquire_release_renew_check_value_reset() {
    let (app, clock) = app(Tokens::default());
    let acquire = |body: Value| post(&app, "/v1/acquire", body, None);
    let one = acquire(json!({ "name": "gpu", "key": "t1" })).await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(one.body["ok"], json!(true));
    assert_eq!(one.body["expiresAt"], at(10_000.0));
    let ticket = one.body["ticket"].as_str().expect("a ticket string").to_string();
    clock.advance(1_000.0);
    let two = acquire(json!({ "name": "gpu", "key": "t1", "count": 2, "ttl": 4_000 })).await;
    assert_eq!((two.body["ok"].clone(), two.body["expiresAt"].clone()), (json!(true), at(5_000.0)));
    // Full: refused until the earliest expiry (T0 + 5 s), with Retry-After in whole seconds.
    let refused = acquire(json!({ "name": "gpu", "key": "t1" })).await;
    assert_eq!(
        (refused.status, &refused.body),
        (StatusCode::OK, &json!({ "ok": false, "retryAfter": 4_000 }))
    );
    assert_eq!(refused.retry_after.as_deref(), Some("4"));
    let thrown = acquire(json!({ "name": "gpu", "key": "t1", "throws": true })).await;
    assert_eq!(thrown.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(thrown.body, json!({ "kind": "RateLimited", "name": "gpu", "retryAfter": 4_000 }));
    let check = post(&app, "/v1/check", json!({ "name": "gpu", "key": "t1" }), None).await;
    assert_eq!(check.body, json!({ "ok": false, "retryAfter": 4_000 }));
    let value = post(&app, "/v1/value", json!({ "name": "gpu", "key": "t1" }), None).await;
    assert_eq!(value.body, json!({ "inFlight": 3, "max": 3, "holders": 2 }));
    // Renew the first; release it twice (true, then false); the ticket as a number too.
    let renewed = post(
        &app,
        "/v1/renew",
        json!({ "name": "gpu", "key": "t1", "ticket": ticket, "ttl": 20_000 }),
        None,
    )
    .await;
    assert_eq!(renewed.body, json!({ "ok": true, "expiresAt": at(21_000.0) }));
    let number: u64 = ticket.parse().unwrap();
    let release = json!({ "name": "gpu", "key": "t1", "ticket": number });
    let released = post(&app, "/v1/release", release.clone(), None).await;
    assert_eq!(released.body, json!({ "released": true }));
    let again = post(&app, "/v1/release", release, None).await;
    assert_eq!(again.body, json!({ "released": false }));
    // The second expires at T0 + 5 s: renewing it then says so.
    clock.set(T0 + 5_000.0);
    let late = post(
        &app,
        "/v1/renew",
        json!({ "name": "gpu", "key": "t1", "ticket": two.body["ticket"] }),
        None,
    )
    .await;
    assert_eq!(late.body, json!({ "ok": false }));
    let check =
        post(&app, "/v1/check", json!({ "name": "gpu", "key": "t1", "count": 3 }), None).await;
    assert_eq!(check.body, json!({ "ok": true }));
    // Reset frees every slot of the key.
    acquire(json!({ "name": "gpu", "key": "t1", "count": 3 })).await;
    let reset = post(&app, "/v1/reset", json!({ "name": "gpu", "key": "t1" }), None).await;
    assert_eq!(reset.status, StatusCode::OK);
    let value = post(&app, "/v1/value", json!({ "name": "gpu", "key": "t1" }), None).await;
    assert_eq!(value.body, json!({ "inFlight": 0, "max": 3, "holders": 0 }));
}

#[tokio::test]
async fn the_config_shows_concurrency_limits() {
    let (app, _) = app(Tokens::default());
    let response = app.clone().oneshot(Request::get("/v1/config").body(Body::empty()).unwrap());
    let bytes = response.await.unwrap().into_body().collect().await.unwrap().to_bytes();
    let config: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(config["gpu"], json!({ "kind": "concurrency", "max": 3, "ttl": 10_000 }));
    assert_eq!(config["api"]["kind"], json!("token bucket"));
}

#[tokio::test]
async fn bad_requests_hold_nothing() {
    let (app, _) = app(Tokens::default());
    for (path, body, status, says) in [
        ("/v1/acquire", json!({ "name": "gpu", "count": 4 }), 400, "max of 3"),
        ("/v1/acquire", json!({ "name": "gpu", "count": 0 }), 400, "count is 0"),
        ("/v1/acquire", json!({ "name": "gpu", "count": 1.5 }), 400, "whole number"),
        ("/v1/acquire", json!({ "name": "gpu", "ttl": 0 }), 400, "ttl is 0"),
        ("/v1/acquire", json!({ "name": "gpu", "reserve": true }), 400, "unknown field"),
        ("/v1/acquire", json!({ "name": "api" }), 400, "is a rate limit"),
        ("/v1/acquire", json!({ "name": "nope" }), 404, "not defined"),
        ("/v1/release", json!({ "name": "gpu", "ticket": "x1" }), 400, "ticket"),
        ("/v1/release", json!({ "name": "gpu", "ticket": -1 }), 400, "ticket"),
        ("/v1/release", json!({ "name": "gpu" }), 400, "ticket"),
        ("/v1/release", json!({ "name": "gpu", "ticket": "1", "ttl": 5 }), 400, "takes none"),
        ("/v1/limit", json!({ "name": "gpu" }), 400, "/v1/acquire"),
        ("/v1/check", json!({ "name": "gpu", "count": 9 }), 400, "max of 3"),
        (
            "/v1/value",
            json!({ "name": "gpu", "config": { "kind": "token bucket", "rate": 1, "period": 1000 } }),
            400,
            "send no config",
        ),
    ] {
        let reply = post(&app, path, body.clone(), None).await;
        assert_eq!(reply.status.as_u16(), status, "{path} {body}: {}", reply.body);
        let error = reply.body["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{path} {body}: {error}");
    }
    let value = post(&app, "/v1/value", json!({ "name": "gpu" }), None).await;
    assert_eq!(value.body, json!({ "inFlight": 0, "max": 3, "holders": 0 }));
}

#[tokio::test]
async fn read_tokens_may_check_but_not_acquire() {
    let tokens = Tokens { full: vec!["full-token".into()], read: vec!["read-token".into()] };
    let (app, _) = app(tokens);
    for path in ["/v1/acquire", "/v1/release", "/v1/renew"] {
        let body = json!({ "name": "gpu", "ticket": "1" });
        let reply = post(&app, path, body, Some("read-token")).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "{path}: {}", reply.body);
    }
    let check = post(&app, "/v1/check", json!({ "name": "gpu" }), Some("read-token")).await;
    assert_eq!(check.body, json!({ "ok": true }));
    let acquired = post(&app, "/v1/acquire", json!({ "name": "gpu" }), Some("full-token")).await;
    assert_eq!(acquired.body["ok"], json!(true));
}

/// The config file's `kind = "concurrency"`, its defaults and its errors.
#[test]
fn config_files_define_concurrency_limits() {
    use tollgate_server::config::{FileConfig, Overrides};
    let settings = |limit: &str| {
        let text = format!("[limits.gpu]\n{limit}\n");
        FileConfig::parse(&text).and_then(|file| file.settings(&Overrides::default(), false))
    };
    let s = settings("kind = \"concurrency\"\nmax = 4\nttl = \"30s\"").unwrap();
    assert_eq!(s.concurrency, [("gpu".to_string(), Concurrency::new(4).with_ttl(30_000.0))]);
    assert!(s.limits.is_empty());
    let s = settings("kind = \"concurrency\"\nmax = 2").unwrap();
    assert_eq!(s.concurrency[0].1.ttl(), 60_000.0);
    let error = |limit: &str| format!("{:#}", settings(limit).unwrap_err());
    for (limit, says) in [
        ("kind = \"concurrency\"", "needs max"),
        ("kind = \"concurrency\"\nmax = 0", "max is 0"),
        ("kind = \"concurrency\"\nmax = 2.5", "max is 2.5"),
        ("kind = \"concurrency\"\nmax = 2\nrate = 5", "unknown field `rate`"),
        ("kind = \"concurrency\"\nmax = 2\nttl = \"forever\"", "ttl"),
        ("kind = \"concurrency\"\nmax = 2\nfailOpen = true", "failOpen"),
    ] {
        assert!(error(limit).contains(says), "{limit}: {}", error(limit));
    }
}

/// The simulator's lines (SPEC §7) carry the three operations, on a config's limit.
#[test]
fn the_simulator_acquires_and_releases() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("limits.toml");
    std::fs::write(&config, "[limits.gpu]\nkind = \"concurrency\"\nmax = 1\nttl = 1000\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["simulate", "--config"])
        .arg(&config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = [
        r#"{"at":0,"op":"acquire","name":"gpu"}"#,
        r#"{"at":100,"op":"acquire","name":"gpu"}"#,
        r#"{"at":200,"op":"renew","name":"gpu","ticket":"1","ttl":1000}"#,
        r#"{"at":300,"op":"value","name":"gpu"}"#,
        r#"{"at":1200,"op":"acquire","name":"gpu"}"#,
        r#"{"at":1200,"op":"release","name":"gpu","ticket":"1"}"#,
        r#"{"at":1200,"op":"acquire","name":"gpu"}"#,
    ];
    child.stdin.take().unwrap().write_all(lines.join("\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let answers: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        answers,
        [
            json!({ "ok": true, "ticket": "1", "expiresAt": 1000 }),
            json!({ "ok": false, "retryAfter": 900 }),
            json!({ "ok": true, "expiresAt": 1200 }),
            json!({ "inFlight": 1, "max": 1, "holders": 1 }),
            json!({ "ok": true, "ticket": "2", "expiresAt": 2200 }),
            json!({ "released": false }),
            json!({ "ok": false, "retryAfter": 1000 }),
        ]
    );
}
