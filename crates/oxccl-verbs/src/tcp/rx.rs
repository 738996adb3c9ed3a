//! The receiving side of a queue pair's connections: reading frames, executing requests in
//! order (across connections), and taking the answers to our own requests.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io::IoSliceMut;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use smallvec::{SmallVec, smallvec};

use super::STRIPE_MIN;
use super::conn::Conn;
use oxccl_seal::{HEADER_LEN as SEAL_HEADER, MAX_RECORD, Opener, SealError, TAG_LEN};

use super::frame::{ACK_EVERY, ACK_REQ, FINISHED, HEADER_LEN, Header, Opcode, PART};
use super::tx::TxFrame;
use crate::contract::sendq::{Keep, Spans};
use crate::contract::{MrInner, QpInner, Span, Writing, key_index};
use crate::model::{AccessFlags, MAX_SGE, WcOpcode, WcStatus};

/// Bytes a connection reads ahead: a small frame, header and payload, costs one `recv`.
const STAGE: usize = 64 << 10;
/// A payload with at least this much left to read is read straight into its target.
const DIRECT: usize = 16 << 10;
/// After a frame with a payload of at least [`DIRECT`] bytes, this many following frames are
/// read exactly: a header alone, a small payload with the next header, so that the next large
/// payload is not read ahead into the stage (and copied from there) but straight into its
/// target. The stream of a large transfer (256 KiB fragments, with credits between them) then
/// costs no copy in user space and no more `recv`s than reading ahead did (two a fragment),
/// where reading ahead copied the first 64 KiB of each fragment through the stage. A stream of
/// small frames alone reads ahead as before (one `recv` for many frames).
const EXACT_AFTER_BIG: u8 = 8;

/// What happens once a request has been executed.
enum After {
    /// A WRITE placed: nothing else to do.
    Nothing,
    /// Complete receive `slot` (WRITE_WITH_IMM or SEND).
    Recv {
        slot: u64,
        opcode: WcOpcode,
        imm: Option<u32>,
    },
}

/// What a payload that has all landed completes.
enum Done {
    /// Request `seq`.
    Request { seq: u64, after: After },
    /// A part of striped request `seq`.
    Part { seq: u64 },
    /// READ `seq` of ours has all its data.
    ReadData { seq: u64 },
    /// A part of READ `seq`'s data, striped over the connections, has landed.
    ReadPart { seq: u64 },
}

enum RxState {
    Header {
        buf: [u8; HEADER_LEN],
        got: usize,
    },
    Payload {
        dst: Spans,
        got: usize,
        total: usize,
        done: Done,
        _keep: Keep,
        /// A WRITE's announcement to its region (deregistering waits for it).
        _writing: Option<Writing>,
    },
    /// Waiting for a receive to be posted (receiver not ready) since `since`.
    Stalled {
        hdr: Header,
        since: Instant,
    },
    /// Waiting for an earlier request (on another connection) to be executed.
    Blocked {
        hdr: Header,
    },
    Discard {
        left: usize,
    },
}

const FRESH: RxState = RxState::Header {
    buf: [0; HEADER_LEN],
    got: 0,
};

/// One connection's receive side.
pub(super) struct Rx {
    state: RxState,
    /// Read-ahead: `stage[lo..hi]` is received and not yet used (on a sealed connection:
    /// authenticated plaintext).
    stage: Vec<u8>,
    lo: usize,
    hi: usize,
    /// The most bytes the next [`Rx::fill`] reads (then back to [`STAGE`]).
    cap: usize,
    /// Frames still to read exactly since the last large payload ([`EXACT_AFTER_BIG`]).
    exact: u8,
    /// A sealed connection's receiving keys and the ciphertext read ahead.
    seal: Option<Box<RxSeal>>,
}

/// The receiving half of a sealed connection. Its ciphertext is read ahead into the stage
/// itself, at `stage[lo..hi]` of this struct; the next whole record there is authenticated and
/// decrypted in place, and only then does its plaintext become the stage's readable window
/// (`Rx::lo..Rx::hi`) for the frame parser: nothing of a record is parsed, let alone reaches
/// target memory, before its tag checked, and no byte is copied on the way but the parser's
/// own copy into the target.
struct RxSeal {
    opener: Opener,
    /// Ciphertext read ahead and not yet opened: `Rx::stage[lo..hi]`.
    lo: usize,
    hi: usize,
    /// The peer's first record (key confirmation) was read.
    confirmed: bool,
    /// The connection, for errors: "sealed connection 1 with 10.0.0.2:4711".
    what: String,
}

/// A whole record, header to tag.
const RECORD_MAX: usize = SEAL_HEADER + MAX_RECORD + TAG_LEN;
/// A sealed connection's stage: four whole records of ciphertext (a partial record is moved
/// to the front only when it would not fit after the records before it).
const SEALED_STAGE: usize = 4 * RECORD_MAX;

/// Why a read of the socket into the stage failed.
enum Fill {
    Os(rustix::io::Errno),
    /// A record failed (the reason, naming the connection and the record).
    Sealed(String),
}

/// A striped request being placed.
struct Striped {
    seq: u64,
    /// Parts not yet landed.
    left: u32,
    /// The request's length.
    total: u32,
    after: After,
    /// The request's address and its target memory there.
    base: u64,
    ptr: *mut u8,
    /// Its announcement to the region (which it holds), until the last part has landed.
    writing: Writing,
}

// SAFETY: `ptr` points into the region that `writing` keeps alive; it is used only under the
// queue pair's `Exec` lock (several shards' drivers may read the queue pair's connections).
unsafe impl Send for Striped {}

/// The initiator's record of what the target answered: how far it executed our requests, and
/// which answers that carry data have all landed.
#[derive(Default)]
pub(super) struct Answers {
    /// The target executed every request of ours up to this one.
    seen: u64,
    /// READs and atomics whose data has landed, not yet completed (they complete in order).
    landed: BTreeSet<u64>,
    /// READs whose data comes striped: the parts still to land.
    parts: HashMap<u64, u32>,
    /// A NAK waiting for the requests before it to complete.
    nak: Option<(u64, WcStatus)>,
}

/// A request that started and is not done yet.
struct Open {
    seq: u64,
    /// The target range it writes (`lo..hi`).
    lo: u64,
    hi: u64,
    /// A WRITE without an immediate (a later one may start while it lands).
    plain: bool,
    /// It has all landed (it is done once every earlier request is).
    landed: bool,
    /// It asked for an ACK.
    ack: bool,
}

/// The target's side of a queue pair: which requests are executed, what was acknowledged.
///
/// Requests start in order (their headers are executed one after the other) and are done in
/// order. A WRITE without an immediate may start while earlier WRITEs without one still land
/// (on other connections), unless their ranges overlap, so that the connections of a queue
/// pair carry a stream of striped WRITEs in parallel; every other request starts once every
/// earlier one is done (a receive completes, a READ reads, an atomic acts after the WRITEs
/// before it).
#[derive(Default)]
pub(super) struct Exec {
    done_seq: u64,
    /// Every request up to this one has started.
    started: u64,
    acked_seq: u64,
    /// A request that asked for an ACK was executed.
    ack_due: bool,
    /// The initiator asked for an ACK of every request up to this one ([`Opcode::AckReq`]).
    ack_upto: u64,
    /// After a NAK every later request of the queue pair is dropped.
    dropping: bool,
    /// Striped requests under way, by sequence number.
    striped: BTreeMap<u64, Striped>,
    /// Requests started and not done, oldest first (a queue that keeps its room: the
    /// small-message path allocates nothing).
    open: VecDeque<Open>,
    /// The region the last request found, by its rkey: a stream of requests into one region
    /// (every step of a collective) looks it up once, not in the context's table each time.
    region: Option<(u64, Weak<MrInner>)>,
}

impl Exec {
    /// Whether request `h` (the next to start) may start now: when every earlier request is
    /// done, or, for a WRITE without an immediate, when every request under way is one too and
    /// none of them writes where it writes.
    fn may_start(&self, h: &Header) -> bool {
        if self.done_seq == self.started {
            return true;
        }
        if h.opcode != Opcode::Write {
            return false;
        }
        let Some((lo, hi)) = write_range(h) else {
            return false;
        };
        self.open
            .iter()
            .all(|o| o.plain && (hi <= o.lo || lo >= o.hi))
    }

    /// Request `seq` started: it is done once it has landed and every earlier one is done.
    fn start(&mut self, h: &Header) {
        self.started = h.seq;
        let (lo, hi) = write_range(h).unwrap_or((0, 0));
        self.open.push_back(Open {
            seq: h.seq,
            lo,
            hi,
            plain: h.opcode == Opcode::Write,
            landed: false,
            ack: h.flags & ACK_REQ != 0,
        });
    }

    /// The ACK due now, if one is (it is then counted as sent): a request that asked for one
    /// is done, [`ACK_EVERY`] requests are, or the initiator asked ([`Opcode::AckReq`]).
    fn take_ack(&mut self) -> Option<u64> {
        let due = self.done_seq > self.acked_seq
            && (self.ack_due
                || self.done_seq - self.acked_seq >= ACK_EVERY
                || self.ack_upto > self.acked_seq);
        self.ack_due = false;
        if due {
            self.acked_seq = self.done_seq;
        }
        due.then_some(self.done_seq)
    }

    /// Request `seq` has all landed: the requests done in order from the oldest are done.
    fn finish(&mut self, seq: u64) {
        if let Some(o) = self.open.iter_mut().find(|o| o.seq == seq) {
            o.landed = true;
        }
        while let Some(o) = self.open.front() {
            if o.seq != self.done_seq + 1 || !o.landed {
                break;
            }
            self.done_seq = o.seq;
            self.ack_due |= o.ack;
            self.open.pop_front();
        }
    }
}

/// The target range a WRITE request writes (all of a striped one's), if its fields make one.
fn write_range(h: &Header) -> Option<(u64, u64)> {
    let (lo, len) = if h.flags & PART != 0 {
        let p = h.part()?;
        (p.base, p.total as u64)
    } else {
        (h.addr, h.len as u64)
    };
    Some((lo, lo.checked_add(len)?))
}

impl Rx {
    pub fn new() -> Rx {
        Rx {
            state: FRESH,
            stage: Vec::new(),
            lo: 0,
            hi: 0,
            cap: STAGE,
            exact: 0,
            seal: None,
        }
    }

    /// From now on the connection's bytes are records opened with `opener`; `confirmed`: the
    /// peer's key confirmation record was already read (else the first record must be it).
    pub fn seal(&mut self, opener: Opener, confirmed: bool, what: String) {
        self.seal = Some(Box::new(RxSeal {
            opener,
            lo: 0,
            hi: 0,
            confirmed,
            what,
        }));
    }

    /// [`Rx::fill`] of a sealed connection: opens the next whole record read ahead (reading
    /// the socket when there is none) and makes its plaintext the stage's readable window.
    /// Called when the frame parser has used every staged byte (it asks for more only then).
    /// `Ok((n, drained))`: `n` plaintext bytes staged (0: the peer closed), `drained`: nothing
    /// more to read or open now.
    fn fill_sealed(&mut self, sock: &TcpStream) -> Result<(usize, bool), Fill> {
        let Some(sl) = self.seal.as_deref_mut() else {
            return Ok((0, true));
        };
        if self.lo != self.hi {
            return Err(Fill::Sealed(format!(
                "{}: internal error: the receive side asked for a record with {} bytes of the \
                 last one unread",
                sl.what,
                self.hi - self.lo
            )));
        }
        (self.lo, self.hi) = (0, 0);
        if self.stage.len() < SEALED_STAGE {
            // First use: nothing read ahead yet.
            self.stage = vec![0; SEALED_STAGE];
            (sl.lo, sl.hi) = (0, 0);
        }
        let mut dry = false;
        loop {
            if let Some(len) = sl.whole_record(&self.stage)? {
                let header: [u8; SEAL_HEADER] = self.stage[sl.lo..sl.lo + SEAL_HEADER]
                    .try_into()
                    .unwrap_or([0; SEAL_HEADER]);
                let start = sl.lo + SEAL_HEADER;
                let n = match sl
                    .opener
                    .open_record(&header, &mut self.stage[start..start + len])
                {
                    Ok(plain) if sl.confirmed || plain == FINISHED => plain.len(),
                    Ok(_) => {
                        return Err(Fill::Sealed(format!(
                            "{}: key confirmation failed: the peer's first record is not the \
                             handshake's end",
                            sl.what
                        )));
                    }
                    Err(e) => return Err(sl.failed(&e)),
                };
                sl.lo = start + len;
                if !sl.confirmed {
                    sl.confirmed = true;
                    continue;
                }
                if n == 0 {
                    continue;
                }
                (self.lo, self.hi) = (start, start + n);
                // A bad next header is this record's successor's failure: reported by the next
                // call, after this record's plaintext was used.
                let ready = !matches!(sl.whole_record(&self.stage), Ok(None));
                return Ok((n, dry && !ready));
            }
            if dry {
                return Err(Fill::Os(rustix::io::Errno::AGAIN));
            }
            // No whole record: read more ciphertext. The partial record moves to the front
            // first (nothing of the stage is readable now) only when it could not be completed
            // where it is: most reads append after it and copy nothing.
            if sl.lo == sl.hi {
                (sl.lo, sl.hi) = (0, 0);
            } else if sl.lo + sl.pending_len(&self.stage) > self.stage.len() {
                self.stage.copy_within(sl.lo..sl.hi, 0);
                (sl.lo, sl.hi) = (0, sl.hi - sl.lo);
            }
            let room = self.stage.len() - sl.hi;
            match rustix::net::recv(
                sock,
                &mut self.stage[sl.hi..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((0, _)) => return Ok((0, true)),
                Ok((n, _)) => {
                    sl.hi += n;
                    dry = n < room;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Fill::Os(e)),
            }
        }
    }

    fn staged(&self) -> usize {
        self.hi - self.lo
    }

    /// Nothing is read ahead and no frame begun: the next bytes start a header.
    fn at_rest(&self) -> bool {
        self.lo == self.hi && matches!(self.state, RxState::Header { got: 0, .. })
    }

    /// Takes up to `out.len()` staged bytes into `out`.
    fn take(&mut self, out: &mut [u8]) -> usize {
        let k = out.len().min(self.staged());
        out[..k].copy_from_slice(&self.stage[self.lo..self.lo + k]);
        self.lo += k;
        k
    }

    /// Copies staged payload bytes into `dst` at payload offset `got` (of `total`).
    fn copy_out(&mut self, dst: &[Span], got: usize, total: usize) -> usize {
        let mut want = (total - got).min(self.staged());
        let n = want;
        let mut skip = got;
        for s in dst {
            if want == 0 {
                break;
            }
            if skip >= s.1 {
                skip -= s.1;
                continue;
            }
            let k = (s.1 - skip).min(want);
            // SAFETY: each span is a validated range of a live registered region (kept alive by
            // the frame state that owns `dst`); `skip + k <= s.1`; the stage holds `k` bytes.
            unsafe {
                crate::contract::copy_bytes(self.stage.as_ptr().add(self.lo), s.0.add(skip), k)
            };
            self.lo += k;
            want -= k;
            skip = 0;
        }
        n
    }

    /// Reads from the socket into the stage, at most [`Rx::cap`] bytes (which then returns
    /// to [`STAGE`]); `Ok(n)` with whether the socket gave less than asked (nothing more to
    /// read now).
    fn fill(&mut self, sock: &TcpStream) -> Result<(usize, bool), rustix::io::Errno> {
        self.ready_stage();
        if self.lo > 0 {
            self.stage.copy_within(self.lo..self.hi, 0);
            (self.lo, self.hi) = (0, self.hi - self.lo);
        }
        let room = (STAGE - self.hi).min(std::mem::replace(&mut self.cap, STAGE).max(1));
        let (n, _) = rustix::net::recv(
            sock,
            &mut self.stage[self.hi..self.hi + room],
            rustix::net::RecvFlags::DONTWAIT,
        )?;
        self.hi += n;
        Ok((n, n < room))
    }

    /// Allocates the stage on first use; rewinds it when it holds nothing unread.
    fn ready_stage(&mut self) {
        if self.stage.is_empty() {
            self.stage = vec![0; STAGE];
        }
        if self.lo == self.hi {
            (self.lo, self.hi) = (0, 0);
        }
    }

    /// A header was read whose frame carries `payload` bytes: after a large one, the next
    /// frames are read exactly ([`EXACT_AFTER_BIG`]).
    fn saw_frame(&mut self, payload: usize) {
        self.exact = if payload >= DIRECT {
            EXACT_AFTER_BIG
        } else {
            self.exact.saturating_sub(1)
        };
    }

    /// Limits the next [`Rx::fill`] to `want` bytes while frames are read exactly (else it
    /// reads as much as the stage holds).
    fn read_exactly(&mut self, want: usize) {
        self.cap = if self.exact > 0 && self.seal.is_none() {
            want
        } else {
            STAGE
        };
    }
}

impl RxSeal {
    /// The body length of the record at `stage[lo..]` when it is all there (its header
    /// checked: length within bounds, the next sequence number).
    fn whole_record(&self, stage: &[u8]) -> Result<Option<usize>, Fill> {
        if self.hi - self.lo < SEAL_HEADER {
            return Ok(None);
        }
        let header: [u8; SEAL_HEADER] = stage[self.lo..self.lo + SEAL_HEADER]
            .try_into()
            .unwrap_or([0; SEAL_HEADER]);
        let len = self
            .opener
            .check_header(&header)
            .map_err(|e| self.failed(&e))?;
        Ok((self.hi - self.lo >= SEAL_HEADER + len).then_some(len))
    }

    /// The whole length of the partial record at `stage[lo..hi]`, header to tag, once its
    /// header is there ([`RECORD_MAX`] before; a bad header is found by `whole_record`).
    fn pending_len(&self, stage: &[u8]) -> usize {
        let Some(header) = stage.get(self.lo..self.lo + SEAL_HEADER) else {
            return RECORD_MAX;
        };
        let header: [u8; SEAL_HEADER] = header.try_into().unwrap_or([0; SEAL_HEADER]);
        match self.opener.check_header(&header) {
            Ok(len) if self.hi - self.lo >= SEAL_HEADER => SEAL_HEADER + len,
            _ => RECORD_MAX,
        }
    }

    /// A record that failed: the error names the connection, the peer and what failed.
    fn failed(&self, e: &SealError) -> Fill {
        Fill::Sealed(if self.confirmed {
            format!("{}: {e}", self.what)
        } else {
            format!(
                "{}: key confirmation failed: {e}: the peer has another job key, or the \
                 handshake was altered on the path",
                self.what
            )
        })
    }
}

/// How a read pass ended early.
enum Stop {
    /// Nothing more to read now.
    Idle,
    /// The connection failed (the reason).
    Failed(String),
    /// The peer closed the connection, or it broke (the reason): what the peer sent before,
    /// on this queue pair's other connections, is executed first ([`Conn::lost`]).
    Lost(String),
}

impl Conn {
    /// Reads and executes frames of connection `i` until there is nothing more to read.
    pub(super) fn on_readable(&self, i: usize) {
        // A failed connection is still read while what the peer sent before is delivered.
        if self.dead.load(Ordering::Acquire) && !self.draining() {
            return;
        }
        self.read_frames(i);
    }

    /// Reads connection `i`, then the connections that waited for what it executed. (What
    /// they make due is acknowledged where it becomes due: [`Conn::done_locked`], an ACK
    /// request.)
    pub(super) fn read_frames(&self, i: usize) {
        let mine = self.socks().get(i).map_or(0, |s| s.shard);
        let mut again = self.read_socket(i);
        while again {
            again = false;
            for (j, s) in self.socks().iter().enumerate() {
                if !s.stalled.load(Ordering::Acquire) {
                    continue;
                }
                if s.shard == mine {
                    again |= self.read_socket(j);
                } else if let Some(sh) = self.shared.upgrade() {
                    // Another shard's connection: its own driver reads it, in parallel with
                    // this one.
                    sh.kick_shard(s.shard);
                }
            }
        }
    }

    /// Reads and executes frames of connection `i` until the socket has nothing more, fails or
    /// closes, or the connection must wait. Returns whether a request was executed.
    fn read_socket(&self, i: usize) -> bool {
        let Some(s) = self.socks().get(i) else {
            return false;
        };
        let Some(sock) = s.stream.get() else {
            return false;
        };
        let mut rx = s.rx.lock().unwrap_or_else(|e| e.into_inner());
        let mut executed = false;
        let mut idle = false;
        // Looked up once something has come: most polls of a waiting rank find nothing.
        let mut qp: Option<Arc<QpInner>> = None;
        let r = loop {
            if rx.at_rest() {
                // Nothing read ahead and no frame begun: one `recv` says whether anything came.
                rx.read_exactly(HEADER_LEN);
                match Self::more(&mut rx, sock, &mut idle) {
                    Ok(()) => {}
                    Err(Stop::Idle) => break Ok(()),
                    Err(e) => break Err(e),
                }
            }
            if qp.is_none() {
                qp = self.qp.upgrade();
            }
            let Some(qp) = qp.as_deref() else {
                break Ok(());
            };
            match self.step(qp, i, sock, &mut rx, &mut idle, &mut executed) {
                Ok(true) => continue,
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        drop(rx);
        match r {
            Err(Stop::Failed(why)) => self.fail(&why),
            Err(Stop::Lost(why)) => self.lost(i, &why),
            _ => {}
        }
        executed
    }

    /// Reads more into the stage, unless the socket already said it has nothing more.
    fn more(rx: &mut Rx, sock: &TcpStream, idle: &mut bool) -> Result<(), Stop> {
        if *idle {
            return Err(Stop::Idle);
        }
        let r = if rx.seal.is_some() {
            match rx.fill_sealed(sock) {
                Err(Fill::Sealed(why)) => return Err(Stop::Failed(why)),
                Err(Fill::Os(e)) => Err(e),
                Ok(r) => Ok(r),
            }
        } else {
            rx.fill(sock)
        };
        match r {
            Ok((0, _)) => Err(Stop::Lost(match rx.seal.as_deref() {
                Some(sl) if !sl.confirmed => format!(
                    "{}: the peer closed the connection before confirming the keys (it has \
                     another job key, or refused ours)",
                    sl.what
                ),
                _ => {
                    "the peer closed the connection (process exited or queue pair destroyed)".into()
                }
            })),
            Ok((_, drained)) => {
                *idle = drained;
                Ok(())
            }
            Err(rustix::io::Errno::AGAIN) => {
                // Nothing to read now: the rest of this pass does not ask again (a payload
                // waiting for its next bytes would otherwise spin on `recv`).
                *idle = true;
                Err(Stop::Idle)
            }
            Err(rustix::io::Errno::INTR) => Ok(()),
            Err(e) => Err(Stop::Lost(format!("receiving from the peer failed: {e}"))),
        }
    }

    /// One step of connection `i`'s receive state machine. `Ok(false)`: wait for more.
    fn step(
        &self,
        qp: &QpInner,
        i: usize,
        sock: &TcpStream,
        rx: &mut Rx,
        idle: &mut bool,
        executed: &mut bool,
    ) -> Result<bool, Stop> {
        let state = std::mem::replace(&mut rx.state, RxState::Discard { left: 0 });
        match state {
            RxState::Header { mut buf, mut got } => {
                got += rx.take(&mut buf[got..]);
                if got < HEADER_LEN {
                    rx.state = RxState::Header { buf, got };
                    rx.read_exactly(HEADER_LEN - got);
                    return match Self::more(rx, sock, idle) {
                        Ok(()) => Ok(true),
                        Err(Stop::Idle) => Ok(false),
                        Err(e) => Err(e),
                    };
                }
                let h = Header::decode(&buf)
                    .map_err(|e| Stop::Failed(format!("malformed frame from the peer: {e}")))?;
                rx.saw_frame(h.payload_len());
                if h.ack != 0 && !qp.is_failed() {
                    // An ACK riding on the peer's frame.
                    self.acked(qp, h.ack);
                }
                *executed |= self.begin(qp, i, rx, h).map_err(Stop::Failed)?;
                Ok(true)
            }
            RxState::Payload {
                dst,
                mut got,
                total,
                done,
                _keep,
                _writing,
            } => {
                if got < total {
                    if rx.staged() > 0 {
                        got += rx.copy_out(&dst, got, total);
                    } else if *idle {
                        rx.state = RxState::Payload {
                            dst,
                            got,
                            total,
                            done,
                            _keep,
                            _writing,
                        };
                        return Ok(false);
                    } else if total - got >= DIRECT && rx.seal.is_none() {
                        // The next frame's header rides along into the (empty) stage.
                        rx.ready_stage();
                        match read_spans(sock, &dst, got, total, &mut rx.stage[..HEADER_LEN]) {
                            Ok(0) => {
                                return Err(Stop::Lost(
                                    "the peer closed the connection mid-frame".into(),
                                ));
                            }
                            Ok(n) => {
                                let rest = total - got;
                                *idle = n < rest + HEADER_LEN;
                                got += n.min(rest);
                                rx.hi = n.saturating_sub(rest);
                            }
                            Err(rustix::io::Errno::AGAIN) => *idle = true,
                            Err(rustix::io::Errno::INTR) => {}
                            Err(e) => {
                                return Err(Stop::Lost(format!(
                                    "receiving from the peer failed: {e}"
                                )));
                            }
                        }
                    } else {
                        // The rest of the payload and the next header.
                        rx.read_exactly(total - got + HEADER_LEN);
                        match Self::more(rx, sock, idle) {
                            Ok(()) | Err(Stop::Idle) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                if got < total {
                    rx.state = RxState::Payload {
                        dst,
                        got,
                        total,
                        done,
                        _keep,
                        _writing,
                    };
                    return Ok(true);
                }
                rx.state = FRESH;
                *executed |= self.landed(qp, done, total);
                Ok(true)
            }
            RxState::Discard { left } => {
                if left == 0 {
                    rx.state = FRESH;
                    return Ok(true);
                }
                let k = left.min(rx.staged());
                rx.lo += k;
                rx.state = RxState::Discard { left: left - k };
                rx.cap = STAGE;
                if left - k > 0 {
                    return match Self::more(rx, sock, idle) {
                        Ok(()) => Ok(true),
                        Err(Stop::Idle) => Ok(false),
                        Err(e) => Err(e),
                    };
                }
                Ok(true)
            }
            RxState::Stalled { hdr, since } => {
                let budget = self.peer_rnr_us.load(Ordering::Relaxed);
                let dropping = self.exec.lock().unwrap_or_else(|e| e.into_inner()).dropping;
                if dropping || qp.recv_available() {
                    self.set_stalled(i, false);
                    *executed |= self.begin(qp, i, rx, hdr).map_err(Stop::Failed)?;
                    Ok(true)
                } else if budget != 0 && since.elapsed() >= Duration::from_micros(budget) {
                    self.set_stalled(i, false);
                    let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());
                    self.nak(&mut ex, hdr.seq, WcStatus::RnrRetryExceeded);
                    drop(ex);
                    rx.state = RxState::Discard {
                        left: hdr.payload_len(),
                    };
                    Ok(true)
                } else {
                    rx.state = RxState::Stalled { hdr, since };
                    self.set_stalled(i, true);
                    Ok(false)
                }
            }
            RxState::Blocked { hdr } => {
                self.set_stalled(i, false);
                *executed |= self.begin(qp, i, rx, hdr).map_err(Stop::Failed)?;
                Ok(!matches!(rx.state, RxState::Blocked { .. }))
            }
        }
    }

    /// Stops (or resumes) watching connection `i`'s input while it waits. The caller holds
    /// connection `i`'s receive side; the interest is set under its send lock, so that the
    /// last change wins.
    fn set_stalled(&self, i: usize, on: bool) {
        let s = &self.socks()[i];
        if s.stalled.swap(on, Ordering::AcqRel) == on {
            return;
        }
        let tx = s.tx.lock().unwrap_or_else(|e| e.into_inner());
        self.set_interest(i, tx.want_out);
    }

    /// NAKs request `seq` (the caller holds the target's state): the target drops every later
    /// request. Once only: with several readers two parts of one request may both fail.
    fn nak(&self, ex: &mut Exec, seq: u64, status: WcStatus) {
        if ex.dropping {
            return;
        }
        ex.dropping = true;
        ex.striped.clear();
        ex.open.clear();
        ex.acked_seq = seq;
        let mut h = Header::new(Opcode::Nak, seq, 0);
        h.a = status as u64;
        self.queue(0, TxFrame::header(&h));
    }

    /// A receive was posted: if a connection waits for one, let its shard's driver retry.
    pub(crate) fn receive_posted(&self) {
        let Some(sh) = self.shared.upgrade() else {
            return;
        };
        let mut kicked = 0u64;
        for s in self.socks() {
            if s.stalled.load(Ordering::Acquire) && kicked & (1 << (s.shard % 64)) == 0 {
                kicked |= 1 << (s.shard % 64);
                sh.kick_shard(s.shard);
            }
        }
    }

    /// Looks up a target region for `len` bytes at (`addr`, `rkey`) and checks access and
    /// bounds: the region the last request found (`ex.region`) if the rkey is its own and it
    /// is still registered, else the context's table's.
    fn target(
        &self,
        ex: &mut Exec,
        addr: u64,
        rkey: u64,
        len: usize,
        need: AccessFlags,
    ) -> Option<(Arc<MrInner>, *mut u8)> {
        let last = match &ex.region {
            Some((key, mr)) if *key == rkey => mr.upgrade().filter(|mr| mr.is_registered()),
            _ => None,
        };
        let mr = match last {
            Some(mr) => mr,
            None => {
                let shared = self.shared.upgrade()?;
                let mr = shared
                    .regions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key_index(rkey))
                    .and_then(Weak::upgrade)?;
                if mr.rkey == rkey {
                    ex.region = Some((rkey, Arc::downgrade(&mr)));
                }
                mr
            }
        };
        if mr.rkey != rkey || !mr.is_registered() || !mr.access.contains(need) {
            return None;
        }
        let off = addr.checked_sub(mr.addr)?;
        if off.checked_add(len as u64)? > mr.len as u64 {
            return None;
        }
        let p = (mr.addr + off) as usize as *mut u8;
        Some((mr, p))
    }

    /// Starts executing a frame whose header just arrived on connection `i`. Returns whether a
    /// request was executed (one with no payload).
    ///
    /// The target's state ([`Exec`]) is held from the decision to its effect: with several
    /// progress shards, two connections of the queue pair are read at once, and two parts of
    /// one striped request must not both start it (nor claim a receive each).
    fn begin(
        &self,
        qp: &QpInner,
        i: usize,
        rx: &mut Rx,
        h: Header,
    ) -> std::result::Result<bool, String> {
        if !h.opcode.is_request() {
            self.answer(qp, rx, h)?;
            return Ok(false);
        }
        let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        if ex.dropping {
            rx.state = RxState::Discard {
                left: h.payload_len(),
            };
            return Ok(false);
        }
        if h.flags & PART != 0
            && let Some(cur) = ex.striped.get_mut(&h.seq)
        {
            // Another part of the striped request under way: validated with the request.
            let part = h.part().ok_or("a part without its fields")?;
            if part.base != cur.base {
                return Err(format!("part of request {} at another address", h.seq));
            }
            // SAFETY: `part()` checked `addr..addr+len` lies in `base..base+total`, which was
            // validated against the region when the request started.
            let p = unsafe { cur.ptr.add((h.addr - cur.base) as usize) };
            rx.state = RxState::Payload {
                dst: smallvec![Span(p, h.len as usize)],
                got: 0,
                total: h.len as usize,
                done: Done::Part { seq: h.seq },
                _keep: smallvec![cur.writing.region().clone()],
                _writing: None,
            };
            return Ok(false);
        }
        if h.seq <= ex.started {
            return Err(format!(
                "request {} again (requests up to {} were started)",
                h.seq, ex.started
            ));
        }
        if h.seq != ex.started + 1 || !ex.may_start(&h) {
            if self.socks().len() > 1 {
                // An earlier request has not started, or is not done: it comes on another
                // connection. Marked stalled before the state is let go, so that the reader
                // that starts or finishes the earlier request sees the mark
                // ([`Conn::read_frames`]) and wakes this one.
                rx.state = RxState::Blocked { hdr: h };
                self.set_stalled(i, true);
                return Ok(false);
            }
            return Err(format!(
                "request sequence {} out of order (expected {})",
                h.seq,
                ex.started + 1
            ));
        }
        self.execute(qp, i, rx, h, &mut ex)
    }

    /// Fails request `h` with `status`: NAKs it and discards its payload.
    fn refuse(
        &self,
        rx: &mut Rx,
        ex: &mut Exec,
        h: &Header,
        status: WcStatus,
    ) -> std::result::Result<bool, String> {
        self.nak(ex, h.seq, status);
        rx.state = RxState::Discard {
            left: h.payload_len(),
        };
        Ok(false)
    }

    /// Executes request `h`, the next in order (its payload, if any, follows).
    fn execute(
        &self,
        qp: &QpInner,
        i: usize,
        rx: &mut Rx,
        h: Header,
        ex: &mut Exec,
    ) -> std::result::Result<bool, String> {
        match h.opcode {
            Opcode::Write | Opcode::WriteImm => self.execute_write(qp, i, rx, h, ex),
            Opcode::Send | Opcode::SendImm => self.execute_send(qp, rx, h, ex),
            Opcode::ReadReq => {
                let Some((mr, p)) =
                    self.target(ex, h.addr, h.rkey, h.len as usize, AccessFlags::REMOTE_READ)
                else {
                    return self.refuse(rx, ex, &h, WcStatus::RemoteAccessError);
                };
                responded(ex, h.seq);
                let mut data = Header::new(Opcode::ReadResp, h.seq, h.len);
                let spans: Spans = smallvec![Span(p, h.len as usize)];
                let keep: Keep = smallvec![mr];
                let k = self.socks().len();
                if k > 1 && h.len as usize >= STRIPE_MIN {
                    // Striped like a WRITE: one part per connection, read by the initiator's
                    // shards in parallel.
                    data.addr = h.addr;
                    self.post_striped(data, &spans, &keep, k);
                } else {
                    self.queue(0, TxFrame::new(&data, spans, keep));
                }
                rx.state = FRESH;
                Ok(true)
            }
            Opcode::Cas | Opcode::Faa => self.execute_atomic(rx, h, ex),
            _ => Err(format!("{:?} is not a request", h.opcode)),
        }
    }

    /// Executes a WRITE or WRITE_WITH_IMM, whole or the first part to arrive of a striped one.
    fn execute_write(
        &self,
        qp: &QpInner,
        i: usize,
        rx: &mut Rx,
        h: Header,
        ex: &mut Exec,
    ) -> std::result::Result<bool, String> {
        let part = if h.flags & PART != 0 {
            Some(h.part().ok_or("a part without its fields")?)
        } else {
            None
        };
        let (base, len) = part.map_or((h.addr, h.len as usize), |p| (p.base, p.total as usize));
        // Held until the request has landed (all its parts): deregistering the region waits for
        // it, so that nothing of it lands afterwards.
        let target = self
            .target(ex, base, h.rkey, len, AccessFlags::REMOTE_WRITE)
            .and_then(|(mr, p)| Some((Writing::begin(mr)?, p)));
        let Some((writing, p)) = target else {
            if ex.done_seq != ex.started {
                // Started early: a NAK must not pass the WRITEs still landing. It waits for
                // them, and is NAKed as the next request.
                rx.state = RxState::Blocked { hdr: h };
                self.set_stalled(i, true);
                return Ok(false);
            }
            return self.refuse(rx, ex, &h, WcStatus::RemoteAccessError);
        };
        let after = if h.opcode == Opcode::WriteImm {
            let Some(slot) = qp.claim_recv() else {
                rx.state = RxState::Stalled {
                    hdr: h,
                    since: Instant::now(),
                };
                return Ok(false);
            };
            After::Recv {
                slot,
                opcode: WcOpcode::RecvRdmaWithImm,
                imm: Some(h.imm),
            }
        } else {
            After::Nothing
        };
        ex.start(&h);
        // SAFETY: `addr - base < len` (checked by `part()` for a part; zero for a whole
        // request), inside the validated range.
        let at = unsafe { p.add((h.addr - base) as usize) };
        if part.is_none() && rx.staged() >= h.len as usize {
            // A whole payload already read ahead (every small message): it lands now, under
            // the target's state it started under.
            rx.copy_out(&[Span(at, h.len as usize)], 0, h.len as usize);
            drop(writing);
            self.done_locked(qp, ex, h.seq, after, h.len as usize);
            rx.state = FRESH;
            return Ok(true);
        }
        // The announcement holds the region: the request's own (a whole request), or the
        // striped request's (a part; the part holds the region too).
        let (done, keep, writing) = match part {
            Some(pt) => {
                let keep = smallvec![writing.region().clone()];
                ex.striped.insert(
                    h.seq,
                    Striped {
                        seq: h.seq,
                        left: pt.count,
                        total: pt.total,
                        after,
                        base,
                        ptr: p,
                        writing,
                    },
                );
                (Done::Part { seq: h.seq }, keep, None)
            }
            None => (
                Done::Request { seq: h.seq, after },
                Keep::new(),
                Some(writing),
            ),
        };
        rx.state = RxState::Payload {
            dst: smallvec![Span(at, h.len as usize)],
            got: 0,
            total: h.len as usize,
            done,
            _keep: keep,
            _writing: writing,
        };
        // Started: a later request may start now (or a connection waiting for it go on).
        Ok(true)
    }

    /// Executes a SEND or SEND_WITH_IMM: its payload lands in the next posted receive.
    fn execute_send(
        &self,
        qp: &QpInner,
        rx: &mut Rx,
        h: Header,
        ex: &mut Exec,
    ) -> std::result::Result<bool, String> {
        let Some(slot) = qp.claim_recv() else {
            rx.state = RxState::Stalled {
                hdr: h,
                since: Instant::now(),
            };
            return Ok(false);
        };
        let imm = (h.opcode == Opcode::SendImm).then_some(h.imm);
        let (spans, keep, room) = match qp.recv_spans(slot) {
            Ok(r) => r,
            Err(st) => {
                qp.complete_recv(slot, st, WcOpcode::Recv, h.len, imm);
                let sender = if st == WcStatus::LocalLengthError {
                    WcStatus::RemoteInvalidRequest
                } else {
                    WcStatus::RemoteOperationError
                };
                return self.refuse(rx, ex, &h, sender);
            }
        };
        if h.len as usize > room {
            qp.complete_recv(slot, WcStatus::LocalLengthError, WcOpcode::Recv, h.len, imm);
            return self.refuse(rx, ex, &h, WcStatus::RemoteInvalidRequest);
        }
        ex.start(&h);
        let after = After::Recv {
            slot,
            opcode: WcOpcode::Recv,
            imm,
        };
        let total = h.len as usize;
        if rx.staged() >= total {
            // The whole payload already read ahead (every small message): it lands now, and
            // the receive completes, under the target's state it started under.
            rx.copy_out(&spans, 0, total);
            drop(keep);
            self.done_locked(qp, ex, h.seq, after, total);
            rx.state = FRESH;
            return Ok(true);
        }
        rx.state = RxState::Payload {
            dst: spans,
            got: 0,
            total,
            done: Done::Request { seq: h.seq, after },
            _keep: keep,
            _writing: None,
        };
        Ok(true)
    }

    /// Executes a compare-and-swap or fetch-and-add and queues its result.
    fn execute_atomic(
        &self,
        rx: &mut Rx,
        h: Header,
        ex: &mut Exec,
    ) -> std::result::Result<bool, String> {
        if !h.addr.is_multiple_of(8) {
            return self.refuse(rx, ex, &h, WcStatus::RemoteInvalidRequest);
        }
        let Some((_mr, p)) = self.target(ex, h.addr, h.rkey, 8, AccessFlags::REMOTE_ATOMIC) else {
            return self.refuse(rx, ex, &h, WcStatus::RemoteAccessError);
        };
        // SAFETY: `p` is 8-byte aligned (region bases are, the address is checked) and inside a
        // live registered region of this process (held by `_mr`).
        let word = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
        let old = if h.opcode == Opcode::Cas {
            match word.compare_exchange(h.a, h.b, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            }
        } else {
            word.fetch_add(h.a, Ordering::SeqCst)
        };
        responded(ex, h.seq);
        let mut r = Header::new(Opcode::AtomicResp, h.seq, 0);
        r.a = old;
        self.queue(0, TxFrame::header(&r));
        rx.state = FRESH;
        Ok(true)
    }

    /// A payload has all landed. The target's state is held throughout, so that the receive
    /// completes, and the request counts as done, at once for every reader.
    fn landed(&self, qp: &QpInner, done: Done, total: usize) -> bool {
        let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        let (seq, after, total) = match done {
            Done::Request { seq, after } => (seq, after, total),
            Done::Part { seq } => {
                let Some(cur) = ex.striped.get_mut(&seq) else {
                    return false;
                };
                cur.left -= 1;
                if cur.left > 0 {
                    return false;
                }
                let Some(cur) = ex.striped.remove(&seq) else {
                    return false;
                };
                (cur.seq, cur.after, cur.total as usize)
            }
            Done::ReadData { seq } => {
                drop(ex);
                self.read_landed(qp, seq, false);
                return false;
            }
            Done::ReadPart { seq } => {
                drop(ex);
                self.read_landed(qp, seq, true);
                return false;
            }
        };
        self.done_locked(qp, &mut ex, seq, after, total);
        true
    }

    /// Request `seq`, of `total` bytes, has all landed (the caller holds the target's state):
    /// completes what it completes, and notes the ACK that makes due.
    fn done_locked(&self, qp: &QpInner, ex: &mut Exec, seq: u64, after: After, total: usize) {
        // A request that completes a receive started once every earlier one was done, and no
        // later one starts before it is done: its receive completes after their data.
        if let After::Recv { slot, opcode, imm } = after {
            qp.complete_recv(slot, WcStatus::Success, opcode, total as u32, imm);
        }
        ex.finish(seq);
        if let Some(ack) = ex.take_ack() {
            self.ack_later(ack);
        }
    }

    /// The target executed every request of ours up to `seq` (an ACK, or implied by an answer):
    /// complete what that completes.
    fn acked(&self, qp: &QpInner, seq: u64) {
        let mut a = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        a.seen = a.seen.max(seq);
        self.settle(qp, &mut a);
    }

    /// Completes our requests in order while they may: one without data once the target
    /// executed it, a READ or atomic once its data has all landed (READ data striped over the
    /// connections lands in parallel with the ACKs on connection 0, which must not complete a
    /// READ before its data); then a NAK waiting for the requests before it.
    fn settle(&self, qp: &QpInner, a: &mut Answers) {
        while let Some(o) = self.sendq.pop_front_if(|o| {
            o.error.is_none()
                && if needs_data(o.opcode) {
                    a.landed.contains(&o.seq)
                } else {
                    o.seq <= a.seen
                }
        }) {
            a.landed.remove(&o.seq);
            qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, o.len, o.signaled);
        }
        if let Some((seq, status)) = a.nak
            && let Some(o) = self.sendq.pop_front_if(|o| o.seq == seq)
        {
            a.nak = None;
            qp.complete_send(o.wr_id, o.opcode, status, 0, true);
            qp.request_failed();
            return;
        }
        self.sendq.complete_local_failures(qp);
    }

    /// Takes an answer to one of our requests.
    fn answer(&self, qp: &QpInner, rx: &mut Rx, h: Header) -> std::result::Result<(), String> {
        rx.state = FRESH;
        if qp.is_failed() {
            // Our queue pair failed and flushed its requests: late answers are dropped.
            rx.state = RxState::Discard {
                left: h.payload_len(),
            };
            return Ok(());
        }
        match h.opcode {
            Opcode::AckReq => {
                let mut ex = self.exec.lock().unwrap_or_else(|e| e.into_inner());
                ex.ack_upto = ex.ack_upto.max(h.seq);
                let ack = ex.take_ack();
                drop(ex);
                if let Some(seq) = ack {
                    self.ack_later(seq);
                }
            }
            Opcode::Ack => self.acked(qp, h.seq),
            Opcode::Nak => {
                let status =
                    WcStatus::from_u32(h.a as u32).unwrap_or(WcStatus::RemoteOperationError);
                if self
                    .sendq
                    .find(|o| (o.seq == h.seq).then_some(()))
                    .is_none()
                {
                    return Err(format!("NAK for request {} that is not outstanding", h.seq));
                }
                // The target NAKs on a request's header: its payload (and what follows it)
                // may still be on its way out, and once the failure is polled the caller may
                // free the buffers it is sent from.
                self.detach_queued();
                let mut a = self.answers.lock().unwrap_or_else(|e| e.into_inner());
                a.seen = a.seen.max(h.seq.saturating_sub(1));
                a.nak = Some((h.seq, status));
                self.settle(qp, &mut a);
            }
            Opcode::ReadResp => self.read_data(qp, rx, h)?,
            Opcode::AtomicResp => {
                let mut a = self.answers.lock().unwrap_or_else(|e| e.into_inner());
                a.seen = a.seen.max(h.seq.saturating_sub(1));
                let copied = self.sendq.find(|o| {
                    if o.seq != h.seq
                        || !matches!(o.opcode, WcOpcode::CompareSwap | WcOpcode::FetchAdd)
                    {
                        return None;
                    }
                    if let Some(d) = o.dst.first().filter(|d| d.1 == 8) {
                        let bytes = h.a.to_ne_bytes();
                        // SAFETY: the 8-byte local SGE was validated at post time and is kept
                        // alive by `o._keep` (the request stays outstanding while the queue's
                        // lock is held).
                        unsafe { crate::contract::copy_bytes(bytes.as_ptr(), d.0, 8) };
                    }
                    Some(())
                });
                if copied.is_none() {
                    return Err(format!(
                        "atomic result for request {} that is not outstanding",
                        h.seq
                    ));
                }
                a.landed.insert(h.seq);
                self.settle(qp, &mut a);
            }
            _ => return Err(format!("{:?} is not an answer", h.opcode)),
        }
        Ok(())
    }

    /// Takes READ data (all of it, or one part of data striped over the connections): it lands
    /// straight in the READ's local buffer.
    fn read_data(&self, qp: &QpInner, rx: &mut Rx, h: Header) -> std::result::Result<(), String> {
        let mut a = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        // The target answers in order: every request before this READ was executed.
        a.seen = a.seen.max(h.seq.saturating_sub(1));
        self.settle(qp, &mut a);
        let Some((len, dst)) = self.sendq.find(|o| {
            (o.seq == h.seq && o.opcode == WcOpcode::Read).then(|| (o.len, o.dst.clone()))
        }) else {
            return Err(format!(
                "READ data for request {} that is not outstanding",
                h.seq
            ));
        };
        let (dst, done) = if h.flags & PART != 0 {
            let part = h.part().ok_or("READ data part without its fields")?;
            if part.total != len {
                return Err(format!(
                    "READ data part of a {}-byte READ for a READ of {len}",
                    part.total
                ));
            }
            a.parts.entry(h.seq).or_insert(part.count);
            let lo = (h.addr - part.base) as usize;
            (
                super::tx::sub_spans(&dst, lo, lo + h.len as usize),
                Done::ReadPart { seq: h.seq },
            )
        } else {
            if len != h.len {
                return Err(format!("READ data of {} bytes for a READ of {len}", h.len));
            }
            (dst, Done::ReadData { seq: h.seq })
        };
        rx.state = RxState::Payload {
            dst,
            got: 0,
            total: h.len as usize,
            done,
            _keep: Keep::new(),
            _writing: None,
        };
        Ok(())
    }

    /// READ data (all of it, or the last part) has landed: the READ completes in order.
    fn read_landed(&self, qp: &QpInner, seq: u64, part: bool) {
        let mut a = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if part {
            let Some(left) = a.parts.get_mut(&seq) else {
                return;
            };
            *left -= 1;
            if *left > 0 {
                return;
            }
            a.parts.remove(&seq);
        }
        a.landed.insert(seq);
        self.settle(qp, &mut a);
    }
}

/// Whether a request completes only once data came back for it (READ, atomics).
fn needs_data(op: WcOpcode) -> bool {
    matches!(
        op,
        WcOpcode::Read | WcOpcode::CompareSwap | WcOpcode::FetchAdd
    )
}

/// Request `seq` was executed and its answer (which acknowledges it) is on its way.
fn responded(ex: &mut Exec, seq: u64) {
    ex.done_seq = seq;
    ex.started = seq;
    ex.acked_seq = seq;
}

/// Receives the rest of a `total`-byte payload into the spans, skipping the `got` bytes already
/// received, then at most `tail.len()` bytes after the payload into `tail`; never writes past
/// the payload into the spans (they may have more room than it needs). Returns the bytes
/// received: those past the payload's rest are in `tail`.
fn read_spans(
    sock: &TcpStream,
    dst: &[Span],
    got: usize,
    total: usize,
    tail: &mut [u8],
) -> std::result::Result<usize, rustix::io::Errno> {
    let mut skip = got;
    let mut want = total - got;
    let mut iov: SmallVec<[IoSliceMut<'_>; 4]> =
        SmallVec::with_capacity(dst.len().min(MAX_SGE) + 1);
    for s in dst {
        if want == 0 {
            break;
        }
        if skip >= s.1 {
            skip -= s.1;
            continue;
        }
        let k = (s.1 - skip).min(want);
        // SAFETY: each span is a validated range of a live registered region (kept alive by the
        // frame state that owns `dst`); `skip + k <= s.1`.
        iov.push(IoSliceMut::new(unsafe {
            std::slice::from_raw_parts_mut(s.0.add(skip), k)
        }));
        want -= k;
        skip = 0;
    }
    iov.push(IoSliceMut::new(tail));
    rustix::net::recvmsg(
        sock,
        &mut iov,
        &mut rustix::net::RecvAncillaryBuffer::default(),
        rustix::net::RecvFlags::DONTWAIT,
    )
    .map(|r| r.bytes)
}
