//! `tollgate simulate`: exact answers for JSON lines, in process and through the binary.

use std::io::Write;
use std::process::{Command, Stdio};

use tollgate::{Config, MINUTE};
use tollgate_server::simulate::Simulation;

fn run(sim: &Simulation, lines: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    sim.run(lines.join("\n").as_bytes(), &mut out).unwrap();
    String::from_utf8(out).unwrap().lines().map(String::from).collect()
}

fn limits() -> Vec<(String, Config)> {
    vec![
        ("tb".into(), Config::token_bucket(10.0, MINUTE)),
        ("fw".into(), Config::fixed_window(10.0, MINUTE).with_start(0.0)),
        ("small".into(), Config::token_bucket(3.0, MINUTE)),
    ]
}

#[test]
fn the_spec_examples() {
    let sim = Simulation::new(&limits(), 0);
    let out = run(
        &sim,
        &[
            r#"{"at":0,"op":"limit","name":"tb","count":5}"#,
            r#"{"at":6000,"op":"limit","name":"tb","count":6}"#,
            r#"{"at":6000,"op":"value","name":"tb"}"#,
            r#"{"at":6000,"op":"limit","name":"tb","count":10}"#,
            r#"{"at":6000,"op":"limit","name":"tb","count":10,"reserve":true}"#,
            r#"{"at":0,"op":"limit","name":"fw","count":5}"#,
            r#"{"at":60000,"op":"limit","name":"fw","count":6}"#,
            r#"{"at":60000,"op":"limit","name":"fw","count":10}"#,
            r#"{"at":60000,"op":"limit","name":"fw","count":10,"reserve":true}"#,
            r#"{"at":60000,"op":"value","name":"fw"}"#,
        ],
    );
    assert_eq!(
        out,
        [
            r#"{"ok":true}"#,
            r#"{"ok":true}"#,
            r#"{"config":{"capacity":10,"kind":"token bucket","period":60000,"rate":10,"shards":1},"shard":0,"ts":6000,"value":0}"#,
            r#"{"ok":false,"retryAfter":60000}"#,
            r#"{"ok":true,"retryAfter":60000}"#,
            r#"{"ok":true}"#,
            r#"{"ok":true}"#,
            r#"{"ok":false,"retryAfter":60000}"#,
            r#"{"ok":true,"retryAfter":60000}"#,
            r#"{"config":{"capacity":10,"kind":"fixed window","period":60000,"rate":10,"shards":1,"start":0},"shard":0,"ts":60000,"value":-6}"#,
        ]
    );
}

/// `adjust` lines (SPEC §4): the LLM pattern, an estimate taken, the difference settled.
#[test]
fn adjust_lines_settle_costs_after_the_work() {
    let sim = Simulation::new(&limits(), 0);
    let out = run(
        &sim,
        &[
            r#"{"at":0,"op":"limit","name":"tb","count":4}"#,
            r#"{"at":0,"op":"adjust","name":"tb","count":9}"#,
            r#"{"at":0,"op":"limit","name":"tb"}"#,
            r#"{"at":12000,"op":"adjust","name":"tb","count":-20}"#,
            r#"{"at":12000,"op":"adjust","name":"tb"}"#,
        ],
    );
    assert_eq!(
        out,
        [
            r#"{"ok":true}"#,
            r#"{"retryAfter":18000,"value":-3}"#,
            r#"{"ok":false,"retryAfter":24000}"#,
            r#"{"value":10}"#,
            r#"{"error":"invalid request body: missing field `count` at line 1 column 13","status":400}"#,
        ]
    );
}

#[test]
fn a_transaction_is_refused_as_a_whole() {
    let sim = Simulation::new(&limits(), 0);
    let out = run(
        &sim,
        &[
            r#"{"at":0,"op":"limit","name":"small","count":2}"#,
            r#"{"at":0,"op":"transaction","limits":[{"name":"tb","count":4},{"name":"small","count":2}]}"#,
            r#"{"at":0,"op":"value","name":"tb"}"#,
            r#"{"at":0,"op":"transaction","limits":[{"name":"tb","count":4},{"name":"small","count":2,"throws":true}]}"#,
            r#"{"at":20000,"op":"transaction","limits":[{"name":"tb","count":4},{"name":"small","count":2}]}"#,
        ],
    );
    assert_eq!(
        out[1],
        r#"{"ok":false,"results":[{"ok":true},{"ok":false,"retryAfter":20000}],"retryAfter":20000}"#
    );
    assert_eq!(
        out[2],
        r#"{"config":{"capacity":10,"kind":"token bucket","period":60000,"rate":10,"shards":1},"shard":0,"ts":0,"value":10}"#
    );
    assert_eq!(out[3], r#"{"kind":"RateLimited","name":"small","retryAfter":20000,"status":429}"#);
    assert_eq!(out[4], r#"{"ok":true,"results":[{"ok":true},{"ok":true}]}"#);
}

#[test]
fn bad_lines_are_answered_and_the_run_goes_on() {
    let sim = Simulation::new(&limits(), 0);
    let out = run(
        &sim,
        &[
            "this is not JSON",
            r#"[1,2]"#,
            r#"{"op":"limit","name":"tb"}"#,
            r#"{"at":"soon","op":"limit","name":"tb"}"#,
            r#"{"at":0,"op":"fly","name":"tb"}"#,
            r#"{"at":0,"op":"limit","name":"nope"}"#,
            r#"{"at":0,"op":"limit","name":"tb","count":11}"#,
            r#"{"at":0,"op":"limit","name":"tb"}"#,
        ],
    );
    assert_eq!(
        out,
        [
            r#"{"error":"malformed JSON: expected ident at line 1 column 2","status":400}"#,
            r#"{"error":"a line must be a JSON object","status":400}"#,
            r#"{"error":"at: missing (ms since the Unix epoch)","status":400}"#,
            r#"{"error":"at: must be a number (ms since the Unix epoch)","status":400}"#,
            r#"{"error":"op: \"fly\" is not one of limit, check, transaction, reset, value, adjust, acquire, release, renew","status":400}"#,
            r#"{"error":"Rate limit nope not defined. Define it in a [limits.nope] table of the server's config file, or send a config with the request.","status":404}"#,
            r#"{"error":"Rate limit tb count 11 exceeds 10.","status":400}"#,
            r#"{"ok":true}"#,
        ]
    );
}

#[test]
fn a_seed_fixes_every_random_choice() {
    let lines: Vec<String> = (0..40)
        .map(|i| format!(r#"{{"at":{},"op":"limit","name":"hot","key":"k{}","config":{{"kind":"fixed window","rate":100,"period":60000,"shards":4}}}}"#, i * 1000, i % 3))
        .chain([r#"{"at":40000,"op":"value","name":"hot","key":"k0","config":{"kind":"fixed window","rate":100,"period":60000,"shards":4},"sampleShards":4}"#.to_string()])
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let a = run(&Simulation::new(&[], 7), &lines);
    let b = run(&Simulation::new(&[], 7), &lines);
    let c = run(&Simulation::new(&[], 8), &lines);
    assert_eq!(a, b, "the same seed replays exactly");
    assert_ne!(a.last(), c.last(), "another seed aligns the windows elsewhere");
}

/// A config file in `dir` that defines `send`: 10 a minute, bursts of 3.
fn send_config(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let config = dir.path().join("limits.toml");
    std::fs::write(
        &config,
        "[limits.send]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1m\"\ncapacity = 3\n",
    )
    .unwrap();
    config
}

#[test]
fn the_binary_reads_stdin_and_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = send_config(&dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["simulate", "--seed", "1", "--config"])
        .arg(&config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let input =
        (0..4).map(|_| r#"{"at":0,"op":"limit","name":"send"}"#).collect::<Vec<_>>().join("\n")
            + "\nnot json\n";
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "{\"ok\":true}\n{\"ok\":true}\n{\"ok\":true}\n{\"ok\":false,\"retryAfter\":6000}\n\
         {\"error\":\"malformed JSON: expected ident at line 1 column 2\",\"status\":400}\n"
    );
}

/// The circles of the series `name` / `key` in the plot, by class.
fn marks(svg: &str, name: &str, key: &str) -> Vec<String> {
    let start = format!(r#"<g class="series" data-name="{name}" data-key="{key}">"#);
    let series = svg.split(&start).nth(1).expect("the series is drawn");
    let series = series.split("</g>").next().unwrap();
    series
        .split("<circle class=\"")
        .skip(1)
        .map(|c| c.split('"').next().unwrap().to_owned())
        .collect()
}

/// `--plot`: one series per (name, key), one mark per request of it with its outcome, the
/// capacity line, the value drawn between; written by the binary.
#[test]
fn the_plot_marks_every_request() {
    let lines = [
        r#"{"at":0,"op":"limit","name":"send","key":"alice"}"#,
        r#"{"at":0,"op":"limit","name":"send","key":"alice"}"#,
        r#"{"at":0,"op":"limit","name":"send","key":"alice"}"#,
        r#"{"at":1000,"op":"limit","name":"send","key":"alice"}"#,
        r#"{"at":1000,"op":"limit","name":"send","key":"alice","reserve":true}"#,
        r#"{"at":2000,"op":"check","name":"send","key":"bob"}"#,
        r#"{"at":3000,"op":"value","name":"send","key":"alice"}"#,
        r#"{"at":3000,"op":"reset","name":"send","key":"alice"}"#,
        r#"{"at":4000,"op":"limit","name":"send","key":"bad","count":-1}"#,
        r#"{"at":19000,"op":"limit","name":"small","key":"bob","config":{"kind":"token bucket","rate":1,"period":"1m"}}"#,
        r#"{"at":20000,"op":"transaction","limits":[{"name":"send","key":"bob"},{"name":"small","key":"bob","config":{"kind":"token bucket","rate":1,"period":"1m"}}]}"#,
        r#"{"at":30000,"op":"transaction","limits":[{"name":"send","key":"bob","count":2}]}"#,
    ];
    let dir = tempfile::tempdir().unwrap();
    let config = send_config(&dir);
    let plot = dir.path().join("plot.svg");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["simulate", "--config"])
        .arg(&config)
        .arg("--plot")
        .arg(&plot)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(lines.join("\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), lines.len());
    assert!(String::from_utf8_lossy(&out.stderr).contains("plot written to"));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""), "{svg}");
    // alice: three granted, one refused, one booked ahead (the value and the reset are not
    // requests to mark; the bad count was an error).
    assert_eq!(
        marks(&svg, "send", "alice"),
        ["granted", "granted", "granted", "refused", "reserved"]
    );
    // bob: a check, then a transaction refused whole by its other limit (nothing taken), then
    // one granted.
    assert_eq!(marks(&svg, "send", "bob"), ["granted", "refused", "granted"]);
    assert_eq!(marks(&svg, "small", "bob"), ["granted", "refused"]);
    assert!(!svg.contains("data-key=\"bad\""));
    assert_eq!(svg.matches("<g class=\"series\"").count(), 3);
    assert_eq!(svg.matches("class=\"capacity\"").count(), 3 + 1, "one per series and the legend's");
    assert_eq!(svg.matches("<path class=\"value\"").count(), 3);
    assert!(svg.contains("token bucket: 10 a minute, bursts of 3"), "the config in words");
    // The marks' hover titles carry the numbers.
    assert!(svg.contains("<title>limit 1 at 0 ms: granted, 2 left</title>"), "{svg}");
    assert!(svg.contains("<title>limit 1 at 0 ms: granted, 0 left</title>"), "{svg}");
}
