//! The core of a completion queue ([`CqCore`]): its local completions and its doorbell, what a
//! queue pair pushes to and rings. Polling and waiting, and the list of queue pairs a queue
//! harvests, are the resource layer's (`resource::cq`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use super::ctx::{CtxInner, CtxTables, MAX_CQ};
use super::segment::futex_wake_all;
use crate::model::{Error, Result, WorkCompletion};

/// Doorbell word 0: the sequence, bumped on every completion.
pub(crate) const SEQ: usize = 0;
/// Doorbell word 1: how many waiters sleep on the sequence.
pub(crate) const SLEEPERS: usize = 1;

/// The completions of a completion queue that queue pairs push (send completions; receive
/// completions stay in each queue pair's ring until harvested), and its doorbell slot in the
/// context segment. Its slot is taken while any queue pair still refers to it.
pub(crate) struct CqCore {
    pub ctx: Arc<CtxInner>,
    pub index: u32,
    local: Mutex<VecDeque<WorkCompletion>>,
    local_len: AtomicUsize,
}

impl CqCore {
    /// Takes a doorbell slot of `ctx` for a new queue (`cqe`: a capacity hint).
    pub(crate) fn new(ctx: Arc<CtxInner>, cqe: usize) -> Result<CqCore> {
        let index = ctx
            .tables
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_cq
            .pop()
            .ok_or_else(|| {
                Error::Exhausted(format!(
                    "all {MAX_CQ} completion-queue slots of this context are in use"
                ))
            })?;
        ctx.seg.cq_word(index, SLEEPERS).store(0, Ordering::SeqCst);
        Ok(CqCore {
            ctx,
            index,
            local: Mutex::new(VecDeque::with_capacity(cqe.min(1 << 16))),
            local_len: AtomicUsize::new(0),
        })
    }

    /// Moves queued local completions into `out`; how many.
    pub(crate) fn drain_local(&self, out: &mut [WorkCompletion]) -> usize {
        if out.is_empty() || self.local_len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut q = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let n = q.len().min(out.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        self.local_len.store(q.len(), Ordering::Release);
        n
    }

    /// Queues a local completion and wakes sleepers.
    pub(crate) fn push(&self, wc: WorkCompletion) {
        {
            let mut q = self.local.lock().unwrap_or_else(|e| e.into_inner());
            q.push_back(wc);
            self.local_len.store(q.len(), Ordering::Release);
        }
        self.notify();
    }

    /// Wakes this queue's sleepers, if any (no syscall when nobody sleeps).
    pub(crate) fn notify(&self) {
        notify_word(
            self.ctx.seg.cq_word(self.index, SEQ),
            self.ctx.seg.cq_word(self.index, SLEEPERS),
        );
        self.ctx.ops.notify();
    }
}

/// The doorbell protocol of a completion-queue slot: bump, then wake only when someone sleeps.
pub(crate) fn notify_word(seq: &AtomicU32, sleepers: &AtomicU32) {
    seq.fetch_add(1, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) > 0 {
        futex_wake_all(seq);
    }
}

impl Drop for CqCore {
    fn drop(&mut self) {
        self.ctx
            .tables
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_cq
            .push(self.index);
    }
}
