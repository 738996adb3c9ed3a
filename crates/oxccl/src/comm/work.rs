//! [`Work`]: the handle of a call submitted to a communicator's worker thread; a
//! [`Future`], and pollable and waitable with a timeout without an executor.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Where the worker leaves a call's result for its [`Work`].
struct Slot<R> {
    state: Mutex<State<R>>,
    done: Condvar,
}

struct State<R> {
    result: Option<Result<R>>,
    /// The job was dropped without running (the communicator went away, or it panicked).
    abandoned: bool,
    /// The result was taken (by `wait` or the future).
    taken: bool,
    waker: Option<Waker>,
}

/// The worker's end: completes the [`Work`] once, with the job's result or, if dropped
/// without one, as abandoned.
pub(super) struct Completer<R>(Arc<Slot<R>>);

impl<R> Completer<R> {
    /// Hands `r` to the waiting [`Work`].
    pub(super) fn complete(self, r: Result<R>) {
        self.finish(Some(r));
    }

    fn finish(&self, r: Option<Result<R>>) {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.result.is_some() || st.abandoned || st.taken {
            return;
        }
        match r {
            Some(r) => st.result = Some(r),
            None => st.abandoned = true,
        }
        let waker = st.waker.take();
        drop(st);
        self.0.done.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<R> Drop for Completer<R> {
    fn drop(&mut self) {
        self.finish(None);
    }
}

/// A non-blocking call's handle (see [`Communicator::submit`](super::Communicator::submit)).
///
/// Wait for it with a timeout ([`Work::wait`]), poll it ([`Work::test`]), or `.await` it in
/// any executor: the worker thread wakes the task when the call is done.
pub struct Work<R> {
    slot: Arc<Slot<R>>,
    rank: usize,
}

/// A new handle and the worker's end of it.
pub(super) fn pair<R>(rank: usize) -> (Work<R>, Completer<R>) {
    let slot = Arc::new(Slot {
        state: Mutex::new(State {
            result: None,
            abandoned: false,
            taken: false,
            waker: None,
        }),
        done: Condvar::new(),
    });
    (
        Work {
            slot: slot.clone(),
            rank,
        },
        Completer(slot),
    )
}

impl<R> Work<R> {
    /// Whether the call has finished (successfully or not).
    pub fn test(&mut self) -> bool {
        let st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        st.result.is_some() || st.abandoned || st.taken
    }

    /// Waits up to `timeout` for the call: its result, or [`Error::WaitTimeout`] if it has not
    /// finished (the handle stays usable: wait again).
    pub fn wait(&mut self, timeout: Duration) -> Result<R> {
        let end = Instant::now() + timeout;
        let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = self.take(&mut st) {
                return r;
            }
            let now = Instant::now();
            if now >= end {
                return Err(Error::WaitTimeout {
                    rank: self.rank,
                    timeout,
                });
            }
            st = self
                .slot
                .done
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The result, if there is one to take.
    fn take(&self, st: &mut State<R>) -> Option<Result<R>> {
        if let Some(r) = st.result.take() {
            st.taken = true;
            return Some(r);
        }
        if st.taken {
            return Some(Err(Error::InvalidArgument {
                rank: self.rank,
                msg: "this work's result was already taken".into(),
            }));
        }
        st.abandoned.then(|| {
            st.taken = true;
            Err(Error::Aborted {
                rank: self.rank,
                op: "submitted work".into(),
                reason: "the communicator was dropped before the work ran, or it panicked".into(),
            })
        })
    }
}

/// Resolves to the call's result once the worker has run it. A call never resolves by its
/// own clock: it ends within its collective's timeout, as every call does.
impl<R> Future for Work<R> {
    type Output = Result<R>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<R>> {
        let this = self.get_mut();
        let mut st = this.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = this.take(&mut st) {
            return Poll::Ready(r);
        }
        match &st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => st.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<R> std::fmt::Debug for Work<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = if st.taken {
            "taken"
        } else if st.result.is_some() || st.abandoned {
            "done"
        } else {
            "running"
        };
        write!(f, "Work {{ rank: {}, {state} }}", self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_work_is_a_future_woken_by_its_completion() {
        let (mut work, done) = pair::<u32>(3);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut work).poll(&mut cx).is_pending());
        assert!(!work.test());
        let t = std::thread::spawn(move || done.complete(Ok(7)));
        t.join().unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once");
        assert!(work.test());
        match Pin::new(&mut work).poll(&mut cx) {
            Poll::Ready(Ok(7)) => {}
            other => panic!("{other:?}"),
        }
        // Taken: a second wait says so, it does not hang.
        let e = work.wait(Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("already taken"), "{e}");
    }

    #[test]
    fn wait_times_out_and_can_wait_again() {
        let (mut work, done) = pair::<&str>(0);
        let t0 = Instant::now();
        let e = work.wait(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, Error::WaitTimeout { rank: 0, .. }), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            done.complete(Ok("done"));
        });
        assert_eq!(work.wait(Duration::from_secs(10)).unwrap(), "done");
        t.join().unwrap();
    }

    #[test]
    fn a_job_dropped_without_running_fails_its_work() {
        let (mut work, done) = pair::<()>(1);
        drop(done);
        assert!(work.test());
        let e = work.wait(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Aborted { rank: 1, .. }), "{e}");
    }
}
