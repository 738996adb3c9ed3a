//! Kill during init (issue 32, item 6, the init column), by real processes: 3 ranks start a
//! job with [`Communicator::init_config_async`] (join included); `OXCCL_FAULT=kill:rank=V,
//! init=STAGE` SIGKILLs rank V at a stage of its init, both chosen by a seeded generator
//! (the seed is printed; `OXCCL_CHAOS_SEED` replays it). Every survivor must end within a
//! bound with a clear error naming the dead rank (or with a working communicator whose
//! checked all-reduce then fails naming it): no hang, no wrong result. Over shm on this host,
//! and over tcp with each rank in a network namespace of an `oxccl-testbed` test bed (root;
//! under `CI=true` a missing prerequisite fails the test).
//!
//! Environment: `OXCCL_INIT_CHAOS_TRIALS` (trials per transport, default 20),
//! `OXCCL_CHAOS_SEED`, `OXCCL_INIT_CHAOS_STAGES` (comma-separated stages to choose from,
//! default all).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl::{Communicator, InitStage, ReduceOp};
use oxccl_testbed::{HostSpec, Testbed};
use serde_json::{Value, json};

use common::{error_kind, mix, report, spawn_job};

/// Ranks of every job.
const N: usize = 3;
/// `OXCCL_TIMEOUT` and `OXCCL_BOOTSTRAP_TIMEOUT` of the jobs, seconds.
const TIMEOUT_S: u64 = 2;
/// How long a survivor may take from its start to its error: the join's and init's timeouts,
/// the tcp queue pairs' own connect timeout (5 s: an active end retries a refused connect
/// that long), and the rank serving the store waiting for the others to read its failure
/// notice, plus slack for two shared cores.
const BOUND: Duration = Duration::from_secs(2 * TIMEOUT_S + 5 + 5);

static SERIAL: Mutex<()> = Mutex::new(());

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "init" => init_scenario(args),
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

struct Rng(u64);

impl Rng {
    fn from_env(test: &str) -> Rng {
        let seed = std::env::var("OXCCL_CHAOS_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                let mut b = [0u8; 8];
                getrandom::fill(&mut b).expect("getrandom");
                u64::from_le_bytes(b)
            });
        println!("{test}: seed {seed} (replay with OXCCL_CHAOS_SEED={seed})");
        Rng(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix(self.0) % n
    }
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
            Some(false) if names(msg, victim) => {}
            Some(false) => fails.push(format!(
                "rank {r}'s error does not name rank {victim}: {msg}"
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
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let trials: usize = std::env::var("OXCCL_INIT_CHAOS_TRIALS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let stages: Vec<InitStage> = match std::env::var("OXCCL_INIT_CHAOS_STAGES") {
        Ok(s) if !s.trim().is_empty() => s.split(',').map(|x| x.parse().unwrap()).collect(),
        _ => InitStage::ALL.to_vec(),
    };
    let mut rng = Rng::from_env(test);
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
fn names_finds_single_ranks_and_lists() {
    assert!(names("rank 2 failed: x", 2));
    assert!(!names("rank 12 failed", 1));
    assert!(names("waiting for ranks [0, 2] of 3", 2));
    assert!(!names("waiting for ranks [0, 12] of 13", 2));
}
