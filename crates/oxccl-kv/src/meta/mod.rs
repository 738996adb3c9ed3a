//! Metadata backends: where engines publish their segment descriptors and peers look them up.
//!
//! Three implementations of one trait, as Mooncake offers etcd, Redis, HTTP and a
//! peer-to-peer handshake:
//! - [`P2pMetadata`]: no service at all. A segment's name is its owner's handshake address
//!   (`IP:port`), and the descriptor is asked of the owner over the authenticated handshake.
//! - [`StoreMetadata`]: the oxccl rendezvous store (`oxccl store`, or a job's bootstrap store).
//! - [`RedisMetadata`]: a Redis server (`redis://host:port/db`).
//!
//! The engine republishes its descriptor whenever [`Metadata::present`] says it is gone, so a
//! metadata server that restarted empty is filled again by the live engines.

mod p2p;
mod redis;
mod store;

use std::time::Duration;

pub use p2p::P2pMetadata;
pub use redis::RedisMetadata;
pub use store::StoreMetadata;

use crate::desc::SegmentDesc;
use crate::error::Result;

/// The key under which a segment's descriptor is kept in key-value backends.
pub fn segment_key(name: &str) -> String {
    format!("oxccl-kv/segment/{name}")
}

/// Where segment descriptors are published and found.
pub trait Metadata: Send + Sync {
    /// Publishes (or replaces) `desc` under its name.
    fn publish(&self, desc: &SegmentDesc) -> Result<()>;

    /// The descriptor of segment `name`, waiting up to `timeout` for it to appear.
    /// [`Error::SegmentNotFound`](crate::Error::SegmentNotFound) when it does not.
    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc>;

    /// Removes segment `name`'s descriptor (an engine shutting down). Removing a missing one
    /// is not an error.
    fn remove(&self, name: &str) -> Result<()>;

    /// Whether segment `name`'s descriptor is there now, at `version` or newer. The engine's
    /// keeper republishes when this says no (a metadata server that restarted empty).
    fn present(&self, name: &str, version: u64) -> Result<bool>;

    /// The backend, for messages (`redis://127.0.0.1:6379/0`).
    fn describe(&self) -> String;
}
