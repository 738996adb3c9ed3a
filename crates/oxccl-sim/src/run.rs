//! Running a collective's schedules over a [`Fabric`].
//!
//! # The model
//!
//! Every rank gets the schedule the runtime would run: its tuner
//! ([`oxccl_core::tuner::Tuning`], built from [`Fabric::topology`], with [`Spec`]'s
//! overrides) picks the algorithm, slice and channels, and [`oxccl_core::schedule::build`]
//! makes the steps (for an [`Algorithm::Aggregation`] all-reduce,
//! [`oxccl_core::schedule::build_aggregator`] makes the aggregator's, which runs in the
//! fabric's aggregating switch, [`Fabric::aggregator`]).
//! Steps run as the executor runs them:
//!
//! - Per (peer, channel) a rank's sends form one FIFO queue and its receives another, in step
//!   order. The `n`-th send from `a` to `b` on channel `c` is received by the `n`-th receive
//!   at `b` from `a` on `c`.
//! - A send starts when its dependencies are done and it is at the head of its queue. The
//!   rank first *posts* it: `fragments × per_message_s` of the rank's time
//!   (`scaleup_per_message_s` to a rank of its own host), where a transfer
//!   moves in fragments of `chunk` elements (at least one); then the next send of the queue
//!   may be posted. A posted send's bytes leave as one *flow* over
//!   `fabric.route(a, b, channel)` once the previous flow of its queue has left (a queue is
//!   one connection: its messages leave in order). The send is done when its flow has left
//!   the sender (its last byte is on the wire).
//! - A flow shares every link it crosses max-min fairly with the other flows (progressive
//!   filling, recomputed whenever flows start or end; see [`crate::engine`]). It occupies all
//!   its links from its start until its last byte leaves (a fluid model), and its last byte
//!   arrives the sum of the route's link latencies later.
//! - A receive completes once its dependencies are done, it is at the head of its queue and
//!   its flow has fully arrived, after its reduction (`bytes / reduce_bytes_per_s`) when it
//!   reduces (`reduce_with`); a plain receive costs nothing more (the data is written in
//!   place).
//! - Flow control as the executor's receive slots: a queue's messages take
//!   `⌈elements / chunk⌉` slots each, and a message leaves only while the messages sent but
//!   not yet received (consumed) on that queue hold fewer than [`Tuning::slots`] slots with
//!   it (one message always may). A consumed message returns its slots at once (the credit's
//!   own latency is not modelled).
//! - Local steps run when their dependencies are done: a reduce costs
//!   `bytes / reduce_bytes_per_s`, and so does a copy (a copy is memory bound like a
//!   reduction), except a copy between the same memory (skipped, as the executor skips it).
//! - A rank does one thing at a time: posting sends, reductions and local steps take turns on
//!   its single thread in the order they became ready (zero-cost work never waits).
//! - The aggregator (a switch) reduces at its own rate and posts at no cost (hardware).
//!
//! The collective's time is when the last rank's last step is done.
//!
//! # Symmetry
//!
//! With [`Spec::symmetry`] and a [`Fabric::symmetry`] generator `g` whose schedules are
//! invariant (see [`crate::sym`]), only one representative rank per orbit of `g` is simulated.
//! A representative's flow stands for the `m` flows of its orbit (`m`: its rank's orbit
//! size); links are grouped in orbits too, and the flow loads its link orbit `O` with weight
//! `m·h/|O|` (`h`: its hops in `O`): in the symmetric state every link of an orbit carries the
//! same load, and max-min fairness of the full fabric is the weighted max-min fairness of
//! the orbits. A receive at a representative from a sender `gʲ(a)` (`a` a representative)
//! waits for the matching send of `a` to `g⁻ʲ` of the receiver. This gives the unsymmetrised
//! run's result when routes are equivariant (`route(g(a), g(b)) = g(route(a, b))`, as the
//! structured fabrics' routes are; a flow's route key is its channel, the same for every
//! flow of an orbit). Runs with an aggregator are never symmetrised.
//!
//! The hierarchical all-reduce cuts its tiers on rail blocks taken in order from the host's
//! own place on the rail, so that shifting hosts is an exact symmetry of its schedules.
//! Schedules that are invariant except for some dependencies (the hierarchical all-gather,
//! which gathers inside the host in host order, each slice once its rail copy arrived) are
//! run in full when that is at most [`Options::approximate_above_steps`] steps (default
//! [`APPROXIMATE_ABOVE_STEPS`]); above, symmetrised as if every rank ran its
//! representative's schedule, and [`Report::approximate`] says so.
//!
//! Costs: schedules are built on two threads and kept in a compact form (one 32-byte record
//! per step); the event loop is sequential.

use std::collections::{BinaryHeap, HashMap, VecDeque};

use oxccl_core::schedule::{Algorithm, Buf, Collective, Op, Region, Schedule};
use oxccl_core::tuner::Tuning;

use crate::engine::Net;
use crate::sym::{self, Cycles};
use crate::{Fabric, NodeKind};

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// The collective and its counts (elements).
    pub coll: Collective,
    /// Bytes per element.
    pub elem_size: usize,
    /// In place or not.
    pub in_place: bool,
    /// Force an algorithm (else the runtime's tuner chooses, as for a real job).
    pub algo: Option<Algorithm>,
    /// Bytes per pipelined slice (else the tuner's default for the fabric).
    pub chunk_bytes: Option<usize>,
    /// Channels (else the tuner's default).
    pub channels: Option<usize>,
    /// Receive slots per (peer, channel), as `OXCCL_SLOTS` (else the runtime's default).
    pub slots: Option<usize>,
    /// Record the events of a trace in [`Report::trace`].
    pub trace: bool,
    /// Use the fabric's symmetry where the schedules allow it.
    pub symmetry: bool,
}

impl Spec {
    /// `coll` over elements of `elem_size` bytes, out of place, as the tuner chooses, no
    /// trace, symmetry used where it applies.
    pub fn new(coll: Collective, elem_size: usize) -> Spec {
        Spec {
            coll,
            elem_size,
            in_place: false,
            algo: None,
            chunk_bytes: None,
            channels: None,
            slots: None,
            trace: false,
            symmetry: true,
        }
    }
}

/// One span of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The track it belongs to.
    pub track: Track,
    /// What happened (e.g. `send 3->4 ch0 1.0 MiB`).
    pub name: String,
    /// Start, seconds from the start of the collective.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
    /// Bytes moved (0 for a local step).
    pub bytes: u64,
}

/// A trace track.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Track {
    /// A rank's steps.
    Rank(usize),
    /// A link's flows.
    Link(usize),
}

/// What a simulation predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The algorithm that ran.
    pub algo: Algorithm,
    /// Time from the start until the last rank is done, seconds.
    pub time_s: f64,
    /// When each rank finished, seconds.
    pub rank_done_s: Vec<f64>,
    /// Bytes each link carried.
    pub link_bytes: Vec<f64>,
    /// Seconds each link carried at least one flow.
    pub link_busy_s: Vec<f64>,
    /// The trace, when [`Spec::trace`] asked for it: per simulated rank, each step's span
    /// (from when it could start, dependencies done and at the head of its queue, until it
    /// was done); per link, its busy intervals. In a symmetric run only the representative
    /// ranks have tracks (the others' are the same, shifted by the symmetry).
    pub trace: Option<Vec<Event>>,
    /// Ranks simulated: every rank, or one representative per orbit of the symmetry.
    pub simulated_ranks: usize,
    /// Whether the fabric's symmetry was used.
    pub symmetric: bool,
    /// Whether the symmetric run is an approximation: the schedules are invariant under the
    /// symmetry except for some dependencies, and the full run was too large (more than
    /// [`APPROXIMATE_ABOVE_STEPS`] steps); each rank is then assumed to run its
    /// representative's schedule, mapped.
    pub approximate: bool,
    /// Steps simulated (of the simulated ranks and the aggregator).
    pub steps: u64,
    /// Flows simulated.
    pub flows: u64,
}

/// The runtime's view of `fabric` for its tuner: [`Fabric::topology`]; when that knows no
/// link rate at all (a fabric built by hand), [`host_link_gbps`] fills them in.
pub fn tuner_topology(fabric: &Fabric) -> oxccl_core::Topology {
    let mut topo = fabric.topology();
    if topo.hosts.iter().all(|h| h.link_gbps.is_none()) && topo.hosts.len() == fabric.hosts.len() {
        let rates = host_link_gbps(fabric);
        for (h, r) in topo.hosts.iter_mut().zip(rates) {
            h.link_gbps = r;
        }
    }
    topo
}

/// Each host's rate into the network, Gbit/s per direction: the sum of the rates of the
/// links that leave the host, where the host is its ranks and the switches whose rank
/// neighbours are all its own (a scale-up switch, a host's switch). A host with one NIC per
/// rank gets the sum of its NICs. `None` for a host without such links.
pub fn host_link_gbps(fabric: &Fabric) -> Vec<Option<f64>> {
    const NONE: usize = usize::MAX;
    const MANY: usize = usize::MAX - 1;
    // The host each node belongs to (ranks: theirs; switches: the one host among their rank
    // neighbours, if only one).
    let mut owner = vec![NONE; fabric.nodes.len()];
    for (i, n) in fabric.nodes.iter().enumerate() {
        if let NodeKind::Rank { host } = n.kind {
            owner[i] = host;
        }
    }
    let mut sw = vec![NONE; fabric.nodes.len()];
    for l in &fabric.links {
        for (s, r) in [(l.from, l.to), (l.to, l.from)] {
            if let (NodeKind::Switch { .. }, NodeKind::Rank { host }) =
                (&fabric.nodes[s].kind, &fabric.nodes[r].kind)
            {
                sw[s] = match sw[s] {
                    NONE => *host,
                    h if h == *host => h,
                    _ => MANY,
                };
            }
        }
    }
    for (i, &h) in sw.iter().enumerate() {
        if h != NONE && h != MANY {
            owner[i] = h;
        }
    }
    let mut rate = vec![0.0f64; fabric.hosts.len()];
    for l in &fabric.links {
        let h = owner[l.from];
        if h != NONE && owner[l.to] != h {
            rate[h] += l.bytes_per_s * 8.0 / 1e9;
        }
    }
    rate.into_iter().map(|r| (r > 0.0).then_some(r)).collect()
}

/// The tuner for `fabric` with `spec`'s overrides.
pub fn tuning(fabric: &Fabric, spec: &Spec) -> Tuning {
    let topo = tuner_topology(fabric);
    let net = topo.hosts.len() > 1;
    let mut t = Tuning::new(&topo, net);
    t.world = fabric.world;
    if let Some(a) = spec.algo {
        t.algo = Some(a);
    }
    if let Some(c) = spec.chunk_bytes {
        t.chunk_bytes = c.max(1);
    }
    if let Some(c) = spec.channels {
        t.channels = c.max(1);
    }
    if let Some(c) = spec.slots {
        t.slots = c.max(1);
    }
    t
}

/// Without usable symmetry, runs of more steps than this (all ranks together) are refused
/// (about 4 GB of steps and a minute of simulation).
const FULL_MAX_STEPS: u128 = 100_000_000;
/// Schedules invariant under the symmetry except for their dependencies are run
/// symmetrised (approximately, [`Report::approximate`]) when the full run would simulate
/// more steps than this.
pub const APPROXIMATE_ABOVE_STEPS: u128 = 8_000_000;
/// Representatives whose schedules are checked against their images (evenly spread when
/// there are more).
const CHECKED_REPS: usize = 64;

/// How a run uses the symmetry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Full,
    Exact,
    Approximate,
}

/// Knobs of [`simulate_with`] that are not part of a [`Spec`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    /// Run symmetrised approximately (see [`Report::approximate`]) when the full run would
    /// simulate more steps than this; `u128::MAX`: never.
    pub approximate_above_steps: u128,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            approximate_above_steps: APPROXIMATE_ABOVE_STEPS,
        }
    }
}

/// Runs `spec` on `fabric` (with the default [`Options`]).
pub fn simulate(fabric: &Fabric, spec: &Spec) -> Result<Report, String> {
    simulate_with(fabric, spec, &Options::default())
}

/// Runs `spec` on `fabric` with `opts`.
pub fn simulate_with(fabric: &Fabric, spec: &Spec, opts: &Options) -> Result<Report, String> {
    let world = fabric.world;
    if world == 0 {
        return Err("the fabric has no rank".into());
    }
    if spec.elem_size == 0 {
        return Err("elements of 0 bytes".into());
    }
    let tuning = tuning(fabric, spec);
    let req0 = tuning.request(&spec.coll, spec.elem_size, 0, spec.in_place);
    let algo = req0.algo;
    let aggregation = algo == Algorithm::Aggregation;
    let agg_node = if aggregation {
        Some(fabric.aggregator().ok_or_else(|| {
            "the aggregation all-reduce needs a switch that can reduce (reduce_bytes_per_s) \
             and that every rank reaches; this fabric has none"
                .to_string()
        })?)
    } else {
        None
    };
    let build = |r: usize| -> Result<Schedule, String> {
        let req = tuning.request(&spec.coll, spec.elem_size, r, spec.in_place);
        oxccl_core::schedule::build(&req).map_err(|e| format!("rank {r}'s schedule: {e}"))
    };
    let skipped = |r: usize| {
        let coll = &spec.coll;
        let in_place = spec.in_place;
        move |a: Region, b: Region| copy_skipped(coll, world, r, in_place, a, b)
    };
    let compact = |r: usize, s: Schedule| Part::new(r, s, spec, world, agg_node.is_some());

    // Symmetry: the rank cycles of the generator, if the schedules are invariant.
    let mut parts: Vec<Part> = Vec::new();
    let mut ranks = Cycles::identity(world);
    let mut links = Cycles::identity(fabric.links.len());
    let mut mode = Mode::Full;
    let mut first_len = None;
    if let (true, false, Some(g)) = (spec.symmetry, aggregation, &fabric.symmetry)
        && g.node_map.len() == fabric.nodes.len()
        && g.node_map[..world].iter().all(|&x| x < world)
        && let (Some(rc), Some(lc)) = (Cycles::of(&g.node_map[..world]), Cycles::of(&g.link_map))
        && rc.cycles.len() < world
    {
        let nreps = rc.cycles.len();
        let checked: Vec<bool> = if nreps <= CHECKED_REPS {
            vec![true; nreps]
        } else {
            let mut v = vec![false; nreps];
            for i in 0..CHECKED_REPS {
                v[i * (nreps - 1) / (CHECKED_REPS - 1)] = true;
            }
            v
        };
        // Per representative: its part, and whether its schedule is invariant (exactly,
        // or but for dependencies).
        let results = par_map(nreps, |c| -> Result<(Part, bool, bool), String> {
            let r = rc.cycles[c][0];
            let a = build(r)?;
            let (mut exact, mut relaxed) = (true, true);
            if checked[c] && rc.cycles[c].len() > 1 {
                let gr = g.node_map[r];
                let b = build(gr)?;
                let map = |p: usize| if p < world { g.node_map[p] } else { p };
                exact = sym::invariant(&a, &b, map, skipped(r), skipped(gr), true);
                relaxed = exact || sym::invariant(&a, &b, map, skipped(r), skipped(gr), false);
            }
            Ok((compact(r, a)?, exact, relaxed))
        });
        let mut exact = true;
        let mut relaxed = true;
        let mut reps = Vec::with_capacity(nreps);
        for res in results {
            let (part, e, r) = res?;
            exact &= e;
            relaxed &= r;
            reps.push(part);
        }
        let full_steps = reps[0].st.len() as u128 * world as u128;
        first_len = Some(reps[0].st.len());
        if exact || (relaxed && full_steps > opts.approximate_above_steps) {
            mode = if exact {
                Mode::Exact
            } else {
                Mode::Approximate
            };
            parts = reps;
            ranks = rc;
            links = lc;
        }
    }
    if mode != Mode::Full {
        // A symmetric run that fails (a schedule the sampled check did not see break the
        // matching) falls back to the full run.
        let mut sim = Sim::new(fabric, spec, &tuning, parts, ranks, links, None)?;
        if sim.run().is_ok() {
            return Ok(sim.report(algo, mode));
        }
        ranks = Cycles::identity(world);
        links = Cycles::identity(fabric.links.len());
        mode = Mode::Full;
    }
    let first = match first_len {
        Some(n) => n,
        None => build(0)?.steps.len(),
    };
    let est = first as u128 * world as u128;
    if est > FULL_MAX_STEPS {
        return Err(format!(
            "about {est} steps to simulate ({world} ranks) and no usable symmetry: the \
             fabric has none, or the schedules are not invariant under it"
        ));
    }
    parts = par_map(world, |r| compact(r, build(r)?))
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    if agg_node.is_some() {
        let s = oxccl_core::schedule::build_aggregator(&req0)?;
        parts.push(compact(world, s)?);
    }
    let mut sim = Sim::new(fabric, spec, &tuning, parts, ranks, links, agg_node)?;
    sim.run()?;
    Ok(sim.report(algo, mode))
}

/// `f(0..n)` on up to two threads (the results in order).
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map(|x| x.get())
        .unwrap_or(1)
        .min(2);
    if threads < 2 || n < 8 {
        return (0..n).map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut got: Vec<(usize, T)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut v = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n {
                            break v;
                        }
                        v.push((i, f(i)));
                    }
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().expect("a worker"))
            .collect()
    });
    got.sort_unstable_by_key(|x| x.0);
    got.into_iter().map(|x| x.1).collect()
}

/// Whether the executor skips a copy from `a` to `b` (the same memory: the same region of
/// one buffer, or input and output at the same place of an in-place call).
fn copy_skipped(
    coll: &Collective,
    world: usize,
    rank: usize,
    in_place: bool,
    a: Region,
    b: Region,
) -> bool {
    let addr = |r: Region| -> (u8, usize) {
        match r.buf {
            Buf::Scratch => (2, r.offset),
            Buf::Input | Buf::Output if in_place => {
                let (i, o) = coll.in_place_offsets(world, rank).unwrap_or((0, 0));
                (0, r.offset + if r.buf == Buf::Input { i } else { o })
            }
            Buf::Input => (0, r.offset),
            Buf::Output => (1, r.offset),
        }
    };
    addr(a) == addr(b)
}

/// A send queue of a participant.
#[derive(Debug)]
struct SendQ {
    peer: usize,
    ch: u8,
    steps: Vec<u32>,
    /// Next step to post.
    post: usize,
    posting: bool,
    /// Steps posted, and the next to transmit.
    posted: usize,
    xmit: usize,
    busy: bool,
    /// Its route (index into `Sim::route_list`).
    route: u32,
    /// The receiving participant and its receive queue, once known.
    target: Option<(u32, u32)>,
    /// Slots held by messages that left and are not received yet.
    inflight: u64,
    /// Cost of posting one fragment (the network's or the host's).
    per_message_s: f64,
}

/// A receive queue.
#[derive(Debug)]
struct RecvQ {
    peer: usize,
    ch: u8,
    steps: Vec<u32>,
    head: usize,
    /// The send queue (participant, queue) whose messages it receives: where its credits go.
    source: Option<(u32, u32)>,
}

const NO_Q: u32 = u32::MAX;

/// Step kinds.
const SEND: u8 = 0;
const RECV: u8 = 1;
const RECV_REDUCE: u8 = 2;
const COPY: u8 = 3;
const COPY_SKIPPED: u8 = 4;
const REDUCE: u8 = 5;

/// Step flags.
const ARRIVED: u8 = 1;
const STARTED: u8 = 2;

/// A step in compact form (one cache line holds two).
#[derive(Clone, Copy, Debug)]
struct St {
    /// Elements moved, reduced or copied.
    elems: u64,
    /// Its queue (send or receive; `NO_Q` for a local step).
    queue: u32,
    /// Its place in its queue.
    qpos: u32,
    /// Its dependents: `dep_list[dep_a..dep_b]`.
    dep_a: u32,
    dep_b: u32,
    /// Dependencies not done yet.
    ndeps: u32,
    kind: u8,
    flags: u8,
}

/// A simulated participant (a rank or the aggregator), its schedule in compact form.
struct Part {
    rank: usize,
    node: usize,
    /// The steps.
    st: Vec<St>,
    /// Dependents of every step (`St::dep_a..St::dep_b`).
    dep_list: Vec<u32>,
    sendq: Vec<SendQ>,
    recvq: Vec<RecvQ>,
    recv_index: HashMap<(usize, u8), u32>,
    begin: Vec<f64>,
    cpu_free: f64,
    reduce_rate: f64,
    per_message_s: f64,
    left: usize,
    done_at: f64,
}

impl Part {
    fn new(
        rank: usize,
        sched: Schedule,
        spec: &Spec,
        world: usize,
        agg: bool,
    ) -> Result<Part, String> {
        let n = sched.steps.len();
        let mut ndeps = vec![0u32; n];
        let mut count = vec![0u32; n + 1];
        for (s, step) in sched.steps.iter().enumerate() {
            ndeps[s] = step.deps.len() as u32;
            for &d in &step.deps {
                if d as usize >= s {
                    return Err(format!("rank {rank} step {s} depends on a later step {d}"));
                }
                count[d as usize + 1] += 1;
            }
        }
        for s in 0..n {
            count[s + 1] += count[s];
        }
        let dep_at = count.clone();
        let mut fill = count;
        let mut dep_list = vec![0u32; dep_at[n] as usize];
        for (s, step) in sched.steps.iter().enumerate() {
            for &d in &step.deps {
                dep_list[fill[d as usize] as usize] = s as u32;
                fill[d as usize] += 1;
            }
        }
        let mut st: Vec<St> = (0..n)
            .map(|i| St {
                elems: 0,
                queue: NO_Q,
                qpos: 0,
                dep_a: dep_at[i],
                dep_b: dep_at[i + 1],
                ndeps: ndeps[i],
                kind: 0,
                flags: 0,
            })
            .collect();
        let mut sendq: Vec<SendQ> = Vec::new();
        let mut recvq: Vec<RecvQ> = Vec::new();
        let mut send_index: HashMap<(usize, u8), u32> = HashMap::new();
        let mut recv_index: HashMap<(usize, u8), u32> = HashMap::new();
        let bad_peer = |peer: usize| peer > world || peer == rank || (peer == world && !agg);
        for (s, step) in sched.steps.iter().enumerate() {
            match step.op {
                Op::Send { peer, channel, src } => {
                    if bad_peer(peer) {
                        return Err(format!("rank {rank} step {s} sends to rank {peer}"));
                    }
                    let q = *send_index.entry((peer, channel)).or_insert_with(|| {
                        sendq.push(SendQ {
                            peer,
                            ch: channel,
                            steps: Vec::new(),
                            post: 0,
                            posting: false,
                            posted: 0,
                            xmit: 0,
                            busy: false,
                            route: 0,
                            target: None,
                            inflight: 0,
                            per_message_s: 0.0,
                        });
                        (sendq.len() - 1) as u32
                    });
                    st[s].kind = SEND;
                    st[s].elems = src.len as u64;
                    st[s].queue = q;
                    st[s].qpos = sendq[q as usize].steps.len() as u32;
                    sendq[q as usize].steps.push(s as u32);
                }
                Op::Recv {
                    peer,
                    channel,
                    dst,
                    reduce_with,
                } => {
                    if bad_peer(peer) {
                        return Err(format!("rank {rank} step {s} receives from rank {peer}"));
                    }
                    let q = *recv_index.entry((peer, channel)).or_insert_with(|| {
                        recvq.push(RecvQ {
                            peer,
                            ch: channel,
                            steps: Vec::new(),
                            head: 0,
                            source: None,
                        });
                        (recvq.len() - 1) as u32
                    });
                    st[s].kind = if reduce_with.is_some() {
                        RECV_REDUCE
                    } else {
                        RECV
                    };
                    st[s].elems = dst.len as u64;
                    st[s].queue = q;
                    st[s].qpos = recvq[q as usize].steps.len() as u32;
                    recvq[q as usize].steps.push(s as u32);
                }
                Op::Copy { src, dst } => {
                    let same = copy_skipped(&spec.coll, world, rank, spec.in_place, src, dst);
                    st[s].kind = if same { COPY_SKIPPED } else { COPY };
                    st[s].elems = src.len as u64;
                }
                Op::Reduce { dst, .. } => {
                    st[s].kind = REDUCE;
                    st[s].elems = dst.len as u64;
                }
            }
        }
        drop(sched);
        Ok(Part {
            rank,
            node: rank,
            st,
            dep_list,
            sendq,
            recvq,
            recv_index,
            begin: if spec.trace {
                vec![f64::NAN; n]
            } else {
                Vec::new()
            },
            cpu_free: 0.0,
            reduce_rate: 0.0,
            per_message_s: 0.0,
            left: n,
            done_at: 0.0,
        })
    }
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    /// A participant's thread finished work on a step.
    Cpu(u32, u32),
    /// A send with no flow (no bytes, or no link) drained.
    Drained(u32, u32),
    /// A receive's data arrived.
    Arrive(u32, u32),
}

/// An event at a time, packed in 16 bytes for the queue: the time's bits (times are never
/// negative, so their bits order as the times do), then the event's kind, participant and
/// step (which break ties, deterministically).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Timed(u64, u64);

impl Timed {
    fn new(t: f64, ev: Ev) -> Timed {
        debug_assert!(t >= 0.0);
        let (k, p, s) = match ev {
            Ev::Cpu(p, s) => (0u64, p, s),
            Ev::Drained(p, s) => (1, p, s),
            Ev::Arrive(p, s) => (2, p, s),
        };
        Timed((t + 0.0).to_bits(), k << 62 | (p as u64) << 32 | s as u64)
    }
    fn time(&self) -> f64 {
        f64::from_bits(self.0)
    }
    fn ev(&self) -> Ev {
        let (p, s) = (((self.1 >> 32) & 0x3fff_ffff) as u32, self.1 as u32);
        match self.1 >> 62 {
            0 => Ev::Cpu(p, s),
            1 => Ev::Drained(p, s),
            _ => Ev::Arrive(p, s),
        }
    }
}

impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // Reversed: BinaryHeap is a max-heap.
        (o.0, o.1).cmp(&(self.0, self.1))
    }
}

#[derive(Clone, Copy, Debug)]
enum Act {
    DepsDone(u32, u32),
    CpuDone(u32, u32),
    Drained(u32, u32),
}

/// A route, as classes and weights, and its latency.
struct Route {
    path: Vec<(u32, f64)>,
    latency: f64,
}

struct Sim<'a> {
    fabric: &'a Fabric,
    elem: usize,
    chunk: u64,
    /// Receive slots per queue (flow control).
    slots: u64,
    trace: bool,
    parts: Vec<Part>,
    /// Each rank's participant (`u32::MAX` for a rank that is not simulated); the aggregator
    /// is rank `world`.
    part_of: Vec<u32>,
    ranks: Cycles,
    links: Cycles,
    net: Net,
    heap: BinaryHeap<Timed>,
    now: f64,
    work: VecDeque<Act>,
    route_list: Vec<Route>,
    /// Per flow: (participant, send step).
    flow_info: Vec<(u32, u32)>,
    flows: u64,
    events: Vec<crate::Event>,
}

impl<'a> Sim<'a> {
    fn new(
        fabric: &'a Fabric,
        spec: &Spec,
        tuning: &Tuning,
        mut parts: Vec<Part>,
        ranks: Cycles,
        links: Cycles,
        agg_node: Option<usize>,
    ) -> Result<Sim<'a>, String> {
        let world = fabric.world;
        let chunk = (tuning.chunk_bytes / spec.elem_size).max(1) as u64;
        let mut part_of = vec![u32::MAX; world + 1];
        let mut routes: HashMap<(usize, usize, u8), u32> = HashMap::new();
        let mut route_list: Vec<Route> = Vec::new();
        let mut scratch = Vec::new();
        let node_of = |r: usize| if r == world { agg_node } else { Some(r) };
        for (i, part) in parts.iter_mut().enumerate() {
            part_of[part.rank] = i as u32;
            if part.rank == world {
                let node = agg_node.expect("an aggregator");
                part.node = node;
                part.reduce_rate = match fabric.nodes[node].kind {
                    NodeKind::Switch {
                        reduce_bytes_per_s: Some(r),
                    } => r,
                    _ => return Err(format!("node {node} cannot reduce")),
                };
                part.per_message_s = 0.0;
            } else {
                part.node = part.rank;
                part.reduce_rate = fabric.reduce_bytes_per_s;
                part.per_message_s = fabric.per_message_s;
            }
            // The flow stands for the orbit of its sender: m flows.
            let m = if part.rank < world {
                ranks.len_of(part.rank) as f64
            } else {
                1.0
            };
            let host_of = |n: usize| match fabric.nodes[n].kind {
                NodeKind::Rank { host } => Some(host),
                NodeKind::Switch { .. } => None,
            };
            for sq in &mut part.sendq {
                let (from, to) = (part.node, node_of(sq.peer).expect("checked"));
                sq.per_message_s = if part.per_message_s == 0.0 {
                    0.0
                } else if host_of(from).is_some() && host_of(from) == host_of(to) {
                    fabric.scaleup_per_message_s
                } else {
                    part.per_message_s
                };
                sq.route = *routes.entry((from, to, sq.ch)).or_insert_with(|| {
                    scratch.clear();
                    // The key: the channel (a queue is one connection), the same for every
                    // flow of an orbit.
                    fabric.route(from, to, sq.ch as u64, &mut scratch);
                    let mut path: Vec<(u32, f64)> = Vec::new();
                    let mut latency = 0.0;
                    for &l in &scratch {
                        latency += fabric.links[l].latency_s;
                        let c = links.cycle_of[l];
                        let w = m / links.len_of(l) as f64;
                        match path.iter_mut().find(|(x, _)| *x == c) {
                            Some(e) => e.1 += w,
                            None => path.push((c, w)),
                        }
                    }
                    route_list.push(Route { path, latency });
                    (route_list.len() - 1) as u32
                });
            }
        }
        // Link classes: the link cycles, capacity of their lowest link.
        let caps: Vec<f64> = links
            .cycles
            .iter()
            .map(|c| fabric.links[c[0]].bytes_per_s)
            .collect();
        Ok(Sim {
            fabric,
            elem: spec.elem_size,
            chunk,
            slots: tuning.slots.max(1) as u64,
            trace: spec.trace,
            parts,
            part_of,
            ranks,
            links,
            net: Net::new(&caps, spec.trace),
            heap: BinaryHeap::new(),
            now: 0.0,
            work: VecDeque::new(),
            route_list,
            flow_info: Vec::new(),
            flows: 0,
            events: Vec::new(),
        })
    }

    fn push(&mut self, t: f64, ev: Ev) {
        self.heap.push(Timed::new(t, ev));
    }

    fn run(&mut self) -> Result<(), String> {
        // Every send queue's receiving queue, and back, for the credits.
        for p in 0..self.parts.len() {
            for q in 0..self.parts[p].sendq.len() {
                let (tp, rq) = self.target(p as u32, q as u32)?;
                let source = &mut self.parts[tp as usize].recvq[rq as usize].source;
                if source.is_some_and(|x| x != (p as u32, q as u32)) {
                    return Err(format!(
                        "two send queues feed rank {}'s receive queue {rq}",
                        self.parts[tp as usize].rank
                    ));
                }
                *source = Some((p as u32, q as u32));
            }
        }
        for p in 0..self.parts.len() {
            for s in 0..self.parts[p].st.len() {
                if self.parts[p].st[s].ndeps == 0 {
                    self.work.push_back(Act::DepsDone(p as u32, s as u32));
                }
            }
        }
        self.drain_work()?;
        self.net.settle(self.now);
        loop {
            let next_ev = self.heap.peek().map(|e| e.time());
            let next_drain = self.net.next_drain().map(|d| d.0);
            let t = match (next_ev, next_drain) {
                (None, None) => break,
                (Some(a), None) => a,
                (None, Some(b)) => b,
                (Some(a), Some(b)) => a.min(b),
            };
            self.now = t;
            // Everything due at t: events first, then drains, then rates once.
            loop {
                if self.heap.peek().is_some_and(|e| e.time() == t) {
                    let ev = self.heap.pop().expect("peeked").ev();
                    self.event(ev)?;
                } else if let Some((d, f)) = self.net.next_drain()
                    && d == t
                {
                    self.net.remove(t, f);
                    let (p, s) = self.flow_info[f as usize];
                    self.work.push_back(Act::Drained(p, s));
                    self.drain_work()?;
                } else {
                    break;
                }
            }
            self.net.settle(t);
        }
        for p in &self.parts {
            if p.left > 0 {
                let s = (0..p.st.len())
                    .find(|&s| p.st[s].flags & STARTED == 0 || p.st[s].ndeps > 0)
                    .unwrap_or(0);
                let what = match p.st[s].queue {
                    NO_Q => "a local step".to_string(),
                    q if p.st[s].kind == SEND => format!(
                        "a send to rank {} on channel {}",
                        p.sendq[q as usize].peer, p.sendq[q as usize].ch
                    ),
                    q => format!(
                        "a receive from rank {} on channel {}",
                        p.recvq[q as usize].peer, p.recvq[q as usize].ch
                    ),
                };
                return Err(format!(
                    "deadlock: rank {} has {} steps left; the first waiting is step {s}, {what}",
                    p.rank, p.left
                ));
            }
        }
        Ok(())
    }

    fn event(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Cpu(p, s) => self.work.push_back(Act::CpuDone(p, s)),
            Ev::Drained(p, s) => self.work.push_back(Act::Drained(p, s)),
            Ev::Arrive(p, s) => {
                self.parts[p as usize].st[s as usize].flags |= ARRIVED;
                self.try_recv(p, s);
            }
        }
        self.drain_work()
    }

    fn drain_work(&mut self) -> Result<(), String> {
        while let Some(a) = self.work.pop_front() {
            match a {
                Act::DepsDone(p, s) => self.deps_done(p, s),
                Act::CpuDone(p, s) => self.cpu_done(p, s),
                Act::Drained(p, s) => self.drained(p, s)?,
            }
        }
        Ok(())
    }

    fn deps_done(&mut self, p: u32, s: u32) {
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        match part.st[i].kind {
            SEND => {
                let q = part.st[i].queue;
                self.try_post(p, q);
            }
            RECV | RECV_REDUCE => self.try_recv(p, s),
            k => {
                if self.trace {
                    part.begin[i] = self.now;
                }
                let cost = if k == COPY_SKIPPED {
                    0.0
                } else {
                    (part.st[i].elems * self.elem as u64) as f64 / part.reduce_rate
                };
                self.cpu(p, s, cost);
            }
        }
    }

    /// Runs `cost` seconds of `p`'s thread for step `s`, after what it is busy with.
    fn cpu(&mut self, p: u32, s: u32, cost: f64) {
        let now = self.now;
        let part = &mut self.parts[p as usize];
        part.st[s as usize].flags |= STARTED;
        if cost <= 0.0 {
            self.work.push_back(Act::CpuDone(p, s));
            return;
        }
        let start = part.cpu_free.max(now);
        let end = start + cost;
        part.cpu_free = end;
        self.push(end, Ev::Cpu(p, s));
    }

    fn try_post(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        if sq.posting || sq.post >= sq.steps.len() {
            return;
        }
        let s = sq.steps[sq.post];
        if part.st[s as usize].ndeps > 0 {
            return;
        }
        sq.posting = true;
        if self.trace {
            part.begin[s as usize] = self.now;
        }
        let frags = part.st[s as usize].elems.div_ceil(self.chunk).max(1);
        let cost = frags as f64 * sq.per_message_s;
        self.cpu(p, s, cost);
    }

    fn try_recv(&mut self, p: u32, s: u32) {
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        if part.st[i].flags & STARTED != 0 || part.st[i].ndeps > 0 {
            return;
        }
        let rq = &part.recvq[part.st[i].queue as usize];
        if rq.steps.get(rq.head) != Some(&s) {
            return;
        }
        if self.trace && part.begin[i].is_nan() {
            // The span starts when it could first consume.
            part.begin[i] = self.now;
        }
        if part.st[i].flags & ARRIVED == 0 {
            return;
        }
        let cost = if part.st[i].kind == RECV_REDUCE {
            (part.st[i].elems * self.elem as u64) as f64 / part.reduce_rate
        } else {
            0.0
        };
        self.cpu(p, s, cost);
    }

    fn cpu_done(&mut self, p: u32, s: u32) {
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        match part.st[i].kind {
            SEND => {
                let q = part.st[i].queue;
                let sq = &mut part.sendq[q as usize];
                sq.posting = false;
                sq.post += 1;
                sq.posted += 1;
                self.try_xmit(p, q);
                self.try_post(p, q);
            }
            RECV | RECV_REDUCE => {
                let q = part.st[i].queue as usize;
                part.recvq[q].head += 1;
                let next = part.recvq[q].steps.get(part.recvq[q].head).copied();
                let frags = part.st[i].elems.div_ceil(self.chunk).max(1);
                let source = part.recvq[q].source;
                self.step_done(p, s);
                // The message's slots go back to its sender.
                if let Some((sp, sq)) = source {
                    let send = &mut self.parts[sp as usize].sendq[sq as usize];
                    send.inflight = send.inflight.saturating_sub(frags);
                    self.try_xmit(sp, sq);
                }
                if let Some(n) = next {
                    self.try_recv(p, n);
                }
            }
            _ => self.step_done(p, s),
        }
    }

    fn try_xmit(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        if sq.busy || sq.xmit >= sq.posted {
            return;
        }
        let s = sq.steps[sq.xmit];
        // Flow control: the receiver's slots (one message may always go).
        let frags = part.st[s as usize].elems.div_ceil(self.chunk).max(1);
        if sq.inflight > 0 && sq.inflight + frags > self.slots {
            return;
        }
        sq.inflight += frags;
        sq.xmit += 1;
        sq.busy = true;
        let r = sq.route as usize;
        let bytes = (part.st[s as usize].elems * self.elem as u64) as f64;
        self.flows += 1;
        if bytes <= 0.0 || self.route_list[r].path.is_empty() {
            self.push(self.now, Ev::Drained(p, s));
            return;
        }
        let f = self.net.add(self.now, &self.route_list[r].path, bytes);
        if self.flow_info.len() <= f as usize {
            self.flow_info.resize(f as usize + 1, (0, 0));
        }
        self.flow_info[f as usize] = (p, s);
    }

    /// The receiving participant and receive queue of `p`'s send queue `q`: the
    /// representative of the peer, receiving from the image of `p`'s rank.
    fn target(&mut self, p: u32, q: u32) -> Result<(u32, u32), String> {
        let world = self.fabric.world;
        let part = &self.parts[p as usize];
        let sq = &part.sendq[q as usize];
        if let Some(t) = sq.target {
            return Ok(t);
        }
        let (peer, ch, a0) = (sq.peer, sq.ch, part.rank);
        let (b0, sender) = if peer < world {
            let j = self.ranks.to_rep(peer);
            let b0 = self.ranks.apply(peer, j);
            let sender = if a0 < world {
                self.ranks.apply(a0, j)
            } else {
                a0
            };
            (b0, sender)
        } else {
            (peer, a0)
        };
        let tp = self.part_of[b0];
        if tp == u32::MAX {
            return Err(format!("rank {b0} is not simulated"));
        }
        let rq = *self.parts[tp as usize]
            .recv_index
            .get(&(sender, ch))
            .ok_or_else(|| {
                format!(
                    "rank {sender} sends to rank {b0} on channel {ch}, which receives nothing \
                     from it there"
                )
            })?;
        self.parts[p as usize].sendq[q as usize].target = Some((tp, rq));
        Ok((tp, rq))
    }

    /// Send `s` of `p` has left: it is done, the queue's next flow may leave, and its data
    /// arrives after the route's latency at the matching receive.
    fn drained(&mut self, p: u32, s: u32) -> Result<(), String> {
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        let q = part.st[i].queue;
        let n = part.st[i].qpos as usize;
        let elems = part.st[i].elems;
        let sq = &mut part.sendq[q as usize];
        sq.busy = false;
        let latency = self.route_list[sq.route as usize].latency;
        self.try_xmit(p, q);
        self.step_done(p, s);
        let (tp, rq) = self.target(p, q)?;
        let tpart = &self.parts[tp as usize];
        let Some(&ts) = tpart.recvq[rq as usize].steps.get(n) else {
            let sq = &self.parts[p as usize].sendq[q as usize];
            return Err(format!(
                "rank {} sends message {n} to rank {} on channel {}, which receives only {}",
                self.parts[p as usize].rank,
                sq.peer,
                sq.ch,
                tpart.recvq[rq as usize].steps.len()
            ));
        };
        if tpart.st[ts as usize].elems != elems {
            return Err(format!(
                "rank {} sends {elems} elements to rank {} (message {n}), which receives {}",
                self.parts[p as usize].rank, tpart.rank, tpart.st[ts as usize].elems
            ));
        }
        self.push(self.now + latency, Ev::Arrive(tp, ts));
        Ok(())
    }

    fn step_done(&mut self, p: u32, s: u32) {
        let now = self.now;
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        part.left -= 1;
        part.done_at = now;
        if self.trace {
            let (name, bytes) = step_name(part, i, self.elem);
            self.events.push(crate::Event {
                track: crate::Track::Rank(part.rank),
                name,
                start_s: part.begin[i],
                end_s: now,
                bytes,
            });
        }
        let (a, b) = (part.st[i].dep_a as usize, part.st[i].dep_b as usize);
        for k in a..b {
            let d = part.dep_list[k];
            part.st[d as usize].ndeps -= 1;
            if part.st[d as usize].ndeps == 0 {
                self.work.push_back(Act::DepsDone(p, d));
            }
        }
    }

    fn report(mut self, algo: Algorithm, mode: Mode) -> Report {
        let world = self.fabric.world;
        let rank_done_s: Vec<f64> = (0..world)
            .map(|r| self.parts[self.part_of[self.ranks.rep(r)] as usize].done_at)
            .collect();
        let time_s = rank_done_s.iter().copied().fold(0.0, f64::max);
        let usage = self.net.usage(time_s);
        let nl = self.fabric.links.len();
        let mut link_bytes = vec![0.0; nl];
        let mut link_busy_s = vec![0.0; nl];
        for l in 0..nl {
            let (b, busy) = usage[self.links.cycle_of[l] as usize];
            link_bytes[l] = b;
            link_busy_s[l] = busy;
        }
        let trace = if self.trace {
            let mut ev = std::mem::take(&mut self.events);
            for l in 0..nl {
                let c = self.links.cycle_of[l];
                for &(a, b) in self.net.intervals(c) {
                    ev.push(crate::Event {
                        track: crate::Track::Link(l),
                        name: format!("busy {}", self.fabric.links[l].name),
                        start_s: a,
                        end_s: b,
                        bytes: 0,
                    });
                }
            }
            Some(ev)
        } else {
            None
        };
        Report {
            algo,
            time_s,
            rank_done_s,
            link_bytes,
            link_busy_s,
            trace,
            simulated_ranks: self.parts.iter().filter(|p| p.rank < world).count(),
            symmetric: mode != Mode::Full,
            approximate: mode == Mode::Approximate,
            steps: self.parts.iter().map(|p| p.st.len() as u64).sum(),
            flows: self.flows,
        }
    }
}

/// A step's trace name and bytes.
fn step_name(part: &Part, i: usize, elem: usize) -> (String, u64) {
    let rank = part.rank;
    let b = part.st[i].elems * elem as u64;
    match part.st[i].kind {
        SEND => {
            let sq = &part.sendq[part.st[i].queue as usize];
            (
                format!("send {rank}->{} ch{} {}", sq.peer, sq.ch, human(b)),
                b,
            )
        }
        k @ (RECV | RECV_REDUCE) => {
            let rq = &part.recvq[part.st[i].queue as usize];
            let what = if k == RECV_REDUCE {
                "recv+reduce"
            } else {
                "recv"
            };
            (
                format!("{what} {}->{rank} ch{} {}", rq.peer, rq.ch, human(b)),
                b,
            )
        }
        REDUCE => (format!("reduce {}", human(b)), 0),
        _ => (format!("copy {}", human(b)), 0),
    }
}

/// Bytes as `1.0 MiB`.
fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
