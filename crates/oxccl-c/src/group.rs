//! Groups: `oxcclGroupStart` opens one on this thread (they nest), the calls made until the
//! matching `oxcclGroupEnd` are checked and queued, and `oxcclGroupEnd` runs them together,
//! as NCCL does.

use std::cell::RefCell;

use crate::coll::{Call, Span, buffers};
use crate::comm::{comm_ref, oxcclComm};
use crate::error::{Failure, guard};
use crate::types::{oxcclComm_t, oxcclResult_t};

/// This thread's open group.
#[derive(Default)]
struct Open {
    /// `oxcclGroupStart`s not yet ended.
    depth: usize,
    /// The calls queued, with their communicators.
    calls: Vec<(oxcclComm_t, Call)>,
    /// The first queued call that failed its checks: the group then runs nothing.
    failed: Option<String>,
}

thread_local! {
    static GROUP: RefCell<Open> = RefCell::new(Open::default());
}

/// Whether a group is open on this thread.
#[inline]
pub(crate) fn open() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Queues a checked call.
pub(crate) fn push(c: &oxcclComm, call: Call) {
    let comm = std::ptr::from_ref(c).cast_mut();
    GROUP.with(|g| g.borrow_mut().calls.push((comm, call)));
}

/// Remembers that a call made inside the group failed its checks (`what` says which).
pub(crate) fn poison(what: &str) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.failed.is_none() {
            g.failed = Some(what.to_owned());
        }
    });
}

/// Opens a group on this thread (`ncclGroupStart`); groups nest, and the outermost
/// [`oxcclGroupEnd`] runs the calls. Calls on a communicator between the two are checked and
/// queued (they return at once); their buffers must stay valid, and must not overlap another
/// queued call's output, until `oxcclGroupEnd`.
#[unsafe(no_mangle)]
pub extern "C" fn oxcclGroupStart() -> oxcclResult_t {
    guard(
        || "oxcclGroupStart".into(),
        || {
            GROUP.with(|g| g.borrow_mut().depth += 1);
            Ok(())
        },
    )
}

/// Closes the group [`oxcclGroupStart`] opened (`ncclGroupEnd`); the outermost one runs the
/// queued calls and returns once all are done, or with the first error. Each communicator's
/// calls run together (a send and a receive with the same peer progress at once); the calls
/// of several communicators run one communicator after the other, in the order of their first
/// call. When a queued call failed its checks, the group runs nothing and returns
/// `oxcclInvalidUsage`.
///
/// # Safety
/// Every queued call's buffers and communicator must still be valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclGroupEnd() -> oxcclResult_t {
    guard(
        || "oxcclGroupEnd".into(),
        || {
            let taken = GROUP.with(|g| {
                let mut g = g.borrow_mut();
                match g.depth {
                    0 => Err(Failure::usage(
                        "no group is open (oxcclGroupStart was not called)",
                    )),
                    1 => {
                        g.depth = 0;
                        Ok(Some((std::mem::take(&mut g.calls), g.failed.take())))
                    }
                    _ => {
                        g.depth -= 1;
                        Ok(None)
                    }
                }
            })?;
            let Some((calls, failed)) = taken else {
                return Ok(());
            };
            if let Some(what) = failed {
                return Err(Failure::usage(format!(
                    "a call in the group failed, so the group ran nothing: {what}"
                )));
            }
            run(&calls)
        },
    )
}

/// Runs a group's calls, one communicator's at a time.
fn run(calls: &[(oxcclComm_t, Call)]) -> Result<(), Failure> {
    check_disjoint(calls)?;
    let mut comms: Vec<oxcclComm_t> = Vec::new();
    for (c, _) in calls {
        if !comms.contains(c) {
            comms.push(*c);
        }
    }
    for comm in comms {
        let c = comm_ref(comm)?;
        let (world, rank) = (c.comm.world_size(), c.comm.rank());
        let mut g = c.comm.group();
        let mine = calls.iter().filter(|(k, _)| *k == comm);
        for (i, (_, call)) in mine.enumerate() {
            let named = |f: Failure| Failure {
                code: f.code,
                msg: format!(
                    "call {} on rank {rank} of {world} ({}): {}",
                    i + 1,
                    call.name,
                    f.msg
                ),
            };
            // SAFETY: the calls' buffers are valid until oxcclGroupEnd returns (the caller's
            // contract) and disjoint from each other's outputs (checked above).
            let bufs = unsafe { buffers(call, world, rank) }.map_err(named)?;
            g.run(&call.coll, call.dtype, call.op, bufs)
                .map_err(|e| named(c.failed(e)))?;
        }
        g.end().map_err(|e| {
            let f = c.failed(e);
            Failure {
                code: f.code,
                msg: format!("rank {rank} of {world}: {}", f.msg),
            }
        })?;
    }
    Ok(())
}

/// Fails when a call's output overlaps another call's input or output (the group's calls run
/// at once: they would race).
fn check_disjoint(calls: &[(oxcclComm_t, Call)]) -> Result<(), Failure> {
    let mut spans: Vec<(Span, Span, &'static str)> = Vec::with_capacity(calls.len());
    for (comm, call) in calls {
        let c = comm_ref(*comm)?;
        let (i, o) = call.spans(c.comm.world_size(), c.comm.rank());
        spans.push((i, o, call.name));
    }
    for (a, (_, out_a, name_a)) in spans.iter().enumerate() {
        for (b, (in_b, out_b, name_b)) in spans.iter().enumerate() {
            if a != b && (out_a.overlaps(*out_b) || out_a.overlaps(*in_b)) {
                return Err(Failure::invalid(format!(
                    "the output of call {} ({name_a}) overlaps a buffer of call {} ({name_b})",
                    a + 1,
                    b + 1
                )));
            }
        }
    }
    Ok(())
}
