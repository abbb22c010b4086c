//! The shipped binary, as a user runs it, on every store URL: `tollgate serve` in a process
//! of its own on a free loopback port, driven over HTTP. Start, take, refuse, reset, value,
//! SIGTERM, restart; and `kill -9` with a store that outlives the process, which must keep
//! what it acknowledged. (The PostgreSQL store once panicked at start here, inside the
//! server's runtime, while the tests that built the app in-process passed.)

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::backend;

/// A running `tollgate serve`.
struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
}

impl Server {
    /// Starts the binary on `store` with `config` (in `dir`), on a port the system picks,
    /// and waits for its banner and `/healthz`.
    fn start(store: &str, config: &std::path::Path, dir: &std::path::Path) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--store", store, "--listen", "127.0.0.1:0", "--config"])
            .arg(config)
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut banner = String::new();
        out.read_line(&mut banner).unwrap();
        let base = match banner.trim().strip_prefix("tollgate listening on ") {
            Some(base) => base.to_owned(),
            None => {
                let _ = child.kill();
                panic!("{store}: no banner, the server did not start: {banner:?}");
            }
        };
        // The rest of the banner, so that it never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let health = agent.get(&format!("{base}/healthz")).call();
            if health.is_ok_and(|r| r.status() == 200) {
                break;
            }
            assert!(Instant::now() < deadline, "{store}: /healthz did not answer 200");
            std::thread::sleep(Duration::from_millis(50));
        }
        Server { child, base, agent }
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = self.agent.post(&format!("{}{path}", self.base)).send_json(body).unwrap();
        (r.status().as_u16(), r.body_mut().read_json().unwrap_or(Value::Null))
    }

    fn value(&self, name: &str) -> f64 {
        let (status, body) = self.post("/v1/value", &json!({ "name": name, "key": "k" }));
        assert_eq!(status, 200, "{body}");
        body["value"].as_f64().unwrap()
    }

    /// SIGTERM: a graceful stop, which must end with exit code 0.
    fn terminate(mut self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "graceful shutdown exits 0: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "SIGTERM did not stop the server");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`: nothing more is flushed.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// The whole life of a server on `store`: a limit of 3 a day (named for this run, so that
/// runs never meet on a shared Redis or PostgreSQL), taken, refused, read, reset; stopped
/// with SIGTERM and started again; and, if the store outlives the process (`durable`),
/// killed with `kill -9` after an acknowledged take, which the next process still sees.
fn a_servers_life(store: &str, label: &str, durable: bool) {
    let dir = tempfile::tempdir().unwrap();
    let name = format!("bin{label}{}", std::process::id());
    let config = dir.path().join("tollgate.toml");
    let limit = format!("[limits.{name}]\nkind = \"token bucket\"\nrate = 3\nperiod = \"1d\"\n");
    std::fs::write(&config, limit).unwrap();
    let take = |count: u32| json!({ "name": name, "key": "k", "count": count });

    let server = Server::start(store, &config, dir.path());
    for _ in 0..3 {
        assert_eq!(server.post("/v1/limit", &take(1)), (200, json!({ "ok": true })), "{store}");
    }
    let (status, refused) = server.post("/v1/limit", &take(1));
    assert_eq!((status, &refused["ok"]), (200, &json!(false)), "{store}: {refused}");
    let wait = refused["retryAfter"].as_f64().unwrap();
    assert!((28_000_000.0..=28_800_000.0).contains(&wait), "{store}: a third of a day: {wait}");
    // Bad input is refused as such on every store, never reported as a store outage (a NUL
    // in a key once reached PostgreSQL, which answered an error: 503).
    let (status, nul) = server.post("/v1/limit", &json!({ "name": name, "key": "a\0b" }));
    assert_eq!(status, 400, "{store}: {nul}");
    assert!(nul["error"].as_str().unwrap().contains("NUL character"), "{store}: {nul}");
    let (status, thrown) =
        server.post("/v1/limit", &json!({ "name": name, "key": "k", "throws": true }));
    assert_eq!((status, &thrown["kind"]), (429, &json!("RateLimited")), "{store}: {thrown}");
    assert!(server.value(&name) < 0.01, "{store}: all taken");
    assert_eq!(server.post("/v1/reset", &json!({ "name": name, "key": "k" })), (200, json!({})));
    assert_eq!(server.value(&name), 3.0, "{store}: reset");
    assert_eq!(server.post("/v1/limit", &take(2)), (200, json!({ "ok": true })), "{store}");
    server.terminate();

    let server = Server::start(store, &config, dir.path());
    let left = server.value(&name);
    if durable {
        assert!((1.0..1.01).contains(&left), "{store}: kept over a restart: {left}");
    } else {
        assert_eq!(left, 3.0, "{store}: the memory store starts empty");
    }
    if durable {
        assert_eq!(server.post("/v1/limit", &take(1)), (200, json!({ "ok": true })));
        server.kill();
        let server = Server::start(store, &config, dir.path());
        let left = server.value(&name);
        assert!(left < 0.01, "{store}: an acknowledged take survives kill -9: {left}");
        // Leave nothing behind on a shared store.
        assert_eq!(server.post("/v1/reset", &json!({ "name": name, "key": "k" })).0, 200);
        server.terminate();
    } else {
        server.terminate();
    }
}

#[test]
fn memory() {
    a_servers_life("memory", "memory", false);
}

#[test]
fn sqlite_file() {
    a_servers_life("sqlite://state.db", "sqlite", true);
}

#[test]
fn redis() {
    let Some(url) = backend("TOLLGATE_REDIS_URL") else { return };
    a_servers_life(&url, "redis", true);
}

#[test]
fn redis_cluster() {
    let Some(url) = backend("TOLLGATE_REDIS_CLUSTER_URL") else { return };
    a_servers_life(&url, "cluster", true);
}

#[test]
fn postgres() {
    let Some(url) = backend("TOLLGATE_POSTGRES_URL") else { return };
    a_servers_life(&url, "postgres", true);
}

/// A store that refuses the server for good (a PostgreSQL role that does not exist) is an
/// error at start that names it, not a panic. (One that cannot be reached yet is only a
/// warning: tests/store_later.rs.)
#[test]
fn a_store_that_cannot_be_opened_is_a_clear_error() {
    let Some(url) = backend("TOLLGATE_POSTGRES_URL") else { return };
    let host = url.split('@').nth(1).and_then(|rest| rest.split('/').next()).unwrap();
    let store = format!("postgres://nobody@{host}/x");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", &store])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&store) && !err.contains("panicked"), "{err}");
}

/// One HTTP/1.1 request written by hand (so that `Host` and `Origin` are what a browser
/// would send): the status.
fn raw_request(base: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> u16 {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    tcp.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();
    answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The README's server with its defaults (no tokens, loopback): the issue's cross-site
/// request (`text/plain`, `Origin: http://evil.example`) is 403 and resets nothing, a
/// rebound `Host` is 403, and curl's requests are served.
#[test]
fn web_pages_of_other_sites_cannot_use_a_loopback_server() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, "").unwrap();
    let server = Server::start("memory", &config, dir.path());
    let host = server.base.trim_start_matches("http://").to_owned();
    let body = r#"{"name":"example","key":"alice"}"#;
    // Take one of example's 3 (a file without limits: define it inline).
    let example = json!({ "name": "example", "key": "alice", "config": { "kind": "token bucket", "rate": 3, "period": "1d" } });
    assert_eq!(server.post("/v1/limit", &example).0, 200);
    let evil = [
        ("host", host.as_str()),
        ("origin", "http://evil.example"),
        ("content-type", "text/plain"),
    ];
    assert_eq!(raw_request(&server.base, "POST", "/v1/reset", &evil, body), 403);
    let rebound = [("host", "rebind.attacker.example:8787")];
    assert_eq!(raw_request(&server.base, "GET", "/v1/config", &rebound, ""), 403);
    assert_eq!(raw_request(&server.base, "POST", "/v1/value", &rebound, body), 403);
    // Nothing was reset: 2 of 3 left.
    let (status, value) = server.post("/v1/value", &example);
    assert_eq!((status, &value["value"]), (200, &json!(2)), "{value}");
    // As curl sends it.
    assert_eq!(
        raw_request(&server.base, "POST", "/v1/reset", &[("host", host.as_str())], body),
        200
    );
    server.terminate();
}

/// A request that declares a body over 64 KiB, asking first whether to send it (`Expect:
/// 100-continue`), is told 413 at once: not 100, and not a wait for the body.
#[test]
fn a_declared_length_over_the_limit_is_refused_before_the_body() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, "").unwrap();
    let server = Server::start("memory", &config, dir.path());
    let mut tcp = std::net::TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let start = Instant::now();
    tcp.write_all(
        b"POST /v1/limit HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 100000\r\n\
          expect: 100-continue\r\ncontent-type: application/json\r\n\r\n",
    )
    .unwrap();
    let mut answer = String::new();
    let _ = tcp.read_to_string(&mut answer); // the server closes the connection after it
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    assert!(answer.contains("the most is 65536"), "{answer}");
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    server.terminate();
}

/// `/healthz` on SQLite tells whether the file can still be written: not while another
/// process holds its write lock (and requests then fail within `storeDeadline`, not after
/// SQLite's own 5 s), nor once the file was deleted or replaced under the server (which
/// the log says too).
#[test]
fn sqlite_health_tells_when_the_file_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, "[server]\nstoreDeadline = 200\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "sqlite://state.db", "--config"])
        .arg(&config)
        .current_dir(dir.path());
    let served = common::Served::start(command, false);
    let base = format!("http://{}", served.http);
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let health = || {
        let mut r = agent.get(&format!("{base}/healthz")).call().unwrap();
        (r.status().as_u16(), r.body_mut().read_json::<Value>().unwrap())
    };
    let take = || {
        let body =
            json!({ "name": "h", "config": { "kind": "token bucket", "rate": 9, "period": "1d" } });
        let mut r = agent.post(&format!("{base}/v1/limit")).send_json(body).unwrap();
        (r.status().as_u16(), r.body_mut().read_json::<Value>().unwrap())
    };
    assert_eq!(health().0, 200);
    assert_eq!(take().0, 200);
    // Another process holds the write lock.
    let other = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let start = Instant::now();
    let (status, body) = take();
    assert_eq!((status, &body["mayHaveTaken"]), (503, &json!(false)), "{body}");
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    let (status, body) = health();
    assert_eq!((status, &body["status"]), (503, &json!("degraded")), "{body}");
    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    assert_eq!(health().0, 200);
    assert_eq!(take().0, 200);
    // The file deleted under the server.
    for end in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(dir.path().join(format!("state.db{end}")));
    }
    let (status, body) = health();
    assert_eq!(status, 503, "{body}");
    assert!(body["store"].as_str().unwrap().contains("state.db was deleted"), "{body}");
    // Another file where it was: still not the server's.
    std::fs::write(dir.path().join("state.db"), "").unwrap();
    let (status, body) = health();
    assert!(status == 503 && body["store"].as_str().unwrap().contains("replaced"), "{body}");
    // The log says so too (checked every 10 s).
    let start = Instant::now();
    while !served.stderr().contains("state.db was") {
        assert!(start.elapsed() < Duration::from_secs(15), "not logged: {}", served.stderr());
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// No secret reaches an error, the help or a generated file (issue 45, items 3 and 9, and
/// the credentials of `types --url`): a PostgreSQL URL's password when the store cannot be
/// opened (not reachable, no such database, a bad option), a token or a URL's password on a line
/// of a config file that does not parse, the values of `TOLLGATE_TOKEN` and
/// `TOLLGATE_SERVER` in `--help`, a server URL's password in `types`.
#[test]
fn no_secret_reaches_an_error_the_help_or_a_header() {
    let tollgate = || Command::new(env!("CARGO_BIN_EXE_tollgate"));
    let secret = "S3cretPGpw";
    // Not reachable: the server starts, and its warning names the URL without the password.
    let unreachable = format!("postgres://postgres:{secret}@127.0.0.1:1/test");
    let mut command = tollgate();
    command.args(["serve", "--listen", "127.0.0.1:0", "--store", &unreachable]);
    command.env("TOLLGATE_STORE_DEADLINE", "2s");
    let served = common::Served::start(command, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !served.stderr().contains("not reachable at start") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = served.stderr();
    assert!(!err.contains(secret) && err.contains("postgres://postgres:***@127.0.0.1:1"), "{err}");
    drop(served);
    // Refused for good: a bad option, and (where PostgreSQL runs) no such database.
    let mut refused = vec![format!("postgres://postgres:{secret}@127.0.0.1/test?bogus=1")];
    if backend("TOLLGATE_POSTGRES_URL").is_some() {
        refused.push(format!("postgres://postgres:{secret}@127.0.0.1/nosuchdb"));
    }
    for url in refused {
        let out = tollgate()
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("TOLLGATE_STORE", &url)
            .env("TOLLGATE_STORE_DEADLINE", "2s")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            !err.contains(secret) && err.contains("postgres://postgres:***@127.0.0.1"),
            "{err}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for (text, secret) in [
        ("[server]\ntokens = [\"s3cr3tTOKEN\" \"x\"]\n", "s3cr3tTOKEN"),
        ("[server]\nreadTokens = \"n0tAList\"\n", "n0tAList"),
        ("[server]\nstore = \"redis://:pw0rdXYZ@127.0.0.1:6379/0\" x\n", "pw0rdXYZ"),
    ] {
        let config = dir.path().join("bad.toml");
        std::fs::write(&config, text).unwrap();
        let out = tollgate().args(["check-config", "--config"]).arg(&config).output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{said}");
        assert!(!said.contains(secret) && said.contains("TOML parse error"), "{said}");
    }
    for command in ["limit", "types"] {
        let out = tollgate()
            .args([command, "--help"])
            .env("TOLLGATE_TOKEN", "tok3nVALUE")
            .env("TOLLGATE_SERVER", "http://u:srvPW@127.0.0.1:1")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("TOLLGATE_TOKEN"), "{help}");
        assert!(!help.contains("tok3nVALUE") && !help.contains("srvPW"), "{help}");
    }
    let out = tollgate()
        .args(["limit", "api", "--server", "http://u:srvPW@127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("srvPW") && err.contains("http://u:***@127.0.0.1:1"), "{err}");
    let served = common::serve_memory(dir.path(), "", false, None);
    let url = format!("http://u:srvPW@{}", served.http);
    let out = tollgate().args(["types", "--url", &url]).output().unwrap();
    let header = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(!header.contains("srvPW") && header.contains("--url http://u:***@"), "{header}");
}
