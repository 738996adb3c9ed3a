//! Device, context and protection domain; the context's shared segment and its segment service.
//!
//! Every context owns one shared *context segment* (published to peers) holding:
//! - a header (magic, pid, liveness),
//! - a table of completion-queue doorbells (futex words peers bump when they complete a RECV),
//! - the memory-region table peers validate rkeys/lkeys against (keys, address, length, access).
//!
//! A small service thread answers peers' requests for segment descriptors over an abstract Unix
//! socket (SCM_RIGHTS), after checking the caller's uid and the secret key it presents. It is off the
//! data path: a peer asks once per segment and caches the mapping.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::EventfdFlags;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::config::DeviceConfig;
use crate::error::{Error, Result};
use crate::segment::Segment;

pub(crate) const CTX_MAGIC: u64 = 0x6f78_6363_6c5f_6374; // "oxccl_ct"
pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_PID: usize = 8;
pub(crate) const OFF_ALIVE: usize = 12;
pub(crate) const CQ_TABLE: usize = 4096;
pub(crate) const CQ_SLOT: usize = 64;
pub(crate) const MAX_CQ: usize = 1024;
pub(crate) const MR_TABLE: usize = CQ_TABLE + MAX_CQ * CQ_SLOT;
pub(crate) const MR_SLOT: usize = 64;
/// Low bits of a key index the region table; the rest is random.
pub(crate) const MR_INDEX_BITS: u32 = 16;
pub(crate) const MAX_MR: usize = 1 << MR_INDEX_BITS;
const CTX_SEG_LEN: usize = MR_TABLE + MAX_MR * MR_SLOT;

/// The context segment's tables, for our own context and for a peer's mapping of theirs.
pub(crate) trait CtxTables {
    /// Word `word` of completion-queue doorbell `index` (0: sequence, 1: sleepers).
    fn cq_word(&self, index: u32, word: usize) -> &AtomicU32;
    /// The 8-byte field at `off` of region-table entry `index`.
    fn mr_u64(&self, index: u32, off: usize) -> &AtomicU64;
    /// The 4-byte field at `off` of region-table entry `index`.
    fn mr_u32(&self, index: u32, off: usize) -> &AtomicU32;
}

impl CtxTables for Segment {
    fn cq_word(&self, index: u32, word: usize) -> &AtomicU32 {
        self.atomic_u32(CQ_TABLE + index as usize * CQ_SLOT + word * 4)
    }
    fn mr_u64(&self, index: u32, off: usize) -> &AtomicU64 {
        self.atomic_u64(MR_TABLE + index as usize * MR_SLOT + off)
    }
    fn mr_u32(&self, index: u32, off: usize) -> &AtomicU32 {
        self.atomic_u32(MR_TABLE + index as usize * MR_SLOT + off)
    }
}

// Offsets inside one MR table entry.
pub(crate) const MR_RKEY: usize = 0;
pub(crate) const MR_LKEY: usize = 8;
pub(crate) const MR_ADDR: usize = 16;
pub(crate) const MR_LEN: usize = 24;
pub(crate) const MR_ACCESS: usize = 32;
pub(crate) const MR_KIND: usize = 36;
pub(crate) const MR_KIND_SEGMENT: u32 = 1;
pub(crate) const MR_KIND_USER: u32 = 2;

// Segment-service request kinds.
const REQ_CTX: u64 = 1;
const REQ_QP: u64 = 2;
const REQ_MR: u64 = 3;

/// Tunables shared by a context's queues.
#[derive(Clone, Debug)]
pub(crate) struct Tuning {
    /// How long a waiter spins before it yields and then sleeps.
    pub spin: Duration,
}

/// The verbs providers this build contains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// Kernel bypass between processes of one host: shared memory, one copy, no syscall.
    Shm,
    /// RDMA semantics over TCP sockets, for hosts without RDMA hardware.
    Tcp,
}

impl Provider {
    /// Every provider built in.
    pub const ALL: &'static [Provider] = &[Provider::Shm, Provider::Tcp];

    /// The provider's name, as `Device::open` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Shm => "shm",
            Provider::Tcp => "tcp",
        }
    }
}

impl std::str::FromStr for Provider {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "shm" => Ok(Provider::Shm),
            "tcp" => Ok(Provider::Tcp),
            _ => Err(Error::UnknownProvider(
                s.to_string(),
                Provider::ALL
                    .iter()
                    .map(|p| p.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            )),
        }
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A verbs device: a provider that can be opened (`ibv_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    provider: Provider,
}

impl Device {
    /// Every device this build offers, one per provider.
    pub fn list() -> Vec<Device> {
        Provider::ALL
            .iter()
            .map(|&provider| Device { provider })
            .collect()
    }

    /// The device of the named provider (`"shm"`).
    pub fn by_name(name: &str) -> Result<Device> {
        Ok(Device {
            provider: name.parse()?,
        })
    }

    /// The provider behind this device.
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Opens a context on this device (`ibv_open_device`), configured from the environment
    /// ([`DeviceConfig::from_env`]).
    pub fn open(&self) -> Result<Context> {
        Context::open_with(self.provider, &DeviceConfig::from_env()?)
    }

    /// Opens a context on this device with the given configuration.
    pub fn open_with(&self, config: &DeviceConfig) -> Result<Context> {
        Context::open_with(self.provider, config)
    }
}

/// An open device (`ibv_context`): owns the shared segment that peers map and the segment service.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

pub(crate) struct CtxInner {
    pub provider: Provider,
    pub seg: Arc<Segment>,
    pub token: u64,
    pub pid: u32,
    pub host: String,
    pub sock_name: String,
    pub tuning: Tuning,
    /// The tcp progress engine, for tcp contexts.
    pub tcp: Option<crate::tcp::Engine>,
    pub registry: Arc<Registry>,
    pub tables: Mutex<Tables>,
    pub peers: PeerMap,
    wake: Arc<OwnedFd>,
    pub next_qpn: AtomicU32,
    pub next_pd: AtomicU64,
    service: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
}

/// Wakes the service thread (new peer to watch, or shutdown).
fn kick(wake: &OwnedFd) {
    let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
}

/// Free slots of the context's tables.
/// Peer contexts by (pid, context token).
pub(crate) type PeerMap = Arc<Mutex<HashMap<(u32, u64), Arc<PeerCtx>>>>;

pub(crate) struct Tables {
    pub free_cq: Vec<u32>,
    pub free_mr: Vec<u32>,
}

/// What the segment service may hand out, keyed by secret tokens.
#[derive(Default)]
pub(crate) struct Registry {
    pub ctx: OnceLock<(u64, Arc<Segment>)>,
    pub qps: Mutex<HashMap<u64, Arc<Segment>>>,
    /// Live regions by table index (the tcp target validates requests against them).
    pub regions: Arc<Mutex<HashMap<u32, std::sync::Weak<crate::mr::MrInner>>>>,
    pub mrs: Mutex<HashMap<(u32, u64), Arc<Segment>>>,
}

impl Context {
    /// Opens a context for `provider` (same as `Device { provider }.open()`), configured from
    /// the environment.
    pub fn open(provider: Provider) -> Result<Context> {
        Context::open_with(provider, &DeviceConfig::from_env()?)
    }

    /// Opens a context for `provider` with the given configuration.
    pub fn open_with(provider: Provider, config: &DeviceConfig) -> Result<Context> {
        let seg = Arc::new(Segment::create("oxccl-ctx", CTX_SEG_LEN)?);
        let pid = std::process::id();
        let token = random_u64();
        seg.atomic_u32(OFF_PID).store(pid, Ordering::Relaxed);
        seg.atomic_u32(OFF_ALIVE).store(1, Ordering::Relaxed);
        seg.atomic_u64(OFF_MAGIC)
            .store(CTX_MAGIC, Ordering::Release);
        let registry = Arc::new(Registry::default());
        let _ = registry.ctx.set((token, seg.clone()));
        let sock_name = format!("oxccl.{pid}.{token:016x}");
        let addr = SocketAddr::from_abstract_name(sock_name.as_bytes())
            .map_err(|e| Error::os("abstract socket name", e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            Error::os(
                format!("binding the segment service socket @{sock_name}"),
                e,
            )
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("segment service socket", e))?;
        let wake = Arc::new(
            rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| Error::os("eventfd for the segment service", e))?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let peers = PeerMap::default();
        let service = {
            let svc = Service {
                listener,
                registry: registry.clone(),
                stop: stop.clone(),
                wake: wake.clone(),
                peers: peers.clone(),
            };
            std::thread::Builder::new()
                .name("oxccl-shm-svc".into())
                .spawn(move || svc.run())
                .map_err(|e| Error::os("spawning the segment service thread", e))?
        };
        let tcp = match provider {
            Provider::Tcp => Some(crate::tcp::Engine::start(
                registry.regions.clone(),
                config.tcp_addr,
                config.tcp_busy_poll,
                config.tcp_inline_max,
            )?),
            Provider::Shm => None,
        };
        Ok(Context {
            inner: Arc::new(CtxInner {
                provider,
                seg,
                token,
                pid,
                host: host_id(),
                sock_name,
                tuning: Tuning { spin: config.spin },
                tcp,
                registry,
                tables: Mutex::new(Tables {
                    free_cq: (0..MAX_CQ as u32).rev().collect(),
                    free_mr: (0..MAX_MR as u32).rev().collect(),
                }),
                peers,
                wake,
                next_qpn: AtomicU32::new(1),
                next_pd: AtomicU64::new(1),
                service: Mutex::new(Some(service)),
                stop,
            }),
        })
    }

    /// The provider this context runs.
    pub fn provider(&self) -> Provider {
        self.inner.provider
    }

    /// The address of a tcp context's listener, which its queue pairs advertise (`None` for
    /// other providers).
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.tcp.as_ref().map(|t| t.shared().addr)
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            ctx: self.clone(),
            id: self.inner.next_pd.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Creates a completion queue (`ibv_create_cq`); `cqe` is a hint, the queue grows as needed.
    pub fn create_cq(&self, cqe: usize) -> Result<crate::cq::CompletionQueue> {
        crate::cq::CompletionQueue::new(self.inner.clone(), cqe)
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        self.seg.atomic_u32(OFF_ALIVE).store(0, Ordering::Release);
        self.stop.store(true, Ordering::SeqCst);
        kick(&self.wake);
        if let Some(h) = self
            .service
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
    }
}

impl CtxInner {
    /// The peer context behind `(pid, token, sock)`, mapped and watched; created on first use.
    pub(crate) fn peer(&self, pid: u32, token: u64, sock: &str) -> Result<Arc<PeerCtx>> {
        let known = |peers: &HashMap<(u32, u64), Arc<PeerCtx>>| {
            peers
                .get(&(pid, token))
                .filter(|p| !p.dead.load(Ordering::Acquire))
                .cloned()
        };
        if let Some(p) = known(&self.peers.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(p);
        }
        // Not under the lock: the peer may be ourselves, and our own service thread needs the
        // lock to answer.
        let p = Arc::new(PeerCtx::connect(pid, token, sock)?);
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = known(&peers) {
            return Ok(existing);
        }
        peers.insert((pid, token), p.clone());
        drop(peers);
        // The service thread watches the new peer's pidfd from now on.
        kick(&self.wake);
        Ok(p)
    }
}

/// A protection domain (`ibv_pd`): memory regions and queue pairs of one domain work together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) ctx: Context,
    pub(crate) id: u64,
}

impl ProtectionDomain {
    /// The context this domain belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// A peer context seen from here: its mapped context segment, pidfd and cached region mappings.
pub(crate) struct PeerCtx {
    pub pid: u32,
    pub sock: String,
    pub seg: Segment,
    pidfd: OwnedFd,
    pub dead: AtomicBool,
    mrs: Mutex<HashMap<u32, (u64, Arc<Segment>)>>,
}

impl PeerCtx {
    fn connect(pid: u32, token: u64, sock: &str) -> Result<PeerCtx> {
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid as i32)
                .ok_or_else(|| Error::arg(format!("peer pid {pid} is invalid")))?,
            rustix::process::PidfdFlags::empty(),
        )
        .map_err(|e| Error::os(format!("pidfd_open of peer process {pid}"), e))?;
        let fd = fetch_fd(sock, REQ_CTX, token, 0)?;
        let seg = Segment::open(fd)?;
        if seg.len() < CTX_SEG_LEN || seg.atomic_u64(OFF_MAGIC).load(Ordering::Acquire) != CTX_MAGIC
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
        )?)?);
        mrs.insert(index, (lkey, seg.clone()));
        Ok(seg)
    }

    /// Maps the peer's queue-pair segment named by `token`.
    pub(crate) fn qp_segment(&self, token: u64) -> Result<Segment> {
        Segment::open(fetch_fd(&self.sock, REQ_QP, token, 0)?)
    }
}

const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the segment service at `sock` for a descriptor.
fn fetch_fd(sock: &str, kind: u64, a: u64, b: u64) -> Result<OwnedFd> {
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
    s.set_read_timeout(Some(FETCH_TIMEOUT))
        .map_err(|e| Error::os(what(), e))?;
    let mut req = [0u8; 24];
    req[0..8].copy_from_slice(&kind.to_le_bytes());
    req[8..16].copy_from_slice(&a.to_le_bytes());
    req[16..24].copy_from_slice(&b.to_le_bytes());
    s.write_all(&req).map_err(|e| Error::os(what(), e))?;
    let mut status = [0u8; 8];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(&mut status)];
    let got = rustix::net::recvmsg(&s, &mut iov, &mut cmsg, RecvFlags::CMSG_CLOEXEC).map_err(
        |e| match e {
            rustix::io::Errno::AGAIN => Error::Timeout {
                what: format!("the segment service of peer socket @{sock} to answer"),
                timeout: FETCH_TIMEOUT,
            },
            e => Error::os(what(), e),
        },
    )?;
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

/// The context's background thread: answers segment requests and watches peers' processes.
///
/// It sleeps in one `poll` on the listening socket, an eventfd (new peer, shutdown) and the pidfd
/// of every live peer. When a peer process exits its pidfd becomes readable: the thread marks the
/// peer dead and wakes every sleeping completion queue of this context, so waiters notice at once
/// and the data path itself never has to make a syscall to check.
struct Service {
    listener: UnixListener,
    registry: Arc<Registry>,
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    peers: PeerMap,
}

impl Service {
    fn run(self) {
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
            fds.extend(live.iter().map(|p| PollFd::new(&p.pidfd, PollFlags::IN)));
            match rustix::event::poll(&mut fds, None) {
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
            for (p, r) in live.iter().zip(&ready[2..]) {
                if *r {
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
            crate::cq::notify_word(seg.cq_word(i, 0), seg.cq_word(i, 1));
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

/// A random, unguessable 64-bit value (from the OS).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("the OS random source failed");
    u64::from_le_bytes(b)
}

/// This host's identity: the boot id (namespaces share it; the bootstrap adds the netns later).
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-boot-id".into())
}
