//! The extern functions called from Rust, at world size 1 (the C programs under `tests/` run
//! them across processes).

use std::ffi::{CStr, c_int, c_void};
use std::ptr::{null, null_mut};

use crate::types::oxcclDataType_t::*;
use crate::types::oxcclRedOp_t::*;
use crate::types::oxcclResult_t::{self, *};
use crate::*;

fn dt(d: oxcclDataType_t) -> DataTypeArg {
    DataTypeArg(d as c_int)
}

fn op(o: oxcclRedOp_t) -> RedOpArg {
    RedOpArg(o as c_int)
}

fn last() -> String {
    // SAFETY: a NUL-terminated string owned by this thread, read before the next call.
    unsafe { CStr::from_ptr(oxcclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// A communicator of one rank, through a unique id.
fn one_rank() -> oxcclComm_t {
    let mut id = oxcclUniqueId { internal: [0; 128] };
    let mut comm = null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(oxcclGetUniqueId(&mut id), oxcclSuccess, "{}", last());
        assert_eq!(
            oxcclCommInitRank(&mut comm, 1, id, 0),
            oxcclSuccess,
            "{}",
            last()
        );
    }
    comm
}

#[test]
fn collectives_at_world_size_one() {
    let comm = one_rank();
    let (mut n, mut r, mut v) = (0, 0, 0);
    let x = [1.5f32, 2.5, -3.0];
    let mut y = [0f32; 3];
    let mut z = [7u64, 8];
    // SAFETY: buffers of the counts passed; a live communicator.
    unsafe {
        assert_eq!(oxcclCommCount(comm, &mut n), oxcclSuccess);
        assert_eq!(oxcclCommUserRank(comm, &mut r), oxcclSuccess);
        assert_eq!((n, r), (1, 0));
        assert_eq!(oxcclGetVersion(&mut v), oxcclSuccess);
        assert_eq!(v, OXCCL_MAJOR * 10000 + OXCCL_MINOR * 100 + OXCCL_PATCH);
        let (xp, yp) = (x.as_ptr().cast(), y.as_mut_ptr().cast());
        let res = oxcclAllReduce(xp, yp, 3, dt(oxcclFloat32), op(oxcclAvg), comm);
        assert_eq!(res, oxcclSuccess, "{}", last());
        assert_eq!(y, x);
        let zp: *mut c_void = z.as_mut_ptr().cast();
        let res = oxcclAllReduce(zp, zp, 2, dt(oxcclUint64), op(oxcclProd), comm);
        assert_eq!(res, oxcclSuccess, "{}", last());
        assert_eq!(
            oxcclBroadcast(zp, zp, 2, dt(oxcclInt64), 0, comm),
            oxcclSuccess
        );
        assert_eq!(z, [7, 8]);
        assert_eq!(oxcclBarrier(comm), oxcclSuccess);
        assert_eq!(oxcclCommDestroy(comm), oxcclSuccess, "{}", last());
    }
}

#[test]
fn bad_arguments_are_codes_with_messages() {
    let comm = one_rank();
    let x = [1i32; 4];
    let mut y = [0i32; 4];
    let (xp, yp): (*const c_void, *mut c_void) = (x.as_ptr().cast(), y.as_mut_ptr().cast());
    // SAFETY: buffers of the counts passed (or calls that must fail before touching them).
    unsafe {
        let res = oxcclAllReduce(xp, yp, 4, dt(oxcclInt32), op(oxcclSum), null_mut());
        assert_eq!(res, oxcclInvalidArgument);
        assert_eq!(
            last(),
            "oxcclAllReduce(count=4, datatype=oxcclInt32, op=oxcclSum): comm is NULL"
        );
        let res = oxcclAllReduce(xp, yp, 4, DataTypeArg(99), op(oxcclSum), comm);
        assert_eq!(res, oxcclInvalidArgument);
        assert!(
            last().contains("datatype 99 is not an oxcclDataType_t"),
            "{}",
            last()
        );
        assert!(last().contains("on rank 0 of 1"), "{}", last());
        let res = oxcclAllReduce(xp, yp, 4, dt(oxcclInt32), RedOpArg(-2), comm);
        assert_eq!(res, oxcclInvalidArgument);
        assert!(last().contains("op -2 is not"), "{}", last());
        assert_eq!(
            oxcclSend(xp, 4, dt(oxcclInt32), 3, comm),
            oxcclInvalidArgument
        );
        assert!(
            last().contains("peer 3 is outside the communicator's 1 ranks"),
            "{}",
            last()
        );
        assert_eq!(
            oxcclRecv(yp, 4, dt(oxcclInt32), -1, comm),
            oxcclInvalidArgument
        );
        assert!(last().contains("peer -1 is negative"), "{}", last());
        let res = oxcclAllReduce(null(), yp, 4, dt(oxcclInt32), op(oxcclSum), comm);
        assert_eq!(res, oxcclInvalidArgument);
        assert!(last().contains("sendbuff is NULL; 16 bytes"), "{}", last());
        // Partly overlapping buffers are not the in-place form.
        let res = oxcclAllReduce(
            xp,
            xp.cast_mut().byte_add(4),
            2,
            dt(oxcclInt32),
            op(oxcclSum),
            comm,
        );
        assert_eq!(res, oxcclInvalidArgument);
        assert!(last().contains("overlap"), "{}", last());
        let res = oxcclAllReduce(xp, yp, usize::MAX / 2, dt(oxcclInt32), op(oxcclSum), comm);
        assert_eq!(res, oxcclInvalidArgument);
        assert!(last().contains("too large"), "{}", last());
        assert_eq!(oxcclCommCount(comm, null_mut()), oxcclInvalidArgument);
        assert_eq!(oxcclGroupEnd(), oxcclInvalidUsage);
        // None of that broke the communicator.
        let mut e = oxcclTimeout;
        assert_eq!(oxcclCommGetAsyncError(comm, &mut e), oxcclSuccess);
        assert_eq!(e, oxcclSuccess);
        assert_eq!(
            oxcclAllReduce(xp, yp, 4, dt(oxcclInt32), op(oxcclSum), comm),
            oxcclSuccess
        );
        assert_eq!(oxcclCommDestroy(comm), oxcclSuccess);
    }
}

#[test]
fn error_strings_for_every_code_and_beyond() {
    for code in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, c_int::MAX] {
        let s = oxcclGetErrorString(ResultArg(code));
        // SAFETY: a static NUL-terminated string.
        let s = unsafe { CStr::from_ptr(s) }.to_str().unwrap();
        assert!(!s.is_empty());
        if !(0..=8).contains(&code) {
            assert_eq!(s, "unknown result code");
        }
    }
}

#[test]
fn groups_queue_and_run_at_the_end() {
    let comm = one_rank();
    let x = [3u8, 4];
    let mut y = [0u8; 2];
    let mut w = [9i8; 2];
    // SAFETY: buffers live until oxcclGroupEnd; a live communicator.
    unsafe {
        assert_eq!(oxcclGroupStart(), oxcclSuccess);
        assert_eq!(oxcclGroupStart(), oxcclSuccess);
        let res = oxcclAllReduce(
            x.as_ptr().cast(),
            y.as_mut_ptr().cast(),
            2,
            dt(oxcclUint8),
            op(oxcclMax),
            comm,
        );
        assert_eq!(res, oxcclSuccess);
        let wp: *mut c_void = w.as_mut_ptr().cast();
        assert_eq!(
            oxcclAllReduce(wp, wp, 2, dt(oxcclInt8), op(oxcclMin), comm),
            oxcclSuccess
        );
        assert_eq!(oxcclGroupEnd(), oxcclSuccess);
        assert_eq!(y, [0, 0], "nothing runs before the outermost end");
        assert_eq!(oxcclGroupEnd(), oxcclSuccess, "{}", last());
        assert_eq!(y, [3, 4]);
        // A call that fails its checks inside a group: the group runs nothing.
        assert_eq!(oxcclGroupStart(), oxcclSuccess);
        let res = oxcclAllReduce(
            x.as_ptr().cast(),
            y.as_mut_ptr().cast(),
            2,
            DataTypeArg(12),
            op(oxcclSum),
            comm,
        );
        assert_eq!(res, oxcclInvalidArgument);
        assert_eq!(oxcclGroupEnd(), oxcclInvalidUsage);
        assert!(last().contains("group ran nothing"), "{}", last());
        // Two calls writing the same bytes.
        y = [0, 0];
        assert_eq!(oxcclGroupStart(), oxcclSuccess);
        let yp: *mut c_void = y.as_mut_ptr().cast();
        assert_eq!(
            oxcclAllReduce(x.as_ptr().cast(), yp, 2, dt(oxcclUint8), op(oxcclSum), comm),
            oxcclSuccess
        );
        assert_eq!(
            oxcclAllReduce(x.as_ptr().cast(), yp, 2, dt(oxcclUint8), op(oxcclSum), comm),
            oxcclSuccess
        );
        assert_eq!(oxcclGroupEnd(), oxcclInvalidArgument);
        assert!(last().contains("overlaps"), "{}", last());
        assert_eq!(y, [0, 0]);
        assert_eq!(oxcclCommDestroy(comm), oxcclSuccess);
    }
}

#[test]
fn register_split_abort() {
    let comm = one_rank();
    let mut buf = vec![1.0f64; 64];
    let mut handle = null_mut();
    // SAFETY: `buf` outlives its registration; live communicators.
    unsafe {
        let p: *mut c_void = buf.as_mut_ptr().cast();
        assert_eq!(
            oxcclCommRegister(comm, p, 64 * 8, &mut handle),
            oxcclSuccess,
            "{}",
            last()
        );
        assert_eq!(
            oxcclAllReduce(p, p, 64, dt(oxcclFloat64), op(oxcclSum), comm),
            oxcclSuccess
        );
        assert_eq!(oxcclCommDeregister(comm, handle), oxcclSuccess);
        assert_eq!(oxcclCommDeregister(comm, null_mut()), oxcclInvalidArgument);
        let mut child = null_mut();
        assert_eq!(
            oxcclCommSplit(comm, 5, 0, &mut child),
            oxcclSuccess,
            "{}",
            last()
        );
        assert!(!child.is_null());
        let mut none = comm;
        assert_eq!(
            oxcclCommSplit(comm, OXCCL_SPLIT_NOCOLOR, 0, &mut none),
            oxcclSuccess
        );
        assert!(none.is_null());
        assert_eq!(oxcclCommSplit(comm, -7, 0, &mut none), oxcclInvalidArgument);
        assert_eq!(oxcclCommDestroy(child), oxcclSuccess, "{}", last());
        assert_eq!(oxcclCommAbort(comm), oxcclSuccess);
        let mut e = oxcclSuccess;
        assert_eq!(oxcclCommGetAsyncError(comm, &mut e), oxcclSuccess);
        assert_eq!(e, oxcclRemoteError);
        assert_eq!(
            oxcclAllReduce(p, p, 64, dt(oxcclFloat64), op(oxcclSum), comm),
            oxcclRemoteError
        );
        assert!(last().contains("aborted"), "{}", last());
        assert_eq!(oxcclCommDestroy(comm), oxcclSuccess, "{}", last());
    }
}

#[test]
fn a_bad_unique_id_is_refused() {
    let id = oxcclUniqueId { internal: [1; 128] };
    let mut comm = null_mut();
    // SAFETY: a valid out-pointer.
    let res = unsafe { oxcclCommInitRank(&mut comm, 2, id, 0) };
    assert_eq!(res, oxcclInvalidArgument);
    assert!(
        last().contains("not made by oxcclGetUniqueId"),
        "{}",
        last()
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { oxcclCommInitRank(&mut comm, 2, id, 2) },
        oxcclInvalidArgument
    );
    assert!(last().contains("rank 2 is outside 0..2"), "{}", last());
    let _: oxcclResult_t = oxcclSuccess;
}

/// Two ranks admit a newcomer (`oxcclCommGrow` / `oxcclCommJoin`), all three all-reduce, then
/// the two leave the newcomer out again (`oxcclCommShrink`); bad arguments are refused.
#[test]
fn grow_join_and_shrink() {
    let mut id = oxcclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { oxcclGetUniqueId(&mut id) },
        oxcclSuccess,
        "{}",
        last()
    );
    let sum = |comm: oxcclComm_t, v: f32| -> (oxcclResult_t, f32) {
        let mut x = [v; 4];
        let p: *mut c_void = x.as_mut_ptr().cast();
        // SAFETY: a buffer of 4 floats; a live communicator.
        let r = unsafe { oxcclAllReduce(p, p, 4, dt(oxcclFloat32), op(oxcclSum), comm) };
        (r, x[0])
    };
    let members: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || -> Result<(f32, f32, c_int), String> {
                let mut comm = null_mut();
                // SAFETY: valid out-pointers; live communicators throughout.
                unsafe {
                    if oxcclCommInitRank(&mut comm, 2, id, rank) != oxcclSuccess {
                        return Err(last());
                    }
                    let mut big = null_mut();
                    assert_eq!(oxcclCommGrow(comm, 0, &mut big), oxcclInvalidArgument);
                    assert!(last().contains("count 0 is not positive"), "{}", last());
                    if oxcclCommGrow(comm, 1, &mut big) != oxcclSuccess {
                        return Err(last());
                    }
                    let (mut n, mut r) = (0, 0);
                    oxcclCommCount(big, &mut n);
                    oxcclCommUserRank(big, &mut r);
                    assert_eq!((n, r), (3, rank));
                    let (res, three) = sum(big, rank as f32 + 1.0);
                    assert_eq!(res, oxcclSuccess, "{}", last());
                    let mut small = null_mut();
                    let two = [2 as c_int];
                    assert_eq!(
                        oxcclCommShrink(big, two.as_ptr(), 1, &mut small, 7),
                        oxcclInvalidArgument
                    );
                    assert!(last().contains("shrinkFlags 7"), "{}", last());
                    let neg = [-1 as c_int];
                    assert_eq!(
                        oxcclCommShrink(big, neg.as_ptr(), 1, &mut small, OXCCL_SHRINK_DEFAULT),
                        oxcclInvalidArgument
                    );
                    let rc =
                        oxcclCommShrink(big, two.as_ptr(), 1, &mut small, OXCCL_SHRINK_DEFAULT);
                    if rc != oxcclSuccess {
                        return Err(last());
                    }
                    oxcclCommCount(small, &mut n);
                    let (res, two_sum) = sum(small, rank as f32 + 1.0);
                    assert_eq!(res, oxcclSuccess, "{}", last());
                    assert_eq!(oxcclCommDestroy(small), oxcclSuccess, "{}", last());
                    assert_eq!(oxcclCommDestroy(big), oxcclSuccess, "{}", last());
                    assert_eq!(oxcclCommDestroy(comm), oxcclSuccess, "{}", last());
                    Ok((three, two_sum, n))
                }
            })
        })
        .collect();
    let mut comm = null_mut();
    // SAFETY: a valid out-pointer; a live communicator.
    unsafe {
        assert_eq!(oxcclCommJoin(&mut comm, id), oxcclSuccess, "{}", last());
        let (mut n, mut r) = (0, 0);
        oxcclCommCount(comm, &mut n);
        oxcclCommUserRank(comm, &mut r);
        assert_eq!((n, r), (3, 2));
        let (res, three) = sum(comm, 3.0);
        assert_eq!(res, oxcclSuccess, "{}", last());
        assert_eq!(three, 6.0);
        assert_eq!(oxcclCommDestroy(comm), oxcclSuccess, "{}", last());
    }
    for m in members {
        let (three, two, n) = m.join().unwrap().unwrap();
        assert_eq!((three, two, n), (6.0, 3.0, 2));
    }
}
