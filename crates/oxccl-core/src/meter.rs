//! What each network link actually delivers, measured by the sender as the collectives run.
//!
//! A link is *busy* from the moment a fragment is posted to it while nothing else is in
//! flight until the completion (the target's acknowledgement) of the last one in flight.
//! Bytes acknowledged over busy time is the rate the path to that peer carried while it had
//! data to carry: a ring whose pace is set by a slow link elsewhere still reads its own
//! link's rate (each fragment crosses at line rate, then the link idles), and flows that share
//! a link read their fair shares, which add up to the link's rate. The gaps between busy
//! periods (waiting for credits, for a reduction, for an upstream peer) do not count.
//!
//! The cost is two clock reads per fragment of a metered (tcp) link; shm links are not
//! metered.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One link's meter (a sender's view of the path to one peer).
#[derive(Debug, Default)]
pub struct LinkMeter {
    /// Bytes of the fragments in flight, oldest first (completions come in order on a
    /// reliable connection).
    in_flight: VecDeque<u32>,
    /// When the current busy period began.
    since: Option<Instant>,
    /// Acknowledged bytes and busy time since the last [`LinkMeter::take`].
    bytes: u64,
    busy: Duration,
}

/// What a link delivered over some busy time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Bytes acknowledged.
    pub bytes: u64,
    /// Time with something in flight.
    pub busy: Duration,
}

impl Delivered {
    /// The rate while busy, in kbit/s (0 with no busy time).
    pub fn kbit_per_s(self) -> u64 {
        let ns = self.busy.as_nanos();
        if ns == 0 {
            return 0;
        }
        // bytes · 8 / ns = Gbit/s; · 10^6 = kbit/s.
        u64::try_from(u128::from(self.bytes) * 8_000_000 / ns).unwrap_or(u64::MAX)
    }
}

impl LinkMeter {
    /// A fragment of `len` bytes was posted at `now`.
    pub fn posted(&mut self, len: usize, now: Instant) {
        if self.in_flight.is_empty() {
            self.since = Some(now);
        }
        self.in_flight
            .push_back(u32::try_from(len).unwrap_or(u32::MAX));
    }

    /// The oldest fragment in flight completed at `now`; returns its length (`None`: nothing
    /// was in flight, the fragment was not metered).
    pub fn completed(&mut self, now: Instant) -> Option<usize> {
        let len = self.in_flight.pop_front()?;
        self.bytes += u64::from(len);
        if self.in_flight.is_empty()
            && let Some(t) = self.since.take()
        {
            self.busy += now.saturating_duration_since(t);
        }
        Some(len as usize)
    }

    /// Forgets fragments that will never complete (a failed call).
    pub fn reset_in_flight(&mut self) {
        self.in_flight.clear();
        self.since = None;
    }

    /// What was delivered since the last call, and starts over.
    pub fn take(&mut self) -> Delivered {
        let d = Delivered {
            bytes: self.bytes,
            busy: self.busy,
        };
        self.bytes = 0;
        self.busy = Duration::ZERO;
        d
    }
}

/// A rank's aggregate rate into the network: bytes acknowledged over all its metered links,
/// in windows of [`EgressMeter::WINDOW`] of busy time (some link with data in flight); the
/// best window is kept. Flows that share this rank's link read fair shares each, but their
/// sum is what the link carries while it is the bottleneck, which the best window shows; a
/// window in which only a flow held back by a slow receiver is left reads low, and is not the
/// best.
#[derive(Debug, Default)]
pub struct EgressMeter {
    in_flight: usize,
    since: Option<Instant>,
    win_bytes: u64,
    win_busy: Duration,
    win_fragments: usize,
    best: u64,
}

impl EgressMeter {
    /// Least busy time per window: long enough to average out a shaper's burst allowance.
    pub const WINDOW: Duration = Duration::from_millis(20);
    /// Least fragments per window: acknowledgements come in bursts (cumulative ones, a busy
    /// target), so a window of few fragments can count one too many.
    pub const WINDOW_FRAGMENTS: usize = 16;

    /// A fragment was posted to some metered link at `now`.
    pub fn posted(&mut self, now: Instant) {
        if self.in_flight == 0 {
            self.since = Some(now);
        }
        self.in_flight += 1;
    }

    /// A fragment of `len` bytes completed at `now`.
    pub fn completed(&mut self, len: usize, now: Instant) {
        if self.in_flight == 0 {
            return;
        }
        self.in_flight -= 1;
        self.win_bytes += len as u64;
        self.win_fragments += 1;
        let busy_now = self
            .since
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        if self.win_busy + busy_now >= Self::WINDOW && self.win_fragments >= Self::WINDOW_FRAGMENTS
        {
            let d = Delivered {
                bytes: self.win_bytes,
                busy: self.win_busy + busy_now,
            };
            self.best = self.best.max(d.kbit_per_s());
            self.win_bytes = 0;
            self.win_busy = Duration::ZERO;
            self.win_fragments = 0;
            self.since = (self.in_flight > 0).then_some(now);
        } else if self.in_flight == 0 {
            self.win_busy += busy_now;
            self.since = None;
        }
    }

    /// Forgets what is in flight (a failed call).
    pub fn reset_in_flight(&mut self) {
        self.in_flight = 0;
        self.since = None;
    }

    /// The best window's rate (kbit/s) since the last call, and starts over.
    pub fn take(&mut self) -> u64 {
        self.win_bytes = 0;
        self.win_busy = Duration::ZERO;
        self.win_fragments = 0;
        std::mem::take(&mut self.best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_spans_overlapping_fragments_and_skips_gaps() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let mut m = LinkMeter::default();
        // Two fragments of 1 MB in flight together from 0 to 16 ms.
        m.posted(1_000_000, ms(0));
        m.posted(1_000_000, ms(1));
        m.completed(ms(8));
        m.completed(ms(16));
        // Idle from 16 to 100 ms (waiting for an upstream peer): not busy.
        m.posted(1_000_000, ms(100));
        m.completed(ms(108));
        let d = m.take();
        assert_eq!(d.bytes, 3_000_000);
        assert_eq!(d.busy, Duration::from_millis(24));
        // 3 MB in 24 ms: 1 Gbit/s.
        assert_eq!(d.kbit_per_s(), 1_000_000);
        assert_eq!(m.take(), Delivered::default());
        assert_eq!(Delivered::default().kbit_per_s(), 0);
        // A stray completion is ignored; a reset forgets what is in flight.
        m.completed(ms(200));
        m.posted(10, ms(300));
        m.reset_in_flight();
        m.completed(ms(400));
        assert_eq!(m.take(), Delivered::default());
    }

    #[test]
    fn egress_keeps_the_best_window_of_busy_time() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let mut e = EgressMeter::default();
        // 0-32 ms: two flows together, 16 fragments of 250 kB acknowledged, one every 2 ms:
        // 4 MB in 32 ms, 1 Gbit/s.
        e.posted(ms(0));
        for k in 1..=16u64 {
            e.posted(ms(2 * k - 2));
            e.completed(250_000, ms(2 * k));
        }
        e.completed(0, ms(32));
        // Idle, then a slow tail: 16 fragments of 31.25 kB in 40 ms (0.1 Gbit/s).
        for k in 0..16u64 {
            e.posted(ms(500 + 2 * k));
            e.completed(31_250, ms(502 + 2 * k + u64::from(k == 15) * 8));
        }
        assert_eq!(e.take(), 1_000_000);
        assert_eq!(e.take(), 0);
        // Short busy periods add up into one window across idle gaps.
        for k in 0..16u64 {
            e.posted(ms(1000 + 100 * k));
            e.completed(250_000, ms(1002 + 100 * k));
        }
        assert_eq!(e.take(), 1_000_000);
    }
}
