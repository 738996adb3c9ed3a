//! The initiator's side of a software provider's queue pair (tcp, ofi): posting a batch, the
//! requests in flight, and completing them in posting order from cumulative ACKs and answers,
//! local failures included.
//!
//! A provider's link implements [`SendLink`]; its [`QpTransport`](crate::contract::QpTransport)
//! calls [`post_send`] and [`flush_sends`], and its receive side completes requests through the
//! link's [`SendQueue`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::qp::{Cause, QpInner};
use super::region::{MrInner, Span};
use super::wr::SendWr;
use crate::model::{QpState, Result, WcOpcode, WcStatus, WrOp};

/// Spans of a request's local buffers (one or two, almost always: no allocation).
pub(crate) type Spans = SmallVec<[Span; 2]>;
/// The regions a request keeps alive.
pub(crate) type Keep = SmallVec<[Arc<MrInner>; 2]>;
/// A request's validated local buffers: region (borrowed from the request: a link that holds
/// on to one past the post clones it), pointer, length.
pub(crate) type Local<'a> = SmallVec<[(&'a Arc<MrInner>, *mut u8, usize); 2]>;

/// A request this side sent and has not seen answered.
pub(crate) struct Outstanding {
    /// Its sequence number (assigned by [`SendQueue::post`]).
    pub seq: u64,
    pub wr_id: u64,
    pub opcode: WcOpcode,
    pub len: u32,
    pub signaled: bool,
    /// Where READ data or an atomic's old value lands.
    pub dst: Spans,
    pub _keep: Keep,
    /// A request that failed locally (or follows one) and was never sent: it completes with
    /// this status once every earlier request has, so completions stay in order.
    pub error: Option<WcStatus>,
}

impl Outstanding {
    /// A request never sent that completes with `status` in its turn.
    fn unsent(seq: u64, wr_id: u64, opcode: WcOpcode, status: WcStatus) -> Outstanding {
        Outstanding {
            seq,
            wr_id,
            opcode,
            len: 0,
            signaled: true,
            dst: Spans::new(),
            _keep: Keep::new(),
            error: Some(status),
        }
    }
}

/// Sequence numbers of posted requests.
#[derive(Default)]
struct Post {
    next_seq: u64,
    /// The queue pair failed and flushed its requests: nothing more is sent.
    flushed: bool,
}

/// The requests a queue pair sent, oldest first.
#[derive(Default)]
pub(crate) struct SendQueue {
    /// Taken before anything a link sends with (its transmit locks).
    post: Mutex<Post>,
    out: Mutex<VecDeque<Outstanding>>,
    /// How many requests in `out` failed locally (their `error` is set): changed under the
    /// `out` lock, read without it by [`SendQueue::failing`] on every post (which scanned the
    /// requests in flight, up to the whole unsignaled window, under the lock). Posters are one
    /// at a time (the link's send lock), so the post that reads it sees every local failure
    /// posted before it.
    unsent: AtomicUsize,
}

impl SendQueue {
    /// Records `o` under the next sequence number and runs `send(seq)`, both under the post
    /// lock, so requests leave in sequence and the record exists before any answer can arrive.
    /// A queue pair that failed (`failed()`, evaluated under the lock) sends nothing: the
    /// request completes flushed in its turn (`Ok`), or now (`Err`) when the flush is done.
    pub fn post(
        &self,
        mut o: Outstanding,
        failed: impl FnOnce() -> bool,
        send: impl FnOnce(u64),
    ) -> std::result::Result<(), WcStatus> {
        let mut post = self.post.lock().unwrap_or_else(|e| e.into_inner());
        if post.flushed {
            return Err(WcStatus::WorkRequestFlushed);
        }
        if failed() {
            drop(post);
            return self.post_flushed(o.wr_id, o.opcode);
        }
        post.next_seq += 1;
        o.seq = post.next_seq;
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(o);
        send(post.next_seq);
        Ok(())
    }

    /// Completes every outstanding request, oldest first (the queue pair failed), and stops
    /// sending; `under_lock` runs first, under the post lock (a link drops what it has not sent).
    /// A request being posted concurrently completes (flushed) after these.
    pub fn flush(
        &self,
        under_lock: impl FnOnce(),
        mut status_of: impl FnMut() -> WcStatus,
        mut complete: impl FnMut(u64, WcOpcode, WcStatus),
    ) {
        let mut post = self.post.lock().unwrap_or_else(|e| e.into_inner());
        post.flushed = true;
        under_lock();
        let drained: Vec<Outstanding> = {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            self.unsent.store(0, Ordering::Relaxed);
            out.drain(..).collect()
        };
        for o in drained {
            // A request that failed locally keeps its own status.
            let status = match o.error {
                Some(e) if e != WcStatus::WorkRequestFlushed => e,
                _ => status_of(),
            };
            complete(o.wr_id, o.opcode, status);
        }
        drop(post);
    }

    /// Takes the oldest outstanding request if `f` says it is the one.
    pub fn pop_front_if(&self, f: impl FnOnce(&Outstanding) -> bool) -> Option<Outstanding> {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if !out.front().is_some_and(f) {
            return None;
        }
        let o = out.pop_front();
        if o.as_ref().is_some_and(|o| o.error.is_some()) {
            self.unsent.fetch_sub(1, Ordering::Relaxed);
        }
        o
    }

    /// What `f` reads of the first outstanding request it answers for, oldest first; the
    /// request stays.
    pub fn find<R>(&self, mut f: impl FnMut(&Outstanding) -> Option<R>) -> Option<R> {
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find_map(&mut f)
    }

    /// Completes outstanding requests up to `seq` (inclusive) as successful (the ofi provider;
    /// the tcp provider completes READs and atomics only once their data landed).
    #[cfg(feature = "ofi")]
    pub fn complete_upto(&self, qp: &QpInner, seq: u64) {
        while let Some(o) = self.pop_front_if(|o| o.seq <= seq && o.error.is_none()) {
            qp.complete_send(o.wr_id, o.opcode, WcStatus::Success, o.len, o.signaled);
        }
        self.complete_local_failures(qp);
    }

    /// Completes the locally failed request at the front, if every earlier one has completed;
    /// the queue pair then fails and flushes the rest.
    pub fn complete_local_failures(&self, qp: &QpInner) {
        if let Some(o) = self.pop_front_if(|o| o.error.is_some()) {
            let status = o.error.unwrap_or(WcStatus::WorkRequestFlushed);
            qp.complete_send(o.wr_id, o.opcode, status, 0, true);
            qp.request_failed();
        }
    }

    /// A request failed before it could be sent (a local error). With requests still in flight
    /// (and the link alive: not `dead`) it queues behind them and this returns the sequence
    /// number of the last one sent; otherwise `None`, and the caller fails the queue pair now.
    fn post_failed(
        &self,
        dead: bool,
        wr_id: u64,
        opcode: WcOpcode,
        status: WcStatus,
    ) -> Option<u64> {
        let post = self.post.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if post.flushed || out.is_empty() || dead {
            return None;
        }
        // Requests posted after it are never sent either: they are flushed when it completes.
        let status = if self.unsent.load(Ordering::Relaxed) > 0 {
            WcStatus::WorkRequestFlushed
        } else {
            status
        };
        out.push_back(Outstanding::unsent(post.next_seq, wr_id, opcode, status));
        self.unsent.fetch_add(1, Ordering::Relaxed);
        Some(post.next_seq)
    }

    /// Queues a request of a failed queue pair to complete as flushed once the flush under way
    /// reaches it (`Ok`); `Err` when the flush already happened (the caller completes it now).
    fn post_flushed(&self, wr_id: u64, opcode: WcOpcode) -> std::result::Result<(), WcStatus> {
        let post = self.post.lock().unwrap_or_else(|e| e.into_inner());
        if post.flushed {
            return Err(WcStatus::WorkRequestFlushed);
        }
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.push_back(Outstanding::unsent(
            post.next_seq,
            wr_id,
            opcode,
            WcStatus::WorkRequestFlushed,
        ));
        self.unsent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether a locally failed request is waiting for earlier ones (later posts queue too).
    fn failing(&self) -> bool {
        self.unsent.load(Ordering::Relaxed) > 0
    }
}

/// What the shared posting code needs of a software provider's link.
pub(crate) trait SendLink {
    /// The link's requests in flight.
    fn sendq(&self) -> &SendQueue;
    /// Whether the link is known to be dead.
    fn dead(&self) -> bool;
    /// The largest request, in bytes.
    fn max_len(&self) -> usize;
    /// Sends one request whose local buffers are `local` (validated; the link keeps their
    /// regions as long as it reads or writes them), recording it with [`SendQueue::post`].
    fn post(
        &self,
        qp: &QpInner,
        wr: &SendWr<'_>,
        local: Local<'_>,
    ) -> std::result::Result<(), WcStatus>;
    /// A request that failed locally queued behind the one numbered `seq` (which may be
    /// unsignaled): a link whose target acknowledges only when asked asks now.
    fn failed_behind(&self, _seq: u64) {}
    /// Called by the flush under the post lock: drop what is queued and not yet sent.
    fn drop_unsent(&self) {}
    /// A list of more than one request is about to be posted: hold back their transmission
    /// until [`SendLink::uncork`], to send them together.
    fn cork(&self) {}
    /// The list is posted: send what [`SendLink::cork`] held back.
    fn uncork(&self) {}
}

/// Uncorks a link when dropped, so that every way out of a post sends what it held back.
struct Corked<'a, L: SendLink>(&'a L);

impl<L: SendLink> Drop for Corked<'_, L> {
    fn drop(&mut self) {
        self.0.uncork();
    }
}

/// [`QpTransport::post_send`](crate::contract::QpTransport::post_send) for a software
/// provider: posts `wrs` in order, one batch at a time per queue pair (`send`). A single
/// request takes the lock too: it makes the check for a local failure waiting
/// ([`SendQueue::failing`]) and the post that follows one step against another thread's
/// request failing locally, so that nothing posted after a failed request is sent.
pub(crate) fn post_send(
    qp: &QpInner,
    send: &Mutex<()>,
    link: &impl SendLink,
    wrs: &[SendWr<'_>],
) -> Result<()> {
    let mut s = send.lock().unwrap_or_else(|e| e.into_inner());
    let _corked = (wrs.len() > 1).then(|| {
        link.cork();
        Corked(link)
    });
    for (i, wr) in wrs.iter().enumerate() {
        qp.check_sges(i, wr)?;
        if !(matches!(qp.state(), QpState::Rts | QpState::Err) && qp.is_connected()) {
            let status = qp.send_flush_status();
            qp.complete_send(wr.wr_id, wr.op.wc_opcode(), status, 0, true);
            continue;
        }
        match post_one(qp, link, wr) {
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
                s = send.lock().unwrap_or_else(|e| e.into_inner());
            }
        }
    }
    Ok(())
}

/// Validates a send request's local buffers and hands it to the link.
fn post_one(
    qp: &QpInner,
    link: &impl SendLink,
    wr: &SendWr<'_>,
) -> std::result::Result<(), WcStatus> {
    let q = link.sendq();
    let opcode = wr.op.wc_opcode();
    if qp.is_failed() {
        // In ERR nothing is validated or sent: flushed, in order behind what is in flight.
        return q.post_flushed(wr.wr_id, opcode);
    }
    let status = match local_buffers(qp, wr, link.max_len()) {
        Ok(local) if !q.failing() => return link.post(qp, wr, local),
        // An earlier request failed locally and waits for those before it: this one is
        // flushed after it (or now, if the queue pair failed meanwhile).
        Ok(_) => WcStatus::WorkRequestFlushed,
        Err(status) => status,
    };
    match q.post_failed(link.dead(), wr.wr_id, opcode, status) {
        Some(seq) => {
            link.failed_behind(seq);
            Ok(())
        }
        None => Err(status),
    }
}

/// [`QpTransport::flush_sends`](crate::contract::QpTransport::flush_sends) for a software
/// provider.
pub(crate) fn flush_sends(qp: &QpInner, send: &Mutex<()>, link: &impl SendLink) {
    if qp.is_connected() {
        // Requests in flight, oldest first. The link stays up (as an InfiniBand peer, the
        // target is not told); it closes when the queue pair is destroyed.
        link.sendq().flush(
            || link.drop_unsent(),
            || qp.send_flush_status(),
            |wr_id, opcode, status| qp.complete_send(wr_id, opcode, status, 0, true),
        );
    }
    // A batch being posted finishes first (its later requests find the link flushed).
    drop(send.lock().unwrap_or_else(|e| e.into_inner()));
}

/// The validated local buffers of a request of at most `max_len` bytes.
fn local_buffers<'a>(
    qp: &QpInner,
    wr: &SendWr<'a>,
    max_len: usize,
) -> std::result::Result<Local<'a>, WcStatus> {
    let scatter = matches!(
        wr.op,
        WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
    );
    let mut local = Local::new();
    let mut total = 0usize;
    for g in wr.sg_list {
        let p = g.mr.inner.local_ptr(qp.pd, g.offset, g.len, scatter)?;
        local.push((&g.mr.inner, p, g.len));
        total += g.len;
    }
    if total > max_len {
        return Err(WcStatus::LocalLengthError);
    }
    if matches!(wr.op, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
        && (local.len() != 1 || total != 8)
    {
        return Err(WcStatus::LocalLengthError);
    }
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(wr_id: u64) -> Outstanding {
        Outstanding {
            seq: 0,
            wr_id,
            opcode: WcOpcode::Write,
            len: 8,
            signaled: true,
            dst: Spans::new(),
            _keep: Keep::new(),
            error: None,
        }
    }

    fn answered(q: &SendQueue, upto: u64) -> Option<u64> {
        q.pop_front_if(|o| o.seq <= upto && o.error.is_none())
            .map(|o| o.wr_id)
    }

    #[test]
    fn a_local_failure_counts_until_it_leaves_the_queue() {
        let q = SendQueue::default();
        let mut seqs = Vec::new();
        for wr_id in [1, 2] {
            q.post(request(wr_id), || false, |s| seqs.push(s)).unwrap();
        }
        assert_eq!(seqs, [1, 2]);
        assert!(!q.failing());
        // A request that fails locally queues behind the two in flight, and the next one
        // is flushed behind it.
        let bad = WcStatus::LocalProtectionError;
        assert_eq!(q.post_failed(false, 3, WcOpcode::Write, bad), Some(2));
        assert!(q.failing());
        assert_eq!(
            q.post_failed(false, 4, WcOpcode::Send, WcStatus::LocalLengthError),
            Some(2)
        );
        assert_eq!(answered(&q, 2), Some(1));
        assert_eq!(answered(&q, 2), Some(2));
        assert_eq!(answered(&q, 2), None);
        assert!(q.failing());
        let o = q.pop_front_if(|o| o.error.is_some()).unwrap();
        assert_eq!((o.wr_id, o.error), (3, Some(bad)));
        assert!(q.failing(), "request 4 still waits behind it");
        let o = q.pop_front_if(|o| o.error.is_some()).unwrap();
        assert_eq!((o.wr_id, o.error), (4, Some(WcStatus::WorkRequestFlushed)));
        assert!(!q.failing());

        // A flush takes the failed requests with the rest.
        q.post(request(5), || false, |_| {}).unwrap();
        assert_eq!(q.post_failed(false, 6, WcOpcode::Write, bad), Some(3));
        assert!(q.failing());
        let mut done = Vec::new();
        q.flush(
            || {},
            || WcStatus::WorkRequestFlushed,
            |wr_id, _, status| done.push((wr_id, status)),
        );
        assert_eq!(done, [(5, WcStatus::WorkRequestFlushed), (6, bad)]);
        assert!(!q.failing());
    }
}
