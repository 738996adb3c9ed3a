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
//! The spin adapts from call to call ([`next_spin`]): a yield that gave the CPU to another
//! thread says a peer shares this CPU (the scheduler put both ranks on one CPU, for a while),
//! and a spin would only hold it off, so the next calls yield at once; waits that give
//! nothing away (the spin covered them, or the yields found the CPU free) let it grow back.
//!
//! A yielding call pays a context switch per yield, and every pass over the call's state
//! after a switch runs on cold caches: so, where the call waits for one word (a mailbox's
//! flag), it reloads that word alone after each yield ([`watch`]) and makes a full pass only
//! once the word changed, or after [`WATCH_YIELDS`] yields (to look at the clock, failed
//! links and strays).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Loads of a watched word between passes of a spinning call.
pub(crate) const WATCH_SPINS: u32 = 64;

/// Yields of a yielding call watching one word before it makes a full pass (and reads the
/// clock): a full pass costs about as much as a yield, so this also bounds how often the
/// clock, the links' health and strays are looked at (as the mailbox loop's 32 idle passes).
pub(crate) const WATCH_YIELDS: u32 = 32;

/// A `sched_yield` that took at least this long (plus the clock's own cost, [`ceded_after`])
/// gave the CPU to another thread: one with nothing else runnable on its CPU returns in a few
/// hundred ns (0.29 µs on an Intel Xeon under KVM, 0.2% of them 1 µs or more), one that
/// switches to a yielding peer and back takes 1 µs and more, every time (2026-12-06).
const CEDED_AFTER: Duration = Duration::from_micros(1);

/// [`CEDED_AFTER`] plus what timing a yield costs here, measured once: two clock reads take a
/// few tens of ns through the vDSO, but where the clock source has none (some VMs') each is a
/// system call, which would otherwise make every yield look like one that gave the CPU away.
fn ceded_after() -> Duration {
    static AFTER: OnceLock<Duration> = OnceLock::new();
    *AFTER.get_or_init(|| {
        let read = (0..32)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(Instant::now());
                t.elapsed()
            })
            .min()
            .unwrap_or_default();
        CEDED_AFTER + read
    })
}

/// What a call's waits said about its CPU ([`Yields::idled`], [`Yields::cede`],
/// [`next_spin`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Yields {
    /// The call never waited (every message was there): nothing learned.
    #[default]
    None,
    /// It waited and never yielded: its spin sufficed, or (across hosts, where a call does
    /// not yield) it slept once the spin was over.
    Spun,
    /// It yielded, and no yield gave the CPU away: nothing else wants this CPU.
    Alone,
    /// A yield gave the CPU to another thread: a peer on this CPU, which a spin holds off.
    Shared,
}

impl Yields {
    /// Whether the call has yielded: its wait outlasted its spin, so it yields between polls
    /// from then on ([`Policy::yields`]).
    pub(crate) fn yielded(self) -> bool {
        matches!(self, Yields::Alone | Yields::Shared)
    }

    /// Notes an idle turn of the call (it waits).
    pub(crate) fn idled(&mut self) {
        if *self == Yields::None {
            *self = Yields::Spun;
        }
    }

    /// Yields the CPU, and notes whether another thread ran meanwhile (the yield took
    /// [`ceded_after`] or longer).
    pub(crate) fn cede(&mut self) {
        let t = Instant::now();
        std::thread::yield_now();
        if t.elapsed() >= ceded_after() {
            *self = Yields::Shared;
        } else if *self != Yields::Shared {
            *self = Yields::Alone;
        }
    }
}

/// The least spin after a call that waited without giving its CPU away: a spin of none
/// (after one that did) grows back from here, doubling ([`next_spin`]).
pub(crate) const SPIN_STEP: Duration = Duration::from_micros(2);

/// The spin of the next idle call, after one that spun for `now` (of at most `full`) and
/// whose waits said `yields`:
/// - [`Yields::Shared`]: none. A peer on this CPU cannot answer while we spin, so the next
///   wait yields at once (as an oversubscribed rank's always does).
/// - [`Yields::Spun`] or [`Yields::Alone`]: twice `now` (at least [`SPIN_STEP`]), back up to
///   `full`.
/// - [`Yields::None`]: `now`. A call that never waited learned nothing: in a ping-pong on one
///   CPU, every other call finds its message there.
pub(crate) fn next_spin(now: Duration, full: Duration, yields: Yields) -> Duration {
    match yields {
        Yields::Shared => Duration::ZERO,
        Yields::Spun | Yields::Alone => (now * 2).max(SPIN_STEP).min(full),
        Yields::None => now.min(full),
    }
}

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

    /// Whether a call yields between polls rather than spinning: with no spin at all, or
    /// once it has yielded (`yielded`: its wait outlasted the spin, [`Yields::yielded`]).
    pub(crate) fn yields(&self, yielded: bool) -> bool {
        self.spin.is_zero() || yielded
    }
}

/// Spins or yields (`yielding`) until `word` reads `want`, at most [`WATCH_SPINS`] loads or
/// [`WATCH_YIELDS`] yields; returns whether it read `want`. A first load that misses is a wait,
/// noted in `yields` with the yields.
pub(crate) fn watch(word: &AtomicU64, want: u64, yielding: bool, yields: &mut Yields) -> bool {
    if word.load(Ordering::Acquire) == want {
        return true;
    }
    yields.idled();
    if yielding {
        for _ in 0..WATCH_YIELDS {
            yields.cede();
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
    fn the_spin_shortens_only_after_a_yield_gave_the_cpu_away() {
        let us = Duration::from_micros;
        // Shared: the next call yields at once.
        assert_eq!(next_spin(us(50), us(50), Yields::Shared), Duration::ZERO);
        assert_eq!(next_spin(us(8), us(50), Yields::Shared), Duration::ZERO);
        // No yield: nothing learned.
        assert_eq!(
            next_spin(Duration::ZERO, us(50), Yields::None),
            Duration::ZERO
        );
        assert_eq!(next_spin(us(8), us(50), Yields::None), us(8));
        assert_eq!(next_spin(us(50), us(50), Yields::None), us(50));
        // Alone (the wait outlasted the spin, and yielding gave nothing away) or Spun (the
        // spin sufficed): back up by doubling.
        for y in [Yields::Alone, Yields::Spun] {
            let mut spin = Duration::ZERO;
            let mut seen = vec![];
            for _ in 0..8 {
                spin = next_spin(spin, us(50), y);
                seen.push(spin.as_micros());
            }
            assert_eq!(seen, [2, 4, 8, 16, 32, 50, 50, 50], "{y:?}");
        }
        // A full spin shorter than the step, and none at all (oversubscribed).
        assert_eq!(next_spin(Duration::ZERO, us(1), Yields::Alone), us(1));
        assert_eq!(next_spin(us(1), us(1), Yields::Shared), Duration::ZERO);
        for y in [Yields::None, Yields::Spun, Yields::Alone, Yields::Shared] {
            assert_eq!(next_spin(Duration::ZERO, Duration::ZERO, y), Duration::ZERO);
        }
    }

    #[test]
    fn waits_note_the_strongest_thing_they_learned() {
        let mut y = Yields::None;
        y.idled();
        assert_eq!(y, Yields::Spun);
        y.cede(); // No thread is pinned beside this one: at most a stray one takes the CPU.
        assert_ne!(y, Yields::Spun);
        assert_ne!(y, Yields::None);
        y.idled();
        assert!(
            matches!(y, Yields::Alone | Yields::Shared),
            "an idle turn adds nothing"
        );
        let mut s = Yields::Shared;
        s.idled();
        assert_eq!(s, Yields::Shared);
    }

    #[test]
    fn cede_tells_a_yield_that_let_a_thread_on_this_cpu_run() {
        use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
        use std::sync::atomic::AtomicBool;
        assert!(ceded_after() >= CEDED_AFTER && ceded_after() < CEDED_AFTER * 100);
        /// Stops the other thread however the test ends.
        struct Stop(Arc<AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        // The test's thread and another on one CPU, which yields in a loop (a peer waiting as
        // ours do): it runs only when the test's thread yields.
        let mine = sched_getaffinity(None).unwrap();
        let cpu = (0..CpuSet::MAX_CPU).find(|&c| mine.is_set(c)).unwrap();
        let mut one = CpuSet::new();
        one.set(cpu);
        let (running, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let _stop = Stop(Arc::clone(&stop));
        let (r2, s2) = (Arc::clone(&running), Arc::clone(&stop));
        let t = std::thread::spawn(move || {
            let pinned = sched_setaffinity(None, &one);
            r2.store(true, Ordering::Release);
            while pinned.is_ok() && !s2.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            pinned
        });
        let start = Instant::now();
        while !running.load(Ordering::Acquire) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the other thread never started"
            );
            std::thread::yield_now();
        }
        sched_setaffinity(None, &one).unwrap();
        let ceded = (0..20)
            .filter(|_| {
                let mut y = Yields::None;
                y.cede();
                y == Yields::Shared
            })
            .count();
        drop(_stop);
        sched_setaffinity(None, &mine).unwrap();
        t.join().unwrap().expect("pinning the other thread");
        assert!(
            ceded >= 16,
            "only {ceded} of 20 yields to a thread yielding on CPU {cpu} were seen to give it the CPU"
        );
    }

    #[test]
    fn watch_sees_a_word_another_thread_sets_and_gives_up_when_none_does() {
        let w = Arc::new(AtomicU64::new(0));
        let mut y = Yields::None;
        assert!(!watch(&w, 1, false, &mut y));
        assert_eq!(
            y,
            Yields::Spun,
            "a spinning watch that missed waited, and never yielded"
        );
        assert!(!watch(&w, 1, true, &mut y));
        assert!(
            matches!(y, Yields::Alone | Yields::Shared),
            "a yielding watch notes its yields"
        );
        w.store(1, Ordering::Release);
        let mut found = Yields::None;
        assert!(watch(&w, 1, false, &mut found) && watch(&w, 1, true, &mut found));
        assert_eq!(found, Yields::None, "a word already set is no wait");
        // A writer that runs only once the watcher yields (one CPU's worth of both).
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || w2.store(2, Ordering::Release));
        let start = Instant::now();
        while !watch(&w, 2, true, &mut y) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "never saw the store"
            );
        }
        t.join().unwrap();
    }
}
