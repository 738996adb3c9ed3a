//! Batches of transfer requests: submission (split into slices, posted on a segment's queue pair
//! within its window), completion dispatch, waiting, and the notification that follows a batch.
//!
//! A batch's notification is sent only once every request of the batch completed successfully,
//! so the target sees it after the data (NIXL's bug, its PR #252, was a flush taken for a fence).
//! Completions are driven through the verbs progress layer ([`oxccl_verbs::progress`]): whoever
//! waits polls the completion queues for everyone (one at a time), so a synchronous transfer on
//! shm costs no thread hand-off; a helper thread drives the batches nobody waits for; a
//! [`Transfer`] future parks its waker under its batch.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use oxccl_verbs::progress::{Driven, Progress, Waited, Window, tag, untag};
use oxccl_verbs::{
    MemoryRegion, Provider, RemoteAddr, SendWr, Sge, WcStatus, WorkCompletion, WrOp,
};

use crate::engine::{
    Inner, LANE_BYTES, LANE_WINDOW, MAX_NOTIFY, Peer, Region, SegmentId, TransferEngine,
};
use crate::error::{Error, Result};

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    /// Copy the target's memory into the local buffer.
    Read,
    /// Copy the local buffer into the target's memory.
    Write,
}

impl std::fmt::Display for Opcode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Opcode::Read => "READ",
            Opcode::Write => "WRITE",
        })
    }
}

/// One transfer (Mooncake's `TransferRequest`): `length` bytes between local registered memory
/// at `source` and the target segment's memory at `target_offset`, an address inside one of the
/// buffers the target registered (as its descriptor lists them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferRequest {
    /// READ or WRITE.
    pub opcode: Opcode,
    /// The local address (inside memory registered with this engine).
    pub source: u64,
    /// The target segment, from [`TransferEngine::open_segment`].
    pub target_id: SegmentId,
    /// The address in the target's registered memory.
    pub target_offset: u64,
    /// Bytes to move.
    pub length: usize,
}

/// A submitted batch.
pub type BatchId = u64;

/// Where one request of a batch stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferStatus {
    /// Still moving.
    Pending,
    /// Done: the data is at its destination.
    Completed,
    /// Failed, with the error's text (naming the segment).
    Failed(String),
}

/// A batch's state, as [`TransferEngine::batch_status`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// One status per request, in submission order.
    pub requests: Vec<TransferStatus>,
    /// Bytes of the requests that completed successfully.
    pub transferred: u64,
    /// Whether the batch is over (every request completed or failed, and its notification, if
    /// any, was delivered or failed).
    pub done: bool,
}

/// A batch's totals ([`TransferEngine::batch_summary`]): counted as requests end, so asking
/// costs the same for a batch of one request or of a million.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSummary {
    /// Requests in the batch.
    pub requests: usize,
    /// Requests that completed successfully.
    pub completed: usize,
    /// Requests that failed (canceled ones included).
    pub failed: usize,
    /// Bytes of the requests that completed successfully.
    pub transferred: u64,
    /// Whether the batch is over (as [`BatchStatus::done`]).
    pub done: bool,
}

// A work request's tag (oxccl_verbs::progress::tag): the batch is the operation, the request's
// index in the batch the part (NOTIFY_REQ: the batch's notification).
const REQ_BITS: u32 = 26;
const NOTIFY_REQ: u64 = (1 << REQ_BITS) - 1;
/// Batch ids are a tag's operation: 32 bits.
const BATCH_MASK: u64 = u32::MAX as u64;
/// Most bytes one work request carries (the tcp provider's frames take up to 2 GiB).
const MAX_WR: usize = 1 << 30;
/// A tcp batch of at least this many bytes is waited for without driving the sockets
/// ([`Progress::wait_passive`]): its copies then run in the provider's progress threads, not in
/// the waiting thread (a 256 MiB WRITE cost its waiter a quarter of a core driving).
const PASSIVE_MIN: usize = 1 << 20;
/// Most requests in one batch.
pub const MAX_BATCH: usize = NOTIFY_REQ as usize;

fn wr_id(batch: u64, req: u64) -> u64 {
    tag(batch as u32, req as u32)
}

fn split_wr_id(w: u64) -> (u64, u64) {
    let (batch, req) = untag(w);
    (u64::from(batch), u64::from(req) & NOTIFY_REQ)
}

/// One work request of a request.
pub(crate) struct Slice {
    batch: u64,
    req: u64,
    op: Opcode,
    region: Arc<Region>,
    local_off: usize,
    /// The target address.
    addr: u64,
    /// The target buffer's rkey as the target's context registered it.
    rkey: u64,
    len: usize,
}

/// A segment's queue of slices waiting for room in its queue pair's window.
pub(crate) struct LaneQueue {
    pending: VecDeque<Slice>,
    /// What is posted and not yet completed.
    inflight: InFlight,
}

/// A queue pair's posted slices, oldest first (a queue pair completes its requests in order):
/// each one's bytes, and its local region, kept registered until its completion; and its window.
struct InFlight {
    slices: VecDeque<(usize, Arc<Region>)>,
    window: Window,
}

impl LaneQueue {
    /// An empty queue.
    /// An empty queue for a queue pair of `lanes` lanes (its window is that many lanes').
    pub(crate) fn new(lanes: usize) -> LaneQueue {
        LaneQueue {
            pending: VecDeque::new(),
            inflight: InFlight {
                slices: VecDeque::new(),
                window: Window::new(LANE_WINDOW * lanes, LANE_BYTES * lanes),
            },
        }
    }
}

#[derive(Clone)]
enum Failure {
    Remote(String),
    Peer(String),
    /// Canceled before it was posted.
    Canceled,
}

impl Failure {
    fn text(&self) -> &str {
        match self {
            Failure::Remote(d) | Failure::Peer(d) => d,
            Failure::Canceled => "canceled before it was sent",
        }
    }
}

struct Req {
    req: TransferRequest,
    /// The segment's connection, kept until the batch is over (its completions come through it).
    peer: Arc<Peer>,
    slices: u32,
    /// Bytes of the slices completed so far.
    bytes: u64,
    failed: Option<Failure>,
}

struct BatchState {
    reqs: Vec<Req>,
    /// Requests not yet finished.
    open: usize,
    /// Requests finished with a failure.
    failed: usize,
    notify: Option<Notify>,
    done: bool,
    transferred: u64,
    /// Forget the batch once it is over (a `transfer_sync` that timed out, a dropped future).
    free_when_done: bool,
}

struct Notify {
    peer: Arc<Peer>,
    msg: Vec<u8>,
    /// The registered copy, while the SEND is in flight.
    mr: Option<MemoryRegion>,
    /// Whether the SEND was handed to `send_notifies` (it goes once).
    sent: bool,
    failed: Option<String>,
}

/// A notification ready to go: the peer and the encoded message.
type NotifySend = (Arc<Peer>, Vec<u8>);

/// Every batch of an engine.
#[derive(Default)]
pub(crate) struct Batches {
    map: Mutex<HashMap<BatchId, BatchState>>,
    next: AtomicU64,
    /// The futures awaiting batches ([`Transfer`]), by batch.
    pub wakers: oxccl_verbs::progress::Wakers,
}

impl Batches {
    fn lock(&self) -> MutexGuard<'_, HashMap<BatchId, BatchState>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BatchState {
    fn result(&self, id: BatchId) -> Result<()> {
        for (i, r) in self.reqs.iter().enumerate() {
            if let Some(f) = &r.failed {
                let what = format!(
                    "batch {id}, request {i} ({} of {} bytes, local {:#x}, target {:#x})",
                    r.req.opcode, r.req.length, r.req.source, r.req.target_offset
                );
                return Err(match f {
                    Failure::Canceled => Error::Canceled {
                        batch: id,
                        request: i,
                        segment: r.peer.name.clone(),
                    },
                    Failure::Remote(d) => Error::RemoteAccess {
                        segment: r.peer.name.clone(),
                        detail: format!("{what}: {d}"),
                    },
                    Failure::Peer(d) => Error::PeerFailed {
                        segment: r.peer.name.clone(),
                        detail: format!("{what}: {d}"),
                    },
                });
            }
        }
        if let Some(n) = &self.notify
            && let Some(f) = &n.failed
        {
            return Err(Error::PeerFailed {
                segment: n.peer.name.clone(),
                detail: format!("batch {id}: its notification was not delivered: {f}"),
            });
        }
        Ok(())
    }

    fn status(&self) -> BatchStatus {
        let requests = self
            .reqs
            .iter()
            .map(|r| match &r.failed {
                Some(f) => {
                    TransferStatus::Failed(format!("segment {:?}: {}", r.peer.name, f.text()))
                }
                None if r.slices == 0 => TransferStatus::Completed,
                None => TransferStatus::Pending,
            })
            .collect();
        BatchStatus {
            requests,
            transferred: self.transferred,
            done: self.done,
        }
    }

    fn summary(&self) -> BatchSummary {
        BatchSummary {
            requests: self.reqs.len(),
            completed: self.reqs.len() - self.open - self.failed,
            failed: self.failed,
            transferred: self.transferred,
            done: self.done,
        }
    }
}

fn describe_status(s: WcStatus, peer: &Peer) -> Failure {
    let detail = peer
        .qp
        .error_detail()
        .map(|d| format!(" ({d})"))
        .unwrap_or_default();
    match s {
        WcStatus::RemoteAccessError => Failure::Remote(format!(
            "the target refused the access (RemoteAccessError: a stale or unregistered \
             buffer){detail}; its memory is untouched"
        )),
        WcStatus::RetryExceeded => Failure::Peer(format!(
            "the target stopped answering (RetryExceeded: it died or closed){detail}"
        )),
        WcStatus::WorkRequestFlushed => Failure::Peer(format!(
            "flushed after an earlier request to the segment failed{detail}"
        )),
        s => Failure::Peer(format!("{s}{detail}")),
    }
}

impl TransferEngine {
    /// Submits a batch (Mooncake's `submitTransfer`): checks every request (local memory
    /// registered, the target range inside a buffer the target registered), then posts them. A
    /// bad request fails the whole submission before anything moves. With `notify`, the targets
    /// of the batch get that message once all of the batch's data is visible to them (one
    /// notification per distinct target segment).
    pub fn submit(&self, reqs: &[TransferRequest], notify: Option<&[u8]>) -> Result<BatchId> {
        self.inner.submit(reqs, notify)
    }

    /// Where a batch stands, driving progress once without blocking (so polling callers need no
    /// other thread).
    pub fn batch_status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.poll();
        let map = self.inner.batches.lock();
        map.get(&batch)
            .map(|b| b.status())
            .ok_or_else(|| Error::arg(format!("batch {batch} is unknown (freed?)")))
    }

    /// A batch's totals, driving progress once without blocking: O(1), where
    /// [`TransferEngine::batch_status`] lists every request.
    pub fn batch_summary(&self, batch: BatchId) -> Result<BatchSummary> {
        self.inner.poll();
        let map = self.inner.batches.lock();
        map.get(&batch)
            .map(|b| b.summary())
            .ok_or_else(|| Error::arg(format!("batch {batch} is unknown (freed?)")))
    }

    /// Cancels a batch (as NIXL's `releaseXferReq` of a transfer in progress): its requests
    /// not yet posted fail with [`Error::Canceled`] and never move; those already posted
    /// cannot be called back and end as they end. The batch is over once they have, with no
    /// notification sent, and [`TransferEngine::wait`] then returns the first request's error.
    /// Returns how many requests had slices taken back (a request cut into slices may have
    /// had some posted already); 0 for a batch that is over.
    pub fn cancel_batch(&self, batch: BatchId) -> Result<usize> {
        self.inner.cancel(batch)
    }

    /// Waits up to `timeout` for a batch to end: `Ok` when every request completed, else the
    /// first failure (naming the segment and the request). A timeout leaves the batch running.
    pub fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        self.inner.wait(batch, timeout)
    }

    /// Forgets an ended batch. One with requests still in flight cannot be freed.
    pub fn free_batch(&self, batch: BatchId) -> Result<()> {
        let mut map = self.inner.batches.lock();
        match map.get(&batch) {
            None => Err(Error::arg(format!("batch {batch} is unknown (freed?)"))),
            Some(b) if !b.done => Err(Error::arg(format!(
                "batch {batch} still has requests in flight: wait for it first"
            ))),
            Some(_) => {
                map.remove(&batch);
                Ok(())
            }
        }
    }

    /// Submits a batch and returns it as a future: `engine.transfer(&reqs, None)?.await`.
    pub fn transfer(
        &self,
        reqs: &[TransferRequest],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'_>> {
        let batch = self.submit(reqs, notify)?;
        Ok(Transfer {
            engine: self,
            batch,
            over: false,
        })
    }

    /// Submits a batch, waits for it with the engine's timeout and frees it.
    pub fn transfer_sync(&self, reqs: &[TransferRequest], notify: Option<&[u8]>) -> Result<()> {
        self.transfer_sync_within(reqs, notify, self.inner.config.timeout)
    }

    /// [`TransferEngine::transfer_sync`] bounded by `timeout` rather than the engine's: past
    /// it, [`Error::Timeout`] names the batch, its segment(s) and the requests still
    /// outstanding (index, READ or WRITE, bytes). The requests already posted cannot be called
    /// back: a late completion still lands (a WRITE in the target's memory, a READ in the local
    /// buffer, which must stay registered until then) or fails, and the batch is freed when it
    /// ends; nothing else is touched, and later transfers go on normally.
    pub fn transfer_sync_within(
        &self,
        reqs: &[TransferRequest],
        notify: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<()> {
        let b = self.submit(reqs, notify)?;
        let r = self.wait(b, timeout);
        let mut map = self.inner.batches.lock();
        match map.get_mut(&b) {
            Some(st) if !st.done => st.free_when_done = true,
            _ => {
                map.remove(&b);
            }
        }
        r
    }
}

/// A submitted batch as a [`Future`] ([`TransferEngine::transfer`]): it resolves to what
/// [`TransferEngine::wait`] would return once the batch is over, and the batch is freed then.
/// The engine's progress thread drives it, so any executor works; dropping it early leaves the
/// batch to finish (and be freed) on its own. A dead target ends it within the peer timeout.
#[must_use = "a transfer does nothing visible unless it is awaited or its batch waited for"]
pub struct Transfer<'a> {
    engine: &'a TransferEngine,
    batch: BatchId,
    over: bool,
}

impl Transfer<'_> {
    /// The batch's id (for [`TransferEngine::batch_status`]).
    pub fn batch(&self) -> BatchId {
        self.batch
    }
}

impl Future for Transfer<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let inner = &self.engine.inner;
        inner.poll();
        let mut map = inner.batches.lock();
        let Some(b) = map.get_mut(&self.batch) else {
            self.over = true;
            return Poll::Ready(Err(Error::arg(format!(
                "batch {} was freed while awaited",
                self.batch
            ))));
        };
        if !b.done {
            // The helper thread drives it, and its last completion's dispatch wakes us. Parked
            // under the batches' lock, which the dispatch that ends the batch takes first.
            inner.batches.wakers.park(self.batch, cx.waker());
            return Poll::Pending;
        }
        let r = b.result(self.batch);
        map.remove(&self.batch);
        self.over = true;
        Poll::Ready(r)
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if !self.over {
            self.engine.inner.batches.wakers.forget(self.batch);
            let mut map = self.engine.inner.batches.lock();
            match map.get_mut(&self.batch) {
                Some(b) if !b.done => b.free_when_done = true,
                _ => {
                    map.remove(&self.batch);
                }
            }
        }
    }
}

impl Inner {
    fn submit(&self, reqs: &[TransferRequest], notify: Option<&[u8]>) -> Result<BatchId> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        if reqs.is_empty() {
            return Err(Error::arg("an empty batch"));
        }
        if reqs.len() > MAX_BATCH {
            return Err(Error::arg(format!(
                "{} requests in one batch (at most {MAX_BATCH})",
                reqs.len()
            )));
        }
        if let Some(m) = notify
            && m.len() > MAX_NOTIFY
        {
            return Err(Error::arg(format!(
                "a notification of {} bytes (at most {MAX_NOTIFY})",
                m.len()
            )));
        }
        // Check everything first: nothing is posted for a batch with a bad request.
        let mut peers: HashMap<SegmentId, Arc<Peer>> = HashMap::new();
        let mut plan: Vec<(Arc<Peer>, Vec<Slice>)> = Vec::new();
        let mut state = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let peer = match peers.get(&r.target_id) {
                Some(p) => p.clone(),
                None => {
                    let p = self.healthy_peer(r.target_id)?;
                    peers.insert(r.target_id, p.clone());
                    p
                }
            };
            let (req, slices) = self.plan_request(i, r, &peer)?;
            state.push(req);
            match plan.iter_mut().find(|(p, _)| Arc::ptr_eq(p, &peer)) {
                Some((_, v)) => v.extend(slices),
                None => plan.push((peer, slices)),
            }
        }
        // The notification goes to the batch's one target, once all of its data is there.
        let notify = match notify {
            Some(_) if plan.len() > 1 => {
                return Err(Error::arg(format!(
                    "a notification goes with a batch to one segment; this one targets {}",
                    plan.len()
                )));
            }
            Some(m) => plan.first().map(|(p, _)| Notify {
                peer: p.clone(),
                msg: m.to_vec(),
                mr: None,
                sent: false,
                failed: None,
            }),
            None => None,
        };
        let id = {
            let mut map = self.batches.lock();
            // Ids take 32 bits of a wr_id: they wrap, skipping 0 and batches still known.
            let id = loop {
                let id = self.batches.next.fetch_add(1, Ordering::Relaxed) & BATCH_MASK;
                if id != 0 && !map.contains_key(&id) {
                    break id;
                }
            };
            map.insert(
                id,
                BatchState {
                    open: state.len(),
                    failed: 0,
                    reqs: state,
                    notify,
                    done: false,
                    transferred: 0,
                    free_when_done: false,
                },
            );
            id
        };
        for (peer, mut slices) in plan {
            for s in &mut slices {
                s.batch = id;
            }
            let mut q = peer.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.pending.extend(slices);
            drop(q);
            self.pump(&peer);
        }
        Ok(id)
    }

    /// Checks request `i` of a batch (`r`, to `peer`) and cuts it into the slices it is posted
    /// as: its local memory registered, its target range inside a buffer the target registered.
    fn plan_request(
        &self,
        i: usize,
        r: &TransferRequest,
        peer: &Arc<Peer>,
    ) -> Result<(Req, Vec<Slice>)> {
        let bad = |e: Error| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("request {i}: {m}")),
            Error::RemoteAccess { segment, detail } => Error::RemoteAccess {
                segment,
                detail: format!("request {i} ({}): {detail}", r.opcode),
            },
            e => e,
        };
        if r.length == 0 {
            return Err(bad(Error::arg("a request of 0 bytes")));
        }
        let (region, off) = self.local(r.source, r.length).map_err(bad)?;
        let rkey: u64 = {
            let fresh = peer
                .desc
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .locate(r.target_offset, r.length as u64)
                .is_err();
            if fresh {
                // The target may have registered the range since: ask it once.
                self.refresh_desc(peer);
            }
            let desc = peer.desc.read().unwrap_or_else(|e| e.into_inner());
            let b = desc.locate(r.target_offset, r.length as u64).map_err(bad)?;
            b.rkey(&peer.key).ok_or_else(|| {
                bad(Error::RemoteAccess {
                    segment: peer.name.clone(),
                    detail: format!(
                        "its buffer at {:#x} is not registered with its {:?} context",
                        b.addr, peer.key
                    ),
                })
            })?
        };
        // Over several lanes, requests are cut into slices (the provider stripes each over
        // the connections); over one, only to stay under what one work request carries
        // (2 GiB for tcp).
        let slice = if peer.lanes > 1 {
            self.config.slice_size
        } else {
            MAX_WR
        };
        let n = r.length.div_ceil(slice);
        let mut slices = Vec::with_capacity(n);
        for k in 0..n {
            let start = k * slice.min(r.length);
            let len = slice.min(r.length - start);
            slices.push(Slice {
                batch: 0,
                req: i as u64,
                op: r.opcode,
                region: region.clone(),
                local_off: off + start,
                addr: r.target_offset + start as u64,
                rkey,
                len,
            });
        }
        let req = Req {
            req: *r,
            peer: peer.clone(),
            slices: n as u32,
            bytes: 0,
            failed: None,
        };
        Ok((req, slices))
    }

    fn cancel(&self, batch: BatchId) -> Result<usize> {
        let peers: Vec<Arc<Peer>> = {
            let map = self.batches.lock();
            let b = map
                .get(&batch)
                .ok_or_else(|| Error::arg(format!("batch {batch} is unknown (freed?)")))?;
            if b.done {
                return Ok(0);
            }
            let mut v: Vec<Arc<Peer>> = Vec::new();
            for r in &b.reqs {
                if !v.iter().any(|p| Arc::ptr_eq(p, &r.peer)) {
                    v.push(r.peer.clone());
                }
            }
            v
        };
        // Take the batch's slices off its peers' queues (nothing posts them after this), then
        // fail them.
        let mut dropped: Vec<u64> = Vec::new();
        for p in &peers {
            let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.pending.retain(|s| {
                let mine = s.batch == batch;
                if mine {
                    dropped.push(s.req);
                }
                !mine
            });
        }
        let mut map = self.batches.lock();
        let Some(b) = map.get_mut(&batch) else {
            return Ok(0);
        };
        for &r in &dropped {
            finish_slice(b, r as usize, 0, Some(Failure::Canceled));
        }
        dropped.dedup();
        // A batch that failed sends no notification: ready_notify only ends it.
        let sends: Vec<_> = ready_notify(b).map(|n| (batch, n)).into_iter().collect();
        let ended = if b.done { vec![batch] } else { Vec::new() };
        self.settle(map, ended, sends);
        self.progress.notify();
        Ok(dropped.len())
    }

    /// The peer of `segment`, opened afresh if its connection failed.
    fn healthy_peer(&self, segment: SegmentId) -> Result<Arc<Peer>> {
        let p = self.peer(segment)?;
        let failed = p.failed.lock().unwrap_or_else(|e| e.into_inner()).is_some();
        if failed { self.reopen(&p) } else { Ok(p) }
    }

    /// Asks a segment's owner for its descriptor again; a failure keeps the old one.
    fn refresh_desc(&self, peer: &Peer) {
        let d = peer
            .client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_desc();
        if let Ok(d) = d {
            *peer.desc.write().unwrap_or_else(|e| e.into_inner()) = d;
        }
    }

    /// Posts a peer's pending slices while its queue pair's window has room.
    pub(crate) fn pump(&self, peer: &Arc<Peer>) {
        let mut failures: Vec<(u64, Failure)> = Vec::new();
        {
            let mut q = peer.queue.lock().unwrap_or_else(|e| e.into_inner());
            let dead = peer
                .failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            while let Some(front) = q.pending.front() {
                if let Some(d) = &dead {
                    let w = wr_id(front.batch, front.req);
                    failures.push((w, Failure::Peer(format!("not sent: {d}"))));
                    q.pending.pop_front();
                    continue;
                }
                if !front.region.mrs[peer.dev()].is_registered() {
                    let w = wr_id(front.batch, front.req);
                    failures.push((
                        w,
                        Failure::Peer(
                            "its local buffer was unregistered before it was sent".into(),
                        ),
                    ));
                    q.pending.pop_front();
                    continue;
                }
                // The queue pair takes a request while it has fewer than LANE_WINDOW requests and
                // LANE_BYTES bytes in flight per lane (an empty one takes any size). On shm a
                // WRITE is the copy itself, so this also bounds how long a submit blocks.
                let len = front.len;
                if !q.inflight.window.fits(len) {
                    break;
                }
                let Some(s) = q.pending.pop_front() else {
                    break;
                };
                let wid = wr_id(s.batch, s.req);
                let mr = &s.region.mrs[peer.dev];
                let sge = [Sge::new(mr, s.local_off, s.len)];
                let remote = RemoteAddr {
                    addr: s.addr,
                    rkey: s.rkey,
                };
                let op = match s.op {
                    Opcode::Read => WrOp::Read { remote },
                    Opcode::Write => WrOp::Write { remote },
                };
                match peer.qp.post_send(&[SendWr::new(wid, op, &sge)]) {
                    Ok(()) => {
                        let f = &mut q.inflight;
                        f.window.take(s.len);
                        f.slices.push_back((s.len, s.region));
                    }
                    Err(e) => failures.push((wid, Failure::Peer(format!("posting failed: {e}")))),
                }
            }
        }
        if failures.is_empty() {
            return;
        }
        let mut map = self.batches.lock();
        let mut sends = Vec::new();
        let mut ended = Vec::new();
        for (w, f) in failures {
            let (bid, r) = split_wr_id(w);
            if let Some(b) = map.get_mut(&bid) {
                finish_slice(b, r as usize, 0, Some(f));
                if let Some(n) = ready_notify(b) {
                    sends.push((bid, n));
                }
                if b.done {
                    ended.push(bid);
                }
            }
        }
        self.settle(map, ended, sends);
        // Not in a poll: the batches' waiters must look again.
        self.progress.notify();
    }

    /// After batches changed under `map`: forgets the `ended` ones nobody will ask about, wakes
    /// the futures of the batches that `ended`, and sends the notifications that are due.
    fn settle(
        &self,
        mut map: MutexGuard<'_, HashMap<BatchId, BatchState>>,
        ended: Vec<BatchId>,
        sends: Vec<(BatchId, NotifySend)>,
    ) {
        // Only a batch that ended now can have become one to forget (the others were
        // forgotten when they ended, or are forgotten by whoever marks them).
        for id in &ended {
            if map.get(id).is_some_and(|b| b.free_when_done) {
                map.remove(id);
            }
        }
        drop(map);
        for b in ended {
            self.batches.wakers.wake(b);
        }
        self.send_notifies(sends);
    }

    /// Polls the completion queues once, unless another thread does.
    pub(crate) fn poll(&self) {
        let _ = self.progress.poll(|dev, wc| self.on_completion(dev, wc));
    }

    /// The progress layer's handler: [`Inner::dispatch`], which cannot fail.
    fn on_completion(&self, dev: usize, wc: &WorkCompletion) -> std::result::Result<(), ()> {
        self.dispatch(dev, wc);
        Ok(())
    }

    /// Routes one completion: first its queue pair (its window back, its failure noted; no
    /// batch lock is held there, so a poster copying into a lane on shm delays nobody else),
    /// then its batch; then posts what the window has room for now.
    fn dispatch(&self, dev: usize, c: &WorkCompletion) {
        let (bid, r) = split_wr_id(c.wr_id);
        let peer = self.peer_of_lane(dev, c.qp_num);
        let failure = (!c.is_ok()).then(|| match &peer {
            Some(p) => describe_status(c.status, p),
            None => Failure::Peer(c.status.to_string()),
        });
        if let Some(p) = &peer {
            if let Some(f) = &failure {
                let mut slot = p.failed.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(f.text().to_string());
                }
            }
            if r != NOTIFY_REQ {
                let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
                let f = &mut q.inflight;
                if let Some((bytes, _region)) = f.slices.pop_front() {
                    f.window.give_back(bytes);
                }
            }
        }
        // (Neither vector allocates unless the batch ends or its notification is due.)
        let mut sends = Vec::new();
        let mut ended = Vec::new();
        let mut map = self.batches.lock();
        if let Some(b) = map.get_mut(&bid) {
            if r == NOTIFY_REQ {
                if let Some(n) = b.notify.as_mut() {
                    n.mr = None;
                    n.failed = failure.map(|f| f.text().to_string());
                }
                b.done = true;
            } else {
                finish_slice(b, r as usize, c.byte_len as u64, failure);
                if let Some(n) = ready_notify(b) {
                    sends.push((bid, n));
                }
            }
            if b.done {
                ended.push(bid);
            }
        }
        self.settle(map, ended, sends);
        if let Some(p) = peer {
            self.pump(&p);
        }
    }

    /// Posts the SENDs of batches whose data is all done.
    fn send_notifies(&self, sends: Vec<(BatchId, NotifySend)>) {
        for (bid, (peer, msg)) in sends {
            let dev = &self.devs[peer.dev()];
            let r = dev
                .pd
                .reg_mr(msg, oxccl_verbs::AccessFlags::LOCAL_WRITE)
                .map_err(|e| e.to_string())
                .and_then(|mr| {
                    let sge = [Sge::whole(&mr)];
                    peer.qp
                        .post_send(&[SendWr::new(wr_id(bid, NOTIFY_REQ), WrOp::Send, &sge)])
                        .map_err(|e| e.to_string())?;
                    Ok(mr)
                });
            let mut map = self.batches.lock();
            if let Some(b) = map.get_mut(&bid)
                && let Some(n) = b.notify.as_mut()
            {
                match r {
                    Ok(mr) => n.mr = Some(mr),
                    Err(e) => {
                        n.failed = Some(e);
                        b.done = true;
                    }
                }
                let ended = b.done;
                if ended && b.free_when_done {
                    map.remove(&bid);
                }
                drop(map);
                if ended {
                    self.batches.wakers.wake(bid);
                    self.progress.notify();
                }
            }
        }
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        // Sleep on the queue of the (first) target segment's queue pair.
        let (hint, passive) = {
            let map = self.batches.lock();
            let b = map
                .get(&batch)
                .ok_or_else(|| Error::arg(format!("batch {batch} is unknown (freed?)")))?;
            let hint = b.reqs.first().map_or(0, |r| r.peer.dev());
            // A long tcp batch is waited for without driving the sockets: the provider's
            // progress threads copy its slices, and the waiter wakes once per completion
            // (driving, it would make those copies itself). A short one is driven, so that
            // its answer wakes the waiter directly.
            let bytes: usize = b.reqs.iter().map(|r| r.req.length).sum();
            let passive = !self.config.busy_poll
                && bytes >= PASSIVE_MIN
                && self
                    .devs
                    .get(hint)
                    .is_some_and(|d| d.provider == Provider::Tcp);
            (hint, passive)
        };
        let handle = |dev: usize, wc: &WorkCompletion| self.on_completion(dev, wc);
        let ready = || {
            let map = self.batches.lock();
            let Some(b) = map.get(&batch) else {
                return Some(Err(Error::arg(format!(
                    "batch {batch} was freed while waited for"
                ))));
            };
            if b.done {
                Some(b.result(batch))
            } else if self.closed.load(Ordering::Acquire) {
                Some(Err(Error::Closed))
            } else {
                None
            }
        };
        let what = || self.pending(batch);
        let deadline = Instant::now() + timeout;
        let r = if passive {
            self.progress
                .wait_passive(deadline, what, hint, handle, ready)
        } else {
            self.progress.wait_for(deadline, what, hint, handle, ready)
        };
        match r {
            Ok(r) => r,
            Err(Waited::Timeout { what, .. }) => Err(Error::Timeout { what, timeout }),
            Err(Waited::Queue(e)) => Err(Error::verbs(format!("waiting for batch {batch}"), e)),
            Err(Waited::Handler(())) => Ok(()),
        }
    }

    /// What a batch still waits for, for a timeout's error.
    fn pending(&self, batch: BatchId) -> String {
        let map = self.batches.lock();
        let Some(b) = map.get(&batch) else {
            return format!("batch {batch} (freed)");
        };
        // The requests still outstanding: the first few by index, kind and size.
        const SHOWN: usize = 8;
        let mut pending = 0;
        let mut bytes = 0u64;
        let mut shown = Vec::new();
        for (i, r) in b.reqs.iter().enumerate() {
            if r.slices == 0 {
                continue;
            }
            pending += 1;
            bytes += r.req.length as u64;
            if shown.len() < SHOWN {
                shown.push(format!("#{i} {} of {} B", r.req.opcode, r.req.length));
            }
        }
        let mut segs: Vec<&str> = b.reqs.iter().map(|r| r.peer.name.as_str()).collect();
        segs.sort_unstable();
        segs.dedup();
        let what = if pending == 0 {
            "every request done, its notification undelivered".to_string()
        } else {
            format!(
                "{pending} of {} requests ({bytes} B) outstanding: {}{}",
                b.reqs.len(),
                shown.join(", "),
                if pending > SHOWN { ", ..." } else { "" }
            )
        };
        format!("batch {batch} to segment(s) {segs:?}: {what}")
    }
}

impl Driven for Inner {
    fn progress(&self) -> &Progress {
        &self.progress
    }

    fn busy(&self) -> bool {
        self.batches.lock().values().any(|b| !b.done)
    }

    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn handle(&self, dev: usize, wc: &WorkCompletion) {
        self.dispatch(dev, wc);
    }
}

/// Accounts one completed (or failed) slice of request `r`.
fn finish_slice(b: &mut BatchState, r: usize, bytes: u64, failure: Option<Failure>) {
    let Some(req) = b.reqs.get_mut(r) else { return };
    if req.slices == 0 {
        return;
    }
    if req.failed.is_none() {
        req.failed = failure;
    }
    req.slices -= 1;
    req.bytes += bytes;
    if req.slices == 0 {
        b.open -= 1;
        if req.failed.is_none() {
            b.transferred += req.bytes;
        } else {
            b.failed += 1;
        }
    }
}

/// When a batch's requests are all over: the notification to send, or the batch is done.
fn ready_notify(b: &mut BatchState) -> Option<NotifySend> {
    if b.open > 0 || b.done {
        return None;
    }
    let ok = b.failed == 0;
    match b.notify.as_mut() {
        Some(n) if ok && !n.sent => {
            n.sent = true;
            Some((n.peer.clone(), std::mem::take(&mut n.msg)))
        }
        Some(n) if ok && n.failed.is_none() => None,
        _ => {
            b.done = true;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        for (b, r) in [(1, 0), (12345, NOTIFY_REQ), ((1 << 32) - 1, 99)] {
            assert_eq!(split_wr_id(wr_id(b, r)), (b, r));
        }
    }
}
