//! [`PyWork`] (`oxccl.Work`): the handle of an asynchronous call.
//!
//! The call flies on the communicator's worker thread with the calls started before and
//! after it ([`oxccl::Communicator::start_with`]: in the order of calls, several at once).
//! When it ends, the result is stored and waiters wake; callbacks and futures (and the
//! release of the call's buffers) run on one completion thread per process, which takes the
//! GIL, so that the worker goes on with the next call at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::buffer::View;
use crate::errors;

/// What runs when a call ends.
enum Callback {
    /// `fn(work)`.
    Call(Py<PyAny>, Py<PyWork>),
    /// `fut.set_result(value)` (value: the call's output when `None`) or
    /// `fut.set_exception(error)`; for `concurrent.futures.Future` and `torch.futures.Future`.
    Future(Py<PyAny>, Option<Py<PyAny>>),
}

#[derive(Default)]
struct State {
    result: Option<oxccl::Result<()>>,
    views: Vec<View>,
    callbacks: Vec<Callback>,
    /// What `wait()` returns: the output object.
    output: Option<Py<PyAny>>,
}

/// A call's state shared by its handle, the worker and the completion thread.
pub struct Shared {
    state: Mutex<State>,
    done: Condvar,
    /// For messages: "all_reduce of 1024 float elements".
    what: String,
    rank: usize,
    /// The call's own timeout: `wait()` without one waits this long plus a margin.
    timeout: Duration,
}

impl Shared {
    /// State for a call about to be submitted, owning its `views`.
    pub fn new(
        what: String,
        rank: usize,
        timeout: Duration,
        views: Vec<View>,
        output: Option<Py<PyAny>>,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            state: Mutex::new(State {
                views,
                output,
                ..State::default()
            }),
            done: Condvar::new(),
            what,
            rank,
            timeout,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The call's views, for the call to own while it runs (they come back with
    /// [`Shared::finish`], so that they outlive the call even if the handle is dropped
    /// meanwhile).
    pub fn take_views(&self) -> Vec<View> {
        std::mem::take(&mut self.lock().views)
    }

    /// Ends the call: its views back, its result stored, waiters woken, Python's part
    /// (callbacks, releasing the buffers) handed to the completion thread.
    pub fn finish(self: &Arc<Self>, views: Vec<View>, r: oxccl::Result<()>) {
        let mut st = self.lock();
        st.views = views;
        st.result = Some(r);
        // Callbacks need the GIL; so does releasing the buffers when the handle is gone (the
        // worker must not wait for the GIL).
        let python_work =
            !st.callbacks.is_empty() || (Arc::strong_count(self) == 1 && !st.views.is_empty());
        drop(st);
        self.done.notify_all();
        if python_work {
            completions().send(self.clone());
        }
    }

    /// Ends a call that could not be submitted.
    pub fn fail(self: &Arc<Self>, e: oxccl::Error) {
        let views = self.take_views();
        self.finish(views, Err(e));
    }
}

/// The completion thread's queue.
struct Completions(Mutex<mpsc::Sender<Arc<Shared>>>);

impl Completions {
    fn send(&self, s: Arc<Shared>) {
        let tx = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // The thread lives as long as the process; if it could not be started, the
        // callbacks are run by the next wait() instead.
        let _ = tx.send(s);
    }
}

/// False once the interpreter is exiting: no thread may take the GIL then.
static ALIVE: AtomicBool = AtomicBool::new(true);
/// Completion batches between their check of [`ALIVE`] and their release of the GIL.
static ATTACHING: AtomicUsize = AtomicUsize::new(0);

fn completions() -> &'static Completions {
    static C: OnceLock<Completions> = OnceLock::new();
    C.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Arc<Shared>>();
        let spawned = std::thread::Builder::new()
            .name("oxccl-py-completion".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut batch = vec![first];
                    batch.extend(rx.try_iter());
                    ATTACHING.fetch_add(1, Ordering::SeqCst);
                    if ALIVE.load(Ordering::SeqCst) {
                        Python::attach(|py| {
                            for s in &batch {
                                finish(py, s);
                            }
                        });
                    } else {
                        // The interpreter is going away: what the callbacks hold goes with it.
                        std::mem::forget(batch);
                    }
                    ATTACHING.fetch_sub(1, Ordering::SeqCst);
                }
            });
        if let Err(e) = spawned {
            eprintln!("oxccl: cannot start the completion thread: {e}");
        }
        Completions(Mutex::new(tx))
    })
}

/// Called by `atexit`: stops completion callbacks before the interpreter finalizes (a thread
/// that took the GIL then would be ended under our feet), waiting up to a second for a batch
/// already running.
#[pyfunction]
#[pyo3(name = "_at_exit")]
pub fn at_exit(py: Python<'_>) {
    ALIVE.store(false, Ordering::SeqCst);
    py.detach(|| {
        let end = Instant::now() + Duration::from_secs(1);
        while ATTACHING.load(Ordering::SeqCst) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Runs a finished call's callbacks and releases its buffers (GIL held).
fn finish(py: Python<'_>, s: &Arc<Shared>) {
    let (callbacks, views, output, err) = {
        let mut st = s.lock();
        let Some(r) = &st.result else { return };
        let err = r.as_ref().err().map(|e| errors::to_py(py, e));
        (
            std::mem::take(&mut st.callbacks),
            std::mem::take(&mut st.views),
            st.output.as_ref().map(|o| o.clone_ref(py)),
            err,
        )
    };
    drop(views);
    for cb in callbacks {
        let r = match cb {
            Callback::Call(f, work) => f.bind(py).call1((work,)).map(drop),
            Callback::Future(fut, value) => {
                let fut = fut.bind(py);
                match &err {
                    Some(e) => fut
                        .call_method1("set_exception", (e.clone_ref(py).into_value(py),))
                        .map(drop),
                    None => {
                        let v = value.or_else(|| output.as_ref().map(|o| o.clone_ref(py)));
                        fut.call_method1("set_result", (v,)).map(drop)
                    }
                }
            }
        };
        if let Err(e) = r {
            // Like concurrent.futures: a failing callback is reported, not propagated.
            e.write_unraisable(py, None);
        }
    }
}

/// The handle of an asynchronous call (`async_op=True`): `wait(timeout)`, `is_completed()`,
/// `exception()`, `add_done_callback(fn)` and `get_future()`.
#[pyclass(frozen, module = "oxccl._oxccl", name = "Work")]
pub struct PyWork {
    shared: Arc<Shared>,
}

impl PyWork {
    /// The handle of `shared`.
    pub fn new(shared: Arc<Shared>) -> PyWork {
        PyWork { shared }
    }
}

#[pymethods]
impl PyWork {
    /// Waits for the call (releasing the GIL) and returns its output object (the buffer the
    /// result is in, or None); raises the call's error. `timeout` (seconds): give up after it
    /// with `oxccl.Timeout`, leaving the call running (wait again); default: the call's own
    /// timeout plus 30 s (the call itself fails within its own).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let s = &self.shared;
        let limit = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Duration::from_secs_f64(t.min(1e9)),
            Some(t) => return Err(errors::value_error(format!("timeout={t}: not a duration"))),
            None => s.timeout + Duration::from_secs(30),
        };
        let finished = py.detach(|| {
            let end = Instant::now() + limit;
            let mut st = s.lock();
            while st.result.is_none() {
                let now = Instant::now();
                if now >= end {
                    return false;
                }
                st = s
                    .done
                    .wait_timeout(st, end - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            true
        });
        if !finished {
            return Err(errors::make(
                py,
                errors::Kind::Timeout,
                format!(
                    "rank {}: {} did not finish within {limit:.3?} (it is still running: wait \
                     again, or abort the communicator)",
                    s.rank, s.what
                ),
                Some(s.rank),
                None,
            ));
        }
        finish(py, s);
        let st = s.lock();
        match &st.result {
            Some(Ok(())) => Ok(st.output.as_ref().map(|o| o.clone_ref(py))),
            Some(Err(e)) => Err(errors::to_py(py, e)),
            None => unreachable!("checked above"),
        }
    }

    /// Whether the call has ended (successfully or not); does not block.
    fn is_completed(&self, py: Python<'_>) -> bool {
        let done = self.shared.lock().result.is_some();
        if done {
            finish(py, &self.shared);
        }
        done
    }

    /// Whether the call ended successfully (False while it runs).
    fn is_success(&self) -> bool {
        matches!(self.shared.lock().result, Some(Ok(())))
    }

    /// The call's error as an exception object, or None (while it runs, or if it succeeded).
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &self.shared.lock().result {
            Some(Err(e)) => Some(errors::to_py(py, e).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Calls `fn(work)` when the call ends (at once if it has), on oxccl's completion
    /// thread; exceptions it raises are reported as unraisable.
    fn add_done_callback(slf: Bound<'_, Self>, f: Py<PyAny>) {
        let py = slf.py();
        let me = slf.clone().unbind();
        add(py, &slf.get().shared, Callback::Call(f, me));
    }

    /// A `concurrent.futures.Future` that completes with the output object (or the error)
    /// when the call ends.
    fn get_future(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let fut = py
            .import("concurrent.futures")?
            .getattr("Future")?
            .call0()?;
        fut.call_method0("set_running_or_notify_cancel")?;
        add(
            py,
            &self.shared,
            Callback::Future(fut.clone().unbind(), None),
        );
        Ok(fut.unbind())
    }

    /// Completes `future` (anything with `set_result` and `set_exception`, such as a
    /// `torch.futures.Future`) with `value` (default: the output object) or the error, when
    /// the call ends.
    #[pyo3(signature = (future, value=None))]
    fn _complete_future(&self, py: Python<'_>, future: Py<PyAny>, value: Option<Py<PyAny>>) {
        add(py, &self.shared, Callback::Future(future, value));
    }

    fn __repr__(&self) -> String {
        let st = self.shared.lock();
        let state = match &st.result {
            None => "running".to_string(),
            Some(Ok(())) => "done".to_string(),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!(
            "<oxccl.Work rank {}: {}, {state}>",
            self.shared.rank, self.shared.what
        )
    }
}

fn add(py: Python<'_>, s: &Arc<Shared>, cb: Callback) {
    let done = {
        let mut st = s.lock();
        st.callbacks.push(cb);
        st.result.is_some()
    };
    if done {
        finish(py, s);
    }
}
