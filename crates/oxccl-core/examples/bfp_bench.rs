//! The BFP codec's rate on one core: GB/s of `f32` input, encode and decode, per width and
//! block size and per kernel set, beside a `memcpy` of the same 64 MiB in the same run.
//!
//! `cargo run --release -p oxccl-core --example bfp_bench -- [MiB] [reps]` (`bench/bfp-codec.sh`).

use std::hint::black_box;
use std::time::Instant;

use oxccl_core::compress::{self, BlockSize, Format, Width};

/// Best and mean seconds of `reps` runs of `f` (after one warm-up run).
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut best = f64::INFINITY;
    let mut total = 0.0;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        let s = t.elapsed().as_secs_f64();
        best = best.min(s);
        total += s;
    }
    (best, total / reps as f64)
}

/// Gradient-like data: a random magnitude per run of 32 values, random signs and mantissas.
fn gradients(n: usize) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut scale = 1.0f32;
    (0..n)
        .map(|i| {
            if i % 32 == 0 {
                scale = 2f32.powi((rnd() % 24) as i32 - 20);
            }
            ((rnd() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// The table's rows: each a timing of `reps` runs over `bytes` of f32 input.
struct Table {
    bytes: f64,
    reps: usize,
}

impl Table {
    /// Prints the rate of `f`'s best and mean run as the row of kernel set `k`, format `f`,
    /// block `blk` and operation `op`.
    fn row(&self, k: &str, fmt: &str, blk: &str, op: &str, f: impl FnMut()) {
        let (b, m) = time(self.reps, f);
        println!(
            "{k:<8} {fmt:<7} {blk:>5} {op:<8} {:>14.2} {:>14.2}",
            self.bytes / b / 1e9,
            self.bytes / m / 1e9
        );
    }
}

/// Encode and decode at every width and block size, with kernel set `kernel`.
fn codec_rows(t: &Table, kernel: &str, x: &[f32], wire: &mut [u8], out: &mut [f32]) {
    let n = x.len();
    for width in [Width::Bfp8, Width::Bfp4] {
        for block in [BlockSize::B16, BlockSize::B32, BlockSize::B64] {
            let fmt = Format { width, block };
            let name = if width == Width::Bfp8 { "bfp8" } else { "bfp4" };
            let wire = &mut wire[..compress::encoded_len(n, fmt)];
            let blk = block.values().to_string();
            t.row(kernel, name, &blk, "encode", || {
                compress::encode(black_box(x), fmt, wire).expect("lengths match");
            });
            t.row(kernel, name, &blk, "decode", || {
                compress::decode(black_box(&*wire), out).expect("a valid buffer");
            });
        }
    }
}

/// The all-reduce's steps, bfp8 at 32: exponents, quantise, decode an i16 sum; then the
/// result phase: re-encoding the sums (plain Rust, the same for every kernel set), and
/// decoding the re-encoded i8 mantissas.
fn all_reduce_rows(t: &Table, kernel: &str, x: &[f32], out: &mut [f32]) {
    let n = x.len();
    let fmt = Format::BFP8;
    let mut e = vec![0u8; compress::block_count(n, fmt.block)];
    let mut q = vec![0i8; n];
    t.row(kernel, "bfp8", "32", "exps", || {
        compress::block_exponents(black_box(x), fmt, &mut e).expect("lengths match");
    });
    t.row(kernel, "bfp8", "32", "quantize", || {
        compress::quantize(black_box(x), &e, fmt, &mut q).expect("finite");
    });
    let sum: Vec<i16> = q.iter().map(|&v| 3 * v as i16).collect();
    t.row(kernel, "bfp8", "32", "deq-i16", || {
        compress::dequantize(black_box(&sum), &e, fmt, out).expect("lengths match");
    });
    let mut ne = vec![0u8; e.len()];
    t.row(kernel, "bfp8", "32", "requant", || {
        compress::requantize(black_box(&sum), &e, fmt, &mut ne, &mut q).expect("lengths match");
    });
    t.row(kernel, "bfp8", "32", "deq-i8", || {
        compress::dequantize(black_box(&q), &ne, fmt, out).expect("lengths match");
    });
}

/// Half-precision inputs (widened on the stack), bfp8 at 32, with the current kernels.
fn half_rows(t: &Table, x: &[f32], wire: &mut [u8]) {
    let n = x.len();
    let fmt = Format::BFP8;
    let wire = &mut wire[..compress::encoded_len(n, fmt)];
    let h: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let mut ho = vec![half::f16::ZERO; n];
    t.row(compress::kernel(), "bfp8", "32", "enc-f16", || {
        compress::encode(black_box(&h), fmt, wire).expect("lengths match");
    });
    t.row(compress::kernel(), "bfp8", "32", "dec-f16", || {
        compress::decode(black_box(&*wire), &mut ho).expect("a valid buffer");
    });
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let mib = args.first().copied().unwrap_or(64);
    let reps = args.get(1).copied().unwrap_or(20);
    let n = mib << 18; // f32 values
    let t = Table {
        bytes: (n * 4) as f64,
        reps,
    };
    let x = gradients(n);

    println!("# bfp codec, one core: {mib} MiB of f32 ({n} values), best (mean) of {reps} runs");
    let best = compress::kernel();
    println!("# default kernels: {best}");
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if let Some(model) = cpu.lines().find(|l| l.starts_with("model name")) {
        println!("# {}", model.trim());
    }

    let mut dst = vec![0f32; n];
    let (b, m) = time(reps, || {
        dst.copy_from_slice(black_box(&x));
        black_box(&mut dst);
    });
    println!(
        "{:<8} {:<7} {:>5} {:<8} {:>14} {:>14}",
        "kernel", "format", "block", "op", "GB/s best", "GB/s mean"
    );
    println!(
        "{:<8} {:<7} {:>5} {:<8} {:>14.2} {:>14.2}",
        "-",
        "memcpy",
        "-",
        "copy",
        t.bytes / b / 1e9,
        t.bytes / m / 1e9
    );

    let widest = Format {
        width: Width::Bfp8,
        block: BlockSize::B16,
    };
    let mut wire = vec![0u8; compress::encoded_len(n, widest)];
    let mut out = vec![0f32; n];
    for kernel in ["avx512", "avx2", "scalar"] {
        if !compress::force_kernel(kernel) {
            println!("# {kernel}: not on this CPU");
            continue;
        }
        codec_rows(&t, kernel, &x, &mut wire, &mut out);
        all_reduce_rows(&t, kernel, &x, &mut out);
    }
    compress::force_kernel(best);
    half_rows(&t, &x, &mut wire);
    println!("# GB/s of f32 input (4 bytes a value; for f16 rows too), 1 GB = 1e9 bytes");
    Ok(())
}
