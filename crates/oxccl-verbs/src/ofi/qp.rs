//! The ofi provider's half of a queue pair: connecting (an address-vector entry) and posting.

use std::sync::{Arc, Mutex};

use super::Engine;
use super::link::{Link, Peer};
use crate::contract::sendq::{self, Local, SendLink, SendQueue};
use crate::contract::{QpInner, QpTransport, SendWr};
use crate::model::*;

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
        sendq::post_send(qp, &self.send, self, wrs)
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
        sendq::flush_sends(qp, &self.send, self);
    }

    fn disconnect(&self, _qp: &QpInner) {
        self.link.close(&self.engine);
    }
}

impl SendLink for OfiQp {
    fn sendq(&self) -> &SendQueue {
        &self.link.sendq
    }

    fn dead(&self) -> bool {
        self.link.dead.load(std::sync::atomic::Ordering::Acquire)
    }

    fn max_len(&self) -> usize {
        u32::MAX as usize
    }

    fn post(&self, qp: &QpInner, wr: &SendWr<'_>, local: Local<'_>) -> Result<(), WcStatus> {
        self.link
            .send_request(&self.engine, wr.wr_id, &wr.op, &local, wr.signaled, || {
                qp.is_failed()
            })
    }
}
