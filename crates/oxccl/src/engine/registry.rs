//! The engine's table of registered buffers ([`Registry`], shared with the communicator that
//! registers them) and each call's snapshot of it ([`RegCache`]), in which a call finds
//! whether a buffer it moves is registered, and with which region.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use oxccl_verbs::MemoryRegion;

/// One registered buffer: its bytes and a registration in each of the engine's provider
/// contexts (in the engine's order).
pub(crate) struct Reg {
    pub addr: usize,
    pub len: usize,
    pub mrs: Vec<MemoryRegion>,
}

impl Reg {
    /// Whether `addr..addr + len` lies inside this buffer.
    pub(crate) fn covers(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr && addr - self.addr + len <= self.len
    }
}

/// A communicator's registered buffers, shared by the engine (which looks calls' buffers up
/// in it) and the handles (which remove theirs when dropped).
#[derive(Default)]
pub(crate) struct Registry {
    /// Bumped on every change: the engine refreshes its copy when it differs.
    version: AtomicU64,
    regs: Mutex<Vec<Arc<Reg>>>,
}

impl Registry {
    /// The registrations, sorted by address, and the generation they belong to.
    pub(crate) fn snapshot(&self) -> (u64, Vec<Arc<Reg>>) {
        let regs = self.regs.lock().unwrap_or_else(|e| e.into_inner());
        (self.version.load(Ordering::Acquire), regs.clone())
    }

    /// The current generation (one load).
    pub(crate) fn generation(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Adds `reg`, unless it overlaps a buffer registered already (that one's range, then).
    pub(crate) fn insert(&self, reg: Arc<Reg>) -> std::result::Result<(), (usize, usize)> {
        let mut regs = self.regs.lock().unwrap_or_else(|e| e.into_inner());
        let at = regs.partition_point(|r| r.addr < reg.addr);
        let overlaps = |r: &&Arc<Reg>| r.addr < reg.addr + reg.len && reg.addr < r.addr + r.len;
        let before = at.checked_sub(1).and_then(|b| regs.get(b));
        if let Some(r) = regs.get(at).filter(overlaps).or(before.filter(overlaps)) {
            return Err((r.addr, r.len));
        }
        regs.insert(at, reg);
        self.version.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Deregisters every registration's regions, once a call failed: writes into them that
    /// peers (which may not know of the failure yet) have under way finish first, later ones
    /// are refused, so that nothing lands in a caller's registered buffer after its call
    /// returned the error. The buffers stay the caller's; the communicator is unusable anyway.
    pub(crate) fn revoke(&self) {
        let regs = self.regs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for r in &regs {
            for mr in &r.mrs {
                mr.deregister();
            }
        }
    }

    pub(crate) fn remove(&self, reg: &Arc<Reg>) {
        let mut regs = self.regs.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|r| !Arc::ptr_eq(r, reg));
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}

/// The engine's copy of a [`Registry`], refreshed when its generation changes.
#[derive(Default)]
pub(crate) struct RegCache {
    version: u64,
    regs: Vec<Arc<Reg>>,
}

impl RegCache {
    /// Brings the copy up to date (one load when nothing changed).
    pub(crate) fn refresh(&mut self, registry: &Registry) {
        if registry.generation() != self.version {
            (self.version, self.regs) = registry.snapshot();
        }
    }

    /// Whether any buffer is registered.
    pub(crate) fn is_empty(&self) -> bool {
        self.regs.is_empty()
    }

    /// The registered buffer holding `addr..addr + len`, if one does and it is registered
    /// in provider context `ctx`: its index, its first address and that registration.
    pub(crate) fn find(
        &self,
        addr: usize,
        len: usize,
        ctx: usize,
    ) -> Option<(usize, usize, &MemoryRegion)> {
        let i = self
            .regs
            .partition_point(|r| r.addr <= addr)
            .checked_sub(1)?;
        let r = &self.regs[i];
        let mr = r.mrs.get(ctx).filter(|m| m.is_registered())?;
        r.covers(addr, len).then_some((i, r.addr, mr))
    }

    /// Registered buffer number `i` (from [`RegCache::find`], until the next refresh).
    pub(crate) fn get(&self, i: usize) -> &Reg {
        &self.regs[i]
    }
}
