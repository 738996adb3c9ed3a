//! 8-bit floats: [`F8E4M3`] (torch's `float8_e4m3fn`) and [`F8E5M2`] (torch's `float8_e5m2`),
//! with conversions to and from `f32` and `f64` that give the same bits as torch's.
//!
//! | | e4m3 (`f8e4m3`) | e5m2 (`f8e5m2`) |
//! | --- | --- | --- |
//! | bits: sign, exponent, mantissa | 1, 4, 3 | 1, 5, 2 |
//! | exponent bias | 7 | 15 |
//! | largest finite | 448 | 57344 |
//! | smallest normal | 2^-6 | 2^-14 |
//! | smallest subnormal | 2^-9 | 2^-16 |
//! | unit roundoff u (half an ulp of 1, relative) | 2^-4 | 2^-3 |
//! | infinities | none | `S.11111.00` |
//! | NaN | `S.1111.111` only | `S.11111.xx`, xx ≠ 00 |
//!
//! Narrowing (`from_f32`, `from_f64`) rounds to nearest, ties to even, as torch does
//! (`tensor.to(torch.float8_e4m3fn)`, torch 2.15), including at the edges:
//! - e4m3 has no infinity and **saturates**: every finite value beyond 448 and ±∞ become ±448
//!   (torch 2.15 does this; older releases gave NaN); NaN becomes `S.1111.111`, keeping its
//!   sign;
//! - e5m2 follows IEEE 754: magnitudes of 61440 (halfway between 57344 and the next binade's
//!   first value) and above round to ±∞; ∞ stays ∞; NaN becomes `S.11111.11`, keeping its sign;
//! - magnitudes at or below half the smallest subnormal round to a zero of the value's sign.
//!
//! `from_f64` rounds the exact `f64` value once. (torch narrows an `f64` tensor through `f32`,
//! which can round twice: an `f64` just above a halfway point between two fp8 values that
//! rounds to the halfway point in `f32` then goes to the even neighbour. This module rounds the
//! `f64` to `f32` by rounding to odd first, which keeps the sticky information, so the second
//! rounding is the correct one.)
//!
//! Widening (`to_f32`, `to_f64`) is exact; a NaN widens to a quiet `f32` NaN with the fp8
//! mantissa in its top bits and the sign kept (torch's bits).
//!
//! The conversions are branch-free selects (no tables), so loops over slices vectorise.

use std::cmp::Ordering;
use std::fmt;

/// Parameters of an 8-bit float format.
trait Format {
    /// Mantissa (fraction) bits.
    const MANT: u32;
    /// Exponent bias.
    const BIAS: u32;
    /// No infinities: overflow saturates and only `S.1..1.1..1` is NaN (the `fn` formats).
    const FINITE: bool;
}

/// Marker of e4m3fn.
struct E4M3;
/// Marker of e5m2.
struct E5M2;

impl Format for E4M3 {
    const MANT: u32 = 3;
    const BIAS: u32 = 7;
    const FINITE: bool = true;
}

impl Format for E5M2 {
    const MANT: u32 = 2;
    const BIAS: u32 = 15;
    const FINITE: bool = false;
}

/// The largest magnitude code a finite non-NaN `f32` can give: the largest finite value
/// (saturation) or infinity.
const fn max_code<F: Format>() -> u32 {
    if F::FINITE {
        0x7e
    } else {
        // Exponent all ones, mantissa 0: infinity.
        0x7f & !((1 << F::MANT) - 1)
    }
}

/// `f32` to the format's bits, rounding to nearest, ties to even.
#[inline(always)]
fn narrow<F: Format>(v: f32) -> u8 {
    let x = v.to_bits();
    let sign = (x >> 24) & 0x80;
    let abs = x & 0x7fff_ffff;
    let shift = 23 - F::MANT;
    // Normal results: add just under half an ulp plus the kept lsb (ties go to even) and cut;
    // a carry into the exponent is the right answer, then rebias the exponent. Overflow
    // (including ∞) clamps to the largest finite value (e4m3fn) or to ∞ (e5m2).
    let rounded = (abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1)) >> shift;
    let normal = rounded
        .wrapping_sub((127 - F::BIAS) << F::MANT)
        .min(max_code::<F>());
    // Below the smallest normal: the ulp of `magic` is the subnormal step, so the f32 adder
    // rounds `abs + magic` to a multiple of the step (to nearest, ties to even) and the low
    // bits are the code; 2^MANT (rounded up to the smallest normal) is that value's code too.
    let magic = f32::from_bits((127 + 24 - F::BIAS - F::MANT) << 23);
    let sub = (f32::from_bits(abs) + magic)
        .to_bits()
        .wrapping_sub(magic.to_bits());
    let min_normal = (127 + 1 - F::BIAS) << 23;
    let code = if abs > 0x7f80_0000 {
        0x7f
    } else if abs < min_normal {
        sub
    } else {
        normal
    };
    (code | sign) as u8
}

/// The format's bits to `f32`, exactly.
#[inline(always)]
fn widen<F: Format>(b: u8) -> f32 {
    let b = b as u32;
    let sign = (b & 0x80) << 24;
    let mag = b & 0x7f;
    let m = b & ((1 << F::MANT) - 1);
    let e = mag >> F::MANT;
    let normal = (mag << (23 - F::MANT)) + ((127 - F::BIAS) << 23);
    // The subnormal step is 2^(1 - BIAS - MANT); m times it is exact in f32.
    let step = f32::from_bits((128 - F::BIAS - F::MANT) << 23);
    let sub = (m as f32 * step).to_bits();
    let special = if F::FINITE {
        mag == 0x7f
    } else {
        e == 0x7f >> F::MANT
    };
    let quiet = if m != 0 { 0x40_0000 } else { 0 };
    let special_bits = 0x7f80_0000 | (m << (23 - F::MANT)) | quiet;
    let bits = if special {
        special_bits
    } else if e == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// `v` rounded to `f32` toward zero, with the last bit set when inexact (round to odd): a
/// later rounding to a format with at least two fewer significand bits is then the same as
/// rounding `v` directly.
#[inline]
fn f64_to_f32_odd(v: f64) -> f32 {
    let t = v as f32;
    if v.is_nan() || !t.is_finite() || f64::from(t) == v {
        return t;
    }
    let mut bits = t.to_bits();
    if f64::from(t).abs() > v.abs() {
        // Rounded away from zero: step back toward zero (t is not zero here).
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

macro_rules! fp8_type {
    ($(#[$doc:meta])* $name:ident, $fmt:ty, $max:expr, $min_pos:expr, $eps:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default)]
        #[repr(transparent)]
        pub struct $name(u8);

        // SAFETY: a `repr(transparent)` wrapper of `u8`: the zero byte is a valid value
        // (+0.0).
        unsafe impl bytemuck::Zeroable for $name {}
        // SAFETY: `repr(transparent)` over `u8`: no padding, every bit pattern is a valid
        // value, `Copy` and `'static`.
        unsafe impl bytemuck::Pod for $name {}

        impl $name {
            /// +0.
            pub const ZERO: $name = $name(0);
            /// -0.
            pub const NEG_ZERO: $name = $name(0x80);
            /// 1.
            pub const ONE: $name = $name(((<$fmt>::BIAS) << <$fmt>::MANT) as u8);
            /// The largest finite value.
            pub const MAX: $name = $name($max);
            /// The most negative finite value.
            pub const MIN: $name = $name($max | 0x80);
            /// The smallest positive normal value.
            pub const MIN_POSITIVE: $name = $name($min_pos);
            /// The smallest positive (subnormal) value.
            pub const MIN_POSITIVE_SUBNORMAL: $name = $name(1);
            /// The difference between 1 and the next larger value.
            pub const EPSILON: $name = $name($eps);
            /// A quiet NaN (`0.1...1`, what narrowing a NaN gives).
            pub const NAN: $name = $name(0x7f);
            /// Bits in the significand, the implicit one included.
            pub const MANTISSA_DIGITS: u32 = <$fmt>::MANT + 1;
            /// The unit roundoff of rounding to nearest, 2^-MANTISSA_DIGITS: a rounded
            /// normal value is within this relative distance of the exact one.
            pub const UNIT_ROUNDOFF: f64 = 1.0 / (1u32 << (<$fmt>::MANT + 1)) as f64;

            /// The value with these bits.
            #[inline]
            pub const fn from_bits(bits: u8) -> $name {
                $name(bits)
            }

            /// This value's bits.
            #[inline]
            pub const fn to_bits(self) -> u8 {
                self.0
            }

            /// `v` rounded to nearest, ties to even, as torch rounds (see the
            /// [module docs](self) for overflow and NaN).
            #[inline]
            pub fn from_f32(v: f32) -> $name {
                $name(narrow::<$fmt>(v))
            }

            /// `v` rounded once to nearest, ties to even (see the [module docs](self)).
            #[inline]
            pub fn from_f64(v: f64) -> $name {
                $name::from_f32(f64_to_f32_odd(v))
            }

            /// The value as `f32` (exact).
            #[inline]
            pub fn to_f32(self) -> f32 {
                widen::<$fmt>(self.0)
            }

            /// The value as `f64` (exact).
            #[inline]
            pub fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }

            /// Whether this is a NaN.
            #[inline]
            pub fn is_nan(self) -> bool {
                self.to_f32().is_nan()
            }

            /// Whether this is neither infinite nor NaN.
            #[inline]
            pub fn is_finite(self) -> bool {
                self.to_f32().is_finite()
            }
        }

        /// IEEE 754 equality: NaN equals nothing, -0 equals +0.
        impl PartialEq for $name {
            fn eq(&self, other: &$name) -> bool {
                self.to_f32() == other.to_f32()
            }
        }

        /// IEEE 754 order (NaN is unordered).
        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &$name) -> Option<Ordering> {
                self.to_f32().partial_cmp(&other.to_f32())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.to_f32(), f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.to_f32(), f)
            }
        }

        impl From<$name> for f32 {
            fn from(v: $name) -> f32 {
                v.to_f32()
            }
        }

        impl From<$name> for f64 {
            fn from(v: $name) -> f64 {
                v.to_f64()
            }
        }
    };
}

fp8_type!(
    /// An 8-bit float with 4 exponent and 3 mantissa bits, bias 7, subnormals, no infinities
    /// and one NaN per sign (`S.1111.111`): torch's `float8_e4m3fn`, OCP's E4M3, NCCL's
    /// `ncclFloat8e4m3` (nccl-tests `f8e4m3`). Largest finite 448; overflow saturates.
    F8E4M3,
    E4M3,
    0x7e,
    0x08,
    0x20
);

fp8_type!(
    /// An 8-bit float with 5 exponent and 2 mantissa bits, bias 15, subnormals, infinities and
    /// NaNs as in IEEE 754: torch's `float8_e5m2`, OCP's E5M2, NCCL's `ncclFloat8e5m2`
    /// (nccl-tests `f8e5m2`). Largest finite 57344.
    F8E5M2,
    E5M2,
    0x7b,
    0x04,
    0x34
);

impl F8E5M2 {
    /// +∞.
    pub const INFINITY: F8E5M2 = F8E5M2(0x7c);
    /// -∞.
    pub const NEG_INFINITY: F8E5M2 = F8E5M2(0xfc);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (splitmix64).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// An independent reference, written from the formats' definitions in `f64`: decoding by
    /// the textbook formula, encoding by searching every code for the nearest value.
    struct Spec {
        exp_bits: i32,
        mant_bits: i32,
        finite: bool,
    }

    const SPEC_E4M3: Spec = Spec {
        exp_bits: 4,
        mant_bits: 3,
        finite: true,
    };
    const SPEC_E5M2: Spec = Spec {
        exp_bits: 5,
        mant_bits: 2,
        finite: false,
    };

    impl Spec {
        fn bias(&self) -> i32 {
            (1 << (self.exp_bits - 1)) - 1
        }

        /// The value of a code, `None` for NaN.
        fn decode(&self, code: u8) -> Option<f64> {
            let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
            let e = ((code & 0x7f) >> self.mant_bits) as i32;
            let m = (code as i32) & ((1 << self.mant_bits) - 1);
            let emax = (1 << self.exp_bits) - 1;
            let frac = m as f64 / (1 << self.mant_bits) as f64;
            if self.finite && e == emax && m == (1 << self.mant_bits) - 1 {
                return None;
            }
            if !self.finite && e == emax {
                return if m == 0 {
                    Some(s * f64::INFINITY)
                } else {
                    None
                };
            }
            Some(if e == 0 {
                s * 2f64.powi(1 - self.bias()) * frac
            } else {
                s * 2f64.powi(e - self.bias()) * (1.0 + frac)
            })
        }

        fn max_finite(&self) -> f64 {
            (0..=0x7fu8)
                .filter_map(|c| self.decode(c))
                .filter(|v| v.is_finite())
                .fold(0.0, f64::max)
        }

        /// The code nearest `v`, ties to the even code; torch's overflow rules.
        fn encode(&self, v: f64) -> u8 {
            let sign = if v.is_sign_negative() { 0x80 } else { 0 };
            if v.is_nan() {
                return sign | 0x7f;
            }
            let a = v.abs();
            let max = self.max_finite();
            // The distance from max to the next value the exponent range would have.
            let ulp_max = 2f64.powi(
                (1 << self.exp_bits) - 2 - self.bias() - self.mant_bits
                    + if self.finite { 1 } else { 0 },
            );
            if self.finite && a > max {
                return sign | 0x7e;
            }
            if !self.finite && a >= max + ulp_max / 2.0 {
                return sign | 0x7c;
            }
            let mut best = 0u8;
            let mut best_d = f64::INFINITY;
            for c in 0..=0x7fu8 {
                let Some(x) = self.decode(c) else { continue };
                if !x.is_finite() {
                    continue;
                }
                let d = (x - a).abs();
                if d < best_d || (d == best_d && c % 2 == 0) {
                    best = c;
                    best_d = d;
                }
            }
            sign | best
        }
    }

    fn check_decode(spec: &Spec, to_f32: fn(u8) -> f32) {
        for c in 0..=255u8 {
            let got = to_f32(c);
            match spec.decode(c) {
                None => assert!(got.is_nan(), "{c:#04x}: {got}"),
                Some(want) => {
                    assert_eq!(f64::from(got), want, "{c:#04x}");
                    assert_eq!(got.is_sign_negative(), c & 0x80 != 0, "{c:#04x} sign");
                }
            }
        }
    }

    /// Every code; the midpoints between neighbours and the f32 values around them; powers of
    /// two and their neighbours over the whole f32 range; specials; random bits.
    fn test_values(spec: &Spec) -> Vec<f32> {
        let mut v = Vec::new();
        let mut finite: Vec<f64> = (0..=0x7fu8)
            .filter_map(|c| spec.decode(c))
            .filter(|x| x.is_finite())
            .collect();
        finite.sort_by(f64::total_cmp);
        let top = *finite.last().unwrap();
        // Values past the top: the midpoint to the next (missing) value and beyond.
        let step = top - finite[finite.len() - 2];
        finite.extend([top + step, top + 2.0 * step, top + 4.0 * step]);
        for w in finite.windows(2) {
            for x in [w[0], (w[0] + w[1]) / 2.0] {
                let f = x as f32;
                assert_eq!(f64::from(f), x, "midpoints are f32 values");
                let b = f.to_bits();
                for d in -3i64..=3 {
                    let bits = (b as i64 + d).clamp(0, 0x7f80_0000) as u32;
                    v.push(f32::from_bits(bits));
                }
            }
        }
        for e in 0..255u32 {
            for m in [
                0u32, 1, 0x40_0000, 0x7f_ffff, 0x10_0000, 0x0f_ffff, 0x10_0001,
            ] {
                v.push(f32::from_bits((e << 23) | m));
            }
        }
        v.extend([
            0.0,
            f32::INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x7fff_ffff),
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
        ]);
        let mut rng = Rng(0xf8);
        v.extend((0..200_000).map(|_| f32::from_bits(rng.next() as u32)));
        // Both signs of everything.
        let neg: Vec<f32> = v.iter().map(|x| -x).collect();
        v.extend(neg);
        v
    }

    fn check_encode(spec: &Spec, from_f32: fn(f32) -> u8) {
        for x in test_values(spec) {
            let got = from_f32(x);
            let want = spec.encode(f64::from(x));
            assert_eq!(
                got,
                want,
                "{x:e} ({:#010x}): got {got:#04x} ({:?}), want {want:#04x} ({:?})",
                x.to_bits(),
                spec.decode(got),
                spec.decode(want)
            );
        }
    }

    #[test]
    fn e4m3_decodes_every_code() {
        check_decode(&SPEC_E4M3, |c| F8E4M3::from_bits(c).to_f32());
    }

    #[test]
    fn e5m2_decodes_every_code() {
        check_decode(&SPEC_E5M2, |c| F8E5M2::from_bits(c).to_f32());
    }

    #[test]
    fn e4m3_encodes_like_the_reference() {
        check_encode(&SPEC_E4M3, |x| F8E4M3::from_f32(x).to_bits());
    }

    #[test]
    fn e5m2_encodes_like_the_reference() {
        check_encode(&SPEC_E5M2, |x| F8E5M2::from_f32(x).to_bits());
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0..=255u8 {
            let a = F8E4M3::from_bits(c);
            let want = if a.is_nan() { c | 0x7f } else { c };
            assert_eq!(F8E4M3::from_f32(a.to_f32()).to_bits(), want, "{c:#04x}");
            assert_eq!(F8E4M3::from_f64(a.to_f64()).to_bits(), want, "{c:#04x}");
            let b = F8E5M2::from_bits(c);
            let want = if b.is_nan() { c | 0x7f } else { c };
            assert_eq!(F8E5M2::from_f32(b.to_f32()).to_bits(), want, "{c:#04x}");
            assert_eq!(F8E5M2::from_f64(b.to_f64()).to_bits(), want, "{c:#04x}");
        }
    }

    /// torch's bits for a few values (from `torch.tensor(v).to(dtype).view(torch.uint8)`,
    /// torch 2.15), including the overflow edges and NaN widening.
    #[test]
    fn torch_edges() {
        let e4 = |v: f32| F8E4M3::from_f32(v).to_bits();
        let e5 = |v: f32| F8E5M2::from_f32(v).to_bits();
        for (v, a, b) in [
            (448.0, 0x7e, 0x5f),
            (464.0, 0x7e, 0x5f),
            (480.0, 0x7e, 0x60),
            (1e4, 0x7e, 0x71),
            (f32::INFINITY, 0x7e, 0x7c),
            (f32::NEG_INFINITY, 0xfe, 0xfc),
            (f32::NAN, 0x7f, 0x7f),
            (-f32::NAN, 0xff, 0xff),
            (57344.0, 0x7e, 0x7b),
            (61439.0, 0x7e, 0x7b),
            (61440.0, 0x7e, 0x7c),
            (-0.0, 0x80, 0x80),
            (2f32.powi(-10), 0x00, 0x14),
            (2f32.powi(-10) * 1.000_001, 0x01, 0x14),
            (2f32.powi(-17), 0x00, 0x00),
            (2f32.powi(-17) * 1.000_001, 0x00, 0x01),
        ] {
            assert_eq!((e4(v), e5(v)), (a, b), "{v:e}");
        }
        assert_eq!(F8E4M3::from_bits(0x7f).to_f32().to_bits(), 0x7ff0_0000);
        assert_eq!(F8E4M3::from_bits(0xff).to_f32().to_bits(), 0xfff0_0000);
        assert_eq!(F8E5M2::from_bits(0x7d).to_f32().to_bits(), 0x7fe0_0000);
        assert_eq!(F8E5M2::from_bits(0x7e).to_f32().to_bits(), 0x7fc0_0000);
        assert_eq!(F8E5M2::from_bits(0xfe).to_f32().to_bits(), 0xffc0_0000);
    }

    /// `from_f64` rounds once, where going through `f32` with round to nearest would round
    /// twice; checked against the reference on values just off every midpoint.
    #[test]
    fn from_f64_rounds_once() {
        for (spec, from) in [
            (
                &SPEC_E4M3,
                (|v| F8E4M3::from_f64(v).to_bits()) as fn(f64) -> u8,
            ),
            (&SPEC_E5M2, |v| F8E5M2::from_f64(v).to_bits()),
        ] {
            let mut finite: Vec<f64> = (0..=0x7fu8)
                .filter_map(|c| spec.decode(c))
                .filter(|x| x.is_finite())
                .collect();
            finite.sort_by(f64::total_cmp);
            for w in finite.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for x in [
                    mid,
                    mid * (1.0 + 1e-12),
                    mid * (1.0 - 1e-12),
                    f64::from_bits(mid.to_bits() + 1),
                    f64::from_bits(mid.to_bits() - 1),
                    w[0],
                    w[1],
                ] {
                    for x in [x, -x] {
                        assert_eq!(from(x), spec.encode(x), "{x:e}");
                    }
                }
            }
            for x in [
                f64::INFINITY,
                f64::NAN,
                1e300,
                -1e300,
                1e-300,
                -1e-300,
                f64::MIN_POSITIVE,
                0.0,
                -0.0,
            ] {
                assert_eq!(from(x), spec.encode(x), "{x:e}");
            }
            // The double-rounding trap itself: just above 1 + half an ulp.
            let ulp = 2f64.powi(-spec.mant_bits);
            let x = 1.0 + ulp / 2.0 + 1e-12;
            assert_eq!(spec.decode(from(x)), Some(1.0 + ulp), "{x}");
        }
        let mut rng = Rng(64);
        for _ in 0..200_000 {
            let x = f64::from_bits(rng.next());
            assert_eq!(F8E4M3::from_f64(x).to_bits(), SPEC_E4M3.encode(x), "{x:e}");
            assert_eq!(F8E5M2::from_f64(x).to_bits(), SPEC_E5M2.encode(x), "{x:e}");
            let y = (rng.next() as i64 as f64) * 2f64.powi(-70);
            assert_eq!(F8E4M3::from_f64(y).to_bits(), SPEC_E4M3.encode(y), "{y:e}");
            assert_eq!(F8E5M2::from_f64(y).to_bits(), SPEC_E5M2.encode(y), "{y:e}");
        }
    }

    #[test]
    fn constants() {
        assert_eq!(F8E4M3::ONE.to_f32(), 1.0);
        assert_eq!(F8E5M2::ONE.to_f32(), 1.0);
        assert_eq!(F8E4M3::MAX.to_f32(), 448.0);
        assert_eq!(F8E4M3::MIN.to_f32(), -448.0);
        assert_eq!(F8E5M2::MAX.to_f32(), 57344.0);
        assert_eq!(F8E4M3::MIN_POSITIVE.to_f32(), 2f32.powi(-6));
        assert_eq!(F8E5M2::MIN_POSITIVE.to_f32(), 2f32.powi(-14));
        assert_eq!(F8E4M3::MIN_POSITIVE_SUBNORMAL.to_f32(), 2f32.powi(-9));
        assert_eq!(F8E5M2::MIN_POSITIVE_SUBNORMAL.to_f32(), 2f32.powi(-16));
        assert_eq!(F8E4M3::EPSILON.to_f32(), 0.125);
        assert_eq!(F8E5M2::EPSILON.to_f32(), 0.25);
        assert_eq!(F8E4M3::UNIT_ROUNDOFF, 1.0 / 16.0);
        assert_eq!(F8E5M2::UNIT_ROUNDOFF, 1.0 / 8.0);
        assert!(F8E4M3::NAN.is_nan() && F8E5M2::NAN.is_nan());
        assert_eq!(F8E5M2::INFINITY.to_f32(), f32::INFINITY);
        assert_eq!(F8E5M2::NEG_INFINITY.to_f32(), f32::NEG_INFINITY);
        assert!(!F8E5M2::INFINITY.is_finite() && F8E4M3::MAX.is_finite());
        assert_eq!(F8E4M3::ZERO, F8E4M3::NEG_ZERO);
        assert_ne!(F8E4M3::NAN, F8E4M3::NAN);
        assert!(F8E5M2::ONE < F8E5M2::MAX);
        assert_eq!(format!("{:?} {}", F8E4M3::ONE, F8E5M2::MAX), "1.0 57344");
    }
}
