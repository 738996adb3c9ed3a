//! The handshake framing that the side channels authenticated by the job's secret share (the
//! aggregation service's control connection, oxccl-kv's segment handshake): JSON messages,
//! each after its length as 4 little-endian bytes, and the challenges (nonces) whose HMACs
//! ([`Secret::mac_of`](crate::Secret::mac_of)) both ends exchange; [`crate::handshake`] runs
//! the proofs over them.
//!
//! ```
//! # fn main() -> std::io::Result<()> {
//! use oxccl_bootstrap::frame;
//! let mut wire = Vec::new();
//! frame::send_json(&mut wire, &("hello", 7u32))?;
//! let back: (String, u32) = frame::recv_json(&mut wire.as_slice(), 1024, "test message")?;
//! assert_eq!(back, ("hello".to_string(), 7));
//! // Longer than the reader allows: refused before it is read.
//! let e = frame::recv_json::<(String, u32)>(&mut wire.as_slice(), 4, "test message");
//! assert!(e.unwrap_err().to_string().contains("a test message of 11 bytes (at most 4)"));
//! assert_ne!(frame::nonce()?, frame::nonce()?);
//! # Ok(()) }
//! ```

use std::io::{Error, ErrorKind, Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Writes `m` as one frame, in one write.
pub fn send_json<T: Serialize>(w: &mut impl Write, m: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(m).map_err(Error::other)?;
    let len = u32::try_from(body.len())
        .map_err(|_| Error::other(format!("a message of {} bytes", body.len())))?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    w.write_all(&out)
}

/// Reads one frame of at most `max` bytes (a longer one is refused before its body is read)
/// and decodes it; `what` names the message in errors (`"control message"`: "a control
/// message of 70000 bytes (at most 65536)", "a malformed control message: ...").
pub fn recv_json<T: DeserializeOwned>(
    r: &mut impl Read,
    max: usize,
    what: &str,
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("a {what} of {len} bytes (at most {max})"),
        ));
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map_err(|e| Error::new(ErrorKind::InvalidData, format!("a malformed {what}: {e}")))
}

/// A fresh 32-byte challenge from the OS's random source.
pub fn nonce() -> std::io::Result<[u8; 32]> {
    let mut n = [0; 32];
    getrandom::fill(&mut n).map_err(|e| Error::other(format!("no randomness: {e}")))?;
    Ok(n)
}
