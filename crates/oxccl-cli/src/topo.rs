//! `oxccl topo`: prints the job's topology (hosts, their ranks and link rates).
//!
//! - `--file PATH` (or `OXCCL_TOPO_FILE` when not under a launcher): reads the file (JSON or
//!   TOML, see [`oxccl::topology`]), validates it for as many ranks as it lists, and prints it.
//! - Under a launcher (torchrun, Slurm, `oxccl run`): every process is a rank; they form a
//!   communicator, whose topology comes from every rank's host identity (or from
//!   `OXCCL_TOPO_FILE`, which wins, with a warning on stderr when it disagrees), and rank 0
//!   prints it, then (in the table) the address, interface and reason of each rank that
//!   talks tcp.
//! - Otherwise: launches its own `-n` ranks on this host, as `oxccl perf` does, and rank 0 of
//!   them prints.
//!
//! `--json` prints the topology in the format the file reads, one host per line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use oxccl::topology::TOPO_FILE_VAR;
use oxccl::{Communicator, Topology};

/// Options of `oxccl topo`.
#[derive(Debug, Parser)]
pub struct Args {
    /// Topology file to read and check instead of detecting [default: OXCCL_TOPO_FILE when
    /// not under a launcher].
    #[arg(long)]
    file: Option<PathBuf>,
    /// Ranks to launch on this host when detecting without a launcher.
    #[arg(short = 'n', long = "nranks", default_value_t = 2)]
    nranks: usize,
    /// Print the topology as JSON (the format `--file` and OXCCL_TOPO_FILE read).
    #[arg(long)]
    json: bool,
}

/// Entry point.
pub fn main(args: Args) -> ExitCode {
    let under_launcher = oxccl_bootstrap::Launcher::in_env().is_some();
    // Under a launcher, OXCCL_TOPO_FILE is read by every rank (Topology::from_env).
    let env_file = std::env::var_os(TOPO_FILE_VAR)
        .filter(|p| !p.is_empty() && !under_launcher)
        .map(PathBuf::from);
    let file = args.file.clone().or(env_file);
    let result = if let Some(path) = file {
        file_main(&args, &path)
    } else if under_launcher {
        rank_main(&args)
    } else {
        return self_launch(&args);
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oxccl topo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Reads, validates and prints a file. The job is taken to have as many ranks as the file
/// implies: the number it lists, or its highest rank + 1 when that is more (so that a gap is
/// reported as a missing rank).
fn file_main(args: &Args, path: &Path) -> Result<(), String> {
    let topo = Topology::from_file(path)?;
    let highest = topo
        .hosts
        .iter()
        .flat_map(|h| h.ranks.iter().copied())
        .max();
    let world = topo.world().max(highest.map_or(0, |r| r + 1));
    topo.validate(world)
        .map_err(|e| format!("topology file {}: {e}", path.display()))?;
    print(args, &topo, &format!("file {}", path.display()))
}

/// One rank of a job: forms a communicator, rank 0 prints the topology it uses
/// ([`Communicator::topology`]: detected, or `OXCCL_TOPO_FILE`, which init validates and
/// prefers, warning on rank 0 when its grouping differs from the detected one).
fn rank_main(args: &Args) -> Result<(), String> {
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let printed = if comm.rank() == 0 {
        let source = match std::env::var(TOPO_FILE_VAR) {
            Ok(p) if !p.trim().is_empty() => format!("{TOPO_FILE_VAR}={p}"),
            _ => format!("host identities of {} ranks", comm.world_size()),
        };
        let addrs: Vec<String> = comm
            .tcp_addrs()
            .iter()
            .enumerate()
            .filter_map(|(r, a)| a.as_ref().map(|a| format!("#   rank {r}: {a}")))
            .collect();
        print(args, &comm.topology(), &source).and_then(|()| {
            if args.json || addrs.is_empty() {
                return Ok(());
            }
            let mut out = std::io::stdout().lock();
            writeln!(out, "# tcp addresses:\n{}", addrs.join("\n")).map_err(|e| e.to_string())
        })
    } else {
        Ok(())
    };
    comm.destroy().map_err(|e| e.to_string())?;
    printed
}

/// Not under a launcher: start `-n` ranks of this same command.
fn self_launch(args: &Args) -> ExitCode {
    if args.nranks == 0 {
        eprintln!("oxccl topo: need -n ≥ 1");
        return ExitCode::from(2);
    }
    let (exe, mut own) = match crate::reexec_command() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oxccl topo: cannot find this executable to launch ranks: {e}");
            return ExitCode::FAILURE;
        }
    };
    own.extend(crate::own_args());
    let opts = crate::run::LaunchOptions {
        prefix_output: false,
        ..crate::run::LaunchOptions::new(args.nranks)
    };
    match crate::run::launch(&opts, exe.as_os_str(), &own) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("oxccl topo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints the table (after a `# source` line) or the JSON document.
fn print(args: &Args, topo: &Topology, source: &str) -> Result<(), String> {
    let text = if args.json {
        // One host per line: `{"hosts": [\n  {...},\n  {...}\n]}`.
        let hosts: Vec<String> = topo
            .hosts
            .iter()
            .map(|h| serde_json::to_string(h).map(|s| format!("  {s}")))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        format!("{{\"hosts\": [\n{}\n]}}", hosts.join(",\n"))
    } else {
        format!("# oxccl topo: from {source}\n{topo}")
    };
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.to_string()),
        _ => Ok(()),
    }
}
