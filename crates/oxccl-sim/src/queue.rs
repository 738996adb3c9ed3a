//! The run's event queue: a monotone priority queue of `(time, key)` pairs (a radix heap).
//!
//! The run pops events in the order of their times, ties broken by their keys, and never
//! schedules an event before the time of the last one it popped: a *monotone* queue, which a
//! radix heap serves in O(1) amortised per push plus, per pop, a pass over a bucket that
//! only moves items towards the front. Times are the bits of non-negative `f64`s, which
//! order as the numbers do.
//!
//! Items are bucketed by the highest bit in which their time differs from `last`, the time
//! of the last pop: bucket `i ≥ 1` holds the times whose highest bit differing from `last`
//! is bit `i − 1`, so every time in bucket `i` is smaller than every time in bucket `j > i`,
//! and bucket 0 holds the items at `last` itself, sorted by key. A pop takes the smallest
//! key of bucket 0; when bucket 0 is empty, the smallest time of the first non-empty bucket
//! becomes `last` and that bucket's items move to lower buckets (each item moves at most 64
//! times over its life, and in practice a few).
//!
//! Against a binary heap: the run's 25 million events of a 16,384-rank all-reduce sat in a
//! heap of about 3,500 entries, and a pop cost a dozen levels of unpredictable comparisons;
//! here a push is a bit scan and a vector push, and events at equal times (the symmetric
//! runs have several per time) are sorted together once.

/// A monotone min-queue of `(time, key)`: see the module docs.
#[derive(Debug)]
pub(crate) struct EventQueue {
    /// No item is earlier than this (the time of the last refill of bucket 0).
    last: u64,
    /// Keys of the items at `last`, sorted in decreasing order (the next is the last one).
    now: Vec<u64>,
    /// `later[i]`: the items whose time differs from `last` first at bit `i` (from the top).
    later: [Vec<(u64, u64)>; 64],
    /// Items in `later`.
    pending: usize,
    /// The earliest time in `later`, when known (see [`EventQueue::peek_time`]).
    min: Option<u64>,
}

impl Default for EventQueue {
    fn default() -> EventQueue {
        EventQueue::new()
    }
}

impl EventQueue {
    /// An empty queue.
    pub(crate) fn new() -> EventQueue {
        EventQueue {
            last: 0,
            now: Vec::new(),
            later: std::array::from_fn(|_| Vec::new()),
            pending: 0,
            min: None,
        }
    }

    /// Items queued.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.now.len() + self.pending
    }

    /// The bucket of `later` for `time` (> `last`).
    fn bucket(&self, time: u64) -> usize {
        63 - (time ^ self.last).leading_zeros() as usize
    }

    /// Queues `key` at `time`, which must not be earlier than the last item popped.
    pub(crate) fn push(&mut self, time: u64, key: u64) {
        debug_assert!(time >= self.last, "an event before the last one popped");
        if time == self.last {
            // Rare: an event at the time being served, in its place among those left.
            let at = self.now.partition_point(|&k| k > key);
            self.now.insert(at, key);
            return;
        }
        let b = self.bucket(time);
        self.later[b].push((time, key));
        self.pending += 1;
        if let Some(m) = self.min
            && time < m
        {
            self.min = Some(time);
        }
    }

    /// The earliest time queued, if any.
    pub(crate) fn peek_time(&mut self) -> Option<u64> {
        if !self.now.is_empty() {
            return Some(self.last);
        }
        if self.pending == 0 {
            return None;
        }
        if self.min.is_none() {
            // `pending > 0` and `now` is empty: a bucket of `later` holds them.
            let b = self.later.iter().find(|b| !b.is_empty()).expect("pending");
            self.min = b.iter().map(|x| x.0).min();
        }
        self.min
    }

    /// Takes the earliest item (the smallest key among the earliest), if any.
    pub(crate) fn pop(&mut self) -> Option<(u64, u64)> {
        if self.now.is_empty() {
            self.refill()?;
        }
        self.now.pop().map(|k| (self.last, k))
    }

    /// Moves the items at the earliest time of `later` into `now`, and the rest of their
    /// bucket into lower buckets; `None` when nothing is queued.
    fn refill(&mut self) -> Option<()> {
        let b = self.later.iter().position(|b| !b.is_empty())?;
        let items = std::mem::take(&mut self.later[b]);
        let m = match self.min {
            Some(m) => m,
            None => items.iter().map(|x| x.0).min().expect("not empty"), // bucket `b` is not
        };
        self.last = m;
        self.min = None;
        self.pending -= items.len();
        let mut items = items;
        for &(t, k) in &items {
            if t == m {
                self.now.push(k);
            } else {
                let nb = self.bucket(t);
                debug_assert!(nb < b);
                self.later[nb].push((t, k));
                self.pending += 1;
            }
        }
        // Keep the bucket's allocation for its next items.
        items.clear();
        if self.later[b].is_empty() {
            self.later[b] = items;
        }
        self.now.sort_unstable_by(|a, b| b.cmp(a));
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    #[test]
    fn pops_in_time_then_key_order() {
        let mut q = EventQueue::new();
        for (t, k) in [(5, 1), (3, 9), (5, 0), (3, 2), (9, 4), (3, 2)] {
            q.push(t, k);
        }
        assert_eq!(q.peek_time(), Some(3));
        let mut got = Vec::new();
        while let Some(x) = q.pop() {
            got.push(x);
            if x == (5, 0) && got.len() == 4 {
                // At the time being served, a smaller key than the one left comes first.
                q.push(5, 0);
                q.push(6, 7);
            }
        }
        assert_eq!(
            got,
            vec![
                (3, 2),
                (3, 2),
                (3, 9),
                (5, 0),
                (5, 0),
                (5, 1),
                (6, 7),
                (9, 4)
            ]
        );
        assert_eq!(q.peek_time(), None);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn f64_times_order_as_their_bits() {
        let ts = [0.0f64, 1e-300, 1e-9, 2.5e-6, 0.07, 0.0700000001, 1.0, 3e5];
        let mut q = EventQueue::new();
        for (i, t) in ts.iter().enumerate().rev() {
            q.push(t.to_bits(), i as u64);
        }
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|x| x.1)).collect();
        assert_eq!(order, (0..ts.len() as u64).collect::<Vec<_>>());
    }

    /// One operation of a random run: push at the last popped time plus a delta (from a
    /// small range, so that times tie often, or any), or pop.
    #[derive(Clone, Debug)]
    enum Op {
        Push(u64, u64),
        PushFar(u64, u64),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..4, 0u64..6).prop_map(|(d, k)| Op::Push(d, k)),
            1 => (any::<u64>(), any::<u64>()).prop_map(|(d, k)| Op::PushFar(d, k)),
            3 => Just(Op::Pop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The same items in the same order as a binary heap on (time, key), ties included,
        /// with pushes at the time being served and far ahead.
        #[test]
        fn same_order_as_a_binary_heap(base in any::<u64>(), ops in prop::collection::vec(op(), 0..400)) {
            // Times are the bits of non-negative f64s: below the sign bit.
            const MAX: u64 = u64::MAX >> 1;
            let base = base >> 1;
            let mut q = EventQueue::new();
            let mut h: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
            let mut last = base;
            // Start above 0, as the run starts at its first event.
            q.push(base, 0);
            h.push(Reverse((base, 0)));
            for o in ops {
                match o {
                    Op::Push(d, k) => {
                        let t = (last + d).min(MAX);
                        q.push(t, k);
                        h.push(Reverse((t, k)));
                    }
                    Op::PushFar(d, k) => {
                        let t = last.saturating_add(d >> (d % 64)).min(MAX);
                        q.push(t, k);
                        h.push(Reverse((t, k)));
                    }
                    Op::Pop => {
                        let want = h.pop().map(|r| r.0);
                        prop_assert_eq!(q.peek_time(), want.map(|x| x.0));
                        let got = q.pop();
                        prop_assert_eq!(got, want);
                        if let Some((t, _)) = got {
                            last = t;
                        }
                    }
                }
                prop_assert_eq!(q.len(), h.len());
                prop_assert_eq!(q.peek_time(), h.peek().map(|r| r.0.0));
            }
            while let Some(Reverse(want)) = h.pop() {
                prop_assert_eq!(q.pop(), Some(want));
            }
            prop_assert_eq!(q.pop(), None);
        }
    }
}
