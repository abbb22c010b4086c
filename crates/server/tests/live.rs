//! Live configuration, against the binary: the config file and the RLS config reloaded on
//! SIGHUP and on each kind of write (in place, a file renamed over it, a Kubernetes
//! ConfigMap's symlink swap) with every state kept; an invalid config refused whole; a reload
//! amid a thousand requests; `check-config`; every `[server]` setting from the environment;
//! draining on SIGTERM.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::{RLS_CONFIG, Served};

/// `tollgate serve --listen 127.0.0.1:0 --store STORE --config CONFIG ARGS`, with `envs`,
/// in `dir`.
fn serve(dir: &Path, store: &str, config: &Path, args: &[&str], envs: &[(&str, &str)]) -> Served {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store, "--config"])
        .arg(config)
        .args(args)
        .envs(envs.iter().copied())
        .env("RUST_LOG", "info")
        .current_dir(dir);
    Served::start(command, args.contains(&"--rls-listen"))
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// `GET path`: the status, the config version header, the body.
fn get(served: &Served, path: &str) -> (u16, Option<String>, String) {
    let mut r = agent().get(&format!("http://{}{path}", served.http)).call().unwrap();
    let version = r.headers().get("tollgate-config-version").map(|v| v.to_str().unwrap().into());
    (r.status().as_u16(), version, r.body_mut().read_to_string().unwrap())
}

/// The defined limits, and the version serving.
fn serving(served: &Served) -> (Value, String) {
    let (status, version, body) = get(served, "/v1/config");
    assert_eq!(status, 200, "{body}");
    (serde_json::from_str(&body).unwrap(), version.expect("Tollgate-Config-Version"))
}

/// A metric's value.
fn metric(served: &Served, series: &str) -> f64 {
    common::metric(&get(served, "/metrics").2, series)
}

/// Waits at most `within` for `done`; false if it never was.
fn within(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(served: &Served, name: &str) {
    let pid = served.child.id().to_string();
    assert!(Command::new("kill").args([name, &pid]).status().unwrap().success());
}

/// A token bucket `slow` of `rate` a day (capacity 10), and `api` of capacity `capacity`.
fn limits(rate: u32, capacity: u32) -> String {
    format!(
        "[limits.slow]\nkind = \"token bucket\"\nrate = {rate}\nperiod = \"1d\"\ncapacity = 10\n\n\
         [limits.api]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1m\"\ncapacity = {capacity}\n"
    )
}

/// How a config file is changed.
#[derive(Clone, Copy, Debug)]
enum Edit {
    /// Truncated and written again, the same file.
    InPlace,
    /// A new file renamed over it, as editors and `kubectl cp` do.
    Rename,
    /// Kubernetes' ConfigMap volume: `tollgate.toml -> ..data/tollgate.toml`, `..data` a
    /// symlink to a directory of this version, swapped for a new one by a rename.
    ConfigMap,
}

/// A config file laid out for `write`, holding `text`: its path.
fn lay_out(dir: &Path, write: Edit, text: &str) -> PathBuf {
    let config = dir.join("tollgate.toml");
    match write {
        Edit::InPlace | Edit::Rename => std::fs::write(&config, text).unwrap(),
        Edit::ConfigMap => {
            let version = dir.join("..2026_11_25_00_00_00.1");
            std::fs::create_dir(&version).unwrap();
            std::fs::write(version.join("tollgate.toml"), text).unwrap();
            std::os::unix::fs::symlink("..2026_11_25_00_00_00.1", dir.join("..data")).unwrap();
            std::os::unix::fs::symlink("..data/tollgate.toml", &config).unwrap();
        }
    }
    config
}

fn rewrite(dir: &Path, write: Edit, text: &str) {
    let config = dir.join("tollgate.toml");
    match write {
        Edit::InPlace => std::fs::write(&config, text).unwrap(),
        Edit::Rename => {
            let new = dir.join(".tollgate.toml.swp");
            std::fs::write(&new, text).unwrap();
            std::fs::rename(&new, &config).unwrap();
        }
        Edit::ConfigMap => {
            // What the kubelet does: the new version's directory, a symlink to it, renamed
            // over `..data`; then the old directory goes.
            let version = dir.join("..2026_11_25_00_01_00.2");
            std::fs::create_dir(&version).unwrap();
            std::fs::write(version.join("tollgate.toml"), text).unwrap();
            std::os::unix::fs::symlink("..2026_11_25_00_01_00.2", dir.join("..data_tmp")).unwrap();
            std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
            std::fs::remove_dir_all(dir.join("..2026_11_25_00_00_00.1")).unwrap();
        }
    }
}

/// `value` and `ts` of (name, key).
fn state(served: &Served, name: &str, key: &str) -> (f64, f64) {
    let (status, body) = served.post("/v1/value", &[], &json!({ "name": name, "key": key }));
    assert_eq!(status, 200, "{body}");
    (body["value"].as_f64().unwrap(), body["ts"].as_f64().unwrap())
}

/// For each kind of write: a limit's rate and another's capacity changed, served within 2 s,
/// and the keys that had spent tokens go on from their stored state under the new config,
/// exactly as SPEC §2 computes it.
fn each_kind_of_write(store: &str) {
    for write in [Edit::InPlace, Edit::Rename, Edit::ConfigMap] {
        let dir = tempfile::tempdir().unwrap();
        let config = lay_out(dir.path(), write, &limits(10, 10));
        let store = store.replace("DIR", dir.path().to_str().unwrap());
        let served = serve(dir.path(), &store, &config, &[], &[]);
        let (defined, before) = serving(&served);
        assert_eq!(defined["slow"]["rate"], json!(10));
        for name in ["slow", "api"] {
            let take = json!({ "name": name, "key": "k", "count": 4 });
            assert_eq!(served.post("/v1/limit", &[], &take), (200, json!({ "ok": true })));
        }
        let (value, ts) = state(&served, "slow", "k");
        assert_eq!(value, 6.0, "{write:?}");

        rewrite(dir.path(), write, &limits(20, 3));
        let changed = within(Duration::from_secs(2), || serving(&served).1 != before);
        assert!(changed, "{store} {write:?}: not served within 2 s: {}", served.stderr());
        let (defined, _) = serving(&served);
        assert_eq!(
            (&defined["slow"]["rate"], &defined["api"]["capacity"]),
            (&json!(20), &json!(3))
        );

        // `api`: 6 left of 10, now at most 3 (SPEC §2's min with capacity): 3 - 1.
        let take = json!({ "name": "api", "key": "k", "count": 1 });
        assert_eq!(served.post("/v1/limit", &[], &take), (200, json!({ "ok": true })));
        assert_eq!(state(&served, "api", "k").0, 2.0, "{store} {write:?}");
        // `slow`: refilled from its stored value and ts at the new rate, 20 a day.
        let take = json!({ "name": "slow", "key": "k", "count": 1 });
        assert_eq!(served.post("/v1/limit", &[], &take), (200, json!({ "ok": true })));
        let (after, now) = state(&served, "slow", "k");
        let per_ms = 20.0 / 86_400_000.0;
        let expected = (value + (now - ts) * per_ms).min(10.0) - 1.0;
        assert_eq!(after, expected, "{store} {write:?}: from ({value}, {ts}) to {now}");
        let old_rate = (value + (now - ts) * (10.0 / 86_400_000.0)).min(10.0) - 1.0;
        assert_ne!(after, old_rate, "the new rate, not the old one");
        assert_eq!(metric(&served, "tollgate_config_reloads_total"), 1.0, "{write:?}");
    }
}

#[test]
fn each_kind_of_write_is_served_keeping_every_state_memory() {
    each_kind_of_write("memory");
}

#[test]
fn each_kind_of_write_is_served_keeping_every_state_sqlite() {
    each_kind_of_write("sqlite://DIR/states.db");
}

/// [`RLS_CONFIG`] with `user` at 5 a minute.
fn rls_v2() -> String {
    RLS_CONFIG.replace("requests_per_unit: 3", "requests_per_unit: 5")
}

/// The limit `POST /json` applies to `user` in `edge` (a user of its own each time).
fn rls_limit(served: &Served) -> Value {
    static USERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let user = USERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_string();
    let request = json!({ "domain": "edge", "descriptors": [{ "entries": [{ "key": "user", "value": user }] }] });
    let (status, body) = served.post("/json", &[], &request);
    assert_eq!(status, 200, "{body}");
    body["statuses"][0]["currentLimit"]["requestsPerUnit"].clone()
}

/// SIGHUP reloads at once (the config file and the RLS rules); a `[server]` setting that
/// needs a restart is logged as such, and the rest of the reload is applied.
#[test]
fn sighup_reloads_the_limits_and_the_rls_rules() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, limits(10, 10)).unwrap();
    let rls = dir.path().join("rls.yaml");
    std::fs::write(&rls, RLS_CONFIG).unwrap();
    let served =
        serve(dir.path(), "memory", &config, &["--rls-config", rls.to_str().unwrap()], &[]);
    assert_eq!(rls_limit(&served), json!(3));
    let (_, first) = serving(&served);

    std::fs::write(&config, format!("[server]\nstoreDeadline = 100\n\n{}", limits(10, 5))).unwrap();
    std::fs::write(&rls, rls_v2()).unwrap();
    signal(&served, "-HUP");
    assert!(within(Duration::from_secs(2), || serving(&served).1 != first), "{}", served.stderr());
    assert_eq!(serving(&served).0["api"]["capacity"], json!(5));
    assert_eq!(rls_limit(&served), json!(5));
    let log = served.stderr();
    assert!(log.contains("config reloaded (SIGHUP)"), "{log}");
    assert!(
        log.contains(
            "[server] storeDeadline changed: it takes a restart to apply; the rest of \
                      this reload is applied"
        ),
        "{log}"
    );
    // The version is in /healthz, /metrics and the header, the same everywhere.
    let (_, version) = serving(&served);
    let (status, _, health) = get(&served, "/healthz");
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!((status, &health["config"]["version"]), (200, &json!(version)));
    assert!(health["config"]["loadedAt"].as_f64().unwrap() > 1.7e12);
    let (_, _, metrics) = get(&served, "/metrics");
    assert!(metrics.contains(&format!("tollgate_config_info{{version=\"{version}\"}} 1")));
    // SIGHUP with nothing changed: nothing reloaded.
    let reloads = metric(&served, "tollgate_config_reloads_total");
    signal(&served, "-HUP");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(metric(&served, "tollgate_config_reloads_total"), reloads);
    assert_eq!(serving(&served).1, version);
    // A limit removed is not defined any more.
    let only_api = limits(10, 5);
    let only_api = &only_api[only_api.find("[limits.api]").unwrap()..];
    std::fs::write(&config, only_api).unwrap();
    signal(&served, "-HUP");
    assert!(within(Duration::from_secs(2), || serving(&served).1 != version));
    assert_eq!(served.post("/v1/limit", &[], &json!({ "name": "slow" })).0, 404);
    assert_eq!(served.post("/v1/limit", &[], &json!({ "name": "api" })).0, 200);
}

/// A reload whose file changes a setting that a variable overrides says that the file's
/// value is not applied (it was silent: an operator saw the file change and nothing happen).
#[test]
fn a_reload_says_when_a_variable_overrides_the_files_change() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    let with =
        |origin: &str| format!("[server]\ncorsOrigins = [\"{origin}\"]\n\n{}", limits(10, 10));
    std::fs::write(&config, with("https://a.example")).unwrap();
    let envs = [("TOLLGATE_CORS_ORIGINS", "https://env.example")];
    let served = serve(dir.path(), "memory", &config, &[], &envs);
    let (_, first) = serving(&served);
    std::fs::write(&config, with("https://b.example")).unwrap();
    assert!(within(Duration::from_secs(3), || serving(&served).1 != first), "{}", served.stderr());
    let said = "[server] corsOrigins changed in the file, but TOLLGATE_CORS_ORIGINS overrides it";
    assert!(
        within(Duration::from_secs(2), || served.stderr().contains(said)),
        "{}",
        served.stderr()
    );
}

/// An RLS directory holding a symlink to nothing, or a symlink loop, is refused whole by a
/// reload and by `check-config` (issue 45, items 7 and 8): the first was skipped in silence
/// (its domain dropped: `/json` answered OK where it answered OVER_LIMIT); the second never
/// finished loading, and blocked every later reload. Here the old rules go on serving, the
/// error metric rises, a later good reload is applied, and `check-config` says why.
#[test]
fn an_rls_directory_with_a_broken_symlink_or_a_loop_is_refused_whole() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, limits(10, 10)).unwrap();
    let rls = dir.path().join("rls");
    std::fs::create_dir_all(rls.join("z")).unwrap();
    std::fs::write(rls.join("edge.yaml"), RLS_CONFIG).unwrap();
    let served =
        serve(dir.path(), "memory", &config, &["--rls-config", rls.to_str().unwrap()], &[]);
    assert_eq!(rls_limit(&served), json!(3));
    let errors = || metric(&served, "tollgate_config_reload_errors_total");
    let check = |rls: &Path| {
        let (code, _, err) = check_config(
            &["--config", config.to_str().unwrap(), "--rls-config", rls.to_str().unwrap()],
            &[],
        );
        (code, err)
    };
    // A symlink to nothing.
    symlink(rls.join("gone.yaml"), rls.join("other.yaml")).unwrap();
    assert!(within(Duration::from_secs(3), || errors() == 1.0), "{}", served.stderr());
    assert_eq!(rls_limit(&served), json!(3), "the old rules go on");
    let (code, err) = check(&rls);
    assert!(code == 1 && err.contains("other.yaml is a symlink to"), "{err}");
    std::fs::remove_file(rls.join("other.yaml")).unwrap();
    // A loop: refused at once (check-config within its 10 s, if it hung).
    symlink(".", rls.join("z/a")).unwrap();
    symlink("..", rls.join("z/b")).unwrap();
    assert!(within(Duration::from_secs(3), || errors() >= 2.0), "{}", served.stderr());
    let started = Instant::now();
    let (code, err) = check(&rls);
    assert!(code == 1 && err.contains("a symlink loop"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let (status, _, _) = get(&served, "/healthz");
    assert_eq!(status, 200);
    // Fixed: the next reload is applied.
    std::fs::remove_file(rls.join("z/a")).unwrap();
    std::fs::remove_file(rls.join("z/b")).unwrap();
    std::fs::write(rls.join("edge.yaml"), rls_v2()).unwrap();
    assert!(
        within(Duration::from_secs(3), || rls_limit(&served) == json!(5)),
        "{}",
        served.stderr()
    );
}

/// Bad TOML, an unknown kind, a negative rate (beside a new valid limit), a broken RLS
/// YAML: each is refused whole, the old config goes on serving, the error metric rises, and
/// the log names the file and the field.
#[test]
fn an_invalid_config_is_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    let good = limits(10, 10);
    std::fs::write(&config, &good).unwrap();
    let rls = dir.path().join("rls.yaml");
    std::fs::write(&rls, RLS_CONFIG).unwrap();
    let served =
        serve(dir.path(), "memory", &config, &["--rls-config", rls.to_str().unwrap()], &[]);
    let (defined, version) = serving(&served);
    let config_path = config.display().to_string();
    let rls_path = rls.display().to_string();
    let leaky = good
        .replace("[limits.api]\nkind = \"token bucket\"", "[limits.api]\nkind = \"leaky bucket\"");
    let negative = format!(
        "{}\n[limits.new]\nkind = \"fixed window\"\nrate = 1\nperiod = 1000\n",
        good.replace("rate = 10\nperiod = \"1m\"", "rate = -1\nperiod = \"1m\"")
    );
    let broken_rls = RLS_CONFIG.replace("unit: minute", "unit: fortnight");
    let bad: [(&Path, String, &str, Vec<String>); 4] = [
        (
            &config,
            format!("{good}\n[limits.x\n"),
            "bad TOML",
            vec![format!("in {config_path}: TOML parse error at line")],
        ),
        (
            &config,
            leaky,
            "unknown kind",
            vec![format!("in {config_path}: [limits.api]"), "leaky bucket".into()],
        ),
        (
            &config,
            negative,
            "negative rate",
            vec![format!("in {config_path}: [limits.api]: invalid config: rate is -1")],
        ),
        (&rls, broken_rls, "broken RLS YAML", vec![format!("{rls_path}: "), "fortnight".into()]),
    ];
    for (i, (file, text, what, words)) in bad.iter().enumerate() {
        std::fs::write(file, text).unwrap();
        let errors = i as f64;
        let refused = within(Duration::from_secs(2), || {
            metric(&served, "tollgate_config_reload_errors_total") > errors
        });
        assert!(refused, "{what}: no reload error counted: {}", served.stderr());
        assert_eq!(
            serving(&served),
            (defined.clone(), version.clone()),
            "{what}: the old one serves"
        );
        assert_eq!(rls_limit(&served), json!(3), "{what}");
        let take = json!({ "name": "api", "key": format!("k{i}") });
        assert_eq!(served.post("/v1/limit", &[], &take), (200, json!({ "ok": true })), "{what}");
        let log = served.stderr();
        let line = log
            .lines()
            .filter(|l| l.contains("config reload (a file changed) refused"))
            .nth(i)
            .unwrap_or_else(|| panic!("{what}: no log line: {log}"));
        assert!(line.contains(&format!("version {version} goes on serving")), "{line}");
        for word in words {
            assert!(line.contains(word.as_str()), "{what}: {word:?} not in {line}");
        }
        // Back to the good files (the same version: nothing to reload).
        std::fs::write(&config, &good).unwrap();
        std::fs::write(&rls, RLS_CONFIG).unwrap();
        std::thread::sleep(Duration::from_millis(400));
    }
    assert_eq!(metric(&served, "tollgate_config_reloads_total"), 0.0);
    assert_eq!(metric(&served, "tollgate_config_reload_errors_total"), 4.0);
}

/// A transaction of `a` and `b` on a fresh key, each reserving 9: under the old config `a`
/// (capacity 6) books ahead and `b` (12) does not; under the new one the other way round.
/// A mix of the two configs within one transaction would show both, or neither.
const OLD: &str = "[limits.a]\nkind = \"token bucket\"\nrate = 6\nperiod = \"1m\"\n\n\
                   [limits.b]\nkind = \"token bucket\"\nrate = 12\nperiod = \"1m\"\n";
const NEW: &str = "[limits.a]\nkind = \"token bucket\"\nrate = 12\nperiod = \"1m\"\n\n\
                   [limits.b]\nkind = \"token bucket\"\nrate = 6\nperiod = \"1m\"\n";

fn transaction_body(key: &str) -> Value {
    json!({ "limits": [
        { "name": "a", "key": key, "count": 9, "reserve": true },
        { "name": "b", "key": key, "count": 9, "reserve": true },
    ] })
}

/// [`transaction_body`] as an HTTP/1.1 request.
fn transaction(key: &str) -> Vec<u8> {
    let body = transaction_body(key).to_string();
    format!(
        "POST /v1/transaction HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Which config answered a transaction: `Some(false)` the old, `Some(true)` the new.
fn which(answer: &Value) -> Option<bool> {
    let waits = |i: usize| answer["results"][i].get("retryAfter").is_some();
    match (answer["ok"].as_bool(), waits(0), waits(1)) {
        (Some(true), true, false) => Some(false),
        (Some(true), false, true) => Some(true),
        _ => None,
    }
}

/// Reads `n` HTTP/1.1 answers (each with a Content-Length) from `tcp`.
fn answers(tcp: &mut TcpStream, n: usize) -> Vec<(u16, Value)> {
    let mut buffer = Vec::new();
    let mut out = Vec::new();
    let mut chunk = [0u8; 8192];
    while out.len() < n {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .expect("content-length");
            if buffer.len() >= end + 4 + length {
                let status = head[9..12].parse().unwrap();
                let body = serde_json::from_slice(&buffer[end + 4..end + 4 + length]).unwrap();
                out.push((status, body));
                buffer.drain(..end + 4 + length);
                continue;
            }
        }
        let n = tcp.read(&mut chunk).unwrap();
        assert!(n > 0, "the connection closed");
        buffer.extend_from_slice(&chunk[..n]);
    }
    out
}

/// A reload while 800 requests are in flight (200 connections, 4 pipelined on each): none is
/// lost, each is answered under the old config or the new one, never a mix; 200 before it
/// see the old one only.
#[test]
fn a_reload_amid_a_thousand_requests_loses_none_and_mixes_none() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, OLD).unwrap();
    let served = serve(dir.path(), "memory", &config, &[], &[]);
    let (_, first) = serving(&served);
    let addr = served.http;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(5));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let barrier = std::sync::Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut connections: Vec<TcpStream> =
                    (0..50).map(|_| TcpStream::connect(addr).unwrap()).collect();
                let mut before = Vec::new();
                for (c, tcp) in connections.iter_mut().enumerate() {
                    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                    tcp.write_all(&transaction(&format!("{t}-{c}-0"))).unwrap();
                    before.extend(answers(tcp, 1));
                }
                barrier.wait();
                for (c, tcp) in connections.iter_mut().enumerate() {
                    let pipelined: Vec<u8> =
                        (1..=4).flat_map(|i| transaction(&format!("{t}-{c}-{i}"))).collect();
                    tcp.write_all(&pipelined).unwrap();
                }
                let during: Vec<(u16, Value)> =
                    connections.iter_mut().flat_map(|tcp| answers(tcp, 4)).collect();
                (before, during)
            })
        })
        .collect();
    barrier.wait();
    std::fs::write(&config, NEW).unwrap();
    signal(&served, "-HUP");
    let (mut old, mut new, mut answered) = (0, 0, 0);
    for thread in threads {
        let (before, during) = thread.join().unwrap();
        for (status, body) in &before {
            assert_eq!((status, which(body)), (&200, Some(false)), "{body}");
        }
        for (status, body) in &during {
            assert_eq!(*status, 200, "{body}");
            match which(body) {
                Some(false) => old += 1,
                Some(true) => new += 1,
                None => panic!("a mix of two configs: {body}"),
            }
        }
        answered += before.len() + during.len();
    }
    assert_eq!((answered, old + new), (1_000, 800));
    assert!(within(Duration::from_secs(2), || serving(&served).1 != first));
    let after = served.post("/v1/transaction", &[], &transaction_body("after"));
    assert_eq!((after.0, which(&after.1)), (200, Some(true)), "{}", after.1);
    eprintln!(
        "in flight during the reload: {old} answered under the old config, {new} under the new"
    );
}

fn check_config(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check-config")
        .args(args)
        .env_remove("TOLLGATE_CONFIG")
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap(), text(&out.stdout), text(&out.stderr))
}

/// `check-config` says what `serve` would: exit 0 and what it found, or exit 1 and each error.
#[test]
fn check_config_exits_0_or_1_with_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    let rls = dir.path().join("rls.yaml");
    std::fs::write(&config, limits(10, 10)).unwrap();
    std::fs::write(&rls, RLS_CONFIG).unwrap();
    let (c, r) = (config.to_str().unwrap(), rls.to_str().unwrap());
    let (code, out, err) = check_config(&["--config", c, "--rls-config", r], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("{c}: ok, version ")), "{out}");
    assert!(out.contains("limits: api, slow"), "{out}");
    assert!(out.contains(&format!("rls:    {r} (domains: edge)")), "{out}");
    // The same version a server of these files reports.
    let served = serve(dir.path(), "memory", &config, &["--rls-config", r], &[]);
    let version = out.split("version ").nth(1).unwrap().lines().next().unwrap();
    assert_eq!(serving(&served).1, version);
    drop(served);

    for (text, yaml, message) in [
        ("[limits.x\n", RLS_CONFIG, format!("error: in {c}: TOML parse error at line 1")),
        (
            "[limits.x]\nkind = \"leaky bucket\"\nrate = 1\nperiod = 1000\n",
            RLS_CONFIG,
            format!("error: in {c}: [limits.x]"),
        ),
        (
            "[limits.x]\nkind = \"token bucket\"\nrate = -1\nperiod = 1000\n",
            RLS_CONFIG,
            format!("error: in {c}: [limits.x]: invalid config: rate is -1"),
        ),
        ("", "domain: edge\ndescriptors: [\n", format!("error: {r}: error loading config file")),
    ] {
        std::fs::write(&config, text).unwrap();
        std::fs::write(&rls, yaml).unwrap();
        let (code, out, err) = check_config(&["--config", c, "--rls-config", r], &[]);
        assert_eq!((code, out.as_str()), (1, ""), "{text}{yaml}: {err}");
        assert!(err.starts_with(&message), "{message:?} in {err}");
    }
    // The environment too, and TOLLGATE_CONFIG for the file.
    std::fs::write(&config, limits(10, 10)).unwrap();
    let (code, _, err) =
        check_config(&[], &[("TOLLGATE_CONFIG", c), ("TOLLGATE_MAX_KEYS", "lots")]);
    assert_eq!(code, 1);
    assert_eq!(
        err.trim(),
        format!("error: in {c}: TOLLGATE_MAX_KEYS is \"lots\"; it must be a whole number")
    );
}

/// `check-config` refuses what `serve` refuses before it opens the store (issue 45, item 10):
/// a store URL of no store, or in a form its store does not take; an empty `TOLLGATE_STORE`;
/// a public address without tokens (unless allowed, as for `serve`). Each with the message
/// `serve` gives, and `check-config` says it did not connect.
#[test]
fn check_config_refuses_what_serve_refuses() {
    let dir = tempfile::tempdir().unwrap();
    // What `serve` says, within 10 s (a server that starts instead is stopped: exit -1).
    let serve_says = |envs: &[(&str, &str)], args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("serve")
            .args(args)
            .env_remove("TOLLGATE_CONFIG")
            .envs(envs.iter().copied())
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stopped = within(Duration::from_secs(10), || child.try_wait().unwrap().is_some());
        if !stopped {
            child.kill().unwrap();
        }
        let out = child.wait_with_output().unwrap();
        let code = if stopped { out.status.code().unwrap() } else { -1 };
        (code, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (store, why) in [
        ("bogus://x", "unknown store"),
        ("memory://foo", "unknown store"),
        ("sqlite://", "give a file"),
        ("redis://h:notaport", "did not parse"),
        ("redis://127.0.0.1:6379/abc", "Invalid database number"),
        ("postgres://u@h/db?bogus=1", "unknown option `bogus`"),
        ("", "the store is empty"),
    ] {
        let envs = [("TOLLGATE_STORE", store)];
        let (code, out, err) = check_config(&[], &envs);
        assert_eq!((code, out.as_str()), (1, ""), "{store:?}: {err}");
        assert!(err.contains("TOLLGATE_STORE") && err.contains(why), "{store:?}: {err}");
        let (code, served) = serve_says(&envs, &["--listen", "127.0.0.1:0"]);
        assert_eq!(code, 2, "{store:?}: {served}");
        assert!(served.contains(why), "{store:?}: {served}");
        let (code, _, err) = check_config(&["--store", store], &[]);
        assert_eq!(code, 1, "--store {store:?}: {err}");
    }
    let refused = "refusing to listen on 0.0.0.0:8787 without tokens";
    let (code, _, err) = check_config(&["--listen", "0.0.0.0:8787"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(refused), "{err}");
    let (code, served) = serve_says(&[("TOLLGATE_LISTEN", "0.0.0.0:8787")], &[]);
    assert!(code == 2 && served.contains(refused), "{served}");
    let (code, out, err) =
        check_config(&["--listen", "0.0.0.0:8787", "--allow-unauthenticated-public"], &[]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = check_config(&["--listen", "0.0.0.0:8787"], &[("TOLLGATE_TOKENS", "t0k")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("store:  sqlite://tollgate.db (its form checked; not connected)"),
        "{out}"
    );
}

/// Each setting from its variable (shown through what the server does with it), the flag
/// over the variable, the variable over the file; a bad value named; `serve --help` lists
/// every variable.
#[test]
fn serve_reads_every_setting_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, format!("[server]\npublicMetrics = false\n\n{}", limits(10, 10)))
        .unwrap();
    let served = serve(
        dir.path(),
        "memory",
        &config,
        &[],
        &[
            ("TOLLGATE_STORE", "sqlite://never.db"),
            ("TOLLGATE_TOKENS", "secret"),
            ("TOLLGATE_PUBLIC_METRICS", "true"),
            ("TOLLGATE_ALLOW_INLINE_CONFIG", "false"),
        ],
    );
    // --store memory over TOLLGATE_STORE: no file made.
    assert!(!dir.path().join("never.db").exists());
    // TOLLGATE_PUBLIC_METRICS over the file: /metrics open, the API not.
    assert_eq!(get(&served, "/metrics").0, 200);
    let inline =
        json!({ "name": "x", "config": { "kind": "fixed window", "rate": 1, "period": 1000 } });
    assert_eq!(served.post("/v1/limit", &[], &inline).0, 401);
    let (status, body) = served.post("/v1/limit", &[("Authorization", "Bearer secret")], &inline);
    assert_eq!(status, 400, "TOLLGATE_ALLOW_INLINE_CONFIG=false: {body}");
    drop(served);

    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory"])
        .env("TOLLGATE_MAX_CONNECTIONS", "zero")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "serve's exit code for a config it cannot run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TOLLGATE_MAX_CONNECTIONS is \"zero\"; it must be a whole number"),
        "{err}"
    );

    let help =
        Command::new(env!("CARGO_BIN_EXE_tollgate")).args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for var in tollgate_server::config::SETTINGS.iter().map(|s| s.var).chain(["TOLLGATE_CONFIG"]) {
        assert!(help.contains(var), "{var} not in serve --help: {help}");
    }
}

/// gRPC health of the server (`""`): 1 SERVING, 2 NOT_SERVING.
fn grpc_health(addr: std::net::SocketAddr) -> u8 {
    // HealthCheckRequest { service: "" }: an empty message.
    let answer = common::grpc_call(addr, "/grpc.health.v1.Health/Check", &[], Some(&[]));
    let bytes = answer.body;
    // A 5-byte frame header, then field 1 (status) as a varint: 0x08, the value.
    assert_eq!(&bytes[..7], &[0, 0, 0, 0, 2, 0x08, bytes[6]], "{bytes:?}");
    bytes[6]
}

/// After SIGTERM, `/healthz` answers 503 `draining` (within 100 ms) and gRPC health
/// `NOT_SERVING` while the listeners go on for `drainDelay`; a slow request in flight still
/// completes after they have closed, within `shutdownDeadline`; the process exits 0.
#[test]
fn sigterm_drains() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(
        &config,
        format!("[server]\ndrainDelay = \"1s\"\nshutdownDeadline = \"5s\"\n\n{}", limits(10, 10)),
    )
    .unwrap();
    let rls = dir.path().join("rls.yaml");
    std::fs::write(&rls, RLS_CONFIG).unwrap();
    let mut served = serve(
        dir.path(),
        "memory",
        &config,
        &["--rls-listen", "127.0.0.1:0", "--rls-config", rls.to_str().unwrap()],
        &[],
    );
    let rls_addr = served.rls.unwrap();
    assert_eq!(grpc_health(rls_addr), 1, "SERVING");
    assert_eq!(get(&served, "/healthz").0, 200);
    // A request whose body is still arriving.
    let body = json!({ "name": "api", "key": "slow" }).to_string();
    let mut slow = TcpStream::connect(served.http).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST /v1/limit HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes()).unwrap();
    slow.write_all(&body.as_bytes()[..5]).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let term = Instant::now();
    signal(&served, "-TERM");
    std::thread::sleep(Duration::from_millis(100));
    let (status, _, health) = get(&served, "/healthz");
    assert_eq!(status, 503, "{health}");
    assert_eq!(serde_json::from_str::<Value>(&health).unwrap()["status"], json!("draining"));
    assert_eq!(grpc_health(rls_addr), 2, "NOT_SERVING");
    // Still answering while draining.
    assert_eq!(served.post("/v1/limit", &[], &json!({ "name": "api", "key": "d" })).0, 200);
    // The listeners close after drainDelay; the slow request is still in flight then.
    assert!(within(Duration::from_secs(5), || TcpStream::connect(served.http).is_err()));
    assert!(term.elapsed() >= Duration::from_secs(1), "{:?}", term.elapsed());
    slow.write_all(&body.as_bytes()[5..]).unwrap();
    let answered = answers(&mut slow, 1);
    assert_eq!(answered, vec![(200, json!({ "ok": true }))]);
    let exited = within(Duration::from_secs(10), || served.child.try_wait().unwrap().is_some());
    assert!(exited, "{}", served.stderr());
    assert!(served.child.wait().unwrap().success());
}
