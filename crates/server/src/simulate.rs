//! `tollgate simulate`: deterministic replay of JSON lines (SPEC §7).

use std::cell::RefCell;
use std::io::{BufRead, Write};
use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{Value, json};
use tollgate::{Config, ManualClock, MemoryStore, RateLimiter};

use crate::answer::Answer;
use crate::engine::{Engine, Op, Permissions};
use crate::plot::{Point, Recording};
use crate::stats::Taken;
use crate::store::DynStore;

/// A simulation: the memory store on a manual clock, every random choice seeded.
pub struct Simulation {
    engine: Engine,
    clock: ManualClock,
    /// Runs the engine's calls (on the memory store, each answers at once).
    runtime: tokio::runtime::Runtime,
    /// The requests and states to plot, when asked for.
    recording: Option<RefCell<Recording>>,
}

impl Simulation {
    /// A simulation of `limits`, with random choices fixed by `seed`.
    pub fn new(limits: &[(String, Config)], seed: u64) -> Self {
        Self::with_concurrency(limits, &[], seed)
    }

    /// A simulation of `limits` and the concurrency limits `concurrency` (SPEC §6f), with
    /// random choices fixed by `seed`.
    pub fn with_concurrency(
        limits: &[(String, Config)],
        concurrency: &[(String, tollgate::Concurrency)],
        seed: u64,
    ) -> Self {
        let clock = ManualClock::new(0.0);
        let store: DynStore = Arc::new(MemoryStore::with_clock(clock.clone()));
        let mut builder = RateLimiter::builder(store).seed(seed);
        for (name, config) in limits {
            builder = builder.define(name.as_str(), *config);
        }
        for (name, limit) in concurrency {
            builder = builder.define_concurrency(name.as_str(), *limit);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime of one thread for the simulation");
        // The server's defaults: inline configs for names the config does not define, and
        // the defined names' configs as the file says.
        let engine = Engine::new(builder.build(), Permissions::default());
        Simulation { engine, clock, runtime, recording: None }
    }

    /// Also records every `limit`, `check` and `transaction` and the state it left, for
    /// [`Simulation::plot`].
    #[must_use]
    pub fn recording(mut self) -> Self {
        self.recording = Some(RefCell::new(Recording::default()));
        self
    }

    /// The SVG of what was recorded (see [`crate::plot`]); `None` without
    /// [`Simulation::recording`].
    pub fn plot(&self) -> Option<String> {
        self.recording.as_ref().map(|r| r.borrow().svg())
    }

    /// Answers one input line with one output line (without the newline).
    pub fn line(&self, line: &str) -> String {
        self.answer(line).to_string()
    }

    fn answer(&self, line: &str) -> Value {
        let mut input: Value = match serde_json::from_str(line) {
            Ok(value) => value,
            Err(e) => return error(StatusCode::BAD_REQUEST, &format!("malformed JSON: {e}")),
        };
        let Some(fields) = input.as_object_mut() else {
            return error(StatusCode::BAD_REQUEST, "a line must be a JSON object");
        };
        let at = match fields.remove("at") {
            Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
            Some(_) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "at: must be a number (ms since the Unix epoch)",
                );
            }
            None => return error(StatusCode::BAD_REQUEST, "at: missing (ms since the Unix epoch)"),
        };
        if !at.is_finite() {
            return error(StatusCode::BAD_REQUEST, "at: must be a finite number");
        }
        let op = match fields.remove("op") {
            Some(Value::String(op)) => op,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "op: missing; one of limit, check, transaction, reset, value, adjust, \
                     acquire, release, renew",
                );
            }
        };
        let Some(op) = Op::parse(&op) else {
            return error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "op: {op:?} is not one of limit, check, transaction, reset, value, adjust, \
                     acquire, release, renew"
                ),
            );
        };
        self.clock.set(at);
        let body = serde_json::to_vec(&input).unwrap_or_default();
        let answer = with_status(self.runtime.block_on(self.engine.run(op, &body)));
        if let Some(recording) = &self.recording
            && answer.get("status").is_none()
        {
            self.record(&mut recording.borrow_mut(), op, at, &input, &answer);
        }
        answer
    }

    /// Records the limits a successful `limit`, `check` or `transaction` asked of, each with
    /// its outcome and the state it left (read back with a `value`).
    fn record(&self, recording: &mut Recording, op: Op, at: f64, input: &Value, answer: &Value) {
        let outcome = |decision: &Value| {
            Taken::of(decision["ok"] == Value::Bool(true), decision["retryAfter"].as_f64())
        };
        let asked: Vec<(&Value, Taken)> = match op {
            Op::Limit | Op::Check => vec![(input, outcome(answer))],
            Op::Transaction => {
                let refused = answer["ok"] == Value::Bool(false);
                let limits = input["limits"].as_array().map(Vec::as_slice).unwrap_or_default();
                let results = answer["results"].as_array().map(Vec::as_slice).unwrap_or_default();
                limits
                    .iter()
                    .zip(results)
                    .map(|(l, r)| (l, if refused { Taken::Refused } else { outcome(r) }))
                    .collect()
            }
            Op::Reset | Op::Value | Op::Adjust | Op::Acquire | Op::Release | Op::Renew => return,
        };
        for (request, outcome) in asked {
            let Some(name) = request["name"].as_str() else { continue };
            let key = request["key"].as_str().unwrap_or_default();
            let mut query = json!({ "name": name });
            if let Some(k) = request.get("key").filter(|k| !k.is_null()) {
                query["key"] = k.clone();
            }
            if let Some(c) = request.get("config").filter(|c| !c.is_null()) {
                query["config"] = c.clone();
            }
            let body = query.to_string();
            let reading = self.runtime.block_on(self.engine.run(Op::Value, body.as_bytes()));
            if reading.status != StatusCode::OK {
                continue;
            }
            let reading = reading.body.into_value();
            let config = serde_json::from_value::<tollgate::RawConfig>(reading["config"].clone())
                .ok()
                .and_then(|raw| Config::try_from(&raw).ok());
            let (Some(config), Some(value), Some(ts)) =
                (config, reading["value"].as_f64(), reading["ts"].as_f64())
            else {
                continue;
            };
            let point = Point {
                at,
                count: request["count"].as_f64().unwrap_or(1.0),
                outcome,
                op: op.name(),
                state: tollgate::core::State { value, ts },
            };
            recording.record(name, key, config, point);
        }
    }

    /// Reads lines from `input` until it ends, writing one answer line per line to `output`.
    /// Empty lines are skipped.
    ///
    /// # Errors
    ///
    /// Reading or writing fails.
    pub fn run(&self, input: impl BufRead, mut output: impl Write) -> std::io::Result<u64> {
        let mut lines = 0;
        for line in input.lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            writeln!(output, "{}", self.line(&line))?;
            lines += 1;
        }
        output.flush()?;
        Ok(lines)
    }
}

/// The answer body, with `status` added when it would not be 200.
fn with_status(answer: Answer) -> Value {
    let mut body = answer.body.into_value();
    if answer.status != StatusCode::OK
        && let Some(fields) = body.as_object_mut()
    {
        fields.insert("status".into(), json!(answer.status.as_u16()));
    }
    body
}

fn error(status: StatusCode, message: &str) -> Value {
    json!({ "error": message, "status": status.as_u16() })
}
