//! A Redis that goes away and comes back: requests fail closed within the timeout while it
//! is gone, and the same limiter works again once it is back, without being rebuilt; all
//! through the async store, inside a Tokio runtime.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_closed_while_down_and_recovers_by_itself() {
    if !redis_server_available() {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = start(port);
    let timeout = Duration::from_millis(300);
    let store =
        RedisStore::builder().timeout(timeout).open(&format!("redis://127.0.0.1:{port}")).unwrap();
    // One limit fails closed (the default), one was made to fail open.
    let limiter = RateLimiter::builder(store).fail_open("search").build();
    let limit = Target::Inline("outage", Config::token_bucket(100.0, MINUTE));
    let search = Target::Inline("search", Config::token_bucket(1.0, MINUTE));
    for _ in 0..5 {
        assert!(limiter.limit_async(limit, Request::new()).await.unwrap().ok);
    }

    server.kill().unwrap();
    server.wait().unwrap();
    for _ in 0..5 {
        let start = Instant::now();
        let result = limiter.limit_async(limit, Request::new()).await;
        assert!(matches!(result, Err(Error::Store(_))), "fail closed, not admitted: {result:?}");
        // Bounded by the timeout (connect, send or receive), not hanging: a generous margin.
        assert!(start.elapsed() < timeout * 10, "took {:?}", start.elapsed());
        assert!(limiter.limit_async(search, Request::new()).await.unwrap().ok, "fails open");
    }
    assert_eq!(limiter.failed_open(), 5);

    let mut server = start(port);
    let decision = limiter.limit_async(limit, Request::new()).await.unwrap();
    assert!(decision.ok, "the same limiter works again");
    // The restarted Redis kept nothing: the limit starts fresh.
    assert_eq!(limiter.value_async(limit, None).await.unwrap().value, 99.0);
    server.kill().unwrap();
    server.wait().unwrap();
}

/// A Redis that stops answering (SIGSTOP) but keeps its connection open: a request fails
/// within the timeout, and its error says it may have been applied (it was sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_times_out_may_have_taken_and_says_so() {
    if !redis_server_available() {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = start(port);
    let timeout = Duration::from_millis(200);
    // One connection, made by the first request: the second goes out on it and is sent.
    let store = RedisStore::builder()
        .timeout(timeout)
        .connections(1)
        .open(&format!("redis://127.0.0.1:{port}"))
        .unwrap();
    let limiter = RateLimiter::new(store);
    let limit = Target::Inline("hang", Config::token_bucket(100.0, MINUTE));
    assert!(limiter.limit_async(limit, Request::new()).await.unwrap().ok);
    let pid = server.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let start = Instant::now();
    let result = limiter.limit_async(limit, Request::new()).await;
    let elapsed = start.elapsed();
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    match result {
        Err(Error::Store(e)) => {
            assert!(e.may_have_taken(), "sent, then no reply: {e}");
            assert!(e.to_string().contains("may have taken"), "{e}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    assert!(elapsed < timeout * 10, "took {elapsed:?}");
    // Once Redis answers again, the store reconnects and goes on.
    let mut recovered = false;
    for _ in 0..50 {
        if limiter.limit_async(limit, Request::new()).await.is_ok_and(|d| d.ok) {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recovered, "the store did not recover");
    server.kill().unwrap();
    server.wait().unwrap();
}
