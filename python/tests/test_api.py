"""The Python API without torch.distributed: numpy arrays, bytearray/memoryview, torch
tensors and DLPack objects, in and out of place, async Work with wait/futures/callbacks,
the store adapter (torch's TCPStore and a plain-Python store), split, abort, the context
manager, and argument errors."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

import launch


def worker_api():
    import numpy as np

    import oxccl

    comm = oxccl.Communicator.from_env(timeout=30)
    rank, n = comm.rank, comm.world_size
    failures = []

    def expect(name, cond, detail=""):
        if not cond:
            failures.append(f"rank {rank}: {name} {detail}")

    def attempt(name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001
            failures.append(f"rank {rank}: {name} raised:\n{traceback.format_exc()}")

    def numpy_collectives():
        for dt in (np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
                   np.float32, np.float64):
            x = (np.arange(12) % 4 + rank + 1).astype(dt)
            every = [(np.arange(12) % 4 + r + 1).astype(dt) for r in range(n)]
            y = x.copy()
            comm.all_reduce(y, "max")
            expect(f"all_reduce max {dt.__name__}", (y == np.maximum.reduce(every)).all(), y)
            out = np.empty_like(x)
            r = comm.all_reduce(x, oxccl.ReduceOp.SUM, out=out)
            expect(f"all_reduce out {dt.__name__}", r is out and (out == sum(every)).all()
                   and (x == every[rank]).all())
            g = np.empty(12 * n, dtype=dt)
            comm.all_gather(x, g)
            expect(f"all_gather {dt.__name__}", (g == np.concatenate(every)).all())
            ip = np.zeros(12 * n, dtype=dt)
            ip[12 * rank:12 * (rank + 1)] = x
            comm.all_gather(ip)
            expect(f"all_gather in place {dt.__name__}", (ip == np.concatenate(every)).all())
            rs = (np.arange(6 * n) + rank).astype(dt)
            comm.reduce_scatter(rs)
            want = sum((np.arange(6 * n) + r).astype(dt) for r in range(n))
            expect(f"reduce_scatter in place {dt.__name__}",
                   (rs[6 * rank:6 * (rank + 1)] == want[6 * rank:6 * (rank + 1)]).all())
            b = x.copy() if rank == n - 1 else np.zeros_like(x)
            comm.broadcast(b, root=n - 1)
            expect(f"broadcast {dt.__name__}", (b == every[n - 1]).all())
            a = np.repeat(np.arange(n) + 10 * rank, 3).astype(dt)
            comm.all_to_all(a)
            expect(f"all_to_all in place {dt.__name__}",
                   (a == np.repeat(np.arange(n) * 10 + rank, 3).astype(dt)).all(), a)
        # bytes-like objects and the dtype override (bfloat16 as raw bytes).
        ba = bytearray([rank + 1] * 8)
        comm.all_reduce(ba)
        expect("bytearray uint8", list(ba) == [sum(range(1, n + 1))] * 8, list(ba))
        mv = memoryview(bytearray(np.full(4, 1.5, np.float32).tobytes()))
        comm.all_reduce(mv, dtype="float")
        expect("memoryview as float", np.frombuffer(mv, np.float32).tolist() == [1.5 * n] * 4)
        bf = np.array([0x3F80] * 4, dtype=np.uint16)  # bfloat16 1.0
        comm.all_reduce(bf, dtype="bfloat16")
        expect("bfloat16 via dtype=", bf.tolist() == [0x4000] * 4 if n == 2 else True, bf)
        # gather / scatter / send / recv
        gi = np.full(3, rank, np.int32)
        go = np.empty(3 * n, np.int32) if rank == 0 else None
        comm.gather(gi, go, root=0)
        if rank == 0:
            expect("gather", (go == np.repeat(np.arange(n), 3)).all(), go)
        so = np.empty(2, np.int64)
        comm.scatter(np.arange(2 * n, dtype=np.int64) if rank == 0 else None, so, root=0)
        expect("scatter", (so == [2 * rank, 2 * rank + 1]).all(), so)
        if n >= 2 and rank in (0, 1):
            buf = np.arange(5, dtype=np.float64) if rank == 0 else np.zeros(5)
            (comm.send if rank == 0 else comm.recv)(buf, 1 - rank)
            expect("send/recv", (buf == np.arange(5)).all(), buf)
        comm.barrier()

    def torch_and_dlpack():
        import torch

        t = torch.full((3, 4), float(rank + 1), dtype=torch.bfloat16)
        comm.all_reduce(t)
        expect("torch bf16", bool((t == sum(range(1, n + 1))).all()), t)

        class OnlyDLPack:
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, **kw):
                return self.t.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        d = torch.arange(6, dtype=torch.float16) + rank
        comm.all_reduce(OnlyDLPack(d))
        expect("DLPack float16", d.tolist() == [float(n * i + sum(range(n))) for i in range(6)], d)
        x = torch.ones(8)
        comm.all_reduce(OnlyDLPack(x[::2]), out=None) if False else None
        try:
            comm.all_reduce(x[::2])
            expect("non-contiguous tensor refused", False)
        except oxccl.InvalidArgument as e:
            expect("non-contiguous message", "not contiguous" in str(e) and "contiguous()" in str(e), e)
        try:
            comm.all_reduce(torch.zeros(2, dtype=torch.int16))
            expect("int16 refused", False)
        except oxccl.InvalidArgument as e:
            expect("int16 message", "torch.int16" in str(e), e)

    def async_work():
        x = np.full(1 << 16, rank + 1.0, np.float32)
        w = comm.all_reduce(x, "avg", async_op=True)
        expect("work repr", "all_reduce" in repr(w))
        expect("wait returns output", w.wait(30) is x)
        expect("avg", np.allclose(x, (n + 1) / 2), x[:3])
        expect("is_completed", w.is_completed() and w.is_success() and w.exception() is None)
        seen = []
        ev = threading.Event()
        w2 = comm.all_reduce(x, async_op=True)
        w2.add_done_callback(lambda work: (seen.append(work is w2), ev.set()))
        f = w2.get_future()
        expect("future result", f.result(30) is x)
        expect("callback ran with the work", ev.wait(10) and seen == [True], seen)
        works = [comm.all_reduce(np.full(4, float(i)), async_op=True) for i in range(20)]
        outs = [w.wait() for w in works]
        expect("20 queued calls in order", all((o == i * n).all() for i, o in enumerate(outs)))
        try:
            comm.all_reduce(x, async_op=True).wait(-1)
            expect("negative timeout refused", False)
        except ValueError:
            pass
        comm.barrier()

    def split_and_errors():
        sub = comm.split(rank % 2, key=n - rank)
        expect("split size", sub.world_size == len(range(rank % 2, n, 2)), sub)
        v = np.ones(3)
        sub.all_reduce(v)
        expect("split all_reduce", (v == sub.world_size).all())
        sub.destroy()
        none = comm.split(None)
        expect("split opt-out", none is None)
        for bad, exc, words in [
            (lambda: comm.all_reduce(np.zeros(3, np.int16)), oxccl.InvalidArgument, '"h"'),
            (lambda: comm.all_reduce(np.zeros(3, bool)), oxccl.InvalidArgument, '"?"'),
            (lambda: comm.all_reduce(np.zeros((4, 4))[:, 1]), oxccl.InvalidArgument, "contiguous"),
            (lambda: comm.all_reduce(np.zeros(3).view()[::-1]), oxccl.InvalidArgument, "contiguous"),
            (lambda: comm.all_reduce(np.zeros(3), "band"), ValueError, "band"),
            (lambda: comm.all_reduce(bytes(4)), oxccl.InvalidArgument, "read-only"),
            (lambda: comm.all_reduce(np.zeros(3), out=np.zeros(3, np.int32)), oxccl.InvalidArgument, "one type"),
            (lambda: comm.broadcast(np.zeros(3), root=n), oxccl.InvalidArgument, f"root {n}"),
            (lambda: comm.all_reduce(42), TypeError, "int"),
            (lambda: comm.reduce_scatter(np.zeros(n * 2 + 1)), oxccl.InvalidArgument, "equal blocks"),
            (lambda: comm.all_gather(np.zeros(4), np.zeros(4 * n + 1)), oxccl.InvalidArgument, "output"),
        ]:
            try:
                bad()
                expect(f"refused: {words}", False)
            except exc as e:
                expect(f"message names {words!r}", words in str(e), str(e))
        comm.barrier()  # argument errors leave the communicator usable

    attempt("numpy collectives", numpy_collectives)
    attempt("torch tensors and DLPack", torch_and_dlpack)
    attempt("async work", async_work)
    attempt("split and errors", split_and_errors)
    with comm:
        comm.barrier()
    expect("destroyed by the with block", "destroyed" in repr(comm))
    try:
        comm.barrier()
        expect("a destroyed communicator refuses calls", False)
    except oxccl.Error as e:
        expect("destroyed message", "destroyed" in str(e), e)
    launch.report({"failures": failures})


def worker_stores():
    """The store adapter: torch's TCPStore (as a user would hand it) and abort()."""
    import os

    import numpy as np
    import torch.distributed as dist

    import oxccl

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=__import__("datetime").timedelta(seconds=30))
    failures = []
    comm = oxccl.Communicator(store=store, rank=rank, world_size=n, timeout=30)
    x = np.full(7, float(rank))
    comm.all_reduce(x)
    if not (x == sum(range(n))).all():
        failures.append(f"rank {rank}: TCPStore all_reduce {x}")
    # abort() from another thread stops a call blocked here: rank 0 never joins the barrier.
    if rank != 0:
        t0 = time.monotonic()
        threading.Timer(0.5, comm.abort).start()
        try:
            comm.all_reduce(x, timeout=20)
            failures.append(f"rank {rank}: all_reduce survived abort()")
        except oxccl.Aborted as e:
            if time.monotonic() - t0 > 10:
                failures.append(f"rank {rank}: abort took {time.monotonic() - t0:.1f} s")
            if "abort" not in str(e).lower():
                failures.append(f"rank {rank}: abort message {e}")
        except oxccl.Error as e:
            failures.append(f"rank {rank}: abort raised {type(e).__name__}: {e}")
    else:
        time.sleep(2)
    store.set(f"done{rank}", b"1")
    store.wait([f"done{r}" for r in range(n)])
    launch.report({"failures": failures})


class DictStore:
    """A plain-Python store (the methods torch's stores have) shared by threads."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = bytes(v)
            self.cv.notify_all()

    def get(self, k):
        self.wait([k])
        return self.d[k]

    def add(self, k, delta):
        with self.cv:
            v = int(self.d.get(k, b"0")) + delta
            self.d[k] = str(v).encode()
            self.cv.notify_all()
            return v

    def check(self, keys):
        with self.cv:
            return all(k in self.d for k in keys)

    def wait(self, keys, timeout=None):
        t = timeout.total_seconds() if timeout is not None else 30
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.d for k in keys), t):
                raise TimeoutError(f"wait timeout: {keys}")

    def compare_set(self, k, expected, desired):
        with self.cv:
            cur = self.d.get(k)
            if (cur is None and expected == b"") or cur == expected:
                self.d[k] = bytes(desired)
                self.cv.notify_all()
                return bytes(desired)
            return cur if cur is not None else bytes(expected)

    def delete_key(self, k):
        with self.cv:
            return self.d.pop(k, None) is not None


def test_python_api(torch_available):
    ranks = launch.run("test_api", "worker_api", 3, timeout=120)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)


def test_torch_store_and_abort(torch_available):
    ranks = launch.run("test_api", "worker_stores", 2, timeout=90)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)


def test_plain_python_store_across_threads():
    import numpy as np

    import oxccl

    store, out, errs = DictStore(), {}, []

    def rank(r):
        try:
            with oxccl.Communicator(store=store, rank=r, world_size=2, timeout=20) as c:
                x = np.full(3, r + 1.0)
                c.all_reduce(x)
                out[r] = x.tolist()
        except Exception as e:  # noqa: BLE001
            errs.append(f"rank {r}: {e!r}")

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    assert out == {0: [3.0] * 3, 1: [3.0] * 3}


def test_rendezvous_timeout_names_the_missing_rank():
    import oxccl

    t0 = time.monotonic()
    with pytest.raises(oxccl.Timeout) as e:
        oxccl.Communicator(store=DictStore(), rank=0, world_size=2, timeout=1)
    assert time.monotonic() - t0 < 15
    assert "1" in str(e.value) and "2" in str(e.value), str(e.value)


def test_bad_constructor_arguments():
    import oxccl

    with pytest.raises(ValueError, match="world_size"):
        oxccl.Communicator(store=DictStore(), rank=0)
    with pytest.raises(TypeError, match="no method"):
        oxccl.Communicator(store=object(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="timeout"):
        oxccl.Communicator(store=DictStore(), rank=0, world_size=1, timeout=-1)
    with pytest.raises(oxccl.ConfigError):
        oxccl.Communicator(store=DictStore(), rank=3, world_size=2, timeout=2)


def worker_registered():
    """Registered buffers: correct results, bytes written in place over tcp (the stats say
    so), close and the with form, and an overlapping registration refused."""
    import numpy as np

    import oxccl

    comm = oxccl.Communicator.from_env(timeout=30)
    rank, n = comm.rank, comm.world_size
    failures = []

    def expect(name, cond, detail=""):
        if not cond:
            failures.append(f"rank {rank}: {name} {detail}")

    count = 4 << 20  # 16 MiB of float32: the ring's all-gather receives are announced
    x = (np.arange(count) % 7 + rank).astype(np.float32)
    want = sum((np.arange(count) % 7 + r).astype(np.float32) for r in range(n))
    out = np.zeros(count, np.float32)
    with comm.register(out) as reg:
        expect("nbytes", reg.nbytes == out.nbytes, reg)
        expect("addr", reg.addr == out.ctypes.data, reg)
        try:
            comm.register(out[100:200])
            expect("an overlapping registration is refused", False)
        except oxccl.InvalidArgument as e:
            expect("the refusal says why", "overlap" in str(e), str(e))
        before = comm.stats()
        for _ in range(2):
            out[:] = -1
            comm.all_reduce(x, out=out)
            expect("all_reduce into a registered output", (out == want).all())
        moved = {k: comm.stats()[k] - before[k] for k in before}
        expect("stats name what moved", set(moved) == {"sent", "placed", "copied", "reduced",
                                                         "local", "received_in_place"}, moved)
        # The all-gather half arrives once per call (two calls: the buffer's size), in place or
        # (a fragment that left before the announcement reached its sender) through a slot.
        expect("accounted", moved["received_in_place"] + moved["copied"] == out.nbytes, moved)
    expect("closed", reg.nbytes == 0 and "closed" in repr(reg), repr(reg))
    reg.close()  # again: a no-op
    # Deregistered: the same buffer works as a plain one.
    out[:] = -1
    comm.all_reduce(x, out=out)
    expect("after close", (out == want).all())
    comm.barrier()
    comm.destroy()
    launch.report({"failures": failures, "in_place": moved["received_in_place"]})


def test_registered_buffers_over_tcp():
    ranks = launch.run("test_api", "worker_registered", 2, timeout=120,
                       env={"OXCCL_PROVIDER": "tcp"})
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)
    assert sum(r.result["in_place"] for r in ranks) > 0, [r.result for r in ranks]
