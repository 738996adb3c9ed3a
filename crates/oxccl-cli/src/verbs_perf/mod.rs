//! `oxccl verbs-perf`: perftest for the oxccl verbs layer.
//!
//! The client (this process) spawns a server process (this binary again, with the hidden
//! `--server-child` flag), exchanges queue-pair endpoints and target regions with it over a
//! control channel ([`channel`]), then runs the test for each message size and prints one row per
//! size in perftest's columns ([`report`]). With the shm provider the data path makes no system
//! call: both sides spin on memory or on completion queues.
//!
//! Across hosts, `--server` and `--connect HOST:PORT` run the two sides as separately started
//! processes that meet through the bootstrap's authenticated store and then speak the same
//! control protocol over TCP ([`remote`]). The raw baselines `tcp_lat` and `tcp_bw`
//! ([`rawtcp`]) measure one plain TCP connection in the same way, for comparison with the tcp
//! provider.

mod baseline;
mod channel;
mod error;
mod rawtcp;
mod remote;
mod report;
mod verbs;

use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use clap::ValueEnum;
use oxccl_verbs::Provider;
use serde::{Deserialize, Serialize};

use channel::{Channel, LineChannel, Msg, RunSpec, ServerProcess, Setup, Spin};
pub use error::Error;
use error::Result;
use rawtcp::{RawConn, RawListener};
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
with --cpu also cpu_init_s_per_gb and cpu_target_s_per_gb.

Across hosts: start `oxccl verbs-perf TEST --server` on one (it serves the rendezvous store on --bind, default 0.0.0.0:18515, and plays the target) and `oxccl verbs-perf TEST --connect HOST[:PORT]` on the other (it prints the rows); both need the same secret in OXCCL_SECRET or OXCCL_SECRET_FILE. With the tcp provider each side advertises the local address of its control connection unless OXCCL_TCP_ADDR is set.")]
pub struct Args {
    /// The test to run.
    #[arg(value_enum, required_unless_present = "server_child")]
    test: Option<Test>,

    /// Verbs provider.
    #[arg(long, default_value = "shm")]
    provider: Provider,

    /// Message size in bytes; K, M and G suffixes are powers of 1024 (4K, 4M).
    /// Default: 2 for latency tests, 65536 for bandwidth tests, 1M for tcp_bw (8 for atomic_lat
    /// and flag_lat).
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

    /// Sleep on the completion queue while waiting for completions instead of spinning on it
    /// (perftest's --events). Leaves the CPU to the tcp provider's progress threads. The
    /// ping-pong of write_lat still spins on memory.
    #[arg(short = 'e', long)]
    events: bool,

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

    /// Busy-poll: tcp_lat and tcp_bw spin on non-blocking sockets instead of blocking, and the
    /// tcp provider's progress threads busy-poll (sets OXCCL_TCP_POLL=busy on both sides where
    /// it is unset). OXCCL_TCP_POLL=busy implies it.
    #[arg(long)]
    busy: bool,

    /// Serve one client started elsewhere with --connect: runs the rendezvous store (rank 0)
    /// and plays the target. Needs OXCCL_SECRET or OXCCL_SECRET_FILE.
    #[arg(long, conflicts_with = "connect")]
    server: bool,

    /// With --server: the store's address [default: 0.0.0.0:18515]; port 0 picks a free one.
    /// The address is printed once listening.
    #[arg(long, value_name = "ADDR:PORT", requires = "server")]
    bind: Option<String>,

    /// Run against a --server at HOST:PORT (the port defaults to 18515). Needs the server's
    /// secret in OXCCL_SECRET or OXCCL_SECRET_FILE.
    #[arg(long, value_name = "HOST:PORT")]
    connect: Option<String>,

    /// Seconds --server waits for its client, and --connect keeps trying to reach the server.
    #[arg(long, default_value_t = 60.0, value_parser = parse_timeout)]
    wait: f64,

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
    /// Baseline: two processes ping-ponging messages over one TCP connection; half round trip.
    TcpLat,
    /// Baseline: one TCP stream of writes (1 MiB by default), drained by the receiver.
    TcpBw,
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
            Test::TcpLat => "tcp_lat",
            Test::TcpBw => "tcp_bw",
        }
    }

    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat
                | Test::ReadLat
                | Test::SendLat
                | Test::AtomicLat
                | Test::FlagLat
                | Test::TcpLat
        )
    }

    fn uses_verbs(self) -> bool {
        !matches!(
            self,
            Test::MemcpyBw | Test::FlagLat | Test::TcpLat | Test::TcpBw
        )
    }

    /// Whether the test is a raw TCP baseline (a data connection, no verbs).
    fn is_raw_tcp(self) -> bool {
        matches!(self, Test::TcpLat | Test::TcpBw)
    }

    /// Whether the test can run between separately started processes (`--server`/`--connect`):
    /// not the baselines that share memory or run alone.
    fn runs_remote(self) -> bool {
        !matches!(self, Test::MemcpyBw | Test::FlagLat)
    }

    /// Whether a sample is a round trip of which half is reported.
    fn is_ping_pong(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::SendLat | Test::FlagLat | Test::TcpLat
        )
    }

    /// The default message size.
    fn default_size(self) -> usize {
        match self {
            Test::TcpBw => 1 << 20,
            _ if self.is_lat() => 2,
            _ => 65536,
        }
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
            Test::TcpLat => "TCP Latency Baseline (2 processes, 1 connection, TCP_NODELAY)",
            Test::TcpBw => "TCP BW Baseline (1 stream, receiver drains)",
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
        (None, None, false) => vec![test.default_size()],
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
    if (args.server || args.connect.is_some()) && !test.runs_remote() {
        let why = match test {
            Test::FlagLat => "it shares a memory page with a spawned process",
            _ => "it has no peer",
        };
        return Err(Error::new(format!(
            "{test} cannot run with --server or --connect: {why}"
        )));
    }
    if busy_polling(&args) && test.uses_verbs() && args.provider == Provider::Tcp {
        // Before any thread or child exists: a spawned server inherits it.
        remote::default_env("OXCCL_TCP_POLL", "busy");
    }
    if args.server {
        return remote_server_main(&args, test);
    }
    let mut printer = Printer::new(args.json, args.cpu);
    match (test, &args.connect) {
        (Test::MemcpyBw, _) => run_memcpy(&args, &steps, &mut printer),
        (_, Some(to)) => run_connected(&args, test, &steps, &mut printer, to),
        (_, None) => run_with_server(&args, test, &steps, &mut printer),
    }
}

/// `--timeout` as a duration.
fn timeout(args: &Args) -> Duration {
    Duration::from_secs_f64(args.timeout)
}

/// Whether the run busy-polls: `--busy`, or `OXCCL_TCP_POLL=busy` in this process.
fn busy_polling(args: &Args) -> bool {
    args.busy || env_busy()
}

/// Whether `OXCCL_TCP_POLL=busy` is set in this process (the tcp provider's progress thread then
/// busy-polls).
fn env_busy() -> bool {
    std::env::var("OXCCL_TCP_POLL").is_ok_and(|v| v.trim() == "busy")
}

/// Logs of the bootstrap (a refused stranger, a secret file readable by others) go to stderr.
fn init_logging() {
    let level = match std::env::var("OXCCL_DEBUG").as_deref() {
        Ok("1" | "debug") => tracing_subscriber::filter::LevelFilter::DEBUG,
        _ => tracing_subscriber::filter::LevelFilter::WARN,
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .try_init();
}

/// CPU seconds (user + system) this process has used so far, all its threads included (the
/// tcp provider's progress thread too).
pub(crate) fn cpu_secs() -> f64 {
    // SAFETY: getrusage only writes the struct we hand it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage struct.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Who the client runs against.
struct Peer {
    /// For the header: "spawned process 1234, control over pipes", or the remote server.
    describe: String,
    /// The server's IP address, for a data address it announces as unspecified (0.0.0.0).
    ip: IpAddr,
}

/// The `key: value` lines of the perftest-like header.
fn header_facts(
    args: &Args,
    test: Test,
    steps: &[Step],
    server: Option<&Peer>,
) -> Vec<(&'static str, String)> {
    let mut f = vec![("Test", test.name().to_string())];
    let busy = busy_polling(args);
    if test.uses_verbs() {
        f.push(("Provider", args.provider.to_string()));
        f.push(("Memory", "provider (alloc_mr, zero copy)".to_string()));
        f.push(("Number of qps", "1 (reliable connected)".to_string()));
        if args.provider == Provider::Tcp {
            let how = if env_busy() {
                "progress threads busy-poll (OXCCL_TCP_POLL=busy)"
            } else {
                "progress threads block in epoll_wait"
            };
            f.push(("TCP progress", how.to_string()));
        }
    }
    if test.is_raw_tcp() {
        let how = if busy {
            "busy-polling non-blocking sockets"
        } else {
            "blocking sockets"
        };
        f.push((
            "Connection",
            format!("1 TCP connection, TCP_NODELAY, {how}"),
        ));
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
    if test.uses_verbs() && !test.is_lat() {
        f.push(("TX depth", args.tx_depth.to_string()));
        f.push((
            "CQ moderation",
            (args.tx_depth / 2).clamp(1, 64).to_string(),
        ));
    }
    if matches!(test, Test::SendLat | Test::SendBw) {
        f.push(("RX depth", args.rx_depth.to_string()));
    }
    if test.uses_verbs() {
        let how = if args.events {
            "sleep on the completion queue (--events)"
        } else {
            "spin on the completion queue"
        };
        f.push(("Completions", how.to_string()));
    }
    if test.is_lat() {
        let what = match test {
            Test::TcpLat if busy => "half round trip (ping-pong, both sides busy-polling recv)",
            Test::TcpLat => "half round trip (ping-pong, both sides blocking in recv)",
            _ if test.is_ping_pong() => "half round trip (ping-pong, both sides spinning)",
            _ => "full time per operation",
        };
        f.push(("Latency", what.to_string()));
    } else {
        f.push((
            "Bandwidth",
            "GB = 1e9 bytes; peak = best window of >= 1/10 of the ops and 1/20 of the time"
                .to_string(),
        ));
    }
    if let Some(peer) = server {
        f.push(("Server", peer.describe.clone()));
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
    let peer = Peer {
        describe: format!("spawned process {}, control over pipes", server.id()),
        ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
    match drive(args, test, steps, printer, &mut chan, flag.as_ref(), &peer) {
        Ok(()) => {
            let _ = chan.send(&Msg::Quit);
            drop(chan);
            server.finish(Duration::from_secs(5))
        }
        // Dropping `server` kills and reaps it if it is still there.
        Err(e) => Err(server.explain(e)),
    }
}

/// `--connect HOST:PORT`: joins the server through its store, then runs as with a spawned
/// server.
fn run_connected(
    args: &Args,
    test: Test,
    steps: &[Step],
    printer: &mut Printer,
    to: &str,
) -> Result<()> {
    init_logging();
    let wait = Duration::from_secs_f64(args.wait);
    let (session, mut chan) = remote::connect(to, wait, timeout(args))
        .map_err(|e| e.context(format!("--connect {to}")))?;
    // The tcp provider advertises the interface the server is reached from.
    remote::default_env("OXCCL_TCP_ADDR", &session.local_ip.to_string());
    let peer = Peer {
        describe: format!("remote, {}", session.describe),
        ip: session.peer_ip,
    };
    let result = drive(args, test, steps, printer, &mut chan, None, &peer);
    match &result {
        Ok(()) => {
            let _ = chan.send(&Msg::Quit);
        }
        // Tell the server why we stop (it may be waiting for us).
        Err(e) => {
            let _ = chan.send(&Msg::Error {
                message: e.to_string(),
            });
        }
    }
    drop(chan);
    session.close();
    result
}

/// `--server`: serves one client that runs `--connect`, as its target.
fn remote_server_main(args: &Args, test: Test) -> Result<()> {
    init_logging();
    let bind = args.bind.as_deref().unwrap_or(remote::DEFAULT_BIND);
    let wait = Duration::from_secs_f64(args.wait);
    let (session, mut chan) = remote::serve(bind, wait, timeout(args), |addr| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "verbs-perf server: listening on {addr}")
            .and_then(|()| out.flush())
            .map_err(Error::stdout)
    })
    .map_err(|e| e.context("verbs-perf server"))?;
    // The tcp provider advertises the interface the client reached us on.
    remote::default_env("OXCCL_TCP_ADDR", &session.local_ip.to_string());
    eprintln!("verbs-perf server: {test} for {}", session.describe);
    let result = match serve(&mut chan, Some((test, args.provider))) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = chan.send(&Msg::Error {
                message: e.to_string(),
            });
            Err(e.context("verbs-perf server"))
        }
    };
    drop(chan);
    session.close();
    result
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
    peer: &Peer,
) -> Result<()> {
    let timeout = timeout(args);
    // Setting up a context maps segments and starts threads: allow more than a data-path wait.
    let setup_timeout = timeout.max(Duration::from_secs(30));
    let max_size = steps.iter().map(|s| s.size).max().unwrap_or(8);
    let busy = busy_polling(args);
    chan.send(&Msg::Setup(Setup {
        test,
        provider: args.provider,
        max_size,
        rx_depth: args.rx_depth,
        tx_depth: args.tx_depth,
        timeout_secs: args.timeout,
        flag_fd: flag.map(|f| f.raw_fd()),
        busy,
        events: args.events,
    }))?;
    let side = if test.uses_verbs() {
        let mut side = VerbsSide::open(
            args.provider,
            max_size,
            args.tx_depth,
            args.rx_depth,
            args.events,
        )?;
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
    let mut raw = if test.is_raw_tcp() {
        let Msg::Listening { addr, token } = expect_msg(
            chan,
            "the server's data address",
            setup_timeout,
            "listening",
        )?
        else {
            unreachable!("checked by expect_msg")
        };
        let mut addr: SocketAddr = addr.parse().map_err(|_| {
            Error::new(format!(
                "the {} announced an invalid data address {addr:?}",
                chan.peer_name()
            ))
        })?;
        if addr.ip().is_unspecified() {
            addr.set_ip(peer.ip);
        }
        Some(RawConn::connect(addr, &token, busy, timeout)?)
    } else {
        None
    };
    expect_msg(chan, "the server's connection", setup_timeout, "connected")?;
    printer.header(
        test.title(),
        &header_facts(args, test, steps, Some(peer)),
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
            if let (Test::FlagLat, Some(flag)) = (test, flag) {
                flag.client(&mut spin, &run).map(Measured::Lat)
            } else if let Some(raw) = raw.as_mut() {
                if test.is_lat() {
                    raw.lat_client(&mut spin, &run).map(Measured::Lat)
                } else {
                    raw.bw_client(&mut spin, &run).map(Measured::Bw)
                }
            } else if let Some(side) = &side {
                if test.is_lat() {
                    side.lat_client(test, &mut spin, &run).map(Measured::Lat)
                } else {
                    side.bw_client(test, &mut spin, &run, args.tx_depth)
                        .map(Measured::Bw)
                }
            } else {
                Err(Error::new("internal error: test without resources"))
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
    match serve(&mut chan, None) {
        Ok(()) => Ok(()),
        Err(e) => match chan.send(&Msg::Error {
            message: e.to_string(),
        }) {
            Ok(()) => Err(e.reported()),
            Err(_) => Err(e.context("verbs-perf server")),
        },
    }
}

/// The server's side of the protocol: set up as told, then answer runs until `quit`. A server
/// started for one test and provider (`--server`) refuses a client that asks for others.
fn serve(chan: &mut dyn Channel, expect: Option<(Test, Provider)>) -> Result<()> {
    let Msg::Setup(setup) = expect_msg(chan, "the test setup", Duration::from_secs(30), "setup")?
    else {
        unreachable!("checked by expect_msg")
    };
    let timeout = Duration::from_secs_f64(setup.timeout_secs);
    let setup_timeout = timeout.max(Duration::from_secs(30));
    let test = setup.test;
    if let Some((want, provider)) = expect {
        let over = |t: Test, p: Provider| {
            if t.uses_verbs() {
                format!("{t} over {p}")
            } else {
                t.to_string()
            }
        };
        if want != test || (test.uses_verbs() && provider != setup.provider) {
            return Err(Error::new(format!(
                "the client asked for {}, but this server was started for {}",
                over(test, setup.provider),
                over(want, provider)
            )));
        }
    }
    if setup.busy && test.uses_verbs() && setup.provider == Provider::Tcp {
        remote::default_env("OXCCL_TCP_POLL", "busy");
    }
    let flag = match (test, setup.flag_fd) {
        (Test::FlagLat, Some(fd)) if expect.is_none() => Some(baseline::FlagPage::inherit(fd)?),
        (Test::FlagLat, _) => return Err(Error::new("flag_lat needs the client's flag page")),
        _ => None,
    };
    let side = if test.uses_verbs() {
        let side = VerbsSide::open(
            setup.provider,
            setup.max_size,
            setup.tx_depth,
            setup.rx_depth,
            setup.events,
        )?;
        let (qp, buf) = side.local();
        chan.send(&Msg::Endpoint { qp, buf })?;
        let Msg::Endpoint { qp, buf } =
            expect_msg(chan, "the client's endpoint", setup_timeout, "endpoint")?
        else {
            unreachable!("checked by expect_msg")
        };
        let mut side = side;
        side.connect(&qp, buf, test, setup.rx_depth)?;
        Some(side)
    } else {
        None
    };
    let mut raw = if test.is_raw_tcp() {
        let listener = RawListener::bind(remote::data_ip())?;
        chan.send(&Msg::Listening {
            addr: listener.addr().to_string(),
            token: listener.token().to_string(),
        })?;
        Some(listener.accept(chan, setup_timeout, setup.busy, timeout)?)
    } else {
        None
    };
    chan.send(&Msg::Connected)?;
    let fault = std::env::var("OXCCL_PERF_FAULT").unwrap_or_default();
    // The client announces its next run as soon as it has printed a row. A spawned server idles
    // until then (its client closes the pipe or kills it when it goes); a remote one gives up
    // after a while, in case the client is stuck (a dead one is noticed sooner, by keepalive).
    let idle = expect.is_some().then_some(setup_timeout);
    loop {
        match chan.recv("the next run", idle)? {
            Msg::Run(run) => {
                inject_fault(&fault);
                let cpu0 = cpu_secs();
                chan.send(&Msg::Ready)?;
                {
                    let mut spin = Spin::new(chan, timeout);
                    match (test, &side, &flag, raw.as_mut()) {
                        (Test::FlagLat, _, Some(flag), _) => flag.server(&mut spin, &run)?,
                        (Test::TcpLat, _, _, Some(raw)) => raw.lat_server(&mut spin, &run)?,
                        (Test::TcpBw, _, _, Some(raw)) => raw.bw_server(&mut spin, &run)?,
                        (Test::WriteLat | Test::SendLat, Some(side), _, _) => {
                            side.lat_server(test, &mut spin, &run)?
                        }
                        (Test::SendBw, Some(side), _, _) => side.bw_server_recv(&mut spin, &run)?,
                        // One-sided tests: the target's application has nothing to do (with the
                        // tcp provider its progress thread does the work).
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
