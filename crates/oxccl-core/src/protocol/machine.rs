//! The slot protocol of one call as a state machine: which fragment to post next, which
//! arrived fragment to consume, which local step to run, when to return a credit, and when
//! the call is done. It does no I/O. The executor performs its actions over verbs, the
//! verifier over symbolic memory, the simulator over its fabric model, and each feeds back
//! what happened (a fragment arrived, a credit arrived, a send completed).
//!
//! # The protocol
//! Between two ranks, each channel is one FIFO queue of transfers in each direction (a
//! *queue*: index `link * channels + channel`). The sender's `k`-th send on a queue is the
//! receiver's `k`-th receive on it. A transfer of `total` bytes moves in
//! [`Config::fragments`] fragments of at most [`Config::frag_bytes`] bytes (an empty
//! transfer is one empty fragment), fragment `k` at byte `k * frag_bytes`, so both ends know
//! every fragment's offset and length. The receiver has [`Config::slots`] slots per queue;
//! the sender writes fragment number `p` (counted over the queue's life, not the call's) into
//! slot `p % slots`, and may post only while `posted - credit < slots`, where `credit` is the
//! number of fragments the receiver reported consumed. The receiver reports (returns a
//! credit) once it has consumed [`Config::credit_every`] fragments since its last report, and
//! at the end of every pass that left one due.
//!
//! A step runs only once its dependencies are done and it is at the head of its queue. A
//! send is done once every fragment is posted and every signaled fragment completed (a
//! fragment of at most [`Config::inline_max`] bytes is copied when posted, so nothing waits
//! for its completion); a receive once its last fragment is consumed; a local step once run.
//!
//! The queue state ([`Flows`]) outlives a call: fragments of the next call may arrive before
//! it starts, and the slot counters never restart. A [`Machine`] holds one call's progress.
//!
//! # Mailbox mode
//! A schedule in which every peer gets at most one small message each way
//! ([`mailbox_eligible`]) can run without slots, credits or completions: one write of the
//! message and one of its stamp, into one of two mailboxes per peer (over a link that maps
//! nothing, one WRITE_WITH_IMM of both, whose completion at the receiver says it landed). Steps then run in order
//! as their dependencies allow, a receive when the driver finds its message ([`Action::Recv`]
//! with `mailbox`; the driver's answer says whether it had arrived).

use std::collections::VecDeque;

use crate::schedule::{Algorithm, CollectiveKind, Op, Schedule};

/// What the protocol is configured with, the same at both ends of every link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Channels per link.
    pub channels: usize,
    /// Receive slots per queue.
    pub slots: usize,
    /// Data bytes a fragment carries at most (a multiple of the element size, ≥ 1).
    pub frag_bytes: usize,
    /// Fragments up to this many bytes are copied when posted: no completion is awaited.
    pub inline_max: usize,
    /// A receiver returns a credit once it has consumed this many fragments since the last.
    pub credit_every: u64,
}

impl Config {
    /// The executor's configuration: `slot_data` bytes per slot of elements of `esize` bytes.
    /// Credits go back every `slots / 2` fragments (at least every one).
    pub fn new(channels: usize, slots: usize, slot_data: usize, esize: usize) -> Config {
        let esize = esize.max(1);
        Config {
            channels: channels.max(1),
            slots: slots.max(1),
            frag_bytes: (slot_data / esize * esize).max(esize),
            inline_max: 0,
            credit_every: (slots as u64 / 2).max(1),
        }
    }

    /// Fragments of a transfer of `total` bytes (an empty transfer is one empty fragment).
    pub fn fragments(&self, total: usize) -> usize {
        total.div_ceil(self.frag_bytes).max(1)
    }

    /// Byte offset and length of fragment `k` of a transfer of `total` bytes.
    pub fn fragment(&self, total: usize, k: usize) -> (usize, usize) {
        let off = (k * self.frag_bytes).min(total);
        (off, (total - off).min(self.frag_bytes))
    }
}

/// One queue's flow control, kept across calls.
#[derive(Clone, Debug, Default)]
pub struct Flow {
    /// Fragments posted on this queue (sender side).
    pub posted: u64,
    /// Fragments the receiver reported consumed (sender side; from its credit word).
    pub credit: u64,
    /// Slots whose fragments arrived and are not consumed yet, in order (receiver side).
    pub arrived: VecDeque<u32>,
    /// Fragments consumed (receiver side).
    pub consumed: u64,
    /// The consumed count last reported to the sender.
    pub returned: u64,
    /// Which call of a group ([`Machine::with_id`]) receives on this queue now: fragments arrive
    /// in the order of the calls, so a later call waits until the earlier ones took theirs.
    pub recv_turn: u32,
    /// Which call of a group posts on this queue now (the receiver takes fragments in the
    /// order of its calls).
    pub send_turn: u32,
}

impl Flow {
    /// The receiver's slot the next fragment posted on this queue goes into.
    pub fn next_slot(&self, slots: usize) -> u32 {
        (self.posted % slots.max(1) as u64) as u32
    }

    /// Free slots at the receiver, as the sender knows them.
    pub fn free(&self, slots: usize) -> u64 {
        (slots as u64).saturating_sub(self.posted.saturating_sub(self.credit))
    }
}

/// Every queue's [`Flow`] of one rank: `links * channels` of them.
#[derive(Clone, Debug, Default)]
pub struct Flows {
    q: Vec<Flow>,
    channels: usize,
}

impl Flows {
    /// Flow state for `links` links of `channels` channels.
    pub fn new(links: usize, channels: usize) -> Flows {
        Flows {
            q: vec![Flow::default(); links * channels.max(1)],
            channels: channels.max(1),
        }
    }

    /// The queue index of (link, channel).
    pub fn queue(&self, link: usize, channel: usize) -> usize {
        link * self.channels + channel
    }

    /// The (link, channel) of a queue.
    pub fn link_channel(&self, q: usize) -> (usize, usize) {
        (q / self.channels, q % self.channels)
    }

    /// One queue's state.
    pub fn get(&self, q: usize) -> &Flow {
        &self.q[q]
    }

    /// Hands every queue's turns to the first of `calls` (in group order) that still
    /// receives or posts on it ([`Machine::receiving_on`], [`Machine::sending_on`]); with no
    /// call left on a queue, back to call 0.
    pub fn pass_turns<'m, 'a: 'm, I>(&mut self, calls: I)
    where
        I: IntoIterator<Item = &'m Machine<'a>> + Clone,
    {
        for (q, f) in self.q.iter_mut().enumerate() {
            let mut recv = None;
            let mut send = None;
            for (i, m) in calls.clone().into_iter().enumerate() {
                if recv.is_none() && m.receiving_on(q) {
                    recv = Some(i as u32);
                }
                if send.is_none() && m.sending_on(q) {
                    send = Some(i as u32);
                }
            }
            f.recv_turn = recv.unwrap_or(0);
            f.send_turn = send.unwrap_or(0);
        }
    }

    /// Gives every queue back to a call alone (number 0).
    pub fn reset_turns(&mut self) {
        for f in &mut self.q {
            f.recv_turn = 0;
            f.send_turn = 0;
        }
    }

    /// A data fragment arrived in `slot` of queue `q`.
    pub fn arrived(&mut self, q: usize, slot: u32) {
        self.q[q].arrived.push_back(slot);
    }

    /// The receiver's credit word for queue `q` says `consumed` (credits only grow: an older,
    /// smaller value read late is ignored).
    pub fn credit(&mut self, q: usize, consumed: u64) {
        let f = &mut self.q[q];
        f.credit = f.credit.max(consumed);
    }

    /// The credit [`Action::Credit`] asked for was posted.
    pub fn credit_sent(&mut self, q: usize, consumed: u64) {
        let f = &mut self.q[q];
        f.returned = f.returned.max(consumed);
    }

    /// What queue `q` could report to its sender now, if it consumed anything since its last
    /// report: a driver that posts a fragment on `q` (to the same peer, the other way) may
    /// send this credit along with it, where it costs no message of its own (record it with
    /// [`Flows::credit_sent`]). Reporting early is always safe: a credit only says what was
    /// consumed.
    pub fn credit_owed(&self, q: usize) -> Option<u64> {
        let f = &self.q[q];
        (f.consumed > f.returned).then_some(f.consumed)
    }

    /// Whether queue `q` owes its sender a credit: `every` fragments or more consumed since
    /// the last report.
    pub fn credit_due(&self, q: usize, every: u64) -> bool {
        let f = &self.q[q];
        f.consumed - f.returned >= every
    }

    /// The sender posts the next fragment on queue `q`, as [`Machine::commit`] records an
    /// [`Action::Post`]: returns the receiver's slot it lands in (fragments are numbered over
    /// the queue's life, slot `posted % slots`). For a driver that walks the schedule itself
    /// (the simulator): it posts only while [`Flow::free`] says a slot is free.
    pub fn post(&mut self, q: usize, slots: usize) -> u32 {
        let f = &mut self.q[q];
        let slot = f.next_slot(slots);
        f.posted += 1;
        slot
    }

    /// The receiver consumes the oldest fragment that arrived on queue `q`, as
    /// [`Machine::commit`] records an [`Action::Recv`]: returns its slot (`None`, and nothing
    /// changes, when none has arrived).
    pub fn consume(&mut self, q: usize) -> Option<u32> {
        let f = &mut self.q[q];
        let slot = f.arrived.pop_front()?;
        f.consumed += 1;
        Some(slot)
    }
}

/// A schedule as the slot protocol walks it, derived once per schedule: per queue its send
/// and receive steps in order, its local steps, and the queues that are not empty.
#[derive(Clone, Debug)]
pub struct Queues {
    send: Vec<Vec<u32>>,
    recv: Vec<Vec<u32>>,
    locals: Vec<u32>,
    active_send: Vec<u32>,
    active_recv: Vec<u32>,
    /// Each step's queue (`u32::MAX` for a local step).
    queue_of: Vec<u32>,
    channels: usize,
}

impl Queues {
    /// Sorts `sched`'s steps into queues; `link_of[peer]` is the link to `peer`
    /// (`usize::MAX` where there is none). Fails naming a step that talks to a rank without
    /// a link or on a channel the configuration does not have, or that depends on a step
    /// that is not earlier.
    pub fn new(sched: &Schedule, link_of: &[usize], channels: usize) -> Result<Queues, String> {
        let links = link_of
            .iter()
            .filter(|&&l| l != usize::MAX)
            .max()
            .map_or(0, |m| m + 1);
        let nq = links * channels;
        let mut send = vec![Vec::new(); nq];
        let mut recv = vec![Vec::new(); nq];
        let mut locals = Vec::new();
        let mut queue_of = Vec::with_capacity(sched.steps.len());
        for (i, step) in sched.steps.iter().enumerate() {
            if let Some(d) = step.deps.iter().find(|&&d| d as usize >= i) {
                return Err(format!(
                    "schedule step {i} depends on step {d}, not an earlier one"
                ));
            }
            match step.op {
                Op::Send { peer, channel, .. } | Op::Recv { peer, channel, .. } => {
                    let l = *link_of.get(peer).unwrap_or(&usize::MAX);
                    if l == usize::MAX || channel as usize >= channels {
                        return Err(format!(
                            "schedule step {i} names peer {peer} channel {channel}"
                        ));
                    }
                    let q = l * channels + channel as usize;
                    if matches!(step.op, Op::Send { .. }) {
                        send[q].push(i as u32);
                    } else {
                        recv[q].push(i as u32);
                    }
                    queue_of.push(q as u32);
                }
                _ => {
                    locals.push(i as u32);
                    queue_of.push(u32::MAX);
                }
            }
        }
        let active = |qs: &[Vec<u32>]| {
            (0..nq as u32)
                .filter(|&q| !qs[q as usize].is_empty())
                .collect()
        };
        Ok(Queues {
            active_send: active(&send),
            active_recv: active(&recv),
            send,
            recv,
            locals,
            queue_of,
            channels,
        })
    }

    /// The queue a send or receive step uses.
    pub fn queue_of(&self, step: usize) -> Option<usize> {
        self.queue_of
            .get(step)
            .filter(|&&q| q != u32::MAX)
            .map(|&q| q as usize)
    }
}

/// One step's progress in a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepState {
    /// The step is done.
    pub done: bool,
    /// Fragments posted (send) or consumed (receive).
    pub frags: u32,
    /// Signaled send fragments whose completion has not come.
    pub outstanding: u32,
    /// A send fragment of this step completed with an error: its data may not have arrived,
    /// so the step is never done (the failed link fails the call).
    pub failed: bool,
}

/// What the driver must do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Post fragment `frag` of send step `step` on queue `q`: bytes `off..off + len` of the
    /// step's source, of a transfer of `total` bytes, into the receiver's slot `slot`.
    /// `signaled`: report its completion with [`Machine::completed`]; otherwise the data is
    /// copied as it is posted and no completion is awaited.
    Post {
        /// The send step.
        step: usize,
        /// Its queue.
        q: usize,
        /// The receiver's slot.
        slot: u32,
        /// Byte offset in the transfer.
        off: usize,
        /// Bytes of this fragment.
        len: usize,
        /// Bytes of the whole transfer.
        total: usize,
        /// Whether a completion will be reported.
        signaled: bool,
    },
    /// Consume the fragment in slot `slot` of queue `q` into receive step `step`'s
    /// destination: its header must say bytes `off..off + len` of a transfer of `total`.
    /// In mailbox mode (`mailbox`), look for the peer's message instead (`slot` is 0); the
    /// driver answers whether it had arrived.
    Recv {
        /// The receive step.
        step: usize,
        /// Its queue.
        q: usize,
        /// The slot holding the fragment.
        slot: u32,
        /// Byte offset in the transfer.
        off: usize,
        /// Bytes of this fragment.
        len: usize,
        /// Bytes of the whole transfer.
        total: usize,
        /// Whether this is a mailbox message.
        mailbox: bool,
    },
    /// Run local step `step` (a copy or a reduction).
    Local {
        /// The step.
        step: usize,
    },
    /// In mailbox mode: send step `step`'s whole source as one message on queue `q`.
    MailboxSend {
        /// The step.
        step: usize,
        /// Its queue.
        q: usize,
        /// Bytes of the message.
        total: usize,
    },
    /// Return a credit on queue `q`: write `consumed` into the sender's credit word, then
    /// report it with [`Flows::credit_sent`] (if posting fails, the credit stays owed).
    Credit {
        /// The queue.
        q: usize,
        /// The consumed count to report.
        consumed: u64,
    },
}

/// What a call that is not done waits for, for its timeout error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Step `step` waits for data on queue `q`.
    Data {
        /// The step.
        step: usize,
        /// Its queue.
        q: usize,
    },
    /// Step `step` waits for the receiver to free a slot on queue `q`.
    Slot {
        /// The step.
        step: usize,
        /// Its queue.
        q: usize,
        /// Fragments posted on the queue.
        posted: u64,
        /// Fragments the receiver reported consumed.
        credit: u64,
    },
    /// Send step `step` has posted everything and waits for the transport's completions.
    Transport {
        /// The step.
        step: usize,
        /// Its queue.
        q: usize,
    },
    /// Step `step` waits for earlier steps (of its own, or ahead of it in its queue).
    Earlier {
        /// The step.
        step: usize,
        /// Its queue, for a send or receive.
        q: Option<usize>,
    },
}

/// One call's progress through its schedule (see the module docs).
#[derive(Debug)]
pub struct Machine<'a> {
    sched: &'a Schedule,
    queues: &'a Queues,
    cfg: Config,
    esize: usize,
    st: Vec<StepState>,
    /// Per queue: index (in [`Queues`]) of the send / receive step at its head.
    send_at: Vec<u32>,
    recv_at: Vec<u32>,
    /// Local steps not run yet.
    locals: Vec<u32>,
    left: usize,
    mailbox: bool,
    /// This call's place in its group (0 alone): whose turn a queue is ([`Flow::recv_turn`]).
    id: u32,
    /// Where [`Machine::next`] is in its pass: the phase and an index in it.
    cursor: (Phase, u32),
}

/// The parts of a pass of [`Machine::next`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Mailbox,
    Recv,
    Send,
    Local,
    Credit,
    Done,
}

impl Phase {
    fn after(self) -> Phase {
        match self {
            Phase::Recv => Phase::Send,
            Phase::Send => Phase::Local,
            Phase::Local => Phase::Credit,
            _ => Phase::Done,
        }
    }
}

/// Buffers a [`Machine`] can reuse from the previous call (no allocation per call).
#[derive(Debug, Default)]
pub struct Reuse {
    st: Vec<StepState>,
    send_at: Vec<u32>,
    recv_at: Vec<u32>,
    locals: Vec<u32>,
}

impl<'a> Machine<'a> {
    /// A call of `sched` (sorted into `queues`) on elements of `esize` bytes, with `cfg`;
    /// `mailbox` runs it in mailbox mode (see [`mailbox_eligible`]). `reuse` lends the
    /// previous call's buffers.
    #[inline]
    pub fn new(
        sched: &'a Schedule,
        queues: &'a Queues,
        cfg: Config,
        esize: usize,
        mailbox: bool,
        reuse: Reuse,
    ) -> Machine<'a> {
        let Reuse {
            mut st,
            mut send_at,
            mut recv_at,
            mut locals,
        } = reuse;
        st.clear();
        st.resize(sched.steps.len(), StepState::default());
        send_at.clear();
        send_at.resize(queues.send.len(), 0);
        recv_at.clear();
        recv_at.resize(queues.recv.len(), 0);
        locals.clear();
        locals.extend_from_slice(&queues.locals);
        Machine {
            left: sched.steps.len(),
            sched,
            queues,
            cfg,
            esize: esize.max(1),
            st,
            send_at,
            recv_at,
            locals,
            mailbox,
            id: 0,
            cursor: if mailbox {
                (Phase::Mailbox, 0)
            } else {
                (Phase::Recv, 0)
            },
        }
    }

    /// Makes this call number `id` of a group: on a queue it shares with the group's other
    /// calls it waits for its turn ([`Flows::pass_turns`]). Mailbox mode is for calls alone.
    pub fn with_id(mut self, id: u32) -> Machine<'a> {
        self.id = id;
        self
    }

    /// Renumbers this call in its group (an earlier call of a group that calls join and leave
    /// left it: [`Flows::pass_turns`] hands turns by the new numbers).
    pub fn set_id(&mut self, id: u32) {
        self.id = id;
    }

    /// Gives back the buffers for the next call.
    pub fn into_reuse(mut self) -> Reuse {
        self.take_reuse()
    }

    /// Gives back the buffers for the next call, leaving this machine without steps (it is
    /// not to be driven after this).
    pub fn take_reuse(&mut self) -> Reuse {
        self.left = 0;
        Reuse {
            st: std::mem::take(&mut self.st),
            send_at: std::mem::take(&mut self.send_at),
            recv_at: std::mem::take(&mut self.recv_at),
            locals: std::mem::take(&mut self.locals),
        }
    }

    /// The schedule.
    pub fn schedule(&self) -> &'a Schedule {
        self.sched
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether every step is done.
    pub fn is_done(&self) -> bool {
        self.left == 0
    }

    /// Steps done so far.
    pub fn steps_done(&self) -> usize {
        self.st.len() - self.left
    }

    /// Step `s`'s progress.
    pub fn step(&self, s: usize) -> &StepState {
        &self.st[s]
    }

    /// Whether signaled send fragments of this call are still in the transport.
    pub fn outstanding(&self) -> bool {
        self.st.iter().any(|s| s.outstanding > 0)
    }

    /// Whether the call runs in mailbox mode.
    pub fn is_mailbox(&self) -> bool {
        self.mailbox
    }

    /// Whether a receive step not done yet waits on queue `q`.
    pub fn receiving_on(&self, q: usize) -> bool {
        (self.recv_at[q] as usize) < self.queues.recv[q].len()
    }

    /// Whether a send step of this call still has fragments to post on queue `q`.
    pub fn sending_on(&self, q: usize) -> bool {
        (self.send_at[q] as usize) < self.queues.send[q].len()
    }

    /// Whether a step not done yet sends to, or receives from, link `link` (sends, receives).
    pub fn needs_link(&self, link: usize) -> (bool, bool) {
        let ch = self.queues.channels;
        let qs = link * ch..(link + 1) * ch;
        let sends = qs.clone().any(|q| {
            self.queues.send[q][..]
                .iter()
                .any(|&s| !self.st[s as usize].done)
        });
        let recvs = qs.clone().any(|q| self.receiving_on(q));
        (sends, recvs)
    }

    /// The receive queues of this call (those it has receive steps on).
    pub fn receive_queues(&self) -> &[u32] {
        &self.queues.active_recv
    }

    /// The receives of queue `q` from its head on, in order: (the step's place in the queue,
    /// the step, the queue-life number of its first fragment, whether its dependencies are
    /// done). Empty while another call of a group has the queue's turn, and in mailbox mode.
    /// A driver offers the destinations of receives whose dependencies are done to the sender
    /// before their data comes ([`Announce`](super::Announce)): nothing else touches such a
    /// destination any more.
    pub fn receives_ahead<'s>(
        &'s self,
        flows: &'s Flows,
        q: usize,
    ) -> impl Iterator<Item = (usize, usize, u64, bool)> + 's {
        let f = &flows.q[q];
        let list: &[u32] = if self.mailbox || f.recv_turn != self.id {
            &[]
        } else {
            &self.queues.recv[q]
        };
        let at = self.recv_at[q] as usize;
        // The head's first fragment: the queue's consumed count less what the head took.
        let mut first = list
            .get(at)
            .map_or(0, |&s| f.consumed - u64::from(self.st[s as usize].frags));
        list.iter().enumerate().skip(at).map(move |(k, &s)| {
            let s = s as usize;
            let here = first;
            first += u64::from(self.frags_of(s));
            (k, s, here, self.deps_done(s))
        })
    }

    /// Whether step `s`'s dependencies are done.
    pub fn deps_done(&self, s: usize) -> bool {
        self.sched.steps[s]
            .deps
            .iter()
            .all(|&d| self.st[d as usize].done)
    }

    fn finish(&mut self, s: usize) {
        if !self.st[s].done {
            self.st[s].done = true;
            self.left -= 1;
        }
    }

    /// Bytes step `s` transfers.
    fn total(&self, s: usize) -> usize {
        match self.sched.steps[s].op {
            Op::Send { src, .. } => src.len * self.esize,
            Op::Recv { dst, .. } => dst.len * self.esize,
            _ => 0,
        }
    }

    fn frags_of(&self, s: usize) -> u32 {
        self.cfg.fragments(self.total(s)) as u32
    }

    /// The next fragment the receive at the head of queue `q` can consume, if one has
    /// arrived and the step may run.
    fn recv_candidate(&self, flows: &Flows, q: usize) -> Option<Action> {
        let s = *self.queues.recv[q].get(self.recv_at[q] as usize)? as usize;
        let &slot = flows.q[q].arrived.front()?;
        if flows.q[q].recv_turn != self.id || !self.deps_done(s) {
            return None;
        }
        let total = self.total(s);
        let (off, len) = self.cfg.fragment(total, self.st[s].frags as usize);
        Some(Action::Recv {
            step: s,
            q,
            slot,
            off,
            len,
            total,
            mailbox: false,
        })
    }

    /// The next fragment the send at the head of queue `q` can post, if the step may run and
    /// the receiver has a free slot.
    fn send_candidate(&self, flows: &Flows, q: usize) -> Option<Action> {
        let s = *self.queues.send[q].get(self.send_at[q] as usize)? as usize;
        let f = &flows.q[q];
        if f.free(self.cfg.slots) == 0 || f.send_turn != self.id || !self.deps_done(s) {
            return None;
        }
        let total = self.total(s);
        let (off, len) = self.cfg.fragment(total, self.st[s].frags as usize);
        Some(Action::Post {
            step: s,
            q,
            slot: f.next_slot(self.cfg.slots),
            off,
            len,
            total,
            signaled: len > self.cfg.inline_max,
        })
    }

    fn credit_candidate(&self, flows: &Flows, q: usize) -> Option<Action> {
        flows
            .credit_due(q, self.cfg.credit_every)
            .then(|| Action::Credit {
                q,
                consumed: flows.q[q].consumed,
            })
    }

    /// The action of step `s` in mailbox mode (a send, a receive or a local step).
    pub(super) fn mailbox_action(&self, s: usize) -> Action {
        let total = self.total(s);
        let q = self.queues.queue_of(s).unwrap_or(0);
        match self.sched.steps[s].op {
            Op::Send { .. } => Action::MailboxSend { step: s, q, total },
            Op::Recv { .. } => Action::Recv {
                step: s,
                q,
                slot: 0,
                off: 0,
                len: total,
                total,
                mailbox: true,
            },
            _ => Action::Local { step: s },
        }
    }

    /// Every action the protocol allows now, into `out` (cleared first): per queue its
    /// head's next fragment, every runnable local step, and the credits due. With
    /// [`Machine::commit`], for a driver that chooses the order itself (the verifier).
    pub fn enabled(&self, flows: &Flows, out: &mut Vec<Action>) {
        out.clear();
        if self.mailbox {
            for s in 0..self.st.len() {
                if !self.st[s].done && self.deps_done(s) {
                    out.push(self.mailbox_action(s));
                }
            }
            return;
        }
        for &q in &self.queues.active_recv {
            out.extend(self.recv_candidate(flows, q as usize));
        }
        for &q in &self.queues.active_send {
            out.extend(self.send_candidate(flows, q as usize));
        }
        for &s in &self.locals {
            if self.deps_done(s as usize) {
                out.push(Action::Local { step: s as usize });
            }
        }
        for q in 0..flows.q.len() {
            out.extend(self.credit_candidate(flows, q));
        }
    }

    /// Records that the driver performed `a`, one action [`Machine::enabled`] (or
    /// [`Machine::pass`]) offered. A mailbox [`Action::Recv`] is committed only if its
    /// message had arrived; an [`Action::Credit`] is recorded by [`Flows::credit_sent`].
    pub fn commit(&mut self, flows: &mut Flows, a: &Action) {
        match *a {
            Action::Post {
                step, q, signaled, ..
            } => {
                flows.post(q, self.cfg.slots);
                let st = &mut self.st[step];
                st.frags += 1;
                st.outstanding += u32::from(signaled);
                if st.frags == self.frags_of(step) {
                    self.send_at[q] += 1;
                    let st = self.st[step];
                    if st.outstanding == 0 && !st.failed {
                        self.finish(step);
                    }
                }
            }
            // A mailbox call has at most one message each way per queue: taking it moves the
            // queue's head past it, as a slot call's last fragment does.
            Action::Recv {
                step,
                q,
                mailbox: true,
                ..
            } => {
                self.recv_at[q] += 1;
                self.finish(step);
            }
            Action::MailboxSend { step, q, .. } => {
                self.send_at[q] += 1;
                self.finish(step);
            }
            Action::Recv { step, q, .. } => {
                flows.consume(q);
                self.st[step].frags += 1;
                if self.st[step].frags == self.frags_of(step) {
                    self.recv_at[q] += 1;
                    self.finish(step);
                }
            }
            Action::Local { step } => {
                if let Some(i) = self.locals.iter().position(|&x| x as usize == step) {
                    self.locals.swap_remove(i);
                }
                self.finish(step);
            }
            Action::Credit { .. } => {}
        }
    }

    /// The next action of the pass the executor makes, committed (except a mailbox
    /// [`Action::Recv`], which the driver commits with [`Machine::commit`] once it found the
    /// message), or `None` at the end of the pass (the next call starts a new one). A pass: on
    /// every receive queue, consume what arrived; on every send queue, post while slots are
    /// free; run the runnable local steps; then return the credits due (the driver records
    /// each with [`Flows::credit_sent`] once posted). In mailbox mode, every step not done
    /// whose dependencies are.
    pub fn next(&mut self, flows: &mut Flows) -> Option<Action> {
        loop {
            let (phase, i) = self.cursor;
            let i = i as usize;
            let found = match phase {
                Phase::Mailbox => {
                    let Some(s) =
                        (i..self.st.len()).find(|&s| !self.st[s].done && self.deps_done(s))
                    else {
                        self.cursor = (Phase::Done, 0);
                        continue;
                    };
                    self.cursor = (Phase::Mailbox, s as u32 + 1);
                    let a = self.mailbox_action(s);
                    if !matches!(a, Action::Recv { .. }) {
                        self.commit(flows, &a);
                    }
                    return Some(a);
                }
                Phase::Recv => match self.queues.active_recv.get(i) {
                    None => None,
                    Some(&q) => match self.recv_candidate(flows, q as usize) {
                        Some(a) => Some(a),
                        None => {
                            self.cursor.1 += 1;
                            continue;
                        }
                    },
                },
                Phase::Send => match self.queues.active_send.get(i) {
                    None => None,
                    Some(&q) => match self.send_candidate(flows, q as usize) {
                        Some(a) => Some(a),
                        None => {
                            self.cursor.1 += 1;
                            continue;
                        }
                    },
                },
                Phase::Local => match self.locals.get(i) {
                    None => None,
                    Some(&s) if self.deps_done(s as usize) => {
                        Some(Action::Local { step: s as usize })
                    }
                    Some(_) => {
                        self.cursor.1 += 1;
                        continue;
                    }
                },
                Phase::Credit => {
                    if i >= flows.q.len() {
                        None
                    } else {
                        self.cursor.1 += 1;
                        match self.credit_candidate(flows, i) {
                            Some(a) => return Some(a),
                            None => continue,
                        }
                    }
                }
                Phase::Done => {
                    self.cursor = self.first_phase();
                    return None;
                }
            };
            match found {
                Some(a) => {
                    self.commit(flows, &a);
                    return Some(a);
                }
                None => self.cursor = (phase.after(), 0),
            }
        }
    }

    fn first_phase(&self) -> (Phase, u32) {
        if self.mailbox {
            (Phase::Mailbox, 0)
        } else {
            (Phase::Recv, 0)
        }
    }

    /// One whole pass of [`Machine::next`], each action performed by `f` (which, for a
    /// credit, records it with [`Flows::credit_sent`] once posted); its error ends the pass,
    /// and `Ok(false)` from it means a mailbox message had not arrived. Returns whether
    /// anything was done.
    pub fn pass<E>(
        &mut self,
        flows: &mut Flows,
        mut f: impl FnMut(&mut Flows, &Action) -> Result<bool, E>,
    ) -> Result<bool, E> {
        let mut progress = false;
        while let Some(a) = self.next(flows) {
            let done = f(flows, &a)?;
            if matches!(a, Action::Recv { mailbox: true, .. }) {
                if done {
                    self.commit(flows, &a);
                    progress = true;
                }
            } else if !matches!(a, Action::Credit { .. }) {
                progress = true;
            }
        }
        Ok(progress)
    }

    /// A signaled fragment of send step `s` completed (`ok`: successfully). A failed one
    /// keeps the step from ever being done.
    pub fn completed(&mut self, s: usize, ok: bool) {
        let Some(st) = self.st.get_mut(s) else { return };
        if st.outstanding == 0 {
            return;
        }
        st.outstanding -= 1;
        st.failed |= !ok;
        let st = *st;
        let posted_all = self
            .queues
            .queue_of(s)
            .is_some_and(|_| st.frags == self.frags_of(s));
        if st.outstanding == 0 && posted_all && !st.failed {
            self.finish(s);
        }
    }

    /// What the first step not done waits for (`None` once every step is done).
    pub fn waiting(&self, flows: &Flows) -> Option<Waiting> {
        let step = self.st.iter().position(|s| !s.done)?;
        let Some(q) = self.queues.queue_of(step) else {
            return Some(Waiting::Earlier { step, q: None });
        };
        let head = |list: &[u32], at: u32| list.get(at as usize) == Some(&(step as u32));
        let deps = self.deps_done(step);
        Some(match self.sched.steps[step].op {
            Op::Recv { .. }
                if deps && (self.mailbox || head(&self.queues.recv[q], self.recv_at[q])) =>
            {
                Waiting::Data { step, q }
            }
            Op::Send { .. } if deps && self.st[step].frags == self.frags_of(step) => {
                Waiting::Transport { step, q }
            }
            Op::Send { .. } if deps && head(&self.queues.send[q], self.send_at[q]) => {
                let f = &flows.q[q];
                Waiting::Slot {
                    step,
                    q,
                    posted: f.posted,
                    credit: f.credit,
                }
            }
            _ => Waiting::Earlier { step, q: Some(q) },
        })
    }
}

/// Whether a call runs in mailbox mode: the one decision, which both ends of every link must
/// make alike. The call's collective and algorithm must let every rank tell from its own
/// schedule what its peers' are ([`mailbox_call`]), and the schedule must fit the mailboxes
/// ([`mailbox_eligible`], with `mailbox_link(peer)` saying whether the link to the peer has
/// mailboxes: every link of the executor's to a rank; it stores into those it has mapped
/// (shm) and writes the others whole).
///
/// ```
/// use oxccl_core::protocol::{MAILBOX_DATA, mailbox_mode};
/// use oxccl_core::schedule::{Algorithm, Buf, CollectiveKind, Op, Region, Schedule, Step};
///
/// let step = |op| Step { op, deps: vec![] };
/// let sched = Schedule {
///     rank: 0,
///     steps: vec![
///         step(Op::Send { peer: 1, channel: 0, src: Region::new(Buf::Input, 0, 8) }),
///         step(Op::Recv {
///             peer: 1,
///             channel: 0,
///             dst: Region::new(Buf::Output, 0, 8),
///             reduce_with: None,
///         }),
///     ],
///     scratch: 0,
/// };
/// let ring = (CollectiveKind::AllReduce, Algorithm::Ring);
/// assert!(mailbox_mode(ring.0, ring.1, &sched, 2, 4, MAILBOX_DATA, |_| true));
/// // Not over a link without mailboxes, nor for a call one end cannot read off its schedule.
/// assert!(!mailbox_mode(ring.0, ring.1, &sched, 2, 4, MAILBOX_DATA, |_| false));
/// let v = CollectiveKind::AllToAllV;
/// assert!(!mailbox_mode(v, Algorithm::Direct, &sched, 2, 4, MAILBOX_DATA, |_| true));
/// ```
pub fn mailbox_mode(
    kind: CollectiveKind,
    algo: Algorithm,
    sched: &Schedule,
    peers: usize,
    esize: usize,
    max_bytes: usize,
    mailbox_link: impl Fn(usize) -> bool,
) -> bool {
    mailbox_call(kind, algo) && mailbox_eligible(sched, peers, esize, max_bytes, mailbox_link)
}

/// Whether a call of collective `kind` built with `algo` may run in mailbox mode at all: not
/// where one end's schedule cannot tell what the other's is (all_to_allv: a rank knows its own
/// blocks, not its peers'; proportional and hierarchical schedules, where a rank with empty
/// blocks talks to fewer peers), nor through the aggregation service (it never runs
/// mailboxes).
pub fn mailbox_call(kind: CollectiveKind, algo: Algorithm) -> bool {
    kind != CollectiveKind::AllToAllV
        && !matches!(
            algo,
            Algorithm::Proportional | Algorithm::Hierarchical | Algorithm::Aggregation
        )
}

/// Whether a schedule can run in mailbox mode: every peer it talks to gets exactly one
/// message each way, of at most `max_bytes`, and `mailbox_link(peer)` says the link to it
/// has mailboxes. One exchange per peer and call is what makes two mailboxes
/// enough: a peer sends its next message only after it has read ours of the call before, so
/// it never overwrites one still being read.
pub fn mailbox_eligible(
    sched: &Schedule,
    peers: usize,
    esize: usize,
    max_bytes: usize,
    mailbox_link: impl Fn(usize) -> bool,
) -> bool {
    let mut sends = vec![0u32; peers];
    let mut recvs = vec![0u32; peers];
    for step in &sched.steps {
        let (peer, len, is_send) = match step.op {
            Op::Send { peer, src, .. } => (peer, src.len, true),
            Op::Recv { peer, dst, .. } => (peer, dst.len, false),
            _ => continue,
        };
        if peer >= peers || !mailbox_link(peer) || len * esize > max_bytes {
            return false;
        }
        if is_send {
            sends[peer] += 1;
        } else {
            recvs[peer] += 1;
        }
    }
    sends.iter().any(|&c| c > 0) && sends == recvs && sends.iter().all(|&c| c <= 1)
}

#[cfg(test)]
mod tests;
