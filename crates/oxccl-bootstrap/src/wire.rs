//! The store's wire format: length-prefixed binary frames.
//!
//! Every frame is `len: u32 LE` followed by `len` bytes of body; the body is a one-byte tag and
//! the message's fields. Integers are little-endian; byte strings and UTF-8 strings are a `u32`
//! length and the bytes; lists are a `u32` count and the items; options are a `0`/`1` byte and
//! the value. Every length is checked against the caps below before anything is allocated, and
//! [`decode`] is a pure function over a byte slice that never panics (a proptest and the
//! `bootstrap_wire` fuzz target in `fuzz/` hold it to that).
//!
//! The handshake's three frames travel in clear; every frame after them travels inside
//! AES-256-GCM records of `oxccl_seal` (a record's plaintext is a run of these frames' bytes,
//! which [`decode`] reads once the record authenticated).

use std::fmt;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 16 << 20;
/// Most keys in one request (or values in one reply).
pub const MAX_KEYS: usize = 1 << 16;
/// Largest frame body, in bytes.
pub const MAX_FRAME_LEN: usize = 64 << 20;
/// Largest frame body the server accepts before a peer has authenticated.
pub const MAX_HANDSHAKE_FRAME_LEN: usize = 2048;
/// Longest free-text field (client label, reasons, error messages), in bytes.
pub const MAX_TEXT_LEN: usize = 1024;
/// Length of the nonces and MACs of the handshake.
pub const NONCE_LEN: usize = crate::handshake::NONCE_LEN;
/// Protocol version the server announces in its greeting. Version 2: after the handshake
/// (`Hello`, `Auth` with an empty label, `AuthOk`), every frame travels inside sealed records
/// ([`oxccl_seal::SealedStream`]) both ways, the client's [`Msg::Name`] first.
pub const PROTOCOL_VERSION: u16 = 2;
/// Magic number that opens the server's greeting ("OXST").
pub const MAGIC: u32 = u32::from_le_bytes(*b"OXST");

/// One message of the store protocol, in either direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Server → client, first message: who we are and a fresh challenge.
    Hello {
        /// Protocol version.
        version: u16,
        /// The server's challenge.
        nonce: [u8; NONCE_LEN],
    },
    /// Client → server: the answer to the challenge and the client's own challenge.
    Auth {
        /// HMAC-SHA256 over the server's nonce, the client's nonce and the label.
        mac: [u8; NONCE_LEN],
        /// The client's challenge.
        nonce: [u8; NONCE_LEN],
        /// Free text naming the client, covered by the MAC. Empty since version 2: the name
        /// follows sealed ([`Msg::Name`]), so that the path learns nothing of the job.
        label: String,
    },
    /// Client → server, the first sealed frame (version 2): free text naming the client, for
    /// the server's logs (e.g. "rank 3 pid 1234 on node7").
    Name {
        /// The client's name.
        label: String,
    },
    /// Server → client: the client is authenticated; the server's answer to its challenge.
    AuthOk {
        /// HMAC-SHA256 over the client's nonce and the server's nonce.
        mac: [u8; NONCE_LEN],
    },
    /// Server → client: the client is refused; the server closes the connection.
    AuthFail {
        /// Why.
        reason: String,
    },
    /// Request: set `key` to `value`.
    Set {
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
    },
    /// Request: wait until every key exists, then return their values.
    Get {
        /// Keys.
        keys: Vec<String>,
        /// How long the server waits, in milliseconds.
        timeout_ms: u64,
    },
    /// Request: wait until every key exists.
    Wait {
        /// Keys.
        keys: Vec<String>,
        /// How long the server waits, in milliseconds.
        timeout_ms: u64,
    },
    /// Request: add `delta` to the integer at `key` (missing counts as 0).
    Add {
        /// Key.
        key: String,
        /// Increment.
        delta: i64,
    },
    /// Request: set `key` to `desired` if its value is `expected` (`None`: if it is missing).
    CompareSet {
        /// Key.
        key: String,
        /// Expected current value; `None` means "the key does not exist".
        expected: Option<Vec<u8>>,
        /// New value.
        desired: Vec<u8>,
    },
    /// Request: delete `key`.
    Delete {
        /// Key.
        key: String,
    },
    /// Reply: done.
    Done,
    /// Reply to `Get`: the values, in the order of the keys.
    Values(Vec<Vec<u8>>),
    /// Reply to `Add`: the new value.
    Int(i64),
    /// Reply to `Delete`: whether the key existed.
    Bool(bool),
    /// Reply to `CompareSet`.
    Cas {
        /// Whether the value was replaced.
        swapped: bool,
        /// The value after the operation (`None`: the key does not exist).
        current: Option<Vec<u8>>,
    },
    /// Reply to `Get`/`Wait`: the timeout passed; these keys are still missing.
    TimedOut {
        /// Missing keys.
        missing: Vec<String>,
    },
    /// Reply: the request was refused.
    Failed {
        /// Why.
        message: String,
    },
}

const T_HELLO: u8 = 1;
const T_AUTH: u8 = 2;
const T_AUTH_OK: u8 = 3;
const T_AUTH_FAIL: u8 = 4;
const T_NAME: u8 = 5;
const T_SET: u8 = 10;
const T_GET: u8 = 11;
const T_WAIT: u8 = 12;
const T_ADD: u8 = 13;
const T_CAS: u8 = 14;
const T_DELETE: u8 = 15;
const T_DONE: u8 = 30;
const T_VALUES: u8 = 31;
const T_INT: u8 = 32;
const T_BOOL: u8 = 33;
const T_CAS_REPLY: u8 = 34;
const T_TIMED_OUT: u8 = 35;
const T_FAILED: u8 = 36;

impl Msg {
    /// Short name of the message kind, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::Auth { .. } => "Auth",
            Msg::AuthOk { .. } => "AuthOk",
            Msg::AuthFail { .. } => "AuthFail",
            Msg::Name { .. } => "Name",
            Msg::Set { .. } => "Set",
            Msg::Get { .. } => "Get",
            Msg::Wait { .. } => "Wait",
            Msg::Add { .. } => "Add",
            Msg::CompareSet { .. } => "CompareSet",
            Msg::Delete { .. } => "Delete",
            Msg::Done => "Done",
            Msg::Values(_) => "Values",
            Msg::Int(_) => "Int",
            Msg::Bool(_) => "Bool",
            Msg::Cas { .. } => "Cas",
            Msg::TimedOut { .. } => "TimedOut",
            Msg::Failed { .. } => "Failed",
        }
    }
}

/// Why a byte string is not (yet) a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The buffer holds only part of a frame: at least `needed` bytes in all are required.
    Incomplete {
        /// Total bytes needed before decoding can make progress.
        needed: usize,
    },
    /// The frame announces a body larger than the cap.
    TooLarge {
        /// Announced body length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// The frame is complete but malformed.
    Invalid(String),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Incomplete { needed } => {
                write!(f, "incomplete frame ({needed} bytes needed)")
            }
            DecodeError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the limit of {max} bytes")
            }
            DecodeError::Invalid(why) => write!(f, "malformed frame: {why}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Reads the body length announced by a frame header, if the buffer holds the header.
pub fn frame_len(buf: &[u8]) -> Option<usize> {
    let header: [u8; 4] = buf.get(..4)?.try_into().ok()?;
    Some(u32::from_le_bytes(header) as usize)
}

/// Decodes one frame from the front of `buf`: the message and the number of bytes consumed.
///
/// Pure and total: any input yields a message, [`DecodeError::Incomplete`] (a prefix of a valid
/// frame, or a header announcing more bytes than the buffer holds),
/// [`DecodeError::TooLarge`] or [`DecodeError::Invalid`]; never a panic.
pub fn decode(buf: &[u8]) -> Result<(Msg, usize), DecodeError> {
    let Some(len) = frame_len(buf) else {
        return Err(DecodeError::Incomplete { needed: 4 });
    };
    if len > MAX_FRAME_LEN {
        return Err(DecodeError::TooLarge {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    let total = 4 + len;
    let Some(body) = buf.get(4..total) else {
        return Err(DecodeError::Incomplete { needed: total });
    };
    let mut r = Reader { buf: body, pos: 0 };
    let msg = r.msg()?;
    if r.pos != body.len() {
        return Err(DecodeError::Invalid(format!(
            "{} trailing bytes after a {} message",
            body.len() - r.pos,
            msg.kind()
        )));
    }
    Ok((msg, total))
}

/// Encodes a message as one frame.
///
/// Fails (rather than emitting a frame no peer would accept) when a field exceeds its cap.
pub fn encode(msg: &Msg) -> Result<Vec<u8>, DecodeError> {
    let mut w = Writer {
        buf: vec![0; 4],
        err: None,
    };
    w.msg(msg);
    if let Some(e) = w.err {
        return Err(DecodeError::Invalid(e));
    }
    let len = w.buf.len() - 4;
    if len > MAX_FRAME_LEN {
        return Err(DecodeError::TooLarge {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    w.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(w.buf)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn invalid(why: impl Into<String>) -> DecodeError {
    DecodeError::Invalid(why.into())
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| invalid(format!("{what} runs past the end of the frame")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], DecodeError> {
        let s = self.take(N, what)?;
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn bool(&mut self, what: &str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(invalid(format!("{what}: {b} is not a boolean"))),
        }
    }

    fn len(&mut self, what: &str, max: usize) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n > max {
            return Err(invalid(format!(
                "{what}: length {n} exceeds the limit {max}"
            )));
        }
        Ok(n)
    }

    fn bytes(&mut self, what: &str, max: usize) -> Result<Vec<u8>, DecodeError> {
        let n = self.len(what, max)?;
        Ok(self.take(n, what)?.to_vec())
    }

    fn string(&mut self, what: &str, max: usize) -> Result<String, DecodeError> {
        let n = self.len(what, max)?;
        let s = self.take(n, what)?;
        std::str::from_utf8(s)
            .map(str::to_owned)
            .map_err(|_| invalid(format!("{what} is not UTF-8")))
    }

    fn key(&mut self) -> Result<String, DecodeError> {
        self.string("key", MAX_KEY_LEN)
    }

    fn keys(&mut self) -> Result<Vec<String>, DecodeError> {
        let n = self.len("key count", MAX_KEYS)?;
        // Each key takes at least 4 bytes: never reserve more than the frame can hold.
        let mut keys = Vec::with_capacity(n.min(self.buf.len().saturating_sub(self.pos) / 4));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }

    fn value(&mut self) -> Result<Vec<u8>, DecodeError> {
        self.bytes("value", MAX_VALUE_LEN)
    }

    fn opt_value(&mut self) -> Result<Option<Vec<u8>>, DecodeError> {
        Ok(if self.bool("option flag")? {
            Some(self.value()?)
        } else {
            None
        })
    }

    fn text(&mut self, what: &str) -> Result<String, DecodeError> {
        self.string(what, MAX_TEXT_LEN)
    }

    fn msg(&mut self) -> Result<Msg, DecodeError> {
        let tag = self.u8("message tag")?;
        Ok(match tag {
            T_HELLO => {
                let magic = self.u32("magic")?;
                if magic != MAGIC {
                    return Err(invalid(format!("bad magic {magic:#010x}")));
                }
                Msg::Hello {
                    version: self.u16("version")?,
                    nonce: self.array("nonce")?,
                }
            }
            T_AUTH => Msg::Auth {
                mac: self.array("mac")?,
                nonce: self.array("nonce")?,
                label: self.text("label")?,
            },
            T_AUTH_OK => Msg::AuthOk {
                mac: self.array("mac")?,
            },
            T_NAME => Msg::Name {
                label: self.text("label")?,
            },
            T_AUTH_FAIL => Msg::AuthFail {
                reason: self.text("reason")?,
            },
            T_SET => Msg::Set {
                key: self.key()?,
                value: self.value()?,
            },
            T_GET => Msg::Get {
                keys: self.keys()?,
                timeout_ms: self.u64("timeout")?,
            },
            T_WAIT => Msg::Wait {
                keys: self.keys()?,
                timeout_ms: self.u64("timeout")?,
            },
            T_ADD => Msg::Add {
                key: self.key()?,
                delta: self.u64("delta")? as i64,
            },
            T_CAS => Msg::CompareSet {
                key: self.key()?,
                expected: self.opt_value()?,
                desired: self.value()?,
            },
            T_DELETE => Msg::Delete { key: self.key()? },
            T_DONE => Msg::Done,
            T_VALUES => {
                let n = self.len("value count", MAX_KEYS)?;
                let mut values =
                    Vec::with_capacity(n.min(self.buf.len().saturating_sub(self.pos) / 4));
                for _ in 0..n {
                    values.push(self.value()?);
                }
                Msg::Values(values)
            }
            T_INT => Msg::Int(self.u64("integer")? as i64),
            T_BOOL => Msg::Bool(self.bool("boolean")?),
            T_CAS_REPLY => Msg::Cas {
                swapped: self.bool("swapped")?,
                current: self.opt_value()?,
            },
            T_TIMED_OUT => Msg::TimedOut {
                missing: self.keys()?,
            },
            T_FAILED => Msg::Failed {
                message: self.text("message")?,
            },
            t => return Err(invalid(format!("unknown message tag {t}"))),
        })
    }
}

struct Writer {
    buf: Vec<u8>,
    err: Option<String>,
}

impl Writer {
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn len(&mut self, what: &str, n: usize, max: usize) {
        if n > max && self.err.is_none() {
            self.err = Some(format!("{what}: length {n} exceeds the limit {max}"));
        }
        self.u32(n.min(u32::MAX as usize) as u32);
    }

    fn bytes(&mut self, what: &str, b: &[u8], max: usize) {
        self.len(what, b.len(), max);
        self.buf.extend_from_slice(b);
    }

    fn key(&mut self, k: &str) {
        self.bytes("key", k.as_bytes(), MAX_KEY_LEN);
    }

    fn keys(&mut self, keys: &[String]) {
        self.len("key count", keys.len(), MAX_KEYS);
        for k in keys {
            self.key(k);
        }
    }

    fn value(&mut self, v: &[u8]) {
        self.bytes("value", v, MAX_VALUE_LEN);
    }

    fn opt_value(&mut self, v: &Option<Vec<u8>>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.value(v);
            }
            None => self.u8(0),
        }
    }

    fn text(&mut self, what: &str, s: &str) {
        self.bytes(what, s.as_bytes(), MAX_TEXT_LEN);
    }

    fn msg(&mut self, msg: &Msg) {
        match msg {
            Msg::Hello { version, nonce } => {
                self.u8(T_HELLO);
                self.u32(MAGIC);
                self.u16(*version);
                self.buf.extend_from_slice(nonce);
            }
            Msg::Auth { mac, nonce, label } => {
                self.u8(T_AUTH);
                self.buf.extend_from_slice(mac);
                self.buf.extend_from_slice(nonce);
                self.text("label", label);
            }
            Msg::AuthOk { mac } => {
                self.u8(T_AUTH_OK);
                self.buf.extend_from_slice(mac);
            }
            Msg::AuthFail { reason } => {
                self.u8(T_AUTH_FAIL);
                self.text("reason", reason);
            }
            Msg::Name { label } => {
                self.u8(T_NAME);
                self.text("label", label);
            }
            Msg::Set { key, value } => {
                self.u8(T_SET);
                self.key(key);
                self.value(value);
            }
            Msg::Get { keys, timeout_ms } => {
                self.u8(T_GET);
                self.keys(keys);
                self.u64(*timeout_ms);
            }
            Msg::Wait { keys, timeout_ms } => {
                self.u8(T_WAIT);
                self.keys(keys);
                self.u64(*timeout_ms);
            }
            Msg::Add { key, delta } => {
                self.u8(T_ADD);
                self.key(key);
                self.u64(*delta as u64);
            }
            Msg::CompareSet {
                key,
                expected,
                desired,
            } => {
                self.u8(T_CAS);
                self.key(key);
                self.opt_value(expected);
                self.value(desired);
            }
            Msg::Delete { key } => {
                self.u8(T_DELETE);
                self.key(key);
            }
            Msg::Done => self.u8(T_DONE),
            Msg::Values(values) => {
                self.u8(T_VALUES);
                self.len("value count", values.len(), MAX_KEYS);
                for v in values {
                    self.value(v);
                }
            }
            Msg::Int(v) => {
                self.u8(T_INT);
                self.u64(*v as u64);
            }
            Msg::Bool(b) => {
                self.u8(T_BOOL);
                self.u8(u8::from(*b));
            }
            Msg::Cas { swapped, current } => {
                self.u8(T_CAS_REPLY);
                self.u8(u8::from(*swapped));
                self.opt_value(current);
            }
            Msg::TimedOut { missing } => {
                self.u8(T_TIMED_OUT);
                self.keys(missing);
            }
            Msg::Failed { message } => {
                self.u8(T_FAILED);
                self.text("message", message);
            }
        }
    }
}

/// Why reading a frame from a stream failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// An I/O error (including the peer closing mid-frame, and read timeouts).
    Io(std::io::Error),
    /// The bytes are not a valid frame.
    Decode(DecodeError),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Closed => f.write_str("the connection was closed"),
            ReadError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                f.write_str("the connection was closed in the middle of a message")
            }
            ReadError::Io(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                f.write_str("no message before the timeout")
            }
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Decode(e) => write!(f, "{e}"),
        }
    }
}

/// Reads one frame, refusing (before allocating) bodies longer than `max`.
pub(crate) fn read_msg(r: &mut impl std::io::Read, max: usize) -> Result<Msg, ReadError> {
    let mut header = [0u8; 4];
    // The first byte distinguishes a clean close from a close mid-frame.
    loop {
        match r.read(&mut header[..1]) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    r.read_exact(&mut header[1..]).map_err(ReadError::Io)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > max {
        return Err(ReadError::Decode(DecodeError::TooLarge { len, max }));
    }
    let mut frame = vec![0u8; 4 + len];
    frame[..4].copy_from_slice(&header);
    r.read_exact(&mut frame[4..]).map_err(ReadError::Io)?;
    match decode(&frame) {
        Ok((msg, _)) => Ok(msg),
        Err(e) => Err(ReadError::Decode(e)),
    }
}

/// Encodes and writes one frame.
pub(crate) fn write_msg(w: &mut impl std::io::Write, msg: &Msg) -> std::io::Result<()> {
    let frame = encode(msg)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    w.write_all(&frame)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Msg> {
        vec![
            Msg::Hello {
                version: PROTOCOL_VERSION,
                nonce: [7; NONCE_LEN],
            },
            Msg::Auth {
                mac: [1; NONCE_LEN],
                nonce: [2; NONCE_LEN],
                label: "rank 3 pid 42".into(),
            },
            Msg::AuthOk {
                mac: [9; NONCE_LEN],
            },
            Msg::AuthFail {
                reason: "wrong secret".into(),
            },
            Msg::Set {
                key: "k".into(),
                value: b"v".to_vec(),
            },
            Msg::Set {
                key: String::new(),
                value: vec![],
            },
            Msg::Get {
                keys: vec!["a".into(), "bé".into()],
                timeout_ms: 1234,
            },
            Msg::Wait {
                keys: vec![],
                timeout_ms: u64::MAX,
            },
            Msg::Add {
                key: "c".into(),
                delta: -5,
            },
            Msg::CompareSet {
                key: "c".into(),
                expected: None,
                desired: b"x".to_vec(),
            },
            Msg::CompareSet {
                key: "c".into(),
                expected: Some(vec![]),
                desired: vec![],
            },
            Msg::Delete { key: "d".into() },
            Msg::Done,
            Msg::Values(vec![vec![], b"abc".to_vec()]),
            Msg::Int(i64::MIN),
            Msg::Bool(true),
            Msg::Cas {
                swapped: false,
                current: Some(b"old".to_vec()),
            },
            Msg::Cas {
                swapped: true,
                current: None,
            },
            Msg::TimedOut {
                missing: vec!["r/2".into(), "r/3".into()],
            },
            Msg::Failed {
                message: "no".into(),
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for msg in samples() {
            let frame = encode(&msg).unwrap();
            assert_eq!(decode(&frame), Ok((msg.clone(), frame.len())), "{msg:?}");
            // Followed by another frame: only the first is consumed.
            let mut two = frame.clone();
            two.extend_from_slice(&encode(&Msg::Done).unwrap());
            assert_eq!(decode(&two), Ok((msg, frame.len())));
        }
    }

    #[test]
    fn every_strict_prefix_is_incomplete() {
        for msg in samples() {
            let frame = encode(&msg).unwrap();
            for cut in 0..frame.len() {
                match decode(&frame[..cut]) {
                    Err(DecodeError::Incomplete { needed }) => {
                        assert!(needed > cut && needed <= frame.len())
                    }
                    other => panic!("{msg:?} cut at {cut}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn malformed_frames_are_rejected() {
        // Unknown tag.
        assert!(matches!(
            decode(&[1, 0, 0, 0, 200]),
            Err(DecodeError::Invalid(_))
        ));
        // Empty body.
        assert!(matches!(
            decode(&[0, 0, 0, 0]),
            Err(DecodeError::Invalid(_))
        ));
        // Oversized announcement: refused before the body arrives.
        let huge = ((MAX_FRAME_LEN + 1) as u32).to_le_bytes();
        assert!(matches!(decode(&huge), Err(DecodeError::TooLarge { .. })));
        // Trailing bytes inside the frame.
        let mut f = encode(&Msg::Done).unwrap();
        f.push(0);
        f[0] += 1;
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
        // A key that claims more bytes than the frame holds.
        let mut f = encode(&Msg::Delete { key: "abc".into() }).unwrap();
        f[5] = 0xff;
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
        // A key longer than the cap.
        let mut f = vec![0, 0, 0, 0, T_DELETE];
        f.extend_from_slice(&((MAX_KEY_LEN + 1) as u32).to_le_bytes());
        f.extend(std::iter::repeat_n(b'k', MAX_KEY_LEN + 1));
        let len = (f.len() - 4) as u32;
        f[..4].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
        // Invalid UTF-8 in a key.
        let f = [6, 0, 0, 0, T_DELETE, 1, 0, 0, 0, 0xff];
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
        // A boolean that is not 0 or 1.
        let f = [2, 0, 0, 0, T_BOOL, 2];
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
        // A greeting with the wrong magic.
        let mut f = encode(&Msg::Hello {
            version: 1,
            nonce: [0; NONCE_LEN],
        })
        .unwrap();
        f[5] ^= 1;
        assert!(matches!(decode(&f), Err(DecodeError::Invalid(_))));
    }

    #[test]
    fn encoding_refuses_oversized_fields() {
        let long_key = "k".repeat(MAX_KEY_LEN + 1);
        assert!(encode(&Msg::Delete { key: long_key }).is_err());
        let long_text = "t".repeat(MAX_TEXT_LEN + 1);
        assert!(encode(&Msg::Failed { message: long_text }).is_err());
    }

    fn arb_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..64)
    }

    fn arb_msg() -> impl Strategy<Value = Msg> {
        let key = "[a-z/0-9]{0,12}";
        prop_oneof![
            (any::<u16>(), any::<[u8; 32]>())
                .prop_map(|(version, nonce)| Msg::Hello { version, nonce }),
            (any::<[u8; 32]>(), any::<[u8; 32]>(), ".{0,20}")
                .prop_map(|(mac, nonce, label)| Msg::Auth { mac, nonce, label }),
            ".{0,20}".prop_map(|label| Msg::Name { label }),
            (key, arb_bytes()).prop_map(|(key, value)| Msg::Set { key, value }),
            (proptest::collection::vec(key, 0..5), any::<u64>())
                .prop_map(|(keys, timeout_ms)| Msg::Get { keys, timeout_ms }),
            (key, any::<i64>()).prop_map(|(key, delta)| Msg::Add { key, delta }),
            (key, proptest::option::of(arb_bytes()), arb_bytes()).prop_map(
                |(key, expected, desired)| Msg::CompareSet {
                    key,
                    expected,
                    desired
                }
            ),
            proptest::collection::vec(arb_bytes(), 0..5).prop_map(Msg::Values),
            (any::<bool>(), proptest::option::of(arb_bytes()))
                .prop_map(|(swapped, current)| Msg::Cas { swapped, current }),
        ]
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok((_, used)) = decode(&bytes) {
                prop_assert!(used <= bytes.len());
            }
        }

        #[test]
        fn decode_never_panics_on_plausible_headers(
            tag in any::<u8>(),
            body in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            // A correct length prefix and a random body reach deep into the field parsers.
            let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
            f.push(tag);
            f.extend_from_slice(&body);
            if let Ok((msg, used)) = decode(&f) {
                prop_assert_eq!(used, f.len());
                // Whatever decodes re-encodes to the same bytes.
                prop_assert_eq!(encode(&msg).unwrap(), f);
            }
        }

        #[test]
        fn random_messages_round_trip(msg in arb_msg()) {
            let frame = encode(&msg).unwrap();
            prop_assert_eq!(decode(&frame), Ok((msg, frame.len())));
        }
    }
}
