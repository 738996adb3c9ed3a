//! The core of a memory region ([`MrInner`]): keys, bounds and access, its registration in the
//! context's region table, and the keep-alives and write announcements providers use.
//!
//! The handle users hold ([`MemoryRegion`]) is defined here because work requests
//! (`contract::wr`) carry it to providers; making regions (`ProtectionDomain::alloc_mr` and
//! friends) and the handle's methods are the resource layer's (`resource::mr`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::ctx::{
    CtxInner, CtxTables, MAX_MR, MR_ACCESS, MR_ADDR, MR_INDEX_BITS, MR_KIND, MR_KIND_SEGMENT,
    MR_KIND_USER, MR_LEN, MR_LKEY, MR_RKEY, MR_WRITERS,
};
use super::keyrng::KeyRng;
use super::provider::RegionInfo;
use super::segment::Segment;
use crate::model::{AccessFlags, Error, Result, WcStatus};

/// A registered memory region (`ibv_mr`).
///
/// Dropping it deregisters it. [`MemoryRegion::deregister`] does so early: later remote accesses
/// with its rkey fail with `RemoteAccessError`, later local uses with `LocalProtectionError`, while
/// the memory itself stays valid until the last request that references it has completed.
/// Deregistering waits (up to [`DEREGISTER_WAIT`], [`DEREGISTER_WAIT_PEERS`] for peers that
/// write with their own copies) for the remote writes into the region that were already under
/// way (a peer's copy into a shared mapping, the tcp target's receive of a
/// payload): once it returns, no peer writes the memory any more.
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

pub(crate) struct MrInner {
    ctx: Arc<CtxInner>,
    pub pd: u64,
    /// Index in the context's region table (the low bits of both keys).
    pub index: u32,
    pub lkey: u64,
    pub rkey: u64,
    pub access: AccessFlags,
    pub addr: u64,
    pub len: usize,
    backing: Backing,
    registered: AtomicBool,
    /// Writes into the region under way in this process ([`Writing`]: the tcp target's
    /// receive of a payload).
    writers: AtomicU32,
}

/// How long deregistering waits for the writes into the region already under way in this
/// process (the tcp target's receive of a payload, which a slow link can stretch). A writer
/// that has not finished by then (a payload stuck on a silent connection) cannot write once
/// its connection is gone; the region's table entry is then not reused.
pub const DEREGISTER_WAIT: Duration = Duration::from_secs(2);

/// How long deregistering waits for peers' writes (shm: one copy of at most a fragment, a
/// millisecond or so): longer means the writer died in the middle of its copy, leaving its
/// count behind (a dead process writes no more), and waiting on would only stall the
/// teardown of a communicator that lost that peer.
pub const DEREGISTER_WAIT_PEERS: Duration = Duration::from_millis(250);

/// A write into a region under way, announced before the region's registration is checked:
/// [`MemoryRegion::deregister`] waits until none is left, so that no write lands after it.
pub(crate) struct Writing(Arc<MrInner>);

impl Writing {
    /// Announces a write into `mr`; `None` (nothing announced) when it is deregistered.
    pub(crate) fn begin(mr: Arc<MrInner>) -> Option<Writing> {
        // SeqCst on both sides (here: count, then check; deregister: clear, then read the
        // count): one of the two sees the other.
        mr.writers.fetch_add(1, Ordering::SeqCst);
        let w = Writing(mr);
        w.0.registered.load(Ordering::SeqCst).then_some(w)
    }

    /// The region written into.
    pub(crate) fn region(&self) -> &Arc<MrInner> {
        &self.0
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        self.0.writers.fetch_sub(1, Ordering::Release);
    }
}

/// A peer's write into a region of this context's table, announced in the table itself (the
/// shm provider's writers are other processes): counted, then checked against `rkey`.
pub(crate) struct TableWriting<'a>(&'a AtomicU64);

impl<'a> TableWriting<'a> {
    /// Announces a write with `rkey` into the table of `seg` (a peer's context segment);
    /// `None` when no region of that table has that rkey now.
    pub(crate) fn begin(seg: &'a Segment, rkey: u64) -> Option<TableWriting<'a>> {
        let index = key_index(rkey);
        if rkey == 0 || index as usize >= MAX_MR {
            return None;
        }
        let count = seg.mr_u64(index, MR_WRITERS);
        count.fetch_add(1, Ordering::SeqCst);
        let w = TableWriting(count);
        (seg.mr_u64(index, MR_RKEY).load(Ordering::SeqCst) == rkey).then_some(w)
    }
}

impl Drop for TableWriting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

pub(crate) enum Backing {
    /// Provider memory: a memfd peers map.
    Segment(Arc<Segment>),
    /// User memory, reached by peers with process_vm_readv/writev. Owns the buffer when it was
    /// handed over as a `Vec`.
    User { _owned: Option<Vec<u8>> },
    /// The memory of a region of another context of this process, kept alive by holding it.
    Borrowed { _of: Arc<MrInner> },
}

// SAFETY: the region's memory is only reached through raw pointers and atomics (see `segment`);
// the struct itself holds no thread-affine state.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

/// A raw byte range inside a registered region, that a provider sends from or receives into
/// (valid while an `Arc<MrInner>` of its region is held beside it).
#[derive(Clone, Copy)]
pub(crate) struct Span(pub *mut u8, pub usize);
// SAFETY: spans point into registered regions kept alive by the `Arc`s stored beside them.
unsafe impl Send for Span {}

/// A key for region-table entry `index`: the index in the low bits, random bits above (never
/// all zero).
fn new_key(keys: &KeyRng, index: u32) -> Result<u64> {
    loop {
        let k = (keys.next_u64()? << MR_INDEX_BITS) | index as u64;
        if k >> MR_INDEX_BITS != 0 {
            return Ok(k);
        }
    }
}

/// The table index a key names.
pub(crate) fn key_index(key: u64) -> u32 {
    (key & ((1u64 << MR_INDEX_BITS) - 1)) as u32
}

impl MrInner {
    /// Registers `addr..addr + len` in domain `pd` of `ctx`: takes a table slot, draws the keys
    /// (the provider may choose the rkey: [`ProviderContext::register_mr`]), then publishes the
    /// entry in the context's region table and its map of live regions.
    ///
    /// [`ProviderContext::register_mr`]: super::ProviderContext::register_mr
    pub(crate) fn register(
        ctx: &Arc<CtxInner>,
        pd: u64,
        addr: u64,
        len: usize,
        access: AccessFlags,
        backing: Backing,
    ) -> Result<MemoryRegion> {
        let index = ctx
            .tables
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_mr
            .pop()
            .ok_or_else(|| {
                Error::Exhausted(format!(
                    "all {} memory-region slots of this context are in use",
                    MAX_MR
                ))
            })?;
        // A failure below gives the slot back.
        let give_back = |e: Error| {
            ctx.tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .free_mr
                .push(index);
            e
        };
        let (lkey, mut rkey) = new_key(&ctx.keys, index)
            .and_then(|l| Ok((l, new_key(&ctx.keys, index)?)))
            .map_err(give_back)?;
        let kind = match &backing {
            Backing::Segment(_) => MR_KIND_SEGMENT,
            Backing::User { .. } | Backing::Borrowed { .. } => MR_KIND_USER,
        };
        let info = RegionInfo {
            index,
            lkey,
            rkey,
            addr,
            len,
            access,
            segment: match &backing {
                Backing::Segment(seg) => Some(seg),
                Backing::User { .. } | Backing::Borrowed { .. } => None,
            },
        };
        let chosen = ctx.ops.register_mr(&info).and_then(|key| match key {
            Some(0) => Err(Error::arg("the provider gave the region a zero rkey")),
            key => Ok(key),
        });
        rkey = chosen.map_err(give_back)?.unwrap_or(rkey);
        let inner = Arc::new(MrInner {
            ctx: ctx.clone(),
            pd,
            index,
            lkey,
            rkey,
            access,
            addr,
            len,
            backing,
            registered: AtomicBool::new(true),
            writers: AtomicU32::new(0),
        });
        ctx.seg
            .mr_u64(index, MR_LKEY)
            .store(lkey, Ordering::Relaxed);
        ctx.seg
            .mr_u64(index, MR_ADDR)
            .store(addr, Ordering::Relaxed);
        ctx.seg
            .mr_u64(index, MR_LEN)
            .store(len as u64, Ordering::Relaxed);
        ctx.seg
            .mr_u32(index, MR_ACCESS)
            .store(access.bits(), Ordering::Relaxed);
        ctx.seg
            .mr_u32(index, MR_KIND)
            .store(kind, Ordering::Relaxed);
        // Publishing the rkey makes the entry valid; readers acquire it first and re-check it last.
        ctx.seg
            .mr_u64(index, MR_RKEY)
            .store(rkey, Ordering::Release);
        ctx.regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(index, Arc::downgrade(&inner));
        Ok(MemoryRegion { inner })
    }

    /// Unpublishes the region (see [`MemoryRegion::deregister`]); false when it already was.
    pub(crate) fn deregister(&self) -> bool {
        if !self.registered.swap(false, Ordering::SeqCst) {
            return false;
        }
        let ctx = &self.ctx;
        ctx.seg
            .mr_u64(self.index, MR_RKEY)
            .store(0, Ordering::SeqCst);
        let drained = self.wait_for_writers();
        ctx.seg
            .mr_u64(self.index, MR_LKEY)
            .store(0, Ordering::Release);
        ctx.regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.index);
        ctx.ops.deregister_mr(self);
        // An entry a writer may still count in is never handed out again.
        if drained {
            ctx.tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .free_mr
                .push(self.index);
        }
        true
    }

    /// Waits (up to [`DEREGISTER_WAIT`] for this process's writers, [`DEREGISTER_WAIT_PEERS`]
    /// for peers') until no write into the region is under way; whether none is.
    fn wait_for_writers(&self) -> bool {
        let table = self.ctx.seg.mr_u64(self.index, MR_WRITERS);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let local = self.writers.load(Ordering::SeqCst) == 0;
            let peers = table.load(Ordering::SeqCst) == 0;
            if local && peers {
                return true;
            }
            let waited = start.elapsed();
            if (!local && waited >= DEREGISTER_WAIT)
                || (local && !peers && waited >= DEREGISTER_WAIT_PEERS)
            {
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    pub(crate) fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// The shared memory behind a provider-allocated region (`None` for user memory).
    pub(crate) fn segment(&self) -> Option<&Arc<Segment>> {
        match &self.backing {
            Backing::Segment(seg) => Some(seg),
            Backing::User { .. } | Backing::Borrowed { .. } => None,
        }
    }

    /// Checks a local access of `len` bytes at `offset` for a request on domain `pd` and returns
    /// where it starts.
    pub(crate) fn local_ptr(
        &self,
        pd: u64,
        offset: usize,
        len: usize,
        write: bool,
    ) -> Result<*mut u8, WcStatus> {
        let in_bounds = offset.checked_add(len).is_some_and(|end| end <= self.len);
        if !self.is_registered()
            || pd != self.pd
            || !in_bounds
            || (write && !self.access.contains(AccessFlags::LOCAL_WRITE))
        {
            return Err(WcStatus::LocalProtectionError);
        }
        Ok((self.addr as usize + offset) as *mut u8)
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// What a provider maps for [`QueuePair::map_remote`](crate::QueuePair::map_remote): a
/// validated range of the peer's memory, and what keeps its mapping alive (the handle users
/// get is `resource::mr::RemoteMapping`).
pub(crate) struct Mapped {
    /// The mapping the range lies in (dropped last).
    pub _keep: Arc<Segment>,
    /// The range's first byte in this process.
    pub ptr: *mut u8,
    /// Its length.
    pub len: usize,
}
