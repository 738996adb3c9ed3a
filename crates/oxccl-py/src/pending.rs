//! `oxccl.PendingInit`: a communicator's init running on a thread of its own
//! (`Communicator.init_async`, over [`Communicator::init_store_async`]), which another thread
//! may abort: an init waiting for a rank that never comes stops at once, naming what it
//! waited for.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use oxccl::{AbortHandle, Communicator, PendingInit};
use pyo3::prelude::*;

use crate::comm::PyCommunicator;
use crate::errors::{self, Kind};

/// `oxccl.PendingInit`: see `Communicator.init_async`.
#[pyclass(frozen, module = "oxccl._oxccl", name = "PendingInit")]
pub struct PyPendingInit {
    abort: AbortHandle,
    rank: usize,
    /// The init, until `wait` takes its result.
    init: Mutex<Option<PendingInit>>,
}

impl PyPendingInit {
    /// Starts the init of rank `rank` of `world` over `store` on a thread of its own.
    pub(crate) fn start(
        store: Box<dyn oxccl_bootstrap::Store>,
        rank: usize,
        world: usize,
        job: &str,
        options: &HashMap<String, String>,
        timeout: Option<Duration>,
    ) -> PyResult<PyPendingInit> {
        let opts = crate::calls::options_with(options, timeout)
            .map_err(|e| Python::attach(|py| errors::to_py(py, &e)))?;
        let init = Communicator::init_store_async(rank, world, store, job, opts);
        Ok(PyPendingInit {
            abort: init.abort_handle(),
            rank,
            init: Mutex::new(Some(init)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<PendingInit>> {
        self.init.lock().unwrap_or_else(|e| e.into_inner())
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
        self.lock().as_ref().is_none_or(PendingInit::is_finished)
    }

    /// Waits (up to `timeout` seconds; without one, until the init ends, which its own
    /// timeout bounds) and returns the communicator, or raises the init's error
    /// (`oxccl.Aborted` after `abort`, `oxccl.Timeout` naming the ranks that never came...).
    /// Raises `oxccl.Timeout` if `timeout` passes first (the init goes on; wait again, or
    /// abort it). The GIL is released meanwhile.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyCommunicator> {
        let limit = crate::calls::parse_timeout(timeout)?;
        let Some(init) = self.lock().take() else {
            return Err(errors::invalid(
                py,
                Some(self.rank),
                "this init's communicator was already taken by an earlier wait()".into(),
            ));
        };
        // `Err(init)`: the time passed first; the init is put back.
        let r = py.detach(move || match limit {
            Some(t) if !init.wait_for(t) => Err(init),
            _ => Ok(init.wait()),
        });
        match r {
            Ok(r) => r
                .map(PyCommunicator::wrap)
                .map_err(|e| errors::to_py(py, &e)),
            Err(init) => {
                *self.lock() = Some(init);
                Err(errors::make(
                    py,
                    Kind::Timeout,
                    format!(
                        "rank {}: the init did not finish within {:?} (it goes on: wait again, \
                         or abort it)",
                        self.rank,
                        limit.unwrap_or_default()
                    ),
                    Some(self.rank),
                    None,
                ))
            }
        }
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
    /// An init nobody waits for is aborted, and its thread joined with the GIL released (the
    /// thread may need it to reach a store handed in from Python).
    fn drop(&mut self) {
        if let Some(init) = self.lock().take() {
            Python::attach(|py| py.detach(move || drop(init)));
        }
    }
}
