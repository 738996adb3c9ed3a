//! `oxccl run -n N [--] PROGRAM ARGS...`: a local launcher, like `torchrun --standalone`.
//!
//! Starts N copies of PROGRAM on this host with torchrun's environment (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK=0`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` =
//! a port that was free when the job started, on which rank 0 serves the bootstrap store),
//! `OXCCL_JOB_ID` (random, or the launcher's own) and the job's secret (`OXCCL_SECRET` or
//! `OXCCL_SECRET_FILE`: the launcher's, or a freshly generated one). That is everything
//! `oxccl_bootstrap::Bootstrap::from_env()` needs.
//!
//! Every line a rank writes to stdout or stderr comes out on the launcher's stdout or stderr
//! with the prefix `[RANK] `, a whole line at a time (`--no-prefix`: the ranks inherit the
//! launcher's stdout and stderr). Each rank runs in a process group of its own, with stdin
//! from `/dev/null`.
//!
//! When a rank fails (non-zero exit or a signal), the launcher names it on stderr, sends SIGTERM
//! to the others' process groups, SIGKILL after the grace period, reaps them and exits with
//! that rank's status (its exit code, or 128 + the signal). The same happens on `--timeout`
//! (exit 124), when the launcher gets SIGINT, SIGTERM or SIGHUP (exit 128 + that signal; a
//! second one sends SIGKILL at once), and when a rank cannot be started (exit 127). Whatever
//! a rank leaves behind in its process group when it exits is killed (as Slurm does at the end
//! of a step); on Linux the ranks also get SIGKILL if the launcher dies.
//!
//! Other subcommands re-launch this binary under the launcher with [`launch`].

use std::ffi::{OsStr, OsString};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libc::c_int;

/// Default time between SIGTERM and SIGKILL when stopping the ranks.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// Exit code when `--timeout` stops the job (as `timeout(1)`).
pub const EXIT_TIMEOUT: i32 = 124;

/// Exit code when a rank cannot be started (as a shell's "command not found").
pub const EXIT_CANNOT_START: i32 = 127;

/// A line longer than this is written out in pieces, each prefixed and ended with a newline.
const MAX_LINE: usize = 64 * 1024;

/// How long to wait, once every rank is reaped, for their output pipes to close.
const OUTPUT_LINGER: Duration = Duration::from_secs(2);

/// Longest sleep of the monitor loop between checks (signals wake it at once anyway).
const MAX_TICK: Duration = Duration::from_millis(500);

/// Options of `oxccl run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of ranks to start.
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_name = "N",
        value_parser = parse_nproc
    )]
    nproc: usize,
    /// Let the ranks write to the launcher's stdout and stderr directly, without the
    /// `[RANK] ` prefix on each line.
    #[arg(long)]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_secs)]
    grace: Duration,
    /// Stop the job and exit with status 124 when it runs longer than this many seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_timeout)]
    timeout: Option<Duration>,
    /// The program to start in every rank, and its arguments (put `--` before them when the
    /// program is an option-like word).
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    command: Vec<OsString>,
}

fn parse_nproc(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("the number of ranks must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "'{s}' is not a number of ranks (a positive integer)"
        )),
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .and_then(|x| Duration::try_from_secs_f64(x).ok())
        .ok_or_else(|| format!("'{s}' is not a number of seconds"))
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    match parse_secs(s)? {
        d if d.is_zero() => Err("the timeout must be more than 0 seconds".into()),
        d => Ok(d),
    }
}

/// `oxccl run`: runs the job and turns [`launch`]'s result into the exit code.
pub fn main(args: Args) -> ExitCode {
    let Some((program, program_args)) = args.command.split_first() else {
        note("error: no PROGRAM given");
        return ExitCode::from(2);
    };
    let mut opts = LaunchOptions::new(args.nproc);
    opts.prefix_output = !args.no_prefix;
    opts.grace = args.grace;
    opts.timeout = args.timeout;
    match launch(&opts, program, program_args) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            note(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// How [`launch`] runs a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Number of ranks; at least 1.
    pub nproc: usize,
    /// Whether each line of the ranks' stdout and stderr is prefixed with `[RANK] ` (through
    /// pipes); `false`: the ranks inherit the launcher's stdout and stderr.
    pub prefix_output: bool,
    /// Time between SIGTERM and SIGKILL when stopping the ranks.
    pub grace: Duration,
    /// Stop the job (exit code 124) when it runs longer than this.
    pub timeout: Option<Duration>,
}

impl LaunchOptions {
    /// `nproc` ranks with prefixed output, the default grace period and no timeout.
    pub fn new(nproc: usize) -> LaunchOptions {
        LaunchOptions {
            nproc,
            prefix_output: true,
            grace: DEFAULT_GRACE,
            timeout: None,
        }
    }
}

/// Runs `program` with `args` (not including argv\[0\]) as `opts.nproc` ranks of one job, with
/// the torchrun environment and the job's secret, and waits for all of them.
///
/// Returns the exit code for the launcher: 0 when every rank exits with 0; otherwise that of
/// the first rank to fail (its exit code, or 128 + the signal that killed it), 124 on
/// `opts.timeout`, 127 when a rank cannot be started, 128 + the signal when this process gets
/// SIGINT, SIGTERM or SIGHUP. In every case no rank is left running, and what happened has been
/// written to stderr as one line starting with `oxccl run: `.
///
/// `Err` (and nothing started) when `opts.nproc` is 0, when the secret configured in the
/// environment is unusable, when no free port is found, or when another `launch` is running in
/// this process (it installs process-wide signal handlers for its duration: SIGCHLD, and SIGINT,
/// SIGTERM and SIGHUP unless they are ignored; the previous ones are put back on return).
///
/// To re-launch the current binary under the launcher (when `RANK` is not set):
/// `launch(&LaunchOptions::new(4), std::env::current_exe()?.as_os_str(), &args)`.
pub fn launch(opts: &LaunchOptions, program: &OsStr, args: &[OsString]) -> Result<i32, String> {
    if opts.nproc == 0 {
        return Err("the number of ranks (-n) must be at least 1".into());
    }
    let secret = oxccl_bootstrap::Secret::from_env_or_generate()
        .map_err(|e| format!("the job's secret: {e}"))?;
    let port = free_port()?;
    let job_id = match std::env::var("OXCCL_JOB_ID") {
        Ok(id) if !id.trim().is_empty() => id,
        _ => random_job_id()?,
    };
    let signals = SignalGuard::install()?;
    let env = RankEnv {
        port,
        job_id: &job_id,
        secret: &secret,
        launcher_pid: std::process::id(),
    };
    let started = Instant::now();
    let deadline = opts.timeout.and_then(|t| started.checked_add(t));

    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers: Vec<JoinHandle<()>> = Vec::new();
    let mut ranks: Vec<Rank> = Vec::with_capacity(opts.nproc);
    let mut job = Job {
        outcome: None,
        kill_at: None,
        killed: false,
        grace: opts.grace,
    };

    let mut signals_seen = 0;
    for rank in 0..opts.nproc {
        let (count, sig) = signals.received();
        if count > 0 {
            signals_seen = count;
            note(&format!(
                "received {} while starting the ranks{}",
                signal_name(sig).unwrap_or("a signal"),
                stopping(running(&ranks), false)
            ));
            job.stop(Outcome::Signaled(sig), &ranks);
            break;
        }
        let mut cmd = rank_command(opts, program, args, rank, &env);
        match cmd.spawn() {
            Ok(mut child) => {
                let pid = child.id() as i32;
                let pipes = (child.stdout.take(), child.stderr.take());
                ranks.push(Rank {
                    child,
                    pid,
                    status: None,
                });
                if let (Some(out), Some(err)) = pipes {
                    for (src, to_stderr) in [
                        (Box::new(out) as Box<dyn Read + Send>, false),
                        (Box::new(err), true),
                    ] {
                        match spawn_reader(src, rank, to_stderr, done_tx.clone()) {
                            Ok(h) => readers.push(h),
                            Err(e) => {
                                let running = running(&ranks);
                                note(&format!(
                                    "cannot start a thread for the output of rank {rank}: {e}{}",
                                    stopping(running, false)
                                ));
                                job.stop(Outcome::CannotStart, &ranks);
                                break;
                            }
                        }
                    }
                    if job.outcome.is_some() {
                        break;
                    }
                }
            }
            Err(e) => {
                note(&format!(
                    "cannot start rank {rank}: {}: {e}{}",
                    program.to_string_lossy(),
                    stopping(running(&ranks), false)
                ));
                job.stop(Outcome::CannotStart, &ranks);
                break;
            }
        }
    }
    drop(done_tx);

    supervise(opts, &mut ranks, &mut job, &signals, signals_seen, deadline);
    wait_for_output(&done_rx, readers);
    drop(signals);
    Ok(job.outcome.map_or(0, |o| o.exit_code()))
}

/// What every rank's environment shares.
struct RankEnv<'a> {
    port: u16,
    job_id: &'a str,
    secret: &'a oxccl_bootstrap::Secret,
    launcher_pid: u32,
}

/// The command that starts `rank`: torchrun's variables, the store, the job id and secret,
/// its own process group, and death with the launcher.
fn rank_command(
    opts: &LaunchOptions,
    program: &OsStr,
    args: &[OsString],
    rank: usize,
    env: &RankEnv<'_>,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", opts.nproc.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", opts.nproc.to_string())
        .env("GROUP_RANK", "0")
        .env("GROUP_WORLD_SIZE", "1")
        .env("ROLE_RANK", rank.to_string())
        .env("ROLE_WORLD_SIZE", opts.nproc.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", env.port.to_string())
        .env("OXCCL_JOB_ID", env.job_id)
        // Explicit rank options would override the launcher's for every rank alike.
        .env_remove("OXCCL_RANK")
        .env_remove("OXCCL_WORLD_SIZE")
        .env_remove("OXCCL_LOCAL_RANK")
        .env_remove("OXCCL_LOCAL_WORLD_SIZE")
        .stdin(Stdio::null())
        .process_group(0);
    env.secret.export_to(&mut cmd);
    let launcher_pid = env.launcher_pid;
    if opts.prefix_output {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    // SAFETY: the closure only makes async-signal-safe calls (prctl, getppid) and does not
    // allocate.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher died before the prctl: no signal will come.
            if libc::getppid() as u32 != launcher_pid {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = launcher_pid;
    cmd
}

/// Watches the ranks until every one has exited: the first failure, a signal, the job's
/// timeout and the grace period after a stop each stop or kill the rest.
fn supervise(
    opts: &LaunchOptions,
    ranks: &mut [Rank],
    job: &mut Job,
    signals: &SignalGuard,
    mut signals_seen: usize,
    deadline: Option<Instant>,
) {
    loop {
        let mut first_failure = None;
        for (rank, r) in ranks.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            let status = match r.child.try_wait() {
                Ok(None) => continue,
                Ok(Some(status)) => status,
                Err(e) => {
                    // Reaped elsewhere (ECHILD): its status is lost.
                    note(&format!("cannot wait for rank {rank}: {e}"));
                    ExitStatus::from_raw(1 << 8)
                }
            };
            r.status = Some(status);
            // Whatever the rank left behind in its process group.
            kill_group(r.pid, libc::SIGKILL);
            if !status.success() && first_failure.is_none() {
                first_failure = Some((rank, status));
            }
        }
        if let Some((rank, status)) = first_failure
            && job.outcome.is_none()
        {
            let (what, code) = describe(status);
            note(&format!(
                "rank {rank} {what}{}",
                stopping(running(ranks), true)
            ));
            job.stop(Outcome::Failed(code), ranks);
        }
        if running(ranks) == 0 {
            break;
        }
        let now = Instant::now();
        let (count, sig) = signals.received();
        if count > signals_seen {
            signals_seen = count;
            let name = signal_name(sig).unwrap_or("a signal");
            if job.outcome.is_none() {
                note(&format!(
                    "received {name}{}",
                    stopping(running(ranks), false)
                ));
                job.stop(Outcome::Signaled(sig), ranks);
            } else if !job.killed {
                note(&format!(
                    "received {name} again; killing the ranks still running"
                ));
                job.kill(ranks);
            }
        }
        if job.outcome.is_none()
            && let Some(d) = deadline
            && now >= d
        {
            note(&format!(
                "the job ran longer than its timeout of {} s{}",
                opts.timeout.unwrap_or_default().as_secs_f64(),
                stopping(running(ranks), false)
            ));
            job.stop(Outcome::TimedOut, ranks);
        }
        if !job.killed
            && let Some(t) = job.kill_at
            && now >= t
        {
            let n = running(ranks);
            note(&format!(
                "{n} rank{} still running after the grace period of {} s; sending SIGKILL",
                plural(n),
                job.grace.as_secs_f64()
            ));
            job.kill(ranks);
        }
        let mut next = now + MAX_TICK;
        if job.outcome.is_none()
            && let Some(d) = deadline
        {
            next = next.min(d);
        }
        if !job.killed
            && let Some(t) = job.kill_at
        {
            next = next.min(t);
        }
        signals.wait(next.saturating_duration_since(now));
    }
}

/// Waits (up to [`OUTPUT_LINGER`]) for the ranks' output to close, then joins the readers
/// that are done.
fn wait_for_output(done_rx: &mpsc::Receiver<()>, readers: Vec<JoinHandle<()>>) {
    // Every rank is reaped and its process group killed: the pipes close, unless a process
    // that left its group (setsid) still holds one.
    let linger = Instant::now() + OUTPUT_LINGER;
    loop {
        match done_rx.recv_timeout(linger.saturating_duration_since(Instant::now())) {
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                note(
                    "warning: the output of a rank is still open after every rank exited (a \
                     process that left the rank's process group holds it); not waiting for it",
                );
                break;
            }
            Ok(()) => {}
        }
    }
    for h in readers {
        if h.is_finished() {
            let _ = h.join();
        }
    }
}

/// One started rank.
struct Rank {
    child: Child,
    pid: i32,
    /// Set once reaped.
    status: Option<ExitStatus>,
}

/// Why the job stops early.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// A rank failed with this exit code (128 + signal for a signal).
    Failed(i32),
    /// A rank could not be started.
    CannotStart,
    /// `--timeout`.
    TimedOut,
    /// The launcher got this signal.
    Signaled(c_int),
}

impl Outcome {
    fn exit_code(self) -> i32 {
        match self {
            Outcome::Failed(code) => code,
            Outcome::CannotStart => EXIT_CANNOT_START,
            Outcome::TimedOut => EXIT_TIMEOUT,
            Outcome::Signaled(sig) => 128 + sig,
        }
    }
}

/// The stopping state of a job.
struct Job {
    outcome: Option<Outcome>,
    /// When SIGKILL follows the SIGTERM.
    kill_at: Option<Instant>,
    killed: bool,
    grace: Duration,
}

impl Job {
    /// Records why the job stops and sends SIGTERM to the ranks still running.
    fn stop(&mut self, outcome: Outcome, ranks: &[Rank]) {
        self.outcome.get_or_insert(outcome);
        if self.kill_at.is_none() {
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                kill_rank(r.pid, libc::SIGTERM);
                // A stopped rank (SIGSTOP, a debugger detached) takes the SIGTERM only once
                // it runs again.
                kill_rank(r.pid, libc::SIGCONT);
            }
            self.kill_at = Some(Instant::now() + self.grace);
        }
    }

    /// Sends SIGKILL to the ranks still running.
    fn kill(&mut self, ranks: &[Rank]) {
        for r in ranks.iter().filter(|r| r.status.is_none()) {
            kill_rank(r.pid, libc::SIGKILL);
        }
        self.killed = true;
    }
}

fn running(ranks: &[Rank]) -> usize {
    ranks.iter().filter(|r| r.status.is_none()).count()
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// "; stopping the [other] N rank(s)", or nothing when none runs.
fn stopping(n: usize, other: bool) -> String {
    if n == 0 {
        return String::new();
    }
    let other = if other { "other " } else { "" };
    format!("; stopping the {other}{n} rank{}", plural(n))
}

/// Signals a rank's process group (its id is the rank's pid). After the rank is reaped the id
/// stays reserved while any member of the group lives, so it names no unrelated process.
fn kill_group(pid: i32, sig: c_int) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(-pid, sig);
    }
}

/// Signals a rank that is not reaped yet: its process group, and the rank itself in case it left
/// the group.
fn kill_rank(pid: i32, sig: c_int) {
    kill_group(pid, sig);
    // SAFETY: as above.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// What happened to a rank, and the matching exit code for the launcher.
fn describe(status: ExitStatus) -> (String, i32) {
    if let Some(code) = status.code() {
        return (format!("exited with status {code}"), code);
    }
    if let Some(sig) = status.signal() {
        let name = signal_name(sig).map_or(String::new(), |n| format!(" ({n})"));
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        return (format!("was killed by signal {sig}{name}{core}"), 128 + sig);
    }
    (format!("ended with {status}"), 1)
}

fn signal_name(sig: c_int) -> Option<&'static str> {
    const NAMES: &[(c_int, &str)] = &[
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSYS, "SIGSYS"),
    ];
    NAMES.iter().find(|(n, _)| *n == sig).map(|(_, name)| *name)
}

/// Writes one `oxccl run: ` line to stderr, ignoring errors (stderr may be closed).
fn note(msg: &str) {
    let _ = writeln!(io::stderr().lock(), "oxccl run: {msg}");
}

/// A TCP port on 127.0.0.1 that nothing listens on: bound and released again.
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port on 127.0.0.1: {e}"))
}

/// 16 random hex characters.
fn random_job_id() -> Result<String, String> {
    let random = oxccl_bootstrap::Secret::generate().map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&random.as_bytes()[..16]).into_owned())
}

/// Starts the thread that copies one of a rank's pipes, with line prefixes, to the launcher's
/// stdout (or stderr). The thread drops `done` when the pipe closes.
fn spawn_reader(
    src: Box<dyn Read + Send>,
    rank: usize,
    to_stderr: bool,
    done: mpsc::Sender<()>,
) -> io::Result<JoinHandle<()>> {
    let stream = if to_stderr { "err" } else { "out" };
    std::thread::Builder::new()
        .name(format!("oxccl-run-{rank}-{stream}"))
        .spawn(move || {
            let _done = done;
            let prefix = format!("[{rank}] ");
            let mut sink = |bytes: &[u8]| {
                if to_stderr {
                    io::stderr().lock().write_all(bytes)
                } else {
                    let mut out = io::stdout().lock();
                    out.write_all(bytes).and_then(|()| out.flush())
                }
            };
            prefix_lines(src, prefix.as_bytes(), &mut sink);
        })
}

/// Copies `src` to `sink` with `prefix` before every line, handing `sink` whole lines only
/// (one call per read, for as many lines as it completed). A last line without a newline gets
/// one; a line longer than [`MAX_LINE`] is cut into pieces, each a line. Bytes pass through
/// unchanged otherwise (UTF-8 or not). Once `sink` fails, the rest is read and dropped, so that
/// the writer never blocks on a full pipe.
fn prefix_lines(mut src: impl Read, prefix: &[u8], sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let mut sink_ok = true;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if !sink_ok {
            continue;
        }
        let mut chunk = &buf[..n];
        while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            out.extend_from_slice(prefix);
            out.append(&mut pending);
            out.extend_from_slice(&chunk[..=i]);
            chunk = &chunk[i + 1..];
        }
        pending.extend_from_slice(chunk);
        while pending.len() >= MAX_LINE {
            out.extend_from_slice(prefix);
            out.extend(pending.drain(..MAX_LINE));
            out.push(b'\n');
        }
        if !out.is_empty() {
            sink_ok = sink(&out).is_ok();
            out.clear();
        }
    }
    if sink_ok && !pending.is_empty() {
        out.extend_from_slice(prefix);
        out.append(&mut pending);
        out.push(b'\n');
        let _ = sink(&out);
    }
}

// Signals. The handler records terminating signals and writes a byte to a pipe (the self-pipe
// trick) that the monitor loop polls, so that a child's exit (SIGCHLD) or a signal to the
// launcher wakes it at once.

/// Whether a [`SignalGuard`] exists (one `launch` at a time per process).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The write end of the wake-up pipe, or -1.
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
/// The last terminating signal received.
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many terminating signals were received.
static SIGNAL_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The signals that stop the job (when not ignored).
const STOP_SIGNALS: [c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

extern "C" fn on_signal(sig: c_int) {
    let errno = errno_location();
    // SAFETY: errno_location returns this thread's errno.
    let saved = errno.map(|p| unsafe { *p });
    if sig != libc::SIGCHLD {
        LAST_SIGNAL.store(sig, Ordering::SeqCst);
        SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
    }
    let fd = WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: write is async-signal-safe; a full pipe (EAGAIN) already means "wake up".
        unsafe {
            libc::write(fd, [1u8].as_ptr().cast(), 1);
        }
    }
    if let (Some(p), Some(v)) = (errno, saved) {
        // SAFETY: as above.
        unsafe { *p = v };
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn errno_location() -> Option<*mut c_int> {
    // SAFETY: no preconditions.
    Some(unsafe { libc::__errno_location() })
}

#[cfg(any(target_vendor = "apple", target_os = "freebsd"))]
fn errno_location() -> Option<*mut c_int> {
    // SAFETY: no preconditions.
    Some(unsafe { libc::__error() })
}

#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_vendor = "apple",
    target_os = "freebsd"
)))]
fn errno_location() -> Option<*mut c_int> {
    None
}

/// The installed signal handlers and the wake-up pipe; dropping it puts the previous handlers
/// back.
struct SignalGuard {
    read: OwnedFd,
    /// Written by the handler through [`WAKE_FD`].
    _write: OwnedFd,
    previous: Vec<(c_int, libc::sigaction)>,
}

impl SignalGuard {
    fn install() -> Result<SignalGuard, String> {
        if ACTIVE
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err("another job is already being launched in this process".into());
        }
        let release = |e: String| {
            ACTIVE.store(false, Ordering::SeqCst);
            e
        };
        let mut fds = [-1; 2];
        // SAFETY: fds has room for the two descriptors.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err(release(format!(
                "cannot create a pipe: {}",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: pipe just returned these descriptors, owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        for fd in fds {
            // SAFETY: fd is open; fcntl with these commands has no memory-safety concerns.
            unsafe {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        LAST_SIGNAL.store(0, Ordering::SeqCst);
        SIGNAL_COUNT.store(0, Ordering::SeqCst);
        WAKE_FD.store(write.as_raw_fd(), Ordering::SeqCst);
        let mut guard = SignalGuard {
            read,
            _write: write,
            previous: Vec::new(),
        };
        for sig in [libc::SIGCHLD].into_iter().chain(STOP_SIGNALS) {
            // SAFETY: sigaction structs are plain data; all-zero is a valid value.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: querying the current action.
            if unsafe { libc::sigaction(sig, std::ptr::null(), &mut previous) } != 0 {
                continue;
            }
            // A launcher started with SIGINT or SIGHUP ignored (nohup, `&`) keeps ignoring them.
            if sig != libc::SIGCHLD && previous.sa_sigaction == libc::SIG_IGN {
                continue;
            }
            action.sa_sigaction = on_signal as extern "C" fn(c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            if sig == libc::SIGCHLD {
                action.sa_flags |= libc::SA_NOCLDSTOP;
            }
            // SAFETY: a valid action whose handler only makes async-signal-safe calls.
            unsafe {
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                    // Dropping the guard restores those installed so far.
                    return Err(format!(
                        "cannot install a signal handler: {}",
                        io::Error::last_os_error()
                    ));
                }
            }
            guard.previous.push((sig, previous));
        }
        Ok(guard)
    }

    /// (how many terminating signals were received, the last of them).
    fn received(&self) -> (usize, c_int) {
        (
            SIGNAL_COUNT.load(Ordering::SeqCst),
            LAST_SIGNAL.load(Ordering::SeqCst),
        )
    }

    /// Sleeps until a signal arrives (or arrived since the last call) or `timeout` passes.
    fn wait(&self, timeout: Duration) {
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as c_int;
        let mut pfd = libc::pollfd {
            fd: self.read.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let mut buf = [0u8; 64];
        // SAFETY: pfd and buf are valid for the calls' durations.
        unsafe {
            libc::poll(&mut pfd, 1, ms);
            while libc::read(pfd.fd, buf.as_mut_ptr().cast(), buf.len()) > 0 {}
        }
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, previous) in self.previous.drain(..).rev() {
            // SAFETY: putting back the action sigaction returned.
            unsafe {
                libc::sigaction(sig, &previous, std::ptr::null_mut());
            }
        }
        WAKE_FD.store(-1, Ordering::SeqCst);
        // The pipe closes after this, when the fields drop.
        ACTIVE.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixed(input: &[u8], read_size: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
        struct Chunks<'a>(&'a [u8], usize);
        impl Read for Chunks<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.len().min(self.1).min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut all = Vec::new();
        let mut calls = Vec::new();
        prefix_lines(Chunks(input, read_size), b"[7] ", &mut |b| {
            all.extend_from_slice(b);
            calls.push(b.to_vec());
            Ok(())
        });
        (all, calls)
    }

    #[test]
    fn lines_are_prefixed_whole() {
        for size in [1, 2, 3, 5, 1000] {
            let (all, calls) = prefixed(b"ab\ncd\n\nlast", size);
            assert_eq!(all, b"[7] ab\n[7] cd\n[7] \n[7] last\n", "read size {size}");
            for c in calls {
                assert!(c.starts_with(b"[7] ") && c.ends_with(b"\n"), "{c:?}");
            }
        }
        assert_eq!(prefixed(b"", 10).0, b"");
        assert_eq!(prefixed(b"\xff\xfe\n", 1).0, b"[7] \xff\xfe\n");
    }

    #[test]
    fn long_lines_are_cut() {
        let mut input = vec![b'x'; MAX_LINE + 10];
        input.push(b'\n');
        let (all, _) = prefixed(&input, 4096);
        let mut want = b"[7] ".to_vec();
        want.extend(vec![b'x'; MAX_LINE]);
        want.extend(b"\n[7] xxxxxxxxxx\n");
        assert_eq!(all, want);
    }

    #[test]
    fn a_failed_sink_is_not_called_again() {
        let mut calls = 0;
        prefix_lines(&b"a\nb\nc"[..], b"", &mut |_| {
            calls += 1;
            Err(io::ErrorKind::BrokenPipe.into())
        });
        assert_eq!(calls, 1);
    }

    #[test]
    fn exit_statuses() {
        assert_eq!(
            describe(ExitStatus::from_raw(3 << 8)),
            ("exited with status 3".into(), 3)
        );
        assert_eq!(
            describe(ExitStatus::from_raw(libc::SIGKILL)),
            ("was killed by signal 9 (SIGKILL)".into(), 137)
        );
        assert!(parse_nproc("0").is_err());
        assert_eq!(parse_nproc("4"), Ok(4));
        assert!(parse_timeout("0").is_err());
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_secs("-1").is_err());
    }
}
