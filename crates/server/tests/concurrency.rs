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

mod common;

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
async fn a_transaction_takes_a_slot_and_tokens_all_or_nothing() {
    let (app, clock) = app(Tokens::default());
    let transaction =
        |limits: Value| post(&app, "/v1/transaction", json!({ "limits": limits }), None);
    let value = |name: &str| post(&app, "/v1/value", json!({ "name": name, "key": "t" }), None);
    // Both granted: the slot's result carries its ticket, at its place in the body.
    let both = transaction(json!([
        { "name": "api", "key": "t", "count": 6 },
        { "name": "gpu", "key": "t" },
    ]))
    .await;
    assert_eq!(both.status, StatusCode::OK);
    assert_eq!(both.body["ok"], json!(true));
    assert_eq!(both.body["results"][0], json!({ "ok": true }));
    assert_eq!(both.body["results"][1]["expiresAt"], at(10_000.0));
    assert!(both.body["results"][1]["ticket"].is_string());
    assert_eq!(both.body["ticket"], both.body["results"][1]["ticket"]);
    assert_eq!(both.body["expiresAt"], at(10_000.0));
    assert_eq!(value("gpu").await.body["inFlight"], json!(1));
    assert_eq!(value("api").await.body["value"], json!(4));
    // The tokens refused (2 short: 12 s at 10 a minute): no slot held, 429 fields.
    let short = transaction(json!([
        { "name": "gpu", "key": "t" },
        { "name": "api", "key": "t", "count": 6 },
    ]))
    .await;
    assert_eq!(
        short.body,
        json!({ "ok": false, "retryAfter": 12000, "results": [
            { "ok": true }, { "ok": false, "retryAfter": 12000 }
        ] })
    );
    assert_eq!(short.retry_after.as_deref(), Some("12"));
    assert_eq!(value("gpu").await.body["inFlight"], json!(1));
    // The slots full: refused to their earliest expiry; no token taken.
    clock.advance(1_000.0);
    let fill = json!({ "name": "gpu", "key": "t", "count": 2 });
    assert_eq!(post(&app, "/v1/acquire", fill, None).await.body["ok"], json!(true));
    let full = transaction(json!([
        { "name": "gpu", "key": "t" },
        { "name": "api", "key": "t", "count": 1, "throws": true },
    ]))
    .await;
    assert_eq!(full.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(full.body, json!({ "kind": "RateLimited", "name": "gpu", "retryAfter": 9000 }));
    assert_eq!(value("api").await.body["value"], json!(4));
    // Two concurrency limits, a reserve, a config for one: 400, nothing taken.
    for bad in [
        json!([{ "name": "gpu", "key": "t" }, { "name": "gpu", "key": "u" }]),
        json!([{ "name": "gpu", "key": "u", "reserve": true }]),
        json!([{ "name": "gpu", "key": "u", "count": 0 }, { "name": "api", "key": "t" }]),
    ] {
        let reply = transaction(bad.clone()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}: {}", reply.body);
    }
    let u = post(&app, "/v1/value", json!({ "name": "gpu", "key": "u" }), None).await;
    assert_eq!(u.body["inFlight"], json!(0));
    assert_eq!(value("api").await.body["value"], json!(4));
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

/// SPEC §6f's bound across processes, as the issue asks it: four `tollgate serve` processes
/// on one store, 64 acquirers each (threads) on one (name, key) with `max = 10`, each
/// holding its slot a random 100-200 ms (long beside a store's answer under CI's load: with
/// 20-60 ms, PostgreSQL answering slowly in a full test run left the logged holds short of
/// overlapping, 5 at most), then releasing. Each hold is logged from when its
/// grant was answered to when its release was sent: inside the time the store held it, so
/// a count of overlapping holds over 10 is a certain violation. At no instant are more than
/// 10 held, and the holds did pile up to the bound (else the test would prove nothing).
fn exact_across_processes(store: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    // 256 acquirers of one key queue on its lock (PostgreSQL's advisory lock, SQLite's
    // writer): a request may wait longer than the default 200 ms for the store.
    let text = "[server]\nstoreDeadline = \"10s\"\n\
                [limits.gpu]\nkind = \"concurrency\"\nmax = 10\nttl = \"30s\"\n";
    std::fs::write(&config, text).unwrap();
    let servers: Vec<common::Served> = (0..4)
        .map(|_| {
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
            command.args(["serve", "--listen", "127.0.0.1:0", "--store", store, "--config"]);
            command.arg(&config).current_dir(dir.path());
            common::Served::start(command, false)
        })
        .collect();
    let key = format!(
        "k{}x{}",
        std::process::id(),
        T0 as u64
            ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
                as u64
    );
    let start = std::time::Instant::now();
    let holds = std::sync::Mutex::new(Vec::<(f64, f64)>::new());
    let refused = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for (s, served) in servers.iter().enumerate() {
            for a in 0..64u64 {
                let (holds, refused, key) = (&holds, &refused, key.as_str());
                scope.spawn(move || {
                    let mut seed = (s as u64) << 32 | a;
                    for _ in 0..8 {
                        let body = json!({ "name": "gpu", "key": key });
                        let (status, answer) = served.post("/v1/acquire", &[], &body);
                        assert_eq!(status, 200, "{answer}");
                        if answer["ok"] != json!(true) {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            std::thread::sleep(std::time::Duration::from_millis(5));
                            continue;
                        }
                        let granted = start.elapsed().as_secs_f64();
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let hold = 100 + (seed >> 33) % 101;
                        std::thread::sleep(std::time::Duration::from_millis(hold));
                        let released = start.elapsed().as_secs_f64();
                        let body = json!({ "name": "gpu", "key": key, "ticket": answer["ticket"] });
                        let (status, answer) = served.post("/v1/release", &[], &body);
                        assert_eq!((status, &answer), (200, &json!({ "released": true })));
                        holds.lock().unwrap().push((granted, released));
                    }
                });
            }
        }
    });
    let holds = holds.into_inner().unwrap();
    // The most holds at once: +1 at each grant, -1 at each release (a release first at a tie).
    let mut events: Vec<(f64, i32)> = holds.iter().flat_map(|&(g, r)| [(g, 1), (r, -1)]).collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut most) = (0, 0);
    for (_, step) in events {
        now += step;
        most = most.max(now);
    }
    let refused = refused.into_inner();
    assert!(most <= 10, "{store}: {most} held at once, where max is 10");
    assert!(most >= 8, "{store}: only {most} held at once: the test did not reach the bound");
    assert!(refused > 0, "{store}: nothing refused: the test did not reach the bound");
    let value = servers[0].post("/v1/value", &[], &json!({ "name": "gpu", "key": key })).1;
    assert_eq!(value["inFlight"], json!(0), "{store}: every slot released");
    eprintln!("{store}: {} holds, {refused} refused, at most {most} at once", holds.len());
}

#[test]
fn exact_across_processes_on_sqlite() {
    exact_across_processes("sqlite://slots.db");
}

#[test]
fn exact_across_processes_on_redis() {
    if let Some(url) = common::backend("TOLLGATE_REDIS_URL") {
        exact_across_processes(&url);
    }
}

#[test]
fn exact_across_processes_on_redis_cluster() {
    if let Some(url) = common::backend("TOLLGATE_REDIS_CLUSTER_URL") {
        exact_across_processes(&url);
    }
}

#[test]
fn exact_across_processes_on_postgres() {
    if let Some(url) = common::backend("TOLLGATE_POSTGRES_URL") {
        exact_across_processes(&url);
    }
}

/// `tollgate types --url` declares the server's rate limits only, as `--config` does: a
/// concurrency limit is not a name `limit` takes.
#[test]
fn types_from_a_server_leave_concurrency_limits_out() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    let text = "[limits.api]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1m\"\n\
                [limits.gpu]\nkind = \"concurrency\"\nmax = 2\n";
    std::fs::write(&config, text).unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--config"]);
    command.arg(&config);
    let served = common::Served::start(command, false);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["types", "--url", &format!("http://{}", served.http)])
        .output()
        .unwrap();
    let declaration = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(declaration.contains("\"api\""), "{declaration}");
    assert!(!declaration.contains("\"gpu\""), "{declaration}");
}
