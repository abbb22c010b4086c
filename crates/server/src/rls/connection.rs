//! One HTTP/2 connection to the rate limit service's port, as the port bounds it: whether it
//! is idle (no call open, and none for a while: PINGs and SETTINGS are not calls), its long
//! calls (`grpc.health.v1.Health/Watch` streams) counted, and its control frames (PING,
//! SETTINGS) within a budget, so that a client cannot keep a connection, or a core, busy with
//! frames that ask for nothing.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// PING and SETTINGS frames a connection may send at once, and then per second. A client
/// sends a SETTINGS and a few acknowledgements at the start, and a PING now and then to keep
/// the connection alive (or, grpc-go, one per burst of answers: each call adds
/// [`CONTROL_PER_CALL`] more); a flood of them (one connection kept a core busy answering
/// PINGs) is cut within its first thousand.
pub const CONTROL_BURST: f64 = 1_000.0;
/// See [`CONTROL_BURST`].
pub const CONTROL_PER_SECOND: f64 = 200.0;
/// See [`CONTROL_BURST`].
pub const CONTROL_PER_CALL: f64 = 4.0;

/// What the port knows of one connection, shared by its reader ([`Frames`]) and its calls.
#[derive(Debug)]
pub struct Connection {
    /// Calls started (the high 32 bits) and open (the low 32): one atomic add a call.
    calls: AtomicU64,
    /// `Watch` streams open on this connection.
    pub watches: Arc<tokio::sync::Semaphore>,
}

/// `Watch` streams one connection may hold open.
pub const WATCHES_PER_CONNECTION: usize = 4;

const STARTED: u64 = 1 << 32;
const OPEN: u64 = STARTED - 1;

impl Connection {
    /// A connection accepted now.
    pub fn new() -> Arc<Self> {
        Arc::new(Connection {
            calls: AtomicU64::new(0),
            watches: Arc::new(tokio::sync::Semaphore::new(WATCHES_PER_CONNECTION)),
        })
    }

    /// A call starts: it is open until what this returns is dropped.
    pub fn call(self: &Arc<Self>) -> OpenCall {
        self.calls.fetch_add(STARTED + 1, Ordering::AcqRel);
        OpenCall(Arc::clone(self))
    }

    /// Calls started so far.
    fn started(&self) -> u64 {
        self.calls.load(Ordering::Acquire) >> 32
    }

    /// Whether the connection was quiet since `seen` (the calls started when last asked):
    /// none open now, and none started since. Notes the calls started for the next time.
    /// Asked every `headerTimeout`, a connection is closed between one and two of them after
    /// its last call (PINGs and SETTINGS are not calls).
    pub fn quiet_since(&self, seen: &mut u64) -> bool {
        let calls = self.calls.load(Ordering::Acquire);
        let (started, open) = (calls >> 32, calls & OPEN);
        let quiet = open == 0 && started == *seen;
        *seen = started;
        quiet
    }
}

/// A call open on a [`Connection`]; dropped when its answer is (a `Watch` stream's when it
/// ends).
#[derive(Debug)]
pub struct OpenCall(Arc<Connection>);

impl Drop for OpenCall {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection's stream, read through a reader of HTTP/2 frame headers that counts the
/// PING and SETTINGS frames against the connection's budget: past it, reading fails and
/// the connection is closed.
pub struct Frames {
    tcp: TcpStream,
    connection: Arc<Connection>,
    headers: FrameHeaders,
    budget: Budget,
}

impl Frames {
    /// `tcp`, read for `connection`.
    pub fn new(tcp: TcpStream, connection: Arc<Connection>) -> Self {
        Frames { tcp, connection, headers: FrameHeaders::default(), budget: Budget::new() }
    }
}

/// The control frames a connection may still send: a token bucket of [`CONTROL_BURST`],
/// [`CONTROL_PER_SECOND`] back a second and [`CONTROL_PER_CALL`] a call started. Only its
/// reader counts, when control frames come, so a call costs it nothing.
#[derive(Debug)]
struct Budget {
    left: f64,
    at: Instant,
    /// Calls started when last counted.
    calls: u64,
}

impl Budget {
    fn new() -> Self {
        Budget { left: CONTROL_BURST, at: Instant::now(), calls: 0 }
    }

    /// Counts `n` control frames, the connection's calls started so far being `calls`:
    /// whether it is still within its budget.
    fn spend(&mut self, n: u32, calls: u64) -> bool {
        let now = Instant::now();
        let back = now.duration_since(self.at).as_secs_f64() * CONTROL_PER_SECOND
            + calls.saturating_sub(self.calls) as f64 * CONTROL_PER_CALL;
        self.left = (self.left + back).min(CONTROL_BURST) - f64::from(n);
        (self.at, self.calls) = (now, calls);
        self.left >= 0.0
    }
}

/// Where a reader is in the client's bytes: the preface, a frame's header, its payload.
#[derive(Debug)]
struct FrameHeaders {
    /// Bytes of the client's preface still to come.
    preface: usize,
    /// The header being read, and how much of it has come.
    head: [u8; 9],
    have: usize,
    /// Bytes of the current frame's payload still to come.
    payload: usize,
}

/// The client's preface: `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const PREFACE: usize = 24;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;

impl Default for FrameHeaders {
    fn default() -> Self {
        FrameHeaders { preface: PREFACE, head: [0; 9], have: 0, payload: 0 }
    }
}

impl FrameHeaders {
    /// Reads `bytes`: how many PING and SETTINGS frames began in them.
    fn feed(&mut self, mut bytes: &[u8]) -> u32 {
        let mut control = 0;
        while !bytes.is_empty() {
            let skip = if self.preface > 0 {
                let n = self.preface.min(bytes.len());
                self.preface -= n;
                n
            } else if self.payload > 0 {
                let n = self.payload.min(bytes.len());
                self.payload -= n;
                n
            } else {
                let n = (9 - self.have).min(bytes.len());
                self.head[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                if self.have == 9 {
                    let h = &self.head;
                    self.payload =
                        usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                    control += u32::from(matches!(h[3], SETTINGS | PING));
                    self.have = 0;
                }
                n
            };
            bytes = &bytes[skip..];
        }
        control
    }
}

impl AsyncRead for Frames {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let control = self.headers.feed(&buf.filled()[before..]);
            let calls = self.connection.started();
            if control > 0 && !self.budget.spend(control, calls) {
                return Poll::Ready(Err(std::io::Error::other(
                    "too many PING or SETTINGS frames: the connection is closed",
                )));
            }
        }
        polled
    }
}

impl AsyncWrite for Frames {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, payload: usize) -> Vec<u8> {
        let mut out = vec![(payload >> 16) as u8, (payload >> 8) as u8, payload as u8, kind, 0];
        out.extend([0; 4]);
        out.extend(std::iter::repeat_n(7u8, payload));
        out
    }

    #[test]
    fn frame_headers_are_found_however_the_bytes_are_cut() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(SETTINGS, 12));
        bytes.extend(frame(1, 300)); // HEADERS
        bytes.extend(frame(PING, 8));
        bytes.extend(frame(0, 0)); // an empty DATA
        bytes.extend(frame(PING, 8));
        for cut in [1, 2, 7, 9, 10, 64, bytes.len()] {
            let mut headers = FrameHeaders::default();
            let found: u32 = bytes.chunks(cut).map(|chunk| headers.feed(chunk)).sum();
            assert_eq!(found, 3, "in chunks of {cut}");
        }
    }

    #[test]
    fn the_budget_runs_out_and_calls_add_to_it() {
        let mut budget = Budget::new();
        assert!(budget.spend(CONTROL_BURST as u32 - 10, 0));
        assert!(budget.spend(10 + CONTROL_PER_CALL as u32 - 1, 1), "a call added to it");
        assert!(!budget.spend(100, 1));
    }

    #[test]
    fn a_connection_is_quiet_only_without_calls_open_or_started() {
        let connection = Connection::new();
        let mut seen = 0;
        assert!(connection.quiet_since(&mut seen));
        let call = connection.call();
        assert!(!connection.quiet_since(&mut seen), "a call started");
        assert!(!connection.quiet_since(&mut seen), "a call open");
        drop(call);
        assert!(connection.quiet_since(&mut seen));
        assert_eq!(connection.started(), 1);
    }
}
