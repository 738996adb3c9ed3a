//! The communicator: connections to the peers, the tuner, and the collective calls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use oxccl_bootstrap::{Bootstrap, CasOutcome, Store};
use oxccl_verbs::Provider;

use crate::dtype::{as_bytes, as_bytes_mut};
use crate::engine::{AbortFlag, Bufs, CallSpec, Engine, Plan};
use crate::error::{Error, OpDesc, Result};
use crate::flight::{self, CallInfo, Probe, Protocol};
use crate::netif::Chosen;
use crate::schedule::{Algorithm, Collective, Request, build};
use crate::topology::Topology;
use crate::tuner::Tuning;
use crate::{DataType, Element, ReduceOp, log_enabled};

mod compress;
mod group;
mod grow;
mod init;
mod options;
mod pending;
mod rates;
mod register;
mod shrink;
mod work;
mod worker;

pub use compress::{
    AUTO_MIN_BYTES as COMPRESS_AUTO_MIN_BYTES, Compression, DEFAULT_CHUNK as DEFAULT_COMPRESS_CHUNK,
};
pub use group::Group;
pub use options::{Options, PROBE_BYTES, WatchdogAction, default_host_id};
pub use pending::PendingInit;
pub use register::{Registered, Registration};
pub use work::Work;
pub use worker::{CallBuffers, Input, Output};

/// The caller's memory for one collective.
pub enum Buffers<'a> {
    /// Separate input and output (either may be empty where the collective ignores it).
    OutOfPlace {
        /// Input bytes.
        input: &'a [u8],
        /// Output bytes.
        output: &'a mut [u8],
    },
    /// One buffer; input and output lie in it as [`Collective::in_place_offsets`] says.
    InPlace(&'a mut [u8]),
}

/// A call's buffers and arguments, checked ([`Communicator::check_call`]).
struct Checked {
    /// The caller's buffers.
    raw: Bufs,
    /// In place: the input's and the output's element offsets.
    in_place: Option<(usize, usize)>,
    /// Bytes of input and of output.
    in_len: usize,
    out_len: usize,
}

impl Checked {
    /// The call `desc` on these buffers, run as `plan` says, for the engine.
    fn spec<'p>(
        &self,
        plan: &'p Plan,
        desc: OpDesc,
        dtype: DataType,
        op: ReduceOp,
    ) -> CallSpec<'p> {
        CallSpec {
            plan,
            desc,
            dtype,
            op,
            bufs: self.raw,
            in_place: self.in_place,
        }
    }
}

/// A schedule and how it runs, as the tuner chose them for a call's arguments.
#[derive(Clone)]
struct Planned {
    plan: Arc<Plan>,
    algorithm: Algorithm,
    protocol: Protocol,
}

impl Planned {
    /// What the flight recorder is told of call `desc` run so.
    fn info<'a>(&'a self, desc: &'a OpDesc) -> CallInfo<'a> {
        CallInfo {
            desc,
            algorithm: self.algorithm,
            protocol: self.protocol,
            steps: self.plan.sched.steps.len(),
        }
    }
}

/// A call numbered and planned ([`Communicator::prepare`]), ready for the engine.
struct Prepared {
    desc: OpDesc,
    planned: Planned,
}

impl Prepared {
    fn info(&self) -> CallInfo<'_> {
        self.planned.info(&self.desc)
    }
}

struct State {
    engine: Engine,
    seq: u64,
    p2p_seq: HashMap<(usize, bool), u64>,
    poisoned: Option<String>,
    cache: HashMap<(Request, u8), Arc<Plan>>,
    /// The last call's arguments and what the tuner made of them: most calls repeat the one
    /// before, and skip the tuner (cleared when the tuning changes).
    last: Option<Last>,
    logged: std::collections::HashSet<(&'static str, Algorithm, usize)>,
    /// The hosts, their ranks and link rates as this communicator knows them now (detected
    /// or from a file, then probed and learned).
    topology: Topology,
    /// What the tuner knows of this communicator (shares, hosts, forced settings).
    tuning: Tuning,
    /// Learns link rates from what the links deliver (`None`: off, or one host).
    learner: Option<crate::learn::Learner>,
}

/// A call's arguments as the tuner sees them, and its plan ([`State::last`]).
struct Last {
    coll: Collective,
    es: usize,
    in_place: bool,
    planned: Planned,
}

impl State {
    /// Derives the tuner's shares from the topology's rates (after a probe or a round of
    /// learning).
    fn retune(&mut self) {
        self.tuning.weights = self.topology.proportional_weights();
        self.tuning.rail_weights = self.topology.rail_weights();
        self.last = None;
    }
}

struct Inner {
    rank: usize,
    world: usize,
    hosts: Vec<String>,
    /// Each rank's host (an index into the topology's hosts).
    host_of: Vec<usize>,
    providers: Vec<Option<Provider>>,
    /// The address each rank's tcp listener advertises, for the ranks that talk tcp.
    tcp_addrs: Vec<Option<Chosen>>,
    /// Whether the link to each rank is sealed.
    sealed: Vec<bool>,
    opts: Options,
    comm_id: u64,
    state: Mutex<State>,
    abort: Arc<AbortFlag>,
    /// Progress of the running call, for the flight recorder and the watchdog.
    probe: Arc<Probe>,
    /// This process's `oxccl status` service, held while this communicator lives.
    _status: Option<Arc<crate::status::Service>>,
    /// The timeout of later calls, in nanoseconds ([`Communicator::set_timeout`]).
    timeout_ns: AtomicU64,
    bootstrap: Arc<Bootstrap>,
    /// Splits started ([`Communicator::split`]).
    split_seq: AtomicU64,
    /// Shrinks started (the epoch of the next is one more: [`Communicator::shrink`]).
    shrink_seq: AtomicU64,
    /// Grows started ([`Communicator::grow`]).
    grow_seq: AtomicU64,
    /// The job id newcomers join under ([`Communicator::join`]): this communicator's
    /// bootstrap job id, or the one of the communicator it was shrunk or grown from.
    lineage: Mutex<String>,
    /// The options as given to init (before init filled in what it derived), for the
    /// communicators shrunk or grown from this one, which derive them anew.
    given: Options,
    /// Peers that failures named ([`Error::PeerFailed`]), in order, for
    /// [`Communicator::shrink_after_failure`].
    failed_peers: Mutex<Vec<usize>>,
    queue: Mutex<Option<mpsc::Sender<worker::Job>>>,
    pending: (Mutex<usize>, Condvar),
    /// The count in `pending`, read without its lock (a blocking call's fast path).
    queued: std::sync::atomic::AtomicUsize,
    /// Jobs queued and not yet taken by the worker (a session in flight stops to admit them).
    waiting_jobs: std::sync::atomic::AtomicUsize,
    /// Threads waiting for the state lock (a session in flight lets them have it).
    wanting: std::sync::atomic::AtomicUsize,
    /// Jobs queued or running whose calls take their sequence numbers only when the worker
    /// runs them ([`worker`]'s submitted closures, calls run alone, deferred calls): while
    /// there is one, a call started is deferred too, so that numbers follow the order of calls.
    unnumbered: std::sync::atomic::AtomicUsize,
}

/// A group of ranks that run collectives together, like an `ncclComm_t`.
///
/// Calls are collective: every rank calls the same collectives in the same order with matching
/// counts, types, operators and roots; a disagreement is reported as [`Error::Mismatch`] on
/// the ranks that see it (never silently corrupted data). Any error leaves the communicator
/// unusable (later calls return [`Error::Poisoned`]); make a new one.
pub struct Communicator {
    inner: Arc<Inner>,
}

/// Store access through the parent's bootstrap, for sub-communicators.
struct SharedStore(Arc<Bootstrap>);

impl Store for SharedStore {
    fn set(&self, key: &str, value: &[u8]) -> oxccl_bootstrap::Result<()> {
        self.0.store().set(key, value)
    }
    fn multi_get(&self, keys: &[&str], t: Duration) -> oxccl_bootstrap::Result<Vec<Vec<u8>>> {
        self.0.store().multi_get(keys, t)
    }
    fn wait(&self, keys: &[&str], t: Duration) -> oxccl_bootstrap::Result<()> {
        self.0.store().wait(keys, t)
    }
    fn add(&self, key: &str, delta: i64) -> oxccl_bootstrap::Result<i64> {
        self.0.store().add(key, delta)
    }
    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> oxccl_bootstrap::Result<CasOutcome> {
        self.0.store().compare_set(key, expected, desired)
    }
    fn delete(&self, key: &str) -> oxccl_bootstrap::Result<bool> {
        self.0.store().delete(key)
    }
    fn location(&self) -> String {
        self.0.store().location()
    }
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.0.store().local_addr()
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        return std::process::id() as u64
            ^ (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0));
    }
    u64::from_le_bytes(b)
}

impl Communicator {
    /// Connects this rank to its peers: shm queue pairs to ranks on the same host, tcp to the
    /// others (or the provider `options` force). Collective over the bootstrap's ranks.
    /// A rank that never comes fails it within the timeouts, naming the missing ranks; to stop
    /// it sooner from another thread, see [`Communicator::init_async`] and
    /// [`Communicator::init_abortable`].
    pub fn init(bootstrap: Bootstrap, options: Options) -> Result<Communicator> {
        Communicator::init_shared(Arc::new(bootstrap), options)
    }

    /// [`Communicator::init`] from the launcher's environment (`Bootstrap::from_env`) and
    /// [`Options::from_env`].
    pub fn from_env() -> Result<Communicator> {
        let opts = Options::from_env()?;
        Communicator::init(Bootstrap::from_env()?, opts)
    }

    fn init_shared(bootstrap: Arc<Bootstrap>, options: Options) -> Result<Communicator> {
        Communicator::init_inner(&bootstrap, options)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// Host identity of every rank.
    pub fn hosts(&self) -> &[String] {
        &self.inner.hosts
    }

    /// The hosts, their ranks and link rates as the tuner sees them now: detected, or
    /// `OXCCL_TOPO_FILE`; rates from the file, measured at init (`OXCCL_TOPO_PROBE`) and
    /// learned from what the links deliver (`OXCCL_TOPO_LEARN`).
    pub fn topology(&self) -> Topology {
        self.lock().topology.clone()
    }

    /// The address each rank's tcp listener advertises to its peers, with its interface and
    /// why it was chosen (`None` for a rank that reaches no peer over tcp).
    pub fn tcp_addrs(&self) -> &[Option<Chosen>] {
        &self.inner.tcp_addrs
    }

    /// Whether the link to each rank is sealed: its frames encrypted and authenticated
    /// ([`Options::encrypt`], `OXCCL_ENCRYPT`). False for this rank and for links that are
    /// not (shm links never are).
    pub fn encrypted(&self) -> &[bool] {
        &self.inner.sealed[..self.inner.world.min(self.inner.sealed.len())]
    }

    /// The provider used to reach each rank (`None` for this rank).
    pub fn providers(&self) -> &[Option<Provider>] {
        &self.inner.providers
    }

    /// The options in force (channels resolved).
    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    /// What this rank's executor has moved through memory so far, by how: sent through
    /// slots, written in place, copied and reduced out of slots, in local steps
    /// ([`crate::Stats`]). For measuring what registered buffers save, say.
    pub fn stats(&self) -> crate::Stats {
        self.lock().engine.stats
    }

    /// How long each later call may take ([`Options::timeout`] until changed).
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.inner.timeout_ns.load(Ordering::Relaxed))
    }

    /// Changes the timeout of later calls (every rank should use the same; a call that times
    /// out breaks the communicator). [`Communicator::run_timeout`] overrides it for one call.
    pub fn set_timeout(&self, timeout: Duration) {
        let ns = timeout.as_nanos().clamp(1, u64::MAX as u128) as u64;
        self.inner.timeout_ns.store(ns, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        if let Ok(g) = self.inner.state.try_lock() {
            return g;
        }
        // Held (by calls in flight, say): say so while waiting, so that they let go soon.
        self.inner.wanting.fetch_add(1, Ordering::AcqRel);
        let g = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.wanting.fetch_sub(1, Ordering::AcqRel);
        g
    }

    /// Runs one collective on raw bytes of `dtype`: the general entry point the typed calls
    /// use. Buffer lengths must be exactly what [`Collective::input_len`] and
    /// [`Collective::output_len`] say (times the element size), except that a buffer the
    /// collective does not use on this rank may have any length.
    #[inline]
    pub fn run(
        &self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        bufs: Buffers<'_>,
    ) -> Result<()> {
        self.run_timeout(coll, dtype, op, bufs, self.timeout())
    }

    /// [`Communicator::run`] with its own timeout instead of [`Communicator::timeout`].
    #[inline]
    pub fn run_timeout(
        &self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        bufs: Buffers<'_>,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_for_queue();
        let checked = self.check_call(coll, dtype, bufs)?;
        self.run_checked(coll, dtype, op, checked, timeout)
    }

    /// Runs a call whose buffers were checked: numbered, planned, executed under the state
    /// lock, then (a call that meters the links) a round of learning, then an average's
    /// division.
    #[inline]
    fn run_checked(
        &self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        checked: Checked,
        timeout: Duration,
    ) -> Result<()> {
        let Checked {
            raw,
            in_place,
            in_len,
            out_len,
        } = checked;
        let es = dtype.size();
        let mut guard = self.lock();
        let st = &mut *guard;
        let metered = st.learner.is_some()
            && crate::learn::eligible(coll, &st.tuning, es, in_len.max(out_len));
        // (Errors return as they come; success is not passed on: a result is 96 bytes.)
        self.run_locked(st, coll, dtype, op, &raw, in_place, timeout, metered)?;
        if metered {
            self.learn_after_call(st, timeout)?;
        }
        drop(guard);
        self.finish_avg(coll, dtype, op, &raw, in_place, out_len);
        Ok(())
    }

    /// Runs a call numbered and planned already (`p`: started, then run alone by the worker,
    /// a call in mailbox mode), as a blocking call runs.
    fn run_planned(
        &self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        p: &Prepared,
        checked: &Checked,
        timeout: Duration,
    ) -> Result<()> {
        let mut st = self.lock();
        self.check_usable(&st, coll)?;
        let spec = checked.spec(&p.planned.plan, p.desc, dtype, op);
        let r = st.engine.execute(&spec, &p.info(), timeout);
        let r = r.map_err(|e| self.failed(&mut st, e));
        drop(st);
        r?;
        let k = checked;
        self.finish_avg(coll, dtype, op, &k.raw, k.in_place, k.out_len);
        Ok(())
    }

    /// An invalid-argument error about `coll` on this rank.
    fn invalid(&self, coll: &Collective, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.inner.rank,
            msg: format!("{}: {msg}", coll.name()),
        }
    }

    /// Checks a call's buffers and arguments against this communicator: the raw buffers,
    /// the in-place offsets, and the output's length in bytes.
    #[inline]
    fn check_call(&self, coll: &Collective, dtype: DataType, bufs: Buffers<'_>) -> Result<Checked> {
        let (rank, world) = (self.inner.rank, self.inner.world);
        let invalid = |msg: String| self.invalid(coll, msg);
        let es = dtype.size();
        let in_len = coll.input_len(world, rank) * es;
        let out_len = coll.output_len(world, rank) * es;
        let (raw, in_place) = match bufs {
            Buffers::OutOfPlace { input, output } => {
                if in_len > 0 && input.len() != in_len {
                    return Err(invalid(format!(
                        "the input has {} bytes; {} {dtype} elements ({in_len} bytes) expected",
                        input.len(),
                        in_len / es
                    )));
                }
                if out_len > 0 && output.len() != out_len {
                    return Err(invalid(format!(
                        "the output has {} bytes; {} {dtype} elements ({out_len} bytes) expected",
                        output.len(),
                        out_len / es
                    )));
                }
                let (ip, op_) = (input.as_ptr(), output.as_mut_ptr());
                let overlap = in_len > 0
                    && out_len > 0
                    && (ip as usize) < op_ as usize + out_len
                    && (op_ as usize) < ip as usize + in_len;
                if overlap {
                    return Err(invalid(
                        "input and output overlap; use the in-place form".into(),
                    ));
                }
                (
                    Bufs {
                        input: ip,
                        input_len: input.len(),
                        output: op_,
                        output_len: output.len(),
                    },
                    None,
                )
            }
            Buffers::InPlace(buf) => {
                let Some((io, oo)) = coll.in_place_offsets(world, rank) else {
                    return Err(invalid("has no in-place form".into()));
                };
                let need = (io * es + in_len).max(oo * es + out_len);
                if need > 0 && buf.len() != need {
                    return Err(invalid(format!(
                        "the in-place buffer has {} bytes; {need} expected",
                        buf.len()
                    )));
                }
                (
                    Bufs {
                        input: buf.as_ptr(),
                        input_len: buf.len(),
                        output: buf.as_mut_ptr(),
                        output_len: buf.len(),
                    },
                    Some((io, oo)),
                )
            }
        };
        if let Some(root) = coll.root()
            && root >= world
        {
            return Err(invalid(format!(
                "rank {root} is outside a world of {world} ranks"
            )));
        }
        if let Collective::AllToAllV {
            send_counts,
            recv_counts,
        } = coll
            && (send_counts.len() != world || recv_counts.len() != world)
        {
            return Err(invalid(format!(
                "{} send and {} receive counts for {world} ranks",
                send_counts.len(),
                recv_counts.len()
            )));
        }
        Ok(Checked {
            raw,
            in_place,
            in_len,
            out_len,
        })
    }

    /// An average is reduced as a sum: divides the output by the world size.
    #[inline]
    fn finish_avg(
        &self,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        raw: &Bufs,
        in_place: Option<(usize, usize)>,
        out_len: usize,
    ) {
        let world = self.inner.world;
        if op == ReduceOp::Avg && coll.reduces() && out_len > 0 && world > 1 {
            let off = in_place.map_or(0, |(_, oo)| oo * dtype.size());
            // SAFETY: `raw.output` is the caller's output buffer (or the in-place buffer) of
            // `raw.output_len >= off + out_len` bytes, checked by `check_call`, borrowed
            // mutably for this call.
            let out = unsafe { std::slice::from_raw_parts_mut(raw.output.add(off), out_len) };
            crate::reduce::divide(dtype, out, world);
        }
    }

    /// Runs one call on checked buffers under the state lock: its sequence number, its
    /// schedule (cached), the flight recorder, the engine; on failure, tells the peers and
    /// poisons the communicator. `metered`: the links' meters run during it.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn run_locked(
        &self,
        st: &mut State,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        raw: &Bufs,
        in_place: Option<(usize, usize)>,
        timeout: Duration,
        metered: bool,
    ) -> Result<()> {
        self.check_usable(st, coll)?;
        let desc = self.plan_call(st, coll, dtype, op, in_place)?;
        // The plan stays in `st.last` (borrowed beside the engine: no reference count).
        let State { engine, last, .. } = &mut *st;
        let planned = self.planned(last, coll)?;
        let spec = CallSpec {
            plan: &planned.plan,
            desc,
            dtype,
            op,
            bufs: *raw,
            in_place,
        };
        engine.metering = metered;
        let r = engine.execute(&spec, &planned.info(&desc), timeout);
        engine.metering = false;
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self.failed(st, e)),
        }
    }

    /// Fails at once if the communicator can no longer run calls (an earlier call failed, or
    /// it was aborted).
    #[inline]
    fn check_usable(&self, st: &State, coll: &Collective) -> Result<()> {
        let rank = self.inner.rank;
        if let Some(first) = &st.poisoned {
            return Err(Error::Poisoned {
                rank,
                first: first.clone(),
            });
        }
        if self.inner.abort.is_set() {
            return Err(Error::Aborted {
                rank,
                op: coll.name().into(),
                reason: self.inner.abort.reason().into(),
            });
        }
        Ok(())
    }

    /// Numbers a call and finds its schedule (cached per request), logging the choice the
    /// first time (`OXCCL_DEBUG=INFO`).
    fn prepare(
        &self,
        st: &mut State,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        in_place: Option<(usize, usize)>,
    ) -> Result<Prepared> {
        let desc = self.plan_call(st, coll, dtype, op, in_place)?;
        let planned = self.planned(&st.last, coll)?.clone();
        Ok(Prepared { desc, planned })
    }

    /// The plan [`Communicator::plan_call`] left in [`State::last`].
    fn planned<'s>(&self, last: &'s Option<Last>, coll: &Collective) -> Result<&'s Planned> {
        last.as_ref()
            .map(|l| &l.planned)
            .ok_or_else(|| self.invalid(coll, "no plan".into()))
    }

    /// Numbers a call and finds its schedule, which it leaves in [`State::last`] (a call that
    /// repeats the one before finds it there at once).
    #[inline]
    fn plan_call(
        &self,
        st: &mut State,
        coll: &Collective,
        dtype: DataType,
        op: ReduceOp,
        in_place: Option<(usize, usize)>,
    ) -> Result<OpDesc> {
        let rank = self.inner.rank;
        let es = dtype.size();
        let invalid = |msg: String| self.invalid(coll, msg);
        let seq = match coll {
            Collective::Send { peer, .. } | Collective::Recv { peer, .. } => {
                let s = st
                    .p2p_seq
                    .entry((*peer, matches!(coll, Collective::Send { .. })))
                    .or_insert(0);
                *s += 1;
                *s
            }
            _ => {
                st.seq = st.seq.wrapping_add(1);
                st.seq
            }
        };
        let desc = OpDesc {
            seq,
            coll: coll.kind(),
            count: coll.count() as u64,
            dtype,
            op,
            root: coll.root(),
        };
        if let Some(l) = &st.last
            && l.es == es
            && l.in_place == in_place.is_some()
            && l.coll == *coll
        {
            return Ok(desc);
        }
        let req = st
            .tuning
            .request(coll, dtype.size(), rank, in_place.is_some());
        let (algo, chunk, channels) = (req.algo, req.chunk, req.channels);
        let key = (req, es as u8);
        let plan = match st.cache.get(&key) {
            Some(s) => s.clone(),
            None => {
                // (Whether it runs in mailboxes: protocol::mailbox_mode, on first use.)
                let mut p = Plan::new(build(&key.0).map_err(invalid)?, coll.kind(), algo);
                if algo == Algorithm::Aggregation {
                    p.agg = Some((chunk, key.0.hosts.clone()));
                } else {
                    p.req = Some(key.0.clone());
                }
                let s = Arc::new(p);
                if st.cache.len() >= 256 {
                    st.cache.clear();
                }
                st.cache.insert(key, s.clone());
                s
            }
        };
        let protocol = if st.engine.uses_mailbox(&plan, es) {
            Protocol::Mailbox
        } else {
            Protocol::Slots
        };
        if log_enabled() && st.logged.insert((coll.name(), algo, chunk * es)) {
            let compiled = protocol == Protocol::Mailbox && st.engine.program(&plan).is_some();
            crate::log_line(format!(
                "rank {rank}: {} of {} bytes: algorithm {}, protocol {}{}, {} channels, {} KiB chunks, {} steps",
                coll.name(),
                coll.count() * es,
                algo.name(),
                protocol.name(),
                if compiled { " (compiled)" } else { "" },
                channels,
                (chunk * es) >> 10,
                plan.sched.steps.len()
            ));
        }
        st.last = Some(Last {
            coll: coll.clone(),
            es,
            in_place: in_place.is_some(),
            planned: Planned {
                plan,
                algorithm: algo,
                protocol,
            },
        });
        Ok(desc)
    }

    /// After a call failed: tells the peers what they need to know, poisons the
    /// communicator, logs and dumps the flight recorder; returns the error.
    fn failed(&self, st: &mut State, e: Error) -> Error {
        let (rank, world) = (self.inner.rank, self.inner.world);
        match &e {
            Error::Aborted { .. } if self.inner.abort.is_set() => st.engine.notify_abort(),
            // Pass a failure on, unless it was passed to us.
            // The aggregation service (peer `world`): every rank finds that out itself.
            Error::PeerFailed {
                peer, op, detail, ..
            } if *peer == world => {
                let addr = st
                    .engine
                    .agg
                    .as_ref()
                    .map_or_else(String::new, |a| a.addr().to_string());
                let e = Error::AggregatorFailed {
                    rank,
                    op: op.clone(),
                    addr,
                    detail: detail.replace(&format!("rank {world} "), "the service "),
                };
                return self.failed_poisoned(st, e);
            }
            Error::PeerFailed { peer, .. } if *peer < world => {
                self.record_failed_peer(*peer);
                if st.engine.failed_by_notice {
                    st.engine.remember_failure(*peer)
                } else {
                    st.engine.notify_failure(*peer)
                }
            }
            // This rank's own call failed: tell the peers, which would otherwise wait.
            Error::Verbs { .. } | Error::InvalidArgument { .. } => st.engine.notify_failure(rank),
            Error::Timeout { .. } => st.engine.request_dumps(),
            _ => {}
        }
        self.failed_poisoned(st, e)
    }

    /// The end of [`Communicator::failed`]: poisons, logs, dumps.
    fn failed_poisoned(&self, st: &mut State, e: Error) -> Error {
        st.poisoned = Some(e.to_string());
        // Before the caller sees the error: no peer writes its registered buffers after it.
        st.engine.registry.revoke();
        crate::log_warn(e.to_string());
        flight::dump_on_error(&self.inner.probe, &e);
        e
    }

    #[inline]
    fn typed<T: Element>(
        &self,
        coll: Collective,
        op: ReduceOp,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        self.run(
            &coll,
            T::DTYPE,
            op,
            Buffers::OutOfPlace {
                input: as_bytes(input),
                output: as_bytes_mut(output),
            },
        )
    }

    fn typed_in_place<T: Element>(
        &self,
        coll: Collective,
        op: ReduceOp,
        buf: &mut [T],
    ) -> Result<()> {
        self.run(&coll, T::DTYPE, op, Buffers::InPlace(as_bytes_mut(buf)))
    }

    /// `output[i] = op over ranks of input[i]`, on every rank.
    ///
    /// With [`Options::compress`] set, an `f32`/`f16`/`bf16` sum or average goes compressed
    /// ([`Communicator::all_reduce_compressed`]): the same bits on every rank, within the
    /// compression's error bound of the exact sum.
    pub fn all_reduce<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if let Some(fmt) = self.compressed_format::<T>(input.len(), op) {
            return self.all_reduce_compressed_as(Some(input), output, op, fmt);
        }
        self.typed(
            Collective::AllReduce { count: input.len() },
            op,
            input,
            output,
        )
    }

    /// [`Communicator::all_reduce`] in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if let Some(fmt) = self.compressed_format::<T>(buf.len(), op) {
            return self.all_reduce_compressed_as(None, buf, op, fmt);
        }
        self.typed_in_place(Collective::AllReduce { count: buf.len() }, op, buf)
    }

    /// Rank `r` gets block `r` (of `output.len()` elements) of the reduction of every rank's
    /// `input` (`world · output.len()` elements).
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.typed(
            Collective::ReduceScatter {
                count: output.len(),
            },
            op,
            input,
            output,
        )
    }

    /// [`Communicator::reduce_scatter`] in place: the result is block `rank` of `buf`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let count = buf.len() / self.inner.world.max(1);
        self.typed_in_place(Collective::ReduceScatter { count }, op, buf)
    }

    /// Every rank's `input` lands in block `r` of every rank's `output`.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.typed(
            Collective::AllGather { count: input.len() },
            ReduceOp::Sum,
            input,
            output,
        )
    }

    /// [`Communicator::all_gather`] in place: this rank's contribution is block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let count = buf.len() / self.inner.world.max(1);
        self.typed_in_place(Collective::AllGather { count }, ReduceOp::Sum, buf)
    }

    /// `root`'s `input` lands in every rank's `output` (other ranks' `input` is ignored and
    /// may be empty).
    pub fn broadcast<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let count = output.len();
        self.typed(
            Collective::Broadcast { count, root },
            ReduceOp::Sum,
            input,
            output,
        )
    }

    /// [`Communicator::broadcast`] in place: `root`'s `buf` is copied to everyone's.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.typed_in_place(
            Collective::Broadcast {
                count: buf.len(),
                root,
            },
            ReduceOp::Sum,
            buf,
        )
    }

    /// The reduction of every rank's `input` lands in `root`'s `output` (other ranks' `output`
    /// is ignored and may be empty).
    pub fn reduce<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.typed(
            Collective::Reduce {
                count: input.len(),
                root,
            },
            op,
            input,
            output,
        )
    }

    /// [`Communicator::reduce`] in place.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.typed_in_place(
            Collective::Reduce {
                count: buf.len(),
                root,
            },
            op,
            buf,
        )
    }

    /// Block `j` of this rank's `input` goes to rank `j`; block `i` of `output` comes from
    /// rank `i` (both `world · count` elements).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let count = input.len() / self.inner.world.max(1);
        self.typed(Collective::AllToAll { count }, ReduceOp::Sum, input, output)
    }

    /// [`Communicator::all_to_all`] in place.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let count = buf.len() / self.inner.world.max(1);
        self.typed_in_place(Collective::AllToAll { count }, ReduceOp::Sum, buf)
    }

    /// All-to-all with per-peer counts: `send_counts[j]` elements (packed in rank order in
    /// `input`) go to rank `j`; `recv_counts[i]` arrive from rank `i`, packed in `output`.
    pub fn all_to_allv<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let coll = Collective::AllToAllV {
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
        };
        self.typed(coll, ReduceOp::Sum, input, output)
    }

    /// Every rank's `input` lands in block `r` of `root`'s `output`.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.typed(
            Collective::Gather {
                count: input.len(),
                root,
            },
            ReduceOp::Sum,
            input,
            output,
        )
    }

    /// Block `r` of `root`'s `input` lands in rank `r`'s `output`.
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.typed(
            Collective::Scatter {
                count: output.len(),
                root,
            },
            ReduceOp::Sum,
            input,
            output,
        )
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.run(
            &Collective::Barrier,
            DataType::U8,
            ReduceOp::Sum,
            Buffers::OutOfPlace {
                input: &[],
                output: &mut [],
            },
        )
    }

    /// Sends `buf` to `peer`, which must call [`Communicator::recv`] with the same count.
    /// Sends to one peer are received in order.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.typed(
            Collective::Send {
                count: buf.len(),
                peer,
            },
            ReduceOp::Sum,
            buf,
            &mut [],
        )
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.typed(
            Collective::Recv {
                count: buf.len(),
                peer,
            },
            ReduceOp::Sum,
            &[],
            buf,
        )
    }

    /// Stops this communicator: a collective running on another thread returns
    /// [`Error::Aborted`] within about 50 ms, every peer it can reach is told (their pending
    /// and later calls fail the same way), and later calls here fail at once.
    pub fn abort(&self) {
        self.inner.abort.set("Communicator::abort was called");
        // If no collective is running, tell the peers now; otherwise the running one does as
        // it stops (and dumps the flight recorder).
        if let Ok(mut st) = self.inner.state.try_lock() {
            st.engine.notify_abort();
            let first = st.poisoned.is_none();
            st.poisoned.get_or_insert_with(|| "aborted".into());
            drop(st);
            if first {
                flight::dump_on_error(
                    &self.inner.probe,
                    &Error::Aborted {
                        rank: self.inner.rank,
                        op: "no call".into(),
                        reason: "Communicator::abort was called".into(),
                    },
                );
            }
        }
    }

    /// Splits into sub-communicators of the ranks that pass the same `color`, ordered by
    /// `key` then rank (like `MPI_Comm_split`); `None` opts out and returns `None`.
    /// Collective over this communicator.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1i64, i64::from), i64::from(key)];
        let mut all = vec![0i64; 2 * self.inner.world];
        self.all_gather(&mine, &mut all)?;
        let seq = self.inner.split_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = (0..self.inner.world)
            .filter(|&r| all[2 * r] == i64::from(color))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.inner.rank)
            .unwrap();
        let store = Box::new(SharedStore(self.inner.bootstrap.clone()));
        let job = format!("{:016x}/split{seq}/color{color}", self.inner.comm_id);
        let boot = Bootstrap::with_store(
            new_rank,
            members.len(),
            store,
            &job,
            self.inner.opts.timeout,
        )?;
        let mut opts = self.inner.opts.clone();
        opts.host_id = Some(self.inner.hosts[self.inner.rank].clone());
        // The child's store handle holds the parent's bootstrap, so the store outlives both.
        Communicator::init_shared(Arc::new(boot), opts).map(Some)
    }

    /// Waits for every rank (a barrier), then releases this communicator. Rank 0, when it
    /// serves the bootstrap store, also waits for the others to disconnect from it.
    pub fn destroy(self) -> Result<()> {
        // A communicator that failed cannot run a barrier; it still waits for the others to
        // leave the store below.
        let poisoned = self.lock().poisoned.is_some();
        let barrier = if poisoned { Ok(()) } else { self.barrier() };
        let inner = match Arc::try_unwrap(self.inner) {
            Ok(i) => i,
            Err(_) => return barrier,
        };
        let boot = inner.bootstrap;
        drop(inner.state);
        // The status service's connection counts as a client of rank 0's store.
        drop(inner._status);
        if let Ok(b) = Arc::try_unwrap(boot) {
            b.close()?;
        }
        barrier
    }
}

/// The watchdog: polls the running call's start time; one that runs past `limit` gets the
/// flight recorder dumped and the communicator aborted (and, with [`WatchdogAction::Exit`],
/// the process ended). It stops when the communicator is dropped.
fn spawn_watchdog(inner: Weak<Inner>, action: WatchdogAction, limit: Duration) {
    let tick = (limit / 4).clamp(Duration::from_millis(10), Duration::from_millis(100));
    let spawned = std::thread::Builder::new()
        .name("oxccl-watchdog".into())
        .spawn(move || {
            loop {
                std::thread::sleep(tick);
                let Some(inner) = inner.upgrade() else { break };
                let started = inner.probe.started_ns.load(Ordering::Relaxed);
                let ran = Duration::from_nanos(flight::now_ns().saturating_sub(started));
                if started == 0 || ran <= limit || inner.abort.is_set() {
                    continue;
                }
                let seq = inner.probe.last_started.load(Ordering::Relaxed);
                let why = format!(
                    "the watchdog stopped it: rank {}'s call (the last collective started is \
                     #{seq}) ran for {ran:.1?}, more than OXCCL_WATCHDOG_TIMEOUT={limit:?}",
                    inner.rank
                );
                crate::log_warn(why.clone());
                flight::dump("watchdog", &why, Some(&inner.probe));
                inner.probe.dumped.store(true, Ordering::Relaxed);
                inner.abort.set(&why);
                if action == WatchdogAction::Exit {
                    // Let the call return and tell the peers (it polls every 50 ms at most).
                    let end = std::time::Instant::now() + Duration::from_secs(1);
                    while inner.probe.started_ns.load(Ordering::Relaxed) == started
                        && std::time::Instant::now() < end
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    crate::log_warn(format!(
                        "rank {}: OXCCL_WATCHDOG=exit: ending the process",
                        inner.rank
                    ));
                    std::process::abort();
                }
            }
        });
    if let Err(e) = spawned {
        crate::log_warn(format!("cannot start the oxccl watchdog thread: {e}"));
    }
}
