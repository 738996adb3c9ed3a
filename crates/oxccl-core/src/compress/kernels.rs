//! The codec's kernels over `f32`: the portable scalar definitions, which the vector versions in
//! `x86` must match bit for bit, and the run-time choice between them.
//!
//! Every kernel takes whole blocks of `block` values from the start of its slices (the last block
//! may be shorter) and lengths already checked by the caller: `exps.len()` is the block count.

use std::sync::atomic::{AtomicU8, Ordering};

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable Rust.
    Scalar,
    /// AVX2 (x86-64).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    /// AVX-512 F (x86-64, with the `avx512` feature).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Isa {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Every kernel set this CPU runs, the best last.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if super::x86::has_avx2() {
                v.push(Isa::Avx2);
            }
            if super::x86::has_avx512() {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// The kernels in use: `Isa as u8 + 1`, 0 before the first call.
static ISA: AtomicU8 = AtomicU8::new(0);

const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

/// The best kernels this CPU runs, detected on the first call.
pub(crate) fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        0 => {
            let best = detect();
            ISA.store(best as u8 + 1, Ordering::Relaxed);
            best
        }
        i => ALL[(i - 1) as usize % ALL.len()],
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if super::x86::has_avx512() {
            return Isa::Avx512;
        }
        if super::x86::has_avx2() {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// Makes every later call use the kernels named (`"scalar"`, `"avx2"`, `"avx512"`) if this CPU
/// runs them; false (and nothing changed) otherwise.
pub(crate) fn force(name: &str) -> bool {
    let Some(&want) = ALL.iter().find(|i| i.name() == name) else {
        return false;
    };
    let ok = match want {
        Isa::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::x86::has_avx2(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => super::x86::has_avx512(),
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    };
    if ok {
        ISA.store(want as u8 + 1, Ordering::Relaxed);
    }
    ok
}

/// `|x|`'s bits at or above this are an infinity or a NaN.
pub(crate) const INF_BITS: u32 = 0x7F80_0000;

/// The exponent of a block whose largest `|x|` has the bits `max_abs_bits`, for `m`-bit
/// mantissas: `max((bits + 2^(24−m)) >> 23, 1) − 1`, or 255 for a NaN or an infinity.
#[inline(always)]
pub(crate) fn exponent_of(max_abs_bits: u32, m: u32) -> u8 {
    if max_abs_bits >= INF_BITS {
        return super::NON_FINITE;
    }
    // At most 0x7F7F_FFFF + 2^20: no overflow, and the shift leaves at most 255.
    (((max_abs_bits + (1 << (24 - m))) >> 23).max(1) - 1) as u8
}

/// `2^p` as an `f32`, for `p` in `−126..=127`.
#[inline(always)]
fn pow2(p: i32) -> f32 {
    f32::from_bits(((p + 127) as u32) << 23)
}

/// The two factors whose product is `1/u(e) = 2^(124 + m − e)` (up to 2^132: not an `f32`),
/// each in `2^−63..=2^66`, both at least 1 or both at most 1, for a finite `e`.
#[inline(always)]
pub(crate) fn quant_factors(e: u8, m: u32) -> (f32, f32) {
    let p = 124 + m as i32 - e as i32;
    let p1 = p >> 1;
    (pow2(p1), pow2(p - p1))
}

/// The unit `u(e) = 2^(e − 124 − m)` as an `f32` (subnormal below 2^−126), NaN for 255.
#[inline(always)]
pub(crate) fn unit(e: u8, m: u32) -> f32 {
    if e == super::NON_FINITE {
        return f32::from_bits(0x7FC0_0000);
    }
    let q = e as i32 - 124 - m as i32; // −132..=126
    if q >= -126 {
        pow2(q)
    } else {
        f32::from_bits(1 << (q + 149))
    }
}

/// The unit `u(e)` as an `f64`, NaN for 255.
pub(crate) fn unit_f64(e: u8, m: u32) -> f64 {
    if e == super::NON_FINITE {
        return f64::NAN;
    }
    (unit(e, m)) as f64
}

/// Adding and subtracting 1.5 · 2^23 rounds an `f32` of magnitude below 2^22 to an integer, to
/// nearest even (the default rounding of the addition), without a call to `roundf` (baseline
/// x86-64 has no rounding instruction).
const RNE_MAGIC: f32 = 12_582_912.0;

/// One value's mantissa: `rne(x · f1 · f2)` clamped to `±max` (`x` finite).
#[inline(always)]
pub(crate) fn quant_one(x: f32, f1: f32, f2: f32, max: f32) -> i8 {
    let y = (x * f1 * f2).min(max).max(-max);
    ((y + RNE_MAGIC) - RNE_MAGIC) as i8
}

pub(crate) fn exps(isa: Isa, x: &[f32], block: usize, m: u32, exps: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let full = x.len() / block;
        let done = match isa {
            #[cfg(feature = "avx512")]
            // SAFETY: `isa()` chose (or a test checked) AVX-512 F on this CPU.
            Isa::Avx512 => unsafe { super::x86::exps512(x, block, m, &mut exps[..full]) },
            // SAFETY: `isa()` chose (or a test checked) AVX2 on this CPU.
            Isa::Avx2 => unsafe { super::x86::exps256(x, block, m, &mut exps[..full]) },
            _ => 0,
        };
        return exps_scalar(&x[done * block..], block, m, &mut exps[done..]);
    }
    #[allow(unreachable_code)]
    {
        let _ = isa;
        exps_scalar(x, block, m, exps)
    }
}

pub(crate) fn exps_scalar(x: &[f32], block: usize, m: u32, exps: &mut [u8]) {
    for (x, e) in x.chunks(block).zip(exps) {
        let max = x.iter().fold(0, |a, v| a.max(v.to_bits() & 0x7FFF_FFFF));
        *e = exponent_of(max, m);
    }
}

/// Quantises; on a NaN or an infinity in a finite block, the index of the first such block.
pub(crate) fn quant(
    isa: Isa,
    x: &[f32],
    exps: &[u8],
    block: usize,
    m: u32,
    out: &mut [i8],
) -> Result<(), usize> {
    #[cfg(target_arch = "x86_64")]
    {
        let full = x.len() / block;
        let done = match isa {
            #[cfg(feature = "avx512")]
            // SAFETY: `isa()` chose (or a test checked) AVX-512 F on this CPU.
            Isa::Avx512 => unsafe { super::x86::quant512(x, &exps[..full], block, m, out) },
            // SAFETY: `isa()` chose (or a test checked) AVX2 on this CPU.
            Isa::Avx2 => unsafe { super::x86::quant256(x, &exps[..full], block, m, out) },
            _ => Some(0),
        };
        return match done {
            Some(d) => quant_scalar(&x[d * block..], &exps[d..], block, m, &mut out[d * block..])
                .map_err(|b| b + d),
            // A non-finite value somewhere: the scalar pass finds the block.
            None => quant_scalar(x, exps, block, m, out),
        };
    }
    #[allow(unreachable_code)]
    {
        let _ = isa;
        quant_scalar(x, exps, block, m, out)
    }
}

pub(crate) fn quant_scalar(
    x: &[f32],
    exps: &[u8],
    block: usize,
    m: u32,
    out: &mut [i8],
) -> Result<(), usize> {
    let max = ((1 << (m - 1)) - 1) as f32;
    for (i, ((x, &e), out)) in x
        .chunks(block)
        .zip(exps)
        .zip(out.chunks_mut(block))
        .enumerate()
    {
        if e == super::NON_FINITE {
            out.fill(0);
            continue;
        }
        if x.iter().any(|v| v.to_bits() & 0x7FFF_FFFF >= INF_BITS) {
            return Err(i);
        }
        let (f1, f2) = quant_factors(e, m);
        for (&x, o) in x.iter().zip(out) {
            *o = quant_one(x, f1, f2, max);
        }
    }
    Ok(())
}

pub(crate) fn dequant_i8(isa: Isa, s: &[i8], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let full = s.len() / block;
        let done = match isa {
            #[cfg(feature = "avx512")]
            // SAFETY: `isa()` chose (or a test checked) AVX-512 F on this CPU.
            Isa::Avx512 => unsafe { super::x86::dequant512_i8(s, &exps[..full], block, m, out) },
            // SAFETY: `isa()` chose (or a test checked) AVX2 on this CPU.
            Isa::Avx2 => unsafe { super::x86::dequant256_i8(s, &exps[..full], block, m, out) },
            _ => 0,
        };
        let d = done * block;
        return dequant_scalar(&s[d..], &exps[done..], block, m, &mut out[d..]);
    }
    #[allow(unreachable_code)]
    {
        let _ = isa;
        dequant_scalar(s, exps, block, m, out)
    }
}

pub(crate) fn dequant_i16(isa: Isa, s: &[i16], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let full = s.len() / block;
        let done = match isa {
            #[cfg(feature = "avx512")]
            // SAFETY: `isa()` chose (or a test checked) AVX-512 F on this CPU.
            Isa::Avx512 => unsafe { super::x86::dequant512_i16(s, &exps[..full], block, m, out) },
            // SAFETY: `isa()` chose (or a test checked) AVX2 on this CPU.
            Isa::Avx2 => unsafe { super::x86::dequant256_i16(s, &exps[..full], block, m, out) },
            _ => 0,
        };
        let d = done * block;
        return dequant_scalar(&s[d..], &exps[done..], block, m, &mut out[d..]);
    }
    #[allow(unreachable_code)]
    {
        let _ = isa;
        dequant_scalar(s, exps, block, m, out)
    }
}

/// `s · u(e)` in `f32`: exact for values of at most 24 significant bits (`i8`, `i16`).
pub(crate) fn dequant_scalar<S: Copy + Into<i32>>(
    s: &[S],
    exps: &[u8],
    block: usize,
    m: u32,
    out: &mut [f32],
) {
    for ((s, &e), out) in s.chunks(block).zip(exps).zip(out.chunks_mut(block)) {
        let u = unit(e, m);
        for (&s, o) in s.iter().zip(out) {
            *o = s.into() as f32 * u;
        }
    }
}

/// `i32` sums: computed exactly in `f64`, rounded once to `f32`.
pub(crate) fn dequant_wide(s: &[i32], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
    for ((s, &e), out) in s.chunks(block).zip(exps).zip(out.chunks_mut(block)) {
        let u = unit_f64(e, m);
        for (&s, o) in s.iter().zip(out) {
            *o = (s as f64 * u) as f32;
        }
    }
}
