//! The flight recorder: the last calls of every communicator of this process, dumped as JSON
//! when something goes wrong, so that a person can see which rank stopped where.
//!
//! Each process keeps one recorder (`OXCCL_FLIGHT_RECORDER` entries, default 1024; `0` turns
//! it off). A call is recorded when it starts (kind, count, type, operator, root, algorithm,
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
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The dump format, shared with `oxccl doctor` (from `oxccl_core::dump`).
pub use oxccl_core::dump::{CallState, CommState, DUMP_VERSION, Dump, Entry, MARKER};

use crate::error::{Error, OpDesc};

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
    pub last_started: AtomicU64,
    pub last_completed: AtomicU64,
    /// Whether this communicator has dumped already after a failure.
    pub dumped: std::sync::atomic::AtomicBool,
    /// Whether it has dumped at a peer's request.
    pub requested: std::sync::atomic::AtomicBool,
}

impl Probe {
    pub(crate) fn new(comm_id: u64, rank: usize, world: usize) -> Arc<Probe> {
        let p = Arc::new(Probe {
            comm_id,
            rank,
            world,
            running: AtomicU64::new(0),
            started_ns: AtomicU64::new(0),
            steps_done: AtomicU32::new(0),
            bytes_in: AtomicU64::new(0),
            last_started: AtomicU64::new(0),
            last_completed: AtomicU64::new(0),
            dumped: Default::default(),
            requested: Default::default(),
        });
        if let Some(r) = recorder() {
            let mut comms = r.comms.lock().unwrap_or_else(|e| e.into_inner());
            comms.retain(|w| w.strong_count() > 0);
            comms.push(Arc::downgrade(&p));
        }
        p
    }
}

/// What a starting call tells the recorder.
pub(crate) struct CallInfo<'a> {
    pub desc: &'a OpDesc,
    pub algorithm: &'static str,
    pub protocol: &'static str,
    pub steps: usize,
}

/// A recorded call: its id in the recorder, its communicator, and what a dump says of it. The
/// entry's `comm_id` text is written when a dump is rendered, so that recording a call
/// allocates nothing.
#[derive(Clone)]
struct Record {
    id: u64,
    comm_id: u64,
    entry: Entry,
}

/// A communicator id as dumps write it: 16 hex digits.
fn hex(id: u64) -> String {
    format!("{id:016x}")
}

struct Recorder {
    cap: usize,
    ring: Mutex<(u64, VecDeque<Record>)>,
    comms: Mutex<Vec<Weak<Probe>>>,
}

fn recorder() -> Option<&'static Recorder> {
    static REC: OnceLock<Option<Recorder>> = OnceLock::new();
    REC.get_or_init(|| {
        let cap = std::env::var("OXCCL_FLIGHT_RECORDER")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1024);
        (cap > 0).then(|| Recorder {
            cap,
            ring: Mutex::new((0, VecDeque::with_capacity(cap.min(4096)))),
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
    probe.started_ns.store(now, Ordering::Relaxed);
    let p2p = call.desc.coll.is_point_to_point();
    if !p2p {
        probe.last_started.store(call.desc.seq, Ordering::Relaxed);
    }
    let Some(r) = recorder() else {
        probe.running.store(u64::MAX, Ordering::Relaxed);
        return 0;
    };
    let d = call.desc;
    let mut ring = r.ring.lock().unwrap_or_else(|e| e.into_inner());
    ring.0 += 1;
    let id = ring.0;
    if ring.1.len() >= r.cap {
        ring.1.pop_front();
    }
    let rank = |r: usize| r as u32;
    ring.1.push_back(Record {
        id,
        comm_id: probe.comm_id,
        entry: Entry {
            comm_id: String::new(),
            rank: rank(probe.rank),
            world_size: rank(probe.world),
            seq: d.seq,
            coll: d.coll,
            count: d.count,
            dtype: Some(d.dtype),
            op: Some(d.op),
            root: d.root.filter(|_| !p2p).map(rank),
            peer: d.root.filter(|_| p2p).map(rank),
            algorithm: Some(call.algorithm.into()),
            protocol: Some(call.protocol.into()),
            state: CallState::Running,
            start_unix_ns: now,
            end_unix_ns: None,
            steps: call.steps as u64,
            steps_done: 0,
            bytes_in: 0,
            waiting: None,
            waiting_on: None,
            error: None,
        },
    });
    drop(ring);
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
    let Some(r) = recorder() else { return };
    if id == 0 {
        return;
    }
    let now = now_ns();
    let mut ring = r.ring.lock().unwrap_or_else(|e| e.into_inner());
    let first = ring.1.front().map_or(0, |e| e.id);
    let Some(rec) = id
        .checked_sub(first)
        .and_then(|i| ring.1.get_mut(i as usize))
    else {
        return;
    };
    let e = &mut rec.entry;
    e.end_unix_ns = Some(now);
    e.steps_done = probe.steps_done.load(Ordering::Relaxed).into();
    e.bytes_in = probe.bytes_in.load(Ordering::Relaxed);
    match result {
        Ok(()) => {
            e.state = CallState::Completed;
            e.steps_done = e.steps;
        }
        Err(err) => {
            e.state = CallState::Failed;
            e.error = Some(err.to_string());
            match err {
                Error::Timeout {
                    waiting,
                    peer,
                    step,
                    bytes,
                    ..
                } => {
                    e.waiting = Some(waiting.clone());
                    e.waiting_on = peer.map(|p| p as u32);
                    e.steps_done = e.steps_done.max(*step as u64);
                    e.bytes_in = *bytes;
                }
                Error::PeerFailed { peer, .. } => e.waiting_on = Some(*peer as u32),
                _ => {}
            }
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The dump as a JSON string: every live communicator's entries, with the running calls'
/// live progress. `about` is the communicator that triggered it (else the first live one).
fn render(reason: &str, detail: &str, about: Option<&Probe>) -> Option<(String, usize)> {
    let r = recorder()?;
    let comms: Vec<Arc<Probe>> = r
        .comms
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let records: Vec<Record> = r
        .ring
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .1
        .iter()
        .cloned()
        .collect();
    let entries = records
        .into_iter()
        .map(
            |Record {
                 id,
                 comm_id,
                 mut entry,
             }| {
                entry.comm_id = hex(comm_id);
                if entry.state == CallState::Running
                    && let Some(p) = comms
                        .iter()
                        .find(|p| p.comm_id == comm_id && p.rank as u32 == entry.rank)
                    && p.running.load(Ordering::Relaxed) == id
                {
                    entry.steps_done = p.steps_done.load(Ordering::Relaxed).into();
                    entry.bytes_in = p.bytes_in.load(Ordering::Relaxed);
                }
                entry
            },
        )
        .collect();
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
    serde_json::to_string(&dump).ok().map(|s| (s, rank))
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
    let to = match std::env::var("OXCCL_DEBUG_DUMP") {
        Ok(t) if !t.is_empty() => {
            let path = dump_path(&t, rank);
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let written = std::fs::write(&tmp, format!("{json}\n"))
                .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
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
    if probe.dumped.swap(true, Ordering::Relaxed) {
        return;
    }
    dump(reason, &err.to_string(), Some(probe));
}

/// Dumps because rank `peer` timed out and asked for it (once per communicator; this rank's
/// own failure, if it follows, dumps again, replacing the file).
pub(crate) fn dump_on_request(probe: &Probe, peer: usize) {
    if probe.dumped.load(Ordering::Relaxed) || probe.requested.swap(true, Ordering::Relaxed) {
        return;
    }
    let why = format!("rank {peer} timed out and asked every rank to dump");
    dump("peer_timeout", &why, Some(probe));
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
    use crate::schedule::CollectiveKind;
    use crate::{DataType, ReduceOp};

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
            algorithm: "ring",
            protocol: "slots",
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
            op: Box::new(desc.clone()),
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
