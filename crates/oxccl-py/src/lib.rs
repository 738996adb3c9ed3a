//! # oxccl-py: the Python bindings of oxccl
//!
//! The extension module `oxccl._oxccl` behind the Python package `oxccl` (sources under
//! `python/oxccl`, built by maturin). It exposes:
//!
//! - [`comm::PyCommunicator`] (`oxccl.Communicator`): joins a job from the launcher's
//!   environment or over any rendezvous store handed in from Python (torch's `TCPStore`,
//!   `FileStore`, `PrefixStore`, ...; see [`store::PyStore`]), and runs every collective of the
//!   Rust API on buffer-protocol objects (numpy arrays, `bytearray`, `memoryview`), CPU torch
//!   tensors and DLPack objects, zero-copy, in and out of place, blocking or asynchronously;
//! - [`work::PyWork`] (`oxccl.Work`): the handle of an asynchronous call, with `wait(timeout)`,
//!   `is_completed()`, futures and callbacks;
//! - [`kv::PyKvEngine`] (`oxccl._oxccl.KvEngine`, under `oxccl.kv.TransferEngine`, shaped like
//!   Mooncake's): the oxccl-kv transfer engine, and [`kv::PyKvMetadataServer`], an oxccl store
//!   for its segment descriptors;
//! - the mapping of [`oxccl::Error`] to the exception classes of `oxccl.errors`.
//!
//! The GIL is released while a call runs and while waiting; the rendezvous store's methods
//! take it back only for the duration of each store operation.
#![deny(missing_docs)]

pub mod buffer;
pub mod comm;
pub mod errors;
pub mod kv;
pub mod store;
pub mod work;

use pyo3::prelude::*;

/// `ReduceOp`: the reduction operators, also accepted as strings (`"sum"`, `"prod"`, `"min"`,
/// `"max"`, `"avg"`).
#[pyclass(
    eq,
    eq_int,
    frozen,
    from_py_object,
    module = "oxccl._oxccl",
    name = "ReduceOp"
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PyReduceOp {
    /// Sum.
    SUM,
    /// Product.
    PRODUCT,
    /// Minimum.
    MIN,
    /// Maximum.
    MAX,
    /// Average (the sum divided by the number of ranks).
    AVG,
}

impl From<PyReduceOp> for oxccl::ReduceOp {
    fn from(op: PyReduceOp) -> oxccl::ReduceOp {
        match op {
            PyReduceOp::SUM => oxccl::ReduceOp::Sum,
            PyReduceOp::PRODUCT => oxccl::ReduceOp::Prod,
            PyReduceOp::MIN => oxccl::ReduceOp::Min,
            PyReduceOp::MAX => oxccl::ReduceOp::Max,
            PyReduceOp::AVG => oxccl::ReduceOp::Avg,
        }
    }
}

/// The data type names oxccl accepts for the `dtype=` override, in nccl-tests spelling.
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    oxccl::DataType::ALL.iter().map(|d| d.name()).collect()
}

/// The module `oxccl._oxccl`.
#[pymodule]
fn _oxccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<comm::PyCommunicator>()?;
    m.add_class::<comm::PyRegistration>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<PyReduceOp>()?;
    m.add_class::<kv::PyKvEngine>()?;
    m.add_class::<kv::PyKvMetadataServer>()?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(work::at_exit, m)?)?;
    // Completion callbacks must not start while the interpreter finalizes.
    let atexit = m.py().import("atexit")?;
    atexit.call_method1("register", (m.getattr("_at_exit")?,))?;
    Ok(())
}
