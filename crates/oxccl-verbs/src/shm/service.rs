//! The shm provider's segment service and its view of peer contexts.
//!
//! A small service thread per context answers peers' requests for segment descriptors over an
//! abstract Unix socket (SCM_RIGHTS), after checking the caller's uid and the secret key it
//! presents. It is off the data path: a peer asks once per segment and caches the mapping. The same
//! thread watches the pidfd of every peer process it has mapped, so that the data path learns of a
//! peer's death from one atomic load.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::contract::ctx::{CTX_MAGIC, MAX_CQ, OFF_ALIVE, OFF_MAGIC, ctx_segment_len};
use crate::contract::{CtxTables, SEQ, SLEEPERS, Segment, notify_word};
use crate::model::{Error, Result};

// Segment-service request kinds.
const REQ_CTX: u64 = 1;
const REQ_QP: u64 = 2;
const REQ_MR: u64 = 3;

/// What the segment service may hand out, keyed by secret tokens.
#[derive(Default)]
pub(crate) struct Registry {
    /// The context segment and the context's token.
    pub ctx: OnceLock<(u64, Arc<Segment>)>,
    /// Queue-pair segments by queue-pair token.
    pub qps: Mutex<HashMap<u64, Arc<Segment>>>,
    /// Provider memory by (table index, lkey).
    pub mrs: Mutex<HashMap<(u32, u64), Arc<Segment>>>,
}

/// Peer contexts by (pid, context token).
pub(crate) type PeerMap = Arc<Mutex<HashMap<(u32, u64), Arc<PeerCtx>>>>;

/// Wakes the service thread (new peer to watch, or shutdown).
pub(crate) fn kick(wake: &OwnedFd) {
    let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
}

/// The peer context behind `(pid, token, sock)` in `peers`, mapped and watched; created on first
/// use (`wake` tells the service thread to watch it).
pub(crate) fn peer(
    peers: &PeerMap,
    wake: &OwnedFd,
    pid: u32,
    token: u64,
    sock: &str,
    cancel: Option<&crate::Cancel>,
) -> Result<Arc<PeerCtx>> {
    let known = |peers: &HashMap<(u32, u64), Arc<PeerCtx>>| {
        peers
            .get(&(pid, token))
            .filter(|p| !p.dead.load(Ordering::Acquire))
            .cloned()
    };
    if let Some(p) = known(&peers.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(p);
    }
    // Not under the lock: the peer may be ourselves, and our own service thread needs the
    // lock to answer.
    let p = Arc::new(PeerCtx::connect(pid, token, sock, cancel)?);
    let mut map = peers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(existing) = known(&map) {
        return Ok(existing);
    }
    map.insert((pid, token), p.clone());
    drop(map);
    // The service thread watches the new peer's pidfd from now on.
    kick(wake);
    Ok(p)
}

/// A peer context seen from here: its mapped context segment, pidfd and cached region mappings.
pub(crate) struct PeerCtx {
    pub pid: u32,
    pub sock: String,
    pub seg: Segment,
    /// The peer process's pidfd; `None` where the kernel has no `pidfd_open` (before Linux
    /// 5.3, or under valgrind): the service thread then checks the process every
    /// [`PID_CHECK`] with `kill(pid, 0)`.
    pidfd: Option<OwnedFd>,
    pub dead: AtomicBool,
    mrs: Mutex<HashMap<u32, (u64, Arc<Segment>)>>,
}

impl PeerCtx {
    fn connect(
        pid: u32,
        token: u64,
        sock: &str,
        cancel: Option<&crate::Cancel>,
    ) -> Result<PeerCtx> {
        let raw = rustix::process::Pid::from_raw(pid as i32)
            .ok_or_else(|| Error::arg(format!("peer pid {pid} is invalid")))?;
        let pidfd = match rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => Some(fd),
            Err(rustix::io::Errno::NOSYS) => None,
            Err(e) => return Err(Error::os(format!("pidfd_open of peer process {pid}"), e)),
        };
        let fd = fetch_fd(sock, REQ_CTX, token, 0, cancel)?;
        let seg = Segment::open(fd)?;
        if seg.len() < ctx_segment_len()
            || seg.atomic_u64(OFF_MAGIC).load(Ordering::Acquire) != CTX_MAGIC
        {
            return Err(Error::arg(format!(
                "peer {pid}'s context segment is not an oxccl context"
            )));
        }
        Ok(PeerCtx {
            pid,
            sock: sock.to_string(),
            seg,
            pidfd,
            dead: AtomicBool::new(false),
            mrs: Mutex::new(HashMap::new()),
        })
    }

    /// Whether the peer is known to be gone: its process exited (the service thread watches its
    /// pidfd and sets `dead`) or it closed its context. Two atomic loads, no syscall.
    pub(crate) fn is_dead(&self) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return true;
        }
        if self.seg.atomic_u32(OFF_ALIVE).load(Ordering::Acquire) == 0 {
            self.dead.store(true, Ordering::Release);
            return true;
        }
        false
    }

    /// The mapping of the peer's region at table `index` whose lkey is `lkey`, fetched on first use.
    pub(crate) fn mr_segment(&self, index: u32, lkey: u64) -> Result<Arc<Segment>> {
        let mut mrs = self.mrs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, seg)) = mrs.get(&index)
            && *k == lkey
        {
            return Ok(seg.clone());
        }
        let seg = Arc::new(Segment::open(fetch_fd(
            &self.sock,
            REQ_MR,
            index as u64,
            lkey,
            None,
        )?)?);
        mrs.insert(index, (lkey, seg.clone()));
        Ok(seg)
    }

    /// Maps the peer's queue-pair segment named by `token`.
    pub(crate) fn qp_segment(&self, token: u64, cancel: Option<&crate::Cancel>) -> Result<Segment> {
        Segment::open(fetch_fd(&self.sock, REQ_QP, token, 0, cancel)?)
    }
}

const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the segment service at `sock` for a descriptor. With `cancel`, looks at it every
/// 100 ms while waiting for the answer (a stopped peer never answers).
fn fetch_fd(
    sock: &str,
    kind: u64,
    a: u64,
    b: u64,
    cancel: Option<&crate::Cancel>,
) -> Result<OwnedFd> {
    let what = || format!("fetching a shared segment from peer socket @{sock}");
    let addr = SocketAddr::from_abstract_name(sock.as_bytes()).map_err(|e| Error::os(what(), e))?;
    let mut s = UnixStream::connect_addr(&addr).map_err(|e| {
        Error::os(
            format!(
                "{} (is the peer alive and on this host, in this network namespace?)",
                what()
            ),
            e,
        )
    })?;
    let slice = if cancel.is_some() {
        Duration::from_millis(100)
    } else {
        FETCH_TIMEOUT
    };
    s.set_read_timeout(Some(slice))
        .map_err(|e| Error::os(what(), e))?;
    let deadline = std::time::Instant::now() + FETCH_TIMEOUT;
    let mut req = [0u8; 24];
    req[0..8].copy_from_slice(&kind.to_le_bytes());
    req[8..16].copy_from_slice(&a.to_le_bytes());
    req[16..24].copy_from_slice(&b.to_le_bytes());
    s.write_all(&req).map_err(|e| Error::os(what(), e))?;
    let mut status = [0u8; 8];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(&mut status)];
    let got = loop {
        match rustix::net::recvmsg(&s, &mut iov, &mut cmsg, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::AGAIN) if std::time::Instant::now() < deadline => {
                if cancel.is_some_and(crate::Cancel::is_cancelled) {
                    return Err(Error::arg(format!(
                        "{}: cancelled while waiting for its answer",
                        what()
                    )));
                }
            }
            Err(rustix::io::Errno::AGAIN) => {
                return Err(Error::Timeout {
                    what: format!("the segment service of peer socket @{sock} to answer"),
                    timeout: FETCH_TIMEOUT,
                });
            }
            Err(e) => return Err(Error::os(what(), e)),
            Ok(got) => break got,
        }
    };
    let mut fd = None;
    for msg in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = msg {
            fd = fds.next();
        }
    }
    if got.bytes != 8 {
        return Err(Error::os(
            what(),
            std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short reply"),
        ));
    }
    match (u64::from_le_bytes(status), fd) {
        (0, Some(fd)) => Ok(fd),
        (code, _) => Err(Error::arg(format!(
            "peer segment service refused the request (kind {kind}, code {code}): the segment was \
             destroyed or deregistered, or the key is wrong"
        ))),
    }
}

/// How often the service thread checks a peer process it has no pidfd for.
const PID_CHECK: Duration = Duration::from_millis(100);

/// The context's background thread: answers segment requests and watches peers' processes.
///
/// It sleeps in one `poll` on the listening socket, an eventfd (new peer, shutdown) and the pidfd
/// of every live peer. When a peer process exits its pidfd becomes readable: the thread marks the
/// peer dead and wakes every sleeping completion queue of this context, so waiters notice at once
/// and the data path itself never has to make a syscall to check.
pub(crate) struct Service {
    pub listener: UnixListener,
    pub registry: Arc<Registry>,
    pub stop: Arc<AtomicBool>,
    pub wake: Arc<OwnedFd>,
    pub peers: PeerMap,
}

impl Service {
    pub(crate) fn run(self) {
        use rustix::event::{PollFd, PollFlags};
        while !self.stop.load(Ordering::SeqCst) {
            let live: Vec<Arc<PeerCtx>> = self
                .peers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|p| !p.dead.load(Ordering::Acquire))
                .cloned()
                .collect();
            let mut fds = vec![
                PollFd::new(&self.listener, PollFlags::IN),
                PollFd::new(&*self.wake, PollFlags::IN),
            ];
            let watched: Vec<&Arc<PeerCtx>> = live.iter().filter(|p| p.pidfd.is_some()).collect();
            fds.extend(
                watched
                    .iter()
                    .filter_map(|p| p.pidfd.as_ref())
                    .map(|fd| PollFd::new(fd, PollFlags::IN)),
            );
            // Peers without a pidfd are checked every PID_CHECK.
            let unwatched = watched.len() < live.len();
            let timeout = unwatched.then(|| rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: PID_CHECK.as_nanos() as _,
            });
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            if ready[1] {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&*self.wake, &mut buf);
            }
            let mut died = false;
            for (p, r) in watched.iter().zip(&ready[2..]) {
                if *r {
                    p.dead.store(true, Ordering::Release);
                    died = true;
                }
            }
            for p in live.iter().filter(|p| p.pidfd.is_none()) {
                let pid = rustix::process::Pid::from_raw(p.pid as i32);
                if pid.is_some_and(|pid| {
                    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
                }) {
                    p.dead.store(true, Ordering::Release);
                    died = true;
                }
            }
            if died {
                self.wake_all_cqs();
            }
            if ready[0] {
                while let Ok((conn, _)) = self.listener.accept() {
                    self.answer(conn);
                }
            }
        }
    }

    /// Bumps every completion-queue doorbell of this context so sleepers re-check their peers.
    fn wake_all_cqs(&self) {
        let Some((_, seg)) = self.registry.ctx.get() else {
            return;
        };
        for i in 0..MAX_CQ as u32 {
            notify_word(seg.cq_word(i, 0), seg.cq_word(i, 1));
        }
    }

    fn answer(&self, mut conn: UnixStream) {
        // Only processes of the same user may map our memory (the 0600 rule of named segments).
        match rustix::net::sockopt::socket_peercred(&conn) {
            Ok(cred) if cred.uid == rustix::process::getuid() => {}
            _ => return,
        }
        if conn.set_nonblocking(false).is_err()
            || conn.set_read_timeout(Some(Duration::from_secs(2))).is_err()
        {
            return;
        }
        let mut req = [0u8; 24];
        if conn.read_exact(&mut req).is_err() {
            return;
        }
        let word = |i: usize| u64::from_le_bytes(req[i * 8..i * 8 + 8].try_into().unwrap());
        let (kind, a, b) = (word(0), word(1), word(2));
        let registry = &self.registry;
        let seg: Option<Arc<Segment>> = match kind {
            REQ_CTX => registry
                .ctx
                .get()
                .filter(|(t, _)| *t == a)
                .map(|(_, s)| s.clone()),
            REQ_QP => registry
                .qps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&a)
                .cloned(),
            REQ_MR => registry
                .mrs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&(a as u32, b))
                .cloned(),
            _ => None,
        };
        let status: u64 = if seg.is_some() { 0 } else { 1 };
        let bytes = status.to_le_bytes();
        let iov = [IoSlice::new(&bytes)];
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(seg) = &seg {
            fds = [seg.fd()];
            cmsg.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let _ = rustix::net::sendmsg(&conn, &iov, &mut cmsg, SendFlags::NOSIGNAL);
    }
}

/// Bumps the doorbell of completion queue `index` of a peer context (waking its sleepers, if
/// any: no syscall when nobody sleeps).
pub(crate) fn notify_peer(peer: &PeerCtx, index: u32) {
    if (index as usize) < MAX_CQ {
        notify_word(
            peer.seg.cq_word(index, SEQ),
            peer.seg.cq_word(index, SLEEPERS),
        );
    }
}
