//! Cross-process test harness: a peer process (this same test binary, re-executed) that owns a
//! context and queue pairs and obeys commands sent as JSON lines on its stdin. Replies come back on
//! stdout as lines prefixed with `@@` (the test harness prints other lines too).
//!
//! The parent connects its own queue pairs to the peer's, drives requests, and inspects the peer's
//! memory through the commands, so every check looks at the target's real memory in another
//! process.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use oxccl_verbs::*;
use serde::{Deserialize, Serialize};

/// Name of the ignored test that runs the peer when `OXCCL_TEST_PEER` is set.
pub const PEER_TEST: &str = "peer_process_entry";

/// Queue pair settings a test can change.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QpSpec {
    pub max_recv_wr: u32,
    pub rnr_retry: u8,
    pub rnr_timer_us: u64,
    pub timeout_ms: u64,
}

impl Default for QpSpec {
    fn default() -> Self {
        QpSpec {
            max_recv_wr: 256,
            rnr_retry: 7,
            rnr_timer_us: 1000,
            timeout_ms: 2000,
        }
    }
}

impl QpSpec {
    pub fn config(&self) -> QpConfig {
        QpConfig {
            max_recv_wr: self.max_recv_wr,
            rnr_retry: self.rnr_retry,
            rnr_timer: Duration::from_micros(self.rnr_timer_us),
            timeout: Duration::from_millis(self.timeout_ms),
            ..QpConfig::default()
        }
    }
}

/// A send request, described by value for the wire.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum OpSpec {
    Write {
        addr: u64,
        rkey: u64,
    },
    WriteImm {
        addr: u64,
        rkey: u64,
        imm: u32,
    },
    Read {
        addr: u64,
        rkey: u64,
    },
    Send,
    SendImm {
        imm: u32,
    },
    Cas {
        addr: u64,
        rkey: u64,
        compare: u64,
        swap: u64,
    },
    Faa {
        addr: u64,
        rkey: u64,
        add: u64,
    },
}

impl OpSpec {
    pub fn to_op(&self) -> WrOp {
        let r = |addr, rkey| RemoteAddr { addr, rkey };
        match *self {
            OpSpec::Write { addr, rkey } => WrOp::Write {
                remote: r(addr, rkey),
            },
            OpSpec::WriteImm { addr, rkey, imm } => WrOp::WriteWithImm {
                remote: r(addr, rkey),
                imm,
            },
            OpSpec::Read { addr, rkey } => WrOp::Read {
                remote: r(addr, rkey),
            },
            OpSpec::Send => WrOp::Send,
            OpSpec::SendImm { imm } => WrOp::SendWithImm { imm },
            OpSpec::Cas {
                addr,
                rkey,
                compare,
                swap,
            } => WrOp::CompareSwap {
                remote: r(addr, rkey),
                compare,
                swap,
            },
            OpSpec::Faa { addr, rkey, add } => WrOp::FetchAdd {
                remote: r(addr, rkey),
                add,
            },
        }
    }
}

/// Commands the peer obeys.
#[derive(Debug, Serialize, Deserialize)]
pub enum Cmd {
    /// Creates queue pair `qp` (replacing one of the same number) and returns its endpoint.
    Setup {
        qp: usize,
        spec: QpSpec,
    },
    Connect {
        qp: usize,
        ep: QpEndpoint,
    },
    /// Allocates (or, with `user`, registers a user buffer as) a region; returns id and remote.
    Alloc {
        len: usize,
        access: u32,
        user: bool,
    },
    /// Fills a region with the deterministic pattern of `seed`.
    Pattern {
        id: usize,
        seed: u64,
    },
    Fill {
        id: usize,
        byte: u8,
    },
    WriteBytes {
        id: usize,
        offset: usize,
        data: Vec<u8>,
    },
    Read {
        id: usize,
        offset: usize,
        len: usize,
    },
    Hash {
        id: usize,
    },
    Dereg {
        id: usize,
    },
    PostRecv {
        qp: usize,
        wr_id: u64,
        sges: Vec<(usize, usize, usize)>,
    },
    /// Posts a send-queue request from the peer's side.
    PostSend {
        qp: usize,
        wr_id: u64,
        op: OpSpec,
        sges: Vec<(usize, usize, usize)>,
    },
    /// Waits up to `timeout_ms` for up to `max` completions (returns what arrived, maybe none).
    Poll {
        max: usize,
        timeout_ms: u64,
    },
    /// Waits for one receive completion, then at once checks that the first `words` u64 words of
    /// region `id` hold 0, 1, 2, …; returns the completion and the number of wrong words.
    WaitImmThenCheck {
        id: usize,
        words: usize,
        timeout_ms: u64,
    },
    State {
        qp: usize,
    },
    /// Runs `n` fetch-and-adds of `add` on a remote word through queue pair `qp`, one at a time.
    FaaLoop {
        qp: usize,
        addr: u64,
        rkey: u64,
        add: u64,
        n: u64,
    },
    /// Runs [`run_stream`] on queue pair `qp` (with region `data` as the WRITE_WITH_IMM landing
    /// ring, when receiving in that mode) and reports what it saw.
    Stream {
        qp: usize,
        data: Option<usize>,
        cfg: StreamCfg,
    },
    /// Runs [`atomic_hammer`] through queue pair `qp` and reports every value it saw.
    AtomicHammer {
        qp: usize,
        cfg: AtomicCfg,
    },
    /// Waits for one completion, replies with it (as [`Cmd::Poll`] with `max` 1), and exits at
    /// once, closing everything (a rank whose last call just returned).
    WaitThenExit {
        timeout_ms: u64,
    },
    Exit,
}

/// Replies.
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    Ok,
    Endpoint(QpEndpoint),
    Mr {
        id: usize,
        remote: RemoteBuffer,
    },
    Bytes(Vec<u8>),
    Hash(u64),
    Wcs(Vec<WorkCompletion>),
    Checked {
        wc: Option<WorkCompletion>,
        wrong: usize,
    },
    State(QpState),
    Stream(StreamReport),
    Atomics(AtomicReport),
    Err(String),
}

/// FNV-1a over bytes: an independent reference for comparing large regions.
pub fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// A deterministic byte pattern (xorshift), different per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// The peer process, seen from the test.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    pub pid: u32,
}

impl Peer {
    /// Starts a peer process for `provider`.
    pub fn spawn(provider: &str) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([
                "--ignored",
                "--exact",
                PEER_TEST,
                "--nocapture",
                "--test-threads=1",
            ])
            .env("OXCCL_TEST_PEER", provider)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning the peer process");
        let stdin = child.stdin.take().unwrap();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may print "test name ... " on the same line before the first reply.
                let Some(at) = line.find("@@") else { continue };
                if tx.send(line[at + 2..].to_string()).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        Peer {
            child,
            stdin,
            lines,
            pid,
        }
    }

    /// Sends a command and returns the reply (panics with context on failure: this is a test).
    pub fn call(&mut self, cmd: Cmd) -> Reply {
        let line = self.start(cmd);
        self.reply(&line)
    }

    /// Sends a command without waiting for its reply ([`Peer::reply`] takes it); returns the
    /// command as sent.
    pub fn start(&mut self, cmd: Cmd) -> String {
        let line = serde_json::to_string(&cmd).unwrap();
        writeln!(self.stdin, "{line}").expect("peer stdin");
        self.stdin.flush().unwrap();
        line
    }

    /// The reply to the command [`Peer::start`] sent as `line`.
    pub fn reply(&mut self, line: &str) -> Reply {
        let reply = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no reply from peer to {line}: {e}"));
        serde_json::from_str(&reply).expect("peer reply")
    }

    pub fn ok(&mut self, cmd: Cmd) {
        match self.call(cmd) {
            Reply::Ok => {}
            r => panic!("peer: {r:?}"),
        }
    }

    pub fn setup(&mut self, qp: usize, spec: &QpSpec) -> QpEndpoint {
        match self.call(Cmd::Setup {
            qp,
            spec: spec.clone(),
        }) {
            Reply::Endpoint(ep) => ep,
            r => panic!("peer setup: {r:?}"),
        }
    }

    pub fn alloc(&mut self, len: usize, access: AccessFlags) -> (usize, RemoteBuffer) {
        self.alloc_kind(len, access, false)
    }

    pub fn alloc_kind(
        &mut self,
        len: usize,
        access: AccessFlags,
        user: bool,
    ) -> (usize, RemoteBuffer) {
        match self.call(Cmd::Alloc {
            len,
            access: access.bits(),
            user,
        }) {
            Reply::Mr { id, remote } => (id, remote),
            r => panic!("peer alloc: {r:?}"),
        }
    }

    pub fn read(&mut self, id: usize, offset: usize, len: usize) -> Vec<u8> {
        match self.call(Cmd::Read { id, offset, len }) {
            Reply::Bytes(b) => b,
            r => panic!("peer read: {r:?}"),
        }
    }

    pub fn hash(&mut self, id: usize) -> u64 {
        match self.call(Cmd::Hash { id }) {
            Reply::Hash(h) => h,
            r => panic!("peer hash: {r:?}"),
        }
    }

    pub fn poll(&mut self, max: usize, timeout_ms: u64) -> Vec<WorkCompletion> {
        match self.call(Cmd::Poll { max, timeout_ms }) {
            Reply::Wcs(w) => w,
            r => panic!("peer poll: {r:?}"),
        }
    }

    /// Runs a stream loop in the peer (see [`run_stream`]); blocks until it ends.
    pub fn stream(&mut self, qp: usize, data: Option<usize>, cfg: &StreamCfg) -> StreamReport {
        match self.call(Cmd::Stream {
            qp,
            data,
            cfg: cfg.clone(),
        }) {
            Reply::Stream(r) => r,
            r => panic!("peer stream: {r:?}"),
        }
    }

    /// Runs an atomics loop in the peer (see [`atomic_hammer`]); blocks until it ends.
    pub fn atomic_hammer(&mut self, qp: usize, cfg: &AtomicCfg) -> AtomicReport {
        match self.call(Cmd::AtomicHammer {
            qp,
            cfg: cfg.clone(),
        }) {
            Reply::Atomics(r) => r,
            r => panic!("peer atomic hammer: {r:?}"),
        }
    }

    pub fn state(&mut self, qp: usize) -> QpState {
        match self.call(Cmd::State { qp }) {
            Reply::State(s) => s,
            r => panic!("peer state: {r:?}"),
        }
    }

    /// Kills the peer with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let line = serde_json::to_string(&Cmd::Exit).unwrap();
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The local side of a test: a context, domain, one CQ, and helpers.
pub struct Local {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
}

impl Local {
    pub fn new(provider: &str) -> Local {
        let ctx = open_provider(provider);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(1024).unwrap();
        Local { ctx, pd, cq }
    }

    /// A queue pair connected to the peer's queue pair `qp` (created with `spec` on both sides).
    pub fn connect(&self, peer: &mut Peer, qp: usize, spec: &QpSpec) -> QueuePair {
        let local = self
            .pd
            .create_qp(&self.cq, &self.cq, &spec.config())
            .unwrap();
        let remote = peer.setup(qp, spec);
        peer.ok(Cmd::Connect {
            qp,
            ep: local.endpoint(),
        });
        local.connect(&remote).unwrap();
        local
    }

    /// Waits for exactly one completion (panics on timeout).
    pub fn wait_one(&self) -> WorkCompletion {
        let mut wc = [WorkCompletion::default(); 1];
        let n = self
            .cq
            .wait(&mut wc, Duration::from_secs(30))
            .expect("waiting for a completion");
        assert_eq!(n, 1);
        wc[0]
    }

    /// Collects `n` completions (panics on timeout).
    pub fn wait_n(&self, n: usize) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        let mut buf = [WorkCompletion::default(); 64];
        while out.len() < n {
            let k = self
                .cq
                .wait(&mut buf, Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("waiting for {} more completions: {e}", n - out.len()));
            out.extend_from_slice(&buf[..k]);
        }
        out
    }
}

/// Opens a context for a provider spec: a provider's name, or `ofi:<libfabric provider>`
/// (`ofi:shm`), which runs the ofi provider over that libfabric provider (both processes open
/// the same spec). A provider that cannot open (libfabric missing) fails the test, never skips.
pub fn open_provider(spec: &str) -> Context {
    let (name, ofi) = match spec.split_once(':') {
        Some((name, ofi)) => (name, Some(ofi)),
        None => (spec, None),
    };
    let mut config = DeviceConfig::from_env().unwrap();
    if let Some(ofi) = ofi {
        config.ofi_provider = ofi.to_string();
    }
    let device = Device::by_name(name).unwrap();
    Context::open_with(device.provider(), &config)
        .unwrap_or_else(|e| panic!("opening provider {spec}: {e}"))
}

/// The peer process's main loop (runs inside the re-executed test binary).
pub fn peer_main() {
    let Ok(provider) = std::env::var("OXCCL_TEST_PEER") else {
        return;
    };
    let ctx = open_provider(&provider);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096).unwrap();
    let mut qps: HashMap<usize, QueuePair> = HashMap::new();
    let mut mrs: Vec<MemoryRegion> = Vec::new();
    let stdin = std::io::stdin();
    let reply = |r: Reply| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "@@{}", serde_json::to_string(&r).unwrap()).unwrap();
        out.flush().unwrap();
    };
    let sges_of =
        |mrs: &Vec<MemoryRegion>, s: &[(usize, usize, usize)]| -> Vec<(usize, usize, usize)> {
            s.iter().filter(|g| g.0 < mrs.len()).cloned().collect()
        };
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let cmd: Cmd = serde_json::from_str(&line).expect("command");
        let r = match cmd {
            Cmd::Setup { qp, spec } => {
                qps.remove(&qp);
                match pd.create_qp(&cq, &cq, &spec.config()) {
                    Ok(q) => {
                        let ep = q.endpoint();
                        q.to_init().unwrap();
                        qps.insert(qp, q);
                        Reply::Endpoint(ep)
                    }
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::Connect { qp, ep } => {
                let q = &qps[&qp];
                match q.to_rtr(&ep).and_then(|_| q.to_rts()) {
                    Ok(()) => Reply::Ok,
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::Alloc { len, access, user } => {
                let access = AccessFlags::from_bits_truncate(access);
                let mr = if user {
                    pd.reg_mr(vec![0u8; len], access)
                } else {
                    pd.alloc_mr(len, access)
                };
                match mr {
                    Ok(mr) => {
                        let remote = mr.remote();
                        mrs.push(mr);
                        Reply::Mr {
                            id: mrs.len() - 1,
                            remote,
                        }
                    }
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::Pattern { id, seed } => {
                mrs[id].write(0, &pattern(seed, mrs[id].len())).unwrap();
                Reply::Ok
            }
            Cmd::Fill { id, byte } => {
                mrs[id].fill(byte);
                Reply::Ok
            }
            Cmd::WriteBytes { id, offset, data } => match mrs[id].write(offset, &data) {
                Ok(()) => Reply::Ok,
                Err(e) => Reply::Err(e.to_string()),
            },
            Cmd::Read { id, offset, len } => {
                let mut b = vec![0u8; len];
                match mrs[id].read(offset, &mut b) {
                    Ok(()) => Reply::Bytes(b),
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::Hash { id } => Reply::Hash(fnv(&mrs[id].to_vec())),
            Cmd::Dereg { id } => {
                mrs[id].deregister();
                Reply::Ok
            }
            Cmd::PostRecv { qp, wr_id, sges } => {
                let sges = sges_of(&mrs, &sges);
                let list: Vec<Sge> = sges
                    .iter()
                    .map(|&(i, o, l)| Sge::new(&mrs[i], o, l))
                    .collect();
                match qps[&qp].post_recv(&[RecvWr::new(wr_id, &list)]) {
                    Ok(()) => Reply::Ok,
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::PostSend {
                qp,
                wr_id,
                op,
                sges,
            } => {
                let sges = sges_of(&mrs, &sges);
                let list: Vec<Sge> = sges
                    .iter()
                    .map(|&(i, o, l)| Sge::new(&mrs[i], o, l))
                    .collect();
                match qps[&qp].post_send(&[SendWr::new(wr_id, op.to_op(), &list)]) {
                    Ok(()) => Reply::Ok,
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
            Cmd::Poll { max, timeout_ms } => poll(&cq, max, timeout_ms),
            Cmd::WaitImmThenCheck {
                id,
                words,
                timeout_ms,
            } => {
                let mut buf = [WorkCompletion::default(); 1];
                match cq.wait(&mut buf, Duration::from_millis(timeout_ms)) {
                    Ok(_) => {
                        let mr = &mrs[id];
                        let wrong = (0..words)
                            .filter(|&i| {
                                mr.atomic_u64(i * 8)
                                    .unwrap()
                                    .load(std::sync::atomic::Ordering::Relaxed)
                                    != i as u64
                            })
                            .count();
                        Reply::Checked {
                            wc: Some(buf[0]),
                            wrong,
                        }
                    }
                    Err(_) => Reply::Checked { wc: None, wrong: 0 },
                }
            }
            Cmd::State { qp } => Reply::State(qps[&qp].state()),
            Cmd::FaaLoop {
                qp,
                addr,
                rkey,
                add,
                n,
            } => {
                let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
                let sg = [Sge::new(&res, 0, 8)];
                let mut bad = None;
                for i in 0..n {
                    let op = WrOp::FetchAdd {
                        remote: RemoteAddr { addr, rkey },
                        add,
                    };
                    qps[&qp].post_send(&[SendWr::new(i, op, &sg)]).unwrap();
                    let mut wc = [WorkCompletion::default(); 1];
                    match cq.wait(&mut wc, Duration::from_secs(10)) {
                        Ok(_) if wc[0].is_ok() => {}
                        r => {
                            bad = Some(format!("{r:?} {:?}", wc[0]));
                            break;
                        }
                    }
                }
                match bad {
                    None => Reply::Ok,
                    Some(e) => Reply::Err(e),
                }
            }
            Cmd::Stream { qp, data, cfg } => {
                let data = data.map(|i| &mrs[i]);
                Reply::Stream(run_stream(&qps[&qp], &cq, &pd, data, &cfg))
            }
            Cmd::AtomicHammer { qp, cfg } => {
                Reply::Atomics(atomic_hammer(&qps[&qp], &cq, &pd, &cfg))
            }
            Cmd::WaitThenExit { timeout_ms } => {
                reply(poll(&cq, 1, timeout_ms));
                break;
            }
            Cmd::Exit => {
                reply(Reply::Ok);
                break;
            }
        };
        reply(r);
    }
    // Close everything before exiting (exit runs no destructors): a provider's context that
    // is never closed leaves its resources behind (libfabric's shm regions under /dev/shm).
    drop(qps);
    drop(mrs);
    drop((cq, pd, ctx));
    std::process::exit(0);
}

/// [`Cmd::Poll`]: waits up to `timeout_ms` for up to `max` completions (none on a timeout).
fn poll(cq: &CompletionQueue, max: usize, timeout_ms: u64) -> Reply {
    let mut buf = vec![WorkCompletion::default(); max.max(1)];
    match cq.wait(&mut buf, Duration::from_millis(timeout_ms)) {
        Ok(n) => Reply::Wcs(buf[..n].to_vec()),
        Err(Error::Timeout { .. }) => Reply::Wcs(Vec::new()),
        Err(e) => Reply::Err(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Stream and atomics loops, run by the test process and by peers alike (the same code on both
// ends, so a hammer test can drive both directions of a queue pair at once).
// ---------------------------------------------------------------------------------------------

/// splitmix64: a cheap, well-mixed hash of a sequence number.
pub fn mix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Length (1..=max_len) of message `seq` of the stream `seed`.
pub fn msg_len(seed: u64, seq: u64, max_len: usize) -> usize {
    1 + (mix(seed ^ mix(seq)) % max_len as u64) as usize
}

/// Content of message `seq` of the stream `seed` (every byte depends on both and on its position).
pub fn msg_fill(seed: u64, seq: u64, buf: &mut [u8]) {
    let x = mix(mix(seed) ^ seq);
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (x >> ((i % 8) * 8)) as u8 ^ (i / 8) as u8;
    }
}

/// Index of the first byte of `data` that is not message `seq`, if any.
pub fn msg_mismatch(seed: u64, seq: u64, data: &[u8]) -> Option<usize> {
    let x = mix(mix(seed) ^ seq);
    data.iter()
        .enumerate()
        .position(|(i, &b)| b != (x >> ((i % 8) * 8)) as u8 ^ (i / 8) as u8)
}

/// How a stream moves its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamMode {
    /// SEND (every third one SEND_WITH_IMM carrying the sequence number) into posted receives.
    Send,
    /// WRITE_WITH_IMM into a ring of slots in the receiver's region, immediate = sequence number.
    WriteImm,
}

/// One end of a stream: it sends `send` messages and expects `recv` messages from the other end,
/// both at once, over one queue pair.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamCfg {
    pub mode: StreamMode,
    /// Messages this end sends (content from `tx_seed`).
    pub send: u64,
    /// Messages this end expects (content from `rx_seed`).
    pub recv: u64,
    /// Receives kept posted (reposted as they complete).
    pub depth: usize,
    /// Sends in flight at most (more than the peer's `depth` forces RNR back-pressure).
    pub window: usize,
    /// Messages are 1..=max_len bytes.
    pub max_len: usize,
    pub tx_seed: u64,
    pub rx_seed: u64,
    /// WriteImm: the other end's landing ring (`slots` slots of `max_len` bytes).
    pub remote: Option<RemoteBuffer>,
    /// WriteImm: slots in the landing rings (at least twice `depth`, so a slot is never
    /// rewritten before its receiver has checked it).
    pub slots: usize,
    /// The whole loop gives up (reporting an error) after this long.
    pub timeout_ms: u64,
}

impl StreamCfg {
    /// The configuration of the other end of the same stream.
    pub fn mirrored(&self, remote: Option<RemoteBuffer>) -> StreamCfg {
        StreamCfg {
            send: self.recv,
            recv: self.send,
            tx_seed: self.rx_seed,
            rx_seed: self.tx_seed,
            remote,
            ..self.clone()
        }
    }
}

/// What one end of a stream saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StreamReport {
    /// Sends completed successfully.
    pub sent: u64,
    /// Messages received and checked (right or wrong).
    pub received: u64,
    /// Wrong messages, wrong completions, failures.
    pub errors: u64,
    /// The first few errors, described.
    pub first_errors: Vec<String>,
    /// Times the send window was full (the peer's receives were the bottleneck).
    pub window_full: u64,
    pub millis: u64,
}

impl StreamReport {
    fn error(&mut self, what: String) {
        self.errors += 1;
        if self.first_errors.len() < 8 {
            self.first_errors.push(what);
        }
    }
}

/// Runs one end of a stream (see [`StreamCfg`]) and checks every message that arrives: its order,
/// length, immediate and every byte. Returns instead of panicking, so a peer can report.
pub fn run_stream(
    qp: &QueuePair,
    cq: &CompletionQueue,
    pd: &ProtectionDomain,
    data: Option<&MemoryRegion>,
    cfg: &StreamCfg,
) -> StreamReport {
    let start = Instant::now();
    let mut rep = StreamReport::default();
    let r = stream_loop(qp, cq, pd, data, cfg, &mut rep, start);
    if let Err(e) = r {
        rep.error(e);
    }
    rep.millis = start.elapsed().as_millis() as u64;
    rep
}

fn stream_loop(
    qp: &QueuePair,
    cq: &CompletionQueue,
    pd: &ProtectionDomain,
    data: Option<&MemoryRegion>,
    cfg: &StreamCfg,
    rep: &mut StreamReport,
    start: Instant,
) -> Result<(), String> {
    let deadline = start + Duration::from_millis(cfg.timeout_ms);
    let (ml, depth, window) = (cfg.max_len, cfg.depth as u64, cfg.window as u64);
    assert!(ml > 0 && depth > 0 && window > 0);
    let src = pd
        .alloc_mr(cfg.window * ml, AccessFlags::NONE)
        .map_err(|e| e.to_string())?;
    let rbuf = match cfg.mode {
        StreamMode::Send => Some(
            pd.alloc_mr(cfg.depth * ml, AccessFlags::LOCAL_WRITE)
                .map_err(|e| e.to_string())?,
        ),
        StreamMode::WriteImm => None,
    };
    if cfg.mode == StreamMode::WriteImm {
        if cfg.send > 0 && cfg.remote.is_none() {
            return Err("WriteImm stream without a remote ring".into());
        }
        if cfg.recv > 0 && data.is_none_or(|d| d.len() < cfg.slots * ml) {
            return Err("WriteImm stream without a big enough landing ring".into());
        }
    }
    let post_recv = |slot: u64| -> Result<(), String> {
        let r = match &rbuf {
            Some(b) => {
                let sg = [Sge::new(b, slot as usize * ml, ml)];
                qp.post_recv(&[RecvWr::new(slot, &sg)])
            }
            None => qp.post_recv(&[RecvWr::new(slot, &[])]),
        };
        r.map_err(|e| format!("post_recv: {e}"))
    };
    let mut posted = 0u64;
    while posted < depth.min(cfg.recv) {
        post_recv(posted % depth)?;
        posted += 1;
    }
    let (mut sent, mut completed, mut received) = (0u64, 0u64, 0u64);
    let mut msg = vec![0u8; ml];
    let mut wcs = [WorkCompletion::default(); 64];
    while completed < cfg.send || received < cfg.recv {
        while sent < cfg.send && sent - completed < window {
            let slot = (sent % window) as usize;
            let len = msg_len(cfg.tx_seed, sent, ml);
            msg_fill(cfg.tx_seed, sent, &mut msg[..len]);
            src.write(slot * ml, &msg[..len]).unwrap();
            let op = match cfg.mode {
                StreamMode::Send if sent % 3 == 0 => WrOp::SendWithImm { imm: sent as u32 },
                StreamMode::Send => WrOp::Send,
                StreamMode::WriteImm => WrOp::WriteWithImm {
                    remote: cfg
                        .remote
                        .unwrap()
                        .at((sent % cfg.slots as u64) * ml as u64),
                    imm: sent as u32,
                },
            };
            let sg = [Sge::new(&src, slot * ml, len)];
            qp.post_send(&[SendWr::new(sent, op, &sg)])
                .map_err(|e| format!("post_send #{sent}: {e}"))?;
            sent += 1;
        }
        if sent < cfg.send {
            rep.window_full += 1;
        }
        let n = match cq.poll(&mut wcs) {
            0 => cq.wait(&mut wcs, Duration::from_millis(50)).unwrap_or(0),
            n => n,
        };
        for wc in &wcs[..n] {
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm if wc.status != WcStatus::Success => {
                    return Err(format!("receive #{received} failed: {wc:?}"));
                }
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => {
                    let seq = received;
                    received += 1;
                    let len = msg_len(cfg.rx_seed, seq, ml);
                    let slot = seq % depth;
                    let (opcode, imm, at) = match cfg.mode {
                        StreamMode::Send => (
                            WcOpcode::Recv,
                            (seq % 3 == 0).then_some(seq as u32),
                            slot as usize * ml,
                        ),
                        StreamMode::WriteImm => (
                            WcOpcode::RecvRdmaWithImm,
                            Some(seq as u32),
                            (seq % cfg.slots as u64) as usize * ml,
                        ),
                    };
                    if (wc.wr_id, wc.opcode, wc.imm, wc.byte_len as usize)
                        != (slot, opcode, imm, len)
                    {
                        rep.error(format!(
                            "message #{seq}: expected wr_id {slot} {opcode:?} imm {imm:?} \
                             byte_len {len}, got {wc:?}"
                        ));
                    } else {
                        let mr = rbuf.as_ref().or(data).unwrap();
                        mr.read(at, &mut msg[..len]).unwrap();
                        if let Some(i) = msg_mismatch(cfg.rx_seed, seq, &msg[..len]) {
                            rep.error(format!(
                                "message #{seq} ({len} bytes): byte {i} is {:#04x}",
                                msg[i]
                            ));
                        }
                    }
                    if posted < cfg.recv {
                        post_recv(posted % depth)?;
                        posted += 1;
                    }
                }
                _ if wc.status != WcStatus::Success => {
                    return Err(format!("send #{completed} failed: {wc:?}"));
                }
                _ => {
                    if wc.wr_id != completed {
                        rep.error(format!(
                            "send completion out of order: want {completed}, {wc:?}"
                        ));
                    }
                    completed += 1;
                }
            }
        }
        rep.sent = completed;
        rep.received = received;
        if Instant::now() > deadline {
            return Err(format!(
                "timed out after {:?}: {sent} posted, {completed} sends completed, {received} \
                 of {} received; qp {:?}",
                deadline - start,
                cfg.recv,
                qp.state()
            ));
        }
    }
    Ok(())
}

/// What an atomics loop does: `n_faa` fetch-and-adds of `add` on `faa` (in bursts of `burst`
/// outstanding requests) and `n_cas` increments of `cas` by compare-and-swap, interleaved.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AtomicCfg {
    pub faa: RemoteAddr,
    pub cas: RemoteAddr,
    pub n_faa: u64,
    pub n_cas: u64,
    pub add: u64,
    pub burst: usize,
    /// A start barrier: fetch-and-add 1 on this word, then read it until it reaches the count
    /// (so that every process starts hammering at once).
    pub barrier: Option<(RemoteAddr, u64)>,
    pub timeout_ms: u64,
}

/// Every value an atomics loop saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AtomicReport {
    /// The old value each fetch-and-add returned, in order.
    pub faa_old: Vec<u64>,
    /// The value each successful compare-and-swap replaced (by value + 1), in order.
    pub cas_won: Vec<u64>,
    /// Compare-and-swaps that lost a race and were retried.
    pub cas_retries: u64,
    pub errors: Vec<String>,
    pub millis: u64,
}

/// Runs an atomics loop (see [`AtomicCfg`]). The compare-and-swap loop reads the word once, then
/// tries `old -> old + 1`, retrying with the value the failed attempt returned.
pub fn atomic_hammer(
    qp: &QueuePair,
    cq: &CompletionQueue,
    pd: &ProtectionDomain,
    cfg: &AtomicCfg,
) -> AtomicReport {
    let start = Instant::now();
    let mut rep = AtomicReport::default();
    if let Err(e) = atomic_loop(qp, cq, pd, cfg, &mut rep, start) {
        rep.errors.push(e);
    }
    rep.millis = start.elapsed().as_millis() as u64;
    rep
}

fn atomic_loop(
    qp: &QueuePair,
    cq: &CompletionQueue,
    pd: &ProtectionDomain,
    cfg: &AtomicCfg,
    rep: &mut AtomicReport,
    start: Instant,
) -> Result<(), String> {
    let deadline = start + Duration::from_millis(cfg.timeout_ms);
    let burst = cfg.burst.max(1);
    let res = pd
        .alloc_mr(8 * burst, AccessFlags::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    let word = |i: usize| res.atomic_u64(8 * i).unwrap().load(Ordering::Acquire);
    let mut next_id = 0u64;
    // Posts `ops` (op, result slot) as one list and waits for all their completions, in order.
    let mut run = |ops: &[WrOp]| -> Result<(), String> {
        let sges: Vec<[Sge; 1]> = (0..ops.len()).map(|i| [Sge::new(&res, 8 * i, 8)]).collect();
        let first = next_id;
        let wrs: Vec<SendWr> = ops
            .iter()
            .zip(&sges)
            .map(|(op, sg)| {
                next_id += 1;
                SendWr::new(next_id - 1, *op, sg)
            })
            .collect();
        qp.post_send(&wrs).map_err(|e| format!("post_send: {e}"))?;
        let mut buf = [WorkCompletion::default(); 16];
        let mut got = 0;
        while got < ops.len() {
            let n = cq.wait(&mut buf, Duration::from_millis(100)).unwrap_or(0);
            for wc in &buf[..n] {
                if !wc.is_ok() || wc.wr_id != first + got as u64 {
                    return Err(format!("atomic #{}: {wc:?}", first + got as u64));
                }
                got += 1;
            }
            if Instant::now() > deadline {
                return Err(format!("timed out; qp {:?}", qp.state()));
            }
        }
        Ok(())
    };
    if let Some((at, n)) = cfg.barrier {
        run(&[WrOp::FetchAdd { remote: at, add: 1 }])?;
        loop {
            run(&[WrOp::Read { remote: at }])?;
            if word(0) >= n {
                break;
            }
            std::thread::yield_now();
        }
    }
    run(&[WrOp::Read { remote: cfg.cas }])?;
    let mut guess = word(0);
    let (mut faa, mut cas) = (0u64, 0u64);
    while faa < cfg.n_faa || cas < cfg.n_cas {
        let k = (cfg.n_faa - faa).min(burst as u64) as usize;
        if k > 0 {
            let op = WrOp::FetchAdd {
                remote: cfg.faa,
                add: cfg.add,
            };
            run(&vec![op; k])?;
            rep.faa_old.extend((0..k).map(word));
            faa += k as u64;
        }
        if cas < cfg.n_cas {
            loop {
                run(&[WrOp::CompareSwap {
                    remote: cfg.cas,
                    compare: guess,
                    swap: guess + 1,
                }])?;
                let old = word(0);
                if old == guess {
                    rep.cas_won.push(old);
                    guess = old + 1;
                    break;
                }
                rep.cas_retries += 1;
                guess = old;
            }
            cas += 1;
        }
    }
    Ok(())
}
