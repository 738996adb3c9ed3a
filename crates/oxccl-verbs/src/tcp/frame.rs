//! The tcp provider's wire format: a fixed 64-byte header, then the payload (if the opcode has one).
//!
//! ```text
//!  0  magic "OXT1"     4  opcode   5  flags (0)   6  reserved (0)
//!  8  seq (u64)       16  len (u32)  20  imm (u32)
//! 24  remote addr    32  rkey      40  a (compare / add / old value / status)
//! 48  b (swap)       56  reserved (0)
//! ```
//!
//! All integers are little endian. [`Header::decode`] is a pure function: it accepts exactly the
//! headers this module encodes and rejects everything else with a [`FrameError`] (fuzzed by
//! `fuzz/fuzz_targets/tcp_frame.rs`).

use std::fmt;

/// Size of every header.
pub const HEADER_LEN: usize = 64;
const MAGIC: [u8; 4] = *b"OXT1";
/// Largest payload of one frame (and largest READ).
pub const MAX_PAYLOAD: u32 = 1 << 31;

/// What a frame asks for or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA WRITE: payload lands at (addr, rkey).
    Write = 1,
    /// WRITE with immediate: also consumes a receive.
    WriteImm = 2,
    /// SEND: payload lands in the next receive.
    Send = 3,
    /// SEND with immediate.
    SendImm = 4,
    /// READ request of `len` bytes at (addr, rkey).
    ReadReq = 5,
    /// Compare-and-swap of the word at (addr, rkey): `a` compare, `b` swap.
    Cas = 6,
    /// Fetch-and-add of the word at (addr, rkey): `a` addend.
    Faa = 7,
    /// Every request up to and including `seq` is done.
    Ack = 16,
    /// Request `seq` failed with status `a`; the responder drops the rest.
    Nak = 17,
    /// Data of READ `seq` (payload `len` bytes).
    ReadResp = 18,
    /// Old value (`a`) of atomic `seq`.
    AtomicResp = 19,
}

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            1 => Write,
            2 => WriteImm,
            3 => Send,
            4 => SendImm,
            5 => ReadReq,
            6 => Cas,
            7 => Faa,
            16 => Ack,
            17 => Nak,
            18 => ReadResp,
            19 => AtomicResp,
            _ => return None,
        })
    }

    /// Whether the frame is a request (initiator to target).
    pub fn is_request(self) -> bool {
        (self as u8) < 16
    }

    /// Whether the payload of `len` bytes follows the header.
    pub fn has_payload(self) -> bool {
        matches!(
            self,
            Opcode::Write | Opcode::WriteImm | Opcode::Send | Opcode::SendImm | Opcode::ReadResp
        )
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub opcode: Opcode,
    /// Request sequence number (requests), or the request answered (responses).
    pub seq: u64,
    /// Payload length, or READ length.
    pub len: u32,
    /// Immediate data.
    pub imm: u32,
    /// Remote address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u64,
    /// First operand: compare / add / old value / NAK status.
    pub a: u64,
    /// Second operand: swap.
    pub b: u64,
}

/// Why a header was rejected. Any of these closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The first four bytes are not the magic.
    BadMagic,
    /// Unknown opcode.
    BadOpcode(u8),
    /// A reserved field is not zero.
    Reserved,
    /// The length is impossible for the opcode.
    BadLength(Opcode, u32),
    /// A NAK carries no known failure status.
    BadStatus(u64),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic => write!(f, "bad magic (not an oxccl tcp frame)"),
            FrameError::BadOpcode(o) => write!(f, "unknown opcode {o}"),
            FrameError::Reserved => write!(f, "reserved header bytes are not zero"),
            FrameError::BadLength(op, l) => write!(f, "length {l} is invalid for {op:?}"),
            FrameError::BadStatus(s) => write!(f, "NAK with invalid status {s}"),
        }
    }
}

impl Header {
    /// A header with every operand zero.
    pub fn new(opcode: Opcode, seq: u64, len: u32) -> Header {
        Header {
            opcode,
            seq,
            len,
            imm: 0,
            addr: 0,
            rkey: 0,
            a: 0,
            b: 0,
        }
    }

    /// The bytes on the wire.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = self.opcode as u8;
        h[8..16].copy_from_slice(&self.seq.to_le_bytes());
        h[16..20].copy_from_slice(&self.len.to_le_bytes());
        h[20..24].copy_from_slice(&self.imm.to_le_bytes());
        h[24..32].copy_from_slice(&self.addr.to_le_bytes());
        h[32..40].copy_from_slice(&self.rkey.to_le_bytes());
        h[40..48].copy_from_slice(&self.a.to_le_bytes());
        h[48..56].copy_from_slice(&self.b.to_le_bytes());
        h
    }

    /// Parses and checks a header. Never panics.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap_or([0; 4]));
        if h[0..4] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        let opcode = Opcode::from_u8(h[4]).ok_or(FrameError::BadOpcode(h[4]))?;
        if h[5] != 0 || h[6] != 0 || h[7] != 0 || h[56..64].iter().any(|&b| b != 0) {
            return Err(FrameError::Reserved);
        }
        let hdr = Header {
            opcode,
            seq: u64_at(8),
            len: u32_at(16),
            imm: u32_at(20),
            addr: u64_at(24),
            rkey: u64_at(32),
            a: u64_at(40),
            b: u64_at(48),
        };
        let len_ok = match opcode {
            Opcode::Cas | Opcode::Faa => hdr.len == 8,
            Opcode::Ack | Opcode::Nak | Opcode::AtomicResp => hdr.len == 0,
            _ => hdr.len <= MAX_PAYLOAD,
        };
        if !len_ok {
            return Err(FrameError::BadLength(opcode, hdr.len));
        }
        if opcode == Opcode::Nak && !(1..=8).contains(&hdr.a) {
            return Err(FrameError::BadStatus(hdr.a));
        }
        Ok(hdr)
    }

    /// Bytes of payload after this header.
    pub fn payload_len(&self) -> usize {
        if self.opcode.has_payload() {
            self.len as usize
        } else {
            0
        }
    }
}

/// The first message on a new connection: which queue pair it is for, proven by its secret token.
pub const HELLO_LEN: usize = 32;
const HELLO_MAGIC: [u8; 8] = *b"OXTHELO1";

/// Encodes the hello naming the target queue pair, the initiator's, and the initiator's RNR
/// budget in µs (how long the target may hold its SEND waiting for a receive; 0 = forever).
pub fn encode_hello(target_token: u64, initiator_token: u64, rnr_us: u64) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..8].copy_from_slice(&HELLO_MAGIC);
    h[8..16].copy_from_slice(&target_token.to_le_bytes());
    h[16..24].copy_from_slice(&initiator_token.to_le_bytes());
    h[24..32].copy_from_slice(&rnr_us.to_le_bytes());
    h
}

/// Decodes a hello: (target token, initiator token, RNR budget in µs).
pub fn decode_hello(h: &[u8; HELLO_LEN]) -> Option<(u64, u64, u64)> {
    if h[0..8] != HELLO_MAGIC {
        return None;
    }
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
    Some((u64_at(8), u64_at(16), u64_at(24)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_every_opcode() {
        for (op, len) in [
            (Opcode::Write, 100),
            (Opcode::WriteImm, 0),
            (Opcode::Send, 5),
            (Opcode::SendImm, 7),
            (Opcode::ReadReq, 1 << 20),
            (Opcode::Cas, 8),
            (Opcode::Faa, 8),
            (Opcode::Ack, 0),
            (Opcode::ReadResp, 9),
            (Opcode::AtomicResp, 0),
        ] {
            let mut h = Header::new(op, 42, len);
            h.imm = 7;
            h.addr = u64::MAX;
            h.rkey = 3;
            h.b = 9;
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
        let mut nak = Header::new(Opcode::Nak, 1, 0);
        nak.a = 3;
        assert_eq!(Header::decode(&nak.encode()), Ok(nak));
    }

    #[test]
    fn rejects_malformed_headers() {
        let good = Header::new(Opcode::Write, 1, 10).encode();
        let mut h = good;
        h[0] = b'X';
        assert_eq!(Header::decode(&h), Err(FrameError::BadMagic));
        let mut h = good;
        h[4] = 99;
        assert_eq!(Header::decode(&h), Err(FrameError::BadOpcode(99)));
        let mut h = good;
        h[60] = 1;
        assert_eq!(Header::decode(&h), Err(FrameError::Reserved));
        let h = Header::new(Opcode::Faa, 1, 16).encode();
        assert_eq!(
            Header::decode(&h),
            Err(FrameError::BadLength(Opcode::Faa, 16))
        );
        let h = Header::new(Opcode::Write, 1, MAX_PAYLOAD + 1).encode();
        assert!(Header::decode(&h).is_err());
        let h = Header::new(Opcode::Nak, 1, 0).encode();
        assert_eq!(Header::decode(&h), Err(FrameError::BadStatus(0)));
        let hello = encode_hello(1, 2, 3);
        assert_eq!(decode_hello(&hello), Some((1, 2, 3)));
        assert_eq!(decode_hello(&[0; HELLO_LEN]), None);
    }

    proptest! {
        #[test]
        fn decode_never_panics_and_accepts_only_what_encodes(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let h: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            if let Ok(hdr) = Header::decode(&h) {
                prop_assert_eq!(hdr.encode(), h);
            }
        }
    }
}
