"""Type stubs of the extension module oxccl._oxccl (the Rust bindings)."""

from __future__ import annotations

import concurrent.futures
from enum import IntEnum
from typing import Any, Callable, Mapping, Optional, Sequence, Union

__version__: str

Buffer = Any
"""A buffer-protocol object (numpy array, bytearray, memoryview), a CPU torch tensor, or a
DLPack object; contiguous; of a type oxccl reduces (or reinterpreted with ``dtype=``). The
8-bit floats come as torch ``float8_e4m3fn``/``float8_e5m2`` tensors (or DLPack tensors of
those types), or as raw bytes (e.g. a ``uint8`` numpy array) with ``dtype="f8e4m3"`` or
``dtype="f8e5m2"``: numpy has no 8-bit float."""

Op = "ReduceOp | str"

class ReduceOp(IntEnum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4

def dtypes() -> list[str]:
    """The data type names ``dtype=`` accepts (nccl-tests spelling; aliases such as
    ``float32``, ``bf16``, ``fp16`` also work)."""

def compress_format(name: Optional[str]) -> Optional[str]:
    """The canonical name of a compress= value ("bfp8", "bfp4/64"), None for None/"off"/"none";
    ValueError naming the allowed values otherwise."""
    ...
def _fp8_convert(data: bytes, dtype: str, widen: bool = False) -> bytes:
    """Test hook, not a stable API: native-endian float32 values rounded to 8-bit float codes
    (``f8e4m3``/``f8e5m2``) as the reductions round them, or (``widen=True``) codes widened to
    float32 bytes."""

def _cli_main(reexec: Sequence[str], argv: Sequence[str]) -> int:
    """Runs the ``oxccl`` command line (``argv[0]`` the program name) in this process and
    returns its exit code; ``reexec`` starts it again (behind ``oxccl._cli.main``)."""

class Work:
    """The handle of an ``async_op=True`` call."""

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Waits (GIL released) and returns the output object; raises the call's error, or
        ``oxccl.Timeout`` after ``timeout`` seconds (the call keeps running)."""
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> Optional[BaseException]: ...
    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """``fn(work)`` when the call ends (on oxccl's completion thread)."""
    def get_future(self) -> concurrent.futures.Future:
        """A future completing with the output object or the error."""
    def _complete_future(self, future: Any, value: Any = None) -> None: ...

class Communicator:
    """A group of ranks that run collectives together. Without a store, joins from the
    launcher's environment; with one (torch's TCPStore/FileStore/PrefixStore or any object
    with their methods), as ``rank`` of ``world_size``. A context manager: leaving the block
    destroys it (aborts it when an exception leaves the block)."""

    def __init__(
        self,
        store: Any = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
        job_id: str = "py",
        options: Optional[Mapping[str, str]] = None,
    ) -> None: ...
    @staticmethod
    def from_env(timeout: Optional[float] = None) -> Communicator: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def size(self) -> int: ...
    @property
    def hosts(self) -> list[str]: ...
    @property
    def providers(self) -> list[Optional[str]]: ...
    @property
    def encrypted(self) -> list[bool]: ...
    timeout: float
    def all_reduce(self, tensor: Buffer, op: Optional[Op] = None, *, out: Optional[Buffer] = None,
                   dtype: Optional[str] = None, async_op: bool = False,
                   timeout: Optional[float] = None, compress: Optional[str] = None,
                   residual: Optional[Buffer] = None) -> Any:
        """op over ranks, in place or into out. compress="bfp8" ("bfp4", "bfp8/16", ...; None
        or "off": exact) sums or averages float32/float16/bfloat16 compressed, in place, as
        all_reduce_compressed (with its residual=; no out, no timeout)."""
        ...
    def all_reduce_compressed(self, tensor: Buffer, compress: str = "bfp8", *,
                              op: Optional[Op] = None, dtype: Optional[str] = None,
                              residual: Optional[Buffer] = None,
                              async_op: bool = False) -> Any:
        """Sum (or op="avg": average) in place, compressed with block floating point ("bfp8",
        "bfp4", "bfp8/16", ...): float32, float16 or bfloat16; the same bits on every rank.
        residual (same type and length, zeros at first) is error feedback in the same call:
        x = tensor + residual is summed, and residual becomes what compression dropped of x
        (its quantisation, plus the sum's rounding on the share this rank re-encodes).
        Returns the tensor, or a Work with async_op=True."""
        ...
    def reduce_scatter(self, input: Buffer, output: Optional[Buffer] = None, op: Optional[Op] = None, *,
                       dtype: Optional[str] = None, async_op: bool = False,
                       timeout: Optional[float] = None, compress: Optional[str] = None,
                       residual: Optional[Buffer] = None) -> Any:
        """Rank r gets block r of op over every rank's input. compress="bfp8" ("bfp4", ...)
        sums or averages float32/float16/bfloat16 compressed on the wire (needs output; no
        timeout); residual (as long as input) is error feedback (input is left alone)."""
        ...
    def all_gather(self, input: Buffer, output: Optional[Buffer] = None, *, dtype: Optional[str] = None,
                   async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def broadcast(self, tensor: Buffer, root: int = 0, *, out: Optional[Buffer] = None,
                  dtype: Optional[str] = None, async_op: bool = False,
                  timeout: Optional[float] = None) -> Any: ...
    def reduce(self, tensor: Buffer, root: int = 0, op: Optional[Op] = None, *,
               out: Optional[Buffer] = None, dtype: Optional[str] = None, async_op: bool = False,
               timeout: Optional[float] = None) -> Any: ...
    def all_to_all(self, input: Buffer, output: Optional[Buffer] = None, *, dtype: Optional[str] = None,
                   async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def all_to_allv(self, input: Buffer, send_counts: Sequence[int], output: Buffer,
                    recv_counts: Sequence[int], *, dtype: Optional[str] = None,
                    async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def gather(self, input: Buffer, output: Optional[Buffer] = None, root: int = 0, *,
               dtype: Optional[str] = None, async_op: bool = False,
               timeout: Optional[float] = None) -> Any: ...
    def scatter(self, input: Optional[Buffer], output: Buffer, root: int = 0, *,
                dtype: Optional[str] = None, async_op: bool = False,
                timeout: Optional[float] = None) -> Any: ...
    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def send(self, tensor: Buffer, peer: int, *, dtype: Optional[str] = None,
             async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def recv(self, tensor: Buffer, peer: int, *, dtype: Optional[str] = None,
             async_op: bool = False, timeout: Optional[float] = None) -> Any: ...
    def register(self, buffer: Buffer) -> Registration: ...
    def stats(self) -> dict[str, int]: ...
    def batch(self, ops: Sequence[tuple[str, Buffer, int]], *, async_op: bool = False,
              timeout: Optional[float] = None) -> Optional[Work]: ...
    def split(self, color: Optional[int], key: int = 0) -> Optional[Communicator]: ...
    def shrink(self, exclude: Sequence[int] = ()) -> "Communicator":
        """A communicator of the survivors: exclude plus every rank a failure here named,
        agreed through the store by every survivor, renumbered in order."""
        ...
    def shrink_after_failure(self) -> "Communicator":
        """Aborts this communicator and shrinks to the ranks its failures did not name."""
        ...
    def grow(self, count: int = 1) -> "Communicator":
        """Admits ``count`` newcomers (``Communicator.join``); members keep their ranks."""
        ...
    @staticmethod
    def init_async(
        store: Any,
        rank: int,
        world_size: int,
        *,
        timeout: Optional[float] = None,
        job_id: str = "py",
        options: Optional[Mapping[str, str]] = None,
    ) -> PendingInit:
        """Starts init on a thread of its own; ``abort()`` stops it from any thread."""
        ...
    @staticmethod
    def join(
        store: Any,
        *,
        job_id: str = "py",
        timeout: Optional[float] = None,
        options: Optional[Mapping[str, str]] = None,
    ) -> "Communicator":
        """Joins a running job as a newcomer once its ranks call ``grow``."""
        ...
    @property
    def lineage(self) -> str:
        """The job id newcomers join under."""
        ...
    @property
    def failed_peers(self) -> list[int]: ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...
    def __enter__(self) -> Communicator: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def _rust_loop(self, coll: str, nbytes: int, iters: int) -> float: ...

class PendingInit:
    """A communicator's init running on a thread of its own (``Communicator.init_async``)."""

    def abort(self, reason: Optional[str] = None) -> None: ...
    def done(self) -> bool: ...
    def wait(self, timeout: Optional[float] = None) -> Communicator: ...

class Registration:
    """A buffer registered with a communicator (``Communicator.register``): calls on it skip
    per-call registration, and over tcp receives into it are written in place. Keeps the
    buffer alive until closed (``close()``, or the end of its ``with`` block)."""

    @property
    def addr(self) -> Optional[int]: ...
    @property
    def nbytes(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> Registration: ...
    def __exit__(self, *exc: Any) -> bool: ...

class KvEngine:
    """The oxccl-kv transfer engine (under ``oxccl.kv.TransferEngine``, which gives it
    Mooncake's API). Every method raises an ``oxccl.errors`` exception on failure; calls that
    block or move data release the GIL."""

    def __init__(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str = "auto",
        *,
        metadata_type: Optional[str] = None,
        name: Optional[str] = None,
        timeout: Optional[float] = None,
        peer_timeout: Optional[float] = None,
        lanes: Optional[int] = None,
        busy_poll: Optional[bool] = None,
        encrypt: Union[str, bool, None] = None,
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def handshake_addr(self) -> str: ...
    @property
    def rpc_port(self) -> int: ...
    @property
    def metadata(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def closed(self) -> bool: ...
    def providers(self) -> list[str]: ...
    def buffers(self) -> list[tuple[int, int]]: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, addr: int) -> None: ...
    def register_memory(self, addr: int, length: int) -> None:
        """The memory must stay allocated until unregistered."""
    def register_object(self, obj: Buffer) -> tuple[int, int]:
        """Registers a writable buffer/tensor (held until unregistered); ``(addr, length)``."""
    def unregister_memory(self, addr: int) -> None: ...
    def write_local(self, addr: int, data: bytes) -> None: ...
    def read_local(self, addr: int, length: int) -> bytes: ...
    def transfer(self, target: str, write: bool, buffer: int, peer_addr: int, length: int,
                 notify: Optional[bytes] = None, timeout: Optional[float] = None) -> None: ...
    def batch_transfer(self, target: str, write: bool, buffers: Sequence[int],
                       peer_addrs: Sequence[int], lengths: Sequence[int],
                       notify: Optional[bytes] = None,
                       timeout: Optional[float] = None) -> None: ...
    def submit(self, target: str, write: bool, buffers: Sequence[int],
               peer_addrs: Sequence[int], lengths: Sequence[int],
               notify: Optional[bytes] = None) -> int:
        """A batch id (never 0)."""
    def batch_status(self, batch: int) -> tuple[bool, int, int, int]:
        """``(done, transferred bytes, completed requests, requests)``; raises a failure."""
    def check_status(self, batch: int) -> int:
        """1 completed (freed), 0 running, -2 running past the timeout; raises a failure."""
    def wait(self, batch: int, timeout: Optional[float] = None) -> None: ...
    def wait_all(self, batches: Sequence[int], timeout: Optional[float] = None) -> None: ...
    def cancel_batch(self, batch: int) -> int:
        """Takes back the batch's requests not yet sent (they fail as canceled); how many."""
    def free_batch(self, batch: int) -> None: ...
    def segment_buffers(self, name: str) -> list[tuple[int, int]]: ...
    def open_segment(self, name: str) -> None: ...
    def get_notifies(self) -> list[tuple[str, bytes]]: ...
    def wait_notifies(self, timeout: float) -> list[tuple[str, bytes]]: ...
    def lanes_encrypted(self, name: str) -> bool:
        """Whether the tcp lanes to segment ``name`` (opened if it is not) are encrypted."""
    @property
    def notifies_dropped(self) -> int:
        """Notifications dropped because the queue (``OXCCL_KV_NOTIFY_QUEUE``) was full."""
    def close(self) -> None: ...

class KvMetadataServer:
    """An oxccl store for segment descriptors (``oxccl://ADDR``); needs ``OXCCL_SECRET``."""

    def __init__(self, bind: str = "127.0.0.1:0") -> None: ...
    @property
    def addr(self) -> str: ...
    def close(self) -> None: ...
