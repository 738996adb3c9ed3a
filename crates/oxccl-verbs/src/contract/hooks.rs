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

/// How long a destroyed tcp queue pair waits, after ending its other connections, before it
/// sends what it owes on connection 0 (0: no reordering), so that the peer reads those ends
/// first.
pub(crate) static TCP_CLOSE_CONN0_LAST_MS: AtomicU64 = AtomicU64::new(0);

/// Ends (write side) every connection of `socks` but the first, then pauses, when
/// [`TCP_CLOSE_CONN0_LAST_MS`] says so.
pub(crate) fn before_close_flush<'a>(socks: impl Iterator<Item = &'a std::net::TcpStream>) {
    let ms = TCP_CLOSE_CONN0_LAST_MS.load(Ordering::Relaxed);
    if ms > 0 {
        for s in socks.skip(1) {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
        std::thread::sleep(Duration::from_millis(ms));
    }
}
