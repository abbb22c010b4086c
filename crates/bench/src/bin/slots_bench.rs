//! Concurrency limits' acquire + release pairs a second (issue 60's goals), through the
//! server's doors: the Redis protocol (`TG.ACQUIRE`, `TG.RELEASE`, four multiplexed
//! connections shared by the clients, as Redis clients share theirs) against HTTP
//! (`POST /v1/acquire`, `/v1/release`, a keep-alive connection a client), on
//! one `tollgate serve`, rounds taking turns; and the library on its own (`acquire_async` +
//! `release_async` on the store directly), the anchor of what the doors add.
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin slots_bench -p tollgate-server --bin tollgate
//! target/release/slots_bench [--store memory|redis://...] [--clients 32] [--secs 5] [--rounds 3]
//! ```
//!
//! Every client makes pairs one after the other on a key of its own (a tenant) of a limit
//! whose `max` (1,000,000) is never reached: each pair is an acquire granted and its
//! release. Loopback only.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_bench::admissions::flag;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let store: String = flag(&args, "--store").unwrap_or_else(|| "memory".into());
    let clients: usize = flag(&args, "--clients").unwrap_or(32);
    let secs: f64 = flag(&args, "--secs").unwrap_or(5.0);
    let rounds: usize = flag(&args, "--rounds").unwrap_or(3);
    let tollgate = std::env::current_exe().unwrap().with_file_name("tollgate");
    assert!(tollgate.is_file(), "build the tollgate binary beside this one");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, "[limits.gpu]\nkind = \"concurrency\"\nmax = 1000000\n").unwrap();
    let mut child = Command::new(&tollgate)
        .args(["serve", "--store", &store, "--listen", "127.0.0.1:0"])
        .args(["--resp-listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (mut http, mut resp) = (String::new(), String::new());
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while resp.is_empty() {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the server did not start");
        if let Some(base) = line.trim().strip_prefix("tollgate listening on http://") {
            http = base.to_owned();
        }
        if let Some(addr) = line.trim().strip_prefix("resp:") {
            let addr = addr.trim().strip_prefix("redis://").unwrap();
            resp = addr.split(' ').next().unwrap().to_owned();
        }
    }
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    println!(
        "slots_bench: {store}, {clients} clients making acquire + release pairs, {secs} s a \
         round, {rounds} rounds each way taking turns (pairs a second)"
    );
    let mut sums = [0.0f64; 3];
    for round in 0..rounds {
        for (way, name) in ["resp", "http", "library"].iter().enumerate() {
            let pairs = runtime.block_on(run(way, &resp, &http, &store, clients, secs));
            println!("  round {} {name}: {pairs:.0}", round + 1);
            sums[way] += pairs;
        }
    }
    let [resp_sum, http_sum, library_sum] = sums;
    let n = rounds as f64;
    println!(
        "  resp {:.0}/s, http {:.0}/s: resp {:.2}x http; the library on the store alone {:.0}/s",
        resp_sum / n,
        http_sum / n,
        resp_sum / http_sum,
        library_sum / n
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// Pairs a second over `secs` by `clients` clients of one way: 0 RESP, 1 HTTP, 2 the
/// library on the store itself.
async fn run(way: usize, resp: &str, http: &str, store: &str, clients: usize, secs: f64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let library = if way == 2 { Some(Arc::new(library(store).await)) } else { None };
    // Redis clients share a multiplexed connection among tasks, pipelining what they send
    // (redis-rs's `MultiplexedConnection`, ioredis's and node-redis's own): four here, each
    // shared by a quarter of the clients. HTTP/1.1 clients keep a connection a request.
    let mut shared = Vec::new();
    if way == 0 {
        let client = redis::Client::open(format!("redis://{resp}")).unwrap();
        for _ in 0..4 {
            shared.push(client.get_multiplexed_async_connection().await.unwrap());
        }
    }
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (stop, pairs) = (Arc::clone(&stop), Arc::clone(&pairs));
        let (http, library) = (http.to_owned(), library.clone());
        let connection = shared.get(client % 4).cloned();
        tasks.push(tokio::spawn(async move {
            let key = format!("k{client}");
            match way {
                0 => {
                    let mut c = connection.unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        let reply: Vec<redis::Value> = redis::cmd("TG.ACQUIRE")
                            .arg(&["gpu", "KEY", &key])
                            .query_async(&mut c)
                            .await
                            .unwrap();
                        let ticket = ticket_of(&reply);
                        let _: redis::Value = redis::cmd("TG.RELEASE")
                            .arg(&["gpu", "TICKET", &ticket, "KEY", &key])
                            .query_async(&mut c)
                            .await
                            .unwrap();
                        pairs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                1 => {
                    let mut c = Http::connect(&http).await;
                    while !stop.load(Ordering::Relaxed) {
                        let body = format!(r#"{{"name":"gpu","key":"{key}"}}"#);
                        let answer = c.post("/v1/acquire", &body).await;
                        let at = answer.find("\"ticket\":\"").expect("granted") + 10;
                        let ticket = &answer[at..at + answer[at..].find('"').unwrap()];
                        let body = format!(r#"{{"name":"gpu","key":"{key}","ticket":"{ticket}"}}"#);
                        let answer = c.post("/v1/release", &body).await;
                        assert!(answer.contains("true"), "{answer}");
                        pairs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ => {
                    let limiter = library.unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        let acquired = limiter.acquire_async("gpu", key.as_str()).await.unwrap();
                        let ticket = acquired.ticket().expect("granted");
                        assert!(limiter.release_async("gpu", Some(&key), ticket.id).await.unwrap());
                        pairs.fetch_add(1, Ordering::Relaxed);
                        // The memory store answers at once: without a turn, no other task
                        // (nor the round's timer) would run.
                        tokio::task::yield_now().await;
                    }
                }
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let made = pairs.load(Ordering::Relaxed);
    let took = start.elapsed().as_secs_f64();
    for task in tasks {
        task.await.unwrap();
    }
    made as f64 / took
}

type Library = tollgate::RateLimiter<Arc<dyn tollgate::AsyncStore>>;

/// The library on the store itself (a fresh prefix of its own on Redis).
async fn library(store: &str) -> Library {
    let opened: Arc<dyn tollgate::AsyncStore> = if store.starts_with("redis") {
        Arc::new(tollgate::store::RedisStore::builder().prefix("slots_bench:").open(store).unwrap())
    } else {
        Arc::new(tollgate::MemoryStore::new())
    };
    tollgate::RateLimiter::builder(opened)
        .define_concurrency("gpu", tollgate::Concurrency::new(1_000_000))
        .build()
}

/// The ticket of a `TG.ACQUIRE` reply (RESP2: field, value, ...).
fn ticket_of(reply: &[redis::Value]) -> String {
    let at = reply
        .iter()
        .position(|v| matches!(v, redis::Value::BulkString(b) if b == b"ticket"))
        .expect("granted");
    match &reply[at + 1] {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("{other:?}"),
    }
}

/// A keep-alive HTTP/1.1 connection, enough for the server's JSON answers.
struct Http {
    tcp: TcpStream,
    host: String,
    buffer: Vec<u8>,
}

impl Http {
    async fn connect(addr: &str) -> Http {
        let tcp = TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        Http { tcp, host: addr.to_owned(), buffer: Vec::with_capacity(4096) }
    }

    /// The answer's body.
    async fn post(&mut self, path: &str, body: &str) -> String {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        self.tcp.write_all(request.as_bytes()).await.unwrap();
        loop {
            if let Some(end) = self.buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buffer[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .expect("a content-length");
                if self.buffer.len() >= end + 4 + length {
                    let body = String::from_utf8_lossy(&self.buffer[end + 4..end + 4 + length])
                        .into_owned();
                    self.buffer.drain(..end + 4 + length);
                    return body;
                }
            }
            let mut chunk = [0u8; 4096];
            let n = self.tcp.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the server closed the connection");
            self.buffer.extend_from_slice(&chunk[..n]);
        }
    }
}
