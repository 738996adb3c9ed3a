//! # oxccl-c: the C API of oxccl
//!
//! `liboxccl.so` (and `liboxccl.a`) with the header `include/oxccl.h`, shaped like NCCL's
//! `nccl.h`: `oxcclGetUniqueId` and `oxcclCommInitRank` (or `oxcclCommInitFromEnv`, which
//! reads `oxccl run`'s, torchrun's, Slurm's, Open MPI's or PMI's variables),
//! `oxcclCommSplit`, every collective, `oxcclSend`/`oxcclRecv`, `oxcclGroupStart`/`End`,
//! `oxcclCommRegister`/`Deregister`, `oxcclCommAbort`, `oxcclCommDestroy` and the queries.
//! `scripts/install-c.sh PREFIX` installs the library, the header and `oxccl.pc`.
//!
//! This program (`examples/c/example.c`, compiled and run under `oxccl run -n 4` by this
//! crate's tests) all-reduces a buffer in place:
//!
//! ```c
#![doc = include_str!("../../../examples/c/example.c")]
//! ```
//!
//! ## How it differs from NCCL
//! - Host memory only, and no stream argument: every call blocks until its data is in place,
//!   except inside a group, where `oxcclGroupEnd` runs the queued calls and blocks.
//! - `oxcclCommAbort` stops the communicator (calls running on other threads return) but does
//!   not free it: `oxcclCommDestroy` does, once no thread uses it.
//! - The unique id carries the store's address and the job's secret: send it only to the
//!   job's ranks. The store it names runs in the process that made it, until that exits.
//! - Extra calls: `oxcclCommInitFromEnv`, `oxcclBarrier`, `oxcclGather`, `oxcclScatter`;
//!   extra code `oxcclTimeout`.
//! - `OXCCL_COMPRESS` does not apply to calls through the C API (they are exact).
//!
//! ## Errors
//! Every function returns an `oxcclResult_t`; none aborts the process or lets a Rust panic
//! cross into C (a panic is `oxcclInternalError`). Null pointers, data types and operators
//! outside their enums, ranks outside the communicator and overlapping buffers are
//! `oxcclInvalidArgument`. `oxcclGetLastError` gives the thread's last failure: the call,
//! its count, type and operator, the rank, and what oxccl said (which names the peer).
#![deny(missing_docs)]
#![allow(non_snake_case, non_camel_case_types)]

mod coll;
mod comm;
mod elastic;
mod error;
mod group;
mod types;

pub use coll::{
    oxcclAllGather, oxcclAllReduce, oxcclAllToAll, oxcclBarrier, oxcclBroadcast, oxcclGather,
    oxcclRecv, oxcclReduce, oxcclReduceScatter, oxcclScatter, oxcclSend,
};
pub use comm::{
    oxcclComm, oxcclCommAbort, oxcclCommCount, oxcclCommDeregister, oxcclCommDestroy,
    oxcclCommGetAsyncError, oxcclCommInitFromEnv, oxcclCommInitRank, oxcclCommRegister,
    oxcclCommSplit, oxcclCommUserRank, oxcclGetErrorString, oxcclGetLastError, oxcclGetUniqueId,
    oxcclGetVersion,
};
pub use elastic::{oxcclCommGrow, oxcclCommJoin, oxcclCommShrink};
pub use group::{oxcclGroupEnd, oxcclGroupStart};
pub use types::{
    DataTypeArg, OXCCL_MAJOR, OXCCL_MINOR, OXCCL_PATCH, OXCCL_SHRINK_ABORT, OXCCL_SHRINK_DEFAULT,
    OXCCL_SPLIT_NOCOLOR, OXCCL_UNIQUE_ID_BYTES, RedOpArg, ResultArg, oxcclComm_t, oxcclDataType_t,
    oxcclRedOp_t, oxcclResult_t, oxcclUniqueId,
};

#[cfg(test)]
mod tests;
