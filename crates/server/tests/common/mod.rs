//! What the server's test files share. Each uses some of it.
#![allow(dead_code)]

/// The URL of a backend server, from the environment variable `var`. Unset: the caller skips,
/// and this says so (past libtest's capture, so that a skip is visible), unless
/// `TOLLGATE_REQUIRE_BACKENDS=1` (as in CI), which makes a missing backend a failure.
pub(crate) fn backend(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
            panic!("{var} is not set, and TOLLGATE_REQUIRE_BACKENDS=1 requires it")
        }
        _ => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "skipped a {var} test: set {var} to run it");
            None
        }
    }
}

/// Whether `redis-server` is installed, for tests that start their own; without it the
/// caller skips, and this says so, unless `TOLLGATE_REQUIRE_BACKENDS=1` (as in CI), which
/// makes it a failure.
pub(crate) fn redis_server_available() -> bool {
    let found = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") {
        panic!("redis-server is not installed, and TOLLGATE_REQUIRE_BACKENDS=1 requires this test");
    }
    if !found {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "skipped: redis-server is not installed");
    }
    found
}

/// A loopback port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The value of the Prometheus sample `series` (a name, with its labels if it has any) in the
/// exposition `text`.
pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in {text}"))
}

/// The answer to one gRPC call by the `h2` crate's client ([`grpc_call`]).
#[derive(Debug)]
pub(crate) struct GrpcAnswer {
    /// The answer's header fields (a trailers-only answer's status is here).
    pub(crate) headers: http::HeaderMap,
    /// Its body, the frames as sent.
    pub(crate) body: Vec<u8>,
    /// Its trailers, if any.
    pub(crate) trailers: http::HeaderMap,
    /// From the call's headers sent to the answer's received.
    pub(crate) took: std::time::Duration,
}

impl GrpcAnswer {
    /// A field of the trailers, or of the headers of a trailers-only answer.
    pub(crate) fn field(&self, name: &str) -> Option<&str> {
        let value = self.trailers.get(name).or_else(|| self.headers.get(name));
        value.map(|v| v.to_str().unwrap())
    }
}

/// One gRPC call on an HTTP/2 connection of its own to `addr`: `path` with `metadata`
/// (`authorization`, `traceparent`) and `message` framed as its body, or with `None` no body
/// ever; answered within 10 s.
pub(crate) fn grpc_call(
    addr: std::net::SocketAddr,
    path: &str,
    metadata: &[(&str, &str)],
    message: Option<&[u8]>,
) -> GrpcAnswer {
    use std::time::{Duration, Instant};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(connection);
        let mut client = client.ready().await.unwrap();
        let mut request = http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in metadata {
            request = request.header(*name, *value);
        }
        let start = Instant::now();
        let (response, mut stream) = client.send_request(request.body(()).unwrap(), false).unwrap();
        if let Some(message) = message {
            let mut framed = vec![0];
            framed.extend((message.len() as u32).to_be_bytes());
            framed.extend(message);
            stream.send_data(framed.into(), true).unwrap();
        }
        let response = tokio::time::timeout(Duration::from_secs(10), response)
            .await
            .expect("an answer within 10 s")
            .unwrap();
        let took = start.elapsed();
        let headers = response.headers().clone();
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.unwrap().unwrap_or_default();
        GrpcAnswer { headers, body: bytes, trailers, took }
    })
}

/// A rate limit service config: domain `edge`, `user` at 3 a minute.
pub(crate) const RLS_CONFIG: &str = "
domain: edge
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 3
";

/// `tollgate serve` on the memory store in a process of its own, with [`RLS_CONFIG`] (and
/// the rate limit service's port with `rls_listens`) and `server` as its config file's
/// `[server]` table, both written in `dir`; `shell`, if any, runs first in bash (a `ulimit`).
pub(crate) fn serve_memory(
    dir: &std::path::Path,
    server: &str,
    rls_listens: bool,
    shell: Option<&str>,
) -> Served {
    let rls = dir.join("rls.yaml");
    std::fs::write(&rls, RLS_CONFIG).unwrap();
    let config = dir.join("tollgate.toml");
    std::fs::write(&config, format!("[server]\n{server}\n")).unwrap();
    let binary = env!("CARGO_BIN_EXE_tollgate");
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--store", "memory"];
    if rls_listens {
        args.extend(["--rls-listen", "127.0.0.1:0"]);
    }
    args.extend(["--rls-config", rls.to_str().unwrap(), "--config", config.to_str().unwrap()]);
    let mut command = match shell {
        None => std::process::Command::new(binary),
        Some(before) => {
            let mut command = std::process::Command::new("bash");
            command.arg("-c").arg(format!("{before} && exec \"$0\" \"$@\"")).arg(binary);
            command
        }
    };
    command.args(args);
    Served::start(command, rls_listens)
}

/// A `tollgate serve` in a process of its own, killed when dropped: its addresses from its
/// banner, and what it writes to stderr so far.
pub(crate) struct Served {
    pub(crate) child: std::process::Child,
    /// The HTTP API's address.
    pub(crate) http: std::net::SocketAddr,
    /// The rate limit service's address, if it serves one.
    pub(crate) rls: Option<std::net::SocketAddr>,
    /// The banner's lines, up to `auth:` (or `rls:`).
    pub(crate) banner: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    /// The thread that reads stderr: it ends when the server has exited and its pipe is read
    /// whole.
    stderr_reader: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    /// Runs `command` (a `tollgate serve` with `--listen 127.0.0.1:0`, and with `rls`
    /// `--rls-listen 127.0.0.1:0`) and waits for its banner.
    pub(crate) fn start(mut command: std::process::Command, rls_listens: bool) -> Served {
        use std::io::{BufRead, BufReader, Read};
        use std::process::Stdio;
        let mut child =
            command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("tollgate runs");
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let collected = std::sync::Arc::clone(&stderr);
        let stderr_reader = std::thread::spawn(move || {
            let mut chunk = [0; 4096];
            while let Ok(n @ 1..) = err.read(&mut chunk) {
                collected.lock().unwrap().push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mut http, mut rls) = (None, None);
        let (mut line, mut banner) = (String::new(), String::new());
        while out.read_line(&mut line).unwrap_or(0) > 0 {
            banner.push_str(&line);
            if let Some(addr) = line.trim().strip_prefix("tollgate listening on http://") {
                http = Some(addr.parse().unwrap());
            }
            if let Some(rest) = line.trim().strip_prefix("rls:") {
                let addr = rest.trim().strip_prefix("grpc://").unwrap().split(' ').next();
                rls = Some(addr.unwrap().parse().unwrap());
            }
            if (line.starts_with("  auth:") && !rls_listens) || line.starts_with("  rls:") {
                break;
            }
            line.clear();
        }
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let Some(http) = http else {
            let _ = child.kill();
            let _ = child.wait();
            std::thread::sleep(std::time::Duration::from_millis(100));
            panic!("no banner; stderr: {}", stderr.lock().unwrap());
        };
        Served { child, http, rls, banner, stderr, stderr_reader: Some(stderr_reader) }
    }

    /// `POST path` with `headers` and the JSON `body`: the status, and the JSON answer
    /// (`null` if it is not JSON).
    pub(crate) fn post(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut request = agent.post(&format!("http://{}{path}", self.http));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut response = request.send_json(body).unwrap();
        let answer = response.body_mut().read_json().unwrap_or(serde_json::Value::Null);
        (response.status().as_u16(), answer)
    }

    /// What the server wrote to stderr so far.
    pub(crate) fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// All the server wrote to stderr, once it has exited (`child.wait()`): its last lines
    /// may still be in the pipe when `wait` returns, so this waits for them.
    pub(crate) fn stderr_at_exit(&mut self) -> String {
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
        self.stderr()
    }

    /// Its resident memory, in bytes (Linux).
    pub(crate) fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .expect("VmRSS");
        kb * 1024
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a client that wrote `head` whole, then trickled `bytes` one at a time `gap` apart,
/// saw: how many of `bytes` it sent before the server closed the connection, the time from
/// the first of them to the close, and what the server sent. (Once every byte is sent it
/// says it is done writing, so that a server that answers still closes.)
pub(crate) struct Trickled {
    pub(crate) sent: usize,
    pub(crate) closed_after: std::time::Duration,
    pub(crate) got: String,
}

/// See [`Trickled`]: a request's head, a Redis command, trickled to `addr`.
pub(crate) fn trickle(addr: &str, head: &[u8], bytes: &[u8], gap: std::time::Duration) -> Trickled {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp.write_all(head).unwrap();
    let mut reader = tcp.try_clone().unwrap();
    reader.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let start = std::time::Instant::now();
    let reading = std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = reader.read_to_end(&mut got);
        (start.elapsed(), String::from_utf8_lossy(&got).into_owned())
    });
    let mut sent = 0;
    for byte in bytes {
        if reading.is_finished() || tcp.write_all(&[*byte]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(gap);
    }
    let _ = tcp.shutdown(std::net::Shutdown::Write);
    let (closed_after, got) = reading.join().unwrap();
    Trickled { sent, closed_after, got }
}
