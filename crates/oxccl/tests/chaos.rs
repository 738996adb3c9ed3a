//! Never hang, never corrupt (issue 5), through the public API, by real processes:
//!
//! - **kill trials**: 4 ranks loop one collective (every kind, and send/recv arranged as a
//!   ring), checking every result; the test SIGKILLs a random rank (rank 0, which serves the
//!   bootstrap store, included) at a random moment. Every survivor must return an error that
//!   names the dead rank within `OXCCL_TIMEOUT` + 1 s of the kill. Over shm on this host, and
//!   over tcp with ranks in network namespaces of an `oxccl-testbed` test bed.
//! - **SIGSTOP**: a stopped rank makes every other rank's all-reduce return `Error::Timeout`
//!   naming the call, its sequence number, the rank, the peer waited on, the step and the
//!   bytes received; once the survivors abort, the stopped rank, continued, fails at once.
//!   In one process: `abort()` from another thread unblocks a blocked call.
//! - **strangers**: connections to the bootstrap store that do not know the secret or do not
//!   speak the protocol are refused while a job runs, which completes undisturbed.
//!
//! Sizes: a kill trial's count is random, alternately small (at most 64 KiB: the mailbox
//! protocol and the latency algorithms) and large (the slot protocol).
//!
//! Environment: `OXCCL_CHAOS_TRIALS` (kill trials per collective and provider, default 4),
//! `OXCCL_CHAOS_SEED` (replays the random choices of a run, printed at its start),
//! `OXCCL_CHAOS_COLLS` (comma-separated collectives, default all), `OXCCL_STRANGER_SECS` (how
//! long strangers pester the job, default 3; from 12 on, the test also checks that the store
//! closes a silent connection). `scripts/chaos.sh` runs the long version.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl::{Communicator, Error, ReduceOp};
use oxccl_bootstrap::{Secret, TcpStore, wire};
use oxccl_testbed::{HostSpec, Testbed};
use serde_json::{Value, json};

use common::{COLLECTIVES, Job, Rng, error_kind, realtime_ns, report, spawn_job};

/// `OXCCL_TIMEOUT` of the kill trials.
const KILL_TIMEOUT_S: u64 = 5;
/// `OXCCL_TIMEOUT` of the SIGSTOP jobs.
const STOP_TIMEOUT_S: u64 = 2;
/// Ranks of every job.
const N: usize = 4;
/// Largest message of the small kind (the mailbox protocol's limit).
const SMALL_BYTES: usize = 64 << 10;

/// The tests of this file run one at a time: their timing claims assume nobody else in this
/// binary is loading the two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "kill_loop" => kill_loop(args),
        "stop_loop" => stop_loop(args),
        "steady" => steady(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

// ------------------------------------------------------------------------------------------
// Randomness (seeded, replayable)

fn env_num(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

// ------------------------------------------------------------------------------------------
// The looped collectives (i32 data, sum; every result checked)

/// Rank `rank`'s element `i` in iteration `iter`: every rank can compute every rank's input.
fn val(rank: usize, i: usize, iter: u64) -> i32 {
    ((i as u64 * 7 + rank as u64 * 131 + iter * 17) % 1000) as i32
}

fn sum_val(n: usize, i: usize, iter: u64) -> i32 {
    (0..n).map(|r| val(r, i, iter)).sum()
}

/// Elements `from` sends `to` in an all-to-allv of iteration `iter` (0 to `c`).
fn v_count(c: usize, from: usize, to: usize, iter: u64) -> usize {
    c * ((from + 2 * to + iter as usize) % 4) / 3
}

/// The first element of `got` that differs from `want(i)`, described.
fn check(what: &str, got: &[i32], want: impl Fn(usize) -> i32) -> Option<String> {
    got.iter()
        .enumerate()
        .find(|&(i, &g)| g != want(i))
        .map(|(i, &g)| format!("{what}: [{i}] = {g}, expected {}", want(i)))
}

/// One call of `coll` (`c` elements per rank, or per block) in iteration `iter`, checked:
/// `Ok(None)` when right, `Ok(Some(what was wrong))`, or the call's error.
fn one(comm: &Communicator, coll: &str, c: usize, iter: u64) -> oxccl::Result<Option<String>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let root = (iter as usize) % n;
    let mine = |len: usize| -> Vec<i32> { (0..len).map(|i| val(rank, i, iter)).collect() };
    let what = format!("{coll} #{iter} (count {c})");
    Ok(match coll {
        "all_reduce" => {
            let mut out = vec![-1; c];
            comm.all_reduce(&mine(c), &mut out, ReduceOp::Sum)?;
            check(&what, &out, |i| sum_val(n, i, iter))
        }
        "reduce_scatter" => {
            let mut out = vec![-1; c];
            comm.reduce_scatter(&mine(n * c), &mut out, ReduceOp::Sum)?;
            check(&what, &out, |i| sum_val(n, rank * c + i, iter))
        }
        "all_gather" => {
            let mut out = vec![-1; n * c];
            comm.all_gather(&mine(c), &mut out)?;
            check(&what, &out, |i| val(i / c.max(1), i % c.max(1), iter))
        }
        "broadcast" => {
            let input = if rank == root { mine(c) } else { Vec::new() };
            let mut out = vec![-1; c];
            comm.broadcast(&input, &mut out, root)?;
            check(&what, &out, |i| val(root, i, iter))
        }
        "reduce" => {
            let mut out = vec![-1; if rank == root { c } else { 0 }];
            comm.reduce(&mine(c), &mut out, ReduceOp::Sum, root)?;
            check(&what, &out, |i| sum_val(n, i, iter))
        }
        "all_to_all" => {
            let mut out = vec![-1; n * c];
            comm.all_to_all(&mine(n * c), &mut out)?;
            check(&what, &out, |i| {
                val(i / c.max(1), rank * c + i % c.max(1), iter)
            })
        }
        "all_to_allv" => {
            let send: Vec<usize> = (0..n).map(|j| v_count(c, rank, j, iter)).collect();
            let recv: Vec<usize> = (0..n).map(|i| v_count(c, i, rank, iter)).collect();
            // Block j holds elements j*c.. of this rank's values.
            let input: Vec<i32> = (0..n)
                .flat_map(|j| (0..send[j]).map(move |k| val(rank, j * c + k, iter)))
                .collect();
            let want: Vec<i32> = (0..n)
                .flat_map(|i| (0..recv[i]).map(move |k| val(i, rank * c + k, iter)))
                .collect();
            let mut out = vec![-1; want.len()];
            comm.all_to_allv(&input, &send, &mut out, &recv)?;
            check(&what, &out, |i| want[i])
        }
        "gather" => {
            let mut out = vec![-1; if rank == root { n * c } else { 0 }];
            comm.gather(&mine(c), &mut out, root)?;
            check(&what, &out, |i| val(i / c.max(1), i % c.max(1), iter))
        }
        "scatter" => {
            let input: Vec<i32> = if rank == root {
                (0..n * c).map(|i| val(root, i, iter)).collect()
            } else {
                Vec::new()
            };
            let mut out = vec![-1; c];
            comm.scatter(&input, &mut out, root)?;
            check(&what, &out, |i| val(root, rank * c + i, iter))
        }
        "barrier" => {
            comm.barrier()?;
            None
        }
        "send_recv" => {
            // A ring: even ranks send first, odd ranks receive first (no deadlock even if a
            // send waits for its receiver); every rank depends on both neighbours.
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let data = mine(c);
            let mut got = vec![-1; c];
            if rank % 2 == 0 {
                comm.send(&data, next)?;
                comm.recv(&mut got, prev)?;
            } else {
                comm.recv(&mut got, prev)?;
                comm.send(&data, next)?;
            }
            check(&what, &got, |i| val(prev, i, iter))
        }
        other => panic!("unknown collective {other:?}"),
    })
}

/// An error as JSON: kind, text and when the call returned (`CLOCK_REALTIME` ns).
fn error_json(e: &Error, t_ns: u64) -> Value {
    let mut v = json!({ "kind": error_kind(e), "msg": e.to_string(), "t_ns": t_ns });
    if let Error::Timeout {
        rank,
        op,
        timeout,
        waiting,
        peer,
        step,
        steps,
        bytes,
        ..
    } = e
    {
        v["timeout"] = json!({
            "rank": rank, "seq": op.seq, "coll": op.coll, "count": op.count,
            "timeout_ms": timeout.as_millis() as u64, "waiting": waiting, "step": step,
            "steps": steps, "bytes": bytes,
            "peer": peer,
        });
    }
    v
}

/// What a looping rank reports: its iterations, wrong results and the error that ended it,
/// its network namespace and the providers of its links.
fn report_and_wait(rank: usize, iters: u64, wrong: &[String], error: Value) -> Value {
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let v = json!({ "rank": rank, "iters": iters, "wrong": wrong, "error": error,
                    "netns": netns, "providers": providers() });
    common::write_json(&format!("result-{rank}"), &v);
    v
}

thread_local! {
    static PROVIDERS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Notes the providers of this rank's links (`-` for itself), for [`report_and_wait`].
fn note_providers(comm: &Communicator) {
    let p = comm
        .providers()
        .iter()
        .map(|p| p.map_or("-".to_string(), |p| format!("{p:?}").to_lowercase()))
        .collect();
    PROVIDERS.with(|x| *x.borrow_mut() = p);
}

fn providers() -> Vec<String> {
    PROVIDERS.with(|x| x.borrow().clone())
}

/// Prints the result, waits (bounded) for the parent's `release` and exits: a survivor stays
/// up until every survivor has its error, so that its exit is not a new failure the others
/// would see (a real job's ranks handle the error the same way).
fn release_and_exit(v: Value) -> ! {
    let _ = common::wait_file("release", Duration::from_secs(90));
    common::emit(&v);
    std::process::exit(0);
}

/// Kill trials, in a rank: init, loop `coll` until it fails, report.
fn kill_loop(args: &Value) -> Value {
    let (rank, _) = common::env_rank();
    let coll = args["coll"].as_str().unwrap().to_string();
    let count = args["count"].as_u64().unwrap() as usize;
    // The communicator stays open until the parent has every report.
    let (_comm, v) = init_and_loop(rank, |_| (&coll, count));
    release_and_exit(v);
}

/// In a rank: inits a communicator and runs `call(iter)` = (collective, count) until one fails
/// (or 120 s pass), marking the rank ready after the first; reports (also an init failure,
/// which exits) and waits for the parent to collect the report.
fn init_and_loop<'a>(rank: usize, call: impl Fn(u64) -> (&'a str, usize)) -> (Communicator, Value) {
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            let v = report_and_wait(rank, 0, &[], error_json(&e, realtime_ns()));
            release_and_exit(v);
        }
    };
    note_providers(&comm);
    let start = Instant::now();
    let mut wrong = Vec::new();
    let mut iter = 0u64;
    let error = loop {
        iter += 1;
        match one(&comm, call(iter).0, call(iter).1, iter) {
            Ok(None) => {}
            Ok(Some(w)) => {
                if wrong.len() < 10 {
                    wrong.push(w);
                }
            }
            Err(e) => break error_json(&e, realtime_ns()),
        }
        if iter == 1 {
            common::touch(&format!("ready-{rank}"));
        }
        if start.elapsed() > Duration::from_secs(120) {
            break Value::Null;
        }
    };
    let v = report_and_wait(rank, iter, &wrong, error);
    (comm, v)
}

// ------------------------------------------------------------------------------------------
// Kill trials, parent side

/// Where a job's ranks run.
enum Net<'a> {
    /// On this host, shm between the ranks.
    Shm,
    /// tcp, in the hosts of a test bed: ranks 0 and 1 in host 0 (which serves the store),
    /// ranks 2 and 3 each in its own.
    Tcp(&'a Testbed),
    /// tcp on this host's loopback.
    TcpLoopback,
}

impl Net<'_> {
    fn name(&self) -> &'static str {
        match self {
            Net::Shm => "shm",
            Net::Tcp(_) | Net::TcpLoopback => "tcp",
        }
    }

    fn host(rank: usize) -> usize {
        rank.saturating_sub(1)
    }

    /// Starts `scenario` on the `N` ranks, with `OXCCL_TIMEOUT=timeout_s`.
    fn spawn(&self, timeout_s: u64, scenario: &str, args: &Value) -> Job {
        let timeout = timeout_s.to_string();
        match self {
            Net::Shm => {
                let env = [("OXCCL_PROVIDER", "shm"), ("OXCCL_TIMEOUT", &timeout)];
                spawn_job(N, &env, scenario, args, &|_, exe| Command::new(exe))
            }
            Net::TcpLoopback => {
                let env = [("OXCCL_PROVIDER", "tcp"), ("OXCCL_TIMEOUT", &timeout)];
                spawn_job(N, &env, scenario, args, &|_, exe| Command::new(exe))
            }
            Net::Tcp(tb) => {
                let master = tb.host_addr(0).to_string();
                let env = [
                    ("OXCCL_PROVIDER", "tcp"),
                    ("OXCCL_TIMEOUT", &timeout),
                    ("MASTER_ADDR", &master),
                ];
                // No OXCCL_TCP_ADDR: each rank finds its address itself (the route to the
                // store), as a user's job would.
                spawn_job(N, &env, scenario, args, &|rank, exe| {
                    tb.command(Net::host(rank), exe)
                })
            }
        }
    }
}

/// Files `ready-<r>` for every rank.
fn all_ready(job: &Job) -> bool {
    (0..job.world()).all(|r| job.path(&format!("ready-{r}")).exists())
}

/// Starts a job and waits (60 s at most) until every rank is ready; `Err` with every rank's
/// output if one exits first or the deadline passes. Launches again (twice at most) when
/// rank 0 could not bind the store's port, which something else took meanwhile.
fn start_ready(net: &Net, timeout_s: u64, scenario: &str, args: &Value) -> Result<Job, String> {
    for attempt in 1.. {
        let mut job = net.spawn(timeout_s, scenario, args);
        let deadline = Instant::now() + Duration::from_secs(60);
        // A rank whose init (or first call) failed reports at once and waits to be released.
        let reported = |j: &Job, r: usize| j.path(&format!("result-{r}")).exists();
        let ready = job.wait_until(deadline, |j| {
            all_ready(j) || (0..j.world()).any(|r| j.exited(r).is_some() || reported(j, r))
        }) && all_ready(&job);
        if ready {
            return Ok(job);
        }
        let failed: Vec<String> = (0..job.world())
            .filter(|&r| reported(&job, r))
            .map(|r| {
                let text = std::fs::read_to_string(job.path(&format!("result-{r}")));
                format!("rank {r} reported {}", text.unwrap_or_default().trim())
            })
            .collect();
        let what = if !failed.is_empty() {
            format!(
                "a rank failed before every rank was ready: {}",
                failed.join("; ")
            )
        } else if Instant::now() >= deadline {
            "not every rank was ready within 60 s".to_string()
        } else {
            "a rank exited before every rank was ready".to_string()
        };
        let outs = job.finish(Duration::from_secs(5));
        if attempt < 3 && (outs[0].stderr.contains("in use") || what.contains("in use")) {
            eprintln!("{scenario}: the store's port was taken; launching again");
            continue;
        }
        return Err(format!("{what}{}", report(&outs)));
    }
    unreachable!()
}

/// Detection times and error kinds of one (collective, provider).
#[derive(Default)]
struct Stats {
    trials: usize,
    /// Seconds from the kill to each survivor's error.
    detect: Vec<f64>,
    kinds: BTreeSet<String>,
}

/// The rank a message names besides the reporting rank's own prefix `rank R: `, checked for
/// `rank {dead}`.
fn names_rank(msg: &str, me: usize, dead: usize) -> bool {
    let body = msg.strip_prefix(&format!("rank {me}: ")).unwrap_or(msg);
    let needle = format!("rank {dead}");
    body.match_indices(&needle).any(|(at, _)| {
        !body[at + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}

/// Waits up to `wait_s` seconds for every rank but `except` to report, reads every rank's
/// report, and lets the ranks go (they keep their communicators open until then).
fn collect_results(job: &mut Job, except: usize, wait_s: u64) -> Vec<Option<Value>> {
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    job.wait_until(deadline, |j| {
        (0..N)
            .filter(|&r| r != except)
            .all(|r| j.path(&format!("result-{r}")).exists())
    });
    let results = (0..N)
        .map(|r| job.read_json(&format!("result-{r}")))
        .collect();
    job.touch("release");
    results
}

/// One kill trial: failures found (empty: passed).
fn kill_trial(
    net: &Net,
    coll: &str,
    trial: usize,
    rng: &mut Rng,
    stats: &mut Stats,
) -> Vec<String> {
    // Alternately small and large: elements per rank (or per block).
    let count = if coll == "barrier" {
        0
    } else if trial.is_multiple_of(2) {
        let per = if matches!(coll, "all_gather" | "gather" | "all_to_all" | "all_to_allv") {
            SMALL_BYTES / 4 / N
        } else {
            SMALL_BYTES / 4
        };
        rng.range(1, per as u64) as usize
    } else {
        rng.range(64 << 10, 384 << 10) as usize
    };
    let victim = rng.range(0, N as u64 - 1) as usize;
    let delay_ms = rng.range(0, 300);
    let ctx = format!(
        "{coll} over {}, trial {trial}: count {count}, rank {victim} killed {delay_ms} ms after \
         every rank was ready",
        net.name()
    );
    let args = json!({ "coll": coll, "count": count });
    let mut job = match start_ready(net, KILL_TIMEOUT_S, "kill_loop", &args) {
        Ok(j) => j,
        Err(e) => return vec![format!("{ctx}: {e}")],
    };
    std::thread::sleep(Duration::from_millis(delay_ms));
    let kill_ns = realtime_ns();
    if let Err(e) = job.signal(victim, libc::SIGKILL) {
        let outs = job.finish(Duration::from_secs(5));
        return vec![format!("{ctx}: kill: {e}{}", report(&outs))];
    }
    stats.trials += 1;
    let survivors: Vec<usize> = (0..N).filter(|&r| r != victim).collect();
    let results = collect_results(&mut job, victim, KILL_TIMEOUT_S + 15);
    let outs = job.finish(Duration::from_secs(15));
    let mut fails = Vec::new();
    let limit = (KILL_TIMEOUT_S + 1) as f64;
    for &s in &survivors {
        let Some(r) = &results[s] else {
            fails.push(format!(
                "rank {s} returned no error within {} s of the kill (a hang)",
                KILL_TIMEOUT_S + 15
            ));
            continue;
        };
        if let Some(w) = r["wrong"].as_array().filter(|w| !w.is_empty()) {
            fails.push(format!("rank {s} got wrong results: {w:?}"));
        }
        let e = &r["error"];
        if e.is_null() {
            fails.push(format!("rank {s} saw no error in 120 s: {r}"));
            continue;
        }
        let (kind, msg) = (e["kind"].as_str().unwrap(), e["msg"].as_str().unwrap());
        let t = e["t_ns"].as_u64().unwrap();
        let detect = t.saturating_sub(kill_ns) as f64 / 1e9;
        stats.detect.push(detect);
        stats.kinds.insert(kind.to_string());
        if t < kill_ns {
            fails.push(format!(
                "rank {s} failed {:.3} s before the kill: {kind}: {msg}",
                (kill_ns - t) as f64 / 1e9
            ));
        }
        if !names_rank(msg, s, victim) {
            fails.push(format!(
                "rank {s}'s error does not name the dead rank {victim}: {kind}: {msg}"
            ));
        }
        if detect > limit {
            fails.push(format!(
                "rank {s} took {detect:.3} s to detect (limit {limit} s): {kind}: {msg}"
            ));
        }
        if outs[s].status.is_none_or(|st| !st.success()) {
            fails.push(format!(
                "rank {s} did not exit cleanly: {:?}",
                outs[s].status
            ));
        }
    }
    fails.extend(check_placement(net, &results));
    let killed = outs[victim].status.and_then(|st| st.signal());
    if killed != Some(libc::SIGKILL) {
        fails.push(format!(
            "rank {victim} was not killed by the test's SIGKILL: {:?}",
            outs[victim].status
        ));
    }
    if fails.is_empty() {
        return fails;
    }
    vec![format!("{ctx}:\n  {}{}", fails.join("\n  "), report(&outs))]
}

/// The ranks ran where `net` says, over its provider: each link's provider, and for the test
/// bed, ranks 0 and 1 in one namespace, ranks 2 and 3 each in another.
fn check_placement(net: &Net, results: &[Option<Value>]) -> Vec<String> {
    let mut f = Vec::new();
    let want = if matches!(net, Net::Shm) {
        "shm"
    } else {
        "tcp"
    };
    let netns: Vec<Option<&str>> = results
        .iter()
        .map(|r| r.as_ref().and_then(|r| r["netns"].as_str()))
        .collect();
    for (rank, r) in results.iter().enumerate() {
        let Some(r) = r else { continue };
        let links: Vec<&str> = r["providers"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let ok = links.len() == N
            && links
                .iter()
                .enumerate()
                .all(|(p, l)| if p == rank { true } else { *l == want });
        if !ok {
            f.push(format!("rank {rank}'s links are {links:?}, not {want}"));
        }
    }
    if let Net::Tcp(_) = net {
        for a in 0..N {
            for b in a + 1..N {
                let (Some(x), Some(y)) = (netns[a], netns[b]) else {
                    continue;
                };
                let same_host = Net::host(a) == Net::host(b);
                if (x == y) != same_host {
                    f.push(format!(
                        "ranks {a} and {b} are in namespaces {x} and {y}, expected {}",
                        if same_host {
                            "the same"
                        } else {
                            "different ones"
                        }
                    ));
                }
            }
        }
    }
    f
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs the kill trials of every collective over `net` and prints the table; panics with
/// every failure at the end.
fn kill_trials(test: &str, net: &Net) {
    let trials = env_num("OXCCL_CHAOS_TRIALS", 4) as usize;
    let colls: Vec<String> = match std::env::var("OXCCL_CHAOS_COLLS") {
        Ok(s) if !s.trim().is_empty() => s.split(',').map(|c| c.trim().to_string()).collect(),
        _ => COLLECTIVES.iter().map(|c| c.to_string()).collect(),
    };
    let mut rng = Rng::from_env(test, "OXCCL_CHAOS_SEED");
    let start = Instant::now();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for coll in &colls {
        let mut stats = Stats::default();
        for trial in 0..trials {
            let f = kill_trial(net, coll, trial, &mut rng, &mut stats);
            for x in &f {
                eprintln!("FAILED {test}: {x}");
            }
            failures.extend(f);
        }
        rows.push((coll.clone(), stats));
    }
    println!(
        "\n{test}: kill trials over {} ({N} ranks, OXCCL_TIMEOUT={KILL_TIMEOUT_S}; detection = \
         survivor's error time - kill time), {:.1} s",
        net.name(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "{:<15} {:>8} {:>6} {:>10} {:>10}  error kinds",
        "collective", "provider", "trials", "worst s", "median s"
    );
    for (coll, s) in &rows {
        let worst = s.detect.iter().copied().fold(f64::NAN, f64::max);
        println!(
            "{coll:<15} {:>8} {:>6} {worst:>10.3} {:>10.3}  {}",
            net.name(),
            s.trials,
            median(&s.detect),
            s.kinds.iter().cloned().collect::<Vec<_>>().join(",")
        );
    }
    assert!(
        failures.is_empty(),
        "{test}: {} failed trial(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn kill_a_rank_during_every_collective_shm() {
    let _g = serial();
    kill_trials("kill_a_rank_during_every_collective_shm", &Net::Shm);
}

#[test]
fn kill_a_rank_during_every_collective_tcp_netns() {
    let name = "kill_a_rank_during_every_collective_tcp_netns";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let _g = serial();
    let tb = Testbed::new(&[HostSpec::unshaped(); 3]).expect("creating the test bed");
    kill_trials(name, &Net::Tcp(&tb));
    // Dropping the bed (also while unwinding) kills what runs in it and deletes it.
}

/// Seconds of `OXCCL_TIMEOUT` in the link-cut test: above the tcp queue pairs' own timeout
/// (5 s: `TCP_USER_TIMEOUT` and keepalive), which is what notices a silent link.
const CUT_TIMEOUT_S: u64 = 10;

/// A host's link cut mid-job (its veth port on the bridge set down: no FIN, no RST, silence):
/// every rank on the other hosts fails naming the rank behind the cut, within the timeout
/// plus a second, through the tcp connections' own timeouts and keepalives.
#[test]
fn cut_link_is_named_on_every_other_host_tcp_netns() {
    let name = "cut_link_is_named_on_every_other_host_tcp_netns";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let _g = serial();
    let tb = Testbed::new(&[HostSpec::unshaped(); 3]).expect("creating the test bed");
    let net = Net::Tcp(&tb);
    // Rank 2 is alone in host 1.
    let (cut_rank, cut_host) = (2, 1);
    let args = json!({ "coll": "all_reduce", "count": 200_000 });
    let mut job =
        start_ready(&net, CUT_TIMEOUT_S, "kill_loop", &args).unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_millis(100));
    let cut_ns = realtime_ns();
    let st = Command::new("ip")
        .args([
            "-n",
            &tb.bridge_netns(),
            "link",
            "set",
            &format!("h{cut_host}"),
            "down",
        ])
        .status()
        .expect("running ip");
    assert!(st.success(), "cutting host {cut_host}'s link failed");
    let others: Vec<usize> = (0..N).filter(|&r| r != cut_rank).collect();
    // (The rank behind the cut fails too, naming someone it can no longer reach.)
    let results = collect_results(&mut job, cut_rank, CUT_TIMEOUT_S + 15);
    let outs = job.finish(Duration::from_secs(CUT_TIMEOUT_S + 5));
    let mut fails = Vec::new();
    let mut worst: f64 = 0.0;
    for &r in &others {
        let Some(e) = results[r]
            .as_ref()
            .map(|v| &v["error"])
            .filter(|e| !e.is_null())
        else {
            fails.push(format!("rank {r} reported no error"));
            continue;
        };
        let msg = e["msg"].as_str().unwrap();
        let detect = e["t_ns"].as_u64().unwrap().saturating_sub(cut_ns) as f64 / 1e9;
        worst = worst.max(detect);
        if !names_rank(msg, r, cut_rank) {
            fails.push(format!("rank {r} does not name rank {cut_rank}: {msg}"));
        }
        if detect > (CUT_TIMEOUT_S + 1) as f64 {
            fails.push(format!("rank {r} took {detect:.2} s: {msg}"));
        }
    }
    println!("{name}: the others named rank {cut_rank} within {worst:.2} s of the cut");
    assert!(fails.is_empty(), "{}{}", fails.join("\n"), report(&outs));
}

// ------------------------------------------------------------------------------------------
// SIGSTOP

/// Elements of the SIGSTOP and stranger jobs' all-reduces: odd iterations small (mailboxes),
/// even ones large (slots).
fn alternate(iter: u64) -> usize {
    if iter % 2 == 1 { 1000 } else { 150_000 }
}

/// In a rank: init, loop a checked all-reduce until it fails; report the error; wait for the
/// parent's `abort`, abort, say so; wait for `release`.
fn stop_loop(_args: &Value) -> Value {
    let (rank, _) = common::env_rank();
    let (comm, v) = init_and_loop(rank, |iter| ("all_reduce", alternate(iter)));
    // The stopped rank, continued, has no `abort` to wait for: the others have aborted.
    if common::wait_file("abort", Duration::from_secs(60)) {
        comm.abort();
        common::touch(&format!("aborted-{rank}"));
    }
    release_and_exit(v);
}

fn check_timeout(me: usize, r: &Value, stop_ns: u64, stopped: usize) -> Vec<String> {
    let mut f = Vec::new();
    let e = &r["error"];
    let (kind, msg) = (
        e["kind"].as_str().unwrap_or("none"),
        e["msg"].as_str().unwrap_or(""),
    );
    if kind != "Timeout" {
        f.push(format!("rank {me} got {kind}, not Timeout: {msg}"));
        return f;
    }
    let t = &e["timeout"];
    let iters = r["iters"].as_u64().unwrap();
    let (seq, step, steps, bytes) = (
        t["seq"].as_u64().unwrap(),
        t["step"].as_u64().unwrap(),
        t["steps"].as_u64().unwrap(),
        t["bytes"].as_u64().unwrap(),
    );
    let waiting = t["waiting"].as_str().unwrap();
    if t["rank"] != me {
        f.push(format!("rank {me}'s Timeout has rank {}", t["rank"]));
    }
    if t["coll"] != "all_reduce" || seq != iters {
        f.push(format!(
            "rank {me}'s Timeout names {} #{seq}; it was in all_reduce #{iters}",
            t["coll"]
        ));
    }
    if t["timeout_ms"] != STOP_TIMEOUT_S * 1000 {
        f.push(format!(
            "rank {me}'s Timeout has timeout {} ms",
            t["timeout_ms"]
        ));
    }
    if t["count"] != alternate(iters) {
        f.push(format!("rank {me}'s Timeout has count {}", t["count"]));
    }
    if !(0..N).any(|p| p != me && names_rank(waiting, me, p)) {
        f.push(format!(
            "rank {me}'s Timeout names no peer waited on: {waiting:?}"
        ));
    }
    // The peer waited on, as a field too.
    match t["peer"].as_u64().map(|p| p as usize) {
        Some(p) if p != me && p < N && names_rank(waiting, me, p) => {}
        other => f.push(format!(
            "rank {me}'s Timeout has peer {other:?}, waiting {waiting:?}"
        )),
    }
    if step >= steps {
        f.push(format!("rank {me}'s Timeout: step {step} of {steps}"));
    }
    // Counted are the bytes that arrived during the call, which may include the next call's
    // from peers already in it: at most every element of every rank's input of both calls,
    // once per step.
    let most = (steps + 1) * (N * (alternate(iters) + alternate(iters + 1)) * 4) as u64;
    if bytes > most {
        f.push(format!(
            "rank {me}'s Timeout: {bytes} bytes received (at most {most})"
        ));
    }
    for part in [
        format!("rank {me}: "),
        format!("all_reduce #{seq}"),
        waiting.to_string(),
        format!("step {step} of {steps}"),
        format!("{bytes} bytes"),
    ] {
        if !msg.contains(&part) {
            f.push(format!("rank {me}'s Timeout text lacks {part:?}: {msg}"));
        }
    }
    let detect = e["t_ns"].as_u64().unwrap().saturating_sub(stop_ns) as f64 / 1e9;
    if detect > (STOP_TIMEOUT_S + 1) as f64 {
        f.push(format!(
            "rank {me} timed out {detect:.3} s after rank {stopped} was stopped (limit {} s)",
            STOP_TIMEOUT_S + 1
        ));
    }
    f
}

/// Stops a random rank; checks the others' timeouts, then continues it after they aborted.
fn stop_trial(test: &str, net: &Net, rng: &mut Rng) {
    let stopped = rng.range(0, N as u64 - 1) as usize;
    let delay_ms = rng.range(0, 300);
    let ctx = format!(
        "{test}: rank {stopped} stopped {delay_ms} ms after every rank was ready ({})",
        net.name()
    );
    let mut job = start_ready(net, STOP_TIMEOUT_S, "stop_loop", &json!({}))
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    std::thread::sleep(Duration::from_millis(delay_ms));
    let stop_ns = realtime_ns();
    job.signal(stopped, libc::SIGSTOP)
        .unwrap_or_else(|e| panic!("{ctx}: SIGSTOP: {e}"));
    let others: Vec<usize> = (0..N).filter(|&r| r != stopped).collect();
    let result = |j: &Job, r: usize| j.read_json(&format!("result-{r}"));
    let got_all = job.wait_until(
        Instant::now() + Duration::from_secs(STOP_TIMEOUT_S + 15),
        |j| others.iter().all(|&r| result(j, r).is_some()),
    );
    // Let them abort, then continue the stopped rank.
    job.touch("abort");
    let aborted = job.wait_until(Instant::now() + Duration::from_secs(10), |j| {
        others
            .iter()
            .all(|&r| j.path(&format!("aborted-{r}")).exists())
    });
    let cont_ns = realtime_ns();
    let cont = job.signal(stopped, libc::SIGCONT);
    job.wait_until(Instant::now() + Duration::from_secs(10), |j| {
        result(j, stopped).is_some()
    });
    let results: Vec<Option<Value>> = (0..N).map(|r| result(&job, r)).collect();
    job.touch("release");
    let outs = job.finish(Duration::from_secs(15));
    let mut f = Vec::new();
    if !got_all {
        f.push(format!(
            "not every other rank returned within {} s (a hang)",
            STOP_TIMEOUT_S + 15
        ));
    }
    if !aborted {
        f.push("not every other rank aborted within 10 s".into());
    }
    if let Err(e) = cont {
        f.push(format!("SIGCONT: {e}"));
    }
    let mut waited_on_stopped = false;
    for &r in &others {
        let Some(res) = &results[r] else { continue };
        if let Some(w) = res["wrong"].as_array().filter(|w| !w.is_empty()) {
            f.push(format!("rank {r} got wrong results: {w:?}"));
        }
        f.extend(check_timeout(r, res, stop_ns, stopped));
        let waiting = res["error"]["timeout"]["waiting"].as_str().unwrap_or("");
        waited_on_stopped |= names_rank(waiting, r, stopped);
        let e = &res["error"];
        println!(
            "{test}: rank {r}: {} after {:.3} s: {}",
            e["kind"],
            e["t_ns"].as_u64().unwrap_or(0).saturating_sub(stop_ns) as f64 / 1e9,
            e["msg"].as_str().unwrap_or("")
        );
    }
    if got_all && !waited_on_stopped {
        f.push(format!(
            "no rank's Timeout says it waited on rank {stopped}"
        ));
    }
    match &results[stopped] {
        None => f.push(format!(
            "rank {stopped} did not return within 10 s of SIGCONT (a hang)"
        )),
        Some(res) => {
            let e = &res["error"];
            let (kind, msg) = (
                e["kind"].as_str().unwrap_or("none"),
                e["msg"].as_str().unwrap_or(""),
            );
            let after = e["t_ns"].as_u64().unwrap_or(0).saturating_sub(cont_ns) as f64 / 1e9;
            println!("{test}: rank {stopped} (continued): {kind} after {after:.3} s: {msg}");
            if !matches!(kind, "Aborted" | "PeerFailed") {
                f.push(format!(
                    "rank {stopped}, continued, got {kind}, not Aborted or PeerFailed: {msg}"
                ));
            }
            if after > 2.0 {
                f.push(format!(
                    "rank {stopped} returned {after:.3} s after SIGCONT (limit 2 s): {msg}"
                ));
            }
            if let Some(w) = res["wrong"].as_array().filter(|w| !w.is_empty()) {
                f.push(format!("rank {stopped} got wrong results: {w:?}"));
            }
        }
    }
    for o in &outs {
        if o.status.is_none_or(|s| !s.success()) {
            f.push(format!(
                "rank {} did not exit cleanly: {:?}",
                o.rank, o.status
            ));
        }
    }
    assert!(
        f.is_empty(),
        "{ctx}:\n  {}{}",
        f.join("\n  "),
        report(&outs)
    );
}

#[test]
fn a_stopped_rank_times_the_others_out_and_fails_when_continued_shm() {
    let _g = serial();
    let test = "a_stopped_rank_times_the_others_out_and_fails_when_continued_shm";
    let mut rng = Rng::from_env(test, "OXCCL_CHAOS_SEED");
    stop_trial(test, &Net::Shm, &mut rng);
}

#[test]
fn a_stopped_rank_times_the_others_out_and_fails_when_continued_tcp() {
    let _g = serial();
    let test = "a_stopped_rank_times_the_others_out_and_fails_when_continued_tcp";
    let mut rng = Rng::from_env(test, "OXCCL_CHAOS_SEED");
    // tcp over loopback: the namespaces add nothing to a stopped process.
    stop_trial(test, &Net::TcpLoopback, &mut rng);
}

/// In one process, two ranks (threads): rank 0 blocks in an all-reduce that rank 1 never
/// joins (as if stopped); another thread's `abort()` must make it return `Aborted` within
/// 200 ms, and rank 1, told of the abort, must fail its next call at once (or the one after,
/// where the next could complete with what had already arrived).
#[test]
fn abort_from_another_thread_unblocks_a_blocked_call() {
    use oxccl::{Options, Provider};
    use oxccl_bootstrap::{Bootstrap, Config, StoreServer};
    let _g = serial();
    let mut fails = Vec::new();
    for (provider, count) in [
        (Provider::Shm, 1000),
        (Provider::Shm, 300_000),
        (Provider::Tcp, 1000),
        (Provider::Tcp, 300_000),
    ] {
        let ctx = format!("{provider:?}, all_reduce of {count} f32");
        let secret = Secret::new(common::random_hex()).unwrap();
        let server = StoreServer::bind("127.0.0.1:0", secret.clone()).expect("a store");
        let addr = server.addr().to_string();
        let init = |rank: usize| {
            let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
            config.serve_store = false;
            config.timeout = Duration::from_secs(20);
            let opts = Options {
                timeout: Duration::from_secs(10),
                provider: Some(provider),
                ..Options::default()
            };
            Communicator::init(Bootstrap::new(config)?, opts)
        };
        let (c0, c1) = std::thread::scope(|s| {
            let h = s.spawn(|| init(1));
            let c0 = init(0);
            (c0, h.join().unwrap())
        });
        let (c0, c1) = (c0.expect("init rank 0"), c1.expect("init rank 1"));
        std::thread::scope(|s| {
            let blocked = s.spawn(|| {
                let mut v = vec![1f32; count];
                let r = c0.all_reduce_in_place(&mut v, ReduceOp::Sum);
                (r, Instant::now())
            });
            std::thread::sleep(Duration::from_millis(300));
            if blocked.is_finished() {
                let (r, _) = blocked.join().unwrap();
                fails.push(format!("{ctx}: the call returned without its peer: {r:?}"));
                return;
            }
            let t = Instant::now();
            c0.abort();
            // Bounded: the call's own timeout is 10 s.
            let (r, at) = blocked.join().unwrap();
            let took = at.saturating_duration_since(t);
            println!("{ctx}: abort returned the blocked call after {took:?}: {r:?}");
            match &r {
                Err(e @ Error::Aborted { .. }) => {
                    if took > Duration::from_millis(200) {
                        fails.push(format!("{ctx}: Aborted after {took:?} (limit 200 ms): {e}"));
                    }
                }
                other => fails.push(format!(
                    "{ctx}: the blocked call got {other:?}, not Aborted"
                )),
            }
            // The peer was told: its calls fail at once, naming the abort. Its next call may
            // still complete, correctly, where rank 0's part of it had already arrived ahead
            // of the abort's notice (over tcp they share a connection, and the data comes
            // first); the call after it has nothing to wait for but the notice.
            for attempt in 0..2 {
                let t = Instant::now();
                let mut v = vec![1f32; count];
                let r1 = c1.all_reduce_in_place(&mut v, ReduceOp::Sum);
                let took = t.elapsed();
                println!("{ctx}: the peer's call {attempt} after {took:?}: {r1:?}");
                match &r1 {
                    Ok(()) if attempt == 0 => {
                        if v.iter().any(|&x| x != 2.0) {
                            fails.push(format!(
                                "{ctx}: the peer's call completed with a wrong sum: {:?}",
                                &v[..4]
                            ));
                        }
                        continue;
                    }
                    Err(e @ Error::Aborted { .. }) if took < Duration::from_secs(2) => {
                        if !e.to_string().contains("rank 0") {
                            fails
                                .push(format!("{ctx}: the peer's error does not name rank 0: {e}"));
                        }
                    }
                    other => fails.push(format!(
                        "{ctx}: the peer's call {attempt} got {other:?} after {took:?}, not \
                         Aborted at once"
                    )),
                }
                break;
            }
        });
        drop((c0, c1));
        server.shutdown();
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

// ------------------------------------------------------------------------------------------
// Strangers

/// In a rank: loop a checked all-reduce (odd iterations small, even ones large) until rank
/// 0 sees the parent's `stop` file, which it passes on in element 0 (so every rank stops
/// after the same call); then destroy the communicator.
fn steady(_args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let (rank, n) = (comm.rank(), comm.world_size());
    let stop = common::shared_dir().join("stop");
    let start = Instant::now();
    let mut wrong = Vec::new();
    let mut error = Value::Null;
    let mut iter = 0u64;
    loop {
        iter += 1;
        let c = alternate(iter);
        let mut buf: Vec<i32> = (0..c).map(|i| val(rank, i, iter)).collect();
        buf[0] = i32::from(rank == 0 && stop.exists());
        if let Err(e) = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
            error = error_json(&e, realtime_ns());
            break;
        }
        let what = format!("all_reduce #{iter}");
        if let Some(w) = check(&what, &buf[1..], |i| sum_val(n, i + 1, iter)) {
            wrong.push(w);
        }
        if iter == 1 {
            common::touch(&format!("ready-{rank}"));
        }
        if buf[0] != 0 || start.elapsed() > Duration::from_secs(240) {
            break;
        }
    }
    let destroy = match comm.destroy() {
        Ok(()) => Value::Null,
        Err(e) => json!(e.to_string()),
    };
    json!({ "iters": iter, "wrong": wrong, "error": error, "destroy": destroy,
            "secs": start.elapsed().as_secs_f64() })
}

/// What a raw stranger saw: the frames the store sent and whether it closed the connection.
struct Seen {
    frames: Vec<wire::Msg>,
    undecodable: usize,
    closed: bool,
}

/// Reads what the store sends until it closes the connection or `timeout` passes.
fn read_all(s: &mut TcpStream, timeout: Duration) -> Seen {
    let deadline = Instant::now() + timeout;
    let mut buf = Vec::new();
    let mut closed = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        s.set_read_timeout(Some(left.min(Duration::from_millis(200))))
            .unwrap();
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // A reset is a close too (the store closed with our bytes unread).
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let mut frames = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        match wire::decode(&buf[at..]) {
            Ok((m, used)) => {
                frames.push(m);
                at += used;
            }
            Err(_) => break,
        }
    }
    Seen {
        frames,
        undecodable: buf.len() - at,
        closed,
    }
}

/// Reads what the silent connection has (non-blocking); notes when the store closed it.
fn poll_silent(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    closed: &mut Option<Duration>,
    since: Instant,
) {
    let mut chunk = [0u8; 4096];
    while closed.is_none() {
        match s.read(&mut chunk) {
            Ok(0) => *closed = Some(since.elapsed()),
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => *closed = Some(since.elapsed()),
        }
    }
}

/// Sends `bytes` as a stranger and checks that the store refuses: it sends its greeting and
/// at most an `AuthFail`, and closes the connection within 5 s.
fn raw_stranger(addr: &str, what: &str, bytes: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("{what}: connect: {e}"))?;
    // The store may close before reading everything: a failed write is fine.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let seen = read_all(&mut s, Duration::from_secs(5));
    let kinds: Vec<&str> = seen.frames.iter().map(wire::Msg::kind).collect();
    let greeted = matches!(seen.frames.first(), Some(wire::Msg::Hello { .. }));
    let refused_only = seen.frames[1.min(seen.frames.len())..]
        .iter()
        .all(|m| matches!(m, wire::Msg::AuthFail { .. }));
    if !greeted || !refused_only || seen.undecodable != 0 || !seen.closed {
        return Err(format!(
            "{what}: the store sent {kinds:?} (+{} undecodable bytes), closed: {}",
            seen.undecodable, seen.closed
        ));
    }
    Ok(())
}

/// The strangers' frames: random garbage, and frames that look right but are not.
fn stranger_payloads(rng: &mut Rng) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    let len = rng.range(1, 4096) as usize;
    let garbage: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    v.push((format!("{len} random bytes"), garbage));
    // A frame announcing far more than any frame may hold.
    let mut huge = (u32::MAX).to_le_bytes().to_vec();
    huge.extend_from_slice(&[2; 64]);
    v.push(("a frame of 4 GiB".into(), huge));
    // An authentication frame over the handshake's limit.
    let big = wire::MAX_HANDSHAKE_FRAME_LEN + 1000;
    let mut over = (big as u32).to_le_bytes().to_vec();
    over.push(2);
    over.extend(std::iter::repeat_n(0x41, big - 1));
    v.push((format!("an Auth frame of {big} bytes"), over));
    // A well-formed Auth frame whose label length says 1 GiB.
    let auth = wire::Msg::Auth {
        mac: [7; wire::NONCE_LEN],
        nonce: [9; wire::NONCE_LEN],
        label: "stranger".into(),
    };
    let mut garbled = wire::encode(&auth).unwrap();
    let label_len_at = 4 + 1 + 2 * wire::NONCE_LEN;
    garbled[label_len_at..label_len_at + 4].copy_from_slice(&(1u32 << 30).to_le_bytes());
    v.push(("an Auth frame with a garbled length".into(), garbled));
    // A well-formed request without authenticating first, and a large one.
    let set = wire::Msg::Set {
        key: "rank/0/endpoints".into(),
        value: vec![1; 64],
    };
    v.push((
        "a Set before authenticating".into(),
        wire::encode(&set).unwrap(),
    ));
    let get = wire::Msg::Get {
        keys: vec!["oxccl".into()],
        timeout_ms: 1000,
    };
    v.push((
        "a Get before authenticating".into(),
        wire::encode(&get).unwrap(),
    ));
    let large = wire::Msg::Set {
        key: "x".into(),
        value: vec![0x5a; 1 << 20],
    };
    v.push(("a 1 MiB Set".into(), wire::encode(&large).unwrap()));
    v
}

#[test]
fn strangers_at_the_store_do_not_disturb_a_running_job() {
    let _g = serial();
    let test = "strangers_at_the_store_do_not_disturb_a_running_job";
    let mut rng = Rng::from_env(test, "OXCCL_CHAOS_SEED");
    let secs = env_num("OXCCL_STRANGER_SECS", 3);
    let mut job =
        start_ready(&Net::Shm, 30, "steady", &json!({})).unwrap_or_else(|e| panic!("{test}: {e}"));
    let addr = format!("127.0.0.1:{}", job.port);
    let mut fails = Vec::new();
    // (c) A connection that says nothing, open while the job runs and ends.
    let mut silent = TcpStream::connect(&addr).expect("connecting to the store");
    silent.set_nonblocking(true).unwrap();
    let silent_since = Instant::now();
    let mut silent_bytes = Vec::new();
    let mut silent_closed = None;
    let wrong = Secret::new("not the job's secret").unwrap();
    let start = Instant::now();
    let mut rounds = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        rounds += 1;
        // (a) The client API with a wrong secret.
        match TcpStore::connect(&addr, &wrong, Duration::from_secs(5)) {
            Err(e @ oxccl_bootstrap::Error::AuthRefused { .. }) => {
                if !e.to_string().contains(&addr) {
                    fails.push(format!(
                        "a wrong secret: the error does not name {addr}: {e}"
                    ));
                }
            }
            other => fails.push(format!("a wrong secret got {other:?}, not AuthRefused")),
        }
        // (b) and (d): raw connections.
        for (what, bytes) in stranger_payloads(&mut rng) {
            if let Err(e) = raw_stranger(&addr, &what, &bytes) {
                fails.push(e);
            }
        }
        poll_silent(
            &mut silent,
            &mut silent_bytes,
            &mut silent_closed,
            silent_since,
        );
        job.poll();
        if (0..N).any(|r| job.exited(r).is_some()) {
            fails.push("a rank exited while the strangers came".into());
            break;
        }
        // Not a flood: ~8 connections every 20 ms (a flood would run out of ports).
        std::thread::sleep(Duration::from_millis(20));
    }
    // What the silent connection got so far: the greeting, nothing else; closed by the store
    // once the handshake's time is up (10 s), when the run was long enough to see it.
    poll_silent(
        &mut silent,
        &mut silent_bytes,
        &mut silent_closed,
        silent_since,
    );
    let mut silent_buf = Vec::new();
    let mut at = 0;
    while let Ok((m, used)) = wire::decode(&silent_bytes[at..]) {
        silent_buf.push(m.kind());
        at += used;
    }
    if at != silent_bytes.len() {
        silent_buf.push("(undecodable bytes)");
    }
    job.touch("stop");
    let deadline = Instant::now() + Duration::from_secs(60);
    job.wait_until(deadline, |j| (0..N).all(|r| j.exited(r).is_some()));
    let outs = job.finish(Duration::from_secs(1));
    drop(silent);
    let kinds_ok =
        silent_buf.first() == Some(&"Hello") && silent_buf[1..].iter().all(|k| *k == "AuthFail");
    if !kinds_ok {
        fails.push(format!("the silent connection got {silent_buf:?}"));
    }
    if secs >= 12 {
        match silent_closed {
            Some(t) if t < Duration::from_secs(13) => {}
            other => fails.push(format!(
                "the store did not close a silent connection within 13 s: {other:?}"
            )),
        }
    }
    let results = common::expect_results(test, &outs);
    for (r, res) in results.iter().enumerate() {
        if !res["error"].is_null() || !res["destroy"].is_null() {
            fails.push(format!("rank {r}: {res}"));
        }
        if let Some(w) = res["wrong"].as_array().filter(|w| !w.is_empty()) {
            fails.push(format!("rank {r} got wrong results: {w:?}"));
        }
    }
    let iters: Vec<u64> = results
        .iter()
        .map(|r| r["iters"].as_u64().unwrap())
        .collect();
    println!(
        "{test}: {rounds} rounds of strangers in {secs} s; every rank ran {iters:?} checked \
         all-reduces; the silent connection saw {silent_buf:?}, closed after {silent_closed:?}"
    );
    if iters.iter().any(|&i| i != iters[0] || i < 2) {
        fails.push(format!("iterations differ or too few: {iters:?}"));
    }
    assert!(
        fails.is_empty(),
        "{test}:\n  {}{}",
        fails.join("\n  "),
        report(&outs)
    );
}
