//! The simulator against closed forms, itself (determinism) and its unsymmetrised run.

mod common;

use common::{Params, cluster, rel};
use oxccl_core::schedule::{Algorithm, Collective};
use oxccl_sim::{Options, Report, Spec, simulate, simulate_with};

fn close(a: f64, b: f64) {
    assert!(rel(a, b) < 1e-9, "{a} vs {b} (rel {})", rel(a, b));
}

fn spec(coll: Collective, algo: Algorithm, chunk: usize) -> Spec {
    Spec {
        algo: Some(algo),
        chunk_bytes: Some(chunk),
        ..Spec::new(coll, 4)
    }
}

#[test]
fn single_flow_on_one_path() {
    // Broadcast from rank 0 to rank 1 over a star: one message of N bytes, rank -> switch ->
    // rank. Time = fragments·o + N/B + 2·latency (the root's copy costs nothing: infinite
    // reduce rate).
    let p = Params {
        reduce: f64::INFINITY,
        ..Params::star(2)
    };
    let f = cluster(p);
    let count = 1 << 20;
    let n = (count * 4) as f64;
    let r = simulate(
        &f,
        &spec(
            Collective::Broadcast { count, root: 0 },
            Algorithm::Tree,
            count * 4,
        ),
    )
    .unwrap();
    close(r.time_s, p.o + n / p.nic + 2.0 * p.lat);
    assert_eq!(r.flows, 1);
    // In fragments of 64 KiB: 64 posts, but each fragment leaves as it is posted (the next
    // post overlaps its transmission), and the 4 slots never stop the sender (a credit
    // comes back every 2 fragments, long before the window is used up): only the first
    // post is on the path.
    let r = simulate(
        &f,
        &spec(
            Collective::Broadcast { count, root: 0 },
            Algorithm::Tree,
            64 << 10,
        ),
    )
    .unwrap();
    close(r.time_s, p.o + n / p.nic + 2.0 * p.lat);
    assert_eq!(r.flows, 64);
    assert_eq!(r.credits, 32);
    // The link carried N bytes, busy N/B.
    let up0 = f.links.iter().position(|l| l.name == "r0->core").unwrap();
    close(r.link_bytes[up0], n);
    close(r.link_busy_s[up0], n / p.nic);
}

#[test]
fn two_flows_share_a_link() {
    // Rank 0 broadcasts to ranks 1 and 2 (binomial tree, larger subtree first: rank 2, then
    // rank 1). Both flows cross rank 0's uplink. The first leaves at o, alone at B until the
    // second leaves at 2o; then each gets B/2; the first drains at 2N/B, after which the
    // second, with B·o left, runs at B again and drains at 2N/B + o.
    let p = Params {
        reduce: f64::INFINITY,
        o: 1e-4,
        ..Params::star(3)
    };
    let f = cluster(p);
    let count = 1 << 20;
    let n = (count * 4) as f64;
    let r = simulate(
        &f,
        &spec(
            Collective::Broadcast { count, root: 0 },
            Algorithm::Tree,
            count * 4,
        ),
    )
    .unwrap();
    let b = p.nic;
    close(r.rank_done_s[2], 2.0 * n / b + 2.0 * p.lat);
    close(r.rank_done_s[1], 2.0 * n / b + p.o + 2.0 * p.lat);
    close(r.rank_done_s[0], 2.0 * n / b + p.o);
    close(r.time_s, 2.0 * n / b + p.o + 2.0 * p.lat);
}

/// The ring all-reduce on a star of P ranks with uniform links (rate B, latency l per hop,
/// two hops per message), per-message cost o, reduce rate R, one slice per block (b = N/P
/// bytes): each of the P−1 reduce-scatter steps takes o + b/B + 2l + b/R (post, transmit,
/// arrive, reduce) and each of the P−1 all-gather steps o + b/B + 2l, so
/// T = 2(P−1)/P·N/B + 2(P−1)(o + 2l) + (P−1)·b/R.
#[test]
fn ring_all_reduce_closed_form() {
    for ranks in [2, 3, 8, 16] {
        let p = Params::star(ranks);
        let f = cluster(p);
        let count = ranks * (1 << 18);
        let n = (count * 4) as f64;
        let block = n / ranks as f64;
        for symmetry in [false, true] {
            let s = Spec {
                symmetry,
                ..spec(
                    Collective::AllReduce { count },
                    Algorithm::Ring,
                    block as usize,
                )
            };
            let r = simulate(&f, &s).unwrap();
            let pm1 = (ranks - 1) as f64;
            let t = 2.0 * pm1 / ranks as f64 * n / p.nic
                + 2.0 * pm1 * (p.o + 2.0 * p.lat)
                + pm1 * block / p.reduce;
            close(r.time_s, t);
            assert_eq!(r.algo, Algorithm::Ring);
            assert_eq!(r.symmetric, symmetry && ranks > 1);
            // Every uplink carried 2(P−1) blocks.
            let up0 = f.links.iter().position(|l| l.name == "r0->core").unwrap();
            close(r.link_bytes[up0], 2.0 * pm1 * block);
        }
    }
}

#[test]
fn aggregation_closed_form() {
    // Every rank sends N to the core switch, which receives them in rank order, folding
    // each in at its rate Rs (P−1 reductions; the first is a plain receive), then sends
    // the sum to every rank: T = o + 2N/B + 2l + (P−1)·N/Rs.
    let ranks = 6;
    let rs = 2e10;
    let p = Params {
        core_reduce: Some(rs),
        ..Params::star(ranks)
    };
    let f = cluster(p);
    let count = 1 << 20;
    let n = (count * 4) as f64;
    let r = simulate(
        &f,
        &spec(
            Collective::AllReduce { count },
            Algorithm::Aggregation,
            count * 4,
        ),
    )
    .unwrap();
    assert_eq!(r.algo, Algorithm::Aggregation);
    assert!(!r.symmetric);
    close(
        r.time_s,
        p.o + 2.0 * n / p.nic + 2.0 * p.lat + (ranks - 1) as f64 * n / rs,
    );
    // Without an aggregating switch it says so.
    let e = simulate(
        &cluster(Params::star(ranks)),
        &spec(
            Collective::AllReduce { count },
            Algorithm::Aggregation,
            count * 4,
        ),
    )
    .unwrap_err();
    assert!(e.contains("switch that can reduce"), "{e}");
}

fn assert_same(a: &Report, b: &Report) {
    assert_eq!(a.algo, b.algo);
    close(a.time_s, b.time_s);
    for (x, y) in a.rank_done_s.iter().zip(&b.rank_done_s) {
        close(*x, *y);
    }
    for (x, y) in a.link_bytes.iter().zip(&b.link_bytes) {
        close(*x, *y);
    }
    for (x, y) in a.link_busy_s.iter().zip(&b.link_busy_s) {
        close(*x, *y);
    }
}

#[test]
fn symmetry_gives_the_unsymmetrised_result() {
    let hosts = |h: usize, per: usize| Params {
        hosts: h,
        per,
        ..Params::star(1)
    };
    let cases: Vec<(Params, Collective, Algorithm, usize)> = vec![
        (
            Params::star(12),
            Collective::AllReduce { count: 3 << 20 },
            Algorithm::Ring,
            1 << 20,
        ),
        (
            Params::star(12),
            Collective::AllReduce { count: 3 << 20 },
            Algorithm::Ring,
            64 << 10,
        ),
        (
            hosts(6, 4),
            Collective::AllReduce { count: 6 << 20 },
            Algorithm::Ring,
            1 << 20,
        ),
        (
            hosts(6, 4),
            Collective::AllReduce { count: 6 << 20 },
            Algorithm::Ring,
            256 << 10,
        ),
        (
            hosts(4, 2),
            Collective::AllGather { count: 1 << 20 },
            Algorithm::Ring,
            1 << 20,
        ),
        (
            hosts(4, 2),
            Collective::ReduceScatter { count: 1 << 20 },
            Algorithm::Ring,
            1 << 20,
        ),
    ];
    for ((p, coll, algo, chunk), channels) in cases.into_iter().zip([1, 2].into_iter().cycle()) {
        let f = cluster(p);
        let base = Spec {
            algo: Some(algo),
            chunk_bytes: Some(chunk),
            channels: Some(channels),
            ..Spec::new(coll.clone(), 4)
        };
        let full = simulate(
            &f,
            &Spec {
                symmetry: false,
                ..base.clone()
            },
        )
        .unwrap();
        let sym = simulate(&f, &base).unwrap();
        assert!(
            sym.symmetric && !sym.approximate,
            "{coll:?} {algo:?}: symmetry not used"
        );
        assert!(!full.symmetric);
        assert!(sym.simulated_ranks < full.simulated_ranks);
        assert_same(&full, &sym);
    }
}

/// Where credits bind (two slots, long links), a representative's credits go back to the
/// representative that sent what it consumed, and the symmetrised run is still exact.
#[test]
fn symmetry_gives_the_unsymmetrised_result_where_credits_bind() {
    let p = Params {
        lat: 50e-6,
        ..Params::star(8)
    };
    let f = cluster(p);
    for (algo, coll) in [
        (Algorithm::Ring, Collective::AllReduce { count: 2 << 20 }),
        (Algorithm::Ring, Collective::AllGather { count: 1 << 18 }),
    ] {
        let base = Spec {
            algo: Some(algo),
            chunk_bytes: Some(64 << 10),
            slots: Some(2),
            ..Spec::new(coll.clone(), 4)
        };
        let full = simulate(
            &f,
            &Spec {
                symmetry: false,
                ..base.clone()
            },
        )
        .unwrap();
        let sym = simulate(&f, &base).unwrap();
        assert!(sym.symmetric && sym.simulated_ranks == 1, "{coll:?}");
        assert!(full.credits > 0);
        assert_eq!(sym.credits * 8, full.credits, "{coll:?}");
        assert_same(&full, &sym);
        // The window binds: more slots go faster.
        let roomy = simulate(
            &f,
            &Spec {
                slots: Some(16),
                ..base
            },
        )
        .unwrap();
        assert!(
            roomy.time_s < full.time_s * 0.9,
            "{coll:?}: {} vs {}",
            roomy.time_s,
            full.time_s
        );
    }
}

#[test]
fn hierarchical_all_reduce_is_symmetric_and_others_run_in_full_or_flagged_approximate() {
    // The hierarchical all-reduce cuts its tiers on rail blocks taken from each host's own
    // place on the rail: shifting hosts is a symmetry of its schedules.
    let f = cluster(Params {
        hosts: 16,
        per: 4,
        nic: 50e9,
        up: 900e9,
        o: 2e-6,
        reduce: 200e9,
        ..Params::star(1)
    });
    let hier = Spec {
        algo: Some(Algorithm::Hierarchical),
        ..Spec::new(Collective::AllReduce { count: 1 << 26 }, 4)
    };
    let sym = simulate(&f, &hier).unwrap();
    let full = simulate(
        &f,
        &Spec {
            symmetry: false,
            ..hier.clone()
        },
    )
    .unwrap();
    assert!(sym.symmetric && !sym.approximate && !full.symmetric);
    assert_same(&full, &sym);
    // The hierarchical all-gather gathers inside the host in host order, each slice once its
    // rail copy arrived: its dependencies depend on the host's place, not a symmetry.
    let s = Spec {
        algo: Some(Algorithm::Hierarchical),
        ..Spec::new(Collective::AllGather { count: 1 << 20 }, 4)
    };
    let full = simulate(&f, &s).unwrap();
    assert!(!full.symmetric);
    let nosym = simulate(
        &f,
        &Spec {
            symmetry: false,
            ..s.clone()
        },
    )
    .unwrap();
    assert_eq!(full, nosym);
    // Forced: flagged approximate, and close.
    let approx = simulate_with(
        &f,
        &s,
        &Options {
            approximate_above_steps: 0,
        },
    )
    .unwrap();
    assert!(approx.symmetric && approx.approximate);
    assert!(
        rel(approx.time_s, full.time_s) < 0.05,
        "{} vs {}",
        approx.time_s,
        full.time_s
    );
}

#[test]
fn uneven_counts_fall_back_to_the_full_run() {
    // 1,000,003 elements over 12 ranks: blocks of unequal length break the invariance.
    let f = cluster(Params::star(12));
    let s = spec(
        Collective::AllReduce { count: 1_000_003 },
        Algorithm::Ring,
        1 << 20,
    );
    let r = simulate(&f, &s).unwrap();
    assert!(!r.symmetric);
    assert_eq!(r.simulated_ranks, 12);
}

#[test]
fn deterministic() {
    let f = cluster(Params {
        hosts: 4,
        per: 4,
        ..Params::star(1)
    });
    for sym in [false, true] {
        let s = Spec {
            trace: true,
            symmetry: sym,
            ..Spec::new(Collective::AllReduce { count: 4 << 20 }, 4)
        };
        let a = simulate(&f, &s).unwrap();
        let b = simulate(&f, &s).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.algo, Algorithm::Hierarchical);
        let trace = a.trace.unwrap();
        assert!(
            trace
                .iter()
                .all(|e| e.end_s >= e.start_s && e.start_s >= 0.0)
        );
        assert!(
            trace
                .iter()
                .any(|e| matches!(e.track, oxccl_sim::Track::Link(_)))
        );
    }
}

#[test]
fn every_collective_runs() {
    let f = cluster(Params {
        hosts: 3,
        per: 2,
        ..Params::star(1)
    });
    let colls = [
        Collective::AllReduce { count: 1000 },
        Collective::AllReduce { count: 1 << 20 },
        Collective::ReduceScatter { count: 1 << 16 },
        Collective::AllGather { count: 1 << 16 },
        Collective::Broadcast {
            count: 1 << 20,
            root: 1,
        },
        Collective::Reduce {
            count: 1 << 20,
            root: 2,
        },
        Collective::AllToAll { count: 1 << 12 },
        Collective::Gather {
            count: 1 << 12,
            root: 0,
        },
        Collective::Scatter {
            count: 1 << 12,
            root: 3,
        },
        Collective::Barrier,
        Collective::AllReduce { count: 0 },
    ];
    for c in colls {
        for in_place in [false, true] {
            let s = Spec {
                in_place,
                ..Spec::new(c.clone(), 4)
            };
            if in_place && c.in_place_offsets(6, 0).is_none() {
                continue;
            }
            let r = simulate(&f, &s).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            assert!(r.time_s.is_finite() && r.time_s >= 0.0, "{c:?}");
            if c.count() > 0 || c == Collective::Barrier {
                assert!(r.time_s > 0.0, "{c:?}");
            }
        }
    }
}

#[test]
fn symmetry_of_a_structured_cluster_gives_the_unsymmetrised_result() {
    // A rail-optimised cluster from a topology file (its routes spread over the spines by
    // hash): 16 hosts of 4 in leaf groups of 4, oversubscribed 2:1 so that spines matter.
    let f = oxccl_sim::Fabric::parse(
        "[cluster]\nhosts = 16\ngpus_per_host = 4\nnic_gbps = 400\nhosts_per_leaf = 4\n\
         oversubscription = 2.0\n",
    )
    .unwrap();
    assert!(f.symmetry.is_some());
    for (coll, algo) in [
        (Collective::AllReduce { count: 4 << 20 }, Algorithm::Ring),
        (Collective::AllGather { count: 1 << 18 }, Algorithm::Ring),
        (
            Collective::ReduceScatter { count: 1 << 18 },
            Algorithm::Ring,
        ),
    ] {
        let s = Spec {
            algo: Some(algo),
            chunk_bytes: Some(256 << 10),
            ..Spec::new(coll.clone(), 4)
        };
        let full = simulate(
            &f,
            &Spec {
                symmetry: false,
                ..s.clone()
            },
        )
        .unwrap();
        let sym = simulate(&f, &s).unwrap();
        assert!(sym.symmetric && !sym.approximate, "{coll:?}");
        assert_same(&full, &sym);
    }
}

#[test]
fn a_huge_run_without_symmetry_is_refused() {
    let f = cluster(Params {
        symmetric: false,
        ..Params::star(4096)
    });
    let s = spec(
        Collective::AllReduce { count: 1 << 26 },
        Algorithm::Ring,
        4096,
    );
    let e = simulate(&f, &s).unwrap_err();
    assert!(e.contains("no usable symmetry"), "{e}");
}

#[test]
fn a_sender_waits_for_the_receivers_slots() {
    // A chain reduce of 3 ranks (rank 2 -> 1 -> 0) in k = 16 slices of c bytes, rank 1
    // reducing at R far below the link rate B. Rank 2 may have 4 slices (the network's
    // slots) unreceived at rank 1: its last slice can leave only once rank 1 has reduced
    // slice k - 5, at about (k - 4)·c/R; without flow control it would be done at k·c/B.
    let p = Params {
        reduce: 1e7,
        o: 0.0,
        ..Params::star(3)
    };
    let f = cluster(p);
    // Slices above INLINE: signaled fragments, whose wire time the pacing below assumes (an
    // inline slice also costs the sender a copy into its staging region).
    let (k, c) = (16usize, 32768usize);
    let r = simulate(
        &f,
        &spec(
            Collective::Reduce {
                count: k * c / 4,
                root: 0,
            },
            Algorithm::Chain,
            c,
        ),
    )
    .unwrap();
    let paced = (k - 4) as f64 * c as f64 / p.reduce;
    assert!(
        r.rank_done_s[2] >= paced * 0.99,
        "rank 2 done at {} s, slots allow {paced} s at the earliest",
        r.rank_done_s[2]
    );
    // And no later than one more slice.
    assert!(r.rank_done_s[2] <= paced + 2.0 * c as f64 / p.reduce);
    assert!((k * c) as f64 / p.nic < paced / 10.0);
}

/// The executor's window, fragment by fragment: rank 0 broadcasts one message of 10
/// fragments to rank 1 through `slots` slots, and the receiver reports its consumed count
/// every `slots / 2` fragments. Fragment `k ≥ slots` may be posted only once the credit
/// that covers fragment `k - slots` is back: the receiver sends it when it has consumed the
/// fragment (the credit's own post costs the receiver nothing), and it takes the per-message
/// time and the two hops' latency back. Posts take the sender's thread in turn, fragments
/// leave the connection in order.
#[test]
fn credits_pace_a_long_message_through_few_slots() {
    let p = Params {
        reduce: f64::INFINITY,
        o: 2e-6,
        lat: 20e-6,
        ..Params::star(2)
    };
    let f = cluster(p);
    let (frag, nf) = (64usize << 10, 10usize);
    let count = nf * frag / 4;
    let tau = frag as f64 / p.nic;
    let one_way = 2.0 * p.lat;
    let credit_delay = p.o + one_way;
    let mut times = Vec::new();
    for slots in [2usize, 4, 8] {
        let s = Spec {
            slots: Some(slots),
            symmetry: false,
            ..spec(
                Collective::Broadcast { count, root: 0 },
                Algorithm::Tree,
                frag,
            )
        };
        let r = simulate(&f, &s).unwrap();
        let every = (slots / 2).max(1);
        let (mut drain, mut arrive) = (vec![0.0f64; nf], vec![0.0f64; nf]);
        let mut thread = 0.0f64;
        for k in 0..nf {
            let window = if k < slots {
                0.0
            } else {
                // The first credit that reports fragment k - slots consumed: the one sent
                // after fragment j, where j + 1 is a multiple of `every`.
                let j = (k - slots + 1).div_ceil(every) * every - 1;
                arrive[j] + credit_delay
            };
            thread = thread.max(window) + p.o;
            let leave = if k == 0 {
                thread
            } else {
                thread.max(drain[k - 1])
            };
            drain[k] = leave + tau;
            arrive[k] = drain[k] + one_way;
        }
        close(r.time_s, arrive[nf - 1]);
        assert_eq!(r.flows, nf as u64, "one flow per fragment");
        assert_eq!(r.credits, (nf / every) as u64, "a credit every {every}");
        times.push(r.time_s);
    }
    // Two slots make the sender wait for credits; with eight the pipeline runs free.
    let free = p.o + nf as f64 * tau + one_way;
    assert!(times[0] > free * 1.05, "{} vs {free}", times[0]);
    close(times[2], free);
}

/// Small one-shot exchanges between ranks of one host run in mailboxes, as the runtime runs
/// them on its shm links: two ranks exchange 64 KiB (recursive doubling: one message each
/// way, the mailbox's largest) as one write each, no slots, no credits. Each rank posts its
/// input (o, and its copy into the staging mailbox, b/R; the send is done then), the message
/// crosses the host's switch (b/up, two hops) and is reduced with the input straight into
/// the output (b/R; out of place, recursive doubling copies nothing first). Between hosts the
/// same exchange runs in mailboxes too (the runtime writes them whole: one frame each way).
#[test]
fn a_mailbox_exchange_has_no_slots_and_no_credits() {
    let b = 64usize << 10;
    let s = Spec {
        slots: Some(2),
        symmetry: false,
        ..spec(
            Collective::AllReduce { count: b / 4 },
            Algorithm::RecursiveDoubling,
            4096,
        )
    };
    let p = Params {
        hosts: 1,
        per: 2,
        ..Params::star(2)
    };
    let r = simulate(&cluster(p), &s).unwrap();
    assert_eq!((r.flows, r.credits), (2, 0));
    let b = b as f64;
    close(r.time_s, 2.0 * b / p.reduce + p.o + b / p.up + 2.0 * p.lat);
    let r = simulate(&cluster(Params::star(2)), &s).unwrap();
    assert_eq!((r.flows, r.credits), (2, 0));
    // Above the mailbox's size, slots: 16 fragments of the 4 KiB chunk and one more each
    // way, through 2 slots.
    let s = Spec {
        coll: Collective::AllReduce {
            count: b as usize / 4 + 1,
        },
        ..s
    };
    let r = simulate(&cluster(p), &s).unwrap();
    assert_eq!(r.flows, 34);
    assert!(r.credits > 0);
}
