//! Work requests: scatter-gather elements, send and receive requests.
//!
//! They sit in the contract rather than the model because they name memory regions
//! ([`MemoryRegion`], `contract::region`), and a provider's `post_send` takes them.

use super::region::MemoryRegion;
use crate::model::WrOp;

/// One scatter-gather element: `len` bytes at `offset` inside a local memory region.
#[derive(Clone, Copy, Debug)]
pub struct Sge<'a> {
    /// The local region.
    pub mr: &'a MemoryRegion,
    /// Offset of the first byte inside the region.
    pub offset: usize,
    /// Number of bytes.
    pub len: usize,
}

impl<'a> Sge<'a> {
    /// `len` bytes at `offset` of `mr`.
    pub fn new(mr: &'a MemoryRegion, offset: usize, len: usize) -> Self {
        Self { mr, offset, len }
    }
    /// The whole region.
    pub fn whole(mr: &'a MemoryRegion) -> Self {
        Self {
            mr,
            offset: 0,
            len: mr.inner.len,
        }
    }
}

/// A send-queue work request (`ibv_send_wr`).
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: WrOp,
    /// Local buffers: gathered for WRITE/SEND, scattered into for READ and atomics (one 8-byte element).
    pub sg_list: &'a [Sge<'a>],
    /// Whether a successful completion is reported (errors always are).
    pub signaled: bool,
}

impl<'a> SendWr<'a> {
    /// A signaled request.
    pub fn new(wr_id: u64, op: WrOp, sg_list: &'a [Sge<'a>]) -> Self {
        Self {
            wr_id,
            op,
            sg_list,
            signaled: true,
        }
    }
    /// The same request, unsignaled.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }
    /// Total bytes in the scatter-gather list.
    pub fn total_len(&self) -> usize {
        self.sg_list.iter().map(|s| s.len).sum()
    }
}

/// A receive-queue work request (`ibv_recv_wr`).
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Buffers the incoming SEND is scattered into (empty for immediates only).
    pub sg_list: &'a [Sge<'a>],
}

impl<'a> RecvWr<'a> {
    /// A receive request.
    pub fn new(wr_id: u64, sg_list: &'a [Sge<'a>]) -> Self {
        Self { wr_id, sg_list }
    }
}
