//! Over real sockets: exactness with concurrent clients, and consumption that survives a
//! restart of the binary, including `kill -9`.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tollgate::{Config, DAY};
use tollgate_server::config::Settings;

use common::{backend, free_port};

fn settings(store: String) -> Settings {
    Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        store,
        tokens: Vec::new(),
        read_tokens: Vec::new(),
        allow_inline_config: true,
        allow_config_override: false,
        max_keys: None,
        store_deadline: std::time::Duration::from_millis(250),
        http: tollgate_server::config::HttpLimits::default(),
        rls_listen: None,
        rls_config: None,
        resp_listen: None,
        resp_throttle_name: "cl.throttle".into(),
        resp_idle_timeout: std::time::Duration::from_secs(300),
        resp_max_period: tollgate_server::config::DEFAULT_RESP_MAX_PERIOD,
        cors_origins: Vec::new(),
        allowed_hosts: Vec::new(),
        public_metrics: false,
        limits: vec![("race".into(), Config::token_bucket(100.0, DAY))],
        concurrency: Vec::new(),
        fail_open: Vec::new(),
        lease: Vec::new(),
    }
}

/// Serves `settings` in this process on a free loopback port.
fn serve_in_process(settings: &Settings) -> SocketAddr {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (app, _) = runtime.block_on(tollgate_server::app(settings)).unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let router = tollgate_server::http::router(app);
    let errors = std::sync::Arc::default();
    let limits = settings.http;
    std::thread::spawn(move || {
        runtime.block_on(tollgate_server::serve_http(
            listener,
            router,
            limits,
            errors,
            std::future::pending(),
        ))
    });
    addr
}

fn post(agent: &ureq::Agent, addr: SocketAddr, path: &str, body: &Value) -> Value {
    let mut r = agent.post(&format!("http://{addr}{path}")).send_json(body).unwrap();
    r.body_mut().read_json().unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

fn race(addr: SocketAddr) -> usize {
    let threads: Vec<_> = (0..32)
        .map(|_| {
            std::thread::spawn(move || {
                let agent = agent();
                (0..10)
                    .filter(|_| {
                        post(&agent, addr, "/v1/limit", &json!({ "name": "race" }))["ok"]
                            == json!(true)
                    })
                    .count()
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).sum()
}

#[test]
fn thirty_two_clients_admit_exactly_the_limit_memory() {
    let addr = serve_in_process(&settings("memory".into()));
    assert_eq!(race(addr), 100);
}

#[test]
fn thirty_two_clients_admit_exactly_the_limit_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let addr =
        serve_in_process(&settings(format!("sqlite://{}", dir.path().join("race.db").display())));
    assert_eq!(race(addr), 100);
}

/// 32 clients x 10 requests against an inline limit of 100 of this run's own.
fn race_inline(addr: SocketAddr) -> usize {
    let name = format!("race-{}", std::process::id());
    let body =
        json!({ "name": name, "config": { "kind": "token bucket", "rate": 100, "period": "1d" } });
    let threads: Vec<_> = (0..32)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                let agent = agent();
                (0..10)
                    .filter(|_| post(&agent, addr, "/v1/limit", &body)["ok"] == json!(true))
                    .count()
            })
        })
        .collect();
    let admitted = threads.into_iter().map(|t| t.join().unwrap()).sum();
    // Leave no state behind on a shared server (a Redis state would live for a day).
    assert_eq!(post(&agent(), addr, "/v1/reset", &body), json!({}));
    admitted
}

#[test]
fn thirty_two_clients_admit_exactly_the_limit_postgres() {
    let Some(url) = backend("TOLLGATE_POSTGRES_URL") else { return };
    let addr = serve_in_process(&settings(url.clone()));
    assert_eq!(race_inline(addr), 100);
    let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    client
        .execute(
            "DELETE FROM tollgate_state WHERE name = $1",
            &[&format!("race-{}", std::process::id())],
        )
        .unwrap();
}

#[test]
fn thirty_two_clients_admit_exactly_the_limit_redis() {
    let Some(url) = backend("TOLLGATE_REDIS_URL") else { return };
    let addr = serve_in_process(&settings(url));
    assert_eq!(race_inline(addr), 100);
}

#[test]
fn thirty_two_clients_admit_exactly_the_limit_redis_cluster() {
    let Some(url) = backend("TOLLGATE_REDIS_CLUSTER_URL") else { return };
    let addr = serve_in_process(&settings(url));
    assert_eq!(race_inline(addr), 100);
}

/// Starts the binary and waits until it answers /healthz.
fn start_binary(store: &str, config: &std::path::Path, port: u16) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--store", store, "--listen", &format!("127.0.0.1:{port}"), "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let agent = agent();
    while agent.get(&format!("http://127.0.0.1:{port}/healthz")).call().is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn consumption_survives_kill_9_and_a_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(
        &config,
        "[limits.daily]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1d\"\n",
    )
    .unwrap();
    let store = format!("sqlite://{}", dir.path().join("state.db").display());
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let agent = Arc::new(agent());

    let mut server = start_binary(&store, &config, port);
    let taken =
        post(&agent, addr, "/v1/limit", &json!({ "name": "daily", "key": "k", "count": 7 }));
    assert_eq!(taken, json!({ "ok": true }), "acknowledged");
    server.kill().unwrap(); // SIGKILL: no chance to flush anything more
    server.wait().unwrap();

    let mut server = start_binary(&store, &config, port);
    let value = post(&agent, addr, "/v1/value", &json!({ "name": "daily", "key": "k" }))["value"]
        .as_f64()
        .unwrap();
    assert!((3.0..3.01).contains(&value), "still consumed after kill -9: {value}");
    post(&agent, addr, "/v1/limit", &json!({ "name": "daily", "key": "k", "count": 2 }));
    // SIGTERM: a graceful stop, exit code 0.
    let pid = server.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(server.wait().unwrap().success(), "graceful shutdown exits 0");

    let mut server = start_binary(&store, &config, port);
    let value = post(&agent, addr, "/v1/value", &json!({ "name": "daily", "key": "k" }))["value"]
        .as_f64()
        .unwrap();
    assert!((1.0..1.01).contains(&value), "still consumed after SIGTERM: {value}");
    server.kill().unwrap();
    server.wait().unwrap();
}

fn client(addr: SocketAddr, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .args(["--server", &format!("http://{addr}"), "--token", "t0ken"])
        .output()
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap().trim_end().to_owned();
    (out.status.code().unwrap(), text(out.stdout), text(out.stderr))
}

#[test]
fn client_commands_talk_to_a_server() {
    let mut settings = settings("memory".into());
    settings.tokens = vec!["t0ken".into()];
    settings.limits = vec![("one".into(), Config::token_bucket(1.0, 60_000.0))];
    let addr = serve_in_process(&settings);
    assert_eq!(client(addr, &["check", "one", "--key", "k"]), (0, "granted".into(), String::new()));
    assert_eq!(client(addr, &["limit", "one", "--key", "k"]), (0, "granted".into(), String::new()));
    let (code, out, _) = client(addr, &["limit", "one", "--key", "k"]);
    assert_eq!(code, 1, "refused");
    assert!(out.starts_with("refused: retry in 59."), "{out}");
    let (code, out, _) = client(addr, &["limit", "one", "--key", "k", "--reserve"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("granted (reserved): do the work in"), "{out}");
    let (code, out, _) = client(addr, &["value", "one", "--key", "k", "--json"]);
    assert_eq!(code, 0);
    let value: Value = serde_json::from_str(&out).unwrap();
    assert!(value["value"].as_f64().unwrap() < -0.9, "{out}");
    assert_eq!(client(addr, &["reset", "one", "--key", "k"]), (0, "reset".into(), String::new()));
    assert_eq!(client(addr, &["limit", "one", "--key", "k"]).0, 0, "fresh after reset");
    let (code, _, err) = client(addr, &["limit", "nope"]);
    assert_eq!(code, 2);
    assert!(err.starts_with("error (404): Rate limit nope not defined."), "{err}");
    let (code, _, err) = client(addr, &["reset", "one", "--count", "2"]);
    assert_eq!(
        (code, err.as_str()),
        (2, "tollgate: --count and --reserve apply to limit and check only")
    );
    // A wrong token is an error, not a refusal.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["limit", "one", "--server", &format!("http://{addr}"), "--token", "wrong"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error (401): wrong bearer token"));
}

#[test]
fn refuses_a_public_address_without_tokens() {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--store", "memory", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("refusing to listen on 0.0.0.0:0 without tokens"), "{err}");
}
