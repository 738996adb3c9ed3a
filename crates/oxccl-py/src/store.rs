//! [`PyStore`]: the [`Store`] trait of `oxccl-bootstrap` over a rendezvous store handed in
//! from Python: torch's `TCPStore`, `FileStore`, `HashStore`, `PrefixStore` (what
//! `torch.distributed` hands a backend, whatever the `init_method`), or any object with their
//! methods (`set`, `get`, `add`, `wait`, `check`, `compare_set`, `delete_key`).
//!
//! Each operation takes the GIL for its own duration only; torch's store methods release it
//! again while they block.

use std::time::Duration;

use oxccl_bootstrap::{CasOutcome, Error, Result, Store};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Waits shorter than this poll with `check` instead of calling the store's `wait`.
const SHORT_WAIT: Duration = Duration::from_millis(500);

/// A Python rendezvous store as an oxccl [`Store`].
pub struct PyStore {
    store: Py<PyAny>,
    location: String,
    /// `host:port` of the TCP store at the bottom of it (a `TCPStore`, under any
    /// `PrefixStore`s), when it has one.
    endpoint: Option<String>,
}

impl PyStore {
    /// Wraps `store`; its description (type, and host:port when it has them) names it in
    /// errors.
    pub fn new(store: &Bound<'_, PyAny>) -> PyResult<PyStore> {
        for m in ["set", "get", "add", "wait", "check", "compare_set"] {
            if !store.hasattr(m)? {
                return Err(crate::errors::type_error(format!(
                    "the store (a {}) has no method {m}(): pass a torch.distributed Store \
                     (TCPStore, FileStore, HashStore, PrefixStore) or an object with its methods",
                    store.get_type().name()?
                )));
            }
        }
        Ok(PyStore {
            location: describe(store),
            endpoint: endpoint(store),
            store: store.clone().unbind(),
        })
    }

    fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
    ) -> std::result::Result<T, (String, String)> {
        Python::attach(|py| {
            f(self.store.bind(py)).map_err(|e| {
                let class = e
                    .get_type(py)
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "Exception".into());
                (class, format!("{what}: {e}"))
            })
        })
    }

    fn error(&self, class: &str, message: String) -> Error {
        if class.contains("Network") || class.contains("Connection") || class.contains("Broken") {
            Error::StoreGone {
                addr: self.location.clone(),
                reason: message,
            }
        } else {
            Error::Rejected {
                addr: self.location.clone(),
                message,
            }
        }
    }

    /// The keys of `keys` not in the store now.
    fn missing(&self, keys: &[&str]) -> Vec<String> {
        keys.iter()
            .filter(|k| !matches!(self.check(&[k]), Ok(true)))
            .map(|k| k.to_string())
            .collect()
    }

    fn timeout_error(&self, keys: &[&str], timeout: Duration) -> Error {
        Error::Timeout {
            addr: self.location.clone(),
            timeout,
            missing: self.missing(keys),
        }
    }
}

/// `host:port` of a store with `host` and `port` attributes (torch's `TCPStore`), looking
/// through `underlying_store` (`PrefixStore`).
fn endpoint(store: &Bound<'_, PyAny>) -> Option<String> {
    if let (Ok(h), Ok(p)) = (store.getattr("host"), store.getattr("port"))
        && let (Ok(h), Ok(p)) = (h.extract::<String>(), p.extract::<u16>())
    {
        return Some(if h.contains(':') && !h.starts_with('[') {
            format!("[{h}]:{p}")
        } else {
            format!("{h}:{p}")
        });
    }
    endpoint(&store.getattr("underlying_store").ok()?)
}

/// "torch TCPStore at host:port", "torch PrefixStore 'default_pg/' over ...", "MyStore".
fn describe(store: &Bound<'_, PyAny>) -> String {
    let name = store
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "store".into());
    let mut s = format!("Python {name}");
    if let (Ok(h), Ok(p)) = (store.getattr("host"), store.getattr("port")) {
        s += &format!(" at {h}:{p}");
    }
    if let Ok(under) = store.getattr("underlying_store") {
        s += &format!(" over {}", describe(&under));
    }
    s
}

fn timedelta<'py>(py: Python<'py>, t: Duration) -> PyResult<Bound<'py, PyAny>> {
    // torch reads a zero timeout as "no timeout": never pass one.
    let secs = t.as_secs_f64().max(0.001);
    py.import("datetime")?.getattr("timedelta")?.call1((
        0,
        secs.trunc(),
        0,
        (secs.fract() * 1e3).round(),
    ))
}

fn is_timeout(class: &str, message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    class.contains("Timeout") || m.contains("timeout") || m.contains("timed out")
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(&format!("set({key:?})"), |s| {
            s.call_method1("set", (key, PyBytes::new(s.py(), value)))
                .map(drop)
        })
        .map_err(|(c, m)| self.error(&c, m))
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout)?;
        self.call("get", |s| {
            keys.iter()
                .map(|k| s.call_method1("get", (*k,))?.extract::<Vec<u8>>())
                .collect::<PyResult<Vec<_>>>()
        })
        .map_err(|(c, m)| self.error(&c, m))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        if timeout.is_zero() {
            return if self.check(keys)? {
                Ok(())
            } else {
                Err(self.timeout_error(keys, timeout))
            };
        }
        if timeout < SHORT_WAIT {
            // Short waits (an abortable init's slices): polled with `check`, since torch's
            // TCPStore logs a warning for every wait that times out.
            let start = std::time::Instant::now();
            loop {
                if self.check(keys)? {
                    return Ok(());
                }
                let left = timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(self.timeout_error(keys, timeout));
                }
                std::thread::sleep(left.min(Duration::from_millis(2)));
            }
        }
        let r = self.call(&format!("wait({keys:?})"), |s| {
            let list = PyList::new(s.py(), keys)?;
            s.call_method1("wait", (list, timedelta(s.py(), timeout)?))
                .map(drop)
        });
        match r {
            Ok(()) => Ok(()),
            Err((c, m)) if is_timeout(&c, &m) => Err(self.timeout_error(keys, timeout)),
            Err((c, m)) => Err(self.error(&c, m)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(&format!("add({key:?}, {delta})"), |s| {
            s.call_method1("add", (key, delta))?.extract::<i64>()
        })
        .map_err(|(c, m)| self.error(&c, m))
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        // torch's compare_set: with an empty `expected` it sets a missing key; otherwise it sets
        // the key when its value equals `expected`. It answers the value now stored, except
        // for a missing key with a non-empty `expected`, where it answers `expected` itself.
        let exp = expected.unwrap_or(&[]);
        let now: Vec<u8> = self
            .call(&format!("compare_set({key:?})"), |s| {
                let py = s.py();
                s.call_method1(
                    "compare_set",
                    (key, PyBytes::new(py, exp), PyBytes::new(py, desired)),
                )?
                .extract::<Vec<u8>>()
            })
            .map_err(|(c, m)| self.error(&c, m))?;
        Ok(if now == desired {
            // (When the key already held `desired`, nothing changed either way.)
            CasOutcome {
                swapped: true,
                current: Some(now),
            }
        } else if expected.is_some() && now == exp {
            CasOutcome {
                swapped: false,
                current: None,
            }
        } else {
            CasOutcome {
                swapped: false,
                current: Some(now),
            }
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.call(&format!("delete_key({key:?})"), |s| {
            s.call_method1("delete_key", (key,))?.extract::<bool>()
        })
        .map_err(|(c, m)| self.error(&c, m))
    }

    fn location(&self) -> String {
        self.location.clone()
    }

    /// The source address this host uses towards a TCP store (the connection itself is
    /// torch's): what the communicator advertises to peers on other hosts by default.
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        let ip = oxccl_bootstrap::route_to(self.endpoint.as_deref()?)?;
        Some(std::net::SocketAddr::new(ip, 0))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.call("check", |s| {
            let list = PyList::new(s.py(), keys)?;
            s.call_method1("check", (list,))?.extract::<bool>()
        })
        .map_err(|(c, m)| self.error(&c, m))
    }
}

/// `store` as the ranks use it: its values sealed with the job's key unless
/// `OXCCL_ENCRYPT=off` ([`oxccl_bootstrap::SealedValues::per_policy`]: the secret is
/// `OXCCL_SECRET` or `OXCCL_SECRET_FILE`; without one, `auto` leaves them in clear with a
/// warning), since whoever reaches a store handed in from Python reads what is set in it.
pub fn foreign(store: PyStore) -> Result<Box<dyn Store>> {
    oxccl_bootstrap::SealedValues::per_policy(Box::new(store), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_recognised_by_class_or_message() {
        assert!(is_timeout(
            "DistStoreError",
            "wait timeout after 30000ms, keys: /a"
        ));
        assert!(is_timeout("TimeoutError", "x"));
        assert!(!is_timeout("DistNetworkError", "Connection reset by peer"));
    }
}
