//! The ofi provider: the verbs model over libfabric (OFI), for real NICs.
//!
//! # How the verbs model maps onto libfabric
//!
//! One context opens one libfabric endpoint of type `FI_EP_RDM` (reliable, connectionless) with
//! `FI_MSG | FI_RMA`, one address vector (`FI_AV_TABLE`) and one completion queue
//! (`FI_CQ_FORMAT_DATA`), with the provider [`DeviceConfig::ofi_provider`] names (default
//! `tcp;ofi_rxm`). Every queue pair of the context shares it: a queue pair's endpoint address
//! is the context endpoint's name (`fi_getname`, in [`EndpointAddr::Opaque`]) with its queue
//! pair number and secret token, and connecting one is inserting the peer's name into the
//! address vector (no handshake: RTR is local, as in InfiniBand). Every message names the target
//! queue pair (number and token) and its sender's, so that the queue pairs of two contexts share
//! one libfabric path and a stale or foreign message is dropped.
//!
//! Every region of the context is registered with libfabric (`fi_mr_reg` in
//! [`ProviderContext::register_mr`]), whatever the provider's memory-registration mode: with
//! `FI_MR_PROV_KEY` the provider's key is kept, otherwise the core's random rkey is requested;
//! with `FI_MR_VIRT_ADDR` RMA addresses are virtual addresses, otherwise offsets into the
//! region (computed here); `FI_MR_ENDPOINT` registrations are bound to the endpoint. The rkey a
//! peer sees stays the core's (validated in software by the target, below); the libfabric key
//! and address of each buffer travel inside the requests that need them.
//!
//! RC semantics are built on top, by a small protocol (`wire`) that the target executes in
//! posting order, as a responder does:
//! - A request (WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM, READ, atomics) is one message
//!   (`fi_send`) into the target context's pool of receive buffers. Payloads up to
//!   [`wire::INLINE_MAX`] travel in it; for larger ones it carries the initiator's buffers
//!   (libfabric address and key), and the target moves the data itself with RMA: `fi_read`
//!   from the initiator for WRITEs and SENDs (zero copy, straight into the target region or the
//!   receive's buffers), `fi_writemsg` with `FI_DELIVERY_COMPLETE` into the initiator's buffers
//!   for READs.
//! - The target validates before any effect: rkey, range and access flags against its region
//!   table (as the tcp provider's target does), alignment for atomics, the receive's buffers
//!   and length for SENDs. A failure is NAKed with the IB status (`RemoteAccessError`,
//!   `RemoteInvalidRequest`, `RemoteOperationError`) and every later request of the queue pair
//!   is dropped, so a rejected request and those after it never touch the target's memory.
//! - A WRITE_WITH_IMM or SEND claims one posted receive ([`QpInner::claim_recv`]) when it
//!   starts, and completes it (`RecvRdmaWithImm` or `Recv`) once its data landed; with none
//!   posted the queue pair's requests stall (receiver not ready) until a receive is posted or
//!   the initiator's RNR budget (carried in the request) runs out, then the target NAKs it with
//!   `RnrRetryExceeded`.
//! - Ordering: requests start in sequence; WRITEs to disjoint ranges may move their data
//!   concurrently, anything else waits for those before it, and completions, ACKs and receive
//!   completions are issued in sequence, so a WRITE_WITH_IMM's receive completion is seen only
//!   after every earlier WRITE landed. The initiator completes requests in posting order from
//!   cumulative ACKs (and READ and atomic responses), failures included.
//! - Atomics run at the target, as 64-bit CPU atomics on the validated word (the tcp provider's
//!   way): libfabric's atomics (`fi_fetch_atomic`, `fi_compare_atomic`) would bypass the
//!   software access check and are not offered by `tcp;ofi_rxm` or `shm` natively, so they are
//!   not used; every provider thereby supports both atomics.
//! - Peer loss: a failed send or RMA (`fi_cq_readerr`) fails the queue pair at once (a
//!   connection refused or reset under `tcp;ofi_rxm`); a queue pair that is destroyed or
//!   disconnected says so (`Bye`); and since an RDM endpoint has no connection to lose, each
//!   connected queue pair pings its peer every quarter of [`QpConfig::timeout`] and fails as
//!   "peer gone" (`RetryExceeded`) when nothing came back for the whole timeout (a dead
//!   process, a queue pair that never connected to this one or is in ERR).
//! - A wedged libfabric: libfabric 1.17's `shm` provider takes a spinlock inside the receiver's
//!   shared memory to send, and the receiver takes it to progress; a peer killed while holding
//!   it leaves every sender spinning inside `fi_send` or `fi_inject` forever, and no timeout
//!   outside libfabric can bring that thread back. A watch thread per context counts the calls
//!   into libfabric: when one has not returned for 5 s it says so on stderr, naming the call
//!   and the provider, fails every queue pair of the context, and from then on every request
//!   fails at once with that message, so only the thread already inside libfabric stays stuck
//!   and the context can still be dropped. `tcp;ofi_rxm` has no such lock.
//!
//! Progress: libfabric's `tcp;ofi_rxm` and `shm` progress data manually, so a thread per context
//! (the "NIC") reads the completion queue, executes requests and moves their data: one-sided
//! operations cost the target's CPU here, as with the tcp provider. It blocks in
//! `fi_cq_sread` where the completion queue has a wait object (`tcp;ofi_rxm`), and polls with
//! short sleeps where not (`shm`, whose `fi_cq_sread` in libfabric 1.17 ignores its timeout), or
//! busy-polls with [`DeviceConfig::ofi_busy_poll`].
//!
//! # On RDMA hardware
//!
//! The same code runs over `verbs;ofi_rxm` (InfiniBand, RoCE), `efa` (AWS) and `cxi`
//! (Slingshot): set `OXCCL_OFI_PROVIDER` (and `OXCCL_OFI_ADDR` to the NIC's IP address for
//! `verbs;ofi_rxm`). What differs there:
//! - Memory registration: those providers ask for `FI_MR_VIRT_ADDR | FI_MR_PROV_KEY |
//!   FI_MR_ALLOCATED` (all handled: keys come from `fi_mr_key`, addresses are virtual) and
//!   `FI_MR_LOCAL` for local buffers, which this provider does not request yet: they are then
//!   not offered, until control messages come from a registered pool (the receive pool already
//!   is one buffer, easy to register) and every local RMA buffer passes its descriptor (it
//!   does). `cxi` wants `FI_MR_ENDPOINT` (handled: registrations are bound to the endpoint).
//! - `FI_CONTEXT`/`FI_CONTEXT2`: every operation's context is a heap block whose first 64
//!   bytes are libfabric's scratch, so providers that require either mode (psm3, some verbs
//!   paths) work.
//! - Inject sizes and message sizes: control messages are sent with `fi_send` (they are 80
//!   bytes, above `tcp;ofi_rxm`'s 64-byte inject size); on EFA and CXI `fi_inject` would save
//!   a completion. `FI_EAGAIN` is absorbed by a backlog the progress thread drains in order.
//! - Progress: EFA and CXI progress in hardware for RMA (`FI_PROGRESS_AUTO` data progress on
//!   cxi), but the target still executes this protocol in software, so the progress thread
//!   stays; the natural next step there is initiator-side RMA (`fi_writedata` for
//!   WRITE_WITH_IMM, `fi_read`, `fi_fetch_atomic`) once rkeys are checked by the NIC, which
//!   needs per-region access flags in the registration and a way to learn of remote access
//!   errors without losing the connection (CXI and verbs report them as completion errors;
//!   `tcp;ofi_rxm` tears the connection down, which is why the target checks in software).
//!
//! [`DeviceConfig::ofi_provider`]: crate::DeviceConfig::ofi_provider
//! [`DeviceConfig::ofi_busy_poll`]: crate::DeviceConfig::ofi_busy_poll
//! [`EndpointAddr::Opaque`]: crate::EndpointAddr::Opaque
//! [`QpInner::claim_recv`]: crate::contract::QpInner::claim_recv
//! [`QpConfig::timeout`]: crate::QpConfig::timeout

mod ffi;
mod link;
mod qp;
mod wire;

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::contract::{
    MrInner, OpenArgs, ProviderContext, QpSetup, QpTransport, RegionInfo, RegionMap,
};
use crate::model::{Error, Result};
use ffi::{CqEntry, Fabric};
use link::Link;

/// Receive buffers posted per context.
const RECV_POOL: usize = 256;

/// Opens the ofi half of a context: a libfabric endpoint of the provider
/// [`DeviceConfig::ofi_provider`](crate::DeviceConfig::ofi_provider) names, and its progress
/// thread.
pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
    let c = args.config;
    let prov = c.ofi_provider.trim().to_string();
    // Socket-based providers bind an IP address: the configured one, else loopback (only this
    // host can reach it, like the tcp provider's default).
    let socket_based = prov.is_empty()
        || ["tcp", "sockets", "udp", "verbs"]
            .iter()
            .any(|p| prov.starts_with(p));
    let node = match c.ofi_addr {
        Some(ip) => Some(ip.to_string()),
        None if socket_based => Some("127.0.0.1".to_string()),
        None => None,
    };
    // shm's fi_cq_sread ignores its timeout in libfabric 1.17: poll it.
    let wait = !c.ofi_busy_poll && !prov.contains("shm");
    let shm = prov.contains("shm");
    if shm {
        remove_stale_shm_regions();
    }
    let fab = Fabric::open(&prov, node.as_deref(), wait).map_err(|e| {
        Error::arg(format!(
            "ofi: opening libfabric provider {:?}{}: {e} (is it installed? `fi_info -l` lists \
             the providers; OXCCL_OFI_PROVIDER picks one)",
            if prov.is_empty() { "(any)" } else { &prov },
            node.as_deref()
                .map(|n| format!(" at {n}"))
                .unwrap_or_default()
        ))
    })?;
    let engine = Engine::new(fab, args.regions.clone(), c.ofi_busy_poll)?;
    let thread = {
        let engine = engine.clone();
        std::thread::Builder::new()
            .name("oxccl-ofi-progress".into())
            .spawn(move || engine.run())
            .map_err(|e| Error::os("spawning the ofi progress thread", e))?
    };
    let watch = {
        let engine = engine.clone();
        std::thread::Builder::new()
            .name("oxccl-ofi-watch".into())
            .spawn(move || engine.watch())
            .map_err(|e| Error::os("spawning the ofi watch thread", e))?
    };
    Ok(Box::new(OfiContext {
        shm,
        engine,
        thread: Mutex::new(Some(thread)),
        watch: Mutex::new(Some(watch)),
    }))
}

/// Removes, once per process and before its first `shm` endpoint, the regions libfabric's shm
/// provider left under `/dev/shm` for processes that no longer run. The provider names an
/// endpoint's region `<pid>:<n>:<m>` and unlinks it when the endpoint closes, so a process that
/// was killed leaves its regions behind: memory nobody frees until reboot, and a later process
/// that gets the same PID (PIDs wrap at `kernel.pid_max`) fails `fi_enable` with EBUSY.
///
/// A region is stale when its owner is gone, checked rather than guessed from its age: no
/// process of this PID namespace has the owner's PID (or the owner's PID is this process's,
/// which has opened no endpoint yet), and no process visible in `/proc` maps the region. Only
/// this user's regions are touched. One case stays ambiguous: a process of another PID
/// namespace that shares this `/dev/shm` and is invisible in this `/proc`, whose PID is free
/// here; containers mount their own `/dev/shm`, which rules it out in practice.
///
/// A context over `shm` sweeps again when it closes ([`sweep_shm_regions`], leaving this
/// process's own names alone then), so that a process whose peers were killed leaves no
/// region of theirs behind either.
fn remove_stale_shm_regions() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| sweep_shm_regions(true));
}

/// Removes the stale libfabric shm regions under `/dev/shm` ([`stale_shm_regions`]).
fn sweep_shm_regions(own: bool) {
    let dir = std::path::Path::new("/dev/shm");
    for (name, why) in stale_shm_regions(dir, own) {
        if std::fs::remove_file(dir.join(&name)).is_ok() {
            eprintln!("oxccl ofi: removed /dev/shm/{name}, a libfabric shm region {why}");
        }
    }
}

/// The libfabric shm regions under `dir` whose owner is gone (see
/// [`remove_stale_shm_regions`]), each with the reason in words. `own`: count regions named
/// after this process as gone (true only before it opens its first endpoint).
fn stale_shm_regions(dir: &std::path::Path, own: bool) -> Vec<(String, String)> {
    use std::os::unix::fs::MetadataExt;
    let me = std::process::id();
    let uid = rustix::process::geteuid().as_raw();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut candidates = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let parts: Vec<&str> = name.split(':').collect();
        let numeric = parts.len() == 3
            && parts
                .iter()
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        let Some(owner) = numeric.then(|| parts[0].parse::<u32>().ok()).flatten() else {
            continue;
        };
        if entry.metadata().map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let why = if owner == me {
            if !own {
                continue;
            }
            format!("of an earlier process with this PID ({me}) that did not close it")
        } else if std::path::Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        } else {
            format!("of process {owner}, which no longer runs, that did not close it")
        };
        candidates.push((name.to_string(), why));
    }
    if candidates.is_empty() {
        return candidates;
    }
    let mapped = mapped_shm_names(dir);
    candidates.retain(|(name, _)| !mapped.contains(name));
    candidates
}

/// The names under `dir` that some process visible in `/proc` has mapped.
fn mapped_shm_names(dir: &std::path::Path) -> std::collections::HashSet<String> {
    let prefix = format!("{}/", dir.display());
    let mut names = std::collections::HashSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return names;
    };
    for p in procs.flatten() {
        let Ok(maps) = std::fs::read_to_string(p.path().join("maps")) else {
            continue;
        };
        for line in maps.lines() {
            if let Some(at) = line.find(&prefix) {
                let rest = &line[at + prefix.len()..];
                names.insert(rest.trim_end_matches(" (deleted)").to_string());
            }
        }
    }
    names
}

/// How long a call into libfabric may go without returning before the context is called wedged.
const WEDGED_AFTER: Duration = Duration::from_secs(5);

/// The ofi half of a context.
struct OfiContext {
    /// Over libfabric's `shm`: sweep stale regions when closing.
    shm: bool,
    engine: Arc<Engine>,
    thread: Mutex<Option<JoinHandle<()>>>,
    watch: Mutex<Option<JoinHandle<()>>>,
}

impl ProviderContext for OfiContext {
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>> {
        let rnr_us = setup.rnr_budget_us().min(u32::MAX as u64) as u32;
        let link = Link::new(&self.engine, setup, rnr_us);
        self.engine
            .links
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(link.token, link.clone());
        Ok(Box::new(qp::OfiQp {
            engine: self.engine.clone(),
            link,
            send: Mutex::new(()),
        }))
    }

    fn register_mr(&self, mr: &RegionInfo<'_>) -> Result<Option<u64>> {
        if mr.len == 0 {
            // Nothing to move: zero-length requests never reach libfabric.
            return Ok(None);
        }
        let e = &self.engine;
        // SAFETY: the region's memory stays mapped until `deregister_mr` closes the
        // registration (the core calls it before the memory goes).
        let r = unsafe { e.fab.mr_reg(mr.addr, mr.len, mr.rkey) }.map_err(|err| {
            Error::arg(format!(
                "ofi: fi_mr_reg of {} bytes at {:#x} ({}): {}",
                mr.len,
                mr.addr,
                e.fab.prov_name(),
                ffi::strerror(err)
            ))
        })?;
        e.mrs.write().unwrap_or_else(|e| e.into_inner()).insert(
            mr.index,
            LfMr {
                mr: r,
                base: mr.addr,
            },
        );
        Ok(None)
    }

    fn deregister_mr(&self, mr: &MrInner) {
        let gone = self
            .engine
            .mrs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&mr.index);
        if let Some(m) = gone {
            self.engine.fab.mr_close(m.mr);
        }
    }
}

impl Drop for OfiContext {
    fn drop(&mut self) {
        self.engine.stop.store(true, Ordering::SeqCst);
        self.engine.kick();
        for slot in [&self.thread, &self.watch] {
            let Some(t) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() else {
                continue;
            };
            // The progress thread may drop the last handle itself: never join yourself. A
            // thread stuck inside a wedged libfabric is left behind (it never returns).
            if t.thread().id() == std::thread::current().id() {
                continue;
            }
            while !t.is_finished() && !self.engine.wedged.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
        if self.shm {
            sweep_shm_regions(false);
        }
    }
}

/// A region's libfabric registration.
struct LfMr {
    mr: ffi::Mr,
    base: u64,
}

/// What a libfabric operation's context points to: 64 bytes of scratch for the provider
/// (`FI_CONTEXT2`), then what the completion means.
#[repr(C)]
pub(super) struct Op {
    scratch: [u64; 8],
    what: What,
}

pub(super) enum What {
    /// Receive buffer `i` of the pool.
    Recv(usize),
    /// A message; the buffer is sent from.
    Send { buf: Vec<u8>, link: Weak<Link> },
    /// RMA of request `seq` of the link (the target moving a request's data).
    Rma {
        link: Weak<Link>,
        seq: u64,
        _keep: Arc<MrInner>,
    },
}

impl Op {
    fn boxed(what: What) -> *mut Op {
        Box::into_raw(Box::new(Op {
            scratch: [0; 8],
            what,
        }))
    }
}

/// An operation to issue (again, after `FI_EAGAIN`).
pub(super) enum Issue {
    Send {
        dest: u64,
        op: *mut Op,
    },
    Read {
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        peer: u64,
        addr: u64,
        key: u64,
        op: *mut Op,
    },
    Write {
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        peer: u64,
        addr: u64,
        key: u64,
        op: *mut Op,
    },
}

// SAFETY: the pointers are owned by the issue (its `Op`) or kept valid by the `Arc<MrInner>` the
// op holds; whichever thread issues it hands them to the thread-safe endpoint.
unsafe impl Send for Issue {}

impl Issue {
    fn op(&self) -> *mut Op {
        match self {
            Issue::Send { op, .. } | Issue::Read { op, .. } | Issue::Write { op, .. } => *op,
        }
    }
}

/// The receive pool: one allocation, `RECV_POOL` buffers of `wire::MSG_MAX` bytes.
struct Pool {
    base: *mut u8,
    mem: *mut [u8],
    ops: Vec<*mut Op>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: the endpoint is closed (the Fabric field is dropped before the pool), so no
        // buffer or context is in libfabric's hands; each pointer came from Box::into_raw.
        unsafe {
            drop(Box::from_raw(self.mem));
            for &op in &self.ops {
                drop(Box::from_raw(op));
            }
        }
    }
}

/// The progress engine of an ofi context: the endpoint and what its thread serves.
pub(crate) struct Engine {
    /// Declared first: closed before the receive pool it reads into is freed.
    fab: Fabric,
    pool: Pool,
    /// RMA addresses are virtual addresses (`FI_MR_VIRT_ADDR`); otherwise offsets.
    virt: bool,
    /// Queue pairs by secret token (messages name their target by it).
    links: RwLock<HashMap<u64, Arc<Link>>>,
    /// Peers' endpoint names, inserted into the address vector.
    peers: Mutex<HashMap<Vec<u8>, u64>>,
    /// libfabric registrations by region table index.
    mrs: RwLock<HashMap<u32, LfMr>>,
    /// The context's regions (the target validates against them).
    regions: RegionMap,
    /// Operations that met `FI_EAGAIN`, issued in order by the progress thread.
    backlog: Mutex<VecDeque<Issue>>,
    backlogged: AtomicBool,
    stop: AtomicBool,
    kicked: AtomicBool,
    /// A call into libfabric has not returned for [`WEDGED_AFTER`]: nothing more is issued.
    wedged: AtomicBool,
    busy: bool,
}

// SAFETY: the pool's raw pointers are only used by the progress thread (and freed on drop);
// the rest is Sync on its own.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

impl Engine {
    fn new(fab: Fabric, regions: RegionMap, busy: bool) -> Result<Arc<Engine>> {
        let mem: *mut [u8] = Box::into_raw(vec![0u8; RECV_POOL * wire::MSG_MAX].into_boxed_slice());
        let base = mem as *mut u8;
        let ops = (0..RECV_POOL).map(|i| Op::boxed(What::Recv(i))).collect();
        let virt = fab.attr.mr_mode & ffi::FI_MR_VIRT_ADDR != 0;
        let e = Arc::new(Engine {
            fab,
            pool: Pool { base, mem, ops },
            virt,
            links: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            mrs: RwLock::new(HashMap::new()),
            regions,
            backlog: Mutex::new(VecDeque::new()),
            backlogged: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            wedged: AtomicBool::new(false),
            busy,
        });
        for i in 0..RECV_POOL {
            let r = e.post_recv(i);
            if r != 0 {
                return Err(Error::arg(format!(
                    "ofi: posting receive buffers ({}): {}",
                    e.fab.prov_name(),
                    ffi::strerror(r)
                )));
            }
        }
        Ok(e)
    }

    fn post_recv(&self, i: usize) -> isize {
        loop {
            // SAFETY: buffer `i` lies inside the pool, which outlives the endpoint (field
            // order); its op is the pool's, never freed before the pool.
            let r = unsafe {
                self.fab.recv(
                    self.pool.base.add(i * wire::MSG_MAX),
                    wire::MSG_MAX,
                    self.pool.ops[i].cast(),
                )
            };
            if r != -ffi::FI_EAGAIN {
                return r;
            }
            std::thread::yield_now();
        }
    }

    /// Wakes the progress thread (retry stalled requests, drain the backlog, sweep).
    pub(super) fn kick(&self) {
        if !self.kicked.swap(true, Ordering::AcqRel) && self.fab.attr.waits != 0 {
            self.fab.cq_signal();
        }
    }

    /// The address-vector entry of a peer's endpoint name.
    pub(super) fn peer(&self, name: &[u8]) -> std::result::Result<u64, String> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&a) = peers.get(name) {
            return Ok(a);
        }
        // Names differ in length only where the provider's are strings (shm: "fi_shm://pid:..",
        // NUL-terminated); a binary name (sockaddr) has the provider's one length.
        let string = self.fab.name().last() == Some(&0);
        let fits = if string {
            name.last() == Some(&0)
        } else {
            name.len() == self.fab.name().len()
        };
        if !fits {
            return Err(format!(
                "the peer's address ({} bytes) is not a {} endpoint name",
                name.len(),
                self.fab.prov_name(),
            ));
        }
        let a = self
            .fab
            .av_insert(name)
            .map_err(|e| format!("fi_av_insert: {}", ffi::strerror(e)))?;
        peers.insert(name.to_vec(), a);
        Ok(a)
    }

    /// The libfabric descriptor, key and RMA address of `ptr` in region `index`.
    pub(super) fn rma_of(&self, index: u32, ptr: *const u8) -> Option<(*mut c_void, u64, u64)> {
        let mrs = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        let m = mrs.get(&index)?;
        let addr = if self.virt {
            ptr as u64
        } else {
            ptr as u64 - m.base
        };
        Some((m.mr.desc, m.mr.key, addr))
    }

    /// Issues an operation, in order behind any backlog; `FI_EAGAIN` queues it for the progress
    /// thread. An error fails the operation's link (the op is freed).
    pub(super) fn issue(&self, is: Issue) {
        if self.wedged.load(Ordering::Relaxed) {
            self.op_failed(is.op(), &self.wedged_why());
            return;
        }
        if self.backlogged.load(Ordering::Acquire) {
            let mut bl = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
            if !bl.is_empty() {
                bl.push_back(is);
                drop(bl);
                self.kick();
                return;
            }
        }
        let r = self.try_issue(&is);
        if r == -ffi::FI_EAGAIN {
            let mut bl = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
            bl.push_back(is);
            self.backlogged.store(true, Ordering::Release);
            drop(bl);
            self.kick();
        } else if r != 0 {
            self.op_failed(
                is.op(),
                &format!("posting to libfabric: {}", ffi::strerror(r)),
            );
        }
    }

    fn try_issue(&self, is: &Issue) -> isize {
        match *is {
            Issue::Send { dest, op } => {
                // SAFETY: `op` is a live boxed Op of kind Send that owns the buffer; both stay
                // until the completion frees them.
                unsafe {
                    let What::Send { buf, .. } = &(*op).what else {
                        return -22;
                    };
                    self.fab.send(buf, dest, op.cast())
                }
            }
            Issue::Read {
                buf,
                len,
                desc,
                peer,
                addr,
                key,
                op,
            } => {
                // SAFETY: `buf` lies in a registered region the op keeps alive (`_keep`); the op
                // lives until its completion.
                unsafe { self.fab.read(buf, len, desc, peer, addr, key, op.cast()) }
            }
            Issue::Write {
                buf,
                len,
                desc,
                peer,
                addr,
                key,
                op,
            } => {
                // SAFETY: as for reads.
                unsafe {
                    self.fab
                        .write(buf, len, desc, peer, addr, key, None, op.cast())
                }
            }
        }
    }

    fn drain_backlog(&self) {
        if !self.backlogged.load(Ordering::Acquire) {
            return;
        }
        let mut bl = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(is) = bl.front() {
            let r = self.try_issue(is);
            if r == -ffi::FI_EAGAIN {
                return;
            }
            let is = bl.pop_front().expect("front");
            if r != 0 {
                self.op_failed(
                    is.op(),
                    &format!("posting to libfabric: {}", ffi::strerror(r)),
                );
            }
        }
        self.backlogged.store(false, Ordering::Release);
    }

    /// Sends a message for `link` to `dest`.
    pub(super) fn send_msg(&self, dest: u64, buf: Vec<u8>, link: Weak<Link>) {
        // Small messages are injected (copied at once, no completion), unless a backlog must
        // go first.
        if buf.len() as u64 <= self.fab.attr.inject_size
            && !self.backlogged.load(Ordering::Acquire)
            && !self.wedged.load(Ordering::Relaxed)
            && self.fab.inject(&buf, dest) == 0
        {
            return;
        }
        let op = Op::boxed(What::Send { buf, link });
        self.issue(Issue::Send { dest, op });
    }

    /// An operation failed (posting it, or in its completion): its link fails; the op is freed.
    fn op_failed(&self, op: *mut Op, why: &str) {
        if op.is_null() {
            return;
        }
        // SAFETY: `op` came from Op::boxed and is no longer in libfabric's hands (its post
        // failed or its completion was read): this is its single release.
        let op = unsafe { Box::from_raw(op) };
        match op.what {
            What::Recv(i) => {
                // A receive buffer failed (canceled at close, or a truncated message): repost.
                let _ = Box::into_raw(op);
                if !self.stop.load(Ordering::Acquire) {
                    self.post_recv(i);
                }
            }
            What::Send { link, .. } | What::Rma { link, .. } => {
                if let Some(l) = link.upgrade() {
                    l.mark_failed(why);
                    self.kick();
                }
            }
        }
    }

    /// Why nothing is issued any more.
    fn wedged_why(&self) -> String {
        let (_, _, call) = self.fab.calls.sample();
        format!(
            "ofi: libfabric's {} provider has not returned from {call} for over {:?}: the \
             context is wedged (libfabric 1.17's shm provider spins on a lock inside a peer's \
             shared memory, forever if the peer died holding it)",
            self.fab.prov_name(),
            WEDGED_AFTER
        )
    }

    /// The watch thread: says once, and marks the context, when a call into libfabric (a
    /// send, an RMA, a completion-queue read) has not returned for [`WEDGED_AFTER`]. Such a
    /// thread cannot be got back; the watch makes the hang a named error for every other
    /// caller (their requests fail at once) and lets the context be dropped.
    fn watch(self: Arc<Self>) {
        // Counted in the watch's own ticks, not by the clock: a process stopped and resumed
        // (SIGSTOP, a debugger) inside a call has not waited on libfabric meanwhile.
        const TICK: Duration = Duration::from_millis(50);
        let (mut last_left, mut stale) = (0, 0u32);
        while !self.stop.load(Ordering::Acquire) {
            std::thread::sleep(TICK);
            let (entered, left, _) = self.fab.calls.sample();
            if entered == left || left != last_left {
                (last_left, stale) = (left, 0);
                continue;
            }
            stale += 1;
            if TICK * stale >= WEDGED_AFTER && !self.wedged.load(Ordering::Acquire) {
                self.wedged.store(true, Ordering::Release);
                let why = self.wedged_why();
                eprintln!("oxccl {why}");
                for l in self
                    .links
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                {
                    l.mark_failed(&why);
                    l.report();
                }
            }
        }
    }

    fn run(self: Arc<Self>) {
        let mut entries = [CqEntry::default(); 32];
        let mut idle = 0u32;
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            self.drain_backlog();
            let block = self.fab.attr.waits != 0
                && idle > 32
                && !self.backlogged.load(Ordering::Acquire)
                && !self.kicked.load(Ordering::Acquire);
            let n = if block {
                self.fab.cq_sread(&mut entries, 5)
            } else {
                self.fab.cq_read(&mut entries)
            };
            if n > 0 {
                idle = 0;
                for e in &entries[..n as usize] {
                    self.completed(e);
                }
            } else if n == -ffi::FI_EAVAIL {
                idle = 0;
                if let Some((ctx, _err, _flags, msg)) = self.fab.cq_readerr() {
                    self.op_failed(
                        ctx.cast(),
                        &format!("{} reported: {msg}", self.fab.prov_name()),
                    );
                }
            } else {
                idle = idle.saturating_add(1);
                if self.fab.attr.waits == 0 {
                    if self.busy || idle < 64 {
                        std::hint::spin_loop();
                    } else if idle < 256 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(if idle < 4096 {
                            20
                        } else {
                            200
                        }));
                    }
                }
            }
            if self.kicked.swap(false, Ordering::AcqRel)
                || last_sweep.elapsed() >= Duration::from_millis(2)
            {
                last_sweep = Instant::now();
                self.sweep();
            }
        }
    }

    fn completed(self: &Arc<Self>, e: &CqEntry) {
        let op: *mut Op = e.op_context.cast();
        if op.is_null() {
            // Remote CQ data or an event without context: this protocol sends none.
            return;
        }
        // SAFETY: every context this engine hands to libfabric is an Op from Op::boxed (or the
        // pool's); its completion is read once.
        let what = unsafe { &(*op).what };
        match what {
            What::Recv(i) => {
                let i = *i;
                let len = e.len.min(wire::MSG_MAX);
                // SAFETY: libfabric wrote `len` bytes into buffer `i`, ours again until reposted.
                let bytes = unsafe {
                    std::slice::from_raw_parts(self.pool.base.add(i * wire::MSG_MAX), len)
                };
                let msg = wire::decode(bytes);
                if !self.stop.load(Ordering::Acquire) {
                    self.post_recv(i);
                }
                if e.flags & ffi::FI_RECV != 0
                    && let Some(m) = msg
                {
                    self.deliver(m);
                }
            }
            What::Send { .. } => {
                // SAFETY: the send's single completion: release its op and buffer.
                drop(unsafe { Box::from_raw(op) });
            }
            What::Rma { link, seq, .. } => {
                let (link, seq) = (link.upgrade(), *seq);
                // SAFETY: the RMA's single completion.
                drop(unsafe { Box::from_raw(op) });
                if let Some(l) = link {
                    l.rma_done(self, seq);
                }
            }
        }
    }

    /// A message arrived: hand it to the queue pair it names.
    fn deliver(self: &Arc<Self>, m: wire::Msg) {
        let link = self
            .links
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&m.h.dst_token)
            .cloned();
        if let Some(l) = link {
            l.receive(self, m);
        }
    }

    /// Every few milliseconds and when kicked: failed links report, stalled ones retry,
    /// connected ones ping their peers and notice silence.
    fn sweep(self: &Arc<Self>) {
        let links: Vec<Arc<Link>> = self
            .links
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for l in links {
            l.sweep(self);
        }
    }

    /// Forgets a queue pair (destroyed).
    pub(super) fn forget(&self, token: u64) {
        self.links
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token);
    }
}
