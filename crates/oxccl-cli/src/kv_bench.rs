//! `oxccl kv-bench`: throughput and latency of the KV-cache transfer engine (`oxccl-kv`), in the
//! spirit of Mooncake's `transfer_engine_bench`.
//!
//! Two engines, each in its own process so that each side's CPU time is its own: the *target*
//! allocates a managed buffer and serves it as a segment; the *initiator* opens that segment
//! and moves data with batched one-sided READs or WRITEs from `--threads` threads, each with
//! its own batches (submit, then wait, one batch in flight per thread, as Mooncake's benchmark
//! does). `--sync` moves one request at a time with `transfer_sync` (the latency mode).
//!
//! By default the initiator spawns the target as a child process of itself (`--role target`
//! with a hidden `--child` flag: it prints its segment name on stdout and serves until its
//! stdin closes). `--role target --listen IP[:port]` and `--role initiator --segment IP:port`
//! run the two sides by hand, on two hosts or in two network namespaces; both need the same
//! secret in `OXCCL_SECRET` (or `OXCCL_SECRET_FILE`).
//!
//! The target's CPU time reaches the initiator through a service the target serves over the
//! engine's authenticated handshake channel (`kv-bench/cpu`: its `getrusage` total), asked
//! before and after the measured run, so that it works the same for a child and for a target
//! on another host.
//!
//! `--protocol raw-tcp` is the reference the tcp protocol is held against: `--lanes` plain TCP
//! connections, each with a sending thread on the initiator and a draining thread on the
//! target, streaming `--block-size` writes without the engine.
//!
//! Output: a perftest-like header and one result row (or one JSON object with `--json`):
//! block size, batch size, threads, lanes, GB/s (1e9 bytes/s), requests/s, latency
//! percentiles (per batch, or per request with `--sync`), CPU seconds per GB of the initiator
//! and of the target process, and the waiting threads' CPU share (their own CPU time over their
//! wall time) and the initiator process's.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Child, ChildStdin, ExitCode, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use oxccl_bootstrap::Secret;
use oxccl_kv::meta::P2pMetadata;
use oxccl_kv::{EngineConfig, Opcode, Protocol, SegmentId, TransferEngine, TransferRequest};
use serde::Serialize;

/// The service a target answers with its process's CPU seconds (8 bytes, f64 LE).
const CPU_SERVICE: &str = "kv-bench/cpu";
/// The line a target prints once it serves: `kv-bench target: segment ADDR ...`.
const READY_PREFIX: &str = "kv-bench target: segment ";
/// Default buffer size cap per side when the plan does not ask for more.
const DEFAULT_BUFFER_CAP: usize = 256 << 20;
/// Longest a default warm-up runs.
const WARMUP_CAP: Duration = Duration::from_secs(2);
/// A raw stream's marker asking the target for its CPU time (sent after the data before it).
const RAW_MARK: u64 = u64::MAX;
/// A raw stream's end.
const RAW_END: u64 = 0;

/// Arguments of `oxccl kv-bench`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Columns: #block (bytes per request), #batch (requests per batch; 1 with --sync), #threads, \
#lanes (tcp connections), #iterations (measured batches, or requests with --sync, all threads), \
BW[GB/sec] (1e9 bytes/s), Req/sec, p50..p99.9[usec] (per batch, submit to the end of wait; per \
request with --sync), CPU_init and CPU_target [s/GB] (getrusage of each process, all its threads, \
per 1e9 bytes moved), wait_cpu[%] (the initiator threads' own CPU time over their wall time, \
mean over threads: the waiting thread's share of a core), init_cpu[%] (the initiator process's \
CPU time over the wall time). --json prints the same as one object (GB = 1e9 bytes).

By hand (two hosts or namespaces), with the same OXCCL_SECRET on both:
  oxccl kv-bench --role target --protocol tcp --listen 10.0.0.1:17000
  oxccl kv-bench --role initiator --protocol tcp --segment 10.0.0.1:17000 --block-size 4M")]
pub struct Args {
    /// Which side this process plays; by default both: this process is the initiator and spawns
    /// the target as a child process.
    #[arg(long, value_enum)]
    role: Option<Role>,

    /// What carries the data: the engine's shm or tcp provider, or raw-tcp (plain TCP streams
    /// from the initiator to the target, no engine: the reference for tcp; --op write only).
    #[arg(long, value_enum, default_value = "tcp")]
    protocol: BenchProtocol,

    /// READ (the target's memory into the initiator's) or WRITE.
    #[arg(long, value_enum, default_value = "write")]
    op: Op,

    /// Bytes per request (K, M, G: powers of 1024).
    #[arg(long, default_value = "64K", value_parser = parse_nonzero_size)]
    block_size: usize,

    /// Requests per batch (ignored with --sync).
    #[arg(long, default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch_size: u32,

    /// Initiator threads, each submitting and waiting for its own batches.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,

    /// tcp: connections per opened segment (the engine's lanes); raw-tcp: streams.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    lanes: u32,

    /// tcp: bytes per slice of a large request [default: the engine's, 1M].
    #[arg(long, value_parser = parse_nonzero_size)]
    slice_size: Option<usize>,

    /// Seconds each thread moves data for (after the warm-up).
    #[arg(long, default_value_t = 5.0, value_parser = parse_secs)]
    duration: f64,

    /// Measured batches (requests with --sync) per thread, instead of --duration.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    iters: Option<u64>,

    /// Warm-up batches (requests with --sync) per thread [default: enough to touch the
    /// thread's part of the buffer once, at least 2 batches or 100 requests, at most 2 s].
    #[arg(long)]
    warmup: Option<u64>,

    /// One request at a time with transfer_sync: the latency mode.
    #[arg(long)]
    sync: bool,

    /// Bytes of the managed buffer on each side [default: block x batch x threads, at most
    /// 256M, at least block x threads; a by-hand target: 256M].
    #[arg(long, value_parser = parse_nonzero_size)]
    buffer_size: Option<usize>,

    /// The address this side's engine binds: the target's handshake listener (IP or IP:port;
    /// default 127.0.0.1:0), or the initiator's local address (default: the one that routes to
    /// the segment).
    #[arg(long, value_name = "IP[:PORT]")]
    listen: Option<String>,

    /// The initiator's target: the segment name (the target's handshake IP:port).
    #[arg(long, value_name = "IP:PORT")]
    segment: Option<String>,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,

    /// Seconds any wait (a batch, the handshake) may take before the run fails.
    #[arg(long, default_value_t = 30.0, value_parser = parse_secs)]
    timeout: f64,

    /// How waits wait (the engine's `busy_poll`): `sleep` (the default) or `busy` (the waiting
    /// thread and the tcp progress threads poll without sleeping, a core each). A spawned
    /// target gets the same.
    #[arg(long, value_enum, default_value = "sleep")]
    poll: Poll,

    /// Microseconds a sleeping wait spins first (the engine's `spin`) [default: the engine's, 20].
    #[arg(long)]
    spin_us: Option<u64>,

    /// Internal: this target was spawned by an initiator (it serves until stdin closes).
    #[arg(long, hide = true)]
    child: bool,

    /// Internal: the spawning initiator's pid (the child dies with it).
    #[arg(long, hide = true)]
    parent_pid: Option<u32>,
}

/// How waits wait (`--poll`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Poll {
    /// Spin briefly, then sleep in the provider's wait.
    Sleep,
    /// Poll without sleeping.
    Busy,
}

/// The side a process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Serves a managed buffer as a segment until killed.
    Target,
    /// Opens the segment given with --segment and moves data.
    Initiator,
}

/// What carries the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BenchProtocol {
    /// The engine over the shm provider (same host).
    Shm,
    /// The engine over the tcp provider.
    Tcp,
    /// Plain TCP streams, initiator to target, no engine (the reference).
    RawTcp,
}

impl BenchProtocol {
    fn name(self) -> &'static str {
        match self {
            BenchProtocol::Shm => "shm",
            BenchProtocol::Tcp => "tcp",
            BenchProtocol::RawTcp => "raw-tcp",
        }
    }

    fn engine(self) -> Option<Protocol> {
        match self {
            BenchProtocol::Shm => Some(Protocol::Shm),
            BenchProtocol::Tcp => Some(Protocol::Tcp),
            BenchProtocol::RawTcp => None,
        }
    }
}

/// READ or WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    /// The target's memory into the initiator's.
    Read,
    /// The initiator's memory into the target's.
    Write,
}

impl Op {
    fn opcode(self) -> Opcode {
        match self {
            Op::Read => Opcode::Read,
            Op::Write => Opcode::Write,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

type Result<T> = std::result::Result<T, String>;

fn parse_nonzero_size(s: &str) -> Result<usize> {
    match oxccl_kv::parse_size(s) {
        Some(0) => Err(format!("size {s:?} must be at least 1 byte")),
        Some(n) if n > 1 << 40 => Err(format!("size {s:?} is too large")),
        Some(n) => Ok(n),
        None => Err(format!(
            "invalid size {s:?}: expected bytes with an optional K, M or G suffix (4K, 1M)"
        )),
    }
}

fn parse_secs(s: &str) -> Result<f64> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("invalid seconds {s:?}: expected a number > 0")),
    }
}

/// Runs `oxccl kv-bench`.
pub fn main(args: Args) -> ExitCode {
    let role = match (args.role, &args.segment) {
        (Some(r), _) => Some(r),
        (None, Some(_)) => Some(Role::Initiator),
        (None, None) => None,
    };
    let r = match role {
        Some(Role::Target) => target_main(&args),
        Some(Role::Initiator) => initiator_main(&args),
        None => spawn_main(&args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let who = if args.child { " target" } else { "" };
            eprintln!("oxccl kv-bench{who}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// CPU seconds (user + system) of this process so far, every thread included.
/// Joins every thread; their results in order, or the first error (a panic counts as one,
/// named `what`).
fn join_all<T>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T>>>,
    what: &str,
) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(handles.len());
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(format!("{what} panicked"));
            }
        }
    }
    first_err.map_or(Ok(out), Err)
}

fn process_cpu() -> f64 {
    // SAFETY: getrusage writes only the struct handed to it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage struct.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds of the calling thread so far.
fn thread_cpu() -> f64 {
    // SAFETY: clock_gettime writes only the struct handed to it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The job secret: from the environment, or (a spawning initiator) generated.
fn secret(generate: bool) -> Result<Secret> {
    if generate {
        Secret::from_env_or_generate().map_err(|e| e.to_string())
    } else {
        Secret::from_env_or_user_file().map_err(|e| e.to_string())
    }
}

/// The buffer size of a side: `--buffer-size`, else the plan's.
fn buffer_size(args: &Args) -> usize {
    if let Some(b) = args.buffer_size {
        return b;
    }
    let threads = args.threads as usize;
    let per_op = if args.sync {
        1
    } else {
        args.batch_size as usize
    };
    let want = args
        .block_size
        .saturating_mul(per_op)
        .saturating_mul(threads);
    let floor = args.block_size.saturating_mul(threads);
    want.min(DEFAULT_BUFFER_CAP).max(floor)
}

fn parse_addr(s: &str, what: &str) -> Result<SocketAddr> {
    oxccl_verbs::parse_ip_or_sockaddr(s.trim())
        .ok_or_else(|| format!("{what} {s:?} is not an IP address or IP:port"))
}

/// The local IP that routes to `to` (no packet is sent).
fn local_ip_towards(to: IpAddr) -> IpAddr {
    let any: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        "[::]:0".parse().expect("a valid address")
    };
    UdpSocket::bind(any)
        .and_then(|s| s.connect(SocketAddr::new(to, 9)).map(|()| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip())
        .unwrap_or(if to.is_loopback() {
            to
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        })
}

fn engine_config(args: &Args, secret: Secret, local: SocketAddr) -> Result<EngineConfig> {
    let mut c = EngineConfig::new(secret);
    c.encrypt = oxccl_kv::Encrypt::from_env().map_err(|e| e.to_string())?;
    c.protocol = args
        .protocol
        .engine()
        .ok_or("internal error: raw-tcp has no engine")?;
    c.local_addr = local;
    c.lanes = args.lanes as usize;
    if let Some(s) = args.slice_size {
        c.slice_size = s;
    }
    c.timeout = Duration::from_secs_f64(args.timeout);
    c.busy_poll = args.poll == Poll::Busy;
    if let Some(us) = args.spin_us {
        c.spin = Duration::from_micros(us);
    }
    Ok(c)
}

/// Fills a managed buffer with a pattern, so that every page is backed before the run.
fn fill(engine: &TransferEngine, addr: u64, len: usize) -> Result<()> {
    const CHUNK: usize = 4 << 20;
    let chunk: Vec<u8> = (0..CHUNK.min(len)).map(|i| (i * 131 + 7) as u8).collect();
    let mut off = 0;
    while off < len {
        let n = chunk.len().min(len - off);
        engine
            .write_local(addr + off as u64, &chunk[..n])
            .map_err(|e| format!("filling the buffer: {e}"))?;
        off += n;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The target.

/// `--role target`: serves a managed buffer (or raw-tcp streams) until killed, or until stdin
/// closes for a spawned child.
fn target_main(args: &Args) -> Result<()> {
    if args.child
        && let Some(ppid) = args.parent_pid
    {
        // Never outlive the initiator, even if it is killed.
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
        let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get() as u32);
        if parent != Some(ppid) {
            return Err("the initiator is already gone".into());
        }
    }
    let listen = parse_addr(args.listen.as_deref().unwrap_or("127.0.0.1:0"), "--listen")?;
    let secret = secret(false)?;
    let len = match (args.buffer_size, args.child) {
        (Some(b), _) => b,
        (None, true) => buffer_size(args),
        (None, false) => DEFAULT_BUFFER_CAP,
    };
    let _keep: Box<dyn std::any::Any> = match args.protocol {
        BenchProtocol::RawTcp => {
            let l = TcpListener::bind(listen).map_err(|e| format!("listening on {listen}: {e}"))?;
            let addr = l.local_addr().map_err(|e| e.to_string())?;
            let token = raw_token(&secret);
            // Each stream drains into its own part of a buffer as large as the engine's would
            // be, block after block: the same working set as the engine's target.
            let part = (len / args.lanes as usize).max(args.block_size);
            let block = args.block_size;
            std::thread::Builder::new()
                .name("kv-bench-raw-accept".into())
                .spawn(move || raw_accept(l, token, part, block))
                .map_err(|e| format!("spawning a thread: {e}"))?;
            announce(&format!("{READY_PREFIX}{addr} (raw-tcp streams)"))?;
            Box::new(())
        }
        _ => {
            let config = engine_config(args, secret.clone(), listen)?;
            let engine = TransferEngine::new(config, Arc::new(P2pMetadata::new(secret)))
                .map_err(|e| format!("starting the engine: {e}"))?;
            let buf = engine
                .allocate_managed_buffer(len)
                .map_err(|e| format!("allocating {len} bytes: {e}"))?;
            fill(&engine, buf, len)?;
            engine.serve(
                CPU_SERVICE,
                Arc::new(|_, _| Ok(process_cpu().to_le_bytes().to_vec())),
            );
            announce(&format!(
                "{READY_PREFIX}{} ({} bytes at {buf:#x}, providers {:?})",
                engine.name(),
                len,
                engine.providers()
            ))?;
            Box::new(engine)
        }
    };
    if args.child {
        // Serve until the initiator closes our stdin (or dies).
        let mut sink = Vec::new();
        let _ = std::io::stdin().lock().read_to_end(&mut sink);
        Ok(())
    } else {
        loop {
            std::thread::park();
        }
    }
}

fn announce(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing to stdout: {e}"))
}

/// The 32 bytes a raw stream opens with: proof of the job secret.
fn raw_token(secret: &Secret) -> [u8; 32] {
    secret.mac_of("oxccl kv-bench raw-tcp stream", &[])
}

/// Accepts raw streams forever, each drained by its own thread into its own `part`-byte
/// buffer, `block` bytes after `block` bytes.
fn raw_accept(l: TcpListener, token: [u8; 32], part: usize, block: usize) {
    for s in l.incoming() {
        let Ok(s) = s else { continue };
        let _ = std::thread::Builder::new()
            .name("kv-bench-raw-drain".into())
            .spawn(move || {
                if let Err(e) = raw_drain(s, &token, part, block) {
                    eprintln!("oxccl kv-bench target: a raw stream ended: {e}");
                }
            });
    }
}

/// The target's side of one raw stream: checks the token, then drains length-prefixed data
/// into consecutive `block`-sized places of a `part`-byte buffer, and answers each mark with its
/// process's CPU seconds.
fn raw_drain(mut s: TcpStream, token: &[u8; 32], part: usize, block: usize) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut got = [0u8; 32];
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.read_exact(&mut got)?;
    if got.iter().zip(token).fold(0u8, |a, (x, y)| a | (x ^ y)) != 0 {
        return Err(std::io::Error::other("refused a stream with a wrong token"));
    }
    s.set_read_timeout(None)?;
    let mut buf: Vec<u8> = (0..part).map(|i| (i * 131 + 7) as u8).collect();
    let slots = (part / block).max(1);
    let mut slot = 0;
    loop {
        let mut h = [0u8; 8];
        match s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        match u64::from_le_bytes(h) {
            RAW_END => return Ok(()),
            RAW_MARK => s.write_all(&process_cpu().to_le_bytes())?,
            mut n => {
                let base = (slot % slots) * block;
                slot += 1;
                let mut off = 0;
                while n > 0 {
                    let at = (base + off) % buf.len();
                    let k = (buf.len() - at).min(usize::try_from(n).unwrap_or(usize::MAX));
                    let got = s.read(&mut buf[at..at + k])?;
                    if got == 0 {
                        return Err(std::io::Error::from(ErrorKind::UnexpectedEof));
                    }
                    n -= got as u64;
                    off += got;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The spawned target.

/// A target child process: killed and reaped when dropped, unless finished.
struct TargetChild {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl TargetChild {
    /// Spawns `oxccl kv-bench --role target --child ...` and reads its segment name.
    fn spawn(args: &Args, secret: &Secret) -> Result<(TargetChild, String)> {
        let mut cmd =
            crate::reexec(["kv-bench"]).map_err(|e| format!("finding this program: {e}"))?;
        cmd.args(["--role", "target", "--child"])
            .args(["--protocol", args.protocol.name()])
            .args(["--listen", args.listen.as_deref().unwrap_or("127.0.0.1:0")])
            .args(["--buffer-size", &buffer_size(args).to_string()])
            .args(["--block-size", &args.block_size.to_string()])
            .args(["--lanes", &args.lanes.to_string()])
            .args(["--timeout", &args.timeout.to_string()])
            .args([
                "--poll",
                if args.poll == Poll::Busy {
                    "busy"
                } else {
                    "sleep"
                },
            ])
            .args(["--parent-pid", &std::process::id().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(s) = args.slice_size {
            cmd.args(["--slice-size", &s.to_string()]);
        }
        if let Some(us) = args.spin_us {
            cmd.args(["--spin-us", &us.to_string()]);
        }
        secret.export_to(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawning the target process: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or("the target's stdout is missing")?;
        let mut me = TargetChild { child, stdin };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let mut r = BufReader::new(stdout);
            let got = r.read_line(&mut line).map(|_| line);
            let _ = tx.send(got);
            // Keep draining, so that the child never blocks on a full pipe.
            let mut sink = Vec::new();
            let _ = r.read_to_end(&mut sink);
        });
        let wait = Duration::from_secs_f64(args.timeout.max(30.0));
        let line = match rx.recv_timeout(wait) {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return Err(format!("reading the target's stdout: {e}")),
            Err(_) => {
                return Err(format!(
                    "the target process did not say where it serves within {wait:?}"
                ));
            }
        };
        let Some(rest) = line.trim().strip_prefix(READY_PREFIX) else {
            let status = me.child.try_wait().ok().flatten();
            return Err(match status {
                Some(s) => format!("the target process exited ({s}) before serving"),
                None => format!("the target process said {:?}", line.trim()),
            });
        };
        let name = rest
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        Ok((me, name))
    }

    fn id(&self) -> u32 {
        self.child.id()
    }

    /// Closes the child's stdin and reaps it.
    fn finish(mut self) -> Result<()> {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) if s.success() => return Ok(()),
                Ok(Some(s)) => return Err(format!("the target process failed ({s})")),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err("the target process did not exit; killed".into());
                }
                Err(e) => return Err(format!("waiting for the target process: {e}")),
            }
        }
    }
}

impl Drop for TargetChild {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The default mode: spawn the target, run the initiator against it, reap the target.
fn spawn_main(args: &Args) -> Result<()> {
    let secret = secret(true)?;
    let (child, name) = TargetChild::spawn(args, &secret)?;
    let who = format!("spawned process {} (segment {name})", child.id());
    let r = run_initiator(args, secret, &name, &who);
    match r {
        Ok(()) => child.finish(),
        Err(e) => Err(e),
    }
}

/// `--role initiator --segment IP:port`.
fn initiator_main(args: &Args) -> Result<()> {
    let name = args
        .segment
        .clone()
        .ok_or("--role initiator needs --segment IP:PORT (the target's segment name)")?;
    let secret = secret(false)?;
    run_initiator(args, secret, &name, &format!("segment {name}"))
}

// ---------------------------------------------------------------------------------------------
// The initiator.

/// One initiator thread's measurement.
#[derive(Default)]
struct ThreadResult {
    /// Nanoseconds per measured operation (a batch, or a request with --sync).
    lats: Vec<u64>,
    /// Bytes moved in the measured part.
    bytes: u64,
    /// Requests in the measured part.
    reqs: u64,
    /// Measured operations.
    ops: u64,
    /// When the thread's last operation ended.
    end: Option<Instant>,
    /// The thread's wall and CPU seconds over the measured part.
    wall: f64,
    cpu: f64,
}

/// The whole run's figures.
struct Outcome {
    results: Vec<ThreadResult>,
    secs: f64,
    init_cpu: f64,
    target_cpu: Option<f64>,
    /// The segment's lanes were sealed (`OXCCL_ENCRYPT`).
    encrypted: bool,
}

/// How many warm-up operations a thread runs, and whether they stop at [`WARMUP_CAP`].
fn warmup_ops(args: &Args, region: usize) -> (u64, bool) {
    if let Some(w) = args.warmup {
        return (w, false);
    }
    let per_op = if args.sync {
        args.block_size
    } else {
        args.block_size * args.batch_size as usize
    };
    let cover = region.div_ceil(per_op.max(1)) as u64;
    let floor = if args.sync { 100 } else { 2 };
    (cover.max(floor), true)
}

fn run_initiator(args: &Args, secret: Secret, name: &str, who: &str) -> Result<()> {
    let outcome = match args.protocol {
        BenchProtocol::RawTcp => run_raw(args, &secret, name)?,
        _ => run_engine(args, secret, name)?,
    };
    report(args, who, &outcome)
}

fn run_engine(args: &Args, secret: Secret, name: &str) -> Result<Outcome> {
    let to = parse_addr(name, "--segment")?;
    let local = match &args.listen {
        Some(l) => parse_addr(l, "--listen")?,
        None => SocketAddr::new(local_ip_towards(to.ip()), 0),
    };
    let config = engine_config(args, secret.clone(), local)?;
    let engine = TransferEngine::new(config, Arc::new(P2pMetadata::new(secret)))
        .map_err(|e| format!("starting the engine: {e}"))?;
    let threads = args.threads as usize;
    let block = args.block_size;
    let llen = buffer_size(args);
    let lbuf = engine
        .allocate_managed_buffer(llen)
        .map_err(|e| format!("allocating {llen} bytes: {e}"))?;
    fill(&engine, lbuf, llen)?;
    let seg = engine
        .open_segment(name)
        .map_err(|e| format!("opening segment {name}: {e}"))?;
    let encrypted = engine.lanes_encrypted(seg).unwrap_or(false);
    let desc = engine
        .segment_descriptor(seg)
        .map_err(|e| format!("segment {name}: {e}"))?;
    let rb = desc
        .buffers
        .iter()
        .max_by_key(|b| b.len)
        .ok_or_else(|| format!("segment {name} has no buffer"))?;
    let (rbase, rlen) = (rb.addr, rb.len as usize);
    let lregion = llen / threads;
    let rregion = rlen / threads;
    let (lslots, rslots) = (lregion / block, rregion / block);
    if lslots == 0 || rslots == 0 {
        return Err(format!(
            "{threads} threads of {block}-byte requests need buffers of at least {} bytes: \
             this side has {llen}, the target {rlen} (--buffer-size)",
            block * threads
        ));
    }
    let target_cpu = |what: &str| -> Result<f64> {
        let b = engine
            .call(seg, CPU_SERVICE, &[])
            .map_err(|e| format!("asking the target for its CPU time ({what}): {e}"))?;
        let a: [u8; 8] = b
            .as_slice()
            .try_into()
            .map_err(|_| "the target's CPU time is not 8 bytes".to_string())?;
        Ok(f64::from_le_bytes(a))
    };
    let per_op = if args.sync {
        1
    } else {
        args.batch_size as usize
    };
    let (warm, capped) = warmup_ops(args, lregion.min(rregion));
    let run = EngineRun {
        args,
        engine: &engine,
        seg,
        local: (lbuf, lregion, lslots),
        remote: (rbase, rregion, rslots),
        per_op,
        warm: (warm, capped),
        ready: Barrier::new(threads + 1),
        go: Barrier::new(threads + 1),
    };
    let (ready, go) = (&run.ready, &run.go);
    let outcome = std::thread::scope(|sc| -> Result<Outcome> {
        let mut handles = Vec::new();
        for t in 0..threads {
            let run = &run;
            handles.push(sc.spawn(move || run.thread(t)));
        }
        ready.wait();
        // Everyone warmed up: the target's CPU, ours, then go.
        let tc0 = target_cpu("before the run");
        let c0 = process_cpu();
        let t0 = Instant::now();
        go.wait();
        let joined = join_all(handles, "an initiator thread");
        let c1 = process_cpu();
        let results = joined?;
        let end = results.iter().filter_map(|r| r.end).max().unwrap_or(t0);
        let tc1 = target_cpu("after the run");
        Ok(Outcome {
            secs: (end - t0).as_secs_f64(),
            init_cpu: c1 - c0,
            target_cpu: match (tc0, tc1) {
                (Ok(a), Ok(b)) => Some(b - a),
                _ => None,
            },
            results,
            encrypted,
        })
    })?;
    drop(engine);
    Ok(outcome)
}

/// What the initiator threads of an engine run share.
struct EngineRun<'a> {
    args: &'a Args,
    engine: &'a TransferEngine,
    seg: SegmentId,
    /// This side's buffer, each thread's region of it (bytes), and its blocks per region.
    local: (u64, usize, usize),
    /// The target's buffer, region and blocks, likewise.
    remote: (u64, usize, usize),
    /// Requests per measured operation (a batch, or one with --sync).
    per_op: usize,
    /// Warm-up operations per thread, and whether they stop at [`WARMUP_CAP`].
    warm: (u64, bool),
    /// Every thread has warmed up; the run starts.
    ready: Barrier,
    go: Barrier,
}

impl EngineRun<'_> {
    /// Initiator thread `t`: warms up, waits for the start, and measures its operations.
    fn thread(&self, t: usize) -> Result<ThreadResult> {
        let (args, engine, seg, per_op) = (self.args, self.engine, self.seg, self.per_op);
        let ((lbuf, lregion, lslots), (rbase, rregion, rslots)) = (self.local, self.remote);
        let (warm, capped) = self.warm;
        let (ready, go) = (&self.ready, &self.go);
        let (block, opcode) = (args.block_size, args.op.opcode());
        let timeout = Duration::from_secs_f64(args.timeout);
        let duration = Duration::from_secs_f64(args.duration);
        let lb = lbuf + (t * lregion) as u64;
        let rb = rbase + (t * rregion) as u64;
        let mut k = 0u64;
        let mut reqs = Vec::with_capacity(per_op);
        let mut next = |reqs: &mut Vec<TransferRequest>| {
            reqs.clear();
            for _ in 0..per_op {
                let (ls, rs) = ((k % lslots as u64) as usize, (k % rslots as u64) as usize);
                reqs.push(TransferRequest {
                    opcode,
                    source: lb + (ls * block) as u64,
                    target_id: seg,
                    target_offset: rb + (rs * block) as u64,
                    length: block,
                });
                k += 1;
            }
        };
        let one = |reqs: &[TransferRequest]| -> Result<()> {
            if args.sync {
                engine
                    .transfer_sync(reqs, None)
                    .map_err(|e| format!("thread {t}: {e}"))
            } else {
                let b = engine
                    .submit(reqs, None)
                    .map_err(|e| format!("thread {t}: submit: {e}"))?;
                engine
                    .wait(b, timeout)
                    .map_err(|e| format!("thread {t}: wait: {e}"))?;
                engine
                    .free_batch(b)
                    .map_err(|e| format!("thread {t}: free_batch: {e}"))
            }
        };
        let w0 = Instant::now();
        let mut warm_err = None;
        for _ in 0..warm {
            if capped && w0.elapsed() >= WARMUP_CAP {
                break;
            }
            next(&mut reqs);
            if let Err(e) = one(&reqs) {
                warm_err = Some(e);
                break;
            }
        }
        ready.wait();
        go.wait();
        if let Some(e) = warm_err {
            return Err(e);
        }
        let mut r = ThreadResult {
            lats: Vec::with_capacity(args.iters.unwrap_or(1 << 16).min(1 << 24) as usize),
            ..ThreadResult::default()
        };
        let t0 = Instant::now();
        let c0 = thread_cpu();
        let deadline = t0 + duration;
        let mut last = t0;
        loop {
            match args.iters {
                Some(n) if r.ops >= n => break,
                None if last >= deadline => break,
                _ => {}
            }
            next(&mut reqs);
            let s = Instant::now();
            one(&reqs)?;
            last = Instant::now();
            r.lats.push((last - s).as_nanos() as u64);
            r.ops += 1;
            r.reqs += per_op as u64;
            r.bytes += (per_op * block) as u64;
        }
        r.cpu = thread_cpu() - c0;
        r.wall = (last - t0).as_secs_f64();
        r.end = Some(last);
        Ok(r)
    }
}

/// raw-tcp: `--lanes` streams, each sent by its own thread.
fn run_raw(args: &Args, secret: &Secret, name: &str) -> Result<Outcome> {
    if args.op == Op::Read {
        return Err(
            "raw-tcp streams go one way (initiator to target): use --op write (over loopback \
             and a symmetric link the direction does not matter)"
                .into(),
        );
    }
    let to = parse_addr(name, "--segment")?;
    let token = raw_token(secret);
    let streams = args.lanes as usize;
    let block = args.block_size;
    let timeout = Duration::from_secs_f64(args.timeout);
    let mut conns = Vec::new();
    for i in 0..streams {
        let mut s = TcpStream::connect_timeout(&to, timeout)
            .map_err(|e| format!("raw stream {i} to {to}: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .and_then(|()| s.write_all(&token))
            .map_err(|e| format!("raw stream {i} to {to}: {e}"))?;
        conns.push(s);
    }
    let (warm, capped) = match args.warmup {
        Some(w) => (w, false),
        None => (((256usize << 20) / block).max(4) as u64, true),
    };
    let duration = Duration::from_secs_f64(args.duration);
    // Each stream sends from its own part of a buffer as large as the engine's, block after
    // block: the same working set as the engine's initiator.
    let part = (buffer_size(args) / streams).max(block);
    let slots = part / block;
    let ready = Barrier::new(streams + 1);
    let go = Barrier::new(streams + 1);
    std::thread::scope(|sc| -> Result<Outcome> {
        let mut handles = Vec::new();
        for (i, mut s) in conns.into_iter().enumerate() {
            let (ready, go) = (&ready, &go);
            handles.push(sc.spawn(move || -> Result<(ThreadResult, f64, f64)> {
                let buf: Vec<u8> = (0..part).map(|j| (j * 131 + 7) as u8).collect();
                let io = |e: std::io::Error| format!("raw stream {i}: {e}");
                let mut slot = 0;
                let mut send = |s: &mut TcpStream| -> std::io::Result<()> {
                    let at = (slot % slots) * block;
                    slot += 1;
                    s.write_all(&(block as u64).to_le_bytes())?;
                    s.write_all(&buf[at..at + block])
                };
                let mark = |s: &mut TcpStream| -> std::io::Result<f64> {
                    s.write_all(&RAW_MARK.to_le_bytes())?;
                    let mut c = [0u8; 8];
                    s.read_exact(&mut c)?;
                    Ok(f64::from_le_bytes(c))
                };
                let w0 = Instant::now();
                let mut warm_r = Ok(0.0);
                for _ in 0..warm {
                    if capped && w0.elapsed() >= WARMUP_CAP {
                        break;
                    }
                    if let Err(e) = send(&mut s) {
                        warm_r = Err(e);
                        break;
                    }
                }
                let warm_r = warm_r.and_then(|_| mark(&mut s));
                ready.wait();
                go.wait();
                let cpu_a = warm_r.map_err(io)?;
                let mut r = ThreadResult::default();
                let t0 = Instant::now();
                let c0 = thread_cpu();
                let deadline = t0 + duration;
                let mut last = t0;
                loop {
                    match args.iters {
                        Some(n) if r.ops >= n => break,
                        None if last >= deadline => break,
                        _ => {}
                    }
                    send(&mut s).map_err(io)?;
                    last = Instant::now();
                    r.ops += 1;
                    r.reqs += 1;
                    r.bytes += block as u64;
                }
                // The end: when the target has read the last byte.
                let cpu_b = mark(&mut s).map_err(io)?;
                let end = Instant::now();
                let _ = s.write_all(&RAW_END.to_le_bytes());
                r.cpu = thread_cpu() - c0;
                r.wall = (end - t0).as_secs_f64();
                r.end = Some(end);
                Ok((r, cpu_a, cpu_b))
            }));
        }
        ready.wait();
        let c0 = process_cpu();
        let t0 = Instant::now();
        go.wait();
        let joined = join_all(handles, "a raw stream thread");
        let c1 = process_cpu();
        let (mut ta, mut tb) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut results = Vec::new();
        for (r, a, b) in joined? {
            results.push(r);
            ta = ta.max(a);
            tb = tb.max(b);
        }
        let end = results.iter().filter_map(|r| r.end).max().unwrap_or(t0);
        Ok(Outcome {
            secs: (end - t0).as_secs_f64(),
            init_cpu: c1 - c0,
            target_cpu: Some(tb - ta),
            results,
            encrypted: false,
        })
    })
}

// ---------------------------------------------------------------------------------------------
// The report.

/// The result row; JSON field names follow the columns.
#[derive(Debug, Serialize)]
struct Row {
    /// Always `kv_bench`.
    test: &'static str,
    /// `shm`, `tcp` or `raw-tcp`.
    protocol: &'static str,
    /// `read` or `write`.
    op: &'static str,
    /// `batch` or `sync`.
    mode: &'static str,
    /// Bytes per request.
    block_bytes: usize,
    /// Requests per batch (1 in sync mode).
    batch: u32,
    /// Initiator threads (raw-tcp: streams).
    threads: u32,
    /// tcp connections (1 for shm).
    lanes: u32,
    /// Measured operations, all threads.
    iterations: u64,
    /// Bytes moved in the measured part.
    bytes: u64,
    /// Seconds of the measured part.
    secs: f64,
    /// Bandwidth, 1e9 bytes per second.
    gb_per_sec: f64,
    /// Requests per second.
    req_per_sec: f64,
    /// Latency percentiles in µs (per batch, or per request in sync mode; none for raw-tcp).
    p50_usec: Option<f64>,
    /// 90th percentile.
    p90_usec: Option<f64>,
    /// 99th percentile.
    p99_usec: Option<f64>,
    /// 99.9th percentile.
    p99_9_usec: Option<f64>,
    /// Initiator process CPU seconds per 1e9 bytes.
    cpu_init_s_per_gb: f64,
    /// Target process CPU seconds per 1e9 bytes (when the target answered).
    cpu_target_s_per_gb: Option<f64>,
    /// The initiator threads' own CPU time over their wall time, mean, in % of a core.
    wait_cpu_pct: f64,
    /// The initiator process's CPU time over the wall time, in % of a core.
    init_cpu_pct: f64,
    /// The lanes were sealed (`OXCCL_ENCRYPT`; never over shm or raw-tcp).
    encrypted: bool,
}

/// The nearest-rank percentile `p` of sorted `v`, in µs.
fn percentile(v: &[u64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1] as f64 / 1e3)
}

const COLUMNS: [&str; 15] = [
    "#block",
    "#batch",
    "#threads",
    "#lanes",
    "#iterations",
    "BW[GB/sec]",
    "Req/sec",
    "p50[usec]",
    "p90[usec]",
    "p99[usec]",
    "p99.9[usec]",
    "CPU_init[s/GB]",
    "CPU_target[s/GB]",
    "wait_cpu[%]",
    "init_cpu[%]",
];

fn report(args: &Args, who: &str, o: &Outcome) -> Result<()> {
    let mut lats: Vec<u64> = o
        .results
        .iter()
        .flat_map(|r| r.lats.iter().copied())
        .collect();
    lats.sort_unstable();
    let bytes: u64 = o.results.iter().map(|r| r.bytes).sum();
    let reqs: u64 = o.results.iter().map(|r| r.reqs).sum();
    let ops: u64 = o.results.iter().map(|r| r.ops).sum();
    let secs = o.secs.max(1e-9);
    let gb = bytes as f64 / 1e9;
    let per_gb = |c: f64| if gb > 0.0 { c / gb } else { 0.0 };
    let wait_cpu = o
        .results
        .iter()
        .map(|r| if r.wall > 0.0 { r.cpu / r.wall } else { 0.0 })
        .sum::<f64>()
        / o.results.len().max(1) as f64;
    let raw = args.protocol == BenchProtocol::RawTcp;
    let lanes = match args.protocol {
        BenchProtocol::Shm => 1,
        _ => args.lanes,
    };
    let row = Row {
        test: "kv_bench",
        protocol: args.protocol.name(),
        op: args.op.name(),
        mode: if args.sync { "sync" } else { "batch" },
        block_bytes: args.block_size,
        batch: if args.sync || raw { 1 } else { args.batch_size },
        threads: if raw { args.lanes } else { args.threads },
        lanes,
        iterations: ops,
        bytes,
        secs,
        gb_per_sec: bytes as f64 / secs / 1e9,
        req_per_sec: reqs as f64 / secs,
        p50_usec: percentile(&lats, 0.5),
        p90_usec: percentile(&lats, 0.9),
        p99_usec: percentile(&lats, 0.99),
        p99_9_usec: percentile(&lats, 0.999),
        cpu_init_s_per_gb: per_gb(o.init_cpu),
        cpu_target_s_per_gb: o.target_cpu.map(per_gb),
        wait_cpu_pct: 100.0 * wait_cpu,
        init_cpu_pct: 100.0 * o.init_cpu / secs,
        encrypted: o.encrypted,
    };
    let mut out = std::io::stdout().lock();
    let text = if args.json {
        serde_json::to_string(&row).map_err(|e| e.to_string())? + "\n"
    } else {
        table(args, who, &row)
    };
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("writing to stdout: {e}")),
    }
}

/// The perftest-like header, the column names and the row.
fn table(args: &Args, who: &str, r: &Row) -> String {
    let rule = "-".repeat(95);
    let title = match args.protocol {
        BenchProtocol::RawTcp => "KV Transfer Benchmark: raw TCP streams (reference)".to_string(),
        _ => format!(
            "KV Transfer Engine {} Benchmark",
            args.op.name().to_uppercase()
        ),
    };
    let mut facts: Vec<(&str, String)> = Vec::new();
    facts.push((
        "Protocol",
        match args.protocol {
            BenchProtocol::Shm => "shm (one memcpy, no syscall on the data path)".into(),
            BenchProtocol::Tcp => format!(
                "tcp, {} lane(s), slices of {} bytes",
                args.lanes,
                args.slice_size.unwrap_or(1 << 20)
            ),
            BenchProtocol::RawTcp => format!(
                "{} plain TCP stream(s), one sending and one draining thread each",
                args.lanes
            ),
        },
    ));
    facts.push((
        "Mode",
        match (args.sync, args.protocol) {
            (_, BenchProtocol::RawTcp) => "streaming, length-prefixed writes".into(),
            (true, _) => "one request at a time, transfer_sync (latency per request)".into(),
            (false, _) => format!(
                "batches of {} requests, submit + wait, one batch in flight per thread \
                 (latency per batch)",
                args.batch_size
            ),
        },
    ));
    if args.protocol != BenchProtocol::RawTcp {
        facts.push(("Threads", args.threads.to_string()));
        facts.push((
            "Buffer",
            format!("{} bytes on this side (managed)", buffer_size(args)),
        ));
    }
    facts.push((
        "Run",
        match args.iters {
            Some(n) => format!("{n} operations per thread (+ warm-up)"),
            None => format!("{} s per thread (+ warm-up)", args.duration),
        },
    ));
    facts.push(("Target", who.to_string()));
    facts.push((
        "Units",
        "GB = 1e9 bytes; CPU = getrusage of each process, all threads".into(),
    ));
    let mut s = format!("{rule}\n{title:^95}\n");
    for (k, v) in facts {
        s.push_str(&format!(" {k:<16}: {v}\n"));
    }
    s.push_str(&rule);
    s.push('\n');
    s.push(' ');
    s.push_str(&COLUMNS.join("   "));
    s.push('\n');
    let f = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
    let line = format!(
        " {:<8} {:<8} {:<10} {:<8} {:<13} {:<12.3} {:<9.0} {:<11} {:<11} {:<11} {:<13} {:<16.4} {:<18} {:<13.1} {:.1}",
        r.block_bytes,
        r.batch,
        r.threads,
        r.lanes,
        r.iterations,
        r.gb_per_sec,
        r.req_per_sec,
        f(r.p50_usec),
        f(r.p90_usec),
        f(r.p99_usec),
        f(r.p99_9_usec),
        r.cpu_init_s_per_gb,
        r.cpu_target_s_per_gb
            .map(|v| format!("{v:.4}"))
            .unwrap_or_else(|| "-".into()),
        r.wait_cpu_pct,
        r.init_cpu_pct,
    );
    s.push_str(line.trim_end());
    s.push('\n');
    s.push_str(&rule);
    s.push('\n');
    s
}
