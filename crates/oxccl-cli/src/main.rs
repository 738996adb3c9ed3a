//! `oxccl`: the command-line front end of the oxccl collective-communication library.
//!
//! Subcommands:
//! - `verbs-perf`: perftest-style latency and bandwidth tests of the verbs layer
//!   (`ib_write_lat`, `ib_write_bw`, ... for the oxccl providers), plus raw baselines
//!   (`memcpy_bw`, `flag_lat`) printed in the same format.

mod verbs_perf;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The oxccl command-line tool.
#[derive(Debug, Parser)]
#[command(
    name = "oxccl",
    version,
    about = "oxccl collective-communication tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Top-level subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Latency and bandwidth of verbs operations, in the format of perftest (ib_write_lat, ...).
    #[command(name = "verbs-perf")]
    VerbsPerf(verbs_perf::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::VerbsPerf(args) => verbs_perf::main(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        // The server process already handed its error to the client, which prints it.
        Err(e) if e.is_reported() => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("oxccl: error: {e}");
            ExitCode::FAILURE
        }
    }
}
