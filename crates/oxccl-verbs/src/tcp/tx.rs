//! The sending side of a queue pair's connections: frames, posting, striping.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use oxccl_seal::{HEADER_LEN as SEAL_HEADER, MAX_RECORD, Sealer, TAG_LEN};
use rustix::net::SendFlags;
use smallvec::SmallVec;

use super::STRIPE_MIN;
use super::conn::Conn;
use super::frame::{ACK_REQ, HEADER_LEN, Header, Opcode, Part};
use crate::contract::Span;
use crate::contract::sendq::{Keep, Local, Outstanding, Spans};
use crate::model::{WcOpcode, WcStatus, WrOp};

/// One frame waiting to be written.
pub(super) struct TxFrame {
    hdr: [u8; HEADER_LEN],
    payload: Spans,
    keep: Keep,
    /// The payload's own copy, once [`TxFrame::detach`] made one (the spans point into it).
    owned: Vec<u8>,
    pub sent: usize,
}

impl TxFrame {
    /// A frame of `hdr` and the payload at `payload` (in the regions of `keep`).
    pub fn new(hdr: &Header, payload: Spans, keep: Keep) -> TxFrame {
        TxFrame {
            hdr: hdr.encode(),
            payload,
            keep,
            owned: Vec::new(),
            sent: 0,
        }
    }

    /// A frame that is only a header (ACK, NAK, atomic result).
    pub fn header(hdr: &Header) -> TxFrame {
        TxFrame::new(hdr, Spans::new(), Keep::new())
    }

    /// Copies the payload into the frame itself, so that it no longer reads the memory it was
    /// posted from: a frame that must still be finished (to keep the stream framed) after its
    /// request was flushed would otherwise read a buffer its owner may free or reuse as soon
    /// as the flush is reported (a user buffer registered for the call that failed).
    pub fn detach(&mut self) {
        if !self.owned.is_empty() || self.payload.is_empty() {
            return;
        }
        let mut owned = Vec::with_capacity(self.payload.iter().map(|s| s.1).sum());
        for s in &self.payload {
            // SAFETY: the span lies in a registered region kept alive by `keep`, and its
            // owner has not been told that the request ended (this runs in the flush that
            // tells it), so the memory is still the caller's buffer.
            owned.extend_from_slice(unsafe { std::slice::from_raw_parts(s.0, s.1) });
        }
        self.payload = SmallVec::from_elem(Span(owned.as_mut_ptr(), owned.len()), 1);
        self.owned = owned;
        self.keep.clear();
    }

    pub fn total(&self) -> usize {
        HEADER_LEN + self.payload.iter().map(|s| s.1).sum::<usize>()
    }

    /// The frame, for an error: what it is, how far it got, and where its payload lies (which
    /// region holds each span, and whether that region is still registered).
    fn describe(&self) -> String {
        let head = match Header::decode(&self.hdr) {
            Ok(h) => format!("{:?} frame, request {}", h.opcode, h.seq),
            Err(_) => "frame".to_string(),
        };
        let spans: Vec<String> = self
            .payload
            .iter()
            .map(|s| {
                let (p, n) = (s.0 as u64, s.1 as u64);
                let region = if !self.owned.is_empty() {
                    "its own copy".to_string()
                } else {
                    self.keep
                        .iter()
                        .find(|m| p >= m.addr && p + n <= m.addr + m.len as u64)
                        .map_or("no region".to_string(), |m| {
                            format!(
                                "region lkey {:#x}{}",
                                m.lkey,
                                if m.is_registered() {
                                    ""
                                } else {
                                    " (deregistered)"
                                }
                            )
                        })
                };
                format!("{n} bytes at {p:#x} in {region}")
            })
            .collect();
        format!(
            "{head}, {} of {} bytes sent, payload: [{}]",
            self.sent,
            self.total(),
            spans.join("; ")
        )
    }
}

/// The most slices one `sendmsg` gathers from several queued frames.
const IOV_BATCH: usize = 8;

/// A connection's frames waiting to be written.
#[derive(Default)]
pub(super) struct Tx {
    pub frames: VecDeque<TxFrame>,
    pub want_out: bool,
    /// A list of requests is being posted ([`Conn::cork`]): frames wait for its end, to leave
    /// in one `sendmsg`.
    pub corked: bool,
    /// A sealed connection's sending keys and the records sealed, not yet written.
    seal: Option<Box<TxSeal>>,
}

/// The sending half of a sealed connection: the frames are cut into records (several small
/// frames share one, a payload is cut at [`MAX_RECORD`]), sealed into `wire` and written from
/// there. A frame's `sent` counts the bytes of it sealed so far.
struct TxSeal {
    sealer: Sealer,
    /// Sealed records; `wire[sent..]` is still to be written.
    wire: Vec<u8>,
    sent: usize,
}

/// Plaintext bytes sealed ahead of the socket at most (the records of one `send`).
const SEAL_AHEAD: usize = 8 * MAX_RECORD;

impl Tx {
    /// From now on, every frame travels in records sealed with `sealer` (the peer's key
    /// confirmation record, if this side sends one first, is already sealed with it).
    pub fn seal(&mut self, sealer: Sealer) {
        self.seal = Some(Box::new(TxSeal {
            sealer,
            wire: Vec::new(),
            sent: 0,
        }));
    }

    /// Whether nothing waits to be written (no frame, no sealed byte).
    pub fn is_idle(&self) -> bool {
        self.frames.is_empty() && self.seal.as_ref().is_none_or(|s| s.sent == s.wire.len())
    }
}

impl Conn {
    /// Takes the held-back ACK along in a frame header about to leave on connection 0 (read
    /// first: mostly none is held back, and a swap is a locked write).
    fn stamp_ack(&self, hdr: &mut [u8; HEADER_LEN]) {
        if self.ack_out.load(Ordering::Relaxed) == 0 {
            return;
        }
        let ack = self.ack_out.swap(0, Ordering::AcqRel);
        let had = u64::from_le_bytes(hdr[56..64].try_into().unwrap_or_default());
        if ack > had {
            hdr[56..64].copy_from_slice(&ack.to_le_bytes());
        }
    }

    /// Writes connection `i`'s queued frames until the socket would block.
    pub(super) fn flush_tx(&self, i: usize) {
        let Some(s) = self.socks().get(i) else { return };
        let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
        let r = self.flush_locked(i, &mut tx);
        drop(tx);
        self.check(r);
    }

    pub(super) fn flush_locked(&self, i: usize, tx: &mut Tx) -> std::result::Result<(), String> {
        let Some(sock) = self.socks().get(i).and_then(|s| s.stream.get()) else {
            return Ok(());
        };
        if tx.seal.is_some() {
            return self.flush_sealed(i, sock, tx);
        }
        while let Some(f) = tx.frames.front_mut() {
            if i == 0 && f.sent == 0 {
                self.stamp_ack(&mut f.hdr);
            }
            // The queued frames in one sendmsg, as far as IOV_BATCH slices go (a first frame
            // with more slices goes alone): a credit posted with a fragment, or frames that
            // queued behind a full socket, cost one system call, not one each.
            let mut iov: SmallVec<[IoSlice<'_>; IOV_BATCH]> = SmallVec::new();
            for f in tx.frames.iter() {
                if !iov.is_empty() && iov.len() + 1 + f.payload.len() > IOV_BATCH {
                    break;
                }
                let mut skip = f.sent;
                if skip < HEADER_LEN {
                    iov.push(IoSlice::new(&f.hdr[skip..]));
                    skip = 0;
                } else {
                    skip -= HEADER_LEN;
                }
                for s in &f.payload {
                    if skip >= s.1 {
                        skip -= s.1;
                        continue;
                    }
                    // SAFETY: the span lies in a region kept alive by `f.keep` (by the poster's
                    // own request while its call lasts: `queue_then`), in the target's
                    // registered region, or in the frame's own copy; `skip < s.1`.
                    iov.push(IoSlice::new(unsafe {
                        std::slice::from_raw_parts(s.0.add(skip), s.1 - skip)
                    }));
                    skip = 0;
                }
            }
            let r = rustix::net::sendmsg(
                sock,
                &iov,
                &mut rustix::net::SendAncillaryBuffer::default(),
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            );
            drop(iov);
            match r {
                Ok(mut n) => {
                    // Retire the frames the bytes covered; the last may be partly sent.
                    while n > 0 {
                        let Some(f) = tx.frames.front_mut() else {
                            break;
                        };
                        let left = f.total() - f.sent;
                        if n >= left {
                            n -= left;
                            tx.frames.pop_front();
                        } else {
                            f.sent += n;
                            n = 0;
                        }
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    let what = tx.frames.front().map(TxFrame::describe).unwrap_or_default();
                    tx.frames.clear();
                    return Err(format!("sending to the peer failed: {e} ({what})"));
                }
            }
        }
        let want = !tx.frames.is_empty();
        if tx.want_out != want {
            tx.want_out = want;
            self.set_interest(i, want);
        }
        Ok(())
    }

    /// [`Conn::flush_locked`] of a sealed connection: writes the sealed records, sealing the
    /// queued frames into more as the socket takes them, until it would block.
    fn flush_sealed(
        &self,
        i: usize,
        sock: &std::net::TcpStream,
        tx: &mut Tx,
    ) -> std::result::Result<(), String> {
        while let Some(seal) = tx.seal.as_deref_mut() {
            if seal.sent == seal.wire.len() {
                seal.wire.clear();
                seal.sent = 0;
                if tx.frames.is_empty() {
                    break;
                }
                self.seal_frames(i, tx)?;
                continue;
            }
            match rustix::net::send(
                sock,
                &seal.wire[seal.sent..],
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            ) {
                Ok(n) => seal.sent += n,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    let what = tx.frames.front().map(TxFrame::describe).unwrap_or_default();
                    let records = seal.sealer.records_sealed();
                    tx.frames.clear();
                    return Err(format!(
                        "sending to the peer failed: {e} (sealed connection {i}, {records} \
                         records sealed; next frame: {what})"
                    ));
                }
            }
        }
        let want = !tx.is_idle();
        if tx.want_out != want {
            tx.want_out = want;
            self.set_interest(i, want);
        }
        Ok(())
    }

    /// Seals the queued frames of connection `i` into records, up to [`SEAL_AHEAD`] bytes:
    /// each record takes up to [`MAX_RECORD`] bytes of the frames in turn (headers and
    /// payloads), so small frames share one and a payload is cut at record bounds. A record
    /// that does not seal (its direction out of record numbers) ends the connection: the
    /// frames are dropped and the error names the connection.
    fn seal_frames(&self, i: usize, tx: &mut Tx) -> std::result::Result<(), String> {
        let Tx { frames, seal, .. } = tx;
        let Some(seal) = seal.as_deref_mut() else {
            return Ok(());
        };
        let mut ahead = 0;
        while !frames.is_empty() && ahead < SEAL_AHEAD {
            let at = seal.wire.len();
            seal.wire.extend_from_slice(&[0u8; SEAL_HEADER]);
            let mut room = MAX_RECORD;
            while room > 0
                && let Some(f) = frames.front_mut()
            {
                if i == 0 && f.sent == 0 {
                    self.stamp_ack(&mut f.hdr);
                }
                let mut skip = f.sent;
                if skip < HEADER_LEN {
                    let k = (HEADER_LEN - skip).min(room);
                    seal.wire.extend_from_slice(&f.hdr[skip..skip + k]);
                    (f.sent, room, skip) = (f.sent + k, room - k, 0);
                } else {
                    skip -= HEADER_LEN;
                }
                for s in &f.payload {
                    if room == 0 {
                        break;
                    }
                    if skip >= s.1 {
                        skip -= s.1;
                        continue;
                    }
                    let k = (s.1 - skip).min(room);
                    // SAFETY: the span lies in a region kept alive by `f.keep` (by the poster's
                    // own request while its call lasts: `queue_then`), in the target's
                    // registered region, or in the frame's own copy; `skip + k <= s.1`.
                    seal.wire
                        .extend_from_slice(unsafe { std::slice::from_raw_parts(s.0.add(skip), k) });
                    (f.sent, room, skip) = (f.sent + k, room - k, 0);
                }
                if f.sent == f.total() {
                    frames.pop_front();
                }
            }
            let n = MAX_RECORD - room;
            seal.wire.extend_from_slice(&[0u8; TAG_LEN]);
            if let Err(e) = seal.sealer.seal_record(&mut seal.wire[at..]) {
                let what = frames.front().map(TxFrame::describe).unwrap_or_default();
                let records = seal.sealer.records_sealed();
                frames.clear();
                return Err(format!(
                    "sealing a record for the peer failed: {e} (sealed connection {i}, {records} \
                     records sealed; next frame: {what})"
                ));
            }
            ahead += n;
        }
        Ok(())
    }

    /// Holds back the frames of the requests posted from now until [`Conn::uncork`], so that a
    /// list of requests posted together (a credit and a fragment) leaves in one `sendmsg` per
    /// connection, as one doorbell rings for a list of work requests on an RDMA NIC.
    pub(super) fn cork(&self) {
        for s in self.socks() {
            s.tx.lock().unwrap_or_else(|e| e.into_inner()).corked = true;
        }
    }

    /// Ends [`Conn::cork`]: writes what was held back.
    pub(super) fn uncork(&self) {
        for (i, s) in self.socks().iter().enumerate() {
            let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
            tx.corked = false;
            if tx.is_idle() {
                continue;
            }
            let r = self.flush_locked(i, &mut tx);
            drop(tx);
            self.check(r);
        }
    }

    /// Queues a frame on connection `i` (written at once when nothing waits before it).
    pub(super) fn queue(&self, i: usize, f: TxFrame) {
        self.queue_then(i, f, |_| {});
    }

    /// [`Conn::queue`], then `waits` on the frame if it is still queued (not all written at
    /// once): a poster whose request borrows its regions for the call gives them to the frame
    /// there, so a small message that leaves at once takes no reference to them.
    fn queue_then(&self, i: usize, f: TxFrame, waits: impl FnOnce(&mut TxFrame)) {
        let Some(s) = self.socks().get(i) else { return };
        let mut tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
        #[cfg(debug_assertions)]
        let mine = f.hdr;
        let r = self.push_locked(i, &mut tx, f);
        // Frames leave from the front, and nothing else is queued while the lock is held: what
        // is left at the back is (the rest of) this one.
        if let Some(f) = tx.frames.back_mut() {
            // The ACK stamp (bytes 56..64) may have changed.
            #[cfg(debug_assertions)]
            debug_assert_eq!(f.hdr[..56], mine[..56]);
            waits(f);
        }
        drop(tx);
        self.check(r);
    }

    /// Appends a frame; writes it at once when nothing is queued before it, otherwise leaves it
    /// to the driver (which is asked to watch for room in the socket).
    fn push_locked(&self, i: usize, tx: &mut Tx, f: TxFrame) -> std::result::Result<(), String> {
        let inline = tx.is_idle() && f.total() <= self.tuning.inline_max;
        tx.frames.push_back(f);
        if tx.corked {
            // Written by `uncork`, with the rest of the list.
            Ok(())
        } else if inline {
            self.flush_locked(i, tx)
        } else {
            if !tx.want_out {
                tx.want_out = true;
                self.set_interest(i, true);
            }
            Ok(())
        }
    }

    /// Posts one send-queue request (the caller validated the QP state and local SGEs).
    pub(super) fn send_request(
        &self,
        wr_id: u64,
        op: &WrOp,
        local: Local<'_>,
        signaled: bool,
        qp_failed: impl Fn() -> bool,
    ) -> Result<(), WcStatus> {
        let total: usize = local.iter().map(|l| l.2).sum();
        let spans: Spans = local.iter().map(|l| Span(l.1, l.2)).collect();
        let keep = || -> Keep { local.iter().map(|l| Arc::clone(l.0)).collect() };
        let (opcode, mut h, payload, dst) = match *op {
            WrOp::Write { remote } | WrOp::WriteWithImm { remote, .. } => {
                let (code, imm) = match *op {
                    WrOp::WriteWithImm { imm, .. } => (Opcode::WriteImm, imm),
                    _ => (Opcode::Write, 0),
                };
                let mut h = Header::new(code, 0, total as u32);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.imm = imm;
                (WcOpcode::Write, h, spans, Spans::new())
            }
            WrOp::Send | WrOp::SendWithImm { .. } => {
                let (code, imm) = match *op {
                    WrOp::SendWithImm { imm } => (Opcode::SendImm, imm),
                    _ => (Opcode::Send, 0),
                };
                let mut h = Header::new(code, 0, total as u32);
                h.imm = imm;
                (WcOpcode::Send, h, spans, Spans::new())
            }
            WrOp::Read { remote } => {
                let mut h = Header::new(Opcode::ReadReq, 0, total as u32);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                (WcOpcode::Read, h, Spans::new(), spans)
            }
            WrOp::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                let mut h = Header::new(Opcode::Cas, 0, 8);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.a = compare;
                h.b = swap;
                (WcOpcode::CompareSwap, h, Spans::new(), spans)
            }
            WrOp::FetchAdd { remote, add } => {
                let mut h = Header::new(Opcode::Faa, 0, 8);
                h.addr = remote.addr;
                h.rkey = remote.rkey;
                h.a = add;
                (WcOpcode::FetchAdd, h, Spans::new(), spans)
            }
        };
        if signaled {
            h.flags = ACK_REQ;
        }
        // The regions are kept by what reads or writes them once this call has returned: a
        // frame that waits its payload, the record of the request where its answer lands
        // (READ, atomics).
        let answer_keep = if dst.is_empty() { Keep::new() } else { keep() };
        let o = Outstanding {
            seq: 0,
            wr_id,
            opcode,
            len: total as u32,
            signaled,
            dst,
            _keep: answer_keep,
            error: None,
        };
        // Frames go out in sequence order on every connection (under the post lock).
        self.sendq.post(
            o,
            || qp_failed() || self.dead.load(Ordering::Acquire),
            |seq| {
                h.seq = seq;
                let k = self.socks().len();
                if k > 1
                    && total >= STRIPE_MIN
                    && matches!(h.opcode, Opcode::Write | Opcode::WriteImm)
                {
                    self.post_striped(h, &payload, &keep(), k);
                } else {
                    let f = TxFrame::new(&h, payload, Keep::new());
                    self.queue_then(0, f, |f| f.keep = keep());
                }
            },
        )
    }

    /// Cuts a WRITE (or a READ's data) into one part per connection (4 KiB aligned) and queues
    /// part `j` on connection `j`. Called under the post lock (a WRITE) or the target's state
    /// lock (READ data), so that frames go out in sequence order on every connection.
    pub(super) fn post_striped(&self, h: Header, payload: &[Span], keep: &Keep, k: usize) {
        let total = h.len as usize;
        let part = total.div_ceil(k).next_multiple_of(4096);
        let parts = total.div_ceil(part);
        for j in 0..parts {
            let (lo, hi) = (j * part, ((j + 1) * part).min(total));
            let sub = sub_spans(payload, lo, hi);
            let mut p = h;
            p.len = (hi - lo) as u32;
            p.addr = h.addr + lo as u64;
            p.set_part(Part {
                index: j as u32,
                count: parts as u32,
                total: total as u32,
                base: h.addr,
            });
            self.queue(j, TxFrame::new(&p, sub, keep.clone()));
        }
    }
}

/// The bytes `lo..hi` of what `spans` cover, as spans.
pub(super) fn sub_spans(spans: &[Span], lo: usize, hi: usize) -> Spans {
    let mut sub = Spans::new();
    let mut at = 0usize;
    for s in spans {
        let (a, b) = (at.max(lo), (at + s.1).min(hi));
        if a < b {
            // SAFETY: `a - at < s.1`: the pointer stays inside the span.
            sub.push(Span(unsafe { s.0.add(a - at) }, b - a));
        }
        at += s.1;
    }
    sub
}
