//! One connection's state (its protocol, who it authenticated as, its name) and the commands
//! it runs: the connection commands Redis clients send on their own, answered as Redis
//! answers them, then `CL.THROTTLE` and `TG.*`.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::answer::{Answer, Body};
use crate::auth::known_token;
use crate::metrics::Protocol as Via;

use super::Resp;
use super::tg::{self, Tg};
use super::throttle;
use super::wire::{Out, Protocol};

/// What a connection does after a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Reads the next one.
    Go,
    /// Sends its replies and closes (`QUIT`).
    Close,
}

/// Who a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// Nothing yet: only `AUTH`, `HELLO`, `QUIT` and `RESET` (tokens are set).
    None,
    /// A read token: checks, values, the time and the config.
    Read,
    /// Anything.
    Full,
}

/// One connection's state.
pub struct Session {
    protocol: Protocol,
    access: Access,
    name: Option<String>,
    id: u64,
}

/// The version `HELLO` and `INFO` give as Redis's: clients read it to know which commands
/// the server has (RESP3 and `CLIENT SETINFO` came with Redis 6 and 7.2), and tollgate
/// answers those.
const REDIS_VERSION: &str = "7.2.0";

/// The commands `COMMAND` lists: (name, arity as Redis writes it, flags).
const COMMANDS: [(&str, i64, &[&str]); 20] = [
    ("cl.throttle", -5, &["write", "fast"]),
    ("tg.limit", -2, &["write", "fast"]),
    ("tg.check", -2, &["readonly", "fast"]),
    ("tg.transaction", -1, &["write", "fast"]),
    ("tg.reset", -2, &["write", "fast"]),
    ("tg.value", -2, &["readonly", "fast"]),
    ("tg.adjust", -4, &["write", "fast"]),
    ("tg.time", 1, &["readonly", "fast"]),
    ("tg.config", 1, &["readonly"]),
    ("auth", -2, &["noscript", "loading", "stale", "fast", "no_auth"]),
    ("hello", -1, &["noscript", "loading", "stale", "fast", "no_auth"]),
    ("ping", -1, &["fast"]),
    ("echo", 2, &["fast"]),
    ("quit", -1, &["fast", "no_auth"]),
    ("reset", 1, &["noscript", "loading", "stale", "fast", "no_auth"]),
    ("select", 2, &["loading", "stale", "fast"]),
    ("client", -2, &[]),
    ("command", -1, &["loading", "stale"]),
    ("info", -1, &["loading", "stale"]),
    ("time", 1, &["loading", "stale", "fast"]),
];

impl Session {
    /// Whether it may take (it authenticated with a full token, or needs none).
    pub fn may_take(&self) -> bool {
        self.access == Access::Full
    }

    /// The protocol its replies are written in.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// A new connection's: RESP2, authenticated only if the server has no tokens.
    pub fn new(resp: &Resp) -> Self {
        Session {
            protocol: Protocol::Resp2,
            access: if resp.tokens.required() { Access::None } else { Access::Full },
            name: None,
            id: resp.next_id.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }

    /// Runs one command (`argv[0]` its name), its reply written to `out`.
    pub async fn run(&mut self, resp: &Resp, argv: &[&[u8]], out: &mut Out) -> Next {
        out.protocol = self.protocol;
        let mut lower = [0u8; 16];
        let name = argv[0];
        let command = if name.len() <= lower.len() {
            for (l, b) in lower.iter_mut().zip(name) {
                *l = b.to_ascii_lowercase();
            }
            std::str::from_utf8(&lower[..name.len()]).unwrap_or("")
        } else {
            ""
        };
        let args = &argv[1..];
        // As Redis: a command it does not have is said so before any question of auth.
        if !COMMANDS.iter().any(|(known, _, _)| *known == command) {
            unknown(out, argv);
            return Next::Go;
        }
        if self.access == Access::None && !matches!(command, "auth" | "hello" | "quit" | "reset") {
            out.coded("NOAUTH", "Authentication required.");
            return Next::Go;
        }
        match command {
            "cl.throttle" => {
                traced("RESP CL.THROTTLE", "throttle", self.throttle(resp, args, out)).await;
            }
            "ping" => match args {
                [] => out.simple("PONG"),
                [message] => out.bulk(message),
                _ => arity(out, "ping"),
            },
            "echo" => match args {
                [message] => out.bulk(message),
                _ => arity(out, "echo"),
            },
            "quit" => {
                out.simple("OK");
                return Next::Close;
            }
            "reset" => {
                self.protocol = Protocol::Resp2;
                self.name = None;
                if resp.tokens.required() {
                    self.access = Access::None;
                }
                out.protocol = self.protocol;
                out.simple("RESET");
            }
            "auth" => match args {
                [token] | [_, token] => {
                    if self.authenticate(resp, token, out) {
                        out.simple("OK");
                    }
                }
                [] => arity(out, "auth"),
                _ => out.error("syntax error"),
            },
            "hello" => self.hello(resp, args, out),
            "select" => match args {
                [b"0"] => out.simple("OK"),
                [db] if std::str::from_utf8(db).is_ok_and(|d| d.parse::<i64>().is_ok()) => {
                    out.error("DB index is out of range");
                }
                [_] => out.error("value is not an integer or out of range"),
                _ => arity(out, "select"),
            },
            "client" => self.client(args, out),
            "command" => command_info(args, out),
            "info" => info(self, out),
            "time" => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                out.array(2);
                out.bulk(now.as_secs().to_string().as_bytes());
                out.bulk(now.subsec_micros().to_string().as_bytes());
            }
            _ => match tg::parse(command, args) {
                Some(parsed) => {
                    let op = parsed.as_ref().map_or("invalid", Tg::name);
                    traced(span_name(command), op, self.tg(resp, parsed, out)).await;
                }
                None => unknown(out, argv),
            },
        }
        Next::Go
    }

    /// Checks a token: `true` when it is one of the server's (the reply is the caller's),
    /// else the error is written.
    fn authenticate(&mut self, resp: &Resp, token: &[u8], out: &mut Out) -> bool {
        if !resp.tokens.required() {
            out.error(
                "AUTH <password> called without any password configured for the default user. \
                 Are you sure your configuration is correct?",
            );
            return false;
        }
        let token = std::str::from_utf8(token).unwrap_or("");
        if known_token(&resp.tokens.full, token) {
            self.access = Access::Full;
        } else if known_token(&resp.tokens.read, token) {
            self.access = Access::Read;
        } else {
            out.coded("WRONGPASS", "invalid username-password pair or user is disabled.");
            return false;
        }
        true
    }

    /// `HELLO [protover [AUTH user token] [SETNAME name]]`.
    fn hello(&mut self, resp: &Resp, args: &[&[u8]], out: &mut Out) {
        let mut protocol = self.protocol;
        if let Some((version, mut options)) = args.split_first() {
            protocol = match *version {
                b"2" => Protocol::Resp2,
                b"3" => Protocol::Resp3,
                v if std::str::from_utf8(v).is_ok_and(|v| v.parse::<i64>().is_ok()) => {
                    return out.coded("NOPROTO", "unsupported protocol version");
                }
                _ => return out.error("Protocol version is not an integer or out of range"),
            };
            let mut name = None;
            while let Some((option, rest)) = options.split_first() {
                match (option.to_ascii_uppercase().as_slice(), rest) {
                    (b"AUTH", [_user, token, more @ ..]) => {
                        if !self.authenticate(resp, token, out) {
                            return;
                        }
                        options = more;
                    }
                    (b"SETNAME", [client, more @ ..]) => {
                        let Some(client) = client_name(client, out) else { return };
                        name = Some(client);
                        options = more;
                    }
                    _ => {
                        return out.error(&format!(
                            "Syntax error in HELLO option '{}'",
                            String::from_utf8_lossy(option)
                        ));
                    }
                }
            }
            if let Some(name) = name {
                self.name = name;
            }
        }
        if self.access == Access::None {
            return out.coded(
                "NOAUTH",
                "HELLO must be called with the client already authenticated, otherwise \
                 the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
                 client and select the RESP protocol version at the same time",
            );
        }
        self.protocol = protocol;
        out.protocol = protocol;
        out.map(7);
        out.bulk(b"server");
        out.bulk(b"redis");
        out.bulk(b"version");
        out.bulk(REDIS_VERSION.as_bytes());
        out.bulk(b"proto");
        out.integer(if protocol == Protocol::Resp3 { 3 } else { 2 });
        out.bulk(b"id");
        out.integer(self.id as i64);
        out.bulk(b"mode");
        out.bulk(b"standalone");
        out.bulk(b"role");
        out.bulk(b"master");
        out.bulk(b"modules");
        out.array(0);
    }

    /// `CLIENT SETNAME|GETNAME|ID|SETINFO|INFO`.
    fn client(&mut self, args: &[&[u8]], out: &mut Out) {
        let Some((sub, rest)) = args.split_first() else { return arity(out, "client") };
        match (sub.to_ascii_uppercase().as_slice(), rest) {
            (b"SETNAME", [name]) => {
                if let Some(name) = client_name(name, out) {
                    self.name = name;
                    out.simple("OK");
                }
            }
            (b"GETNAME", []) => match &self.name {
                Some(name) => out.bulk(name.as_bytes()),
                None => out.null(),
            },
            (b"ID", []) => out.integer(self.id as i64),
            (b"SETINFO", [attribute, _]) => {
                if attribute.eq_ignore_ascii_case(b"LIB-NAME")
                    || attribute.eq_ignore_ascii_case(b"LIB-VER")
                {
                    out.simple("OK");
                } else {
                    out.error(&format!(
                        "Unrecognized option '{}'",
                        String::from_utf8_lossy(attribute)
                    ));
                }
            }
            (b"INFO", []) => {
                let name = self.name.as_deref().unwrap_or("");
                let resp = if self.protocol == Protocol::Resp3 { 3 } else { 2 };
                out.verbatim(&format!("id={} name={name} db=0 resp={resp}\n", self.id));
            }
            (b"SETNAME" | b"GETNAME" | b"ID" | b"SETINFO" | b"INFO", _) => {
                let sub = String::from_utf8_lossy(sub).to_ascii_lowercase();
                out.error(&format!("wrong number of arguments for 'client|{sub}' command"));
            }
            _ => out.error(&format!(
                "unknown subcommand '{}'. Try CLIENT HELP.",
                String::from_utf8_lossy(sub)
            )),
        }
    }

    /// Runs `CL.THROTTLE`; how it went, for metrics and spans.
    async fn throttle(&mut self, resp: &Resp, args: &[&[u8]], out: &mut Out) -> &'static str {
        let start = Instant::now();
        if self.access == Access::Read {
            self.read_only(resp, "CL.THROTTLE", "throttle", start, out);
            return "invalid";
        }
        run_throttle(resp, args, out, start).await
    }

    /// Runs a `TG.*` command; how it went, for metrics and spans.
    async fn tg(&mut self, resp: &Resp, parsed: Result<Tg, String>, out: &mut Out) -> &'static str {
        let start = Instant::now();
        let tg = match parsed {
            Ok(tg) => tg,
            Err(message) => {
                out.error(&message);
                return "invalid";
            }
        };
        if self.access == Access::Read && !tg.reads_only() {
            let command = format!("TG.{}", tg.name().to_ascii_uppercase());
            self.read_only(resp, &command, tg.name(), start, out);
            return "invalid";
        }
        let answer = match &tg {
            Tg::Run(op, body) => resp.engine.run(*op, body).await,
            Tg::Time => resp.engine.time().await,
            Tg::Config => resp.engine.config(),
        };
        if answer.status.is_success() {
            match &answer.body {
                Body::Decision { ok, retry_after } => {
                    out.map(1 + usize::from(retry_after.is_some()));
                    out.bulk(b"ok");
                    out.boolean(*ok);
                    if let Some(wait) = retry_after {
                        out.bulk(b"retryAfter");
                        out.number(*wait);
                    }
                }
                Body::Json(value) => out.json(value),
            }
        } else {
            error_reply(resp, tg.name(), &answer, out);
        }
        resp.metrics.record(Via::Resp, tg.name(), answer.outcome, start.elapsed());
        answer.outcome
    }

    fn read_only(
        &self,
        resp: &Resp,
        command: &str,
        op: &'static str,
        start: Instant,
        out: &mut Out,
    ) {
        resp.metrics.record(Via::Resp, op, "invalid", start.elapsed());
        out.coded(
            "NOPERM",
            &format!(
                "a read token may run TG.CHECK, TG.VALUE, TG.TIME and TG.CONFIG only; \
             {command} needs a token of [server] tokens"
            ),
        );
    }
}

/// `CL.THROTTLE`'s work once the connection may run it: its reply written to `out`; how it
/// went, for metrics and spans.
async fn run_throttle(resp: &Resp, args: &[&[u8]], out: &mut Out, start: Instant) -> &'static str {
    let parsed = match throttle::args(args) {
        Ok(parsed) => parsed,
        Err(message) => {
            resp.metrics.record(Via::Resp, "throttle", "invalid", start.elapsed());
            out.error(&message);
            return "invalid";
        }
    };
    let defined = resp.engine.current();
    let name = resp.throttle_name.as_str();
    let outcome = match throttle::throttle(&defined, name, parsed).await {
        Ok(t) => {
            out.array(5);
            for n in [t.limited, t.limit, t.remaining, t.retry_after, t.reset_after] {
                out.integer(n);
            }
            let now = crate::engine::now_ms();
            let taken = if t.limited == 0 {
                crate::stats::Taken::of(true, None)
            } else {
                crate::stats::Taken::of(false, Some(t.retry_after as f64))
            };
            resp.engine.stats.record(name, taken, now);
            if t.limited == 0 { "ok" } else { "refused" }
        }
        Err(e) => {
            let answer = match e {
                tollgate::Error::Store(e) => crate::engine::store_failed(&e),
                other => Answer::error(
                    axum::http::StatusCode::BAD_REQUEST,
                    format!("CL.THROTTLE: {other}"),
                ),
            };
            error_reply(resp, "throttle", &answer, out);
            answer.outcome
        }
    };
    resp.metrics.record(Via::Resp, "throttle", outcome, start.elapsed());
    outcome
}

/// `CL.THROTTLE argv` (its name left out) for a connection that may take, replying in
/// `protocol`: what [`super`] runs at once for pipelined commands on a networked store.
pub async fn throttle_now(resp: &Resp, protocol: Protocol, argv: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Out { buf: Vec::with_capacity(48), protocol };
    let args: Vec<&[u8]> = argv.iter().map(Vec::as_slice).collect();
    let work = run_throttle(resp, &args, &mut out, Instant::now());
    traced("RESP CL.THROTTLE", "throttle", work).await;
    out.buf
}

/// No header fields: a Redis command carries no trace context.
static NO_HEADERS: std::sync::LazyLock<axum::http::HeaderMap> =
    std::sync::LazyLock::new(axum::http::HeaderMap::new);

/// A command's span, named as HTTP's are by their route.
fn span_name(command: &str) -> &'static str {
    match command {
        "tg.limit" => "RESP TG.LIMIT",
        "tg.check" => "RESP TG.CHECK",
        "tg.transaction" => "RESP TG.TRANSACTION",
        "tg.reset" => "RESP TG.RESET",
        "tg.value" => "RESP TG.VALUE",
        "tg.adjust" => "RESP TG.ADJUST",
        "tg.time" => "RESP TG.TIME",
        _ => "RESP TG.CONFIG",
    }
}

/// `work` under `span`, with `tollgate.protocol` and its outcome.
/// `work`, under a span named `name` for the operation `op` when tracing is on; as it is
/// otherwise.
async fn traced(
    name: &'static str,
    op: &'static str,
    work: impl Future<Output = &'static str> + Send,
) {
    if !crate::otel::on() {
        work.await;
        return;
    }
    let mut span = crate::otel::span(name, op, &NO_HEADERS);
    if span.recording() {
        span.set("tollgate.protocol", "resp");
    }
    crate::otel::traced(span, work, |span, outcome: &&'static str| {
        span.set("tollgate.outcome", *outcome);
        if *outcome == "store_error" {
            span.failed();
        }
    })
    .await;
}

/// An answer that is not a success as an error reply: `-RATELIMITED name retryAfter` for a
/// refusal with `THROWS` (HTTP's 429), `-UNAVAILABLE message` when the store failed (503,
/// with whether it may have taken), `-ERR message` otherwise.
fn error_reply(resp: &Resp, op: &str, answer: &Answer, out: &mut Out) {
    let body = answer.body.clone().into_value();
    let message = body.get("error").and_then(|e| e.as_str()).unwrap_or("");
    match answer.status.as_u16() {
        429 => {
            let name = body.get("name").and_then(|n| n.as_str()).unwrap_or("");
            let wait = body.get("retryAfter").map(ToString::to_string).unwrap_or_default();
            out.coded("RATELIMITED", &format!("{name} {wait}"));
        }
        503 => {
            let may = body.get("mayHaveTaken").and_then(serde_json::Value::as_bool);
            out.coded("UNAVAILABLE", &format!("{message} (mayHaveTaken: {})", may.unwrap_or(true)));
            resp.errors.record(op, answer.status, &answer.body.to_json());
        }
        _ => out.error(message),
    }
}

/// A client name, or `None` with the error written.
fn client_name(name: &[u8], out: &mut Out) -> Option<Option<String>> {
    if name.is_empty() {
        return Some(None);
    }
    if name.len() > 256 || !name.iter().all(|b| (b'!'..=b'~').contains(b)) {
        out.error("Client names cannot contain spaces, newlines or special characters.");
        return None;
    }
    Some(Some(String::from_utf8_lossy(name).into_owned()))
}

fn arity(out: &mut Out, command: &str) {
    out.error(&format!("wrong number of arguments for '{command}' command"));
}

/// Redis's words for a command it does not have.
fn unknown(out: &mut Out, argv: &[&[u8]]) {
    let mut message =
        format!("unknown command '{}', with args beginning with: ", shown(argv[0], 128));
    for arg in argv[1..].iter().take(16) {
        message.push_str(&format!("'{}' ", shown(arg, 128)));
    }
    out.error(&message);
}

fn shown(arg: &[u8], most: usize) -> String {
    let text = String::from_utf8_lossy(&arg[..arg.len().min(most)]);
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// `COMMAND`, `COMMAND COUNT`, `COMMAND DOCS [name...]`, `COMMAND INFO [name...]`,
/// `COMMAND LIST`.
fn command_info(args: &[&[u8]], out: &mut Out) {
    let find =
        |name: &[u8]| COMMANDS.iter().find(|(n, _, _)| name.eq_ignore_ascii_case(n.as_bytes()));
    let info = |out: &mut Out, (name, arity, flags): &(&str, i64, &[&str])| {
        out.array(10);
        out.bulk(name.as_bytes());
        out.integer(*arity);
        out.array(flags.len());
        for flag in *flags {
            out.simple(flag);
        }
        // Key positions: CL.THROTTLE's first argument is its key.
        let key = i64::from(*name == "cl.throttle");
        out.integer(key);
        out.integer(key);
        out.integer(key);
        out.array(0);
        out.array(0);
        out.array(0);
        out.array(0);
    };
    let Some((sub, names)) = args.split_first() else {
        out.array(COMMANDS.len());
        for command in &COMMANDS {
            info(out, command);
        }
        return;
    };
    match sub.to_ascii_uppercase().as_slice() {
        b"COUNT" => out.integer(COMMANDS.len() as i64),
        b"LIST" => {
            out.array(COMMANDS.len());
            for (name, _, _) in &COMMANDS {
                out.bulk(name.as_bytes());
            }
        }
        b"INFO" => {
            out.array(names.len());
            for name in names {
                match find(name) {
                    Some(command) => info(out, command),
                    None => out.null(),
                }
            }
        }
        b"DOCS" => {
            let listed: Vec<_> = if names.is_empty() {
                COMMANDS.iter().collect()
            } else {
                names.iter().filter_map(|n| find(n)).collect()
            };
            out.map(listed.len());
            for (name, _, _) in listed {
                out.bulk(name.as_bytes());
                out.map(3);
                out.bulk(b"summary");
                out.bulk(summary(name).as_bytes());
                out.bulk(b"since");
                out.bulk(b"0.1.0");
                out.bulk(b"group");
                out.bulk(if name.starts_with("tg.") || *name == "cl.throttle" {
                    b"module".as_slice()
                } else {
                    b"connection".as_slice()
                });
            }
        }
        _ => out.error(&format!(
            "unknown subcommand '{}'. Try COMMAND HELP.",
            String::from_utf8_lossy(sub)
        )),
    }
}

fn summary(name: &str) -> &'static str {
    match name {
        "cl.throttle" => "redis-cell's rate limit: key max_burst count period [quantity]",
        "tg.limit" => "Takes tokens from a limit",
        "tg.check" => "Says whether a limit would grant tokens, taking nothing",
        "tg.transaction" => "Takes from several limits, all or nothing",
        "tg.reset" => "Forgets a limit's state for a key",
        "tg.value" => "A limit's value for a key",
        "tg.adjust" => "Settles a cost known after the work (signed COUNT), never refused",
        "tg.time" => "The server's clock in ms",
        "tg.config" => "The limits the server defines",
        _ => "A connection command, as Redis answers it",
    }
}

/// `INFO [section...]`: the fields clients read (the version, that nothing is loading).
fn info(session: &Session, out: &mut Out) {
    let text = format!(
        "# Server\r\nredis_version:{REDIS_VERSION}\r\nredis_mode:standalone\r\n\
         tollgate_version:{}\r\nprocess_id:{}\r\n\r\n# Clients\r\nclient_id:{}\r\n\r\n\
         # Persistence\r\nloading:0\r\n\r\n# Replication\r\nrole:master\r\n",
        env!("CARGO_PKG_VERSION"),
        std::process::id(),
        session.id,
    );
    out.verbatim(&text);
}
