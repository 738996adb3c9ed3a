"""oxccl: collective communication over the RDMA programming model.

``Communicator`` joins a job (``Communicator.from_env()`` under a launcher, or
``Communicator(store=..., rank=..., world_size=...)`` over a rendezvous store such as torch's
``TCPStore``) and runs every collective on numpy arrays, CPU torch tensors, buffer-protocol
and DLPack objects, zero-copy, in place or out of place, blocking or with ``async_op=True``
(an ``oxccl.Work``). ``import oxccl.torch`` registers the ``torch.distributed`` backend
``"oxccl"``.
"""

from __future__ import annotations

from . import errors
from .errors import (
    Aborted,
    ConfigError,
    Error,
    InvalidArgument,
    Mismatch,
    PeerFailed,
    Timeout,
)
from ._oxccl import (
    Communicator,
    PendingInit,
    ReduceOp,
    Registration,
    Work,
    __version__,
    dtypes,
)

__all__ = [
    "Communicator",
    "PendingInit",
    "Registration",
    "Work",
    "ReduceOp",
    "dtypes",
    "errors",
    "Error",
    "Timeout",
    "PeerFailed",
    "Mismatch",
    "Aborted",
    "ConfigError",
    "InvalidArgument",
    "__version__",
]
