//! Injected faults (`OXCCL_FAULT`), the watchdog and the flight recorder, by real processes:
//! a rank that kills or stops itself mid-call, a cut or stalled connection, a damaged
//! fragment header, a refused registration. Every rank must get an error that names the rank
//! at fault, within the timeout plus a second; the dumps must say where each rank was.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use oxccl::{Communicator, Error, ReduceOp};
use serde_json::{Value, json};

use common::{error_kind, expect_results, report, run_ranks, shared_dir};

/// f32 elements of an all-reduce that runs the mailbox protocol on shm.
const SMALL: usize = 1000;
/// f32 elements of an all-reduce that runs the slot protocol and registers buffers.
const LARGE: usize = 300_000;

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "loop" => looped(args),
        "signal_dump" => signal_dump(),
        "cycles" => cycles(),
        other => panic!("unknown scenario {other:?}"),
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Runs all-reduces of `count` f32 (checking each result) until one fails or `calls` are
/// done. Reports the first error (kind, text, fields), when it came, and how long the failing
/// call took. With `cont_after_timeout`, rank 0 sends `SIGCONT` to the stopped rank (its pid
/// is in the shared directory) after its own timeout, and every rank that timed out aborts.
fn looped(args: &Value) -> Value {
    let mut opts = oxccl::Options::from_env().unwrap();
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    if args["no_watchdog_rank"].as_u64() == Some(rank as u64) {
        opts.watchdog = None;
    }
    let boot = oxccl_bootstrap::Bootstrap::from_env().unwrap_or_else(|e| panic!("bootstrap: {e}"));
    let comm = Communicator::init(boot, opts).unwrap_or_else(|e| panic!("init: {e}"));
    let (rank, n) = (comm.rank(), comm.world_size());
    std::fs::write(
        shared_dir().join(format!("pid-{rank}")),
        std::process::id().to_string(),
    )
    .unwrap();
    if args["doomed"].as_u64() == Some(rank as u64) {
        // It will be killed: the others need not wait for it to finish.
        common::mark_done();
    }
    if let Some(t) = args["set_timeout_ms"].as_u64() {
        comm.set_timeout(Duration::from_millis(t));
    }
    let count = args["count"].as_u64().unwrap() as usize;
    let calls = args["calls"].as_u64().unwrap_or(6);
    for call in 1..=calls {
        // Different data in every call: a fragment taken from the wrong call shows.
        let c = call as usize * 10;
        let mut v: Vec<f32> = (0..count).map(|i| (i % 7 + rank + c) as f32).collect();
        let t = Instant::now();
        let r = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
        let ms = t.elapsed().as_millis() as u64;
        match r {
            Ok(()) => {
                let bad = (0..count)
                    .find(|&i| v[i] != (n * (i % 7 + c) + n * (n - 1) / 2) as f32)
                    .map(|i| format!("element {i} is {}", v[i]));
                if let Some(b) = bad {
                    return json!({ "ok": false, "kind": "WrongResult", "msg": b, "call": call });
                }
            }
            Err(e) => {
                let at = now_ns();
                let (seq, peer, waiting) = match &e {
                    Error::Timeout {
                        op, peer, waiting, ..
                    } => (Some(op.seq), *peer, Some(waiting.clone())),
                    Error::PeerFailed { peer, .. } => (None, Some(*peer), None),
                    _ => (None, None, None),
                };
                let mut out = json!({
                    "ok": false, "kind": error_kind(&e), "msg": e.to_string(), "call": call,
                    "ms": ms, "at_ns": at, "seq": seq, "peer": peer, "waiting": waiting,
                });
                if args["cont_after_timeout"].as_bool() == Some(true)
                    && matches!(e, Error::Timeout { .. } | Error::Aborted { .. })
                {
                    let stopped = args["stopped"].as_u64().unwrap() as usize;
                    // Every other rank times out on its own before anyone aborts.
                    let dir = shared_dir();
                    std::fs::write(dir.join(format!("gave-up-{rank}")), b"").unwrap();
                    let start = Instant::now();
                    while !(0..n)
                        .filter(|&r| r != stopped)
                        .all(|r| dir.join(format!("gave-up-{r}")).exists())
                        && start.elapsed() < Duration::from_secs(20)
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    if rank == 0 {
                        let pid =
                            std::fs::read_to_string(shared_dir().join(format!("pid-{stopped}")))
                                .unwrap();
                        std::fs::write(shared_dir().join("cont_ns"), now_ns().to_string()).unwrap();
                        let st = std::process::Command::new("kill")
                            .args(["-CONT", pid.trim()])
                            .status()
                            .unwrap();
                        assert!(st.success());
                    }
                    comm.abort();
                }
                if rank as u64 == args["stopped"].as_u64().unwrap_or(u64::MAX) {
                    // This rank was stopped: when was it continued?
                    out["cont_ns"] = std::fs::read_to_string(shared_dir().join("cont_ns"))
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .into();
                }
                if args["close_on_error"].as_bool() == Some(true) {
                    // Drop the communicator at once (the harness waits for the others).
                    drop(comm);
                    return out;
                }
                // Keep the communicator until every rank has its error, as a job that handles
                // errors would.
                common::emit(&out);
                common::mark_done();
                common::linger();
                std::process::exit(0);
            }
        }
    }
    json!({ "ok": true, "calls": calls })
}

/// Runs a few calls, then signals itself with `SIGUSR1` and waits for the dump.
fn signal_dump() -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let mut v = vec![1i32; 4096];
    for _ in 0..3 {
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    }
    let mut b = vec![0u8; 100];
    comm.broadcast_in_place(&mut b, 1).unwrap();
    let prefix = std::env::var("OXCCL_DEBUG_DUMP").unwrap();
    let path = PathBuf::from(format!("{prefix}{}.json", comm.rank()));
    let st = std::process::Command::new("kill")
        .args(["-USR1", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let start = Instant::now();
    while !path.exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let dump = std::fs::read_to_string(&path).unwrap_or_default();
    let destroyed = comm.destroy().map_err(|e| e.to_string());
    json!({ "dump": dump, "destroy": format!("{destroyed:?}") })
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map_or(0, |d| d.count())
}

/// Creates and destroys communicators (sub-communicators of one parent, with the watchdog, one
/// of them aborted) and reports this process's threads and descriptors before and after.
fn cycles() -> Value {
    let mut opts = oxccl::Options::from_env().unwrap();
    opts.watchdog = Some(oxccl::WatchdogAction::Abort);
    let boot = oxccl_bootstrap::Bootstrap::from_env().unwrap();
    let parent = Communicator::init(boot, opts).unwrap();
    let one = |abort: bool| {
        let comm = parent.split(Some(0), 0).unwrap().unwrap();
        let mut v = vec![1f32; 50_000];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        let mut work = comm.all_reduce_async(vec![1i32; 10], ReduceOp::Sum);
        work.wait(Duration::from_secs(10)).unwrap();
        if abort {
            // Every rank aborts; one may hear a peer's abort in the barrier first: fine.
            let _ = comm.barrier();
            comm.abort();
        }
        comm.destroy().unwrap();
    };
    one(false);
    std::thread::sleep(Duration::from_millis(300));
    let before = (count_dir("/proc/self/task"), count_dir("/proc/self/fd"));
    for i in 0..8 {
        one(i == 3);
    }
    // A watchdog notices its communicator is gone within a tick (100 ms).
    std::thread::sleep(Duration::from_millis(300));
    let after = (count_dir("/proc/self/task"), count_dir("/proc/self/fd"));
    parent.destroy().unwrap();
    json!({ "threads": [before.0, after.0], "fds": [before.1, after.1] })
}

fn dump_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("dump-{rank}.json"))
}

struct Job {
    results: Vec<Value>,
    /// The flight-recorder dumps found, per rank.
    dumps: Vec<Option<Value>>,
}

/// Runs `looped` on `n` ranks with `fault` injected.
fn launch(n: usize, env: &[(&str, &str)], args: Value) -> Job {
    let dumps = common::TempDir::new("faults-dumps");
    let prefix = format!("{}/dump-", dumps.0.display());
    let mut all_env: Vec<(&str, &str)> = vec![("OXCCL_DEBUG_DUMP", &prefix)];
    all_env.extend_from_slice(env);
    let outs = run_ranks(n, &all_env, "loop", &args);
    let doomed = args["doomed"].as_u64().map(|d| d as usize);
    let results = if let Some(d) = doomed {
        let want = args["doomed_signal"].as_i64().unwrap_or(9) as i32;
        let killed = outs[d].status.is_some_and(|s| {
            use std::os::unix::process::ExitStatusExt;
            s.signal() == Some(want)
        });
        assert!(
            killed,
            "rank {d} did not die of signal {want}{}",
            report(&outs)
        );
        assert!(
            outs.iter().filter(|o| o.rank != d).all(|o| o.ok()),
            "{env:?} {args}: a survivor failed{}",
            report(&outs)
        );
        outs.iter()
            .map(|o| {
                if o.rank == d {
                    json!({ "ok": false, "killed": true })
                } else {
                    o.result().clone()
                }
            })
            .collect()
    } else {
        expect_results(&format!("{env:?} {args}"), &outs)
    };
    let dumps = (0..n)
        .map(|r| {
            std::fs::read_to_string(dump_file(&dumps.0, r))
                .ok()
                .map(|s| serde_json::from_str(&s).expect("a dump is JSON"))
        })
        .collect();
    if std::env::var_os("OXCCL_TEST_VERBOSE").is_some() {
        eprintln!("{}", report(&outs));
    }
    Job { results, dumps }
}

fn ms(v: &Value) -> u64 {
    v["ms"].as_u64().unwrap_or(u64::MAX)
}

/// Every rank's error names `culprit` as the rank at fault.
fn assert_all_name(job: &Job, culprit: usize, except: &[usize], limit_ms: u64) {
    for (r, res) in job.results.iter().enumerate() {
        if except.contains(&r) {
            continue;
        }
        assert_eq!(res["ok"], false, "rank {r} did not fail: {res}");
        let msg = res["msg"].as_str().unwrap();
        assert!(
            res["peer"].as_u64() == Some(culprit as u64)
                || msg.contains(&format!("rank {culprit}")),
            "rank {r}'s error does not name rank {culprit}: {res}"
        );
        assert!(ms(res) <= limit_ms, "rank {r} took {} ms: {res}", ms(res));
    }
}

fn kill_fault(provider: &str, count: usize, close_on_error: bool) {
    let job = launch(
        4,
        &[
            ("OXCCL_PROVIDER", provider),
            ("OXCCL_TIMEOUT", "5"),
            ("OXCCL_FAULT", "kill:rank=2,seq=3,after=1"),
        ],
        json!({ "count": count, "doomed": 2, "close_on_error": close_on_error }),
    );
    for (r, res) in job.results.iter().enumerate().filter(|(r, _)| *r != 2) {
        // A rank may still be finishing the call before when the news arrives.
        let call = res["call"].as_u64().unwrap();
        assert!(
            call == 3 || call == 2,
            "rank {r} failed in another call: {res}"
        );
        assert_eq!(res["kind"], "PeerFailed", "rank {r}: {res}");
    }
    // Detection well within the timeout (5 s) plus a second.
    assert_all_name(&job, 2, &[2], 6000);
    // The failure dumps (OXCCL_DEBUG_DUMP is set): the survivors' call #3 failed, waiting on 2.
    for r in [0, 1, 3] {
        let d = job.dumps[r]
            .as_ref()
            .unwrap_or_else(|| panic!("rank {r} wrote no dump"));
        let e = d["entries"]
            .as_array()
            .unwrap()
            .iter()
            .rfind(|e| e["coll"] == "all_reduce")
            .unwrap();
        assert_eq!(e["seq"], job.results[r]["call"], "rank {r}: {e}");
        assert_eq!(e["state"], "failed", "rank {r}: {e}");
        assert_eq!(e["waiting_on"], 2, "rank {r}: {e}");
    }
}

#[test]
fn kill_fault_names_the_dead_rank_shm() {
    kill_fault("shm", LARGE, false);
}

/// Survivors that close their communicator as soon as they fail must not be blamed by those
/// still waiting: the failure notice they sent first is read before their connection closes.
#[test]
fn survivors_that_close_at_once_are_not_blamed_tcp() {
    for _ in 0..3 {
        kill_fault("tcp", LARGE, true);
    }
}

#[test]
fn survivors_that_close_at_once_are_not_blamed_shm() {
    for _ in 0..3 {
        kill_fault("shm", LARGE, true);
    }
}

#[test]
fn kill_fault_names_the_dead_rank_small_shm() {
    kill_fault("shm", SMALL, false);
}

#[test]
fn kill_fault_names_the_dead_rank_tcp() {
    kill_fault("tcp", LARGE, false);
}

/// A stopped rank: the others time out naming the call, themselves, the peer, the step and
/// the bytes; then it is continued, they abort, and it returns at once.
fn stop_then_abort(provider: &str, count: usize) {
    let job = launch(
        4,
        &[
            ("OXCCL_PROVIDER", provider),
            ("OXCCL_TIMEOUT", "30"),
            ("OXCCL_FAULT", "stop:rank=1,seq=2"),
        ],
        json!({ "count": count, "set_timeout_ms": 2000, "cont_after_timeout": true, "stopped": 1 }),
    );
    for r in [0, 2, 3] {
        let res = &job.results[r];
        assert_eq!(res["kind"], "Timeout", "rank {r}: {res}");
        assert_eq!(res["seq"], 2, "rank {r}: {res}");
        assert!(res["peer"].is_u64(), "rank {r} names no peer: {res}");
        let msg = res["msg"].as_str().unwrap();
        for want in [
            format!("rank {r}: all_reduce #2"),
            "step ".into(),
            "bytes had arrived".into(),
        ] {
            assert!(msg.contains(&want), "rank {r}: {want:?} missing in {msg}");
        }
        // set_timeout (2 s) governs, not OXCCL_TIMEOUT (30 s); within a second of it.
        assert!((1900..=3000).contains(&ms(res)), "rank {r}: {res}");
        let d = job.dumps[r].as_ref().expect("a timeout dumps");
        assert_eq!(d["reason"], "timeout");
        let e = d["entries"].as_array().unwrap().last().unwrap();
        assert_eq!(
            (e["seq"].as_u64(), e["state"].as_str()),
            (Some(2), Some("failed"))
        );
        assert!(e["waiting"].as_str().unwrap().contains("rank"), "{e}");
    }
    // Rank 1 sees the abort after SIGCONT, quickly.
    let res = &job.results[1];
    assert!(
        matches!(res["kind"].as_str(), Some("Aborted" | "PeerFailed")),
        "rank 1: {res}"
    );
    let cont = res["cont_ns"].as_u64().expect("rank 0 continued rank 1");
    let after = res["at_ns"].as_u64().unwrap().saturating_sub(cont) / 1_000_000;
    assert!(
        after <= 2000,
        "rank 1 returned {after} ms after SIGCONT: {res}"
    );
    println!("{provider}: stopped rank returned {after} ms after SIGCONT");
}

#[test]
fn stopped_rank_times_out_the_others_then_abort_releases_all_shm() {
    stop_then_abort("shm", LARGE);
}

#[test]
fn stopped_rank_times_out_the_others_then_abort_releases_all_small_tcp() {
    stop_then_abort("tcp", SMALL);
}

/// The watchdog turns a stuck call into an abort long before the call's own timeout.
#[test]
fn watchdog_aborts_a_stuck_call_and_dumps() {
    let job = launch(
        3,
        &[
            ("OXCCL_TIMEOUT", "60"),
            ("OXCCL_WATCHDOG", "1"),
            ("OXCCL_WATCHDOG_TIMEOUT", "1"),
            ("OXCCL_FAULT", "stop:rank=2,seq=2"),
        ],
        json!({ "count": LARGE, "cont_after_timeout": true, "stopped": 2 }),
    );
    for r in [0, 1] {
        let res = &job.results[r];
        assert!(
            matches!(res["kind"].as_str(), Some("Aborted")),
            "rank {r}: {res}"
        );
        assert!(ms(res) <= 3000, "rank {r}: {res}");
        let d = job.dumps[r].as_ref().expect("the watchdog dumps");
        // The first to fire dumps as "watchdog"; a rank aborted by a peer first as "abort".
        assert!(
            matches!(d["reason"].as_str(), Some("watchdog" | "abort")),
            "rank {r}: {d}"
        );
    }
    assert!(
        job.results[..2]
            .iter()
            .any(|r| r["msg"].as_str().unwrap().contains("watchdog")),
        "{:?}",
        job.results
    );
    let res = &job.results[2];
    assert!(
        matches!(res["kind"].as_str(), Some("Aborted" | "PeerFailed")),
        "rank 2: {res}"
    );
}

/// `OXCCL_WATCHDOG=exit`: the stuck rank's process dumps, tells its peers and ends itself with
/// `abort()` (SIGABRT), as torch's async error handling does.
#[test]
fn watchdog_exit_ends_the_process_after_telling_the_peers() {
    let job = launch(
        2,
        &[
            ("OXCCL_TIMEOUT", "60"),
            ("OXCCL_WATCHDOG", "exit"),
            ("OXCCL_WATCHDOG_TIMEOUT", "1"),
            ("OXCCL_FAULT", "delay:rank=1,seq=2,ms=3000"),
        ],
        json!({ "count": LARGE, "doomed": 0, "doomed_signal": 6, "no_watchdog_rank": 1 }),
    );
    let d = job.dumps[0]
        .as_ref()
        .expect("the watchdog dumped before exiting");
    assert_eq!(d["reason"], "watchdog", "{d}");
    let e = d["entries"].as_array().unwrap().last().unwrap();
    assert_eq!(
        (e["seq"].as_u64(), e["coll"].as_str()),
        (Some(2), Some("all_reduce")),
        "{e}"
    );
    // Rank 1 (no watchdog) hears of it when it wakes.
    let r1 = &job.results[1];
    assert_eq!(r1["ok"], false, "{r1}");
    assert!(ms(r1) <= 4500, "{r1}");
}

/// A cut connection: both ends name each other, the others hear of it.
fn dropped_connection(provider: &str) {
    let job = launch(
        4,
        &[
            ("OXCCL_PROVIDER", provider),
            ("OXCCL_TIMEOUT", "5"),
            ("OXCCL_FAULT", "drop:rank=1,peer=2,seq=2"),
        ],
        json!({ "count": LARGE }),
    );
    let r1 = &job.results[1];
    assert_eq!(
        (r1["kind"].as_str(), r1["peer"].as_u64()),
        (Some("PeerFailed"), Some(2)),
        "{r1}"
    );
    let r2 = &job.results[2];
    assert_eq!(
        (r2["kind"].as_str(), r2["peer"].as_u64()),
        (Some("PeerFailed"), Some(1)),
        "{r2}"
    );
    for res in &job.results {
        assert_eq!(res["ok"], false, "{res}");
        assert!(ms(res) <= 6000, "{res}");
    }
}

#[test]
fn dropped_connection_is_named_on_both_sides_shm() {
    dropped_connection("shm");
}

#[test]
fn dropped_connection_is_named_on_both_sides_tcp() {
    dropped_connection("tcp");
}

/// A stall shorter than the timeout only delays; a longer one is a timeout naming the peer.
#[test]
fn delayed_sends_are_harmless_or_time_out_naming_the_sender() {
    let job = launch(
        3,
        &[
            ("OXCCL_TIMEOUT", "10"),
            ("OXCCL_FAULT", "delay:rank=0,peer=1,seq=2,ms=300"),
        ],
        json!({ "count": SMALL, "calls": 4 }),
    );
    for res in &job.results {
        assert_eq!(res["ok"], true, "{res}");
    }
    let job = launch(
        2,
        &[
            ("OXCCL_TIMEOUT", "1"),
            ("OXCCL_FAULT", "delay:rank=0,peer=1,seq=2,ms=2500"),
        ],
        json!({ "count": LARGE, "calls": 3 }),
    );
    let r1 = &job.results[1];
    assert_eq!(r1["kind"], "Timeout", "{r1}");
    assert_eq!(r1["peer"], 0, "{r1}");
    assert_eq!(r1["seq"], 2, "{r1}");
}

fn corrupt(count: usize) {
    let job = launch(
        4,
        &[
            ("OXCCL_TIMEOUT", "5"),
            ("OXCCL_FAULT", "corrupt:rank=2,peer=3,seq=2"),
        ],
        json!({ "count": count }),
    );
    let r3 = &job.results[3];
    assert_eq!(
        (r3["kind"].as_str(), r3["peer"].as_u64()),
        (Some("PeerFailed"), Some(2)),
        "{r3}"
    );
    assert!(r3["msg"].as_str().unwrap().contains("damaged"), "{r3}");
    assert_all_name(&job, 2, &[2], 6000);
    assert_eq!(job.results[2]["ok"], false);
}

#[test]
fn corrupted_header_is_reported_naming_the_sender() {
    corrupt(LARGE);
}

#[test]
fn corrupted_mailbox_header_is_reported_naming_the_sender() {
    corrupt(SMALL);
}

/// A registration that fails: that rank says why, the others learn at once that it failed.
#[test]
fn refused_registration_fails_the_call_and_tells_the_peers() {
    let job = launch(
        4,
        &[
            ("OXCCL_TIMEOUT", "20"),
            ("OXCCL_FAULT", "refuse_reg:rank=1,seq=2"),
        ],
        json!({ "count": LARGE }),
    );
    let r1 = &job.results[1];
    assert_eq!(r1["kind"], "Verbs", "{r1}");
    assert!(
        r1["msg"]
            .as_str()
            .unwrap()
            .contains("refused by fault injection"),
        "{r1}"
    );
    // Long before the 20 s timeout.
    assert_all_name(&job, 1, &[1], 3000);
}

/// Once a peer is known dead, a later call fails at once naming it, even one that would not
/// talk to it.
#[test]
fn calls_after_a_death_fail_at_once() {
    let job = launch(
        3,
        &[
            ("OXCCL_TIMEOUT", "20"),
            ("OXCCL_FAULT", "kill:rank=2,seq=2"),
        ],
        json!({ "count": SMALL, "doomed": 2 }),
    );
    assert_all_name(&job, 2, &[2], 3000);
}

/// Nine sub-communicators made and destroyed one after the other (watchdog on, one aborted): no
/// thread and no descriptor is left behind, on shm and tcp.
#[test]
fn destroyed_communicators_leave_no_threads_or_descriptors() {
    for provider in ["shm", "tcp"] {
        let outs = run_ranks(3, &[("OXCCL_PROVIDER", provider)], "cycles", &json!({}));
        for (r, res) in expect_results("cycles", &outs).iter().enumerate() {
            assert_eq!(
                res["threads"][0], res["threads"][1],
                "{provider} rank {r}: {res}"
            );
            assert_eq!(res["fds"][0], res["fds"][1], "{provider} rank {r}: {res}");
        }
    }
}

/// `SIGUSR1` dumps the recorder: every call with its number, kind, count, type and state.
#[test]
fn sigusr1_dumps_the_flight_recorder() {
    let dir = common::TempDir::new("faults-sigusr1");
    let prefix = format!("{}/dump-", dir.0.display());
    let outs = run_ranks(
        2,
        &[("OXCCL_DEBUG_DUMP", &prefix)],
        "signal_dump",
        &json!({}),
    );
    let results = expect_results("signal_dump", &outs);
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res["destroy"], "Ok(())", "rank {r}");
        let d: Value = serde_json::from_str(res["dump"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("rank {r}: {e}: {res}"));
        assert_eq!(d["oxccl_flight_recorder"], oxccl::DUMP_VERSION);
        assert_eq!(d["reason"], "signal");
        assert_eq!(d["rank"], r);
        let got: Vec<(u64, &str, u64, &str, &str)> = d["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["seq"].as_u64().unwrap(),
                    e["coll"].as_str().unwrap(),
                    e["count"].as_u64().unwrap(),
                    e["dtype"].as_str().unwrap(),
                    e["state"].as_str().unwrap(),
                )
            })
            .collect();
        let want = vec![
            (0, "barrier", 0, "uint8", "completed"),
            (1, "all_reduce", 4096, "int32", "completed"),
            (2, "all_reduce", 4096, "int32", "completed"),
            (3, "all_reduce", 4096, "int32", "completed"),
            (4, "broadcast", 100, "uint8", "completed"),
        ];
        assert_eq!(got, want, "rank {r}");
        let c = &d["communicators"][0];
        assert_eq!(
            (c["last_started"].as_u64(), c["last_completed"].as_u64()),
            (Some(4), Some(4))
        );
        assert_eq!(d["entries"][4]["root"], 1);
    }
}
