//! The server's request parsing and operations on any bytes: never a panic; every answer
//! that is not 200 is an error (`{"error": ...}`) or a throws refusal (429 with its kind);
//! and a request answered with an error takes nothing (the states of the server's limits
//! are as before).
#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use tollgate::{Config, MINUTE, ManualClock, MemoryStore, RateLimiter};
use tollgate_server::engine::{Engine, Op, Permissions};
use tollgate_server::store::DynStore;

struct Fixture {
    engine: Engine,
    runtime: tokio::runtime::Runtime,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let store: DynStore = Arc::new(MemoryStore::with_clock(ManualClock::new(1.7e12)));
    let limiter = RateLimiter::builder(store)
        .define("a", Config::token_bucket(10.0, MINUTE).with_capacity(3.0))
        .define("b", Config::fixed_window(5.0, MINUTE).with_shards(4))
        .build();
    Fixture {
        engine: Engine::new(limiter, Permissions::default()),
        runtime: tokio::runtime::Builder::new_current_thread().build().unwrap(),
    }
});

const OPS: [Op; 5] = [Op::Limit, Op::Check, Op::Transaction, Op::Reset, Op::Value];

/// What the defined limits hold for the keys a fuzzed body is likely to name.
fn snapshot(f: &Fixture) -> Vec<String> {
    let mut states = Vec::new();
    for name in ["a", "b"] {
        for key in ["", "k", "a", "\"k\""] {
            let body = serde_json::json!({ "name": name, "key": key, "sampleShards": 4 });
            let answer = f.runtime.block_on(f.engine.run(Op::Value, body.to_string().as_bytes()));
            states.push(answer.body.to_json());
        }
    }
    states
}

fuzz_target!(|data: &[u8]| {
    let Some((&op, body)) = data.split_first() else { return };
    let f = &*FIXTURE;
    let op = OPS[usize::from(op) % OPS.len()];
    let before = snapshot(f);
    let answer = f.runtime.block_on(f.engine.run(op, body));
    let json: serde_json::Value = serde_json::from_str(&answer.body.to_json()).expect("JSON");
    match answer.status.as_u16() {
        200 => {}
        429 => assert_eq!(json["kind"], "RateLimited", "{json}"),
        status => {
            let message = json["error"].as_str().unwrap_or_else(|| panic!("{status}: {json}"));
            assert!(!message.is_empty());
            assert!(!message.contains("tollgate_server::"), "a type name in a message: {message}");
            assert_eq!(before, snapshot(f), "{status} {message}: something was taken");
        }
    }
});
