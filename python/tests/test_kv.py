"""oxccl.kv's Mooncake-shaped TransferEngine, between two processes: this one (the initiator)
and a target process started per test (``Target``), which answers commands on its stdin.

Covers: writes and reads of managed buffers and of registered numpy/torch memory, checked byte
for byte, over tcp and shm, with the P2P handshake, an oxccl store and Redis as metadata;
synchronous, batched and asynchronous calls with status polling; a notification that arrives
after its data; how initialize() maps host names, protocols and timeouts; Mooncake's return
conventions with the message in last_error() and the ``oxccl.kv`` logger; a bad peer address;
an unregistered pointer; mismatched lists; a missing secret; a target killed while a transfer
is in flight; the GIL released while waiting; and the Mooncake-style example script."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import need

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SECRET = f"pytest-kv-{os.getpid()}"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OXCCL_SECRET", SECRET)
    for k in ("OXCCL_KV_PROTOCOL", "OXCCL_KV_ADDR", "OXCCL_KV_NAME", "OXCCL_KV_TIMEOUT",
              "OXCCL_KV_PEER_TIMEOUT", "OXCCL_KV_LANES", "MC_TRANSFER_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the target process ---------------------------------------------------------------------


def target_main(local: str, meta: str, proto: str, memory: str, size: str) -> None:
    """The target: one engine with one buffer of ``size`` bytes (managed, or registered numpy
    memory); reads JSON commands on stdin, answers one JSON line each on stdout."""
    from oxccl.kv import TransferEngine

    n = int(size)
    e = TransferEngine(peer_timeout=1.0, timeout=10.0)
    if e.initialize(local, meta, proto, "") != 0:
        print(json.dumps({"error": e.last_error()}), flush=True)
        return
    keep = None
    if memory == "numpy":
        import numpy as np

        keep = np.zeros(n, dtype=np.uint8)
        assert e.register_memory(keep) == 0, e.last_error()
        addr = keep.ctypes.data

        def read(off: int, ln: int) -> bytes:
            return keep[off : off + ln].tobytes()

        def fill(data: bytes) -> None:
            keep[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    else:
        addr = e.allocate_managed_buffer(n)
        assert addr != 0, e.last_error()

        def read(off: int, ln: int) -> bytes:
            return e.read_bytes_from_buffer(addr + off, ln)

        def fill(data: bytes) -> None:
            assert e.write_bytes_to_buffer(addr, data, len(data)) == 0, e.last_error()

    print(json.dumps({"segment": e.get_segment_name(), "port": e.get_rpc_port(),
                      "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "digest":
            out = {"digest": digest(read(cmd["off"], cmd["len"]))}
        elif op == "fill":
            fill(pattern(cmd["len"], cmd["seed"]))
            out = {"ok": True}
        elif op == "notify":
            # The data must be there when the notification is: digest it at once.
            deadline = time.monotonic() + cmd["wait"]
            got = []
            while not got and time.monotonic() < deadline:
                got = e.wait_notifies(deadline - time.monotonic())
            d = digest(read(cmd["off"], cmd["len"])) if got else None
            out = {"notifies": [[x.name, x.msg, x.sender] for x in got], "digest": d}
        elif op == "quit":
            break
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    e.close()


class Target:
    """A target process and its segment."""

    def __init__(self, meta: str, proto: str, memory: str = "managed", size: int = 4 * MiB,
                 local: str = "127.0.0.1") -> None:
        code = (
            f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_kv as m; "
            f"m.target_main(*sys.argv[1:])"
        )
        env = dict(os.environ, OXCCL_SECRET=SECRET, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, local, meta, proto, memory, str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )
        hello = self._read(30)
        assert "segment" in hello, hello
        self.segment: str = hello["segment"]
        self.port: int = hello["port"]
        self.addr: int = hello["addr"]
        self.size = size

    def _read(self, timeout: float) -> dict:
        result: list = []
        t = threading.Thread(target=lambda: result.append(self.p.stdout.readline()))
        t.daemon = True
        t.start()
        t.join(timeout)
        if not result or not result[0]:
            self.p.kill()
            raise AssertionError(f"target said nothing; stderr:\n{self.p.stderr.read()[-4000:]}")
        return json.loads(result[0])

    def ask(self, timeout: float = 30, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read(timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(10)
            except Exception:
                pass
        self.kill()


@pytest.fixture
def targets():
    started: list[Target] = []

    def start(*a, **k) -> Target:
        t = Target(*a, **k)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


@pytest.fixture(scope="module")
def store():
    from oxccl.kv import MetadataServer

    # The server reads the secret once, when it starts.
    old = os.environ.get("OXCCL_SECRET")
    os.environ["OXCCL_SECRET"] = SECRET
    try:
        s = MetadataServer()
    finally:
        if old is None:
            del os.environ["OXCCL_SECRET"]
        else:
            os.environ["OXCCL_SECRET"] = old
    with s:
        yield s


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of this module's own (skipped without one; a failure under CI=true)."""
    import shutil

    from conftest import IN_CI

    exe = os.environ.get("OXCCL_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not exe:
        msg = "redis-server is not installed (Debian: apt-get install redis-server)"
        if IN_CI:
            pytest.fail(msg + "; CI=true: nothing may skip")
        pytest.skip(msg)
    d = tmp_path_factory.mktemp("redis")
    port = free_port()
    p = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(d), "--logfile", str(d / "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        log = d / "redis.log"
        while "Ready to accept connections" not in (log.read_text() if log.exists() else ""):
            assert p.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        p.kill()
        p.wait()


class Stores:
    """The metadata services a test may use, started when first asked for."""

    def __init__(self, request) -> None:
        self.request = request

    @property
    def url(self) -> str:
        return self.request.getfixturevalue("store").url

    @property
    def addr(self) -> str:
        return self.request.getfixturevalue("store").addr

    @property
    def redis(self) -> str:
        return self.request.getfixturevalue("redis_url")


@pytest.fixture
def meta_servers(request) -> Stores:
    return Stores(request)


def metadata(kind: str, store) -> str:
    return {"p2p": lambda: "P2PHANDSHAKE", "store": lambda: store.url,
            "redis": lambda: store.redis}[kind]()


def local_for(kind: str) -> str:
    # With a metadata service the segment is named by local_hostname (as in Mooncake):
    # distinct ports give distinct names.
    return "127.0.0.1" if kind == "p2p" else f"127.0.0.1:{free_port()}"


def engine(kind: str, store, proto: str, **kw):
    from oxccl.kv import TransferEngine

    e = TransferEngine(**kw)
    assert e.initialize(local_for(kind), metadata(kind, store), proto, "") == 0, e.last_error()
    return e


# ---- data moves, byte for byte --------------------------------------------------------------


@pytest.mark.parametrize("meta", ["p2p", "store", "redis"])
@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_managed_buffers_write_and_read_byte_for_byte(targets, meta_servers, proto, meta):
    from oxccl.kv import TransferNotify, TransferOpcode

    store = meta_servers

    t = targets(metadata(meta, store), proto, local=local_for(meta))
    if meta == "p2p":
        assert t.segment == f"127.0.0.1:{t.port}"  # what SGLang and vLLM compute
    e = engine(meta, store, proto)
    try:
        assert e.get_first_buffer_address(t.segment) == t.addr
        n = 2 * MiB
        buf = e.allocate_managed_buffer(n)
        assert buf != 0
        data = pattern(n, 1)
        assert e.write_bytes_to_buffer(buf, data, n) == 0

        # One synchronous write (and one at an offset).
        assert e.transfer_sync_write(t.segment, buf, t.addr, n) == 0, e.last_error()
        assert t.ask(op="digest", off=0, len=n)["digest"] == digest(data)
        assert e.transfer_sync_write(t.segment, buf + 7, t.addr + n + 3, 1000) == 0
        assert t.ask(op="digest", off=n + 3, len=1000)["digest"] == digest(data[7:1007])

        # One synchronous read of what the target wrote itself.
        t.ask(op="fill", len=n, seed=2)
        assert e.transfer_sync_read(t.segment, buf, t.addr, n) == 0, e.last_error()
        assert e.read_bytes_from_buffer(buf, n) == pattern(n, 2)

        # A batch of 16 blocks, scattered in reverse order, then read back in one batch.
        blk = 64 << 10
        src = [buf + i * blk for i in range(16)]
        dst = [t.addr + (15 - i) * blk for i in range(16)]
        assert e.write_bytes_to_buffer(buf, data, n) == 0
        assert e.batch_transfer_sync_write(t.segment, src, dst, [blk] * 16) == 0
        want = b"".join(data[i * blk : (i + 1) * blk] for i in reversed(range(16)))
        assert t.ask(op="digest", off=0, len=16 * blk)["digest"] == digest(want)
        back = e.allocate_managed_buffer(16 * blk)
        assert e.batch_transfer_sync_read(
            t.segment, [back + i * blk for i in range(16)], dst, [blk] * 16) == 0
        assert e.read_bytes_from_buffer(back, 16 * blk) == data[: 16 * blk]

        # Asynchronous: two batches waited for together, one polled to completion.
        b1 = e.batch_transfer_async_write(t.segment, src[:8], dst[:8], [blk] * 8)
        b2 = e.batch_transfer_async(t.segment, [back], [t.addr + n], [blk], TransferOpcode.READ)
        assert b1 != 0 and b2 != 0, e.last_error()
        assert e.get_batch_transfer_status([b1, b2]) == 0, e.last_error()
        # The target's bytes at n..n+blk: zero but for the 1000 bytes written at n+3.
        assert e.read_bytes_from_buffer(back, blk) == (
            bytes(3) + data[7:1007] + bytes(blk - 1003))
        b3 = e.transfer_submit_write(t.segment, buf, t.addr + 3 * MiB, MiB)
        assert b3 != 0, e.last_error()
        polls = 0
        while (s := e.transfer_check_status(b3)) == 0:
            polls += 1
            time.sleep(0.0005)
        assert s == 1, e.last_error()
        assert t.ask(op="digest", off=3 * MiB, len=MiB)["digest"] == digest(data[:MiB])
        # Polling a batch with the oxccl addition: status, then free.
        b4 = e.batch_transfer_async_read(t.segment, [back], [t.addr], [blk])
        while not (st := e.get_batch_status(b4))["done"]:
            time.sleep(0.0005)
        assert st == dict(done=True, transferred=blk, completed=1, requests=1, error=None)
        assert e.free_batch(b4) == 0

        # A notification follows its data: the target digests as soon as it arrives.
        e.write_bytes_to_buffer(buf, pattern(n, 3), n)
        assert e.batch_transfer_sync(t.segment, [buf], [t.addr], [n], TransferOpcode.WRITE,
                                     TransferNotify("req-7", "kv done")) == 0, e.last_error()
        got = t.ask(op="notify", off=0, len=n, wait=10)
        assert got["notifies"] == [["req-7", "kv done", e.get_segment_name()]]
        assert got["digest"] == digest(pattern(n, 3))
    finally:
        e.close()


@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_registered_numpy_and_torch_memory(targets, store, proto):
    need("numpy")
    need("torch")
    import numpy as np
    import torch

    t = targets("P2PHANDSHAKE", proto, memory="numpy", size=MiB)
    e = engine("p2p", store, proto)
    try:
        n = 256 << 10
        # numpy by raw address (Mooncake's way), torch by the tensor itself (oxccl's addition).
        a = np.frombuffer(bytearray(pattern(n, 4)), dtype=np.uint8).copy()
        assert e.register_memory(a.ctypes.data, a.nbytes) == 0, e.last_error()
        tt = torch.zeros(n // 4, dtype=torch.float32)
        assert e.register_memory(tt) == 0, e.last_error()
        assert e.transfer_sync_write(t.segment, a.ctypes.data, t.addr + 5, n) == 0, e.last_error()
        assert t.ask(op="digest", off=5, len=n)["digest"] == digest(a.tobytes())
        assert e.transfer_sync_read(t.segment, tt.data_ptr(), t.addr + 5, n) == 0
        assert tt.numpy().tobytes() == a.tobytes()
        assert e.unregister_memory(tt) == 0
        assert e.unregister_memory(a.ctypes.data) == 0
        # Unregistered now: refused, with the reason.
        assert e.transfer_sync_write(t.segment, a.ctypes.data, t.addr, n) < 0
        assert "not inside memory registered" in e.last_error()
    finally:
        e.close()


def test_initialize_maps_hostnames_protocols_and_timeouts(monkeypatch):
    from oxccl.kv import TransferEngine

    # P2P: the segment is "host:rpc_port" as given (a host name stays a name), a fixed port
    # is the rpc port.
    a = TransferEngine()
    assert a.initialize("localhost", "P2PHANDSHAKE", "tcp", "") == 0, a.last_error()
    port = free_port()
    b = TransferEngine()
    assert b.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "auto", "") == 0, b.last_error()
    try:
        assert a.get_segment_name() == f"localhost:{a.get_rpc_port()}"
        assert b.get_segment_name() == f"127.0.0.1:{port}" and b.get_rpc_port() == port
        topo = json.loads(b.get_local_topology())
        assert topo["providers"] == ["shm", "tcp"] and topo["segment"] == b.get_segment_name()
        abuf, bbuf = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        a.write_bytes_to_buffer(abuf, b"x" * 4096, 4096)
        assert a.transfer_sync_write(b.get_segment_name(), abuf, bbuf, 4096) == 0, a.last_error()
        assert b.transfer_sync_read(a.get_segment_name(), bbuf, abuf + 1, 100) == 0, \
            b.last_error()
        assert b.read_bytes_from_buffer(bbuf, 4096) == b"x" * 4096
    finally:
        a.close()
        b.close()
    # The environment overrides the protocol the code names; Mooncake's MC_TRANSFER_TIMEOUT
    # stands in for OXCCL_KV_TIMEOUT.
    monkeypatch.setenv("OXCCL_KV_PROTOCOL", "tcp")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2.5")
    with TransferEngine() as c:
        assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0, c.last_error()
        assert c.get_engine().providers() == ["tcp"]
        assert c.get_engine().timeout == 2.5
    assert c.get_rpc_port() == -1 and "closed" in c.last_error()


def test_encrypt_keyword_and_the_notification_queue(monkeypatch):
    """initialize(..., encrypt=...) (keyword only; Mooncake's positional call unchanged): both
    ends on encrypt the tcp lanes; a peer that wants them in clear is refused, saying which
    side wants what; a bad value is named. A full notification queue drops the oldest and
    counts."""
    from oxccl.kv import TransferEngine, TransferNotify, TransferOpcode

    monkeypatch.setenv("OXCCL_KV_NOTIFY_QUEUE", "2")
    t, c, clear = TransferEngine(), TransferEngine(), TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "", encrypt=True) == 0, t.last_error()
    assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "", encrypt="on") == 0, c.last_error()
    # auto (the default): on-host lanes in clear.
    assert clear.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, clear.last_error()
    try:
        seg = t.get_segment_name()
        assert c.get_engine().lanes_encrypted(seg) is True
        tbuf, cbuf = t.allocate_managed_buffer(65536), c.allocate_managed_buffer(65536)
        for i in range(5):
            c.write_bytes_to_buffer(cbuf, bytes([i]) * 65536, 65536)
            assert c.batch_transfer_sync(seg, [cbuf], [tbuf], [65536], TransferOpcode.WRITE,
                                         TransferNotify("n", f"note-{i}")) == 0, c.last_error()
        deadline = time.monotonic() + 10
        while t.get_notifies_dropped() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.get_notifies_dropped() == 3
        assert [n.msg for n in t.get_notifies()] == ["note-3", "note-4"]
        assert t.read_bytes_from_buffer(tbuf, 65536) == bytes([4]) * 65536
        with pytest.raises(Exception, match=r"wants the lanes from 127\.0\.0\.1 .* encrypted "
                           r"\(OXCCL_ENCRYPT=on here\), the peer asked for them in clear"):
            clear.get_engine().lanes_encrypted(seg)
    finally:
        for e in (t, c, clear):
            e.close()
    bad = TransferEngine()
    assert bad.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "", encrypt="sometimes") == -1
    assert "encrypt=\"sometimes\"" in bad.last_error()


# ---- failures: Mooncake's codes, and the message -------------------------------------------


def test_bad_input_returns_negative_and_says_why(targets, store, caplog):
    from oxccl.kv import TransferEngine, TransferOpcode

    e = TransferEngine(timeout=1.0)
    # Before initialize.
    assert e.transfer_sync_write("127.0.0.1:1", 1, 2, 3) == -1
    assert "not initialized" in e.last_error()
    assert e.allocate_managed_buffer(10) == 0
    # Unsupported metadata service.
    assert e.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert "etcd" in e.last_error() and "P2PHANDSHAKE" in e.last_error()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1
    assert "carrier-pigeon" in e.last_error()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "mlx5_0") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice
    t = targets("P2PHANDSHAKE", "tcp")
    try:
        buf = e.allocate_managed_buffer(MiB)
        caplog.set_level(logging.WARNING, logger="oxccl.kv")
        # A pointer that was never registered.
        assert e.transfer_sync_write(t.segment, 0x1234, t.addr, 64) == -1
        assert "0x1234" in e.last_error() and "not inside memory registered" in e.last_error()
        assert any("0x1234" in r.getMessage() for r in caplog.records if r.name == "oxccl.kv")
        # The target's range is outside its buffer: refused before anything moves.
        assert e.transfer_sync_write(t.segment, buf, t.addr + 4 * MiB - 8, 64) == -1
        assert t.segment in e.last_error() and "not inside a registered buffer" in e.last_error()
        # Lists of different lengths.
        assert e.batch_transfer_sync_write(t.segment, [buf, buf], [t.addr], [8, 8]) == -1
        assert "differ in length" in e.last_error()
        assert e.batch_transfer_async_write(t.segment, [buf], [t.addr], []) == 0
        assert e.transfer_sync(t.segment, buf, t.addr, 8, 7) == -1
        assert "opcode" in e.last_error()
        assert e.transfer_check_status(987654) == -1 and "987654" in e.last_error()
        assert e.free_managed_buffer(0x42) == -1 and "0x42" in e.last_error()
        assert e.write_bytes_to_buffer(0x42, b"abc", 3) == -1
        assert e.read_bytes_from_buffer(0x42, 3) == b""
        # A peer nobody listens on: named in the message, within the (short) timeout.
        bad = f"127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        assert e.transfer_sync_write(bad, buf, t.addr, 64) == -1
        assert time.monotonic() - t0 < 5
        assert bad in e.last_error()
        assert e.get_first_buffer_address(bad) == 0 and bad in e.last_error()
        assert e.send_probe(bad) == -1 and e.send_probe(t.segment) == 0
        # Each thread has its own last error.
        seen = []
        th = threading.Thread(target=lambda: seen.append(e.last_error()))
        th.start()
        th.join()
        assert seen == [None]
    finally:
        e.close()
    assert e.transfer_sync_write(t.segment, 1, 2, 3) == -1 and "closed" in e.last_error()
    _ = TransferOpcode


def test_missing_secret_and_unknown_store_segment(monkeypatch, store):
    from oxccl.kv import TransferEngine

    # No secret set and no home for the per-user secret file: the error says what to set.
    monkeypatch.delenv("OXCCL_SECRET")
    monkeypatch.delenv("OXCCL_SECRET_FILE", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert "OXCCL_SECRET" in e.last_error()
    monkeypatch.setenv("OXCCL_SECRET", SECRET)
    e = TransferEngine(timeout=0.5)
    assert e.initialize(f"127.0.0.1:{free_port()}", store.addr, "tcp", "") == 0, e.last_error()
    try:
        assert e.get_first_buffer_address("nobody-here") == 0
        assert "nobody-here" in e.last_error()
    finally:
        e.close()


def test_raise_errors_raises_oxccl_exceptions(targets, store):
    import oxccl
    from oxccl.kv import TransferEngine

    e = TransferEngine(raise_errors=True, timeout=0.5)
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        with pytest.raises(oxccl.InvalidArgument, match="not inside memory registered"):
            e.transfer_sync_write(e.get_segment_name(), 0x1234, 0x5678, 8)
        with pytest.raises(oxccl.PeerFailed, match="not found"):
            e.transfer_sync_write(f"127.0.0.1:{free_port()}", 0x1234, 0x5678, 8)
    finally:
        e.close()


@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_killed_target_fails_the_transfer_within_the_timeout(targets, store, proto):
    t = targets("P2PHANDSHAKE", proto, size=64 * MiB)
    e = engine("p2p", store, proto, peer_timeout=1.0, timeout=3.0)
    try:
        n = 64 * MiB
        buf = e.allocate_managed_buffer(n)
        assert e.transfer_sync_write(t.segment, buf, t.addr, 4096) == 0, e.last_error()
        if proto == "tcp":
            # Frozen, the target takes no more bytes: a 512 MiB batch stays in flight.
            os.killpg(t.p.pid, signal.SIGSTOP)
            b = e.batch_transfer_async_write(t.segment, [buf] * 8, [t.addr] * 8, [n] * 8)
            assert b != 0, e.last_error()
            time.sleep(0.2)
            assert e.get_batch_status(b)["done"] is False
            t.kill()
            t0 = time.monotonic()
            assert e.get_batch_transfer_status([b]) == -1
        else:
            # shm writes are one memcpy: nothing stays in flight; the first call after the kill
            # must fail (not write into a dead process's memory and report success).
            t.kill()
            t0 = time.monotonic()
            assert e.transfer_sync_write(t.segment, buf, t.addr, 4096) == -1
        took = time.monotonic() - t0
        assert took < 3, took
        assert t.segment in e.last_error(), e.last_error()
        assert "died" in e.last_error() or "gone" in e.last_error(), e.last_error()
    finally:
        e.close()


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if not f.read().rsplit(") ", 1)[1].startswith("T"):
                    return False
        except FileNotFoundError:
            pass
    return True


def test_stopped_target_bounds_the_wait_by_the_callers_timeout(targets, store):
    # SIGSTOP: the target's sockets stay open and its kernel still takes the bytes, so nothing
    # looks dead; only the caller's timeout ends the wait (the engine's is 60 s here).
    t = targets("P2PHANDSHAKE", "tcp")
    e = engine("p2p", store, "tcp", timeout=60.0)
    try:
        n = 3 * 4096
        buf = e.allocate_managed_buffer(n)
        data = pattern(n, 7)
        assert e.write_bytes_to_buffer(buf, data, n) == 0
        assert e.transfer_sync_write(t.segment, buf, t.addr, 4096) == 0, e.last_error()
        os.killpg(t.p.pid, signal.SIGSTOP)
        try:
            # A signal stops each thread as it next runs: wait until all of them have.
            deadline = time.monotonic() + 10
            while not all_stopped(t.p.pid):
                assert time.monotonic() < deadline, "the target did not stop"
                time.sleep(0.001)
            t0 = time.monotonic()
            rc = e.transfer_sync_write(t.segment, buf + 4096, t.addr + 4096, 4096, timeout=0.3)
            took = time.monotonic() - t0
            assert rc == -1
            assert 0.3 <= took < 2.3, took
            err = e.last_error()
            for part in ("timed out", "batch ", t.segment, "1 of 1 requests (4096 B) outstanding",
                         "#0 WRITE of 4096 B"):
                assert part in err, (part, err)
            b = e.batch_transfer_async_write(t.segment, [buf + 8192], [t.addr + 8192], [4096])
            assert b != 0, e.last_error()
            t0 = time.monotonic()
            assert e.get_batch_transfer_status([b], timeout=0.2) == -1
            assert time.monotonic() - t0 < 2.2
            assert f"batch {b} to segment(s)" in e.last_error(), e.last_error()
        finally:
            os.killpg(t.p.pid, signal.SIGCONT)
        # Served again: the late WRITEs land, and the engine goes on.
        deadline = time.monotonic() + 10
        while t.ask(op="digest", off=0, len=n)["digest"] != digest(data):
            assert time.monotonic() < deadline, "the late WRITEs never landed"
            time.sleep(0.05)
        assert e.transfer_sync_read(t.segment, buf, t.addr + 4096, 4096, timeout=10) == 0, \
            e.last_error()
    finally:
        e.close()


@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_cancel_batch_takes_back_what_was_not_sent(targets, store, proto):
    t = targets("P2PHANDSHAKE", proto)
    e = engine("p2p", store, proto)
    try:
        # More small requests than a queue pair's window takes: most wait to be posted.
        blk, count = 256, 8192
        n = blk * count
        buf = e.allocate_managed_buffer(n)
        data = pattern(n, 9)
        assert e.write_bytes_to_buffer(buf, data, n) == 0
        held = pattern(n, 4)
        srcs = [buf + i * blk for i in range(count)]
        dsts = [t.addr + i * blk for i in range(count)]
        # The engine posts while this thread runs Python: on a loaded machine it may have posted
        # the whole batch before the cancel arrives. Such a trial must then have moved every
        # byte; the test asks that some trial out of 20 found requests left to take back.
        canceled = 0
        for _ in range(20):
            t.ask(op="fill", len=n, seed=4)  # what the target holds before
            b = e.batch_transfer_async_write(t.segment, srcs, dsts, [blk] * count)
            assert b != 0, e.last_error()
            canceled = e.cancel_batch(b)
            assert 0 <= canceled < count, (canceled, e.last_error())
            while not (st := e.get_batch_status(b))["done"]:
                time.sleep(0.0005)
            if canceled == 0:
                assert st["error"] is None, st
                assert t.ask(op="digest", off=0, len=n)["digest"] == digest(data)
                assert e.free_batch(b) == 0
                continue
            assert st["error"] is not None and "canceled" in st["error"], st
            # The posted requests are the batch's first ones (a segment's queue is in order):
            # they landed whole; the canceled rest left the target's bytes as they were.
            sent = count - canceled
            assert t.ask(op="digest", off=0, len=sent * blk)["digest"] == digest(data[: sent * blk])
            rest = t.ask(op="digest", off=sent * blk, len=n - sent * blk)["digest"]
            assert rest == digest(held[sent * blk:]), "a canceled request moved bytes"
            assert e.cancel_batch(b) == 0
            assert e.free_batch(b) == 0
            break
        assert canceled > 0, "in 20 trials the whole batch was posted before the cancel"
        assert e.transfer_sync_write(t.segment, buf, t.addr, 4096) == 0, e.last_error()
    finally:
        e.close()


def test_waits_release_the_gil(store):
    e = engine("p2p", store, "tcp")
    try:
        ticks = 0
        done = threading.Event()

        def waiter() -> None:
            e.wait_notifies(0.5)
            done.set()

        th = threading.Thread(target=waiter)
        th.start()
        while not done.is_set():
            ticks += 1
        th.join()
        assert ticks > 10_000  # the main thread ran while the other one waited
    finally:
        e.close()


# ---- the example ----------------------------------------------------------------------------


@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_mooncake_style_example_runs(proto, tmp_path):
    """The example runs as a Mooncake user runs it: no OXCCL_* variable at all, in a home
    that has no oxccl secret yet (the per-user secret file is made on first use)."""
    need("numpy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OXCCL_")}
    env.pop("XDG_CONFIG_HOME", None)
    env["HOME"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "kv_mooncake_style.py"), "--protocol", proto],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode: all blocks verified" in r.stdout, r.stdout + r.stderr
    secret = tmp_path / ".config" / "oxccl" / "secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / ".config" / "oxccl").stat().st_mode & 0o777 == 0o700
