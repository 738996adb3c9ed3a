//! Property tests: random sequences of work requests against a peer process, checked against a
//! model of the peer's memory and receive queue, per provider (`properties!` at the bottom).
//!
//! A case picks one or two target regions out of a pool (full access, partial access flags,
//! provider or registered user memory) and runs up to 40 steps: WRITE, WRITE_WITH_IMM, READ, SEND
//! and SEND_WITH_IMM with random scatter-gather lists of 1..=16 pieces (zero lengths included),
//! fetch-and-add and compare-and-swap on aligned words, receives posted with random layouts,
//! reconnections, and now and then a request that must fail: bad or foreign rkey, out of range
//! (at and around both ends), missing access flag, misaligned atomic, a SEND longer than the
//! receive, a SEND into a receive whose buffer was deregistered, a bad local buffer. Requests are
//! posted one at a time or chained into lists of up to eight, signaled or not; sometimes the
//! receive a request needs is posted only after the list, so it waits (RNR) and everything after
//! it waits too.
//!
//! The model says, for every request, the completion it gets (status, opcode, byte_len), what a
//! READ or an atomic brings back, which receive a SEND or WRITE_WITH_IMM consumes and the
//! receive completion it produces, and what the peer's memory holds afterwards. After a failure
//! the queue pair is in ERR and the model expects `WorkRequestFlushed` until the next
//! reconnection (a fresh queue-pair pair). Each case ends by hashing every region of the peer.
//!
//! One peer process serves the whole run: proptest's `TestRunner` is driven by hand inside one
//! `#[test]`, with a fixed seed and no failure persistence (nothing is written to the tree).
//! `PROPTEST_CASES` and `PROPTEST_RNG_SEED` override the case count (128) and the seed.

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use oxccl_verbs::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// Entry point of the peer process (does nothing unless `OXCCL_TEST_PEER` is set).
#[test]
#[ignore = "the peer process of the property tests, started by the tests themselves"]
fn peer_process_entry() {
    peer_main();
}

const LW: u32 = AccessFlags::LOCAL_WRITE.bits();
const W: u32 = AccessFlags::REMOTE_WRITE.bits();
const R: u32 = AccessFlags::REMOTE_READ.bits();
const AT: u32 = AccessFlags::REMOTE_ATOMIC.bits();

/// The target regions in the peer: (remote access, length, registered user memory).
/// A case's first region is 0 or 1 (full access), its optional second one any of them; requests
/// that must fail for a missing flag pick any region that lacks it.
const POOL: &[(u32, usize, bool)] = &[
    (W | R | AT, 4096, false),
    (W | R | AT, 1004, false), // length not a multiple of 8
    (W | R, 2048, false),
    (R | AT, 512, false),
    (W, 777, false),
    (AT, 256, false),
    (0, 128, false),
    (W | AT, 644, false),
    (W | R, 1500, true),
    (R, 300, true),
];

/// Local source of WRITEs and SENDs.
const SRC_LEN: usize = 16 << 10;
/// Local READ destinations (one per position in a chained list).
const DST_LEN: usize = 8 << 10;
/// The peer's receive buffer (every posted receive scatters into it).
const RECV_LEN: usize = 9 << 10;
/// Most requests posted in one `post_send` list.
const BATCH_MAX: usize = 8;
/// What a READ destination holds before the READ.
const UNTOUCHED: u8 = 0xCC;
/// What an atomic's result word holds before the atomic.
const SENTINEL: u64 = 0x5EAD_BEEF_5EAD_BEEF;
const WAIT: Duration = Duration::from_secs(10);

// ------------------------------------------------------------------------------------------
// What the strategies generate: intentions, resolved against the regions when they run.
// ------------------------------------------------------------------------------------------

/// A length, resolved against the room there is.
#[derive(Clone, Copy, Debug)]
enum Len {
    Zero,
    /// 1..=16 bytes (less when there is no room).
    Small(u8),
    /// A fraction (of 65535) of the room.
    Frac(u16),
}

impl Len {
    fn resolve(self, room: usize) -> usize {
        match self {
            Len::Zero => 0,
            Len::Small(n) => (n as usize).min(room),
            Len::Frac(f) => frac(f, room),
        }
    }
}

fn frac(f: u16, max: usize) -> usize {
    (max as u64 * f as u64 / u16::MAX as u64) as usize
}

/// A scatter-gather list: each piece's share of the bytes (0 allowed) and where it lies.
type Pieces = Vec<(u8, u16)>;

/// A receive's scatter list: each piece's length and where it lies in the receive buffer.
#[derive(Clone, Debug)]
struct RecvLayout(Vec<(u16, u16)>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Write,
    WriteImm,
    Read,
    Faa,
    Cas,
}

impl Kind {
    fn need(self) -> u32 {
        match self {
            Kind::Write | Kind::WriteImm => W,
            Kind::Read => R,
            Kind::Faa | Kind::Cas => AT,
        }
    }
    fn atomic(self) -> bool {
        matches!(self, Kind::Faa | Kind::Cas)
    }
}

#[derive(Clone, Copy, Debug)]
enum BadKey {
    Zero,
    /// The right key with these bits flipped (never zero).
    Flip(u64),
    /// The key of another region (the address stays in this one).
    Other(u8),
}

#[derive(Clone, Copy, Debug)]
enum Range {
    /// Starts past the end.
    PastEnd,
    /// Starts inside, ends past the end.
    Straddle,
    /// Starts before the region.
    Before,
    /// An address near the top of the address space.
    Wrap,
}

/// Requests that must fail, leave the target untouched and move the queue pair to ERR.
#[derive(Clone, Debug)]
enum Bad {
    Rkey {
        kind: Kind,
        key: BadKey,
        on: u8,
        at: u16,
    },
    Range {
        kind: Kind,
        how: Range,
        on: u8,
        k: u8,
    },
    Flag {
        kind: Kind,
        pick: u8,
        at: u16,
    },
    Misaligned {
        cas: bool,
        on: u8,
        word: u16,
        by: u8,
    },
    /// A SEND longer than the receive it lands in (by 1..=64 bytes).
    TooLong {
        extra: u8,
    },
    /// A WRITE whose gather list runs past the end of the local region.
    LocalOutOfBounds {
        at: u16,
    },
    /// A READ into a local region without LOCAL_WRITE.
    LocalReadOnly {
        at: u16,
    },
}

#[derive(Clone, Debug)]
enum Op {
    /// WRITE, or WRITE_WITH_IMM when `imm` is set.
    Write {
        to: u8,
        at: u16,
        len: Len,
        sg: Pieces,
        imm: Option<u32>,
    },
    Read {
        from: u8,
        at: u16,
        len: Len,
        sg: Pieces,
    },
    /// SEND, or SEND_WITH_IMM when `imm` is set; the length is resolved against the receive.
    Send {
        len: Len,
        sg: Pieces,
        imm: Option<u32>,
    },
    Faa {
        on: u8,
        word: u16,
        add: u64,
    },
    /// With `hit`, `compare` is replaced by the word's current value (the swap happens).
    Cas {
        on: u8,
        word: u16,
        hit: bool,
        compare: u64,
        swap: u64,
    },
    /// The peer posts a receive.
    PostRecv(RecvLayout),
    /// The peer posts a receive whose buffer is a deregistered region: a SEND into it fails
    /// (LocalProtectionError at the peer, RemoteOperationError here), a WRITE_WITH_IMM, which
    /// does not touch the receive's buffers, does not.
    PostDeadRecv,
    /// A fresh queue pair on both sides.
    Reconnect,
    Bad(Bad),
}

#[derive(Clone, Debug)]
struct Step {
    op: Op,
    signaled: bool,
    /// Posted in the same list as the next step.
    chain: bool,
    /// The receive the peer posts first if this step needs one and none is posted.
    recv: RecvLayout,
    /// That receive is posted only after the list is: the request waits (RNR), and so does
    /// everything after it.
    late: bool,
}

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    regions: Vec<usize>,
    steps: Vec<Step>,
}

fn len() -> impl Strategy<Value = Len> {
    prop_oneof![
        1 => Just(Len::Zero),
        3 => (1u8..=16).prop_map(Len::Small),
        4 => any::<u16>().prop_map(Len::Frac),
        1 => Just(Len::Frac(u16::MAX)),
    ]
}

/// A position (a fraction of 65535 of the room), the two ends often.
fn at() -> impl Strategy<Value = u16> {
    prop_oneof![1 => Just(0), 1 => Just(u16::MAX), 4 => any::<u16>()]
}

fn pieces() -> impl Strategy<Value = Pieces> {
    prop::collection::vec((any::<u8>(), any::<u16>()), 1..=16)
}

fn recv_layout() -> impl Strategy<Value = RecvLayout> {
    prop::collection::vec((0u16..=512, any::<u16>()), 0..=16).prop_map(RecvLayout)
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Write),
        Just(Kind::WriteImm),
        Just(Kind::Read),
        Just(Kind::Faa),
        Just(Kind::Cas),
    ]
}

fn bad() -> impl Strategy<Value = Bad> {
    let key = prop_oneof![
        Just(BadKey::Zero),
        (1..=u64::MAX).prop_map(BadKey::Flip),
        any::<u8>().prop_map(BadKey::Other),
    ];
    let how = prop_oneof![
        Just(Range::PastEnd),
        Just(Range::Straddle),
        Just(Range::Before),
        Just(Range::Wrap),
    ];
    prop_oneof![
        2 => (kind(), key, any::<u8>(), at()).prop_map(|(kind, key, on, at)| Bad::Rkey {
            kind,
            key,
            on,
            at
        }),
        4 => (kind(), how, any::<u8>(), any::<u8>()).prop_map(|(kind, how, on, k)| Bad::Range {
            kind,
            how,
            on,
            k
        }),
        2 => (kind(), any::<u8>(), at()).prop_map(|(kind, pick, at)| Bad::Flag {
            kind,
            pick,
            at
        }),
        1 => (any::<bool>(), any::<u8>(), at(), 1u8..=7).prop_map(|(cas, on, word, by)| {
            Bad::Misaligned { cas, on, word, by }
        }),
        1 => prop_oneof![Just(1u8), 1u8..=64].prop_map(|extra| Bad::TooLong { extra }),
        1 => at().prop_map(|at| Bad::LocalOutOfBounds { at }),
        1 => at().prop_map(|at| Bad::LocalReadOnly { at }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), at(), len(), pieces()).prop_map(|(to, at, len, sg)| Op::Write {
            to, at, len, sg, imm: None
        }),
        2 => (any::<u8>(), at(), len(), pieces(), any::<u32>()).prop_map(
            |(to, at, len, sg, imm)| Op::Write { to, at, len, sg, imm: Some(imm) }
        ),
        5 => (any::<u8>(), at(), len(), pieces()).prop_map(|(from, at, len, sg)| {
            Op::Read { from, at, len, sg }
        }),
        4 => (len(), pieces(), prop::option::of(any::<u32>())).prop_map(|(len, sg, imm)| {
            Op::Send { len, sg, imm }
        }),
        2 => (any::<u8>(), at(), any::<u64>()).prop_map(|(on, word, add)| Op::Faa {
            on, word, add
        }),
        2 => (any::<u8>(), at(), any::<bool>(), any::<u64>(), any::<u64>()).prop_map(
            |(on, word, hit, compare, swap)| Op::Cas { on, word, hit, compare, swap }
        ),
        1 => recv_layout().prop_map(Op::PostRecv),
        1 => Just(Op::PostDeadRecv),
        4 => Just(Op::Reconnect),
        2 => bad().prop_map(Op::Bad),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    (
        op(),
        prop::bool::weighted(0.75),
        prop::bool::weighted(0.4),
        recv_layout(),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(op, signaled, chain, recv, late)| Step {
            op,
            signaled,
            chain,
            recv,
            late,
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        0..2usize,
        prop::option::of(0..POOL.len()),
        any::<u64>(),
        prop::collection::vec(step(), 1..=40),
    )
        .prop_map(|(first, second, seed, steps)| {
            let mut regions = vec![first];
            regions.extend(second.filter(|&s| s != first));
            Case {
                seed,
                regions,
                steps,
            }
        })
}

// ------------------------------------------------------------------------------------------
// Layout helpers (pure functions of the generated values).
// ------------------------------------------------------------------------------------------

/// Splits `n` bytes over pieces in proportion to their weights (equally when all are 0).
fn split(n: usize, pieces: &[(u8, u16)]) -> Vec<usize> {
    let sum: u64 = pieces.iter().map(|p| p.0 as u64).sum();
    let total = if sum == 0 { pieces.len() as u64 } else { sum };
    let (mut cum, mut prev) = (0u64, 0usize);
    pieces
        .iter()
        .map(|p| {
            cum += if sum == 0 { 1 } else { p.0 as u64 };
            let cut = (n as u64 * cum / total) as usize;
            let len = cut - prev;
            prev = cut;
            len
        })
        .collect()
}

/// Disjoint places for pieces of `lens`: ordered by their `place` value, with small gaps.
fn place(lens: &[usize], places: &[u16]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&j| (places[j], j));
    let mut offs = vec![0; lens.len()];
    let mut pos = 0;
    for j in order {
        pos += (places[j] % 16) as usize;
        offs[j] = pos;
        pos += lens[j];
    }
    offs
}

/// (offset, len) pieces of a receive in the peer's receive buffer.
fn recv_pieces(layout: &RecvLayout) -> Vec<(usize, usize)> {
    let lens: Vec<usize> = layout.0.iter().map(|p| p.0 as usize).collect();
    let places: Vec<u16> = layout.0.iter().map(|p| p.1).collect();
    place(&lens, &places).into_iter().zip(lens).collect()
}

// ------------------------------------------------------------------------------------------
// The world (peer process, local resources) and one case's run against the model.
// ------------------------------------------------------------------------------------------

struct Target {
    id: usize,
    rb: RemoteBuffer,
    access: u32,
    len: usize,
}

struct World {
    peer: Peer,
    l: Local,
    qp: Option<QueuePair>,
    spec: QpSpec,
    targets: Vec<Target>,
    recv_id: usize,
    /// A deregistered region of the peer.
    dead_id: usize,
    src: MemoryRegion,
    dst: Vec<MemoryRegion>,
    atom: MemoryRegion,
    next_wr: u64,
    next_recv: u64,
    /// How many requests of each kind ended how, over the whole run (printed at the end).
    stats: BTreeMap<String, u64>,
}

impl World {
    fn new(provider: &str) -> World {
        let mut peer = Peer::spawn(provider);
        let l = Local::new(provider);
        let targets = POOL
            .iter()
            .map(|&(access, len, user)| {
                let flags = AccessFlags::from_bits_truncate(access | LW);
                let (id, rb) = peer.alloc_kind(len, flags, user);
                Target {
                    id,
                    rb,
                    access,
                    len,
                }
            })
            .collect();
        let (recv_id, _) = peer.alloc(RECV_LEN, AccessFlags::LOCAL_WRITE);
        let (dead_id, _) = peer.alloc(64, AccessFlags::LOCAL_WRITE);
        peer.ok(Cmd::Dereg { id: dead_id });
        let src = l.pd.alloc_mr(SRC_LEN, AccessFlags::NONE).unwrap();
        let dst = (0..BATCH_MAX)
            .map(|_| l.pd.alloc_mr(DST_LEN, AccessFlags::LOCAL_WRITE).unwrap())
            .collect();
        let atom =
            l.pd.alloc_mr(8 * BATCH_MAX, AccessFlags::LOCAL_WRITE)
                .unwrap();
        World {
            peer,
            l,
            qp: None,
            spec: QpSpec {
                max_recv_wr: 256,
                timeout_ms: 5000,
                ..QpSpec::default()
            },
            targets,
            recv_id,
            dead_id,
            src,
            dst,
            atom,
            next_wr: 1,
            next_recv: 1 << 32,
            stats: BTreeMap::new(),
        }
    }

    fn qp(&self) -> &QueuePair {
        self.qp.as_ref().expect("connected")
    }

    /// A fresh queue pair on both sides (the peer's replaces its old one).
    fn reconnect(&mut self) {
        self.qp = None;
        self.qp = Some(self.l.connect(&mut self.peer, 0, &self.spec));
    }

    /// Throws away whatever completions are left on both sides (after a failed case).
    fn drain_all(&mut self) {
        let mut wc = [WorkCompletion::default(); 64];
        while self.l.cq.poll(&mut wc) > 0 {}
        while !self.peer.poll(64, 0).is_empty() {}
    }
}

#[derive(Clone, Copy, Debug)]
enum Buf {
    Src,
    Dst(usize),
    Atom,
}

/// What to check locally once a request succeeded.
enum Check {
    Nothing,
    Read { k: usize, expect: Vec<u8> },
    Atomic { k: usize, old: u64 },
}

/// A request resolved and run through the model.
struct Planned {
    wr_id: u64,
    op: WrOp,
    sges: Vec<(Buf, usize, usize)>,
    signaled: bool,
    status: WcStatus,
    byte_len: u32,
    check: Check,
    /// The target region, to check it is untouched after a failure.
    target: Option<usize>,
    desc: String,
}

/// A receive completion the peer must see.
#[derive(Debug)]
struct PeerWc {
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
}

/// The remote part of a request, before the model judges it.
struct Remote {
    kind: Kind,
    addr: u64,
    rkey: u64,
    len: usize,
}

/// A resolved request, before the model judges it.
struct Req {
    op: WrOp,
    sges: Vec<(Buf, usize, usize)>,
    data: Vec<u8>,
    total: usize,
    remote: Option<Remote>,
    /// A SEND that makes the receive at the head of the queue fail: (our status, the peer's).
    breaks_recv: Option<(WcStatus, WcStatus)>,
    local_bad: bool,
    /// For READs: where each scattered piece lands in the destination.
    scatter: Vec<(usize, usize)>,
    /// The region the request aims at (whatever its key says).
    aimed: Option<usize>,
    desc: String,
}

struct Run<'a> {
    w: &'a mut World,
    regions: &'a [usize],
    mem: Vec<Vec<u8>>,
    recv_mem: Vec<u8>,
    src_data: Vec<u8>,
    /// Receives posted at the peer and not consumed: (wr_id, pieces).
    recvq: VecDeque<(u64, Vec<(usize, usize)>)>,
    /// Those of them whose buffer is deregistered.
    dead: HashSet<u64>,
    local_err: bool,
    peer_err: bool,
    batch: Vec<Planned>,
    /// Receives to post before the batch (auto-posted for SENDs and WRITE_WITH_IMMs).
    pre: Vec<(u64, Vec<(usize, usize)>)>,
    /// Receives to post after the batch, and the first request that waits for them.
    late: Vec<(u64, Vec<(usize, usize)>)>,
    first_waiting: Option<u64>,
    peer_expect: VecDeque<PeerWc>,
    trace: Vec<String>,
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

impl<'a> Run<'a> {
    fn new(w: &'a mut World, case: &'a Case) -> Run<'a> {
        w.drain_all();
        w.reconnect();
        let mut mem = Vec::new();
        for (i, t) in w.targets.iter().enumerate() {
            let seed = case.seed ^ (i as u64 + 1);
            w.peer.ok(Cmd::Pattern { id: t.id, seed });
            mem.push(pattern(seed, t.len));
        }
        w.peer.ok(Cmd::Fill {
            id: w.recv_id,
            byte: 0,
        });
        let src_data = pattern(case.seed.rotate_left(32), SRC_LEN);
        w.src.write(0, &src_data).unwrap();
        Run {
            w,
            regions: &case.regions,
            mem,
            recv_mem: vec![0; RECV_LEN],
            src_data,
            recvq: VecDeque::new(),
            dead: HashSet::new(),
            local_err: false,
            peer_err: false,
            batch: Vec::new(),
            pre: Vec::new(),
            late: Vec::new(),
            first_waiting: None,
            peer_expect: VecDeque::new(),
            trace: Vec::new(),
        }
    }

    fn run(&mut self, steps: &[Step]) -> Result<(), String> {
        for step in steps {
            match &step.op {
                Op::PostRecv(layout) => {
                    self.flush()?;
                    self.post_recv(recv_pieces(layout), false)?;
                }
                Op::PostDeadRecv => {
                    self.flush()?;
                    self.post_recv(vec![(0, 64)], true)?;
                }
                Op::Reconnect => {
                    self.flush()?;
                    self.reconnect()?;
                }
                _ => {
                    self.plan(step)?;
                    if !step.chain || self.batch.len() == BATCH_MAX {
                        self.flush()?;
                    }
                }
            }
        }
        self.flush()?;
        // Nothing left over on our side, nothing unexplained on the peer's.
        let mut wc = [WorkCompletion::default(); 8];
        let n = self.w.l.cq.poll(&mut wc);
        ensure!(n == 0, "unexpected completions {:?}", &wc[..n]);
        self.drain_peer()?;
        // The peer's memory, every region, against the model.
        for (i, t) in self.w.targets.iter().enumerate() {
            let got = self.w.peer.hash(t.id);
            if got != fnv(&self.mem[i]) {
                let actual = self.w.peer.read(t.id, 0, t.len);
                let first = (0..t.len).find(|&j| actual[j] != self.mem[i][j]).unwrap();
                return Err(format!(
                    "region {i} differs from the model, first at byte {first}: {:#04x}, \
                     model {:#04x}",
                    actual[first], self.mem[i][first]
                ));
            }
        }
        let got = self.w.peer.hash(self.w.recv_id);
        ensure!(
            got == fnv(&self.recv_mem),
            "receive buffer differs from the model"
        );
        Ok(())
    }

    fn reconnect(&mut self) -> Result<(), String> {
        self.drain_peer()?;
        self.w.reconnect();
        self.recvq.clear();
        self.local_err = false;
        self.peer_err = false;
        self.trace.push("-- reconnected".into());
        *self.w.stats.entry("reconnect".into()).or_default() += 1;
        Ok(())
    }

    /// Takes what the peer has: only flushes of receives still posted are allowed (a provider
    /// may move the target's queue pair to ERR after a remote access error, or not).
    fn drain_peer(&mut self) -> Result<(), String> {
        self.check_peer()?;
        loop {
            let wcs = self.w.peer.poll(64, 0);
            if wcs.is_empty() {
                return Ok(());
            }
            for wc in wcs {
                let head = self.recvq.pop_front();
                ensure!(
                    wc.status == WcStatus::WorkRequestFlushed
                        && head.is_some_and(|h| h.0 == wc.wr_id),
                    "unexpected receive completion at the peer: {wc:?}"
                );
            }
        }
    }

    fn post_recv(&mut self, pieces: Vec<(usize, usize)>, dead: bool) -> Result<(), String> {
        let wr_id = self.w.next_recv;
        self.w.next_recv += 1;
        let region = if dead { self.w.dead_id } else { self.w.recv_id };
        self.post_recv_in(region, wr_id, &pieces)?;
        if self.peer_err {
            // Posted to a queue pair in ERR: flushed at once.
            self.peer_expect.push_back(PeerWc {
                wr_id,
                status: WcStatus::WorkRequestFlushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
            });
            self.check_peer()?;
        } else {
            if dead {
                self.dead.insert(wr_id);
            }
            self.recvq.push_back((wr_id, pieces));
        }
        Ok(())
    }

    fn post_recv_now(&mut self, wr_id: u64, pieces: &[(usize, usize)]) -> Result<(), String> {
        self.post_recv_in(self.w.recv_id, wr_id, pieces)
    }

    fn post_recv_in(
        &mut self,
        region: usize,
        wr_id: u64,
        pieces: &[(usize, usize)],
    ) -> Result<(), String> {
        let sges = pieces.iter().map(|&(o, l)| (region, o, l)).collect();
        let dead = if region == self.w.dead_id {
            " (deregistered)"
        } else {
            ""
        };
        self.trace
            .push(format!("peer: RECV {wr_id} into {pieces:?}{dead}"));
        match self.w.peer.call(Cmd::PostRecv { qp: 0, wr_id, sges }) {
            Reply::Ok => Ok(()),
            r => Err(format!("peer post_recv: {r:?}")),
        }
    }

    fn target(&self, kind: Kind, sel: u8) -> usize {
        let cands: Vec<usize> = self
            .regions
            .iter()
            .copied()
            .filter(|&r| POOL[r].0 & kind.need() != 0)
            .collect();
        cands[sel as usize % cands.len()]
    }

    fn gather(&self, n: usize, sg: &[(u8, u16)]) -> (Vec<(Buf, usize, usize)>, Vec<u8>) {
        let lens = split(n, sg);
        let mut data = Vec::with_capacity(n);
        let sges = lens
            .iter()
            .zip(sg)
            .map(|(&len, &(_, f))| {
                let off = frac(f, SRC_LEN - len);
                data.extend_from_slice(&self.src_data[off..off + len]);
                (Buf::Src, off, len)
            })
            .collect();
        (sges, data)
    }

    /// A one-sided request on region `t` at `off`, with a plain local buffer.
    fn simple(&self, kind: Kind, k: usize, t: usize, addr: u64, rkey: u64, n: usize) -> Req {
        let remote = RemoteAddr { addr, rkey };
        let (op, sges) = match kind {
            Kind::Write => (WrOp::Write { remote }, vec![(Buf::Src, 0, n)]),
            Kind::WriteImm => (
                WrOp::WriteWithImm { remote, imm: 7 },
                vec![(Buf::Src, 0, n)],
            ),
            Kind::Read => (WrOp::Read { remote }, vec![(Buf::Dst(k), 0, n)]),
            Kind::Faa => (
                WrOp::FetchAdd { remote, add: 1 },
                vec![(Buf::Atom, 8 * k, 8)],
            ),
            Kind::Cas => (
                WrOp::CompareSwap {
                    remote,
                    compare: 0,
                    swap: 1,
                },
                vec![(Buf::Atom, 8 * k, 8)],
            ),
        };
        let n = if kind.atomic() { 8 } else { n };
        Req {
            op,
            sges,
            data: self.src_data[..if kind.atomic() { 0 } else { n }].to_vec(),
            total: n,
            remote: Some(Remote {
                kind,
                addr,
                rkey,
                len: n,
            }),
            breaks_recv: None,
            local_bad: false,
            scatter: vec![(0, n)],
            aimed: Some(t),
            desc: format!(
                "{kind:?} r{t} {:+} len {n} rkey {rkey:#x}",
                addr as i128 - self.w.targets[t].rb.addr as i128
            ),
        }
    }

    /// Resolves a step into a request.
    fn resolve(&self, op: &Op, k: usize) -> Req {
        let tg = |t: usize| &self.w.targets[t];
        match op {
            Op::Write {
                to,
                at,
                len,
                sg,
                imm,
            } => {
                let kind = if imm.is_some() {
                    Kind::WriteImm
                } else {
                    Kind::Write
                };
                let t = self.target(kind, *to);
                let off = frac(*at, tg(t).len);
                let n = len.resolve(tg(t).len - off);
                let (sges, data) = self.gather(n, sg);
                let remote = tg(t).rb.at(off as u64);
                let op = match imm {
                    Some(imm) => WrOp::WriteWithImm { remote, imm: *imm },
                    None => WrOp::Write { remote },
                };
                Req {
                    op,
                    sges,
                    data,
                    total: n,
                    remote: Some(Remote {
                        kind,
                        addr: remote.addr,
                        rkey: remote.rkey,
                        len: n,
                    }),
                    breaks_recv: None,
                    local_bad: false,
                    scatter: vec![],
                    aimed: Some(t),
                    desc: format!("{kind:?} r{t}+{off} len {n} in {} pieces", sg.len()),
                }
            }
            Op::Read { from, at, len, sg } => {
                let t = self.target(Kind::Read, *from);
                let off = frac(*at, tg(t).len);
                let n = len.resolve(tg(t).len - off);
                let lens = split(n, sg);
                let places: Vec<u16> = sg.iter().map(|p| p.1).collect();
                let offs = place(&lens, &places);
                let remote = tg(t).rb.at(off as u64);
                Req {
                    op: WrOp::Read { remote },
                    sges: offs
                        .iter()
                        .zip(&lens)
                        .map(|(&o, &l)| (Buf::Dst(k), o, l))
                        .collect(),
                    data: vec![],
                    total: n,
                    remote: Some(Remote {
                        kind: Kind::Read,
                        addr: remote.addr,
                        rkey: remote.rkey,
                        len: n,
                    }),
                    breaks_recv: None,
                    local_bad: false,
                    scatter: offs.into_iter().zip(lens).collect(),
                    aimed: Some(t),
                    desc: format!("Read r{t}+{off} len {n} in {} pieces", sg.len()),
                }
            }
            Op::Send { len, sg, imm } => {
                let room = self.head_room();
                let dead = self.head_dead();
                // Into a dead receive: at least one byte (a zero-length SEND need not look at
                // the receive's buffers).
                let n = if dead {
                    len.resolve(room).max(1)
                } else {
                    len.resolve(room)
                };
                let (sges, data) = self.gather(n, sg);
                Req {
                    op: match imm {
                        Some(imm) => WrOp::SendWithImm { imm: *imm },
                        None => WrOp::Send,
                    },
                    sges,
                    data,
                    total: n,
                    remote: None,
                    breaks_recv: dead.then_some((
                        WcStatus::RemoteOperationError,
                        WcStatus::LocalProtectionError,
                    )),
                    local_bad: false,
                    scatter: vec![],
                    aimed: None,
                    desc: format!(
                        "Send len {n} (room {room}{}) in {} pieces, imm {imm:?}",
                        if dead { ", deregistered" } else { "" },
                        sg.len()
                    ),
                }
            }
            Op::Faa { on, word, add } => {
                let t = self.target(Kind::Faa, *on);
                let off = 8 * frac(*word, tg(t).len / 8 - 1);
                let remote = tg(t).rb.at(off as u64);
                Req {
                    op: WrOp::FetchAdd { remote, add: *add },
                    ..self.simple(Kind::Faa, k, t, remote.addr, remote.rkey, 8)
                }
            }
            Op::Cas {
                on,
                word,
                hit,
                compare,
                swap,
            } => {
                let t = self.target(Kind::Cas, *on);
                let off = 8 * frac(*word, tg(t).len / 8 - 1);
                let remote = tg(t).rb.at(off as u64);
                let compare = if *hit {
                    u64::from_ne_bytes(self.mem[t][off..off + 8].try_into().unwrap())
                } else {
                    *compare
                };
                Req {
                    op: WrOp::CompareSwap {
                        remote,
                        compare,
                        swap: *swap,
                    },
                    ..self.simple(Kind::Cas, k, t, remote.addr, remote.rkey, 8)
                }
            }
            Op::Bad(bad) => self.resolve_bad(bad, k),
            Op::PostRecv(_) | Op::PostDeadRecv | Op::Reconnect => {
                unreachable!("not a request")
            }
        }
    }

    fn resolve_bad(&self, bad: &Bad, k: usize) -> Req {
        let tg = |t: usize| &self.w.targets[t];
        // Invalid requests always move at least one byte: a zero-length RDMA request need not
        // validate its key and address (InfiniBand skips the check).
        let small = |at: u16| 1 + (at % 64) as usize;
        let mut req = match *bad {
            Bad::Rkey { kind, key, on, at } => {
                let t = self.target(kind, on);
                let n = if kind.atomic() { 8 } else { small(at) };
                let off = if kind.atomic() {
                    8 * frac(at, tg(t).len / 8 - 1)
                } else {
                    frac(at, tg(t).len - n)
                };
                let rkey = match key {
                    BadKey::Zero => 0,
                    BadKey::Flip(x) => tg(t).rb.rkey ^ x,
                    BadKey::Other(o) => {
                        let mut o = o as usize % POOL.len();
                        if o == t {
                            o = (o + 1) % POOL.len();
                        }
                        tg(o).rb.rkey
                    }
                };
                self.simple(kind, k, t, tg(t).rb.addr + off as u64, rkey, n)
            }
            Bad::Range {
                kind,
                how,
                on,
                k: x,
            } => {
                let t = self.target(kind, on);
                let (base, rlen, x) = (tg(t).rb.addr, tg(t).len as u64, x as u64);
                let (addr, n) = match (how, kind.atomic()) {
                    // Starts at or just past the end.
                    (Range::PastEnd, false) => (base + rlen + x % 4, 1 + (x / 4) as usize % 16),
                    (Range::PastEnd, true) => (base + rlen.next_multiple_of(8) + 8 * x, 8),
                    // Ends 1..=4 bytes past the end.
                    (Range::Straddle, false) => {
                        let (over, inside) = (1 + x % 4, (x / 4) % 61);
                        (base + rlen - inside, (inside + over) as usize)
                    }
                    (Range::Straddle, true) => (base + rlen / 8 * 8, 8),
                    // Starts 1..=4 bytes before the start, ends before or inside.
                    (Range::Before, false) => {
                        let before = 1 + x % 4;
                        (base - before, (before + (x / 4) % 16) as usize)
                    }
                    (Range::Before, true) => (base - 8 * (1 + x), 8),
                    (Range::Wrap, _) => (u64::MAX - 7 - 8 * x, 8),
                };
                self.simple(kind, k, t, addr, tg(t).rb.rkey, n)
            }
            Bad::Flag { kind, pick, at } => {
                let lacking: Vec<usize> = (0..POOL.len())
                    .filter(|&r| POOL[r].0 & kind.need() == 0)
                    .collect();
                let t = lacking[pick as usize % lacking.len()];
                let n = if kind.atomic() { 8 } else { small(at) };
                let off = if kind.atomic() {
                    8 * frac(at, tg(t).len / 8 - 1)
                } else {
                    frac(at, tg(t).len - n)
                };
                self.simple(kind, k, t, tg(t).rb.addr + off as u64, tg(t).rb.rkey, n)
            }
            Bad::Misaligned { cas, on, word, by } => {
                let kind = if cas { Kind::Cas } else { Kind::Faa };
                let t = self.target(kind, on);
                let off = 8 * frac(word, tg(t).len / 8 - 2) + by as usize;
                self.simple(kind, k, t, tg(t).rb.addr + off as u64, tg(t).rb.rkey, 8)
            }
            Bad::TooLong { extra } => {
                let room = self.head_room();
                let dead = self.head_dead();
                // Into a dead receive, which error wins is not defined: send one byte.
                let n = if dead { 1 } else { room + extra as usize };
                let (sges, data) = self.gather(n, &[(1, 0), (2, 30000), (1, 65535)]);
                Req {
                    op: WrOp::Send,
                    sges,
                    data,
                    total: n,
                    remote: None,
                    breaks_recv: Some(if dead {
                        (
                            WcStatus::RemoteOperationError,
                            WcStatus::LocalProtectionError,
                        )
                    } else {
                        (WcStatus::RemoteInvalidRequest, WcStatus::LocalLengthError)
                    }),
                    local_bad: false,
                    scatter: vec![],
                    aimed: None,
                    desc: format!("Send len {n}, {extra} more than the receive holds"),
                }
            }
            Bad::LocalOutOfBounds { at } => {
                let t = self.regions[0];
                let n = 1 + small(at);
                let off = frac(at, tg(t).len - n);
                let mut req = self.simple(
                    Kind::Write,
                    k,
                    t,
                    tg(t).rb.addr + off as u64,
                    tg(t).rb.rkey,
                    n,
                );
                req.sges = vec![(Buf::Src, 0, 1), (Buf::Src, SRC_LEN - n + 2, n - 1)];
                req.local_bad = true;
                req.desc += " (local gather list past the end)";
                req
            }
            Bad::LocalReadOnly { at } => {
                let t = self.regions[0];
                let n = small(at);
                let off = frac(at, tg(t).len - n);
                let mut req = self.simple(
                    Kind::Read,
                    k,
                    t,
                    tg(t).rb.addr + off as u64,
                    tg(t).rb.rkey,
                    n,
                );
                req.sges = vec![(Buf::Src, 0, n)];
                req.local_bad = true;
                req.desc += " (into a local region without LOCAL_WRITE)";
                req
            }
        };
        req.desc = format!("BAD {bad:?}: {}", req.desc);
        req
    }

    fn head_dead(&self) -> bool {
        self.recvq.front().is_some_and(|r| self.dead.contains(&r.0))
    }

    fn head_room(&self) -> usize {
        self.recvq
            .front()
            .map_or(0, |r| r.1.iter().map(|p| p.1).sum())
    }

    /// The model's verdict on a one-sided request: its status, and the region and offset it
    /// reaches when it succeeds.
    fn judge(&self, r: &Remote) -> (WcStatus, Option<(usize, usize)>) {
        if r.kind.atomic() && !r.addr.is_multiple_of(8) {
            return (WcStatus::RemoteInvalidRequest, None);
        }
        let denied = (WcStatus::RemoteAccessError, None);
        let Some(t) = self.w.targets.iter().position(|t| t.rb.rkey == r.rkey) else {
            return denied;
        };
        let tg = &self.w.targets[t];
        let Some(off) = r.addr.checked_sub(tg.rb.addr) else {
            return denied;
        };
        if off as u128 + r.len as u128 > tg.len as u128 || tg.access & r.kind.need() == 0 {
            return denied;
        }
        (WcStatus::Success, Some((t, off as usize)))
    }

    fn consume_recv(&mut self, wc: PeerWc) -> Vec<(usize, usize)> {
        let (wr_id, pieces) = self.recvq.pop_front().expect("a receive is posted");
        if self.dead.contains(&wr_id) {
            *self
                .w
                .stats
                .entry("WriteWithImm consumed a deregistered receive".into())
                .or_default() += 1;
        }
        self.peer_expect.push_back(PeerWc { wr_id, ..wc });
        pieces
    }

    /// Resolves a step, runs it through the model and adds it to the batch.
    fn plan(&mut self, step: &Step) -> Result<(), String> {
        let k = self.batch.len();
        let wr_id = self.w.next_wr;
        self.w.next_wr += 1;
        let needs_recv = match &step.op {
            Op::Send { .. } | Op::Bad(Bad::TooLong { .. }) => true,
            Op::Write { imm, .. } => imm.is_some(),
            Op::Bad(Bad::Rkey { kind, .. } | Bad::Range { kind, .. } | Bad::Flag { kind, .. }) => {
                *kind == Kind::WriteImm
            }
            _ => false,
        };
        let mut auto = None;
        if needs_recv && !self.local_err && self.recvq.is_empty() {
            let id = self.w.next_recv;
            self.w.next_recv += 1;
            let pieces = recv_pieces(&step.recv);
            self.recvq.push_back((id, pieces.clone()));
            auto = Some((id, pieces));
        }
        let req = self.resolve(&step.op, k);
        let mut check = Check::Nothing;
        let target = req.aimed;
        let status = if self.local_err {
            WcStatus::WorkRequestFlushed
        } else if req.local_bad {
            WcStatus::LocalProtectionError
        } else if let Some((status, _)) = req.breaks_recv {
            status
        } else if let Some(r) = &req.remote {
            let (status, at) = self.judge(r);
            if let Some((t, off)) = at {
                let n = req.total;
                match req.op {
                    WrOp::Write { .. } => self.mem[t][off..off + n].copy_from_slice(&req.data),
                    WrOp::WriteWithImm { imm, .. } => {
                        self.mem[t][off..off + n].copy_from_slice(&req.data);
                        self.consume_recv(PeerWc {
                            wr_id: 0,
                            status: WcStatus::Success,
                            opcode: WcOpcode::RecvRdmaWithImm,
                            byte_len: n as u32,
                            imm: Some(imm),
                        });
                    }
                    WrOp::Read { .. } => {
                        let mut expect = vec![UNTOUCHED; DST_LEN];
                        let mut from = off;
                        for &(o, l) in &req.scatter {
                            expect[o..o + l].copy_from_slice(&self.mem[t][from..from + l]);
                            from += l;
                        }
                        check = Check::Read { k, expect };
                    }
                    WrOp::FetchAdd { add, .. } | WrOp::CompareSwap { swap: add, .. } => {
                        let word = &mut self.mem[t][off..off + 8];
                        let old = u64::from_ne_bytes(word.try_into().unwrap());
                        let new = match req.op {
                            WrOp::FetchAdd { .. } => old.wrapping_add(add),
                            WrOp::CompareSwap { compare, .. } if compare == old => add,
                            _ => old,
                        };
                        word.copy_from_slice(&new.to_ne_bytes());
                        check = Check::Atomic { k, old };
                    }
                    WrOp::Send | WrOp::SendWithImm { .. } => unreachable!(),
                }
            }
            status
        } else {
            // A SEND that fits the receive at the head of the queue.
            let imm = match req.op {
                WrOp::SendWithImm { imm } => Some(imm),
                _ => None,
            };
            let pieces = self.consume_recv(PeerWc {
                wr_id: 0,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len: req.total as u32,
                imm,
            });
            let mut from = 0;
            for (o, l) in pieces {
                let l = l.min(req.total - from);
                self.recv_mem[o..o + l].copy_from_slice(&req.data[from..from + l]);
                from += l;
            }
            WcStatus::Success
        };
        if let Some(recv) = auto {
            // A late receive makes the request wait (RNR) if it would succeed or needs the
            // receive to fail (too long); a request refused for its key or range may fail
            // before or after waiting, so its receive is posted in time. Once one receive
            // comes late, every later one does too (the queue is FIFO).
            let waits = status == WcStatus::Success || req.breaks_recv.is_some();
            if (step.late && waits) || !self.late.is_empty() {
                self.first_waiting.get_or_insert(wr_id);
                self.late.push(recv);
            } else {
                self.pre.push(recv);
            }
        }
        if status != WcStatus::Success && !self.local_err {
            self.local_err = true;
            if let Some((_, recv_status)) = req.breaks_recv {
                // The receiver fails the receive (its queue pair goes to ERR: the rest flush).
                let (head, _) = self.recvq.pop_front().expect("a receive is posted");
                self.peer_expect.push_back(PeerWc {
                    wr_id: head,
                    status: recv_status,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                });
                for (wr_id, _) in self.recvq.drain(..) {
                    self.peer_expect.push_back(PeerWc {
                        wr_id,
                        status: WcStatus::WorkRequestFlushed,
                        opcode: WcOpcode::Recv,
                        byte_len: 0,
                        imm: None,
                    });
                }
                self.peer_err = true;
            }
        }
        self.trace
            .push(format!("#{wr_id} {} -> {status:?}", req.desc));
        let what = match &step.op {
            Op::Bad(b) => format!("{b:?}")
                .split([' ', '{'])
                .next()
                .unwrap()
                .to_string(),
            _ => format!("{:?}", req.op)
                .split([' ', '{'])
                .next()
                .unwrap()
                .to_string(),
        };
        *self
            .w
            .stats
            .entry(format!("{what} {status:?}"))
            .or_default() += 1;
        self.batch.push(Planned {
            wr_id,
            op: req.op,
            sges: req.sges,
            signaled: step.signaled,
            status,
            byte_len: req.total as u32,
            check,
            target,
            desc: req.desc,
        });
        Ok(())
    }

    /// Posts the batch as one list and checks every completion and result against the model.
    fn flush(&mut self) -> Result<(), String> {
        if self.batch.is_empty() {
            return Ok(());
        }
        for (wr_id, pieces) in std::mem::take(&mut self.pre) {
            self.post_recv_now(wr_id, &pieces)?;
        }
        // The last request is signaled: its completion says the list is done (RC ordering).
        self.batch.last_mut().unwrap().signaled = true;
        let batch = std::mem::take(&mut self.batch);
        *self
            .w
            .stats
            .entry(format!("list of {}", batch.len()))
            .or_default() += 1;
        let w = &*self.w;
        for p in &batch {
            match p.check {
                Check::Read { k, .. } => w.dst[k].fill(UNTOUCHED),
                Check::Atomic { k, .. } => w.atom.write(8 * k, &SENTINEL.to_ne_bytes()).unwrap(),
                Check::Nothing => {}
            }
        }
        let buf = |b: Buf| match b {
            Buf::Src => &w.src,
            Buf::Dst(k) => &w.dst[k],
            Buf::Atom => &w.atom,
        };
        let lists: Vec<Vec<Sge>> = batch
            .iter()
            .map(|p| {
                p.sges
                    .iter()
                    .map(|&(b, o, l)| Sge::new(buf(b), o, l))
                    .collect()
            })
            .collect();
        let wrs: Vec<SendWr> = batch
            .iter()
            .zip(&lists)
            .map(|(p, sg)| {
                let wr = SendWr::new(p.wr_id, p.op, sg);
                if p.signaled { wr } else { wr.unsignaled() }
            })
            .collect();
        w.qp()
            .post_send(&wrs)
            .map_err(|e| format!("post_send: {e}"))?;
        let want: Vec<&Planned> = batch
            .iter()
            .filter(|p| p.signaled || p.status != WcStatus::Success)
            .collect();
        let mut got = Vec::new();
        if let Some(first) = self.first_waiting.take() {
            // Requests before the waiting one may complete; it and those after it may not.
            let mut wc = [WorkCompletion::default(); BATCH_MAX];
            loop {
                let n = w.l.cq.poll(&mut wc);
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&wc[..n]);
            }
            if let Some(wc) = got.iter().find(|wc| wc.wr_id >= first) {
                return Err(format!(
                    "#{first} waits for a receive, yet #{} completed: {wc:?}",
                    wc.wr_id
                ));
            }
            *self
                .w
                .stats
                .entry("waited for a receive".into())
                .or_default() += 1;
            for (wr_id, pieces) in std::mem::take(&mut self.late) {
                self.post_recv_now(wr_id, &pieces)?;
            }
        }
        let w = &*self.w;
        got.extend(wait_local(&w.l.cq, want.len() - got.len())?);
        for (p, wc) in want.iter().zip(&got) {
            let ok = wc.wr_id == p.wr_id
                && wc.status == p.status
                && (p.status != WcStatus::Success
                    || (wc.opcode, wc.byte_len) == (p.op.wc_opcode(), p.byte_len));
            ensure!(
                ok,
                "{}: expected {:?} (byte_len {}), got {wc:?}",
                p.desc,
                p.status,
                p.byte_len
            );
        }
        let mut extra = [WorkCompletion::default(); 4];
        let n = w.l.cq.poll(&mut extra);
        ensure!(n == 0, "completions nobody asked for: {:?}", &extra[..n]);
        for p in batch.iter().filter(|p| p.status == WcStatus::Success) {
            match &p.check {
                Check::Read { k, expect } => {
                    let got = w.dst[*k].to_vec();
                    if &got != expect {
                        let i = (0..DST_LEN).find(|&i| got[i] != expect[i]).unwrap();
                        return Err(format!(
                            "{}: destination byte {i} is {:#04x}, model {:#04x}",
                            p.desc, got[i], expect[i]
                        ));
                    }
                }
                Check::Atomic { k, old } => {
                    let got = w.atom.atomic_u64(8 * k).unwrap().load(Ordering::Acquire);
                    ensure!(got == *old, "{}: returned {got:#x}, model {old:#x}", p.desc);
                }
                Check::Nothing => {}
            }
        }
        if let Some(p) = batch
            .iter()
            .find(|p| !matches!(p.status, WcStatus::Success | WcStatus::WorkRequestFlushed))
        {
            ensure!(
                w.qp().state() == QpState::Err,
                "{}: queue pair in {:?} after the failure",
                p.desc,
                w.qp().state()
            );
            if let Some(t) = p.target {
                let h = self.w.peer.hash(self.w.targets[t].id);
                ensure!(
                    h == fnv(&self.mem[t]),
                    "{}: a rejected request changed region {t}",
                    p.desc
                );
            }
        }
        self.check_peer()
    }

    /// Collects the receive completions the model expects at the peer, in order.
    fn check_peer(&mut self) -> Result<(), String> {
        while !self.peer_expect.is_empty() {
            let wcs = self
                .w
                .peer
                .poll(self.peer_expect.len(), WAIT.as_millis() as u64);
            ensure!(
                !wcs.is_empty(),
                "the peer is still waiting for {:?}",
                self.peer_expect
            );
            for wc in wcs {
                let e = self.peer_expect.pop_front().unwrap();
                let ok = wc.wr_id == e.wr_id
                    && wc.status == e.status
                    && (e.status != WcStatus::Success
                        || (wc.opcode, wc.byte_len, wc.imm) == (e.opcode, e.byte_len, e.imm));
                ensure!(ok, "receive at the peer: expected {e:?}, got {wc:?}");
            }
        }
        Ok(())
    }
}

fn wait_local(cq: &CompletionQueue, n: usize) -> Result<Vec<WorkCompletion>, String> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        match cq.wait(&mut buf[..want], Duration::from_millis(100)) {
            Ok(k) => out.extend_from_slice(&buf[..k]),
            Err(Error::Timeout { .. }) if Instant::now() < deadline => {}
            Err(e) => return Err(format!("{} of {n} completions, then: {e}", out.len())),
        }
    }
    Ok(out)
}

fn run_case(w: &mut World, case: &Case) -> Result<(), String> {
    let mut run = Run::new(w, case);
    run.run(&case.steps).map_err(|e| {
        let from = run.trace.len().saturating_sub(60);
        format!(
            "{e}\nregions {:?}; the last requests:\n  {}",
            case.regions,
            run.trace[from..].join("\n  ")
        )
    })
}

pub fn random_sequences(provider: &str) {
    let base = Config::default();
    let env = |k: &str| std::env::var_os(k).is_some();
    let config = Config {
        cases: if env("PROPTEST_CASES") {
            base.cases
        } else {
            128
        },
        rng_seed: if env("PROPTEST_RNG_SEED") {
            base.rng_seed
        } else {
            RngSeed::Fixed(0x0cc1_5eed)
        },
        failure_persistence: None,
        fork: false,
        timeout: 0,
        max_shrink_time: 30_000,
        max_shrink_iters: 2000,
        ..base
    };
    let world = RefCell::new(World::new(provider));
    let t = Instant::now();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&case(), |case| {
        run_case(&mut world.borrow_mut(), &case).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => eprintln!(
            "{provider}: {} random sequences in {:?}: {:?}",
            runner.config().cases,
            t.elapsed(),
            world.borrow().stats
        ),
        Err(TestError::Fail(why, case)) => {
            panic!("{provider}: a sequence failed: {why}\nminimal case: {case:#?}")
        }
        Err(e) => panic!("{provider}: {e}"),
    }
}

/// Instantiates the property tests for one provider.
macro_rules! properties {
    ($module:ident, $provider:literal) => {
        mod $module {
            #[test]
            fn random_sequences() {
                super::random_sequences($provider)
            }
        }
    };
}

properties!(shm, "shm");
properties!(tcp, "tcp");
#[cfg(feature = "ofi")]
properties!(ofi, "ofi");
#[cfg(feature = "ofi")]
properties!(ofi_shm, "ofi:shm");
