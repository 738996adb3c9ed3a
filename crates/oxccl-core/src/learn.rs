//! Link rates learned while a job runs, so that the proportional and two-tier algorithms
//! follow the network: a link that slows (another tenant, a degraded port) is routed around
//! within a few calls, and one that recovers is used again.
//!
//! Every large all-reduce, reduce-scatter or all-gather on a ring, proportional or two-tier
//! schedule (the *eligible* calls: which ones is a function of the call alone, so every rank
//! counts the same) meters what each tcp link delivered while busy, and each rank's best
//! aggregate window ([`crate::meter`]). Every [`DEFAULT_INTERVAL`] eligible calls the ranks
//! combine, in two small integer all-reduces, per host: the fastest flow touching it (MAX)
//! and its ranks' best windows (SUM). Both are lower bounds on the host's link rate, and
//! each is tight in the patterns that matter (see [`estimates`]). (Per-host rates on one
//! link per host are what the tuner's topology holds.)
//!
//! The values are exact integers, so every rank derives the same estimates and, by the same
//! deterministic rule ([`next_rates`]), the same new rates and shares: no extra agreement is
//! needed. The rule has hysteresis so that noise does not flap the algorithm:
//! - rates within [`EQUAL_BAND`] of each other are taken as equal (the ring is the best
//!   algorithm for equal links), and rates that are equal stay so until they spread beyond
//!   [`UNEQUAL_BAND`];
//! - a host's rate changes only when its estimate moves more than [`CHANGE`], and a change
//!   must be seen in two consecutive rounds (unless no rate was known at all).

use crate::meter::Delivered;
use crate::schedule::{Algorithm, Collective};
use crate::tuner::Tuning;

/// Eligible calls between two rounds of agreement.
pub const DEFAULT_INTERVAL: usize = 4;
/// Rates whose spread (max/min) is within this count as equal when they were unequal.
pub const EQUAL_BAND: f64 = 1.15;
/// Equal rates become unequal only when their spread exceeds this.
pub const UNEQUAL_BAND: f64 = 1.3;
/// A host's estimate must differ from its rate by more than this share to change it.
pub const CHANGE: f64 = 0.2;
/// Busy time below which a link's reading is too short to trust (its acknowledgement's
/// round trip would dominate).
pub const MIN_BUSY_NS: u128 = 2_000_000;
/// Bytes from which an all-reduce, reduce-scatter or all-gather is metered.
pub const MIN_BYTES: usize = 1 << 20;

/// Whether a call is metered (the same answer on every rank: it depends on the call and the
/// tuner only): a large all-reduce, reduce-scatter or all-gather on a ring, proportional or
/// two-tier schedule, whose fragments fill the slots and whose flows are concurrent.
pub fn eligible(coll: &Collective, tuning: &Tuning, esize: usize, bytes: usize) -> bool {
    matches!(
        coll,
        Collective::AllReduce { .. }
            | Collective::ReduceScatter { .. }
            | Collective::AllGather { .. }
    ) && bytes >= MIN_BYTES
        && matches!(
            tuning.choose(coll, esize).0,
            Algorithm::Ring | Algorithm::Proportional | Algorithm::Hierarchical
        )
}

/// The learner's state on one rank (identical on every rank).
#[derive(Clone, Debug)]
pub struct Learner {
    /// Eligible calls between rounds.
    pub interval: usize,
    /// Eligible calls since the last round.
    pub calls: usize,
    /// A change seen in the last round, waiting to be confirmed by the next.
    pub pending: Option<Vec<f64>>,
    /// Rounds run so far.
    pub rounds: u64,
}

impl Learner {
    /// A learner that runs a round every `interval` eligible calls (at least 1).
    pub fn new(interval: usize) -> Learner {
        Learner {
            interval: interval.max(1),
            calls: 0,
            pending: None,
            rounds: 0,
        }
    }

    /// Counts an eligible call; true when it is time for a round.
    pub fn count(&mut self) -> bool {
        self.calls += 1;
        if self.calls >= self.interval {
            self.calls = 0;
            self.rounds += 1;
            true
        } else {
            false
        }
    }
}

/// This rank's part of a round: per host, the fastest flow this rank metered that touches it
/// (`peak`, to be combined with MAX) and, for this rank's own host, its best aggregate window
/// (`egress`, to be combined with SUM: the ranks of a host share its link), in kbit/s.
/// Links inside the host and readings shorter than [`MIN_BUSY_NS`] are left out.
pub fn contribution(
    my_host: usize,
    host_of: &[usize],
    hosts: usize,
    delivered: &[(usize, Delivered)],
    egress_kbps: u64,
) -> (Vec<u64>, Vec<u64>) {
    let mut peak = vec![0u64; hosts];
    let mut egress = vec![0u64; hosts];
    egress[my_host] = egress_kbps;
    for &(peer, d) in delivered {
        let h = host_of[peer];
        if h == my_host || d.busy.as_nanos() < MIN_BUSY_NS {
            continue;
        }
        let kbps = d.kbit_per_s();
        peak[my_host] = peak[my_host].max(kbps);
        peak[h] = peak[h].max(kbps);
    }
    (peak, egress)
}

/// Each host's estimated rate (Gbit/s) from a round's MAX of `peak` and SUM of `egress`:
/// both are lower bounds on the host's link rate (a flow crosses both of its ends' links; a
/// host's ranks send no faster than its link), and each is tight in some pattern (a ring's
/// flows cross each link alone; flows sharing a saturated link add up in the egress
/// window), so the estimate is the larger. `None` for a host nothing was measured on.
pub fn estimates(peak: &[u64], egress: &[u64]) -> Vec<Option<f64>> {
    peak.iter()
        .zip(egress)
        .map(|(&p, &e)| (p.max(e) > 0).then(|| p.max(e) as f64 / 1e6))
        .collect()
}

fn spread(rates: &[f64]) -> f64 {
    let (lo, hi) = rates
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &r| (a.min(r), b.max(r)));
    if lo > 0.0 { hi / lo } else { f64::INFINITY }
}

fn all_equal(rates: &[f64]) -> bool {
    rates.windows(2).all(|w| w[0] == w[1])
}

/// Rates whose spread is within `band` become their mean (equal links: the ring); others
/// are merged into clusters (`merge_clusters`).
pub fn settle(rates: &mut [f64], band: f64) {
    if spread(rates) <= band {
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        rates.iter_mut().for_each(|r| *r = mean);
    } else {
        merge_clusters(rates);
    }
}

/// Uneven rates: hosts within [`UNEQUAL_BAND`] of a faster one take its rate, from the
/// fastest down. Estimates are lower bounds, and a host's flows read low when its peers hold
/// them back (a fast host's shares of its link in a proportional all-reduce), so the faster
/// of similar readings is the better one; and similar hosts then get equal shares instead of
/// shares that follow the noise.
fn merge_clusters(rates: &mut [f64]) {
    let mut order: Vec<usize> = (0..rates.len()).collect();
    order.sort_by(|&a, &b| rates[b].total_cmp(&rates[a]).then(a.cmp(&b)));
    let mut i = 0;
    while i < order.len() {
        let top = rates[order[i]];
        while i < order.len() && rates[order[i]] * UNEQUAL_BAND >= top {
            rates[order[i]] = top;
            i += 1;
        }
    }
}

/// Three significant digits: what the tuner sees does not move with the last bits.
fn round3(r: f64) -> f64 {
    format!("{r:.2e}").parse().unwrap_or(r)
}

/// The rates to use after a round, or `None` to keep `current`. `current[h]` is host `h`'s
/// rate (`None`: unknown), `est` the round's [`estimates`]; `pending` carries an unconfirmed
/// change from one round to the next. See the module's documentation for the rule.
pub fn next_rates(
    current: &[Option<f64>],
    est: &[Option<f64>],
    pending: &mut Option<Vec<f64>>,
) -> Option<Vec<f64>> {
    let Some(mut proposal) = current
        .iter()
        .zip(est)
        .map(|(c, e)| e.or(*c).filter(|r| *r > 0.0))
        .collect::<Option<Vec<f64>>>()
    else {
        // Some host is neither known nor measured: nothing to derive shares from yet.
        *pending = None;
        return None;
    };
    let known: Option<Vec<f64>> = current.iter().copied().collect();
    // Equal links stay equal within the wide band; unequal ones become equal in the narrow.
    let band = match &known {
        Some(k) if !all_equal(k) => EQUAL_BAND,
        _ => UNEQUAL_BAND,
    };
    settle(&mut proposal, band);
    let Some(known) = known else {
        *pending = None;
        return Some(proposal.into_iter().map(round3).collect());
    };
    let moved = |a: &[f64], b: &[f64]| {
        a.iter().zip(b).any(|(x, y)| (x / y - 1.0).abs() > CHANGE) || all_equal(a) != all_equal(b)
    };
    if !moved(&proposal, &known) {
        *pending = None;
        return None;
    }
    match pending.take() {
        Some(prev) if !moved(&proposal, &prev) => {
            // Seen twice: the mean of the two readings.
            let both: Vec<f64> = proposal
                .iter()
                .zip(&prev)
                .map(|(a, b)| round3((a + b) / 2.0))
                .collect();
            Some(both)
        }
        _ => {
            *pending = Some(proposal);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn d(mbit: u64, ms: u64) -> Delivered {
        Delivered {
            bytes: mbit * 1_000_000 / 8 * ms / 1000,
            busy: Duration::from_millis(ms),
        }
    }

    /// Combines contributions as the round's two all-reduces do.
    fn combine(parts: &[(Vec<u64>, Vec<u64>)]) -> Vec<Option<f64>> {
        let hosts = parts[0].0.len();
        let mut peak = vec![0u64; hosts];
        let mut egress = vec![0u64; hosts];
        for (p, e) in parts {
            peak.iter_mut().zip(p).for_each(|(a, b)| *a = (*a).max(*b));
            egress.iter_mut().zip(e).for_each(|(a, b)| *a += b);
        }
        estimates(&peak, &egress)
    }

    #[test]
    fn a_ring_reads_each_link_through_its_flows() {
        // 4 hosts of one rank on a ring 0 -> 1 -> 2 -> 3 -> 0; host 3's link at 250 Mbit/s.
        // The ring moves at 250 everywhere, but each flow crosses its link at line rate: the
        // flows into and out of host 3 read 250, the others 1000; the windows read the pace.
        let host_of = [0, 1, 2, 3];
        let flows = [(0, 1, 1000), (1, 2, 1000), (2, 3, 250), (3, 0, 250)];
        let parts: Vec<_> = flows
            .iter()
            .map(|&(from, to, rate)| contribution(from, &host_of, 4, &[(to, d(rate, 50))], 250_000))
            .collect();
        // Host 0 reads 1000 through its flow to host 1, though host 3 feeds it at 250.
        assert_eq!(
            combine(&parts),
            vec![Some(1.0), Some(1.0), Some(1.0), Some(0.25)]
        );
    }

    #[test]
    fn shared_links_read_through_the_egress_window() {
        // Proportional shares on 1, 1, 1, 0.25: host 0 sends to hosts 1 and 2 at 460 each
        // and to host 3 at 80; its window reads its link, 1000.
        let host_of = [0, 1, 2, 3, 0];
        let dl = [(1, d(460, 40)), (2, d(460, 40)), (3, d(80, 40))];
        let parts = vec![
            contribution(0, &host_of, 4, &dl, 1_000_000),
            // Host 3 sends to the three others at 83: its window reads 250.
            contribution(3, &host_of, 4, &[(0, d(83, 40)), (1, d(83, 40))], 250_000),
        ];
        let est = combine(&parts);
        assert_eq!(est[0], Some(1.0));
        assert_eq!(est[3], Some(0.25));
        // Two ranks of one host add their windows.
        let parts = vec![
            contribution(0, &host_of, 4, &[], 400_000),
            contribution(0, &host_of, 4, &[], 500_000),
        ];
        assert_eq!(combine(&parts)[0], Some(0.9));
        // Inside the host, and too short: nothing.
        let (p, e) = contribution(0, &host_of, 4, &[(4, d(1000, 50)), (1, d(1000, 1))], 0);
        assert!(p.iter().chain(&e).all(|&x| x == 0), "{p:?} {e:?}");
        assert_eq!(estimates(&p, &e), vec![None; 4]);
    }

    #[test]
    fn first_estimates_are_taken_at_once_and_equal_ones_snap_to_their_mean() {
        let mut p = None;
        let unknown = [None; 4];
        let got = next_rates(
            &unknown,
            &[Some(1.0), Some(1.05), Some(0.95), Some(0.25)],
            &mut p,
        );
        assert_eq!(got, Some(vec![1.05, 1.05, 1.05, 0.25]));
        let got = next_rates(
            &unknown,
            &[Some(1.0), Some(1.1), Some(0.9), Some(1.0)],
            &mut p,
        );
        assert_eq!(got, Some(vec![1.0; 4]));
        // A host never measured: no rates yet.
        assert_eq!(
            next_rates(&unknown, &[Some(1.0), None, Some(1.0), Some(1.0)], &mut p),
            None
        );
    }

    #[test]
    fn a_slowed_link_is_taken_after_two_rounds_and_noise_never_flaps() {
        let equal = [Some(1.0); 4];
        let mut p = None;
        // Noise within the bands: nothing changes, round after round.
        for noise in [
            [1.1, 0.9, 1.05, 0.95],
            [0.85, 1.0, 1.08, 1.0],
            [1.2, 0.95, 1.0, 0.97],
        ] {
            let est: Vec<Option<f64>> = noise.iter().map(|&r| Some(r)).collect();
            assert_eq!(next_rates(&equal, &est, &mut p), None, "{noise:?}");
        }
        // Host 3 drops to 0.25: pending after one round, taken after the second.
        let slow = [Some(1.0), Some(0.98), Some(1.02), Some(0.26)];
        assert_eq!(next_rates(&equal, &slow, &mut p), None);
        assert!(p.is_some());
        let slow2 = [Some(1.0), Some(1.0), Some(1.0), Some(0.24)];
        let got = next_rates(&equal, &slow2, &mut p).unwrap();
        assert_eq!(got, vec![1.01, 1.01, 1.01, 0.25]);
        // A single odd round is forgotten.
        let now: Vec<Option<f64>> = got.iter().map(|&r| Some(r)).collect();
        let mut p = None;
        assert_eq!(
            next_rates(&now, &[Some(1.0), Some(0.4), Some(1.0), Some(0.25)], &mut p),
            None
        );
        assert_eq!(
            next_rates(&now, &[Some(1.0), Some(1.0), Some(1.0), Some(0.26)], &mut p),
            None
        );
        assert_eq!(p, None);
        // Unequal rates that come back together (within the narrow band) become equal again.
        let back = [Some(1.0), Some(1.0), Some(1.0), Some(0.92)];
        assert_eq!(next_rates(&now, &back, &mut p), None);
        assert_eq!(next_rates(&now, &back, &mut p).unwrap(), vec![0.98; 4]);
    }

    #[test]
    fn similar_uneven_rates_take_the_fastest_of_them() {
        let mut p = None;
        let unknown = [None; 5];
        let est = [Some(0.89), Some(0.75), Some(0.95), Some(0.25), Some(0.21)];
        let got = next_rates(&unknown, &est, &mut p).unwrap();
        assert_eq!(got, vec![0.95, 0.95, 0.95, 0.25, 0.25]);
        let est = [Some(2.0), Some(1.0), Some(1.1), Some(0.5)];
        let got = next_rates(&[None; 4], &est, &mut p).unwrap();
        assert_eq!(got, vec![2.0, 1.1, 1.1, 0.5]);
    }

    #[test]
    fn unmeasured_hosts_keep_their_rate() {
        let now = [Some(1.0), Some(1.0), Some(2.0)];
        let mut p = None;
        let est = [None, Some(1.0), Some(0.5)];
        assert_eq!(next_rates(&now, &est, &mut p), None);
        let got = next_rates(&now, &est, &mut p).unwrap();
        assert_eq!(got, vec![1.0, 1.0, 0.5]);
    }

    #[test]
    fn the_learner_counts_rounds() {
        let mut l = Learner::new(3);
        let fired: Vec<bool> = (0..7).map(|_| l.count()).collect();
        assert_eq!(fired, [false, false, true, false, false, true, false]);
        assert_eq!(l.rounds, 2);
    }
}
