//! Shrink, by real processes: 4 ranks, one SIGKILLed mid-run; the survivors (including one
//! that saw nothing) agree through the store, build a communicator of the rest and check an
//! all-reduce against sums computed here; an explicit exclusion without a failure; a second
//! death during the shrink ends in a working smaller communicator or a clear error within a
//! bound, never a hang.

mod common;

use std::time::{Duration, Instant};

use oxccl::{Communicator, Error, ReduceOp};
use serde_json::{Value, json};

use common::{error_kind, report, run_ranks};

const COUNT: usize = 10_000;

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "shrink" => shrink_scenario(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// What old rank `r` contributes at element `i` (after the shrink).
fn value(r: usize, i: usize) -> f32 {
    (i % 13 + 3 * r + 1) as f32
}

fn die() -> ! {
    // SAFETY: no preconditions.
    unsafe { libc::raise(libc::SIGKILL) };
    unreachable!()
}

fn err_json(e: &Error) -> Value {
    let missing = match e {
        Error::Shrink { missing, .. } => json!(missing),
        _ => Value::Null,
    };
    json!({ "ok": false, "kind": error_kind(e), "msg": e.to_string(), "missing": missing })
}

/// Runs an all-reduce on `comm` whose ranks are the old ranks `members` and checks it; the
/// error, if any.
fn checked_all_reduce(comm: &Communicator, members: &[usize], old: usize) -> Result<(), String> {
    let mut v: Vec<f32> = (0..COUNT).map(|i| value(old, i)).collect();
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    for (i, x) in v.iter().enumerate() {
        let want: f32 = members.iter().map(|&r| value(r, i)).sum();
        if *x != want {
            return Err(format!("element {i}: {x} != {want} (members {members:?})"));
        }
    }
    Ok(())
}

/// Modes:
/// - `kill`: all-reduces until one fails (the test's `OXCCL_FAULT` kills a rank), then
///   `shrink_after_failure` and a checked all-reduce.
/// - `unaware`: ranks 0 and 2 receive from rank 1, which SIGKILLs itself; they fail. Rank 3
///   runs no call (it sees nothing) and shrinks after a pause: it learns from the store.
/// - `explicit`: no failure; every rank but `exclude` calls `shrink(&[exclude])`.
/// - `second`: as `kill`, and rank `second` SIGKILLs itself `second_ms` after it starts to
///   shrink; survivors shrink again (each failure of the new communicator leads to another
///   shrink, at most 3) until an all-reduce succeeds, or end with a clear error.
fn shrink_scenario(args: &Value) -> Value {
    let opts = oxccl::Options::from_env().unwrap();
    let boot = oxccl_bootstrap::Bootstrap::from_env().unwrap_or_else(|e| panic!("bootstrap: {e}"));
    let comm = Communicator::init(boot, opts).unwrap_or_else(|e| panic!("init: {e}"));
    let rank = comm.rank();
    let mode = args["mode"].as_str().unwrap();
    let doomed = args["doomed"].as_u64().map(|d| d as usize);
    let second = args["second"].as_u64().map(|d| d as usize);
    if doomed == Some(rank) || second == Some(rank) {
        common::mark_done();
    }
    let mut first_error = Value::Null;
    match mode {
        "kill" | "second" => {
            for call in 1..=20 {
                let mut v: Vec<f32> = (0..COUNT).map(|i| value(rank, i) + call as f32).collect();
                if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                    first_error = json!({ "call": call, "error": err_json(&e) });
                    break;
                }
            }
            if first_error.is_null() {
                return json!({ "ok": false, "msg": "no call failed" });
            }
        }
        "unaware" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(200));
                die();
            }
            if rank == 3 {
                // Long enough for the others to fail and check in; it runs no call.
                std::thread::sleep(Duration::from_millis(1500));
            } else {
                let mut v = vec![0f32; 16];
                let e = comm.recv(&mut v, 1).unwrap_err();
                first_error = err_json(&e);
            }
        }
        "inflight" => {
            // Rank 1 dies while the others have calls in flight; rank 3 shrinks before it
            // waits for them (the shrink aborts them), ranks 0 and 2 wait first.
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(300));
                die();
            }
            let mut works: Vec<oxccl::Work<Vec<f32>>> = (0..4)
                .map(|k| comm.all_reduce_async(vec![1.0f32; 100_000 + k], ReduceOp::Sum))
                .collect();
            let mut early = None;
            if rank == 3 {
                let ms = args["shrink_first_ms"].as_u64().unwrap();
                std::thread::sleep(Duration::from_millis(ms));
                early = Some(comm.shrink_after_failure());
            }
            let mut calls = Vec::new();
            for w in &mut works {
                let first = w.wait(Duration::from_secs(10));
                // A second wait must not complete it again.
                let again = w.wait(Duration::from_millis(10));
                calls.push(json!({
                    "first": first.as_ref().map(|_| "ok").map_err(|e| e.to_string()).unwrap_or_else(|e| Box::leak(e.into_boxed_str())),
                    "first_ok": first.is_ok(),
                    "again_ok": again.is_ok(),
                    "again": again.err().map(|e| e.to_string()),
                }));
            }
            first_error = json!({ "calls": calls });
            if let Some(r) = early {
                let small = match r {
                    Ok(s) => s,
                    Err(e) => {
                        return json!({ "ok": false, "shrink_error": err_json(&e), "first": first_error });
                    }
                };
                let mut olds = vec![0u64; small.world_size()];
                if let Err(e) = small.all_gather(&[rank as u64], &mut olds) {
                    return json!({ "ok": false, "msg": e.to_string(), "first": first_error });
                }
                let m: Vec<usize> = olds.iter().map(|&o| o as usize).collect();
                if let Err(e) = checked_all_reduce(&small, &m, rank) {
                    return json!({ "ok": false, "msg": e, "first": first_error });
                }
                let out = json!({ "ok": true, "members": m, "new_rank": small.rank(), "first": first_error });
                std::mem::forget(small);
                return out;
            }
        }
        "explicit" => {
            let exclude = args["exclude"].as_u64().unwrap() as usize;
            if rank == exclude {
                // Kept open: closing it while a peer still finishes init would fail that.
                std::mem::forget(comm);
                return json!({ "ok": true, "excluded": true });
            }
        }
        m => panic!("unknown mode {m}"),
    }
    let failed_before = comm.failed_peers();
    if let (true, Some(ms)) = (
        args["late"].as_u64() == Some(rank as u64),
        args["late_ms"].as_u64(),
    ) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    if let (true, Some(ms)) = (second == Some(rank), args["second_ms"].as_u64()) {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            die();
        });
    }
    let t = Instant::now();
    let mut shrinks = 0;
    let mut cur: Option<Communicator> = None;
    let mut last_err = String::new();
    loop {
        let c = cur.as_ref().unwrap_or(&comm);
        let r = if mode == "explicit" {
            c.shrink(&[args["exclude"].as_u64().unwrap() as usize])
        } else {
            c.shrink_after_failure()
        };
        shrinks += 1;
        let small = match r {
            Ok(s) => s,
            Err(e) => {
                return json!({
                    "ok": false, "shrink_error": err_json(&e), "first": first_error,
                    "failed_before": failed_before, "shrinks": shrinks, "last": last_err,
                    "ms": t.elapsed().as_millis() as u64,
                });
            }
        };
        // The original ranks of the new communicator's members, all-gathered, then an
        // all-reduce checked against the sum of their values computed here.
        let mut olds = vec![0u64; small.world_size()];
        let checked = small
            .all_gather(&[rank as u64], &mut olds)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                let m: Vec<usize> = olds.iter().map(|&o| o as usize).collect();
                checked_all_reduce(&small, &m, rank).map(|()| m)
            });
        match checked {
            Ok(members) => {
                let out = json!({
                    "ok": true, "new_rank": small.rank(), "world": small.world_size(),
                    "members": members, "first": first_error, "failed_before": failed_before,
                    "shrinks": shrinks, "last": last_err, "ms": t.elapsed().as_millis() as u64,
                });
                // Kept open: a peer may still be finishing its part of the all-reduce.
                std::mem::forget(small);
                return out;
            }
            Err(e) if mode == "second" && shrinks < 3 => {
                // The new communicator lost a rank too: shrink it in turn.
                last_err = e;
                cur = Some(small);
            }
            Err(e) => {
                return json!({
                    "ok": false, "msg": e, "last": last_err, "first": first_error,
                    "shrinks": shrinks, "ms": t.elapsed().as_millis() as u64,
                });
            }
        }
    }
}

fn env(timeout: &str, fault: Option<&'static str>) -> Vec<(&'static str, String)> {
    env_on("shm", timeout, fault)
}

fn env_on(
    provider: &str,
    timeout: &str,
    fault: Option<&'static str>,
) -> Vec<(&'static str, String)> {
    let mut e = vec![
        ("OXCCL_PROVIDER", provider.to_string()),
        ("OXCCL_TIMEOUT", timeout.to_string()),
    ];
    if let Some(f) = fault {
        e.push(("OXCCL_FAULT", f.to_string()));
    }
    e
}

fn launch(env: &[(&'static str, String)], args: Value) -> Vec<common::RankOutput> {
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    run_ranks(4, &e, "shrink", &args)
}

fn ok_result(outs: &[common::RankOutput], r: usize) -> &Value {
    let o = &outs[r];
    assert!(o.ok(), "rank {r} did not finish{}", report(outs));
    let res = o.result();
    assert_eq!(res["ok"], true, "rank {r}: {res}{}", report(outs));
    res
}

#[test]
fn survivors_of_a_kill_shrink_and_all_reduce() {
    survivors_of_a_kill("shm");
}

#[test]
fn survivors_of_a_kill_shrink_and_all_reduce_tcp() {
    survivors_of_a_kill("tcp");
}

fn survivors_of_a_kill(provider: &str) {
    let outs = launch(
        &env_on(provider, "5", Some("kill:rank=1,seq=3,after=1")),
        json!({ "mode": "kill", "doomed": 1 }),
    );
    assert!(
        outs[1].status.is_some_and(|s| !s.success()),
        "{}",
        report(&outs)
    );
    for (old, new) in [(0, 0), (2, 1), (3, 2)] {
        let res = ok_result(&outs, old);
        assert_eq!(res["world"], 3, "rank {old}: {res}");
        assert_eq!(res["new_rank"], new, "rank {old}: {res}");
        assert_eq!(res["members"], json!([0, 2, 3]), "rank {old}: {res}");
        assert_eq!(res["shrinks"], 1, "rank {old}: {res}");
        // Well within the timeout: every survivor reported rank 1, or learned it.
        assert!(res["ms"].as_u64().unwrap() < 4000, "rank {old}: {res}");
        eprintln!("rank {old}: {res}");
    }
}

#[test]
fn a_rank_that_saw_nothing_learns_through_the_store() {
    let outs = launch(&env("5", None), json!({ "mode": "unaware", "doomed": 1 }));
    for (old, new) in [(0, 0), (2, 1), (3, 2)] {
        let res = ok_result(&outs, old);
        assert_eq!(res["members"], json!([0, 2, 3]), "rank {old}: {res}");
        assert_eq!(res["new_rank"], new, "rank {old}: {res}");
        eprintln!("rank {old}: {res}");
    }
    let r3 = outs[3].result();
    assert_eq!(r3["failed_before"], json!([]), "rank 3 saw a failure: {r3}");
    // It did not wait out the timeout (5 s) for rank 1: the others' check-ins named it.
    assert!(r3["ms"].as_u64().unwrap() < 4000, "rank 3: {r3}");
    for r in [0, 2] {
        assert_eq!(outs[r].result()["failed_before"], json!([1]), "rank {r}");
    }
}

/// Calls in flight when a rank dies end once, with an error, on every survivor, whether it
/// waits for them before it shrinks or shrinks first (which aborts them); the shrunk
/// communicator then works. Rank 3 shrinks 800 ms in (after the news of rank 1's death at
/// 300 ms), or 100 ms in (before it: its abort ends everyone's calls, rank 1's too, so no
/// survivor names rank 1 and they exclude it when the timeout passes without its check-in).
#[test]
fn calls_in_flight_end_once_with_an_error() {
    for ms in [800, 100] {
        calls_in_flight(ms);
    }
}

fn calls_in_flight(shrink_first_ms: u64) {
    let outs = launch(
        &env("5", None),
        json!({ "mode": "inflight", "doomed": 1, "shrink_first_ms": shrink_first_ms }),
    );
    for (old, new) in [(0, 0), (2, 1), (3, 2)] {
        let res = ok_result(&outs, old);
        assert_eq!(res["members"], json!([0, 2, 3]), "rank {old}: {res}");
        assert_eq!(res["new_rank"], new, "rank {old}: {res}");
        let calls = res["first"]["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 4, "rank {old}: {res}");
        for c in calls {
            assert_eq!(
                c["first_ok"], false,
                "rank {old}: a call in flight succeeded: {res}"
            );
            assert_eq!(c["again_ok"], false, "rank {old}: {res}");
            let again = c["again"].as_str().unwrap();
            assert!(
                again.contains("already taken"),
                "rank {old}: completed twice: {res}"
            );
        }
        eprintln!("rank {old}: {res}");
    }
}

/// A survivor that starts to shrink only after the timeout (2 s) has passed since the others
/// did: they exclude it (it did not check in) and go on; it gets a clear error, not a hang.
#[test]
fn a_rank_that_comes_too_late_is_excluded_with_a_clear_error() {
    let outs = launch(
        &env("2", Some("kill:rank=1,seq=3,after=1")),
        json!({ "mode": "kill", "doomed": 1, "late": 3, "late_ms": 3500 }),
    );
    for (old, new) in [(0, 0), (2, 1)] {
        let res = ok_result(&outs, old);
        assert_eq!(res["members"], json!([0, 2]), "rank {old}: {res}");
        assert_eq!(res["new_rank"], new, "rank {old}: {res}");
        // The decision came at the timeout, not later.
        assert!(res["ms"].as_u64().unwrap() < 3500, "rank {old}: {res}");
    }
    let r3 = &outs[3];
    assert!(r3.ok(), "rank 3 did not finish{}", report(&outs));
    let e = &r3.result()["shrink_error"];
    assert_eq!(e["kind"], "Shrink", "rank 3: {}", r3.result());
    let msg = e["msg"].as_str().unwrap();
    assert!(msg.contains("excluded this rank"), "rank 3: {msg}");
    // It fails at once: the decision is in the store.
    assert!(
        r3.result()["ms"].as_u64().unwrap() < 1000,
        "rank 3: {}",
        r3.result()
    );
    eprintln!("rank 3: {msg}");
}

#[test]
fn explicit_exclusion_without_a_failure() {
    let outs = launch(
        &env("10", None),
        json!({ "mode": "explicit", "exclude": 2 }),
    );
    for (old, new) in [(0, 0), (1, 1), (3, 2)] {
        let res = ok_result(&outs, old);
        assert_eq!(res["members"], json!([0, 1, 3]), "rank {old}: {res}");
        assert_eq!(res["new_rank"], new, "rank {old}: {res}");
    }
    assert_eq!(outs[2].result()["excluded"], true);
}

/// Rank 2 dies during the shrink that follows rank 1's death: once the survivors have decided
/// (an injected fault, `shrink=1`: the new communicator's init and the done round find it
/// missing, and they shrink again), or a moment after it starts to shrink (before it checks
/// in, or after: whatever the timing). Within a bound, each of ranks 0 and 3 holds a
/// communicator that all-reduces correctly (of ranks 0 and 3; or of 0, 2 and 3 when rank 2
/// died only after the shrink was over), or a clear error naming rank 2; nobody hangs.
#[test]
fn a_second_death_during_the_shrink_never_hangs() {
    let mut tally = std::collections::BTreeMap::new();
    let cases: [(&str, Option<u64>); 3] = [
        ("kill:rank=1,seq=3,after=1;kill:rank=2,shrink=1", None),
        ("kill:rank=1,seq=3,after=1", Some(0)),
        ("kill:rank=1,seq=3,after=1", Some(5)),
    ];
    for (fault, ms) in cases {
        let start = Instant::now();
        let mut args = json!({ "mode": "second", "doomed": 1, "second": 2 });
        if let Some(ms) = ms {
            args["second_ms"] = json!(ms);
        }
        let outs = launch(&env("3", Some(fault)), args);
        let took = start.elapsed();
        let case = format!("{fault} second_ms={ms:?}");
        assert!(
            outs[2].status.is_some_and(|s| !s.success()),
            "{case}: rank 2 lived{}",
            report(&outs)
        );
        for r in [0, 3] {
            let o = &outs[r];
            assert!(o.ok(), "{case}: rank {r} did not finish{}", report(&outs));
            let res = o.result();
            let outcome = if res["ok"] == true {
                let m = &res["members"];
                assert!(
                    *m == json!([0, 3]) || (ms.is_some() && *m == json!([0, 2, 3])),
                    "{case}: rank {r}: {res}"
                );
                format!("members {m} after {} shrinks", res["shrinks"])
            } else {
                let msg = res.to_string();
                assert!(
                    msg.contains("rank 2") || msg.contains("[2]"),
                    "{case}: rank {r}: {res}"
                );
                "clear error".to_string()
            };
            if ms.is_none() {
                // The fault fires after the decision: the survivors must shrink twice.
                assert_eq!(res["members"], json!([0, 3]), "{case}: rank {r}: {res}");
                assert_eq!(res["shrinks"], 1, "{case}: rank {r}: {res}");
            }
            // A shrink waits at most a few timeouts (3 s): init, the done round, again.
            assert!(
                res["ms"].as_u64().unwrap() < 20_000,
                "{case}: rank {r}: {res}"
            );
            eprintln!("{case}: rank {r}: {outcome}: {res}");
            *tally.entry(outcome).or_insert(0) += 1;
        }
        eprintln!("{case}: the job took {took:?}");
    }
    eprintln!("outcomes: {tally:?}");
}
