//! The caller's memory: a [`View`] of a buffer-protocol object (numpy arrays, `bytearray`,
//! `memoryview`, `array.array`), a CPU torch tensor, or a DLPack object, without copying.
//!
//! The 8-bit floats come as torch tensors (`torch.float8_e4m3fn`, `torch.float8_e5m2`), as
//! DLPack tensors of those types (DLPack 1.1's `kDLFloat8_e4m3fn`, `kDLFloat8_e5m2`), or as any
//! buffer of bytes with `dtype="f8e4m3"` / `"f8e5m2"`: numpy has no 8-bit float and the buffer
//! protocol no format for one (a `uint8` array of the codes, or an `ml_dtypes` array viewed as
//! `uint8`, works).
//!
//! A view holds what keeps the memory alive (the buffer export, the tensor, the DLPack
//! capsule) until it is dropped, so an asynchronous call can own its views while it runs.

use std::ffi::c_void;

use oxccl::DataType;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict, PyDictMethods, PyTuple};

use crate::errors;

/// What keeps a view's memory alive.
enum Keep {
    /// A buffer export (released when dropped).
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
    /// A tensor or a DLPack capsule (whose destructor calls the producer's deleter).
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// Contiguous memory of one data type, borrowed from a Python object.
pub struct View {
    ptr: *mut u8,
    len: usize,
    dtype: DataType,
    writable: bool,
    _keep: Keep,
}

// SAFETY: the pointer is into memory owned by the Python object in `_keep`, which stays
// alive (and, for buffer exports, locked against resizing) as long as the view; the view is
// only read or written during a collective call, whose caller hands it over whole.
unsafe impl Send for View {}
// SAFETY: shared references only read the pointer and length; the memory itself is accessed
// through `bytes`/`bytes_mut`, whose callers ensure exclusivity.
unsafe impl Sync for View {}

impl View {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// Elements.
    pub fn count(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// The first byte's address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Whether the memory may be written.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// The memory as bytes.
    ///
    /// # Safety
    /// No mutable slice of the same memory may be alive at the same time (the caller checks
    /// that input and output views do not overlap before making both).
    pub unsafe fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr..ptr+len` is the exporter's live memory (see `Send` above); the caller
        // guarantees no overlapping `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory as mutable bytes.
    ///
    /// # Safety
    /// No other slice of the same memory may be alive at the same time, and the view must be
    /// writable (checked by the caller when the view is made).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`; the caller guarantees exclusivity and writability.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The data type a buffer's struct-module format denotes, given its item size.
pub fn dtype_of_format(format: &str, itemsize: usize) -> Result<DataType, String> {
    let (order, code) = match format.chars().next() {
        Some(c @ ('@' | '=' | '<' | '>' | '!')) => (Some(c), &format[1..]),
        _ => (None, format),
    };
    let big = matches!(order, Some('>' | '!'));
    let dtype = match (code, itemsize) {
        ("b", 1) => DataType::I8,
        ("B" | "c", 1) => DataType::U8,
        ("i" | "l", 4) => DataType::I32,
        ("I" | "L", 4) => DataType::U32,
        ("l" | "q" | "n", 8) => DataType::I64,
        ("L" | "Q" | "N", 8) => DataType::U64,
        ("e", 2) => DataType::F16,
        ("f", 4) => DataType::F32,
        ("d", 8) => DataType::F64,
        _ => {
            return Err(format!(
                "buffer format {format:?} ({itemsize}-byte items) is not a type oxccl reduces \
                 (int8, uint8, int32, uint32, int64, uint64, float16, bfloat16, float32, float64; \
                 8-bit floats as bytes with dtype=\"f8e4m3\" or \"f8e5m2\")"
            ));
        }
    };
    if big && itemsize > 1 && cfg!(target_endian = "little") {
        return Err(format!(
            "buffer format {format:?} is big-endian; oxccl works on native-endian data"
        ));
    }
    Ok(dtype)
}

/// What torch offers, looked up once torch is imported.
struct Torch {
    tensor: Py<PyAny>,
    strided: Py<PyAny>,
    dtypes: Vec<(Py<PyAny>, DataType)>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

static SYS_MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();

fn torch(py: Python<'_>) -> Option<&Torch> {
    if let Some(t) = TORCH.get(py) {
        return Some(t);
    }
    // Only once the program has imported torch: importing it here would cost seconds. (A
    // cached `sys.modules` and a dict lookup: this runs on every call until torch comes.)
    let modules = SYS_MODULES
        .get_or_try_init(py, || -> PyResult<Py<PyDict>> {
            Ok(py
                .import("sys")?
                .getattr("modules")?
                .cast_into::<PyDict>()?
                .unbind())
        })
        .ok()?
        .bind(py);
    let torch = modules.get_item("torch").ok()??;
    let get = |name: &str| torch.getattr(name).ok().map(Bound::unbind);
    let mut dtypes = Vec::new();
    for (name, d) in [
        ("int8", DataType::I8),
        ("uint8", DataType::U8),
        ("int32", DataType::I32),
        ("uint32", DataType::U32),
        ("int64", DataType::I64),
        ("uint64", DataType::U64),
        ("float16", DataType::F16),
        ("bfloat16", DataType::Bf16),
        ("float32", DataType::F32),
        ("float64", DataType::F64),
        ("float8_e4m3fn", DataType::F8E4M3),
        ("float8_e5m2", DataType::F8E5M2),
    ] {
        if let Some(t) = get(name) {
            dtypes.push((t, d));
        }
    }
    let t = Torch {
        tensor: get("Tensor")?,
        strided: get("strided")?,
        dtypes,
    };
    Some(TORCH.get_or_init(py, || t))
}

/// What a view is wanted for (names it in errors; an output must be writable).
#[derive(Clone, Copy)]
pub struct Role<'a> {
    /// "the input", "the output", "the buffer", ...
    pub what: &'a str,
    /// Whether the call writes it.
    pub write: bool,
}

/// A view of `obj` (buffer protocol, CPU torch tensor, or DLPack), as `dtype` when given
/// (reinterpreting the bytes), else as the object's own element type.
pub fn view(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    role: Role<'_>,
    dtype: Option<DataType>,
    rank: Option<usize>,
) -> PyResult<View> {
    let bad = |msg: String| errors::invalid(py, rank, format!("{}: {msg}", role.what));
    let mut v = if let Some(t) = torch(py)
        && obj.is_instance(t.tensor.bind(py))?
    {
        tensor_view(py, obj, t, dtype).map_err(bad)?
    } else if is_buffer(obj) {
        buffer_view(obj, dtype).map_err(bad)?
    } else if obj.hasattr("__dlpack__")? {
        dlpack_view(py, obj, dtype).map_err(bad)?
    } else {
        return Err(errors::type_error(format!(
            "{}: a {} is not a buffer (numpy array, bytearray, memoryview), a CPU torch tensor \
             or a DLPack object",
            role.what,
            obj.get_type().name()?
        )));
    };
    if role.write && !v.writable {
        return Err(bad("is read-only".into()));
    }
    if let Some(d) = dtype {
        if !v.len.is_multiple_of(d.size()) {
            return Err(bad(format!(
                "{} bytes are not a whole number of {d} elements",
                v.len
            )));
        }
        v.dtype = d;
    }
    Ok(v)
}

fn is_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is a live object and we hold the GIL; PyObject_CheckBuffer only reads its
    // type's slots.
    unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) != 0 }
}

/// The element type: `wanted` (a reinterpretation of the bytes) when given, else `native`.
fn pick(native: Result<DataType, String>, wanted: Option<DataType>) -> Result<DataType, String> {
    match wanted {
        Some(d) => Ok(d),
        None => native,
    }
}

fn buffer_view(obj: &Bound<'_, PyAny>, wanted: Option<DataType>) -> Result<View, String> {
    let buf = PyUntypedBuffer::get(obj).map_err(|e| format!("cannot export its buffer: {e}"))?;
    if !buf.is_c_contiguous() {
        return Err(format!(
            "is not contiguous (shape {:?}, strides {:?}); make a contiguous copy \
             (numpy.ascontiguousarray)",
            buf.shape(),
            buf.strides()
        ));
    }
    let format = buf.format().to_string_lossy().into_owned();
    let dtype = pick(dtype_of_format(&format, buf.item_size()), wanted)?;
    Ok(View {
        ptr: buf.buf_ptr().cast(),
        len: buf.len_bytes(),
        dtype,
        writable: !buf.readonly(),
        _keep: Keep::Buffer(buf),
    })
}

fn tensor_view(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    torch: &Torch,
    wanted: Option<DataType>,
) -> Result<View, String> {
    let e = |e: PyErr| e.to_string();
    let dt = t.getattr("dtype").map_err(e)?;
    let native = torch
        .dtypes
        .iter()
        .find(|(d, _)| d.bind(py).is(&dt))
        .map(|(_, d)| *d)
        .ok_or_else(|| {
            format!(
                "dtype {dt} is not supported (oxccl reduces int8, uint8, int32, uint32, int64, \
                 uint64, float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2)"
            )
        });
    let dtype = pick(native, wanted)?;
    if !t.getattr("layout").map_err(e)?.is(torch.strided.bind(py)) {
        return Err(format!(
            "is a {} tensor; oxccl needs a dense (strided) one",
            t.getattr("layout").map_err(e)?
        ));
    }
    if !t.getattr("is_cpu").map_err(e)?.is_truthy().map_err(e)? {
        return Err(format!(
            "is on device {}; oxccl moves CPU memory (use .cpu())",
            t.getattr("device").map_err(e)?
        ));
    }
    if !t
        .call_method0("is_contiguous")
        .map_err(e)?
        .is_truthy()
        .map_err(e)?
    {
        return Err(format!(
            "is not contiguous (shape {}, strides {}); use .contiguous()",
            t.getattr("shape").map_err(e)?,
            t.call_method0("stride").map_err(e)?
        ));
    }
    let ptr: usize = t
        .call_method0("data_ptr")
        .map_err(e)?
        .extract()
        .map_err(e)?;
    let len: usize = t.getattr("nbytes").map_err(e)?.extract().map_err(e)?;
    Ok(View {
        ptr: ptr as *mut u8,
        len,
        dtype,
        writable: true,
        _keep: Keep::Object(t.clone().unbind()),
    })
}

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor` (capsule name `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// DLPack 1.x's `DLManagedTensorVersioned` (capsule name `dltensor_versioned`).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const DL_CPU: i32 = 1;
const DL_CUDA_HOST: i32 = 3;
const DL_FLAG_READ_ONLY: u64 = 1;
/// DLPack 1.1's `kDLFloat8_e4m3fn`.
const DL_FLOAT8_E4M3FN: u8 = 10;
/// DLPack 1.1's `kDLFloat8_e5m2`.
const DL_FLOAT8_E5M2: u8 = 12;

fn dl_dtype(d: &DlDataType) -> Result<DataType, String> {
    if d.lanes != 1 {
        return Err(format!(
            "DLPack vector types ({} lanes) are not supported",
            d.lanes
        ));
    }
    Ok(match (d.code, d.bits) {
        (0, 8) => DataType::I8,
        (0, 32) => DataType::I32,
        (0, 64) => DataType::I64,
        (1, 8) => DataType::U8,
        (1, 32) => DataType::U32,
        (1, 64) => DataType::U64,
        (2, 16) => DataType::F16,
        (2, 32) => DataType::F32,
        (2, 64) => DataType::F64,
        (4, 16) => DataType::Bf16,
        (DL_FLOAT8_E4M3FN, 8) => DataType::F8E4M3,
        (DL_FLOAT8_E5M2, 8) => DataType::F8E5M2,
        (code, bits) => {
            let kind = match code {
                0 => "int",
                1 => "uint",
                2 => "float",
                4 => "bfloat",
                5 => "complex",
                6 => "bool",
                // The float8/6/4 formats of DLPack 1.1 other than e4m3fn and e5m2.
                7..=17 => "low-precision float ",
                _ => "opaque",
            };
            return Err(format!(
                "DLPack dtype {kind}{bits} (code {code}) is not supported (oxccl reduces int8, uint8, int32, \
                 uint32, int64, uint64, float16, bfloat16, float32, float64, float8_e4m3fn, \
                 float8_e5m2)"
            ));
        }
    })
}

/// Pointer and byte length of a CPU, compact, row-major DLPack tensor.
///
/// # Safety
/// `t` must be a valid `DLTensor` whose `shape` (and `strides`, when not null) point to `ndim`
/// integers, as the DLPack producer guarantees while the capsule lives.
unsafe fn dl_extent(
    t: &DlTensor,
    wanted: Option<DataType>,
) -> Result<(*mut u8, usize, DataType), String> {
    if t.device.device_type != DL_CPU && t.device.device_type != DL_CUDA_HOST {
        return Err(format!(
            "is on DLPack device type {} (id {}); oxccl moves CPU memory",
            t.device.device_type, t.device.device_id
        ));
    }
    let dtype = pick(dl_dtype(&t.dtype), wanted)?;
    let bits = usize::from(t.dtype.bits) * usize::from(t.dtype.lanes);
    let ndim = usize::try_from(t.ndim).map_err(|_| "a negative ndim".to_string())?;
    // SAFETY: per this function's contract, `shape` holds `ndim` values.
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let mut count = 1usize;
    for &s in shape {
        count = count
            .checked_mul(usize::try_from(s).map_err(|_| format!("a negative extent {s}"))?)
            .ok_or("its size overflows")?;
    }
    if !t.strides.is_null() && count > 1 {
        // SAFETY: per this function's contract, non-null `strides` holds `ndim` values.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want = 1i64;
        for (&s, &st) in shape.iter().zip(strides).rev() {
            if s != 1 && st != want {
                return Err(format!(
                    "is not contiguous (shape {shape:?}, strides {strides:?} in elements); \
                     make a contiguous copy"
                ));
            }
            want *= s;
        }
    }
    let bytes = (count * bits).div_ceil(8);
    let ptr = if t.data.is_null() {
        std::ptr::NonNull::<u8>::dangling().as_ptr()
    } else {
        // SAFETY: `byte_offset` is inside the producer's allocation by the DLPack contract.
        unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) }
    };
    Ok((ptr, bytes, dtype))
}

fn dlpack_view(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    wanted: Option<DataType>,
) -> Result<View, String> {
    let e = |e: PyErr| format!("__dlpack__ failed: {e}");
    let kwargs = PyDict::new(py);
    kwargs
        .set_item("max_version", PyTuple::new(py, [1, 0]).map_err(e)?)
        .map_err(e)?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(err) if err.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => {
            obj.call_method0("__dlpack__").map_err(e)?
        }
        Err(err) => return Err(e(err)),
    };
    let cap = capsule
        .cast::<PyCapsule>()
        .map_err(|_| "__dlpack__ did not return a capsule".to_string())?;
    let (ptr, len, dtype, writable) = if cap.is_valid_checked(Some(c"dltensor_versioned")) {
        let p = cap
            .pointer_checked(Some(c"dltensor_versioned"))
            .map_err(|e| e.to_string())?;
        // SAFETY: a capsule named `dltensor_versioned` holds a `DLManagedTensorVersioned`,
        // valid until the capsule's destructor runs; we keep the capsule alive in the view.
        let m = unsafe { &*p.as_ptr().cast::<DlManagedTensorVersioned>() };
        if m.version[0] != 1 {
            return Err(format!(
                "DLPack version {}.{} is not supported (1.x or 0.x)",
                m.version[0], m.version[1]
            ));
        }
        // SAFETY: the producer's tensor description, valid while the capsule lives.
        let (ptr, len, dtype) = unsafe { dl_extent(&m.dl_tensor, wanted)? };
        (ptr, len, dtype, m.flags & DL_FLAG_READ_ONLY == 0)
    } else if cap.is_valid_checked(Some(c"dltensor")) {
        let p = cap
            .pointer_checked(Some(c"dltensor"))
            .map_err(|e| e.to_string())?;
        // SAFETY: a capsule named `dltensor` holds a `DLManagedTensor`, valid until its
        // destructor runs; we keep the capsule alive in the view.
        let m = unsafe { &*p.as_ptr().cast::<DlManagedTensor>() };
        // SAFETY: as above.
        let (ptr, len, dtype) = unsafe { dl_extent(&m.dl_tensor, wanted)? };
        (ptr, len, dtype, true)
    } else {
        return Err(
            "__dlpack__ returned a capsule that is neither `dltensor` nor \
                    `dltensor_versioned` (already consumed?)"
                .into(),
        );
    };
    // The capsule is not renamed to `used_dltensor`: its own destructor then calls the
    // producer's deleter when the view drops it, which is what a consumer that is done owes.
    Ok(View {
        ptr,
        len,
        dtype,
        writable,
        _keep: Keep::Object(capsule.unbind()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_map_to_types_and_bad_ones_are_named() {
        assert_eq!(dtype_of_format("f", 4), Ok(DataType::F32));
        assert_eq!(dtype_of_format("<d", 8), Ok(DataType::F64));
        assert_eq!(dtype_of_format("l", 8), Ok(DataType::I64));
        assert_eq!(dtype_of_format("L", 8), Ok(DataType::U64));
        assert_eq!(dtype_of_format("B", 1), Ok(DataType::U8));
        assert_eq!(dtype_of_format("e", 2), Ok(DataType::F16));
        let e = dtype_of_format("h", 2).unwrap_err();
        assert!(e.contains("\"h\"") && e.contains("2-byte"), "{e}");
        assert!(dtype_of_format("?", 1).is_err());
        assert!(dtype_of_format(">f", 4).unwrap_err().contains("big-endian"));
        assert_eq!(dtype_of_format(">b", 1), Ok(DataType::I8));
    }

    #[test]
    fn dlpack_types_and_strides_are_checked() {
        let d = |code, bits, lanes| DlDataType { code, bits, lanes };
        assert_eq!(dl_dtype(&d(4, 16, 1)), Ok(DataType::Bf16));
        assert_eq!(dl_dtype(&d(1, 64, 1)), Ok(DataType::U64));
        assert!(dl_dtype(&d(6, 8, 1)).unwrap_err().contains("bool8"));
        assert_eq!(dl_dtype(&d(10, 8, 1)), Ok(DataType::F8E4M3));
        assert_eq!(dl_dtype(&d(12, 8, 1)), Ok(DataType::F8E5M2));
        // e4m3fnuz and e5m2fnuz are other formats (no negative zero, other bias).
        let e = dl_dtype(&d(11, 8, 1)).unwrap_err();
        assert!(e.contains("code 11"), "{e}");
        assert!(dl_dtype(&d(13, 8, 1)).is_err());
        assert!(dl_dtype(&d(2, 32, 4)).unwrap_err().contains("4 lanes"));
        let mut data = [0f32; 6];
        let mut shape = [2i64, 3];
        let mut strides = [3i64, 1];
        let mut t = DlTensor {
            data: data.as_mut_ptr().cast(),
            device: DlDevice {
                device_type: DL_CPU,
                device_id: 0,
            },
            ndim: 2,
            dtype: d(2, 32, 1),
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 4,
        };
        // SAFETY: shape and strides hold ndim values and outlive the calls.
        let (p, len, dt) = unsafe { dl_extent(&t, None) }.unwrap();
        assert_eq!(
            (p as usize - data.as_ptr() as usize, len, dt),
            (4, 24, DataType::F32)
        );
        strides = [1, 2];
        t.strides = strides.as_mut_ptr();
        // SAFETY: as above.
        assert!(
            unsafe { dl_extent(&t, None) }
                .unwrap_err()
                .contains("not contiguous")
        );
        t.device.device_type = 2;
        // SAFETY: as above.
        assert!(
            unsafe { dl_extent(&t, None) }
                .unwrap_err()
                .contains("device type 2")
        );
    }
}
