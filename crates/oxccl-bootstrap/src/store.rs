//! The key-value store interface and its in-memory implementation.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::wire::{MAX_KEY_LEN, MAX_KEYS, MAX_VALUE_LEN};

/// The outcome of [`Store::compare_set`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the value was replaced by the desired one.
    pub swapped: bool,
    /// The value after the operation: the desired one when swapped, otherwise the value that
    /// did not match (`None`: the key does not exist).
    pub current: Option<Vec<u8>>,
}

/// A rendezvous key-value store, shaped like torch's `TCPStore` and Gloo's stores.
///
/// Keys are UTF-8 strings of at most [`MAX_KEY_LEN`](crate::wire::MAX_KEY_LEN) bytes; values
/// are bytes, at most [`MAX_VALUE_LEN`](crate::wire::MAX_VALUE_LEN). Every call that can block
/// takes a timeout; the others answer promptly or fail (a store that stops answering is an
/// error, never a hang).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any value, and wakes those waiting for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits up to `timeout` until every key exists, then returns their values in order.
    /// On timeout the error lists the keys still missing.
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Waits up to `timeout` until every key exists. On timeout the error lists the keys
    /// still missing.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Adds `delta` to the integer stored at `key` (decimal text; a missing key counts as 0)
    /// and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Sets `key` to `desired` if its current value is `expected` (`None`: if the key does
    /// not exist). Atomic.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8])
    -> Result<CasOutcome>;

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Where the store is, for messages (an address, or "in-process store").
    fn location(&self) -> String;

    /// The local address of this process's connection to the store, when it has one: the
    /// address of the interface that routes to the store, which peers can most likely reach.
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }

    /// Waits up to `timeout` for `key`, then returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut v = self.multi_get(&[key], timeout)?;
        v.pop().ok_or_else(|| Error::Protocol {
            addr: self.location(),
            reason: "an empty reply to a get".into(),
        })
    }

    /// Whether every key exists now (no waiting).
    fn check(&self, keys: &[&str]) -> Result<bool> {
        match self.wait(keys, Duration::ZERO) {
            Ok(()) => Ok(true),
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Checks a request's arguments against the wire format's caps.
pub(crate) fn check_args<'a>(
    keys: impl IntoIterator<Item = &'a str>,
    value: Option<&[u8]>,
) -> Result<()> {
    let mut n = 0;
    for k in keys {
        n += 1;
        if k.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "key of {} bytes exceeds the limit of {MAX_KEY_LEN}",
                k.len()
            )));
        }
    }
    if n > MAX_KEYS {
        return Err(Error::InvalidArgument(format!(
            "{n} keys in one request exceed the limit of {MAX_KEYS}"
        )));
    }
    if let Some(v) = value.filter(|v| v.len() > MAX_VALUE_LEN) {
        return Err(Error::InvalidArgument(format!(
            "value of {} bytes exceeds the limit of {MAX_VALUE_LEN}",
            v.len()
        )));
    }
    Ok(())
}

/// Why a wait ended without the keys.
#[derive(Debug)]
pub(crate) enum WaitFail {
    /// The timeout passed; these keys are missing.
    Missing(Vec<String>),
    /// The store shut down.
    Closed,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// An in-process store: a map behind a mutex, with waiters on a condition variable.
///
/// The [`StoreServer`](crate::StoreServer) serves one over TCP; rank 0 uses it directly.
/// Clones share the same map.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
    /// What errors call this store (the served address, on the rank that serves it).
    location: Option<Arc<str>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.lock().map.len())
            .finish()
    }
}

fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    // Far enough for any real wait, and never an overflow.
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
            location: None,
        }
    }

    /// The same store, named `location` in errors (e.g. the address it is served on).
    pub fn with_location(&self, location: &str) -> MemoryStore {
        MemoryStore {
            shared: self.shared.clone(),
            location: Some(location.into()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated (each operation is
        // one map call), so a poisoned lock is still usable.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Closes the store: waiters wake and fail, later blocking calls fail at once.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.shared.changed.notify_all();
    }

    pub(crate) fn set_raw(&self, key: &str, value: &[u8]) {
        self.lock().map.insert(key.to_owned(), value.to_vec());
        self.shared.changed.notify_all();
    }

    /// Waits until all keys exist; returns their values when `values` is set.
    pub(crate) fn wait_raw<K: AsRef<str>>(
        &self,
        keys: &[K],
        timeout: Duration,
        values: bool,
    ) -> std::result::Result<Vec<Vec<u8>>, WaitFail> {
        let deadline = deadline_after(timeout);
        let mut st = self.lock();
        loop {
            if st.closed {
                return Err(WaitFail::Closed);
            }
            if keys.iter().all(|k| st.map.contains_key(k.as_ref())) {
                return Ok(if values {
                    keys.iter().map(|k| st.map[k.as_ref()].clone()).collect()
                } else {
                    Vec::new()
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = keys
                    .iter()
                    .filter(|k| !st.map.contains_key(k.as_ref()))
                    .map(|k| k.as_ref().to_owned())
                    .collect();
                return Err(WaitFail::Missing(missing));
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }
    }

    pub(crate) fn add_raw(&self, key: &str, delta: i64) -> std::result::Result<i64, String> {
        let mut st = self.lock();
        let old = match st.map.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| format!("add: the value of {key:?} is not an integer"))?,
        };
        let new = old
            .checked_add(delta)
            .ok_or_else(|| format!("add: {old} + {delta} overflows at {key:?}"))?;
        st.map.insert(key.to_owned(), new.to_string().into_bytes());
        drop(st);
        self.shared.changed.notify_all();
        Ok(new)
    }

    pub(crate) fn compare_set_raw(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> CasOutcome {
        let mut st = self.lock();
        let current = st.map.get(key).map(Vec::as_slice);
        if current == expected {
            st.map.insert(key.to_owned(), desired.to_vec());
            drop(st);
            self.shared.changed.notify_all();
            CasOutcome {
                swapped: true,
                current: Some(desired.to_vec()),
            }
        } else {
            CasOutcome {
                swapped: false,
                current: current.map(<[u8]>::to_vec),
            }
        }
    }

    pub(crate) fn delete_raw(&self, key: &str) -> bool {
        self.lock().map.remove(key).is_some()
    }

    /// Number of keys stored.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn wait_result(&self, keys: &[&str], timeout: Duration, values: bool) -> Result<Vec<Vec<u8>>> {
        check_args(keys.iter().copied(), None)?;
        self.wait_raw(keys, timeout, values).map_err(|f| match f {
            WaitFail::Missing(missing) => Error::Timeout {
                addr: self.location(),
                timeout,
                missing,
            },
            WaitFail::Closed => Error::StoreGone {
                addr: self.location(),
                reason: "the store was shut down".into(),
            },
        })
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_args([key], Some(value))?;
        self.set_raw(key, value);
        Ok(())
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait_result(keys, timeout, true)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_result(keys, timeout, false).map(drop)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_args([key], None)?;
        self.add_raw(key, delta).map_err(|message| Error::Rejected {
            addr: self.location(),
            message,
        })
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        check_args([key], Some(desired))?;
        check_args([], expected)?;
        Ok(self.compare_set_raw(key, expected, desired))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_args([key], None)?;
        Ok(self.delete_raw(key))
    }

    fn location(&self) -> String {
        match &self.location {
            Some(l) => l.to_string(),
            None => "in-process store".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn basic_operations() {
        let s = MemoryStore::new();
        assert!(s.is_empty());
        s.set("a", b"1").unwrap();
        assert_eq!(s.get("a", T).unwrap(), b"1");
        assert_eq!(s.multi_get(&["a", "a"], T).unwrap(), vec![b"1", b"1"]);
        assert!(s.check(&["a"]).unwrap());
        assert!(!s.check(&["a", "b"]).unwrap());
        assert_eq!(s.add("n", 5).unwrap(), 5);
        assert_eq!(s.add("n", -7).unwrap(), -2);
        assert_eq!(s.get("n", T).unwrap(), b"-2");
        let e = s.add("a", 1).and_then(|_| s.add("x", 0)).map(drop);
        assert!(e.is_ok());
        s.set("text", b"hello").unwrap();
        assert!(matches!(s.add("text", 1), Err(Error::Rejected { .. })));
        s.set("max", i64::MAX.to_string().as_bytes()).unwrap();
        assert!(matches!(s.add("max", 1), Err(Error::Rejected { .. })));
        assert!(s.delete("a").unwrap());
        assert!(!s.delete("a").unwrap());
        assert!(matches!(
            s.set(&"k".repeat(MAX_KEY_LEN + 1), b""),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn compare_set_semantics() {
        let s = MemoryStore::new();
        let o = s.compare_set("k", None, b"first").unwrap();
        assert_eq!(
            o,
            CasOutcome {
                swapped: true,
                current: Some(b"first".to_vec())
            }
        );
        let o = s.compare_set("k", None, b"second").unwrap();
        assert_eq!(
            o,
            CasOutcome {
                swapped: false,
                current: Some(b"first".to_vec())
            }
        );
        let o = s.compare_set("k", Some(b"first"), b"third").unwrap();
        assert!(o.swapped);
        let o = s.compare_set("missing", Some(b"x"), b"y").unwrap();
        assert_eq!(
            o,
            CasOutcome {
                swapped: false,
                current: None
            }
        );
    }

    #[test]
    fn waits_wake_on_set_and_time_out_listing_missing_keys() {
        let s = MemoryStore::new();
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.multi_get(&["x", "y"], T));
        std::thread::sleep(Duration::from_millis(20));
        s.set("y", b"Y").unwrap();
        s.set("x", b"X").unwrap();
        assert_eq!(
            t.join().unwrap().unwrap(),
            vec![b"X".to_vec(), b"Y".to_vec()]
        );

        let start = Instant::now();
        let e = s
            .wait(&["x", "p", "q"], Duration::from_millis(50))
            .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        match e {
            Error::Timeout { missing, .. } => assert_eq!(missing, ["p", "q"]),
            e => panic!("{e}"),
        }
        // A huge timeout does not overflow.
        s.wait(&["x"], Duration::MAX).unwrap();
    }

    #[test]
    fn closing_wakes_waiters() {
        let s = MemoryStore::new();
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.wait(&["never"], T));
        std::thread::sleep(Duration::from_millis(20));
        s.close();
        assert!(t.join().unwrap().unwrap_err().is_store_gone());
    }
}
