//! `oxccl.PendingInit`: a communicator's init running on a thread of its own
//! (`Communicator.init_async`), which another thread may abort: an init waiting for a rank
//! that never comes stops at once, naming what it waited for.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use oxccl::{AbortHandle, Communicator};
use oxccl_bootstrap::Bootstrap;
use pyo3::prelude::*;

use crate::comm::PyCommunicator;
use crate::errors::{self, Kind};
use crate::store::PyStore;

/// What the init thread leaves: its result, until `wait` takes it.
type Slot = Arc<(Mutex<Option<oxccl::Result<Communicator>>>, Condvar)>;

/// `oxccl.PendingInit`: see `Communicator.init_async`.
#[pyclass(frozen, module = "oxccl._oxccl", name = "PendingInit")]
pub struct PyPendingInit {
    abort: AbortHandle,
    slot: Slot,
    rank: usize,
    /// Whether `wait` has returned the communicator (or its error) already.
    taken: Mutex<bool>,
}

impl PyPendingInit {
    /// Starts the init of rank `rank` of `world` over `store` on a thread of its own.
    pub(crate) fn start(
        store: PyStore,
        rank: usize,
        world: usize,
        job: String,
        options: HashMap<String, String>,
        timeout: Option<Duration>,
    ) -> PyResult<PyPendingInit> {
        let abort = AbortHandle::new();
        let slot: Slot = Arc::new((Mutex::new(None), Condvar::new()));
        let (a, s) = (abort.clone(), slot.clone());
        std::thread::Builder::new()
            .name(format!("oxccl-init-{rank}"))
            .spawn(move || {
                let r = (|| -> oxccl::Result<Communicator> {
                    let opts = crate::calls::options_with(&options, timeout)?;
                    let boot = Bootstrap::with_store_abortable(
                        rank,
                        world,
                        Box::new(store),
                        &job,
                        opts.timeout,
                        &a,
                    )
                    .map_err(|e| match e {
                        oxccl_bootstrap::Error::Aborted {
                            reason, waiting, ..
                        } => oxccl::Error::Aborted {
                            rank,
                            op: "init".into(),
                            reason: format!("{reason}, while waiting {waiting}"),
                        },
                        e => e.into(),
                    })?;
                    Communicator::init_abortable(boot, opts, &a)
                })();
                *s.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                s.1.notify_all();
            })
            .map_err(|e| {
                pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "rank {rank}: cannot start the init thread: {e}"
                ))
            })?;
        Ok(PyPendingInit {
            abort,
            slot,
            rank,
            taken: Mutex::new(false),
        })
    }
}

#[pymethods]
impl PyPendingInit {
    /// Stops the init (nothing once it has finished): its waits end at once and `wait` raises
    /// `oxccl.Aborted`, saying what it was waiting for (`reason` is part of the message). The
    /// other ranks of the init fail naming this one. Any thread may call it.
    #[pyo3(signature = (reason=None))]
    fn abort(&self, reason: Option<String>) {
        self.abort.abort_with(
            reason
                .as_deref()
                .unwrap_or("PendingInit.abort() was called"),
        );
    }

    /// Whether the init has finished (`wait` then returns at once).
    fn done(&self) -> bool {
        self.slot
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
            || *self.taken.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits (up to `timeout` seconds; without one, until the init ends, which its own
    /// timeout bounds) and returns the communicator, or raises the init's error
    /// (`oxccl.Aborted` after `abort`, `oxccl.Timeout` naming the ranks that never came...).
    /// Raises `oxccl.Timeout` if `timeout` passes first (the init goes on; wait again, or
    /// abort it). The GIL is released meanwhile.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyCommunicator> {
        let limit = crate::calls::parse_timeout(timeout)?;
        if *self.taken.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(errors::invalid(
                py,
                Some(self.rank),
                "this init's communicator was already taken by an earlier wait()".into(),
            ));
        }
        let slot = self.slot.clone();
        let got = py.detach(move || {
            let deadline = limit.map(|t| Instant::now() + t);
            let mut g = slot.0.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(r) = g.take() {
                    return Some(r);
                }
                let left = match deadline {
                    Some(d) => match d.checked_duration_since(Instant::now()) {
                        Some(l) if !l.is_zero() => l,
                        _ => return None,
                    },
                    None => Duration::from_secs(3600),
                };
                g = slot
                    .1
                    .wait_timeout(g, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        });
        let Some(r) = got else {
            return Err(errors::make(
                py,
                Kind::Timeout,
                format!(
                    "rank {}: the init did not finish within {:?} (it goes on: wait again, or \
                     abort it)",
                    self.rank,
                    limit.unwrap_or_default()
                ),
                Some(self.rank),
                None,
            ));
        };
        *self.taken.lock().unwrap_or_else(|e| e.into_inner()) = true;
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "PendingInit(rank={}, done={}, aborted={})",
            self.rank,
            self.done(),
            self.abort.is_aborted()
        )
    }
}

impl Drop for PyPendingInit {
    /// An init nobody will wait for is stopped (its communicator, if it came, is dropped by
    /// its thread's slot).
    fn drop(&mut self) {
        if !self.done() {
            self.abort.abort_with("its PendingInit was dropped");
        }
    }
}
