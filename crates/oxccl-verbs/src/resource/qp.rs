//! Reliable-connected queue pairs, as users hold them: creating one in a protection domain,
//! walking its states, posting, mapping the peer's memory.
//!
//! The queue pair's core (state word, receive ring, errors and flushes, the services its
//! provider calls) is the contract's (`contract::QpInner`); [`QueuePair`] is its handle, and
//! attaches it to its completion queues.

use std::sync::Arc;

use super::context::ProtectionDomain;
use super::cq::{CompletionQueue, CqInner};
use super::mr::RemoteMapping;
use crate::contract::{Cause, QpHandleSide, QpInner, RecvWr, SendWr};
use crate::model::*;

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
            if !Arc::ptr_eq(&cq.inner.core.ctx, &ctx) {
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
        let inner = QpInner::create(&ctx, self.id, &send_cq.inner.core, &recv_cq.inner.core, cfg)?;
        send_cq.inner.attach(inner.clone());
        recv_cq.inner.attach(inner.clone());
        Ok(QueuePair {
            inner,
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
        })
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
    /// The completion queues it is attached to (detached when it is dropped).
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
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
        let qp = &self.inner;
        QpEndpoint {
            provider: qp.ctx.provider,
            host: qp.ctx.host.clone(),
            qp_num: qp.qpn,
            addr: qp.transport().endpoint_addr(qp),
        }
    }

    /// The endpoint this queue pair is connected to, once in RTR or later.
    pub fn remote(&self) -> Option<&QpEndpoint> {
        self.inner.remote().get()
    }

    /// A description of the last failure the kernel explained (for example why a
    /// process_vm_writev was refused), if any.
    pub fn error_detail(&self) -> Option<String> {
        self.inner.detail()
    }

    /// RESET → INIT: receives may now be posted.
    pub fn to_init(&self) -> Result<()> {
        self.inner
            .transition(&[QpState::Reset, QpState::Init], QpState::Init)
    }

    /// INIT → RTR: connects to `remote` (the provider reaches the peer: maps its segments and
    /// watches its process, or opens a connection).
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
        qp.transport().connect(qp, remote).map_err(fail)?;
        if qp.remote().set(remote.clone()).is_err() {
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
        self.inner.transport().disconnect(&self.inner);
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

    /// Maps the connected peer's memory at `remote` into this process, where the provider can
    /// (UCX's `ucp_rkey_ptr`): the shm provider maps its provider memory (`alloc_mr`); other
    /// providers, and user memory, give `Ok(None)`, and requests remain the way to reach it.
    /// The range is validated as a request's would be: an rkey, range or access (`need`) that
    /// does not match fails with [`Error::RemoteAccess`] and the queue pair stays as it is.
    /// Only in RTS. See [`RemoteMapping`] for what the mapping allows, and for how long.
    pub fn map_remote(
        &self,
        remote: RemoteBuffer,
        need: AccessFlags,
    ) -> Result<Option<RemoteMapping>> {
        let state = self.state();
        if state != QpState::Rts {
            return Err(Error::InvalidState {
                qp_num: self.inner.qpn,
                op: "map_remote",
                state,
            });
        }
        let Ok(len) = usize::try_from(remote.len) else {
            return Err(Error::arg(format!("{} bytes cannot be mapped", remote.len)));
        };
        let m = self
            .inner
            .transport()
            .map_remote(&self.inner, remote.at(0), len, need)?;
        Ok(m.map(RemoteMapping::new))
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
        qp.transport().destroy(qp);
        self.send_cq.detach(qp);
        self.recv_cq.detach(qp);
    }
}
