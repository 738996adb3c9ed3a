//! The event loop: posts, flows, arrivals, credits and local steps, in time order.

use std::collections::{HashMap, VecDeque};

use oxccl_core::protocol::Config;
use oxccl_core::schedule::Algorithm;
use oxccl_core::tuner::Tuning;

use super::*;

/// Something that happens to a participant (`p`): timed in the event queue, or due now in
/// the work list.
#[derive(Clone, Copy, Debug)]
pub(super) enum Ev {
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
    pub(super) fn pack(self) -> u64 {
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

    pub(super) fn unpack(x: u64) -> Ev {
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
pub(super) struct Route {
    pub(super) path: Vec<(u32, f64)>,
    pub(super) latency: f64,
}

pub(super) struct Sim<'a> {
    pub(super) fabric: &'a Fabric,
    pub(super) elem: usize,
    /// The protocol's configuration (the runtime's [`Geometry::config`]).
    pub(super) cfg: Config,
    pub(super) trace: bool,
    pub(super) parts: Vec<Part>,
    /// Each rank's participant (`u32::MAX` for a rank that is not simulated); the aggregator
    /// is rank `world`.
    pub(super) part_of: Vec<u32>,
    pub(super) ranks: Cycles,
    pub(super) links: Cycles,
    pub(super) net: Net,
    /// The timed events: the bits of their times (never negative, so the bits order as
    /// the times do) and the packed events ([`Ev::pack`]: kind, participant and step or
    /// queue break ties, deterministically).
    pub(super) events_at: EventQueue,
    pub(super) now: f64,
    pub(super) work: VecDeque<Ev>,
    pub(super) route_list: Vec<Route>,
    /// Per flow: (participant, send queue).
    pub(super) flow_info: Vec<(u32, u32)>,
    /// The last message size [`Sim::slot_sizes`] was asked, and its answer.
    pub(super) last_size: std::cell::Cell<(usize, u32, u32)>,
    pub(super) flows: u64,
    pub(super) credits: u64,
    pub(super) events: Vec<crate::Event>,
}

impl<'a> Sim<'a> {
    pub(super) fn new(
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
                // The aggregator's part (rank `world`) is made only with an aggregator node.
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
                // `Part::new` refused a peer above `world`, and `world` without an aggregator.
                let (from, to) = (part.node, node_of(sq.peer).expect("checked"));
                sq.per_message_s = message_s(from, to);
                scratch.clear();
                fabric
                    .route(to, from, sq.ch as u64, &mut scratch)
                    .map_err(|e| format!("rank {}'s credits: {e}", sq.peer))?;
                sq.credit_delay = message_s(to, from)
                    + scratch
                        .iter()
                        .map(|&l| fabric.links[l].latency_s)
                        .sum::<f64>();
                sq.route = match routes.entry((from, to, sq.ch)) {
                    std::collections::hash_map::Entry::Occupied(e) => *e.get(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        scratch.clear();
                        // The key: the channel (a queue is one connection), the same for every
                        // flow of an orbit.
                        fabric
                            .route(from, to, sq.ch as u64, &mut scratch)
                            .map_err(|e| {
                                format!("rank {}'s sends to {}: {e}", part.rank, sq.peer)
                            })?;
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
                        *e.insert((route_list.len() - 1) as u32)
                    }
                };
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

    pub(super) fn push(&mut self, t: f64, ev: Ev) {
        debug_assert!(t >= 0.0);
        self.events_at.push((t + 0.0).to_bits(), ev.pack());
    }

    /// Connects every send queue with the receive queue it feeds (and back, for the
    /// credits), and checks that they agree: the receiver expects at least as many messages,
    /// each of the same size, and both ends run the same protocol.
    pub(super) fn connect(&mut self) -> Result<(), String> {
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

    pub(super) fn run(&mut self) -> Result<(), String> {
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
                    let (_, ev) = self.events_at.pop().expect("peeked"); // just seen, not popped
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
    pub(super) fn stuck(&self, p: &Part) -> String {
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

    pub(super) fn drain_work(&mut self) {
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
    pub(super) fn slot_sizes(&self, bytes: usize) -> (u32, u32) {
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
    pub(super) fn cursor(&self, p: u32, s: u32) -> Cursor {
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

    pub(super) fn load_post(&mut self, p: u32, q: u32) {
        let s = self.parts[p as usize].sendq[q as usize].post;
        let c = self.cursor(p, s);
        self.parts[p as usize].sendq[q as usize].post_at = c;
    }

    pub(super) fn load_xmit(&mut self, p: u32, q: u32) {
        let s = self.parts[p as usize].sendq[q as usize].xmit;
        let c = self.cursor(p, s);
        self.parts[p as usize].sendq[q as usize].xmit_at = c;
    }

    pub(super) fn load_head(&mut self, p: u32, rq: u32) {
        let s = self.parts[p as usize].recvq[rq as usize].head;
        let c = self.cursor(p, s);
        self.parts[p as usize].recvq[rq as usize].head_at = c;
    }

    pub(super) fn deps_done(&mut self, p: u32, s: u32) {
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
    pub(super) fn cpu(&mut self, p: u32, cost: f64, done: Ev) {
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
    pub(super) fn try_post(&mut self, p: u32, q: u32) {
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
    pub(super) fn posted(&mut self, p: u32, q: u32) {
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
    pub(super) fn try_xmit(&mut self, p: u32, q: u32) {
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
        // Routes name this net's classes with weights m/|O| > 0, and a fragment with a
        // flow has bytes (see `Sim::new` and the caller).
        let f = self
            .net
            .add(self.now, &self.route_list[r].path, len as f64)
            .expect("a route of this net, and bytes");
        if self.flow_info.len() <= f as usize {
            self.flow_info.resize(f as usize + 1, (0, 0));
        }
        self.flow_info[f as usize] = (p, q);
    }

    /// The fragment leaving send queue `q` of `p` has left: the queue's next may leave, its
    /// data arrives after the route's latency at the receive queue it feeds, and its
    /// completion may finish its send.
    pub(super) fn drained(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        let sq = &mut part.sendq[q as usize];
        let (s, k) = (sq.xmit, sq.xmit_frag);
        let sig = sq.xmit_at.last_signaled;
        sq.busy = false;
        sq.xmit_frag += 1;
        let latency = self.route_list[sq.route as usize].latency;
        // `Sim::run` connected every send queue (`Sim::connect`) before any fragment left.
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
    pub(super) fn arrive(&mut self, p: u32, rq: u32) {
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
    pub(super) fn try_recv(&mut self, p: u32, rq: u32) {
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
    pub(super) fn consumed(&mut self, p: u32, rq: u32) {
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
    pub(super) fn return_credit(&mut self, p: u32, rq: u32) {
        let every = self.cfg.credit_every;
        let part = &mut self.parts[p as usize];
        let q = rq as usize;
        if !part.recvs.credit_due(q, every) {
            return;
        }
        let consumed = part.recvs.get(q).consumed;
        part.recvs.credit_sent(q, consumed);
        let leaves = self.now.max(part.cpu_free);
        // A credit is due only after fragments arrived on this queue, so a send queue
        // feeds it and `Sim::connect` recorded which.
        let (sp, sq) = part.recvq[q].source.expect("connected");
        let send = &mut self.parts[sp as usize].sendq[sq as usize];
        send.credits.push_back(consumed);
        let at = leaves + send.credit_delay;
        self.credits += 1;
        self.push(at, Ev::Credit(sp, sq));
    }

    /// A credit arrived at send queue `q` of `p`: its slots are free.
    pub(super) fn credit_arrived(&mut self, p: u32, q: u32) {
        let part = &mut self.parts[p as usize];
        // Every `Ev::Credit` was pushed with its count (`Sim::return_credit`).
        let consumed = part.sendq[q as usize]
            .credits
            .pop_front()
            .expect("a credit on its way");
        part.sends.credit(q as usize, consumed);
        self.try_post(p, q);
    }

    /// The receiving participant and receive queue of `p`'s send queue `q`: the
    /// representative of the peer, receiving from the image of `p`'s rank.
    pub(super) fn target(&mut self, p: u32, q: u32) -> Result<(u32, u32), String> {
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

    pub(super) fn step_done(&mut self, p: u32, s: u32) {
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

    pub(super) fn report(mut self, algo: Algorithm, mode: Mode) -> Report {
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
