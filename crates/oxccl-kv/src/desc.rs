//! Segment descriptors: what a peer needs to reach a segment, as the metadata backends store it.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The descriptor format's version; a reader refuses other versions with a clear error.
pub const DESC_FORMAT: u32 = 1;

/// One registered buffer of a segment, in the owner's address space.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// Start address in the owner's address space (what requests name as `target_offset`).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key per provider (`"shm"`, `"tcp"`), as the owner registered it there.
    pub rkeys: Vec<(String, u64)>,
}

impl BufferDesc {
    /// The rkey of this buffer on `provider`, if it is registered there.
    pub fn rkey(&self, provider: &str) -> Option<u64> {
        self.rkeys
            .iter()
            .find(|(p, _)| p == provider)
            .map(|&(_, k)| k)
    }

    /// Whether `addr..addr+len` lies inside this buffer.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .zip(self.addr.checked_add(self.len))
                .is_some_and(|(end, last)| end <= last)
    }
}

/// Everything a peer needs to open a segment: where the owner's handshake listener is, which
/// providers it serves, and its buffers. Published by the owner to the metadata backend on every
/// change, with a growing `version`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// [`DESC_FORMAT`].
    pub format: u32,
    /// The segment's name (the engine's name).
    pub name: String,
    /// Grows by one on every change (a buffer registered or unregistered); a reader keeps the
    /// newest it has seen.
    pub version: u64,
    /// `IP:port` of the owner's handshake listener.
    pub handshake: String,
    /// The owner's host identity (boot id): peers on the same host may use shm.
    pub host: String,
    /// The providers the owner serves (`"shm"`, `"tcp"`).
    pub providers: Vec<String>,
    /// The buffers, in address order.
    pub buffers: Vec<BufferDesc>,
}

impl SegmentDesc {
    /// The descriptor as JSON bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a descriptor, refusing other format versions; `from` names where it came from.
    pub fn from_bytes(bytes: &[u8], from: &str) -> Result<SegmentDesc> {
        #[derive(Deserialize)]
        struct Probe {
            format: u32,
        }
        let probe: Probe = serde_json::from_slice(bytes).map_err(|e| Error::Metadata {
            backend: from.to_string(),
            detail: format!("a segment descriptor that is not valid JSON: {e}"),
        })?;
        if probe.format != DESC_FORMAT {
            return Err(Error::Metadata {
                backend: from.to_string(),
                detail: format!(
                    "segment descriptor format {} (this build reads {DESC_FORMAT})",
                    probe.format
                ),
            });
        }
        serde_json::from_slice(bytes).map_err(|e| Error::Metadata {
            backend: from.to_string(),
            detail: format!("a malformed segment descriptor: {e}"),
        })
    }

    /// The buffer holding `addr..addr+len`, or a [`Error::RemoteAccess`] naming the range and
    /// the buffers there are.
    pub fn locate(&self, addr: u64, len: u64) -> Result<&BufferDesc> {
        self.buffers
            .iter()
            .find(|b| b.contains(addr, len))
            .ok_or_else(|| Error::RemoteAccess {
                segment: self.name.clone(),
                detail: format!(
                    "{len} bytes at {addr:#x} are not inside a registered buffer (version {} has {})",
                    self.version,
                    self.describe_buffers()
                ),
            })
    }

    fn describe_buffers(&self) -> String {
        if self.buffers.is_empty() {
            return "no buffers".into();
        }
        let list: Vec<String> = self
            .buffers
            .iter()
            .take(8)
            .map(|b| format!("{:#x}+{}", b.addr, b.len))
            .collect();
        let more = self.buffers.len().saturating_sub(8);
        if more > 0 {
            format!("{} and {more} more", list.join(", "))
        } else {
            list.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> SegmentDesc {
        SegmentDesc {
            format: DESC_FORMAT,
            name: "node-a".into(),
            version: 3,
            handshake: "127.0.0.1:1".into(),
            host: "h".into(),
            providers: vec!["shm".into()],
            buffers: vec![BufferDesc {
                addr: 0x1000,
                len: 0x100,
                rkeys: vec![("shm".into(), 42)],
            }],
        }
    }

    #[test]
    fn descriptors_round_trip_and_other_formats_are_refused() {
        let d = desc();
        assert_eq!(SegmentDesc::from_bytes(&d.to_bytes(), "t").unwrap(), d);
        let mut old = d.clone();
        old.format = 99;
        let e = SegmentDesc::from_bytes(&old.to_bytes(), "t").unwrap_err();
        assert!(e.to_string().contains("format 99"), "{e}");
        assert!(SegmentDesc::from_bytes(b"{", "t").is_err());
    }

    #[test]
    fn locate_checks_both_ends_and_names_the_range() {
        let d = desc();
        assert_eq!(d.locate(0x1000, 0x100).unwrap().rkey("shm"), Some(42));
        assert!(d.locate(0x10ff, 1).is_ok());
        for (a, l) in [(0x10ff, 2), (0xfff, 1), (0x1100, 1), (u64::MAX, 2)] {
            let e = d.locate(a, l).unwrap_err();
            assert!(matches!(e, Error::RemoteAccess { .. }), "{e}");
            assert!(e.to_string().contains(&format!("{a:#x}")), "{e}");
        }
    }
}
