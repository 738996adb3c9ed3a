//! Block floating point (BFP) compression: blocks of values share one 8-bit exponent, each value
//! keeps a small signed integer mantissa, and mantissas quantised to a *common* exponent sum
//! exactly as integers.
//!
//! ```
//! use oxccl_core::compress::{self, Format};
//!
//! let grad: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.01).collect();
//! let fmt = Format::BFP8; // 8-bit mantissas, blocks of 32: 8.25 bits a value
//! let mut wire = vec![0u8; compress::encoded_len(grad.len(), fmt)];
//! compress::encode(&grad, fmt, &mut wire)?;
//! let mut back = vec![0f32; compress::header(&wire)?.len];
//! compress::decode(&wire, &mut back)?;
//! // One quantisation: within 2/(2^8 - 1) of each block's largest magnitude (0.5 here).
//! assert!(grad.iter().zip(&back).all(|(x, y)| (x - y).abs() <= 0.5 * 2.0 / 255.0));
//!
//! // The exact sum of two ranks' blocks: agree on the exponents (a max), quantise to them,
//! // add the mantissas as integers, decode once.
//! let other: Vec<f32> = grad.iter().map(|x| 3.0 * x).collect();
//! let nb = compress::block_count(grad.len(), fmt.block);
//! let (mut e0, mut e1) = (vec![0u8; nb], vec![0u8; nb]);
//! compress::block_exponents(&grad, fmt, &mut e0)?;
//! compress::block_exponents(&other, fmt, &mut e1)?;
//! compress::max_exponents(&mut e0, &e1)?; // what a max all-reduce gives every rank
//! let (mut m0, mut m1) = (vec![0i8; grad.len()], vec![0i8; grad.len()]);
//! compress::quantize(&grad, &e0, fmt, &mut m0)?;
//! compress::quantize(&other, &e0, fmt, &mut m1)?;
//! let sum: Vec<i16> = m0.iter().zip(&m1).map(|(&a, &b)| a as i16 + b as i16).collect();
//! let mut total = vec![0f32; grad.len()];
//! compress::dequantize(&sum, &e0, fmt, &mut total)?;
//! // Two quantisations' error, each within 2/255 of the common block maximum (1.5 here).
//! assert!(grad.iter().zip(&total).all(|(x, t)| (4.0 * x - t).abs() <= 2.0 * 1.5 * 2.0 / 255.0));
//! # Ok::<(), compress::CodecError>(())
//! ```
//!
//! # Format
//!
//! A buffer of `n` values is cut into blocks of `B` values (`B` = 16, 32 or 64, [`BlockSize`];
//! the last block may be shorter). Each block has one exponent byte `E`, each value one signed
//! mantissa `m` of `M` bits (`M` = 8 for [`Width::Bfp8`], 4 for [`Width::Bfp4`]), and stands for
//!
//! ```text
//! x̂ = m · u(E),   u(E) = 2^(E − 124 − M),   |m| ≤ 2^(M−1) − 1   (127 for bfp8, 7 for bfp4).
//! ```
//!
//! Writing `e = E − 125`, the unit is `u = 2^(e − (M − 1))` and every decoded value lies in
//! `(−2^e, 2^e)`. `E` runs over `0..=254` (so `e` over `−125..=129`, enough for every finite
//! `f32`, `f16` and `bf16`); `E = 255` ([`NON_FINITE`]) marks a block holding a NaN or an
//! infinity. The mantissa range is symmetric: `−2^(M−1)` is never produced, so negation is exact
//! and sums are bounded by `n · (2^(M−1) − 1)`.
//!
//! Per value this is `M` bits plus `8/B` for the exponent: `bfp8` is 8.25 bits at `B` = 32 (8.5
//! at 16, 8.125 at 64), `bfp4` 4.25. Mantissas are `i8` in memory for both widths; [`pack4`]
//! and [`unpack4`] put two 4-bit mantissas in a byte for the wire.
//!
//! # The block exponent
//!
//! [`block_exponents`] gives each block the *smallest* `E` in `0..=254` at which every value
//! of the block rounds to a mantissa within range, `|rne(x / u(E))| ≤ 2^(M−1) − 1`. Since that
//! condition only depends on the block's largest magnitude `a = max |x|`, and `a` is
//! `2^(k−127) · (1 + f)` with `k` its biased IEEE exponent and `f` its fraction, the rule is
//! `E = k − 1`, or `E = k` when `f ≥ 1 − 2^(1−M)` (then `a / u(k − 1)` would round up to
//! `2^(M−1)`); on the bits of `a` as an `f32` this is
//! `E = max((bits(a) + 2^(24−M)) >> 23, 1) − 1`. Subnormal and zero blocks get `E = 0`. The
//! exponent depends on `M`: exponents computed for `bfp8` are not those of `bfp4`.
//!
//! # Rounding and saturation
//!
//! [`quantize`] computes `m = rne(x / u(E))` (round to nearest, ties to even) for the exponent
//! it is given. `x / u(E)` is a multiplication by a power of two, exact whenever the result is a
//! normal number (and when it is not, it is below 2^−126 and rounds to 0 either way), so the
//! only rounding is the final one to an integer. An exponent larger than the block needs is
//! fine (that is the common exponent of the exact sum); one smaller than the block needs
//! *saturates*: mantissas are clamped to `±(2^(M−1) − 1)`, never wrapped.
//!
//! # Error bound of one quantisation
//!
//! Without saturation, `|x − x̂| ≤ u(E)/2 = 2^(e − M)` for every value: half a mantissa unit
//! at the block's scale. When `E ≥ 1` is the block's own exponent it is the smallest that fits,
//! so at `E − 1` the block's largest magnitude `a` did not fit:
//! `a / u(E − 1) ≥ 2^(M−1) − 1/2`, i.e. `a ≥ (2^(M−1) − 1/2) · u(E)/2`, and therefore
//!
//! ```text
//! |x − x̂| ≤ u(E)/2 ≤ a / (2^(M−1) − 1/2) = 2a / (2^M − 1)     (a/127.5 for bfp8, a/7.5 for bfp4).
//! ```
//!
//! Values much smaller than the block maximum keep this *absolute* error, so their relative
//! error is larger (they may round to 0): BFP is accurate relative to each block's maximum.
//! A block whose maximum is below about 2^−125 (`E = 0`) keeps the absolute bound `u(0)/2`.
//! Decoding to `f32` is exact (`m · u` has at most 8 significant bits and lies within `f32`'s
//! range); decoding to `f16`/`bf16` rounds once more, to nearest even.
//!
//! # Exact sums at a common exponent
//!
//! In the compressed all-reduce each rank `r` computes its block exponents `E_r`, the ranks
//! agree on `E = max_r E_r` per block (a max all-reduce of the exponent bytes,
//! [`max_exponents`]), and every rank quantises to that common `E`: `m_r = rne(x_r / u(E))`.
//! The fit condition is monotone in `E`, so `E ≥ E_r` never saturates and each `m_r` carries an
//! error of at most `u(E)/2`. The ranks then add mantissas as integers, `S = Σ_r m_r`, and decode
//! `S · u(E)` once. Integer addition is associative and commutative and, in a wide enough type,
//! never overflows, so **every order and grouping of the additions** (ring, tree, two-tier, an
//! in-network aggregator) gives the same `S`, hence the same bits after decoding; the result is
//! `Σ_r x̂_r` exactly, so its error against the exact sum is `|S·u − Σ_r x_r| ≤ n · u(E)/2`,
//! the error of the one quantisation each input went through, and nothing from the additions.
//! (Decompressing, adding in floating point and recompressing at every hop instead rounds at
//! every hop, and the result depends on the order.)
//!
//! The sum needs `|S| ≤ n · (2^(M−1) − 1)`: `i16` holds the sum of `bfp8` mantissas from up to
//! 258 ranks (256 · 127 = 32 512 ≤ 32 767), `i32` from up to 16 909 320; `bfp4` sums fit `i8`
//! up to 18 ranks and `i16` up to 4 681 ([`max_ranks`]). [`dequantize`] decodes `i8` mantissas
//! and `i16`/`i32` sums: from `i8` and `i16` the `f32` result is exact (at most 16 significant
//! bits) unless it exceeds `f32`'s range, where it is ±infinity as a floating-point sum would
//! be; from `i32` it is rounded once (computed in `f64`, then rounded to the output type).
//!
//! # The result phase: one rounding of the sum
//!
//! Sending the sums `S` back as `i16` costs two bytes a value. The compressed all-reduce
//! instead has the owner of each block re-encode its exact sums in the same format
//! ([`requantize`]): a new exponent `E' = E + k`, `k` the smallest shift at which the block's
//! largest `|S|` rounds within `2^(M−1) − 1`, and mantissas `rne(S / 2^k)`, computed on the
//! integers. The owner does this once and every rank decodes the same bytes, so the result is
//! still the same bits everywhere and for every algorithm. Its error against the exact sum is
//! one quantisation of each input at the common exponent plus one rounding of the sum:
//!
//! ```text
//! |result − Σ_r x_r| ≤ n · u(E)/2 + u(E')/2,   u(E')/2 ≤ max(u(E)/2, 2A / (2^M − 1)),
//! ```
//!
//! `A` the largest magnitude of the block's quantised sum (`k = 0` leaves the sum as it is; for
//! `k ≥ 1` it did not fit at `k − 1`, which bounds `u(E')` as for [`block_exponents`]). A sum
//! beyond `f32`'s range saturates at exponent 254 and decodes as ±infinity.
//!
//! # NaN and infinity
//!
//! A block holding a NaN or an infinity gets the exponent [`NON_FINITE`] (255): [`quantize`]
//! writes zero mantissas for it and [`dequantize`] decodes **every value of the block as NaN**.
//! Through the all-reduce, the max of the exponents makes that block NaN on every rank, so a
//! non-finite gradient is seen by all of them, as with an uncompressed NCCL all-reduce (which is
//! what PyTorch's `GradScaler` relies on to skip a step after an overflow). The NaN is per
//! block: the block's finite values are lost, other blocks are unaffected. Quantising a NaN or an
//! infinity to a *finite* exponent (exponents computed from other data) is refused:
//! [`CodecError::NonFinite`] names the first such block.
//!
//! # Wire layout of [`encode`]
//!
//! A [`HEADER_LEN`]-byte header (`0xBF`, version 1, `M`, `B`, then `n` as a little-endian
//! `u64`), then `ceil(n / B)` exponent bytes, then the mantissas: `n` bytes (`i8`) for `bfp8`,
//! `ceil(n / 2)` bytes for `bfp4` (value `2i` in the low nibble of byte `i`, `2i + 1` in the high
//! one, two's complement). [`encoded_len`] gives the total.
//!
//! # Speed
//!
//! The kernels have AVX2 versions (and AVX-512 ones with the `avx512` feature, which needs
//! Rust 1.89), chosen once at run time (`is_x86_feature_detected!`), and a portable scalar
//! version; all give the same bits.
//! [`kernel`] names the one in use. `f16` and `bf16` are widened to `f32` a few KiB at a time on
//! the stack; nothing here allocates.

use std::fmt;

use half::{bf16, f16};

use crate::dtype::Element;

mod kernels;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The exponent byte of a block holding a NaN or an infinity: it decodes as NaN throughout.
pub const NON_FINITE: u8 = 255;

/// Bytes of the header [`encode`] writes before the exponents.
pub const HEADER_LEN: usize = 12;

const MAGIC: u8 = 0xBF;
const VERSION: u8 = 1;

/// Values staged through the stack at a time (a multiple of every block size).
const CHUNK: usize = 2048;

/// The mantissa width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Width {
    /// 8-bit mantissas (`bfp8`), in `−127..=127`.
    Bfp8,
    /// 4-bit mantissas (`bfp4`), in `−7..=7`.
    Bfp4,
}

impl Width {
    /// `M`, the bits of a mantissa (8 or 4).
    pub const fn bits(self) -> u32 {
        match self {
            Width::Bfp8 => 8,
            Width::Bfp4 => 4,
        }
    }

    /// The largest mantissa magnitude, `2^(M−1) − 1` (127 or 7).
    pub const fn max_mantissa(self) -> i32 {
        (1 << (self.bits() - 1)) - 1
    }

    fn from_bits(bits: u8) -> Option<Width> {
        match bits {
            8 => Some(Width::Bfp8),
            4 => Some(Width::Bfp4),
            _ => None,
        }
    }
}

/// The number of values sharing one exponent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum BlockSize {
    /// 16 values a block.
    B16,
    /// 32 values a block (the default).
    #[default]
    B32,
    /// 64 values a block.
    B64,
}

impl BlockSize {
    /// The number of values in a block.
    pub const fn values(self) -> usize {
        match self {
            BlockSize::B16 => 16,
            BlockSize::B32 => 32,
            BlockSize::B64 => 64,
        }
    }

    fn from_len(len: u8) -> Option<BlockSize> {
        match len {
            16 => Some(BlockSize::B16),
            32 => Some(BlockSize::B32),
            64 => Some(BlockSize::B64),
            _ => None,
        }
    }
}

/// A BFP format: mantissa width and block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Format {
    /// The mantissa width.
    pub width: Width,
    /// Values per shared exponent.
    pub block: BlockSize,
}

impl Format {
    /// `bfp8`: 8-bit mantissas in blocks of 32 (8.25 bits a value).
    pub const BFP8: Format = Format {
        width: Width::Bfp8,
        block: BlockSize::B32,
    };
    /// `bfp4`: 4-bit mantissas in blocks of 32 (4.25 bits a value).
    pub const BFP4: Format = Format {
        width: Width::Bfp4,
        block: BlockSize::B32,
    };

    /// Bits on the wire per value, exponents included (8.25 for `bfp8`).
    pub fn bits_per_value(self) -> f64 {
        self.width.bits() as f64 + 8.0 / self.block.values() as f64
    }
}

/// `bfp8` or `bfp4`, with blocks of 32, or `bfp8/16`, `bfp4/64`, ... (blocks of 16, 32 or 64):
/// the names `oxccl perf --compress` and the Python API take.
impl std::str::FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Format, String> {
        let (w, b) = s.split_once('/').unwrap_or((s, "32"));
        let width = match w {
            "bfp8" => Width::Bfp8,
            "bfp4" => Width::Bfp4,
            _ => {
                return Err(format!(
                    "{s:?} is not a BFP format: bfp8 or bfp4, optionally /16, /32 or /64"
                ));
            }
        };
        let block = match b {
            "16" => BlockSize::B16,
            "32" => BlockSize::B32,
            "64" => BlockSize::B64,
            _ => return Err(format!("{s:?}: blocks of 16, 32 or 64 values")),
        };
        Ok(Format { width, block })
    }
}

/// The name [`Format::from_str`](std::str::FromStr) reads: `bfp8`, or `bfp4/64`.
impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bfp{}", self.width.bits())?;
        if self.block != BlockSize::B32 {
            write!(f, "/{}", self.block.values())?;
        }
        Ok(())
    }
}

/// What went wrong in a codec call. The output buffers' contents are unspecified after an error.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    /// A buffer has the wrong length for the others.
    Length {
        /// Which buffer (`"exponents"`, `"mantissas"`, `"output"`, ...).
        what: &'static str,
        /// The length the other arguments call for (elements, or bytes for byte buffers).
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A NaN or an infinity was to be quantised to a finite exponent (one not [`NON_FINITE`]):
    /// the exponents were not computed from (or agreed over) this data.
    NonFinite {
        /// The index of the first such block.
        block: usize,
    },
    /// An encoded buffer's header is not one [`encode`] writes.
    Header(&'static str),
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Length {
                what,
                expected,
                got,
            } => write!(f, "bfp: {what} has length {got}, expected {expected}"),
            CodecError::NonFinite { block } => write!(
                f,
                "bfp: block {block} holds a NaN or an infinity but its exponent is finite \
                 (exponents not computed from this data)"
            ),
            CodecError::Header(why) => write!(f, "bfp: bad encoded buffer: {why}"),
        }
    }
}

impl std::error::Error for CodecError {}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), CodecError> {
    if expected == got {
        Ok(())
    } else {
        Err(CodecError::Length {
            what,
            expected,
            got,
        })
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i8 {}
    impl Sealed for i16 {}
    impl Sealed for i32 {}
}

/// The input and output types of the codec: `f32`, `f16` and `bf16` (sealed).
pub trait Float: Element + private::Sealed {
    /// The slice as `f32`s, when `Self` is `f32`.
    #[doc(hidden)]
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// The slice as `f32`s, when `Self` is `f32`.
    #[doc(hidden)]
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// Widens `src` into `dst` (same length; exact).
    #[doc(hidden)]
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (same length; to nearest even).
    #[doc(hidden)]
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// Rounds `v` to nearest even, once.
    #[doc(hidden)]
    fn round_from_f64(v: f64) -> Self;
}

impl Float for f32 {
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    fn round_from_f64(v: f64) -> Self {
        v as f32
    }
}

/// `v` rounded to `f32` to odd: toward zero, with the last bit set when inexact. Rounding that
/// to nearest even in a format of at most 11 significant bits (`f16`, `bf16`) gives `v` rounded
/// once to that format (24 ≥ 2·11 + 2), where going through nearest-even `f32` could round
/// twice (and `half`'s `from_f64` drops `v`'s low 32 bits before rounding).
fn f32_round_to_odd(v: f64) -> f32 {
    let r = v as f32;
    if v.is_nan() || r as f64 == v {
        return r;
    }
    let mut bits = r.to_bits();
    if (r as f64).abs() > v.abs() {
        bits -= 1; // one step toward zero (from an infinity: to the largest finite)
    }
    f32::from_bits(bits | 1)
}

macro_rules! half_float {
    ($t:ty) => {
        impl Float for $t {
            fn as_f32(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn widen(src: &[Self], dst: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst)
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(src)
            }
            fn round_from_f64(v: f64) -> Self {
                <$t>::from_f32(f32_round_to_odd(v))
            }
        }
    };
}
half_float!(f16);
half_float!(bf16);

/// The integer types [`dequantize`] decodes: `i8` mantissas, `i16` and `i32` sums of mantissas
/// (sealed).
pub trait Mantissa: Copy + private::Sealed {
    /// The largest magnitude the type holds.
    #[doc(hidden)]
    const MAX: i64;
    /// Decodes `src` (whole blocks from the first, exponents `exps`) into `out` (same length).
    #[doc(hidden)]
    fn dequantize_f32(src: &[Self], exps: &[u8], block: usize, m: u32, out: &mut [f32]);
    /// Whether decoding to `f32` is exact (else it goes through `f64`).
    #[doc(hidden)]
    const EXACT_IN_F32: bool;
    /// The value as an `f64`.
    #[doc(hidden)]
    fn to_f64(self) -> f64;
}

impl Mantissa for i8 {
    const MAX: i64 = i8::MAX as i64;
    const EXACT_IN_F32: bool = true;
    fn dequantize_f32(src: &[Self], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
        kernels::dequant_i8(kernels::isa(), src, exps, block, m, out)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Mantissa for i16 {
    const MAX: i64 = i16::MAX as i64;
    const EXACT_IN_F32: bool = true;
    fn dequantize_f32(src: &[Self], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
        kernels::dequant_i16(kernels::isa(), src, exps, block, m, out)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Mantissa for i32 {
    const MAX: i64 = i32::MAX as i64;
    const EXACT_IN_F32: bool = false;
    fn dequantize_f32(src: &[Self], exps: &[u8], block: usize, m: u32, out: &mut [f32]) {
        kernels::dequant_wide(src, exps, block, m, out)
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

/// The number of blocks of `n` values: `ceil(n / B)`.
pub const fn block_count(n: usize, block: BlockSize) -> usize {
    n.div_ceil(block.values())
}

/// How many ranks' mantissas of `width` an `S` holds the sum of without overflow:
/// `S::MAX / (2^(M−1) − 1)` (258 for `bfp8` in `i16`, 18 for `bfp4` in `i8`).
pub fn max_ranks<S: Mantissa>(width: Width) -> usize {
    (S::MAX / width.max_mantissa() as i64) as usize
}

/// The name of the kernels in use: `"avx512"`, `"avx2"` or `"scalar"`.
pub fn kernel() -> &'static str {
    kernels::isa().name()
}

/// Benchmarks only: makes later calls use the kernels named (`"scalar"`, `"avx2"`, `"avx512"`),
/// if this CPU runs them (returns whether it does). All give the same bits; only speed differs.
#[doc(hidden)]
pub fn force_kernel(name: &str) -> bool {
    kernels::force(name)
}

/// Writes the exponent each block of `input` needs (see the module docs: the smallest `E` at
/// which the block's values fit `fmt.width`'s mantissas; [`NON_FINITE`] for a block holding a
/// NaN or an infinity) into `exps`, which must hold [`block_count`]`(input.len(), fmt.block)`.
pub fn block_exponents<T: Float>(
    input: &[T],
    fmt: Format,
    exps: &mut [u8],
) -> Result<(), CodecError> {
    let b = fmt.block.values();
    check_len("exponents", block_count(input.len(), fmt.block), exps.len())?;
    let (isa, m) = (kernels::isa(), fmt.width.bits());
    match T::as_f32(input) {
        Some(x) => kernels::exps(isa, x, b, m, exps),
        None => {
            let mut w = [0f32; CHUNK];
            for (x, e) in input.chunks(CHUNK).zip(exps.chunks_mut(CHUNK / b)) {
                let w = &mut w[..x.len()];
                T::widen(x, w);
                kernels::exps(isa, w, b, m, e);
            }
        }
    }
    Ok(())
}

/// `acc[i] = max(acc[i], other[i])`: the combining step of the exponents' max all-reduce.
pub fn max_exponents(acc: &mut [u8], other: &[u8]) -> Result<(), CodecError> {
    check_len("exponents", acc.len(), other.len())?;
    for (a, &o) in acc.iter_mut().zip(other) {
        *a = (*a).max(o);
    }
    Ok(())
}

/// Quantises `input` to the given block exponents (its own from [`block_exponents`], or larger
/// agreed ones), rounding to nearest even and saturating, into one `i8` mantissa per value
/// (`mantissas.len() == input.len()`; in `−7..=7` for `bfp4`: see [`pack4`]).
///
/// Blocks with exponent [`NON_FINITE`] get zero mantissas. A NaN or an infinity in a block with a
/// finite exponent is an error ([`CodecError::NonFinite`]).
pub fn quantize<T: Float>(
    input: &[T],
    exps: &[u8],
    fmt: Format,
    mantissas: &mut [i8],
) -> Result<(), CodecError> {
    let b = fmt.block.values();
    check_len("exponents", block_count(input.len(), fmt.block), exps.len())?;
    check_len("mantissas", input.len(), mantissas.len())?;
    let (isa, m) = (kernels::isa(), fmt.width.bits());
    let nonfinite = |block| CodecError::NonFinite { block };
    match T::as_f32(input) {
        Some(x) => kernels::quant(isa, x, exps, b, m, mantissas).map_err(nonfinite),
        None => {
            let mut w = [0f32; CHUNK];
            let chunks = input.chunks(CHUNK).zip(exps.chunks(CHUNK / b));
            for (i, ((x, e), out)) in chunks.zip(mantissas.chunks_mut(CHUNK)).enumerate() {
                let w = &mut w[..x.len()];
                T::widen(x, w);
                kernels::quant(isa, w, e, b, m, out).map_err(|j| nonfinite(i * CHUNK / b + j))?;
            }
            Ok(())
        }
    }
}

/// [`quantize`], and into `error` what it dropped of each value, `x − m · u(E)` (exact in
/// `f32`: `x` and `m · u(E)` are both multiples of the unit of `x`'s own exponent or of `u(E)`,
/// and within `u(E)/2` of each other), zero throughout a [`NON_FINITE`] block: the error
/// feedback of a compressed sum. A cache-sized piece at a time, so that the error is computed
/// while the piece's values are still in the first-level cache (no second pass over memory).
/// `mantissas` and `error` are as long as `input`.
pub fn quantize_with_error<T: Float>(
    input: &[T],
    exps: &[u8],
    fmt: Format,
    mantissas: &mut [i8],
    error: &mut [T],
) -> Result<(), CodecError> {
    let b = fmt.block.values();
    check_len("exponents", block_count(input.len(), fmt.block), exps.len())?;
    check_len("mantissas", input.len(), mantissas.len())?;
    check_len("error", input.len(), error.len())?;
    let m = fmt.width.bits();
    let (mut w, mut r) = ([0f32; CHUNK], [0f32; CHUNK]);
    let pieces = input.chunks(CHUNK).zip(mantissas.chunks_mut(CHUNK));
    for (i, ((x, q), (e, err))) in pieces
        .zip(exps.chunks(CHUNK / b).zip(error.chunks_mut(CHUNK)))
        .enumerate()
    {
        quantize(x, e, fmt, q).map_err(|err| match err {
            CodecError::NonFinite { block } => CodecError::NonFinite {
                block: i * CHUNK / b + block,
            },
            other => other,
        })?;
        let xf: &[f32] = match T::as_f32(x) {
            Some(xf) => xf,
            None => {
                T::widen(x, &mut w[..x.len()]);
                &w[..x.len()]
            }
        };
        match T::as_f32_mut(err) {
            Some(out) => dropped(xf, q, e, b, m, out),
            None => {
                let rf = &mut r[..x.len()];
                dropped(xf, q, e, b, m, rf);
                T::narrow(rf, err);
            }
        }
    }
    Ok(())
}

/// `out = x − q · u(E)` per block of `b` values, zero in a [`NON_FINITE`] block.
fn dropped(x: &[f32], q: &[i8], exps: &[u8], b: usize, m: u32, out: &mut [f32]) {
    for (((o, x), q), &e) in out
        .chunks_mut(b)
        .zip(x.chunks(b))
        .zip(q.chunks(b))
        .zip(exps)
    {
        if e == NON_FINITE {
            o.fill(0.0);
            continue;
        }
        let u = kernels::unit(e, m);
        if u <= 2f32.powi(119) {
            for ((o, &x), &q) in o.iter_mut().zip(x).zip(q) {
                *o = x - f32::from(q) * u;
            }
        } else {
            // `q · u` could pass f32's range (the value itself does not): in f64, exact.
            for ((o, &x), &q) in o.iter_mut().zip(x).zip(q) {
                *o = (x as f64 - f64::from(q) * u as f64) as f32;
            }
        }
    }
}

/// Decodes mantissas (`i8`) or sums of mantissas at common exponents (`i16`, `i32`) into `out`
/// (`out.len() == mantissas.len()`): `out[i] = mantissas[i] · u(E)` of its block, rounded to
/// `T` (exact for `f32` from `i8` and `i16`), NaN throughout a [`NON_FINITE`] block.
pub fn dequantize<S: Mantissa, T: Float>(
    mantissas: &[S],
    exps: &[u8],
    fmt: Format,
    out: &mut [T],
) -> Result<(), CodecError> {
    let b = fmt.block.values();
    check_len(
        "exponents",
        block_count(mantissas.len(), fmt.block),
        exps.len(),
    )?;
    check_len("output", mantissas.len(), out.len())?;
    let m = fmt.width.bits();
    if !S::EXACT_IN_F32 {
        // One rounding, from the exact value in f64, to any output type.
        for ((s, o), &e) in mantissas.chunks(b).zip(out.chunks_mut(b)).zip(exps) {
            let u = kernels::unit_f64(e, m);
            for (&s, o) in s.iter().zip(o) {
                *o = T::round_from_f64(s.to_f64() * u);
            }
        }
        return Ok(());
    }
    match T::as_f32_mut(out) {
        Some(o) => S::dequantize_f32(mantissas, exps, b, m, o),
        None => {
            let mut w = [0f32; CHUNK];
            let chunks = mantissas.chunks(CHUNK).zip(exps.chunks(CHUNK / b));
            for ((s, e), o) in chunks.zip(out.chunks_mut(CHUNK)) {
                let w = &mut w[..s.len()];
                S::dequantize_f32(s, e, b, m, w);
                T::narrow(w, o);
            }
        }
    }
    Ok(())
}

/// Re-encodes exact sums of mantissas at common exponents (`sums`, one block exponent each in
/// `exps`) as mantissas of the same width: the result phase of the compressed all-reduce, where
/// the owner of a share of blocks sends its sums back as BFP rather than as `i16`.
///
/// Each block gets the new exponent `E' = E + k`, `k ≥ 0` the smallest shift at which every sum
/// of the block rounds within range, `|rne(S / 2^k)| ≤ 2^(M−1) − 1`, and each value the mantissa
/// `rne(S / 2^k)` (round to nearest, ties to even, on the integers: exact, no floating point).
/// Where `E + k` would pass 254 (a sum beyond every float's range) `E'` is 254 and the
/// mantissas saturate at `±(2^(M−1) − 1)`, which decode as ±infinity in `f32`. A
/// [`NON_FINITE`] block stays [`NON_FINITE`] with zero mantissas.
///
/// `S · u(E) = (S / 2^k) · u(E')`, so the value changes by one rounding, at most `u(E')/2`; with
/// `k ≥ 1` the block's largest sum `A = max |S| · u(E)` did not fit at `k − 1`, hence
/// `u(E')/2 ≤ 2A / (2^M − 1)`, and with `k = 0` nothing changes. The function is pure integer
/// arithmetic, so every rank that runs it on the same sums gets the same bits.
///
/// `new_exps` holds as many bytes as `exps` ([`block_count`] of `sums.len()`), `mantissas` one
/// per sum.
pub fn requantize(
    sums: &[i16],
    exps: &[u8],
    fmt: Format,
    new_exps: &mut [u8],
    mantissas: &mut [i8],
) -> Result<(), CodecError> {
    let b = fmt.block.values();
    check_len("exponents", block_count(sums.len(), fmt.block), exps.len())?;
    check_len("new exponents", exps.len(), new_exps.len())?;
    check_len("mantissas", sums.len(), mantissas.len())?;
    let max = fmt.width.max_mantissa();
    let blocks = sums.chunks(b).zip(mantissas.chunks_mut(b));
    for (((s, out), &e), ne) in blocks.zip(exps).zip(new_exps.iter_mut()) {
        if e == NON_FINITE {
            *ne = NON_FINITE;
            out.fill(0);
            continue;
        }
        let top = s.iter().map(|&v| i32::from(v).abs()).max().unwrap_or(0);
        let mut k = 0u32;
        while rne_shift(top, k) > max {
            k += 1;
        }
        let k = k.min(u32::from(NON_FINITE - 1 - e));
        *ne = e + k as u8;
        if k == 0 {
            for (o, &v) in out.iter_mut().zip(s) {
                *o = i32::from(v).clamp(-max, max) as i8;
            }
        } else {
            // rne(v / 2^k) without a branch per value (so that it vectorises): adding
            // 2^(k−1) − 1, plus 1 when the floor is odd, then shifting, rounds ties to even.
            let bias = (1i32 << (k - 1)) - 1;
            for (o, &v) in out.iter_mut().zip(s) {
                let v = i32::from(v);
                *o = ((v + bias + ((v >> k) & 1)) >> k).clamp(-max, max) as i8;
            }
        }
    }
    Ok(())
}

/// `rne(v / 2^k)`: round to nearest, ties to even, on integers.
#[inline]
fn rne_shift(v: i32, k: u32) -> i32 {
    if k == 0 {
        return v;
    }
    let q = v >> k; // floor
    let r = v - (q << k);
    let half = 1 << (k - 1);
    if r > half || (r == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// Packs `bfp4` mantissas (in `−8..=7`; [`quantize`] gives `−7..=7`) two to a byte: value `2i` in
/// the low nibble of `packed[i]`, `2i + 1` in the high one (0 past an odd end).
/// `packed.len()` must be `ceil(mantissas.len() / 2)`; values outside `−8..=7` keep their low
/// four bits.
pub fn pack4(mantissas: &[i8], packed: &mut [u8]) -> Result<(), CodecError> {
    check_len("packed", mantissas.len().div_ceil(2), packed.len())?;
    let mut pairs = mantissas.chunks_exact(2);
    for (p, pair) in packed.iter_mut().zip(&mut pairs) {
        *p = (pair[0] as u8 & 0xF) | ((pair[1] as u8) << 4);
    }
    if let ([last], Some(p)) = (pairs.remainder(), packed.last_mut()) {
        *p = *last as u8 & 0xF;
    }
    Ok(())
}

/// Unpacks what [`pack4`] packed: `mantissas.len()` values (sign-extended) from
/// `ceil(mantissas.len() / 2)` bytes of `packed`.
pub fn unpack4(packed: &[u8], mantissas: &mut [i8]) -> Result<(), CodecError> {
    check_len("packed", mantissas.len().div_ceil(2), packed.len())?;
    let mut pairs = mantissas.chunks_exact_mut(2);
    for (&p, pair) in packed.iter().zip(&mut pairs) {
        pair[0] = ((p << 4) as i8) >> 4;
        pair[1] = (p as i8) >> 4;
    }
    if let ([last], Some(&p)) = (pairs.into_remainder(), packed.last()) {
        *last = ((p << 4) as i8) >> 4;
    }
    Ok(())
}

/// Bytes of the mantissas of `n` values on the wire.
const fn mantissa_bytes(n: usize, width: Width) -> usize {
    match width {
        Width::Bfp8 => n,
        Width::Bfp4 => n.div_ceil(2),
    }
}

/// The bytes [`encode`] writes for `n` values: [`HEADER_LEN`] + `ceil(n / B)` exponents + the
/// mantissas (`n` bytes for `bfp8`, `ceil(n / 2)` for `bfp4`). Saturates at `usize::MAX` for an
/// `n` no buffer can have.
pub const fn encoded_len(n: usize, fmt: Format) -> usize {
    HEADER_LEN
        .saturating_add(block_count(n, fmt.block))
        .saturating_add(mantissa_bytes(n, fmt.width))
}

/// What an encoded buffer's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The format of the data.
    pub format: Format,
    /// The number of values.
    pub len: usize,
}

/// Reads and checks the header of an encoded buffer (and that the buffer has the length it
/// calls for).
pub fn header(encoded: &[u8]) -> Result<Header, CodecError> {
    let Some((h, _)) = encoded.split_first_chunk::<HEADER_LEN>() else {
        return Err(CodecError::Header("shorter than the header"));
    };
    if h[0] != MAGIC {
        return Err(CodecError::Header("not a BFP buffer (magic byte)"));
    }
    if h[1] != VERSION {
        return Err(CodecError::Header("unknown version"));
    }
    let width = Width::from_bits(h[2]).ok_or(CodecError::Header("mantissa width not 8 or 4"))?;
    let block =
        BlockSize::from_len(h[3]).ok_or(CodecError::Header("block size not 16, 32 or 64"))?;
    let mut n = [0u8; 8];
    n.copy_from_slice(&h[4..12]);
    let len = usize::try_from(u64::from_le_bytes(n))
        .map_err(|_| CodecError::Header("length too large"))?;
    let format = Format { width, block };
    check_len("encoded buffer", encoded_len(len, format), encoded.len())?;
    Ok(Header { format, len })
}

/// Encodes `input` into `out` (exactly [`encoded_len`]`(input.len(), fmt)` bytes): header,
/// block exponents, mantissas (see the module docs). Returns the bytes written.
pub fn encode<T: Float>(input: &[T], fmt: Format, out: &mut [u8]) -> Result<usize, CodecError> {
    let n = input.len();
    check_len("output", encoded_len(n, fmt), out.len())?;
    let b = fmt.block.values();
    let nb = block_count(n, fmt.block);
    let (h, rest) = out.split_at_mut(HEADER_LEN);
    h[0] = MAGIC;
    h[1] = VERSION;
    h[2] = fmt.width.bits() as u8;
    h[3] = b as u8;
    h[4..12].copy_from_slice(&(n as u64).to_le_bytes());
    let (exps, mant) = rest.split_at_mut(nb);
    // Chunk by chunk, so that quantising reads the input while it is still in cache.
    let mut q = [0i8; CHUNK];
    for (i, (x, e)) in input
        .chunks(CHUNK)
        .zip(exps.chunks_mut(CHUNK / b))
        .enumerate()
    {
        block_exponents(x, fmt, e)?;
        let base = i * CHUNK;
        let shift = |err| match err {
            CodecError::NonFinite { block } => CodecError::NonFinite {
                block: base / b + block,
            },
            other => other,
        };
        match fmt.width {
            Width::Bfp8 => {
                let out = bytemuck::cast_slice_mut(&mut mant[base..base + x.len()]);
                quantize(x, e, fmt, out).map_err(shift)?;
            }
            Width::Bfp4 => {
                let q = &mut q[..x.len()];
                quantize(x, e, fmt, q).map_err(shift)?;
                let start = base / 2;
                pack4(q, &mut mant[start..start + x.len().div_ceil(2)])?;
            }
        }
    }
    Ok(out.len())
}

/// Decodes a buffer [`encode`] wrote into `out`, whose length must be the header's
/// ([`header`] reads it first). Returns the header.
pub fn decode<T: Float>(encoded: &[u8], out: &mut [T]) -> Result<Header, CodecError> {
    let hdr = header(encoded)?;
    check_len("output", hdr.len, out.len())?;
    let fmt = hdr.format;
    let nb = block_count(hdr.len, fmt.block);
    let (exps, mant) = encoded[HEADER_LEN..].split_at(nb);
    match fmt.width {
        Width::Bfp8 => dequantize::<i8, T>(bytemuck::cast_slice(mant), exps, fmt, out)?,
        Width::Bfp4 => {
            let b = fmt.block.values();
            let mut q = [0i8; CHUNK];
            for (i, (o, e)) in out
                .chunks_mut(CHUNK)
                .zip(exps.chunks(CHUNK / b))
                .enumerate()
            {
                let q = &mut q[..o.len()];
                let start = i * CHUNK / 2;
                unpack4(&mant[start..start + o.len().div_ceil(2)], q)?;
                dequantize(q, e, fmt, o)?;
            }
        }
    }
    Ok(hdr)
}
