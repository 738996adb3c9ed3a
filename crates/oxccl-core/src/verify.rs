//! The reference executor: runs every rank's [`Schedule`] in memory, in a random order that
//! respects each schedule's dependencies, matching rules and flow control, over symbolic
//! elements, and checks the outcome against the collective's definition.
//!
//! Each input element is the symbol `(index, {rank})`; a reduction of two symbols must name the
//! same index and disjoint rank sets, so an element reduced twice, reduced with the wrong
//! element, or never reduced is caught, whatever the data type. Every participant runs the
//! executor's own protocol state machine ([`crate::protocol::Machine`]): fragments of `chunk`
//! elements through `slots` slots per (sender, receiver, channel), credits returned as the
//! executor returns them; this module is only its transport, which delivers fragments, credits
//! and completions in a random order. A fragment written into a slot whose previous fragment
//! is not consumed, or consumed where the receiver expects another, is reported; so is any
//! write to memory a send fragment has not finished reading (half of the seeds copy small
//! fragments as they are posted, as the executor's inline fragments, half wait for every
//! completion). A barrier must not let a rank finish before every rank has started.
//!
//! ```
//! use oxccl_core::schedule::{Algorithm, Collective, Request};
//! let reqs: Vec<Request> = (0..5)
//!     .map(|rank| Request {
//!         coll: Collective::AllReduce { count: 37 },
//!         world: 5,
//!         rank,
//!         in_place: false,
//!         hosts: Vec::new(),
//!         algo: Algorithm::Ring,
//!         chunk: 4,
//!         channels: 2,
//!         weights: Vec::new(),
//!     })
//!     .collect();
//! oxccl_core::verify::verify(&reqs, 2, 42).unwrap();
//! ```

use std::collections::{HashMap, VecDeque};

use crate::protocol::{Action, Config, Flows, Machine, Queues, Reuse, Waiting};

mod compiled;
use crate::schedule::{
    Algorithm, Buf, Collective, Op, Region, Request, Schedule, build, build_aggregator,
};
pub use compiled::verify_compiled;

/// A symbolic element: which input element it derives from, and whose contributions it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sym {
    idx: u32,
    mask: u64,
}

const POISON: Sym = Sym {
    idx: u32::MAX,
    mask: 0,
};

/// A fragment in a receiver's slot.
struct Fragment {
    data: Vec<Sym>,
    /// The transfer's length and this fragment's offset in it (elements).
    total: usize,
    off: usize,
    know: u64,
}

/// One participant's memory.
#[derive(Clone)]
struct RankState {
    /// The participant.
    rank: usize,
    /// One buffer when in place, else input and output separately.
    input: Vec<Sym>,
    output: Vec<Sym>,
    in_place: Option<(usize, usize)>,
    scratch: Vec<Sym>,
    /// Regions signaled send fragments are still reading, until their completion: (step,
    /// region).
    reading: Vec<(usize, Region)>,
    /// Ranks whose start this rank has (transitively) heard of.
    know: u64,
}

impl RankState {
    /// Participant `r`'s memory for `sched`.
    fn new(
        r: usize,
        sched: &Schedule,
        input: Vec<Sym>,
        output: Vec<Sym>,
        in_place: Option<(usize, usize)>,
    ) -> RankState {
        RankState {
            rank: r,
            scratch: vec![POISON; sched.scratch],
            input,
            output,
            in_place,
            reading: Vec::new(),
            know: 1u64.checked_shl(r as u32).unwrap_or(0),
        }
    }

    /// Physical location of a region: (buffer id, offset); buffer 0 = input, 1 = output,
    /// 2 = scratch; in place, input and output are buffer 1 at their offsets.
    fn locate(&self, reg: Region) -> (u8, usize) {
        match (reg.buf, self.in_place) {
            (Buf::Scratch, _) => (2, reg.offset),
            (Buf::Input, Some((i, _))) => (1, i + reg.offset),
            (Buf::Output, Some((_, o))) => (1, o + reg.offset),
            (Buf::Input, None) => (0, reg.offset),
            (Buf::Output, None) => (1, reg.offset),
        }
    }

    fn buffer(&self, id: u8) -> &Vec<Sym> {
        match id {
            0 => &self.input,
            1 => &self.output,
            _ => &self.scratch,
        }
    }

    fn read(&self, reg: Region) -> Result<Vec<Sym>, String> {
        let (id, off) = self.locate(reg);
        self.buffer(id)
            .get(off..off + reg.len)
            .map(<[Sym]>::to_vec)
            .ok_or_else(|| format!("read of {reg:?} is out of bounds"))
    }

    fn write(&mut self, reg: Region, data: &[Sym]) -> Result<(), String> {
        if reg.buf == Buf::Input && self.in_place.is_none() {
            return Err(format!("writes to the input buffer: {reg:?}"));
        }
        let (id, off) = self.locate(reg);
        for &(step, r) in &self.reading {
            let (rid, roff) = self.locate(r);
            if rid == id && off < roff + r.len && roff < off + reg.len && reg.len > 0 {
                return Err(format!(
                    "overwrites {reg:?} while step {step} is still sending it"
                ));
            }
        }
        let buf = match id {
            0 => &mut self.input,
            1 => &mut self.output,
            _ => &mut self.scratch,
        };
        buf.get_mut(off..off + reg.len)
            .ok_or_else(|| format!("write of {reg:?} is out of bounds"))?
            .copy_from_slice(data);
        Ok(())
    }
}

fn combine(a: Sym, b: Sym) -> Result<Sym, String> {
    if a == POISON || b == POISON {
        return Err(format!("reduces an unwritten element ({a:?} ⊕ {b:?})"));
    }
    if a.idx != b.idx {
        return Err(format!("reduces element {} with element {}", a.idx, b.idx));
    }
    if a.mask & b.mask != 0 {
        return Err(format!(
            "reduces the contribution of ranks {:#x} twice into element {}",
            a.mask & b.mask,
            a.idx
        ));
    }
    Ok(Sym {
        idx: a.idx,
        mask: a.mask | b.mask,
    })
}

fn reduce_slices(a: &[Sym], b: &[Sym]) -> Result<Vec<Sym>, String> {
    if a.len() != b.len() {
        return Err(format!("reduces {} elements with {}", a.len(), b.len()));
    }
    a.iter().zip(b).map(|(&x, &y)| combine(x, y)).collect()
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Builds every rank's schedule from `reqs` (one per rank, in rank order) and runs them
/// together with `slots` receive slots per (sender, receiver, channel) and fragments of
/// `reqs[r].chunk` elements, choosing among enabled actions with a PRNG seeded by `seed`.
/// Returns the first violation: a build error, a deadlock, a mismatched transfer, a hazard or
/// a wrong result, naming the rank and step.
pub fn verify(reqs: &[Request], slots: usize, seed: u64) -> Result<(), String> {
    let scheds = reqs
        .iter()
        .enumerate()
        .map(|(r, req)| build(req).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    verify_schedules(reqs, scheds, slots, seed)
}

/// [`verify`] with schedules given rather than built (to check a hand-made or mutated one).
pub fn verify_schedules(
    reqs: &[Request],
    mut scheds: Vec<Schedule>,
    slots: usize,
    seed: u64,
) -> Result<(), String> {
    let n = reqs.len();
    if scheds.len() != n {
        return Err(format!("{} schedules for {n} requests", scheds.len()));
    }
    if n == 0 || n > 64 {
        return Err(format!("verify runs 1..=64 ranks, got {n}"));
    }
    if slots == 0 {
        return Err("slots must be ≥ 1".into());
    }
    let mut ranks = initial_states(reqs, &mut scheds)?;
    // Every participant runs the protocol's own state machine ([`crate::protocol::Machine`])
    // with fragments of `chunk` elements: this loop is only its transport, which delivers
    // fragments, credits and completions in a random order.
    let chunk = reqs[0].chunk.max(1);
    let channels = reqs[0].channels.max(1);
    if let Some(r) = reqs
        .iter()
        .position(|q| q.chunk.max(1) != chunk || q.channels.max(1) != channels)
    {
        return Err(format!(
            "rank {r} has chunk {} and {} channels, rank 0 {chunk} and {channels}: the protocol needs them alike",
            reqs[r].chunk, reqs[r].channels
        ));
    }
    let parts = scheds.len();
    let mut cfg = Config::new(channels, slots, chunk, 1);
    // Half of the seeds copy small fragments when posted (the executor's inline fragments),
    // half wait for every fragment's completion (which exposes more hazards).
    cfg.inline_max = if seed & 2 == 0 { 0 } else { chunk / 2 };
    let links: Vec<Vec<usize>> = (0..parts)
        .map(|r| {
            (0..parts)
                .map(|p| if p == r { usize::MAX } else { p })
                .collect()
        })
        .collect();
    let queues = scheds
        .iter()
        .enumerate()
        .map(|(r, s)| Queues::new(s, &links[r], channels).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut machines: Vec<Machine<'_>> = (0..parts)
        .map(|r| Machine::new(&scheds[r], &queues[r], cfg, 1, false, Reuse::default()))
        .collect();
    let mut net = Wires {
        parts,
        flows: (0..parts).map(|_| Flows::new(parts, channels)).collect(),
        fragments: vec![VecDeque::new(); parts * parts],
        credits: vec![VecDeque::new(); parts * parts],
        landed: HashMap::new(),
    };
    let mut rng = Rng(seed | 1);
    let mut acts = Vec::new();
    let mut choices: Vec<Choice> = Vec::new();
    loop {
        choices.clear();
        for r in 0..parts {
            machines[r].enabled(&net.flows[r], &mut acts);
            choices.extend(acts.iter().map(|&a| Choice::Act(r, a)));
            choices.extend((0..ranks[r].reading.len()).map(|i| Choice::Complete(r, i)));
        }
        for w in 0..parts * parts {
            if !net.fragments[w].is_empty() {
                choices.push(Choice::Arrive(w));
            }
            if !net.credits[w].is_empty() {
                choices.push(Choice::Credit(w));
            }
        }
        if choices.is_empty() {
            break;
        }
        match choices.swap_remove(rng.below(choices.len())) {
            Choice::Arrive(w) => {
                let (q, slot) = net.fragments[w].pop_front().expect("chosen");
                net.flows[w % parts].arrived(q, slot);
            }
            Choice::Credit(w) => {
                let (q, consumed) = net.credits[w].pop_front().expect("chosen");
                net.flows[w / parts].credit(q, consumed);
            }
            Choice::Complete(r, i) => {
                let (s, _) = ranks[r].reading.swap_remove(i);
                machines[r].completed(s, true);
            }
            Choice::Act(r, a) => {
                machines[r].commit(&mut net.flows[r], &a);
                net.act(&scheds[r], &mut ranks[r], a)?;
            }
        }
    }
    for (r, m) in machines.iter().enumerate() {
        if let Some(w) = m.waiting(&net.flows[r]) {
            let s = match w {
                Waiting::Data { step, .. }
                | Waiting::Slot { step, .. }
                | Waiting::Transport { step, .. }
                | Waiting::Earlier { step, .. } => step,
            };
            return Err(format!(
                "deadlock: rank {r} cannot run step {s} ({:?}, deps {:?}): {w:?}",
                scheds[r].steps[s].op, scheds[r].steps[s].deps
            ));
        }
    }
    if let Some(&(r, q, _)) = net.landed.keys().next() {
        let (peer, ch) = net.flows[r].link_channel(q);
        return Err(format!(
            "rank {peer} sent rank {r} (channel {ch}) more than it received"
        ));
    }
    check_results(reqs, &ranks[..n])
}

/// Every participant's symbolic buffers at the start (each input element carries its rank's
/// contribution; outputs are unwritten), and, for an aggregation all-reduce, the aggregator
/// (participant `n`), whose schedule is appended to `scheds`.
fn initial_states(reqs: &[Request], scheds: &mut Vec<Schedule>) -> Result<Vec<RankState>, String> {
    let n = reqs.len();
    let mut ranks = Vec::with_capacity(n + 1);
    for ((r, req), sched) in reqs.iter().enumerate().zip(scheds.iter()) {
        if req.rank != r || req.world != n {
            return Err(format!(
                "request {r} is for rank {} of {} ranks",
                req.rank, req.world
            ));
        }
        let in_len = req.coll.input_len(n, r);
        let out_len = req.coll.output_len(n, r);
        let in_place = if req.in_place {
            Some(
                req.coll
                    .in_place_offsets(n, r)
                    .ok_or_else(|| format!("{} has no in-place form", req.coll.name()))?,
            )
        } else {
            None
        };
        let input: Vec<Sym> = (0..in_len)
            .map(|i| Sym {
                idx: i as u32,
                mask: 1 << r,
            })
            .collect();
        let (input, output) = match in_place {
            Some((io, oo)) => {
                let mut buf = vec![POISON; (io + in_len).max(oo + out_len)];
                buf[io..io + in_len].copy_from_slice(&input);
                (Vec::new(), buf)
            }
            None => (input, vec![POISON; out_len]),
        };
        ranks.push(RankState::new(r, sched, input, output, in_place));
    }
    // An aggregation all-reduce has one more participant: the aggregator, peer `n`.
    if reqs[0].algo == Algorithm::Aggregation {
        // A pool of two slots: slot reuse is checked too.
        let sched = build_aggregator(&reqs[0], 2).map_err(|e| format!("aggregator: {e}"))?;
        let mut aggregator = RankState::new(n, &sched, Vec::new(), Vec::new(), None);
        // It holds no contribution of its own.
        aggregator.know = 0;
        ranks.push(aggregator);
        scheds.push(sched);
    }
    Ok(ranks)
}

/// The verifier's transport: every participant's flow control, and what is in flight per
/// (sender, receiver): fragments (queue at the receiver, slot) and credits (queue at the
/// sender, count); what each receiver's slots hold.
struct Wires {
    parts: usize,
    flows: Vec<Flows>,
    fragments: Vec<VecDeque<(usize, u32)>>,
    credits: Vec<VecDeque<(usize, u64)>>,
    /// (receiver, queue, slot) → fragment.
    landed: HashMap<(usize, usize, u32), Fragment>,
}

impl Wires {
    /// Carries out action `a` of participant `st.rank` (whose schedule is `sched`) on its
    /// symbolic buffers and the wires; the first violation, naming the rank and step.
    fn act(&mut self, sched: &Schedule, st: &mut RankState, a: Action) -> Result<(), String> {
        let (r, parts) = (st.rank, self.parts);
        let fail = |s: usize, e: String| format!("rank {r} step {s}: {e}");
        match a {
            Action::Post {
                step,
                q,
                slot,
                off,
                len,
                total,
                signaled,
            } => {
                let Op::Send { peer, src, .. } = sched.steps[step].op else {
                    unreachable!("a post is a send's")
                };
                let part = src.sub(off, len);
                let data = st.read(part).map_err(|e| fail(step, e))?;
                if data.contains(&POISON) {
                    return Err(fail(step, format!("sends unwritten data from {src:?}")));
                }
                if signaled {
                    st.reading.push((step, part));
                }
                let (_, ch) = self.flows[r].link_channel(q);
                let rq = self.flows[peer].queue(r, ch);
                let frag = Fragment {
                    data,
                    total,
                    off,
                    know: st.know,
                };
                if self.landed.insert((peer, rq, slot), frag).is_some() {
                    return Err(fail(
                        step,
                        format!(
                            "overwrites slot {slot} of rank {peer} (channel {ch}) before rank {peer} consumed it"
                        ),
                    ));
                }
                self.fragments[r * parts + peer].push_back((rq, slot));
            }
            Action::Recv {
                step,
                q,
                slot,
                off,
                len,
                total,
                ..
            } => {
                let Op::Recv {
                    peer,
                    channel,
                    dst,
                    reduce_with,
                } = sched.steps[step].op
                else {
                    unreachable!("a consume is a receive's")
                };
                let frag = self
                    .landed
                    .remove(&(r, q, slot))
                    .expect("an arrived slot holds data");
                if frag.total != total || frag.off != off || frag.data.len() != len {
                    return Err(fail(
                        step,
                        format!(
                            "receives {} elements from rank {peer} (channel {channel}) at {off}, which sends {} at {}",
                            dst.len, frag.total, frag.off
                        ),
                    ));
                }
                let value = match reduce_with {
                    Some(w) => {
                        let local = st.read(w.sub(off, len)).map_err(|e| fail(step, e))?;
                        reduce_slices(&local, &frag.data).map_err(|e| fail(step, e))?
                    }
                    None => frag.data,
                };
                st.write(dst.sub(off, len), &value)
                    .map_err(|e| fail(step, e))?;
                st.know |= frag.know;
            }
            Action::Credit { q, consumed } => {
                self.flows[r].credit_sent(q, consumed);
                let (peer, ch) = self.flows[r].link_channel(q);
                let at = self.flows[peer].queue(r, ch);
                self.credits[peer * parts + r].push_back((at, consumed));
            }
            Action::Local { step } => run_local(sched, st, step).map_err(|e| fail(step, e))?,
            Action::MailboxSend { .. } => unreachable!("the verifier runs the slot protocol"),
        }
        Ok(())
    }
}

/// Runs local step `step` of `sched` (a copy or a reduction) on `st`'s symbolic buffers.
fn run_local(sched: &Schedule, st: &mut RankState, step: usize) -> Result<(), String> {
    match sched.steps[step].op {
        Op::Copy { src, dst } => {
            if src.len != dst.len {
                return Err(format!("copies {src:?} into {dst:?}"));
            }
            if st.locate(src) != st.locate(dst) {
                let data = st.read(src)?;
                st.write(dst, &data)?;
            }
        }
        Op::Reduce { dst, a, b } => {
            let a = st.read(a)?;
            let b = st.read(b)?;
            let v = reduce_slices(&a, &b)?;
            st.write(dst, &v)?;
        }
        _ => unreachable!("a local step is a copy or a reduction"),
    }
    Ok(())
}

/// What the verifier's transport may do next.
enum Choice {
    /// A participant performs an action its machine offers.
    Act(usize, Action),
    /// The oldest fragment on wire `w` (sender · parts + receiver) arrives.
    Arrive(usize),
    /// The oldest credit on wire `w` (sender of the data · parts + its receiver) arrives.
    Credit(usize),
    /// Signaled fragment `i` of participant `r` completes.
    Complete(usize, usize),
}

fn check_results(reqs: &[Request], ranks: &[RankState]) -> Result<(), String> {
    let n = reqs.len();
    let full = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    let one = |idx: usize, rank: usize| Sym {
        idx: idx as u32,
        mask: 1 << rank,
    };
    let all = |idx: usize| Sym {
        idx: idx as u32,
        mask: full,
    };
    for (r, st) in ranks.iter().enumerate() {
        let coll = &reqs[r].coll;
        let out_len = coll.output_len(n, r);
        let expect: Vec<Sym> = match coll {
            Collective::Reduce { root, .. } | Collective::Gather { root, .. } if *root != r => {
                Vec::new()
            }
            Collective::AllReduce { count } | Collective::Reduce { count, .. } => {
                (0..*count).map(all).collect()
            }
            Collective::ReduceScatter { count } => {
                (0..*count).map(|i| all(r * count + i)).collect()
            }
            Collective::AllGather { count } | Collective::Gather { count, .. } => (0..n)
                .flat_map(|j| (0..*count).map(move |i| one(i, j)))
                .collect(),
            Collective::Broadcast { count, root } => (0..*count).map(|i| one(i, *root)).collect(),
            Collective::AllToAll { count } => (0..n)
                .flat_map(|j| (0..*count).map(move |i| one(r * count + i, j)))
                .collect(),
            Collective::AllToAllV { .. } => {
                let mut v = Vec::new();
                for (j, req) in reqs.iter().enumerate() {
                    let Collective::AllToAllV { send_counts, .. } = &req.coll else {
                        return Err(format!(
                            "rank {j} runs {}, not all_to_allv",
                            req.coll.name()
                        ));
                    };
                    let off: usize = send_counts[..r].iter().sum();
                    v.extend((0..send_counts[r]).map(|i| one(off + i, j)));
                }
                v
            }
            Collective::Scatter { count, root } => {
                (0..*count).map(|i| one(r * count + i, *root)).collect()
            }
            Collective::Barrier => {
                if st.know != full {
                    return Err(format!(
                        "barrier: rank {r} finished without hearing from ranks {:#x}",
                        full & !st.know
                    ));
                }
                Vec::new()
            }
            Collective::Send { .. } => Vec::new(),
            Collective::Recv { count, peer } => (0..*count).map(|i| one(i, *peer)).collect(),
        };
        if expect.len() != out_len {
            return Err(format!(
                "rank {r}: expected {} output elements, the output holds {out_len}",
                expect.len()
            ));
        }
        let got = st.read(Region::new(Buf::Output, 0, out_len))?;
        if let Some(i) = (0..out_len).find(|&i| got[i] != expect[i]) {
            return Err(format!(
                "rank {r}: {} output element {i} is {:?}, expected {:?}",
                coll.name(),
                got[i],
                expect[i]
            ));
        }
        // The input is read-only (out of place): still the original values.
        if st.in_place.is_none()
            && let Some(i) = (0..st.input.len()).find(|&i| st.input[i] != one(i, r))
        {
            return Err(format!("rank {r}: input element {i} was modified"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Algorithm;

    fn colls(n: usize, count: usize, root: usize) -> Vec<(Collective, Vec<Algorithm>)> {
        use Algorithm::*;
        vec![
            (
                Collective::AllReduce { count },
                vec![
                    Ring,
                    RecursiveDoubling,
                    Proportional,
                    Hierarchical,
                    Aggregation,
                ],
            ),
            (
                Collective::ReduceScatter { count },
                vec![Ring, Hierarchical],
            ),
            (Collective::AllGather { count }, vec![Ring, Hierarchical]),
            (
                Collective::Broadcast { count, root },
                vec![Tree, Chain, Hierarchical],
            ),
            (Collective::Reduce { count, root }, vec![Tree, Chain]),
            (Collective::AllToAll { count }, vec![Direct]),
            (Collective::Gather { count, root }, vec![Direct]),
            (Collective::Scatter { count, root }, vec![Direct]),
            (Collective::Barrier, vec![Dissemination]),
        ]
        .into_iter()
        .filter(|_| n > 0)
        .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        coll: &Collective,
        n: usize,
        algo: Algorithm,
        in_place: bool,
        chunk: usize,
        channels: usize,
        slots: usize,
        seed: u64,
    ) -> Result<(), String> {
        let reqs: Vec<Request> = (0..n)
            .map(|rank| Request {
                coll: coll.clone(),
                world: n,
                rank,
                in_place,
                // Hosts interleaved (rank x on host x mod h), h the smallest proper divisor.
                hosts: if algo == Algorithm::Hierarchical {
                    let h = (2..n).find(|&d| n.is_multiple_of(d)).unwrap_or(1);
                    (0..n).map(|x| (x % h) as u32).collect()
                } else {
                    Vec::new()
                },
                algo,
                chunk,
                channels,
                // Uneven shares, some of them zero (never all).
                weights: if algo == Algorithm::Proportional {
                    (0..n).map(|i| ((i * 7 + 3) % 5) as u32).collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        verify(&reqs, slots, seed).map_err(|e| {
            format!("{} n={n} algo={} in_place={in_place} chunk={chunk} channels={channels} slots={slots} seed={seed}: {e}", coll.name(), algo.name())
        })
    }

    /// Every collective and algorithm for world sizes `worlds`, counts around the world size,
    /// in and out of place, one slot and several.
    fn every_collective(worlds: std::ops::RangeInclusive<usize>) -> usize {
        let mut cases = 0;
        for n in worlds {
            for count in [0, 1, n.saturating_sub(1), n, 2 * n + 3, 61] {
                let root = (count * 7 + 3) % n;
                for (coll, algos) in colls(n, count, root) {
                    for algo in algos {
                        let in_place_forms = if coll.in_place_offsets(n, 0).is_some() {
                            vec![false, true]
                        } else {
                            vec![false]
                        };
                        for in_place in in_place_forms {
                            for (chunk, channels, slots) in [(1, 1, 1), (3, 2, 2), (64, 3, 4)] {
                                if chunk == 1 && count > 2 * n + 3 {
                                    continue;
                                }
                                let seed = (n * 1000 + count * 10 + chunk) as u64;
                                run(&coll, n, algo, in_place, chunk, channels, slots, seed)
                                    .unwrap();
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        cases
    }

    #[test]
    fn every_collective_world_sizes_1_to_8() {
        assert!(every_collective(1..=8) > 2000);
    }

    #[test]
    fn every_collective_world_sizes_9_to_16() {
        assert!(every_collective(9..=16) > 2000);
    }

    #[test]
    fn all_to_allv_and_point_to_point() {
        for n in 1..=9 {
            for seed in 0..4u64 {
                // counts[i][j]: what rank i sends rank j.
                let counts: Vec<Vec<usize>> = (0..n)
                    .map(|i| {
                        (0..n)
                            .map(|j| ((i * 7 + j * 3 + seed as usize) % 5) * (i + 1) % 7)
                            .collect()
                    })
                    .collect();
                let reqs: Vec<Request> = (0..n)
                    .map(|rank| Request {
                        coll: Collective::AllToAllV {
                            send_counts: counts[rank].clone(),
                            recv_counts: (0..n).map(|j| counts[j][rank]).collect(),
                        },
                        world: n,
                        rank,
                        in_place: false,
                        hosts: Vec::new(),
                        algo: Algorithm::Direct,
                        chunk: 2,
                        channels: 1,
                        weights: Vec::new(),
                    })
                    .collect();
                verify(&reqs, 1, seed).unwrap();
            }
        }
        let p2p = |rank: usize| Request {
            coll: if rank == 0 {
                Collective::Send { count: 9, peer: 1 }
            } else {
                Collective::Recv { count: 9, peer: 0 }
            },
            world: 2,
            rank,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Direct,
            chunk: 4,
            channels: 1,
            weights: Vec::new(),
        };
        verify(&[p2p(0), p2p(1)], 1, 1).unwrap();
    }

    /// The verifier catches what it claims to: a mismatched count, a missing dependency, a
    /// schedule that deadlocks.
    #[test]
    fn verifier_catches_planted_bugs() {
        let req = |rank: usize, count: usize| Request {
            coll: Collective::AllReduce { count },
            world: 3,
            rank,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Ring,
            chunk: 2,
            channels: 1,
            weights: Vec::new(),
        };
        // One rank with another count.
        verify(&[req(0, 9), req(1, 9), req(2, 10)], 2, 1).unwrap_err();

        let reqs: Vec<Request> = (0..3)
            .map(|r| Request {
                in_place: true,
                ..req(r, 12)
            })
            .collect();
        let good: Vec<Schedule> = reqs.iter().map(|r| build(r).unwrap()).collect();
        verify_schedules(&reqs, good.clone(), 1, 1).unwrap();
        // Drop every dependency of one rank: some seed must expose it.
        let mut bad = good.clone();
        for s in &mut bad[1].steps {
            s.deps.clear();
        }
        let caught = (0..50).any(|seed| verify_schedules(&reqs, bad.clone(), 2, seed).is_err());
        assert!(caught, "no seed caught a schedule without dependencies");
        // Drop one receive: the sender's data is never taken.
        let mut bad = good.clone();
        let i = bad[2]
            .steps
            .iter()
            .rposition(|s| matches!(s.op, Op::Recv { .. }))
            .unwrap();
        bad[2].steps.remove(i);
        verify_schedules(&reqs, bad, 4, 1).unwrap_err();
        // Two ranks that both receive before they send: deadlock.
        let p = |rank: usize| Request {
            coll: Collective::Barrier,
            world: 2,
            rank,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Dissemination,
            chunk: 1,
            channels: 1,
            weights: Vec::new(),
        };
        let mut dl: Vec<Schedule> = (0..2).map(|r| build(&p(r)).unwrap()).collect();
        for s in &mut dl {
            s.steps.swap(0, 1);
            s.steps[1].deps = vec![0];
        }
        let e = verify_schedules(&[p(0), p(1)], dl, 1, 1).unwrap_err();
        assert!(e.contains("deadlock"), "{e}");
    }

    #[test]
    fn schedules_are_deterministic() {
        let req = Request {
            coll: Collective::AllReduce { count: 1000 },
            world: 6,
            rank: 4,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Ring,
            chunk: 17,
            channels: 3,
            weights: Vec::new(),
        };
        assert_eq!(build(&req), build(&req));
    }
}
