//! Shrinking a communicator: the survivors of a failure (or of an explicit exclusion) agree,
//! through the bootstrap store, on who is gone, and build a communicator of the rest.
//!
//! # How the survivors agree
//!
//! Each shrink has an epoch `e` (1, 2, ... per communicator; a shrink that has to start over
//! takes the next) and its keys live under `oxccl/<comm id>/shrink<e>/agree/`:
//!
//! - `in/<rank>`: each rank that calls shrink checks in with the ranks it excludes (its
//!   `exclude` list plus the peers its failures named), as decimal text, `"1,3"`.
//! - `decision`: the ranks excluded, set once by compare-and-set: the first proposal wins and
//!   every rank adopts it, so all agree even when they saw the failure at different calls or
//!   not at all. A rank proposes the union of every check-in's exclusions as soon as every
//!   rank outside that union has checked in, or, once [`Communicator::timeout`] has passed
//!   since it checked in, that union plus the ranks that have not (they did not answer).
//! - `done/<new rank>`, `failed/<new rank>` and `outcome`: after the new communicator's init
//!   (under the job `<comm id>/shrink<e>`, so a fresh store prefix per epoch), each member
//!   says it is done, or that its init failed (it is alive), and waits (again up to the
//!   timeout) until every member has said one or the other; then the outcome (`ok` when all
//!   are done, else `retry:` and the members that said nothing) is set once by
//!   compare-and-set, and every member abides by it: either all keep the new communicator, or
//!   all drop it (and start the next epoch without the silent ones; with none silent, or this
//!   rank among them, it fails with [`Error::Shrink`]).
//!
//! Every wait has the communicator's timeout as its deadline; none waits on a dead rank's
//! answer for longer. A rank that dies after checking in (a second death during the shrink)
//! is found out by the new communicator's init or by the `done` round: the outcome then says
//! `retry`, naming it, and the survivors shrink again at the next epoch without it, up to
//! [`MAX_ATTEMPTS`] times; a shrink that cannot go on fails with [`Error::Shrink`] naming what
//! it waited for and the ranks that did not answer.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::Bootstrap;

use super::{Communicator, SharedStore};
use crate::error::{Error, Result};

/// How many epochs one call of [`Communicator::shrink`] tries before it gives up.
pub const MAX_ATTEMPTS: u64 = 4;

/// How the store-side part of one epoch ended.
enum Epoch {
    /// The new communicator, agreed by every member.
    Done(Communicator),
    /// Start over without these ranks as well (they died during this epoch).
    Retry(BTreeSet<usize>),
}

fn encode(set: &BTreeSet<usize>) -> String {
    set.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn decode(v: &[u8], world: usize) -> BTreeSet<usize> {
    String::from_utf8_lossy(v)
        .split(',')
        .filter_map(|x| x.trim().parse::<usize>().ok())
        .filter(|&r| r < world)
        .collect()
}

impl Communicator {
    /// Builds a communicator of this one's ranks without `exclude` (and without the peers
    /// that failures on this communicator named), renumbered as [`Communicator::split`]
    /// renumbers: the remaining ranks in their order, from 0.
    ///
    /// Every remaining rank calls it (an excluded rank must not: it gets
    /// [`Error::InvalidArgument`] at once). The ranks need not pass the same `exclude`: they
    /// agree, through the bootstrap store this communicator was created from, on the union
    /// of what they report, so a rank that saw nothing learns the others' news there. A rank that does not call it within
    /// [`Communicator::timeout`] of the first is excluded too. If a rank dies during the
    /// shrink, the survivors shrink again without it (up to 4 epochs); a shrink that cannot
    /// go on returns [`Error::Shrink`] naming the ranks that did not answer. A rank that the
    /// others excluded (they report it failed, or it came too late) gets [`Error::Shrink`]
    /// too. Each wait is bounded by [`Communicator::timeout`].
    ///
    /// This communicator stays usable if nothing failed (its calls must not overlap the
    /// shrink); after a failure it is aborted first, so that its calls still in flight end
    /// with an error. The store must outlive the shrink: with the built-in store, rank 0
    /// serves it and must be among the survivors. Faults injected with
    /// [`Options::faults`](crate::Options::faults) do not carry over to the new communicator.
    /// New connections are made between the survivors (the old ones are not reused).
    ///
    /// # How the ranks agree
    ///
    /// Each shrink has an epoch `e` (1, 2, ... per communicator; one that starts over takes
    /// the next), with its keys under `oxccl/<comm id>/shrink<e>/agree/` in the store: each
    /// rank checks in (`in/<rank>`: the ranks it excludes); the first rank to see every rank
    /// outside the union of those exclusions checked in, or to wait the timeout, sets
    /// `decision` (that union, plus the ranks that did not check in) by compare-and-set, and
    /// everyone adopts it. The rest init a communicator under `<comm id>/shrink<e>`, then say
    /// `done/<new rank>` or `failed/<new rank>`; the first to see every member's answer, or to
    /// wait the timeout, sets `outcome` (`ok`, or `retry:` and the members that said nothing)
    /// by compare-and-set, and all keep the communicator or all start over without those.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use oxccl::{Communicator, Options, ReduceOp};
    /// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = Secret::new("the job's shared secret")?;
    /// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
    /// # let addr = server.addr().to_string();
    /// // Three ranks; rank 1 leaves, ranks 0 and 2 go on as ranks 0 and 1.
    /// let inited = std::sync::Arc::new(std::sync::Barrier::new(3));
    /// let ranks: Vec<_> = (0..3)
    ///     .map(|rank| {
    ///         let inited = inited.clone();
    /// #       let mut config = Config::new(rank, 3, addr.clone(), secret.clone());
    /// #       config.serve_store = false;
    /// #       config.timeout = Duration::from_secs(20);
    ///         std::thread::spawn(move || -> oxccl::Result<Option<(usize, Vec<f32>)>> {
    ///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
    ///             inited.wait(); // (leaving during a peer's init would fail that init)
    ///             if rank == 1 {
    ///                 return Ok(None);
    ///             }
    ///             let small = comm.shrink(&[1])?;
    ///             assert_eq!(small.world_size(), 2);
    ///             let mut v = vec![rank as f32; 4];
    ///             small.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    ///             Ok(Some((small.rank(), v)))
    ///         })
    ///     })
    ///     .collect();
    /// let out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    /// for (old, new) in [(0, 0), (2, 1)] {
    ///     let (rank, v) = out[old].as_ref().unwrap().clone().unwrap();
    ///     assert_eq!(rank, new);
    ///     assert_eq!(v, vec![2.0; 4]); // 0 + 2
    /// }
    /// # Ok(()) }
    /// ```
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        let (rank, world) = (self.inner.rank, self.inner.world);
        let invalid = |msg: String| Error::InvalidArgument {
            rank,
            msg: format!("shrink: {msg}"),
        };
        if let Some(r) = exclude.iter().find(|&&r| r >= world) {
            return Err(invalid(format!(
                "rank {r} is outside a world of {world} ranks"
            )));
        }
        if exclude.contains(&rank) {
            return Err(invalid(format!(
                "this rank ({rank}) is in the exclude list; only the remaining ranks call shrink"
            )));
        }
        let failed = self.failed_peers();
        let mut suspects: BTreeSet<usize> = exclude.iter().copied().collect();
        suspects.extend(failed.iter().copied().filter(|&p| p != rank));
        if self.lock().poisoned.is_some() || self.inner.abort.is_set() {
            // Calls still in flight end now (with an error), and peers that saw nothing are
            // told.
            self.abort();
        }
        let timeout = self.timeout();
        let mut last_missing = BTreeSet::new();
        for _ in 0..MAX_ATTEMPTS {
            let epoch = self
                .inner
                .shrink_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            match self.shrink_epoch(epoch, &suspects, timeout)? {
                Epoch::Done(c) => return Ok(c),
                Epoch::Retry(more) => {
                    crate::log_warn(format!(
                        "rank {rank}: shrink epoch {epoch}: ranks {more:?} did not finish; \
                         shrinking again without them"
                    ));
                    suspects.extend(more.iter().copied());
                    last_missing = more;
                }
            }
        }
        Err(Error::Shrink {
            rank,
            epoch: self
                .inner
                .shrink_seq
                .load(std::sync::atomic::Ordering::Relaxed),
            detail: format!("gave up after {MAX_ATTEMPTS} epochs, each with ranks dying"),
            missing: last_missing.into_iter().collect(),
        })
    }

    /// [`Communicator::shrink`] without the ranks that failures on this communicator named
    /// ([`Error::PeerFailed`]'s `peer`, on this rank or, through the store, on any other):
    /// what every survivor calls after a peer died. A rank that saw no failure calls it too
    /// and learns from the others who is gone. The communicator is aborted first, so that
    /// calls still in flight on it end with an error.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use oxccl::{Communicator, Options, ReduceOp};
    /// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = Secret::new("the job's shared secret")?;
    /// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
    /// # let addr = server.addr().to_string();
    /// // Rank 2 of three leaves without a word (as a crashed process would); the others
    /// // fail, shrink, and go on.
    /// let inited = std::sync::Arc::new(std::sync::Barrier::new(3));
    /// let ranks: Vec<_> = (0..3)
    ///     .map(|rank| {
    ///         let inited = inited.clone();
    /// #       let mut config = Config::new(rank, 3, addr.clone(), secret.clone());
    /// #       config.serve_store = false;
    /// #       config.timeout = Duration::from_secs(20);
    ///         std::thread::spawn(move || -> oxccl::Result<Option<Vec<u32>>> {
    ///             // Every wait of a shrink ends within this timeout (default 300 s).
    ///             let opts = Options { timeout: Duration::from_secs(10), ..Options::default() };
    ///             let comm = Communicator::init(Bootstrap::new(config)?, opts)?;
    ///             inited.wait(); // (leaving during a peer's init would fail that init)
    ///             if rank == 2 {
    ///                 drop(comm); // its connections close: its peers' calls fail naming it
    ///                 return Ok(None);
    ///             }
    ///             let mut v = vec![1u32; 8];
    ///             assert!(comm.all_reduce_in_place(&mut v, ReduceOp::Sum).is_err());
    ///             let small = comm.shrink_after_failure()?;
    ///             let mut v = vec![1u32; 8];
    ///             small.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    ///             Ok(Some(v))
    ///         })
    ///     })
    ///     .collect();
    /// let out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    /// assert_eq!(out[0].as_ref().unwrap().as_deref(), Some(&[2u32; 8][..]));
    /// assert_eq!(out[1].as_ref().unwrap().as_deref(), Some(&[2u32; 8][..]));
    /// # Ok(()) }
    /// ```
    pub fn shrink_after_failure(&self) -> Result<Communicator> {
        self.abort();
        self.shrink(&[])
    }

    /// The peers that failures on this communicator named so far (ranks of this communicator,
    /// in the order they were named).
    pub fn failed_peers(&self) -> Vec<usize> {
        self.inner
            .failed_peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Remembers that a failure named `peer`.
    pub(super) fn record_failed_peer(&self, peer: usize) {
        if peer == self.inner.rank {
            return;
        }
        let mut f = self
            .inner
            .failed_peers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !f.contains(&peer) {
            f.push(peer);
        }
    }

    /// One epoch: check in, agree on the excluded ranks, build their communicator, agree that
    /// it was built.
    fn shrink_epoch(
        &self,
        epoch: u64,
        suspects: &BTreeSet<usize>,
        timeout: Duration,
    ) -> Result<Epoch> {
        let (rank, world) = (self.inner.rank, self.inner.world);
        let job = format!("{:016x}/shrink{epoch}", self.inner.comm_id);
        let round = Round {
            comm: self,
            epoch,
            agree: format!("oxccl/{job}/agree/"),
            timeout,
        };

        // 1. Check in, and agree on who is excluded.
        let excluded = round.exclusions(suspects)?;
        if excluded.contains(&rank) {
            return Err(round.fail(
                "the survivors excluded this rank (a failure named it, or it checked in after \
                 they had decided)"
                    .into(),
                vec![],
            ));
        }
        let members: Vec<usize> = (0..world).filter(|r| !excluded.contains(r)).collect();
        let new_rank = members.iter().position(|&r| r == rank).unwrap_or(0);
        if crate::log_enabled() {
            crate::log_line(format!(
                "rank {rank}: shrink epoch {epoch}: excluded {excluded:?}; {} ranks remain, \
                 this is rank {new_rank}",
                members.len()
            ));
        }

        crate::fault::in_shrink(self.inner.opts.faults.as_ref(), rank, epoch);

        // 2. The new communicator, under a fresh prefix.
        let built = Bootstrap::with_store(
            new_rank,
            members.len(),
            Box::new(SharedStore(self.inner.bootstrap.clone())),
            &job,
            timeout,
        )
        .map_err(Error::from)
        .and_then(|boot| {
            let mut opts = self.inner.given.clone();
            opts.host_id = Some(self.inner.hosts[rank].clone());
            opts.faults = None;
            opts.timeout = timeout;
            Communicator::init_shared(Arc::new(boot), opts)
        })
        .inspect(|c| c.set_lineage(&self.lineage()));

        // 3. Agree that every member built it; otherwise all start over without the ranks
        // that did not answer.
        let why = match &built {
            Ok(_) => None,
            Err(e) => Some(format!(
                "this rank's init of the new communicator failed: {e}"
            )),
        };
        let outcome = round.outcome(&members, new_rank, why.as_deref())?;
        if outcome == "ok" {
            return match built {
                Ok(c) => Ok(Epoch::Done(c)),
                // Cannot happen (this rank said it was not done); fail rather than hang.
                Err(e) => Err(round.fail(format!("the new communicator failed here: {e}"), vec![])),
            };
        }
        drop(built);
        let more = decode(
            outcome.strip_prefix("retry:").unwrap_or("").as_bytes(),
            world,
        );
        if more.is_empty() || more.contains(&rank) {
            let detail = why.unwrap_or_else(|| {
                format!(
                    "the new communicator of ranks {members:?} could not be built within \
                     {timeout:?}"
                )
            });
            return Err(round.fail(detail, more.into_iter().collect()));
        }
        Ok(Epoch::Retry(more))
    }
}

/// The store side of one shrink epoch: its keys, its errors and its two agreements.
struct Round<'a> {
    comm: &'a Communicator,
    epoch: u64,
    /// The prefix of the epoch's agreement keys.
    agree: String,
    timeout: Duration,
}

impl Round<'_> {
    fn fail(&self, detail: String, missing: Vec<usize>) -> Error {
        Error::Shrink {
            rank: self.comm.inner.rank,
            epoch: self.epoch,
            detail,
            missing,
        }
    }

    fn store(&self) -> &dyn oxccl_bootstrap::Store {
        self.comm.inner.bootstrap.store()
    }

    fn store_err(&self, what: &str, e: oxccl_bootstrap::Error) -> Error {
        self.fail(
            format!("{what} at the store {}: {e}", self.store().location()),
            vec![],
        )
    }

    /// Checks in with `suspects` and returns the excluded ranks everyone adopts: the first
    /// proposal, made once every rank outside the union of the check-ins has checked in, or
    /// once the timeout has passed (then with the ranks that did not).
    fn exclusions(&self, suspects: &BTreeSet<usize>) -> Result<BTreeSet<usize>> {
        let (rank, world) = (self.comm.inner.rank, self.comm.inner.world);
        let (store, agree, timeout) = (self.store(), &self.agree, self.timeout);
        store
            .set(&format!("{agree}in/{rank}"), encode(suspects).as_bytes())
            .map_err(|e| self.store_err("checking in", e))?;
        let decision_key = format!("{agree}decision");
        let start = Instant::now();
        let mut seen = vec![false; world];
        let mut union = suspects.clone();
        let mut pause = Duration::from_millis(1);
        let decision = loop {
            if store
                .check(&[&decision_key])
                .map_err(|e| self.store_err("reading the decision", e))?
            {
                break store
                    .get(&decision_key, timeout)
                    .map_err(|e| self.store_err("reading the decision", e))?;
            }
            for r in (0..world).filter(|&r| !seen[r]).collect::<Vec<_>>() {
                let key = format!("{agree}in/{r}");
                if store
                    .check(&[&key])
                    .map_err(|e| self.store_err("reading check-ins", e))?
                {
                    let v = store
                        .get(&key, timeout)
                        .map_err(|e| self.store_err("reading check-ins", e))?;
                    seen[r] = true;
                    union.extend(decode(&v, world));
                }
            }
            let unseen: Vec<usize> = (0..world)
                .filter(|r| !seen[*r] && !union.contains(r))
                .collect();
            let late = start.elapsed() >= timeout;
            if unseen.is_empty() || late {
                let mut proposal = union.clone();
                proposal.extend(unseen.iter().copied());
                if late {
                    crate::log_warn(format!(
                        "rank {rank}: shrink epoch {}: ranks {unseen:?} did not check in \
                         within {timeout:?}; proposing to exclude them",
                        self.epoch
                    ));
                }
                let out = store
                    .compare_set(&decision_key, None, encode(&proposal).as_bytes())
                    .map_err(|e| self.store_err("proposing the decision", e))?;
                break out.current.unwrap_or_default();
            }
            super::grow::back_off(&mut pause);
        };
        Ok(decode(&decision, world))
    }

    /// Says `done` (or `failed`, with `why`: alive, but its init failed) as member
    /// `new_rank` of `members`, waits (up to the timeout) until every member has said one,
    /// and returns the outcome everyone adopts: `ok` when all are done, else `retry:` and
    /// the (old) ranks of the members that said nothing.
    fn outcome(&self, members: &[usize], new_rank: usize, why: Option<&str>) -> Result<String> {
        let (store, agree) = (self.store(), &self.agree);
        let done = |r: usize| format!("{agree}done/{r}");
        let failed = |r: usize| format!("{agree}failed/{r}");
        let outcome_key = format!("{agree}outcome");
        match why {
            None => store.set(&done(new_rank), b"1"),
            Some(why) => store.set(&failed(new_rank), why.as_bytes()),
        }
        .map_err(|e| self.store_err("saying it is done", e))?;
        let n = members.len();
        let mut state = vec![0u8; n]; // 0: silent, 1: done, 2: failed
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            for i in (0..n).filter(|&i| state[i] == 0).collect::<Vec<_>>() {
                if store.check(&[&done(i)]).unwrap_or(false) {
                    state[i] = 1;
                } else if store.check(&[&failed(i)]).unwrap_or(false) {
                    state[i] = 2;
                }
            }
            if state.iter().all(|&s| s != 0)
                || start.elapsed() >= self.timeout
                || store.check(&[&outcome_key]).unwrap_or(false)
            {
                break;
            }
            super::grow::back_off(&mut pause);
        }
        let proposal = if state.iter().all(|&s| s == 1) {
            "ok".to_string()
        } else {
            let silent: BTreeSet<usize> = (0..n)
                .filter(|&i| state[i] == 0)
                .map(|i| members[i])
                .collect();
            format!("retry:{}", encode(&silent))
        };
        let outcome = store
            .compare_set(&outcome_key, None, proposal.as_bytes())
            .map_err(|e| self.store_err("proposing the outcome", e))?
            .current
            .unwrap_or_default();
        Ok(String::from_utf8_lossy(&outcome).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_round_trip_and_junk_is_dropped() {
        let s: BTreeSet<usize> = [3, 1, 7].into_iter().collect();
        assert_eq!(encode(&s), "1,3,7");
        assert_eq!(decode(encode(&s).as_bytes(), 8), s);
        assert!(decode(b"", 8).is_empty());
        // Out of range or malformed entries are ignored, not trusted.
        let d = decode(b"1, 9,x,2", 8);
        assert_eq!(d.into_iter().collect::<Vec<_>>(), vec![1, 2]);
    }
}
