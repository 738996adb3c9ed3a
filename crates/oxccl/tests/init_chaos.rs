//! Kill during init (issue 32, item 6, the init column), by real processes: 3 ranks start a
//! job with [`Communicator::init_config_async`] (join included); `OXCCL_FAULT=kill:rank=V,
//! init=STAGE` SIGKILLs rank V at a stage of its init, both chosen by a seeded generator
//! (the seed is printed; `OXCCL_CHAOS_SEED` replays it). Every survivor must end within a
//! bound with a clear error naming the dead rank (or with a working communicator whose
//! checked all-reduce then fails naming it): no hang, no wrong result. Over shm on this host,
//! and over tcp with each rank in a network namespace of an `oxccl-testbed` test bed (root;
//! under `CI=true` a missing prerequisite fails the test).
//!
//! Abort with a rank stopped (SIGSTOP) at a stage of its init: the aborted rank returns
//! within 300 ms with `Error::Aborted` saying what it waited for, and the other rank ends
//! naming the aborted or the stopped rank. Prints the latencies per stage.
//!
//! Environment: `OXCCL_INIT_CHAOS_TRIALS` (trials per transport, default 20),
//! `OXCCL_CHAOS_SEED`, `OXCCL_INIT_CHAOS_STAGES` (comma-separated stages to choose from,
//! default all).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use oxccl::{Communicator, InitStage, ReduceOp};
use oxccl_testbed::{HostSpec, Testbed};
use serde_json::{Value, json};

use common::{RankOutput, Rng, error_kind, report, spawn_job};

/// Ranks of every job.
const N: usize = 3;
/// `OXCCL_TIMEOUT` and `OXCCL_BOOTSTRAP_TIMEOUT` of the jobs, seconds.
const TIMEOUT_S: u64 = 2;
/// How long a survivor may take from its start to its error: the join's and init's timeouts,
/// the tcp queue pairs' own connect timeout (5 s: an active end retries a refused connect
/// that long), and the rank serving the store waiting for the others to read its failure
/// notice, plus slack for two shared cores.
const BOUND: Duration = Duration::from_secs(2 * TIMEOUT_S + 5 + 5);

/// The abort trials (timed tightly) run alone: they take this for writing, the kill chaos for
/// reading.
static SERIAL: RwLock<()> = RwLock::new(());
/// One kill chaos per transport at a time; the shm and the tcp chaos may overlap (their
/// bound leaves room for that).
static SHM: Mutex<()> = Mutex::new(());
static BED: Mutex<()> = Mutex::new(());

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "init" => init_scenario(args),
        "abort" => abort_scenario(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// Inits (the fault kills the victim on the way), then, if init succeeded, a checked
/// all-reduce. Reports the outcome and the seconds it took.
fn init_scenario(args: &Value) -> Value {
    let (rank, n) = common::env_rank();
    if args["victim"].as_u64() == Some(rank as u64) {
        // It will not get to say so.
        common::mark_done();
    }
    let t0 = Instant::now();
    let config = oxccl_bootstrap::Config::from_env().unwrap();
    let opts = oxccl::Options::from_env().unwrap();
    let r = Communicator::init_config_async(config, opts).wait();
    let secs = t0.elapsed().as_secs_f64();
    let comm = match r {
        Ok(c) => c,
        Err(e) => {
            return json!({ "ok": false, "stage": "init", "kind": error_kind(&e),
                           "msg": e.to_string(), "secs": secs });
        }
    };
    let mut v: Vec<f32> = (0..1000).map(|i| (i + rank) as f32).collect();
    let r = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
    let secs = t0.elapsed().as_secs_f64();
    match r {
        Err(e) => json!({ "ok": false, "stage": "all_reduce", "kind": error_kind(&e),
                          "msg": e.to_string(), "secs": secs }),
        Ok(()) => {
            let right = v
                .iter()
                .enumerate()
                .all(|(i, x)| *x == (0..n).map(|r| (i + r) as f32).sum::<f32>());
            json!({ "ok": true, "right": right, "secs": secs })
        }
    }
}

/// Rank 2 stops itself (SIGSTOP) at a stage of its init; rank 1 aborts its own init
/// `abort_ms` after starting it; rank 0 just waits. Each reports its error and when it
/// returned (`CLOCK_REALTIME`), rank 1 also when it aborted.
fn abort_scenario(args: &Value) -> Value {
    let (rank, _) = common::env_rank();
    if rank == 2 {
        common::mark_done();
    }
    let config = oxccl_bootstrap::Config::from_env().unwrap();
    let opts = oxccl::Options::from_env().unwrap();
    let p = Communicator::init_config_async(config, opts);
    let mut at_ns = Value::Null;
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(args["abort_ms"].as_u64().unwrap()));
        at_ns = json!(common::realtime_ns());
        p.abort_handle().abort_with("the test aborted rank 1");
    }
    let r = p.wait();
    let end_ns = common::realtime_ns();
    json!({ "ok": r.is_ok(), "msg": r.err().map(|e| e.to_string()), "at_ns": at_ns,
            "end_ns": end_ns })
}

/// Whether `msg` (a survivor's error) names rank `v`: "rank V" (not followed by a digit), or
/// V in a list "ranks [..]".
fn names(msg: &str, v: usize) -> bool {
    let one = format!("rank {v}");
    let single = msg.match_indices(&one).any(|(at, _)| {
        !msg[at + one.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    });
    let listed = msg.match_indices("ranks [").any(|(at, m)| {
        let rest = &msg[at + m.len()..];
        rest.split(']').next().is_some_and(|l| {
            l.split(',')
                .any(|x| x.trim().parse::<usize>().ok() == Some(v))
        })
    });
    single || listed
}

/// Whether the error `msg` of survivor `r` names another survivor that itself failed with an
/// error naming `victim`: a cascade (rank 0, which serves the store, is killed; rank 1 loses the
/// store and exits; rank 2, connecting, then finds rank 1's memory gone), where `r` met the
/// victim's death through that rank first.
fn failed_of(outs: &[RankOutput], r: usize, msg: &str, victim: usize) -> bool {
    outs.iter()
        .filter(|q| q.rank != r && q.rank != victim && q.ok() && names(msg, q.rank))
        .any(|q| {
            let res = q.result();
            res["ok"].as_bool() == Some(false) && names(res["msg"].as_str().unwrap_or(""), victim)
        })
}

/// One trial: what went wrong (empty: it ended cleanly) and each survivor's seconds and error
/// kind.
fn trial(
    tb: Option<&Testbed>,
    victim: usize,
    stage: InitStage,
) -> (Vec<String>, Vec<(f64, String)>) {
    let timeout = TIMEOUT_S.to_string();
    let fault = format!("kill:rank={victim},init={}", stage.name());
    let provider = if tb.is_some() { "tcp" } else { "shm" };
    let master = tb.map(|t| t.host_addr(0).to_string());
    let mut env = vec![
        ("OXCCL_PROVIDER", provider),
        ("OXCCL_TIMEOUT", &timeout),
        ("OXCCL_BOOTSTRAP_TIMEOUT", &timeout),
        ("OXCCL_FAULT", &fault),
    ];
    if let Some(m) = &master {
        env.push(("MASTER_ADDR", m));
    }
    let args = json!({ "victim": victim });
    let job = spawn_job(N, &env, "init", &args, &|rank, exe| match tb {
        Some(t) => t.command(rank, exe),
        None => Command::new(exe),
    });
    let outs = job.finish(BOUND + Duration::from_secs(10));
    let mut fails = Vec::new();
    let mut secs = Vec::new();
    if outs[victim].status.and_then(|s| s.signal()) != Some(libc::SIGKILL) {
        fails.push(format!(
            "rank {victim} was not killed at {}: {:?}",
            stage.name(),
            outs[victim].status
        ));
    }
    for o in outs.iter().filter(|o| o.rank != victim) {
        let r = o.rank;
        if !o.ok() {
            fails.push(format!(
                "rank {r} did not exit with one result (hung or crashed): {:?}",
                o.status
            ));
            continue;
        }
        let res = o.result();
        let s = res["secs"].as_f64().unwrap_or(f64::NAN);
        secs.push((s, res["kind"].as_str().unwrap_or("none").to_string()));
        eprintln!(
            "  rank {r} after {s:.2} s: {}",
            res["msg"].as_str().unwrap_or("(no error)")
        );
        if s > BOUND.as_secs_f64() {
            fails.push(format!("rank {r} took {s:.2} s (bound {BOUND:?})"));
        }
        let msg = res["msg"].as_str().unwrap_or("");
        match res["ok"].as_bool() {
            Some(false) if names(msg, victim) || failed_of(&outs, r, msg, victim) => {}
            Some(false) => fails.push(format!(
                "rank {r}'s error names neither rank {victim} nor a rank that failed of it: {msg}"
            )),
            _ => fails.push(format!(
                "rank {r}'s all-reduce succeeded with rank {victim} dead: {res}"
            )),
        }
    }
    if !fails.is_empty() {
        fails = vec![format!(
            "victim {victim} at {}: {}{}",
            stage.name(),
            fails.join("; "),
            report(&outs)
        )];
    }
    (fails, secs)
}

fn init_chaos(test: &str, tb: Option<&Testbed>) {
    let _all = SERIAL.read().unwrap_or_else(|e| e.into_inner());
    let _mine = if tb.is_some() { &BED } else { &SHM }
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let trials: usize = std::env::var("OXCCL_INIT_CHAOS_TRIALS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let stages: Vec<InitStage> = match std::env::var("OXCCL_INIT_CHAOS_STAGES") {
        Ok(s) if !s.trim().is_empty() => s.split(',').map(|x| x.parse().unwrap()).collect(),
        _ => InitStage::ALL.to_vec(),
    };
    let mut rng = Rng::from_env(test, "OXCCL_CHAOS_SEED");
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut clean = 0;
    // Per stage: trials, the survivors' worst seconds, their error kinds.
    let mut table: BTreeMap<usize, (usize, f64, BTreeSet<String>)> = BTreeMap::new();
    for t in 0..trials {
        let victim = rng.below(N as u64) as usize;
        let stage = stages[rng.below(stages.len() as u64) as usize];
        let si = InitStage::ALL.iter().position(|s| *s == stage).unwrap();
        let (f, secs) = trial(tb, victim, stage);
        let worst = secs.iter().map(|s| s.0).fold(0.0, f64::max);
        eprintln!(
            "{test}: trial {t}: kill rank {victim} at {}: {} (survivors' worst {worst:.2} s)",
            stage.name(),
            if f.is_empty() { "clean" } else { "FAILED" }
        );
        let e = table.entry(si).or_default();
        e.0 += 1;
        e.1 = e.1.max(worst);
        e.2.extend(secs.into_iter().map(|s| s.1));
        if f.is_empty() {
            clean += 1;
        }
        failures.extend(f);
    }
    let transport = if tb.is_some() {
        "tcp across namespace hosts"
    } else {
        "shm"
    };
    println!(
        "{:<10} {:>6} {:>16}  survivors' error kinds",
        "stage", "trials", "worst survivor s"
    );
    for (si, (n, w, kinds)) in &table {
        let kinds: Vec<&str> = kinds.iter().map(String::as_str).collect();
        println!(
            "{:<10} {n:>6} {w:>16.2}  {}",
            InitStage::ALL[*si].name(),
            kinds.join(",")
        );
    }
    println!(
        "init chaos: {clean}/{trials} trials ended cleanly over {transport} ({N} ranks, \
         OXCCL_TIMEOUT={TIMEOUT_S}, bound {BOUND:?}), {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{test}: {} trial(s) failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn kill_a_rank_during_init_shm() {
    init_chaos("kill_a_rank_during_init_shm", None);
}

#[test]
fn kill_a_rank_during_init_tcp_netns() {
    let name = "kill_a_rank_during_init_tcp_netns";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); N]).expect("creating the test bed");
    init_chaos(name, Some(&tb));
}

#[test]
fn a_cascade_through_a_rank_that_failed_of_the_victim_is_followed() {
    let out = |rank: usize, msg: &str| RankOutput {
        rank,
        status: Some(std::process::ExitStatus::from_raw(0)),
        stdout: String::new(),
        stderr: String::new(),
        results: vec![json!({ "ok": false, "msg": msg })],
        elapsed: Duration::ZERO,
    };
    let outs = [
        out(
            1,
            "bootstrap: the store went away; rank 0 serves it and exited or was killed",
        ),
        out(
            2,
            "rank 2: posting receives for rank 1: remote access refused",
        ),
    ];
    // Rank 2 names rank 1, which failed naming the victim, rank 0.
    assert!(failed_of(
        &outs,
        2,
        outs[1].result()["msg"].as_str().unwrap(),
        0
    ));
    // Not when the named rank's error does not name the victim, nor through the victim itself.
    let other = [
        out(1, "rank 1: something else"),
        out(
            2,
            "rank 2: posting receives for rank 1: remote access refused",
        ),
    ];
    assert!(!failed_of(&other, 2, "posting receives for rank 1", 0));
    assert!(!failed_of(&outs, 1, "rank 1 and nothing else", 0));
}

#[test]
fn names_finds_single_ranks_and_lists() {
    assert!(names("rank 2 failed: x", 2));
    assert!(!names("rank 12 failed", 1));
    assert!(names("waiting for ranks [0, 2] of 3", 2));
    assert!(!names("waiting for ranks [0, 12] of 13", 2));
}

/// Rank 2 stops at `stage`; rank 1 aborts 500 ms into its init: it must return within
/// `ABORT_BOUND` with `Error::Aborted` saying what it waited for, and rank 0 must end with an
/// error naming rank 1 or rank 2 within its timeouts. Returns the failures and a line of
/// figures.
fn abort_trial(tb: Option<&Testbed>, stage: InitStage) -> (Vec<String>, String) {
    const ABORT_BOUND: Duration = Duration::from_millis(300);
    // Both timeouts far above the abort's 500 ms. The bootstrap's is the lower one because
    // rank 0, serving the store, waits min(it, 5 s) for the stopped rank 2 to read the failure
    // notice before it returns: at 10 s, each hello, links or stored trial waited those 5 s.
    let timeout = "10".to_string();
    let boot_timeout = "3".to_string();
    let fault = format!("stop:rank=2,init={}", stage.name());
    let provider = if tb.is_some() { "tcp" } else { "shm" };
    let master = tb.map(|t| t.host_addr(0).to_string());
    let mut env = vec![
        ("OXCCL_PROVIDER", provider),
        ("OXCCL_TIMEOUT", &timeout),
        ("OXCCL_BOOTSTRAP_TIMEOUT", &boot_timeout),
        ("OXCCL_FAULT", &fault),
    ];
    if let Some(m) = &master {
        env.push(("MASTER_ADDR", m));
    }
    let args = json!({ "abort_ms": 500 });
    let job = spawn_job(N, &env, "abort", &args, &|rank, exe| match tb {
        Some(t) => t.command(rank, exe),
        None => Command::new(exe),
    });
    // Rank 2 stays stopped: wait for ranks 0 and 1 only, then kill it.
    let mut job = job;
    let deadline = Instant::now() + Duration::from_secs(25);
    job.wait_until(deadline, |j| j.exited(0).is_some() && j.exited(1).is_some());
    let outs = job.finish(Duration::ZERO);
    let mut fails = Vec::new();
    let (Some(r1), Some(r0)) = (
        outs[1].ok().then(|| outs[1].result().clone()),
        outs[0].ok().then(|| outs[0].result().clone()),
    ) else {
        return (
            vec![format!(
                "stage {}: rank 0 or 1 did not report{}",
                stage.name(),
                report(&outs)
            )],
            String::new(),
        );
    };
    let at = r1["at_ns"].as_u64().unwrap_or(0);
    let ms = |end: &Value| (end.as_u64().unwrap_or(0).saturating_sub(at)) as f64 / 1e6;
    let (took1, took0) = (ms(&r1["end_ns"]), ms(&r0["end_ns"]));
    let m1 = r1["msg"].as_str().unwrap_or("");
    let m0 = r0["msg"].as_str().unwrap_or("");
    let what = m1.contains(", while ") || m1.contains("in its first calls over the connections");
    if !(m1.starts_with("rank 1: init aborted: ") && m1.contains("the test aborted rank 1") && what)
    {
        fails.push(format!("rank 1's error is not its abort: {m1:?}"));
    }
    if took1 > ABORT_BOUND.as_secs_f64() * 1e3 {
        fails.push(format!("rank 1 returned {took1:.1} ms after its abort"));
    }
    if !(names(m0, 1) || names(m0, 2)) {
        fails.push(format!("rank 0's error names neither rank 1 nor 2: {m0:?}"));
    }
    let line = format!(
        "{:<8} {:>9.1} {:>9.1}  rank 1: {m1}\n{:<28}rank 0: {m0}",
        stage.name(),
        took1,
        took0,
        ""
    );
    if !fails.is_empty() {
        fails = vec![format!(
            "abort with rank 2 stopped at {}: {}{}",
            stage.name(),
            fails.join("; "),
            report(&outs)
        )];
    }
    (fails, line)
}

fn abort_trials(test: &str, tb: Option<&Testbed>, stages: &[InitStage]) {
    let _g = SERIAL.write().unwrap_or_else(|e| e.into_inner());
    let mut failures = Vec::new();
    println!("\n{test}: rank 2 stopped at a stage, rank 1 aborted 500 ms in (ms after the abort)");
    println!("{:<8} {:>9} {:>9}", "stage", "rank 1", "rank 0");
    for &st in stages {
        let (f, line) = abort_trial(tb, st);
        println!("{line}");
        failures.extend(f);
    }
    assert!(
        failures.is_empty(),
        "{test}: {} failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn abort_while_a_rank_is_stopped_in_init_shm() {
    use InitStage::*;
    abort_trials(
        "abort_while_a_rank_is_stopped_in_init_shm",
        None,
        &[Hello, Links, Stored, Barrier],
    );
}

#[test]
fn abort_while_a_rank_is_stopped_in_init_tcp_netns() {
    let name = "abort_while_a_rank_is_stopped_in_init_tcp_netns";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped(); N]).expect("creating the test bed");
    use InitStage::*;
    abort_trials(name, Some(&tb), &[Hello, Connect, Stored, Barrier]);
}
