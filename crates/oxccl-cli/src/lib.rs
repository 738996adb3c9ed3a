//! `oxccl`: the command-line front end of the oxccl collective-communication library.
//!
//! A library with one entry, [`main_with_args`], so that the same command line runs as the
//! `oxccl` binary (`src/main.rs`, a thin wrapper) and from the Python package's console script
//! (`oxccl._cli`, through the extension module). Where a subcommand starts another copy of
//! itself (`perf` and `topo` their ranks, `verbs-perf` its server, `kv-bench` its target), it
//! runs [`set_reexec_command`]'s command line, by default this executable.
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
mod status;
mod topo;
mod verbs_perf;

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command as Process;
use std::process::ExitCode;
use std::sync::OnceLock;

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
    /// Ask every rank of a running job, through its store, what it is doing now; name the rank
    /// that holds everyone up (answers within --timeout, 1 s, even when the job hangs).
    Status(status::Args),
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

/// The command line that starts this CLI again (program, then leading arguments), when not
/// this executable: set once by an embedder, see [`set_reexec_command`].
static REEXEC: OnceLock<Vec<OsString>> = OnceLock::new();
/// The arguments of the running command, after the program name (set by [`main_with_args`]).
static ARGS: OnceLock<Vec<OsString>> = OnceLock::new();

/// Says how a subcommand that starts another copy of this CLI (`perf`'s and `topo`'s ranks,
/// `verbs-perf`'s server, `kv-bench`'s target) runs it: `command[0]` with the arguments
/// `command[1..]`, then the subcommand's own. Without it, this executable is re-executed
/// (`std::env::current_exe`), which is right for the `oxccl` binary; an embedder whose
/// executable is not the CLI (the Python interpreter) sets it before [`main_with_args`], e.g.
/// to `[sys.executable, "-m", "oxccl._cli"]`. Only the first call has an effect; it returns
/// whether it was that one. An empty `command` is ignored.
pub fn set_reexec_command(command: Vec<OsString>) -> bool {
    !command.is_empty() && REEXEC.set(command).is_ok()
}

/// The program and leading arguments that run this CLI again.
pub(crate) fn reexec_command() -> std::io::Result<(OsString, Vec<OsString>)> {
    match REEXEC.get() {
        Some(command) => Ok((command[0].clone(), command[1..].to_vec())),
        None => Ok((std::env::current_exe()?.into_os_string(), Vec::new())),
    }
}

/// A [`std::process::Command`] that runs this CLI again, with `args` after the leading ones.
pub(crate) fn reexec<I, S>(args: I) -> std::io::Result<Process>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let (program, lead) = reexec_command()?;
    let mut cmd = Process::new(program);
    cmd.args(lead).args(args);
    Ok(cmd)
}

/// The running command's arguments after the program name (what a subcommand passes on to the
/// copies of itself that it starts).
pub(crate) fn own_args() -> Vec<OsString> {
    match ARGS.get() {
        Some(args) => args.clone(),
        None => std::env::args_os().skip(1).collect(),
    }
}

/// Runs the `oxccl` command line: `args` as `std::env::args_os()` gives them, the program name
/// first. Parse errors, `--help` and `--version` print and exit the process, as clap does;
/// otherwise returns the exit code, with standard output flushed. Call it once per process
/// (subcommands install process-wide state: signal handlers, a log subscriber).
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    ExitCode::from(run_with_args(args))
}

/// [`main_with_args`], with the exit code as a number (for an embedder that exits by itself,
/// such as the Python console script).
pub fn run_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let _ = ARGS.set(args.iter().skip(1).cloned().collect());
    let cli = Cli::parse_from(args);
    let code = dispatch(cli);
    // An embedder's process does not run Rust's exit-time flush of stdout.
    let _ = std::io::stdout().flush();
    // `ExitCode` keeps its number to itself: find the one it was made from.
    (0..=u8::MAX)
        .find(|&n| ExitCode::from(n) == code)
        .unwrap_or(1)
}

fn dispatch(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::VerbsPerf(args) => verbs_perf::main(args),
        Command::Run(args) => return run::main(args),
        Command::Perf(args) => return perf::main(args),
        Command::Doctor(args) => return doctor::main(args),
        Command::Status(args) => return status::main(args),
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
