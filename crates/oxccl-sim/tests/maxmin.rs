//! The engine's max-min fair rates against a brute-force reference on random small cases,
//! after every change of an incremental sequence of flows starting and ending.

use oxccl_sim::engine::Net;
use proptest::prelude::*;

/// Progressive filling, the naive way: raise every unfrozen flow by the largest amount no
/// link forbids, freeze the flows of the links that are then full, repeat.
#[allow(clippy::needless_range_loop)] // links index caps and loads alike
fn reference(caps: &[f64], flows: &[Vec<(u32, f64)>]) -> Vec<f64> {
    let mut rate = vec![0.0; flows.len()];
    let mut frozen = vec![false; flows.len()];
    loop {
        let load = |l: usize, rate: &[f64]| -> f64 {
            flows
                .iter()
                .enumerate()
                .map(|(f, p)| {
                    p.iter()
                        .filter(|x| x.0 as usize == l)
                        .map(|x| x.1 * rate[f])
                        .sum::<f64>()
                })
                .sum()
        };
        let wfree = |l: usize, frozen: &[bool]| -> f64 {
            flows
                .iter()
                .enumerate()
                .filter(|(f, _)| !frozen[*f])
                .map(|(_, p)| {
                    p.iter()
                        .filter(|x| x.0 as usize == l)
                        .map(|x| x.1)
                        .sum::<f64>()
                })
                .sum()
        };
        let mut inc = f64::INFINITY;
        for l in 0..caps.len() {
            let w = wfree(l, &frozen);
            if w > 0.0 {
                inc = inc.min((caps[l] - load(l, &rate)).max(0.0) / w);
            }
        }
        if !inc.is_finite() {
            return rate;
        }
        for f in 0..flows.len() {
            if !frozen[f] {
                rate[f] += inc;
            }
        }
        for l in 0..caps.len() {
            if wfree(l, &frozen) > 0.0 && caps[l] - load(l, &rate) <= 1e-9 * caps[l] {
                for (f, p) in flows.iter().enumerate() {
                    if p.iter().any(|x| x.0 as usize == l) {
                        frozen[f] = true;
                    }
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Add(Vec<(u32, f64)>),
    Remove(usize),
}

fn case() -> impl Strategy<Value = (Vec<f64>, Vec<Op>)> {
    (2usize..6).prop_flat_map(|links| {
        let caps = proptest::collection::vec(1.0f64..100.0, links);
        let path = proptest::collection::btree_map(0..links as u32, 1u32..4, 1..=links)
            .prop_map(|m| m.into_iter().map(|(l, w)| (l, w as f64 / 2.0)).collect());
        let op = prop_oneof![3 => path.prop_map(Op::Add), 1 => (0usize..8).prop_map(Op::Remove)];
        (caps, proptest::collection::vec(op, 1..20))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn rates_are_max_min_fair((caps, ops) in case()) {
        let mut net = Net::new(&caps, false);
        let mut active: Vec<(u32, Vec<(u32, f64)>)> = Vec::new();
        for (t, op) in ops.into_iter().enumerate() {
            let now = t as f64 * 1e-3;
            match op {
                Op::Add(path) => {
                    let id = net.add(now, &path, 1e9).unwrap();
                    active.push((id, path));
                }
                Op::Remove(i) => {
                    if !active.is_empty() {
                        let (id, _) = active.remove(i % active.len());
                        net.remove(now, id);
                    }
                }
            }
            net.settle(now);
            let paths: Vec<Vec<(u32, f64)>> = active.iter().map(|a| a.1.clone()).collect();
            let want = reference(&caps, &paths);
            for ((id, _), w) in active.iter().zip(&want) {
                let got = net.rate(*id);
                prop_assert!((got - w).abs() <= 1e-9 * w.max(1.0), "flow {id}: {got} vs {w}");
            }
        }
    }
}
