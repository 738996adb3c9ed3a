//! The layout of a queue pair's segment: its state word and its receive ring.
//!
//! Every queue pair owns one shared segment, whatever its provider:
//!
//! ```text
//! header: magic | state | recv CQ index | recv capacity ‖ posted ‖ claimed ‖ doorbell
//! slots:  [recv slot; capacity]  (wr_id, SGEs as (lkey, addr, len), and the completion fields)
//! ```
//!
//! The receive queue is a single-producer ring: the owner posts (writes a slot, then
//! release-stores `posted`). Whoever delivers a SEND or WRITE_WITH_IMM into it claims the next
//! slot with a CAS on `claimed`, fills the buffers and the completion, and release-stores the
//! slot's `done` word: the owner's poll acquires it, so every byte written before is visible (RC
//! ordering). When the owner's queue pair fails it claims the remaining slots itself and completes
//! them as flushed; the CAS makes each slot complete exactly once.
//!
//! Who claims depends on the provider: a shm peer claims in its mapping of this segment; the tcp
//! provider's progress thread claims in the owner's own mapping. The segment is shared memory for
//! the first case; the second does not need it to be.

use std::sync::atomic::Ordering;

use super::segment::Segment;
use crate::model::{WcOpcode, WcStatus};

pub(crate) const QP_MAGIC: u64 = 0x6f78_6363_6c5f_7170; // "oxccl_qp"
// Header words, one cache line per writer so owner and peer do not false-share: line 0 is
// read-mostly (written on state changes), `posted` is written by the owner, `claimed` by whoever
// claims a receive, the doorbell by the peer's WRITEs.
pub(crate) const H_MAGIC: usize = 0;
pub(crate) const H_STATE: usize = 8;
pub(crate) const H_RECV_CQ: usize = 12;
pub(crate) const H_CAP: usize = 16;
pub(crate) const H_POSTED: usize = 64;
pub(crate) const H_CLAIMED: usize = 128;
pub(crate) const H_DOORBELL: usize = 192;
pub(crate) const SLOTS: usize = 256;
pub(crate) const SLOT: usize = 512;
pub(crate) const S_DONE: usize = 8;
pub(crate) const S_WR_ID: usize = 16;
pub(crate) const S_NUM_SGE: usize = 24;
pub(crate) const S_STATUS: usize = 28;
pub(crate) const S_OPCODE: usize = 32;
pub(crate) const S_BYTE_LEN: usize = 36;
pub(crate) const S_IMM: usize = 40;
pub(crate) const S_HAS_IMM: usize = 44;
pub(crate) const S_SGES: usize = 64;

/// Bytes of a segment whose ring has `cap` slots.
pub(crate) fn segment_len(cap: u64) -> usize {
    SLOTS + SLOT * cap as usize
}

/// Offset of the slot that receive `i` uses.
pub(crate) fn slot_base(cap: u64, i: u64) -> usize {
    SLOTS + (i % cap) as usize * SLOT
}

/// Claims the next posted, unclaimed receive of the ring in `seg`, if there is one.
pub(crate) fn claim(seg: &Segment) -> Option<u64> {
    let claimed = seg.atomic_u64(H_CLAIMED);
    let posted = seg.atomic_u64(H_POSTED);
    loop {
        let c = claimed.load(Ordering::Acquire);
        if c >= posted.load(Ordering::Acquire) {
            return None;
        }
        if claimed
            .compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Some(c);
        }
    }
}

/// Fills in the completion of receive `i` and publishes it.
pub(crate) fn complete_slot(
    seg: &Segment,
    cap: u64,
    i: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
) {
    let base = slot_base(cap, i);
    seg.atomic_u32(base + S_STATUS)
        .store(status as u32, Ordering::Relaxed);
    seg.atomic_u32(base + S_OPCODE)
        .store(opcode as u32, Ordering::Relaxed);
    seg.atomic_u32(base + S_BYTE_LEN)
        .store(byte_len, Ordering::Relaxed);
    seg.atomic_u32(base + S_IMM)
        .store(imm.unwrap_or(0), Ordering::Relaxed);
    seg.atomic_u32(base + S_HAS_IMM)
        .store(imm.is_some() as u32, Ordering::Relaxed);
    seg.atomic_u64(base + S_DONE)
        .store(i + 1, Ordering::Release);
}

/// Scatter-gather element `j` of receive slot `base`: (lkey, addr, len).
pub(crate) fn slot_sge(seg: &Segment, base: usize, j: usize) -> (u64, u64, usize) {
    let o = base + S_SGES + j * 24;
    (
        seg.atomic_u64(o).load(Ordering::Relaxed),
        seg.atomic_u64(o + 8).load(Ordering::Relaxed),
        seg.atomic_u64(o + 16).load(Ordering::Relaxed) as usize,
    )
}
