//! Shared-memory segments (memfd + mmap) and the futex doorbell: the few places with `unsafe`.
//!
//! A segment is a memfd mapped `MAP_SHARED`. Its file descriptor travels to peers over a Unix socket
//! (SCM_RIGHTS), so nothing is ever named in `/dev/shm` and nothing is left behind when a process dies.
//! Everything other processes may touch concurrently is read and written through atomics obtained
//! with [`Segment::atomic_u64`] / [`Segment::atomic_u32`]; bulk data is copied with raw pointers.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::model::{Error, Result};

/// A shared mapping of a memfd. Unmapped on drop.
pub(crate) struct Segment {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all concurrent access goes through atomics or raw
// pointer copies whose races are the documented semantics of RDMA memory.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only hands out atomics and raw pointers.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes (rounded up to a page).
    pub(crate) fn create(name: &str, len: usize) -> Result<Self> {
        let len = round_to_page(len.max(1));
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| Error::os(format!("memfd_create({name})"), e))?;
        rustix::fs::ftruncate(&fd, len as u64)
            .map_err(|e| Error::os(format!("ftruncate memfd {name} to {len} bytes"), e))?;
        // The size can no longer change: a peer's mapping can never be truncated under it (SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::os(format!("sealing memfd {name}"), e))?;
        Self::map(fd, len)
    }

    /// Maps a segment received from a peer. Its size is read from the descriptor.
    pub(crate) fn open(fd: OwnedFd) -> Result<Self> {
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat of a peer's segment", e))?;
        let len = st.st_size as usize;
        if len == 0 || !len.is_multiple_of(page_size()) {
            return Err(Error::arg(format!(
                "peer segment has an invalid size of {len} bytes"
            )));
        }
        // Only sealed segments are accepted, so the peer cannot shrink them under our mapping.
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| Error::os("reading seals", e))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(Error::arg("peer segment is not sealed against shrinking"));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self> {
        // SAFETY: a fresh mapping chosen by the kernel (null hint), of a descriptor we own; it
        // aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::os(format!("mmap of a {len}-byte shared segment"), e))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).expect("mmap returned null");
        Ok(Self { fd, ptr, len })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The 8-byte atomic at `off`. Panics (an internal bug) when misaligned or out of bounds.
    pub(crate) fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: in bounds and aligned (checked above); the mapping lives as long as `self`, and
        // AtomicU64 has the layout of u64 with interior mutability, so shared access is sound.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The 4-byte atomic at `off`. Panics (an internal bug) when misaligned or out of bounds.
    pub(crate) fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: as in `atomic_u64`.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we own this mapping and no reference into it outlives `self` (every accessor
        // borrows `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

pub(crate) fn round_to_page(len: usize) -> usize {
    let p = page_size();
    len.div_ceil(p) * p
}

/// Sleeps on a shared futex word while it equals `expected`, at most `timeout`.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // Shared (not private) futex: the word lives in memory mapped by several processes.
    let _ = rustix::thread::futex::wait(
        word,
        rustix::thread::futex::Flags::empty(),
        expected,
        Some(&ts),
    );
}

/// Wakes every sleeper on a shared futex word.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    let _ =
        rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), i32::MAX as u32);
}

/// Copies `len` bytes between raw locations.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, and they must not overlap.
/// Concurrent access by peers is the RDMA contract: the bytes may tear, but nothing else breaks.
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if len > 0 {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// Cross-memory attach: one copy between this process and a peer's private memory.
pub(crate) mod cma {
    use std::io;

    fn iovecs(local: &[(*mut u8, usize)]) -> Vec<libc::iovec> {
        local
            .iter()
            .map(|&(p, len)| libc::iovec {
                iov_base: p.cast(),
                iov_len: len,
            })
            .collect()
    }

    fn run(
        pid: u32,
        addr: u64,
        local: &[(*mut u8, usize)],
        call: unsafe extern "C" fn(
            libc::pid_t,
            *const libc::iovec,
            libc::c_ulong,
            *const libc::iovec,
            libc::c_ulong,
            libc::c_ulong,
        ) -> isize,
    ) -> io::Result<()> {
        let total: usize = local.iter().map(|l| l.1).sum();
        let mut done = 0usize;
        let mut iov = iovecs(local);
        while done < total {
            // Skip what was already transferred (a partial transfer stops at an iovec boundary
            // or a page the peer does not map).
            let mut skip = done;
            let mut first = 0;
            while first < iov.len() && skip >= local[first].1 {
                skip -= local[first].1;
                first += 1;
            }
            iov[first].iov_base = local[first].0.wrapping_add(skip).cast();
            iov[first].iov_len = local[first].1 - skip;
            let remote = libc::iovec {
                iov_base: (addr as usize + done) as *mut libc::c_void,
                iov_len: total - done,
            };
            // SAFETY: the local iovecs describe validated, live local buffers; the kernel checks
            // the remote range against the peer's address space and fails with EFAULT if unmapped.
            let n = unsafe {
                call(
                    pid as libc::pid_t,
                    iov[first..].as_ptr(),
                    (iov.len() - first) as libc::c_ulong,
                    &remote,
                    1,
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::EFAULT));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Writes the local buffers, in order, to `addr` in process `pid`.
    pub(crate) fn write(pid: u32, addr: u64, local: &[(*mut u8, usize)]) -> io::Result<()> {
        run(pid, addr, local, libc::process_vm_writev)
    }

    /// Reads from `addr` in process `pid` into the local buffers, in order.
    pub(crate) fn read(pid: u32, addr: u64, local: &[(*mut u8, usize)]) -> io::Result<()> {
        run(pid, addr, local, libc::process_vm_readv)
    }
}
