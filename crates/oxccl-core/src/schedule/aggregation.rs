//! All-reduce through an in-network aggregator ([`Algorithm::Aggregation`]): each rank's
//! schedule sends its input slice by slice to the aggregator (the virtual peer `world`) and
//! receives the result; [`build_aggregator`] builds the aggregator's own schedule.

use super::{Algorithm, Buf, Builder, Collective, Region, Request, Schedule, slices, split};

/// A rank's side of an [`Algorithm::Aggregation`] all-reduce: each slice of its input up to the
/// aggregator (peer `world`), and the reduced slice back into its output.
pub(super) fn aggregation_all_reduce(b: &mut Builder, req: &Request, count: usize) {
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
