//! The ofi provider's messages: a fixed 80-byte header, then the initiator's buffer
//! descriptors (for the target's RMA), then an inline payload.
//!
//! ```text
//!  0  kind (u8)   1  nsge (u8)   2  flags (u8: 1 = inline payload)   3  reserved
//!  4  dst_qpn (u32)      8  dst_token (u64: the target queue pair's secret)
//! 16  src_qpn (u32)     20  len (u32)      24  seq (u64)
//! 32  addr (u64)        40  rkey (u64)     48  a (u64)       56  b (u64)
//! 64  imm (u32)         68  rnr_us (u32)   72  src_token (u64)
//! 80  nsge × (addr u64, key u64, len u64): the initiator's buffers, as libfabric names them
//!     then the inline payload (len bytes) when flags says so
//! ```
//!
//! `a` and `b` carry the atomics' operands, a NAK's status, an atomic's old value, a pong's
//! readiness. Everything is little-endian.

use crate::model::MAX_SGE;

/// Header length.
pub(super) const HDR: usize = 80;
/// One buffer descriptor.
pub(super) const SGE_LEN: usize = 24;
/// Payloads up to this size travel in the request (or READ response) itself; larger ones are
/// moved by the target with RMA (fi_read from the initiator, fi_write to it).
pub(super) const INLINE_MAX: usize = 8192;
/// The largest message: a receive buffer of the context's pool.
pub(super) const MSG_MAX: usize = HDR + MAX_SGE * SGE_LEN + INLINE_MAX;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    Write = 1,
    WriteImm = 2,
    Send = 3,
    SendImm = 4,
    Read = 5,
    Cas = 6,
    Faa = 7,
    /// Requests up to `seq` executed.
    Ack = 16,
    /// Request `seq` failed with status `a`; later ones are dropped.
    Nak = 17,
    /// READ `seq` done (its data inline, or already written into the initiator's buffers).
    ReadResp = 18,
    /// Atomic `seq` done; `a` is the old value.
    AtomicResp = 19,
    /// Liveness probe.
    Ping = 20,
    /// Answer to a ping; `a` = 1 when the queue pair is connected to the sender and ready.
    Pong = 21,
    /// The sender's queue pair is gone (destroyed or disconnected).
    Bye = 22,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Write,
            2 => WriteImm,
            3 => Send,
            4 => SendImm,
            5 => Read,
            6 => Cas,
            7 => Faa,
            16 => Ack,
            17 => Nak,
            18 => ReadResp,
            19 => AtomicResp,
            20 => Ping,
            21 => Pong,
            22 => Bye,
            _ => return None,
        })
    }

    /// Whether the kind is a request a target executes in sequence.
    pub(super) fn is_request(self) -> bool {
        (self as u8) < 16
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug)]
pub(super) struct Hdr {
    pub kind: Kind,
    pub nsge: u8,
    pub inline: bool,
    pub dst_qpn: u32,
    pub dst_token: u64,
    pub src_qpn: u32,
    pub len: u32,
    pub seq: u64,
    pub addr: u64,
    pub rkey: u64,
    pub a: u64,
    pub b: u64,
    pub imm: u32,
    pub rnr_us: u32,
    pub src_token: u64,
}

/// A buffer of the initiator, as the target's RMA names it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rsge {
    pub addr: u64,
    pub key: u64,
    pub len: u64,
}

/// A received message.
pub(super) struct Msg {
    pub h: Hdr,
    pub sges: Vec<Rsge>,
    pub payload: Vec<u8>,
}

impl Hdr {
    /// A header of `kind` with everything else zero.
    pub(super) fn new(kind: Kind) -> Hdr {
        Hdr {
            kind,
            nsge: 0,
            inline: false,
            dst_qpn: 0,
            dst_token: 0,
            src_qpn: 0,
            len: 0,
            seq: 0,
            addr: 0,
            rkey: 0,
            a: 0,
            b: 0,
            imm: 0,
            rnr_us: 0,
            src_token: 0,
        }
    }

    /// Appends the encoded header to `out`.
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.kind as u8);
        out.push(self.nsge);
        out.push(self.inline as u8);
        out.push(0);
        out.extend_from_slice(&self.dst_qpn.to_le_bytes());
        out.extend_from_slice(&self.dst_token.to_le_bytes());
        out.extend_from_slice(&self.src_qpn.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        for v in [self.seq, self.addr, self.rkey, self.a, self.b] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.imm.to_le_bytes());
        out.extend_from_slice(&self.rnr_us.to_le_bytes());
        out.extend_from_slice(&self.src_token.to_le_bytes());
    }
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(w)
}

/// Decodes a message; `None` when it is malformed.
pub(super) fn decode(b: &[u8]) -> Option<Msg> {
    if b.len() < HDR {
        return None;
    }
    let h = Hdr {
        kind: Kind::from_u8(b[0])?,
        nsge: b[1],
        inline: b[2] & 1 != 0,
        dst_qpn: u32_at(b, 4),
        dst_token: u64_at(b, 8),
        src_qpn: u32_at(b, 16),
        len: u32_at(b, 20),
        seq: u64_at(b, 24),
        addr: u64_at(b, 32),
        rkey: u64_at(b, 40),
        a: u64_at(b, 48),
        b: u64_at(b, 56),
        imm: u32_at(b, 64),
        rnr_us: u32_at(b, 68),
        src_token: u64_at(b, 72),
    };
    let n = h.nsge as usize;
    if n > MAX_SGE || b.len() < HDR + n * SGE_LEN {
        return None;
    }
    let sges = (0..n)
        .map(|i| {
            let o = HDR + i * SGE_LEN;
            Rsge {
                addr: u64_at(b, o),
                key: u64_at(b, o + 8),
                len: u64_at(b, o + 16),
            }
        })
        .collect();
    let rest = &b[HDR + n * SGE_LEN..];
    let payload = if h.inline {
        if rest.len() != h.len as usize {
            return None;
        }
        rest.to_vec()
    } else {
        Vec::new()
    };
    Some(Msg { h, sges, payload })
}
