//! The simulator on any input line: never a panic; one JSON line out per line in; an
//! answer with a status that is not 200 carries an error (or a throws refusal's kind).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_server::simulate::Simulation;

thread_local! {
    // Per thread: a simulation keeps its plot's recording in a `RefCell` (libFuzzer runs one).
    static SIMULATION: Simulation = Simulation::new(&[], 7);
}

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else { return };
    if line.contains('\n') {
        return;
    }
    let out = SIMULATION.with(|simulation| simulation.line(line));
    assert!(!out.contains('\n'), "one line out: {out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("a JSON line");
    if let Some(status) = json.get("status") {
        let ok = json.get("error").is_some_and(|e| e.is_string())
            || (status == 429 && json["kind"] == "RateLimited");
        assert!(ok, "{out}");
    }
});
