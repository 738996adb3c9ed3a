"""Type stubs of the extension module oxccl._oxccl (the Rust bindings)."""

from __future__ import annotations

import concurrent.futures
from enum import IntEnum
from typing import Any, Callable, Mapping, Optional, Sequence

__version__: str

Buffer = Any
"""A buffer-protocol object (numpy array, bytearray, memoryview), a CPU torch tensor, or a
DLPack object; contiguous; of a type oxccl reduces (or reinterpreted with ``dtype=``)."""

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
    timeout: float
    def all_reduce(self, tensor: Buffer, op: Optional[Op] = None, *, out: Optional[Buffer] = None,
                   dtype: Optional[str] = None, async_op: bool = False,
                   timeout: Optional[float] = None) -> Any: ...
    def reduce_scatter(self, input: Buffer, output: Optional[Buffer] = None, op: Optional[Op] = None, *,
                       dtype: Optional[str] = None, async_op: bool = False,
                       timeout: Optional[float] = None) -> Any: ...
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
    def split(self, color: Optional[int], key: int = 0) -> Optional[Communicator]: ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...
    def __enter__(self) -> Communicator: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def _rust_loop(self, coll: str, nbytes: int, iters: int) -> float: ...
