//! [`PyKvEngine`] (`oxccl._oxccl.KvEngine`): the oxccl-kv transfer engine for Python, and
//! [`PyKvMetadataServer`] (`oxccl._oxccl.KvMetadataServer`), an oxccl store serving segment
//! descriptors from inside a Python process.
//!
//! This layer is Pythonic: every failure raises an exception of `oxccl.errors` carrying the
//! Rust message (which names the segment, the request and the address). The Mooncake-shaped
//! `oxccl.kv.TransferEngine` (in `python/oxccl/kv.py`) wraps it and turns exceptions into
//! Mooncake's return codes, a logger warning and `last_error()`.
//!
//! Every call that can block or move data runs with the GIL released; waits sleep (the
//! engine spins for a few microseconds, then blocks), they do not spin a core.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use oxccl::DataType;
use oxccl_kv::meta::{P2pMetadata, RedisMetadata, StoreMetadata};
use oxccl_kv::{
    BatchId, EngineConfig, Metadata, Opcode, Protocol, SegmentId, TransferEngine, TransferRequest,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::{Role, View, view};
use crate::errors::{self, Kind};

/// The class of `oxccl.errors` an oxccl-kv error maps to.
pub fn kind_of(e: &oxccl_kv::Error) -> Kind {
    use oxccl_kv::Error as E;
    match e {
        E::InvalidArgument(_) | E::RemoteAccess { .. } => Kind::InvalidArgument,
        E::SegmentNotFound { .. } | E::PeerFailed { .. } | E::Handshake { .. } => Kind::PeerFailed,
        E::Timeout { .. } => Kind::Timeout,
        E::Auth { .. } => Kind::ConfigError,
        E::Canceled { .. } => Kind::Aborted,
        _ => Kind::Error,
    }
}

/// The Python exception for an oxccl-kv error (its message is the Rust error's text).
pub fn to_py(py: Python<'_>, e: &oxccl_kv::Error) -> PyErr {
    errors::make(py, kind_of(e), e.to_string(), None, None)
}

/// Runs `f` with the GIL released; its error, or a panic in it, becomes the Python exception
/// (a panic never unwinds into Python: it is reported as an `oxccl.Error` naming it a bug).
fn blocking<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> oxccl_kv::Result<T> + Send,
) -> PyResult<T> {
    let r = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    settle(py, r)
}

/// [`blocking`] for quick calls that keep the GIL.
fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> oxccl_kv::Result<T>) -> PyResult<T> {
    settle(
        py,
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)),
    )
}

fn settle<T>(py: Python<'_>, r: std::thread::Result<oxccl_kv::Result<T>>) -> PyResult<T> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, &e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            Err(errors::make(
                py,
                Kind::Error,
                format!("internal error in oxccl-kv (a bug; please report it): panic: {what}"),
                None,
                None,
            ))
        }
    }
}

fn invalid(py: Python<'_>, msg: String) -> PyErr {
    errors::make(py, Kind::InvalidArgument, msg, None, None)
}

fn config_error(py: Python<'_>, msg: String) -> PyErr {
    errors::make(py, Kind::ConfigError, msg, None, None)
}

fn seconds(py: Python<'_>, what: &str, s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(invalid(
            py,
            format!("{what}={s}: expected a positive number of seconds"),
        )),
    }
}

/// Where segment descriptors live, as `metadata_server` (and Mooncake's `metadata_type`) say.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Backend {
    /// `P2PHANDSHAKE`: no service; a segment is named by its owner's handshake `IP:port`.
    P2p,
    /// `redis://...` (the URL as given).
    Redis(String),
    /// `oxccl://host:port` or a bare `host:port`: an oxccl store.
    Store(String),
}

fn parse_backend(server: &str, kind: Option<&str>) -> Result<Backend, String> {
    let server = server.trim();
    if server.eq_ignore_ascii_case("P2PHANDSHAKE") {
        return Ok(Backend::P2p);
    }
    let (scheme, rest) = match server.split_once("://") {
        Some((s, r)) => (s.to_ascii_lowercase(), r.to_string()),
        None => match kind.map(|k| k.trim().to_ascii_lowercase()) {
            Some(k) if !k.is_empty() => (k, server.to_string()),
            _ => ("oxccl".to_string(), server.to_string()),
        },
    };
    match scheme.as_str() {
        "p2p" | "p2phandshake" => Ok(Backend::P2p),
        "redis" | "rediss" => Ok(Backend::Redis(format!("{scheme}://{rest}"))),
        "oxccl" | "store" if rest.is_empty() => Err(format!(
            "metadata server {server:?}: an oxccl store needs host:port"
        )),
        "oxccl" | "store" => Ok(Backend::Store(rest)),
        other => Err(format!(
            "metadata server {server:?}: {other:?} metadata is not supported by oxccl-kv \
             (use \"P2PHANDSHAKE\", \"redis://host:port[/db]\", or an oxccl store as \
             \"oxccl://host:port\" or \"host:port\")"
        )),
    }
}

/// `local_hostname` split into a bind address and, when it was a host name rather than an IP,
/// that name (`ip`, `ip:port`, `[v6]:port`, `host`, `host:port`; empty: the loopback).
fn parse_local(s: &str) -> Result<(SocketAddr, Option<String>), String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok((SocketAddr::from(([127, 0, 0, 1], 0)), None));
    }
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok((a, None));
    }
    let bare = s.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok((SocketAddr::new(ip, 0), None));
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match p.parse::<u16>() {
            Ok(p) => (h, p),
            Err(_) => return Err(format!("local hostname {s:?}: {p:?} is not a port")),
        },
        _ => (s, 0),
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("local hostname {s:?} does not resolve: {e}"))?
        .collect();
    let a = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("local hostname {s:?} resolves to no address"))?;
    Ok((a, Some(host.to_string())))
}

/// The variables the configuration reads: the process environment, where Mooncake's
/// `MC_TRANSFER_TIMEOUT` stands in for `OXCCL_KV_TIMEOUT` when that is not set.
fn env_var(k: &str) -> Option<String> {
    let v = std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    match (k, v) {
        ("OXCCL_KV_TIMEOUT", None) => std::env::var("MC_TRANSFER_TIMEOUT").ok(),
        (_, v) => v,
    }
}

/// The settings `KvEngine(...)` takes, after the environment.
struct Setup {
    config: EngineConfig,
    backend: Backend,
}

#[allow(clippy::too_many_arguments)]
/// What the keyword arguments of `KvEngine(...)` override in the environment's configuration.
struct Overrides {
    name: Option<String>,
    timeout: Option<Duration>,
    peer_timeout: Option<Duration>,
    lanes: Option<usize>,
    busy_poll: Option<bool>,
    /// `"off"`, `"on"` or `"auto"` (`OXCCL_ENCRYPT`).
    encrypt: Option<String>,
}

fn setup(
    local_hostname: &str,
    metadata_server: &str,
    protocol: &str,
    metadata_type: Option<&str>,
    over: Overrides,
) -> Result<Setup, (Kind, String)> {
    let cfg = |m: String| (Kind::ConfigError, m);
    let mut config = EngineConfig::from_vars(&env_var).map_err(|e| cfg(e.to_string()))?;
    let backend = parse_backend(metadata_server, metadata_type).map_err(cfg)?;
    // The environment may override the protocol the (ported) code names.
    if env_var("OXCCL_KV_PROTOCOL").is_none() {
        config.protocol = protocol
            .parse::<Protocol>()
            .map_err(|e| (Kind::InvalidArgument, e.to_string()))?;
    }
    let (mut addr, host) = parse_local(local_hostname).map_err(cfg)?;
    if env_var("OXCCL_KV_ADDR").is_some() && local_hostname.trim().is_empty() {
        addr = config.local_addr;
    }
    config.name = match (&backend, over.name.or_else(|| env_var("OXCCL_KV_NAME"))) {
        (_, Some(n)) => Some(n),
        // Peer-to-peer: peers open `host:port` of the listener, as Mooncake's callers compute
        // it from get_rpc_port(). Under a host name (not an IP), the port is chosen here so
        // the name can carry it.
        (Backend::P2p, None) => match host {
            None => None,
            Some(h) => {
                if addr.port() == 0 {
                    let l = TcpListener::bind(addr)
                        .map_err(|e| cfg(format!("binding {addr} (for {h:?}): {e}")))?;
                    addr = l
                        .local_addr()
                        .map_err(|e| cfg(format!("binding {addr}: {e}")))?;
                }
                Some(format!("{h}:{}", addr.port()))
            }
        },
        // A metadata service: the segment is named by local_hostname, as Mooncake names it.
        (_, None) if local_hostname.trim().is_empty() => None,
        (_, None) => Some(local_hostname.trim().to_string()),
    };
    config.local_addr = addr;
    if let Some(t) = over.timeout {
        config.timeout = t;
    }
    if let Some(t) = over.peer_timeout {
        config.peer_timeout = t;
    }
    if let Some(n) = over.lanes {
        config.lanes = n;
    }
    if let Some(b) = over.busy_poll {
        config.busy_poll = b;
    }
    if let Some(e) = over.encrypt {
        config.encrypt = e.parse().map_err(|_| {
            (
                Kind::InvalidArgument,
                format!("encrypt={e:?}: expected \"off\", \"on\", \"auto\", True or False"),
            )
        })?;
    }
    Ok(Setup { config, backend })
}

fn connect_backend(b: &Backend, config: &EngineConfig) -> oxccl_kv::Result<Arc<dyn Metadata>> {
    Ok(match b {
        Backend::P2p => Arc::new(
            P2pMetadata::new(config.secret.clone()).with_connect_retry(config.connect_retry),
        ),
        Backend::Redis(url) => Arc::new(RedisMetadata::connect(url, config.timeout)?),
        Backend::Store(addr) => Arc::new(StoreMetadata::connect(
            addr,
            &config.secret,
            config.timeout,
        )?),
    })
}

/// Submits `reqs`; when the target's descriptor this engine holds lacks the range (it
/// registered memory since the segment was opened), asks the target for it again once.
fn submit_fresh(
    e: &TransferEngine,
    seg: SegmentId,
    reqs: &[TransferRequest],
    notify: Option<&[u8]>,
) -> oxccl_kv::Result<BatchId> {
    match e.submit(reqs, notify) {
        Err(oxccl_kv::Error::RemoteAccess { .. }) => {
            e.refresh_segment(seg)?;
            e.submit(reqs, notify)
        }
        r => r,
    }
}

/// The requests of a batch (their target is set once the segment is open).
fn requests(
    py: Python<'_>,
    write: bool,
    locals: &[u64],
    remotes: &[u64],
    lengths: &[usize],
) -> PyResult<Vec<TransferRequest>> {
    if locals.len() != remotes.len() || locals.len() != lengths.len() {
        return Err(invalid(
            py,
            format!(
                "buffers, peer_buffer_addresses and lengths differ in length ({}, {}, {})",
                locals.len(),
                remotes.len(),
                lengths.len()
            ),
        ));
    }
    if locals.is_empty() {
        return Err(invalid(py, "an empty batch (no buffers)".into()));
    }
    let opcode = if write { Opcode::Write } else { Opcode::Read };
    Ok(locals
        .iter()
        .zip(remotes)
        .zip(lengths)
        .map(|((&source, &target_offset), &length)| TransferRequest {
            opcode,
            source,
            target_id: 0,
            target_offset,
            length,
        })
        .collect())
}

/// The oxccl-kv transfer engine (`oxccl._oxccl.KvEngine`): the Pythonic layer under
/// `oxccl.kv.TransferEngine`. Methods raise `oxccl.errors` exceptions on failure.
#[pyclass(frozen, module = "oxccl._oxccl", name = "KvEngine")]
pub struct PyKvEngine {
    engine: RwLock<Option<Arc<TransferEngine>>>,
    name: String,
    handshake: String,
    backend: String,
    timeout: Duration,
    /// Python objects registered by `register_object`, kept alive (and their buffer exports
    /// held) until unregistered.
    objects: Mutex<HashMap<u64, View>>,
    /// When each batch from `submit` was submitted (`check_status`'s timeout).
    submitted: Mutex<HashMap<BatchId, Instant>>,
    /// Batches a synchronous call gave up on (timed out): freed once they end.
    orphans: Mutex<Vec<BatchId>>,
    has_orphans: AtomicBool,
}

impl PyKvEngine {
    fn get(&self, py: Python<'_>) -> PyResult<Arc<TransferEngine>> {
        self.engine
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                errors::make(
                    py,
                    Kind::Error,
                    format!("the transfer engine {:?} is closed", self.name),
                    None,
                    None,
                )
            })
    }

    /// Frees the timed-out batches that ended since.
    fn sweep(&self, e: &TransferEngine) {
        if !self.has_orphans.load(Ordering::Acquire) {
            return;
        }
        let mut o = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        o.retain(|&b| match e.batch_summary(b) {
            Ok(s) if s.done => {
                let _ = e.free_batch(b);
                false
            }
            Ok(_) => true,
            Err(_) => false,
        });
        self.has_orphans.store(!o.is_empty(), Ordering::Release);
    }

    fn orphan(&self, b: BatchId) {
        self.orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(b);
        self.has_orphans.store(true, Ordering::Release);
    }

    /// Submits, waits up to `timeout` (the engine's when `None`), frees (a timed-out batch is
    /// freed once it ends: its late completions land or fail, nothing else waits for them).
    fn sync(
        &self,
        e: &TransferEngine,
        target: &str,
        reqs: &mut [TransferRequest],
        notify: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> oxccl_kv::Result<()> {
        self.sweep(e);
        let seg = e.open_segment(target)?;
        for r in reqs.iter_mut() {
            r.target_id = seg;
        }
        let b = submit_fresh(e, seg, reqs, notify)?;
        let r = e.wait(b, timeout.unwrap_or(self.timeout));
        if matches!(r, Err(oxccl_kv::Error::Timeout { .. })) {
            self.orphan(b);
        } else {
            let _ = e.free_batch(b);
        }
        r
    }
}

#[pymethods]
impl PyKvEngine {
    /// Starts an engine: `local_hostname` (`IP`, `IP:port`, `host`, `host:port`; the
    /// handshake listener and the tcp provider bind it), `metadata_server` (`P2PHANDSHAKE`,
    /// `redis://...`, `oxccl://host:port` or `host:port`), `protocol` (`auto`, `shm`, `tcp`,
    /// `rdma`; `OXCCL_KV_PROTOCOL` overrides it). The job secret comes from `OXCCL_SECRET` or
    /// `OXCCL_SECRET_FILE`; the other `OXCCL_KV_*` variables are read as
    /// `EngineConfig::from_env` documents, and the keyword arguments override them.
    #[new]
    #[pyo3(signature = (local_hostname, metadata_server, protocol="auto", *, metadata_type=None, name=None, timeout=None, peer_timeout=None, lanes=None, busy_poll=None, encrypt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        metadata_type: Option<&str>,
        name: Option<String>,
        timeout: Option<f64>,
        peer_timeout: Option<f64>,
        lanes: Option<usize>,
        busy_poll: Option<bool>,
        encrypt: Option<Bound<'_, PyAny>>,
    ) -> PyResult<PyKvEngine> {
        // True/False, or "on"/"off"/"auto".
        let encrypt = match encrypt {
            None => None,
            Some(v) if v.is_instance_of::<pyo3::types::PyBool>() => {
                Some(if v.extract::<bool>()? { "on" } else { "off" }.to_string())
            }
            Some(v) => Some(v.extract::<String>().map_err(|_| {
                invalid(
                    py,
                    format!("encrypt={v}: expected \"off\", \"on\", \"auto\", True or False"),
                )
            })?),
        };
        let over = Overrides {
            name,
            timeout: seconds(py, "timeout", timeout)?,
            peer_timeout: seconds(py, "peer_timeout", peer_timeout)?,
            lanes,
            busy_poll,
            encrypt,
        };
        let s = setup(
            local_hostname,
            metadata_server,
            protocol,
            metadata_type,
            over,
        )
        .map_err(|(k, m)| errors::make(py, k, m, None, None))?;
        let Setup { config, backend } = s;
        let timeout = config.timeout;
        let (engine, backend) = blocking(py, move || {
            let meta = connect_backend(&backend, &config)?;
            let describe = meta.describe();
            Ok((TransferEngine::new(config, meta)?, describe))
        })?;
        Ok(PyKvEngine {
            name: engine.name().to_string(),
            handshake: engine.handshake_addr().to_string(),
            backend,
            timeout,
            engine: RwLock::new(Some(Arc::new(engine))),
            objects: Mutex::new(HashMap::new()),
            submitted: Mutex::new(HashMap::new()),
            orphans: Mutex::new(Vec::new()),
            has_orphans: AtomicBool::new(false),
        })
    }

    /// The segment name peers open this engine by.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// `IP:port` of the handshake listener.
    #[getter]
    fn handshake_addr(&self) -> &str {
        &self.handshake
    }

    /// The handshake listener's port (Mooncake's RPC port).
    #[getter]
    fn rpc_port(&self) -> u16 {
        self.handshake
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or(0)
    }

    /// The metadata backend, as it describes itself.
    #[getter]
    fn metadata(&self) -> &str {
        &self.backend
    }

    /// The default timeout of every wait, seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// The providers this engine serves (`"shm"`, `"tcp"`).
    fn providers(&self, py: Python<'_>) -> PyResult<Vec<&'static str>> {
        let e = self.get(py)?;
        guarded(py, || Ok(e.providers()))
    }

    /// `(addr, len)` of each buffer this engine registered (its own descriptor).
    fn buffers(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64)>> {
        let e = self.get(py)?;
        let d = guarded(py, || Ok(e.descriptor()))?;
        Ok(d.buffers.iter().map(|b| (b.addr, b.len)).collect())
    }

    /// Allocates `length` bytes of zeroed memory registered with every provider; its address.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: usize) -> PyResult<u64> {
        let e = self.get(py)?;
        blocking(py, || e.allocate_managed_buffer(length))
    }

    /// Frees a managed buffer.
    fn free_managed_buffer(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let e = self.get(py)?;
        blocking(py, || e.free_managed_buffer(addr))
    }

    /// Registers `length` bytes at `addr`, memory the caller owns: it must stay allocated
    /// until unregistered (as with Mooncake's `register_memory`, nothing can check a raw
    /// address).
    fn register_memory(&self, py: Python<'_>, addr: u64, length: usize) -> PyResult<()> {
        let e = self.get(py)?;
        // SAFETY: the caller's contract (documented above and in oxccl.kv): the memory stays
        // valid and allocated until it is unregistered.
        blocking(py, || unsafe { e.register_memory(addr, length) })
    }

    /// Registers the memory of `obj` (a writable buffer-protocol object, a CPU torch tensor
    /// or a DLPack object, contiguous), kept alive until unregistered; `(addr, length)`.
    fn register_object(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
        let e = self.get(py)?;
        let v = view(
            py,
            obj,
            Role {
                what: "register_memory's buffer",
                write: true,
            },
            Some(DataType::U8),
            None,
        )?;
        let (addr, len) = (v.addr() as u64, v.len());
        if len == 0 {
            return Err(invalid(py, "register_memory: the buffer is empty".into()));
        }
        // SAFETY: `v` holds the object (and its buffer export) until the memory is
        // unregistered: it is kept in `objects` under the address.
        blocking(py, || unsafe { e.register_memory(addr, len) })?;
        self.objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, v);
        Ok((addr, len))
    }

    /// Unregisters memory registered with `register_memory` or `register_object` (the latter's
    /// object is released).
    fn unregister_memory(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let e = self.get(py)?;
        blocking(py, || e.unregister_memory(addr))?;
        let v = self
            .objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&addr);
        drop(v);
        Ok(())
    }

    /// Copies `data` into registered local memory at `addr`.
    fn write_local(&self, py: Python<'_>, addr: u64, data: &[u8]) -> PyResult<()> {
        let e = self.get(py)?;
        guarded(py, || e.write_local(addr, data))
    }

    /// `length` bytes of registered local memory at `addr`.
    fn read_local<'py>(
        &self,
        py: Python<'py>,
        addr: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let e = self.get(py)?;
        let mut err = None;
        let b = PyBytes::new_with(py, length, |buf| {
            if let Err(x) = guarded(py, || e.read_local(addr, buf)) {
                err = Some(x);
            }
            Ok(())
        })?;
        match err {
            Some(x) => Err(x),
            None => Ok(b),
        }
    }

    /// One synchronous transfer of `length` bytes between local `buffer` and the target's
    /// `peer_addr` (WRITE when `write`, else READ), with an optional notification; waits up to
    /// `timeout` seconds (default the engine's), then raises a timeout naming the batch, the
    /// segment and what is outstanding.
    #[pyo3(signature = (target, write, buffer, peer_addr, length, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        target: &str,
        write: bool,
        buffer: u64,
        peer_addr: u64,
        length: usize,
        notify: Option<&[u8]>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = seconds(py, "timeout", timeout)?;
        let e = self.get(py)?;
        let mut req = [TransferRequest {
            opcode: if write { Opcode::Write } else { Opcode::Read },
            source: buffer,
            target_id: 0,
            target_offset: peer_addr,
            length,
        }];
        blocking(py, || self.sync(&e, target, &mut req, notify, timeout))
    }

    /// A synchronous batch to one target: request `i` moves `lengths[i]` bytes between local
    /// `buffers[i]` and the target's `peer_addrs[i]`; waits up to `timeout` seconds (default
    /// the engine's).
    #[pyo3(signature = (target, write, buffers, peer_addrs, lengths, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer(
        &self,
        py: Python<'_>,
        target: &str,
        write: bool,
        buffers: Vec<u64>,
        peer_addrs: Vec<u64>,
        lengths: Vec<usize>,
        notify: Option<&[u8]>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = seconds(py, "timeout", timeout)?;
        let e = self.get(py)?;
        let mut reqs = requests(py, write, &buffers, &peer_addrs, &lengths)?;
        blocking(py, || self.sync(&e, target, &mut reqs, notify, timeout))
    }

    /// Submits a batch to one target and returns its id (never 0) at once.
    #[pyo3(signature = (target, write, buffers, peer_addrs, lengths, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        target: &str,
        write: bool,
        buffers: Vec<u64>,
        peer_addrs: Vec<u64>,
        lengths: Vec<usize>,
        notify: Option<&[u8]>,
    ) -> PyResult<u64> {
        let e = self.get(py)?;
        let mut reqs = requests(py, write, &buffers, &peer_addrs, &lengths)?;
        let b = blocking(py, || {
            self.sweep(&e);
            let seg = e.open_segment(target)?;
            for r in &mut reqs {
                r.target_id = seg;
            }
            submit_fresh(&e, seg, &reqs, notify)
        })?;
        self.submitted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(b, Instant::now());
        Ok(b)
    }

    /// Where a batch stands, without blocking: `(done, transferred bytes, requests completed,
    /// requests)`. A failed batch raises its error (and stays until freed).
    fn batch_status(&self, py: Python<'_>, batch: u64) -> PyResult<(bool, u64, usize, usize)> {
        let e = self.get(py)?;
        let s = blocking(py, || e.batch_summary(batch))?;
        if s.done {
            // The batch's own result: the error naming the segment and the request.
            blocking(py, || e.wait(batch, Duration::ZERO))?;
        }
        Ok((s.done, s.transferred, s.completed, s.requests))
    }

    /// Cancels a batch: its requests not yet sent fail as canceled and never move; those in
    /// flight end as they end (no notification goes). Returns how many requests were taken
    /// back; the batch stays until freed.
    fn cancel_batch(&self, py: Python<'_>, batch: u64) -> PyResult<usize> {
        let e = self.get(py)?;
        guarded(py, || e.cancel_batch(batch))
    }

    /// Mooncake's `transfer_check_status`: 1 when the batch completed (it is freed), 0 while
    /// it runs, -2 while it runs past the engine's timeout; a failure raises (and frees it).
    fn check_status(&self, py: Python<'_>, batch: u64) -> PyResult<i32> {
        let e = self.get(py)?;
        let s = blocking(py, || e.batch_summary(batch))?;
        if !s.done {
            let late = self
                .submitted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&batch)
                .is_some_and(|t| t.elapsed() > self.timeout);
            return Ok(if late { -2 } else { 0 });
        }
        let r = blocking(py, || e.wait(batch, Duration::ZERO));
        let _ = e.free_batch(batch);
        self.submitted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&batch);
        r.map(|()| 1)
    }

    /// Waits for a batch to end (up to `timeout` seconds, default the engine's), raising its
    /// error; the batch is kept (see `free_batch`).
    #[pyo3(signature = (batch, timeout=None))]
    fn wait(&self, py: Python<'_>, batch: u64, timeout: Option<f64>) -> PyResult<()> {
        let e = self.get(py)?;
        let t = seconds(py, "timeout", timeout)?.unwrap_or(self.timeout);
        blocking(py, || e.wait(batch, t))
    }

    /// Waits for every batch of `batches` to end (within `timeout` seconds in all, default the
    /// engine's) and frees those that ended; raises the first failure. Batches still running
    /// at the timeout are freed once they end.
    #[pyo3(signature = (batches, timeout=None))]
    fn wait_all(&self, py: Python<'_>, batches: Vec<u64>, timeout: Option<f64>) -> PyResult<()> {
        let e = self.get(py)?;
        let t = seconds(py, "timeout", timeout)?.unwrap_or(self.timeout);
        let r = blocking(py, || {
            let deadline = Instant::now() + t;
            let mut first = None;
            for &b in &batches {
                let left = deadline.saturating_duration_since(Instant::now());
                let r = e.wait(b, left.max(Duration::from_millis(1)));
                match &r {
                    Err(oxccl_kv::Error::Timeout { .. }) => self.orphan(b),
                    _ => {
                        let _ = e.free_batch(b);
                    }
                }
                if let Err(x) = r
                    && first.is_none()
                {
                    first = Some(x);
                }
            }
            first.map_or(Ok(()), Err)
        });
        {
            let mut s = self.submitted.lock().unwrap_or_else(|e| e.into_inner());
            for b in &batches {
                s.remove(b);
            }
        }
        r
    }

    /// Forgets an ended batch.
    fn free_batch(&self, py: Python<'_>, batch: u64) -> PyResult<()> {
        let e = self.get(py)?;
        guarded(py, || e.free_batch(batch))?;
        self.submitted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&batch);
        Ok(())
    }

    /// `(addr, len)` of each buffer segment `name` registered, as its owner says now (the
    /// segment is opened, and its descriptor asked for again).
    fn segment_buffers(&self, py: Python<'_>, name: &str) -> PyResult<Vec<(u64, u64)>> {
        let e = self.get(py)?;
        let d = blocking(py, || {
            let seg = e.open_segment(name)?;
            e.refresh_segment(seg)
        })?;
        Ok(d.buffers.iter().map(|b| (b.addr, b.len)).collect())
    }

    /// Opens segment `name` (connects to its owner) if it is not open yet.
    fn open_segment(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let e = self.get(py)?;
        blocking(py, || e.open_segment(name)).map(|_| ())
    }

    /// The notifications that arrived since the last call: `(sender's segment name, message)`.
    fn get_notifies<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let e = self.get(py)?;
        let n = guarded(py, || Ok(e.get_notifies()))?;
        Ok(n.into_iter()
            .map(|n| (n.from, PyBytes::new(py, &n.msg)))
            .collect())
    }

    /// Whether the lanes to segment `name` (opened) are encrypted.
    fn lanes_encrypted(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        let e = self.get(py)?;
        guarded(py, || {
            let seg = e.open_segment(name)?;
            e.lanes_encrypted(seg)
        })
    }

    /// How many notifications were dropped because the queue (`OXCCL_KV_NOTIFY_QUEUE`) was
    /// full: the oldest go first.
    #[getter]
    fn notifies_dropped(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get(py)?.notifies_dropped())
    }

    /// Waits up to `timeout` seconds for a notification, then takes all that arrived.
    fn wait_notifies<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let e = self.get(py)?;
        let t = if timeout.is_finite() && timeout > 0.0 {
            Duration::from_secs_f64(timeout.min(1e9))
        } else {
            Duration::ZERO
        };
        let n = blocking(py, || Ok(e.wait_notifies(t)))?;
        Ok(n.into_iter()
            .map(|n| (n.from, PyBytes::new(py, &n.msg)))
            .collect())
    }

    /// Closes the engine: its descriptor is withdrawn, peers' requests to it fail, registered
    /// objects are released. Later calls raise. Closing twice is harmless.
    fn close(&self, py: Python<'_>) {
        let e = self
            .engine
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // Dropping the last handle joins the engine's threads: without the GIL.
        py.detach(move || drop(e));
        let objects = std::mem::take(&mut *self.objects.lock().unwrap_or_else(|e| e.into_inner()));
        drop(objects);
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.engine
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    fn __repr__(&self) -> String {
        format!(
            "KvEngine(name={:?}, handshake={:?}, metadata={:?}{})",
            self.name,
            self.handshake,
            self.backend,
            if self.closed() { ", closed" } else { "" }
        )
    }
}

impl Drop for PyKvEngine {
    fn drop(&mut self) {
        // The engine before the objects whose memory it has registered.
        let e = self
            .engine
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(e);
    }
}

/// An oxccl store serving segment descriptors (`oxccl._oxccl.KvMetadataServer`): engines
/// started with `metadata_server="oxccl://ADDR"` publish to it and look each other up in it.
/// It authenticates clients with the job secret (`OXCCL_SECRET` / `OXCCL_SECRET_FILE`).
#[pyclass(frozen, module = "oxccl._oxccl", name = "KvMetadataServer")]
pub struct PyKvMetadataServer {
    server: Mutex<Option<oxccl_bootstrap::StoreServer>>,
    addr: String,
}

#[pymethods]
impl PyKvMetadataServer {
    /// Listens on `bind` (`host:port`; port 0 picks a free one: see `addr`).
    #[new]
    #[pyo3(signature = (bind="127.0.0.1:0"))]
    fn new(py: Python<'_>, bind: &str) -> PyResult<PyKvMetadataServer> {
        let secret = oxccl_bootstrap::Secret::from_env_or_user_file()
            .map_err(|e| config_error(py, e.to_string()))?;
        let s = py
            .detach(|| oxccl_bootstrap::StoreServer::bind(bind, secret))
            .map_err(|e| config_error(py, format!("metadata server on {bind}: {e}")))?;
        Ok(PyKvMetadataServer {
            addr: s.addr().to_string(),
            server: Mutex::new(Some(s)),
        })
    }

    /// `host:port` it listens on.
    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// Stops serving (the descriptors it held are gone).
    fn close(&self, py: Python<'_>) {
        let s = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(move || drop(s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_servers_map_to_backends() {
        assert_eq!(parse_backend("P2PHANDSHAKE", None), Ok(Backend::P2p));
        assert_eq!(
            parse_backend("redis://127.0.0.1:6379/0", None),
            Ok(Backend::Redis("redis://127.0.0.1:6379/0".into()))
        );
        assert_eq!(
            parse_backend("oxccl://10.0.0.1:29500", None),
            Ok(Backend::Store("10.0.0.1:29500".into()))
        );
        assert_eq!(
            parse_backend("10.0.0.1:29500", None),
            Ok(Backend::Store("10.0.0.1:29500".into()))
        );
        assert_eq!(
            parse_backend("127.0.0.1:6379", Some("redis")),
            Ok(Backend::Redis("redis://127.0.0.1:6379".into()))
        );
        assert_eq!(
            parse_backend("P2PHANDSHAKE", Some("redis")),
            Ok(Backend::P2p)
        );
        let e = parse_backend("etcd://127.0.0.1:2379", None).unwrap_err();
        assert!(e.contains("etcd") && e.contains("P2PHANDSHAKE"), "{e}");
        assert!(parse_backend("127.0.0.1:2379", Some("http")).is_err());
    }

    #[test]
    fn local_hostnames_parse() {
        let a = |s: &str| parse_local(s).unwrap();
        assert_eq!(a("127.0.0.1"), ("127.0.0.1:0".parse().unwrap(), None));
        assert_eq!(
            a("127.0.0.1:7000"),
            ("127.0.0.1:7000".parse().unwrap(), None)
        );
        assert_eq!(a("[::1]:7000"), ("[::1]:7000".parse().unwrap(), None));
        assert_eq!(a(""), ("127.0.0.1:0".parse().unwrap(), None));
        let (addr, host) = a("localhost:7001");
        assert_eq!((addr.port(), host.as_deref()), (7001, Some("localhost")));
        assert!(addr.ip().is_loopback());
        assert!(parse_local("localhost:notaport").is_err());
    }
}
