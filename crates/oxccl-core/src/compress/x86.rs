//! AVX2 and AVX-512 versions of the kernels in `kernels`, bit for bit the same: the same IEEE
//! operations in the same order per value (the multiplications by the two power-of-two factors,
//! the clamp, the conversion to an integer in the default round-to-nearest-even mode). They
//! handle whole blocks only and return how many they did; the caller finishes the tail with the
//! scalar kernels. Loads and stores go through `bytemuck` casts of fixed-size arrays, so nothing
//! here is `unsafe` beyond the `#[target_feature]` calls (made in `kernels`).

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _mm_cvtsi128_si32, _mm_max_epu32, _mm_shuffle_epi32,
    _mm_unpackhi_epi64, _mm256_and_si256, _mm256_castsi256_si128, _mm256_cvtepi8_epi32,
    _mm256_cvtepi16_epi32, _mm256_cvtepi32_ps, _mm256_cvtps_epi32, _mm256_extracti128_si256,
    _mm256_max_epu32, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_packs_epi16,
    _mm256_packs_epi32, _mm256_permutevar8x32_epi32, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setr_epi32, _mm256_setzero_si256,
};

use bytemuck::cast;

use super::kernels::{INF_BITS, exponent_of, quant_factors, unit};

pub(super) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// AVX-512 F, when the `avx512` feature compiled its kernels in.
pub(super) fn has_avx512() -> bool {
    cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f")
}

/// `N` values from the start of `s` (which holds at least `N`).
#[inline(always)]
fn arr<T: Copy + Default, const N: usize>(s: &[T]) -> [T; N] {
    s.get(..N)
        .and_then(|s| s.try_into().ok())
        .unwrap_or([T::default(); N])
}

// ---------------------------------------------------------------------------------------------
// AVX2: 8 lanes.

/// The largest of 8 unsigned lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn hmax256(v: __m256i) -> u32 {
    let m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// Block exponents of the whole blocks of `x` (as many as `exps` holds).
#[target_feature(enable = "avx2")]
pub(super) fn exps256(x: &[f32], block: usize, m: u32, exps: &mut [u8]) -> usize {
    match block {
        16 => exps256_v::<2>(x, m, exps),
        32 => exps256_v::<4>(x, m, exps),
        _ => exps256_v::<8>(x, m, exps),
    }
}

#[target_feature(enable = "avx2")]
fn exps256_v<const V: usize>(x: &[f32], m: u32, exps: &mut [u8]) -> usize {
    let abs = _mm256_set1_epi32(0x7FFF_FFFF);
    for (x, e) in x.chunks_exact(8 * V).zip(exps.iter_mut()) {
        let mut acc = _mm256_setzero_si256();
        for v in x.chunks_exact(8) {
            let v: __m256i = cast(arr::<f32, 8>(v));
            acc = _mm256_max_epu32(acc, _mm256_and_si256(v, abs));
        }
        *e = exponent_of(hmax256(acc), m);
    }
    exps.len()
}

/// 32 bytes: the 8 lanes of `a`, then of `b`, `c`, `d` (each within `i8`).
#[target_feature(enable = "avx2")]
#[inline]
fn pack256(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    let ab = _mm256_packs_epi32(a, b); // a0-3 b0-3 | a4-7 b4-7
    let cd = _mm256_packs_epi32(c, d);
    let abcd = _mm256_packs_epi16(ab, cd); // dwords: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
    _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Quantises the whole blocks of `x` (as many as `exps` holds): `Some(blocks done)`, or `None`
/// if a block with a finite exponent holds a NaN or an infinity.
#[target_feature(enable = "avx2")]
pub(super) fn quant256(
    x: &[f32],
    exps: &[u8],
    block: usize,
    m: u32,
    out: &mut [i8],
) -> Option<usize> {
    match block {
        16 => quant256_v::<2>(x, exps, m, out),
        32 => quant256_v::<4>(x, exps, m, out),
        _ => quant256_v::<8>(x, exps, m, out),
    }
}

#[target_feature(enable = "avx2")]
fn quant256_v<const V: usize>(x: &[f32], exps: &[u8], m: u32, out: &mut [i8]) -> Option<usize> {
    let abs = _mm256_set1_epi32(0x7FFF_FFFF);
    let max = ((1 << (m - 1)) - 1) as f32;
    let (hi, lo) = (_mm256_set1_ps(max), _mm256_set1_ps(-max));
    let mut seen = _mm256_setzero_si256();
    let blocks = x.chunks_exact(8 * V).zip(out.chunks_exact_mut(8 * V));
    for ((x, out), &e) in blocks.zip(exps) {
        if e == super::NON_FINITE {
            out.fill(0);
            continue;
        }
        let (f1, f2) = quant_factors(e, m);
        let (f1, f2) = (_mm256_set1_ps(f1), _mm256_set1_ps(f2));
        let q = |v: &[f32]| {
            let v: __m256 = cast(arr::<f32, 8>(v));
            let y = _mm256_mul_ps(_mm256_mul_ps(v, f1), f2);
            (
                _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(y, hi), lo)),
                _mm256_and_si256(cast(v), abs),
            )
        };
        if V == 2 {
            let ((a, sa), (b, sb)) = (q(&x[..8]), q(&x[8..16]));
            seen = _mm256_max_epu32(seen, _mm256_max_epu32(sa, sb));
            let p: [i8; 32] = cast(pack256(a, b, a, b));
            out.copy_from_slice(&p[..16]);
        } else {
            for (x, out) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
                let ((a, sa), (b, sb)) = (q(&x[..8]), q(&x[8..16]));
                let ((c, sc), (d, sd)) = (q(&x[16..24]), q(&x[24..32]));
                let s = _mm256_max_epu32(_mm256_max_epu32(sa, sb), _mm256_max_epu32(sc, sd));
                seen = _mm256_max_epu32(seen, s);
                out.copy_from_slice(&cast::<__m256i, [i8; 32]>(pack256(a, b, c, d)));
            }
        }
    }
    (hmax256(seen) < INF_BITS).then_some(exps.len())
}

/// Decodes the whole blocks of `s` (as many as `exps` holds).
#[target_feature(enable = "avx2")]
pub(super) fn dequant256_i8(s: &[i8], exps: &[u8], block: usize, m: u32, out: &mut [f32]) -> usize {
    for ((s, &e), out) in s
        .chunks_exact(block)
        .zip(exps)
        .zip(out.chunks_exact_mut(block))
    {
        let u = _mm256_set1_ps(unit(e, m));
        for (s, out) in s.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            let v: __m128i = cast(arr::<i8, 16>(s));
            let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
            let b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
            let r: [[f32; 8]; 2] = [cast(_mm256_mul_ps(a, u)), cast(_mm256_mul_ps(b, u))];
            out.copy_from_slice(r.as_flattened());
        }
    }
    exps.len()
}

/// Decodes the whole blocks of `s` (as many as `exps` holds).
#[target_feature(enable = "avx2")]
pub(super) fn dequant256_i16(
    s: &[i16],
    exps: &[u8],
    block: usize,
    m: u32,
    out: &mut [f32],
) -> usize {
    for ((s, &e), out) in s
        .chunks_exact(block)
        .zip(exps)
        .zip(out.chunks_exact_mut(block))
    {
        let u = _mm256_set1_ps(unit(e, m));
        for (s, out) in s.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            let v: __m256i = cast(arr::<i16, 16>(s));
            let a = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
            let b = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(v)));
            let r: [[f32; 8]; 2] = [cast(_mm256_mul_ps(a, u)), cast(_mm256_mul_ps(b, u))];
            out.copy_from_slice(r.as_flattened());
        }
    }
    exps.len()
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes, one vector per 16 values. Behind the `avx512` feature: these intrinsics
// are stable from Rust 1.89, after the workspace's MSRV (1.88).

#[cfg(feature = "avx512")]
pub(super) use avx512::*;

#[cfg(feature = "avx512")]
#[allow(clippy::incompatible_msrv)] // the feature needs Rust 1.89 (see Cargo.toml)
mod avx512 {
    use std::arch::x86_64::{
        __m128i, __m256i, __m512, __m512i, _mm512_and_si512, _mm512_cvtepi8_epi32,
        _mm512_cvtepi16_epi32, _mm512_cvtepi32_epi8, _mm512_cvtepi32_ps, _mm512_cvtps_epi32,
        _mm512_max_epu32, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_reduce_max_epu32,
        _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_si512,
    };

    use bytemuck::cast;

    use super::arr;
    use crate::compress::kernels::{INF_BITS, exponent_of, quant_factors, unit};

    /// Block exponents of the whole blocks of `x` (as many as `exps` holds).
    #[target_feature(enable = "avx512f")]
    pub(in crate::compress) fn exps512(x: &[f32], block: usize, m: u32, exps: &mut [u8]) -> usize {
        let abs = _mm512_set1_epi32(0x7FFF_FFFF);
        for (x, e) in x.chunks_exact(block).zip(exps.iter_mut()) {
            let mut acc = _mm512_setzero_si512();
            for v in x.chunks_exact(16) {
                let v: __m512i = cast(arr::<f32, 16>(v));
                acc = _mm512_max_epu32(acc, _mm512_and_si512(v, abs));
            }
            *e = exponent_of(_mm512_reduce_max_epu32(acc), m);
        }
        exps.len()
    }

    /// Quantises the whole blocks of `x` (as many as `exps` holds): `Some(blocks done)`, or `None`
    /// if a block with a finite exponent holds a NaN or an infinity.
    #[target_feature(enable = "avx512f")]
    pub(in crate::compress) fn quant512(
        x: &[f32],
        exps: &[u8],
        block: usize,
        m: u32,
        out: &mut [i8],
    ) -> Option<usize> {
        let abs = _mm512_set1_epi32(0x7FFF_FFFF);
        let max = ((1 << (m - 1)) - 1) as f32;
        let (hi, lo) = (_mm512_set1_ps(max), _mm512_set1_ps(-max));
        let mut seen = _mm512_setzero_si512();
        let blocks = x.chunks_exact(block).zip(out.chunks_exact_mut(block));
        for ((x, out), &e) in blocks.zip(exps) {
            if e == crate::compress::NON_FINITE {
                out.fill(0);
                continue;
            }
            let (f1, f2) = quant_factors(e, m);
            let (f1, f2) = (_mm512_set1_ps(f1), _mm512_set1_ps(f2));
            for (x, out) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                let v: __m512 = cast(arr::<f32, 16>(x));
                seen = _mm512_max_epu32(seen, _mm512_and_si512(cast(v), abs));
                let y = _mm512_mul_ps(_mm512_mul_ps(v, f1), f2);
                let i = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(y, hi), lo));
                out.copy_from_slice(&cast::<__m128i, [i8; 16]>(_mm512_cvtepi32_epi8(i)));
            }
        }
        (_mm512_reduce_max_epu32(seen) < INF_BITS).then_some(exps.len())
    }

    /// Decodes the whole blocks of `s` (as many as `exps` holds).
    #[target_feature(enable = "avx512f")]
    pub(in crate::compress) fn dequant512_i8(
        s: &[i8],
        exps: &[u8],
        block: usize,
        m: u32,
        out: &mut [f32],
    ) -> usize {
        for ((s, &e), out) in s
            .chunks_exact(block)
            .zip(exps)
            .zip(out.chunks_exact_mut(block))
        {
            let u = _mm512_set1_ps(unit(e, m));
            for (s, out) in s.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                let v: __m128i = cast(arr::<i8, 16>(s));
                let r = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), u);
                out.copy_from_slice(&cast::<__m512, [f32; 16]>(r));
            }
        }
        exps.len()
    }

    /// Decodes the whole blocks of `s` (as many as `exps` holds).
    #[target_feature(enable = "avx512f")]
    pub(in crate::compress) fn dequant512_i16(
        s: &[i16],
        exps: &[u8],
        block: usize,
        m: u32,
        out: &mut [f32],
    ) -> usize {
        for ((s, &e), out) in s
            .chunks_exact(block)
            .zip(exps)
            .zip(out.chunks_exact_mut(block))
        {
            let u = _mm512_set1_ps(unit(e, m));
            for (s, out) in s.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                let v: __m256i = cast(arr::<i16, 16>(s));
                let r = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(v)), u);
                out.copy_from_slice(&cast::<__m512, [f32; 16]>(r));
            }
        }
        exps.len()
    }
}
