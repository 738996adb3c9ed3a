//! [`PyCommunicator`] (`oxccl.Communicator`): joining a job, and every collective on Python
//! buffers.
//!
//! Conventions, the same for every call: the input comes first; leaving the output out runs
//! the call in place (the one buffer laid out as NCCL's in-place calls want: all-gather's input
//! is this rank's block of it, reduce-scatter's result is this rank's block); element counts
//! come from the buffers' sizes; `async_op=True` returns an `oxccl.Work`, otherwise the call
//! blocks (with the GIL released) and returns the output object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oxccl::compress::Format;
use oxccl::schedule::Collective;
use oxccl::{Communicator, DataType, Options, ReduceOp};
use oxccl_bootstrap::Bootstrap;
use pyo3::prelude::*;

use crate::buffer::{Role, View, view};
use crate::calls::*;
use crate::errors;
pub use crate::registration::PyRegistration;
use crate::store::PyStore;
use crate::work::{PyWork, Shared};

/// One call being prepared: its views, layout and output object.
struct Prepared {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    layout: Layout,
    views: Vec<View>,
    output: Option<Py<PyAny>>,
}

/// A group of ranks that run collectives together (`oxccl.Communicator`).
#[pyclass(frozen, module = "oxccl._oxccl", name = "Communicator")]
pub struct PyCommunicator {
    comm: Mutex<Option<Arc<Communicator>>>,
    rank: usize,
    world: usize,
}

impl PyCommunicator {
    pub(crate) fn wrap(c: Communicator) -> PyCommunicator {
        PyCommunicator {
            rank: c.rank(),
            world: c.world_size(),
            comm: Mutex::new(Some(Arc::new(c))),
        }
    }

    fn get(&self, py: Python<'_>) -> PyResult<Arc<Communicator>> {
        self.comm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                errors::make(
                    py,
                    errors::Kind::Error,
                    format!("rank {}: the communicator was destroyed", self.rank),
                    Some(self.rank),
                    None,
                )
            })
    }

    fn view(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        what: &str,
        write: bool,
        dtype: Option<DataType>,
    ) -> PyResult<View> {
        view(py, obj, Role { what, write }, dtype, Some(self.rank))
    }

    fn invalid(&self, py: Python<'_>, msg: String) -> PyErr {
        errors::invalid(py, Some(self.rank), format!("rank {}: {msg}", self.rank))
    }

    /// `count` split in `world` equal blocks, or an error naming the collective.
    fn blocks(&self, py: Python<'_>, name: &str, v: &View) -> PyResult<usize> {
        if !v.count().is_multiple_of(self.world) {
            return Err(self.invalid(
                py,
                format!(
                    "{name}: the buffer's {} elements do not split into {} equal blocks",
                    v.count(),
                    self.world
                ),
            ));
        }
        Ok(v.count() / self.world)
    }

    /// Input and output views of one call: checks their types agree and they do not share
    /// memory; the same memory twice becomes an in-place call where `same_ok`.
    #[allow(clippy::too_many_arguments)]
    fn pair(
        &self,
        py: Python<'_>,
        name: &str,
        input: Option<&Bound<'_, PyAny>>,
        output: Option<&Bound<'_, PyAny>>,
        dtype: Option<DataType>,
        same_ok: bool,
    ) -> PyResult<(Layout, Vec<View>, Option<DataType>)> {
        let i = input
            .map(|o| self.view(py, o, &format!("{name}: the input"), false, dtype))
            .transpose()?;
        let o = output
            .map(|o| self.view(py, o, &format!("{name}: the output"), true, dtype))
            .transpose()?;
        if let (Some(iv), Some(ov)) = (&i, &o) {
            if iv.dtype() != ov.dtype() {
                return Err(self.invalid(
                    py,
                    format!(
                        "{name}: the input is {} and the output {}; they must be of one type",
                        iv.dtype(),
                        ov.dtype()
                    ),
                ));
            }
            let overlap = !iv.is_empty()
                && !ov.is_empty()
                && iv.addr() < ov.addr() + ov.len()
                && ov.addr() < iv.addr() + iv.len();
            if overlap {
                if same_ok && iv.addr() == ov.addr() && iv.len() == ov.len() {
                    let dt = ov.dtype();
                    return Ok((Layout::InPlace, o.into_iter().collect(), Some(dt)));
                }
                return Err(self.invalid(
                    py,
                    format!(
                        "{name}: the input and the output share memory; for an in-place call \
                         leave the output out"
                    ),
                ));
            }
        }
        let dt = i.as_ref().or(o.as_ref()).map(View::dtype);
        let layout = Layout::Out {
            input: i.is_some(),
            output: o.is_some(),
        };
        Ok((layout, i.into_iter().chain(o).collect(), dt))
    }

    /// Runs `p`: blocking (returns the output object) or submitted (returns a Work).
    fn execute(
        &self,
        py: Python<'_>,
        p: Prepared,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let timeout = parse_timeout(timeout)?;
        let comm = self.get(py)?;
        let Prepared {
            coll,
            dtype,
            op,
            layout,
            views,
            output,
        } = p;
        if !async_op {
            let r = py.detach(|| run_views(&comm, &coll, dtype, op, layout, &views, timeout));
            drop(views);
            return match r {
                Ok(()) => Ok(output.unwrap_or_else(|| py.None())),
                Err(e) => Err(errors::to_py(py, &e)),
            };
        }
        let what = format!("{} of {} {dtype} elements", coll.name(), coll.count());
        let shared = Shared::new(
            what,
            self.rank,
            timeout.unwrap_or_else(|| comm.timeout()),
            views,
            output,
        );
        // The call flies with the calls started before and after it (a send and a receive
        // with the same peer progress together), owning its views until it is done.
        let call = Flying {
            views: shared.take_views(),
            layout,
            dtype,
        };
        let s = shared.clone();
        comm.start_with(coll, op, call, timeout, move |call, r| {
            s.finish(call.views, r)
        });
        Ok(Py::new(py, PyWork::new(shared))?.into_any())
    }

    /// A call on one buffer, in place, or on an input and an output.
    #[allow(clippy::too_many_arguments)]
    fn simple(
        &self,
        py: Python<'_>,
        name: &str,
        buf: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        op: ReduceOp,
        coll: impl FnOnce(&View) -> PyResult<Collective>,
        same_ok: bool,
    ) -> PyResult<Prepared> {
        let dtype = parse_dtype(dtype)?;
        match out {
            None => {
                let v = self.view(py, buf, &format!("{name}: the buffer"), true, dtype)?;
                Ok(Prepared {
                    coll: coll(&v)?,
                    dtype: v.dtype(),
                    op,
                    layout: Layout::InPlace,
                    views: vec![v],
                    output: Some(buf.clone().unbind()),
                })
            }
            Some(o) => {
                let (layout, views, dt) =
                    self.pair(py, name, Some(buf), Some(o), dtype, same_ok)?;
                let c = coll(&views[0])?;
                let output = Some(if matches!(layout, Layout::InPlace) {
                    buf
                } else {
                    o
                });
                Ok(Prepared {
                    coll: c,
                    dtype: dt.expect("two views"),
                    op,
                    layout,
                    views,
                    output: output.map(|o| o.clone().unbind()),
                })
            }
        }
    }

    /// The format of a call's `compress=` (None: exact), refusing what does not go with it: a
    /// `timeout=` beside it (a compressed call runs under the communicator's), a `residual=`
    /// without it.
    fn compress_args(
        &self,
        py: Python<'_>,
        name: &str,
        compress: Option<&str>,
        residual: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Format>> {
        let fmt = parse_compress(compress)?;
        let refuse = |msg: String| Err(self.invalid(py, format!("{name}: {msg}")));
        match fmt {
            Some(f) if timeout.is_some() => refuse(format!(
                "compress={f} runs under the communicator's timeout; leave out timeout="
            )),
            None if residual.is_some() => refuse(
                "residual= is the error feedback of a compressed call; it needs compress=".into(),
            ),
            f => Ok(f),
        }
    }

    /// A compressed all-reduce of `tensor` in place, or (with `output`) a compressed
    /// reduce-scatter of `tensor` into `output`, summing or averaging, with error feedback
    /// through `residual` when given: blocking, or submitted to the worker.
    #[allow(clippy::too_many_arguments)]
    fn compressed(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        fmt: Format,
        op: ReduceOp,
        dtype: Option<&str>,
        residual: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let kind = match output {
            None => Squeezed::AllReduce,
            Some(_) => Squeezed::ReduceScatter,
        };
        let name = match kind {
            Squeezed::AllReduce => format!("all_reduce (compress={fmt})"),
            Squeezed::ReduceScatter => format!("reduce_scatter (compress={fmt})"),
        };
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(self.invalid(
                py,
                format!("{name}: compression sums or averages; op={op:?} is not supported"),
            ));
        }
        let first = if kind == Squeezed::AllReduce {
            "the tensor"
        } else {
            "the input"
        };
        let write = kind == Squeezed::AllReduce;
        let v = self.view(
            py,
            tensor,
            &format!("{name}: {first}"),
            write,
            parse_dtype(dtype)?,
        )?;
        let dt = v.dtype();
        if !matches!(dt, DataType::F32 | DataType::F16 | DataType::Bf16) {
            return Err(self.invalid(
                py,
                format!("{name}: compression sums float32, float16 or bfloat16 values, not {dt}"),
            ));
        }
        let mut views = vec![v];
        let mut extra = Vec::new();
        if let Some(o) = output {
            extra.push((o, "the output", Some(views[0].count() / self.world.max(1))));
        }
        if let Some(r) = residual {
            extra.push((r, "the residual", Some(views[0].count())));
        }
        for (obj, what, count) in extra {
            let w = self.view(py, obj, &format!("{name}: {what}"), true, None)?;
            if w.dtype() != dt || Some(w.count()) != count {
                return Err(self.invalid(
                    py,
                    format!(
                        "{name}: {what} is {} {} values; {} expected ({first}: {} {dt})",
                        w.count(),
                        w.dtype(),
                        count.unwrap_or(0),
                        views[0].count()
                    ),
                ));
            }
            if views.iter().any(|o| overlap(o, &w)) {
                return Err(self.invalid(
                    py,
                    format!("{name}: {what} shares memory with another buffer of the call"),
                ));
            }
            views.push(w);
        }
        let comm = self.get(py)?;
        if !async_op {
            let r = py.detach(|| run_compressed(&comm, kind, &views, dt, fmt, op));
            drop(views);
            r.map_err(|e| errors::to_py(py, &e))?;
            return Ok(output.unwrap_or(tensor).clone().unbind());
        }
        let what = format!("{name} of {} {dt} elements", views[0].count());
        let result = output.unwrap_or(tensor).clone().unbind();
        let shared = Shared::new(what, self.rank, comm.timeout(), views, Some(result));
        let views = shared.take_views();
        let s = shared.clone();
        // Runs alone on the worker, after every call made before it: the order of
        // collectives stays the order of calls on every rank.
        drop(comm.submit(move |c| {
            let r = run_compressed(c, kind, &views, dt, fmt, op);
            s.finish(views, r);
            Ok(())
        }));
        Ok(Py::new(py, PyWork::new(shared))?.into_any())
    }

    fn check_rank(&self, py: Python<'_>, what: &str, r: usize) -> PyResult<()> {
        if r >= self.world {
            return Err(self.invalid(
                py,
                format!("{what} {r} is outside a world of {} ranks", self.world),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl PyCommunicator {
    /// Joins a job over `store` (torch's `TCPStore`, `FileStore`, `PrefixStore`, ... or any
    /// object with their methods) as `rank` of `world_size`; without a store, from the
    /// launcher's environment (as `Communicator.from_env()`). `timeout` (seconds) bounds the
    /// join and every later call (default `OXCCL_TIMEOUT`, 300 s); `job_id` namespaces the
    /// keys in the store; `options` (`{"OXCCL_CHUNK_SIZE": "2M", ...}`) overrides the
    /// `OXCCL_*` environment for this communicator. Collective over the ranks; the GIL is
    /// released meanwhile.
    #[new]
    #[pyo3(signature = (store=None, rank=None, world_size=None, *, timeout=None, job_id="py", options=None))]
    fn new(
        py: Python<'_>,
        store: Option<&Bound<'_, PyAny>>,
        rank: Option<usize>,
        world_size: Option<usize>,
        timeout: Option<f64>,
        job_id: &str,
        options: Option<HashMap<String, String>>,
    ) -> PyResult<PyCommunicator> {
        let timeout = parse_timeout(timeout)?;
        let options = check_options(options)?;
        let Some(store) = store else {
            if rank.is_some() || world_size.is_some() {
                return Err(errors::value_error(
                    "rank and world_size need a store; without one, the launcher's environment \
                     says them (Communicator.from_env())"
                        .into(),
                ));
            }
            if !options.is_empty() {
                return Err(errors::value_error(
                    "options= needs a store; under a launcher set OXCCL_* in the environment"
                        .into(),
                ));
            }
            return Self::from_env(py, timeout.map(|t| t.as_secs_f64()));
        };
        let (Some(rank), Some(world)) = (rank, world_size) else {
            return Err(errors::value_error(
                "a store needs rank= and world_size=".into(),
            ));
        };
        let store = PyStore::new(store)?;
        let job = job_id.to_string();
        let r = py.detach(move || -> oxccl::Result<Communicator> {
            // `options` wins over the environment.
            let opts = options_with(&options, timeout)?;
            let store = crate::store::foreign(store)?;
            let boot = Bootstrap::with_store(rank, world, store, &job, opts.timeout)?;
            Communicator::init(boot, opts)
        });
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// Starts this rank's init over `store` (as the constructor does) on a thread of its own
    /// and returns an `oxccl.PendingInit` at once: `wait(timeout=None)` returns the
    /// communicator (or raises the init's error), `done()` says whether it finished, and
    /// `abort()`, from any thread, stops an init that waits for a rank that never comes
    /// (`oxccl.Aborted`, naming what it waited for; the other ranks fail naming this one).
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, *, timeout=None, job_id="py", options=None))]
    fn init_async(
        store: &Bound<'_, PyAny>,
        rank: usize,
        world_size: usize,
        timeout: Option<f64>,
        job_id: &str,
        options: Option<HashMap<String, String>>,
    ) -> PyResult<crate::pending::PyPendingInit> {
        let timeout = parse_timeout(timeout)?;
        let options = check_options(options)?;
        let store = crate::store::foreign(PyStore::new(store)?)
            .map_err(|e| errors::to_py(store.py(), &e.into()))?;
        crate::pending::PyPendingInit::start(store, rank, world_size, job_id, &options, timeout)
    }

    /// Joins the job the launcher describes (torchrun's, Slurm's, Open MPI's or oxccl run's
    /// environment; `OXCCL_SECRET` must be set alike on every rank).
    #[staticmethod]
    #[pyo3(signature = (timeout=None))]
    fn from_env(py: Python<'_>, timeout: Option<f64>) -> PyResult<PyCommunicator> {
        let timeout = parse_timeout(timeout)?;
        let r = py.detach(move || -> oxccl::Result<Communicator> {
            let mut opts = Options::from_env()?;
            if let Some(t) = timeout {
                opts.timeout = t;
            }
            let mut boot = Bootstrap::from_env()?;
            if timeout.is_some() {
                boot.set_timeout(opts.timeout);
            }
            Communicator::init(boot, opts)
        });
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Registers `buffer` (a writable buffer, CPU tensor or DLPack object) with every
    /// connection of this communicator (`ncclCommRegister`): calls on it skip the
    /// registration every call of an unregistered buffer makes, and over tcp a receive into
    /// it is written in place by the sender. Keeps the buffer alive until the returned
    /// `Registration` is closed (`close()`, or leaving its `with` block) or collected.
    fn register(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<PyRegistration> {
        let comm = self.get(py)?;
        let v = self.view(py, buffer, "register: the buffer", true, None)?;
        // SAFETY: the view keeps the buffer's memory alive (and, for buffer exports, locked
        // against resizing) for as long as the registration, which holds both and drops the
        // registration first.
        let reg = unsafe { comm.register_raw(v.addr() as *mut u8, v.len()) }
            .map_err(|e| errors::to_py(py, &e))?;
        Ok(PyRegistration {
            reg: std::sync::Mutex::new(Some((reg, v))),
        })
    }

    /// What this rank's executor has moved through memory so far, in bytes: `sent` (through
    /// a peer's slots), `placed` (written in place into a peer's destination), `copied` and
    /// `reduced` (out of this rank's slots), `local` (local steps), `received_in_place`.
    fn stats(&self, py: Python<'_>) -> PyResult<std::collections::BTreeMap<&'static str, u64>> {
        let s = self.get(py)?.stats();
        Ok([
            ("sent", s.sent),
            ("placed", s.placed),
            ("copied", s.copied),
            ("reduced", s.reduced),
            ("local", s.local),
            ("received_in_place", s.received_in_place),
        ]
        .into_iter()
        .collect())
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// Number of ranks (as torch's `size()`).
    fn size(&self) -> usize {
        self.world
    }

    /// The host identity of every rank.
    #[getter]
    fn hosts(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self.get(py)?.hosts().to_vec())
    }

    /// Whether the link to each rank is sealed: encrypted and authenticated with the job's
    /// key (`OXCCL_ENCRYPT=off|on|auto`, in the environment or `options=`; False for this rank
    /// and for shm links).
    #[getter]
    fn encrypted(&self, py: Python<'_>) -> PyResult<Vec<bool>> {
        Ok(self.get(py)?.encrypted().to_vec())
    }

    /// The provider used to reach each rank ("shm", "tcp"; None for this rank).
    #[getter]
    fn providers(&self, py: Python<'_>) -> PyResult<Vec<Option<&'static str>>> {
        Ok(self
            .get(py)?
            .providers()
            .iter()
            .map(|p| p.map(|p| p.name()))
            .collect())
    }

    /// Seconds each later call may take.
    #[getter]
    fn get_timeout(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.get(py)?.timeout().as_secs_f64())
    }

    /// Changes the timeout of later calls (use the same on every rank).
    #[setter]
    fn set_timeout(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let t = parse_timeout(Some(seconds))?.expect("some");
        self.get(py)?.set_timeout(t);
        Ok(())
    }

    /// `tensor = sum over ranks of tensor` (or with `op="avg"` the average), in place,
    /// compressed with block floating point (`compress`: `"bfp8"`, `"bfp4"`, `"bfp8/16"`, ...):
    /// float32, float16 or bfloat16 values; the result is the same bits on every rank, within
    /// one quantisation per rank of the exact sum plus one rounding of the sum
    /// (`Communicator::all_reduce_compressed` in the Rust crate).
    ///
    /// `residual` (a writable buffer of the tensor's type and length, zeros at first), when
    /// given, is error feedback in the same call (`all_reduce_compressed_feedback`): the ranks
    /// sum `x = tensor + residual` and `residual` becomes what compression dropped of this
    /// rank's `x` (its quantisation at the agreed block exponents, plus, for the share of
    /// blocks this rank re-encodes, the sum's rounding), to be sent by the next call. Blocking,
    /// or with `async_op=True` an `oxccl.Work` (run on the communicator's worker, in call
    /// order).
    #[pyo3(signature = (tensor, compress="bfp8", *, op=None, dtype=None, residual=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_compressed(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        compress: &str,
        op: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        residual: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let fmt: oxccl::compress::Format = compress
            .parse()
            .map_err(|e| errors::value_error(format!("compress={compress:?}: {e}")))?;
        let op = parse_op(op)?;
        self.compressed(py, tensor, None, fmt, op, dtype, residual, async_op)
    }

    /// `tensor = op over ranks of tensor`, in place; with `out`, the result goes there.
    ///
    /// `compress="bfp8"` (`"bfp4"`, `"bfp8/16"`, ...; `None` or `"off"`: exact) sums or
    /// averages float32, float16 or bfloat16 values compressed with block floating point, in
    /// place, as `all_reduce_compressed` (with its `residual=`); no `out` and no `timeout` (the
    /// communicator's applies).
    #[pyo3(signature = (tensor, op=None, *, out=None, dtype=None, async_op=false, timeout=None, compress=None, residual=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
        compress: Option<&str>,
        residual: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let op = parse_op(op)?;
        if let Some(fmt) = self.compress_args(py, "all_reduce", compress, residual, timeout)? {
            if out.is_some() {
                return Err(self.invalid(
                    py,
                    format!("all_reduce: compress={fmt} runs in place; leave out out="),
                ));
            }
            return self.compressed(py, tensor, None, fmt, op, dtype, residual, async_op);
        }
        let p = self.simple(
            py,
            "all_reduce",
            tensor,
            out,
            dtype,
            op,
            |v| Ok(Collective::AllReduce { count: v.count() }),
            true,
        )?;
        self.execute(py, p, async_op, timeout)
    }

    /// Rank r gets block r of the reduction of every rank's `input` (world · n elements);
    /// without `output`, in place: the result is block `rank` of `input`.
    ///
    /// `compress="bfp8"` (`"bfp4"`, ...) sums or averages float32, float16 or bfloat16 values
    /// compressed with block floating point on the wire (`Communicator::reduce_scatter_compressed`
    /// in the Rust crate): it needs `output` and runs under the communicator's timeout; with
    /// `residual` (as long as `input`), error feedback: `input + residual` is summed and
    /// `residual` keeps what quantisation dropped, for the next call (`input` is not changed).
    #[pyo3(signature = (input, output=None, op=None, *, dtype=None, async_op=false, timeout=None, compress=None, residual=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
        compress: Option<&str>,
        residual: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let op = parse_op(op)?;
        if let Some(fmt) = self.compress_args(py, "reduce_scatter", compress, residual, timeout)? {
            let Some(output) = output else {
                return Err(self.invalid(
                    py,
                    format!(
                        "reduce_scatter: compress={fmt} needs an output (it does not run in place)"
                    ),
                ));
            };
            return self.compressed(py, input, Some(output), fmt, op, dtype, residual, async_op);
        }
        let in_place = output.is_none();
        let p = self.simple(
            py,
            "reduce_scatter",
            input,
            output,
            dtype,
            op,
            |v| {
                let count = if in_place {
                    self.blocks(py, "reduce_scatter", v)?
                } else {
                    0
                };
                Ok(Collective::ReduceScatter { count })
            },
            false,
        )?;
        let p = if in_place {
            p
        } else {
            // The count is the output's.
            let count = p.views.get(1).map_or(0, View::count);
            Prepared {
                coll: Collective::ReduceScatter { count },
                ..p
            }
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Every rank's `input` lands in block r of every rank's `output` (world · n elements);
    /// without `output`, in place: `input` is the whole output, this rank's block filled.
    #[pyo3(signature = (input, output=None, *, dtype=None, async_op=false, timeout=None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let in_place = output.is_none();
        let p = self.simple(
            py,
            "all_gather",
            input,
            output,
            dtype,
            ReduceOp::Sum,
            |v| {
                let count = if in_place {
                    self.blocks(py, "all_gather", v)?
                } else {
                    v.count()
                };
                Ok(Collective::AllGather { count })
            },
            false,
        )?;
        self.execute(py, p, async_op, timeout)
    }

    /// `root`'s `tensor` is copied into every rank's (in place), or into `out`.
    #[pyo3(signature = (tensor, root=0, *, out=None, dtype=None, async_op=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "broadcast: root", root)?;
        let has_out = out.is_some();
        let p = self.simple(
            py,
            "broadcast",
            tensor,
            out,
            dtype,
            ReduceOp::Sum,
            |v| {
                Ok(Collective::Broadcast {
                    count: v.count(),
                    root,
                })
            },
            true,
        )?;
        let p = if has_out && matches!(p.layout, Layout::Out { .. }) {
            let count = p.views[1].count();
            Prepared {
                coll: Collective::Broadcast { count, root },
                ..p
            }
        } else {
            p
        };
        self.execute(py, p, async_op, timeout)
    }

    /// The reduction of every rank's `tensor` lands in `root`'s (in place), or in `root`'s
    /// `out` (other ranks may leave it out).
    #[pyo3(signature = (tensor, root=0, op=None, *, out=None, dtype=None, async_op=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        op: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "reduce: root", root)?;
        let op = parse_op(op)?;
        let p = self.simple(
            py,
            "reduce",
            tensor,
            out,
            dtype,
            op,
            |v| {
                Ok(Collective::Reduce {
                    count: v.count(),
                    root,
                })
            },
            true,
        )?;
        self.execute(py, p, async_op, timeout)
    }

    /// Block j of this rank's `input` goes to rank j; block i of `output` comes from rank i
    /// (both world · n elements); without `output`, in place.
    #[pyo3(signature = (input, output=None, *, dtype=None, async_op=false, timeout=None))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let p = self.simple(
            py,
            "all_to_all",
            input,
            output,
            dtype,
            ReduceOp::Sum,
            |v| {
                Ok(Collective::AllToAll {
                    count: self.blocks(py, "all_to_all", v)?,
                })
            },
            true,
        )?;
        self.execute(py, p, async_op, timeout)
    }

    /// All-to-all with counts per peer: `send_counts[j]` elements of `input` (packed in rank
    /// order) go to rank j; `recv_counts[i]` elements from rank i land in `output`, packed.
    #[pyo3(signature = (input, send_counts, output, recv_counts, *, dtype=None, async_op=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_allv(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        output: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let dtype = parse_dtype(dtype)?;
        let (layout, views, dt) =
            self.pair(py, "all_to_allv", Some(input), Some(output), dtype, false)?;
        let p = Prepared {
            coll: Collective::AllToAllV {
                send_counts,
                recv_counts,
            },
            dtype: dt.expect("two views"),
            op: ReduceOp::Sum,
            layout,
            views,
            output: Some(output.clone().unbind()),
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Every rank's `input` lands in block r of `root`'s `output` (world · n elements; other
    /// ranks may leave it out).
    #[pyo3(signature = (input, output=None, root=0, *, dtype=None, async_op=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        root: usize,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "gather: root", root)?;
        if root == self.rank && output.is_none() {
            return Err(self.invalid(
                py,
                format!("gather: the root (rank {root}) needs an output"),
            ));
        }
        let dtype = parse_dtype(dtype)?;
        let (layout, views, dt) = self.pair(py, "gather", Some(input), output, dtype, false)?;
        let p = Prepared {
            coll: Collective::Gather {
                count: views[0].count(),
                root,
            },
            dtype: dt.expect("an input"),
            op: ReduceOp::Sum,
            layout,
            views,
            output: output.map(|o| o.clone().unbind()),
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Block r of `root`'s `input` (world · n elements) lands in rank r's `output`; other
    /// ranks pass None as `input`.
    #[pyo3(signature = (input, output, root=0, *, dtype=None, async_op=false, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        py: Python<'_>,
        input: Option<&Bound<'_, PyAny>>,
        output: &Bound<'_, PyAny>,
        root: usize,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "scatter: root", root)?;
        if root == self.rank && input.is_none() {
            return Err(self.invalid(
                py,
                format!("scatter: the root (rank {root}) needs an input"),
            ));
        }
        let dtype = parse_dtype(dtype)?;
        let (layout, views, dt) = self.pair(py, "scatter", input, Some(output), dtype, false)?;
        let count = views.last().map_or(0, View::count);
        let p = Prepared {
            coll: Collective::Scatter { count, root },
            dtype: dt.expect("an output"),
            op: ReduceOp::Sum,
            layout,
            views,
            output: Some(output.clone().unbind()),
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Returns once every rank has called it.
    #[pyo3(signature = (*, async_op=false, timeout=None))]
    fn barrier(&self, py: Python<'_>, async_op: bool, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let p = Prepared {
            coll: Collective::Barrier,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            layout: Layout::Empty,
            views: Vec::new(),
            output: None,
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Sends `tensor` to `peer`, which receives it with `recv` (same count); sends to one peer
    /// arrive in order.
    #[pyo3(signature = (tensor, peer, *, dtype=None, async_op=false, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: usize,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "send: peer", peer)?;
        let dtype = parse_dtype(dtype)?;
        let v = self.view(py, tensor, "send: the buffer", false, dtype)?;
        let p = Prepared {
            coll: Collective::Send {
                count: v.count(),
                peer,
            },
            dtype: v.dtype(),
            op: ReduceOp::Sum,
            layout: Layout::Out {
                input: true,
                output: false,
            },
            views: vec![v],
            output: None,
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Receives `peer`'s next `send` into `tensor`.
    #[pyo3(signature = (tensor, peer, *, dtype=None, async_op=false, timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: usize,
        dtype: Option<&str>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        self.check_rank(py, "recv: peer", peer)?;
        let dtype = parse_dtype(dtype)?;
        let v = self.view(py, tensor, "recv: the buffer", true, dtype)?;
        let p = Prepared {
            coll: Collective::Recv {
                count: v.count(),
                peer,
            },
            dtype: v.dtype(),
            op: ReduceOp::Sum,
            layout: Layout::Out {
                input: false,
                output: true,
            },
            views: vec![v],
            output: Some(tensor.clone().unbind()),
        };
        self.execute(py, p, async_op, timeout)
    }

    /// Runs sends and receives together as one group (NCCL's `ncclGroupStart` ...
    /// `ncclGroupEnd`): `ops` is a list of `("send", buffer, peer)` and
    /// `("recv", buffer, peer)`; a send and a receive with the same peer do not wait for each
    /// other. Each pair of ranks lists its operations with each other in the same order (the
    /// k-th send to a peer is its k-th receive from this rank). A receive's buffer may share
    /// memory with no other buffer of the batch. Returns None, or a Work with `async_op=True`
    /// (the batch then runs on the worker after the calls made before it).
    #[pyo3(signature = (ops, *, async_op=false, timeout=None))]
    fn batch(
        &self,
        py: Python<'_>,
        ops: Vec<(String, Bound<'_, PyAny>, usize)>,
        async_op: bool,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let timeout = parse_timeout(timeout)?;
        let mut kinds = Vec::with_capacity(ops.len());
        let mut views: Vec<View> = Vec::with_capacity(ops.len());
        for (i, (kind, buf, peer)) in ops.iter().enumerate() {
            let send = match kind.as_str() {
                "send" => true,
                "recv" => false,
                other => {
                    return Err(self.invalid(
                        py,
                        format!("batch: operation {i} is {other:?}, not \"send\" or \"recv\""),
                    ));
                }
            };
            self.check_rank(py, &format!("batch: operation {i} ({kind}): peer"), *peer)?;
            let what = format!("batch: operation {i} ({kind}): the buffer");
            let v = self.view(py, buf, &what, !send, None)?;
            kinds.push((send, *peer));
            views.push(v);
        }
        for (i, (a, &(sa, _))) in views.iter().zip(&kinds).enumerate() {
            for (j, (b, &(sb, _))) in views.iter().zip(&kinds).enumerate().skip(i + 1) {
                let overlap = !a.is_empty()
                    && !b.is_empty()
                    && a.addr() < b.addr() + b.len()
                    && b.addr() < a.addr() + a.len();
                if overlap && !(sa && sb) {
                    return Err(self.invalid(
                        py,
                        format!(
                            "batch: operations {i} and {j} share memory, and one of them \
                             receives into it"
                        ),
                    ));
                }
            }
        }
        let comm = self.get(py)?;
        if !async_op {
            let r = py.detach(|| run_batch(&comm, &kinds, &views, timeout));
            drop(views);
            r.map_err(|e| errors::to_py(py, &e))?;
            return Ok(py.None());
        }
        let what = format!("batch of {} sends and receives", kinds.len());
        let shared = Shared::new(
            what,
            self.rank,
            timeout.unwrap_or_else(|| comm.timeout()),
            views,
            None,
        );
        let views = shared.take_views();
        let s = shared.clone();
        // Runs alone on the worker, after every call made before it, as one group.
        drop(comm.submit(move |c| {
            let r = run_batch(c, &kinds, &views, timeout);
            s.finish(views, r);
            Ok(())
        }));
        Ok(Py::new(py, PyWork::new(shared))?.into_any())
    }

    /// Splits into sub-communicators of the ranks passing the same `color`, ordered by `key`
    /// then rank; `color=None` opts out and returns None. Collective.
    #[pyo3(signature = (color, key=0))]
    fn split(
        &self,
        py: Python<'_>,
        color: Option<u32>,
        key: u32,
    ) -> PyResult<Option<PyCommunicator>> {
        let comm = self.get(py)?;
        let r = py.detach(|| comm.split(color, key));
        match r {
            Ok(c) => Ok(c.map(PyCommunicator::wrap)),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// A communicator of the ranks that remain after leaving out `exclude` (this
    /// communicator's ranks) and every rank a failure here named: the survivors agree on who is
    /// gone through the store (a rank that saw no failure learns it there), renumbered in
    /// order as `split` does. Called by every survivor; a rank dying meanwhile makes them
    /// shrink again; a rank that is left out raises `oxccl.Error` at once. Without a failure
    /// this communicator stays usable (`Communicator::shrink` in the Rust crate).
    #[pyo3(signature = (exclude=Vec::new()))]
    fn shrink(&self, py: Python<'_>, exclude: Vec<usize>) -> PyResult<PyCommunicator> {
        let comm = self.get(py)?;
        for &r in &exclude {
            self.check_rank(py, "shrink: excluded rank", r)?;
        }
        let r = py.detach(|| comm.shrink(&exclude));
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// After a failure (`oxccl.PeerFailed`, say): stops this communicator (its calls in flight
    /// raise) and returns a communicator of the survivors, leaving out the ranks the failures
    /// named (`shrink` with no rank of its own).
    fn shrink_after_failure(&self, py: Python<'_>) -> PyResult<PyCommunicator> {
        let comm = self.get(py)?;
        let r = py.detach(|| comm.shrink_after_failure());
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// Admits ``count`` newcomers (processes calling ``Communicator.join`` with this job's
    /// store and job id) and returns the communicator of this one's ranks and theirs: the
    /// members keep their ranks, the newcomers follow in the order they asked. Called by every
    /// rank with the same ``count``, between calls. Raises ``oxccl.Error`` when the newcomers
    /// do not come within the timeout (this communicator stays usable), or when a member or
    /// newcomer dies meanwhile (``peer``: the first member that did not answer, if any).
    #[pyo3(signature = (count=1))]
    fn grow(&self, py: Python<'_>, count: usize) -> PyResult<PyCommunicator> {
        let comm = self.get(py)?;
        let r = py.detach(|| comm.grow(count));
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// Joins a running job as a newcomer: waits (up to ``timeout`` seconds, default
    /// ``OXCCL_TIMEOUT`` or 300) until its ranks call ``grow`` and admit this process, and
    /// returns the grown communicator (this process ranks after the members). ``store`` is the
    /// job's store (a torch ``Store``, or ``oxccl.Store``), ``job_id`` the one the job's
    /// communicator was made with (``"py"`` by default; ``"torch"`` for the torch backend,
    /// over the store c10d hands it). Raises ``oxccl.Error`` if nobody admits it in time (it
    /// withdraws: a later grow will not count it).
    #[staticmethod]
    #[pyo3(signature = (store, *, job_id="py", timeout=None, options=None))]
    fn join(
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        job_id: &str,
        timeout: Option<f64>,
        options: Option<HashMap<String, String>>,
    ) -> PyResult<PyCommunicator> {
        let timeout = parse_timeout(timeout)?;
        let options = check_options(options)?;
        let store = PyStore::new(store)?;
        let job = job_id.to_string();
        let r = py.detach(move || -> oxccl::Result<Communicator> {
            let opts = options_with(&options, timeout)?;
            Communicator::join(crate::store::foreign(store)?, &job, opts)
        });
        r.map(PyCommunicator::wrap)
            .map_err(|e| errors::to_py(py, &e))
    }

    /// The job id newcomers join this communicator's job under (``Communicator.join``).
    #[getter]
    fn lineage(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.get(py)?.lineage())
    }

    /// The ranks failures on this communicator named (a lost peer), in the order seen.
    #[getter]
    fn failed_peers(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        Ok(self.get(py)?.failed_peers())
    }

    /// Stops the communicator: calls running here (on any thread) and on the peers raise
    /// `oxccl.Aborted` promptly; later calls raise at once.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        if let Ok(c) = self.get(py) {
            py.detach(|| c.abort());
        }
        Ok(())
    }

    /// Waits for every rank (a barrier), then releases the communicator; later calls raise.
    /// A no-op when already destroyed.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        let Some(arc) = self.comm.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        // Calls running on other threads hold the communicator for their duration.
        let rank = self.rank;
        let r = py.detach(move || {
            let end = Instant::now() + Duration::from_secs(5);
            let mut arc = arc;
            loop {
                match Arc::try_unwrap(arc) {
                    Ok(c) => return c.destroy().map_err(|e| e.to_string()),
                    Err(a) if Instant::now() < end => {
                        arc = a;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(_) => {
                        return Err(format!(
                            "rank {rank}: destroy(): calls on other threads still use the \
                             communicator after 5 s; it is released when they end"
                        ));
                    }
                }
            }
        });
        r.map_err(|m| errors::make(py, errors::Kind::Error, m, Some(rank), None))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block destroys the communicator; leaving it by an exception aborts
    /// it instead (the peers may be elsewhere), then releases it.
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if exc_type.is_some_and(|t| !t.is_none()) {
            self.abort(py)?;
            drop(self.comm.lock().unwrap_or_else(|e| e.into_inner()).take());
        } else {
            self.destroy(py)?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let alive = self
            .comm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        format!(
            "<oxccl.Communicator rank {} of {}{}>",
            self.rank,
            self.world,
            if alive { "" } else { ", destroyed" }
        )
    }

    /// For benchmarks: `iters` blocking calls of `coll` ("all_reduce", float32 sum) on
    /// `nbytes` from Rust, with no Python in the loop (the GIL released); returns the mean
    /// seconds per call, the Rust side of the Python layer's overhead.
    #[pyo3(signature = (coll, nbytes, iters))]
    fn _rust_loop(&self, py: Python<'_>, coll: &str, nbytes: usize, iters: usize) -> PyResult<f64> {
        if coll != "all_reduce" {
            return Err(errors::value_error(format!(
                "_rust_loop: {coll:?} is not all_reduce"
            )));
        }
        let comm = self.get(py)?;
        let r = py.detach(|| {
            let mut buf = vec![1f32; nbytes.div_ceil(4)];
            let t = Instant::now();
            for _ in 0..iters {
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            }
            Ok::<f64, oxccl::Error>(t.elapsed().as_secs_f64() / iters.max(1) as f64)
        });
        r.map_err(|e| errors::to_py(py, &e))
    }
}
