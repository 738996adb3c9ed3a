//! Raw baselines printed beside the verbs tests: what the hardware gives without the library.
//!
//! - `memcpy_bw`: one thread copying between two private buffers, the floor of any one-copy
//!   transport's bandwidth.
//! - `flag_lat`: two processes ping-ponging an 8-byte flag in a shared memfd page, both spinning:
//!   the floor of any shared-memory doorbell's latency.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};

use super::channel::{RunSpec, Spin};
use super::error::{Error, Result};
use super::report::Marks;

/// One thread copying `size` bytes between two private buffers, `warmup` then `iters` times.
pub fn memcpy_bw(size: usize, warmup: u64, iters: u64) -> Marks {
    const BATCH: u64 = 64;
    let src = vec![0xa5u8; size];
    let mut dst = vec![0x5au8; size];
    let mut copy = |n: u64| {
        for _ in 0..n {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
    };
    copy(warmup);
    let mut marks = Marks::new(iters, BATCH);
    marks.start();
    let mut done = 0;
    while done < iters {
        let k = BATCH.min(iters - done);
        copy(k);
        done += k;
        marks.mark(done);
    }
    marks
}

/// Size of the shared flag page.
const PAGE: usize = 4096;
/// The client's inbox (the server writes it).
const CLIENT_WORD: usize = 0;
/// The server's inbox, two cache lines away (no false sharing, no adjacent-line prefetch).
const SERVER_WORD: usize = 128;

/// A shared page holding the two flags of `flag_lat`.
pub struct FlagPage {
    fd: OwnedFd,
    ptr: NonNull<u8>,
}

impl FlagPage {
    /// Creates the page. Its descriptor is inheritable (not close-on-exec), so the spawned
    /// server maps the same page.
    pub fn create() -> Result<Self> {
        let fd = rustix::fs::memfd_create("oxccl-flag-lat", MemfdFlags::empty())
            .map_err(|e| Error::new(format!("memfd_create for flag_lat: {e}")))?;
        rustix::fs::ftruncate(&fd, PAGE as u64)
            .map_err(|e| Error::new(format!("sizing the flag_lat page: {e}")))?;
        Self::map(fd)
    }

    /// Maps the page inherited as descriptor `fd`.
    pub fn inherit(fd: i32) -> Result<Self> {
        if fd < 0 {
            return Err(Error::new(format!("invalid flag_lat descriptor {fd}")));
        }
        // SAFETY: only used for the duration of the fstat call; an fd that is not open makes
        // fstat fail with EBADF, which we report.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let st = rustix::fs::fstat(borrowed)
            .map_err(|e| Error::new(format!("flag_lat descriptor {fd} is not usable: {e}")))?;
        if st.st_size as usize != PAGE {
            return Err(Error::new(format!(
                "flag_lat descriptor {fd} is not the client's flag page ({} bytes)",
                st.st_size
            )));
        }
        // Take ownership of a private duplicate; the inherited number stays as it is.
        let fd = borrowed
            .try_clone_to_owned()
            .map_err(|e| Error::new(format!("duplicating flag_lat descriptor {fd}: {e}")))?;
        Self::map(fd)
    }

    /// Maps the page of `fd`, shared and writable.
    fn map(fd: OwnedFd) -> Result<Self> {
        // SAFETY: a fresh shared mapping of a descriptor we own, at an address the kernel picks;
        // it aliases no Rust object. It is only accessed through atomics.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                PAGE,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::new(format!("mapping the flag_lat page: {e}")))?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::new("mapping the flag_lat page returned null"))?;
        Ok(FlagPage { fd, ptr })
    }

    /// The descriptor number to hand to the server process.
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The flag word at byte `off`.
    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= PAGE);
        // SAFETY: in bounds and 8-byte aligned (page-aligned base); the mapping lives as long as
        // `self`; the other process uses the word only through atomics too.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The client's side: `warmup + iters` round trips; returns per-round-trip nanoseconds.
    pub fn client(&self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<Vec<u64>> {
        let (mine, theirs) = (self.word(CLIENT_WORD), self.word(SERVER_WORD));
        let mut samples = Vec::with_capacity(run.iters as usize);
        let mut last = Instant::now();
        for i in 0..run.warmup + run.iters {
            let seq = run.seq + i + 1;
            theirs.store(seq, Ordering::Release);
            while mine.load(Ordering::Acquire) != seq {
                spin.turn(&|| format!("the server's flag #{seq}"))?;
            }
            spin.progress();
            let now = Instant::now();
            if i >= run.warmup {
                samples.push((now - last).as_nanos() as u64);
            }
            last = now;
        }
        Ok(samples)
    }

    /// The server's side: answer every flag.
    pub fn server(&self, spin: &mut Spin<'_>, run: &RunSpec) -> Result<()> {
        let (mine, theirs) = (self.word(SERVER_WORD), self.word(CLIENT_WORD));
        for i in 0..run.warmup + run.iters {
            let seq = run.seq + i + 1;
            while mine.load(Ordering::Acquire) != seq {
                spin.turn(&|| format!("the client's flag #{seq}"))?;
            }
            spin.progress();
            theirs.store(seq, Ordering::Release);
        }
        Ok(())
    }
}

impl Drop for FlagPage {
    fn drop(&mut self) {
        // SAFETY: our own mapping; no reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), PAGE) };
    }
}
