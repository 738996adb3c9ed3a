//! Group calls (`Communicator::group` ... `Group::end`), by real processes on shm and tcp: an
//! exchange that deadlocks without a group, an all-to-all made of sends and receives, several
//! collectives of different types in one group, and groups whose ranks disagree.

mod common;

use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};
use serde_json::{Value, json};

use common::{error_kind, expect_results, mix, run_ranks};

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let start = Instant::now();
    let r = match scenario {
        "ring" => ring(&comm, args),
        "alltoall" => alltoall(&comm, args),
        "mixed" => mixed(&comm),
        "disordered" => disordered(&comm),
        other => panic!("unknown scenario {other:?}"),
    };
    let ms = start.elapsed().as_millis() as u64;
    let v = match r {
        Ok(wrong) => json!({ "ok": true, "wrong": wrong, "ms": ms }),
        Err(e) => json!({ "ok": false, "kind": error_kind(&e), "msg": e.to_string(), "ms": ms }),
    };
    // Keep the communicator until every rank has its result: a rank that exits early is a
    // failure its peers would see.
    common::mark_done();
    common::linger();
    drop(comm);
    v
}

/// What rank `from` sends rank `to`, element `i` (an independent reference every rank can
/// compute).
fn value(from: usize, to: usize, i: usize) -> u32 {
    mix((from * 1_000_003 + to * 7919 + i) as u64) as u32
}

/// Each rank sends a large buffer to its right neighbour and receives one from its left,
/// sends first: without a group, every rank's send waits for a receive nobody has started.
fn ring(comm: &Communicator, args: &Value) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let count = args["count"].as_u64().unwrap() as usize;
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let mut wrong = Vec::new();
    for round in 0..2 {
        let mine: Vec<u32> = (0..count).map(|i| value(rank, right, i + round)).collect();
        let mut theirs = vec![0u32; count];
        let mut g = comm.group();
        g.send(&mine, right)?;
        g.recv(&mut theirs, left)?;
        g.end()?;
        if let Some(i) = (0..count).find(|&i| theirs[i] != value(left, rank, i + round)) {
            wrong.push(format!("round {round}: element {i} from rank {left}"));
        }
    }
    Ok(wrong)
}

/// An all-to-all written as one group of a send and a receive per peer, in a different
/// order on each rank for the peers (the order per peer is what must agree).
fn alltoall(comm: &Communicator, args: &Value) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let count = args["count"].as_u64().unwrap() as usize;
    let sends: Vec<Vec<u32>> = (0..n)
        .map(|p| (0..count).map(|i| value(rank, p, i)).collect())
        .collect();
    let mut recvs: Vec<Vec<u32>> = vec![vec![0; count]; n];
    let mut g = comm.group();
    let mut slots: Vec<&mut Vec<u32>> = recvs.iter_mut().collect();
    for k in (1..n).rev() {
        let p = (rank + k) % n;
        g.send(&sends[p], p)?;
    }
    for (p, buf) in slots.iter_mut().enumerate() {
        if p != rank {
            g.recv(buf, p)?;
        }
    }
    g.end()?;
    let mut wrong = Vec::new();
    for (p, got) in recvs.iter().enumerate().filter(|(p, _)| *p != rank) {
        if let Some(i) = (0..count).find(|&i| got[i] != value(p, rank, i)) {
            wrong.push(format!("element {i} from rank {p}"));
        }
    }
    Ok(wrong)
}

/// Several collectives of different types, operators and sizes (mailbox-sized and
/// slot-sized) in one group, checked against sums computed locally.
fn mixed(comm: &Communicator) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut a: Vec<f64> = (0..100_000).map(|i| (rank * 3 + i % 7) as f64).collect();
    let mut b: Vec<i32> = (0..100).map(|i| (rank as i32 + 1) * (i - 50)).collect();
    let mut c: Vec<f32> = (0..50_000).map(|i| (rank + i) as f32).collect();
    let mut d: Vec<u8> = if rank == n - 1 {
        (0..5000).map(|i| (i % 251) as u8).collect()
    } else {
        vec![0; 5000]
    };
    let mut g = comm.group();
    g.all_reduce_in_place(&mut a, ReduceOp::Sum)?;
    g.all_reduce_in_place(&mut b, ReduceOp::Max)?;
    g.all_reduce_in_place(&mut c, ReduceOp::Avg)?;
    g.broadcast_in_place(&mut d, n - 1)?;
    g.end()?;
    let mut wrong = Vec::new();
    let sum_a = |i: usize| (0..n).map(|r| (r * 3 + i % 7) as f64).sum::<f64>();
    if let Some(i) = (0..a.len()).find(|&i| a[i] != sum_a(i)) {
        wrong.push(format!("sum: element {i} is {}, not {}", a[i], sum_a(i)));
    }
    let max_b = |i: usize| {
        (0..n)
            .map(|r| (r as i32 + 1) * (i as i32 - 50))
            .max()
            .unwrap()
    };
    if let Some(i) = (0..b.len()).find(|&i| b[i] != max_b(i)) {
        wrong.push(format!("max: element {i} is {}, not {}", b[i], max_b(i)));
    }
    let avg_c = |i: usize| (0..n).map(|r| (r + i) as f32).sum::<f32>() / n as f32;
    if let Some(i) = (0..c.len()).find(|&i| (c[i] - avg_c(i)).abs() > 1e-3 * avg_c(i).abs()) {
        wrong.push(format!("avg: element {i} is {}, not {}", c[i], avg_c(i)));
    }
    if let Some(i) = (0..d.len()).find(|&i| d[i] != (i % 251) as u8) {
        wrong.push(format!("broadcast: element {i} is {}", d[i]));
    }
    Ok(wrong)
}

/// Rank 0 lists a group's two all-reduces in the other order: the ranks disagree, and every
/// rank must say so (a mismatch or the failure it causes), not hang or mix the data up.
fn disordered(comm: &Communicator) -> oxccl::Result<Vec<String>> {
    let mut x = vec![1f32; 200_000];
    let mut y = vec![1f32; 300_000];
    let mut g = comm.group();
    if comm.rank() == 0 {
        g.all_reduce_in_place(&mut y, ReduceOp::Sum)?;
        g.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    } else {
        g.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        g.all_reduce_in_place(&mut y, ReduceOp::Sum)?;
    }
    comm.set_timeout(Duration::from_secs(10));
    g.end()?;
    Ok(vec!["the group completed".into()])
}

fn check_all_ok(name: &str, n: usize, env: &[(&str, &str)], scenario: &str, args: Value) {
    let outs = run_ranks(n, env, scenario, &args);
    let results = expect_results(name, &outs);
    for (rank, r) in results.iter().enumerate() {
        let all = || {
            results
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            r["ok"],
            true,
            "{name}: rank {rank}: {r}\nevery rank:\n{}",
            all()
        );
        assert_eq!(r["wrong"], json!([]), "{name}: rank {rank}: {r}");
    }
}

const PROVIDERS: [&str; 2] = ["shm", "tcp"];

#[test]
fn a_send_and_a_receive_in_a_group_do_not_wait_for_each_other() {
    for p in PROVIDERS {
        for (n, count) in [(2, 300_000), (3, 70_000), (4, 7)] {
            let name = format!("ring {p} n={n} count={count}");
            let env = [("OXCCL_PROVIDER", p), ("OXCCL_TIMEOUT", "20")];
            check_all_ok(&name, n, &env, "ring", json!({ "count": count }));
        }
    }
}

#[test]
fn an_all_to_all_of_sends_and_receives_in_one_group() {
    for p in PROVIDERS {
        for (n, count) in [(3, 50_000), (4, 1000)] {
            let name = format!("alltoall {p} n={n} count={count}");
            let env = [("OXCCL_PROVIDER", p), ("OXCCL_TIMEOUT", "20")];
            check_all_ok(&name, n, &env, "alltoall", json!({ "count": count }));
        }
    }
}

#[test]
fn several_collectives_of_different_types_in_one_group() {
    for p in PROVIDERS {
        for n in [2, 3] {
            let name = format!("mixed {p} n={n}");
            let env = [("OXCCL_PROVIDER", p), ("OXCCL_TIMEOUT", "20")];
            check_all_ok(&name, n, &env, "mixed", json!({}));
        }
    }
}

#[test]
fn ranks_that_order_a_group_differently_all_get_an_error() {
    let outs = run_ranks(3, &[("OXCCL_TIMEOUT", "10")], "disordered", &json!({}));
    let results = expect_results("disordered", &outs);
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(
            r["ok"], false,
            "rank {rank} completed a disordered group: {r}"
        );
        assert!(
            r["ms"].as_u64().unwrap() < 9000,
            "rank {rank} waited for its timeout rather than seeing the disagreement: {r}"
        );
        let msg = r["msg"].as_str().unwrap();
        assert!(
            msg.contains("rank 0") || r["kind"] == "Mismatch",
            "rank {rank}'s error names neither the mismatch nor rank 0: {r}"
        );
    }
}
