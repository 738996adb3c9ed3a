//! Completion queues: polling, and a blocking wait that spins, yields, then sleeps on a futex.
//!
//! A queue is its core (`contract::CqCore`: the completions queue pairs push, the doorbell) and
//! the queue pairs attached to it, whose progress a poll drives and whose receive rings it
//! harvests (`contract::QpInner`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::contract::{
    CqCore, CtxInner, CtxTables, QpHandleSide, QpInner, SEQ, SLEEPERS, futex_wait,
};
use crate::model::{Error, Result, WorkCompletion};

/// A completion queue (`ibv_cq`), shareable by many queue pairs as send and/or receive queue.
///
/// Completions of local requests are queued here; receive completions stay in the queue pair's
/// shared ring until polled. Waiting spins for [`DeviceConfig::spin`](crate::DeviceConfig::spin)
/// (default 50 µs), yields, then sleeps on a futex in the context segment that peers bump when
/// they complete one of our receives, so many processes on few cores do not starve each other.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    /// What queue pairs push to and ring.
    pub core: Arc<CqCore>,
    /// The queue pairs attached (as send or receive queue).
    sources: Mutex<Vec<Arc<QpInner>>>,
}

/// Longest single sleep: a safety net, since every event that matters also bumps the doorbell.
const MAX_NAP: Duration = Duration::from_millis(100);

impl CompletionQueue {
    pub(crate) fn new(ctx: Arc<CtxInner>, cqe: usize) -> Result<Self> {
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                core: Arc::new(CqCore::new(ctx, cqe)?),
                sources: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Moves up to `out.len()` completions into `out` and returns how many (`ibv_poll_cq`).
    /// Never blocks; drives pending requests (RNR retries) and notices dead peers.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        self.inner.poll(out)
    }

    /// Drives the software progress of this queue's queue pairs without taking completions:
    /// what an application that waits by polling memory (a flag a peer's WRITE sets) calls in
    /// its loop, as libfabric's manual-progress providers and UCX's `ucp_worker_progress` ask.
    /// With the tcp provider this reads the sockets (a peer's WRITE lands here, in this
    /// thread, rather than in the progress thread after a wake-up); with shm it costs a few
    /// loads.
    pub fn progress(&self) {
        self.inner.poll(&mut []);
    }

    /// A counter bumped whenever a completion is added to this queue (or a peer of it dies):
    /// when two reads return the same value, nothing arrived in between, so a caller can skip
    /// a [`CompletionQueue::poll`] with one memory load.
    pub fn doorbell(&self) -> u32 {
        let core = &self.inner.core;
        core.ctx
            .seg
            .cq_word(core.index, SEQ)
            .load(Ordering::Acquire)
    }

    /// Moves up to `out.len()` completions that are already made into `out`, driving nothing
    /// (no provider progress, no socket read): for a thread that leaves the driving to others
    /// (the tcp provider's progress thread, the threads that wait for their requests) and only
    /// collects, as a listener for incoming messages does. A peer's death is noticed by a
    /// [`CompletionQueue::poll`].
    pub fn take(&self, out: &mut [WorkCompletion]) -> usize {
        let inner = &self.inner;
        let mut n = inner.core.drain_local(out);
        let sources = inner.sources.lock().unwrap_or_else(|e| e.into_inner());
        for qp in sources.iter() {
            if n == out.len() {
                break;
            }
            if Arc::ptr_eq(qp.recv_cq(), &inner.core) {
                n += qp.harvest(&mut out[n..]);
            }
        }
        n
    }

    /// Sleeps until the [`doorbell`](CompletionQueue::doorbell) differs from `seen` (a
    /// completion was added, or a peer died), at most `timeout`, without driving the provider:
    /// unlike [`CompletionQueue::wait`], it never becomes the thread that reads the tcp
    /// provider's sockets, so a message for another thread does not wake this one first.
    /// Returns whether the doorbell moved.
    pub fn wait_doorbell(&self, seen: u32, timeout: Duration) -> bool {
        let core = &self.inner.core;
        let seq = core.ctx.seg.cq_word(core.index, SEQ);
        let deadline = Instant::now() + timeout;
        loop {
            if seq.load(Ordering::SeqCst) != seen {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            sleep_on_doorbell(core, seen, (deadline - now).min(MAX_NAP));
        }
    }

    /// Waits up to `timeout` for at least one completion and moves what is there into `out`.
    /// Errors with [`Error::Timeout`] naming this queue when nothing arrived in time.
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Err(Error::arg("wait needs room for at least one completion"));
        }
        let inner = &self.inner;
        let core = &inner.core;
        let start = Instant::now();
        let deadline = start + timeout;
        let spin_until = start + core.ctx.tuning.spin.min(timeout);
        let mut spins = 0u32;
        loop {
            let n = inner.poll(out);
            if n > 0 {
                return Ok(n);
            }
            spins = spins.wrapping_add(1);
            // (The clock is read every 64 polls, and after the first: a spin of 0 polls once,
            // where 64 polls of a tcp queue, a system call each, kept a waiting thread busy for
            // a whole 4 KiB round trip.)
            if (spins == 1 || spins.is_multiple_of(64)) && Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        // A spin of 0 asks for no busy waiting: no yields either (each is a system call and a
        // poll, which on tcp is another).
        let yields = if core.ctx.tuning.spin.is_zero() { 0 } else { 4 };
        for _ in 0..yields {
            std::thread::yield_now();
            let n = inner.poll(out);
            if n > 0 {
                return Ok(n);
            }
        }
        let seq = core.ctx.seg.cq_word(core.index, SEQ);
        loop {
            let observed = seq.load(Ordering::SeqCst);
            let n = inner.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "a completion on completion queue #{} ({} queue pair(s) attached)",
                        core.index,
                        inner
                            .sources
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .len()
                    ),
                    timeout,
                });
            }
            // Sleep until a producer bumps the sequence (peers completing our receives, local
            // completions, the service thread noticing a dead peer). Requests waiting for a
            // receive at the peer (RNR) are retried on a short back-off.
            let mut nap = (deadline - now).min(MAX_NAP);
            if inner.has_pending() {
                nap = nap.min(Duration::from_micros(200));
            }
            // A provider with its own wait (tcp: epoll on its sockets) sleeps there: the message
            // wakes the thread that waits for it.
            if core.ctx.ops.block(nap) {
                continue;
            }
            sleep_on_doorbell(core, observed, nap);
        }
    }
}

/// Sleeps on queue `core`'s doorbell while it still reads `seen` (at most `nap`), counted among
/// its sleepers so that a producer wakes it.
fn sleep_on_doorbell(core: &CqCore, seen: u32, nap: Duration) {
    let seq = core.ctx.seg.cq_word(core.index, SEQ);
    let sleepers = core.ctx.seg.cq_word(core.index, SLEEPERS);
    sleepers.fetch_add(1, Ordering::SeqCst);
    if seq.load(Ordering::SeqCst) == seen {
        futex_wait(seq, seen, nap);
    }
    sleepers.fetch_sub(1, Ordering::SeqCst);
}

impl CqInner {
    pub(crate) fn attach(&self, qp: Arc<QpInner>) {
        let mut s = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        if !s.iter().any(|q| Arc::ptr_eq(q, &qp)) {
            s.push(qp);
        }
    }

    pub(crate) fn detach(&self, qp: &QpInner) {
        self.sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|q| !std::ptr::eq(Arc::as_ptr(q), qp));
    }

    fn has_pending(&self) -> bool {
        self.sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|q| q.has_pending())
    }

    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        {
            self.core.ctx.ops.progress();
            let sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
            for qp in sources.iter() {
                qp.progress();
            }
            n += self.core.drain_local(&mut out[n..]);
            for qp in sources.iter() {
                if n == out.len() {
                    break;
                }
                if Arc::ptr_eq(qp.recv_cq(), &self.core) {
                    n += qp.harvest(&mut out[n..]);
                }
            }
        }
        self.core.ctx.ops.polled(n);
        n
    }
}
