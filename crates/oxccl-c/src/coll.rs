//! The collectives and point-to-point calls. Each checks its arguments, turns the C pointers
//! into the buffers the collective uses on this rank (in place where NCCL's in-place layout
//! says so), and runs the call, or queues it inside a group.

use std::ffi::{c_int, c_void};

use oxccl::schedule::Collective;
use oxccl::{Buffers, DataType, ReduceOp};

use crate::comm::{comm_ref, oxcclComm};
use crate::error::{Failure, guard};
use crate::group;
use crate::types::{DataTypeArg, RedOpArg, oxcclComm_t, oxcclResult_t};

/// One call as C made it, before its buffers are checked.
pub(crate) struct Call {
    /// The C function's name.
    pub name: &'static str,
    pub coll: Collective,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub send: *const c_void,
    pub recv: *mut c_void,
}

impl Call {
    /// The bytes this call reads and writes on this rank: `(input, output)`, as address
    /// ranges (an in-place call reads and writes one range).
    pub(crate) fn spans(&self, world: usize, rank: usize) -> (Span, Span) {
        let es = self.dtype.size();
        let in_len = self.coll.input_len(world, rank) * es;
        let out_len = self.coll.output_len(world, rank) * es;
        (
            Span(self.send as usize, in_len),
            Span(self.recv as usize, out_len),
        )
    }
}

/// An address range: start and length in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span(pub usize, pub usize);

impl Span {
    /// Whether both ranges are non-empty and share a byte.
    pub(crate) fn overlaps(self, o: Span) -> bool {
        self.1 > 0
            && o.1 > 0
            && self.0 < o.0.saturating_add(o.1)
            && o.0 < self.0.saturating_add(self.1)
    }
}

/// A rank argument (a root or a peer) as an index, or why it is none.
fn rank_arg(v: c_int, what: &str) -> Result<usize, Failure> {
    usize::try_from(v).map_err(|_| Failure::invalid(format!("{what} {v} is negative")))
}

/// Checks that a count of `count` elements (`world` times, for the collectives that take a
/// block per rank) of `es` bytes fits the address space, before the lengths are computed.
fn check_count(count: usize, world: usize, es: usize) -> Result<(), Failure> {
    let limit = isize::MAX as usize / world.max(1) / es;
    if count > limit {
        return Err(Failure::invalid(format!(
            "count {count} is too large ({world} blocks of {es}-byte elements overflow)"
        )));
    }
    Ok(())
}

/// The buffers `call` uses on this rank: in place when `sendbuff` and `recvbuff` lie where
/// NCCL's in-place form puts them (equal, or for all-gather `sendbuff == recvbuff +
/// rank * count`, for reduce-scatter `recvbuff == sendbuff + rank * count`); a buffer the
/// call does not use on this rank is ignored (it may be NULL); otherwise two buffers, which
/// must not overlap.
///
/// # Safety
/// Where used, `call.send` must be readable and `call.recv` writable for the lengths the
/// collective takes on this rank (its count, times the world size where it takes a block per
/// rank), for `'a`, and nothing else may touch the output meanwhile.
pub(crate) unsafe fn buffers<'a>(
    call: &Call,
    world: usize,
    rank: usize,
) -> Result<Buffers<'a>, Failure> {
    let es = call.dtype.size();
    let (input, output) = call.spans(world, rank);
    if input.1 > 0 && output.1 > 0 {
        if let Some((io, oo)) = call.coll.in_place_offsets(world, rank) {
            let base = output.0.checked_sub(oo * es);
            if base.is_some() && input.0.checked_sub(io * es) == base && !call.recv.is_null() {
                let need = (io * es + input.1).max(oo * es + output.1);
                let start = call.recv.cast::<u8>().wrapping_sub(oo * es);
                // SAFETY: the caller's contract: one buffer of `need` bytes from `start`
                // (the in-place layout), writable, used by this call alone.
                let buf = unsafe { std::slice::from_raw_parts_mut(start, need) };
                return Ok(Buffers::InPlace(buf));
            }
        }
        if input.overlaps(output) {
            return Err(Failure::invalid(format!(
                "sendbuff ({} bytes at {:p}) and recvbuff ({} bytes at {:p}) overlap, and not \
                 as the in-place form places them",
                input.1, call.send, output.1, call.recv
            )));
        }
    }
    if input.1 > 0 && call.send.is_null() {
        return Err(Failure::invalid(format!(
            "sendbuff is NULL; {} bytes are read from it",
            input.1
        )));
    }
    if output.1 > 0 && call.recv.is_null() {
        return Err(Failure::invalid(format!(
            "recvbuff is NULL; {} bytes are written to it",
            output.1
        )));
    }
    let inp: &[u8] = if input.1 == 0 {
        &[]
    } else {
        // SAFETY: non-null; readable for `input.1` bytes by the caller's contract.
        unsafe { std::slice::from_raw_parts(call.send.cast::<u8>(), input.1) }
    };
    let out: &mut [u8] = if output.1 == 0 {
        &mut []
    } else {
        // SAFETY: non-null; writable for `output.1` bytes, disjoint from the input (checked
        // above) and used by nothing else, by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(call.recv.cast::<u8>(), output.1) }
    };
    Ok(Buffers::OutOfPlace {
        input: inp,
        output: out,
    })
}

/// Runs `call` on `c` now, or queues it when a group is open on this thread.
#[inline]
fn submit(c: &oxcclComm, call: Call) -> Result<(), Failure> {
    let (world, rank) = (c.comm.world_size(), c.comm.rank());
    if let Some(root) = call.coll.root()
        && root >= world
    {
        let what = match call.coll {
            Collective::Send { .. } | Collective::Recv { .. } => "peer",
            _ => "root",
        };
        return Err(Failure::invalid(format!(
            "{what} {root} is outside the communicator's {world} ranks"
        )));
    }
    if group::open() {
        // Checked now (the pointers are not kept as references), run by oxcclGroupEnd.
        // SAFETY: the caller's contract for the call's buffers, checked here only.
        unsafe { buffers(&call, world, rank) }?;
        group::push(c, call);
        return Ok(());
    }
    // SAFETY: the caller's contract for this blocking call's buffers.
    let bufs = unsafe { buffers(&call, world, rank) }?;
    c.comm
        .run(&call.coll, call.dtype, call.op, bufs)
        .map_err(|e| c.failed(e))
}

/// Describes a failed call: the function, its arguments and, when `comm` is usable, the rank.
fn describe(name: &str, args: String, comm: oxcclComm_t) -> String {
    match comm_ref(comm) {
        Ok(c) => format!(
            "{name}({args}) on rank {} of {}",
            c.comm.rank(),
            c.comm.world_size()
        ),
        Err(_) => format!("{name}({args})"),
    }
}

/// The body of every collective entry point: checks the communicator, the data type and the
/// operator, builds the collective with `coll(world)` and submits it.
#[allow(clippy::too_many_arguments)]
#[inline]
fn collective(
    name: &'static str,
    comm: oxcclComm_t,
    count: usize,
    datatype: DataTypeArg,
    op: Option<RedOpArg>,
    send: *const c_void,
    recv: *mut c_void,
    coll: impl FnOnce() -> Result<Collective, Failure>,
) -> oxcclResult_t {
    let what = || {
        let mut args = format!("count={count}, datatype={}", datatype.name());
        if let Some(op) = op {
            args += &format!(", op={}", op.name());
        }
        args
    };
    let checked_submit = || {
        let c = comm_ref(comm)?;
        let dtype = datatype.get().map_err(Failure::invalid)?;
        let op = match op {
            Some(o) => o.get().map_err(Failure::invalid)?,
            None => ReduceOp::Sum,
        };
        check_count(count, c.comm.world_size(), dtype.size())?;
        let coll = coll()?;
        let call = Call {
            name,
            coll,
            dtype,
            op,
            send,
            recv,
        };
        submit(c, call)
    };
    guard(
        || describe(name, what(), comm),
        || {
            let r = checked_submit();
            if let Err(f) = &r
                && group::open()
            {
                group::poison(&format!("{name}: {}", f.msg));
            }
            r
        },
    )
}

/// `recvbuff[i]` = `op` over the ranks of `sendbuff[i]`, for `count` elements, on every rank
/// (`ncclAllReduce`). In place when `sendbuff == recvbuff`.
///
/// # Safety
/// `sendbuff` readable and `recvbuff` writable for `count` elements of `datatype`, or equal
/// (in place); `comm` NULL or a live communicator. Inside a group, until `oxcclGroupEnd`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclAllReduce",
        comm,
        count,
        datatype,
        Some(op),
        sendbuff,
        recvbuff,
        || Ok(Collective::AllReduce { count }),
    )
}

/// `root`'s `count` elements at `sendbuff` land at every rank's `recvbuff`
/// (`ncclBroadcast`); `sendbuff` is ignored on the other ranks. In place when equal.
///
/// # Safety
/// As [`oxcclAllReduce`] (`sendbuff` used on `root` only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclBroadcast",
        comm,
        count,
        datatype,
        None,
        sendbuff,
        recvbuff,
        || {
            let root = rank_arg(root, "root")?;
            Ok(Collective::Broadcast { count, root })
        },
    )
}

/// The reduction with `op` of every rank's `count` elements lands at `root`'s `recvbuff`
/// (`ncclReduce`); `recvbuff` is ignored on the other ranks. In place when equal.
///
/// # Safety
/// As [`oxcclAllReduce`] (`recvbuff` used on `root` only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    root: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclReduce",
        comm,
        count,
        datatype,
        Some(op),
        sendbuff,
        recvbuff,
        || {
            let root = rank_arg(root, "root")?;
            Ok(Collective::Reduce { count, root })
        },
    )
}

/// Every rank's `sendcount` elements land in block `r` (rank `r`'s) of every rank's
/// `recvbuff`, `nranks * sendcount` elements (`ncclAllGather`). In place when
/// `sendbuff == recvbuff + rank * sendcount` elements.
///
/// # Safety
/// `sendbuff` readable for `sendcount` elements, `recvbuff` writable for `nranks *
/// sendcount`; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: DataTypeArg,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclAllGather",
        comm,
        sendcount,
        datatype,
        None,
        sendbuff,
        recvbuff,
        || Ok(Collective::AllGather { count: sendcount }),
    )
}

/// Rank `r` gets block `r` (`recvcount` elements) of the reduction with `op` of every rank's
/// `nranks * recvcount` elements (`ncclReduceScatter`). In place when `recvbuff == sendbuff +
/// rank * recvcount` elements.
///
/// # Safety
/// `sendbuff` readable for `nranks * recvcount` elements, `recvbuff` writable for
/// `recvcount`; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclReduceScatter",
        comm,
        recvcount,
        datatype,
        Some(op),
        sendbuff,
        recvbuff,
        || Ok(Collective::ReduceScatter { count: recvcount }),
    )
}

/// Block `j` (`count` elements) of this rank's `sendbuff` goes to rank `j`; block `i` of
/// `recvbuff` comes from rank `i` (`ncclAlltoAll`; both `nranks * count` elements). In place
/// when equal.
///
/// # Safety
/// Both buffers `nranks * count` elements (or equal); `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclAllToAll",
        comm,
        count,
        datatype,
        None,
        sendbuff,
        recvbuff,
        || Ok(Collective::AllToAll { count }),
    )
}

/// Every rank's `sendcount` elements land in block `r` of `root`'s `recvbuff` (`nranks *
/// sendcount` elements; ignored on the other ranks). In place on `root` when `sendbuff ==
/// recvbuff + root * sendcount` elements.
///
/// # Safety
/// `sendbuff` readable for `sendcount` elements; on `root`, `recvbuff` writable for `nranks *
/// sendcount`; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclGather",
        comm,
        sendcount,
        datatype,
        None,
        sendbuff,
        recvbuff,
        || {
            let root = rank_arg(root, "root")?;
            Ok(Collective::Gather {
                count: sendcount,
                root,
            })
        },
    )
}

/// Block `r` (`recvcount` elements) of `root`'s `sendbuff` lands at rank `r`'s `recvbuff`
/// (`sendbuff` is ignored on the other ranks). In place on `root` when `recvbuff == sendbuff
/// + root * recvcount` elements.
///
/// # Safety
/// On `root`, `sendbuff` readable for `nranks * recvcount` elements; `recvbuff` writable for
/// `recvcount`; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclScatter",
        comm,
        recvcount,
        datatype,
        None,
        sendbuff,
        recvbuff,
        || {
            let root = rank_arg(root, "root")?;
            Ok(Collective::Scatter {
                count: recvcount,
                root,
            })
        },
    )
}

/// Returns once every rank of `comm` has called it. No NCCL counterpart.
///
/// # Safety
/// `comm` NULL or a live communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclBarrier(comm: oxcclComm_t) -> oxcclResult_t {
    collective(
        "oxcclBarrier",
        comm,
        0,
        DataTypeArg(crate::types::oxcclDataType_t::oxcclUint8 as c_int),
        None,
        std::ptr::null(),
        std::ptr::null_mut(),
        || Ok(Collective::Barrier),
    )
}

/// Sends `count` elements to `peer`, which receives them with [`oxcclRecv`] (`ncclSend`).
/// Blocks until the peer has them, so two ranks that send to each other first need a group.
///
/// # Safety
/// `sendbuff` readable for `count` elements; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclSend",
        comm,
        count,
        datatype,
        None,
        sendbuff,
        std::ptr::null_mut(),
        || {
            let peer = rank_arg(peer, "peer")?;
            Ok(Collective::Send { count, peer })
        },
    )
}

/// Receives `count` elements from `peer` (`ncclRecv`).
///
/// # Safety
/// `recvbuff` writable for `count` elements; `comm` NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: oxcclComm_t,
) -> oxcclResult_t {
    collective(
        "oxcclRecv",
        comm,
        count,
        datatype,
        None,
        std::ptr::null(),
        recvbuff,
        || {
            let peer = rank_arg(peer, "peer")?;
            Ok(Collective::Recv { count, peer })
        },
    )
}
