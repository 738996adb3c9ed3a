//! The communicator's worker thread: the progress engine of calls that do not block.
//!
//! Two kinds of jobs queue up for it, in the order they were made:
//! - calls started with [`Communicator::start`] (and the `_async` calls built on it): the
//!   worker flies them together, as a group's calls, admitting each new one as it comes while
//!   the others run ([`crate::engine`]'s session), so that several are in flight at once and
//!   a send and a receive with the same peer never wait for each other, whenever each was
//!   started; each call's [`Work`] completes as soon as that call is done;
//! - closures given to [`Communicator::submit`], which run alone, after every call queued
//!   before them.
//!
//! A call started while a job that numbers its calls only when it runs is queued or running
//! (a submitted closure, a call that runs alone, or another such call) is deferred: it is
//! numbered and planned by the worker when it reaches it, in queue order, and then flies as a
//! started call does. So sequence numbers follow the order of calls whatever the timing, and
//! starting a call never waits for a long call to finish (a DDP hook returns at once).
//!
//! A blocking call waits until the queue is empty and nothing flies, so collectives keep the
//! order in which they were called. Calls a rank must run alone also wait for the set to empty
//! (calls in mailbox mode, whose two ends must both run them alone; calls that feed the
//! link-rate learner, which runs a collective of its own after them).

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{Buffers, Checked, Communicator, Inner, Prepared, work};
use crate::engine::{One, Plan, Scratch};
use crate::error::{Error, Result};
use crate::flight;
use crate::schedule::Collective;
use crate::{DataType, Element, ReduceOp, Registered, Work, dtype};

/// A job for the worker.
pub(super) enum Job {
    /// Work to run alone ([`Communicator::submit`]).
    Run(Box<dyn FnOnce(&Communicator) + Send>),
    /// A call to fly ([`Communicator::start`]).
    Call(Box<Started>),
    /// A call to number, plan and fly when the worker reaches it ([`Communicator::start`]
    /// while an unnumbered job waits).
    Deferred(Box<Deferred>),
}

/// A checked call, numbered and planned by the worker in queue order.
pub(super) struct Deferred {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    checked: Carried,
    timeout: Duration,
    done: Box<dyn FnOnce(Result<()>) + Send>,
    /// Whether the call may feed the link-rate learner (then it runs alone, when the worker
    /// reaches it, as a blocking call does: every rank counts it alike).
    metered: bool,
}

impl Deferred {
    /// Whether the call must run alone: it feeds the link-rate learner.
    fn alone(&self, comm: &Communicator) -> bool {
        let c = &self.checked.0;
        self.metered
            && comm.runs_alone(
                &comm.lock(),
                &self.coll,
                self.dtype,
                c.in_len.max(c.out_len),
            )
    }

    /// Runs the call alone, now (on the worker), and completes its work.
    fn run_alone(self, comm: &Communicator) {
        let r = comm.run_checked(
            &self.coll,
            self.dtype,
            self.op,
            self.checked.take(),
            self.timeout,
        );
        (self.done)(r);
        comm.inner.unnumbered.fetch_sub(1, Ordering::AcqRel);
        comm.job_done();
    }

    /// Numbered and planned now (on the worker): a started call, or its work failed.
    fn number(self, comm: &Communicator) -> Option<Started> {
        let planned = {
            let mut st = comm.lock();
            comm.check_usable(&st, &self.coll).and_then(|()| {
                let in_place = self.checked.0.in_place;
                comm.prepare(&mut st, &self.coll, self.dtype, self.op, in_place)
            })
        };
        comm.inner.unnumbered.fetch_sub(1, Ordering::AcqRel);
        match planned {
            Ok(prepared) => Some(Started {
                coll: self.coll,
                dtype: self.dtype,
                op: self.op,
                prepared,
                checked: self.checked.take(),
                timeout: self.timeout,
                done: self.done,
            }),
            Err(e) => {
                (self.done)(Err(e));
                comm.job_done();
                None
            }
        }
    }
}

/// A started call: checked, numbered and planned on the caller's thread (so its sequence
/// number is its place among the caller's calls), waiting to fly.
pub(super) struct Started {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    prepared: Prepared,
    checked: Checked,
    timeout: Duration,
    /// Completes the call's [`Work`], giving its buffers back on success.
    done: Box<dyn FnOnce(Result<()>) + Send>,
}

// SAFETY: `Checked` holds raw pointers into buffers the job itself owns (boxed in `done`,
// which is never called, nor dropped, while the engine uses them): moving the job to the
// worker thread moves the ownership of that memory with it.
unsafe impl Send for Started {}

/// A checked call's buffers, carried to the worker with the job that owns their memory.
struct Carried(Checked);

// SAFETY: as for `Started`: the raw pointers point into memory the same job owns (boxed in
// its `finish`, called only once the call is over).
unsafe impl Send for Carried {}

impl Carried {
    /// The buffers (a method, so that a closure captures the whole carrier, not its field).
    fn take(self) -> Checked {
        self.0
    }
}

/// Buffers a call that does not block owns while it runs ([`Communicator::start`]), and
/// hands back through its [`Work`] when it is done.
///
/// Implemented for a vector or registered buffer (the call's one buffer: in place, or the
/// send buffer of a send, the receive buffer of a receive), and for a pair of them (input,
/// output).
pub trait CallBuffers: Send + 'static {
    /// The element type.
    fn dtype(&self) -> DataType;
    /// Elements of the buffer (of the input, for a pair): an `_async` call's count.
    fn elements(&self) -> usize;
    /// The call's buffers. Called once, after the value was moved where it stays until the
    /// call is done.
    fn buffers(&mut self) -> Buffers<'_>;
}

impl<T: Element> CallBuffers for Vec<T> {
    fn dtype(&self) -> DataType {
        T::DTYPE
    }
    fn elements(&self) -> usize {
        self.len()
    }
    fn buffers(&mut self) -> Buffers<'_> {
        Buffers::InPlace(dtype::as_bytes_mut(self))
    }
}

impl<T: Element> CallBuffers for Registered<T> {
    fn dtype(&self) -> DataType {
        T::DTYPE
    }
    fn elements(&self) -> usize {
        self.len()
    }
    fn buffers(&mut self) -> Buffers<'_> {
        Buffers::InPlace(dtype::as_bytes_mut(self))
    }
}

impl<I: Input, O: Output> CallBuffers for (I, O) {
    fn dtype(&self) -> DataType {
        self.0.element()
    }
    fn elements(&self) -> usize {
        self.0.bytes().len() / self.0.element().size()
    }
    fn buffers(&mut self) -> Buffers<'_> {
        let (i, o) = self;
        Buffers::OutOfPlace {
            input: i.bytes(),
            output: o.bytes_mut(),
        }
    }
}

/// The input of an out-of-place call that does not block.
pub trait Input: Send + 'static {
    /// The element type.
    fn element(&self) -> DataType;
    /// Its bytes.
    fn bytes(&self) -> &[u8];
}

/// The output of an out-of-place call that does not block.
pub trait Output: Send + 'static {
    /// Its bytes.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl<T: Element> Input for Vec<T> {
    fn element(&self) -> DataType {
        T::DTYPE
    }
    fn bytes(&self) -> &[u8] {
        dtype::as_bytes(self)
    }
}

impl<T: Element> Input for Registered<T> {
    fn element(&self) -> DataType {
        T::DTYPE
    }
    fn bytes(&self) -> &[u8] {
        dtype::as_bytes(self)
    }
}

impl<T: Element> Output for Vec<T> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        dtype::as_bytes_mut(self)
    }
}

impl<T: Element> Output for Registered<T> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        dtype::as_bytes_mut(self)
    }
}

/// Rounds a session drives before it looks at its queue, when nothing is done and nothing
/// stops it: about this long without progress.
const SLICE: Duration = Duration::from_millis(1);

/// Calls a session flies at most (more wait their turn); the plans of its calls are kept until
/// it ends, so a session that never empties is ended by not admitting past this many.
const SESSION_CALLS: usize = 4096;

/// Calls in flight at once at most.
const IN_FLIGHT: usize = 64;

impl Communicator {
    /// Starts `coll` on `bufs` without waiting for it: the call joins the calls in flight
    /// (see the module docs of the worker), and its [`Work`] gives the buffers back once it
    /// is done (or its error). Calls started one after another run together, so a send and
    /// a receive with the same peer, or several collectives, progress at once; every rank
    /// starts its calls in the same order, as with blocking calls.
    ///
    /// The buffers are checked now (an error is the work's result at once); a send takes its
    /// buffer as its input, a receive as its output, any other call in place unless given a
    /// pair (input, output). Its timeout is the communicator's at the time of the call.
    pub fn start<B: CallBuffers>(&self, coll: Collective, op: ReduceOp, bufs: B) -> Work<B> {
        self.start_work(coll, op, bufs, true)
    }

    /// [`Communicator::start`] with its own timeout (`None`: the communicator's) and, instead
    /// of a [`Work`], a function the worker calls with the buffers and the result once the
    /// call is done (or failed: the buffers come back either way): for a caller with its own
    /// way of waiting (Python's, say). `done` runs on the worker thread (or at once, for
    /// arguments refused), and must not block.
    pub fn start_with<B, F>(
        &self,
        coll: Collective,
        op: ReduceOp,
        bufs: B,
        timeout: Option<Duration>,
        done: F,
    ) where
        B: CallBuffers,
        F: FnOnce(B, Result<()>) + Send + 'static,
    {
        self.start_metered(coll, op, bufs, timeout, done, true)
    }

    /// [`Communicator::start`] for a call that never feeds the link-rate learner, so it always
    /// flies with the others and is numbered now, in the caller's order. (A metered call runs
    /// alone and is numbered when the worker reaches it, so calls started after it while it
    /// waits would take numbers before it, in an order that depends on timing: pipelines
    /// that start calls while others are queued use this.)
    pub(super) fn start_unmetered<B: CallBuffers>(
        &self,
        coll: Collective,
        op: ReduceOp,
        bufs: B,
    ) -> Work<B> {
        self.start_work(coll, op, bufs, false)
    }

    /// [`Communicator::start`], metered or not: the [`Work`] the buffers come back through.
    fn start_work<B: CallBuffers>(
        &self,
        coll: Collective,
        op: ReduceOp,
        bufs: B,
        metered: bool,
    ) -> Work<B> {
        let (work, done) = work::pair(self.inner.rank);
        let done = move |b, r: Result<()>| done.complete(r.map(|()| b));
        self.start_metered(coll, op, bufs, None, done, metered);
        work
    }

    /// [`Communicator::start_with`], the call metered (when the learner wants it) or not.
    fn start_metered<B, F>(
        &self,
        coll: Collective,
        op: ReduceOp,
        bufs: B,
        timeout: Option<Duration>,
        done: F,
        metered: bool,
    ) where
        B: CallBuffers,
        F: FnOnce(B, Result<()>) + Send + 'static,
    {
        let timeout = timeout.unwrap_or_else(|| self.timeout());
        let mut owner = Box::new(bufs);
        let dtype = owner.dtype();
        let buffers = match (owner.buffers(), &coll) {
            (Buffers::InPlace(b), Collective::Send { .. }) => Buffers::OutOfPlace {
                input: b,
                output: &mut [],
            },
            (Buffers::InPlace(b), Collective::Recv { .. }) => Buffers::OutOfPlace {
                input: &[],
                output: b,
            },
            (b, _) => b,
        };
        let checked = match self.check_call(&coll, dtype, buffers) {
            Ok(c) => c,
            Err(e) => {
                done(*owner, Err(e));
                return;
            }
        };
        let finish: Box<dyn FnOnce(Result<()>) + Send> =
            Box::new(move |r: Result<()>| done(*owner, r));
        // Started from a job the worker runs (`submit`): the worker is busy with that job, so
        // the call runs now, on it, in the job's order (queued, it would wait for the job that
        // waits for it).
        if ON_WORKER.with(|w| w.get()) == Arc::as_ptr(&self.inner) as usize {
            finish(self.run_checked(&coll, dtype, op, checked, timeout));
            return;
        }
        // Behind a job that numbers its calls when it runs: numbered by the worker too, after it
        // (and without waiting for it here).
        if self.inner.unnumbered.load(Ordering::Acquire) > 0 {
            self.enqueue(Job::Deferred(Box::new(Deferred {
                coll,
                dtype,
                op,
                checked: Carried(checked),
                timeout,
                done: finish,
                metered,
            })));
            return;
        }
        // Calls that must run alone go through the queue as closures: those that feed the
        // link-rate learner. The others are numbered and planned now, in the caller's order.
        let planned = {
            let mut st = self.lock();
            let alone =
                metered && self.runs_alone(&st, &coll, dtype, checked.in_len.max(checked.out_len));
            (!alone).then(|| {
                self.check_usable(&st, &coll)
                    .and_then(|()| self.prepare(&mut st, &coll, dtype, op, checked.in_place))
            })
        };
        match planned {
            None => {
                let checked = Carried(checked);
                self.enqueue(Job::Run(Box::new(move |c: &Communicator| {
                    finish(c.run_checked(&coll, dtype, op, checked.take(), timeout));
                })));
            }
            Some(Ok(prepared)) => self.enqueue(Job::Call(Box::new(Started {
                coll,
                dtype,
                op,
                prepared,
                checked,
                timeout,
                done: finish,
            }))),
            Some(Err(e)) => finish(Err(e)),
        }
    }

    /// Non-blocking in-place all-reduce of an owned buffer, returned by [`Work::wait`].
    pub fn all_reduce_async<B: CallBuffers>(&self, buf: B, op: ReduceOp) -> Work<B> {
        let count = buf.elements();
        self.start(Collective::AllReduce { count }, op, buf)
    }

    /// Non-blocking send of an owned buffer to `peer` ([`Communicator::send`]); the buffer
    /// comes back through the [`Work`].
    pub fn send_async<B: CallBuffers>(&self, buf: B, peer: usize) -> Work<B> {
        let count = buf.elements();
        self.start(Collective::Send { count, peer }, ReduceOp::Sum, buf)
    }

    /// Non-blocking receive into an owned buffer from `peer` ([`Communicator::recv`]).
    pub fn recv_async<B: CallBuffers>(&self, buf: B, peer: usize) -> Work<B> {
        let count = buf.elements();
        self.start(Collective::Recv { count, peer }, ReduceOp::Sum, buf)
    }

    /// Runs `f` on this communicator's worker thread, after every call started or submitted
    /// before it, alone, and returns a handle; blocking calls made meanwhile wait for
    /// submitted work first, so the order of collectives is the order of calls. `f` owns its
    /// buffers: `comm.submit(move |c| c.all_reduce_in_place(&mut v, ReduceOp::Sum).map(|_| v))`.
    pub fn submit<R, F>(&self, f: F) -> Work<R>
    where
        R: Send + 'static,
        F: FnOnce(&Communicator) -> Result<R> + Send + 'static,
    {
        let (work, done) = work::pair(self.inner.rank);
        self.enqueue(Job::Run(Box::new(move |c: &Communicator| {
            done.complete(f(c))
        })));
        work
    }

    /// Queues a job for the worker (starting it on first use).
    fn enqueue(&self, job: Job) {
        {
            let mut p = self
                .inner
                .pending
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *p += 1;
            self.inner.queued.store(*p, Ordering::Release);
        }
        self.inner.waiting_jobs.fetch_add(1, Ordering::AcqRel);
        let unnumbered = !matches!(job, Job::Call(_));
        if unnumbered {
            self.inner.unnumbered.fetch_add(1, Ordering::AcqRel);
        }
        let mut q = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        let sender = q.get_or_insert_with(|| spawn(Arc::downgrade(&self.inner)));
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            drop(q);
            self.inner.waiting_jobs.fetch_sub(1, Ordering::AcqRel);
            if unnumbered {
                self.inner.unnumbered.fetch_sub(1, Ordering::AcqRel);
            }
            // The worker is gone: the job is abandoned (its work says so) and not pending.
            drop(job);
            self.job_done();
        }
    }

    /// A job (or one call of a session) is over.
    /// Whether a call of `bytes` feeds the link-rate learner, and so must run alone (as the
    /// blocking calls run: every rank counts it at the same place).
    fn runs_alone(
        &self,
        st: &super::State,
        coll: &Collective,
        dtype: DataType,
        bytes: usize,
    ) -> bool {
        st.learner.is_some() && crate::learn::eligible(coll, &st.tuning, dtype.size(), bytes)
    }

    fn job_done(&self) {
        let (m, cv) = &self.inner.pending;
        let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
        *p -= 1;
        self.inner.queued.store(*p, Ordering::Release);
        cv.notify_all();
    }

    /// Waits until every started and submitted job is done (a blocking call keeps the order
    /// of calls); returns at once on the worker thread itself.
    #[inline]
    pub(super) fn wait_for_queue(&self) {
        if self.inner.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let me = Arc::as_ptr(&self.inner) as usize;
        if ON_WORKER.with(|w| w.get()) == me {
            return;
        }
        let (m, cv) = &self.inner.pending;
        let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
        while *p > 0 {
            p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }
}

thread_local! {
    static ON_WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Starts the worker thread.
fn spawn(inner: Weak<Inner>) -> mpsc::Sender<Job> {
    let (tx, rx) = mpsc::channel::<Job>();
    let spawned = std::thread::Builder::new()
        .name("oxccl-worker".into())
        .spawn(move || worker(inner, rx));
    if let Err(e) = spawned {
        crate::log_warn(format!("cannot start the oxccl worker thread: {e}"));
    }
    tx
}

fn worker(inner: Weak<Inner>, rx: Receiver<Job>) {
    let mut next: Option<Job> = None;
    loop {
        let job = match next.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => break,
            },
        };
        let Some(inner) = inner.upgrade() else { break };
        inner.waiting_jobs.fetch_sub(1, Ordering::AcqRel);
        let comm = Communicator { inner };
        ON_WORKER.with(|w| w.set(Arc::as_ptr(&comm.inner) as usize));
        match job {
            Job::Run(f) => {
                f(&comm);
                comm.inner.unnumbered.fetch_sub(1, Ordering::AcqRel);
                comm.job_done();
            }
            Job::Call(s) => next = Session::new(&comm, &rx).run(*s),
            Job::Deferred(d) if d.alone(&comm) => d.run_alone(&comm),
            Job::Deferred(d) => {
                if let Some(s) = d.number(&comm) {
                    next = Session::new(&comm, &rx).run(s);
                }
            }
        }
        ON_WORKER.with(|w| w.set(0));
    }
}

/// A call in flight: what its work needs when it lands.
struct Flying {
    call: Started,
    /// Its id in the flight recorder.
    flight: u64,
    deadline: Instant,
    _scratch: Scratch,
}

/// The worker flying calls: admits started calls as they come, drives them, lands each as
/// it is done, and ends once none flies and none waits (or a job that must run alone is
/// next, which it returns).
struct Session<'c> {
    comm: &'c Communicator,
    rx: &'c Receiver<Job>,
}

impl<'c> Session<'c> {
    fn new(comm: &'c Communicator, rx: &'c Receiver<Job>) -> Session<'c> {
        Session { comm, rx }
    }

    fn run(self, first: Started) -> Option<Job> {
        let plans = typed_arena::Arena::<Arc<Plan>>::new();
        let mut ones: Vec<One<'_>> = Vec::new();
        let mut flying: Vec<Flying> = Vec::new();
        let mut admitted = 0;
        let mut next = Some(Job::Call(Box::new(first)));
        let mut alone: Option<Box<Started>> = None;
        loop {
            // Admit what waits, unless a call that must run alone is next.
            while alone.is_none() && ones.len() < IN_FLIGHT && admitted < SESSION_CALLS {
                let job = match next.take() {
                    Some(j) => j,
                    None => match self.rx.try_recv() {
                        Ok(j) => {
                            self.comm.inner.waiting_jobs.fetch_sub(1, Ordering::AcqRel);
                            j
                        }
                        Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                    },
                };
                let s = match job {
                    Job::Call(s) => s,
                    // It runs alone: once the calls flying have landed.
                    Job::Deferred(d) if d.alone(self.comm) => {
                        next = Some(Job::Deferred(d));
                        break;
                    }
                    Job::Deferred(d) => match d.number(self.comm) {
                        Some(s) => Box::new(s),
                        None => continue,
                    },
                    run @ Job::Run(_) => {
                        next = Some(run);
                        break;
                    }
                };
                if self.mailbox(&s) {
                    alone = Some(s);
                    break;
                }
                admitted += 1;
                self.admit(*s, &plans, &mut ones, &mut flying);
            }
            if ones.is_empty() {
                match alone.take() {
                    // A call in mailbox mode, alone: as a blocking call.
                    Some(s) => {
                        self.solo(*s);
                        continue;
                    }
                    None if next.is_some() || admitted >= SESSION_CALLS => return next,
                    None => match self.rx.try_recv() {
                        Ok(j) => {
                            self.comm.inner.waiting_jobs.fetch_sub(1, Ordering::AcqRel);
                            next = Some(j);
                            continue;
                        }
                        Err(_) => return None,
                    },
                }
            }
            self.drive(&mut ones, &mut flying);
        }
    }

    /// Whether a started call runs in mailbox mode (alone).
    fn mailbox(&self, s: &Started) -> bool {
        s.prepared.planned.protocol == flight::Protocol::Mailbox
    }

    /// Makes a started call fly (or fails its work at once). Its start is recorded under the
    /// communicator's lock, as every call's is (the flight recorder has one writer at a
    /// time).
    fn admit<'p>(
        &self,
        s: Started,
        plans: &'p typed_arena::Arena<Arc<Plan>>,
        ones: &mut Vec<One<'p>>,
        flying: &mut Vec<Flying>,
    ) {
        let comm = self.comm;
        let p = &s.prepared;
        let plan: &'p Plan = plans.alloc(p.planned.plan.clone());
        let mut scratch = Scratch::new();
        let mut st = comm.lock();
        let spec = s.checked.spec(plan, p.desc, s.dtype, s.op);
        let r = comm
            .check_usable(&st, &s.coll)
            .and_then(|()| st.engine.fly(&spec, ones.len(), &mut scratch));
        match r {
            Ok(one) => {
                let id = flight::start(&comm.inner.probe, &p.info());
                drop(st);
                ones.push(one);
                flying.push(Flying {
                    deadline: Instant::now() + s.timeout,
                    call: s,
                    flight: id,
                    _scratch: scratch,
                });
            }
            Err(e) => {
                let e = match e {
                    e @ Error::Poisoned { .. } | e @ Error::Aborted { .. } => e,
                    e => comm.failed(&mut st, e),
                };
                drop(st);
                (s.done)(Err(e));
                comm.job_done();
            }
        }
    }

    /// Runs a call that must run alone, as a blocking call would.
    fn solo(&self, s: Started) {
        let r = self
            .comm
            .run_planned(&s.coll, s.dtype, s.op, &s.prepared, &s.checked, s.timeout);
        (s.done)(r);
        self.comm.job_done();
    }

    /// Drives the calls in flight for a slice; lands those that are done; on a failure,
    /// fails them all. Their ends are recorded before the lock is let go.
    fn drive(&self, ones: &mut Vec<One<'_>>, flying: &mut Vec<Flying>) {
        let comm = self.comm;
        let inner = &comm.inner;
        let stop = || {
            inner.waiting_jobs.load(Ordering::Acquire) > 0
                || inner.wanting.load(Ordering::Acquire) > 0
        };
        let deadlines: Vec<(Instant, Duration)> = flying
            .iter()
            .map(|f| (f.deadline, f.call.timeout))
            .collect();
        let mut st = comm.lock();
        let ended: Vec<(Flying, Result<()>)> = match st.engine.drive(ones, &deadlines, &stop, SLICE)
        {
            Ok(()) => {
                let landed = st.engine.land(ones);
                landed
                    .iter()
                    .rev()
                    .map(|&i| (flying.remove(i), Ok(())))
                    .collect()
            }
            Err(e) => {
                let e = comm.failed(&mut st, e);
                ones.clear();
                // The first call in flight gets the error (which names the call that failed);
                // the others, what it was.
                let text = e.to_string();
                let mut first = Some(e);
                flying
                    .drain(..)
                    .map(|f| {
                        let e = first.take().unwrap_or_else(|| Error::Poisoned {
                            rank: inner.rank,
                            first: text.clone(),
                        });
                        (f, Err(e))
                    })
                    .collect()
            }
        };
        for (f, r) in &ended {
            flight::end(&inner.probe, f.flight, &f.call.prepared.desc, r);
        }
        drop(st);
        for (f, r) in ended {
            self.finish(f.call, r);
        }
        // Let a thread that waits for the engine (a call being started) have it.
        let mut spins = 0;
        while inner.wanting.load(Ordering::Acquire) > 0 && spins < 100 {
            std::thread::yield_now();
            spins += 1;
        }
    }

    /// A call landed (or failed): an average's division, its work.
    fn finish(&self, s: Started, r: Result<()>) {
        let comm = self.comm;
        if r.is_ok() {
            let k = &s.checked;
            comm.finish_avg(&s.coll, s.dtype, s.op, &k.raw, k.in_place, k.out_len);
        }
        (s.done)(r);
        comm.job_done();
    }
}
