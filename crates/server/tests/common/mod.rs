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

/// A loopback port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
