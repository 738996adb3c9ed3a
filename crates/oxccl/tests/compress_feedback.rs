//! Error feedback and the compressed reduce-scatter over 4 in-process ranks, against sums the
//! test computes itself in `f64`:
//! - `all_reduce_compressed_feedback`: over `K` calls, the results add up to the inputs' sum
//!   minus the residuals left after the last call (what compression dropped is sent later,
//!   including the sums' rounding), where without feedback the error grows with every call;
//!   the same bits on every rank; an average is the sum over the world size;
//! - `reduce_scatter_compressed`: each rank's share within one quantisation per input of the
//!   `f64` sum of that share, the same telescoping with a residual, the input left alone;
//! - bad lengths and operations are refused with errors that name them.

use std::sync::Mutex;
use std::time::Duration;

use half::bf16;
use oxccl::compress::{Float, Format};
use oxccl::{Communicator, Options, Provider, ReduceOp};

mod common;
use common::Rng;

const N: usize = 4;

/// One job at a time: 4 ranks already outnumber this machine's CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

/// 4 communicators over shared memory, pipeline chunks of `chunk` bytes.
fn communicators(chunk: usize) -> Vec<Communicator> {
    common::in_process(N, "feedback", |_| Options {
        timeout: Duration::from_secs(60),
        provider: Some(Provider::Shm),
        compress_chunk: chunk,
        ..Options::default()
    })
}

/// Rank `rank`'s gradient of step `step`: values in (−1, 1) at one scale a group of 40 (the
/// blocks of the format do not line up with it), and a small steady drift that quantisation
/// at the block's scale mostly rounds away without feedback.
fn grad(step: usize, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng(0x9e37_79b9 ^ ((step as u64) << 20) ^ ((rank as u64 + 1) * 0x1234_5678_9abc));
    let mut scale = 1.0;
    (0..len)
        .map(|i| {
            let r = rng.next();
            if i % 40 == 0 {
                scale = 2f64.powi((r % 7) as i32 - 3);
            }
            let noise = ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale;
            (noise + 0.003 * scale * ((i % 5) as f64 - 2.0)) as f32
        })
        .collect()
}

/// A gradient whose every group of 40 holds one value of magnitude `s` and 39 steady ones
/// between 1/8 and 3/8 of the unit of `fmt` at `s`: without feedback they round to zero in every
/// block that holds the large one, call after call.
fn steady(step: usize, rank: usize, len: usize, fmt: Format) -> Vec<f32> {
    let mut rng =
        Rng(0x51ed ^ ((step as u64) << 24) ^ (rank as u64 + 7).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let unit = 2.0 / (2f64.powi(fmt.width.bits() as i32) - 1.0);
    let mut s = 1.0;
    (0..len)
        .map(|i| {
            let r = rng.next();
            let frac = (r >> 11) as f64 / (1u64 << 53) as f64;
            if i % 40 == 0 {
                s = 2f64.powi((r % 7) as i32 - 3);
                return if r & 1 == 0 { s as f32 } else { -s as f32 };
            }
            (s * unit * (0.25 + (frac - 0.5) / 4.0)) as f32
        })
        .collect()
}

/// The largest `|Σ results − (Σ inputs − Σ residuals)|` over the values, and the largest
/// `|Σ results − Σ inputs|`, all in `f64`.
fn drift(results: &[f64], inputs: &[f64], residuals: &[f64]) -> (f64, f64) {
    let mut tele: f64 = 0.0;
    let mut plain: f64 = 0.0;
    for ((r, i), e) in results.iter().zip(inputs).zip(residuals) {
        tele = tele.max((r - (i - e)).abs());
        plain = plain.max((r - i).abs());
    }
    (tele, plain)
}

#[test]
fn feedback_sends_later_what_compression_dropped() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 8 KiB chunks: several pipeline chunks per call.
    let comms = communicators(8 << 10);
    const K: usize = 24;
    for fmt in [Format::BFP8, Format::BFP4] {
        for len in [1usize, 1000, 5003] {
            let what = format!("{fmt:?}, {len} values");
            // Each rank's results, summed over the calls, its residual, and (without
            // feedback) its results summed.
            let per = common::per_rank(&comms, |rank, c| {
                let (mut res, mut sum, mut plain) =
                    (vec![0f32; len], vec![0f64; len], vec![0f64; len]);
                let mut first = Vec::new();
                for step in 0..K {
                    let mut g = steady(step, rank, len, fmt);
                    c.all_reduce_compressed_feedback(&mut g, &mut res, fmt, ReduceOp::Sum)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    sum.iter_mut().zip(&g).for_each(|(s, v)| *s += *v as f64);
                    if step == 0 {
                        first = g;
                    }
                    let mut g = steady(step, rank, len, fmt);
                    c.all_reduce_compressed(&mut g, fmt).unwrap();
                    plain.iter_mut().zip(&g).for_each(|(s, v)| *s += *v as f64);
                }
                (sum, res, plain, first)
            });
            for (r, p) in per.iter().enumerate() {
                assert!(
                    p.3.iter()
                        .zip(&per[0].3)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: rank {r}'s first result differs from rank 0's"
                );
            }
            let inputs: Vec<f64> = (0..len)
                .map(|k| {
                    (0..K)
                        .flat_map(|s| (0..N).map(move |r| (s, r)))
                        .map(|(s, r)| steady(s, r, len, fmt)[k] as f64)
                        .sum()
                })
                .collect();
            let left: Vec<f64> = (0..len)
                .map(|k| per.iter().map(|p| p.1[k] as f64).sum())
                .collect();
            let (tele, with_fb) = drift(&per[0].0, &inputs, &left);
            let (_, without) = drift(&per[0].2, &inputs, &left);
            // Only f32 roundings remain: of x = g + e and of the residual's additions, a few
            // units in the last place of values below 2^3 per call and rank.
            let ulps = K as f64 * N as f64 * 4.0 * 8.0 * f32::EPSILON as f64;
            assert!(
                tele <= ulps,
                "{what}: results − (inputs − residuals) = {tele:e} > {ulps:e}"
            );
            if len > 1 {
                assert!(
                    without > 3.0 * with_fb.max(tele),
                    "{what}: without feedback the error ({without:e}) should be well above \
                     with it ({with_fb:e})"
                );
            }
        }
    }
}

#[test]
fn an_average_is_the_sum_over_the_world_and_bad_calls_are_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = communicators(64 << 10);
    let len = 777;
    let out = common::per_rank(&comms, |rank, c| {
        let (mut a, mut ra) = (grad(1, rank, len), vec![0f32; len]);
        c.all_reduce_compressed_feedback(&mut a, &mut ra, Format::BFP8, ReduceOp::Avg)
            .unwrap();
        let (mut s, mut rs) = (grad(1, rank, len), vec![0f32; len]);
        c.all_reduce_compressed_feedback(&mut s, &mut rs, Format::BFP8, ReduceOp::Sum)
            .unwrap();
        (a, ra, s, rs)
    });
    for (r, (a, ra, s, rs)) in out.iter().enumerate() {
        // Dividing by 4 is exact.
        assert!(
            a.iter()
                .zip(s)
                .all(|(a, s)| a.to_bits() == (s / 4.0).to_bits()),
            "rank {r}"
        );
        assert_eq!(
            ra, rs,
            "rank {r}: the residual does not depend on the operation"
        );
    }
    // Refused before any collective runs, so one rank alone gets its answer.
    let c = &comms[0];
    let (mut g, mut short) = (vec![0f32; 10], vec![0f32; 9]);
    let e = c
        .all_reduce_compressed_feedback(&mut g, &mut short, Format::BFP8, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string().contains("a residual of 9 values for 10"),
        "{e}"
    );
    let mut res = vec![0f32; 10];
    let e = c
        .all_reduce_compressed_feedback(&mut g, &mut res, Format::BFP8, ReduceOp::Max)
        .unwrap_err();
    assert!(e.to_string().contains("op=Max is not supported"), "{e}");
    let mut out = vec![0f32; 3];
    let e = c
        .reduce_scatter_compressed(&g, &mut out, None, Format::BFP8, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("an input of 10 values for 4 ranks (n · m = 12"),
        "{e}"
    );
}

/// The first value of rank `r`'s share outside one quantisation per input of the `f64` sum:
/// `n · 2a / (2^M − 1)`, `a` the largest magnitude of the value's block (blocks start at the
/// share's first value) over every rank's input, plus one rounding to `T`.
fn rs_outside<T: Float>(
    inputs: &[Vec<T>],
    r: usize,
    out: &[T],
    fmt: Format,
    store: f64,
) -> Option<String> {
    let (m, b) = (out.len(), fmt.block.values());
    let levels = 2f64.powi(fmt.width.bits() as i32) - 1.0;
    for (blk, chunk) in out.chunks(b).enumerate() {
        let span = r * m + blk * b..r * m + blk * b + chunk.len();
        let a = inputs
            .iter()
            .flat_map(|x| x[span.clone()].iter().map(|v| v.to_f64().abs()))
            .fold(0.0, f64::max);
        let bound = N as f64 * 2.0 * a / levels;
        for (k, got) in span.zip(chunk) {
            let sum: f64 = inputs.iter().map(|x| x[k].to_f64()).sum();
            if (got.to_f64() - sum).abs() > bound + store * sum.abs() {
                return Some(format!(
                    "value {k}: {} against {sum}, bound {bound}",
                    got.to_f64()
                ));
            }
        }
    }
    None
}

#[test]
fn a_compressed_reduce_scatter_is_each_share_of_the_sum() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for chunk in [4 << 10, 4 << 20] {
        let comms = communicators(chunk);
        for fmt in [Format::BFP8, Format::BFP4] {
            for m in [0usize, 1, 33, 1000, 4097] {
                let what = format!("{fmt:?}, {m} values a rank, chunks of {chunk} bytes");
                let inputs: Vec<Vec<f32>> = (0..N).map(|r| grad(7, r, N * m)).collect();
                let out = common::per_rank(&comms, |r, c| {
                    let mut o = vec![f32::NAN; m];
                    c.reduce_scatter_compressed(&inputs[r], &mut o, None, fmt, ReduceOp::Sum)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    o
                });
                for (r, o) in out.iter().enumerate() {
                    if let Some(w) = rs_outside(&inputs, r, o, fmt, 0.0) {
                        panic!("{what}: rank {r}: {w}");
                    }
                }
                let bf: Vec<Vec<bf16>> = inputs
                    .iter()
                    .map(|x| x.iter().map(|&v| bf16::from_f32(v)).collect())
                    .collect();
                let out = common::per_rank(&comms, |r, c| {
                    let mut o = vec![bf16::ZERO; m];
                    c.reduce_scatter_compressed(&bf[r], &mut o, None, fmt, ReduceOp::Avg)
                        .unwrap_or_else(|e| panic!("{what}, bf16: {e}"));
                    o.iter()
                        .map(|v| bf16::from_f32(v.to_f32() * N as f32))
                        .collect::<Vec<_>>()
                });
                for (r, o) in out.iter().enumerate() {
                    if let Some(w) = rs_outside(&bf, r, o, fmt, 2f64.powi(-8)) {
                        panic!("{what}, bf16 average × 4: rank {r}: {w}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_reduce_scatter_with_feedback_telescopes_and_leaves_its_input_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = communicators(4 << 10);
    const K: usize = 10;
    let m = 1500;
    let fmt = Format::BFP4;
    let per = common::per_rank(&comms, |rank, c| {
        let (mut res, mut sum) = (vec![0f32; N * m], vec![0f64; m]);
        for step in 0..K {
            let g = grad(step, rank, N * m);
            let mut o = vec![0f32; m];
            c.reduce_scatter_compressed(&g, &mut o, Some(&mut res), fmt, ReduceOp::Sum)
                .unwrap();
            assert_eq!(g, grad(step, rank, N * m), "rank {rank}: the input changed");
            sum.iter_mut().zip(&o).for_each(|(s, v)| *s += *v as f64);
        }
        (sum, res)
    });
    for (r, (sum, _)) in per.iter().enumerate() {
        let inputs: Vec<f64> = (0..m)
            .map(|k| {
                (0..K)
                    .flat_map(|s| (0..N).map(move |q| (s, q)))
                    .map(|(s, q)| grad(s, q, N * m)[r * m + k] as f64)
                    .sum()
            })
            .collect();
        let left: Vec<f64> = (0..m)
            .map(|k| per.iter().map(|p| p.1[r * m + k] as f64).sum())
            .collect();
        let (tele, plain) = drift(sum, &inputs, &left);
        let ulps = K as f64 * N as f64 * 4.0 * 8.0 * f32::EPSILON as f64;
        assert!(
            tele <= ulps,
            "rank {r}: results − (inputs − residuals) = {tele:e} > {ulps:e}"
        );
        // The residuals are not nothing: bfp4 drops a lot a call.
        assert!(
            plain > 100.0 * ulps,
            "rank {r}: residuals {plain:e} look empty"
        );
    }
}
