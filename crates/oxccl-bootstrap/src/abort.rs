//! [`AbortHandle`]: stops a join or an init that waits for ranks, from any thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How often a wait that an [`AbortHandle`] watches looks at it: the bound on how long an
/// abort takes to stop a store wait (plus one store round trip), in jobs of up to 100 ranks;
/// larger jobs look every 0.2 ms × their world size, so that the store is not flooded.
pub const ABORT_POLL: Duration = Duration::from_millis(20);

type Hook = Box<dyn Fn(&str) + Send + Sync>;

#[derive(Default)]
struct Inner {
    aborted: AtomicBool,
    reason: OnceLock<String>,
    hooks: Mutex<Vec<(u64, Hook)>>,
    next_hook: AtomicU64,
}

/// A switch that stops a join ([`Bootstrap::new_abortable`](crate::Bootstrap::new_abortable))
/// or an init that waits for ranks, from any thread: clones share one switch.
///
/// Every wait that watches it (the bootstrap's join, all-gathers and barriers, and what
/// `oxccl::Communicator::init_abortable` connects) looks at it at least every
/// [`ABORT_POLL`] and then fails with [`Error::Aborted`](crate::Error::Aborted), naming
/// what it was waiting for. Aborting is final: a handle once aborted stays so.
///
/// ```
/// let handle = oxccl_bootstrap::AbortHandle::new();
/// let other = handle.clone();
/// std::thread::spawn(move || other.abort_with("the job was cancelled")).join().unwrap();
/// assert!(handle.is_aborted());
/// assert_eq!(handle.reason().as_deref(), Some("the job was cancelled"));
/// ```
#[derive(Clone, Default)]
pub struct AbortHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle")
            .field("aborted", &self.is_aborted())
            .finish_non_exhaustive()
    }
}

/// Runs while registered ([`AbortHandle::on_abort`]); dropping it unregisters the hook.
#[must_use = "dropping the guard unregisters the hook at once"]
pub struct AbortHook {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for AbortHook {
    fn drop(&mut self) {
        self.inner
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(id, _)| *id != self.id);
    }
}

impl AbortHandle {
    /// A switch not yet set.
    pub fn new() -> AbortHandle {
        AbortHandle::default()
    }

    /// Aborts, with the reason "AbortHandle::abort was called".
    pub fn abort(&self) {
        self.abort_with("AbortHandle::abort was called");
    }

    /// Aborts with `reason` and runs the registered hooks on this thread. Only the first
    /// call does anything.
    pub fn abort_with(&self, reason: &str) {
        let _ = self.inner.reason.set(reason.to_owned());
        if self.inner.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let why = self.reason().unwrap_or_default();
        for (_, hook) in self
            .inner
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            hook(&why);
        }
    }

    /// Whether it was aborted.
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::SeqCst)
    }

    /// Why it was aborted, once it was.
    pub fn reason(&self) -> Option<String> {
        self.is_aborted()
            .then(|| self.inner.reason.get().cloned().unwrap_or_default())
    }

    /// Runs `hook(reason)` when the handle is aborted (at once, on this thread, if it already
    /// is), until the returned guard is dropped: how a wait that cannot poll the handle (a
    /// connection being set up, a collective) is told. The hook runs on the aborting thread
    /// with the handle's hook list locked: keep it short, do not register hooks from it, and
    /// make it idempotent (a hook registered while the handle is being aborted may run twice).
    pub fn on_abort(&self, hook: impl Fn(&str) + Send + Sync + 'static) -> AbortHook {
        let id = self.inner.next_hook.fetch_add(1, Ordering::Relaxed);
        let mut hooks = self.inner.hooks.lock().unwrap_or_else(|e| e.into_inner());
        hooks.push((id, Box::new(hook)));
        // Checked under the lock: `abort_with` sets the flag before it takes the lock, so a
        // hook registered after the abort ran its hooks sees the flag here.
        if self.is_aborted() {
            let why = self.reason().unwrap_or_default();
            (hooks.last().expect("just pushed").1)(&why);
        }
        drop(hooks);
        AbortHook {
            inner: self.inner.clone(),
            id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn hooks_run_once_registered_and_not_after_their_guard_is_dropped() {
        let h = AbortHandle::new();
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        let kept = h.on_abort(move |why| {
            assert_eq!(why, "stop");
            n2.fetch_add(1, Ordering::SeqCst);
        });
        let n3 = n.clone();
        drop(h.on_abort(move |_| {
            n3.fetch_add(100, Ordering::SeqCst);
        }));
        assert_eq!(h.reason(), None);
        h.clone().abort_with("stop");
        h.abort_with("ignored: the first reason is kept");
        assert_eq!(h.reason().as_deref(), Some("stop"));
        assert_eq!(n.load(Ordering::SeqCst), 1, "the kept hook, once");
        let n4 = n.clone();
        let _late = h.on_abort(move |_| {
            n4.fetch_add(10, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 11, "a late hook runs at once");
        drop(kept);
    }
}
