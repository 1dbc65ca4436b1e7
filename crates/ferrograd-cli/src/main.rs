//! The `ferrograd` command: `train` (the main job: a GPT on the shipped corpus), `plan` (its
//! memory before it runs), `demo` (gradient memory, byte by byte), `info` (devices) and
//! `launch` (one process per rank, torchrun-style). With no subcommand it trains on its
//! defaults.

mod cli;
mod launch;
mod plan;
mod train;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            if let Some(failed) = e.downcast_ref::<launch::LaunchFailed>() {
                return ExitCode::from(failed.exit_code);
            }
            train::interrupted_exit_code().map_or(ExitCode::FAILURE, ExitCode::from)
        }
    }
}
