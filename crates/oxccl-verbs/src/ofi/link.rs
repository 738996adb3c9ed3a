//! One queue pair's side of the protocol: as initiator (requests in flight, completed in order
//! from the target's answers) and as target (requests executed in sequence), plus liveness.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::wire::{HDR, Hdr, INLINE_MAX, Kind, Msg, Rsge, SGE_LEN};
use super::{Engine, Issue, Op, What};
use crate::contract::sendq::{Keep, Outstanding, SendQueue, Spans};
use crate::contract::{MrInner, QpInner, QpSetup, Span, key_index};
use crate::model::{AccessFlags, QpState, WcOpcode, WcStatus, WrOp};

/// Requests whose data a target moves at once, per queue pair (WRITEs to disjoint ranges).
const MAX_ACTIVE: usize = 8;

/// The connected peer.
pub(crate) struct Peer {
    /// Its context's entry in the address vector.
    pub addr: u64,
    pub qpn: u32,
    pub token: u64,
}

/// One queue pair's protocol state.
pub(crate) struct Link {
    me: Weak<Link>,
    engine: Weak<Engine>,
    qp: Weak<QpInner>,
    /// The queue pair's secret token: names it in messages (the progress thread's key).
    pub token: u64,
    /// Our RNR budget (µs, 0 = forever), carried in our requests.
    rnr_us: u32,
    timeout: Duration,
    pub peer: OnceLock<Peer>,
    /// Our requests in flight.
    pub(super) sendq: SendQueue,
    rx: Mutex<Rx>,
    /// Messages that arrived before `connect` named the peer.
    early: Mutex<Vec<Msg>>,
    pub dead: AtomicBool,
    reason: Mutex<Option<String>>,
    reported: AtomicBool,
    times: Mutex<Times>,
}

struct Times {
    heard: Instant,
    pinged: Instant,
}

/// The target side: requests in sequence.
struct Rx {
    /// The next sequence number to start.
    next: u64,
    /// Arrived, not yet started.
    queue: BTreeMap<u64, Msg>,
    /// Started, retired in order.
    active: VecDeque<Active>,
    done_seq: u64,
    acked_seq: u64,
    /// After a NAK every later request is dropped.
    dropping: bool,
    /// Since when the next request waits for a receive.
    stall_since: Option<Instant>,
}

struct Active {
    seq: u64,
    /// RMA operations still in flight.
    pending: usize,
    /// The target range of a WRITE (others run alone).
    range: Option<(u64, u64)>,
    then: Then,
    _keep: Vec<Arc<MrInner>>,
}

enum Then {
    Nothing,
    Recv {
        slot: u64,
        opcode: WcOpcode,
        imm: Option<u32>,
        len: u32,
    },
    ReadResp(Option<Vec<u8>>),
    AtomicResp(u64),
}

enum Start {
    /// No receive posted: try again later.
    Stall(Box<Msg>),
    Nak(WcStatus),
}

impl Link {
    pub(super) fn new(engine: &Arc<Engine>, setup: &QpSetup<'_>, rnr_us: u32) -> Arc<Link> {
        Arc::new_cyclic(|me| Link {
            me: me.clone(),
            engine: Arc::downgrade(engine),
            qp: setup.qp.clone(),
            token: setup.token,
            rnr_us,
            timeout: setup.cfg.timeout,
            peer: OnceLock::new(),
            sendq: SendQueue::default(),
            rx: Mutex::new(Rx {
                next: 1,
                queue: BTreeMap::new(),
                active: VecDeque::new(),
                done_seq: 0,
                acked_seq: 0,
                dropping: false,
                stall_since: None,
            }),
            early: Mutex::new(Vec::new()),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            reported: AtomicBool::new(false),
            times: Mutex::new(Times {
                heard: Instant::now(),
                pinged: Instant::now(),
            }),
        })
    }

    /// Names the peer (`to_rtr`) and says hello; messages that came early are handled by the
    /// progress thread.
    pub(super) fn set_peer(&self, peer: Peer) -> Result<(), String> {
        self.peer
            .set(peer)
            .map_err(|_| "already connected".to_string())?;
        {
            let mut t = self.times.lock().unwrap_or_else(|e| e.into_inner());
            t.heard = Instant::now();
            t.pinged = Instant::now();
        }
        if let Some(e) = self.engine.upgrade() {
            self.send_ctl(&e, Kind::Ping, 0, 0);
            e.kick();
        }
        Ok(())
    }

    fn header(&self, kind: Kind) -> Option<(Hdr, u64)> {
        let p = self.peer.get()?;
        let mut h = Hdr::new(kind);
        h.dst_qpn = p.qpn;
        h.dst_token = p.token;
        h.src_qpn = self.qp.upgrade().map_or(0, |q| q.qpn);
        h.src_token = self.token;
        Some((h, p.addr))
    }

    /// Sends a control message (answers, pings) with `seq` and `a`, and `payload` inline.
    fn send_ctl_with(&self, e: &Engine, kind: Kind, seq: u64, a: u64, payload: Option<Vec<u8>>) {
        let Some((mut h, dest)) = self.header(kind) else {
            return;
        };
        h.seq = seq;
        h.a = a;
        let mut buf = Vec::with_capacity(HDR + payload.as_ref().map_or(0, Vec::len));
        if let Some(p) = &payload {
            h.inline = true;
            h.len = p.len() as u32;
        }
        h.encode(&mut buf);
        if let Some(p) = payload {
            buf.extend_from_slice(&p);
        }
        e.send_msg(dest, buf, self.me.clone());
    }

    fn send_ctl(&self, e: &Engine, kind: Kind, seq: u64, a: u64) {
        self.send_ctl_with(e, kind, seq, a, None);
    }

    // ------------------------------------------------------------------------------------
    // Failure and liveness.
    // ------------------------------------------------------------------------------------

    /// Records why the link failed; the queue pair learns it on its next progress call or the
    /// progress thread's next sweep (callers may hold queue-pair locks).
    pub(super) fn mark_failed(&self, why: &str) {
        let mut reason = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if reason.is_none() {
            *reason = Some(why.to_string());
        }
        drop(reason);
        self.dead.store(true, Ordering::Release);
    }

    /// Moves the queue pair to ERR, once, with the recorded reason (holding no lock).
    pub(super) fn report(&self) {
        if !self.dead.load(Ordering::Acquire) || self.reported.swap(true, Ordering::AcqRel) {
            return;
        }
        let why = self.note().unwrap_or_else(|| "the link failed".into());
        if let Some(qp) = self.qp.upgrade() {
            qp.connection_failed(&why);
        }
    }

    /// Why the link failed.
    pub(super) fn note(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The queue pair is destroyed or disconnected: tell the peer, stop.
    pub(super) fn close(&self, e: &Engine) {
        // A pass of the progress thread under way (`advance`) may have completed a receive
        // the application saw and not yet sent the ACK it makes due: it sends it before it
        // lets go, so the ACK goes before the `Bye`.
        drop(self.rx.lock().unwrap_or_else(|e| e.into_inner()));
        if !self.dead.swap(true, Ordering::AcqRel) {
            self.send_ctl(e, Kind::Bye, 0, 0);
        }
        self.reported.store(true, Ordering::Release);
        e.forget(self.token);
    }

    /// The progress thread's periodic visit.
    pub(super) fn sweep(&self, e: &Arc<Engine>) {
        if self.dead.load(Ordering::Acquire) {
            self.report();
            return;
        }
        let Some(qp) = self.qp.upgrade() else { return };
        if self.peer.get().is_none() {
            return;
        }
        self.drain_early(e, &qp);
        if matches!(qp.state(), QpState::Rtr | QpState::Rts) {
            let (silent, ping) = {
                let mut t = self.times.lock().unwrap_or_else(|e| e.into_inner());
                let silent = t.heard.elapsed() > self.timeout;
                let ping = t.pinged.elapsed() >= self.timeout / 4;
                if ping {
                    t.pinged = Instant::now();
                }
                (silent, ping)
            };
            if silent {
                self.mark_failed(&format!(
                    "no word from the peer for {:?} (the queue pair's timeout): its process is \
                     gone, or its queue pair never connected to this one or failed",
                    self.timeout
                ));
                self.report();
                return;
            }
            if ping {
                self.send_ctl(e, Kind::Ping, 0, 0);
            }
        }
        let waiting = {
            let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
            !rx.queue.is_empty()
        };
        if waiting {
            self.advance(e, &qp);
        }
    }

    fn heard(&self) {
        self.times.lock().unwrap_or_else(|e| e.into_inner()).heard = Instant::now();
    }

    // ------------------------------------------------------------------------------------
    // Receiving.
    // ------------------------------------------------------------------------------------

    /// A message for this queue pair arrived (progress thread).
    pub(super) fn receive(&self, e: &Arc<Engine>, m: Msg) {
        let Some(qp) = self.qp.upgrade() else { return };
        let Some(peer) = self.peer.get() else {
            if m.h.kind.is_request() || m.h.kind == Kind::Bye {
                self.early.lock().unwrap_or_else(|e| e.into_inner()).push(m);
            }
            return;
        };
        if m.h.src_token != peer.token {
            return;
        }
        self.drain_early(e, &qp);
        self.dispatch(e, &qp, m);
    }

    fn drain_early(&self, e: &Arc<Engine>, qp: &QpInner) {
        let early = std::mem::take(&mut *self.early.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(peer) = self.peer.get() else { return };
        for m in early {
            if m.h.src_token == peer.token {
                self.dispatch(e, qp, m);
            }
        }
    }

    fn dispatch(&self, e: &Arc<Engine>, qp: &QpInner, m: Msg) {
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        if !(m.h.kind == Kind::Pong && m.h.a == 0) {
            self.heard();
        }
        match m.h.kind {
            Kind::Ping => {
                let ready = matches!(qp.state(), QpState::Rtr | QpState::Rts);
                self.send_ctl(e, Kind::Pong, 0, ready as u64);
            }
            Kind::Pong => {}
            Kind::Bye => {
                self.mark_failed("the peer destroyed or disconnected its queue pair");
                self.report();
            }
            k if k.is_request() => {
                if qp.is_failed() {
                    // A responder in ERR executes nothing (the initiator times out).
                    return;
                }
                self.rx
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .queue
                    .insert(m.h.seq, m);
                self.advance(e, qp);
            }
            _ => {
                if let Err(why) = self.on_answer(qp, m) {
                    self.mark_failed(&why);
                    self.report();
                }
            }
        }
    }

    // ------------------------------------------------------------------------------------
    // Initiator.
    // ------------------------------------------------------------------------------------

    /// Posts one send-queue request (the caller validated the state and local buffers).
    /// `local`: the validated buffers (region, pointer, length).
    pub(super) fn send_request(
        &self,
        e: &Engine,
        wr_id: u64,
        op: &WrOp,
        local: &[(&Arc<MrInner>, *mut u8, usize)],
        signaled: bool,
        qp_failed: impl Fn() -> bool,
    ) -> Result<(), WcStatus> {
        let total: usize = local.iter().map(|l| l.2).sum();
        let Some((mut h, dest)) = self.header(Kind::Write) else {
            return Err(WcStatus::WorkRequestFlushed);
        };
        h.len = total as u32;
        h.rnr_us = self.rnr_us;
        let (kind, opcode) = match *op {
            WrOp::Write { remote } => {
                (h.addr, h.rkey) = (remote.addr, remote.rkey);
                (Kind::Write, WcOpcode::Write)
            }
            WrOp::WriteWithImm { remote, imm } => {
                (h.addr, h.rkey, h.imm) = (remote.addr, remote.rkey, imm);
                (Kind::WriteImm, WcOpcode::Write)
            }
            WrOp::Send => (Kind::Send, WcOpcode::Send),
            WrOp::SendWithImm { imm } => {
                h.imm = imm;
                (Kind::SendImm, WcOpcode::Send)
            }
            WrOp::Read { remote } => {
                (h.addr, h.rkey) = (remote.addr, remote.rkey);
                (Kind::Read, WcOpcode::Read)
            }
            WrOp::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                (h.addr, h.rkey, h.a, h.b) = (remote.addr, remote.rkey, compare, swap);
                (Kind::Cas, WcOpcode::CompareSwap)
            }
            WrOp::FetchAdd { remote, add } => {
                (h.addr, h.rkey, h.a) = (remote.addr, remote.rkey, add);
                (Kind::Faa, WcOpcode::FetchAdd)
            }
        };
        h.kind = kind;
        let gather = matches!(
            kind,
            Kind::Write | Kind::WriteImm | Kind::Send | Kind::SendImm
        );
        let inline = total <= INLINE_MAX;
        let mut descs = Vec::new();
        if !inline && (gather || kind == Kind::Read) {
            for (mr, p, len) in local.iter().filter(|l| l.2 > 0) {
                let (_, key, addr) = e
                    .rma_of(mr.index, *p)
                    .ok_or(WcStatus::LocalProtectionError)?;
                descs.push(Rsge {
                    addr,
                    key,
                    len: *len as u64,
                });
            }
        }
        h.nsge = descs.len() as u8;
        h.inline = inline && gather;
        let mut buf =
            Vec::with_capacity(HDR + descs.len() * SGE_LEN + if h.inline { total } else { 0 });
        h.encode(&mut buf);
        for d in &descs {
            for v in [d.addr, d.key, d.len] {
                buf.extend_from_slice(&v.to_le_bytes());
            }
        }
        if h.inline {
            for (_, p, len) in local {
                // SAFETY: each buffer is a validated range of a live registered region (the
                // caller holds its Arc).
                buf.extend_from_slice(unsafe { std::slice::from_raw_parts(*p, *len) });
            }
        }
        let keep: Keep = local.iter().map(|l| Arc::clone(l.0)).collect();
        let dst: Spans = if gather {
            Spans::new()
        } else {
            local.iter().map(|l| Span(l.1, l.2)).collect()
        };
        let o = Outstanding {
            seq: 0,
            wr_id,
            opcode,
            len: total as u32,
            signaled,
            dst,
            _keep: keep,
            error: None,
        };
        // Messages leave in sequence (issued under the post lock).
        self.sendq.post(
            o,
            || qp_failed() || self.dead.load(Ordering::Acquire),
            |seq| {
                buf[24..32].copy_from_slice(&seq.to_le_bytes());
                e.send_msg(dest, buf, self.me.clone());
            },
        )
    }

    /// An answer from the target (progress thread).
    fn on_answer(&self, qp: &QpInner, m: Msg) -> Result<(), String> {
        if qp.is_failed() {
            // Our queue pair failed and flushed its requests: late answers are dropped.
            return Ok(());
        }
        let h = m.h;
        match h.kind {
            Kind::Ack => self.sendq.complete_upto(qp, h.seq),
            Kind::Nak => {
                self.sendq.complete_upto(qp, h.seq.saturating_sub(1));
                let status =
                    WcStatus::from_u32(h.a as u32).unwrap_or(WcStatus::RemoteOperationError);
                let o = self.sendq.pop_front_if(|o| o.seq == h.seq);
                let Some(o) = o else {
                    return Err(format!("NAK for request {} that is not outstanding", h.seq));
                };
                qp.complete_send(o.wr_id, o.opcode, status, 0, true);
                qp.request_failed();
            }
            Kind::ReadResp | Kind::AtomicResp => {
                self.sendq.complete_upto(qp, h.seq.saturating_sub(1));
                let want = if h.kind == Kind::ReadResp {
                    WcOpcode::Read
                } else {
                    WcOpcode::FetchAdd
                };
                let o = self.sendq.pop_front_if(|o| {
                    o.seq == h.seq
                        && (o.opcode == want
                            || (want == WcOpcode::FetchAdd && o.opcode == WcOpcode::CompareSwap))
                });
                let Some(o) = o else {
                    return Err(format!(
                        "{:?} for request {} that is not outstanding",
                        h.kind, h.seq
                    ));
                };
                if h.kind == Kind::ReadResp {
                    if h.inline {
                        if m.payload.len() != o.len as usize {
                            return Err(format!(
                                "READ data of {} bytes for a READ of {}",
                                m.payload.len(),
                                o.len
                            ));
                        }
                        scatter(&m.payload, &o.dst);
                    }
                } else if let Some(d) = o.dst.first().filter(|d| d.1 == 8) {
                    let bytes = h.a.to_ne_bytes();
                    // SAFETY: the 8-byte local buffer was validated at post time and is kept
                    // alive by `o._keep`.
                    unsafe { crate::contract::copy_bytes(bytes.as_ptr(), d.0, 8) };
                }
                qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, o.len, o.signaled);
                self.sendq.complete_local_failures(qp);
            }
            k => return Err(format!("unexpected {k:?} message")),
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------
    // Target.
    // ------------------------------------------------------------------------------------

    /// An RMA of request `seq` finished (progress thread).
    pub(super) fn rma_done(&self, e: &Arc<Engine>, seq: u64) {
        {
            let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(a) = rx.active.iter_mut().find(|a| a.seq == seq) {
                a.pending = a.pending.saturating_sub(1);
            }
        }
        if let Some(qp) = self.qp.upgrade() {
            self.advance(e, &qp);
        }
    }

    /// Executes what can be executed, in sequence; answers what finished (progress thread).
    fn advance(&self, e: &Arc<Engine>, qp: &QpInner) {
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            while rx.active.front().is_some_and(|a| a.pending == 0) {
                let a = rx.active.pop_front().expect("front");
                match a.then {
                    Then::Nothing => {}
                    Then::Recv {
                        slot,
                        opcode,
                        imm,
                        len,
                    } => qp.complete_recv(slot, WcStatus::Success, opcode, len, imm),
                    Then::ReadResp(data) => {
                        self.send_ctl_with(e, Kind::ReadResp, a.seq, 0, data);
                        rx.acked_seq = a.seq;
                    }
                    Then::AtomicResp(old) => {
                        self.send_ctl(e, Kind::AtomicResp, a.seq, old);
                        rx.acked_seq = a.seq;
                    }
                }
                rx.done_seq = a.seq;
            }
            if qp.is_failed() || self.dead.load(Ordering::Acquire) {
                break;
            }
            let next = rx.next;
            let Some(m) = rx.queue.get(&next) else { break };
            if rx.dropping {
                rx.queue.remove(&next);
                rx.next += 1;
                continue;
            }
            if !rx.active.is_empty() {
                let h = &m.h;
                let end = h.addr.checked_add(h.len as u64);
                let ok = matches!(h.kind, Kind::Write | Kind::WriteImm)
                    && rx.active.len() < MAX_ACTIVE
                    && end.is_some()
                    && self
                        .target(e, h, h.len as usize, AccessFlags::REMOTE_WRITE)
                        .is_some()
                    && rx.active.iter().all(|a| {
                        a.range
                            .is_some_and(|(s, t)| t <= h.addr || end.is_some_and(|end| end <= s))
                    });
                if !ok {
                    break;
                }
            }
            let m = rx.queue.remove(&next).expect("present");
            match self.start(e, qp, m) {
                Ok(a) => {
                    rx.stall_since = None;
                    rx.active.push_back(a);
                    rx.next += 1;
                }
                Err(Start::Stall(m)) => {
                    let since = *rx.stall_since.get_or_insert_with(Instant::now);
                    let over = m.h.rnr_us != 0
                        && since.elapsed() >= Duration::from_micros(m.h.rnr_us as u64);
                    if over && rx.active.is_empty() {
                        rx.stall_since = None;
                        self.nak(e, &mut rx, m.h.seq, WcStatus::RnrRetryExceeded);
                        rx.next += 1;
                    } else {
                        rx.queue.insert(next, *m);
                        break;
                    }
                }
                Err(Start::Nak(status)) => {
                    self.nak(e, &mut rx, next, status);
                    rx.next += 1;
                }
            }
        }
        if rx.done_seq > rx.acked_seq {
            rx.acked_seq = rx.done_seq;
            let seq = rx.done_seq;
            self.send_ctl(e, Kind::Ack, seq, 0);
        }
    }

    fn nak(&self, e: &Engine, rx: &mut Rx, seq: u64, status: WcStatus) {
        rx.dropping = true;
        rx.done_seq = seq;
        rx.acked_seq = seq;
        self.send_ctl(e, Kind::Nak, seq, status as u64);
    }

    /// Looks up a target region for a request and checks access and bounds.
    fn target(
        &self,
        e: &Engine,
        h: &Hdr,
        len: usize,
        need: AccessFlags,
    ) -> Option<(Arc<MrInner>, *mut u8)> {
        let mr = e
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key_index(h.rkey))
            .and_then(Weak::upgrade)?;
        if mr.rkey != h.rkey || h.rkey == 0 || !mr.is_registered() || !mr.access.contains(need) {
            return None;
        }
        let off = h.addr.checked_sub(mr.addr)?;
        if off.checked_add(len as u64)? > mr.len as u64 {
            return None;
        }
        Some((mr.clone(), (mr.addr + off) as usize as *mut u8))
    }

    /// Starts request `m` (the next in sequence).
    fn start(&self, e: &Arc<Engine>, qp: &QpInner, m: Msg) -> Result<Active, Start> {
        let h = m.h;
        let len = h.len as usize;
        let active = |pending, range, then, keep| Active {
            seq: h.seq,
            pending,
            range,
            then,
            _keep: keep,
        };
        match h.kind {
            Kind::Write | Kind::WriteImm => {
                let (mr, p) = self
                    .target(e, &h, len, AccessFlags::REMOTE_WRITE)
                    .ok_or(Start::Nak(WcStatus::RemoteAccessError))?;
                let then = if h.kind == Kind::WriteImm {
                    let Some(slot) = qp.claim_recv() else {
                        return Err(Start::Stall(Box::new(m)));
                    };
                    Then::Recv {
                        slot,
                        opcode: WcOpcode::RecvRdmaWithImm,
                        imm: Some(h.imm),
                        len: h.len,
                    }
                } else {
                    Then::Nothing
                };
                let range = Some((h.addr, h.addr + len as u64));
                if h.inline {
                    // SAFETY: `p..p+len` was validated inside the live region `mr`; the
                    // payload has exactly `len` bytes (checked when decoded).
                    unsafe { crate::contract::copy_bytes(m.payload.as_ptr(), p, len) };
                    return Ok(active(0, range, then, vec![mr]));
                }
                let n = self.pull(e, h.seq, &m.sges, &[(p, len, mr.clone())])?;
                Ok(active(n, range, then, vec![mr]))
            }
            Kind::Send | Kind::SendImm => {
                let Some(slot) = qp.claim_recv() else {
                    return Err(Start::Stall(Box::new(m)));
                };
                let imm = (h.kind == Kind::SendImm).then_some(h.imm);
                let (spans, keep, room) = match qp.recv_spans(slot) {
                    Ok(s) => s,
                    Err(st) => {
                        qp.complete_recv(slot, st, WcOpcode::Recv, h.len, imm);
                        return Err(Start::Nak(if st == WcStatus::LocalLengthError {
                            WcStatus::RemoteInvalidRequest
                        } else {
                            WcStatus::RemoteOperationError
                        }));
                    }
                };
                if len > room {
                    qp.complete_recv(slot, WcStatus::LocalLengthError, WcOpcode::Recv, h.len, imm);
                    return Err(Start::Nak(WcStatus::RemoteInvalidRequest));
                }
                let then = Then::Recv {
                    slot,
                    opcode: WcOpcode::Recv,
                    imm,
                    len: h.len,
                };
                if h.inline {
                    scatter(&m.payload, &spans);
                    return Ok(active(0, None, then, keep.into_vec()));
                }
                let dst: Vec<(*mut u8, usize, Arc<MrInner>)> = spans
                    .iter()
                    .zip(&keep)
                    .map(|(s, k)| (s.0, s.1, k.clone()))
                    .collect();
                let n = self.pull(e, h.seq, &m.sges, &dst)?;
                Ok(active(n, None, then, keep.into_vec()))
            }
            Kind::Read => {
                let (mr, p) = self
                    .target(e, &h, len, AccessFlags::REMOTE_READ)
                    .ok_or(Start::Nak(WcStatus::RemoteAccessError))?;
                if len <= INLINE_MAX {
                    // SAFETY: `p..p+len` was validated inside the live region `mr`.
                    let data = unsafe { std::slice::from_raw_parts(p, len) }.to_vec();
                    return Ok(active(0, None, Then::ReadResp(Some(data)), vec![mr]));
                }
                let n = self.push(e, h.seq, (p, len, &mr), &m.sges)?;
                Ok(active(n, None, Then::ReadResp(None), vec![mr]))
            }
            Kind::Cas | Kind::Faa => {
                if !h.addr.is_multiple_of(8) {
                    return Err(Start::Nak(WcStatus::RemoteInvalidRequest));
                }
                let (mr, p) = self
                    .target(e, &h, 8, AccessFlags::REMOTE_ATOMIC)
                    .ok_or(Start::Nak(WcStatus::RemoteAccessError))?;
                // SAFETY: `p` is 8-byte aligned (region bases are, the address is checked) and
                // inside a live registered region of this process (held by `mr`).
                let word = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                let old = if h.kind == Kind::Cas {
                    match word.compare_exchange(h.a, h.b, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(v) | Err(v) => v,
                    }
                } else {
                    word.fetch_add(h.a, Ordering::SeqCst)
                };
                Ok(active(0, None, Then::AtomicResp(old), vec![mr]))
            }
            _ => Err(Start::Nak(WcStatus::RemoteInvalidRequest)),
        }
    }

    /// Reads the initiator's buffers `src` into `dst` (the target's): one fi_read per piece.
    /// Returns the number issued.
    fn pull(
        &self,
        e: &Engine,
        seq: u64,
        src: &[Rsge],
        dst: &[(*mut u8, usize, Arc<MrInner>)],
    ) -> Result<usize, Start> {
        let peer = self.peer.get().map_or(0, |p| p.addr);
        let mut n = 0;
        for_pieces(src, dst, |s, soff, d, doff, len| {
            let (p, _, mr) = &dst[d];
            // SAFETY: `doff + len` lies within the validated span `dst[d]`.
            let buf = unsafe { p.add(doff) };
            let (desc, _, _) = e.rma_of(mr.index, buf).ok_or(())?;
            let op = Op::boxed(What::Rma {
                link: self.me.clone(),
                seq,
                _keep: mr.clone(),
            });
            e.issue(Issue::Read {
                buf,
                len,
                desc,
                peer,
                addr: src[s].addr + soff as u64,
                key: src[s].key,
                op,
            });
            n += 1;
            Ok(())
        })
        .map_err(|()| Start::Nak(WcStatus::RemoteOperationError))?;
        Ok(n)
    }

    /// Writes the target's `(p, len)` into the initiator's buffers `dst`.
    fn push(
        &self,
        e: &Engine,
        seq: u64,
        (p, len, mr): (*mut u8, usize, &Arc<MrInner>),
        dst: &[Rsge],
    ) -> Result<usize, Start> {
        let peer = self.peer.get().map_or(0, |p| p.addr);
        let mut n = 0;
        let local = [(p, len, mr.clone())];
        // Pieces of the local range against the initiator's buffers (roles swapped).
        for_pieces(dst, &local, |d, doff, _, soff, k| {
            // SAFETY: `soff + k <= len`: inside the validated range.
            let buf = unsafe { p.add(soff) };
            let (desc, _, _) = e.rma_of(mr.index, buf).ok_or(())?;
            let op = Op::boxed(What::Rma {
                link: self.me.clone(),
                seq,
                _keep: mr.clone(),
            });
            e.issue(Issue::Write {
                buf,
                len: k,
                desc,
                peer,
                addr: dst[d].addr + doff as u64,
                key: dst[d].key,
                op,
            });
            n += 1;
            Ok(())
        })
        .map_err(|()| Start::Nak(WcStatus::RemoteOperationError))?;
        Ok(n)
    }
}

/// Walks two lists of buffers side by side, calling `f(i, offset in a[i], j, offset in b[j],
/// length)` for each non-empty piece, until either list runs out.
fn for_pieces(
    a: &[Rsge],
    b: &[(*mut u8, usize, Arc<MrInner>)],
    mut f: impl FnMut(usize, usize, usize, usize, usize) -> Result<(), ()>,
) -> Result<(), ()> {
    let (mut i, mut io, mut j, mut jo) = (0, 0usize, 0, 0usize);
    while i < a.len() && j < b.len() {
        let ra = a[i].len as usize - io;
        let rb = b[j].1 - jo;
        if ra == 0 {
            i += 1;
            io = 0;
            continue;
        }
        if rb == 0 {
            j += 1;
            jo = 0;
            continue;
        }
        let k = ra.min(rb);
        f(i, io, j, jo, k)?;
        io += k;
        jo += k;
    }
    Ok(())
}

/// Copies `data` into the spans, in order.
fn scatter(data: &[u8], spans: &[Span]) {
    let mut off = 0;
    for s in spans {
        if off >= data.len() {
            break;
        }
        let k = s.1.min(data.len() - off);
        // SAFETY: each span is a validated range of a live registered region (kept alive by
        // the caller), `k <= s.1`, and `off + k <= data.len()`.
        unsafe { crate::contract::copy_bytes(data.as_ptr().add(off), s.0, k) };
        off += k;
    }
}
