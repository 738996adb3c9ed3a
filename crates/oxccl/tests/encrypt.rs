//! `OXCCL_ENCRYPT` by real processes over tcp: `on` seals every tcp link and the all-reduces
//! stay exact (checked against a closed form computed here); `auto` leaves a link between
//! two ranks on one host (loopback or this host's interfaces) plain. What each rank decided is
//! read from [`Communicator::encrypted`] and from its `OXCCL_DEBUG=INFO` lines.

mod common;

use oxccl::{Communicator, ReduceOp};
use serde_json::{Value, json};

use common::{expect_results, report, run_ranks};

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "all_reduce" => all_reduce(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// Element `i` of rank `r`'s input: small integers, so that every sum is exact in f32.
fn input(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 13) % 101) as f32
}

/// All-reduces (sum) of each count in `counts`; for each, whether every element equals the
/// sum of the inputs computed here.
fn all_reduce(args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut exact = Vec::new();
    for c in args["counts"].as_array().unwrap() {
        let count = c.as_u64().unwrap() as usize;
        let mut v: Vec<f32> = (0..count).map(|i| input(rank, i)).collect();
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("all-reduce of {count}: {e}"));
        let wrong = (0..count).find(|&i| v[i] != (0..n).map(|r| input(r, i)).sum::<f32>());
        exact.push(json!({ "count": count, "first_wrong": wrong }));
    }
    json!({
        "encrypted": comm.encrypted(),
        "providers": comm.providers().iter().map(|p| p.map(|p| p.name())).collect::<Vec<_>>(),
        "exact": exact,
    })
}

/// Runs the all-reduces on 2 ranks over tcp with `OXCCL_ENCRYPT=encrypt`; checks every
/// result is exact and returns the results with every rank's stderr.
fn run(encrypt: &str) -> (Vec<Value>, Vec<String>) {
    let outs = run_ranks(
        2,
        &[
            ("OXCCL_PROVIDER", "tcp"),
            ("OXCCL_ENCRYPT", encrypt),
            ("OXCCL_DEBUG", "INFO"),
        ],
        "all_reduce",
        // A mailbox-sized call, one of a few slots, one of many 1 MiB chunks.
        &json!({ "counts": [1000, 300_000, 4_000_001] }),
    );
    let results = expect_results(&format!("OXCCL_ENCRYPT={encrypt}"), &outs);
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res["providers"][1 - r], "tcp", "{}", report(&outs));
        for e in res["exact"].as_array().unwrap() {
            assert!(
                e["first_wrong"].is_null(),
                "OXCCL_ENCRYPT={encrypt}: rank {r}: {e}"
            );
        }
    }
    (results, outs.into_iter().map(|o| o.stderr).collect())
}

/// `on`: both ranks seal their link, say so at INFO, and every all-reduce is exact.
#[test]
fn encrypt_on_seals_tcp_and_all_reduce_is_exact() {
    let (results, stderr) = run("on");
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res["encrypted"][1 - r], true, "rank {r}: {res}");
        assert_eq!(res["encrypted"][r], false, "rank {r}: itself");
        let line = format!("rank {r}: link to rank {} at ", 1 - r);
        assert!(
            stderr[r]
                .lines()
                .any(|l| l.contains(&line) && l.contains("over tcp: sealed")),
            "rank {r}'s INFO lines: {}",
            stderr[r]
        );
    }
}

/// `auto` (the default) between two ranks of this host: the tcp link stays plain, and INFO
/// says so.
#[test]
fn encrypt_auto_leaves_a_link_on_this_host_plain() {
    let (results, stderr) = run("auto");
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res["encrypted"][1 - r], false, "rank {r}: {res}");
        assert!(
            stderr[r]
                .lines()
                .any(|l| l.contains(&format!("link to rank {}", 1 - r))
                    && l.contains("over tcp: plain")),
            "rank {r}'s INFO lines: {}",
            stderr[r]
        );
    }
}
