//! The codec against a slow `f64` reference written from the definitions (a search for the
//! smallest exponent, rounding by `floor` and a comparison with one half), every kernel set
//! against it (so the vector kernels equal the scalar ones bit for bit), the error bounds, the
//! exact sums, and the API's checks.

use half::{bf16, f16};
use proptest::prelude::*;

use super::kernels::{self, Isa};
use super::*;

// ---- the reference ---------------------------------------------------------------------------

fn ref_unit(e: u8, m: u32) -> f64 {
    2f64.powi(e as i32 - 124 - m as i32)
}

/// Round half to even, from `floor`.
fn ref_round(v: f64) -> f64 {
    let f = v.floor();
    let d = v - f; // exact: `v` has at most 24 significant bits
    if d > 0.5 || (d == 0.5 && f.rem_euclid(2.0) == 1.0) {
        f + 1.0
    } else {
        f
    }
}

/// The smallest exponent at which every value of the block fits, by search.
fn ref_exponent(block: &[f32], m: u32) -> u8 {
    if block.iter().any(|x| !x.is_finite()) {
        return NON_FINITE;
    }
    let max = (1u32 << (m - 1)) as f64 - 1.0;
    (0..=254u8)
        .find(|&e| {
            block
                .iter()
                .all(|&x| ref_round((x as f64).abs() / ref_unit(e, m)) <= max)
        })
        .expect("every finite f32 fits at 254")
}

fn ref_quant(x: f32, e: u8, m: u32) -> i8 {
    if e == NON_FINITE {
        return 0;
    }
    let max = (1u32 << (m - 1)) as f64 - 1.0;
    ref_round(x as f64 / ref_unit(e, m)).clamp(-max, max) as i8
}

fn ref_dequant(s: i64, e: u8, m: u32) -> f64 {
    if e == NON_FINITE {
        f64::NAN
    } else {
        s as f64 * ref_unit(e, m)
    }
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

// ---- inputs ----------------------------------------------------------------------------------

const FORMATS: [Format; 6] = [
    Format {
        width: Width::Bfp8,
        block: BlockSize::B16,
    },
    Format {
        width: Width::Bfp8,
        block: BlockSize::B32,
    },
    Format {
        width: Width::Bfp8,
        block: BlockSize::B64,
    },
    Format {
        width: Width::Bfp4,
        block: BlockSize::B16,
    },
    Format {
        width: Width::Bfp4,
        block: BlockSize::B32,
    },
    Format {
        width: Width::Bfp4,
        block: BlockSize::B64,
    },
];

fn format() -> impl Strategy<Value = Format> {
    (0..FORMATS.len()).prop_map(|i| FORMATS[i])
}

/// A finite `f32` of the kinds that matter: zeros, subnormals, random bits over the whole range,
/// values near a power of two (the exponent's rounding bump), exact halves of small units (RNE
/// ties), and values of a block's typical magnitude.
fn value() -> impl Strategy<Value = f32> {
    let finite = any::<u32>().prop_map(|b| {
        let x = f32::from_bits(b);
        if x.is_finite() {
            x
        } else {
            f32::from_bits(b & 0xBF7F_FFFF)
        }
    });
    prop_oneof![
        2 => Just(0.0f32),
        1 => Just(-0.0f32),
        2 => (1u32..0x80_0000, any::<bool>())
            .prop_map(|(b, s)| f32::from_bits(b | (s as u32) << 31)),
        3 => finite,
        // Just below / at powers of two: (2 - k·2^-23)·2^p.
        3 => (-130i32..128, 0u32..600, any::<bool>()).prop_map(|(p, k, s)| {
            let v = (2.0f64 - k as f64 * 2f64.powi(-23)) * 2f64.powi(p);
            let v = (if s { -v } else { v }) as f32;
            if v.is_finite() { v } else { f32::MAX }
        }),
        // (j + 1/2)·2^p: ties at many scales.
        4 => (-140i32..120, -260i32..260)
            .prop_map(|(p, j)| ((j as f64 + 0.5) * 2f64.powi(p)) as f32),
        6 => -1.0e3f32..1.0e3,
    ]
}

/// Blocks of mixed magnitudes: a run of values scaled by a random power of two per block.
fn buffer(max: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((value(), -20i32..20, 0u8..4), 0..max).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (x, p, k))| {
                // Every fourth run of 16 shares one scale: typical gradient blocks.
                if k == 0 && (i / 16) % 4 == 0 {
                    let y = x * 2f32.powi(p);
                    if y.is_finite() { y } else { x }
                } else {
                    x
                }
            })
            .collect()
    })
}

// ---- every kernel set against the reference --------------------------------------------------

fn check_kernels(x: &[f32], fmt: Format) -> Result<(), TestCaseError> {
    let (b, m) = (fmt.block.values(), fmt.width.bits());
    let nb = block_count(x.len(), fmt.block);
    let want_e: Vec<u8> = x.chunks(b).map(|c| ref_exponent(c, m)).collect();
    let want_q: Vec<i8> = x
        .chunks(b)
        .zip(&want_e)
        .flat_map(|(c, &e)| c.iter().map(move |&v| ref_quant(v, e, m)))
        .collect();
    for isa in Isa::available() {
        let mut e = vec![0u8; nb];
        kernels::exps(isa, x, b, m, &mut e);
        prop_assert_eq!(&e, &want_e, "{:?} exponents, {:?}", isa, fmt);
        let mut q = vec![0i8; x.len()];
        prop_assert_eq!(kernels::quant(isa, x, &e, b, m, &mut q), Ok(()));
        prop_assert_eq!(&q, &want_q, "{:?} mantissas, {:?}", isa, fmt);
        let mut d = vec![0f32; x.len()];
        kernels::dequant_i8(isa, &q, &e, b, m, &mut d);
        let q16: Vec<i16> = q.iter().map(|&v| v as i16 * 3).collect();
        let mut d16 = vec![0f32; x.len()];
        kernels::dequant_i16(isa, &q16, &e, b, m, &mut d16);
        for (i, (&xi, (&di, &d16i))) in x.iter().zip(d.iter().zip(&d16)).enumerate() {
            let (e, qi) = (e[i / b], q[i] as i64);
            prop_assert!(
                same(di, ref_dequant(qi, e, m) as f32),
                "{:?} decode {}",
                isa,
                i
            );
            prop_assert!(same(d16i, ref_dequant(3 * qi, e, m) as f32));
            // One quantisation: half a unit, and 2a/(2^M - 1) of the block maximum.
            let u = ref_unit(e, m);
            // (Against the exact decoded value: within 2^-M of f32::MAX it overflows f32.)
            let err = (xi as f64 - ref_dequant(qi, e, m)).abs();
            prop_assert!(err <= u / 2.0, "error {} > u/2 = {}", err, u / 2.0);
            if e >= 1 {
                let a = x[i / b * b..]
                    .iter()
                    .take(b)
                    .fold(0f64, |a, v| a.max(v.abs() as f64));
                prop_assert!(err <= 2.0 * a / ((1u32 << m) as f64 - 1.0));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn kernels_match_the_reference(x in buffer(300), fmt in format()) {
        check_kernels(&x, fmt)?;
    }

    #[test]
    fn larger_agreed_exponents_and_saturation(
        x in buffer(200), fmt in format(), shift in -3i32..4,
    ) {
        let (b, m) = (fmt.block.values(), fmt.width.bits());
        let mut e = vec![0u8; block_count(x.len(), fmt.block)];
        block_exponents(&x, fmt, &mut e).unwrap();
        // Shifted exponents: larger ones fit, smaller ones saturate; all against the reference.
        for e in &mut e {
            *e = (*e as i32 + shift).clamp(0, 254) as u8;
        }
        for isa in Isa::available() {
            let mut q = vec![0i8; x.len()];
            prop_assert_eq!(kernels::quant(isa, &x, &e, b, m, &mut q), Ok(()));
            for (i, (&xi, &qi)) in x.iter().zip(&q).enumerate() {
                prop_assert_eq!(qi, ref_quant(xi, e[i / b], m), "{:?} at {}", isa, i);
            }
        }
    }

    #[test]
    fn exact_sums_at_common_exponents(
        ranks in prop::collection::vec(buffer(150), 1..9), fmt in format(),
    ) {
        let n = ranks.iter().map(Vec::len).min().unwrap_or(0);
        let nb = block_count(n, fmt.block);
        // The max all-reduce of the exponents.
        let mut common = vec![0u8; nb];
        for x in &ranks {
            let mut e = vec![0u8; nb];
            block_exponents(&x[..n], fmt, &mut e).unwrap();
            max_exponents(&mut common, &e).unwrap();
        }
        let mut sum16 = vec![0i16; n];
        let mut exact = vec![0f64; n];
        let mut err = vec![0f64; n];
        for x in &ranks {
            let mut q = vec![0i8; n];
            quantize(&x[..n], &common, fmt, &mut q).unwrap();
            let (b, m) = (fmt.block.values(), fmt.width.bits());
            for i in 0..n {
                sum16[i] += q[i] as i16;
                exact[i] += ref_dequant(q[i] as i64, common[i / b], m); // exact in f64
                err[i] += x[i] as f64;
            }
        }
        let mut out16 = vec![0f32; n];
        dequantize(&sum16, &common, fmt, &mut out16).unwrap();
        let sum32: Vec<i32> = sum16.iter().map(|&s| s as i32).collect();
        let mut out32 = vec![0f32; n];
        dequantize(&sum32, &common, fmt, &mut out32).unwrap();
        let b = fmt.block.values();
        for i in 0..n {
            prop_assert!(same(out16[i], exact[i] as f32), "decode(sum) != sum of decodes at {}", i);
            prop_assert!(same(out16[i], out32[i]));
            let u = ref_unit(common[i / b], fmt.width.bits());
            let bound = ranks.len() as f64 * u / 2.0;
            prop_assert!((exact[i] - err[i]).abs() <= bound, "at {}", i);
        }
    }

    #[test]
    fn halves_match_their_widening(x in buffer(300), fmt in format()) {
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let bh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        check_half(&h, fmt)?;
        check_half(&bh, fmt)?;
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn encode_decode_round_trip(x in buffer(5000), fmt in format()) {
        let mut wire = vec![0u8; encoded_len(x.len(), fmt)];
        prop_assert_eq!(encode(&x, fmt, &mut wire), Ok(wire.len()));
        let hdr = header(&wire).unwrap();
        prop_assert_eq!(hdr, Header { format: fmt, len: x.len() });
        let mut back = vec![0f32; x.len()];
        decode(&wire, &mut back).unwrap();
        let nb = block_count(x.len(), fmt.block);
        let mut e = vec![0u8; nb];
        block_exponents(&x, fmt, &mut e).unwrap();
        prop_assert_eq!(&wire[HEADER_LEN..HEADER_LEN + nb], &e[..]);
        let mut q = vec![0i8; x.len()];
        quantize(&x, &e, fmt, &mut q).unwrap();
        let mut d = vec![0f32; x.len()];
        dequantize(&q, &e, fmt, &mut d).unwrap();
        prop_assert!(back.iter().zip(&d).all(|(a, b)| same(*a, *b)));
    }

    #[test]
    fn pack4_round_trips(v in prop::collection::vec(-8i8..=7, 0..100)) {
        let mut p = vec![0u8; v.len().div_ceil(2)];
        pack4(&v, &mut p).unwrap();
        let mut back = vec![0i8; v.len()];
        unpack4(&p, &mut back).unwrap();
        prop_assert_eq!(back, v);
    }
}

fn check_half<T: Float>(h: &[T], fmt: Format) -> Result<(), TestCaseError> {
    let w: Vec<f32> = h.iter().map(|v| v.to_f64() as f32).collect();
    let nb = block_count(h.len(), fmt.block);
    let (mut eh, mut ew) = (vec![0u8; nb], vec![0u8; nb]);
    block_exponents(h, fmt, &mut eh).unwrap();
    block_exponents(&w, fmt, &mut ew).unwrap();
    prop_assert_eq!(&eh, &ew);
    let (mut qh, mut qw) = (vec![0i8; h.len()], vec![0i8; h.len()]);
    quantize(h, &eh, fmt, &mut qh).unwrap();
    quantize(&w, &ew, fmt, &mut qw).unwrap();
    prop_assert_eq!(&qh, &qw);
    let mut dh = vec![h.first().copied().unwrap_or(T::from_f64(0.0)); h.len()];
    let mut dw = vec![0f32; h.len()];
    dequantize(&qh, &eh, fmt, &mut dh).unwrap();
    dequantize(&qw, &ew, fmt, &mut dw).unwrap();
    for (a, &b) in dh.iter().zip(&dw) {
        let want = T::from_f64(b as f64); // f32 exact, so one rounding either way
        prop_assert!(a.to_f64().to_bits() == want.to_f64().to_bits());
    }
    Ok(())
}

// ---- edges, by hand --------------------------------------------------------------------------

#[test]
fn exponent_rule_at_the_bump() {
    // 127.5 units of 2^(E-132) round (to even) to 128: too big at E, so the block takes E + 1.
    let e = 150u8;
    let u = ref_unit(e, 8) as f32;
    let at = |k: f32| {
        let mut out = [0u8];
        block_exponents(&[k * u], Format::BFP8, &mut out).unwrap();
        out[0]
    };
    assert_eq!(at(127.0), e);
    assert_eq!(at(127.49998), e);
    assert_eq!(at(127.5), e + 1);
    assert_eq!(at(64.0), e);
    assert_eq!(at(63.9), e); // 127.8 units at E - 1 round to 128
    assert_eq!(at(63.74), e - 1); // 127.48 units at E - 1 round to 127
    assert_eq!(at(63.75), e); // a tie at 127.5 goes to 128
    // bfp4: 7.5 units round to 8 and do not fit.
    let u4 = ref_unit(e, 4) as f32;
    let mut out = [0u8];
    let fmt = Format {
        block: BlockSize::B16,
        ..Format::BFP4
    };
    block_exponents(&[7.0 * u4, 0.0, 7.5 * u4], fmt, &mut out).unwrap();
    assert_eq!(out[0], e + 1);
    // The largest finite f32 rounds to 64 units of 2^122 = 2^128 at E = 254: decoded to f32 it
    // overflows to infinity, as rounding it to any narrower IEEE format does.
    let mut out = [0u8];
    block_exponents(&[f32::MAX], Format::BFP8, &mut out).unwrap();
    assert_eq!(out[0], 254);
    let mut q = [0i8];
    quantize(&[f32::MAX], &out, Format::BFP8, &mut q).unwrap();
    assert_eq!(q[0], 64);
    let mut d = [0f32];
    dequantize(&q, &out, Format::BFP8, &mut d).unwrap();
    assert_eq!(d[0], f32::INFINITY);
}

#[test]
fn zero_subnormal_nan_inf_blocks() {
    let fmt = Format {
        width: Width::Bfp8,
        block: BlockSize::B16,
    };
    let mut x = vec![0f32; 16 * 5];
    x[16] = f32::from_bits(1); // a subnormal block
    x[17] = -f32::from_bits(0x7F_FFFF);
    x[32 + 3] = f32::NAN;
    x[48 + 15] = f32::NEG_INFINITY;
    x[64] = 1.0;
    let mut e = [0u8; 5];
    block_exponents(&x, fmt, &mut e).unwrap();
    assert_eq!(e, [0, 0, NON_FINITE, NON_FINITE, 126]);
    let mut q = vec![1i8; x.len()];
    quantize(&x, &e, fmt, &mut q).unwrap();
    assert!(q[..16].iter().all(|&m| m == 0));
    // The largest subnormal is 2^-126 (1 - 2^-23): 64 units of u(0) = 2^-132.
    assert_eq!((q[16], q[17]), (0, -64));
    assert!(q[32..64].iter().all(|&m| m == 0));
    assert_eq!(q[64], 64);
    let mut d = vec![0f32; x.len()];
    dequantize(&q, &e, fmt, &mut d).unwrap();
    assert!(d[..16].iter().all(|&v| v == 0.0));
    assert!(d[32..64].iter().all(|v| v.is_nan()));
    assert_eq!(d[64], 1.0);
    // A NaN quantised to a finite exponent is refused, naming its block.
    let mut e2 = e;
    e2[3] = 200;
    assert_eq!(
        quantize(&x, &e2, fmt, &mut q),
        Err(CodecError::NonFinite { block: 3 })
    );
    // In a long half-precision buffer the block number counts from the start.
    let mut h = vec![f16::ONE; 5000];
    h[4100] = f16::INFINITY;
    let mut eh = vec![0u8; block_count(h.len(), fmt.block)];
    block_exponents(&h, fmt, &mut eh).unwrap();
    assert_eq!(eh[4100 / 16], NON_FINITE);
    eh[4100 / 16] = 130;
    let mut qh = vec![0i8; h.len()];
    assert_eq!(
        quantize(&h, &eh, fmt, &mut qh),
        Err(CodecError::NonFinite { block: 4100 / 16 })
    );
}

#[test]
fn rne_ties_go_to_even() {
    let e = 140u8;
    let u = ref_unit(e, 8) as f32;
    // The block max 100 units fixes E; the ties 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 126.5 -> 126.
    let x = [
        100.0 * u,
        2.5 * u,
        3.5 * u,
        -2.5 * u,
        126.5 * u,
        -126.5 * u,
        0.5 * u,
        1.5 * u,
    ];
    for isa in Isa::available() {
        let mut q = [0i8; 8];
        kernels::quant(isa, &x, &[e], 32, 8, &mut q).unwrap();
        assert_eq!(q, [100, 2, 4, -2, 126, -126, 0, 2], "{isa:?}");
    }
}

#[test]
fn saturates_never_wraps() {
    let x: Vec<f32> = (0..64)
        .map(|i| if i % 2 == 0 { 1.0e30 } else { -f32::MAX })
        .collect();
    for isa in Isa::available() {
        let mut q = [0i8; 64];
        kernels::quant(isa, &x, &[10, 0], 32, 8, &mut q).unwrap();
        assert!(q.chunks(2).all(|p| p == [127, -127]), "{isa:?}");
        kernels::quant(isa, &x, &[10, 0], 32, 4, &mut q).unwrap();
        assert!(q.chunks(2).all(|p| p == [7, -7]), "{isa:?}");
    }
}

#[test]
fn sums_widened() {
    assert_eq!(max_ranks::<i16>(Width::Bfp8), 258);
    assert_eq!(max_ranks::<i8>(Width::Bfp4), 18);
    assert_eq!(max_ranks::<i16>(Width::Bfp4), 4681);
    // 256 ranks of the largest mantissa: fits i16, decodes exactly.
    let s = [256 * 127i16; 32];
    let mut out = [0f32; 32];
    dequantize(&s, &[140], Format::BFP8, &mut out).unwrap();
    assert_eq!(out[0] as f64, 256.0 * 127.0 * ref_unit(140, 8));
    // i32 sums beyond 24 bits are rounded once, to nearest: 2^25 + 2^14 + 1 units of 2^-20 is
    // 32 + 2^-6 + 2^-20, just above the midpoint of f16's 32 and 32 + 2^-5 (through f32 it
    // would be the midpoint itself, and round to 32).
    let s = [(1 << 25) + (1 << 14) + 1i32; 16];
    let fmt = Format {
        block: BlockSize::B16,
        ..Format::BFP8
    };
    let mut h = [f16::ZERO; 16];
    dequantize(&s, &[132 - 20], fmt, &mut h).unwrap();
    assert_eq!(h[0], f16::from_f64(32.0 + 1.0 / 32.0));
    let mut f = [0f32; 16];
    dequantize(&s, &[132 - 20], fmt, &mut f).unwrap();
    assert_eq!(f[0], 32.015625); // f32: 2^25 + 2^14 + 1 rounds to 2^25 + 2^14
}

#[test]
fn lengths_and_headers_are_checked() {
    let fmt = Format::BFP8;
    let x = [1.0f32; 40];
    let mut e = [0u8; 1];
    assert_eq!(
        block_exponents(&x, fmt, &mut e),
        Err(CodecError::Length {
            what: "exponents",
            expected: 2,
            got: 1
        })
    );
    let e = [130u8; 2];
    let mut q = [0i8; 39];
    assert!(matches!(
        quantize(&x, &e, fmt, &mut q),
        Err(CodecError::Length {
            what: "mantissas",
            ..
        })
    ));
    let mut out = [0f32; 41];
    assert!(dequantize(&[0i8; 40], &e, fmt, &mut out).is_err());
    assert!(pack4(&[1, 2, 3], &mut [0u8; 1]).is_err());
    assert!(unpack4(&[0u8; 3], &mut [0i8; 3]).is_err());
    let mut wire = vec![0u8; encoded_len(40, Format::BFP4)];
    assert_eq!(wire.len(), HEADER_LEN + 2 + 20);
    assert!(encode(&x, fmt, &mut wire).is_err()); // bfp8 needs more
    encode(&x, Format::BFP4, &mut wire).unwrap();
    assert!(decode(&wire, &mut [0f32; 39]).is_err());
    assert!(decode(&wire[..wire.len() - 1], &mut [0f32; 40]).is_err());
    let mut bad = wire.clone();
    bad[0] = 0;
    assert_eq!(
        header(&bad),
        Err(CodecError::Header("not a BFP buffer (magic byte)"))
    );
    bad = wire.clone();
    bad[3] = 48;
    assert!(header(&bad).is_err());
    bad = wire.clone();
    bad[11] = 1; // n = 2^56 + 40
    assert!(header(&bad).is_err());
    assert!(header(&[]).is_err());
    assert_eq!(encoded_len(usize::MAX, fmt), usize::MAX);
    // Empty buffers are fine.
    let mut wire = vec![0u8; encoded_len(0, fmt)];
    encode::<f32>(&[], fmt, &mut wire).unwrap();
    decode::<f32>(&wire, &mut []).unwrap();
    assert!(kernel() == "avx512" || kernel() == "avx2" || kernel() == "scalar");
}

#[test]
fn format_names_round_trip_and_bad_ones_are_refused() {
    for w in [Width::Bfp8, Width::Bfp4] {
        for b in [BlockSize::B16, BlockSize::B32, BlockSize::B64] {
            let f = Format { width: w, block: b };
            assert_eq!(f.to_string().parse::<Format>(), Ok(f), "{f}");
        }
    }
    assert_eq!(Format::BFP8.to_string(), "bfp8");
    assert_eq!(
        "bfp4/64".parse::<Format>().map(|f| f.block),
        Ok(BlockSize::B64)
    );
    for bad in [
        "",
        "off",
        "bfp",
        "bfp16",
        "bfp8/8",
        "bfp8/",
        "BFP8",
        "bfp8/32/1",
    ] {
        let e = bad.parse::<Format>().unwrap_err();
        assert!(
            e.contains("bfp8") || e.contains("16, 32 or 64"),
            "{bad:?}: {e}"
        );
    }
}

// ---- re-encoding exact sums (the result phase of the compressed all-reduce) ------------------

/// The reference: the smallest shift by search, rounding in `f64` by `floor`.
fn ref_requantize(s: &[i16], e: u8, m: u32) -> (u8, Vec<i8>) {
    if e == NON_FINITE {
        return (NON_FINITE, vec![0; s.len()]);
    }
    let max = (1u32 << (m - 1)) as f64 - 1.0;
    let top = s.iter().map(|&v| (v as f64).abs()).fold(0.0, f64::max);
    let k = (0..=16)
        .find(|&k| ref_round(top / 2f64.powi(k)) <= max)
        .unwrap()
        .min(254 - e as i32);
    let q = s
        .iter()
        .map(|&v| ref_round(v as f64 / 2f64.powi(k)).clamp(-max, max) as i8)
        .collect();
    (e + k as u8, q)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn requantized_sums_match_the_reference_and_the_bound(
        sums in prop::collection::vec(-32512i16..=32512, 0..200),
        scale in 0u32..16,
        e0 in 0u8..=255,
        fmt in format(),
    ) {
        let (b, m) = (fmt.block.values(), fmt.width.bits());
        // Sums of every size, from a few units to 256 ranks' worth.
        let sums: Vec<i16> = sums.iter().map(|&s| s >> scale).collect();
        let nb = block_count(sums.len(), fmt.block);
        let exps: Vec<u8> = (0..nb).map(|i| e0.wrapping_add((i as u8).wrapping_mul(37))).collect();
        let (mut ne, mut q) = (vec![0u8; nb], vec![0i8; sums.len()]);
        requantize(&sums, &exps, fmt, &mut ne, &mut q).unwrap();
        for (i, (s, qb)) in sums.chunks(b).zip(q.chunks(b)).enumerate() {
            let (re, rq) = ref_requantize(s, exps[i], m);
            prop_assert_eq!(ne[i], re, "block {}", i);
            prop_assert_eq!(qb, &rq[..], "block {}", i);
            if re == NON_FINITE || re == 254 {
                continue;
            }
            // One rounding: within u(E')/2 of the exact sum, and u(E')/2 ≤ 2A/(2^M − 1) once
            // the block was shifted.
            let top = s.iter().map(|&v| (v as f64).abs()).fold(0.0, f64::max);
            let a = top * ref_unit(exps[i], m);
            for (&v, &w) in s.iter().zip(qb) {
                let err = (ref_dequant(v as i64, exps[i], m) - ref_dequant(w as i64, re, m)).abs();
                prop_assert!(err <= ref_unit(re, m) / 2.0);
                if re > exps[i] {
                    prop_assert!(err <= 2.0 * a / ((1u32 << m) as f64 - 1.0));
                }
            }
        }
    }
}

#[test]
fn requantize_ties_saturation_and_lengths() {
    let fmt = Format {
        block: BlockSize::B16,
        ..Format::BFP4
    };
    // Largest 9: shift 1 (9/2 = 4.5 → 4 fits 7), ties to even: 3/2 → 2, 5/2 → 2, -3/2 → -2.
    let mut s = [0i16; 16];
    s[..4].copy_from_slice(&[9, 3, 5, -3]);
    let (mut ne, mut q) = ([0u8; 1], [0i8; 16]);
    requantize(&s, &[100], fmt, &mut ne, &mut q).unwrap();
    assert_eq!((ne[0], &q[..4]), (101, &[4i8, 2, 2, -2][..]));
    // Already in range: unchanged.
    s[..4].copy_from_slice(&[7, -7, 1, 0]);
    requantize(&s, &[100], fmt, &mut ne, &mut q).unwrap();
    assert_eq!((ne[0], &q[..4]), (100, &[7i8, -7, 1, 0][..]));
    // Past exponent 254: saturated, and f32 decodes ±infinity, as the float sum would be.
    s[..2].copy_from_slice(&[100, -100]);
    requantize(&s, &[253], fmt, &mut ne, &mut q).unwrap();
    assert_eq!((ne[0], &q[..2]), (254, &[7i8, -7][..]));
    let mut f = [0f32; 16];
    dequantize(&q, &ne, fmt, &mut f).unwrap();
    assert_eq!((f[0], f[1]), (f32::INFINITY, f32::NEG_INFINITY));
    // Non-finite blocks stay so.
    requantize(&s, &[NON_FINITE], fmt, &mut ne, &mut q).unwrap();
    assert_eq!((ne[0], q), (NON_FINITE, [0; 16]));
    // Lengths.
    assert!(requantize(&s, &[1, 2], fmt, &mut ne, &mut q).is_err());
    assert!(requantize(&s, &[1], fmt, &mut [0; 2], &mut q).is_err());
    assert!(requantize(&s, &[1], fmt, &mut ne, &mut [0; 15]).is_err());
}

// ---- the error of a quantisation, for error feedback -----------------------------------------

/// `quantize_with_error` against the reference: the same mantissas as `quantize`, and an error
/// of `x − m · u(E)` computed in `f64` (exact), zero in a NaN block, at exponents raised by up
/// to `raise` over the input's own (as the ranks' agreed maximum raises them).
fn check_error(x: &[f32], fmt: Format, raise: u8) -> Result<(), TestCaseError> {
    let (b, m) = (fmt.block.values(), fmt.width.bits());
    let nb = block_count(x.len(), fmt.block);
    let mut exps = vec![0u8; nb];
    block_exponents(x, fmt, &mut exps).unwrap();
    for e in exps.iter_mut().filter(|e| **e != NON_FINITE) {
        *e = e.saturating_add(raise).min(NON_FINITE - 1);
    }
    let (mut q, mut want_q) = (vec![0i8; x.len()], vec![0i8; x.len()]);
    let mut err = vec![f32::NAN; x.len()];
    quantize(x, &exps, fmt, &mut want_q).unwrap();
    quantize_with_error(x, &exps, fmt, &mut q, &mut err).unwrap();
    prop_assert_eq!(&q, &want_q);
    for (i, (&v, &got)) in x.iter().zip(&err).enumerate() {
        let e = exps[i / b];
        let want = if e == NON_FINITE {
            0.0
        } else {
            v as f64 - ref_dequant(q[i] as i64, e, m)
        };
        prop_assert!(
            want == got as f64,
            "value {i} ({v}): error {got}, want {want}"
        );
    }
    // bf16 input: the error rounded once to bf16.
    let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut hexps = vec![0u8; nb];
    block_exponents(&h, fmt, &mut hexps).unwrap();
    let mut herr = vec![bf16::ZERO; x.len()];
    quantize_with_error(&h, &hexps, fmt, &mut q, &mut herr).unwrap();
    for (i, (&v, &got)) in h.iter().zip(&herr).enumerate() {
        let e = hexps[i / b];
        let want = if e == NON_FINITE {
            0.0
        } else {
            v.to_f64() - ref_dequant(q[i] as i64, e, m)
        };
        prop_assert!(
            bf16::from_f64(want) == got,
            "bf16 value {i}: error {got}, want {want}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    // Up to 4500 values: across the pieces of 2048 it works in.
    fn quantisation_error_is_exact(x in buffer(4500), fmt in format(), raise in 0u8..3) {
        check_error(&x, fmt, raise)?;
    }
}

#[test]
fn quantisation_error_of_a_nan_block_is_zero_and_lengths_are_checked() {
    let mut x = vec![0.3f32; 100];
    x[40] = f32::NAN;
    let fmt = Format::BFP8;
    let mut exps = vec![0u8; 4];
    block_exponents(&x, fmt, &mut exps).unwrap();
    let (mut q, mut err) = (vec![0i8; 100], vec![1f32; 100]);
    quantize_with_error(&x, &exps, fmt, &mut q, &mut err).unwrap();
    assert!(err[32..64].iter().all(|&e| e == 0.0));
    assert!(err[..32].iter().all(|&e| e.abs() < 0.3 / 100.0));
    let mut short = vec![0f32; 99];
    assert!(matches!(
        quantize_with_error(&x, &exps, fmt, &mut q, &mut short),
        Err(CodecError::Length { .. })
    ));
}
