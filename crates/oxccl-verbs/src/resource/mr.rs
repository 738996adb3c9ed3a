//! Memory regions, as users hold them: making them in a protection domain (provider-allocated
//! shared memory, the zero-copy path, and registered user memory), the [`MemoryRegion`] handle's
//! methods, and [`RemoteMapping`], a peer's memory mapped into this process.
//!
//! The region's core (keys, the region table, keep-alives) is the contract's
//! (`contract::region`), since providers work with it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use super::context::ProtectionDomain;
use crate::contract::{Backing, Mapped, MemoryRegion, MrInner, Segment, copy_bytes};
use crate::model::{AccessFlags, Error, RemoteBuffer, Result};

impl ProtectionDomain {
    /// Allocates `len` bytes of zeroed shared memory and registers it: the zero-copy path, where a
    /// peer's WRITE is one `memcpy` into this memory.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        let seg = Arc::new(Segment::create("oxccl-mr", len)?);
        let addr = seg.as_ptr() as u64;
        self.register_region(addr, len, access, Backing::Segment(seg))
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
        self.register_region(addr, len, access, Backing::User { _owned: Some(buf) })
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
        self.register_region(addr as u64, len, access, Backing::User { _owned: None })
    }

    /// Registers the memory of `region`, a region of another context of this process (provider
    /// memory of the shm context, say), in this domain: a second provider reaches the same
    /// bytes. The new region keeps that memory mapped for as long as it, or a request using it,
    /// lives, even after `region` is dropped; its own deregistration is separate.
    pub fn reg_mr_of(&self, region: &MemoryRegion, access: AccessFlags) -> Result<MemoryRegion> {
        self.check_user_access(access)?;
        let of = region.inner.clone();
        self.register_region(of.addr, of.len, access, Backing::Borrowed { _of: of })
    }

    fn check_user_access(&self, access: AccessFlags) -> Result<()> {
        self.ctx.inner.ops.check_user_access(access)
    }

    fn register_region(
        &self,
        addr: u64,
        len: usize,
        access: AccessFlags,
        backing: Backing,
    ) -> Result<MemoryRegion> {
        MrInner::register(&self.ctx.inner, self.id, addr, len, access, backing)
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
        self.inner.segment().is_some()
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
