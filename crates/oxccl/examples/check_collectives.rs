//! Checks every collective of a job started by a launcher, against a reference that each rank
//! computes by itself.
//!
//! ```text
//! mpirun -np 4 -x OXCCL_SECRET target/debug/examples/check_collectives
//! srun -n 4 target/debug/examples/check_collectives
//! torchrun --nproc-per-node 4 --no-python target/debug/examples/check_collectives
//! ```
//!
//! Each rank joins with `Communicator::from_env()` and runs all-reduce, reduce-scatter,
//! all-gather, broadcast, reduce, all-to-all(v), gather, scatter, send/recv (out of place and,
//! where the API has it, in place) over counts 0, 1, 7, 1001 and 70001, for every data type and
//! operator; and the barrier. Every rank's input is a formula of (rank, element, check), so
//! each rank computes what its output must hold without asking anyone. Inputs are small
//! integers, so sums, products, minima and maxima are exact in every type and must match
//! exactly; only a floating-point average may differ by a rounding.
//!
//! Rank 0 prints one line per check, `ok` or `FAIL` with how many ranks saw a wrong result;
//! a rank that sees one prints the first wrong element on stderr. Every rank exits with 1 if
//! its own results were wrong and 2 on an error, so the launcher's exit status tells.
//!
//! Options: `--timeout SECONDS` for each call (default 60), `--counts 0,1,7,...`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use oxccl::{Communicator, DataType, Element, F8E4M3, F8E5M2, ReduceOp};

type R<T = ()> = Result<T, String>;

/// A value no collective writes (outputs start as it, so an untouched element shows).
const UNTOUCHED: f64 = 99.0;

struct Checker<'a> {
    comm: &'a Communicator,
    rank: usize,
    n: usize,
    checks: usize,
    /// Checks whose result was wrong on this rank.
    wrong_here: usize,
    /// Checks whose result was wrong on some rank (as rank 0 learns).
    wrong_anywhere: usize,
}

fn signed(d: DataType) -> bool {
    !matches!(d, DataType::U8 | DataType::U32 | DataType::U64)
}

/// Element `i` of `rank`'s input to a check with `op` on `d` (`salt` varies it between
/// checks). Reductions get small integers, whose results are exact in every type; data that
/// is only moved (`op` None) gets values that differ between ranks and positions, up to what
/// `d` holds exactly.
fn value(op: Option<ReduceOp>, d: DataType, rank: usize, i: usize, salt: usize) -> f64 {
    match op {
        // At most every third rank contributes 2: products stay below 2^6 for 16 ranks.
        Some(ReduceOp::Prod) => {
            if (rank + i + salt).is_multiple_of(3) {
                2.0
            } else {
                1.0
            }
        }
        Some(ReduceOp::Min | ReduceOp::Max) => {
            ((rank * 5 + i * 7 + salt) % 11) as f64 - if signed(d) { 5.0 } else { 0.0 }
        }
        // Sums of up to 25 ranks fit in an int8.
        Some(ReduceOp::Sum | ReduceOp::Avg) => ((rank * 3 + i + salt) % 5) as f64,
        None => {
            let modulus: u64 = match d {
                DataType::I8 | DataType::U8 => 127,
                DataType::Bf16 => 251,
                // Every finite value: from_f64 rounds the others to them (e4m3 saturates).
                DataType::F8E4M3 => 449,
                DataType::F8E5M2 => 57_345,
                DataType::F16 => 2039,
                DataType::F32 => 16_777_213,
                _ => 4_294_967_291,
            };
            ((rank as u64 * 7919 + i as u64 * 31 + salt as u64 * 101) % modulus) as f64
        }
    }
}

/// What `op` over every rank's element `i` gives.
fn reduced(op: ReduceOp, d: DataType, n: usize, i: usize, salt: usize) -> f64 {
    let vals = (0..n).map(|r| value(Some(op), d, r, i, salt));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => {
            let mean = vals.sum::<f64>() / n as f64;
            if d.is_float() { mean } else { mean.trunc() }
        }
    }
}

/// Relative difference allowed: a rounding of the type for a floating-point average, none
/// otherwise.
fn tolerance(d: DataType, op: Option<ReduceOp>) -> f64 {
    match (op, d) {
        (Some(ReduceOp::Avg), DataType::F16) => 1e-3,
        (Some(ReduceOp::Avg), DataType::Bf16) => 8e-3,
        (Some(ReduceOp::Avg), DataType::F32) => 1e-6,
        (Some(ReduceOp::Avg), DataType::F64) => 1e-14,
        _ => 0.0,
    }
}

fn input<T: Element>(
    op: Option<ReduceOp>,
    rank: usize,
    range: std::ops::Range<usize>,
    salt: usize,
) -> Vec<T> {
    range
        .map(|i| T::from_f64(value(op, T::DTYPE, rank, i, salt)))
        .collect()
}

fn untouched<T: Element>(len: usize) -> Vec<T> {
    vec![T::from_f64(UNTOUCHED); len]
}

/// The first wrong element, if any, and how many are wrong.
fn compare<T: Element>(got: &[T], want: &[f64], tol: f64) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| {
            let (g, w) = (got[i].to_f64(), want[i]);
            // Written so that a NaN is wrong.
            let close = (g - w).abs() <= tol * w.abs();
            !close
        })
        .collect();
    let &first = bad.first()?;
    Some(format!(
        "{} of {} elements wrong; first: element {first} = {:?}, expected {}",
        bad.len(),
        got.len(),
        got[first],
        want[first]
    ))
}

impl Checker<'_> {
    /// Records one check on every rank: each says whether its result was right; rank 0
    /// prints the line.
    fn report(&mut self, what: &str, mismatch: Option<String>) -> R {
        self.checks += 1;
        if let Some(m) = &mismatch {
            self.wrong_here += 1;
            say(&format!(
                "check_collectives: rank {}: FAIL {what}: {m}",
                self.rank
            ));
        }
        let mut wrong = [u32::from(mismatch.is_some())];
        self.call(
            what,
            self.comm.all_reduce_in_place(&mut wrong, ReduceOp::Sum),
        )?;
        if self.rank == 0 {
            if wrong[0] == 0 {
                println!("ok   {what}");
            } else {
                self.wrong_anywhere += 1;
                println!("FAIL {what}: wrong on {} of {} ranks", wrong[0], self.n);
            }
        }
        Ok(())
    }

    fn call<T>(&self, what: &str, r: oxccl::Result<T>) -> R<T> {
        r.map_err(|e| format!("{what}: {e}"))
    }

    /// All-reduce, reduce-scatter and reduce with `op` on `T`, out of place and in place.
    fn reductions<T: Element>(&mut self, op: ReduceOp, count: usize, salt: usize) -> R {
        let (comm, n, me, d) = (self.comm, self.n, self.rank, T::DTYPE);
        let tol = tolerance(d, Some(op));
        let all: Vec<f64> = (0..n * count).map(|i| reduced(op, d, n, i, salt)).collect();
        let ar = format!("all_reduce {d} {} count {count}", op.name());
        let mut out = untouched::<T>(count);
        let x = input::<T>(Some(op), me, 0..count, salt);
        self.call(&ar, comm.all_reduce(&x, &mut out, op))?;
        self.report(
            &format!("{ar} out of place"),
            compare(&out, &all[..count], tol),
        )?;
        let mut buf = x.clone();
        self.call(&ar, comm.all_reduce_in_place(&mut buf, op))?;
        self.report(&format!("{ar} in place"), compare(&buf, &all[..count], tol))?;

        let rs = format!("reduce_scatter {d} {} count {count} per rank", op.name());
        let mine = &all[me * count..(me + 1) * count];
        let x = input::<T>(Some(op), me, 0..n * count, salt);
        let mut out = untouched::<T>(count);
        self.call(&rs, comm.reduce_scatter(&x, &mut out, op))?;
        self.report(&format!("{rs} out of place"), compare(&out, mine, tol))?;
        let mut buf = x.clone();
        self.call(&rs, comm.reduce_scatter_in_place(&mut buf, op))?;
        let block = &buf[me * count..(me + 1) * count];
        self.report(&format!("{rs} in place"), compare(block, mine, tol))?;

        for root in roots(n) {
            let rd = format!("reduce {d} {} count {count} root {root}", op.name());
            let x = input::<T>(Some(op), me, 0..count, salt);
            let mut out = untouched::<T>(if me == root { count } else { 0 });
            self.call(&rd, comm.reduce(&x, &mut out, op, root))?;
            let want = if me == root { &all[..count] } else { &[][..] };
            self.report(&format!("{rd} out of place"), compare(&out, want, tol))?;
            let mut buf = x.clone();
            self.call(&rd, comm.reduce_in_place(&mut buf, op, root))?;
            // Other ranks' buffers are theirs to keep: check only the root's.
            let got = if me == root { &buf[..] } else { &[][..] };
            self.report(&format!("{rd} in place"), compare(got, want, tol))?;
        }
        Ok(())
    }

    /// All-gather, broadcast, all-to-all(v), gather, scatter and send/recv on `T`.
    fn movements<T: Element>(&mut self, count: usize, salt: usize) -> R {
        let (comm, n, me, d) = (self.comm, self.n, self.rank, T::DTYPE);
        // Rank r's element i, as every rank can compute it.
        // As the type holds it: fp8 rounds most of these values (the others hold them exactly).
        let of = |r: usize, i: usize| T::from_f64(value(None, d, r, i, salt)).to_f64();

        let what = format!("all_gather {d} count {count} per rank");
        let want: Vec<f64> = (0..n * count)
            .map(|k| of(k / count.max(1), k % count.max(1)))
            .collect();
        let mut out = untouched::<T>(n * count);
        self.call(
            &what,
            comm.all_gather(&input(None, me, 0..count, salt), &mut out),
        )?;
        self.report(&format!("{what} out of place"), compare(&out, &want, 0.0))?;
        let mut buf = untouched::<T>(n * count);
        buf[me * count..(me + 1) * count].copy_from_slice(&input(None, me, 0..count, salt));
        self.call(&what, comm.all_gather_in_place(&mut buf))?;
        self.report(&format!("{what} in place"), compare(&buf, &want, 0.0))?;

        // Block j of rank r's input goes to rank j: rank r's elements j·count.. .
        let what = format!("all_to_all {d} count {count} per pair");
        let want: Vec<f64> = (0..n * count)
            .map(|k| of(k / count.max(1), me * count + k % count.max(1)))
            .collect();
        let x = input::<T>(None, me, 0..n * count, salt);
        let mut out = untouched::<T>(n * count);
        self.call(&what, comm.all_to_all(&x, &mut out))?;
        self.report(&format!("{what} out of place"), compare(&out, &want, 0.0))?;
        let mut buf = x.clone();
        self.call(&what, comm.all_to_all_in_place(&mut buf))?;
        self.report(&format!("{what} in place"), compare(&buf, &want, 0.0))?;

        // Uneven: rank r sends (r + j + count) mod 3 elements to rank j, from its input's start.
        let sends = |r: usize| -> Vec<usize> { (0..n).map(|j| (r + j + count) % 3).collect() };
        let what = format!("all_to_allv {d} counts 0-2 per pair (count {count})");
        let send_counts = sends(me);
        let recv_counts: Vec<usize> = (0..n).map(|i| sends(i)[me]).collect();
        let x = input::<T>(None, me, 0..send_counts.iter().sum(), salt);
        let mut want = Vec::new();
        for (i, &c) in recv_counts.iter().enumerate() {
            let start: usize = sends(i)[..me].iter().sum();
            want.extend((start..start + c).map(|k| of(i, k)));
        }
        let mut out = untouched::<T>(want.len());
        self.call(
            &what,
            comm.all_to_allv(&x, &send_counts, &mut out, &recv_counts),
        )?;
        self.report(&what, compare(&out, &want, 0.0))?;

        for root in roots(n) {
            let what = format!("broadcast {d} count {count} root {root}");
            let want: Vec<f64> = (0..count).map(|i| of(root, i)).collect();
            let x = if me == root {
                input(None, root, 0..count, salt)
            } else {
                Vec::new()
            };
            let mut out = untouched::<T>(count);
            self.call(&what, comm.broadcast(&x, &mut out, root))?;
            self.report(&format!("{what} out of place"), compare(&out, &want, 0.0))?;
            let mut buf: Vec<T> = if me == root {
                input(None, root, 0..count, salt)
            } else {
                untouched(count)
            };
            self.call(&what, comm.broadcast_in_place(&mut buf, root))?;
            self.report(&format!("{what} in place"), compare(&buf, &want, 0.0))?;

            let what = format!("gather {d} count {count} per rank root {root}");
            let len = if me == root { n * count } else { 0 };
            let want: Vec<f64> = (0..len)
                .map(|k| of(k / count.max(1), k % count.max(1)))
                .collect();
            let mut out = untouched::<T>(len);
            self.call(
                &what,
                comm.gather(&input(None, me, 0..count, salt), &mut out, root),
            )?;
            self.report(&what, compare(&out, &want, 0.0))?;

            let what = format!("scatter {d} count {count} per rank root {root}");
            let x = if me == root {
                input(None, root, 0..n * count, salt)
            } else {
                Vec::new()
            };
            let want: Vec<f64> = (0..count).map(|i| of(root, me * count + i)).collect();
            let mut out = untouched::<T>(count);
            self.call(&what, comm.scatter(&x, &mut out, root))?;
            self.report(&what, compare(&out, &want, 0.0))?;
        }

        if n > 1 {
            // Rank r sends to r+1 and receives from r-1; even ranks send first, so that no
            // cycle of ranks all waits to send.
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let what = format!("send/recv {d} count {count} to the next rank");
            let x = input::<T>(None, me, 0..count, salt);
            let mut got = untouched::<T>(count);
            if me % 2 == 0 {
                self.call(&what, comm.send(&x, next))?;
                self.call(&what, comm.recv(&mut got, prev))?;
            } else {
                self.call(&what, comm.recv(&mut got, prev))?;
                self.call(&what, comm.send(&x, next))?;
            }
            let want: Vec<f64> = (0..count).map(|i| of(prev, i)).collect();
            self.report(&what, compare(&got, &want, 0.0))?;
        }
        Ok(())
    }

    /// A barrier waits for the last rank: one rank arrives 150 ms late, and nobody may leave
    /// before it came (allowing 75 ms for ranks that left the previous barrier at different
    /// times).
    fn barriers(&mut self) -> R {
        let (comm, n, me) = (self.comm, self.n, self.rank);
        for late in roots(n) {
            let what = format!("barrier with rank {late} arriving 150 ms late");
            self.call(&what, comm.barrier())?;
            let t0 = Instant::now();
            if me == late {
                std::thread::sleep(Duration::from_millis(150));
            }
            self.call(&what, comm.barrier())?;
            let waited = t0.elapsed();
            let early = (waited < Duration::from_millis(75))
                .then(|| format!("left after {waited:?}, before rank {late} arrived"));
            self.report(&what, early)?;
        }
        Ok(())
    }
}

/// Writes one line to stderr in one write, so that lines of ranks sharing it do not mix.
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// Roots to try: 0 and the last rank.
fn roots(n: usize) -> Vec<usize> {
    if n > 1 { vec![0, n - 1] } else { vec![0] }
}

fn run(comm: &Communicator, counts: &[usize]) -> R<(usize, usize, usize)> {
    let mut c = Checker {
        comm,
        rank: comm.rank(),
        n: comm.world_size(),
        checks: 0,
        wrong_here: 0,
        wrong_anywhere: 0,
    };
    for (k, &count) in counts.iter().enumerate() {
        // Every data type once and every operator on float.
        c.reductions::<f32>(ReduceOp::Sum, count, k)?;
        c.reductions::<f32>(ReduceOp::Prod, count, k)?;
        c.reductions::<f32>(ReduceOp::Min, count, k)?;
        c.reductions::<f32>(ReduceOp::Max, count, k)?;
        c.reductions::<f32>(ReduceOp::Avg, count, k)?;
        c.reductions::<f64>(ReduceOp::Avg, count, k)?;
        c.reductions::<f16>(ReduceOp::Max, count, k)?;
        c.reductions::<bf16>(ReduceOp::Sum, count, k)?;
        c.reductions::<i8>(ReduceOp::Min, count, k)?;
        c.reductions::<u8>(ReduceOp::Prod, count, k)?;
        c.reductions::<i32>(ReduceOp::Avg, count, k)?;
        c.reductions::<u32>(ReduceOp::Max, count, k)?;
        c.reductions::<i64>(ReduceOp::Prod, count, k)?;
        c.reductions::<u64>(ReduceOp::Sum, count, k)?;
        // 8-bit floats: min and prod are exact (fp8 sums round; tests/fp8.rs bounds them).
        c.reductions::<F8E4M3>(ReduceOp::Min, count, k)?;
        c.reductions::<F8E5M2>(ReduceOp::Prod, count, k)?;
        c.movements::<f32>(count, k)?;
        c.movements::<u8>(count, k)?;
        c.movements::<f16>(count, k)?;
        c.movements::<i64>(count, k)?;
        c.movements::<F8E4M3>(count, k)?;
    }
    c.barriers()?;
    Ok((c.checks, c.wrong_here, c.wrong_anywhere))
}

fn parse_args() -> R<(Duration, Vec<usize>)> {
    let mut timeout = Duration::from_secs(60);
    let mut counts = vec![0, 1, 7, 1001, 70001];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--timeout" => {
                let v = val()?;
                timeout = v
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        format!("--timeout {v}: expected a positive number of seconds")
                    })?;
            }
            "--counts" => {
                let v = val()?;
                counts = v
                    .split(',')
                    .map(|c| c.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("--counts {v}: expected counts like 0,1,7"))?;
            }
            _ => {
                return Err(format!(
                    "unknown argument {a:?} (options: --timeout SECONDS, --counts 0,1,7)"
                ));
            }
        }
    }
    Ok((timeout, counts))
}

fn main() -> ExitCode {
    let (timeout, counts) = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("check_collectives: {e}");
            return ExitCode::from(2);
        }
    };
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            say(&format!("check_collectives: cannot join: {e}"));
            return ExitCode::from(2);
        }
    };
    comm.set_timeout(timeout);
    let (rank, n) = (comm.rank(), comm.world_size());
    if rank == 0 {
        println!("check_collectives: {n} ranks, counts {counts:?}");
    }
    let t0 = Instant::now();
    let result = run(&comm, &counts);
    let destroyed = comm.destroy();
    match (result, destroyed) {
        (Err(e), _) => {
            say(&format!("check_collectives: rank {rank}: {e}"));
            ExitCode::from(2)
        }
        (Ok(_), Err(e)) => {
            say(&format!("check_collectives: rank {rank}: destroy: {e}"));
            ExitCode::from(2)
        }
        (Ok((checks, here, anywhere)), Ok(())) => {
            if rank == 0 {
                println!(
                    "check_collectives: {checks} checks on {n} ranks in {:.1} s: {}",
                    t0.elapsed().as_secs_f64(),
                    if anywhere == 0 {
                        "all right".to_string()
                    } else {
                        format!("{anywhere} wrong")
                    }
                );
            }
            if here == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
    }
}
