//! The ofi provider's half of a queue pair: connecting (an address-vector entry) and posting.

use std::sync::{Arc, Mutex};

use super::Engine;
use super::link::{Link, Peer};
use crate::error::Result;
use crate::mr::MrInner;
use crate::provider::QpTransport;
use crate::qp::{Cause, EndpointAddr, QpEndpoint, QpInner};
use crate::types::*;

/// The ofi half of a queue pair.
pub(crate) struct OfiQp {
    pub(super) engine: Arc<Engine>,
    pub(super) link: Arc<Link>,
    /// Held while a batch is posted (concurrent posts to one queue pair go one batch at a time),
    /// and taken by the flush after the link's requests are flushed.
    pub(super) send: Mutex<()>,
}

impl QpTransport for OfiQp {
    fn endpoint_addr(&self, qp: &QpInner) -> EndpointAddr {
        EndpointAddr::Opaque {
            bytes: self.engine.fab.name().to_vec(),
            qp_token: qp.token,
        }
    }

    fn connect(&self, qp: &QpInner, remote: &QpEndpoint) -> std::result::Result<(), String> {
        let EndpointAddr::Opaque { bytes, qp_token } = &remote.addr else {
            return Err("not an ofi endpoint address".into());
        };
        if *qp_token == qp.token {
            return Err("a queue pair cannot connect to itself".into());
        }
        let addr = self.engine.peer(bytes)?;
        self.link.set_peer(Peer {
            addr,
            qpn: remote.qp_num,
            token: *qp_token,
        })
    }

    fn post_send(&self, qp: &QpInner, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut s = self.send.lock().unwrap_or_else(|e| e.into_inner());
        for (i, wr) in wrs.iter().enumerate() {
            qp.check_sges(i, wr)?;
            if !(matches!(qp.state(), QpState::Rts | QpState::Err) && qp.is_connected()) {
                let status = qp.send_flush_status();
                qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, 0, true);
                continue;
            }
            match self.post_one(qp, wr) {
                Ok(()) => {}
                Err(WcStatus::WorkRequestFlushed) => {
                    let status = qp.send_flush_status();
                    qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, 0, true);
                }
                Err(status) => {
                    drop(s);
                    qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, 0, true);
                    qp.set_error(Cause::Request);
                    s = self.send.lock().unwrap_or_else(|e| e.into_inner());
                }
            }
        }
        Ok(())
    }

    fn recv_posted(&self, qp: &QpInner) {
        if qp.is_connected() {
            self.engine.kick();
        }
    }

    fn progress(&self, qp: &QpInner) {
        if qp.is_connected() && self.link.dead.load(std::sync::atomic::Ordering::Acquire) {
            self.link.report();
        }
    }

    fn peer_gone(&self, qp: &QpInner) -> bool {
        qp.is_connected() && self.link.dead.load(std::sync::atomic::Ordering::Acquire)
    }

    fn gone_note(&self, _qp: &QpInner) -> Option<String> {
        self.link.note()
    }

    fn flush_sends(&self, qp: &QpInner) {
        if qp.is_connected() {
            self.link.flush_outstanding(
                || qp.send_flush_status(),
                |wr_id, opcode, status| qp.complete_send(wr_id, opcode, status, 0, true),
            );
        }
        // A batch being posted finishes first (its later requests find the link flushed).
        drop(self.send.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn disconnect(&self, _qp: &QpInner) {
        self.link.close(&self.engine);
    }
}

impl OfiQp {
    /// Validates a send request's local buffers and hands it to the link.
    fn post_one(&self, qp: &QpInner, wr: &SendWr<'_>) -> Result<(), WcStatus> {
        let link = &self.link;
        let opcode = wr.op.wc_opcode();
        if qp.is_failed() {
            return if link.post_flushed(wr.wr_id, opcode) {
                Ok(())
            } else {
                Err(WcStatus::WorkRequestFlushed)
            };
        }
        match check_local(qp, wr) {
            Ok(local) if !link.failing() => {
                link.post(&self.engine, wr.wr_id, &wr.op, &local, wr.signaled, || {
                    qp.is_failed()
                })
            }
            Ok(_) => {
                if link.post_failed(wr.wr_id, opcode, WcStatus::WorkRequestFlushed) {
                    Ok(())
                } else {
                    Err(WcStatus::WorkRequestFlushed)
                }
            }
            Err(status) if link.post_failed(wr.wr_id, opcode, status) => Ok(()),
            Err(status) => Err(status),
        }
    }
}

/// The validated local buffers of a request.
#[allow(clippy::type_complexity)]
fn check_local(
    qp: &QpInner,
    wr: &SendWr<'_>,
) -> Result<Vec<(Arc<MrInner>, *mut u8, usize)>, WcStatus> {
    let scatter = matches!(
        wr.op,
        WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
    );
    let mut local = Vec::with_capacity(wr.sg_list.len());
    let mut total = 0usize;
    for g in wr.sg_list {
        let p = g.mr.inner.local_ptr(qp.pd, g.offset, g.len, scatter)?;
        local.push((g.mr.inner.clone(), p, g.len));
        total += g.len;
    }
    if total > u32::MAX as usize {
        return Err(WcStatus::LocalLengthError);
    }
    if matches!(wr.op, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
        && (local.len() != 1 || total != 8)
    {
        return Err(WcStatus::LocalLengthError);
    }
    Ok(local)
}
