//! Running a call on Python buffers (their layout, the views kept alive while it flies, a
//! batch of point-to-point calls, the compressed all-reduce and reduce-scatter) and parsing
//! the arguments every call shares.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use oxccl::compress::Format;
use oxccl::schedule::Collective;
use oxccl::{Buffers, CallBuffers, Communicator, DataType, Options, ReduceOp};
use pyo3::prelude::*;

use crate::PyReduceOp;
use crate::buffer::View;
use crate::errors;

/// Where a call's views go.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Layout {
    /// No buffers (barrier).
    Empty,
    /// One buffer, `views[0]`.
    InPlace,
    /// Separate buffers: the input (when present) is `views[0]`, then the output.
    Out { input: bool, output: bool },
}

/// A call that does not block, with the views it owns while it flies.
pub(crate) struct Flying {
    pub(crate) views: Vec<View>,
    pub(crate) layout: Layout,
    pub(crate) dtype: DataType,
}

impl CallBuffers for Flying {
    fn dtype(&self) -> DataType {
        self.dtype
    }

    fn elements(&self) -> usize {
        self.views
            .first()
            .map_or(0, |v| v.len() / self.dtype.size())
    }

    fn buffers(&mut self) -> Buffers<'_> {
        buffers(self.layout, &self.views)
    }
}

/// The buffers of a call on `views` laid out as `layout`.
pub(crate) fn buffers(layout: Layout, views: &[View]) -> Buffers<'_> {
    // SAFETY (every slice below): the views are alive while the buffers are (they borrow
    // them); `check_overlap` refused out-of-place views that share memory, so the input slice
    // and the output slice do not alias; outputs were checked writable when their views were
    // made.
    match layout {
        Layout::Empty => Buffers::OutOfPlace {
            input: &[],
            output: &mut [],
        },
        Layout::InPlace => Buffers::InPlace(unsafe { views[0].bytes_mut() }),
        Layout::Out { input, output } => {
            let (i, rest) = if input {
                (unsafe { views[0].bytes() }, &views[1..])
            } else {
                (&[][..], views)
            };
            let o: &mut [u8] = if output {
                unsafe { rest[0].bytes_mut() }
            } else {
                &mut []
            };
            Buffers::OutOfPlace {
                input: i,
                output: o,
            }
        }
    }
}

/// Runs one collective on `views`.
pub(crate) fn run_views(
    c: &Communicator,
    coll: &Collective,
    dtype: DataType,
    op: ReduceOp,
    layout: Layout,
    views: &[View],
    timeout: Option<Duration>,
) -> oxccl::Result<()> {
    let bufs = buffers(layout, views);
    match timeout {
        Some(t) => c.run_timeout(coll, dtype, op, bufs, t),
        None => c.run(coll, dtype, op, bufs),
    }
}

/// Runs the sends (`true`) and receives of a batch as one group ([`Communicator::group`]).
pub(crate) fn run_batch(
    c: &Communicator,
    ops: &[(bool, usize)],
    views: &[View],
    timeout: Option<Duration>,
) -> oxccl::Result<()> {
    let mut g = c.group();
    for (&(send, peer), v) in ops.iter().zip(views) {
        let count = v.count();
        // SAFETY: the views outlive the group (it ends below); `PyCommunicator::batch`
        // refused a receive's buffer that shares memory with any other buffer of the batch,
        // so no slice handed out here aliases a mutable one.
        let (coll, bufs) = if send {
            let input = unsafe { v.bytes() };
            (
                Collective::Send { count, peer },
                Buffers::OutOfPlace {
                    input,
                    output: &mut [],
                },
            )
        } else {
            let output = unsafe { v.bytes_mut() };
            (
                Collective::Recv { count, peer },
                Buffers::OutOfPlace { input: &[], output },
            )
        };
        g.run(&coll, v.dtype(), ReduceOp::Sum, bufs)?;
    }
    match timeout {
        Some(t) => g.end_timeout(t),
        None => g.end(),
    }
}

/// A `compress=` value: `None`, `"off"` or `"none"` for none, else a BFP format's name.
pub(crate) fn parse_compress(s: Option<&str>) -> PyResult<Option<Format>> {
    match s {
        None | Some("off") | Some("none") => Ok(None),
        Some(s) => s.parse().map(Some).map_err(|e| {
            errors::value_error(format!(
                "compress={s:?}: {e}; or \"off\" (bfp8, bfp4, bfp8/16, bfp4/64, ...)"
            ))
        }),
    }
}

/// A compressed call's kind: an all-reduce in place (views: the tensor, then the residual if
/// any) or a reduce-scatter (views: input, output, then the residual if any).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Squeezed {
    AllReduce,
    ReduceScatter,
}

/// Whether two views share a byte.
pub(crate) fn overlap(a: &View, b: &View) -> bool {
    !a.is_empty() && !b.is_empty() && a.addr() < b.addr() + b.len() && b.addr() < a.addr() + a.len()
}

/// Runs a compressed call on its views (see [`Squeezed`]).
pub(crate) fn run_compressed(
    c: &Communicator,
    kind: Squeezed,
    views: &[View],
    dtype: DataType,
    fmt: Format,
    op: ReduceOp,
) -> oxccl::Result<()> {
    // SAFETY: the views are this call's own, those written to writable (checked when they
    // were made), none overlapping one written to (checked by `compressed`), and alive until
    // it returns.
    unsafe {
        match kind {
            Squeezed::AllReduce => {
                let res = views.get(1).map(|r| r.bytes_mut());
                c.all_reduce_compressed_bytes_with(views[0].bytes_mut(), res, dtype, fmt, op)
            }
            Squeezed::ReduceScatter => {
                let (input, output) = (views[0].bytes(), views[1].bytes_mut());
                let res = views.get(2).map(|r| r.bytes_mut());
                c.reduce_scatter_compressed_bytes(input, output, res, dtype, fmt, op)
            }
        }
    }
}

pub(crate) fn parse_op(op: Option<&Bound<'_, PyAny>>) -> PyResult<ReduceOp> {
    let Some(op) = op else {
        return Ok(ReduceOp::Sum);
    };
    if let Ok(o) = op.extract::<PyReduceOp>() {
        return Ok(o.into());
    }
    if let Ok(s) = op.extract::<String>() {
        return ReduceOp::from_str(&s.to_ascii_lowercase())
            .map_err(|e| errors::value_error(format!("op={s:?}: {e} (sum, prod, min, max, avg)")));
    }
    Err(errors::type_error(format!(
        "op must be an oxccl.ReduceOp or a string (sum, prod, min, max, avg), not {}",
        op.get_type().name()?
    )))
}

pub(crate) fn parse_dtype(dtype: Option<&str>) -> PyResult<Option<DataType>> {
    dtype
        .map(|d| {
            DataType::from_str(d).map_err(|e| errors::value_error(format!("dtype={d:?}: {e}")))
        })
        .transpose()
}

pub(crate) fn parse_timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(errors::value_error(format!(
            "timeout={s}: expected a positive number of seconds"
        ))),
    }
}

/// A constructor's `options=` (checked: `OXCCL_*` names only; none given is empty).
pub(crate) fn check_options(
    options: Option<HashMap<String, String>>,
) -> PyResult<HashMap<String, String>> {
    let options = options.unwrap_or_default();
    if let Some(k) = options.keys().find(|k| !k.starts_with("OXCCL_")) {
        return Err(errors::value_error(format!(
            "options: {k:?} is not an OXCCL_* setting"
        )));
    }
    Ok(options)
}

/// The communicator's [`Options`]: `options` over the environment, and `timeout` over both.
pub(crate) fn options_with(
    options: &HashMap<String, String>,
    timeout: Option<Duration>,
) -> oxccl::Result<Options> {
    let mut opts =
        Options::from_vars(&|k| options.get(k).cloned().or_else(|| std::env::var(k).ok()))?;
    if let Some(t) = timeout {
        opts.timeout = t;
    }
    Ok(opts)
}
