//! Hand-written bindings: the C shim's plain functions (`shim.c`, which wraps libfabric's
//! inline calls) and the one libfabric struct read on this side, `fi_cq_data_entry`.
//!
//! [`Fabric`] owns an opened endpoint and is the only place that calls them: each method is a
//! small `unsafe` block over pointers it owns or that its caller vouches for.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// The shim's handle (fabric, domain, AV, CQ, endpoint).
#[repr(C)]
pub(super) struct RawFabric {
    _opaque: [u8; 0],
}

/// `struct fid_mr`, opaque.
#[repr(C)]
pub(super) struct RawMr {
    _opaque: [u8; 0],
}

/// `struct fi_cq_data_entry` (FI_CQ_FORMAT_DATA).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CqEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
}

impl Default for CqEntry {
    fn default() -> Self {
        CqEntry {
            op_context: std::ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: std::ptr::null_mut(),
            data: 0,
        }
    }
}

/// `struct oxofi_attr` of the shim: what the opened endpoint is like.
#[repr(C)]
pub(super) struct Attr {
    pub mr_mode: u64,
    pub caps: u64,
    pub mode: u64,
    pub msg_order: u64,
    pub max_msg_size: u64,
    pub inject_size: u64,
    pub iov_limit: u64,
    pub rma_iov_limit: u64,
    pub mr_key_size: u64,
    pub name_len: u64,
    pub waits: u64,
    pub prov: [c_char; 64],
    pub fabric: [c_char; 128],
    pub name: [u8; 256],
}

/// `FI_EAGAIN`.
pub(super) const FI_EAGAIN: isize = 11;
/// `FI_EAVAIL`: an error entry is at the head of the CQ.
pub(super) const FI_EAVAIL: isize = 259;
/// `FI_MR_VIRT_ADDR`: RMA addresses are virtual addresses (otherwise offsets into the region).
pub(super) const FI_MR_VIRT_ADDR: u64 = 1 << 4;
/// `FI_RECV` in a completion's flags.
pub(super) const FI_RECV: u64 = 1 << 10;

unsafe extern "C" {
    fn oxofi_open(
        prov: *const c_char,
        node: *const c_char,
        wait: c_int,
        out: *mut *mut RawFabric,
        attr: *mut Attr,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn oxofi_close(o: *mut RawFabric);
    fn oxofi_av_insert(o: *mut RawFabric, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    fn oxofi_mr_reg(
        o: *mut RawFabric,
        buf: *mut c_void,
        len: usize,
        key: u64,
        mr: *mut *mut RawMr,
        desc: *mut *mut c_void,
        key_out: *mut u64,
    ) -> c_int;
    fn oxofi_mr_close(mr: *mut RawMr) -> c_int;
    fn oxofi_recv(
        o: *mut RawFabric,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        ctx: *mut c_void,
    ) -> isize;
    fn oxofi_send(
        o: *mut RawFabric,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        ctx: *mut c_void,
    ) -> isize;
    fn oxofi_inject(o: *mut RawFabric, buf: *const c_void, len: usize, dest: u64) -> isize;
    fn oxofi_read(
        o: *mut RawFabric,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> isize;
    fn oxofi_write(
        o: *mut RawFabric,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        addr: u64,
        key: u64,
        data: u64,
        with_data: c_int,
        ctx: *mut c_void,
    ) -> isize;
    fn oxofi_cq_read(o: *mut RawFabric, buf: *mut CqEntry, n: usize) -> isize;
    fn oxofi_cq_sread(o: *mut RawFabric, buf: *mut CqEntry, n: usize, timeout_ms: c_int) -> isize;
    fn oxofi_cq_signal(o: *mut RawFabric) -> c_int;
    fn oxofi_cq_readerr(
        o: *mut RawFabric,
        ctx: *mut *mut c_void,
        err: *mut c_int,
        flags: *mut u64,
        msg: *mut c_char,
        msglen: usize,
    ) -> isize;
    fn oxofi_strerror(err: c_int) -> *const c_char;
}

/// libfabric's text for error `err` (positive `FI_E*`).
pub(super) fn strerror(err: isize) -> String {
    // SAFETY: fi_strerror returns a static NUL-terminated string for any value.
    unsafe { CStr::from_ptr(oxofi_strerror(err.unsigned_abs() as c_int)) }
        .to_string_lossy()
        .into_owned()
}

/// The calls into libfabric that should return at once, counted so that one that does not can
/// be named ([`Fabric::calls`]): libfabric 1.17's `shm` provider spins on a lock inside a
/// peer's shared memory, forever if that peer was killed while holding it.
#[derive(Default)]
pub(super) struct CallWatch {
    entered: AtomicU64,
    left: AtomicU64,
    last: AtomicU8,
}

/// The calls [`CallWatch`] names.
const CALLS: [&str; 6] = [
    "fi_recv",
    "fi_send",
    "fi_inject",
    "fi_read",
    "fi_writemsg",
    "fi_cq_read",
];

impl CallWatch {
    fn run<R>(&self, call: usize, f: impl FnOnce() -> R) -> R {
        self.last.store(call as u8, Ordering::Relaxed);
        self.entered.fetch_add(1, Ordering::Relaxed);
        let r = f();
        self.left.fetch_add(1, Ordering::Relaxed);
        r
    }

    /// Calls entered, calls returned, and the name of the last call entered.
    pub(super) fn sample(&self) -> (u64, u64, &'static str) {
        let left = self.left.load(Ordering::Relaxed);
        let entered = self.entered.load(Ordering::Relaxed);
        let last = CALLS
            .get(self.last.load(Ordering::Relaxed) as usize)
            .copied()
            .unwrap_or("?");
        (entered, left, last)
    }
}

/// An opened RDM endpoint with its fabric, domain, AV and CQ. Opened with `FI_THREAD_SAFE`:
/// every method may be called from any thread.
pub(super) struct Fabric {
    raw: *mut RawFabric,
    /// What it is like.
    pub attr: Box<Attr>,
    /// The data-path calls in progress.
    pub calls: CallWatch,
}

// SAFETY: the endpoint was opened with FI_THREAD_SAFE threading: libfabric serializes access to
// its objects itself.
unsafe impl Send for Fabric {}
// SAFETY: as above.
unsafe impl Sync for Fabric {}

/// A registration (`fid_mr`), closed by [`Fabric::mr_close`].
pub(super) struct Mr {
    pub raw: *mut RawMr,
    pub desc: *mut c_void,
    pub key: u64,
}

// SAFETY: a registration handle is only passed back to libfabric (thread-safe domain).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Fabric {
    /// Opens provider `prov` (empty: libfabric's choice) at `node`.
    pub(super) fn open(prov: &str, node: Option<&str>, wait: bool) -> Result<Fabric, String> {
        let prov_c = CString::new(prov).map_err(|_| "provider name has a NUL".to_string())?;
        let node_c = node
            .map(CString::new)
            .transpose()
            .map_err(|_| "address has a NUL".to_string())?;
        // SAFETY: Attr is plain data (integers and byte arrays): all zeroes is a valid value.
        let mut attr: Box<Attr> = Box::new(unsafe { std::mem::zeroed() });
        let mut raw = std::ptr::null_mut();
        let mut err = [0 as c_char; 256];
        // SAFETY: the strings are NUL-terminated and outlive the call; `attr`, `raw` and `err`
        // are valid for writes of their sizes.
        let r = unsafe {
            oxofi_open(
                if prov.is_empty() {
                    std::ptr::null()
                } else {
                    prov_c.as_ptr()
                },
                node_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                wait as c_int,
                &mut raw,
                &mut *attr,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if r != 0 {
            // SAFETY: the shim wrote a NUL-terminated message into `err` (snprintf).
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) };
            return Err(msg.to_string_lossy().into_owned());
        }
        Ok(Fabric {
            raw,
            attr,
            calls: CallWatch::default(),
        })
    }

    /// The provider's name (`tcp;ofi_rxm`, `shm`, ...).
    pub(super) fn prov_name(&self) -> String {
        // SAFETY: the shim wrote a NUL-terminated string (snprintf) into the array.
        unsafe { CStr::from_ptr(self.attr.prov.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The endpoint's own address (`fi_getname`).
    pub(super) fn name(&self) -> &[u8] {
        &self.attr.name[..(self.attr.name_len as usize).min(self.attr.name.len())]
    }

    /// Inserts a peer's endpoint name into the address vector.
    pub(super) fn av_insert(&self, name: &[u8]) -> Result<u64, isize> {
        let mut a = u64::MAX;
        // SAFETY: `name` is a complete endpoint name of this provider (a peer's fi_getname,
        // checked for length by the caller); `a` is valid for a write.
        let r = unsafe { oxofi_av_insert(self.raw, name.as_ptr().cast(), &mut a) };
        if r != 0 { Err(r as isize) } else { Ok(a) }
    }

    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay mapped until [`Fabric::mr_close`].
    pub(super) unsafe fn mr_reg(&self, addr: u64, len: usize, key: u64) -> Result<Mr, isize> {
        let mut mr = Mr {
            raw: std::ptr::null_mut(),
            desc: std::ptr::null_mut(),
            key: 0,
        };
        // SAFETY: the caller keeps the memory mapped; the out-pointers are valid.
        let r = unsafe {
            oxofi_mr_reg(
                self.raw,
                addr as usize as *mut c_void,
                len,
                key,
                &mut mr.raw,
                &mut mr.desc,
                &mut mr.key,
            )
        };
        if r != 0 { Err(r as isize) } else { Ok(mr) }
    }

    /// Closes a registration.
    pub(super) fn mr_close(&self, mr: Mr) {
        // SAFETY: `mr` came from `mr_reg` of this fabric and is closed once (moved in).
        unsafe { oxofi_mr_close(mr.raw) };
    }

    /// Posts a receive buffer.
    ///
    /// # Safety
    /// `buf` must stay valid, and `ctx` (64 bytes of scratch first) alive and unmoved, until
    /// the buffer's completion is read.
    pub(super) unsafe fn recv(&self, buf: *mut u8, len: usize, ctx: *mut c_void) -> isize {
        // SAFETY: forwarded from the caller.
        self.calls.run(0, || unsafe {
            oxofi_recv(self.raw, buf.cast(), len, std::ptr::null_mut(), ctx)
        })
    }

    /// Sends a message.
    ///
    /// # Safety
    /// `buf` and `ctx` must stay valid until the send's completion is read.
    pub(super) unsafe fn send(&self, buf: &[u8], dest: u64, ctx: *mut c_void) -> isize {
        // SAFETY: forwarded from the caller.
        self.calls.run(1, || unsafe {
            oxofi_send(
                self.raw,
                buf.as_ptr().cast(),
                buf.len(),
                std::ptr::null_mut(),
                dest,
                ctx,
            )
        })
    }

    /// Sends a small message without a completion (the buffer is copied).
    pub(super) fn inject(&self, buf: &[u8], dest: u64) -> isize {
        // SAFETY: fi_inject copies `buf` before returning.
        self.calls.run(2, || unsafe {
            oxofi_inject(self.raw, buf.as_ptr().cast(), buf.len(), dest)
        })
    }

    /// RMA read of the peer's `(addr, key)` into `buf`.
    ///
    /// # Safety
    /// `buf` (registered, `desc` its descriptor) and `ctx` must stay valid until the
    /// completion is read.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> isize {
        // SAFETY: forwarded from the caller.
        self.calls.run(3, || unsafe {
            oxofi_read(self.raw, buf.cast(), len, desc, src, addr, key, ctx)
        })
    }

    /// RMA write of `buf` to the peer's `(addr, key)`, delivery-complete, with remote CQ data
    /// when `data` is given.
    ///
    /// # Safety
    /// As [`Fabric::read`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn write(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        addr: u64,
        key: u64,
        data: Option<u64>,
        ctx: *mut c_void,
    ) -> isize {
        // SAFETY: forwarded from the caller.
        self.calls.run(4, || unsafe {
            oxofi_write(
                self.raw,
                buf.cast(),
                len,
                desc,
                dest,
                addr,
                key,
                data.unwrap_or(0),
                data.is_some() as c_int,
                ctx,
            )
        })
    }

    /// Reads completions (`fi_cq_read`): a count, `-FI_EAGAIN` or `-FI_EAVAIL`.
    pub(super) fn cq_read(&self, out: &mut [CqEntry]) -> isize {
        // SAFETY: `out` is valid for `out.len()` entries of the CQ's format (DATA).
        self.calls.run(5, || unsafe {
            oxofi_cq_read(self.raw, out.as_mut_ptr(), out.len())
        })
    }

    /// As [`Fabric::cq_read`], blocking up to `timeout_ms` (CQs with a wait object only).
    pub(super) fn cq_sread(&self, out: &mut [CqEntry], timeout_ms: i32) -> isize {
        // SAFETY: as in `cq_read`.
        unsafe { oxofi_cq_sread(self.raw, out.as_mut_ptr(), out.len(), timeout_ms) }
    }

    /// Wakes a thread blocked in [`Fabric::cq_sread`].
    pub(super) fn cq_signal(&self) {
        // SAFETY: plain call on the owned CQ.
        unsafe { oxofi_cq_signal(self.raw) };
    }

    /// The error entry at the head of the CQ: (operation context, error, flags, message).
    pub(super) fn cq_readerr(&self) -> Option<(*mut c_void, i32, u64, String)> {
        let mut ctx = std::ptr::null_mut();
        let mut err = 0;
        let mut flags = 0;
        let mut msg = [0 as c_char; 256];
        // SAFETY: the out-pointers are valid; `msg` for its length.
        let n = unsafe {
            oxofi_cq_readerr(
                self.raw,
                &mut ctx,
                &mut err,
                &mut flags,
                msg.as_mut_ptr(),
                msg.len(),
            )
        };
        if n != 1 {
            return None;
        }
        // SAFETY: the shim wrote a NUL-terminated message (snprintf).
        let text = unsafe { CStr::from_ptr(msg.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Some((ctx, err, flags, text))
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: `raw` came from oxofi_open and is closed once, here.
        unsafe { oxofi_close(self.raw) };
    }
}
