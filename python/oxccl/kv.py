"""oxccl.kv: a KV-cache transfer engine with the Python API of Mooncake's ``TransferEngine``.

Code written for Mooncake (``from mooncake.engine import TransferEngine``, as vLLM's and
SGLang's connectors use it) runs by changing the import::

    from oxccl.kv import TransferEngine        # was: from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    session = f"127.0.0.1:{engine.get_rpc_port()}"   # what peers open this engine by
    buf = engine.allocate_managed_buffer(1 << 20)
    ret = engine.transfer_sync_write(peer_session, buf, peer_addr, 4096)
    if ret < 0:
        print(engine.last_error())

Conventions kept from Mooncake, so that ported callers check results the same way:

- calls return ``0`` on success and a negative number (``-1``) on failure;
- calls that return an address or a batch id return ``0`` on failure;
- ``transfer_check_status`` returns 1 (completed), 0 (running), -1 (failed), -2 (running past
  the timeout); ``get_batch_transfer_status`` waits and returns 0 or -1;
- (oxccl's) the synchronous calls and ``get_batch_transfer_status`` take ``timeout=`` in
  seconds, bounding that one wait instead of the engine's timeout.

Failures are never silent: each one is logged as a warning on the ``oxccl.kv`` logger with
the engine's message (which names the segment, the request and the address), and
``last_error()`` returns that message (per thread, like ``errno``). ``TransferEngine(
raise_errors=True)`` raises the ``oxccl.errors`` exception instead of returning a code.

Mapping of ``initialize(local_hostname, metadata_server, protocol, device_name)``:

- ``local_hostname``: ``"IP"`` or ``"IP:port"`` (also a host name, ``"host[:port]"``): the
  address the handshake listener (Mooncake's RPC port, ``get_rpc_port()``) and the tcp
  provider bind; port 0 or none picks a free one.
- ``metadata_server``: ``"P2PHANDSHAKE"`` (no service: a segment is named
  ``"host:rpc_port"`` of its owner), ``"redis://host:port[/db]"``, or an oxccl store as
  ``"oxccl://host:port"`` or a bare ``"host:port"`` (see :class:`MetadataServer`). With a
  service, the segment is named by ``local_hostname`` as given, as in Mooncake. etcd and
  HTTP metadata are not supported (a clear error says so).
- ``protocol``: ``"tcp"``, ``"shm"`` (this host only), ``"auto"`` (shm inside the host, tcp
  across), or ``"rdma"``, which means ``"auto"`` here (the fastest path: kernel bypass inside
  a host, RDMA's model over tcp across hosts). ``OXCCL_KV_PROTOCOL`` overrides
  what the code asks for.
- ``device_name``: accepted and ignored (oxccl picks its providers itself).
- ``transport_hint`` arguments are accepted and ignored.

The job secret comes from ``OXCCL_SECRET`` or ``OXCCL_SECRET_FILE`` (every process of the
job needs the same one; a peer without it opens no segment). Other settings:
``OXCCL_KV_TIMEOUT`` (seconds; Mooncake's ``MC_TRANSFER_TIMEOUT`` is read when it is unset),
``OXCCL_KV_PEER_TIMEOUT``, ``OXCCL_KV_LANES``, ``OXCCL_KV_SLICE``, or the keyword arguments of
:class:`TransferEngine`.

Differences from Mooncake worth knowing:

- ``register_memory`` also takes a buffer-protocol object (numpy array, bytearray), a CPU torch
  tensor or a DLPack object; the engine then holds it until it is unregistered. A raw address
  must stay allocated until unregistered, as in Mooncake.
- ``write_bytes_to_buffer``/``read_bytes_from_buffer`` only touch memory registered with this
  engine (Mooncake copies to or from any address).
- Batch ids are opaque integers, never 0; ``get_batch_transfer_status`` and a completed or
  failed ``transfer_check_status`` free them, as in Mooncake.
- A notification's ``name`` and ``msg`` arrive as the sender gave them; ``sender`` also says
  which segment sent it (authenticated by the handshake).
- CUDA-stream methods (``transfer_write_on_cuda``...) are not provided.
"""

from __future__ import annotations

import enum
import json
import logging
import numbers
import threading
from typing import Any, Optional, Sequence, Union

from . import errors
from ._oxccl import KvEngine, KvMetadataServer

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "MetadataServer",
    "KvEngine",
]

logger = logging.getLogger("oxccl.kv")


class TransferOpcode(enum.IntEnum):
    """The direction of a transfer (Mooncake's ``TransferOpcode``; both spellings work)."""

    READ = 0
    WRITE = 1
    Read = 0
    Write = 1


# Notifications from this API carry the sender's (name, msg) pair: magic, 2-byte name length
# (little endian), name, msg. Other messages (from the Rust API) arrive as (sender, bytes).
_NOTIFY_MAGIC = b"\x00oxkv-mc1"


def _to_bytes(x: Union[str, bytes, bytearray, memoryview]) -> bytes:
    if isinstance(x, str):
        return x.encode("utf-8")
    return bytes(x)


class TransferNotify:
    """A notification (Mooncake's ``TransferNotify``): sent with a transfer, it arrives at the
    target after the transfer's data is visible there.

    ``name`` and ``msg`` are what the sender gave (strings; ``msg_bytes`` holds the message's
    bytes as sent); ``sender``, on received notifications, is the segment name of the engine
    that sent it."""

    __slots__ = ("name", "msg", "msg_bytes", "sender")

    def __init__(
        self,
        name: str = "",
        msg: Union[str, bytes] = "",
        *,
        sender: Optional[str] = None,
    ) -> None:
        self.name: str = name
        if isinstance(msg, str):
            self.msg: str = msg
            self.msg_bytes: bytes = msg.encode("utf-8")
        else:
            self.msg_bytes = bytes(msg)
            self.msg = self.msg_bytes.decode("utf-8", errors="replace")
        self.sender: Optional[str] = sender

    def _encode(self) -> bytes:
        name = self.name.encode("utf-8")
        if len(name) > 0xFFFF:
            raise errors.InvalidArgument(f"a notification name of {len(name)} bytes")
        return _NOTIFY_MAGIC + len(name).to_bytes(2, "little") + name + self.msg_bytes

    @staticmethod
    def _decode(sender: str, raw: bytes) -> "TransferNotify":
        m = len(_NOTIFY_MAGIC)
        if raw.startswith(_NOTIFY_MAGIC) and len(raw) >= m + 2:
            n = int.from_bytes(raw[m : m + 2], "little")
            if len(raw) >= m + 2 + n:
                name = raw[m + 2 : m + 2 + n].decode("utf-8", errors="replace")
                return TransferNotify(name, raw[m + 2 + n :], sender=sender)
        return TransferNotify(sender, raw, sender=sender)

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r}, sender={self.sender!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg_bytes) == (other.name, other.msg_bytes)


def _notify_bytes(notify: Any) -> Optional[bytes]:
    if notify is None:
        return None
    if isinstance(notify, TransferNotify):
        return notify._encode()
    if isinstance(notify, (str, bytes, bytearray, memoryview)):
        return _to_bytes(notify)
    raise TypeError(
        f"notify must be a TransferNotify (or str/bytes), not {type(notify).__name__}"
    )


class _NotInitialized:
    """Stands for the engine before ``initialize()`` (and after ``close()``)."""

    def __init__(self, why: str) -> None:
        self._why = why

    def __getattr__(self, attr: str) -> Any:
        raise errors.Error(self._why)


_NOT_INITIALIZED = _NotInitialized(
    "the transfer engine is not initialized: call initialize() first"
)
_CLOSED = _NotInitialized("the transfer engine is closed")


def _is_write(opcode: Any) -> bool:
    op = int(opcode)
    if op not in (0, 1):
        raise errors.InvalidArgument(
            f"opcode {opcode!r}: expected TransferOpcode.READ (0) or WRITE (1)"
        )
    return op == 1


class TransferEngine:
    """A KV-cache transfer engine with Mooncake's ``TransferEngine`` API (see the module's
    documentation for the mapping). Construct, then ``initialize(...)``.

    Keyword arguments (oxccl's, all optional) override the environment: ``timeout`` (seconds
    every wait and lookup may take; ``OXCCL_KV_TIMEOUT``), ``peer_timeout`` (how soon a dead
    peer is noticed; ``OXCCL_KV_PEER_TIMEOUT``), ``lanes`` (tcp connections per peer),
    ``busy_poll`` (waits poll without sleeping, for the shortest round trip at the cost of a
    core while they wait; ``OXCCL_KV_POLL=busy``), ``name`` (the segment name, instead of
    the one the metadata backend implies), and
    ``raise_errors`` (raise ``oxccl.errors`` exceptions instead of returning Mooncake's
    codes). Also a context manager: leaving the block closes the engine."""

    TransferOpcode = TransferOpcode

    def __init__(
        self,
        *,
        timeout: Optional[float] = None,
        peer_timeout: Optional[float] = None,
        lanes: Optional[int] = None,
        name: Optional[str] = None,
        raise_errors: bool = False,
        busy_poll: Optional[bool] = None,
    ) -> None:
        self._e: Any = _NOT_INITIALIZED
        self._options = dict(
            timeout=timeout, peer_timeout=peer_timeout, lanes=lanes, name=name, busy_poll=busy_poll
        )
        self._raise = raise_errors
        self._tls = threading.local()
        self._objects: dict[int, int] = {}

    # ---- errors -------------------------------------------------------------------------

    def _fail(self, what: str, exc: BaseException, ret: Any = -1) -> Any:
        msg = f"{what}: {exc}"
        self._tls.error = msg
        logger.warning("%s", msg)
        if self._raise:
            raise exc
        return ret

    def last_error(self) -> Optional[str]:
        """The message of the last call that failed in this thread (what the ``oxccl.kv``
        logger warned), or None. oxccl's addition to Mooncake's API."""
        return getattr(self._tls, "error", None)

    # ---- set-up -------------------------------------------------------------------------

    def initialize(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str = "auto",
        device_name: Optional[str] = "",
        *,
        encrypt: Union[str, bool, None] = None,
    ) -> int:
        """Starts the engine: binds ``local_hostname`` (``IP`` or ``IP:port``), connects to
        ``metadata_server`` (``P2PHANDSHAKE``, ``redis://...``, ``oxccl://host:port`` or
        ``host:port``) and serves ``protocol`` (``tcp``, ``rdma``, ``shm``, ``auto``).
        ``device_name`` is ignored. ``encrypt`` (oxccl's, keyword only): whether the tcp lanes
        are encrypted and authenticated, ``"auto"`` (lanes that leave the host), ``"on"``
        (``True``) or ``"off"`` (``False``); default ``OXCCL_ENCRYPT``, else auto; both ends
        must agree. The handshake is always encrypted. 0 on success, -1 on failure."""
        return self._init(
            local_hostname, metadata_server, protocol, None, "initialize", encrypt
        )

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: Optional[str],
        metadata_type: str,
        *,
        encrypt: Union[str, bool, None] = None,
    ) -> int:
        """``initialize`` with the metadata service's type given apart (``"redis"``,
        ``"oxccl"``, ``"p2p"``) for a ``metadata_server`` without a scheme."""
        return self._init(
            local_hostname,
            metadata_server,
            protocol,
            metadata_type,
            "initialize_ext",
            encrypt,
        )

    def _init(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        metadata_type: Optional[str],
        what: str,
        encrypt: Union[str, bool, None] = None,
    ) -> int:
        if isinstance(self._e, KvEngine):
            return self._fail(
                what, errors.Error("already initialized (close() it first)")
            )
        try:
            self._e = KvEngine(
                local_hostname or "",
                metadata_server,
                protocol or "auto",
                metadata_type=metadata_type,
                encrypt=encrypt,
                **self._options,
            )
        except Exception as exc:
            return self._fail(f"{what}({local_hostname!r}, {metadata_server!r})", exc)
        logger.debug("oxccl.kv: engine %r started: %r", self._e.name, self._e)
        return 0

    def close(self) -> None:
        """Closes the engine (its segment is withdrawn; peers' requests to it fail). oxccl's
        addition; dropping the object closes it too."""
        e, self._e = self._e, _CLOSED
        if isinstance(e, KvEngine):
            e.close()
        self._objects.clear()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_rpc_port(self) -> int:
        """The handshake listener's port (under ``P2PHANDSHAKE`` peers open this engine as
        ``"host:port"``); -1 before ``initialize``."""
        try:
            return self._e.rpc_port
        except Exception as exc:
            return self._fail("get_rpc_port", exc)

    def get_segment_name(self) -> str:
        """The segment name peers open this engine by (oxccl's addition); "" before
        ``initialize``."""
        try:
            return self._e.name
        except Exception as exc:
            return self._fail("get_segment_name", exc, "")

    def get_engine(self) -> Optional[KvEngine]:
        """The underlying ``oxccl._oxccl.KvEngine`` (raises instead of returning codes)."""
        return self._e if isinstance(self._e, KvEngine) else None

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """A JSON description of this engine: its providers, segment and handshake address."""
        try:
            e = self._e
            return json.dumps(
                {
                    "segment": e.name,
                    "handshake": e.handshake_addr,
                    "metadata": e.metadata,
                    "providers": e.providers(),
                }
            )
        except Exception as exc:
            return self._fail("get_local_topology", exc, "{}")

    # ---- memory -------------------------------------------------------------------------

    def allocate_managed_buffer(self, length: int) -> int:
        """``length`` bytes of zeroed memory registered with the engine (the zero-copy path);
        its address, or 0 on failure."""
        try:
            return self._e.allocate_managed_buffer(length)
        except Exception as exc:
            return self._fail(f"allocate_managed_buffer({length})", exc, 0)

    def free_managed_buffer(self, buffer_addr: int, length: int = 0) -> int:
        """Frees a managed buffer (``length`` is accepted for Mooncake's signature)."""
        try:
            self._e.free_managed_buffer(buffer_addr)
            return 0
        except Exception as exc:
            return self._fail(f"free_managed_buffer({buffer_addr:#x})", exc)

    def register_memory(
        self, buffer_addr: Any, capacity: Optional[int] = None, location: str = "*"
    ) -> int:
        """Registers memory for transfers and for peers to READ/WRITE: a raw address and
        ``capacity`` (the memory must stay allocated until unregistered), or a writable
        buffer-protocol object / CPU torch tensor / DLPack object (held by the engine until
        unregistered; ``capacity``, if given, must be its size in bytes). ``location`` is
        ignored. 0 on success, -1 on failure."""
        try:
            if isinstance(buffer_addr, numbers.Integral):  # int, numpy integers
                if capacity is None:
                    raise errors.InvalidArgument(
                        "register_memory(address, capacity): the capacity is missing"
                    )
                self._e.register_memory(int(buffer_addr), capacity)
                return 0
            addr, n = self._e.register_object(buffer_addr)
            if capacity is not None and capacity != n:
                self._e.unregister_memory(addr)
                raise errors.InvalidArgument(
                    f"register_memory: capacity {capacity} differs from the buffer's "
                    f"{n} bytes"
                )
            self._objects[id(buffer_addr)] = addr
            return 0
        except Exception as exc:
            return self._fail(f"register_memory({_describe(buffer_addr)}, {capacity})", exc)

    def unregister_memory(self, buffer_addr: Any) -> int:
        """Unregisters memory registered with ``register_memory`` (its address, or the
        object registered). 0 on success, -1 on failure."""
        try:
            if isinstance(buffer_addr, numbers.Integral):
                addr = int(buffer_addr)
            else:
                addr = self._objects.get(id(buffer_addr))
                if addr is None:
                    raise errors.InvalidArgument(
                        f"{_describe(buffer_addr)} was not registered with this engine"
                    )
            self._e.unregister_memory(addr)
            self._objects = {k: v for k, v in self._objects.items() if v != addr}
            return 0
        except Exception as exc:
            return self._fail(f"unregister_memory({_describe(buffer_addr)})", exc)

    def batch_register_memory(
        self,
        buffer_addresses: Sequence[int],
        capacities: Sequence[int],
        location: str = "*",
    ) -> int:
        """Registers several ranges; all or none (a failure unregisters the ones done)."""
        if len(buffer_addresses) != len(capacities):
            return self._fail(
                "batch_register_memory",
                errors.InvalidArgument(
                    f"{len(buffer_addresses)} addresses but {len(capacities)} capacities"
                ),
            )
        done: list[int] = []
        for a, c in zip(buffer_addresses, capacities):
            try:
                self._e.register_memory(a, c)
            except Exception as exc:
                for d in done:
                    try:
                        self._e.unregister_memory(d)
                    except Exception:
                        pass
                return self._fail(f"batch_register_memory({_describe(a)}, {c})", exc)
            done.append(a)
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters several ranges (all are tried); 0, or -1 if any failed."""
        ret = 0
        for a in buffer_addresses:
            if self.unregister_memory(a) < 0:
                ret = -1
        return ret

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies the first ``length`` bytes of ``src_ptr`` into registered memory at
        ``dest_address``. 0 on success, -1 on failure."""
        try:
            data = src_ptr if isinstance(src_ptr, bytes) else _to_bytes(src_ptr)
            if length > len(data) or length < 0:
                raise errors.InvalidArgument(
                    f"write_bytes_to_buffer: length {length} but {len(data)} bytes given"
                )
            self._e.write_local(dest_address, data if length == len(data) else data[:length])
            return 0
        except Exception as exc:
            return self._fail(f"write_bytes_to_buffer({_describe(dest_address)}, {length})", exc)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of registered memory at ``source_address`` (b"" on failure)."""
        try:
            return self._e.read_local(source_address, length)
        except Exception as exc:
            return self._fail(
                f"read_bytes_from_buffer({_describe(source_address)}, {length})", exc, b""
            )

    # ---- transfers ----------------------------------------------------------------------

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """Writes ``length`` bytes from local ``buffer`` to ``peer_buffer_address`` in segment
        ``target_hostname``, and waits, up to ``timeout`` seconds (oxccl's keyword; default
        the engine's). 0 on success, -1 on failure or timeout (:meth:`last_error` names the
        batch, the segment and what is outstanding; a late completion still lands)."""
        return self._sync(
            "transfer_sync_write to", target_hostname,
            lambda: self._e.transfer(
                target_hostname, True, buffer, peer_buffer_address, length, None, timeout
            ),
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """Reads ``length`` bytes at ``peer_buffer_address`` of segment ``target_hostname``
        into local ``buffer``, and waits. 0 on success, -1 on failure."""
        return self._sync(
            "transfer_sync_read from", target_hostname,
            lambda: self._e.transfer(
                target_hostname, False, buffer, peer_buffer_address, length, None, timeout
            ),
        )

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode,
        notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """One transfer of ``opcode``, then ``notify`` (if given) delivered to the target
        after the data. 0 on success, -1 on failure."""
        return self._sync(
            "transfer_sync with", target_hostname,
            lambda: self._e.transfer(
                target_hostname, _is_write(opcode), buffer, peer_buffer_address, length,
                _notify_bytes(notify), timeout,
            ),
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """Writes ``lengths[i]`` bytes from ``buffers[i]`` to ``peer_buffer_addresses[i]``
        for every i, as one batch, and waits. 0 on success, -1 on failure."""
        return self._sync(
            "batch_transfer_sync_write to", target_hostname,
            lambda: self._e.batch_transfer(
                target_hostname, True, buffers, peer_buffer_addresses, lengths, None, timeout
            ),
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """Reads ``lengths[i]`` bytes at ``peer_buffer_addresses[i]`` into ``buffers[i]`` for
        every i, as one batch, and waits. 0 on success, -1 on failure."""
        return self._sync(
            "batch_transfer_sync_read from", target_hostname,
            lambda: self._e.batch_transfer(
                target_hostname, False, buffers, peer_buffer_addresses, lengths, None, timeout
            ),
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: TransferOpcode,
        notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
        timeout: Optional[float] = None,
    ) -> int:
        """A batch of ``opcode``, then ``notify`` (if given) delivered after all its data.
        0 on success, -1 on failure."""
        return self._sync(
            "batch_transfer_sync with", target_hostname,
            lambda: self._e.batch_transfer(
                target_hostname, _is_write(opcode), buffers, peer_buffer_addresses, lengths,
                _notify_bytes(notify), timeout,
            ),
        )

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Submits a batch of writes; its id (for ``get_batch_transfer_status``), or 0 on
        failure."""
        return self._submit(
            "batch_transfer_async_write", target_hostname, True, buffers,
            peer_buffer_addresses, lengths, None,
        )

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Submits a batch of reads; its id, or 0 on failure."""
        return self._submit(
            "batch_transfer_async_read", target_hostname, False, buffers,
            peer_buffer_addresses, lengths, None,
        )

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: TransferOpcode,
        transport_hint: str = "",
        notify: Optional[TransferNotify] = None,
    ) -> int:
        """Submits a batch of ``opcode`` (oxccl also takes a ``notify``, delivered after the
        batch's data); its id, or 0 on failure."""
        try:
            write = _is_write(opcode)
        except Exception as exc:
            return self._fail("batch_transfer_async", exc, 0)
        return self._submit(
            "batch_transfer_async", target_hostname, write, buffers,
            peer_buffer_addresses, lengths, notify,
        )

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Submits one write; its batch id (for ``transfer_check_status``), or 0 on
        failure."""
        return self._submit(
            "transfer_submit_write", target_hostname, True, [buffer],
            [peer_buffer_address], [length], None,
        )

    def _sync(self, what: str, target: str, call: Any) -> int:
        """Runs ``call()``: 0, or -1 with the reason (``what`` and ``target``) kept for
        :meth:`last_error`."""
        try:
            call()
            return 0
        except Exception as exc:
            return self._fail(f"{what} {target!r}", exc)

    def _submit(
        self,
        what: str,
        target: str,
        write: bool,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
        notify: Any,
    ) -> int:
        try:
            return self._e.submit(
                target, write, buffers, peers, lengths, _notify_bytes(notify)
            )
        except Exception as exc:
            return self._fail(f"{what} to {target!r}", exc, 0)

    def get_batch_transfer_status(
        self, batch_ids: Sequence[int], timeout: Optional[float] = None
    ) -> int:
        """Waits (sleeping, GIL released) until every batch of ``batch_ids`` ended, within
        ``timeout`` seconds in all (default the engine's), and frees them. 0 when all
        completed, -1 when any failed or timed out (:meth:`last_error` names the batch, its
        segment and what is outstanding; a timed-out batch is freed once it ends)."""
        try:
            self._e.wait_all(list(batch_ids), timeout)
            return 0
        except Exception as exc:
            return self._fail("get_batch_transfer_status", exc)

    def transfer_check_status(self, batch_id: int) -> int:
        """Without blocking: 1 when the batch completed (it is freed), 0 while it runs, -2
        while it runs past the engine's timeout, -1 when it failed (it is freed)."""
        try:
            return self._e.check_status(batch_id)
        except Exception as exc:
            return self._fail(f"transfer_check_status({batch_id})", exc)

    def get_batch_status(self, batch_id: int) -> dict[str, Any]:
        """Where a batch stands (oxccl's addition; it is not freed): ``done``,
        ``transferred`` (bytes), ``completed`` and ``requests`` (counts), ``error`` (the
        message when it failed, else None)."""
        try:
            done, transferred, completed, n = self._e.batch_status(batch_id)
            return dict(
                done=done, transferred=transferred, completed=completed, requests=n, error=None
            )
        except Exception as exc:
            self._fail(f"get_batch_status({batch_id})", exc, None)
            return dict(
                done=True, transferred=0, completed=0, requests=0, error=self.last_error()
            )

    def cancel_batch(self, batch_id: int) -> int:
        """Cancels a batch (oxccl's addition, as NIXL's release of a transfer in progress):
        its requests not yet sent fail as canceled and never move, those in flight end as
        they end, and no notification goes. Returns how many requests were taken back, or
        -1 (see ``last_error``). The batch stays until ``free_batch``."""
        try:
            return self._e.cancel_batch(batch_id)
        except Exception as exc:
            return self._fail(f"cancel_batch({batch_id})", exc)

    def free_batch(self, batch_id: int) -> int:
        """Forgets an ended batch (oxccl's addition, after ``get_batch_status``)."""
        try:
            self._e.free_batch(batch_id)
            return 0
        except Exception as exc:
            return self._fail(f"free_batch({batch_id})", exc)

    # ---- segments and notifications -----------------------------------------------------

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of segment ``segment_name``'s first buffer (its lowest address), as its
        owner says now; 0 when the segment is not found or has no buffer."""
        try:
            bufs = self._e.segment_buffers(segment_name)
        except Exception as exc:
            return self._fail(f"get_first_buffer_address({segment_name!r})", exc, 0)
        if not bufs:
            return self._fail(
                f"get_first_buffer_address({segment_name!r})",
                errors.Error(f"segment {segment_name!r} has no registered buffer"),
                0,
            )
        return bufs[0][0]

    def get_segment_buffers(self, segment_name: str) -> list[tuple[int, int]]:
        """``(address, length)`` of every buffer of segment ``segment_name`` (oxccl's
        addition); [] on failure."""
        try:
            return self._e.segment_buffers(segment_name)
        except Exception as exc:
            return self._fail(f"get_segment_buffers({segment_name!r})", exc, [])

    def send_probe(self, peer_server_name: str) -> int:
        """Whether segment ``peer_server_name`` answers now (one round trip to its owner):
        0 when it does, -1 otherwise."""
        try:
            self._e.segment_buffers(peer_server_name)
            return 0
        except Exception as exc:
            return self._fail(f"send_probe({peer_server_name!r})", exc)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Opens (connects to) segment ``segment_name`` ahead of its first transfer."""
        try:
            self._e.open_segment(segment_name)
            return 0
        except Exception as exc:
            return self._fail(f"warmup_efa_segment({segment_name!r})", exc)

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications that arrived since the last call (each after its transfer's
        data)."""
        try:
            raw = self._e.get_notifies()
        except Exception as exc:
            return self._fail("get_notifies", exc, [])
        return [TransferNotify._decode(s, m) for s, m in raw]

    def wait_notifies(self, timeout: float) -> list[TransferNotify]:
        """Waits up to ``timeout`` seconds (sleeping, GIL released) for a notification, then
        takes all that arrived (oxccl's addition); [] when none came."""
        try:
            raw = self._e.wait_notifies(timeout)
        except Exception as exc:
            return self._fail("wait_notifies", exc, [])
        return [TransferNotify._decode(s, m) for s, m in raw]

    def get_notifies_dropped(self) -> int:
        """How many notifications were dropped because nobody took them and the queue
        (``OXCCL_KV_NOTIFY_QUEUE``, 4096 by default) was full: the oldest go first (oxccl's
        addition); -1 before ``initialize``."""
        try:
            return self._e.notifies_dropped
        except Exception as exc:
            return self._fail("get_notifies_dropped", exc)

    def __repr__(self) -> str:
        e = self._e
        if isinstance(e, KvEngine):
            return f"oxccl.kv.TransferEngine({e.name!r}, metadata={e.metadata!r})"
        return "oxccl.kv.TransferEngine(not initialized)"


def _describe(x: Any) -> str:
    if isinstance(x, numbers.Integral):
        return hex(int(x))
    return type(x).__name__


class MetadataServer:
    """An oxccl store serving segment descriptors from this process (Mooncake's metadata
    server, oxccl flavour): engines initialized with ``metadata_server=server.url`` publish
    to it and find each other in it. It needs the job secret (``OXCCL_SECRET``). A context
    manager; ``close()`` stops it."""

    def __init__(self, bind: str = "127.0.0.1:0") -> None:
        self._s = KvMetadataServer(bind)

    @property
    def addr(self) -> str:
        """``host:port`` it listens on."""
        return self._s.addr

    @property
    def url(self) -> str:
        """``oxccl://host:port``: what ``initialize`` takes as ``metadata_server``."""
        return f"oxccl://{self._s.addr}"

    def close(self) -> None:
        """Stops serving."""
        self._s.close()

    def __enter__(self) -> "MetadataServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
