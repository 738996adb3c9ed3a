//! The flight recorder: the last calls of every communicator of this process, dumped as JSON
//! when something goes wrong, so that a person can see which rank stopped where.
//!
//! Each communicator keeps its last calls (`OXCCL_FLIGHT_RECORDER` entries, default 1024; `0`
//! turns the recorder off), and the process keeps those of the last few communicators that
//! are gone. A call is recorded when it starts (kind, count, type, operator, root, algorithm,
//! protocol, sequence number, time) and updated when it ends (state, time, error, what it was
//! waiting on); while it runs, the executor publishes how many of its steps are done and how
//! many bytes have arrived, so a dump taken meanwhile shows where it is.
//!
//! A dump is one JSON object ([`Dump`], format version [`DUMP_VERSION`]; `oxccl doctor` reads
//! it with the same types). It is written
//! - when a call times out, is aborted, or the watchdog fires (always), and on other errors
//!   that break a communicator when `OXCCL_DEBUG_DUMP` is set: once per communicator;
//! - when a peer times out: it asks every rank to dump (`"reason":"peer_timeout"`), since a
//!   launcher may stop the others before their own timeouts fire;
//! - whenever the process receives `SIGUSR1` (the handler is installed with the first
//!   communicator unless `OXCCL_DUMP_ON_SIGNAL=0`; it chains to any handler installed before).
//!
//! It goes to the file `OXCCL_DEBUG_DUMP` names (`%r` becomes the rank and `%p` the process
//! id; without `%r` the rank and `.json` are appended, so `/tmp/dump-` gives `/tmp/dump-0.json`
//! ...; a later dump replaces the file atomically), or else to stderr as one line.
//!
//! ```json
//! {"oxccl_flight_recorder":1,"reason":"timeout","detail":"rank 0: all_reduce #42 ...",
//!  "time_unix_ns":1764455000123456789,"pid":1234,"host":"node7","rank":0,"world_size":4,
//!  "comm_id":"1f2e3d4c5b6a7988",
//!  "communicators":[{"comm_id":"1f2e3d4c5b6a7988","rank":0,"world_size":4,
//!                    "last_started":42,"last_completed":41}],
//!  "entries":[{"comm_id":"1f2e3d4c5b6a7988","rank":0,"world_size":4,"seq":42,
//!              "coll":"all_reduce","count":1000,"dtype":"float","op":"sum","root":null,
//!              "peer":null,"algorithm":"ring","protocol":"slots","state":"failed",
//!              "start_unix_ns":1764454995000000000,"end_unix_ns":1764455000000000000,
//!              "steps":12,"steps_done":3,"bytes_in":4096,
//!              "waiting":"waiting for data from rank 1 (channel 0)","waiting_on":1,
//!              "error":"rank 0: all_reduce #42 (...) timed out after 5s: ..."}]}
//! ```
//! `last_started`/`last_completed` count collectives (not send/recv, whose sequence numbers
//! are per peer and direction); the initial barrier inside `Communicator::init` is #0.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The dump format, shared with `oxccl doctor` (from `oxccl_core::dump`).
pub use oxccl_core::dump::{CallState, CommState, DUMP_VERSION, Dump, Entry, MARKER};

use crate::error::{Error, OpDesc};
use crate::schedule::{Algorithm, CollectiveKind};
use crate::{DataType, ReduceOp};

/// Nanoseconds since the Unix epoch, from the kernel's coarse real-time clock: its resolution
/// is the scheduler tick (1 to 4 ms), plenty for a recorder of hangs, and it costs about 5 ns
/// to read where the precise clock costs about 30 (this is read twice per call).
pub(crate) fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::RealtimeCoarse);
    (t.tv_sec as u64).saturating_mul(1_000_000_000) + t.tv_nsec as u64
}

/// A communicator's live state, shared by its executor (which publishes progress), the
/// recorder and the watchdog.
pub(crate) struct Probe {
    pub comm_id: u64,
    pub rank: usize,
    pub world: usize,
    /// Recorder id of the running call (0: none).
    pub running: AtomicU64,
    /// When the running call started (ns since the epoch; 0: none).
    pub started_ns: AtomicU64,
    /// Steps of the running call that are done.
    pub steps_done: AtomicU32,
    /// Bytes the running call has received.
    pub bytes_in: AtomicU64,
    /// What the running call waits for, once it has idled a while ([`Waited::pack`]; 0:
    /// nothing published). Written off the fast path, by an idle call only.
    pub waiting: AtomicU64,
    /// Since when it waits (ns since the epoch), with `waiting`.
    pub waiting_since_ns: AtomicU64,
    pub last_started: AtomicU64,
    pub last_completed: AtomicU64,
    /// Whether this communicator has dumped already after a failure.
    pub dumped: std::sync::atomic::AtomicBool,
    /// Whether it has dumped at a peer's request.
    pub requested: std::sync::atomic::AtomicBool,
    /// This communicator's last calls (see [`Ring`]).
    ring: Ring,
}

impl Probe {
    pub(crate) fn new(comm_id: u64, rank: usize, world: usize) -> Arc<Probe> {
        let rec = recorder();
        let p = Arc::new(Probe {
            comm_id,
            rank,
            world,
            running: AtomicU64::new(0),
            started_ns: AtomicU64::new(0),
            steps_done: AtomicU32::new(0),
            bytes_in: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            waiting_since_ns: AtomicU64::new(0),
            last_started: AtomicU64::new(0),
            last_completed: AtomicU64::new(0),
            dumped: Default::default(),
            requested: Default::default(),
            ring: Ring::new(rec.map_or(0, |r| r.cap)),
        });
        if let Some(r) = rec {
            let mut comms = r.comms.lock().unwrap_or_else(|e| e.into_inner());
            // Keep the entries of a few communicators that are gone (a dump may be about them).
            let mut gone = comms.iter().filter(|c| Arc::strong_count(c) == 1).count();
            comms.retain(|c| {
                let drop = gone > KEEP_GONE && Arc::strong_count(c) == 1;
                gone -= usize::from(drop);
                !drop
            });
            comms.push(p.clone());
        }
        p
    }
}

/// What an idle running call waits for, as `oxccl status` tells it (the words of a timeout's
/// error, less its counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    /// Data from `peer` on `channel`.
    Data { peer: usize, channel: usize },
    /// A message in the mailbox `peer` writes.
    Mailbox { peer: usize },
    /// `peer` to free a slot on `channel`.
    Slot { peer: usize, channel: usize },
    /// The transport to finish a send to `peer`.
    Transport { peer: usize },
    /// Earlier steps, before a send to `peer`.
    EarlierSend { peer: usize },
    /// Earlier steps.
    Earlier,
}

impl Waited {
    /// Kind (8 bits), channel (8), step (24), peer + 1 (24): never 0.
    pub(crate) fn pack(self, step: usize) -> u64 {
        let (kind, peer, channel) = match self {
            Waited::Data { peer, channel } => (1, Some(peer), channel),
            Waited::Mailbox { peer } => (2, Some(peer), 0),
            Waited::Slot { peer, channel } => (3, Some(peer), channel),
            Waited::Transport { peer } => (4, Some(peer), 0),
            Waited::EarlierSend { peer } => (5, Some(peer), 0),
            Waited::Earlier => (6, None, 0),
        };
        let peer = peer.map_or(0, |p| (p as u64 + 1).min(0xff_ffff));
        kind | (channel.min(0xff) as u64) << 8 | (step.min(0xff_ffff) as u64) << 16 | peer << 40
    }

    /// What [`Waited::pack`] packed: what, and at which step.
    fn unpack(w: u64) -> Option<(Waited, u64)> {
        let peer = ((w >> 40) as usize).checked_sub(1);
        let channel = ((w >> 8) & 0xff) as usize;
        let step = (w >> 16) & 0xff_ffff;
        let waited = match (w & 0xff, peer) {
            (1, Some(peer)) => Waited::Data { peer, channel },
            (2, Some(peer)) => Waited::Mailbox { peer },
            (3, Some(peer)) => Waited::Slot { peer, channel },
            (4, Some(peer)) => Waited::Transport { peer },
            (5, Some(peer)) => Waited::EarlierSend { peer },
            (6, _) => Waited::Earlier,
            _ => return None,
        };
        Some((waited, step))
    }

    fn peer(self) -> Option<usize> {
        match self {
            Waited::Data { peer, .. }
            | Waited::Mailbox { peer }
            | Waited::Slot { peer, .. }
            | Waited::Transport { peer }
            | Waited::EarlierSend { peer } => Some(peer),
            Waited::Earlier => None,
        }
    }

    fn text(self) -> String {
        match self {
            Waited::Data { peer, channel } => {
                format!("waiting for data from rank {peer} (channel {channel})")
            }
            Waited::Mailbox { peer } => format!("waiting for rank {peer}'s message in its mailbox"),
            Waited::Slot { peer, channel } => {
                format!("waiting for rank {peer} to free a slot (channel {channel})")
            }
            Waited::Transport { peer } => {
                format!("waiting for the transport to finish a send to rank {peer}")
            }
            Waited::EarlierSend { peer } => {
                format!("waiting to send to rank {peer} after earlier steps")
            }
            Waited::Earlier => "waiting for earlier steps".into(),
        }
    }
}

/// Publishes what the running call waits for (an idle call, off its fast path; `since`: when
/// it went idle, ns since the epoch).
pub(crate) fn publish_waiting(probe: &Probe, waited: Waited, step: usize, since: u64) {
    probe.waiting_since_ns.store(since, Ordering::Relaxed);
    probe.waiting.store(waited.pack(step), Ordering::Relaxed);
}

/// Communicators that no longer exist whose entries dumps still show.
const KEEP_GONE: usize = 8;

/// What a starting call tells the recorder.
pub(crate) struct CallInfo<'a> {
    pub desc: &'a OpDesc,
    pub algorithm: Algorithm,
    pub protocol: Protocol,
    pub steps: usize,
}

/// The protocol a call runs (as dumps name it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Slots and credits.
    Slots,
    /// Mailboxes.
    Mailbox,
}

impl Protocol {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Protocol::Slots => "slots",
            Protocol::Mailbox => "mailbox",
        }
    }
}

/// One recorded call, as words of a [`Ring`] slot.
const W_ID: usize = 0;
const W_SEQ: usize = 1;
const W_COUNT: usize = 2;
const W_START: usize = 3;
const W_END: usize = 4;
const W_STEPS: usize = 5;
const W_DONE: usize = 6;
const W_BYTES: usize = 7;
/// Collective code, dtype, operator, state, algorithm and protocol (a byte each), then
/// whether the last word holds a root or a peer.
const W_KIND: usize = 8;
const W_ROOT: usize = 9;
const WORDS: usize = 10;

const STATE_RUNNING: u64 = 0;
const STATE_COMPLETED: u64 = 1;
const STATE_FAILED: u64 = 2;

/// A ring slot: the record's words and its version (odd while being written).
#[derive(Default)]
struct Slot {
    ver: AtomicU64,
    w: [AtomicU64; WORDS],
}

/// A communicator's recorded calls: a ring of slots that the thread running its calls writes
/// (one call at a time, under the communicator's lock), and that a dump reads from any thread
/// at any time, a hang included: each slot is a seqlock (a version that is odd while the slot
/// is written, read before and after its words), so recording a call takes no lock and
/// allocates nothing. What a failed call adds in text (its error, what it waited for) goes
/// to a short list beside it.
struct Ring {
    slots: Box<[Slot]>,
    /// Ids given so far (a call's id is its number, from 1).
    ids: AtomicU64,
    /// The slot of the newest id, `(ids - 1) % slots.len()`, kept as ids are given: the
    /// records of a running call find it without a division (a few ns of every call).
    newest: AtomicUsize,
    /// Failed calls' texts, by id (the last [`FAILURES`]).
    failures: Mutex<VecDeque<(u64, Failure)>>,
}

/// What a failed call's record says in words.
#[derive(Clone, Default)]
struct Failure {
    error: Option<String>,
    waiting: Option<String>,
    waiting_on: Option<u32>,
}

/// Failed calls whose texts a communicator keeps.
const FAILURES: usize = 16;

impl Ring {
    fn new(cap: usize) -> Ring {
        Ring {
            slots: (0..cap).map(|_| Slot::default()).collect(),
            ids: AtomicU64::new(0),
            newest: AtomicUsize::new(cap.saturating_sub(1)),
            failures: Mutex::new(VecDeque::new()),
        }
    }

    fn slot(&self, id: u64) -> Option<&Slot> {
        let n = self.slots.len() as u64;
        if id == self.ids.load(Ordering::Relaxed) {
            return self.slots.get(self.newest.load(Ordering::Relaxed));
        }
        (n > 0).then(|| &self.slots[((id - 1) % n) as usize])
    }

    /// The next call's id (by the single writer), its slot kept as the newest.
    fn next_id(&self) -> u64 {
        let id = self.ids.load(Ordering::Relaxed) + 1;
        let at = self.newest.load(Ordering::Relaxed) + 1;
        let at = if at >= self.slots.len() { 0 } else { at };
        self.newest.store(at, Ordering::Relaxed);
        self.ids.store(id, Ordering::Relaxed);
        id
    }

    /// Writes words of slot `id` with `f` (the single writer: the communicator's caller).
    fn write(&self, id: u64, f: impl FnOnce(&[AtomicU64; WORDS])) {
        let Some(s) = self.slot(id) else { return };
        let v = s.ver.load(Ordering::Relaxed);
        s.ver.store(v | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        f(&s.w);
        s.ver.store((v | 1) + 1, Ordering::Release);
    }

    /// A consistent copy of every slot in use, oldest first.
    fn read(&self) -> Vec<[u64; WORDS]> {
        let mut out = Vec::with_capacity(self.slots.len());
        for s in self.slots.iter() {
            for _ in 0..1000 {
                let v1 = s.ver.load(Ordering::Acquire);
                if v1 & 1 == 1 {
                    std::hint::spin_loop();
                    continue;
                }
                let w: [u64; WORDS] = std::array::from_fn(|i| s.w[i].load(Ordering::Relaxed));
                std::sync::atomic::fence(Ordering::Acquire);
                if s.ver.load(Ordering::Relaxed) == v1 {
                    if w[W_ID] != 0 {
                        out.push(w);
                    }
                    break;
                }
            }
        }
        out.sort_by_key(|w| w[W_ID]);
        out
    }
}

/// A recorded call's words as a dump entry.
fn entry(probe: &Probe, w: &[u64; WORDS], failures: &VecDeque<(u64, Failure)>) -> Entry {
    let byte = |i: u32| (w[W_KIND] >> (8 * i)) as u8;
    let p2p = byte(6) & 2 != 0;
    let root = (byte(6) & 1 != 0).then_some(w[W_ROOT] as u32);
    let failure = failures
        .iter()
        .find(|(id, _)| *id == w[W_ID])
        .map(|(_, f)| f.clone())
        .unwrap_or_default();
    let state = match u64::from(byte(3)) {
        STATE_COMPLETED => CallState::Completed,
        STATE_FAILED => CallState::Failed,
        _ => CallState::Running,
    };
    let running = state == CallState::Running && probe.running.load(Ordering::Relaxed) == w[W_ID];
    // A running call that idles says what it waits for.
    let live = Waited::unpack(probe.waiting.load(Ordering::Relaxed)).filter(|_| running);
    let (waiting, waiting_on, waiting_since_unix_ns) = match (failure.waiting, live) {
        (None, Some((waited, _))) => (
            Some(waited.text()),
            waited.peer().map(|p| p as u32),
            Some(probe.waiting_since_ns.load(Ordering::Relaxed)),
        ),
        (waiting, _) => (waiting, failure.waiting_on, None),
    };
    Entry {
        comm_id: hex(probe.comm_id),
        rank: probe.rank as u32,
        world_size: probe.world as u32,
        seq: w[W_SEQ],
        coll: CollectiveKind::from_code(byte(0)).unwrap_or(CollectiveKind::AllReduce),
        count: w[W_COUNT],
        dtype: DataType::ALL.get(byte(1) as usize).copied(),
        op: ReduceOp::ALL.get(byte(2) as usize).copied(),
        root: root.filter(|_| !p2p),
        peer: root.filter(|_| p2p),
        algorithm: Algorithm::ALL
            .get(byte(4) as usize)
            .map(|a| a.name().into()),
        protocol: Some(
            if byte(5) == 1 {
                Protocol::Mailbox
            } else {
                Protocol::Slots
            }
            .name()
            .into(),
        ),
        state,
        start_unix_ns: w[W_START],
        end_unix_ns: (w[W_END] != 0).then_some(w[W_END]),
        steps: w[W_STEPS],
        // A running call's live progress.
        steps_done: if running {
            probe.steps_done.load(Ordering::Relaxed).into()
        } else {
            w[W_DONE]
        },
        bytes_in: if running {
            probe.bytes_in.load(Ordering::Relaxed)
        } else {
            w[W_BYTES]
        },
        waiting,
        waiting_on,
        waiting_since_unix_ns,
        error: failure.error,
    }
}

/// A communicator id as dumps write it: 16 hex digits.
fn hex(id: u64) -> String {
    format!("{id:016x}")
}

struct Recorder {
    /// Entries kept per communicator.
    cap: usize,
    /// Every communicator of this process (and the last few that are gone).
    comms: Mutex<Vec<Arc<Probe>>>,
}

fn recorder() -> Option<&'static Recorder> {
    static REC: OnceLock<Option<Recorder>> = OnceLock::new();
    REC.get_or_init(|| {
        let cap = std::env::var("OXCCL_FLIGHT_RECORDER")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1024);
        (cap > 0).then(|| Recorder {
            cap: cap.min(1 << 20),
            comms: Mutex::new(Vec::new()),
        })
    })
    .as_ref()
}

/// Records the start of a call; returns its id (0 when the recorder is off).
pub(crate) fn start(probe: &Probe, call: &CallInfo<'_>) -> u64 {
    let now = now_ns();
    probe.steps_done.store(0, Ordering::Relaxed);
    probe.bytes_in.store(0, Ordering::Relaxed);
    probe.waiting.store(0, Ordering::Relaxed);
    probe.started_ns.store(now, Ordering::Relaxed);
    let d = call.desc;
    let p2p = d.coll.is_point_to_point();
    if !p2p {
        probe.last_started.store(d.seq, Ordering::Relaxed);
    }
    if probe.ring.slots.is_empty() {
        probe.running.store(u64::MAX, Ordering::Relaxed);
        return 0;
    }
    let id = probe.ring.next_id();
    let kind = u64::from(d.coll.code())
        | u64::from(d.dtype.index()) << 8
        | u64::from(d.op.index()) << 16
        | STATE_RUNNING << 24
        | u64::from(call.algorithm.index()) << 32
        | u64::from(call.protocol == Protocol::Mailbox) << 40
        | (u64::from(d.root.is_some()) | u64::from(p2p) << 1) << 48;
    probe.ring.write(id, |w| {
        let set = |i: usize, v: u64| w[i].store(v, Ordering::Relaxed);
        set(W_ID, id);
        set(W_SEQ, d.seq);
        set(W_COUNT, d.count);
        set(W_START, now);
        set(W_END, 0);
        set(W_STEPS, call.steps as u64);
        set(W_DONE, 0);
        set(W_BYTES, 0);
        set(W_KIND, kind);
        set(W_ROOT, d.root.unwrap_or(0) as u64);
    });
    probe.running.store(id, Ordering::Relaxed);
    id
}

/// Records the end of call `id` (from [`start`]).
pub(crate) fn end(probe: &Probe, id: u64, desc: &OpDesc, result: &Result<(), Error>) {
    probe.running.store(0, Ordering::Relaxed);
    probe.started_ns.store(0, Ordering::Relaxed);
    if result.is_ok() && !desc.coll.is_point_to_point() {
        probe.last_completed.store(desc.seq, Ordering::Relaxed);
    }
    if id == 0 {
        return;
    }
    let now = now_ns();
    let ring = &probe.ring;
    let mut steps_done = u64::from(probe.steps_done.load(Ordering::Relaxed));
    let mut bytes = probe.bytes_in.load(Ordering::Relaxed);
    let state = match result {
        Ok(()) => STATE_COMPLETED,
        Err(err) => {
            let mut f = Failure {
                error: Some(err.to_string()),
                ..Failure::default()
            };
            match err {
                Error::Timeout {
                    waiting,
                    peer,
                    step,
                    bytes: b,
                    ..
                } => {
                    f.waiting = Some(waiting.clone());
                    f.waiting_on = peer.map(|p| p as u32);
                    steps_done = steps_done.max(*step as u64);
                    bytes = *b;
                }
                Error::PeerFailed { peer, .. } => f.waiting_on = Some(*peer as u32),
                _ => {}
            }
            let mut fs = ring.failures.lock().unwrap_or_else(|e| e.into_inner());
            if fs.len() >= FAILURES {
                fs.pop_front();
            }
            fs.push_back((id, f));
            STATE_FAILED
        }
    };
    ring.write(id, |w| {
        if w[W_ID].load(Ordering::Relaxed) != id {
            return;
        }
        let steps = w[W_STEPS].load(Ordering::Relaxed);
        w[W_END].store(now, Ordering::Relaxed);
        w[W_DONE].store(
            if state == STATE_COMPLETED {
                steps
            } else {
                steps_done
            },
            Ordering::Relaxed,
        );
        w[W_BYTES].store(bytes, Ordering::Relaxed);
        let kind = w[W_KIND].load(Ordering::Relaxed);
        w[W_KIND].store(kind & !(0xff << 24) | state << 24, Ordering::Relaxed);
    });
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The dump as a JSON string: every live communicator's entries, with the running calls'
/// live progress. `about` is the communicator that triggered it (else the first live one).
fn render(reason: &str, detail: &str, about: Option<&Probe>) -> Option<(String, usize)> {
    let dump = snapshot(reason, detail, about, None)?;
    serde_json::to_string(&dump)
        .ok()
        .map(|s| (s, dump.rank as usize))
}

/// This process's state for `oxccl status` ([`crate::status`]): a dump of the communicators
/// that still exist, with the last `last` calls of each (`None`: without a recorder).
pub(crate) fn live(last: usize) -> Option<Dump> {
    snapshot("status", "live", None, Some(last))
}

/// The dump of [`render`]; with `last`, of the communicators that still exist only, and
/// their last `last` calls each.
fn snapshot(
    reason: &str,
    detail: &str,
    about: Option<&Probe>,
    last: Option<usize>,
) -> Option<Dump> {
    let r = recorder()?;
    let mut comms: Vec<Arc<Probe>> = r.comms.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if last.is_some() {
        // The recorder's list holds one reference; a live communicator holds more.
        comms.retain(|p| Arc::strong_count(p) > 2);
    }
    let mut entries: Vec<Entry> = Vec::new();
    for p in &comms {
        let failures = p
            .ring
            .failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let words = p.ring.read();
        let from = last.map_or(0, |n| words.len().saturating_sub(n));
        entries.extend(words[from..].iter().map(|w| entry(p, w, &failures)));
    }
    entries.sort_by_key(|e| e.start_unix_ns);
    let (rank, world, comm_id) = match about.or(comms.first().map(|p| &**p)) {
        Some(p) => (p.rank, p.world, p.comm_id),
        None => (0, 0, 0),
    };
    let dump = Dump {
        oxccl_flight_recorder: DUMP_VERSION,
        reason: reason.into(),
        detail: detail.into(),
        time_unix_ns: now_ns(),
        pid: Some(std::process::id()),
        host: Some(hostname()),
        rank: rank as u32,
        world_size: world as u32,
        comm_id: hex(comm_id),
        communicators: comms
            .iter()
            .map(|p| CommState {
                comm_id: hex(p.comm_id),
                rank: p.rank as u32,
                world_size: p.world as u32,
                last_started: p.last_started.load(Ordering::Relaxed),
                last_completed: p.last_completed.load(Ordering::Relaxed),
            })
            .collect(),
        entries,
    };
    Some(dump)
}

/// Where a dump of `rank` goes: the file `OXCCL_DEBUG_DUMP` names, if set.
pub(crate) fn dump_path(template: &str, rank: usize) -> std::path::PathBuf {
    let pid = std::process::id().to_string();
    let s = if template.contains("%r") {
        template.replace("%r", &rank.to_string())
    } else {
        format!("{template}{rank}.json")
    };
    s.replace("%p", &pid).into()
}

/// Writes a dump (see the module docs) and logs where it went.
pub(crate) fn dump(reason: &str, detail: &str, about: Option<&Probe>) {
    let Some((json, rank)) = render(reason, detail, about) else {
        return;
    };
    write_dump(reason, &json, rank);
}

/// Writes a rendered dump where [`dump`] would, and logs where it went.
fn write_dump(reason: &str, json: &str, rank: usize) {
    let to = match std::env::var("OXCCL_DEBUG_DUMP") {
        Ok(t) if !t.is_empty() => {
            let path = dump_path(&t, rank);
            if let Err(e) = write_whole(&path, json) {
                crate::log_warn(format!(
                    "rank {rank}: could not write the flight recorder to {}: {e}",
                    path.display()
                ));
                return;
            }
            path.display().to_string()
        }
        _ => {
            use std::io::Write;
            let _ = std::io::stderr().write_all(format!("{json}\n").as_bytes());
            "stderr".into()
        }
    };
    crate::log_warn(format!(
        "rank {rank}: flight recorder dumped to {to} ({reason})"
    ));
}

/// Writes `json` to `path` whole: into a file of its own, then renamed over `path`, so that a
/// reader never sees a half-written dump, nor two dumps of one process written at once (the
/// watchdog's and the abort's that follows it) interleaved.
fn write_whole(path: &std::path::Path, json: &str) -> std::io::Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}.{n}", std::process::id()));
    let written =
        std::fs::write(&tmp, format!("{json}\n")).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Dumps once per communicator after the error that broke it: always for a timeout or an
/// abort, for other errors only when `OXCCL_DEBUG_DUMP` is set.
pub(crate) fn dump_on_error(probe: &Probe, err: &Error) {
    let reason = match err {
        Error::Timeout { .. } => "timeout",
        Error::Aborted { .. } => "abort",
        Error::InvalidArgument { .. } | Error::Poisoned { .. } => return,
        _ if std::env::var_os("OXCCL_DEBUG_DUMP").is_some() => "error",
        _ => return,
    };
    // Under the lock a peer-requested dump writes under: it either wrote before (and this one
    // replaces it) or sees `dumped` and writes nothing.
    let _writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if probe.dumped.swap(true, Ordering::Relaxed) {
        return;
    }
    dump(reason, &err.to_string(), Some(probe));
}

/// Held while a failure's own dump or a peer-requested one is decided and written, so that a
/// requested dump written late never replaces this rank's own.
static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Dumps because rank `peer` timed out and asked for it (once per communicator; this rank's
/// own failure, if it follows, dumps again, replacing the file).
pub(crate) fn dump_on_request(probe: &Arc<Probe>, peer: usize) {
    if probe.dumped.load(Ordering::Relaxed) || probe.requested.swap(true, Ordering::Relaxed) {
        return;
    }
    let why = format!("rank {peer} timed out and asked every rank to dump");
    // Rendered here (the state as it is now), written from a thread of its own: this runs in
    // the middle of a call, and a stderr nobody reads (a full pipe) must not stall the call,
    // nor with it the peers that wait on this rank (a launcher draining one rank's output
    // after the other's then deadlocks).
    let Some((json, rank)) = render("peer_timeout", &why, Some(probe)) else {
        return;
    };
    let probe = probe.clone();
    let spawned = std::thread::Builder::new()
        .name("oxccl-dump".into())
        .spawn(move || {
            // This rank's own failure dumped meanwhile: that one says more; keep it.
            let _writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
            if !probe.dumped.load(Ordering::Relaxed) {
                write_dump("peer_timeout", &json, rank);
            }
        });
    if let Err(e) = spawned {
        crate::log_warn(format!("rank {rank}: cannot start the dump thread: {e}"));
    }
}

/// Installs the `SIGUSR1` handler (once per process) that dumps the recorder.
pub(crate) fn install_signal_handler() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if recorder().is_none() || std::env::var("OXCCL_DUMP_ON_SIGNAL").as_deref() == Ok("0") {
            return;
        }
        let mut signals = match signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
        {
            Ok(s) => s,
            Err(e) => {
                crate::log_warn(format!("cannot install the SIGUSR1 dump handler: {e}"));
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("oxccl-sigusr1".into())
            .spawn(move || {
                for _ in signals.forever() {
                    dump("signal", "SIGUSR1", None);
                }
            });
        if let Err(e) = spawned {
            crate::log_warn(format!("cannot start the SIGUSR1 dump thread: {e}"));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_paths_follow_the_template() {
        assert_eq!(
            dump_path("/tmp/d-", 3),
            std::path::PathBuf::from("/tmp/d-3.json")
        );
        assert_eq!(
            dump_path("/x/rank%r.txt", 12),
            std::path::PathBuf::from("/x/rank12.txt")
        );
        let p = dump_path("/x/%r-%p", 1).display().to_string();
        assert_eq!(p, format!("/x/1-{}", std::process::id()));
    }

    /// Dumps of one process written at once (the watchdog's while the abort's is written) end
    /// as one of them whole, never interleaved; a reader meanwhile sees whole dumps only.
    #[test]
    fn dumps_written_at_once_end_whole() {
        let dir = std::env::temp_dir().join(format!("oxccl-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank0.json");
        let writers: Vec<_> = (0..4)
            .map(|t| {
                let path = path.clone();
                // Lengths differ by writer, so that an interleaving leaves trailing bytes.
                let json = serde_json::json!({ "writer": t, "pad": "x".repeat(1000 * (4 - t)) })
                    .to_string();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        write_whole(&path, &json).unwrap();
                    }
                })
            })
            .collect();
        let mut reads = 0;
        while writers.iter().any(|w| !w.is_finished()) {
            if let Ok(text) = std::fs::read_to_string(&path) {
                let v: serde_json::Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("a torn dump ({e}): {} bytes", text.len()));
                assert!(v["writer"].as_u64().unwrap() < 4);
                reads += 1;
            }
        }
        writers.into_iter().for_each(|w| w.join().unwrap());
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(left, ["rank0.json"], "temporary files left behind");
        assert!(reads > 0);
    }

    /// The newest id's slot, kept as ids are given, is the one its number says: slots are
    /// used in turn, from the first, wrapping around.
    #[test]
    fn ids_take_the_slots_in_turn() {
        for cap in [1, 2, 3, 5] {
            let ring = Ring::new(cap);
            for _ in 0..3 * cap + 1 {
                let id = ring.next_id();
                let want = &ring.slots[((id - 1) % cap as u64) as usize];
                assert!(
                    std::ptr::eq(ring.slot(id).unwrap(), want),
                    "id {id} of {cap}"
                );
                if id > 1 {
                    let prev = &ring.slots[((id - 2) % cap as u64) as usize];
                    assert!(std::ptr::eq(ring.slot(id - 1).unwrap(), prev));
                }
            }
        }
        assert!(Ring::new(0).slot(Ring::new(0).next_id()).is_none());
    }

    /// A dump read while calls are being recorded sees each record whole: the seqlock never
    /// hands out a record half old, half new. Two slots, so that the writer keeps rewriting
    /// the ones being read; every record's words are multiples of its id.
    #[test]
    fn dumps_read_records_whole_while_they_are_written() {
        let ring = Arc::new(Ring::new(2));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (ring, stop) = (ring.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut id = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    id += 1;
                    ring.write(id, |w| {
                        for (i, word) in w.iter().enumerate() {
                            word.store(id * (i as u64 + 1), Ordering::Relaxed);
                        }
                    });
                }
                id
            })
        };
        let (mut seen, end) = (
            0,
            std::time::Instant::now() + std::time::Duration::from_millis(300),
        );
        while std::time::Instant::now() < end {
            for w in ring.read() {
                for (i, &x) in w.iter().enumerate() {
                    assert_eq!(x, w[W_ID] * (i as u64 + 1), "a torn record: {w:?}");
                }
                seen += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let written = writer.join().unwrap();
        assert!(
            seen > 100 && written > 100,
            "{seen} records read, {written} written"
        );
        assert_eq!(ring.read().last().unwrap()[W_ID], written);
    }

    #[test]
    fn what_a_call_waits_for_packs_and_unpacks() {
        let cases = [
            Waited::Data {
                peer: 3,
                channel: 2,
            },
            Waited::Mailbox { peer: 0 },
            Waited::Slot {
                peer: 1000,
                channel: 0,
            },
            Waited::Transport { peer: 7 },
            Waited::EarlierSend { peer: 1 },
            Waited::Earlier,
        ];
        for (i, w) in cases.into_iter().enumerate() {
            let packed = w.pack(i * 5);
            assert_ne!(packed, 0, "0 means nothing published");
            assert_eq!(Waited::unpack(packed), Some((w, (i * 5) as u64)));
        }
        assert_eq!(Waited::unpack(0), None);
        assert_eq!(
            Waited::Data {
                peer: 3,
                channel: 1
            }
            .text(),
            "waiting for data from rank 3 (channel 1)"
        );
    }

    /// A live snapshot shows the running call with what it waits for, and only communicators
    /// that still exist.
    #[test]
    fn live_snapshots_show_the_wait_of_the_running_call() {
        let probe = Probe::new(0xdef, 1, 3);
        let gone = Probe::new(0x123, 0, 2);
        drop(gone);
        let desc = OpDesc {
            seq: 9,
            coll: CollectiveKind::AllReduce,
            count: 10,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            root: None,
        };
        let info = CallInfo {
            desc: &desc,
            algorithm: Algorithm::Ring,
            protocol: Protocol::Slots,
            steps: 4,
        };
        let id = start(&probe, &info);
        publish_waiting(
            &probe,
            Waited::Data {
                peer: 2,
                channel: 0,
            },
            1,
            12345,
        );
        let dump = live(LAST).unwrap();
        assert!(
            dump.communicators.iter().all(|c| c.comm_id != hex(0x123)),
            "a dropped communicator is not live"
        );
        let e = dump
            .entries
            .iter()
            .find(|e| e.comm_id == hex(0xdef))
            .unwrap();
        assert_eq!(e.state, CallState::Running);
        assert_eq!(e.waiting_on, Some(2));
        assert_eq!(e.waiting_since_unix_ns, Some(12345));
        assert_eq!(
            e.waiting.as_deref(),
            Some("waiting for data from rank 2 (channel 0)")
        );
        end(&probe, id, &desc, &Ok(()));
        // The next call starts with nothing published; a finished one has no live wait.
        let id = start(&probe, &info);
        let dump = live(LAST).unwrap();
        let mine: Vec<&Entry> = dump
            .entries
            .iter()
            .filter(|e| e.comm_id == hex(0xdef))
            .collect();
        assert_eq!(mine.len(), 2);
        assert!(mine.iter().all(|e| e.waiting.is_none()), "{mine:?}");
        end(&probe, id, &desc, &Ok(()));
        // The last `LAST` calls only.
        for _ in 0..LAST + 3 {
            let id = start(&probe, &info);
            end(&probe, id, &desc, &Ok(()));
        }
        let dump = live(LAST).unwrap();
        let n = dump
            .entries
            .iter()
            .filter(|e| e.comm_id == hex(0xdef))
            .count();
        assert_eq!(n, LAST);
    }

    const LAST: usize = 4;

    #[test]
    fn entries_record_calls_and_live_progress() {
        let probe = Probe::new(0xabc, 2, 4);
        let desc = OpDesc {
            seq: 7,
            coll: CollectiveKind::AllReduce,
            count: 1000,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            root: None,
        };
        let info = CallInfo {
            desc: &desc,
            algorithm: Algorithm::Ring,
            protocol: Protocol::Slots,
            steps: 12,
        };
        let id = start(&probe, &info);
        assert!(id > 0);
        probe.steps_done.store(5, Ordering::Relaxed);
        probe.bytes_in.store(4096, Ordering::Relaxed);
        let (json, rank) = render("signal", "test", Some(&probe)).unwrap();
        assert_eq!(rank, 2);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["oxccl_flight_recorder"], 1);
        assert_eq!(v["comm_id"], "0000000000000abc");
        let mine: Vec<&serde_json::Value> = v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["comm_id"] == "0000000000000abc")
            .collect();
        assert_eq!(mine.len(), 1);
        let e = mine[0];
        assert_eq!(e["state"], "running");
        assert_eq!(e["steps_done"], 5);
        assert_eq!(e["bytes_in"], 4096);
        assert_eq!(e["dtype"], "float");
        assert_eq!(e["seq"], 7);
        let c = v["communicators"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["comm_id"] == "0000000000000abc")
            .unwrap();
        assert_eq!(c["last_started"], 7);
        assert_eq!(c["last_completed"], 0);

        let err = Error::Timeout {
            rank: 2,
            op: Box::new(desc),
            timeout: std::time::Duration::from_secs(1),
            waiting: "waiting for data from rank 1 (channel 0)".into(),
            peer: Some(1),
            step: 6,
            steps: 12,
            bytes: 8192,
        };
        end(&probe, id, &desc, &Err(err));
        let (json, _) = render("timeout", "t", Some(&probe)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let e = v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["comm_id"] == "0000000000000abc")
            .unwrap()
            .clone();
        assert_eq!(e["state"], "failed");
        assert_eq!(e["waiting_on"], 1);
        assert_eq!(e["steps_done"], 6);
        assert_eq!(e["bytes_in"], 8192);
        assert!(e["error"].as_str().unwrap().contains("timed out"));
        assert!(e["end_unix_ns"].as_u64().unwrap() >= e["start_unix_ns"].as_u64().unwrap());
    }
}
