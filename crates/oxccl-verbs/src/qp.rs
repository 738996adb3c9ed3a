//! Reliable-connected queue pairs: the state machine, posting, and the shm transport.
//!
//! Each queue pair owns a shared segment that its peer maps:
//!
//! ```text
//! header: magic | state | recv CQ index | recv capacity ‖ posted ‖ claimed ‖ doorbell
//! slots:  [recv slot; capacity]  (wr_id, SGEs as (lkey, addr, len), and the completion fields)
//! ```
//!
//! The receive queue is a single-producer ring: the owner posts (writes a slot, then release-stores
//! `posted`). A peer that SENDs or WRITEs-with-immediate claims the next slot with a CAS on
//! `claimed`, copies the payload straight into the owner's buffers, fills in the completion and
//! release-stores the slot's `done` word: the owner's poll acquires it, so every byte the peer wrote
//! before (in any earlier request too) is visible (RC ordering). When the owner's queue pair fails it
//! claims the remaining slots itself and completes them as flushed; the CAS makes each slot
//! complete exactly once.
//!
//! A WRITE or READ is one copy by the initiator between its own buffer and its mapping of the
//! target's region, after validating rkey, bounds and access against the target's region table; then
//! a release-store of the doorbell. Atomics are CPU atomics on the mapped word. None of it makes a
//! syscall. Registered user memory (not shared) is reached with process_vm_readv/writev instead.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::context::{
    CtxInner, CtxTables, MAX_MR, MR_ACCESS, MR_ADDR, MR_KIND, MR_KIND_SEGMENT, MR_KIND_USER,
    MR_LEN, MR_LKEY, MR_RKEY, PeerCtx, ProtectionDomain, Provider, random_u64,
};
use crate::cq::{CompletionQueue, CqInner, notify_peer};
use crate::error::{Error, Result};
use crate::mr::{MrInner, key_index};
use crate::segment::{Segment, cma, copy_bytes};
use crate::tcp;
use crate::types::*;

const QP_MAGIC: u64 = 0x6f78_6363_6c5f_7170; // "oxccl_qp"
// Header words, one cache line per writer so owner and peer do not false-share: line 0 is
// read-mostly (written on state changes), `posted` is written by the owner, `claimed` by whoever
// claims a receive, the doorbell by the peer's WRITEs.
const H_MAGIC: usize = 0;
const H_STATE: usize = 8;
const H_RECV_CQ: usize = 12;
const H_CAP: usize = 16;
const H_POSTED: usize = 64;
const H_CLAIMED: usize = 128;
const H_DOORBELL: usize = 192;
const SLOTS: usize = 256;
const SLOT: usize = 512;
const S_DONE: usize = 8;
const S_WR_ID: usize = 16;
const S_NUM_SGE: usize = 24;
const S_STATUS: usize = 28;
const S_OPCODE: usize = 32;
const S_BYTE_LEN: usize = 36;
const S_IMM: usize = 40;
const S_HAS_IMM: usize = 44;
const S_SGES: usize = 64;

/// What a peer needs to connect to a queue pair: serialize it and hand it over out of band.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Provider of the queue pair; both ends must match.
    pub provider: Provider,
    /// Host identity (boot id) of the owner.
    pub host: String,
    /// Queue pair number (for messages and completions).
    pub qp_num: u32,
    /// Provider-specific address.
    pub addr: EndpointAddr,
}

/// The provider-specific part of an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EndpointAddr {
    /// A shared-memory queue pair.
    Shm {
        /// Owner's process id.
        pid: u32,
        /// Owner context's secret token.
        ctx_token: u64,
        /// Abstract Unix socket of the owner's segment service.
        socket: String,
        /// Secret token of the queue pair's segment.
        qp_token: u64,
    },
    /// A tcp queue pair.
    Tcp {
        /// `IP:port` of the owner context's listener.
        addr: String,
        /// Secret token naming the queue pair in the connection handshake.
        qp_token: u64,
    },
}

impl std::fmt::Display for QpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.addr {
            EndpointAddr::Shm { pid, .. } => {
                write!(f, "{} qp {} of pid {pid}", self.provider, self.qp_num)
            }
            EndpointAddr::Tcp { addr, .. } => {
                write!(f, "{} qp {} at {addr}", self.provider, self.qp_num)
            }
        }
    }
}

/// A reliable-connected queue pair (`ibv_qp` of type RC).
///
/// Walk it RESET → INIT → RTR → RTS with [`QueuePair::connect`] (or step by step); any failed
/// request moves it to ERR, after which every outstanding and later request completes with
/// `WorkRequestFlushed`. Dropping it destroys it; the peer's requests then fail with
/// `RetryExceeded`.
pub struct QueuePair {
    inner: Arc<QpInner>,
}

pub(crate) struct QpInner {
    ctx: Arc<CtxInner>,
    pd: u64,
    qpn: u32,
    token: u64,
    cfg: QpConfig,
    seg: Arc<Segment>,
    cap: u64,
    send_cq: Arc<CqInner>,
    pub(crate) recv_cq: Arc<CqInner>,
    link: OnceLock<Link>,
    /// The tcp connection (tcp contexts), created with the queue pair so that it can accept.
    tcp_conn: Option<Arc<tcp::Conn>>,
    send: Mutex<SendSide>,
    recv: Mutex<RecvSide>,
    pending: AtomicUsize,
    /// The peer is gone; the first request of each queue to learn it reports `RetryExceeded`.
    gone: AtomicBool,
    gone_told_send: AtomicBool,
    gone_told_recv: AtomicBool,
    detail: Mutex<Option<String>>,
}

/// How a connected queue pair reaches its peer.
enum Link {
    Shm(ShmLink),
    Tcp(Arc<tcp::Conn>, QpEndpoint),
}

impl Link {
    fn remote(&self) -> &QpEndpoint {
        match self {
            Link::Shm(l) => &l.remote,
            Link::Tcp(_, r) => r,
        }
    }
}

struct ShmLink {
    peer: Arc<PeerCtx>,
    seg: Segment,
    cap: u64,
    recv_cq: u32,
    remote: QpEndpoint,
}

#[derive(Default)]
struct SendSide {
    pending: VecDeque<PendingWr>,
    writes: u64,
    mr_cache: Option<(u32, u64, Arc<Segment>)>,
}

#[derive(Default)]
struct RecvSide {
    posted: u64,
    reaped: u64,
}

struct PendingWr {
    wr_id: u64,
    op: WrOp,
    sges: Vec<(Arc<MrInner>, usize, usize)>,
    signaled: bool,
    deadline: Option<Instant>,
    why: NotReady,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NotReady {
    /// The target has no receive posted.
    Rnr,
    /// The target queue pair is not yet ready to receive.
    Peer,
}

enum Outcome {
    Done(WcStatus, u32),
    NotReady(NotReady),
}

/// Why a queue pair fails as a whole.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cause {
    Request,
    PeerGone,
    User,
}

trait Sges {
    fn count(&self) -> usize;
    fn get(&self, i: usize) -> (&MrInner, usize, usize);
}

impl Sges for [Sge<'_>] {
    fn count(&self) -> usize {
        self.len()
    }
    fn get(&self, i: usize) -> (&MrInner, usize, usize) {
        (&self[i].mr.inner, self[i].offset, self[i].len)
    }
}

impl Sges for [(Arc<MrInner>, usize, usize)] {
    fn count(&self) -> usize {
        self.len()
    }
    fn get(&self, i: usize) -> (&MrInner, usize, usize) {
        (&self[i].0, self[i].1, self[i].2)
    }
}

/// Where a validated remote access lands.
#[derive(Clone, Copy)]
enum Target {
    Mapped(*mut u8),
    User { pid: u32, addr: u64 },
}

impl ProtectionDomain {
    /// Creates a reliable-connected queue pair (`ibv_create_qp`) in state RESET.
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        cfg: &QpConfig,
    ) -> Result<QueuePair> {
        let ctx = self.ctx.inner.clone();
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.inner.ctx, &ctx) {
                return Err(Error::arg("completion queue belongs to another context"));
            }
        }
        if cfg.max_sge as usize > MAX_SGE || cfg.max_sge == 0 {
            return Err(Error::arg(format!(
                "max_sge {} outside 1..={MAX_SGE}",
                cfg.max_sge
            )));
        }
        if cfg.max_recv_wr == 0 || cfg.max_recv_wr > 1 << 16 || cfg.max_send_wr == 0 {
            return Err(Error::arg(format!(
                "queue depths out of range: max_send_wr {} (>= 1), max_recv_wr {} (1..=65536)",
                cfg.max_send_wr, cfg.max_recv_wr
            )));
        }
        let cap = cfg.max_recv_wr as u64;
        let seg = Arc::new(Segment::create("oxccl-qp", SLOTS + SLOT * cap as usize)?);
        let qpn = ctx.next_qpn.fetch_add(1, Ordering::Relaxed);
        // Never u64::MAX or u64::MAX - 1: the tcp engine's epoll keys for its own descriptors.
        let token = random_u64() >> 1;
        seg.atomic_u32(H_STATE)
            .store(QpState::Reset as u32, Ordering::Relaxed);
        seg.atomic_u32(H_RECV_CQ)
            .store(recv_cq.inner.index, Ordering::Relaxed);
        seg.atomic_u32(H_CAP).store(cap as u32, Ordering::Relaxed);
        seg.atomic_u64(H_MAGIC).store(QP_MAGIC, Ordering::Release);
        ctx.registry
            .qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token, seg.clone());
        let rnr_us = if cfg.rnr_retry >= 7 {
            0
        } else {
            (cfg.rnr_timer * (cfg.rnr_retry as u32 + 1))
                .as_micros()
                .max(1) as u64
        };
        let inner = Arc::new_cyclic(|me| QpInner {
            tcp_conn: ctx
                .tcp
                .as_ref()
                .map(|e| e.shared().conn(me.clone(), token, rnr_us)),
            ctx,
            pd: self.id,
            qpn,
            token,
            cfg: cfg.clone(),
            seg,
            cap,
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
            link: OnceLock::new(),
            send: Mutex::new(SendSide::default()),
            recv: Mutex::new(RecvSide::default()),
            pending: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
            gone_told_send: AtomicBool::new(false),
            gone_told_recv: AtomicBool::new(false),
            detail: Mutex::new(None),
        });
        send_cq.inner.attach(inner.clone());
        recv_cq.inner.attach(inner.clone());
        Ok(QueuePair { inner })
    }
}

impl QueuePair {
    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.inner.state()
    }

    /// The endpoint a peer connects to.
    pub fn endpoint(&self) -> QpEndpoint {
        let ctx = &self.inner.ctx;
        let addr = match &ctx.tcp {
            Some(engine) => EndpointAddr::Tcp {
                addr: tcp::advertised(engine.shared()),
                qp_token: self.inner.token,
            },
            None => EndpointAddr::Shm {
                pid: ctx.pid,
                ctx_token: ctx.token,
                socket: ctx.sock_name.clone(),
                qp_token: self.inner.token,
            },
        };
        QpEndpoint {
            provider: ctx.provider,
            host: ctx.host.clone(),
            qp_num: self.inner.qpn,
            addr,
        }
    }

    /// The endpoint this queue pair is connected to, once in RTR or later.
    pub fn remote(&self) -> Option<&QpEndpoint> {
        self.inner.link.get().map(Link::remote)
    }

    /// A description of the last failure the kernel explained (for example why a
    /// process_vm_writev was refused), if any.
    pub fn error_detail(&self) -> Option<String> {
        self.inner
            .detail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// RESET → INIT: receives may now be posted.
    pub fn to_init(&self) -> Result<()> {
        self.inner
            .transition(&[QpState::Reset, QpState::Init], QpState::Init)
    }

    /// INIT → RTR: connects to `remote` (maps its segments, watches its process).
    pub fn to_rtr(&self, remote: &QpEndpoint) -> Result<()> {
        let qp = &self.inner;
        let state = qp.state();
        if state != QpState::Init {
            return Err(Error::InvalidTransition {
                qp_num: qp.qpn,
                from: state,
                to: QpState::Rtr,
            });
        }
        let fail = |reason: String| Error::Connect {
            qp_num: qp.qpn,
            peer: remote.to_string(),
            reason,
        };
        if remote.provider != qp.ctx.provider {
            return Err(fail(format!(
                "provider mismatch: local {}, remote {}",
                qp.ctx.provider, remote.provider
            )));
        }
        let link = match &remote.addr {
            EndpointAddr::Shm {
                pid,
                ctx_token,
                socket,
                qp_token,
            } => {
                if remote.host != qp.ctx.host {
                    return Err(fail(format!(
                        "the peer is on another host (boot id {} vs ours {}); shm reaches only \
                         this host",
                        remote.host, qp.ctx.host
                    )));
                }
                let peer = qp
                    .ctx
                    .peer(*pid, *ctx_token, socket)
                    .map_err(|e| fail(e.to_string()))?;
                let seg = peer
                    .qp_segment(*qp_token)
                    .map_err(|e| fail(e.to_string()))?;
                if seg.atomic_u64(H_MAGIC).load(Ordering::Acquire) != QP_MAGIC {
                    return Err(fail("the peer segment is not a queue pair".into()));
                }
                let cap = seg.atomic_u32(H_CAP).load(Ordering::Relaxed) as u64;
                if cap == 0 || SLOTS + SLOT * cap as usize > seg.len() {
                    return Err(fail(format!(
                        "peer queue pair reports a bad capacity {cap}"
                    )));
                }
                let recv_cq = seg.atomic_u32(H_RECV_CQ).load(Ordering::Relaxed);
                Link::Shm(ShmLink {
                    peer,
                    seg,
                    cap,
                    recv_cq,
                    remote: remote.clone(),
                })
            }
            EndpointAddr::Tcp { addr, qp_token } => {
                let engine = qp
                    .ctx
                    .tcp
                    .as_ref()
                    .ok_or_else(|| fail("no tcp engine".into()))?;
                if *qp_token == qp.token {
                    return Err(fail("a queue pair cannot connect to itself".into()));
                }
                let sa: std::net::SocketAddr = addr
                    .parse()
                    .map_err(|_| fail(format!("bad address {addr:?}")))?;
                let _ = engine;
                let conn = qp
                    .tcp_conn
                    .clone()
                    .ok_or_else(|| fail("no tcp connection".into()))?;
                conn.set_remote(*qp_token, qp.cfg.timeout);
                // The side with the smaller token connects, unless the caller chose; the
                // other one accepts.
                let active = match qp.cfg.connect {
                    ConnectRole::Auto => qp.token < *qp_token,
                    ConnectRole::Active => true,
                    ConnectRole::Passive => false,
                };
                if active {
                    conn.connect_to(sa, qp.cfg.timeout)
                        .map_err(|e| fail(e.to_string()))?;
                }
                Link::Tcp(conn, remote.clone())
            }
        };
        if qp.link.set(link).is_err() {
            return Err(fail("already connected".into()));
        }
        qp.set_state(QpState::Rtr);
        Ok(())
    }

    /// RTR → RTS: requests may now be posted.
    pub fn to_rts(&self) -> Result<()> {
        self.inner
            .transition(&[QpState::Rtr, QpState::Rts], QpState::Rts)
    }

    /// Walks RESET → INIT → RTR → RTS towards `remote`.
    pub fn connect(&self, remote: &QpEndpoint) -> Result<()> {
        if self.state() == QpState::Reset {
            self.to_init()?;
        }
        self.to_rtr(remote)?;
        self.to_rts()
    }

    /// Moves the queue pair to ERR: every outstanding request completes with `WorkRequestFlushed`.
    pub fn to_error(&self) {
        self.inner.set_error(Cause::User);
    }

    /// Tears the connection down as a cut cable or an exiting process would: this queue pair
    /// moves to ERR (outstanding requests are flushed, then it reads as destroyed) and the
    /// peer's fails too, as "peer gone". Unlike [`QueuePair::to_error`], which the peer does
    /// not notice (as in InfiniBand). For fault injection and tests.
    pub fn disconnect(&self) {
        self.inner.set_error(Cause::User);
        self.inner.set_state(QpState::Destroyed);
        if let Some(engine) = &self.inner.ctx.tcp {
            engine.shared().forget(self.inner.token);
        }
    }

    /// Posts send-queue requests (`ibv_post_send`). Errors name the request (its index and
    /// `wr_id`) that could not be posted; requests before it were posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.inner.post_send(wrs)
    }

    /// Posts receive requests (`ibv_post_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.qpn)
            .field("state", &self.state())
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let qp = &self.inner;
        qp.set_state(QpState::Destroyed);
        if let Some(engine) = &qp.ctx.tcp {
            engine.shared().forget(qp.token);
        }
        qp.ctx
            .registry
            .qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qp.token);
        qp.send_cq.detach(qp);
        qp.recv_cq.detach(qp);
    }
}

impl QpInner {
    fn state(&self) -> QpState {
        QpState::from_u32(self.seg.atomic_u32(H_STATE).load(Ordering::Acquire))
    }

    fn set_state(&self, s: QpState) {
        self.seg
            .atomic_u32(H_STATE)
            .store(s as u32, Ordering::SeqCst);
    }

    fn transition(&self, from: &[QpState], to: QpState) -> Result<()> {
        let state = self.state();
        if !from.contains(&state) {
            return Err(Error::InvalidTransition {
                qp_num: self.qpn,
                from: state,
                to,
            });
        }
        self.set_state(to);
        Ok(())
    }

    pub(crate) fn has_pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed) > 0
    }

    fn note(&self, msg: String) {
        *self.detail.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
    }

    fn complete_send(&self, wr_id: u64, op: &WrOp, status: WcStatus, len: u32, signaled: bool) {
        if signaled || status != WcStatus::Success {
            self.failing_before_completion(status);
            self.send_cq.push(WorkCompletion {
                wr_id,
                status,
                opcode: op.wc_opcode(),
                byte_len: len,
                imm: None,
                qp_num: self.qpn,
            });
        }
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let state = self.state();
        if !matches!(state, QpState::Rts | QpState::Err) {
            return Err(Error::InvalidState {
                qp_num: self.qpn,
                op: "post_send",
                state,
            });
        }
        let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.cfg.max_sge as usize {
                return Err(Error::arg(format!(
                    "queue pair {}: send request #{i} (wr_id {}) has {} SGEs, max_sge is {}",
                    self.qpn,
                    wr.wr_id,
                    wr.sg_list.len(),
                    self.cfg.max_sge
                )));
            }
            if s.pending.len() >= self.cfg.max_send_wr as usize {
                return Err(Error::QueueFull {
                    qp_num: self.qpn,
                    queue: "send",
                    depth: self.cfg.max_send_wr,
                });
            }
            let link = match (self.state(), self.link.get()) {
                (QpState::Rts | QpState::Err, Some(Link::Tcp(conn, _))) => {
                    match self.post_tcp(conn, wr) {
                        Ok(()) => {}
                        Err(WcStatus::WorkRequestFlushed) => {
                            // Already failed and flushed: flushed too (or RetryExceeded, if this
                            // is the first request to learn that the peer is gone).
                            let status = self.flush_status(&self.gone_told_send);
                            self.complete_send(wr.wr_id, &wr.op, status, 0, true);
                        }
                        Err(status) => {
                            drop(s);
                            self.complete_send(wr.wr_id, &wr.op, status, 0, true);
                            self.set_error(Cause::Request);
                            s = self.send.lock().unwrap_or_else(|e| e.into_inner());
                        }
                    }
                    continue;
                }
                (QpState::Rts, Some(Link::Shm(link))) => link,
                _ => {
                    let status = self.flush_status(&self.gone_told_send);
                    self.complete_send(wr.wr_id, &wr.op, status, 0, true);
                    continue;
                }
            };
            if link.peer.is_dead() {
                self.pending_push(&mut s, wr, NotReady::Peer);
                drop(s);
                self.set_error(Cause::PeerGone);
                s = self.send.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            if !s.pending.is_empty() {
                self.pending_push(&mut s, wr, NotReady::Peer);
                continue;
            }
            match self.exec(&mut s, link, &wr.op, wr.sg_list) {
                Outcome::Done(status, len) => {
                    self.complete_send(wr.wr_id, &wr.op, status, len, wr.signaled);
                    if status != WcStatus::Success {
                        drop(s);
                        self.set_error(if status == WcStatus::RetryExceeded {
                            Cause::PeerGone
                        } else {
                            Cause::Request
                        });
                        s = self.send.lock().unwrap_or_else(|e| e.into_inner());
                    }
                }
                Outcome::NotReady(why) => self.pending_push(&mut s, wr, why),
            }
        }
        drop(s);
        if self.has_pending() {
            self.progress();
        }
        Ok(())
    }

    fn pending_push(&self, s: &mut SendSide, wr: &SendWr<'_>, why: NotReady) {
        s.pending.push_back(PendingWr {
            wr_id: wr.wr_id,
            op: wr.op,
            sges: wr
                .sg_list
                .iter()
                .map(|g| (g.mr.inner.clone(), g.offset, g.len))
                .collect(),
            signaled: wr.signaled,
            deadline: None,
            why,
        });
        self.pending.store(s.pending.len(), Ordering::Relaxed);
    }

    /// Retries pending requests, notices dead or destroyed peers. Called from polls and waits.
    pub(crate) fn progress(&self) {
        let link = match self.link.get() {
            Some(Link::Shm(link)) => link,
            Some(Link::Tcp(conn, _)) => {
                if conn.dead.load(Ordering::Acquire) {
                    conn.report();
                }
                return;
            }
            None => return,
        };
        let state = self.state();
        if state == QpState::Err {
            return;
        }
        let peer_state = QpState::from_u32(link.seg.atomic_u32(H_STATE).load(Ordering::Acquire));
        if peer_state == QpState::Destroyed || link.peer.is_dead() {
            self.set_error(Cause::PeerGone);
            return;
        }
        if !self.has_pending() {
            return;
        }
        let Ok(mut s) = self.send.try_lock() else {
            return;
        };
        let mut failed = None;
        while let Some(mut p) = s.pending.pop_front() {
            let outcome = self.exec(&mut s, link, &p.op, &p.sges[..]);
            match outcome {
                Outcome::Done(status, len) => {
                    self.complete_send(p.wr_id, &p.op, status, len, p.signaled);
                    if status != WcStatus::Success {
                        failed = Some(status);
                        break;
                    }
                }
                Outcome::NotReady(why) => {
                    let now = Instant::now();
                    if p.deadline.is_none() || p.why != why {
                        p.why = why;
                        p.deadline = match why {
                            NotReady::Rnr if self.cfg.rnr_retry >= 7 => None,
                            NotReady::Rnr => {
                                Some(now + self.cfg.rnr_timer * (self.cfg.rnr_retry as u32 + 1))
                            }
                            NotReady::Peer => Some(now + self.cfg.timeout),
                        };
                        if why == NotReady::Rnr && self.cfg.rnr_retry >= 7 {
                            p.deadline = None;
                        }
                    }
                    if p.deadline.is_some_and(|d| now >= d) {
                        let status = match why {
                            NotReady::Rnr => WcStatus::RnrRetryExceeded,
                            NotReady::Peer => WcStatus::RetryExceeded,
                        };
                        self.complete_send(p.wr_id, &p.op, status, 0, true);
                        failed = Some(status);
                    } else {
                        s.pending.push_front(p);
                    }
                    break;
                }
            }
        }
        self.pending.store(s.pending.len(), Ordering::Relaxed);
        drop(s);
        if let Some(status) = failed {
            self.set_error(if status == WcStatus::RetryExceeded {
                Cause::PeerGone
            } else {
                Cause::Request
            });
        }
    }

    /// How a request is flushed: `RetryExceeded` for the first one of a queue after the peer
    /// went away (so its waiter learns why), `WorkRequestFlushed` otherwise.
    fn flush_status(&self, told: &AtomicBool) -> WcStatus {
        if self.gone.load(Ordering::Acquire) && !told.swap(true, Ordering::AcqRel) {
            WcStatus::RetryExceeded
        } else {
            WcStatus::WorkRequestFlushed
        }
    }

    /// An error completion is about to become visible: the queue pair reads ERR first, so that
    /// a poller that sees the completion also sees ERR (as in InfiniBand, where the QP is in
    /// ERR when its error completion is generated). [`QpInner::set_error`], called after the
    /// completion is pushed, then flushes the rest; a destroyed queue pair stays destroyed.
    /// A flushed request changes nothing: it is flushed because the queue pair is failing,
    /// and the failure itself (a peer found gone, which makes the next flushed request
    /// `RetryExceeded`) is `set_error`'s to record.
    fn failing_before_completion(&self, status: WcStatus) {
        if matches!(status, WcStatus::Success | WcStatus::WorkRequestFlushed) {
            return;
        }
        let _ =
            self.seg
                .atomic_u32(H_STATE)
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| {
                    (s != QpState::Destroyed as u32 && s != QpState::Err as u32)
                        .then_some(QpState::Err as u32)
                });
    }

    /// Moves to ERR and flushes: pending sends and unclaimed receives complete as flushed (the
    /// first of each as `RetryExceeded` when the peer is gone).
    fn set_error(&self, cause: Cause) {
        if cause == Cause::PeerGone
            && !self.gone.swap(true, Ordering::AcqRel)
            && let Some(Link::Shm(link)) = self.link.get()
        {
            let why = if link.peer.is_dead() {
                "its process exited or closed its context"
            } else {
                "it destroyed its queue pair or never became ready"
            };
            self.note(format!(
                "queue pair {}: peer {} is gone: {why}",
                self.qpn, link.remote
            ));
        }
        let prev = self
            .seg
            .atomic_u32(H_STATE)
            .swap(QpState::Err as u32, Ordering::SeqCst);
        if prev == QpState::Destroyed as u32 {
            self.set_state(QpState::Destroyed);
            return;
        }
        if let Some(Link::Tcp(conn, _)) = self.link.get() {
            // Requests in flight, oldest first. The connection stays up (as an InfiniBand peer,
            // the target is not told); it closes when the queue pair is destroyed.
            conn.flush_outstanding(
                || self.flush_status(&self.gone_told_send),
                |wr_id, opcode, status| self.tcp_complete(wr_id, opcode, status, 0, true),
            );
        }
        {
            let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
            while let Some(p) = s.pending.pop_front() {
                let status = self.flush_status(&self.gone_told_send);
                self.complete_send(p.wr_id, &p.op, status, 0, true);
            }
            self.pending.store(0, Ordering::Relaxed);
        }
        // Claim every receive the peer has not claimed; complete them here.
        let claimed = self.seg.atomic_u64(H_CLAIMED);
        let posted = self.seg.atomic_u64(H_POSTED);
        loop {
            let c = claimed.load(Ordering::Acquire);
            let p = posted.load(Ordering::Acquire);
            if c >= p {
                break;
            }
            if claimed
                .compare_exchange(c, p, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                for i in c..p {
                    let status = self.flush_status(&self.gone_told_recv);
                    complete_slot(&self.seg, self.cap, i, status, WcOpcode::Recv, 0, None);
                }
                break;
            }
        }
        self.recv_cq.notify();
        self.send_cq.notify();
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let state = self.state();
        if state == QpState::Reset || state == QpState::Destroyed {
            return Err(Error::InvalidState {
                qp_num: self.qpn,
                op: "post_recv",
                state,
            });
        }
        let mut r = self.recv.lock().unwrap_or_else(|e| e.into_inner());
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.cfg.max_sge as usize {
                return Err(Error::arg(format!(
                    "queue pair {}: receive request #{i} (wr_id {}) has {} SGEs, max_sge is {}",
                    self.qpn,
                    wr.wr_id,
                    wr.sg_list.len(),
                    self.cfg.max_sge
                )));
            }
            if r.posted - r.reaped >= self.cap {
                return Err(Error::QueueFull {
                    qp_num: self.qpn,
                    queue: "receive",
                    depth: self.cfg.max_recv_wr,
                });
            }
            let base = SLOTS + (r.posted % self.cap) as usize * SLOT;
            let seg = &self.seg;
            seg.atomic_u64(base + S_WR_ID)
                .store(wr.wr_id, Ordering::Relaxed);
            seg.atomic_u32(base + S_NUM_SGE)
                .store(wr.sg_list.len() as u32, Ordering::Relaxed);
            for (j, g) in wr.sg_list.iter().enumerate() {
                let o = base + S_SGES + j * 24;
                // A deregistered region publishes lkey 0, which never validates.
                let lkey = if g.mr.is_registered() && g.mr.inner.pd == self.pd {
                    g.mr.lkey()
                } else {
                    0
                };
                seg.atomic_u64(o).store(lkey, Ordering::Relaxed);
                seg.atomic_u64(o + 8)
                    .store(g.mr.addr().wrapping_add(g.offset as u64), Ordering::Relaxed);
                seg.atomic_u64(o + 16)
                    .store(g.len as u64, Ordering::Relaxed);
            }
            r.posted += 1;
            seg.atomic_u64(H_POSTED).store(r.posted, Ordering::Release);
            if let Some(Link::Tcp(conn, _)) = self.link.get() {
                conn.receive_posted();
            }
            if self.state() == QpState::Err {
                // Nobody will claim it: flush it ourselves (the CAS keeps it exactly once).
                let claimed = seg.atomic_u64(H_CLAIMED);
                let i = r.posted - 1;
                if claimed
                    .compare_exchange(i, i + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    complete_slot(
                        seg,
                        self.cap,
                        i,
                        WcStatus::WorkRequestFlushed,
                        WcOpcode::Recv,
                        0,
                        None,
                    );
                    self.recv_cq.notify();
                }
            }
        }
        Ok(())
    }

    /// Moves finished receive completions into `out`, in posting order.
    pub(crate) fn harvest(&self, out: &mut [WorkCompletion]) -> usize {
        let Ok(mut r) = self.recv.try_lock() else {
            return 0;
        };
        let mut n = 0;
        let mut failed = false;
        while n < out.len() && r.reaped < r.posted {
            let i = r.reaped;
            let base = SLOTS + (i % self.cap) as usize * SLOT;
            let seg = &self.seg;
            let done = seg.atomic_u64(base + S_DONE).load(Ordering::Acquire);
            let status;
            if done == i + 1 {
                status =
                    WcStatus::from_u32(seg.atomic_u32(base + S_STATUS).load(Ordering::Relaxed))
                        .unwrap_or(WcStatus::RemoteOperationError);
                let imm = (seg.atomic_u32(base + S_HAS_IMM).load(Ordering::Relaxed) != 0)
                    .then(|| seg.atomic_u32(base + S_IMM).load(Ordering::Relaxed));
                out[n] = WorkCompletion {
                    wr_id: seg.atomic_u64(base + S_WR_ID).load(Ordering::Relaxed),
                    status,
                    opcode: WcOpcode::from_u32(
                        seg.atomic_u32(base + S_OPCODE).load(Ordering::Relaxed),
                    )
                    .unwrap_or(WcOpcode::Recv),
                    byte_len: seg.atomic_u32(base + S_BYTE_LEN).load(Ordering::Relaxed),
                    imm,
                    qp_num: self.qpn,
                };
            } else if self.state() == QpState::Err && self.peer_gone() {
                // Claimed by a peer that died before completing it.
                status = self.flush_status(&self.gone_told_recv);
                out[n] = WorkCompletion {
                    wr_id: seg.atomic_u64(base + S_WR_ID).load(Ordering::Relaxed),
                    status,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                    qp_num: self.qpn,
                };
            } else {
                break;
            }
            failed |= status != WcStatus::Success && status != WcStatus::WorkRequestFlushed;
            r.reaped += 1;
            n += 1;
        }
        drop(r);
        if failed && self.state() != QpState::Err {
            self.set_error(Cause::Request);
        }
        n
    }

    /// Whether the peer is known to be gone.
    fn peer_gone(&self) -> bool {
        match self.link.get() {
            Some(Link::Shm(l)) => l.peer.dead.load(Ordering::Acquire),
            Some(Link::Tcp(c, _)) => c.dead.load(Ordering::Acquire),
            None => false,
        }
    }

    /// Validates a send request's local buffers and hands it to the tcp connection.
    fn post_tcp(&self, conn: &tcp::Conn, wr: &SendWr<'_>) -> Result<(), WcStatus> {
        let opcode = wr.op.wc_opcode();
        if self.is_failed() {
            // In ERR nothing is validated or sent: flushed, in order behind what is in flight.
            return if conn.post_flushed(wr.wr_id, opcode) {
                Ok(())
            } else {
                Err(WcStatus::WorkRequestFlushed)
            };
        }
        match self.check_tcp(wr) {
            Ok(local) if !conn.failing() => {
                conn.post(wr.wr_id, &wr.op, &local, wr.signaled, || self.is_failed())
            }
            Ok(_) => {
                // An earlier request failed locally and waits for those before it: this one is
                // flushed after it (or now, if the queue pair failed meanwhile).
                if conn.post_failed(wr.wr_id, opcode, WcStatus::WorkRequestFlushed) {
                    Ok(())
                } else {
                    Err(WcStatus::WorkRequestFlushed)
                }
            }
            Err(status) if conn.post_failed(wr.wr_id, opcode, status) => Ok(()),
            Err(status) => Err(status),
        }
    }

    /// The validated local buffers of a tcp request.
    #[allow(clippy::type_complexity)]
    fn check_tcp(&self, wr: &SendWr<'_>) -> Result<Vec<(Arc<MrInner>, *mut u8, usize)>, WcStatus> {
        let scatter = matches!(
            wr.op,
            WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
        );
        let mut local = Vec::with_capacity(wr.sg_list.len());
        let mut total = 0usize;
        for g in wr.sg_list {
            let p = g.mr.inner.local_ptr(self.pd, g.offset, g.len, scatter)?;
            local.push((g.mr.inner.clone(), p, g.len));
            total += g.len;
        }
        if total > tcp::frame::MAX_PAYLOAD as usize {
            return Err(WcStatus::LocalLengthError);
        }
        if matches!(wr.op, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
            && (local.len() != 1 || total != 8)
        {
            return Err(WcStatus::LocalLengthError);
        }
        Ok(local)
    }

    /// Whether the queue pair is in ERR.
    pub(crate) fn is_failed(&self) -> bool {
        self.state() == QpState::Err
    }

    pub(crate) fn timeout(&self) -> std::time::Duration {
        self.cfg.timeout
    }

    /// The tcp connection failed (closed, reset, malformed frame, never attached).
    pub(crate) fn tcp_failed(&self, why: &str) {
        let remote = self
            .link
            .get()
            .map(|l| l.remote().to_string())
            .unwrap_or_default();
        self.note(format!(
            "queue pair {}: connection to {remote}: {why}",
            self.qpn
        ));
        self.set_error(Cause::PeerGone);
    }

    /// A request was NAKed: the queue pair fails.
    pub(crate) fn tcp_request_failed(&self) {
        #[cfg(test)]
        crate::tests::hooks::between_error_completion_and_flush();
        self.set_error(Cause::Request);
    }

    /// Reports the completion of a tcp request.
    pub(crate) fn tcp_complete(
        &self,
        wr_id: u64,
        opcode: WcOpcode,
        status: WcStatus,
        len: u32,
        signaled: bool,
    ) {
        if signaled || status != WcStatus::Success {
            self.failing_before_completion(status);
            self.send_cq.push(WorkCompletion {
                wr_id,
                status,
                opcode,
                byte_len: len,
                imm: None,
                qp_num: self.qpn,
            });
        }
    }

    /// Whether a receive is posted and unclaimed (tcp target side).
    pub(crate) fn recv_available(&self) -> bool {
        self.seg.atomic_u64(H_CLAIMED).load(Ordering::Acquire)
            < self.seg.atomic_u64(H_POSTED).load(Ordering::Acquire)
    }

    /// Claims our own next receive (tcp target side).
    pub(crate) fn claim_local_recv(&self) -> Option<u64> {
        if self.state() == QpState::Err {
            return None;
        }
        claim(&self.seg)
    }

    /// Completes our own receive `slot` and wakes the receive queue's waiters.
    pub(crate) fn complete_local_recv(
        &self,
        slot: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
        imm: Option<u32>,
    ) {
        complete_slot(&self.seg, self.cap, slot, status, opcode, len, imm);
        self.recv_cq.notify();
    }

    /// The validated buffers of our own receive `slot`: spans, regions kept alive, total room.
    #[allow(clippy::type_complexity)]
    pub(crate) fn local_recv_spans(
        &self,
        slot: u64,
        regions: &Mutex<std::collections::HashMap<u32, std::sync::Weak<MrInner>>>,
    ) -> Result<(Vec<tcp::Span>, Vec<Arc<MrInner>>, usize), WcStatus> {
        let seg = &self.seg;
        let base = SLOTS + (slot % self.cap) as usize * SLOT;
        let n = (seg.atomic_u32(base + S_NUM_SGE).load(Ordering::Relaxed) as usize).min(MAX_SGE);
        let regions = regions.lock().unwrap_or_else(|e| e.into_inner());
        let mut spans = Vec::with_capacity(n);
        let mut keep = Vec::with_capacity(n);
        let mut room = 0usize;
        for j in 0..n {
            let o = base + S_SGES + j * 24;
            let lkey = seg.atomic_u64(o).load(Ordering::Relaxed);
            let addr = seg.atomic_u64(o + 8).load(Ordering::Relaxed);
            let len = seg.atomic_u64(o + 16).load(Ordering::Relaxed) as usize;
            let mr = regions
                .get(&key_index(lkey))
                .and_then(std::sync::Weak::upgrade)
                .filter(|m| m.lkey == lkey && lkey != 0)
                .ok_or(WcStatus::LocalProtectionError)?;
            let off = addr
                .checked_sub(mr.addr)
                .ok_or(WcStatus::LocalProtectionError)? as usize;
            let p = mr.local_ptr(self.pd, off, len, true)?;
            spans.push(tcp::Span(p, len));
            keep.push(mr);
            room += len;
        }
        Ok((spans, keep, room))
    }

    /// Executes one request against the peer. Validates everything before touching memory.
    fn exec<S: Sges + ?Sized>(
        &self,
        s: &mut SendSide,
        link: &ShmLink,
        op: &WrOp,
        sg: &S,
    ) -> Outcome {
        use Outcome::Done;
        match QpState::from_u32(link.seg.atomic_u32(H_STATE).load(Ordering::Acquire)) {
            QpState::Err | QpState::Destroyed => return Done(WcStatus::RetryExceeded, 0),
            QpState::Reset | QpState::Init => return Outcome::NotReady(NotReady::Peer),
            QpState::Rtr | QpState::Rts => {}
        }
        if link.peer.dead.load(Ordering::Acquire) {
            return Done(WcStatus::RetryExceeded, 0);
        }
        // Local buffers first: a local error must not have remote effects.
        let scatter = matches!(
            op,
            WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
        );
        let mut local = [(std::ptr::null_mut::<u8>(), 0usize); MAX_SGE];
        let mut total = 0usize;
        for (i, slot) in local.iter_mut().enumerate().take(sg.count()) {
            let (mr, off, len) = sg.get(i);
            match mr.local_ptr(self.pd, off, len, scatter) {
                Ok(p) => *slot = (p, len),
                Err(st) => return Done(st, 0),
            }
            total += len;
        }
        let local = &local[..sg.count()];
        if total > u32::MAX as usize {
            return Done(WcStatus::LocalLengthError, 0);
        }
        match *op {
            WrOp::Write { remote } => {
                match self.resolve(s, link, remote, total, AccessFlags::REMOTE_WRITE) {
                    Ok(t) => match self.put(link, &t, local) {
                        Ok(()) => {
                            s.writes += 1;
                            link.seg
                                .atomic_u64(H_DOORBELL)
                                .store(s.writes, Ordering::Release);
                            Done(WcStatus::Success, total as u32)
                        }
                        Err(st) => Done(st, 0),
                    },
                    Err(st) => Done(st, 0),
                }
            }
            WrOp::WriteWithImm { remote, imm } => {
                let t = match self.resolve(s, link, remote, total, AccessFlags::REMOTE_WRITE) {
                    Ok(t) => t,
                    Err(st) => return Done(st, 0),
                };
                let Some(slot) = claim(&link.seg) else {
                    return Outcome::NotReady(NotReady::Rnr);
                };
                let status = self.put(link, &t, local);
                let (recv_status, op_status) = match status {
                    Ok(()) => (WcStatus::Success, WcStatus::Success),
                    Err(st) => (WcStatus::WorkRequestFlushed, st),
                };
                complete_slot(
                    &link.seg,
                    link.cap,
                    slot,
                    recv_status,
                    WcOpcode::RecvRdmaWithImm,
                    total as u32,
                    Some(imm),
                );
                notify_peer(&link.peer, link.recv_cq);
                Done(op_status, total as u32)
            }
            WrOp::Send | WrOp::SendWithImm { .. } => {
                let imm = match *op {
                    WrOp::SendWithImm { imm } => Some(imm),
                    _ => None,
                };
                let Some(slot) = claim(&link.seg) else {
                    return Outcome::NotReady(NotReady::Rnr);
                };
                let (recv_status, op_status) = self.deliver(s, link, slot, local, total);
                complete_slot(
                    &link.seg,
                    link.cap,
                    slot,
                    recv_status,
                    WcOpcode::Recv,
                    total as u32,
                    imm,
                );
                notify_peer(&link.peer, link.recv_cq);
                Done(op_status, total as u32)
            }
            WrOp::Read { remote } => {
                match self.resolve(s, link, remote, total, AccessFlags::REMOTE_READ) {
                    Ok(Target::Mapped(mut src)) => {
                        for &(p, len) in local {
                            // SAFETY: `src..src+total` lies inside the peer's mapped region (checked
                            // by `resolve`); `p` is a validated local range.
                            unsafe {
                                copy_bytes(src, p, len);
                                src = src.add(len);
                            }
                        }
                        Done(WcStatus::Success, total as u32)
                    }
                    Ok(Target::User { pid, addr }) => match cma::read(pid, addr, local) {
                        Ok(()) => Done(WcStatus::Success, total as u32),
                        Err(e) => Done(self.cma_failed("process_vm_readv", pid, e), 0),
                    },
                    Err(st) => Done(st, 0),
                }
            }
            WrOp::CompareSwap { remote, .. } | WrOp::FetchAdd { remote, .. } => {
                if local.len() != 1 || total != 8 {
                    return Done(WcStatus::LocalLengthError, 0);
                }
                if remote.addr % 8 != 0 {
                    return Done(WcStatus::RemoteInvalidRequest, 0);
                }
                let word = match self.resolve(s, link, remote, 8, AccessFlags::REMOTE_ATOMIC) {
                    Ok(Target::Mapped(p)) => p,
                    Ok(Target::User { .. }) => return Done(WcStatus::RemoteAccessError, 0),
                    Err(st) => return Done(st, 0),
                };
                // SAFETY: `word` is 8-byte aligned (the region base is page aligned and the
                // address is a multiple of 8) and inside the peer's mapping; AtomicU64 is the
                // right way to share it with the peer's own atomics.
                let word = unsafe { &*(word as *const std::sync::atomic::AtomicU64) };
                let old = match *op {
                    WrOp::CompareSwap { compare, swap, .. } => {
                        match word.compare_exchange(
                            compare,
                            swap,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        ) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                    WrOp::FetchAdd { add, .. } => word.fetch_add(add, Ordering::SeqCst),
                    _ => unreachable!("atomic op"),
                };
                let bytes = old.to_ne_bytes();
                // SAFETY: the local SGE is 8 writable bytes (validated above).
                unsafe { copy_bytes(bytes.as_ptr(), local[0].0, 8) };
                Done(WcStatus::Success, 8)
            }
        }
    }

    /// The mapping of the peer's provider region `index` (identified by its `lkey`), from the
    /// one-entry cache of this queue pair or the peer's mapping table.
    fn peer_segment(
        &self,
        s: &mut SendSide,
        link: &ShmLink,
        index: u32,
        lkey: u64,
    ) -> Option<Arc<Segment>> {
        if let Some((i, k, seg)) = &s.mr_cache
            && *i == index
            && *k == lkey
        {
            return Some(seg.clone());
        }
        match link.peer.mr_segment(index, lkey) {
            Ok(seg) => {
                s.mr_cache = Some((index, lkey, seg.clone()));
                Some(seg)
            }
            Err(e) => {
                self.note(format!("mapping the peer's region failed: {e}"));
                None
            }
        }
    }

    /// Validates a remote access against the peer's region table.
    fn resolve(
        &self,
        s: &mut SendSide,
        link: &ShmLink,
        remote: RemoteAddr,
        len: usize,
        need: AccessFlags,
    ) -> Result<Target, WcStatus> {
        let deny = Err(WcStatus::RemoteAccessError);
        let index = key_index(remote.rkey);
        if index as usize >= MAX_MR || remote.rkey == 0 {
            return deny;
        }
        let p = &link.peer;
        if p.seg.mr_u64(index, MR_RKEY).load(Ordering::Acquire) != remote.rkey {
            return deny;
        }
        let access =
            AccessFlags::from_bits_truncate(p.seg.mr_u32(index, MR_ACCESS).load(Ordering::Relaxed));
        let base = p.seg.mr_u64(index, MR_ADDR).load(Ordering::Relaxed);
        let mlen = p.seg.mr_u64(index, MR_LEN).load(Ordering::Relaxed);
        let kind = p.seg.mr_u32(index, MR_KIND).load(Ordering::Relaxed);
        let lkey = p.seg.mr_u64(index, MR_LKEY).load(Ordering::Relaxed);
        let Some(off) = remote.addr.checked_sub(base) else {
            return deny;
        };
        if !access.contains(need) || off.checked_add(len as u64).is_none_or(|e| e > mlen) {
            return deny;
        }
        let target = match kind {
            MR_KIND_SEGMENT => {
                let Some(seg) = self.peer_segment(s, link, index, lkey) else {
                    return deny;
                };
                if (off as usize).saturating_add(len) > seg.len() {
                    return deny;
                }
                // SAFETY: `off + len` lies within the mapping (checked just above).
                Target::Mapped(unsafe { seg.as_ptr().add(off as usize) })
            }
            MR_KIND_USER => Target::User {
                pid: p.pid,
                addr: remote.addr,
            },
            _ => return deny,
        };
        // The entry could have been deregistered while we read it.
        if p.seg.mr_u64(index, MR_RKEY).load(Ordering::Acquire) != remote.rkey {
            return deny;
        }
        Ok(target)
    }

    /// Gathers the local buffers into the target.
    fn put(&self, _link: &ShmLink, t: &Target, local: &[(*mut u8, usize)]) -> Result<(), WcStatus> {
        match *t {
            Target::Mapped(mut dst) => {
                for &(p, len) in local {
                    // SAFETY: the target range was validated by `resolve` for the total length;
                    // `p` is a validated local range; they are distinct mappings.
                    unsafe {
                        copy_bytes(p, dst, len);
                        dst = dst.add(len);
                    }
                }
                Ok(())
            }
            Target::User { pid, addr } => cma::write(pid, addr, local)
                .map_err(|e| self.cma_failed("process_vm_writev", pid, e)),
        }
    }

    fn cma_failed(&self, call: &str, pid: u32, e: std::io::Error) -> WcStatus {
        let (status, why) = match e.raw_os_error() {
            Some(libc::ESRCH) => (
                WcStatus::RetryExceeded,
                "the peer process is gone".to_string(),
            ),
            Some(libc::EPERM) => (
                WcStatus::RemoteAccessError,
                "the kernel refused cross-process memory access (ptrace access check: \
                 kernel.yama.ptrace_scope, differing credentials or a seccomp filter); \
                 use provider memory (alloc_mr) or allow ptrace access"
                    .to_string(),
            ),
            Some(libc::ENOSYS) => (
                WcStatus::RemoteAccessError,
                "the kernel lacks process_vm_readv/writev (CONFIG_CROSS_MEMORY_ATTACH)".to_string(),
            ),
            _ => (
                WcStatus::RemoteAccessError,
                "the target range is not mapped in the peer".to_string(),
            ),
        };
        self.note(format!("{call} to pid {pid} failed ({e}): {why}"));
        status
    }

    /// Scatters a SEND into the claimed receive `slot`. Returns (receiver status, sender status).
    fn deliver(
        &self,
        s: &mut SendSide,
        link: &ShmLink,
        slot: u64,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> (WcStatus, WcStatus) {
        let seg = &link.seg;
        let base = SLOTS + (slot % link.cap) as usize * SLOT;
        let n = (seg.atomic_u32(base + S_NUM_SGE).load(Ordering::Relaxed) as usize).min(MAX_SGE);
        let p = &link.peer;
        let mut dst = [(Target::Mapped(std::ptr::null_mut()), 0usize); MAX_SGE];
        let mut room = 0usize;
        for (j, d) in dst.iter_mut().enumerate().take(n) {
            let o = base + S_SGES + j * 24;
            let lkey = seg.atomic_u64(o).load(Ordering::Relaxed);
            let addr = seg.atomic_u64(o + 8).load(Ordering::Relaxed);
            let len = seg.atomic_u64(o + 16).load(Ordering::Relaxed) as usize;
            let index = key_index(lkey);
            let bad = (
                WcStatus::LocalProtectionError,
                WcStatus::RemoteOperationError,
            );
            if lkey == 0
                || index as usize >= MAX_MR
                || p.seg.mr_u64(index, MR_LKEY).load(Ordering::Acquire) != lkey
            {
                return bad;
            }
            let access = AccessFlags::from_bits_truncate(
                p.seg.mr_u32(index, MR_ACCESS).load(Ordering::Relaxed),
            );
            let mbase = p.seg.mr_u64(index, MR_ADDR).load(Ordering::Relaxed);
            let mlen = p.seg.mr_u64(index, MR_LEN).load(Ordering::Relaxed);
            let Some(off) = addr.checked_sub(mbase) else {
                return bad;
            };
            if !access.contains(AccessFlags::LOCAL_WRITE)
                || off.checked_add(len as u64).is_none_or(|e| e > mlen)
            {
                return bad;
            }
            *d = match p.seg.mr_u32(index, MR_KIND).load(Ordering::Relaxed) {
                MR_KIND_SEGMENT => match self.peer_segment(s, link, index, lkey) {
                    // SAFETY: `off + len <= mlen <= mapping length`.
                    Some(m) if (off as usize + len) <= m.len() => {
                        (Target::Mapped(unsafe { m.as_ptr().add(off as usize) }), len)
                    }
                    _ => return bad,
                },
                MR_KIND_USER => (Target::User { pid: p.pid, addr }, len),
                _ => return bad,
            };
            room += len;
        }
        if total > room {
            return (WcStatus::LocalLengthError, WcStatus::RemoteInvalidRequest);
        }
        // Copy, walking source and destination lists together.
        let (mut si, mut soff) = (0usize, 0usize);
        for (t, dlen) in dst.iter().take(n) {
            let mut doff = 0usize;
            while doff < *dlen && si < local.len() {
                let (sp, slen) = local[si];
                let k = (slen - soff).min(dlen - doff);
                if k > 0 {
                    // SAFETY: `sp+soff..+k` is inside a validated local SGE.
                    let src = unsafe { sp.add(soff) };
                    match *t {
                        // SAFETY: `d+doff..+k` is inside a validated receive SGE mapping.
                        Target::Mapped(d) => unsafe { copy_bytes(src, d.add(doff), k) },
                        Target::User { pid, addr } => {
                            if let Err(e) = cma::write(pid, addr + doff as u64, &[(src, k)]) {
                                let st = self.cma_failed("process_vm_writev", pid, e);
                                return (WcStatus::LocalProtectionError, st);
                            }
                        }
                    }
                }
                soff += k;
                doff += k;
                if soff == slen {
                    si += 1;
                    soff = 0;
                }
            }
        }
        (WcStatus::Success, WcStatus::Success)
    }
}

/// Claims the peer's next posted receive, if there is one.
fn claim(seg: &Segment) -> Option<u64> {
    let claimed = seg.atomic_u64(H_CLAIMED);
    let posted = seg.atomic_u64(H_POSTED);
    loop {
        let c = claimed.load(Ordering::Acquire);
        if c >= posted.load(Ordering::Acquire) {
            return None;
        }
        if claimed
            .compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Some(c);
        }
    }
}

/// Fills in the completion of receive `i` and publishes it.
fn complete_slot(
    seg: &Segment,
    cap: u64,
    i: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
) {
    let base = SLOTS + (i % cap) as usize * SLOT;
    seg.atomic_u32(base + S_STATUS)
        .store(status as u32, Ordering::Relaxed);
    seg.atomic_u32(base + S_OPCODE)
        .store(opcode as u32, Ordering::Relaxed);
    seg.atomic_u32(base + S_BYTE_LEN)
        .store(byte_len, Ordering::Relaxed);
    seg.atomic_u32(base + S_IMM)
        .store(imm.unwrap_or(0), Ordering::Relaxed);
    seg.atomic_u32(base + S_HAS_IMM)
        .store(imm.is_some() as u32, Ordering::Relaxed);
    seg.atomic_u64(base + S_DONE)
        .store(i + 1, Ordering::Release);
}
