//! A loopback TCP proxy that delays every chunk by a fixed time each way: a store "a network
//! away" on one machine. It only ever connects to 127.0.0.1.
//!
//! Each proxied connection has, per direction, a reader thread that stamps every chunk it
//! reads and a writer thread that sends it on once its time has come (`std::thread::sleep`,
//! precise to tens of microseconds on Linux, where a Tokio timer rounds up to whole
//! milliseconds). Chunks keep their order; the delay adds to each, it does not hold back the
//! next one (a pipe with latency, not a slow link). A store client keeps a few connections,
//! so a few threads each.
//!
//! A proxy can be cut off ([`Proxy::cut`]) and healed ([`Proxy::heal`]), as a network
//! partition does: while cut, nothing it reads is passed on (new connections are accepted,
//! and wait too); at the heal, what waited goes on in order, as TCP's retransmissions would
//! deliver it.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running proxy: where to connect to reach the target through it.
pub struct Proxy {
    /// The proxy's own address (127.0.0.1, a free port).
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    /// Starts a proxy to `target` (a loopback address) that delays each chunk by `delay`
    /// each way. It runs until the process ends.
    ///
    /// # Panics
    ///
    /// If `target` is not a loopback address, or no port is free.
    pub fn start(target: SocketAddr, delay: Duration) -> Proxy {
        assert!(target.ip().is_loopback(), "the proxy only connects to loopback: {target}");
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let addr = listener.local_addr().expect("its address");
        let cut = Arc::new(AtomicBool::new(false));
        let cuts = Arc::clone(&cut);
        std::thread::Builder::new()
            .name("proxy-accept".into())
            .spawn(move || {
                for client in listener.incoming().flatten() {
                    let Ok(server) = TcpStream::connect(target) else { continue };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    pipe(&client, &server, delay, &cuts);
                    pipe(&server, &client, delay, &cuts);
                }
            })
            .expect("the proxy's thread");
        Proxy { addr, cut }
    }

    /// Cuts it off: nothing goes through until [`Proxy::heal`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Release);
    }

    /// Lets through again what waited, and what comes.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::Release);
    }
}

/// Forwards what `from` sends to `to`, each chunk `delay` after it was read, and none while
/// `cut`.
fn pipe(from: &TcpStream, to: &TcpStream, delay: Duration, cut: &Arc<AtomicBool>) {
    let cut = Arc::clone(cut);
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    let (chunks, timed) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 || chunks.send((Instant::now() + delay, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (due, chunk) in timed {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            while cut.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_each_way_and_keeps_the_bytes_in_order() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = echo.accept().unwrap();
            let mut buffer = [0u8; 1024];
            while let Ok(n) = conn.read(&mut buffer) {
                if n == 0 || conn.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
        });
        let delay = Duration::from_millis(20);
        let proxy = Proxy::start(target, delay);
        let mut conn = TcpStream::connect(proxy.addr).unwrap();
        let start = Instant::now();
        conn.write_all(b"hello ").unwrap();
        conn.write_all(b"world").unwrap();
        let mut got = Vec::new();
        let mut buffer = [0u8; 64];
        while got.len() < 11 {
            let n = conn.read(&mut buffer).unwrap();
            got.extend_from_slice(&buffer[..n]);
        }
        assert_eq!(got, b"hello world");
        assert!(start.elapsed() >= 2 * delay, "{:?}", start.elapsed());
    }

    #[test]
    fn a_cut_holds_everything_until_the_heal() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            while let Ok((mut conn, _)) = echo.accept() {
                std::thread::spawn(move || {
                    let mut buffer = [0u8; 1024];
                    while let Ok(n) = conn.read(&mut buffer) {
                        if n == 0 || conn.write_all(&buffer[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(target, Duration::from_millis(1));
        let mut before = TcpStream::connect(proxy.addr).unwrap();
        proxy.cut();
        let mut during = TcpStream::connect(proxy.addr).unwrap();
        before.write_all(b"one").unwrap();
        during.write_all(b"two").unwrap();
        for conn in [&before, &during] {
            conn.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        }
        let mut buffer = [0u8; 16];
        assert!(before.read(&mut buffer).is_err(), "nothing passes while cut");
        assert!(during.read(&mut buffer).is_err(), "nor on a connection made while cut");
        proxy.heal();
        for (conn, said) in [(&mut before, b"one"), (&mut during, b"two")] {
            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut got = [0u8; 3];
            conn.read_exact(&mut got).unwrap();
            assert_eq!(&got, said);
        }
    }
}
