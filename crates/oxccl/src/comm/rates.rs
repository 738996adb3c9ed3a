//! Link rates: measured by a short probe at init, then learned from what the links deliver
//! while the job runs ([`crate::learn`]), so that the proportional and two-tier algorithms
//! engage without a topology file and follow the network when it changes.

use std::time::{Duration, Instant};

use super::{Communicator, PROBE_BYTES, State};
use crate::engine::Bufs;
use crate::error::Result;
use crate::schedule::Collective;
use crate::topology::Topology;
use crate::{DataType, ReduceOp, learn, log_enabled};

/// Times each link-probe measurement is repeated (the best is kept).
const PROBE_REPEAT: usize = 2;
/// Most rounds of pairwise exchanges the probe runs: all `H − 1` rounds of the round-robin
/// tournament up to 5 hosts; above, a sample (every host meets this many partners), so that
/// its cost does not grow with the number of hosts. Learning refines what the sample missed.
const PROBE_ROUNDS: usize = 4;
/// Most hosts the probe's incast pass measures above 8 hosts (the fastest ones); up to 8
/// hosts, every host within 15% of the fastest is measured (pairwise readings cannot tell
/// which of them is faster than all its partners).
const PROBE_INCASTS: usize = 4;

impl Communicator {
    /// The link probe at init ([`crate::Options::topo_probe`]): by default when the job spans
    /// several hosts and some rate is unknown; measures them, then derives the proportional
    /// and two-tier shares from them as from a file's. A file's rates win.
    pub(super) fn probe_at_init(&self) -> Result<()> {
        let asked = self.inner.opts.topo_probe;
        let bytes = match asked {
            Some(0) => return Ok(()),
            Some(b) => b,
            None => PROBE_BYTES,
        };
        let topo = self.topology();
        if topo.hosts.len() < 2 {
            return Ok(());
        }
        if topo.hosts.iter().all(|h| h.link_gbps.is_some()) {
            if self.inner.rank == 0 && asked.is_some() {
                crate::log_warn(
                    "OXCCL_TOPO_PROBE: the topology file gives every link rate; not probing".into(),
                );
            }
            return Ok(());
        }
        let t0 = Instant::now();
        // Injected faults name the user's calls (`seq=N`), not the probe's.
        let faults = self.lock().engine.faults.take();
        let rates = self.probe_link_rates(&topo, bytes);
        let took = t0.elapsed();
        let mut st = self.lock();
        st.engine.faults = faults;
        let rates = rates?;
        // A rate the file gives wins over the measured one.
        for (h, r) in st.topology.hosts.iter_mut().zip(&rates) {
            h.link_gbps.get_or_insert(*r);
        }
        st.retune();
        if self.inner.rank == 0 && log_enabled() {
            crate::log_line(format!(
                "link probe: rates {rates:?} Gbit/s in {:.0} ms ({} hosts, {} KiB per \
                 transfer); proportional shares {:?}",
                took.as_secs_f64() * 1e3,
                rates.len(),
                bytes >> 10,
                st.tuning.weights
            ));
        }
        Ok(())
    }

    /// Measures each host's link rate into the network (Gbit/s, per direction) between the
    /// hosts' lowest ranks, `bytes` per transfer:
    /// 1. pairs of hosts exchange `bytes` both ways, in rounds of disjoint pairs (a
    ///    round-robin tournament, at most [`PROBE_ROUNDS`] rounds): pair `(i, j)` moves at
    ///    `min(rate_i, rate_j)`, so host `i`'s estimate is the best rate it reached with any
    ///    partner;
    /// 2. that underestimates a host faster than all its partners: the hosts whose estimate
    ///    is the highest (all within 15% of it up to 8 hosts, else the [`PROBE_INCASTS`]
    ///    fastest) then receive from all others
    ///    at once, each sending in proportion to its estimate (so that all finish together),
    ///    which measures `min(rate_i, Σ others)`.
    ///
    /// Every measurement is taken [`PROBE_REPEAT`] times, keeping the best. The rates then
    /// settle as learned ones do ([`learn::settle`]): within [`learn::UNEQUAL_BAND`] of one
    /// another they are equal (their mean: the probe's own spread on equal links is about
    /// 15%, and the ring is the best algorithm for equal links), otherwise similar ones take
    /// the fastest of them. The estimates travel in all-gathers over the communicator itself,
    /// not through the store.
    fn probe_link_rates(&self, topo: &Topology, bytes: usize) -> Result<Vec<f64>> {
        let (n, me) = (self.inner.world, self.inner.rank);
        let leaders: Vec<usize> = topo.hosts.iter().map(|h| h.ranks[0]).collect();
        let h = leaders.len();
        let mine = leaders.iter().position(|&l| l == me);
        // One timed all-to-allv where `plan(i, j)` bytes go from host i's leader to host j's.
        let exchange = |plan: &dyn Fn(usize, usize) -> usize| -> Result<f64> {
            let (mut send, mut recv) = (vec![0usize; n], vec![0usize; n]);
            if let Some(i) = mine {
                for j in 0..h {
                    send[leaders[j]] = plan(i, j);
                    recv[leaders[j]] = plan(j, i);
                }
            }
            let input = vec![0xa5u8; send.iter().sum()];
            let mut output = vec![0u8; recv.iter().sum()];
            self.barrier()?;
            let t0 = Instant::now();
            self.all_to_allv(&input, &send, &mut output, &recv)?;
            Ok(t0.elapsed().as_secs_f64().max(1e-9))
        };
        // Every rank's value, in rank order.
        let gather = |x: f64| -> Result<Vec<f64>> {
            let mut all = vec![0.0f64; n];
            self.all_gather(&[x], &mut all)?;
            Ok(all)
        };
        let gbps = |b: usize, secs: f64| b as f64 * 8.0 / secs / 1e9;
        // 1. Round-robin pairs (circle method; with an odd count, one host sits out a round).
        let slots = h + h % 2;
        let rounds = (slots - 1).min(PROBE_ROUNDS);
        let mut best = 0.0f64;
        for round in (0..PROBE_REPEAT * rounds).map(|x| x % rounds) {
            let partner = |x: usize| -> Option<usize> {
                let p = if x == slots - 1 {
                    round
                } else if x == round {
                    slots - 1
                } else {
                    (2 * round + slots - 1 - x) % (slots - 1)
                };
                Some(p).filter(|&p| p < h && p != x)
            };
            let secs = exchange(&|i, j| if partner(i) == Some(j) { bytes } else { 0 })?;
            if mine.is_some_and(|i| partner(i).is_some()) {
                best = best.max(gbps(bytes, secs));
            }
        }
        let all = gather(best)?;
        let mut rates: Vec<f64> = leaders.iter().map(|&l| all[l]).collect();
        // 2. Incast into the fastest hosts (ties to the lower index).
        let top = rates.iter().cloned().fold(0.0, f64::max);
        let mut order: Vec<usize> = (0..h).filter(|&t| rates[t] >= top * 0.85).collect();
        order.sort_by(|&a, &b| rates[b].total_cmp(&rates[a]).then(a.cmp(&b)));
        let incasts = if h <= 8 { h } else { PROBE_INCASTS };
        for &t in order.iter().take(incasts) {
            let amount = |j: usize| (bytes as f64 * rates[j] / top).ceil() as usize;
            let plan = |i: usize, j: usize| if j == t && i != t { amount(i) } else { 0 };
            let total: usize = (0..h).map(|i| plan(i, t)).sum();
            let mut got = 0.0f64;
            for _ in 0..PROBE_REPEAT {
                let secs = exchange(&plan)?;
                if mine == Some(t) {
                    got = got.max(gbps(total, secs));
                }
            }
            rates[t] = rates[t].max(gather(got)?[leaders[t]]);
        }
        learn::settle(&mut rates, learn::UNEQUAL_BAND);
        // Three significant digits: every rank derives the same shares from the same text.
        Ok(rates
            .into_iter()
            .map(|r| format!("{r:.3e}").parse().unwrap_or(r))
            .collect())
    }

    /// An in-place all-reduce of `v` under the state lock (the learner's rounds).
    fn reduce_u64_locked(
        &self,
        st: &mut State,
        v: &mut [u64],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let buf = crate::as_bytes_mut(v);
        let raw = Bufs {
            input: buf.as_ptr(),
            input_len: buf.len(),
            output: buf.as_mut_ptr(),
            output_len: buf.len(),
        };
        let coll = Collective::AllReduce { count: v.len() };
        let in_place = coll.in_place_offsets(self.inner.world, self.inner.rank);
        self.run_locked(st, &coll, DataType::U64, op, &raw, in_place, timeout, false)
    }

    /// After a metered call ([`learn::eligible`]): counts it, and every
    /// [`crate::Options::learn_interval`] of them sums what every rank's links delivered (one
    /// small integer all-reduce, the same on every rank) and moves the rates and shares as
    /// [`learn::next_rates`] says.
    pub(super) fn learn_after_call(&self, st: &mut State, timeout: Duration) -> Result<()> {
        let Some(learner) = st.learner.as_mut() else {
            return Ok(());
        };
        if !learner.count() {
            return Ok(());
        }
        let hosts = st.topology.hosts.len();
        let host_of = &self.inner.host_of;
        let (mut delivered, egress) = st.engine.take_delivered();
        // Ranks only (not an aggregation service).
        delivered.retain(|(p, _)| *p < self.inner.world);
        let me = host_of[self.inner.rank];
        if crate::trace_enabled() {
            let flows: Vec<String> = delivered
                .iter()
                .filter(|(_, d)| d.bytes > 0)
                .map(|(p, d)| {
                    let gbps = d.kbit_per_s() as f64 / 1e6;
                    format!(
                        "to rank {p} {gbps:.3} Gbit/s over {:.0} ms",
                        d.busy.as_secs_f64() * 1e3
                    )
                })
                .collect();
            crate::log_line(format!(
                "rank {}: link meters, round {}: best window {:.3} Gbit/s; {}",
                self.inner.rank,
                st.learner.as_ref().map_or(0, |l| l.rounds),
                egress as f64 / 1e6,
                flows.join(", ")
            ));
        }
        let (mut peak, mut sum) = learn::contribution(me, host_of, hosts, &delivered, egress);
        self.reduce_u64_locked(st, &mut peak, ReduceOp::Max, timeout)?;
        self.reduce_u64_locked(st, &mut sum, ReduceOp::Sum, timeout)?;
        let est = learn::estimates(&peak, &sum);
        let current: Vec<Option<f64>> = st.topology.hosts.iter().map(|h| h.link_gbps).collect();
        let Some(learner) = st.learner.as_mut() else {
            return Ok(());
        };
        let round = learner.rounds;
        let Some(new) = learn::next_rates(&current, &est, &mut learner.pending) else {
            return Ok(());
        };
        for (h, r) in st.topology.hosts.iter_mut().zip(&new) {
            h.link_gbps = Some(*r);
        }
        st.retune();
        if self.inner.rank == 0 && log_enabled() {
            crate::log_line(format!(
                "learned link rates {new:?} Gbit/s (round {round}; were {current:?}, this \
                 round measured {est:?}); proportional shares {:?}",
                st.tuning.weights
            ));
        }
        Ok(())
    }
}
