//! The guide (`docs/src`, an mdBook) keeps its shape: every chapter is in `SUMMARY.md` and
//! every entry there exists; every chapter's examples are doc tests (`src/lib.rs` includes
//! each chapter, as it does the README); every fenced block says its language (rustdoc
//! would compile an untagged block as Rust, and mdBook would show it as such). Links and
//! anchors are checked on the built book by `scripts/check-links` in CI.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every chapter, relative to `docs/src`, but `SUMMARY.md`.
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
        assert!(lib.contains(&include), "src/lib.rs does not include {chapter} as a doc test");
    }
}

#[test]
fn every_fenced_block_says_its_language() {
    let mut pages: Vec<PathBuf> =
        chapters().iter().map(|c| root().join("docs/src").join(c)).collect();
    pages.push(root().join("README.md"));
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let mut inside = false;
        for (i, line) in text.lines().enumerate() {
            if let Some(info) = line.trim_start().strip_prefix("```") {
                if !inside {
                    assert!(
                        !info.trim().is_empty(),
                        "{}:{}: a block without a language",
                        page.display(),
                        i + 1
                    );
                }
                inside = !inside;
            }
        }
        assert!(!inside, "{}: a block left open", page.display());
    }
}
