//! Memory regions: provider-allocated shared memory (the zero-copy path) and registered user memory.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::context::{
    CtxInner, CtxTables, MAX_MR, MR_ACCESS, MR_ADDR, MR_INDEX_BITS, MR_KIND, MR_KIND_SEGMENT,
    MR_KIND_USER, MR_LEN, MR_LKEY, MR_RKEY, MR_WRITERS, ProtectionDomain, random_u64,
};
use crate::error::{Error, Result};
use crate::provider::RegionInfo;
use crate::segment::{Segment, copy_bytes};
use crate::types::{AccessFlags, RemoteBuffer, WcStatus};

/// A registered memory region (`ibv_mr`).
///
/// Dropping it deregisters it. [`MemoryRegion::deregister`] does so early: later remote accesses
/// with its rkey fail with `RemoteAccessError`, later local uses with `LocalProtectionError`, while
/// the memory itself stays valid until the last request that references it has completed.
/// Deregistering waits (up to [`DEREGISTER_WAIT`]) for the remote writes into the region that
/// were already under way (a peer's copy into a shared mapping, the tcp target's receive of a
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

/// How long deregistering waits for the writes into the region already under way. A writer
/// that has not finished by then (a peer process killed in the middle of its copy, a payload
/// stuck on a silent connection) cannot write after its process or connection is gone; the
/// region's table entry is then not reused.
pub const DEREGISTER_WAIT: Duration = Duration::from_secs(2);

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

enum Backing {
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

fn new_key(index: u32) -> u64 {
    loop {
        let k = (random_u64() << MR_INDEX_BITS) | index as u64;
        if k >> MR_INDEX_BITS != 0 {
            return k;
        }
    }
}

/// The table index a key names.
pub(crate) fn key_index(key: u64) -> u32 {
    (key & ((1u64 << MR_INDEX_BITS) - 1)) as u32
}

impl ProtectionDomain {
    /// Allocates `len` bytes of zeroed shared memory and registers it: the zero-copy path, where a
    /// peer's WRITE is one `memcpy` into this memory.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        let seg = Arc::new(Segment::create("oxccl-mr", len)?);
        let addr = seg.as_ptr() as u64;
        self.register(addr, len, access, Backing::Segment(seg))
    }

    /// Registers a user buffer, which the region owns until it is dropped.
    ///
    /// Peers reach it with `process_vm_readv`/`process_vm_writev` (one copy, one syscall per
    /// request). Atomics need provider memory: use [`ProtectionDomain::alloc_mr`] for
    /// `REMOTE_ATOMIC`.
    pub fn reg_mr(&self, buf: Vec<u8>, access: AccessFlags) -> Result<MemoryRegion> {
        let mut buf = buf;
        let addr = buf.as_mut_ptr() as u64;
        let len = buf.len();
        self.check_user_access(access)?;
        self.register(addr, len, access, Backing::User { _owned: Some(buf) })
    }

    /// Registers memory the caller owns (`ibv_reg_mr`).
    ///
    /// # Safety
    /// `addr..addr+len` must be valid, writable memory of this process that stays allocated until
    /// the region is dropped and every request that uses it has completed. Peers may write it at
    /// any time while it is registered with remote access.
    pub unsafe fn reg_mr_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        self.check_user_access(access)?;
        self.register(addr as u64, len, access, Backing::User { _owned: None })
    }

    /// Registers the memory of `region`, a region of another context of this process (provider
    /// memory of the shm context, say), in this domain: a second provider reaches the same
    /// bytes. The new region keeps that memory mapped for as long as it, or a request using it,
    /// lives, even after `region` is dropped; its own deregistration is separate.
    pub fn reg_mr_of(&self, region: &MemoryRegion, access: AccessFlags) -> Result<MemoryRegion> {
        self.check_user_access(access)?;
        let of = region.inner.clone();
        self.register(of.addr, of.len, access, Backing::Borrowed { _of: of })
    }

    fn check_user_access(&self, access: AccessFlags) -> Result<()> {
        self.ctx.inner.ops.check_user_access(access)
    }

    fn register(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
        backing: Backing,
    ) -> Result<MemoryRegion> {
        let ctx = self.ctx.inner.clone();
        let index = ctx
            .tables
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_mr
            .pop()
            .ok_or_else(|| {
                Error::Exhausted(format!(
                    "all {} memory-region slots of this context are in use",
                    crate::context::MAX_MR
                ))
            })?;
        let (lkey, mut rkey) = (new_key(index), new_key(index));
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
        match chosen {
            Ok(key) => rkey = key.unwrap_or(rkey),
            Err(e) => {
                ctx.tables
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .free_mr
                    .push(index);
                return Err(e);
            }
        }
        let inner = Arc::new(MrInner {
            ctx: ctx.clone(),
            pd: self.id,
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
}

impl MrInner {
    fn deregister(&self) -> bool {
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

    /// Waits (up to [`DEREGISTER_WAIT`]) until no write into the region is under way, here or
    /// by a peer; whether none is.
    fn wait_for_writers(&self) -> bool {
        let table = self.ctx.seg.mr_u64(self.index, MR_WRITERS);
        let idle = || self.writers.load(Ordering::SeqCst) == 0 && table.load(Ordering::SeqCst) == 0;
        let start = Instant::now();
        let mut spins = 0u32;
        while !idle() {
            if start.elapsed() >= DEREGISTER_WAIT {
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
        true
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

impl MemoryRegion {
    /// Start address (in this process).
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u64 {
        self.inner.lkey
    }
    /// Remote key: hand it to peers with [`MemoryRegion::remote`].
    pub fn rkey(&self) -> u64 {
        self.inner.rkey
    }
    /// Access flags.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }
    /// Whether the region is provider memory (shared mapping) rather than registered user memory.
    pub fn is_provider_memory(&self) -> bool {
        matches!(self.inner.backing, Backing::Segment(_))
    }
    /// What a peer needs to address this region.
    pub fn remote(&self) -> RemoteBuffer {
        RemoteBuffer {
            addr: self.inner.addr,
            len: self.inner.len as u64,
            rkey: self.inner.rkey,
        }
    }
    /// Whether the region is still registered.
    pub fn is_registered(&self) -> bool {
        self.inner.is_registered()
    }
    /// Deregisters the region (`ibv_dereg_mr`); later uses of its keys fail. Idempotent.
    pub fn deregister(&self) {
        self.inner.deregister();
    }
    /// Raw pointer to the first byte. Peers may write the memory at any time.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.addr as usize as *mut u8
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(Error::arg(format!(
                "range {offset}+{len} outside memory region of {} bytes",
                self.len()
            )));
        }
        Ok(())
    }

    /// Copies `buf.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        // SAFETY: in bounds (checked); the region's memory lives as long as `self`; `buf` is a
        // distinct Rust allocation.
        unsafe { copy_bytes(self.as_ptr().add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: as in `read`, reversed.
        unsafe { copy_bytes(data.as_ptr(), self.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Sets every byte of the region to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole region is valid for writes while `self` lives.
        unsafe { std::ptr::write_bytes(self.as_ptr(), byte, self.len()) };
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        let _ = self.read(0, &mut v);
        v
    }

    /// The 8-byte word at `offset` as an atomic (for flags peers write, and for polling).
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        let p = self.addr() as usize + offset;
        if !p.is_multiple_of(8) {
            return Err(Error::arg(format!("offset {offset} is not 8-byte aligned")));
        }
        // SAFETY: in bounds and aligned (checked); the memory outlives the borrow of `self`;
        // AtomicU64 tolerates concurrent access from peers.
        Ok(unsafe { &*(p as *const AtomicU64) })
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .field("registered", &self.is_registered())
            .finish()
    }
}

/// What a provider maps for [`QueuePair::map_remote`](crate::QueuePair::map_remote): a
/// validated range of the peer's memory, and what keeps its mapping alive.
pub(crate) struct Mapped {
    /// The mapping the range lies in (dropped last).
    pub _keep: Arc<Segment>,
    /// The range's first byte in this process.
    pub ptr: *mut u8,
    /// Its length.
    pub len: usize,
}

/// A peer's memory, mapped into this process ([`QueuePair::map_remote`], the analog of UCX's
/// `ucp_rkey_ptr`): loads and stores reach it directly, with no request, no completion and
/// no system call. Only where the peer's memory can be mapped (the shm provider's provider
/// memory).
///
/// The range was validated once, when it was mapped (rkey, bounds, access); like a memory
/// window it stays accessible until this handle is dropped, whatever the peer does later
/// (deregistering the region, or exiting: the memory then belongs to nobody, and stores into
/// it are lost). It is meant for a peer's long-lived regions (a communicator's receive
/// buffers), whose protocol says when each byte may be written; the peer reads what is
/// stored here with its own loads ([`MemoryRegion::atomic_u64`] and copies).
///
/// [`QueuePair::map_remote`]: crate::QueuePair::map_remote
pub struct RemoteMapping {
    m: Mapped,
}

// SAFETY: the mapping is shared memory reached through raw pointers and atomics, as a
// region's own memory is (`MrInner`); the handle holds no thread-affine state.
unsafe impl Send for RemoteMapping {}
// SAFETY: as above.
unsafe impl Sync for RemoteMapping {}

impl RemoteMapping {
    pub(crate) fn new(m: Mapped) -> RemoteMapping {
        RemoteMapping { m }
    }

    /// The mapped range's first byte in this process: valid for `len()` bytes while `self`
    /// lives. Writes through it race with the peer unless the peer's protocol says otherwise.
    pub fn as_ptr(&self) -> *mut u8 {
        self.m.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.m.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.m.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.m.len) {
            return Err(Error::arg(format!(
                "range {offset}+{len} outside a mapping of {} bytes",
                self.m.len
            )));
        }
        Ok(())
    }

    /// Copies `data` into the peer's memory at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); the mapping lives as long as `self`; `data` is local
        // memory, a distinct mapping.
        unsafe { copy_bytes(data.as_ptr(), self.m.ptr.add(offset), data.len()) };
        Ok(())
    }

    /// Copies `buf.len()` bytes of the peer's memory at `offset` into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        // SAFETY: as in `write`, reversed.
        unsafe { copy_bytes(self.m.ptr.add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// The peer's 8-byte word at `offset` as an atomic (a flag the peer polls with
    /// [`MemoryRegion::atomic_u64`]).
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        let p = self.m.ptr as usize + offset;
        if !p.is_multiple_of(8) {
            return Err(Error::arg(format!("offset {offset} is not 8-byte aligned")));
        }
        // SAFETY: in bounds and aligned (checked); the mapping outlives the borrow of `self`;
        // AtomicU64 tolerates the peer's concurrent access.
        Ok(unsafe { &*(p as *const AtomicU64) })
    }
}

impl fmt::Debug for RemoteMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteMapping")
            .field("ptr", &self.m.ptr)
            .field("len", &self.m.len)
            .finish()
    }
}
