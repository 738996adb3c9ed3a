//! The transfer engine: local memory, opened segments, the handshake service and the threads
//! that keep the engine reachable. Batches and their completions are in [`crate::batch`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxccl_verbs::progress::{Progress, run_helper};
use oxccl_verbs::{
    AccessFlags, CompletionQueue, ConnectRole, Context, Device, DeviceConfig, EndpointAddr,
    MemoryRegion, ProtectionDomain, Provider, QpConfig, QpEndpoint, QueuePair, RecvWr, Sge,
    WorkCompletion,
};

use crate::batch::Batches;
use crate::config::{Encrypt, EngineConfig, Protocol};
use crate::desc::{BufferDesc, DESC_FORMAT, SegmentDesc};
use crate::error::{Error, Result};
use crate::handshake::{self, Client, Msg, Server};
use crate::meta::Metadata;

/// The purpose the lanes' job key is derived for.
const LANES_PURPOSE: &str = "oxccl-kv lanes v1";

/// Largest notification message, bytes (one posted receive buffer).
pub const MAX_NOTIFY: usize = 4096;
/// Receive buffers posted per inbound connection for notifications.
const NOTIFY_DEPTH: usize = 64;
/// Requests in flight per lane before later ones wait in the engine: a segment's queue pair
/// takes this many per lane (its connections).
pub(crate) const LANE_WINDOW: usize = 1024;
/// Bytes in flight per lane before later requests wait in the engine: a segment's queue pair
/// takes this many per lane, so the bytes in flight do not depend on how they are carried.
pub(crate) const LANE_BYTES: usize = 16 << 20;

/// A notification: a message a peer delivered with a batch, after the batch's data was visible
/// here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The name of the engine that sent it.
    pub from: String,
    /// The message.
    pub msg: Vec<u8>,
}

/// An opened segment, as [`TransferEngine::open_segment`] returns it: what requests name as
/// their target.
pub type SegmentId = u64;

/// A service answering calls that peers make over the handshake channel
/// ([`TransferEngine::serve`], [`TransferEngine::call`]): `(caller's name, body) → reply`.
pub type Service = Arc<dyn Fn(&str, &[u8]) -> Result<Vec<u8>> + Send + Sync>;

/// Rewrites the tcp address a target's queue pair listens on ([`TransferEngine::redirect_lanes`]).
#[doc(hidden)]
pub type LaneRedirect = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// One provider this engine serves: its context, protection domain and completion queues.
pub(crate) struct Dev {
    pub provider: Provider,
    /// Its name in descriptors' rkey lists: the provider's.
    pub label: String,
    pub pd: ProtectionDomain,
    /// Completions of this engine's own requests (all opened segments on this provider).
    pub send_cq: CompletionQueue,
    /// Receive completions (notifications) of inbound connections, taken by this device's
    /// notification thread.
    pub recv: Arc<Progress>,
    _ctx: Context,
}

/// A range of local memory registered with every provider.
pub(crate) struct Region {
    pub addr: u64,
    pub len: usize,
    /// One region per [`Dev`], in the same order.
    pub mrs: Vec<MemoryRegion>,
    /// Whether the engine allocated it (`allocate_managed_buffer`).
    pub managed: bool,
}

impl Region {
    fn desc(&self, devs: &[Dev]) -> BufferDesc {
        BufferDesc {
            addr: self.addr,
            len: self.len as u64,
            rkeys: devs
                .iter()
                .zip(&self.mrs)
                .map(|(d, m)| (d.label.clone(), m.rkey()))
                .collect(),
        }
    }
}

/// A segment this engine opened: a queue pair connected to the owner's. Over tcp its lanes are
/// the queue pair's connections ([`oxccl_verbs::DeviceConfig::tcp_nsocks`]): the provider
/// stripes large WRITEs over them and reads them with several progress threads.
pub(crate) struct Peer {
    pub id: SegmentId,
    pub name: String,
    /// The dev (context on this side) of the queue pair.
    pub dev: usize,
    /// The rkey set at the target: the label its registrations have there.
    pub key: String,
    /// The queue pair's lanes (its connections; 1 on shm): its window is this many lanes'.
    pub lanes: usize,
    pub desc: RwLock<SegmentDesc>,
    pub qp: QueuePair,
    /// The authenticated handshake connection, kept for service calls.
    pub client: Mutex<Client>,
    /// Whether the queue pair's connections are sealed (encrypted and authenticated).
    pub sealed: bool,
    /// Set when the queue pair failed: later requests fail at once with it.
    pub failed: Mutex<Option<String>>,
    /// Slices waiting for room in the queue pair's window.
    pub queue: Mutex<crate::batch::LaneQueue>,
}

impl Peer {
    /// The dev of the queue pair (notifications go there too).
    pub(crate) fn dev(&self) -> usize {
        self.dev
    }
}

/// An inbound connection: a peer's queue pair to this engine, and the buffers its notifications
/// land in.
struct Inbound {
    from: String,
    /// The address the peer's handshake came from: the caps count by it.
    ip: IpAddr,
    /// Its queue pairs' connections (lanes).
    lanes: usize,
    qps: Vec<QueuePair>,
    bufs: MemoryRegion,
}

pub(crate) struct Inner {
    pub name: String,
    pub config: EngineConfig,
    pub host: String,
    pub devs: Vec<Dev>,
    meta: Arc<dyn Metadata>,
    handshake_addr: String,
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    version: AtomicU64,
    pub peers: RwLock<HashMap<SegmentId, Arc<Peer>>>,
    /// Every queue pair's peer, by (dev, queue pair number), for completions. A batch holds its
    /// peers until it is over, so a peer replaced after a failure, or closed, still gets its
    /// last completions.
    lanes: RwLock<HashMap<(usize, u32), Weak<Peer>>>,
    by_name: Mutex<HashMap<String, SegmentId>>,
    next_segment: AtomicU64,
    pub batches: Batches,
    /// The send queues of `devs` (queue `i` is `devs[i]`'s), polled by the batches' waiters.
    pub progress: Progress,
    notifies: Mutex<VecDeque<Notification>>,
    notified: Condvar,
    /// Notifications dropped because the queue was full.
    notifies_dropped: AtomicU64,
    /// Inbound connections by (dev, number of their first queue pair).
    inbound: Mutex<HashMap<(usize, u32), Inbound>>,
    services: RwLock<HashMap<String, Service>>,
    /// The job key of the lanes (`"oxccl-kv lanes v1"`): the tcp provider derives each
    /// connection's keys from it.
    lane_key: oxccl_seal::JobKey,
    /// Tests: where this engine's queue pairs connect instead of the tcp address a target
    /// gave (a man in the middle on the lanes).
    lane_redirect: RwLock<Option<LaneRedirect>>,
    pub closed: AtomicBool,
}

/// The transfer engine (Mooncake's `TransferEngine`, NIXL's agent): registers memory as a named
/// segment, opens peers' segments, and moves data with batched one-sided READs and WRITEs over
/// the oxccl verbs (shm inside a host, tcp across hosts).
///
/// Dropping it closes it: its descriptor is removed from the metadata backend, its threads stop,
/// and peers' requests to it fail.
pub struct TransferEngine {
    pub(crate) inner: Arc<Inner>,
    server: Option<Server>,
    threads: Vec<JoinHandle<()>>,
}

impl TransferEngine {
    /// Starts an engine: opens the providers `config.protocol` needs, binds the handshake
    /// listener on `config.local_addr`, and publishes the (empty) segment to `meta`.
    pub fn new(config: EngineConfig, meta: Arc<dyn Metadata>) -> Result<TransferEngine> {
        config.check()?;
        let providers: &[Provider] = match config.protocol {
            Protocol::Auto => &[Provider::Shm, Provider::Tcp],
            Protocol::Shm => &[Provider::Shm],
            Protocol::Tcp => &[Provider::Tcp],
        };
        let mut devs = Vec::new();
        for &p in providers {
            let label = p.name().to_string();
            let dc = DeviceConfig {
                tcp_addr: std::net::SocketAddr::new(config.local_addr.ip(), 0),
                // A caller that posts slices and then waits leaves the large frames to the
                // progress thread: waiting costs a few percent of a core, not a third.
                tcp_inline_max: 64 << 10,
                tcp_busy_poll: config.busy_poll,
                // The lanes are the connections of a segment's queue pair, each read by its own
                // progress thread (the automatic number of progress shards), so the kernel's
                // copies of several lanes run on several cores (as raw streams' threads do).
                tcp_nsocks: config.lanes,
                tcp_progress_threads: match config.progress_threads {
                    0 if config.busy_poll => 1,
                    n => n,
                },
                spin: config.spin,
                ..DeviceConfig::default()
            };
            let what = |w: &str| format!("{w} of the {p} provider");
            let ctx = Device::by_name(p.name())
                .and_then(|d| d.open_with(&dc))
                .map_err(|e| Error::verbs(what("opening a context"), e))?;
            let pd = ctx
                .alloc_pd()
                .map_err(|e| Error::verbs(what("allocating a protection domain"), e))?;
            let send_cq = ctx
                .create_cq(64 * 1024)
                .map_err(|e| Error::verbs(what("creating a completion queue"), e))?;
            let recv_cq = ctx
                .create_cq(16 * 1024)
                .map_err(|e| Error::verbs(what("creating a completion queue"), e))?;
            devs.push(Dev {
                provider: p,
                label,
                pd,
                send_cq,
                recv: Arc::new(Progress::new(vec![recv_cq])),
                _ctx: ctx,
            });
        }
        // The handshake listener first: its address may be the segment's name.
        let inner_slot: Arc<OnceLock<Weak<Inner>>> = Arc::new(OnceLock::new());
        let handler = Arc::new(Handler {
            inner: inner_slot.clone(),
        });
        let provisional = config
            .name
            .clone()
            .unwrap_or_else(|| format!("{}", config.local_addr));
        let server = Server::start(
            config.local_addr,
            provisional,
            config.secret.clone(),
            handler,
            config.timeout,
            handshake::PeerConns::new(config.max_peer_conns),
        )?;
        let handshake_addr = server.addr().to_string();
        let name = config
            .name
            .clone()
            .unwrap_or_else(|| handshake_addr.clone());
        let progress = Progress::new(devs.iter().map(|d| d.send_cq.clone()).collect())
            .busy_poll(config.busy_poll);
        let inner = Arc::new(Inner {
            name,
            host: oxccl_verbs::host_identity(),
            devs,
            progress,
            meta,
            handshake_addr,
            regions: RwLock::new(BTreeMap::new()),
            // Versions grow across restarts too (a restarted engine of the same name must not
            // lose to its crashed predecessor's descriptor): they start at the clock.
            version: AtomicU64::new(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_micros() as u64),
            ),
            peers: RwLock::new(HashMap::new()),
            lanes: RwLock::new(HashMap::new()),
            by_name: Mutex::new(HashMap::new()),
            next_segment: AtomicU64::new(1),
            batches: Batches::default(),
            notifies: Mutex::new(VecDeque::new()),
            notified: Condvar::new(),
            notifies_dropped: AtomicU64::new(0),
            inbound: Mutex::new(HashMap::new()),
            services: RwLock::new(HashMap::new()),
            lane_redirect: RwLock::new(None),
            lane_key: oxccl_seal::JobKey::derive(config.secret.as_bytes(), LANES_PURPOSE),
            closed: AtomicBool::new(false),
            config,
        });
        let _ = inner_slot.set(Arc::downgrade(&inner));
        inner.publish()?;
        let mut threads = Vec::new();
        for d in 0..inner.devs.len() {
            let w = Arc::downgrade(&inner);
            threads.push(spawn("oxccl-kv-notify", move || notify_loop(w, d))?);
        }
        let w = Arc::downgrade(&inner);
        threads.push(spawn("oxccl-kv-keeper", move || keeper_loop(w))?);
        let w = Arc::downgrade(&inner);
        threads.push(spawn("oxccl-kv-progress", move || run_helper(w))?);
        Ok(TransferEngine {
            inner,
            server: Some(server),
            threads,
        })
    }

    /// The segment name peers open this engine by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `IP:port` of the handshake listener (Mooncake's RPC port).
    pub fn handshake_addr(&self) -> &str {
        &self.inner.handshake_addr
    }

    /// The providers this engine serves (`"shm"`, `"tcp"`).
    pub fn providers(&self) -> Vec<&'static str> {
        self.inner.provider_names()
    }

    /// This engine's current descriptor, as peers see it.
    pub fn descriptor(&self) -> SegmentDesc {
        self.inner.descriptor()
    }

    /// Allocates `len` bytes of zeroed memory, registered with every provider: the zero-copy
    /// path (on shm, a peer's WRITE is one `memcpy` into it and no syscall). Freed with
    /// [`TransferEngine::free_managed_buffer`] or when the engine closes.
    pub fn allocate_managed_buffer(&self, len: usize) -> Result<u64> {
        self.inner.allocate(len)
    }

    /// Frees a buffer from [`TransferEngine::allocate_managed_buffer`].
    pub fn free_managed_buffer(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr, true)
    }

    /// Registers memory the caller owns, so that requests may use it as their local side and
    /// peers may READ and WRITE it (Mooncake's `register_memory`). On shm, peers reach it with
    /// one `process_vm_readv`/`writev` per request; managed buffers need none.
    ///
    /// # Safety
    /// `addr..addr+len` must be valid, writable memory of this process that stays allocated
    /// until it is unregistered (or the engine closes) and every request using it completed.
    /// Peers may write it at any time while it is registered.
    pub unsafe fn register_memory(&self, addr: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.register(addr, len) }
    }

    /// Unregisters memory registered with [`TransferEngine::register_memory`]; later requests
    /// on it fail (peers' with a remote access error).
    pub fn unregister_memory(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr, false)
    }

    /// Copies `data` into registered local memory at `addr` (managed buffers: the safe way to
    /// fill them).
    pub fn write_local(&self, addr: u64, data: &[u8]) -> Result<()> {
        let (r, off) = self.inner.local(addr, data.len())?;
        r.mrs[0]
            .write(off, data)
            .map_err(|e| Error::verbs("writing local memory", e))
    }

    /// Copies registered local memory at `addr` into `out`.
    pub fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let (r, off) = self.inner.local(addr, out.len())?;
        r.mrs[0]
            .read(off, out)
            .map_err(|e| Error::verbs("reading local memory", e))
    }

    /// Opens segment `name` (looked up in the metadata backend) and connects to its owner:
    /// returns the id requests name as their target. Opening an open segment returns the same
    /// id; one whose peer failed is opened afresh.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner.open(name)
    }

    /// The newest descriptor known of an opened segment.
    pub fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDesc> {
        let p = self.inner.peer(segment)?;
        let d = p.desc.read().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(d)
    }

    /// Asks the owner of `segment` for its descriptor again (after it registered more memory).
    pub fn refresh_segment(&self, segment: SegmentId) -> Result<SegmentDesc> {
        let p = self.inner.peer(segment)?;
        let d = p
            .client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_desc()?;
        *p.desc.write().unwrap_or_else(|e| e.into_inner()) = d.clone();
        Ok(d)
    }

    /// Closes an opened segment: its connections are torn down.
    pub fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let p = self
            .inner
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&segment)
            .ok_or_else(|| Error::arg(format!("segment id {segment} is not open")))?;
        self.inner
            .by_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, id| *id != segment);
        // Batches in flight hold the connection until they are over.
        drop(p);
        Ok(())
    }

    /// Registers `service` under `name`: peers call it with [`TransferEngine::call`].
    pub fn serve(&self, name: &str, service: Service) {
        self.inner
            .services
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), service);
    }

    /// Calls the service `service` of the owner of `segment` with `body`, over the handshake
    /// channel; its reply, or its error.
    pub fn call(&self, segment: SegmentId, service: &str, body: &[u8]) -> Result<Vec<u8>> {
        let p = self.inner.peer(segment)?;
        let mut c = p.client.lock().unwrap_or_else(|e| e.into_inner());
        match c.call(&Msg::Call {
            service: service.to_string(),
            body: body.to_vec(),
        })? {
            Msg::Reply { body } => Ok(body),
            m => Err(Error::Handshake {
                peer: c.addr.clone(),
                detail: format!("expected a reply, got {m:?}"),
            }),
        }
    }

    /// Takes the notifications that arrived since the last call (Mooncake's `get_notifies`).
    pub fn get_notifies(&self) -> Vec<Notification> {
        let mut q = self
            .inner
            .notifies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.drain(..).collect()
    }

    /// Waits up to `timeout` for at least one notification, then takes them all; an empty
    /// vector when none came.
    pub fn wait_notifies(&self, timeout: Duration) -> Vec<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self
            .inner
            .notifies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while q.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            q = self
                .inner
                .notified
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        q.drain(..).collect()
    }

    /// How many notifications were dropped, since the engine started, because the queue held
    /// [`EngineConfig::notify_queue`] of them that nobody had taken: the oldest goes first.
    pub fn notifies_dropped(&self) -> u64 {
        self.inner.notifies_dropped.load(Ordering::Relaxed)
    }

    /// For tests of the wire: segments opened after this call connect their lanes to
    /// `redirect(target's tcp address)` instead (a proxy in the middle). Not for production.
    #[doc(hidden)]
    pub fn redirect_lanes(&self, redirect: Option<LaneRedirect>) {
        *self
            .inner
            .lane_redirect
            .write()
            .unwrap_or_else(|e| e.into_inner()) = redirect;
    }

    /// Whether the lanes of an opened segment are encrypted and authenticated
    /// ([`EngineConfig::encrypt`]): over tcp as the policy says for the owner's address; never
    /// over shm (it does not leave the host).
    pub fn lanes_encrypted(&self, segment: SegmentId) -> Result<bool> {
        Ok(self.inner.peer(segment)?.sealed)
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        let _ = self.inner.meta.remove(&self.inner.name);
        self.server.take();
        self.inner.progress.notify();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.inner
            .inbound
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.inner
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| Error::io(format!("spawning thread {name}"), e))
}

fn access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
}

impl Inner {
    pub(crate) fn descriptor(&self) -> SegmentDesc {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        SegmentDesc {
            format: DESC_FORMAT,
            name: self.name.clone(),
            version: self.version.load(Ordering::Acquire),
            handshake: self.handshake_addr.clone(),
            host: self.host.clone(),
            providers: self
                .provider_names()
                .into_iter()
                .map(String::from)
                .collect(),
            buffers: regions.values().map(|r| r.desc(&self.devs)).collect(),
        }
    }

    /// The providers served, each once.
    fn provider_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for d in &self.devs {
            if !v.contains(&d.provider.name()) {
                v.push(d.provider.name());
            }
        }
        v
    }

    fn publish(&self) -> Result<()> {
        self.meta.publish(&self.descriptor())
    }

    fn allocate(&self, len: usize) -> Result<u64> {
        if len == 0 {
            return Err(Error::arg("a managed buffer of 0 bytes"));
        }
        let first = self.devs[0]
            .pd
            .alloc_mr(len, access())
            .map_err(|e| Error::verbs(format!("allocating a managed buffer of {len} bytes"), e))?;
        let addr = first.addr();
        let mut mrs = vec![first];
        for d in &self.devs[1..] {
            // The other providers' registrations keep the mapping alive themselves, so a
            // request in flight there never lands in freed (or reused) memory.
            let mr =
                d.pd.reg_mr_of(&mrs[0], access())
                    .map_err(|e| Error::verbs("registering a managed buffer", e))?;
            mrs.push(mr);
        }
        self.insert(Region {
            addr,
            len,
            mrs,
            managed: true,
        })?;
        Ok(addr)
    }

    /// # Safety
    /// As [`TransferEngine::register_memory`].
    unsafe fn register(&self, addr: u64, len: usize) -> Result<()> {
        if len == 0 || addr == 0 {
            return Err(Error::arg(format!(
                "registering {len} bytes at {addr:#x}: a null or empty range"
            )));
        }
        let mut mrs = Vec::new();
        for d in &self.devs {
            // SAFETY: the caller guarantees the range stays valid while registered.
            let mr = unsafe { d.pd.reg_mr_raw(addr as *mut u8, len, access()) }
                .map_err(|e| Error::verbs(format!("registering {len} bytes at {addr:#x}"), e))?;
            mrs.push(mr);
        }
        self.insert(Region {
            addr,
            len,
            mrs,
            managed: false,
        })
    }

    fn insert(&self, r: Region) -> Result<()> {
        {
            let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
            let end = r.addr + r.len as u64;
            if let Some((_, o)) = regions.range(..end).next_back()
                && o.addr + o.len as u64 > r.addr
            {
                return Err(Error::arg(format!(
                    "{} bytes at {:#x} overlap registered memory {:#x}+{}",
                    r.len, r.addr, o.addr, o.len
                )));
            }
            regions.insert(r.addr, Arc::new(r));
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        self.publish()
    }

    fn unregister(&self, addr: u64, managed: bool) -> Result<()> {
        {
            let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
            match regions.get(&addr) {
                Some(r) if r.managed == managed && Arc::strong_count(r) > 1 => {
                    return Err(Error::arg(format!(
                        "{addr:#x} is in use by requests in flight ({} of them): wait for their \
                         batches first",
                        Arc::strong_count(r) - 1
                    )));
                }
                Some(r) if r.managed == managed => {}
                Some(_) if managed => {
                    return Err(Error::arg(format!(
                        "{addr:#x} was registered by the caller, not allocated: use unregister_memory"
                    )));
                }
                Some(_) => {
                    return Err(Error::arg(format!(
                        "{addr:#x} is a managed buffer: use free_managed_buffer"
                    )));
                }
                None => {
                    return Err(Error::arg(format!(
                        "{addr:#x} is not the start of a registered buffer"
                    )));
                }
            }
            if let Some(r) = regions.remove(&addr) {
                for m in &r.mrs {
                    m.deregister();
                }
            }
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        self.publish()
    }

    /// The registered region holding `addr..addr+len`, and the offset of `addr` in it.
    pub(crate) fn local(&self, addr: u64, len: usize) -> Result<(Arc<Region>, usize)> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        regions
            .range(..=addr)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| {
                addr.checked_add(len as u64)
                    .is_some_and(|end| end <= r.addr + r.len as u64)
            })
            .map(|r| (r.clone(), (addr - r.addr) as usize))
            .ok_or_else(|| {
                Error::arg(format!(
                    "local buffer of {len} bytes at {addr:#x} is not inside memory registered \
                     with engine {:?} (register_memory or allocate_managed_buffer first)",
                    self.name
                ))
            })
    }

    pub(crate) fn peer(&self, segment: SegmentId) -> Result<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&segment)
            .cloned()
            .ok_or_else(|| {
                Error::arg(format!(
                    "segment id {segment} is not open on engine {:?}",
                    self.name
                ))
            })
    }

    fn open(&self, name: &str) -> Result<SegmentId> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let existing = self
            .by_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied();
        if let Some(id) = existing
            && let Ok(p) = self.peer(id)
        {
            if p.failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                self.reopen(&p)?;
            }
            return Ok(id);
        }
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let peer = self.connect_peer(name, id)?;
        self.peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, peer);
        self.by_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), id);
        Ok(id)
    }

    /// Connects afresh to a peer whose connection failed, under the same segment id. When
    /// another thread did so first, its connection is the one used.
    pub(crate) fn reopen(&self, old: &Arc<Peer>) -> Result<Arc<Peer>> {
        let fresh = self.connect_peer(&old.name, old.id)?;
        let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
        match peers.get(&old.id) {
            Some(cur) if !Arc::ptr_eq(cur, old) => Ok(cur.clone()),
            _ => {
                peers.insert(old.id, fresh.clone());
                Ok(fresh)
            }
        }
    }

    /// The peer a completion of queue pair `qp` (of dev `dev`) belongs to.
    pub(crate) fn peer_of_lane(&self, dev: usize, qp: u32) -> Option<Arc<Peer>> {
        let p = self
            .lanes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(dev, qp))
            .and_then(Weak::upgrade);
        if p.is_none() {
            self.lanes
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(dev, qp));
        }
        p
    }

    /// Looks segment `name` up, and connects lanes to its owner over the handshake.
    fn connect_peer(&self, name: &str, id: SegmentId) -> Result<Arc<Peer>> {
        let desc = self.meta.lookup(name, self.config.timeout)?;
        let dev = self.pick_dev(&desc)?;
        let provider = self.devs[dev].provider;
        let mut client = Client::connect(
            &desc.handshake,
            &self.name,
            &self.config.secret,
            self.config.timeout,
            Some(self.config.local_addr.ip()),
        )?;
        // The descriptor from the owner itself is the newest.
        let desc = client.get_desc()?;
        let owner_ip = client.peer_ip();
        let sealed = self.seals(provider, owner_ip);
        let qcfg = QpConfig {
            timeout: self.config.peer_timeout,
            connect: ConnectRole::Active,
            // This side only sends: a receive ring of one.
            max_recv_wr: 1,
            seal: sealed.then(|| self.lane_key.clone()),
            ..QpConfig::default()
        };
        let d = &self.devs[dev];
        let qp = d
            .pd
            .create_qp(&d.send_cq, &d.recv.queues()[0], &qcfg)
            .map_err(|e| Error::verbs(format!("creating a queue pair for segment {name:?}"), e))?;
        let (mut theirs, key) = match client.call(&Msg::Connect {
            provider: provider.name().to_string(),
            endpoints: vec![qp.endpoint()],
            encrypt: sealed,
        })? {
            Msg::Connected {
                mut endpoints,
                mut keys,
            } if endpoints.len() == 1 && keys.len() == 1 => (endpoints.remove(0), keys.remove(0)),
            m => {
                return Err(Error::Handshake {
                    peer: desc.handshake.clone(),
                    detail: format!("expected 1 connected endpoint, got {m:?}"),
                });
            }
        };
        if let Some(r) = &*self.lane_redirect.read().unwrap_or_else(|e| e.into_inner())
            && let EndpointAddr::Tcp { addr, .. } = &mut theirs.addr
        {
            *addr = r(addr);
        }
        qp.connect(&theirs).map_err(|e| {
            Error::verbs(format!("connecting to segment {name:?} over {provider}"), e)
        })?;
        // The tcp provider opens at most 16 connections per queue pair.
        let lanes = if provider == Provider::Tcp {
            self.config.lanes.min(16)
        } else {
            1
        };
        if provider == Provider::Tcp {
            tracing::info!(
                "oxccl-kv: segment {name:?} ({}): its {lanes} tcp lanes are {} (OXCCL_ENCRYPT={})",
                desc.handshake,
                if sealed {
                    "encrypted and authenticated"
                } else {
                    "in clear"
                },
                self.config.encrypt
            );
        }
        let peer = Arc::new(Peer {
            id,
            sealed,
            name: name.to_string(),
            queue: Mutex::new(crate::batch::LaneQueue::new(lanes)),
            dev,
            key,
            lanes,
            desc: RwLock::new(desc),
            qp,
            client: Mutex::new(client),
            failed: Mutex::new(None),
        });
        let mut map = self.lanes.write().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        map.insert((dev, peer.qp.qp_num()), Arc::downgrade(&peer));
        Ok(peer)
    }

    fn pick_dev(&self, desc: &SegmentDesc) -> Result<usize> {
        let has = |p: Provider| {
            desc.providers.iter().any(|x| x == p.name())
                && self.devs.iter().any(|d| d.provider == p)
        };
        let same_host = desc.host == self.host;
        let want = if same_host && has(Provider::Shm) {
            Some(Provider::Shm)
        } else if has(Provider::Tcp) {
            Some(Provider::Tcp)
        } else {
            None
        };
        want.and_then(|p| self.devs.iter().position(|d| d.provider == p))
            .ok_or_else(|| Error::PeerFailed {
                segment: desc.name.clone(),
                detail: format!(
                    "no provider in common: this engine serves {:?}, the segment {:?}{}",
                    self.devs
                        .iter()
                        .map(|d| d.provider.name())
                        .collect::<Vec<_>>(),
                    desc.providers,
                    if same_host {
                        ""
                    } else {
                        " on another host (shm reaches only this host)"
                    }
                ),
            })
    }

    /// A peer asks for queue pairs connected to its own (one per opened segment; its lanes are
    /// that queue pair's connections), on this side's context of the provider; the answer names
    /// each one's rkey set.
    fn accept(
        &self,
        from: &str,
        addr: SocketAddr,
        provider: &str,
        endpoints: Vec<QpEndpoint>,
        encrypt: bool,
    ) -> Result<Msg> {
        let Some(dev) = self.devs.iter().position(|d| d.provider.name() == provider) else {
            return Err(Error::arg(format!(
                "this engine does not serve provider {provider}"
            )));
        };
        if endpoints.is_empty() || endpoints.len() > 64 {
            return Err(Error::arg(format!("{} queue pairs asked", endpoints.len())));
        }
        // The connections each queue pair will have: the smaller of the two sides' wishes.
        let lanes: usize = endpoints
            .iter()
            .map(|e| match &e.addr {
                EndpointAddr::Tcp { nsocks, .. } => {
                    (*nsocks as usize).clamp(1, 16).min(self.config.lanes)
                }
                _ => 1,
            })
            .sum();
        let ip = addr.ip();
        self.within_caps(from, ip, endpoints.len(), lanes)?;
        let sealed = self.seals(self.devs[dev].provider, Some(ip));
        if sealed != encrypt {
            let how = |on: bool| if on { "encrypted" } else { "in clear" };
            return Err(Error::arg(format!(
                "the lanes' encryption differs: engine {:?} wants the lanes from {ip} ({from:?}) \
                 {} (OXCCL_ENCRYPT={} here), the peer asked for them {}: set OXCCL_ENCRYPT \
                 (EngineConfig::encrypt) alike on both",
                self.name,
                how(sealed),
                self.config.encrypt,
                how(encrypt)
            )));
        }
        let mut qps = Vec::new();
        let mut keys = Vec::new();
        for (i, e) in endpoints.iter().enumerate() {
            let d = &self.devs[dev];
            // Notifications arrive on the first queue pair only.
            let qcfg = QpConfig {
                timeout: self.config.peer_timeout,
                connect: ConnectRole::Passive,
                max_recv_wr: if i == 0 { NOTIFY_DEPTH as u32 } else { 1 },
                seal: sealed.then(|| self.lane_key.clone()),
                ..QpConfig::default()
            };
            let q =
                d.pd.create_qp(&d.send_cq, &d.recv.queues()[0], &qcfg)
                    .map_err(|e| Error::verbs("creating an inbound queue pair", e))?;
            q.connect(e)
                .map_err(|e| Error::verbs(format!("connecting {from:?}'s queue pair"), e))?;
            qps.push(q);
            keys.push(d.label.clone());
        }
        let first = &self.devs[dev];
        let bufs = first
            .pd
            .alloc_mr(NOTIFY_DEPTH * MAX_NOTIFY, AccessFlags::LOCAL_WRITE)
            .map_err(|e| Error::verbs("allocating notification buffers", e))?;
        for i in 0..NOTIFY_DEPTH {
            post_notify_recv(&qps[0], &bufs, i)?;
        }
        let mine = qps.iter().map(|q| q.endpoint()).collect();
        let key = (dev, qps[0].qp_num());
        // Checked again with the connection counted, against connects of the same peer that
        // ran alongside this one (this one's queue pairs then go, unused).
        let mut inbound = self.inbound.lock().unwrap_or_else(|e| e.into_inner());
        check_caps(&self.config, &inbound, from, ip, endpoints.len(), lanes)?;
        inbound.insert(
            key,
            Inbound {
                from: from.to_string(),
                ip,
                lanes,
                qps,
                bufs,
            },
        );
        drop(inbound);
        if self.devs[dev].provider == Provider::Tcp {
            tracing::info!(
                "oxccl-kv: {from:?} at {ip} connected {lanes} tcp lanes to segment {:?}, {}",
                self.name,
                if sealed {
                    "encrypted and authenticated"
                } else {
                    "in clear"
                }
            );
        }
        Ok(Msg::Connected {
            endpoints: mine,
            keys,
        })
    }
}

impl Inner {
    /// Whether queue pairs of `provider` to the peer at `ip` are sealed: over tcp as
    /// [`EngineConfig::encrypt`] says (`auto`: when the peer is not on this host; an address
    /// not known counts as off the host); never over shm.
    fn seals(&self, provider: Provider, ip: Option<IpAddr>) -> bool {
        provider == Provider::Tcp
            && match ip {
                Some(ip) => self.config.encrypt.seals(ip),
                None => self.config.encrypt != Encrypt::Off,
            }
    }

    fn within_caps(&self, from: &str, ip: IpAddr, qps: usize, lanes: usize) -> Result<()> {
        let inbound = self.inbound.lock().unwrap_or_else(|e| e.into_inner());
        check_caps(&self.config, &inbound, from, ip, qps, lanes)
    }
}

/// Whether the peer at `ip` may connect `qps` more queue pairs of `lanes` connections in all.
fn check_caps(
    config: &EngineConfig,
    inbound: &HashMap<(usize, u32), Inbound>,
    from: &str,
    ip: IpAddr,
    qps: usize,
    lanes: usize,
) -> Result<()> {
    let (mut has_qps, mut has_lanes) = (0, 0);
    for ib in inbound.values().filter(|ib| ib.ip == ip) {
        has_qps += ib.qps.len();
        has_lanes += ib.lanes;
    }
    let over = |what: &str, has: usize, more: usize, cap: usize, knob: &str| {
        let e = Error::PeerLimit {
            peer: format!("{ip} (as {from:?})"),
            detail: format!(
                "it has {has} {what} connected here and asked for {more} more, over the cap of \
                 {cap} per peer address (EngineConfig::{knob}, OXCCL_KV_{})",
                knob.to_ascii_uppercase()
            ),
        };
        tracing::warn!("oxccl-kv: {e}");
        Err(e)
    };
    if has_qps + qps > config.max_peer_qps {
        return over(
            "queue pairs",
            has_qps,
            qps,
            config.max_peer_qps,
            "max_peer_qps",
        );
    }
    if has_lanes + lanes > config.max_peer_lanes {
        return over(
            "lanes",
            has_lanes,
            lanes,
            config.max_peer_lanes,
            "max_peer_lanes",
        );
    }
    Ok(())
}

fn post_notify_recv(qp: &QueuePair, bufs: &MemoryRegion, i: usize) -> Result<()> {
    let sge = [Sge::new(bufs, i * MAX_NOTIFY, MAX_NOTIFY)];
    qp.post_recv(&[RecvWr::new(i as u64, &sge)])
        .map_err(|e| Error::verbs("posting a notification receive", e))
}

/// The handshake service of an engine (holds it weakly: the engine owns the server).
struct Handler {
    inner: Arc<OnceLock<Weak<Inner>>>,
}

impl handshake::Handler for Handler {
    fn handle(&self, peer: &str, addr: SocketAddr, msg: Msg) -> Msg {
        let Some(inner) = self.inner.get().and_then(Weak::upgrade) else {
            return Msg::Failed {
                reason: "the engine is shutting down".into(),
            };
        };
        let r = match msg {
            Msg::GetDesc => Ok(Msg::Desc {
                desc: inner.descriptor(),
            }),
            Msg::Connect {
                provider,
                endpoints,
                encrypt,
            } => inner.accept(peer, addr, &provider, endpoints, encrypt),
            Msg::Call { service, body } => {
                let s = inner
                    .services
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&service)
                    .cloned();
                match s {
                    Some(s) => s(peer, &body).map(|body| Msg::Reply { body }),
                    None => Err(Error::arg(format!(
                        "engine {:?} has no service {service:?}",
                        inner.name
                    ))),
                }
            }
            m => Err(Error::arg(format!("unexpected request {m:?}"))),
        };
        r.unwrap_or_else(|e| Msg::Failed {
            reason: e.to_string(),
        })
    }
}

/// Takes notifications off a provider's receive queue, and drops inbound connections whose
/// peer went away.
fn notify_loop(w: Weak<Inner>, dev: usize) {
    let mut wc: Vec<WorkCompletion> = Vec::new();
    loop {
        let Some(inner) = w.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        let recv = inner.devs[dev].recv.clone();
        drop(inner);
        wc.clear();
        // (This thread is the queue's only poller.) It collects and never drives: sleeping in
        // the provider's own wait would make it the thread that reads the tcp sockets, so that
        // every frame (a request at a target, the ACK a waiting initiator wants) woke it first
        // and then, through the completion queue, the thread it was for: two wake-ups per
        // round trip where one does. The progress thread, or the caller that waits, reads.
        let Some(cq) = recv.queues().first() else {
            return;
        };
        let seen = cq.doorbell();
        let mut buf = [WorkCompletion::EMPTY; 16];
        let mut n = cq.take(&mut buf);
        if n == 0 {
            if !cq.wait_doorbell(seen, Duration::from_millis(100)) {
                continue;
            }
            n = cq.take(&mut buf);
            if n == 0 {
                // The doorbell also rings when a peer dies: a poll notices it (and flushes).
                n = cq.poll(&mut buf);
            }
        }
        wc.extend_from_slice(&buf[..n]);
        if wc.is_empty() {
            continue;
        }
        let Some(inner) = w.upgrade() else { return };
        let mut inbound = inner.inbound.lock().unwrap_or_else(|e| e.into_inner());
        for c in &wc {
            let key = (dev, c.qp_num);
            if !c.is_ok() {
                // The peer is gone (its queue pair flushed): forget the connection.
                if let Some(ib) = inbound.remove(&key) {
                    tracing::debug!("oxccl-kv: {:?}'s connection closed: {}", ib.from, c.status);
                    drop(ib.qps);
                }
                continue;
            }
            let Some(ib) = inbound.get(&key) else {
                continue;
            };
            let slot = c.wr_id as usize;
            let len = (c.byte_len as usize).min(MAX_NOTIFY);
            let mut msg = vec![0; len];
            if ib.bufs.read(slot * MAX_NOTIFY, &mut msg).is_ok() {
                // The sender is the peer this connection authenticated, not what it says.
                let mut q = inner.notifies.lock().unwrap_or_else(|e| e.into_inner());
                while q.len() >= inner.config.notify_queue {
                    q.pop_front();
                    if inner.notifies_dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!(
                            "oxccl-kv: engine {:?} dropped its oldest notification: {} were \
                             waiting and nobody took them (get_notifies); the queue holds \
                             notify_queue = {} (OXCCL_KV_NOTIFY_QUEUE). Further drops are \
                             counted (notifies_dropped), not logged",
                            inner.name,
                            q.len() + 1,
                            inner.config.notify_queue
                        );
                    }
                }
                q.push_back(Notification {
                    from: ib.from.clone(),
                    msg,
                });
                drop(q);
                inner.notified.notify_all();
            }
            if let Err(e) = post_notify_recv(&ib.qps[0], &ib.bufs, slot) {
                tracing::debug!("oxccl-kv: reposting a notification receive: {e}");
            }
        }
    }
}

/// Publishes the descriptor again whenever the backend lost it (a restarted server).
fn keeper_loop(w: Weak<Inner>) {
    let mut last = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(inner) = w.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if last.elapsed() < inner.config.republish_every {
            continue;
        }
        last = Instant::now();
        let v = inner.version.load(Ordering::Acquire);
        match inner.meta.present(&inner.name, v) {
            Ok(true) => {}
            Ok(false) => match inner.publish() {
                Ok(()) => tracing::info!(
                    "oxccl-kv: segment {:?} published again to {}",
                    inner.name,
                    inner.meta.describe()
                ),
                Err(e) => tracing::debug!("oxccl-kv: republishing: {e}"),
            },
            Err(e) => tracing::debug!("oxccl-kv: checking the descriptor: {e}"),
        }
    }
}
