//! The disk tier: a file of fixed-alignment extents on a local (NVMe) file system.
//!
//! This is the bottom tier of the block store (Mooncake's design): values evicted from memory
//! go to extents of one preallocated file, read back on a miss.
//!
//! - [`DiskTier::open`] takes the path of the **file** (not a directory). The file is created
//!   (mode 0600) or, if it exists, truncated, and sized to the capacity; it is locked (`flock`)
//!   while the tier is open, so a second tier on the same file is refused. With
//!   [`DiskOptions::preallocate`] (the default) its blocks are reserved with `fallocate`, so a
//!   file system without room for the capacity is found at open ([`Error::TierFull`]); without
//!   it the file is sparse and the file system's `ENOSPC` is found at write, also as
//!   [`Error::TierFull`] naming the tier.
//! - The file is opened with `O_DIRECT` where the file system supports it (ext4, xfs, and tmpfs
//!   since Linux 6.6): the page cache is bypassed. Where `O_DIRECT` is refused with `EINVAL`, the
//!   tier falls back to buffered I/O and drops the pages it touched with
//!   `posix_fadvise(DONTNEED)`; [`DiskTier::direct`] says which mode is in use, and the choice is
//!   logged.
//! - Space is handed out as [`Extent`]s, whole multiples of [`DISK_ALIGN`] (4096 bytes, the
//!   `O_DIRECT` requirement), by a best-fit allocator that merges neighbouring free extents.
//! - [`DiskTier::write`] and [`DiskTier::read`] take `&self` and may be called from many threads
//!   at once. A transfer is cut into chunks of [`DiskOptions::chunk_size`] bytes that run in
//!   parallel, on the calling thread and up to `threads - 1` pool workers
//!   ([`DiskOptions::threads`]), each a `pread`/`pwrite` (short transfers and `EINTR` are
//!   retried). A caller's buffer that is aligned in address and length is transferred in
//!   place; otherwise each chunk goes through a page-aligned bounce buffer from a small pool.
//! - Dropping the tier removes the file if the tier created it, unless
//!   [`DiskOptions::keep_file`] is set. An existing file that was truncated is left in place.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io;
use std::num::NonZeroU64;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::fs::{Advice, FallocateFlags, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// The unit of disk space: extents start and end on multiples of it, and `O_DIRECT` transfers
/// use buffers aligned to it.
pub const DISK_ALIGN: u64 = 4096;

const ALIGN: usize = DISK_ALIGN as usize;
/// How long opening a tier waits for a file lock held by a tier that was just dropped (see
/// `DiskTier::open`).
const LOCK_GRACE: Duration = Duration::from_millis(200);

/// Whether the tier bypasses the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// `O_DIRECT` where the file system accepts it, buffered I/O otherwise (the default).
    #[default]
    Auto,
    /// `O_DIRECT` or fail at open ([`Error::InvalidArgument`]): for measurements that must not
    /// read the page cache.
    Require,
    /// Buffered I/O (pages dropped after use with `posix_fadvise(DONTNEED)`).
    Off,
}

/// How a [`DiskTier`] is opened.
#[derive(Debug, Clone)]
pub struct DiskOptions {
    /// Bytes per `pread`/`pwrite`: a transfer larger than this is split into chunks that run in
    /// parallel. A nonzero multiple of [`DISK_ALIGN`]; default 1 MiB. It is also the size of
    /// each bounce buffer.
    pub chunk_size: usize,
    /// The most chunks of one transfer in flight at once: the calling thread plus
    /// `threads - 1` pool workers (shared by all callers). 1 to 64; default 4, measured on a
    /// 2-vCPU machine whose virtio disk wants more than one request in flight (see
    /// `bench/kv-disk.sh`).
    pub threads: usize,
    /// Reserve the whole capacity with `fallocate` at open (default `true`). Without it the
    /// file is sparse and space is taken from the file system as extents are first written.
    pub preallocate: bool,
    /// `O_DIRECT` or not; default [`DirectIo::Auto`].
    pub direct: DirectIo,
    /// Leave the file in place when the tier is dropped, even if the tier created it
    /// (default `false`).
    pub keep_file: bool,
}

impl Default for DiskOptions {
    fn default() -> DiskOptions {
        DiskOptions {
            chunk_size: 1 << 20,
            threads: 4,
            preallocate: true,
            direct: DirectIo::Auto,
            keep_file: false,
        }
    }
}

/// A piece of a [`DiskTier`]'s file, from [`DiskTier::alloc`]: whole multiples of
/// [`DISK_ALIGN`]. It is only valid on the tier that handed it out, until it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    tier: u64,
    offset: u64,
    len: u64,
}

impl Extent {
    /// Where the extent starts in the file (a multiple of [`DISK_ALIGN`]).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The extent's size in bytes (a nonzero multiple of [`DISK_ALIGN`], at least what was
    /// asked of [`DiskTier::alloc`]).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: extents are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A [`DiskTier`]'s counters since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Bytes returned by successful [`DiskTier::read`]s.
    pub bytes_read: u64,
    /// Bytes stored by successful [`DiskTier::write`]s.
    pub bytes_written: u64,
    /// Successful reads.
    pub reads: u64,
    /// Successful writes.
    pub writes: u64,
    /// Reads and writes that failed.
    pub errors: u64,
    /// Time spent in reads, summed over calls (concurrent calls each count their own time).
    pub read_time: Duration,
    /// Time spent in writes, summed over calls.
    pub write_time: Duration,
    /// Chunks transferred straight from or into the caller's buffer.
    pub direct_chunks: u64,
    /// Chunks that went through a bounce buffer (an unaligned caller buffer under `O_DIRECT`).
    pub bounced_chunks: u64,
}

// ---------------------------------------------------------------------------------------------
// Space management.

/// Best-fit allocator of aligned extents; free extents are merged with their neighbours.
#[derive(Debug)]
pub(crate) struct Allocator {
    capacity: u64,
    /// Free extents: offset -> length.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free extents ordered by (length, offset), for best fit.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Extents handed out: offset -> length.
    used: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl Allocator {
    pub(crate) fn new(capacity: u64) -> Allocator {
        let mut a = Allocator {
            capacity,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            used: BTreeMap::new(),
            free_bytes: 0,
        };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.insert(offset, len);
        self.free_by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    pub(crate) fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Takes `len` bytes (a nonzero multiple of the alignment): the smallest free extent that
    /// fits, lowest offset first among equals. `None` when nothing fits.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let &(flen, offset) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(offset, flen);
        if flen > len {
            self.insert_free(offset + len, flen - len);
        }
        self.used.insert(offset, len);
        Some(offset)
    }

    /// Gives back an extent handed out by [`Allocator::alloc`].
    pub(crate) fn free(&mut self, offset: u64, len: u64) -> std::result::Result<(), &'static str> {
        match self.used.get(&offset) {
            Some(&l) if l == len => {}
            Some(_) => return Err("its length does not match the extent allocated there"),
            None => return Err("it is not allocated (freed twice?)"),
        }
        self.used.remove(&offset);
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&poff, &plen)) = self.free_by_offset.range(..offset).next_back()
            && poff + plen == offset
        {
            self.remove_free(poff, plen);
            start = poff;
        }
        if let Some(&nlen) = self.free_by_offset.get(&end) {
            self.remove_free(end, nlen);
            end += nlen;
        }
        self.insert_free(start, end - start);
        Ok(())
    }

    fn is_allocated(&self, offset: u64, len: u64) -> bool {
        self.used.get(&offset) == Some(&len)
    }
}

// ---------------------------------------------------------------------------------------------
// Aligned bounce buffers.

/// A page-aligned, zero-initialised buffer: a `Vec` over-allocated by one page, used from its
/// first aligned byte (no `unsafe` needed).
struct AlignedBuf {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let vec = vec![0u8; len + ALIGN];
        let start = vec.as_ptr().align_offset(ALIGN);
        AlignedBuf { vec, start, len }
    }

    fn as_slice(&self) -> &[u8] {
        &self.vec[self.start..self.start + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

/// Bounce buffers of one size, kept for reuse (up to `keep` of them).
struct BufPool {
    size: usize,
    keep: usize,
    free: Mutex<Vec<AlignedBuf>>,
}

impl BufPool {
    fn get(&self) -> AlignedBuf {
        lock(&self.free)
            .pop()
            .unwrap_or_else(|| AlignedBuf::new(self.size))
    }

    fn put(&self, buf: AlignedBuf) {
        let mut free = lock(&self.free);
        if free.len() < self.keep {
            free.push(buf);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn is_aligned(ptr: *const u8, len: usize) -> bool {
    (ptr as usize).is_multiple_of(ALIGN) && len.is_multiple_of(ALIGN)
}

// ---------------------------------------------------------------------------------------------
// The shared state of the tier and its workers.

#[derive(Default)]
struct Counters {
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    errors: AtomicU64,
    read_ns: AtomicU64,
    write_ns: AtomicU64,
    direct_chunks: AtomicU64,
    bounced_chunks: AtomicU64,
}

struct Queue {
    tickets: VecDeque<Arc<Batch>>,
    shutdown: bool,
}

struct Shared {
    fd: OwnedFd,
    direct: bool,
    chunk: usize,
    /// `disk at /path`, the name errors give the tier.
    name: String,
    pool: BufPool,
    counters: Counters,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// The caller's buffer, as a pointer the workers can hold.
#[derive(Clone, Copy)]
struct BufPtr(*mut u8);

// SAFETY: a `BufPtr` is only dereferenced for chunks of a batch while the call that owns the
// buffer waits for them (see `Shared::chunk_slice`); each chunk is a disjoint range handed to
// exactly one thread, so sending the pointer to a worker is like sending it a `&mut [u8]`
// sub-slice (or a `&[u8]` one for writes).
unsafe impl Send for BufPtr {}
// SAFETY: as above; threads share only the pointer value, never the same bytes.
unsafe impl Sync for BufPtr {}

/// One read or write in flight: its chunks are claimed one at a time by the caller and the
/// workers holding a ticket for it.
struct Batch {
    kind: Kind,
    base: BufPtr,
    len: usize,
    file_offset: u64,
    nchunks: usize,
    next: AtomicUsize,
    failed: AtomicBool,
    state: Mutex<BatchState>,
    done: Condvar,
}

struct BatchState {
    finished: usize,
    error: Option<Error>,
}

impl Batch {
    fn finish(&self, result: Result<()>) {
        let mut st = lock(&self.state);
        if let Err(e) = result {
            self.failed.store(true, Ordering::Release);
            if st.error.is_none() {
                st.error = Some(e);
            }
        }
        st.finished += 1;
        if st.finished == self.nchunks {
            self.done.notify_all();
        }
    }
}

/// Counts a claimed chunk as finished when dropped: after its transfer, or while unwinding
/// from a panic inside it, so that the caller never stops waiting while a chunk still touches
/// its buffer.
struct ChunkGuard<'a> {
    batch: &'a Batch,
    result: Option<Result<()>>,
}

impl Drop for ChunkGuard<'_> {
    fn drop(&mut self) {
        let result = self.result.take().unwrap_or_else(|| {
            Err(Error::io(
                "disk tier chunk",
                io::Error::other("a disk worker panicked"),
            ))
        });
        self.batch.finish(result);
    }
}

/// Waits, when dropped, until every chunk of the batch is finished: the caller's buffer must
/// outlive every access to it, even if the caller unwinds.
struct WaitAll<'a>(&'a Batch);

impl Drop for WaitAll<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.0.state);
        while st.finished < self.0.nchunks {
            st = self.0.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Shared {
    /// Claims and runs chunks of `batch` until none is left.
    fn work(&self, batch: &Batch) {
        loop {
            let i = batch.next.fetch_add(1, Ordering::AcqRel);
            if i >= batch.nchunks {
                return;
            }
            let mut guard = ChunkGuard {
                batch,
                result: None,
            };
            // After a failure the remaining chunks are skipped (counted, not transferred).
            let r = if batch.failed.load(Ordering::Acquire) {
                Ok(())
            } else {
                self.run_chunk(batch, i)
            };
            guard.result = Some(r);
        }
    }

    fn run_chunk(&self, batch: &Batch, i: usize) -> Result<()> {
        let start = i * self.chunk;
        let len = self.chunk.min(batch.len - start);
        let offset = batch.file_offset + start as u64;
        // SAFETY: `base .. base + batch.len` is the caller's buffer (`&mut [u8]` for a read,
        // `&[u8]` for a write), borrowed by `DiskTier::transfer` for the whole call; the call
        // does not return (nor unwind) before every claimed chunk is finished (`WaitAll`, and
        // `ChunkGuard` counts a chunk only after this slice is gone). Chunk `i` was claimed by
        // this thread alone (`fetch_add`), chunks do not overlap, and the caller does not use
        // its slice during the call, so this is the only reference to these bytes.
        // `start + len <= batch.len` because `i < nchunks = ceil(len / chunk)`.
        match batch.kind {
            Kind::Read => {
                let out = unsafe { std::slice::from_raw_parts_mut(batch.base.0.add(start), len) };
                self.read_chunk(out, offset)
            }
            Kind::Write => {
                // SAFETY: as above; a write only reads the bytes.
                let data = unsafe { std::slice::from_raw_parts(batch.base.0.add(start), len) };
                self.write_chunk(data, offset)
            }
        }
    }

    fn write_chunk(&self, data: &[u8], offset: u64) -> Result<()> {
        if !self.direct || is_aligned(data.as_ptr(), data.len()) {
            self.counters.direct_chunks.fetch_add(1, Ordering::Relaxed);
            self.pwrite_all(data, offset)?;
            self.drop_cache(offset, data.len());
            return Ok(());
        }
        self.counters.bounced_chunks.fetch_add(1, Ordering::Relaxed);
        let mut buf = self.pool.get();
        let padded = data.len().next_multiple_of(ALIGN);
        let b = buf.as_mut_slice();
        b[..data.len()].copy_from_slice(data);
        b[data.len()..padded].fill(0);
        let r = self.pwrite_all(&buf.as_slice()[..padded], offset);
        self.pool.put(buf);
        r
    }

    fn read_chunk(&self, out: &mut [u8], offset: u64) -> Result<()> {
        if !self.direct || is_aligned(out.as_ptr(), out.len()) {
            self.counters.direct_chunks.fetch_add(1, Ordering::Relaxed);
            self.pread_exact(out, offset)?;
            self.drop_cache(offset, out.len());
            return Ok(());
        }
        self.counters.bounced_chunks.fetch_add(1, Ordering::Relaxed);
        let mut buf = self.pool.get();
        let padded = out.len().next_multiple_of(ALIGN);
        let r = self.pread_exact(&mut buf.as_mut_slice()[..padded], offset);
        if r.is_ok() {
            out.copy_from_slice(&buf.as_slice()[..out.len()]);
        }
        self.pool.put(buf);
        r
    }

    /// Buffered mode only: drop the pages just used (dirty ones are queued for writeback).
    fn drop_cache(&self, offset: u64, len: usize) {
        if !self.direct {
            let _ = rustix::fs::fadvise(
                &self.fd,
                offset,
                NonZeroU64::new(len as u64),
                Advice::DontNeed,
            );
        }
    }

    fn pwrite_all(&self, mut data: &[u8], mut offset: u64) -> Result<()> {
        let total = data.len();
        let start = offset;
        while !data.is_empty() {
            match rustix::io::pwrite(&self.fd, data, offset) {
                Ok(0) => {
                    return Err(Error::io(
                        format!("writing {total} bytes at offset {start} of {}", self.name),
                        io::Error::new(io::ErrorKind::WriteZero, "pwrite wrote nothing"),
                    ));
                }
                Ok(n) => {
                    data = &data[n..];
                    offset += n as u64;
                }
                Err(Errno::INTR) => {}
                Err(e @ (Errno::NOSPC | Errno::DQUOT)) => {
                    return Err(Error::TierFull {
                        tier: self.name.clone(),
                        detail: format!(
                            "the file system has no room for the {total}-byte chunk at offset {start} \
                             ({}); the file is sparse or the disk is shared",
                            io::Error::from(e)
                        ),
                    });
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("writing {total} bytes at offset {start} of {}", self.name),
                        e.into(),
                    ));
                }
            }
        }
        Ok(())
    }

    fn pread_exact(&self, mut out: &mut [u8], mut offset: u64) -> Result<()> {
        let total = out.len();
        let start = offset;
        while !out.is_empty() {
            match rustix::io::pread(&self.fd, &mut *out, offset) {
                Ok(0) => {
                    return Err(Error::io(
                        format!("reading {total} bytes at offset {start} of {}", self.name),
                        io::Error::new(io::ErrorKind::UnexpectedEof, "the file is too short"),
                    ));
                }
                Ok(n) => {
                    out = &mut std::mem::take(&mut out)[n..];
                    offset += n as u64;
                }
                Err(Errno::INTR) => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("reading {total} bytes at offset {start} of {}", self.name),
                        e.into(),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn worker(shared: Arc<Shared>) {
    loop {
        let batch = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(b) = q.tickets.pop_front() {
                    break b;
                }
                if q.shutdown {
                    return;
                }
                q = shared.queue_cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        // A panic inside a chunk is reported to its caller by `ChunkGuard`; the worker lives on.
        let _ = catch_unwind(AssertUnwindSafe(|| shared.work(&batch)));
    }
}

// ---------------------------------------------------------------------------------------------
// The tier.

static NEXT_TIER_ID: AtomicU64 = AtomicU64::new(1);

/// The disk tier: a file of [`Extent`]s with parallel, page-cache-bypassing I/O. See the
/// [module documentation](self).
pub struct DiskTier {
    id: u64,
    shared: Arc<Shared>,
    alloc: Mutex<Allocator>,
    workers: Vec<JoinHandle<()>>,
    path: PathBuf,
    capacity: u64,
    created: bool,
    keep_file: bool,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("path", &self.path)
            .field("capacity", &self.capacity)
            .field("direct", &self.shared.direct)
            .field("free", &self.free_bytes())
            .finish()
    }
}

impl DiskTier {
    /// Creates (or truncates) the file at `path` and makes it a tier of `capacity` bytes
    /// (rounded down to a multiple of [`DISK_ALIGN`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for a capacity under one [`DISK_ALIGN`], a bad
    /// option, or `O_DIRECT` refused under [`DirectIo::Require`]; [`Error::TierFull`] when
    /// the file system has no room for the preallocation; [`Error::Io`] otherwise.
    pub fn open(path: &Path, capacity: u64, opts: DiskOptions) -> Result<DiskTier> {
        let capacity = capacity - capacity % DISK_ALIGN;
        if capacity == 0 {
            return Err(Error::arg(format!(
                "disk tier at {}: capacity must be at least {DISK_ALIGN} bytes",
                path.display()
            )));
        }
        if capacity > i64::MAX as u64 {
            return Err(Error::arg(format!(
                "disk tier at {}: capacity {capacity} is too large",
                path.display()
            )));
        }
        if opts.chunk_size == 0 || !opts.chunk_size.is_multiple_of(ALIGN) {
            return Err(Error::arg(format!(
                "disk tier chunk_size {} must be a nonzero multiple of {DISK_ALIGN}",
                opts.chunk_size
            )));
        }
        if !(1..=64).contains(&opts.threads) {
            return Err(Error::arg(format!(
                "disk tier threads {} must be 1 to 64",
                opts.threads
            )));
        }
        let name = format!("disk at {}", path.display());

        let mode = Mode::RUSR | Mode::WUSR;
        let base = OFlags::RDWR | OFlags::CLOEXEC;
        let (fd, created) = match rustix::fs::open(path, base | OFlags::CREATE | OFlags::EXCL, mode)
        {
            Ok(fd) => (fd, true),
            Err(Errno::EXIST) => match rustix::fs::open(path, base, mode) {
                Ok(fd) => (fd, false),
                Err(e) => return Err(Error::io(format!("opening {}", path.display()), e.into())),
            },
            Err(e) => return Err(Error::io(format!("creating {}", path.display()), e.into())),
        };
        let cleanup = |e: Error| {
            if created {
                let _ = rustix::fs::unlink(path);
            }
            e
        };

        // One tier per file: an existing file is truncated only once its lock is held. A lock
        // held is waited on for up to LOCK_GRACE: a tier just dropped may still hold it for a
        // moment through a child another thread is forking (the child keeps a copy of the file
        // description until it execs).
        let grace = Instant::now() + LOCK_GRACE;
        let locked = loop {
            match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
                Err(Errno::WOULDBLOCK) if Instant::now() < grace => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                r => break r,
            }
        };
        match locked {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => {
                return Err(cleanup(Error::arg(format!(
                    "{name}: the file is in use by another disk tier (locked)"
                ))));
            }
            Err(e) => {
                return Err(cleanup(Error::io(
                    format!("locking {}", path.display()),
                    e.into(),
                )));
            }
        }
        let direct = Self::setup_file(&fd, path, &name, capacity, &opts).map_err(cleanup)?;
        tracing::info!(
            path = %path.display(),
            capacity,
            direct,
            preallocated = opts.preallocate,
            "disk tier opened ({})",
            if direct { "O_DIRECT" } else { "buffered, O_DIRECT refused by the file system" }
        );

        let shared = Arc::new(Shared {
            fd,
            direct,
            chunk: opts.chunk_size,
            name,
            pool: BufPool {
                size: opts.chunk_size,
                keep: 2 * opts.threads,
                free: Mutex::new(Vec::new()),
            },
            counters: Counters::default(),
            queue: Mutex::new(Queue {
                tickets: VecDeque::new(),
                shutdown: false,
            }),
            queue_cv: Condvar::new(),
        });
        let mut tier = DiskTier {
            id: NEXT_TIER_ID.fetch_add(1, Ordering::Relaxed),
            shared: Arc::clone(&shared),
            alloc: Mutex::new(Allocator::new(capacity)),
            workers: Vec::new(),
            path: path.to_path_buf(),
            capacity,
            created,
            keep_file: opts.keep_file,
        };
        for i in 1..opts.threads {
            let s = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("oxccl-kv-disk-{i}"))
                .spawn(move || worker(s))
                .map_err(|e| Error::io("starting a disk tier worker thread", e))?;
            tier.workers.push(h);
        }
        Ok(tier)
    }

    /// Sizes (and preallocates) the file and settles `O_DIRECT`; returns whether it is on.
    fn setup_file(
        fd: &OwnedFd,
        path: &Path,
        name: &str,
        capacity: u64,
        opts: &DiskOptions,
    ) -> Result<bool> {
        rustix::fs::ftruncate(fd, 0)
            .map_err(|e| Error::io(format!("truncating {}", path.display()), e.into()))?;
        rustix::fs::ftruncate(fd, capacity).map_err(|e| {
            Error::io(
                format!("sizing {} to {capacity} bytes", path.display()),
                e.into(),
            )
        })?;
        if opts.preallocate {
            match rustix::fs::fallocate(fd, FallocateFlags::empty(), 0, capacity) {
                Ok(()) => {}
                Err(e @ (Errno::NOSPC | Errno::DQUOT)) => {
                    return Err(Error::TierFull {
                        tier: name.to_string(),
                        detail: format!(
                            "the file system has no room to preallocate {capacity} bytes ({})",
                            io::Error::from(e)
                        ),
                    });
                }
                Err(e @ (Errno::OPNOTSUPP | Errno::NOSYS)) => {
                    tracing::warn!(
                        path = %path.display(),
                        "fallocate not supported ({}); the disk tier file stays sparse",
                        io::Error::from(e)
                    );
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("preallocating {capacity} bytes for {}", path.display()),
                        e.into(),
                    ));
                }
            }
        }
        if opts.direct == DirectIo::Off {
            return Ok(false);
        }
        let refused = |why: String| -> Result<bool> {
            if opts.direct == DirectIo::Require {
                Err(Error::arg(format!(
                    "{name}: O_DIRECT was required but the file system refuses it ({why})"
                )))
            } else {
                tracing::warn!(path = %path.display(), "O_DIRECT refused ({why}); buffered I/O");
                Ok(false)
            }
        };
        let flags = rustix::fs::fcntl_getfl(fd)
            .map_err(|e| Error::io(format!("fcntl(F_GETFL) on {}", path.display()), e.into()))?;
        match rustix::fs::fcntl_setfl(fd, flags | OFlags::DIRECT) {
            Ok(()) => {}
            Err(Errno::INVAL) => return refused("fcntl(O_DIRECT): EINVAL".into()),
            Err(e) => {
                return Err(Error::io(
                    format!("setting O_DIRECT on {}", path.display()),
                    e.into(),
                ));
            }
        }
        // Some file systems accept the flag and refuse the I/O: probe one aligned block.
        let mut probe = AlignedBuf::new(ALIGN);
        match pread_once(fd.as_fd(), probe.as_mut_slice(), 0) {
            Ok(_) => Ok(true),
            Err(Errno::INVAL) => {
                rustix::fs::fcntl_setfl(fd, flags).map_err(|e| {
                    Error::io(format!("clearing O_DIRECT on {}", path.display()), e.into())
                })?;
                refused(format!(
                    "an aligned {DISK_ALIGN}-byte O_DIRECT read: EINVAL"
                ))
            }
            Err(e) => Err(Error::io(
                format!("probing O_DIRECT reads of {}", path.display()),
                e.into(),
            )),
        }
    }

    /// Whether the file is open with `O_DIRECT` (the page cache is bypassed).
    pub fn direct(&self) -> bool {
        self.shared.direct
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tier's name in errors: `disk at /path`.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The capacity in bytes (a multiple of [`DISK_ALIGN`]).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes not allocated to any extent.
    pub fn free_bytes(&self) -> u64 {
        lock(&self.alloc).free_bytes
    }

    /// The largest extent [`DiskTier::alloc`] could hand out now.
    pub fn largest_free(&self) -> u64 {
        lock(&self.alloc).largest_free()
    }

    /// Allocates an extent of at least `len` bytes (rounded up to [`DISK_ALIGN`]).
    ///
    /// Errors: [`Error::TierFull`] naming the tier, the size asked, what is free and the
    /// capacity, when no free extent is large enough; [`Error::InvalidArgument`] for `len` 0.
    pub fn alloc(&self, len: u64) -> Result<Extent> {
        if len == 0 {
            return Err(Error::arg(format!(
                "{}: cannot allocate 0 bytes",
                self.name()
            )));
        }
        let full = |a: &Allocator| Error::TierFull {
            tier: self.shared.name.clone(),
            detail: format!(
                "{len} bytes asked, {} free of {} (largest free extent {})",
                a.free_bytes,
                a.capacity,
                a.largest_free()
            ),
        };
        let mut a = lock(&self.alloc);
        let Some(rounded) = len.checked_next_multiple_of(DISK_ALIGN) else {
            return Err(full(&a));
        };
        match a.alloc(rounded) {
            Some(offset) => Ok(Extent {
                tier: self.id,
                offset,
                len: rounded,
            }),
            None => Err(full(&a)),
        }
    }

    /// Gives an extent back. Errors ([`Error::InvalidArgument`]) for an extent of another tier
    /// or one already freed.
    pub fn free(&self, extent: Extent) -> Result<()> {
        if extent.tier != self.id {
            return Err(Error::arg(format!(
                "{}: freeing an extent of another tier",
                self.name()
            )));
        }
        lock(&self.alloc)
            .free(extent.offset, extent.len)
            .map_err(|why| {
                Error::arg(format!(
                    "{}: cannot free the extent at {} ({} bytes): {why}",
                    self.name(),
                    extent.offset,
                    extent.len
                ))
            })
    }

    /// Writes `data` at the start of `extent` (`data.len() <= extent.len()`). Under `O_DIRECT`
    /// an unaligned tail is padded with zeros to [`DISK_ALIGN`] inside the extent. Returns
    /// when every chunk is on the file (in the device's hands; see [`DiskTier::sync`] for
    /// durability), or with the first error: [`Error::TierFull`] if the file system runs out
    /// of space (a sparse file), [`Error::Io`] otherwise. After an error the extent's content
    /// is unspecified.
    pub fn write(&self, extent: &Extent, data: &[u8]) -> Result<()> {
        self.check(extent, data.len(), "write")?;
        let t = Instant::now();
        // A write only reads through the pointer.
        let r = self.transfer(
            Kind::Write,
            data.as_ptr().cast_mut(),
            data.len(),
            extent.offset,
        );
        let c = &self.shared.counters;
        match r {
            Ok(()) => {
                c.writes.fetch_add(1, Ordering::Relaxed);
                c.bytes_written
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
            Err(_) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        c.write_ns.fetch_add(elapsed_ns(t), Ordering::Relaxed);
        r
    }

    /// Reads the first `out.len()` bytes of `extent` into `out` (`out.len() <= extent.len()`).
    /// Bytes never written read as zeros or as the extent's previous content.
    pub fn read(&self, extent: &Extent, out: &mut [u8]) -> Result<()> {
        self.check(extent, out.len(), "read")?;
        let t = Instant::now();
        let len = out.len();
        let r = self.transfer(Kind::Read, out.as_mut_ptr(), len, extent.offset);
        let c = &self.shared.counters;
        match r {
            Ok(()) => {
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
            }
            Err(_) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        c.read_ns.fetch_add(elapsed_ns(t), Ordering::Relaxed);
        r
    }

    /// `fdatasync`s the file: what was written survives a crash.
    pub fn sync(&self) -> Result<()> {
        rustix::fs::fdatasync(&self.shared.fd)
            .map_err(|e| Error::io(format!("fdatasync of {}", self.name()), e.into()))
    }

    /// The counters so far.
    pub fn stats(&self) -> DiskStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            bytes_read: get(&c.bytes_read),
            bytes_written: get(&c.bytes_written),
            reads: get(&c.reads),
            writes: get(&c.writes),
            errors: get(&c.errors),
            read_time: Duration::from_nanos(get(&c.read_ns)),
            write_time: Duration::from_nanos(get(&c.write_ns)),
            direct_chunks: get(&c.direct_chunks),
            bounced_chunks: get(&c.bounced_chunks),
        }
    }

    fn check(&self, extent: &Extent, len: usize, what: &str) -> Result<()> {
        if extent.tier != self.id {
            return Err(Error::arg(format!(
                "{}: {what} on an extent of another tier",
                self.name()
            )));
        }
        if len as u64 > extent.len {
            return Err(Error::arg(format!(
                "{}: {what} of {len} bytes into an extent of {} bytes at offset {}",
                self.name(),
                extent.len,
                extent.offset
            )));
        }
        if !lock(&self.alloc).is_allocated(extent.offset, extent.len) {
            return Err(Error::arg(format!(
                "{}: {what} on the extent at {} ({} bytes), which is not allocated",
                self.name(),
                extent.offset,
                extent.len
            )));
        }
        Ok(())
    }

    /// Runs one read or write over the caller's buffer `base .. base + len` (borrowed by the
    /// caller for the duration of this call) at `file_offset`.
    fn transfer(&self, kind: Kind, base: *mut u8, len: usize, file_offset: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let shared = &*self.shared;
        let nchunks = len.div_ceil(shared.chunk);
        let batch = Arc::new(Batch {
            kind,
            base: BufPtr(base),
            len,
            file_offset,
            nchunks,
            next: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            state: Mutex::new(BatchState {
                finished: 0,
                error: None,
            }),
            done: Condvar::new(),
        });
        {
            let _wait = WaitAll(&batch);
            let helpers = (nchunks - 1).min(self.workers.len());
            if helpers > 0 {
                let mut q = lock(&shared.queue);
                for _ in 0..helpers {
                    q.tickets.push_back(Arc::clone(&batch));
                }
                drop(q);
                for _ in 0..helpers {
                    shared.queue_cv.notify_one();
                }
            }
            shared.work(&batch);
        }
        lock(&batch.state).error.take().map_or(Ok(()), Err)
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.queue_cv.notify_all();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
        if self.created
            && !self.keep_file
            && let Err(e) = rustix::fs::unlink(&self.path)
        {
            tracing::warn!(path = %self.path.display(), "removing the disk tier file: {e}");
        }
    }
}

fn pread_once(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> rustix::io::Result<usize> {
    loop {
        match rustix::io::pread(fd, &mut *buf, offset) {
            Err(Errno::INTR) => continue,
            r => return r,
        }
    }
}

fn elapsed_ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
