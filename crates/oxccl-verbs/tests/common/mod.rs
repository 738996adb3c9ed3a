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
use std::sync::mpsc;
use std::time::Duration;

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
                if let Some(at) = line.find("@@") {
                    if tx.send(line[at + 2..].to_string()).is_err() {
                        break;
                    }
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
        let line = serde_json::to_string(&cmd).unwrap();
        writeln!(self.stdin, "{line}").expect("peer stdin");
        self.stdin.flush().unwrap();
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
        let ctx = Device::by_name(provider).unwrap().open().unwrap();
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

/// The peer process's main loop (runs inside the re-executed test binary).
pub fn peer_main() {
    let Ok(provider) = std::env::var("OXCCL_TEST_PEER") else {
        return;
    };
    let ctx = Device::by_name(&provider).unwrap().open().unwrap();
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
            Cmd::Poll { max, timeout_ms } => {
                let mut buf = vec![WorkCompletion::default(); max.max(1)];
                match cq.wait(&mut buf, Duration::from_millis(timeout_ms)) {
                    Ok(n) => Reply::Wcs(buf[..n].to_vec()),
                    Err(Error::Timeout { .. }) => Reply::Wcs(Vec::new()),
                    Err(e) => Reply::Err(e.to_string()),
                }
            }
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
            Cmd::Exit => {
                reply(Reply::Ok);
                break;
            }
        };
        reply(r);
    }
    drop(qps);
    std::process::exit(0);
}
