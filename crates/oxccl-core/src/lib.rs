//! # oxccl-core: the parts of oxccl that do no I/O
//!
//! Data types and reduction operators ([`DataType`], [`ReduceOp`], [`Element`], the 8-bit floats
//! of [`fp8`]), algorithms as
//! data ([`schedule`]: a pure function from a [`schedule::Request`] to one rank's
//! [`schedule::Schedule`]), the [`tuner`] that picks an algorithm for a call, the job's
//! [`topology`], the symbolic reference executor that checks schedules ([`verify`]), the wire
//! protocol ([`protocol`]), the flight recorder's dump format ([`dump`]) and the link-rate
//! learning rule ([`learn`], [`meter`]), and the block-floating-point codec ([`compress`]).
//! The runtime (`oxccl`) drives these over verbs, and the fabric simulator (`oxccl-sim`) over a
//! modelled network; like quinn-proto, this crate is unit-testable alone.
//!
//! Build every rank's schedule of a ring all-reduce and run them together against the
//! collective's definition:
//!
//! ```
//! use oxccl_core::schedule::{Algorithm, Collective, Op, Request, build};
//!
//! let reqs: Vec<Request> = (0..4)
//!     .map(|rank| Request {
//!         coll: Collective::AllReduce { count: 1000 },
//!         world: 4,
//!         rank,
//!         in_place: false,
//!         algo: Algorithm::Ring,
//!         chunk: 64,
//!         channels: 2,
//!         weights: Vec::new(),
//!         hosts: Vec::new(),
//!     })
//!     .collect();
//! let sched = build(&reqs[1])?;
//! // Rank 1 only talks to its ring neighbours.
//! assert!(sched.steps.iter().all(|s| match s.op {
//!     Op::Send { peer, .. } => peer == 2,
//!     Op::Recv { peer, .. } => peer == 0,
//!     _ => true,
//! }));
//! // All four schedules together, in a random order, through 2 slots per link.
//! oxccl_core::verify::verify(&reqs, 2, 7)?;
//! # Ok::<(), String>(())
//! ```
#![deny(missing_docs)]

pub mod compress;
pub mod dtype;
pub mod dump;
pub mod fp8;
pub mod learn;
pub mod meter;
pub mod protocol;
pub mod schedule;
pub mod topology;
pub mod tuner;
pub mod verify;

pub use dtype::{DataType, Element, ParseNameError, ReduceOp, as_bytes, as_bytes_mut};
pub use fp8::{F8E4M3, F8E5M2};
pub use schedule::CollectiveKind;
pub use topology::{Host, Topology};

/// What the fuzz targets under `fuzz/` drive (feature `fuzzing`; not a stable API): the pure
/// schedule builder and the symbolic reference executor that checks its schedules.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::schedule::{
        Algorithm, Buf, Collective, CollectiveKind, Op, Region, Request, Schedule, Step, build,
    };
    pub use crate::verify::{verify, verify_schedules};
}
