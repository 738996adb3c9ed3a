//! What travels: the fragment header with the call's fingerprint, the immediates, and where
//! slots, credit words and mailboxes lie in a peer's receive region.

use crate::schedule::CollectiveKind;
use crate::{DataType, ReduceOp};

use super::OpDesc;

/// Bytes of the header in front of every fragment.
pub const SLOT_HEADER: usize = 64;
/// The largest mailbox message's data.
pub const MAILBOX_DATA: usize = 64 << 10;
/// Bytes of one mailbox: the first line, the data of a block message and its stamp (see
/// [`mailbox`]).
pub const MAILBOX: usize = mailbox::LINE + MAILBOX_DATA + mailbox::LINE;
/// Fragments up to this many bytes are copied beside their header in the sender's staging
/// region (no registration, no completion awaited): a header and its data fill 16 KiB. Above
/// it a fragment waits for its completion, which over tcp is the target's ACK: a round trip
/// that doubled the time of a 2-rank 4-8 KiB all-reduce when this was 4 KiB (25-31 µs against
/// 14-17 µs; the extra copy costs well under a microsecond).
pub const INLINE: usize = 16384 - SLOT_HEADER;
/// Bytes of one staging entry (a header and inline data) per slot.
pub const STAGE: usize = SLOT_HEADER + INLINE;
/// The first word of every header.
pub const MAGIC: u32 = 0x0CC1_C0DE;

/// What an immediate value says, as 2 bits of kind, 6 of channel and 24 of value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// A fragment arrived in `slot` of `channel`.
    Data {
        /// The channel.
        channel: usize,
        /// The slot.
        slot: u32,
    },
    /// The receiver wrote its consumed count for `channel` into our credit word.
    Credit {
        /// The channel.
        channel: usize,
    },
    /// The peer reports a failure, an abort or a dump request ([`Notice`]).
    Notice(Notice),
    /// The peer found that data of call `seq` (modulo 2^24) did not match its own call.
    Mismatch {
        /// The call's sequence number modulo 2^24.
        seq: u32,
    },
    /// The peer's next mailbox message has landed whole (a link without a mapping: the
    /// message is written with one WRITE_WITH_IMM, and this completion is what says it is all
    /// there; see [`mailbox`]).
    Mailbox,
}

/// A peer's notice ([`Imm::Notice`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The communicator was aborted by its user.
    Aborted,
    /// "Dump your flight recorder" (the peer timed out); aborts nothing.
    DumpRequest,
    /// Rank `n` failed (the sender itself, when its own call failed).
    Failed(usize),
}

const KIND_DATA: u32 = 0;
const KIND_CREDIT: u32 = 1;
const KIND_NOTICE: u32 = 2;
const KIND_MISMATCH: u32 = 3;
/// The channel field of [`Imm::Mailbox`] (a data immediate on a channel no link has: at most
/// 16).
const MAILBOX_CHANNEL: usize = 0x3f;
const ABORTED_BY_USER: u32 = 0xff_ffff;
const DUMP_REQUEST: u32 = 0xff_fffe;

impl Imm {
    /// The 32-bit immediate.
    pub fn encode(self) -> u32 {
        let pack = |kind: u32, channel: usize, value: u32| {
            kind << 30 | (channel as u32 & 0x3f) << 24 | (value & 0xff_ffff)
        };
        match self {
            Imm::Data { channel, slot } => pack(KIND_DATA, channel, slot),
            Imm::Credit { channel } => pack(KIND_CREDIT, channel, 0),
            Imm::Notice(Notice::Aborted) => pack(KIND_NOTICE, 0, ABORTED_BY_USER),
            Imm::Notice(Notice::DumpRequest) => pack(KIND_NOTICE, 0, DUMP_REQUEST),
            Imm::Notice(Notice::Failed(r)) => pack(KIND_NOTICE, 0, r as u32),
            Imm::Mismatch { seq } => pack(KIND_MISMATCH, 0, seq),
            Imm::Mailbox => pack(KIND_DATA, MAILBOX_CHANNEL, 0),
        }
    }

    /// Reads an immediate.
    pub fn decode(v: u32) -> Imm {
        let channel = ((v >> 24) & 0x3f) as usize;
        let value = v & 0xff_ffff;
        match v >> 30 {
            KIND_DATA if channel == MAILBOX_CHANNEL => Imm::Mailbox,
            KIND_DATA => Imm::Data {
                channel,
                slot: value,
            },
            KIND_CREDIT => Imm::Credit { channel },
            KIND_NOTICE => Imm::Notice(match value {
                ABORTED_BY_USER => Notice::Aborted,
                DUMP_REQUEST => Notice::DumpRequest,
                r => Notice::Failed(r as usize),
            }),
            _ => Imm::Mismatch { seq: value },
        }
    }
}

/// How a mailbox message lies in the receiver's mailbox, which the sender writes with its own
/// stores where the receive region is mapped into the sender (`QueuePair::map_remote`, shm):
/// no request, no completion, and no stamp of its own for a small message. Where it is not
/// (tcp, ofi), the sender composes the same bytes in its staging region
/// ([`Geometry::stage_mailbox`]) and writes them with one WRITE_WITH_IMM ([`Imm::Mailbox`]);
/// the receiver takes the message once that completion has come (a provider's copy into
/// memory promises no order of its bytes), and reads it as it would a stored one: one frame
/// each way per peer and call, no slot, no credit.
///
/// The first 64-byte line holds a flag, the message's short header
/// ([`Header::encode_short`]: the call's fingerprint and the message's length) and the first
/// [`FIRST_DATA`](mailbox::FIRST_DATA) bytes of data: a message that fits is one line, written
/// with one flag, as NCCL's LL protocol writes its lines. The data of a larger message goes on
/// from there, contiguous, and is followed by one more flag, its stamp
/// ([`stamp_offset`](mailbox::stamp_offset)), in the line of its last bytes. The sender stores
/// the header and the data, then each flag with a release store; a receiver that reads a flag
/// with an acquire load reads everything stored before it. The receiver looks at both flags:
/// the first says the header can be checked (a sender whose message has another length or
/// belongs to another call is found, not waited for), the stamp that the data is complete. The
/// data is contiguous from [`DATA`](mailbox::DATA), so both ends copy and reduce it whole, in
/// one piece; the lines of a message arrive together rather than one by one (a flag in every
/// line, as LL128, would let a receiver start sooner, but a rank here writes its whole message
/// before it reads its peer's).
///
/// A flag's value is the message's number on its link, plus one (messages to a peer are
/// counted from 0, and alternate between two mailboxes): a line left from an earlier message
/// never carries the awaited value.
pub mod mailbox {
    /// Bytes of a line.
    pub const LINE: usize = 64;
    /// Where the first line's flag lies.
    pub const FLAG: usize = 0;
    /// Where the short header lies.
    pub const HEADER: usize = 8;
    /// Bytes of the short header.
    pub const SHORT_HEADER: usize = 40;
    /// Where the data starts.
    pub const DATA: usize = HEADER + SHORT_HEADER;
    /// Data bytes that fit the first line.
    pub const FIRST_DATA: usize = LINE - DATA;

    /// Whether a message of `total` bytes has a stamp (it does not fit in the first line).
    pub fn has_stamp(total: usize) -> bool {
        total > FIRST_DATA
    }

    /// Where the stamp of a message of `total` bytes lies: the first 8-byte word after its
    /// data.
    pub fn stamp_offset(total: usize) -> usize {
        DATA + total.next_multiple_of(8)
    }

    /// Bytes of the mailbox a message of `total` bytes uses.
    pub fn used(total: usize) -> usize {
        if has_stamp(total) {
            stamp_offset(total) + 8
        } else {
            LINE
        }
    }
}

/// Bytes of an announcement in the receive region.
pub const ANNOUNCE: usize = 64;

/// Announcements per channel: a receiver announces up to this many receives ahead of the
/// one it is in, so that a sender running ahead by its window of slots still finds where its
/// fragments go (a queue's announcement number `k` uses record `k % ANNOUNCE_RING`; the
/// sender looks for the record that names its fragment).
pub const ANNOUNCE_RING: usize = 16;

/// Receives of at least this many bytes are announced ([`Announce`]): below, the write of the
/// announcement and a fragment's header are a large part of what moves.
pub const PLACE_MIN: usize = 64 << 10;

/// Where record `i` of channel `ch`'s announcement ring lies in a region whose rings start
/// at the first record boundary from byte `start`.
fn announce_at(start: usize, ch: usize, i: usize) -> usize {
    start.next_multiple_of(ANNOUNCE) + (ch * ANNOUNCE_RING + i) * ANNOUNCE
}

/// A receiver's announcement: a coming receive on a channel may be written in place, straight
/// into its destination, rather than through the slots. The receiver writes it into the
/// sender's receive region ([`Geometry::announce_offset`], a ring of [`ANNOUNCE_RING`] records
/// per channel) once the receive's dependencies are done (nothing else touches the destination
/// from then on), up to that many receives ahead; the sender reads the ring from its own
/// memory when it posts a fragment, and uses the record that names that fragment.
///
/// Fragments are numbered over a queue's life at both ends ([`crate::protocol::Flow`]), so
/// the receiver names exactly the fragments of that receive (`first .. first + frags`): an
/// announcement left from an earlier receive names no later fragment. A fragment written in
/// place still sends its header through its slot (with [`Header::placed`] set, and no data),
/// after its data on the same connection: the slots, credits and the order of consumption are
/// those of every fragment, and a sender that has not seen the announcement yet (or does not
/// use it) sends through the slot as always. The checksum makes a record read while it is being
/// rewritten unusable, not wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Announce {
    /// The queue-life number of the receive's first fragment.
    pub first: u64,
    /// Its fragments.
    pub frags: u64,
    /// Bytes of the whole transfer.
    pub total: u64,
    /// Where its first byte goes, in the receiver's address space.
    pub addr: u64,
    /// The remote key of the registered memory it lies in.
    pub rkey: u64,
}

impl Announce {
    /// The record's bytes (`out[..48]`), with a checksum.
    pub fn encode(&self, out: &mut [u8]) {
        let words = [self.first, self.frags, self.total, self.addr, self.rkey];
        for (i, w) in words.iter().enumerate() {
            out[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        let sum = announce_sum(&words);
        out[40..48].copy_from_slice(&sum.to_le_bytes());
    }

    /// Reads a record (`None` when its checksum does not match: torn, damaged or never
    /// written).
    pub fn decode(b: &[u8]) -> Option<Announce> {
        let word = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        let words = [word(0), word(1), word(2), word(3), word(4)];
        (word(5) == announce_sum(&words) && words[1] > 0).then_some(Announce {
            first: words[0],
            frags: words[1],
            total: words[2],
            addr: words[3],
            rkey: words[4],
        })
    }

    /// Where fragment `number` of a transfer of `total` bytes at byte `off` goes, if this
    /// announcement names it (and the transfer has the length announced).
    pub fn place(&self, number: u64, total: usize, off: usize) -> Option<u64> {
        let named = number >= self.first && number - self.first < self.frags;
        (named && self.total == total as u64).then(|| self.addr + off as u64)
    }
}

fn announce_sum(w: &[u64; 5]) -> u64 {
    let mut h = 0x2545_F491_4F6C_DD1Du64;
    for &x in w {
        h = (h ^ x).wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(31);
    }
    (h ^ (h >> 29)).wrapping_mul(0x94D0_49BB_1331_11EB) ^ 0x0CC1
}

/// Slot geometry, the same on every rank (checked at init).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Geometry {
    /// Data bytes per slot.
    pub slot_data: usize,
    /// Slots per (peer, channel).
    pub slots: usize,
    /// Channels.
    pub channels: usize,
}

impl Geometry {
    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        SLOT_HEADER + self.slot_data
    }
    /// Bytes of the receive region for one peer: slots, one credit word per channel, then
    /// two mailboxes.
    pub fn recv_region(&self) -> usize {
        self.mailbox_offset(2)
    }
    /// Where slot `slot` of channel `ch` starts in the receive region.
    pub fn slot_offset(&self, ch: usize, slot: usize) -> usize {
        (ch * self.slots + slot) * self.slot_bytes()
    }
    /// Where record `i` of channel `ch`'s announcements ([`Announce`]) lies in the receive
    /// region: the peer writes there where our data for that channel may go in place.
    pub fn announce_offset(&self, ch: usize, i: usize) -> usize {
        announce_at(
            self.channels * self.slots * self.slot_bytes() + 8 * self.channels,
            ch,
            i,
        )
    }
    /// Where mailbox `parity` starts in the receive region (on a line: a mailbox's lines are
    /// cache lines).
    pub fn mailbox_offset(&self, parity: usize) -> usize {
        self.announce_offset(self.channels, 0) + parity * MAILBOX
    }
    /// Where channel `ch`'s credit word lies in the receive region.
    pub fn credit_offset(&self, ch: usize) -> usize {
        self.channels * self.slots * self.slot_bytes() + 8 * ch
    }
    /// Where slot `slot` of channel `ch`'s staging entry starts in the staging region.
    pub fn stage_offset(&self, ch: usize, slot: usize) -> usize {
        (ch * self.slots + slot) * STAGE
    }
    /// Where channel `ch`'s credit source word lies in the staging region.
    pub fn stage_credit(&self, ch: usize) -> usize {
        self.channels * self.slots * STAGE + 8 * ch
    }
    /// Where record `i` of channel `ch`'s announcements is composed in the staging region (the
    /// source of the write that carries it; a ring as in the receive region, so that a record
    /// still being sent is not rewritten by the next).
    pub fn stage_announce(&self, ch: usize, i: usize) -> usize {
        announce_at(
            self.channels * self.slots * STAGE + 8 * self.channels,
            ch,
            i,
        )
    }
    /// Where the image of a mailbox message of parity `parity` (0 or 1: messages to a peer
    /// alternate) is composed in the staging region, on a link whose mailboxes are written
    /// rather than stored into (no mapping): the source of the one write that carries it.
    pub fn stage_mailbox(&self, parity: usize) -> usize {
        self.stage_announce(self.channels, 0) + parity * MAILBOX
    }
    /// Bytes of the staging region: headers and inline data per slot, credit source words,
    /// the announcement rings, then two mailbox images.
    pub fn stage_region(&self) -> usize {
        self.stage_mailbox(2)
    }
    /// Receive work requests kept posted per queue pair.
    pub fn recv_depth(&self) -> u32 {
        (2 * self.channels * self.slots + 16) as u32
    }
    /// Send work requests per queue pair.
    pub fn send_depth(&self) -> u32 {
        (4 * self.channels * self.slots + 16) as u32
    }
    /// The protocol configuration of a call on elements of `esize` bytes.
    pub fn config(&self, esize: usize) -> super::Config {
        let mut c = super::Config::new(self.channels, self.slots, self.slot_data, esize);
        c.inline_max = INLINE;
        c
    }
}

/// The fragment header, little-endian at the start of each slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: u32,
    /// The collective's wire code ([`CollectiveKind::code`]).
    pub coll: u8,
    /// The data type's index in [`DataType::ALL`].
    pub dtype: u8,
    /// The operator's index in [`ReduceOp::ALL`].
    pub op: u8,
    /// Whether `root` is meaningful.
    pub has_root: u8,
    /// The call's sequence number.
    pub seq: u64,
    /// The call's element count (0 for all_to_allv).
    pub count: u64,
    /// The root rank.
    pub root: u32,
    /// The sending rank.
    pub sender: u32,
    /// Bytes of the whole transfer.
    pub xfer_len: u64,
    /// Where this fragment lies in it.
    pub frag_off: u64,
    /// Bytes of this fragment.
    pub frag_len: u32,
    /// Where the sender wrote this fragment's data at the receiver, when it wrote it in place
    /// (into the destination the receiver announced: [`Announce`]); 0 when the data follows
    /// the header in the slot.
    pub placed: u64,
    /// Set by `decode` when the checksum does not match (never sent).
    pub damaged: bool,
}

/// A checksum of a header's fields (its first 52 bytes and the placed address at 56), so that
/// a damaged header is reported as such, not misread: a multiply-rotate hash over 8-byte words
/// (every input bit reaches the result; a few ns, where a byte-wise FNV took about 70).
fn header_sum(b: &[u8]) -> u32 {
    let word = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for o in (0..48).step_by(8).chain([56]) {
        h = (h ^ word(o))
            .wrapping_mul(0xBF58_476D_1CE4_E5B9)
            .rotate_left(29);
    }
    h ^= u64::from(u32::from_le_bytes(b[48..52].try_into().unwrap()));
    h = (h ^ (h >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (h ^ (h >> 32)) as u32
}

/// The short header's checksum: its four 8-byte words ([`Header::short_words`]), mixed as
/// [`header_sum`] mixes a header's; the magic number stands in for the word a mailbox does not
/// carry, so that a line of zeros or of another layout does not pass. (On words, not bytes:
/// the header is built, summed and stored in registers, never stored bytewise and read back
/// wider, which stalls the store-to-load forwarding of every send.)
fn short_sum(w: &[u64; 4]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(MAGIC);
    for &x in w {
        h = (h ^ x).wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(29);
    }
    h = (h ^ (h >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 32)
}

/// The four little-endian words of `b[..32]` (a short header's fields).
fn words_of(b: &[u8]) -> [u64; 4] {
    std::array::from_fn(|i| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap()))
}

/// Why a fragment's header does not fit the call that receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Violation {
    /// The checksum does not match: the header was damaged on the way.
    Damaged,
    /// The fingerprint (collective, type, operator, root, sequence number, count, sender)
    /// differs: the ranks are not in the same call.
    Fingerprint,
    /// The transfer's length or the fragment's offset differs from what the receiver expects.
    Position,
    /// The fragment's length is not the one its offset implies.
    Length,
}

impl Header {
    /// What a sender puts in every fragment of call `desc`, before the fragment's position:
    /// the call's fingerprint, which the receiver compares with its own.
    pub fn expected(desc: &OpDesc, sender: usize) -> Header {
        // A send is received by a recv: both carry "send".
        let coll = if desc.coll == CollectiveKind::Recv {
            CollectiveKind::Send
        } else {
            desc.coll
        };
        let p2p = desc.coll.is_point_to_point();
        Header {
            magic: MAGIC,
            coll: coll.code(),
            dtype: desc.dtype.index(),
            op: desc.op.index(),
            has_root: u8::from(desc.root.is_some() && !p2p),
            seq: desc.seq,
            count: if desc.coll == CollectiveKind::AllToAllV {
                0
            } else {
                desc.count
            },
            root: if p2p {
                0
            } else {
                desc.root.unwrap_or(0) as u32
            },
            sender: sender as u32,
            ..Header::default()
        }
    }

    /// This header, as rank `sender` sends it.
    pub fn from(mut self, sender: usize) -> Header {
        self.sender = sender as u32;
        self
    }

    /// This header, placed at bytes `off..off + len` of a transfer of `total`.
    pub fn at(mut self, total: usize, off: usize, len: usize) -> Header {
        self.xfer_len = total as u64;
        self.frag_off = off as u64;
        self.frag_len = len as u32;
        self
    }

    /// Writes the header (and its checksum) into `out[..SLOT_HEADER]`.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.magic.to_le_bytes());
        out[4] = self.coll;
        out[5] = self.dtype;
        out[6] = self.op;
        out[7] = self.has_root;
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.count.to_le_bytes());
        out[24..28].copy_from_slice(&self.root.to_le_bytes());
        out[28..32].copy_from_slice(&self.sender.to_le_bytes());
        out[32..40].copy_from_slice(&self.xfer_len.to_le_bytes());
        out[40..48].copy_from_slice(&self.frag_off.to_le_bytes());
        out[48..52].copy_from_slice(&self.frag_len.to_le_bytes());
        out[56..64].copy_from_slice(&self.placed.to_le_bytes());
        let sum = header_sum(out);
        out[52..56].copy_from_slice(&sum.to_le_bytes());
    }

    /// Reads a header from `b[..SLOT_HEADER]`; [`Header::damaged`] says whether its checksum
    /// matched.
    pub fn decode(b: &[u8]) -> Header {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        Header {
            magic: u32_at(0),
            coll: b[4],
            dtype: b[5],
            op: b[6],
            has_root: b[7],
            seq: u64_at(8),
            count: u64_at(16),
            root: u32_at(24),
            sender: u32_at(28),
            xfer_len: u64_at(32),
            frag_off: u64_at(40),
            frag_len: u32_at(48),
            placed: u64_at(56),
            damaged: u32_at(52) != header_sum(b),
        }
    }

    /// Writes the short header of a mailbox message ([`mailbox`]): the fingerprint and the
    /// message's length (a message is one fragment: its offset is 0 and its fragment length
    /// the whole), with a checksum, into `out[..SHORT_HEADER]`. The magic number is not
    /// carried: a mailbox holds nothing else.
    #[inline]
    pub fn encode_short(&self, out: &mut [u8]) {
        let w = self.short_words();
        let sum = short_sum(&w);
        for (o, x) in out[..mailbox::SHORT_HEADER]
            .chunks_exact_mut(8)
            .zip(w.into_iter().chain([sum]))
        {
            o.copy_from_slice(&x.to_le_bytes());
        }
    }

    /// The short header's fields, without its checksum, as the four little-endian words it
    /// is stored as: coll, dtype, op, has_root and root (bytes 0-7); sender and length
    /// (8-15); the sequence number (16-23); the count (24-31).
    #[inline]
    pub fn short_words(&self) -> [u64; 4] {
        [
            u64::from(self.coll)
                | u64::from(self.dtype) << 8
                | u64::from(self.op) << 16
                | u64::from(self.has_root) << 24
                | u64::from(self.root) << 32,
            u64::from(self.sender) | u64::from(self.xfer_len as u32) << 32,
            self.seq,
            self.count,
        ]
    }

    /// Whether the short header in `b` says exactly what this one does: a receiver's fast
    /// check (no checksum needed when every field is the one expected; a header that
    /// differs is decoded and checked whole, to say how it differs).
    pub fn short_matches(&self, b: &[u8]) -> bool {
        b.len() >= 32 && self.short_matches_words(&words_of(b))
    }

    /// [`Header::short_matches`] on the header's first four words, as read from the mailbox
    /// ([`Header::short_words`]).
    #[inline]
    pub fn short_matches_words(&self, w: &[u64; 4]) -> bool {
        // (Word by word in registers: a comparison of the arrays as memory would store the
        // expected words and read them back wider, which stalls.)
        let x = self.short_words();
        (0..4).fold(0, |d, i| d | (w[i] ^ x[i])) == 0
    }

    /// Reads a short header ([`Header::encode_short`]) from `b[..SHORT_HEADER]`, as a full
    /// one: magic set, the fragment the whole message, [`Header::damaged`] when the checksum
    /// does not match.
    pub fn decode_short(b: &[u8]) -> Header {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let len = u32_at(12);
        Header {
            magic: MAGIC,
            coll: b[0],
            dtype: b[1],
            op: b[2],
            has_root: b[3],
            root: u32_at(4),
            sender: u32_at(8),
            xfer_len: len.into(),
            seq: u64_at(16),
            count: u64_at(24),
            frag_off: 0,
            frag_len: len,
            placed: 0,
            damaged: u64_at(32) != short_sum(&words_of(b)),
        }
    }

    fn fingerprint(&self) -> (u32, u8, u8, u8, u8, u64, u64, u32, u32) {
        (
            self.magic,
            self.coll,
            self.dtype,
            self.op,
            self.has_root,
            self.seq,
            self.count,
            self.root,
            self.sender,
        )
    }

    /// Checks this (received) header against `want` ([`Header::expected`] for the sender)
    /// and the fragment the protocol expects: bytes `off..off + len` of `total`.
    pub fn check(
        &self,
        want: &Header,
        total: usize,
        off: usize,
        len: usize,
    ) -> Result<(), Violation> {
        if self.damaged {
            return Err(Violation::Damaged);
        }
        if self.fingerprint() != want.fingerprint() {
            return Err(Violation::Fingerprint);
        }
        if self.xfer_len != total as u64 || self.frag_off != off as u64 {
            return Err(Violation::Position);
        }
        if self.frag_len as usize != len {
            return Err(Violation::Length);
        }
        Ok(())
    }

    /// The call this header belongs to, as users read it: `all_reduce #3 (count 10, f32,
    /// sum)`.
    pub fn describe(&self) -> String {
        let dtype = DataType::ALL
            .get(self.dtype as usize)
            .map_or("?".into(), |d| d.to_string());
        let op = ReduceOp::ALL
            .get(self.op as usize)
            .map_or("?".into(), |o| o.to_string());
        let kind = CollectiveKind::from_code(self.coll);
        let name = kind.map_or("unknown", |k| k.name());
        let mut s = format!(
            "{name} #{} (count {}, {dtype}",
            super::seq_text(self.seq),
            self.count
        );
        if kind.is_some_and(|k| k.reduces()) {
            s += &format!(", {op}");
        }
        if self.has_root != 0 {
            s += &format!(", root {}", self.root);
        }
        s + ")"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(coll: CollectiveKind) -> OpDesc {
        OpDesc {
            seq: 7,
            coll,
            count: 1000,
            dtype: DataType::F32,
            op: ReduceOp::Max,
            root: Some(2),
        }
    }

    #[test]
    fn a_header_survives_the_wire_and_damage_is_seen() {
        let h = Header::expected(&desc(CollectiveKind::Broadcast), 3).at(4000, 1024, 512);
        let mut b = [0u8; SLOT_HEADER];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), h);
        assert_eq!(h.describe(), "broadcast #7 (count 1000, float, root 2)");
        // Every bit of the fields is covered by the checksum.
        for bit in (0..52 * 8).chain(56 * 8..64 * 8) {
            let mut d = b;
            d[bit / 8] ^= 1 << (bit % 8);
            assert!(Header::decode(&d).damaged, "bit {bit} flipped unseen");
            assert_eq!(
                Header::decode(&d).check(&h, 4000, 1024, 512),
                Err(Violation::Damaged)
            );
        }
    }

    #[test]
    fn the_receiver_checks_the_fingerprint_then_the_position() {
        let ours = desc(CollectiveKind::AllReduce);
        let want = Header::expected(&ours, 1);
        let sent = want.at(100, 0, 40);
        assert_eq!(sent.check(&want, 100, 0, 40), Ok(()));
        assert_eq!(sent.check(&want, 100, 40, 40), Err(Violation::Position));
        assert_eq!(sent.check(&want, 96, 0, 40), Err(Violation::Position));
        assert_eq!(sent.check(&want, 100, 0, 36), Err(Violation::Length));
        for other in [
            OpDesc { seq: 8, ..ours },
            OpDesc { count: 999, ..ours },
            OpDesc {
                dtype: DataType::F16,
                ..ours
            },
            OpDesc {
                op: ReduceOp::Sum,
                ..ours
            },
            OpDesc {
                root: Some(1),
                ..ours
            },
            OpDesc {
                coll: CollectiveKind::Reduce,
                ..ours
            },
        ] {
            let theirs = Header::expected(&other, 1).at(100, 0, 40);
            assert_eq!(
                theirs.check(&want, 100, 0, 40),
                Err(Violation::Fingerprint),
                "{other}"
            );
        }
        let stranger = Header::expected(&ours, 2).at(100, 0, 40);
        assert_eq!(
            stranger.check(&want, 100, 0, 40),
            Err(Violation::Fingerprint)
        );
        // A recv expects what the matching send carries; all_to_allv leaves counts out.
        let send = OpDesc {
            coll: CollectiveKind::Send,
            root: Some(1),
            ..ours
        };
        let recv = OpDesc {
            coll: CollectiveKind::Recv,
            root: Some(0),
            ..ours
        };
        assert_eq!(Header::expected(&send, 0), Header::expected(&recv, 0));
        let v = |count| OpDesc {
            coll: CollectiveKind::AllToAllV,
            count,
            ..ours
        };
        assert_eq!(Header::expected(&v(3), 0), Header::expected(&v(9), 0));
    }

    #[test]
    fn a_short_header_survives_the_mailbox_and_damage_is_seen() {
        use mailbox::SHORT_HEADER;
        let h = Header::expected(&desc(CollectiveKind::Broadcast), 3).at(4000, 0, 4000);
        let mut b = [0u8; SHORT_HEADER];
        h.encode_short(&mut b);
        assert_eq!(Header::decode_short(&b), h);
        assert_eq!(Header::decode_short(&b).check(&h, 4000, 0, 4000), Ok(()));
        for bit in 0..SHORT_HEADER * 8 {
            let mut d = b;
            d[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(
                Header::decode_short(&d).check(&h, 4000, 0, 4000),
                Err(Violation::Damaged),
                "bit {bit} flipped unseen"
            );
        }
        assert!(h.short_matches(&b));
        for i in 0..32 {
            let mut d = b;
            d[i] ^= 0x10;
            assert!(!h.short_matches(&d), "byte {i} changed unseen");
        }
        // A line of zeros is no header.
        assert!(Header::decode_short(&[0; SHORT_HEADER]).damaged);
        // Another call's header is told apart by its fingerprint, another length by position.
        let other = Header::expected(&desc(CollectiveKind::AllReduce), 3).at(4000, 0, 4000);
        other.encode_short(&mut b);
        assert_eq!(
            Header::decode_short(&b).check(&h, 4000, 0, 4000),
            Err(Violation::Fingerprint)
        );
        h.at(400, 0, 400).encode_short(&mut b);
        assert_eq!(
            Header::decode_short(&b).check(&h, 4000, 0, 4000),
            Err(Violation::Position)
        );
    }

    /// The short header's bytes are where its documentation puts them (written field by field
    /// here, independently of the word packing), and the words a receiver reads compare as the
    /// bytes do.
    #[test]
    fn a_short_header_keeps_its_byte_layout() {
        let mut d = desc(CollectiveKind::Reduce);
        d.root = Some(0x0102_0304);
        d.seq = 0x1122_3344_5566_7788;
        d.count = 0x99AA_BBCC_DDEE_FF00;
        let h = Header::expected(&d, 0x0A0B_0C0D).at(0x4142_4344, 0, 0x4142_4344);
        let mut b = [0u8; mailbox::SHORT_HEADER];
        h.encode_short(&mut b);
        let mut want = [0u8; 32];
        want[0] = CollectiveKind::Reduce.code();
        want[1] = d.dtype.index();
        want[2] = d.op.index();
        want[3] = 1;
        want[4..8].copy_from_slice(&0x0102_0304u32.to_le_bytes());
        want[8..12].copy_from_slice(&0x0A0B_0C0Du32.to_le_bytes());
        want[12..16].copy_from_slice(&0x4142_4344u32.to_le_bytes());
        want[16..24].copy_from_slice(&d.seq.to_le_bytes());
        want[24..32].copy_from_slice(&d.count.to_le_bytes());
        assert_eq!(b[..32], want);
        let words = words_of(&want);
        assert_eq!(h.short_words(), words);
        assert!(h.short_matches_words(&words));
        for i in 0..4 {
            let mut w = words;
            w[i] ^= 1 << 40;
            assert!(!h.short_matches_words(&w), "word {i} changed unseen");
        }
    }

    /// The parts of a message do not overlap the header or the flags, and the largest one fits.
    #[test]
    fn mailbox_messages_fit_and_their_parts_do_not_overlap() {
        use mailbox::*;
        const { assert!(FLAG + 8 <= HEADER && HEADER + SHORT_HEADER == DATA && DATA < LINE) };
        assert!(used(MAILBOX_DATA) <= MAILBOX);
        for total in (0..300).chain([4096, 10_000, MAILBOX_DATA]) {
            if has_stamp(total) {
                let stamp = stamp_offset(total);
                assert!(stamp.is_multiple_of(8) && stamp >= DATA + total);
                assert!(stamp < DATA + total + 8, "{total}: no room wasted");
                assert_eq!(used(total), stamp + 8);
            } else {
                assert!(DATA + total <= LINE);
                assert_eq!(used(total), LINE);
            }
        }
    }

    #[test]
    fn an_announcement_names_its_fragments_and_a_torn_one_is_unusable() {
        let a = Announce {
            first: 40,
            frags: 8,
            total: 8 << 17,
            addr: 0x7f00_0000,
            rkey: 0xdead_beef,
        };
        let mut b = [0u8; ANNOUNCE];
        a.encode(&mut b);
        assert_eq!(Announce::decode(&b), Some(a));
        assert_eq!(Announce::decode(&[0; ANNOUNCE]), None, "never written");
        for bit in 0..48 * 8 {
            let mut d = b;
            d[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(Announce::decode(&d), None, "bit {bit}");
        }
        // Half of one record and half of another (a read while it was rewritten).
        let mut other = [0u8; ANNOUNCE];
        Announce { first: 48, ..a }.encode(&mut other);
        let mut torn = b;
        torn[24..].copy_from_slice(&other[24..]);
        assert_eq!(Announce::decode(&torn), None);
        assert_eq!(a.place(40, 8 << 17, 0), Some(0x7f00_0000));
        assert_eq!(a.place(47, 8 << 17, 7 << 17), Some(0x7f00_0000 + (7 << 17)));
        assert_eq!(a.place(48, 8 << 17, 0), None, "the next receive's");
        assert_eq!(a.place(39, 8 << 17, 0), None, "the previous receive's");
        assert_eq!(a.place(41, 4 << 17, 0), None, "another length");
    }

    #[test]
    fn immediates_round_trip() {
        let all = [
            Imm::Data {
                channel: 0,
                slot: 0,
            },
            Imm::Data {
                channel: 62,
                slot: 0xff_fffd,
            },
            Imm::Mailbox,
            Imm::Credit { channel: 5 },
            Imm::Notice(Notice::Aborted),
            Imm::Notice(Notice::DumpRequest),
            Imm::Notice(Notice::Failed(0)),
            Imm::Notice(Notice::Failed(70_000)),
            Imm::Mismatch { seq: 0xab_cdef },
        ];
        for i in all {
            assert_eq!(Imm::decode(i.encode()), i);
        }
        // Kinds differ in their top two bits, whatever the rest says.
        let kinds: std::collections::HashSet<u32> = all.iter().map(|i| i.encode() >> 30).collect();
        assert_eq!(kinds.len(), 4);
    }

    #[test]
    fn regions_do_not_overlap() {
        let g = Geometry {
            slot_data: 1000,
            slots: 3,
            channels: 2,
        };
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for ch in 0..2 {
            for s in 0..3 {
                spans.push((g.slot_offset(ch, s), g.slot_bytes()));
            }
            spans.push((g.credit_offset(ch), 8));
            for i in 0..ANNOUNCE_RING {
                spans.push((g.announce_offset(ch, i), ANNOUNCE));
            }
        }
        for p in 0..2 {
            spans.push((g.mailbox_offset(p), MAILBOX));
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        let last = spans.last().unwrap();
        assert_eq!(last.0 + last.1, g.recv_region());
        assert!(g.mailbox_offset(0).is_multiple_of(mailbox::LINE));
        let mut stage = Vec::new();
        for ch in 0..2 {
            stage.extend((0..3).map(|s| (g.stage_offset(ch, s), STAGE)));
            stage.push((g.stage_credit(ch), 8));
            for i in 0..ANNOUNCE_RING {
                stage.push((g.stage_announce(ch, i), ANNOUNCE));
            }
        }
        for p in 0..2 {
            stage.push((g.stage_mailbox(p), MAILBOX));
        }
        stage.sort();
        for w in stage.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert_eq!(g.stage_mailbox(1) + MAILBOX, g.stage_region());
        // A mailbox image starts on a line, as the mailbox it is written into.
        assert!(g.stage_mailbox(0).is_multiple_of(mailbox::LINE));
        let c = g.config(4);
        assert_eq!(
            (c.frag_bytes, c.inline_max, c.credit_every),
            (1000, INLINE, 1)
        );
    }
}
