//! Values sealed before they go into a store that is not ours (torch's `TCPStore`, Redis, a
//! file), and opened when they come back: such a store carries the ranks' endpoints and
//! rkeys in clear, to whoever can reach it.
//!
//! [`SealedValues`] wraps any [`Store`]: `set` and `compare_set` seal each value with the job's
//! key ([`JobKey::seal_value`], a fresh random nonce, the key's name as associated data),
//! `get` opens it. A value that does not open (set by a process with another secret, changed
//! in the store, or moved from another key) is [`Error::ValueNotAuthentic`], naming the key.
//! Counters ([`Store::add`]) stay in clear: the store itself adds to them, and they are
//! numbers (tickets, generations), not endpoints. Waits and deletes only name keys.

use std::time::Duration;

use oxccl_seal::{Encrypt, JobKey};

use crate::error::{Error, Result};
use crate::secret::Secret;
use crate::store::{CasOutcome, Store};

/// The purpose the values' key is derived for ([`JobKey::derive`]).
pub const VALUES_PURPOSE: &str = "oxccl store values v1";

/// How many times a `compare_set` with an expected value retries when the value changes
/// between its read and its swap.
const CAS_TRIES: usize = 64;

/// A [`Store`] whose values are sealed with the job's key: see the module's documentation.
pub struct SealedValues {
    inner: Box<dyn Store>,
    key: JobKey,
}

impl std::fmt::Debug for SealedValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedValues")
            .field("store", &self.inner.location())
            .finish_non_exhaustive()
    }
}

impl SealedValues {
    /// Wraps `inner`, sealing its values with the key `secret` derives for them.
    pub fn new(inner: Box<dyn Store>, secret: &Secret) -> SealedValues {
        SealedValues {
            inner,
            key: JobKey::derive(secret.as_bytes(), VALUES_PURPOSE),
        }
    }

    /// `inner` as the encryption policy (`OXCCL_ENCRYPT`, [`Encrypt`]) wants a
    /// store that is not ours: wrapped in [`SealedValues`] unless the policy is `off`.
    ///
    /// The key comes from `secret` when given, else from the environment's (`OXCCL_SECRET`,
    /// `OXCCL_SECRET_FILE`). Without either, `on` falls back to the user's secret file
    /// ([`Secret::from_env_or_user_file`]; an error if there is none), and `auto` leaves the
    /// values in clear with a warning, as the tcp links of a job without a secret are (every
    /// rank must decide alike: give them all the secret, or none).
    pub fn per_policy(inner: Box<dyn Store>, secret: Option<&Secret>) -> Result<Box<dyn Store>> {
        SealedValues::per_policy_from_vars(inner, secret, &|v| std::env::var(v).ok())
    }

    /// [`SealedValues::per_policy`] over any source of variables.
    pub fn per_policy_from_vars(
        inner: Box<dyn Store>,
        secret: Option<&Secret>,
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Box<dyn Store>> {
        let policy = policy_from_vars(var)?;
        if policy == Encrypt::Off {
            return Ok(inner);
        }
        let secret = match (secret, Secret::from_vars(var)?) {
            (Some(s), _) => s.clone(),
            (None, Some(s)) => s,
            (None, None) if policy == Encrypt::On => Secret::from_vars_or_user_file(var)?,
            (None, None) => {
                tracing::warn!(
                    "the values set in the store at {} are not sealed: no job secret \
                     (OXCCL_SECRET or OXCCL_SECRET_FILE) to derive the key from \
                     (OXCCL_ENCRYPT=on would use the user's secret file)",
                    inner.location()
                );
                return Ok(inner);
            }
        };
        Ok(Box::new(SealedValues::new(inner, &secret)))
    }

    fn seal(&self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        self.key
            .seal_value(key.as_bytes(), value)
            .map_err(|source| Error::ValueNotSealed {
                addr: self.inner.location(),
                key: key.to_owned(),
                source,
            })
    }

    fn open(&self, key: &str, sealed: &[u8]) -> Result<Vec<u8>> {
        self.key
            .open_value(key.as_bytes(), sealed)
            .map_err(|e| Error::ValueNotAuthentic {
                addr: self.inner.location(),
                key: key.to_owned(),
                reason: e.to_string(),
            })
    }

    /// The value at `key` now, sealed as stored, if any.
    fn current(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.inner.multi_get(&[key], Duration::ZERO) {
            Ok(mut v) => Ok(v.pop()),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Store for SealedValues {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(key, &self.seal(key, value)?)
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let sealed = self.inner.multi_get(keys, timeout)?;
        keys.iter()
            .zip(&sealed)
            .map(|(k, v)| self.open(k, v))
            .collect()
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(keys, timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(key, delta)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        let sealed = self.seal(key, desired)?;
        let Some(expected) = expected else {
            let o = self.inner.compare_set(key, None, &sealed)?;
            return Ok(CasOutcome {
                swapped: o.swapped,
                current: match (o.swapped, o.current) {
                    (true, _) => Some(desired.to_vec()),
                    (false, Some(v)) => Some(self.open(key, &v)?),
                    (false, None) => None,
                },
            });
        };
        // Sealed values differ each time: compare the plaintexts, then swap exactly the
        // sealed value read (again if another process changed it in between).
        for _ in 0..CAS_TRIES {
            let Some(now) = self.current(key)? else {
                return Ok(CasOutcome {
                    swapped: false,
                    current: None,
                });
            };
            let plain = self.open(key, &now)?;
            if plain != expected {
                return Ok(CasOutcome {
                    swapped: false,
                    current: Some(plain),
                });
            }
            if self.inner.compare_set(key, Some(&now), &sealed)?.swapped {
                return Ok(CasOutcome {
                    swapped: true,
                    current: Some(desired.to_vec()),
                });
            }
        }
        Err(Error::Rejected {
            addr: self.inner.location(),
            message: format!(
                "compare_set of {key:?}: its value changed under each of {CAS_TRIES} tries"
            ),
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }

    fn location(&self) -> String {
        self.inner.location()
    }

    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// The policy in `OXCCL_ENCRYPT` (unset: [`Encrypt::Auto`]); a value that is none of `off`,
/// `on`, `auto` is [`Error::BadEnv`], naming the variable.
fn policy_from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Encrypt> {
    Encrypt::from_vars(var).map_err(|e| Error::BadEnv {
        var: oxccl_seal::ENCRYPT_ENV,
        value: e.0,
        reason: "expected off, on or auto".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    const T: Duration = Duration::from_secs(5);

    fn sealed(store: &MemoryStore, secret: &str) -> SealedValues {
        SealedValues::new(Box::new(store.clone()), &Secret::new(secret).unwrap())
    }

    #[test]
    fn values_are_sealed_in_the_store_and_open_for_the_job() {
        let under = MemoryStore::new();
        let s = sealed(&under, "job");
        let endpoint = b"tcp 10.0.0.7:41234 rkey 0x5eed";
        s.set("ep/3", endpoint).unwrap();
        // What the store holds shows nothing of the value, and another rank of the job
        // reads it back.
        let raw = under.get("ep/3", T).unwrap();
        assert!(!raw.windows(8).any(|w| endpoint.windows(8).any(|e| e == w)));
        assert_eq!(sealed(&under, "job").get("ep/3", T).unwrap(), endpoint);
        assert_eq!(s.multi_get(&["ep/3", "ep/3"], T).unwrap(), [endpoint; 2]);
    }

    #[test]
    fn a_value_that_does_not_open_names_its_key() {
        let under = MemoryStore::new();
        sealed(&under, "job").set("ep/1", b"one").unwrap();
        // Another secret.
        match sealed(&under, "stranger").get("ep/1", T) {
            Err(Error::ValueNotAuthentic { key, .. }) => assert_eq!(key, "ep/1"),
            r => panic!("{r:?}"),
        }
        // Changed in the store: one bit.
        let mut raw = under.get("ep/1", T).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        under.set("ep/1", &raw).unwrap();
        let e = sealed(&under, "job").get("ep/1", T).unwrap_err();
        assert!(e.to_string().contains("\"ep/1\""), "{e}");
        // Moved from another key: sealed for "ep/2", stored at "ep/1".
        sealed(&under, "job").set("ep/2", b"two").unwrap();
        under.set("ep/1", &under.get("ep/2", T).unwrap()).unwrap();
        assert!(matches!(
            sealed(&under, "job").get("ep/1", T),
            Err(Error::ValueNotAuthentic { .. })
        ));
        // A value set in clear by someone without the key.
        under.set("ep/9", b"plain").unwrap();
        assert!(sealed(&under, "job").get("ep/9", T).is_err());
    }

    #[test]
    fn compare_set_compares_plaintexts() {
        let under = MemoryStore::new();
        let s = sealed(&under, "job");
        assert!(s.compare_set("k", None, b"first").unwrap().swapped);
        let o = s.compare_set("k", None, b"second").unwrap();
        assert_eq!(
            (o.swapped, o.current.as_deref()),
            (false, Some(&b"first"[..]))
        );
        let o = s.compare_set("k", Some(b"nope"), b"x").unwrap();
        assert_eq!(
            (o.swapped, o.current.as_deref()),
            (false, Some(&b"first"[..]))
        );
        let o = s.compare_set("k", Some(b"first"), b"third").unwrap();
        assert_eq!(
            (o.swapped, o.current.as_deref()),
            (true, Some(&b"third"[..]))
        );
        assert_eq!(s.get("k", T).unwrap(), b"third");
        let o = s.compare_set("missing", Some(b"x"), b"y").unwrap();
        assert_eq!((o.swapped, o.current), (false, None));
        // Counters stay numbers the store can add to.
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.add("n", 3).unwrap(), 5);
    }

    #[test]
    fn a_job_bootstraps_over_sealed_values_and_the_store_holds_no_endpoint() {
        let under = MemoryStore::new();
        let secret = Secret::new("job").unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                let store: Box<dyn Store> =
                    Box::new(SealedValues::new(Box::new(under.clone()), &secret));
                std::thread::spawn(move || {
                    let b = crate::Bootstrap::with_store(rank, 3, store, "sealed", T)?;
                    let ep = format!("endpoint of rank {rank} at 10.1.2.{rank}:4000");
                    let all = b.all_gather("eps", ep.as_bytes())?;
                    b.barrier("done", T)?;
                    Ok::<_, Error>(all)
                })
            })
            .collect();
        for r in ranks {
            let all = r.join().unwrap().unwrap();
            for (rank, ep) in all.iter().enumerate() {
                assert_eq!(
                    ep,
                    format!("endpoint of rank {rank} at 10.1.2.{rank}:4000").as_bytes()
                );
            }
        }
        // Every value the store holds is sealed (a counter aside): none shows an endpoint.
        let keys: Vec<String> = under.keys();
        assert!(!keys.is_empty());
        for k in &keys {
            let v = under.get(k, T).unwrap();
            assert!(
                !v.windows(8).any(|w| w == b"endpoint"),
                "{k} holds an endpoint in clear"
            );
        }
    }

    #[test]
    fn the_policy_decides_whether_values_are_sealed() {
        // Whether a value set through the store `per_policy` makes is sealed underneath.
        let sealed_under = |vars: &[(&str, &str)]| -> Result<bool> {
            let under = MemoryStore::new();
            let var = |n: &str| {
                vars.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| (*v).to_owned())
            };
            let s = SealedValues::per_policy_from_vars(Box::new(under.clone()), None, &var)?;
            s.set("k", b"plain value")?;
            assert_eq!(s.get("k", T)?, b"plain value");
            Ok(under.get("k", T)? != b"plain value")
        };
        let secret = (crate::SECRET_ENV, "a job secret");
        let off = (crate::ENCRYPT_ENV, "off");
        let on = (crate::ENCRYPT_ENV, "on");
        assert!(sealed_under(&[secret]).unwrap(), "auto with a secret");
        assert!(sealed_under(&[secret, on]).unwrap(), "on with a secret");
        assert!(!sealed_under(&[secret, off]).unwrap(), "off");
        assert!(!sealed_under(&[]).unwrap(), "auto without a secret");
        let bad = sealed_under(&[(crate::ENCRYPT_ENV, "sometimes")]).unwrap_err();
        assert!(bad.to_string().contains(crate::ENCRYPT_ENV), "{bad}");
        // A secret handed in wins over the environment's.
        let under = MemoryStore::new();
        let given = Secret::new("given").unwrap();
        let s =
            SealedValues::per_policy_from_vars(Box::new(under.clone()), Some(&given), &|_| None)
                .unwrap();
        s.set("k", b"v").unwrap();
        assert_eq!(sealed(&under, "given").get("k", T).unwrap(), b"v");
    }

    #[test]
    fn the_policy_parses_and_bad_values_name_the_variable() {
        let with = |v: Option<&str>| {
            let v = v.map(str::to_owned);
            policy_from_vars(&move |n| (n == oxccl_seal::ENCRYPT_ENV).then(|| v.clone()).flatten())
        };
        assert_eq!(with(None).unwrap(), Encrypt::Auto);
        assert_eq!(with(Some("off")).unwrap(), Encrypt::Off);
        assert_eq!(with(Some("ON")).unwrap(), Encrypt::On);
        assert_eq!(with(Some("auto")).unwrap(), Encrypt::Auto);
        match with(Some("maybe")) {
            Err(Error::BadEnv { var, value, .. }) => {
                assert_eq!((var, value.as_str()), (oxccl_seal::ENCRYPT_ENV, "maybe"))
            }
            r => panic!("{r:?}"),
        }
    }
}
