//! `tollgate types`: the limits a server defines, as a TypeScript declaration for the
//! `tollgate-client` npm package, so that its compiler accepts those names (and no misspelling
//! of them) without a config in the call.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::bail;
use clap::Args;
use serde_json::Value;

use crate::config::FileConfig;

/// Where the limits come from: a config file, or a running server.
#[derive(Debug, Args)]
pub struct TypesArgs {
    /// The server's config file (its `[limits.NAME]` tables).
    #[arg(long, required_unless_present = "url", conflicts_with = "url")]
    config: Option<PathBuf>,
    /// A running server: its `GET /v1/config`.
    #[arg(long, required_unless_present = "config")]
    url: Option<String>,
    /// A bearer token for `--url`, if the server wants one (a read token is enough).
    #[arg(long, env = "TOLLGATE_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

/// Prints the declaration.
///
/// # Errors
///
/// The file cannot be read or is invalid, or the server cannot be reached or refuses.
pub fn run(args: &TypesArgs) -> anyhow::Result<()> {
    let (limits, source) = match (&args.config, &args.url) {
        (Some(path), _) => {
            let limits = FileConfig::load(path)?.named_limits()?;
            let object: serde_json::Map<String, Value> = limits
                .iter()
                .map(|(name, config)| Ok((name.clone(), serde_json::to_value(config)?)))
                .collect::<anyhow::Result<_>>()?;
            (object, format!("--config {}", path.display()))
        }
        (None, Some(url)) => {
            let shown = tollgate::store::redacted_url(url);
            let mut limits = fetch(url, args.token.as_deref())?;
            // The declaration names rate limits (what `limit` and `check` take); a server's
            // concurrency limits are left out, as a config file's are.
            limits.retain(|_, config| config["kind"] != "concurrency");
            (limits, format!("--url {shown}"))
        }
        (None, None) => bail!("give --config FILE or --url URL"),
    };
    print!("{}", declaration(&limits, &source));
    Ok(())
}

/// `GET /v1/config` of the server at `url`.
fn fetch(url: &str, token: Option<&str>) -> anyhow::Result<serde_json::Map<String, Value>> {
    let url = format!("{}/v1/config", url.trim_end_matches('/'));
    let (status, answer) = crate::client::call(&url, token, None)?;
    match answer {
        Value::Object(limits) if status == 200 => Ok(limits),
        answer => {
            let error = answer.get("error").and_then(Value::as_str).unwrap_or("no message");
            bail!("{} answered {status}: {error}", tollgate::store::redacted_url(&url))
        }
    }
}

/// The declaration: an augmentation of the package's `ServerLimits` interface, one member per
/// limit, its config as literal types.
pub fn declaration(limits: &serde_json::Map<String, Value>, source: &str) -> String {
    let mut out = String::new();
    out.push_str(
        "// The limits a tollgate server defines, for tollgate-client: names the compiler\n",
    );
    // The source on one line of the comment, whatever it holds (a path may hold a newline).
    let source: String = source.chars().map(|c| if c.is_control() { '?' } else { c }).collect();
    let _ = writeln!(out, "// accepts without a config. Made by `tollgate types {source}`;");
    out.push_str("// make it again when the server's limits change.\n");
    out.push_str("export {};\n\ndeclare module \"tollgate-client\" {\n");
    out.push_str("  interface ServerLimits {\n");
    for (name, config) in limits {
        let _ = writeln!(out, "    {}: {};", Value::String(name.clone()), literal(config));
    }
    out.push_str("  }\n}\n");
    out
}

/// A JSON value as a TypeScript type: its literal type (`"token bucket"`, `10`), objects
/// with readonly members.
fn literal(value: &Value) -> String {
    match value {
        Value::Object(members) => {
            let members: Vec<String> =
                members.iter().map(|(k, v)| format!("readonly {k}: {}", literal(v))).collect();
            format!("{{ {} }}", members.join("; "))
        }
        // Numbers, strings, booleans and null are their own literal types in TypeScript's
        // syntax, written as JSON writes them.
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's comment stays one comment whatever the source holds: a path with a
    /// newline does not start a line of code.
    #[test]
    fn the_source_stays_in_its_comment() {
        let limits = serde_json::Map::new();
        let out = declaration(&limits, "--config a\nexport const pwned = 1;\r//");
        assert!(!out.lines().any(|l| l.starts_with("export const")), "{out}");
        assert!(out.contains("--config a?export const pwned = 1;?//"), "{out}");
    }

    #[test]
    fn a_declaration_names_each_limit_with_its_config() {
        let limits = serde_json::json!({
            "sendMessage": { "kind": "token bucket", "rate": 10, "period": 60000, "capacity": 3 },
            "odd \"name\"": { "kind": "fixed window", "rate": 1.5, "period": 1000 },
        });
        let text = declaration(limits.as_object().unwrap(), "--config t.toml");
        assert!(
            text.contains("declare module \"tollgate-client\" {\n  interface ServerLimits {\n")
        );
        assert!(text.contains(
            "    \"sendMessage\": { readonly capacity: 3; readonly kind: \"token bucket\"; \
             readonly period: 60000; readonly rate: 10 };\n"
        ));
        assert!(text.contains("    \"odd \\\"name\\\"\": { readonly kind: \"fixed window\";"));
        assert!(text.contains("`tollgate types --config t.toml`"));
    }
}
