//! The shm provider: kernel bypass between processes of one host.
//!
//! A context hands its context segment (completion-queue doorbells, region table), its queue
//! pairs' segments and its provider memory (memfds) to same-host peers through its segment
//! service ([`service`]), after checking the caller's uid and the secret token it presents. A
//! peer maps them once and then works on them directly:
//!
//! - A WRITE or READ is one copy by the initiator between its own buffer and its mapping of the
//!   target's region, after validating rkey, bounds and access against the target's region table;
//!   then a release-store of the doorbell. Atomics are CPU atomics on the mapped word. None of it
//!   makes a syscall. Registered user memory (not shared) is reached with process_vm_readv/writev
//!   instead.
//! - A SEND or WRITE_WITH_IMM claims the next receive in the target's ring (`ring`) with a CAS,
//!   copies the payload straight into the target's buffers, completes the slot and rings the
//!   target's completion-queue doorbell (a futex wake only when someone sleeps).
//! - A request that finds no receive posted, or the target not yet ready, waits in the initiator's
//!   pending queue and is retried on every poll until the RNR budget or the timeout runs out.
//!
//! The service thread watches every mapped peer's pidfd: a peer that exits is noticed at once, and
//! the data path learns it from one atomic load.

mod qp;
mod service;

use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use rustix::event::EventfdFlags;

use crate::contract::{MrInner, OpenArgs, ProviderContext, QpSetup, QpTransport, RegionInfo};
use crate::model::{AccessFlags, Error, Result};
use service::{PeerMap, Registry, Service, kick};

/// Opens the shm half of a context: starts its segment service.
pub(crate) fn open(args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
    let pid = std::process::id();
    let token = args.keys.next_u64()?;
    let registry = Arc::new(Registry::default());
    let _ = registry.ctx.set((token, args.seg.clone()));
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
    Ok(Box::new(ShmContext {
        shared: Arc::new(Shared {
            token,
            sock_name,
            registry,
            peers,
            wake,
        }),
        service: Mutex::new(Some(service)),
        stop,
    }))
}

/// What a shm context's queue pairs share with it.
pub(crate) struct Shared {
    /// The context's secret token (peers present it to map the context segment).
    token: u64,
    /// The segment service's abstract socket.
    sock_name: String,
    /// What the service hands out.
    registry: Arc<Registry>,
    /// Peer contexts mapped so far.
    peers: PeerMap,
    /// Wakes the service thread.
    wake: Arc<OwnedFd>,
}

impl Shared {
    /// The peer context behind `(pid, token, sock)`, mapped and watched; created on first use.
    fn peer(
        &self,
        pid: u32,
        token: u64,
        sock: &str,
        cancel: Option<&crate::Cancel>,
    ) -> Result<Arc<service::PeerCtx>> {
        service::peer(&self.peers, &self.wake, pid, token, sock, cancel)
    }
}

/// The shm half of a context: the segment service.
struct ShmContext {
    shared: Arc<Shared>,
    service: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for ShmContext {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        kick(&self.shared.wake);
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

impl ProviderContext for ShmContext {
    fn create_qp(&self, setup: &QpSetup<'_>) -> Result<Box<dyn QpTransport>> {
        self.shared
            .registry
            .qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(setup.token, setup.seg.clone());
        Ok(Box::new(qp::ShmQp {
            shm: self.shared.clone(),
            link: OnceLock::new(),
            send: Mutex::new(qp::SendSide::default()),
            pending: AtomicUsize::new(0),
        }))
    }

    fn register_mr(&self, mr: &RegionInfo<'_>) -> Result<Option<u64>> {
        // Peers map provider memory through the segment service (user memory they reach with
        // process_vm_readv/writev).
        if let Some(seg) = mr.segment {
            self.shared
                .registry
                .mrs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((mr.index, mr.lkey), seg.clone());
        }
        Ok(None)
    }

    fn deregister_mr(&self, mr: &MrInner) {
        if mr.segment().is_some() {
            self.shared
                .registry
                .mrs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(mr.index, mr.lkey));
        }
    }

    fn check_user_access(&self, access: AccessFlags) -> Result<()> {
        if access.contains(AccessFlags::REMOTE_ATOMIC) {
            return Err(Error::arg(
                "REMOTE_ATOMIC on registered user memory: the shm provider performs atomics on \
                 shared mappings only; allocate the region with ProtectionDomain::alloc_mr",
            ));
        }
        Ok(())
    }
}
