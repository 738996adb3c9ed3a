//! The oxccl rendezvous store as a metadata backend.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use oxccl_bootstrap::{Secret, Store, TcpStore};

use super::{Metadata, segment_key};
use crate::desc::SegmentDesc;
use crate::error::{Error, Result};

/// Descriptors kept in an oxccl store (`oxccl store`, a job's bootstrap store, or an
/// in-process [`MemoryStore`](oxccl_bootstrap::MemoryStore)) under `oxccl-kv/segment/NAME`.
///
/// Made with [`StoreMetadata::connect`], it reconnects when the store server went away and
/// came back (a restarted server is empty: the engines' keepers publish again).
pub struct StoreMetadata {
    store: Mutex<Arc<dyn Store>>,
    reconnect: Option<(String, Secret)>,
    location: String,
}

impl StoreMetadata {
    /// Uses `store` as it is (no reconnecting).
    pub fn new(store: Arc<dyn Store>) -> StoreMetadata {
        let location = store.location();
        StoreMetadata {
            store: Mutex::new(store),
            reconnect: None,
            location,
        }
    }

    /// Connects to the oxccl store server at `addr` (`host:port`) with the job secret, retrying
    /// up to `timeout` while nothing listens there.
    pub fn connect(addr: &str, secret: &Secret, timeout: Duration) -> Result<StoreMetadata> {
        let store = TcpStore::connect(addr, secret, timeout).map_err(|e| Error::Metadata {
            backend: format!("oxccl store at {addr}"),
            detail: e.to_string(),
        })?;
        Ok(StoreMetadata {
            store: Mutex::new(Arc::new(store)),
            reconnect: Some((addr.to_string(), secret.clone())),
            location: format!("oxccl store at {addr}"),
        })
    }

    fn store(&self) -> Arc<dyn Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs `f` on the store; once more on a fresh connection if the store had gone.
    fn with<T>(
        &self,
        f: impl Fn(&dyn Store) -> oxccl_bootstrap::Result<T>,
    ) -> oxccl_bootstrap::Result<T> {
        match f(&*self.store()) {
            Err(e) if e.is_store_gone() => {
                let Some((addr, secret)) = &self.reconnect else {
                    return Err(e);
                };
                let fresh: Arc<dyn Store> =
                    Arc::new(TcpStore::connect(addr, secret, Duration::from_secs(1))?);
                *self.store.lock().unwrap_or_else(|e| e.into_inner()) = fresh.clone();
                f(&*fresh)
            }
            r => r,
        }
    }

    fn fail(&self, e: oxccl_bootstrap::Error) -> Error {
        Error::Metadata {
            backend: self.describe(),
            detail: e.to_string(),
        }
    }
}

impl Metadata for StoreMetadata {
    /// Compare-and-set: an older version never replaces a newer one (another engine of the same
    /// name that started later, or a late republish).
    fn publish(&self, desc: &SegmentDesc) -> Result<()> {
        let key = segment_key(&desc.name);
        let bytes = desc.to_bytes();
        for _ in 0..64 {
            let cur = match self.with(|s| s.get(&key, Duration::ZERO)) {
                Ok(b) => Some(b),
                Err(e) if e.is_timeout() => None,
                Err(e) => return Err(self.fail(e)),
            };
            if let Some(c) = &cur
                && let Ok(d) = SegmentDesc::from_bytes(c, "")
                && d.version > desc.version
            {
                return Ok(());
            }
            let out = self
                .with(|s| s.compare_set(&key, cur.as_deref(), &bytes))
                .map_err(|e| self.fail(e))?;
            if out.swapped {
                return Ok(());
            }
        }
        Err(Error::Metadata {
            backend: self.describe(),
            detail: format!("publishing {key:?} lost 64 compare-and-set races in a row"),
        })
    }

    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc> {
        let key = segment_key(name);
        match self.with(|s| s.get(&key, timeout)) {
            Ok(b) => SegmentDesc::from_bytes(&b, &self.describe()),
            Err(e) if e.is_timeout() => Err(Error::SegmentNotFound {
                name: name.into(),
                backend: self.describe(),
                detail: format!("no descriptor under {key:?} within {timeout:?}"),
            }),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn remove(&self, name: &str) -> Result<()> {
        let key = segment_key(name);
        self.with(|s| s.delete(&key))
            .map(|_| ())
            .map_err(|e| self.fail(e))
    }

    fn present(&self, name: &str, version: u64) -> Result<bool> {
        let key = segment_key(name);
        match self.with(|s| s.get(&key, Duration::ZERO)) {
            Ok(b) => Ok(SegmentDesc::from_bytes(&b, &self.describe())
                .map(|d| d.version >= version)
                .unwrap_or(false)),
            Err(e) if e.is_timeout() => Ok(false),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}
