//! The rate limit service (Envoy's RLS v3) through a tonic client, on a server started in
//! this process: matching, statuses and header fields with exact numbers, all or nothing
//! across descriptors on every store, `hits_addend`, overrides, `unlimited`, `shadow_mode`,
//! `replaces`, a failing store, tokens; and `POST /json`.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate_server::config::Settings;
use tonic::transport::Channel;

use common::backend;

/// A domain of this run's own, so that the shared stores start empty.
fn domain() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("test{}x{nanos}", std::process::id())
}

fn config(domain: &str) -> String {
    format!(
        r"
domain: {domain}
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: plan
    value: free
    rate_limit:
      name: free
      unit: hour
      requests_per_unit: 1
  - key: plan
    value: paid
    rate_limit:
      name: paid
      unit: hour
      requests_per_unit: 100
      replaces:
        - name: free
  - key: path
    value: /health
    rate_limit:
      unlimited: true
  - key: path
    value: /api*
    shadow_mode: true
    rate_limit:
      unit: day
      requests_per_unit: 1
  - key: closed
    rate_limit:
      unit: second
      requests_per_unit: 0
  - key: api_key
    rate_limits:
      - name: burst
        unit: hour
        requests_per_unit: 5
      - name: daily
        unit: day
        requests_per_unit: 3
        time_zone: Europe/Berlin
  - key: window
    rate_limit:
      name: five_minutes
      unit: minute
      unit_multiplier: 5
      requests_per_unit: 2
  - key: tenant
    descriptors:
      - key: llm
        rate_limit:
          kind: token bucket
          unit: minute
          requests_per_unit: 600
          capacity: 50
"
    )
}

struct Server {
    runtime: tokio::runtime::Runtime,
    rls: SocketAddr,
    http: tollgate_server::http::Service,
    domain: String,
}

fn start(store: &str, tokens: &[&str]) -> Server {
    let domain = domain();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rls.yaml");
    std::fs::write(&path, config(&domain)).unwrap();
    let settings = Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: store.to_owned(),
        // `read:T` is T as a read token.
        tokens: tokens
            .iter()
            .filter(|t| !t.starts_with("read:"))
            .map(|t| (*t).to_owned())
            .collect(),
        read_tokens: tokens
            .iter()
            .filter_map(|t| t.strip_prefix("read:"))
            .map(Into::into)
            .collect(),
        allow_inline_config: true,
        allow_config_override: false,
        max_keys: None,
        store_deadline: std::time::Duration::from_millis(250),
        http: tollgate_server::config::HttpLimits::default(),
        rls_listen: Some("127.0.0.1:0".parse().unwrap()),
        rls_config: Some(path),
        resp_listen: None,
        resp_throttle_name: "cl.throttle".into(),
        resp_idle_timeout: std::time::Duration::from_secs(300),
        resp_max_period: tollgate_server::config::DEFAULT_RESP_MAX_PERIOD,
        cors_origins: Vec::new(),
        allowed_hosts: Vec::new(),
        public_metrics: false,
        limits: Vec::new(),
        concurrency: Vec::new(),
        fail_open: Vec::new(),
        lease: Vec::new(),
    };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (app, _) = runtime.block_on(tollgate_server::app(&settings)).unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let rls = listener.local_addr().unwrap();
    let service = tollgate_server::rls::service::Service::new(
        Arc::clone(app.rls.as_ref().unwrap()),
        app.tokens.clone(),
        Arc::clone(&app.errors),
    );
    runtime.spawn(tollgate_server::rls::service::serve(
        listener,
        service,
        settings.http,
        std::time::Duration::from_secs(1),
        Arc::clone(&app.accept_errors),
        std::future::pending(),
        std::future::pending(),
    ));
    Server { runtime, rls, http: tollgate_server::http::router(app), domain }
}

impl Server {
    fn client(&self) -> RateLimitServiceClient<Channel> {
        let url = format!("http://{}", self.rls);
        self.runtime.block_on(async {
            // The listener is bound: the first connection succeeds.
            RateLimitServiceClient::connect(url).await.unwrap()
        })
    }

    fn ask(&self, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitResponse {
        self.try_ask(descriptors, hits).unwrap()
    }

    fn try_ask(
        &self,
        descriptors: Vec<RateLimitDescriptor>,
        hits: u32,
    ) -> Result<RateLimitResponse, tonic::Status> {
        let mut client = self.client();
        let request =
            RateLimitRequest { domain: self.domain.clone(), descriptors, hits_addend: hits };
        self.runtime.block_on(client.should_rate_limit(request)).map(tonic::Response::into_inner)
    }

    /// A request to the HTTP side: status and body.
    fn http(&self, request: axum::http::Request<axum::body::Body>) -> (u16, Vec<u8>) {
        use tower::ServiceExt as _;
        self.runtime.block_on(async {
            let response = self.http.clone().oneshot(request).await.unwrap();
            let status = response.status().as_u16();
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            (status, bytes.to_vec())
        })
    }

    fn json(&self, body: &str) -> (u16, serde_json::Value) {
        let request = axum::http::Request::post("/json")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_owned()))
            .unwrap();
        let (status, bytes) = self.http(request);
        (status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry { key: (*k).to_owned(), value: (*v).to_owned() })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn ok(code: i32) -> bool {
    code == Code::Ok as i32
}

/// The parts of a status that do not depend on the clock.
fn fixed(s: &DescriptorStatus) -> (bool, Option<RateLimit>, u32) {
    (ok(s.code), s.current_limit.clone(), s.limit_remaining)
}

fn limit(name: &str, requests_per_unit: u32, unit: i32) -> Option<RateLimit> {
    Some(RateLimit { name: name.to_owned(), requests_per_unit, unit })
}

const MINUTE: i32 = 2;
const HOUR: i32 = 3;
const DAY: i32 = 4;
const SECOND: i32 = 1;

fn header<'r>(response: &'r RateLimitResponse, name: &str) -> Option<&'r str> {
    response.response_headers_to_add.iter().find(|h| h.key == name).map(|h| h.value.as_str())
}

#[test]
fn matching_statuses_and_headers() {
    let s = start("memory", &[]);
    let d = s.domain.clone();
    let r = s.ask(vec![descriptor(&[("user", "alice")])], 0);
    assert!(ok(r.overall_code));
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 2));
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert!((1..=60).contains(&(reset.seconds + i64::from(reset.nanos > 0))), "{reset:?}");
    assert_eq!(header(&r, "RateLimit-Policy"), Some(format!("\"{d}.user\";q=3;w=60").as_str()));
    assert!(header(&r, "RateLimit").unwrap().starts_with(&format!("\"{d}.user\";r=2;t=")));
    assert_eq!(header(&r, "Retry-After"), None);
    // Each key its own state; the third take of alice empties it; the fourth is over.
    assert_eq!(s.ask(vec![descriptor(&[("user", "bob")])], 0).statuses[0].limit_remaining, 2);
    s.ask(vec![descriptor(&[("user", "alice")])], 2);
    let r = s.ask(vec![descriptor(&[("user", "alice")])], 0);
    assert!(!ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (false, limit("", 3, MINUTE), 0));
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // No match: OK, no limit; a value without a limit of its own; more entries than the tree.
    for entries in [&[("nothing", "x")][..], &[("plan", "gold")], &[("user", "a"), ("x", "y")]] {
        let r = s.ask(vec![descriptor(entries)], 0);
        assert!(ok(r.overall_code));
        assert_eq!(fixed(&r.statuses[0]), (true, None, 0), "{entries:?}");
        assert_eq!(r.statuses[0].duration_until_reset, None);
        assert!(r.response_headers_to_add.is_empty());
    }
    // Nested: tenant (key only) then llm: a token bucket of tollgate's fields.
    let r = s.ask(vec![descriptor(&[("tenant", "acme"), ("llm", "gpt")])], 40);
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 600, MINUTE), 10));
    assert_eq!(
        fixed(&s.ask(vec![descriptor(&[("tenant", "acme")])], 0).statuses[0]),
        (true, None, 0)
    );
    // An unknown domain limits nothing.
    let mut client = s.client();
    let other = RateLimitRequest {
        domain: "elsewhere".into(),
        descriptors: vec![descriptor(&[("user", "alice")])],
        hits_addend: 0,
    };
    let r = s.runtime.block_on(client.should_rate_limit(other)).unwrap().into_inner();
    assert_eq!(fixed(&r.statuses[0]), (true, None, 0));
}

#[test]
fn hits_overrides_unlimited_shadow_and_replaces() {
    let s = start("memory", &[]);
    // A descriptor's own hits_addend, 0 included (a look that takes nothing).
    let mut zero = descriptor(&[("user", "carol")]);
    zero.hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(s.ask(vec![zero], 5).statuses[0].limit_remaining, 3);
    let mut two = descriptor(&[("user", "carol")]);
    two.hits_addend = Some(UInt64Value { value: 2 });
    assert_eq!(s.ask(vec![two], 5).statuses[0].limit_remaining, 1);
    // The request's own limit for a descriptor.
    let mut own = descriptor(&[("user", "dave")]);
    own.limit = Some(RateLimitOverride { requests_per_unit: 10, unit: SECOND });
    let r = s.ask(vec![own], 4);
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 10, SECOND), 6));
    // Unlimited: never counted.
    for _ in 0..3 {
        let r = s.ask(vec![descriptor(&[("path", "/health")])], 1000);
        assert_eq!(fixed(&r.statuses[0]), (true, None, u32::MAX));
    }
    // Shadow mode: counted, over the limit, and never refuses.
    let r = s.ask(vec![descriptor(&[("path", "/api/x")])], 0);
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 1, DAY), 0));
    let r = s.ask(vec![descriptor(&[("path", "/api/x")])], 0);
    assert!(ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 1, DAY), 0));
    // replaces: the paid plan's limit removes the free one from the same request.
    let r = s.ask(vec![descriptor(&[("plan", "free")]), descriptor(&[("plan", "paid")])], 0);
    assert!(ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, None, 0));
    assert_eq!(fixed(&r.statuses[1]), (true, limit("paid", 100, HOUR), 99));
    let request = axum::http::Request::get("/metrics").body(axum::body::Body::empty()).unwrap();
    let metrics = String::from_utf8(s.http(request).1).unwrap();
    let d = &s.domain;
    for line in [
        format!(
            "tollgate_rls_hits_total{{domain=\"{d}\",descriptor=\"{d}.path_/api*\",outcome=\"shadow_mode\"}} 1"
        ),
        format!(
            "tollgate_rls_hits_total{{domain=\"{d}\",descriptor=\"{d}.path_/api*\",outcome=\"within_limit\"}} 1"
        ),
        format!(
            "tollgate_rls_hits_total{{domain=\"{d}\",descriptor=\"{d}.user\",outcome=\"total\"}} 2"
        ),
        // A request's own limit counts under its keys, apart.
        format!(
            "tollgate_rls_hits_total{{domain=\"{d}\",descriptor=\"{d}.user:own_limit\",outcome=\"total\"}} 4"
        ),
    ] {
        assert!(metrics.contains(&line), "{line} not in\n{metrics}");
    }
}

/// tollgate's `rate_limits` (a burst limit and a calendar-day cap on one descriptor, all or
/// nothing) and `unit_multiplier` (a window of 5 minutes).
fn several_limits_and_n_unit_windows(store: &str) {
    let s = start(store, &[]);
    let key = format!("k{}", s.domain);
    let ask = |hits| s.ask(vec![descriptor(&[("api_key", &key)])], hits);
    // 3 of the day's 3, 3 of the hour's 5: the status is the tighter limit's.
    let r = ask(3);
    assert!(ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, limit("daily", 3, DAY), 0));
    let fields = header(&r, "RateLimit").unwrap();
    assert!(fields.contains("\"burst\";r=2") && fields.contains("\"daily\";r=0"), "{fields}");
    let policy = header(&r, "RateLimit-Policy").unwrap();
    assert!(policy.contains("\"daily\";q=3;w=86400"), "{policy}");
    // The daily cap refuses; the burst limit would admit, and nothing is taken from it.
    let r = ask(1);
    assert!(!ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (false, limit("daily", 3, DAY), 0));
    // Until midnight in Berlin: at most a day away.
    let wait = r.statuses[0].duration_until_reset.unwrap().seconds;
    assert!(wait > 0 && wait <= 25 * 3_600, "{wait}");
    let fields = header(&r, "RateLimit").unwrap();
    assert!(fields.contains("\"burst\";r=2"), "nothing taken from the burst limit: {fields}");
    // Five-minute windows from the epoch.
    let window = || s.ask(vec![descriptor(&[("window", &key)])], 1);
    assert!(ok(window().overall_code));
    let r = window();
    assert!(ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, limit("five_minutes", 2, MINUTE), 0));
    let policy = header(&r, "RateLimit-Policy").unwrap();
    assert!(policy.contains("\"five_minutes\";q=2;w=300"), "{policy}");
    let r = window();
    assert!(!ok(r.overall_code));
    let wait = r.statuses[0].duration_until_reset.unwrap().seconds;
    assert!(wait <= 300, "{wait}");
}

#[test]
fn several_limits_and_n_unit_windows_memory() {
    several_limits_and_n_unit_windows("memory");
}

#[test]
fn several_limits_and_n_unit_windows_redis() {
    if let Some(url) = backend("TOLLGATE_REDIS_URL") {
        several_limits_and_n_unit_windows(&url);
    }
}

#[test]
fn several_limits_and_n_unit_windows_postgres() {
    if let Some(url) = backend("TOLLGATE_POSTGRES_URL") {
        several_limits_and_n_unit_windows(&url);
    }
}

/// Two descriptors, one over: nothing is taken from the other.
fn all_or_nothing(store: &str) {
    let s = start(store, &[]);
    let both = || vec![descriptor(&[("user", "erin")]), descriptor(&[("plan", "free")])];
    let r = s.ask(both(), 0);
    assert!(ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 2));
    assert_eq!(fixed(&r.statuses[1]), (true, limit("free", 1, HOUR), 0));
    let r = s.ask(both(), 0);
    assert!(!ok(r.overall_code));
    // The user's limit would have admitted it, and says how it stands: nothing taken.
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 2));
    assert_eq!(fixed(&r.statuses[1]), (false, limit("free", 1, HOUR), 0));
    let r = s.ask(vec![descriptor(&[("user", "erin")])], 0);
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 1));
}

#[test]
fn all_or_nothing_memory() {
    all_or_nothing("memory");
}

#[test]
fn all_or_nothing_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    all_or_nothing(&format!("sqlite://{}", dir.path().join("t.db").display()));
}

#[test]
fn all_or_nothing_redis() {
    if let Some(url) = backend("TOLLGATE_REDIS_URL") {
        all_or_nothing(&url);
    }
}

#[test]
fn all_or_nothing_redis_cluster() {
    if let Some(url) = backend("TOLLGATE_REDIS_CLUSTER_URL") {
        all_or_nothing(&url);
    }
}

#[test]
fn all_or_nothing_postgres() {
    if let Some(url) = backend("TOLLGATE_POSTGRES_URL") {
        all_or_nothing(&url);
    }
}

#[test]
fn errors_are_grpc_statuses() {
    // A Redis that is not there: UNAVAILABLE (Envoy's failure_mode_deny decides).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let s = start(&format!("redis://127.0.0.1:{port}"), &[]);
    let e = s.try_ask(vec![descriptor(&[("user", "x")])], 0).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    // Nothing to limit is no store call at all.
    assert!(s.try_ask(vec![descriptor(&[("nothing", "x")])], 0).is_ok());
    let e = s.try_ask(vec![], 0).unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, "rate limit descriptor list must not be empty")
    );
    // With tokens, a call without one is refused; so is one with a read token (a call takes).
    let s = start("memory", &["s3cret", "read:r3ad"]);
    let e = s.try_ask(vec![descriptor(&[("user", "x")])], 0).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut client = s.client();
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: s.domain.clone(),
        descriptors: vec![descriptor(&[("user", "x")])],
        hits_addend: 0,
    });
    request.metadata_mut().insert("authorization", "bearer s3cret".parse().unwrap());
    assert!(s.runtime.block_on(client.should_rate_limit(request)).is_ok());
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: s.domain.clone(),
        descriptors: vec![descriptor(&[("user", "x")])],
        hits_addend: 0,
    });
    request.metadata_mut().insert("authorization", "Bearer r3ad".parse().unwrap());
    let e = s.runtime.block_on(client.should_rate_limit(request)).unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
}

/// A call over 64 KiB (the HTTP API's body limit) is refused with OUT_OF_RANGE and takes
/// nothing; one under it is served whole.
#[test]
fn a_call_over_64_kib_is_refused_and_takes_nothing() {
    let s = start("memory", &[]);
    let users = |n: usize| (0..n).map(|i| descriptor(&[("user", &format!("u{i:04}"))])).collect();
    // 6,000 descriptors of 17 bytes each: about 100 KB.
    let Err(e) = s.try_ask(users(6_000), 0) else { panic!("a call of about 100 KB was served") };
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    assert!(e.message().contains("the limit is: 65536 bytes"), "{e}");
    // Nothing taken: u0000 still has its 3 a minute.
    let first = s.ask(users(1), 0);
    assert_eq!(first.statuses[0].limit_remaining, 2);
    // 3,000 (about 50 KB) are served, each user taking one.
    let answer = s.ask(users(3_000), 0);
    assert!(ok(answer.overall_code));
    assert_eq!(answer.statuses.len(), 3_000);
    assert_eq!(answer.statuses[0].limit_remaining, 1);
    assert_eq!(answer.statuses[2_999].limit_remaining, 2);
}

/// A limit of 0 refuses the request: its other limits are looked at (their statuses
/// answered) and nothing is taken.
#[test]
fn a_limit_of_zero_refuses_and_takes_nothing() {
    let s = start("memory", &[]);
    let answer = s.ask(vec![descriptor(&[("user", "z")]), descriptor(&[("closed", "x")])], 0);
    assert!(!ok(answer.overall_code));
    assert_eq!(fixed(&answer.statuses[0]), (true, limit("", 3, MINUTE), 2));
    assert_eq!(fixed(&answer.statuses[1]), (false, limit("", 0, SECOND), 0));
    // Nothing was taken from z: its first take leaves 2 of 3.
    let answer = s.ask(vec![descriptor(&[("user", "z")])], 0);
    assert_eq!(fixed(&answer.statuses[0]), (true, limit("", 3, MINUTE), 2));
}

/// A descriptor value too long to keep whole (from a client's header: over 1,024 bytes with
/// its length, or a request's own limit whose name holds it past 256 bytes) is counted under
/// its digest like any other, on every store: the call never fails for it, and its other
/// descriptors are counted too. Two long values that differ only at their end count apart.
fn long_values_are_counted(store: &str) {
    let s = start(store, &[]);
    let long = |end: char| format!("{}{end}", "v".repeat(1_999));
    let (a, b) = (long('a'), long('b'));
    let with_paid =
        |user: &str| vec![descriptor(&[("user", user)]), descriptor(&[("plan", "paid")])];
    for remaining in [2, 1, 0] {
        let r = s.ask(with_paid(&a), 0);
        assert!(ok(r.overall_code), "{r:?}");
        assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), remaining));
        assert_eq!(fixed(&r.statuses[1]), (true, limit("paid", 100, HOUR), 97 + remaining));
    }
    // Over: refused, and the paid plan's token not taken (it says how it stands).
    let r = s.ask(with_paid(&a), 0);
    assert!(!ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (false, limit("", 3, MINUTE), 0));
    assert_eq!(fixed(&r.statuses[1]), (true, limit("paid", 100, HOUR), 97));
    // Another long value: a state of its own.
    assert_eq!(s.ask(vec![descriptor(&[("user", &b)])], 0).statuses[0].limit_remaining, 2);
    // Exactly 1,024 bytes (its key, with the length, is longer).
    let exact = "e".repeat(1_024);
    assert_eq!(s.ask(vec![descriptor(&[("user", &exact)])], 0).statuses[0].limit_remaining, 2);
    // A request's own limit: its state's name holds the values.
    let mut own = descriptor(&[("user", &a)]);
    own.limit = Some(RateLimitOverride { requests_per_unit: 2, unit: HOUR });
    for remaining in [1, 0] {
        let r = s.ask(vec![own.clone()], 0);
        assert_eq!(fixed(&r.statuses[0]), (true, limit("", 2, HOUR), remaining));
        // Its name in the header fields is bounded too.
        assert!(header(&r, "RateLimit").unwrap().len() < 300, "{r:?}");
    }
    assert!(!ok(s.ask(vec![own], 0).overall_code));
    // Through POST /json as well.
    let body = serde_json::json!({
        "domain": s.domain,
        "descriptors": [{ "entries": [{ "key": "user", "value": b }] }],
    });
    let (status, answer) = s.json(&body.to_string());
    assert_eq!((status, &answer["statuses"][0]["limitRemaining"]), (200, &serde_json::json!(1)));
}

#[test]
fn long_values_are_counted_memory() {
    long_values_are_counted("memory");
}

#[test]
fn long_values_are_counted_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    long_values_are_counted(&format!("sqlite://{}", dir.path().join("t.db").display()));
}

#[test]
fn long_values_are_counted_redis() {
    if let Some(url) = backend("TOLLGATE_REDIS_URL") {
        long_values_are_counted(&url);
    }
}

#[test]
fn long_values_are_counted_redis_cluster() {
    if let Some(url) = backend("TOLLGATE_REDIS_CLUSTER_URL") {
        long_values_are_counted(&url);
    }
}

#[test]
fn long_values_are_counted_postgres() {
    if let Some(url) = backend("TOLLGATE_POSTGRES_URL") {
        long_values_are_counted(&url);
    }
}

fn hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
    d.hits_addend = Some(UInt64Value { value: hits });
    d
}

/// A cost (`hits_addend`) that the limit can never grant is OVER_LIMIT (as
/// envoyproxy/ratelimit answers), never an error that Envoy would let through: nothing is
/// taken from the call's other descriptors, and there is no Retry-After (no wait helps).
#[test]
fn a_cost_the_limit_can_never_grant_is_over_the_limit_and_takes_nothing() {
    let s = start("memory", &[]);
    let costly = || vec![descriptor(&[("user", "costly")]), descriptor(&[("plan", "paid")])];
    // 4 for every descriptor, against 3 a minute.
    let r = s.ask(costly(), 4);
    assert!(!ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (false, limit("", 3, MINUTE), 0));
    assert!(r.statuses[0].duration_until_reset.is_some());
    // The paid plan is looked at (4 of its 100 would be left 96), not taken.
    assert_eq!(fixed(&r.statuses[1]), (true, limit("paid", 100, HOUR), 96));
    assert_eq!(header(&r, "Retry-After"), None);
    assert!(header(&r, "RateLimit").unwrap().contains("user\";r=3;"), "{r:?}");
    // A descriptor's own cost, up to the most a call may ask.
    for cost in [4, 1_000_000, 1_000_000_000_000_000] {
        let r = s.ask(vec![hits(descriptor(&[("user", "costly")]), cost)], 0);
        assert_eq!(fixed(&r.statuses[0]), (false, limit("", 3, MINUTE), 0), "{cost}");
    }
    // The token bucket of tollgate's fields: capacity 50.
    let r = s.ask(vec![descriptor(&[("tenant", "t"), ("llm", "x")])], 51);
    assert_eq!(fixed(&r.statuses[0]), (false, limit("", 600, MINUTE), 0));
    // Nothing was taken by any of them.
    let r = s.ask(vec![descriptor(&[("user", "costly")]), descriptor(&[("plan", "paid")])], 3);
    assert!(ok(r.overall_code), "{r:?}");
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 0));
    assert_eq!(fixed(&r.statuses[1]), (true, limit("paid", 100, HOUR), 97));
    // Two descriptors of one state add up: 2 + 2 of 3 can never be granted.
    let dup = || hits(descriptor(&[("user", "dup")]), 2);
    let r = s.ask(vec![dup(), dup()], 0);
    assert!(!ok(r.overall_code));
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 3, MINUTE), 1));
    assert_eq!(fixed(&r.statuses[1]), (false, limit("", 3, MINUTE), 0));
    assert_eq!(header(&r, "Retry-After"), None);
    assert_eq!(
        s.ask(vec![hits(descriptor(&[("user", "dup")]), 3)], 0).statuses[0].limit_remaining,
        0
    );
    // In shadow mode it never refuses: the request is admitted and the rest taken.
    let r =
        s.ask(vec![hits(descriptor(&[("path", "/api/x")]), 5), descriptor(&[("user", "sh")])], 0);
    assert!(ok(r.overall_code), "{r:?}");
    assert_eq!(fixed(&r.statuses[0]), (true, limit("", 1, DAY), 0));
    assert_eq!(fixed(&r.statuses[1]), (true, limit("", 3, MINUTE), 2));
    // POST /json: 429, the same statuses, no Retry-After.
    let body = serde_json::json!({
        "domain": s.domain,
        "descriptors": [{ "entries": [{ "key": "user", "value": "json-costly" }] }],
        "hitsAddend": 4,
    });
    let (status, answer) = s.json(&body.to_string());
    assert_eq!(status, 429, "{answer}");
    assert_eq!(answer["overallCode"], "OVER_LIMIT");
    let headers = answer["responseHeadersToAdd"].as_array().unwrap();
    assert!(headers.iter().all(|h| h["key"] != "Retry-After"), "{answer}");
    let (status, answer) =
        s.json(&body.to_string().replace("\"hitsAddend\":4", "\"hitsAddend\":3"));
    assert_eq!(status, 200, "{answer}");
}

#[test]
fn the_json_endpoint() {
    let s = start("memory", &[]);
    let body = |hits: u32| {
        serde_json::json!({
            "domain": s.domain,
            "descriptors": [{ "entries": [{ "key": "user", "value": "json" }] }],
            "hitsAddend": hits,
        })
        .to_string()
    };
    let (status, answer) = s.json(&body(2));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(answer["statuses"][0]["code"], "OK");
    assert_eq!(
        answer["statuses"][0]["currentLimit"],
        serde_json::json!({ "requestsPerUnit": 3, "unit": "MINUTE" })
    );
    assert_eq!(answer["statuses"][0]["limitRemaining"], 1);
    assert!(answer["statuses"][0]["durationUntilReset"].as_str().unwrap().ends_with('s'));
    assert_eq!(answer["responseHeadersToAdd"][0]["key"], "RateLimit-Policy");
    let (status, answer) = s.json(&body(2));
    assert_eq!(status, 429, "{answer}");
    assert_eq!(answer["overallCode"], "OVER_LIMIT");
    assert_eq!(answer["statuses"][0]["code"], "OVER_LIMIT");
    assert_eq!(answer["statuses"][0].get("limitRemaining"), None);
    // snake_case names and 64-bit integers as strings, as proto3 JSON allows.
    let snake = serde_json::json!({
        "domain": s.domain,
        "descriptors": [{ "entries": [{ "key": "user", "value": "snake" }], "hits_addend": "3" }],
    });
    let (status, answer) = s.json(&snake.to_string());
    assert_eq!((status, &answer["statuses"][0]["limitRemaining"]), (200, &serde_json::Value::Null));
    for (bad, message) in [
        ("{", "invalid RateLimitRequest"),
        (r#"{"domain":"d","descriptors":[{"entries":[],"bogus":1}]}"#, "unknown field `bogus`"),
        (r#"{"domain":"","descriptors":[{"entries":[]}]}"#, "rate limit domain must not be empty"),
        (
            r#"{"domain":"d","hitsAddend":-1,"descriptors":[{"entries":[]}]}"#,
            "invalid type: integer `-1`, expected an integer >= 0, or a string of one",
        ),
        (
            r#"{"domain":"d","hitsAddend":"many","descriptors":[{"entries":[]}]}"#,
            "hitsAddend: must be an integer in 0..=4294967295",
        ),
    ] {
        let (status, answer) = s.json(bad);
        assert_eq!(status, 400, "{bad}");
        assert!(answer["error"].as_str().unwrap().contains(message), "{answer}");
    }
}

#[test]
fn a_bad_config_stops_the_server_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n").unwrap();
    // The server with an RLS listener, and `extra` arguments.
    let serve = |extra: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory"])
            .args(["--rls-listen", "127.0.0.1:0"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = serve(&["--rls-config".as_ref(), path.as_os_str()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{}: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
            path.display()
        )),
        "{err}"
    );
    let out = serve(&[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs its configuration"));
}
