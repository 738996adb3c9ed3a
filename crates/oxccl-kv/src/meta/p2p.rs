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
pub struct P2pMetadata {
    secret: Secret,
    me: String,
}

impl P2pMetadata {
    /// A backend that proves `secret` to the owners it asks.
    pub fn new(secret: Secret) -> P2pMetadata {
        P2pMetadata {
            secret,
            me: format!("p2p-lookup-{}", std::process::id()),
        }
    }
}

impl Metadata for P2pMetadata {
    fn publish(&self, _desc: &SegmentDesc) -> Result<()> {
        Ok(())
    }

    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let r = Client::connect(
                name,
                &self.me,
                &self.secret,
                left.max(Duration::from_millis(100)),
            )
            .and_then(|mut c| c.get_desc());
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
