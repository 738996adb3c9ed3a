//! # oxccl-verbs: the RDMA programming model, in safe Rust
//!
//! Protection domains, memory regions with lkey/rkey and access flags, reliable-connected queue
//! pairs walking RESET → INIT → RTR → RTS (and ERR), completion queues that poll or wait, and work
//! requests: WRITE, WRITE_WITH_IMM, READ, SEND, SEND_WITH_IMM, RECV, compare-and-swap and
//! fetch-and-add. Shaped like libibverbs, so its users feel at home.
//!
//! Providers:
//! - `shm`: kernel bypass between processes of one host. Regions live in shared memory, a WRITE
//!   is one `memcpy` by the initiator into the peer's mapped region followed by a release-store,
//!   and the data path makes no system call.
//! - `tcp`: the same semantics over TCP, for hosts without RDMA. A progress thread per context
//!   receives frames straight into the target's registered memory after validating them.
//! - `ofi`: libfabric, for real NICs (the `ofi` cargo feature).
//!
//! # Layers
//!
//! The crate is built in layers, one folder of `src/` each. A file uses only its own layer and
//! the layers below it; a provider uses only the model, the contract and its own folder
//! (`tests/layers.rs` checks both):
//!
//! ```text
//!  top          lib.rs, registry.rs    the public API's re-exports; Device, and opening a
//!                                      Context on a provider: the only code that names one
//! ─────────────────────────────────────────────────────────────────────────────────────────
//!  5 providers  shm/  tcp/  ofi/       each private to itself: implements the contract's
//!                 │     │     │        traits, calls the core's services
//! ─ ─ ─ ─ ─ ─ ─ ─ ┼ ─ ─ ┼ ─ ─ ┼ ─ ─ ─  (a provider skips layers 3 and 4)
//!  4 progress     │     │     │        tags, polling by the caller, wakers, windows: what
//!                 │     │     │        the engines above the crate drive operations with
//! ────────────────┼─────┼─────┼────────────────────────────────────────────────────────────
//!  3 resource/    │     │     │        the handles users hold: Context, ProtectionDomain,
//!                 │     │     │        MemoryRegion's methods, CompletionQueue, QueuePair
//! ────────────────┼─────┼─────┼────────────────────────────────────────────────────────────
//!  2 contract/  ◄─┴─────┴─────┘        ProviderContext and QpTransport (the traits); the
//!                                      cores the handles own and providers work with
//!                                      (CtxInner, MrInner, CqCore, QpInner and its
//!                                      services); work requests; segments, the receive
//!                                      ring, the software send queue
//! ─────────────────────────────────────────────────────────────────────────────────────────
//!  1 model/                            types, errors, DeviceConfig, Provider (a name only),
//!                                      QpEndpoint
//! ```
//!
//! The resources reach a provider only through the contract's traits (the context's
//! `ProviderContext`, which the registry opens); a provider reaches its queue pair only
//! through the core's services (`QpInner`: completing work, claiming and completing receives,
//! failing the queue pair), never through the handles. A context is configured by the
//! [`DeviceConfig`] it is opened with: no provider reads the environment.
//!
//! ```
//! use std::time::Duration;
//! use oxccl_verbs::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = Device::by_name("shm")?.open()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//! // Two queue pairs connected to each other (normally in two processes: exchange the
//! // serializable endpoints out of band).
//! let a = pd.create_qp(&cq, &cq, &QpConfig::default())?;
//! let b = pd.create_qp(&cq, &cq, &QpConfig::default())?;
//! a.connect(&b.endpoint())?;
//! b.connect(&a.endpoint())?;
//!
//! let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! src.write(0, b"hello, rdma")?;
//!
//! let sge = [Sge::new(&src, 0, 11)];
//! a.post_send(&[SendWr::new(7, WrOp::Write { remote: dst.remote().at(0) }, &sge)])?;
//! let mut wc = [WorkCompletion::default(); 4];
//! let n = cq.wait(&mut wc, Duration::from_secs(5))?;
//! assert_eq!((n, wc[0].wr_id, wc[0].status), (1, 7, WcStatus::Success));
//! assert_eq!(&dst.to_vec()[..11], b"hello, rdma");
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod contract;
mod model;
pub mod progress;
mod registry;
mod resource;

/// Whether this build includes the ofi provider (the `ofi` cargo feature). Tests that build
/// other binaries of the workspace pass the same feature, so that the binaries they run match.
pub const OFI_BUILT_IN: bool = cfg!(feature = "ofi");

#[cfg(feature = "ofi")]
mod ofi;
#[cfg(not(feature = "ofi"))]
mod ofi {
    //! This build has no ofi provider (the `ofi` feature is off): opening it says how to get it.
    use crate::contract::{OpenArgs, ProviderContext};
    use crate::model::{Error, Result};

    pub(crate) fn open(_: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
        Err(Error::ProviderUnavailable {
            provider: "ofi",
            why: "this build of oxccl does not include it: rebuild with the `ofi` cargo feature \
                  (e.g. `cargo build --features oxccl-verbs/ofi`), which needs libfabric's \
                  headers (Debian/Ubuntu: apt-get install libfabric-dev); or use \
                  OXCCL_PROVIDER=shm or tcp"
                .to_string(),
        })
    }
}
mod shm;
mod tcp;

#[cfg(test)]
mod tests;

pub use contract::region::{DEREGISTER_WAIT, DEREGISTER_WAIT_PEERS, MemoryRegion};
pub use contract::wr::{RecvWr, SendWr, Sge};
pub use model::*;
pub use registry::Device;
pub use resource::{
    CompletionQueue, Context, ProtectionDomain, QueuePair, RemoteMapping, host_identity,
};

/// The tcp provider's wire format (`Header::decode`/`encode`, `decode_hello`/`encode_hello`),
/// re-exported for the fuzz targets in `fuzz/` only: not a stable API, compiled only with the
/// `fuzzing` feature.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::tcp::frame::*;
}
