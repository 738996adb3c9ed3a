//! The flow-level network: link classes with a capacity, flows that cross them with a
//! weight, and max-min fair rates by progressive filling (water-filling).
//!
//! A *class* is one directed link, or (in a symmetric run) one orbit of links that carry the
//! same load; a flow crosses a class with a *weight*: 1 for each hop over a plain link, and
//! `m·h/|O|` for a representative flow standing for an orbit of `m` flows that makes `h` hops
//! in a link orbit of `|O|` links (see [`crate::run`]). A flow at rate `x` loads a class by
//! `weight·x`; a class's load never exceeds its capacity.
//!
//! Rates are recomputed only where something changed: after flows start or end, the
//! connected component of classes and flows around them (classes sharing a flow, flows
//! sharing a class) is water-filled again; the rest keep their rates. Every loop runs over
//! vectors in index order, so results are deterministic.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Identifies a flow of a [`Net`].
pub type FlowId = u32;

const NOT_QUEUED: u32 = u32::MAX;

/// A flow's state.
#[derive(Clone, Debug)]
struct Flow {
    /// Classes crossed and the weight on each.
    path: Vec<(u32, f64)>,
    /// Bytes not yet transmitted at `last`.
    remaining: f64,
    /// Current rate, bytes per second.
    rate: f64,
    /// When `remaining` was last brought up to date.
    last: f64,
    active: bool,
    /// Scratch: visited by the current component search / frozen by the current fill.
    mark: u32,
    frozen: bool,
}

/// A class's state.
#[derive(Clone, Debug)]
struct Class {
    cap: f64,
    /// Active flows crossing it (any order).
    flows: Vec<FlowId>,
    mark: u32,
    /// Scratch of the fill: capacity left and weight of unfrozen flows.
    left: f64,
    wsum: f64,
    /// Scratch of the fill: unfrozen flows crossing it.
    nfree: u32,
    /// Since when it carries a flow (when it does).
    busy_since: f64,
    /// Seconds it carried at least one flow.
    busy: f64,
    /// Bytes·weight that crossed it.
    bytes: f64,
    /// Busy intervals, when recorded.
    intervals: Vec<(f64, f64)>,
}

/// A min-heap key: (share, class).
#[derive(Debug, PartialEq)]
struct Share(f64, u32);

impl Eq for Share {}
impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Share {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap.
        other
            .0
            .total_cmp(&self.0)
            .then_with(|| other.1.cmp(&self.1))
    }
}

/// The active flows with a finite drain time, a binary min-heap on (due, id) that knows
/// where each flow is: the keys sit in the heap itself (no indirection to the flows when
/// comparing), and the places in a vector of their own.
#[derive(Debug, Default)]
struct DrainHeap {
    heap: Vec<(f64, FlowId)>,
    /// Each flow's place in `heap` (`NOT_QUEUED` when not in it).
    pos: Vec<u32>,
}

impl DrainHeap {
    /// The first to drain (ties: the lowest id).
    fn first(&self) -> Option<(f64, FlowId)> {
        self.heap.first().copied()
    }

    fn before(a: (f64, FlowId), b: (f64, FlowId)) -> bool {
        a.0 < b.0 || (a.0 == b.0 && a.1 < b.1)
    }

    fn place(&mut self, i: usize) {
        let f = self.heap[i].1;
        self.pos[f as usize] = i as u32;
    }

    /// Moves the entry at `i` up to its place; returns where it lands.
    fn sift_up(&mut self, mut i: usize) -> usize {
        let x = self.heap[i];
        while i > 0 {
            let parent = (i - 1) / 2;
            if !Self::before(x, self.heap[parent]) {
                break;
            }
            self.heap[i] = self.heap[parent];
            self.place(i);
            i = parent;
        }
        self.heap[i] = x;
        self.place(i);
        i
    }

    fn sift_down(&mut self, mut i: usize) {
        let n = self.heap.len();
        let x = self.heap[i];
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = l;
            if l >= n {
                break;
            }
            if r < n && Self::before(self.heap[r], self.heap[l]) {
                m = r;
            }
            if !Self::before(self.heap[m], x) {
                break;
            }
            self.heap[i] = self.heap[m];
            self.place(i);
            i = m;
        }
        self.heap[i] = x;
        self.place(i);
    }

    /// Queues flow `f` to drain at `due`, or moves it there.
    fn set(&mut self, f: FlowId, due: f64) {
        if self.pos.len() <= f as usize {
            self.pos.resize(f as usize + 1, NOT_QUEUED);
        }
        let i = match self.pos[f as usize] {
            NOT_QUEUED => {
                self.heap.push((due, f));
                self.heap.len() - 1
            }
            p => {
                self.heap[p as usize].0 = due;
                p as usize
            }
        };
        let i = self.sift_up(i);
        self.sift_down(i);
    }

    /// Takes flow `f` out, if it is in.
    fn remove(&mut self, f: FlowId) {
        let Some(&p) = self.pos.get(f as usize) else {
            return;
        };
        if p == NOT_QUEUED {
            return;
        }
        let i = p as usize;
        self.pos[f as usize] = NOT_QUEUED;
        let last = self.heap.pop().expect("queued"); // `f` is queued: the heap holds it
        if i < self.heap.len() {
            self.heap[i] = last;
            let i = self.sift_up(i);
            self.sift_down(i);
        }
    }
}

/// Links (classes) and the flows crossing them. See the module docs.
#[derive(Debug)]
pub struct Net {
    classes: Vec<Class>,
    flows: Vec<Flow>,
    free: Vec<FlowId>,
    /// Classes touched since the last [`Net::settle`].
    dirty: Vec<u32>,
    /// Active flows with a finite drain time, by (due, id).
    drains: DrainHeap,
    epoch: u32,
    record: bool,
    /// Scratch of settle.
    comp_flows: Vec<FlowId>,
    comp_classes: Vec<u32>,
    fill_heap: BinaryHeap<Share>,
    new_rate: Vec<(FlowId, f64)>,
}

impl Net {
    /// A network of classes with these capacities (bytes per second; may be infinite);
    /// `record`: keep each class's busy intervals.
    pub fn new(caps: &[f64], record: bool) -> Net {
        Net {
            classes: caps
                .iter()
                .map(|&cap| Class {
                    cap,
                    flows: Vec::new(),
                    mark: 0,
                    left: 0.0,
                    wsum: 0.0,
                    nfree: 0,
                    busy_since: 0.0,
                    busy: 0.0,
                    bytes: 0.0,
                    intervals: Vec::new(),
                })
                .collect(),
            flows: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            drains: DrainHeap::default(),
            epoch: 0,
            record,
            comp_flows: Vec::new(),
            comp_classes: Vec::new(),
            fill_heap: BinaryHeap::new(),
            new_rate: Vec::new(),
        }
    }

    /// Starts a flow of `bytes` (> 0) over `path` (classes and weights, non-empty) at `now`.
    /// Its rate is set by the next [`Net::settle`].
    ///
    /// # Errors
    /// An empty path, a class that is not one of this net's, a weight that is not finite
    /// and above 0, or bytes that are not finite and above 0 (the error names which); the
    /// net is unchanged.
    pub fn add(&mut self, now: f64, path: &[(u32, f64)], bytes: f64) -> Result<FlowId, String> {
        if path.is_empty() {
            return Err("a flow over an empty path".into());
        }
        if !(bytes.is_finite() && bytes > 0.0) {
            return Err(format!(
                "a flow of {bytes} bytes: must be finite and above 0"
            ));
        }
        let n = self.classes.len();
        for &(c, w) in path {
            if c as usize >= n {
                return Err(format!("a flow over class {c}: the net has {n} classes"));
            }
            if !(w.is_finite() && w > 0.0) {
                return Err(format!(
                    "a flow with weight {w} on class {c}: must be finite and above 0"
                ));
            }
        }
        let id = match self.free.pop() {
            Some(id) => {
                // Reuse the slot and its path's allocation.
                let f = &mut self.flows[id as usize];
                f.path.clear();
                f.path.extend_from_slice(path);
                f.remaining = bytes;
                f.rate = 0.0;
                f.last = now;
                f.active = true;
                f.mark = 0;
                f.frozen = false;
                id
            }
            None => {
                self.flows.push(Flow {
                    path: path.to_vec(),
                    remaining: bytes,
                    rate: 0.0,
                    last: now,
                    active: true,
                    mark: 0,
                    frozen: false,
                });
                (self.flows.len() - 1) as FlowId
            }
        };
        for &(c, w) in path {
            let class = &mut self.classes[c as usize];
            if class.flows.is_empty() {
                class.busy_since = now;
            }
            class.flows.push(id);
            class.bytes += bytes * w;
            self.dirty.push(c);
        }
        Ok(id)
    }

    /// The flow that drains first and when (ties: the lowest id), if any flow is active
    /// with a positive rate.
    pub fn next_drain(&self) -> Option<(f64, FlowId)> {
        self.drains.first()
    }

    /// Sets flow `f`'s drain time (infinite: not queued).
    fn set_due(&mut self, f: FlowId, due: f64) {
        if due.is_finite() {
            self.drains.set(f, due);
        } else {
            self.drains.remove(f);
        }
    }

    /// Ends flow `id` (drained) at `now`; nothing for an id that is not an active flow of
    /// this net (never added, or ended already).
    pub fn remove(&mut self, now: f64, id: FlowId) {
        let Some(f) = self.flows.get_mut(id as usize).filter(|f| f.active) else {
            return;
        };
        self.drains.remove(id);
        f.active = false;
        let path = std::mem::take(&mut f.path);
        for &(c, _) in &path {
            let class = &mut self.classes[c as usize];
            // An active flow is on every class of its path (`add` put it there).
            let pos = class.flows.iter().position(|&x| x == id).expect("on it");
            class.flows.swap_remove(pos);
            if class.flows.is_empty() {
                class.busy += now - class.busy_since;
                if self.record {
                    class.intervals.push((class.busy_since, now));
                }
            }
            self.dirty.push(c);
        }
        self.flows[id as usize].path = path;
        self.free.push(id);
    }

    /// Recomputes the rates of the flows around what changed since the last call, and their
    /// drain times ([`Net::next_drain`]).
    pub fn settle(&mut self, now: f64) {
        if self.dirty.is_empty() {
            return;
        }
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        // The component: breadth first from the dirty classes.
        let mut cflows = std::mem::take(&mut self.comp_flows);
        let mut cclasses = std::mem::take(&mut self.comp_classes);
        cflows.clear();
        cclasses.clear();
        let dirty = std::mem::take(&mut self.dirty);
        for &c in &dirty {
            if self.classes[c as usize].mark != epoch {
                self.classes[c as usize].mark = epoch;
                cclasses.push(c);
            }
        }
        let mut i = 0;
        while i < cclasses.len() {
            let c = cclasses[i] as usize;
            i += 1;
            for k in 0..self.classes[c].flows.len() {
                let f = self.classes[c].flows[k];
                let flow = &mut self.flows[f as usize];
                if flow.mark == epoch {
                    continue;
                }
                flow.mark = epoch;
                cflows.push(f);
                for &(c2, _) in &flow.path {
                    let class = &mut self.classes[c2 as usize];
                    if class.mark != epoch {
                        class.mark = epoch;
                        cclasses.push(c2);
                    }
                }
            }
        }
        self.dirty = dirty;
        self.dirty.clear();
        if cflows.len() == 1 {
            // One flow alone on its links: the tightest of them.
            let f = cflows[0];
            let rate = self.flows[f as usize]
                .path
                .iter()
                .map(|&(c, w)| self.classes[c as usize].cap / w)
                .fold(f64::INFINITY, f64::min);
            self.set_rate(now, f, rate);
            self.comp_flows = cflows;
            self.comp_classes = cclasses;
            return;
        }
        // Water-filling (the search's order is deterministic; the result does not depend on
        // it but for rounding).
        let mut heap = std::mem::take(&mut self.fill_heap);
        heap.clear();
        for &c in &cclasses {
            let class = &mut self.classes[c as usize];
            class.left = class.cap;
            class.wsum = 0.0;
            class.nfree = 0;
        }
        for &f in &cflows {
            let flow = &mut self.flows[f as usize];
            flow.frozen = false;
            for &(c, w) in &flow.path {
                let class = &mut self.classes[c as usize];
                class.wsum += w;
                class.nfree += 1;
            }
        }
        for &c in &cclasses {
            let class = &self.classes[c as usize];
            if class.nfree > 0 {
                heap.push(Share(class.left / class.wsum, c));
            }
        }
        let mut new_rate = std::mem::take(&mut self.new_rate);
        new_rate.clear();
        // Lazy keys: freezing flows at the smallest share only raises the other classes'
        // shares, so a key is a lower bound of its class's share; a popped class whose share
        // has grown goes back with its new share, else its share is the smallest of all.
        while let Some(Share(key, c)) = heap.pop() {
            let class = &self.classes[c as usize];
            if class.nfree == 0 {
                continue;
            }
            let share = if class.wsum > 0.0 {
                (class.left / class.wsum).max(0.0)
            } else {
                f64::INFINITY
            };
            if share > key {
                heap.push(Share(share, c));
                continue;
            }
            // Freeze every unfrozen flow on c at `share`.
            for k in 0..self.classes[c as usize].flows.len() {
                let f = self.classes[c as usize].flows[k];
                if self.flows[f as usize].frozen {
                    continue;
                }
                self.flows[f as usize].frozen = true;
                new_rate.push((f, share));
                for j in 0..self.flows[f as usize].path.len() {
                    let (c2, w) = self.flows[f as usize].path[j];
                    let class = &mut self.classes[c2 as usize];
                    if share.is_finite() {
                        class.left = (class.left - w * share).max(0.0);
                    }
                    class.wsum -= w;
                    class.nfree -= 1;
                }
            }
        }
        // Flows on no constrained class (cannot happen with non-empty paths) stay as they are.
        for &(f, rate) in &new_rate {
            self.set_rate(now, f, rate);
        }
        self.new_rate = new_rate;
        self.fill_heap = heap;
        self.comp_flows = cflows;
        self.comp_classes = cclasses;
    }

    /// Gives flow `f` `rate` from `now` (its bytes so far at the old rate), and its drain time.
    fn set_rate(&mut self, now: f64, f: FlowId, rate: f64) {
        let flow = &mut self.flows[f as usize];
        if flow.rate == rate && flow.rate > 0.0 {
            return;
        }
        if flow.rate > 0.0 && flow.rate.is_finite() {
            flow.remaining = (flow.remaining - flow.rate * (now - flow.last)).max(0.0);
        } else if flow.rate.is_infinite() {
            flow.remaining = 0.0;
        }
        flow.last = now;
        flow.rate = rate;
        let t = if rate.is_infinite() || flow.remaining <= 0.0 {
            now
        } else if rate > 0.0 {
            now + flow.remaining / rate
        } else {
            f64::INFINITY
        };
        self.set_due(f, t);
    }

    /// The current rate of a flow (0 for an id that is no flow of this net).
    pub fn rate(&self, id: FlowId) -> f64 {
        self.flows.get(id as usize).map_or(0.0, |f| f.rate)
    }

    /// Per class: bytes·weight carried, seconds busy (closing open intervals at `now`).
    pub fn usage(&self, now: f64) -> Vec<(f64, f64)> {
        self.classes
            .iter()
            .map(|c| {
                let open = if c.flows.is_empty() {
                    0.0
                } else {
                    now - c.busy_since
                };
                (c.bytes, c.busy + open)
            })
            .collect()
    }

    /// A class's recorded busy intervals (none for a class that is not one of this net's).
    pub fn intervals(&self, class: u32) -> &[(f64, f64)] {
        self.classes
            .get(class as usize)
            .map_or(&[], |c| c.intervals.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drain times of every active flow, in drain order.
    fn drains(net: &mut Net, now: f64) -> Vec<(f64, FlowId)> {
        net.settle(now);
        let mut v: Vec<(f64, FlowId)> = net.drains.heap.clone();
        v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        assert_eq!(net.next_drain(), v.first().copied());
        v
    }

    proptest::proptest! {
        /// The drain heap's first entry is the least (due, id) of the flows queued, through
        /// random sets (new flows and moves, dues that tie) and removals.
        #[test]
        fn drain_heap_gives_the_least_due_then_id(
            ops in proptest::collection::vec((0u32..24, 0u8..12, proptest::bool::ANY), 0..300)
        ) {
            let mut h = DrainHeap::default();
            let mut want: std::collections::BTreeMap<FlowId, f64> = Default::default();
            for (f, due, remove) in ops {
                if remove {
                    h.remove(f);
                    want.remove(&f);
                } else {
                    let due = due as f64 * 0.5;
                    h.set(f, due);
                    want.insert(f, due);
                }
                let least = want
                    .iter()
                    .map(|(&f, &d)| (d, f))
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                proptest::prop_assert_eq!(h.first(), least);
                proptest::prop_assert_eq!(h.heap.len(), want.len());
                for (i, &(_, f)) in h.heap.iter().enumerate() {
                    proptest::prop_assert_eq!(h.pos[f as usize], i as u32);
                }
            }
        }
    }

    #[test]
    fn one_flow_takes_the_link() {
        let mut net = Net::new(&[10.0], false);
        let f = net.add(0.0, &[(0, 1.0)], 100.0).unwrap();
        assert_eq!(drains(&mut net, 0.0), vec![(10.0, f)]);
    }

    #[test]
    fn bottleneck_and_leftover() {
        // Flow a crosses links 0 (cap 10) and 1 (cap 4); flow b crosses link 0 only: a gets 4
        // (limited by link 1), b the 6 left on link 0.
        let mut net = Net::new(&[10.0, 4.0], false);
        let a = net.add(0.0, &[(0, 1.0), (1, 1.0)], 8.0).unwrap();
        let b = net.add(0.0, &[(0, 1.0)], 60.0).unwrap();
        let d = drains(&mut net, 0.0);
        assert_eq!(net.rate(a), 4.0);
        assert_eq!(net.rate(b), 6.0);
        assert_eq!(d, vec![(2.0, a), (10.0, b)]);
        net.remove(2.0, a);
        // b has 48 left at 2 s, now at 10/s.
        assert_eq!(drains(&mut net, 2.0), vec![(6.8, b)]);
    }

    /// Bad flows are errors naming the class, weight or bytes, and leave the net as it
    /// was; unknown ids and classes are answered, not indexed (they panicked before).
    #[test]
    fn bad_flows_and_unknown_ids_do_not_panic() {
        let mut net = Net::new(&[10.0, 4.0], false);
        for (path, bytes, want) in [
            (&[(2u32, 1.0)][..], 1.0, "class 2: the net has 2 classes"),
            (&[(0, 1.0), (7, 1.0)][..], 1.0, "class 7"),
            (&[(0, f64::NAN)][..], 1.0, "weight NaN on class 0"),
            (&[(1, 0.0)][..], 1.0, "weight 0 on class 1"),
            (&[(0, 1.0)][..], -5.0, "-5 bytes"),
            (&[(0, 1.0)][..], f64::INFINITY, "inf bytes"),
            (&[][..], 1.0, "empty path"),
        ] {
            crate::testing::has(&net.add(0.0, path, bytes).unwrap_err(), &[want]);
        }
        assert_eq!(net.next_drain(), None);
        assert!(net.usage(1.0).iter().all(|&(b, t)| b == 0.0 && t == 0.0));
        net.remove(1.0, 3);
        assert_eq!(net.rate(3), 0.0);
        assert!(net.intervals(9).is_empty());
        // A flow ended twice: the second time is nothing.
        let f = net.add(0.0, &[(0, 1.0)], 100.0).unwrap();
        assert_eq!(drains(&mut net, 0.0), vec![(10.0, f)]);
        net.remove(10.0, f);
        net.remove(10.0, f);
        assert_eq!(net.next_drain(), None);
    }

    #[test]
    fn weights_scale_the_load() {
        // A representative flow standing for 4 flows over a 2-link orbit: weight 2.
        let mut net = Net::new(&[10.0], false);
        let f = net.add(0.0, &[(0, 2.0)], 10.0).unwrap();
        drains(&mut net, 0.0);
        assert_eq!(net.rate(f), 5.0);
    }
}
