//! Redis as a metadata backend (being written).

use std::time::Duration;

use super::Metadata;
use crate::desc::SegmentDesc;
use crate::error::{Error, Result};

/// Descriptors kept in Redis under `oxccl-kv/segment/NAME` (being written).
pub struct RedisMetadata {
    url: String,
}

impl RedisMetadata {
    /// Connects to `url` (`redis://host:port/db`).
    pub fn connect(url: &str, _timeout: Duration) -> Result<RedisMetadata> {
        Err(Error::Metadata {
            backend: url.to_string(),
            detail: "the Redis backend is not built yet".into(),
        })
    }
}

impl Metadata for RedisMetadata {
    fn publish(&self, _desc: &SegmentDesc) -> Result<()> {
        Err(Error::Closed)
    }
    fn lookup(&self, _name: &str, _timeout: Duration) -> Result<SegmentDesc> {
        Err(Error::Closed)
    }
    fn remove(&self, _name: &str) -> Result<()> {
        Err(Error::Closed)
    }
    fn present(&self, _name: &str, _version: u64) -> Result<bool> {
        Err(Error::Closed)
    }
    fn describe(&self) -> String {
        self.url.clone()
    }
}
