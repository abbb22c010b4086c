//! The fault harness of leased limits (issue 34): several processes, each its own
//! `RateLimiter` on one store with the hot limit leased, offered 0.5x, 1x and 10x the limit
//! (one process 80% of it), while this harness kills random holders with -9, stops one with
//! SIGSTOP past its lease, restarts Redis (with an append-only file fsynced on each write, so
//! a restart loses nothing it acknowledged) and, in one scenario, puts 0.5 ms each way between
//! the processes and Redis. Every request is logged by its process, with the times it was sent
//! and answered, into a file mapped in memory (what a killed process logged survives it). Then
//! every interval is checked against the bound and the arrivals are replayed through one
//! in-memory bucket (the oracle).
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin lease_faults
//! target/release/lease_faults [--short] [--secs S] [--procs N] [--rate R] [--only SCENARIO]
//! ```
//!
//! Scenarios: `redis` (a Redis of the harness's own, restarted during each run), `redis-0.5ms`
//! (the same through the delay proxy), `cluster` (`TOLLGATE_REDIS_CLUSTER_URL`, skipped without
//! it unless `TOLLGATE_REQUIRE_BACKENDS=1`). Loopback only; every run is bounded in time.
//! Exits 1 on any interval over its bound.
//!
//! How an interval is checked: a request was decided somewhere between the moment it was
//! sent and the moment its answer came (both on the host's real-time clock, the clock Redis's
//! `TIME` reads). An admission counts in the interval [a, b] only if both lie within it, so a
//! count over the bound is a certain violation; the check takes the worst interval over all
//! (a sweep over the answers in time order, with a segment tree over the start times). For a
//! fixed window the count of each window (admissions wholly inside it) is checked against
//! the allowance (the capacity equals the rate here, so this is the interval bound).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::cell::RefCell;
use std::sync::Arc;
use tollgate::store::{AsyncStore, LeaseOptions, LeaseStats, PgStore, RedisStore};

use tollgate::core::{OneTake, Slot, State, splitmix64};
use tollgate::{Config, RateLimiter, Request};
use tollgate_bench::admissions::{
    Log, Logged, OwnRedis, flag, offer, read_log, real_ns, worst_interval,
};
use tollgate_bench::proxy::Proxy;

/// Requests a process keeps on their way at once.
const IN_FLIGHT: usize = 128;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        child(&args[1..]);
    } else {
        harness(&args);
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Bucket,
    Window,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bucket => "token bucket",
            Kind::Window => "fixed window",
        }
    }

    /// The limit: `rate` a second; a bucket holds a tenth of a second's worth, a window
    /// allows its rate (capacity = rate).
    fn config(self, rate: f64) -> Config {
        match self {
            Kind::Bucket => Config::token_bucket(rate, 1_000.0).with_capacity(rate / 10.0),
            Kind::Window => Config::fixed_window(rate, 1_000.0),
        }
    }
}

// ---------------------------------------------------------------------------------------
// A process of the harness: one RateLimiter on the store, the limit leased.

fn child(args: &[String]) {
    let url: String = flag(args, "--url").expect("--url");
    let prefix: String = flag(args, "--prefix").expect("--prefix");
    let key: String = flag(args, "--key").expect("--key");
    let kind = if flag::<String>(args, "--kind").as_deref() == Some("window") {
        Kind::Window
    } else {
        Kind::Bucket
    };
    let rate: f64 = flag(args, "--rate").expect("--rate");
    let offered: f64 = flag(args, "--offered").expect("--offered");
    let until: u64 = flag(args, "--until").expect("--until");
    let start: u64 = flag(args, "--start").expect("--start");
    let term: u64 = flag(args, "--term").expect("--term");
    let log: PathBuf = flag::<String>(args, "--log").expect("--log").into();
    let slots: usize = flag(args, "--slots").expect("--slots");

    let log = Log::create(&log, slots, start);

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let options = LeaseOptions::new().term(Duration::from_millis(term));
    let config = kind.config(rate);
    let drive = Drive { log, slots, offered, until, key };
    runtime.block_on(async move {
        if url.starts_with("postgres") {
            let store = PgStore::builder().table(TABLE).lease("hot", options).open(&url).await;
            let limiter = RateLimiter::builder(store.unwrap()).define("hot", config).build();
            drive.run(limiter).await;
        } else {
            let store = RedisStore::builder().prefix(prefix).lease("hot", options).open(&url);
            let limiter = RateLimiter::builder(store.unwrap()).define("hot", config).build();
            drive.run(limiter).await;
        }
    });
}

/// The PostgreSQL table of the harness's runs (dropped at its end).
const TABLE: &str = "tollgate_lease_faults";

/// A store that leases, as a process of the harness uses it.
trait Leasing: AsyncStore + Send + Sync + 'static {
    /// Answered from leases, direct takes, grants.
    fn counts(&self) -> (u64, u64, u64);
    async fn release(&self);
}

fn counts(stats: &[(String, Option<String>, LeaseStats)]) -> (u64, u64, u64) {
    stats.iter().fold((0, 0, 0), |(l, d, g), (_, _, s)| (l + s.local, d + s.direct, g + s.grants))
}

impl Leasing for RedisStore {
    fn counts(&self) -> (u64, u64, u64) {
        counts(&self.lease_stats())
    }

    async fn release(&self) {
        let _ = self.release_leases().await;
    }
}

impl Leasing for PgStore {
    fn counts(&self) -> (u64, u64, u64) {
        counts(&self.lease_stats())
    }

    async fn release(&self) {
        let _ = self.release_leases().await;
    }
}

/// A process's load: requests at `offered` a second until `until`, each logged.
struct Drive {
    log: Log,
    slots: usize,
    offered: f64,
    until: u64,
    key: String,
}

impl Drive {
    async fn run<S: Leasing>(self, limiter: RateLimiter<S>) {
        let Drive { mut log, slots, offered, until, key } = self;
        let limiter = Arc::new(limiter);
        let t0 = Instant::now();
        // The errors seen (at most 8 kinds), each with its count.
        let errors: RefCell<Vec<(String, u64)>> = RefCell::new(Vec::new());
        let send = || {
            let limiter = Arc::clone(&limiter);
            let (key, errors) = (key.clone(), &errors);
            async move {
                match limiter.limit_async("hot", Request::new().key(&key)).await {
                    Ok(decision) => Some(decision.ok),
                    Err(e) => {
                        let e = e.to_string();
                        let mut errors = errors.borrow_mut();
                        if let Some((_, n)) = errors.iter_mut().find(|(seen, _)| *seen == e) {
                            *n += 1;
                        } else if errors.len() < 8 {
                            errors.push((e, 1));
                        }
                        None
                    }
                }
            }
        };
        let room = |issued: u64, pending: usize| {
            let due = (offered * t0.elapsed().as_secs_f64()) as u64;
            issued < due && pending < IN_FLIGHT && (issued as usize) < slots
        };
        offer(&mut log, until, room, send).await;
        let errors = errors.into_inner();
        if std::env::var_os("LEASE_FAULTS_ERRORS").is_some() {
            for (error, n) in &errors {
                eprintln!("{n} x {error}");
            }
        }
        limiter.store().release().await;
        let (local, direct, grants) = limiter.store().counts();
        println!("{local} {direct} {grants}");
    }
}

// ---------------------------------------------------------------------------------------
// The harness.

#[derive(Clone, Copy, Debug, PartialEq)]
enum Scenario {
    Redis,
    RedisDelayed,
    Cluster,
    Postgres,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Redis => "redis",
            Scenario::RedisDelayed => "redis-0.5ms",
            Scenario::Cluster => "cluster",
            Scenario::Postgres => "postgres",
        }
    }
}

#[derive(Clone, Copy)]
struct Plan {
    secs: f64,
    procs: usize,
    rate: f64,
    term: u64,
}

/// What one run found.
#[derive(Default)]
struct Found {
    arrivals: u64,
    admitted: u64,
    errors: u64,
    oracle: u64,
    /// The worst interval: admissions over its bound (at most 0 when exact), and the count
    /// and bound there.
    excess: f64,
    worst: (u64, f64),
    local: u64,
    direct: u64,
    grants: u64,
    kills: u32,
    stops: u32,
    restarts: u32,
    lost_records: u64,
}

fn harness(args: &[String]) {
    let short = args.iter().any(|a| a == "--short");
    let plan = Plan {
        secs: flag(args, "--secs").unwrap_or(if short { 3.0 } else { 25.0 }),
        procs: flag(args, "--procs").unwrap_or(4),
        rate: flag(args, "--rate").unwrap_or(if short { 4_000.0 } else { 30_000.0 }),
        term: flag(args, "--term").unwrap_or(1_000),
    };
    let only: Option<String> = flag(args, "--only");
    let require = std::env::var("TOLLGATE_REQUIRE_BACKENDS").is_ok_and(|v| v == "1");
    let dir = tempfile::Builder::new()
        .prefix("lease-faults")
        .tempdir_in(if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
        .unwrap();
    println!(
        "lease_faults: {} processes (one offered 80%), rate {}/s, lease term {} ms, {} s a run",
        plan.procs, plan.rate, plan.term, plan.secs
    );
    let mut redis = OwnRedis::start(dir.path(), true);
    let restart_postgres = args.iter().any(|a| a == "--restart-postgres");
    let mut scenarios =
        vec![Scenario::Redis, Scenario::RedisDelayed, Scenario::Cluster, Scenario::Postgres];
    if let Some(only) = &only {
        scenarios.retain(|s| s.name() == only);
        assert!(!scenarios.is_empty(), "--only: redis, redis-0.5ms, cluster or postgres");
    }
    let proxy = Proxy::start(redis.addr(), Duration::from_micros(500));
    let mut total = Found::default();
    let mut violations = 0;
    let mut run = 0u64;
    println!(
        "{:<12} {:<13} {:>5} {:>9} {:>9} {:>7} {:>7} {:>8} {:>7} {:>9} {:>6}",
        "scenario",
        "limit",
        "load",
        "arrived/s",
        "admitted",
        "local",
        "errors",
        "oracle",
        "ratio",
        "excess",
        "faults"
    );
    for &scenario in &scenarios {
        let url = match scenario {
            Scenario::Redis => format!("redis://{}", redis.addr()),
            Scenario::RedisDelayed => format!("redis://{}", proxy.addr),
            Scenario::Cluster => match backend("TOLLGATE_REDIS_CLUSTER_URL", require) {
                Some(url) => url,
                None => continue,
            },
            Scenario::Postgres => match backend("TOLLGATE_POSTGRES_URL", require) {
                Some(url) => url,
                None => continue,
            },
        };
        assert!(url.contains("127.0.0.1") || url.contains("localhost"), "loopback only: {url}");
        // PostgreSQL serves fewer direct takes a second than Redis on this machine: a
        // lower limit, so that at 10x its bound is what refuses, not the database's speed.
        let rate = if scenario == Scenario::Postgres { plan.rate / 6.0 } else { plan.rate };
        let plan = Plan { rate, ..plan };
        for kind in [Kind::Bucket, Kind::Window] {
            for load in [0.5, 1.0, 10.0] {
                run += 1;
                let restart = match scenario {
                    Scenario::Redis | Scenario::RedisDelayed => Restart::Redis(&mut redis),
                    Scenario::Postgres if restart_postgres => Restart::Postgres,
                    _ => Restart::None,
                };
                let found = one_run(&plan, &url, kind, load, run, dir.path(), restart);
                if found.excess > 1e-6 {
                    violations += 1;
                }
                let faults = format!("{}k{}s{}r", found.kills, found.stops, found.restarts);
                println!(
                    "{:<12} {:<13} {:>4}x {:>9.0} {:>9} {:>6.1}% {:>7} {:>8} {:>7.4} {:>9.2} {:>6}",
                    scenario.name(),
                    kind.name(),
                    load,
                    found.arrivals as f64 / plan.secs,
                    found.admitted,
                    100.0 * found.local as f64 / (found.local + found.direct).max(1) as f64,
                    found.errors,
                    found.oracle,
                    found.admitted as f64 / found.oracle.max(1) as f64,
                    found.excess,
                    faults,
                );
                if found.excess > 1e-6 {
                    println!(
                        "  VIOLATION: {} admissions in an interval whose bound is {:.2}",
                        found.worst.0, found.worst.1
                    );
                }
                total.arrivals += found.arrivals;
                total.admitted += found.admitted;
                total.lost_records += found.lost_records;
                total.grants += found.grants;
                total.kills += found.kills;
                total.stops += found.stops;
                total.restarts += found.restarts;
            }
        }
    }
    redis.stop();
    if scenarios.contains(&Scenario::Postgres)
        && let Ok(url) = std::env::var("TOLLGATE_POSTGRES_URL")
    {
        drop_table(&url);
    }
    println!(
        "total: {} admissions of {} requests checked, {} kills -9, {} SIGSTOPs past the lease, \
         {} store restarts, {} grants; intervals over the bound: {violations}",
        total.admitted, total.arrivals, total.kills, total.stops, total.restarts, total.grants
    );
    if total.lost_records > 0 {
        println!("({} requests of killed processes were sent but not logged)", total.lost_records);
    }
    if violations > 0 {
        std::process::exit(1);
    }
}

/// The URL in `var`; without it the scenario is skipped, or with `require` the harness stops.
fn backend(var: &str, require: bool) -> Option<String> {
    match std::env::var(var) {
        Ok(url) => Some(url),
        Err(_) if require => panic!("{var} is required"),
        Err(_) => {
            println!("skipped: no {var}");
            None
        }
    }
}

/// What a run restarts halfway through.
enum Restart<'a> {
    None,
    Redis(&'a mut OwnRedis),
    /// The machine's PostgreSQL (`pg_ctlcluster ... restart -m fast`), with
    /// `--restart-postgres`.
    Postgres,
}

/// Restarts the machine's PostgreSQL cluster (fast: sessions end, committed data stays) and
/// waits until it answers.
fn restart_postgres() {
    let versions = std::fs::read_dir("/etc/postgresql").expect("Debian's /etc/postgresql");
    let version = versions.flatten().next().expect("a cluster").file_name();
    let status = Command::new("pg_ctlcluster")
        .arg("--skip-systemctl-redirect")
        .arg(&version)
        .args(["main", "restart", "-m", "fast"])
        .status()
        .expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster restart: {status}");
    let started = Instant::now();
    while !Command::new("pg_isready")
        .args(["-h", "127.0.0.1", "-q"])
        .status()
        .is_ok_and(|s| s.success())
    {
        assert!(started.elapsed() < Duration::from_secs(30), "PostgreSQL did not come back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Drops the harness's table and its functions.
fn drop_table(url: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let Ok((client, connection)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await
        else {
            return;
        };
        tokio::spawn(connection);
        let functions = ["take", "takes", "lease", "lfill", "lsum", "lheld"]
            .map(|f| format!("DROP FUNCTION IF EXISTS {TABLE}_{f};"))
            .concat();
        let _ = client.batch_execute(&format!("DROP TABLE IF EXISTS {TABLE}; {functions}")).await;
    });
}

/// One process of a run: its log and, while it runs, the process.
struct Holder {
    log: PathBuf,
    child: Option<Child>,
    stopped_until: Option<Instant>,
}

#[allow(clippy::too_many_arguments)]
fn spawn_child(
    url: &str,
    prefix: &str,
    kind: Kind,
    plan: &Plan,
    offered: f64,
    until: u64,
    start: u64,
    log: &Path,
) -> Child {
    let slots = (offered * plan.secs * 1.2) as usize + 10_000;
    Command::new(std::env::current_exe().unwrap())
        .arg("child")
        .args(["--url", url, "--prefix", prefix, "--key", prefix])
        .args(["--kind", if kind == Kind::Window { "window" } else { "bucket" }])
        .args(["--rate", &plan.rate.to_string(), "--offered", &offered.to_string()])
        .args(["--until", &until.to_string(), "--start", &start.to_string()])
        .args(["--term", &plan.term.to_string(), "--slots", &slots.to_string()])
        .arg("--log")
        .arg(log)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, signal: &str) {
    let _ = Command::new("kill").args([signal, &child.id().to_string()]).status();
}

#[allow(clippy::too_many_lines)]
fn one_run(
    plan: &Plan,
    url: &str,
    kind: Kind,
    load: f64,
    run: u64,
    dir: &Path,
    mut restart: Restart<'_>,
) -> Found {
    if let Restart::Redis(redis) = &restart {
        redis.empty();
    }
    let prefix = format!("lease-faults:{}:{run}:", std::process::id());
    let start = real_ns();
    let until = start + (plan.secs * 1e9) as u64;
    let offered_all = load * plan.rate;
    let share = |i: usize| {
        if i == 0 { 0.8 * offered_all } else { 0.2 * offered_all / (plan.procs - 1) as f64 }
    };
    let mut holders: Vec<Vec<Holder>> = Vec::new();
    for i in 0..plan.procs {
        let log = dir.join(format!("run{run}-p{i}-0.log"));
        let child = spawn_child(url, &prefix, kind, plan, share(i), until, start, &log);
        holders.push(vec![Holder { log, child: Some(child), stopped_until: None }]);
    }
    let mut found = Found::default();
    // The faults: a kill -9 of a random process (started again at once, a new holder) every
    // second or so, one SIGSTOP past the lease's term, one Redis restart.
    let mut seed = splitmix64(run ^ start);
    let mut random = move |n: u64| {
        seed = splitmix64(seed);
        seed % n
    };
    let secs = plan.secs;
    let stop_at = secs / 3.0;
    let restart_at = secs / 2.0;
    let mut next_kill = 0.5 + random(1000) as f64 / 1000.0;
    let (mut stopped, mut restarted) = (false, false);
    let t0 = Instant::now();
    loop {
        let elapsed = t0.elapsed().as_secs_f64();
        if elapsed > secs + 0.2 {
            break;
        }
        for generations in &mut holders {
            let holder = generations.last_mut().unwrap();
            if holder.stopped_until.is_some_and(|t| Instant::now() >= t) {
                signal(holder.child.as_ref().unwrap(), "-CONT");
                holder.stopped_until = None;
            }
        }
        if elapsed >= next_kill && elapsed < secs - 0.5 {
            let i = random(plan.procs as u64) as usize;
            let generation = holders[i].len();
            let holder = holders[i].last_mut().unwrap();
            if holder.stopped_until.is_none() {
                let mut child = holder.child.take().unwrap();
                signal(&child, "-KILL");
                let _ = child.wait();
                found.kills += 1;
                let log = dir.join(format!("run{run}-p{i}-{generation}.log"));
                let child = spawn_child(url, &prefix, kind, plan, share(i), until, start, &log);
                holders[i].push(Holder { log, child: Some(child), stopped_until: None });
            }
            next_kill = elapsed + 0.5 + random(1000) as f64 / 1000.0;
        }
        if !stopped && elapsed >= stop_at {
            stopped = true;
            let i = random(plan.procs as u64) as usize;
            let holder = holders[i].last_mut().unwrap();
            signal(holder.child.as_ref().unwrap(), "-STOP");
            let past = Duration::from_millis(plan.term + 500);
            holder.stopped_until = Some(Instant::now() + past);
            found.stops += 1;
        }
        if !restarted && elapsed >= restart_at {
            restarted = true;
            match &mut restart {
                Restart::None => {}
                Restart::Redis(redis) => {
                    redis.restart(Duration::from_millis(200));
                    found.restarts += 1;
                }
                Restart::Postgres => {
                    restart_postgres();
                    found.restarts += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every process ends by itself at `until`; one still stopped is let go.
    let mut records = Vec::new();
    for generations in &mut holders {
        for holder in generations.iter_mut() {
            if let Some(mut child) = holder.child.take() {
                if holder.stopped_until.is_some() {
                    signal(&child, "-CONT");
                }
                let out = wait_with_deadline(&mut child, Duration::from_secs(30));
                let mut words = out.split_whitespace().map(|w| w.parse::<u64>().unwrap_or(0));
                found.local += words.next().unwrap_or(0);
                found.direct += words.next().unwrap_or(0);
                found.grants += words.next().unwrap_or(0);
            }
            read_log(&holder.log, &mut records);
            let _ = std::fs::remove_file(&holder.log);
        }
    }
    check(kind, plan.rate, start, &prefix, &records, &mut found);
    found
}

fn wait_with_deadline(child: &mut Child, deadline: Duration) -> String {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            // A process of the run that failed on its own (its store would not open, say)
            // makes the run worthless: stop here, its error above.
            assert!(status.success(), "a process of the run failed: {status}");
            break;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return String::new();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        use std::io::Read;
        let _ = stdout.read_to_string(&mut out);
    }
    out
}

/// The interval check and the oracle.
fn check(kind: Kind, rate: f64, start: u64, key: &str, records: &[Logged], found: &mut Found) {
    let config = kind.config(rate);
    found.arrivals = records.len() as u64;
    found.errors = records.iter().filter(|r| r.error).count() as u64;
    let admitted: Vec<&Logged> = records.iter().filter(|r| r.admitted).collect();
    found.admitted = admitted.len() as u64;
    let start_ms = start as f64 / 1e6;
    // The store's alignment of the limit's windows (store time: epoch milliseconds); the
    // limiter aligns by the limit's name and key (seed 0, as every process).
    let alignment = tollgate::core::alignment(&config, 0, "hot", Some(key), 0);
    match kind {
        Kind::Bucket => {
            let per_ms = rate / 1_000.0;
            let (excess, worst) = worst_interval(&admitted, per_ms, config.capacity());
            found.excess = excess;
            found.worst = worst;
        }
        Kind::Window => {
            // Admissions wholly inside each window, against its allowance.
            let mut per_window = std::collections::HashMap::<i64, u64>::new();
            for r in &admitted {
                let window = |t: f64| ((start_ms + t - alignment) / 1_000.0).floor() as i64;
                let (a, b) = (window(r.sent), window(r.answered));
                if a == b {
                    *per_window.entry(a).or_default() += 1;
                }
            }
            let most = per_window.values().copied().max().unwrap_or(0);
            found.excess = most as f64 - rate;
            found.worst = (most, rate);
        }
    }
    // The oracle: every arrival, in the order sent, through one bucket; but for those the
    // store could not answer (down for a restart: refused, fail closed), which no lease
    // changes and the oracle would count as admitted.
    let mut arrivals: Vec<f64> =
        records.iter().filter(|r| !r.error).map(|r| start_ms + r.sent).collect();
    arrivals.sort_by(f64::total_cmp);
    let slot = Slot { name: "hot", key: Some(key), shard: 0, config, alignment };
    let take = OneTake { slot, count: 1.0, reserve: false, writes: true };
    let mut state: Option<State> = None;
    for now in arrivals {
        let (taken, next) = take.decide(now, state);
        if taken.decision.ok {
            found.oracle += 1;
        }
        if next.is_some() {
            state = next;
        }
    }
}
