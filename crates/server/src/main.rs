//! `tollgate`: see `tollgate --help`.

use std::process::ExitCode;

use clap::Parser;

// Requests allocate small, short-lived buffers at a high rate; mimalloc serves those faster
// than glibc's malloc (BENCHMARKS.md has the figures).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    match tollgate_server::run(tollgate_server::Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tollgate: {err:#}");
            ExitCode::from(2)
        }
    }
}
