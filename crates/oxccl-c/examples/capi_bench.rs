//! The C API's cost over the Rust call: a small all-reduce (2 `f32`, 8 bytes) through
//! `oxcclAllReduce` (from `liboxccl.so`, loaded with `dlopen`) and through
//! `Communicator::all_reduce`, interleaved in rounds in one run, on two communicators of the
//! same ranks. Run it under the launcher, in release:
//!
//! ```text
//! cargo build --release -p oxccl-c --example capi_bench
//! oxccl run -n 2 target/release/examples/capi_bench [ROUNDS] [ITERS]
//! ```
//!
//! Rank 0 prints each round's mean time per call of both, then the medians and minima and
//! their differences.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::time::Instant;

use oxccl::{Communicator, ReduceOp};

type GetUniqueId = unsafe extern "C" fn(*mut [u8; 128]) -> c_int;
type InitRank = unsafe extern "C" fn(*mut *mut c_void, c_int, [u8; 128], c_int) -> c_int;
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, *mut c_void) -> c_int;
type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
type LastError = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// `oxcclFloat32` and `oxcclSum` in oxccl.h.
const FLOAT32: c_int = 7;
const SUM: c_int = 0;

/// The C API's functions, from `liboxccl.so`.
struct Lib {
    get_unique_id: GetUniqueId,
    init_rank: InitRank,
    all_reduce: AllReduce,
    destroy: Destroy,
    last_error: LastError,
}

fn load(path: &str) -> Lib {
    let cpath = CString::new(path).expect("a path without NUL");
    // SAFETY: a NUL-terminated path; the library stays loaded until the process exits.
    let h = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen {path} failed");
    let sym = |name: &str| {
        let c = CString::new(name).expect("a name");
        // SAFETY: `h` is a live handle; `c` a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        assert!(!p.is_null(), "{name} is not in {path}");
        p
    };
    // SAFETY: each symbol is the extern "C" function of oxccl.h with this signature.
    unsafe {
        Lib {
            get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(sym("oxcclGetUniqueId")),
            init_rank: std::mem::transmute::<*mut c_void, InitRank>(sym("oxcclCommInitRank")),
            all_reduce: std::mem::transmute::<*mut c_void, AllReduce>(sym("oxcclAllReduce")),
            destroy: std::mem::transmute::<*mut c_void, Destroy>(sym("oxcclCommDestroy")),
            last_error: std::mem::transmute::<*mut c_void, LastError>(sym("oxcclGetLastError")),
        }
    }
}

impl Lib {
    fn check(&self, what: &str, r: c_int) {
        if r != 0 {
            // SAFETY: a NUL-terminated string owned by this thread.
            let msg = unsafe { CStr::from_ptr((self.last_error)(std::ptr::null_mut())) };
            panic!("{what} returned {r}: {}", msg.to_string_lossy());
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map_or(Ok(40), |s| s.parse())?;
    let iters: usize = args.get(2).map_or(Ok(2000), |s| s.parse())?;
    let exe = std::env::current_exe()?;
    let default_lib = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("liboxccl.so"))
        .ok_or("no profile directory")?;
    let path = std::env::var("OXCCL_LIB").unwrap_or_else(|_| default_lib.display().to_string());
    let lib = load(&path);

    let rust = Communicator::from_env()?;
    let rank = rust.rank();
    // The C communicator: rank 0 makes the id, the Rust communicator broadcasts it.
    let mut id = [0u8; 128];
    if rank == 0 {
        // SAFETY: a writable 128-byte id.
        lib.check("oxcclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) });
    }
    rust.broadcast_in_place(&mut id, 0)?;
    let mut c = std::ptr::null_mut();
    let world = rust.world_size() as c_int;
    // SAFETY: a writable handle.
    lib.check("oxcclCommInitRank", unsafe {
        (lib.init_rank)(&mut c, world, id, rank as c_int)
    });

    let x = [1.0f32, 2.0];
    let mut y = [0f32; 2];
    let c_call = |y: &mut [f32; 2]| {
        // SAFETY: 2 floats in, 2 out; a live communicator.
        let r = unsafe {
            (lib.all_reduce)(x.as_ptr().cast(), y.as_mut_ptr().cast(), 2, FLOAT32, SUM, c)
        };
        lib.check("oxcclAllReduce", r);
    };
    for _ in 0..iters {
        c_call(&mut y);
        rust.all_reduce(&x, &mut y, ReduceOp::Sum)?;
    }
    let (mut cs, mut rs) = (Vec::new(), Vec::new());
    if rank == 0 {
        println!(
            "# oxcclAllReduce vs Communicator::all_reduce, 8 bytes (2 f32, sum), {world} ranks"
        );
        println!("# {rounds} rounds of {iters} calls each, interleaved; mean us per call");
        println!("round c_api_us rust_us diff_us");
    }
    for round in 0..rounds {
        let t = Instant::now();
        for _ in 0..iters {
            c_call(&mut y);
        }
        let c_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let t = Instant::now();
        for _ in 0..iters {
            rust.all_reduce(&x, &mut y, ReduceOp::Sum)?;
        }
        let r_us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        assert_eq!(y, [world as f32, 2.0 * world as f32]);
        if rank == 0 {
            println!("{round} {c_us:.3} {r_us:.3} {:+.3}", c_us - r_us);
        }
        cs.push(c_us);
        rs.push(r_us);
    }
    if rank == 0 {
        let (cmin, rmin) = (
            cs.iter().copied().fold(f64::MAX, f64::min),
            rs.iter().copied().fold(f64::MAX, f64::min),
        );
        let (cmed, rmed) = (median(&mut cs), median(&mut rs));
        println!(
            "median c_api {cmed:.3} us rust {rmed:.3} us diff {:+.3} us",
            cmed - rmed
        );
        println!(
            "min    c_api {cmin:.3} us rust {rmin:.3} us diff {:+.3} us",
            cmin - rmin
        );
    }
    // SAFETY: the C communicator, used by no one else now.
    lib.check("oxcclCommDestroy", unsafe { (lib.destroy)(c) });
    rust.destroy()?;
    Ok(())
}
