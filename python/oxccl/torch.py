"""oxccl as a ``torch.distributed`` backend.

``import oxccl.torch`` registers the backend ``"oxccl"`` (CPU tensors); then
``torch.distributed.init_process_group("oxccl")`` works under any ``init_method``
(``env://`` under torchrun, ``tcp://``, ``file://``): the rendezvous goes through the store
torch hands the backend. ``DistributedDataParallel`` runs on it unchanged.

Every call returns a ``Work`` whose ``get_future()`` completes when the collective ends;
calls made with ``async_op=False`` run on the calling thread (no hand-off), and so do exact
all-reduces of one tensor of at most ``OXCCL_TORCH_EAGER_BYTES`` (256 KiB; 0: none) made with
``async_op=True`` (torch's functional collectives, which DTensor and tensor parallelism use,
wait for them at once); the others run on the communicator's worker thread, in the order they
were made. Reductions: SUM, AVG, PRODUCT, MIN,
MAX (complex tensors: SUM and AVG). ``OXCCL_TIMEOUT`` (seconds), when set, wins over the
``timeout`` of ``init_process_group``.

Compression (block floating point, issue 17): ``OXCCL_COMPRESS=bfp8|bfp4|bfp8/16|...|off``
(default off), read when a group is created, makes the group's SUM and AVG all-reduces of
float32, float16 and bfloat16 tensors compressed (``Communicator.all_reduce(...,
compress=...)``: exact integer sums at a common block exponent, the same bits on every rank,
within one quantisation per rank of the exact sum); ``group.compress`` changes it per group,
and ``with oxccl.torch.compressed("bfp4"):`` (or ``compressed("off")``) overrides every group
of the process inside the block. Every other all-reduce (other dtypes, PRODUCT/MIN/MAX,
complex tensors) and every other collective stays exact; with ``OXCCL_DEBUG=INFO`` the group
says so on stderr, once per dtype and operator. A compressed call runs alone on the
communicator's worker, after the calls made before it.

``OXCCL_REDUCE_SCATTER_COMPRESS=bfp8|bfp4|...`` (``group.reduce_scatter_compress``) does the
same for float SUM/AVG reduce-scatters: FSDP2's gradients go compressed, its parameters'
all-gathers stay exact.

For training, ``bfp_hook`` with a ``BfpState`` is a DDP communication hook that compresses the
gradient buckets with error feedback (a residual per bucket), one fused call per bucket.
``OXCCL_DDP_COMPRESS=bfp8`` (or ``bfp4``, ...) registers it by itself, at a DDP module's first
forward, when the module's group is an "oxccl" group across more than one host and no hook was
registered: ``init_process_group("oxccl")`` and DDP then compress across hosts with no code
change (``OXCCL_DEBUG=INFO`` says what was chosen and why).

Encryption (issue 31): ``OXCCL_ENCRYPT=off|on|auto`` (default ``auto``), or
``ProcessGroupOxccl(..., encrypt="on")``, seals the group's tcp links (AES-256-GCM records keyed
from the job's secret: a stranger on the path learns nothing and cannot alter, replay or drop a
byte unnoticed): ``auto`` the links that leave the host, ``on`` every tcp link, ``off`` none;
shm links never leave the host and are never sealed. Set it alike on every rank;
``group.encrypted`` says which links are (``OXCCL_DEBUG=INFO`` logs it at init).

Elastic training (issue 32): after a failure, ``oxccl.torch.shrink(group)`` on every survivor
returns a new ``ProcessGroup`` of the survivors (they agree through the store on who is gone);
``oxccl.torch.grow(group, count)`` on the members and ``oxccl.torch.join(store)`` on newcomers
return the grown group. A group made from the default group becomes the default group; DDP is
rebuilt on the new group. ``oxccl.torch.is_failure(exc)`` says whether an exception (an
``oxccl`` error, or the RuntimeError DDP's backward raises when a gradient all-reduce fails)
is one ``shrink`` answers. ``examples/elastic_ddp.py`` shows the whole loop.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import _oxccl
from .errors import Error as _Error
from .errors import InvalidArgument

__all__ = [
    "ProcessGroupOxccl",
    "BACKEND",
    "communicators",
    "compressed",
    "BfpState",
    "bfp_hook",
    "backend",
    "shrink",
    "grow",
    "join",
    "wrap",
    "backend_store",
    "is_failure",
]

BACKEND = "oxccl"

_R = dist.ReduceOp.RedOpType
_OPS = {
    _R.SUM: _oxccl.ReduceOp.SUM,
    _R.AVG: _oxccl.ReduceOp.AVG,
    _R.PRODUCT: _oxccl.ReduceOp.PRODUCT,
    _R.MIN: _oxccl.ReduceOp.MIN,
    _R.MAX: _oxccl.ReduceOp.MAX,
}


def _op(reduce_op: Any) -> Any:
    kind = getattr(reduce_op, "op", reduce_op)
    try:
        return _OPS[kind]
    except (KeyError, TypeError):
        name = getattr(kind, "name", str(kind))
        raise InvalidArgument(
            f"oxccl: ReduceOp.{name} is not supported (SUM, AVG, PRODUCT, MIN, MAX)"
        ) from None


def _real(t: torch.Tensor, op: Any) -> torch.Tensor:
    """Complex tensors travel as their real view (where the operator allows it)."""
    if t.is_complex():
        if op not in (_oxccl.ReduceOp.SUM, _oxccl.ReduceOp.AVG):
            raise InvalidArgument(
                f"oxccl: {op} of complex tensors ({t.dtype}) is not defined; SUM and AVG are"
            )
        return torch.view_as_real(t)
    return t


def _seconds(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout) / 1000.0  # torch passes milliseconds as an int in some paths
    return s if s > 0 else None


class _Work(dist._Work):
    """One call's handle, as torch expects: ``wait``, ``is_completed``, ``is_success``,
    ``exception``, ``get_future`` and ``result``.

    ``work`` is the oxccl.Work of a submitted call (None when the call already ran);
    ``value`` is what the future completes with (the output tensors); ``after`` runs once the
    call has ended (copying results out of staging buffers) before anyone sees it complete;
    ``error``: the call already failed with it (an ``async_op`` call that failed on the calling
    thread: its Work reports the error, as Gloo's does, rather than the call raising).
    """

    def __init__(
        self,
        work: Optional[_oxccl.Work] = None,
        value: Optional[list] = None,
        after: Optional[Callable[[], None]] = None,
        error: Optional[BaseException] = None,
    ):
        super().__init__()
        self._error = error
        self._base: Optional[torch.futures.Future] = None
        self._work = work
        self._value = value if value is not None else []
        self._after = after
        self._lock = threading.Lock() if after is not None else None
        self._future: Optional[torch.futures.Future] = None

    def _run_after(self) -> None:
        if self._after is None:
            return
        with self._lock:
            after, self._after = self._after, None
            if after is not None:
                after()

    def wait(self, timeout: Any = None) -> bool:
        if self._error is not None:
            raise self._error
        if self._work is not None:
            self._work.wait(_seconds(timeout))
        self._run_after()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        if self._error is not None:
            return False
        return self._work is None or self._work.is_success()

    def exception(self) -> Any:
        if self._error is not None:
            return self._error
        return None if self._work is None else self._work.exception()

    def result(self) -> list:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        if self._future is not None:
            return self._future
        if self._error is None and self._work is None:
            fut: torch.futures.Future = torch.futures.Future()
            self._run_after()
            fut.set_result(self._value)
            self._future = fut
            return fut
        # The future handed out is ``base.then(...)``: it ends in error at the C++ level when
        # the call fails, which DDP's reducer needs (see _errorable_future).
        self._base, self._future = _errorable_future()
        if self._error is not None:
            self._base.set_exception(self._error)
        elif self._after is None:
            # Completed from Rust's completion thread.
            self._work._complete_future(self._base, self._value)
        else:
            self._work.add_done_callback(self._complete)
        return self._future

    def _complete(self, work: _oxccl.Work) -> None:
        fut = self._base
        exc = work.exception()
        if exc is None:
            try:
                self._run_after()
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiters
                exc = e
        if exc is None:
            fut.set_result(self._value)
        else:
            fut.set_exception(exc)


def _unwrap(fut: torch.futures.Future) -> Any:
    return fut.wait()  # the value, or the call's error raised


def _errorable_future() -> tuple:
    """(base, out): complete ``base`` (``set_result`` or ``set_exception``) and ``out``
    completes the same way, with an error C++ consumers see. torch's Python
    ``Future.set_exception`` completes the C++ future successfully, with the exception object
    as its value (only Python's ``wait`` raises it): DDP's reducer then read that object as its
    bucket's tensors and crashed the process (SIGSEGV) when a gradient all-reduce failed. A
    ``then`` callback that raises fails its future properly; it costs one Python call per
    completion."""
    base: torch.futures.Future = torch.futures.Future()
    return base, base.then(_unwrap)


_DONE_VALUE: list = []


def _failed(e: BaseException, value: list) -> _Work:
    """An ``async_op`` call that failed on the calling thread (run there, or refused at once by
    a failed communicator): its Work carries the error, as Gloo's would (torchft's Manager and
    DDP's reducer read errors from the Work); a bad argument still raises at the call."""
    if isinstance(e, InvalidArgument):
        raise e
    return _Work(None, value, error=e)


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# Under data parallelism the collectives run while the ranks compute (DDP overlaps the
# gradient all-reduce with the backward pass), so on hosts with few cores the ranks' workers
# are often descheduled: fewer, larger pipeline steps wait less on the scheduler. 2 MiB chunks
# took a 4-rank DDP step's communication share from ~35% to ~6% on 2 cores (128 KiB is the
# library's default for one host). The environment wins.
_DEFAULTS = {"OXCCL_CHUNK_SIZE": "2M"}


def _eager_bytes() -> int:
    v = os.environ.get("OXCCL_TORCH_EAGER_BYTES", "").strip()
    if not v:
        return 256 << 10
    try:
        mult = {"K": 1 << 10, "M": 1 << 20}.get(v[-1].upper(), 1)
        return int(v[:-1] if mult > 1 else v) * mult
    except ValueError:
        raise ValueError(
            f"OXCCL_TORCH_EAGER_BYTES={v!r}: expected bytes (256K, 1M, 0 to turn it off)"
        ) from None


# An async_op all-reduce of one tensor of at most this many bytes (default 256 KiB;
# OXCCL_TORCH_EAGER_BYTES, 0: none) runs on the calling thread, as a blocking one does, and
# returns a completed Work. torch's functional collectives (DTensor, tensor parallelism) issue
# every all-reduce with async_op and wait for it at once; handing it to the communicator's
# worker thread and back cost 17-120 us more than the blocking call (bench/torch-overhead.sh,
# 2 ranks, 512 B-32 KiB; now equal). In a TP step (bench/tp.sh) the effect is within the
# noise of a loaded 2-CPU host: see bench/results/torch-overhead-tp-2026-12-05.md. The price: such a call no longer overlaps what the caller does before waiting, and
# it waits for its peers to join; ranks must issue their collectives in the same order
# across groups (as the SPMD programs torch runs do). Larger calls stay asynchronous.
_EAGER_BYTES = _eager_bytes()


def _defaults() -> dict:
    return {k: v for k, v in _DEFAULTS.items() if k not in os.environ}


# -- compression ---------------------------------------------------------------------------
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_COMPRESS_VALUES = "bfp8, bfp4, optionally /16, /32 or /64 (bfp8/16, bfp4/64), or off"


def _format(value: Optional[str], what: str) -> Optional[str]:
    """The canonical BFP format name of ``value`` (None for None, "" and "off"), or a
    ValueError naming ``what`` and the allowed values."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{what}={value!r}: expected a string: {_COMPRESS_VALUES}")
    try:
        return _oxccl.compress_format(value.strip().lower())
    except ValueError:
        raise ValueError(f"{what}={value!r} is not a compression: {_COMPRESS_VALUES}") from None


def _env_format(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return _format(value if value not in ("off", "none") else None, name)


# The process-wide override of ``compressed()``: a stack of formats (None: off), innermost last.
_SCOPE: list = []
_SCOPE_LOCK = threading.Lock()


@contextlib.contextmanager
def compressed(compress: Optional[str] = "bfp8"):
    """Inside the block, every "oxccl" group of this process compresses its float32, float16
    and bfloat16 SUM/AVG all-reduces with ``compress`` ("bfp8", "bfp4", "bfp8/16", ...), or
    none with ``"off"``/None, whatever ``OXCCL_COMPRESS`` or ``group.compress`` say. The
    override is process-wide (DDP's reducer may call from another thread), so enter it on every
    rank around the same calls. Nested blocks: the innermost wins.

        with oxccl.torch.compressed("bfp4"):
            dist.all_reduce(grad)
    """
    fmt = _format(compress if compress not in ("off", "none") else None, "compress")
    with _SCOPE_LOCK:
        _SCOPE.append(fmt)
    try:
        yield fmt
    finally:
        with _SCOPE_LOCK:
            _SCOPE.pop()


def _debug_info() -> bool:
    return os.environ.get("OXCCL_DEBUG", "").upper() in ("INFO", "DEBUG", "TRACE")


def _info(line: str) -> None:
    """An ``OXCCL_DEBUG=INFO`` line on stderr, in the Rust side's shape."""
    print(f"oxccl INFO {line}", file=sys.stderr, flush=True)


# c10d's C++ Backend, subclassable from Python (pybind11 forwards its virtual calls here).
_C10dBackend = torch._C._distributed_c10d.Backend


class ProcessGroupOxccl(_C10dBackend):
    """The ``"oxccl"`` backend: a c10d ``Backend`` over an ``oxccl.Communicator`` joined
    through the store torch hands it.

    c10d wraps it in a ``ProcessGroup`` as it does every custom backend (the one whose name,
    sequence numbers and coalescing state DeviceMesh, FSDP2 and ``split_group`` use): a Python
    ``ProcessGroup`` subclass returned by the creator would replace that wrapper and has no
    backend to hold the group's name (``RuntimeError: ProcessGroup name not set`` from
    ``init_device_mesh``). ``oxccl.torch.backend(group)`` finds this object behind a group."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: Any = None,
        communicator: Optional[_oxccl.Communicator] = None,
        encrypt: Optional[str] = None,
    ):
        if communicator is not None:
            # A communicator made elsewhere (a shrink, a grow, a join: oxccl.torch.shrink,
            # grow, join); it says the rank and size.
            rank, size = communicator.rank, communicator.world_size
        super().__init__(rank, size)
        env = os.environ.get("OXCCL_TIMEOUT")
        seconds = None if env else _seconds(timeout)
        # Checked before joining: a bad value fails every rank alike, at once.
        self._compress: Optional[str] = _env_format("OXCCL_COMPRESS")
        self._rs_compress: Optional[str] = _env_format("OXCCL_REDUCE_SCATTER_COMPRESS")
        options = {**_defaults(), "OXCCL_COMPRESS": "off"}
        if encrypt is not None:
            # Wins over OXCCL_ENCRYPT.
            if encrypt not in ("off", "on", "auto"):
                raise ValueError(f"encrypt={encrypt!r}: expected 'off', 'on' or 'auto'")
            options["OXCCL_ENCRYPT"] = encrypt
        self._noted: set = set()
        # Reconfigurations (shrink, grow, join) since init_process_group: names the groups
        # they make alike on every rank (oxccl.torch.shrink and friends).
        self.generation = 0
        self._comm = communicator if communicator is not None else _oxccl.Communicator(
            store=store,
            rank=rank,
            world_size=size,
            timeout=seconds,
            job_id="torch",
            # The backend decides per call what goes compressed (OXCCL_COMPRESS read above,
            # group.compress, compressed()): the Rust side's own reading of OXCCL_COMPRESS
            # would compress every plain all-reduce and could not be turned off per call.
            options=options,
        )
        self._store = store
        self._timeout = timeout
        self._coalescing: Optional[list] = None
        self._p2p: Optional[list] = None
        self._splits: dict = {}
        self.batches = 0  # batches of sends and receives run as one group (for tests)

    # c10d reads these of a backend; pybind11 would look each one up in Python and recurse
    # forever when a Python backend does not define it.
    supports_coalescing = True
    supports_splitting = True
    supports_reconfigure = False
    supports_shrinking = True  # torch's dist.shrink_group (ProcessGroupOxccl.shrink)
    supports_window = False

    @property
    def options(self) -> Any:
        t = self._timeout if isinstance(self._timeout, datetime.timedelta) else None
        if t is None:
            return _C10dBackend.Options(BACKEND)
        return _C10dBackend.Options(BACKEND, t)

    @property
    def encrypted(self) -> list:
        """Whether the link to each rank is sealed (encrypted and authenticated:
        ``OXCCL_ENCRYPT`` or ``encrypt=``); False for this rank and for shm links."""
        return self._comm.encrypted

    @property
    def compress(self) -> Optional[str]:
        """The BFP format this group compresses its float SUM/AVG all-reduces with ("bfp8",
        ...), None when off; starts as ``OXCCL_COMPRESS``. Set it alike on every rank."""
        return self._compress

    @compress.setter
    def compress(self, value: Optional[str]) -> None:
        self._compress = _format(value if value not in ("off", "none") else None, "compress")

    @property
    def reduce_scatter_compress(self) -> Optional[str]:
        """The BFP format this group compresses its float SUM/AVG reduce-scatters with (FSDP2's
        gradients; its parameters' all-gathers stay exact), None when off; starts as
        ``OXCCL_REDUCE_SCATTER_COMPRESS``. Set it alike on every rank."""
        return self._rs_compress

    @reduce_scatter_compress.setter
    def reduce_scatter_compress(self, value: Optional[str]) -> None:
        self._rs_compress = _format(
            value if value not in ("off", "none") else None, "reduce_scatter_compress"
        )

    def _compress_for(self, t: torch.Tensor, op: Any, what: str = "all_reduce") -> Optional[str]:
        """The format an all-reduce (or reduce-scatter) of ``t`` with ``op`` runs compressed
        with, or None."""
        if what == "all_reduce":
            with _SCOPE_LOCK:
                fmt = _SCOPE[-1] if _SCOPE else self._compress
        else:
            fmt = self._rs_compress
        if fmt is None:
            return None
        ok = t.dtype in _FLOATS and op in (_oxccl.ReduceOp.SUM, _oxccl.ReduceOp.AVG)
        key = (what, t.dtype, str(op), fmt)
        if _debug_info() and key not in self._noted:
            self._noted.add(key)
            how = (
                f"compressed ({fmt})"
                if ok
                else "exact: compression sums float32, float16 or bfloat16 (SUM, AVG)"
            )
            _info(f"rank {self.rank()}: {what} of {t.dtype} {str(op).rsplit('.', 1)[-1]}: {how}")
        return fmt if ok else None

    def _allreduce_call(self, t: torch.Tensor, op: Any) -> Callable[..., Any]:
        """One tensor's all-reduce call (``call(async_op)``), compressed when this group says so
        (a compressed AVG is averaged in the same call)."""
        comm = self._comm
        fmt = self._compress_for(t, op)
        if fmt is None:
            r = _real(t, op)
            return lambda a: comm.all_reduce(r, op, async_op=a)
        return lambda a: comm.all_reduce(t, op, compress=fmt, async_op=a)

    # -- identity -----------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def communicator(self) -> _oxccl.Communicator:
        """The oxccl.Communicator under this group."""
        return self._comm

    def abort(self) -> None:
        self._comm.abort()

    def split(self, store: Any, ranks: Sequence[int], opts: Any = None) -> Optional[ProcessGroupOxccl]:
        """``split_group``: a new group of ``ranks`` (this group's ranks, in the new order),
        joined through ``store`` by those ranks only; None when this rank is not in it."""
        ranks = [int(r) for r in ranks]
        if self.rank() not in ranks:
            return None
        key = tuple(ranks)
        serial = self._splits.get(key, 0)
        self._splits[key] = serial + 1
        prefix = f"oxccl-split/{'-'.join(map(str, ranks))}/{serial}/"
        timeout = getattr(opts, "_timeout", None) or self._timeout
        return _create(dist.PrefixStore(prefix, store), ranks.index(self.rank()), len(ranks), timeout)

    def eager_connect_single_device(self, device: Any = None) -> None:
        pass  # joined when created

    def shrink(self, ranks: Sequence[int], flags: int = 0, opts: Any = None) -> "ProcessGroupOxccl":
        """torch's ``dist.shrink_group(ranks_to_exclude, group)``: the backend of the group
        without ``ranks`` (this group's ranks; every survivor calls it, the excluded ranks do
        not), through ``Communicator.shrink``. The survivors agree through the store on who is
        gone; if that is more than ``ranks`` (another rank failed too), torch's renumbering
        would be wrong, so this raises ``oxccl.Error`` on every survivor alike:
        ``oxccl.torch.shrink(group)`` needs no list and takes the agreed set. The old group's
        communicator is left to the garbage collector (torch destroys the old group next, and
        a barrier there would wait for the excluded ranks)."""
        ranks = sorted({int(r) for r in ranks})
        new = self._comm.shrink(ranks)
        self._released = True
        if new.world_size != self.size() - len(ranks):
            raise _Error(
                f"rank {self.rank()}: dist.shrink_group({ranks}): the survivors agreed on "
                f"{new.world_size} ranks, not {self.size() - len(ranks)} (another rank failed "
                "too); use oxccl.torch.shrink(group), which takes the agreed set"
            )
        out = ProcessGroupOxccl(self._store, 0, 0, self._timeout, communicator=new)
        out.generation = self.generation + 1
        out._serial = time.monotonic()
        _GROUPS.add(out)
        return out

    def shutdown(self) -> None:
        """``destroy_process_group``: the communicator's destroy (a barrier, bounded by the
        group's timeout, skipped when the communicator already failed). A group whose peers
        failed or left cannot meet them there; teardown goes on, with a warning on stderr,
        as Gloo's does (a raise here would stop ``destroy_process_group`` half way). A group
        that ``dist.shrink_group`` replaced skips the barrier (its excluded ranks never come)."""
        if getattr(self, "_released", False):
            return
        try:
            self._comm.destroy()
        except _Error as e:
            print(f"oxccl WARN rank {self.rank()}: destroy_process_group: {e}", file=sys.stderr,
                  flush=True)

    # -- plumbing -----------------------------------------------------------------------
    def _issue(
        self,
        opts: Any,
        calls: Sequence[Callable[..., Any]],
        value: list,
        after: Optional[Callable[[], None]] = None,
    ) -> _Work:
        """Runs ``calls`` (each ``call(async_op) -> oxccl.Work | None``) now or submitted."""
        if not getattr(opts, "asyncOp", True) and self._coalescing is None:
            for call in calls:
                call(False)
            if after is not None:
                after()
            return _Work(None, value)
        try:
            works = [call(True) for call in calls]
        except _Error as e:
            return _failed(e, value)
        work = works[-1] if works else None
        # Calls run in order on the worker: the last one ending means all have. Earlier
        # failures would make the last one fail too (the communicator is then unusable);
        # still, check them when waiting.
        if len(works) > 1:
            first = works[:-1]
            prev_after = after

            def after_all() -> None:
                for w in first:
                    w.wait()
                if prev_after is not None:
                    prev_after()

            after = after_all
        w = _Work(work, value, after)
        if self._coalescing is not None:
            self._coalescing.append(w)
        return w

    # -- collectives --------------------------------------------------------------------
    def allreduce(self, tensors: list, opts: Any = None) -> _Work:
        op = _op(opts.reduceOp)
        if len(tensors) == 1 and self._coalescing is None and not _SCOPE and (
            self._compress is None
        ):
            # The common call (one tensor, exact, not coalescing), without the general path's
            # closures: a blocking one runs here, an async_op one is submitted.
            t = tensors[0]
            r = _real(t, op)
            # Small async_op calls run here too (eager), unless OXCCL_TORCH_EAGER_BYTES says
            # otherwise: see _EAGER_BYTES.
            if not getattr(opts, "asyncOp", True):
                self._comm.all_reduce(r, op)
                return _Work(None, tensors)
            try:
                if t.numel() * t.element_size() <= _EAGER_BYTES:
                    self._comm.all_reduce(r, op)
                    return _Work(None, tensors)
                return _Work(self._comm.all_reduce(r, op, async_op=True), tensors)
            except _Error as e:
                return _failed(e, tensors)
        return self._issue(opts, [self._allreduce_call(t, op) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> _Work:
        op = _op(opts.reduceOp)
        groups: dict = {}
        for t in tensors:
            # Complex tensors travel as their real view, exact (never compressed).
            groups.setdefault((t.dtype, t.is_complex()), []).append(t)
        calls = []
        flats = []
        for group in groups.values():
            flat = _cat([_real(t, op) for t in group])
            flats.append((flat, [_real(t, op) for t in group]))
            if group[0].is_complex():
                calls.append(lambda a, f=flat: self._comm.all_reduce(f, op, async_op=a))
                continue
            calls.append(self._allreduce_call(flat, op))

        def after() -> None:
            for flat, group in flats:
                off = 0
                for t in group:
                    n = t.numel()
                    t.copy_(flat[off : off + n].view_as(t))
                    off += n

        return self._issue(opts, calls, tensors, after)

    def broadcast(self, tensors: list, opts: Any = None) -> _Work:
        root = opts.rootRank
        comm = self._comm
        calls = [(lambda a, t=t: comm.broadcast(t, root, async_op=a)) for t in tensors]
        return self._issue(opts, calls, tensors)

    def reduce(self, tensors: list, opts: Any = None) -> _Work:
        op = _op(opts.reduceOp)
        root = opts.rootRank
        comm = self._comm
        calls = [
            (lambda a, t=_real(t, op): comm.reduce(t, root, op, async_op=a)) for t in tensors
        ]
        return self._issue(opts, calls, tensors)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> _Work:
        comm = self._comm
        n = self.size()
        calls = []
        copies = []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != n:
                raise InvalidArgument(
                    f"oxccl allgather: {len(outs)} output tensors for {n} ranks"
                )
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
            copies.append((flat, outs, inp.numel()))
            calls.append(lambda a, i=inp, f=flat: comm.all_gather(i, f, async_op=a))

        def after() -> None:
            for flat, outs, m in copies:
                for j, o in enumerate(outs):
                    o.copy_(flat[j * m : (j + 1) * m].view_as(o))

        return self._issue(opts, calls, output_tensors, after)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:  # noqa: A002
        return self._issue(opts, [self._all_gather_call(input, output)], [output])

    def _all_gather_call(self, inp: torch.Tensor, out: torch.Tensor) -> Callable[..., Any]:
        """An all-gather call; in place when ``inp`` is this rank's block of ``out`` (FSDP2's
        all-gather), through a copy when the two share memory otherwise."""
        comm = self._comm
        rel = _overlap(inp, out)
        if rel is None:
            return lambda a: comm.all_gather(inp, out, async_op=a)
        if rel == self.rank() * inp.numel() * inp.element_size() and inp.is_contiguous():
            return lambda a: comm.all_gather(out, async_op=a)
        copy = inp.clone()
        return lambda a: comm.all_gather(copy, out, async_op=a)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        calls = [self._all_gather_call(i, o) for o, i in zip(outputs, inputs)]
        return self._issue(opts, calls, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> _Work:
        op = _op(opts.reduceOp)
        comm = self._comm
        n = self.size()
        calls = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != n:
                raise InvalidArgument(
                    f"oxccl reduce_scatter: {len(ins)} input tensors for {n} ranks"
                )
            flat = _cat([_real(t, op) for t in ins])
            fmt = self._compress_for(out, op, "reduce_scatter")
            calls.append(
                lambda a, f=flat, o=_real(out, op), c=fmt: comm.reduce_scatter(
                    f, o, op, compress=c, async_op=a
                )
            )
        return self._issue(opts, calls, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:  # noqa: A002
        op = _op(opts.reduceOp)
        return self._issue(opts, [self._reduce_scatter_call(input, output, op)], [output])

    def _reduce_scatter_call(self, inp: torch.Tensor, out: torch.Tensor, op: Any) -> Callable[..., Any]:
        comm = self._comm
        i, o = _real(inp, op), _real(out, op)
        if _overlap(i, o) is not None:
            i = i.clone()  # the output is part of the input: reduce from a copy
        fmt = self._compress_for(inp, op, "reduce_scatter")
        if fmt is not None:
            return lambda a: comm.reduce_scatter(i, o, op, compress=fmt, async_op=a)
        return lambda a: comm.reduce_scatter(i, o, op, async_op=a)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        op = _op(opts.reduceOp)
        calls = [self._reduce_scatter_call(i, o, op) for o, i in zip(outputs, inputs)]
        return self._issue(opts, calls, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> _Work:
        comm = self._comm
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgument(
                f"oxccl alltoall: {len(input_tensors)} inputs and {len(output_tensors)} "
                f"outputs for {n} ranks"
            )
        flat_in = _cat(input_tensors)
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat_out = torch.empty(sum(recv), dtype=flat_in.dtype)

        def after() -> None:
            off = 0
            for t, m in zip(output_tensors, recv):
                t.copy_(flat_out[off : off + m].view_as(t))
                off += m

        if len(set(send)) == 1 and send == recv:
            call = lambda a: comm.all_to_all(flat_in, flat_out, async_op=a)  # noqa: E731
        else:
            call = lambda a: comm.all_to_allv(flat_in, send, flat_out, recv, async_op=a)  # noqa: E731
        return self._issue(opts, [call], output_tensors, after)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list,
        input_split_sizes: list,
        opts: Any = None,
    ) -> _Work:
        comm = self._comm
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            call = lambda a: comm.all_to_all(input, output, async_op=a)  # noqa: E731
        else:

            def counts(t: torch.Tensor, splits: list, what: str) -> list:
                rows = t.shape[0] if t.dim() > 0 else 1
                per_row = t.numel() // rows if rows else 0
                if not splits:
                    if rows % n:
                        raise InvalidArgument(
                            f"oxccl all_to_all_single: {what} has {rows} rows, not divisible "
                            f"by {n} ranks"
                        )
                    splits = [rows // n] * n
                if len(splits) != n or sum(splits) != rows:
                    raise InvalidArgument(
                        f"oxccl all_to_all_single: {what} split sizes {list(splits)} do not "
                        f"split its {rows} rows among {n} ranks"
                    )
                return [s * per_row for s in splits]

            send = counts(input, list(input_split_sizes), "the input")
            recv = counts(output, list(output_split_sizes), "the output")
            call = lambda a: comm.all_to_allv(input, send, output, recv, async_op=a)  # noqa: E731
        return self._issue(opts, [call], [output])

    alltoall_base = all_to_all_single

    def gather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> _Work:
        comm = self._comm
        root = opts.rootRank
        n = self.size()
        if len(input_tensors) != 1:
            raise InvalidArgument(f"oxccl gather: {len(input_tensors)} input tensors (1 expected)")
        inp = input_tensors[0]
        if self.rank() != root:
            return self._issue(
                opts, [lambda a: comm.gather(inp, None, root, async_op=a)], output_tensors
            )
        outs = output_tensors[0]
        if len(outs) != n:
            raise InvalidArgument(f"oxccl gather: {len(outs)} output tensors for {n} ranks")
        m = inp.numel()
        flat = torch.empty(n * m, dtype=inp.dtype)

        def after() -> None:
            for j, o in enumerate(outs):
                o.copy_(flat[j * m : (j + 1) * m].view_as(o))

        return self._issue(
            opts, [lambda a: comm.gather(inp, flat, root, async_op=a)], output_tensors, after
        )

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> _Work:
        comm = self._comm
        root = opts.rootRank
        n = self.size()
        if len(output_tensors) != 1:
            raise InvalidArgument(
                f"oxccl scatter: {len(output_tensors)} output tensors (1 expected)"
            )
        out = output_tensors[0]
        flat = None
        if self.rank() == root:
            ins = input_tensors[0]
            if len(ins) != n:
                raise InvalidArgument(f"oxccl scatter: {len(ins)} input tensors for {n} ranks")
            flat = _cat(ins)
        return self._issue(
            opts, [lambda a: comm.scatter(flat, out, root, async_op=a)], output_tensors
        )

    def barrier(self, opts: Any = None) -> _Work:
        comm = self._comm
        return self._issue(opts, [lambda a: comm.barrier(async_op=a)], _DONE_VALUE)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """Gloo's monitored barrier: every other rank sends to rank 0 and waits for rank 0's
        release; rank 0 waits for them all within ``opts.timeout`` (c10d hands BarrierOptions;
        a timedelta is taken too), then releases them. Rank 0's error names the first rank
        that did not come (every one with ``wait_all_ranks``), as Gloo's does; a rank that came
        gets no release then and raises within its own timeout, naming rank 0, rather than
        passing a barrier rank 0 gave up on. Every wait is bounded by the timeout."""
        timeout = _seconds(getattr(opts, "timeout", opts))
        if timeout is None:
            timeout = self._comm.get_timeout()
        n, me = self.size(), self.rank()
        if n == 1:
            return
        ms = int(timeout * 1000)
        comm = self._comm
        token = torch.zeros(1, dtype=torch.int32)
        if me != 0:
            try:
                sent = comm.send(token, 0, async_op=True, timeout=timeout)
                comm.recv(torch.zeros(1, dtype=torch.int32), 0, timeout=timeout)
                sent.wait(timeout + _SLACK)
            except _Error as e:
                raise _renamed(
                    e,
                    f"rank {me}: monitored_barrier: rank 0 did not release this rank within "
                    f"{ms} ms (it did not come, or it gave up on another rank): {e}",
                    0,
                ) from e
            return
        tokens = [torch.zeros(1, dtype=torch.int32) for _ in range(n)]
        works = {r: comm.recv(tokens[r], r, async_op=True, timeout=timeout) for r in range(1, n)}
        missing = []
        first: Optional[BaseException] = None
        for r, w in works.items():
            try:
                w.wait(timeout + _SLACK)  # the call's own timeout fires first, naming more
            except _Error as e:
                missing.append(r)
                first = first or e
                if not wait_all_ranks:
                    break
        if missing:
            who = (f"Rank {missing[0]}" if len(missing) == 1
                   else "Ranks " + ", ".join(map(str, missing)))
            raise _renamed(
                first,
                f"rank 0: monitored_barrier: {who} failed to pass monitoredBarrier in {ms} ms "
                f"({first})",
                missing[0],
            ) from first
        for w in [comm.send(token, r, async_op=True, timeout=timeout) for r in range(1, n)]:
            w.wait(timeout + _SLACK)

    # -- point to point -----------------------------------------------------------------
    # Sends and receives between two ranks match in the order each rank makes them (as with
    # NCCL). Inside a batch (``batch_isend_irecv``: one oxccl group) they also match by tag:
    # the batch runs its operations ordered by tag, keeping their order within a tag, so a
    # batch whose ranks list the same tags in different orders still pairs them by tag.
    def send(self, tensors: list, dst: int, tag: int = 0) -> _Work:
        return self._point("send", tensors, dst, tag)

    def recv(self, tensors: list, src: int, tag: int = 0) -> _Work:
        return self._point("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list, tag: int = 0) -> _Work:
        raise InvalidArgument(
            "oxccl recv from any source: not supported (a receive names its source rank)"
        )

    def _point(self, kind: str, tensors: list, peer: int, tag: int) -> _Work:
        if not 0 <= peer < self.size():
            raise InvalidArgument(f"oxccl {kind}: peer {peer} outside {self.size()} ranks")
        if self._p2p is not None:
            work = _Work(None, tensors)
            for t in tensors:
                self._p2p.append((int(tag), kind, t, peer, work))
            return work
        comm = self._comm
        call = comm.send if kind == "send" else comm.recv
        return _p2p([call(t, peer, async_op=True) for t in tensors], tensors)

    # -- coalescing (torch's _coalescing_manager with a device) -------------------------
    # Collectives made while coalescing are submitted at once (in order); sends and receives
    # wait for the end, which runs them as one group (``Communicator.batch``).
    def start_coalescing(self, device: Any = None) -> None:
        if self._coalescing is not None:
            raise InvalidArgument("oxccl: start_coalescing while already coalescing")
        self._coalescing = []
        self._p2p = []

    _start_coalescing = start_coalescing

    def end_coalescing(self, device: Any = None) -> _Work:
        if self._coalescing is None:
            raise InvalidArgument("oxccl: end_coalescing without start_coalescing")
        works, self._coalescing = self._coalescing, None
        p2p, self._p2p = self._p2p or [], None
        if p2p:
            p2p.sort(key=lambda op: op[0])  # by tag; stable: in order within a tag
            ops = [(kind, t, peer) for _, kind, t, peer, _ in p2p]
            batch = self._comm.batch(ops, async_op=True)
            self.batches += 1
            for w in {id(op[4]): op[4] for op in p2p}.values():
                w._work = batch
            works.append(_Work(batch, []))

        def after() -> None:
            for w in works:
                w.wait()

        last = works[-1]._work if works else None
        return _Work(last, [], after)

    _end_coalescing = end_coalescing


def _overlap(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """Where ``a``'s memory starts in ``b``'s (bytes) when the two share memory, else None."""
    if a.numel() == 0 or b.numel() == 0:
        return None
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    if a0 < b1 and b0 < a1:
        return a0 - b0
    return None


# How much longer than a call's own timeout a wait on it lasts: the call's timeout fires first
# (its error names the peer and the step); the wait's only backs it up.
_SLACK = 5.0


def _renamed(e: BaseException, message: str, peer: int) -> BaseException:
    """An exception of ``e``'s class with ``message``, ``e``'s rank and kind, and ``peer``."""
    out = type(e)(message)
    for k in ("rank", "kind"):
        setattr(out, k, getattr(e, k, None))
    out.peer = peer
    return out


def _p2p(works: list, tensors: list) -> _Work:
    if len(works) == 1:
        return _Work(works[0], tensors)
    first = works[:-1]

    def after() -> None:
        for w in first:
            w.wait()

    return _Work(works[-1], tensors, after)


# -- the DDP communication hook ---------------------------------------------------------------
def backend(group: Any = None, what: str = "oxccl.torch.backend") -> ProcessGroupOxccl:
    """The ``ProcessGroupOxccl`` behind ``group`` (None: the default group), e.g. to set its
    ``compress``; an InvalidArgument naming the backend the group has instead."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, ProcessGroupOxccl):
        return pg
    found = None
    try:
        found = pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend: reported below
        pass
    if isinstance(found, ProcessGroupOxccl):
        return found
    try:
        name = pg.name()
    except Exception:  # noqa: BLE001
        name = type(pg).__name__
    raise InvalidArgument(
        f"{what}: the process group's backend is {name!r}, not \"oxccl\": compression needs "
        "an oxccl group (init_process_group(\"oxccl\") or new_group(backend=\"oxccl\"))"
    )


class BfpState:
    """The state of ``bfp_hook``: the group, the format and, with error feedback, one residual
    per gradient bucket.

    ``process_group``: the oxccl group DDP runs on (None: the default group); ``compress``:
    "bfp8" (default), "bfp4", "bfp8/16", ...; ``error_feedback``: keep each rank's quantisation
    error ``e`` of each bucket and add it to the bucket's next gradient (``x = g + e``, then
    ``e = x - Q(x)``), so that what compression drops is sent later instead of lost (as
    PowerSGD and 1-bit Adam do). Residuals are keyed by bucket index and start again at zero
    when a bucket's size, type or parameters change (DDP rebuilds its buckets after the first
    step). A bad ``compress`` raises ValueError naming the allowed values.
    """

    def __init__(
        self,
        process_group: Any = None,
        compress: str = "bfp8",
        error_feedback: bool = True,
    ):
        fmt = _format(compress, "BfpState: compress")
        if fmt is None:
            raise ValueError(
                f"BfpState: compress={compress!r}: the hook compresses ({_COMPRESS_VALUES[:-7]}); "
                "for exact gradients register no hook"
            )
        self.process_group = process_group
        self.compress: str = fmt
        self.error_feedback = bool(error_feedback)
        self.residuals: dict = {}
        self._keys: dict = {}
        self._comm: Optional[_oxccl.Communicator] = None

    def communicator(self) -> _oxccl.Communicator:
        """The oxccl.Communicator the hook sums on (found on first use)."""
        if self._comm is None:
            self._comm = backend(self.process_group, "bfp_hook").communicator
        return self._comm

    def residual(self, index: int, grads: torch.Tensor, params: Any = ()) -> torch.Tensor:
        """Bucket ``index``'s residual, zeros when new or when the bucket changed."""
        key = (grads.numel(), grads.dtype, tuple(p.data_ptr() for p in params))
        e = self.residuals.get(index)
        if e is None or self._keys.get(index) != key:
            e = torch.zeros(grads.numel(), dtype=grads.dtype)
            self.residuals[index] = e
            self._keys[index] = key
        return e

    def __repr__(self) -> str:
        return (
            f"BfpState(compress={self.compress!r}, error_feedback={self.error_feedback}, "
            f"{len(self.residuals)} residuals)"
        )


def bfp_hook(state: BfpState, bucket: Any) -> torch.futures.Future:
    """A DDP communication hook: the bucket's gradients averaged over the ranks with a BFP
    compressed all-reduce, with error feedback when ``state.error_feedback``::

        ddp.register_comm_hook(oxccl.torch.BfpState(compress="bfp8"), oxccl.torch.bfp_hook)

    One call into oxccl per bucket (``Communicator.all_reduce(..., compress=, residual=)``):
    the residual's add, the encoding, the collective, the decoding and the division by the
    world size run fused and pipelined in chunks on the communicator's worker, with no pass
    over the bucket of their own. Per bucket and rank: ``x = g + e``; the ranks sum ``Q(x)``,
    ``x`` quantised at the block exponents they agree on (exactly, in integers: the same bits on
    every rank); the owner of each share of blocks rounds its sums once into the format; the
    bucket becomes the sum divided by the world size. With error feedback ``e = x - Q(x)``,
    and the owner of a share adds the sums' rounding ``S - Q'(S)`` to its ``e`` too, so that
    everything compression drops is sent by a later step: over ``k`` steps the applied
    averages add up to the average of the gradients minus the mean of the residuals left
    (each within ``u/2`` of its block, ``u`` the unit of the block at the agreed exponent,
    ``2^(e-(M-1))`` with ``M`` = 8 or 4 mantissa bits, plus ``u'/2`` on the owned share,
    ``u'`` the re-encoded sum's unit). Returns a ``torch.futures.Future`` completed with the
    bucket's tensor from the communicator's worker; float32, float16 and bfloat16 buckets
    (others raise InvalidArgument).
    """
    if not isinstance(state, BfpState):
        raise InvalidArgument(
            f"bfp_hook: the state is a {type(state).__name__}, not an oxccl.torch.BfpState"
        )
    t = bucket.buffer()
    index = bucket.index()
    if t.dtype not in _FLOATS:
        raise InvalidArgument(
            f"bfp_hook: bucket {index} holds {t.dtype} gradients; BFP compression sums float32, "
            "float16 or bfloat16"
        )
    comm = state.communicator()
    flat = t.view(-1)
    e = None
    if state.error_feedback:
        params = bucket.parameters() if hasattr(bucket, "parameters") else ()
        e = state.residual(index, flat, params)
    work = comm.all_reduce(
        flat, _oxccl.ReduceOp.AVG, compress=state.compress, residual=e, async_op=True
    )
    base, out = _errorable_future()

    def done(w: Any) -> None:
        exc = w.exception()
        if exc is None:
            base.set_result(t)
        else:
            base.set_exception(exc)  # out fails where DDP sees it (see _errorable_future)

    work.add_done_callback(done)
    return out


# DDP checks a hook's annotations as objects (this module's are strings).
bfp_hook.__annotations__ = {
    "state": BfpState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


# -- OXCCL_DDP_COMPRESS: DDP compressed across hosts without a code change ---------------------
def _ddp_compression(ddp: Any) -> None:
    """At a DDP module's first forward: registers ``bfp_hook`` (error feedback on) in the
    format ``OXCCL_DDP_COMPRESS`` names when its group is an "oxccl" group whose ranks span more
    than one host and the user registered no hook of their own; says at ``OXCCL_DEBUG=INFO``
    what it did and why."""
    ddp._oxccl_checked = True
    fmt = _env_format("OXCCL_DDP_COMPRESS")
    if fmt is None or ddp._comm_hooks or getattr(ddp, "_oxccl_builtin_hook", False):
        return
    try:
        pg = backend(ddp.process_group, "OXCCL_DDP_COMPRESS")
    except InvalidArgument as err:
        if _debug_info():
            _info(f"OXCCL_DDP_COMPRESS={fmt}: DDP left exact: {err}")
        return
    hosts = pg.communicator.hosts
    rank = pg.rank()
    if len(set(hosts)) < 2:
        if _debug_info():
            _info(
                f"rank {rank}: OXCCL_DDP_COMPRESS={fmt}: DDP left exact: its {len(hosts)} ranks "
                "share one host (shared memory is faster than the codec)"
            )
        return
    ddp.register_comm_hook(BfpState(ddp.process_group, compress=fmt), bfp_hook)
    if _debug_info():
        _info(
            f"rank {rank}: OXCCL_DDP_COMPRESS={fmt}: DDP averages its gradient buckets with "
            f"oxccl.torch.bfp_hook ({fmt}, error feedback) across {len(set(hosts))} hosts"
        )


def _install_ddp_hooks() -> None:
    """Wraps DDP's forward (the first call registers the hook) and its hook registration
    (which then knows a built-in hook was chosen)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "_oxccl_wrapped", False):
        return
    forward, builtin = DDP.forward, DDP._register_builtin_comm_hook

    @functools.wraps(forward)
    def wrapped_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_oxccl_checked", False):
            _ddp_compression(self)
        return forward(self, *inputs, **kwargs)

    @functools.wraps(builtin)
    def wrapped_builtin(self: Any, comm_hook_type: Any) -> Any:
        self._oxccl_builtin_hook = True
        return builtin(self, comm_hook_type)

    DDP.forward = wrapped_forward
    DDP._register_builtin_comm_hook = wrapped_builtin
    DDP._oxccl_wrapped = True


_GROUPS: "weakref.WeakSet[ProcessGroupOxccl]" = weakref.WeakSet()


def communicators() -> list:
    """The oxccl.Communicator of every live "oxccl" group of this process, oldest first
    (for tools and benchmarks that want to bypass torch.distributed)."""
    return [g.communicator for g in sorted(_GROUPS, key=lambda g: g._serial)]


def _create(store: Any, rank: int, size: int, timeout: Any) -> ProcessGroupOxccl:
    pg = ProcessGroupOxccl(store, rank, size, timeout)
    pg._serial = len(_GROUPS) + id(pg) * 0 + time.monotonic()
    _GROUPS.add(pg)
    return pg


def _register() -> None:
    if BACKEND in getattr(dist.Backend, "backend_list", []) or hasattr(dist.Backend, "OXCCL"):
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


_register()
_install_ddp_hooks()

# Elastic groups (issue 32): a new ProcessGroup after a shrink, a grow or a join.
from ._torch_elastic import backend_store, grow, is_failure, join, shrink, wrap  # noqa: E402
