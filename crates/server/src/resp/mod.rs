//! The Redis protocol (SPEC §6d): `tollgate serve --resp-listen ADDR` answers redis-cell's
//! `CL.THROTTLE`, the `TG.*` commands and the connection commands that Redis clients send
//! on their own, to any Redis client, over RESP2 or (after `HELLO 3`) RESP3.
//!
//! A connection reads what the client sent, runs every whole command in it in order, and
//! writes their replies at once (pipelining); it reads again only when those are written. So
//! a connection holds at most one read, one command not yet whole ([`wire::MAX_COMMAND`])
//! and [`FLUSH_AT`] bytes of replies: a client that writes and never reads stops being
//! read from, and costs the server no more.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::auth::Tokens;
use crate::config::HttpLimits;
use crate::engine::Engine;
use crate::error_log::ErrorLog;
use crate::listen::{Stopping, serve_connections};
use crate::metrics::Metrics;

pub mod session;
pub mod tg;
pub mod throttle;
pub mod wire;

/// Replies are sent once this many bytes wait, even before the read's commands are all run.
pub const FLUSH_AT: usize = 64 * 1024;

/// How much is read at a time.
const READ_AT_ONCE: usize = 16 * 1024;

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
    serve_connections(listener, "resp", limits, accept_errors, stop, move |tcp, stopping| {
        connection(Arc::clone(&resp), tcp, stopping)
    })
    .await
}

/// Why a connection ends.
enum End {
    /// The client closed it, or asked to (`QUIT`), or broke the protocol.
    Done,
    /// It said nothing, or took no replies, for too long; or the server is stopping.
    Cut,
}

/// The most pipelined `CL.THROTTLE` one connection runs at once on a networked store.
pub const AT_ONCE: usize = 64;

/// Pipelined `CL.THROTTLE` commands of distinct keys, waiting to run together: on a store
/// across the network each would otherwise wait for the round trips of those before it.
/// Commands on different keys commute, so running them at once changes no answer; a key
/// seen again, or any other command, first runs what waits, so every key's commands (and
/// everything around them) keep their order. Replies are written in the order sent.
#[derive(Default)]
struct Together {
    /// Each command's arguments after its name.
    commands: Vec<Vec<Vec<u8>>>,
}

impl Together {
    /// Whether `argv` may join: a `CL.THROTTLE` with a key not already waiting, of a size
    /// that can be valid (a key of at most 1024 bytes, numbers of at most 20), so that what
    /// waits stays within 64 small copies.
    fn joins(&self, argv: &[&[u8]]) -> bool {
        (2..=6).contains(&argv.len())
            && argv[1].len() <= 1024
            && argv[2..].iter().all(|a| a.len() <= 20)
            && argv[0].eq_ignore_ascii_case(b"cl.throttle")
            && self.commands.len() < AT_ONCE
            && !self.commands.iter().any(|c| c[0] == argv[1])
    }

    /// Runs what waits, at once, and writes the replies in order.
    async fn run(&mut self, resp: &Resp, protocol: wire::Protocol, out: &mut wire::Out) {
        if self.commands.is_empty() {
            return;
        }
        if let [one] = &self.commands[..] {
            // The common case of a hot key: one at a time, nothing to join.
            let reply = session::throttle_now(resp, protocol, one).await;
            out.buf.extend_from_slice(&reply);
            self.commands.clear();
            return;
        }
        let commands = std::mem::take(&mut self.commands);
        let replies = futures_util::future::join_all(
            commands.iter().map(|argv| session::throttle_now(resp, protocol, argv)),
        )
        .await;
        for reply in replies {
            out.buf.extend_from_slice(&reply);
        }
    }
}

async fn connection(resp: Arc<Resp>, mut tcp: TcpStream, mut stopping: Stopping) {
    let mut session = session::Session::new(&resp);
    let mut input = BytesMut::with_capacity(READ_AT_ONCE);
    let mut args = Vec::with_capacity(8);
    let mut out = wire::Out::new();
    // An in-process store answers at once: nothing to gain from running commands together.
    let networked = resp.engine.current().limiter().store().immediate().is_none();
    let mut together = Together::default();
    let mut last_key: Vec<u8> = Vec::new();
    loop {
        // Every whole command received, in order.
        let mut close = false;
        loop {
            match wire::parse(&input, &mut args) {
                Ok(Some(used)) => {
                    if !args.is_empty() {
                        let argv: Vec<&[u8]> = args.iter().map(|r| &input[r.clone()]).collect();
                        // A key just run again (a hot key) runs as it comes: nothing to
                        // run beside it, and nothing to copy.
                        let again = argv.get(1).is_some_and(|k| *k == last_key.as_slice());
                        if networked && !again && session.may_take() && together.joins(&argv) {
                            last_key.clear();
                            last_key.extend_from_slice(argv[1]);
                            together.commands.push(argv[1..].iter().map(|a| a.to_vec()).collect());
                        } else {
                            together.run(&resp, session.protocol(), &mut out).await;
                            close =
                                session.run(&resp, &argv, &mut out).await == session::Next::Close;
                        }
                    }
                    input.advance(used);
                    if close {
                        break;
                    }
                    if out.buf.len() >= FLUSH_AT && send(&mut tcp, &mut out, &resp).await.is_err() {
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
        if send(&mut tcp, &mut out, &resp).await.is_err() || close {
            return;
        }
        // More: within the idle timeout between commands, the command timeout within one.
        let wait = if input.is_empty() { resp.idle_timeout } else { resp.command_timeout };
        if input.capacity() - input.len() < READ_AT_ONCE / 4 {
            input.reserve(READ_AT_ONCE);
        }
        let read = tokio::select! {
            biased;
            read = tokio::time::timeout(wait, tcp.read_buf(&mut input)) => read,
            () = stopping.wait() => return,
        };
        let end = match read {
            Ok(Ok(0)) | Ok(Err(_)) => End::Done,
            Ok(Ok(_)) => continue,
            Err(_) => End::Cut,
        };
        if let End::Cut = end {
            // Said in the reply Redis gives no client either: the connection just closes.
            tracing::debug!("resp: a connection idle for {wait:?} closed");
        }
        return;
    }
}

/// Writes the replies waiting, within the idle timeout.
async fn send(tcp: &mut TcpStream, out: &mut wire::Out, resp: &Resp) -> Result<(), ()> {
    if out.buf.is_empty() {
        return Ok(());
    }
    let written = tokio::time::timeout(resp.idle_timeout, tcp.write_all(&out.buf)).await;
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
