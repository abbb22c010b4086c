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

use common::{backend, trickle};

/// A running `tollgate serve --resp-listen`.
struct Served {
    child: Child,
    http: String,
    resp: String,
    /// What the server wrote to stderr so far (its log).
    log: std::sync::Arc<std::sync::Mutex<String>>,
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
            .stderr(Stdio::piped());
        for (var, value) in env {
            command.env(var, value);
        }
        let mut child = command.spawn().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (mut err, collected) = (child.stderr.take().unwrap(), std::sync::Arc::clone(&log));
        std::thread::spawn(move || {
            let mut chunk = [0; 4096];
            while let Ok(n @ 1..) = err.read(&mut chunk) {
                collected.lock().unwrap().push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mut http, mut resp) = (String::new(), String::new());
        let mut line = String::new();
        while resp.is_empty() {
            line.clear();
            if out.read_line(&mut line).unwrap() == 0 {
                let _ = child.kill();
                std::thread::sleep(Duration::from_millis(200));
                panic!("{store}: the server did not start: {}", log.lock().unwrap());
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
        Served { child, http, resp, log, _dir: dir }
    }

    /// What the server has logged so far.
    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
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

/// `TG.ACQUIRE`, `TG.RELEASE` and `TG.RENEW` (SPEC §6f), and `TG.CHECK` and `TG.VALUE` of a
/// concurrency limit: the answers of their HTTP twins, the ticket the string of digits it is
/// there, and the same errors.
#[test]
fn tg_concurrency_commands() {
    let toml = "[limits.gpu]\nkind = \"concurrency\"\nmax = 2\nttl = \"1m\"\n";
    let served = Served::start("memory", toml, &[]);
    let mut c = served.client();
    let key = unique("slots");
    let tg = |c: &mut redis::Connection, args: &[&str]| -> Value {
        let reply: R = redis::cmd(args[0]).arg(&args[1..]).query(c).unwrap();
        json_of(&reply)
    };
    let one = tg(&mut c, &["TG.ACQUIRE", "gpu", "KEY", &key]);
    assert_eq!(one["ok"], json!(1), "{one}");
    let ticket = one["ticket"].as_f64().expect("a ticket of digits").to_string();
    assert!(one["expiresAt"].as_f64().unwrap() > 0.0, "{one}");
    let refused = tg(&mut c, &["TG.ACQUIRE", "gpu", "KEY", &key, "COUNT", "2"]);
    assert_eq!(refused["ok"], json!(0), "{refused}");
    let wait = refused["retryAfter"].as_f64().unwrap();
    assert!(wait > 59_000.0 && wait <= 60_000.0, "{refused}");
    let thrown = error(&mut c, "TG.ACQUIRE", &["gpu", "KEY", &key, "COUNT", "2", "THROWS"]);
    assert!(thrown.starts_with("RATELIMITED"), "{thrown}");
    assert_eq!(tg(&mut c, &["TG.CHECK", "gpu", "KEY", &key])["ok"], json!(1));
    let value = tg(&mut c, &["TG.VALUE", "gpu", "KEY", &key]);
    assert_eq!(value, json!({ "inFlight": 1, "max": 2, "holders": 1 }));
    let (_, http) = served.post("/v1/value", &json!({ "name": "gpu", "key": key }));
    assert_eq!(http, value, "the HTTP twin sees the same slots");
    let renewed = tg(&mut c, &["TG.RENEW", "gpu", "TICKET", &ticket, "KEY", &key, "TTL", "5000"]);
    assert_eq!(renewed["ok"], json!(1), "{renewed}");
    let released = tg(&mut c, &["TG.RELEASE", "gpu", "TICKET", &ticket, "KEY", &key]);
    assert_eq!(released, json!({ "released": 1 }));
    let again = tg(&mut c, &["TG.RELEASE", "gpu", "TICKET", &ticket, "KEY", &key]);
    assert_eq!(again, json!({ "released": 0 }));
    let e = error(&mut c, "TG.ACQUIRE", &["gpu", "COUNT", "3"]);
    assert!(e.contains("max of 2"), "{e}");
    let e = error(&mut c, "TG.RELEASE", &["gpu", "TICKET", "abc"]);
    assert!(e.contains("ticket"), "{e}");
}

/// TG.TRANSACTION naming a concurrency limit: its slot and the tokens, all or nothing, the
/// ticket in the reply (SPEC §6f), as `POST /v1/transaction` answers.
#[test]
fn tg_transaction_takes_a_slot_with_the_tokens() {
    let toml = "[limits.gpu]\nkind = \"concurrency\"\nmax = 1\n\n\
                [limits.api]\nkind = \"token bucket\"\nrate = 2\nperiod = \"1m\"\n";
    let served = Served::start("memory", toml, &[]);
    let mut c = served.client();
    let key = unique("slotsWith");
    let transaction = |c: &mut redis::Connection| -> Value {
        let args = ["LIMIT", "gpu", "KEY", &key, "LIMIT", "api", "KEY", &key];
        let reply: R = redis::cmd("TG.TRANSACTION").arg(&args[..]).query(c).unwrap();
        json_of(&reply)
    };
    let both = transaction(&mut c);
    assert_eq!(both["ok"], json!(1), "{both}");
    let ticket = both["ticket"].as_f64().expect("a ticket of digits").to_string();
    assert_eq!(both["results"][0]["ticket"], both["ticket"], "{both}");
    // The slot held: the next is refused by it, and takes no token.
    let full = transaction(&mut c);
    assert_eq!(full["ok"], json!(0), "{full}");
    assert!(full.get("ticket").is_none(), "{full}");
    let (_, value) = served.post("/v1/value", &json!({ "name": "api", "key": key }));
    assert_eq!(value["value"], json!(1), "one token taken, with the slot");
    let released: R = redis::cmd("TG.RELEASE")
        .arg(&["gpu", "TICKET", &ticket, "KEY", &key])
        .query(&mut c)
        .unwrap();
    assert_eq!(json_of(&released), json!({ "released": 1 }));
}

/// Whether an array reads as fields and values: even, with a name at every even place.
fn is_fields(items: &[R]) -> bool {
    const FIELDS: [&str; 18] = [
        "ok",
        "ticket",
        "expiresAt",
        "released",
        "inFlight",
        "max",
        "holders",
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

/// What the server sends on a new connection to `addr` given `bytes` (and `QUIT` after
/// them), up to its close: replies byte for byte as Redis writes them.
fn exchange(addr: &str, bytes: &[u8]) -> String {
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    raw.write_all(bytes).unwrap();
    raw.write_all(b"QUIT\r\n").unwrap();
    let mut all = Vec::new();
    let _ = raw.read_to_end(&mut all);
    String::from_utf8_lossy(&all).into_owned()
}

/// Whether the server closes `tcp` within `within` (EOF or a reset, and nothing else).
fn closed_within(tcp: &mut TcpStream, within: Duration) -> Result<Duration, String> {
    tcp.set_read_timeout(Some(within)).unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    match tcp.read_to_end(&mut got) {
        Ok(_) => Ok(start.elapsed()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(start.elapsed()),
        Err(e) => {
            Err(format!("{e} after {:?}, {}", start.elapsed(), String::from_utf8_lossy(&got)))
        }
    }
}

/// A command trickled a byte at a time must arrive whole within `bodyTimeout` of its first
/// byte: reads do not restart the clock (one byte every 150 ms, a second allowed: cut after
/// about 7 of its 14 bytes). The clock starts at the command's first byte, not at the
/// connection's: a connection quiet for longer than that, then sending a whole command, is
/// answered.
#[test]
fn a_trickled_command_is_cut_at_its_deadline() {
    let served = Served::start("memory", "[server]\nbodyTimeout = \"1s\"\n", &[]);
    let ping = b"*1\r\n$4\r\nPING\r\n";
    let cut = trickle(&served.resp, b"", ping, Duration::from_millis(150));
    assert!(!cut.got.contains("PONG"), "answered: {:?} after {:?}", cut.got, cut.closed_after);
    assert!(cut.sent < ping.len(), "every byte was taken: {:?}", cut.closed_after);
    assert!(
        cut.closed_after >= Duration::from_millis(900)
            && cut.closed_after < Duration::from_millis(1_800),
        "closed after {:?}",
        cut.closed_after
    );
    // Quiet longer than bodyTimeout between commands (the idle timeout's business), then a
    // whole command: answered.
    let mut quiet = TcpStream::connect(&served.resp).unwrap();
    std::thread::sleep(Duration::from_millis(1_500));
    quiet.write_all(b"PING\r\n").unwrap();
    let mut pong = [0u8; 7];
    quiet.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"+PONG\r\n");
    // Pieces that arrive within the deadline make a command.
    for piece in [&b"*1\r\n$4"[..], b"\r\nPI", b"NG\r\n"] {
        quiet.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    quiet.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"+PONG\r\n");
}

/// Before `AUTH`, a connection has a tighter budget: it must authenticate within
/// `headerTimeout` of its start (the time HTTP gives a request's headers, where its token
/// is), whether it sends nothing or trickles its `AUTH`; its commands take at most 10
/// arguments and 16 KiB (Redis's bounds for unauthenticated clients), refused as soon as
/// they say more. Once authenticated, the connection has the usual ones.
#[test]
fn before_auth_the_budget_is_tighter() {
    let served = Served::start(
        "memory",
        "[server]\nheaderTimeout = \"1s\"\nbodyTimeout = \"5s\"\n",
        &[("TOLLGATE_TOKENS", "full-token-of-thirty-two-chars!")],
    );
    // Nothing sent: closed after the header timeout, not the idle timeout (5 minutes).
    let mut silent = TcpStream::connect(&served.resp).unwrap();
    let took = closed_within(&mut silent, Duration::from_secs(5)).unwrap();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2_500), "{took:?}");
    // AUTH trickled, well within bodyTimeout per byte and in all: cut at the header timeout.
    let auth = b"AUTH full-token-of-thirty-two-chars!\r\n";
    let cut = trickle(&served.resp, b"", auth, Duration::from_millis(100));
    assert!(!cut.got.contains("+OK"), "authenticated: {:?}", cut.got);
    assert!(cut.closed_after < Duration::from_millis(2_500), "closed after {:?}", cut.closed_after);
    // Memory: an argument over 16 KiB, or more than 10 arguments, before AUTH.
    assert_eq!(
        exchange(&served.resp, b"*2\r\n$4\r\nECHO\r\n$20000\r\n"),
        "-ERR Protocol error: unauthenticated bulk length\r\n"
    );
    assert_eq!(
        exchange(&served.resp, b"*11\r\n"),
        "-ERR Protocol error: unauthenticated multibulk length\r\n"
    );
    // Authenticated: quiet past the header timeout, then a 20,000-byte argument: answered.
    let mut c = TcpStream::connect(&served.resp).unwrap();
    c.write_all(b"AUTH full-token-of-thirty-two-chars!\r\n").unwrap();
    let mut ok = [0u8; 5];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n");
    std::thread::sleep(Duration::from_millis(1_500));
    let big = "x".repeat(20_000);
    write!(c, "*2\r\n$4\r\nECHO\r\n$20000\r\n{big}\r\n").unwrap();
    let mut echoed = vec![0u8; 20_000 + 10];
    c.read_exact(&mut echoed).unwrap();
    assert_eq!(String::from_utf8_lossy(&echoed), format!("$20000\r\n{big}\r\n"));
}

/// `MULTI`, `EXEC` and `DISCARD` answer as Redis 7 does, word for word (each case was sent
/// to a redis-server 7 too): `+QUEUED` for each command, one array of replies at `EXEC`,
/// nothing run at `DISCARD` or after an error while queueing (`-EXECABORT`), an error of a
/// command that runs stays in the array; `MULTI` inside one, `EXEC` or `DISCARD` without one,
/// and `WATCH` inside one are errors. Nothing queued is taken until `EXEC`.
#[test]
fn multi_exec_answer_as_redis() {
    let served = Served::start("memory", "", &[]);
    let addr = served.resp.as_str();
    let quit = "+OK\r\n";
    assert_eq!(
        exchange(addr, b"MULTI\r\nMULTI\r\nPING\r\nEXEC\r\n"),
        format!("+OK\r\n-ERR MULTI calls can not be nested\r\n+QUEUED\r\n*1\r\n+PONG\r\n{quit}")
    );
    assert_eq!(
        exchange(addr, b"EXEC\r\nDISCARD\r\n"),
        format!("-ERR EXEC without MULTI\r\n-ERR DISCARD without MULTI\r\n{quit}")
    );
    assert_eq!(
        exchange(addr, b"MULTI\r\nPING\r\nNOPE x\r\nPING\r\nEXEC\r\n"),
        format!(
            "+OK\r\n+QUEUED\r\n-ERR unknown command 'NOPE', with args beginning with: 'x' \r\n\
             +QUEUED\r\n-EXECABORT Transaction discarded because of previous errors.\r\n{quit}"
        )
    );
    // Arity is checked when queued (ECHO takes one argument); PING's, when it runs.
    assert_eq!(
        exchange(addr, b"MULTI\r\nECHO\r\nEXEC\r\nMULTI\r\nPING a b c\r\nEXEC\r\n"),
        format!(
            "+OK\r\n-ERR wrong number of arguments for 'echo' command\r\n\
             -EXECABORT Transaction discarded because of previous errors.\r\n\
             +OK\r\n+QUEUED\r\n*1\r\n-ERR wrong number of arguments for 'ping' command\r\n{quit}"
        )
    );
    assert_eq!(
        exchange(addr, b"MULTI\r\nWATCH a\r\nEXEC\r\nUNWATCH\r\n"),
        format!("+OK\r\n-ERR WATCH inside MULTI is not allowed\r\n*0\r\n+OK\r\n{quit}")
    );
    assert!(
        exchange(addr, b"WATCH a\r\n").starts_with("-ERR WATCH is not supported"),
        "WATCH outside MULTI"
    );
    // Nothing taken by a DISCARD, by an aborted EXEC, or by a RESET inside MULTI.
    let key = unique("multi");
    let take = format!("CL.THROTTLE {key} 1 1 60\r\n");
    let peek = format!("CL.THROTTLE {key} 1 1 60 0\r\n");
    let full = "*5\r\n:0\r\n:2\r\n:2\r\n:-1\r\n:0\r\n";
    let sent = format!("MULTI\r\n{take}{take}{take}DISCARD\r\n{peek}");
    assert_eq!(
        exchange(addr, sent.as_bytes()),
        format!("+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n+OK\r\n{full}{quit}")
    );
    let sent = format!("MULTI\r\n{take}NOPE\r\n{take}EXEC\r\n{peek}");
    let got = exchange(addr, sent.as_bytes());
    assert!(got.contains("-EXECABORT") && got.ends_with(&format!("{full}{quit}")), "{got}");
    let sent = format!("MULTI\r\n{take}RESET\r\nEXEC\r\n{peek}");
    assert_eq!(
        exchange(addr, sent.as_bytes()),
        format!("+OK\r\n+QUEUED\r\n+RESET\r\n-ERR EXEC without MULTI\r\n{full}{quit}")
    );
    // An error of a command that runs is its reply in the array; the others run.
    let sent = format!("MULTI\r\nCL.THROTTLE {key} x 1 60\r\n{take}EXEC\r\n");
    let got = exchange(addr, sent.as_bytes());
    assert!(
        got.starts_with("+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n-ERR CL.THROTTLE: max_burst is \"x\"")
            && got.ends_with(&format!("*5\r\n:0\r\n:2\r\n:1\r\n:-1\r\n:60\r\n{quit}")),
        "{got}"
    );
}

/// redis-rs's atomic pipeline (`MULTI` ... `EXEC`) on `store`: every command's reply, each
/// token taken once; pipelined `CL.THROTTLE` on a networked store are queued too, not run
/// at once beside the transaction.
fn atomic_pipelines_take_once(store: &str) {
    let served = Served::start(store, TWIN, &[]);
    let mut c = served.client();
    let key = unique("atomic");
    let mut pipe = redis::pipe();
    pipe.atomic();
    for _ in 0..3 {
        pipe.cmd("CL.THROTTLE").arg(&key).arg(1).arg(1).arg(86_400);
    }
    let replies: Vec<Vec<i64>> = pipe.query(&mut c).unwrap();
    let limited: Vec<i64> = replies.iter().map(|r| r[0]).collect();
    assert_eq!(limited, [0, 0, 1], "{store}: {replies:?}");
    assert_eq!(throttle(&mut c, &[&key, "1", "1", "86400", "0"])[2], 0, "{store}");
    // Mixed with TG.* and a connection command.
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("TG.LIMIT").arg("twin").arg("KEY").arg(&key).cmd("PING");
    let (taken, pong): (R, String) = pipe.query(&mut c).unwrap();
    assert_eq!(json_of(&taken)["ok"], json!(1), "{store}");
    assert_eq!(pong, "PONG");
}

#[test]
fn atomic_pipelines_take_once_on_memory() {
    atomic_pipelines_take_once("memory");
}

#[test]
fn atomic_pipelines_take_once_on_redis() {
    let Some(url) = backend("TOLLGATE_REDIS_URL") else { return };
    atomic_pipelines_take_once(&url);
}

/// Pipelined slot commands on a networked store run together (distinct keys at once), and
/// still answer as one after the other: 20 keys of a limit of 1 acquired twice in turn are
/// granted once each, refused the second time; a release pipelined after its key's acquire
/// frees it for the acquire after it.
#[test]
fn pipelined_slot_commands_keep_their_order() {
    let Some(url) = backend("TOLLGATE_REDIS_URL") else { return };
    let toml = "[limits.one]\nkind = \"concurrency\"\nmax = 1\n";
    let served = Served::start(&url, toml, &[]);
    let mut c = served.client();
    let base = unique("piped");
    let keys: Vec<String> = (0..20).map(|i| format!("{base}-{i}")).collect();
    let mut pipe = redis::pipe();
    for _ in 0..2 {
        for key in &keys {
            pipe.cmd("TG.ACQUIRE").arg("one").arg("KEY").arg(key);
        }
    }
    let replies: Vec<R> = pipe.query(&mut c).unwrap();
    let ok: Vec<Value> = replies.iter().map(|r| json_of(r)["ok"].clone()).collect();
    assert_eq!(ok[..20], vec![json!(1); 20], "{replies:?}");
    assert_eq!(ok[20..], vec![json!(0); 20], "{replies:?}");
    let ticket = json_of(&replies[0])["ticket"].as_f64().unwrap().to_string();
    let mut pipe = redis::pipe();
    pipe.cmd("TG.RELEASE").arg("one").arg("TICKET").arg(&ticket).arg("KEY").arg(&keys[0]);
    pipe.cmd("TG.ACQUIRE").arg("one").arg("KEY").arg(&keys[0]);
    pipe.cmd("TG.ACQUIRE").arg("one").arg("KEY").arg(&keys[1]);
    let replies: Vec<R> = pipe.query(&mut c).unwrap();
    assert_eq!(json_of(&replies[0]), json!({ "released": 1 }));
    assert_eq!(json_of(&replies[1])["ok"], json!(1), "released, then acquired again");
    assert_eq!(json_of(&replies[2])["ok"], json!(0), "still held");
}

/// A transaction holds a bounded amount: past 64 KiB of queued commands (what one command
/// may take), the command is refused and `EXEC` aborts; nothing is taken.
#[test]
fn a_transaction_holds_a_bounded_amount() {
    let served = Served::start("memory", "", &[]);
    let key = unique("big");
    let mut sent = String::from("MULTI\r\n");
    for _ in 0..4_000 {
        sent.push_str(&format!("CL.THROTTLE {key} 10 1 60\r\n"));
    }
    sent.push_str(&format!("EXEC\r\nCL.THROTTLE {key} 10 1 60 0\r\n"));
    let got = exchange(&served.resp, sent.as_bytes());
    assert!(got.contains("-ERR a transaction holds at most 65536 bytes"), "{}", &got[..200]);
    assert!(got.contains("-EXECABORT"), "not aborted");
    assert!(got.ends_with("*5\r\n:0\r\n:11\r\n:11\r\n:-1\r\n:0\r\n+OK\r\n"), "taken");
}

/// `COMMAND DOCS` of 4,000 names (72 KB in) is a map of the distinct commands named, not a
/// reply per name (a map has each key once): a few KB, not 596 KB.
#[test]
fn command_docs_of_many_names_is_small() {
    let served = Served::start("memory", "", &[]);
    let mut command = format!("*{}\r\n$7\r\nCOMMAND\r\n$4\r\nDOCS\r\n", 4_002);
    for i in 0..4_000 {
        let name = ["cl.throttle", "tg.transaction", "hello", "nothing"][i % 4];
        command.push_str(&format!("${}\r\n{name}\r\n", name.len()));
    }
    let got = exchange(&served.resp, command.as_bytes());
    assert!(got.starts_with("*6\r\n$11\r\ncl.throttle\r\n"), "{}", &got[..got.len().min(200)]);
    assert!(got.len() < 4_096, "{} bytes", got.len());
}

/// Clients that send commands with large replies (`COMMAND INFO` of 4,000 names: 40 KB in,
/// 236 KB out) and never read: each connection's pending replies stay within its bound
/// (16 KiB and a part of a reply, then it is not read from), so 400 of them grow the server
/// by far less than their replies' 94 MB (measured: 23 MB; 168 MB before each kept its
/// reply); once they close, the memory is given back (each runtime thread asks mimalloc to
/// whenever it runs out of work: main.rs).
#[test]
fn clients_that_never_read_large_replies_cost_a_bounded_memory() {
    let served = Served::start("memory", "", &[]);
    let mut command = format!("*{}\r\n$7\r\nCOMMAND\r\n$4\r\nINFO\r\n", 4_002);
    for _ in 0..4_000 {
        command.push_str("$4\r\nping\r\n");
    }
    // The reply's size, read whole once.
    let mut one = TcpStream::connect(&served.resp).unwrap();
    one.write_all(command.as_bytes()).unwrap();
    one.write_all(b"QUIT\r\n").unwrap();
    let mut reply = Vec::new();
    one.read_to_end(&mut reply).unwrap();
    assert!(reply.len() > 200_000, "{}", reply.len());
    let before = served.rss_kib();
    let clients: Vec<TcpStream> = (0..400)
        .map(|_| {
            let mut c = TcpStream::connect(&served.resp).unwrap();
            c.write_all(command.as_bytes()).unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let during = served.rss_kib();
    eprintln!("RSS {before} KiB; with 400 clients not reading {during} KiB");
    assert!(during < before + 64 * 1024, "RSS {before} KiB, then {during} KiB");
    drop(clients);
    std::thread::sleep(Duration::from_secs(3));
    let after = served.rss_kib();
    eprintln!("RSS once they closed: {after} KiB");
    assert!(after < before + 16 * 1024, "RSS {before} KiB, then {during}, then {after} KiB");
}

const DEFINED_THROTTLE: &str = r#"
[limits."cl.throttle"]
kind = "token bucket"
rate = 1
period = "1m"
capacity = 3
"#;

/// With `respThrottleName` defined in `[limits]`, `CL.THROTTLE` follows the rule of HTTP
/// and `TG.LIMIT`: arguments that give its config take from it; others are refused
/// (`allowConfigOverride = false`), a quantity-0 peek too, and rewrite nothing: a drained
/// limit is not granted more. The server warns at start. With `allowConfigOverride = true`,
/// the arguments are the config, as before.
#[test]
fn cl_throttle_keeps_a_defined_limit() {
    let served = Served::start("memory", DEFINED_THROTTLE, &[]);
    let mut c = served.client();
    let key = unique("defined");
    // max_burst 2, count 1, period 60: the defined bucket.
    for left in [2, 1, 0] {
        assert_eq!(throttle(&mut c, &[&key, "2", "1", "60"])[..3], [0, 3, left]);
    }
    assert_eq!(throttle(&mut c, &[&key, "2", "1", "60"])[0], 1);
    for args in
        [[&key, "10", "1", "60", "1"], [&key, "10", "1", "60", "0"], [&key, "2", "5", "1", "0"]]
    {
        let e = error(&mut c, "CL.THROTTLE", &args);
        assert!(e.starts_with("ERR CL.THROTTLE: cl.throttle is defined by the server"), "{e}");
        assert!(e.contains("max_burst 2, count 1, period 60"), "{e}");
    }
    assert_eq!(throttle(&mut c, &[&key, "2", "1", "60", "0"])[..3], [0, 3, 0]);
    let value = |c: &mut redis::Connection| {
        let reply: R =
            redis::cmd("TG.VALUE").arg("cl.throttle").arg("KEY").arg(&key).query(c).unwrap();
        json_of(&reply)["value"].as_f64().unwrap()
    };
    assert!(value(&mut c) < 0.1, "the drained limit was refilled");
    let log = served.log();
    assert!(log.contains("respThrottleName \"cl.throttle\" is a limit of [limits]"), "{log}");

    let toml = format!("[server]\nallowConfigOverride = true\n{DEFINED_THROTTLE}");
    let served = Served::start("memory", &toml, &[]);
    let mut c = served.client();
    assert_eq!(throttle(&mut c, &[&key, "10", "1", "60"])[..3], [0, 11, 10]);
}

/// `AUTH` and `HELLO AUTH` as Redis 7 answers them, with no tokens: `AUTH default x` is
/// accepted (the nopass default user), `AUTH x` is Redis's error, another user is
/// `-WRONGPASS`. With tokens: `HELLO 3 AUTH u <token> SETNAME "bad name"` checks the name
/// first (Redis 7.2 does) and leaves the connection unauthenticated.
#[test]
fn auth_answers_as_redis_7() {
    let served = Served::start("memory", "", &[]);
    assert_eq!(
        exchange(
            &served.resp,
            b"AUTH x\r\nAUTH default x\r\nAUTH bob x\r\nHELLO 2 AUTH default x\r\n"
        )
        .lines()
        .take(3)
        .collect::<Vec<_>>(),
        [
            "-ERR AUTH <password> called without any password configured for the default user. \
             Are you sure your configuration is correct?",
            "+OK",
            "-WRONGPASS invalid username-password pair or user is disabled.",
        ]
    );
    assert!(
        exchange(&served.resp, b"HELLO 2 AUTH default x\r\n").starts_with("*14\r\n$6\r\nserver"),
        "HELLO AUTH default on a server without tokens"
    );
    let token = "full-token-of-thirty-two-chars!";
    let served = Served::start("memory", "", &[("TOLLGATE_TOKENS", token)]);
    let hello = format!("HELLO 3 AUTH default {token} SETNAME \"bad name\"\r\nPING\r\n");
    assert_eq!(
        exchange(&served.resp, hello.as_bytes()),
        "-ERR Client names cannot contain spaces, newlines or special characters.\r\n\
         -NOAUTH Authentication required.\r\n+OK\r\n"
    );
}

/// Wrong tokens are throttled per client address: 20 at once, then one a second; past
/// that, `AUTH` is refused unchecked (a right token too) until one comes back. Each is
/// counted in `tollgate_resp_auth_failures_total` and logged, summed up. A token of a few
/// characters is warned of at start.
#[test]
fn auth_guesses_are_throttled_and_observed() {
    let served = Served::start(
        "memory",
        "[server]\npublicMetrics = true\n",
        &[("TOLLGATE_TOKENS", "short")],
    );
    assert!(served.log().contains("is 5 characters long"), "{}", served.log());
    let mut sent = String::new();
    for i in 0..25 {
        sent.push_str(&format!("AUTH guess{i}\r\n"));
    }
    sent.push_str("AUTH short\r\n");
    let got = exchange(&served.resp, sent.as_bytes());
    let lines: Vec<&str> = got.lines().collect();
    let wrong = lines.iter().filter(|l| l.starts_with("-WRONGPASS")).count();
    let throttled = lines.iter().filter(|l| l.starts_with("-ERR too many wrong tokens")).count();
    assert_eq!((wrong, throttled), (20, 6), "{got}");
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(exchange(&served.resp, b"AUTH short\r\nPING\r\n"), "+OK\r\n+PONG\r\n+OK\r\n");
    let m = served.metrics();
    assert_eq!(
        common::metric(&m, "tollgate_resp_auth_failures_total{reason=\"wrong_token\"}"),
        20.0
    );
    assert_eq!(common::metric(&m, "tollgate_resp_auth_failures_total{reason=\"throttled\"}"), 6.0);
    let log = served.log();
    assert!(log.contains("resp: a wrong token from 127.0.0.1"), "{log}");
}

/// Over `maxConnections`, a Redis client is told `-ERR max number of clients reached`, as
/// Redis tells it, before the connection closes.
#[test]
fn over_max_connections_a_client_is_told() {
    let served = Served::start("memory", "[server]\nmaxConnections = 2\n", &[]);
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&served.resp).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(exchange(&served.resp, b"PING\r\n"), "-ERR max number of clients reached\r\n");
    drop(held);
}

/// Keys over 1,024 bytes are taken, as redis-cell takes them (kept under a key of that
/// size made of their start and their SHA-256): two that differ only in their last byte
/// are two buckets.
#[test]
fn long_keys_are_taken() {
    let served = Served::start("memory", "", &[]);
    let mut c = served.client();
    let long = format!("{}{}", unique("long"), "k".repeat(2_000));
    let (a, b) = (format!("{long}a"), format!("{long}b"));
    assert_eq!(throttle(&mut c, &[&a, "1", "1", "60"])[..3], [0, 2, 1]);
    assert_eq!(throttle(&mut c, &[&a, "1", "1", "60"])[..3], [0, 2, 0]);
    assert_eq!(throttle(&mut c, &[&a, "1", "1", "60"])[0], 1);
    assert_eq!(throttle(&mut c, &[&b, "1", "1", "60"])[..3], [0, 2, 1]);
}

/// The period a client may choose is bounded by `respMaxPeriod` (default a year), and its
/// error names that bound; a period over 1e12 s names it too, not 1e15.
#[test]
fn the_period_is_bounded() {
    let served = Served::start("memory", "", &[]);
    let mut c = served.client();
    let key = unique("period");
    assert_eq!(throttle(&mut c, &[&key, "1", "1", "31536000"])[0], 0);
    for period in ["31536001", "2000000000000", "99999999999999999"] {
        let e = error(&mut c, "CL.THROTTLE", &[&key, "1", "1", period]);
        assert!(
            e.contains(&format!(
                "period is {period}; it must be an integer from 1 to 31536000 (respMaxPeriod)"
            )),
            "{e}"
        );
    }
    let served = Served::start("memory", "[server]\nrespMaxPeriod = \"1h\"\n", &[]);
    let mut c = served.client();
    let e = error(&mut c, "CL.THROTTLE", &[&key, "1", "1", "3601"]);
    assert!(e.contains("from 1 to 3600 (respMaxPeriod)"), "{e}");
}
