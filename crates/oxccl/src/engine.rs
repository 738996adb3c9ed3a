//! The executor: runs one rank's [`Schedule`] over verbs.
//!
//! It drives the protocol of [`oxccl_core::protocol`], the same for every provider and the
//! one the verifier and the simulator drive: the state machine ([`Machine`]) says which
//! fragment to post into which of the peer's slots, which arrived fragment to consume, which
//! local step to run and when to return a credit; this module performs those actions over
//! verbs and feeds back what the completion queues say. For each peer and channel the receiver
//! exposes `slots` slots of `SLOT_HEADER + slot_data` bytes in a registered region. The sender
//! writes a fragment with WRITE_WITH_IMM (imm = channel and slot): a 64-byte header (the
//! collective's sequence number and fingerprint, the transfer's length, the fragment's offset)
//! followed by the data, taken from the user's buffer in place (registered for the call) or,
//! for small fragments, copied beside the header in a staging region. The receiver checks the
//! header, reduces or copies straight out of the slot into its destination, and every
//! `slots / 2` fragments returns a credit: a WRITE_WITH_IMM of its consumed count into a
//! counter word beside the sender's slots, so a sender waiting for room sleeps on its
//! completion queue. Small one-shot exchanges on shm run in mailboxes instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(crate) use oxccl_core::protocol::Geometry;
use oxccl_core::protocol::mailbox::SHORT_HEADER;
use oxccl_core::protocol::{
    self, ANNOUNCE, ANNOUNCE_RING, Action, Announce, Flows, Header, Imm, MAILBOX_DATA, Machine,
    Notice, PLACE_MIN, Queues, Reuse, SLOT_HEADER, Violation, Waiting,
};
use oxccl_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, ProtectionDomain, Provider, QpState, QueuePair,
    RecvWr, RemoteAddr, RemoteBuffer, RemoteMapping, SendWr, Sge, WcStatus, WorkCompletion, WrOp,
};

use crate::comm::{RegCache, Registry};
use crate::error::{Error, OpDesc, Result};
use crate::fault::Injector;
use crate::flight::Probe;
use crate::mailbox::{self, Inbox};
use crate::meter::{Delivered, EgressMeter, LinkMeter};
use crate::reduce;
use crate::schedule::{Buf, CollectiveKind, Op, Region, Schedule};
use crate::{DataType, ReduceOp};

// wr_id: kind in the top byte; then, for data, the call (the engine's count of calls, modulo
// 2^24) and the step; for receives, the link index.
const WR_RECV: u64 = 1 << 56;
const WR_DATA: u64 = 2 << 56;
const WR_CTRL: u64 = 3 << 56;

/// The wr_id of a fragment that step `step` of the engine's call number `call` sends.
fn data_wr_id(call: u64, step: usize) -> u64 {
    WR_DATA | (call & 0xff_ffff) << 32 | (step as u64 & 0xffff_ffff)
}

/// The step a data completion belongs to, if it belongs to call number `call`: a call does
/// not wait for the completions of its inline fragments (their data was copied), so one may
/// still arrive during a later call, whose step with the same index it must not count. (The
/// engine's own count, not the call's sequence number: point-to-point calls number theirs
/// per peer, so two calls in a row may share one.)
fn data_wr_step(wr_id: u64, call: u64) -> Option<usize> {
    ((wr_id >> 32) & 0xff_ffff == call & 0xff_ffff).then_some((wr_id & 0xffff_ffff) as usize)
}

/// One connected peer.
pub(crate) struct Link {
    pub(crate) peer: usize,
    pub(crate) provider: Provider,
    pub(crate) qp: QueuePair,
    /// Index of the provider context ([`Engine::cqs`]) this link belongs to.
    pub(crate) ctx: usize,
    /// Where the peer writes to us: slots, then credit words.
    slots: MemoryRegion,
    /// Our headers, inline data and credit source words.
    stage: MemoryRegion,
    /// The peer's receive region for our fragments.
    remote: RemoteBuffer,
    /// The same region mapped into this process, where the provider maps it (shm): mailbox
    /// messages are stored straight into it ([`crate::mailbox`]).
    outbox: Option<RemoteMapping>,
    /// Why the connection failed, once it has.
    failed: Option<String>,
    /// Mailbox messages sent to and received from this peer.
    mbox_sent: u64,
    mbox_recv: u64,
    /// What our data fragments to this peer delivered (tcp links only; see [`crate::meter`]).
    pub(crate) meter: Option<LinkMeter>,
}

impl Link {
    /// Allocates this side's regions; [`Link::connect`] completes it.
    pub(crate) fn new(
        peer: usize,
        provider: Provider,
        ctx: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        geo: &Geometry,
    ) -> oxccl_verbs::Result<Link> {
        let slots = pd.alloc_mr(
            geo.recv_region(),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        let stage = pd.alloc_mr(geo.stage_region(), AccessFlags::LOCAL_WRITE)?;
        Ok(Link {
            peer,
            provider,
            qp,
            ctx,
            slots,
            stage,
            remote: RemoteBuffer {
                addr: 0,
                len: 0,
                rkey: 0,
            },
            outbox: None,
            failed: None,
            mbox_sent: 0,
            mbox_recv: 0,
            meter: (provider == Provider::Tcp).then(LinkMeter::default),
        })
    }

    /// What the peer needs to write to us.
    pub(crate) fn local_region(&self) -> RemoteBuffer {
        self.slots.remote()
    }

    /// Records the peer's region (mapping it where the provider can), and posts the receive
    /// queue. The queue pair is connected.
    pub(crate) fn connect(
        &mut self,
        remote: RemoteBuffer,
        geo: &Geometry,
        index: usize,
    ) -> oxccl_verbs::Result<()> {
        self.remote = remote;
        self.outbox = self.qp.map_remote(remote, AccessFlags::REMOTE_WRITE)?;
        let wrs: Vec<RecvWr<'_>> = (0..geo.recv_depth())
            .map(|_| RecvWr::new(WR_RECV | index as u64, &[]))
            .collect();
        self.qp.post_recv(&wrs)
    }

    /// Records a failure the queue pair shows (ERR, even before a completion says so).
    fn refresh_failed(&mut self) {
        if self.failed.is_none()
            && matches!(
                self.qp.state(),
                oxccl_verbs::QpState::Err | oxccl_verbs::QpState::Destroyed
            )
        {
            let d = self.qp.error_detail();
            self.failed = Some(d.unwrap_or_else(|| "the connection failed".into()));
        }
    }

    /// The fragment header at byte `off` of the receive region.
    fn header_at(&self, off: usize) -> oxccl_verbs::Result<Header> {
        let mut hb = [0u8; SLOT_HEADER];
        self.slots.read(off, &mut hb)?;
        Ok(Header::decode(&hb))
    }

    /// The mailbox the peer's next message arrives in.
    fn inbox(&self, geo: &Geometry) -> Inbox<'_> {
        Inbox::new(
            &self.slots,
            geo.mailbox_offset((self.mbox_recv % 2) as usize),
        )
    }

    /// Whether the header of the peer's next mailbox message has arrived.
    fn mailbox_arrived(&self, geo: &Geometry) -> bool {
        self.inbox(geo).header_arrived(self.mbox_recv + 1)
    }

    fn credit_word(&self, ch: usize, geo: &Geometry) -> u64 {
        self.slots
            .atomic_u64(geo.credit_offset(ch))
            .map(|a| a.load(Ordering::Acquire))
            .unwrap_or(0)
    }
}

/// A schedule with what the executor learns about it once: whether it runs in mailboxes.
pub(crate) struct Plan {
    pub(crate) sched: Schedule,
    mailbox: std::sync::OnceLock<bool>,
    /// The protocol's queues, derived on first use.
    queues: std::sync::OnceLock<std::result::Result<Queues, String>>,
}

impl Plan {
    /// `mailbox_ok`: whether the mailbox protocol may be considered. It must be chosen alike
    /// at both ends of every link, so never where one end's schedule cannot tell what the
    /// other's is (all_to_allv: a rank knows its own blocks, not its peers'; proportional and
    /// hierarchical schedules, where a rank with empty blocks talks to fewer peers).
    pub(crate) fn new(sched: Schedule, mailbox_ok: bool) -> Plan {
        let mailbox = std::sync::OnceLock::new();
        if !mailbox_ok {
            let _ = mailbox.set(false);
        }
        Plan {
            sched,
            mailbox,
            queues: std::sync::OnceLock::new(),
        }
    }
}

/// The last calls this engine ran (to name the call a peer's late data or notice is about).
#[derive(Default)]
struct Recent {
    calls: [Option<OpDesc>; 16],
    next: usize,
}

impl Recent {
    fn push(&mut self, d: OpDesc) {
        self.calls[self.next % 16] = Some(d);
        self.next = self.next.wrapping_add(1);
    }

    fn newest_first(&self) -> impl Iterator<Item = &OpDesc> {
        (1..=16).filter_map(|i| self.calls[self.next.wrapping_sub(i) % 16].as_ref())
    }
}

/// The spin of an idle call after one whose wait outlasted its spin ([`Engine::adapt_spin`]).
const SHORT_SPIN: Duration = Duration::from_micros(2);

/// Polls of one awaited mailbox flag between passes of an idle mailbox call.
const MAILBOX_SPIN: u32 = 64;

/// Extra polling a call gets once its time is up, before it reports a timeout: what the
/// transport already holds (a peer's abort or failure notice, the awaited data itself) comes
/// first. A process stopped past its deadline (SIGSTOP, a debugger) finds it still unread.
const TIMEOUT_GRACE: Duration = Duration::from_millis(100);

/// Whether a call's time is up (after one [`TIMEOUT_GRACE`]).
fn expired(deadline: &mut Instant, graced: &mut bool, now: Instant) -> bool {
    if now < *deadline {
        return false;
    }
    if !*graced {
        *graced = true;
        *deadline = now + TIMEOUT_GRACE;
        return false;
    }
    true
}

/// The caller's buffers for one call, as raw memory: the engine is their only user until the
/// call returns.
pub(crate) struct Bufs {
    pub input: *const u8,
    pub input_len: usize,
    pub output: *mut u8,
    pub output_len: usize,
}

/// Which registration covers a region: the engine's scratch (per context) or one of the
/// call's own.
#[derive(Clone, Copy)]
enum MrRef {
    Scratch(usize),
    Call(usize),
    /// A registered buffer ([`RegCache::get`]) in context `.1`.
    Registered(usize, usize),
}

/// Memory registrations of one call's buffers, per provider context, made on first use.
#[derive(Default)]
struct CallMrs {
    mrs: Vec<((u8, usize), MemoryRegion)>,
}

/// A communicator's abort switch: set by `Communicator::abort` or the watchdog, with why.
#[derive(Default)]
pub(crate) struct AbortFlag {
    set: AtomicBool,
    why: std::sync::OnceLock<String>,
}

impl AbortFlag {
    /// Sets the switch; the first reason given is kept.
    pub(crate) fn set(&self, why: &str) {
        let _ = self.why.set(why.to_string());
        self.set.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Relaxed)
    }

    pub(crate) fn reason(&self) -> &str {
        self.why.get().map_or("aborted", String::as_str)
    }
}

/// The per-communicator executor.
pub(crate) struct Engine {
    pub(crate) rank: usize,
    pub(crate) geo: Geometry,
    pub(crate) links: Vec<Link>,
    /// Link index per rank (`usize::MAX` for ourselves).
    pub(crate) link_of: Vec<usize>,
    /// One protection domain and completion queue per provider context.
    pub(crate) pds: Vec<ProtectionDomain>,
    pub(crate) cqs: Vec<CompletionQueue>,
    pub(crate) abort: Arc<AbortFlag>,
    /// Where the running call publishes its progress (for the flight recorder).
    pub(crate) probe: Arc<Probe>,
    /// Injected faults (`OXCCL_FAULT`), if this rank has any.
    pub(crate) faults: Option<Box<Injector>>,
    /// The notice to send every peer when closing (why this communicator failed), if any.
    last_words: Option<u32>,
    /// The last calls, for naming the one a peer reports a mismatch in.
    recent: Recent,
    /// Each completion queue's doorbell when it was last polled.
    doorbells: Vec<u32>,
    /// Every queue's flow control (slots posted, credits, fragments arrived), kept across
    /// calls.
    flows: Flows,
    /// The last call's protocol buffers, kept for the next (no allocation per call).
    reuse: Reuse,
    /// Whether schedules may run in mailboxes (`OXCCL_PROTO=slots` forbids it).
    pub(crate) mailbox_allowed: bool,
    /// A mismatch a peer reported in a call this rank had not reached: (sequence number
    /// modulo 2^24, the peer).
    pending_mismatch: Option<(u32, usize)>,
    /// Whether the last call's [`Error::PeerFailed`] came from a peer's notice (so it is not
    /// passed on again).
    pub(crate) failed_by_notice: bool,
    /// How long an idle call polls without yielding ([`crate::Options::idle_spin`]).
    spin_for: Duration,
    /// How long the next idle call polls without yielding: [`Engine::spin_for`] while waits
    /// end within it, [`SHORT_SPIN`] after one that did not (a peer that shares our CPU
    /// cannot answer while we spin: see [`Engine::adapt_spin`]).
    spin_now: Duration,
    /// How long an idle call then polls, yielding the CPU between polls, before it sleeps on
    /// the completion queue ([`crate::Options::idle_yield`]).
    pub(crate) yield_for: Duration,
    scratch: Vec<u64>,
    scratch_mrs: Vec<Option<MemoryRegion>>,
    wcs: Vec<WorkCompletion>,
    /// Whether the running call meters its tcp links ([`crate::meter`]).
    pub(crate) metering: bool,
    /// This rank's aggregate rate over its metered links.
    egress: EgressMeter,
    /// Calls executed so far: tags the data requests of each (see [`data_wr_id`]).
    calls: u64,
    /// The communicator's registered buffers ([`crate::Communicator::register`]), and this
    /// engine's copy of them.
    pub(crate) registry: Arc<Registry>,
    regs: RegCache,
    /// Per queue: the fragment number up to which receives were considered for announcing
    /// ([`Call::announce_ready`]), and the announcements made (their ring's next record).
    announced: Vec<u64>,
    announcements: Vec<u64>,
    /// Bytes moved, by how ([`Stats`]).
    pub(crate) stats: Stats,
}

/// What an engine has moved through memory since it started, counted by the executor:
/// `oxccl::Communicator::stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes this rank handed to its connections to land in a peer's slots (a copy each, by
    /// the provider or the network).
    pub sent: u64,
    /// Bytes this rank wrote in place into a peer's destination (zero copy: no slot, and no
    /// copy at the receiver).
    pub placed: u64,
    /// Bytes this rank copied out of its slots and mailboxes into destinations.
    pub copied: u64,
    /// Bytes this rank reduced out of its slots and mailboxes into destinations.
    pub reduced: u64,
    /// Bytes of this rank's local steps (copies and reductions between its own buffers).
    pub local: u64,
    /// Bytes peers wrote in place into this rank's destinations.
    pub received_in_place: u64,
}

impl Stats {
    /// Bytes that went through memory in a copy or a reduction, at this rank: what it sent
    /// (one copy each, slot or in place), what it took out of slots, and its local steps.
    pub fn moved(&self) -> u64 {
        self.sent + self.placed + self.copied + self.reduced + self.local
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Before the connections close: on each, the notice precedes the close.
        if let Some(v) = self.last_words {
            Engine::notify_all(&self.links, v);
        }
    }
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        geo: Geometry,
        links: Vec<Link>,
        link_of: Vec<usize>,
        pds: Vec<ProtectionDomain>,
        cqs: Vec<CompletionQueue>,
        abort: Arc<AbortFlag>,
        probe: Arc<Probe>,
    ) -> Engine {
        let n = pds.len();
        let flows = Flows::new(links.len(), geo.channels);
        let flows_queues = links.len() * geo.channels;
        Engine {
            rank,
            geo,
            links,
            link_of,
            pds,
            cqs,
            abort,
            probe,
            faults: None,
            last_words: None,
            recent: Recent::default(),
            doorbells: vec![u32::MAX; n],
            flows,
            reuse: Reuse::default(),
            mailbox_allowed: true,
            pending_mismatch: None,
            failed_by_notice: false,
            spin_for: Duration::from_micros(50),
            spin_now: Duration::from_micros(50),
            yield_for: Duration::from_millis(2),
            scratch: Vec::new(),
            scratch_mrs: (0..n).map(|_| None).collect(),
            wcs: vec![WorkCompletion::default(); 64],
            metering: false,
            egress: EgressMeter::default(),
            calls: 0,
            registry: Arc::default(),
            regs: RegCache::default(),
            announced: vec![0; flows_queues],
            announcements: vec![0; flows_queues],
            stats: Stats::default(),
        }
    }

    /// Whether `plan` runs with the mailbox protocol (decided once per plan).
    pub(crate) fn uses_mailbox(&self, plan: &Plan, esize: usize) -> bool {
        *plan
            .mailbox
            .get_or_init(|| self.mailbox_allowed && mailbox_eligible(self, &plan.sched, esize))
    }

    /// Tells every peer this communicator was aborted; best effort.
    pub(crate) fn notify_abort(&mut self) {
        let notice = Imm::Notice(Notice::Aborted).encode();
        self.last_words = Some(notice);
        Engine::notify_all(&self.links, notice);
    }

    /// Asks every peer to dump its flight recorder now (this rank timed out: the launcher may
    /// stop the others before their own timeouts), so that the dumps show every rank.
    pub(crate) fn request_dumps(&self) {
        Engine::notify_all(&self.links, Imm::Notice(Notice::DumpRequest).encode());
    }

    /// Tells every peer that rank `dead` failed (`dead` = this rank: its own call failed), so
    /// that those not waiting on it fail naming it rather than timing out; best effort. `dead`
    /// itself is told too: if only the connection failed, it learns who lost it.
    pub(crate) fn notify_failure(&mut self, dead: usize) {
        self.remember_failure(dead);
        Engine::notify_all(&self.links, Imm::Notice(Notice::Failed(dead)).encode());
    }

    /// Remembers that rank `dead` failed, to say so once more as this communicator closes
    /// ([`Engine`]'s `Drop`): a peer that sees our connections close then knows why, whatever
    /// it received from others meanwhile, and does not blame us.
    pub(crate) fn remember_failure(&mut self, dead: usize) {
        self.last_words = Some(Imm::Notice(Notice::Failed(dead)).encode());
    }

    /// Posts a control message (an immediate) to every peer; best effort.
    fn notify_all(links: &[Link], imm: u32) {
        for l in links {
            let _ = l.qp.post_send(&[SendWr::new(
                WR_CTRL,
                WrOp::WriteWithImm {
                    remote: l.remote.at(0),
                    imm,
                },
                &[],
            )]);
        }
    }

    /// Sets how long an idle call polls without yielding ([`crate::Options::idle_spin`]).
    pub(crate) fn set_spin(&mut self, d: Duration) {
        self.spin_for = d;
        self.spin_now = d;
    }

    /// After a call: if its wait outlasted the spin (`spun_out`), the next calls spin only
    /// [`SHORT_SPIN`] before they yield, so that a peer on the same CPU runs sooner; a call
    /// that did not doubles the spin again, up to [`Engine::spin_for`].
    fn adapt_spin(&mut self, spun_out: bool) {
        self.spin_now = if spun_out {
            SHORT_SPIN.min(self.spin_for)
        } else {
            (self.spin_now * 2).clamp(SHORT_SPIN.min(self.spin_for), self.spin_for)
        };
    }

    #[allow(clippy::too_many_arguments)]
    /// Runs `plan` on `bufs`. `dtype`/`op` drive reductions (`Avg` reduces as a sum; the
    /// caller divides afterwards).
    pub(crate) fn execute(
        &mut self,
        plan: &Plan,
        desc: &OpDesc,
        dtype: DataType,
        op: ReduceOp,
        bufs: &Bufs,
        in_place: Option<(usize, usize)>,
        timeout: Duration,
    ) -> Result<()> {
        let spec = CallSpec {
            plan,
            desc,
            dtype,
            op,
            bufs,
            in_place,
        };
        self.execute_group(std::slice::from_ref(&spec), timeout)
    }

    /// Runs several calls at once (a group: `group_start` ... `group_end`), each through its
    /// own protocol state machine over the shared queues, in turns where two share a queue,
    /// so that they progress together: a send and a receive with the same peer do not wait
    /// for each other. Every rank must list its calls with a given peer in the same order.
    /// Fails with the first error; `timeout` bounds the whole group.
    pub(crate) fn execute_group(
        &mut self,
        specs: &[CallSpec<'_>],
        timeout: Duration,
    ) -> Result<()> {
        let Some(first) = specs.first() else {
            return Ok(());
        };
        for spec in specs {
            self.recent.push(*spec.desc);
        }
        self.failed_by_notice = false;
        self.regs.refresh(&self.registry);
        if let Some(f) = self.faults.as_mut() {
            f.begin(first.desc.seq);
            if f.armed {
                f.steps_done(0);
            }
        }
        for desc in specs.iter().map(|s| s.desc) {
            if let Some((seq, peer)) = self.pending_mismatch
                && (desc.seq as u32).wrapping_sub(seq) & 0xff_ffff < 1 << 23
            {
                return Err(Error::Mismatch {
                    rank: self.rank,
                    detail: format!(
                        "rank {peer} found that the data it received in its call #{seq} (modulo \
                         2^24) does not match its own; this rank is in {desc} (rank {peer}'s \
                         error names both sides)"
                    ),
                });
            }
        }
        // Each call's scratch space, side by side in the engine's buffer (8-byte aligned).
        let scratch_of =
            |s: &CallSpec<'_>| (s.plan.sched.scratch * s.dtype.size()).next_multiple_of(8);
        let need: usize = specs.iter().map(scratch_of).sum();
        if self.scratch.len() * 8 < need {
            self.scratch = vec![0u64; need.div_ceil(8)];
            self.scratch_mrs.iter_mut().for_each(|m| *m = None);
        }
        if let [spec] = specs {
            // A call alone: its state on the stack (no allocation per call).
            let mut one = [self.prepare_call(spec, 0, 0, true)?];
            return self.run_calls(&mut one, timeout);
        }
        let mut calls = Vec::with_capacity(specs.len());
        let mut at = 0;
        for (i, spec) in specs.iter().enumerate() {
            calls.push(self.prepare_call(spec, i, at, false)?);
            at += scratch_of(spec);
        }
        self.run_calls(&mut calls, timeout)
    }

    /// Call number `i` of a group (`alone`: the only one) with its scratch space at byte
    /// `scratch_off`: its queues (derived once per plan), number and protocol state.
    #[inline(always)]
    fn prepare_call<'s>(
        &mut self,
        spec: &CallSpec<'s>,
        i: usize,
        scratch_off: usize,
        alone: bool,
    ) -> Result<One<'s>> {
        let sched = &spec.plan.sched;
        let esize = spec.dtype.size();
        // Mailboxes hold one message per peer and call: a call alone only.
        let mailbox = alone && self.uses_mailbox(spec.plan, esize);
        let queues = match spec
            .plan
            .queues
            .get_or_init(|| Queues::new(sched, &self.link_of, self.geo.channels))
        {
            Ok(q) => q,
            Err(e) => {
                return Err(Error::InvalidArgument {
                    rank: self.rank,
                    msg: format!("{}: {e}", spec.desc),
                });
            }
        };
        self.calls = self.calls.wrapping_add(1);
        let reuse = if i == 0 {
            std::mem::take(&mut self.reuse)
        } else {
            Reuse::default()
        };
        let m = Machine::new(sched, queues, self.geo.config(esize), esize, mailbox, reuse)
            .with_id(i as u32);
        Ok(One {
            sched,
            desc: spec.desc,
            dtype: spec.dtype,
            op: if spec.op == ReduceOp::Avg {
                ReduceOp::Sum
            } else {
                spec.op
            },
            esize,
            bufs: spec.bufs,
            in_place: spec.in_place,
            m,
            mrs: CallMrs::default(),
            tag: self.calls,
            want: Header::expected(spec.desc, 0),
            announce: !mailbox && !self.regs.is_empty(),
            spans: spans(
                spec.bufs,
                spec.in_place,
                esize,
                &mut self.scratch,
                scratch_off,
            ),
        })
    }

    /// Runs prepared calls to the end (or the first error), then checks for strays and, after
    /// an error, quiesces.
    fn run_calls(&mut self, calls: &mut [One<'_>], timeout: Duration) -> Result<()> {
        let alone = calls.len() == 1;
        let mailbox = calls[0].m.is_mailbox();
        let mut call = Call {
            eng: self,
            calls,
            cur: 0,
            bytes_in: 0,
            reported: 0,
            spun_out: false,
        };
        if !alone {
            call.eng.flows.pass_turns(call.calls.iter().map(|o| &o.m));
        }
        let mut r = call.check_members();
        r = if r.is_err() {
            r
        } else if mailbox {
            call.run_mailbox(timeout)
        } else {
            call.run(timeout)
        };
        // Before returning success, make sure no peer sent this call (or an earlier one) what
        // it did not take: a disagreement that happened to complete must still be reported.
        if r.is_ok() {
            // (Polling only if a completion arrived since the last poll: one load each.)
            let rang = (0..call.eng.cqs.len())
                .any(|c| call.eng.cqs[c].doorbell() != call.eng.doorbells[c]);
            r = if rang {
                call.poll_cqs().map(drop)
            } else {
                Ok(())
            }
            .and_then(|()| call.check_strays(false));
        }
        if r.is_err() {
            call.quiesce();
            for m in call.eng.links.iter_mut().filter_map(|l| l.meter.as_mut()) {
                m.reset_in_flight();
            }
            call.eng.egress.reset_in_flight();
        }
        let Call {
            eng,
            calls,
            spun_out,
            ..
        } = call;
        eng.adapt_spin(spun_out);
        if !alone {
            // Turns go back to a call alone (number 0).
            eng.flows.reset_turns();
        }
        eng.reuse = calls[0].m.take_reuse();
        r
    }

    /// What each metered (tcp) link delivered since the last time this was called, with the
    /// peer it leads to, and this rank's best aggregate window (kbit/s); resets the meters.
    pub(crate) fn take_delivered(&mut self) -> (Vec<(usize, Delivered)>, u64) {
        let links = self
            .links
            .iter_mut()
            .filter_map(|l| Some((l.peer, l.meter.as_mut()?.take())))
            .collect();
        (links, self.egress.take())
    }
}

/// One call as the engine runs it, alone or in a group.
pub(crate) struct CallSpec<'a> {
    /// Its schedule.
    pub plan: &'a Plan,
    /// What it is (errors, the wire header's fingerprint).
    pub desc: &'a OpDesc,
    /// Its elements' type.
    pub dtype: DataType,
    /// Its reduction (`Avg` reduces as a sum; the caller divides afterwards).
    pub op: ReduceOp,
    /// The caller's buffers.
    pub bufs: &'a Bufs,
    /// In place: the input's and the output's element offsets in the one buffer.
    pub in_place: Option<(usize, usize)>,
}

/// One call's state while it runs.
struct One<'a> {
    sched: &'a Schedule,
    desc: &'a OpDesc,
    dtype: DataType,
    op: ReduceOp,
    esize: usize,
    bufs: &'a Bufs,
    in_place: Option<(usize, usize)>,
    /// The call's protocol state ([`oxccl_core::protocol`]).
    m: Machine<'a>,
    mrs: CallMrs,
    /// This call's number ([`Engine::calls`]): its data requests carry it.
    tag: u64,
    /// What every fragment of this call carries ([`Header::expected`], sender 0).
    want: Header,
    /// Whether its receives are announced to their senders ([`Call::announce_ready`]): slot
    /// calls, while some buffer is registered.
    announce: bool,
    /// Where each of its buffers ([`Buf`], by index) lies: the memory, its length in bytes,
    /// and the byte at which the schedule's offsets start (in place: the input's or the
    /// output's place in the one buffer; scratch: this call's part of the engine's).
    spans: [(*mut u8, usize, usize); 3],
}

/// The calls of one [`Engine::execute_group`] (one, or a group) and what they share.
struct Call<'a, 'c> {
    eng: &'a mut Engine,
    calls: &'a mut [One<'c>],
    /// The call whose action is being performed, or whose error is being told.
    cur: usize,
    bytes_in: u64,
    /// Steps done as last reported to the flight recorder and the fault injector.
    reported: usize,
    /// Whether a wait of this call outlasted its spin and yielded.
    spun_out: bool,
}

impl Call<'_, '_> {
    /// A communicator with a failed member cannot run collectives: says so at once, naming
    /// it, even if this call would not talk to it (as NCCL's and Gloo's communicators, it is
    /// broken as a whole). Notices that arrived before the connection failed (a peer that
    /// reported a failure, then closed) explain it better and come first.
    fn check_members(&mut self) -> Result<()> {
        let mut failed = None;
        for link in &mut self.eng.links {
            link.refresh_failed();
            if failed.is_none() && link.failed.is_some() {
                failed = Some(link.peer);
            }
        }
        let Some(peer) = failed else { return Ok(()) };
        self.poll_cqs()?;
        let l = self.eng.link_of[peer];
        Err(Error::PeerFailed {
            rank: self.eng.rank,
            op: self.calls[self.cur].desc.to_string(),
            peer,
            detail: format!(
                "{} (found before this call started)",
                self.eng.links[l].failed.as_deref().unwrap_or("failed")
            ),
        })
    }

    /// Whether every call is done.
    fn all_done(&self) -> bool {
        self.calls.iter().all(|o| o.m.is_done())
    }

    /// The first call not done (errors are told as its), or the first.
    fn lead(&self) -> usize {
        self.calls.iter().position(|o| !o.m.is_done()).unwrap_or(0)
    }

    /// Reports the steps done to the flight recorder and the fault injector (which may stop
    /// this process after a given step).
    fn note_steps(&mut self) {
        let done = self.calls.iter().map(|o| o.m.steps_done()).sum();
        if done != self.reported {
            self.reported = done;
            self.eng
                .probe
                .steps_done
                .store(done as u32, Ordering::Relaxed);
            if let Some(f) = self.eng.faults.as_mut().filter(|f| f.armed) {
                f.steps_done(done);
            }
        }
    }

    /// Applies the faults injected into a send to `peer` (link `l`): a drop, a delay, a damaged
    /// header (`hb`).
    #[cold]
    fn send_faults(&mut self, l: usize, peer: usize, hb: &mut [u8]) {
        let Some(f) = self.eng.faults.as_mut() else {
            return;
        };
        let what = f.on_send(peer);
        if let Some(d) = what.delay {
            crate::log_warn(format!(
                "fault injection: rank {} waits {d:?} before sending to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            std::thread::sleep(d);
        }
        if what.corrupt {
            crate::log_warn(format!(
                "fault injection: rank {} damages a header sent to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            hb[8] ^= 0x5a;
        }
        if what.drop {
            crate::log_warn(format!(
                "fault injection: rank {} drops its connection to rank {peer} in {}",
                self.eng.rank, self.calls[self.cur].desc
            ));
            self.eng.links[l].qp.disconnect();
        }
    }

    fn invalid(&self, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.eng.rank,
            msg: format!("{}: {msg}", self.calls[self.cur].desc),
        }
    }

    /// Byte address and length of a region, checked against its buffer.
    #[inline]
    fn locate(&self, reg: Region) -> Result<(*mut u8, usize)> {
        let one = &self.calls[self.cur];
        let (base, len, start) = one.spans[reg.buf as usize];
        let off = start + reg.offset * one.esize;
        let bytes = reg.len * one.esize;
        if off.checked_add(bytes).is_none_or(|end| end > len) {
            return Err(self.outside(reg, off, bytes, len));
        }
        // SAFETY: `off + bytes <= len`, the length of the buffer `base` points to.
        Ok((unsafe { base.add(off) }, bytes))
    }

    #[cold]
    fn outside(&self, reg: Region, off: usize, bytes: usize, len: usize) -> Error {
        self.invalid(format!(
            "step needs bytes {off}..{} of the {:?} buffer, which has {len}",
            off.saturating_add(bytes),
            reg.buf
        ))
    }

    /// The memory region covering `reg`'s buffer on context `ctx`, registered on first use.
    fn mr_for(&mut self, reg: Region, ctx: usize) -> Result<(MrRef, usize)> {
        let (ptr, _) = self.locate(reg)?;
        let (base, len) = match (reg.buf, self.calls[self.cur].in_place) {
            (Buf::Scratch, _) => (
                self.eng.scratch.as_ptr() as *mut u8,
                self.eng.scratch.len() * 8,
            ),
            (Buf::Input, None) => (
                self.calls[self.cur].bufs.input as *mut u8,
                self.calls[self.cur].bufs.input_len,
            ),
            _ => (
                self.calls[self.cur].bufs.output,
                self.calls[self.cur].bufs.output_len,
            ),
        };
        let off = ptr as usize - base as usize;
        let rank = self.eng.rank;
        if self
            .eng
            .faults
            .as_mut()
            .is_some_and(|f| f.armed && f.refuse_registration())
        {
            return Err(Error::Verbs {
                rank,
                what: format!("{}: registering memory", self.calls[self.cur].desc),
                source: oxccl_verbs::Error::InvalidArgument(
                    "refused by fault injection (OXCCL_FAULT=refuse_reg)".into(),
                ),
            });
        }
        if reg.buf != Buf::Scratch
            && let Some((i, r)) = self
                .eng
                .regs
                .find(ptr as usize, reg.len * self.calls[self.cur].esize)
            && r.mrs.get(ctx).is_some_and(|m| m.is_registered())
        {
            return Ok((MrRef::Registered(i, ctx), ptr as usize - r.addr));
        }
        if reg.buf == Buf::Scratch {
            if self.eng.scratch_mrs[ctx].is_none() {
                // SAFETY: the scratch vector lives in the engine and is only replaced (after
                // dropping its registrations) when a call needs more.
                let mr =
                    unsafe { self.eng.pds[ctx].reg_mr_raw(base, len, AccessFlags::LOCAL_WRITE) }
                        .map_err(|e| Error::Verbs {
                            rank,
                            what: "registering scratch memory".into(),
                            source: e,
                        })?;
                self.eng.scratch_mrs[ctx] = Some(mr);
            }
            return Ok((MrRef::Scratch(ctx), off));
        }
        let key = (u8::from(base == self.calls[self.cur].bufs.output), ctx);
        if let Some(i) = self.calls[self.cur]
            .mrs
            .mrs
            .iter()
            .position(|(k, _)| *k == key)
        {
            return Ok((MrRef::Call(i), off));
        }
        // SAFETY: the caller's buffers stay valid and untouched by the caller until the call
        // returns, and the registration is dropped before it does (`Call::mrs`); the region
        // is only read locally (no remote access).
        let mr = unsafe { self.eng.pds[ctx].reg_mr_raw(base, len, AccessFlags::LOCAL_WRITE) }
            .map_err(|e| Error::Verbs {
                rank,
                what: "registering the caller's buffer".into(),
                source: e,
            })?;
        self.calls[self.cur].mrs.mrs.push((key, mr));
        Ok((MrRef::Call(self.calls[self.cur].mrs.mrs.len() - 1), off))
    }

    fn mr(&self, r: MrRef) -> &MemoryRegion {
        match r {
            MrRef::Scratch(ctx) => self.eng.scratch_mrs[ctx]
                .as_ref()
                .expect("registered by mr_for"),
            MrRef::Call(i) => &self.calls[self.cur].mrs.mrs[i].1,
            MrRef::Registered(i, ctx) => &self.eng.regs.get(i).mrs[ctx],
        }
    }

    /// Runs the schedule with the mailbox protocol: one WRITE of header and data and one of
    /// the stamp per message, and the receiver polls the stamp in its own memory (RC ordering
    /// on the queue pair orders the two writes). No completion queue, no credits.
    fn run_mailbox(&mut self, timeout: Duration) -> Result<()> {
        // The clock is read only once the call idles (most small calls never do).
        let mut deadline: Option<Instant> = None;
        let mut graced = false;
        let mut idle_since: Option<Instant> = None;
        let mut idle_polls = 0u32;
        let mut napping = false;
        let geo = self.eng.geo;
        while !self.calls[self.cur].m.is_done() {
            let mut progress = false;
            while let Some(a) = self.calls[self.cur].m.next(&mut self.eng.flows) {
                progress |= self.perform(&a, &geo)?;
            }
            if self.calls[self.cur].m.is_done() {
                break;
            }
            if progress {
                idle_since = None;
                idle_polls = 0;
                napping = false;
                continue;
            }
            // Reading the clock costs as much as a poll: look at it every 32 idle passes.
            idle_polls += 1;
            // (Once napping, every pass is long anyway: look at everything each time.)
            if !napping && !idle_polls.is_multiple_of(32) {
                if self.eng.spin_now.is_zero() || self.spun_out {
                    std::thread::yield_now();
                } else {
                    // Watch the one word the call waits for, rather than make passes: the
                    // message is taken as soon as it lands.
                    self.spin_on_awaited(&geo);
                }
                continue;
            }
            // Notices (abort, mismatch), failed connections and data that does not belong to
            // this call arrive through the completion queues.
            self.poll_cqs()?;
            self.check_strays(true)?;
            self.check_health()?;
            let now = Instant::now();
            if expired(deadline.get_or_insert(now + timeout), &mut graced, now) {
                return Err(self.timeout_error(timeout));
            }
            let idle = now - *idle_since.get_or_insert(now);
            if idle < self.eng.spin_now {
                std::hint::spin_loop();
            } else if idle < self.eng.yield_for {
                self.spun_out = true;
                std::thread::yield_now();
            } else {
                // Nothing to sleep on: nap briefly.
                napping = true;
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }

    /// Spins (a bounded while) on the flag the first message this mailbox call waits for
    /// will set.
    #[inline(never)]
    fn spin_on_awaited(&self, geo: &Geometry) {
        let one = &self.calls[self.cur];
        let Some(Waiting::Data { step, q }) = one.m.waiting(&self.eng.flows) else {
            std::hint::spin_loop();
            return;
        };
        let Op::Recv { dst, .. } = one.sched.steps[step].op else {
            return;
        };
        let link = &self.eng.links[self.eng.flows.link_channel(q).0];
        let flag = link.mbox_recv + 1;
        if let Some(w) = link.inbox(geo).awaited(dst.len * one.esize, flag) {
            for _ in 0..MAILBOX_SPIN {
                if w.load(Ordering::Acquire) == flag {
                    return;
                }
                std::hint::spin_loop();
            }
        }
    }

    /// Stores step `src`'s data as the next mailbox message to `peer`, straight into the
    /// peer's mapped mailbox ([`crate::mailbox::post`]).
    fn mailbox_send(&mut self, peer: usize, src: Region, geo: &Geometry) -> Result<()> {
        let rank = self.eng.rank;
        let l = self.eng.link_of[peer];
        let (p, len) = self.locate(src)?;
        let h = self.calls[self.cur].want.from(rank).at(len, 0, len);
        let mut hb = [0u8; SHORT_HEADER];
        h.encode_short(&mut hb);
        if self.eng.faults.as_ref().is_some_and(|f| f.armed) {
            self.send_faults(l, peer, &mut hb);
        }
        let link = &self.eng.links[l];
        // A connection that failed (or was dropped) carries nothing more, as a request would
        // not be executed.
        if link.qp.state() != QpState::Rts {
            return Err(self.link_down(l));
        }
        let Some(outbox) = &link.outbox else {
            return Err(self.invalid(format!(
                "a mailbox message to rank {peer}, whose receive region is not mapped"
            )));
        };
        let m = link.mbox_sent;
        // SAFETY: bounds-checked by `locate`.
        let data = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        mailbox::post(
            outbox,
            geo.mailbox_offset((m % 2) as usize),
            &hb,
            data,
            m + 1,
        )
        .map_err(|e| self.invalid(e))?;
        self.eng.links[l].mbox_sent += 1;
        self.eng.stats.sent += len as u64;
        Ok(())
    }

    /// Consumes `peer`'s next mailbox message into `dst` (reduced with `reduce_with`) if it
    /// has arrived. Its header is checked as soon as it is there, before the rest: a peer in
    /// another call, or sending another length, is found rather than waited for.
    fn mailbox_recv(
        &mut self,
        peer: usize,
        dst: Region,
        reduce_with: Option<Region>,
        geo: &Geometry,
    ) -> Result<bool> {
        let l = self.eng.link_of[peer];
        let link = &self.eng.links[l];
        let flag = link.mbox_recv + 1;
        let inbox = link.inbox(geo);
        if !inbox.header_arrived(flag) {
            return Ok(false);
        }
        let one = &self.calls[self.cur];
        let total = dst.len * one.esize;
        let want = one.want.from(peer).at(total, 0, total);
        if !inbox.header_is(&want) {
            self.check_header(&inbox.header(), peer, total, 0, total)?;
        }
        if !inbox.complete(total, flag) {
            return Ok(false);
        }
        self.bytes_in += total as u64;
        self.eng
            .probe
            .bytes_in
            .store(self.bytes_in, Ordering::Relaxed);
        for (progress, len, at) in inbox.pieces(total) {
            self.apply(l, at, len, dst, reduce_with, progress)?;
        }
        self.count_out(total, reduce_with.is_some());
        self.eng.links[l].mbox_recv += 1;
        Ok(true)
    }

    fn run(&mut self, timeout: Duration) -> Result<()> {
        // The clock is read only once the call idles (a call that never waits never reads it).
        let mut deadline: Option<Instant> = None;
        let mut graced = false;
        let geo = self.eng.geo;
        self.check_health()?;
        self.refresh_credits();
        let mut idle_since: Option<Instant> = None;
        let group = self.calls.len() > 1;
        let announcing = self.calls.iter().any(|o| o.announce);
        while !self.all_done() {
            let mut progress = self.poll_cqs()?;
            if announcing {
                self.announce_ready();
            }
            for c in 0..self.calls.len() {
                self.cur = c;
                while let Some(a) = self.calls[c].m.next(&mut self.eng.flows) {
                    progress |= self.perform(&a, &geo)?;
                }
            }
            if group {
                self.eng.flows.pass_turns(self.calls.iter().map(|o| &o.m));
            }
            self.cur = self.lead();
            if self.all_done() {
                break;
            }
            if progress {
                idle_since = None;
                continue;
            }
            self.check_strays(false)?;
            self.check_health()?;
            // (A credit's completion updates the count; its word in memory is the truth.)
            self.refresh_credits();
            let now = Instant::now();
            let deadline = deadline.get_or_insert(now + timeout);
            if expired(deadline, &mut graced, now) {
                return Err(self.timeout_error(timeout));
            }
            let idle = now - *idle_since.get_or_insert(now);
            if idle < self.eng.spin_now {
                std::hint::spin_loop();
                continue;
            }
            self.spun_out = true;
            if idle < self.eng.yield_for {
                // Poll, and let other runnable threads (more ranks than cores) use the CPU.
                std::thread::yield_now();
                continue;
            }
            self.wait((*deadline).min(now + Duration::from_millis(50)) - now)?;
        }
        Ok(())
    }

    /// Performs one action of the protocol; returns whether it did something (a mailbox
    /// message that has not arrived, or a credit, is not progress).
    fn perform(&mut self, a: &Action, geo: &Geometry) -> Result<bool> {
        let sched = self.calls[self.cur].sched;
        let r = match *a {
            Action::Post {
                step,
                q,
                slot,
                off,
                len,
                total,
                signaled,
            } => {
                let Op::Send { src, .. } = sched.steps[step].op else {
                    unreachable!("a post is a send's")
                };
                let (l, ch) = self.eng.flows.link_channel(q);
                let r = self.post_fragment(step, l, ch, slot, src, (off, len, total), signaled);
                if r.is_err() && signaled {
                    // Not posted: no completion will come for it.
                    self.calls[self.cur].m.completed(step, false);
                }
                r?;
                true
            }
            Action::Recv {
                step,
                mailbox: true,
                ..
            } => {
                let Op::Recv {
                    peer,
                    dst,
                    reduce_with,
                    ..
                } = sched.steps[step].op
                else {
                    unreachable!("a receive's")
                };
                let arrived = self.mailbox_recv(peer, dst, reduce_with, geo)?;
                if arrived {
                    self.calls[self.cur].m.commit(&mut self.eng.flows, a);
                }
                arrived
            }
            Action::Recv {
                step,
                q,
                slot,
                off,
                len,
                total,
                ..
            } => {
                let Op::Recv {
                    dst, reduce_with, ..
                } = sched.steps[step].op
                else {
                    unreachable!("a receive's")
                };
                let (l, ch) = self.eng.flows.link_channel(q);
                self.consume(l, ch, slot, dst, reduce_with, (off, len, total))?;
                true
            }
            Action::MailboxSend { step, .. } => {
                let Op::Send { peer, src, .. } = sched.steps[step].op else {
                    unreachable!("a send's")
                };
                self.mailbox_send(peer, src, geo)?;
                true
            }
            Action::Local { step } => {
                self.run_local(step)?;
                true
            }
            Action::Credit { q, consumed } => {
                self.send_credit(q, consumed, geo);
                false
            }
        };
        self.note_steps();
        Ok(r)
    }

    /// Reads every queue's credit word (what the receiver last reported consumed).
    fn refresh_credits(&mut self) {
        let geo = self.eng.geo;
        for (l, link) in self.eng.links.iter().enumerate() {
            for ch in 0..geo.channels {
                let q = self.eng.flows.queue(l, ch);
                self.eng.flows.credit(q, link.credit_word(ch, &geo));
            }
        }
    }

    /// Waits for a completion on the provider contexts; handles what arrives.
    fn wait(&mut self, max: Duration) -> Result<()> {
        if self.eng.cqs.len() == 1 {
            let mut wcs = std::mem::take(&mut self.eng.wcs);
            let r = self.eng.cqs[0].wait(&mut wcs, max);
            let res = match r {
                Ok(n) => wcs[..n].iter().try_for_each(|wc| self.handle(wc)),
                Err(oxccl_verbs::Error::Timeout { .. }) => Ok(()),
                Err(e) => Err(Error::Verbs {
                    rank: self.eng.rank,
                    what: format!("{}: waiting for completions", self.calls[self.cur].desc),
                    source: e,
                }),
            };
            self.eng.wcs = wcs;
            return res;
        }
        // Several contexts: poll them in turn, briefly.
        let end = Instant::now() + max.min(Duration::from_millis(1));
        while Instant::now() < end {
            if self.poll_cqs()? {
                return Ok(());
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    fn poll_cqs(&mut self) -> Result<bool> {
        let mut any = false;
        for c in 0..self.eng.cqs.len() {
            self.eng.doorbells[c] = self.eng.cqs[c].doorbell();
            loop {
                let mut wcs = std::mem::take(&mut self.eng.wcs);
                let n = self.eng.cqs[c].poll(&mut wcs);
                let r = wcs[..n].iter().try_for_each(|wc| self.handle(wc));
                self.eng.wcs = wcs;
                r?;
                any |= n > 0;
                if n < self.eng.wcs.len() {
                    break;
                }
            }
        }
        Ok(any)
    }

    fn peer_of_qp(&self, qp_num: u32, ctx_hint: Option<usize>) -> Option<usize> {
        self.eng
            .links
            .iter()
            .position(|l| l.qp.qp_num() == qp_num && ctx_hint.is_none_or(|c| c == l.ctx))
    }

    fn handle(&mut self, wc: &WorkCompletion) -> Result<()> {
        let kind = wc.wr_id & (0xff << 56);
        let link = match kind {
            WR_RECV => Some((wc.wr_id & 0xffff_ffff) as usize),
            _ => self.peer_of_qp(wc.qp_num, None),
        };
        if wc.status != WcStatus::Success {
            // The connection is dead: remember why; it fails this call only if the call still
            // needs that peer (a peer that finished and left is no error).
            let Some(l) = link else { return Ok(()) };
            let lk = &mut self.eng.links[l];
            if lk.failed.is_none() {
                let d = lk.qp.error_detail().unwrap_or_default();
                lk.failed = Some(format!(
                    "{:?} on the {} connection{}{d}",
                    wc.status,
                    lk.provider.name(),
                    if d.is_empty() { "" } else { ": " }
                ));
            }
            if kind == WR_DATA {
                self.data_completed(wc.wr_id, false);
            }
            return Ok(());
        }
        match kind {
            WR_RECV => {
                let l = link.unwrap_or(usize::MAX);
                let Some(lk) = self.eng.links.get_mut(l) else {
                    return Ok(());
                };
                let _ = lk.qp.post_recv(&[RecvWr::new(WR_RECV | l as u64, &[])]);
                let Some(v) = wc.imm else { return Ok(()) };
                let geo = self.eng.geo;
                match Imm::decode(v) {
                    Imm::Data { channel: ch, slot } if ch < geo.channels => {
                        let q = self.eng.flows.queue(l, ch);
                        self.eng.flows.arrived(q, slot);
                        self.bytes_in += wc.byte_len as u64;
                        self.eng
                            .probe
                            .bytes_in
                            .store(self.bytes_in, Ordering::Relaxed);
                    }
                    Imm::Credit { channel: ch } if ch < geo.channels => {
                        let q = self.eng.flows.queue(l, ch);
                        let word = lk.credit_word(ch, &geo);
                        self.eng.flows.credit(q, word);
                    }
                    Imm::Notice(Notice::DumpRequest) => {
                        let peer = lk.peer;
                        crate::flight::dump_on_request(&self.eng.probe, peer);
                    }
                    Imm::Notice(Notice::Failed(dead)) => {
                        let peer = lk.peer;
                        let (culprit, detail) = if dead == self.eng.rank {
                            // Our connection to the reporter failed on its side only.
                            (
                                peer,
                                format!("rank {peer} lost its connection to this rank"),
                            )
                        } else if dead == peer {
                            (
                                peer,
                                format!("rank {peer} reports that its own call failed"),
                            )
                        } else {
                            (dead, format!("rank {peer} reports that rank {dead} failed"))
                        };
                        self.eng.failed_by_notice = true;
                        return Err(Error::PeerFailed {
                            rank: self.eng.rank,
                            op: self.calls[self.cur].desc.to_string(),
                            peer: culprit,
                            detail,
                        });
                    }
                    Imm::Notice(Notice::Aborted) => {
                        let peer = lk.peer;
                        return Err(Error::Aborted {
                            rank: self.eng.rank,
                            op: self.calls[self.cur].desc.to_string(),
                            reason: format!("rank {peer} aborted the communicator"),
                        });
                    }
                    Imm::Mismatch { seq } => {
                        let peer = lk.peer;
                        // A notice about a call this rank has not started (it is behind)
                        // fails that call when it starts, not this one.
                        let last = self.calls.last().map_or(0, |o| o.desc.seq);
                        let ahead = seq.wrapping_sub(last as u32) & 0xff_ffff;
                        if ahead != 0 && ahead < 1 << 23 {
                            self.eng.pending_mismatch.get_or_insert((seq, peer));
                            return Ok(());
                        }
                        let theirs = self
                            .eng
                            .recent
                            .newest_first()
                            .find(|d| d.seq & 0xff_ffff == u64::from(seq))
                            .map_or(format!("call #{seq} (modulo 2^24)"), |d| d.to_string());
                        return Err(Error::Mismatch {
                            rank: self.eng.rank,
                            detail: format!(
                                "rank {peer} found that what this rank sent in {theirs} does not \
                                 match its own call; this rank is now in {} (rank {peer}'s error \
                                 names both sides)",
                                self.calls[self.cur].desc
                            ),
                        });
                    }
                    _ => {}
                }
            }
            WR_DATA => {
                // Every fragment is metered, also one an earlier call posted.
                if let Some(m) = link
                    .and_then(|l| self.eng.links.get_mut(l))
                    .and_then(|l| l.meter.as_mut())
                {
                    let now = Instant::now();
                    if let Some(len) = m.completed(now) {
                        self.eng.egress.completed(len, now);
                    }
                }
                self.data_completed(wc.wr_id, true);
            }
            _ => {}
        }
        Ok(())
    }

    /// A data fragment completed: tells the call that posted it (by its tag), if it is one of
    /// these (an inline fragment's completion may come during a later call).
    fn data_completed(&mut self, wr_id: u64, ok: bool) {
        for one in self.calls.iter_mut() {
            if let Some(s) = data_wr_step(wr_id, one.tag) {
                one.m.completed(s, ok);
                return;
            }
        }
    }

    /// Fails the call if a connection it still needs has failed (a queue pair in ERR counts,
    /// even before a completion says so), or if the communicator was aborted.
    fn check_health(&mut self) -> Result<()> {
        for l in 0..self.eng.links.len() {
            self.eng.links[l].refresh_failed();
            if self.check_link(l).is_err() {
                // What arrived before the connection failed comes first: a notice (a peer that
                // reported a failure, then closed) explains it better, and the last data of a
                // peer that finished this call and left (its completions may still wait in
                // the completion queue) means the link is no longer needed.
                self.poll_cqs()?;
                self.check_link(l)?;
            }
        }
        if self.eng.abort.is_set() {
            return Err(Error::Aborted {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                reason: self.eng.abort.reason().to_string(),
            });
        }
        Ok(())
    }

    /// Fails the call if link `l` has failed and a step not yet done involves its peer.
    fn check_link(&self, l: usize) -> Result<()> {
        let peer = self.eng.links[l].peer;
        let Some(why) = &self.eng.links[l].failed else {
            return Ok(());
        };
        // Data that arrived before the failure still counts: in slots, or a message waiting in
        // the mailbox (a peer that sent its last message and closed at once).
        let link = &self.eng.links[l];
        let ch = self.eng.geo.channels;
        let nothing_left = (0..ch).all(|c| self.eng.flows.get(l * ch + c).arrived.is_empty())
            && !(self.calls[self.cur].m.is_mailbox() && link.mailbox_arrived(&self.eng.geo));
        let (sends, recvs) = self
            .calls
            .iter()
            .map(|o| o.m.needs_link(l))
            .fold((false, false), |(a, b), (c, d)| (a || c, b || d));
        let needed = sends || (recvs && nothing_left);
        if needed {
            return Err(Error::PeerFailed {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                peer,
                detail: why.clone(),
            });
        }
        Ok(())
    }

    /// Consumes the fragment in `slot` of link `l`'s channel `ch` into `dst` (reduced with
    /// `reduce_with`), where it must be bytes `off..off + len` of a transfer of `total`.
    fn consume(
        &mut self,
        l: usize,
        ch: usize,
        slot: u32,
        dst: Region,
        reduce_with: Option<Region>,
        (off, len, total): (usize, usize, usize),
    ) -> Result<()> {
        let geo = self.eng.geo;
        let link = &self.eng.links[l];
        let peer = link.peer;
        let slot = slot as usize;
        if slot >= geo.slots {
            return Err(self.mismatch(format!("a fragment named slot {slot}")));
        }
        let base = geo.slot_offset(ch, slot);
        let h = link.header_at(base).map_err(|e| Error::Verbs {
            rank: self.eng.rank,
            what: "reading a slot".into(),
            source: e,
        })?;
        self.check_header(&h, peer, total, off, len)?;
        if h.placed != 0 {
            return self.placed(&h, peer, dst, reduce_with, off, len);
        }
        self.apply(l, base + SLOT_HEADER, len, dst, reduce_with, off)?;
        self.count_out(len, reduce_with.is_some());
        Ok(())
    }

    /// Counts `len` bytes taken out of a slot or mailbox (reduced, or copied).
    fn count_out(&mut self, len: usize, reduced: bool) {
        let st = &mut self.eng.stats;
        if reduced {
            st.reduced += len as u64;
        } else {
            st.copied += len as u64;
        }
    }

    /// A fragment whose data the sender wrote in place: it must have gone exactly where this
    /// rank announced (bytes `off..off + len` of `dst`, not reduced), and nothing is left to
    /// copy.
    fn placed(
        &mut self,
        h: &Header,
        peer: usize,
        dst: Region,
        reduce_with: Option<Region>,
        off: usize,
        len: usize,
    ) -> Result<()> {
        let (p, n) = self.locate(dst)?;
        let want = p as u64 + off as u64;
        if reduce_with.is_some() || off + len > n || h.placed != want {
            return Err(self.mismatch(format!(
                "rank {peer} wrote bytes {off}..{} of a transfer in place at {:#x}, where this \
                 rank {}",
                off + len,
                h.placed,
                if reduce_with.is_some() {
                    "reduces what it receives and announced no destination".to_string()
                } else {
                    format!("announced {want:#x}")
                }
            )));
        }
        self.eng.stats.received_in_place += len as u64;
        Ok(())
    }

    /// Checks a fragment's header against this call: the fingerprint, then that it is bytes
    /// `progress..progress + expect` of a transfer of `total` bytes.
    fn check_header(
        &self,
        h: &Header,
        peer: usize,
        total: usize,
        progress: usize,
        expect: usize,
    ) -> Result<()> {
        let want = self.calls[self.cur].want.from(peer);
        let violation = match h.check(&want, total, progress, expect) {
            Ok(()) => return Ok(()),
            Err(v) => v,
        };
        if violation == Violation::Damaged {
            return Err(Error::PeerFailed {
                rank: self.eng.rank,
                op: self.calls[self.cur].desc.to_string(),
                peer,
                detail: format!(
                    "a fragment header from rank {peer} is damaged (checksum mismatch): the \
                     data was corrupted on the way, so this call cannot trust what it received"
                ),
            });
        }
        if violation == Violation::Fingerprint {
            return Err(self.mismatch(format!(
                "rank {} is in {}, but rank {peer} sent data for {}{}",
                self.eng.rank,
                self.calls[self.cur].desc,
                h.describe(),
                self.our_side(h)
            )));
        }
        if violation == Violation::Position {
            return Err(self.mismatch(format!(
                    "in {}, rank {} expects {total} bytes from rank {peer} (at offset {progress}), which sends {} (at offset {})",
                    self.calls[self.cur].desc, self.eng.rank, h.xfer_len, h.frag_off
                ),
            ));
        }
        Err(self.mismatch(format!(
            "a fragment of {} bytes at offset {progress} of {total}, where the protocol puts \
             {expect}",
            h.frag_len
        )))
    }

    /// Copies or reduces `len` bytes at `off` in link `l`'s receive region into bytes
    /// `progress..` of `dst`.
    fn apply(
        &self,
        l: usize,
        off: usize,
        len: usize,
        dst: Region,
        reduce_with: Option<Region>,
        progress: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let link = &self.eng.links[l];
        if off + len > link.slots.len() {
            return Err(self.invalid(format!(
                "a fragment beyond the receive region ({off}+{len})"
            )));
        }
        // Bytes `progress..progress + len` of a region.
        let part = |r: Region| -> Result<*mut u8> {
            let (p, n) = self.locate(r)?;
            if progress + len > n {
                return Err(self.invalid(format!(
                    "a fragment at {progress}+{len} of a region of {n} bytes"
                )));
            }
            // SAFETY: `progress + len <= n`, the region's length (checked above).
            Ok(unsafe { p.add(progress) })
        };
        let dp = part(dst)?;
        // SAFETY: `off + len` lies inside the receive region (checked above); the peer does
        // not write these bytes again until we return its credit or read its next message.
        let data = unsafe { std::slice::from_raw_parts(link.slots.as_ptr().add(off), len) };
        match reduce_with {
            Some(w) => {
                let wp = part(w)?;
                if wp == dp {
                    // SAFETY: `locate` bounds-checked `dp..dp+len` in a buffer the engine
                    // alone uses during the call.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp, len) };
                    reduce::reduce_in_place(
                        self.calls[self.cur].dtype,
                        self.calls[self.cur].op,
                        d,
                        data,
                    );
                } else {
                    check_disjoint(dp, wp, len).map_err(|m| self.invalid(m))?;
                    // SAFETY: both bounds-checked, and disjoint (checked above).
                    let (d, a) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(dp, len),
                            std::slice::from_raw_parts(wp as *const u8, len),
                        )
                    };
                    reduce::reduce_to(
                        self.calls[self.cur].dtype,
                        self.calls[self.cur].op,
                        d,
                        a,
                        data,
                    );
                }
            }
            None => {
                // SAFETY: bounds-checked by `locate`; the receive region is another mapping.
                let d = unsafe { std::slice::from_raw_parts_mut(dp, len) };
                d.copy_from_slice(data);
            }
        }
        Ok(())
    }

    /// A mismatch error; every peer is told (with this call's sequence number), so that its
    /// call, or its next, fails too.
    fn mismatch(&self, detail: String) -> Error {
        self.mismatch_at(self.calls[self.cur].desc.seq, detail)
    }

    /// [`Call::mismatch`] about call `seq` (an earlier call's data can be found late).
    fn mismatch_at(&self, seq: u64, detail: String) -> Error {
        Engine::notify_all(&self.eng.links, Imm::Mismatch { seq: seq as u32 }.encode());
        Error::Mismatch {
            rank: self.eng.rank,
            detail,
        }
    }

    /// Posts bytes `off..off + len` of `src` (a transfer of `total`) for send step `s` into
    /// `slot` of link `l`'s channel `ch`; copied beside the header unless `signaled`. A
    /// fragment the receiver's announcement names is written in place: its data straight to
    /// the destination, then its header (saying where) through the slot.
    #[allow(clippy::too_many_arguments)]
    fn post_fragment(
        &mut self,
        s: usize,
        l: usize,
        ch: usize,
        slot: u32,
        src: Region,
        (off, len, total): (usize, usize, usize),
        signaled: bool,
    ) -> Result<()> {
        let geo = self.eng.geo;
        let rank = self.eng.rank;
        let placed = if signaled && total >= PLACE_MIN {
            self.placement(l, ch, total, off)
        } else {
            None
        };
        let mut h = self.calls[self.cur].want.from(rank).at(total, off, len);
        h.placed = placed.map_or(0, |(addr, _)| addr);
        let slot = slot as usize;
        let stage_off = geo.stage_offset(ch, slot);
        let mut hb = [0u8; SLOT_HEADER];
        h.encode(&mut hb);
        if self.eng.faults.as_ref().is_some_and(|f| f.armed) {
            self.send_faults(l, self.eng.links[l].peer, &mut hb);
        }
        let link = &self.eng.links[l];
        let verbs_err = |what: &str, e| Error::Verbs {
            rank,
            what: what.into(),
            source: e,
        };
        link.stage
            .write(stage_off, &hb)
            .map_err(|e| verbs_err("staging a header", e))?;
        let remote = link.remote.at(geo.slot_offset(ch, slot) as u64);
        let wr_imm = Imm::Data {
            channel: ch,
            slot: slot as u32,
        }
        .encode();
        let inline = !signaled;
        let es = self.calls[self.cur].esize;
        let part = src.sub(off / es, len / es);
        if inline && len > 0 {
            let (p, _) = self.locate(part)?;
            // SAFETY: bounds-checked by `locate`.
            let data = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
            link.stage
                .write(stage_off + SLOT_HEADER, data)
                .map_err(|e| verbs_err("staging a fragment", e))?;
        }
        let wr_id = data_wr_id(self.calls[self.cur].tag, s);
        // Inline: header and data from the staging region. Otherwise the header from staging
        // and the data straight from the caller's (or scratch) memory, registered on first use
        // (or registered already: `Communicator::register`).
        let source = if inline {
            None
        } else {
            Some(self.mr_for(part, self.eng.links[l].ctx)?)
        };
        let link = &self.eng.links[l];
        let head = if inline {
            SLOT_HEADER + len
        } else {
            SLOT_HEADER
        };
        let first = Sge::new(&link.stage, stage_off, head);
        let header_wr = |sges| {
            SendWr::new(
                wr_id,
                WrOp::WriteWithImm {
                    remote,
                    imm: wr_imm,
                },
                sges,
            )
        };
        let posted = match (source, placed) {
            // In place: the data to the destination, then (ordered after it on the connection)
            // the header alone, whose completion says both are done.
            (Some((r, mr_off)), Some((addr, rkey))) => {
                let data = [Sge::new(self.mr(r), mr_off, len)];
                let head = [first];
                let wrs = [
                    SendWr::new(
                        wr_id,
                        WrOp::Write {
                            remote: RemoteAddr { addr, rkey },
                        },
                        &data,
                    )
                    .unsignaled(),
                    header_wr(&head),
                ];
                link.qp.post_send(&wrs)
            }
            (Some((r, mr_off)), None) => {
                let both = [first, Sge::new(self.mr(r), mr_off, len)];
                link.qp.post_send(&[header_wr(&both)])
            }
            (None, _) => link
                .qp
                .post_send(&[header_wr(std::slice::from_ref(&first))]),
        };
        posted.map_err(|e| self.send_error(l, e))?;
        if placed.is_some() {
            self.eng.stats.placed += len as u64;
        } else {
            self.eng.stats.sent += len as u64;
        }
        let link = &mut self.eng.links[l];
        if self.eng.metering
            && let Some(m) = &mut link.meter
        {
            let now = Instant::now();
            m.posted(SLOT_HEADER + len, now);
            self.eng.egress.posted(now);
        }
        Ok(())
    }

    /// Where the receiver on link `l` announced that the fragment being posted on channel
    /// `ch` (bytes `off..` of a transfer of `total`) goes in place, if it did: the address and
    /// the remote key ([`Announce`]).
    fn placement(&self, l: usize, ch: usize, total: usize, off: usize) -> Option<(u64, u64)> {
        let link = &self.eng.links[l];
        let q = self.eng.flows.queue(l, ch);
        // The machine counted this fragment as posted already.
        let number = self.eng.flows.get(q).posted.checked_sub(1)?;
        let mut b = [0u8; ANNOUNCE];
        (0..ANNOUNCE_RING).find_map(|i| {
            link.slots
                .read(self.eng.geo.announce_offset(ch, i), &mut b)
                .ok()?;
            let a = Announce::decode(&b)?;
            Some((a.place(number, total, off)?, a.rkey))
        })
    }

    /// Offers the senders of the coming receives of calls that may place (up to
    /// [`ANNOUNCE_RING`] ahead on each queue, in order, as far as their dependencies are done)
    /// their destinations, where those are registered memory the link writes without a copy
    /// through the slots ([`Announce`]). Each receive is considered once: the engine keeps,
    /// per queue, the fragment number up to which it has.
    fn announce_ready(&mut self) {
        for c in 0..self.calls.len() {
            if !self.calls[c].announce {
                continue;
            }
            self.cur = c;
            for i in 0..self.calls[c].m.receive_queues().len() {
                let q = self.calls[c].m.receive_queues()[i] as usize;
                loop {
                    let from = self.eng.announced[q];
                    let next = self.calls[c]
                        .m
                        .receives_ahead(&self.eng.flows, q)
                        .take(ANNOUNCE_RING)
                        .find(|&(_, _, first, _)| first >= from);
                    let Some((_, step, first, true)) = next else {
                        break;
                    };
                    let frags = self.announce(step, q, first);
                    self.eng.announced[q] = first + frags;
                }
            }
        }
        self.cur = self.lead();
    }

    /// Announces receive step `step` on queue `q`, whose first fragment is number `first`, if
    /// it can be written in place: a whole receive (not reduced) of at least [`PLACE_MIN`]
    /// bytes into registered memory that the link writes without a system call (over shm,
    /// memory from `Communicator::alloc`). Best effort: a failed post leaves the data to come
    /// through the slots. Returns the step's fragment count.
    fn announce(&mut self, step: usize, q: usize, first: u64) -> u64 {
        let one = &self.calls[self.cur];
        let Op::Recv {
            dst, reduce_with, ..
        } = one.sched.steps[step].op
        else {
            return 0;
        };
        let total = dst.len * one.esize;
        let frags = one.m.config().fragments(total) as u64;
        if total < PLACE_MIN || reduce_with.is_some() {
            return frags;
        }
        let Ok((p, _)) = self.locate(dst) else {
            return frags;
        };
        let (l, ch) = self.eng.flows.link_channel(q);
        let link = &self.eng.links[l];
        let Some((_, r)) = self.eng.regs.find(p as usize, total) else {
            return frags;
        };
        let Some(mr) = r.mrs.get(link.ctx).filter(|m| m.is_registered()) else {
            return frags;
        };
        if link.provider == Provider::Shm && !mr.is_provider_memory() {
            return frags;
        }
        let a = Announce {
            first,
            frags,
            total: total as u64,
            addr: mr.addr() + (p as usize - r.addr) as u64,
            rkey: mr.rkey(),
        };
        let geo = self.eng.geo;
        let i = (self.eng.announcements[q] % ANNOUNCE_RING as u64) as usize;
        let mut b = [0u8; ANNOUNCE];
        a.encode(&mut b);
        let at = geo.stage_announce(ch, i);
        if link.stage.write(at, &b).is_ok() {
            let sge = [Sge::new(&link.stage, at, ANNOUNCE)];
            let wr = SendWr::new(
                WR_CTRL,
                WrOp::Write {
                    remote: link.remote.at(geo.announce_offset(ch, i) as u64),
                },
                &sge,
            )
            .unsignaled();
            if link.qp.post_send(&[wr]).is_ok() {
                self.eng.announcements[q] += 1;
            }
        }
        frags
    }

    /// The error of a send on link `l`, whose queue pair is no longer connected.
    fn link_down(&self, l: usize) -> Error {
        let link = &self.eng.links[l];
        Error::PeerFailed {
            rank: self.eng.rank,
            op: self.calls[self.cur].desc.to_string(),
            peer: link.peer,
            detail: format!(
                "its {} connection is down ({:?}){}",
                link.provider.name(),
                link.qp.state(),
                link.qp
                    .error_detail()
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default()
            ),
        }
    }

    fn send_error(&self, l: usize, e: oxccl_verbs::Error) -> Error {
        let link = &self.eng.links[l];
        Error::PeerFailed {
            rank: self.eng.rank,
            op: self.calls[self.cur].desc.to_string(),
            peer: link.peer,
            detail: format!(
                "posting to its {} connection: {e}{}",
                link.provider.name(),
                link.qp
                    .error_detail()
                    .map(|d| format!(" ({d})"))
                    .unwrap_or_default()
            ),
        }
    }

    /// Returns a credit on queue `q`: the consumed count, written beside the sender's slots.
    /// If the send queue is full, the credit stays due for the next pass.
    fn send_credit(&mut self, q: usize, consumed: u64, geo: &Geometry) {
        let (l, ch) = self.eng.flows.link_channel(q);
        let link = &self.eng.links[l];
        let src_off = geo.stage_credit(ch);
        if link.stage.write(src_off, &consumed.to_le_bytes()).is_err() {
            return;
        }
        let sge = [Sge::new(&link.stage, src_off, 8)];
        let wr = SendWr::new(
            WR_CTRL,
            WrOp::WriteWithImm {
                remote: link.remote.at(geo.credit_offset(ch) as u64),
                imm: Imm::Credit { channel: ch }.encode(),
            },
            &sge,
        );
        if link.qp.post_send(&[wr]).is_ok() {
            self.eng.flows.credit_sent(q, consumed);
        }
    }

    fn run_local(&mut self, s: usize) -> Result<()> {
        match self.calls[self.cur].sched.steps[s].op {
            Op::Copy { src, dst } => {
                let (sp, n) = self.locate(src)?;
                let (dp, m) = self.locate(dst)?;
                if n != m {
                    return Err(self.invalid(format!("step {s} copies {n} bytes into {m}")));
                }
                if sp != dp && n > 0 {
                    check_disjoint(dp, sp, n).map_err(|m| self.invalid(m))?;
                    // SAFETY: both bounds-checked by `locate` and disjoint.
                    unsafe { std::ptr::copy_nonoverlapping(sp as *const u8, dp, n) };
                    self.eng.stats.local += n as u64;
                }
            }
            Op::Reduce { dst, a, b } => {
                let (dp, n) = self.locate(dst)?;
                let (ap, _) = self.locate(a)?;
                let (bp, _) = self.locate(b)?;
                check_disjoint(dp, bp, n).map_err(|m| self.invalid(m))?;
                // SAFETY: bounds-checked by `locate`; `dst` and `b` are disjoint, and `a` is
                // either `dst` itself or disjoint from it.
                unsafe {
                    let bs = std::slice::from_raw_parts(bp as *const u8, n);
                    if ap == dp {
                        reduce::reduce_in_place(
                            self.calls[self.cur].dtype,
                            self.calls[self.cur].op,
                            std::slice::from_raw_parts_mut(dp, n),
                            bs,
                        );
                    } else {
                        check_disjoint(dp, ap, n).map_err(|m| self.invalid(m))?;
                        let as_ = std::slice::from_raw_parts(ap as *const u8, n);
                        reduce::reduce_to(
                            self.calls[self.cur].dtype,
                            self.calls[self.cur].op,
                            std::slice::from_raw_parts_mut(dp, n),
                            as_,
                            bs,
                        );
                    }
                }
                self.eng.stats.local += n as u64;
            }
            _ => unreachable!("a local step is a copy or a reduction"),
        }
        Ok(())
    }

    fn timeout_error(&self, timeout: Duration) -> Error {
        let flows = &self.eng.flows;
        let peer_of = |q: usize| self.eng.links[flows.link_channel(q).0].peer;
        let w = self.calls[self.cur].m.waiting(flows);
        let (step, waiting, peer) = match w {
            Some(Waiting::Data { step, q }) if self.calls[self.cur].m.is_mailbox() => (
                step,
                format!("waiting for rank {}'s message in its mailbox", peer_of(q)),
                Some(peer_of(q)),
            ),
            Some(Waiting::Data { step, q }) => (
                step,
                format!(
                    "waiting for data from rank {} (channel {})",
                    peer_of(q),
                    flows.link_channel(q).1
                ),
                Some(peer_of(q)),
            ),
            Some(Waiting::Slot {
                step, q, posted, ..
            }) => {
                let (l, ch) = flows.link_channel(q);
                let link = &self.eng.links[l];
                (
                    step,
                    format!(
                        "waiting for rank {} to free a slot (channel {ch}, {posted} fragments \
                         posted, {} consumed)",
                        link.peer,
                        link.credit_word(ch, &self.eng.geo)
                    ),
                    Some(link.peer),
                )
            }
            Some(Waiting::Transport { step, q }) => (
                step,
                format!(
                    "waiting for the transport to finish a send to rank {}",
                    peer_of(q)
                ),
                Some(peer_of(q)),
            ),
            Some(Waiting::Earlier { step, q: Some(q) })
                if matches!(self.calls[self.cur].sched.steps[step].op, Op::Send { .. }) =>
            {
                (
                    step,
                    format!("waiting to send to rank {} after earlier steps", peer_of(q)),
                    Some(peer_of(q)),
                )
            }
            Some(Waiting::Earlier { step, .. }) => {
                (step, "waiting for earlier steps".to_string(), None)
            }
            None => (0, "waiting for earlier steps".to_string(), None),
        };
        Error::Timeout {
            rank: self.eng.rank,
            op: Box::new(*self.calls[self.cur].desc),
            timeout,
            waiting,
            peer,
            step,
            steps: self.calls[self.cur].sched.steps.len(),
            bytes: self.bytes_in,
        }
    }

    /// After an error: stop every connection (so no transport still reads the caller's
    /// buffers) and drain what completes, briefly.
    fn quiesce(&mut self) {
        // Wait (briefly) for the transport to finish reading the caller's buffers; only links
        // still busy after that are stopped, so peers are not told that a live rank failed.
        let end = Instant::now() + Duration::from_millis(500);
        while self.calls.iter().any(|o| o.m.outstanding()) {
            if Instant::now() >= end {
                for l in &self.eng.links {
                    l.qp.to_error();
                }
                break;
            }
            let mut wcs = std::mem::take(&mut self.eng.wcs);
            for c in 0..self.eng.cqs.len() {
                let n = self.eng.cqs[c].poll(&mut wcs);
                for wc in &wcs[..n] {
                    if wc.wr_id & (0xff << 56) == WR_DATA {
                        self.data_completed(wc.wr_id, false);
                    }
                }
            }
            self.eng.wcs = wcs;
            std::thread::yield_now();
        }
    }

    /// Data that no step of this call will take: a fragment in a slot with no receive left
    /// for its (peer, channel), or a message in a mailbox this call does not read. Data for a
    /// later call (a peer that is ahead) is fine; data for this call or an earlier one means
    /// the ranks disagree about what they are doing.
    fn check_strays(&self, mailbox: bool) -> Result<()> {
        let geo = self.eng.geo;
        let nch = geo.channels;
        let flows = &self.eng.flows;
        for (l, link) in self.eng.links.iter().enumerate() {
            for ch in 0..nch {
                let q = flows.queue(l, ch);
                let waiting = self
                    .calls
                    .iter()
                    .any(|o| !o.m.is_mailbox() && o.m.receiving_on(q));
                let Some(&slot) = flows.get(q).arrived.front() else {
                    continue;
                };
                if waiting || slot as usize >= geo.slots {
                    continue;
                }
                if let Ok(h) = link.header_at(geo.slot_offset(ch, slot as usize)) {
                    self.stray(&h, link.peer)?;
                }
            }
            // In a mailbox call, a message from a peer it receives from is its own.
            let ours = mailbox
                && self.calls[0]
                    .sched
                    .steps
                    .iter()
                    .any(|s| matches!(s.op, Op::Recv { peer, .. } if peer == link.peer));
            if !ours && link.mailbox_arrived(&geo) {
                self.stray(&link.inbox(&geo).header(), link.peer)?;
            }
        }
        Ok(())
    }

    fn stray(&self, h: &Header, peer: usize) -> Result<()> {
        let p2p = h.coll == CollectiveKind::Send.code()
            || self.calls.iter().any(|o| o.desc.coll.is_point_to_point());
        // A later call's data is a peer that is ahead, not a mismatch (sequence numbers
        // compare with wrap-around: init's probe numbers its calls just below 0). In a group,
        // later than its last call.
        let last = self.calls.last().map_or(0, |o| o.desc.seq);
        let later = (h.seq.wrapping_sub(last) as i64) > 0;
        if h.magic == protocol::MAGIC && (p2p || later) {
            return Ok(());
        }
        Err(self.mismatch_at(
            h.seq,
            format!(
                "rank {} is in {}, but rank {peer} sent data this call does not expect, for \
                 {}{}",
                self.eng.rank,
                self.calls[self.cur].desc,
                h.describe(),
                self.our_side(h)
            ),
        ))
    }

    /// This rank's own side of an earlier call a peer's data belongs to, when it still knows
    /// it: ", where this rank ran broadcast #1 (...)".
    fn our_side(&self, h: &Header) -> String {
        self.eng
            .recent
            .newest_first()
            .find(|d| d.seq == h.seq && h.seq != self.calls[self.cur].desc.seq)
            .map_or(String::new(), |d| format!(", where this rank ran {d}"))
    }
}

/// Where a call's buffers lie ([`One::spans`]): `Buf::Input`, `Buf::Output`, `Buf::Scratch`.
fn spans(
    bufs: &Bufs,
    in_place: Option<(usize, usize)>,
    esize: usize,
    scratch: &mut [u64],
    scratch_off: usize,
) -> [(*mut u8, usize, usize); 3] {
    let scratch = (
        scratch.as_mut_ptr() as *mut u8,
        scratch.len() * 8,
        scratch_off,
    );
    match in_place {
        Some((io, oo)) => [
            (bufs.output, bufs.output_len, io * esize),
            (bufs.output, bufs.output_len, oo * esize),
            scratch,
        ],
        None => [
            (bufs.input as *mut u8, bufs.input_len, 0),
            (bufs.output, bufs.output_len, 0),
            scratch,
        ],
    }
}

/// Whether the mailbox protocol can run this schedule ([`protocol::mailbox_eligible`]):
/// every peer it talks to has its receive region mapped here (shm: mailboxes are stored into
/// directly) and gets one message each way of at most [`MAILBOX_DATA`] bytes.
fn mailbox_eligible(eng: &Engine, sched: &Schedule, esize: usize) -> bool {
    protocol::mailbox_eligible(sched, eng.link_of.len(), esize, MAILBOX_DATA, |p| {
        let l = eng.link_of[p];
        l != usize::MAX && eng.links[l].outbox.is_some()
    })
}

fn check_disjoint(a: *mut u8, b: *mut u8, len: usize) -> std::result::Result<(), String> {
    let (a, b) = (a as usize, b as usize);
    if a < b + len && b < a + len {
        return Err(format!("regions overlap ({a:#x} and {b:#x}, {len} bytes)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data completion counts only for the call that posted it: an inline fragment's
    /// completion that arrives during the next call (which has a step with the same index)
    /// once made that step finish before its own last fragment was sent, and the caller
    /// freed or reused the buffer it was still being sent from (`EFAULT` in the tcp
    /// provider, or the peer receiving what the buffer held next).
    #[test]
    fn a_data_completion_counts_only_for_its_own_call() {
        let id = data_wr_id(41, 3);
        assert_eq!(id & (0xff << 56), WR_DATA);
        assert_eq!(data_wr_step(id, 41), Some(3));
        assert_eq!(data_wr_step(id, 42), None);
        // The count wraps at 2^24 (24 bits of the wr_id), and a step index keeps its 32 bits.
        assert_eq!(data_wr_step(data_wr_id(5, 0), 5 + (1 << 24)), Some(0));
        assert_eq!(
            data_wr_step(data_wr_id(u64::MAX, 70_000), u64::MAX),
            Some(70_000)
        );
        assert_eq!(data_wr_step(data_wr_id(u64::MAX, 7), 0), None);
    }
}
