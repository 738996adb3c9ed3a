//! Test-only hooks the core calls at chosen points, to force interleavings (`src/tests.rs`
//! sets them).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long the tcp provider pauses between pushing a request's error completion and
/// flushing the queue pair (0: no pause).
pub(crate) static ERROR_FLUSH_PAUSE_MS: AtomicU64 = AtomicU64::new(0);

pub(crate) fn between_error_completion_and_flush() {
    let ms = ERROR_FLUSH_PAUSE_MS.load(Ordering::Relaxed);
    if ms > 0 {
        std::thread::sleep(Duration::from_millis(ms));
    }
}
