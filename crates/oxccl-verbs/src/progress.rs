//! The progress layer: what an engine above verbs needs to drive its operations to completion,
//! written once for the collectives' executor and the KV transfer engine.
//!
//! - **Tags.** An operation's work requests carry `(op, part)` in their `wr_id` ([`tag`],
//!   [`untag`]), so a completion finds its operation and the part of it that ended.
//! - **Polling by the caller.** [`Progress`] holds an engine's completion queues. Whoever waits
//!   polls them for everyone, one thread at a time ([`Progress::poll`]), and hands each
//!   completion, with the index of its queue, to the engine's handler: a synchronous operation
//!   costs no thread hand-off. A thread that finds another one polling sleeps until that one's
//!   dispatch ([`Progress::wait_for`]), on an event count, so no wake-up is lost.
//! - **A helper when nobody polls.** [`run_helper`] drives an engine's operations that nobody
//!   waits for (submitted, then left to finish), and stands back while a caller waits.
//! - **Wakers for futures** ([`Wakers`]): a future parks its waker under its operation, and the
//!   dispatch that ends the operation wakes it.
//! - **Windows** ([`Window`]): how many requests and bytes one queue pair may have in flight.
//! - **Timeouts that say what they waited for** ([`Waited::Timeout`]).
//!
//! ```
//! use std::time::{Duration, Instant};
//! use oxccl_verbs::progress::{Progress, Waited, tag, untag};
//! use oxccl_verbs::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = Device::by_name("shm")?.open()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//! let a = pd.create_qp(&cq, &cq, &QpConfig::default())?;
//! let b = pd.create_qp(&cq, &cq, &QpConfig::default())?;
//! a.connect(&b.endpoint())?;
//! b.connect(&a.endpoint())?;
//! let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//! let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let sge = [Sge::new(&src, 0, 64)];
//! a.post_send(&[SendWr::new(tag(7, 0), WrOp::Write { remote: dst.remote().at(0) }, &sge)])?;
//!
//! let progress = Progress::new(vec![cq]);
//! let done = std::cell::Cell::new(false);
//! let r = progress.wait_for(
//!     Instant::now() + Duration::from_secs(5),
//!     || "operation 7's WRITE".to_string(),
//!     0,
//!     |_queue, wc| {
//!         assert_eq!(untag(wc.wr_id), (7, 0));
//!         done.set(wc.is_ok());
//!         Ok::<_, String>(())
//!     },
//!     || done.get().then_some(()),
//! );
//! assert!(matches!(r, Ok(())));
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::model::{Error, WorkCompletion};
use crate::resource::CompletionQueue;

/// The `wr_id` of part `part` of operation `op`.
pub fn tag(op: u32, part: u32) -> u64 {
    (u64::from(op) << 32) | u64::from(part)
}

/// The operation and the part a `wr_id` made by [`tag`] names.
pub fn untag(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

/// How long a waiter that found another thread polling sleeps at most before it looks again
/// (a bound, not the usual case: the poller's dispatch wakes it).
const WATCH_NAP: Duration = Duration::from_millis(1);
/// With several queues, a sleeper blocks on one for this long at most before it polls them all.
const TURN: Duration = Duration::from_millis(1);
/// A passive waiter's longest sleep on a doorbell before it looks again (a bound: completions
/// ring the doorbell and wake it).
const MAX_PASSIVE_NAP: Duration = Duration::from_millis(10);

/// Why driving stopped.
#[derive(Debug)]
pub enum Waited<E> {
    /// The handler returned this error (driving stopped at that completion).
    Handler(E),
    /// A completion queue failed.
    Queue(Error),
    /// Nothing made the operation ready in time.
    Timeout {
        /// What was waited for, as the caller described it.
        what: String,
        /// How long.
        waited: Duration,
    },
}

impl<E: std::fmt::Display> std::fmt::Display for Waited<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Waited::Handler(e) => e.fmt(f),
            Waited::Queue(e) => write!(f, "a completion queue failed: {e}"),
            Waited::Timeout { what, waited } => {
                write!(f, "timed out after {waited:?} waiting for {what}")
            }
        }
    }
}

/// An engine's completion queues, and who polls them (see the module docs).
pub struct Progress {
    cqs: Vec<CompletionQueue>,
    /// Each queue's doorbell as the last poll found it ([`Progress::rang`]).
    rung: Vec<AtomicU32>,
    /// Held by the thread that polls: the buffer it polls into.
    poller: Mutex<Vec<WorkCompletion>>,
    /// Dispatches so far: a waiter reads it before it looks at its operation and sleeps only
    /// while it is unchanged (an event count), so a dispatch in between is never missed.
    dispatched: AtomicU64,
    sleep: Mutex<()>,
    changed: Condvar,
    /// Threads asleep on `changed` (a condition variable's wake is a system call even when
    /// nobody sleeps; the data path makes it only when someone does).
    sleepers: AtomicUsize,
    /// Threads in [`Progress::wait_for`]: while there are any, [`run_helper`] stands back.
    waiters: AtomicUsize,
    /// A waiter that finds nothing polls again at once instead of sleeping
    /// ([`Progress::busy_poll`]).
    busy: bool,
}

/// No queues: a placeholder (an engine takes its progress out while a handler borrows it).
impl Default for Progress {
    fn default() -> Progress {
        Progress::new(Vec::new())
    }
}

impl Progress {
    /// Progress over `cqs` (an engine's send queues, one per context it uses).
    pub fn new(cqs: Vec<CompletionQueue>) -> Progress {
        // (No buffer for no queues: the placeholder of `Default` allocates nothing.)
        let room = if cqs.is_empty() { 0 } else { 64 };
        Progress {
            rung: cqs.iter().map(|_| AtomicU32::new(u32::MAX)).collect(),
            cqs,
            poller: Mutex::new(vec![WorkCompletion::EMPTY; room]),
            dispatched: AtomicU64::new(0),
            sleep: Mutex::new(()),
            changed: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            busy: false,
        }
    }

    /// Makes [`Progress::wait_for`] poll without sleeping (a core spent per waiting thread, for
    /// the shortest round trip), or sleep again after its spin (the default).
    pub fn busy_poll(mut self, busy: bool) -> Progress {
        self.busy = busy;
        self
    }

    /// The queues, in the order their indices name them.
    pub fn queues(&self) -> &[CompletionQueue] {
        &self.cqs
    }

    /// Polls every queue until it is empty and hands each completion, with its queue's index,
    /// to `handle` (stopping at its first error). `None` when another thread polls now.
    pub fn poll<E>(
        &self,
        handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<Option<usize>, E> {
        let Ok(mut wcs) = self.poller.try_lock() else {
            return Ok(None);
        };
        let r = self.drain(&mut wcs, handle);
        drop(wcs);
        self.notify();
        r.map(Some)
    }

    /// [`Progress::poll`] for the owner of the only handle: no lock, no wake-ups (an engine
    /// that polls from one thread, as the collectives' executor does).
    pub fn poll_owned<E>(
        &mut self,
        handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<usize, E> {
        let mut wcs = std::mem::take(self.poller.get_mut().unwrap_or_else(|e| e.into_inner()));
        let r = self.drain(&mut wcs, handle);
        *self.poller.get_mut().unwrap_or_else(|e| e.into_inner()) = wcs;
        r
    }

    /// Polls every queue into `wcs` until it is empty, handing over each completion.
    fn drain<E>(
        &self,
        wcs: &mut [WorkCompletion],
        handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<usize, E> {
        self.hand_over(wcs, true, handle)
    }

    /// Takes what every queue holds (driving nothing) and hands it over.
    fn collect<E>(
        &self,
        wcs: &mut [WorkCompletion],
        handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<usize, E> {
        self.hand_over(wcs, false, handle)
    }

    /// Empties every queue into `wcs`, a batch at a time, handing over each completion: by
    /// polling (`drive`: the provider moves what it has first, and the doorbells seen are
    /// noted for [`Progress::rang`]), or by taking only what was completed already.
    fn hand_over<E>(
        &self,
        wcs: &mut [WorkCompletion],
        drive: bool,
        mut handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<usize, E> {
        if wcs.is_empty() {
            return Ok(0);
        }
        let mut total = 0;
        for (q, cq) in self.cqs.iter().enumerate() {
            loop {
                let n = if drive { cq.poll(wcs) } else { cq.take(wcs) };
                if drive && n < wcs.len() {
                    // Noted once the queue is empty, after the provider's own driving: what
                    // that reading completed was taken, and is no reason to poll again.
                    self.rung[q].store(cq.doorbell(), Ordering::Relaxed);
                }
                total += n;
                for wc in &wcs[..n] {
                    handle(q, wc)?;
                }
                if n < wcs.len() {
                    break;
                }
            }
        }
        Ok(total)
    }

    /// Whether a completion may have arrived since the last poll found the queues empty: one
    /// load per queue. The completions that poll's own driving made (a tcp socket read in
    /// this thread) were taken by it and do not count; one that another thread adds after it
    /// looked may not either, and stays queued for the next poll.
    pub fn rang(&self) -> bool {
        self.cqs
            .iter()
            .zip(&self.rung)
            .any(|(cq, seen)| cq.doorbell() != seen.load(Ordering::Relaxed))
    }

    /// Sleeps until a completion arrives (at most `max`) and hands over what came. It blocks in
    /// the wait of queue `hint` (the provider's: a futex for shm, `epoll_wait` on its sockets
    /// for tcp), the queue most likely to complete next; with several queues, for 1 ms at most
    /// before it polls them all. The caller must be the only poller (it holds the handle
    /// mutably, or it is the thread [`Progress::poll`] let in).
    pub fn sleep<E>(
        &self,
        hint: usize,
        max: Duration,
        mut handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
    ) -> Result<usize, Waited<E>> {
        let q = hint.min(self.cqs.len().saturating_sub(1));
        let Some(cq) = self.cqs.get(q) else {
            return Ok(0);
        };
        let several = self.cqs.len() > 1;
        let mut wcs = [WorkCompletion::EMPTY; 16];
        self.rung[q].store(cq.doorbell(), Ordering::Relaxed);
        let mut n = match cq.wait(&mut wcs, if several { max.min(TURN) } else { max }) {
            Ok(n) => n,
            Err(Error::Timeout { .. }) => 0,
            Err(e) => return Err(Waited::Queue(e)),
        };
        for wc in &wcs[..n] {
            handle(q, wc).map_err(Waited::Handler)?;
        }
        if several {
            n += self.drain(&mut wcs, &mut handle).map_err(Waited::Handler)?;
        }
        Ok(n)
    }

    /// Waits until `ready` gives a value, by `deadline`: while no other thread polls, this one
    /// polls (and, finding nothing, sleeps on queue `hint` for up to 10 ms, see
    /// [`Progress::sleep`]); while another does, it sleeps until that one's next dispatch.
    /// `ready` is asked before every sleep; `what` describes the wait for the timeout's error.
    pub fn wait_for<T, E>(
        &self,
        deadline: Instant,
        what: impl FnOnce() -> String,
        hint: usize,
        mut handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
        ready: impl FnMut() -> Option<T>,
    ) -> Result<T, Waited<E>> {
        self.wait_turns(deadline, what, ready, |mut wcs, left| {
            let r = match self.drain(&mut wcs, &mut handle) {
                Ok(0) if self.busy => {
                    std::hint::spin_loop();
                    Ok(0)
                }
                Ok(0) => self.sleep(hint, left.min(Duration::from_millis(10)), &mut handle),
                Ok(n) => Ok(n),
                Err(e) => Err(Waited::Handler(e)),
            };
            self.notify();
            r.map(drop)
        })
    }

    /// [`Progress::wait_for`] without driving the providers: completions are collected
    /// ([`CompletionQueue::take`]) and a waiter that finds none sleeps on queue `hint`'s
    /// doorbell ([`CompletionQueue::wait_doorbell`]), so that the provider's own threads (the
    /// tcp progress threads) move the bytes. For long transfers, whose copies would otherwise
    /// run in the waiting thread (it reads and writes the sockets while it drives): the waiter
    /// then wakes once per completion and costs little CPU. A short round trip waits better
    /// with [`Progress::wait_for`], where the message wakes the waiter directly.
    pub fn wait_passive<T, E>(
        &self,
        deadline: Instant,
        what: impl FnOnce() -> String,
        hint: usize,
        mut handle: impl FnMut(usize, &WorkCompletion) -> Result<(), E>,
        ready: impl FnMut() -> Option<T>,
    ) -> Result<T, Waited<E>> {
        let q = hint.min(self.cqs.len().saturating_sub(1));
        self.wait_turns(deadline, what, ready, |mut wcs, left| {
            let bell = self.cqs.get(q).map(CompletionQueue::doorbell);
            let r = self.collect(&mut wcs, &mut handle);
            drop(wcs);
            self.notify();
            let n = r.map_err(Waited::Handler)?;
            if let (0, Some(cq), Some(bell)) = (n, self.cqs.get(q), bell) {
                let nap = if self.cqs.len() > 1 {
                    TURN
                } else {
                    MAX_PASSIVE_NAP
                };
                cq.wait_doorbell(bell, left.min(nap));
            }
            Ok(())
        })
    }

    /// The loop of both waits: until `ready` gives a value (asked before every turn) or
    /// `deadline` passes, the thread that holds the poller takes a turn (`turn`, with the
    /// time left), and one that does not sleeps until the holder's next dispatch.
    fn wait_turns<T, E>(
        &self,
        deadline: Instant,
        what: impl FnOnce() -> String,
        mut ready: impl FnMut() -> Option<T>,
        mut turn: impl FnMut(
            std::sync::MutexGuard<'_, Vec<WorkCompletion>>,
            Duration,
        ) -> Result<(), Waited<E>>,
    ) -> Result<T, Waited<E>> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let _out = Leave(&self.waiters);
        let start = Instant::now();
        loop {
            let seen = self.dispatched.load(Ordering::Acquire);
            if let Some(v) = ready() {
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Waited::Timeout {
                    what: what(),
                    waited: now - start,
                });
            }
            let left = deadline - now;
            match self.poller.try_lock() {
                Ok(wcs) => turn(wcs, left)?,
                Err(_) => self.watch(seen, left.min(WATCH_NAP)),
            }
        }
    }

    /// Sleeps until a dispatch after `seen`, at most `max`.
    fn watch(&self, seen: u64, max: Duration) {
        let g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if self.dispatched.load(Ordering::Acquire) == seen {
            let _ = self
                .changed
                .wait_timeout_while(g, max, |_| self.dispatched.load(Ordering::Acquire) == seen);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Counts a dispatch and wakes the threads that watch for one (see
    /// [`Progress::wait_for`]), if any. Every poll does; an engine calls it after changing its
    /// operations outside a poll (a post that failed), so that their waiters look again.
    pub fn notify(&self) {
        self.dispatched.fetch_add(1, Ordering::Release);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            // Under the lock: a watcher between its check and its sleep holds it, so the
            // notification cannot fall between the two.
            drop(self.sleep.lock().unwrap_or_else(|e| e.into_inner()));
            self.changed.notify_all();
        }
    }

    /// Whether some thread is in [`Progress::wait_for`] (it drives; a helper stands back).
    pub fn has_waiters(&self) -> bool {
        self.waiters.load(Ordering::Acquire) > 0
    }
}

/// Counts a waiter out when its wait ends, however it ends.
struct Leave<'a>(&'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An engine a [`run_helper`] thread drives.
pub trait Driven: Send + Sync + 'static {
    /// The engine's progress.
    fn progress(&self) -> &Progress;
    /// Whether any operation is outstanding (the helper idles otherwise).
    fn busy(&self) -> bool;
    /// Whether the engine is shutting down (the helper ends).
    fn closed(&self) -> bool;
    /// Handles one completion of queue `queue` (as the engine's waiters do).
    fn handle(&self, queue: usize, wc: &WorkCompletion);
}

/// How long the helper naps between polls while operations are outstanding and nobody waits.
pub const HELPER_NAP: Duration = Duration::from_micros(200);
/// How long it naps when idle or when a caller drives (a submit does not wake the helper,
/// which would cost the submit a system call: an operation nobody waits for starts moving
/// within this).
pub const HELPER_IDLE: Duration = Duration::from_millis(1);

/// The body of an engine's helper thread: polls for operations nobody waits for, standing back
/// while a caller waits (it drives then), until the engine is closed or dropped.
pub fn run_helper<D: Driven>(engine: Weak<D>) {
    loop {
        let Some(e) = engine.upgrade() else { return };
        if e.closed() {
            return;
        }
        let nap = if e.progress().has_waiters() || !e.busy() {
            HELPER_IDLE
        } else {
            let _ = e.progress().poll(|q, wc| {
                e.handle(q, wc);
                Ok::<(), ()>(())
            });
            HELPER_NAP
        };
        drop(e);
        std::thread::sleep(nap);
    }
}

/// Wakers of futures, each parked under the operation it awaits.
#[derive(Default)]
pub struct Wakers {
    parked: Mutex<HashMap<u64, Waker>>,
    /// How many are parked (a dispatch skips the lock when none is).
    count: AtomicUsize,
}

impl Wakers {
    /// Parks `waker` under operation `op` (replacing the one parked before).
    pub fn park(&self, op: u64, waker: &Waker) {
        let mut m = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        if m.insert(op, waker.clone()).is_none() {
            self.count.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Wakes the future parked under `op`, if any.
    pub fn wake(&self, op: u64) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let w = {
            let mut m = self.parked.lock().unwrap_or_else(|e| e.into_inner());
            let w = m.remove(&op);
            if w.is_some() {
                self.count.fetch_sub(1, Ordering::AcqRel);
            }
            w
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Forgets the waker parked under `op` (its future was dropped).
    pub fn forget(&self, op: u64) {
        let mut m = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        if m.remove(&op).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// How much one queue pair may have in flight: requests and bytes. A request always fits an
/// empty window, however large.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    /// Most requests in flight.
    pub max_reqs: usize,
    /// Most bytes in flight.
    pub max_bytes: usize,
    reqs: usize,
    bytes: usize,
}

impl Window {
    /// An empty window of `max_reqs` requests and `max_bytes` bytes.
    pub fn new(max_reqs: usize, max_bytes: usize) -> Window {
        Window {
            max_reqs,
            max_bytes,
            reqs: 0,
            bytes: 0,
        }
    }

    /// Whether a request of `len` bytes may be posted now.
    pub fn fits(&self, len: usize) -> bool {
        self.reqs == 0 || (self.reqs < self.max_reqs && self.bytes + len <= self.max_bytes)
    }

    /// Counts a posted request of `len` bytes.
    pub fn take(&mut self, len: usize) {
        self.reqs += 1;
        self.bytes += len;
    }

    /// Counts a completed request of `len` bytes.
    pub fn give_back(&mut self, len: usize) {
        self.reqs = self.reqs.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(len);
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.reqs
    }
}

#[cfg(test)]
mod tests;
