//! The rate limit service's port under abuse, against the built binary: a flood of calls that
//! send their headers and never a body, the same with tokens, calls held past their deadline,
//! idle connections, and a process allowed few open files. Every client is on loopback and
//! bounded in what it sends and how long it waits.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::Served;

/// `tollgate serve` on the memory store with the rate limit service, and `server` as its
/// config file's `[server]` table; `shell` runs first (a `ulimit`).
fn start(dir: &std::path::Path, server: &str, shell: Option<&str>) -> Served {
    common::serve_memory(dir, server, true, shell)
}

/// HTTP/2 frames by hand, for a client that does what a well-behaved one never would.
mod raw {
    use std::io::{Read, Write};

    pub(crate) const DATA: u8 = 0;
    pub(crate) const HEADERS: u8 = 1;
    pub(crate) const RST_STREAM: u8 = 3;
    pub(crate) const SETTINGS: u8 = 4;
    pub(crate) const PING: u8 = 6;
    pub(crate) const GOAWAY: u8 = 7;
    pub(crate) const END_STREAM: u8 = 1;
    const END_HEADERS: u8 = 4;

    pub(crate) fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// The connection's start: the preface and empty SETTINGS.
    pub(crate) fn preface() -> Vec<u8> {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(SETTINGS, 0, 0, &[]));
        out
    }

    /// (type, flags, stream, payload) of the next frame.
    pub(crate) fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
        let mut head = [0; 9];
        r.read_exact(&mut head)?;
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
        let mut payload = vec![0; len];
        r.read_exact(&mut payload)?;
        Ok((head[3], head[4], stream, payload))
    }

    /// A string of HPACK, without Huffman coding (shorter than 127 bytes).
    fn string(out: &mut Vec<u8>, s: &str) {
        out.push(s.len() as u8);
        out.extend_from_slice(s.as_bytes());
    }

    /// The HEADERS frame of a `ShouldRateLimit` call on `stream`, no body to follow yet.
    pub(crate) fn call(stream: u32, authorization: Option<&str>) -> Vec<u8> {
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
        block.push(0x04); // :path, a literal
        string(&mut block, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
        block.push(0x01); // :authority
        string(&mut block, "127.0.0.1");
        block.extend([0x0f, 0x10]); // content-type (static index 31)
        string(&mut block, "application/grpc");
        block.push(0x00); // a new name
        string(&mut block, "te");
        string(&mut block, "trailers");
        if let Some(value) = authorization {
            block.extend([0x0f, 0x08]); // authorization (static index 23)
            string(&mut block, value);
        }
        frame(HEADERS, END_HEADERS, stream, &block)
    }

    pub(crate) fn write(w: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
        w.write_all(bytes)
    }
}

/// What one flooding connection saw.
#[derive(Debug, Default)]
struct Flood {
    /// Calls whose headers were sent.
    sent: u32,
    /// Streams the server reset (refused past its cap on open calls).
    reset: u32,
    /// Calls the server answered whole (a response that ends its stream).
    answered: u32,
    /// Whether the server said GOAWAY.
    goaway: bool,
}

/// Opens a connection to `addr` and sends `calls` calls' headers (with `authorization`),
/// never a body, without waiting for anything; reads what the server sends until it closes
/// or has sent nothing for `quiet`.
fn flood(addr: SocketAddr, calls: u32, authorization: Option<&str>, quiet: Duration) -> Flood {
    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    raw::write(&mut tcp, &raw::preface()).unwrap();
    let mut reader = tcp.try_clone().unwrap();
    reader.set_read_timeout(Some(quiet)).unwrap();
    // The server's SETTINGS, acknowledged.
    loop {
        let (kind, flags, _, _) = raw::read_frame(&mut reader).unwrap();
        if kind == raw::SETTINGS && flags & 1 == 0 {
            break;
        }
    }
    raw::write(&mut tcp, &raw::frame(raw::SETTINGS, 1, 0, &[])).unwrap();
    let read = std::thread::spawn(move || {
        let mut seen = Flood::default();
        while let Ok((kind, flags, _, _)) = raw::read_frame(&mut reader) {
            match kind {
                raw::RST_STREAM => seen.reset += 1,
                raw::GOAWAY => seen.goaway = true,
                raw::HEADERS | raw::DATA if flags & raw::END_STREAM != 0 => seen.answered += 1,
                _ => {}
            }
        }
        seen
    });
    let mut sent = 0;
    let mut batch = Vec::new();
    for i in 0..calls {
        batch.extend(raw::call(2 * i + 1, authorization));
        if batch.len() > 16 * 1024 || i + 1 == calls {
            if tcp.write_all(&batch).is_err() {
                break; // the server closed the connection
            }
            sent = i + 1;
            batch.clear();
        }
    }
    let mut seen = read.join().unwrap();
    seen.sent = sent;
    seen
}

/// Three connections of 30,000 calls each that send their headers and never a body: each
/// connection is held to 256 open calls (the rest reset; after many resets the connection is
/// told GOAWAY and closed), the held calls are answered at their deadline, and the server's
/// memory stays within a bound of where it started (before this cap, such a flood took it
/// from 41 MB to 1.1 GB).
#[test]
fn a_flood_of_calls_without_bodies_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "bodyTimeout = \"1s\"", None);
    let rls = served.rls.unwrap();
    let before = served.rss();
    let floods: Vec<_> = (0..3)
        .map(|_| std::thread::spawn(move || flood(rls, 30_000, None, Duration::from_secs(5))))
        .collect();
    let mut peak = before;
    while !floods.iter().all(std::thread::JoinHandle::is_finished) {
        peak = peak.max(served.rss());
        std::thread::sleep(Duration::from_millis(20));
    }
    let floods: Vec<Flood> = floods.into_iter().map(|f| f.join().unwrap()).collect();
    for f in &floods {
        // Refused past the cap, with resets or GOAWAY; what was held is answered.
        assert!(f.reset > 0 || f.goaway, "{f:?}");
        assert!(f.answered <= 256, "{f:?}");
    }
    let grown = peak.saturating_sub(before);
    eprintln!("flood: {floods:?}; memory {before} -> peak {peak} (+{grown} bytes)");
    assert!(grown < 48 << 20, "the server grew by {grown} bytes under the flood");
    // And it still serves: a whole call is answered.
    let answered = call(rls, None, true);
    assert_eq!(answered.grpc_status.as_deref(), Some("0"), "{answered:?}");
}

/// Calls held open over many connections (each under its own cap) are bounded too: past
/// 1,024 open at once, a call is answered RESOURCE_EXHAUSTED at once.
#[test]
fn calls_held_over_many_connections_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "bodyTimeout = \"10s\"", None);
    let rls = served.rls.unwrap();
    let before = served.rss();
    // 20 connections of 250 calls: 5,000 held, 3,976 past the bound.
    let floods: Vec<Flood> = (0..20)
        .map(|_| std::thread::spawn(move || flood(rls, 250, None, Duration::from_secs(2))))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|f| f.join().unwrap())
        .collect();
    let answered: u32 = floods.iter().map(|f| f.answered).sum();
    assert_eq!(answered, 5_000 - 1_024, "{floods:?}");
    let grown = served.rss().saturating_sub(before);
    eprintln!("held calls: memory {before} -> {} (+{grown} bytes)", before + grown);
    // Measured: about 38 MB for the 1,024 held (and the 20 connections).
    assert!(grown < 64 << 20, "the server grew by {grown} bytes");
}

/// The answer to one call by the `h2` crate's client.
#[derive(Debug)]
struct Answered {
    grpc_status: Option<String>,
    message: Option<String>,
    took: Duration,
}

/// One call on a connection of its own: its headers (with `authorization`), and its body
/// if `body` (a request for `user=alice` in domain `edge`), else none ever.
fn call(addr: SocketAddr, authorization: Option<&str>, body: bool) -> Answered {
    // RateLimitRequest { domain: "edge", descriptors: [{ entries: [{ "user", "alice" }] }] }
    let entry = [&[0x0a, 4][..], b"user", &[0x12, 5], b"alice"].concat();
    let descriptor = [&[0x0a, entry.len() as u8][..], &entry].concat();
    let message = [&[0x0a, 4][..], b"edge", &[0x12, descriptor.len() as u8], &descriptor].concat();
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let metadata: Vec<_> = authorization.iter().map(|value| ("authorization", *value)).collect();
    let answer = common::grpc_call(addr, path, &metadata, body.then_some(&message[..]));
    Answered {
        grpc_status: answer.field("grpc-status").map(decoded),
        message: answer.field("grpc-message").map(decoded),
        took: answer.took,
    }
}

/// A `grpc-message` with its percent-encoding undone.
fn decoded(text: &str) -> String {
    let mut out = Vec::new();
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex: String = bytes.by_ref().take(2).map(char::from).collect();
            out.push(u8::from_str_radix(&hex, 16).unwrap());
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).unwrap()
}

/// A call that sends its headers and no body is answered DEADLINE_EXCEEDED at its deadline
/// (bodyTimeout + storeDeadline: 1.25 s here), not held.
#[test]
fn a_call_without_its_body_is_answered_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "bodyTimeout = \"1s\"", None);
    let held = call(served.rls.unwrap(), None, false);
    assert_eq!(held.grpc_status.as_deref(), Some("4"), "{held:?}"); // DEADLINE_EXCEEDED
    assert!(held.took >= Duration::from_millis(1_200) && held.took < Duration::from_secs(5));
}

/// With tokens, a call without a good one is refused on its headers, at once: before its
/// body (which never comes) would be read. The flood of such calls holds nothing.
#[test]
fn with_tokens_a_call_is_refused_on_its_headers() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "tokens = [\"s3cret\"]\nbodyTimeout = \"5s\"", None);
    let rls = served.rls.unwrap();
    for (authorization, message) in [
        (None, "send one authorization: Bearer <token> (none, or more than one, was sent)"),
        (Some("Basic czNjcmV0"), "expected authorization: Bearer <token>"),
        (Some("Bearer wrong"), "wrong bearer token"),
    ] {
        let refused = call(rls, authorization, false);
        assert_eq!(refused.grpc_status.as_deref(), Some("16"), "{refused:?}"); // UNAUTHENTICATED
        assert_eq!(refused.message.as_deref(), Some(message));
        assert!(refused.took < Duration::from_secs(2), "{refused:?}");
    }
    assert_eq!(call(rls, Some("Bearer s3cret"), true).grpc_status.as_deref(), Some("0"));
    let before = served.rss();
    let flooded = flood(rls, 20_000, None, Duration::from_secs(2));
    // Each refused as it came: answered, not held (some may be reset once the client is
    // told to calm down).
    assert!(flooded.answered + flooded.reset >= flooded.sent.min(1_000), "{flooded:?}");
    let grown = served.rss().saturating_sub(before);
    assert!(grown < 32 << 20, "the server grew by {grown} bytes: {flooded:?}");
}

/// Whether the server has closed `tcp`, as of now: it reads EOF or a reset (rather than
/// nothing yet). Anything it sent (SETTINGS, GOAWAY) is read past.
fn closed(mut tcp: &TcpStream) -> bool {
    tcp.set_nonblocking(true).unwrap();
    let mut chunk = [0; 256];
    let closed = loop {
        match tcp.read(&mut chunk) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e) => break e.kind() != std::io::ErrorKind::WouldBlock,
        }
    };
    tcp.set_nonblocking(false).unwrap();
    closed
}

/// How many of `connections` are still open after waiting `wait`.
fn open_after(connections: &[TcpStream], wait: Duration) -> usize {
    std::thread::sleep(wait);
    connections.iter().filter(|tcp| !closed(tcp)).count()
}

/// `maxConnections` and `headerTimeout` hold on the rate limit service's port as on the
/// HTTP API's: connections past the cap are closed at once, one that sends nothing is
/// closed after `headerTimeout`, an HTTP/2 connection idle that long is told GOAWAY and
/// closed; the HTTP API answers throughout.
#[test]
fn idle_connections_to_the_rls_port_are_capped_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "maxConnections = 20\nheaderTimeout = \"1s\"", None);
    let rls = served.rls.unwrap();
    let idle: Vec<TcpStream> = (0..60).map(|_| TcpStream::connect(rls).unwrap()).collect();
    // 40 are over the cap: closed at once.
    assert_eq!(open_after(&idle, Duration::from_millis(300)), 20);
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let health = agent.get(&format!("http://{}/healthz", served.http)).call().unwrap();
    assert_eq!(health.status(), 200);
    // The other 20 said nothing: closed after the header timeout.
    assert_eq!(open_after(&idle, Duration::from_millis(1_500)), 0);
    // A connection that made its HTTP/2 start and then idles: GOAWAY (and a PING, answered
    // as a client does), then closed.
    let mut tcp = TcpStream::connect(rls).unwrap();
    raw::write(&mut tcp, &raw::preface()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let start = Instant::now();
    let mut goaway = false;
    while let Ok((kind, flags, _, payload)) = raw::read_frame(&mut tcp) {
        if kind == raw::SETTINGS && flags & 1 == 0 {
            raw::write(&mut tcp, &raw::frame(raw::SETTINGS, 1, 0, &[])).unwrap();
        }
        if kind == raw::PING && flags & 1 == 0 {
            raw::write(&mut tcp, &raw::frame(raw::PING, 1, 0, &payload)).unwrap();
        }
        goaway |= kind == raw::GOAWAY;
    }
    assert!(goaway, "no GOAWAY");
    assert!(start.elapsed() < Duration::from_secs(4), "closed after {:?}", start.elapsed());
}

/// A process allowed 200 open files: both listeners' caps are fitted into that (with a
/// warning at start), so filling the rate limit service's port never runs the process out
/// of file descriptors, and the HTTP API still answers.
#[test]
fn a_low_open_files_limit_caps_connections_and_the_http_api_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "headerTimeout = \"30s\"", Some("ulimit -n 200"));
    let rls = served.rls.unwrap();
    let idle: Vec<TcpStream> = (0..150).map(|_| TcpStream::connect(rls).unwrap()).collect();
    // (200 - 64 kept for the rest) / 2 listeners = 68 each; the rest closed at once.
    assert_eq!(open_after(&idle, Duration::from_millis(300)), 68);
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    for _ in 0..5 {
        let health = agent.get(&format!("http://{}/healthz", served.http)).call().unwrap();
        assert_eq!(health.status(), 200);
    }
    let stderr = served.stderr();
    assert!(stderr.contains("each is capped at 68 connections"), "{stderr}");
    assert!(!stderr.contains("Too many open files"), "{stderr}");
}

/// What `Watch` calls on one connection got: the streams opened (their answer's headers
/// carry no `grpc-status`: the stream goes on), and the `grpc-status` of each refused one.
#[derive(Debug, Default)]
struct Watched {
    opened: usize,
    refused: Vec<String>,
}

/// Opens `n` `grpc.health.v1.Health/Watch` streams on one connection to `addr` (with
/// `authorization`), holds what opened for `hold`, and says what each got.
async fn watch(addr: SocketAddr, n: usize, authorization: Option<&str>, hold: Duration) -> Watched {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let mut answers = Vec::new();
    for _ in 0..n {
        let mut request = http::Request::post(format!("http://{addr}/grpc.health.v1.Health/Watch"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        client = client.ready().await.unwrap();
        let (response, mut stream) = client.send_request(request.body(()).unwrap(), false).unwrap();
        // An empty HealthCheckRequest: every service.
        stream.send_data(vec![0, 0, 0, 0, 0].into(), true).unwrap();
        answers.push((response, stream));
    }
    let mut seen = Watched::default();
    let mut held = Vec::new();
    for (response, stream) in answers {
        let response = tokio::time::timeout(Duration::from_secs(5), response)
            .await
            .expect("headers within 5 s")
            .unwrap();
        match response.headers().get("grpc-status") {
            Some(status) => seen.refused.push(status.to_str().unwrap().to_owned()),
            None => seen.opened += 1,
        }
        held.push((response, stream));
    }
    tokio::time::sleep(hold).await;
    seen
}

/// `Watch` streams are bounded (four a connection, 64 in all; other calls are not crowded
/// out), however many connections ask: before, 150 connections of 256 streams took the
/// server from 20 MB to 432 MB, each held until the client left.
#[test]
fn watch_streams_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "headerTimeout = \"2s\"", None);
    let rls = served.rls.unwrap();
    let before = served.rss();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let watching = runtime.spawn(async move {
        let each = (0..100).map(|_| tokio::spawn(watch(rls, 32, None, Duration::from_secs(3))));
        let mut all = Vec::new();
        for one in each.collect::<Vec<_>>() {
            all.push(one.await.unwrap());
        }
        all
    });
    let mut peak = before;
    while !watching.is_finished() {
        peak = peak.max(served.rss());
        std::thread::sleep(Duration::from_millis(50));
    }
    let all = runtime.block_on(watching).unwrap();
    let opened: usize = all.iter().map(|w| w.opened).sum();
    assert_eq!(opened, 64, "{all:?}");
    assert!(all.iter().all(|w| w.opened <= 4), "{all:?}");
    assert!(all.iter().flat_map(|w| &w.refused).all(|s| s == "8"), "RESOURCE_EXHAUSTED");
    let grown = peak.saturating_sub(before);
    eprintln!("watch streams: memory {before} -> peak {peak} (+{grown} bytes)");
    // Measured: about 19 MB, the 100 connections' own buffers mostly (64 streams are 0.7 MB).
    assert!(grown < 40 << 20, "the server grew by {grown} bytes");
    // Other calls were answered all along, and the streams, once their clients left, are
    // given back.
    assert_eq!(call(rls, None, true).grpc_status.as_deref(), Some("0"));
    let again = runtime.block_on(watch(rls, 4, None, Duration::ZERO));
    assert_eq!(again.opened, 4, "{again:?}");
}

/// With tokens, a `Watch` needs one (a read token will do); `Check`, which probes send,
/// needs none.
#[test]
fn with_tokens_a_watch_needs_one() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "tokens = [\"s3cret\"]\nreadTokens = [\"peek\"]", None);
    let rls = served.rls.unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = runtime.block_on(watch(rls, 1, None, Duration::ZERO));
    assert_eq!(refused.refused, ["16"], "UNAUTHENTICATED: {refused:?}");
    let wrong = runtime.block_on(watch(rls, 1, Some("Bearer wrong"), Duration::ZERO));
    assert_eq!(wrong.refused, ["16"], "{wrong:?}");
    for token in ["Bearer peek", "Bearer s3cret"] {
        let opened = runtime.block_on(watch(rls, 1, Some(token), Duration::ZERO));
        assert_eq!(opened.opened, 1, "{token}: {opened:?}");
    }
    let check = common::grpc_call(rls, "/grpc.health.v1.Health/Check", &[], Some(&[]));
    assert_eq!(check.field("grpc-status"), Some("0"), "{:?}", check.headers);
}

/// A connection that sends PINGs and never a call is idle all the same: told GOAWAY and
/// closed after `headerTimeout` (before, each PING counted as activity and it was kept for
/// ever).
#[test]
fn a_connection_of_pings_alone_is_idle() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "headerTimeout = \"1s\"", None);
    let mut tcp = TcpStream::connect(served.rls.unwrap()).unwrap();
    raw::write(&mut tcp, &raw::preface()).unwrap();
    let writer = tcp.try_clone().unwrap();
    let pinging = std::thread::spawn(move || {
        let mut writer = writer;
        // A PING every 200 ms for at most 10 s, until the server closes.
        for i in 0u64..50 {
            let ping = raw::frame(raw::PING, 0, 0, &i.to_be_bytes());
            if raw::write(&mut writer, &ping).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let start = Instant::now();
    let mut goaway = false;
    while let Ok((kind, flags, _, _)) = raw::read_frame(&mut tcp) {
        if kind == raw::SETTINGS && flags & 1 == 0 {
            raw::write(&mut tcp, &raw::frame(raw::SETTINGS, 1, 0, &[])).unwrap();
        }
        goaway |= kind == raw::GOAWAY;
    }
    assert!(goaway, "no GOAWAY");
    assert!(start.elapsed() < Duration::from_secs(4), "closed after {:?}", start.elapsed());
    pinging.join().unwrap();
}

/// A connection that floods PINGs, or SETTINGS, is closed within its first thousand or
/// so, answered no more than that (before, one such connection kept 0.9 of a core busy
/// answering each, and was never closed); the port serves others meanwhile.
#[test]
fn a_flood_of_pings_or_settings_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "headerTimeout = \"30s\"", None);
    let rls = served.rls.unwrap();
    for (what, kind, payload) in
        [("PING", raw::PING, &[7u8; 8][..]), ("SETTINGS", raw::SETTINGS, &[])]
    {
        let mut tcp = TcpStream::connect(rls).unwrap();
        raw::write(&mut tcp, &raw::preface()).unwrap();
        let frame = raw::frame(kind, 0, 0, payload);
        let batch: Vec<u8> = std::iter::repeat_n(frame, 500).flatten().collect();
        let start = Instant::now();
        let mut sent = 0;
        // 100,000 frames, as fast as the connection takes them (at most 10 s).
        while sent < 100_000 && start.elapsed() < Duration::from_secs(10) {
            if tcp.write_all(&batch).is_err() {
                break; // closed
            }
            sent += 500;
        }
        // What the server sent back, until it closed (EOF or a reset; not a read timeout).
        tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answers = 0;
        let ended = loop {
            match raw::read_frame(&mut tcp) {
                Ok((k, flags, _, _)) => answers += usize::from(k == kind && flags & 1 == 1),
                Err(e) => break e.kind(),
            }
        };
        eprintln!("{what} flood: {sent} sent, {answers} answered, then {ended:?}");
        assert!(
            matches!(
                ended,
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ),
            "{what}: the connection was not closed ({ended:?})"
        );
        assert!(answers <= 2_000, "{what}: {answers} answered");
        assert_eq!(call(rls, None, true).grpc_status.as_deref(), Some("0"));
    }
}

/// Makes an HTTP/2 start on a new connection to `addr` (the preface, the server's SETTINGS
/// acknowledged), then writes `bytes` one at a time, `gap` apart, until the server closes
/// the connection or all are sent. Returns how many bytes went, and when the server closed
/// (from the first byte), if it did before the bytes ran out.
fn trickle(addr: SocketAddr, bytes: &[u8], gap: Duration) -> (usize, Option<Duration>) {
    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    raw::write(&mut tcp, &raw::preface()).unwrap();
    let mut reader = tcp.try_clone().unwrap();
    reader.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    loop {
        let (kind, flags, _, _) = raw::read_frame(&mut reader).unwrap();
        if kind == raw::SETTINGS && flags & 1 == 0 {
            break;
        }
    }
    raw::write(&mut tcp, &raw::frame(raw::SETTINGS, 1, 0, &[])).unwrap();
    let start = Instant::now();
    let read = std::thread::spawn(move || {
        while raw::read_frame(&mut reader).is_ok() {}
        start.elapsed()
    });
    let mut sent = 0;
    for byte in bytes {
        if read.is_finished() || raw::write(&mut tcp, &[*byte]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(gap);
    }
    let trickled_all = sent == bytes.len();
    let _ = tcp.shutdown(std::net::Shutdown::Both);
    let closed = read.join().unwrap();
    (sent, (!trickled_all).then_some(closed))
}

/// The shape of the Redis protocol's trickled command, on this port: a call's HEADERS frame
/// sent a byte every 100 ms (a call never starts, so the connection is idle: GOAWAY and
/// closed within two header timeouts and the grace after, not when the bytes run out), and
/// a call's body sent as DATA frames of one byte each, 100 ms apart (answered
/// DEADLINE_EXCEEDED at bodyTimeout + storeDeadline from its start, however often bytes
/// come). Neither restarts its clock with each read.
#[test]
fn trickled_headers_and_bodies_are_cut() {
    let dir = tempfile::tempdir().unwrap();
    let served = start(dir.path(), "headerTimeout = \"1s\"\nbodyTimeout = \"1s\"", None);
    let rls = served.rls.unwrap();
    let headers = raw::call(1, None);
    let (sent, closed) = trickle(rls, &headers, Duration::from_millis(100));
    let closed = closed.unwrap_or_else(|| panic!("all {sent} bytes of HEADERS taken"));
    eprintln!("HEADERS trickled: closed after {closed:?}, {sent} of {} bytes", headers.len());
    assert!(closed < Duration::from_secs(4), "closed after {closed:?}");

    // The body: the call's headers whole, then its message (45 bytes) a byte per DATA frame,
    // one every 100 ms, by the h2 crate's client.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (status, took) = runtime.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(rls).await.unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(connection);
        let mut client = client.ready().await.unwrap();
        let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
        let request = http::Request::post(format!("http://{rls}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let start = Instant::now();
        let (response, mut stream) = client.send_request(request, false).unwrap();
        let message = [&[0u8, 0, 0, 0, 40][..], &[0x0a; 40]].concat();
        let trickling = tokio::spawn(async move {
            for byte in message {
                if stream.send_data(vec![byte].into(), false).is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let response = tokio::time::timeout(Duration::from_secs(10), response).await;
        let took = start.elapsed();
        trickling.abort();
        let response = response.expect("an answer within 10 s").unwrap();
        let status = response.headers().get("grpc-status").map(|v| v.to_str().unwrap().to_owned());
        (status, took)
    });
    eprintln!("a body trickled: answered {status:?} after {took:?}");
    assert_eq!(status.as_deref(), Some("4"), "not DEADLINE_EXCEEDED after {took:?}");
    assert!(
        took >= Duration::from_millis(1_200) && took < Duration::from_millis(2_500),
        "answered after {took:?}"
    );
}
