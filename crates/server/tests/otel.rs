//! Tracing with OpenTelemetry, against the built binary: the spans `tollgate serve` exports
//! over OTLP/HTTP, read by a receiver of the test's own on loopback; and, without an
//! endpoint, that nothing is sent at all.
#![cfg(feature = "otel")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;
use serde_json::json;

/// One request to a receiver, as it came.
struct Export {
    path: String,
    content_type: String,
    body: Vec<u8>,
}

/// What an OTLP/HTTP receiver was sent: each export request, and how many connections were
/// opened to it.
#[derive(Clone, Default)]
struct Received {
    exports: Arc<Mutex<Vec<Export>>>,
    connections: Arc<AtomicUsize>,
}

/// An OTLP/HTTP receiver on `listener`: it answers every request 200 with an empty
/// `ExportTraceServiceResponse`, keeping what it was sent.
fn receive(listener: TcpListener) -> Received {
    let received = Received::default();
    let kept = received.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            kept.connections.fetch_add(1, Ordering::SeqCst);
            let kept = kept.clone();
            std::thread::spawn(move || {
                let _ = answer_exports(stream, &kept);
            });
        }
    });
    received
}

/// Reads HTTP/1.1 requests on `stream` until it closes, answering each.
fn answer_exports(stream: TcpStream, received: &Received) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let path = request_line.split(' ').nth(1).unwrap_or("").to_owned();
        let (mut length, mut content_type) = (0, String::new());
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "content-type" => value.trim().clone_into(&mut content_type),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        received.exports.lock().unwrap().push(Export { path, content_type, body });
        writer.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        )?;
    }
}

/// One exported span, with what the test looks at.
#[derive(Debug)]
struct Span {
    name: String,
    kind: i32,
    trace_id: String,
    parent_span_id: String,
    attributes: Vec<KeyValue>,
    service: Option<String>,
}

impl Span {
    fn attribute(&self, key: &str) -> Option<&Any> {
        self.attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()
    }

    fn text(&self, key: &str) -> &str {
        match self.attribute(key) {
            Some(Any::StringValue(s)) => s,
            other => panic!("{key} is {other:?} in {self:?}"),
        }
    }
}

fn text_of(value: &Option<AnyValue>) -> Option<String> {
    match value.as_ref()?.value.as_ref()? {
        Any::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every span in what was received so far.
fn spans(received: &Received) -> Vec<Span> {
    let exports = received.exports.lock().unwrap();
    let mut spans = Vec::new();
    for Export { path, content_type, body } in exports.iter() {
        assert_eq!(path, "/v1/traces");
        assert_eq!(content_type, "application/x-protobuf");
        let export = ExportTraceServiceRequest::decode(&body[..]).expect("an OTLP export");
        for resource in export.resource_spans {
            let service = resource.resource.as_ref().and_then(|r| {
                r.attributes
                    .iter()
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| text_of(&kv.value))
            });
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(Span {
                        name: span.name,
                        kind: span.kind,
                        trace_id: hex(&span.trace_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: span.attributes,
                        service: service.clone(),
                    });
                }
            }
        }
    }
    spans
}

/// `tollgate serve` on the memory store in `dir`, with limits `api` (2 a minute) and `other`,
/// the rate limit service of [`common::RLS_CONFIG`] on both its ports, and of the `OTEL_*`
/// variables only `otel`.
fn serve(dir: &std::path::Path, otel: &[(&str, &str)]) -> common::Served {
    let config = dir.join("tollgate.toml");
    std::fs::write(
        &config,
        "[limits.api]\nkind = \"token bucket\"\nrate = 2\nperiod = \"1m\"\ncapacity = 2\n\n\
         [limits.other]\nkind = \"fixed window\"\nrate = 10\nperiod = \"1m\"\n",
    )
    .unwrap();
    let rls = dir.join("rls.yaml");
    std::fs::write(&rls, common::RLS_CONFIG).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--rls-listen", "127.0.0.1:0", "--store"])
        .args(["memory", "--config", config.to_str().unwrap(), "--rls-config"])
        .arg(&rls)
        .env("RUST_LOG", "info");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    command.envs(otel.iter().copied());
    common::Served::start(command, true)
}

/// `ShouldRateLimit` for `user=alice` in domain `edge`, with `traceparent`.
fn should_rate_limit(served: &common::Served, traceparent: &str) -> common::GrpcAnswer {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let entry = Entry { key: "user".into(), value: "alice".into() };
    let descriptor = RateLimitDescriptor { entries: vec![entry], ..Default::default() };
    let request =
        RateLimitRequest { domain: "edge".into(), descriptors: vec![descriptor], hits_addend: 0 };
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let metadata = [("traceparent", traceparent)];
    common::grpc_call(served.rls.unwrap(), path, &metadata, Some(&request.encode_to_vec()))
}

const TRACE: [&str; 4] = [
    "0af7651916cd43dd8448eb211c80319c",
    "4bf92f3577b34da6a3ce929d0e0e4736",
    "5bf92f3577b34da6a3ce929d0e0e4737",
    "6bf92f3577b34da6a3ce929d0e0e4738",
];
const PARENT: &str = "b7ad6b7169203331";

fn traceparent(trace: &str) -> String {
    format!("00-{trace}-{PARENT}-01")
}

/// Each rate-limit request is one span, exported to `OTEL_EXPORTER_OTLP_ENDPOINT`: a child of
/// the caller's span when it sent `traceparent` (over HTTP and gRPC metadata alike), with its
/// operation, limit names, outcome and time in the store.
#[test]
fn each_request_is_one_span_in_the_callers_trace() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let received = receive(listener);
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{addr}");
    let served = serve(
        dir.path(),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    assert!(
        served.banner.contains(&format!("traces: {endpoint}/v1/traces (OTLP/HTTP, http/protobuf)")),
        "{}",
        served.banner
    );

    let first = traceparent(TRACE[0]);
    let alice = json!({ "name": "api", "key": "alice" });
    let granted: Vec<bool> = (0..3)
        .map(|_| {
            served.post("/v1/limit", &[("traceparent", &first)], &alice).1["ok"].as_bool().unwrap()
        })
        .collect();
    assert_eq!(granted, [true, true, false]);
    let both =
        json!({ "limits": [{ "name": "api", "key": "bob" }, { "name": "other", "key": "bob" }] });
    let second = traceparent(TRACE[1]);
    assert_eq!(served.post("/v1/transaction", &[("traceparent", &second)], &both).0, 200);
    assert_eq!(served.post("/v1/limit", &[], &json!({ "name": "nope" })).0, 404);
    let answer = should_rate_limit(&served, &traceparent(TRACE[2]));
    assert_eq!(answer.field("grpc-status"), Some("0"), "{answer:?}");
    let envoy = json!({ "domain": "edge", "descriptors": [{ "entries": [{ "key": "user", "value": "carol" }] }] });
    assert_eq!(served.post("/json", &[("traceparent", &traceparent(TRACE[3]))], &envoy).0, 200);

    // The batch is sent every 100 ms.
    let start = Instant::now();
    while spans(&received).len() < 7 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let spans = spans(&received);
    assert_eq!(spans.len(), 7, "one span per request: {spans:#?}");
    for span in &spans {
        assert_eq!(span.kind, SpanKind::Server as i32, "{span:?}");
        assert_eq!(span.service.as_deref(), Some("tollgate"), "{span:?}");
        match span.attribute("tollgate.store_ms") {
            Some(Any::DoubleValue(ms)) => assert!((0.0..10_000.0).contains(ms), "{span:?}"),
            other => panic!("tollgate.store_ms is {other:?}"),
        }
    }
    let of = |trace: &str| spans.iter().filter(|s| s.trace_id == trace).collect::<Vec<_>>();

    let limits = of(TRACE[0]);
    assert_eq!(limits.len(), 3, "{spans:#?}");
    let mut oks = Vec::new();
    for span in &limits {
        assert_eq!(span.name, "POST /v1/limit");
        assert_eq!(span.parent_span_id, PARENT);
        assert_eq!(span.text("tollgate.operation"), "limit");
        assert_eq!(span.text("tollgate.limits"), "api");
        assert_eq!(span.attribute("http.response.status_code"), Some(&Any::IntValue(200)));
        match span.attribute("tollgate.granted") {
            Some(Any::BoolValue(ok)) => oks.push(*ok),
            other => panic!("tollgate.granted is {other:?}"),
        }
        let outcome = if oks.last() == Some(&true) { "ok" } else { "refused" };
        assert_eq!(span.text("tollgate.outcome"), outcome);
    }
    oks.sort();
    assert_eq!(oks, [false, true, true]);

    let [transaction] = of(TRACE[1])[..] else { panic!("{spans:#?}") };
    assert_eq!(transaction.name, "POST /v1/transaction");
    assert_eq!(transaction.parent_span_id, PARENT);
    assert_eq!(transaction.text("tollgate.limits"), "api,other");
    assert_eq!(transaction.attribute("tollgate.granted"), Some(&Any::BoolValue(true)));

    let [grpc] = of(TRACE[2])[..] else { panic!("{spans:#?}") };
    assert_eq!(grpc.name, "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    assert_eq!(grpc.parent_span_id, PARENT);
    assert_eq!(grpc.text("tollgate.operation"), "should_rate_limit");
    assert_eq!(grpc.text("tollgate.domain"), "edge");
    assert_eq!(grpc.text("tollgate.outcome"), "ok");
    assert_eq!(grpc.attribute("rpc.grpc.status_code"), Some(&Any::IntValue(0)));
    assert!(!grpc.text("tollgate.limits").is_empty(), "{grpc:?}");

    let [json] = of(TRACE[3])[..] else { panic!("{spans:#?}") };
    assert_eq!(json.name, "POST /json");
    assert_eq!(json.text("tollgate.domain"), "edge");
    assert_eq!(json.attribute("http.response.status_code"), Some(&Any::IntValue(200)));

    // Without a traceparent, a trace of its own.
    let known = |s: &&Span| TRACE.contains(&s.trace_id.as_str());
    let [unknown] = spans.iter().filter(|s| !known(s)).collect::<Vec<_>>()[..] else {
        panic!("{spans:#?}")
    };
    assert_eq!(unknown.name, "POST /v1/limit");
    assert_eq!(unknown.parent_span_id, "");
    assert_eq!(unknown.text("tollgate.outcome"), "not_defined");
    assert_eq!(unknown.attribute("http.response.status_code"), Some(&Any::IntValue(404)));
}

/// A Redis protocol command is a span too: named for its command, with the operation, the
/// protocol, the outcome and the time in the store.
#[test]
fn each_redis_command_is_one_span() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let received = receive(listener);
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{addr}");
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, "[limits.api]\nkind = \"token bucket\"\nrate = 1\nperiod = \"1m\"\n")
        .unwrap();
    let resp = format!("127.0.0.1:{}", common::free_port());
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--resp-listen", &resp])
        .args(["--config", config.to_str().unwrap()]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    command.envs([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let _served = common::Served::start(command, false);
    let mut redis = TcpStream::connect(&resp).unwrap();
    redis
        .write_all(b"CL.THROTTLE k 1 1 60\r\nTG.LIMIT api KEY k\r\nTG.LIMIT api KEY k\r\nPING\r\n")
        .unwrap();
    let mut replies = BufReader::new(redis);
    let mut last = String::new();
    while last != "+PONG\r\n" {
        last.clear();
        replies.read_line(&mut last).unwrap();
    }
    let start = Instant::now();
    while spans(&received).len() < 3 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let spans = spans(&received);
    // PING is not an operation: no span.
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let named = |name: &str| spans.iter().filter(|s| s.name == name).collect::<Vec<_>>();
    let [throttle] = named("RESP CL.THROTTLE")[..] else { panic!("{spans:#?}") };
    assert_eq!(throttle.text("tollgate.operation"), "throttle");
    assert_eq!(throttle.text("tollgate.protocol"), "resp");
    assert_eq!(throttle.text("tollgate.outcome"), "ok");
    assert!(matches!(throttle.attribute("tollgate.store_ms"), Some(Any::DoubleValue(_))));
    let mut outcomes: Vec<&str> = named("RESP TG.LIMIT")
        .iter()
        .map(|s| {
            assert_eq!(s.text("tollgate.operation"), "limit");
            assert_eq!(s.text("tollgate.limits"), "api");
            s.text("tollgate.outcome")
        })
        .collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["ok", "refused"]);
}

/// Without an endpoint nothing is exported: no connection is opened, not even to the
/// standard default (`localhost:4318`), where this test listens.
#[test]
fn without_an_endpoint_no_connection_is_attempted() {
    let listener = TcpListener::bind("127.0.0.1:4318")
        .expect("port 4318 (OTLP/HTTP's default) is free on 127.0.0.1, for this test to listen on");
    let received = receive(listener);
    // localhost may be ::1 first; listen there too where there is IPv6.
    let v6 =
        TcpListener::bind(SocketAddr::from(([0, 0, 0, 0, 0, 0, 0, 1], 4318))).ok().map(receive);
    let dir = tempfile::tempdir().unwrap();
    // The other variables, but not the endpoint.
    let served = serve(
        dir.path(),
        &[("OTEL_BSP_SCHEDULE_DELAY", "100"), ("OTEL_SERVICE_NAME", "edge-limits")],
    );
    assert!(!served.banner.contains("traces:"), "{}", served.banner);
    let alice = json!({ "name": "api", "key": "alice" });
    for _ in 0..5 {
        served.post("/v1/limit", &[("traceparent", &traceparent(TRACE[0]))], &alice);
    }
    should_rate_limit(&served, &traceparent(TRACE[1]));
    // Ten batch intervals, and a stop (which would send what is held).
    std::thread::sleep(Duration::from_secs(1));
    let pid = served.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut served = served;
    let start = Instant::now();
    while served.child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(served.child.try_wait().unwrap().is_some(), "stopped on SIGTERM");
    assert_eq!(received.connections.load(Ordering::SeqCst), 0);
    if let Some(v6) = v6 {
        assert_eq!(v6.connections.load(Ordering::SeqCst), 0);
    }
}

/// What this build cannot do is refused at start, by the name of the variable.
#[test]
fn an_unsupported_variable_stops_the_start_and_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .env_remove("TOLLGATE_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\""), "{err}");
    assert!(err.contains("http/protobuf"), "{err}");
}
