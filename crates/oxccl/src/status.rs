//! The live health service behind `oxccl status`: every process of a running job answers,
//! through the job's store, what its communicators are doing right now, even while they hang.
//!
//! Each process that makes a communicator over oxccl's own store ([`oxccl_bootstrap::TcpStore`]
//! or the store rank 0 serves) starts one service thread (`oxccl-status`), shared by all its
//! communicators on that store and gone with the last of them. The process is registered at
//! init (`oxccl/status/proc/<i>`: a [`Registration`]); the thread opens its own connection to
//! the store and blocks in a `wait` on the next request key (`oxccl/status/req/<g>`), a minute
//! at a time: no polling, and nothing on the data path. A request wakes it at once; it answers with a flight-recorder
//! [`Dump`] of the live communicators (their last [`LAST_CALLS`] calls each; the running one
//! with its steps done, the peer it waits on and since when) under
//! `oxccl/status/ans/<g>/<i>`. A communicator's drop breaks the service's connection (no
//! round trip), so the thread ends at once; it then marks its registration gone on a short
//! new connection, best effort. What a running call waits on is published by the call itself
//! once it has idled for a millisecond ([`crate::flight`]), so a hung job answers fully.
//!
//! [`query`] is the other side (`oxccl status`): it posts a request, collects the answers for
//! up to a deadline, and names the registered processes that did not answer (a rank stopped
//! with `SIGSTOP`, or spinning with its signals blocked, cannot answer).
//!
//! No service runs where the store was handed in from outside ([`Bootstrap::with_store`], e.g.
//! torch's store from Python, unless a communicator of the same process runs over oxccl's store
//! at the same address), nor when `OXCCL_STATUS=0`, nor without a flight recorder
//! (`OXCCL_FLIGHT_RECORDER=0`: the process then answers with no communicators). The keys are
//! global to the store: jobs that share a standalone store (`oxccl store`) are reported
//! together, grouped by communicator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use oxccl_bootstrap::{
    Bootstrap, ClientOptions, Interrupter, SERVICE_LABEL_PREFIX, Secret, Store, TcpStore,
};
use serde::{Deserialize, Serialize};

use crate::flight::{self, Dump, Probe};

/// The prefix of every key of the status protocol.
pub const PREFIX: &str = "oxccl/status/";
/// The counter of requests: request `g` is posted as [`request_key`]`(g)`.
pub const REQUESTS_KEY: &str = "oxccl/status/requests";
/// The counter of registered processes: process `i` registers as [`process_key`]`(i)`.
pub const PROCESSES_KEY: &str = "oxccl/status/processes";
/// Calls of each communicator in an answer (the running one and those just before).
pub const LAST_CALLS: usize = 4;
/// A request older than this when a service sees it (it was stopped meanwhile) is not
/// answered: whoever asked has given up.
const MAX_AGE: Duration = Duration::from_secs(30);
/// How long the service's `wait` for a request lasts before it is renewed.
const WAIT_SLICE: Duration = Duration::from_secs(60);

/// The key of request `g` (its value: a [`Request`]).
pub fn request_key(g: u64) -> String {
    format!("{PREFIX}req/{g}")
}

/// The key of process `i`'s answer to request `g` (its value: a [`Dump`]).
pub fn answer_key(g: u64, i: u64) -> String {
    format!("{PREFIX}ans/{g}/{i}")
}

/// The key of process `i`'s [`Registration`].
pub fn process_key(i: u64) -> String {
    format!("{PREFIX}proc/{i}")
}

/// A process that serves status requests, as registered in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Its index (`oxccl/status/proc/<index>`).
    pub index: u64,
    /// The process id.
    pub pid: u32,
    /// The host's name.
    pub host: String,
    /// The communicator whose init started the service (16 hex digits), this process's rank
    /// in it and its size: how a process that does not answer is named.
    pub comm_id: String,
    /// This process's rank in `comm_id`.
    pub rank: u32,
    /// The ranks of `comm_id`.
    pub world_size: u32,
    /// When it registered (ns since the epoch).
    pub since_unix_ns: u64,
    /// Whether its service has ended (its communicators are gone).
    #[serde(default)]
    pub gone: bool,
}

/// A status request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Request {
    /// When it was posted (ns since the epoch).
    pub time_unix_ns: u64,
}

/// The outcome of [`query`].
#[derive(Debug)]
pub struct Answers {
    /// The request's number.
    pub request: u64,
    /// The processes that answered, with their answers, by registration.
    pub answered: Vec<(Registration, Dump)>,
    /// The registered processes that did not answer in time.
    pub silent: Vec<Registration>,
    /// Registered processes whose service has ended.
    pub gone: usize,
    /// Processes that registered, but whose registration could not be read.
    pub unreadable: Vec<String>,
}

impl Answers {
    /// Deletes the answers read from the store (after they are reported: a round trip each).
    pub fn forget(&self, store: &dyn Store) {
        for (r, _) in &self.answered {
            let _ = store.delete(&answer_key(self.request, r.index));
        }
    }
}

/// Asks every registered process of the store what it is doing; waits for the answers until
/// `deadline`. Fails only when the store fails (unreachable, a refused request).
pub fn query(store: &dyn Store, deadline: Instant) -> oxccl_bootstrap::Result<Answers> {
    let processes = u64::try_from(store.add(PROCESSES_KEY, 0)?).unwrap_or(0);
    let keys: Vec<String> = (0..processes).map(process_key).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    // A process registers right after adding itself: allow it a moment to do so.
    let values = get_present(store, &refs, Instant::now() + Duration::from_millis(50))?;
    let mut live = Vec::new();
    let mut unreadable = Vec::new();
    let mut gone = 0;
    for (key, value) in keys.iter().zip(values) {
        match value.map(|v| serde_json::from_slice::<Registration>(&v)) {
            Some(Ok(r)) if r.gone => gone += 1,
            Some(Ok(r)) => live.push(r),
            Some(Err(e)) => unreadable.push(format!("{key}: {e}")),
            None => unreadable.push(format!("{key}: not written")),
        }
    }
    let g = u64::try_from(store.add(REQUESTS_KEY, 1)?).unwrap_or(0);
    let req = Request {
        time_unix_ns: flight::now_ns(),
    };
    let body = serde_json::to_vec(&req).unwrap_or_default();
    store.set(&request_key(g), &body)?;
    let keys: Vec<String> = live.iter().map(|r| answer_key(g, r.index)).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = get_present(store, &refs, deadline)?;
    let mut answered = Vec::new();
    let mut silent = Vec::new();
    for ((r, key), value) in live.into_iter().zip(&keys).zip(values) {
        match value.map(|v| serde_json::from_slice::<Dump>(&v)) {
            Some(Ok(d)) => answered.push((r, d)),
            Some(Err(e)) => {
                unreadable.push(format!("{key}: {e}"));
                silent.push(r);
            }
            None => silent.push(r),
        }
    }
    Ok(Answers {
        request: g,
        answered,
        silent,
        gone,
        unreadable,
    })
}

/// The values of `keys` that exist by `deadline` (`None` for the others).
fn get_present(
    store: &dyn Store,
    keys: &[&str],
    deadline: Instant,
) -> oxccl_bootstrap::Result<Vec<Option<Vec<u8>>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let missing: Vec<String> = match store.wait(keys, left) {
        Ok(()) => Vec::new(),
        Err(oxccl_bootstrap::Error::Timeout { missing, .. }) => missing,
        Err(e) => return Err(e),
    };
    let present: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !missing.iter().any(|m| m == k))
        .collect();
    let mut values = if present.is_empty() {
        Vec::new()
    } else {
        store.multi_get(&present, Duration::ZERO)?
    }
    .into_iter();
    Ok(keys
        .iter()
        .map(|k| {
            if missing.iter().any(|m| m == k) {
                None
            } else {
                values.next()
            }
        })
        .collect())
}

// ---------------------------------------------------------------------------------------------
// The service.

/// This process's status service on one store; communicators hold it ([`attach`]), and the
/// last one's drop stops it.
pub(crate) struct Service {
    shared: Arc<Shared>,
    /// Disconnected when the thread ends.
    ended: Mutex<std::sync::mpsc::Receiver<()>>,
}

/// How long the last communicator's drop waits for the service to say it is gone (normally
/// a few ms: one short connection to the store; longer only when the store is unreachable).
const DROP_WAIT: Duration = Duration::from_millis(100);

/// What the service thread and its owners share.
struct Shared {
    addr: String,
    stop: AtomicBool,
    /// Breaks the thread's connection (set once it has one).
    interrupter: Mutex<Option<Interrupter>>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(i) = &*lock(&self.shared.interrupter) {
            i.interrupt();
        }
        // A moment for the thread to mark the process gone: a process that exits right after
        // would otherwise leave its registration behind, and look silent to `oxccl status`.
        let _ = lock(&self.ended).recv_timeout(DROP_WAIT);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The running services of this process, by store address.
static SERVICES: Mutex<Vec<Weak<Service>>> = Mutex::new(Vec::new());

/// The status service of this process for `bootstrap`'s store: the running one, or a new one
/// (registered as the process of `probe`'s rank). `None` where none can run (see the module
/// docs).
pub(crate) fn attach(bootstrap: &Bootstrap, probe: &Probe) -> Option<Arc<Service>> {
    if std::env::var("OXCCL_STATUS").is_ok_and(|v| v.trim() == "0") {
        return None;
    }
    let addr = bootstrap.store_addr();
    let mut services = lock(&SERVICES);
    services.retain(|s| s.strong_count() > 0);
    if let Some(s) = services
        .iter()
        .filter_map(Weak::upgrade)
        .find(|s| s.shared.addr == addr)
    {
        return Some(s);
    }
    let secret = bootstrap.secret()?.clone();
    let shared = Arc::new(Shared {
        addr: addr.to_string(),
        stop: AtomicBool::new(false),
        interrupter: Mutex::new(None),
    });
    let me = Registration {
        index: 0,
        pid: std::process::id(),
        host: hostname(),
        comm_id: format!("{:016x}", probe.comm_id),
        rank: probe.rank as u32,
        world_size: probe.world as u32,
        since_unix_ns: flight::now_ns(),
        gone: false,
    };
    // Registered here, through the bootstrap's store, so that a process is known once its
    // init returns; the last request is read first: one posted by whoever has seen the
    // registration comes after it, and the thread answers it.
    let mut me = me;
    let store = bootstrap.store();
    let registered = (|| {
        let last = u64::try_from(store.add(REQUESTS_KEY, 0)?).unwrap_or(0);
        me.index = u64::try_from(store.add(PROCESSES_KEY, 1)? - 1).unwrap_or(0);
        store.set(
            &process_key(me.index),
            &serde_json::to_vec(&me).unwrap_or_default(),
        )?;
        Ok::<_, oxccl_bootstrap::Error>(last)
    })();
    let last = match registered {
        Ok(last) => last,
        Err(e) => {
            crate::log_warn(format!(
                "rank {}: no status service (oxccl status): cannot register in the store: {e}",
                probe.rank
            ));
            return None;
        }
    };
    let thread_shared = shared.clone();
    let (ending, ended) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("oxccl-status".into())
        .spawn(move || {
            serve(&thread_shared, &secret, me, last);
            drop(ending);
        });
    if let Err(e) = spawned {
        crate::log_warn(format!(
            "rank {}: cannot start the status service thread: {e}",
            probe.rank
        ));
        return None;
    }
    let service = Arc::new(Service {
        shared,
        ended: Mutex::new(ended),
    });
    services.push(Arc::downgrade(&service));
    Some(service)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The service thread: answers requests after `last` until stopped.
fn serve(shared: &Shared, secret: &Secret, mut me: Registration, last: u64) {
    // (Rank 0 does not wait for a service to leave its store before it stops it.)
    let label = format!(
        "{SERVICE_LABEL_PREFIX}oxccl status, rank {} pid {}",
        me.rank, me.pid
    );
    let opts = ClientOptions {
        connect_timeout: Duration::from_secs(10),
        label: label.clone(),
        ..ClientOptions::default()
    };
    let result = TcpStore::connect_with(&shared.addr, secret, &opts).and_then(|store| {
        *lock(&shared.interrupter) = Some(store.interrupter()?);
        // (Checked once the interrupter is in place: a drop before it is seen here, one
        // after it breaks the connection.)
        answer_requests(&store, &shared.stop, &me, last + 1)
    });
    if shared.stop.load(Ordering::Relaxed) {
        // Ended by the communicators' drop: say so, so that `oxccl status` does not count
        // this process as silent (best effort, on a new short connection).
        me.gone = true;
        // (Briefly: the store may be gone with the job. The reply gets the default 30 s: the
        // drop waits 100 ms at most, and a thread that lingers holds nothing.)
        let quick = ClientOptions {
            connect_timeout: Duration::from_millis(250),
            label,
            ..ClientOptions::default()
        };
        if let Ok(s) = TcpStore::connect_with(&shared.addr, secret, &quick) {
            let _ = s.set(
                &process_key(me.index),
                &serde_json::to_vec(&me).unwrap_or_default(),
            );
        }
    } else if let Err(e) = result {
        let text = format!(
            "rank {}: the status service (oxccl status) ends: {e}",
            me.rank
        );
        match e {
            // The store went away: the job is ending (rank 0 closed it), nothing to say.
            oxccl_bootstrap::Error::StoreGone { .. } if !crate::log_enabled() => {}
            oxccl_bootstrap::Error::StoreGone { .. } => crate::log_line(text),
            _ => crate::log_warn(text),
        }
    }
}

/// Answers request `next` and those after it, until stopped or the store fails.
fn answer_requests(
    store: &TcpStore,
    stop: &AtomicBool,
    me: &Registration,
    mut next: u64,
) -> oxccl_bootstrap::Result<()> {
    while !stop.load(Ordering::Relaxed) {
        let body = match store.get(&request_key(next), WAIT_SLICE) {
            Ok(b) => b,
            Err(oxccl_bootstrap::Error::Timeout { .. }) => continue,
            Err(e) => return Err(e),
        };
        let fresh = serde_json::from_slice::<Request>(&body).is_ok_and(|r| {
            flight::now_ns().saturating_sub(r.time_unix_ns) < MAX_AGE.as_nanos() as u64
        });
        if fresh {
            let answer = flight::live(LAST_CALLS).unwrap_or_else(|| empty_answer(me));
            store.set(
                &answer_key(next, me.index),
                &serde_json::to_vec(&answer).unwrap_or_default(),
            )?;
        }
        next += 1;
    }
    Ok(())
}

/// The answer of a process without a flight recorder: who it is, no communicators.
fn empty_answer(me: &Registration) -> Dump {
    Dump {
        oxccl_flight_recorder: flight::DUMP_VERSION,
        reason: "status".into(),
        detail: "no flight recorder (OXCCL_FLIGHT_RECORDER=0)".into(),
        time_unix_ns: flight::now_ns(),
        pid: Some(me.pid),
        host: Some(me.host.clone()),
        rank: me.rank,
        world_size: me.world_size,
        comm_id: me.comm_id.clone(),
        communicators: Vec::new(),
        entries: Vec::new(),
    }
}
