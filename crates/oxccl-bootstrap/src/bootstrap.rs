//! Rank membership over a store: join, all-gather, barrier.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::abort::{ABORT_POLL, AbortHandle};
use crate::client::{ClientOptions, TcpStore};
use crate::config::{Config, Launcher};
use crate::error::{Error, Result};
use crate::secret::{Secret, random_bytes};
use crate::server::StoreServer;
use crate::store::Store;

/// What every rank registers when it joins.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Member {
    rank: usize,
    world_size: usize,
    pid: u32,
    host: String,
    nonce: u64,
}

impl Member {
    fn describe(&self) -> String {
        format!("pid {} on {}", self.pid, self.host)
    }
}

/// A rank's error after the join, published so that the others stop waiting for it.
#[derive(Debug, Serialize, Deserialize)]
struct Failed {
    rank: usize,
    message: String,
}

/// The first world size registered, and by whom.
#[derive(Debug, Serialize, Deserialize)]
struct WorldSize {
    rank: usize,
    world_size: usize,
}

/// Why a rank stopped the join; published so that every rank fails with the same error.
#[derive(Debug, Serialize, Deserialize)]
enum Abort {
    WorldSize {
        rank: usize,
        world_size: usize,
        other_rank: usize,
        other_world_size: usize,
    },
    Duplicate {
        rank: usize,
        first: String,
        second: String,
    },
    OutOfRange {
        rank: usize,
        world_size: usize,
    },
    /// A rank's [`AbortHandle`] stopped its join.
    Aborted {
        rank: usize,
        reason: String,
    },
    /// A rank's join failed with its connection to the store (broken, or closed by the
    /// store for a record that failed authentication): published over a fresh connection,
    /// so that the others fail now rather than time out.
    Failed {
        rank: usize,
        message: String,
    },
    /// Published by the rank that serves the store when its join times out, so that the
    /// others report the same missing ranks rather than the store going away.
    Timeout {
        what: String,
        missing: Vec<usize>,
        world_size: usize,
        timeout_ms: u64,
    },
}

impl Abort {
    fn into_error(self) -> Error {
        match self {
            Abort::WorldSize {
                rank,
                world_size,
                other_rank,
                other_world_size,
            } => Error::WorldSizeMismatch {
                rank,
                world_size,
                other_rank,
                other_world_size,
            },
            Abort::Duplicate {
                rank,
                first,
                second,
            } => Error::DuplicateRank {
                rank,
                first,
                second,
            },
            Abort::OutOfRange { rank, world_size } => Error::RankOutOfRange { rank, world_size },
            Abort::Aborted { rank, reason } => Error::RankFailed {
                rank,
                message: format!("it aborted its join ({reason})"),
            },
            Abort::Failed { rank, message } => Error::RankFailed { rank, message },
            Abort::Timeout {
                what,
                missing,
                world_size,
                timeout_ms,
            } => Error::RanksMissing {
                what,
                missing,
                world_size,
                timeout: Duration::from_millis(timeout_ms),
            },
        }
    }
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into())
}

fn to_json<T: Serialize>(what: impl FnOnce() -> String, v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|source| Error::Serde {
        what: what(),
        source,
    })
}

fn from_json<T: DeserializeOwned>(what: impl FnOnce() -> String, v: &[u8]) -> Result<T> {
    serde_json::from_slice(v).map_err(|source| Error::Serde {
        what: what(),
        source,
    })
}

/// Key names of one job in the store.
struct Keys {
    prefix: String,
}

impl Keys {
    fn world_size(&self) -> String {
        format!("{}join/world_size", self.prefix)
    }
    fn abort(&self) -> String {
        format!("{}join/abort", self.prefix)
    }
    fn failed(&self) -> String {
        format!("{}failed", self.prefix)
    }
    fn member(&self, rank: usize) -> String {
        format!("{}join/rank/{rank}", self.prefix)
    }
    fn collective(&self, kind: &str, tag: &str, generation: u64, rank: usize) -> String {
        format!("{}{kind}/{tag}/{generation}/{rank}", self.prefix)
    }
}

/// Ranks named by keys that end in `/<rank>`.
fn ranks_of(keys: &[String]) -> Vec<usize> {
    keys.iter()
        .filter_map(|k| k.rsplit('/').next()?.parse().ok())
        .collect()
}

/// A rank's membership in a job: who it is, and a store shared with the other ranks.
///
/// Made by [`Bootstrap::from_env`] (launcher environments) or [`Bootstrap::new`] (explicit
/// [`Config`]); both return after every rank has joined. Rank 0 serves the store unless a
/// standalone one runs; it must outlive the others' use of it, so end a job with
/// [`Bootstrap::close`] on every rank (rank 0's waits for the others to disconnect).
pub struct Bootstrap {
    rank: usize,
    world_size: usize,
    local_rank: Option<usize>,
    local_world_size: Option<usize>,
    launcher: Launcher,
    store_addr: String,
    secret: Option<Secret>,
    timeout: Duration,
    keys: Keys,
    generations: Mutex<HashMap<String, u64>>,
    /// Watched by every wait while set ([`Bootstrap::set_abort`]).
    abort: Mutex<Option<AbortHandle>>,
    /// Whether rank 0 serves the store (then a store gone names it).
    rank0_serves: bool,
    /// Whether [`Bootstrap::fail`] has waited for the others to leave (it does once).
    fail_waited: std::sync::atomic::AtomicBool,
    // Dropped before the server: rank 0's own handle first.
    store: Box<dyn Store>,
    server: Option<StoreServer>,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("launcher", &self.launcher)
            .field("store_addr", &self.store_addr)
            .finish_non_exhaustive()
    }
}

/// Binds rank 0's store: the configured bind address, else the store address, else (when the
/// store address is not one of this host's) every interface on its port.
fn bind_store(config: &Config, secret: &Secret) -> Result<StoreServer> {
    if let Some(bind) = &config.bind_addr {
        return StoreServer::bind(bind, secret.clone());
    }
    match StoreServer::bind(&config.store_addr, secret.clone()) {
        Err(Error::Bind { addr, source })
            if source.kind() == std::io::ErrorKind::AddrNotAvailable =>
        {
            // An address worked out from the launcher must be rank 0's own: serving on every
            // interface here would leave the others knocking at another host.
            if let Some(from) = &config.store_addr_inferred {
                return Err(Error::Config(format!(
                    "rank 0 is not on the store's host {addr} (inferred from {from}): set \
                     MASTER_ADDR (and MASTER_PORT) to rank 0's host"
                )));
            }
            let any = addr
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| match a {
                    std::net::SocketAddr::V4(a) => format!("0.0.0.0:{}", a.port()),
                    std::net::SocketAddr::V6(a) => format!("[::]:{}", a.port()),
                });
            match any {
                Some(any) => {
                    debug!("{addr} is not an address of this host; serving the store on {any}");
                    StoreServer::bind(&any, secret.clone())
                }
                None => Err(Error::Bind { addr, source }),
            }
        }
        r => r,
    }
}

impl Bootstrap {
    /// Reads the launcher environment ([`Config::from_env`]), then [`Bootstrap::new`].
    pub fn from_env() -> Result<Bootstrap> {
        Bootstrap::new(Config::from_env()?)
    }

    /// Serves the store (rank 0, unless `config.serve_store` is false) or connects to it
    /// (retrying until `config.timeout`), then joins: registers this rank and waits for all.
    ///
    /// Fails with [`Error::RankOutOfRange`], [`Error::DuplicateRank`],
    /// [`Error::WorldSizeMismatch`] (every rank still joining fails with the same error), or
    /// [`Error::RanksMissing`] listing the ranks that did not join within the timeout.
    pub fn new(config: Config) -> Result<Bootstrap> {
        Bootstrap::new_with(config, None)
    }

    /// [`Bootstrap::new`] that `abort` can stop from another thread: while it connects to the
    /// store or waits for the others to join, an abort makes it fail within about
    /// [`ABORT_POLL`] with [`Error::Aborted`] naming the ranks it was waiting for, and the
    /// ranks still joining fail at once with [`Error::RankFailed`] naming this one. The
    /// bootstrap it returns keeps watching `abort` until [`Bootstrap::set_abort`] changes it.
    pub fn new_abortable(config: Config, abort: &AbortHandle) -> Result<Bootstrap> {
        Bootstrap::new_with(config, Some(abort))
    }

    fn new_with(config: Config, abort: Option<&AbortHandle>) -> Result<Bootstrap> {
        // No secret set: the per-user secret file (Secret::user_default).
        let secret = match config.secret.clone() {
            Some(s) => s,
            None => Secret::user_default()?,
        };
        if config.world_size == 0 {
            return Err(Error::Config("the world size is 0".into()));
        }
        let pid = std::process::id();
        let host = hostname();
        let opts = ClientOptions {
            connect_timeout: config.timeout,
            label: format!("rank {} pid {pid} on {host}", config.rank),
            abort: abort.cloned(),
            ..ClientOptions::default()
        };
        let keys = Keys {
            prefix: format!("oxccl/{}/", config.job_id),
        };
        if config.rank >= config.world_size {
            // Tell the others, so that they fail now rather than time out; but do not wait
            // long for a store to report a mistake that is already known.
            let quick = ClientOptions {
                connect_timeout: config.timeout.min(Duration::from_secs(10)),
                ..opts
            };
            let abort = Abort::OutOfRange {
                rank: config.rank,
                world_size: config.world_size,
            };
            if let Ok(client) = TcpStore::connect_with(&config.store_addr, &secret, &quick) {
                publish_abort(&client, &keys, &abort);
            }
            return Err(abort.into_error());
        }
        let (store, server, store_addr): (Box<dyn Store>, _, _) =
            if config.rank == 0 && config.serve_store {
                let server = bind_store(&config, &secret)?;
                let shown = if config.store_addr.ends_with(":0") {
                    server.addr().to_string()
                } else {
                    config.store_addr.clone()
                };
                let store = server.store().with_location(&shown);
                (Box::new(store), Some(server), shown)
            } else {
                let client = TcpStore::connect_with(&config.store_addr, &secret, &opts)
                    .map_err(|e| match e {
                        Error::Aborted {
                            reason, waiting, ..
                        } => Error::Aborted {
                            rank: config.rank,
                            reason,
                            waiting,
                        },
                        Error::Connect {
                            addr,
                            timeout,
                            reason,
                        } if config.serve_store => Error::Connect {
                            addr,
                            timeout,
                            reason: format!(
                                "{reason} (rank 0 serves the store: it has not started it, or \
                                 exited)"
                            ),
                        },
                        e => e,
                    })
                    .map_err(|e| with_inferred_hint(e, &config))?;
                (Box::new(client), None, config.store_addr.clone())
            };
        let b = Bootstrap {
            rank: config.rank,
            world_size: config.world_size,
            local_rank: config.local_rank,
            local_world_size: config.local_world_size,
            launcher: config.launcher,
            store_addr,
            secret: Some(secret),
            timeout: config.timeout,
            keys,
            generations: Mutex::new(HashMap::new()),
            abort: Mutex::new(abort.cloned()),
            rank0_serves: config.serve_store,
            fail_waited: Default::default(),
            store,
            server,
        };
        if let Err(e) = b
            .join(pid, host)
            .map_err(|e| with_inferred_hint(b.name_store_owner(e), &config))
        {
            if let Some(server) = &b.server {
                // The store goes away with this process: first let the ranks still joining
                // learn why (they watch the abort record), so that they report the same
                // error rather than the store going away.
                if let Error::RanksMissing {
                    what,
                    missing,
                    world_size,
                    timeout,
                } = &e
                {
                    b.abort(Abort::Timeout {
                        what: what.clone(),
                        missing: missing.clone(),
                        world_size: *world_size,
                        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                    });
                }
                server.wait_for_clients_to_leave(b.timeout.min(Duration::from_secs(5)));
            } else if matches!(
                e,
                Error::StoreGone { .. } | Error::Protocol { .. } | Error::Rejected { .. }
            ) {
                // This rank's connection is what failed: tell the others over a fresh one
                // (briefly: the store may be gone indeed).
                if let Some(client) = b.fresh_client() {
                    let abort = Abort::Failed {
                        rank: b.rank,
                        message: e.to_string(),
                    };
                    publish_abort(&client, &b.keys, &abort);
                    // And for the waits after the join (the others may be past theirs).
                    let notice = Failed {
                        rank: b.rank,
                        message: e.to_string(),
                    };
                    if let Ok(bytes) = serde_json::to_vec(&notice) {
                        let _ = client.compare_set(&b.keys.failed(), None, &bytes);
                    }
                }
            }
            return Err(e);
        }
        Ok(b)
    }

    /// Joins over a store that is already connected (and authenticated): for tests and for
    /// embedding in another rendezvous. `job_id` namespaces the keys.
    pub fn with_store(
        rank: usize,
        world_size: usize,
        store: Box<dyn Store>,
        job_id: &str,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        Bootstrap::with_store_watched(rank, world_size, store, job_id, timeout, None)
    }

    /// [`Bootstrap::with_store`] whose join (and every later wait, as
    /// [`Bootstrap::set_abort`] says) stops with [`Error::Aborted`] once `abort` is aborted.
    pub fn with_store_abortable(
        rank: usize,
        world_size: usize,
        store: Box<dyn Store>,
        job_id: &str,
        timeout: Duration,
        abort: &AbortHandle,
    ) -> Result<Bootstrap> {
        Bootstrap::with_store_watched(rank, world_size, store, job_id, timeout, Some(abort))
    }

    fn with_store_watched(
        rank: usize,
        world_size: usize,
        store: Box<dyn Store>,
        job_id: &str,
        timeout: Duration,
        abort: Option<&AbortHandle>,
    ) -> Result<Bootstrap> {
        let keys = Keys {
            prefix: format!("oxccl/{job_id}/"),
        };
        if world_size == 0 {
            return Err(Error::Config("the world size is 0".into()));
        }
        if rank >= world_size {
            let abort = Abort::OutOfRange { rank, world_size };
            publish_abort(store.as_ref(), &keys, &abort);
            return Err(abort.into_error());
        }
        let b = Bootstrap {
            rank,
            world_size,
            local_rank: None,
            local_world_size: None,
            launcher: Launcher::Explicit,
            store_addr: store.location(),
            secret: None,
            timeout,
            keys,
            generations: Mutex::new(HashMap::new()),
            abort: Mutex::new(abort.cloned()),
            rank0_serves: false,
            fail_waited: Default::default(),
            store,
            server: None,
        };
        b.join(std::process::id(), hostname())?;
        Ok(b)
    }

    fn join(&self, pid: u32, host: String) -> Result<()> {
        let start = Instant::now();
        let (rank, world_size) = (self.rank, self.world_size);
        // The first rank to get here fixes the world size; every other rank compares.
        let ws = to_json(String::new, &WorldSize { rank, world_size })?;
        let o = self.store.compare_set(&self.keys.world_size(), None, &ws)?;
        if !o.swapped {
            let first: WorldSize = from_json(
                || "the world size registered in the store".into(),
                o.current.as_deref().unwrap_or_default(),
            )?;
            if first.world_size != world_size {
                return Err(self.abort(Abort::WorldSize {
                    rank,
                    world_size,
                    other_rank: first.rank,
                    other_world_size: first.world_size,
                }));
            }
        }
        let me = Member {
            rank,
            world_size,
            pid,
            host,
            nonce: u64::from_le_bytes(random_bytes()?),
        };
        let record = to_json(String::new, &me)?;
        let o = self
            .store
            .compare_set(&self.keys.member(rank), None, &record)?;
        if !o.swapped {
            let first: Member = from_json(
                || format!("the record of rank {rank} in the store"),
                o.current.as_deref().unwrap_or_default(),
            )?;
            return Err(self.abort(Abort::Duplicate {
                rank,
                first: first.describe(),
                second: me.describe(),
            }));
        }
        debug!(
            "rank {rank} of {world_size} registered in the store at {}",
            self.store_addr
        );
        // Wait for everyone, in growing slices, watching for another rank's abort.
        let mut missing: Vec<String> = (0..world_size).map(|r| self.keys.member(r)).collect();
        let abort_key = self.keys.abort();
        let deadline = start + self.timeout;
        let mut slice = Duration::from_millis(20);
        let watched = self.abort_handle();
        loop {
            if let Some(reason) = watched.as_ref().and_then(AbortHandle::reason) {
                let waiting = format!(
                    "for ranks {:?} of {world_size} to join the store at {}",
                    ranks_of(&missing),
                    self.store_addr
                );
                let _ = self.abort(Abort::Aborted {
                    rank,
                    reason: reason.clone(),
                });
                return Err(Error::Aborted {
                    rank,
                    reason,
                    waiting,
                });
            }
            match self.store.multi_get(&[&abort_key], Duration::ZERO) {
                Ok(mut v) => {
                    let a: Abort = from_json(
                        || "the abort record in the store".into(),
                        &v.pop().unwrap_or_default(),
                    )?;
                    return Err(a.into_error());
                }
                Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::RanksMissing {
                    what: format!("join the store at {}", self.store_addr),
                    missing: ranks_of(&missing),
                    world_size,
                    timeout: self.timeout,
                });
            }
            let refs: Vec<&str> = missing.iter().map(String::as_str).collect();
            let most = if watched.is_some() {
                self.abort_poll()
            } else {
                left
            };
            match self.store.wait(&refs, slice.min(left).min(most)) {
                Ok(()) => break,
                Err(Error::Timeout { missing: m, .. }) => {
                    missing = m;
                    slice = (slice * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
        debug!("rank {rank}: all {world_size} ranks joined");
        Ok(())
    }

    /// A store gone, on a rank that does not serve it while rank 0 does: says that rank 0 (the
    /// store's process) exited or was killed.
    fn name_store_owner(&self, e: Error) -> Error {
        match e {
            Error::StoreGone { addr, reason } if self.rank0_serves && self.rank != 0 => {
                Error::StoreGone {
                    addr,
                    reason: format!("{reason}; rank 0 serves it and exited or was killed"),
                }
            }
            e => e,
        }
    }

    /// Publishes why the join stops (the first reason published wins) and returns it as the
    /// error of this rank.
    fn abort(&self, abort: Abort) -> Error {
        publish_abort(self.store.as_ref(), &self.keys, &abort);
        abort.into_error()
    }

    fn next_generation(&self, kind: &str, tag: &str) -> u64 {
        let mut g = self
            .generations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let n = g.entry(format!("{kind}/{tag}")).or_insert(0);
        let gen_now = *n;
        *n += 1;
        gen_now
    }

    /// Publishes `data` under a fresh key of (`kind`, `tag`, generation) and waits for every
    /// rank's; returns their data in rank order when `fetch`.
    fn collective(
        &self,
        kind: &str,
        tag: &str,
        data: &[u8],
        fetch: bool,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        self.collective_inner(kind, tag, data, fetch, timeout)
            .map_err(|e| self.name_store_owner(e))
    }

    fn collective_inner(
        &self,
        kind: &str,
        tag: &str,
        data: &[u8],
        fetch: bool,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let generation = self.next_generation(kind, tag);
        let key = |r| self.keys.collective(kind, tag, generation, r);
        self.store.set(&key(self.rank), data)?;
        let keys: Vec<String> = (0..self.world_size).map(key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let deadline = Instant::now() + timeout;
        let describe = |missing: &[String]| {
            format!(
                "for ranks {:?} of {} to reach {} {tag:?} (round {generation}) in the store at {}",
                ranks_of(missing),
                self.world_size,
                if fetch { "all-gather" } else { "barrier" },
                self.store_addr
            )
        };
        let result = self
            .wait_watching(&keys, deadline, &describe)
            .and_then(|()| {
                if fetch {
                    let left = deadline.saturating_duration_since(Instant::now());
                    self.store
                        .multi_get(&refs, left.max(Duration::from_secs(1)))
                } else {
                    Ok(Vec::new())
                }
            });
        let values = result.map_err(|e| match e {
            Error::Timeout { missing, .. } => Error::RanksMissing {
                what: format!(
                    "reach {} {tag:?} (round {generation}) in the store at {}",
                    if fetch { "all-gather" } else { "barrier" },
                    self.store_addr
                ),
                missing: ranks_of(&missing),
                world_size: self.world_size,
                timeout,
            },
            e => e,
        })?;
        // Every rank has posted this round, so every rank is done reading the previous one.
        if generation > 0 {
            let _ = self
                .store
                .delete(&self.keys.collective(kind, tag, generation - 1, self.rank));
        }
        Ok(values)
    }

    /// Waits until every key of `keys` exists, in growing slices, watching for a rank's
    /// failure notice ([`Bootstrap::fail`]): a rank that gave up fails the wait at once.
    /// While an abort handle is set, looks at it every [`ABORT_POLL`] (longer in large jobs);
    /// an abort fails the
    /// wait with [`Error::Aborted`], `describe(missing keys)` saying what it waited for.
    fn wait_watching(
        &self,
        keys: &[String],
        deadline: Instant,
        describe: &dyn Fn(&[String]) -> String,
    ) -> Result<()> {
        let mut missing: Vec<String> = keys.to_vec();
        let mut slice = Duration::from_millis(20);
        let watched = self.abort_handle();
        loop {
            if let Some(reason) = watched.as_ref().and_then(AbortHandle::reason) {
                return Err(Error::Aborted {
                    rank: self.rank,
                    reason,
                    waiting: describe(&missing),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let most = if watched.is_some() {
                self.abort_poll()
            } else {
                left
            };
            let refs: Vec<&str> = missing.iter().map(String::as_str).collect();
            match self.store.wait(&refs, slice.min(left).min(most)) {
                Ok(()) => return Ok(()),
                Err(Error::Timeout { missing: m, .. }) if !left.is_zero() => {
                    missing = m;
                    slice = (slice * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
            if let Some(f) = self.failure()? {
                return Err(Error::RankFailed {
                    rank: f.rank,
                    message: f.message,
                });
            }
        }
    }

    /// The failure notice in the store, if a rank published one.
    fn failure(&self) -> Result<Option<Failed>> {
        match self.store.multi_get(&[&self.keys.failed()], Duration::ZERO) {
            Ok(mut v) => Ok(Some(from_json(
                || "the failure notice in the store".into(),
                &v.pop().unwrap_or_default(),
            )?)),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The failure notice a rank published ([`Bootstrap::fail`]), if any: its rank and
    /// message, as [`Error::RankFailed`]. Looks once, without waiting.
    pub fn failure_notice(&self) -> Option<Error> {
        match self.failure() {
            Ok(Some(f)) => Some(Error::RankFailed {
                rank: f.rank,
                message: f.message,
            }),
            _ => None,
        }
    }

    /// A new connection to the store (a client rank of [`Bootstrap::new`] only), tried
    /// briefly: to report this rank's failure when its own connection broke.
    fn fresh_client(&self) -> Option<TcpStore> {
        if self.server.is_some() {
            return None;
        }
        let secret = self.secret.as_ref()?;
        let quick = ClientOptions {
            connect_timeout: self.timeout.min(Duration::from_secs(5)),
            label: format!(
                "rank {} pid {} (reporting its failure)",
                self.rank,
                std::process::id()
            ),
            abort: None,
            ..ClientOptions::default()
        };
        TcpStore::connect_with(&self.store_addr, secret, &quick).ok()
    }

    /// Tells the other ranks that this one gave up with `message` (the first notice
    /// published wins): their bootstrap waits ([`Bootstrap::all_gather`],
    /// [`Bootstrap::barrier`]) then fail at once with [`Error::RankFailed`] instead of timing
    /// out. On the rank that serves the store, waits (up to 5 s, the first time only) for the
    /// others to read it and disconnect, since the store goes away with this process.
    pub fn fail(&self, message: &str) {
        let notice = Failed {
            rank: self.rank,
            message: message.to_owned(),
        };
        if let Ok(bytes) = serde_json::to_vec(&notice) {
            let posted = self.store.compare_set(&self.keys.failed(), None, &bytes);
            // This rank's own connection broke (or was closed for a record that failed to
            // open): post it over a fresh one, so that the others do not wait it out.
            if matches!(
                posted,
                Err(Error::StoreGone { .. } | Error::Protocol { .. } | Error::Rejected { .. })
            ) && let Some(client) = self.fresh_client()
            {
                let _ = client.compare_set(&self.keys.failed(), None, &bytes);
            }
        }
        if let Some(server) = &self.server
            && !self
                .fail_waited
                .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            server.wait_for_clients_to_leave(self.timeout.min(Duration::from_secs(5)));
        }
    }

    /// Makes every later wait (join excepted: see [`Bootstrap::new_abortable`]) watch `abort`,
    /// or none (`None`): an abort then fails the wait within about [`ABORT_POLL`] with
    /// [`Error::Aborted`]. Waits also look at the store's failure notice that often, so that
    /// a rank watching a handle learns of another's failure (or abort) sooner.
    pub fn set_abort(&self, abort: Option<AbortHandle>) {
        *self.abort.lock().unwrap_or_else(|e| e.into_inner()) = abort;
    }

    /// How often a wait watching an abort handle returns to look at it: [`ABORT_POLL`], longer
    /// in large jobs (0.2 ms per rank), so that every rank's polling together stays at about
    /// 5,000 store requests a second.
    fn abort_poll(&self) -> Duration {
        ABORT_POLL.max(Duration::from_micros(200).saturating_mul(self.world_size as u32))
    }

    /// The abort handle the waits watch, if any ([`Bootstrap::set_abort`]).
    pub fn abort_handle(&self) -> Option<AbortHandle> {
        self.abort.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The IP address of this host's interface that routes to the store: the local address
    /// of this rank's store connection, or, on the rank that serves the store, the source
    /// address the kernel picks for the store's own address. `None` when neither is known
    /// (a store handed in without a network connection).
    pub fn route_addr(&self) -> Option<std::net::IpAddr> {
        if let Some(a) = self.store.local_addr() {
            return Some(a.ip());
        }
        route_to(&self.store_addr)
    }

    /// Every rank contributes `data`; returns all contributions in rank order.
    ///
    /// Ranks call it collectively with the same `tag`s in the same order; repeated calls with
    /// one tag are separate rounds (keys never collide, and the store keeps only the last two
    /// rounds of each tag). Waits up to [`Bootstrap::timeout`]; the error lists the ranks that
    /// did not arrive.
    pub fn all_gather(&self, tag: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.collective("allgather", tag, data, true, self.timeout)
    }

    /// [`Bootstrap::all_gather`] of serializable values (JSON on the wire), e.g. queue pair
    /// endpoints: `bootstrap.all_gather_serde("qp", &qp.endpoint())`.
    pub fn all_gather_serde<T: Serialize + DeserializeOwned>(
        &self,
        tag: &str,
        value: &T,
    ) -> Result<Vec<T>> {
        let bytes = to_json(|| format!("all-gather {tag:?}: this rank's value"), value)?;
        self.all_gather(tag, &bytes)?
            .iter()
            .enumerate()
            .map(|(r, v)| from_json(|| format!("all-gather {tag:?}: the value of rank {r}"), v))
            .collect()
    }

    /// Waits until every rank has reached the barrier `tag` (one round per call), for at most
    /// `timeout`; the error lists the ranks that did not.
    pub fn barrier(&self, tag: &str, timeout: Duration) -> Result<()> {
        self.collective("barrier", tag, &[], false, timeout)
            .map(drop)
    }

    /// Ends this rank's use of the store. Rank 0, when it serves the store, first waits (up
    /// to [`Bootstrap::timeout`]) for the other ranks to disconnect, so that their last
    /// requests are answered; the error then lists the ranks still connected.
    pub fn close(mut self) -> Result<()> {
        let Some(server) = self.server.take() else {
            return Ok(());
        };
        let left = server.wait_for_clients_to_leave(self.timeout);
        drop(server);
        if left.is_empty() {
            return Ok(());
        }
        warn!("rank 0 stopped the store while these were still connected: {left:?}");
        let missing = left
            .iter()
            .filter_map(|l| l.strip_prefix("rank ")?.split(' ').next()?.parse().ok())
            .collect();
        Err(Error::RanksMissing {
            what: format!("disconnect from the store at {}", self.store_addr),
            missing,
            world_size: self.world_size,
            timeout: self.timeout,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank among this host's processes, when the launcher said.
    pub fn local_rank(&self) -> Option<usize> {
        self.local_rank
    }

    /// Number of ranks on this host, when the launcher said.
    pub fn local_world_size(&self) -> Option<usize> {
        self.local_world_size
    }

    /// The launcher whose environment configured this rank.
    pub fn launcher(&self) -> Launcher {
        self.launcher
    }

    /// The store's address.
    pub fn store_addr(&self) -> &str {
        &self.store_addr
    }

    /// The job id that namespaces this bootstrap's keys (`oxccl/<job id>/...`): the
    /// [`Config::job_id`], or the one given to [`Bootstrap::with_store`].
    pub fn job_id(&self) -> &str {
        self.keys
            .prefix
            .strip_prefix("oxccl/")
            .and_then(|p| p.strip_suffix('/'))
            .unwrap_or(&self.keys.prefix)
    }

    /// The store, for the caller's own keys (keep them out of the `oxccl/` prefix).
    pub fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    /// The store server, on the rank that serves it.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    /// The job's shared secret (`None` when made by [`Bootstrap::with_store`]).
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }

    /// How long joins and collectives wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes how long collectives wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
}

/// A failure to reach the store, or ranks missing from it, when its address was worked out
/// from the launcher's variables: says so, and how to give it.
fn with_inferred_hint(e: Error, config: &Config) -> Error {
    let Some(from) = &config.store_addr_inferred else {
        return e;
    };
    let hint = format!(
        " (the store's address was inferred from {from}; if rank 0 does not run there, set \
         MASTER_ADDR and MASTER_PORT)"
    );
    match e {
        Error::Connect {
            addr,
            timeout,
            reason,
        } => Error::Connect {
            addr,
            timeout,
            reason: reason + &hint,
        },
        Error::RanksMissing {
            what,
            missing,
            world_size,
            timeout,
        } => Error::RanksMissing {
            what: what + &hint,
            missing,
            world_size,
            timeout,
        },
        e => e,
    }
}

/// The source address this host uses towards `addr` (`host:port`): a UDP socket connected
/// there (which sends nothing) reads it off the routing table.
pub fn route_to(addr: &str) -> Option<std::net::IpAddr> {
    let dest = addr.to_socket_addrs().ok()?.next()?;
    if dest.ip().is_unspecified() {
        return None;
    }
    let any: std::net::SocketAddr = if dest.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = std::net::UdpSocket::bind(any).ok()?;
    sock.connect(dest).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

fn publish_abort(store: &dyn Store, keys: &Keys, abort: &Abort) {
    if let Ok(bytes) = serde_json::to_vec(abort) {
        let _ = store.compare_set(&keys.abort(), None, &bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::thread;

    const T: Duration = Duration::from_secs(5);

    fn spawn_ranks<R: Send + 'static>(
        ranks: &[(usize, usize)],
        timeout: Duration,
        body: impl Fn(Bootstrap) -> R + Send + Sync + 'static,
    ) -> Vec<Result<R>> {
        let store = MemoryStore::new();
        let body = std::sync::Arc::new(body);
        let handles: Vec<_> = ranks
            .iter()
            .map(|&(rank, world)| {
                let store = store.clone();
                let body = body.clone();
                thread::spawn(move || {
                    Bootstrap::with_store(rank, world, Box::new(store), "t", timeout)
                        .map(|b| body(b))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_gather_in_rank_order_over_rounds_and_tags() {
        let results = spawn_ranks(&[(2, 3), (0, 3), (1, 3)], T, |b| {
            let r = b.rank();
            let mut out = Vec::new();
            for round in 0..3u8 {
                out.push(b.all_gather("x", &[r as u8, round]).unwrap());
                out.push(b.all_gather("y", &[10 + r as u8]).unwrap());
            }
            b.barrier("end", T).unwrap();
            let ser: Vec<(usize, String)> = b.all_gather_serde("s", &(r, format!("r{r}"))).unwrap();
            (out, ser)
        });
        for res in results {
            let (out, ser) = res.unwrap();
            for round in 0..3u8 {
                assert_eq!(
                    out[2 * round as usize],
                    vec![vec![0, round], vec![1, round], vec![2, round]]
                );
                assert_eq!(
                    out[2 * round as usize + 1],
                    vec![vec![10], vec![11], vec![12]]
                );
            }
            assert_eq!(
                ser,
                vec![(0, "r0".into()), (1, "r1".into()), (2, "r2".into())]
            );
        }
    }

    #[test]
    fn old_rounds_are_deleted() {
        let store = MemoryStore::new();
        let s2 = store.clone();
        let t = thread::spawn(move || {
            let b = Bootstrap::with_store(1, 2, Box::new(s2), "t", T).unwrap();
            for _ in 0..10 {
                b.all_gather("x", b"data").unwrap();
            }
        });
        let b = Bootstrap::with_store(0, 2, Box::new(store.clone()), "t", T).unwrap();
        for _ in 0..10 {
            b.all_gather("x", b"data").unwrap();
        }
        t.join().unwrap();
        // join: world size + 2 members; all-gather: at most 2 rounds of 2 ranks.
        assert!(store.len() <= 3 + 4, "{} keys left", store.len());
    }

    #[test]
    fn world_size_one() {
        let b = Bootstrap::with_store(0, 1, Box::new(MemoryStore::new()), "t", T).unwrap();
        assert_eq!(b.all_gather("x", b"me").unwrap(), vec![b"me".to_vec()]);
        b.barrier("b", T).unwrap();
        b.close().unwrap();
    }

    #[test]
    fn join_timeout_lists_missing_ranks() {
        let results = spawn_ranks(&[(0, 4), (1, 4)], Duration::from_millis(300), |_| ());
        for r in results {
            let e = r.unwrap_err();
            match &e {
                Error::RanksMissing {
                    missing,
                    world_size,
                    ..
                } => {
                    assert_eq!((missing.as_slice(), *world_size), (&[2, 3][..], 4));
                }
                e => panic!("{e}"),
            }
            assert!(
                e.to_string()
                    .starts_with("timed out after 0.3s waiting for ranks [2, 3] of 4 to join"),
                "{e}"
            );
        }
    }

    #[test]
    fn join_errors_reach_every_rank() {
        // World sizes disagree.
        for r in spawn_ranks(&[(0, 2), (1, 3)], T, |_| ()) {
            assert!(matches!(r, Err(Error::WorldSizeMismatch { .. })), "{r:?}");
        }
        // Duplicate rank; rank 2 never comes, so rank 0 and the first rank 1 are still
        // waiting when the second rank 1 arrives.
        for r in spawn_ranks(&[(0, 3), (1, 3), (1, 3)], T, |_| ()) {
            match r {
                Err(Error::DuplicateRank { rank: 1, .. }) => {}
                r => panic!("{r:?}"),
            }
        }
        // Out of range.
        for r in spawn_ranks(&[(0, 2), (2, 2)], T, |_| ()) {
            match r {
                Err(Error::RankOutOfRange {
                    rank: 2,
                    world_size: 2,
                }) => {}
                r => panic!("{r:?}"),
            }
        }
    }

    #[test]
    fn a_failed_rank_stops_the_others_waiting() {
        let t0 = Instant::now();
        let results = spawn_ranks(&[(0, 3), (1, 3), (2, 3)], T, |b| {
            if b.rank() == 2 {
                std::thread::sleep(Duration::from_millis(100));
                b.fail("cannot connect to rank 1 at 10.0.0.2:4000 (eth0): refused");
                return Ok(());
            }
            b.barrier("connected", Duration::from_secs(60))
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        for r in &results[..2] {
            match r.as_ref().unwrap() {
                Err(Error::RankFailed { rank: 2, message }) => {
                    assert!(message.contains("10.0.0.2:4000 (eth0)"), "{message}")
                }
                r => panic!("{r:?}"),
            }
        }
        let e = results[0].as_ref().unwrap().as_ref().unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 2 failed: cannot connect to rank 1 at 10.0.0.2:4000 (eth0): refused"
        );
    }

    #[test]
    fn an_inferred_store_address_must_be_rank_0s_own() {
        let secret = Secret::new("inferred-store-test-secret").unwrap();
        let mut config = Config::new(0, 2, "192.0.2.1:29999", secret.clone());
        // Given by the user: rank 0 serves on every interface (the address may be a NAT's).
        let server = bind_store(&config, &secret).unwrap();
        assert_eq!(server.addr().ip().to_string(), "0.0.0.0");
        drop(server);
        config.store_addr_inferred = Some("the first node of SLURM_JOB_NODELIST=\"n[1-2]\"".into());
        let e = bind_store(&config, &secret).unwrap_err().to_string();
        assert!(
            e.contains(
                "rank 0 is not on the store's host 192.0.2.1:29999 (inferred from the first node"
            ) && e.contains("set MASTER_ADDR"),
            "{e}"
        );
        let e = with_inferred_hint(
            Error::Connect {
                addr: "192.0.2.1:29999".into(),
                timeout: Duration::from_secs(1),
                reason: "refused".into(),
            },
            &config,
        );
        assert!(
            e.to_string()
                .contains("refused (the store's address was inferred from"),
            "{e}"
        );
    }

    #[test]
    fn route_to_finds_the_source_address() {
        assert_eq!(
            route_to("127.0.0.1:9"),
            Some(std::net::IpAddr::from([127, 0, 0, 1]))
        );
        assert_eq!(route_to("0.0.0.0:9"), None);
        assert_eq!(route_to("not an address"), None);
    }

    #[test]
    fn collective_timeout_lists_missing_ranks() {
        let results = spawn_ranks(&[(0, 3), (1, 3), (2, 3)], T, |b| {
            if b.rank() == 1 {
                return Ok(());
            }
            b.barrier("b", Duration::from_millis(200))
        });
        for (i, r) in results.into_iter().enumerate() {
            let r = r.unwrap();
            if i == 1 {
                continue;
            }
            let e = r.unwrap_err();
            assert!(
                e.to_string()
                    .contains("waiting for ranks [1] of 3 to reach barrier \"b\" (round 0)"),
                "{e}"
            );
        }
    }
}
