//! `oxccl.Registration`: a buffer registered with a communicator.

use pyo3::prelude::*;

use crate::buffer::View;

/// `oxccl.Registration`: a buffer registered with a communicator
/// (`Communicator.register`), until closed.
#[pyclass(frozen, module = "oxccl._oxccl", name = "Registration")]
pub struct PyRegistration {
    /// The registration, then the view that keeps the buffer alive (dropped after it).
    pub(crate) reg: std::sync::Mutex<Option<(oxccl::Registration, View)>>,
}

#[pymethods]
impl PyRegistration {
    /// The registered memory's first address.
    #[getter]
    fn addr(&self) -> Option<usize> {
        self.lock().as_ref().map(|(r, _)| r.addr())
    }

    /// Bytes registered (0 once closed).
    #[getter]
    fn nbytes(&self) -> usize {
        self.lock().as_ref().map_or(0, |(r, _)| r.len())
    }

    /// Deregisters the buffer (no peer writes it afterwards) and lets it go; again is a no-op.
    fn close(&self) {
        let taken = self.lock().take();
        drop(taken);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        match self.lock().as_ref() {
            Some((r, _)) => format!("Registration({} bytes at {:#x})", r.len(), r.addr()),
            None => "Registration(closed)".into(),
        }
    }
}

impl PyRegistration {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(oxccl::Registration, View)>> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }
}
