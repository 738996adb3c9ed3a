//! `oxccl`: the command-line front end of the oxccl collective-communication library.
//!
//! Subcommands:
//! - `verbs-perf`: perftest-style latency and bandwidth tests of the verbs layer
//!   (`ib_write_lat`, `ib_write_bw`, ... for the oxccl providers), plus raw baselines
//!   (`memcpy_bw`, `flag_lat`, `tcp_lat`, `tcp_bw`) printed in the same format; with a spawned
//!   server process, or across hosts with `--server` and `--connect HOST:PORT`.
//! - `store`: a standalone rendezvous store for `oxccl-bootstrap` (ranks then set
//!   `OXCCL_STORE_STANDALONE=1` and `OXCCL_STORE_ADDR`).
//! - `run`: a local launcher like `torchrun --standalone`: `oxccl run -n N PROGRAM ARGS...`.
//! - `perf`: collective benchmarks in the nccl-tests format: `oxccl perf all_reduce -n 4`.
//! - `doctor`: reads the ranks' flight-recorder dumps and says which rank is behind, and on
//!   what: `oxccl doctor /tmp/dump-*.json`.
//! - `topo`: prints the job's topology (hosts, ranks, link rates), detected or read from a
//!   file: `oxccl topo -n 4`, `oxccl topo --file hosts.toml --json`.
//! - `kv-bench`: throughput and latency of the KV-cache transfer engine (`oxccl-kv`), batched
//!   READ/WRITE or one request at a time, against a spawned target process or one started by
//!   hand, like Mooncake's `transfer_engine_bench`: `oxccl kv-bench --protocol tcp --block-size 4M`.
//! - `agg`: the in-network aggregation service (the "switch"): `oxccl agg --listen IP:PORT`;
//!   jobs join it with `OXCCL_AGG_ADDR`, and their all-reduces stream through it.
//! - `sim`: predicts a collective on a modelled fabric (`oxccl-sim`) in `perf`'s table:
//!   `oxccl sim --topo examples/topologies/testbed-b.toml all_reduce -b 1M -e 64M`.

mod agg;
mod doctor;
mod kv_bench;
mod perf;
mod run;
mod sim;
mod sim_compress;
mod topo;
mod verbs_perf;

use std::io::Write;
use std::path::PathBuf;
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
    /// A standalone rendezvous store: serves until killed; refusals are logged to stderr.
    Store(StoreArgs),
    /// Collective benchmarks in the format of nccl-tests (launches its own ranks unless
    /// started by a launcher).
    Perf(perf::Args),
    /// Start N ranks of PROGRAM on this host with torchrun's environment; stop all when one fails.
    Run(run::Args),
    /// Read the ranks' flight-recorder dumps (files, directories, logs) and say which rank is
    /// behind, and on what.
    Doctor(doctor::Args),
    /// Print the job's topology (hosts, ranks, link rates): read from --file or
    /// OXCCL_TOPO_FILE, or detected (launches its own ranks unless started by a launcher).
    Topo(topo::Args),
    /// Predict a collective's time on a modelled fabric (a topology file), in the table of
    /// `perf`; a per-link summary and a Perfetto trace on request.
    Sim(sim::Args),
    /// Throughput and latency of the KV-cache transfer engine (batched READ/WRITE, or one
    /// request at a time with --sync), against a spawned target process or one started by hand.
    #[command(name = "kv-bench")]
    KvBench(kv_bench::Args),
    /// The in-network aggregation service: jobs that join it (OXCCL_AGG_ADDR) stream their
    /// all-reduces through it; serves until killed.
    Agg(agg::Args),
}

/// Options of `oxccl store`.
#[derive(Debug, clap::Args)]
struct StoreArgs {
    /// Address to listen on; port 0 picks a free port. The address is printed once listening.
    #[arg(long, default_value = "0.0.0.0:29500")]
    bind: String,
    /// File holding the shared secret [default: OXCCL_SECRET or OXCCL_SECRET_FILE].
    #[arg(long)]
    secret_file: Option<PathBuf>,
}

/// `oxccl store`: serves until the process is killed.
fn store_main(args: StoreArgs) -> Result<(), String> {
    let level = match std::env::var("OXCCL_DEBUG").as_deref() {
        Ok("1" | "debug") => tracing_subscriber::filter::LevelFilter::DEBUG,
        _ => tracing_subscriber::filter::LevelFilter::INFO,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .init();
    let secret = match &args.secret_file {
        Some(path) => oxccl_bootstrap::Secret::from_file(path),
        None => oxccl_bootstrap::Secret::from_env_or_user_file(),
    }
    .map_err(|e| e.to_string())?;
    let server =
        oxccl_bootstrap::StoreServer::bind(&args.bind, secret).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "oxccl store: listening on {}", server.addr()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    loop {
        std::thread::park();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::VerbsPerf(args) => verbs_perf::main(args),
        Command::Run(args) => return run::main(args),
        Command::Perf(args) => return perf::main(args),
        Command::Doctor(args) => return doctor::main(args),
        Command::Topo(args) => return topo::main(args),
        Command::Sim(args) => return sim::main(args),
        Command::KvBench(args) => return kv_bench::main(args),
        Command::Agg(args) => return agg::main(args),
        Command::Store(args) => {
            return match store_main(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("oxccl store: error: {e}");
                    ExitCode::FAILURE
                }
            };
        }
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
