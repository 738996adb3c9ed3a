//! All-reduce through an in-network aggregator ([`Algorithm::Aggregation`]): each rank's
//! schedule sends its input slice by slice to the aggregator (the virtual peer `world`) and
//! receives the result; [`build_aggregator`] builds the aggregator's own schedule.

use super::hierarchical::{hierarchical_all_reduce, host_groups};
use super::{Algorithm, Buf, Builder, Collective, Region, Request, Schedule, slices, split};

/// Slices of a block of `len` elements that an aggregator receives (the ranks and the
/// aggregator cut alike).
pub(super) fn aggregation_slices(len: usize, chunk: usize) -> usize {
    slices(len, chunk)
}

/// The hosts of a two-tier aggregation (`req.hosts` lists several hosts of the same number,
/// above one, of ranks), if it is one: each host's ranks.
fn two_tier(req: &Request) -> Option<Vec<Vec<usize>>> {
    if req.hosts.len() != req.world {
        return None;
    }
    let hosts = host_groups(&req.hosts);
    let l = hosts[0].len();
    (hosts.len() > 1 && l > 1 && hosts.iter().all(|h| h.len() == l)).then_some(hosts)
}

/// A rank's side of an [`Algorithm::Aggregation`] all-reduce: each slice of its input up to the
/// aggregator (peer `world`), and the reduced slice back into its output.
///
/// In two tiers (`req.hosts`: several hosts of several ranks each), the ranks of a host first
/// reduce-scatter over their own links, each rail's rank streams its block through the
/// aggregator, and the host all-gathers: a host's link carries its data once each way.
pub(super) fn aggregation_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    if two_tier(req).is_some() {
        return hierarchical_all_reduce(b, req, count);
    }
    let n = req.world;
    let k = slices(count, req.chunk);
    for s in 0..k {
        let (o, l) = split(count, k, s);
        let sent = b.send(n, 0, Region::new(Buf::Input, o, l), &[]);
        // In place, the result overwrites what the send reads.
        let out = Region::new(Buf::Output, o, l);
        b.recv(n, 0, out, None, &[req.in_place.then_some(sent)]);
    }
}

/// The aggregator's schedule for an [`Algorithm::Aggregation`] all-reduce of `req` (any
/// rank's request): its peers are ranks `0..world`; slice by slice it receives every rank's
/// contribution into an aggregation slot, folding them in rank order as they come (so the
/// sum is the same bits whatever order they arrive in), then sends the sum to every rank.
///
/// `pool` bounds the slots (each of `req.chunk` elements; 0: one per slice): slice `s` uses
/// slot `s % pool`, and its first receive waits until every rank has taken slice
/// `s - pool`'s result (its sends completed), so the stream clocks itself, as SwitchML's
/// switch slots do. The schedule's scratch is `min(pool, slices) * chunk` elements.
pub fn build_aggregator(req: &Request, pool: usize) -> Result<Schedule, String> {
    let (n, count) = match req.coll {
        Collective::AllReduce { count } if req.algo == Algorithm::Aggregation => (req.world, count),
        _ => {
            return Err(format!(
                "an aggregator runs aggregation all-reduces, not {} with {}",
                req.coll.name(),
                req.algo.name()
            ));
        }
    };
    if n == 0 || req.chunk == 0 {
        return Err(format!("world {n} and chunk {} must be ≥ 1", req.chunk));
    }
    if let Some(hosts) = two_tier(req) {
        return Ok(rails_aggregator(req, count, &hosts, pool));
    }
    let k = slices(count, req.chunk);
    let pool = if pool == 0 { k } else { pool.min(k) };
    // The largest slice (`split` makes the first ones the longest).
    let slot = split(count, k, 0).1;
    let mut b = Builder {
        steps: Vec::new(),
        scratch: pool * slot,
    };
    // One rank copies its input; nothing moves for zero elements.
    if count > 0 && n > 1 {
        // Per slot, the sends of the slice that used it last.
        let mut sent: Vec<Vec<Option<u32>>> = vec![Vec::new(); pool];
        for s in 0..k {
            let l = split(count, k, s).1;
            let acc = Region::new(Buf::Scratch, (s % pool) * slot, l);
            let mut last = None;
            for p in 0..n {
                let with = (p > 0).then_some(acc);
                let mut deps = vec![last];
                if p == 0 {
                    deps.append(&mut sent[s % pool]);
                }
                last = Some(b.recv(p, 0, acc, with, &deps));
            }
            for p in 0..n {
                let id = b.send(p, 0, acc, &[last]);
                sent[s % pool].push(Some(id));
            }
        }
    }
    Ok(Schedule {
        rank: n,
        steps: b.steps,
        scratch: b.scratch,
    })
}

/// The aggregator of a two-tier aggregation all-reduce: rail `j` (the ranks with local index
/// `j` on every host) streams local block `j`, slice by slice; each slice is folded in host
/// order in a slot of the pool and sent back to the rail. Slices of the rails interleave, so
/// that every rail streams at once.
fn rails_aggregator(req: &Request, count: usize, hosts: &[Vec<usize>], pool: usize) -> Schedule {
    let l = hosts[0].len();
    let blocks: Vec<(usize, usize)> = (0..l).map(|j| split(count, l, j)).collect();
    let ks: Vec<usize> = blocks
        .iter()
        .map(|&(_, len)| aggregation_slices(len, req.chunk))
        .collect();
    let total: usize = ks.iter().sum();
    let pool = if pool == 0 { total } else { pool.min(total) };
    let slot = (0..l)
        .map(|j| split(blocks[j].1, ks[j], 0).1)
        .max()
        .unwrap_or(0);
    let mut b = Builder {
        steps: Vec::new(),
        scratch: pool * slot,
    };
    let mut sent: Vec<Vec<Option<u32>>> = vec![Vec::new(); pool];
    let mut g = 0;
    for s in 0..ks.iter().copied().max().unwrap_or(0) {
        for j in (0..l).filter(|&j| s < ks[j]) {
            let sl = split(blocks[j].1, ks[j], s).1;
            let acc = Region::new(Buf::Scratch, (g % pool) * slot, sl);
            let mut last = None;
            for (q, host) in hosts.iter().enumerate() {
                let with = (q > 0).then_some(acc);
                let mut deps = vec![last];
                if q == 0 {
                    deps.append(&mut sent[g % pool]);
                }
                last = Some(b.recv(host[j], 0, acc, with, &deps));
            }
            for host in hosts {
                let id = b.send(host[j], 0, acc, &[last]);
                sent[g % pool].push(Some(id));
            }
            g += 1;
        }
    }
    Schedule {
        rank: req.world,
        steps: b.steps,
        scratch: b.scratch,
    }
}
