//! A Redis that goes away and comes back: requests fail closed within the timeout while it
//! is gone, and the same limiter works again once it is back, without being rebuilt.

#![cfg(feature = "redis")]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate::store::RedisStore;
use tollgate::{Config, Error, MINUTE, RateLimiter, Request, Target};

fn redis_server_available() -> bool {
    let found =
        Command::new("redis-server").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found && std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") {
        panic!("redis-server is not installed, and TOLLGATE_REQUIRE_BACKENDS=1 requires this test");
    }
    if !found {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "skipped the Redis outage test: redis-server is not installed"
        );
    }
    found
}

/// A throwaway Redis on `port`, loopback only, keeping nothing on disk.
fn start(port: u16) -> Child {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn fails_closed_while_down_and_recovers_by_itself() {
    if !redis_server_available() {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = start(port);
    let timeout = Duration::from_millis(300);
    let store = RedisStore::builder()
        .timeout(timeout)
        .connections(2)
        .open(&format!("redis://127.0.0.1:{port}"))
        .unwrap();
    // One limit fails closed (the default), one was made to fail open.
    let limiter = RateLimiter::builder(store).fail_open("search").build();
    let limit = Target::Inline("outage", Config::token_bucket(100.0, MINUTE));
    let search = Target::Inline("search", Config::token_bucket(1.0, MINUTE));
    for _ in 0..5 {
        assert!(limiter.limit(limit, Request::new()).unwrap().ok);
    }

    server.kill().unwrap();
    server.wait().unwrap();
    for _ in 0..5 {
        let start = Instant::now();
        let result = limiter.limit(limit, Request::new());
        assert!(matches!(result, Err(Error::Store(_))), "fail closed, not admitted: {result:?}");
        // Bounded by the timeout (connect, send or receive), not hanging: a generous margin.
        assert!(start.elapsed() < timeout * 10, "took {:?}", start.elapsed());
        assert!(limiter.limit(search, Request::new()).unwrap().ok, "this one fails open");
    }
    assert_eq!(limiter.failed_open(), 5);

    let mut server = start(port);
    let decision = limiter.limit(limit, Request::new()).unwrap();
    assert!(decision.ok, "the same limiter works again");
    // The restarted Redis kept nothing: the limit starts fresh.
    assert_eq!(limiter.value(limit, None).unwrap().value, 99.0);
    server.kill().unwrap();
    server.wait().unwrap();
}
