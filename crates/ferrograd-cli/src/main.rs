//! The `ferrograd` command: `train` (the main job: a GPT on the shipped corpus), `plan` (its
//! memory before it runs), `demo` (gradient memory, byte by byte) and `info` (devices). With
//! no subcommand it trains on its defaults.

mod cli;
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
            train::interrupted_exit_code().map_or(ExitCode::FAILURE, ExitCode::from)
        }
    }
}
