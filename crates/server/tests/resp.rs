//! The Redis protocol (SPEC §6d) of the shipped binary, through real clients: redis-rs (the
//! `redis` crate) and Debian's `redis-cli`. redis-cell's `CL.THROTTLE` integer by integer;
//! the `TG.*` commands against their HTTP twins; 200 concurrent `CL.THROTTLE` from 8
//! connections against a burst of 50 on every store; the connection commands clients send;
//! tokens; errors that leave the connection usable, protocol errors that close it; a client
//! that pipelines 100,000 commands without reading; the metrics. (redis-py, ioredis and
//! node-redis are driven by `clients/resp`, which CI runs against the same binary.)

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::Value as R;
use serde_json::{Value, json};

use common::backend;

/// A running `tollgate serve --resp-listen`.
struct Served {
    child: Child,
    http: String,
    resp: String,
    _dir: tempfile::TempDir,
}

impl Served {
    /// The binary on `store` with the config `toml` and the environment `env`.
    fn start(store: &str, toml: &str, env: &[(&str, &str)]) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("tollgate.toml");
        std::fs::write(&config, toml).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command
            .args(["serve", "--store", store, "--listen", "127.0.0.1:0"])
            .args(["--resp-listen", "127.0.0.1:0", "--config"])
            .arg(&config)
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (var, value) in env {
            command.env(var, value);
        }
        let mut child = command.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mut http, mut resp) = (String::new(), String::new());
        let mut line = String::new();
        while resp.is_empty() {
            line.clear();
            if out.read_line(&mut line).unwrap() == 0 {
                let _ = child.kill();
                panic!("{store}: the server did not start");
            }
            if let Some(base) = line.trim().strip_prefix("tollgate listening on ") {
                http = base.to_owned();
            }
            if let Some(addr) = line.trim().strip_prefix("resp:") {
                let addr = addr.trim().strip_prefix("redis://").unwrap();
                resp = addr.split(' ').next().unwrap().to_owned();
            }
        }
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        Served { child, http, resp, _dir: dir }
    }

    fn client(&self) -> redis::Connection {
        let client = redis::Client::open(format!("redis://{}", self.resp)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match client.get_connection() {
                Ok(connection) => return connection,
                Err(e) if Instant::now() > deadline => panic!("cannot connect: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r = agent.post(&format!("{}{path}", self.http)).send_json(body).unwrap();
        (r.status().as_u16(), r.body_mut().read_json().unwrap_or(Value::Null))
    }

    fn metrics(&self) -> String {
        let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
        agent
            .get(&format!("{}/metrics", self.http))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    }

    /// The server's resident memory, in KiB.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A key of this run's own, so that runs on a shared store never meet.
fn unique(label: &str) -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{label}{}x{nanos}", std::process::id())
}

fn throttle(c: &mut redis::Connection, args: &[&str]) -> Vec<i64> {
    redis::cmd("CL.THROTTLE").arg(args).query(c).unwrap()
}

fn error(c: &mut redis::Connection, command: &str, args: &[&str]) -> String {
    let result: redis::RedisResult<R> = redis::cmd(command).arg(args).query(c);
    let e = result.expect_err("an error reply");
    // redis-rs splits the reply's code from its message (and keeps no code for ERR); put
    // them back as sent.
    format!("{} {}", e.code().unwrap_or("ERR"), e.detail().unwrap_or_default())
}

/// redis-cell's README, replayed: `CL.THROTTLE user123 15 30 60 1` on a new key is
/// `[0, 16, 15, -1, 2]`; each take leaves one token fewer and two seconds more to wait for
/// the bucket to be full; the 17th in the same second is refused; a quantity of 0 reads and
/// takes nothing; more than the bucket holds is refused with retry_after -1 and takes
/// nothing.
#[test]
fn cl_throttle_answers_as_redis_cell() {
    let served = Served::start("memory", "", &[]);
    let mut c = served.client();
    let key = unique("user");
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60", "1"]), [0, 16, 15, -1, 2]);
    // The default quantity is 1.
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60"]), [0, 16, 14, -1, 4]);
    // Quantity 0: the state as it stands, nothing taken.
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60", "0"]), [0, 16, 14, -1, 4]);
    // More than max_burst + 1 can never be granted.
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60", "17"]), [1, 16, 14, -1, 4]);
    // The rest of the burst, one by one: 13 left ... 0 left.
    for left in (0..14).rev() {
        let reply = throttle(&mut c, &[&key, "15", "30", "60", "1"]);
        assert_eq!(reply[..4], [0, 16, left, -1]);
        assert_eq!(reply[4], 2 * (16 - left), "{reply:?}");
    }
    // Empty: refused; a token comes back every 2 s (well within 2 s now), and the bucket is
    // full 32 s from now; nothing was taken.
    let refused = throttle(&mut c, &[&key, "15", "30", "60", "1"]);
    assert_eq!(refused, [1, 16, 0, 2, 32]);
    // Two tokens at once wait for two to come back.
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60", "2"]), [1, 16, 0, 4, 32]);
    // redis-cell's end-to-end test: a burst of 0, one token every 2 s.
    let e2e = unique("e2e");
    assert_eq!(throttle(&mut c, &[&e2e, "0", "1", "2", "1"]), [0, 1, 0, -1, 2]);
    assert_eq!(throttle(&mut c, &[&e2e, "0", "1", "2", "1"]), [1, 1, 0, 2, 2]);
    // A larger burst for the same key: tollgate keeps the key's tokens (none), which now
    // refill towards 26; redis-cell keeps the time at which the bucket is full, and would
    // grant the 10 more at once. The one difference, in the guide's "From redis-cell".
    let wider = throttle(&mut c, &[&key, "25", "30", "60", "1"]);
    assert_eq!(wider[..4], [1, 26, 0, 2]);
    // A smaller one caps the tokens at the new burst.
    let other = unique("narrow");
    assert_eq!(throttle(&mut c, &[&other, "15", "30", "60", "1"])[..3], [0, 16, 15]);
    assert_eq!(throttle(&mut c, &[&other, "4", "30", "60", "1"])[..3], [0, 5, 4]);
}

/// Every malformed `CL.THROTTLE` is an error that takes nothing, and the connection goes on.
#[test]
fn cl_throttle_errors_take_nothing() {
    let served = Served::start("memory", "", &[]);
    let mut c = served.client();
    let key = unique("bad");
    let cases: [(&[&str], &str); 8] = [
        (&[&key, "15", "30"], "ERR wrong number of arguments for 'cl.throttle' command"),
        (&[&key, "15", "30", "60", "1", "2"], "ERR wrong number of arguments"),
        (&[&key, "x", "30", "60"], "ERR CL.THROTTLE: max_burst is \"x\"; it must be an integer"),
        (&[&key, "15", "1.5", "60"], "ERR CL.THROTTLE: count is \"1.5\""),
        (
            &[&key, "15", "30", "-60"],
            "ERR CL.THROTTLE: period is -60; it must be an integer from 1",
        ),
        (&[&key, "15", "0", "60"], "ERR CL.THROTTLE: count is 0; it must be an integer from 1"),
        (&[&key, "-1", "30", "60"], "ERR CL.THROTTLE: max_burst is -1"),
        (&[&key, "15", "30", "60", "-1"], "ERR CL.THROTTLE: quantity is -1"),
    ];
    for (args, expected) in cases {
        let e = error(&mut c, "CL.THROTTLE", args);
        assert!(e.starts_with(expected), "{args:?}: {e}");
    }
    // Nothing was taken by any of them.
    assert_eq!(throttle(&mut c, &[&key, "15", "30", "60", "0"]), [0, 16, 16, -1, 0]);
    let m = served.metrics();
    assert_eq!(
        common::metric(
            &m,
            "tollgate_requests_total{op=\"throttle\",outcome=\"invalid\",protocol=\"resp\"}"
        ),
        8.0
    );
    assert_eq!(
        common::metric(
            &m,
            "tollgate_requests_total{op=\"throttle\",outcome=\"ok\",protocol=\"resp\"}"
        ),
        1.0
    );
}

const TWIN: &str = r#"
[limits.twin]
kind = "fixed window"
rate = 3
period = "1d"
start = 0
[limits.sharded]
kind = "token bucket"
rate = 40
period = "1h"
shards = 4
"#;

/// Each `TG.*` command and its HTTP twin, on keys of their own of the same limits: the same
/// fields, the same decisions and errors, waits within the time between the two calls.
#[test]
fn tg_commands_answer_as_http() {
    let served = Served::start("memory", TWIN, &[]);
    let mut c = served.client();
    let (rk, hk) = (unique("resp"), unique("http"));
    let tg = |c: &mut redis::Connection, args: &[&str]| -> Value {
        let reply: R = redis::cmd(args[0]).arg(&args[1..]).query(c).unwrap();
        json_of(&reply)
    };
    // limit: three granted, the fourth refused until the next window (in a day).
    for i in 0..4 {
        let resp = tg(&mut c, &["TG.LIMIT", "twin", "KEY", &rk]);
        let (status, http) = served.post("/v1/limit", &json!({ "name": "twin", "key": hk }));
        assert_eq!(status, 200);
        same(&resp, &http, &format!("limit {i}"));
    }
    // check: refused, nothing taken; with COUNT and RESERVE, a reservation granted.
    let resp = tg(&mut c, &["TG.CHECK", "twin", "KEY", &rk, "COUNT", "2", "RESERVE"]);
    let (_, http) = served
        .post("/v1/check", &json!({ "name": "twin", "key": hk, "count": 2, "reserve": true }));
    same(&resp, &http, "check");
    assert_eq!(resp["ok"], json!(1));
    // value, with the config filled in.
    let resp = tg(&mut c, &["TG.VALUE", "twin", "KEY", &rk]);
    let (_, http) = served.post("/v1/value", &json!({ "name": "twin", "key": hk }));
    same(&resp, &http, "value");
    assert_eq!(resp["value"], json!(0));
    // adjust: a cost settled after the work, signed; the twin of POST /v1/adjust.
    let resp = tg(&mut c, &["TG.ADJUST", "twin", "KEY", &rk, "COUNT", "-2"]);
    let (_, http) = served.post("/v1/adjust", &json!({ "name": "twin", "key": hk, "count": -2 }));
    same(&resp, &http, "adjust");
    assert_eq!(resp, json!({ "value": 2 }));
    let resp = tg(&mut c, &["TG.ADJUST", "twin", "COUNT", "3", "KEY", &rk]);
    let (_, http) = served.post("/v1/adjust", &json!({ "name": "twin", "key": hk, "count": 3 }));
    same(&resp, &http, "adjust into debt");
    assert_eq!(resp["value"], json!(-1));
    assert!(resp["retryAfter"].as_f64().unwrap() > 0.0, "{resp}");
    // A transaction, all or nothing: one limit refuses, so nothing is taken of the other.
    let (rk2, hk2) = (unique("resp"), unique("http"));
    let resp = tg(
        &mut c,
        &[
            "TG.TRANSACTION",
            "LIMIT",
            "sharded",
            "KEY",
            &rk2,
            "COUNT",
            "5",
            "LIMIT",
            "twin",
            "KEY",
            &rk,
        ],
    );
    let (_, http) = served.post(
        "/v1/transaction",
        &json!({ "limits": [{ "name": "sharded", "key": hk2, "count": 5 }, { "name": "twin", "key": hk }] }),
    );
    same(&resp, &http, "transaction");
    assert_eq!(resp["ok"], json!(0));
    let resp = tg(&mut c, &["TG.VALUE", "sharded", "KEY", &rk2, "SAMPLESHARDS", "4"]);
    assert_eq!(resp["value"], json!(40), "{resp}");
    // reset: the limit is whole again.
    assert_eq!(tg(&mut c, &["TG.RESET", "twin", "KEY", &rk]), json!([]));
    assert_eq!(tg(&mut c, &["TG.LIMIT", "twin", "KEY", &rk]), json!({ "ok": 1 }));
    // An inline config, for a name the server does not define.
    let config = r#"{"kind":"token bucket","rate":2,"period":"1m"}"#;
    let resp = tg(&mut c, &["TG.LIMIT", "inline", "KEY", &rk, "COUNT", "2", "CONFIG", config]);
    assert_eq!(resp, json!({ "ok": 1 }));
    // time and config.
    let now = tg(&mut c, &["TG.TIME"])["now"].as_f64().unwrap();
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    assert!((now - wall.as_millis() as f64).abs() < 5_000.0, "{now}");
    let (_, http) = served.post("/v1/config", &json!({}));
    let _ = http;
    let resp = tg(&mut c, &["TG.CONFIG"]);
    assert_eq!(resp["twin"]["rate"], json!(3), "{resp}");
    // Errors: the HTTP API's messages, and the connection goes on.
    for (args, body) in [
        (
            vec!["TG.LIMIT", "twin", "KEY", rk.as_str(), "COUNT", "4"],
            json!({ "name": "twin", "key": hk, "count": 4 }),
        ),
        (vec!["TG.LIMIT", "nowhere"], json!({ "name": "nowhere" })),
        (
            vec!["TG.LIMIT", "twin", "CONFIG", config],
            json!({ "name": "twin", "config": { "kind": "token bucket", "rate": 2, "period": "1m" } }),
        ),
        (
            vec!["TG.VALUE", "twin", "SAMPLESHARDS", "0"],
            json!({ "name": "twin", "sampleShards": 0 }),
        ),
    ] {
        let e = error(&mut c, args[0], &args[1..]);
        let path = if args[0] == "TG.VALUE" { "/v1/value" } else { "/v1/limit" };
        let (_, http) = served.post(path, &body);
        assert_eq!(e, format!("ERR {}", http["error"].as_str().unwrap()), "{args:?}");
    }
    // THROWS: a refusal as an error reply, as HTTP's 429.
    let e = error(&mut c, "TG.LIMIT", &["twin", "KEY", &hk, "THROWS"]);
    assert!(e.starts_with("RATELIMITED twin "), "{e}");
    let _: String = redis::cmd("PING").query(&mut c).unwrap();
}

/// A RESP reply as the JSON it stands for: a map (RESP3), or a flat array of fields and
/// values (RESP2), as an object; integers 0 and 1 that stand for booleans are left to
/// [`same`].
fn json_of(reply: &R) -> Value {
    match reply {
        R::Nil => Value::Null,
        R::Int(n) => json!(n),
        R::Double(x) => json!(x),
        R::Boolean(b) => json!(b),
        R::BulkString(bytes) => {
            let text = String::from_utf8_lossy(bytes).into_owned();
            text.parse::<f64>().map_or(Value::String(text), |x| json!(x))
        }
        R::SimpleString(text) => Value::String(text.clone()),
        R::Map(pairs) => Value::Object(
            pairs
                .iter()
                .map(|(k, v)| (json_of(k).as_str().unwrap().to_owned(), json_of(v)))
                .collect(),
        ),
        R::Array(items) if is_fields(items) => Value::Object(
            items
                .chunks(2)
                .map(|p| (json_of(&p[0]).as_str().unwrap().to_owned(), json_of(&p[1])))
                .collect(),
        ),
        R::Array(items) => Value::Array(items.iter().map(json_of).collect()),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// Whether an array reads as fields and values: even, with a name at every even place.
fn is_fields(items: &[R]) -> bool {
    const FIELDS: [&str; 12] = [
        "ok",
        "retryAfter",
        "results",
        "value",
        "ts",
        "shard",
        "config",
        "now",
        "kind",
        "rate",
        "period",
        "capacity",
    ];
    !items.is_empty()
        && items.len().is_multiple_of(2)
        && items.chunks(2).all(|p| match &p[0] {
            R::BulkString(name) => {
                let name = String::from_utf8_lossy(name);
                FIELDS.contains(&name.as_ref())
                    || name.starts_with("twin")
                    || name == "sharded"
                    || name == "maxReserved"
                    || name == "shards"
                    || name == "start"
            }
            _ => false,
        })
}

/// The same answer: the same fields, booleans (RESP2's 0 and 1), numbers, with waits and
/// times within a second of each other (the two calls were made apart).
fn same(resp: &Value, http: &Value, what: &str) {
    match (resp, http) {
        (Value::Object(a), Value::Object(b)) => {
            let (mut ka, mut kb): (Vec<_>, Vec<_>) = (a.keys().collect(), b.keys().collect());
            ka.sort();
            kb.sort();
            assert_eq!(ka, kb, "{what}: {resp} against {http}");
            for (k, v) in a {
                let close = matches!(k.as_str(), "retryAfter" | "ts");
                match (v, &b[k]) {
                    (Value::Number(x), Value::Number(y)) if close => {
                        let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                        assert!((x - y).abs() < 1_000.0, "{what}: {k} {x} against {y}");
                    }
                    (x, y) => same(x, y, &format!("{what}.{k}")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(b) {
                same(x, y, what);
            }
        }
        (Value::Number(n), Value::Bool(b)) => {
            assert_eq!(n.as_i64(), Some(i64::from(*b)), "{what}");
        }
        (Value::Number(x), Value::Number(y)) => {
            assert_eq!(x.as_f64(), y.as_f64(), "{what}");
        }
        (a, b) => assert_eq!(a, b, "{what}"),
    }
}

/// 200 concurrent `CL.THROTTLE` from 8 connections against a burst of 50 admit exactly 50,
/// on `store`.
fn exactly_the_burst(store: &str) {
    let served = Served::start(store, "", &[]);
    let key = unique("burst");
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let mut c = served.client();
            let key = key.clone();
            std::thread::spawn(move || {
                // 25 each, pipelined in one write: the server runs them in order.
                let mut pipe = redis::pipe();
                for _ in 0..25 {
                    pipe.cmd("CL.THROTTLE").arg(&key).arg(49).arg(1).arg(86_400);
                }
                let replies: Vec<Vec<i64>> = pipe.query(&mut c).unwrap();
                replies.iter().filter(|r| r[0] == 0).count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 50, "{store}");
    let mut c = served.client();
    assert_eq!(throttle(&mut c, &[&key, "49", "1", "86400", "0"])[2], 0, "{store}");
    // Pipelined over four keys, interleaved (a networked store runs different keys' commands
    // at once): every key's answers still come in its commands' order, 4 3 2 1 0 left, then
    // refused, and every reply in the order sent.
    let keys: Vec<String> = (0..4).map(|i| format!("{key}-{i}")).collect();
    let mut pipe = redis::pipe();
    for _ in 0..7 {
        for k in &keys {
            pipe.cmd("CL.THROTTLE").arg(k).arg(4).arg(1).arg(86_400);
        }
    }
    let replies: Vec<Vec<i64>> = pipe.query(&mut c).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let theirs: Vec<(i64, i64)> =
            replies.iter().skip(i).step_by(4).map(|r| (r[0], r[2])).collect();
        assert_eq!(theirs, [(0, 4), (0, 3), (0, 2), (0, 1), (0, 0), (1, 0), (1, 0)], "{store} {k}");
    }
}

#[test]
fn exactly_the_burst_on_memory() {
    exactly_the_burst("memory");
}

#[test]
fn exactly_the_burst_on_sqlite() {
    exactly_the_burst("sqlite://resp.db");
}

#[test]
fn exactly_the_burst_on_redis() {
    let Some(url) = backend("TOLLGATE_REDIS_URL") else { return };
    exactly_the_burst(&url);
}

#[test]
fn exactly_the_burst_on_postgres() {
    let Some(url) = backend("TOLLGATE_POSTGRES_URL") else { return };
    exactly_the_burst(&url);
}

/// What clients send on their own: `HELLO` (RESP3 after `HELLO 3`), `CLIENT SETNAME`,
/// `SETINFO`, `GETNAME`, `ID`, `SELECT 0`, `PING`, `ECHO`, `INFO`, `COMMAND`, `RESET`, `QUIT`.
#[test]
fn connection_commands_answer_as_redis() {
    let served = Served::start("memory", TWIN, &[]);
    // redis-rs with RESP3: HELLO 3 first, then CLIENT SETINFO; a map comes back as a map.
    let client = redis::Client::open(format!("redis://{}/?protocol=resp3", served.resp)).unwrap();
    let mut c = client.get_connection().unwrap();
    let key = unique("r3");
    let reply: R = redis::cmd("TG.LIMIT").arg("twin").arg("KEY").arg(&key).query(&mut c).unwrap();
    assert_eq!(reply, R::Map(vec![(R::BulkString(b"ok".to_vec()), R::Boolean(true))]));
    let hello: R = redis::cmd("HELLO").query(&mut c).unwrap();
    let hello = json_of(&hello);
    assert_eq!(hello["proto"], json!(3));
    assert_eq!(hello["server"], json!("redis"));
    let id: i64 = redis::cmd("CLIENT").arg("ID").query(&mut c).unwrap();
    assert!(id > 0);
    let name: Option<String> = redis::cmd("CLIENT").arg("GETNAME").query(&mut c).unwrap();
    assert_eq!(name, None);
    let _: () = redis::cmd("CLIENT").arg("SETNAME").arg("worker-1").query(&mut c).unwrap();
    let name: Option<String> = redis::cmd("CLIENT").arg("GETNAME").query(&mut c).unwrap();
    assert_eq!(name.as_deref(), Some("worker-1"));
    assert!(error(&mut c, "CLIENT", &["SETNAME", "a b"]).starts_with("ERR Client names cannot"));
    assert_eq!(
        error(&mut c, "CLIENT", &["KILL"]),
        "ERR unknown subcommand 'KILL'. Try CLIENT HELP."
    );
    let _: () = redis::cmd("SELECT").arg(0).query(&mut c).unwrap();
    assert_eq!(error(&mut c, "SELECT", &["1"]), "ERR DB index is out of range");
    let pong: String = redis::cmd("PING").query(&mut c).unwrap();
    assert_eq!(pong, "PONG");
    let echo: String = redis::cmd("ECHO").arg("hi").query(&mut c).unwrap();
    assert_eq!(echo, "hi");
    let info: String = redis::cmd("INFO").query(&mut c).unwrap();
    assert!(info.contains("redis_version:") && info.contains("loading:0"), "{info}");
    let count: i64 = redis::cmd("COMMAND").arg("COUNT").query(&mut c).unwrap();
    let all: Vec<R> = redis::cmd("COMMAND").query(&mut c).unwrap();
    assert_eq!(all.len() as i64, count);
    let docs: R = redis::cmd("COMMAND").arg("DOCS").arg("cl.throttle").query(&mut c).unwrap();
    assert!(matches!(docs, R::Map(ref m) if m.len() == 1), "{docs:?}");
    assert_eq!(
        error(&mut c, "SET", &["a", "b"]),
        "ERR unknown command 'SET', with args beginning with: 'a' 'b' "
    );
    assert!(error(&mut c, "HELLO", &["4"]).starts_with("NOPROTO"));
    // RESET: back to RESP2, its name forgotten.
    let reset: String = redis::cmd("RESET").query(&mut c).unwrap();
    assert_eq!(reset, "RESET");
    let reply: R = redis::cmd("TG.CHECK").arg("twin").arg("KEY").arg(&key).query(&mut c).unwrap();
    assert_eq!(reply, R::Array(vec![R::BulkString(b"ok".to_vec()), R::Int(1)]));
    // QUIT: +OK, then the server closes.
    let mut raw = TcpStream::connect(&served.resp).unwrap();
    raw.write_all(b"PING\r\nQUIT\r\nPING\r\n").unwrap();
    let mut all = String::new();
    raw.read_to_string(&mut all).unwrap();
    assert_eq!(all, "+PONG\r\n+OK\r\n");
}

/// With tokens: `-NOAUTH` before `AUTH` (but `HELLO 3 AUTH`, `AUTH user token` and
/// `AUTH token` all work), `-WRONGPASS` for a wrong one, and a read token that may check,
/// read values and the time, and nothing else.
#[test]
fn tokens_as_on_http() {
    let served = Served::start(
        "memory",
        TWIN,
        &[("TOLLGATE_TOKENS", "full-token"), ("TOLLGATE_READ_TOKENS", "read-token")],
    );
    let key = unique("auth");
    let mut c = served.client();
    assert_eq!(
        error(&mut c, "CL.THROTTLE", &[&key, "1", "1", "1"]),
        "NOAUTH Authentication required."
    );
    assert_eq!(error(&mut c, "PING", &[]), "NOAUTH Authentication required.");
    assert_eq!(
        error(&mut c, "AUTH", &["nope"]),
        "WRONGPASS invalid username-password pair or user is disabled."
    );
    let _: () = redis::cmd("AUTH").arg("default").arg("full-token").query(&mut c).unwrap();
    assert_eq!(throttle(&mut c, &[&key, "1", "1", "1"])[0], 0);
    // redis-rs's own AUTH from the URL, and HELLO 3 AUTH.
    let url = format!("redis://:full-token@{}/?protocol=resp3", served.resp);
    let mut c3 = redis::Client::open(url).unwrap().get_connection().unwrap();
    assert_eq!(throttle(&mut c3, &[&key, "1", "1", "1"])[0], 0);
    // A read token.
    let url = format!("redis://:read-token@{}", served.resp);
    let mut r = redis::Client::open(url).unwrap().get_connection().unwrap();
    let reply: R = redis::cmd("TG.CHECK").arg("twin").arg("KEY").arg(&key).query(&mut r).unwrap();
    assert_eq!(json_of(&reply)["ok"], json!(1));
    let _: R = redis::cmd("TG.VALUE").arg("twin").arg("KEY").arg(&key).query(&mut r).unwrap();
    let _: R = redis::cmd("TG.TIME").query(&mut r).unwrap();
    for (command, args) in [
        ("TG.LIMIT", vec!["twin"]),
        ("TG.RESET", vec!["twin"]),
        ("TG.ADJUST", vec!["twin", "COUNT", "-1"]),
        ("CL.THROTTLE", vec!["k", "1", "1", "1"]),
    ] {
        let e = error(&mut r, command, &args);
        assert!(e.starts_with("NOPERM a read token may run TG.CHECK"), "{command}: {e}");
    }
    // RESET forgets who the connection was.
    let _: String = redis::cmd("RESET").query(&mut c).unwrap();
    assert_eq!(error(&mut c, "TG.TIME", &[]), "NOAUTH Authentication required.");
}

/// A protocol error is answered and closes the connection, as Redis does; a command over
/// the bounds too, before its bytes arrive.
#[test]
fn protocol_errors_close_the_connection() {
    let served = Served::start("memory", "", &[]);
    let exchange = |bytes: &[u8]| {
        let mut raw = TcpStream::connect(&served.resp).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        raw.write_all(bytes).unwrap();
        let mut all = String::new();
        raw.read_to_string(&mut all).unwrap();
        all
    };
    assert_eq!(
        exchange(b"PING\r\n*1\r\n+PING\r\nPING\r\n"),
        "+PONG\r\n-ERR Protocol error: expected '$', got '+'\r\n"
    );
    assert!(
        exchange(b"*99999\r\n").starts_with("-ERR Protocol error: invalid multibulk length 99999")
    );
    assert!(
        exchange(b"*2\r\n$4\r\nECHO\r\n$1000000\r\n")
            .starts_with("-ERR Protocol error: invalid bulk length 1000000")
    );
}

/// A client that pipelines 100,000 commands and reads nothing until it has written them all
/// is simply not read from while its replies wait: the server's memory stays within 16 MiB
/// of what it was, and every reply then comes, in order.
#[test]
fn a_client_that_never_reads_costs_a_bounded_memory() {
    let served = Served::start("memory", "", &[]);
    let mut raw = TcpStream::connect(&served.resp).unwrap();
    raw.write_all(b"PING\r\n").unwrap();
    let mut pong = [0u8; 7];
    raw.read_exact(&mut pong).unwrap();
    let before = served.rss_kib();
    let key = unique("flood");
    let command = format!(
        "*6\r\n$11\r\nCL.THROTTLE\r\n${}\r\n{key}\r\n$2\r\n10\r\n$1\r\n1\r\n$2\r\n60\r\n$1\r\n0\r\n",
        key.len()
    );
    const N: usize = 100_000;
    let mut writer = raw.try_clone().unwrap();
    let write = std::thread::spawn(move || {
        let batch = command.repeat(1_000);
        for _ in 0..N / 1_000 {
            writer.write_all(batch.as_bytes()).unwrap();
        }
    });
    // The writer fills the socket's buffers and blocks: the server reads no more.
    std::thread::sleep(Duration::from_secs(2));
    let during = served.rss_kib();
    assert!(during < before + 16 * 1024, "RSS {before} KiB, then {during} KiB");
    // Then every reply, in order.
    let reply = b"*5\r\n:0\r\n:11\r\n:11\r\n:-1\r\n:0\r\n";
    let mut got = vec![0u8; reply.len()];
    raw.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    for i in 0..N {
        raw.read_exact(&mut got).unwrap();
        assert_eq!(got, reply, "reply {i}");
    }
    write.join().unwrap();
}

/// Debian's redis-cli, as a user types it.
#[test]
fn redis_cli_works() {
    let served = Served::start("memory", TWIN, &[]);
    let (host, port) = served.resp.rsplit_once(':').unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new("redis-cli").args(["-h", host, "-p", port]).args(args).output();
        match out {
            Ok(out) => String::from_utf8(out.stdout).unwrap(),
            Err(e) if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
                panic!("redis-cli: {e}")
            }
            Err(_) => String::new(),
        }
    };
    if cli(&["PING"]).is_empty() {
        eprintln!("skipped: redis-cli is not installed");
        return;
    }
    let key = unique("cli");
    assert_eq!(cli(&["CL.THROTTLE", &key, "15", "30", "60", "1"]), "0\n16\n15\n-1\n2\n");
    assert_eq!(cli(&["TG.LIMIT", "twin", "KEY", &key]), "ok\n1\n");
    assert_eq!(cli(&["-3", "TG.LIMIT", "twin", "KEY", &key]), "ok (true)\n");
    let refused = cli(&["CL.THROTTLE", &key, "0", "1", "60", "2"]);
    assert_eq!(refused, "1\n1\n1\n-1\n0\n");
}
