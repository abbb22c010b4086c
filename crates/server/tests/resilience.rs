//! The server under a hostile operator, black box, with the built binary: a Redis that
//! hangs (SIGSTOP) instead of dying, clients that send half a request, a SIGTERM while one
//! is stuck, a body that is too large on a keep-alive connection. The bounds on time here are
//! the server's own deadlines with a wide margin (a request that waited seconds before the
//! deadlines existed), not speed targets.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A running `tollgate serve` with `config` on `store`.
struct Server {
    child: Child,
    addr: String,
    /// Holds the server's log (its standard error).
    dir: tempfile::TempDir,
}

impl Server {
    fn start(store: &str, config: &str) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tollgate.toml");
        std::fs::write(&path, config).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--store", store, "--config"])
            .arg(&path)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut banner = String::new();
        out.read_line(&mut banner).unwrap();
        let addr = banner.trim().strip_prefix("tollgate listening on http://").unwrap().to_owned();
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        Server { child, addr, dir }
    }

    /// What the server has logged so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap()
    }

    /// The value of the Prometheus sample `name` in `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        common::metric(&self.exchange("GET", "/metrics", "").2, name)
    }

    /// One request on a connection of its own: status, headers (lower case) and JSON body.
    fn request(&self, method: &str, path: &str, body: &str) -> (u16, String, Value) {
        let (status, head, body) = self.exchange(method, path, body);
        (status, head, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// One request on a connection of its own: status, headers (lower case) and body.
    fn exchange(&self, method: &str, path: &str, body: &str) -> (u16, String, String) {
        let mut conn = TcpStream::connect(&self.addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            conn,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        (status, head.to_lowercase(), body.to_owned())
    }

    fn limit(&self, name: &str, count: u32) -> (u16, Value) {
        let (status, _, body) =
            self.request("POST", "/v1/limit", &json!({ "name": name, "count": count }).to_string());
        (status, body)
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: &str, signal: &str) {
    assert!(Command::new("kill").args([signal, pid]).status().unwrap().success());
}

/// A throwaway Redis on a spare loopback port, keeping nothing on disk.
struct Redis(Child, u16);

impl Redis {
    fn start() -> Redis {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis(child, port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-CONT", &pid]).status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const DEADLINE_MS: u64 = 200;

/// Redis frozen with SIGSTOP: every request is answered within the store deadline (with a
/// margin): fail-open limits granted, fail-closed ones 503, `/healthz` 503; once the breaker
/// is open, at once. A 503 says whether the request may have taken its tokens, and after
/// Redis resumes no more were taken than the requests that said so. Then the store
/// recovers by itself.
#[test]
fn a_frozen_redis_is_answered_within_the_deadline_and_honestly() {
    if !common::redis_server_available() {
        return;
    }
    let redis = Redis::start();
    let config = format!(
        "[server]\nstoreDeadline = {DEADLINE_MS}\n\n\
         [limits.closed]\nkind = \"token bucket\"\nrate = 1000\nperiod = \"1d\"\n\n\
         [limits.open]\nkind = \"token bucket\"\nrate = 1000\nperiod = \"1d\"\nfailOpen = true\n"
    );
    let server = Server::start(&format!("redis://127.0.0.1:{}", redis.1), &config);
    assert_eq!(server.limit("closed", 5), (200, json!({ "ok": true })));
    assert_eq!(server.limit("open", 1), (200, json!({ "ok": true })));

    signal(&redis.0.id().to_string(), "-STOP");
    let margin = Duration::from_millis(DEADLINE_MS * 5);
    let (mut may_have_taken, mut surely_not) = (0, 0);
    for round in 0..10 {
        let start = Instant::now();
        let (status, body) = server.limit("closed", 5);
        let took = start.elapsed();
        assert_eq!(status, 503, "round {round}: {body}");
        assert!(took < margin, "round {round}: a fail-closed limit took {took:?}");
        match body["mayHaveTaken"] {
            Value::Bool(true) => may_have_taken += 1,
            Value::Bool(false) => surely_not += 1,
            ref other => panic!("mayHaveTaken is {other}"),
        }
        let start = Instant::now();
        assert_eq!(server.limit("open", 1), (200, json!({ "ok": true })), "fails open");
        assert!(
            start.elapsed() < margin,
            "round {round}: a fail-open limit took {:?}",
            start.elapsed()
        );
    }
    let start = Instant::now();
    let (status, _, _) = server.request("GET", "/healthz", "");
    assert_eq!(status, 503);
    assert!(start.elapsed() < margin, "/healthz took {:?}", start.elapsed());
    assert_eq!(server.metric("tollgate_store_breaker_open"), 1.0);
    assert!(server.metric("tollgate_store_breaker_trips_total") >= 1.0);
    assert!(server.metric("tollgate_store_breaker_rejected_total") >= 5.0);
    assert!(server.metric("tollgate_store_failures_total") >= 3.0);
    // Ten failed requests within seconds: one line, the rest summed up later.
    let failed = server.log().lines().filter(|l| l.contains("WARN")).count();
    assert_eq!(failed, 1, "{}", server.log());
    assert!(surely_not >= 5, "once the breaker is open, nothing is sent: {surely_not} of 10");

    signal(&redis.0.id().to_string(), "-CONT");
    // The breaker's probe finds Redis again; the store reconnects.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, body) = server.request("POST", "/v1/value", r#"{"name":"closed"}"#);
        if status == 200 {
            // 5 taken before; each request that may have taken took at most 5 more.
            let taken = 1000.0 - body["value"].as_f64().unwrap();
            assert!(
                taken >= 5.0 && taken <= 5.0 + 5.0 * f64::from(may_have_taken),
                "{taken} taken, {may_have_taken} may have"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the store did not recover: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.limit("closed", 1), (200, json!({ "ok": true })), "recovered");
    assert_eq!(server.metric("tollgate_store_breaker_open"), 0.0);
}

/// A "Redis" that accepts connections and never answers (a mute proxy, a port taken by
/// something else): no connection is ever made, so no request was sent, and every 503 says
/// so (`mayHaveTaken: false`; the first said true, from the breaker's deadline, which cannot
/// know).
#[test]
fn a_redis_that_never_answers_took_nothing() {
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = mute.local_addr().unwrap().port();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = std::sync::Arc::clone(&done);
    let held = std::thread::spawn(move || {
        mute.set_nonblocking(true).unwrap();
        let mut connections = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((tcp, _)) = mute.accept() {
                connections.push(tcp);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let config = format!(
        "[server]\nstoreDeadline = {DEADLINE_MS}\n\n\
         [limits.closed]\nkind = \"token bucket\"\nrate = 1000\nperiod = \"1d\"\n"
    );
    let server = Server::start(&format!("redis://127.0.0.1:{port}"), &config);
    for round in 0..3 {
        let (status, body) = server.limit("closed", 1);
        assert_eq!(status, 503, "round {round}: {body}");
        assert_eq!(body["mayHaveTaken"], json!(false), "round {round}: {body}");
    }
    drop(server);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    held.join().unwrap();
}

/// A client that sends half its headers is cut off after the header timeout, and one still
/// stuck does not hold SIGTERM past the shutdown deadline.
#[test]
fn slow_clients_are_cut_off_and_do_not_hold_a_shutdown() {
    let config = "[server]\nheaderTimeout = 300\nshutdownDeadline = 500\n";
    let server = Server::start("memory", config);
    let mut half = TcpStream::connect(&server.addr).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    half.write_all(b"POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le").unwrap();
    let start = Instant::now();
    let mut rest = Vec::new();
    let _ = half.read_to_end(&mut rest);
    assert!(start.elapsed() < Duration::from_secs(5), "cut off after {:?}", start.elapsed());

    // A keep-alive connection idle after its first answer is closed the same way.
    let mut idle = TcpStream::connect(&server.addr).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut answer = [0u8; 1024];
    let n = idle.read(&mut answer).unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
    let start = Instant::now();
    let _ = idle.read_to_end(&mut rest);
    assert!(start.elapsed() < Duration::from_secs(5), "idle closed after {:?}", start.elapsed());

    // A server with a long header timeout, a stuck client, and SIGTERM: out within the
    // shutdown deadline.
    let config = "[server]\nheaderTimeout = \"1m\"\nshutdownDeadline = 500\n";
    let mut server = Server::start("memory", config);
    let mut stuck = TcpStream::connect(&server.addr).unwrap();
    stuck
        .write_all(
            b"POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"na",
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    signal(&server.pid(), "-TERM");
    let start = Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "SIGTERM waited for a stuck client");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stuck);
}

/// Connections beyond `maxConnections` are closed as soon as they are accepted; once one
/// of those open leaves, a new one is served.
#[test]
fn connections_beyond_the_limit_are_closed() {
    let server = Server::start("memory", "[server]\nmaxConnections = 2\n");
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&server.addr).unwrap()).collect();
    // Both are accepted before the third arrives (the accept loop takes them in order).
    std::thread::sleep(Duration::from_millis(200));
    let mut over = TcpStream::connect(&server.addr).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = over.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let mut text = Vec::new();
    let start = Instant::now();
    let _ = over.read_to_end(&mut text);
    assert!(text.is_empty(), "{}", String::from_utf8_lossy(&text));
    assert!(start.elapsed() < Duration::from_secs(5), "closed after {:?}", start.elapsed());
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Until the server has seen the two leave, a new connection is closed (or reset).
        let mut conn = TcpStream::connect(&server.addr).unwrap();
        let _ = conn
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        let mut text = String::new();
        let _ = conn.read_to_string(&mut text);
        if text.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "a slot never came free");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A body that stalls is answered 408 after the body timeout, with `Connection: close`; a
/// body over the limit is 413 with `Connection: close`, so that a keep-alive client does
/// not send its next request on a connection the server closes.
#[test]
fn answers_that_close_the_connection_say_so() {
    let server = Server::start("memory", "[server]\nbodyTimeout = 300\n");
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    conn.write_all(
        b"POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"name\"",
    )
    .unwrap();
    let mut text = String::new();
    let _ = conn.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.to_lowercase().contains("connection: close"), "{text}");

    let big = format!(r#"{{"name":"example","key":"{}"}}"#, "k".repeat(1 << 20));
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Keep-alive: the client means to send more on this connection.
    write!(
        conn,
        "POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n",
        big.len()
    )
    .unwrap();
    let _ = conn.write_all(big.as_bytes());
    let mut head = [0u8; 512];
    let n = conn.read(&mut head).unwrap();
    let head = String::from_utf8_lossy(&head[..n]).to_lowercase();
    assert!(head.starts_with("http/1.1 413"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
}

/// Bearer's scheme name in any case; an empty token refused at start.
#[test]
fn auth_details() {
    let config = "[server]\ntokens = [\"s3cret\"]\n\n[limits.example]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1m\"\n";
    let server = Server::start("memory", config);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let mut conn = TcpStream::connect(&server.addr).unwrap();
        let body = r#"{"name":"example"}"#;
        write!(
            conn,
            "POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {scheme} s3cret\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{scheme}: {text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    std::fs::write(&path, "[server]\ntokens = [\"\"]\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("an empty token"), "{err}");
}

/// The shape of the Redis protocol's trickled command, on the HTTP API: a request's head
/// sent a byte every 100 ms is cut at `headerTimeout` from its first byte (hyper's header
/// read timer is not restarted by each read), and a body sent a byte every 100 ms is
/// answered 408 at `bodyTimeout` from its start.
#[test]
fn trickled_heads_and_bodies_are_cut() {
    let server = Server::start("memory", "[server]\nheaderTimeout = 1000\nbodyTimeout = 1000\n");
    let gap = Duration::from_millis(100);
    // The head trickled (40 bytes: 4 s).
    let head = b"POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}";
    let common::Trickled { sent, closed_after: took, got } =
        common::trickle(&server.addr, b"", head, gap);
    assert!(sent < 40 && got.is_empty(), "{sent} bytes taken: {got}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2_000), "{took:?}");
    // The body trickled (34 bytes: 3.4 s).
    let body = br#"{"name":"example","key":"trickle"}"#;
    let head = format!(
        "POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let common::Trickled { sent, closed_after: took, got } =
        common::trickle(&server.addr, head.as_bytes(), body, gap);
    assert!(sent < body.len() && got.starts_with("HTTP/1.1 408"), "{sent} bytes taken: {got}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2_000), "{took:?}");
}
