//! Wrong usage and failures, by real processes: ranks that disagree on a collective's count,
//! type, operator, kind or root; buffers of the wrong size; a peer that dies; an abort. Every
//! rank must get an error that says what happened: never a hang past `OXCCL_TIMEOUT`, never a
//! panic, never wrong data.
//!
//! Sizes matter: on one host an all-reduce of at most 16 KiB runs the mailbox protocol, larger
//! calls and everything else the slot protocol. `SMALL` and `LARGE` pick one or the other.
//!
//! The ranks keep their communicators until every rank has its results (`common::linger`), as
//! processes that handle the error would: a rank that exits early is a new failure the others
//! would see.

mod common;

use std::time::{Duration, Instant};

use oxccl::{Communicator, ReduceOp};
use serde_json::{Value, json};

use common::{error_kind, expect_results, run_ranks};

/// `OXCCL_TIMEOUT` of these jobs: a rank that waits this long has hung.
const TIMEOUT_S: u64 = 10;
/// f32 elements of an all-reduce that runs the mailbox protocol on shm (4000 bytes).
const SMALL: usize = 1000;
/// f32 elements of an all-reduce that runs the slot protocol (ring, 400 KB).
const LARGE: usize = 100_000;

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "disagree" => disagree(args),
        "invalid" => invalid(),
        "dead_peer" => dead_peer(args),
        "abort" => abort(args),
        "late" => late(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// A call's outcome: `{"ok": true}` or the error's kind and text, with its duration.
fn outcome(r: oxccl::Result<()>, start: Instant) -> Value {
    let ms = start.elapsed().as_millis() as u64;
    match r {
        Ok(()) => json!({ "ok": true, "ms": ms }),
        Err(e) => json!({ "ok": false, "kind": error_kind(&e), "msg": e.to_string(), "ms": ms }),
    }
}

fn init() -> Communicator {
    Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"))
}

fn count_arg(args: &Value, key: &str, default: usize) -> usize {
    args[key].as_u64().map_or(default, |c| c as usize)
}

/// Every rank runs one collective; rank `bad` runs it with one thing different (`what`). Then
/// every rank runs a correct all-reduce of `next_count` elements. A call that succeeds must
/// have the result the good ranks agree on.
fn disagree(args: &Value) -> Value {
    let comm = init();
    let (rank, n) = (comm.rank(), comm.world_size());
    let bad = rank == args["bad"].as_u64().unwrap() as usize;
    let bad_root = count_arg(args, "bad_root", 1);
    let count = count_arg(args, "count", SMALL);
    let what = args["what"].as_str().unwrap();
    let sum = ReduceOp::Sum;
    let t = Instant::now();
    // The result, and whether the data is what the good ranks agree on.
    let (first, right) = match what {
        "count" => {
            let mut v = vec![1f32; count + usize::from(bad)];
            let r = comm.all_reduce_in_place(&mut v, sum);
            (r, v.iter().all(|&x| x == n as f32))
        }
        "dtype" if bad => {
            let mut v = vec![1i32; count];
            let r = comm.all_reduce_in_place(&mut v, sum);
            (r, v.iter().all(|&x| x == n as i32))
        }
        "dtype" | "collective" if !bad => {
            let mut v = vec![1f32; count];
            let r = comm.all_reduce_in_place(&mut v, sum);
            (r, v.iter().all(|&x| x == n as f32))
        }
        "collective" => {
            let mut v = vec![1f32; count];
            (comm.broadcast_in_place(&mut v, 0), true)
        }
        "op" => {
            let mut v = vec![1f64; count];
            let op = if bad { ReduceOp::Max } else { sum };
            let r = comm.all_reduce_in_place(&mut v, op);
            (r, v.iter().all(|&x| x == n as f64))
        }
        "root" => {
            let root = if bad { bad_root } else { 0 };
            let mut v = vec![rank as f32 + 1.0; count];
            let r = comm.broadcast_in_place(&mut v, root);
            (r, v.iter().all(|&x| x == 1.0))
        }
        other => panic!("unknown disagreement {other:?}"),
    };
    let first_wrong = first.is_ok() && !bad && !right;
    let first = outcome(first, t);
    let t = Instant::now();
    let mut v = vec![1f32; count_arg(args, "next_count", SMALL)];
    let r = comm.all_reduce_in_place(&mut v, sum);
    let second_wrong = r.is_ok() && v.iter().any(|&x| x != n as f32);
    let second = outcome(r, t);
    common::mark_done();
    common::linger();
    json!({
        "first": first,
        "second": second,
        "first_wrong": first_wrong,
        "second_wrong": second_wrong,
    })
}

/// Ranks other than 0 make calls with bad arguments first; each must fail at once, locally,
/// without sending anything or spoiling the communicator; then everyone runs a good call.
fn invalid() -> Value {
    let comm = init();
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut calls = Vec::new();
    if rank != 0 {
        let mut check = |name: &str, call: &dyn Fn() -> oxccl::Result<()>| {
            let t = Instant::now();
            let mut o = outcome(call(), t);
            o["call"] = json!(name);
            calls.push(o);
        };
        let sum = ReduceOp::Sum;
        check("all_reduce 1000 -> 999", &|| {
            comm.all_reduce(&[1f32; 1000], &mut [0f32; 999], sum)
        });
        check("reduce_scatter input n*1000+1", &|| {
            comm.reduce_scatter(&vec![1f32; n * 1000 + 1], &mut [0f32; 1000], sum)
        });
        check("all_gather 10 -> n*10+3", &|| {
            comm.all_gather(&[7u64; 10], &mut vec![0u64; n * 10 + 3])
        });
        check("broadcast root = world", &|| {
            comm.broadcast(&[1i32; 10], &mut [0i32; 10], n)
        });
        check("all_to_allv with 1 count", &|| {
            comm.all_to_allv(&[1u8; 4], &[4], &mut [0u8; 4], &[4])
        });
        check("send to itself", &|| comm.send(&[1u8; 4], rank));
        check("recv from rank = world", &|| comm.recv(&mut [0u8; 4], n));
    }
    let t = Instant::now();
    let mut v = vec![(rank + 1) as f32; 1000];
    let r = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
    let want = (n * (n + 1) / 2) as f32;
    let wrong = r.is_ok() && v.iter().any(|&x| x != want);
    let good = outcome(r, t);
    let destroyed = outcome(comm.destroy(), Instant::now());
    json!({ "calls": calls, "good": good, "good_wrong": wrong, "destroy": destroyed })
}

/// Rank `dead` exits right after init (or `delay_ms` later, while the others wait in their
/// all-reduce of `count` elements), without destroying anything; the others run the
/// all-reduce, then another.
fn dead_peer(args: &Value) -> Value {
    // A rank that exits right after its init may leave others still in init's closing
    // barrier (its last messages not yet delivered, over tcp): their init fails as the first
    // call would.
    let t = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            let failed = outcome(Err(e), t);
            common::mark_done();
            common::linger();
            return json!({ "first": failed, "second": failed });
        }
    };
    let dead = args["dead"].as_u64().unwrap() as usize;
    if comm.rank() == dead {
        std::thread::sleep(Duration::from_millis(
            args["delay_ms"].as_u64().unwrap_or(0),
        ));
        common::emit(&json!({ "dead": true }));
        common::mark_done();
        std::process::exit(0);
    }
    let t = Instant::now();
    let mut v = vec![1f32; count_arg(args, "count", SMALL)];
    let first = outcome(comm.all_reduce_in_place(&mut v, ReduceOp::Sum), t);
    let t = Instant::now();
    let second = outcome(comm.all_reduce_in_place(&mut v, ReduceOp::Sum), t);
    common::mark_done();
    common::linger();
    json!({ "first": first, "second": second })
}

/// Rank `aborter` aborts right after init; the others run an all-reduce of `count` elements.
/// Then everybody makes one more call.
fn abort(args: &Value) -> Value {
    // The abort may reach a rank still finishing its init (the barrier that ends it), which
    // then fails as the first call would.
    let t = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            let failed = outcome(Err(e), t);
            common::mark_done();
            common::linger();
            return json!({ "first": failed, "second": failed });
        }
    };
    let aborter = args["aborter"].as_u64().unwrap() as usize;
    let mut v = vec![1f32; count_arg(args, "count", SMALL)];
    let t = Instant::now();
    let first = if comm.rank() == aborter {
        comm.abort();
        outcome(Ok(()), t)
    } else {
        outcome(comm.all_reduce_in_place(&mut v, ReduceOp::Sum), t)
    };
    let t = Instant::now();
    let second = outcome(comm.all_reduce_in_place(&mut v, ReduceOp::Sum), t);
    common::mark_done();
    common::linger();
    json!({ "first": first, "second": second })
}

/// Rank 1 starts its small all-reduce `delay_ms` late (past rank 0's timeout); rank 0 runs
/// its own at once.
fn late(args: &Value) -> Value {
    let comm = init();
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_millis(args["delay_ms"].as_u64().unwrap()));
    }
    let mut v = vec![1f32; SMALL];
    let t = Instant::now();
    let first = outcome(comm.all_reduce_in_place(&mut v, ReduceOp::Sum), t);
    common::mark_done();
    common::linger();
    json!({ "first": first })
}

fn launch(n: usize, provider: &str, scenario: &str, args: Value) -> (Vec<Value>, String) {
    let timeout = TIMEOUT_S.to_string();
    let env = [("OXCCL_PROVIDER", provider), ("OXCCL_TIMEOUT", &timeout)];
    let start = Instant::now();
    let outs = run_ranks(n, &env, scenario, &args);
    let name = format!("{scenario} {args} ({n} ranks over {provider})");
    let results = expect_results(&name, &outs);
    eprintln!("{name}: {:.1} s", start.elapsed().as_secs_f64());
    (results, common::report(&outs))
}

fn assert_took_less(ctx: &str, rank: usize, call: &Value, limit: Duration) {
    let ms = call["ms"].as_u64().unwrap();
    assert!(
        Duration::from_millis(ms) < limit,
        "{ctx}: rank {rank} took {ms} ms (OXCCL_TIMEOUT={TIMEOUT_S}): {call}"
    );
}

// ------------------------------------------------------------------------------------------
// Disagreements

/// How strictly a disagreement's errors are checked.
#[derive(Clone, Copy, PartialEq)]
enum Naming {
    /// Tolerates two known faults: an error seen in the call after the bad one may name that
    /// later call instead (`late_mismatch_names_the_call`), and a rank may see another's
    /// teardown after its mismatch before the mismatch notice, and report `PeerFailed`
    /// naming that rank (`mismatch_reaches_every_rank_as_a_mismatch`).
    Lenient,
    /// Every error is a mismatch naming the collective that went wrong.
    Strict,
}

const LATE: Naming = Naming::Lenient;

/// The rank a `PeerFailed` message names as the failed peer.
fn failed_peer(msg: &str) -> Option<usize> {
    let rest = &msg[msg.find("peer rank ")? + "peer rank ".len()..];
    rest.split(' ').next()?.parse().ok()
}

/// Runs a disagreement (`args`: see [`disagree`]) and checks: every rank's call, or at latest
/// its next one, fails with `Mismatch` (or `Poisoned` after one) naming `coll`, promptly
/// (never `Timeout`); after an error the next call is `Poisoned`; a call that succeeds has
/// the right data; and some rank's message names both sides (`sides`).
fn check_disagreement(
    n: usize,
    provider: &str,
    args: Value,
    coll: &str,
    sides: [&str; 2],
    naming: Naming,
) {
    let (results, report) = launch(n, provider, "disagree", args.clone());
    let ctx = format!("disagreement {args}, {n} ranks over {provider}");
    let mut both_sides = false;
    for (rank, r) in results.iter().enumerate() {
        let (first, second) = (&r["first"], &r["second"]);
        let late = first["ok"] == true;
        let err = if late { second } else { first };
        assert!(
            err["ok"] == false,
            "{ctx}: rank {rank} saw no error in the call or the next one: {r}{report}"
        );
        let (kind, msg) = (err["kind"].as_str().unwrap(), err["msg"].as_str().unwrap());
        let saw_mismatch = |p: usize| {
            results[p]["first"]["kind"] == "Mismatch" || results[p]["second"]["kind"] == "Mismatch"
        };
        let cascade = naming == LATE
            && kind == "PeerFailed"
            && failed_peer(msg).is_some_and(|p| p != rank && saw_mismatch(p));
        assert!(
            kind == "Mismatch" || kind == "Poisoned" || cascade,
            "{ctx}: rank {rank} got {kind}, not Mismatch: {msg}{report}"
        );
        // A rank that finished the bad call (a root, say) hears of the mismatch in its next
        // call, whose name the message may give instead (see `late_mismatch_names_the_call`).
        let named = if late && naming == LATE && !msg.contains(coll) {
            "all_reduce #2"
        } else {
            coll
        };
        assert!(
            msg.contains(named),
            "{ctx}: rank {rank}'s error does not name {named}: {msg}"
        );
        if !late {
            assert_eq!(
                second["kind"], "Poisoned",
                "{ctx}: rank {rank}: the call after an error: {second}"
            );
        }
        for call in [first, second] {
            assert_took_less(&ctx, rank, call, Duration::from_secs(TIMEOUT_S - 2));
        }
        assert!(
            r["first_wrong"] == false && r["second_wrong"] == false,
            "{ctx}: rank {rank}: a call succeeded with wrong data: {r}"
        );
        both_sides |= sides.iter().all(|s| msg.contains(s));
    }
    assert!(
        both_sides,
        "{ctx}: no rank's error names both {sides:?}: {results:?}"
    );
}

#[test]
fn count_mismatch_tcp() {
    let args = json!({ "what": "count", "bad": 1 });
    let sides = ["count 1000", "count 1001"];
    check_disagreement(3, "tcp", args, "all_reduce", sides, LATE);
}

#[test]
fn count_mismatch_two_ranks_shm() {
    // Each rank receives the other's message: both see the mismatch themselves.
    let args = json!({ "what": "count", "bad": 1 });
    let sides = ["count 1000", "count 1001"];
    check_disagreement(2, "shm", args, "all_reduce", sides, LATE);
}

#[test]
fn large_count_mismatch() {
    // Ring all-reduce over several chunks; the counts differ by one element.
    let args = json!({ "what": "count", "bad": 1, "count": 300_000 });
    let sides = ["count 300000", "count 300001"];
    check_disagreement(3, "shm", args, "all_reduce", sides, LATE);
}

/// Recursive doubling on 3 ranks in mailboxes: ranks 0 and 1 exchange and see the mismatch;
/// rank 2 waits for rank 0's last message and must learn of it from rank 0's notice, which
/// the mailbox loop finds on the completion queue (regression: it once never polled it, and
/// rank 2 timed out).
#[test]
fn count_mismatch() {
    let args = json!({ "what": "count", "bad": 1 });
    let sides = ["count 1000", "count 1001"];
    check_disagreement(3, "shm", args, "all_reduce", sides, LATE);
}

#[test]
fn dtype_mismatch_of_the_same_size_tcp() {
    let args = json!({ "what": "dtype", "bad": 1 });
    check_disagreement(3, "tcp", args, "all_reduce", ["float", "int32"], LATE);
}

#[test]
fn large_dtype_mismatch_of_the_same_size() {
    let args = json!({ "what": "dtype", "bad": 1, "count": LARGE, "next_count": LARGE });
    check_disagreement(3, "shm", args, "all_reduce", ["float", "int32"], LATE);
}

/// Like `count_mismatch`: rank 2 never hears of the mismatch ranks 0 and 1 found.
#[test]
fn dtype_mismatch_of_the_same_size() {
    let args = json!({ "what": "dtype", "bad": 1 });
    check_disagreement(3, "shm", args, "all_reduce", ["float", "int32"], LATE);
}

#[test]
fn op_mismatch() {
    let args = json!({ "what": "op", "bad": 1, "count": 100 });
    check_disagreement(3, "shm", args, "all_reduce", ["sum", "max"], LATE);
}

#[test]
fn collective_mismatch() {
    // Ring all-reduce against chain broadcast.
    let args = json!({ "what": "collective", "bad": 1, "count": LARGE, "next_count": LARGE });
    check_disagreement(3, "shm", args, "", ["all_reduce", "broadcast"], LATE);
}

#[test]
fn collective_mismatch_tcp() {
    let args = json!({ "what": "collective", "bad": 1 });
    check_disagreement(3, "tcp", args, "", ["all_reduce", "broadcast"], LATE);
}

/// Ranks 0 and 2 run a mailbox all-reduce, rank 1 a broadcast: rank 1's slot fragment reaches
/// a rank in the mailbox protocol, and rank 0's mailbox message a rank in the slot protocol;
/// each must be read as a stray and reported (regression: all three once timed out).
#[test]
fn collective_mismatch_small() {
    let args = json!({ "what": "collective", "bad": 1 });
    check_disagreement(3, "shm", args, "", ["all_reduce", "broadcast"], LATE);
}

/// Rank 3 of 4 takes rank 1 for the root; it receives rank 1's data, which names root 0.
#[test]
fn broadcast_root_mismatch() {
    let args = json!({ "what": "root", "bad": 3, "bad_root": 1, "next_count": LARGE });
    check_disagreement(4, "shm", args, "broadcast", ["root 0", "root 1"], LATE);
}

#[test]
fn large_broadcast_root_mismatch() {
    // Chain broadcast: rank 1 takes rank 3 for the root.
    let args = json!({ "what": "root", "bad": 1, "bad_root": 3, "count": LARGE,
                       "next_count": LARGE });
    check_disagreement(4, "shm", args, "broadcast", ["root 0", "root 3"], LATE);
}

/// Rank 2 of 3 takes itself for the root: often every rank's broadcast returns (rank 2 sends
/// and receives nothing; the others get rank 0's data), and the mismatch shows in the next
/// call, in whichever stale fragment is read first.
#[test]
fn broadcast_root_mismatch_self_root() {
    let args = json!({ "what": "root", "bad": 2, "bad_root": 2, "next_count": LARGE });
    // Found in the broadcast itself (a fragment for root 2 where root 0's is expected) or in
    // the next call (a stray fragment of broadcast #1 for root 2): either names both roots.
    let sides = ["root 0", "root 2"];
    check_disagreement(3, "shm", args, "broadcast", sides, LATE);
}

/// Both ranks of 2 take themselves for the root: neither has anything to receive, so each
/// finds the other's fragment unread when its broadcast ends (or, at the latest, in the next
/// call).
#[test]
fn broadcast_root_mismatch_two_roots_tcp() {
    let args = json!({ "what": "root", "bad": 1, "bad_root": 1 });
    let sides = ["root 0", "root 1"];
    check_disagreement(2, "tcp", args, "broadcast", sides, LATE);
}

/// As `broadcast_root_mismatch`, but the next call is a small all-reduce, which runs the
/// mailbox protocol: rank 3 finds the mismatch and notifies everyone, and ranks 0-2 must see
/// the notice in the mailbox loop (regression: they once timed out).
#[test]
fn mismatch_notice_reaches_a_small_next_call() {
    let args = json!({ "what": "root", "bad": 3, "bad_root": 1 });
    check_disagreement(4, "shm", args, "broadcast", ["root 0", "root 1"], LATE);
}

/// As `broadcast_root_mismatch_self_root`, with a small next call: a broadcast can complete
/// on every rank with rank 2's fragments left unread in the slots, so every call checks what
/// arrived and was not taken before it returns (regression: the mailbox all-reduce once
/// succeeded everywhere, rank 2 keeping its own data, and nobody was told).
#[test]
fn self_root_mismatch_before_a_small_call() {
    let args = json!({ "what": "root", "bad": 2, "bad_root": 2 });
    // Found in the broadcast or, by a rank whose broadcast completed, in the all-reduce:
    // either way the error names both roots.
    let sides = ["root 0", "root 2"];
    check_disagreement(3, "shm", args, "broadcast", sides, LATE);
}

/// Rank 2 of 3 takes rank 1 for the root and waits for rank 1, which (in the tree from rank
/// 0) sends it nothing; rank 0's fragment, which names root 0, arrives on a link rank 2's
/// schedule does not receive from and must be read as a stray (regression: every rank once
/// timed out and nobody reported the mismatch).
#[test]
fn broadcast_root_mismatch_third_rank_as_root() {
    let args = json!({ "what": "root", "bad": 2, "bad_root": 1 });
    check_disagreement(3, "tcp", args, "broadcast", ["root 0", "root 1"], LATE);
}

/// Every rank must get `Mismatch`, never `PeerFailed` about the live rank that found it
/// (regression: the finder once put every queue pair in the error state right away).
#[test]
fn mismatch_reaches_every_rank_as_a_mismatch() {
    for _ in 0..10 {
        let args = json!({ "what": "collective", "bad": 1, "count": LARGE, "next_count": LARGE });
        let sides = ["all_reduce", "broadcast"];
        check_disagreement(3, "shm", args, "", sides, Naming::Strict);
    }
}

/// A rank that completed a mismatched collective (here the root, and the ranks that got its
/// data) learns of the mismatch in its next call, from the notice of the rank that found it;
/// the notice carries the call's sequence number, so the error names the broadcast that went
/// wrong, not the call that happened to be running.
#[test]
fn late_mismatch_names_the_call() {
    let args = json!({ "what": "root", "bad": 3, "bad_root": 1, "next_count": LARGE });
    let sides = ["root 0", "root 1"];
    check_disagreement(4, "shm", args, "broadcast #1", sides, Naming::Strict);
}

// ------------------------------------------------------------------------------------------
// Bad arguments

#[test]
fn invalid_arguments_fail_locally() {
    let n = 3;
    let (results, report) = launch(n, "shm", "invalid", json!({}));
    for (rank, r) in results.iter().enumerate() {
        let calls = r["calls"].as_array().unwrap();
        assert_eq!(calls.len(), if rank == 0 { 0 } else { 7 }, "{r}");
        for c in calls {
            let (name, msg) = (c["call"].as_str().unwrap(), c["msg"].as_str().unwrap_or(""));
            assert_eq!(
                c["kind"], "InvalidArgument",
                "rank {rank}: {name}: {c}{report}"
            );
            assert!(
                c["ms"].as_u64().unwrap() < 1000,
                "rank {rank}: {name} was not rejected at once: {c}"
            );
            assert!(msg.starts_with(&format!("rank {rank}: ")), "{name}: {msg}");
            let names: &[&str] = match name {
                "all_reduce 1000 -> 999" => &["all_reduce", "3996", "4000"],
                "reduce_scatter input n*1000+1" => &["reduce_scatter", "12004", "12000"],
                "all_gather 10 -> n*10+3" => &["all_gather", "264", "240"],
                "broadcast root = world" => &["broadcast", "3"],
                "all_to_allv with 1 count" => &["all_to_allv", "1", "3"],
                "send to itself" => &["send", "itself"],
                _ => &["recv", "3"],
            };
            for s in names {
                assert!(msg.contains(s), "rank {rank}: {name}: {msg:?} lacks {s:?}");
            }
        }
        // Nothing was sent and nothing spoiled: the next call works, on every rank.
        assert!(
            r["good"]["ok"] == true && r["good_wrong"] == false,
            "rank {rank}: the good all_reduce after the rejected calls: {r}{report}"
        );
        assert!(r["destroy"]["ok"] == true, "rank {rank}: destroy: {r}");
    }
}

// ------------------------------------------------------------------------------------------
// A dead peer

/// What a dead-peer check demands of the survivors beyond "an error, not a hang".
#[derive(Clone, Copy, PartialEq)]
struct Want {
    /// Every survivor's error names the dead rank (else: each names some peer, one the dead
    /// rank).
    all_name_it: bool,
    /// Every survivor gets `PeerFailed` well before the timeout (else: `PeerFailed` or
    /// `Timeout`, within the timeout and a little).
    at_once: bool,
}

/// Rank `dead` of `n` exits (after `delay_ms`); every survivor's all-reduce of `count`
/// elements must fail with PeerFailed or Timeout naming the collective, as `want` says; the
/// next call is `Poisoned`.
///
/// A survivor that fails tears its connections down, which a third rank may see first and
/// report as that survivor's failure (see `every_survivor_names_the_dead_peer`): only with
/// 2 ranks can every survivor be expected to name the dead one.
fn check_dead_peer(n: usize, provider: &str, dead: usize, delay_ms: u64, count: usize, want: Want) {
    let start = Instant::now();
    let args = json!({ "dead": dead, "delay_ms": delay_ms, "count": count });
    let (results, report) = launch(n, provider, "dead_peer", args);
    let ctx = format!("rank {dead} of {n} dead ({provider}, all_reduce of {count})");
    let (kinds, limit): (&[&str], _) = if want.at_once {
        (&["PeerFailed"], Duration::from_secs(TIMEOUT_S / 2))
    } else {
        (
            &["PeerFailed", "Timeout"],
            Duration::from_secs(TIMEOUT_S + 5),
        )
    };
    let mut named = false;
    for (rank, r) in results.iter().enumerate() {
        if rank == dead {
            continue;
        }
        let first = &r["first"];
        let (kind, msg) = (
            first["kind"].as_str().unwrap_or("none"),
            first["msg"].as_str().unwrap_or(""),
        );
        assert!(kinds.contains(&kind), "{ctx}: rank {rank}: {first}{report}");
        // The failure may reach a rank still in init's closing barrier (#0).
        let in_init = msg.contains("barrier #0");
        assert!(
            msg.contains("all_reduce #1") || in_init,
            "{ctx}: rank {rank}'s error does not name the call: {msg}"
        );
        let names_peer = (0..n).any(|p| p != rank && msg.contains(&format!("rank {p}")));
        assert!(
            names_peer,
            "{ctx}: rank {rank}'s error names no peer: {msg}"
        );
        let names_dead = match kind {
            "PeerFailed" => msg.contains(&format!("peer rank {dead} failed")),
            _ => msg.contains(&format!("rank {dead}")),
        };
        assert!(
            names_dead || !want.all_name_it,
            "{ctx}: rank {rank}'s error does not name the dead rank {dead}: {msg}"
        );
        named |= names_dead;
        assert_took_less(&ctx, rank, first, limit);
        if !in_init {
            assert_eq!(r["second"]["kind"], "Poisoned", "{ctx}: rank {rank}: {r}");
        }
    }
    assert!(
        named,
        "{ctx}: no survivor's error names rank {dead}: {results:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(TIMEOUT_S + 10));
}

const SOME_NAME_IT: Want = Want {
    all_name_it: false,
    at_once: false,
};
const AT_ONCE: Want = Want {
    all_name_it: false,
    at_once: true,
};
const ALL_AT_ONCE: Want = Want {
    all_name_it: true,
    at_once: true,
};

/// A small all-reduce on shm (recursive doubling in mailboxes): rank 0 only notices when the
/// timeout expires (see `small_call_notices_a_dead_peer`); rank 1, which only exchanges with
/// rank 0, names rank 0 (see `every_survivor_names_the_dead_peer`).
#[test]
fn dead_peer_shm() {
    check_dead_peer(3, "shm", 2, 0, SMALL, SOME_NAME_IT);
}

#[test]
fn dead_peer_large_call_shm() {
    check_dead_peer(3, "shm", 2, 0, LARGE, AT_ONCE);
}

#[test]
fn dead_peer_two_ranks_shm() {
    check_dead_peer(2, "shm", 1, 0, LARGE, ALL_AT_ONCE);
}

/// Recursive doubling on 3 ranks over tcp: only rank 0 exchanges data with rank 2.
#[test]
fn dead_peer_tcp() {
    check_dead_peer(3, "tcp", 2, 0, SMALL, SOME_NAME_IT);
}

#[test]
fn peer_dies_during_the_call_shm() {
    // Rank 0 also serves the bootstrap store: it must outlive the others' init (which waits
    // on the store after rank 0's init has returned), hence the delay.
    check_dead_peer(3, "shm", 0, 300, LARGE, AT_ONCE);
}

#[test]
fn peer_dies_during_the_call_tcp() {
    check_dead_peer(2, "tcp", 1, 300, SMALL, ALL_AT_ONCE);
}

/// A survivor that does not exchange data with the dead rank (recursive doubling on 3 ranks:
/// rank 1 only talks to rank 0) must still fail naming the dead rank, from the failure notice
/// the rank that saw it passes on (regression: it once named rank 0, a live rank, or timed
/// out).
#[test]
fn every_survivor_names_the_dead_peer() {
    check_dead_peer(
        3,
        "tcp",
        2,
        0,
        SMALL,
        Want {
            all_name_it: true,
            at_once: false,
        },
    );
}

/// The shm provider reports a dead peer on the completion queue: survivors of a small
/// (mailbox) all-reduce must notice it there, well before `OXCCL_TIMEOUT`.
#[test]
fn small_call_notices_a_dead_peer() {
    check_dead_peer(3, "shm", 0, 300, SMALL, AT_ONCE);
}

/// A small all-reduce on shm that times out says what it waited for, step and peer: the same
/// whether it ran compiled (the program tells its machine what ran only once it must say
/// what it waits for) or driven by its machine.
#[test]
fn a_small_call_that_times_out_names_the_mailbox_it_waits_on() {
    let mut said = Vec::new();
    for compiled in ["1", "0"] {
        let env = [
            ("OXCCL_PROVIDER", "shm"),
            ("OXCCL_TIMEOUT", "1"),
            ("OXCCL_COMPILED", compiled),
        ];
        let outs = run_ranks(2, &env, "late", &json!({ "delay_ms": 2500 }));
        let results = expect_results("late", &outs);
        let first = &results[0]["first"];
        let msg = first["msg"].as_str().unwrap_or("");
        assert_eq!(
            first["kind"], "Timeout",
            "OXCCL_COMPILED={compiled}: {first}"
        );
        assert!(
            msg.contains("all_reduce #1")
                && msg.contains("waiting for rank 1's message in its mailbox"),
            "OXCCL_COMPILED={compiled}: {msg}"
        );
        let ms = first["ms"].as_u64().unwrap();
        assert!(
            (900..2400).contains(&ms),
            "OXCCL_COMPILED={compiled}: {ms} ms: {first}"
        );
        // What follows "waiting ...": the step and the bytes that arrived.
        said.push(msg.split_once("waiting").unwrap().1.to_string());
    }
    assert_eq!(
        said[0], said[1],
        "compiled and uncompiled say different things"
    );
}

// ------------------------------------------------------------------------------------------
// Abort

/// Rank 1 aborts; the others' all-reduce fails at once, with `Aborted` naming rank 1 (with
/// `strict`, on every rank; else on one at least, the others may see a survivor's teardown
/// first, as `PeerFailed`); the aborter's own next call fails at once too.
fn check_abort(n: usize, provider: &str, count: usize, strict: bool) {
    let (results, report) = launch(
        n,
        provider,
        "abort",
        json!({ "aborter": 1, "count": count }),
    );
    let ctx = format!("rank 1 of {n} aborts ({provider}, all_reduce of {count})");
    let mut told = false;
    for (rank, r) in results.iter().enumerate() {
        let err = if rank == 1 { &r["second"] } else { &r["first"] };
        let (kind, msg) = (
            err["kind"].as_str().unwrap_or("none"),
            err["msg"].as_str().unwrap_or(""),
        );
        assert_took_less(&ctx, rank, err, Duration::from_secs(TIMEOUT_S / 2));
        if rank == 1 {
            assert!(
                kind == "Aborted" || kind == "Poisoned",
                "{ctx}: the aborter's next call: {err}"
            );
            continue;
        }
        // The abort may arrive while this rank still runs init's closing barrier (#0).
        if !msg.contains("barrier #0") {
            assert_eq!(r["second"]["kind"], "Poisoned", "{ctx}: rank {rank}: {r}");
            assert!(msg.contains("all_reduce"), "{ctx}: rank {rank}: {msg}");
        }
        if kind == "Aborted" {
            assert!(msg.contains("rank 1 aborted"), "{ctx}: rank {rank}: {msg}");
            told = true;
        } else {
            assert!(
                !strict && kind == "PeerFailed",
                "{ctx}: rank {rank}: {err}{report}"
            );
        }
    }
    assert!(told, "{ctx}: nobody was told of the abort: {results:?}");
}

#[test]
fn abort_reaches_every_peer() {
    check_abort(3, "shm", LARGE, false);
}

#[test]
fn abort_reaches_every_peer_tcp() {
    check_abort(3, "tcp", SMALL, false);
}

#[test]
fn abort_reaches_the_peer_two_ranks() {
    check_abort(2, "shm", LARGE, true);
}

/// Every survivor must get `Aborted`, never `PeerFailed` about a live rank that was told
/// first (regression: about one run in three once did).
#[test]
fn abort_reaches_every_peer_as_an_abort() {
    for _ in 0..3 {
        check_abort(3, "shm", LARGE, true);
    }
}

/// The abort notice arrives on the completion queue, which the mailbox loop must poll.
#[test]
fn abort_reaches_a_small_call() {
    check_abort(3, "shm", SMALL, false);
}
