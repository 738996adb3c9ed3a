//! The C types: result codes, data types, reduction operators, the unique id, the handles.

use std::ffi::{c_char, c_int};

use oxccl::{DataType, ReduceOp};

/// Major version of this library (`OXCCL_MAJOR`).
pub const OXCCL_MAJOR: c_int = 0;
/// Minor version of this library (`OXCCL_MINOR`).
pub const OXCCL_MINOR: c_int = 1;
/// Patch version of this library (`OXCCL_PATCH`).
pub const OXCCL_PATCH: c_int = 0;

/// Bytes in an [`oxcclUniqueId`] (as `NCCL_UNIQUE_ID_BYTES`).
pub const OXCCL_UNIQUE_ID_BYTES: usize = 128;

/// The `color` that leaves a rank out of [`crate::oxcclCommSplit`] (its new communicator is
/// `NULL`), as `NCCL_SPLIT_NOCOLOR`.
pub const OXCCL_SPLIT_NOCOLOR: c_int = -1;

/// [`crate::oxcclCommShrink`]'s flag for a communicator that still works: the ranks excluded
/// are the ones listed (and any a failure named), as `NCCL_SHRINK_DEFAULT`.
pub const OXCCL_SHRINK_DEFAULT: c_int = 0;

/// [`crate::oxcclCommShrink`]'s flag after a failure: aborts `comm` first (its calls in flight
/// end with an error) and leaves out every rank a failure named, as `NCCL_SHRINK_ABORT`.
pub const OXCCL_SHRINK_ABORT: c_int = 1;

/// What a call returned. The codes are NCCL's (`ncclResult_t`), with `oxcclTimeout` added;
/// [`crate::oxcclGetLastError`] says what failed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum oxcclResult_t {
    /// The call did what it was asked.
    oxcclSuccess = 0,
    /// An error this library has no better code for.
    oxcclUnhandledError = 1,
    /// The system failed: a socket, shared memory, the rendezvous store, registering memory.
    oxcclSystemError = 2,
    /// A bug in oxccl (a Rust panic, caught at the C boundary).
    oxcclInternalError = 3,
    /// A bad argument: a null pointer, an unknown data type or operator, a rank outside the
    /// communicator, overlapping buffers.
    oxcclInvalidArgument = 4,
    /// The library used wrongly: ranks that disagree on a call, a communicator unusable after
    /// an earlier error, `oxcclGroupEnd` without `oxcclGroupStart`.
    oxcclInvalidUsage = 5,
    /// A peer failed, aborted, or could not be reached.
    oxcclRemoteError = 6,
    /// Work still in progress (not returned by blocking calls; kept for NCCL's numbering).
    oxcclInProgress = 7,
    /// A call ran past its timeout (`OXCCL_TIMEOUT`).
    oxcclTimeout = 8,
}

/// Element types, numbered as NCCL numbers them (`ncclDataType_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum oxcclDataType_t {
    /// `int8_t` (NCCL's `ncclInt8`, `ncclChar`).
    oxcclInt8 = 0,
    /// `uint8_t`.
    oxcclUint8 = 1,
    /// `int32_t` (NCCL's `ncclInt32`, `ncclInt`).
    oxcclInt32 = 2,
    /// `uint32_t`.
    oxcclUint32 = 3,
    /// `int64_t`.
    oxcclInt64 = 4,
    /// `uint64_t`.
    oxcclUint64 = 5,
    /// IEEE binary16 (NCCL's `ncclFloat16`, `ncclHalf`); sums accumulate in `float`.
    oxcclFloat16 = 6,
    /// `float` (NCCL's `ncclFloat32`, `ncclFloat`).
    oxcclFloat32 = 7,
    /// `double` (NCCL's `ncclFloat64`, `ncclDouble`).
    oxcclFloat64 = 8,
    /// bfloat16; sums accumulate in `float`.
    oxcclBfloat16 = 9,
    /// 8-bit float, 4 exponent and 3 mantissa bits, no infinities (torch's `float8_e4m3fn`).
    oxcclFloat8e4m3 = 10,
    /// 8-bit float, 5 exponent and 2 mantissa bits (torch's `float8_e5m2`).
    oxcclFloat8e5m2 = 11,
}

/// Reduction operators, numbered as NCCL numbers them (`ncclRedOp_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum oxcclRedOp_t {
    /// Sum (integers wrap).
    oxcclSum = 0,
    /// Product (integers wrap).
    oxcclProd = 1,
    /// Maximum.
    oxcclMax = 2,
    /// Minimum.
    oxcclMin = 3,
    /// The sum divided by the number of ranks (integers truncate toward zero).
    oxcclAvg = 4,
}

/// A data type as C passes it: any `int`, checked before use (an out-of-range value in a Rust
/// enum would be undefined behaviour). It is `oxcclDataType_t` in the header.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataTypeArg(pub c_int);

/// A reduction operator as C passes it; `oxcclRedOp_t` in the header.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RedOpArg(pub c_int);

/// A result code as C passes it (any `int`); `oxcclResult_t` in the header.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResultArg(pub c_int);

/// NCCL's order of the data types, index = `oxcclDataType_t` value.
const DTYPES: [(DataType, &str); 12] = [
    (DataType::I8, "oxcclInt8"),
    (DataType::U8, "oxcclUint8"),
    (DataType::I32, "oxcclInt32"),
    (DataType::U32, "oxcclUint32"),
    (DataType::I64, "oxcclInt64"),
    (DataType::U64, "oxcclUint64"),
    (DataType::F16, "oxcclFloat16"),
    (DataType::F32, "oxcclFloat32"),
    (DataType::F64, "oxcclFloat64"),
    (DataType::Bf16, "oxcclBfloat16"),
    (DataType::F8E4M3, "oxcclFloat8e4m3"),
    (DataType::F8E5M2, "oxcclFloat8e5m2"),
];

/// NCCL's order of the operators, index = `oxcclRedOp_t` value.
const OPS: [(ReduceOp, &str); 5] = [
    (ReduceOp::Sum, "oxcclSum"),
    (ReduceOp::Prod, "oxcclProd"),
    (ReduceOp::Max, "oxcclMax"),
    (ReduceOp::Min, "oxcclMin"),
    (ReduceOp::Avg, "oxcclAvg"),
];

impl DataTypeArg {
    /// The data type, or why this value is none.
    pub(crate) fn get(self) -> Result<DataType, String> {
        usize::try_from(self.0)
            .ok()
            .and_then(|i| DTYPES.get(i))
            .map(|d| d.0)
            .ok_or_else(|| {
                format!(
                    "datatype {} is not an oxcclDataType_t (0 to {})",
                    self.0,
                    DTYPES.len() - 1
                )
            })
    }

    /// The C name of the data type (or the number, when it is none).
    pub(crate) fn name(self) -> String {
        usize::try_from(self.0)
            .ok()
            .and_then(|i| DTYPES.get(i))
            .map_or_else(|| self.0.to_string(), |d| d.1.to_owned())
    }
}

impl RedOpArg {
    /// The operator, or why this value is none.
    pub(crate) fn get(self) -> Result<ReduceOp, String> {
        usize::try_from(self.0)
            .ok()
            .and_then(|i| OPS.get(i))
            .map(|o| o.0)
            .ok_or_else(|| {
                format!(
                    "op {} is not an oxcclRedOp_t (0 to {})",
                    self.0,
                    OPS.len() - 1
                )
            })
    }

    /// The C name of the operator (or the number, when it is none).
    pub(crate) fn name(self) -> String {
        usize::try_from(self.0)
            .ok()
            .and_then(|i| OPS.get(i))
            .map_or_else(|| self.0.to_string(), |o| o.1.to_owned())
    }
}

/// Names a job for [`crate::oxcclCommInitRank`], as `ncclUniqueId` does: made by
/// [`crate::oxcclGetUniqueId`] on one process and sent to every rank by the application (over
/// MPI, a file, a socket). It carries the rendezvous store's address and the job's secret:
/// send it only to the job's ranks.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct oxcclUniqueId {
    /// Opaque bytes.
    pub internal: [c_char; OXCCL_UNIQUE_ID_BYTES],
}

/// A communicator: the ranks of a job, joined. Opaque; made by `oxcclCommInit*` or
/// `oxcclCommSplit`, released by [`crate::oxcclCommDestroy`].
pub type oxcclComm_t = *mut crate::comm::oxcclComm;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_match_the_package() {
        let v = |s: &str| s.parse::<c_int>().unwrap();
        assert_eq!(OXCCL_MAJOR, v(env!("CARGO_PKG_VERSION_MAJOR")));
        assert_eq!(OXCCL_MINOR, v(env!("CARGO_PKG_VERSION_MINOR")));
        assert_eq!(OXCCL_PATCH, v(env!("CARGO_PKG_VERSION_PATCH")));
    }

    #[test]
    fn enums_follow_the_tables() {
        assert_eq!(
            DataTypeArg(oxcclDataType_t::oxcclBfloat16 as c_int).get(),
            Ok(DataType::Bf16)
        );
        assert_eq!(
            DataTypeArg(oxcclDataType_t::oxcclFloat8e5m2 as c_int).get(),
            Ok(DataType::F8E5M2)
        );
        assert_eq!(
            DataTypeArg(oxcclDataType_t::oxcclFloat32 as c_int).name(),
            "oxcclFloat32"
        );
        assert!(DataTypeArg(12).get().is_err());
        assert!(DataTypeArg(-1).get().is_err());
        assert_eq!(
            RedOpArg(oxcclRedOp_t::oxcclMax as c_int).get(),
            Ok(ReduceOp::Max)
        );
        assert_eq!(
            RedOpArg(oxcclRedOp_t::oxcclMin as c_int).get(),
            Ok(ReduceOp::Min)
        );
        assert!(RedOpArg(5).get().unwrap_err().contains("op 5"));
    }
}
