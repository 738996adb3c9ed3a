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
    self, ANNOUNCE, ANNOUNCE_RING, Action, Announce, Config, Flows, Header, Imm, MAILBOX_DATA,
    Machine, Notice, PLACE_MIN, Program, Queues, Reuse, SLOT_HEADER, Violation, Waiting,
};
use oxccl_verbs::progress::{self, Progress};
use oxccl_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, ProtectionDomain, Provider, QpState, QueuePair,
    RecvWr, RemoteAddr, RemoteBuffer, RemoteMapping, SendWr, Sge, WcStatus, WorkCompletion, WrOp,
};

use crate::error::{Error, OpDesc, Result};
use crate::fault::Injector;
use crate::flight::{self, CallInfo, Probe};
use crate::mailbox::{self, Inbox};
use crate::meter::{Delivered, EgressMeter, LinkMeter};
use crate::reduce;
use crate::schedule::{Algorithm, Buf, CollectiveKind, Op, Region, Request, Schedule};
use crate::{DataType, ReduceOp};

mod data;
mod link;
mod mailboxes;
mod registry;
mod run;
mod session;
pub(crate) mod wait;

pub(crate) use link::Link;
pub(crate) use registry::{Reg, RegCache, Registry};
pub(crate) use session::Scratch;

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

/// A schedule with what the executor learns about it once: whether it runs in mailboxes.
pub(crate) struct Plan {
    pub(crate) sched: Schedule,
    /// The call's collective and algorithm, for the mailbox decision
    /// ([`protocol::mailbox_mode`]).
    call: (CollectiveKind, Algorithm),
    mailbox: std::sync::OnceLock<bool>,
    /// The protocol's queues, derived on first use.
    queues: std::sync::OnceLock<std::result::Result<Queues, String>>,
    /// An aggregation all-reduce's slice (elements) and host table (two tiers; else empty):
    /// the call is named to the aggregation service before it runs ([`crate::agg`]).
    pub(crate) agg: Option<(usize, Vec<u32>)>,
    /// The request the schedule was built from, where every rank's differs from it only in
    /// the rank: the compiled program's verification builds the others' schedules from it.
    pub(crate) req: Option<Request>,
    /// The mailbox call compiled to a straight line and verified with every rank's, on first
    /// use ([`Engine::program`]); `None` where it is not a mailbox call or did not verify.
    program: std::sync::OnceLock<Option<Program>>,
}

impl Plan {
    /// The plan of `sched`, a call of collective `kind` built with `algo`.
    pub(crate) fn new(sched: Schedule, kind: CollectiveKind, algo: Algorithm) -> Plan {
        Plan {
            sched,
            call: (kind, algo),
            mailbox: std::sync::OnceLock::new(),
            queues: std::sync::OnceLock::new(),
            agg: None,
            req: None,
            program: std::sync::OnceLock::new(),
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
#[derive(Clone, Copy)]
pub(crate) struct Bufs {
    pub input: *const u8,
    pub input_len: usize,
    pub output: *mut u8,
    pub output_len: usize,
}

impl Bufs {
    /// No buffers: a schedule that only uses scratch (the aggregation service's).
    pub(crate) const EMPTY: Bufs = Bufs {
        input: std::ptr::null(),
        input_len: 0,
        output: std::ptr::null_mut(),
        output_len: 0,
    };
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
    /// (the buffer's address, the context) and its registration.
    mrs: Vec<((usize, usize), MemoryRegion)>,
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
    /// One protection domain per provider context.
    pub(crate) pds: Vec<ProtectionDomain>,
    /// The completion queue of each context (in the contexts' order), polled by the call.
    progress: Progress,
    pub(crate) abort: Arc<AbortFlag>,
    /// Where the running call publishes its progress (for the flight recorder).
    pub(crate) probe: Arc<Probe>,
    /// Injected faults (`OXCCL_FAULT`), if this rank has any.
    pub(crate) faults: Option<Box<Injector>>,
    /// The notice to send every peer when closing (why this communicator failed), if any.
    last_words: Option<u32>,
    /// The last calls, for naming the one a peer reports a mismatch in.
    recent: Recent,
    /// Every queue's flow control (slots posted, credits, fragments arrived), kept across
    /// calls.
    flows: Flows,
    /// The last call's protocol buffers, kept for the next (no allocation per call).
    reuse: Reuse,
    /// Whether schedules may run in mailboxes (`OXCCL_PROTO=slots` forbids it).
    pub(crate) mailbox_allowed: bool,
    /// Whether mailbox calls run compiled ([`Engine::program`]; `OXCCL_COMPILED=0` forbids it).
    pub(crate) compiled: bool,
    /// A mismatch a peer reported in a call this rank had not reached: (sequence number
    /// modulo 2^24, the peer).
    pending_mismatch: Option<(u32, usize)>,
    /// Whether the last call's [`Error::PeerFailed`] came from a peer's notice (so it is not
    /// passed on again).
    pub(crate) failed_by_notice: bool,
    /// How long an idle call polls without yielding ([`crate::Options::idle_spin`]).
    spin_for: Duration,
    /// How long the next idle call polls without yielding: [`Engine::spin_for`], or none
    /// after a call whose yield gave the CPU to another thread (a peer that shares our CPU
    /// cannot answer while we spin), growing back after calls that did not (see
    /// [`Engine::adapt_spin`]).
    spin_now: Duration,
    /// How long an idle call then polls, yielding the CPU between polls, before it sleeps on
    /// the completion queue ([`crate::Options::idle_yield`]).
    pub(crate) yield_for: Duration,
    scratch: Vec<u64>,
    scratch_mrs: Vec<Option<MemoryRegion>>,
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
    /// This rank's membership of an aggregation service, if it joined one: the service is
    /// peer `world` (the last link).
    pub(crate) agg: Option<Box<dyn Aggregator>>,
}

/// What the engine needs of an aggregation service its calls stream through (the ranks' side
/// of it lives in `agg`, above the engine).
pub(crate) trait Aggregator: Send {
    /// The service's address, for errors.
    fn addr(&self) -> &str;
    /// Names the aggregation calls among those about to run (each with its slice, in
    /// elements, and its host table), before their data.
    fn announce(&mut self, rank: usize, calls: &[(OpDesc, usize, &[u32])]) -> Result<()>;
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
            progress: Progress::new(cqs),
            abort,
            probe,
            faults: None,
            last_words: None,
            recent: Recent::default(),
            flows,
            reuse: Reuse::default(),
            mailbox_allowed: true,
            compiled: true,
            pending_mismatch: None,
            failed_by_notice: false,
            spin_for: Duration::from_micros(50),
            spin_now: Duration::from_micros(50),
            yield_for: Duration::from_millis(2),
            scratch: Vec::new(),
            scratch_mrs: (0..n).map(|_| None).collect(),
            metering: false,
            egress: EgressMeter::default(),
            calls: 0,
            registry: Arc::default(),
            regs: RegCache::default(),
            announced: vec![0; flows_queues],
            announcements: vec![0; flows_queues],
            stats: Stats::default(),
            agg: None,
        }
    }

    /// Whether `plan` runs with the mailbox protocol (decided once per plan, by
    /// [`protocol::mailbox_mode`]): every peer it talks to gets one message each way of at
    /// most [`MAILBOX_DATA`] bytes. Mailboxes are stored into directly where the peer's
    /// receive region is mapped here (shm), and written with one WRITE_WITH_IMM elsewhere.
    pub(crate) fn uses_mailbox(&self, plan: &Plan, esize: usize) -> bool {
        *plan.mailbox.get_or_init(|| {
            let (kind, algo) = plan.call;
            let peers = self.link_of.len();
            self.mailbox_allowed
                && protocol::mailbox_mode(
                    kind,
                    algo,
                    &plan.sched,
                    peers,
                    esize,
                    MAILBOX_DATA,
                    |p| self.link_of[p] != usize::MAX,
                )
        })
    }

    /// The compiled form of `plan` (a mailbox call, [`Engine::uses_mailbox`]), made once per
    /// plan: every rank's program of the call, compiled from its protocol machine, run
    /// together by [`oxccl_core::verify::verify_compiled`], and this rank's kept. `None` where
    /// compiling is off or the programs do not verify (the call is then driven by its
    /// machine, which exchanges the same messages).
    pub(crate) fn program<'p>(&self, plan: &'p Plan) -> Option<&'p Program> {
        plan.program
            .get_or_init(|| {
                let req = plan.req.as_ref().filter(|_| self.compiled)?;
                let reqs: Vec<Request> = (0..req.world)
                    .map(|rank| Request {
                        rank,
                        ..req.clone()
                    })
                    .collect();
                match oxccl_core::verify::verify_compiled(&reqs) {
                    Ok(mut progs) if progs.len() > self.rank => Some(progs.swap_remove(self.rank)),
                    Ok(_) => None,
                    Err(e) => {
                        if crate::log_enabled() {
                            crate::log_line(format!(
                                "rank {}: {} of {} elements runs uncompiled: {e}",
                                self.rank,
                                req.coll.name(),
                                req.coll.count()
                            ));
                        }
                        None
                    }
                }
            })
            .as_ref()
    }

    /// Whether peer `p` is the aggregation service this rank joined (peer `world`, the last).
    pub(crate) fn is_aggregator(&self, p: usize) -> bool {
        self.agg.is_some() && p + 1 == self.link_of.len()
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

    /// How an idle call waits now ([`wait`]): the spin this call gets, then the yielding.
    pub(crate) fn policy(&self) -> wait::Policy {
        wait::Policy {
            spin: self.spin_now,
            yield_for: self.yield_for,
        }
    }

    /// After a call, by what its waits said ([`wait::next_spin`]): after one whose yield gave
    /// the CPU to another thread (a peer on this CPU, which a spin holds off), the next call
    /// yields at once; after one that waited and gave nothing away, the spin doubles back up
    /// to [`Engine::spin_for`]. A wait that outlasted the spin never shortens it: across
    /// hosts, where a call sleeps once its spin is over, a short spin would put every later
    /// call to sleep, each paying a wake-up.
    fn adapt_spin(&mut self, yields: wait::Yields) {
        self.spin_now = wait::next_spin(self.spin_now, self.spin_for, yields);
    }

    /// Runs one call (`Avg` reduces as a sum; the caller divides afterwards), and records it
    /// in the flight recorder as `info`: its start once it is under way (a call that runs
    /// compiled, once its first messages are out: the record then costs nothing while they
    /// travel), its end when it returns.
    pub(crate) fn execute(
        &mut self,
        spec: &CallSpec<'_>,
        info: &CallInfo<'_>,
        timeout: Duration,
    ) -> Result<()> {
        let mut rec = Record::Pending(info);
        let r = self.execute_recorded(std::slice::from_ref(spec), timeout, &mut rec);
        let id = rec.start(&self.probe);
        flight::end(&self.probe, id, &spec.desc, &r);
        // (Success is told afresh rather than passed on: the result is 96 bytes, and a copy of
        // it on every call, read back wider than it was written, stalls.)
        r?;
        Ok(())
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
        self.execute_recorded(specs, timeout, &mut Record::Made(0))
    }

    /// [`Engine::execute_group`], starting `rec` once the calls are under way.
    fn execute_recorded(
        &mut self,
        specs: &[CallSpec<'_>],
        timeout: Duration,
        rec: &mut Record<'_>,
    ) -> Result<()> {
        let Some(first) = specs.first() else {
            return Ok(());
        };
        for spec in specs {
            self.recent.push(spec.desc);
        }
        if let Some(agg) = self.agg.as_mut() {
            let named: smallvec::SmallVec<[(OpDesc, usize, &[u32]); 2]> = specs
                .iter()
                .filter_map(|s| s.plan.agg.as_ref().map(|(c, h)| (s.desc, *c, h.as_slice())))
                .collect();
            agg.announce(self.rank, &named)?;
        }
        self.failed_by_notice = false;
        self.regs.refresh(&self.registry);
        if let Some(f) = self.faults.as_mut() {
            f.begin(first.desc.seq);
            if f.armed {
                f.steps_done(0);
            }
        }
        for desc in specs.iter().map(|s| &s.desc) {
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
            let queues = self.queues_of(spec)?;
            let mut one = [self.prepare_call(spec, queues, 0, 0, true)];
            return self.run_calls(&mut one, timeout, rec);
        }
        let mut calls = Vec::with_capacity(specs.len());
        let mut at = 0;
        for (i, spec) in specs.iter().enumerate() {
            let queues = self.queues_of(spec)?;
            calls.push(self.prepare_call(spec, queues, i, at, false));
            at += scratch_of(spec);
        }
        self.run_calls(&mut calls, timeout, rec)
    }

    /// The queues of `spec`'s schedule (derived once per plan).
    fn queues_of<'s>(&self, spec: &CallSpec<'s>) -> Result<&'s Queues> {
        let sched = &spec.plan.sched;
        spec.plan
            .queues
            .get_or_init(|| Queues::new(sched, &self.link_of, self.geo.channels))
            .as_ref()
            .map_err(|e| Error::InvalidArgument {
                rank: self.rank,
                msg: format!("{}: {e}", spec.desc),
            })
    }

    /// Call number `i` of a group (`alone`: the only one) over `queues`, with its scratch
    /// space at byte `scratch_off`: its number and protocol state. (Infallible, so that the
    /// call's state is built where it is kept rather than moved there.)
    #[inline(always)]
    fn prepare_call<'s>(
        &mut self,
        spec: &CallSpec<'s>,
        queues: &'s Queues,
        i: usize,
        scratch_off: usize,
        alone: bool,
    ) -> One<'s> {
        let sched = &spec.plan.sched;
        let esize = spec.dtype.size();
        // Mailboxes hold one message per peer and call: a call alone only.
        let mailbox = alone && self.uses_mailbox(spec.plan, esize);
        self.calls = self.calls.wrapping_add(1);
        // A call that injects faults counts its steps as the machine runs them.
        let prog = if mailbox && self.faults.is_none() {
            self.program(spec.plan)
        } else {
            None
        };
        let cfg = self.geo.config(esize);
        // A compiled call builds its machine only if something asks what it did
        // ([`Call::sync_machine`]); the buffers wait in the engine until then.
        let m = if prog.is_some() {
            None
        } else {
            let reuse = if i == 0 {
                std::mem::take(&mut self.reuse)
            } else {
                Reuse::default()
            };
            Some(Machine::new(sched, queues, cfg, esize, mailbox, reuse).with_id(i as u32))
        };
        One {
            sched,
            prog,
            desc: spec.desc,
            dtype: spec.dtype,
            op: if spec.op == ReduceOp::Avg {
                ReduceOp::Sum
            } else {
                spec.op
            },
            esize,
            m,
            queues,
            cfg,
            mailbox,
            mrs: CallMrs::default(),
            tag: self.calls,
            want: Header::expected(&spec.desc, 0),
            own_scratch: false,
            announce: !mailbox && !self.regs.is_empty(),
            spans: spans(
                &spec.bufs,
                spec.in_place,
                esize,
                &mut self.scratch,
                scratch_off,
            ),
        }
    }

    /// Runs prepared calls to the end (or the first error), then checks for strays and, after
    /// an error, quiesces.
    fn run_calls(
        &mut self,
        calls: &mut [One<'_>],
        timeout: Duration,
        rec: &mut Record<'_>,
    ) -> Result<()> {
        let alone = calls.len() == 1;
        let mut call = Call::new(self, calls);
        if !alone {
            call.eng
                .flows
                .pass_turns(call.calls.iter().filter_map(|o| o.m.as_ref()));
        }
        let r = call.run_to_end(timeout, rec);
        if r.is_err() {
            call.stop_after_error();
        }
        let Call {
            eng, calls, yields, ..
        } = call;
        eng.adapt_spin(yields);
        if !alone {
            // Turns go back to a call alone (number 0).
            eng.flows.reset_turns();
        }
        if let Some(m) = calls[0].m.as_mut() {
            eng.reuse = m.take_reuse();
        }
        // (Success told afresh, not passed on: see `execute`.)
        r?;
        Ok(())
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

/// A lone call's entry in the flight recorder ([`flight::start`]), made once the call is
/// under way ([`Engine::execute`]).
pub(crate) enum Record<'i> {
    /// Not made yet: what it will say.
    Pending(&'i CallInfo<'i>),
    /// Made, with this id (0: none to make, as for the calls of a group, which have theirs).
    Made(u64),
}

impl Record<'_> {
    /// Makes the entry, if not made yet; its id.
    fn start(&mut self, probe: &Probe) -> u64 {
        let id = match *self {
            Record::Pending(info) => flight::start(probe, info),
            Record::Made(id) => id,
        };
        *self = Record::Made(id);
        id
    }
}

/// One call as the engine runs it, alone or in a group.
pub(crate) struct CallSpec<'a> {
    /// Its schedule.
    pub plan: &'a Plan,
    /// What it is (errors, the wire header's fingerprint).
    pub desc: OpDesc,
    /// Its elements' type.
    pub dtype: DataType,
    /// Its reduction (`Avg` reduces as a sum; the caller divides afterwards).
    pub op: ReduceOp,
    /// The caller's buffers.
    pub bufs: Bufs,
    /// In place: the input's and the output's element offsets in the one buffer.
    pub in_place: Option<(usize, usize)>,
}

/// One call's state while it runs.
pub(crate) struct One<'a> {
    sched: &'a Schedule,
    desc: OpDesc,
    dtype: DataType,
    op: ReduceOp,
    esize: usize,
    /// The call's protocol state ([`oxccl_core::protocol`]): none yet in a call that runs
    /// compiled ([`One::m`] builds it).
    m: Option<Machine<'a>>,
    /// What its machine is built from: the schedule's queues and the protocol's
    /// configuration.
    queues: &'a Queues,
    cfg: Config,
    /// Whether the call runs in mailbox mode ([`Engine::uses_mailbox`]).
    mailbox: bool,
    /// A lone mailbox call's compiled form, which then runs instead of the machine.
    prog: Option<&'a Program>,
    mrs: CallMrs,
    /// This call's number ([`Engine::calls`]): its data requests carry it.
    tag: u64,
    /// What every fragment of this call carries ([`Header::expected`], sender 0).
    want: Header,
    /// Whether its scratch space is its own (a call in flight with others that come and go:
    /// [`Engine::fly`]) rather than its part of the engine's.
    own_scratch: bool,
    /// Whether its receives are announced to their senders ([`Call::announce_ready`]): slot
    /// calls, while some buffer is registered.
    announce: bool,
    /// Where each of its buffers ([`Buf`], by index) lies: the memory, its length in bytes,
    /// and the byte at which the schedule's offsets start (in place: the input's or the
    /// output's place in the one buffer; scratch: this call's part of the engine's).
    spans: [(*mut u8, usize, usize); 3],
}

impl<'a> One<'a> {
    /// The call's machine, built now (with `reuse`'s buffers) if the call ran compiled and
    /// nothing asked it yet.
    fn machine(&mut self, reuse: &mut Reuse) -> &mut Machine<'a> {
        let One {
            m,
            sched,
            queues,
            cfg,
            esize,
            mailbox,
            ..
        } = self;
        m.get_or_insert_with(|| {
            Machine::new(sched, queues, *cfg, *esize, *mailbox, std::mem::take(reuse))
        })
    }

    /// The call's machine: a machine-driven call's, built with it (a compiled call's, built
    /// now if it was not: [`One::machine`]).
    fn m(&mut self) -> &mut Machine<'a> {
        self.machine(&mut Reuse::default())
    }

    /// Whether the call is done (a compiled call is told so by its driver, not its machine).
    fn is_done(&self) -> bool {
        self.m.as_ref().is_some_and(Machine::is_done)
    }

    /// Steps its machine knows done.
    fn steps_done(&self) -> usize {
        self.m.as_ref().map_or(0, Machine::steps_done)
    }

    /// What its machine says it waits for (none before it is built).
    fn waiting(&self, flows: &Flows) -> Option<Waiting> {
        self.m.as_ref().and_then(|m| m.waiting(flows))
    }
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
    /// What this call's waits and yields said about its CPU.
    yields: wait::Yields,
}

impl<'a, 'c> Call<'a, 'c> {
    /// `calls` about to run on `eng`.
    fn new(eng: &'a mut Engine, calls: &'a mut [One<'c>]) -> Call<'a, 'c> {
        Call {
            eng,
            calls,
            cur: 0,
            bytes_in: 0,
            reported: 0,
            yields: wait::Yields::None,
        }
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
