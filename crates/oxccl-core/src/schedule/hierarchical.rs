//! Two-tier schedules over [`Request::hosts`] (`Algorithm::Hierarchical`): inside each host,
//! then along the rails across hosts (the ranks with the same local index on every host), the
//! tiers overlapping slice by slice.

use super::aggregation::aggregation_slices;
use super::direct::{
    Cut, direct_all_gather, direct_all_reduce_part, direct_reduce_scatter, even_cut, phase_slices,
};
use super::proportional::weighted_blocks;
use super::ring::{ring_all_gather_part, ring_all_reduce_part};
use super::{Algorithm, Buf, Builder, Done, NOTHING, Region, Request, split};

/// The longest rail a hierarchical schedule crosses with direct exchanges (every rank talks
/// to its rail-mate on every other host); longer rails run a ring.
pub const RAIL_DIRECT_MAX: usize = 8;

/// The two tiers of [`Request::hosts`]: every host's ranks (hosts in ascending number, ranks
/// ascending), this rank's host-mates, its index among them, its rail (the ranks with that
/// index on every host) and its host's index (its place on the rail).
struct Tiers {
    hosts: Vec<Vec<usize>>,
    locals: Vec<usize>,
    li: usize,
    rail: Vec<usize>,
    ri: usize,
}

/// Every host's ranks (hosts in ascending number, ranks ascending) of a host table.
pub(super) fn host_groups(table: &[u32]) -> Vec<Vec<usize>> {
    let mut ids: Vec<u32> = table.to_vec();
    ids.sort_unstable();
    ids.dedup();
    let mut hosts: Vec<Vec<usize>> = vec![Vec::new(); ids.len()];
    for (x, h) in table.iter().enumerate() {
        hosts[ids.binary_search(h).expect("listed")].push(x);
    }
    hosts
}

fn tiers(req: &Request) -> Tiers {
    let hosts = host_groups(&req.hosts);
    let ri = hosts
        .iter()
        .position(|h| h.contains(&req.rank))
        .expect("its host");
    let locals = hosts[ri].clone();
    let li = locals
        .iter()
        .position(|&x| x == req.rank)
        .expect("on its host");
    let rail = hosts.iter().map(|h| h[li]).collect();
    Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    }
}

/// See `Algorithm::Hierarchical`: across hosts along the rail first (each rank's block to
/// the ranks with its local index elsewhere), then inside each host (what each rank gathered,
/// host by host, each slice as soon as it arrived).
pub(super) fn hierarchical_all_gather(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let own = b.copy(
        Region::new(Buf::Input, 0, count),
        Region::new(Buf::Output, r * count, count),
        &[],
    );
    let block = |x: usize| (x * count, count);
    let rblocks: Vec<(usize, usize)> = rail.iter().map(|&x| block(x)).collect();
    let k = phase_slices(&rblocks, req.chunk);
    let mut held = if rail.len() <= RAIL_DIRECT_MAX {
        let ready = vec![vec![Some(own)]; k];
        let war = vec![vec![None; k]; rail.len()];
        direct_all_gather(b, &rail, r, (k, &even_cut(&rblocks, k)), &ready, &war)
    } else {
        ring_all_gather_part(b, &rail, ri, &rblocks, req.chunk, Some(own))
    };
    held.add(r * count, count, Some(own));
    let held = held.sealed();
    let none = vec![vec![None; k]; locals.len()];
    for host in &hosts {
        // Host-mate `l` holds the block of `host[l]` (its rail's member on that host).
        let lblocks: Vec<(usize, usize)> = host.iter().map(|&x| block(x)).collect();
        let ready: Vec<Vec<Option<u32>>> = (0..k)
            .map(|s| {
                let (o, l) = split(count, k, s);
                held.over(lblocks[li].0 + o, l)
            })
            .collect();
        direct_all_gather(b, &locals, r, (k, &even_cut(&lblocks, k)), &ready, &none);
    }
}

/// See `Algorithm::Hierarchical`.
pub(super) fn hierarchical_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let (l, h) = (locals.len(), rail.len());
    let lblocks: Vec<(usize, usize)> = (0..l).map(|j| split(count, l, j)).collect();
    // How local block `j` splits along its rail (relative offsets): in proportion to the
    // rail's weights when given, else evenly (rings ignore weights).
    let rail_split = |j: usize| -> Vec<(usize, usize)> {
        let len = lblocks[j].1;
        let w: Vec<u32> = hosts
            .iter()
            .map(|host| req.weights.get(host[j]).copied().unwrap_or(0))
            .collect();
        if h <= RAIL_DIRECT_MAX && w.iter().any(|&x| x > 0) {
            weighted_blocks(len, &w)
        } else {
            (0..h).map(|q| split(len, h, q)).collect()
        }
    };
    let splits: Vec<Vec<(usize, usize)>> = (0..l).map(rail_split).collect();
    // The first and last tiers cut every local block on its rail blocks, `ks` slices each,
    // taking the rail blocks in the order the rail uses them from this host (its own rail
    // index first, then downwards): a slice's steps sit at the same place on every host,
    // so the schedule looks the same from every host (the simulator's symmetry), and the
    // rail starts on what the first tier finishes first.
    let ks = phase_slices(&lblocks, req.chunk).div_ceil(h).max(1);
    let k1 = h * ks;
    let cut = |j: usize, s: usize| {
        let q = (ri + h - s / ks) % h;
        let (qo, ql) = splits[j][q];
        let (so, sl) = split(ql, ks, s % ks);
        (lblocks[j].0 + qo + so, sl)
    };
    // 1. Inside the host: reduce-scatter into the local blocks.
    let (off, len) = lblocks[li];
    let own = (Buf::Output, off);
    let rs1 = direct_reduce_scatter(
        b,
        &locals,
        r,
        &lblocks,
        (k1, &cut),
        Buf::Input,
        own,
        &NOTHING,
    );
    let mut p1 = rs1.done;
    if l == 1 && !req.in_place && len > 0 {
        // No local partner: the output starts as the input.
        let (i, o) = (
            Region::new(Buf::Input, off, len),
            Region::new(Buf::Output, off, len),
        );
        p1.add(off, len, Some(b.copy(i, o, &[])));
    }
    let p1 = p1.sealed();
    let after1 = |o: usize, l: usize| p1.over(o, l);
    // 2. Across hosts, along the rail: all-reduce of this rank's local block, each part as
    //    soon as the first tier has reduced it.
    let p2 = if h == 1 {
        Done::default()
    } else if req.algo == Algorithm::Aggregation {
        aggregated_rail(b, req, (off, len), &after1)
    } else if h <= RAIL_DIRECT_MAX {
        let rblocks: Vec<(usize, usize)> =
            splits[li].iter().map(|&(o, sl)| (off + o, sl)).collect();
        let k2 = phase_slices(&rblocks, req.chunk);
        let own = (Buf::Output, rblocks[ri].0);
        direct_all_reduce_part(b, &rail, r, &rblocks, k2, Buf::Output, own, &after1)
    } else {
        ring_all_reduce_part(b, &rail, ri, (off, len), req.chunk, 0, Buf::Output, &after1)
    }
    .sealed();
    // 3. Inside the host: all-gather of the local blocks, each slice once it is complete.
    let ready3: Vec<Vec<Option<u32>>> = (0..k1)
        .map(|s| {
            let (o, sl) = cut(li, s);
            let mut deps = p1.over(o, sl);
            deps.extend(p2.over(o, sl));
            deps
        })
        .collect();
    direct_all_gather(b, &locals, r, (k1, &cut), &ready3, &rs1.sent);
}

/// The rail tier of an aggregation all-reduce in two tiers: this rank's local block, slice
/// by slice ([`aggregation_slices`]), up to the aggregator (peer `world`) as soon as the first
/// tier has reduced it, and the rail's sum back in its place.
fn aggregated_rail(
    b: &mut Builder,
    req: &Request,
    (off, len): (usize, usize),
    after1: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> Done {
    let mut done = Done::default();
    let k = aggregation_slices(len, req.chunk);
    for s in 0..k {
        let (so, sl) = split(len, k, s);
        let r = Region::new(Buf::Output, off + so, sl);
        let sent = b.send(req.world, 0, r, &after1(off + so, sl));
        done.add(
            off + so,
            sl,
            Some(b.recv(req.world, 0, r, None, &[Some(sent)])),
        );
    }
    done
}

/// See `Algorithm::Hierarchical`: inside each host, a reduce-scatter of the blocks bound
/// for each host (rank `l` of a host sums, for every host, the block of that host's rank
/// `l`), then a direct reduce-scatter along the rail.
pub(super) fn hierarchical_reduce_scatter(b: &mut Builder, req: &Request, count: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        rail,
        ..
    } = tiers(req);
    let (l, h) = (locals.len(), hosts.len());
    let block = |x: usize| (x * count, count);
    let out = (Buf::Output, 0);
    if req.world == 1 {
        let (i, o) = (
            Region::new(Buf::Input, 0, count),
            Region::new(Buf::Output, 0, count),
        );
        b.copy(i, o, &[]);
        return;
    }
    if l == 1 {
        // One rank per host: only the rail.
        let rblocks: Vec<(usize, usize)> = rail.iter().map(|&x| block(x)).collect();
        let k = phase_slices(&rblocks, req.chunk);
        let cut = (k, &even_cut(&rblocks, k) as Cut);
        direct_reduce_scatter(b, &rail, r, &rblocks, cut, Buf::Input, out, &NOTHING);
        return;
    }
    // 1. Inside the host: this rank's sum for host `hb` lands in scratch block `hb`.
    b.scratch = h * count;
    let mut p1 = Done::default();
    for (hb, host) in hosts.iter().enumerate() {
        let lblocks: Vec<(usize, usize)> = host.iter().map(|&x| block(x)).collect();
        let k = phase_slices(&lblocks, req.chunk);
        let to = (Buf::Scratch, hb * count);
        let cut = (k, &even_cut(&lblocks, k) as Cut);
        let rs = direct_reduce_scatter(b, &locals, r, &lblocks, cut, Buf::Input, to, &NOTHING);
        p1.extend(rs.done);
    }
    let p1 = p1.sealed();
    // 2. Along the rail: rail-mate `hb` owns scratch block `hb`, each slice as soon as it is
    //    summed on this host.
    if h == 1 {
        let deps = p1.over(0, count);
        b.copy(
            Region::new(Buf::Scratch, 0, count),
            Region::new(Buf::Output, 0, count),
            &deps,
        );
        return;
    }
    let rblocks: Vec<(usize, usize)> = (0..h).map(|hb| (hb * count, count)).collect();
    let k = phase_slices(&rblocks, req.chunk);
    let after = |o: usize, l: usize| p1.over(o, l);
    let cut = (k, &even_cut(&rblocks, k) as Cut);
    direct_reduce_scatter(b, &rail, r, &rblocks, cut, Buf::Scratch, out, &after);
}

/// See `Algorithm::Hierarchical`: the root hands piece `l` of the buffer to its host-mate
/// `l`; each piece travels along its rail in a pipelined chain from the root's host; every
/// host then all-gathers its pieces. Each rank's network link carries one piece in and at
/// most one out: a host with a NIC per rank moves the buffer `l` times faster than one
/// chain.
pub(super) fn hierarchical_broadcast(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let r = req.rank;
    let Tiers {
        hosts,
        locals,
        li,
        rail,
        ri,
    } = tiers(req);
    let (l, h) = (locals.len(), hosts.len());
    let ra = hosts
        .iter()
        .position(|x| x.contains(&root))
        .expect("root's host");
    let pieces: Vec<(usize, usize)> = (0..l).map(|j| split(count, l, j)).collect();
    let k = phase_slices(&pieces, req.chunk);
    let slice = |j: usize, s: usize| {
        let (o, len) = split(pieces[j].1, k, s);
        Region::new(Buf::Output, pieces[j].0 + o, len)
    };
    let mut have = Done::default();
    // 1. The root (whose copy into its output is step 0) scatters the pieces on its host.
    let copied = (r == root).then_some(0u32);
    have.add(0, count, copied);
    let peers: Vec<usize> = (1..l).map(|d| (li + d) % l).collect();
    if ri == ra {
        for s in 0..k {
            if r == root {
                for &j in &peers {
                    b.send(locals[j], 0, slice(j, s), &[copied]);
                }
            } else {
                let got = b.recv(root, 0, slice(li, s), None, &[]);
                have.add(slice(li, s).offset, slice(li, s).len, Some(got));
            }
        }
    }
    // 2. Along the rail, a chain from the root's host.
    let v = (ri + h - ra) % h;
    let (next, prev) = (rail[(ri + 1) % h], rail[(ri + h - 1) % h]);
    let mut have = have.sealed();
    let mut chain = Done::default();
    for s in 0..k {
        let part = slice(li, s);
        if v == 0 {
            if h > 1 {
                b.send(next, 0, part, &have.over(part.offset, part.len));
            }
        } else {
            let got = b.recv(prev, 0, part, None, &[]);
            chain.add(part.offset, part.len, Some(got));
            if v + 1 < h {
                b.send(next, 0, part, &[Some(got)]);
            }
        }
    }
    have.extend(chain);
    let have = have.sealed();
    // 3. Inside each host, every rank but the root gathers the other pieces.
    for s in 0..k {
        let part = slice(li, s);
        let ready = have.over(part.offset, part.len);
        for &j in &peers {
            if locals[j] != root && part.len > 0 {
                b.send(locals[j], 0, part, &ready);
            }
        }
        if r != root {
            for &j in &peers {
                if slice(j, s).len > 0 {
                    b.recv(locals[j], 0, slice(j, s), None, &[]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Algorithm, Collective, Op, build};

    /// Random worlds split into hosts of equal size (including one rank per host and one host),
    /// ranks dealt to hosts in a random order, against the reference executor.
    #[test]
    fn hierarchical_schedules_verify_for_random_layouts() {
        let mut x = 0x5851_f42d_4c95_7f2du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..300 {
            let n = 1 + (next() % 12) as usize;
            let divisors: Vec<usize> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
            let h = divisors[(next() % divisors.len() as u64) as usize];
            // Deal ranks to hosts in a shuffled order; host numbers are arbitrary labels.
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let mut hosts = vec![0u32; n];
            for (slot, &rank) in order.iter().enumerate() {
                hosts[rank] = 100 + 7 * (slot % h) as u32;
            }
            let count = (next() % 150) as usize;
            let in_place = next() & 1 == 1;
            let chunk = 1 + (next() % 23) as usize;
            let coll = match case % 4 {
                0 => Collective::AllReduce { count },
                1 => Collective::AllGather { count: count / 4 },
                2 => Collective::ReduceScatter { count: count / 4 },
                _ => Collective::Broadcast {
                    count,
                    root: (next() % n as u64) as usize,
                },
            };
            // The same layouts order rings host by host.
            for algo in [
                Algorithm::Hierarchical,
                Algorithm::Ring,
                Algorithm::Aggregation,
            ] {
                if !algo.supports(&coll) {
                    continue;
                }
                let reqs: Vec<Request> = (0..n)
                    .map(|rank| Request {
                        coll: coll.clone(),
                        world: n,
                        rank,
                        in_place,
                        hosts: hosts.clone(),
                        algo,
                        chunk,
                        channels: 1 + case % 2,
                        // Uneven rail shares, some zero, on some all-reduces.
                        weights: if algo == Algorithm::Hierarchical && case % 8 == 0 {
                            hosts.iter().map(|&x| (x % 3) * 2).collect()
                        } else {
                            Vec::new()
                        },
                    })
                    .collect();
                let slots = 1 + case % 3;
                crate::verify::verify(&reqs, slots, next()).unwrap_or_else(|e| {
                    panic!("{coll:?} {algo:?} n={n} hosts={hosts:?} in_place={in_place} chunk={chunk} slots={slots}: {e}")
                });
            }
        }
        // Rails longer than RAIL_DIRECT_MAX run rings: 10 hosts × 2 ranks and 9 × 3,
        // hosts interleaved.
        for (n, h) in [(20usize, 10usize), (27, 9)] {
            let hosts: Vec<u32> = (0..n).map(|x| (x % h) as u32).collect();
            for (i, coll) in [
                Collective::AllReduce { count: 97 },
                Collective::AllGather { count: 5 },
                Collective::ReduceScatter { count: 3 },
                Collective::Broadcast { count: 61, root: 7 },
            ]
            .into_iter()
            .enumerate()
            {
                for in_place in [false, true] {
                    let reqs: Vec<Request> = (0..n)
                        .map(|rank| Request {
                            coll: coll.clone(),
                            world: n,
                            rank,
                            in_place,
                            hosts: hosts.clone(),
                            algo: Algorithm::Hierarchical,
                            chunk: 3,
                            channels: 1,
                            weights: Vec::new(),
                        })
                        .collect();
                    crate::verify::verify(&reqs, 2, (n * 10 + i) as u64).unwrap_or_else(|e| {
                        panic!("{coll:?} n={n} hosts={h} in_place={in_place}: {e}")
                    });
                }
            }
        }
        // A ring ordered by host crosses the host links half as much as one in rank order
        // when two hosts' ranks alternate.
        let crossing = |hosts: Vec<u32>| -> usize {
            let layout = [0u32, 1, 0, 1, 0, 1];
            (0..6)
                .map(|rank| {
                    let req = Request {
                        coll: Collective::AllReduce { count: 600 },
                        world: 6,
                        rank,
                        in_place: false,
                        hosts: hosts.clone(),
                        algo: Algorithm::Ring,
                        chunk: 1000,
                        channels: 1,
                        weights: Vec::new(),
                    };
                    build(&req)
                        .unwrap()
                        .steps
                        .iter()
                        .map(|st| match st.op {
                            Op::Send { peer, src, .. } if layout[peer] != layout[rank] => src.len,
                            _ => 0,
                        })
                        .sum::<usize>()
                })
                .sum()
        };
        assert_eq!(crossing(Vec::new()), 6 * 10 * 100);
        assert_eq!(crossing(vec![0, 1, 0, 1, 0, 1]), 2 * 10 * 100);
        // Uneven hosts are refused.
        let req = Request {
            coll: Collective::AllReduce { count: 10 },
            world: 3,
            rank: 0,
            in_place: false,
            hosts: vec![0, 0, 1],
            algo: Algorithm::Hierarchical,
            chunk: 4,
            channels: 1,
            weights: Vec::new(),
        };
        assert!(
            build(&req)
                .unwrap_err()
                .contains("as many ranks on every host")
        );
    }
}
