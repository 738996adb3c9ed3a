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
//!   [`mailbox_eligible`] (every peer it talks to a rank, on its host or another: the runtime
//!   stores into shm mailboxes and writes the others; one message each way of at most
//!   [`MAILBOX_DATA`] bytes) runs the call in mailbox mode:
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

use oxccl_core::protocol::{Config, Geometry, MAILBOX_DATA, mailbox_eligible};
#[cfg(doc)]
use oxccl_core::protocol::{Flow, INLINE};
use oxccl_core::schedule::{Algorithm, Buf, Collective, Region, Schedule};
use oxccl_core::tuner::Tuning;

use crate::engine::Net;
use crate::queue::EventQueue;
use crate::sym::{self, Cycles};
use crate::{Fabric, NodeKind};

mod part;
mod sim;
#[cfg(test)]
mod tests;

use part::*;
use sim::*;

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
    // (On a fabric that `Fabric::validate` refuses, links to missing nodes and ranks on
    // missing hosts are left out rather than indexed.)
    let hosts = fabric.hosts.len();
    let mut owner = vec![NONE; fabric.nodes.len()];
    for (i, n) in fabric.nodes.iter().enumerate() {
        if let NodeKind::Rank { host } = n.kind
            && host < hosts
        {
            owner[i] = host;
        }
    }
    let n = fabric.nodes.len();
    let links = || fabric.links.iter().filter(move |l| l.from < n && l.to < n);
    let mut sw = vec![NONE; n];
    for l in links() {
        for (s, r) in [(l.from, l.to), (l.to, l.from)] {
            if let (NodeKind::Switch { .. }, NodeKind::Rank { host }) =
                (&fabric.nodes[s].kind, &fabric.nodes[r].kind)
                && *host < hosts
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
    let mut rate = vec![0.0f64; hosts];
    for l in links() {
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

/// The most bytes a simulated rank's buffer may hold (1 PiB): the simulator refuses larger
/// calls rather than overflow while sizing them.
pub const MAX_BUFFER_BYTES: u128 = 1 << 50;

/// Checks that `spec`'s buffers fit [`MAX_BUFFER_BYTES`] on `world` ranks (each rank's input
/// and output, counts times the element size), so that sizing them cannot overflow.
fn check_spec(spec: &Spec, world: usize) -> Result<(), String> {
    if spec.elem_size == 0 {
        return Err("elements of 0 bytes".into());
    }
    // Elements of the larger of a rank's input and output (more than a `usize`: too many).
    let elems = spec.coll.max_len(world);
    let bytes = elems.map_or(u128::MAX, |e| {
        (e as u128).saturating_mul(spec.elem_size as u128)
    });
    if bytes > MAX_BUFFER_BYTES {
        let what = match elems {
            Some(e) => format!("{e} elements"),
            None => "more elements than a usize counts".into(),
        };
        return Err(format!(
            "{} of {what} of {} bytes on {world} ranks: a rank's buffer would hold more than \
             the simulator's limit of {MAX_BUFFER_BYTES} bytes (1 PiB)",
            spec.coll.name(),
            spec.elem_size
        ));
    }
    Ok(())
}

/// Runs `spec` on `fabric` with `opts`.
///
/// # Errors
/// A fabric that [`Fabric::validate`] refuses, a spec whose buffers are too large
/// ([`MAX_BUFFER_BYTES`]) or whose schedules can't be built, ranks that must talk and can't
/// reach each other, and a run that can't finish (the error says which rank waits for what).
pub fn simulate_with(fabric: &Fabric, spec: &Spec, opts: &Options) -> Result<Report, String> {
    let world = fabric.world;
    if world == 0 {
        return Err("the fabric has no rank".into());
    }
    fabric.validate()?;
    check_spec(spec, world)?;
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
    // The mailbox protocol where the runtime would use it: between ranks (stored into on one
    // host, written across hosts; the aggregator has none).
    let mailbox = |r: usize, s: &Schedule| {
        r < world && mailbox_eligible(s, world, spec.elem_size, MAILBOX_DATA, |p| p < world)
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
            // A worker fails only if `f` panicked: carry that panic on, as a loop would.
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
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
    // (Elements of 0 bytes, which `simulate` refuses, as 1: the geometry divides by it.)
    .config(esize.max(1))
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
