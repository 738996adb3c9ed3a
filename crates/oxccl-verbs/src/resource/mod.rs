//! Layer 3, the resources users hold: contexts and protection domains (`context`), memory
//! regions (`mr`), completion queues (`cq`) and queue pairs (`qp`).
//!
//! Each is a handle on its core in the contract (an `Arc` of `CtxInner`, `MrInner`, `CqCore`,
//! `QpInner`), with the user-facing methods: creating, posting, polling and waiting. This layer
//! uses the model and the contract; it names no provider (opening a context on one is the
//! registry's, above).

mod context;
mod cq;
mod mr;
mod qp;

pub use context::{Context, ProtectionDomain, host_identity};
pub use cq::CompletionQueue;
pub use mr::RemoteMapping;
pub use qp::QueuePair;
