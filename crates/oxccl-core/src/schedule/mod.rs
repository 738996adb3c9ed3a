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

use serde::{Deserialize, Serialize};

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

/// The collectives, with the element counts that define their buffers.
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
    /// Short name, as `oxccl perf` and error messages spell it.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "all_reduce",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllGather { .. } => "all_gather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::AllToAllV { .. } => "all_to_allv",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::Barrier => "barrier",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
        }
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
        matches!(
            self,
            Collective::AllReduce { .. }
                | Collective::ReduceScatter { .. }
                | Collective::Reduce { .. }
        )
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// Builds `req.rank`'s schedule; an error says why the request is invalid.
pub fn build(req: &Request) -> Result<Schedule, String> {
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
    let mut b = Builder {
        steps: Vec::new(),
        scratch: 0,
    };
    let input = |off, len| Region::new(Buf::Input, off, len);
    let output = |off, len| Region::new(Buf::Output, off, len);
    match (&req.coll, req.algo) {
        (Collective::Barrier, _) => dissemination(&mut b, n, r),
        // Nothing moves for zero elements (all-to-allv can still receive what it doesn't send);
        // the builders below may assume count > 0.
        (c, _) if c.count() == 0 && !matches!(c, Collective::AllToAllV { .. }) => {}
        (&Collective::AllReduce { count }, _) if n == 1 => {
            b.copy(input(0, count), output(0, count), &[]);
        }
        (&Collective::AllReduce { count }, Algorithm::Ring) => ring_all_reduce(&mut b, req, count),
        (&Collective::AllReduce { count }, Algorithm::Direct) => {
            direct_all_reduce(&mut b, n, r, count, req.in_place)
        }
        (&Collective::AllReduce { count }, Algorithm::Proportional) => {
            proportional_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, Algorithm::Hierarchical) => {
            hierarchical_all_reduce(&mut b, req, count)
        }
        (&Collective::AllReduce { count }, Algorithm::Aggregation) => {
            let k = slices(count, req.chunk);
            for s in 0..k {
                let (o, l) = split(count, k, s);
                let sent = b.send(n, 0, input(o, l), &[]);
                // In place, the result overwrites what the send reads.
                b.recv(n, 0, output(o, l), None, &[req.in_place.then_some(sent)]);
            }
        }
        (&Collective::AllReduce { count }, _) => recursive_doubling(&mut b, n, r, count),
        (&Collective::ReduceScatter { count }, Algorithm::Hierarchical) => {
            hierarchical_reduce_scatter(&mut b, req, count)
        }
        (&Collective::ReduceScatter { count }, _) => ring_reduce_scatter(&mut b, req, count),
        (&Collective::AllGather { count }, Algorithm::Hierarchical) => {
            hierarchical_all_gather(&mut b, req, count)
        }
        (&Collective::AllGather { count }, _) => ring_all_gather(&mut b, req, count),
        (&Collective::Broadcast { count, root }, algo) => {
            if r == root {
                b.copy(input(0, count), output(0, count), &[]);
            }
            if algo == Algorithm::Hierarchical {
                hierarchical_broadcast(&mut b, req, count, root)
            } else if algo == Algorithm::Chain {
                chain_broadcast(&mut b, req, count, root)
            } else {
                tree_broadcast(&mut b, n, r, count, root)
            }
        }
        (&Collective::Reduce { count, root }, algo) => {
            if n == 1 {
                b.copy(input(0, count), output(0, count), &[]);
            } else if algo == Algorithm::Chain {
                chain_reduce(&mut b, req, count, root)
            } else {
                tree_reduce(&mut b, n, r, count, root)
            }
        }
        (&Collective::AllToAll { count }, _) => {
            let counts = vec![count; n];
            pairwise(&mut b, n, r, &counts, &counts, req.in_place)
        }
        (
            Collective::AllToAllV {
                send_counts,
                recv_counts,
            },
            _,
        ) => pairwise(&mut b, n, r, send_counts, recv_counts, req.in_place),
        (&Collective::Gather { count, root }, _) => {
            if r == root {
                b.copy(input(0, count), output(r * count, count), &[]);
                for p in (0..n).filter(|&p| p != r) {
                    b.recv(p, 0, output(p * count, count), None, &[]);
                }
            } else {
                b.send(root, 0, input(0, count), &[]);
            }
        }
        (&Collective::Scatter { count, root }, _) => {
            if r == root {
                for i in 1..n {
                    let p = (r + i) % n;
                    b.send(p, 0, input(p * count, count), &[]);
                }
                b.copy(input(r * count, count), output(0, count), &[]);
            } else {
                b.recv(root, 0, output(0, count), None, &[]);
            }
        }
        (&Collective::Send { count, peer }, _) => {
            b.send(peer, 0, input(0, count), &[]);
        }
        (&Collective::Recv { count, peer }, _) => {
            b.recv(peer, 0, output(0, count), None, &[]);
        }
    }
    Ok(Schedule {
        rank: r,
        steps: b.steps,
        scratch: b.scratch,
    })
}

/// The aggregator's schedule for an [`Algorithm::Aggregation`] all-reduce of `req` (any
/// rank's request): its peers are ranks `0..world`; slice by slice it receives every rank's
/// contribution into scratch, folding them in as they come, then sends the sum to every rank.
pub fn build_aggregator(req: &Request) -> Result<Schedule, String> {
    let (n, count) = match req.coll {
        Collective::AllReduce { count } if req.algo == Algorithm::Aggregation => (req.world, count),
        _ => {
            return Err(format!(
                "an aggregator runs aggregation all-reduces, not {} with {}",
                req.coll.name(),
                req.algo.name()
            ));
        }
    };
    if n == 0 || req.chunk == 0 {
        return Err(format!("world {n} and chunk {} must be ≥ 1", req.chunk));
    }
    let mut b = Builder {
        steps: Vec::new(),
        scratch: count,
    };
    // One rank copies its input; nothing moves for zero elements.
    if count > 0 && n > 1 {
        let k = slices(count, req.chunk);
        for s in 0..k {
            let (o, l) = split(count, k, s);
            let acc = Region::new(Buf::Scratch, o, l);
            let mut last = None;
            for p in 0..n {
                let with = (p > 0).then_some(acc);
                last = Some(b.recv(p, 0, acc, with, &[last]));
            }
            for p in 0..n {
                b.send(p, 0, acc, &[last]);
            }
        }
    }
    Ok(Schedule {
        rank: n,
        steps: b.steps,
        scratch: b.scratch,
    })
}

/// Slices of a block of `len` elements: `k` nearly equal pieces where `k` is chosen from the
/// largest block so that every rank cuts every block into the same number of slices.
fn slices(max_block: usize, chunk: usize) -> usize {
    max_block.div_ceil(chunk).max(1)
}

/// The ring over channel `ch`'s part of `count` elements: `(part offset, part len)`.
fn channel_part(count: usize, channels: usize, ch: usize) -> (usize, usize) {
    split(count, channels, ch)
}

/// The ring's order: ranks in order, or with [`Request::hosts`] host by host (hosts in order
/// of their lowest rank), so that the ring crosses each host's link once each way; and this
/// rank's place in it.
fn ring_order(req: &Request) -> (Vec<usize>, usize) {
    let mut members: Vec<usize> = (0..req.world).collect();
    if !req.hosts.is_empty() {
        let first = |h: u32| req.hosts.iter().position(|&x| x == h).unwrap_or(0);
        members.sort_by_key(|&x| (first(req.hosts[x]), x));
    }
    let i = members
        .iter()
        .position(|&x| x == req.rank)
        .expect("a member");
    (members, i)
}

fn ring_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let (members, i) = ring_order(req);
    let channels = req.channels.min(count).max(1);
    for ch in 0..channels {
        let part = channel_part(count, channels, ch);
        let c = ch as u8;
        ring_all_reduce_part(b, &members, i, part, req.chunk, c, Buf::Input, &NOTHING);
    }
}

/// Ring all-reduce of the output's elements `part` (offset, len) among `members` (this rank
/// is member `i`) on channel `c`, pipelined in slices of at most `chunk`: this rank's
/// contribution is in `src` (the input, or the output holding a partial result), read once
/// `after` (given the part read) is done. Returns when each part of the result became final.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn ring_all_reduce_part(
    b: &mut Builder,
    members: &[usize],
    i: usize,
    (poff, plen): (usize, usize),
    chunk: usize,
    c: u8,
    src: Buf,
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> Done {
    let n = members.len();
    let r = i;
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let block = |i: usize| {
        let (o, l) = split(plen, n, i % n);
        (poff + o, l)
    };
    let k = slices(plen.div_ceil(n), chunk);
    let slice = |blk: usize, s: usize| {
        let (o, l) = block(blk);
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    };
    let mut done = Done::default();
    // Reduce-scatter: at step t send block r-t, receive block r-t-1 and reduce it.
    let mut rs_recv: Vec<Vec<u32>> = Vec::new();
    let mut rs_send: Vec<Vec<u32>> = Vec::new();
    for t in 0..n - 1 {
        let sb = (r + n - t) % n;
        let rb = (r + 2 * n - t - 1) % n;
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for s in 0..k {
            let (so, sl) = slice(sb, s);
            let sent = if t == 0 {
                b.send(next, c, Region::new(src, so, sl), &after(so, sl))
            } else {
                let dep = Some(rs_recv[t - 1][s]);
                b.send(next, c, Region::new(Buf::Output, so, sl), &[dep])
            };
            sends.push(sent);
            let (ro, rl) = slice(rb, s);
            let (dst, with) = (Region::new(Buf::Output, ro, rl), Region::new(src, ro, rl));
            recvs.push(b.recv(prev, c, dst, Some(with), &after(ro, rl)));
        }
        rs_send.push(sends);
        rs_recv.push(recvs);
    }
    if n > 1 {
        for s in 0..k {
            let (o, l) = slice((r + 1) % n, s);
            done.add(o, l, Some(rs_recv[n - 2][s]));
        }
    }
    // All-gather: at step t send block r+1-t (reduced), receive block r-t.
    let mut ag_recv: Vec<u32> = Vec::new();
    for t in 0..n - 1 {
        let sb = (r + 1 + n - t) % n;
        let rb = (r + n - t) % n;
        let mut recvs = Vec::new();
        for s in 0..k {
            let (so, sl) = slice(sb, s);
            let dep = if t == 0 {
                rs_recv[n - 2][s]
            } else {
                ag_recv[s]
            };
            b.send(next, c, Region::new(Buf::Output, so, sl), &[Some(dep)]);
            let (ro, rl) = slice(rb, s);
            // Block r-t was sent at reduce-scatter step t: that send must be done. (Out of
            // place at t = 0 it read the input, but dropping this dependency measured
            // slower at 1 MiB on shm: the receive then competes with the send for the core.)
            let war = Some(rs_send[t][s]);
            let id = b.recv(prev, c, Region::new(Buf::Output, ro, rl), None, &[war]);
            done.add(ro, rl, Some(id));
            recvs.push(id);
        }
        ag_recv = recvs;
    }
    done
}

fn ring_reduce_scatter(b: &mut Builder, req: &Request, count: usize) {
    let n = req.world;
    // Positions on the ring; position p's block is that of rank members[p].
    let (members, r) = ring_order(req);
    if n == 1 {
        b.copy(
            Region::new(Buf::Input, 0, count),
            Region::new(Buf::Output, 0, count),
            &[],
        );
        return;
    }
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let channels = req.channels.min(count).max(1);
    // Partials travel through two scratch blocks, used alternately.
    b.scratch = 2 * count;
    for ch in 0..channels {
        let (poff, plen) = channel_part(count, channels, ch);
        let k = slices(plen, req.chunk);
        // Slice s of channel ch inside a block of `count` elements.
        let slice = |s: usize| {
            let (so, sl) = split(plen, k, s);
            (poff + so, sl)
        };
        let c = ch as u8;
        let mut prev_recv: Vec<u32> = Vec::new();
        let mut sends: Vec<Vec<u32>> = Vec::new();
        for t in 0..n - 1 {
            // Send block r-t-1, receive block r-t-2; the last receive is block r.
            let sb = members[(r + 2 * n - t - 1) % n];
            let rb = members[(r + 2 * n - t - 2) % n];
            let mut step_sends = Vec::new();
            let mut recvs = Vec::new();
            for s in 0..k {
                let (so, sl) = slice(s);
                let (src, dep) = if t == 0 {
                    (Region::new(Buf::Input, sb * count + so, sl), None)
                } else {
                    let sc = ((t - 1) % 2) * count;
                    (Region::new(Buf::Scratch, sc + so, sl), Some(prev_recv[s]))
                };
                step_sends.push(b.send(next, c, src, &[dep]));
                let with = Region::new(Buf::Input, rb * count + so, sl);
                let (dst, war) = if t == n - 2 {
                    (Region::new(Buf::Output, so, sl), None)
                } else {
                    // Scratch half t%2 was last sent at step t-1.
                    let war = if t >= 2 { Some(sends[t - 1][s]) } else { None };
                    (Region::new(Buf::Scratch, (t % 2) * count + so, sl), war)
                };
                recvs.push(b.recv(prev, c, dst, Some(with), &[war]));
            }
            sends.push(step_sends);
            prev_recv = recvs;
        }
    }
}

#[allow(clippy::needless_range_loop)] // slices index parallel per-step vectors
fn ring_all_gather(b: &mut Builder, req: &Request, count: usize) {
    let n = req.world;
    b.copy(
        Region::new(Buf::Input, 0, count),
        Region::new(Buf::Output, req.rank * count, count),
        &[],
    );
    if n == 1 {
        return;
    }
    // Positions on the ring; position p's block is that of rank members[p].
    let (members, r) = ring_order(req);
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let channels = req.channels.min(count).max(1);
    for ch in 0..channels {
        let (poff, plen) = channel_part(count, channels, ch);
        let k = slices(plen, req.chunk);
        let slice = |s: usize| {
            let (so, sl) = split(plen, k, s);
            (poff + so, sl)
        };
        let c = ch as u8;
        let mut prev_recv: Vec<u32> = Vec::new();
        for t in 0..n - 1 {
            let sb = members[(r + n - t) % n];
            let rb = members[(r + 2 * n - t - 1) % n];
            let mut recvs = Vec::new();
            for s in 0..k {
                let (so, sl) = slice(s);
                let (src, dep) = if t == 0 {
                    (Region::new(Buf::Input, so, sl), None)
                } else {
                    (
                        Region::new(Buf::Output, sb * count + so, sl),
                        Some(prev_recv[s]),
                    )
                };
                b.send(next, c, src, &[dep]);
                recvs.push(b.recv(
                    prev,
                    c,
                    Region::new(Buf::Output, rb * count + so, sl),
                    None,
                    &[],
                ));
            }
            prev_recv = recvs;
        }
    }
}

/// Recursive doubling over the largest power of two `p ≤ n`; ranks `p..n` first hand their
/// input to rank `r - p` and get the result back at the end. Each round receives into
/// scratch and reduces after its own send is done, so any message size is deadlock-free.
fn recursive_doubling(b: &mut Builder, n: usize, r: usize, count: usize) {
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let all = |buf| Region::new(buf, 0, count);
    b.scratch = count;
    if r >= p {
        let sent = b.send(r - p, 0, all(Buf::Input), &[]);
        b.recv(r - p, 0, all(Buf::Output), None, &[Some(sent)]);
        return;
    }
    let mut last = if r + p < n {
        Some(b.recv(r + p, 0, all(Buf::Output), Some(all(Buf::Input)), &[]))
    } else {
        Some(b.copy(all(Buf::Input), all(Buf::Output), &[]))
    };
    let mut mask = 1;
    while mask < p {
        let partner = r ^ mask;
        let send = b.send(partner, 0, all(Buf::Output), &[last]);
        let recv = b.recv(partner, 0, all(Buf::Scratch), None, &[last]);
        last = Some(b.push(
            Op::Reduce {
                dst: all(Buf::Output),
                a: all(Buf::Output),
                b: all(Buf::Scratch),
            },
            [Some(send), Some(recv)],
        ));
        mask <<= 1;
    }
    if r + p < n {
        b.send(r + p, 0, all(Buf::Output), &[last]);
    }
}

/// Every rank sends its whole input to every other rank and reduces all of them itself, in
/// rank order (so every rank computes bit-identical results): one round of messages, for small
/// messages between ranks of one host. In place, the input first moves to scratch, since the
/// output is written before every send is done.
fn direct_all_reduce(b: &mut Builder, n: usize, r: usize, count: usize, in_place: bool) {
    b.scratch = n * count;
    let slot = |j: usize| Region::new(Buf::Scratch, j * count, count);
    let (own, saved) = if in_place {
        let c = b.copy(Region::new(Buf::Input, 0, count), slot(r), &[]);
        (slot(r), Some(c))
    } else {
        (Region::new(Buf::Input, 0, count), None)
    };
    let mut sends = Vec::new();
    for i in 1..n {
        sends.push(Some(b.send((r + i) % n, 0, own, &[saved])));
    }
    let mut got = vec![None; n];
    for i in 1..n {
        let p = (r + n - i) % n;
        got[p] = Some(b.recv(p, 0, slot(p), None, &[]));
    }
    let src = |j: usize| if j == r { own } else { slot(j) };
    let out = Region::new(Buf::Output, 0, count);
    // The output may be the input: write it only after every send has read the input.
    let mut first = sends.clone();
    first.extend([got[0], saved]);
    let mut last = b.copy(src(0), out, &first);
    for (j, &arrived) in got.iter().enumerate().skip(1) {
        last = b.push(
            Op::Reduce {
                dst: out,
                a: out,
                b: src(j),
            },
            [Some(last), arrived],
        );
    }
}

/// Splits `len` elements into blocks proportional to `weights` (largest remainders first, ties
/// to the lower index): block `i`'s `(offset, len)` for every `i`. Every rank computes the same.
pub fn weighted_blocks(len: usize, weights: &[u32]) -> Vec<(usize, usize)> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if total == 0 {
        return weights.iter().map(|_| (0, 0)).collect();
    }
    let exact = |i: usize| u128::from(weights[i]) * len as u128;
    let mut lens: Vec<usize> = (0..weights.len())
        .map(|i| (exact(i) / total) as usize)
        .collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(exact(i) % total), i));
    let short = len - lens.iter().sum::<usize>();
    for &i in order.iter().take(short) {
        lens[i] += 1;
    }
    let mut off = 0;
    lens.into_iter()
        .map(|l| {
            off += l;
            (off - l, l)
        })
        .collect()
}

/// The shares of an all-reduce's elements each rank should own when rank `i`'s link carries
/// `rates[i]` per direction (all ranks on one star of links, one rank per link), and the
/// time it then takes relative to moving the whole buffer over a link of rate 1.
///
/// # Derivation
/// Let `N` be the buffer, `n` ≥ 3 the ranks and `B_i` (with `Σ B_i = N`) what rank `i` owns.
/// A direct reduce-scatter sends every other owner its block (`N − B_i` out) and receives
/// every other rank's contribution to its own (`(n−1)·B_i` in); the all-gather then sends its
/// reduced block to everyone (`(n−1)·B_i` out) and receives the others' (`N − B_i` in). So each
/// direction of link `i` carries `N + (n−2)·B_i`, taking `T_i = (N + (n−2)·B_i) / r_i`. We
/// want `B` minimising `max_i T_i`:
/// - every rank moves at least `N` each way whatever it owns (`B_i ≥ 0`), so `T ≥ N / r_min`;
/// - the ranks that own something all finish together at `T`: `B_i = (T·r_i − N)/(n−2)`, and
///   the others own nothing; `Σ_i max(0, T·r_i − N) = (n−2)·N` gives the smallest `T_s`
///   (a piecewise-linear, increasing function of `T`: solved exactly below).
///
/// Hence `T* = max(T_s, N / r_min)`, with shares proportional to `max(0, T*·r_i − N)`
/// (any split within those caps is optimal when `N / r_min` binds). Equal rates give
/// `B_i = N/n` and `T* = 2(n−1)N/(n·r)`, the ring's time; a plain ring always takes
/// `2(n−1)N/(n·r_min)`, so the gain is `2(n−1)/(n·r_min) / (T*/N)`: with one link of four
/// at a quarter rate, `1.5` (the slow rank owns nothing and only sends and receives `N`).
/// For `n = 2` every split takes `N / r_min`; shares then follow the rates.
pub fn proportional_shares(rates: &[f64]) -> (Vec<f64>, f64) {
    let n = rates.len();
    let r_min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    if n <= 2 {
        let total: f64 = rates.iter().sum();
        return (rates.iter().map(|r| r / total).collect(), 1.0 / r_min);
    }
    // Σ max(0, T·r_i − 1) = n − 2, with N = 1: add ranks from the fastest down.
    let mut sorted: Vec<f64> = rates.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut t_s = f64::INFINITY;
    let (mut sum_r, mut k) = (0.0, 0.0);
    for (j, &r) in sorted.iter().enumerate() {
        sum_r += r;
        k += 1.0;
        let t = (n as f64 - 2.0 + k) / sum_r;
        // Valid when every rank counted owns something and the next would not.
        let next_owns = sorted.get(j + 1).is_some_and(|&rn| t * rn > 1.0);
        if t * r >= 1.0 && !next_owns {
            t_s = t;
            break;
        }
    }
    let t = t_s.max(1.0 / r_min);
    let caps: Vec<f64> = rates.iter().map(|r| (t * r - 1.0).max(0.0)).collect();
    let total: f64 = caps.iter().sum();
    let shares = if total > 0.0 {
        caps.iter().map(|c| c / total).collect()
    } else {
        vec![1.0 / n as f64; n]
    };
    (shares, t)
}

/// The fewest slices [`Algorithm::Proportional`] cuts a block into.
const PROPORTIONAL_SLICES: usize = 16;

/// See [`Algorithm::Proportional`]: a direct reduce-scatter into weighted blocks, then a
/// direct all-gather, pipelined in slices (slice `s` of a block is gathered as soon as it is
/// reduced).
fn proportional_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let members: Vec<usize> = (0..req.world).collect();
    let blocks = weighted_blocks(count, &req.weights);
    let k = phase_slices(&blocks, req.chunk);
    let own = (Buf::Output, blocks[req.rank].0);
    direct_all_reduce_part(b, &members, req.rank, &blocks, k, Buf::Input, own, &NOTHING);
}

/// The longest rail a hierarchical schedule crosses with direct exchanges (every rank talks
/// to its rail-mate on every other host); longer rails run a ring.
pub const RAIL_DIRECT_MAX: usize = 8;

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

/// The two tiers of [`Request::hosts`]: every host's ranks (hosts in ascending number, ranks
/// ascending), this rank's host-mates, its index among them, its rail (the ranks with that
/// index on every host) and its host's index (its place on the rail).
struct Tiers {
    hosts: Vec<Vec<usize>>,
    locals: Vec<usize>,
    li: usize,
    rail: Vec<usize>,
    ri: usize,
}

fn tiers(req: &Request) -> Tiers {
    let mut ids: Vec<u32> = req.hosts.clone();
    ids.sort_unstable();
    ids.dedup();
    let mut hosts: Vec<Vec<usize>> = vec![Vec::new(); ids.len()];
    for (x, h) in req.hosts.iter().enumerate() {
        hosts[ids.binary_search(h).expect("listed")].push(x);
    }
    let ri = ids.binary_search(&req.hosts[req.rank]).expect("its host");
    let locals = hosts[ri].clone();
    let li = locals
        .iter()
        .position(|&x| x == req.rank)
        .expect("on its host");
    let rail = hosts.iter().map(|h| h[li]).collect();
    Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    }
}

/// See [`Algorithm::Hierarchical`]: across hosts along the rail first (each rank's block to
/// the ranks with its local index elsewhere), then inside each host (what each rank gathered,
/// host by host, each slice as soon as it arrived).
fn hierarchical_all_gather(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let own = b.copy(
        Region::new(Buf::Input, 0, count),
        Region::new(Buf::Output, r * count, count),
        &[],
    );
    let block = |x: usize| (x * count, count);
    let rblocks: Vec<(usize, usize)> = rail.iter().map(|&x| block(x)).collect();
    let k = phase_slices(&rblocks, req.chunk);
    let mut held = if rail.len() <= RAIL_DIRECT_MAX {
        let ready = vec![vec![Some(own)]; k];
        let war = vec![vec![None; k]; rail.len()];
        direct_all_gather(b, &rail, r, (k, &even_cut(&rblocks, k)), &ready, &war)
    } else {
        ring_all_gather_part(b, &rail, ri, &rblocks, req.chunk, Some(own))
    };
    held.add(r * count, count, Some(own));
    let held = held.sealed();
    let none = vec![vec![None; k]; locals.len()];
    for host in &hosts {
        // Host-mate `l` holds the block of `host[l]` (its rail's member on that host).
        let lblocks: Vec<(usize, usize)> = host.iter().map(|&x| block(x)).collect();
        let ready: Vec<Vec<Option<u32>>> = (0..k)
            .map(|s| {
                let (o, l) = split(count, k, s);
                held.over(lblocks[li].0 + o, l)
            })
            .collect();
        direct_all_gather(b, &locals, r, (k, &even_cut(&lblocks, k)), &ready, &none);
    }
}

/// See [`Algorithm::Hierarchical`].
fn hierarchical_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let (l, h) = (locals.len(), rail.len());
    let lblocks: Vec<(usize, usize)> = (0..l).map(|j| split(count, l, j)).collect();
    // How local block `j` splits along its rail (relative offsets): in proportion to the
    // rail's weights when given, else evenly (rings ignore weights).
    let rail_split = |j: usize| -> Vec<(usize, usize)> {
        let len = lblocks[j].1;
        let w: Vec<u32> = hosts
            .iter()
            .map(|host| req.weights.get(host[j]).copied().unwrap_or(0))
            .collect();
        if h <= RAIL_DIRECT_MAX && w.iter().any(|&x| x > 0) {
            weighted_blocks(len, &w)
        } else {
            (0..h).map(|q| split(len, h, q)).collect()
        }
    };
    let splits: Vec<Vec<(usize, usize)>> = (0..l).map(rail_split).collect();
    // The first and last tiers cut every local block on its rail blocks, `ks` slices each,
    // taking the rail blocks in the order the rail uses them from this host (its own rail
    // index first, then downwards): a slice's steps sit at the same place on every host,
    // so the schedule looks the same from every host (the simulator's symmetry), and the
    // rail starts on what the first tier finishes first.
    let ks = phase_slices(&lblocks, req.chunk).div_ceil(h).max(1);
    let k1 = h * ks;
    let cut = |j: usize, s: usize| {
        let q = (ri + h - s / ks) % h;
        let (qo, ql) = splits[j][q];
        let (so, sl) = split(ql, ks, s % ks);
        (lblocks[j].0 + qo + so, sl)
    };
    // 1. Inside the host: reduce-scatter into the local blocks.
    let (off, len) = lblocks[li];
    let own = (Buf::Output, off);
    let rs1 = direct_reduce_scatter(
        b,
        &locals,
        r,
        &lblocks,
        (k1, &cut),
        Buf::Input,
        own,
        &NOTHING,
    );
    let mut p1 = rs1.done;
    if l == 1 && !req.in_place && len > 0 {
        // No local partner: the output starts as the input.
        let (i, o) = (
            Region::new(Buf::Input, off, len),
            Region::new(Buf::Output, off, len),
        );
        p1.add(off, len, Some(b.copy(i, o, &[])));
    }
    let p1 = p1.sealed();
    let after1 = |o: usize, l: usize| p1.over(o, l);
    // 2. Across hosts, along the rail: all-reduce of this rank's local block, each part as
    //    soon as the first tier has reduced it.
    let p2 = if h == 1 {
        Done::default()
    } else if h <= RAIL_DIRECT_MAX {
        let rblocks: Vec<(usize, usize)> =
            splits[li].iter().map(|&(o, sl)| (off + o, sl)).collect();
        let k2 = phase_slices(&rblocks, req.chunk);
        let own = (Buf::Output, rblocks[ri].0);
        direct_all_reduce_part(b, &rail, r, &rblocks, k2, Buf::Output, own, &after1)
    } else {
        ring_all_reduce_part(b, &rail, ri, (off, len), req.chunk, 0, Buf::Output, &after1)
    }
    .sealed();
    // 3. Inside the host: all-gather of the local blocks, each slice once it is complete.
    let ready3: Vec<Vec<Option<u32>>> = (0..k1)
        .map(|s| {
            let (o, sl) = cut(li, s);
            let mut deps = p1.over(o, sl);
            deps.extend(p2.over(o, sl));
            deps
        })
        .collect();
    direct_all_gather(b, &locals, r, (k1, &cut), &ready3, &rs1.sent);
}

/// See [`Algorithm::Hierarchical`]: inside each host, a reduce-scatter of the blocks bound
/// for each host (rank `l` of a host sums, for every host, the block of that host's rank
/// `l`), then a direct reduce-scatter along the rail.
fn hierarchical_reduce_scatter(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        rail,
        ..
    } = tiers(req);
    let (l, h) = (locals.len(), hosts.len());
    let block = |x: usize| (x * count, count);
    let out = (Buf::Output, 0);
    if req.world == 1 {
        let (i, o) = (
            Region::new(Buf::Input, 0, count),
            Region::new(Buf::Output, 0, count),
        );
        b.copy(i, o, &[]);
        return;
    }
    if l == 1 {
        // One rank per host: only the rail.
        let rblocks: Vec<(usize, usize)> = rail.iter().map(|&x| block(x)).collect();
        let k = phase_slices(&rblocks, req.chunk);
        let cut = (k, &even_cut(&rblocks, k) as Cut);
        direct_reduce_scatter(b, &rail, r, &rblocks, cut, Buf::Input, out, &NOTHING);
        return;
    }
    // 1. Inside the host: this rank's sum for host `hb` lands in scratch block `hb`.
    b.scratch = h * count;
    let mut p1 = Done::default();
    for (hb, host) in hosts.iter().enumerate() {
        let lblocks: Vec<(usize, usize)> = host.iter().map(|&x| block(x)).collect();
        let k = phase_slices(&lblocks, req.chunk);
        let to = (Buf::Scratch, hb * count);
        let cut = (k, &even_cut(&lblocks, k) as Cut);
        let rs = direct_reduce_scatter(b, &locals, r, &lblocks, cut, Buf::Input, to, &NOTHING);
        p1.extend(rs.done);
    }
    let p1 = p1.sealed();
    // 2. Along the rail: rail-mate `hb` owns scratch block `hb`, each slice as soon as it is
    //    summed on this host.
    if h == 1 {
        let deps = p1.over(0, count);
        b.copy(
            Region::new(Buf::Scratch, 0, count),
            Region::new(Buf::Output, 0, count),
            &deps,
        );
        return;
    }
    let rblocks: Vec<(usize, usize)> = (0..h).map(|hb| (hb * count, count)).collect();
    let k = phase_slices(&rblocks, req.chunk);
    let after = |o: usize, l: usize| p1.over(o, l);
    let cut = (k, &even_cut(&rblocks, k) as Cut);
    direct_reduce_scatter(b, &rail, r, &rblocks, cut, Buf::Scratch, out, &after);
}

/// See [`Algorithm::Hierarchical`]: the root hands piece `l` of the buffer to its host-mate
/// `l`; each piece travels along its rail in a pipelined chain from the root's host; every
/// host then all-gathers its pieces. Each rank's network link carries one piece in and at
/// most one out: a host with a NIC per rank moves the buffer `l` times faster than one
/// chain.
fn hierarchical_broadcast(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let (l, h) = (locals.len(), hosts.len());
    let ra = hosts
        .iter()
        .position(|x| x.contains(&root))
        .expect("root's host");
    let pieces: Vec<(usize, usize)> = (0..l).map(|j| split(count, l, j)).collect();
    let k = phase_slices(&pieces, req.chunk);
    let slice = |j: usize, s: usize| {
        let (o, len) = split(pieces[j].1, k, s);
        Region::new(Buf::Output, pieces[j].0 + o, len)
    };
    let mut have = Done::default();
    // 1. The root (whose copy into its output is step 0) scatters the pieces on its host.
    let copied = (r == root).then_some(0u32);
    have.add(0, count, copied);
    let peers: Vec<usize> = (1..l).map(|d| (li + d) % l).collect();
    if ri == ra {
        for s in 0..k {
            if r == root {
                for &j in &peers {
                    b.send(locals[j], 0, slice(j, s), &[copied]);
                }
            } else {
                let got = b.recv(root, 0, slice(li, s), None, &[]);
                have.add(slice(li, s).offset, slice(li, s).len, Some(got));
            }
        }
    }
    // 2. Along the rail, a chain from the root's host.
    let v = (ri + h - ra) % h;
    let (next, prev) = (rail[(ri + 1) % h], rail[(ri + h - 1) % h]);
    let mut have = have.sealed();
    let mut chain = Done::default();
    for s in 0..k {
        let part = slice(li, s);
        if v == 0 {
            if h > 1 {
                b.send(next, 0, part, &have.over(part.offset, part.len));
            }
        } else {
            let got = b.recv(prev, 0, part, None, &[]);
            chain.add(part.offset, part.len, Some(got));
            if v + 1 < h {
                b.send(next, 0, part, &[Some(got)]);
            }
        }
    }
    have.extend(chain);
    let have = have.sealed();
    // 3. Inside each host, every rank but the root gathers the other pieces.
    for s in 0..k {
        let part = slice(li, s);
        let ready = have.over(part.offset, part.len);
        for &j in &peers {
            if locals[j] != root && part.len > 0 {
                b.send(locals[j], 0, part, &ready);
            }
        }
        if r != root {
            for &j in &peers {
                if slice(j, s).len > 0 {
                    b.recv(locals[j], 0, slice(j, s), None, &[]);
                }
            }
        }
    }
}

/// Slices per block of a direct phase: at least [`PROPORTIONAL_SLICES`], so that a block's
/// gather overlaps its reduction.
fn phase_slices(blocks: &[(usize, usize)], chunk: usize) -> usize {
    let largest = blocks.iter().map(|b| b.1).max().unwrap_or(0);
    slices(largest, chunk).max(PROPORTIONAL_SLICES.min(largest.max(1)))
}

/// How many slices a direct all-reduce's reduce-scatter runs ahead of its all-gather in a
/// peer's queue (see [`direct_all_reduce_part`]).
const DIRECT_LEAD: usize = 4;

/// Direct all-reduce among `members` (a reduce-scatter into `blocks` of `src`, this rank's
/// block folded into `own`, then an all-gather into the output), emitted slice by slice,
/// the reduce-scatter [`DIRECT_LEAD`] slices ahead: slice `s`'s gather follows the
/// reduce-scatter of slice `s + DIRECT_LEAD` in every (peer, channel) queue. No gathered
/// slice waits behind the reduce-scatter of all later slices (which, with one slow
/// contributor, held every gather until its last byte), and no reduce-scatter slice waits
/// for a gather a whole round trip away (which, over long links, cost a round trip per
/// slice). Returns where the output became final.
#[allow(clippy::too_many_arguments)]
fn direct_all_reduce_part(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    blocks: &[(usize, usize)],
    k: usize,
    src: Buf,
    own: (Buf, usize),
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> Done {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    let slice = |blk: usize, s: usize| {
        let (o, l) = blocks[blk];
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    };
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut done = Done::default();
    // Per slice: this rank's sends of its contributions, and the step after which its own
    // block's slice is reduced.
    let mut sent: Vec<Vec<Option<u32>>> = Vec::with_capacity(k);
    let mut reduced: Vec<Option<u32>> = Vec::with_capacity(k);
    let reduce_scatter = |b: &mut Builder, done: &mut Done, s: usize| {
        let mut out = vec![None; m];
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                out[j] = Some(b.send(members[j], 0, Region::new(src, o, l), &after(o, l)));
            }
        }
        let (mo, ml) = slice(i, s);
        let mut last = None;
        if ml > 0 {
            let dst = Region::new(own.0, own.1 + mo - blocks[i].0, ml);
            for (n, &j) in peers.iter().rev().enumerate() {
                let (with, mut deps) = if n == 0 {
                    (Region::new(src, mo, ml), after(mo, ml))
                } else {
                    (dst, Vec::new())
                };
                deps.push(last);
                last = Some(b.recv(members[j], 0, dst, Some(with), &deps));
            }
            done.add(dst.offset, ml, last);
        }
        (out, last)
    };
    for s in 0..k.min(DIRECT_LEAD) {
        let (o, r) = reduce_scatter(b, &mut done, s);
        sent.push(o);
        reduced.push(r);
    }
    for s in 0..k {
        // All-gather of slice s: this rank's reduced slice to every other member.
        let (mo, ml) = slice(i, s);
        if ml > 0 {
            let out = Region::new(Buf::Output, mo, ml);
            for &j in &peers {
                b.send(members[j], 0, out, &[reduced[s]]);
            }
        }
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                let part = Region::new(Buf::Output, o, l);
                let id = b.recv(members[j], 0, part, None, &[sent[s][j]]);
                done.add(o, l, Some(id));
            }
        }
        if s + DIRECT_LEAD < k {
            let (o, r) = reduce_scatter(b, &mut done, s + DIRECT_LEAD);
            sent.push(o);
            reduced.push(r);
        }
    }
    done
}

/// How a direct phase cuts its blocks: slice `s` of block `j` as (offset, len).
type Cut<'a> = &'a dyn Fn(usize, usize) -> (usize, usize);

/// Each block cut into `k` nearly equal slices.
fn even_cut(blocks: &[(usize, usize)], k: usize) -> impl Fn(usize, usize) -> (usize, usize) + '_ {
    move |j, s| {
        let (o, l) = blocks[j];
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    }
}

/// What a direct reduce-scatter left: per member and slice, the send of this rank's
/// contribution; where this rank's reduced slices are, and after which steps.
struct ReduceScatter {
    sent: Vec<Vec<Option<u32>>>,
    done: Done,
}

/// Direct reduce-scatter among `members` (this rank is `me`, one of them; member `j` owns
/// `blocks[j]` of `src`, cut into `k` slices): every contribution is sent from `src` (the
/// input, or a buffer holding a partial result) once `after` (given the part read) is done;
/// the owner folds them into its block's destination `own` (a buffer and where the block
/// starts in it) in one chain per slice.
#[allow(clippy::too_many_arguments)]
fn direct_reduce_scatter(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    blocks: &[(usize, usize)],
    (k, slice): (usize, Cut<'_>),
    src: Buf,
    own: (Buf, usize),
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> ReduceScatter {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    // Everyone starts with a different peer, so that no owner gets everything at once.
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut out = ReduceScatter {
        sent: vec![vec![None; k]; m],
        done: Done::default(),
    };
    for s in 0..k {
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                let id = b.send(members[j], 0, Region::new(src, o, l), &after(o, l));
                out.sent[j][s] = Some(id);
            }
        }
        let (mo, ml) = slice(i, s);
        if ml > 0 {
            let dst = Region::new(own.0, own.1 + mo - blocks[i].0, ml);
            let mut last = None;
            for (n, &j) in peers.iter().rev().enumerate() {
                let (with, mut deps) = if n == 0 {
                    (Region::new(src, mo, ml), after(mo, ml))
                } else {
                    (dst, Vec::new())
                };
                deps.push(last);
                last = Some(b.recv(members[j], 0, dst, Some(with), &deps));
            }
            out.done.add(dst.offset, ml, last);
        }
    }
    out
}

/// Direct all-gather among `members`: this rank's block, slice `s` once `ready[s]` is done,
/// to every other member; every other member's block into the output, slice `s` of member
/// `j`'s once `war[j][s]` (the last read of that memory) is done. Returns the receives.
fn direct_all_gather(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    (k, cut): (usize, Cut<'_>),
    ready: &[Vec<Option<u32>>],
    war: &[Vec<Option<u32>>],
) -> Done {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    let slice = |blk: usize, s: usize| {
        let (o, l) = cut(blk, s);
        Region::new(Buf::Output, o, l)
    };
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut got = Done::default();
    for s in 0..k {
        if slice(i, s).len > 0 {
            for &j in &peers {
                b.send(members[j], 0, slice(i, s), &ready[s]);
            }
        }
        for &j in &peers {
            let part = slice(j, s);
            if part.len > 0 {
                let id = b.recv(members[j], 0, part, None, &[war[j][s]]);
                got.add(part.offset, part.len, Some(id));
            }
        }
    }
    got
}

/// Ring all-gather among `members` (this rank is member `i`) of their blocks of the output,
/// on channel 0, pipelined in slices of at most `chunk`; this rank's own block is sent once
/// `own` is done. Returns the receives.
#[allow(clippy::needless_range_loop)] // slices index parallel per-step vectors
fn ring_all_gather_part(
    b: &mut Builder,
    members: &[usize],
    i: usize,
    blocks: &[(usize, usize)],
    chunk: usize,
    own: Option<u32>,
) -> Done {
    let m = members.len();
    let (next, prev) = (members[(i + 1) % m], members[(i + m - 1) % m]);
    let k = slices(blocks.iter().map(|x| x.1).max().unwrap_or(0), chunk);
    let slice = |j: usize, s: usize| {
        let (o, l) = split(blocks[j].1, k, s);
        Region::new(Buf::Output, blocks[j].0 + o, l)
    };
    let mut got = Done::default();
    let mut prev_recv: Vec<Option<u32>> = vec![own; k];
    for t in 0..m - 1 {
        let sb = (i + m - t) % m;
        let rb = (i + 2 * m - t - 1) % m;
        for s in 0..k {
            b.send(next, 0, slice(sb, s), &[prev_recv[s]]);
            let id = b.recv(prev, 0, slice(rb, s), None, &[]);
            got.add(slice(rb, s).offset, slice(rb, s).len, Some(id));
            prev_recv[s] = Some(id);
        }
    }
    got
}

/// Binomial tree on ranks relative to the root: `v`'s parent is `v` without its highest bit;
/// its children are `v + 2^j` for every `2^j` above that bit.
fn tree_children(n: usize, v: usize) -> Vec<usize> {
    let top = if v == 0 {
        0
    } else {
        usize::BITS - v.leading_zeros()
    };
    (top..usize::BITS)
        .map(|j| 1usize << j)
        .take_while(|&m| v + m < n && m > v)
        .map(|m| v + m)
        .collect()
}

fn tree_parent(v: usize) -> usize {
    v & !(1usize << (usize::BITS - 1 - v.leading_zeros()))
}

fn tree_broadcast(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let v = (r + n - root) % n;
    let out = Region::new(Buf::Output, 0, count);
    let (src, got) = if v == 0 {
        (Region::new(Buf::Input, 0, count), None)
    } else {
        let parent = (tree_parent(v) + root) % n;
        (out, Some(b.recv(parent, 0, out, None, &[])))
    };
    // Largest subtree first.
    for c in tree_children(n, v).into_iter().rev() {
        b.send((c + root) % n, 0, src, &[got]);
    }
}

fn tree_reduce(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let v = (r + n - root) % n;
    let acc = if v == 0 {
        Region::new(Buf::Output, 0, count)
    } else {
        b.scratch = count;
        Region::new(Buf::Scratch, 0, count)
    };
    let mut cur = Region::new(Buf::Input, 0, count);
    let mut last = None;
    for c in tree_children(n, v) {
        last = Some(b.recv((c + root) % n, 0, acc, Some(cur), &[last]));
        cur = acc;
    }
    if v == 0 {
        if last.is_none() {
            b.copy(cur, acc, &[]);
        }
    } else {
        b.send((tree_parent(v) + root) % n, 0, cur, &[last]);
    }
}

fn chain_broadcast(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let (n, r) = (req.world, req.rank);
    if n == 1 {
        return;
    }
    let v = (r + n - root) % n;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let k = slices(count, req.chunk);
    for s in 0..k {
        let (o, l) = split(count, k, s);
        let out = Region::new(Buf::Output, o, l);
        if v == 0 {
            b.send(next, 0, Region::new(Buf::Input, o, l), &[]);
        } else {
            let got = b.recv(prev, 0, out, None, &[]);
            if v + 1 < n {
                b.send(next, 0, out, &[Some(got)]);
            }
        }
    }
}

/// The chain runs from relative rank `n-1` down to the root: each rank adds its input to what
/// arrives from `v+1` and passes it to `v-1`.
fn chain_reduce(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let (n, r) = (req.world, req.rank);
    let v = (r + n - root) % n;
    let up = (r + 1) % n; // relative v+1
    let down = (r + n - 1) % n; // relative v-1
    let acc_buf = if v == 0 { Buf::Output } else { Buf::Scratch };
    if v != 0 && v + 1 < n {
        b.scratch = count;
    }
    let k = slices(count, req.chunk);
    for s in 0..k {
        let (o, l) = split(count, k, s);
        let input = Region::new(Buf::Input, o, l);
        if v + 1 == n {
            b.send(down, 0, input, &[]);
        } else {
            let acc = Region::new(acc_buf, o, l);
            let got = b.recv(up, 0, acc, Some(input), &[]);
            if v != 0 {
                b.send(down, 0, acc, &[Some(got)]);
            }
        }
    }
}

/// At step `i`, rank `r` exchanges with `(i - r) mod n`: a perfect matching per step (its own
/// block when the partner is itself), so every pair of ranks talks at the same step. In place,
/// blocks arrive in scratch and move to the buffer once the same block has been sent (waiting
/// in the receive itself could deadlock when a block spans more fragments than slots).
fn pairwise(
    b: &mut Builder,
    n: usize,
    r: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
    in_place: bool,
) {
    let offsets = |counts: &[usize]| {
        let mut acc = 0;
        counts
            .iter()
            .map(|&c| {
                let o = acc;
                acc += c;
                o
            })
            .collect::<Vec<_>>()
    };
    let so = offsets(send_counts);
    let ro = offsets(recv_counts);
    if in_place {
        b.scratch = recv_counts.iter().sum();
    }
    for i in 0..n {
        let p = (i + n - r % n) % n;
        if p == r {
            b.copy(
                Region::new(Buf::Input, so[r], send_counts[r]),
                Region::new(Buf::Output, ro[r], recv_counts[r]),
                &[],
            );
            continue;
        }
        let sent = b.send(p, 0, Region::new(Buf::Input, so[p], send_counts[p]), &[]);
        let out = Region::new(Buf::Output, ro[p], recv_counts[p]);
        if in_place {
            // Block p of the buffer is still being sent: receive beside it, move it after.
            let tmp = Region::new(Buf::Scratch, ro[p], recv_counts[p]);
            let got = b.recv(p, 0, tmp, None, &[]);
            b.copy(tmp, out, &[Some(sent), Some(got)]);
        } else {
            b.recv(p, 0, out, None, &[]);
        }
    }
}

fn dissemination(b: &mut Builder, n: usize, r: usize) {
    let mut last = None;
    let mut d = 1;
    while d < n {
        let empty = Region::new(Buf::Input, 0, 0);
        b.send((r + d) % n, 0, empty, &[last]);
        last = Some(b.recv(
            (r + n - d) % n,
            0,
            Region::new(Buf::Output, 0, 0),
            None,
            &[last],
        ));
        d <<= 1;
    }
}

#[cfg(test)]
mod proportional_tests {
    use super::*;

    #[test]
    fn weighted_blocks_cover_the_buffer_in_proportion() {
        assert_eq!(weighted_blocks(10, &[1, 1]), vec![(0, 5), (5, 5)]);
        assert_eq!(
            weighted_blocks(10, &[3, 0, 1]),
            vec![(0, 8), (8, 0), (8, 2)]
        );
        assert_eq!(weighted_blocks(7, &[1, 1, 1]), vec![(0, 3), (3, 2), (5, 2)]);
        assert_eq!(weighted_blocks(0, &[2, 5]), vec![(0, 0), (0, 0)]);
        // Random weights: contiguous, complete, within one element of the exact share.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + (x % 9) as usize;
            let len = (x >> 8) as usize % 100_000;
            let w: Vec<u32> = (0..n).map(|i| ((x >> (i * 5)) % 7) as u32).collect();
            if w.iter().all(|&v| v == 0) {
                continue;
            }
            let b = weighted_blocks(len, &w);
            let total: f64 = w.iter().map(|&v| f64::from(v)).sum();
            let mut off = 0;
            for (i, &(o, l)) in b.iter().enumerate() {
                assert_eq!(o, off, "{w:?} {len}");
                off += l;
                let exact = f64::from(w[i]) * len as f64 / total;
                assert!(
                    (l as f64 - exact).abs() < 1.0,
                    "{w:?} {len}: block {i} {l} vs {exact}"
                );
            }
            assert_eq!(off, len);
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn shares_and_times_match_the_derivation() {
        // Equal rates: equal shares, the ring's time 2(n-1)/n.
        let (s, t) = proportional_shares(&[1.0; 4]);
        assert!(s.iter().all(|&x| close(x, 0.25)), "{s:?}");
        assert!(close(t, 1.5));
        // One slow link of four (scenario c): it owns nothing, and bounds the time at N/r.
        let (s, t) = proportional_shares(&[1.0, 1.0, 1.0, 0.25]);
        assert!(close(s[3], 0.0) && close(t, 4.0), "{s:?} {t}");
        // Against the plain ring, 2(n-1)/n / r_min = 6: the bound of 1.5.
        assert!(close(1.5 / 0.25 / t, 1.5));
        // Scenario d: 2, 1, 1, 0.5.
        let (s, t) = proportional_shares(&[2.0, 1.0, 1.0, 0.5]);
        assert!(close(t, 2.0) && close(s[3], 0.0), "{s:?} {t}");
        assert!(s[0] > s[1] && close(s[1], s[2]), "{s:?}");
        // Two fast, two half-rate: T_s binds (nobody forced to zero).
        let (s, t) = proportional_shares(&[1.0, 1.0, 0.5, 0.5]);
        // Σ max(0, T r - 1) = 2 → 2(T-1) + 2 max(0, T/2 - 1) = 2 → T = 2 (edge: slow own 0).
        assert!(close(t, 2.0), "{t}");
        assert!(close(s[0], 0.5) && close(s[2], 0.0), "{s:?}");
        // The optimum: no share vector does better (random search).
        let rates = [1.7, 0.9, 1.2, 0.4, 1.0];
        let (best, t) = proportional_shares(&rates);
        let time = |b: &[f64]| {
            let n = b.len() as f64;
            (0..b.len())
                .map(|i| (1.0 + (n - 2.0) * b[i]) / rates[i])
                .fold(0.0, f64::max)
        };
        assert!(close(time(&best), t), "{} vs {t}", time(&best));
        let mut x = 7u64;
        for _ in 0..20_000 {
            let mut b: Vec<f64> = (0..5)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 11) as f64 / (1u64 << 53) as f64
                })
                .collect();
            let sum: f64 = b.iter().sum();
            b.iter_mut().for_each(|v| *v /= sum);
            assert!(time(&b) >= t - 1e-9, "{b:?} beats the derived optimum {t}");
        }
    }

    #[test]
    fn proportional_all_reduce_verifies_for_random_shares() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..300 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + (x % 8) as usize;
            let count = (x >> 4) as usize % 200;
            let mut weights: Vec<u32> = (0..n).map(|i| ((x >> (i * 4 + 10)) % 6) as u32).collect();
            if weights.iter().all(|&w| w == 0) {
                weights[0] = 1;
            }
            let in_place = x & (1 << 60) != 0;
            let chunk = 1 + (x >> 40) as usize % 37;
            let reqs: Vec<Request> = (0..n)
                .map(|rank| Request {
                    coll: Collective::AllReduce { count },
                    world: n,
                    rank,
                    in_place,
                    hosts: Vec::new(),
                    algo: Algorithm::Proportional,
                    chunk,
                    channels: 1,
                    weights: weights.clone(),
                })
                .collect();
            let slots = 1 + case % 4;
            crate::verify::verify(&reqs, slots, x).unwrap_or_else(|e| {
                panic!("n={n} count={count} weights={weights:?} in_place={in_place} chunk={chunk} slots={slots}: {e}")
            });
        }
        // Wrong weights are refused.
        let req = |weights: Vec<u32>| Request {
            coll: Collective::AllReduce { count: 10 },
            world: 3,
            rank: 0,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Proportional,
            chunk: 4,
            channels: 1,
            weights,
        };
        assert!(build(&req(vec![0, 0, 0])).is_err());
        assert!(build(&req(vec![1, 1])).is_err());
        assert!(build(&req(vec![1, 0, 2])).is_ok());
    }
}

#[cfg(test)]
mod hierarchical_tests {
    use super::*;

    /// Random worlds split into hosts of equal size (including one rank per host and one host),
    /// ranks dealt to hosts in a random order, against the reference executor.
    #[test]
    fn hierarchical_schedules_verify_for_random_layouts() {
        let mut x = 0x5851_f42d_4c95_7f2du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..300 {
            let n = 1 + (next() % 12) as usize;
            let divisors: Vec<usize> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
            let h = divisors[(next() % divisors.len() as u64) as usize];
            // Deal ranks to hosts in a shuffled order; host numbers are arbitrary labels.
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let mut hosts = vec![0u32; n];
            for (slot, &rank) in order.iter().enumerate() {
                hosts[rank] = 100 + 7 * (slot % h) as u32;
            }
            let count = (next() % 150) as usize;
            let in_place = next() & 1 == 1;
            let chunk = 1 + (next() % 23) as usize;
            let coll = match case % 4 {
                0 => Collective::AllReduce { count },
                1 => Collective::AllGather { count: count / 4 },
                2 => Collective::ReduceScatter { count: count / 4 },
                _ => Collective::Broadcast {
                    count,
                    root: (next() % n as u64) as usize,
                },
            };
            // The same layouts order rings host by host.
            for algo in [Algorithm::Hierarchical, Algorithm::Ring] {
                if !algo.supports(&coll) {
                    continue;
                }
                let reqs: Vec<Request> = (0..n)
                    .map(|rank| Request {
                        coll: coll.clone(),
                        world: n,
                        rank,
                        in_place,
                        hosts: hosts.clone(),
                        algo,
                        chunk,
                        channels: 1 + case % 2,
                        // Uneven rail shares, some zero, on some all-reduces.
                        weights: if algo == Algorithm::Hierarchical && case % 8 == 0 {
                            hosts.iter().map(|&x| (x % 3) * 2).collect()
                        } else {
                            Vec::new()
                        },
                    })
                    .collect();
                let slots = 1 + case % 3;
                crate::verify::verify(&reqs, slots, next()).unwrap_or_else(|e| {
                    panic!("{coll:?} {algo:?} n={n} hosts={hosts:?} in_place={in_place} chunk={chunk} slots={slots}: {e}")
                });
            }
        }
        // Rails longer than RAIL_DIRECT_MAX run rings: 10 hosts × 2 ranks and 9 × 3,
        // hosts interleaved.
        for (n, h) in [(20usize, 10usize), (27, 9)] {
            let hosts: Vec<u32> = (0..n).map(|x| (x % h) as u32).collect();
            for (i, coll) in [
                Collective::AllReduce { count: 97 },
                Collective::AllGather { count: 5 },
                Collective::ReduceScatter { count: 3 },
                Collective::Broadcast { count: 61, root: 7 },
            ]
            .into_iter()
            .enumerate()
            {
                for in_place in [false, true] {
                    let reqs: Vec<Request> = (0..n)
                        .map(|rank| Request {
                            coll: coll.clone(),
                            world: n,
                            rank,
                            in_place,
                            hosts: hosts.clone(),
                            algo: Algorithm::Hierarchical,
                            chunk: 3,
                            channels: 1,
                            weights: Vec::new(),
                        })
                        .collect();
                    crate::verify::verify(&reqs, 2, (n * 10 + i) as u64).unwrap_or_else(|e| {
                        panic!("{coll:?} n={n} hosts={h} in_place={in_place}: {e}")
                    });
                }
            }
        }
        // A ring ordered by host crosses the host links half as much as one in rank order
        // when two hosts' ranks alternate.
        let crossing = |hosts: Vec<u32>| -> usize {
            let layout = [0u32, 1, 0, 1, 0, 1];
            (0..6)
                .map(|rank| {
                    let req = Request {
                        coll: Collective::AllReduce { count: 600 },
                        world: 6,
                        rank,
                        in_place: false,
                        hosts: hosts.clone(),
                        algo: Algorithm::Ring,
                        chunk: 1000,
                        channels: 1,
                        weights: Vec::new(),
                    };
                    build(&req)
                        .unwrap()
                        .steps
                        .iter()
                        .map(|st| match st.op {
                            Op::Send { peer, src, .. } if layout[peer] != layout[rank] => src.len,
                            _ => 0,
                        })
                        .sum::<usize>()
                })
                .sum()
        };
        assert_eq!(crossing(Vec::new()), 6 * 10 * 100);
        assert_eq!(crossing(vec![0, 1, 0, 1, 0, 1]), 2 * 10 * 100);
        // Uneven hosts are refused.
        let req = Request {
            coll: Collective::AllReduce { count: 10 },
            world: 3,
            rank: 0,
            in_place: false,
            hosts: vec![0, 0, 1],
            algo: Algorithm::Hierarchical,
            chunk: 4,
            channels: 1,
            weights: Vec::new(),
        };
        assert!(
            build(&req)
                .unwrap_err()
                .contains("as many ranks on every host")
        );
    }
}
