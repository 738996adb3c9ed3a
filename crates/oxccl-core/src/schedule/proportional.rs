//! Bandwidth-proportional chunking for links of unequal rates (`Algorithm::Proportional`):
//! each rank owns a share of an all-reduce's elements in proportion to what its link can carry
//! ([`proportional_shares`] derives the optimal shares, [`weighted_blocks`] cuts a buffer by
//! them).

use super::direct::{direct_all_reduce_part, phase_slices};
use super::{Buf, Builder, NOTHING, Request};

/// Splits `len` elements into blocks proportional to `weights` (largest remainders first, ties
/// to the lower index): block `i`'s `(offset, len)` for every `i`. Every rank computes the same.
pub fn weighted_blocks(len: usize, weights: &[u32]) -> Vec<(usize, usize)> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if total == 0 {
        return weights.iter().map(|_| (0, 0)).collect();
    }
    let exact = |i: usize| u128::from(weights[i]) * len as u128;
    let mut lens: Vec<usize> = (0..weights.len())
        .map(|i| (exact(i) / total) as usize)
        .collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(exact(i) % total), i));
    let short = len - lens.iter().sum::<usize>();
    for &i in order.iter().take(short) {
        lens[i] += 1;
    }
    let mut off = 0;
    lens.into_iter()
        .map(|l| {
            off += l;
            (off - l, l)
        })
        .collect()
}

/// The shares of an all-reduce's elements each rank should own when rank `i`'s link carries
/// `rates[i]` per direction (all ranks on one star of links, one rank per link), and the
/// time it then takes relative to moving the whole buffer over a link of rate 1.
///
/// # Derivation
/// Let `N` be the buffer, `n` ≥ 3 the ranks and `B_i` (with `Σ B_i = N`) what rank `i` owns.
/// A direct reduce-scatter sends every other owner its block (`N − B_i` out) and receives
/// every other rank's contribution to its own (`(n−1)·B_i` in); the all-gather then sends its
/// reduced block to everyone (`(n−1)·B_i` out) and receives the others' (`N − B_i` in). So each
/// direction of link `i` carries `N + (n−2)·B_i`, taking `T_i = (N + (n−2)·B_i) / r_i`. We
/// want `B` minimising `max_i T_i`:
/// - every rank moves at least `N` each way whatever it owns (`B_i ≥ 0`), so `T ≥ N / r_min`;
/// - the ranks that own something all finish together at `T`: `B_i = (T·r_i − N)/(n−2)`, and
///   the others own nothing; `Σ_i max(0, T·r_i − N) = (n−2)·N` gives the smallest `T_s`
///   (a piecewise-linear, increasing function of `T`: solved exactly below).
///
/// Hence `T* = max(T_s, N / r_min)`, with shares proportional to `max(0, T*·r_i − N)`
/// (any split within those caps is optimal when `N / r_min` binds). Equal rates give
/// `B_i = N/n` and `T* = 2(n−1)N/(n·r)`, the ring's time; a plain ring always takes
/// `2(n−1)N/(n·r_min)`, so the gain is `2(n−1)/(n·r_min) / (T*/N)`: with one link of four
/// at a quarter rate, `1.5` (the slow rank owns nothing and only sends and receives `N`).
/// For `n = 2` every split takes `N / r_min`; shares then follow the rates.
pub fn proportional_shares(rates: &[f64]) -> (Vec<f64>, f64) {
    let n = rates.len();
    let r_min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    if n <= 2 {
        let total: f64 = rates.iter().sum();
        return (rates.iter().map(|r| r / total).collect(), 1.0 / r_min);
    }
    // Σ max(0, T·r_i − 1) = n − 2, with N = 1: add ranks from the fastest down.
    let mut sorted: Vec<f64> = rates.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut t_s = f64::INFINITY;
    let (mut sum_r, mut k) = (0.0, 0.0);
    for (j, &r) in sorted.iter().enumerate() {
        sum_r += r;
        k += 1.0;
        let t = (n as f64 - 2.0 + k) / sum_r;
        // Valid when every rank counted owns something and the next would not.
        let next_owns = sorted.get(j + 1).is_some_and(|&rn| t * rn > 1.0);
        if t * r >= 1.0 && !next_owns {
            t_s = t;
            break;
        }
    }
    let t = t_s.max(1.0 / r_min);
    let caps: Vec<f64> = rates.iter().map(|r| (t * r - 1.0).max(0.0)).collect();
    let total: f64 = caps.iter().sum();
    let shares = if total > 0.0 {
        caps.iter().map(|c| c / total).collect()
    } else {
        vec![1.0 / n as f64; n]
    };
    (shares, t)
}

/// See `Algorithm::Proportional`: a direct reduce-scatter into weighted blocks, then a
/// direct all-gather, pipelined in slices (slice `s` of a block is gathered as soon as it is
/// reduced).
pub(super) fn proportional_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let members: Vec<usize> = (0..req.world).collect();
    let blocks = weighted_blocks(count, &req.weights);
    let k = phase_slices(&blocks, req.chunk);
    let own = (Buf::Output, blocks[req.rank].0);
    direct_all_reduce_part(b, &members, req.rank, &blocks, k, Buf::Input, own, &NOTHING);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Algorithm, Collective, build};

    #[test]
    fn weighted_blocks_cover_the_buffer_in_proportion() {
        assert_eq!(weighted_blocks(10, &[1, 1]), vec![(0, 5), (5, 5)]);
        assert_eq!(
            weighted_blocks(10, &[3, 0, 1]),
            vec![(0, 8), (8, 0), (8, 2)]
        );
        assert_eq!(weighted_blocks(7, &[1, 1, 1]), vec![(0, 3), (3, 2), (5, 2)]);
        assert_eq!(weighted_blocks(0, &[2, 5]), vec![(0, 0), (0, 0)]);
        // Random weights: contiguous, complete, within one element of the exact share.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + (x % 9) as usize;
            let len = (x >> 8) as usize % 100_000;
            let w: Vec<u32> = (0..n).map(|i| ((x >> (i * 5)) % 7) as u32).collect();
            if w.iter().all(|&v| v == 0) {
                continue;
            }
            let b = weighted_blocks(len, &w);
            let total: f64 = w.iter().map(|&v| f64::from(v)).sum();
            let mut off = 0;
            for (i, &(o, l)) in b.iter().enumerate() {
                assert_eq!(o, off, "{w:?} {len}");
                off += l;
                let exact = f64::from(w[i]) * len as f64 / total;
                assert!(
                    (l as f64 - exact).abs() < 1.0,
                    "{w:?} {len}: block {i} {l} vs {exact}"
                );
            }
            assert_eq!(off, len);
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn shares_and_times_match_the_derivation() {
        // Equal rates: equal shares, the ring's time 2(n-1)/n.
        let (s, t) = proportional_shares(&[1.0; 4]);
        assert!(s.iter().all(|&x| close(x, 0.25)), "{s:?}");
        assert!(close(t, 1.5));
        // One slow link of four (scenario c): it owns nothing, and bounds the time at N/r.
        let (s, t) = proportional_shares(&[1.0, 1.0, 1.0, 0.25]);
        assert!(close(s[3], 0.0) && close(t, 4.0), "{s:?} {t}");
        // Against the plain ring, 2(n-1)/n / r_min = 6: the bound of 1.5.
        assert!(close(1.5 / 0.25 / t, 1.5));
        // Scenario d: 2, 1, 1, 0.5.
        let (s, t) = proportional_shares(&[2.0, 1.0, 1.0, 0.5]);
        assert!(close(t, 2.0) && close(s[3], 0.0), "{s:?} {t}");
        assert!(s[0] > s[1] && close(s[1], s[2]), "{s:?}");
        // Two fast, two half-rate: T_s binds (nobody forced to zero).
        let (s, t) = proportional_shares(&[1.0, 1.0, 0.5, 0.5]);
        // Σ max(0, T r - 1) = 2 → 2(T-1) + 2 max(0, T/2 - 1) = 2 → T = 2 (edge: slow own 0).
        assert!(close(t, 2.0), "{t}");
        assert!(close(s[0], 0.5) && close(s[2], 0.0), "{s:?}");
        // The optimum: no share vector does better (random search).
        let rates = [1.7, 0.9, 1.2, 0.4, 1.0];
        let (best, t) = proportional_shares(&rates);
        let time = |b: &[f64]| {
            let n = b.len() as f64;
            (0..b.len())
                .map(|i| (1.0 + (n - 2.0) * b[i]) / rates[i])
                .fold(0.0, f64::max)
        };
        assert!(close(time(&best), t), "{} vs {t}", time(&best));
        let mut x = 7u64;
        for _ in 0..20_000 {
            let mut b: Vec<f64> = (0..5)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 11) as f64 / (1u64 << 53) as f64
                })
                .collect();
            let sum: f64 = b.iter().sum();
            b.iter_mut().for_each(|v| *v /= sum);
            assert!(time(&b) >= t - 1e-9, "{b:?} beats the derived optimum {t}");
        }
    }

    #[test]
    fn proportional_all_reduce_verifies_for_random_shares() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..300 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + (x % 8) as usize;
            let count = (x >> 4) as usize % 200;
            let mut weights: Vec<u32> = (0..n).map(|i| ((x >> (i * 4 + 10)) % 6) as u32).collect();
            if weights.iter().all(|&w| w == 0) {
                weights[0] = 1;
            }
            let in_place = x & (1 << 60) != 0;
            let chunk = 1 + (x >> 40) as usize % 37;
            let reqs: Vec<Request> = (0..n)
                .map(|rank| Request {
                    coll: Collective::AllReduce { count },
                    world: n,
                    rank,
                    in_place,
                    hosts: Vec::new(),
                    algo: Algorithm::Proportional,
                    chunk,
                    channels: 1,
                    weights: weights.clone(),
                })
                .collect();
            let slots = 1 + case % 4;
            crate::verify::verify(&reqs, slots, x).unwrap_or_else(|e| {
                panic!("n={n} count={count} weights={weights:?} in_place={in_place} chunk={chunk} slots={slots}: {e}")
            });
        }
        // Wrong weights are refused.
        let req = |weights: Vec<u32>| Request {
            coll: Collective::AllReduce { count: 10 },
            world: 3,
            rank: 0,
            in_place: false,
            hosts: Vec::new(),
            algo: Algorithm::Proportional,
            chunk: 4,
            channels: 1,
            weights,
        };
        assert!(build(&req(vec![0, 0, 0])).is_err());
        assert!(build(&req(vec![1, 1])).is_err());
        assert!(build(&req(vec![1, 0, 2])).is_ok());
    }
}
