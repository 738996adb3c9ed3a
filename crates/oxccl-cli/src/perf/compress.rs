//! `oxccl perf all_reduce --compress bfp8|bfp4`: the compressed sum all-reduce
//! (`Communicator::all_reduce_compressed`), timed in place, with busbw in the caller's
//! uncompressed bytes and, beside it, the bytes that left rank 0 per call.

use std::time::Instant;

use oxccl::compress::{self, Float, Format};
use oxccl::{Communicator, ReduceOp};

use super::{Args, bus_factor, input_value};
use oxccl::schedule::CollectiveKind;

/// A `--compress` value: `off`, or a [`Format`] name (`bfp8`, `bfp4`, `bfp8/16`, ...).
pub(crate) fn parse(arg: &str) -> Result<Option<Format>, String> {
    if arg == "off" {
        return Ok(None);
    }
    arg.parse()
        .map(Some)
        .map_err(|e| format!("--compress: {e}, or off"))
}

/// What every rank must hold after the compressed sum of every rank's input: the same
/// steps computed here, for the whole buffer at once, from the codec's parts (each rank's
/// exponents, their max, quantisation, exact `i16` sums, one re-encoding, decoding). Block
/// boundaries do not depend on the runtime's shares or chunks, so its result is these bits.
fn reference<T: Float>(n: usize, count: usize, fmt: Format) -> Result<Vec<T>, String> {
    let e = |e: compress::CodecError| format!("the reference: {e}");
    let nb = compress::block_count(count, fmt.block);
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|r| {
            (0..count)
                .map(|i| T::from_f64(input_value(ReduceOp::Sum, r, i)))
                .collect()
        })
        .collect();
    let mut exps = vec![0u8; nb];
    let mut mine = vec![0u8; nb];
    for x in &inputs {
        compress::block_exponents(x, fmt, &mut mine).map_err(e)?;
        compress::max_exponents(&mut exps, &mine).map_err(e)?;
    }
    let mut sums = vec![0i16; count];
    let mut q = vec![0i8; count];
    for x in &inputs {
        compress::quantize(x, &exps, fmt, &mut q).map_err(e)?;
        for (s, &m) in sums.iter_mut().zip(&q) {
            *s += i16::from(m);
        }
    }
    let mut new_exps = vec![0u8; nb];
    compress::requantize(&sums, &exps, fmt, &mut new_exps, &mut q).map_err(e)?;
    let mut out = vec![T::from_f64(0.0); count];
    compress::dequantize(&q, &new_exps, fmt, &mut out).map_err(e)?;
    Ok(out)
}

/// Runs the sizes of `args` compressed with `fmt`; the number of wrong values.
pub(crate) fn bench<T: Float>(
    comm: &Communicator,
    args: &Args,
    fmt: Format,
) -> Result<u64, String> {
    let (n, me) = (comm.world_size(), comm.rank());
    let es = T::DTYPE.size();
    let mut w = [0u64];
    for _ in 0..args.warmup.max(1) * 4 {
        comm.all_reduce_in_place(&mut w, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
    }
    if me == 0 && !args.json {
        println!(
            "# oxccl perf all_reduce --compress {fmt}{}: nranks {n} minBytes {} maxBytes {} \
             step: {}(factor) warmup iters: {} iters: {} validation: {}",
            if args.feedback { " --feedback" } else { "" },
            args.min_bytes,
            args.max_bytes,
            args.factor,
            args.warmup,
            args.iters,
            args.check
        );
        println!(
            "# in place; each iteration first copies the input back (timed). busbw counts the \
             uncompressed bytes; wire: bytes rank 0 sent per call, and that against a ring's \
             2(n-1)/n of the buffer"
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>10} {:>9} {:>9} {:>13} {:>10} {:>8}",
            "size", "count", "type", "time(us)", "algbw", "busbw", "wire(B)", "wire/ring", "#wrong"
        );
    }
    let mut rows = Vec::new();
    let mut total_wrong = 0;
    let mut size = args.min_bytes;
    loop {
        let count = size / es;
        let input: Vec<T> = (0..count)
            .map(|i| T::from_f64(input_value(ReduceOp::Sum, me, i)))
            .collect();
        let mut buf = input.clone();
        let mut residual = vec![T::from_f64(0.0); if args.feedback { count } else { 0 }];
        let once = |buf: &mut Vec<T>, res: &mut Vec<T>| {
            buf.copy_from_slice(&input);
            if args.feedback {
                comm.all_reduce_compressed_feedback(buf, res, fmt, ReduceOp::Sum)
            } else {
                comm.all_reduce_compressed(buf, fmt)
            }
            .map_err(|e| e.to_string())
        };
        for _ in 0..args.warmup {
            once(&mut buf, &mut residual)?;
        }
        comm.barrier().map_err(|e| e.to_string())?;
        let s0 = comm.stats();
        let t0 = Instant::now();
        for _ in 0..args.iters {
            once(&mut buf, &mut residual)?;
        }
        let mut t = [t0.elapsed().as_secs_f64() * 1e6 / args.iters as f64];
        let s1 = comm.stats();
        let wire = (s1.sent + s1.placed - s0.sent - s0.placed) / args.iters as u64;
        comm.all_reduce_in_place(&mut t, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let mut wrong = 0;
        if args.check != 0 {
            // From a zero residual, x is the input: the reference's bits.
            residual.iter_mut().for_each(|e| *e = T::from_f64(0.0));
            once(&mut buf, &mut residual)?;
            let want = reference::<T>(n, count, fmt)?;
            let bad = buf
                .iter()
                .zip(&want)
                .filter(|(x, w)| x.to_f64().to_bits() != w.to_f64().to_bits())
                .count() as u64;
            let mut w = [bad];
            comm.all_reduce_in_place(&mut w, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            wrong = w[0];
        }
        let bytes = count * es;
        let algbw = bytes as f64 / t[0] / 1e3;
        let busbw = algbw * bus_factor(CollectiveKind::AllReduce, n);
        let ring = 2.0 * (n as f64 - 1.0) / n as f64 * bytes as f64;
        if me == 0 {
            if args.json {
                rows.push(serde_json::json!({
                    "size": bytes, "count": count, "type": T::DTYPE.name(),
                    "compress": fmt.to_string(), "time_us": t[0], "algbw": algbw,
                    "busbw": busbw, "wire_bytes": wire, "wire_vs_ring": wire as f64 / ring,
                    "wrong": wrong,
                }));
            } else {
                println!(
                    "{:>12} {:>12} {:>8} {:>10.2} {:>9.3} {:>9.3} {:>13} {:>10.3} {:>8}",
                    bytes,
                    count,
                    T::DTYPE.name(),
                    t[0],
                    algbw,
                    busbw,
                    wire,
                    wire as f64 / ring,
                    wrong
                );
            }
        }
        total_wrong += wrong;
        match size.checked_mul(args.factor) {
            Some(s) if s <= args.max_bytes => size = s,
            _ => break,
        }
    }
    if me == 0 && args.json {
        println!("{}", serde_json::json!({ "rows": rows }));
    }
    Ok(total_wrong)
}
