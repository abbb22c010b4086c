//! Over real sockets: exactness with concurrent clients, and consumption that survives a
//! restart of the binary, including `kill -9`.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tollgate::{Config, DAY};
use tollgate_server::config::Settings;

fn settings(store: String) -> Settings {
    Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        store,
        tokens: Vec::new(),
        allow_inline_config: true,
        limits: vec![("race".into(), Config::token_bucket(100.0, DAY))],
    }
}

/// Serves `settings` in this process on a free loopback port.
fn serve_in_process(settings: &Settings) -> SocketAddr {
    let (app, _) = tollgate_server::app(settings).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let router = tollgate_server::http::router(app);
    std::thread::spawn(move || {
        runtime.block_on(async move { axum::serve(listener, router).await })
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
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
