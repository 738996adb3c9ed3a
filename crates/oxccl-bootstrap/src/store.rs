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

/// The variable that caps the keys one job may keep in a store ([`StoreCaps::max_keys`]).
pub const STORE_MAX_KEYS_ENV: &str = "OXCCL_STORE_MAX_KEYS";
/// The variable that caps the bytes one job may keep in a store ([`StoreCaps::max_bytes`]).
pub const STORE_MAX_BYTES_ENV: &str = "OXCCL_STORE_MAX_BYTES";
/// Keys a job may keep in a store unless told otherwise: 1 Mi (a job of 10 000 ranks keeps a
/// few keys per rank).
pub const DEFAULT_STORE_MAX_KEYS: usize = 1 << 20;
/// Bytes (keys and values) a job may keep in a store unless told otherwise: 1 GiB.
pub const DEFAULT_STORE_MAX_BYTES: usize = 1 << 30;

/// Caps on what one job may keep in a store: a request that would pass one fails with an
/// error that names the cap, its variable and the job, and stores nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreCaps {
    /// Most keys held at once ([`STORE_MAX_KEYS_ENV`], default [`DEFAULT_STORE_MAX_KEYS`]).
    pub max_keys: usize,
    /// Most bytes held at once, keys and values ([`STORE_MAX_BYTES_ENV`], default
    /// [`DEFAULT_STORE_MAX_BYTES`]).
    pub max_bytes: usize,
    /// The job, as errors name it (e.g. `job 1a2b3c4d`: see [`StoreCaps::job_of`]).
    pub job: String,
}

impl Default for StoreCaps {
    fn default() -> Self {
        StoreCaps {
            max_keys: DEFAULT_STORE_MAX_KEYS,
            max_bytes: DEFAULT_STORE_MAX_BYTES,
            job: "the job".into(),
        }
    }
}

impl StoreCaps {
    /// The defaults, overridden by [`STORE_MAX_KEYS_ENV`] and [`STORE_MAX_BYTES_ENV`] (a
    /// count; a size such as `256M`); `job` names the job in errors.
    pub fn from_env(job: impl Into<String>) -> Result<StoreCaps> {
        StoreCaps::from_vars(&|v| std::env::var(v).ok(), job)
    }

    /// [`StoreCaps::from_env`] over any source of variables. A value that is not a positive
    /// number is [`Error::BadEnv`], naming the variable.
    pub fn from_vars(
        var: &dyn Fn(&str) -> Option<String>,
        job: impl Into<String>,
    ) -> Result<StoreCaps> {
        let read = |name: &'static str, default: usize| -> Result<usize> {
            match var(name) {
                None => Ok(default),
                Some(value) => match crate::config::parse_size(&value) {
                    Some(n) if n > 0 => Ok(n),
                    _ => Err(Error::BadEnv {
                        var: name,
                        value,
                        reason: "expected a positive count (a size such as 64M for bytes)".into(),
                    }),
                },
            }
        };
        Ok(StoreCaps {
            max_keys: read(STORE_MAX_KEYS_ENV, DEFAULT_STORE_MAX_KEYS)?,
            max_bytes: read(STORE_MAX_BYTES_ENV, DEFAULT_STORE_MAX_BYTES)?,
            job: job.into(),
        })
    }

    /// How errors name the job of `secret`: `job` and a fingerprint of its secret (a MAC
    /// under a label of its own: it tells nothing of the secret), the same on every rank.
    pub fn job_of(secret: &crate::Secret) -> String {
        let f = secret.mac_of("oxccl store job fingerprint", &[]);
        format!("job {:02x}{:02x}{:02x}{:02x}", f[0], f[1], f[2], f[3])
    }
}

struct State {
    map: HashMap<String, Vec<u8>>,
    closed: bool,
    /// Bytes held: every key's and value's length.
    bytes: usize,
    caps: StoreCaps,
}

impl State {
    /// Checks that `key` may hold `len` bytes of value within the caps; returns the bytes
    /// the store then holds. Nothing changes.
    fn room(&self, key: &str, len: usize) -> std::result::Result<usize, String> {
        let old = self.map.get(key).map(|v| key.len() + v.len());
        let caps = &self.caps;
        if old.is_none() && self.map.len() >= caps.max_keys {
            return Err(format!(
                "{key:?} not stored: {} holds {} keys, its cap (max_keys, {STORE_MAX_KEYS_ENV}={})",
                caps.job,
                self.map.len(),
                caps.max_keys
            ));
        }
        let total = (self.bytes - old.unwrap_or(0))
            .saturating_add(key.len())
            .saturating_add(len);
        if total > caps.max_bytes {
            return Err(format!(
                "{key:?} not stored: {} would hold {total} bytes, over its cap (max_bytes, \
                 {STORE_MAX_BYTES_ENV}={})",
                caps.job, caps.max_bytes
            ));
        }
        Ok(total)
    }

    /// Stores `value` at `key` within the caps ([`State::room`]).
    fn put(&mut self, key: &str, value: Vec<u8>) -> std::result::Result<(), String> {
        self.bytes = self.room(key, value.len())?;
        self.map.insert(key.to_owned(), value);
        Ok(())
    }

    fn remove(&mut self, key: &str) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                self.bytes -= key.len() + v.len();
                true
            }
            None => false,
        }
    }
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
    /// An empty store, with the default caps ([`StoreCaps::default`]).
    pub fn new() -> MemoryStore {
        MemoryStore::with_caps(StoreCaps::default())
    }

    /// An empty store that holds at most what `caps` allow.
    pub fn with_caps(caps: StoreCaps) -> MemoryStore {
        MemoryStore {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    map: HashMap::new(),
                    closed: false,
                    bytes: 0,
                    caps,
                }),
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

    /// The caps this store keeps to.
    pub fn caps(&self) -> StoreCaps {
        self.lock().caps.clone()
    }

    /// Bytes held now (every key's and value's length), as the caps count them.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    pub(crate) fn set_raw(&self, key: &str, value: &[u8]) -> std::result::Result<(), String> {
        self.lock().put(key, value.to_vec())?;
        self.shared.changed.notify_all();
        Ok(())
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
        st.put(key, new.to_string().into_bytes())
            .map_err(|e| format!("add: {e}"))?;
        drop(st);
        self.shared.changed.notify_all();
        Ok(new)
    }

    pub(crate) fn compare_set_raw(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> std::result::Result<CasOutcome, String> {
        let mut st = self.lock();
        let current = st.map.get(key).map(Vec::as_slice);
        if current == expected {
            st.put(key, desired.to_vec())
                .map_err(|e| format!("compare_set: {e}"))?;
            drop(st);
            self.shared.changed.notify_all();
            Ok(CasOutcome {
                swapped: true,
                current: Some(desired.to_vec()),
            })
        } else {
            Ok(CasOutcome {
                swapped: false,
                current: current.map(<[u8]>::to_vec),
            })
        }
    }

    pub(crate) fn delete_raw(&self, key: &str) -> bool {
        self.lock().remove(key)
    }

    /// The keys stored, for tests.
    #[cfg(test)]
    pub(crate) fn keys(&self) -> Vec<String> {
        self.lock().map.keys().cloned().collect()
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
        self.set_raw(key, value).map_err(|message| Error::Rejected {
            addr: self.location(),
            message,
        })
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
        self.compare_set_raw(key, expected, desired)
            .map_err(|message| Error::Rejected {
                addr: self.location(),
                message,
            })
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

    fn capped(max_keys: usize, max_bytes: usize) -> MemoryStore {
        MemoryStore::with_caps(StoreCaps {
            max_keys,
            max_bytes,
            job: "job test-caps".into(),
        })
    }

    fn rejected(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::Rejected { message, .. }) => message,
            r => panic!("expected a refusal, got {r:?}"),
        }
    }

    #[test]
    fn a_set_past_the_key_cap_names_it_and_stores_nothing() {
        let s = capped(3, 1 << 20);
        for k in ["a", "b", "c"] {
            s.set(k, b"v").unwrap();
        }
        let m = rejected(s.set("d", b"v"));
        for part in [
            "\"d\"",
            "job test-caps",
            "max_keys",
            STORE_MAX_KEYS_ENV,
            "=3",
        ] {
            assert!(m.contains(part), "{part} missing from {m}");
        }
        assert!(!s.check(&["d"]).unwrap());
        assert_eq!(s.len(), 3);
        // A new key by add or compare_set is refused the same way.
        assert!(rejected(s.add("n", 1)).contains(STORE_MAX_KEYS_ENV));
        assert!(rejected(s.compare_set("n", None, b"1")).contains(STORE_MAX_KEYS_ENV));
        assert!(!s.check(&["n"]).unwrap());
        // Replacing a key held is not a new key; deleting one makes room.
        s.set("a", b"w").unwrap();
        assert!(s.delete("b").unwrap());
        s.set("d", b"v").unwrap();
        assert_eq!(s.get("d", T).unwrap(), b"v");
    }

    #[test]
    fn a_set_past_the_byte_cap_names_it_and_keeps_the_old_value() {
        // Keys count: "k" + 10 bytes, "j" + 4 bytes = 16.
        let s = capped(100, 16);
        s.set("k", &[1; 10]).unwrap();
        s.set("j", &[2; 4]).unwrap();
        assert_eq!(s.bytes(), 16);
        let m = rejected(s.set("k", &[3; 11]));
        for part in [
            "\"k\"",
            "job test-caps",
            "max_bytes",
            STORE_MAX_BYTES_ENV,
            "=16",
            "17",
        ] {
            assert!(m.contains(part), "{part} missing from {m}");
        }
        // Nothing half-stored: the old value and the count are as they were.
        assert_eq!(s.get("k", T).unwrap(), [1; 10]);
        assert_eq!(s.bytes(), 16);
        // compare_set that would swap is refused and leaves the value.
        assert!(rejected(s.compare_set("j", Some(&[2; 4]), &[9; 5])).contains("max_bytes"));
        assert_eq!(s.get("j", T).unwrap(), [2; 4]);
        // add that makes the number's text longer than the cap allows: "n" + "99" is 3 bytes,
        // "n" + "100" would be 4.
        let s = capped(100, 3);
        assert_eq!(s.add("n", 99).unwrap(), 99);
        assert!(rejected(s.add("n", 1)).contains("max_bytes"));
        assert_eq!(s.get("n", T).unwrap(), b"99");
        // A smaller value fits again, and a delete gives the bytes back.
        let s = capped(100, 16);
        s.set("k", &[1; 15]).unwrap();
        s.set("k", &[1; 5]).unwrap();
        assert_eq!(s.bytes(), 6);
        assert!(s.delete("k").unwrap());
        assert_eq!(s.bytes(), 0);
        s.set("big", &[0; 13]).unwrap();
    }

    #[test]
    fn caps_come_from_the_variables_and_bad_values_name_the_variable() {
        let none = |_: &str| None;
        let c = StoreCaps::from_vars(&none, "job x").unwrap();
        assert_eq!(
            (c.max_keys, c.max_bytes),
            (DEFAULT_STORE_MAX_KEYS, DEFAULT_STORE_MAX_BYTES)
        );
        let vars = |v: &str| match v {
            STORE_MAX_KEYS_ENV => Some("1000".to_owned()),
            STORE_MAX_BYTES_ENV => Some("64M".to_owned()),
            _ => None,
        };
        let c = StoreCaps::from_vars(&vars, "job x").unwrap();
        assert_eq!(
            (c.max_keys, c.max_bytes, c.job.as_str()),
            (1000, 64 << 20, "job x")
        );
        for bad in ["0", "lots", "-1"] {
            let vars = |v: &str| (v == STORE_MAX_BYTES_ENV).then(|| bad.to_owned());
            match StoreCaps::from_vars(&vars, "job x") {
                Err(Error::BadEnv { var, value, .. }) => {
                    assert_eq!((var, value.as_str()), (STORE_MAX_BYTES_ENV, bad))
                }
                r => panic!("{bad}: {r:?}"),
            }
        }
        let a = StoreCaps::job_of(&crate::Secret::new("one").unwrap());
        let b = StoreCaps::job_of(&crate::Secret::new("two").unwrap());
        assert!(a.starts_with("job ") && a.len() == 12 && a != b, "{a} {b}");
    }
}
