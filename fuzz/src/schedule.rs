//! The `schedule` fuzz target: `oxccl_core::schedule::build` against the reference executor
//! (`oxccl_core::verify`).
//!
//! An input decodes ([`Input::decode`], total: every byte string is an input) into one request
//! per rank of a world of 1..=16 ranks: any collective (all-to-allv with a matrix of counts,
//! send/recv as disjoint sender/receiver pairs), a count, a root, any [`Algorithm`], in place or
//! not, a chunk, 1..=4 channels, 1..=8 slots, the verifier's random seed, and sometimes one way
//! of breaking the request (chunk 0, channels 0 or > 64, a root or peer outside the world,
//! all-to-allv counts of the wrong length, a rank outside the world, an empty world).
//!
//! [`check`] asserts:
//! - `build` never panics;
//! - it refuses every invalid request (broken as above, or an algorithm that does not
//!   `support` the collective, or send/recv with oneself);
//! - it accepts every valid one: every algorithm that supports a collective is one the
//!   runtime tuner (`Communicator::tune`) may pick, by default or through `OXCCL_ALGO`;
//! - every rank's schedule, run together by `verify_schedules` (random order, fragments of
//!   `chunk` elements through `slots` slots, hazards, deadlocks, symbolic results), is correct.
//!
//! Each execution stays well under a millisecond: counts are capped so that the symbolic
//! buffers of all ranks hold about [`ELEMS`] elements (half the inputs have counts of at most
//! [`SMALL_COUNT`]), chunks are raised so that a rank's transfers move in about [`MAX_SLICES`]
//! fragments, and a case whose verification would cost more than [`MAX_WORK`] (fragments ×
//! queues, plus the elements sent) is built but not run.

use oxccl_core::fuzzing::{
    Algorithm, Collective, CollectiveKind, Op, Request, Schedule, build, verify_schedules,
};

/// Bytes of the fixed part of an input; the rest is a list of little-endian `u16`s.
pub const HEADER_LEN: usize = 19;
/// Roughly the symbolic elements of all ranks' buffers together.
pub const ELEMS: usize = 8_000;
/// The largest of the small counts (see [`Input::count`]).
pub const SMALL_COUNT: usize = 64;
/// The largest count.
pub const MAX_COUNT: usize = 5_000;
/// A transfer of `count` elements moves in at most this many fragments divided by the world
/// size (chunks are raised), so a rank's transfers move in about this many fragments.
pub const MAX_SLICES: usize = 64;
/// Cases whose verification would cost more than this (see `work`) are only built.
pub const MAX_WORK: usize = 12_000;

/// The collectives, in the order [`Input::kind`] selects them (modulo their number): every
/// kind but [`CollectiveKind::Recv`] (the last), since [`CollectiveKind::Send`] stands for
/// disjoint send/recv pairs.
pub const KINDS: &[CollectiveKind] = CollectiveKind::ALL.split_last().expect("kinds").1;
const _: () = assert!(matches!(
    CollectiveKind::ALL[CollectiveKind::ALL.len() - 1],
    CollectiveKind::Recv
));

/// What a kind of [`KINDS`] is called in messages and the seed corpus's file names: its name,
/// but `send_recv` for the send/recv pairs.
pub fn label(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::Send => "send_recv",
        k => k.name(),
    }
}

/// The algorithms, in the order [`Input::algo`] selects them (modulo their number).
pub const ALGORITHMS: [Algorithm; 9] = Algorithm::ALL;

/// Ways to break a request, selected by `flags >> 4` (0..=9: none).
pub const BREAKAGES: [&str; 6] = [
    "chunk 0",
    "channels 0 or over 64",
    "root or peer outside the world",
    "all_to_allv counts of the wrong length",
    "rank outside the world",
    "world of 0 ranks",
];

/// The raw fields of an input, as laid out in its bytes (missing bytes read as 0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Input {
    /// Byte 0: the collective, an index into [`KINDS`] (modulo).
    pub kind: u8,
    /// Byte 1: the world, biased to small ones: `1 + b % 4` below 0xa0, `1 + b % 8` below
    /// 0xe0, else `1 + b % 16`.
    pub world: u8,
    /// Bytes 2..4: the count: with bit 15 clear, modulo [`SMALL_COUNT`] + 1; with it set, the
    /// low 15 bits modulo the cap for this world and collective (at most [`MAX_COUNT`]) + 1.
    pub count: u16,
    /// Byte 4: the root, modulo the world.
    pub root: u8,
    /// Byte 5: the algorithm, an index into [`ALGORITHMS`] (modulo).
    pub algo: u8,
    /// Byte 6: bit 0 in place (where the collective has an in-place form), bit 1 selects
    /// channels 0 over 65+ when breaking channels, bits 4..8 the breakage (see [`BREAKAGES`]).
    pub flags: u8,
    /// Bytes 7..9: the chunk (0 reads as 1; raised to keep a transfer within [`MAX_SLICES`]).
    pub chunk: u16,
    /// Byte 9: channels, `1 + b % 4`.
    pub channels: u8,
    /// Byte 10: slots, `1 + b % 8`.
    pub slots: u8,
    /// Bytes 11..19: the verifier's seed (also the seed of the send/recv pairing).
    pub seed: u64,
    /// The rest: all-to-allv's matrix of counts (row `i`: what rank `i` sends to each rank),
    /// or the count of each send/recv pair, each modulo the cap plus one; missing entries
    /// take `count`.
    pub tail: Vec<u16>,
}

impl Input {
    /// Reads an input from any bytes.
    pub fn decode(data: &[u8]) -> Input {
        let mut head = [0u8; HEADER_LEN];
        let n = data.len().min(HEADER_LEN);
        head[..n].copy_from_slice(&data[..n]);
        let rest = data.get(HEADER_LEN..).unwrap_or_default();
        Input {
            kind: head[0],
            world: head[1],
            count: u16::from_le_bytes([head[2], head[3]]),
            root: head[4],
            algo: head[5],
            flags: head[6],
            chunk: u16::from_le_bytes([head[7], head[8]]),
            channels: head[9],
            slots: head[10],
            seed: u64::from_le_bytes(head[11..19].try_into().unwrap()),
            tail: rest
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        }
    }

    /// The bytes [`Input::decode`] reads back as this input.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.kind, self.world];
        v.extend(self.count.to_le_bytes());
        v.extend([self.root, self.algo, self.flags]);
        v.extend(self.chunk.to_le_bytes());
        v.extend([self.channels, self.slots]);
        v.extend(self.seed.to_le_bytes());
        for t in &self.tail {
            v.extend(t.to_le_bytes());
        }
        v
    }

    /// The count field for `count` elements (at most the cap for the case's world).
    pub fn count_field(count: usize) -> u16 {
        assert!(count <= MAX_COUNT);
        if count <= SMALL_COUNT {
            count as u16
        } else {
            0x8000 | count as u16
        }
    }

    /// The world byte for `n` ranks (1..=16).
    pub fn world_byte(n: usize) -> u8 {
        assert!((1..=16).contains(&n));
        match n {
            1..=4 => (n - 1) as u8,
            5..=8 => 0xa0 + (n - 1) as u8,
            _ => 0xe0 + (n - 1) as u8,
        }
    }
}

/// A decoded case: one request per rank, and whether `build` must accept them.
#[derive(Clone, Debug)]
pub struct Case {
    /// The requests, in rank order (a single one when the rank is broken).
    pub reqs: Vec<Request>,
    /// Slots per (sender, receiver, channel).
    pub slots: usize,
    /// The verifier's seed.
    pub seed: u64,
    /// Why `build` must refuse the requests, or `None` when it must accept them.
    pub invalid: Option<String>,
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

impl Case {
    /// The case an input stands for.
    pub fn from_input(inp: &Input) -> Case {
        let n = match inp.world {
            0..0xa0 => 1 + inp.world as usize % 4,
            0xa0..0xe0 => 1 + inp.world as usize % 8,
            _ => 1 + inp.world as usize % 16,
        };
        let kind = KINDS[inp.kind as usize % KINDS.len()];
        let algo = ALGORITHMS[inp.algo as usize % ALGORITHMS.len()];
        // Collectives whose buffers (or direct all-reduce's scratch) are n·count per rank.
        let wide = matches!(
            kind,
            CollectiveKind::ReduceScatter
                | CollectiveKind::AllGather
                | CollectiveKind::AllToAll
                | CollectiveKind::AllToAllV
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
        ) || (kind == CollectiveKind::AllReduce && algo == Algorithm::Direct);
        let cap = (if wide { ELEMS / (n * n) } else { ELEMS / n }).min(MAX_COUNT);
        // Half the inputs (bit 15 clear) have a small count: the verifier's cost grows with it.
        let count = if inp.count & 0x8000 == 0 {
            inp.count as usize % (cap.min(SMALL_COUNT) + 1)
        } else {
            (inp.count & 0x7fff) as usize % (cap + 1)
        };
        let root = inp.root as usize % n;
        let entry = |i: usize| inp.tail.get(i).map_or(count, |&c| c as usize % (cap + 1));
        // Transfers are at most `largest` elements.
        let mut largest = count;
        let colls: Vec<Collective> = match kind {
            CollectiveKind::AllReduce => vec![Collective::AllReduce { count }; n],
            CollectiveKind::ReduceScatter => vec![Collective::ReduceScatter { count }; n],
            CollectiveKind::AllGather => vec![Collective::AllGather { count }; n],
            CollectiveKind::Broadcast => vec![Collective::Broadcast { count, root }; n],
            CollectiveKind::Reduce => vec![Collective::Reduce { count, root }; n],
            CollectiveKind::AllToAll => vec![Collective::AllToAll { count }; n],
            CollectiveKind::AllToAllV => {
                let m: Vec<Vec<usize>> = (0..n)
                    .map(|i| (0..n).map(|j| entry(i * n + j)).collect())
                    .collect();
                largest = m.iter().flatten().copied().max().unwrap_or(0);
                (0..n)
                    .map(|r| Collective::AllToAllV {
                        send_counts: m[r].clone(),
                        recv_counts: (0..n).map(|j| m[j][r]).collect(),
                    })
                    .collect()
            }
            CollectiveKind::Gather => vec![Collective::Gather { count, root }; n],
            CollectiveKind::Scatter => vec![Collective::Scatter { count, root }; n],
            CollectiveKind::Barrier => vec![Collective::Barrier; n],
            // Send (and Recv, which KINDS leaves out): send/recv pairs.
            _ => {
                // Disjoint pairs of a random permutation: perm[2k] sends to perm[2k+1]; an odd
                // rank out sends nothing (count 0). One rank alone sends to itself (invalid).
                let mut perm: Vec<usize> = (0..n).collect();
                let mut s = inp.seed ^ 0x9e37_79b9_7f4a_7c15 | 1;
                for i in (1..n).rev() {
                    perm.swap(i, (xorshift(&mut s) % (i as u64 + 1)) as usize);
                }
                let mut colls = vec![
                    Collective::Send {
                        count: 0,
                        peer: perm[0]
                    };
                    n
                ];
                if n == 1 {
                    colls[0] = Collective::Send { count, peer: 0 };
                }
                for k in 0..n / 2 {
                    let (a, b) = (perm[2 * k], perm[2 * k + 1]);
                    let c = entry(k);
                    largest = largest.max(c);
                    colls[a] = Collective::Send { count: c, peer: b };
                    colls[b] = Collective::Recv { count: c, peer: a };
                }
                if n % 2 == 1 && n > 1 {
                    colls[perm[n - 1]] = Collective::Send {
                        count: 0,
                        peer: perm[0],
                    };
                }
                colls
            }
        };
        let in_place = inp.flags & 1 == 1 && colls[0].in_place_offsets(n, 0).is_some();
        // Ring collectives move n-1 transfers of `largest` per rank, so the bound scales with n.
        let chunk = (inp.chunk as usize)
            .max(1)
            .max((largest * n).div_ceil(MAX_SLICES));
        let channels = 1 + inp.channels as usize % 4;
        // Proportional shares from the tail bytes (some zero), never all zero.
        let weights: Vec<u32> = if algo == Algorithm::Proportional {
            let mut w: Vec<u32> = (0..n)
                .map(|i| u32::from(inp.tail.get(i).map_or(1, |&c| c as u8 % 5)))
                .collect();
            if w.iter().all(|&x| x == 0) {
                w[root] = 1;
            }
            w
        } else {
            Vec::new()
        };
        // Hosts of equal size (a divisor of n picked by the input), ranks dealt round robin.
        let hosts: Vec<u32> = if algo == Algorithm::Hierarchical {
            let divisors: Vec<usize> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
            let h = divisors[inp.root as usize % divisors.len()];
            (0..n).map(|x| (x % h) as u32).collect()
        } else {
            Vec::new()
        };
        let mut reqs: Vec<Request> = colls
            .into_iter()
            .enumerate()
            .map(|(rank, coll)| Request {
                coll,
                world: n,
                rank,
                in_place,
                hosts: hosts.clone(),
                algo,
                chunk,
                channels,
                weights: weights.clone(),
            })
            .collect();
        let mut invalid = None;
        if !algo.supports(&reqs[0].coll) {
            invalid = Some(format!("{} cannot run {}", algo.name(), label(kind)));
        }
        if kind == CollectiveKind::Send && n == 1 {
            invalid = Some("send to oneself".into());
        }
        let breakage = (inp.flags >> 4) as usize;
        let broken = match breakage {
            10 => {
                reqs.iter_mut().for_each(|r| r.chunk = 0);
                true
            }
            11 => {
                let c = if inp.flags & 2 != 0 {
                    0
                } else {
                    65 + inp.channels as usize
                };
                reqs.iter_mut().for_each(|r| r.channels = c);
                true
            }
            12 => {
                let outside = n + inp.root as usize;
                let mut any = false;
                for r in &mut reqs {
                    match &mut r.coll {
                        Collective::Broadcast { root, .. }
                        | Collective::Reduce { root, .. }
                        | Collective::Gather { root, .. }
                        | Collective::Scatter { root, .. }
                        | Collective::Send { peer: root, .. }
                        | Collective::Recv { peer: root, .. } => {
                            *root = outside;
                            any = true;
                        }
                        _ => {}
                    }
                }
                any
            }
            13 => {
                let mut any = false;
                for r in &mut reqs {
                    if let Collective::AllToAllV {
                        send_counts,
                        recv_counts,
                    } = &mut r.coll
                    {
                        if inp.flags & 2 != 0 || send_counts.len() == 1 {
                            send_counts.push(count);
                        } else {
                            recv_counts.pop();
                        }
                        any = true;
                    }
                }
                any
            }
            14 => {
                let mut r = reqs[0].clone();
                r.rank = n + inp.root as usize;
                reqs = vec![r];
                true
            }
            15 => {
                reqs.iter_mut().for_each(|r| r.world = 0);
                true
            }
            _ => false,
        };
        if broken {
            invalid = Some(BREAKAGES[breakage - 10].into());
        }
        Case {
            reqs,
            slots: 1 + inp.slots as usize % 8,
            seed: inp.seed,
            invalid,
        }
    }
}

/// The verifier's work, roughly: it picks each of its actions (about three per fragment) among
/// the heads of every rank's queues, so fragments × (queues + ranks), and it copies every
/// element sent a few times.
fn work(reqs: &[Request], scheds: &[Schedule]) -> usize {
    let mut fragments = 0;
    let mut moved = 0;
    let mut queues = std::collections::HashSet::new();
    for (r, (s, req)) in scheds.iter().zip(reqs).enumerate() {
        for st in &s.steps {
            match st.op {
                Op::Send { peer, channel, src } => {
                    fragments += src.len.div_ceil(req.chunk).max(1);
                    moved += src.len;
                    queues.insert((r, peer, channel, true));
                }
                Op::Recv { peer, channel, .. } => {
                    queues.insert((r, peer, channel, false));
                }
                _ => {}
            }
        }
    }
    fragments * (queues.len() + reqs.len()) + moved / 4
}

/// How a case ended, for the generator and tests (a failure panics instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `build` refused an invalid request, as it must.
    Refused,
    /// Built, but too large to run in the verifier.
    BuiltOnly,
    /// Built and verified.
    Verified,
}

/// The fuzz target's body: panics on any finding.
pub fn check(data: &[u8]) -> Outcome {
    let case = Case::from_input(&Input::decode(data));
    let mut scheds = Vec::with_capacity(case.reqs.len());
    for req in &case.reqs {
        match (build(req), &case.invalid) {
            (Ok(s), None) => scheds.push(s),
            (Err(_), Some(_)) => {}
            (Ok(_), Some(why)) => panic!("build accepted an invalid request ({why}): {req:?}"),
            (Err(e), None) => panic!("build refused a valid request: {e}\n{req:?}"),
        }
    }
    if case.invalid.is_some() {
        return Outcome::Refused;
    }
    if work(&case.reqs, &scheds) > MAX_WORK {
        return Outcome::BuiltOnly;
    }
    if let Err(e) = verify_schedules(&case.reqs, scheds, case.slots, case.seed) {
        let r = &case.reqs[0];
        panic!(
            "verify: {e}\n{} world={} algo={} in_place={} chunk={} channels={} slots={} seed={}\n\
             rank 0: {:?}",
            r.coll.name(),
            r.world,
            r.algo.name(),
            r.in_place,
            r.chunk,
            r.channels,
            case.slots,
            case.seed,
            r.coll
        );
    }
    Outcome::Verified
}
