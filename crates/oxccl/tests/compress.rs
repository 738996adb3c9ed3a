//! The compressed all-reduce (`Communicator::all_reduce_compressed`) over 4 in-process ranks:
//! the same bits on every rank, the same bits whether the ranks share one host or form two
//! (where the collectives under it run two-tier algorithms), whatever the pipeline's chunk size,
//! and within one quantisation per input plus one rounding of the sum of an `f64` sum: per value
//! at most `n · 2a / (2^M − 1) + 2·max(a, A) / (2^M − 1)`, with `a` the largest magnitude of the
//! value's block over every rank's input, `A` the largest magnitude of the block's quantised sum
//! (at most that of its `f64` sum plus the first term) and `M` the mantissa bits (the bounds
//! `oxccl_core::compress` derives for a quantisation at a block's exponent and for
//! `requantize`). A block with a NaN on one rank is NaN on every rank. Then `OXCCL_COMPRESS`:
//! its parsing, and a plain `all_reduce` that goes compressed exactly when it should.

use std::sync::Mutex;
use std::time::Duration;

use half::{bf16, f16};
use oxccl::compress::{BlockSize, Float, Format, Width};
use oxccl::{Communicator, Compression, Options, Provider, ReduceOp};

mod common;
use common::Rng;

const N: usize = 4;

/// One job at a time: 4 ranks already outnumber this machine's CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

/// 4 communicators in this process over `provider`, `per_host` ranks per host id.
fn communicators(provider: Provider, per_host: usize) -> Vec<Communicator> {
    with_options(provider, per_host, Options::default())
}

/// [`communicators`] with other options.
fn with_options(provider: Provider, per_host: usize, o: Options) -> Vec<Communicator> {
    common::in_process(N, &format!("{provider:?}"), |rank| Options {
        timeout: Duration::from_secs(60),
        provider: Some(provider),
        host_id: Some(format!("compress-host-{}", rank / per_host)),
        ..o.clone()
    })
}

/// Rank `rank`'s input: each block of 16 values at its own scale (2^-20 .. 2^20), both signs,
/// some exact zeros.
fn input<T: Float>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng = Rng(seed ^ (rank as u64 + 1).wrapping_mul(0x5851_f42d_4c95_7f2d));
    let mut scale = 1.0;
    (0..len)
        .map(|i| {
            let r = rng.next();
            if i % 16 == 0 {
                scale = 2f64.powi((r % 41) as i32 - 20);
            }
            let x = if r.is_multiple_of(11) {
                0.0
            } else {
                ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
            };
            T::from_f64(x)
        })
        .collect()
}

/// Runs the compressed all-reduce of `inputs` (one per rank) on `comms`; every rank's result.
fn run<T: Float>(comms: &[Communicator], inputs: &[Vec<T>], fmt: Format) -> Vec<Vec<T>> {
    common::per_rank(comms, |r, c| {
        let mut buf = inputs[r].clone();
        c.all_reduce_compressed(&mut buf, fmt)
            .unwrap_or_else(|e| panic!("{fmt:?}, {} values: {e}", buf.len()));
        buf
    })
}

/// Whether every rank holds the same bits.
fn same_bits<T: Float>(out: &[Vec<T>]) -> bool {
    out.iter().all(|o| {
        o.len() == out[0].len()
            && o.iter()
                .zip(&out[0])
                .all(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits())
    })
}

/// The first value outside `n · 2a / (2^M − 1) + 2·max(a, A) / (2^M − 1)` of the `f64` sum, if
/// any.
fn outside_bound<T: Float + Stored>(inputs: &[Vec<T>], out: &[T], fmt: Format) -> Option<String> {
    let b = fmt.block.values();
    let m = fmt.width.bits() as i32;
    for (blk, chunk) in out.chunks(b).enumerate() {
        let range = blk * b..blk * b + chunk.len();
        let a = inputs
            .iter()
            .flat_map(|x| x[range.clone()].iter().map(|v| v.to_f64().abs()))
            .fold(0.0, f64::max);
        let inputs_err = N as f64 * 2.0 * a / (2f64.powi(m) - 1.0);
        let sums = range
            .clone()
            .map(|k| inputs.iter().map(|x| x[k].to_f64()).sum::<f64>().abs())
            .fold(0.0, f64::max);
        let big = sums + inputs_err;
        let bound = inputs_err + 2.0 * a.max(big) / (2f64.powi(m) - 1.0);
        for (k, got) in range.clone().zip(chunk) {
            let sum: f64 = inputs.iter().map(|x| x[k].to_f64()).sum();
            // A bf16/f16 result also rounds once when it is stored.
            let store = got.to_f64().abs() * 2f64.powi(-(T::mantissa_bits() as i32));
            if (got.to_f64() - sum).abs() > bound + store {
                return Some(format!(
                    "value {k}: {} against the sum {sum}, bound {bound} (block max {a})",
                    got.to_f64()
                ));
            }
        }
    }
    None
}

/// The stored precision of the test's element types.
trait Stored {
    fn mantissa_bits() -> u32;
}

impl Stored for f32 {
    fn mantissa_bits() -> u32 {
        // The i16 sums decode exactly into f32.
        64
    }
}

impl Stored for f16 {
    fn mantissa_bits() -> u32 {
        11
    }
}

impl Stored for bf16 {
    fn mantissa_bits() -> u32 {
        8
    }
}

fn check<T: Float + Stored>(
    flat: &[Communicator],
    two_hosts: &[Communicator],
    small_chunks: &[Communicator],
    ctx: &str,
    seed: u64,
) {
    let formats = [
        Format::BFP8,
        Format::BFP4,
        Format {
            width: Width::Bfp8,
            block: BlockSize::B16,
        },
        Format {
            width: Width::Bfp4,
            block: BlockSize::B64,
        },
    ];
    for fmt in formats {
        for len in [0usize, 1, 31, 32, 33, 1000, 4099, 70_001] {
            let inputs: Vec<Vec<T>> = (0..N).map(|r| input(seed ^ len as u64, r, len)).collect();
            let out = run(flat, &inputs, fmt);
            let what = format!("{ctx}, {fmt:?}, {len} values");
            assert!(same_bits(&out), "{what}: the ranks' results differ");
            if let Some(w) = outside_bound(&inputs, &out[0], fmt) {
                panic!("{what}: {w}");
            }
            let other = run(two_hosts, &inputs, fmt);
            assert!(
                same_bits(&[out[0].clone(), other[0].clone()]) && same_bits(&other),
                "{what}: two hosts give other bits than one"
            );
            let piped = run(small_chunks, &inputs, fmt);
            assert!(
                same_bits(&[out[0].clone(), piped[0].clone()]) && same_bits(&piped),
                "{what}: pipeline chunks of 64 KiB give other bits than one chunk"
            );
        }
    }
}

#[test]
fn the_same_bits_everywhere_within_one_quantisation() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for provider in [Provider::Shm, Provider::Tcp] {
        let flat = communicators(provider, N);
        let two = communicators(provider, 2);
        let small = with_options(
            provider,
            N,
            Options {
                compress_chunk: 64 << 10,
                ..Options::default()
            },
        );
        let ctx = format!("{provider:?}");
        check::<f32>(&flat, &two, &small, &format!("{ctx}, f32"), 1);
        check::<bf16>(&flat, &two, &small, &format!("{ctx}, bf16"), 2);
        check::<f16>(&flat, &two, &small, &format!("{ctx}, f16"), 3);
    }
}

#[test]
fn a_nan_block_on_one_rank_is_nan_on_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = communicators(Provider::Shm, N);
    let fmt = Format::BFP8;
    let mut inputs: Vec<Vec<f32>> = (0..N).map(|r| input(7, r, 100)).collect();
    inputs[2][40] = f32::NAN;
    inputs[3][70] = f32::INFINITY;
    let out = run(&comms, &inputs, fmt);
    assert!(same_bits(&out));
    for (k, v) in out[0].iter().enumerate() {
        // Blocks of 32: values 32..64 hold the NaN, 64..96 the infinity.
        let poisoned = (32..96).contains(&k);
        assert_eq!(v.is_nan(), poisoned, "value {k} = {v}");
    }
    // The finite blocks are still within the bound.
    let finite: Vec<Vec<f32>> = inputs.iter().map(|x| x[..32].to_vec()).collect();
    assert_eq!(outside_bound(&finite, &out[0][..32], fmt), None);
}

#[test]
fn untyped_buffers_of_the_wrong_type_or_shape_are_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = communicators(Provider::Shm, N);
    let c = &comms[0];
    let mut aligned = vec![0f32; 4];
    // Refused before any collective runs, so one rank alone gets its answer.
    for (range, dtype, says) in [
        (
            0..6,
            oxccl::DataType::F32,
            "not whole, aligned float values",
        ),
        (
            1..9,
            oxccl::DataType::F32,
            "not whole, aligned float values",
        ),
        (0..8, oxccl::DataType::I32, "float32, float16 or bfloat16"),
    ] {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut aligned);
        let e = c
            .all_reduce_compressed_bytes(&mut bytes[range], dtype, Format::BFP8)
            .unwrap_err();
        assert!(
            matches!(e, oxccl::Error::InvalidArgument { rank: 0, .. })
                && e.to_string().contains(says),
            "{dtype}: {e}"
        );
    }
}

#[test]
fn oxccl_compress_is_parsed_and_bad_values_are_refused() {
    let parse = |v: &str| {
        Options::from_vars(&|k| (k == "OXCCL_COMPRESS").then(|| v.to_string())).map(|o| o.compress)
    };
    assert_eq!(parse("off").unwrap(), Compression::Off);
    assert_eq!(parse("auto").unwrap(), Compression::Auto);
    assert_eq!(parse("bfp8").unwrap(), Compression::Always(Format::BFP8));
    assert_eq!(parse(" bfp4 ").unwrap(), Compression::Always(Format::BFP4));
    assert_eq!(
        parse("bfp8/16").unwrap(),
        Compression::Always(Format {
            width: Width::Bfp8,
            block: BlockSize::B16
        })
    );
    for bad in ["bfp7", "bfp8/48", "on", "fp8"] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(
            e.contains("OXCCL_COMPRESS") && e.contains("off, auto, bfp8 or bfp4"),
            "{bad}: {e}"
        );
    }
    assert_eq!(Options::default().compress, Compression::Off);
    let chunk = |v: &str| {
        Options::from_vars(&|k| (k == "OXCCL_COMPRESS_CHUNK").then(|| v.to_string()))
            .map(|o| o.compress_chunk)
    };
    assert_eq!(chunk("1M").unwrap(), 1 << 20);
    let e = chunk("1K").unwrap_err().to_string();
    assert!(e.contains("OXCCL_COMPRESS_CHUNK"), "{e}");
}

/// Every rank's plain `all_reduce` (out of place) of `inputs` with `op`.
fn plain<T: oxccl::Element>(
    comms: &[Communicator],
    inputs: &[Vec<T>],
    op: ReduceOp,
) -> Vec<Vec<T>> {
    common::per_rank(comms, |r, c| {
        let mut out = inputs[r].clone();
        c.all_reduce(&inputs[r], &mut out, op).expect("all_reduce");
        out
    })
}

#[test]
fn plain_all_reduce_goes_compressed_when_asked() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let len = 70_001;
    let inputs: Vec<Vec<f32>> = (0..N).map(|r| input(11, r, len)).collect();
    let exact = plain(&communicators(Provider::Shm, N), &inputs, ReduceOp::Sum);
    let bfp4 = run(&communicators(Provider::Shm, N), &inputs, Format::BFP4);
    assert!(!same_bits(&[exact[0].clone(), bfp4[0].clone()]));
    let asked = |c| Options {
        compress: c,
        ..Options::default()
    };
    // Asked for bfp4: a float sum is the compressed sum, bit for bit; an average that divided
    // by the world size.
    let comms = with_options(Provider::Shm, N, asked(Compression::Always(Format::BFP4)));
    let got = plain(&comms, &inputs, ReduceOp::Sum);
    assert!(same_bits(&got) && same_bits(&[got[0].clone(), bfp4[0].clone()]));
    let avg = plain(&comms, &inputs, ReduceOp::Avg);
    assert!(avg[0].iter().zip(&bfp4[0]).all(|(a, s)| *a == s / N as f32));
    // Other types and operators stay exact.
    let ints: Vec<Vec<i32>> = (0..N)
        .map(|r| (0..1000).map(|i| i * 7 - r as i32 * 1001).collect())
        .collect();
    let sums = plain(&comms, &ints, ReduceOp::Sum);
    for (i, s) in sums[0].iter().enumerate() {
        assert_eq!(*s as i64, (0..N).map(|r| ints[r][i] as i64).sum::<i64>());
    }
    let max = plain(&comms, &inputs, ReduceOp::Max);
    for (i, m) in max[0].iter().enumerate() {
        let want = (0..N).map(|r| inputs[r][i]).fold(f32::MIN, f32::max);
        assert_eq!(*m, want, "max at {i}");
    }
    // In place too.
    std::thread::scope(|s| {
        for (c, x) in comms.iter().zip(&inputs) {
            let want = &bfp4[0];
            s.spawn(move || {
                let mut b = x.clone();
                c.all_reduce_in_place(&mut b, ReduceOp::Sum)
                    .expect("in place");
                assert!(b.iter().zip(want).all(|(a, w)| a.to_bits() == w.to_bits()));
            });
        }
    });
    // Auto: every rank on one host (shared memory) stays exact, even when large...
    let big: Vec<Vec<f32>> = (0..N).map(|r| input(12, r, 300_000)).collect();
    let auto = with_options(Provider::Shm, N, asked(Compression::Auto));
    let exact_big = plain(&communicators(Provider::Shm, N), &big, ReduceOp::Sum);
    let got = plain(&auto, &big, ReduceOp::Sum);
    assert!(same_bits(&[got[0].clone(), exact_big[0].clone()]));
    for (i, g) in got[0].iter().enumerate() {
        let sum: f64 = (0..N).map(|r| big[r][i] as f64).sum();
        let size: f64 = (0..N).map(|r| (big[r][i] as f64).abs()).sum();
        assert!((*g as f64 - sum).abs() <= size * 1e-6, "{i}");
    }
    // ... across two hosts it compresses (bfp8) from COMPRESS_AUTO_MIN_BYTES, not below.
    let auto2 = with_options(Provider::Tcp, 2, asked(Compression::Auto));
    let bfp8 = run(&communicators(Provider::Tcp, 2), &big, Format::BFP8);
    let got = plain(&auto2, &big, ReduceOp::Sum);
    assert!(same_bits(&got) && same_bits(&[got[0].clone(), bfp8[0].clone()]));
    const { assert!(300_000 * 4 >= oxccl::COMPRESS_AUTO_MIN_BYTES) };
    let got = plain(&auto2, &inputs, ReduceOp::Sum);
    const { assert!(70_001 * 4 < oxccl::COMPRESS_AUTO_MIN_BYTES) };
    let exact2 = plain(&communicators(Provider::Tcp, 2), &inputs, ReduceOp::Sum);
    assert!(same_bits(&[got[0].clone(), exact2[0].clone()]));
}

#[test]
fn large_pipelined_calls_across_hosts_keep_their_order() {
    // Chunks of 4 MiB on two hosts over tcp: each chunk's all-gather (1.03 MiB) is large enough for the
    // link-rate learner, whose metered calls run alone and are numbered late; the pipeline's
    // calls must not be (they were, and ranks saw each other in different calls).
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = |chunk| Options {
        compress_chunk: chunk,
        ..Options::default()
    };
    let piped = with_options(Provider::Tcp, 2, opts(4 << 20));
    let whole = with_options(Provider::Tcp, 2, opts(1 << 30));
    let len = 3_000_000;
    let inputs: Vec<Vec<f32>> = (0..N).map(|r| input(21, r, len)).collect();
    for fmt in [Format::BFP8, Format::BFP4] {
        let a = run(&piped, &inputs, fmt);
        let b = run(&whole, &inputs, fmt);
        assert!(
            same_bits(&a) && same_bits(&[a[0].clone(), b[0].clone()]),
            "{fmt:?}"
        );
        assert_eq!(outside_bound(&inputs, &a[0], fmt), None, "{fmt:?}");
    }
}

/// A compressed all-reduce inside a job submitted to the worker (as Python's `async_op=True`
/// and the DDP hook run it): its pipeline's calls run on the worker, in the job, and give the
/// bits of the blocking call (they were queued behind the job that waited for them: a hang).
#[test]
fn inside_a_submitted_job_the_pipeline_runs_on_the_worker() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = with_options(
        Provider::Shm,
        N,
        Options {
            compress_chunk: 64 << 10,
            ..Options::default()
        },
    );
    let len = 100_003;
    let inputs: Vec<Vec<f32>> = (0..N).map(|r| input(33, r, len)).collect();
    let blocking = run(&comms, &inputs, Format::BFP8);
    let submitted: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, inp)| {
                let mut v = inp.clone();
                s.spawn(move || {
                    let mut w = c
                        .submit(move |c| c.all_reduce_compressed(&mut v, Format::BFP8).map(|()| v));
                    w.wait(Duration::from_secs(60)).expect("the submitted job")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(same_bits(&[blocking[0].clone(), submitted[0].clone()]));
    assert!(same_bits(&submitted));
}
