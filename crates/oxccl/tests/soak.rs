//! Soak (issue 5): 4 ranks on shm run a long random sequence of collectives on one
//! communicator, every kind (all-to-allv and send/recv pairs included), every data type and
//! operator, random roots and counts (log-uniform from 0 to 256 Ki elements, mostly small), in
//! place and out of place. Every rank derives the same sequence from a shared seed and checks
//! every result against a reference computed from deterministic inputs: small integers, so
//! that every result is exact in every type (sums of 4 values in -8..=8; products of ±1 and
//! one 2; averages of 4 are exact in binary floating point). After a warm-up and at the end,
//! each rank records its resident memory (`VmRSS`) and open file descriptors: the descriptors
//! must not grow, and the memory by less than 16 MiB.
//!
//! Environment: `OXCCL_SOAK_CALLS` (default 10,000), `OXCCL_SOAK_SEED` (replays a sequence;
//! the seed is printed), `OXCCL_SOAK_KINDS` (comma-separated kinds to draw from, default all:
//! to narrow down a failure).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use oxccl::schedule::Collective;
use oxccl::{Buffers, Communicator, DataType, Element, ReduceOp, as_bytes_mut};
use oxccl_testbed::{HostSpec, Testbed};
use serde_json::{Value, json};

use common::{COLLECTIVES, Rng, error_kind, mix, report, spawn_job};

const N: usize = 4;
/// Largest RSS growth allowed (see [`Footprint`]): after the warm-up at the largest size, three
/// seeds grew 8-812 KiB; seeds 14210006709031644059 and 1124711701311702480 grow 4.8 and
/// 8.4 MiB in one step (near calls 9,000 and 5,500, on rank 1) and stay flat after it: a
/// one-time allocation, not a leak (its cause is not found yet; perhaps the engine's scratch
/// growing for a group of large calls, which the warm-up does not run). A leak grows with the
/// calls: 16 MiB over 10,000 calls still catches 1.6 KiB a call.
const RSS_GROWTH_MAX_KB: i64 = 16 << 10;

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "soak" => soak(args),
        "all_to_allv_matrix" => all_to_allv_matrix(args),
        "reuse_after_return" => reuse_after_return(args),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// One call of the sequence: the same on every rank.
#[derive(Debug)]
struct Spec {
    kind: &'static str,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    /// Elements (per rank where the collective counts per rank; per pair at most for
    /// all-to-allv).
    count: usize,
    in_place: bool,
    /// The other rank of a send/recv pair (`root` is the first).
    peer: usize,
    /// Salt of this call's inputs.
    salt: u64,
}

/// The largest count [`draw_count`] draws.
const MAX_COUNT: usize = 1 << 18;

/// Log-uniform, mostly small: 5 % zero, 85 % up to 1 Ki, 9 % up to 32 Ki, 1 % up to 256 Ki
/// ([`MAX_COUNT`]).
fn draw_count(rng: &mut Rng) -> usize {
    let p = rng.below(100);
    let (lo, hi) = match p {
        0..5 => return 0,
        5..90 => (0, 10),
        90..99 => (10, 15),
        _ => (15, 18),
    };
    let e = lo + rng.below(hi - lo + 1);
    let base = 1u64 << e;
    (base / 2 + rng.below(base / 2 + 1)).max(1) as usize
}

fn draw(rng: &mut Rng, call: u64, seed: u64, kinds: &[&'static str]) -> Spec {
    let kind = kinds[rng.below(kinds.len() as u64) as usize];
    let dtype = DataType::ALL[rng.below(DataType::ALL.len() as u64) as usize];
    let op = ReduceOp::ALL[rng.below(5) as usize];
    let root = rng.below(N as u64) as usize;
    let peer = (root + 1 + rng.below(N as u64 - 1) as usize) % N;
    let count = draw_count(rng);
    let in_place = rng.below(2) == 1;
    Spec {
        kind,
        dtype,
        op,
        root,
        count,
        in_place,
        peer,
        salt: mix(seed ^ call),
    }
}

fn signed(d: DataType) -> bool {
    !matches!(d, DataType::U8 | DataType::U32 | DataType::U64)
}

/// Rank `rank`'s input element `idx`: for reductions -8..=8 (0..=15 unsigned), for `prod` ±1
/// and a 2 from one rank in 4; otherwise -100..=100 (0..=199 unsigned). Exact in every type.
fn val(s: &Spec, rank: usize, idx: u64) -> f64 {
    let h = mix(s.salt ^ mix(((rank as u64) << 44) ^ idx));
    let reducing = matches!(s.kind, "all_reduce" | "reduce_scatter" | "reduce");
    match s.op {
        ReduceOp::Prod if reducing => {
            let mag = if (rank as u64 + idx).is_multiple_of(4) {
                2.0
            } else {
                1.0
            };
            if signed(s.dtype) && h.is_multiple_of(3) {
                -mag
            } else {
                mag
            }
        }
        // 8-bit floats: partial sums of -1, 0 and 1 over the ranks stay exact.
        _ if reducing && matches!(s.dtype, DataType::F8E4M3 | DataType::F8E5M2) => {
            (h % 3) as f64 - 1.0
        }
        _ if reducing && signed(s.dtype) => (h % 17) as f64 - 8.0,
        _ if reducing => (h % 16) as f64,
        _ if signed(s.dtype) => (h % 201) as f64 - 100.0,
        _ => (h % 200) as f64,
    }
}

fn reduced(s: &Spec, idx: u64) -> f64 {
    let v = (0..N).map(|r| val(s, r, idx));
    match s.op {
        ReduceOp::Sum => v.sum(),
        ReduceOp::Prod => v.product(),
        ReduceOp::Min => v.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => v.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => {
            let mean = v.sum::<f64>() / N as f64;
            if s.dtype.is_float() {
                mean
            } else {
                mean.trunc()
            }
        }
    }
}

fn input<T: Element>(s: &Spec, rank: usize, idx: impl Iterator<Item = u64>) -> Vec<T> {
    idx.map(|i| T::from_f64(val(s, rank, i))).collect()
}

/// An output's initial value, outside every input's range.
fn sentinel<T: Element>() -> T {
    T::from_f64(if T::DTYPE.is_float() {
        12345.0
    } else if signed(T::DTYPE) {
        127.0
    } else {
        255.0
    })
}

/// The first difference between `got` and `want` (converted to `T`), described.
fn compare<T: Element>(got: &[T], want: impl Fn(usize) -> f64, len: usize) -> Option<String> {
    if got.len() != len {
        return Some(format!("{} elements, {len} expected", got.len()));
    }
    let mut wrong = 0;
    let mut first = None;
    for (i, g) in got.iter().enumerate() {
        let w = T::from_f64(want(i));
        if g.to_f64() != w.to_f64() {
            wrong += 1;
            first.get_or_insert_with(|| format!("[{i}] = {g:?}, expected {w:?}"));
        }
    }
    first.map(|f| format!("{wrong} of {len} elements wrong, first {f}"))
}

/// Elements `from` sends `to` in an all-to-allv (0 to `max`).
fn pair_count(s: &Spec, from: usize, to: usize) -> usize {
    (mix(s.salt ^ ((from as u64) << 20) ^ to as u64) % (s.count as u64 + 1)) as usize
}

type Outcome = oxccl::Result<Option<String>>;

/// Runs `s` on this rank and checks it: `Ok(None)` when right, `Ok(Some(what was wrong))`,
/// or the call's error.
fn run<T: Element>(comm: &Communicator, s: &Spec) -> Outcome {
    let (rank, n, c) = (comm.rank(), N, s.count);
    let (op, root, ip) = (s.op, s.root, s.in_place);
    let all = |idx: u64| reduced(s, idx);
    let unchanged = |input: &[T], before: &[T]| -> Option<String> {
        (input != before).then(|| "the input buffer changed".to_string())
    };
    Ok(match s.kind {
        "all_reduce" => {
            let inp: Vec<T> = input(s, rank, 0..c as u64);
            let got = if ip {
                let mut b = inp;
                comm.all_reduce_in_place(&mut b, op)?;
                b
            } else {
                let mut out = vec![sentinel::<T>(); c];
                comm.all_reduce(&inp, &mut out, op)?;
                out
            };
            compare(&got, |i| all(i as u64), c)
        }
        "reduce_scatter" => {
            let inp: Vec<T> = input(s, rank, 0..(n * c) as u64);
            let got = if ip {
                let mut b = inp;
                comm.reduce_scatter_in_place(&mut b, op)?;
                b[rank * c..(rank + 1) * c].to_vec()
            } else {
                let mut out = vec![sentinel::<T>(); c];
                let before = inp.clone();
                comm.reduce_scatter(&inp, &mut out, op)?;
                if let Some(w) = unchanged(&inp, &before) {
                    return Ok(Some(w));
                }
                out
            };
            compare(&got, |i| all((rank * c + i) as u64), c)
        }
        "reduce" => {
            let inp: Vec<T> = input(s, rank, 0..c as u64);
            let got = if ip {
                let mut b = inp;
                comm.reduce_in_place(&mut b, op, root)?;
                b
            } else {
                let mut out = vec![sentinel::<T>(); if rank == root { c } else { 0 }];
                comm.reduce(&inp, &mut out, op, root)?;
                out
            };
            if rank != root {
                return Ok(None);
            }
            compare(&got, |i| all(i as u64), c)
        }
        "all_gather" => {
            let inp: Vec<T> = input(s, rank, 0..c as u64);
            let got = if ip {
                let mut b = vec![sentinel::<T>(); n * c];
                b[rank * c..(rank + 1) * c].copy_from_slice(&inp);
                comm.all_gather_in_place(&mut b)?;
                b
            } else {
                let mut out = vec![sentinel::<T>(); n * c];
                comm.all_gather(&inp, &mut out)?;
                out
            };
            compare(&got, |i| val(s, i / c, (i % c) as u64), n * c)
        }
        "broadcast" => {
            let data: Vec<T> = input(s, root, 0..c as u64);
            let got = if ip {
                let mut b = if rank == root {
                    data
                } else {
                    vec![sentinel::<T>(); c]
                };
                comm.broadcast_in_place(&mut b, root)?;
                b
            } else {
                let inp = if rank == root { data } else { Vec::new() };
                let mut out = vec![sentinel::<T>(); c];
                comm.broadcast(&inp, &mut out, root)?;
                out
            };
            compare(&got, |i| val(s, root, i as u64), c)
        }
        "all_to_all" => {
            let inp: Vec<T> = input(s, rank, 0..(n * c) as u64);
            let got = if ip {
                let mut b = inp;
                comm.all_to_all_in_place(&mut b)?;
                b
            } else {
                let mut out = vec![sentinel::<T>(); n * c];
                let before = inp.clone();
                comm.all_to_all(&inp, &mut out)?;
                if let Some(w) = unchanged(&inp, &before) {
                    return Ok(Some(w));
                }
                out
            };
            compare(&got, |i| val(s, i / c, (rank * c + i % c) as u64), n * c)
        }
        "all_to_allv" => {
            let send: Vec<usize> = (0..n).map(|j| pair_count(s, rank, j)).collect();
            let recv: Vec<usize> = (0..n).map(|i| pair_count(s, i, rank)).collect();
            // Element k of the block from `from` to `to` is `from`'s value at (to << 32 | k).
            let code = |to: usize, k: usize| ((to as u64) << 32) | k as u64;
            let inp: Vec<T> = (0..n)
                .flat_map(|j| (0..send[j]).map(move |k| code(j, k)))
                .map(|x| T::from_f64(val(s, rank, x)))
                .collect();
            let want: Vec<f64> = (0..n)
                .flat_map(|i| (0..recv[i]).map(move |k| (i, k)))
                .map(|(i, k)| val(s, i, code(rank, k)))
                .collect();
            let mut out = vec![sentinel::<T>(); want.len()];
            comm.all_to_allv(&inp, &send, &mut out, &recv)?;
            compare(&out, |i| want[i], want.len())
        }
        "gather" => {
            let inp: Vec<T> = input(s, rank, 0..c as u64);
            let got = if ip {
                let mut b = if rank == root {
                    let mut b = vec![sentinel::<T>(); n * c];
                    b[rank * c..(rank + 1) * c].copy_from_slice(&inp);
                    b
                } else {
                    inp
                };
                // No typed in-place gather: the raw entry point takes it.
                let coll = Collective::Gather { count: c, root };
                comm.run(&coll, T::DTYPE, op, Buffers::InPlace(as_bytes_mut(&mut b)))?;
                b
            } else {
                let mut out = vec![sentinel::<T>(); if rank == root { n * c } else { 0 }];
                comm.gather(&inp, &mut out, root)?;
                out
            };
            if rank != root {
                return Ok(None);
            }
            compare(&got, |i| val(s, i / c, (i % c) as u64), n * c)
        }
        "scatter" => {
            let data: Vec<T> = input(s, root, 0..(n * c) as u64);
            let got = if ip {
                let mut b = if rank == root {
                    data
                } else {
                    vec![sentinel::<T>(); c]
                };
                let coll = Collective::Scatter { count: c, root };
                comm.run(&coll, T::DTYPE, op, Buffers::InPlace(as_bytes_mut(&mut b)))?;
                if rank == root {
                    b[rank * c..(rank + 1) * c].to_vec()
                } else {
                    b
                }
            } else {
                let inp = if rank == root { data } else { Vec::new() };
                let mut out = vec![sentinel::<T>(); c];
                comm.scatter(&inp, &mut out, root)?;
                out
            };
            compare(&got, |i| val(s, root, (rank * c + i) as u64), c)
        }
        "barrier" => {
            comm.barrier()?;
            None
        }
        "send_recv" => {
            // Both directions between `root` and `peer`: the lower rank sends first.
            let (a, b) = (root, s.peer);
            if rank != a && rank != b {
                return Ok(None);
            }
            let other = if rank == a { b } else { a };
            let data: Vec<T> = input(s, rank, 0..c as u64);
            let mut got = vec![sentinel::<T>(); c];
            if rank < other {
                comm.send(&data, other)?;
                comm.recv(&mut got, other)?;
            } else {
                comm.recv(&mut got, other)?;
                comm.send(&data, other)?;
            }
            compare(&got, |i| val(s, other, i as u64), c)
        }
        other => panic!("unknown kind {other:?}"),
    })
}

fn run_typed(comm: &Communicator, s: &Spec) -> Outcome {
    match s.dtype {
        DataType::I8 => run::<i8>(comm, s),
        DataType::U8 => run::<u8>(comm, s),
        DataType::I32 => run::<i32>(comm, s),
        DataType::U32 => run::<u32>(comm, s),
        DataType::I64 => run::<i64>(comm, s),
        DataType::U64 => run::<u64>(comm, s),
        DataType::F16 => run::<half::f16>(comm, s),
        DataType::Bf16 => run::<half::bf16>(comm, s),
        DataType::F32 => run::<f32>(comm, s),
        DataType::F64 => run::<f64>(comm, s),
        DataType::F8E4M3 => run::<oxccl::F8E4M3>(comm, s),
        DataType::F8E5M2 => run::<oxccl::F8E5M2>(comm, s),
    }
}

/// (resident KiB, open descriptors) of this process, after giving freed heap back to the
/// system (what the test's own buffers leave behind is not the library's growth).
fn footprint() -> (i64, i64) {
    // SAFETY: malloc_trim only releases free memory at the allocator's discretion.
    unsafe {
        libc::malloc_trim(0);
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(-1);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(-1, |d| d.count() as i64);
    (rss, fds)
}

/// The warm-up's end: call 1,000, or half of a shorter run.
fn warm_call(calls: u64) -> u64 {
    1000.min(calls / 2).max(1)
}

fn soak(args: &Value) -> Value {
    let seed = args["seed"].as_u64().unwrap();
    let calls = args["calls"].as_u64().unwrap();
    let kinds: Vec<&'static str> = args["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| *COLLECTIVES.iter().find(|x| **x == k).expect("a known kind"))
        .collect();
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    assert_eq!(comm.world_size(), N);
    let mut rng = Rng(seed);
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut nfail = 0u64;
    let mut error = Value::Null;
    let mut done = 0;
    let mut per_kind = std::collections::BTreeMap::<&str, u64>::new();
    // (call, RSS KiB, open fds) after the warm-up and every twentieth of the run after it.
    let warm = warm_call(calls);
    let every = ((calls - warm) / 20).max(1);
    let mut samples = Vec::new();
    // First every kind once at the largest size the run can draw (f64, in and out of place),
    // so that the allocator's high-water mark and the library's caches reach their size
    // before RSS is sampled: a large call first met late in the run is not growth (one seed
    // drew its largest all-to-allv after call 5,000, and RSS rose 10 MiB there, once).
    for (i, kind) in kinds.iter().enumerate() {
        for in_place in [false, true] {
            let s = Spec {
                kind,
                dtype: DataType::F64,
                op: ReduceOp::Sum,
                root: 0,
                count: MAX_COUNT,
                in_place,
                peer: 1,
                salt: mix(seed ^ !(2 * i as u64 + u64::from(in_place))),
            };
            match run_typed(&comm, &s) {
                Ok(None) => {}
                Ok(Some(w)) => {
                    nfail += 1;
                    failures.push(format!("warm-up {s:?}: {w}"));
                }
                Err(e) => panic!("warm-up {s:?}: {} error: {e}", error_kind(&e)),
            }
        }
    }
    for call in 1..=calls {
        let s = draw(&mut rng, call, seed, &kinds);
        match run_typed(&comm, &s) {
            Ok(None) => {}
            Ok(Some(w)) => {
                nfail += 1;
                if failures.len() < 20 {
                    failures.push(format!("call {call} {s:?}: {w}"));
                }
            }
            Err(e) => {
                error = json!(format!("call {call} {s:?}: {} error: {e}", error_kind(&e)));
                break;
            }
        }
        *per_kind.entry(s.kind).or_default() += 1;
        done = call;
        if call >= warm && ((call - warm).is_multiple_of(every) || call == calls) {
            let (rss, fds) = footprint();
            samples.push(json!([call, rss, fds]));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let destroy = comm.destroy().err().map(|e| e.to_string());
    json!({
        "calls": done, "nfail": nfail, "failures": failures, "error": error,
        "destroy": destroy, "secs": secs, "per_kind": per_kind, "samples": samples,
    })
}

/// What a rank's samples say: RSS after the warm-up and at the end, the growth (the highest
/// RSS of the second half of the run minus that of the first: the library's bounded caches
/// make RSS swing by several MiB between calls, which comparing two single samples would
/// take for growth or hide), and open descriptors after the warm-up and at most later.
struct Footprint {
    rss_warm: i64,
    rss_end: i64,
    growth: i64,
    fd_warm: i64,
    fd_max: i64,
    fd_end: i64,
}

fn footprint_of(v: &Value) -> Option<Footprint> {
    let s: Vec<(u64, i64, i64)> = serde_json::from_value(v["samples"].clone()).ok()?;
    let (first, last) = (s.first()?, s.last()?);
    let mid = (first.0 + last.0) / 2;
    let peak = |f: &dyn Fn(u64) -> bool| s.iter().filter(|x| f(x.0)).map(|x| x.1).max();
    Some(Footprint {
        rss_warm: first.1,
        rss_end: last.1,
        growth: peak(&|c| c > mid)? - peak(&|c| c <= mid)?,
        fd_warm: first.2,
        fd_max: s.iter().map(|x| x.2).max()?,
        fd_end: last.2,
    })
}

#[test]
fn soak_random_collectives_shm() {
    let test = "soak_random_collectives_shm";
    let calls: u64 = std::env::var("OXCCL_SOAK_CALLS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(10_000);
    let seed: u64 = std::env::var("OXCCL_SOAK_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).expect("getrandom");
            u64::from_le_bytes(b)
        });
    let kinds: Vec<String> = match std::env::var("OXCCL_SOAK_KINDS") {
        Ok(k) if !k.trim().is_empty() => k.split(',').map(|s| s.trim().to_string()).collect(),
        _ => COLLECTIVES.iter().map(|k| k.to_string()).collect(),
    };
    if let Some(k) = kinds.iter().find(|k| !COLLECTIVES.contains(&k.as_str())) {
        panic!("OXCCL_SOAK_KINDS: unknown kind {k:?} (known: {COLLECTIVES:?})");
    }
    println!("{test}: {calls} calls, seed {seed} (replay with OXCCL_SOAK_SEED={seed})");
    let start = Instant::now();
    let env = [("OXCCL_PROVIDER", "shm"), ("OXCCL_TIMEOUT", "30")];
    let args = json!({ "seed": seed, "calls": calls, "kinds": kinds });
    let mut job = spawn_job(N, &env, "soak", &args, &|_, exe| Command::new(exe));
    // A hang inside the library ends at OXCCL_TIMEOUT; this bounds everything else.
    let deadline = Instant::now() + Duration::from_secs(120) + Duration::from_millis(30 * calls);
    job.wait_until(deadline, |j| (0..N).all(|r| j.exited(r).is_some()));
    let outs = job.finish(Duration::from_secs(1));
    let results = common::expect_results(test, &outs);
    let ctx = format!("{test} (seed {seed}, {calls} calls)");
    println!(
        "{test}: {:.1} s; per rank: RSS after call {} and at the end, growth (peak of the \
         second half - peak of the first), open descriptors",
        start.elapsed().as_secs_f64(),
        warm_call(calls)
    );
    let mut fails = Vec::new();
    for (r, v) in results.iter().enumerate() {
        if v["calls"] != calls || !v["error"].is_null() || !v["destroy"].is_null() {
            fails.push(format!(
                "rank {r}: {} of {calls} calls; error {}; destroy {}",
                v["calls"], v["error"], v["destroy"]
            ));
        }
        if v["nfail"] != 0 {
            fails.push(format!(
                "rank {r}: {} wrong results: {}",
                v["nfail"], v["failures"]
            ));
        }
        if v["calls"] != calls {
            continue;
        }
        let Some(f) = footprint_of(v) else {
            fails.push(format!("rank {r}: no footprint samples: {}", v["samples"]));
            continue;
        };
        println!(
            "  rank {r}: {} calls in {:.1} s; RSS {} -> {} KiB, growth {:+} KiB; fds {} -> {} \
             (at most {})",
            v["calls"],
            v["secs"].as_f64().unwrap_or(0.0),
            f.rss_warm,
            f.rss_end,
            f.growth,
            f.fd_warm,
            f.fd_end,
            f.fd_max
        );
        if f.fd_warm < 0 || f.rss_warm < 0 || f.fd_max > f.fd_warm {
            fails.push(format!(
                "rank {r}: open descriptors grew: {} after the warm-up, {} at most later",
                f.fd_warm, f.fd_max
            ));
        }
        if f.growth > RSS_GROWTH_MAX_KB {
            fails.push(format!(
                "rank {r}: RSS grew by {} KiB (limit {RSS_GROWTH_MAX_KB} KiB): samples {}",
                f.growth, v["samples"]
            ));
        }
    }
    println!("  calls per kind: {}", results[0]["per_kind"]);
    assert!(
        fails.is_empty(),
        "{ctx}:\n  {}{}",
        fails.join("\n  "),
        report(&outs)
    );
}

/// Rank r sends `m[r][j]` elements to rank j (element k of the block is `r * 10^6 + k`), then
/// checks what it received.
fn all_to_allv_matrix(args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let rank = comm.rank();
    let m: Vec<Vec<usize>> = serde_json::from_value(args["m"].clone()).expect("a matrix");
    let send: Vec<usize> = (0..N).map(|j| m[rank][j]).collect();
    let recv: Vec<usize> = (0..N).map(|i| m[i][rank]).collect();
    let code = |from: usize, k: usize| (from * 1_000_000 + k) as i32;
    let input: Vec<i32> = (0..N)
        .flat_map(|j| (0..send[j]).map(move |k| code(rank, k)))
        .collect();
    let want: Vec<i32> = (0..N)
        .flat_map(|i| (0..recv[i]).map(move |k| code(i, k)))
        .collect();
    let mut out = vec![-1i32; want.len()];
    let r = comm.all_to_allv(&input, &send, &mut out, &recv);
    let wrong = r.is_ok() && out != want;
    let r = r.err().map(|e| e.to_string());
    let destroy = comm.destroy().err().map(|e| e.to_string());
    json!({ "error": r, "wrong": wrong, "destroy": destroy })
}

/// One pair of an all-to-allv moves more than a mailbox holds (64 KiB), the others nothing:
/// every rank must agree on how the call runs (regression: the ranks whose own blocks fit
/// chose mailboxes, the two with the large block slots, and every rank reported a false
/// `Mismatch`; the soak found it).
#[test]
fn all_to_allv_with_one_block_over_the_mailbox_size_shm() {
    for big in [16_384usize, 16_385, 100_000] {
        let mut m = vec![vec![0usize; N]; N];
        m[0][3] = big;
        m[2][1] = 5;
        let outs = common::run_ranks(
            N,
            &[("OXCCL_PROVIDER", "shm")],
            "all_to_allv_matrix",
            &json!({ "m": m }),
        );
        let name = format!("all_to_allv, rank 0 sends {big} int32 to rank 3");
        let results = common::expect_results(&name, &outs);
        for (r, v) in results.iter().enumerate() {
            assert!(
                v["error"].is_null() && v["wrong"] == false && v["destroy"].is_null(),
                "{name}: rank {r}: {v}{}",
                report(&outs)
            );
        }
    }
}

/// Rank r and its partner r ^ 1 take turns sending `bytes` in an all-to-allv after a barrier,
/// `iters` times, each from a fresh buffer that is overwritten as soon as the call returns;
/// the receiver checks it got the sender's pattern. (One direction at a time: a sender whose
/// call waits for nothing else returns as soon as it thinks its send is done.)
fn reuse_after_return(args: &Value) -> Value {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("init: {e}"));
    let (rank, n) = (comm.rank(), comm.world_size());
    let bytes = args["bytes"].as_u64().unwrap() as usize;
    let iters = args["iters"].as_u64().unwrap();
    let partner = rank ^ 1;
    let pattern = |from: usize, it: u64, k: usize| (mix(it * 64 + from as u64) as usize + k) as u8;
    let mut wrong = Vec::new();
    for it in 0..iters {
        let sender = (it % 2) as usize;
        let (mut send, mut recv) = (vec![0usize; n], vec![0usize; n]);
        if rank % 2 == sender {
            send[partner] = bytes;
        } else {
            recv[partner] = bytes;
        }
        let r = comm.barrier().and_then(|()| {
            let mut input: Vec<u8> = (0..send[partner]).map(|k| pattern(rank, it, k)).collect();
            let mut out = vec![0u8; recv[partner]];
            comm.all_to_allv(&input, &send, &mut out, &recv)?;
            // The caller may reuse its buffer once the call returned.
            input.fill(0xee);
            drop(input);
            Ok(out)
        });
        match r {
            Ok(out) => {
                if let Some(k) = (0..out.len()).find(|&k| out[k] != pattern(partner, it, k)) {
                    wrong.push(format!("call {it}: byte {k} is {:#x}", out[k]));
                }
            }
            Err(e) => return json!({ "error": e.to_string(), "wrong": wrong }),
        }
        if wrong.len() >= 5 {
            break;
        }
    }
    let destroy = comm.destroy().err().map(|e| e.to_string());
    json!({ "error": destroy, "wrong": wrong })
}

/// A call returns only once the transport is done with the caller's buffers: a small call's
/// inline fragments are not waited for, and a completion of one that arrived during the next
/// call counted for that call's step with the same index, which then returned before its
/// last fragment was sent. The caller freed the buffer and the tcp provider failed with
/// `EFAULT` ("sending to the peer failed: Bad address"; seen in the link probe at init, a
/// barrier then a 1 MiB all-to-allv from a fresh buffer), or reused it and the peer got what
/// it held next. Over tcp inside a namespace host whose sockets have small send buffers
/// (`net.ipv4.tcp_wmem`, per namespace), so that a fragment still waits in the provider when
/// such a call returns: the old code failed every run, 0xee bytes arriving within 40 calls.
#[test]
fn a_buffer_is_reused_only_after_its_call_returned_tcp_netns() {
    let name = "a_buffer_is_reused_only_after_its_call_returned_tcp_netns";
    if !oxccl_testbed::require(name, Testbed::available()) {
        return;
    }
    let tb = Testbed::new(&[HostSpec::unshaped()]).expect("creating the test bed");
    let set = tb
        .command(0, "sh")
        .args([
            "-c",
            "echo '4096 16384 16384' > /proc/sys/net/ipv4/tcp_wmem",
        ])
        .status()
        .expect("running sh in the bed");
    assert!(set.success(), "setting tcp_wmem in the bed's host: {set}");
    let master = tb.host_addr(0).to_string();
    let env = [
        ("OXCCL_PROVIDER", "tcp"),
        ("OXCCL_TOPO_PROBE", "0"),
        ("MASTER_ADDR", master.as_str()),
    ];
    let args = json!({ "bytes": 256 << 10, "iters": 80 });
    let job = spawn_job(N, &env, "reuse_after_return", &args, &|_, exe| {
        tb.command(0, exe)
    });
    let outs = job.finish(Duration::from_secs(120));
    let results = common::expect_results(name, &outs);
    for (r, v) in results.iter().enumerate() {
        assert!(
            v["error"].is_null() && v["wrong"].as_array().is_some_and(|w| w.is_empty()),
            "rank {r}: {v}{}",
            report(&outs)
        );
    }
}
