//! The shm provider's queue pairs: the data path, straight into the peer's mapped memory.
//!
//! `post_send` executes a request at once when the peer is ready and nothing waits before it:
//! validate the local buffers, validate the remote range against the peer's region table, copy,
//! release-store (see the parent module). Otherwise the request waits in the pending queue, which
//! [`ShmQp::progress`] retries on every poll.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::Shared;
use super::service::{PeerCtx, notify_peer};
use crate::contract::ctx::{
    MAX_MR, MR_ACCESS, MR_ADDR, MR_KIND, MR_KIND_SEGMENT, MR_KIND_USER, MR_LEN, MR_LKEY, MR_RKEY,
};
use crate::contract::ring::{
    H_CAP, H_DOORBELL, H_MAGIC, H_RECV_CQ, H_STATE, QP_MAGIC, S_NUM_SGE, claim, complete_slot,
    segment_len, slot_base, slot_sge,
};
use crate::contract::{
    Cause, CtxTables, Mapped, MrInner, QpInner, QpTransport, Segment, SendWr, Sge, TableWriting,
    cma, copy_bytes, key_index,
};
use crate::model::*;

/// The shm half of a queue pair.
pub(crate) struct ShmQp {
    pub(super) shm: Arc<Shared>,
    /// The peer, once connected.
    pub(super) link: OnceLock<ShmLink>,
    pub(super) send: Mutex<SendSide>,
    /// Length of the pending queue, read without the lock.
    pub(super) pending: AtomicUsize,
}

/// A connected queue pair's view of its peer.
pub(super) struct ShmLink {
    peer: Arc<PeerCtx>,
    /// The peer queue pair's segment, mapped.
    seg: Segment,
    cap: u64,
    /// The peer's receive completion queue (its doorbell index).
    recv_cq: u32,
    remote: QpEndpoint,
}

/// The send side: requests waiting to be retried, and the data path's caches.
#[derive(Default)]
pub(super) struct SendSide {
    pending: VecDeque<PendingWr>,
    writes: u64,
    mr_cache: Option<(u32, u64, Arc<Segment>)>,
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

impl QpTransport for ShmQp {
    fn endpoint_addr(&self, qp: &QpInner) -> EndpointAddr {
        EndpointAddr::Shm {
            pid: qp.ctx.pid,
            ctx_token: self.shm.token,
            socket: self.shm.sock_name.clone(),
            qp_token: qp.token,
        }
    }

    fn connect(&self, qp: &QpInner, remote: &QpEndpoint) -> std::result::Result<(), String> {
        let EndpointAddr::Shm {
            pid,
            ctx_token,
            socket,
            qp_token,
        } = &remote.addr
        else {
            return Err("not a shm endpoint address".into());
        };
        if remote.host != qp.ctx.host {
            return Err(format!(
                "the peer is on another host (boot id {} vs ours {}); shm reaches only this host",
                remote.host, qp.ctx.host
            ));
        }
        let peer = self
            .shm
            .peer(*pid, *ctx_token, socket, qp.cfg.cancel.as_ref())
            .map_err(|e| e.to_string())?;
        let seg = peer
            .qp_segment(*qp_token, qp.cfg.cancel.as_ref())
            .map_err(|e| e.to_string())?;
        if seg.atomic_u64(H_MAGIC).load(Ordering::Acquire) != QP_MAGIC {
            return Err("the peer segment is not a queue pair".into());
        }
        let cap = seg.atomic_u32(H_CAP).load(Ordering::Relaxed) as u64;
        if cap == 0 || segment_len(cap) > seg.len() {
            return Err(format!("peer queue pair reports a bad capacity {cap}"));
        }
        let recv_cq = seg.atomic_u32(H_RECV_CQ).load(Ordering::Relaxed);
        self.link
            .set(ShmLink {
                peer,
                seg,
                cap,
                recv_cq,
                remote: remote.clone(),
            })
            .map_err(|_| "already connected".to_string())
    }

    fn post_send(&self, qp: &QpInner, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
        for (i, wr) in wrs.iter().enumerate() {
            qp.check_sges(i, wr)?;
            if s.pending.len() >= qp.cfg.max_send_wr as usize {
                return Err(Error::QueueFull {
                    qp_num: qp.qpn,
                    queue: "send",
                    depth: qp.cfg.max_send_wr,
                });
            }
            let link = match (qp.state(), self.link.get()) {
                (QpState::Rts, Some(link)) => link,
                _ => {
                    let status = qp.send_flush_status();
                    qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, 0, true);
                    continue;
                }
            };
            if link.peer.is_dead() {
                self.pending_push(&mut s, wr, NotReady::Peer);
                drop(s);
                qp.set_error(Cause::PeerGone);
                s = self.send.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            if !s.pending.is_empty() {
                self.pending_push(&mut s, wr, NotReady::Peer);
                continue;
            }
            match self.exec(qp, &mut s, link, &wr.op, wr.sg_list) {
                Outcome::Done(status, len) => {
                    qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, len, wr.signaled);
                    if status != WcStatus::Success {
                        drop(s);
                        qp.set_error(if status == WcStatus::RetryExceeded {
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
            self.progress(qp);
        }
        Ok(())
    }

    /// Retries pending requests, notices dead or destroyed peers. Called from polls and waits.
    fn progress(&self, qp: &QpInner) {
        let Some(link) = self.link.get() else {
            return;
        };
        let state = qp.state();
        if state == QpState::Err {
            return;
        }
        let peer_state = QpState::from_u32(link.seg.atomic_u32(H_STATE).load(Ordering::Acquire));
        if peer_state == QpState::Destroyed || link.peer.is_dead() {
            qp.set_error(Cause::PeerGone);
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
            let outcome = self.exec(qp, &mut s, link, &p.op, &p.sges[..]);
            match outcome {
                Outcome::Done(status, len) => {
                    qp.complete_send(p.wr_id, p.op.wc_opcode(), status, len, p.signaled);
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
                            NotReady::Rnr if qp.cfg.rnr_retry >= 7 => None,
                            NotReady::Rnr => {
                                Some(now + qp.cfg.rnr_timer * (qp.cfg.rnr_retry as u32 + 1))
                            }
                            NotReady::Peer => Some(now + qp.cfg.timeout),
                        };
                        if why == NotReady::Rnr && qp.cfg.rnr_retry >= 7 {
                            p.deadline = None;
                        }
                    }
                    if p.deadline.is_some_and(|d| now >= d) {
                        let status = match why {
                            NotReady::Rnr => WcStatus::RnrRetryExceeded,
                            NotReady::Peer => WcStatus::RetryExceeded,
                        };
                        qp.complete_send(p.wr_id, p.op.wc_opcode(), status, 0, true);
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
            qp.set_error(if status == WcStatus::RetryExceeded {
                Cause::PeerGone
            } else {
                Cause::Request
            });
        }
    }

    fn has_pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed) > 0
    }

    fn peer_gone(&self, _qp: &QpInner) -> bool {
        self.link
            .get()
            .is_some_and(|l| l.peer.dead.load(Ordering::Acquire))
    }

    fn gone_note(&self, qp: &QpInner) -> Option<String> {
        let link = self.link.get()?;
        let why = if link.peer.is_dead() {
            "its process exited or closed its context"
        } else {
            "it destroyed its queue pair or never became ready"
        };
        Some(format!(
            "queue pair {}: peer {} is gone: {why}",
            qp.qpn, link.remote
        ))
    }

    fn map_remote(
        &self,
        qp: &QpInner,
        remote: RemoteAddr,
        len: usize,
        need: AccessFlags,
    ) -> Result<Option<Mapped>> {
        let refused = |detail: String| Error::RemoteAccess {
            qp_num: qp.qpn,
            detail,
        };
        let Some(link) = self.link.get() else {
            return Err(refused("not connected".into()));
        };
        let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
        match self.resolve(qp, &mut s, link, remote, len, need) {
            // `resolve` left the region's mapping in the one-entry cache.
            Ok(Target::Mapped(ptr)) => match &s.mr_cache {
                Some((_, _, seg)) => Ok(Some(Mapped {
                    _keep: seg.clone(),
                    ptr,
                    len,
                })),
                None => Err(refused("the peer's region is not mapped".into())),
            },
            // User memory: only process_vm_writev reaches it.
            Ok(Target::User { .. }) => Ok(None),
            Err(_) => Err(refused(format!(
                "{len} bytes at {:#x} with rkey {:#x} and {need:?} access: no such region of \
                 the peer grants that",
                remote.addr, remote.rkey
            ))),
        }
    }

    fn flush_sends(&self, qp: &QpInner) {
        let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(p) = s.pending.pop_front() {
            let status = qp.send_flush_status();
            qp.complete_send(p.wr_id, p.op.wc_opcode(), status, 0, true);
        }
        self.pending.store(0, Ordering::Relaxed);
    }

    fn destroy(&self, qp: &QpInner) {
        // Peers can no longer map it; those that did see it DESTROYED.
        self.shm
            .registry
            .qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qp.token);
    }
}

impl ShmQp {
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

    /// Executes one request against the peer. Validates everything before touching memory:
    /// the peer's state, the local buffers (a local error must not have remote effects), then
    /// the remote range (in the operation's own step below).
    fn exec<S: Sges + ?Sized>(
        &self,
        qp: &QpInner,
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
        let mut local = [(std::ptr::null_mut::<u8>(), 0usize); MAX_SGE];
        let total = match local_buffers(qp, op, sg, &mut local) {
            Ok(total) => total,
            Err(st) => return Done(st, 0),
        };
        let local = &local[..sg.count()];
        match *op {
            WrOp::Write { remote } => self.exec_write(qp, s, link, remote, local, total),
            WrOp::WriteWithImm { remote, imm } => {
                self.exec_write_imm(qp, s, link, remote, imm, local, total)
            }
            WrOp::Send => self.exec_send(qp, s, link, None, local, total),
            WrOp::SendWithImm { imm } => self.exec_send(qp, s, link, Some(imm), local, total),
            WrOp::Read { remote } => self.exec_read(qp, s, link, remote, local, total),
            WrOp::CompareSwap { remote, .. } | WrOp::FetchAdd { remote, .. } => {
                self.exec_atomic(qp, s, link, op, remote, local, total)
            }
        }
    }

    /// A WRITE: validate the remote range, copy, ring the peer queue pair's doorbell.
    fn exec_write(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        remote: RemoteAddr,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> Outcome {
        use Outcome::Done;
        // Announced before the checks, held until the copy is done: the target's
        // deregistration waits for it.
        let Some(_writing) = TableWriting::begin(&link.peer.seg, remote.rkey) else {
            return Done(WcStatus::RemoteAccessError, 0);
        };
        match self.resolve(qp, s, link, remote, total, AccessFlags::REMOTE_WRITE) {
            Ok(t) => match self.put(qp, &t, local) {
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

    /// A WRITE_WITH_IMM: validate the remote range, claim a receive of the peer, copy, complete
    /// the receive.
    #[allow(clippy::too_many_arguments)]
    fn exec_write_imm(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        remote: RemoteAddr,
        imm: u32,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> Outcome {
        use Outcome::Done;
        let Some(_writing) = TableWriting::begin(&link.peer.seg, remote.rkey) else {
            return Done(WcStatus::RemoteAccessError, 0);
        };
        let t = match self.resolve(qp, s, link, remote, total, AccessFlags::REMOTE_WRITE) {
            Ok(t) => t,
            Err(st) => return Done(st, 0),
        };
        let Some(slot) = claim(&link.seg) else {
            return Outcome::NotReady(NotReady::Rnr);
        };
        let status = self.put(qp, &t, local);
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

    /// A SEND (with `imm` or without): claim a receive of the peer, scatter into it, complete it.
    fn exec_send(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        imm: Option<u32>,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> Outcome {
        let Some(slot) = claim(&link.seg) else {
            return Outcome::NotReady(NotReady::Rnr);
        };
        let (recv_status, op_status) = self.deliver(qp, s, link, slot, local, total);
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
        Outcome::Done(op_status, total as u32)
    }

    /// A READ: validate the remote range, copy out of the peer's mapping (or with
    /// process_vm_readv from its user memory).
    fn exec_read(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        remote: RemoteAddr,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> Outcome {
        use Outcome::Done;
        match self.resolve(qp, s, link, remote, total, AccessFlags::REMOTE_READ) {
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
                Err(e) => Done(self.cma_failed(qp, "process_vm_readv", pid, e), 0),
            },
            Err(st) => Done(st, 0),
        }
    }

    /// A compare-and-swap or fetch-and-add: a CPU atomic on the peer's mapped word, the old
    /// value into the one 8-byte local buffer.
    #[allow(clippy::too_many_arguments)]
    fn exec_atomic(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        op: &WrOp,
        remote: RemoteAddr,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> Outcome {
        use Outcome::Done;
        if local.len() != 1 || total != 8 {
            return Done(WcStatus::LocalLengthError, 0);
        }
        if !remote.addr.is_multiple_of(8) {
            return Done(WcStatus::RemoteInvalidRequest, 0);
        }
        let word = match self.resolve(qp, s, link, remote, 8, AccessFlags::REMOTE_ATOMIC) {
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
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
            WrOp::FetchAdd { add, .. } => word.fetch_add(add, Ordering::SeqCst),
            _ => unreachable!("atomic op"),
        };
        let bytes = old.to_ne_bytes();
        // SAFETY: the local SGE is 8 writable bytes (validated in `local_buffers`).
        unsafe { copy_bytes(bytes.as_ptr(), local[0].0, 8) };
        Done(WcStatus::Success, 8)
    }

    /// The mapping of the peer's provider region `index` (identified by its `lkey`), from the
    /// one-entry cache of this queue pair or the peer's mapping table.
    fn peer_segment(
        &self,
        qp: &QpInner,
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
                qp.note(format!("mapping the peer's region failed: {e}"));
                None
            }
        }
    }

    /// Validates a remote access against the peer's region table.
    fn resolve(
        &self,
        qp: &QpInner,
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
                let Some(seg) = self.peer_segment(qp, s, link, index, lkey) else {
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
    fn put(&self, qp: &QpInner, t: &Target, local: &[(*mut u8, usize)]) -> Result<(), WcStatus> {
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
                .map_err(|e| self.cma_failed(qp, "process_vm_writev", pid, e)),
        }
    }

    fn cma_failed(&self, qp: &QpInner, call: &str, pid: u32, e: std::io::Error) -> WcStatus {
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
        qp.note(format!("{call} to pid {pid} failed ({e}): {why}"));
        status
    }

    /// Scatters a SEND into the claimed receive `slot`. Returns (receiver status, sender status).
    fn deliver(
        &self,
        qp: &QpInner,
        s: &mut SendSide,
        link: &ShmLink,
        slot: u64,
        local: &[(*mut u8, usize)],
        total: usize,
    ) -> (WcStatus, WcStatus) {
        let seg = &link.seg;
        let base = slot_base(link.cap, slot);
        let n = (seg.atomic_u32(base + S_NUM_SGE).load(Ordering::Relaxed) as usize).min(MAX_SGE);
        let p = &link.peer;
        let mut dst = [(Target::Mapped(std::ptr::null_mut()), 0usize); MAX_SGE];
        let mut room = 0usize;
        for (j, d) in dst.iter_mut().enumerate().take(n) {
            let (lkey, addr, len) = slot_sge(seg, base, j);
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
                MR_KIND_SEGMENT => match self.peer_segment(qp, s, link, index, lkey) {
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
                                let st = self.cma_failed(qp, "process_vm_writev", pid, e);
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

/// Validates the local buffers of a request (written into `local`, one per SGE) and returns
/// their total length. Scattered into (LOCAL_WRITE needed) for a READ or an atomic.
fn local_buffers<S: Sges + ?Sized>(
    qp: &QpInner,
    op: &WrOp,
    sg: &S,
    local: &mut [(*mut u8, usize); MAX_SGE],
) -> Result<usize, WcStatus> {
    let scatter = matches!(
        op,
        WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
    );
    let mut total = 0usize;
    for (i, slot) in local.iter_mut().enumerate().take(sg.count()) {
        let (mr, off, len) = sg.get(i);
        *slot = (mr.local_ptr(qp.pd, off, len, scatter)?, len);
        total += len;
    }
    if total > u32::MAX as usize {
        return Err(WcStatus::LocalLengthError);
    }
    Ok(total)
}
