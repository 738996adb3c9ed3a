//! Element types and reduction operators, and the [`Element`] trait that ties a Rust type to its
//! [`DataType`].
//!
//! Names follow nccl-tests (`int8 ... double`, `sum ... avg`); parsing also takes the Rust names
//! (`i8 ... f64`) and NCCL's aliases (`char`, `int`, `uint`, `fp16`, `fp32`, `fp64`, ...).

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

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
}

impl DataType {
    /// This type's place in [`DataType::ALL`] (its wire code).
    pub const fn index(self) -> u8 {
        self as u8
    }

    /// Every data type, in declaration order.
    pub const ALL: [DataType; 10] = [
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
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// The nccl-tests name: `int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double`.
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
        }
    }

    /// Whether this is a floating-point type (`half`, `bfloat16`, `float`, `double`).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64
        )
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
    /// `fp32`/`float32`, `fp64`/`float64`.
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
/// `i32`, `u32`, `i64`, `u64`, [`half::f16`], [`half::bf16`], `f32` and `f64`.
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

element_half!(f16 => F16, bf16 => Bf16);

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
        assert_eq!(T::from_f64(100.0).to_f64(), 100.0);
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
                "double"
            ]
        );
        let sizes: Vec<_> = DataType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [1, 1, 4, 4, 8, 8, 2, 2, 4, 8]);
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
            "i8", "u8", "i32", "u32", "i64", "u64", "f16", "bf16", "f32", "f64",
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
        assert!("".parse::<DataType>().is_err());
        assert!("all".parse::<DataType>().is_err());
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
