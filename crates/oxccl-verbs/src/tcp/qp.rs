//! The tcp provider's half of a queue pair: the connection, set up in `connect`, and posting.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::{Conn, Shared, frame};
use crate::error::Result;
use crate::mr::MrInner;
use crate::provider::QpTransport;
use crate::qp::{Cause, EndpointAddr, QpEndpoint, QpInner};
use crate::types::*;

/// The tcp half of a queue pair.
pub(crate) struct TcpQp {
    pub(super) shared: Arc<Shared>,
    /// The connection, made with the queue pair so that it can accept the peer's.
    pub(super) conn: Arc<Conn>,
    /// Held while a batch is posted (concurrent posts to one queue pair go one batch at a time),
    /// and taken by the flush after the connection's requests are flushed.
    pub(super) send: Mutex<()>,
}

impl QpTransport for TcpQp {
    fn endpoint_addr(&self, qp: &QpInner) -> EndpointAddr {
        EndpointAddr::Tcp {
            addr: super::advertised(&self.shared),
            qp_token: qp.token,
            nsocks: self.conn.wanted(),
        }
    }

    fn connect(&self, qp: &QpInner, remote: &QpEndpoint) -> std::result::Result<(), String> {
        let EndpointAddr::Tcp {
            addr,
            qp_token,
            nsocks,
        } = &remote.addr
        else {
            return Err("not a tcp endpoint address".into());
        };
        if *qp_token == qp.token {
            return Err("a queue pair cannot connect to itself".into());
        }
        let sa: std::net::SocketAddr = addr.parse().map_err(|_| format!("bad address {addr:?}"))?;
        let conn = &self.conn;
        let count = (*nsocks)
            .clamp(1, frame::MAX_PARTS as u32)
            .min(conn.wanted());
        conn.set_remote(*qp_token, count, qp.cfg.timeout);
        // The side with the smaller token connects, unless the caller chose; the other one
        // accepts.
        let active = match qp.cfg.connect {
            ConnectRole::Auto => qp.token < *qp_token,
            ConnectRole::Active => true,
            ConnectRole::Passive => false,
        };
        if active {
            conn.connect_to(sa, qp.cfg.timeout)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
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
                    // Already failed and flushed: flushed too (or RetryExceeded, if this is the
                    // first request to learn that the peer is gone).
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
            self.conn.receive_posted();
        }
    }

    fn progress(&self, qp: &QpInner) {
        // The bytes move in the context's progress (`TcpContext::progress`); here only a
        // connection that failed is reported.
        if qp.is_connected() && self.conn.dead.load(Ordering::Acquire) {
            self.conn.report();
        }
    }

    fn peer_gone(&self, qp: &QpInner) -> bool {
        qp.is_connected() && self.conn.dead.load(Ordering::Acquire)
    }

    fn flush_sends(&self, qp: &QpInner) {
        if qp.is_connected() {
            // Requests in flight, oldest first. The connection stays up (as an InfiniBand peer,
            // the target is not told); it closes when the queue pair is destroyed.
            self.conn.flush_outstanding(
                || qp.send_flush_status(),
                |wr_id, opcode, status| qp.complete_send(wr_id, opcode, status, 0, true),
            );
        }
        // A batch being posted finishes first (its later requests find the connection flushed).
        drop(self.send.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn disconnect(&self, qp: &QpInner) {
        self.shared.forget(qp.token);
    }
}

impl TcpQp {
    /// Validates a send request's local buffers and hands it to the tcp connection.
    fn post_one(&self, qp: &QpInner, wr: &SendWr<'_>) -> Result<(), WcStatus> {
        let conn = &self.conn;
        let opcode = wr.op.wc_opcode();
        if qp.is_failed() {
            // In ERR nothing is validated or sent: flushed, in order behind what is in flight.
            return if conn.post_flushed(wr.wr_id, opcode) {
                Ok(())
            } else {
                Err(WcStatus::WorkRequestFlushed)
            };
        }
        match check_local(qp, wr) {
            Ok(local) if !conn.failing() => {
                conn.post(wr.wr_id, &wr.op, &local, wr.signaled, || qp.is_failed())
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
}

/// The validated local buffers of a tcp request.
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
    if total > frame::MAX_PAYLOAD as usize {
        return Err(WcStatus::LocalLengthError);
    }
    if matches!(wr.op, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
        && (local.len() != 1 || total != 8)
    {
        return Err(WcStatus::LocalLengthError);
    }
    Ok(local)
}
