//! `tollgate`: see `tollgate --help`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    match tollgate_server::run(tollgate_server::Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tollgate: {err:#}");
            ExitCode::from(2)
        }
    }
}
