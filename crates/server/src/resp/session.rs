//! One connection's state (its protocol, who it authenticated as, its name, the commands it
//! queued since `MULTI`) and the commands it runs: the connection commands Redis clients send
//! on their own, answered as Redis answers them, then `CL.THROTTLE` and `TG.*`.

use std::net::IpAddr;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::answer::{Answer, Body};
use crate::auth::known_token;
use crate::metrics::Protocol as Via;

use super::tg::{self, Tg};
use super::throttle;
use super::wire::{Bounds, Out, Protocol};
use super::{Resp, Writer};

/// What a connection does after a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Reads the next one.
    Go,
    /// Sends its replies and closes (`QUIT`).
    Close,
    /// Closes at once: the client took none of a long reply within the idle timeout, or is
    /// gone.
    Cut,
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
    /// The client's address, whose wrong tokens are counted together.
    peer: Option<IpAddr>,
    /// The commands queued since `MULTI`, while one is open.
    transaction: Option<Transaction>,
}

/// The most a transaction may hold: its commands' arguments, and 8 bytes for each argument
/// and command (how they are kept), take at most what one command may take (64 KiB).
pub const MAX_QUEUED: usize = super::wire::MAX_COMMAND;

/// The commands queued since `MULTI`, kept in one buffer (each argument 8 bytes besides its
/// own), and whether one of them was refused (then `EXEC` runs none).
#[derive(Default)]
struct Transaction {
    bytes: Vec<u8>,
    args: Vec<Range<u32>>,
    /// Each command: its name (as [`COMMANDS`] spells it) and where its arguments end in
    /// `args`.
    commands: Vec<(&'static str, usize)>,
    failed: bool,
}

impl Transaction {
    /// What it holds, counted against [`MAX_QUEUED`].
    fn size(&self) -> usize {
        self.bytes.len() + 8 * (self.args.len() + self.commands.len())
    }

    /// Queues `argv` (its name spelt `command`), or says how much is too much.
    fn push(&mut self, command: &'static str, argv: &[&[u8]]) -> Result<(), String> {
        let more = argv.iter().map(|a| a.len() + 8).sum::<usize>() + 8;
        if self.size() + more > MAX_QUEUED {
            return Err(format!(
                "a transaction holds at most {MAX_QUEUED} bytes of commands here; it is \
                 discarded (EXEC answers EXECABORT). Send fewer commands between MULTI and \
                 EXEC, or TG.TRANSACTION to take from several limits at once"
            ));
        }
        for arg in argv {
            let start = self.bytes.len() as u32;
            self.bytes.extend_from_slice(arg);
            self.args.push(start..self.bytes.len() as u32);
        }
        self.commands.push((command, self.args.len()));
        Ok(())
    }

    /// The commands, in order: each one's name and arguments (its own name first).
    fn each(&self) -> impl Iterator<Item = (&'static str, Vec<&[u8]>)> + '_ {
        let mut from = 0;
        self.commands.iter().map(move |&(command, to)| {
            let argv = self.args[from..to]
                .iter()
                .map(|r| &self.bytes[r.start as usize..r.end as usize])
                .collect();
            from = to;
            (command, argv)
        })
    }
}

/// The version `HELLO` and `INFO` give as Redis's: clients read it to know which commands
/// the server has (RESP3 and `CLIENT SETINFO` came with Redis 6 and 7.2), and tollgate
/// answers those.
const REDIS_VERSION: &str = "7.2.0";

/// The commands `COMMAND` lists: (name, arity as Redis writes it, flags).
const COMMANDS: [(&str, i64, &[&str]); 28] = [
    ("cl.throttle", -5, &["write", "fast"]),
    ("tg.limit", -2, &["write", "fast"]),
    ("tg.check", -2, &["readonly", "fast"]),
    ("tg.transaction", -1, &["write", "fast"]),
    ("tg.reset", -2, &["write", "fast"]),
    ("tg.value", -2, &["readonly", "fast"]),
    ("tg.adjust", -4, &["write", "fast"]),
    ("tg.acquire", -2, &["write", "fast"]),
    ("tg.release", -4, &["write", "fast"]),
    ("tg.renew", -4, &["write", "fast"]),
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
    ("multi", 1, &["noscript", "loading", "stale", "fast", "allow_busy"]),
    ("exec", 1, &["noscript", "loading", "stale", "skip_slowlog"]),
    ("discard", 1, &["noscript", "loading", "stale", "fast", "allow_busy"]),
    ("watch", -2, &["noscript", "loading", "stale", "fast", "allow_busy"]),
    ("unwatch", 1, &["noscript", "loading", "stale", "fast", "allow_busy"]),
];

/// Whether `argc` arguments (the name included) fit `arity` as Redis writes it: exactly
/// that many, or at least `-arity`.
fn fits(arity: i64, argc: usize) -> bool {
    let argc = argc as i64;
    if arity >= 0 { argc == arity } else { argc >= -arity }
}

/// The operation a command counts as in metrics, if it takes or writes (what a read token
/// may not run).
fn writes(command: &str) -> Option<&'static str> {
    match command {
        "cl.throttle" => Some("throttle"),
        "tg.limit" => Some("limit"),
        "tg.transaction" => Some("transaction"),
        "tg.reset" => Some("reset"),
        "tg.adjust" => Some("adjust"),
        "tg.acquire" => Some("acquire"),
        "tg.release" => Some("release"),
        "tg.renew" => Some("renew"),
        _ => None,
    }
}

impl Session {
    /// Whether it may take (it authenticated with a full token, or needs none) a command
    /// now, outside a transaction: what may run beside others.
    pub fn may_take_now(&self) -> bool {
        self.access == Access::Full && self.transaction.is_none()
    }

    /// Whether it has authenticated, or needs not.
    pub fn authenticated(&self) -> bool {
        self.access != Access::None
    }

    /// What its next command may be.
    pub fn bounds(&self) -> Bounds {
        if self.authenticated() { Bounds::AUTHENTICATED } else { Bounds::UNAUTHENTICATED }
    }

    /// The protocol its replies are written in.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// A new connection's, from `peer`: RESP2, authenticated only if the server has no
    /// tokens.
    pub fn new(resp: &Resp, peer: Option<IpAddr>) -> Self {
        Session {
            protocol: Protocol::Resp2,
            access: if resp.tokens.required() { Access::None } else { Access::Full },
            name: None,
            id: resp.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            peer,
            transaction: None,
        }
    }

    /// Runs one command (`argv[0]` its name), its reply written to `out` (a long one sent
    /// part by part through `writer`); inside `MULTI`, queues it.
    pub async fn run(
        &mut self,
        resp: &Resp,
        argv: &[&[u8]],
        out: &mut Out,
        writer: &mut Writer<'_>,
    ) -> Next {
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
        // As Redis: a command it does not have is said so before any question of auth; a
        // command refused before it runs discards the transaction it was sent in.
        let Some(&(command, arity, _)) = COMMANDS.iter().find(|(known, _, _)| *known == command)
        else {
            unknown(out, argv);
            self.refused();
            return Next::Go;
        };
        if self.access == Access::None && !matches!(command, "auth" | "hello" | "quit" | "reset") {
            out.coded("NOAUTH", "Authentication required.");
            self.refused();
            return Next::Go;
        }
        match command {
            "multi" if self.transaction.is_some() => out.error("MULTI calls can not be nested"),
            "multi" => {
                self.transaction = Some(Transaction::default());
                out.simple("OK");
            }
            "exec" => return self.exec(resp, out, writer).await,
            "discard" => match self.transaction.take() {
                Some(_) => out.simple("OK"),
                None => out.error("DISCARD without MULTI"),
            },
            "watch" if self.transaction.is_some() => {
                out.error("WATCH inside MULTI is not allowed");
            }
            "watch" if argv.len() < 2 => arity_error(out, "watch"),
            // A no-op would promise what it does not keep: an EXEC that aborts when a watched
            // key changed. tollgate's states are not Redis keys a client reads and writes;
            // each command is atomic on its own, and TG.TRANSACTION takes from several
            // limits all or nothing.
            "watch" => out.error(
                "WATCH is not supported here: tollgate keeps no keys a client could watch. \
                 Each command is atomic on its own; TG.TRANSACTION takes from several limits \
                 all or nothing",
            ),
            "quit" | "reset" => return self.dispatch(resp, command, argv, out, writer).await,
            _ if self.transaction.is_some() => self.queue(resp, command, arity, argv, out),
            _ => return self.dispatch(resp, command, argv, out, writer).await,
        }
        Next::Go
    }

    /// A command refused before it would run: inside `MULTI`, `EXEC` then runs nothing.
    fn refused(&mut self) {
        if let Some(transaction) = &mut self.transaction {
            transaction.failed = true;
        }
    }

    /// Queues a command inside `MULTI`, checked as Redis checks it then (its number of
    /// arguments, what the connection may run), and within [`MAX_QUEUED`].
    fn queue(
        &mut self,
        resp: &Resp,
        command: &'static str,
        arity: i64,
        argv: &[&[u8]],
        out: &mut Out,
    ) {
        if !fits(arity, argv.len()) {
            arity_error(out, command);
            return self.refused();
        }
        if let (Access::Read, Some(op)) = (self.access, writes(command)) {
            self.read_only(resp, &command.to_ascii_uppercase(), op, Instant::now(), out);
            return self.refused();
        }
        let Some(transaction) = &mut self.transaction else { return };
        match transaction.push(command, argv) {
            Ok(()) => out.simple("QUEUED"),
            Err(message) => {
                out.error(&message);
                self.refused();
            }
        }
    }

    /// `EXEC`: the queued commands run in order, their replies in one array (sent part by
    /// part); none if one was refused while queued.
    async fn exec(&mut self, resp: &Resp, out: &mut Out, writer: &mut Writer<'_>) -> Next {
        let Some(transaction) = self.transaction.take() else {
            out.error("EXEC without MULTI");
            return Next::Go;
        };
        if transaction.failed {
            out.coded("EXECABORT", "Transaction discarded because of previous errors.");
            return Next::Go;
        }
        out.array(transaction.commands.len());
        for (command, argv) in transaction.each() {
            let next = self.dispatch(resp, command, &argv, out, writer).await;
            if next != Next::Go {
                return next;
            }
            if writer.room(out).await.is_err() {
                return Next::Cut;
            }
        }
        Next::Go
    }

    /// Runs `command` (its name in `argv[0]`, spelt as [`COMMANDS`] spells it).
    async fn dispatch(
        &mut self,
        resp: &Resp,
        command: &'static str,
        argv: &[&[u8]],
        out: &mut Out,
        writer: &mut Writer<'_>,
    ) -> Next {
        out.protocol = self.protocol;
        let args = &argv[1..];
        match command {
            "cl.throttle" => {
                traced("RESP CL.THROTTLE", "throttle", self.throttle(resp, args, out)).await;
            }
            "ping" => match args {
                [] => out.simple("PONG"),
                [message] => out.bulk(message),
                _ => arity_error(out, "ping"),
            },
            "echo" => match args {
                [message] => out.bulk(message),
                _ => arity_error(out, "echo"),
            },
            "quit" => {
                out.simple("OK");
                return Next::Close;
            }
            "reset" => {
                self.protocol = Protocol::Resp2;
                self.name = None;
                self.transaction = None;
                if resp.tokens.required() {
                    self.access = Access::None;
                }
                out.protocol = self.protocol;
                out.simple("RESET");
            }
            "auth" => match args {
                [token] => {
                    if self.authenticate(resp, None, token, out) {
                        out.simple("OK");
                    }
                }
                [user, token] => {
                    if self.authenticate(resp, Some(user), token, out) {
                        out.simple("OK");
                    }
                }
                [] => arity_error(out, "auth"),
                _ => out.error("syntax error"),
            },
            "hello" => self.hello(resp, args, out),
            "select" => match args {
                [b"0"] => out.simple("OK"),
                [db] if std::str::from_utf8(db).is_ok_and(|d| d.parse::<i64>().is_ok()) => {
                    out.error("DB index is out of range");
                }
                [_] => out.error("value is not an integer or out of range"),
                _ => arity_error(out, "select"),
            },
            "client" => self.client(args, out),
            "command" => {
                if command_info(args, out, writer).await.is_err() {
                    return Next::Cut;
                }
            }
            "info" => info(self, out),
            "time" => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                out.array(2);
                out.bulk(now.as_secs().to_string().as_bytes());
                out.bulk(now.subsec_micros().to_string().as_bytes());
            }
            // Nothing is watched (see WATCH): nothing to forget.
            "unwatch" => out.simple("OK"),
            // MULTI, EXEC, DISCARD and WATCH are never queued, so never run from here.
            "multi" | "exec" | "discard" | "watch" => out.error("Command not allowed here"),
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

    /// Checks a token given with `AUTH [user] token` or `HELLO ... AUTH user token`: `true`
    /// when the connection may go on as authenticated (the reply is the caller's), else the
    /// error is written.
    ///
    /// A server without tokens answers as Redis's default user without a password does:
    /// `AUTH default <anything>` is accepted, `AUTH <password>` alone is Redis's error, and
    /// another user does not exist. With tokens the user is not checked (a token is who the
    /// client is); wrong tokens are counted per client address and throttled.
    fn authenticate(
        &mut self,
        resp: &Resp,
        user: Option<&[u8]>,
        token: &[u8],
        out: &mut Out,
    ) -> bool {
        if !resp.tokens.required() {
            match user {
                Some(b"default") => return true,
                Some(_) => {
                    out.coded("WRONGPASS", "invalid username-password pair or user is disabled.");
                }
                None => out.error(
                    "AUTH <password> called without any password configured for the default \
                     user. Are you sure your configuration is correct?",
                ),
            }
            return false;
        }
        if let Err(wait) = resp.guesses.may_try(self.peer, &resp.metrics) {
            out.error(&format!(
                "too many wrong tokens from this address; AUTH is refused for {} s",
                wait.as_secs().max(1)
            ));
            return false;
        }
        let token = std::str::from_utf8(token).unwrap_or("");
        if known_token(&resp.tokens.full, token) {
            self.access = Access::Full;
        } else if known_token(&resp.tokens.read, token) {
            self.access = Access::Read;
        } else {
            resp.guesses.wrong(self.peer, &resp.metrics);
            out.coded("WRONGPASS", "invalid username-password pair or user is disabled.");
            return false;
        }
        true
    }

    /// `HELLO [protover [AUTH user token] [SETNAME name]]`, as Redis 7.2 runs it: every
    /// option read (and a name checked) first, then the token, then the name is set. A bad
    /// name leaves the connection as it was, unauthenticated if it was.
    fn hello(&mut self, resp: &Resp, args: &[&[u8]], out: &mut Out) {
        let mut protocol = self.protocol;
        let mut credentials = None;
        let mut name = None;
        if let Some((version, mut options)) = args.split_first() {
            protocol = match *version {
                b"2" => Protocol::Resp2,
                b"3" => Protocol::Resp3,
                v if std::str::from_utf8(v).is_ok_and(|v| v.parse::<i64>().is_ok()) => {
                    return out.coded("NOPROTO", "unsupported protocol version");
                }
                _ => return out.error("Protocol version is not an integer or out of range"),
            };
            while let Some((option, rest)) = options.split_first() {
                match (option.to_ascii_uppercase().as_slice(), rest) {
                    (b"AUTH", [user, token, more @ ..]) => {
                        credentials = Some((*user, *token));
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
        }
        if let Some((user, token)) = credentials
            && !self.authenticate(resp, Some(user), token, out)
        {
            return;
        }
        if self.access == Access::None {
            return out.coded(
                "NOAUTH",
                "HELLO must be called with the client already authenticated, otherwise \
                 the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
                 client and select the RESP protocol version at the same time",
            );
        }
        if let Some(name) = name {
            self.name = name;
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
        let Some((sub, rest)) = args.split_first() else { return arity_error(out, "client") };
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
        answer_tg(resp, &tg, start, out).await
    }
}

/// Runs a parsed `TG.*` command that may run (a joined one may: its connection was checked
/// before it joined); how it went, for metrics and spans.
async fn run_tg(resp: &Resp, parsed: Result<Tg, String>, out: &mut Out) -> &'static str {
    match parsed {
        Ok(tg) => answer_tg(resp, &tg, Instant::now(), out).await,
        Err(message) => {
            out.error(&message);
            "invalid"
        }
    }
}

/// Runs `tg` and writes its answer; how it went.
async fn answer_tg(resp: &Resp, tg: &Tg, start: Instant, out: &mut Out) -> &'static str {
    let answer = match tg {
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

impl Session {
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
    let parsed = match throttle::args(args, resp.max_period) {
        Ok(parsed) => parsed,
        Err(message) => {
            resp.metrics.record(Via::Resp, "throttle", "invalid", start.elapsed());
            out.error(&message);
            return "invalid";
        }
    };
    let defined = resp.engine.current();
    let name = resp.throttle_name.as_str();
    let target = match throttle::target(&defined, name, parsed.config) {
        Ok(target) => target,
        Err(message) => {
            resp.metrics.record(Via::Resp, "throttle", "invalid", start.elapsed());
            out.error(&message);
            return "invalid";
        }
    };
    let outcome = match throttle::throttle(&defined, target, parsed).await {
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

/// A command run beside others (see `Together` in the module above), its name first:
/// `CL.THROTTLE`, or a slot command of a connection that may take (authenticated with a full
/// token, outside `MULTI`): its reply.
pub async fn joined_now(resp: &Resp, protocol: Protocol, argv: &[Vec<u8>]) -> Vec<u8> {
    if argv[0].eq_ignore_ascii_case(b"cl.throttle") {
        return throttle_now(resp, protocol, &argv[1..]).await;
    }
    let mut out = Out { buf: Vec::with_capacity(64), protocol };
    let command = String::from_utf8_lossy(&argv[0]).to_ascii_lowercase();
    let args: Vec<&[u8]> = argv[1..].iter().map(Vec::as_slice).collect();
    match tg::parse(&command, &args) {
        Some(parsed) => {
            let op = parsed.as_ref().map_or("invalid", Tg::name);
            traced(span_name(&command), op, run_tg(resp, parsed, &mut out)).await;
        }
        None => unknown(&mut out, &argv.iter().map(Vec::as_slice).collect::<Vec<_>>()),
    }
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
        "tg.acquire" => "RESP TG.ACQUIRE",
        "tg.release" => "RESP TG.RELEASE",
        "tg.renew" => "RESP TG.RENEW",
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

fn arity_error(out: &mut Out, command: &str) {
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
/// `COMMAND LIST`. `COMMAND INFO` answers each name given (as Redis does, a name twice
/// twice), sent part by part through `writer`; `COMMAND DOCS` is a map, so each command
/// named is in it once, however often it was named.
///
/// # Errors
///
/// The client took none of a long reply within the idle timeout.
async fn command_info(args: &[&[u8]], out: &mut Out, writer: &mut Writer<'_>) -> Result<(), ()> {
    type Command = (&'static str, i64, &'static [&'static str]);
    let find = |name: &[u8]| -> Option<&'static Command> {
        COMMANDS.iter().find(|(n, _, _)| name.eq_ignore_ascii_case(n.as_bytes()))
    };
    let info = |out: &mut Out, (name, arity, flags): &Command| {
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
        return Ok(());
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
                writer.room(out).await?;
            }
        }
        b"DOCS" => {
            let mut listed: Vec<&Command> = Vec::new();
            if names.is_empty() {
                listed.extend(&COMMANDS);
            }
            for command in names.iter().filter_map(|n| find(n)) {
                if !listed.iter().any(|l| l.0 == command.0) {
                    listed.push(command);
                }
            }
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
                } else if matches!(*name, "multi" | "exec" | "discard" | "watch" | "unwatch") {
                    b"transactions".as_slice()
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
    Ok(())
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
        "multi" => "Starts a transaction: the commands after it are queued until EXEC",
        "exec" => "Runs the commands queued since MULTI, in order",
        "discard" => "Forgets the commands queued since MULTI",
        "watch" => "Not supported: tollgate keeps no keys to watch",
        "unwatch" => "Forgets watched keys (there are none)",
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
