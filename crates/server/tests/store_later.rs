//! A store that is down when tollgate starts and comes up later (issue 57, item 6): the
//! library's `RateLimiter` and the server fail closed meanwhile, then use the store once it
//! answers, without being rebuilt or restarted. The store's port has nothing listening at
//! first; then a forwarder to the machine's own PostgreSQL or Redis starts on it (the shared
//! servers themselves are never stopped).

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate::store::{AsyncStore, PgStore, RedisStore};
use tollgate::{Config, Error, MINUTE, RateLimiter, Request, Target};

use common::{Served, backend, free_port};

/// Forwards every connection accepted on `listener` to `target`, both ways, until the
/// process ends.
fn forward(listener: TcpListener, target: SocketAddr) {
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(target) else { continue };
            for (from, to) in [(&client, &server), (&server, &client)] {
                let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut chunk = [0; 16 * 1024];
                    while let Ok(n @ 1..) = from.read(&mut chunk) {
                        if to.write_all(&chunk[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
}

/// `url` (`scheme://[user@]host[:port][/rest]`) pointed at a free loopback port instead,
/// with where it pointed: the port, and the store's address.
fn moved(url: &str, default_port: u16) -> (String, u16, SocketAddr) {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (user, rest) = match rest.split_once('@') {
        Some((user, rest)) => (format!("{user}@"), rest),
        None => (String::new(), rest),
    };
    let (host, path) = rest.split_once('/').map_or((rest, ""), |(h, p)| (h, p));
    let host = if host.contains(':') { host.to_owned() } else { format!("{host}:{default_port}") };
    let target = host.to_socket_addrs().unwrap().next().unwrap();
    let port = free_port();
    (format!("{scheme}://{user}127.0.0.1:{port}/{path}"), port, target)
}

/// The stores to start without: PostgreSQL and Redis, each as its URL pointed at a port
/// with nothing behind it yet, that port, and the store's real address.
fn stores() -> Vec<(&'static str, String, u16, SocketAddr)> {
    let mut stores = Vec::new();
    if let Some(url) = backend("TOLLGATE_POSTGRES_URL") {
        let (url, port, target) = moved(&url, 5432);
        stores.push(("postgres", url, port, target));
    }
    if let Some(url) = backend("TOLLGATE_REDIS_URL") {
        let (url, port, target) = moved(&url, 6379);
        stores.push(("redis", url, port, target));
    }
    stores
}

/// A name no earlier run used (runs share the stores).
fn fresh(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    format!("{prefix}{}x{}", std::process::id(), nanos.as_nanos())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_uses_a_store_that_comes_up_after_it() {
    for (label, url, port, target) in stores() {
        let timeout = Duration::from_millis(300);
        // Made at once, though nothing answers on the store's port.
        let store: Arc<dyn AsyncStore> = if label == "postgres" {
            Arc::new(PgStore::builder().timeout(timeout).connect_lazy(&url).unwrap())
        } else {
            Arc::new(RedisStore::builder().timeout(timeout).open(&url).unwrap())
        };
        let limiter = RateLimiter::new(store);
        let name = fresh("later");
        let limit = Target::Inline(&name, Config::token_bucket(3.0, MINUTE));
        for _ in 0..3 {
            match limiter.limit_async(limit, Request::new()).await {
                Err(Error::Store(e)) => assert!(!e.may_have_taken(), "{label}: {e}"),
                other => panic!("{label}: fails closed while the store is down: {other:?}"),
            }
        }
        forward(TcpListener::bind(("127.0.0.1", port)).unwrap(), target);
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = loop {
            match limiter.limit_async(limit, Request::new()).await {
                Ok(decision) => break decision,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("{label}: the store is up, but the limiter still fails: {e}"),
            }
        };
        // The store's own count from then on, one call after the other (sent at once, they
        // may commit in another order over the store's connections): 3 granted, the 4th
        // refused.
        let mut rest = Vec::new();
        for _ in 0..3 {
            rest.push(limiter.limit_async(limit, Request::new()).await.unwrap().ok);
        }
        assert_eq!((first.ok, rest), (true, vec![true, true, false]), "{label}");
    }
}

#[test]
fn the_server_uses_a_store_that_comes_up_after_it() {
    let dir = tempfile::tempdir().unwrap();
    for (label, url, port, target) in stores() {
        let name = fresh("later");
        let config = dir.path().join(format!("{label}.toml"));
        std::fs::write(
            &config,
            format!("[limits.{name}]\nkind = \"token bucket\"\nrate = 3\nperiod = \"1m\"\n"),
        )
        .unwrap();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command.args(["serve", "--listen", "127.0.0.1:0", "--store", &url, "--config"]);
        command.arg(&config).env("TOLLGATE_STORE_DEADLINE", "300ms");
        // It starts, though nothing answers on the store's port.
        let served = Served::start(command, false);
        let body = json!({ "name": name, "key": "alice" });
        let (status, answer) = served.post("/v1/limit", &[], &body);
        assert_eq!((status, &answer["mayHaveTaken"]), (503, &json!(false)), "{label}: {answer}");

        forward(TcpListener::bind(("127.0.0.1", port)).unwrap(), target);
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut answers = Vec::new();
        while answers.len() < 4 {
            let (status, answer) = served.post("/v1/limit", &[], &body);
            match status {
                200 => answers.push(answer["ok"].as_bool().unwrap()),
                503 if answers.is_empty() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => panic!("{label}: the store is up, but the server answers {status} {answer}"),
            }
        }
        assert_eq!(answers, [true, true, true, false], "{label}: {}", served.stderr());
        let err = served.stderr();
        assert!(err.contains("not reachable at start") || label == "redis", "{label}: {err}");
    }
}
