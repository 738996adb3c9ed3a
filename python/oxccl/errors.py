"""The exceptions oxccl raises. Each carries the Rust library's message and the attributes
``rank`` (the rank that raised, when known), ``peer`` (the rank it names, when one) and
``kind`` (the class name)."""

from __future__ import annotations

__all__ = [
    "Error",
    "Timeout",
    "PeerFailed",
    "Mismatch",
    "Aborted",
    "ConfigError",
    "InvalidArgument",
]


class Error(RuntimeError):
    """Base of every oxccl error (also a RuntimeError)."""

    rank: int | None = None
    peer: int | None = None
    kind: str = "Error"


class Timeout(Error, TimeoutError):
    """A call, a wait or the rendezvous did not finish in time; the message names what it
    waited for (the peer, the step, the keys or ranks missing)."""


class PeerFailed(Error):
    """A peer died or its connection failed (``peer`` names it), or the rendezvous store
    went away."""


class Mismatch(Error):
    """Ranks called different collectives, or the same one with different counts, types,
    operators or roots; the message names both sides."""


class Aborted(Error):
    """The communicator was aborted, here or on a peer."""


class ConfigError(Error, ValueError):
    """A malformed setting (an ``OXCCL_*`` variable) or launcher environment."""


class InvalidArgument(Error, ValueError):
    """A bad argument: a buffer of the wrong size, type or layout, a rank out of range, an
    unsupported operator."""
