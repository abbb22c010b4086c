//! `tollgate`: see `tollgate --help`.

use std::process::ExitCode;

use clap::Parser;

// Requests allocate small, short-lived buffers at a high rate; mimalloc serves those faster
// than glibc's malloc (BENCHMARKS.md has the figures).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tollgate_server::when_idle(give_memory_back);
    match tollgate_server::run(tollgate_server::Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tollgate: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// Run by each runtime thread when it runs out of work, before it sleeps: mimalloc's
/// `mi_collect(false)` gives what this thread's heap has freed back to the system. Each
/// thread must ask for its own (mimalloc's heaps are per thread; a second thread asking
/// every second gave nothing back), and mimalloc gives memory back only when it is next
/// called: a server gone quiet after a burst of connections (3,000 clients' buffers: over a
/// gigabyte) would otherwise keep it for as long as it stays quiet. About a microsecond
/// (measured on a heap of 20,000 live blocks), paid only by a thread about to sleep.
#[allow(unsafe_code)]
fn give_memory_back() {
    // SAFETY: mi_collect takes no pointer and may be called from any thread at any time;
    // mimalloc is this process's allocator (ALLOCATOR above).
    unsafe { libmimalloc_sys::mi_collect(false) };
}
