//! The server's settings: a TOML file, overridden by flags and `TOLLGATE_TOKENS`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;
use tollgate::core::Period;
use tollgate::{Config, HOUR, MINUTE, RawConfig};

/// The default address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";

/// The limit name `CL.THROTTLE` takes from unless `respThrottleName` says otherwise.
pub const DEFAULT_THROTTLE_NAME: &str = "cl.throttle";

/// How long a Redis protocol connection may sit idle: Redis keeps them for ever (its
/// `timeout` is 0), pools keep them long; five minutes frees what a crashed client left.
pub const DEFAULT_RESP_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// The default store: a SQLite file in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://tollgate.db";

/// The config file (SPEC §6).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    server: ServerSection,
    #[serde(default)]
    limits: BTreeMap<String, LimitTable>,
}

/// A `[limits.<name>]` table: the limit's config (SPEC §1), and `failOpen = true` for a limit
/// that is granted while the store fails (see `tollgate::RateLimiterBuilder::fail_open`).
#[derive(Debug)]
struct LimitTable {
    /// A rate limit's config; none for a concurrency limit.
    config: Option<RawConfig>,
    /// `kind = "concurrency"`: slots in flight (SPEC §6f), with `max` and `ttl`.
    concurrency: Option<tollgate::Concurrency>,
    fail_open: bool,
    /// `lease = true` or `lease = { term, share, floor, hotAfter }`: served from leases on a
    /// Redis or PostgreSQL store.
    lease: Option<LeaseTable>,
}

/// The tuning of a leased limit (`tollgate::store::LeaseOptions`); each field optional.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseTable {
    term: Option<Period>,
    share: Option<f64>,
    floor: Option<f64>,
    #[serde(rename = "hotAfter")]
    hot_after: Option<i64>,
}

impl<'de> Deserialize<'de> for LimitTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(deserializer)?;
        let mut flag = |name: &str| match table.remove(name) {
            None => Ok(false),
            Some(toml::Value::Boolean(yes)) => Ok(yes),
            Some(other) => {
                Err(D::Error::custom(format!("{name} is {other}; it must be true or false")))
            }
        };
        let fail_open = flag("failOpen")?;
        if table.get("kind").and_then(toml::Value::as_str) == Some("concurrency") {
            return concurrency_table(table, fail_open).map_err(D::Error::custom);
        }
        let lease = match table.remove("lease") {
            None | Some(toml::Value::Boolean(false)) => None,
            Some(toml::Value::Boolean(true)) => Some(LeaseTable::default()),
            Some(toml::Value::Table(tuning)) => Some(
                toml::Value::Table(tuning)
                    .try_into()
                    .map_err(|e| D::Error::custom(format!("lease: {e}")))?,
            ),
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "lease is {other}; it must be true, false or {{ term, share, floor, hotAfter }}"
                )));
            }
        };
        // The rest is the config, with its own errors for unknown or invalid fields.
        let config = toml::Value::Table(table).try_into().map_err(D::Error::custom)?;
        Ok(LimitTable { config: Some(config), concurrency: None, fail_open, lease })
    }
}

/// A `[limits.<name>]` table of `kind = "concurrency"`: `max` (a whole number) and `ttl`
/// (ms or a duration, default 60 s), nothing else.
fn concurrency_table(mut table: toml::Table, fail_open: bool) -> Result<LimitTable, String> {
    table.remove("kind");
    if fail_open {
        // A slot granted while the store is down holds nothing: nobody could release it,
        // and the bound would mean nothing.
        return Err("failOpen is not for a concurrency limit (no slot can be held while \
                    the store is down)"
            .into());
    }
    let max = match table.remove("max") {
        Some(toml::Value::Integer(n)) => n as f64,
        Some(toml::Value::Float(n)) => n,
        Some(other) => return Err(format!("max is {other}; it must be a whole number")),
        None => return Err("a concurrency limit needs max, the slots it holds".into()),
    };
    let ttl = match table.remove("ttl") {
        None => tollgate::core::slots::DEFAULT_TTL,
        Some(value) => {
            let period: Period = value.try_into().map_err(|e| format!("ttl: {e}"))?;
            period.millis().map_err(|e| format!("ttl: {e}"))?
        }
    };
    if let Some(field) = table.keys().next() {
        return Err(format!(
            "unknown field `{field}` for a concurrency limit, expected `kind`, `max` or `ttl`"
        ));
    }
    let concurrency = tollgate::Concurrency::try_new(max, ttl).map_err(|e| e.to_string())?;
    Ok(LimitTable { config: None, concurrency: Some(concurrency), fail_open, lease: None })
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServerSection {
    listen: Option<String>,
    store: Option<String>,
    tokens: Option<Vec<String>>,
    read_tokens: Option<Vec<String>>,
    allow_inline_config: Option<bool>,
    allow_config_override: Option<bool>,
    max_keys: Option<usize>,
    store_deadline: Option<Period>,
    header_timeout: Option<Period>,
    body_timeout: Option<Period>,
    max_connections: Option<usize>,
    shutdown_deadline: Option<Period>,
    rls_listen: Option<String>,
    rls_config: Option<std::path::PathBuf>,
    resp_listen: Option<String>,
    resp_throttle_name: Option<String>,
    resp_idle_timeout: Option<Period>,
    resp_max_period: Option<Period>,
    cors_origins: Option<Vec<String>>,
    allowed_hosts: Option<Vec<String>>,
    public_metrics: Option<bool>,
    drain_delay: Option<Period>,
    /// Where each setting overridden by a flag or the environment came from, to name it in
    /// errors: `--listen`, `TOLLGATE_MAX_KEYS`.
    #[serde(skip)]
    from: BTreeMap<&'static str, String>,
}

impl ServerSection {
    /// How errors name `field`: the flag or variable it came from, or `[server] field`.
    fn label(&self, field: &str) -> String {
        self.from.get(field).cloned().unwrap_or_else(|| format!("[server] {field}"))
    }
}

/// How a setting is written in a variable or flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// As it is.
    Text,
    /// Comma-separated.
    List,
    /// `true` or `false`.
    Bool,
    /// A whole number.
    Count,
    /// Milliseconds (`250`) or a duration (`10s`, `1m`).
    Duration,
}

/// One `[server]` setting: its field in the file, its environment variable, how it is
/// written there, and whether a reload applies it (or it waits for a restart).
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    /// The field of `[server]`.
    pub field: &'static str,
    /// The environment variable.
    pub var: &'static str,
    /// How the variable is written.
    pub kind: Kind,
    /// A reload applies it while serving; otherwise it takes a restart.
    pub live: bool,
}

const fn setting(field: &'static str, var: &'static str, kind: Kind, live: bool) -> Setting {
    Setting { field, var, kind, live }
}

/// Every `[server]` setting, in the order `serve --help` lists them.
pub const SETTINGS: [Setting; 22] = [
    setting("listen", "TOLLGATE_LISTEN", Kind::Text, false),
    setting("store", "TOLLGATE_STORE", Kind::Text, false),
    setting("tokens", "TOLLGATE_TOKENS", Kind::List, false),
    setting("readTokens", "TOLLGATE_READ_TOKENS", Kind::List, false),
    setting("allowInlineConfig", "TOLLGATE_ALLOW_INLINE_CONFIG", Kind::Bool, true),
    setting("allowConfigOverride", "TOLLGATE_ALLOW_CONFIG_OVERRIDE", Kind::Bool, true),
    setting("maxKeys", "TOLLGATE_MAX_KEYS", Kind::Count, false),
    setting("storeDeadline", "TOLLGATE_STORE_DEADLINE", Kind::Duration, false),
    setting("headerTimeout", "TOLLGATE_HEADER_TIMEOUT", Kind::Duration, false),
    setting("bodyTimeout", "TOLLGATE_BODY_TIMEOUT", Kind::Duration, false),
    setting("maxConnections", "TOLLGATE_MAX_CONNECTIONS", Kind::Count, false),
    setting("shutdownDeadline", "TOLLGATE_SHUTDOWN_DEADLINE", Kind::Duration, false),
    setting("drainDelay", "TOLLGATE_DRAIN_DELAY", Kind::Duration, false),
    setting("rlsListen", "TOLLGATE_RLS_LISTEN", Kind::Text, false),
    setting("rlsConfig", "TOLLGATE_RLS_CONFIG", Kind::Text, false),
    setting("respListen", "TOLLGATE_RESP_LISTEN", Kind::Text, false),
    setting("respThrottleName", "TOLLGATE_RESP_THROTTLE_NAME", Kind::Text, false),
    setting("respIdleTimeout", "TOLLGATE_RESP_IDLE_TIMEOUT", Kind::Duration, false),
    setting("respMaxPeriod", "TOLLGATE_RESP_MAX_PERIOD", Kind::Duration, false),
    setting("corsOrigins", "TOLLGATE_CORS_ORIGINS", Kind::List, true),
    setting("allowedHosts", "TOLLGATE_ALLOWED_HOSTS", Kind::List, true),
    setting("publicMetrics", "TOLLGATE_PUBLIC_METRICS", Kind::Bool, false),
];

/// The variable that names the config file (`--config` overrides it).
pub const CONFIG_VAR: &str = "TOLLGATE_CONFIG";

/// Everything `tollgate serve` runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The store URL.
    pub store: String,
    /// Accepted bearer tokens; empty: no authentication.
    pub tokens: Vec<String>,
    /// Bearer tokens that may only read: `value`, `check`, `time` and `config` (for web
    /// pages); needs `tokens`.
    pub read_tokens: Vec<String>,
    /// Whether requests may carry their own config for names the server does not define.
    pub allow_inline_config: bool,
    /// Whether requests may carry their own config for names the server defines.
    pub allow_config_override: bool,
    /// The most live states of the memory store (none: no bound but memory itself).
    pub max_keys: Option<usize>,
    /// How long a request may wait for a networked store (Redis, PostgreSQL) before it
    /// fails; with a circuit breaker after it (see `tollgate::store::CircuitBreaker`).
    pub store_deadline: Duration,
    /// How the HTTP side treats slow and idle clients, and stops.
    pub http: HttpLimits,
    /// Where the rate limit service (Envoy's RLS v3, gRPC) listens, if anywhere.
    pub rls_listen: Option<SocketAddr>,
    /// envoyproxy/ratelimit's configuration (a YAML file or a directory), for the RLS and
    /// `POST /json`.
    pub rls_config: Option<std::path::PathBuf>,
    /// Where the Redis protocol listens, if anywhere (SPEC §6d).
    pub resp_listen: Option<SocketAddr>,
    /// The limit name redis-cell's `CL.THROTTLE` takes from (default `cl.throttle`).
    pub resp_throttle_name: String,
    /// A Redis protocol connection that sends nothing, or takes none of its replies, this
    /// long is closed (default 5 minutes: clients keep pooled connections open and idle).
    pub resp_idle_timeout: Duration,
    /// The longest period, in whole seconds, a client may give `CL.THROTTLE` (default a
    /// year): a state lives as long as its bucket takes to refill, so a client could
    /// otherwise make states that never expire.
    pub resp_max_period: i64,
    /// The origins whose web pages may call the API (`*`: any); see [`crate::browsers`].
    pub cors_origins: Vec<String>,
    /// Host names a server without tokens answers to, besides loopback and its address.
    pub allowed_hosts: Vec<String>,
    /// `/metrics` without a token on a server with tokens.
    pub public_metrics: bool,
    /// The named limits.
    pub limits: Vec<(String, Config)>,
    /// The named concurrency limits (`kind = "concurrency"`, SPEC §6f).
    pub concurrency: Vec<(String, tollgate::Concurrency)>,
    /// The named limits that fail open (`failOpen = true`).
    pub fail_open: Vec<String>,
    /// The named limits served from leases (`lease = true` or a table of its tuning; a
    /// Redis store only), with their options.
    pub lease: Vec<(String, tollgate::store::LeaseOptions)>,
}

impl Settings {
    /// The settings of a config given as JSON of the file's shape (`{"server": {...},
    /// "limits": {...}}`): how the in-process packages (Node, Python) hand over their options
    /// and limits, checked by the same rules and named in the same errors as a file (no
    /// flags or environment over it, no example limits).
    ///
    /// # Errors
    ///
    /// Not JSON of this shape, or a setting or limit that is not valid.
    pub fn from_json(text: &str) -> anyhow::Result<Settings> {
        let file: FileConfig = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        file.settings(&Overrides::default(), false)
    }

    /// Refuses a non-loopback address (the HTTP API's or the rate limit service's) without
    /// tokens, unless `allowed` (`--allow-unauthenticated-public`): anyone who could reach it
    /// could use and reset the limits. `serve` and `check-config` both ask.
    ///
    /// # Errors
    ///
    /// The address, and how to fix it.
    pub fn public_without_tokens(&self, allowed: bool) -> anyhow::Result<()> {
        for addr in std::iter::once(self.listen).chain(self.rls_listen).chain(self.resp_listen) {
            if self.tokens.is_empty() && !addr.ip().is_loopback() && !allowed {
                anyhow::bail!(
                    "refusing to listen on {addr} without tokens: anyone who can reach it could \
                     use and reset your limits. Set [server] tokens or TOLLGATE_TOKENS, or pass \
                     --allow-unauthenticated-public."
                );
            }
        }
        Ok(())
    }
}

/// How the HTTP side treats slow and idle clients, and how it stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    /// A connection that takes longer to send a request's headers, or that sits idle
    /// between requests for longer, is closed (one timer, hyper's).
    pub header_timeout: Duration,
    /// A request whose body takes longer to arrive is answered 408 and its connection
    /// closed.
    pub body_timeout: Duration,
    /// Connections beyond this many are closed as soon as they are accepted.
    pub max_connections: usize,
    /// After SIGTERM, requests in flight have this long to finish; then every connection is
    /// cut and the process exits.
    pub shutdown_deadline: Duration,
    /// After SIGTERM, how long the listeners go on accepting while `/healthz` says
    /// `draining` (and gRPC health `NOT_SERVING`), so that load balancers stop sending
    /// before they close; 0: they close at once.
    pub drain_delay: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            shutdown_deadline: Duration::from_secs(10),
            drain_delay: Duration::ZERO,
        }
    }
}

/// The default store deadline: far more than a round trip on a healthy network, far less
/// than a user notices.
pub const DEFAULT_STORE_DEADLINE: Duration = Duration::from_millis(250);

/// A duration of the `[server]` table (or of the flag or variable `label` names): at least
/// `least` (more than 0 when that is 0, unless `zero`), at most a day.
fn duration(
    label: &str,
    value: Option<&Period>,
    default: Duration,
    zero: bool,
    least: Duration,
) -> anyhow::Result<Duration> {
    let Some(value) = value else { return Ok(default) };
    let ms = millis(label, value, "250 (ms) or \"10s\"")?;
    if zero && ms == 0.0 {
        return Ok(Duration::ZERO);
    }
    if !(ms > 0.0 && ms <= tollgate::DAY) {
        let least = if zero { "at least 0" } else { "more than 0" };
        bail!("{label} is {ms} ms; it must be {least} and at most a day");
    }
    let floor = least.as_secs_f64() * 1e3;
    if ms < floor {
        bail!(
            "{label} is {ms} ms; it must be at least {floor} ms (less would fail every request, \
             or cut off every client)"
        );
    }
    Ok(Duration::from_secs_f64(ms / 1_000.0))
}

/// The milliseconds of the setting `label`'s `value`, or an error that shows it as written
/// and gives `examples` of what it takes.
fn millis(label: &str, value: &Period, examples: &str) -> anyhow::Result<f64> {
    value.millis().map_err(|_| {
        let written = match value {
            Period::Millis(ms) => ms.to_string(),
            Period::Text(text) => format!("{text:?}"),
        };
        anyhow::anyhow!("{label}: {written} is not a duration such as {examples}")
    })
}

/// The longest period a server may let `CL.THROTTLE` clients choose, in seconds
/// (`respMaxPeriod`): 1e12 s, tollgate's bound on periods (1e15 ms).
pub const MAX_RESP_PERIOD: i64 = 1_000_000_000_000;

/// The default `respMaxPeriod`: a year, the longest window of any quota people run, so that
/// a state a client makes expires within a year (when it takes no more than `count` at a
/// time).
pub const DEFAULT_RESP_MAX_PERIOD: i64 = 365 * 86_400;

/// `respMaxPeriod` in whole seconds (a part of a second is dropped): at least a second, at
/// most 1e12 s (tollgate's bound on a period); by default a year.
fn max_period(label: &str, value: &Option<Period>) -> anyhow::Result<i64> {
    let Some(value) = value else { return Ok(DEFAULT_RESP_MAX_PERIOD) };
    let ms = millis(label, value, "\"1d\" or \"365d\"")?;
    if !(ms >= 1_000.0 && ms <= MAX_RESP_PERIOD as f64 * 1_000.0) {
        bail!("{label} is {ms} ms; it must be at least 1 s and at most 1e12 s");
    }
    Ok((ms / 1_000.0).floor() as i64)
}

/// The tokens of `field` in the file and of the variable `var` (comma-separated), checked:
/// none empty, each visible ASCII.
fn token_list(
    field: &str,
    file: Option<&[String]>,
    var: &str,
    env: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    let mut tokens = file.map(<[String]>::to_vec).unwrap_or_default();
    if let Some(env) = env {
        // Set but blank, or with an empty item ("a,,b"): a mistake that would otherwise
        // leave the server open, or lock its clients out.
        if env.trim().is_empty() {
            bail!(
                "{var} is set but holds no token; unset it to run without them, or give them \
                 comma-separated"
            );
        }
        for (i, token) in env.split(',').map(str::trim).enumerate() {
            if token.is_empty() {
                bail!("{var}: item {} is empty (\"a,,b\" or a trailing comma?)", i + 1);
            }
            tokens.push(token.to_owned());
        }
    }
    if tokens.iter().any(String::is_empty) {
        bail!("{field}: an empty token can never be sent, so it would lock every client out");
    }
    if tokens.iter().any(|t| !t.bytes().all(|b| b.is_ascii_graphic())) {
        bail!(
            "{field} must be visible ASCII (no spaces, control characters or other \
             characters): a client could not send another one in an Authorization header"
        );
    }
    Ok(tokens)
}

/// A TOML error as `toml` shows it (where, the line with a caret under the place, why), with
/// the secrets a config holds left out: on a line of `tokens` or `readTokens` (or inside
/// their array), every string is `***`; a URL's password is `***` wherever it appears. Both
/// the reload's log and `check-config` show this.
fn shown_error(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim_end();
    let Some(span) = e.span() else { return redact_urls(message) };
    let at = span.start.min(text.len());
    let line_no = text[..at].matches('\n').count() + 1;
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    let line = text[line_start..line_end].trim_end_matches('\r');
    let column = text[line_start..at].chars().count() + 1;
    // The key whose value the line is in: its own, or the last one above it (an array over
    // several lines).
    let key = text[..line_end]
        .lines()
        .rev()
        .find_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_ascii_lowercase()))
        .unwrap_or_default();
    let secret = key.contains("token");
    let (shown_line, message) = if secret {
        (strings_hidden(line), strings_hidden(message))
    } else {
        (redact_urls(line), redact_urls(message))
    };
    let width = line_no.to_string().len();
    let caret = " ".repeat(column - 1) + &"^".repeat(span.len().clamp(1, 80));
    let pad = " ".repeat(width);
    format!(
        "TOML parse error at line {line_no}, column {column}\n{pad} |\n{line_no} | {shown_line}\n\
         {pad} | {caret}\n{message}"
    )
}

/// `text` with every quoted string replaced by `"***"`.
fn strings_hidden(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match quote {
            Some(q) if c == q => {
                out.push_str("***");
                out.push(c);
                quote = None;
            }
            Some(_) => {}
            None => {
                out.push(c);
                if c == '"' || c == '\'' || c == '`' {
                    quote = Some(c);
                }
            }
        }
    }
    if quote.is_some() {
        out.push_str("***");
    }
    out
}

/// `text` with the password of every URL in it replaced by `***`.
fn redact_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        // The URL: from its scheme (letters, digits, + - .) to a space or a quote.
        let start = rest[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "+-.".contains(c)))
            .map_or(0, |i| i + 1);
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || "\"'`".contains(c))
            .map_or(rest.len(), |i| at + i);
        out.push_str(&rest[..start]);
        out.push_str(&tollgate::store::redacted_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// What the command line and the environment say, to override the file: flags first, then
/// variables.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `TOLLGATE_TOKENS`, comma-separated (added to the file's).
    pub tokens_env: Option<String>,
    /// `TOLLGATE_READ_TOKENS`, comma-separated (added to the file's).
    pub read_tokens_env: Option<String>,
    /// Other settings: (field, value, the flag or variable it came from), flags first.
    values: Vec<(&'static str, String, String)>,
}

impl Overrides {
    /// The variables of [`SETTINGS`] among `vars` (the process's environment).
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut overrides = Overrides::default();
        for (var, value) in vars {
            match var.as_str() {
                "TOLLGATE_TOKENS" => overrides.tokens_env = Some(value),
                "TOLLGATE_READ_TOKENS" => overrides.read_tokens_env = Some(value),
                _ => {
                    if let Some(s) = SETTINGS.iter().find(|s| s.var == var) {
                        overrides.values.push((s.field, value, var));
                    }
                }
            }
        }
        overrides
    }

    /// The setting `field` as the flag `flag` gives it, if it does: it overrides the
    /// variable.
    #[must_use]
    pub fn flag(mut self, field: &'static str, flag: &str, value: Option<String>) -> Self {
        if let Some(value) = value {
            self.values.retain(|(f, _, _)| *f != field);
            self.values.insert(0, (field, value, flag.to_owned()));
        }
        self
    }

    /// `server` with these values in place of its own.
    fn apply(&self, server: &mut ServerSection) -> anyhow::Result<()> {
        for (field, value, from) in &self.values {
            let list = || -> anyhow::Result<Vec<String>> {
                let items: Vec<String> = value.split(',').map(|v| v.trim().to_owned()).collect();
                if let Some(i) = items.iter().position(String::is_empty) {
                    bail!("{from}: item {} is empty (\"a,,b\" or a trailing comma?)", i + 1);
                }
                Ok(items)
            };
            let boolean = || match value.trim() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(anyhow::anyhow!("{from} is {value:?}; it must be true or false")),
            };
            let count = || {
                value
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| anyhow::anyhow!("{from} is {value:?}; it must be a whole number"))
            };
            let period = || match value.trim().parse::<f64>() {
                Ok(ms) => Period::Millis(ms),
                Err(_) => Period::Text(value.trim().to_owned()),
            };
            match *field {
                "listen" => server.listen = Some(value.clone()),
                "store" => server.store = Some(value.clone()),
                "allowInlineConfig" => server.allow_inline_config = Some(boolean()?),
                "allowConfigOverride" => server.allow_config_override = Some(boolean()?),
                "maxKeys" => server.max_keys = Some(count()?),
                "storeDeadline" => server.store_deadline = Some(period()),
                "headerTimeout" => server.header_timeout = Some(period()),
                "bodyTimeout" => server.body_timeout = Some(period()),
                "maxConnections" => server.max_connections = Some(count()?),
                "shutdownDeadline" => server.shutdown_deadline = Some(period()),
                "drainDelay" => server.drain_delay = Some(period()),
                "rlsListen" => server.rls_listen = Some(value.clone()),
                "rlsConfig" => server.rls_config = Some(value.into()),
                "respListen" => server.resp_listen = Some(value.clone()),
                "respThrottleName" => server.resp_throttle_name = Some(value.clone()),
                "respIdleTimeout" => server.resp_idle_timeout = Some(period()),
                "respMaxPeriod" => server.resp_max_period = Some(period()),
                "corsOrigins" => server.cors_origins = Some(list()?),
                "allowedHosts" => server.allowed_hosts = Some(list()?),
                "publicMetrics" => server.public_metrics = Some(boolean()?),
                _ => continue,
            }
            // A flag comes first: a variable of the same setting does not rename it.
            server.from.entry(field).or_insert_with(|| from.clone());
        }
        Ok(())
    }
}

impl FileConfig {
    /// Reads and parses a config file.
    ///
    /// # Errors
    ///
    /// The file cannot be read, is not TOML of this shape, or a limit's config is invalid.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    /// Parses a config file's text.
    ///
    /// # Errors
    ///
    /// Not TOML of this shape.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        toml::from_str(text).map_err(|e| anyhow::anyhow!(shown_error(&e, text)))
    }

    /// The limits this file defines, validated; the examples when it defines none and `examples`.
    fn limits(&self, examples: bool) -> anyhow::Result<Vec<(String, Config)>> {
        if self.limits.is_empty() && examples {
            return Ok(example_limits());
        }
        self.limits
            .iter()
            .filter_map(|(name, table)| Some((name, table.config.as_ref()?)))
            .map(|(name, raw)| {
                let config = Config::try_from(raw).with_context(|| format!("[limits.{name}]"))?;
                tollgate::core::validate_name_key(name, None)
                    .with_context(|| format!("[limits.{name}]"))?;
                Ok((name.clone(), config))
            })
            .collect()
    }

    /// The concurrency limits (`kind = "concurrency"`), their names checked.
    fn concurrency(&self) -> anyhow::Result<Vec<(String, tollgate::Concurrency)>> {
        self.limits
            .iter()
            .filter_map(|(name, table)| Some((name, table.concurrency?)))
            .map(|(name, limit)| {
                tollgate::core::validate_name_key(name, None)
                    .with_context(|| format!("[limits.{name}]"))?;
                Ok((name.clone(), limit))
            })
            .collect()
    }

    /// The settings a reload applies that a flag or variable overrides here: (field, the
    /// flag or variable, the file's value as written), for the log to say that a change of
    /// the file's value is not applied.
    pub fn overridden_live(&self, overrides: &Overrides) -> Vec<(&'static str, String, String)> {
        let server = &self.server;
        let mut out: Vec<(&'static str, String, String)> = Vec::new();
        for (field, _, from) in &overrides.values {
            let live = SETTINGS.iter().any(|s| s.field == *field && s.live);
            if !live || out.iter().any(|(f, _, _)| f == field) {
                continue;
            }
            let value = match *field {
                "allowInlineConfig" => format!("{:?}", server.allow_inline_config),
                "allowConfigOverride" => format!("{:?}", server.allow_config_override),
                "corsOrigins" => format!("{:?}", server.cors_origins),
                "allowedHosts" => format!("{:?}", server.allowed_hosts),
                _ => continue,
            };
            out.push((field, from.clone(), value));
        }
        out
    }

    /// The settings: this file, then the overrides, then the defaults.
    ///
    /// # Errors
    ///
    /// An address that does not parse, or an invalid limit.
    pub fn settings(&self, overrides: &Overrides, examples: bool) -> anyhow::Result<Settings> {
        let mut server = self.server.clone();
        overrides.apply(&mut server)?;
        let server = &server;
        let listen = server.listen.clone().unwrap_or_else(|| DEFAULT_LISTEN.into());
        let listen: SocketAddr = listen.parse().with_context(|| {
            format!("{}: listen address {listen:?} is not IP:PORT", server.label("listen"))
        })?;
        let store = server.store.clone().unwrap_or_else(|| DEFAULT_STORE.into());
        crate::store::check(&store).with_context(|| server.label("store"))?;
        let lease = self.leased(&store)?;
        let tokens = token_list(
            "tokens",
            server.tokens.as_deref(),
            "TOLLGATE_TOKENS",
            overrides.tokens_env.as_deref(),
        )?;
        let read_tokens = token_list(
            "readTokens",
            server.read_tokens.as_deref(),
            "TOLLGATE_READ_TOKENS",
            overrides.read_tokens_env.as_deref(),
        )?;
        if !read_tokens.is_empty() && tokens.is_empty() {
            bail!(
                "readTokens are set but tokens are not: a server without tokens asks for none, \
                 so read tokens would mean nothing; set [server] tokens (or TOLLGATE_TOKENS) too"
            );
        }
        if let Some(both) = read_tokens.iter().find(|t| tokens.contains(t)) {
            let shown = both.chars().take(4).collect::<String>();
            bail!(
                "a token (beginning {shown:?}) is both in tokens and in readTokens; a read token \
                 must be one of its own"
            );
        }
        if server.max_connections == Some(0) {
            bail!("{} is 0; it must be at least 1", server.label("maxConnections"));
        }
        let defaults = HttpLimits::default();
        if server.max_keys == Some(0) {
            bail!("{} is 0; it must be at least 1", server.label("maxKeys"));
        }
        let time = |field: &str, value: &Option<Period>, default: Duration, least: Duration| {
            duration(&server.label(field), value.as_ref(), default, least.is_zero(), least)
        };
        // Below these a client on any network, or any store, could never be answered.
        let (ms, zero) = (Duration::from_millis(1), Duration::ZERO);
        let client = Duration::from_millis(100);
        let http = HttpLimits {
            header_timeout: time(
                "headerTimeout",
                &server.header_timeout,
                defaults.header_timeout,
                client,
            )?,
            body_timeout: time("bodyTimeout", &server.body_timeout, defaults.body_timeout, client)?,
            max_connections: server.max_connections.unwrap_or(defaults.max_connections),
            shutdown_deadline: time(
                "shutdownDeadline",
                &server.shutdown_deadline,
                defaults.shutdown_deadline,
                ms,
            )?,
            drain_delay: time("drainDelay", &server.drain_delay, defaults.drain_delay, zero)?,
        };
        let store_deadline =
            time("storeDeadline", &server.store_deadline, DEFAULT_STORE_DEADLINE, ms)?;
        // A listener's address, if set: `IP:PORT`, or an error that names its setting.
        let address = |field: &str, value: &Option<String>, what: &str| {
            value
                .as_deref()
                .map(|addr| {
                    addr.parse::<SocketAddr>().with_context(|| {
                        format!("{}: {what} address {addr:?} is not IP:PORT", server.label(field))
                    })
                })
                .transpose()
        };
        let rls_listen = address("rlsListen", &server.rls_listen, "the rate limit service's")?;
        let rls_config = server.rls_config.clone();
        if rls_listen.is_some() && rls_config.is_none() {
            bail!(
                "the rate limit service needs its configuration: give --rls-config PATH (or \
                 [server] rlsConfig), envoyproxy/ratelimit's YAML file or a directory of them"
            );
        }
        let resp_listen = address("respListen", &server.resp_listen, "the Redis protocol's")?;
        let resp_throttle_name =
            server.resp_throttle_name.clone().unwrap_or_else(|| DEFAULT_THROTTLE_NAME.into());
        tollgate::core::validate_name_key(&resp_throttle_name, None)
            .with_context(|| server.label("respThrottleName"))?;
        let resp_idle_timeout = time(
            "respIdleTimeout",
            &server.resp_idle_timeout,
            DEFAULT_RESP_IDLE_TIMEOUT,
            Duration::from_secs(1),
        )?;
        let resp_max_period = max_period(&server.label("respMaxPeriod"), &server.resp_max_period)?;
        let cors_origins = server.cors_origins.clone().unwrap_or_default();
        for origin in &cors_origins {
            if origin != "*" && !is_origin(origin) {
                bail!(
                    "{}: {origin:?} is not an origin such as \"https://app.example\" or \
                     \"http://localhost:3000\" (a scheme, a host and an optional port; no \
                     path), nor \"*\"",
                    server.label("corsOrigins")
                );
            }
        }
        let allowed_hosts = server.allowed_hosts.clone().unwrap_or_default();
        for host in &allowed_hosts {
            if host.is_empty()
                || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
            {
                bail!(
                    "{}: {host:?} is not a host name such as \"tollgate.internal\" (no \
                     scheme, port or path)",
                    server.label("allowedHosts")
                );
            }
        }
        Ok(Settings {
            listen,
            store,
            tokens,
            read_tokens,
            allow_inline_config: server.allow_inline_config.unwrap_or(true),
            allow_config_override: server.allow_config_override.unwrap_or(false),
            max_keys: server.max_keys,
            store_deadline,
            http,
            rls_listen,
            rls_config,
            resp_listen,
            resp_throttle_name,
            resp_idle_timeout,
            resp_max_period,
            cors_origins,
            allowed_hosts,
            public_metrics: server.public_metrics.unwrap_or(false),
            limits: self.limits(examples)?,
            concurrency: self.concurrency()?,
            fail_open: self
                .limits
                .iter()
                .filter(|(_, table)| table.fail_open)
                .map(|(name, _)| name.clone())
                .collect(),
            lease,
        })
    }

    /// The limits with `lease`, checked: leases need a Redis or PostgreSQL store, a leased limit has no
    /// shards (yet), and its tuning is in range.
    fn leased(&self, store: &str) -> anyhow::Result<Vec<(String, tollgate::store::LeaseOptions)>> {
        let mut leased = Vec::new();
        for (name, table) in &self.limits {
            let (Some(tuning), Some(config)) = (&table.lease, &table.config) else { continue };
            if !store.starts_with("redis") && !store.starts_with("postgres") {
                bail!(
                    "[limits.{name}] lease = true needs a Redis or PostgreSQL store (redis://, \
                     rediss://, redis+cluster://, redis+sentinel://, postgres://); the store \
                     is {store:?}"
                );
            }
            if config.shards.is_some_and(|n| n > 1.0) {
                bail!("[limits.{name}] a leased limit cannot have shards yet");
            }
            if config.calendar.is_some() {
                bail!("[limits.{name}] a leased limit cannot be a calendar window yet");
            }
            let label = format!("[limits.{name}] lease.term");
            let term = duration(
                &label,
                tuning.term.as_ref(),
                Duration::from_secs(2),
                false,
                Duration::ZERO,
            )?;
            let mut options = tollgate::store::LeaseOptions::new().term(term);
            if let Some(share) = tuning.share {
                if !(share > 0.0 && share <= 1.0) {
                    bail!(
                        "[limits.{name}] lease.share is {share}; it must be more than 0 and at most 1"
                    );
                }
                options = options.share(share);
            }
            if let Some(floor) = tuning.floor {
                if !(0.0..=1.0).contains(&floor) {
                    bail!("[limits.{name}] lease.floor is {floor}; it must be from 0 to 1");
                }
                options = options.floor(floor);
            }
            if let Some(takes) = tuning.hot_after {
                let Some(takes) = u32::try_from(takes).ok().filter(|&t| t >= 1) else {
                    bail!(
                        "[limits.{name}] lease.hotAfter is {takes}; it must be a whole number of \
                         takes within a term, 1 (every key leased from its first take) or more"
                    );
                };
                options = options.hot_after(takes);
            }
            leased.push((name.clone(), options));
        }
        Ok(leased)
    }

    /// The named limits only (for the simulator).
    ///
    /// # Errors
    ///
    /// An invalid limit.
    pub fn named_limits(&self) -> anyhow::Result<Vec<(String, Config)>> {
        self.limits(false)
    }

    /// The concurrency limits of the file (`kind = "concurrency"`), for the simulator.
    ///
    /// # Errors
    ///
    /// An invalid name.
    pub fn named_concurrency(&self) -> anyhow::Result<Vec<(String, tollgate::Concurrency)>> {
        self.concurrency()
    }
}

/// Whether `text` is a web origin: `http` or `https`, `://`, a host, an optional port.
fn is_origin(text: &str) -> bool {
    let Some(rest) = text.strip_prefix("https://").or_else(|| text.strip_prefix("http://")) else {
        return false;
    };
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, _)) if !host.ends_with(']') && host.contains(':') => (rest, ""),
        Some((host, port)) => (host, port),
        None => (rest, ""),
    };
    !host.is_empty()
        && !host.contains(['/', '?', '#', '@', ' '])
        && port.bytes().all(|b| b.is_ascii_digit())
}

/// The limits a server without a config file starts with, so that it can be tried at once.
pub fn example_limits() -> Vec<(String, Config)> {
    vec![
        ("example".into(), Config::token_bucket(10.0, MINUTE).with_capacity(3.0)),
        ("signup".into(), Config::fixed_window(100.0, HOUR)),
        ("llmTokens".into(), Config::token_bucket(40_000.0, MINUTE).with_shards(10)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings below what could ever serve a request are refused with the least they take
    /// (a store deadline of 100 ns made every request a 503 while `/healthz` said ok).
    #[test]
    fn settings_below_any_use_are_refused() {
        let settings = |vars: &[(&str, &str)]| {
            let vars = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
            FileConfig::default().settings(&Overrides::from_env(vars), true)
        };
        for (var, value, says) in [
            ("TOLLGATE_STORE_DEADLINE", "0.0000001", "at least 1 ms"),
            ("TOLLGATE_HEADER_TIMEOUT", "0.5", "at least 100 ms"),
            ("TOLLGATE_BODY_TIMEOUT", "50ms", "at least 100 ms"),
            ("TOLLGATE_MAX_KEYS", "0", "at least 1"),
        ] {
            let e = format!("{:#}", settings(&[(var, value)]).unwrap_err());
            assert!(e.contains(var) && e.contains(says), "{var}={value}: {e}");
        }
        let ok = settings(&[("TOLLGATE_STORE_DEADLINE", "1"), ("TOLLGATE_HEADER_TIMEOUT", "100")]);
        assert_eq!(ok.unwrap().store_deadline, Duration::from_millis(1));
        assert_eq!(
            settings(&[("TOLLGATE_DRAIN_DELAY", "0")]).unwrap().http.drain_delay,
            Duration::ZERO
        );
    }

    /// A TOML error shows where and why, never a token or a URL's password from the file.
    #[test]
    fn toml_errors_keep_secrets_out() {
        for (text, secret, still) in [
            ("[server]\ntokens = [\"s3cr3tTOKEN\" \"x\"]\n", "s3cr3tTOKEN", "line 2, column 25"),
            (
                "[server]\nreadTokens = \"notalist-s3cr3t\"\n",
                "notalist-s3cr3t",
                "expected a sequence",
            ),
            ("[server]\ntokens = [\n  \"first\",\n  \"s3cr3t\" x\n]\n", "s3cr3t", "line 4"),
            (
                "[server]\nstore = \"redis://:pw0rdXYZ@127.0.0.1:6379/0\" x\n",
                "pw0rdXYZ",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("[server]\nstore = 5 # postgres://u:pw0rdXYZ@h/db\n", "pw0rdXYZ", "expected a string"),
        ] {
            let shown = format!("{:#}", FileConfig::parse(text).unwrap_err());
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.contains(still), "{shown}");
        }
        // Nothing secret: shown as toml shows it.
        let shown = format!("{:#}", FileConfig::parse("[server]\nlisten = 5\n").unwrap_err());
        assert!(shown.contains("3 | listen = 5") || shown.contains("2 | listen = 5"), "{shown}");
        assert!(shown.contains("invalid type: integer `5`, expected a string"), "{shown}");
    }

    #[test]
    fn defaults_without_a_file() {
        let s = FileConfig::default().settings(&Overrides::default(), true).unwrap();
        assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(s.store, DEFAULT_STORE);
        assert!(s.tokens.is_empty());
        assert!(s.allow_inline_config);
        assert_eq!(s.limits.len(), 3);
    }

    #[test]
    fn file_then_flags_then_env() {
        let file = FileConfig::parse(
            r#"
            [server]
            listen = "127.0.0.1:9000"
            store = "memory"
            tokens = ["a"]
            allowInlineConfig = false

            [limits.send]
            kind = "token bucket"
            rate = 10
            period = "1m"
            capacity = 3
            "#,
        )
        .unwrap();
        let s = file.settings(&Overrides::default(), true).unwrap();
        assert_eq!(
            (s.listen.port(), s.store.as_str(), s.allow_inline_config),
            (9000, "memory", false)
        );
        assert_eq!(
            s.limits,
            vec![("send".into(), Config::token_bucket(10.0, MINUTE).with_capacity(3.0))]
        );
        let o = Overrides { tokens_env: Some("b, c".into()), ..Overrides::default() }
            .flag("listen", "--listen", Some("127.0.0.1:9001".into()))
            .flag("store", "--store", Some("sqlite://x.db".into()));
        let s = file.settings(&o, true).unwrap();
        assert_eq!((s.listen.port(), s.store.as_str()), (9001, "sqlite://x.db"));
        assert_eq!(s.tokens, ["a", "b", "c"]);
    }

    #[test]
    fn bad_files_say_where() {
        let err =
            FileConfig::parse("[limits.x]\nkind = \"token bucket\"\nrate = -1\nperiod = 1000\n")
                .unwrap()
                .settings(&Overrides::default(), true)
                .unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            "[limits.x]: invalid config: rate is -1; it must be finite, at least 1e-9 and at most 1e15"
        );
        assert!(
            FileConfig::parse("[server]\nport = 1\n")
                .unwrap_err()
                .to_string()
                .contains("unknown field `port`")
        );
        let err = FileConfig::default()
            .settings(
                &Overrides::default().flag("listen", "--listen", Some("localhost".into())),
                true,
            )
            .unwrap_err();
        assert_eq!(err.to_string(), "--listen: listen address \"localhost\" is not IP:PORT");
    }

    #[test]
    fn tokens_from_the_environment() {
        let with = |env: &str| {
            let o = Overrides { tokens_env: Some(env.into()), ..Overrides::default() };
            FileConfig::default().settings(&o, true).map(|s| s.tokens)
        };
        assert_eq!(with(" a , b ").unwrap(), ["a", "b"]);
        for (env, message) in [
            ("", "TOLLGATE_TOKENS is set but holds no token"),
            ("  ", "TOLLGATE_TOKENS is set but holds no token"),
            ("a,,b", "TOLLGATE_TOKENS: item 2 is empty"),
            ("a,", "TOLLGATE_TOKENS: item 2 is empty"),
            ("\u{e9}t\u{e9}", "tokens must be visible ASCII"),
        ] {
            let err = with(env).unwrap_err().to_string();
            assert!(err.starts_with(message), "{env:?}: {err}");
        }
    }

    #[test]
    fn read_tokens_from_the_file_and_the_environment() {
        let with = |text: &str, env: Option<&str>| {
            let o = Overrides { read_tokens_env: env.map(Into::into), ..Overrides::default() };
            FileConfig::parse(text).and_then(|f| f.settings(&o, true))
        };
        let s = with("[server]\ntokens = [\"w\"]\nreadTokens = [\"r\"]\n", Some("s, t")).unwrap();
        assert_eq!(s.tokens, ["w"]);
        assert_eq!(s.read_tokens, ["r", "s", "t"]);
        for (text, env, message) in [
            ("[server]\nreadTokens = [\"r\"]\n", None, "readTokens are set but tokens are not"),
            ("", Some("r"), "readTokens are set but tokens are not"),
            ("[server]\ntokens = [\"w\"]\n", Some(""), "TOLLGATE_READ_TOKENS is set but holds"),
            ("[server]\ntokens = [\"w\"]\n", Some("r,"), "TOLLGATE_READ_TOKENS: item 2 is empty"),
            (
                "[server]\ntokens = [\"w\"]\nreadTokens = [\"a b\"]\n",
                None,
                "readTokens must be visible ASCII",
            ),
            (
                "[server]\ntokens = [\"same\"]\nreadTokens = [\"same\"]\n",
                None,
                "a token (beginning \"same\") is both in tokens and in readTokens",
            ),
        ] {
            let err = with(text, env).unwrap_err().to_string();
            assert!(err.starts_with(message), "{text:?} {env:?}: {err}");
        }
    }

    #[test]
    fn web_origins_and_host_names() {
        let s = FileConfig::parse(
            "[server]\ncorsOrigins = [\"https://app.example\", \"http://localhost:3000\", \
             \"http://[::1]:5173\", \"*\"]\nallowedHosts = [\"tollgate.internal\"]\n",
        )
        .unwrap()
        .settings(&Overrides::default(), true)
        .unwrap();
        assert_eq!(s.cors_origins.len(), 4);
        assert_eq!(s.allowed_hosts, ["tollgate.internal"]);
        for bad in [
            "app.example",
            "ftp://app.example",
            "https://",
            "https://a.example/x",
            "https://a.example:x",
        ] {
            assert!(!is_origin(bad), "{bad}");
        }
    }

    #[test]
    fn timeouts_and_limits_of_the_server_section() {
        let settings = |text: &str| {
            FileConfig::parse(text).and_then(|f| f.settings(&Overrides::default(), true))
        };
        let s = settings("").unwrap();
        assert_eq!(s.store_deadline, DEFAULT_STORE_DEADLINE);
        assert_eq!(s.http, HttpLimits::default());
        let s = settings(
            "[server]\nstoreDeadline = 100\nheaderTimeout = \"2s\"\nbodyTimeout = \"1m\"\n\
             maxConnections = 5\nshutdownDeadline = 1500\n",
        )
        .unwrap();
        assert_eq!(s.store_deadline, Duration::from_millis(100));
        assert_eq!(
            s.http,
            HttpLimits {
                header_timeout: Duration::from_secs(2),
                body_timeout: Duration::from_secs(60),
                max_connections: 5,
                shutdown_deadline: Duration::from_millis(1500),
                drain_delay: Duration::ZERO,
            }
        );
        for (text, message) in [
            (
                "[server]\nstoreDeadline = \"soon\"\n",
                "[server] storeDeadline: \"soon\" is not a duration such as 250 (ms) or \"10s\"",
            ),
            (
                "[server]\nheaderTimeout = 0\n",
                "[server] headerTimeout is 0 ms; it must be more than 0 and at most a day",
            ),
            (
                "[server]\nshutdownDeadline = \"2d\"\n",
                "[server] shutdownDeadline is 172800000 ms; it must be more than 0 and at most a day",
            ),
            (
                "[server]\nmaxConnections = 0\n",
                "[server] maxConnections is 0; it must be at least 1",
            ),
            (
                "[server]\ntokens = [\"\"]\n",
                "tokens: an empty token can never be sent, so it would lock every client out",
            ),
            (
                "[server]\ntokens = [\"caf\u{e9}\"]\n",
                "tokens must be visible ASCII (no spaces, control characters or other \
                 characters): a client could not send another one in an Authorization header",
            ),
            (
                "[server]\ntokens = [\"two words\"]\n",
                "tokens must be visible ASCII (no spaces, control characters or other \
                 characters): a client could not send another one in an Authorization header",
            ),
            (
                "[server]\ncorsOrigins = [\"https://app.example/\"]\n",
                "[server] corsOrigins: \"https://app.example/\" is not an origin such as \
                 \"https://app.example\" or \"http://localhost:3000\" (a scheme, a host and an \
                 optional port; no path), nor \"*\"",
            ),
            (
                "[server]\nallowedHosts = [\"tollgate:8787\"]\n",
                "[server] allowedHosts: \"tollgate:8787\" is not a host name such as \
                 \"tollgate.internal\" (no scheme, port or path)",
            ),
        ] {
            assert_eq!(settings(text).unwrap_err().to_string(), message, "{text}");
        }
    }

    #[test]
    fn every_setting_from_the_environment_flags_first() {
        let env = |vars: &[(&str, &str)]| {
            Overrides::from_env(vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())))
        };
        let file = FileConfig::parse(
            "[server]\nlisten = \"127.0.0.1:9000\"\nstore = \"memory\"\nmaxKeys = 5\n\
             storeDeadline = 100\npublicMetrics = false\ntokens = [\"w\"]\n",
        )
        .unwrap();
        let vars = [
            ("TOLLGATE_LISTEN", "127.0.0.1:9001"),
            ("TOLLGATE_STORE", "sqlite://env.db"),
            ("TOLLGATE_TOKENS", "x"),
            ("TOLLGATE_READ_TOKENS", "r"),
            ("TOLLGATE_ALLOW_INLINE_CONFIG", "false"),
            ("TOLLGATE_ALLOW_CONFIG_OVERRIDE", "1"),
            ("TOLLGATE_MAX_KEYS", "7"),
            ("TOLLGATE_STORE_DEADLINE", "2s"),
            ("TOLLGATE_HEADER_TIMEOUT", "3000"),
            ("TOLLGATE_BODY_TIMEOUT", "4s"),
            ("TOLLGATE_MAX_CONNECTIONS", "9"),
            ("TOLLGATE_SHUTDOWN_DEADLINE", "5s"),
            ("TOLLGATE_DRAIN_DELAY", "0"),
            ("TOLLGATE_RLS_LISTEN", "127.0.0.1:9002"),
            ("TOLLGATE_RLS_CONFIG", "rls.yaml"),
            ("TOLLGATE_RESP_LISTEN", "127.0.0.1:9004"),
            ("TOLLGATE_RESP_THROTTLE_NAME", "throttled"),
            ("TOLLGATE_RESP_IDLE_TIMEOUT", "1m"),
            ("TOLLGATE_RESP_MAX_PERIOD", "7d"),
            ("TOLLGATE_CORS_ORIGINS", "https://a.example, http://localhost:3000"),
            ("TOLLGATE_ALLOWED_HOSTS", "tollgate.internal"),
            ("TOLLGATE_PUBLIC_METRICS", "true"),
            ("OTHER", "ignored"),
        ];
        assert_eq!(vars.len(), SETTINGS.len() + 1, "a variable of every setting");
        let s = file.settings(&env(&vars), false).unwrap();
        assert_eq!(s.listen.to_string(), "127.0.0.1:9001");
        assert_eq!(s.store, "sqlite://env.db");
        assert_eq!((s.tokens, s.read_tokens), (vec!["w".into(), "x".into()], vec!["r".into()]));
        assert_eq!((s.allow_inline_config, s.allow_config_override), (false, true));
        assert_eq!(s.max_keys, Some(7));
        assert_eq!(s.store_deadline, Duration::from_secs(2));
        assert_eq!(
            s.http,
            HttpLimits {
                header_timeout: Duration::from_secs(3),
                body_timeout: Duration::from_secs(4),
                max_connections: 9,
                shutdown_deadline: Duration::from_secs(5),
                drain_delay: Duration::ZERO,
            }
        );
        assert_eq!(s.rls_listen, Some("127.0.0.1:9002".parse().unwrap()));
        assert_eq!(s.rls_config, Some("rls.yaml".into()));
        assert_eq!(s.resp_listen, Some("127.0.0.1:9004".parse().unwrap()));
        assert_eq!(s.resp_throttle_name, "throttled");
        assert_eq!(s.resp_idle_timeout, Duration::from_secs(60));
        assert_eq!(s.resp_max_period, 7 * 86_400);
        assert_eq!(s.cors_origins, ["https://a.example", "http://localhost:3000"]);
        assert_eq!(s.allowed_hosts, ["tollgate.internal"]);
        assert!(s.public_metrics);
        // A flag over its variable, the variable over the file.
        let o = env(&vars[..2]).flag("listen", "--listen", Some("127.0.0.1:9003".into()));
        let s = file.settings(&o, false).unwrap();
        assert_eq!(
            (s.listen.port(), s.store.as_str(), s.max_keys),
            (9003, "sqlite://env.db", Some(5))
        );
        // A bad value names its variable (or flag).
        for (var, value, message) in [
            (
                "TOLLGATE_MAX_KEYS",
                "many",
                "TOLLGATE_MAX_KEYS is \"many\"; it must be a whole number",
            ),
            (
                "TOLLGATE_PUBLIC_METRICS",
                "yes",
                "TOLLGATE_PUBLIC_METRICS is \"yes\"; it must be true or false",
            ),
            (
                "TOLLGATE_HEADER_TIMEOUT",
                "soon",
                "TOLLGATE_HEADER_TIMEOUT: \"soon\" is not a duration such as 250 (ms) or \"10s\"",
            ),
            (
                "TOLLGATE_BODY_TIMEOUT",
                "0",
                "TOLLGATE_BODY_TIMEOUT is 0 ms; it must be more than 0 and at most a day",
            ),
            (
                "TOLLGATE_DRAIN_DELAY",
                "-1",
                "TOLLGATE_DRAIN_DELAY is -1 ms; it must be at least 0 and at most a day",
            ),
            (
                "TOLLGATE_MAX_CONNECTIONS",
                "0",
                "TOLLGATE_MAX_CONNECTIONS is 0; it must be at least 1",
            ),
            (
                "TOLLGATE_LISTEN",
                "localhost",
                "TOLLGATE_LISTEN: listen address \"localhost\" is not IP:PORT",
            ),
            (
                "TOLLGATE_CORS_ORIGINS",
                "a.example",
                "TOLLGATE_CORS_ORIGINS: \"a.example\" is not an origin",
            ),
            ("TOLLGATE_ALLOWED_HOSTS", "a,,b", "TOLLGATE_ALLOWED_HOSTS: item 2 is empty"),
            (
                "TOLLGATE_RESP_MAX_PERIOD",
                "500",
                "TOLLGATE_RESP_MAX_PERIOD is 500 ms; it must be at least 1 s and at most 1e12 s",
            ),
            (
                "TOLLGATE_RESP_MAX_PERIOD",
                "a while",
                "TOLLGATE_RESP_MAX_PERIOD: \"a while\" is not a duration such as \"1d\"",
            ),
        ] {
            let err = file.settings(&env(&[(var, value)]), false).unwrap_err().to_string();
            assert!(err.starts_with(message), "{var}={value}: {err}");
        }
    }
}
