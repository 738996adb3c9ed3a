//! The tcp provider's wire format: a fixed 64-byte header, then the payload (if the opcode has one).
//!
//! ```text
//!  0  magic "OXT2"     4  opcode   5  flags        6  reserved (0)
//!  8  seq (u64)       16  len (u32)  20  imm (u32)
//! 24  remote addr    32  rkey      40  a (compare / add / old value / status)
//! 48  b (swap)       56  ack (u64)
//! ```
//!
//! Flags: [`ACK_REQ`] (the target acknowledges the request once it is executed; without it the
//! target acknowledges only every [`ACK_EVERY`] requests, cumulatively), [`PART`] (one part of a
//! WRITE, or of a READ's data, striped across the queue pair's connections: `a` holds the part's
//! index (bits 0-7), the number of parts (bits 8-15) and the whole request's length (bits
//! 16-47), `b` the request's address (at the target), `addr` and `len` this part's; see
//! [`Part`]). Every other bit is reserved (0).
//!
//! `ack`, on any frame: every request of the receiver's up to this one is done (a cumulative
//! ACK riding on traffic that goes the other way anyway; 0: none). A READ or atomic among them
//! still completes only once its data has arrived.
//!
//! All integers are little endian. [`Header::decode`] is a pure function: it accepts exactly the
//! headers this module encodes and rejects everything else with a [`FrameError`] (fuzzed by
//! `fuzz/fuzz_targets/tcp_frame.rs`).

use std::fmt;

/// Size of every header.
pub const HEADER_LEN: usize = 64;
const MAGIC: [u8; 4] = *b"OXT2";
/// Flag: acknowledge this request once it is executed (the initiator asked for a completion).
pub const ACK_REQ: u8 = 1;
/// Flag: one part of a striped WRITE or WRITE_WITH_IMM ([`Part`]).
pub const PART: u8 = 2;
/// The most parts a striped request has (and connections a queue pair has).
pub const MAX_PARTS: u64 = 16;
/// A target acknowledges at least every this many requests, asked or not, so that the
/// initiator's record of requests in flight stays bounded.
pub const ACK_EVERY: u64 = 64;
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
    /// Initiator to target: acknowledge every request up to `seq` once it is executed, asked
    /// or not (a request that failed locally waits for the completions before it).
    AckReq = 20,
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
            20 => AckReq,
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
    /// [`ACK_REQ`] and [`PART`].
    pub flags: u8,
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
    /// A cumulative ACK of the receiver's requests (0: none).
    pub ack: u64,
}

/// Where a part of a striped WRITE belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// Which part (`0..count`).
    pub index: u32,
    /// How many parts the request has.
    pub count: u32,
    /// The request's length.
    pub total: u32,
    /// The request's address.
    pub base: u64,
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
    /// Flags the opcode cannot have, or a part index and count that do not fit.
    BadFlags(u8),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic => write!(f, "bad magic (not an oxccl tcp frame)"),
            FrameError::BadOpcode(o) => write!(f, "unknown opcode {o}"),
            FrameError::Reserved => write!(f, "reserved header bytes are not zero"),
            FrameError::BadLength(op, l) => write!(f, "length {l} is invalid for {op:?}"),
            FrameError::BadStatus(s) => write!(f, "NAK with invalid status {s}"),
            FrameError::BadFlags(x) => write!(f, "flags {x:#x} are invalid for this frame"),
        }
    }
}

impl Header {
    /// A header with every operand zero.
    pub fn new(opcode: Opcode, seq: u64, len: u32) -> Header {
        Header {
            opcode,
            flags: 0,
            seq,
            len,
            imm: 0,
            addr: 0,
            rkey: 0,
            a: 0,
            b: 0,
            ack: 0,
        }
    }

    /// The bytes on the wire.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = self.opcode as u8;
        h[5] = self.flags;
        h[8..16].copy_from_slice(&self.seq.to_le_bytes());
        h[16..20].copy_from_slice(&self.len.to_le_bytes());
        h[20..24].copy_from_slice(&self.imm.to_le_bytes());
        h[24..32].copy_from_slice(&self.addr.to_le_bytes());
        h[32..40].copy_from_slice(&self.rkey.to_le_bytes());
        h[40..48].copy_from_slice(&self.a.to_le_bytes());
        h[48..56].copy_from_slice(&self.b.to_le_bytes());
        h[56..64].copy_from_slice(&self.ack.to_le_bytes());
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
        if h[6] != 0 || h[7] != 0 {
            return Err(FrameError::Reserved);
        }
        let hdr = Header {
            opcode,
            flags: h[5],
            seq: u64_at(8),
            len: u32_at(16),
            imm: u32_at(20),
            addr: u64_at(24),
            rkey: u64_at(32),
            a: u64_at(40),
            b: u64_at(48),
            ack: u64_at(56),
        };
        let len_ok = match opcode {
            Opcode::Cas | Opcode::Faa => hdr.len == 8,
            Opcode::Ack | Opcode::Nak | Opcode::AtomicResp | Opcode::AckReq => hdr.len == 0,
            _ => hdr.len <= MAX_PAYLOAD,
        };
        if !len_ok {
            return Err(FrameError::BadLength(opcode, hdr.len));
        }
        if opcode == Opcode::Nak && !(1..=8).contains(&hdr.a) {
            return Err(FrameError::BadStatus(hdr.a));
        }
        let flags_ok = match hdr.flags {
            0 => true,
            ACK_REQ => opcode.is_request(),
            // READ data striped over the connections is a part too (never asks for an ACK).
            PART => {
                matches!(opcode, Opcode::Write | Opcode::WriteImm | Opcode::ReadResp)
                    && hdr.part().is_some()
            }
            3 => matches!(opcode, Opcode::Write | Opcode::WriteImm) && hdr.part().is_some(),
            _ => false,
        };
        if !flags_ok {
            return Err(FrameError::BadFlags(hdr.flags));
        }
        Ok(hdr)
    }

    /// The part a [`PART`] frame is, if its fields make one: index below count, count in
    /// `2..=MAX_PARTS`, total at most [`MAX_PAYLOAD`], and the part inside the request.
    pub fn part(&self) -> Option<Part> {
        let p = Part {
            index: (self.a & 0xff) as u32,
            count: ((self.a >> 8) & 0xff) as u32,
            total: (self.a >> 16) as u32,
            base: self.b,
        };
        let end = p.base.checked_add(p.total as u64)?;
        let ok = self.a >> 48 == 0
            && (2..=MAX_PARTS as u32).contains(&p.count)
            && p.index < p.count
            && p.total <= MAX_PAYLOAD
            && self.addr >= p.base
            && self.addr.checked_add(self.len as u64)? <= end;
        ok.then_some(p)
    }

    /// Makes this header part `index` of `count` of a request of `total` bytes at `base`.
    pub fn set_part(&mut self, p: Part) {
        self.flags |= PART;
        self.a = p.index as u64 | (p.count as u64) << 8 | (p.total as u64) << 16;
        self.b = p.base;
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

/// The first message on a new connection: which queue pair it is for, proven by its secret
/// token, which of the queue pair's connections it is, and, on a sealed queue pair, the
/// initiator's fresh nonce.
pub const HELLO_LEN: usize = 80;
const HELLO_MAGIC: [u8; 8] = *b"OXTHELO3";
/// Hello and reply flag: the connection is sealed (the nonce field holds a nonce).
const SEALED: u32 = 1;
/// Bytes of a fresh per-connection nonce (`oxccl_seal::NONCE_LEN`).
pub const NONCE_LEN: usize = 32;

/// A decoded hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The token of the queue pair the connection is for.
    pub target: u64,
    /// The token of the queue pair that connects.
    pub initiator: u64,
    /// The initiator's RNR budget in µs (how long the target may hold its SEND waiting for a
    /// receive; 0 = forever).
    pub rnr_us: u64,
    /// Which of the queue pair's connections this is (`0..count`).
    pub index: u32,
    /// How many connections the queue pair has (`1..=MAX_PARTS`).
    pub count: u32,
    /// The initiator's fresh nonce when it wants the connection sealed; `None`: plain.
    pub nonce: Option<[u8; NONCE_LEN]>,
}

/// Encodes a hello.
pub fn encode_hello(h: &Hello) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..8].copy_from_slice(&HELLO_MAGIC);
    b[8..16].copy_from_slice(&h.target.to_le_bytes());
    b[16..24].copy_from_slice(&h.initiator.to_le_bytes());
    b[24..32].copy_from_slice(&h.rnr_us.to_le_bytes());
    b[32..36].copy_from_slice(&h.index.to_le_bytes());
    b[36..40].copy_from_slice(&h.count.to_le_bytes());
    if let Some(n) = &h.nonce {
        b[40..44].copy_from_slice(&SEALED.to_le_bytes());
        b[48..80].copy_from_slice(n);
    }
    b
}

/// Decodes a hello; `None` for anything [`encode_hello`] does not make.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Option<Hello> {
    if b[0..8] != HELLO_MAGIC {
        return None;
    }
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
    let nonce = decode_nonce(u32_at(40), u32_at(44), &b[48..80])?;
    let h = Hello {
        target: u64_at(8),
        initiator: u64_at(16),
        rnr_us: u64_at(24),
        index: u32_at(32),
        count: u32_at(36),
        nonce,
    };
    ((1..=MAX_PARTS as u32).contains(&h.count) && h.index < h.count).then_some(h)
}

/// The nonce field of a hello or reply: `Some(None)` plain (flags 0, the field zero),
/// `Some(Some(nonce))` sealed, `None` malformed.
fn decode_nonce(flags: u32, reserved: u32, field: &[u8]) -> Option<Option<[u8; NONCE_LEN]>> {
    let nonce: [u8; NONCE_LEN] = field.try_into().ok()?;
    match (flags, reserved) {
        (0, 0) if nonce == [0; NONCE_LEN] => Some(None),
        (SEALED, 0) => Some(Some(nonce)),
        _ => None,
    }
}

/// The acceptor's answer to a hello.
pub const REPLY_LEN: usize = 56;

/// What the acceptor answers: whether it takes the connection, its RNR budget, and, on a
/// sealed connection, its fresh nonce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    /// [`Verdict`] of the acceptor.
    pub verdict: Verdict,
    /// The acceptor's RNR budget in µs.
    pub rnr_us: u64,
    /// The acceptor's fresh nonce on a sealed connection.
    pub nonce: Option<[u8; NONCE_LEN]>,
}

/// Whether the acceptor takes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Verdict {
    /// Refused: the queue pair is gone, or not connecting to this peer.
    Refused = 0,
    /// Accepted.
    Accepted = 1,
    /// Refused: the acceptor's queue pair is sealed and the hello is plain.
    WantsSealed = 2,
    /// Refused: the acceptor's queue pair is plain and the hello is sealed.
    WantsPlain = 3,
}

/// Encodes a reply.
pub fn encode_reply(r: &Reply) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[0..8].copy_from_slice(&(r.verdict as u64).to_le_bytes());
    b[8..16].copy_from_slice(&r.rnr_us.to_le_bytes());
    if let Some(n) = &r.nonce {
        b[16..20].copy_from_slice(&SEALED.to_le_bytes());
        b[24..56].copy_from_slice(n);
    }
    b
}

/// Decodes a reply; `None` for anything [`encode_reply`] does not make.
pub fn decode_reply(b: &[u8; REPLY_LEN]) -> Option<Reply> {
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
    let verdict = match u64::from_le_bytes(b[0..8].try_into().unwrap_or([0xff; 8])) {
        0 => Verdict::Refused,
        1 => Verdict::Accepted,
        2 => Verdict::WantsSealed,
        3 => Verdict::WantsPlain,
        _ => return None,
    };
    Some(Reply {
        verdict,
        rnr_us: u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])),
        nonce: decode_nonce(u32_at(16), u32_at(20), &b[24..56])?,
    })
}

/// The plaintext of each side's first record on a sealed connection (key confirmation: a peer
/// with another job key, or a hello altered on the path, fails it at connect).
pub const FINISHED: &[u8] = b"oxccl tcp qp v1 finished";

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
            (Opcode::AckReq, 0),
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
        h[7] = 1;
        assert_eq!(Header::decode(&h), Err(FrameError::Reserved));
        let mut h = good;
        h[5] = 4;
        assert_eq!(Header::decode(&h), Err(FrameError::BadFlags(4)));
        let h = Header::new(Opcode::Faa, 1, 16).encode();
        assert_eq!(
            Header::decode(&h),
            Err(FrameError::BadLength(Opcode::Faa, 16))
        );
        let h = Header::new(Opcode::Write, 1, MAX_PAYLOAD + 1).encode();
        assert!(Header::decode(&h).is_err());
        let h = Header::new(Opcode::Nak, 1, 0).encode();
        assert_eq!(Header::decode(&h), Err(FrameError::BadStatus(0)));
        let hello = Hello {
            target: 1,
            initiator: 2,
            rnr_us: 3,
            index: 1,
            count: 4,
            nonce: None,
        };
        assert_eq!(decode_hello(&encode_hello(&hello)), Some(hello));
        let sealed = Hello {
            nonce: Some([7; NONCE_LEN]),
            ..hello
        };
        assert_eq!(decode_hello(&encode_hello(&sealed)), Some(sealed));
        // A plain hello with a nonce, or unknown flags, is malformed.
        let mut b = encode_hello(&hello);
        b[50] = 1;
        assert_eq!(decode_hello(&b), None);
        let mut b = encode_hello(&sealed);
        b[40] = 2;
        assert_eq!(decode_hello(&b), None);
        for r in [
            Reply {
                verdict: Verdict::Accepted,
                rnr_us: 9,
                nonce: Some([3; NONCE_LEN]),
            },
            Reply {
                verdict: Verdict::WantsPlain,
                rnr_us: 0,
                nonce: None,
            },
        ] {
            assert_eq!(decode_reply(&encode_reply(&r)), Some(r));
        }
        let mut b = encode_reply(&Reply {
            verdict: Verdict::Refused,
            rnr_us: 0,
            nonce: None,
        });
        b[0] = 9;
        assert_eq!(decode_reply(&b), None);
        assert_eq!(decode_hello(&[0; HELLO_LEN]), None);
        let bad = Hello { index: 4, ..hello };
        assert_eq!(decode_hello(&encode_hello(&bad)), None);
        let mut part = Header::new(Opcode::Write, 1, 10);
        part.flags = ACK_REQ;
        part.addr = 1010;
        let p = Part {
            index: 1,
            count: 4,
            total: 40,
            base: 1000,
        };
        part.set_part(p);
        assert_eq!(Header::decode(&part.encode()), Ok(part));
        assert_eq!(part.part(), Some(p));
        part.set_part(Part { index: 4, ..p });
        assert_eq!(Header::decode(&part.encode()), Err(FrameError::BadFlags(3)));
        part.set_part(Part { total: 15, ..p });
        assert_eq!(Header::decode(&part.encode()), Err(FrameError::BadFlags(3)));
        // READ data may be a part, but never asks for an ACK.
        let mut data = Header::new(Opcode::ReadResp, 1, 10);
        data.addr = 1010;
        data.set_part(p);
        assert_eq!(Header::decode(&data.encode()), Ok(data));
        data.flags |= ACK_REQ;
        assert_eq!(Header::decode(&data.encode()), Err(FrameError::BadFlags(3)));
        let mut ack = Header::new(Opcode::Ack, 1, 0);
        ack.flags = ACK_REQ;
        assert_eq!(Header::decode(&ack.encode()), Err(FrameError::BadFlags(1)));
    }

    proptest! {
        #[test]
        fn decode_never_panics_and_accepts_only_what_encodes(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let h: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            if let Ok(hdr) = Header::decode(&h) {
                prop_assert_eq!(hdr.encode(), h);
            }
        }

        #[test]
        fn hello_and_reply_decode_only_what_encodes(bytes in proptest::collection::vec(any::<u8>(), HELLO_LEN), sealed in any::<bool>()) {
            let mut b: [u8; HELLO_LEN] = bytes.try_into().unwrap();
            b[0..8].copy_from_slice(&HELLO_MAGIC);
            if !sealed {
                b[40..48].fill(0);
            }
            if let Some(h) = decode_hello(&b) {
                prop_assert_eq!(encode_hello(&h), b);
            }
            let r: [u8; REPLY_LEN] = b[..REPLY_LEN].try_into().unwrap();
            if let Some(x) = decode_reply(&r) {
                prop_assert_eq!(encode_reply(&x), r);
            }
        }
    }
}
