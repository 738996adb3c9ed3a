//! Mailbox messages through mapped memory: the sender stores a message straight into the
//! peer's mailbox (its receive region, mapped with `QueuePair::map_remote`), or, where the
//! provider maps nothing, composes it in its own staging region for one write that carries it
//! there; the receiver reads it from its own memory. The layout, and why it is safe to read, is
//! [`oxccl_core::protocol::mailbox`]'s: a first line with a flag, the short header and the
//! start of the data; the data contiguous from [`DATA`]; a stamp after it when it does not fit
//! the first line. This module is the only one that touches those bytes.

use std::sync::atomic::{AtomicU64, Ordering};

use oxccl_core::protocol::Header;
use oxccl_core::protocol::mailbox::{
    DATA, FLAG, HEADER, LINE, SHORT_HEADER, has_stamp, stamp_offset, used,
};
use oxccl_verbs::{MemoryRegion, RemoteMapping};

/// The word at `p` (8-byte aligned, inside a live mapping) as an atomic.
///
/// # Safety
/// `p` must be 8-byte aligned and valid for 8 bytes for as long as the result is used.
unsafe fn word<'a>(p: *mut u8) -> &'a AtomicU64 {
    debug_assert!((p as usize).is_multiple_of(8));
    // SAFETY: the caller's promise; AtomicU64 has u64's layout and tolerates the peer's
    // concurrent access.
    unsafe { &*(p as *const AtomicU64) }
}

/// Memory a mailbox message can be stored into: a peer's receive region mapped here, or this
/// rank's own staging region.
pub(crate) trait Mapped {
    /// The first byte (page-aligned); valid for [`Mapped::len`] bytes while `self` lives.
    fn base(&self) -> *mut u8;
    /// Bytes.
    fn len(&self) -> usize;
}

impl Mapped for RemoteMapping {
    fn base(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        RemoteMapping::len(self)
    }
}

impl Mapped for MemoryRegion {
    fn base(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        MemoryRegion::len(self)
    }
}

/// Stores message number `flag - 1` into the mailbox at byte `at` of `outbox`: the short
/// header `hdr` (with any fault already applied), `data`, then the flags. Fails, naming the
/// sizes, if the message does not fit.
pub(crate) fn post(
    outbox: &impl Mapped,
    at: usize,
    hdr: &[u8; SHORT_HEADER],
    data: &[u8],
    flag: u64,
) -> Result<(), String> {
    let total = data.len();
    let end = at.checked_add(used(total));
    if end.is_none_or(|e| e > outbox.len()) || !at.is_multiple_of(LINE) {
        return Err(format!(
            "a mailbox message of {total} bytes at {at} does not fit the region of {} bytes",
            outbox.len()
        ));
    }
    // SAFETY: `at + used(total)` lies inside the memory (checked above) and `at` is on a
    // line, so every offset below is in bounds and each flag 8-byte aligned (the memory
    // starts on a page). The receiver reads none of these bytes before it sees the flag that
    // follows them (or, for a written mailbox, before the write has landed), and does not
    // hand the mailbox back (by sending its next message) before it has read them: nothing
    // else touches them meanwhile. `data` is local memory.
    unsafe {
        let line = outbox.base().add(at);
        // The header word by word, as it was composed (a copy of it whole would read the
        // words back wider than they were stored, stalling on their forwarding).
        for (i, w) in hdr.chunks_exact(8).enumerate() {
            let w = u64::from_ne_bytes(w.try_into().unwrap_or_default());
            word(line.add(HEADER + 8 * i)).store(w, Ordering::Relaxed);
        }
        std::ptr::copy_nonoverlapping(data.as_ptr(), line.add(DATA), total);
        word(line.add(FLAG)).store(flag, Ordering::Release);
        if has_stamp(total) {
            word(line.add(stamp_offset(total))).store(flag, Ordering::Release);
        }
    }
    Ok(())
}

/// A message in this rank's own mailbox at byte `at` of its receive region `mr`.
pub(crate) struct Inbox<'a> {
    mr: &'a MemoryRegion,
    at: usize,
}

impl<'a> Inbox<'a> {
    /// The mailbox at byte `at` of `mr` (on a line, with room for the largest message:
    /// the receive region's layout guarantees both).
    pub(crate) fn new(mr: &'a MemoryRegion, at: usize) -> Inbox<'a> {
        debug_assert!(at.is_multiple_of(LINE));
        debug_assert!(at + oxccl_core::protocol::MAILBOX <= mr.len());
        Inbox { mr, at }
    }

    fn flag_at(&self, off: usize) -> u64 {
        self.mr
            .atomic_u64(self.at + off)
            .map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// The flag a receiver of the message with flag `flag` and `total` bytes waits on now:
    /// the first line's, then the stamp (`None` once both are there). For a waiter that
    /// spins on one word rather than looking at everything.
    pub(crate) fn awaited(&self, total: usize, flag: u64) -> Option<&'a AtomicU64> {
        let off = if !self.header_arrived(flag) {
            FLAG
        } else if !self.complete(total, flag) {
            stamp_offset(total)
        } else {
            return None;
        };
        self.mr.atomic_u64(self.at + off).ok()
    }

    /// Whether the first line of the message with flag `flag` has arrived (its header can be
    /// read).
    pub(crate) fn header_arrived(&self, flag: u64) -> bool {
        self.flag_at(FLAG) == flag
    }

    /// The message's header (once [`Inbox::header_arrived`]).
    pub(crate) fn header(&self) -> Header {
        Header::decode_short(&self.header_bytes())
    }

    /// Whether the message's header says exactly `want` (once [`Inbox::header_arrived`]):
    /// its four words compared with the ones expected, read as words.
    pub(crate) fn header_is(&self, want: &Header) -> bool {
        if self.at + HEADER + 32 > self.mr.len() {
            return false;
        }
        let base = self.mr.as_ptr();
        let w: [u64; 4] = std::array::from_fn(|i| {
            // SAFETY: in bounds (checked above); 8-byte aligned (the region starts on a page,
            // `at` on a line, the header on a word). The sender stores none of these bytes
            // again before this rank answers (see `post`), and a concurrent store is atomic.
            unsafe { word(base.add(self.at + HEADER + 8 * i)) }.load(Ordering::Relaxed)
        });
        want.short_matches_words(&w)
    }

    fn header_bytes(&self) -> [u8; SHORT_HEADER] {
        let mut b = [0u8; SHORT_HEADER];
        let _ = self.mr.read(self.at + HEADER, &mut b);
        b
    }

    /// Whether all `total` bytes of the message with flag `flag` have arrived (once its
    /// header said it has `total`).
    pub(crate) fn complete(&self, total: usize, flag: u64) -> bool {
        !has_stamp(total) || self.flag_at(stamp_offset(total)) == flag
    }

    /// Where the message's `total` bytes lie in the receive region (contiguous), for a caller
    /// that copies or reduces them straight out of it.
    pub(crate) fn data(&self) -> usize {
        self.at + DATA
    }
}
