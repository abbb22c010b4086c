//! A reload that changes a limit keeps its states and lets no client past the new limit, on
//! every store, against the binary (issue 45, items 1 and 6): keys exhausted under the old
//! config are still exhausted under a slower rate, a longer period or a higher capacity once
//! the old config would have seen them full (and the store dropped them), and under another
//! number of shards or another kind at once.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::Served;

/// Three token buckets refilled in three seconds (so that an exhausted state is full, and
/// dropped, three seconds later under this config: the reload must come before that, on a
/// loaded machine too), a token bucket of 100 an hour and a fixed window of 100 an hour; their
/// names carry `tag`, so that runs sharing a Redis or a table do not meet.
fn before(tag: &str) -> String {
    format!(
        "[limits.rate{tag}]\nkind = \"token bucket\"\nrate = 10\nperiod = \"3s\"\ncapacity = 10\n\n\
         [limits.period{tag}]\nkind = \"token bucket\"\nrate = 10\nperiod = \"3s\"\ncapacity = 10\n\n\
         [limits.capacity{tag}]\nkind = \"token bucket\"\nrate = 10\nperiod = \"3s\"\ncapacity = 10\n\n\
         [limits.shards{tag}]\nkind = \"token bucket\"\nrate = 100\nperiod = \"1h\"\n\n\
         [limits.kind{tag}]\nkind = \"fixed window\"\nrate = 100\nperiod = \"1h\"\nstart = 0\n"
    )
}

/// The same, each changed: a slower rate, a longer period, a higher capacity, ten shards, a
/// token bucket.
fn after(tag: &str) -> String {
    format!(
        "[limits.rate{tag}]\nkind = \"token bucket\"\nrate = 1\nperiod = \"1h\"\ncapacity = 10\n\n\
         [limits.period{tag}]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1h\"\ncapacity = 10\n\n\
         [limits.capacity{tag}]\nkind = \"token bucket\"\nrate = 10\nperiod = \"3s\"\ncapacity = 10000\n\n\
         [limits.shards{tag}]\nkind = \"token bucket\"\nrate = 100\nperiod = \"1h\"\nshards = 10\n\n\
         [limits.kind{tag}]\nkind = \"token bucket\"\nrate = 100\nperiod = \"1h\"\n"
    )
}

fn serve(dir: &Path, store: &str, config: &Path) -> Served {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store, "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .current_dir(dir);
    Served::start(command, false)
}

/// How many of `n` takes of one token from (name, key) are granted.
fn admitted(served: &Served, name: &str, key: &str, n: usize) -> usize {
    let take = json!({ "name": name, "key": key });
    (0..n)
        .filter(|_| {
            let (status, answer) = served.post("/v1/limit", &[], &take);
            assert_eq!(status, 200, "{answer}");
            answer["ok"] == json!(true)
        })
        .count()
}

fn value(served: &Served, name: &str, key: &str) -> Value {
    let (status, answer) = served.post("/v1/value", &[], &json!({ "name": name, "key": key }));
    assert_eq!(status, 200, "{answer}");
    answer
}

/// Runs the scenario on `store` (`DIR` in it: the test's directory); `drop_full` makes the
/// store drop the states that are full by now, as its own sweep would (none: the store
/// drops them by itself, or keeps them).
fn reload_carries(store: &str, wait: Duration, drop_full: impl Fn(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let tag = format!("{}x{}", std::process::id(), rand_tag());
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, before(&tag)).unwrap();
    let store = store.replace("DIR", dir.path().to_str().unwrap());
    let served = serve(dir.path(), &store, &config);
    let names = ["rate", "period", "capacity", "shards", "kind"].map(|n| format!("{n}{tag}"));
    let [rate, period, capacity, shards, kind] = &names;
    // The hour-long limits first: the refilling ones are exhausted last, just before the reload,
    // which must come while the old config still sees them short of full (3 s).
    for (name, n) in [(shards, 100), (kind, 100), (rate, 10), (period, 10), (capacity, 10)] {
        assert_eq!(admitted(&served, name, "k", n), n, "{name}: {}", served.stderr());
        // Exhausted. The last three refill a token every 300 ms, which a slow store (or a
        // busy machine) may take to answer the ten: those are drained until one is refused.
        let refills = n == 10;
        let mut more = 0;
        while admitted(&served, name, "k", 1) == 1 {
            more += 1;
            assert!(refills && more <= 20, "{name}: not exhausted after {more} more");
        }
    }
    let version = |served: &Served| {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let r = agent.get(&format!("http://{}/v1/config", served.http)).call().unwrap();
        r.headers().get("tollgate-config-version").map(|v| v.to_str().unwrap().to_owned())
    };
    let first = version(&served);
    std::fs::write(&config, after(&tag)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while version(&served) == first {
        assert!(Instant::now() < deadline, "not reloaded: {}", served.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    // A change of shards or kind is carried before the new config serves: nothing back.
    assert_eq!(admitted(&served, shards, "k", 20), 0, "shards: {}", served.stderr());
    assert_eq!(admitted(&served, kind, "k", 20), 0, "kind: {}", served.stderr());
    // Past the moment the old config saw the others full, and the store's drop of full states.
    std::thread::sleep(wait);
    drop_full(dir.path());
    // Under the new config about 0.001 tokens came back to `rate`, 0.01 to `period`.
    assert_eq!(admitted(&served, rate, "k", 12), 0, "rate: {}", served.stderr());
    assert_eq!(admitted(&served, period, "k", 12), 0, "period: {}", served.stderr());
    // `capacity` refills at 10 in 3 s from empty, up to 10,000: the stored state is kept
    // (a dropped one reads as 10,000 at ts 0).
    let kept = value(&served, capacity, "k");
    assert_ne!(kept["ts"], json!(0), "capacity: dropped: {kept}");
    assert!(kept["value"].as_f64().unwrap() < 1_000.0, "capacity: {kept}");
    assert!(served.stderr().contains("carried to its new config"), "{}", served.stderr());
}

/// A tag apart from the process id, for two runs of one test binary.
fn rand_tag() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        % 1_000_000
}

/// The memory store sweeps full states every 10 s: one sweep comes between the moment the
/// old config sees them full (3 s after the reload at most) and 13 s.
#[test]
fn a_reload_carries_every_state_memory() {
    reload_carries("memory", Duration::from_secs(13), |_| {});
}

/// The SQLite store deletes the states whose `full_at` has passed every minute: done here at
/// once with the server's own statement.
#[test]
fn a_reload_carries_every_state_sqlite() {
    reload_carries("sqlite://DIR/states.db", Duration::from_millis(3_500), |dir| {
        let db = rusqlite::Connection::open(dir.join("states.db")).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            * 1e3;
        db.busy_timeout(Duration::from_secs(5)).unwrap();
        db.execute("DELETE FROM tollgate_state WHERE full_at <= ?1", [now]).unwrap();
    });
}

/// Redis expires a state when it is full again, by its own clock.
#[test]
fn a_reload_carries_every_state_redis() {
    let Some(url) = common::backend("TOLLGATE_REDIS_URL") else { return };
    reload_carries(&url, Duration::from_millis(3_500), |_| {});
}

/// The same on Redis Cluster (the keys found on every primary).
#[test]
fn a_reload_carries_every_state_redis_cluster() {
    let Some(url) = common::backend("TOLLGATE_REDIS_CLUSTER_URL") else { return };
    reload_carries(&url, Duration::from_millis(3_500), |_| {});
}

/// PostgreSQL keeps a state until a request leaves it full; a change of kind or shards is
/// carried all the same.
#[test]
fn a_reload_carries_every_state_postgres() {
    let Some(url) = common::backend("TOLLGATE_POSTGRES_URL") else { return };
    reload_carries(&url, Duration::from_millis(3_500), |_| {});
}
