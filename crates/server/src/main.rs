//! `tollgate`: see `tollgate --help`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

// Requests allocate small, short-lived buffers at a high rate; mimalloc serves those faster
// than glibc's malloc (BENCHMARKS.md has the figures).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    give_memory_back();
    match tollgate_server::run(tollgate_server::Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tollgate: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// mimalloc gives freed memory back to the system a second after it is freed (its purge
/// delay), but only when it is next called: a server gone quiet after a burst of
/// connections (3,000 clients' buffers: over a gigabyte) would keep that memory for as long
/// as it stays quiet. A thread of its own calls it every second.
fn give_memory_back() {
    let every = Duration::from_secs(1);
    let _ = std::thread::Builder::new().name("give-memory-back".into()).spawn(move || {
        loop {
            std::thread::sleep(every);
            collect();
        }
    });
}

/// mimalloc's `mi_collect(false)`: memory freed more than its purge delay ago goes back to
/// the system (arenas are the process's, whichever thread asks).
#[allow(unsafe_code)]
fn collect() {
    // SAFETY: mi_collect takes no pointer and may be called from any thread at any time;
    // mimalloc is this process's allocator (ALLOCATOR above).
    unsafe { libmimalloc_sys::mi_collect(false) };
}
