//! The `TG.*` commands: every operation of SPEC §4 with the HTTP API's fields, written as
//! words that read well in `redis-cli`:
//!
//! ```text
//! TG.LIMIT name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json]
//! TG.CHECK name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json]
//! TG.TRANSACTION LIMIT name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json] [LIMIT name ...]
//! TG.RESET name [KEY key] [CONFIG json]
//! TG.VALUE name [KEY key] [SAMPLESHARDS n] [CONFIG json]
//! TG.ACQUIRE name [KEY key] [COUNT n] [TTL ms] [THROWS]
//! TG.RELEASE name TICKET ticket [KEY key]
//! TG.RENEW name TICKET ticket [KEY key] [TTL ms]
//! TG.TIME
//! TG.CONFIG
//! ```
//!
//! Each is read into the JSON body its HTTP twin takes and run by the same
//! [`crate::engine::Engine::run`], so that both answer the same numbers and the same errors; the answer's
//! JSON becomes the reply (objects are maps: a RESP3 map, or a flat array of fields and
//! values in RESP2).

use serde_json::{Map, Value};

use crate::engine::Op;

/// A `TG.*` command: the operation and its HTTP body.
#[derive(Debug, PartialEq)]
pub enum Tg {
    /// An operation with a body.
    Run(Op, Vec<u8>),
    /// `TG.TIME`.
    Time,
    /// `TG.CONFIG`.
    Config,
}

impl Tg {
    /// The operation's name, for metrics and spans.
    pub fn name(&self) -> &'static str {
        match self {
            Tg::Run(op, _) => op.name(),
            Tg::Time => "time",
            Tg::Config => "config",
        }
    }

    /// Whether a read token may run it (as `READ_PATHS` says for HTTP).
    pub fn reads_only(&self) -> bool {
        matches!(self, Tg::Run(Op::Check | Op::Value, _) | Tg::Time | Tg::Config)
    }
}

/// How each command is written, for its errors.
fn usage(command: &str) -> &'static str {
    match command {
        "tg.limit" => "TG.LIMIT name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json]",
        "tg.check" => "TG.CHECK name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json]",
        "tg.transaction" => {
            "TG.TRANSACTION LIMIT name [KEY key] [COUNT n] [RESERVE] [THROWS] [CONFIG json] \
             [LIMIT name ...]"
        }
        "tg.reset" => "TG.RESET name [KEY key] [CONFIG json]",
        "tg.value" => "TG.VALUE name [KEY key] [SAMPLESHARDS n] [CONFIG json]",
        "tg.adjust" => "TG.ADJUST name COUNT n [KEY key] [CONFIG json]",
        "tg.acquire" => "TG.ACQUIRE name [KEY key] [COUNT n] [TTL ms] [THROWS]",
        "tg.release" => "TG.RELEASE name TICKET ticket [KEY key]",
        "tg.renew" => "TG.RENEW name TICKET ticket [KEY key] [TTL ms]",
        "tg.time" => "TG.TIME",
        _ => "TG.CONFIG",
    }
}

/// Reads `TG.<command> args...` (`command` lowercase, without `tg.`'s arguments); `None` if
/// there is no such command.
///
/// # Errors
///
/// The arguments do not fit the command: what was wrong, and how it is written.
pub fn parse(command: &str, args: &[&[u8]]) -> Option<Result<Tg, String>> {
    let op = match command {
        "tg.limit" => Op::Limit,
        "tg.check" => Op::Check,
        "tg.transaction" => Op::Transaction,
        "tg.reset" => Op::Reset,
        "tg.value" => Op::Value,
        "tg.adjust" => Op::Adjust,
        "tg.acquire" => Op::Acquire,
        "tg.release" => Op::Release,
        "tg.renew" => Op::Renew,
        "tg.time" | "tg.config" => {
            if !args.is_empty() {
                return Some(Err(format!("wrong number of arguments for '{command}' command")));
            }
            return Some(Ok(if command == "tg.time" { Tg::Time } else { Tg::Config }));
        }
        _ => return None,
    };
    let body = match op {
        Op::Transaction => transaction(args),
        _ => match args.split_first() {
            None => Err(format!("wrong number of arguments for '{command}' command")),
            Some((name, options)) => one(op, name, options),
        },
    };
    Some(
        body.map(|body| Tg::Run(op, serde_json::to_vec(&body).unwrap_or_default()))
            .map_err(|e| format!("{e} (usage: {})", usage(command))),
    )
}

/// `args` as text.
fn text<'a>(arg: &'a [u8], what: &str) -> Result<&'a str, String> {
    std::str::from_utf8(arg).map_err(|_| format!("{what} must be UTF-8 text"))
}

/// One limit's `name [OPTION value]...` as its JSON object.
fn one(op: Op, name: &[u8], options: &[&[u8]]) -> Result<Map<String, Value>, String> {
    let mut body = Map::new();
    body.insert("name".into(), Value::String(text(name, "name")?.to_owned()));
    let mut rest = options.iter();
    while let Some(option) = rest.next() {
        let option = text(option, "an option")?.to_ascii_uppercase();
        let mut value = |what: &str| -> Result<&[u8], String> {
            rest.next().copied().ok_or_else(|| format!("{option} needs {what}"))
        };
        let (field, json) = match (option.as_str(), op) {
            ("KEY", _) => ("key", Value::String(text(value("a key")?, "KEY")?.to_owned())),
            ("CONFIG", op) if !matches!(op, Op::Acquire | Op::Release | Op::Renew) => {
                ("config", config(value("a JSON object")?)?)
            }
            ("COUNT", Op::Limit | Op::Check | Op::Transaction | Op::Adjust | Op::Acquire) => {
                ("count", number(value("a number")?, "COUNT")?)
            }
            ("RESERVE", Op::Limit | Op::Check | Op::Transaction) => ("reserve", Value::Bool(true)),
            ("THROWS", Op::Limit | Op::Check | Op::Transaction | Op::Acquire) => {
                ("throws", Value::Bool(true))
            }
            ("TTL", Op::Acquire | Op::Renew) => ("ttl", number(value("a number of ms")?, "TTL")?),
            // The ticket as the string an acquire answered (the HTTP body takes it so).
            ("TICKET", Op::Release | Op::Renew) => {
                ("ticket", Value::String(text(value("a ticket")?, "TICKET")?.to_owned()))
            }
            ("SAMPLESHARDS", Op::Value) => {
                ("sampleShards", number(value("a number")?, "SAMPLESHARDS")?)
            }
            _ => return Err(format!("syntax error: unknown option {option:?}")),
        };
        if body.insert(field.into(), json).is_some() {
            return Err(format!("syntax error: {option} given twice"));
        }
    }
    Ok(body)
}

/// `LIMIT name [options] LIMIT name [options]...` as `{ limits: [...] }`.
fn transaction(args: &[&[u8]]) -> Result<Map<String, Value>, String> {
    let mut limits = Vec::new();
    let mut at = 0;
    while at < args.len() {
        if !args[at].eq_ignore_ascii_case(b"LIMIT") {
            return Err(format!(
                "syntax error: expected LIMIT, got {:?}",
                String::from_utf8_lossy(args[at])
            ));
        }
        let Some(name) = args.get(at + 1) else {
            return Err("syntax error: LIMIT needs a name".into());
        };
        // The options run to the next LIMIT that stands where an option would: a key or a
        // count of "LIMIT" is a value, not a start.
        let mut end = at + 2;
        while end < args.len() && !args[end].eq_ignore_ascii_case(b"LIMIT") {
            let takes_value = ["KEY", "COUNT", "CONFIG"]
                .iter()
                .any(|o| args[end].eq_ignore_ascii_case(o.as_bytes()));
            end += if takes_value { 2 } else { 1 };
        }
        let end = end.min(args.len());
        limits.push(Value::Object(one(Op::Transaction, name, &args[at + 2..end])?));
        at = end;
    }
    let mut body = Map::new();
    body.insert("limits".into(), Value::Array(limits));
    Ok(body)
}

/// A number argument, as the JSON number it stands for.
fn number(arg: &[u8], what: &str) -> Result<Value, String> {
    let shown = String::from_utf8_lossy(arg);
    let n: f64 = text(arg, what)?
        .parse()
        .map_err(|_| format!("{what} is {shown:?}; it must be a number"))?;
    serde_json::Number::from_f64(n)
        .map(Value::Number)
        .ok_or_else(|| format!("{what} is {shown}; it must be finite"))
}

/// A `CONFIG` argument: a JSON object, as the HTTP body's `config`.
fn config(arg: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice::<Value>(arg) {
        Ok(object @ Value::Object(_)) => Ok(object),
        Ok(_) => Err("CONFIG must be a JSON object such as \
                      {\"kind\":\"token bucket\",\"rate\":10,\"period\":\"1m\"}"
            .into()),
        Err(e) => Err(format!("CONFIG is not JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(command: &str, args: &[&str]) -> Result<Value, String> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        match parse(command, &args).unwrap()? {
            Tg::Run(_, body) => Ok(serde_json::from_slice(&body).unwrap()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn words_become_the_http_body() {
        assert_eq!(
            body("tg.limit", &["sendMessage", "key", "alice", "COUNT", "2.5", "RESERVE"]).unwrap(),
            serde_json::json!({ "name": "sendMessage", "key": "alice", "count": 2.5, "reserve": true })
        );
        assert_eq!(
            body(
                "tg.value",
                &[
                    "api",
                    "SAMPLESHARDS",
                    "4",
                    "CONFIG",
                    r#"{"kind":"token bucket","rate":1,"period":1000}"#
                ]
            )
            .unwrap(),
            serde_json::json!({ "name": "api", "sampleShards": 4.0,
                "config": { "kind": "token bucket", "rate": 1, "period": 1000 } })
        );
        assert_eq!(
            body("tg.transaction", &["LIMIT", "a", "KEY", "LIMIT", "LIMIT", "b", "COUNT", "3"])
                .unwrap(),
            serde_json::json!({ "limits": [{ "name": "a", "key": "LIMIT" }, { "name": "b", "count": 3.0 }] })
        );
        assert!(matches!(parse("tg.time", &[]), Some(Ok(Tg::Time))));
        assert!(parse("tg.nothing", &[]).is_none());
        assert_eq!(
            body("tg.acquire", &["gpu", "KEY", "t1", "COUNT", "2", "TTL", "30000", "THROWS"])
                .unwrap(),
            serde_json::json!({ "name": "gpu", "key": "t1", "count": 2.0, "ttl": 30000.0, "throws": true })
        );
        assert_eq!(
            body("tg.renew", &["gpu", "TICKET", "17", "TTL", "5000"]).unwrap(),
            serde_json::json!({ "name": "gpu", "ticket": "17", "ttl": 5000.0 })
        );
        let e = body("tg.release", &["gpu", "TTL", "5"]).unwrap_err();
        assert!(e.starts_with("syntax error: unknown option \"TTL\""), "{e}");
    }

    #[test]
    fn bad_words_say_how_the_command_is_written() {
        let e = body("tg.limit", &["a", "COUNT", "x"]).unwrap_err();
        assert!(e.starts_with("COUNT is \"x\"; it must be a number (usage: TG.LIMIT name"), "{e}");
        let e = body("tg.limit", &["a", "SAMPLESHARDS", "2"]).unwrap_err();
        assert!(e.starts_with("syntax error: unknown option \"SAMPLESHARDS\""), "{e}");
        let e = body("tg.reset", &["a", "KEY"]).unwrap_err();
        assert!(e.starts_with("KEY needs a key"), "{e}");
        let e = body("tg.limit", &["a", "KEY", "x", "key", "y"]).unwrap_err();
        assert!(e.starts_with("syntax error: KEY given twice"), "{e}");
        let e = body("tg.transaction", &["a"]).unwrap_err();
        assert!(e.starts_with("syntax error: expected LIMIT, got \"a\""), "{e}");
        let e = body("tg.limit", &["a", "CONFIG", "[1]"]).unwrap_err();
        assert!(e.starts_with("CONFIG must be a JSON object"), "{e}");
        let e = body("tg.limit", &[]).unwrap_err();
        assert!(e.starts_with("wrong number of arguments for 'tg.limit' command"), "{e}");
    }
}
