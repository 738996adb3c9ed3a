//! Calls in flight (`Communicator::start` and the `_async` calls), by real processes on shm
//! and tcp: a send and a receive started one after the other with the same peer progress
//! together whenever each was started (a large exchange deadlocks if they run one at a
//! time), many collectives in flight at once and waited for in any order, blocking calls
//! and submitted closures between them, the buffers handed back, bad arguments reported
//! through the work at once, and a peer that dies failing every call in flight.

mod common;

use std::time::Duration;

use oxccl::schedule::Collective;
use oxccl::{Communicator, ReduceOp, Work};
use serde_json::{Value, json};

use common::{error_kind, expect_results, mix, run_ranks};

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    let comm = if scenario == "learner_behind" {
        // Each rank its own host, over tcp: the link-rate learner runs, a round after every call.
        let mut o = oxccl::Options::from_env().unwrap();
        o.host_id = Some(format!("host{}", common::env_rank().0));
        o.learn_interval = 1;
        let boot = oxccl_bootstrap::Bootstrap::from_env().unwrap();
        Communicator::init(boot, o).unwrap_or_else(|e| panic!("init: {e}"))
    } else {
        Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"))
    };
    let r = match scenario {
        "learner_behind" => learner_behind(&comm),
        "exchange" => exchange(&comm, args),
        "many" => many(&comm, args),
        "dies" => dies(comm),
        "behind" => behind(&comm),
        other => panic!("unknown scenario {other:?}"),
    };
    let v = match r {
        Ok(wrong) => json!({ "ok": true, "wrong": wrong }),
        Err(e) => json!({ "ok": false, "kind": error_kind(&e), "msg": e.to_string() }),
    };
    common::mark_done();
    common::linger();
    drop(comm);
    v
}

fn wait<T>(w: &mut Work<T>) -> oxccl::Result<T> {
    w.wait(Duration::from_secs(60))
}

/// What rank `from` sends rank `to`, element `i`.
fn value(from: usize, to: usize, round: usize, i: usize) -> u32 {
    mix((from * 1_000_003 + to * 7919 + round * 31 + i) as u64) as u32
}

/// Each rank sends a large buffer to its right neighbour and receives one from its left:
/// the send started first, the receive after it (on odd ranks, after a pause), which
/// deadlocks unless both fly together.
fn exchange(comm: &Communicator, args: &Value) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let count = args["count"].as_u64().unwrap() as usize;
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let mut wrong = Vec::new();
    for round in 0..3 {
        let mine: Vec<u32> = (0..count).map(|i| value(rank, right, round, i)).collect();
        let mut sent = comm.send_async(mine, right);
        if rank % 2 == 1 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut got = comm.recv_async(vec![0u32; count], left);
        let theirs = wait(&mut got)?;
        let mine = wait(&mut sent)?;
        if mine.len() != count || mine[count - 1] != value(rank, right, round, count - 1) {
            wrong.push(format!(
                "round {round}: the send's buffer came back changed"
            ));
        }
        if let Some(i) = (0..count).find(|&i| theirs[i] != value(left, rank, round, i)) {
            wrong.push(format!("round {round}: element {i} from rank {left}"));
        }
    }
    Ok(wrong)
}

/// An out-of-place call's buffers: input, output.
type Pair = (Vec<f32>, Vec<f32>);

/// Rank `r`'s element `i` of call `k`: small integers, exact in f32 sums.
fn input(r: usize, k: usize, i: usize) -> f32 {
    ((r * 5 + k * 11 + i) % 97) as f32
}

/// Many all-reduces in flight (mailbox-sized, slot-sized, in and out of place), with a
/// blocking call and a submitted closure among them, waited for in reverse order; then a
/// call with bad buffers, whose work says so at once.
fn many(comm: &Communicator, args: &Value) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let large = args["large"].as_u64().unwrap() as usize;
    let sizes = [4usize, large, 1000, large / 2 + 3, 7, large];
    let want = |k: usize, i: usize| (0..n).map(|r| input(r, k, i)).sum::<f32>();
    let mut wrong = Vec::new();
    let mut inplace: Vec<(usize, Work<Vec<f32>>)> = Vec::new();
    let mut outplace: Vec<(usize, Work<Pair>)> = Vec::new();
    for (k, &len) in sizes.iter().enumerate() {
        let v: Vec<f32> = (0..len).map(|i| input(rank, k, i)).collect();
        if k % 2 == 0 {
            inplace.push((k, comm.all_reduce_async(v, ReduceOp::Sum)));
        } else {
            let out = vec![-1.0f32; len];
            let coll = Collective::AllReduce { count: len };
            outplace.push((k, comm.start(coll, ReduceOp::Sum, (v, out))));
        }
        if k == 2 {
            // A blocking call among them runs after those started before it.
            let mut b = vec![rank as u64; 3];
            comm.all_reduce_in_place(&mut b, ReduceOp::Max)?;
            if b != vec![n as u64 - 1; 3] {
                wrong.push(format!("blocking all_reduce among calls in flight: {b:?}"));
            }
        }
        if k == 3 {
            let mut w = comm.submit(|c| {
                let mut x = [c.rank() as i32 + 1];
                c.all_reduce_in_place(&mut x, ReduceOp::Sum).map(|()| x[0])
            });
            let got = wait(&mut w)?;
            if got != (n * (n + 1) / 2) as i32 {
                wrong.push(format!("submitted closure among calls in flight: {got}"));
            }
        }
    }
    for (k, mut w) in outplace.into_iter().rev() {
        let (input_back, out) = wait(&mut w)?;
        if input_back.first().is_some_and(|&x| x != input(rank, k, 0)) {
            wrong.push(format!("call {k}: the input came back changed"));
        }
        if let Some(i) = (0..out.len()).find(|&i| out[i] != want(k, i)) {
            wrong.push(format!("call {k} (out of place): element {i}"));
        }
    }
    for (k, mut w) in inplace.into_iter().rev() {
        let out = wait(&mut w)?;
        if let Some(i) = (0..out.len()).find(|&i| out[i] != want(k, i)) {
            wrong.push(format!("call {k} (in place): element {i}"));
        }
    }
    // Bad buffers: an out-of-place all-reduce whose output is too short.
    let coll = Collective::AllReduce { count: 10 };
    let mut bad = comm.start(coll, ReduceOp::Sum, (vec![1f32; 10], vec![0f32; 9]));
    match bad.wait(Duration::from_secs(1)) {
        Err(e) if error_kind(&e) == "InvalidArgument" && e.to_string().contains("output") => {}
        other => wrong.push(format!("bad buffers: {:?}", other.map(|_| ()))),
    }
    // The communicator still works.
    let mut x = [1u8];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    if x[0] as usize != n {
        wrong.push(format!("after the bad call: {}", x[0]));
    }
    Ok(wrong)
}

/// Calls started behind a submitted closure that numbers its own calls late (after a pause
/// on rank 0 only): they take their numbers after the closure's calls on every rank, whatever
/// the timing, so each sums what its peers' same call sums (the counts differ from call to
/// call: out of order, they would mismatch); starting them returns at once instead of waiting
/// for the closure; and a send and a receive started behind it still fly together (a large
/// exchange, which deadlocks if they run one at a time).
fn behind(comm: &Communicator) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut wrong = Vec::new();
    let pause = if rank == 0 { 400 } else { 0 };
    let mut first = comm.submit(move |c| {
        std::thread::sleep(Duration::from_millis(pause));
        let mut a = vec![rank as f32 + 1.0; 1000];
        c.all_reduce_in_place(&mut a, ReduceOp::Sum)?;
        let mut b = vec![1f32; 3000];
        c.all_reduce_in_place(&mut b, ReduceOp::Sum)?;
        Ok((a, b))
    });
    let t0 = std::time::Instant::now();
    let mut later: Vec<(usize, Work<Vec<f32>>)> = [7usize, 100_000, 5]
        .iter()
        .map(|&len| (len, comm.all_reduce_async(vec![2f32; len], ReduceOp::Sum)))
        .collect();
    let big = 4 << 20;
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let mut send = comm.send_async(vec![rank as u32; big], right);
    let mut recv = comm.recv_async(vec![0u32; big], left);
    let started = t0.elapsed();
    if rank == 0 && started > Duration::from_millis(200) {
        wrong.push(format!("starting calls behind a closure took {started:?}"));
    }
    let (a, b) = wait(&mut first)?;
    let sum = (n * (n + 1) / 2) as f32;
    if a.iter().any(|&x| x != sum) || b.iter().any(|&x| x != n as f32) {
        wrong.push(format!("the closure's calls: {} and {}", a[0], b[0]));
    }
    for (len, w) in later.iter_mut() {
        let v = wait(w)?;
        if v.len() != *len || v.iter().any(|&x| x != 2.0 * n as f32) {
            wrong.push(format!("the call of {len} started behind: {:?}", v.first()));
        }
    }
    wait(&mut send)?;
    let got = wait(&mut recv)?;
    if got.iter().any(|&x| x != left as u32) {
        wrong.push(format!("the exchange behind the closure: {}", got[0]));
    }
    Ok(wrong)
}

/// Calls that feed the link-rate learner, started on rank 0 behind a closure (so numbered by
/// the worker when it reaches them) and on rank 1 directly: every rank counts them alike and
/// runs the learner's rounds at the same calls (a rank that did not would be in a round while
/// the other runs an all-reduce: a mismatch).
fn learner_behind(comm: &Communicator) -> oxccl::Result<Vec<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut wrong = Vec::new();
    // Rank 0 starts its calls while a closure runs (they are deferred to the worker); rank 1
    // has none (each call is numbered on this thread and run alone).
    let mut first = (rank == 0).then(|| {
        comm.submit(|_| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })
    });
    let len = 1 << 19; // 2 MiB of f32: above the learner's smallest call
    let mut works: Vec<Work<Vec<f32>>> = (0..5)
        .map(|k| comm.all_reduce_async(vec![(rank + k) as f32; len], ReduceOp::Sum))
        .collect();
    if let Some(f) = first.as_mut() {
        wait(f)?;
    }
    for (k, w) in works.iter_mut().enumerate() {
        let v = wait(w)?;
        let want = (0..n).map(|r| (r + k) as f32).sum::<f32>();
        if v.iter().any(|&x| x != want) {
            wrong.push(format!("call {k}: {} != {want}", v[0]));
        }
    }
    Ok(wrong)
}

/// Rank 1 exits while rank 0 has several calls in flight: every one of them fails, naming
/// rank 1, within the timeout.
fn dies(comm: Communicator) -> ! {
    if comm.rank() == 1 {
        // Let rank 0 start its calls, then vanish (the others need not wait for it).
        common::mark_done();
        std::thread::sleep(Duration::from_millis(300));
        std::process::exit(0);
    }
    let mut works: Vec<Work<Vec<f32>>> = (0..4)
        .map(|k| comm.all_reduce_async(vec![1.0f32; 100_000 + k], ReduceOp::Sum))
        .collect();
    let results: Vec<Value> = works
        .iter_mut()
        .map(|w| match w.wait(Duration::from_secs(30)) {
            Ok(_) => json!({ "ok": true }),
            Err(e) => json!({ "ok": false, "kind": error_kind(&e), "msg": e.to_string() }),
        })
        .collect();
    let out = json!({ "ok": true, "calls": results });
    // A survivor's result, then exit at once (closing the communicator would wait for the
    // dead rank).
    common::emit(&out);
    common::mark_done();
    common::linger();
    drop(comm);
    std::process::exit(0);
}

fn run_exchange(provider: &str, n: usize) {
    // Larger than the receiver's slots (8 of 128 KiB on shm, 4 of 1 MiB on tcp): a send
    // alone cannot finish before its receive runs.
    let out = run_ranks(
        n,
        &[("OXCCL_PROVIDER", provider)],
        "exchange",
        &json!({ "count": 4 << 20 }),
    );
    for (rank, v) in expect_results("exchange in flight", &out)
        .iter()
        .enumerate()
    {
        assert_eq!(v["ok"], true, "rank {rank}: {v}");
        assert_eq!(v["wrong"], json!([]), "rank {rank}: {v}");
    }
}

#[test]
fn send_and_receive_in_flight_together_shm() {
    run_exchange("shm", 2);
}

#[test]
fn send_and_receive_in_flight_together_tcp() {
    run_exchange("tcp", 2);
}

#[test]
fn a_ring_of_exchanges_in_flight_shm() {
    run_exchange("shm", 3);
}

fn run_many(provider: &str) {
    let out = run_ranks(
        2,
        &[("OXCCL_PROVIDER", provider)],
        "many",
        &json!({ "large": 300_000 }),
    );
    for (rank, v) in expect_results("many in flight", &out).iter().enumerate() {
        assert_eq!(v["ok"], true, "rank {rank}: {v}");
        assert_eq!(v["wrong"], json!([]), "rank {rank}: {v}");
    }
}

#[test]
fn calls_started_behind_a_closure_keep_their_order_and_do_not_wait() {
    for provider in ["shm", "tcp"] {
        let out = run_ranks(2, &[("OXCCL_PROVIDER", provider)], "behind", &json!({}));
        for (rank, v) in expect_results("behind", &out).iter().enumerate() {
            assert_eq!(v["ok"], true, "{provider}, rank {rank}: {v}");
            assert_eq!(v["wrong"], json!([]), "{provider}, rank {rank}: {v}");
        }
    }
}

#[test]
fn calls_that_feed_the_learner_are_counted_alike_behind_a_closure() {
    let out = run_ranks(
        2,
        &[("OXCCL_PROVIDER", "tcp")],
        "learner_behind",
        &json!({}),
    );
    for (rank, v) in expect_results("learner_behind", &out).iter().enumerate() {
        assert_eq!(v["ok"], true, "rank {rank}: {v}");
        assert_eq!(v["wrong"], json!([]), "rank {rank}: {v}");
    }
}

#[test]
fn many_calls_in_flight_shm() {
    run_many("shm");
}

#[test]
fn many_calls_in_flight_tcp() {
    run_many("tcp");
}

#[test]
fn a_dead_peer_fails_every_call_in_flight() {
    let out = run_ranks(2, &[("OXCCL_TIMEOUT", "20")], "dies", &json!({}));
    let r0 = &out[0];
    assert!(r0.ok(), "rank 0: {}\n{}", r0.stdout, r0.stderr);
    let calls = r0.result()["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 4);
    for c in calls {
        assert_eq!(c["ok"], false, "{c}");
        let msg = c["msg"].as_str().unwrap();
        assert!(
            msg.contains("rank 1"),
            "every call in flight fails naming the dead peer: {c}"
        );
    }
    assert!(
        calls[0]["msg"].as_str().unwrap().contains("rank 1"),
        "the first names the dead peer: {}",
        calls[0]
    );
}
