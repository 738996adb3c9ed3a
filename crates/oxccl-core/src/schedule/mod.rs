//! Algorithms as data: a [`Schedule`] is one rank's ordered list of [`Step`]s over regions of
//! its buffers, with explicit dependencies. Building one does no I/O; the runtime's executor
//! (`oxccl`'s engine) runs it over verbs, [`verify`](crate::verify::verify) runs every rank's
//! schedule in memory against a symbolic reference, and the fabric simulator (`oxccl-sim`) runs
//! the same values over a modelled network.
//!
//! Sizes and offsets are in elements, so one schedule serves every data type.
//!
//! Matching rule: the `n`-th [`Op::Send`] from rank `a` to rank `b` on channel `c` is received by
//! the `n`-th [`Op::Recv`] at `b` from `a` on channel `c`, and both name the same length. The
//! executor moves a transfer in fragments of at most `chunk` elements through a window of
//! `slots` receive slots per (peer, channel); a transfer always moves at least one fragment,
//! so zero-length transfers are messages (barriers use them).
//!
//! This module holds the types and [`build`], which dispatches to one file per family of
//! algorithms: `ring` (pipelined rings), `tree` (recursive doubling, binomial trees, chains,
//! the dissemination barrier), `direct` (direct exchanges: the small all-reduce, all-to-all,
//! gather, scatter, point to point, and the direct phases the next two are made of),
//! `proportional` (bandwidth-proportional shares), `hierarchical` (two tiers) and
//! `aggregation` (through an in-network aggregator).

use serde::{Deserialize, Serialize};

mod aggregation;
mod direct;
mod hierarchical;
mod kind;
mod proportional;
mod ring;
mod tree;

pub use aggregation::build_aggregator;
pub use hierarchical::RAIL_DIRECT_MAX;
pub use kind::CollectiveKind;
pub use proportional::{proportional_shares, weighted_blocks};

/// Which of a rank's buffers a region lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Buf {
    /// The caller's send buffer (read only).
    Input,
    /// The caller's receive buffer.
    Output,
    /// Scratch space the executor allocates: [`Schedule::scratch`] elements.
    Scratch,
}

/// `len` elements at element `offset` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// The buffer.
    pub buf: Buf,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Region {
    /// A region of `buf`.
    pub const fn new(buf: Buf, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }

    /// The sub-region `offset..offset+len` of this one.
    pub fn sub(self, offset: usize, len: usize) -> Region {
        debug_assert!(offset + len <= self.len);
        Region::new(self.buf, self.offset + offset, len)
    }
}

/// What a step does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Send `src` to `peer` on `channel`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Channel (an independent FIFO between the same two ranks).
        channel: u8,
        /// What to send.
        src: Region,
    },
    /// Receive from `peer` on `channel` into `dst`; with `reduce_with`, `dst = reduce_with ⊕
    /// incoming` (the two may be the same region), else `dst = incoming`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Channel.
        channel: u8,
        /// Where the result goes.
        dst: Region,
        /// The local operand of the reduction, if any.
        reduce_with: Option<Region>,
    },
    /// `dst = src` (skipped when they are the same memory).
    Copy {
        /// Source.
        src: Region,
        /// Destination.
        dst: Region,
    },
    /// `dst = a ⊕ b` (`dst` may be `a`).
    Reduce {
        /// Destination.
        dst: Region,
        /// First operand.
        a: Region,
        /// Second operand.
        b: Region,
    },
}

/// One step and the earlier steps (indices into [`Schedule::steps`]) it waits for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The operation.
    pub op: Op,
    /// Steps that must be done first (all earlier in the list).
    pub deps: Vec<u32>,
}

/// The collectives, with the element counts that define their buffers ([`Collective::kind`]
/// says which one without them).
///
/// Buffer sizes (elements) per rank, `n` ranks: see [`Collective::input_len`] and
/// [`Collective::output_len`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Collective {
    /// Every rank ends with the reduction of all inputs: `count` in, `count` out.
    AllReduce {
        /// Elements.
        count: usize,
    },
    /// Rank `r` ends with block `r` of the reduction: `n·count` in, `count` out.
    ReduceScatter {
        /// Elements per rank.
        count: usize,
    },
    /// Every rank ends with every rank's input, in rank order: `count` in, `n·count` out.
    AllGather {
        /// Elements per rank.
        count: usize,
    },
    /// `root`'s input reaches every rank's output: `count` in (root), `count` out.
    Broadcast {
        /// Elements.
        count: usize,
        /// The sending rank.
        root: usize,
    },
    /// The reduction of all inputs lands in `root`'s output: `count` in, `count` out (root).
    Reduce {
        /// Elements.
        count: usize,
        /// The receiving rank.
        root: usize,
    },
    /// Block `j` of rank `i`'s input lands in block `i` of rank `j`'s output: `n·count` each.
    AllToAll {
        /// Elements per (sender, receiver) pair.
        count: usize,
    },
    /// All-to-all with this rank's counts per peer; blocks are packed in rank order. Rank
    /// `i`'s `send_counts[j]` must equal rank `j`'s `recv_counts[i]`.
    AllToAllV {
        /// Elements this rank sends to each rank.
        send_counts: Vec<usize>,
        /// Elements this rank receives from each rank.
        recv_counts: Vec<usize>,
    },
    /// Every rank's input lands in block `i` of `root`'s output: `count` in, `n·count` out (root).
    Gather {
        /// Elements per rank.
        count: usize,
        /// The receiving rank.
        root: usize,
    },
    /// Block `i` of `root`'s input lands in rank `i`'s output: `n·count` in (root), `count` out.
    Scatter {
        /// Elements per rank.
        count: usize,
        /// The sending rank.
        root: usize,
    },
    /// No rank leaves before every rank has arrived.
    Barrier,
    /// Point to point: `count` elements of the input to `peer`.
    Send {
        /// Elements.
        count: usize,
        /// Destination rank.
        peer: usize,
    },
    /// Point to point: `count` elements from `peer` into the output.
    Recv {
        /// Elements.
        count: usize,
        /// Source rank.
        peer: usize,
    },
}

impl Collective {
    /// Short name, as `oxccl perf` and error messages spell it ([`CollectiveKind::name`]).
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The root, for rooted collectives (the peer, for send and recv).
    pub fn root(&self) -> Option<usize> {
        match *self {
            Collective::Broadcast { root, .. }
            | Collective::Reduce { root, .. }
            | Collective::Gather { root, .. }
            | Collective::Scatter { root, .. } => Some(root),
            Collective::Send { peer, .. } | Collective::Recv { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// The `count` that defines the collective (0 for barrier; total sent for all-to-allv).
    pub fn count(&self) -> usize {
        match self {
            Collective::AllReduce { count }
            | Collective::ReduceScatter { count }
            | Collective::AllGather { count }
            | Collective::Broadcast { count, .. }
            | Collective::Reduce { count, .. }
            | Collective::AllToAll { count }
            | Collective::Gather { count, .. }
            | Collective::Scatter { count, .. }
            | Collective::Send { count, .. }
            | Collective::Recv { count, .. } => *count,
            Collective::AllToAllV { send_counts, .. } => send_counts.iter().sum(),
            Collective::Barrier => 0,
        }
    }

    /// Whether it combines values with a reduction operator.
    pub fn reduces(&self) -> bool {
        self.kind().reduces()
    }

    /// Elements of `rank`'s input buffer.
    pub fn input_len(&self, world: usize, rank: usize) -> usize {
        match self {
            Collective::AllReduce { count }
            | Collective::AllGather { count }
            | Collective::Reduce { count, .. }
            | Collective::Gather { count, .. }
            | Collective::Send { count, .. } => *count,
            Collective::Broadcast { count, root } => {
                if rank == *root {
                    *count
                } else {
                    0
                }
            }
            Collective::ReduceScatter { count } | Collective::AllToAll { count } => world * count,
            Collective::Scatter { count, root } => {
                if rank == *root {
                    world * count
                } else {
                    0
                }
            }
            Collective::AllToAllV { send_counts, .. } => send_counts.iter().sum(),
            Collective::Barrier | Collective::Recv { .. } => 0,
        }
    }

    /// Elements of `rank`'s output buffer.
    pub fn output_len(&self, world: usize, rank: usize) -> usize {
        match self {
            Collective::AllReduce { count }
            | Collective::ReduceScatter { count }
            | Collective::Broadcast { count, .. }
            | Collective::Scatter { count, .. }
            | Collective::Recv { count, .. } => *count,
            Collective::Reduce { count, root } => {
                if rank == *root {
                    *count
                } else {
                    0
                }
            }
            Collective::AllGather { count } | Collective::AllToAll { count } => world * count,
            Collective::Gather { count, root } => {
                if rank == *root {
                    world * count
                } else {
                    0
                }
            }
            Collective::AllToAllV { recv_counts, .. } => recv_counts.iter().sum(),
            Collective::Barrier | Collective::Send { .. } => 0,
        }
    }

    /// The most elements any rank's input or output holds ([`Collective::input_len`] and
    /// [`Collective::output_len`] at their largest), or `None` when that does not fit a
    /// `usize`: for sizing a call whose counts are not trusted.
    pub fn max_len(&self, world: usize) -> Option<usize> {
        // Every length is a count, a count times the world or a sum of counts: check those.
        match self {
            Collective::AllToAllV {
                send_counts,
                recv_counts,
            } => {
                let sum = |v: &[usize]| v.iter().try_fold(0usize, |a, &c| a.checked_add(c));
                sum(send_counts)?;
                sum(recv_counts)?;
            }
            _ => {
                self.count().checked_mul(world)?;
            }
        }
        // Rooted collectives are largest at the root; the others the same on every rank.
        let r = self.root().filter(|&r| r < world).unwrap_or(0);
        Some(self.input_len(world, r).max(self.output_len(world, r)))
    }

    /// Where input and output lie inside the single buffer of an in-place call (NCCL's
    /// conventions): `(input offset, output offset)` in elements, or `None` when this
    /// collective has no in-place form. All-gather's and gather's input is the rank's block of
    /// the output; reduce-scatter's and scatter's output is the rank's block of the input.
    pub fn in_place_offsets(&self, world: usize, rank: usize) -> Option<(usize, usize)> {
        let _ = world;
        match *self {
            Collective::AllReduce { .. }
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::AllToAll { .. } => Some((0, 0)),
            Collective::AllGather { count } => Some((rank * count, 0)),
            Collective::Gather { count, root } => {
                Some((if rank == root { rank * count } else { 0 }, 0))
            }
            Collective::ReduceScatter { count } => Some((0, rank * count)),
            Collective::Scatter { count, root } => {
                Some((0, if rank == root { rank * count } else { 0 }))
            }
            _ => None,
        }
    }
}

/// The algorithms schedules are built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Algorithm {
    /// Pipelined ring (reduce-scatter then all-gather for all-reduce), per channel.
    Ring,
    /// Recursive doubling (all-reduce, small messages).
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce, small messages).
    Tree,
    /// Pipelined chain from or to the root (broadcast, reduce, large messages).
    Chain,
    /// Every pair exchanges directly (all-to-all, gather, scatter, send/recv).
    Direct,
    /// Dissemination rounds of empty messages (barrier).
    Dissemination,
    /// All-reduce as a direct reduce-scatter then all-gather where rank `i` owns (reduces and
    /// distributes) a share of the elements proportional to [`Request::weights`]`[i]`: for links
    /// of unequal rates (see [`proportional_shares`] for the derivation).
    Proportional,
    /// Two tiers over [`Request::hosts`]. All-reduce: a reduce-scatter among the ranks of each
    /// host, an all-reduce of each rank's slice among the ranks with its local index on every
    /// host (rail style: every rank of a host drives its own slice across the network), and
    /// an all-gather inside each host; across hosts it moves `2(H−1)/H·N` per host link and
    /// direction where a flat ring moves `2(n−1)/n·N`. All-gather: along the rails across
    /// hosts first, then inside each host (`(H−1)/H·N` per host link against `(n−1)/n·N`).
    /// Reduce-scatter: inside each host first (rank `l` sums the blocks bound for every
    /// host's rank `l`), then along the rail. Broadcast: the root scatters pieces on its host,
    /// each piece goes down its rail in a chain, every host all-gathers them. The tiers
    /// overlap: each part crosses the network as soon as its part of the first tier is done.
    /// Rails of up to [`RAIL_DIRECT_MAX`] hosts exchange directly (an all-reduce's rail blocks
    /// in proportion to [`Request::weights`] when given: uneven host links), longer ones
    /// run rings.
    Hierarchical,
    /// All-reduce through an in-network aggregator (SHARP-style): every rank sends its input,
    /// slice by slice, to the aggregator, which reduces the slices of all ranks and sends the
    /// result back to every rank. The aggregator is the virtual peer `world`; its own
    /// schedule comes from [`build_aggregator`]. Each rank moves `N` up and `N` down, half
    /// the ring's `2(n−1)/n·N` each way. The runtime has no aggregator yet; the fabric
    /// simulator places it in a switch that can reduce.
    Aggregation,
}

impl Algorithm {
    /// This algorithm's place in [`Algorithm::ALL`].
    pub const fn index(self) -> u8 {
        self as u8
    }

    /// Every algorithm.
    pub const ALL: [Algorithm; 9] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Tree,
        Algorithm::Chain,
        Algorithm::Direct,
        Algorithm::Dissemination,
        Algorithm::Proportional,
        Algorithm::Hierarchical,
        Algorithm::Aggregation,
    ];

    /// Lower-case name, as `OXCCL_ALGO` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::Tree => "tree",
            Algorithm::Chain => "chain",
            Algorithm::Direct => "direct",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Proportional => "prop",
            Algorithm::Hierarchical => "hier",
            Algorithm::Aggregation => "agg",
        }
    }

    /// Parses a name (`ring`, `rd`/`recursive_doubling`, `tree`, `chain`, `direct`,
    /// `dissemination`).
    pub fn from_name(s: &str) -> Option<Algorithm> {
        Some(match s.to_ascii_lowercase().as_str() {
            "ring" => Algorithm::Ring,
            "rd" | "recursive_doubling" | "recursive-doubling" => Algorithm::RecursiveDoubling,
            "tree" | "binomial" => Algorithm::Tree,
            "chain" | "pipeline" => Algorithm::Chain,
            "direct" => Algorithm::Direct,
            "dissemination" => Algorithm::Dissemination,
            "prop" | "proportional" => Algorithm::Proportional,
            "hier" | "hierarchical" => Algorithm::Hierarchical,
            "agg" | "aggregation" | "in-switch" | "sharp" => Algorithm::Aggregation,
            _ => return None,
        })
    }

    /// Whether this algorithm can run `coll`.
    pub fn supports(self, coll: &Collective) -> bool {
        use Algorithm::*;
        match coll {
            Collective::AllReduce { .. } => {
                matches!(
                    self,
                    Ring | RecursiveDoubling | Direct | Proportional | Hierarchical | Aggregation
                )
            }
            Collective::AllGather { .. } => matches!(self, Ring | Hierarchical),
            Collective::ReduceScatter { .. } => matches!(self, Ring | Hierarchical),
            Collective::Broadcast { .. } => matches!(self, Tree | Chain | Hierarchical),
            Collective::Reduce { .. } => matches!(self, Tree | Chain),
            Collective::Barrier => self == Dissemination,
            _ => self == Direct,
        }
    }
}

/// Everything a schedule depends on.
#[derive(Clone, Debug, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The collective and its counts (this rank's, for all-to-allv).
    pub coll: Collective,
    /// Number of ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Whether input and output are one buffer (see [`Collective::in_place_offsets`]);
    /// schedules then order the steps that would
    /// otherwise overwrite data still to be sent.
    pub in_place: bool,
    /// The algorithm.
    pub algo: Algorithm,
    /// Elements per pipelined slice (≥ 1).
    pub chunk: usize,
    /// Independent channels (rings) the data is split over (≥ 1).
    pub channels: usize,
    /// [`Algorithm::Proportional`]: each rank's share of the elements it owns (one per rank,
    /// not all zero; they need not sum to anything). [`Algorithm::Hierarchical`] all-reduce:
    /// optionally each rank's share of its rail's blocks. Empty otherwise.
    #[serde(default)]
    pub weights: Vec<u32>,
    /// [`Algorithm::Hierarchical`]: each rank's host (any numbering; every host with the
    /// same number of ranks). Empty otherwise.
    #[serde(default)]
    pub hosts: Vec<u32>,
}

/// Field by field, as the derived one would, but the lists only when they are not empty: the
/// runtime compares a call's request with its cached one on every call, and comparing two
/// empty `Vec`s calls `memcmp` with a dangling pointer and length 0, which glibc took 200-300
/// ns for on some machines (measured: two such compares were half of a small all-reduce).
impl PartialEq for Request {
    fn eq(&self, o: &Request) -> bool {
        fn same(a: &[u32], b: &[u32]) -> bool {
            a.len() == b.len() && (a.is_empty() || a == b)
        }
        self.world == o.world
            && self.rank == o.rank
            && self.in_place == o.in_place
            && self.algo == o.algo
            && self.chunk == o.chunk
            && self.channels == o.channels
            && self.coll == o.coll
            && same(&self.weights, &o.weights)
            && same(&self.hosts, &o.hosts)
    }
}

/// The fields [`PartialEq`] compares, so equal requests hash alike.
impl std::hash::Hash for Request {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.coll.hash(h);
        self.world.hash(h);
        self.rank.hash(h);
        self.in_place.hash(h);
        self.algo.hash(h);
        self.chunk.hash(h);
        self.channels.hash(h);
        self.weights.hash(h);
        self.hosts.hash(h);
    }
}

/// One rank's schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// The rank it belongs to.
    pub rank: usize,
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// Elements of scratch space the steps use.
    pub scratch: usize,
}

/// Splits `len` elements into `parts` nearly equal pieces: piece `i`'s (offset, len).
pub fn split(len: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = len / parts;
    let extra = len % parts;
    let off = i * base + i.min(extra);
    (off, base + usize::from(i < extra))
}

struct Builder {
    steps: Vec<Step>,
    scratch: usize,
}

impl Builder {
    fn push(&mut self, op: Op, deps: impl IntoIterator<Item = Option<u32>>) -> u32 {
        let mut deps: Vec<u32> = deps.into_iter().flatten().collect();
        deps.sort_unstable();
        deps.dedup();
        self.steps.push(Step { op, deps });
        (self.steps.len() - 1) as u32
    }
    fn send(&mut self, peer: usize, channel: u8, src: Region, deps: &[Option<u32>]) -> u32 {
        self.push(Op::Send { peer, channel, src }, deps.iter().copied())
    }
    fn recv(
        &mut self,
        peer: usize,
        channel: u8,
        dst: Region,
        reduce_with: Option<Region>,
        deps: &[Option<u32>],
    ) -> u32 {
        self.push(
            Op::Recv {
                peer,
                channel,
                dst,
                reduce_with,
            },
            deps.iter().copied(),
        )
    }
    fn copy(&mut self, src: Region, dst: Region, deps: &[Option<u32>]) -> u32 {
        self.push(Op::Copy { src, dst }, deps.iter().copied())
    }
}

/// Why `req` cannot be built, if it cannot: a rank or root outside the world, a bad chunk or
/// channel count, counts, weights or hosts that do not fit the world or the algorithm, or an
/// algorithm that cannot run the collective.
fn validate(req: &Request) -> Result<(), String> {
    let n = req.world;
    let r = req.rank;
    if n == 0 || r >= n {
        return Err(format!("rank {r} is outside a world of {n} ranks"));
    }
    if req.chunk == 0 || req.channels == 0 || req.channels > 64 {
        return Err(format!(
            "chunk {} and channels {} must be ≥ 1 (channels ≤ 64)",
            req.chunk, req.channels
        ));
    }
    if let Some(root) = req.coll.root() {
        if root >= n {
            return Err(format!(
                "{} names rank {root}, outside a world of {n} ranks",
                req.coll.name()
            ));
        }
        if matches!(req.coll, Collective::Send { .. } | Collective::Recv { .. }) && root == r {
            return Err(format!("{} to or from itself (rank {r})", req.coll.name()));
        }
    }
    if let Collective::AllToAllV {
        send_counts,
        recv_counts,
    } = &req.coll
        && (send_counts.len() != n || recv_counts.len() != n)
    {
        return Err(format!(
            "all_to_allv needs {n} send and receive counts, got {} and {}",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    if req.algo == Algorithm::Proportional
        && (req.weights.len() != n || req.weights.iter().all(|&w| w == 0))
    {
        return Err(format!(
            "the proportional algorithm needs {n} weights, not all zero; got {:?}",
            req.weights
        ));
    }
    if req.algo == Algorithm::Hierarchical {
        if req.hosts.len() != n {
            return Err(format!(
                "the hierarchical algorithm needs the host of each of the {n} ranks, got {:?}",
                req.hosts
            ));
        }
        if !req.weights.is_empty() && req.weights.len() != n {
            return Err(format!(
                "the hierarchical algorithm takes no weights or one per rank ({n}), got {:?}",
                req.weights
            ));
        }
        let mut ids = req.hosts.clone();
        ids.sort_unstable();
        let per: Vec<usize> = ids.chunk_by(|a, b| a == b).map(<[u32]>::len).collect();
        if per.iter().any(|&c| c != per[0]) {
            return Err(format!(
                "the hierarchical algorithm needs as many ranks on every host: {:?}",
                req.hosts
            ));
        }
    }
    if req.algo == Algorithm::Ring && !req.hosts.is_empty() && req.hosts.len() != n {
        return Err(format!(
            "a ring ordered by host needs the host of each of the {n} ranks, got {:?}",
            req.hosts
        ));
    }
    if !req.algo.supports(&req.coll) {
        return Err(format!(
            "algorithm {} cannot run {}",
            req.algo.name(),
            req.coll.name()
        ));
    }
    Ok(())
}

/// Builds `req.rank`'s schedule; an error says why the request is invalid.
pub fn build(req: &Request) -> Result<Schedule, String> {
    validate(req)?;
    let n = req.world;
    let r = req.rank;
    let mut b = Builder {
        steps: Vec::new(),
        scratch: 0,
    };
    let copy_all = |b: &mut Builder, count| {
        let (i, o) = (
            Region::new(Buf::Input, 0, count),
            Region::new(Buf::Output, 0, count),
        );
        b.copy(i, o, &[]);
    };
    match (&req.coll, req.algo) {
        (Collective::Barrier, _) => tree::dissemination(&mut b, n, r),
        // Nothing moves for zero elements (all-to-allv can still receive what it doesn't send);
        // the builders below may assume count > 0.
        (c, _) if c.count() == 0 && !matches!(c, Collective::AllToAllV { .. }) => {}
        (&Collective::AllReduce { count }, _) if n == 1 => copy_all(&mut b, count),
        (&Collective::AllReduce { count }, Algorithm::Ring) => {
            ring::ring_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, Algorithm::Direct) => {
            direct::direct_all_reduce(&mut b, n, r, count, req.in_place)
        }
        (&Collective::AllReduce { count }, Algorithm::Proportional) => {
            proportional::proportional_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, Algorithm::Hierarchical) => {
            hierarchical::hierarchical_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, Algorithm::Aggregation) => {
            aggregation::aggregation_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, _) => {
            tree::recursive_doubling(&mut b, n, r, count, req.in_place)
        }
        (&Collective::ReduceScatter { count }, Algorithm::Hierarchical) => {
            hierarchical::hierarchical_reduce_scatter(&mut b, req, count)
        }
        (&Collective::ReduceScatter { count }, _) => ring::ring_reduce_scatter(&mut b, req, count),
        (&Collective::AllGather { count }, Algorithm::Hierarchical) => {
            hierarchical::hierarchical_all_gather(&mut b, req, count)
        }
        (&Collective::AllGather { count }, _) => ring::ring_all_gather(&mut b, req, count),
        (&Collective::Broadcast { count, root }, algo) => {
            if r == root {
                copy_all(&mut b, count);
            }
            if algo == Algorithm::Hierarchical {
                hierarchical::hierarchical_broadcast(&mut b, req, count, root)
            } else if algo == Algorithm::Chain {
                tree::chain_broadcast(&mut b, req, count, root)
            } else {
                tree::tree_broadcast(&mut b, n, r, count, root)
            }
        }
        (&Collective::Reduce { count, root }, algo) => {
            if n == 1 {
                copy_all(&mut b, count);
            } else if algo == Algorithm::Chain {
                tree::chain_reduce(&mut b, req, count, root)
            } else {
                tree::tree_reduce(&mut b, n, r, count, root)
            }
        }
        (&Collective::AllToAll { count }, _) => {
            let counts = vec![count; n];
            direct::pairwise(&mut b, n, r, &counts, &counts, req.in_place)
        }
        (
            Collective::AllToAllV {
                send_counts,
                recv_counts,
            },
            _,
        ) => direct::pairwise(&mut b, n, r, send_counts, recv_counts, req.in_place),
        (&Collective::Gather { count, root }, _) => direct::gather(&mut b, n, r, count, root),
        (&Collective::Scatter { count, root }, _) => direct::scatter(&mut b, n, r, count, root),
        (&Collective::Send { count, peer }, _) => {
            b.send(peer, 0, Region::new(Buf::Input, 0, count), &[]);
        }
        (&Collective::Recv { count, peer }, _) => {
            b.recv(peer, 0, Region::new(Buf::Output, 0, count), None, &[]);
        }
    }
    Ok(Schedule {
        rank: r,
        steps: b.steps,
        scratch: b.scratch,
    })
}

/// Slices of a block of `len` elements: `k` nearly equal pieces where `k` is chosen from the
/// largest block so that every rank cuts every block into the same number of slices.
fn slices(max_block: usize, chunk: usize) -> usize {
    max_block.div_ceil(chunk).max(1)
}

/// Which step last wrote each range of a buffer: what a later phase waits on for exactly the
/// part it reads, so that the tiers of a hierarchical schedule overlap (a slice crosses the
/// network as soon as its part of the first tier is done).
#[derive(Default)]
struct Done(Vec<(usize, usize, u32)>);

impl Done {
    fn add(&mut self, off: usize, len: usize, step: Option<u32>) {
        if let Some(s) = step
            && len > 0
        {
            self.0.push((off, len, s));
        }
    }

    fn extend(&mut self, other: Done) {
        self.0.extend(other.0);
    }

    /// Sorted by offset, for [`Done::over`].
    fn sealed(mut self) -> Done {
        self.0.sort_unstable();
        self
    }

    /// The steps that wrote any element of `off..off+len` (the ranges of one phase do not
    /// overlap one another, and the list is sorted).
    fn over(&self, off: usize, len: usize) -> Vec<Option<u32>> {
        let first = self.0.partition_point(|&(o, l, _)| o + l <= off);
        self.0[first..]
            .iter()
            .take_while(|&&(o, _, _)| o < off + len)
            .map(|&(_, _, s)| Some(s))
            .collect()
    }
}

/// Deps of a phase that reads what nothing earlier wrote.
const NOTHING: fn(usize, usize) -> Vec<Option<u32>> = |_, _| Vec::new();

#[cfg(test)]
mod tests {
    use super::*;

    /// `max_len` is the largest input or output of any rank, and `None` where that would
    /// overflow.
    #[test]
    fn max_len_is_the_largest_buffer_of_any_rank() {
        let colls = [
            Collective::AllReduce { count: 7 },
            Collective::ReduceScatter { count: 7 },
            Collective::AllGather { count: 7 },
            Collective::Broadcast { count: 7, root: 2 },
            Collective::Reduce { count: 7, root: 1 },
            Collective::AllToAll { count: 7 },
            Collective::Gather { count: 7, root: 2 },
            Collective::Scatter { count: 7, root: 1 },
            Collective::Send { count: 7, peer: 1 },
            Collective::Recv { count: 7, peer: 1 },
            Collective::AllToAllV {
                send_counts: vec![1, 2, 3],
                recv_counts: vec![4, 5, 6],
            },
            Collective::Barrier,
        ];
        for c in &colls {
            let want = (0..3)
                .map(|r| c.input_len(3, r).max(c.output_len(3, r)))
                .max()
                .unwrap();
            assert_eq!(c.max_len(3), Some(want), "{c:?}");
        }
        assert_eq!(Collective::AllGather { count: 1 << 62 }.max_len(8), None);
        assert_eq!(
            Collective::Scatter {
                count: usize::MAX,
                root: 0
            }
            .max_len(2),
            None
        );
        let v = Collective::AllToAllV {
            send_counts: vec![1],
            recv_counts: vec![usize::MAX, 1],
        };
        assert_eq!(v.max_len(2), None);
        assert_eq!(
            Collective::AllReduce { count: usize::MAX }.max_len(1),
            Some(usize::MAX)
        );
    }

    #[test]
    fn algorithm_indexes_are_places_in_all() {
        for (i, a) in Algorithm::ALL.iter().enumerate() {
            assert_eq!(a.index() as usize, i, "{a:?}");
            assert_eq!(Algorithm::from_name(a.name()), Some(*a));
        }
    }

    /// The hand-written `PartialEq` of `Request` tells apart exactly what the derived one
    /// would: every field, the lists by length and content.
    #[test]
    fn requests_differ_in_every_field() {
        let base = Request {
            coll: Collective::AllReduce { count: 10 },
            world: 4,
            rank: 1,
            in_place: false,
            algo: Algorithm::Ring,
            chunk: 8,
            channels: 2,
            weights: Vec::new(),
            hosts: Vec::new(),
        };
        assert_eq!(base, base.clone());
        let others = [
            Request {
                coll: Collective::AllReduce { count: 11 },
                ..base.clone()
            },
            Request {
                world: 5,
                ..base.clone()
            },
            Request {
                rank: 2,
                ..base.clone()
            },
            Request {
                in_place: true,
                ..base.clone()
            },
            Request {
                algo: Algorithm::Tree,
                ..base.clone()
            },
            Request {
                chunk: 9,
                ..base.clone()
            },
            Request {
                channels: 1,
                ..base.clone()
            },
            Request {
                weights: vec![0],
                ..base.clone()
            },
            Request {
                hosts: vec![1, 1, 2, 2],
                ..base.clone()
            },
        ];
        for o in &others {
            assert_ne!(&base, o);
            assert_ne!(o, &base);
        }
        let w = |weights: Vec<u32>| Request {
            weights,
            ..base.clone()
        };
        assert_eq!(w(vec![1, 2]), w(vec![1, 2]));
        assert_ne!(w(vec![1, 2]), w(vec![2, 1]));
    }
}
