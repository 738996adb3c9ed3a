//! The core of a reliable-connected queue pair ([`QpInner`]): the state machine, the receive
//! queue, errors and flushes, and the services a provider's transport calls.
//!
//! This is the part every provider shares. A queue pair owns a segment (`ring`): its state word
//! and its receive ring, which `post_recv` fills and completion queues harvest. The send side is
//! the provider's ([`QpTransport`], made by the context's provider with the queue pair):
//! `post_send` checks the state and hands the requests over; completions come back through
//! [`QpInner::complete_send`]. A failure moves the queue pair to ERR through
//! [`QpInner::set_error`], which asks the provider to flush its outstanding sends and flushes the
//! receive ring itself.
//!
//! The handle users hold (`QueuePair`) and its creation are the resource layer's
//! (`resource::qp`); it and the completion queues reach the core through [`QpHandleSide`],
//! which providers do not import. A provider uses only [`QpInner`]'s own methods (completions,
//! receives, errors) and its read-only fields.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::cq::CqCore;
use super::ctx::CtxInner;
use super::provider::{QpSetup, QpTransport};
use super::region::{Span, key_index};
use super::ring::{
    H_CAP, H_CLAIMED, H_MAGIC, H_POSTED, H_RECV_CQ, H_STATE, QP_MAGIC, S_BYTE_LEN, S_DONE,
    S_HAS_IMM, S_IMM, S_NUM_SGE, S_OPCODE, S_SGES, S_STATUS, S_WR_ID, claim, complete_slot,
    segment_len, slot_base, slot_sge,
};
use super::segment::Segment;
use super::sendq::{Keep, Spans};
use super::wr::{RecvWr, SendWr};
use crate::model::*;

/// The core of a queue pair, shared by its handle (`QueuePair`), the completion queues it is
/// attached to, and its provider's transport (which reaches it through the `Weak` of
/// [`QpSetup::qp`] and the `&QpInner` every [`QpTransport`] method gets).
pub(crate) struct QpInner {
    pub(crate) ctx: Arc<CtxInner>,
    /// The protection domain's id.
    pub(crate) pd: u64,
    pub(crate) qpn: u32,
    /// Secret token: names the queue pair to peers (shm segment service, tcp handshake).
    pub(crate) token: u64,
    pub(crate) cfg: QpConfig,
    seg: Arc<Segment>,
    cap: u64,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    /// The peer's endpoint, once connected (RTR or later).
    remote: OnceLock<QpEndpoint>,
    /// The provider's half: the send side.
    transport: Box<dyn QpTransport>,
    recv: Mutex<RecvSide>,
    /// The peer is gone; the first request of each queue to learn it reports `RetryExceeded`.
    gone: AtomicBool,
    gone_told_send: AtomicBool,
    gone_told_recv: AtomicBool,
    /// The last failure explained ([`QpInner::note`]).
    detail: Mutex<Option<String>>,
}

#[derive(Default)]
struct RecvSide {
    posted: u64,
    reaped: u64,
}

/// Why a queue pair fails as a whole.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// A request failed.
    Request,
    /// The peer is gone (died, destroyed its queue pair, never became ready).
    PeerGone,
    /// The user asked ([`QueuePair::to_error`](crate::QueuePair::to_error)).
    User,
}

impl QpInner {
    /// Makes the core of a new queue pair in RESET: its segment (state word and receive ring)
    /// and its provider's transport ([`ProviderContext::create_qp`]). `cfg` was checked by the
    /// caller (`ProtectionDomain::create_qp`), which attaches the result to its completion
    /// queues.
    ///
    /// [`ProviderContext::create_qp`]: super::ProviderContext::create_qp
    pub(crate) fn create(
        ctx: &Arc<CtxInner>,
        pd: u64,
        send_cq: &Arc<CqCore>,
        recv_cq: &Arc<CqCore>,
        cfg: &QpConfig,
    ) -> Result<Arc<QpInner>> {
        let cap = cfg.max_recv_wr as u64;
        let seg = Arc::new(Segment::create("oxccl-qp", segment_len(cap))?);
        let qpn = ctx.next_qpn.fetch_add(1, Ordering::Relaxed);
        // Never u64::MAX or u64::MAX - 1: the tcp engine's epoll keys for its own descriptors.
        let token = ctx.keys.next_u64()? >> 1;
        seg.atomic_u32(H_STATE)
            .store(QpState::Reset as u32, Ordering::Relaxed);
        seg.atomic_u32(H_RECV_CQ)
            .store(recv_cq.index, Ordering::Relaxed);
        seg.atomic_u32(H_CAP).store(cap as u32, Ordering::Relaxed);
        seg.atomic_u64(H_MAGIC).store(QP_MAGIC, Ordering::Release);
        let mut failed = None;
        let inner = Arc::new_cyclic(|me| {
            let setup = QpSetup {
                qp: me,
                token,
                seg: &seg,
                cfg,
            };
            let transport = ctx.ops.create_qp(&setup).unwrap_or_else(|e| {
                failed = Some(e);
                Box::new(Unmade)
            });
            QpInner {
                ctx: ctx.clone(),
                pd,
                qpn,
                token,
                cfg: cfg.clone(),
                seg: seg.clone(),
                cap,
                send_cq: send_cq.clone(),
                recv_cq: recv_cq.clone(),
                remote: OnceLock::new(),
                transport,
                recv: Mutex::new(RecvSide::default()),
                gone: AtomicBool::new(false),
                gone_told_send: AtomicBool::new(false),
                gone_told_recv: AtomicBool::new(false),
                detail: Mutex::new(None),
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(inner)
    }

    /// The current state.
    pub(crate) fn state(&self) -> QpState {
        QpState::from_u32(self.seg.atomic_u32(H_STATE).load(Ordering::Acquire))
    }

    /// Records a failure's explanation for
    /// [`QueuePair::error_detail`](crate::QueuePair::error_detail).
    pub(crate) fn note(&self, msg: String) {
        *self.detail.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
    }

    /// Whether the queue pair is connected (RTR or later, or failed after that).
    pub(crate) fn is_connected(&self) -> bool {
        self.remote.get().is_some()
    }

    /// Reports the completion of a send-queue request: queued on the send completion queue when
    /// signaled or failed (a failure moves the queue pair to ERR first, see
    /// [`QpInner::failing_before_completion`]).
    pub(crate) fn complete_send(
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

    /// Checks the SGE count of send request `i` of a batch.
    pub(crate) fn check_sges(&self, i: usize, wr: &SendWr<'_>) -> Result<()> {
        if wr.sg_list.len() > self.cfg.max_sge as usize {
            return Err(Error::arg(format!(
                "queue pair {}: send request #{i} (wr_id {}) has {} SGEs, max_sge is {}",
                self.qpn,
                wr.wr_id,
                wr.sg_list.len(),
                self.cfg.max_sge
            )));
        }
        Ok(())
    }

    /// How a send request is flushed (see [`QpInner::flush_status`]).
    pub(crate) fn send_flush_status(&self) -> WcStatus {
        self.flush_status(&self.gone_told_send)
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

    /// Moves to ERR and flushes: outstanding sends (the provider's) and unclaimed receives
    /// complete as flushed (the first of each as `RetryExceeded` when the peer is gone).
    pub(crate) fn set_error(&self, cause: Cause) {
        if cause == Cause::PeerGone
            && !self.gone.swap(true, Ordering::AcqRel)
            && let Some(note) = self.transport.gone_note(self)
        {
            self.note(note);
        }
        let prev = self
            .seg
            .atomic_u32(H_STATE)
            .swap(QpState::Err as u32, Ordering::SeqCst);
        if prev == QpState::Destroyed as u32 {
            self.set_state(QpState::Destroyed);
            return;
        }
        self.transport.flush_sends(self);
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

    /// Whether the queue pair is in ERR.
    pub(crate) fn is_failed(&self) -> bool {
        self.state() == QpState::Err
    }

    /// How long the peer may be unreachable ([`QpConfig::timeout`]).
    pub(crate) fn timeout(&self) -> std::time::Duration {
        self.cfg.timeout
    }

    /// The link to the peer failed (closed, reset, malformed message, never came up): the
    /// queue pair fails as "peer gone", with `why` in its error detail.
    pub(crate) fn connection_failed(&self, why: &str) {
        let remote = self
            .remote
            .get()
            .map(ToString::to_string)
            .unwrap_or_default();
        self.note(format!(
            "queue pair {}: connection to {remote}: {why}",
            self.qpn
        ));
        self.set_error(Cause::PeerGone);
    }

    /// A request failed (its error completion is already pushed): the queue pair fails.
    pub(crate) fn request_failed(&self) {
        #[cfg(test)]
        super::hooks::between_error_completion_and_flush();
        self.set_error(Cause::Request);
    }

    /// Whether a receive is posted and unclaimed (a delivery may claim it).
    pub(crate) fn recv_available(&self) -> bool {
        self.seg.atomic_u64(H_CLAIMED).load(Ordering::Acquire)
            < self.seg.atomic_u64(H_POSTED).load(Ordering::Acquire)
    }

    /// Claims our own next receive, for a delivery by the provider (none in ERR).
    pub(crate) fn claim_recv(&self) -> Option<u64> {
        if self.state() == QpState::Err {
            return None;
        }
        claim(&self.seg)
    }

    /// Completes our own receive `slot` and wakes the receive queue's waiters.
    pub(crate) fn complete_recv(
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

    /// The validated buffers of our own receive `slot`: spans, regions kept alive, total room
    /// (one or two buffers, almost always: nothing is allocated).
    pub(crate) fn recv_spans(&self, slot: u64) -> Result<(Spans, Keep, usize), WcStatus> {
        let seg = &self.seg;
        let base = slot_base(self.cap, slot);
        let n = (seg.atomic_u32(base + S_NUM_SGE).load(Ordering::Relaxed) as usize).min(MAX_SGE);
        let regions = self.ctx.regions.lock().unwrap_or_else(|e| e.into_inner());
        let mut spans = Spans::new();
        let mut keep = Keep::new();
        let mut room = 0usize;
        for j in 0..n {
            let (lkey, addr, len) = slot_sge(seg, base, j);
            let mr = regions
                .get(&key_index(lkey))
                .and_then(std::sync::Weak::upgrade)
                .filter(|m| m.lkey == lkey && lkey != 0)
                .ok_or(WcStatus::LocalProtectionError)?;
            let off = addr
                .checked_sub(mr.addr)
                .ok_or(WcStatus::LocalProtectionError)? as usize;
            let p = mr.local_ptr(self.pd, off, len, true)?;
            spans.push(Span(p, len));
            keep.push(mr);
            room += len;
        }
        Ok((spans, keep, room))
    }
}

/// The side of the core that only the resource layer uses: the queue pair's handle
/// (`resource::qp`: states, posting, connecting, teardown) and the completion queues it is
/// attached to (`resource::cq`: progress, harvesting). A provider never imports this trait
/// (`tests/layers.rs` checks), so that a transport reaches its queue pair only through the
/// services of [`QpInner`] itself: completing work, claiming receives, failing.
pub(crate) trait QpHandleSide {
    /// Sets the state.
    fn set_state(&self, s: QpState);
    /// Moves from one of `from` to `to`, or says why not.
    fn transition(&self, from: &[QpState], to: QpState) -> Result<()>;
    /// Whether the transport has requests waiting to be retried.
    fn has_pending(&self) -> bool;
    /// Checks the state and hands send requests to the transport.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()>;
    /// Drives the transport (called from polls and waits).
    fn progress(&self);
    /// Writes receive requests into the ring.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()>;
    /// Moves finished receive completions into `out`, in posting order.
    fn harvest(&self, out: &mut [WorkCompletion]) -> usize;
    /// The core of the receive completion queue.
    fn recv_cq(&self) -> &Arc<CqCore>;
    /// The provider's half.
    fn transport(&self) -> &dyn QpTransport;
    /// The peer's endpoint, set once when connecting.
    fn remote(&self) -> &OnceLock<QpEndpoint>;
    /// The last failure explained.
    fn detail(&self) -> Option<String>;
}

impl QpHandleSide for QpInner {
    /// Sets the state.
    fn set_state(&self, s: QpState) {
        self.seg
            .atomic_u32(H_STATE)
            .store(s as u32, Ordering::SeqCst);
    }

    /// Moves from one of `from` to `to`.
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

    fn has_pending(&self) -> bool {
        self.transport.has_pending()
    }

    /// Checks the state and hands the requests to the transport.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let state = self.state();
        if !matches!(state, QpState::Rts | QpState::Err) {
            return Err(Error::InvalidState {
                qp_num: self.qpn,
                op: "post_send",
                state,
            });
        }
        self.transport.post_send(self, wrs)
    }

    /// Retries pending requests, notices dead or destroyed peers. Called from polls and waits.
    fn progress(&self) {
        self.transport.progress(self);
    }

    /// Writes receive requests into the ring.
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
            let base = slot_base(self.cap, r.posted);
            let seg = &self.seg;
            seg.atomic_u64(base + S_WR_ID)
                .store(wr.wr_id, Ordering::Relaxed);
            seg.atomic_u32(base + S_NUM_SGE)
                .store(wr.sg_list.len() as u32, Ordering::Relaxed);
            for (j, g) in wr.sg_list.iter().enumerate() {
                let o = base + S_SGES + j * 24;
                // A deregistered region publishes lkey 0, which never validates.
                let mr = &g.mr.inner;
                let lkey = if mr.is_registered() && mr.pd == self.pd {
                    mr.lkey
                } else {
                    0
                };
                seg.atomic_u64(o).store(lkey, Ordering::Relaxed);
                seg.atomic_u64(o + 8)
                    .store(mr.addr.wrapping_add(g.offset as u64), Ordering::Relaxed);
                seg.atomic_u64(o + 16)
                    .store(g.len as u64, Ordering::Relaxed);
            }
            r.posted += 1;
            seg.atomic_u64(H_POSTED).store(r.posted, Ordering::Release);
            self.transport.recv_posted(self);
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

    /// Moves finished receive completions into `out`, in posting order. For the completion
    /// queue's poll.
    fn harvest(&self, out: &mut [WorkCompletion]) -> usize {
        let Ok(mut r) = self.recv.try_lock() else {
            return 0;
        };
        let mut n = 0;
        let mut failed = false;
        while n < out.len() && r.reaped < r.posted {
            let i = r.reaped;
            let base = slot_base(self.cap, i);
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
            } else if self.state() == QpState::Err && self.transport.peer_gone(self) {
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

    fn recv_cq(&self) -> &Arc<CqCore> {
        &self.recv_cq
    }

    fn transport(&self) -> &dyn QpTransport {
        &*self.transport
    }

    fn remote(&self) -> &OnceLock<QpEndpoint> {
        &self.remote
    }

    fn detail(&self) -> Option<String> {
        self.detail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The transport of a queue pair whose provider failed to make one: never used (the queue pair
/// is dropped before `create_qp` returns).
struct Unmade;

impl QpTransport for Unmade {
    fn endpoint_addr(&self, qp: &QpInner) -> EndpointAddr {
        EndpointAddr::Opaque {
            bytes: Vec::new(),
            qp_token: qp.token,
        }
    }
    fn connect(&self, _qp: &QpInner, _remote: &QpEndpoint) -> std::result::Result<(), String> {
        Err("the queue pair was never made".into())
    }
    fn post_send(&self, _qp: &QpInner, _wrs: &[SendWr<'_>]) -> Result<()> {
        Err(Error::arg("the queue pair was never made"))
    }
    fn progress(&self, _qp: &QpInner) {}
    fn peer_gone(&self, _qp: &QpInner) -> bool {
        false
    }
    fn flush_sends(&self, _qp: &QpInner) {}
}
