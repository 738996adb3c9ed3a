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
//!
//! Each provider is a module of its own behind two crate-internal traits (a context's half and a
//! queue pair's half, see `src/provider.rs`, which also lists the providers built in and guides
//! the author of a new one); [`Provider`] only names them. A context is configured by the
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

mod config;
mod context;
mod cq;
mod error;
mod mr;
/// Whether this build includes the ofi provider (the `ofi` cargo feature). Tests that build
/// other binaries of the workspace pass the same feature, so that the binaries they run match.
pub const OFI_BUILT_IN: bool = cfg!(feature = "ofi");

#[cfg(feature = "ofi")]
mod ofi;
#[cfg(not(feature = "ofi"))]
mod ofi {
    //! This build has no ofi provider (the `ofi` feature is off): opening it says how to get it.
    use crate::provider::{OpenArgs, ProviderContext};
    use crate::{Error, Result};

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
pub mod progress;
mod provider;
mod qp;
mod ring;
mod segment;
mod sendq;
mod shm;
mod tcp;
mod types;

#[cfg(test)]
mod tests;

pub use config::{DeviceConfig, parse_ip_or_sockaddr};
pub use context::{Context, Device, ProtectionDomain, host_identity};
pub use cq::CompletionQueue;
pub use error::{Error, Result};
pub use mr::{DEREGISTER_WAIT, DEREGISTER_WAIT_PEERS, MemoryRegion, RemoteMapping};
pub use provider::Provider;
pub use qp::{EndpointAddr, QpEndpoint, QueuePair};
pub use types::*;

/// The tcp provider's wire format (`Header::decode`/`encode`, `decode_hello`/`encode_hello`),
/// re-exported for the fuzz targets in `fuzz/` only: not a stable API, compiled only with the
/// `fuzzing` feature.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::tcp::frame::*;
}
