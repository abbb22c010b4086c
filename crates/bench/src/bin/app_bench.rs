//! An axum app rate limited by tollgate's `RateLimitLayer` against the same app with a
//! hand-written async limit on the same client crate, under wrk, with the store on loopback
//! and behind a proxy that delays every chunk by a fixed time each way (a store "a network
//! away"). Loopback only; every run bounded in time.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin app_bench -- redis|postgres [SECONDS] [ROUNDS] [GROUP]
//! cargo run --release -p tollgate-bench --bin app_bench -- server OLD NEW [SECONDS] [ROUNDS]
//! cargo run --release -p tollgate-bench --bin app_bench -- frozen OLD NEW [SECONDS] [ROUNDS]
//! cargo run --release -p tollgate-bench --bin app_bench -- leased TOLLGATE [SECONDS] [ROUNDS]
//! cargo run --release -p tollgate-bench --bin app_bench -- leased-app [SECONDS] [ROUNDS] [window]
//! ```
//!
//! - `redis`: tollgate's layer on `RedisStore` against a fixed window by hand: `INCR` and
//!   `PEXPIRE` in one pipeline on one multiplexed redis-rs connection (`TOLLGATE_REDIS_URL`,
//!   default redis://127.0.0.1:6379). `GROUP` sets the store's `group` (default: the store's
//!   default, 64; 1 sends every request alone).
//! - `postgres`: tollgate's layer on `PgStore` against a one-row `UPDATE ... RETURNING` by
//!   hand on tokio-postgres, prepared once, on as many connections as the store keeps (4),
//!   round robin (`TOLLGATE_POSTGRES_URL`, default postgres://postgres@127.0.0.1/test).
//! - `server`: two `tollgate` binaries (say, one built before a change and one after) serving
//!   `POST /v1/limit` on the memory store, SQLite, and Redis behind the proxy.
//! - `frozen`: the same two binaries on a Redis of the bench's own (a `redis-server` on a
//!   spare loopback port) that is frozen with SIGSTOP: requests a second to a fail-open and
//!   to a fail-closed limit, and their latency, while it hangs.
//! - `leased`: one binary serving one hot limit (every request to it) on the memory store
//!   against Redis (not leased, leased, leased behind the proxy) and PostgreSQL (not leased,
//!   leased), with Redis's `INFO commandstats` read around its rounds.
//! - `leased-app`: the axum app with the layer on one hot limit (a token bucket; `window`: a
//!   fixed window), on the memory store against Redis (not leased, leased) and PostgreSQL
//!   (leased).
//!
//! Each app runs in this process on a Tokio runtime of two threads (as `#[tokio::main]` on
//! this project's two-core machines) and answers `GET /` with `ok` when the limit grants; every
//! request is granted (a limit of a billion a second, keyed by the user header that wrk's
//! script cycles over 10,000 users), so the figure is the cost of the admit path. wrk runs
//! with 2 threads, at 64 and 256 connections, with 0 and 0.5 ms of one-way delay; the two
//! sides of each pair alternate which goes first, round by round, and the median ratio of the
//! rounds is printed after them. A side that answered anything but 200 is reported.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tollgate::store::{PgStore, RedisStore};
use tollgate::tower::{Key, LimitSpec, RateLimitLayer};
use tollgate::{AsyncStore, Config, RateLimiter, SECOND};
use tollgate_bench::proxy::Proxy;
use tollgate_bench::{command_stats, loopback_url};

/// Every request is granted.
const GENEROUS: Config = Config::fixed_window(1e9, SECOND);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: u64| -> u64 {
        args.get(i).map_or(default, |a| a.parse().unwrap_or_else(|_| panic!("{a:?}: a number")))
    };
    match args.first().map(String::as_str) {
        Some("redis") => apps(Backend::Redis, number(1, 5), number(2, 3) as usize, number(3, 64)),
        Some("postgres") => apps(Backend::Postgres, number(1, 5), number(2, 3) as usize, 0),
        Some("server") if args.len() >= 3 => {
            servers(&args[1], &args[2], number(3, 5), number(4, 3) as usize);
        }
        Some("frozen") if args.len() >= 3 => {
            frozen(&args[1], &args[2], number(3, 5), number(4, 2) as usize);
        }
        Some("replicas") if args.len() >= 3 => {
            replicas(&args[1], &args[2], number(3, 5), number(4, 3) as usize);
        }
        Some("leased") if args.len() >= 2 => leased(&args[1], number(2, 5), number(3, 3) as usize),
        Some("leased-app") => {
            let window = args.get(3).is_some_and(|kind| kind == "window");
            leased_app(number(1, 5), number(2, 5) as usize, window);
        }
        _ => {
            eprintln!("usage: app_bench redis|postgres [SECONDS] [ROUNDS] [GROUP]");
            eprintln!("       app_bench server OLD_TOLLGATE NEW_TOLLGATE [SECONDS] [ROUNDS]");
            eprintln!("       app_bench frozen OLD_TOLLGATE NEW_TOLLGATE [SECONDS] [ROUNDS]");
            eprintln!("       app_bench replicas TOLLGATE SENTINEL_URL [SECONDS] [ROUNDS]");
            eprintln!("       app_bench leased TOLLGATE [SECONDS] [ROUNDS]");
            std::process::exit(2);
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    Redis,
    Postgres,
}

/// One wrk run: requests per second, 99th percentile latency, answers other than 2xx, and
/// the CPU time per request of this process (the app and the proxy) and of the store's
/// server, in microseconds (when its process is known).
#[derive(Clone, Copy)]
struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    not_ok: u64,
    app_us: f64,
    store_us: f64,
}

/// User and system CPU time of a process so far, in microseconds (Linux `/proc`).
fn cpu_us(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return f64::NAN };
    // After the command's name, in parentheses: fields 14 (utime) and 15 (stime) of proc(5).
    let fields: Vec<&str> =
        stat.rsplit_once(')').map_or(vec![], |s| s.1.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(f64::NAN);
    (ticks(11) + ticks(12)) * 1e6 / 100.0 // USER_HZ is 100 on Linux
}

/// The process id of the server on `port` of this machine, if `ss` can tell.
fn pid_on_port(port: u16) -> Option<String> {
    let out = Command::new("ss").args(["-Hltnp", &format!("sport = :{port}")]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find("pid=")? + 4;
    Some(text[start..].chars().take_while(char::is_ascii_digit).collect())
}

/// Runs wrk against `url` with `connections` for `secs`, with a script that sends `body`
/// (a POST with a JSON body with `%s` for the key) or a GET with the key in `x-user`.
fn wrk(url: &str, connections: usize, secs: u64, body: Option<&str>, store: Option<&str>) -> Run {
    let script = std::env::temp_dir().join(format!("app_bench_{}.lua", std::process::id()));
    let request = match body {
        Some(body) => format!(
            "local template = '{body}'\nrequest = function()\n  counter = counter + 1\n  \
             local body = string.format(template, 'user-' .. (counter % 10000))\n  \
             return wrk.format('POST', nil, {{['Content-Type'] = 'application/json'}}, body)\nend\n"
        ),
        None => "request = function()\n  counter = counter + 1\n  \
                 return wrk.format('GET', nil, {['x-user'] = 'user-' .. (counter % 10000)}, nil)\nend\n"
            .to_owned(),
    };
    std::fs::write(&script, format!("counter = 0\n{request}")).unwrap();
    let (app0, store0) = (cpu_us("self"), store.map_or(f64::NAN, cpu_us));
    let output = Command::new("wrk")
        .args(["-t2", &format!("-c{connections}"), &format!("-d{secs}s"), "--latency", "-s"])
        .arg(&script)
        .arg(url)
        .stderr(Stdio::inherit())
        .output()
        .expect("wrk (Debian: apt-get install wrk)");
    let text = String::from_utf8_lossy(&output.stdout);
    let field = |prefix: &str| {
        text.lines().find_map(|l| l.trim().strip_prefix(prefix).map(|rest| rest.trim().to_owned()))
    };
    let rps = field("Requests/sec:").and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let p99_ms = field("99%").map_or(f64::NAN, |v| duration_ms(&v));
    let p50_ms = field("50%").map_or(f64::NAN, |v| duration_ms(&v));
    let not_ok = field("Non-2xx or 3xx responses:").and_then(|v| v.parse().ok()).unwrap_or(0)
        + field("Socket errors:").map_or(0, |v| {
            v.split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum()
        });
    let requests = rps * secs as f64;
    let app_us = (cpu_us("self") - app0) / requests;
    let store_us = store.map_or(f64::NAN, |pid| (cpu_us(pid) - store0) / requests);
    Run { rps, p50_ms, p99_ms, not_ok, app_us, store_us }
}

/// A wrk latency (`1.23ms`, `845.00us`, `1.02s`) in ms.
fn duration_ms(text: &str) -> f64 {
    let split = text.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => number / 1_000.0,
        "ms" => number,
        "s" => number * 1_000.0,
        "m" => number * 60_000.0,
        _ => f64::NAN,
    }
}

/// Serves `app` on a free loopback port of `runtime`; its URL.
fn serve(runtime: &tokio::runtime::Runtime, app: Router) -> String {
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    runtime.spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/")
}

/// The app: `GET /` answers `ok`.
fn app() -> Router {
    Router::new().route("/", axum::routing::get(|| async { "ok" }))
}

/// The app behind tollgate's layer on `store`.
fn with_tollgate<S: AsyncStore + 'static>(store: S) -> Router {
    let spec = LimitSpec::new(("perUser", GENEROUS)).key(Key::header("x-user"));
    app().layer(RateLimitLayer::new(Arc::new(RateLimiter::new(store)), spec))
}

/// What the hand-written limits share: the limit, and where a request's user is.
fn user(request: &Request) -> String {
    request.headers().get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
}

/// A fixed window by hand on Redis: `INCR` the user's counter of this second and set it to
/// expire (`PEXPIRE ... NX`, so only the window's first request sets it), one pipeline on one
/// multiplexed connection; refuse over the limit.
async fn redis_window(
    State(conn): State<redis::aio::MultiplexedConnection>,
    request: Request,
    next: Next,
) -> Response {
    let window = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let key = format!("hand:{}:{window}", user(&request));
    let mut conn = conn;
    let counted: redis::RedisResult<(i64,)> = redis::pipe()
        .cmd("INCR")
        .arg(&key)
        .cmd("PEXPIRE")
        .arg(&key)
        .arg(1_000)
        .arg("NX")
        .ignore()
        .query_async(&mut conn)
        .await;
    match counted {
        Ok((n,)) if n as f64 <= GENEROUS.rate() => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// A counter by hand on PostgreSQL: one prepared `UPDATE ... RETURNING` of the user's row,
/// on the next of a few connections (each pipelines what it is given).
async fn postgres_counter(
    State(clients): State<Arc<Vec<(tokio_postgres::Client, tokio_postgres::Statement)>>>,
    request: Request,
    next: Next,
) -> Response {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % clients.len();
    let (client, update) = &clients[i];
    let user = user(&request);
    match client.query_opt(update, &[&user]).await {
        Ok(Some(row)) if (row.get::<_, i64>(0) as f64) <= 1e18 => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The store's address, and a URL that reaches it through `proxy` (or directly).
fn through(url: &str, proxy: Option<&Proxy>) -> String {
    match proxy {
        None => url.to_owned(),
        Some(proxy) => {
            let (scheme, rest) = url.split_once("://").expect("a URL");
            let (auth, rest) = rest.rsplit_once('@').map_or(("", rest), |(a, r)| (a, r));
            let path = rest.find('/').map_or("", |i| &rest[i..]);
            let auth = if auth.is_empty() { String::new() } else { format!("{auth}@") };
            format!("{scheme}://{auth}{}{path}", proxy.addr)
        }
    }
}

/// The loopback address of a store URL (`scheme://[auth@]host:port[/...]`).
fn address(url: &str, default_port: u16) -> SocketAddr {
    let rest = url.split_once("://").expect("a URL").1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host_port = rest.split('/').next().unwrap_or(rest);
    let with_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:{default_port}")
    };
    let with_port = with_port.replace("localhost", "127.0.0.1");
    with_port.parse().unwrap_or_else(|_| panic!("{url}: a loopback IP address and port"))
}

fn apps(backend: Backend, secs: u64, rounds: usize, group: u64) {
    let runtime = runtime();
    let (var, default, port, name) = match backend {
        Backend::Redis => ("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379", 6379, "Redis"),
        Backend::Postgres => {
            ("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test", 5432, "PostgreSQL")
        }
    };
    let url = loopback_url(var, default);
    let delayed = Proxy::start(address(&url, port), Duration::from_micros(500));
    // Redis is one process; PostgreSQL's work is done by a backend process per connection.
    let store_pid = (backend == Backend::Redis).then(|| pid_on_port(address(&url, port).port()));
    let store_pid = store_pid.flatten();
    let store_pid = store_pid.as_deref();
    let server =
        if store_pid.is_some() { format!(" + of the {name} server") } else { String::new() };
    println!(
        "{name}: requests per second (p99 latency, CPU time a request of the app and proxy{server}), \
         wrk -t2, {secs} s a run, {rounds} rounds"
    );
    println!();
    println!("| one-way delay | connections | round | hand-written | tollgate layer | ratio |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (delay, proxy) in [("0", None), ("0.5 ms", Some(&delayed))] {
        let store_url = through(&url, proxy);
        let (hand, tollgate) = match backend {
            Backend::Redis => {
                let client = redis::Client::open(store_url.as_str()).unwrap();
                let conn = runtime.block_on(client.get_multiplexed_async_connection()).unwrap();
                let hand = app().layer(middleware::from_fn_with_state(conn, redis_window));
                let prefix = format!("tollgate-app-bench:{}:", std::process::id());
                let store = RedisStore::builder().prefix(prefix).group(group as usize);
                let store = store.open(&store_url).unwrap();
                (serve(&runtime, hand), serve(&runtime, with_tollgate(store)))
            }
            Backend::Postgres => {
                let clients = runtime.block_on(postgres_hand(&store_url));
                let hand = app().layer(middleware::from_fn_with_state(clients, postgres_counter));
                let store = runtime
                    .block_on(PgStore::builder().table("tollgate_app_bench").open(&store_url));
                (serve(&runtime, hand), serve(&runtime, with_tollgate(store.unwrap())))
            }
        };
        for connections in [64, 256] {
            // A warm-up of each, so that connections and statements are made before timing.
            wrk(&hand, connections, 1, None, None);
            wrk(&tollgate, connections, 1, None, None);
            let mut ratios = Vec::new();
            for round in 0..rounds {
                let (h, t) = if round % 2 == 0 {
                    let h = wrk(&hand, connections, secs, None, store_pid);
                    (h, wrk(&tollgate, connections, secs, None, store_pid))
                } else {
                    let t = wrk(&tollgate, connections, secs, None, store_pid);
                    (wrk(&hand, connections, secs, None, store_pid), t)
                };
                ratios.push(t.rps / h.rps);
                println!(
                    "| {delay} | {connections} | {} | {} | {} | {:.2}x |",
                    round + 1,
                    shown(h),
                    shown(t),
                    t.rps / h.rps
                );
            }
            ratios.sort_by(f64::total_cmp);
            println!(
                "| {delay} | {connections} | median | | | **{:.2}x** |",
                ratios[ratios.len() / 2]
            );
        }
    }
    if backend == Backend::Postgres {
        runtime.block_on(async {
            let (client, connection) =
                tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(connection);
            client
                .batch_execute(
                    "DROP TABLE IF EXISTS tollgate_app_bench_counter; \
                     DROP TABLE IF EXISTS tollgate_app_bench; \
                     DROP FUNCTION IF EXISTS tollgate_app_bench_take; \
                     DROP FUNCTION IF EXISTS tollgate_app_bench_takes;",
                )
                .await
                .unwrap();
        });
    }
}

fn shown(run: Run) -> String {
    let failed = if run.not_ok > 0 { format!(", {} not 200", run.not_ok) } else { String::new() };
    let cpu = if run.store_us.is_nan() {
        format!("{:.0} us", run.app_us)
    } else {
        format!("{:.0}+{:.0} us", run.app_us, run.store_us)
    };
    format!("{:.0} ({:.1} ms, {cpu}{failed})", run.rps, run.p99_ms)
}

/// The hand-written side's table (a row per user, made up front) and its connections, as
/// many as the store keeps, each with the `UPDATE` prepared.
async fn postgres_hand(url: &str) -> Arc<Vec<(tokio_postgres::Client, tokio_postgres::Statement)>> {
    let mut clients = Vec::new();
    for i in 0..4 {
        let (client, connection) =
            tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        if i == 0 {
            client
                .batch_execute(
                    "DROP TABLE IF EXISTS tollgate_app_bench_counter;
                     CREATE TABLE tollgate_app_bench_counter (name text PRIMARY KEY, n bigint NOT NULL);
                     INSERT INTO tollgate_app_bench_counter
                       SELECT 'user-' || g, 0 FROM generate_series(0, 9999) g;",
                )
                .await
                .unwrap();
        }
        let update = client
            .prepare("UPDATE tollgate_app_bench_counter SET n = n + 1 WHERE name = $1 RETURNING n")
            .await
            .unwrap();
        clients.push((client, update));
    }
    Arc::new(clients)
}

/// Two `tollgate serve` binaries on the same stores, `POST /v1/limit` with a key per
/// request, 256 connections: the memory store, a SQLite file, and Redis behind the proxy
/// with 0.5 ms each way.
fn servers(old: &str, new: &str, secs: u64, rounds: usize) {
    // Each server runs in a directory of its own: the binaries' paths must not be relative.
    let path = |p: &str| {
        std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{p}: {e}")).display().to_string()
    };
    let (old, new) = (&path(old), &path(new));
    let redis = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let delayed = Proxy::start(address(&redis, 6379), Duration::from_micros(500));
    let work = tempfile::tempdir().unwrap();
    let config = generous_config(work.path());
    let body = BODY;
    println!(
        "tollgate serve, POST /v1/limit: requests per second (p99 latency), wrk -t2 -c256, {secs} s a run"
    );
    println!();
    println!("| store | round | old | new | new / old |");
    println!("|---|---:|---:|---:|---:|");
    let stores = [
        ("memory", "memory".to_owned()),
        ("SQLite", "sqlite://bench.db".to_owned()),
        ("Redis, 0.5 ms each way", through(&redis, Some(&delayed))),
    ];
    for (name, store) in stores {
        let start =
            |binary: &str, dir: &str| start_server(binary, &store, &config, &work.path().join(dir));
        let (mut old_server, old_url) = start(old, "old");
        let (mut new_server, new_url) = start(new, "new");
        wrk(&old_url, 256, 1, Some(body), None);
        wrk(&new_url, 256, 1, Some(body), None);
        compare(&format!("| {name} "), (&old_url, &new_url), secs, rounds, Some(body), shown);
        for server in [&mut old_server, &mut new_server] {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

/// `rounds` of [`paired`] runs of two servers, a table row each after `prefix` (`| name `,
/// or nothing) with `show` of each run and the second's requests a second over the first's,
/// then the median of those ratios; the runs, in order.
fn compare(
    prefix: &str,
    urls: (&str, &str),
    secs: u64,
    rounds: usize,
    body: Option<&str>,
    show: impl Fn(Run) -> String,
) -> Vec<(Run, Run)> {
    let mut runs = Vec::new();
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let (a, b) = paired(round, urls, 256, secs, body);
        ratios.push(b.rps / a.rps);
        println!("{prefix}| {} | {} | {} | {:.2}x |", round + 1, show(a), show(b), b.rps / a.rps);
        runs.push((a, b));
    }
    ratios.sort_by(f64::total_cmp);
    println!("{prefix}| median | | | **{:.2}x** |", ratios[ratios.len() / 2]);
    runs
}

/// One wrk run of each of two servers, the order alternating with `round` so that a slow
/// spell of the host falls on both sides alike: (old, new).
fn paired(
    round: usize,
    (old, new): (&str, &str),
    connections: usize,
    secs: u64,
    body: Option<&str>,
) -> (Run, Run) {
    if round.is_multiple_of(2) {
        let o = wrk(old, connections, secs, body, None);
        (o, wrk(new, connections, secs, body, None))
    } else {
        let n = wrk(new, connections, secs, body, None);
        (wrk(old, connections, secs, body, None), n)
    }
}

/// A `tollgate serve` of `binary` on `store` with `config`, in `dir`: the process and the
/// base URL of its `/v1/limit`.
fn start_server(
    binary: &str,
    store: &str,
    config: &std::path::Path,
    dir: &std::path::Path,
) -> (std::process::Child, String) {
    let config = config.to_str().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--store", store, "--config", config];
    tollgate_bench::serve(binary, &args, dir, |line| {
        line.strip_prefix("tollgate listening on ").map(|addr| format!("{addr}/v1/limit"))
    })
}

/// `POST /v1/limit`'s body for wrk, a key per request.
const BODY: &str = r#"{"name":"bench","key":"%s"}"#;

/// A server config in `dir` whose one limit, `bench`, grants every request.
fn generous_config(dir: &std::path::Path) -> std::path::PathBuf {
    let config = dir.join("tollgate.toml");
    let limit = "[limits.bench]\nkind = \"fixed window\"\nrate = 1000000000\nperiod = 1000\n";
    std::fs::write(&config, limit).unwrap();
    config
}

/// One hot limit (one key, every request to it, far from its bound) on `tollgate serve`:
/// the memory store against Redis, Redis with the limit leased (`lease = true`), and the
/// same behind the bench's proxy with 0.5 ms each way; paired wrk runs, memory first and
/// second in turn. Redis is `TOLLGATE_REDIS_URL` (loopback only).
fn leased(binary: &str, secs: u64, rounds: usize) {
    let binary = std::fs::canonicalize(binary).unwrap().display().to_string();
    let redis = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let delayed = Proxy::start(address(&redis, 6379), Duration::from_micros(500));
    let work = tempfile::tempdir().unwrap();
    let hot = "[limits.hot]\nkind = \"token bucket\"\nrate = 1000000000\nperiod = 1000\n";
    let config = |name: &str, lease: bool| {
        let path = work.path().join(name);
        std::fs::write(&path, format!("{hot}{}", if lease { "lease = true\n" } else { "" }))
            .unwrap();
        path
    };
    let (plain, leased) = (config("plain.toml", false), config("leased.toml", true));
    let body = r#"{"name":"hot"}"#;
    let (mut memory, memory_url) = start_server(&binary, "memory", &plain, &work.path().join("m"));
    println!(
        "tollgate serve, POST /v1/limit on one hot limit: requests per second (p50, p99), wrk -t2 -c256, {secs} s a run"
    );
    println!();
    println!("| store | round | memory | store | store / memory |");
    println!("|---|---:|---:|---:|---:|");
    let postgres = loopback_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test");
    let stores = [
        ("Redis", redis.clone(), &plain),
        ("Redis, leased", redis.clone(), &leased),
        ("Redis, leased, 0.5 ms each way", through(&redis, Some(&delayed)), &leased),
        ("PostgreSQL", postgres.clone(), &plain),
        ("PostgreSQL, leased", postgres.clone(), &leased),
    ];
    let mut admin = redis::Client::open(redis.as_str()).unwrap().get_connection().unwrap();
    for (i, (name, store, config)) in stores.into_iter().enumerate() {
        let (mut server, url) =
            start_server(&binary, &store, config, &work.path().join(i.to_string()));
        wrk(&memory_url, 256, 1, Some(body), None);
        wrk(&url, 256, 1, Some(body), None);
        let (calls0, usec0) = command_stats(&mut admin, "evalsha");
        let show =
            |run: Run| format!("{:.0} ({:.2} ms, {:.1} ms)", run.rps, run.p50_ms, run.p99_ms);
        let runs =
            compare(&format!("| {name} "), (&memory_url, &url), secs, rounds, Some(body), show);
        for (m, r) in &runs {
            assert_eq!((m.not_ok, r.not_ok), (0, 0), "answers other than 200");
        }
        let served: f64 = runs.iter().map(|(_, r)| r.rps * secs as f64).sum();
        let (calls, usec) = command_stats(&mut admin, "evalsha");
        if store.starts_with("redis") {
            println!(
                "    Redis during its rounds: {:.4} script calls and {:.3} us of Redis time a \
                 request",
                (calls - calls0) / served,
                (usec - usec0) / served
            );
        }
        let metrics =
            Command::new("curl").args(["-s", &url.replace("/v1/limit", "/metrics")]).output();
        if let Ok(out) = metrics {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.starts_with("tollgate_lease_") {
                    println!("    {line}");
                }
            }
        }
        let _ = server.kill();
        let _ = server.wait();
    }
    let _ = memory.kill();
    let _ = memory.wait();
}

/// The axum app with tollgate's layer on one hot limit (every request takes from it, far from
/// its bound): on the memory store against on Redis and on PostgreSQL, the limit leased, in
/// paired wrk rounds (256 connections).
fn leased_app(secs: u64, rounds: usize, window: bool) {
    use tollgate::MemoryStore;
    use tollgate::store::LeaseOptions;
    let runtime = runtime();
    let redis = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let postgres = loopback_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test");
    // Every request granted: a token bucket (or, given `window`, a fixed window) of a
    // billion a second.
    let hot = if window { GENEROUS } else { Config::token_bucket(1e9, SECOND) };
    fn layered<S: AsyncStore + 'static>(hot: Config, store: S) -> Router {
        let limiter = Arc::new(RateLimiter::new(store));
        app().layer(RateLimitLayer::new(limiter, LimitSpec::new(("hot", hot))))
    }
    let memory = serve(&runtime, layered(hot, MemoryStore::new()));
    let prefix = format!("tollgate-app-bench-leased:{}:", std::process::id());
    let open = RedisStore::builder().prefix(prefix.clone()).open(&redis).unwrap();
    let redis_plain = serve(&runtime, layered(hot, open));
    let open = RedisStore::builder().prefix(prefix).lease("hot", LeaseOptions::new());
    let redis_leased = serve(&runtime, layered(hot, open.open(&redis).unwrap()));
    let pg = PgStore::builder().table("tollgate_app_bench").lease("hot", LeaseOptions::new());
    let pg = runtime.block_on(pg.open(&postgres)).unwrap();
    let pg_leased = serve(&runtime, layered(hot, pg));
    println!(
        "the axum app, tollgate's layer on one hot limit ({}): requests per second (p50, p99), wrk -t2 -c256, {secs} s a run",
        if window { "fixed window" } else { "token bucket" }
    );
    println!();
    println!("| store | round | memory | store | store / memory |");
    println!("|---|---:|---:|---:|---:|");
    let show = |run: Run| format!("{:.0} ({:.2} ms, {:.1} ms)", run.rps, run.p50_ms, run.p99_ms);
    for (name, url) in [
        ("Redis, not leased", &redis_plain),
        ("Redis, leased", &redis_leased),
        ("PostgreSQL, leased", &pg_leased),
    ] {
        wrk(&memory, 256, 1, None, None);
        wrk(url, 256, 1, None, None);
        for (m, r) in compare(&format!("| {name} "), (&memory, url), secs, rounds, None, show) {
            // Every request is granted: anything else is a socket error of wrk's, or a
            // store error; said, not hidden.
            if (m.not_ok, r.not_ok) != (0, 0) {
                println!("    not 200 (or socket errors): memory {}, store {}", m.not_ok, r.not_ok);
            }
        }
    }
}

/// What `?replicas=1` costs: one binary, two servers on the same Sentinel-watched primary
/// (`scripts/redis-sentinel start DIR` prints its URL), one without the option and one with
/// it, in paired wrk runs (a key per request, every request granted, so each is a write).
fn replicas(binary: &str, sentinels: &str, secs: u64, rounds: usize) {
    let hosts = sentinels.split_once("://").map_or("", |(_, rest)| rest);
    let hosts = hosts.split('/').next().unwrap_or_default();
    assert!(
        hosts.split(',').all(|h| h.starts_with("127.") || h.starts_with("[::1]")),
        "{sentinels}: loopback Sentinels only"
    );
    let binary = std::fs::canonicalize(binary).unwrap().display().to_string();
    let work = tempfile::tempdir().unwrap();
    let config = generous_config(work.path());
    let body = BODY;
    let waits = format!("{sentinels}{}replicas=1", if sentinels.contains('?') { '&' } else { '?' });
    let (mut without, without_url) =
        start_server(&binary, sentinels, &config, &work.path().join("a"));
    let (mut with, with_url) = start_server(&binary, &waits, &config, &work.path().join("b"));
    println!(
        "tollgate serve on Redis behind Sentinel, POST /v1/limit: requests per second (p99 latency), wrk -t2 -c256, {secs} s a run"
    );
    println!();
    println!("| round | without | replicas=1 | replicas=1 / without |");
    println!("|---:|---:|---:|---:|");
    wrk(&without_url, 256, 1, Some(body), None);
    wrk(&with_url, 256, 1, Some(body), None);
    for (a, b) in compare("", (&without_url, &with_url), secs, rounds, Some(body), shown) {
        assert_eq!((a.not_ok, b.not_ok), (0, 0), "answers other than 200");
    }
    for server in [&mut without, &mut with] {
        let _ = server.kill();
        let _ = server.wait();
    }
}

/// Two servers on a Redis frozen with SIGSTOP: requests a second to a fail-open and to a
/// fail-closed limit while it hangs (every answer a grant or a 503: the figure is how fast
/// the server says so).
fn frozen(old: &str, new: &str, secs: u64, rounds: usize) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut redis = Command::new("redis-server")
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
        .expect("redis-server");
    std::thread::sleep(Duration::from_millis(300));
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("tollgate.toml");
    std::fs::write(
        &config,
        "[limits.open]\nkind = \"fixed window\"\nrate = 1000000000\nperiod = 1000\nfailOpen = true\n\n\
         [limits.closed]\nkind = \"fixed window\"\nrate = 1000000000\nperiod = 1000\n",
    )
    .unwrap();
    let store = format!("redis://127.0.0.1:{port}");
    let (mut old_server, old_url) = start_server(old, &store, &config, &work.path().join("old"));
    let (mut new_server, new_url) = start_server(new, &store, &config, &work.path().join("new"));
    for url in [&old_url, &new_url] {
        wrk(url, 64, 1, Some(r#"{"name":"open","key":"%s"}"#), None);
    }
    let pid = redis.id().to_string();
    let _ = Command::new("kill").args(["-STOP", &pid]).status();
    println!(
        "tollgate serve on a Redis frozen with SIGSTOP, POST /v1/limit: requests a second (p99 latency; answers not 200), wrk -t2 -c64, {secs} s a run"
    );
    println!();
    println!("| limit | round | before | after | after / before |");
    println!("|---|---:|---:|---:|---:|");
    for (limit, body) in [
        ("fail open", r#"{"name":"open","key":"%s"}"#),
        ("fail closed", r#"{"name":"closed","key":"%s"}"#),
    ] {
        let mut ratios = Vec::new();
        for round in 0..rounds {
            let (o, n) = paired(round, (&old_url, &new_url), 64, secs, Some(body));
            ratios.push(n.rps / o.rps);
            let show = |r: Run| format!("{:.0} ({:.1} ms; {} not 200)", r.rps, r.p99_ms, r.not_ok);
            println!(
                "| {limit} | {} | {} | {} | {:.0}x |",
                round + 1,
                show(o),
                show(n),
                n.rps / o.rps
            );
        }
    }
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    for child in [&mut old_server, &mut new_server, &mut redis] {
        let _ = child.kill();
        let _ = child.wait();
    }
}
