//! The compact forms the run keeps: queues and their cursors, steps as 16-byte records,
//! shapes shared by participants whose schedules differ only in their peers, and each
//! participant's state.

use std::collections::{HashMap, VecDeque};

use oxccl_core::protocol::{Config, Flows};
use oxccl_core::schedule::{Op, Schedule, Step};

use super::*;

/// A send queue of a participant. Its flow control (fragments posted, the credit it knows)
/// is its entry in [`Part::sends`].
#[derive(Debug)]
pub(super) struct SendQ {
    pub(super) peer: usize,
    pub(super) ch: u8,
    /// The step being posted (`NONE` once all are) and its fragments posted so far.
    pub(super) post: u32,
    pub(super) post_frag: u32,
    /// The step being posted, as the run needs it (see [`Cursor`]).
    pub(super) post_at: Cursor,
    /// A post is under way.
    pub(super) posting: bool,
    /// The next fragment to leave (step, fragment), or the one leaving while `busy`: those
    /// from here up to `(post, post_frag)` are posted and wait for the connection (steps of
    /// a queue are in schedule order, so the pairs compare as positions).
    pub(super) xmit: u32,
    pub(super) xmit_frag: u32,
    pub(super) xmit_at: Cursor,
    pub(super) busy: bool,
    /// Its route (index into `Sim::route_list`).
    pub(super) route: u32,
    /// The receiving participant and its receive queue, once known.
    pub(super) target: Option<(u32, u32)>,
    /// Cost of posting one fragment (the network's or the host's).
    pub(super) per_message_s: f64,
    /// A credit's time from the receiver back to this sender: the reverse direction's
    /// per-message time and the reverse route's latency.
    pub(super) credit_delay: f64,
    /// Credits on their way back: the consumed counts they carry, oldest first.
    pub(super) credits: VecDeque<u64>,
}

impl SendQ {
    /// The queue of the sends to `peer` on `ch`, before its first step is known.
    pub(super) fn new(peer: usize, ch: u8) -> SendQ {
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
pub(super) struct RecvQ {
    pub(super) peer: usize,
    pub(super) ch: u8,
    /// The receive at the head (`NONE` once all are done) and its fragments consumed so far.
    pub(super) head: u32,
    pub(super) head_frag: u32,
    pub(super) head_at: Cursor,
    /// A fragment is being consumed (the thread reduces it).
    pub(super) consuming: bool,
    /// The send queue (participant, queue) whose messages it receives: where its credits go.
    pub(super) source: Option<(u32, u32)>,
}

impl RecvQ {
    /// The queue of the receives from `peer` on `ch`, before its first step is known.
    pub(super) fn new(peer: usize, ch: u8) -> RecvQ {
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
pub(super) struct Cursor {
    /// Bytes of the transfer.
    pub(super) bytes: usize,
    /// Its fragments.
    pub(super) frags: u32,
    /// Its last signaled fragment (`NONE`: every fragment is inline, or a mailbox message).
    pub(super) last_signaled: u32,
    /// The next step of the queue.
    pub(super) next: u32,
    /// Its dependencies are done.
    pub(super) ready: bool,
    /// A receive that reduces.
    pub(super) reduces: bool,
}

pub(super) const NO_Q: u32 = u32::MAX;
/// No step (the end of a queue).
pub(super) const NONE: u32 = u32::MAX;

/// Step kinds.
pub(super) const SEND: u8 = 0;
pub(super) const RECV: u8 = 1;
pub(super) const RECV_REDUCE: u8 = 2;
pub(super) const COPY: u8 = 3;
pub(super) const COPY_SKIPPED: u8 = 4;
pub(super) const REDUCE: u8 = 5;

/// Fragments of a message of `bytes` (one in mailbox mode).
pub(super) fn frags(cfg: &Config, mailbox: bool, bytes: usize) -> u32 {
    if mailbox {
        1
    } else {
        cfg.fragments(bytes) as u32
    }
}

/// Bytes of fragment `k` of a message of `bytes`.
pub(super) fn frag_len(cfg: &Config, mailbox: bool, bytes: usize, k: u32) -> usize {
    if mailbox {
        bytes
    } else {
        cfg.fragment(bytes, k as usize).1
    }
}

/// The last fragment of a message of `bytes` whose completion its send awaits (`None`: every
/// fragment is inline). Only the last fragment can be shorter than the others, so it is the
/// last or the one before.
pub(super) fn last_signaled(cfg: &Config, bytes: usize) -> Option<u32> {
    let n = cfg.fragments(bytes);
    (n.saturating_sub(2)..n)
        .rev()
        .find(|&k| cfg.fragment(bytes, k).1 > cfg.inline_max)
        .map(|k| k as u32)
}

/// A step in compact form, 16 bytes: what the run reads of it, never written during the
/// run (the mutable state, dependencies left and done, is the participant's: see [`Part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct St {
    /// Elements moved, reduced or copied (`u32::MAX`: more, in [`Shape::big`]).
    pub(super) elems: u32,
    /// Its queue (send or receive; `NO_Q` for a local step).
    pub(super) queue: u32,
    /// The next step of its queue (`NONE` for the last): the queues' cursors follow these,
    /// so that the run reads no list beside the steps.
    pub(super) next: u32,
    /// The kind.
    pub(super) kind: u8,
}

/// A schedule in compact form, as far as the run only reads it: the steps, their
/// dependents and the queues' first steps. Participants whose schedules differ only in
/// their peers (the same steps, kinds, sizes, queue numbers and dependencies) share one
/// ([`Shapes`]): every representative of the symmetric 16,384-rank all-reduces has the same
/// shape, so the run reads one copy of it (hot in the cache) instead of one per participant
/// (a quarter of a gigabyte, read from memory).
#[derive(Debug, PartialEq)]
pub(super) struct Shape {
    /// A digest of the rest (its lengths and a sample of its steps), compared first.
    pub(super) digest: u64,
    /// The steps.
    pub(super) st: Vec<St>,
    /// Dependents of every step: step `s`'s are `dep_list[dep_at[s]..dep_at[s + 1]]`.
    pub(super) dep_at: Vec<u32>,
    pub(super) dep_list: Vec<u32>,
    /// Dependencies of every step, as its schedule lists them: step `s`'s are
    /// `deps[deps_at[s]..deps_at[s + 1]]` (to tell whether a schedule has this shape).
    pub(super) deps_at: Vec<u32>,
    pub(super) deps: Vec<u32>,
    /// Each step's dependencies, the count a run starts from (`u8::MAX`: that many or more,
    /// the count in [`Shape::many`]).
    pub(super) ndeps: Vec<u8>,
    /// Dependency counts of steps waiting for `u8::MAX` or more, and element counts of
    /// steps of `u32::MAX` elements or more (rare: kept aside to keep the records small).
    pub(super) many: Vec<(u32, u32)>,
    pub(super) big: Vec<(u32, u64)>,
    /// Each send queue's and each receive queue's first step and number of steps.
    pub(super) send_first: Vec<(u32, u32)>,
    pub(super) recv_first: Vec<(u32, u32)>,
}

impl Shape {
    /// Elements of step `i`.
    pub(super) fn elems(&self, i: usize) -> u64 {
        match self.st[i].elems {
            u32::MAX => {
                let at = self.big.partition_point(|x| (x.0 as usize) < i);
                self.big[at].1
            }
            e => e as u64,
        }
    }

    /// Bytes of step `i` on elements of `elem` bytes.
    pub(super) fn bytes(&self, i: usize, elem: usize) -> usize {
        self.elems(i) as usize * elem
    }

    /// The steps of a queue that starts at `first`, in order.
    pub(super) fn queue_steps(&self, first: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((first != NONE).then_some(first), |&s| {
            let n = self.st[s as usize].next;
            (n != NONE).then_some(n)
        })
    }
}

/// The shapes of a run's participants, each kept once (see [`Shape`]); filled by the
/// threads that build the schedules.
#[derive(Default)]
pub(super) struct Shapes(pub(super) std::sync::Mutex<Vec<std::sync::Arc<Shape>>>);

impl Shapes {
    /// The shapes kept most recently (at most 8), the latest first: those a schedule is
    /// compared with before it is made compact itself.
    pub(super) fn recent(&self) -> Vec<std::sync::Arc<Shape>> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().rev().take(8).cloned().collect()
    }

    /// The shape equal to `s`, the one kept if there is one, else `s` (kept from now on).
    pub(super) fn intern(&self, s: Shape) -> std::sync::Arc<Shape> {
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
pub(super) type QueueIndex = rustc_hash::FxHashMap<(usize, u8), u32>;

/// A simulated participant (a rank or the aggregator): its schedule's [`Shape`] and the
/// run's state of it.
pub(super) struct Part {
    pub(super) rank: usize,
    pub(super) node: usize,
    /// The schedule, shared with the participants of the same shape.
    pub(super) shape: std::sync::Arc<Shape>,
    /// Dependencies not done yet of every step (`u8::MAX`: more, in [`Part::many`]): one
    /// byte each, 64 to a cache line, as a step done counts down its dependents far ahead.
    pub(super) ndeps: Vec<u8>,
    pub(super) many: HashMap<u32, u32>,
    /// Which steps are done, a bit each.
    pub(super) done: Vec<u64>,
    pub(super) sendq: Vec<SendQ>,
    pub(super) recvq: Vec<RecvQ>,
    pub(super) recv_index: QueueIndex,
    /// The core's flow-control state of every send queue and of every receive queue (one
    /// [`Flows`] queue each, indexed as `sendq` and `recvq`).
    pub(super) sends: Flows,
    pub(super) recvs: Flows,
    /// The call runs in mailbox mode ([`mailbox_eligible`]).
    pub(super) mailbox: bool,
    pub(super) begin: Vec<f64>,
    pub(super) cpu_free: f64,
    pub(super) reduce_rate: f64,
    /// Rate of the copies into the staging region (inline fragments, mailbox messages).
    pub(super) copy_rate: f64,
    pub(super) left: usize,
    pub(super) done_at: f64,
}

/// One dependency of step `i` is done (`ndeps` and `many` as in [`Part`]): whether all
/// are now.
pub(super) fn dep_done(ndeps: &mut [u8], many: &mut HashMap<u32, u32>, i: usize) -> bool {
    let n = &mut ndeps[i];
    if *n < u8::MAX {
        *n -= 1;
        return *n == 0;
    }
    // A count of u8::MAX means it is kept in `many` (`Part::new` put it there).
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
    pub(super) fn is_done(&self, i: usize) -> bool {
        self.done[i / 64] >> (i % 64) & 1 != 0
    }

    /// `sched` of `rank` in compact form: its shape, one of `shapes` when it has one of
    /// them (the schedule compared with it step by step), else made from the schedule and
    /// kept in `shapes`.
    pub(super) fn new(
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
pub(super) struct Ctx<'a> {
    pub(super) rank: usize,
    pub(super) spec: &'a Spec,
    pub(super) world: usize,
    /// The run has an aggregator (rank `world`).
    pub(super) agg: bool,
}

/// A participant's queues, numbered in the order its schedule first names them (as its
/// shape numbers them).
#[derive(Default)]
pub(super) struct Named {
    pub(super) sendq: Vec<SendQ>,
    pub(super) recvq: Vec<RecvQ>,
    pub(super) send_index: QueueIndex,
    pub(super) recv_index: QueueIndex,
}

impl Named {
    /// Step `s`'s record (with no next step yet) and its elements, its queue named (a new
    /// one when the step is the first to name it).
    pub(super) fn step(
        &mut self,
        ctx: &Ctx<'_>,
        s: usize,
        step: &Step,
    ) -> Result<(St, u64), String> {
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
    pub(super) fn of(ctx: &Ctx<'_>, sched: &Schedule, named: &mut Named) -> Result<Shape, String> {
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
    pub(super) fn matches(&self, ctx: &Ctx<'_>, sched: &Schedule, named: &mut Named) -> bool {
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
pub(super) fn digest(st: &[St], dep_list: &[u32]) -> u64 {
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
