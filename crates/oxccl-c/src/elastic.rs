//! Elastic communicators: shrink after a lost rank, grow by newcomers that join.

use std::ffi::c_int;

use oxccl::{Communicator, Options};
use oxccl_bootstrap::TcpStore;

use crate::comm::{CAPI_JOB, bootstrap_timeout, comm_ref, read_unique_id, write_out};
use crate::error::{Failure, guard};
use crate::types::oxcclResult_t;
use crate::types::{OXCCL_SHRINK_ABORT, OXCCL_SHRINK_DEFAULT, oxcclComm_t, oxcclUniqueId};

/// Makes `*newcomm`, a communicator of `comm`'s ranks without the `excludeRanksCount` ranks of
/// `excludeRanksList` (`ncclCommShrink`, without its config), renumbered in order. Every
/// remaining rank calls it; they agree through the job's store on who is left out (the union
/// of what they list and of the ranks failures named), so a rank that saw no failure learns
/// it. `shrinkFlags`: [`OXCCL_SHRINK_DEFAULT`] (`comm` still works), or [`OXCCL_SHRINK_ABORT`]
/// after a failure (aborts `comm` first, so that its calls in flight end with an error).
/// `comm` stays yours to destroy. Every wait ends within `comm`'s timeout.
///
/// # Safety
/// `comm` must be NULL or a live communicator; `excludeRanksList` NULL (with a count of 0) or
/// `excludeRanksCount` readable ints; `newcomm` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommShrink(
    comm: oxcclComm_t,
    excludeRanksList: *const c_int,
    excludeRanksCount: c_int,
    newcomm: *mut oxcclComm_t,
    shrinkFlags: c_int,
) -> oxcclResult_t {
    guard(
        || {
            format!(
                "oxcclCommShrink(excludeRanksCount={excludeRanksCount}, shrinkFlags={shrinkFlags})"
            )
        },
        || {
            let c = comm_ref(comm)?;
            if newcomm.is_null() {
                return Err(Failure::invalid("newcomm is NULL"));
            }
            let count = usize::try_from(excludeRanksCount).map_err(|_| {
                Failure::invalid(format!("excludeRanksCount {excludeRanksCount} is negative"))
            })?;
            if count > 0 && excludeRanksList.is_null() {
                return Err(Failure::invalid(format!(
                    "excludeRanksList is NULL with excludeRanksCount {count}"
                )));
            }
            let list: &[c_int] = if count == 0 {
                &[]
            } else {
                // SAFETY: the caller gives `count` readable ints at `excludeRanksList`.
                unsafe { std::slice::from_raw_parts(excludeRanksList, count) }
            };
            let exclude = list
                .iter()
                .map(|&r| {
                    usize::try_from(r)
                        .map_err(|_| Failure::invalid(format!("excluded rank {r} is negative")))
                })
                .collect::<Result<Vec<usize>, Failure>>()?;
            match shrinkFlags {
                OXCCL_SHRINK_DEFAULT => {}
                OXCCL_SHRINK_ABORT => c.comm.abort(),
                f => {
                    return Err(Failure::invalid(format!(
                        "shrinkFlags {f} is neither OXCCL_SHRINK_DEFAULT (0) nor \
                         OXCCL_SHRINK_ABORT (1)"
                    )));
                }
            }
            let small = c.comm.shrink(&exclude)?;
            write_out(newcomm, "newcomm", crate::oxcclComm::boxed(small))
        },
    )
}

/// Admits `count` newcomers ([`oxcclCommJoin`] with the job's unique id) and makes
/// `*newcomm`, the communicator of `comm`'s ranks and theirs: `comm`'s ranks keep their
/// numbers, the newcomers follow in the order they asked to join. Every rank of `comm`
/// calls it with the same `count`, with no call in flight. If they do not come within
/// `comm`'s timeout, every rank fails alike ([`crate::oxcclGetLastError`] says how many came)
/// and `comm` is unchanged.
///
/// # Safety
/// `comm` must be NULL or a live communicator; `newcomm` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommGrow(
    comm: oxcclComm_t,
    count: c_int,
    newcomm: *mut oxcclComm_t,
) -> oxcclResult_t {
    guard(
        || format!("oxcclCommGrow(count={count})"),
        || {
            let c = comm_ref(comm)?;
            if newcomm.is_null() {
                return Err(Failure::invalid("newcomm is NULL"));
            }
            let n = usize::try_from(count)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Failure::invalid(format!("count {count} is not positive")))?;
            // Not `c.failed`: a grow that fails leaves `comm` working.
            let big = c.comm.grow(n)?;
            write_out(newcomm, "newcomm", crate::oxcclComm::boxed(big))
        },
    )
}

/// Joins, as a newcomer, the running job that `commId` (the id its ranks were made with)
/// names: waits until its ranks call [`oxcclCommGrow`] and admit this process, then writes
/// the grown communicator (this process ranks after them) to `*comm`. Waits up to
/// `OXCCL_TIMEOUT` (300 s by default); if nobody admits it, it withdraws and fails.
///
/// # Safety
/// `comm` must be NULL or point to writable memory for an [`oxcclComm_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn oxcclCommJoin(
    comm: *mut oxcclComm_t,
    commId: oxcclUniqueId,
) -> oxcclResult_t {
    guard(
        || "oxcclCommJoin".into(),
        || {
            if comm.is_null() {
                return Err(Failure::invalid("comm is NULL"));
            }
            let (addr, secret) = read_unique_id(&commId)?;
            let store = TcpStore::connect(&addr, &secret, bootstrap_timeout()?)?;
            let opts = Options::from_env()?;
            let c = Communicator::join(Box::new(store), CAPI_JOB, opts)?;
            write_out(comm, "comm", crate::oxcclComm::boxed(c))
        },
    )
}
