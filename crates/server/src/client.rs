//! `tollgate limit|check|reset|value NAME`: the API from a shell.

use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

/// The options of the client commands.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The limit's name.
    name: String,
    /// The key (a user, an IP); none: the global value.
    #[arg(long)]
    key: Option<String>,
    /// Tokens to take (limit, check).
    #[arg(long)]
    count: Option<f64>,
    /// Book a shortfall ahead instead of refusing (limit, check).
    #[arg(long)]
    reserve: bool,
    /// The server.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        hide_env_values = true,
        default_value = "http://127.0.0.1:8787"
    )]
    server: String,
    /// A bearer token, if the server wants one.
    #[arg(long, env = "TOLLGATE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print the server's JSON answer instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Sends `op` and prints the answer. Exit code 0 when granted (or done), 1 when refused,
/// 2 on an error.
///
/// # Errors
///
/// The server cannot be reached.
pub fn run(op: &str, args: ClientArgs) -> anyhow::Result<ExitCode> {
    let mut body = json!({ "name": args.name });
    if let Some(key) = &args.key {
        body["key"] = json!(key);
    }
    if matches!(op, "limit" | "check") {
        if let Some(count) = args.count {
            body["count"] = json!(count);
        }
        if args.reserve {
            body["reserve"] = json!(true);
        }
    } else if args.count.is_some() || args.reserve {
        bail!("--count and --reserve apply to limit and check only");
    }
    let url = format!("{}/v1/{op}", args.server.trim_end_matches('/'));
    let (status, answer) = call(&url, args.token.as_deref(), Some(&body))?;
    if args.json {
        println!("{answer}");
    }
    if let Some(error) = answer.get("error").and_then(Value::as_str) {
        if !args.json {
            eprintln!("error ({status}): {error}");
        }
        return Ok(ExitCode::from(2));
    }
    let granted = answer.get("ok").and_then(Value::as_bool).unwrap_or(true);
    if !args.json {
        println!("{}", describe(op, &answer));
    }
    Ok(if granted { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Sends a request to `url` (a POST of `body`, or a GET without one), with `token` as a
/// bearer token if given: the answer's status and JSON body, whatever the status.
///
/// # Errors
///
/// The server cannot be reached, or its answer is not JSON.
pub fn call(url: &str, token: Option<&str>, body: Option<&Value>) -> anyhow::Result<(u16, Value)> {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let authorization = token.map(|token| format!("Bearer {token}"));
    let sent = match body {
        Some(body) => {
            let mut request = agent.post(url);
            if let Some(value) = &authorization {
                request = request.header("Authorization", value);
            }
            request.send_json(body)
        }
        None => {
            let mut request = agent.get(url);
            if let Some(value) = &authorization {
                request = request.header("Authorization", value);
            }
            request.call()
        }
    };
    // Messages name the URL without the password it may carry.
    let shown = tollgate::store::redacted_url(url);
    let mut response = sent.with_context(|| format!("cannot reach {shown}"))?;
    let answer =
        response.body_mut().read_json().with_context(|| format!("{shown} did not answer JSON"))?;
    Ok((response.status().as_u16(), answer))
}

fn describe(op: &str, answer: &Value) -> String {
    let wait =
        answer.get("retryAfter").and_then(Value::as_f64).map(|ms| format!("{:.3} s", ms / 1_000.0));
    match (op, answer.get("ok").and_then(Value::as_bool)) {
        (_, Some(true)) => match wait {
            Some(wait) => format!("granted (reserved): do the work in {wait}"),
            None => "granted".into(),
        },
        (_, Some(false)) => {
            format!("refused: retry in {}", wait.unwrap_or_else(|| "a while".into()))
        }
        ("reset", _) => "reset".into(),
        ("value", _) => {
            format!("value {} at ts {} (shard {})", answer["value"], answer["ts"], answer["shard"])
        }
        _ => answer.to_string(),
    }
}
