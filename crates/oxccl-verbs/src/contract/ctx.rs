//! The core of a context: its shared segment's layout, and what its resources and its provider
//! share ([`CtxInner`]).
//!
//! Every context owns one shared *context segment* holding:
//! - a header (magic, pid, liveness),
//! - a table of completion-queue doorbells (futex words bumped when a completion arrives, by this
//!   process or, for receives a shm peer completes, by the peer),
//! - the memory-region table (keys, address, length, access, kind of every registered region).
//!
//! It is shared memory so that a provider whose peers live on this host (shm) can hand it to them:
//! they then validate rkeys against the region table and ring the doorbells themselves. What else a
//! context holds belongs to its provider ([`ProviderContext`]): the shm provider's segment
//! service, the tcp provider's listener and progress thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::keyrng::KeyRng;
use super::provider::ProviderContext;
use super::region::MrInner;
use super::segment::Segment;
use crate::model::Provider;

pub(crate) const CTX_MAGIC: u64 = 0x6f78_6363_6c5f_6374; // "oxccl_ct"
pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_PID: usize = 8;
pub(crate) const OFF_ALIVE: usize = 12;
pub(crate) const CQ_TABLE: usize = 4096;
pub(crate) const CQ_SLOT: usize = 64;
pub(crate) const MAX_CQ: usize = 1024;
pub(crate) const MR_TABLE: usize = CQ_TABLE + MAX_CQ * CQ_SLOT;
pub(crate) const MR_SLOT: usize = 64;
/// Low bits of a key index the region table; the rest is random.
pub(crate) const MR_INDEX_BITS: u32 = 16;
pub(crate) const MAX_MR: usize = 1 << MR_INDEX_BITS;
const CTX_SEG_LEN: usize = MR_TABLE + MAX_MR * MR_SLOT;

/// Bytes of a context segment (a peer's mapping must have at least as many).
pub(crate) const fn ctx_segment_len() -> usize {
    CTX_SEG_LEN
}

/// The context segment's tables, for our own context and for a peer's mapping of theirs.
pub(crate) trait CtxTables {
    /// Word `word` of completion-queue doorbell `index` (0: sequence, 1: sleepers).
    fn cq_word(&self, index: u32, word: usize) -> &AtomicU32;
    /// The 8-byte field at `off` of region-table entry `index`.
    fn mr_u64(&self, index: u32, off: usize) -> &AtomicU64;
    /// The 4-byte field at `off` of region-table entry `index`.
    fn mr_u32(&self, index: u32, off: usize) -> &AtomicU32;
}

impl CtxTables for Segment {
    fn cq_word(&self, index: u32, word: usize) -> &AtomicU32 {
        self.atomic_u32(CQ_TABLE + index as usize * CQ_SLOT + word * 4)
    }
    fn mr_u64(&self, index: u32, off: usize) -> &AtomicU64 {
        self.atomic_u64(MR_TABLE + index as usize * MR_SLOT + off)
    }
    fn mr_u32(&self, index: u32, off: usize) -> &AtomicU32 {
        self.atomic_u32(MR_TABLE + index as usize * MR_SLOT + off)
    }
}

// Offsets inside one MR table entry.
pub(crate) const MR_RKEY: usize = 0;
pub(crate) const MR_LKEY: usize = 8;
pub(crate) const MR_ADDR: usize = 16;
pub(crate) const MR_LEN: usize = 24;
pub(crate) const MR_ACCESS: usize = 32;
pub(crate) const MR_KIND: usize = 36;
/// Writes into the region under way by peers that map it (shm): deregistering waits for 0.
pub(crate) const MR_WRITERS: usize = 40;
pub(crate) const MR_KIND_SEGMENT: u32 = 1;
pub(crate) const MR_KIND_USER: u32 = 2;

/// Tunables shared by a context's queues.
#[derive(Clone, Debug)]
pub(crate) struct Tuning {
    /// How long a waiter spins before it yields and then sleeps.
    pub spin: Duration,
}

/// Live regions of a context by table index (a software target validates requests against them
/// and keeps a region alive while it writes into it).
pub(crate) type RegionMap = Arc<Mutex<HashMap<u32, Weak<MrInner>>>>;

/// The core of an open context, shared by its handle (`Context`), its resources and its
/// provider.
pub(crate) struct CtxInner {
    pub provider: Provider,
    pub seg: Arc<Segment>,
    pub pid: u32,
    pub host: String,
    pub tuning: Tuning,
    pub regions: RegionMap,
    pub tables: Mutex<Tables>,
    pub next_qpn: AtomicU32,
    pub next_pd: AtomicU64,
    /// Draws the keys of its regions and the tokens of its queue pairs.
    pub keys: KeyRng,
    /// The provider's half of the context. Dropped after `Drop::drop` marked the segment dead.
    pub ops: Box<dyn ProviderContext>,
}

/// Free slots of the context's tables.
pub(crate) struct Tables {
    pub free_cq: Vec<u32>,
    pub free_mr: Vec<u32>,
}

impl CtxInner {
    /// Makes the context segment (header and tables, marked alive) of a new context.
    pub(crate) fn create_segment() -> crate::model::Result<Arc<Segment>> {
        let seg = Arc::new(Segment::create("oxccl-ctx", CTX_SEG_LEN)?);
        seg.atomic_u32(OFF_PID)
            .store(std::process::id(), Ordering::Relaxed);
        seg.atomic_u32(OFF_ALIVE).store(1, Ordering::Relaxed);
        seg.atomic_u64(OFF_MAGIC)
            .store(CTX_MAGIC, Ordering::Release);
        Ok(seg)
    }
}

impl Tables {
    /// Every slot free.
    pub(crate) fn new() -> Tables {
        Tables {
            free_cq: (0..MAX_CQ as u32).rev().collect(),
            free_mr: (0..MAX_MR as u32).rev().collect(),
        }
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // Peers mapping the segment see the context gone; then `ops` is dropped (the provider
        // stops its threads).
        self.seg.atomic_u32(OFF_ALIVE).store(0, Ordering::Release);
    }
}
