//! Grow, by real processes: newcomers join a running job (`Communicator::join`) when its
//! ranks call `Communicator::grow`; two at once; a replacement for a rank that died, after
//! the survivors shrank; nobody coming (a clear error, the old communicator still works); a
//! newcomer that gave up is not admitted later. Every grown communicator is checked with an
//! all-reduce against sums computed here.

mod common;

use std::time::{Duration, Instant};

use oxccl::{Communicator, Error, Options, ReduceOp};
use oxccl_bootstrap::{Bootstrap, Config, Secret, TcpStore};
use serde_json::{Value, json};

use common::{error_kind, report, run_ranks};

const COUNT: usize = 4_000;

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "grow" => grow_scenario(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// What process `p` contributes at element `i`.
fn value(p: usize, i: usize) -> f32 {
    (i % 11 + 5 * p + 1) as f32
}

fn err_json(e: &Error) -> Value {
    json!({ "ok": false, "kind": error_kind(e), "msg": e.to_string() })
}

/// All-gathers each rank's process index, then runs an all-reduce and checks it against the
/// sum of those processes' values; returns the process indices in rank order.
fn checked(comm: &Communicator, me: usize) -> Result<Vec<usize>, String> {
    let mut ids = vec![0u64; comm.world_size()];
    comm.all_gather(&[me as u64], &mut ids)
        .map_err(|e| e.to_string())?;
    let ids: Vec<usize> = ids.into_iter().map(|x| x as usize).collect();
    let mut v: Vec<f32> = (0..COUNT).map(|i| value(me, i)).collect();
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    for (i, x) in v.iter().enumerate() {
        let want: f32 = ids.iter().map(|&p| value(p, i)).sum();
        if *x != want {
            return Err(format!("element {i}: {x} != {want} (processes {ids:?})"));
        }
    }
    Ok(ids)
}

/// A newcomer: joins the job whose store rank 0 serves, with `timeout` seconds.
fn newcomer(me: usize, timeout: f64, args: &Value) -> Value {
    let delays = args["delay_ms"].as_array().cloned().unwrap_or_default();
    let m = args["members"].as_u64().unwrap() as usize;
    if let Some(ms) = delays.get(me - m).and_then(Value::as_u64) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let secret = Secret::new(std::env::var("OXCCL_SECRET").unwrap()).unwrap();
    let addr = format!("127.0.0.1:{}", std::env::var("MASTER_PORT").unwrap());
    let job = std::env::var("OXCCL_JOB_ID").unwrap();
    let mut opts = Options::from_env().unwrap();
    opts.timeout = Duration::from_secs_f64(timeout);
    // The members' faults are theirs: a newcomer's rank may be the one a fault names.
    opts.faults = None;
    let t = Instant::now();
    let store = match TcpStore::connect(&addr, &secret, Duration::from_secs(30)) {
        Ok(s) => s,
        Err(e) => return json!({ "ok": false, "msg": format!("store: {e}") }),
    };
    let comm = match Communicator::join(Box::new(store), &job, opts) {
        Ok(c) => c,
        Err(e) => {
            return json!({ "ok": false, "join_error": err_json(&e),
                           "ms": t.elapsed().as_millis() as u64 });
        }
    };
    let joined_ms = t.elapsed().as_millis() as u64;
    let out = match checked(&comm, me) {
        Ok(ids) => json!({ "ok": true, "rank": comm.rank(), "world": comm.world_size(),
                           "ids": ids, "ms": joined_ms, "lineage": comm.lineage() }),
        Err(e) => json!({ "ok": false, "msg": e }),
    };
    // Kept open: a peer may still be finishing its part of the all-reduce.
    std::mem::forget(comm);
    out
}

/// Modes (`members` processes make the job; the others are newcomers):
/// - `grow`: the members check an all-reduce, then `grow(count)`, then check the grown one.
/// - `replace`: a fault kills one member during the all-reduces; the others
///   `shrink_after_failure`, then `grow(1)`; the newcomer replaces the dead rank.
/// - `late`: the members wait `members_wait_ms` before they grow.
fn grow_scenario(args: &Value) -> Value {
    let (me, _) = common::env_rank();
    let m = args["members"].as_u64().unwrap() as usize;
    let mode = args["mode"].as_str().unwrap();
    if me >= m {
        let timeout = args["newcomer_timeouts"]
            .as_array()
            .and_then(|t| t.get(me - m))
            .and_then(Value::as_f64)
            .unwrap_or(30.0);
        return newcomer(me, timeout, args);
    }
    let mut config = Config::from_env().unwrap();
    config.world_size = m;
    let boot = Bootstrap::new(config).unwrap_or_else(|e| panic!("bootstrap: {e}"));
    let comm = Communicator::init(boot, Options::from_env().unwrap())
        .unwrap_or_else(|e| panic!("init: {e}"));
    let count = args["count"].as_u64().unwrap_or(1) as usize;
    let mut shrunk = None;
    match mode {
        "grow" | "late" => {
            if let Err(e) = checked(&comm, me) {
                return json!({ "ok": false, "msg": format!("before: {e}") });
            }
            if let Some(ms) = args["members_wait_ms"].as_u64() {
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        "replace" => {
            let doomed = args["doomed"].as_u64().unwrap() as usize;
            if me == doomed {
                common::mark_done();
            }
            let mut failed = false;
            for call in 0..20 {
                let mut v: Vec<f32> = (0..COUNT).map(|i| value(me, i) + call as f32).collect();
                if comm.all_reduce_in_place(&mut v, ReduceOp::Sum).is_err() {
                    failed = true;
                    break;
                }
            }
            if !failed {
                return json!({ "ok": false, "msg": "no call failed" });
            }
            match comm.shrink_after_failure() {
                Ok(s) => shrunk = Some(s),
                Err(e) => return json!({ "ok": false, "shrink_error": err_json(&e) }),
            }
        }
        m => panic!("unknown mode {m}"),
    }
    let base = shrunk.as_ref().unwrap_or(&comm);
    let t = Instant::now();
    let grown = match base.grow(count) {
        Ok(g) => g,
        Err(e) => {
            let ms = t.elapsed().as_millis() as u64;
            // The communicator it grew from still works.
            let still = checked(base, me).map(|_| ()).map_err(|e| e.to_string());
            return json!({ "ok": false, "grow_error": err_json(&e), "ms": ms,
                           "still_works": still.is_ok(), "still": format!("{still:?}") });
        }
    };
    let ms = t.elapsed().as_millis() as u64;
    let out = match checked(&grown, me) {
        Ok(ids) => json!({ "ok": true, "rank": grown.rank(), "world": grown.world_size(),
                           "old_rank": base.rank(), "ids": ids, "ms": ms }),
        Err(e) => json!({ "ok": false, "msg": e }),
    };
    std::mem::forget(grown);
    std::mem::forget(shrunk);
    std::mem::forget(comm);
    out
}

fn launch(n: usize, timeout: &str, fault: Option<&str>, args: Value) -> Vec<common::RankOutput> {
    let mut env = vec![("OXCCL_PROVIDER", "shm"), ("OXCCL_TIMEOUT", timeout)];
    if let Some(f) = fault {
        env.push(("OXCCL_FAULT", f));
    }
    run_ranks(n, &env, "grow", &args)
}

fn ok(outs: &[common::RankOutput], p: usize) -> Value {
    let o = &outs[p];
    assert!(o.ok(), "process {p} did not finish{}", report(outs));
    let r = o.result().clone();
    assert_eq!(r["ok"], true, "process {p}: {r}{}", report(outs));
    r
}

#[test]
fn two_newcomers_join_at_once_after_the_members() {
    let outs = launch(
        4,
        "20",
        None,
        json!({ "mode": "grow", "members": 2, "count": 2 }),
    );
    let mut newcomer_ranks = Vec::new();
    for p in 0..4 {
        let r = ok(&outs, p);
        assert_eq!(r["world"], 4, "process {p}: {r}");
        if p < 2 {
            // Members keep their ranks.
            assert_eq!(r["rank"], p, "process {p}: {r}");
        } else {
            newcomer_ranks.push(r["rank"].as_u64().unwrap());
            assert_eq!(r["lineage"], "test-grow", "process {p}: {r}");
        }
        eprintln!("process {p}: {r}");
    }
    newcomer_ranks.sort();
    assert_eq!(newcomer_ranks, vec![2, 3]);
    // Every rank sees the same order of processes.
    let ids = ok(&outs, 0)["ids"].clone();
    for p in 1..4 {
        assert_eq!(ok(&outs, p)["ids"], ids);
    }
}

/// Rank 1 of 3 dies; ranks 0 and 2 shrink to two, then take in a replacement (which waited
/// for them from the start) as rank 2.
#[test]
fn a_replacement_joins_the_survivors_of_a_shrink() {
    let outs = launch(
        4,
        "5",
        Some("kill:rank=1,seq=3,after=1"),
        json!({ "mode": "replace", "members": 3, "doomed": 1 }),
    );
    for (p, rank) in [(0, 0), (2, 1), (3, 2)] {
        let r = ok(&outs, p);
        assert_eq!(r["world"], 3, "process {p}: {r}");
        assert_eq!(r["rank"], rank, "process {p}: {r}");
        assert_eq!(r["ids"], json!([0, 2, 3]), "process {p}: {r}");
        eprintln!("process {p}: {r}");
    }
}

/// Nobody joins: every member fails alike, once the timeout (2 s) has passed, and its
/// communicator still works.
#[test]
fn a_grow_nobody_joins_fails_clearly_and_leaves_the_communicator_working() {
    let start = Instant::now();
    let outs = launch(2, "2", None, json!({ "mode": "grow", "members": 2 }));
    for p in 0..2 {
        assert!(outs[p].ok(), "process {p}{}", report(&outs));
        let r = outs[p].result();
        assert_eq!(r["grow_error"]["kind"], "Grow", "process {p}: {r}");
        let msg = r["grow_error"]["msg"].as_str().unwrap();
        assert!(msg.contains("newcomers to call join"), "{msg}");
        assert!(msg.contains(&format!("rank {p}")), "{msg}");
        let ms = r["ms"].as_u64().unwrap();
        assert!((1900..8000).contains(&ms), "process {p}: {ms} ms");
        assert_eq!(r["still_works"], true, "process {p}: {r}");
        eprintln!("process {p}: {msg}");
    }
    assert!(start.elapsed() < Duration::from_secs(20));
}

/// A newcomer that gave up (1 s timeout) withdraws its ticket; one that comes later is the
/// one admitted.
#[test]
fn a_newcomer_that_gave_up_is_not_admitted_later() {
    let outs = launch(
        4,
        "10",
        None,
        json!({ "mode": "late", "members": 2, "members_wait_ms": 2500,
                "newcomer_timeouts": [1.0, 30.0], "delay_ms": [0, 1500] }),
    );
    let gave_up = outs[2].result();
    assert!(outs[2].ok(), "{}", report(&outs));
    assert_eq!(gave_up["join_error"]["kind"], "Grow", "{gave_up}");
    let msg = gave_up["join_error"]["msg"].as_str().unwrap();
    assert!(msg.contains("no member of the job admitted it"), "{msg}");
    assert!(msg.contains("ticket 1"), "{msg}");
    for (p, rank) in [(0, 0), (1, 1), (3, 2)] {
        let r = ok(&outs, p);
        assert_eq!(r["world"], 3, "process {p}: {r}");
        assert_eq!(r["rank"], rank, "process {p}: {r}");
    }
}
