//! Every collective, data type, operator, count and buffer layout, run by real processes over
//! the real providers and checked against a reference each rank computes locally.
//!
//! Each test launches one job (see `common::run_ranks`); its ranks run a whole [`Plan`] on one
//! communicator, recording every wrong result rather than stopping, and report a summary that
//! the test asserts on. Inputs are a deterministic function of (seed, rank, index), so each rank
//! knows every rank's input. Values are small integers (sums exact in every type: -1, 0 and 1
//! for the 8-bit floats, whose partial sums up to 8 ranks stay exact; products of ±1 and 2 with
//! at most two 2s per element), so only `avg` on floating types needs a tolerance. (The error
//! bound of fp8 sums of arbitrary values is `tests/fp8.rs`'s subject.)

mod common;

use std::time::{Duration, Instant};

use oxccl::schedule::Collective;
use oxccl::{Buffers, Communicator, DataType, Element, ReduceOp, Work, as_bytes_mut};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use common::{error_kind, expect_results, mix, run_ranks};

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    common::child_entry(dispatch);
}

fn dispatch(scenario: &str, args: &Value) -> Value {
    match scenario {
        "plan" => run_plan(serde_json::from_value(args.clone()).expect("a plan")),
        other => panic!("unknown scenario {other:?}"),
    }
}

/// What one job runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Plan {
    seed: u64,
    /// Sections to run, in this order (see [`run_section`]).
    sections: Vec<String>,
    /// (type, operator) pairs for all-reduce, reduce-scatter and reduce.
    reduce_pairs: Vec<(DataType, ReduceOp)>,
    /// Types for the collectives that move data without reducing it.
    move_dtypes: Vec<DataType>,
    /// Element counts (per rank where the collective counts per rank).
    counts: Vec<usize>,
    /// Both layouts, or only one.
    in_place: Vec<bool>,
    /// The large count of the "large" section (f32 sum, several chunks and channels).
    large: usize,
}

/// The plan's sections besides one per collective (`common::COLLECTIVES`).
const MORE_SECTIONS: [&str; 4] = ["large", "unaligned", "nonblocking", "split"];

fn all_pairs() -> Vec<(DataType, ReduceOp)> {
    DataType::ALL
        .into_iter()
        .flat_map(|d| ReduceOp::ALL.into_iter().map(move |o| (d, o)))
        .collect()
}

/// Every type with `sum`, and every operator with a few types of each kind.
fn some_pairs() -> Vec<(DataType, ReduceOp)> {
    let mut v: Vec<_> = DataType::ALL
        .into_iter()
        .map(|d| (d, ReduceOp::Sum))
        .collect();
    for (i, op) in ReduceOp::ALL.into_iter().enumerate().skip(1) {
        for d in [
            DataType::F32,
            DataType::I8,
            DataType::U64,
            DataType::Bf16,
            DataType::F8E4M3,
        ] {
            v.push((d, op));
        }
        v.push((DataType::ALL[(3 * i) % DataType::ALL.len()], op));
    }
    v.dedup();
    v
}

impl Plan {
    /// Everything: every pair, type, count, layout and (for rooted collectives) every root.
    fn full(seed: u64) -> Plan {
        Plan {
            seed,
            sections: common::COLLECTIVES
                .iter()
                .chain(&MORE_SECTIONS)
                .map(|s| s.to_string())
                .collect(),
            reduce_pairs: all_pairs(),
            move_dtypes: DataType::ALL.to_vec(),
            counts: vec![0, 1, 7, 1000],
            in_place: vec![false, true],
            large: 300_007,
        }
    }

    fn sections(mut self, s: &[&str]) -> Plan {
        self.sections = s.iter().map(|s| s.to_string()).collect();
        self
    }
}

type R = Result<(), String>;

/// One rank's view while it runs a plan.
struct Cx<'a> {
    comm: &'a Communicator,
    rank: usize,
    n: usize,
    seed: u64,
    calls: u64,
    checks: u64,
    nfailures: u64,
    failures: Vec<String>,
}

fn signed(d: DataType) -> bool {
    !matches!(d, DataType::U8 | DataType::U32 | DataType::U64)
}

/// An 8-bit float: reduced inputs stay within -1..=1 so that every partial sum is exact.
fn fp8(d: DataType) -> bool {
    matches!(d, DataType::F8E4M3 | DataType::F8E5M2)
}

/// An output's initial value, outside every input range.
fn sentinel<T: Element>() -> T {
    T::from_f64(if T::DTYPE.is_float() {
        12345.0
    } else if signed(T::DTYPE) {
        127.0
    } else {
        255.0
    })
}

/// Relative tolerance: only `avg` of floating types rounds.
fn tolerance(d: DataType, op: Option<ReduceOp>) -> f64 {
    match (op, d) {
        (Some(ReduceOp::Avg), DataType::F16) => 1e-3,
        (Some(ReduceOp::Avg), DataType::Bf16) => 1e-2,
        (Some(ReduceOp::Avg), DataType::F32) => 1e-6,
        (Some(ReduceOp::Avg), DataType::F64) => 1e-12,
        // One rounding (the division) of an exact sum: the unit roundoff.
        (Some(ReduceOp::Avg), DataType::F8E4M3) => 1.0 / 16.0,
        (Some(ReduceOp::Avg), DataType::F8E5M2) => 1.0 / 8.0,
        _ => 0.0,
    }
}

fn label(
    coll: &str,
    d: DataType,
    op: Option<ReduceOp>,
    count: usize,
    root: Option<usize>,
    in_place: bool,
) -> String {
    let mut s = format!("{coll} {d}");
    if let Some(op) = op {
        s += &format!(" {op}");
    }
    s += &format!(" count {count}");
    if let Some(r) = root {
        s += &format!(" root {r}");
    }
    s += if in_place {
        " in place"
    } else {
        " out of place"
    };
    s
}

impl Cx<'_> {
    /// Rank `rank`'s input element `idx`: for reductions small values (±1 and 2 for `prod`,
    /// with a 2 from at most 2 of 8 ranks), otherwise a wider range.
    fn val(&self, d: DataType, op: Option<ReduceOp>, rank: usize, idx: u64) -> f64 {
        let h = mix(self.seed ^ mix(((rank as u64) << 44) ^ idx));
        match op {
            Some(ReduceOp::Prod) => {
                let mag = if (rank as u64 + idx).is_multiple_of(4) {
                    2.0
                } else {
                    1.0
                };
                if signed(d) && h.is_multiple_of(3) {
                    -mag
                } else {
                    mag
                }
            }
            Some(_) if fp8(d) => (h % 3) as f64 - 1.0,
            Some(_) if signed(d) => (h % 17) as f64 - 8.0,
            Some(_) => (h % 16) as f64,
            None if signed(d) => (h % 201) as f64 - 100.0,
            None => (h % 200) as f64,
        }
    }

    fn input<T: Element>(
        &self,
        op: Option<ReduceOp>,
        rank: usize,
        idx: impl Iterator<Item = u64>,
    ) -> Vec<T> {
        idx.map(|i| T::from_f64(self.val(T::DTYPE, op, rank, i)))
            .collect()
    }

    /// The reference reduction of element `idx` over `ranks`.
    fn reduced(&self, d: DataType, op: ReduceOp, ranks: &[usize], idx: u64) -> f64 {
        let v = ranks.iter().map(|&r| self.val(d, Some(op), r, idx));
        match op {
            ReduceOp::Sum => v.sum(),
            ReduceOp::Prod => v.product(),
            ReduceOp::Min => v.fold(f64::INFINITY, f64::min),
            ReduceOp::Max => v.fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Avg => {
                let mean = v.sum::<f64>() / ranks.len() as f64;
                if d.is_float() { mean } else { mean.trunc() }
            }
        }
    }

    fn all(&self) -> Vec<usize> {
        (0..self.n).collect()
    }

    /// A library call: an error ends the plan (the communicator is unusable after one).
    fn call(&mut self, what: &str, r: oxccl::Result<()>) -> R {
        self.calls += 1;
        r.map_err(|e| format!("{what}: {} error: {e}", error_kind(&e)))
    }

    fn fail(&mut self, msg: String) {
        self.nfailures += 1;
        if self.failures.len() < 20 {
            self.failures.push(format!("rank {}: {msg}", self.rank));
        }
    }

    /// Compares `got` with the reference values `want` (after conversion to `T`).
    fn compare<T: Element>(&mut self, what: &str, got: &[T], want: &[f64], tol: f64) {
        self.checks += 1;
        if got.len() != want.len() {
            self.fail(format!(
                "{what}: {} elements, {} expected",
                got.len(),
                want.len()
            ));
            return;
        }
        let mut wrong = 0usize;
        let mut first = Vec::new();
        for (i, (g, &w)) in got.iter().zip(want).enumerate() {
            let g = g.to_f64();
            let ok = if tol == 0.0 {
                g == T::from_f64(w).to_f64()
            } else {
                (g - w).abs() <= tol * w.abs().max(1.0)
            };
            if !ok {
                wrong += 1;
                if first.len() < 4 {
                    first.push(format!("[{i}] = {g}, expected {w}"));
                }
            }
        }
        if wrong > 0 {
            self.fail(format!(
                "{what}: {wrong} of {} elements wrong: {}",
                got.len(),
                first.join("; ")
            ));
        }
    }

    fn unchanged<T: Element>(&mut self, what: &str, input: &[T], before: &[T]) {
        self.checks += 1;
        if input != before {
            self.fail(format!("{what}: the input buffer changed"));
        }
    }
}

macro_rules! typed {
    ($d:expr, $f:ident ( $($a:expr),* )) => {
        match $d {
            DataType::I8 => $f::<i8>($($a),*),
            DataType::U8 => $f::<u8>($($a),*),
            DataType::I32 => $f::<i32>($($a),*),
            DataType::U32 => $f::<u32>($($a),*),
            DataType::I64 => $f::<i64>($($a),*),
            DataType::U64 => $f::<u64>($($a),*),
            DataType::F16 => $f::<half::f16>($($a),*),
            DataType::Bf16 => $f::<half::bf16>($($a),*),
            DataType::F32 => $f::<f32>($($a),*),
            DataType::F64 => $f::<f64>($($a),*),
            DataType::F8E4M3 => $f::<oxccl::F8E4M3>($($a),*),
            DataType::F8E5M2 => $f::<oxccl::F8E5M2>($($a),*),
        }
    };
}

fn all_reduce<T: Element>(cx: &mut Cx, op: ReduceOp, count: usize, in_place: bool) -> R {
    let (comm, d) = (cx.comm, T::DTYPE);
    let what = label("all_reduce", d, Some(op), count, None, in_place);
    let input: Vec<T> = cx.input(Some(op), cx.rank, 0..count as u64);
    let got = if in_place {
        let mut buf = input.clone();
        cx.call(&what, comm.all_reduce_in_place(&mut buf, op))?;
        buf
    } else {
        let before = input.clone();
        let mut out = vec![sentinel::<T>(); count];
        cx.call(&what, comm.all_reduce(&input, &mut out, op))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    let all = cx.all();
    let want: Vec<f64> = (0..count as u64)
        .map(|i| cx.reduced(d, op, &all, i))
        .collect();
    cx.compare(&what, &got, &want, tolerance(d, Some(op)));
    Ok(())
}

fn reduce_scatter<T: Element>(cx: &mut Cx, op: ReduceOp, count: usize, in_place: bool) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let what = label("reduce_scatter", d, Some(op), count, None, in_place);
    let input: Vec<T> = cx.input(Some(op), rank, 0..(n * count) as u64);
    let got = if in_place {
        let mut buf = input.clone();
        cx.call(&what, comm.reduce_scatter_in_place(&mut buf, op))?;
        buf[rank * count..(rank + 1) * count].to_vec()
    } else {
        let before = input.clone();
        let mut out = vec![sentinel::<T>(); count];
        cx.call(&what, comm.reduce_scatter(&input, &mut out, op))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    let all = cx.all();
    let want: Vec<f64> = (0..count)
        .map(|i| cx.reduced(d, op, &all, (rank * count + i) as u64))
        .collect();
    cx.compare(&what, &got, &want, tolerance(d, Some(op)));
    Ok(())
}

fn reduce<T: Element>(cx: &mut Cx, op: ReduceOp, count: usize, root: usize, in_place: bool) -> R {
    let (comm, d, rank) = (cx.comm, T::DTYPE, cx.rank);
    let what = label("reduce", d, Some(op), count, Some(root), in_place);
    let input: Vec<T> = cx.input(Some(op), rank, 0..count as u64);
    let got = if in_place {
        let mut buf = input.clone();
        cx.call(&what, comm.reduce_in_place(&mut buf, op, root))?;
        buf
    } else {
        let before = input.clone();
        // Non-roots pass an empty output, which the API allows.
        let mut out = vec![sentinel::<T>(); if rank == root { count } else { 0 }];
        cx.call(&what, comm.reduce(&input, &mut out, op, root))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    if rank == root {
        let all = cx.all();
        let want: Vec<f64> = (0..count as u64)
            .map(|i| cx.reduced(d, op, &all, i))
            .collect();
        cx.compare(&what, &got, &want, tolerance(d, Some(op)));
    }
    Ok(())
}

fn all_gather<T: Element>(cx: &mut Cx, count: usize, in_place: bool) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let what = label("all_gather", d, None, count, None, in_place);
    let input: Vec<T> = cx.input(None, rank, 0..count as u64);
    let got = if in_place {
        let mut buf = vec![sentinel::<T>(); n * count];
        buf[rank * count..(rank + 1) * count].copy_from_slice(&input);
        cx.call(&what, comm.all_gather_in_place(&mut buf))?;
        buf
    } else {
        let before = input.clone();
        let mut out = vec![sentinel::<T>(); n * count];
        cx.call(&what, comm.all_gather(&input, &mut out))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    let want: Vec<f64> = (0..n)
        .flat_map(|b| (0..count as u64).map(move |i| (b, i)))
        .map(|(b, i)| cx.val(d, None, b, i))
        .collect();
    cx.compare(&what, &got, &want, 0.0);
    Ok(())
}

fn broadcast<T: Element>(cx: &mut Cx, count: usize, root: usize, in_place: bool) -> R {
    let (comm, d, rank) = (cx.comm, T::DTYPE, cx.rank);
    let what = label("broadcast", d, None, count, Some(root), in_place);
    let data: Vec<T> = cx.input(None, root, 0..count as u64);
    let got = if in_place {
        let mut buf = if rank == root {
            data.clone()
        } else {
            vec![sentinel::<T>(); count]
        };
        cx.call(&what, comm.broadcast_in_place(&mut buf, root))?;
        buf
    } else {
        // Non-roots pass an empty input, which the API allows.
        let input = if rank == root {
            data.clone()
        } else {
            Vec::new()
        };
        let mut out = vec![sentinel::<T>(); count];
        cx.call(&what, comm.broadcast(&input, &mut out, root))?;
        if rank == root {
            cx.unchanged(&what, &input, &data);
        }
        out
    };
    let want: Vec<f64> = (0..count as u64)
        .map(|i| cx.val(d, None, root, i))
        .collect();
    cx.compare(&what, &got, &want, 0.0);
    Ok(())
}

fn all_to_all<T: Element>(cx: &mut Cx, count: usize, in_place: bool) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let what = label("all_to_all", d, None, count, None, in_place);
    let input: Vec<T> = cx.input(None, rank, 0..(n * count) as u64);
    let got = if in_place {
        let mut buf = input.clone();
        cx.call(&what, comm.all_to_all_in_place(&mut buf))?;
        buf
    } else {
        let before = input.clone();
        let mut out = vec![sentinel::<T>(); n * count];
        cx.call(&what, comm.all_to_all(&input, &mut out))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    let want: Vec<f64> = (0..n)
        .flat_map(|i| (0..count).map(move |k| (i, k)))
        .map(|(i, k)| cx.val(d, None, i, (rank * count + k) as u64))
        .collect();
    cx.compare(&what, &got, &want, 0.0);
    Ok(())
}

/// Elements rank `from` sends rank `to` in all-to-allv round `salt`: the same on every rank.
fn pair_count(seed: u64, salt: u64, max: usize, from: usize, to: usize) -> usize {
    (mix(seed ^ mix(salt << 40 ^ (from as u64) << 20 ^ to as u64)) % (max as u64 + 1)) as usize
}

fn all_to_allv<T: Element>(cx: &mut Cx, max: usize, salt: u64) -> R {
    let (comm, d, n, rank, seed) = (cx.comm, T::DTYPE, cx.n, cx.rank, cx.seed);
    let what = format!("all_to_allv {d} up to {max} per pair (round {salt})");
    let send: Vec<usize> = (0..n)
        .map(|j| pair_count(seed, salt, max, rank, j))
        .collect();
    let recv: Vec<usize> = (0..n)
        .map(|i| pair_count(seed, salt, max, i, rank))
        .collect();
    // Element k of the block from `from` to `to` is `from`'s value at (to << 32 | k).
    let code = |to: usize, k: usize| ((to as u64) << 32) | k as u64;
    let input: Vec<T> = (0..n)
        .flat_map(|j| (0..send[j]).map(move |k| code(j, k)))
        .map(|c| T::from_f64(cx.val(d, None, rank, c)))
        .collect();
    let before = input.clone();
    let mut out = vec![sentinel::<T>(); recv.iter().sum()];
    cx.call(&what, comm.all_to_allv(&input, &send, &mut out, &recv))?;
    cx.unchanged(&what, &input, &before);
    let want: Vec<f64> = (0..n)
        .flat_map(|i| (0..recv[i]).map(move |k| (i, k)))
        .map(|(i, k)| cx.val(d, None, i, code(rank, k)))
        .collect();
    cx.compare(&what, &out, &want, 0.0);
    Ok(())
}

fn gather<T: Element>(cx: &mut Cx, count: usize, root: usize, in_place: bool) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let what = label("gather", d, None, count, Some(root), in_place);
    let input: Vec<T> = cx.input(None, rank, 0..count as u64);
    let got = if in_place {
        let mut buf = if rank == root {
            let mut b = vec![sentinel::<T>(); n * count];
            b[rank * count..(rank + 1) * count].copy_from_slice(&input);
            b
        } else {
            input.clone()
        };
        // No typed in-place gather: the raw entry point takes it.
        let coll = Collective::Gather { count, root };
        let bufs = Buffers::InPlace(as_bytes_mut(&mut buf));
        cx.call(&what, comm.run(&coll, T::DTYPE, ReduceOp::Sum, bufs))?;
        buf
    } else {
        let before = input.clone();
        let mut out = vec![sentinel::<T>(); if rank == root { n * count } else { 0 }];
        cx.call(&what, comm.gather(&input, &mut out, root))?;
        cx.unchanged(&what, &input, &before);
        out
    };
    if rank == root {
        let want: Vec<f64> = (0..n)
            .flat_map(|b| (0..count as u64).map(move |i| (b, i)))
            .map(|(b, i)| cx.val(d, None, b, i))
            .collect();
        cx.compare(&what, &got, &want, 0.0);
    }
    Ok(())
}

fn scatter<T: Element>(cx: &mut Cx, count: usize, root: usize, in_place: bool) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let what = label("scatter", d, None, count, Some(root), in_place);
    let data: Vec<T> = cx.input(None, root, 0..(n * count) as u64);
    let got = if in_place {
        let mut buf = if rank == root {
            data.clone()
        } else {
            vec![sentinel::<T>(); count]
        };
        let coll = Collective::Scatter { count, root };
        let bufs = Buffers::InPlace(as_bytes_mut(&mut buf));
        cx.call(&what, comm.run(&coll, T::DTYPE, ReduceOp::Sum, bufs))?;
        if rank == root {
            buf[rank * count..(rank + 1) * count].to_vec()
        } else {
            buf
        }
    } else {
        let input = if rank == root {
            data.clone()
        } else {
            Vec::new()
        };
        let mut out = vec![sentinel::<T>(); count];
        cx.call(&what, comm.scatter(&input, &mut out, root))?;
        if rank == root {
            cx.unchanged(&what, &input, &data);
        }
        out
    };
    let want: Vec<f64> = (0..count)
        .map(|i| cx.val(d, None, root, (rank * count + i) as u64))
        .collect();
    cx.compare(&what, &got, &want, 0.0);
    Ok(())
}

/// Rank r sends to r+1 and receives from r-1 (even ranks send first, odd ranks receive first,
/// which cannot deadlock even if a send waits for its receiver).
fn send_recv<T: Element>(cx: &mut Cx, count: usize) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let what = format!("send/recv {d} count {count} ({prev} -> {rank} -> {next})");
    let data: Vec<T> = cx.input(None, rank, 0..count as u64);
    let mut got = vec![sentinel::<T>(); count];
    if rank % 2 == 0 {
        cx.call(&what, comm.send(&data, next))?;
        cx.call(&what, comm.recv(&mut got, prev))?;
    } else {
        cx.call(&what, comm.recv(&mut got, prev))?;
        cx.call(&what, comm.send(&data, next))?;
    }
    let want: Vec<f64> = (0..count as u64)
        .map(|i| cx.val(d, None, prev, i))
        .collect();
    cx.compare(&what, &got, &want, 0.0);
    Ok(())
}

fn barrier(cx: &mut Cx) -> R {
    let (comm, n, rank) = (cx.comm, cx.n, cx.rank);
    let dir = common::shared_dir();
    for round in 0..4 {
        // Arrive (a file), wait, then every rank must have arrived.
        let path = |r: usize| dir.join(format!("round{round}-rank{r}"));
        if rank == round % n {
            std::thread::sleep(Duration::from_millis(30));
        }
        std::fs::write(path(rank), b"").map_err(|e| format!("barrier file: {e}"))?;
        cx.call(&format!("barrier round {round}"), comm.barrier())?;
        cx.checks += 1;
        let missing: Vec<usize> = (0..n).filter(|&r| !path(r).exists()).collect();
        if !missing.is_empty() {
            cx.fail(format!(
                "barrier round {round} returned before ranks {missing:?} arrived"
            ));
        }
    }
    Ok(())
}

fn large(cx: &mut Cx, count: usize) -> R {
    let n = cx.n;
    let per_rank = count / n;
    for in_place in [false, true] {
        all_reduce::<f32>(cx, ReduceOp::Sum, count, in_place)?;
        reduce_scatter::<f32>(cx, ReduceOp::Sum, per_rank, in_place)?;
        all_gather::<f32>(cx, per_rank, in_place)?;
        let root = if in_place { 0 } else { n - 1 };
        broadcast::<f32>(cx, count, root, in_place)?;
        reduce::<f32>(cx, ReduceOp::Sum, count, n - 1 - root, in_place)?;
        all_to_all::<f32>(cx, per_rank, in_place)?;
    }
    send_recv::<f32>(cx, count)?;
    Ok(())
}

/// Buffers at odd byte offsets (through the raw entry point): the reduction kernels and
/// transfers must not assume alignment.
fn unaligned<T: Element>(cx: &mut Cx, op: ReduceOp, count: usize) -> R {
    let (comm, d, n, rank) = (cx.comm, T::DTYPE, cx.n, cx.rank);
    let es = d.size();
    let all = cx.all();
    let typed_input: Vec<T> = cx.input(Some(op), rank, 0..(n * count) as u64);
    let bytes_of = |v: &[T]| oxccl::as_bytes(v).to_vec();
    let decode = |b: &[u8]| {
        let mut v = vec![T::from_f64(0.0); b.len() / es];
        as_bytes_mut(&mut v).copy_from_slice(b);
        v
    };
    // All-reduce, out of place: input at +1, output at +3.
    let what = format!("unaligned all_reduce {d} {op} count {count} out of place");
    let mut inb = vec![0u8; count * es + 8];
    inb[1..1 + count * es].copy_from_slice(&bytes_of(&typed_input[..count]));
    let mut outb = vec![0u8; count * es + 8];
    let coll = Collective::AllReduce { count };
    let bufs = Buffers::OutOfPlace {
        input: &inb[1..1 + count * es],
        output: &mut outb[3..3 + count * es],
    };
    cx.call(&what, comm.run(&coll, d, op, bufs))?;
    let want: Vec<f64> = (0..count as u64)
        .map(|i| cx.reduced(d, op, &all, i))
        .collect();
    cx.compare(
        &what,
        &decode(&outb[3..3 + count * es]),
        &want,
        tolerance(d, Some(op)),
    );
    // All-reduce in place at +5.
    let what = format!("unaligned all_reduce {d} {op} count {count} in place");
    let mut buf = vec![0u8; count * es + 8];
    buf[5..5 + count * es].copy_from_slice(&bytes_of(&typed_input[..count]));
    let bufs = Buffers::InPlace(&mut buf[5..5 + count * es]);
    cx.call(&what, comm.run(&coll, d, op, bufs))?;
    cx.compare(
        &what,
        &decode(&buf[5..5 + count * es]),
        &want,
        tolerance(d, Some(op)),
    );
    // Reduce-scatter in place at +1.
    let what = format!("unaligned reduce_scatter {d} {op} count {count} in place");
    let len = n * count * es;
    let mut buf = vec![0u8; len + 8];
    buf[1..1 + len].copy_from_slice(&bytes_of(&typed_input));
    let coll = Collective::ReduceScatter { count };
    cx.call(
        &what,
        comm.run(&coll, d, op, Buffers::InPlace(&mut buf[1..1 + len])),
    )?;
    let want: Vec<f64> = (0..count)
        .map(|i| cx.reduced(d, op, &all, (rank * count + i) as u64))
        .collect();
    let mine = &buf[1 + rank * count * es..1 + (rank + 1) * count * es];
    cx.compare(&what, &decode(mine), &want, tolerance(d, Some(op)));
    // All-gather out of place: input at +7, output at +1.
    let what = format!("unaligned all_gather {d} count {count} out of place");
    let mine: Vec<T> = cx.input(None, rank, 0..count as u64);
    let mut inb = vec![0u8; count * es + 8];
    inb[7..7 + count * es].copy_from_slice(&bytes_of(&mine));
    let mut outb = vec![0u8; len + 8];
    let bufs = Buffers::OutOfPlace {
        input: &inb[7..7 + count * es],
        output: &mut outb[1..1 + len],
    };
    cx.call(
        &what,
        comm.run(&Collective::AllGather { count }, d, op, bufs),
    )?;
    let want: Vec<f64> = (0..n)
        .flat_map(|b| (0..count as u64).map(move |i| (b, i)))
        .map(|(b, i)| cx.val(d, None, b, i))
        .collect();
    cx.compare(&what, &decode(&outb[1..1 + len]), &want, 0.0);
    Ok(())
}

fn wait<T>(cx: &mut Cx, what: &str, w: &mut Work<T>) -> Result<T, String> {
    cx.calls += 1;
    w.wait(Duration::from_secs(60))
        .map_err(|e| format!("{what}: {} error: {e}", error_kind(&e)))
}

/// Submitted work interleaved with blocking calls; results must not depend on the mix.
fn nonblocking(cx: &mut Cx, large: usize) -> R {
    let (comm, n, rank) = (cx.comm, cx.n, cx.rank);
    let all = cx.all();
    let sum = Some(ReduceOp::Sum);
    let a: Vec<f32> = cx.input(sum, rank, 0..1000);
    let mut w1 = comm.all_reduce_async(a, ReduceOp::Sum);
    let b: Vec<i64> = cx.input(None, rank, 0..5);
    let mut w2 = comm.submit(move |c| {
        let mut out = vec![0i64; 5 * c.world_size()];
        c.all_gather(&b, &mut out).map(|()| out)
    });
    // A blocking call while those are queued: it runs after them.
    all_reduce::<f64>(cx, ReduceOp::Max, 7, false)?;
    let big = large.max(1000);
    let c: Vec<f32> = cx.input(sum, rank, 0..big as u64);
    let mut w3 = comm.all_reduce_async(c, ReduceOp::Sum);
    // Many small ones, waited for in reverse order.
    let mut many: Vec<Work<Vec<i32>>> = (0..12u64)
        .map(|k| {
            let v: Vec<i32> = cx.input(Some(ReduceOp::Min), rank, k * 1000..k * 1000 + 7);
            comm.all_reduce_async(v, ReduceOp::Min)
        })
        .collect();
    let start = Instant::now();
    while !w3.test() {
        if start.elapsed() > Duration::from_secs(60) {
            return Err("nonblocking: Work::test never became true".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // A blocking call after them all.
    broadcast::<u8>(cx, 100, n - 1, true)?;
    for k in (0..many.len()).rev() {
        let what = format!("all_reduce_async i32 min #{k}");
        let got = wait(cx, &what, &mut many[k])?;
        let want: Vec<f64> = (k as u64 * 1000..k as u64 * 1000 + 7)
            .map(|i| cx.reduced(DataType::I32, ReduceOp::Min, &all, i))
            .collect();
        cx.compare(&what, &got, &want, 0.0);
    }
    let got = wait(cx, "all_reduce_async f32 sum (large)", &mut w3)?;
    let want: Vec<f64> = (0..big as u64)
        .map(|i| cx.reduced(DataType::F32, ReduceOp::Sum, &all, i))
        .collect();
    cx.compare("all_reduce_async f32 sum (large)", &got, &want, 0.0);
    let got = wait(cx, "submitted all_gather i64", &mut w2)?;
    let want: Vec<f64> = (0..n)
        .flat_map(|r| (0..5).map(move |i| (r, i)))
        .map(|(r, i)| cx.val(DataType::I64, None, r, i))
        .collect();
    cx.compare("submitted all_gather i64", &got, &want, 0.0);
    let got = wait(cx, "all_reduce_async f32 sum", &mut w1)?;
    let want: Vec<f64> = (0..1000)
        .map(|i| cx.reduced(DataType::F32, ReduceOp::Sum, &all, i))
        .collect();
    cx.compare("all_reduce_async f32 sum", &got, &want, 0.0);
    // A failed submitted call is reported through its handle, not lost.
    let mut bad = comm.submit(|c| {
        let mut out = vec![0f32; 3];
        c.all_reduce(&[1f32; 4], &mut out, ReduceOp::Sum)
    });
    cx.checks += 1;
    match bad.wait(Duration::from_secs(60)) {
        Err(oxccl::Error::InvalidArgument { .. }) => {}
        other => cx.fail(format!(
            "a submitted all_reduce with a short output returned {other:?}, not InvalidArgument"
        )),
    }
    // And the communicator still works (that error was local).
    all_reduce::<u32>(cx, ReduceOp::Sum, 7, true)
}

/// Splits into evens and odds (ordered by descending rank), runs collectives in each, then
/// splits again with rank 0 opting out; the parent keeps working throughout.
fn split(cx: &mut Cx) -> R {
    let (comm, n, rank) = (cx.comm, cx.n, cx.rank);
    let color = (rank % 2) as u32;
    cx.calls += 1;
    let sub = comm
        .split(Some(color), (n - rank) as u32)
        .map_err(|e| format!("split: {} error: {e}", error_kind(&e)))?
        .ok_or("split returned None for a rank with a color")?;
    let members: Vec<usize> = (0..n).rev().filter(|r| r % 2 == rank % 2).collect();
    let me = members.iter().position(|&r| r == rank).unwrap();
    cx.checks += 1;
    if (sub.rank(), sub.world_size()) != (me, members.len()) {
        cx.fail(format!(
            "split(color {color}): rank {} of {}, expected {me} of {}",
            sub.rank(),
            sub.world_size(),
            members.len()
        ));
        return Ok(());
    }
    // All-reduce in the sub-communicator: each member contributes its parent rank's input.
    for (d, op, count) in [
        (DataType::F32, ReduceOp::Sum, 1000usize),
        (DataType::I32, ReduceOp::Max, 7),
        (DataType::U8, ReduceOp::Min, 100_000),
    ] {
        let what = format!("split(color {color}) all_reduce {d} {op} count {count}");
        let want: Vec<f64> = (0..count as u64)
            .map(|i| cx.reduced(d, op, &members, i))
            .collect();
        match d {
            DataType::F32 => {
                let mut v: Vec<f32> = cx.input(Some(op), rank, 0..count as u64);
                cx.call(&what, sub.all_reduce_in_place(&mut v, op))?;
                cx.compare(&what, &v, &want, 0.0);
            }
            DataType::I32 => {
                let mut v: Vec<i32> = cx.input(Some(op), rank, 0..count as u64);
                cx.call(&what, sub.all_reduce_in_place(&mut v, op))?;
                cx.compare(&what, &v, &want, 0.0);
            }
            _ => {
                let mut v: Vec<u8> = cx.input(Some(op), rank, 0..count as u64);
                cx.call(&what, sub.all_reduce_in_place(&mut v, op))?;
                cx.compare(&what, &v, &want, 0.0);
            }
        }
    }
    // Broadcast from the sub-communicator's rank 0 (the group's highest parent rank).
    let what = format!("split(color {color}) broadcast root 0");
    let mut b: Vec<u64> = if me == 0 {
        cx.input(None, rank, 0..50)
    } else {
        vec![0; 50]
    };
    cx.call(&what, sub.broadcast_in_place(&mut b, 0))?;
    let want: Vec<f64> = (0..50)
        .map(|i| cx.val(DataType::U64, None, members[0], i))
        .collect();
    cx.compare(&what, &b, &want, 0.0);
    // The parent still works, with the sub-communicator alive.
    all_reduce::<f64>(cx, ReduceOp::Sum, 1000, false)?;
    cx.call("destroying a split communicator", sub.destroy())?;
    // Rank 0 opts out; the others form one group ordered by rank.
    if n >= 3 {
        cx.calls += 1;
        let opt = (rank != 0).then_some(7);
        let sub = comm.split(opt, rank as u32).map_err(|e| {
            format!(
                "split with rank 0 opting out: {} error: {e}",
                error_kind(&e)
            )
        })?;
        cx.checks += 1;
        match (rank, sub) {
            (0, None) => {}
            (0, Some(_)) => cx.fail("split(None) returned a communicator".into()),
            (_, None) => cx.fail("split(Some(7)) returned None".into()),
            (_, Some(sub)) => {
                let members: Vec<usize> = (1..n).collect();
                if (sub.rank(), sub.world_size()) != (rank - 1, n - 1) {
                    cx.fail(format!(
                        "split without rank 0: rank {} of {}, expected {} of {}",
                        sub.rank(),
                        sub.world_size(),
                        rank - 1,
                        n - 1
                    ));
                } else {
                    let what = "split without rank 0: all_reduce f64 avg count 33";
                    let mut v: Vec<f64> = cx.input(Some(ReduceOp::Avg), rank, 0..33);
                    cx.call(what, sub.all_reduce_in_place(&mut v, ReduceOp::Avg))?;
                    let want: Vec<f64> = (0..33)
                        .map(|i| cx.reduced(DataType::F64, ReduceOp::Avg, &members, i))
                        .collect();
                    cx.compare(
                        what,
                        &v,
                        &want,
                        tolerance(DataType::F64, Some(ReduceOp::Avg)),
                    );
                }
                cx.call("destroying a split communicator", sub.destroy())?;
            }
        }
    }
    all_reduce::<i8>(cx, ReduceOp::Sum, 7, true)
}

fn run_section(cx: &mut Cx, plan: &Plan, section: &str) -> R {
    let roots = cx.all();
    for &in_place in &plan.in_place {
        for &count in &plan.counts {
            match section {
                "all_reduce" | "reduce_scatter" | "reduce" => {
                    for &(d, op) in &plan.reduce_pairs {
                        match section {
                            "all_reduce" => typed!(d, all_reduce(cx, op, count, in_place))?,
                            "reduce_scatter" => typed!(d, reduce_scatter(cx, op, count, in_place))?,
                            _ => {
                                for &root in &roots {
                                    typed!(d, reduce(cx, op, count, root, in_place))?;
                                }
                            }
                        }
                    }
                }
                "all_gather" | "broadcast" | "all_to_all" | "gather" | "scatter" => {
                    for &d in &plan.move_dtypes {
                        match section {
                            "all_gather" => typed!(d, all_gather(cx, count, in_place))?,
                            "all_to_all" => typed!(d, all_to_all(cx, count, in_place))?,
                            _ => {
                                for &root in &roots {
                                    match section {
                                        "broadcast" => {
                                            typed!(d, broadcast(cx, count, root, in_place))?
                                        }
                                        "gather" => typed!(d, gather(cx, count, root, in_place))?,
                                        _ => typed!(d, scatter(cx, count, root, in_place))?,
                                    }
                                }
                            }
                        }
                    }
                }
                "send_recv" if in_place => {
                    for &d in &plan.move_dtypes {
                        typed!(d, send_recv(cx, count))?;
                    }
                }
                _ => {}
            }
        }
    }
    match section {
        "all_to_allv" => {
            let maxes = plan.counts.iter().map(|&c| c.min(300));
            for (salt, max) in maxes.enumerate() {
                for &d in &plan.move_dtypes {
                    typed!(d, all_to_allv(cx, max, salt as u64))?;
                }
            }
        }
        "barrier" => {
            barrier(cx)?;
            for _ in 0..3 {
                cx.call("barrier", cx.comm.barrier())?;
            }
        }
        "unaligned" => {
            for d in [
                DataType::F32,
                DataType::F64,
                DataType::F16,
                DataType::Bf16,
                DataType::I32,
                DataType::U64,
                DataType::I8,
                DataType::F8E5M2,
            ] {
                for (op, count) in [
                    (ReduceOp::Sum, 7),
                    (ReduceOp::Max, 1000),
                    (ReduceOp::Sum, 50_000),
                    (ReduceOp::Avg, 1001),
                ] {
                    typed!(d, unaligned(cx, op, count))?;
                }
            }
        }
        "large" if plan.large > 0 => large(cx, plan.large)?,
        "nonblocking" => nonblocking(cx, plan.large)?,
        "split" if cx.n >= 2 => split(cx)?,
        _ => {}
    }
    Ok(())
}

fn run_plan(plan: Plan) -> Value {
    let start = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => return json!({ "error": format!("init: {} error: {e}", error_kind(&e)) }),
    };
    let mut cx = Cx {
        comm: &comm,
        rank: comm.rank(),
        n: comm.world_size(),
        seed: plan.seed,
        calls: 0,
        checks: 0,
        nfailures: 0,
        failures: Vec::new(),
    };
    let mut times = serde_json::Map::new();
    let mut error = None;
    for section in &plan.sections {
        let t = Instant::now();
        if let Err(e) = run_section(&mut cx, &plan, section) {
            error = Some(format!("rank {}: {e}", cx.rank));
            break;
        }
        times.insert(section.clone(), json!(t.elapsed().as_millis() as u64));
    }
    let (calls, checks, nfailures, failures) = (cx.calls, cx.checks, cx.nfailures, cx.failures);
    let providers: Vec<Option<&str>> = comm
        .providers()
        .iter()
        .map(|p| p.map(|p| p.name()))
        .collect();
    let opts = comm.options();
    let geometry = json!([opts.chunk_size, opts.slots, opts.channels]);
    if error.is_none()
        && let Err(e) = comm.destroy()
    {
        error = Some(format!("destroy: {} error: {e}", error_kind(&e)));
    }
    json!({
        "calls": calls,
        "checks": checks,
        "nfailures": nfailures,
        "failures": failures,
        "error": error,
        "ms": start.elapsed().as_millis() as u64,
        "section_ms": times,
        "providers": providers,
        "geometry": geometry,
    })
}

/// Runs `plan` on `n` ranks with `env`; asserts that every rank ran it without an error or a
/// wrong result; returns rank 0's stderr (for tests that check the log).
fn run_job(name: &str, n: usize, env: &[(&str, &str)], plan: Plan) -> String {
    let start = Instant::now();
    let outs = run_ranks(n, env, "plan", &serde_json::to_value(&plan).unwrap());
    let results = expect_results(name, &outs);
    let mut problems = Vec::new();
    for (rank, r) in results.iter().enumerate() {
        if let Some(e) = r["error"].as_str() {
            problems.push(format!("rank {rank} stopped: {e}"));
        }
        if r["nfailures"].as_u64() != Some(0) {
            problems.push(format!(
                "rank {rank}: {} wrong results:\n  {}",
                r["nfailures"],
                r["failures"]
                    .as_array()
                    .map(|f| f
                        .iter()
                        .map(|x| x.as_str().unwrap_or("?"))
                        .collect::<Vec<_>>()
                        .join("\n  "))
                    .unwrap_or_default()
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{name}:\n{}{}",
        problems.join("\n"),
        common::report(&outs)
    );
    // The environment took effect: the provider forced and the flow-control geometry.
    let var = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    for (rank, r) in results.iter().enumerate() {
        let provs = r["providers"].as_array().expect("providers");
        assert_eq!(provs.len(), n, "{name}: rank {rank}: providers {provs:?}");
        for (p, v) in provs.iter().enumerate() {
            let want = if p == rank {
                None
            } else {
                Some(var("OXCCL_PROVIDER").unwrap_or("shm"))
            };
            assert_eq!(
                v.as_str(),
                want,
                "{name}: rank {rank} reaches rank {p} over {v}"
            );
        }
        let geo = &r["geometry"];
        if let Some(c) = var("OXCCL_CHUNK_SIZE") {
            assert_eq!(
                geo[0].as_u64(),
                c.parse().ok(),
                "{name}: rank {rank}: geometry {geo}"
            );
        }
        if let Some(s) = var("OXCCL_SLOTS") {
            assert_eq!(
                geo[1].as_u64(),
                s.parse().ok(),
                "{name}: rank {rank}: geometry {geo}"
            );
        }
        if let Some(c) = var("OXCCL_NCHANNELS") {
            assert_eq!(
                geo[2].as_u64(),
                c.parse().ok(),
                "{name}: rank {rank}: geometry {geo}"
            );
        }
    }
    let checks: u64 = results
        .iter()
        .map(|r| r["checks"].as_u64().unwrap_or(0))
        .sum();
    assert!(checks > 0, "{name}: nothing was checked");
    eprintln!(
        "{name}: {n} ranks, {} calls and {checks} checks per job, {:.1} s; rank 0 sections (ms): {}",
        results[0]["calls"],
        start.elapsed().as_secs_f64(),
        results[0]["section_ms"]
    );
    outs[0].stderr.clone()
}

fn shm() -> [(&'static str, &'static str); 1] {
    [("OXCCL_PROVIDER", "shm")]
}

fn tcp() -> [(&'static str, &'static str); 1] {
    [("OXCCL_PROVIDER", "tcp")]
}

/// `(collective, bytes, algorithm, channels)` of each algorithm line of an `OXCCL_DEBUG=INFO`
/// log (one per kind of call).
fn algorithms(log: &str) -> Vec<(String, u64, String, u64)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.split_once("oxccl INFO rank ")?.1.split_once(": ")?.1;
            let (coll, rest) = rest.split_once(" of ")?;
            let (bytes, rest) = rest.split_once(" bytes: algorithm ")?;
            let (algo, rest) = rest.split_once(", ")?;
            // "protocol mailbox, " or "protocol slots, " comes next.
            let rest = rest.split_once("protocol ")?.1.split_once(", ")?.1;
            let (channels, _) = rest.split_once(" channels")?;
            Some((
                coll.to_string(),
                bytes.parse().ok()?,
                algo.to_string(),
                channels.parse().ok()?,
            ))
        })
        .collect()
}

/// Asserts that `log` shows `coll` run with `algo` (and, with `channels`, on that many).
fn assert_used(name: &str, log: &str, coll: &str, algo: &str, channels: Option<u64>) {
    let lines = algorithms(log);
    assert!(
        lines
            .iter()
            .any(|(c, _, a, ch)| c == coll && a == algo && channels.is_none_or(|x| x == *ch)),
        "{name}: no {coll} ran with algorithm {algo} (channels {channels:?}); the log shows {lines:?}"
    );
}

/// Runs `sections` of the full plan with `OXCCL_ALGO=algo`; every call of a collective the
/// algorithm supports must have used it.
fn forced(name: &str, n: usize, algo: &str, colls: &[&str], sections: &[&str]) {
    let mut plan = Plan::full(0xa160 + n as u64).sections(sections);
    plan.reduce_pairs = some_pairs();
    let env = [
        ("OXCCL_PROVIDER", "shm"),
        ("OXCCL_ALGO", algo),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job(name, n, &env, plan);
    for coll in colls {
        assert_used(name, &log, coll, algo, None);
    }
    for (c, bytes, a, _) in algorithms(&log) {
        assert!(
            !colls.contains(&c.as_str()) || a == algo,
            "{name}: {c} of {bytes} bytes ran with {a}, not the forced {algo}"
        );
    }
}

#[test]
fn forced_ring_for_small_all_reduce() {
    forced(
        "OXCCL_ALGO=ring, 3 ranks",
        3,
        "ring",
        &["all_reduce", "reduce_scatter", "all_gather"],
        &["all_reduce", "reduce_scatter", "all_gather", "large"],
    );
}

#[test]
fn forced_recursive_doubling_for_large_all_reduce() {
    // 3 and 6 ranks: not powers of two.
    for n in [3, 6] {
        forced(
            &format!("OXCCL_ALGO=rd, {n} ranks"),
            n,
            "rd",
            &["all_reduce"],
            &["large", "all_reduce", "nonblocking"],
        );
    }
}

#[test]
fn forced_proportional_all_reduce() {
    // Equal shares until link rates come from the topology; every dtype and op, large and
    // small, in place and not, through the executor (over the slot protocol: one round per
    // peer each way, but not the mailbox's single exchange).
    forced(
        "OXCCL_ALGO=prop, 3 ranks",
        3,
        "prop",
        &["all_reduce"],
        &["large", "all_reduce", "nonblocking"],
    );
}

/// A topology file with one slow link of four: the tuner runs large all-reduces with shares
/// proportional to what each link can carry (the slow rank owns none), and every result is
/// right, for every dtype and op, in place and not.
#[test]
fn uneven_links_in_the_topology_file_pick_the_proportional_all_reduce() {
    let dir = common::TempDir::new("topo-file");
    let file = dir.0.join("topo.toml");
    let mut toml = String::new();
    for (h, rate) in [1.0, 1.0, 1.0, 0.25].iter().enumerate() {
        toml += &format!("[[hosts]]\nname = \"h{h}\"\nranks = [{h}]\nlink_gbps = {rate}\n");
    }
    std::fs::write(&file, toml).unwrap();
    let mut plan = Plan::full(0x7090).sections(&["large", "all_reduce"]);
    plan.reduce_pairs = some_pairs();
    let name = "OXCCL_TOPO_FILE, rates 1, 1, 1, 0.25";
    let env = [
        ("OXCCL_PROVIDER", "shm"),
        ("OXCCL_TOPO_FILE", file.to_str().unwrap()),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job(name, 4, &env, plan);
    assert_used(name, &log, "all_reduce", "prop", None);
    // Small ones keep the latency algorithms.
    assert!(
        algorithms(&log)
            .iter()
            .any(|(c, bytes, a, _)| c == "all_reduce" && *bytes <= 1024 && a != "prop"),
        "{name}: {:?}",
        algorithms(&log)
    );
}

/// A topology file of 2 hosts × 2 ranks (interleaved: ranks 0 and 2 on one host): large
/// all-reduces, all-gathers, reduce-scatters and broadcasts run two-tier, and every result is
/// right.
#[test]
fn two_hosts_of_two_ranks_pick_the_hierarchical_collectives() {
    let dir = common::TempDir::new("topo-hier");
    let file = dir.0.join("topo.json");
    std::fs::write(
        &file,
        r#"{"hosts": [{"name": "a", "ranks": [0, 2]}, {"name": "b", "ranks": [1, 3]}]}"#,
    )
    .unwrap();
    let mut plan = Plan::full(0x41e2).sections(&[
        "large",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "nonblocking",
    ]);
    plan.reduce_pairs = some_pairs();
    let name = "OXCCL_TOPO_FILE, 2 hosts x 2 ranks";
    let env = [
        ("OXCCL_PROVIDER", "shm"),
        ("OXCCL_TOPO_FILE", file.to_str().unwrap()),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job(name, 4, &env, plan);
    assert_used(name, &log, "all_reduce", "hier", None);
    assert_used(name, &log, "all_gather", "hier", None);
    assert_used(name, &log, "reduce_scatter", "hier", None);
    assert_used(name, &log, "broadcast", "hier", None);
}

#[test]
fn forced_tree_for_large_broadcast_and_reduce() {
    forced(
        "OXCCL_ALGO=tree, 5 ranks",
        5,
        "tree",
        &["broadcast", "reduce"],
        &["large", "broadcast", "reduce"],
    );
}

#[test]
fn forced_chain_for_small_broadcast_and_reduce() {
    forced(
        "OXCCL_ALGO=chain, 4 ranks",
        4,
        "chain",
        &["broadcast", "reduce"],
        &["broadcast", "reduce", "large"],
    );
}

#[test]
fn forced_direct_all_reduce() {
    // Small ones in mailboxes, large ones (300 000 elements) over the slot protocol.
    forced(
        "OXCCL_ALGO=direct, 3 ranks",
        3,
        "direct",
        &["all_reduce"],
        &["all_reduce", "large", "nonblocking"],
    );
}

#[test]
fn forced_direct_all_reduce_tcp() {
    let mut plan = Plan::full(0xd1).sections(&["all_reduce", "large"]);
    plan.reduce_pairs = some_pairs();
    let env = [
        ("OXCCL_PROVIDER", "tcp"),
        ("OXCCL_ALGO", "direct"),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job("OXCCL_ALGO=direct, tcp, 3 ranks", 3, &env, plan);
    assert_used(
        "OXCCL_ALGO=direct over tcp",
        &log,
        "all_reduce",
        "direct",
        None,
    );
}

/// Tiny chunks, two slots and three channels: every large transfer waits for credits.
#[test]
fn flow_control_stress_shm() {
    let mut plan = Plan::full(0xf10);
    plan.counts.push(5000);
    let env = [
        ("OXCCL_PROVIDER", "shm"),
        ("OXCCL_CHUNK_SIZE", "4096"),
        ("OXCCL_SLOTS", "2"),
        ("OXCCL_NCHANNELS", "3"),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job("flow control, shm, 3 ranks", 3, &env, plan);
    assert_used("flow control", &log, "all_reduce", "ring", Some(3));
}

#[test]
fn flow_control_stress_tcp() {
    let mut plan = Plan::full(0xf11).sections(&["all_reduce", "all_to_all", "send_recv", "large"]);
    plan.reduce_pairs = some_pairs();
    plan.counts.push(5000);
    let env = [
        ("OXCCL_PROVIDER", "tcp"),
        ("OXCCL_CHUNK_SIZE", "4096"),
        ("OXCCL_SLOTS", "2"),
        ("OXCCL_NCHANNELS", "3"),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job("flow control, tcp, 2 ranks", 2, &env, plan);
    assert_used("flow control", &log, "all_reduce", "ring", Some(3));
}

#[test]
fn shm_1_rank_everything() {
    let plan = Plan::full(1);
    run_job("shm, 1 rank", 1, &shm(), plan);
}

#[test]
fn shm_2_ranks_everything() {
    let plan = Plan::full(2);
    run_job("shm, 2 ranks", 2, &shm(), plan);
}

/// With `OXCCL_COMPILED=0`: the mailbox calls are driven by their protocol machines, which
/// exchange the same messages as the compiled programs the other jobs run.
#[test]
fn shm_3_ranks_everything_uncompiled() {
    let plan = Plan::full(3);
    let env = [
        ("OXCCL_PROVIDER", "shm"),
        ("OXCCL_COMPILED", "0"),
        ("OXCCL_DEBUG", "INFO"),
    ];
    let log = run_job("shm, 3 ranks, uncompiled", 3, &env, plan);
    assert!(log.contains("protocol mailbox, "), "no mailbox call: {log}");
    assert!(!log.contains("(compiled)"), "a call ran compiled: {log}");
}

/// Also checks the tuner: a latency algorithm (recursive doubling or direct for all-reduce,
/// tree for broadcast and reduce) for small calls, a bandwidth one (ring, chain) above 64 KiB.
#[test]
fn shm_4_ranks_everything() {
    let plan = Plan::full(4);
    let env = [("OXCCL_PROVIDER", "shm"), ("OXCCL_DEBUG", "INFO")];
    let name = "shm, 4 ranks";
    let log = run_job(name, 4, &env, plan);
    let lines = algorithms(&log);
    for (coll, algos) in [
        ("all_reduce", &["rd", "direct"][..]),
        ("all_reduce", &["ring"]),
        ("reduce_scatter", &["ring"]),
        ("all_gather", &["ring"]),
        ("broadcast", &["tree"]),
        ("broadcast", &["chain"]),
        ("reduce", &["tree"]),
        ("reduce", &["chain"]),
        ("all_to_all", &["direct"]),
        ("all_to_allv", &["direct"]),
        ("gather", &["direct"]),
        ("scatter", &["direct"]),
        ("send", &["direct"]),
        ("recv", &["direct"]),
        ("barrier", &["dissemination"]),
    ] {
        assert!(
            lines
                .iter()
                .any(|(c, _, a, _)| c == coll && algos.contains(&a.as_str())),
            "{name}: no {coll} ran with {algos:?}; the log shows {lines:?}"
        );
    }
    // The small calls that run in mailboxes (an exchange each way with each peer) ran
    // compiled, each rank's program verified with the others'.
    for coll in ["all_reduce", "barrier"] {
        assert!(
            log.lines().any(|l| l.contains(&format!(": {coll} of "))
                && l.contains("protocol mailbox (compiled), ")),
            "{name}: no {coll} ran compiled; the log: {log}"
        );
    }
    assert!(!log.contains("runs uncompiled"), "{name}: {log}");
    for (c, bytes, a, _) in lines {
        let latency = matches!(
            (c.as_str(), a.as_str()),
            (_, "rd" | "tree") | ("all_reduce", "direct")
        );
        assert!(
            !latency || bytes <= 64 << 10,
            "{c} of {bytes} bytes (over 64 KiB) ran with the latency algorithm {a}"
        );
    }
}

#[test]
fn shm_8_ranks_everything() {
    let plan = Plan::full(8);
    run_job("shm, 8 ranks", 8, &shm(), plan);
}

#[test]
fn tcp_2_ranks_everything() {
    let plan = Plan::full(12);
    let env = [("OXCCL_PROVIDER", "tcp"), ("OXCCL_DEBUG", "INFO")];
    let log = run_job("tcp, 2 ranks", 2, &env, plan);
    assert_used("tcp, 2 ranks", &log, "all_reduce", "ring", None);
}

#[test]
fn tcp_3_ranks_everything() {
    let plan = Plan::full(13);
    run_job("tcp, 3 ranks", 3, &tcp(), plan);
}
