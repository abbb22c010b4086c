//! The guide (`docs/src`, an mdBook, and the README) keeps its shape and its examples stay
//! true. Its shape: every chapter is in `SUMMARY.md` and every entry there exists; every
//! chapter is a doc test (`crates/tollgate/src/lib.rs` includes each, as it does the README);
//! every fenced block says its language (rustdoc would compile an untagged block as Rust).
//! Its examples, loaded as the server loads them: every TOML block that is a tollgate config
//! file (one with a `[server]` or `[limits.*]` table), and the one a Kubernetes ConfigMap
//! carries, by the config parser, with its settings checked as `serve` checks them; every
//! YAML block that is an envoyproxy/ratelimit config (one with `domain:`) by the rate limit
//! service's loader; the config chapter against the server's settings; the simulator's and
//! `check-config`'s examples run by the binary, answering what the chapters say. Links and
//! anchors are checked on the built book by `scripts/check-links` in CI.

use std::path::{Path, PathBuf};

use tollgate_server::config::{FileConfig, Overrides};
use tollgate_server::rls::config::RlsConfig;

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every chapter of the guide, relative to `docs/src`, `SUMMARY.md` aside.
fn chapters() -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path.strip_prefix(base).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let src = root().join("docs/src");
    let mut out = Vec::new();
    walk(&src, &src, &mut out);
    out.retain(|c| c != "SUMMARY.md");
    out.sort();
    out
}

/// Every chapter of the guide and the README: (path, text).
fn pages() -> Vec<(PathBuf, String)> {
    let src = root().join("docs/src");
    let paths = std::iter::once(root().join("README.md"))
        .chain(chapters().into_iter().map(|c| src.join(c)));
    paths.map(|p| (p.clone(), std::fs::read_to_string(&p).unwrap())).collect()
}

/// The fenced blocks of `text`: the line each starts on, its language (the info string's
/// first word) and its text; and whether the last one was left open.
fn fences(text: &str) -> (Vec<(usize, String, String)>, bool) {
    let mut found = Vec::new();
    let mut open: Option<(usize, String, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let tag = info.split([',', ' ']).next().unwrap_or("").to_owned();
                    open = Some((i + 1, tag, String::new()));
                }
            }
            Some(_) if trimmed.starts_with("```") => found.extend(open.take()),
            Some((_, _, body)) => {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    (found, open.is_some())
}

/// The fenced blocks of `text` tagged `lang`, with the line each starts on.
fn blocks(text: &str, lang: &str) -> Vec<(usize, String)> {
    let (found, _) = fences(text);
    found
        .into_iter()
        .filter(|(_, tag, _)| tag == lang)
        .map(|(line, _, body)| (line, body))
        .collect()
}

#[test]
fn every_chapter_is_in_the_summary_and_every_entry_exists() {
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).unwrap();
    let linked: Vec<&str> =
        summary.split("](").skip(1).map(|rest| rest.split(')').next().unwrap()).collect();
    for chapter in chapters() {
        assert!(linked.contains(&chapter.as_str()), "{chapter} is not in SUMMARY.md");
    }
    for entry in linked {
        assert!(root().join("docs/src").join(entry).is_file(), "SUMMARY.md names {entry}");
    }
}

#[test]
fn every_chapter_is_a_doc_test() {
    let lib = std::fs::read_to_string(root().join("crates/tollgate/src/lib.rs")).unwrap();
    for chapter in chapters() {
        let include = format!("include_str!(\"../../../docs/src/{chapter}\")");
        assert!(lib.contains(&include), "crates/tollgate/src/lib.rs does not include {chapter}");
    }
}

#[test]
fn every_fenced_block_says_its_language() {
    for (page, text) in pages() {
        let (found, left_open) = fences(&text);
        for (line, tag, _) in found {
            assert!(!tag.is_empty(), "{}:{line}: a block without a language", page.display());
        }
        assert!(!left_open, "{}: a block left open", page.display());
    }
}

#[test]
fn every_config_file_shown_loads() {
    let mut loaded = 0;
    for (path, text) in pages() {
        for (line, toml) in blocks(&text, "toml") {
            let is_config = toml.lines().any(|l| {
                let l = l.trim();
                l == "[server]" || l.starts_with("[limits.")
            });
            if !is_config {
                continue;
            }
            let settings = FileConfig::parse(&toml)
                .and_then(|file| file.settings(&Overrides::default(), false));
            if let Err(e) = settings {
                panic!("{}:{line}: this config does not load: {e:#}\n{toml}", path.display());
            }
            loaded += 1;
        }
    }
    // A config file inside a Kubernetes ConfigMap (`tollgate.toml: |`, indented below it).
    for (path, text) in pages() {
        for (line, yaml) in blocks(&text, "yaml") {
            let Some(at) = yaml.find("tollgate.toml: |\n") else { continue };
            let rest = &yaml[at + "tollgate.toml: |\n".len()..];
            let indent = rest.len() - rest.trim_start().len();
            let toml: String = rest
                .lines()
                .take_while(|l| l.len() > indent && l[..indent].trim().is_empty())
                .map(|l| format!("{}\n", &l[indent..]))
                .collect();
            let settings = FileConfig::parse(&toml)
                .and_then(|file| file.settings(&Overrides::default(), false));
            if let Err(e) = settings {
                panic!(
                    "{}:{line}: the ConfigMap's config does not load: {e:#}\n{toml}",
                    path.display()
                );
            }
            assert!(toml.contains("[limits."), "{toml}");
            loaded += 1;
        }
    }
    assert!(loaded >= 5, "only {loaded} configs found: is the guide where this test looks?");
}

#[test]
fn every_rate_limit_service_config_shown_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mut loaded = 0;
    for (path, text) in pages() {
        for (line, yaml) in blocks(&text, "yaml") {
            if !yaml.lines().any(|l| l.starts_with("domain:")) {
                continue;
            }
            let file = dir.path().join(format!("{loaded}.yaml"));
            std::fs::write(&file, &yaml).unwrap();
            if let Err(e) = RlsConfig::load(&file) {
                panic!("{}:{line}: this RLS config does not load: {e:#}\n{yaml}", path.display());
            }
            loaded += 1;
        }
    }
    assert!(loaded >= 1, "no RLS config found in the guide");
}

/// The simulator chapter's example: its traffic and limits, run by the binary, answer the
/// four lines the chapter prints.
#[test]
fn the_simulator_chapter_answers_what_it_says() {
    let text = std::fs::read_to_string(root().join("docs/src/simulator.md")).unwrap();
    let (_, script) = blocks(&text, "sh").into_iter().next().expect("the chapter's example");
    let traffic: String = script
        .lines()
        .skip_while(|l| !l.starts_with("cat > traffic.jsonl"))
        .skip(1)
        .take_while(|l| *l != "LINES")
        .map(|l| format!("{l}\n"))
        .collect();
    let expected: Vec<&str> = script
        .lines()
        .filter_map(|l| l.strip_prefix("# "))
        .filter(|l| l.starts_with('{'))
        .collect();
    assert_eq!((traffic.lines().count(), expected.len()), (4, 4), "{script}");
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.toml");
    std::fs::write(&limits, "[limits.send]\nkind = \"token bucket\"\nrate = 10\nperiod = \"1m\"\n")
        .unwrap();
    assert!(script.contains(
        r#"printf '[limits.send]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\n' > limits.toml"#
    ));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["simulate", "--config"])
        .arg(&limits)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(traffic.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let answers = String::from_utf8(out.stdout).unwrap();
    assert_eq!(answers.lines().collect::<Vec<_>>(), expected);
}

/// The simulator chapter's plot is what its command draws today (the committed picture
/// would otherwise drift from the simulator; `scripts/book-pictures` draws it again).
#[test]
fn the_simulator_plot_is_what_the_simulator_draws() {
    let docs = root().join("docs/src/simulator");
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("plot.svg");
    let traffic = std::fs::File::open(docs.join("traffic.jsonl")).unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["simulate", "--config"])
        .arg(docs.join("limits.toml"))
        .arg("--plot")
        .arg(&plot)
        .stdin(traffic)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let drawn = std::fs::read_to_string(&plot).unwrap();
    let committed = std::fs::read_to_string(docs.join("plot.svg")).unwrap();
    assert!(
        drawn == committed,
        "docs/src/simulator/plot.svg is not what the simulator draws: run scripts/book-pictures"
    );
}

/// The config chapter is checked against the code: its example's `[server]` table sets every
/// setting the server knows (and, loading above, nothing else), and its table of variables
/// has a row for each, naming its field and saying whether a reload applies it as the code
/// does; no row names a variable the server does not read.
#[test]
fn the_config_reference_has_every_server_setting() {
    use tollgate_server::config::{CONFIG_VAR, SETTINGS};
    let text = std::fs::read_to_string(root().join("docs/src/server/config.md")).unwrap();
    let (_, example) = blocks(&text, "toml")
        .into_iter()
        .find(|(_, toml)| toml.contains("[server]"))
        .expect("the chapter's example of [server]");
    for setting in SETTINGS {
        let set = example.lines().any(|l| l.starts_with(&format!("{} = ", setting.field)));
        assert!(set, "the example does not set [server] {}", setting.field);
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| `{}` |", setting.var)))
            .unwrap_or_else(|| panic!("no row for {}", setting.var));
        assert!(row.contains(&format!("`{}`", setting.field)), "{row}");
        let applies = row.trim_end_matches('|').rsplit('|').next().unwrap().trim();
        match applies {
            "no" => assert!(!setting.live, "{row}: a reload applies it"),
            a if a.starts_with("yes") => assert!(setting.live, "{row}: it takes a restart"),
            _ => {} // `its contents: yes`: the path takes a restart, what it names reloads
        }
    }
    for row in text.lines().filter(|l| l.starts_with("| `TOLLGATE_")) {
        let var = row.split('`').nth(1).unwrap();
        let known = var == CONFIG_VAR || SETTINGS.iter().any(|s| s.var == var);
        assert!(known, "the chapter names {var}, which the server does not read");
    }
}

/// The reload chapter's `check-config` example prints what the chapter shows: for a file with
/// the limits `api` and `signup`, `ok`, a version of 12 hex digits, the limits and the store
/// checked but not connected (exit 0); for one whose `api` has a rate of -1, the error and exit 1.
#[test]
fn the_check_config_example_prints_what_the_chapter_shows() {
    let text = std::fs::read_to_string(root().join("docs/src/server/reload.md")).unwrap();
    let (_, script) = blocks(&text, "sh")
        .into_iter()
        .find(|(_, sh)| sh.starts_with("tollgate check-config"))
        .expect("the chapter's check-config example");
    let shown: Vec<&str> = script.lines().filter_map(|l| l.strip_prefix("# ")).collect();
    let dir = tempfile::tempdir().unwrap();
    let good = "[limits.api]\nkind = \"token bucket\"\nrate = 600\nperiod = \"1m\"\n\n\
                [limits.signup]\nkind = \"fixed window\"\nrate = 100\nperiod = \"1h\"\n";
    std::fs::write(dir.path().join("tollgate.toml"), good).unwrap();
    std::fs::write(dir.path().join("bad.toml"), good.replace("rate = 600", "rate = -1")).unwrap();
    let run = |file: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["check-config", "--config", file])
            .current_dir(dir.path())
            .env_remove("TOLLGATE_STORE")
            .output()
            .unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), printed)
    };
    let (code, printed) = run("tollgate.toml");
    assert_eq!(code, Some(0), "{printed}");
    let printed: Vec<&str> = printed.lines().collect();
    assert_eq!(printed.len(), 3, "{printed:?}");
    let version =
        |line: &str| line.rsplit_once("version ").map(|(head, v)| (head.to_owned(), v.len()));
    assert_eq!(version(printed[0]), version(shown[0]), "{printed:?} against {shown:?}");
    assert!(printed[0].rsplit(' ').next().unwrap().chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(printed[1..], shown[1..3]);
    let (code, printed) = run("bad.toml");
    assert_eq!(code, Some(1), "{printed}");
    assert_eq!(printed.trim_end(), shown[3], "the error as the chapter shows it");
    assert_eq!(shown[4], "exit 1");
}
