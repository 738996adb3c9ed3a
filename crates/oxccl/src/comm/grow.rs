//! Growing a communicator: newcomers (replacements for lost ranks, or extra ranks) join a
//! running job at a call boundary.
//!
//! # How a newcomer gets in
//!
//! The meeting point is the bootstrap store, under the job id the job's first communicator was
//! made with (its *lineage*, kept by every communicator shrunk or grown from it), in
//! `oxccl/<job id>/grow/`:
//!
//! - `ticket`: a counter; each newcomer takes the next number with `add` ([`Communicator::join`]).
//! - `admit/<ticket>`: set once, by compare-and-set: either the members' admission (JSON: the
//!   job prefix of the new communicator, the newcomer's rank and the new world size), or
//!   `withdrawn`, when the newcomer gave up waiting (a ticket is never admitted after that).
//!
//! The members, all calling [`Communicator::grow`] with the same `count`, agree on whom they
//! admit under `oxccl/<comm id>/grow<g>/decision` (`g` counts this communicator's grows): as
//! soon as `count` tickets without an `admit` entry exist, any member proposes the first
//! `count` of them (in ticket order) by compare-and-set, and every member adopts the winner's
//! proposal; the winner then admits each. If the newcomers do not come within the
//! communicator's timeout, a member proposes `none` instead, and every member fails alike.
//! Then all (members keeping their ranks, newcomers after them in ticket order) init the new
//! communicator under the job `<comm id>/grow<g>`, which authenticates the newcomers with the
//! job's secret as every init does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_bootstrap::{Bootstrap, Store};
use serde::{Deserialize, Serialize};

use super::{Communicator, Options, SharedStore};
use crate::error::{Error, Result};

/// The members' word to one newcomer (the value of `admit/<ticket>`).
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
struct Admission {
    /// The job id of the new communicator's bootstrap.
    job: String,
    /// The newcomer's rank in it.
    rank: usize,
    /// Its world size.
    world: usize,
}

const WITHDRAWN: &[u8] = b"withdrawn";
const NONE: &str = "none";

fn keys(lineage: &str) -> (String, impl Fn(i64) -> String + '_) {
    (format!("oxccl/{lineage}/grow/ticket"), move |t: i64| {
        format!("oxccl/{lineage}/grow/admit/{t}")
    })
}

fn tickets(v: &[u8]) -> Vec<i64> {
    String::from_utf8_lossy(v)
        .split(',')
        .filter_map(|x| x.trim().parse::<i64>().ok())
        .filter(|&t| t > 0)
        .collect()
}

/// Sleeps for `pause`, doubling it up to 20 ms (the store polls of grow and shrink).
pub(super) fn back_off(pause: &mut Duration) {
    std::thread::sleep(*pause);
    *pause = (*pause * 2).min(Duration::from_millis(20));
}

impl Communicator {
    /// Admits `count` newcomers, which call [`Communicator::join`], and returns the
    /// communicator of this one's ranks and theirs. Every rank of this communicator calls it,
    /// with the same `count`, between calls (none in flight): the members keep their ranks,
    /// and the newcomers follow them, in the order they asked to join.
    ///
    /// Waits up to [`Communicator::timeout`] for the newcomers; if they do not come, every
    /// member returns [`Error::Grow`] and this communicator stays as it was (usable). If a
    /// member or a newcomer dies while the new communicator is made, the others get an error
    /// naming it, within the timeout, and this communicator is still usable (after a member
    /// died: [`Communicator::shrink`] it without that rank). The store must be reachable by
    /// the newcomers: with the built-in store, rank 0 of the first communicator serves it.
    /// New connections are made between every pair of ranks of the new communicator; this
    /// one keeps its own until it is dropped.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use oxccl::{Communicator, Options, ReduceOp};
    /// # use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer, TcpStore};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = Secret::new("the job's shared secret")?;
    /// # let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
    /// # let addr = server.addr().to_string();
    /// // Two ranks run; a third process joins them.
    /// let members: Vec<_> = (0..2)
    ///     .map(|rank| {
    /// #       let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
    /// #       config.serve_store = false;
    /// #       config.job_id = "train".into();
    ///         std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
    ///             let comm = Communicator::init(Bootstrap::new(config)?, Options::default())?;
    ///             let big = comm.grow(1)?;
    ///             assert_eq!((big.rank(), big.world_size()), (rank, 3));
    ///             let mut v = vec![1.0f32; 4];
    ///             big.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    ///             Ok(v)
    ///         })
    ///     })
    ///     .collect();
    /// // The newcomer needs the store and the job id (and the job's secret).
    /// let store = TcpStore::connect(&addr, &secret, Duration::from_secs(10))?;
    /// let comm = Communicator::join(Box::new(store), "train", Options::default())?;
    /// assert_eq!((comm.rank(), comm.world_size()), (2, 3));
    /// let mut v = vec![1.0f32; 4];
    /// comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    /// assert_eq!(v, vec![3.0; 4]);
    /// for m in members {
    ///     assert_eq!(m.join().unwrap()?, vec![3.0; 4]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn grow(&self, count: usize) -> Result<Communicator> {
        let rank = self.inner.rank;
        let n = self.inner.world;
        let g = self
            .inner
            .grow_seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let fail = |detail: String| Error::Grow {
            who: format!("rank {rank}"),
            detail: format!("grow {g} of a communicator of {n} ranks: {detail}"),
            missing: vec![],
        };
        if count == 0 {
            return Err(Error::InvalidArgument {
                rank,
                msg: "grow: count is 0 (admit at least one newcomer)".into(),
            });
        }
        if let Some(first) = &self.lock().poisoned {
            return Err(fail(format!(
                "this communicator failed earlier ({first}): shrink it first"
            )));
        }
        let lineage = self.lineage();
        let store = self.inner.bootstrap.store();
        let store_err = |what: &str, e: oxccl_bootstrap::Error| {
            fail(format!("{what} at the store {}: {e}", store.location()))
        };
        let timeout = self.timeout();
        let (ticket_key, admit) = keys(&lineage);
        let decision_key = format!("oxccl/{:016x}/grow{g}/decision", self.inner.comm_id);

        // 1. Agree on whom to admit.
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        let mut taken = 0i64; // tickets up to here are admitted or withdrawn
        let (decision, won) = loop {
            if store
                .check(&[&decision_key])
                .map_err(|e| store_err("reading the decision", e))?
            {
                let d = store
                    .get(&decision_key, timeout)
                    .map_err(|e| store_err("reading the decision", e))?;
                break (d, false);
            }
            let issued = store
                .add(&ticket_key, 0)
                .map_err(|e| store_err("counting newcomers", e))?;
            let mut free = Vec::new();
            for t in taken + 1..=issued {
                let k = admit(t);
                if store
                    .check(&[&k])
                    .map_err(|e| store_err("reading tickets", e))?
                {
                    if free.is_empty() {
                        taken = t;
                    }
                } else {
                    free.push(t);
                }
            }
            let late = start.elapsed() >= timeout;
            if free.len() >= count || late {
                let proposal = if free.len() >= count {
                    free.truncate(count);
                    free.iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                } else {
                    NONE.to_string()
                };
                let o = store
                    .compare_set(&decision_key, None, proposal.as_bytes())
                    .map_err(|e| store_err("proposing the decision", e))?;
                break (o.current.unwrap_or_default(), o.swapped);
            }
            back_off(&mut pause);
        };
        let chosen = tickets(&decision);
        if chosen.len() != count {
            return Err(fail(format!(
                "waited {timeout:?} for {count} newcomers to call join (under the job id \
                 {lineage:?} at the store {}); fewer came",
                store.location()
            )));
        }
        let world = n + count;
        let job = format!("{:016x}/grow{g}", self.inner.comm_id);
        if won {
            for (i, &t) in chosen.iter().enumerate() {
                let a = Admission {
                    job: job.clone(),
                    rank: n + i,
                    world,
                };
                let v = serde_json::to_vec(&a).map_err(|e| fail(e.to_string()))?;
                // A newcomer that withdrew in the meantime is missed by the init below, which
                // then fails naming its rank.
                store
                    .compare_set(&admit(t), None, &v)
                    .map_err(|e| store_err("admitting a newcomer", e))?;
            }
        }
        if crate::log_enabled() {
            crate::log_line(format!(
                "rank {rank}: grow {g}: admitting tickets {chosen:?} as ranks {n}..{world}"
            ));
        }
        crate::fault::in_grow(self.inner.opts.faults.as_ref(), rank, g);

        // 2. The new communicator, under a fresh prefix.
        let boot = Bootstrap::with_store(
            rank,
            world,
            Box::new(SharedStore(self.inner.bootstrap.clone())),
            &job,
            timeout,
        )
        .map_err(|e| self.grown_failed(g, e.into()))?;
        let mut opts = self.inner.given.clone();
        opts.host_id = Some(self.inner.hosts[rank].clone());
        opts.faults = None;
        opts.timeout = timeout;
        let c =
            Communicator::init_shared(Arc::new(boot), opts).map_err(|e| self.grown_failed(g, e))?;
        c.set_lineage(&lineage);
        Ok(c)
    }

    /// [`Error::Grow`] for a member whose init of the grown communicator failed with `e`,
    /// naming the members (ranks of this communicator) the error names.
    fn grown_failed(&self, g: u64, e: Error) -> Error {
        let n = self.inner.world;
        let missing = named_ranks(&e).into_iter().filter(|&r| r < n).collect();
        Error::Grow {
            who: format!("rank {}", self.inner.rank),
            detail: format!(
                "grow {g}: the new communicator could not be made ({e}); this communicator \
                 is unchanged"
            ),
            missing,
        }
    }

    /// Joins a running job as a newcomer: waits (up to `options.timeout`) until its members
    /// call [`Communicator::grow`] and admit this process, then returns the grown
    /// communicator, in which this process has a rank after every member's.
    ///
    /// `store` is the job's bootstrap store (authenticated with the job's secret, as
    /// [`oxccl_bootstrap::TcpStore::connect`] does), and `job_id` the job id the members'
    /// first communicator was made with ([`oxccl_bootstrap::Config::job_id`], or the one given
    /// to [`Bootstrap::with_store`]). If no member admits it in time, it withdraws (it will not
    /// be admitted later) and returns [`Error::Grow`]. See [`Communicator::grow`] for an
    /// example.
    pub fn join(store: Box<dyn Store>, job_id: &str, options: Options) -> Result<Communicator> {
        let timeout = options.timeout;
        let (ticket_key, admit) = keys(job_id);
        let fail = |who: String, detail: String| Error::Grow {
            who,
            detail,
            missing: vec![],
        };
        let at = store.location();
        let ticket = store.add(&ticket_key, 1).map_err(|e| {
            fail(
                "a newcomer".into(),
                format!("taking a ticket at the store {at}: {e}"),
            )
        })?;
        let who = format!("a newcomer (ticket {ticket} of job {job_id:?})");
        let key = admit(ticket);
        // Wait for the admission; at the deadline, withdraw, unless it came in the meantime.
        let value = match store.get(&key, timeout) {
            Ok(v) => v,
            Err(e) if e.is_timeout() => {
                let o = store
                    .compare_set(&key, None, WITHDRAWN)
                    .map_err(|e| fail(who.clone(), format!("withdrawing at {at}: {e}")))?;
                if o.swapped {
                    return Err(fail(
                        who,
                        format!(
                            "no member of the job admitted it within {timeout:?}: call grow() \
                             on every rank of the job (the store at {at})"
                        ),
                    ));
                }
                o.current.unwrap_or_default()
            }
            Err(e) => return Err(fail(who, format!("waiting for its admission at {at}: {e}"))),
        };
        if value.as_slice() == WITHDRAWN {
            return Err(fail(who, "its ticket was withdrawn".into()));
        }
        let a: Admission = serde_json::from_slice(&value).map_err(|e| {
            fail(
                who.clone(),
                format!("the admission in the store is not valid: {e}"),
            )
        })?;
        if crate::log_enabled() {
            crate::log_line(format!("{who}: admitted as rank {} of {}", a.rank, a.world));
        }
        let made = |e: Error| {
            fail(
                who.clone(),
                format!(
                    "admitted as rank {} of {}, but the grown communicator could not be made: \
                     {e}",
                    a.rank, a.world
                ),
            )
        };
        let boot = Bootstrap::with_store(a.rank, a.world, store, &a.job, timeout)
            .map_err(|e| made(e.into()))?;
        let c = Communicator::init_shared(Arc::new(boot), options).map_err(made)?;
        c.set_lineage(job_id);
        Ok(c)
    }
}

impl Communicator {
    /// The job id newcomers join this communicator's job under ([`Communicator::join`]).
    pub fn lineage(&self) -> String {
        self.inner
            .lineage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes this communicator (shrunk or grown from another) join-able under `lineage`.
    pub(super) fn set_lineage(&self, lineage: &str) {
        *self.inner.lineage.lock().unwrap_or_else(|e| e.into_inner()) = lineage.to_string();
    }
}

/// The ranks an init error names (the dead or missing ones), to say which members failed.
fn named_ranks(e: &Error) -> Vec<usize> {
    match e {
        Error::PeerFailed { peer, .. } | Error::Unreachable { peer, .. } => vec![*peer],
        Error::Timeout { peer: Some(p), .. } => vec![*p],
        Error::Bootstrap(b) => b.missing_ranks(),
        _ => vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_parse_and_junk_is_dropped() {
        assert_eq!(tickets(b"3,4,5"), vec![3, 4, 5]);
        assert_eq!(tickets(b"none"), Vec::<i64>::new());
        assert_eq!(tickets(b"0,-1,x,7"), vec![7]);
    }

    #[test]
    fn admissions_round_trip() {
        let a = Admission {
            job: "00ab/grow1".into(),
            rank: 3,
            world: 4,
        };
        let v = serde_json::to_vec(&a).unwrap();
        assert_eq!(serde_json::from_slice::<Admission>(&v).unwrap(), a);
        assert!(serde_json::from_slice::<Admission>(WITHDRAWN).is_err());
    }
}
