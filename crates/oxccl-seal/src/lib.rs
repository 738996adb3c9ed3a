//! Sealed records for oxccl's tcp wires: authenticated encryption of a byte stream, keyed per
//! connection from the job's secret.
//!
//! Every tcp wire of oxccl (the tcp provider's queue pairs, the store, the aggregation
//! service's streams, oxccl-kv's handshake) can carry its bytes in *records*:
//!
//! ```text
//!  0  body length (u32 LE: ciphertext + tag)   4  record number (u64 LE)
//! 12  ciphertext (at most MAX_RECORD bytes)        then the 16-byte GCM tag
//! ```
//!
//! - **Cipher:** AES-256-GCM from [`ring`] (hardware AES and carry-less multiply where the CPU
//!   has them); the header is associated data, so neither field can be changed unnoticed.
//! - **Keys:** a [`JobKey`] is derived from the job's secret for one purpose (HKDF-SHA256). A
//!   connection's two keys, one per direction, are derived from it with both sides' fresh
//!   nonces and the handshake's transcript ([`JobKey::session`]), so no two connections (nor
//!   the two directions of one) share a key, and a handshake altered on the path leaves the two
//!   sides with different keys.
//! - **Replay, loss and reordering:** records are numbered from 0 in each direction, and the
//!   number is the GCM nonce. A receiver takes only the next number ([`Opener::check_header`]):
//!   a replayed, dropped or reordered record fails as [`SealError::OutOfOrder`], a changed
//!   one as [`SealError::Tampered`], before any of its plaintext is handed out.
//! - **What records do not say:** where a stream ends. A stream cut between two records (the
//!   connection closed after record k) reads as a clean end after record k; the protocols
//!   above know when a message is due (a reply, a frame's payload) and fail then.
//!
//! [`SealedStream`] (and its halves, [`SealedReader`] and [`SealedWriter`]) carry a blocking
//! stream in records. Non-blocking users (the tcp provider) drive [`Sealer`] and [`Opener`]
//! themselves. [`JobKey::seal_value`] seals a single value for a store that is not ours.
//! [`Encrypt`] is the policy (`OXCCL_ENCRYPT=off|on|auto`) every wire reads.
//!
//! ```
//! use std::io::{Read, Write};
//! use oxccl_seal::{JobKey, Role, SealedStream, fresh_nonce};
//!
//! let job = JobKey::derive(b"the job's shared secret", "example v1");
//! let (ni, na) = (fresh_nonce()?, fresh_nonce()?);
//! let (a, b) = std::os::unix::net::UnixStream::pair()?;
//! let mut client = SealedStream::new(a, job.session(Role::Initiator, &ni, &na, b"hello"), "server");
//! let mut server = SealedStream::new(b, job.session(Role::Acceptor, &ni, &na, b"hello"), "client");
//! client.write_all(b"gradients")?;
//! client.flush()?; // a record goes out on flush (or when MAX_RECORD bytes are buffered)
//! let mut got = [0u8; 9];
//! server.read_exact(&mut got)?;
//! assert_eq!(&got, b"gradients");
//! # Ok::<(), std::io::Error>(())
//! ```

#![deny(missing_docs)]

#[cfg(feature = "mitm")]
pub mod mitm;
mod policy;
mod stream;

use std::fmt;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN as GCM_NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, KeyType, Salt};

pub use policy::{ENCRYPT_ENV, Encrypt, PolicyError, is_on_host};
pub use stream::{SealedReader, SealedStream, SealedWriter};

/// Length of a [`JobKey`] and of every derived key.
pub const KEY_LEN: usize = 32;
/// Length of the fresh nonce each side of a connection contributes ([`fresh_nonce`]).
pub const NONCE_LEN: usize = 32;
/// Length of a record's header: the body's length (u32 LE), then the record's number (u64 LE).
pub const HEADER_LEN: usize = 12;
/// Length of a record's authentication tag (at the end of its body).
pub const TAG_LEN: usize = 16;
/// The most plaintext bytes one record carries.
pub const MAX_RECORD: usize = 64 * 1024;
/// The most bytes [`JobKey::seal_value`] seals: AES-GCM's limit under one nonce
/// ((2^32 - 2) blocks of 16 bytes).
pub const MAX_VALUE: usize = ((1 << 32) - 2) * 16;

/// The label of the first extraction: what makes a job key oxccl-seal's and this version's.
const JOB_SALT: &[u8] = b"oxccl-seal v1 job key";

/// Why a record or a value did not seal or open (or was refused before it was read).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// Its tag did not check: the record was changed on the way, or sealed under another key
    /// (a peer without the job's secret).
    #[error(
        "record {seq} failed authentication (changed on the way, or sealed without the job's \
         secret)"
    )]
    Tampered {
        /// The record's number.
        seq: u64,
    },
    /// It is not the record expected next: a replayed, reordered or dropped record.
    #[error(
        "record {got} arrived where record {expected} was due ({})",
        out_of_order_why(.expected, .got)
    )]
    OutOfOrder {
        /// The number expected.
        expected: u64,
        /// The number it carries.
        got: u64,
    },
    /// Its header claims a body longer than a record may have (or shorter than a tag).
    #[error(
        "a record header claims a {len}-byte body, outside {TAG_LEN}..={max} (a corrupted or \
         forged header)"
    )]
    TooLong {
        /// The body length claimed.
        len: usize,
        /// The most a body may be.
        max: usize,
    },
    /// A sealed value did not open (what was wrong with it).
    #[error("a sealed value did not open: {0}")]
    Value(&'static str),
    /// The operating system's random source (`getrandom`) failed while drawing `what`.
    #[error("the operating system's random source failed drawing {what}: {source}")]
    Random {
        /// What was being drawn (a handshake nonce, a value's nonce).
        what: &'static str,
        /// The error `getrandom` gave.
        source: getrandom::Error,
    },
    /// [`Sealer::seal_record`] was handed a buffer that is not one record: a header, at most
    /// [`MAX_RECORD`] bytes of plaintext and room for the tag.
    #[error(
        "seal_record: a {len}-byte buffer is not a record ({HEADER_LEN}-byte header, at most \
         {MAX_RECORD} bytes of plaintext, {TAG_LEN}-byte tag)"
    )]
    RecordSize {
        /// The buffer's length.
        len: usize,
    },
    /// [`JobKey::seal_value`] was handed a value longer than AES-GCM seals under one nonce.
    #[error("a {len}-byte value is longer than AES-GCM seals under one nonce ({max} bytes)")]
    ValueTooLong {
        /// The value's length.
        len: usize,
        /// The most a value may be ([`MAX_VALUE`]).
        max: usize,
    },
    /// One direction of a connection has used every record number (2^64 records): sealing
    /// another would reuse a nonce.
    #[error("record numbers of this connection's direction are used up (2^64 records): reconnect")]
    Exhausted,
}

/// What a record that is not the one due most likely is.
fn out_of_order_why(expected: &u64, got: &u64) -> &'static str {
    if got < expected {
        "replayed or reordered"
    } else {
        "an earlier record was dropped or reordered"
    }
}

impl From<SealError> for std::io::Error {
    fn from(e: SealError) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// Which end of a connection a side is: the one that connected (initiator) or the one that
/// accepted (acceptor). Each direction has its own key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The end that connected.
    Initiator,
    /// The end that accepted.
    Acceptor,
}

/// A fresh random nonce for a handshake.
///
/// # Errors
/// [`SealError::Random`] when the operating system's random source (`getrandom`) fails.
pub fn fresh_nonce() -> Result<[u8; NONCE_LEN], SealError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|source| SealError::Random {
        what: "a handshake nonce",
        source,
    })?;
    Ok(n)
}

/// An HKDF output length that ring accepts as a key type.
struct Len(usize);

impl KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// Expands `prk` into a key under `info`.
fn expand(prk: &ring::hkdf::Prk, info: &[&[u8]]) -> [u8; KEY_LEN] {
    let mut k = [0u8; KEY_LEN];
    // Infallible by construction: HKDF-SHA256 refuses only an output longer than 255 * 32
    // bytes (RFC 5869), and `okm.fill` only a buffer of another length than the one asked
    // for; both are the constant KEY_LEN (32) here, whatever the input.
    prk.expand(info, Len(KEY_LEN))
        .and_then(|okm| okm.fill(&mut k))
        .expect("HKDF-SHA256 expands to 32 bytes");
    k
}

fn aead_key(bytes: &[u8; KEY_LEN]) -> LessSafeKey {
    // Infallible by construction: `UnboundKey::new` refuses only a key whose length is not
    // the algorithm's, and the type says 32 bytes, AES-256's length.
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, bytes).expect("32 bytes is an AES-256 key"))
}

/// Key material of one job for one purpose (the tcp provider's queue pairs, the store, ...):
/// what every connection's keys are derived from. Two job keys are equal when their bytes are;
/// `Debug` shows nothing of them.
#[derive(Clone, PartialEq, Eq)]
pub struct JobKey([u8; KEY_LEN]);

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(..)")
    }
}

impl JobKey {
    /// The job key of `secret` (the job's shared secret) for `purpose` (a label naming the wire
    /// and its version: keys for one purpose never serve another).
    pub fn derive(secret: &[u8], purpose: &str) -> JobKey {
        let prk = Salt::new(HKDF_SHA256, JOB_SALT).extract(secret);
        JobKey(expand(&prk, &[purpose.as_bytes()]))
    }

    /// Both directions' keys of one connection: bound to both sides' fresh nonces and to
    /// `transcript` (what both sides said in the clear before: hellos, names, tokens). The
    /// initiator's sealer is the acceptor's opener and the other way round.
    pub fn session(
        &self,
        role: Role,
        initiator_nonce: &[u8; NONCE_LEN],
        acceptor_nonce: &[u8; NONCE_LEN],
        transcript: &[u8],
    ) -> Session {
        let mut salt = [0u8; 2 * NONCE_LEN];
        salt[..NONCE_LEN].copy_from_slice(initiator_nonce);
        salt[NONCE_LEN..].copy_from_slice(acceptor_nonce);
        let prk = Salt::new(HKDF_SHA256, &salt).extract(&self.0);
        let to_acceptor = expand(&prk, &[b"oxccl-seal v1 initiator to acceptor", transcript]);
        let to_initiator = expand(&prk, &[b"oxccl-seal v1 acceptor to initiator", transcript]);
        let (tx, rx) = match role {
            Role::Initiator => (to_acceptor, to_initiator),
            Role::Acceptor => (to_initiator, to_acceptor),
        };
        Session {
            tx: Sealer {
                key: aead_key(&tx),
                seq: 0,
            },
            rx: Opener {
                key: aead_key(&rx),
                seq: 0,
            },
        }
    }

    /// `value` sealed under this key with a random nonce and `name` as associated data (a
    /// value kept in a store that is not ours: its key name, so a value moved to another name
    /// does not open). Layout: version (1), nonce (12), ciphertext, tag (16).
    ///
    /// # Errors
    /// [`SealError::ValueTooLong`] for a value over [`MAX_VALUE`] bytes;
    /// [`SealError::Random`] when the operating system's random source fails.
    pub fn seal_value(&self, name: &[u8], value: &[u8]) -> Result<Vec<u8>, SealError> {
        if value.len() > MAX_VALUE {
            return Err(SealError::ValueTooLong {
                len: value.len(),
                max: MAX_VALUE,
            });
        }
        let key = self.value_key();
        let mut nonce = [0u8; GCM_NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|source| SealError::Random {
            what: "a sealed value's nonce",
            source,
        })?;
        let mut out = Vec::with_capacity(1 + GCM_NONCE_LEN + value.len() + TAG_LEN);
        out.push(VALUE_VERSION);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(value);
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name),
                &mut out[1 + GCM_NONCE_LEN..],
            )
            // ring refuses only a plaintext over AES-GCM's limit, checked above.
            .map_err(|_| SealError::ValueTooLong {
                len: value.len(),
                max: MAX_VALUE,
            })?;
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Opens a value [`JobKey::seal_value`] sealed under `name`.
    pub fn open_value(&self, name: &[u8], sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        let short = SealError::Value("shorter than a sealed value");
        let (&version, rest) = sealed.split_first().ok_or(short.clone())?;
        let (nonce, body) = rest
            .split_first_chunk::<GCM_NONCE_LEN>()
            .filter(|(_, body)| body.len() >= TAG_LEN)
            .ok_or(short)?;
        if version != VALUE_VERSION {
            return Err(SealError::Value(
                "not a sealed value (a plain one, or another version)",
            ));
        }
        let mut body = body.to_vec();
        let n = self
            .value_key()
            .open_in_place(
                Nonce::assume_unique_for_key(*nonce),
                Aad::from(name),
                &mut body,
            )
            .map_err(|_| {
                SealError::Value("its tag did not check (changed, moved, or another job's)")
            })?
            .len();
        body.truncate(n);
        Ok(body)
    }

    fn value_key(&self) -> LessSafeKey {
        let prk = Salt::new(HKDF_SHA256, b"oxccl-seal v1 values").extract(&self.0);
        aead_key(&expand(&prk, &[b"value"]))
    }
}

/// The first byte of a sealed value.
const VALUE_VERSION: u8 = 0xA1;

/// One connection's two keys, made by [`JobKey::session`].
pub struct Session {
    /// Seals what this side sends.
    pub tx: Sealer,
    /// Opens what this side receives.
    pub rx: Opener,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("sealed", &self.tx.seq)
            .field("opened", &self.rx.seq)
            .finish()
    }
}

fn gcm_nonce(seq: u64) -> Nonce {
    let mut n = [0u8; GCM_NONCE_LEN];
    n[GCM_NONCE_LEN - 8..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals one direction's records, numbering them from 0.
pub struct Sealer {
    key: LessSafeKey,
    seq: u64,
}

impl Sealer {
    /// Appends to `out` one record per [`MAX_RECORD`] bytes of `plaintext` (one empty record for
    /// an empty one).
    ///
    /// # Errors
    /// [`SealError::Exhausted`] when this direction has no record number left; `out` is then
    /// as it was before the call.
    pub fn seal(&mut self, plaintext: &[u8], out: &mut Vec<u8>) -> Result<(), SealError> {
        let before = out.len();
        let mut chunks = plaintext.chunks(MAX_RECORD);
        let first = chunks.next().unwrap_or(&[]);
        for chunk in std::iter::once(first).chain(chunks) {
            let at = out.len();
            out.resize(at + HEADER_LEN, 0);
            out.extend_from_slice(chunk);
            out.resize(out.len() + TAG_LEN, 0);
            if let Err(e) = self.seal_record(&mut out[at..]) {
                out.truncate(before);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Seals one record in place: `record` is [`HEADER_LEN`] + n + [`TAG_LEN`] bytes
    /// (n ≤ [`MAX_RECORD`]) with the plaintext at `[HEADER_LEN..HEADER_LEN + n]`; writes the
    /// header, encrypts the plaintext and writes the tag.
    ///
    /// # Errors
    /// [`SealError::RecordSize`] when `record` is shorter than a header and a tag, or n is over
    /// [`MAX_RECORD`] (nothing is sealed, and no record number is used);
    /// [`SealError::Exhausted`] when this direction has no record number left.
    pub fn seal_record(&mut self, record: &mut [u8]) -> Result<(), SealError> {
        let len = record.len();
        let body = len
            .checked_sub(HEADER_LEN)
            .filter(|b| (TAG_LEN..=MAX_RECORD + TAG_LEN).contains(b))
            .ok_or(SealError::RecordSize { len })?;
        let seq = self.seq;
        // A number is never used twice: it is the GCM nonce.
        self.seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
        let (header, rest) = record.split_at_mut(HEADER_LEN);
        // `body` is at most MAX_RECORD + TAG_LEN (checked above): it fits a u32.
        header[..4].copy_from_slice(&(body as u32).to_le_bytes());
        header[4..].copy_from_slice(&seq.to_le_bytes());
        let (text, tag_at) = rest.split_at_mut(body - TAG_LEN);
        let tag = self
            .key
            .seal_in_place_separate_tag(gcm_nonce(seq), Aad::from(&*header), text)
            // ring refuses only a plaintext over AES-GCM's limit (about 64 GiB); a record's
            // is at most MAX_RECORD (checked above).
            .map_err(|_| SealError::RecordSize { len })?;
        tag_at.copy_from_slice(tag.as_ref());
        Ok(())
    }

    /// How many records this side has sealed (the number of the next).
    pub fn records_sealed(&self) -> u64 {
        self.seq
    }
}

/// Opens one direction's records, in order.
pub struct Opener {
    key: LessSafeKey,
    seq: u64,
}

impl Opener {
    /// The length of the body that follows `header` (plaintext + [`TAG_LEN`]), once the header
    /// is one this side can take: a body within [`MAX_RECORD`], and the number due next.
    pub fn check_header(&self, header: &[u8; HEADER_LEN]) -> Result<usize, SealError> {
        let [l0, l1, l2, l3, seq @ ..] = *header;
        let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
        let seq = u64::from_le_bytes(seq);
        if !(TAG_LEN..=MAX_RECORD + TAG_LEN).contains(&len) {
            return Err(SealError::TooLong {
                len,
                max: MAX_RECORD + TAG_LEN,
            });
        }
        if seq != self.seq {
            return Err(SealError::OutOfOrder {
                expected: self.seq,
                got: seq,
            });
        }
        Ok(len)
    }

    /// Checks the record's tag and decrypts its body in place: the plaintext is the returned
    /// slice. A record that fails returns nothing (its buffer then holds garbage that must never
    /// reach the application), and every later record fails too (the one due is still this).
    pub fn open_record<'a>(
        &mut self,
        header: &[u8; HEADER_LEN],
        body: &'a mut [u8],
    ) -> Result<&'a mut [u8], SealError> {
        let len = self.check_header(header)?;
        if body.len() != len {
            return Err(SealError::TooLong {
                len: body.len(),
                max: len,
            });
        }
        let seq = self.seq;
        let text = self
            .key
            .open_in_place(gcm_nonce(seq), Aad::from(&header[..]), body)
            .map_err(|_| SealError::Tampered { seq })?;
        // The sealer refuses a record past number u64::MAX, so none can be opened after it.
        self.seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
        Ok(text)
    }

    /// How many records this side has opened (the number due next).
    pub fn records_opened(&self) -> u64 {
        self.seq
    }
}

#[cfg(test)]
mod tests;
