//! Layer 2, the provider contract: the traits a provider implements, and the core every
//! provider shares and calls.
//!
//! - [`provider`]: [`ProviderContext`] and [`QpTransport`] (the traits), what `open` and
//!   `create_qp` are given, and the implementer's guide.
//! - The cores of the resources, which the handles of the resource layer own and providers work
//!   with: [`CtxInner`] (`ctx`: the context segment's layout and tables), [`MrInner`]
//!   (`region`: keys, the region table, keep-alives, write announcements), [`CqCore`] (`cq`:
//!   completions and the doorbell), [`QpInner`] (`qp`: states, the receive ring, completions
//!   and errors: the services a transport calls instead of reaching into a queue pair).
//! - Work requests ([`SendWr`], [`RecvWr`], [`Sge`]: `wr`), which name regions.
//! - Building blocks: shared-memory segments, futexes and cross-process copies (`segment`),
//!   the queue-pair segment's layout (`ring`), and the initiator's side of a software
//!   provider's queue pair (`sendq`: posting, requests in flight, ordered completion).
//!
//! This layer uses only the model; it names no provider and no handle of the resource layer.

pub(crate) mod cq;
pub(crate) mod ctx;
#[cfg(test)]
pub(crate) mod hooks;
pub(crate) mod keyrng;
pub(crate) mod provider;
pub(crate) mod qp;
pub(crate) mod region;
pub(crate) mod ring;
pub(crate) mod segment;
pub(crate) mod sendq;
pub(crate) mod wr;

pub(crate) use cq::{CqCore, SEQ, SLEEPERS, notify_word};
pub(crate) use ctx::{CtxInner, CtxTables, RegionMap, Tables, Tuning};
pub(crate) use keyrng::KeyRng;
pub(crate) use provider::{OpenArgs, ProviderContext, QpSetup, QpTransport, RegionInfo};
pub(crate) use qp::{Cause, QpHandleSide, QpInner};
pub(crate) use region::{
    Backing, Mapped, MemoryRegion, MrInner, Span, TableWriting, Writing, key_index,
};
pub(crate) use segment::{Segment, cma, copy_bytes, futex_wait};
pub(crate) use wr::{RecvWr, SendWr, Sge};
