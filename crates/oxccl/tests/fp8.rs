//! fp8 all-reduce sums over 8 in-process ranks (threads, the shm provider) stay within the error
//! bound documented in `oxccl_core::dtype`, against an exact `f64` reference, for both 8-bit
//! types and every all-reduce algorithm the runtime can run (forced through
//! [`Options::algo`]):
//!
//! ```text
//! |computed − Σ x_i| ≤ ((1 + u)^k − 1) · Σ |x_i|  +  (n − 1) · (1 + u)^k · s/2
//! ```
//!
//! with `u` the unit roundoff, `s` the smallest subnormal and `k` the algorithm's number of
//! roundings on a path (ring, direct, proportional: n − 1; hierarchical over 2 hosts of 4:
//! 3 + 1; recursive doubling: log2 n). Inputs are random fp8 values small enough that no
//! partial sum can leave the finite range (e4m3 saturates at 448), drawn over every exponent
//! (subnormals included) or from a narrow range of exponents with both signs (cancellation).
//! Every rank must also hold the same bits. The largest error seen, as a fraction of the bound,
//! is printed (`--nocapture`).

use std::cell::RefCell;
use std::sync::Mutex;
use std::time::Duration;

use oxccl::schedule::Algorithm;
use oxccl::{Communicator, DataType, Element, F8E4M3, F8E5M2, Options, Provider, ReduceOp};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError, TestRunner};

mod common;
use common::Rng;

const N: usize = 8;

/// One job at a time: 8 ranks each already outnumber this machine's CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

/// What the test needs of an fp8 type.
trait Fp8: Element {
    /// The largest magnitude code of an input: `Σ|x_i| (1 + u)^k` stays finite for 8 ranks
    /// and k ≤ 7 (e4m3: 32 = 0x60, 8 · 32 · 1.0625^7 ≈ 392 < 448; e5m2: 2048 = 0x68,
    /// 8 · 2048 · 1.125^7 ≈ 37 400 < 57 344).
    const MAX_INPUT_CODE: u8;
    /// The smallest positive subnormal.
    const SUBNORMAL: f64;
    /// Mantissa bits (codes per binade: 2^MANT).
    const MANT: u32;
    fn from_bits(b: u8) -> Self;
}

impl Fp8 for F8E4M3 {
    const MAX_INPUT_CODE: u8 = 0x60;
    const SUBNORMAL: f64 = 1.0 / 512.0;
    const MANT: u32 = 3;
    fn from_bits(b: u8) -> Self {
        F8E4M3::from_bits(b)
    }
}

impl Fp8 for F8E5M2 {
    const MAX_INPUT_CODE: u8 = 0x68;
    const SUBNORMAL: f64 = 1.0 / 65536.0;
    const MANT: u32 = 2;
    fn from_bits(b: u8) -> Self {
        F8E5M2::from_bits(b)
    }
}

/// Rank `rank`'s input: magnitudes over every code up to the limit (`narrow == false`), or
/// within two binades starting at a random one (both signs, so sums cancel).
fn input<T: Fp8>(seed: u64, rank: usize, count: usize, narrow: bool) -> Vec<T> {
    let mut rng = Rng(seed ^ (rank as u64).wrapping_mul(0x5851_f42d_4c95_7f2d));
    let top = u64::from(T::MAX_INPUT_CODE);
    let span = 2u64 << T::MANT;
    let low = seed % (top + 1 - span);
    (0..count)
        .map(|_| {
            let r = rng.next();
            let mag = if narrow {
                low + (r >> 8) % span
            } else {
                (r >> 8) % (top + 1)
            };
            T::from_bits(mag as u8 | ((r & 1) << 7) as u8)
        })
        .collect()
}

/// 8 communicators joined in this process with `algo` forced; `per_host` ranks per host id.
fn communicators(algo: Algorithm, per_host: usize) -> Vec<Communicator> {
    common::in_process(N, &format!("{algo:?}"), |rank| Options {
        timeout: Duration::from_secs(60),
        provider: Some(Provider::Shm),
        host_id: Some(format!("fp8-host-{}", rank / per_host)),
        algo: Some(algo),
        // Small chunks: long messages pipeline over many steps.
        chunk_size: Some(256),
        channels: Some(2),
        ..Options::default()
    })
}

/// The largest error seen, as a fraction of the bound and of Σ|x_i|.
#[derive(Default)]
struct Worst {
    of_bound: f64,
    of_abs_sum: f64,
}

/// One case: every rank all-reduces its input; every output within the bound, and the same
/// on every rank.
#[allow(clippy::too_many_arguments)]
fn check<T: Fp8>(
    comms: &[Communicator],
    k: u32,
    seed: u64,
    count: usize,
    narrow: bool,
    in_place: bool,
    worst: &mut Worst,
) -> Result<(), TestCaseError> {
    let inputs: Vec<Vec<T>> = (0..N).map(|r| input(seed, r, count, narrow)).collect();
    let outputs: Vec<oxccl::Result<Vec<T>>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, inp)| {
                s.spawn(move || {
                    if in_place {
                        let mut buf = inp.clone();
                        c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
                        Ok(buf)
                    } else {
                        let mut out = vec![T::from_f64(0.0); count];
                        c.all_reduce(inp, &mut out, ReduceOp::Sum)?;
                        Ok(out)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let outputs: Vec<Vec<T>> = outputs
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.map_err(|e| TestCaseError::fail(format!("rank {r}: {e}"))))
        .collect::<Result<_, _>>()?;
    let u = T::DTYPE.unit_roundoff().expect("a float");
    let grow = (1.0 + u).powi(k as i32);
    for i in 0..count {
        // Exact: fp8 values have 4 significant bits within 2^-16..2^15.
        let exact: f64 = inputs.iter().map(|v| v[i].to_f64()).sum();
        let abs: f64 = inputs.iter().map(|v| v[i].to_f64().abs()).sum();
        let bound = (grow - 1.0) * abs + (N - 1) as f64 * grow * T::SUBNORMAL / 2.0;
        let got = outputs[0][i].to_f64();
        let err = (got - exact).abs();
        prop_assert!(
            err <= bound,
            "{} element {i} of {count}: got {got}, exact {exact}, error {err} > bound {bound} \
             (Σ|x| {abs}, k {k}); inputs {:?}",
            T::DTYPE,
            inputs.iter().map(|v| v[i]).collect::<Vec<_>>()
        );
        if bound > 0.0 {
            worst.of_bound = worst.of_bound.max(err / bound);
        }
        if abs > 0.0 {
            worst.of_abs_sum = worst.of_abs_sum.max(err / abs);
        }
    }
    for (r, o) in outputs.iter().enumerate().skip(1) {
        let same = oxccl::as_bytes(o) == oxccl::as_bytes(&outputs[0]);
        prop_assert!(
            same,
            "{}: rank {r}'s result differs from rank 0's",
            T::DTYPE
        );
    }
    Ok(())
}

/// Runs the property for both types with `algo` forced; `k` its roundings per path.
fn property(algo: Algorithm, per_host: usize, k: u32) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = communicators(algo, per_host);
    for dtype in [DataType::F8E4M3, DataType::F8E5M2] {
        let mut runner = TestRunner::new(PropConfig {
            cases: 64,
            failure_persistence: None,
            ..PropConfig::default()
        });
        let worst = RefCell::new(Worst::default());
        let strategy = (any::<u64>(), 1usize..2000, any::<bool>(), any::<bool>());
        let result = runner.run(&strategy, |(seed, count, narrow, in_place)| match dtype {
            DataType::F8E4M3 => check::<F8E4M3>(
                &comms,
                k,
                seed,
                count,
                narrow,
                in_place,
                &mut worst.borrow_mut(),
            ),
            _ => check::<F8E5M2>(
                &comms,
                k,
                seed,
                count,
                narrow,
                in_place,
                &mut worst.borrow_mut(),
            ),
        });
        if let Err(e) = result {
            panic!("{algo:?}, {dtype}: {e}");
        }
        let worst = worst.into_inner();
        eprintln!(
            "fp8 sum, 8 ranks, {algo:?} (k = {k}), {dtype}: largest error {:.3} of the bound, \
             {:.4} of Σ|x_i| (first-order bound k·u = {:.4})",
            worst.of_bound,
            worst.of_abs_sum,
            k as f64 * dtype.unit_roundoff().unwrap_or(0.0)
        );
    }
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || c.destroy().expect("destroy"));
        }
    });
}

#[test]
fn ring_sums_within_the_bound() {
    property(Algorithm::Ring, N, N as u32 - 1);
}

#[test]
fn recursive_doubling_sums_within_the_bound() {
    property(Algorithm::RecursiveDoubling, N, 3);
}

#[test]
fn direct_sums_within_the_bound() {
    property(Algorithm::Direct, N, N as u32 - 1);
}

#[test]
fn proportional_sums_within_the_bound() {
    property(Algorithm::Proportional, N, N as u32 - 1);
}

#[test]
fn hierarchical_sums_within_the_bound() {
    // 2 hosts of 4 ranks: 3 roundings inside a host, 1 across.
    property(Algorithm::Hierarchical, 4, 4);
}
