//! `oxccl agg`: the in-network aggregation service ([`oxccl::agg`]), standing where the switch
//! stands. Jobs join it with `OXCCL_AGG_ADDR`; their all-reduces then stream through it.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use oxccl::agg::{Service, ServiceOptions};
use oxccl_bootstrap::Secret;

/// Options of `oxccl agg`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address to listen on for members (port 0: any free port; printed once listening).
    /// Its IP is also where members' queue pairs connect: give one they can reach.
    #[arg(long, default_value = "0.0.0.0:29600")]
    listen: String,
    /// A file holding the secret of a job to serve; repeat for several jobs [default:
    /// OXCCL_SECRET or OXCCL_SECRET_FILE].
    #[arg(long)]
    secret_file: Vec<PathBuf>,
    /// Bytes of aggregation slots in all (K, M, G suffixes); each job gets pool / max-jobs.
    #[arg(long, default_value = "256M")]
    pool: String,
    /// Jobs served at once; a job beyond them runs without the service.
    #[arg(long, default_value_t = 4)]
    max_jobs: usize,
    /// Most ranks in one job; a member of a larger one is refused.
    #[arg(long, default_value_t = 4096)]
    max_members: usize,
    /// Jobs of one secret waiting for their members at once; one more is refused.
    #[arg(long, default_value_t = 4)]
    max_pending: usize,
    /// Print what the service did every this many seconds (0: never): bytes reduced, their
    /// rate, and the rate per CPU-second the service used (its own cost).
    #[arg(long, default_value_t = 0.0)]
    stats_every: f64,
    /// Do not log jobs as they join and end.
    #[arg(long)]
    quiet: bool,
}

/// Runs the service until the process is killed.
pub fn main(args: Args) -> ExitCode {
    match serve(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oxccl agg: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: Args) -> Result<(), String> {
    let secrets = if args.secret_file.is_empty() {
        vec![Secret::from_env_or_user_file().map_err(|e| e.to_string())?]
    } else {
        args.secret_file
            .iter()
            .map(|p| Secret::from_file(p).map_err(|e| format!("{}: {e}", p.display())))
            .collect::<Result<_, _>>()?
    };
    let listen = args
        .listen
        .parse()
        .map_err(|e| format!("--listen {}: {e} (an IP:port)", args.listen))?;
    let pool_bytes = oxccl_bootstrap::parse_size(&args.pool)
        .ok_or_else(|| format!("--pool {}: not a size (e.g. 256M)", args.pool))?;
    let mut opts = ServiceOptions::new(listen, secrets);
    opts.pool_bytes = pool_bytes;
    opts.max_jobs = args.max_jobs;
    opts.max_members = args.max_members;
    opts.max_pending = args.max_pending;
    opts.verbose = !args.quiet;
    let service = Service::start(opts).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "oxccl agg: listening on {} ({} of slots, at most {} jobs)",
        service.addr(),
        args.pool,
        args.max_jobs
    )
    .map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    if args.stats_every <= 0.0 {
        loop {
            std::thread::park();
        }
    }
    let every = Duration::from_secs_f64(args.stats_every);
    let (mut last, mut t, mut cpu) = (
        service.stats(),
        Instant::now(),
        crate::verbs_perf::cpu_secs(),
    );
    loop {
        std::thread::sleep(every);
        let (now, t1, cpu1) = (
            service.stats(),
            Instant::now(),
            crate::verbs_perf::cpu_secs(),
        );
        let bytes = (now.bytes_in - last.bytes_in) as f64;
        let secs = (t1 - t).as_secs_f64();
        let cpu_used = cpu1 - cpu;
        println!(
            "oxccl agg: {} jobs running, {} calls, {:.3} GB in over {secs:.1} s: {:.3} GB/s, \
             {:.2} CPU-s: {:.3} GB per CPU-second",
            now.running,
            now.calls - last.calls,
            bytes / 1e9,
            bytes / 1e9 / secs.max(1e-9),
            cpu_used,
            if cpu_used > 0.0 {
                bytes / 1e9 / cpu_used
            } else {
                0.0
            },
        );
        (last, t, cpu) = (now, t1, cpu1);
    }
}
