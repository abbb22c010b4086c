//! Load on Envoy's rate limit service (RLS v3 gRPC): many concurrent `ShouldRateLimit`
//! calls, bounded in time, to one or more servers on loopback, the servers taking turns
//! round by round; requests a second and latency percentiles, and each server's figure
//! against the first's.
//!
//! ```text
//! cargo build --release -p tollgate-server --bin tollgate -p tollgate-bench --bin rls_bench
//! target/release/rls_bench --tollgate target/release/tollgate [--seconds 5] [--rounds 3] \
//!     [--concurrency 256] [--connections 4] [--keys 1000] [NAME=127.0.0.1:PORT ...]
//! ```
//!
//! Every call asks domain `bench` for one descriptor `[user=u<n>]` (n cycling over `--keys`
//! values), one hit, under a limit of 1,000,000,000 a minute, so that every answer is OK and
//! the figure is the service's own cost. `--tollgate BIN` starts `BIN serve --store memory
//! --rls-listen` on a free port with that limit (envoyproxy/ratelimit's YAML); any other
//! server is given by its address and must hold the same limit, for example limitador
//! (`limitador-server -b 127.0.0.1 -p PORT limits.yaml memory`) with
//!
//! ```yaml
//! - namespace: bench
//!   max_value: 1000000000
//!   seconds: 60
//!   conditions: []
//!   variables: ["descriptors[0].user"]
//! ```

use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::{Channel, Endpoint};

const RLS_CONFIG: &str = "domain: bench\ndescriptors:\n  - key: user\n    rate_limit:\n      \
                          unit: minute\n      requests_per_unit: 1000000000\n";

struct Options {
    seconds: u64,
    rounds: usize,
    concurrency: usize,
    connections: usize,
    keys: usize,
    tollgate: Option<String>,
    targets: Vec<(String, String)>,
}

fn options() -> Options {
    let mut o = Options {
        seconds: 5,
        rounds: 3,
        concurrency: 256,
        connections: 4,
        keys: 1000,
        tollgate: None,
        targets: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--seconds" => o.seconds = number("--seconds") as u64,
            "--rounds" => o.rounds = number("--rounds"),
            "--concurrency" => o.concurrency = number("--concurrency").max(1),
            "--connections" => o.connections = number("--connections").max(1),
            "--keys" => o.keys = number("--keys").max(1),
            "--tollgate" => o.tollgate = args.next(),
            target => {
                let (name, addr) =
                    target.split_once('=').unwrap_or_else(|| panic!("{target}: give NAME=ADDR"));
                assert!(
                    addr.starts_with("127.") || addr.starts_with("[::1]"),
                    "{addr}: only loopback addresses"
                );
                o.targets.push((name.to_owned(), addr.to_owned()));
            }
        }
    }
    o
}

/// `tollgate serve` with the bench's limit, on free loopback ports; its RLS address.
fn start_tollgate(binary: &str, dir: &std::path::Path) -> (Child, String) {
    let config = dir.join("rls.yaml");
    std::fs::write(&config, RLS_CONFIG).unwrap();
    let config = config.to_str().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--store", "memory", "--rls-listen", "127.0.0.1:0"];
    let args = [&args[..], &["--rls-config", config]].concat();
    tollgate_bench::serve(binary, &args, dir, |line| {
        let rest = line.strip_prefix("rls:")?.trim().strip_prefix("grpc://")?;
        Some(rest.split(' ').next()?.to_owned())
    })
}

struct Run {
    rps: f64,
    p50_us: u32,
    p99_us: u32,
    errors: u64,
}

async fn load(addr: &str, o: &Options) -> Run {
    let mut channels = Vec::new();
    for _ in 0..o.connections {
        let endpoint = Endpoint::from_shared(format!("http://{addr}")).unwrap().tcp_nodelay(true);
        channels.push(endpoint.connect().await.unwrap_or_else(|e| panic!("{addr}: {e}")));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..o.concurrency {
        let channel: Channel = channels[task % channels.len()].clone();
        let stop = Arc::clone(&stop);
        let keys = o.keys;
        tasks.push(tokio::spawn(async move {
            let mut client = RateLimitServiceClient::new(channel);
            let mut latencies = Vec::with_capacity(1 << 14);
            let mut errors = 0u64;
            let mut n = task;
            while !stop.load(Ordering::Relaxed) {
                let request = RateLimitRequest {
                    domain: "bench".into(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "user".into(),
                            value: format!("u{}", n % keys),
                        }],
                        ..RateLimitDescriptor::default()
                    }],
                    hits_addend: 1,
                };
                n += 7919;
                let start = Instant::now();
                match client.should_rate_limit(request).await {
                    Ok(r) if r.get_ref().overall_code == 1 => {
                        latencies
                            .push(start.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    }
                    _ => errors += 1,
                }
            }
            (latencies, errors)
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(o.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (latencies, e) = task.await.unwrap();
        all.extend(latencies);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Run { rps: all.len() as f64 / elapsed, p50_us: at(0.50), p99_us: at(0.99), errors }
}

fn main() {
    let o = options();
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    let mut targets = Vec::new();
    if let Some(binary) = &o.tollgate {
        let (child, addr) = start_tollgate(binary, dir.path());
        children.push(child);
        targets.push(("tollgate".to_owned(), addr));
    }
    targets.extend(o.targets.iter().cloned());
    assert!(!targets.is_empty(), "give --tollgate BIN or NAME=ADDR");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    println!(
        "ShouldRateLimit, one descriptor, {} keys: {} calls in flight over {} connections, {} s a run",
        o.keys, o.concurrency, o.connections, o.seconds
    );
    println!();
    println!("| round | server | calls/s | p50 | p99 | errors | / {} |", targets[0].0);
    println!("|---:|---|---:|---:|---:|---:|---:|");
    // Warm up each (connections, first states).
    for (_, addr) in &targets {
        let warm = Options { seconds: 1, ..options_copy(&o) };
        runtime.block_on(load(addr, &warm));
    }
    for round in 1..=o.rounds {
        // Alternate the order round by round.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut runs: Vec<Option<Run>> = (0..targets.len()).map(|_| None).collect();
        for i in order {
            runs[i] = Some(runtime.block_on(load(&targets[i].1, &o)));
        }
        let first = runs[0].as_ref().unwrap().rps;
        for (i, run) in runs.iter().enumerate() {
            let run = run.as_ref().unwrap();
            println!(
                "| {round} | {} | {:.0} | {:.2} ms | {:.2} ms | {} | {:.2}x |",
                targets[i].0,
                run.rps,
                f64::from(run.p50_us) / 1_000.0,
                f64::from(run.p99_us) / 1_000.0,
                run.errors,
                run.rps / first
            );
        }
    }
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn options_copy(o: &Options) -> Options {
    Options {
        seconds: o.seconds,
        rounds: o.rounds,
        concurrency: o.concurrency,
        connections: o.connections,
        keys: o.keys,
        tollgate: None,
        targets: Vec::new(),
    }
}
