//! Communicator init: the hello (hosts, settings, routes to the store), the tcp address,
//! the connections to every peer, and the engine that drives them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use oxccl_bootstrap::{AbortHandle, Bootstrap};
use oxccl_verbs::{Cancel, ConnectRole, Context, Provider, QpConfig, QpEndpoint, RemoteBuffer};
use serde::{Deserialize, Serialize};

use super::{Communicator, Inner, Options, State, default_host_id, random_u64, spawn_watchdog};
use crate::engine::{AbortFlag, Engine, Geometry, Link};
use crate::error::{Error, Result};
use crate::fault::{InitStage, Injector, in_init};
use crate::flight::{self, Probe};
use crate::log_enabled;
use crate::netif::Chosen;
use crate::topology::Topology;
use crate::tuner::Tuning;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Settings {
    chunk: Option<usize>,
    slots: Option<usize>,
    channels: Option<usize>,
    provider: Option<String>,
    /// The link probe and learning run collective calls: every rank must do the same.
    probe: Option<usize>,
    learn: usize,
    /// Both ends of a link must decide alike whether it is sealed.
    encrypt: String,
}

#[derive(Serialize, Deserialize)]
struct Hello {
    host: String,
    settings: Settings,
    comm_id: u64,
    /// This rank's address towards the store ([`Bootstrap::route_addr`]).
    route: Option<std::net::IpAddr>,
}

#[derive(Serialize, Deserialize, Clone)]
struct LinkInfo {
    endpoint: QpEndpoint,
    region: RemoteBuffer,
}

/// What each rank publishes to connect: its tcp address (when it talks tcp) and, per peer,
/// the queue pair and region to reach it.
#[derive(Serialize, Deserialize)]
struct Links {
    tcp: Option<Chosen>,
    peers: Vec<Option<LinkInfo>>,
}

/// Every rank's host, settings and route to the store; checks that the settings agree.
/// Returns rank 0's communicator id, the hosts and the routes.
fn exchange_hello(
    bootstrap: &Bootstrap,
    opts: &Options,
    host: &str,
) -> Result<(u64, Vec<String>, Vec<Option<std::net::IpAddr>>)> {
    let rank = bootstrap.rank();
    // What must agree on every rank: the slot geometry and a forced provider (geometry is
    // agreed from rank 0's options, so that every rank sizes its slots alike).
    let settings = Settings {
        chunk: opts.chunk_size,
        slots: opts.slots,
        channels: opts.channels,
        provider: opts.provider.map(|p| p.name().to_string()),
        probe: opts.topo_probe,
        learn: opts.learn_interval,
        encrypt: opts.encrypt.name().to_string(),
    };
    let hellos: Vec<Hello> = bootstrap.all_gather_serde(
        "oxccl/hello",
        &Hello {
            host: host.to_owned(),
            settings,
            comm_id: random_u64(),
            route: bootstrap.route_addr(),
        },
    )?;
    for (r, h) in hellos.iter().enumerate() {
        if h.settings != hellos[0].settings {
            return Err(Error::InvalidArgument {
                rank,
                msg: format!(
                    "rank {r} has OXCCL_CHUNK_SIZE/OXCCL_SLOTS/OXCCL_NCHANNELS/OXCCL_PROVIDER/\
                     OXCCL_TOPO_PROBE/OXCCL_TOPO_LEARN/OXCCL_ENCRYPT {:?}, rank 0 has {:?}: set them alike on \
                     every rank",
                    h.settings, hellos[0].settings
                ),
            });
        }
    }
    let comm_id = hellos[0].comm_id;
    let routes = hellos.iter().map(|h| h.route).collect();
    Ok((
        comm_id,
        hellos.into_iter().map(|h| h.host).collect(),
        routes,
    ))
}

/// The address this rank's tcp listener binds and advertises ([`crate::netif`]).
fn choose_tcp_addr(
    opts: &Options,
    rank: usize,
    route: Option<std::net::IpAddr>,
    others: &[std::net::IpAddr],
) -> Result<Chosen> {
    let ifaces = crate::netif::interfaces().map_err(|e| {
        Error::Config(format!(
            "rank {rank}: cannot list this host's network interfaces: {e}"
        ))
    })?;
    crate::netif::choose(
        &ifaces,
        &crate::netif::Want {
            tcp_addr: opts.tcp_addr,
            ifname: opts.socket_ifname.as_ref(),
            route,
            others,
        },
    )
    .map_err(|e| Error::Config(format!("rank {rank}: {e}")))
}

/// What init has once every rank is connected.
struct Established {
    comm_id: u64,
    host: String,
    hosts: Vec<String>,
    topology: Topology,
    weights: Vec<u32>,
    providers: Vec<Option<Provider>>,
    any_tcp: bool,
    geo: Geometry,
    links: Vec<Link>,
    link_of: Vec<usize>,
    pds: Vec<oxccl_verbs::ProtectionDomain>,
    cqs: Vec<oxccl_verbs::CompletionQueue>,
    tcp_addrs: Vec<Option<Chosen>>,
    /// Whether the link to each rank is sealed (encrypted).
    sealed: Vec<bool>,
    /// The aggregation service this job joined, with the slots it got.
    agg: Option<(crate::agg::Membership, usize)>,
}

type Connected = (
    Vec<Link>,
    Vec<usize>,
    Vec<oxccl_verbs::ProtectionDomain>,
    Vec<oxccl_verbs::CompletionQueue>,
    Vec<Option<Chosen>>,
);

/// Opens a context per provider in use, makes a queue pair and slots per peer, exchanges
/// them through the store and connects every link. A peer that cannot be reached is named
/// with its address, its interface and how it chose it. `before_exchange` runs once the
/// links exist, before any is connected (it joins the aggregation service: a refusal then
/// fails every rank there, not some of them while connecting).
#[allow(clippy::too_many_arguments)]
fn connect_links(
    bootstrap: &Bootstrap,
    opts: &Options,
    providers: &[Option<Provider>],
    geo: &Geometry,
    tcp: Option<Chosen>,
    sealing: &Sealing,
    cancel: Cancel,
    before_exchange: impl FnOnce(&mut Vec<Link>, &mut Vec<usize>) -> Result<()>,
) -> Result<Connected> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
    let verbs = |what: &str| {
        let what = what.to_string();
        move |source| Error::Verbs {
            rank,
            what: what.clone(),
            source,
        }
    };
    let kinds: Vec<Provider> = [Provider::Shm, Provider::Tcp, Provider::Ofi]
        .into_iter()
        .filter(|k| providers.contains(&Some(*k)))
        .collect();
    let (mut ctxs, mut pds, mut cqs) = (Vec::new(), Vec::new(), Vec::new());
    let mut tcp = tcp;
    for k in &kinds {
        let peers = providers.iter().filter(|p| **p == Some(*k)).count();
        let mut config = opts.device.clone();
        if let (Provider::Tcp, Some(c)) = (k, &tcp) {
            config.tcp_addr = std::net::SocketAddr::new(c.ip, c.port);
        }
        let ctx = Context::open_with(*k, &config).map_err(|e| match (k, &tcp) {
            (Provider::Tcp, Some(c)) => Error::Config(format!(
                "rank {rank}: cannot listen for tcp peers on {c}: {e}"
            )),
            _ => verbs(&format!("opening the {} provider", k.name()))(e),
        })?;
        if let (Provider::Tcp, Some(c)) = (k, &mut tcp)
            && let Some(a) = ctx.tcp_addr()
        {
            c.port = a.port();
        }
        let pd = ctx
            .alloc_pd()
            .map_err(verbs("allocating a protection domain"))?;
        let cq = ctx
            .create_cq(peers * (geo.send_depth() + geo.recv_depth()) as usize + 64)
            .map_err(verbs("creating a completion queue"))?;
        ctxs.push(ctx);
        pds.push(pd);
        cqs.push(cq);
    }
    let qp_cfg = QpConfig {
        max_send_wr: geo.send_depth(),
        max_recv_wr: geo.recv_depth(),
        max_sge: 2,
        rnr_retry: 7,
        cancel: Some(cancel.clone()),
        ..QpConfig::default()
    };
    let mut links = Vec::new();
    // `providers` may have one more entry than ranks: the aggregation service (peer
    // `world`), connected through its own handshake, not the store's.
    let mut link_of = vec![usize::MAX; providers.len()];
    for (p, prov) in providers.iter().enumerate() {
        let Some(prov) = prov else { continue };
        let c = kinds.iter().position(|k| k == prov).unwrap_or(0);
        // The lower rank opens each tcp connection: an address that some peer cannot reach
        // then fails the same pairs on every run.
        let cfg = QpConfig {
            connect: if rank < p {
                ConnectRole::Active
            } else {
                ConnectRole::Passive
            },
            seal: sealing.key_for(p),
            ..qp_cfg.clone()
        };
        let qp = pds[c]
            .create_qp(&cqs[c], &cqs[c], &cfg)
            .map_err(verbs(&format!("creating a queue pair for peer {p}")))?;
        link_of[p] = links.len();
        links.push(
            Link::new(p, *prov, c, &pds[c], qp, geo)
                .map_err(verbs(&format!("allocating slots for rank {p}")))?,
        );
    }
    before_exchange(&mut links, &mut link_of)?;
    in_init(opts.faults.as_ref(), rank, InitStage::Links);
    let mine = Links {
        tcp: tcp.clone(),
        peers: (0..world)
            .map(|p| {
                let l = link_of[p];
                (l != usize::MAX).then(|| LinkInfo {
                    endpoint: links[l].qp.endpoint(),
                    region: links[l].local_region(),
                })
            })
            .collect(),
    };
    let all: Vec<Links> = bootstrap.all_gather_serde("oxccl/links", &mine)?;
    // While connecting, a thread watches the store for a rank's failure notice and cancels
    // the connects under way (a peer that stopped answering would hold them until the queue
    // pairs' timeout); an abort cancels them too (the hook in `init_watched`).
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                if bootstrap.failure_notice().is_some() {
                    cancel.cancel();
                    return;
                }
                // 20 ms, longer in large jobs: every rank together, ~5,000 store requests/s.
                let world = u32::try_from(bootstrap.world_size()).unwrap_or(u32::MAX);
                std::thread::sleep(
                    Duration::from_millis(20).max(Duration::from_micros(200).saturating_mul(world)),
                );
            }
        });
        let r = connect_each(
            bootstrap, opts, providers, geo, &tcp, &all, &cancel, &mut links, &link_of,
        );
        stop.store(true, Ordering::Release);
        r
    })?;
    drop(ctxs);
    let addrs = all.into_iter().map(|l| l.tcp).collect();
    Ok((links, link_of, pds, cqs, addrs))
}

/// How long a rank whose init failed in its first calls keeps its connections open, so that
/// the peers read its notice before they see them close.
const FAILED_INIT_GRACE: Duration = Duration::from_millis(50);

/// Connects the link of every peer to the endpoint it published (`all`), in rank order.
#[allow(clippy::too_many_arguments)]
fn connect_each(
    bootstrap: &Bootstrap,
    opts: &Options,
    providers: &[Option<Provider>],
    geo: &Geometry,
    tcp: &Option<Chosen>,
    all: &[Links],
    cancel: &Cancel,
    links: &mut [Link],
    link_of: &[usize],
) -> Result<()> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
    let verbs = |what: &str| {
        let what = what.to_string();
        move |source| Error::Verbs {
            rank,
            what: what.clone(),
            source,
        }
    };
    let mut done = 0;
    for p in 0..world {
        let l = link_of[p];
        if l == usize::MAX {
            continue;
        }
        let Some(info) = all[p].peers.get(rank).cloned().flatten() else {
            return Err(Error::InvalidArgument {
                rank,
                msg: format!("rank {p} published no connection for this rank"),
            });
        };
        let prov = providers[p].unwrap_or(Provider::Shm);
        // A peer that died after publishing its links: say so rather than what the
        // transport makes of its vanished segments. A peer that gave up (a failure notice in
        // the store, posted before it closed its links): its reason, which names the cause.
        let gone = |e: &oxccl_verbs::Error| {
            shm_owner_gone(&info.endpoint)
                .map(|pid| Error::PeerFailed {
                    rank,
                    op: "init (connecting)".into(),
                    peer: p,
                    detail: format!("its process (pid {pid}) exited during init ({e})"),
                })
                .or_else(|| bootstrap.failure_notice().map(Error::Bootstrap))
                .or_else(|| {
                    cancel.is_cancelled().then(|| Error::Aborted {
                        rank,
                        op: "init (connecting)".into(),
                        reason: format!("connecting to rank {p} ({})", info.endpoint),
                    })
                })
        };
        let connected = links[l].qp.connect(&info.endpoint).map_err(|e| {
            gone(&e).unwrap_or_else(|| match (&all[p].tcp, tcp) {
                (Some(theirs), Some(ours)) if prov == Provider::Tcp => Error::Unreachable {
                    rank,
                    peer: p,
                    detail: format!(
                        "it listens on {theirs}, this rank on {ours}: {e}. Either rank {p} \
                         exited, or that address is not reachable from this host: then choose \
                         rank {p}'s interface with OXCCL_SOCKET_IFNAME or its address with \
                         OXCCL_TCP_ADDR"
                    ),
                },
                _ => verbs(&format!("connecting to rank {p} over {}", prov.name()))(e),
            })
        });
        let posted = connected.and_then(|()| {
            links[l].connect(info.region, geo, l).map_err(|e| {
                gone(&e).unwrap_or_else(|| verbs(&format!("posting receives for rank {p}"))(e))
            })
        });
        // Told before this rank's links close (as the error returns): the others then read
        // why in the store before they see the links go.
        posted.inspect_err(|e| bootstrap.fail(&e.to_string()))?;
        done += 1;
        if done == 1 {
            in_init(opts.faults.as_ref(), rank, InitStage::Connect);
        }
    }
    Ok(())
}

/// The process id of a shm endpoint's owner when that process has exited (it no longer
/// exists, or is a zombie its parent has not reaped yet).
fn shm_owner_gone(endpoint: &QpEndpoint) -> Option<u32> {
    let oxccl_verbs::EndpointAddr::Shm { pid, .. } = &endpoint.addr else {
        return None;
    };
    let gone = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    };
    gone.then_some(*pid)
}

impl Communicator {
    /// Init up to the store barrier that ends it: hello, topology, addresses, connections.
    fn establish(bootstrap: &Bootstrap, opts: &mut Options, cancel: Cancel) -> Result<Established> {
        let rank = bootstrap.rank();
        let world = bootstrap.world_size();
        let host = opts.host_id.clone().unwrap_or_else(default_host_id);
        in_init(opts.faults.as_ref(), rank, InitStage::Hello);
        let (comm_id, hosts, routes) = exchange_hello(bootstrap, opts, &host)?;
        let (topology, note) = Topology::from_env(&hosts).map_err(Error::Config)?;
        if let Some(note) = note
            && rank == 0
        {
            crate::log_warn(note);
        }
        let weights = topology.proportional_weights();
        // Every rank must cut all-reduces the same way: same file, same shares.
        let all_weights: Vec<Vec<u32>> = bootstrap.all_gather_serde("oxccl/topology", &weights)?;
        if let Some(r) = all_weights.iter().position(|w| *w != weights) {
            return Err(Error::InvalidArgument {
                rank,
                msg: format!(
                    "rank {r} derives link shares {:?} from its topology, this rank {weights:?}: \
                     give every rank the same OXCCL_TOPO_FILE",
                    all_weights[r]
                ),
            });
        }
        // A topology file may name the network's aggregation service; the variable wins.
        if opts.agg_addr.is_none() {
            opts.agg_addr.clone_from(&topology.aggregator);
        }
        if opts.algo == Some(crate::schedule::Algorithm::Aggregation) && opts.agg_addr.is_none() {
            return Err(Error::Config(format!(
                "rank {rank}: OXCCL_ALGO=agg needs an aggregation service to stream through: \
                 set OXCCL_AGG_ADDR, or `aggregator` in the topology file (see `oxccl agg`)"
            )));
        }
        // The aggregation service first: its host decides whether we talk shm or tcp to it.
        let contact = match &opts.agg_addr {
            Some(a) => Some(crate::agg::contact(a, rank, opts.timeout)?),
            None => None,
        };
        let mut providers: Vec<Option<Provider>> = (0..world)
            .map(|p| {
                (p != rank).then(|| {
                    opts.provider.unwrap_or(if hosts[p] == host {
                        Provider::Shm
                    } else {
                        Provider::Tcp
                    })
                })
            })
            .collect();
        // Whether any pair of ranks talks over tcp: then larger chunks amortise the per-message
        // cost of the socket path (every rank computes the same answer).
        // (ofi, whose target executes requests in software, is costed as tcp is.)
        // The service speaks shm and tcp.
        let agg_provider = contact.as_ref().map(|c| match opts.provider {
            Some(p @ (Provider::Shm | Provider::Tcp)) => p,
            _ if c.host == host => Provider::Shm,
            _ => Provider::Tcp,
        });
        let any_tcp = matches!(opts.provider, Some(Provider::Tcp | Provider::Ofi))
            || hosts.iter().any(|h| h != &hosts[0])
            || agg_provider == Some(Provider::Tcp);
        let geo = Geometry {
            slot_data: opts.chunk_size.unwrap_or(if any_tcp {
                crate::tuner::CHUNK_NET
            } else {
                crate::tuner::CHUNK_SHM
            }),
            slots: opts.slots.unwrap_or(if any_tcp {
                crate::tuner::SLOTS_NET
            } else {
                crate::tuner::SLOTS_SHM
            }),
            channels: opts.channels.unwrap_or(1),
        };
        opts.chunk_size = Some(geo.slot_data);
        opts.slots = Some(geo.slots);
        opts.channels = Some(geo.channels);
        providers.extend(agg_provider.map(Some));
        let tcp = if providers.contains(&Some(Provider::Tcp)) {
            let mut others: Vec<std::net::IpAddr> = (0..world)
                .filter(|&p| hosts[p] != host)
                .filter_map(|p| routes[p])
                .collect();
            if let Some(ip) = opts.agg_addr.as_deref().and_then(oxccl_bootstrap::route_to) {
                others.push(ip);
            }
            Some(choose_tcp_addr(opts, rank, routes[rank], &others)?)
        } else {
            None
        };
        let mut sealing = Sealing::agree(bootstrap, opts, &providers, tcp.as_ref(), any_tcp)?;
        // The tcp link to the aggregation service is sealed by this rank's own decision (the
        // service seals its end as the join says).
        let agg_key = contact
            .as_ref()
            .filter(|_| agg_provider == Some(Provider::Tcp))
            .and_then(|c| c.data_seal(opts.encrypt, bootstrap.secret()));
        let contact = contact.map(|c| c.seal_data(agg_key.is_some()));
        sealing.set_service(world, agg_key);
        let mut agg = None;
        let (links, link_of, pds, cqs, tcp_addrs) = connect_links(
            bootstrap,
            opts,
            &providers,
            &geo,
            tcp,
            &sealing,
            cancel.clone(),
            |links, link_of| {
                if let Some(c) = contact {
                    agg = join_aggregator(bootstrap, opts, c, comm_id, geo, links, link_of)?;
                }
                Ok(())
            },
        )?;
        providers.truncate(world);
        in_init(opts.faults.as_ref(), rank, InitStage::Stored);
        if let Err(e) = bootstrap.barrier("oxccl/connected", opts.timeout) {
            // Connected peers may be past this barrier, in the one over the connections
            // (rank 0 died just after it, taking the store): they would see these
            // connections close and blame this rank. Keep them open a moment, so that they
            // notice the real failure first.
            bootstrap.fail(&e.to_string());
            if !cancel.is_cancelled() {
                std::thread::sleep(FAILED_INIT_GRACE.saturating_mul(4).min(opts.timeout));
            }
            return Err(e.into());
        }
        Ok(Established {
            comm_id,
            host,
            hosts,
            topology,
            weights,
            providers,
            any_tcp,
            geo,
            links,
            link_of,
            pds,
            cqs,
            tcp_addrs,
            sealed: sealing.links,
            agg,
        })
    }

    pub(super) fn init_inner(bootstrap: &Arc<Bootstrap>, opts: Options) -> Result<Communicator> {
        Communicator::init_watched(bootstrap, opts, None)
    }

    /// Init that `abort` (if any) stops: every store wait watches it, and an abort cancels the
    /// tcp connects under way and aborts the barrier over the connections. An error after an
    /// abort is [`Error::Aborted`] with `op` "init", saying what init was waiting for.
    pub(super) fn init_watched(
        bootstrap: &Arc<Bootstrap>,
        opts: Options,
        abort: Option<&AbortHandle>,
    ) -> Result<Communicator> {
        let rank = bootstrap.rank();
        let flag = Arc::new(AbortFlag::default());
        let cancel = Cancel::new();
        let _hook = abort.map(|h| {
            let (flag, cancel) = (flag.clone(), cancel.clone());
            h.on_abort(move |why| {
                cancel.cancel();
                flag.set(&format!("init was aborted ({why})"));
            })
        });
        if let Some(h) = abort {
            bootstrap.set_abort(Some(h.clone()));
        }
        let r = Communicator::init_body(bootstrap, opts, flag, cancel);
        if abort.is_some() {
            bootstrap.set_abort(None);
        }
        let why = abort.and_then(AbortHandle::reason);
        r.map_err(|e| match (e, why) {
            (
                Error::Bootstrap(oxccl_bootstrap::Error::Aborted {
                    reason, waiting, ..
                }),
                _,
            ) => Error::Aborted {
                rank,
                op: "init".into(),
                reason: format!("{reason}, while waiting {waiting}"),
            },
            (Error::Aborted { op, reason, .. }, Some(why)) if op == "init (connecting)" => {
                Error::Aborted {
                    rank,
                    op: "init".into(),
                    reason: format!("{why}, while {reason}"),
                }
            }
            (Error::Aborted { reason, .. }, Some(_)) => Error::Aborted {
                rank,
                op: "init".into(),
                reason: format!("{reason}, in its first calls over the connections"),
            },
            (e, Some(why)) => Error::Aborted {
                rank,
                op: "init".into(),
                reason: format!("{why}: {e}"),
            },
            (e, None) => e,
        })
    }

    fn init_body(
        bootstrap: &Arc<Bootstrap>,
        mut opts: Options,
        abort: Arc<AbortFlag>,
        cancel: Cancel,
    ) -> Result<Communicator> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let given = opts.clone();
        // Until every rank is past the store barrier that ends `establish`, a failure is
        // posted in the store, so that the others (waiting there) fail at once instead of
        // timing out. From then on failures travel over the connections (a dead peer, an
        // abort notice).
        let established = Communicator::establish(bootstrap, &mut opts, cancel)
            .inspect_err(|e| bootstrap.fail(&e.to_string()))?;
        if log_enabled() {
            established.log_connected(rank, world);
        }
        let Established {
            comm_id,
            host,
            hosts,
            topology,
            weights,
            providers,
            any_tcp,
            geo,
            links,
            link_of,
            pds,
            cqs,
            tcp_addrs,
            sealed,
            agg,
        } = established;
        let probe = Probe::new(comm_id, rank, world);
        flight::install_signal_handler();
        let mut engine = Engine::new(
            rank,
            geo,
            links,
            link_of,
            pds,
            cqs,
            abort.clone(),
            probe.clone(),
        );
        configure_engine(&mut engine, &opts, &hosts, &host);
        let joined = agg.is_some();
        if let Some((membership, pool)) = agg {
            if log_enabled() {
                crate::log_line(format!(
                    "rank {rank}: joined the aggregation service at {} ({pool} slots of {} KiB)",
                    membership.addr,
                    geo.slot_data >> 10
                ));
            }
            engine.agg = Some(Box::new(membership));
        }
        let tuning = Tuning {
            aggregator: joined,
            algo: opts
                .algo
                .filter(|a| joined || *a != crate::schedule::Algorithm::Aggregation),
            all_shm: providers.iter().flatten().all(|p| *p == Provider::Shm),
            small_bytes: opts.small_bytes,
            weights,
            chunk_bytes: geo.slot_data,
            channels: geo.channels,
            slots: geo.slots,
            ..Tuning::new(&topology, any_tcp)
        };
        let learner = (opts.learn_interval > 0 && any_tcp && topology.hosts.len() > 1)
            .then(|| crate::learn::Learner::new(opts.learn_interval));
        let opts_timeout_ns = opts.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let watchdog = opts
            .watchdog
            .map(|a| (a, opts.watchdog_timeout.unwrap_or(opts.timeout)));
        let comm = Communicator {
            inner: Arc::new(Inner {
                rank,
                world,
                hosts,
                host_of: topology.host_table(),
                providers,
                tcp_addrs,
                sealed,
                opts,
                comm_id,
                state: Mutex::new(State {
                    engine,
                    // The first call, init's own barrier, gets sequence number 0.
                    seq: u64::MAX,
                    p2p_seq: HashMap::new(),
                    poisoned: None,
                    cache: HashMap::new(),
                    last: None,
                    logged: Default::default(),
                    tuning,
                    learner,
                    topology,
                }),
                abort,
                _status: crate::status::attach(bootstrap, &probe),
                probe,
                timeout_ns: AtomicU64::new(opts_timeout_ns),
                bootstrap: bootstrap.clone(),
                split_seq: AtomicU64::new(0),
                shrink_seq: AtomicU64::new(0),
                grow_seq: AtomicU64::new(0),
                lineage: Mutex::new(bootstrap.job_id().to_string()),
                given,
                failed_peers: Mutex::new(Vec::new()),
                queue: Mutex::new(None),
                pending: (Mutex::new(0), Condvar::new()),
                queued: Default::default(),
                waiting_jobs: Default::default(),
                unnumbered: Default::default(),
                wanting: Default::default(),
            }),
        };
        comm.ready_at_init()?;
        if let Some((action, limit)) = watchdog {
            spawn_watchdog(Arc::downgrade(&comm.inner), action, limit);
        }
        Ok(comm)
    }

    /// Init's last step, a barrier over the new connections.
    fn ready_at_init(&self) -> Result<()> {
        let (comm, rank) = (self, self.inner.rank);
        // A barrier over the new connections: when it returns, every rank is past the store
        // barrier above, so a rank that now exits (and with rank 0, the store) strands nobody.
        // (Sequence number 0: users count their calls from 1.)
        // The probe's calls are init's own: they are numbered just below 0 (2^20 of them at
        // most), so that the barrier is call 0 whether or not it ran, and a peer's fragment of
        // call 0 that arrives while this rank still finishes the probe's last call counts as
        // a later call's (sequence numbers compare modulo 2^24), not an earlier one's.
        in_init(comm.inner.opts.faults.as_ref(), rank, InitStage::Barrier);
        comm.lock().seq = u64::MAX - (1 << 20);
        let ready = comm.probe_at_init().and_then(|()| {
            comm.lock().seq = u64::MAX;
            comm.barrier()
        });
        if let Err(e) = ready {
            // This rank told its peers why (a peer died, an abort); they read it before they
            // see its connections close, not a send to it failing first (which would blame
            // this rank).
            std::thread::sleep(FAILED_INIT_GRACE.min(comm.inner.opts.timeout));
            return Err(e);
        }
        Ok(())
    }
}

impl Established {
    /// Logs what init connected (`OXCCL_DEBUG=INFO`).
    fn log_connected(&self, rank: usize, world: usize) {
        let (providers, hosts, geo) = (&self.providers, &self.hosts, &self.geo);
        let chosen = &self.tcp_addrs[rank];
        let count = |k| providers.iter().filter(|p| **p == Some(k)).count();
        let distinct: std::collections::HashSet<&String> = hosts.iter().collect();
        crate::log_line(format!(
            "rank {rank}/{world}: connected {} peers over shm, {} over tcp{}; \
             {} hosts; {} channels × {} slots × {} KiB chunks",
            count(Provider::Shm),
            count(Provider::Tcp),
            chosen
                .as_ref()
                .map_or_else(String::new, |c| format!(" from {c}")),
            distinct.len(),
            geo.channels,
            geo.slots,
            geo.slot_data >> 10
        ));
        for (p, prov) in providers.iter().enumerate().take(world) {
            let Some(prov) = prov else { continue };
            let addr = match (prov, self.tcp_addrs.get(p).and_then(Option::as_ref)) {
                (Provider::Tcp, Some(c)) => format!(" at {}:{}", c.ip, c.port),
                _ => String::new(),
            };
            crate::log_line(format!(
                "rank {rank}: link to rank {p}{addr} over {}: {}",
                prov.name(),
                if self.sealed.get(p).copied().unwrap_or(false) {
                    "sealed (encrypted and authenticated)"
                } else {
                    "plain"
                }
            ));
        }
    }
}

/// Which tcp links are sealed ([`Options::encrypt`]), decided alike at both ends of each,
/// and the job key that seals them.
pub(super) struct Sealing {
    key: Option<oxccl_seal::JobKey>,
    /// Per rank.
    links: Vec<bool>,
    /// The aggregation service's link's key (peer `world`), when it is sealed.
    service: Option<oxccl_seal::JobKey>,
}

/// What each rank tells the others so that both ends of a link decide alike
/// (`OXCCL_ENCRYPT=auto`): whether it can seal, its tcp address and its interfaces'.
#[derive(Serialize, Deserialize)]
struct SealInfo {
    /// It has the job's secret (the key is derived from it).
    keyed: bool,
    tcp: Option<std::net::IpAddr>,
    local: Vec<std::net::IpAddr>,
}

/// Whether the tcp link between the ranks that published `a` and `b` is sealed under
/// `policy` (before the secret is checked): `on` always, `auto` unless each end's address is
/// on the other's host (loopback, or one of its interfaces' addresses). Symmetric: both ends
/// compute the same answer from the same two records.
fn wants_seal(policy: oxccl_verbs::Encrypt, a: &SealInfo, b: &SealInfo) -> bool {
    let on_host = |of: &SealInfo, addr: Option<std::net::IpAddr>| {
        addr.is_some_and(|x| x.is_loopback() || of.local.contains(&x))
    };
    match policy {
        oxccl_verbs::Encrypt::Off => false,
        oxccl_verbs::Encrypt::On => true,
        oxccl_verbs::Encrypt::Auto => !(on_host(a, b.tcp) && on_host(b, a.tcp)),
    }
}

/// The purpose the tcp queue pairs' job key is derived for.
pub(crate) const TCP_KEY_PURPOSE: &str = "oxccl tcp qp v1";

impl Sealing {
    /// Decides which tcp links are sealed. With `OXCCL_ENCRYPT=off`, or no tcp anywhere
    /// (`any_tcp`, alike on every rank), none: nothing is exchanged. Otherwise every rank
    /// publishes a [`SealInfo`] and each end of a tcp link decides from both ends' (so the two
    /// decide alike): `on` seals it, `auto` seals it unless each end's address is on the
    /// other's host (loopback, or one of its interfaces' addresses). A link to be sealed
    /// needs the job's secret at both ends: without it `on` fails init, naming the rank,
    /// and `auto` leaves the link plain with a warning.
    fn agree(
        bootstrap: &Bootstrap,
        opts: &Options,
        providers: &[Option<Provider>],
        tcp: Option<&Chosen>,
        any_tcp: bool,
    ) -> Result<Sealing> {
        use oxccl_verbs::Encrypt;
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let mut links = vec![false; providers.len()];
        if opts.encrypt == Encrypt::Off || !any_tcp {
            return Ok(Sealing {
                key: None,
                links,
                service: None,
            });
        }
        let key = bootstrap
            .secret()
            .map(|s| oxccl_seal::JobKey::derive(s.as_bytes(), TCP_KEY_PURPOSE));
        let local = crate::netif::interfaces()
            .map(|ifs| ifs.into_iter().map(|i| i.ip).collect())
            .unwrap_or_default();
        let all: Vec<SealInfo> = bootstrap.all_gather_serde(
            "oxccl/encrypt",
            &SealInfo {
                keyed: key.is_some(),
                tcp: tcp.map(|c| c.ip),
                local,
            },
        )?;
        let me = &all[rank];
        for p in 0..world.min(providers.len()) {
            if providers[p] != Some(Provider::Tcp) {
                continue;
            }
            let them = &all[p];
            if !wants_seal(opts.encrypt, me, them) {
                continue;
            }
            if me.keyed && them.keyed {
                links[p] = true;
                continue;
            }
            let who = if me.keyed {
                format!("rank {p}")
            } else {
                "this rank".to_string()
            };
            if opts.encrypt == Encrypt::On {
                return Err(Error::Config(format!(
                    "rank {rank}: OXCCL_ENCRYPT=on seals the tcp link to rank {p}, and {who} \
                     has no job secret to derive the key from: give every rank the job's secret \
                     (OXCCL_SECRET or OXCCL_SECRET_FILE)"
                )));
            }
            crate::log_warn(format!(
                "rank {rank}: the tcp link to rank {p} leaves the host and is not encrypted: \
                 {who} has no job secret (OXCCL_SECRET) to derive the key from"
            ));
        }
        Ok(Sealing {
            key,
            links,
            service: None,
        })
    }

    /// The job key for the link to peer `p`, if that link is sealed.
    fn key_for(&self, p: usize) -> Option<oxccl_seal::JobKey> {
        if p == self.links.len() {
            return self.service.clone();
        }
        if self.links.get(p).copied().unwrap_or(false) {
            self.key.clone()
        } else {
            None
        }
    }

    /// The link to the aggregation service (peer `world`, after the ranks) is sealed with
    /// `key` (its own purpose's, from [`crate::agg::Contact::data_seal`]), if any.
    fn set_service(&mut self, world: usize, key: Option<oxccl_seal::JobKey>) {
        self.links.truncate(world);
        self.service = key;
    }
}

/// The engine's settings from the options and where the ranks are (`hosts`; this one's is
/// `host`): injected faults, how long a waiting rank spins and yields, whether it may run
/// mailboxes.
fn configure_engine(engine: &mut Engine, opts: &Options, hosts: &[String], host: &str) {
    let rank = engine.rank;
    engine.faults = opts
        .faults
        .as_ref()
        .and_then(|f| Injector::for_rank(f, rank));
    // More ranks on this host than CPUs: a rank that waits must give its CPU away at once
    // (spinning would hold off the very peer it waits for), as MPI's yield-when-idle does.
    let local = hosts.iter().filter(|h| **h == host).count();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    engine.set_spin(opts.idle_spin.unwrap_or(if local > cpus {
        Duration::ZERO
    } else {
        Duration::from_micros(50)
    }));
    let one_host = hosts.iter().all(|h| *h == host);
    engine.yield_for = opts.idle_yield.unwrap_or(if one_host {
        Duration::from_millis(2)
    } else {
        Duration::ZERO
    });
    engine.mailbox_allowed = opts.mailboxes != Some(false);
    engine.compiled = opts.compiled;
}

/// Joins the aggregation service (`contact`) with the link `connect_links` made for it (the
/// last), and agrees with every rank whether the job has it: unless every rank joined, none
/// uses it. Returns the membership and the slots the job got.
fn join_aggregator(
    bootstrap: &Bootstrap,
    opts: &Options,
    contact: crate::agg::Contact,
    comm_id: u64,
    geo: Geometry,
    links: &mut Vec<Link>,
    link_of: &mut Vec<usize>,
) -> Result<Option<(crate::agg::Membership, usize)>> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
    let addr = opts.agg_addr.clone().unwrap_or_default();
    let secret = bootstrap.secret().ok_or_else(|| {
        Error::Config(format!(
            "rank {rank}: the aggregation service at {addr} admits jobs by their secret, and \
             this job has none: set OXCCL_SECRET or OXCCL_SECRET_FILE"
        ))
    })?;
    let l = link_of[world];
    let verbs = |what: &str, source| Error::Verbs {
        rank,
        what: format!("{what} the aggregation service at {addr}"),
        source,
    };
    let joined = contact.join(
        secret,
        comm_id,
        rank,
        world,
        geo,
        links[l].provider.name(),
        links[l].qp.endpoint(),
        links[l].local_region(),
        opts.timeout,
    )?;
    let mut joined = match joined {
        crate::agg::Joined::Accepted {
            membership,
            endpoint,
            region,
            pool,
        } => {
            links[l]
                .qp
                .connect(&endpoint)
                .map_err(|e| verbs("connecting to", e))?;
            links[l]
                .connect(region, &geo, l)
                .map_err(|e| verbs("posting receives for", e))?;
            Some((membership, pool))
        }
        crate::agg::Joined::Busy(why) => {
            if log_enabled() {
                crate::log_line(format!(
                    "rank {rank}: the aggregation service at {addr} has no room for this job \
                     ({why}): its all-reduces run without it"
                ));
            }
            None
        }
    };
    let all: Vec<bool> = bootstrap.all_gather_serde("oxccl/agg", &joined.is_some())?;
    if !all.iter().all(|&j| j) {
        if joined.is_some() && log_enabled() {
            crate::log_line(format!(
                "rank {rank}: not every rank joined the aggregation service at {addr}: the job \
                 runs without it"
            ));
        }
        joined = None;
    }
    if joined.is_none() {
        links.truncate(l);
        link_of.truncate(world);
    }
    Ok(joined)
}

#[cfg(test)]
mod seal_tests {
    use super::{SealInfo, wants_seal};
    use oxccl_verbs::Encrypt;

    fn info(tcp: &str, local: &[&str]) -> SealInfo {
        SealInfo {
            keyed: true,
            tcp: Some(tcp.parse().unwrap()),
            local: local.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    /// `auto` leaves a link plain only when each end's address is on the other's host, and
    /// both ends decide alike, whichever way round they look at it.
    #[test]
    fn the_seal_decision_is_symmetric() {
        let one_host_a = info("10.0.0.1", &["127.0.0.1", "10.0.0.1"]);
        let one_host_b = info("10.0.0.1", &["127.0.0.1", "10.0.0.1"]);
        let lo_a = info("127.0.0.1", &["127.0.0.1"]);
        let lo_b = info("127.0.0.1", &["127.0.0.1"]);
        let ns_a = info("10.9.0.1", &["127.0.0.1", "10.9.0.1"]);
        let ns_b = info("10.9.0.2", &["127.0.0.1", "10.9.0.2"]);
        // An odd one: a's address is b's, but b's is not a's (a badly set OXCCL_TCP_ADDR).
        let odd_a = info("10.0.0.1", &["10.0.0.1"]);
        let odd_b = info("10.0.0.2", &["10.0.0.1", "10.0.0.2"]);
        let cases = [
            (&one_host_a, &one_host_b, false),
            (&lo_a, &lo_b, false),
            (&ns_a, &ns_b, true),
            (&odd_a, &odd_b, true),
        ];
        for (a, b, sealed) in cases {
            assert_eq!(
                wants_seal(Encrypt::Auto, a, b),
                sealed,
                "{:?} {:?}",
                a.tcp,
                b.tcp
            );
            assert_eq!(
                wants_seal(Encrypt::Auto, b, a),
                sealed,
                "{:?} {:?}",
                b.tcp,
                a.tcp
            );
            assert!(wants_seal(Encrypt::On, a, b) && wants_seal(Encrypt::On, b, a));
            assert!(!wants_seal(Encrypt::Off, a, b) && !wants_seal(Encrypt::Off, b, a));
        }
        // An end that reaches no peer over tcp (no address): sealed under auto.
        let none = SealInfo {
            keyed: true,
            tcp: None,
            local: vec![],
        };
        assert!(wants_seal(Encrypt::Auto, &none, &lo_a) && wants_seal(Encrypt::Auto, &lo_a, &none));
    }
}
