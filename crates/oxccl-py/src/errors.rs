//! [`oxccl::Error`] as Python exceptions: the classes live in `oxccl.errors` (a Python module,
//! so that they can derive from two bases, e.g. `Timeout(Error, TimeoutError)`); each raised
//! exception carries the Rust message and the attributes `rank`, `peer` and `kind`.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// Which class of `oxccl.errors` an error maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `oxccl.Error`: anything without a more precise class.
    Error,
    /// `oxccl.Timeout` (also a `TimeoutError`).
    Timeout,
    /// `oxccl.PeerFailed`: a peer died or its connection failed.
    PeerFailed,
    /// `oxccl.Mismatch`: ranks called different collectives or sizes.
    Mismatch,
    /// `oxccl.Aborted`: `abort()` here or on a peer.
    Aborted,
    /// `oxccl.ConfigError` (also a `ValueError`): a bad setting or launcher environment.
    ConfigError,
    /// `oxccl.InvalidArgument` (also a `ValueError`): a bad argument to a call.
    InvalidArgument,
}

impl Kind {
    /// The class name in `oxccl.errors`.
    pub fn class_name(self) -> &'static str {
        match self {
            Kind::Error => "Error",
            Kind::Timeout => "Timeout",
            Kind::PeerFailed => "PeerFailed",
            Kind::Mismatch => "Mismatch",
            Kind::Aborted => "Aborted",
            Kind::ConfigError => "ConfigError",
            Kind::InvalidArgument => "InvalidArgument",
        }
    }
}

/// The class, rank and peer of a bootstrap error.
fn bootstrap_kind(e: &oxccl_bootstrap::Error) -> Kind {
    use oxccl_bootstrap::Error as B;
    if e.is_timeout() {
        return Kind::Timeout;
    }
    match e {
        B::StoreGone { .. } | B::Connect { .. } => Kind::PeerFailed,
        B::Aborted { .. } => Kind::Aborted,
        B::InvalidArgument(_) => Kind::InvalidArgument,
        B::BadAddr { .. }
        | B::NoLauncher { .. }
        | B::BadEnv { .. }
        | B::Config(_)
        | B::Secret(_)
        | B::RankOutOfRange { .. }
        | B::WorldSizeMismatch { .. }
        | B::DuplicateRank { .. }
        | B::AddrInUse { .. }
        | B::AuthRefused { .. }
        | B::StoreNotAuthentic { .. } => Kind::ConfigError,
        _ => Kind::Error,
    }
}

/// The class, rank and peer of an oxccl error.
pub fn classify(e: &oxccl::Error) -> (Kind, Option<usize>, Option<usize>) {
    use oxccl::Error as E;
    match e {
        E::InvalidArgument { rank, .. } => (Kind::InvalidArgument, Some(*rank), None),
        E::Config(_) => (Kind::ConfigError, None, None),
        E::Bootstrap(b) => (bootstrap_kind(b), None, None),
        E::Verbs { rank, .. } => (Kind::Error, Some(*rank), None),
        E::Timeout { rank, peer, .. } => (Kind::Timeout, Some(*rank), *peer),
        E::PeerFailed { rank, peer, .. } => (Kind::PeerFailed, Some(*rank), Some(*peer)),
        // The aggregation service is the peer that failed (it has no rank of the job's).
        E::AggregatorFailed { rank, .. } => (Kind::PeerFailed, Some(*rank), None),
        E::Mismatch { rank, .. } => (Kind::Mismatch, Some(*rank), None),
        E::Aborted { rank, .. } => (Kind::Aborted, Some(*rank), None),
        E::WaitTimeout { rank, .. } => (Kind::Timeout, Some(*rank), None),
        E::Poisoned { rank, .. } => (Kind::Error, Some(*rank), None),
        E::Shrink { rank, missing, .. } => (Kind::Error, Some(*rank), missing.first().copied()),
        E::Grow { missing, .. } => (Kind::Error, None, missing.first().copied()),
        _ => (Kind::Error, None, None),
    }
}

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The exception class of `kind`, from `oxccl.errors` (RuntimeError if the module is missing,
/// which only happens when the extension is imported outside its package).
pub fn class(py: Python<'_>, kind: Kind) -> Bound<'_, PyType> {
    let module = ERRORS.get_or_try_init(py, || py.import("oxccl.errors").map(|m| m.unbind()));
    module
        .ok()
        .and_then(|m| m.bind(py).getattr(kind.class_name()).ok())
        .and_then(|c| c.cast_into::<PyType>().ok())
        .unwrap_or_else(|| py.get_type::<PyRuntimeError>())
}

/// An exception of `kind` with `message`, `rank` and `peer` attributes.
pub fn make(
    py: Python<'_>,
    kind: Kind,
    message: String,
    rank: Option<usize>,
    peer: Option<usize>,
) -> PyErr {
    let cls = class(py, kind);
    match cls.call1((message.clone(),)) {
        Ok(exc) => {
            let _ = exc.setattr("rank", rank);
            let _ = exc.setattr("peer", peer);
            let _ = exc.setattr("kind", kind.class_name());
            PyErr::from_value(exc)
        }
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// The Python exception for an oxccl error.
pub fn to_py(py: Python<'_>, e: &oxccl::Error) -> PyErr {
    let (kind, rank, peer) = classify(e);
    make(py, kind, e.to_string(), rank, peer)
}

/// `oxccl.InvalidArgument` for a bad argument found before the call reached Rust's API.
pub fn invalid(py: Python<'_>, rank: Option<usize>, message: String) -> PyErr {
    make(py, Kind::InvalidArgument, message, rank, None)
}

/// A `TypeError` (wrong kind of object) with `message`.
pub fn type_error(message: String) -> PyErr {
    PyTypeError::new_err(message)
}

/// A `ValueError` with `message`.
pub fn value_error(message: String) -> PyErr {
    PyValueError::new_err(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_the_classes_the_docs_promise() {
        let peer = oxccl::Error::PeerFailed {
            rank: 1,
            op: "all_reduce #3".into(),
            peer: 2,
            detail: "its process exited".into(),
        };
        assert_eq!(classify(&peer), (Kind::PeerFailed, Some(1), Some(2)));
        let mm = oxccl::Error::Mismatch {
            rank: 0,
            detail: "rank 0 all_reduce count 4, rank 1 count 5".into(),
        };
        assert_eq!(classify(&mm).0, Kind::Mismatch);
        let cfg = oxccl::Error::Config("OXCCL_ALGO=\"x\"".into());
        assert_eq!(classify(&cfg).0, Kind::ConfigError);
        let boot = oxccl::Error::Bootstrap(oxccl_bootstrap::Error::RanksMissing {
            what: "join".into(),
            missing: vec![3],
            world_size: 4,
            timeout: std::time::Duration::from_secs(1),
        });
        assert_eq!(classify(&boot).0, Kind::Timeout);
        let gone = oxccl::Error::Bootstrap(oxccl_bootstrap::Error::StoreGone {
            addr: "h:1".into(),
            reason: "eof".into(),
        });
        assert_eq!(classify(&gone).0, Kind::PeerFailed);
        let wt = oxccl::Error::WaitTimeout {
            rank: 3,
            timeout: std::time::Duration::from_millis(5),
        };
        assert_eq!(classify(&wt), (Kind::Timeout, Some(3), None));
        let ab = oxccl::Error::Aborted {
            rank: 0,
            op: "barrier".into(),
            reason: "abort".into(),
        };
        assert_eq!(classify(&ab).0, Kind::Aborted);
    }
}
