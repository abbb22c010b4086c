//! The Redis protocol (SPEC §6d): `tollgate serve --resp-listen ADDR` answers redis-cell's
//! `CL.THROTTLE`, the `TG.*` commands and the connection commands that Redis clients send
//! on their own, to any Redis client, over RESP2 or (after `HELLO 3`) RESP3.
//!
//! A connection reads what the client sent, runs every whole command in it in order, and
//! writes their replies at once (pipelining); it reads again only when those are written. So
//! a connection holds at most one read, one command not yet whole ([`wire::MAX_COMMAND`])
//! and [`FLUSH_AT`] bytes of replies and one part of a reply (a long reply, `EXEC`'s or
//! `COMMAND INFO`'s, is sent part by part, each once the client has taken the ones before):
//! a client that writes and never reads stops being read from, and costs the server no more.
//!
//! A command must arrive whole within `bodyTimeout` of its first byte, however its bytes
//! trickle in; between commands a connection may be quiet for `respIdleTimeout`, and it
//! gives its buffers back after a second of it. Until it has authenticated (on a server with
//! tokens), a connection has a tighter budget: `headerTimeout` in all to do so (the time
//! HTTP gives a request's headers, where its token is), commands of at most 10 arguments
//! and 16 KiB (Redis's bounds for such clients), and reads of 1 KiB at a time.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::auth::Tokens;
use crate::config::HttpLimits;
use crate::engine::Engine;
use crate::error_log::ErrorLog;
use crate::listen::{Stopping, serve_connections};
use crate::metrics::Metrics;

pub mod guesses;
pub mod session;
pub mod tg;
pub mod throttle;
pub mod wire;

/// Replies are sent once this many bytes wait, even before the read's commands are all run
/// (or a long reply is all written): a pipeline of a thousand `CL.THROTTLE` replies (40 KB)
/// takes three writes.
pub const FLUSH_AT: usize = 16 * 1024;

/// How much is read at a time.
const READ_AT_ONCE: usize = 16 * 1024;

/// How much is read at a time before the connection has authenticated: what `AUTH` needs.
const READ_BEFORE_AUTH: usize = 1024;

/// A connection quiet between commands for this long gives its buffers back while it waits:
/// a busy one keeps them (no allocation per read), an idle one in a pool costs little.
const KEEP_BUFFERS: Duration = Duration::from_secs(1);

/// What every connection shares.
pub struct Resp {
    /// The operations.
    pub engine: Arc<Engine>,
    /// Accepted tokens; none: no `AUTH` needed.
    pub tokens: Tokens,
    /// The counters of `/metrics` (`protocol="resp"`).
    pub metrics: Arc<Metrics>,
    /// Failed requests, logged without flooding.
    pub errors: Arc<ErrorLog>,
    /// The limit name `CL.THROTTLE` takes from (`respThrottleName`).
    pub throttle_name: String,
    /// A connection that sends nothing (or takes none of its replies) this long is closed.
    pub idle_timeout: Duration,
    /// A command begun must arrive whole within this (`bodyTimeout`).
    pub command_timeout: Duration,
    /// A connection must authenticate within this of its start, or of a `RESET`
    /// (`headerTimeout`), on a server with tokens.
    pub auth_timeout: Duration,
    /// The longest period `CL.THROTTLE` takes, in seconds (`respMaxPeriod`).
    pub max_period: i64,
    /// Wrong tokens, counted per client address.
    pub guesses: guesses::Guesses,
    /// The ids `CLIENT ID` answers.
    pub next_id: AtomicU64,
}

/// Serves the Redis protocol on `listener` until `stop` resolves, with the other listeners'
/// bounds (see [`serve_connections`]).
///
/// # Errors
///
/// The listener fails for good.
pub async fn serve(
    listener: TcpListener,
    resp: Arc<Resp>,
    limits: HttpLimits,
    accept_errors: Arc<ErrorLog>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    // Wrong tokens are logged summed up: what an interval did not say, once it is over.
    let guesses = Arc::clone(&resp);
    let summing = tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            guesses.guesses.flush();
        }
    });
    // Over maxConnections a client is told, in Redis's words, before the close.
    let full = b"-ERR max number of clients reached\r\n";
    let served = serve_connections(
        listener,
        "resp",
        limits,
        full,
        accept_errors,
        stop,
        move |tcp, stopping| connection(Arc::clone(&resp), tcp, stopping),
    )
    .await;
    summing.abort();
    served
}

/// The most pipelined `CL.THROTTLE` (or `TG.ACQUIRE`, `TG.RELEASE`, `TG.RENEW`) one
/// connection runs at once on a networked store.
pub const AT_ONCE: usize = 64;

/// Pipelined commands of distinct keys, waiting to run together: `CL.THROTTLE`, and the slot
/// commands `TG.ACQUIRE`, `TG.RELEASE` and `TG.RENEW` (a connection that clients share, as
/// Redis clients share theirs, carries many callers' acquires and releases). On a store
/// across the network each would otherwise wait for the round trips of those before it.
/// Commands on different keys commute, so running them at once changes no answer; a key
/// seen again, or any other command, first runs what waits, so every key's commands (and
/// everything around them) keep their order. Replies are written in the order sent.
#[derive(Default)]
struct Together {
    /// Each command's arguments, its name first, and the key it is about.
    commands: Vec<(Vec<Vec<u8>>, Vec<u8>)>,
}

/// What a command that may join is about: `CL.THROTTLE`'s key, or a slot command's name
/// and `KEY` (a NUL between them, which neither may hold); `None` for any other command,
/// or one too big to copy (a name of over 256 bytes, a key of over 1024, other arguments
/// of over 20).
fn joined_key(argv: &[&[u8]]) -> Option<Vec<u8>> {
    let command = argv[0];
    if command.eq_ignore_ascii_case(b"cl.throttle") {
        let fits = (2..=6).contains(&argv.len())
            && argv[1].len() <= 1024
            && argv[2..].iter().all(|a| a.len() <= 20);
        return fits.then(|| argv[1].to_vec());
    }
    let slots = [&b"tg.acquire"[..], b"tg.release", b"tg.renew"];
    if !slots.iter().any(|c| command.eq_ignore_ascii_case(c)) || !(2..=10).contains(&argv.len()) {
        return None;
    }
    let name = argv[1];
    let mut key: &[u8] = b"";
    let mut rest = argv[2..].iter();
    while let Some(option) = rest.next() {
        if option.eq_ignore_ascii_case(b"KEY") {
            key = rest.next()?;
        } else if option.len() > 20 {
            return None;
        }
    }
    if name.len() > 256 || key.len() > 1024 {
        return None;
    }
    let mut joined = Vec::with_capacity(name.len() + 1 + key.len());
    joined.extend_from_slice(name);
    joined.push(0);
    joined.extend_from_slice(key);
    Some(joined)
}

impl Together {
    /// Whether a command about `key` may join (room, and no command of that key waiting).
    fn joins(&self, key: &[u8]) -> bool {
        self.commands.len() < AT_ONCE && !self.commands.iter().any(|(_, k)| k == key)
    }

    /// Runs what waits, at once, and writes the replies in order.
    async fn run(&mut self, resp: &Resp, protocol: wire::Protocol, out: &mut wire::Out) {
        if self.commands.is_empty() {
            return;
        }
        if let [(one, _)] = &self.commands[..] {
            // The common case of a hot key: one at a time, nothing to join.
            let reply = session::joined_now(resp, protocol, one).await;
            out.buf.extend_from_slice(&reply);
            self.commands.clear();
            return;
        }
        let commands = std::mem::take(&mut self.commands);
        let replies = futures_util::future::join_all(
            commands.iter().map(|(argv, _)| session::joined_now(resp, protocol, argv)),
        )
        .await;
        for reply in replies {
            out.buf.extend_from_slice(&reply);
        }
    }
}

async fn connection(resp: Arc<Resp>, mut tcp: TcpStream, mut stopping: Stopping) {
    let peer = tcp.peer_addr().ok().map(|addr| addr.ip());
    let mut session = session::Session::new(&resp, peer);
    let mut input = BytesMut::new();
    let mut args = Vec::with_capacity(8);
    let mut out = wire::Out::new();
    // An in-process store answers at once: nothing to gain from running commands together.
    let networked = resp.engine.current().limiter().store().immediate().is_none();
    let mut together = Together::default();
    let mut last_key: Vec<u8> = Vec::new();
    // When the command not yet whole began (its first byte came), if one has.
    let mut begun: Option<Instant> = None;
    // Until when a connection that has not authenticated may go on.
    let mut authenticate_by =
        (!session.authenticated()).then(|| Instant::now() + resp.auth_timeout);
    loop {
        // Every whole command received, in order.
        let mut close = false;
        let mut ran = false;
        loop {
            let bounds = session.bounds();
            match wire::parse(&input, &mut args, bounds) {
                Ok(Some(used)) => {
                    ran = true;
                    if !args.is_empty() {
                        let argv: Vec<&[u8]> = args.iter().map(|r| &input[r.clone()]).collect();
                        // A key just run again (a hot key) runs as it comes: nothing to
                        // run beside it, and nothing to copy.
                        let key = if networked && session.may_take_now() {
                            joined_key(&argv)
                        } else {
                            None
                        };
                        let key = key.filter(|k| *k != last_key && together.joins(k));
                        if let Some(key) = key {
                            last_key.clone_from(&key);
                            let argv = argv.iter().map(|a| a.to_vec()).collect();
                            together.commands.push((argv, key));
                        } else {
                            together.run(&resp, session.protocol(), &mut out).await;
                            let mut writer = Writer { tcp: &mut tcp, timeout: resp.idle_timeout };
                            match session.run(&resp, &argv, &mut out, &mut writer).await {
                                session::Next::Go => {}
                                session::Next::Close => close = true,
                                session::Next::Cut => return,
                            }
                        }
                    }
                    input.advance(used);
                    if close {
                        break;
                    }
                    let mut writer = Writer { tcp: &mut tcp, timeout: resp.idle_timeout };
                    if writer.room(&mut out).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    together.run(&resp, session.protocol(), &mut out).await;
                    out.error(&format!("Protocol error: {}", e.0));
                    close = true;
                    break;
                }
            }
        }
        together.run(&resp, session.protocol(), &mut out).await;
        let mut writer = Writer { tcp: &mut tcp, timeout: resp.idle_timeout };
        if writer.send(&mut out).await.is_err() || close {
            return;
        }
        let now = Instant::now();
        // Authenticated now, or not any more (`RESET`): the budget follows.
        authenticate_by = match (session.authenticated(), authenticate_by) {
            (true, _) => None,
            (false, None) => Some(now + resp.auth_timeout),
            (false, by) => by,
        };
        // A command's bytes after those run began with the last read; those of a command
        // already waiting keep its start.
        begun = match (input.is_empty(), begun) {
            (true, _) => None,
            (false, Some(at)) if !ran => Some(at),
            (false, _) => Some(now),
        };
        let (deadline, waiting) = match begun {
            Some(at) => (at + resp.command_timeout, Waiting::RestOfCommand),
            None => (now + resp.idle_timeout, Waiting::NextCommand),
        };
        let (deadline, waiting) = match authenticate_by {
            Some(by) if by < deadline => (by, Waiting::Authentication),
            _ => (deadline, waiting),
        };
        let chunk = if session.authenticated() { READ_AT_ONCE } else { READ_BEFORE_AUTH };
        if input.capacity() - input.len() < chunk / 4 {
            input.reserve(chunk);
        }
        // Between commands the buffers are kept a moment, then given back while it waits.
        let keep = if input.is_empty() { deadline.min(now + KEEP_BUFFERS) } else { deadline };
        let read = tokio::select! {
            biased;
            read = tokio::time::timeout_at(keep.into(), tcp.read_buf(&mut input)) => read,
            () = stopping.wait() => return,
        };
        match read {
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(_)) => continue,
            Err(_) if keep < deadline => {
                input = BytesMut::new();
                out.buf = Vec::new();
                args = Vec::new();
                let ready = tokio::select! {
                    biased;
                    ready = tokio::time::timeout_at(deadline.into(), tcp.readable()) => ready,
                    () = stopping.wait() => return,
                };
                match ready {
                    Ok(Ok(())) => continue,
                    Ok(Err(_)) => return,
                    Err(_) => {}
                }
            }
            Err(_) => {}
        }
        // Said in the log only: Redis tells a client nothing when it closes an idle
        // connection, and one that trickles a command is not waiting for an answer.
        match waiting {
            Waiting::NextCommand => {
                tracing::debug!("resp: a connection idle for {:?} closed", resp.idle_timeout);
            }
            Waiting::RestOfCommand => tracing::debug!(
                "resp: a command not whole {:?} after its first byte (bodyTimeout): closed",
                resp.command_timeout
            ),
            Waiting::Authentication => tracing::debug!(
                "resp: a connection not authenticated {:?} after its start \
                 (headerTimeout): closed",
                resp.auth_timeout
            ),
        }
        return;
    }
}

/// What a connection waits for when it reads, for the log when the wait is too long.
#[derive(Clone, Copy)]
enum Waiting {
    /// A command, between commands (`respIdleTimeout`).
    NextCommand,
    /// The rest of a command begun (`bodyTimeout`).
    RestOfCommand,
    /// `AUTH` (`headerTimeout`).
    Authentication,
}

/// Where a connection's replies go, for [`session::Session::run`] to send a long reply part
/// by part.
pub struct Writer<'a> {
    tcp: &'a mut TcpStream,
    /// A client that takes none of its replies for this long is cut (`respIdleTimeout`).
    timeout: Duration,
}

impl Writer<'_> {
    /// Sends the replies waiting once they are [`FLUSH_AT`] bytes or more: what a long reply
    /// calls between its parts, so that a connection never holds more than that and a
    /// part.
    ///
    /// # Errors
    ///
    /// The client is gone, or took none of its replies within the idle timeout.
    pub async fn room(&mut self, out: &mut wire::Out) -> Result<(), ()> {
        if out.buf.len() < FLUSH_AT {
            return Ok(());
        }
        self.send(out).await
    }

    /// Writes the replies waiting, within the idle timeout.
    async fn send(&mut self, out: &mut wire::Out) -> Result<(), ()> {
        if out.buf.is_empty() {
            return Ok(());
        }
        let written = tokio::time::timeout(self.timeout, self.tcp.write_all(&out.buf)).await;
        out.buf.clear();
        // A large reply (`TG.CONFIG` of many limits) does not stay with the connection.
        if out.buf.capacity() > 4 * FLUSH_AT {
            out.buf.shrink_to(FLUSH_AT);
        }
        match written {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    }
}
