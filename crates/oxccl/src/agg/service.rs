//! The aggregation service: admits jobs, connects to their members, and runs each job's
//! aggregation calls through the executor, one thread per job.

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxccl_bootstrap::Secret;
use oxccl_seal::{Role, SealedStream};
use oxccl_verbs::{
    ConnectRole, Context, DeviceConfig, Provider, QpConfig, QpEndpoint, RemoteBuffer,
};

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
    /// Most ranks in one job (`--max-members`, default 4096): a member that says its job has
    /// more is refused, and told this cap.
    pub max_members: usize,
    /// Jobs of one secret waiting for their members at once (`--max-pending`, default 4): the
    /// first member of one more is refused, and told this cap. (Each waiting member holds a
    /// connection and a thread of the service until its job is complete.)
    pub max_pending: usize,
    /// Longest a job's members wait for each other at the service (default 1 hour): a member
    /// that asks for longer waits this long.
    pub max_join_wait: Duration,
    /// Most steps (slices times members) in the schedule of one named call, and in all the
    /// schedules the service keeps for a job (default 8 Mi, a few hundred MiB): a call over it
    /// fails the job with an error naming this cap.
    pub max_call_steps: usize,
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
            max_members: 4096,
            max_pending: 4,
            max_join_wait: Duration::from_secs(3600),
            max_call_steps: 8 << 20,
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
    /// Members' tcp data links that were sealed (`OXCCL_ENCRYPT`, as each member's join said).
    pub sealed_links: u64,
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
    sealed_links: AtomicU64,
    /// The last jobs' failures ([`Service::failures`]).
    failures: Mutex<std::collections::VecDeque<String>>,
}

/// Failures a service keeps for [`Service::failures`].
const FAILURES_KEPT: usize = 16;

impl Shared {
    fn failed(&self, what: String) {
        if self.opts.verbose {
            eprintln!("oxccl agg: {what}");
        }
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() == FAILURES_KEPT {
            f.pop_front();
        }
        f.push_back(what);
    }
}

/// A member that proved its secret, waiting for the rest of its job.
struct Member {
    /// Its control connection: sealed records after the join ([`wire::session`]); the accept
    /// or a refusal goes in clear underneath (`get_mut`).
    stream: SealedStream<TcpStream>,
    join: Box<Join>,
    /// Its queue pair's endpoint and its receive region (they came sealed).
    endpoint: QpEndpoint,
    region: RemoteBuffer,
    /// Whether its tcp queue pair seals its frames: ours to it then does too.
    sealed: bool,
    /// The service's challenge to it.
    nonce: [u8; 32],
    /// The secret it proved (an index into [`ServiceOptions::secrets`]).
    tenant: usize,
}

/// A job some of whose members have joined (removed from [`Shared::pending`] once taken:
/// admitted or refused).
struct Pending {
    /// Its ranks, as its first member said.
    world: usize,
    /// The members there, by rank (only those that came: a job's size costs nothing until
    /// its members come).
    members: BTreeMap<usize, Member>,
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
        for (name, v) in [
            ("max_jobs", opts.max_jobs),
            ("max_members", opts.max_members),
            ("max_pending", opts.max_pending),
            ("max_call_steps", opts.max_call_steps),
        ] {
            if v == 0 {
                return Err(Error::Config(format!(
                    "the aggregation service's {name} must be ≥ 1"
                )));
            }
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
            sealed_links: AtomicU64::new(0),
            failures: Mutex::new(std::collections::VecDeque::new()),
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

    /// How the last jobs that failed failed (at most 16, oldest first), each naming the job
    /// and what failed: a member's control connection whose record was changed, replayed,
    /// dropped or reordered on the way, a call past a cap, a job that could not be connected.
    pub fn failures(&self) -> Vec<String> {
        let f = self
            .shared
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        f.iter().cloned().collect()
    }

    /// What it has done so far.
    pub fn stats(&self) -> ServiceStats {
        let s = &self.shared;
        ServiceStats {
            jobs: s.jobs.load(Ordering::Relaxed),
            running: s.running.load(Ordering::Relaxed),
            calls: s.calls.load(Ordering::Relaxed),
            bytes_in: s.bytes_in.load(Ordering::Relaxed),
            sealed_links: s.sealed_links.load(Ordering::Relaxed),
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
                // `admit` gives the slot back once the member is proven (its job's caps
                // bound it from then on), or when it returns before that.
                let mut slot = Some(());
                admit(stream, &s, &mut slot);
                if slot.is_some() {
                    s.unadmitted.fetch_sub(1, Ordering::AcqRel);
                }
            });
        if spawned.is_err() {
            shared.unadmitted.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Refuses a member, in clear (it reads the answer to its join in clear).
fn refuse(stream: &mut TcpStream, reason: String, busy: bool) {
    let _ = wire::send(stream, &Msg::Refused { reason, busy });
}

/// A message's kind, for errors that must not print its fields.
fn kind(m: &Msg) -> &'static str {
    match m {
        Msg::Hello { .. } => "a hello",
        Msg::Join(_) => "a join",
        Msg::Side { .. } => "a side",
        Msg::Accept { .. } => "an accept",
        Msg::Refused { .. } => "a refusal",
        Msg::Calls { .. } => "calls",
    }
}

/// One connection: hello, the member's proof, then its job. `slot` is the connection's
/// place among the unadmitted: taken (given back) once the member is proven.
fn admit(mut stream: TcpStream, shared: &Arc<Shared>, slot: &mut Option<()>) {
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
    // Its side of the data connection follows, sealed.
    let peer = match stream.peer_addr() {
        Ok(a) => format!("rank {} of job {:016x} at {a}", join.rank, join.job),
        Err(_) => format!("rank {} of job {:016x}", join.rank, join.job),
    };
    let session = wire::session(
        &shared.opts.secrets[tenant],
        Role::Acceptor,
        &join.nonce,
        &ns,
        &join.claims(),
        &join.proof,
    );
    let mut stream = SealedStream::new(stream, session, peer);
    let (endpoint, region, sealed) = match wire::recv(&mut stream) {
        Ok(Msg::Side {
            endpoint,
            region,
            sealed,
        }) => (endpoint, region, sealed),
        Ok(m) => {
            let why = format!("sent {} where its side belongs", kind(&m));
            refuse(stream.get_mut(), why, false);
            return;
        }
        Err(e) => {
            shared.failed(format!(
                "job {:016x}: closed the connection of rank {}: its side: {}",
                join.job,
                join.rank,
                wire::describe(&e, AUTH_TIMEOUT)
            ));
            return;
        }
    };
    // Proven: from here on the job's caps bound what it holds, not the strangers' count.
    if slot.take().is_some() {
        shared.unadmitted.fetch_sub(1, Ordering::AcqRel);
    }
    let opts = &shared.opts;
    if let Some(why) = not_a_member(&join, opts) {
        refuse(stream.get_mut(), why, false);
        return;
    }
    let timeout = Duration::from_millis(join.timeout_ms).min(opts.max_join_wait);
    let key = (tenant, join.job);
    let (rank, world) = (join.rank, join.world);
    let member = Member {
        stream,
        join,
        endpoint,
        region,
        sealed,
        nonce: ns,
        tenant,
    };
    let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
    let mut member = member;
    if !pending.contains_key(&key) {
        let waiting = pending.keys().filter(|(t, _)| *t == tenant).count();
        if waiting >= opts.max_pending {
            drop(pending);
            refuse(
                member.stream.get_mut(),
                format!(
                    "{waiting} jobs of this secret are waiting for their members, the \
                     service's cap (max_pending, --max-pending {}): job {:016x} cannot start \
                     waiting for its own",
                    opts.max_pending, member.join.job
                ),
                false,
            );
            return;
        }
    }
    let entry = pending.entry(key).or_insert_with(|| Pending {
        world,
        members: BTreeMap::new(),
    });
    if let Some(why) = mismatch(entry, &member.join) {
        drop(pending);
        refuse(member.stream.get_mut(), why, false);
        return;
    }
    entry.members.insert(rank, member);
    if entry.members.len() == entry.world {
        let Some(job) = pending.remove(&key) else {
            return;
        };
        shared.joined.notify_all();
        drop(pending);
        let members = job.members.into_values().collect();
        start_job(members, shared);
        return;
    }
    // Wait for the others; the last to come starts the job.
    wait_for_members(shared, pending, key, world, timeout);
}

/// Why a proven member's join is refused before it waits: a rank outside its world, or a
/// world over the service's cap of members per job.
fn not_a_member(join: &Join, opts: &ServiceOptions) -> Option<String> {
    if join.world == 0 || join.rank >= join.world {
        return Some(format!(
            "rank {} of world {} is not a member",
            join.rank, join.world
        ));
    }
    (join.world > opts.max_members).then(|| {
        format!(
            "rank {} says job {:016x} has {} ranks, over the service's cap of {} members per \
             job (max_members, --max-members)",
            join.rank, join.job, join.world, opts.max_members
        )
    })
}

/// Waits (up to `timeout`) until job `key`'s last member comes and starts it; refuses every
/// member that waited when it does not.
fn wait_for_members(
    shared: &Arc<Shared>,
    mut pending: std::sync::MutexGuard<'_, HashMap<(usize, u64), Pending>>,
    key: (usize, u64),
    world: usize,
    timeout: Duration,
) {
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
            let present: Vec<usize> = job.members.keys().copied().collect();
            for mut m in job.members.into_values() {
                refuse(
                    m.stream.get_mut(),
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
    if p.world != join.world {
        return Some(format!(
            "rank {} says the job has {} ranks, another member says {}",
            join.rank, join.world, p.world
        ));
    }
    if p.members.contains_key(&join.rank) {
        return Some(format!("rank {} joined twice", join.rank));
    }
    let other = p.members.values().next()?;
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
                m.stream.get_mut(),
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
            let sealed = members
                .iter()
                .filter(|m| m.sealed && m.join.provider == "tcp")
                .count();
            shared
                .sealed_links
                .fetch_add(sealed as u64, Ordering::Relaxed);
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
                    match r {
                        Ok(calls) if s.opts.verbose => {
                            eprintln!("oxccl agg: job {job:016x} ended after {calls} calls")
                        }
                        Ok(_) => {}
                        Err(e) => s.failed(format!("job {job:016x} failed: {e}")),
                    }
                    s.running.fetch_sub(1, Ordering::AcqRel);
                });
            if spawned.is_err() {
                shared.running.fetch_sub(1, Ordering::AcqRel);
            }
        }
        Err(why) => {
            shared.running.fetch_sub(1, Ordering::AcqRel);
            shared.failed(format!("job {job:016x} could not be connected: {why}"));
            for m in &mut members {
                refuse(m.stream.get_mut(), why.clone(), false);
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
                .and_then(|(m, _)| m.stream.get_ref().local_addr().ok())
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
            // Sealed as the member's end is (its decision, by the policy, as for its peers).
            seal: (m.sealed && providers[r] == Provider::Tcp)
                .then(|| wire::data_key(&opts.secrets[m.tenant])),
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
        // The proof in clear, then the service's side sealed.
        let side = Msg::Side {
            endpoint: links[r].qp.endpoint(),
            region: links[r].local_region(),
            sealed: m.sealed && providers[r] == Provider::Tcp,
        };
        wire::send(m.stream.get_mut(), &Msg::Accept { proof, pool })
            .and_then(|()| wire::send(&mut m.stream, &side))
            .map_err(|e| format!("cannot answer rank {}: {e}", m.join.rank))?;
    }
    for (r, m) in members.iter().enumerate() {
        links[r]
            .qp
            .connect(&m.endpoint)
            .map_err(|e| format!("connecting rank {}: {e}", m.join.rank))?;
        let region: RemoteBuffer = m.region;
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
    // Steps of the schedules in `plans`.
    let mut plan_steps = 0usize;
    let mut calls = 0u64;
    // Rank 0 names the calls, in sealed records; the others say nothing more (their
    // connections only tell when they leave).
    let _ = members[0]
        .stream
        .get_ref()
        .set_read_timeout(Some(IDLE_TICK));
    for m in &members[1..] {
        let _ = m.stream.get_ref().set_nonblocking(true);
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
                    left[r] |= closed(m.stream.get_ref());
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
            let (key, desc) = plan_key(c, n, engine.geo.slot_data)?;
            if !plans.contains_key(&key) {
                let steps = key.steps(n);
                let cap = shared.opts.max_call_steps;
                if steps > cap {
                    return Err(format!(
                        "rank 0 named call {} of {} elements in slices of {}: {steps} steps \
                         for {n} members, over the service's cap of {cap} (max_call_steps)",
                        desc.seq, key.count, key.chunk
                    ));
                }
                // The schedules kept stay within the cap too (the calls of one group
                // are kept together: they are used together just below).
                if plans.len() >= 64 || plan_steps + steps > cap {
                    plans.retain(|k, _| keyed.iter().any(|(kk, _)| kk == k));
                    plan_steps = plans.keys().map(|k| k.steps(n)).sum();
                }
                if plan_steps + steps > cap {
                    return Err(format!(
                        "rank 0 named {} calls together whose schedules add up to more than \
                         the service's cap of {cap} steps (max_call_steps)",
                        named.len()
                    ));
                }
                let sched = build_aggregator(&key.request(n), pool)?;
                plan_steps += steps;
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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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

    /// Steps of the aggregator's schedule, as [`ServiceOptions::max_call_steps`] counts them:
    /// slices times members.
    fn steps(&self, n: usize) -> usize {
        self.count.div_ceil(self.chunk).max(1).saturating_mul(n)
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

/// A named call's plan key and fingerprint, checked against the job's `n` members and
/// slots of `slot_data` bytes (a slice fills one slot at most, so the service's scratch for
/// a call stays within its share of the pool).
fn plan_key(c: &CallDesc, n: usize, slot_data: usize) -> Result<(PlanKey, OpDesc), String> {
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
    let chunk = usize::try_from(c.chunk).unwrap_or(usize::MAX).max(1);
    if chunk > 1 && chunk.saturating_mul(dtype.size()) > slot_data {
        return Err(format!(
            "rank 0 named call {} with slices of {chunk} elements of {} bytes, larger than \
             the job's slots of {slot_data} bytes",
            c.seq,
            dtype.size()
        ));
    }
    let key = PlanKey {
        count,
        chunk,
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

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_core::protocol::Geometry;
    use oxccl_verbs::EndpointAddr;

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    fn start(secrets: Vec<Secret>, tune: impl FnOnce(&mut ServiceOptions)) -> Service {
        let mut opts = ServiceOptions::new("127.0.0.1:0".parse().unwrap(), secrets);
        tune(&mut opts);
        Service::start(opts).unwrap()
    }

    const GEO: Geometry = Geometry {
        slot_data: 4096,
        slots: 2,
        channels: 1,
    };

    /// A proven member of `job` (rank `rank` of `world`) that has sent its join and its side.
    fn join(
        svc: &Service,
        s: &Secret,
        job: u64,
        rank: usize,
        world: usize,
    ) -> SealedStream<TcpStream> {
        join_sealed(svc, s, job, rank, world, false)
    }

    /// [`join`], saying whether the member's queue pair is sealed.
    fn join_sealed(
        svc: &Service,
        s: &Secret,
        job: u64,
        rank: usize,
        world: usize,
        sealed: bool,
    ) -> SealedStream<TcpStream> {
        let mut stream = TcpStream::connect(svc.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let Ok(Msg::Hello { nonce: ns, .. }) = wire::recv(&mut stream) else {
            panic!("no hello")
        };
        let nc = wire::nonce().unwrap();
        let mut j = Join {
            nonce: nc,
            proof: Vec::new(),
            job,
            rank,
            world,
            geo: GEO,
            provider: "tcp".into(),
            timeout_ms: 20_000,
        };
        j.proof = LABELS.client_proof(s, &ns, &nc, &j.claims()).to_vec();
        let session = wire::session(s, Role::Initiator, &nc, &ns, &j.claims(), &j.proof);
        wire::send(&mut stream, &Msg::Join(Box::new(j))).unwrap();
        let mut stream = SealedStream::new(stream, session, "the service");
        let side = Msg::Side {
            endpoint: QpEndpoint {
                provider: Provider::Tcp,
                host: "test".into(),
                qp_num: 1,
                addr: EndpointAddr::Tcp {
                    addr: "127.0.0.1:1".into(),
                    qp_token: 7,
                    nsocks: 1,
                },
            },
            region: RemoteBuffer {
                addr: 0,
                len: 0,
                rkey: 0,
            },
            sealed,
        };
        wire::send(&mut stream, &side).unwrap();
        stream
    }

    fn refusal(stream: &mut SealedStream<TcpStream>) -> String {
        match wire::recv(stream.get_mut()) {
            Ok(Msg::Refused { reason, busy }) => {
                assert!(!busy, "{reason}");
                reason
            }
            r => panic!("expected a refusal, got {r:?}"),
        }
    }

    /// Whether the service has said nothing to `stream` for a while (the member waits).
    fn waiting(stream: &mut SealedStream<TcpStream>) -> bool {
        stream
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let r = wire::recv(stream.get_mut());
        matches!(&r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }

    #[test]
    fn a_job_larger_than_the_member_cap_is_refused_naming_it() {
        let s = secret("caps");
        let svc = start(vec![s.clone()], |o| o.max_members = 2);
        let mut m = join(&svc, &s, 0xabc, 0, 3);
        let why = refusal(&mut m);
        for part in [
            "3 ranks",
            "cap of 2 members",
            "max_members",
            "--max-members",
            "abc",
        ] {
            assert!(why.contains(part), "{part} missing from {why}");
        }
        // A job within the cap waits for its other member.
        let mut ok = join(&svc, &s, 0xdef, 0, 2);
        assert!(waiting(&mut ok));
    }

    #[test]
    fn pending_jobs_are_capped_per_secret() {
        let (a, b) = (secret("tenant a"), secret("tenant b"));
        let svc = start(vec![a.clone(), b.clone()], |o| o.max_pending = 2);
        // Two jobs of tenant a wait for their second members.
        let mut first = join(&svc, &a, 1, 0, 2);
        let mut second = join(&svc, &a, 2, 0, 2);
        assert!(waiting(&mut first) && waiting(&mut second));
        // A third is refused, naming the cap.
        let mut third = join(&svc, &a, 3, 0, 2);
        let why = refusal(&mut third);
        for part in [
            "2 jobs of this secret",
            "max_pending",
            "--max-pending 2",
            "0000000000000003",
        ] {
            assert!(why.contains(part), "{part} missing from {why}");
        }
        // A member of a job already waiting is not a new job; another tenant is not held
        // back by tenant a's jobs.
        let mut other = join(&svc, &b, 3, 0, 2);
        assert!(waiting(&mut other));
        let mut more = join(&svc, &a, 1, 1, 3);
        assert!(refusal(&mut more).contains("says the job has 3 ranks"));
        // Members that are proven do not count among the unadmitted connections.
        assert_eq!(svc.shared.unadmitted.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_named_call_is_checked_against_the_slots_and_counted_in_steps() {
        let call = |count: u64, chunk: u64| CallDesc {
            seq: 9,
            count,
            dtype: wire::dtype_code(DataType::F32),
            op: wire::op_code(ReduceOp::Sum),
            chunk,
            hosts: Vec::new(),
        };
        // Slices of 1024 f32 fill 4096-byte slots exactly; 1025 do not fit.
        let (key, desc) = plan_key(&call(10_000, 1024), 4, 4096).unwrap();
        assert_eq!((key.chunk, desc.seq), (1024, 9));
        assert_eq!(key.steps(4), 10_000usize.div_ceil(1024) * 4);
        let e = plan_key(&call(10_000, 1025), 4, 4096).unwrap_err();
        assert!(e.contains("call 9") && e.contains("4096 bytes"), "{e}");
        // A count of u64::MAX in slices of 1 is counted without overflow (and far over any cap).
        let (key, _) = plan_key(&call(u64::MAX, 1), 4, 4096).unwrap();
        assert_eq!(key.steps(4), usize::MAX);
    }

    #[test]
    fn the_service_seals_the_data_queue_pair_as_each_member_does() {
        let s = secret("sealing");
        let svc = start(vec![s.clone()], |_| {});
        let mut members: Vec<_> = [true, false]
            .into_iter()
            .enumerate()
            .map(|(rank, sealed)| (join_sealed(&svc, &s, 0x5ea1, rank, 2, sealed), sealed))
            .collect();
        for (rank, (m, sealed)) in members.iter_mut().enumerate() {
            // The accept in clear, then the service's side, sealed, saying the same.
            match wire::recv(m.get_mut()) {
                Ok(Msg::Accept { .. }) => {}
                r => panic!("rank {rank}: {r:?}"),
            }
            match wire::recv(m) {
                Ok(Msg::Side { sealed: theirs, .. }) => assert_eq!(theirs, *sealed, "rank {rank}"),
                r => panic!("rank {rank}: {r:?}"),
            }
        }
    }
}
