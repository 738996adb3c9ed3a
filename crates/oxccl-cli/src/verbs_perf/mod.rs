//! `oxccl verbs-perf`: perftest for the oxccl verbs layer.
//!
//! The client (this process) spawns a server process (this binary again, with the hidden
//! `--server-child` flag), exchanges queue-pair endpoints and target regions with it over a
//! control channel ([`channel`]), then runs the test for each message size and prints one row per
//! size in perftest's columns ([`report`]). The data path makes no system call: both sides spin
//! on memory or on completion queues.

mod baseline;
mod channel;
mod error;
mod report;
mod verbs;

use std::fmt;
use std::time::Duration;

use clap::ValueEnum;
use oxccl_verbs::Provider;
use serde::{Deserialize, Serialize};

use channel::{Channel, LineChannel, Msg, RunSpec, ServerProcess, Setup, Spin};
pub use error::Error;
use error::Result;
use report::{Printer, cpu_per_gb, lat_row};
use verbs::VerbsSide;

/// Largest message size accepted (buffers of this size are allocated on both sides).
const MAX_SIZE: usize = 1 << 30;
/// Largest size of `-a`.
const ALL_MAX: usize = 8 << 20;

/// Arguments of `oxccl verbs-perf`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
JSON rows (--json) have the fields test, provider, bytes, iterations and, for latency tests, \
t_min_usec, t_max_usec, t_typical_usec (median), t_avg_usec, t_stdev_usec, p99_usec, p99_9_usec; \
for bandwidth tests bw_peak_gb_per_sec, bw_average_gb_per_sec, msg_rate_mpps (GB = 1e9 bytes); \
with --cpu also cpu_init_s_per_gb and cpu_target_s_per_gb.")]
pub struct Args {
    /// The test to run.
    #[arg(value_enum, required_unless_present = "server_child")]
    test: Option<Test>,

    /// Verbs provider.
    #[arg(long, default_value = "shm")]
    provider: Provider,

    /// Message size in bytes; K, M and G suffixes are powers of 1024 (4K, 4M).
    /// Default: 2 for latency tests, 65536 for bandwidth tests (8 for atomic_lat and flag_lat).
    #[arg(short = 's', long, value_parser = parse_size)]
    size: Option<usize>,

    /// Run every power-of-two size from 2 B to 8 MiB.
    #[arg(short = 'a', long, conflicts_with = "size")]
    all: bool,

    /// Measured iterations per size. Default: 1000 for latency tests, 5000 for bandwidth tests
    /// (with -a and no -n, large sizes run fewer, to keep the run short).
    #[arg(short = 'n', long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    iters: Option<u64>,

    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    json: bool,

    /// Outstanding send requests in bandwidth tests.
    #[arg(short = 't', long, default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=16384))]
    tx_depth: u32,

    /// Receives kept posted in send tests.
    #[arg(short = 'r', long, default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    rx_depth: u32,

    /// Also print CPU seconds per GB moved, of the initiator and of the target (getrusage).
    #[arg(long)]
    cpu: bool,

    /// Seconds any wait may go without progress before the run fails.
    #[arg(long, default_value_t = 10.0, value_parser = parse_timeout)]
    timeout: f64,

    /// Internal: run as the server process spawned by a client.
    #[arg(long, hide = true)]
    server_child: bool,

    /// Internal: the client's pid (the server exits when it is gone).
    #[arg(long, hide = true)]
    parent_pid: Option<u32>,
}

/// The tests `verbs-perf` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[value(rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Test {
    /// RDMA WRITE ping-pong; half round trip.
    WriteLat,
    /// RDMA WRITE streaming.
    WriteBw,
    /// RDMA READ, one at a time; full time per READ.
    ReadLat,
    /// RDMA READ streaming.
    ReadBw,
    /// SEND/RECV ping-pong; half round trip.
    SendLat,
    /// SEND streaming into posted receives.
    SendBw,
    /// Fetch-and-add, one at a time; full time per atomic.
    AtomicLat,
    /// Baseline: single-thread memcpy between two private buffers.
    MemcpyBw,
    /// Baseline: two processes ping-ponging a flag in shared memory; half round trip.
    FlagLat,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::WriteLat => "write_lat",
            Test::WriteBw => "write_bw",
            Test::ReadLat => "read_lat",
            Test::ReadBw => "read_bw",
            Test::SendLat => "send_lat",
            Test::SendBw => "send_bw",
            Test::AtomicLat => "atomic_lat",
            Test::MemcpyBw => "memcpy_bw",
            Test::FlagLat => "flag_lat",
        }
    }

    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat | Test::FlagLat
        )
    }

    fn uses_verbs(self) -> bool {
        !matches!(self, Test::MemcpyBw | Test::FlagLat)
    }

    /// Whether a sample is a round trip of which half is reported.
    fn is_ping_pong(self) -> bool {
        matches!(self, Test::WriteLat | Test::SendLat | Test::FlagLat)
    }

    /// The only size the test works with, if it is fixed.
    fn fixed_size(self) -> Option<usize> {
        matches!(self, Test::AtomicLat | Test::FlagLat).then_some(8)
    }

    fn title(self) -> &'static str {
        match self {
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::SendLat => "Send Latency Test",
            Test::SendBw => "Send BW Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            Test::MemcpyBw => "memcpy BW Baseline (1 thread, private buffers)",
            Test::FlagLat => "Shared-Memory Flag Latency Baseline (2 processes, spinning)",
        }
    }
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a byte count: digits with an optional K, M or G suffix (powers of 1024, an optional
/// trailing `B` or `iB` allowed).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let bad = || {
        format!(
            "invalid size '{s}': expected bytes with an optional K, M or G suffix (e.g. 4096, 64K, 4M)"
        )
    };
    let t = s.trim();
    let digits = t.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 {
        return Err(bad());
    }
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let unit = unit.trim().to_ascii_uppercase();
    let unit = unit
        .strip_suffix("IB")
        .or_else(|| unit.strip_suffix('B'))
        .unwrap_or(&unit);
    let mult: u64 = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return Err(bad()),
    };
    let bytes = n
        .checked_mul(mult)
        .filter(|&b| b <= MAX_SIZE as u64)
        .ok_or_else(|| format!("size '{s}' is too large (at most {MAX_SIZE} bytes, 1G)"))?;
    if bytes == 0 {
        return Err(format!("size '{s}' must be at least 1 byte"));
    }
    Ok(bytes as usize)
}

fn parse_timeout(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "invalid timeout '{s}': expected seconds, greater than 0 (e.g. 10 or 0.5)"
        )),
    }
}

/// One row to measure.
#[derive(Clone, Copy, Debug)]
struct Step {
    size: usize,
    warmup: u64,
    iters: u64,
}

/// The sizes, iterations and warm-ups of a run.
fn plan(args: &Args, test: Test) -> Result<Vec<Step>> {
    let sizes: Vec<usize> = match (test.fixed_size(), args.size, args.all) {
        (Some(fixed), Some(s), _) if s != fixed => {
            return Err(Error::new(format!(
                "{test} works on {fixed}-byte words: -s must be {fixed} (or left out)"
            )));
        }
        (Some(fixed), _, _) => vec![fixed],
        (None, _, true) => (1..=ALL_MAX.trailing_zeros())
            .map(|b| 1usize << b)
            .collect(),
        (None, Some(s), false) => vec![s],
        (None, None, false) => vec![if test.is_lat() { 2 } else { 65536 }],
    };
    let lat = test.is_lat();
    Ok(sizes
        .into_iter()
        .map(|size| {
            let default = if lat { 1000 } else { 5000 };
            let iters = match args.iters {
                Some(n) => n,
                // -a: fewer iterations where each moves a lot, so the sweep stays short.
                None if args.all => {
                    let budget: u64 = if lat { 256 << 20 } else { 1 << 30 };
                    let floor = if lat { 100 } else { 200 };
                    default.min((budget / size as u64).max(floor))
                }
                None => default,
            };
            let mut warmup = (iters / 10).clamp(16, 1000);
            if !lat {
                warmup = warmup.max(args.tx_depth as u64);
            }
            // Warm-up need not move more than 256 MiB.
            warmup = warmup.min(((256u64 << 20) / size as u64).max(8));
            Step {
                size,
                warmup,
                iters,
            }
        })
        .collect())
}

/// Runs `oxccl verbs-perf`.
pub fn main(args: Args) -> Result<()> {
    if args.server_child {
        return server_main(&args);
    }
    let test = args
        .test
        .ok_or_else(|| Error::new("no test given (see --help)"))?;
    let steps = plan(&args, test)?;
    let mut printer = Printer::new(args.json, args.cpu);
    match test {
        Test::MemcpyBw => run_memcpy(&args, &steps, &mut printer),
        _ => run_with_server(&args, test, &steps, &mut printer),
    }
}

/// `--timeout` as a duration.
fn timeout(args: &Args) -> Duration {
    Duration::from_secs_f64(args.timeout)
}

/// CPU seconds (user + system) this process has used so far.
fn cpu_secs() -> f64 {
    // SAFETY: getrusage only writes the struct we hand it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage struct.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The `key: value` lines of the perftest-like header.
fn header_facts(
    args: &Args,
    test: Test,
    steps: &[Step],
    server: Option<u32>,
) -> Vec<(&'static str, String)> {
    let mut f = vec![("Test", test.name().to_string())];
    if test.uses_verbs() {
        f.push(("Provider", args.provider.to_string()));
        f.push(("Memory", "provider (alloc_mr, zero copy)".to_string()));
        f.push(("Number of qps", "1 (reliable connected)".to_string()));
    }
    let iters = match steps {
        [s] => format!("{} (+{} warm-up)", s.iters, s.warmup),
        _ => format!(
            "{} to {} per size (+ warm-up)",
            steps.iter().map(|s| s.iters).min().unwrap_or(0),
            steps.iter().map(|s| s.iters).max().unwrap_or(0)
        ),
    };
    f.push(("Iterations", iters));
    if !test.is_lat() && test != Test::MemcpyBw {
        f.push(("TX depth", args.tx_depth.to_string()));
        f.push((
            "CQ moderation",
            (args.tx_depth / 2).clamp(1, 64).to_string(),
        ));
    }
    if matches!(test, Test::SendLat | Test::SendBw) {
        f.push(("RX depth", args.rx_depth.to_string()));
    }
    if test.is_lat() {
        let what = if test.is_ping_pong() {
            "half round trip (ping-pong, both sides spinning)"
        } else {
            "full time per operation"
        };
        f.push(("Latency", what.to_string()));
    } else {
        f.push((
            "Bandwidth",
            "GB = 1e9 bytes; peak = best of 10 windows".to_string(),
        ));
    }
    if let Some(pid) = server {
        f.push((
            "Server",
            format!("spawned process {pid}, control over pipes"),
        ));
    }
    f
}

/// `memcpy_bw`: no server, one row per size.
fn run_memcpy(args: &Args, steps: &[Step], printer: &mut Printer) -> Result<()> {
    printer.header(
        Test::MemcpyBw.title(),
        &header_facts(args, Test::MemcpyBw, steps, None),
        false,
    )?;
    for s in steps {
        let cpu0 = cpu_secs();
        let marks = baseline::memcpy_bw(s.size, s.warmup, s.iters);
        let cpu = cpu_secs() - cpu0;
        let mut row = marks.bw_row(Test::MemcpyBw.name(), None, s.size, s.iters);
        if args.cpu {
            row.cpu_init_s_per_gb = cpu_per_gb(cpu, ((s.warmup + s.iters) * s.size as u64) as f64);
        }
        printer.bw(&row)?;
    }
    printer.footer()
}

/// Every test with a peer: spawns the server process, runs, and reaps it (or kills it on error).
fn run_with_server(args: &Args, test: Test, steps: &[Step], printer: &mut Printer) -> Result<()> {
    // Created before the spawn, so the server inherits the descriptor.
    let flag = match test {
        Test::FlagLat => Some(baseline::FlagPage::create()?),
        _ => None,
    };
    let (mut server, mut chan) = ServerProcess::spawn()?;
    let pid = server.id();
    match drive(args, test, steps, printer, &mut chan, flag.as_ref(), pid) {
        Ok(()) => {
            let _ = chan.send(&Msg::Quit);
            drop(chan);
            server.finish(Duration::from_secs(5))
        }
        // Dropping `server` kills and reaps it if it is still there.
        Err(e) => Err(server.explain(e)),
    }
}

/// Receives the next message and checks that it is a `want` (see [`Msg::kind`]).
fn expect_msg(chan: &mut dyn Channel, what: &str, timeout: Duration, want: &str) -> Result<Msg> {
    let m = chan.recv(what, Some(timeout))?;
    if m.kind() != want {
        return Err(Error::new(format!(
            "protocol error: expected {what} ({want}) from the {}, got {}",
            chan.peer_name(),
            m.kind()
        )));
    }
    Ok(m)
}

/// The client's side of the protocol: setup, connection, then one run and one row per size.
fn drive(
    args: &Args,
    test: Test,
    steps: &[Step],
    printer: &mut Printer,
    chan: &mut dyn Channel,
    flag: Option<&baseline::FlagPage>,
    server_pid: u32,
) -> Result<()> {
    let timeout = timeout(args);
    // Setting up a context maps segments and starts threads: allow more than a data-path wait.
    let setup_timeout = timeout.max(Duration::from_secs(30));
    let max_size = steps.iter().map(|s| s.size).max().unwrap_or(8);
    chan.send(&Msg::Setup(Setup {
        test,
        provider: args.provider,
        max_size,
        rx_depth: args.rx_depth,
        tx_depth: args.tx_depth,
        timeout_secs: args.timeout,
        flag_fd: flag.map(|f| f.raw_fd()),
    }))?;
    let side = if test.uses_verbs() {
        let mut side = VerbsSide::open(args.provider, max_size, args.tx_depth, args.rx_depth)?;
        let Msg::Endpoint { qp, buf } =
            expect_msg(chan, "the server's endpoint", setup_timeout, "endpoint")?
        else {
            unreachable!("checked by expect_msg")
        };
        let (my_qp, my_buf) = side.local();
        chan.send(&Msg::Endpoint {
            qp: my_qp,
            buf: my_buf,
        })?;
        side.connect(&qp, buf, test, args.rx_depth)?;
        Some(side)
    } else {
        None
    };
    expect_msg(chan, "the server's connection", setup_timeout, "connected")?;
    printer.header(
        test.title(),
        &header_facts(args, test, steps, Some(server_pid)),
        test.is_lat(),
    )?;
    let provider = test.uses_verbs().then(|| args.provider.to_string());
    let mut seq = 0u64;
    for s in steps {
        let run = RunSpec {
            size: s.size,
            warmup: s.warmup,
            iters: s.iters,
            seq,
        };
        chan.send(&Msg::Run(run))?;
        expect_msg(chan, "the server's readiness", timeout, "ready")?;
        let cpu0 = cpu_secs();
        let measured = {
            let mut spin = Spin::new(chan, timeout);
            match (test, &side, flag) {
                (Test::FlagLat, _, Some(flag)) => flag.client(&mut spin, &run).map(Measured::Lat),
                (_, Some(side), _) if test.is_lat() => {
                    side.lat_client(test, &mut spin, &run).map(Measured::Lat)
                }
                (_, Some(side), _) => side
                    .bw_client(test, &mut spin, &run, args.tx_depth)
                    .map(Measured::Bw),
                _ => Err(Error::new("internal error: test without resources")),
            }
        };
        let cpu = cpu_secs() - cpu0;
        let measured = measured.map_err(|e| e.context(format!("{test}, {} bytes", s.size)))?;
        chan.send(&Msg::Finish)?;
        let Msg::Done {
            cpu_secs: server_cpu,
        } = expect_msg(chan, "the server's end of the run", timeout, "done")?
        else {
            unreachable!("checked by expect_msg")
        };
        seq += s.warmup + s.iters;
        let bytes = ((s.warmup + s.iters) * s.size as u64) as f64;
        let (ci, ct) = if args.cpu {
            (cpu_per_gb(cpu, bytes), cpu_per_gb(server_cpu, bytes))
        } else {
            (None, None)
        };
        match measured {
            Measured::Lat(mut samples) => {
                let scale = if test.is_ping_pong() { 0.5 } else { 1.0 };
                let mut row = lat_row(test.name(), provider.clone(), s.size, &mut samples, scale);
                row.cpu_init_s_per_gb = ci;
                row.cpu_target_s_per_gb = ct;
                printer.lat(&row)?;
            }
            Measured::Bw(marks) => {
                let mut row = marks.bw_row(test.name(), provider.clone(), s.size, s.iters);
                row.cpu_init_s_per_gb = ci;
                row.cpu_target_s_per_gb = ct;
                printer.bw(&row)?;
            }
        }
    }
    printer.footer()
}

/// What the client measured in one run.
enum Measured {
    /// Per-operation nanoseconds (round trips for ping-pong tests).
    Lat(Vec<u64>),
    /// Completion progress over time.
    Bw(report::Marks),
}

/// The server process: set up what the client asks for, then play the target of every run.
fn server_main(args: &Args) -> Result<()> {
    if let Some(ppid) = args.parent_pid {
        // Never outlive the client, even if it is killed.
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(|e| Error::new(format!("PR_SET_PDEATHSIG: {e}")))?;
        let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get() as u32);
        if parent != Some(ppid) {
            return Err(Error::new("the client process is already gone"));
        }
    }
    let mut chan = LineChannel::stdio()?;
    match serve(&mut chan) {
        Ok(()) => Ok(()),
        Err(e) => match chan.send(&Msg::Error {
            message: e.to_string(),
        }) {
            Ok(()) => Err(e.reported()),
            Err(_) => Err(e.context("verbs-perf server")),
        },
    }
}

/// The server's side of the protocol: set up as told, then answer runs until `quit`.
fn serve(chan: &mut dyn Channel) -> Result<()> {
    let Msg::Setup(setup) = expect_msg(chan, "the test setup", Duration::from_secs(30), "setup")?
    else {
        unreachable!("checked by expect_msg")
    };
    let timeout = Duration::from_secs_f64(setup.timeout_secs);
    let test = setup.test;
    let flag = match (test, setup.flag_fd) {
        (Test::FlagLat, Some(fd)) => Some(baseline::FlagPage::inherit(fd)?),
        (Test::FlagLat, None) => return Err(Error::new("flag_lat needs the client's flag page")),
        _ => None,
    };
    let side = if test.uses_verbs() {
        let side = VerbsSide::open(
            setup.provider,
            setup.max_size,
            setup.tx_depth,
            setup.rx_depth,
        )?;
        let (qp, buf) = side.local();
        chan.send(&Msg::Endpoint { qp, buf })?;
        let Msg::Endpoint { qp, buf } = expect_msg(
            chan,
            "the client's endpoint",
            timeout.max(Duration::from_secs(30)),
            "endpoint",
        )?
        else {
            unreachable!("checked by expect_msg")
        };
        let mut side = side;
        side.connect(&qp, buf, test, setup.rx_depth)?;
        Some(side)
    } else {
        None
    };
    chan.send(&Msg::Connected)?;
    let fault = std::env::var("OXCCL_PERF_FAULT").unwrap_or_default();
    loop {
        // Idle until the client speaks: it closes the channel (or kills us) when it goes.
        match chan.recv("the next run", None)? {
            Msg::Run(run) => {
                inject_fault(&fault);
                let cpu0 = cpu_secs();
                chan.send(&Msg::Ready)?;
                {
                    let mut spin = Spin::new(chan, timeout);
                    match (test, &side, &flag) {
                        (Test::FlagLat, _, Some(flag)) => flag.server(&mut spin, &run)?,
                        (Test::WriteLat | Test::SendLat, Some(side), _) => {
                            side.lat_server(test, &mut spin, &run)?
                        }
                        (Test::SendBw, Some(side), _) => side.bw_server_recv(&mut spin, &run)?,
                        // One-sided tests: the target's CPU has nothing to do.
                        _ => {}
                    }
                }
                match chan.recv("the end of the run", None)? {
                    Msg::Finish => {}
                    other => {
                        return Err(Error::new(format!(
                            "protocol error: expected the end of the run, got {other:?}"
                        )));
                    }
                }
                let cpu = cpu_secs() - cpu0;
                chan.send(&Msg::Done { cpu_secs: cpu })?;
            }
            Msg::Quit => return Ok(()),
            other => {
                return Err(Error::new(format!(
                    "protocol error: expected a run or quit, got {other:?}"
                )));
            }
        }
    }
}

/// Test hooks (`OXCCL_PERF_FAULT`): make the server fail on purpose, to check the client
/// reports it instead of hanging.
fn inject_fault(fault: &str) {
    match fault {
        // Dies before answering the run.
        "server-exit-at-run" => std::process::exit(3),
        // Dies in the middle of the data phase.
        "server-abort-during-run" => {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                std::process::abort();
            });
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn args(argv: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("verbs-perf").chain(argv.iter().copied()))
            .expect("arguments parse")
            .args
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("4m"), Ok(4 << 20));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        for bad in [
            "",
            "K",
            "4X",
            "-1",
            "1.5K",
            "0",
            "2G",
            "99999999999999999999",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn plans_follow_perftest_defaults() {
        let p = plan(&args(&["write_lat"]), Test::WriteLat).unwrap();
        assert_eq!((p.len(), p[0].size, p[0].iters), (1, 2, 1000));
        let p = plan(&args(&["write_bw"]), Test::WriteBw).unwrap();
        assert_eq!((p.len(), p[0].size, p[0].iters), (1, 65536, 5000));
        assert!(p[0].warmup >= 128, "bandwidth warm-up fills the send queue");
        let p = plan(&args(&["write_bw", "-a"]), Test::WriteBw).unwrap();
        assert_eq!(p.len(), 23);
        assert_eq!((p[0].size, p[22].size), (2, 8 << 20));
        assert!(p[22].iters < 5000, "-a shortens the largest sizes");
        let p = plan(&args(&["write_bw", "-a", "-n", "7"]), Test::WriteBw).unwrap();
        assert!(p.iter().all(|s| s.iters == 7), "-n is honoured exactly");
        let p = plan(&args(&["atomic_lat", "-a"]), Test::AtomicLat).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].size, 8);
        assert!(plan(&args(&["flag_lat", "-s", "16"]), Test::FlagLat).is_err());
    }
}
