//! Random kill points in shrink and grow, by real processes, over shm on this host and over
//! tcp across the hosts (network namespaces) of an `oxccl-testbed` test bed:
//!
//! - **shrink**: 4 ranks loop checked all-reduces; an injected fault kills a random rank (not
//!   rank 0, which serves the store) at a random call and step; in half the trials a second
//!   rank dies during the shrink, at the injected kill point after the decision or a random
//!   moment after it starts to shrink. The survivors shrink (again, when the new communicator
//!   fails too) until a checked all-reduce succeeds.
//! - **grow**: 3 members admit a newcomer; a random one of them dies: a member at the injected
//!   kill point after the decision, or a random moment into the grow; the newcomer a random
//!   moment into its join; or nobody. Members whose grow failed check the communicator they
//!   had, and shrink it when that fails.
//!
//! Every survivor must end, within a bound set by the timeout, in a communicator whose
//! all-reduce matches the sums computed from its members' identities, or with a clear error
//! (one of the failure kinds, its message naming a rank). No survivor hangs or is killed; no
//! result is wrong. The test prints the count. `OXCCL_ELASTIC_TRIALS` (default 20) sets the
//! trials per kind and transport, `OXCCL_ELASTIC_SEED` replays a run.

mod common;

use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl::{Communicator, Error, Options, ReduceOp};
use oxccl_bootstrap::{Bootstrap, Config, Secret, TcpStore};
use oxccl_testbed::{HostSpec, Testbed};
use serde_json::{Value, json};

use common::{Rng, error_kind, report, spawn_job};

/// `OXCCL_TIMEOUT` of every trial, in seconds.
const TIMEOUT_S: u64 = 2;
const COUNT: usize = 3_000;

/// One shm test at a time, and one test bed at a time (the beds would compete for
/// addresses); a shm test and a bed test may overlap: the trials mostly wait out timeouts,
/// and their bounds leave room for that.
static SHM: Mutex<()> = Mutex::new(());
static BED: Mutex<()> = Mutex::new(());

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "elastic" => elastic(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

fn value(p: usize, i: usize) -> f32 {
    (i % 7 + 3 * p + 1) as f32
}

fn die_in(ms: u64) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(ms));
        // SAFETY: raise has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    });
}

fn err_json(e: &Error) -> Value {
    json!({ "kind": error_kind(e), "msg": e.to_string() })
}

/// All-gathers the process indices, all-reduces, and checks the sums; the indices.
fn checked(comm: &Communicator, me: usize) -> Result<Vec<usize>, Error> {
    let mut ids = vec![0u64; comm.world_size()];
    comm.all_gather(&[me as u64], &mut ids)?;
    let ids: Vec<usize> = ids.into_iter().map(|x| x as usize).collect();
    let mut v: Vec<f32> = (0..COUNT).map(|i| value(me, i)).collect();
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    for (i, x) in v.iter().enumerate() {
        let want: f32 = ids.iter().map(|&p| value(p, i)).sum();
        // A wrong sum is the one outcome never allowed: fail the process loudly.
        assert_eq!(*x, want, "process {me}: element {i} (members {ids:?})");
    }
    Ok(ids)
}

/// Shrinks `comm` (after a failure) until a checked all-reduce succeeds, 3 times at most.
fn shrink_until_it_works(comm: &Communicator, me: usize, log: &mut Vec<Value>) -> Value {
    let mut cur: Option<Communicator> = None;
    for _ in 0..3 {
        let c = cur.as_ref().unwrap_or(comm);
        match c.shrink_after_failure() {
            Ok(s) => match checked(&s, me) {
                Ok(ids) => {
                    let out = json!({ "ok": true, "end": "shrunk", "ids": ids, "log": log });
                    std::mem::forget(s);
                    return out;
                }
                Err(e) => {
                    log.push(json!({ "shrunk_failed": err_json(&e) }));
                    cur = Some(s);
                }
            },
            Err(e) => return json!({ "ok": false, "error": err_json(&e), "log": log }),
        }
    }
    json!({ "ok": false, "error": { "kind": "gave up", "msg": "3 shrinks failed" }, "log": log })
}

fn member_comm(m: usize) -> Communicator {
    let mut config = Config::from_env().unwrap();
    config.world_size = m;
    let boot = Bootstrap::new(config).unwrap_or_else(|e| panic!("bootstrap: {e}"));
    Communicator::init(boot, Options::from_env().unwrap()).unwrap_or_else(|e| panic!("init: {e}"))
}

fn elastic(args: &Value) -> Value {
    let (me, _) = common::env_rank();
    let m = args["members"].as_u64().unwrap() as usize;
    let doomed: Vec<usize> = args["doomed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    if doomed.contains(&me) {
        // The others must not wait for this process to say it is done.
        common::mark_done();
    }
    let die_ms = args["die_ms"].as_u64();
    let t = Instant::now();
    let mut out = if args["kind"] == "shrink" {
        shrink_trial(args, me, m, die_ms)
    } else if me >= m {
        newcomer(me, die_ms.filter(|_| doomed.contains(&me)))
    } else {
        grow_trial(me, m, die_ms.filter(|_| doomed.contains(&me)))
    };
    out["ms"] = json!(t.elapsed().as_millis() as u64);
    out
}

fn shrink_trial(args: &Value, me: usize, m: usize, die_ms: Option<u64>) -> Value {
    let comm = member_comm(m);
    let mut log = Vec::new();
    let mut failed = false;
    for call in 0..12u32 {
        let mut v: Vec<f32> = (0..COUNT).map(|i| value(me, i) + call as f32).collect();
        if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            log.push(json!({ "call": call, "error": err_json(&e) }));
            failed = true;
            break;
        }
        let want: f32 = (0..m).map(|p| value(p, 0) + call as f32).sum();
        assert_eq!(v[0], want, "process {me}: call {call}");
    }
    if !failed {
        return json!({ "ok": false, "error": { "kind": "none", "msg": "no call failed" } });
    }
    if args["second"].as_u64() == Some(me as u64)
        && let Some(ms) = die_ms
    {
        die_in(ms);
    }
    let out = shrink_until_it_works(&comm, me, &mut log);
    std::mem::forget(comm);
    out
}

fn grow_trial(me: usize, m: usize, die_ms: Option<u64>) -> Value {
    let comm = member_comm(m);
    if let Err(e) = checked(&comm, me) {
        return json!({ "ok": false, "error": err_json(&e), "log": ["before the grow"] });
    }
    if let Some(ms) = die_ms {
        die_in(ms);
    }
    let mut log = Vec::new();
    let out = match comm.grow(1) {
        Ok(g) => match checked(&g, me) {
            Ok(ids) => {
                let out = json!({ "ok": true, "end": "grown", "ids": ids });
                std::mem::forget(g);
                out
            }
            Err(e) => json!({ "ok": false, "error": err_json(&e), "log": ["grown, then"] }),
        },
        Err(e) => {
            log.push(json!({ "grow": err_json(&e) }));
            // The communicator it had: still working, or (a member died) shrunk.
            match checked(&comm, me) {
                Ok(ids) => json!({ "ok": true, "end": "old", "ids": ids, "log": log }),
                Err(e) => {
                    log.push(json!({ "old": err_json(&e) }));
                    shrink_until_it_works(&comm, me, &mut log)
                }
            }
        }
    };
    std::mem::forget(comm);
    out
}

fn newcomer(me: usize, die_ms: Option<u64>) -> Value {
    let secret = Secret::new(std::env::var("OXCCL_SECRET").unwrap()).unwrap();
    let addr = format!(
        "{}:{}",
        std::env::var("MASTER_ADDR").unwrap(),
        std::env::var("MASTER_PORT").unwrap()
    );
    let mut opts = Options::from_env().unwrap();
    opts.faults = None;
    let store = match TcpStore::connect(&addr, &secret, Duration::from_secs(30)) {
        Ok(s) => s,
        Err(e) => return json!({ "ok": false, "error": { "kind": "store", "msg": e.to_string() } }),
    };
    if let Some(ms) = die_ms {
        die_in(ms);
    }
    let job = std::env::var("OXCCL_JOB_ID").unwrap();
    match Communicator::join(Box::new(store), &job, opts) {
        Ok(c) => {
            let out = match checked(&c, me) {
                Ok(ids) => json!({ "ok": true, "end": "joined", "ids": ids }),
                Err(e) => json!({ "ok": false, "error": err_json(&e) }),
            };
            std::mem::forget(c);
            out
        }
        Err(e) => json!({ "ok": false, "error": err_json(&e) }),
    }
}

// ------------------------------------------------------------------------------------------
// The parent

fn trials() -> usize {
    std::env::var("OXCCL_ELASTIC_TRIALS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(20)
}

/// One trial's plan: the processes, the fault, and who dies.
fn plan(kind: &str, rng: &mut Rng) -> (usize, Option<String>, Value) {
    if kind == "shrink" {
        let victim = rng.range(1, 3);
        let fault = format!(
            "kill:rank={victim},seq={},after={}",
            rng.range(2, 5),
            rng.range(0, 2)
        );
        let mut doomed = vec![victim];
        let mut args = json!({ "kind": "shrink", "members": 4 });
        let fault = match rng.range(0, 3) {
            0 | 1 => fault,
            2 => {
                let second = (victim % 3) + 1;
                doomed.push(second);
                format!("{fault};kill:rank={second},shrink=1")
            }
            _ => {
                let second = (victim % 3) + 1;
                doomed.push(second);
                args["second"] = json!(second);
                args["die_ms"] = json!(rng.range(0, 40));
                fault
            }
        };
        args["doomed"] = json!(doomed);
        return (4, Some(fault), args);
    }
    let mut args = json!({ "kind": "grow", "members": 3, "doomed": [] });
    let fault = match rng.range(0, 3) {
        0 => {
            let v = rng.range(1, 2);
            args["doomed"] = json!([v]);
            args["point"] = json!("member after the decision");
            Some(format!("kill:rank={v},grow=1"))
        }
        1 => {
            let v = rng.range(1, 2);
            args["doomed"] = json!([v]);
            args["die_ms"] = json!(rng.range(0, 60));
            args["point"] = json!("member during the grow");
            None
        }
        2 => {
            args["doomed"] = json!([3]);
            args["die_ms"] = json!(rng.range(0, 120));
            args["point"] = json!("newcomer during its join");
            None
        }
        _ => {
            args["point"] = json!("nobody");
            None
        }
    };
    (4, fault, args)
}

#[derive(Default)]
struct Tally {
    working: usize,
    errors: usize,
    kinds: std::collections::BTreeMap<String, usize>,
    slowest_ms: u64,
}

fn serial(lock: &'static Mutex<()>) -> std::sync::MutexGuard<'static, ()> {
    lock.lock().unwrap_or_else(|e| e.into_inner())
}

fn run_trials(test: &str, kind: &str, tb: Option<&Testbed>) {
    let mut rng = Rng::from_env(test, "OXCCL_ELASTIC_SEED");
    let n_trials = trials();
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    let timeout = TIMEOUT_S.to_string();
    // Every survivor ends within this: a grow's wait, a failed init, then up to three shrinks.
    let bound = Duration::from_secs(TIMEOUT_S * 6 + 8);
    for trial in 0..n_trials {
        let (n, fault, args) = plan(kind, &mut rng);
        let mut env: Vec<(&str, &str)> = vec![
            ("OXCCL_PROVIDER", if tb.is_some() { "tcp" } else { "shm" }),
            ("OXCCL_TIMEOUT", &timeout),
            ("OXCCL_BOOTSTRAP_TIMEOUT", "20"),
        ];
        let master = tb.map(|t| t.host_addr(0).to_string());
        if let Some(m) = &master {
            env.push(("MASTER_ADDR", m));
        }
        if let Some(f) = &fault {
            env.push(("OXCCL_FAULT", f));
        }
        let job = spawn_job(n, &env, "elastic", &args, &|p, exe| match tb {
            Some(t) => t.command(p, exe),
            None => Command::new(exe),
        });
        let outs = job.finish(bound + Duration::from_secs(10));
        let doomed: Vec<usize> = args["doomed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let what = format!("trial {trial} ({args}, fault {fault:?})");
        for (p, o) in outs.iter().enumerate() {
            if doomed.contains(&p) && o.status.is_some_and(|s| !s.success()) {
                continue; // it died, as planned
            }
            if doomed.contains(&p) && o.status.is_none() {
                failures.push(format!("{what}: doomed process {p} hung{}", report(&outs)));
                continue;
            }
            if !o.ok() {
                failures.push(format!(
                    "{what}: process {p} did not finish{}",
                    report(&outs)
                ));
                continue;
            }
            let r = o.result();
            let ms = r["ms"].as_u64().unwrap_or(u64::MAX);
            tally.slowest_ms = tally.slowest_ms.max(ms);
            if ms > bound.as_millis() as u64 {
                failures.push(format!("{what}: process {p} took {ms} ms: {r}"));
            }
            if r["ok"] == true {
                tally.working += 1;
                *tally
                    .kinds
                    .entry(format!("ended {}", r["end"]))
                    .or_default() += 1;
                continue;
            }
            let kind = r["error"]["kind"].as_str().unwrap_or("");
            let msg = r["error"]["msg"].as_str().unwrap_or("");
            let clear = [
                "Shrink",
                "Grow",
                "PeerFailed",
                "Timeout",
                "Aborted",
                "Bootstrap",
            ]
            .contains(&kind)
                && msg.contains("rank");
            if clear {
                if std::env::var_os("OXCCL_ELASTIC_VERBOSE").is_some() {
                    println!("{what}: process {p}: {msg}");
                }
                tally.errors += 1;
                *tally.kinds.entry(format!("error {kind}")).or_default() += 1;
            } else {
                failures.push(format!("{what}: process {p}: unclear outcome {r}"));
            }
        }
    }
    println!(
        "{test}: {}/{n_trials} trials ended cleanly: {} survivors in a working communicator, \
         {} with a clear error; {:?}; slowest survivor {} ms (bound {} ms)",
        n_trials - failures.len().min(n_trials),
        tally.working,
        tally.errors,
        tally.kinds,
        tally.slowest_ms,
        bound.as_millis()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn random_kills_in_shrink_shm() {
    let _g = serial(&SHM);
    run_trials("random_kills_in_shrink_shm", "shrink", None);
}

#[test]
fn random_kills_in_grow_shm() {
    let _g = serial(&SHM);
    run_trials("random_kills_in_grow_shm", "grow", None);
}

fn bed(test: &str) -> Option<Testbed> {
    if !oxccl_testbed::require(test, Testbed::available()) {
        return None;
    }
    Some(Testbed::new(&[HostSpec::unshaped(); 4]).expect("creating the test bed"))
}

#[test]
fn random_kills_in_shrink_tcp_netns() {
    let name = "random_kills_in_shrink_tcp_netns";
    let _g = serial(&BED);
    if let Some(tb) = bed(name) {
        run_trials(name, "shrink", Some(&tb));
    }
}

#[test]
fn random_kills_in_grow_tcp_netns() {
    let name = "random_kills_in_grow_tcp_netns";
    let _g = serial(&BED);
    if let Some(tb) = bed(name) {
        run_trials(name, "grow", Some(&tb));
    }
}
