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
//! Steps run as the executor runs them, under the executor's own protocol: the numbers and
//! rules of its flow control come from [`oxccl_core::protocol`] (see *What comes from the
//! core* below):
//!
//! - The protocol's configuration is the runtime's: [`Geometry::config`] of the geometry the
//!   communicator would build (`slot_data` = the tuner's slice [`Tuning::chunk_bytes`], as
//!   the runtime sizes its slots by `OXCCL_CHUNK_SIZE`; [`Tuning::slots`] slots per queue),
//!   so a transfer of `b` bytes moves in [`Config::fragments`]`(b)` fragments of at most
//!   `slot_data` bytes (an empty transfer is one empty fragment), fragments up to
//!   [`INLINE`] bytes are copied into the staging region when posted, and a receiver returns
//!   a credit every [`Config::credit_every`] (`slots / 2`) fragments.
//! - Per (peer, channel) a rank's sends form one FIFO queue and its receives another, in step
//!   order. The `n`-th send from `a` to `b` on channel `c` is received by the `n`-th receive
//!   at `b` from `a` on `c`; their `k`-th fragments are the same bytes.
//! - A send starts when its dependencies are done and it is at the head of its queue. The
//!   rank *posts* its fragments one after another, each only while the receiver has a free
//!   slot as the sender knows it ([`Flow::free`]: fragments posted minus the receiver's last
//!   reported consumed count, below `slots`); a post takes `per_message_s` of the rank's time
//!   (`scaleup_per_message_s` to a rank of its own host), plus the copy of an inline
//!   fragment (`bytes / reduce_bytes_per_s`). Once the head's last fragment is posted, the
//!   next send of the queue may post.
//! - Each posted fragment leaves as one *flow* over `fabric.route(a, b, channel)` once the
//!   previous fragment of its queue has left (a queue is one connection: its fragments leave
//!   in order). The send is done when every fragment is posted and every signaled one (above
//!   [`INLINE`] bytes) has left the sender, its last byte on the wire (its completion; an
//!   inline fragment's is not awaited).
//! - A flow shares every link it crosses max-min fairly with the other flows (progressive
//!   filling, recomputed whenever flows start or end; see [`crate::engine`]). It occupies all
//!   its links from its start until its last byte leaves (a fluid model), and its last byte
//!   arrives the sum of the route's link latencies later.
//! - A receive at the head of its queue, its dependencies done, consumes its fragments in
//!   order as they arrive, each after its reduction (`bytes / reduce_bytes_per_s`) when it
//!   reduces (`reduce_with`); a plain receive costs nothing more (the data is written in
//!   place). It is done when its last fragment is consumed.
//! - Credits as the executor returns them: a receiver consumes what has arrived on a queue
//!   and then, if [`Flows::credit_due`] (`credit_every` fragments consumed since its last
//!   report), returns its consumed count: a small message back, which leaves once the
//!   receiver's thread has done the work that was ready when the credit became due (the
//!   executor returns credits at the end of its pass, after its posts and local steps) and
//!   arrives at the sender the reverse direction's per-message time (`per_message_s`, or
//!   `scaleup_per_message_s` inside a host: the one-way time of a small write) plus the
//!   latency of the reverse route later ([`Flows::credit`]: only then do its slots count as
//!   free). Its bytes and the post's own CPU time are not modelled. A credit that is not due
//!   at the end of the call stays owed, as in the executor; every queue starts empty (a
//!   fresh communicator's first call).
//! - The mailbox protocol where the runtime would use it: a rank whose schedule is
//!   [`mailbox_eligible`] (every peer it talks to on its own host, the runtime's shm links,
//!   one message each way of at most [`MAILBOX_DATA`] bytes) runs the call in mailbox mode:
//!   each message is one write (one post, plus its copy into the staging mailbox) that leaves
//!   as one flow, with no slots, no credits and no completion (the send is done when posted);
//!   steps run as their dependencies allow, a receive once its message has arrived. Both
//!   ends of a queue must agree (the runtime decides per rank; a rank in mailbox mode talking
//!   to one that is not would wait forever), else the simulation fails saying so.
//! - Local steps run when their dependencies are done: a reduce costs
//!   `bytes / reduce_bytes_per_s`, and so does a copy (a copy is memory bound like a
//!   reduction), except a copy between the same memory (skipped, as the executor skips it).
//! - A rank does one thing at a time: posting fragments, reductions and local steps take
//!   turns on its single thread in the order they became ready (zero-cost work never waits).
//! - The aggregator (a switch) reduces at its own rate and posts at no cost (hardware); it
//!   runs the same slots and credits.
//!
//! The collective's time is when the last rank's last step is done.
//!
//! # What comes from the core
//!
//! The configuration ([`Config`] through the runtime's [`Geometry`]: fragment count and
//! sizes, slots, the credit period, the inline threshold), each queue's flow-control state
//! ([`Flows`]: fragments posted, the credit the sender knows, the fragments arrived, consumed
//! and reported, changed by [`Flows::post`], [`Flows::credit`], [`Flows::arrived`],
//! [`Flows::consume`] and [`Flows::credit_sent`] as the executor's actions change them; the
//! window [`Flow::free`] and the credit rule [`Flows::credit_due`]), and which calls run in
//! mailboxes ([`mailbox_eligible`], [`MAILBOX_DATA`]). What the simulator does itself is the
//! walk of the schedule that [`oxccl_core::protocol::Machine`] does for the executor and the
//! verifier: which step is at the head of its queue, whether its dependencies are done,
//! which fragment is next. It does not drive `Machine` because a `Machine` walks its call in
//! *passes* over every queue and every pending local step of its rank (O(queues + local
//! steps) per pass, and here there would be one pass per event) over the full [`Schedule`]
//! (a heap vector of dependencies per step): a 16,384-rank 1 GiB all-reduce
//! (`examples/topologies/cluster-2048x8.toml`) keeps the 16.7 million steps of its 256
//! simulated ranks as one shared list of 65,532 16-byte records and a byte of state per step
//! and rank, and advances by events, where schedules and machines would take gigabytes and
//! a pass per event. The walk's rules are the `Machine`'s (queue
//! heads, dependencies, fragments in order, a receive done when its last fragment is
//! consumed, a send when every fragment is posted and every signaled one completed); the
//! time each action takes is the fabric's.
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
//! Costs: schedules are built on two threads and kept in a compact form: a `Shape` (one
//! 16-byte record per step, the steps' dependents in one list, the queues' first steps) that
//! every participant whose schedule differs only in its peers shares (all 256
//! representatives of the 16,384-rank all-reduces: one copy, which stays in the cache), and
//! per participant its queues, a byte per step counting the dependencies left and a bit per
//! step done. The event loop is sequential, and bound by the memory it touches: each
//! queue's cursor keeps what it needs of its step (`Cursor`), the queues follow links
//! between their steps instead of lists, and the timed events wait in a radix heap
//! (`crate::queue`: the run never schedules an event before the one it is serving, and the
//! symmetric runs have several events at each time).

use std::collections::{HashMap, VecDeque};

use oxccl_core::protocol::{Config, Flows, Geometry, MAILBOX_DATA, mailbox_eligible};
#[cfg(doc)]
use oxccl_core::protocol::{Flow, INLINE};
use oxccl_core::schedule::{Algorithm, Buf, Collective, Op, Region, Schedule, Step};
use oxccl_core::tuner::Tuning;

use crate::engine::Net;
use crate::queue::EventQueue;
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
    /// Flows simulated (one per fragment, or per mailbox message).
    pub flows: u64,
    /// Credits returned (receivers reporting their consumed count to their senders).
    pub credits: u64,
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
    // The mailbox protocol where the runtime would use it: every peer on the rank's own
    // host (the runtime's shm links; the aggregator is none).
    let host = |r: usize| match fabric.nodes[r].kind {
        NodeKind::Rank { host } => Some(host),
        NodeKind::Switch { .. } => None,
    };
    let mailbox = |r: usize, s: &Schedule| {
        r < world
            && mailbox_eligible(s, world, spec.elem_size, MAILBOX_DATA, |p| {
                p < world && host(p) == host(r)
            })
    };
    // Participants of the same shape share it (one copy per run).
    let shapes = Shapes::default();
    let compact = |r: usize, s: Schedule| {
        let mb = mailbox(r, &s);
        Part::new(r, s, spec, world, agg_node.is_some(), mb, &shapes)
    };

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
        let full_steps = reps[0].shape.st.len() as u128 * world as u128;
        first_len = Some(reps[0].shape.st.len());
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
        let s = oxccl_core::schedule::build_aggregator(&req0, 0)?;
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

/// A send queue of a participant. Its flow control (fragments posted, the credit it knows)
/// is its entry in [`Part::sends`].
#[derive(Debug)]
struct SendQ {
    peer: usize,
    ch: u8,
    /// The step being posted (`NONE` once all are) and its fragments posted so far.
    post: u32,
    post_frag: u32,
    /// The step being posted, as the run needs it (see [`Cursor`]).
    post_at: Cursor,
    /// A post is under way.
    posting: bool,
    /// The next fragment to leave (step, fragment), or the one leaving while `busy`: those
    /// from here up to `(post, post_frag)` are posted and wait for the connection (steps of
    /// a queue are in schedule order, so the pairs compare as positions).
    xmit: u32,
    xmit_frag: u32,
    xmit_at: Cursor,
    busy: bool,
    /// Its route (index into `Sim::route_list`).
    route: u32,
    /// The receiving participant and its receive queue, once known.
    target: Option<(u32, u32)>,
    /// Cost of posting one fragment (the network's or the host's).
    per_message_s: f64,
    /// A credit's time from the receiver back to this sender: the reverse direction's
    /// per-message time and the reverse route's latency.
    credit_delay: f64,
    /// Credits on their way back: the consumed counts they carry, oldest first.
    credits: VecDeque<u64>,
}

impl SendQ {
    /// The queue of the sends to `peer` on `ch`, before its first step is known.
    fn new(peer: usize, ch: u8) -> SendQ {
        SendQ {
            peer,
            ch,
            post: NONE,
            post_frag: 0,
            post_at: Cursor::default(),
            posting: false,
            xmit: NONE,
            xmit_frag: 0,
            xmit_at: Cursor::default(),
            busy: false,
            route: 0,
            target: None,
            per_message_s: 0.0,
            credit_delay: 0.0,
            credits: VecDeque::new(),
        }
    }
}

/// A receive queue. Its flow control (fragments arrived, consumed, reported) is its entry in
/// [`Part::recvs`].
#[derive(Debug)]
struct RecvQ {
    peer: usize,
    ch: u8,
    /// The receive at the head (`NONE` once all are done) and its fragments consumed so far.
    head: u32,
    head_frag: u32,
    head_at: Cursor,
    /// A fragment is being consumed (the thread reduces it).
    consuming: bool,
    /// The send queue (participant, queue) whose messages it receives: where its credits go.
    source: Option<(u32, u32)>,
}

impl RecvQ {
    /// The queue of the receives from `peer` on `ch`, before its first step is known.
    fn new(peer: usize, ch: u8) -> RecvQ {
        RecvQ {
            peer,
            ch,
            head: NONE,
            head_frag: 0,
            head_at: Cursor::default(),
            consuming: false,
            source: None,
        }
    }
}

/// What the run needs of the step a queue's cursor is on, read once when the cursor gets
/// there, so that the run touches a step's record only then and when the step is done (it
/// is bound by the memory it touches).
#[derive(Clone, Copy, Debug, Default)]
struct Cursor {
    /// Bytes of the transfer.
    bytes: usize,
    /// Its fragments.
    frags: u32,
    /// Its last signaled fragment (`NONE`: every fragment is inline, or a mailbox message).
    last_signaled: u32,
    /// The next step of the queue.
    next: u32,
    /// Its dependencies are done.
    ready: bool,
    /// A receive that reduces.
    reduces: bool,
}

const NO_Q: u32 = u32::MAX;
/// No step (the end of a queue).
const NONE: u32 = u32::MAX;

/// Step kinds.
const SEND: u8 = 0;
const RECV: u8 = 1;
const RECV_REDUCE: u8 = 2;
const COPY: u8 = 3;
const COPY_SKIPPED: u8 = 4;
const REDUCE: u8 = 5;

/// Fragments of a message of `bytes` (one in mailbox mode).
fn frags(cfg: &Config, mailbox: bool, bytes: usize) -> u32 {
    if mailbox {
        1
    } else {
        cfg.fragments(bytes) as u32
    }
}

/// Bytes of fragment `k` of a message of `bytes`.
fn frag_len(cfg: &Config, mailbox: bool, bytes: usize, k: u32) -> usize {
    if mailbox {
        bytes
    } else {
        cfg.fragment(bytes, k as usize).1
    }
}

/// The last fragment of a message of `bytes` whose completion its send awaits (`None`: every
/// fragment is inline). Only the last fragment can be shorter than the others, so it is the
/// last or the one before.
fn last_signaled(cfg: &Config, bytes: usize) -> Option<u32> {
    let n = cfg.fragments(bytes);
    (n.saturating_sub(2)..n)
        .rev()
        .find(|&k| cfg.fragment(bytes, k).1 > cfg.inline_max)
        .map(|k| k as u32)
}

/// A step in compact form, 16 bytes: what the run reads of it, never written during the
/// run (the mutable state, dependencies left and done, is the participant's: see [`Part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct St {
    /// Elements moved, reduced or copied (`u32::MAX`: more, in [`Shape::big`]).
    elems: u32,
    /// Its queue (send or receive; `NO_Q` for a local step).
    queue: u32,
    /// The next step of its queue (`NONE` for the last): the queues' cursors follow these,
    /// so that the run reads no list beside the steps.
    next: u32,
    /// The kind.
    kind: u8,
}

/// A schedule in compact form, as far as the run only reads it: the steps, their
/// dependents and the queues' first steps. Participants whose schedules differ only in
/// their peers (the same steps, kinds, sizes, queue numbers and dependencies) share one
/// ([`Shapes`]): every representative of the symmetric 16,384-rank all-reduces has the same
/// shape, so the run reads one copy of it (hot in the cache) instead of one per participant
/// (a quarter of a gigabyte, read from memory).
#[derive(Debug, PartialEq)]
struct Shape {
    /// A digest of the rest (its lengths and a sample of its steps), compared first.
    digest: u64,
    /// The steps.
    st: Vec<St>,
    /// Dependents of every step: step `s`'s are `dep_list[dep_at[s]..dep_at[s + 1]]`.
    dep_at: Vec<u32>,
    dep_list: Vec<u32>,
    /// Dependencies of every step, as its schedule lists them: step `s`'s are
    /// `deps[deps_at[s]..deps_at[s + 1]]` (to tell whether a schedule has this shape).
    deps_at: Vec<u32>,
    deps: Vec<u32>,
    /// Each step's dependencies, the count a run starts from (`u8::MAX`: that many or more,
    /// the count in [`Shape::many`]).
    ndeps: Vec<u8>,
    /// Dependency counts of steps waiting for `u8::MAX` or more, and element counts of
    /// steps of `u32::MAX` elements or more (rare: kept aside to keep the records small).
    many: Vec<(u32, u32)>,
    big: Vec<(u32, u64)>,
    /// Each send queue's and each receive queue's first step and number of steps.
    send_first: Vec<(u32, u32)>,
    recv_first: Vec<(u32, u32)>,
}

impl Shape {
    /// Elements of step `i`.
    fn elems(&self, i: usize) -> u64 {
        match self.st[i].elems {
            u32::MAX => {
                let at = self.big.partition_point(|x| (x.0 as usize) < i);
                self.big[at].1
            }
            e => e as u64,
        }
    }

    /// Bytes of step `i` on elements of `elem` bytes.
    fn bytes(&self, i: usize, elem: usize) -> usize {
        self.elems(i) as usize * elem
    }

    /// The steps of a queue that starts at `first`, in order.
    fn queue_steps(&self, first: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((first != NONE).then_some(first), |&s| {
            let n = self.st[s as usize].next;
            (n != NONE).then_some(n)
        })
    }
}

/// The shapes of a run's participants, each kept once (see [`Shape`]); filled by the
/// threads that build the schedules.
#[derive(Default)]
struct Shapes(std::sync::Mutex<Vec<std::sync::Arc<Shape>>>);

impl Shapes {
    /// The shapes kept most recently (at most 8), the latest first: those a schedule is
    /// compared with before it is made compact itself.
    fn recent(&self) -> Vec<std::sync::Arc<Shape>> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().rev().take(8).cloned().collect()
    }

    /// The shape equal to `s`, the one kept if there is one, else `s` (kept from now on).
    fn intern(&self, s: Shape) -> std::sync::Arc<Shape> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.iter().find(|k| ***k == s) {
            return k.clone();
        }
        let s = std::sync::Arc::new(s);
        kept.push(s.clone());
        s
    }
}

/// A participant's queues by (peer, channel). Looked up for every send and receive step
/// while its schedule is made compact: hashed as rustc hashes (a peer and a channel need no
/// protection against collisions chosen by an adversary).
type QueueIndex = rustc_hash::FxHashMap<(usize, u8), u32>;

/// A simulated participant (a rank or the aggregator): its schedule's [`Shape`] and the
/// run's state of it.
struct Part {
    rank: usize,
    node: usize,
    /// The schedule, shared with the participants of the same shape.
    shape: std::sync::Arc<Shape>,
    /// Dependencies not done yet of every step (`u8::MAX`: more, in [`Part::many`]): one
    /// byte each, 64 to a cache line, as a step done counts down its dependents far ahead.
    ndeps: Vec<u8>,
    many: HashMap<u32, u32>,
    /// Which steps are done, a bit each.
    done: Vec<u64>,
    sendq: Vec<SendQ>,
    recvq: Vec<RecvQ>,
    recv_index: QueueIndex,
    /// The core's flow-control state of every send queue and of every receive queue (one
    /// [`Flows`] queue each, indexed as `sendq` and `recvq`).
    sends: Flows,
    recvs: Flows,
    /// The call runs in mailbox mode ([`mailbox_eligible`]).
    mailbox: bool,
    begin: Vec<f64>,
    cpu_free: f64,
    reduce_rate: f64,
    /// Rate of the copies into the staging region (inline fragments, mailbox messages).
    copy_rate: f64,
    left: usize,
    done_at: f64,
}

/// One dependency of step `i` is done (`ndeps` and `many` as in [`Part`]): whether all
/// are now.
fn dep_done(ndeps: &mut [u8], many: &mut HashMap<u32, u32>, i: usize) -> bool {
    let n = &mut ndeps[i];
    if *n < u8::MAX {
        *n -= 1;
        return *n == 0;
    }
    let m = many.get_mut(&(i as u32)).expect("counted aside");
    *m -= 1;
    if *m < u8::MAX as u32 {
        *n = *m as u8;
        many.remove(&(i as u32));
    }
    false
}

impl Part {
    /// Whether step `i` is done.
    fn is_done(&self, i: usize) -> bool {
        self.done[i / 64] >> (i % 64) & 1 != 0
    }

    /// `sched` of `rank` in compact form: its shape, one of `shapes` when it has one of
    /// them (the schedule compared with it step by step), else made from the schedule and
    /// kept in `shapes`.
    fn new(
        rank: usize,
        sched: Schedule,
        spec: &Spec,
        world: usize,
        agg: bool,
        mailbox: bool,
        shapes: &Shapes,
    ) -> Result<Part, String> {
        let ctx = Ctx {
            rank,
            spec,
            world,
            agg,
        };
        let mut found = None;
        for shape in shapes.recent() {
            let mut named = Named::default();
            if shape.matches(&ctx, &sched, &mut named) {
                found = Some((shape, named));
                break;
            }
        }
        let (shape, mut named) = match found {
            Some(x) => x,
            None => {
                let mut named = Named::default();
                let shape = Shape::of(&ctx, &sched, &mut named)?;
                (shapes.intern(shape), named)
            }
        };
        drop(sched);
        // Put each queue's cursors on its first step.
        for (sq, &(first, _)) in named.sendq.iter_mut().zip(&shape.send_first) {
            sq.post = first;
            sq.xmit = first;
        }
        for (rq, &(first, _)) in named.recvq.iter_mut().zip(&shape.recv_first) {
            rq.head = first;
        }
        let n = shape.st.len();
        Ok(Part {
            rank,
            node: rank,
            ndeps: shape.ndeps.clone(),
            many: shape.many.iter().copied().collect(),
            done: vec![0; n.div_ceil(64)],
            shape,
            sends: Flows::new(named.sendq.len(), 1),
            recvs: Flows::new(named.recvq.len(), 1),
            sendq: named.sendq,
            recvq: named.recvq,
            recv_index: named.recv_index,
            mailbox,
            begin: if spec.trace {
                vec![f64::NAN; n]
            } else {
                Vec::new()
            },
            cpu_free: 0.0,
            reduce_rate: 0.0,
            copy_rate: f64::INFINITY,
            left: n,
            done_at: 0.0,
        })
    }
}

/// What making a schedule compact needs to know of its rank and the run.
struct Ctx<'a> {
    rank: usize,
    spec: &'a Spec,
    world: usize,
    /// The run has an aggregator (rank `world`).
    agg: bool,
}

/// A participant's queues, numbered in the order its schedule first names them (as its
/// shape numbers them).
#[derive(Default)]
struct Named {
    sendq: Vec<SendQ>,
    recvq: Vec<RecvQ>,
    send_index: QueueIndex,
    recv_index: QueueIndex,
}

impl Named {
    /// Step `s`'s record (with no next step yet) and its elements, its queue named (a new
    /// one when the step is the first to name it).
    fn step(&mut self, ctx: &Ctx<'_>, s: usize, step: &Step) -> Result<(St, u64), String> {
        let rank = ctx.rank;
        let bad_peer =
            |peer: usize| peer > ctx.world || peer == rank || (peer == ctx.world && !ctx.agg);
        let (kind, elems, queue) = match step.op {
            Op::Send { peer, channel, src } => {
                if bad_peer(peer) {
                    return Err(format!("rank {rank} step {s} sends to rank {peer}"));
                }
                let sendq = &mut self.sendq;
                let q = *self.send_index.entry((peer, channel)).or_insert_with(|| {
                    sendq.push(SendQ::new(peer, channel));
                    (sendq.len() - 1) as u32
                });
                (SEND, src.len, q)
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
                let recvq = &mut self.recvq;
                let q = *self.recv_index.entry((peer, channel)).or_insert_with(|| {
                    recvq.push(RecvQ::new(peer, channel));
                    (recvq.len() - 1) as u32
                });
                let kind = if reduce_with.is_some() {
                    RECV_REDUCE
                } else {
                    RECV
                };
                (kind, dst.len, q)
            }
            Op::Copy { src, dst } => {
                let spec = ctx.spec;
                let same = copy_skipped(&spec.coll, ctx.world, rank, spec.in_place, src, dst);
                (if same { COPY_SKIPPED } else { COPY }, src.len, NO_Q)
            }
            Op::Reduce { dst, .. } => (REDUCE, dst.len, NO_Q),
        };
        let st = St {
            elems: if elems >= u32::MAX as usize {
                u32::MAX
            } else {
                elems as u32
            },
            queue,
            next: NONE,
            kind,
        };
        Ok((st, elems as u64))
    }
}

impl Shape {
    /// The shape of `sched` (of `ctx.rank`), its queues named in `named`.
    fn of(ctx: &Ctx<'_>, sched: &Schedule, named: &mut Named) -> Result<Shape, String> {
        let rank = ctx.rank;
        let n = sched.steps.len();
        let mut ndeps = vec![0u8; n];
        let mut many = Vec::new();
        let mut count = vec![0u32; n + 1];
        let mut deps_at = Vec::with_capacity(n + 1);
        let mut deps = Vec::new();
        deps_at.push(0);
        for (s, step) in sched.steps.iter().enumerate() {
            let k = step.deps.len();
            if k >= u8::MAX as usize {
                ndeps[s] = u8::MAX;
                many.push((s as u32, k as u32));
            } else {
                ndeps[s] = k as u8;
            }
            for &d in &step.deps {
                if d as usize >= s {
                    return Err(format!("rank {rank} step {s} depends on a later step {d}"));
                }
                count[d as usize + 1] += 1;
            }
            deps.extend_from_slice(&step.deps);
            deps_at.push(deps.len() as u32);
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
        drop(fill);
        let mut st = Vec::with_capacity(n);
        let mut big = Vec::new();
        // Each queue's first step and number of steps, and its last step so far.
        let mut send_first: Vec<(u32, u32)> = Vec::new();
        let mut recv_first: Vec<(u32, u32)> = Vec::new();
        let mut send_last: Vec<u32> = Vec::new();
        let mut recv_last: Vec<u32> = Vec::new();
        for (s, step) in sched.steps.iter().enumerate() {
            let (rec, elems) = named.step(ctx, s, step)?;
            if rec.elems == u32::MAX {
                big.push((s as u32, elems));
            }
            st.push(rec);
            let (first, last) = match rec.kind {
                SEND => (&mut send_first, &mut send_last),
                RECV | RECV_REDUCE => (&mut recv_first, &mut recv_last),
                _ => continue,
            };
            let q = rec.queue as usize;
            if q == first.len() {
                first.push((s as u32, 0));
                last.push(NONE);
            }
            if last[q] != NONE {
                st[last[q] as usize].next = s as u32;
            }
            last[q] = s as u32;
            first[q].1 += 1;
        }
        Ok(Shape {
            digest: digest(&st, &dep_list),
            st,
            dep_at,
            dep_list,
            deps_at,
            deps,
            ndeps,
            many,
            big,
            send_first,
            recv_first,
        })
    }

    /// Whether `sched` (of `ctx.rank`) has this shape, its queues named in `named` (some
    /// of them when it has not; a schedule that fails a check has not, and the error comes
    /// from [`Shape::of`]).
    fn matches(&self, ctx: &Ctx<'_>, sched: &Schedule, named: &mut Named) -> bool {
        if sched.steps.len() != self.st.len() {
            return false;
        }
        for (s, step) in sched.steps.iter().enumerate() {
            let Ok((rec, elems)) = named.step(ctx, s, step) else {
                return false;
            };
            let want = self.st[s];
            let deps = &self.deps[self.deps_at[s] as usize..self.deps_at[s + 1] as usize];
            // The lists compared element by element: they are short, and a slice compare
            // calls memcmp (which took the time of the rest of the check together).
            if (rec.kind, rec.elems, rec.queue) != (want.kind, want.elems, want.queue)
                || (rec.elems == u32::MAX && self.elems(s) != elems)
                || step.deps.len() != deps.len()
                || step.deps.iter().zip(deps).any(|(a, b)| a != b)
            {
                return false;
            }
        }
        named.sendq.len() == self.send_first.len() && named.recvq.len() == self.recv_first.len()
    }
}

/// A digest of a shape's steps and dependents: their numbers and 64 steps evenly spread
/// (FNV-1a), enough to tell most different shapes apart before comparing them whole.
fn digest(st: &[St], dep_list: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    eat(st.len() as u64);
    eat(dep_list.len() as u64);
    let n = st.len();
    for k in 0..64.min(n) {
        let s = st[k * n / 64.min(n)];
        eat(s.elems as u64 | (s.queue as u64) << 32);
        eat(s.next as u64 | (s.kind as u64) << 32);
    }
    h
}

/// Something that happens to a participant (`p`): timed in the event queue, or due now in
/// the work list.
#[derive(Clone, Copy, Debug)]
enum Ev {
    /// The thread finished posting a fragment of send queue `q`: `Posted(p, q)`.
    Posted(u32, u32),
    /// The thread finished consuming a fragment of receive queue `rq`.
    Consumed(u32, u32),
    /// The thread finished local step `s`.
    LocalDone(u32, u32),
    /// The fragment leaving send queue `q` has left (a fragment without a flow, no bytes or
    /// no link, leaves at once).
    Drained(u32, u32),
    /// A fragment arrived at receive queue `rq`.
    Arrive(u32, u32),
    /// A credit arrived at send queue `q`.
    Credit(u32, u32),
    /// Step `s`'s dependencies are done.
    DepsDone(u32, u32),
    /// Receive queue `rq` returns the credit it owes, if it still does.
    ReturnCredit(u32, u32),
}

impl Ev {
    fn pack(self) -> u64 {
        let (k, p, s) = match self {
            Ev::Posted(p, s) => (0u64, p, s),
            Ev::Consumed(p, s) => (1, p, s),
            Ev::LocalDone(p, s) => (2, p, s),
            Ev::Drained(p, s) => (3, p, s),
            Ev::Arrive(p, s) => (4, p, s),
            Ev::Credit(p, s) => (5, p, s),
            Ev::DepsDone(p, s) => (6, p, s),
            Ev::ReturnCredit(p, s) => (7, p, s),
        };
        debug_assert!(p < 1 << 29);
        k << 61 | (p as u64) << 32 | s as u64
    }

    fn unpack(x: u64) -> Ev {
        let (p, s) = (((x >> 32) & 0x1fff_ffff) as u32, x as u32);
        match x >> 61 {
            0 => Ev::Posted(p, s),
            1 => Ev::Consumed(p, s),
            2 => Ev::LocalDone(p, s),
            3 => Ev::Drained(p, s),
            4 => Ev::Arrive(p, s),
            5 => Ev::Credit(p, s),
            6 => Ev::DepsDone(p, s),
            _ => Ev::ReturnCredit(p, s),
        }
    }
}

/// A route, as classes and weights, and its latency.
struct Route {
    path: Vec<(u32, f64)>,
    latency: f64,
}

struct Sim<'a> {
    fabric: &'a Fabric,
    elem: usize,
    /// The protocol's configuration (the runtime's [`Geometry::config`]).
    cfg: Config,
    trace: bool,
    parts: Vec<Part>,
    /// Each rank's participant (`u32::MAX` for a rank that is not simulated); the aggregator
    /// is rank `world`.
    part_of: Vec<u32>,
    ranks: Cycles,
    links: Cycles,
    net: Net,
    /// The timed events: the bits of their times (never negative, so the bits order as
    /// the times do) and the packed events ([`Ev::pack`]: kind, participant and step or
    /// queue break ties, deterministically).
    events_at: EventQueue,
    now: f64,
    work: VecDeque<Ev>,
    route_list: Vec<Route>,
    /// Per flow: (participant, send queue).
    flow_info: Vec<(u32, u32)>,
    /// The last message size [`Sim::slot_sizes`] was asked, and its answer.
    last_size: std::cell::Cell<(usize, u32, u32)>,
    flows: u64,
    credits: u64,
    events: Vec<crate::Event>,
}

/// The protocol configuration the runtime would run `tuning` with on elements of `esize`
/// bytes: its [`Geometry`] has slots of the tuner's slice (the communicator sizes both by
/// `OXCCL_CHUNK_SIZE`, and hands the tuner its slot size), [`Tuning::slots`] of them per
/// queue and [`Tuning::channels`] channels.
pub fn protocol_config(tuning: &Tuning, esize: usize) -> Config {
    Geometry {
        slot_data: tuning.chunk_bytes,
        slots: tuning.slots,
        channels: tuning.channels,
    }
    .config(esize)
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
        let mut part_of = vec![u32::MAX; world + 1];
        let mut routes: HashMap<(usize, usize, u8), u32> = HashMap::new();
        let mut route_list: Vec<Route> = Vec::new();
        let mut scratch = Vec::new();
        let node_of = |r: usize| if r == world { agg_node } else { Some(r) };
        let host_of = |n: usize| match fabric.nodes[n].kind {
            NodeKind::Rank { host } => Some(host),
            NodeKind::Switch { .. } => None,
        };
        // The per-message time of a message from node `from` to node `to` (the aggregator
        // posts at no cost).
        let message_s = |from: usize, to: usize| {
            if agg_node == Some(from) {
                0.0
            } else if host_of(from).is_some() && host_of(from) == host_of(to) {
                fabric.scaleup_per_message_s
            } else {
                fabric.per_message_s
            }
        };
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
            } else {
                part.node = part.rank;
                part.reduce_rate = fabric.reduce_bytes_per_s;
                part.copy_rate = fabric.reduce_bytes_per_s;
            }
            // The flow stands for the orbit of its sender: m flows.
            let m = if part.rank < world {
                ranks.len_of(part.rank) as f64
            } else {
                1.0
            };
            for sq in &mut part.sendq {
                let (from, to) = (part.node, node_of(sq.peer).expect("checked"));
                sq.per_message_s = message_s(from, to);
                scratch.clear();
                fabric.route(to, from, sq.ch as u64, &mut scratch);
                sq.credit_delay = message_s(to, from)
                    + scratch
                        .iter()
                        .map(|&l| fabric.links[l].latency_s)
                        .sum::<f64>();
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
            cfg: protocol_config(tuning, spec.elem_size),
            trace: spec.trace,
            parts,
            part_of,
            ranks,
            links,
            net: Net::new(&caps, spec.trace),
            events_at: EventQueue::new(),
            now: 0.0,
            work: VecDeque::new(),
            route_list,
            flow_info: Vec::new(),
            last_size: std::cell::Cell::new((usize::MAX, 0, 0)),
            flows: 0,
            credits: 0,
            events: Vec::new(),
        })
    }

    fn push(&mut self, t: f64, ev: Ev) {
        debug_assert!(t >= 0.0);
        self.events_at.push((t + 0.0).to_bits(), ev.pack());
    }

    /// Connects every send queue with the receive queue it feeds (and back, for the
    /// credits), and checks that they agree: the receiver expects at least as many messages,
    /// each of the same size, and both ends run the same protocol.
    fn connect(&mut self) -> Result<(), String> {
        for p in 0..self.parts.len() {
            for q in 0..self.parts[p].sendq.len() {
                let (tp, rq) = self.target(p as u32, q as u32)?;
                let (sender, receiver) = (&self.parts[p], &self.parts[tp as usize]);
                let (sq, r) = (&sender.sendq[q], &receiver.recvq[rq as usize]);
                if r.source.is_some_and(|x| x != (p as u32, q as u32)) {
                    return Err(format!(
                        "two send queues feed rank {}'s receive queue {rq}",
                        receiver.rank
                    ));
                }
                let (a0, na) = sender.shape.send_first[q];
                let (b0, nb) = receiver.shape.recv_first[rq as usize];
                if na > nb {
                    return Err(format!(
                        "rank {} sends {na} messages to rank {} on channel {}, which receives \
                         only {nb}",
                        sender.rank, sq.peer, sq.ch,
                    ));
                }
                let (sa, sb) = (&sender.shape, &receiver.shape);
                for (n, (a, b)) in sa.queue_steps(a0).zip(sb.queue_steps(b0)).enumerate() {
                    let (ea, eb) = (sa.elems(a as usize), sb.elems(b as usize));
                    if ea != eb {
                        return Err(format!(
                            "rank {} sends {ea} elements to rank {} (message {n}), which \
                             receives {eb}",
                            sender.rank, receiver.rank
                        ));
                    }
                }
                if sender.mailbox != receiver.mailbox {
                    let mode = |m: bool| if m { "mailboxes" } else { "slots" };
                    return Err(format!(
                        "rank {} sends to rank {} in {}, which receives in {}: the runtime \
                         decides the mailbox mode per rank, and this pair would wait forever",
                        sender.rank,
                        receiver.rank,
                        mode(sender.mailbox),
                        mode(receiver.mailbox)
                    ));
                }
                self.parts[tp as usize].recvq[rq as usize].source = Some((p as u32, q as u32));
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), String> {
        self.connect()?;
        // The run follows the steps' links from every queue's first step.
        for p in 0..self.parts.len() {
            for q in 0..self.parts[p].sendq.len() {
                self.load_post(p as u32, q as u32);
                self.load_xmit(p as u32, q as u32);
            }
            for rq in 0..self.parts[p].recvq.len() {
                self.load_head(p as u32, rq as u32);
            }
        }
        for p in 0..self.parts.len() {
            for s in 0..self.parts[p].ndeps.len() {
                if self.parts[p].ndeps[s] == 0 {
                    self.work.push_back(Ev::DepsDone(p as u32, s as u32));
                }
            }
        }
        self.drain_work();
        self.net.settle(self.now);
        loop {
            let next_ev = self.events_at.peek_time().map(f64::from_bits);
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
                if self
                    .events_at
                    .peek_time()
                    .is_some_and(|e| f64::from_bits(e) == t)
                {
                    let (_, ev) = self.events_at.pop().expect("peeked");
                    self.work.push_back(Ev::unpack(ev));
                    self.drain_work();
                } else if let Some((d, f)) = self.net.next_drain()
                    && d == t
                {
                    self.net.remove(t, f);
                    let (p, q) = self.flow_info[f as usize];
                    self.work.push_back(Ev::Drained(p, q));
                    self.drain_work();
                } else {
                    break;
                }
            }
            self.net.settle(t);
        }
        for p in &self.parts {
            if p.left > 0 {
                return Err(self.stuck(p));
            }
        }
        Ok(())
    }

    /// What a participant that did not finish waits for.
    fn stuck(&self, p: &Part) -> String {
        let st = &p.shape.st;
        let s = (0..st.len()).find(|&s| !p.is_done(s)).unwrap_or(0);
        let what = match st[s].queue {
            NO_Q => "a local step".to_string(),
            q if st[s].kind == SEND => {
                let f = p.sends.get(q as usize);
                format!(
                    "a send to rank {} on channel {} ({} fragments posted there, {} reported \
                     consumed)",
                    p.sendq[q as usize].peer, p.sendq[q as usize].ch, f.posted, f.credit
                )
            }
            q => format!(
                "a receive from rank {} on channel {}",
                p.recvq[q as usize].peer, p.recvq[q as usize].ch
            ),
        };
        format!(
            "deadlock: rank {} has {} steps left; the first not done is step {s}, {what}",
            p.rank, p.left
        )
    }

    fn drain_work(&mut self) {
        while let Some(ev) = self.work.pop_front() {
            match ev {
                Ev::Posted(p, q) => self.posted(p, q),
                Ev::Consumed(p, rq) => self.consumed(p, rq),
                Ev::LocalDone(p, s) => self.step_done(p, s),
                Ev::Drained(p, q) => self.drained(p, q),
                Ev::Arrive(p, rq) => self.arrive(p, rq),
                Ev::Credit(p, q) => self.credit_arrived(p, q),
                Ev::DepsDone(p, s) => self.deps_done(p, s),
                Ev::ReturnCredit(p, rq) => self.return_credit(p, rq),
            }
        }
    }

    /// The fragments of a message of `bytes` in slots, and its last signaled fragment
    /// (`NONE`: every fragment is inline), remembered for the last size asked (the steps of
    /// a schedule come in few sizes, and each would take two divisions).
    fn slot_sizes(&self, bytes: usize) -> (u32, u32) {
        let (b, f, l) = self.last_size.get();
        if b == bytes {
            return (f, l);
        }
        let f = frags(&self.cfg, false, bytes);
        let l = last_signaled(&self.cfg, bytes).unwrap_or(NONE);
        self.last_size.set((bytes, f, l));
        (f, l)
    }

    /// What the run needs of step `s` of `p` (see [`Cursor`]).
    fn cursor(&self, p: u32, s: u32) -> Cursor {
        if s == NONE {
            return Cursor {
                next: NONE,
                last_signaled: NONE,
                ..Cursor::default()
            };
        }
        let part = &self.parts[p as usize];
        let i = s as usize;
        let bytes = part.shape.bytes(i, self.elem);
        let st = part.shape.st[i];
        let (frags, signaled) = if part.mailbox {
            (1, NONE)
        } else {
            self.slot_sizes(bytes)
        };
        Cursor {
            bytes,
            frags,
            last_signaled: if st.kind == SEND { signaled } else { NONE },
            next: st.next,
            ready: part.ndeps[i] == 0,
            reduces: st.kind == RECV_REDUCE,
        }
    }

    fn load_post(&mut self, p: u32, q: u32) {
        let s = self.parts[p as usize].sendq[q as usize].post;
        let c = self.cursor(p, s);
        self.parts[p as usize].sendq[q as usize].post_at = c;
    }

    fn load_xmit(&mut self, p: u32, q: u32) {
        let s = self.parts[p as usize].sendq[q as usize].xmit;
        let c = self.cursor(p, s);
        self.parts[p as usize].sendq[q as usize].xmit_at = c;
    }

    fn load_head(&mut self, p: u32, rq: u32) {
        let s = self.parts[p as usize].recvq[rq as usize].head;
        let c = self.cursor(p, s);
        self.parts[p as usize].recvq[rq as usize].head_at = c;
    }

    fn deps_done(&mut self, p: u32, s: u32) {
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        let St { queue: q, kind, .. } = part.shape.st[i];
        match kind {
            SEND => {
                let sq = &mut part.sendq[q as usize];
                if sq.post == s {
                    sq.post_at.ready = true;
                    self.try_post(p, q);
                }
            }
            RECV | RECV_REDUCE => {
                let r = &mut part.recvq[q as usize];
                if r.head == s {
                    r.head_at.ready = true;
                    self.try_recv(p, q);
                }
            }
            k => {
                if self.trace {
                    part.begin[i] = self.now;
                }
                let cost = if k == COPY_SKIPPED {
                    0.0
                } else {
                    part.shape.bytes(i, self.elem) as f64 / part.reduce_rate
                };
                self.cpu(p, cost, Ev::LocalDone(p, s));
            }
        }
    }

    /// Runs `cost` seconds of `p`'s thread, after what it is busy with, then `done`.
    fn cpu(&mut self, p: u32, cost: f64, done: Ev) {
        if cost <= 0.0 {
            self.work.push_back(done);
            return;
        }
        let part = &mut self.parts[p as usize];
        let start = part.cpu_free.max(self.now);
        let end = start + cost;
        part.cpu_free = end;
        self.push(end, done);
    }

    /// Posts the next fragment of send queue `q` of `p`, if its head may post and the
    /// receiver has a free slot.
    fn try_post(&mut self, p: u32, q: u32) {
        let cfg = self.cfg;
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        let s = sq.post;
        if sq.posting || s == NONE || !sq.post_at.ready {
            return;
        }
        if self.trace && part.begin[s as usize].is_nan() {
            part.begin[s as usize] = self.now;
        }
        let bytes = sq.post_at.bytes;
        let cost = if part.mailbox {
            // One write of the message (and one of its stamp), copied into the staging
            // mailbox first.
            sq.per_message_s + bytes as f64 / part.copy_rate
        } else {
            if part.sends.get(q as usize).free(cfg.slots) == 0 {
                return;
            }
            part.sends.post(q as usize, cfg.slots);
            let len = cfg.fragment(bytes, sq.post_frag as usize).1;
            let staged = if len <= cfg.inline_max {
                len as f64 / part.copy_rate
            } else {
                0.0
            };
            sq.per_message_s + staged
        };
        sq.posting = true;
        self.cpu(p, cost, Ev::Posted(p, q));
    }

    /// A fragment of send queue `q` of `p` is posted: it may leave, the queue may post the
    /// next, and the send is done once all are posted and its signaled ones have left.
    fn posted(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        sq.posting = false;
        sq.post_frag += 1;
        if sq.post_frag == sq.post_at.frags {
            let s = sq.post;
            // Its completions came if the connection is past its last signaled fragment
            // (none for a mailbox message or inline fragments).
            let sig = sq.post_at.last_signaled;
            let done = sig == NONE || (sq.xmit, sq.xmit_frag) > (s, sig);
            sq.post = sq.post_at.next;
            sq.post_frag = 0;
            self.load_post(p, q);
            if done {
                self.step_done(p, s);
            }
        }
        self.try_xmit(p, q);
        self.try_post(p, q);
    }

    /// Starts the next posted fragment of send queue `q` of `p` on its connection, if it is
    /// free.
    fn try_xmit(&mut self, p: u32, q: u32) {
        let cfg = self.cfg;
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        if sq.busy || (sq.xmit, sq.xmit_frag) >= (sq.post, sq.post_frag) {
            return;
        }
        let len = frag_len(&cfg, part.mailbox, sq.xmit_at.bytes, sq.xmit_frag);
        sq.busy = true;
        let r = sq.route as usize;
        self.flows += 1;
        if len == 0 || self.route_list[r].path.is_empty() {
            self.work.push_back(Ev::Drained(p, q));
            return;
        }
        let f = self.net.add(self.now, &self.route_list[r].path, len as f64);
        if self.flow_info.len() <= f as usize {
            self.flow_info.resize(f as usize + 1, (0, 0));
        }
        self.flow_info[f as usize] = (p, q);
    }

    /// The fragment leaving send queue `q` of `p` has left: the queue's next may leave, its
    /// data arrives after the route's latency at the receive queue it feeds, and its
    /// completion may finish its send.
    fn drained(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        let (s, k) = (sq.xmit, sq.xmit_frag);
        let sig = sq.xmit_at.last_signaled;
        sq.busy = false;
        sq.xmit_frag += 1;
        let latency = self.route_list[sq.route as usize].latency;
        let (tp, rq) = sq.target.expect("connected");
        // Its last signaled fragment completed: done if every fragment is posted too.
        let done = k == sig && sq.post != s;
        if sq.xmit_frag == sq.xmit_at.frags {
            sq.xmit = sq.xmit_at.next;
            sq.xmit_frag = 0;
            self.load_xmit(p, q);
        }
        if done {
            self.step_done(p, s);
        }
        self.push(self.now + latency, Ev::Arrive(tp, rq));
        self.try_xmit(p, q);
    }

    /// A fragment arrived at receive queue `rq` of `p`.
    fn arrive(&mut self, p: u32, rq: u32) {
        let slots = self.cfg.slots as u64;
        let part = &mut self.parts[p as usize];
        let f = part.recvs.get(rq as usize);
        let slot = if part.mailbox {
            0
        } else {
            ((f.consumed + f.arrived.len() as u64) % slots) as u32
        };
        part.recvs.arrived(rq as usize, slot);
        self.try_recv(p, rq);
    }

    /// Consumes the next fragment of receive queue `rq` of `p`, if its head may receive and
    /// the fragment has arrived.
    fn try_recv(&mut self, p: u32, rq: u32) {
        let cfg = self.cfg;
        let part = &mut self.parts[p as usize];
        let r = &mut part.recvq[rq as usize];
        let s = r.head;
        if r.consuming || s == NONE || !r.head_at.ready {
            return;
        }
        if self.trace && part.begin[s as usize].is_nan() {
            // The span starts when it could first consume.
            part.begin[s as usize] = self.now;
        }
        if part.recvs.get(rq as usize).arrived.is_empty() {
            return;
        }
        r.consuming = true;
        let cost = if r.head_at.reduces {
            frag_len(&cfg, part.mailbox, r.head_at.bytes, r.head_frag) as f64 / part.reduce_rate
        } else {
            0.0
        };
        self.cpu(p, cost, Ev::Consumed(p, rq));
    }

    /// A fragment of receive queue `rq` of `p` is consumed: the receive is done after its
    /// last; the queue goes on with what has arrived, and then returns the credit due.
    fn consumed(&mut self, p: u32, rq: u32) {
        let every = self.cfg.credit_every;
        let part = &mut self.parts[p as usize];
        let r = &mut part.recvq[rq as usize];
        r.consuming = false;
        part.recvs.consume(rq as usize);
        r.head_frag += 1;
        if r.head_frag == r.head_at.frags {
            let s = r.head;
            r.head = r.head_at.next;
            r.head_frag = 0;
            self.load_head(p, rq);
            self.step_done(p, s);
        }
        // The executor consumes what has arrived, then returns the credit due (after the
        // posts and local steps of its pass: queued behind the work the step's end made
        // ready).
        let part = &self.parts[p as usize];
        let head = part.recvq[rq as usize].head;
        let more = head != NONE
            && part.ndeps[head as usize] == 0
            && !part.recvs.get(rq as usize).arrived.is_empty();
        if !part.mailbox && !more && part.recvs.credit_due(rq as usize, every) {
            self.work.push_back(Ev::ReturnCredit(p, rq));
        }
        self.try_recv(p, rq);
    }

    /// Returns the credit receive queue `rq` of `p` owes its sender, if it still owes one:
    /// its consumed count, which leaves when the thread is free and arrives after the
    /// queue's credit delay.
    fn return_credit(&mut self, p: u32, rq: u32) {
        let every = self.cfg.credit_every;
        let part = &mut self.parts[p as usize];
        let q = rq as usize;
        if !part.recvs.credit_due(q, every) {
            return;
        }
        let consumed = part.recvs.get(q).consumed;
        part.recvs.credit_sent(q, consumed);
        let leaves = self.now.max(part.cpu_free);
        let (sp, sq) = part.recvq[q].source.expect("connected");
        let send = &mut self.parts[sp as usize].sendq[sq as usize];
        send.credits.push_back(consumed);
        let at = leaves + send.credit_delay;
        self.credits += 1;
        self.push(at, Ev::Credit(sp, sq));
    }

    /// A credit arrived at send queue `q` of `p`: its slots are free.
    fn credit_arrived(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let consumed = part.sendq[q as usize]
            .credits
            .pop_front()
            .expect("a credit on its way");
        part.sends.credit(q as usize, consumed);
        self.try_post(p, q);
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

    fn step_done(&mut self, p: u32, s: u32) {
        let now = self.now;
        let part = &mut self.parts[p as usize];
        let i = s as usize;
        part.done[i / 64] |= 1 << (i % 64);
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
        let Part {
            shape, ndeps, many, ..
        } = part;
        let (a, b) = (shape.dep_at[i] as usize, shape.dep_at[i + 1] as usize);
        for &d in &shape.dep_list[a..b] {
            if dep_done(ndeps, many, d as usize) {
                self.work.push_back(Ev::DepsDone(p, d));
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
            steps: self.parts.iter().map(|p| p.ndeps.len() as u64).sum(),
            flows: self.flows,
            credits: self.credits,
        }
    }
}

/// A step's trace name and bytes.
fn step_name(part: &Part, i: usize, elem: usize) -> (String, u64) {
    let rank = part.rank;
    let b = part.shape.elems(i) * elem as u64;
    let st = part.shape.st[i];
    match st.kind {
        SEND => {
            let sq = &part.sendq[st.queue as usize];
            (
                format!("send {rank}->{} ch{} {}", sq.peer, sq.ch, human(b)),
                b,
            )
        }
        k @ (RECV | RECV_REDUCE) => {
            let rq = &part.recvq[st.queue as usize];
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

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_core::schedule::Step;

    fn send(peer: usize, len: usize, deps: &[u32]) -> Step {
        Step {
            op: Op::Send {
                peer,
                channel: 0,
                src: Region::new(Buf::Input, 0, len),
            },
            deps: deps.to_vec(),
        }
    }

    fn recv(peer: usize, len: usize, deps: &[u32]) -> Step {
        Step {
            op: Op::Recv {
                peer,
                channel: 0,
                dst: Region::new(Buf::Output, 0, len),
                reduce_with: Some(Region::new(Buf::Input, 0, len)),
            },
            deps: deps.to_vec(),
        }
    }

    fn sched(rank: usize, steps: Vec<Step>) -> Schedule {
        Schedule {
            rank,
            steps,
            scratch: 0,
        }
    }

    fn part(rank: usize, steps: Vec<Step>, shapes: &Shapes) -> Part {
        let spec = Spec::new(Collective::AllReduce { count: 1 }, 4);
        Part::new(rank, sched(rank, steps), &spec, 4, false, false, shapes).unwrap()
    }

    /// Ranks whose schedules differ only in their peers share one shape; their queues keep
    /// their own peers, and their dependency counts are their own.
    #[test]
    fn schedules_that_differ_in_peers_share_a_shape() {
        let shapes = Shapes::default();
        let ring = |r: usize| {
            let (next, prev) = ((r + 1) % 4, (r + 3) % 4);
            vec![
                send(next, 10, &[]),
                recv(prev, 10, &[]),
                send(next, 10, &[1]),
                recv(prev, 10, &[0, 1]),
            ]
        };
        let mut a = part(0, ring(0), &shapes);
        let b = part(1, ring(1), &shapes);
        assert!(std::sync::Arc::ptr_eq(&a.shape, &b.shape));
        assert_eq!((a.sendq[0].peer, b.sendq[0].peer), (1, 2));
        assert_eq!((a.recvq[0].peer, b.recvq[0].peer), (3, 0));
        let sh = &a.shape;
        assert_eq!(sh.send_first, vec![(0, 2)]);
        assert_eq!(sh.recv_first, vec![(1, 2)]);
        assert_eq!(sh.queue_steps(0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(sh.queue_steps(1).collect::<Vec<_>>(), vec![1, 3]);
        // Step 1's dependents are steps 2 and 3, step 0's step 3.
        let dependents = |s: usize| &sh.dep_list[sh.dep_at[s] as usize..sh.dep_at[s + 1] as usize];
        assert_eq!((dependents(0), dependents(1)), (&[3][..], &[2, 3][..]));
        assert_eq!(a.ndeps, vec![0, 0, 1, 2]);
        assert!(!dep_done(&mut a.ndeps, &mut a.many, 3));
        assert!(dep_done(&mut a.ndeps, &mut a.many, 3));
        assert_eq!((a.ndeps[3], b.ndeps[3]), (0, 2));
        // Another size, another dependency, another order of the queues: other shapes.
        let mut other = ring(2);
        other[2] = send(3, 11, &[1]);
        let c = part(2, other, &shapes);
        let mut other = ring(2);
        other[3].deps = vec![1];
        let d = part(2, other, &shapes);
        let mut other = ring(3);
        other.swap(0, 1);
        let e = part(3, other, &shapes);
        for x in [&c, &d, &e] {
            assert!(!std::sync::Arc::ptr_eq(&a.shape, &x.shape));
        }
        assert_eq!(shapes.0.lock().unwrap().len(), 4);
    }

    /// A schedule that fails a check fails it the same way whether or not a shape it
    /// nearly has was kept before.
    #[test]
    fn a_bad_schedule_fails_alike_with_or_without_shapes() {
        let spec = Spec::new(Collective::AllReduce { count: 1 }, 4);
        let ok = vec![send(1, 10, &[]), recv(3, 10, &[]), send(1, 10, &[1])];
        let bad_peer = vec![send(1, 10, &[]), recv(3, 10, &[]), send(0, 10, &[1])];
        let bad_dep = vec![send(1, 10, &[]), recv(3, 10, &[2]), send(1, 10, &[1])];
        for bad in [bad_peer, bad_dep] {
            let kept = Shapes::default();
            part(0, ok.clone(), &kept);
            let with = Part::new(0, sched(0, bad.clone()), &spec, 4, false, false, &kept);
            let without = Part::new(0, sched(0, bad), &spec, 4, false, false, &Shapes::default());
            let (with, without) = (with.err().unwrap(), without.err().unwrap());
            assert_eq!(with, without);
        }
    }

    /// Steps of `u32::MAX` elements or more, and steps waiting for `u8::MAX` dependencies or
    /// more, are counted aside, and counted down exactly.
    #[test]
    fn big_steps_and_many_dependencies_are_kept_aside() {
        let shapes = Shapes::default();
        let big = 5_000_000_000usize;
        let mut steps = vec![send(1, big, &[])];
        let n = 300u32;
        for _ in 0..n {
            steps.push(send(1, 7, &[]));
        }
        let all: Vec<u32> = (1..=n).collect();
        steps.push(Step {
            op: Op::Copy {
                src: Region::new(Buf::Input, 0, 5),
                dst: Region::new(Buf::Output, 0, 5),
            },
            deps: all,
        });
        let mut p = part(0, steps, &shapes);
        let last = n as usize + 1;
        assert_eq!(p.shape.elems(0), big as u64);
        assert_eq!(p.shape.bytes(0, 4), big * 4);
        assert_eq!(p.shape.elems(1), 7);
        assert_eq!(p.shape.elems(last), 5);
        assert_eq!(p.ndeps[last], u8::MAX);
        for k in 0..n {
            let all_done = dep_done(&mut p.ndeps, &mut p.many, last);
            assert_eq!(all_done, k + 1 == n, "after {}", k + 1);
        }
        assert!(p.many.is_empty());
        assert_eq!(p.shape.send_first, vec![(0, n + 1)]);
        assert_eq!(p.shape.queue_steps(0).count(), n as usize + 1);
    }
}
