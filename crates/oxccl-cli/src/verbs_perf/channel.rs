//! The out-of-band control channel between the client (initiator) and the server (target).
//!
//! Messages are serde_json objects, one per line. [`Channel`] is what the benchmark needs;
//! [`LineChannel`] runs it over the pipes of a spawned server process ([`ServerProcess`]), in
//! that process over its standard input and output, and with `--server` / `--connect HOST:PORT`
//! over the two halves of an authenticated TCP connection (see [`super::remote`]).
//!
//! A reader thread turns incoming lines into messages, so every receive has a timeout and the
//! spinning data path can ask whether the peer is gone without a system call
//! ([`Channel::check_peer`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use oxccl_verbs::{Provider, QpEndpoint, RemoteBuffer};
use serde::{Deserialize, Serialize};

use super::Test;
use super::error::{Error, Result};

/// A control message.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    /// Client → server: what to prepare.
    Setup(Setup),
    /// Both ways: a queue pair endpoint and the sender's target buffer.
    Endpoint {
        /// The sender's queue pair.
        qp: QpEndpoint,
        /// The sender's target region (peers WRITE, READ and run atomics here).
        buf: RemoteBuffer,
    },
    /// Server → client (raw `tcp_*` baselines): connect the data connection to `addr` and send
    /// `token` first.
    Listening {
        /// The server's data listener, `IP:port`.
        addr: String,
        /// What the client sends first on the connection ([`super::rawtcp::TOKEN_LEN`] hex
        /// characters).
        token: String,
    },
    /// Server → client: connected (and receives posted); runs may start.
    Connected,
    /// Client → server: the next measurement.
    Run(RunSpec),
    /// Server → client: ready for the run just announced.
    Ready,
    /// Client → server: the run is over (the idle server's cue to report).
    Finish,
    /// Server → client: the server's side of the run is done.
    Done {
        /// CPU seconds (user + system) the server used during the measured part of the run.
        cpu_secs: f64,
    },
    /// Client → server: no more runs; exit.
    Quit,
    /// Either way: the sender failed and is exiting.
    Error {
        /// What went wrong, in words.
        message: String,
    },
}

impl Msg {
    /// The message's tag, as it appears on the wire (`"ready"`, `"done"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Setup(_) => "setup",
            Msg::Endpoint { .. } => "endpoint",
            Msg::Listening { .. } => "listening",
            Msg::Connected => "connected",
            Msg::Run(_) => "run",
            Msg::Ready => "ready",
            Msg::Finish => "finish",
            Msg::Done { .. } => "done",
            Msg::Quit => "quit",
            Msg::Error { .. } => "error",
        }
    }
}

/// What the server prepares once, for every run that follows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Setup {
    /// The test.
    pub test: Test,
    /// The verbs provider.
    pub provider: Provider,
    /// The largest message of all runs (buffer size).
    pub max_size: usize,
    /// Receives kept posted (send tests).
    pub rx_depth: u32,
    /// Outstanding send requests (sizing of the send queue).
    pub tx_depth: u32,
    /// Seconds a wait may go without progress.
    pub timeout_secs: f64,
    /// `flag_lat`: the inherited descriptor of the shared flag page.
    pub flag_fd: Option<i32>,
    /// Busy-poll (`--busy` or `OXCCL_TCP_POLL=busy` on the client): the raw tcp baselines spin
    /// on non-blocking sockets, and the tcp provider's progress thread busy-polls unless the
    /// server's own `OXCCL_TCP_POLL` says otherwise.
    #[serde(default)]
    pub busy: bool,
    /// Completion waits sleep on the completion queue instead of spinning (`-e`).
    #[serde(default)]
    pub events: bool,
}

/// One measurement: `warmup + iters` operations of `size` bytes.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct RunSpec {
    /// Message size in bytes.
    pub size: usize,
    /// Warm-up operations, not measured.
    pub warmup: u64,
    /// Measured operations.
    pub iters: u64,
    /// Sequence number before the run's first operation (ping-pong counters continue across runs).
    pub seq: u64,
}

/// The control channel the benchmark talks over.
pub trait Channel {
    /// Sends one message.
    fn send(&mut self, msg: &Msg) -> Result<()>;
    /// Receives the next message; `what` names it for errors. `None` waits until the peer closes
    /// the channel (used only by an idle server, which the client's exit always wakes).
    fn recv(&mut self, what: &str, timeout: Option<Duration>) -> Result<Msg>;
    /// Errors when the peer has failed or hung up. Never blocks and makes no system call, so
    /// spin loops can call it.
    fn check_peer(&mut self) -> Result<()>;
    /// Who is at the other end ("server process", "client"), for messages.
    fn peer_name(&self) -> &str;
}

/// What the reader thread hands over.
enum Incoming {
    /// A control message.
    Msg(Msg),
    /// A line that is not a control message.
    Garbage(String),
    /// End of stream (with the read error, if that ended it).
    Closed(Option<String>),
}

/// A [`Channel`] over any byte stream pair: newline-delimited JSON, read by a helper thread.
pub struct LineChannel {
    writer: Box<dyn Write + Send>,
    rx: Receiver<Incoming>,
    closed: Arc<AtomicBool>,
    peer: String,
    dead: Option<String>,
}

impl LineChannel {
    /// A channel writing to `writer` and reading lines from `reader`; `peer` names the other end.
    pub fn new<R, W>(reader: R, writer: W, peer: &str) -> Result<Self>
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        std::thread::Builder::new()
            .name("oxccl-perf-ctl".into())
            .spawn(move || {
                let mut lines = BufReader::new(reader).lines();
                let end = loop {
                    match lines.next() {
                        None => break None,
                        Some(Err(e)) => break Some(e.to_string()),
                        Some(Ok(line)) if line.trim().is_empty() => continue,
                        Some(Ok(line)) => {
                            let item = match serde_json::from_str::<Msg>(&line) {
                                Ok(m) => Incoming::Msg(m),
                                Err(_) => Incoming::Garbage(line),
                            };
                            if tx.send(item).is_err() {
                                return;
                            }
                        }
                    }
                };
                flag.store(true, Ordering::Release);
                let _ = tx.send(Incoming::Closed(end));
            })
            .map_err(|e| Error::new(format!("spawning the control-channel reader thread: {e}")))?;
        Ok(LineChannel {
            writer: Box::new(writer),
            rx,
            closed,
            peer: peer.to_string(),
            dead: None,
        })
    }

    /// The channel of a server process to its client: standard input and output.
    pub fn stdio() -> Result<Self> {
        Self::new(std::io::stdin(), std::io::stdout(), "client")
    }

    /// Records that the peer hung up and returns the error that says so.
    fn gone(&mut self, why: Option<String>) -> Error {
        let msg = match why {
            // A read error: reset, or a dead link noticed by keepalive or the user timeout.
            Some(w) => format!("lost the control channel to the {} ({w})", self.peer),
            None => format!("the {} closed the control channel", self.peer),
        };
        self.dead = Some(msg.clone());
        Error::new(msg)
    }

    /// Turns what the reader thread got into a message or an error.
    fn accept(&mut self, item: Incoming) -> Result<Msg> {
        match item {
            Incoming::Msg(Msg::Error { message }) => {
                let msg = format!("the {} failed: {message}", self.peer);
                self.dead = Some(msg.clone());
                Err(Error::new(msg))
            }
            Incoming::Msg(m) => Ok(m),
            Incoming::Garbage(line) => {
                let mut line = line;
                line.truncate(200);
                Err(Error::new(format!(
                    "the {} sent something that is not a control message: {line:?}",
                    self.peer
                )))
            }
            Incoming::Closed(why) => Err(self.gone(why)),
        }
    }
}

impl Channel for LineChannel {
    fn send(&mut self, msg: &Msg) -> Result<()> {
        if let Some(dead) = &self.dead {
            return Err(Error::new(dead.clone()));
        }
        let mut line = serde_json::to_string(msg)
            .map_err(|e| Error::new(format!("encoding a control message: {e}")))?;
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .and_then(|()| self.writer.flush())
            .map_err(|e| {
                Error::new(format!(
                    "sending to the {} failed ({e}): it is gone",
                    self.peer
                ))
            })
    }

    fn recv(&mut self, what: &str, timeout: Option<Duration>) -> Result<Msg> {
        if let Some(dead) = &self.dead {
            return Err(Error::new(dead.clone()));
        }
        let item = match timeout {
            Some(t) => match self.rx.recv_timeout(t) {
                Ok(item) => item,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::new(format!(
                        "timed out after {:.1} s waiting for {what} from the {}",
                        t.as_secs_f64(),
                        self.peer
                    )));
                }
                Err(RecvTimeoutError::Disconnected) => Incoming::Closed(None),
            },
            None => self.rx.recv().unwrap_or(Incoming::Closed(None)),
        };
        self.accept(item)
            .map_err(|e| e.context(format!("waiting for {what}")))
    }

    fn check_peer(&mut self) -> Result<()> {
        if let Some(dead) = &self.dead {
            return Err(Error::new(dead.clone()));
        }
        if !self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        // The peer hung up: report the error it sent before going, if any.
        loop {
            match self.rx.try_recv() {
                Ok(Incoming::Msg(Msg::Error { message })) => {
                    return self
                        .accept(Incoming::Msg(Msg::Error { message }))
                        .map(|_| ());
                }
                Ok(Incoming::Closed(why)) => return Err(self.gone(why)),
                Ok(_) => continue,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                    return Err(self.gone(None));
                }
            }
        }
    }

    fn peer_name(&self) -> &str {
        &self.peer
    }
}

/// The spawned server process: this binary re-executed as `verbs-perf --server-child`.
///
/// The child gets `SIGKILL` when its parent dies (`PR_SET_PDEATHSIG`) and exits when its standard
/// input closes; dropping this handle without [`ServerProcess::finish`] kills and reaps it.
pub struct ServerProcess {
    child: Child,
    reaped: Option<ExitStatus>,
}

impl ServerProcess {
    /// Starts the server process. It inherits every descriptor that is not close-on-exec.
    pub fn spawn() -> Result<(ServerProcess, LineChannel)> {
        let mut cmd = crate::reexec(["verbs-perf", "--server-child"])
            .map_err(|e| Error::new(format!("finding this program to start the server: {e}")))?;
        let exe = cmd.get_program().to_owned();
        let mut child = cmd
            .arg("--parent-pid")
            .arg(std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                Error::new(format!(
                    "starting the server process {}: {e}",
                    std::path::Path::new(&exe).display()
                ))
            })?;
        let stdin: ChildStdin = child.stdin.take().expect("piped stdin");
        let stdout: ChildStdout = child.stdout.take().expect("piped stdout");
        let server = ServerProcess {
            child,
            reaped: None,
        };
        let chan = LineChannel::new(stdout, stdin, "server process")?;
        Ok((server, chan))
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit; its status if it did.
    pub fn exited_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.reaped.is_some() {
            return self.reaped;
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    self.reaped = Some(st);
                    return Some(st);
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => return None,
            }
        }
    }

    /// Adds how the server ended (if it did within a moment) to `err`.
    pub fn explain(&mut self, err: Error) -> Error {
        match self.exited_within(Duration::from_millis(300)) {
            Some(st) if !st.success() => {
                err.with_note(format!("the server process exited: {}", describe(st)))
            }
            _ => err,
        }
    }

    /// Waits for a clean exit after the channel was closed; kills the process after `timeout`.
    pub fn finish(mut self, timeout: Duration) -> Result<()> {
        match self.exited_within(timeout) {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err(Error::new(format!(
                "the server process exited: {}",
                describe(st)
            ))),
            None => Err(Error::new(format!(
                "the server process did not exit within {:.1} s; killed it",
                timeout.as_secs_f64()
            ))),
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if self.reaped.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// "exit code 3" or "killed by signal 9 (SIGKILL)".
fn describe(st: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = st.code() {
        format!("exit code {code}")
    } else if let Some(sig) = st.signal() {
        let name = match sig {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGBUS => " (SIGBUS)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGTERM => " (SIGTERM)",
            _ => "",
        };
        format!("killed by signal {sig}{name}")
    } else {
        format!("{st}")
    }
}

/// Spin turns between yields, minus one: with the tcp provider the peer's data arrives through
/// progress threads that need a core, so spinners yield often (every 64 turns); shm spins freely.
static YIELD_MASK: AtomicU32 = AtomicU32::new(0x3fff);

/// Makes spin loops yield the CPU often (for providers whose progress runs in threads).
pub fn yield_often(often: bool) {
    YIELD_MASK.store(if often { 0x3f } else { 0x3fff }, Ordering::Relaxed);
}

/// Turns a spin loop into a bounded wait: every 16384 turns (a fraction of a millisecond; no
/// system call on the fast path) it checks that the peer is still there and that `timeout` has
/// not passed without progress, and yields the CPU once, so that a peer starved of a core (more
/// spinning processes than cores) still gets to run.
pub struct Spin<'a> {
    chan: &'a mut dyn Channel,
    timeout: Duration,
    turns: u32,
    since: Option<Instant>,
}

impl<'a> Spin<'a> {
    /// A spinner that gives up after `timeout` without progress.
    pub fn new(chan: &'a mut dyn Channel, timeout: Duration) -> Self {
        Spin {
            chan,
            timeout,
            turns: 0,
            since: None,
        }
    }

    /// Called when the awaited thing happened: the next wait starts afresh.
    #[inline]
    pub fn progress(&mut self) {
        self.turns = 0;
        self.since = None;
    }

    /// One turn of a spin loop waiting for `what`.
    #[inline]
    pub fn turn(&mut self, what: &dyn Fn() -> String) -> Result<()> {
        self.turns = self.turns.wrapping_add(1);
        if self.turns & 0x3fff == 0 {
            self.check(what)?;
        } else if self.turns & YIELD_MASK.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        std::hint::spin_loop();
        Ok(())
    }

    /// A turn of a wait that sleeps between turns (`--events`): checks the peer and the timeout
    /// every time, without yielding.
    pub fn idle(&mut self, what: &dyn Fn() -> String) -> Result<()> {
        self.check_peer_and_time(what)
    }

    /// The periodic check of a spin loop (see [`Spin`]).
    #[cold]
    fn check(&mut self, what: &dyn Fn() -> String) -> Result<()> {
        std::thread::yield_now();
        self.check_peer_and_time(what)
    }

    /// Errors when the peer is gone or `timeout` has passed without progress.
    fn check_peer_and_time(&mut self, what: &dyn Fn() -> String) -> Result<()> {
        self.chan
            .check_peer()
            .map_err(|e| e.context(format!("while waiting for {}", what())))?;
        let now = Instant::now();
        match self.since {
            None => self.since = Some(now),
            Some(t) if now - t > self.timeout => {
                return Err(Error::new(format!(
                    "no progress for {:.1} s while waiting for {} (is the {} stuck?)",
                    self.timeout.as_secs_f64(),
                    what(),
                    self.chan.peer_name()
                )));
            }
            Some(_) => {}
        }
        Ok(())
    }
}
