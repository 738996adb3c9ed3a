//! The tcp provider's half of a queue pair: the connection, set up in `connect`, and posting.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::{Conn, Shared, frame};
use crate::contract::sendq::{self, Local, SendLink, SendQueue};
use crate::contract::{QpInner, QpTransport, SendWr};
use crate::model::*;

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
            conn.connect_to(sa, qp.cfg.timeout, qp.cfg.cancel.as_ref())
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn post_send(&self, qp: &QpInner, wrs: &[SendWr<'_>]) -> Result<()> {
        sendq::post_send(qp, &self.send, self, wrs)
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
        sendq::flush_sends(qp, &self.send, self);
    }

    fn disconnect(&self, qp: &QpInner) {
        self.shared.forget(qp.token);
    }

    fn destroy(&self, qp: &QpInner) {
        if qp.is_connected() {
            self.conn.flush_before_close(super::CLOSE_FLUSH);
        }
        self.shared.forget(qp.token);
    }
}

impl SendLink for TcpQp {
    fn sendq(&self) -> &SendQueue {
        &self.conn.sendq
    }

    fn dead(&self) -> bool {
        self.conn.dead.load(Ordering::Acquire)
    }

    fn max_len(&self) -> usize {
        frame::MAX_PAYLOAD as usize
    }

    fn post(&self, qp: &QpInner, wr: &SendWr<'_>, local: Local<'_>) -> Result<(), WcStatus> {
        self.conn
            .send_request(wr.wr_id, &wr.op, local, wr.signaled, || qp.is_failed())
    }

    fn failed_behind(&self, seq: u64) {
        // The requests before it may be unsignaled (the target would not acknowledge them):
        // ask for the ACK that lets it complete.
        self.conn.queue(
            0,
            super::tx::TxFrame::header(&frame::Header::new(frame::Opcode::AckReq, seq, 0)),
        );
    }

    fn drop_unsent(&self) {
        self.conn.drop_unsent();
    }

    fn cork(&self) {
        self.conn.cork();
    }

    fn uncork(&self) {
        self.conn.uncork();
    }
}
