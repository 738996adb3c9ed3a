//! The aggregation service: admits jobs, connects to their members, and runs each job's
//! aggregation calls through the executor, one thread per job.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxccl_bootstrap::Secret;
use oxccl_verbs::{ConnectRole, Context, DeviceConfig, Provider, QpConfig, RemoteBuffer};

use super::wire::{self, CallDesc, Join, LABELS, MAGIC, Msg};
use crate::engine::{AbortFlag, Bufs, CallSpec, Engine, Link, Plan};
use crate::error::{Error, OpDesc};
use crate::flight::Probe;
use crate::schedule::{Algorithm, Collective, CollectiveKind, Request, build_aggregator};
use crate::{DataType, ReduceOp};

/// How long a connection may take to say who it is.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections not yet admitted, at most: more are closed at once.
const MAX_UNADMITTED: usize = 256;
/// How often an idle job looks at its members' connections.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How long a dropped service waits for its jobs to end.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// How a [`Service`] runs.
#[derive(Clone, Debug)]
pub struct ServiceOptions {
    /// Where it listens for members (port 0: any free port; see [`Service::addr`]). Its
    /// queue pairs listen on the same address's IP.
    pub listen: SocketAddr,
    /// The secrets of the jobs it serves: a member proves one of them, and the members of a
    /// job are those that proved the same secret with the same communicator id.
    pub secrets: Vec<Secret>,
    /// Bytes of aggregation slots in all (`--pool`, default 256 MiB): each admitted job gets
    /// an equal share, `pool_bytes / max_jobs`, in slots of its chunk size (at least 2).
    pub pool_bytes: usize,
    /// Jobs served at once (`--max-jobs`, default 4): a job beyond them is told the service
    /// is busy, and runs its other algorithms.
    pub max_jobs: usize,
    /// This host's identity: members with the same `OXCCL_HOST_ID` (by default the boot id)
    /// talk shm to the service, the others tcp.
    pub host_id: String,
    /// The providers' settings.
    pub device: DeviceConfig,
    /// Logs jobs as they join and end, on stderr.
    pub verbose: bool,
}

impl ServiceOptions {
    /// Defaults for a service on `listen` serving jobs with `secrets`.
    pub fn new(listen: SocketAddr, secrets: Vec<Secret>) -> ServiceOptions {
        ServiceOptions {
            listen,
            secrets,
            pool_bytes: 256 << 20,
            max_jobs: 4,
            host_id: crate::default_host_id(),
            device: DeviceConfig::default(),
            verbose: false,
        }
    }
}

/// What a service has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// Jobs admitted.
    pub jobs: u64,
    /// Jobs running now.
    pub running: usize,
    /// Aggregation calls completed.
    pub calls: u64,
    /// Bytes the service summed (each member's contribution to each call).
    pub bytes_in: u64,
}

/// A running aggregation service; stops when dropped: it admits no more members, and its
/// running jobs end (each at its next idle moment; the drop waits up to 5 s for them), which
/// their ranks see as the service's failure.
pub struct Service {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    opts: ServiceOptions,
    stop: AtomicBool,
    pending: Mutex<HashMap<(usize, u64), Pending>>,
    joined: Condvar,
    unadmitted: AtomicUsize,
    running: AtomicUsize,
    jobs: AtomicU64,
    calls: AtomicU64,
    bytes_in: AtomicU64,
}

/// A member that proved its secret, waiting for the rest of its job.
struct Member {
    stream: TcpStream,
    join: Box<Join>,
    /// The service's challenge to it.
    nonce: [u8; 32],
    /// The secret it proved (an index into [`ServiceOptions::secrets`]).
    tenant: usize,
}

/// A job some of whose members have joined (removed from [`Shared::pending`] once taken:
/// admitted or refused).
struct Pending {
    members: Vec<Option<Member>>,
}

impl Service {
    /// Binds `opts.listen` and starts serving.
    pub fn start(opts: ServiceOptions) -> crate::Result<Service> {
        if opts.secrets.is_empty() {
            return Err(Error::Config(
                "an aggregation service needs the secret of at least one job (OXCCL_SECRET, \
                 OXCCL_SECRET_FILE or --secret-file)"
                    .into(),
            ));
        }
        if opts.max_jobs == 0 {
            return Err(Error::Config("max_jobs must be ≥ 1".into()));
        }
        let listener = TcpListener::bind(opts.listen).map_err(|e| {
            Error::Config(format!(
                "the aggregation service cannot listen on {}: {e}",
                opts.listen
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Config(format!("the aggregation service's address: {e}")))?;
        let shared = Arc::new(Shared {
            opts,
            stop: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            joined: Condvar::new(),
            unadmitted: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            jobs: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("oxccl-agg".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| Error::Config(format!("cannot start the service's thread: {e}")))?;
        Ok(Service {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    /// The address members reach it at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it has done so far.
    pub fn stats(&self) -> ServiceStats {
        let s = &self.shared;
        ServiceStats {
            jobs: s.jobs.load(Ordering::Relaxed),
            running: s.running.load(Ordering::Relaxed),
            calls: s.calls.load(Ordering::Relaxed),
            bytes_in: s.bytes_in.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let t = Instant::now();
        while self.shared.running.load(Ordering::Acquire) > 0 && t.elapsed() < STOP_WAIT {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        if shared.unadmitted.fetch_add(1, Ordering::AcqRel) >= MAX_UNADMITTED {
            shared.unadmitted.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("oxccl-agg-join".into())
            .spawn(move || {
                admit(stream, &s);
                s.unadmitted.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            shared.unadmitted.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn refuse(stream: &mut TcpStream, reason: String, busy: bool) {
    let _ = wire::send(stream, &Msg::Refused { reason, busy });
}

/// One connection: hello, the member's proof, then its job.
fn admit(mut stream: TcpStream, shared: &Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(AUTH_TIMEOUT));
    let Ok(ns) = wire::nonce() else { return };
    let hello = Msg::Hello {
        magic: MAGIC.into(),
        host: shared.opts.host_id.clone(),
        nonce: ns,
    };
    if wire::send(&mut stream, &hello).is_err() {
        return;
    }
    let join = match wire::recv(&mut stream) {
        Ok(Msg::Join(j)) => j,
        _ => return,
    };
    let (secrets, claims) = (&shared.opts.secrets, join.claims());
    let tenant = LABELS.client_secret(secrets, &ns, &join.nonce, &claims, &join.proof);
    let Some(tenant) = tenant else {
        refuse(
            &mut stream,
            "the job's secret was not proven: this service does not serve the job (a \
             stranger, or the service was given another OXCCL_SECRET)"
                .into(),
            false,
        );
        return;
    };
    if join.world == 0 || join.rank >= join.world || join.world > 1 << 16 {
        refuse(
            &mut stream,
            format!("rank {} of world {} is not a member", join.rank, join.world),
            false,
        );
        return;
    }
    let timeout = Duration::from_millis(join.timeout_ms).min(Duration::from_secs(3600));
    let key = (tenant, join.job);
    let (rank, world) = (join.rank, join.world);
    let member = Member {
        stream,
        join,
        nonce: ns,
        tenant,
    };
    let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
    let entry = pending.entry(key).or_insert_with(|| Pending {
        members: (0..world).map(|_| None).collect(),
    });
    let mut member = member;
    if let Some(why) = mismatch(entry, &member.join) {
        drop(pending);
        refuse(&mut member.stream, why, false);
        return;
    }
    entry.members[rank] = Some(member);
    if entry.members.iter().all(Option::is_some) {
        let Some(job) = pending.remove(&key) else {
            return;
        };
        shared.joined.notify_all();
        drop(pending);
        let members = job.members.into_iter().flatten().collect();
        start_job(members, shared);
        return;
    }
    // Wait for the others; the last to come starts the job.
    let deadline = Instant::now() + timeout;
    loop {
        let now = Instant::now();
        if !pending.contains_key(&key) {
            return;
        }
        if now >= deadline {
            let Some(job) = pending.remove(&key) else {
                return;
            };
            drop(pending);
            let present: Vec<usize> = (0..world).filter(|&r| job.members[r].is_some()).collect();
            for mut m in job.members.into_iter().flatten() {
                refuse(
                    &mut m.stream,
                    format!(
                        "only ranks {present:?} of the job's {world} joined within {timeout:?}"
                    ),
                    false,
                );
            }
            return;
        }
        pending = shared
            .joined
            .wait_timeout(pending, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Why `join` cannot be part of the job `p` (another world size or slot geometry, a rank
/// taken), if so.
fn mismatch(p: &Pending, join: &Join) -> Option<String> {
    if p.members.len() != join.world {
        return Some(format!(
            "rank {} says the job has {} ranks, another member says {}",
            join.rank,
            join.world,
            p.members.len()
        ));
    }
    if p.members[join.rank].is_some() {
        return Some(format!("rank {} joined twice", join.rank));
    }
    let other = p.members.iter().flatten().next()?;
    (other.join.geo != join.geo).then(|| {
        format!(
            "rank {} has slots {:?}, rank {} {:?}: set OXCCL_CHUNK_SIZE/OXCCL_SLOTS/\
             OXCCL_NCHANNELS alike",
            join.rank, join.geo, other.join.rank, other.join.geo
        )
    })
}

/// Every member has joined: admits the job if there is room, connects to every member, and
/// runs it on a thread of its own.
fn start_job(mut members: Vec<Member>, shared: &Arc<Shared>) {
    members.sort_by_key(|m| m.join.rank);
    let opts = &shared.opts;
    let running = shared.running.fetch_add(1, Ordering::AcqRel);
    if running >= opts.max_jobs {
        shared.running.fetch_sub(1, Ordering::AcqRel);
        for m in &mut members {
            refuse(
                &mut m.stream,
                format!(
                    "it serves {} jobs, its most (--max-jobs {})",
                    running, opts.max_jobs
                ),
                true,
            );
        }
        return;
    }
    let job = members[0].join.job;
    match connect_job(&mut members, opts) {
        Ok((engine, pool)) => {
            shared.jobs.fetch_add(1, Ordering::Relaxed);
            if opts.verbose {
                eprintln!(
                    "oxccl agg: job {job:016x} of {} ranks ({}) joined: {pool} slots of {} KiB",
                    members.len(),
                    members[0].join.provider,
                    engine.geo.slot_data >> 10
                );
            }
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("oxccl-agg-{job:x}"))
                .spawn(move || {
                    let r = run_job(engine, members, pool, &s);
                    s.running.fetch_sub(1, Ordering::AcqRel);
                    if s.opts.verbose {
                        match r {
                            Ok(calls) => {
                                eprintln!("oxccl agg: job {job:016x} ended after {calls} calls")
                            }
                            Err(e) => eprintln!("oxccl agg: job {job:016x} failed: {e}"),
                        }
                    }
                });
            if spawned.is_err() {
                shared.running.fetch_sub(1, Ordering::AcqRel);
            }
        }
        Err(why) => {
            shared.running.fetch_sub(1, Ordering::AcqRel);
            if opts.verbose {
                eprintln!("oxccl agg: job {job:016x} could not be connected: {why}");
            }
            for m in &mut members {
                refuse(&mut m.stream, why.clone(), false);
            }
        }
    }
}

/// Opens the job's provider contexts, a queue pair and slots per member, answers every member
/// with its side, and connects. Returns the job's engine and its slots.
fn connect_job(members: &mut [Member], opts: &ServiceOptions) -> Result<(Engine, usize), String> {
    let n = members.len();
    let geo = members[0].join.geo;
    let providers: Vec<Provider> = members
        .iter()
        .map(|m| match m.join.provider.as_str() {
            "shm" => Ok(Provider::Shm),
            "tcp" => Ok(Provider::Tcp),
            p => Err(format!(
                "rank {} asks for provider {p:?}; the service speaks shm and tcp",
                m.join.rank
            )),
        })
        .collect::<Result<_, _>>()?;
    let kinds: Vec<Provider> = [Provider::Shm, Provider::Tcp]
        .into_iter()
        .filter(|k| providers.contains(k))
        .collect();
    let (mut pds, mut cqs, mut ctxs) = (Vec::new(), Vec::new(), Vec::new());
    for k in &kinds {
        let mut config = opts.device.clone();
        if *k == Provider::Tcp {
            // The address the members reached us at, so that they can reach our queue pairs.
            let ip = members
                .iter()
                .zip(&providers)
                .find(|(_, p)| **p == Provider::Tcp)
                .and_then(|(m, _)| m.stream.local_addr().ok())
                .map_or(opts.listen.ip(), |a| a.ip());
            config.tcp_addr = SocketAddr::new(ip, 0);
        }
        let ctx = Context::open_with(*k, &config)
            .map_err(|e| format!("cannot open the {} provider: {e}", k.name()))?;
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let peers = providers.iter().filter(|p| *p == k).count();
        let cq = ctx
            .create_cq(peers * (geo.send_depth() + geo.recv_depth()) as usize + 64)
            .map_err(|e| e.to_string())?;
        ctxs.push(ctx);
        pds.push(pd);
        cqs.push(cq);
    }
    let timeout = Duration::from_millis(members[0].join.timeout_ms);
    let mut links = Vec::with_capacity(n);
    for (r, m) in members.iter().enumerate() {
        let c = kinds.iter().position(|k| *k == providers[r]).unwrap_or(0);
        let cfg = QpConfig {
            max_send_wr: geo.send_depth(),
            max_recv_wr: geo.recv_depth(),
            max_sge: 2,
            rnr_retry: 7,
            timeout: timeout.max(Duration::from_secs(10)),
            // The member connects (it knows our address; we need not reach it).
            connect: ConnectRole::Passive,
            ..QpConfig::default()
        };
        let qp = pds[c]
            .create_qp(&cqs[c], &cqs[c], &cfg)
            .map_err(|e| format!("a queue pair for rank {}: {e}", m.join.rank))?;
        links.push(
            Link::new(r, providers[r], c, &pds[c], qp, &geo)
                .map_err(|e| format!("slots for rank {}: {e}", m.join.rank))?,
        );
    }
    let share = opts.pool_bytes / opts.max_jobs;
    let pool = (share / geo.slot_data.max(1)).max(2);
    for (r, m) in members.iter_mut().enumerate() {
        let proof = LABELS
            .server_proof(&opts.secrets[m.tenant], &m.nonce, &m.join.nonce)
            .to_vec();
        let accept = Msg::Accept {
            proof,
            endpoint: links[r].qp.endpoint(),
            region: links[r].local_region(),
            pool,
        };
        wire::send(&mut m.stream, &accept)
            .map_err(|e| format!("cannot answer rank {}: {e}", m.join.rank))?;
    }
    for (r, m) in members.iter().enumerate() {
        links[r]
            .qp
            .connect(&m.join.endpoint)
            .map_err(|e| format!("connecting rank {}: {e}", m.join.rank))?;
        let region: RemoteBuffer = m.join.region;
        links[r]
            .connect(region, &geo, r)
            .map_err(|e| format!("posting receives for rank {}: {e}", m.join.rank))?;
    }
    drop(ctxs);
    let mut link_of: Vec<usize> = (0..n).collect();
    link_of.push(usize::MAX);
    let probe = Probe::new(members[0].join.job, n, n + 1);
    let mut engine = Engine::new(
        n,
        geo,
        links,
        link_of,
        pds,
        cqs,
        Arc::new(AbortFlag::default()),
        probe,
    );
    engine.mailbox_allowed = false;
    Ok((engine, pool))
}

/// Runs the job's calls as rank 0 names them, until every member has left or a call fails.
/// Returns the calls run.
fn run_job(
    mut engine: Engine,
    mut members: Vec<Member>,
    pool: usize,
    shared: &Shared,
) -> Result<u64, String> {
    let n = members.len();
    let timeout = Duration::from_millis(members[0].join.timeout_ms);
    let mut plans: HashMap<PlanKey, Plan> = HashMap::new();
    let mut calls = 0u64;
    let _ = members[0].stream.set_read_timeout(Some(IDLE_TICK));
    for m in &members[1..] {
        let _ = m.stream.set_nonblocking(true);
    }
    let mut left = vec![false; n];
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return Ok(calls);
        }
        let named = match wire::recv(&mut members[0].stream) {
            Ok(Msg::Calls { calls }) if !calls.is_empty() => calls,
            Ok(m) => return Err(format!("rank 0 sent {m:?} where calls belong")),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // Idle: has everyone left?
                for (r, m) in members.iter().enumerate().skip(1) {
                    left[r] |= closed(&m.stream);
                }
                if members.len() > 1 && left[1..].iter().all(|&l| l) {
                    // The others are gone; rank 0 will see its connection close.
                    return Ok(calls);
                }
                continue;
            }
            // Rank 0 left (its communicator closed, or it died: the others then see their
            // own connections to it fail).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(calls);
            }
            Err(e) => return Err(format!("rank 0's control connection: {e}")),
        };
        // The calls rank 0 named together run together (a group), as on the ranks.
        let mut keyed = Vec::with_capacity(named.len());
        for c in &named {
            let (key, desc) = plan_key(c, n)?;
            if !plans.contains_key(&key) {
                let sched = build_aggregator(&key.request(n), pool)?;
                if plans.len() >= 64 {
                    plans.clear();
                }
                plans.insert(
                    key.clone(),
                    Plan::new(sched, CollectiveKind::AllReduce, Algorithm::Aggregation),
                );
            }
            keyed.push((key, desc));
        }
        let specs: Vec<CallSpec<'_>> = keyed
            .iter()
            .map(|(key, desc)| CallSpec {
                plan: &plans[key],
                desc: *desc,
                dtype: desc.dtype,
                op: desc.op,
                bufs: Bufs::EMPTY,
                in_place: None,
            })
            .collect();
        // The last member may start its call up to a timeout after rank 0.
        if let Err(e) = engine.execute_group(&specs, timeout * 2) {
            tell_members(&mut engine, &e, n);
            return Err(e.to_string());
        }
        calls += specs.len() as u64;
        shared
            .calls
            .fetch_add(specs.len() as u64, Ordering::Relaxed);
        let bytes: usize = keyed.iter().map(|(k, _)| k.bytes_in(n)).sum();
        shared.bytes_in.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// What an aggregator's schedule depends on: count, chunk, element size, host table.
#[derive(Clone, PartialEq, Eq, Hash)]
struct PlanKey {
    count: usize,
    chunk: usize,
    es: usize,
    hosts: Vec<u32>,
}

impl PlanKey {
    /// The aggregator's request for a job of `n` ranks.
    fn request(&self, n: usize) -> Request {
        Request {
            coll: Collective::AllReduce { count: self.count },
            world: n,
            rank: n,
            in_place: false,
            algo: Algorithm::Aggregation,
            chunk: self.chunk,
            channels: 1,
            weights: Vec::new(),
            hosts: self.hosts.clone(),
        }
    }

    /// Bytes the service receives: every member's buffer; in two tiers, every host's (its
    /// rails').
    fn bytes_in(&self, n: usize) -> usize {
        let senders = if self.hosts.is_empty() {
            n
        } else {
            let mut d = self.hosts.clone();
            d.sort_unstable();
            d.dedup();
            d.len()
        };
        self.count * self.es * senders
    }
}

/// A named call's plan key and fingerprint, checked.
fn plan_key(c: &CallDesc, n: usize) -> Result<(PlanKey, OpDesc), String> {
    let (Some(&dtype), Some(&op)) = (
        DataType::ALL.get(c.dtype as usize),
        ReduceOp::ALL.get(c.op as usize),
    ) else {
        return Err(format!(
            "rank 0 named a call with data type {} and op {}",
            c.dtype, c.op
        ));
    };
    if !c.hosts.is_empty() && c.hosts.len() != n {
        return Err(format!(
            "rank 0 named a call with {} hosts for {n} ranks",
            c.hosts.len()
        ));
    }
    let count = usize::try_from(c.count).map_err(|_| format!("count {}", c.count))?;
    let key = PlanKey {
        count,
        chunk: (c.chunk as usize).max(1),
        es: dtype.size(),
        hosts: c.hosts.clone(),
    };
    let desc = OpDesc {
        seq: c.seq,
        coll: CollectiveKind::AllReduce,
        count: c.count,
        dtype,
        op,
        root: None,
    };
    Ok((key, desc))
}

/// A failed call: tells every member whom to blame.
fn tell_members(engine: &mut Engine, e: &Error, n: usize) {
    match e {
        // A member failed: the others hear it was that rank.
        Error::PeerFailed { peer, .. } if *peer < n => engine.notify_failure(*peer),
        // The executor told every member already, naming the call; an abort reached every
        // member from the rank that aborted.
        Error::Mismatch { .. } | Error::Aborted { .. } => {}
        // The service's own call failed (a mismatch it found, a timeout): every member hears
        // that the service failed.
        _ => engine.notify_failure(n),
    }
}

/// Whether a non-blocking control connection was closed by its member.
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}
