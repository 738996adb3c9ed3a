//! Element types and reduction operators, and the [`Element`] trait that ties a Rust type to its
//! [`DataType`].
//!
//! Names follow nccl-tests (`int8 ... double`, `f8e4m3`, `f8e5m2`, `sum ... avg`); parsing also
//! takes the Rust names (`i8 ... f64`), NCCL's aliases (`char`, `int`, `uint`, `fp16`, `fp32`,
//! `fp64`, ...) and, for the 8-bit floats, `e4m3`/`e5m2` and torch's names.
//!
//! ## 8-bit floats and the error of a sum
//!
//! [`DataType::F8E4M3`] and [`DataType::F8E5M2`] (see [`crate::fp8`]) are reduced like `f16`
//! and `bf16`: each step widens both operands to `f32`, combines them there and rounds the
//! result back to the 8-bit type once, to nearest even, when it stores it. The sum of two fp8
//! values is exact in `f32`, so each step rounds exactly once. A sum over `n` ranks therefore
//! rounds once per addition on the path of each input to the result; call the largest number
//! of roundings on any path `k`:
//!
//! | algorithm (all-reduce) | k |
//! | --- | --- |
//! | ring (reduce-scatter along the ring) | n − 1 |
//! | direct (every rank sums all inputs in rank order) | n − 1 |
//! | proportional (direct reduce-scatter) | n − 1 |
//! | hierarchical (L ranks on each of H hosts) | (L − 1) + (H − 1) ≤ n − 1 |
//! | recursive doubling (extra ranks fold in first) | ⌈log2 n⌉ |
//!
//! (reduce: binomial tree or chain, k ≤ n − 1; reduce-scatter as the ring.) Each rounding
//! of a value `a` gives `a(1 + δ) + η` with `|δ| ≤ u` and, only below the smallest normal,
//! `|η| ≤ s/2`, where `u` is the unit roundoff (2^-4 for e4m3, 2^-3 for e5m2) and `s` the
//! smallest subnormal (2^-9, 2^-16). Following the errors along the `n − 1` additions gives,
//! for inputs `x_i` whose exact sum and partial sums stay within the finite range (no
//! saturation, no overflow to ∞):
//!
//! ```text
//! |computed − Σ x_i| ≤ ((1 + u)^k − 1) · Σ |x_i|  +  (n − 1) · (1 + u)^k · s/2
//! ```
//!
//! which is `k·u·Σ|x_i|` to first order: with `k = 7` (8 ranks on a ring) up to ≈ 0.57 of
//! `Σ|x_i|` for e4m3 and ≈ 1.4 for e5m2 (cancelling inputs make it large relative to the sum
//! itself), and with recursive doubling (`k = 3`) ≈ 0.20 and 0.42. `avg` rounds once more when
//! it divides. `min`, `max` are exact, and `prod` rounds once per step like `sum` (relative
//! error `(1 + u)^k − 1` while in the normal range). The property test
//! `crates/oxccl/tests/fp8.rs` checks this bound on 8 ranks for every all-reduce algorithm.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::fp8::{F8E4M3, F8E5M2};

/// The element type of a buffer taking part in a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DataType {
    /// Signed 8-bit integer (`int8`).
    I8,
    /// Unsigned 8-bit integer (`uint8`).
    U8,
    /// Signed 32-bit integer (`int32`).
    I32,
    /// Unsigned 32-bit integer (`uint32`).
    U32,
    /// Signed 64-bit integer (`int64`).
    I64,
    /// Unsigned 64-bit integer (`uint64`).
    U64,
    /// IEEE 754 binary16 (`half`).
    F16,
    /// bfloat16 (`bfloat16`).
    Bf16,
    /// IEEE 754 binary32 (`float`).
    F32,
    /// IEEE 754 binary64 (`double`).
    F64,
    /// 8-bit float, 4 exponent and 3 mantissa bits, no infinities (`f8e4m3`; torch's
    /// `float8_e4m3fn`; see [`crate::fp8::F8E4M3`]).
    F8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits, IEEE-like (`f8e5m2`; torch's
    /// `float8_e5m2`; see [`crate::fp8::F8E5M2`]).
    F8E5M2,
}

impl DataType {
    /// This type's place in [`DataType::ALL`] (its wire code).
    pub const fn index(self) -> u8 {
        self as u8
    }

    /// Every data type, in declaration order.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// The nccl-tests name: `int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double
    /// f8e4m3 f8e5m2`.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::F8E4M3 => "f8e4m3",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    /// Whether this is a floating-point type (`half`, `bfloat16`, `float`, `double`,
    /// `f8e4m3`, `f8e5m2`).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16
                | DataType::Bf16
                | DataType::F32
                | DataType::F64
                | DataType::F8E4M3
                | DataType::F8E5M2
        )
    }

    /// For floating-point types, the unit roundoff of rounding to nearest (half the distance
    /// from 1 to the next value: 2^-11 for `half`, 2^-8 `bfloat16`, 2^-24 `float`, 2^-53
    /// `double`, 2^-4 `f8e4m3`, 2^-3 `f8e5m2`); `None` for integers. See the module docs for
    /// the error of a sum.
    pub const fn unit_roundoff(self) -> Option<f64> {
        let digits = match self {
            DataType::F16 => 11,
            DataType::Bf16 => 8,
            DataType::F32 => 24,
            DataType::F64 => 53,
            DataType::F8E4M3 => 4,
            DataType::F8E5M2 => 3,
            _ => return None,
        };
        Some(1.0 / (1u64 << digits) as f64)
    }

    /// Every name [`FromStr`] accepts for this type, the nccl-tests name first.
    const fn names(self) -> &'static [&'static str] {
        match self {
            DataType::I8 => &["int8", "i8", "char"],
            DataType::U8 => &["uint8", "u8"],
            DataType::I32 => &["int32", "i32", "int"],
            DataType::U32 => &["uint32", "u32", "uint"],
            DataType::I64 => &["int64", "i64"],
            DataType::U64 => &["uint64", "u64"],
            DataType::F16 => &["half", "f16", "fp16", "float16"],
            DataType::Bf16 => &["bfloat16", "bf16"],
            DataType::F32 => &["float", "f32", "fp32", "float32"],
            DataType::F64 => &["double", "f64", "fp64", "float64"],
            DataType::F8E4M3 => &["f8e4m3", "e4m3", "fp8e4m3", "float8_e4m3fn"],
            DataType::F8E5M2 => &["f8e5m2", "e5m2", "fp8e5m2", "float8_e5m2"],
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for DataType {
    type Err = ParseNameError;

    /// Parses a name, ignoring ASCII case and surrounding whitespace: the nccl-tests names,
    /// the Rust names and the aliases `char`, `int`, `uint`, `fp16`/`float16`,
    /// `fp32`/`float32`, `fp64`/`float64`, `e4m3`/`fp8e4m3`/`float8_e4m3fn`,
    /// `e5m2`/`fp8e5m2`/`float8_e5m2`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("data type", s, &DataType::ALL, DataType::names)
    }
}

/// The reduction applied by reducing collectives (all-reduce, reduce, reduce-scatter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean: the sum divided by the number of ranks (integers: truncated toward zero).
    Avg,
}

impl ReduceOp {
    /// This operator's place in [`ReduceOp::ALL`] (its wire code).
    pub const fn index(self) -> u8 {
        self as u8
    }

    /// Every operator, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The nccl-tests name: `sum prod min max avg`.
    pub const fn name(self) -> &'static str {
        self.names()[0]
    }

    /// Every name [`FromStr`] accepts for this operator (only its name).
    const fn names(self) -> &'static [&'static str] {
        match self {
            ReduceOp::Sum => &["sum"],
            ReduceOp::Prod => &["prod"],
            ReduceOp::Min => &["min"],
            ReduceOp::Max => &["max"],
            ReduceOp::Avg => &["avg"],
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = ParseNameError;

    /// Parses `sum prod min max avg`, ignoring ASCII case and surrounding whitespace.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("reduction operator", s, &ReduceOp::ALL, ReduceOp::names)
    }
}

/// The error of parsing a [`DataType`], a [`ReduceOp`] or a
/// [`CollectiveKind`](crate::schedule::CollectiveKind) from an unknown name; its message lists
/// the accepted names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseNameError {
    what: &'static str,
    input: String,
    accepted: String,
}

/// The one of `all` that `s` names (one of its `names`, ignoring ASCII case and surrounding
/// whitespace), or else the error of parsing a `what` (`data type`, `collective`, ...), which
/// lists every value's names, the first one outside parentheses: `int8 (i8, char), uint8 ...`.
pub(crate) fn parse_name<T: Copy>(
    what: &'static str,
    s: &str,
    all: &[T],
    names: fn(T) -> &'static [&'static str],
) -> Result<T, ParseNameError> {
    let t = s.trim();
    let named = |v: &&T| names(**v).iter().any(|n| n.eq_ignore_ascii_case(t));
    all.iter().find(named).copied().ok_or_else(|| {
        let accepted: Vec<String> = all
            .iter()
            .map(|&v| match names(v) {
                [first, rest @ ..] if !rest.is_empty() => format!("{first} ({})", rest.join(", ")),
                names => names.join(", "),
            })
            .collect();
        ParseNameError {
            what,
            input: s.to_owned(),
            accepted: accepted.join(", "),
        }
    })
}

impl fmt::Display for ParseNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?}; accepted: {}",
            self.what, self.input, self.accepted
        )
    }
}

impl std::error::Error for ParseNameError {}

mod private {
    /// Seals [`super::Element`]: only the types of this module implement it.
    pub trait Sealed {}
}

/// A Rust type that is the element of one [`DataType`]; sealed, implemented for `i8`, `u8`,
/// `i32`, `u32`, `i64`, `u64`, [`half::f16`], [`half::bf16`], `f32`, `f64`, [`F8E4M3`] and
/// [`F8E5M2`].
pub trait Element:
    bytemuck::Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static + private::Sealed
{
    /// The data type of this element type.
    const DTYPE: DataType;

    /// Converts from `f64`: integers take `as` semantics (rounded toward zero, saturating at the
    /// type's bounds, NaN gives 0); floats round to nearest.
    fn from_f64(v: f64) -> Self;

    /// Converts to `f64` (exact except for 64-bit integers beyond 2^53, which round to nearest).
    fn to_f64(self) -> f64;
}

macro_rules! element_as {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}

element_as!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64, f32 => F32, f64 => F64);

macro_rules! element_half {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    )*};
}

element_half!(f16 => F16, bf16 => Bf16, F8E4M3 => F8E4M3, F8E5M2 => F8E5M2);

/// Views a slice of elements as its bytes (native byte order).
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a mutable slice of elements as its bytes (native byte order).
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_are_places_in_all() {
        for (i, d) in DataType::ALL.iter().enumerate() {
            assert_eq!(d.index() as usize, i, "{d}");
        }
        for (i, o) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!(o.index() as usize, i, "{o}");
        }
    }

    fn check_element<T: Element>(size: usize, float: bool) {
        assert_eq!(T::DTYPE.size(), size);
        assert_eq!(std::mem::size_of::<T>(), size);
        assert_eq!(T::DTYPE.is_float(), float);
        assert_eq!(T::from_f64(3.0).to_f64(), 3.0);
        assert_eq!(T::from_f64(96.0).to_f64(), 96.0);
    }

    #[test]
    fn elements_match_their_data_types() {
        check_element::<i8>(1, false);
        check_element::<u8>(1, false);
        check_element::<i32>(4, false);
        check_element::<u32>(4, false);
        check_element::<i64>(8, false);
        check_element::<u64>(8, false);
        check_element::<f16>(2, true);
        check_element::<bf16>(2, true);
        check_element::<f32>(4, true);
        check_element::<f64>(8, true);
        check_element::<F8E4M3>(1, true);
        check_element::<F8E5M2>(1, true);
        let dtypes = [
            i8::DTYPE,
            u8::DTYPE,
            i32::DTYPE,
            u32::DTYPE,
            i64::DTYPE,
            u64::DTYPE,
            f16::DTYPE,
            bf16::DTYPE,
            f32::DTYPE,
            f64::DTYPE,
            F8E4M3::DTYPE,
            F8E5M2::DTYPE,
        ];
        assert_eq!(dtypes, DataType::ALL);
    }

    #[test]
    fn from_f64_saturates_integers_and_rounds_floats() {
        assert_eq!(i8::from_f64(300.0), 127);
        assert_eq!(i8::from_f64(-300.0), -128);
        assert_eq!(u8::from_f64(-1.0), 0);
        assert_eq!(u8::from_f64(2.9), 2);
        assert_eq!(i32::from_f64(-2.9), -2);
        assert_eq!(u64::from_f64(f64::NAN), 0);
        assert_eq!(i64::from_f64(1e300), i64::MAX);
        assert_eq!(f16::from_f64(1e6), f16::INFINITY);
        assert_eq!(f16::from_f64(0.1).to_f64(), f16::from_f32(0.1).to_f64());
        assert_eq!(bf16::from_f64(1.0 / 3.0), bf16::from_f32(1.0 / 3.0));
        assert_eq!(F8E4M3::from_f64(1e6).to_f64(), 448.0);
        assert_eq!(F8E5M2::from_f64(1e6).to_f64(), f64::INFINITY);
        assert_eq!(F8E4M3::from_f64(1.0 / 3.0).to_f64(), 0.34375);
        assert_eq!(F8E5M2::from_f64(1.0 / 3.0).to_f64(), 0.3125);
        assert_eq!(f32::from_f64(0.1), 0.1f32);
        assert!(f64::from_f64(f64::NAN).to_f64().is_nan());
    }

    #[test]
    fn names_and_sizes() {
        let names: Vec<_> = DataType::ALL.iter().map(|d| d.name()).collect();
        assert_eq!(
            names,
            [
                "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "bfloat16", "float",
                "double", "f8e4m3", "f8e5m2"
            ]
        );
        let sizes: Vec<_> = DataType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [1, 1, 4, 4, 8, 8, 2, 2, 4, 8, 1, 1]);
        // The wire codes of the types that came before the 8-bit floats did not move.
        let codes: Vec<_> = DataType::ALL.iter().map(|d| d.index()).collect();
        assert_eq!(codes, (0..12).collect::<Vec<u8>>());
        assert_eq!(DataType::F64.index(), 9);
        assert_eq!(DataType::F8E4M3.index(), 10);
        assert_eq!(DataType::F8E5M2.index(), 11);
        let ops: Vec<_> = ReduceOp::ALL.iter().map(|o| o.to_string()).collect();
        assert_eq!(ops, ["sum", "prod", "min", "max", "avg"]);
        assert_eq!(DataType::Bf16.to_string(), "bfloat16");
        assert_eq!(format!("{:>6}", DataType::F32), " float");
    }

    #[test]
    fn data_type_parses_every_name_and_alias() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>(), Ok(d));
            assert_eq!(d.to_string().parse::<DataType>(), Ok(d));
            assert_eq!(d.name().to_uppercase().parse::<DataType>(), Ok(d));
        }
        let rust = [
            "i8", "u8", "i32", "u32", "i64", "u64", "f16", "bf16", "f32", "f64", "e4m3", "e5m2",
        ];
        for (name, d) in rust.into_iter().zip(DataType::ALL) {
            assert_eq!(name.parse::<DataType>(), Ok(d), "{name}");
        }
        for (name, d) in [
            ("char", DataType::I8),
            ("int", DataType::I32),
            ("uint", DataType::U32),
            ("fp16", DataType::F16),
            ("float16", DataType::F16),
            ("fp32", DataType::F32),
            ("float32", DataType::F32),
            ("fp64", DataType::F64),
            ("float64", DataType::F64),
            (" double\n", DataType::F64),
            ("F8E4M3", DataType::F8E4M3),
            ("fp8e4m3", DataType::F8E4M3),
            ("float8_e4m3fn", DataType::F8E4M3),
            ("fp8e5m2", DataType::F8E5M2),
            ("float8_e5m2", DataType::F8E5M2),
            ("E5M2", DataType::F8E5M2),
        ] {
            assert_eq!(name.parse::<DataType>(), Ok(d), "{name}");
        }
    }

    #[test]
    fn data_type_parse_error_lists_accepted_names() {
        let err = "int16".parse::<DataType>().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("unknown data type \"int16\"; accepted: "),
            "{msg}"
        );
        for d in DataType::ALL {
            for n in d.names() {
                assert!(msg.contains(n), "{msg} lacks {n}");
            }
        }
        assert!(msg.contains("half (f16, fp16, float16)"), "{msg}");
        assert!(msg.contains("uint64 (u64)"), "{msg}");
        assert!(
            msg.contains("f8e4m3 (e4m3, fp8e4m3, float8_e4m3fn)"),
            "{msg}"
        );
        assert!("e4m3fnuz".parse::<DataType>().is_err());
        assert!("".parse::<DataType>().is_err());
        assert!("all".parse::<DataType>().is_err());
    }

    #[test]
    fn unit_roundoffs() {
        for d in DataType::ALL {
            let u = d.unit_roundoff();
            assert_eq!(u.is_some(), d.is_float(), "{d}");
        }
        assert_eq!(
            DataType::F32.unit_roundoff(),
            Some(f32::EPSILON as f64 / 2.0)
        );
        assert_eq!(DataType::F64.unit_roundoff(), Some(f64::EPSILON / 2.0));
        assert_eq!(
            DataType::F8E4M3.unit_roundoff(),
            Some(F8E4M3::UNIT_ROUNDOFF)
        );
        assert_eq!(
            DataType::F8E5M2.unit_roundoff(),
            Some(F8E5M2::UNIT_ROUNDOFF)
        );
        assert_eq!(DataType::F8E4M3.unit_roundoff(), Some(1.0 / 16.0));
    }

    #[test]
    fn reduce_op_round_trips_and_errors() {
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>(), Ok(o));
            assert_eq!(o.to_string().to_uppercase().parse::<ReduceOp>(), Ok(o));
        }
        let msg = "mean".parse::<ReduceOp>().unwrap_err().to_string();
        assert_eq!(
            msg,
            "unknown reduction operator \"mean\"; accepted: sum, prod, min, max, avg"
        );
    }

    #[test]
    fn serde_round_trip() {
        for d in DataType::ALL {
            let s = serde_json::to_string(&d).unwrap();
            assert_eq!(serde_json::from_str::<DataType>(&s).unwrap(), d);
        }
        for o in ReduceOp::ALL {
            let s = serde_json::to_string(&o).unwrap();
            assert_eq!(serde_json::from_str::<ReduceOp>(&s).unwrap(), o);
        }
    }

    #[test]
    fn byte_views() {
        let mut v = [1u32, 0x0403_0201];
        assert_eq!(as_bytes(&v).len(), 8);
        assert_eq!(&as_bytes(&v)[4..], &0x0403_0201u32.to_ne_bytes());
        as_bytes_mut(&mut v)[..4].copy_from_slice(&7u32.to_ne_bytes());
        assert_eq!(v[0], 7);
        let h = [f16::ONE, f16::NEG_ONE];
        assert_eq!(
            as_bytes(&h),
            bytemuck::cast_slice::<u16, u8>(&[0x3c00, 0xbc00])
        );
        let e: [f64; 0] = [];
        assert!(as_bytes(&e).is_empty());
    }
}
