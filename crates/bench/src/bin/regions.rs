//! One global limit across regions (issue 59): three "regions", each one or more app servers
//! (processes of this harness, each a `RateLimiter` with the limit leased), reaching one Redis
//! through a delay proxy of their own (one-way delays of half the round trips given, 25 and
//! 75 ms by default: 50 and 150 ms round trips; this machine's kernel has no `netem`, so the
//! network is a userspace proxy's). Clients in every region: each server offers requests at a
//! rate the scenario sets, open loop, and logs every one with the times it was sent and
//! answered into a file mapped in memory (what a server killed with -9 logged survives it).
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin regions
//! target/release/regions [--short] [--secs S] [--rate R] [--capacity C] [--trips 50,150,150]
//!                        [--servers N] [--only SCENARIO] [--limitador PATH]
//! ```
//!
//! Scenarios:
//! - `saturated`: every region offers the whole limit (3x in all), for the run.
//! - `cut`: the same, with the last region cut off from the store for the middle third.
//! - `swing`: the first two regions offer twice the limit between them, 90/10 and then 10/90
//!   from the middle of the run; the last offers half the limit, and is cut off for 30 s (a
//!   third of a `--short` run) from 45% of the run, one of its servers killed with -9 (and
//!   started again) halfway through the cut.
//! - `memory`: the saturated loads, each server on a memory store of its own: the latency a
//!   server has with no store to reach (its limit its own, not global).
//! - `throughput`: each server as fast as it can (64 requests in flight, closed loop), on the
//!   leased global limit and on a memory store of its own, rounds taking turns: what a region
//!   serves of a saturated global limit against what it serves on its memory store.
//! - `throughput-serve` (only with `--only throughput-serve`; needs `wrk` and the `tollgate`
//!   binary, `--tollgate PATH`): the same with `tollgate serve` as each region's servers,
//!   each driven over HTTP by a wrk of its own (`storeDeadline = "1s"`, as the guide says for
//!   a store in another region). With `REGIONS_LEASE_COUNTS=1` it also prints wrk's whole
//!   report and each leased server's `tollgate_lease_*` lines from its `/metrics`, and keeps
//!   each server's log in `/tmp/regions-serve-r{REGION}-{PORT}.log`.
//! - `limitador` and `limitador-cut` (with `--limitador PATH`, a limitador-server binary):
//!   the loads of `saturated` and `cut`, each server a client (Envoy's gRPC protocol) of a
//!   limitador-server of its own, whose `redis_cached` storage reaches the Redis through the
//!   region's proxy; the limit a fixed window of the rate a second (limitador has no token
//!   bucket), checked against what an exact fixed window admits.
//!
//! Checked: every interval [a, b] admits at most `capacity + rate (b - a)` (an admission
//! counts in an interval only if both its send and its answer lie inside it, so a count over
//! the bound is a certain violation; see `tollgate_bench::admissions`); the process exits 1 if
//! one does. Printed: admitted over the bound of the whole run (how much of the limit was
//! used), store calls per request (Redis `INFO commandstats`), each region's p50 and p99, and
//! after the swing how many lease terms the region whose demand rose took to reach its share.
//! Loopback only; every run is bounded in time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::store::{AsyncStore, LeaseOptions, MemoryStore, RedisStore};
use tollgate::{Config, RateLimiter, Request};
use tollgate_bench::admissions::{
    Log, Logged, OwnRedis, flag, offer, read_log, real_ns, worst_interval,
};
use tollgate_bench::proxy::Proxy;
use tonic::transport::Endpoint;

/// Requests a server keeps on their way at once, open loop (a region 150 ms away waits that
/// long for its first takes, before its key is leased).
const IN_FLIGHT: usize = 1_024;

/// Requests a server keeps on their way in the throughput rounds.
const CLOSED: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        child(&args[1..]);
    } else {
        harness(&args);
    }
}

/// The limit: a token bucket of `rate` a second holding `capacity`.
fn config(rate: f64, capacity: f64) -> Config {
    Config::token_bucket(rate, 1_000.0).with_capacity(capacity)
}

// ---------------------------------------------------------------------------------------
// A server of a region.

/// Offered load: from each time (s since the start), a rate (a second).
fn schedule(text: &str) -> Vec<(f64, f64)> {
    text.split(',')
        .map(|step| {
            let (at, rate) = step.split_once(':').expect("a schedule is at:rate,...");
            (at.parse().unwrap(), rate.parse().unwrap())
        })
        .collect()
}

/// Requests due by `elapsed` seconds under `schedule`.
fn due(schedule: &[(f64, f64)], elapsed: f64) -> f64 {
    let mut total = 0.0;
    for (i, &(at, rate)) in schedule.iter().enumerate() {
        if elapsed <= at {
            break;
        }
        let end = schedule.get(i + 1).map_or(elapsed, |&(next, _)| next.min(elapsed));
        total += rate * (end - at);
    }
    total
}

fn child(args: &[String]) {
    let url: String = flag(args, "--url").expect("--url");
    let key: String = flag(args, "--key").expect("--key");
    let rate: f64 = flag(args, "--rate").expect("--rate");
    let capacity: f64 = flag(args, "--capacity").expect("--capacity");
    let term: u64 = flag(args, "--term").expect("--term");
    let start: u64 = flag(args, "--start").expect("--start");
    let until: u64 = flag(args, "--until").expect("--until");
    let log: PathBuf = flag::<String>(args, "--log").expect("--log").into();
    let slots: usize = flag(args, "--slots").expect("--slots");
    let load = match flag::<usize>(args, "--closed") {
        Some(n) => Load::Closed(n),
        None => Load::Open(schedule(&flag::<String>(args, "--schedule").expect("--schedule"))),
    };
    let log = Log::create(&log, slots, start);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let config = config(rate, capacity);
    let drive = Drive { log, load, start, until, key };
    runtime.block_on(async move {
        if url == "memory" {
            let limiter = RateLimiter::builder(MemoryStore::new()).define("hot", config).build();
            drive.limiter(limiter).await;
        } else if let Some(addr) = url.strip_prefix("rls://") {
            drive.rls(addr).await;
        } else {
            let options = LeaseOptions::new().term(Duration::from_millis(term));
            let store = RedisStore::builder().prefix("regions:").lease("hot", options).open(&url);
            let limiter = RateLimiter::builder(store.unwrap()).define("hot", config).build();
            drive.limiter(limiter).await;
        }
    });
}

/// What a server says of its store at its end: answered from leases, refused from them,
/// direct takes, grants, takes of the key before it was leased.
trait Counted: AsyncStore + Send + Sync + 'static {
    fn counts(&self) -> [u64; 5];
    async fn release(&self);
}

impl Counted for RedisStore {
    fn counts(&self) -> [u64; 5] {
        let mut out = [0; 5];
        for (_, _, s) in self.lease_stats() {
            out[0] += s.local;
            out[1] += s.refused;
            out[2] += s.direct;
            out[3] += s.grants;
        }
        out[4] = self.lease_names().iter().map(|n| n.cold).sum();
        out
    }

    async fn release(&self) {
        let _ = self.release_leases().await;
    }
}

impl Counted for MemoryStore {
    fn counts(&self) -> [u64; 5] {
        [0; 5]
    }

    async fn release(&self) {}
}

enum Load {
    /// Requests at the schedule's rates.
    Open(Vec<(f64, f64)>),
    /// This many requests on their way at all times.
    Closed(usize),
}

struct Drive {
    log: Log,
    load: Load,
    start: u64,
    until: u64,
    key: String,
}

impl Drive {
    /// Drives a `RateLimiter` of this process; prints its store's counts at the end.
    async fn limiter<S: Counted>(self, limiter: RateLimiter<S>) {
        let limiter = Arc::new(limiter);
        let key = self.key.clone();
        self.run(|| {
            let limiter = Arc::clone(&limiter);
            let key = key.clone();
            async move {
                let answer = limiter.limit_async("hot", Request::new().key(&key)).await;
                answer.ok().map(|d| d.ok)
            }
        })
        .await;
        limiter.store().release().await;
        let counts = limiter.store().counts().map(|n| n.to_string());
        println!("{}", counts.join(" "));
    }

    /// Drives a rate limit service over Envoy's gRPC protocol (limitador-server): the
    /// namespace `regions`, one descriptor entry `key` = the key, a hit each.
    async fn rls(self, addr: &str) {
        let endpoint = Endpoint::from_shared(format!("http://{addr}")).unwrap().tcp_nodelay(true);
        // A few HTTP/2 connections, as a sidecar's client would keep.
        let mut channels = Vec::new();
        for _ in 0..4 {
            channels.push(endpoint.connect().await.unwrap_or_else(|e| panic!("{addr}: {e}")));
        }
        let next = std::cell::Cell::new(0usize);
        let key = self.key.clone();
        self.run(|| {
            let i = next.get();
            next.set(i + 1);
            let mut client = RateLimitServiceClient::new(channels[i % channels.len()].clone());
            let request = RateLimitRequest {
                domain: "regions".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry { key: "key".into(), value: key.clone() }],
                    ..RateLimitDescriptor::default()
                }],
                hits_addend: 1,
            };
            async move {
                match client.should_rate_limit(request).await {
                    Ok(r) => match r.get_ref().overall_code {
                        1 => Some(true),
                        2 => Some(false),
                        _ => None,
                    },
                    Err(_) => None,
                }
            }
        })
        .await;
        println!("0 0 0 0 0");
    }

    /// Offers the load, each request `decide()` (admitted, refused, or `None` for an error),
    /// and logs every one.
    async fn run<F, Fut>(self, decide: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Option<bool>>,
    {
        let Drive { mut log, load, start, until, key: _ } = self;
        let room = |issued: u64, pending: usize| match &load {
            Load::Open(schedule) => {
                let elapsed = (real_ns().saturating_sub(start)) as f64 / 1e9;
                issued < due(schedule, elapsed) as u64 && pending < IN_FLIGHT
            }
            Load::Closed(n) => pending < *n,
        };
        offer(&mut log, until, room, decide).await;
    }
}

// ---------------------------------------------------------------------------------------
// The harness.

#[derive(Clone)]
struct Plan {
    secs: f64,
    rate: f64,
    capacity: f64,
    term: u64,
    /// Round trips to the store, ms, one per region.
    trips: Vec<f64>,
    servers: usize,
    short: bool,
    /// limitador-server, for its scenarios (`--limitador PATH`).
    limitador: Option<PathBuf>,
}

/// A server of a region and its generations (one more each time it is killed).
struct Server {
    region: usize,
    /// The log of each generation.
    logs: Vec<PathBuf>,
    child: Option<Child>,
    schedule: String,
}

/// What a run's servers said and logged, per region.
#[derive(Default)]
struct Ran {
    /// Every request, with its region.
    records: Vec<(usize, Logged)>,
    /// Summed over servers: local, refused, direct, grants, cold.
    counts: [u64; 5],
    /// Store calls during the run (Redis `INFO commandstats`).
    calls: u64,
    span_ms: f64,
}

fn harness(args: &[String]) {
    let short = args.iter().any(|a| a == "--short");
    let trips: String = flag(args, "--trips").unwrap_or_else(|| "50,150,150".into());
    let rate: f64 = flag(args, "--rate").unwrap_or(3_000.0);
    let plan = Plan {
        secs: flag(args, "--secs").unwrap_or(if short { 12.0 } else { 90.0 }),
        rate,
        capacity: flag(args, "--capacity").unwrap_or(rate),
        term: flag(args, "--term").unwrap_or(2_000),
        trips: trips.split(',').map(|t| t.parse().expect("--trips: ms,ms,ms")).collect(),
        servers: flag(args, "--servers").unwrap_or(2),
        short,
        limitador: flag::<String>(args, "--limitador").map(PathBuf::from),
    };
    assert!(plan.trips.len() >= 2, "--trips: at least two regions");
    let only: Option<String> = flag(args, "--only");
    let dir = tempfile::Builder::new()
        .prefix("regions")
        .tempdir_in(if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
        .unwrap();
    let mut redis = OwnRedis::start(dir.path(), false);
    let proxies: Vec<Proxy> = plan
        .trips
        .iter()
        .map(|&trip| Proxy::start(redis.addr(), Duration::from_secs_f64(trip / 2e3)))
        .collect();
    println!(
        "regions: {} regions {:?} ms from Redis, {} servers each; one token bucket of {}/s \
         holding {}, leased (term {} ms); {} s a run",
        plan.trips.len(),
        plan.trips,
        plan.servers,
        plan.rate,
        plan.capacity,
        plan.term,
        plan.secs
    );
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let mut over = 0;
    let mut memory_p99: Option<Vec<f64>> = None;
    if wanted("memory") || wanted("saturated") {
        let ran = run(&plan, &proxies, &mut redis, dir.path(), Scenario::Memory);
        memory_p99 = Some(report("memory", &plan, &ran, None, false).1);
    }
    for scenario in [Scenario::Saturated, Scenario::Cut, Scenario::Swing] {
        if !wanted(scenario.name()) {
            continue;
        }
        let ran = run(&plan, &proxies, &mut redis, dir.path(), scenario);
        let (excess, _) = report(scenario.name(), &plan, &ran, memory_p99.as_deref(), true);
        if excess > 1e-6 {
            over += 1;
        }
        if scenario == Scenario::Swing {
            swing_shares(&plan, &ran);
        }
    }
    if wanted("throughput") {
        throughput(&plan, &proxies, &mut redis, dir.path());
    }
    // Opt-in: it needs wrk, and a tollgate binary.
    if only.as_deref() == Some("throughput-serve") {
        throughput_serve(&plan, &proxies, &mut redis, dir.path(), args);
    }
    if plan.limitador.is_some() {
        for scenario in [Scenario::Limitador, Scenario::LimitadorCut] {
            if wanted(scenario.name()) {
                let ran = run(&plan, &proxies, &mut redis, dir.path(), scenario);
                report_windows(scenario.name(), &plan, &ran);
            }
        }
    }
    redis.stop();
    if over > 0 {
        println!("VIOLATION: {over} runs had an interval over the bound");
        std::process::exit(1);
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Scenario {
    Memory,
    Saturated,
    Cut,
    Swing,
    /// The saturated loads, each server a client of a limitador-server of its own
    /// (`redis_cached` on the region's proxy), the limit a fixed window.
    Limitador,
    /// The same, the last region cut off for the middle third.
    LimitadorCut,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Memory => "memory",
            Scenario::Saturated => "saturated",
            Scenario::Cut => "cut",
            Scenario::Swing => "swing",
            Scenario::Limitador => "limitador",
            Scenario::LimitadorCut => "limitador-cut",
        }
    }

    fn limitador(self) -> bool {
        matches!(self, Scenario::Limitador | Scenario::LimitadorCut)
    }
}

/// The swing's times: when demand swings, when the last region is cut and healed, when one
/// of its servers is killed.
fn swing_times(plan: &Plan) -> (f64, f64, f64, f64) {
    let at = plan.secs / 2.0;
    let cut = if plan.short { plan.secs / 3.0 } else { 30.0_f64.min(plan.secs / 3.0) };
    let from = 0.45 * plan.secs;
    (at, from, from + cut, from + cut / 2.0)
}

/// Each server's schedule (`at:rate,...`) in `scenario`.
fn schedule_of(plan: &Plan, scenario: Scenario, region: usize) -> String {
    let regions = plan.trips.len();
    let per_server = |region_rate: f64| region_rate / plan.servers as f64;
    match scenario {
        Scenario::Memory
        | Scenario::Saturated
        | Scenario::Cut
        | Scenario::Limitador
        | Scenario::LimitadorCut => {
            format!("0:{}", per_server(plan.rate))
        }
        Scenario::Swing => {
            let (at, ..) = swing_times(plan);
            let pair = 2.0 * plan.rate;
            match region {
                0 => format!("0:{},{at}:{}", per_server(0.9 * pair), per_server(0.1 * pair)),
                1 => format!("0:{},{at}:{}", per_server(0.1 * pair), per_server(0.9 * pair)),
                _ => format!("0:{}", per_server(0.5 * plan.rate / (regions - 2) as f64)),
            }
        }
    }
}

fn spawn(
    plan: &Plan,
    url: &str,
    load: &[&str],
    start: u64,
    until: u64,
    log: &Path,
    slots: usize,
) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .arg("child")
        .args(["--url", url, "--key", "global"])
        .args(["--rate", &plan.rate.to_string(), "--capacity", &plan.capacity.to_string()])
        .args(["--term", &plan.term.to_string()])
        .args(["--start", &start.to_string(), "--until", &until.to_string()])
        .args(["--slots", &slots.to_string()])
        .args(load)
        .arg("--log")
        .arg(log)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The scripts Redis ran since its last `CONFIG RESETSTAT` (`EVALSHA`, `EVAL`): every take,
/// grant and give-back is one. (The commands a script calls are counted apart by Redis and
/// are not calls of a client; a process's word of its config to the others, a `SET` and a
/// `GET` at most once a term, is left out.)
fn store_calls(redis: &OwnRedis) -> u64 {
    let url = format!("redis://{}", redis.addr());
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn).unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter(|line| ["evalsha", "eval"].contains(&line.split(':').next().unwrap_or("")))
        .filter_map(|line| line.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

fn reset_stats(redis: &OwnRedis) {
    let url = format!("redis://{}", redis.addr());
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut conn).unwrap();
}

fn run(
    plan: &Plan,
    proxies: &[Proxy],
    redis: &mut OwnRedis,
    dir: &Path,
    scenario: Scenario,
) -> Ran {
    redis.empty();
    // A limitador-server per server for its scenarios, each on its region's proxy.
    let limitadors: Vec<(Child, u16)> = if scenario.limitador() {
        let mut all = Vec::new();
        for proxy in proxies {
            for _ in 0..plan.servers {
                all.push(limitador(plan, dir, &format!("redis://{}", proxy.addr)));
            }
        }
        all
    } else {
        Vec::new()
    };
    reset_stats(redis);
    let start = real_ns();
    let until = start + (plan.secs * 1e9) as u64;
    let slots = (3.0 * plan.rate * plan.secs) as usize + 10_000;
    let url = |region: usize, s: usize| match scenario {
        Scenario::Memory => "memory".to_string(),
        _ if scenario.limitador() => {
            format!("rls://127.0.0.1:{}", limitadors[region * plan.servers + s].1)
        }
        _ => format!("redis://{}", proxies[region].addr),
    };
    let mut servers = Vec::new();
    for region in 0..plan.trips.len() {
        for s in 0..plan.servers {
            let log = dir.join(format!("{}-r{region}-s{s}-0.log", scenario.name()));
            let schedule = schedule_of(plan, scenario, region);
            let load = ["--schedule", schedule.as_str()];
            let child = spawn(plan, &url(region, s), &load, start, until, &log, slots);
            servers.push(Server { region, logs: vec![log], child: Some(child), schedule });
        }
    }
    let last = plan.trips.len() - 1;
    let (cut_at, heal_at, kill_at) = match scenario {
        Scenario::Cut | Scenario::LimitadorCut => {
            (Some(plan.secs / 3.0), 2.0 * plan.secs / 3.0, None)
        }
        Scenario::Swing => {
            let (_, from, to, kill) = swing_times(plan);
            (Some(from), to, Some(kill))
        }
        _ => (None, 0.0, None),
    };
    let (mut cut, mut healed, mut killed) = (false, false, false);
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < plan.secs {
        let elapsed = t0.elapsed().as_secs_f64();
        if let Some(at) = cut_at {
            if !cut && elapsed >= at {
                cut = true;
                proxies[last].cut();
            }
            if cut && !healed && elapsed >= heal_at {
                healed = true;
                proxies[last].heal();
            }
        }
        if let Some(at) = kill_at
            && !killed
            && elapsed >= at
        {
            killed = true;
            let server = servers.iter_mut().find(|s| s.region == last).unwrap();
            let mut child = server.child.take().unwrap();
            let _ = Command::new("kill").args(["-KILL", &child.id().to_string()]).status();
            let _ = child.wait();
            let generation = server.logs.len();
            let log = dir.join(format!("{}-r{last}-killed-{generation}.log", scenario.name()));
            let load = ["--schedule", server.schedule.as_str()];
            server.child = Some(spawn(plan, &url(last, 0), &load, start, until, &log, slots));
            server.logs.push(log);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if cut && !healed {
        proxies[last].heal();
    }
    let mut ran = Ran::default();
    for server in &mut servers {
        if let Some(child) = server.child.take() {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "a server of the run failed: {}", out.status);
            let text = String::from_utf8_lossy(&out.stdout);
            for (sum, word) in ran.counts.iter_mut().zip(text.split_whitespace()) {
                *sum += word.parse::<u64>().unwrap_or(0);
            }
        }
        for log in &server.logs {
            let mut records = Vec::new();
            read_log(log, &mut records);
            ran.records.extend(records.into_iter().map(|r| (server.region, r)));
            let _ = std::fs::remove_file(log);
        }
    }
    ran.calls = if scenario == Scenario::Memory { 0 } else { store_calls(redis) };
    for (mut child, _) in limitadors {
        let _ = child.kill();
        let _ = child.wait();
    }
    let first = ran.records.iter().map(|(_, r)| r.sent).fold(f64::INFINITY, f64::min);
    let end = ran.records.iter().map(|(_, r)| r.answered).fold(0.0, f64::max);
    ran.span_ms = end - first;
    ran
}

/// Starts a limitador-server (`redis_cached` on `url`, its defaults: a flush a second)
/// with the limit as a fixed window of `rate` a second, one counter for the namespace;
/// returns it once its gRPC port answers.
fn limitador(plan: &Plan, dir: &Path, url: &str) -> (Child, u16) {
    let (rls, http) = (free_port(), free_port());
    let limits = dir.join("limitador.yaml");
    let yaml = format!(
        "- namespace: regions\n  max_value: {}\n  seconds: 1\n  conditions: []\n  variables: []\n",
        plan.rate as u64
    );
    std::fs::write(&limits, yaml).unwrap();
    let child = Command::new(plan.limitador.as_ref().unwrap())
        .args(["--rls-ip", "127.0.0.1", "--rls-port", &rls.to_string()])
        .args(["--http-ip", "127.0.0.1", "--http-port", &http.to_string()])
        .arg(&limits)
        .args(["redis_cached", url])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("limitador-server");
    wait_for_port(rls, "limitador-server");
    (child, rls)
}

/// A loopback port free now (a child is told to listen on it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits (at most 20 s) until something listens on loopback `port`: `what`, started.
fn wait_for_port(port: u16, what: &str) {
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{what} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A limitador run's figures. Its limit is a fixed window of `M = rate` a second (limitador
/// has no token bucket); an exact fixed window admits at most `M (ceil(t) + 1)` in any
/// interval of `t` seconds, so at most `2M + M t`: an interval over that is a certain
/// violation of the limit, and the admissions of the whole run are set against `M (T + 1)`.
fn report_windows(name: &str, plan: &Plan, ran: &Ran) {
    let arrivals = ran.records.len();
    let admitted: Vec<&Logged> =
        ran.records.iter().filter(|(_, r)| r.admitted).map(|(_, r)| r).collect();
    let errors = ran.records.iter().filter(|(_, r)| r.error).count();
    let secs = ran.span_ms / 1e3;
    let bound = plan.rate * (secs.ceil() + 1.0);
    let (excess, (count, at)) = worst_interval(&admitted, plan.rate / 1e3, 2.0 * plan.rate);
    println!("\n{name}: {arrivals} requests, {} admitted, {errors} failed", admitted.len());
    println!(
        "  admitted: {} where an exact window of {}/s admits at most {bound:.0} over the run's \
         {secs:.1} s: {:.3}",
        admitted.len(),
        plan.rate,
        admitted.len() as f64 / bound
    );
    println!(
        "  worst interval: {count} admitted where an exact window admits at most {at:.1} \
         (excess {excess:.2}): {}",
        if excess > 1e-6 { "OVER" } else { "within" }
    );
    println!(
        "  store calls: {} ({:.5} a request)",
        ran.calls,
        ran.calls as f64 / arrivals.max(1) as f64
    );
    for region in 0..plan.trips.len() {
        let mut waits: Vec<f64> = ran
            .records
            .iter()
            .filter(|(r, _)| *r == region)
            .map(|(_, l)| l.answered - l.sent)
            .collect();
        waits.sort_by(f64::total_cmp);
        let admitted = ran.records.iter().filter(|(r, l)| *r == region && l.admitted).count();
        println!(
            "  region {region} ({} ms): {} requests, {admitted} admitted ({:.0}/s); p50 {:.3} \
             ms, p99 {:.3} ms",
            plan.trips[region],
            waits.len(),
            admitted as f64 / secs,
            percentile(&waits, 0.5),
            percentile(&waits, 0.99)
        );
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[at]
}

/// Prints a run's figures: the worst interval's excess over the bound (at most 0 when
/// exact), and each region's p99 (ms).
fn report(
    name: &str,
    plan: &Plan,
    ran: &Ran,
    memory_p99: Option<&[f64]>,
    global: bool,
) -> (f64, Vec<f64>) {
    let arrivals = ran.records.len();
    let admitted: Vec<&Logged> =
        ran.records.iter().filter(|(_, r)| r.admitted).map(|(_, r)| r).collect();
    let errors = ran.records.iter().filter(|(_, r)| r.error).count();
    let bound = plan.capacity + plan.rate * ran.span_ms / 1e3;
    let (excess, (count, at)) = worst_interval(&admitted, plan.rate / 1e3, plan.capacity);
    let [local, refused, direct, grants, cold] = ran.counts;
    println!("\n{name}: {arrivals} requests, {} admitted, {errors} failed", admitted.len());
    if global {
        println!(
            "  used: {} of a bound of {bound:.0} over the run's {:.1} s: {:.3}",
            admitted.len(),
            ran.span_ms / 1e3,
            admitted.len() as f64 / bound
        );
        println!(
            "  worst interval: {count} admitted where the bound is {at:.1} (excess {excess:.2}): {}",
            if excess > 1e-6 { "OVER" } else { "within" }
        );
        println!(
            "  store calls: {} ({:.5} a request); servers: {local} from leases, {refused} \
             refused from them, {direct} direct, {grants} grants, {cold} before the key was \
             leased",
            ran.calls,
            ran.calls as f64 / arrivals.max(1) as f64
        );
    }
    let mut p99s = Vec::new();
    for region in 0..plan.trips.len() {
        let mut waits: Vec<f64> = ran
            .records
            .iter()
            .filter(|(r, _)| *r == region)
            .map(|(_, l)| l.answered - l.sent)
            .collect();
        waits.sort_by(f64::total_cmp);
        let n = waits.len();
        let admitted = ran.records.iter().filter(|(r, l)| *r == region && l.admitted).count();
        let p99 = percentile(&waits, 0.99);
        let versus = memory_p99
            .and_then(|m| m.get(region))
            .map(|m| format!(" (memory {m:.3} ms: +{:.3} ms)", p99 - m))
            .unwrap_or_default();
        println!(
            "  region {region} ({} ms): {n} requests, {admitted} admitted ({:.0}/s); p50 {:.3} \
             ms, p99 {p99:.3} ms{versus}, p99.9 {:.3} ms",
            plan.trips[region],
            admitted as f64 / (ran.span_ms / 1e3),
            percentile(&waits, 0.5),
            percentile(&waits, 0.999)
        );
        p99s.push(p99);
        if std::env::var_os("REGIONS_SLOW").is_some() {
            // Requests answered after more than a millisecond, per second of the run.
            let mut slow = vec![0u32; (ran.span_ms / 1e3).ceil() as usize + 1];
            for (_, l) in
                ran.records.iter().filter(|(r, l)| *r == region && l.answered - l.sent > 1.0)
            {
                slow[(l.sent / 1e3) as usize] += 1;
            }
            println!("    slow (> 1 ms) a second: {slow:?}");
        }
    }
    (excess, p99s)
}

/// Region 1's admitted share of regions 0 and 1's per lease term over the run (its demand
/// goes from a tenth of theirs to nine tenths at the swing), and how many terms after the
/// swing it took to reach nine tenths of its share over the terms from the fourth after the
/// swing to the cut's end (the last region's return changes the shares again).
fn swing_shares(plan: &Plan, ran: &Ran) {
    let (at, _, healed, _) = swing_times(plan);
    let term = plan.term as f64;
    let bins = (plan.secs * 1e3 / term).ceil() as usize;
    let mut per_bin = vec![[0u64; 2]; bins];
    for (region, r) in &ran.records {
        if *region > 1 || !r.admitted {
            continue;
        }
        let bin = ((r.answered / term) as usize).min(bins - 1);
        per_bin[bin][*region] += 1;
    }
    let share = |b: &[u64; 2]| b[1] as f64 / (b[0] + b[1]).max(1) as f64;
    let swing = (at * 1e3 / term).ceil() as usize;
    let until = ((healed * 1e3 / term).floor() as usize).min(bins);
    let steady = &per_bin[(swing + 3).min(until)..until];
    let settled = steady.iter().map(share).sum::<f64>() / steady.len().max(1) as f64;
    let reached = per_bin[swing..].iter().position(|b| share(b) >= 0.9 * settled);
    let shares: Vec<String> = per_bin
        .iter()
        .enumerate()
        .map(|(i, b)| format!("{}{:.2}", if i == swing { "| " } else { "" }, share(b)))
        .collect();
    println!(
        "  region 1's share of regions 0 and 1's admissions per term (| the swing): [{}]; \
         {settled:.2} after it until the cut ends, 9/10 of that reached in term {} after it",
        shares.join(", "),
        reached.map_or("never".to_string(), |t| (t + 1).to_string())
    );
}

/// `tollgate serve` in each region, as the issue's topology has it: each server's HTTP API
/// driven by a wrk of its own (closed loop, `POST /v1/limit` of the one key), every server at
/// once, rounds taking turns between the leased global limit (Redis through the region's
/// proxy) and each server's memory store: what a region's servers answer a second. Needs
/// `wrk` on the PATH and the binary (`--tollgate PATH`, default `tollgate` beside this one).
fn throughput_serve(
    plan: &Plan,
    proxies: &[Proxy],
    redis: &mut OwnRedis,
    dir: &Path,
    args: &[String],
) {
    let tollgate: PathBuf = flag::<String>(args, "--tollgate")
        .map_or_else(|| std::env::current_exe().unwrap().with_file_name("tollgate"), PathBuf::from);
    assert!(tollgate.is_file(), "no tollgate binary at {}", tollgate.display());
    let secs = if plan.short { 3 } else { 8 };
    let connections: usize = flag(args, "--connections").unwrap_or(16);
    // Each server's lease counters, wrk's whole report and the servers' logs, to look into.
    let verbose = std::env::var_os("REGIONS_LEASE_COUNTS").is_some();
    let rounds = 3;
    let lua = dir.join("limit.lua");
    std::fs::write(
        &lua,
        "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.body = '{\"name\":\"hot\",\"key\":\"global\"}'\n",
    )
    .unwrap();
    // A store 150 ms away needs a deadline above a round trip or two (a request may wait for
    // a lease on its way, then take directly): the default (250 ms) is for a store nearby.
    let limit = format!(
        "[server]\nstoreDeadline = \"1s\"\n\n[limits.hot]\nkind = \"token bucket\"\nrate = {}\n\
         period = 1000\ncapacity = {}\n",
        plan.rate, plan.capacity
    );
    let leased = dir.join("leased.toml");
    std::fs::write(&leased, format!("{limit}lease = {{ term = \"{}ms\" }}\n", plan.term)).unwrap();
    let memory = dir.join("memory.toml");
    std::fs::write(&memory, &limit).unwrap();
    println!(
        "\nthroughput-serve: each region's {} tollgate serve, each driven by wrk (1 thread, \
         {connections} connections, {secs} s after 1 s of warm-up), every server at once, \
         {rounds} rounds each way taking turns (answered a second, per region)",
        plan.servers
    );
    let mut sums = vec![[0.0f64; 2]; plan.trips.len()];
    for round in 0..rounds {
        for (way, on_memory) in [(0, false), (1, true)] {
            redis.empty();
            let mut servers = Vec::new();
            for (region, proxy) in proxies.iter().enumerate() {
                for _ in 0..plan.servers {
                    let port = free_port();
                    let store = if on_memory {
                        "memory".to_string()
                    } else {
                        format!("redis://{}", proxy.addr)
                    };
                    let config = if on_memory { &memory } else { &leased };
                    let child = Command::new(&tollgate)
                        .args([
                            "serve",
                            "--store",
                            &store,
                            "--listen",
                            &format!("127.0.0.1:{port}"),
                        ])
                        .arg("--config")
                        .arg(config)
                        .stdout(Stdio::null())
                        .stderr(if verbose {
                            let log = format!("/tmp/regions-serve-r{region}-{port}.log");
                            Stdio::from(std::fs::File::create(log).unwrap())
                        } else {
                            Stdio::null()
                        })
                        .spawn()
                        .expect("tollgate serve");
                    wait_for_port(port, "tollgate serve");
                    servers.push((region, port, child));
                }
            }
            let wrk = |port: u16, secs: u64| {
                Command::new("wrk")
                    .args([
                        "-t1",
                        &format!("-c{connections}"),
                        &format!("-d{secs}s"),
                        "--latency",
                        "-s",
                    ])
                    .arg(&lua)
                    .arg(format!("http://127.0.0.1:{port}/v1/limit"))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("wrk")
            };
            // Warm-up: each server's first takes of the key (its round trip measured, its
            // first lease on its way) are not what a running server serves.
            for child in servers.iter().map(|(_, port, _)| wrk(*port, 1)).collect::<Vec<_>>() {
                let _ = child.wait_with_output();
            }
            let runs: Vec<(usize, Child)> =
                servers.iter().map(|(region, port, _)| (*region, wrk(*port, secs))).collect();
            let mut served = vec![0.0f64; plan.trips.len()];
            let mut p99s = vec![String::new(); plan.trips.len()];
            for (region, child) in runs {
                let out = child.wait_with_output().unwrap();
                let text = String::from_utf8_lossy(&out.stdout);
                if verbose {
                    println!("    region {region}: {}", text.replace('\n', " / "));
                }
                let p99 = text.lines().find_map(|l| l.trim().strip_prefix("99%"));
                p99s[region] += &format!(" {}", p99.unwrap_or("?").trim());
                let rate = text
                    .lines()
                    .find_map(|l| l.strip_prefix("Requests/sec:"))
                    .and_then(|r| r.trim().parse::<f64>().ok())
                    .unwrap_or_else(|| panic!("wrk said no rate: {text}"));
                served[region] += rate;
            }
            if !on_memory && verbose {
                for (region, port, _) in &servers {
                    let out = Command::new("curl")
                        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
                        .output()
                        .unwrap();
                    let text = String::from_utf8_lossy(&out.stdout);
                    let counts: Vec<&str> = text
                        .lines()
                        .filter(|l| l.starts_with("tollgate_lease_") && !l.starts_with('#'))
                        .collect();
                    println!("    region {region} :{port}: {}", counts.join(" | "));
                }
            }
            for (_, _, mut child) in servers {
                let _ = child.kill();
                let _ = child.wait();
            }
            let rates: Vec<String> = served.iter().map(|r| format!("{r:.0}")).collect();
            println!(
                "  round {} {}: {} (p99 per server:{})",
                round + 1,
                if on_memory { "memory" } else { "leased" },
                rates.join(", "),
                p99s.join(",")
            );
            for (sum, r) in sums.iter_mut().zip(&served) {
                sum[way] += r;
            }
        }
    }
    for (region, [leased, memory]) in sums.iter().enumerate() {
        println!(
            "  region {region} ({} ms): leased global limit {:.0}/s, memory {:.0}/s: {:.2}x",
            plan.trips[region],
            leased / f64::from(rounds),
            memory / f64::from(rounds),
            leased / memory
        );
    }
}

/// Closed loop, rounds taking turns: leased global limit against memory stores.
fn throughput(plan: &Plan, proxies: &[Proxy], redis: &mut OwnRedis, dir: &Path) {
    let secs = if plan.short { 3.0 } else { 8.0 };
    let rounds = 3;
    println!(
        "\nthroughput: each server {CLOSED} requests in flight for {secs} s, {rounds} rounds \
         each way, taking turns (answered a second, per region)"
    );
    let mut sums = vec![[0.0f64; 2]; plan.trips.len()];
    for round in 0..rounds {
        for (way, memory) in [(0, false), (1, true)] {
            redis.empty();
            let start = real_ns();
            let until = start + (secs * 1e9) as u64;
            // Enough for a memory store's pace (a full log stops its server).
            let slots = (2_000_000.0 * secs) as usize;
            let mut servers = Vec::new();
            for (region, proxy) in proxies.iter().enumerate() {
                for s in 0..plan.servers {
                    let log = dir.join(format!("throughput-{round}-{way}-r{region}-s{s}.log"));
                    let url =
                        if memory { "memory".into() } else { format!("redis://{}", proxy.addr) };
                    let load = ["--closed", &CLOSED.to_string()].map(str::to_string);
                    let load: Vec<&str> = load.iter().map(String::as_str).collect();
                    let child = spawn(plan, &url, &load, start, until, &log, slots);
                    servers.push((region, log, child));
                }
            }
            let mut served = vec![0usize; plan.trips.len()];
            for (region, log, child) in servers {
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "a server failed: {}", out.status);
                let mut records = Vec::new();
                read_log(&log, &mut records);
                served[region] += records.len();
                let _ = std::fs::remove_file(&log);
            }
            let rates: Vec<String> =
                served.iter().map(|&n| format!("{:.0}", n as f64 / secs)).collect();
            println!(
                "  round {} {}: {}",
                round + 1,
                if memory { "memory" } else { "leased" },
                rates.join(", ")
            );
            for (sum, n) in sums.iter_mut().zip(&served) {
                sum[way] += *n as f64;
            }
        }
    }
    for (region, [leased, memory]) in sums.iter().enumerate() {
        println!(
            "  region {region} ({} ms): leased global limit {:.0}/s, memory {:.0}/s: {:.2}x",
            plan.trips[region],
            leased / (rounds as f64 * secs),
            memory / (rounds as f64 * secs),
            leased / memory
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_counts_what_is_due() {
        let steps = schedule("0:100,2:10");
        assert_eq!(due(&steps, 1.0), 100.0);
        assert_eq!(due(&steps, 2.0), 200.0);
        assert_eq!(due(&steps, 3.0), 210.0);
    }
}
