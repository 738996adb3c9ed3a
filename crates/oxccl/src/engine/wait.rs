//! How an idle call waits: the one waiting policy every loop that drives calls uses (the
//! slot protocol's rounds, [`super::Call::run`] and the session's `drive`, and the mailbox
//! loop, [`super::Call::run_mailbox`]).
//!
//! An idle call first spins (polls without giving its CPU away) for `spin`, then polls with a
//! `sched_yield` between polls until it has been idle for `yield_for`, then sleeps (on the
//! completion queue, or a short nap where there is nothing to sleep on). With more ranks on
//! this host than CPUs it may use, the spin is 0 (a spinning rank holds off the very peer it
//! waits for): the call yields at once, as Open MPI's `opal_progress` does when
//! `mpi_yield_when_idle` is set (mpirun sets it when it oversubscribes).
//!
//! A yielding call pays a context switch per yield, and every pass over the call's state
//! after a switch runs on cold caches: so, where the call waits for one word (a mailbox's
//! flag), it reloads that word alone after each yield ([`watch`]) and makes a full pass only
//! once the word changed, or after [`WATCH_YIELDS`] yields (to look at the clock, failed
//! links and strays).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Loads of a watched word between passes of a spinning call.
pub(crate) const WATCH_SPINS: u32 = 64;

/// Yields of a yielding call watching one word before it makes a full pass (and reads the
/// clock): a full pass costs about as much as a yield, so this also bounds how often the
/// clock, the links' health and strays are looked at (as the mailbox loop's 32 idle passes).
pub(crate) const WATCH_YIELDS: u32 = 32;

/// What an idle call does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pause {
    /// Poll again at once.
    Spin,
    /// Give the CPU to another runnable thread, then poll again.
    Yield,
    /// Sleep until something arrives (or for a short nap).
    Sleep,
}

/// An engine's waiting policy ([`crate::Options::idle_spin`], [`crate::Options::idle_yield`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    /// How long an idle call polls without yielding.
    pub(crate) spin: Duration,
    /// How long (counted from the start of the idle spell) an idle call polls at all, yielding
    /// between polls once the spin is over, before it sleeps.
    pub(crate) yield_for: Duration,
}

impl Policy {
    /// What a call that has been idle for `idle` does next.
    pub(crate) fn pause(&self, idle: Duration) -> Pause {
        if idle < self.spin {
            Pause::Spin
        } else if idle < self.yield_for {
            Pause::Yield
        } else {
            Pause::Sleep
        }
    }

    /// Whether a call whose wait outlasted the spin (`spun_out`) yields between polls
    /// rather than spinning.
    pub(crate) fn yields(&self, spun_out: bool) -> bool {
        self.spin.is_zero() || spun_out
    }
}

/// Spins or yields (`yielding`) until `word` reads `want`, at most [`WATCH_SPINS`] loads or
/// [`WATCH_YIELDS`] yields; returns whether it read `want`.
pub(crate) fn watch(word: &AtomicU64, want: u64, yielding: bool) -> bool {
    if word.load(Ordering::Acquire) == want {
        return true;
    }
    if yielding {
        for _ in 0..WATCH_YIELDS {
            std::thread::yield_now();
            if word.load(Ordering::Acquire) == want {
                return true;
            }
        }
    } else {
        for _ in 0..WATCH_SPINS {
            std::hint::spin_loop();
            if word.load(Ordering::Acquire) == want {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn the_policy_spins_then_yields_then_sleeps() {
        let p = Policy {
            spin: Duration::from_micros(50),
            yield_for: Duration::from_millis(2),
        };
        assert_eq!(p.pause(Duration::ZERO), Pause::Spin);
        assert_eq!(p.pause(Duration::from_micros(49)), Pause::Spin);
        assert_eq!(p.pause(Duration::from_micros(50)), Pause::Yield);
        assert_eq!(p.pause(Duration::from_micros(1999)), Pause::Yield);
        assert_eq!(p.pause(Duration::from_millis(2)), Pause::Sleep);
        assert!(!p.yields(false));
        assert!(p.yields(true));
        // Oversubscribed: no spin at all; across hosts: no yielding either.
        let over = Policy {
            spin: Duration::ZERO,
            ..p
        };
        assert_eq!(over.pause(Duration::ZERO), Pause::Yield);
        assert!(over.yields(false));
        let net = Policy {
            spin: Duration::from_micros(50),
            yield_for: Duration::ZERO,
        };
        assert_eq!(net.pause(Duration::ZERO), Pause::Spin);
        assert_eq!(net.pause(Duration::from_micros(50)), Pause::Sleep);
    }

    #[test]
    fn watch_sees_a_word_another_thread_sets_and_gives_up_when_none_does() {
        let w = Arc::new(AtomicU64::new(0));
        assert!(!watch(&w, 1, false));
        assert!(!watch(&w, 1, true));
        w.store(1, Ordering::Release);
        assert!(watch(&w, 1, false) && watch(&w, 1, true));
        // A writer that runs only once the watcher yields (one CPU's worth of both).
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || w2.store(2, Ordering::Release));
        let start = Instant::now();
        while !watch(&w, 2, true) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "never saw the store"
            );
        }
        t.join().unwrap();
    }
}
