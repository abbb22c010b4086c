//! `tollgate serve` on a Redis that speaks TLS only and asks for a client certificate
//! (`scripts/redis-tls start DIR` prints its URL; CI sets `TOLLGATE_REDIS_TLS_URL` to it): it
//! serves over `rediss://`, and a certificate that does not verify stops it at start with a
//! message that says why, never a silent fallback.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

/// Runs `tollgate serve` on `store`, expecting it to stop at once: its exit code and stderr.
fn refused(store: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let stderr = dir.path().join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "tollgate serve --store {store} did not stop: {}",
                std::fs::read_to_string(&stderr).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code().unwrap_or(-1), std::fs::read_to_string(&stderr).unwrap())
}

#[test]
fn serves_over_tls_and_refuses_a_certificate_that_does_not_verify() {
    let Some(url) = common::backend("TOLLGATE_REDIS_TLS_URL") else { return };
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(["serve", "--listen", "127.0.0.1:0", "--store", &url]);
    let served = common::Served::start(command, false);
    let (status, answer) =
        served.post("/v1/limit", &[], &json!({ "name": "example", "key": "tls" }));
    assert_eq!((status, answer), (200, json!({ "ok": true })));
    drop(served);

    // A CA that did not sign the server's certificate (`scripts/redis-tls` makes one beside).
    let (dir, _) = url.split_once("ca=").unwrap().1.split_once("/ca.crt").unwrap();
    let wrong_ca = url.replace(&format!("{dir}/ca.crt"), &format!("{dir}/other-ca.crt"));
    let (code, stderr) = refused(&wrong_ca);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("over TLS") && stderr.contains("UnknownIssuer"), "{stderr}");
    assert!(stderr.contains("ca="), "the message names the parameter: {stderr}");

    // No client certificate, where the server asks for one.
    let (without, _) = url.split_once("&cert=").unwrap();
    let (code, stderr) = refused(without);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("over TLS") && stderr.contains("CertificateRequired"), "{stderr}");

    // A CA file that is not there: refused before any connection.
    let (code, stderr) = refused(&url.replace(&format!("{dir}/ca.crt"), "/no/such/ca.crt"));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("ca=/no/such/ca.crt"), "{stderr}");
}
