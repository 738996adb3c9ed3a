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
//! - the mapping of [`oxccl::Error`] to the exception classes of `oxccl.errors`;
//! - `_cli_main`: the `oxccl` command line (the crate `oxccl-cli`), behind the package's
//!   `oxccl` console script (`oxccl._cli`).
//!
//! The GIL is released while a call runs and while waiting; the rendezvous store's methods
//! take it back only for the duration of each store operation.
#![deny(missing_docs)]

pub mod buffer;
mod calls;
pub mod comm;
pub mod errors;
pub mod kv;
mod pending;
mod registration;
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

/// Test hook, not a stable API: converts between `f32` values and the 8-bit float `dtype`
/// (`f8e4m3` or `f8e5m2`, or an alias) exactly as the reductions do. `data` holds native-endian
/// `f32` values, rounded to the 8-bit codes; with `widen=True` it holds codes, widened to
/// `f32` bytes.
#[pyfunction]
#[pyo3(name = "_fp8_convert", signature = (data, dtype, widen = false))]
fn fp8_convert<'py>(
    py: Python<'py>,
    data: &[u8],
    dtype: &str,
    widen: bool,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use oxccl::{DataType, F8E4M3, F8E5M2};
    use pyo3::exceptions::PyValueError;
    let d: DataType = dtype
        .parse()
        .map_err(|e: oxccl::ParseNameError| PyValueError::new_err(e.to_string()))?;
    type Narrow = fn(f32) -> u8;
    type Widen = fn(u8) -> f32;
    let (narrow, wide): (Narrow, Widen) = match d {
        DataType::F8E4M3 => (
            |v| F8E4M3::from_f32(v).to_bits(),
            |b| F8E4M3::from_bits(b).to_f32(),
        ),
        DataType::F8E5M2 => (
            |v| F8E5M2::from_f32(v).to_bits(),
            |b| F8E5M2::from_bits(b).to_f32(),
        ),
        other => {
            return Err(PyValueError::new_err(format!(
                "_fp8_convert: {other} is not an 8-bit float (f8e4m3, f8e5m2)"
            )));
        }
    };
    let out: Vec<u8> = if widen {
        data.iter().flat_map(|&b| wide(b).to_ne_bytes()).collect()
    } else {
        if !data.len().is_multiple_of(4) {
            return Err(PyValueError::new_err(format!(
                "_fp8_convert: {} bytes are not a whole number of float32 values",
                data.len()
            )));
        }
        data.chunks_exact(4)
            .map(|c| narrow(f32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect()
    };
    Ok(pyo3::types::PyBytes::new(py, &out))
}

/// The canonical name of a `compress=` value (`"bfp8"`, `"bfp4/64"`, ...), or None for `None`,
/// `"off"` and `"none"`; a ValueError naming the allowed values otherwise.
#[pyfunction]
#[pyo3(signature = (name))]
fn compress_format(name: Option<&str>) -> PyResult<Option<String>> {
    Ok(calls::parse_compress(name)?.map(|f| f.to_string()))
}

/// `_cli_main(reexec, argv)`: runs the `oxccl` command line (the crate `oxccl-cli`) in this
/// process, with the GIL released, and returns its exit code; `argv` starts with the program
/// name. `reexec` is the command line that starts the CLI again (`[sys.executable, "-m",
/// "oxccl._cli"]`), for the subcommands that re-execute themselves (`perf`'s ranks,
/// `verbs-perf`'s server, `kv-bench`'s target): this process's executable is the interpreter.
/// Called once, by `oxccl._cli.main` (the package's `oxccl` console script).
#[pyfunction]
#[pyo3(name = "_cli_main")]
fn cli_main(py: Python<'_>, reexec: Vec<std::ffi::OsString>, argv: Vec<std::ffi::OsString>) -> u8 {
    oxccl_cli::set_reexec_command(reexec);
    py.detach(|| oxccl_cli::run_with_args(argv))
}

/// The module `oxccl._oxccl`.
#[pymodule]
fn _oxccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<comm::PyCommunicator>()?;
    m.add_class::<comm::PyRegistration>()?;
    m.add_class::<pending::PyPendingInit>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<PyReduceOp>()?;
    m.add_class::<kv::PyKvEngine>()?;
    m.add_class::<kv::PyKvMetadataServer>()?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(fp8_convert, m)?)?;
    m.add_function(wrap_pyfunction!(compress_format, m)?)?;
    m.add_function(wrap_pyfunction!(work::at_exit, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    // Completion callbacks must not start while the interpreter finalizes.
    let atexit = m.py().import("atexit")?;
    atexit.call_method1("register", (m.getattr("_at_exit")?,))?;
    Ok(())
}
