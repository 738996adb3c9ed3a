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
//! message and one of its stamp, into one of two mailboxes per peer. Steps then run in order
//! as their dependencies allow, a receive when the driver finds its message ([`Action::Recv`]
//! with `mailbox`; the driver's answer says whether it had arrived).

use std::collections::VecDeque;

use crate::schedule::{Op, Schedule};

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
    /// Which call of a group ([`Machine::id`]) receives on this queue now: fragments arrive
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

    fn mailbox_action(&self, s: usize) -> Action {
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

/// Whether a schedule can run in mailbox mode: every peer it talks to gets exactly one
/// message each way, of at most `max_bytes`, and `mailbox_link(peer)` says the link to it
/// has mailboxes (shared memory). One exchange per peer and call is what makes two mailboxes
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
mod tests {
    use super::*;
    use crate::schedule::{Buf, Region, Step};

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
                reduce_with: None,
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

    /// Link 0 leads to the other of two ranks.
    fn links(rank: usize) -> Vec<usize> {
        if rank == 0 {
            vec![usize::MAX, 0]
        } else {
            vec![0, usize::MAX]
        }
    }

    fn cfg(slots: usize, frag: usize, inline_max: usize) -> Config {
        let mut c = Config::new(1, slots, frag, 1);
        c.inline_max = inline_max;
        c
    }

    /// One rank's side in a two-rank run: its machine's queue state and what is on the wire
    /// towards the other.
    struct Side {
        flows: Flows,
        /// Fragments posted and not yet arrived: (slot, off, len, total).
        wire: VecDeque<(u32, usize, usize, usize)>,
        /// Credits posted and not yet arrived.
        credits: VecDeque<u64>,
        /// Signaled fragments posted and not completed: their step.
        completing: VecDeque<usize>,
        /// What the peer's slots hold: slot -> (off, len, total), until consumed.
        landed: Vec<Option<(usize, usize, usize)>>,
    }

    impl Side {
        fn new(slots: usize) -> Side {
            Side {
                flows: Flows::new(1, 1),
                wire: VecDeque::new(),
                credits: VecDeque::new(),
                completing: VecDeque::new(),
                landed: vec![None; slots],
            }
        }
    }

    /// Runs two ranks' schedules to the end, choosing among every enabled action and every
    /// delivery by `choose(n)`, and checks the protocol's invariants on the way: a fragment
    /// never lands in a slot whose previous fragment is not consumed, the receiver consumes
    /// exactly the fragment it expects, and both calls finish. Returns the actions taken.
    fn run_pair(
        s0: &Schedule,
        s1: &Schedule,
        c: Config,
        mut choose: impl FnMut(usize) -> usize,
    ) -> Result<usize, String> {
        let l0 = links(0);
        let l1 = links(1);
        let q0 = Queues::new(s0, &l0, 1)?;
        let q1 = Queues::new(s1, &l1, 1)?;
        let mut m = [
            Machine::new(s0, &q0, c, 1, false, Reuse::default()),
            Machine::new(s1, &q1, c, 1, false, Reuse::default()),
        ];
        let mut side = [Side::new(c.slots), Side::new(c.slots)];
        let mut taken = 0;
        let mut acts = Vec::new();
        loop {
            // Every choice: (rank, Some(action)) or a delivery (rank, None, kind).
            let mut choices: Vec<(usize, Option<Action>, u8)> = Vec::new();
            for r in 0..2 {
                m[r].enabled(&side[r].flows, &mut acts);
                choices.extend(acts.iter().map(|a| (r, Some(*a), 0)));
                if !side[r].wire.is_empty() {
                    choices.push((r, None, 1));
                }
                if !side[r].credits.is_empty() {
                    choices.push((r, None, 2));
                }
                if !side[r].completing.is_empty() {
                    choices.push((r, None, 3));
                }
            }
            if choices.is_empty() {
                break;
            }
            let (r, a, kind) = choices.swap_remove(choose(choices.len()));
            let o = 1 - r;
            taken += 1;
            match (a, kind) {
                (Some(a), _) => {
                    m[r].commit(&mut side[r].flows, &a);
                    match a {
                        Action::Post {
                            step,
                            slot,
                            off,
                            len,
                            total,
                            signaled,
                            ..
                        } => {
                            let dest = &mut side[r].landed[slot as usize];
                            if dest.is_some() {
                                return Err(format!("rank {r} overwrote slot {slot}"));
                            }
                            *dest = Some((off, len, total));
                            side[r].wire.push_back((slot, off, len, total));
                            if signaled {
                                side[r].completing.push_back(step);
                            }
                        }
                        Action::Recv {
                            slot,
                            off,
                            len,
                            total,
                            ..
                        } => {
                            let got = side[o].landed[slot as usize].take();
                            if got != Some((off, len, total)) {
                                return Err(format!(
                                    "rank {r} expected {:?} in slot {slot}, found {got:?}",
                                    (off, len, total)
                                ));
                            }
                        }
                        Action::Credit { q, consumed } => {
                            side[r].flows.credit_sent(q, consumed);
                            side[r].credits.push_back(consumed);
                        }
                        Action::Local { .. } | Action::MailboxSend { .. } => {}
                    }
                }
                (None, 1) => {
                    let (slot, ..) = side[r].wire.pop_front().unwrap();
                    side[o].flows.arrived(0, slot);
                }
                (None, 2) => {
                    let v = side[r].credits.pop_front().unwrap();
                    side[o].flows.credit(0, v);
                }
                (None, _) => {
                    let s = side[r].completing.pop_front().unwrap();
                    m[r].completed(s, true);
                }
            }
        }
        for (r, mach) in m.iter().enumerate() {
            if !mach.is_done() {
                return Err(format!(
                    "rank {r} stuck: {:?}",
                    mach.waiting(&side[r].flows)
                ));
            }
        }
        Ok(taken)
    }

    /// Every order of events (actions of both ranks, arrivals, credits, completions) of a
    /// small exchange, explored exhaustively by depth-first search over the choices: the
    /// orders the verifier samples at random.
    #[test]
    fn every_event_order_of_a_small_exchange_finishes_correctly() {
        // Rank 0 sends 3 fragments (2 with two slots) then receives 1; rank 1 receives then
        // sends (a credit every fragment either way).
        for (slots, inline_max, len) in [(1, 0, 5), (1, 1, 5), (2, 0, 3), (2, 2, 3)] {
            let s0 = sched(0, vec![send(1, len, &[]), recv(1, 2, &[0])]);
            let s1 = sched(1, vec![recv(0, len, &[]), send(0, 2, &[0])]);
            let c = cfg(slots, 2, inline_max);
            // Depth-first over choice sequences: `path` holds (choice, alternatives) per level.
            let mut path: Vec<(usize, usize)> = Vec::new();
            let mut runs = 0;
            loop {
                let mut depth = 0;
                let mut trail = Vec::new();
                run_pair(&s0, &s1, c, |n| {
                    let pick = if depth < path.len() { path[depth].0 } else { 0 };
                    trail.push((pick, n));
                    depth += 1;
                    pick
                })
                .unwrap_or_else(|e| panic!("inline_max {inline_max}, order {trail:?}: {e}"));
                runs += 1;
                path = trail;
                while let Some((pick, n)) = path.pop() {
                    if pick + 1 < n {
                        path.push((pick + 1, n));
                        break;
                    }
                }
                if path.is_empty() {
                    break;
                }
                assert!(runs < 3_000_000, "too many orders to explore");
            }
            eprintln!("slots {slots} inline_max {inline_max}: {runs} orders");
            assert!(runs > 100, "only {runs} orders explored");
        }
    }

    /// The receives ahead on a queue name the numbers the sender gives their fragments, and
    /// whether their dependencies are done.
    #[test]
    fn receives_ahead_name_their_first_fragments() {
        // Rank 1 receives 5 bytes (3 fragments of 2), then 3 more (2 fragments) after a local
        // step that depends on the first receive, then 2 (1 fragment) with no dependency.
        let copy = Step {
            op: Op::Copy {
                src: Region::new(Buf::Output, 0, 1),
                dst: Region::new(Buf::Scratch, 0, 1),
            },
            deps: vec![0],
        };
        let s1 = sched(
            1,
            vec![recv(0, 5, &[]), copy, recv(0, 3, &[1]), recv(0, 2, &[])],
        );
        let q1 = Queues::new(&s1, &links(1), 1).unwrap();
        let c = cfg(8, 2, 0);
        let mut flows = Flows::new(1, 1);
        // Fragments of an earlier call were consumed on this queue already.
        for slot in 0..4 {
            flows.arrived(0, slot);
            flows.consume(0);
        }
        let mut m = Machine::new(&s1, &q1, c, 1, false, Reuse::default());
        assert_eq!(m.receive_queues(), &[0]);
        let ahead = |m: &Machine<'_>, flows: &Flows| m.receives_ahead(flows, 0).collect::<Vec<_>>();
        assert_eq!(
            ahead(&m, &flows),
            vec![(0, 0, 4, true), (1, 2, 7, false), (2, 3, 9, true)]
        );
        // The sender's numbering: its posts on the queue so far.
        let mut sender = Flows::new(1, 1);
        for _ in 0..4 {
            sender.post(0, 8);
        }
        assert_eq!(
            sender.get(0).posted,
            4,
            "the first fragment of the receive is number 4"
        );
        // Midway through the first receive, the numbers stay.
        flows.arrived(0, 4);
        let a = m.next(&mut flows).unwrap();
        assert!(matches!(a, Action::Recv { step: 0, .. }));
        assert_eq!(ahead(&m, &flows)[1..], [(1, 2, 7, false), (2, 3, 9, true)]);
        for slot in 5..7 {
            flows.arrived(0, slot);
        }
        while m.next(&mut flows).is_some() {}
        assert!(m.step(0).done && m.step(1).done);
        assert_eq!(ahead(&m, &flows), vec![(1, 2, 7, true), (2, 3, 9, true)]);
        // Another call's turn, or mailbox mode: nothing.
        flows.q[0].recv_turn = 1;
        assert!(ahead(&m, &flows).is_empty());
        flows.q[0].recv_turn = 0;
        let mb = Machine::new(&s1, &q1, c, 1, true, Reuse::default());
        assert!(ahead(&mb, &flows).is_empty());
    }

    #[test]
    fn random_orders_of_longer_exchanges_finish_correctly() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        for slots in 1..=5 {
            for len in [0, 1, 7, 64, 100] {
                let s0 = sched(
                    0,
                    vec![send(1, len, &[]), recv(1, len, &[]), send(1, 3, &[1])],
                );
                let s1 = sched(
                    1,
                    vec![send(0, len, &[]), recv(0, len, &[]), recv(0, 3, &[])],
                );
                for _ in 0..20 {
                    run_pair(&s0, &s1, cfg(slots, 4, 2), &mut rnd)
                        .unwrap_or_else(|e| panic!("slots {slots} len {len}: {e}"));
                }
            }
        }
    }

    /// `Flows::post` and `Flows::consume` keep the counters as the machine's own posts and
    /// receives do: the same slots, the same window, the same credits due.
    #[test]
    fn posting_and_consuming_by_hand_match_the_machine() {
        let c = Config::new(1, 4, 10, 1);
        let s0 = sched(0, vec![send(1, 60, &[])]);
        let l0 = links(0);
        let q0 = Queues::new(&s0, &l0, 1).unwrap();
        let mut by_machine = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, c, 1, false, Reuse::default());
        let mut slots = Vec::new();
        while let Some(a) = m.next(&mut by_machine) {
            if let Action::Post { slot, .. } = a {
                slots.push(slot);
            }
        }
        let mut by_hand = Flows::new(1, 1);
        let mut hand = Vec::new();
        while by_hand.get(0).free(c.slots) > 0 {
            hand.push(by_hand.post(0, c.slots));
        }
        assert_eq!(hand, slots);
        assert_eq!(hand, [0, 1, 2, 3]);
        assert_eq!(by_hand.get(0).posted, by_machine.get(0).posted);
        // The receiver's side: nothing to consume, then the arrivals in order.
        let mut rx = Flows::new(1, 1);
        assert_eq!(rx.consume(0), None);
        assert_eq!(rx.get(0).consumed, 0);
        for slot in [0, 1, 2] {
            rx.arrived(0, slot);
        }
        assert_eq!(rx.consume(0), Some(0));
        assert!(!rx.credit_due(0, c.credit_every));
        assert_eq!(rx.consume(0), Some(1));
        assert!(rx.credit_due(0, c.credit_every), "every slots / 2 = 2");
        rx.credit_sent(0, 2);
        assert_eq!(rx.consume(0), Some(2));
        assert!(!rx.credit_due(0, c.credit_every));
        assert_eq!(rx.get(0).consumed, 3);
        // The credit frees the sender's slots.
        by_hand.credit(0, 2);
        assert_eq!(by_hand.get(0).free(c.slots), 2);
        assert_eq!(by_hand.post(0, c.slots), 0);
    }

    #[test]
    fn fragments_and_credits_follow_the_configuration() {
        let c = Config::new(1, 8, 10, 4);
        assert_eq!((c.frag_bytes, c.credit_every), (8, 4));
        assert_eq!(c.fragments(0), 1);
        assert_eq!(c.fragment(0, 0), (0, 0));
        assert_eq!(c.fragments(17), 3);
        assert_eq!(c.fragment(17, 2), (16, 1));
        assert_eq!(
            Config::new(1, 1, 3, 4).frag_bytes,
            4,
            "one element at least"
        );
        assert_eq!(Config::new(1, 1, 3, 4).credit_every, 1);
    }

    /// The executor's pass, driven against a receiver that never returns credits: the sender
    /// posts exactly `slots` fragments and then says it waits for a slot.
    #[test]
    fn a_sender_stops_at_the_receivers_slots_and_says_so() {
        let s0 = sched(0, vec![send(1, 100, &[])]);
        let l0 = links(0);
        let q0 = Queues::new(&s0, &l0, 1).unwrap();
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, cfg(3, 10, 0), 1, false, Reuse::default());
        let mut posts = Vec::new();
        let progress = m
            .pass(&mut flows, |_, a| {
                posts.push(*a);
                Ok::<_, ()>(true)
            })
            .unwrap();
        assert!(progress);
        assert_eq!(posts.len(), 3);
        assert!(matches!(
            posts[2],
            Action::Post {
                slot: 2,
                off: 20,
                len: 10,
                ..
            }
        ));
        assert!(!m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap());
        assert_eq!(
            m.waiting(&flows),
            Some(Waiting::Slot {
                step: 0,
                q: 0,
                posted: 3,
                credit: 0
            })
        );
        // A late, smaller credit value changes nothing; a larger one frees slots.
        flows.credit(0, 2);
        flows.credit(0, 1);
        assert_eq!(flows.get(0).credit, 2);
        let mut n = 0;
        m.pass(&mut flows, |_, a| {
            assert!(matches!(a, Action::Post { slot, .. } if *slot == (3 + n) % 3));
            n += 1;
            Ok::<_, ()>(true)
        })
        .unwrap();
        assert_eq!(n, 2);
    }

    #[test]
    fn a_send_is_done_only_once_its_signaled_fragments_completed() {
        let s0 = sched(0, vec![send(1, 30, &[])]);
        let l0 = links(0);
        let q0 = Queues::new(&s0, &l0, 1).unwrap();
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, cfg(8, 10, 0), 1, false, Reuse::default());
        m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap();
        assert!(!m.is_done());
        assert_eq!(
            m.waiting(&flows),
            Some(Waiting::Transport { step: 0, q: 0 })
        );
        m.completed(0, true);
        m.completed(0, true);
        assert!(!m.is_done());
        m.completed(0, true);
        assert!(m.is_done());
        // A completion that comes after the step is done is ignored.
        m.completed(0, true);
        assert!(m.is_done());
        // A failed completion keeps the step from being done.
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, cfg(8, 10, 0), 1, false, m.into_reuse());
        m.pass(&mut flows, |_, _| Ok::<_, ()>(true)).unwrap();
        m.completed(0, false);
        m.completed(0, true);
        m.completed(0, true);
        assert!(!m.is_done());
        assert!(m.step(0).failed);
        // Inline fragments are done as they are posted.
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, cfg(8, 10, 10), 1, false, m.into_reuse());
        m.pass(&mut flows, |_, a| {
            assert!(matches!(
                a,
                Action::Post {
                    signaled: false,
                    ..
                }
            ));
            Ok::<_, ()>(true)
        })
        .unwrap();
        assert!(m.is_done() && !m.outstanding());
    }

    /// Fragments of the next call that arrive before it starts stay queued for it, and the
    /// slot counters carry on across calls.
    #[test]
    fn early_fragments_wait_for_the_next_call() {
        let s1 = sched(1, vec![recv(0, 5, &[])]);
        let l1 = links(1);
        let q1 = Queues::new(&s1, &l1, 1).unwrap();
        let mut flows = Flows::new(1, 1);
        for slot in [0, 1, 2, 0] {
            flows.arrived(0, slot);
        }
        let mut reuse = Reuse::default();
        let mut slots = Vec::new();
        for _ in 0..2 {
            let mut m = Machine::new(&s1, &q1, cfg(3, 3, 0), 1, false, reuse);
            m.pass(&mut flows, |_, a| {
                if let Action::Recv { slot, .. } = a {
                    slots.push(*slot);
                }
                Ok::<_, ()>(true)
            })
            .unwrap();
            assert!(m.is_done());
            reuse = m.into_reuse();
        }
        assert_eq!(slots, [0, 1, 2, 0]);
        assert_eq!(flows.get(0).consumed, 4);
    }

    #[test]
    fn steps_wait_for_their_dependencies() {
        let mut steps = vec![
            Step {
                op: Op::Copy {
                    src: Region::new(Buf::Input, 0, 4),
                    dst: Region::new(Buf::Output, 0, 4),
                },
                deps: vec![],
            },
            recv(1, 4, &[0]),
        ];
        steps.push(send(1, 4, &[1]));
        let s0 = sched(0, steps);
        let l0 = links(0);
        let q0 = Queues::new(&s0, &l0, 1).unwrap();
        let mut flows = Flows::new(1, 1);
        flows.arrived(0, 0);
        let mut m = Machine::new(&s0, &q0, cfg(4, 8, 0), 1, false, Reuse::default());
        let mut acts = Vec::new();
        m.enabled(&flows, &mut acts);
        assert_eq!(
            acts,
            [Action::Local { step: 0 }],
            "the receive waits for the copy"
        );
        m.commit(&mut flows, &acts[0]);
        m.enabled(&flows, &mut acts);
        assert!(matches!(acts[..], [Action::Recv { step: 1, .. }]));
        m.commit(&mut flows, &acts[0].clone());
        m.enabled(&flows, &mut acts);
        assert!(matches!(acts[..], [Action::Post { step: 2, .. }]));
        assert_eq!(m.steps_done(), 2);
    }

    #[test]
    fn credits_go_back_every_half_of_the_slots() {
        let s1 = sched(1, vec![recv(0, 8, &[])]);
        let l1 = links(1);
        let q1 = Queues::new(&s1, &l1, 1).unwrap();
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(
            &s1,
            &q1,
            Config::new(1, 4, 1, 1),
            1,
            false,
            Reuse::default(),
        );
        let mut credits = Vec::new();
        for slot in 0..8u32 {
            flows.arrived(0, slot % 4);
            m.pass(&mut flows, |f, a| {
                if let Action::Credit { q, consumed } = *a {
                    f.credit_sent(q, consumed);
                    credits.push(consumed);
                }
                Ok::<_, ()>(true)
            })
            .unwrap();
        }
        assert_eq!(credits, [2, 4, 6, 8]);
        assert!(m.is_done());
    }

    #[test]
    fn mailbox_mode_runs_steps_as_their_messages_arrive() {
        let s0 = sched(0, vec![send(1, 4, &[]), recv(1, 4, &[])]);
        let l0 = links(0);
        let q0 = Queues::new(&s0, &l0, 1).unwrap();
        assert!(mailbox_eligible(&s0, 2, 4, 64, |p| p == 1));
        assert!(!mailbox_eligible(&s0, 2, 4, 8, |p| p == 1), "too large");
        assert!(!mailbox_eligible(&s0, 2, 4, 64, |_| false), "no mailboxes");
        let twice = sched(0, vec![send(1, 4, &[]), send(1, 4, &[]), recv(1, 4, &[])]);
        assert!(
            !mailbox_eligible(&twice, 2, 4, 64, |_| true),
            "two messages"
        );
        let mut flows = Flows::new(1, 1);
        let mut m = Machine::new(&s0, &q0, cfg(2, 8, 0), 4, true, Reuse::default());
        let mut seen = Vec::new();
        let arrived = std::cell::Cell::new(false);
        for _ in 0..2 {
            m.pass(&mut flows, |_, a| {
                seen.push(*a);
                Ok::<_, ()>(!matches!(a, Action::Recv { .. }) || arrived.get())
            })
            .unwrap();
            arrived.set(true);
        }
        assert!(m.is_done());
        // Done with its peer: a failed link to it does not concern this call any more.
        assert!(!m.receiving_on(0) && !m.sending_on(0));
        assert_eq!(m.needs_link(0), (false, false));
        assert_eq!(
            seen,
            [
                Action::MailboxSend {
                    step: 0,
                    q: 0,
                    total: 16
                },
                Action::Recv {
                    step: 1,
                    q: 0,
                    slot: 0,
                    off: 0,
                    len: 16,
                    total: 16,
                    mailbox: true
                },
                Action::Recv {
                    step: 1,
                    q: 0,
                    slot: 0,
                    off: 0,
                    len: 16,
                    total: 16,
                    mailbox: true
                },
            ]
        );
    }

    /// Two calls of a group on one queue: each takes the fragments of its own transfer, in
    /// the order of the calls, whichever is driven first; and a later call posts only once
    /// the earlier one has posted everything.
    #[test]
    fn calls_of_a_group_take_their_turns_on_a_shared_queue() {
        let a = sched(1, vec![recv(0, 8, &[]), send(0, 4, &[])]);
        let b = sched(1, vec![recv(0, 4, &[]), send(0, 4, &[])]);
        let l1 = links(1);
        let (qa, qb) = (
            Queues::new(&a, &l1, 1).unwrap(),
            Queues::new(&b, &l1, 1).unwrap(),
        );
        let c = cfg(8, 4, 0);
        let mut calls = [
            Machine::new(&a, &qa, c, 1, false, Reuse::default()).with_id(0),
            Machine::new(&b, &qb, c, 1, false, Reuse::default()).with_id(1),
        ];
        let mut flows = Flows::new(1, 1);
        flows.pass_turns(&calls);
        // Call 0 has two fragments to receive, call 1 one; all three have arrived.
        for slot in 0..3 {
            flows.arrived(0, slot);
        }
        let mut log = Vec::new();
        for _ in 0..3 {
            for (i, m) in calls.iter_mut().enumerate().rev() {
                while let Some(a) = m.next(&mut flows) {
                    log.push((i, a));
                }
            }
            flows.pass_turns(&calls);
        }
        let got: Vec<(usize, u32)> = log
            .iter()
            .filter_map(|(i, a)| match a {
                Action::Recv { slot, .. } => Some((*i, *slot)),
                _ => None,
            })
            .collect();
        assert_eq!(got, [(0, 0), (0, 1), (1, 2)]);
        let posts: Vec<(usize, u32)> = log
            .iter()
            .filter_map(|(i, a)| match a {
                Action::Post { slot, .. } => Some((*i, *slot)),
                _ => None,
            })
            .collect();
        assert_eq!(posts, [(0, 0), (1, 1)], "call 1 posts after call 0");
        assert!(calls[1].step(0).done && calls[0].step(0).done);
    }

    #[test]
    fn queues_refuse_bad_schedules() {
        let bad_peer = sched(0, vec![send(0, 4, &[])]);
        assert!(
            Queues::new(&bad_peer, &links(0), 1)
                .unwrap_err()
                .contains("peer 0")
        );
        let forward = sched(0, vec![send(1, 4, &[1]), recv(1, 4, &[])]);
        assert!(
            Queues::new(&forward, &links(0), 1)
                .unwrap_err()
                .contains("depends on step 1")
        );
    }
}
