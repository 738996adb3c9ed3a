//! The peer-to-peer backend: no service; a segment's name is its owner's handshake address.

use std::time::{Duration, Instant};

use oxccl_bootstrap::Secret;

use super::Metadata;
use crate::desc::SegmentDesc;
use crate::error::{Error, Result};
use crate::handshake::Client;

/// Peer-to-peer metadata (Mooncake's `P2PHANDSHAKE`): publishing is a no-op, and a lookup asks
/// the owner itself, over the authenticated handshake, at the address the segment is named by
/// (`IP:port`, as [`TransferEngine::name`](crate::TransferEngine::name) gives it under this
/// backend).
///
/// A lookup retries an owner that does not answer yet until its timeout, but one where nobody
/// listens (connection refused) only for [`P2pMetadata::with_connect_retry`] (1 s by default):
/// a peer that is starting gets that long, a wrong address fails quickly, naming it.
pub struct P2pMetadata {
    secret: Secret,
    me: String,
    connect_retry: Duration,
}

impl P2pMetadata {
    /// A backend that proves `secret` to the owners it asks.
    pub fn new(secret: Secret) -> P2pMetadata {
        P2pMetadata {
            secret,
            me: format!("p2p-lookup-{}", std::process::id()),
            connect_retry: Duration::from_secs(1),
        }
    }

    /// How long a lookup retries an address that refuses connections
    /// ([`EngineConfig::connect_retry`](crate::EngineConfig::connect_retry)).
    pub fn with_connect_retry(mut self, retry: Duration) -> P2pMetadata {
        self.connect_retry = retry;
        self
    }
}

impl Metadata for P2pMetadata {
    fn publish(&self, _desc: &SegmentDesc) -> Result<()> {
        Ok(())
    }

    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc> {
        let start = Instant::now();
        let deadline = start + timeout;
        // Since when the address has refused every connection.
        let mut refused_since: Option<Instant> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let r = match Client::dial(
                name,
                &self.me,
                &self.secret,
                left.max(Duration::from_millis(100)),
                None,
            ) {
                Ok(mut c) => {
                    refused_since = None;
                    c.get_desc()
                }
                Err(e) => {
                    if !e.refused {
                        refused_since = None;
                    } else {
                        let since = *refused_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= self.connect_retry {
                            return Err(Error::SegmentNotFound {
                                name: name.into(),
                                backend: self.describe(),
                                detail: format!(
                                    "nobody is listening at {name}: connections refused for \
                                     {:.1?} (retried for connect_retry = {:?}, \
                                     OXCCL_KV_CONNECT_RETRY): {}",
                                    start.elapsed(),
                                    self.connect_retry,
                                    e.error
                                ),
                            });
                        }
                    }
                    Err(e.error)
                }
            };
            match r {
                Ok(d) if d.name == name => return Ok(d),
                Ok(d) => {
                    return Err(Error::SegmentNotFound {
                        name: name.into(),
                        backend: self.describe(),
                        detail: format!("the engine at that address serves segment {:?}", d.name),
                    });
                }
                Err(e @ Error::Auth { .. }) => return Err(e),
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::SegmentNotFound {
                        name: name.into(),
                        backend: self.describe(),
                        detail: format!("no engine answered within {timeout:?}: {e}"),
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn remove(&self, _name: &str) -> Result<()> {
        Ok(())
    }

    fn present(&self, _name: &str, _version: u64) -> Result<bool> {
        Ok(true)
    }

    fn describe(&self) -> String {
        "p2p handshake".into()
    }
}
