"""Failures through torch.distributed: a killed rank is named on every survivor within the
timeout; ranks that disagree on a shape get an error naming both; bad arguments (a
non-contiguous tensor, an unsupported dtype or operator) raise clear errors."""

from __future__ import annotations

import os
import signal
import time

import launch
import pytest

TIMEOUT = 30


def worker_killed():
    import torch
    import torch.distributed as dist

    import oxccl
    import oxccl.torch  # noqa: F401

    dist.init_process_group("oxccl")
    rank = dist.get_rank()
    t = torch.ones(1 << 12)
    dist.all_reduce(t)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
            time.sleep(0.01)
        launch.report({"raised": None})
    except Exception as e:  # noqa: BLE001
        launch.report({
            "raised": type(e).__name__,
            "oxccl_error": isinstance(e, oxccl.Error),
            "peer": getattr(e, "peer", None),
            "message": str(e),
            "seconds": time.monotonic() - t0,
        })
    os._exit(0)  # the group is broken; do not wait on it at exit


def test_killed_rank_is_named_on_every_survivor(torch_available):
    ranks = launch.run("test_failures", "worker_killed", 3, timeout=120,
                       env={"OXCCL_TIMEOUT": str(TIMEOUT)})
    assert ranks[2].returncode == -signal.SIGKILL, launch.explain(ranks)
    for r in ranks[:2]:
        assert r.returncode == 0 and r.result, launch.explain(ranks)
        res = r.result
        assert res["raised"] == "PeerFailed" and res["oxccl_error"], res
        assert res["peer"] == 2 and "rank 2" in res["message"], res
        assert res["seconds"] < TIMEOUT, res


def worker_mismatch_and_bad_args():
    import torch
    import torch.distributed as dist

    import oxccl
    import oxccl.torch  # noqa: F401

    dist.init_process_group("oxccl")
    rank = dist.get_rank()
    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = [type(e).__name__, str(e)]

    catch("non_contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()))
    catch("int16", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)))
    catch("bool", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool)))
    catch("band", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND))
    catch("premul", lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0)))
    # Tags are honoured (torch.distributed.pipelining sends with tags), not refused.
    if rank == 0:
        dist.send(torch.full((1,), 7.0), 1, tag=7)
        out["tag"] = 7.0
    else:
        got = torch.zeros(1)
        dist.recv(got, 0, tag=7)
        out["tag"] = got.item()
    # The group is still usable after argument errors.
    t = torch.ones(3)
    dist.all_reduce(t)
    out["usable"] = t.tolist()
    # Shapes that differ across ranks: rank 0 has 4 elements, rank 1 has 5.
    catch("mismatch", lambda: dist.all_reduce(torch.ones(4 + rank)))
    launch.report(out)
    os._exit(0)


def test_mismatch_and_bad_arguments(torch_available):
    ranks = launch.run("test_failures", "worker_mismatch_and_bad_args", 2, timeout=90,
                       env={"OXCCL_TIMEOUT": str(TIMEOUT)})
    assert all(r.returncode == 0 and r.result for r in ranks), launch.explain(ranks)
    for r in ranks:
        o = r.result
        assert o["usable"] == [2.0] * 3, o
        want = {
            "non_contiguous": "not contiguous",
            "int16": "torch.int16",
            "bool": "torch.bool",
            "band": "BAND",
            "premul": "PREMUL_SUM",
        }
        assert o["tag"] == 7.0, o
        for case, words in want.items():
            assert o[case] is not None, (case, o)
            assert o[case][0] == "InvalidArgument" and words in o[case][1], (case, o[case])
        kind, msg = o["mismatch"]
        assert kind == "Mismatch", o["mismatch"]
        # Both sides are named: the two ranks and both counts.
        assert "rank 0" in msg and "rank 1" in msg and "4" in msg and "5" in msg, msg


def worker_shrink():
    """4 ranks over oxccl.Communicator; rank 1 is SIGKILLed; the survivors catch PeerFailed,
    shrink and go on: their all-reduce equals the sum of the survivors' values."""
    import numpy as np

    import oxccl

    comm = oxccl.Communicator.from_env()
    rank = comm.rank
    x = np.full(1000, rank + 1, np.float32)
    comm.all_reduce(x)
    if rank == 1:
        # After the others have finished the first call too (it could still be moving their
        # last bytes), so that the failure lands in the loop below.
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"first": float(x[0])}
    try:
        for _ in range(1000):
            comm.all_reduce(np.ones(1 << 14, np.float32))
            time.sleep(0.005)
    except oxccl.Error as e:
        # PeerFailed naming rank 1, or Aborted when a faster survivor's shrink_after_failure
        # stopped the communicator first (that rank then learns who is gone from the others).
        out["raised"] = f"{type(e).__name__}: {e}"
        out["failed_peers"] = comm.failed_peers
    t0 = time.monotonic()
    small = comm.shrink_after_failure()
    out["shrink_s"] = time.monotonic() - t0
    out["new_rank"], out["new_size"] = small.rank, small.world_size
    y = np.full(1000, rank + 1, np.float32)
    small.all_reduce(y)
    out["sum"] = float(y[0])
    # A rank outside the communicator is refused by name.
    try:
        small.shrink([7])
        out["bad"] = None
    except oxccl.InvalidArgument as e:
        out["bad"] = str(e)
    small.destroy()
    launch.report(out)
    os._exit(0)


def test_survivors_shrink_and_go_on():
    ranks = launch.run("test_failures", "worker_shrink", 4, timeout=120,
                       env={"OXCCL_TIMEOUT": "10"})
    assert ranks[1].returncode == -signal.SIGKILL, launch.explain(ranks)
    survivors = [r for i, r in enumerate(ranks) if i != 1]
    for new, r in enumerate(survivors):
        assert r.returncode == 0 and r.result, launch.explain(ranks)
        res = r.result
        assert res["first"] == 10.0, res
        # Ranks 0, 2, 3 become 0, 1, 2; 1 + 3 + 4 = 8.
        assert (res["new_rank"], res["new_size"]) == (new, 3), launch.explain(ranks)
        assert res["sum"] == 8.0, res
        assert res["shrink_s"] < 10, res
        assert res["bad"] and "7" in res["bad"], res
        # Each survivor's call failed: naming rank 1, or aborted by a faster survivor's shrink
        # (it still learns from the others who is gone).
        assert res["raised"].startswith(("PeerFailed", "Aborted")), res
        if res["raised"].startswith("PeerFailed"):
            assert "rank 1" in res["raised"] and res["failed_peers"] == [1], res


def worker_grow():
    """Ranks 0 and 1 run a job over torch's TCPStore; process 2 joins it as a newcomer
    (``Communicator.join``) when they call ``grow``; the three all-reduce."""
    import numpy as np
    from torch.distributed import TCPStore

    import oxccl

    me = int(os.environ["RANK"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    out = {}
    if me < 2:
        store = TCPStore(host, port, is_master=me == 0, wait_for_workers=False)
        comm = oxccl.Communicator(store=store, rank=me, world_size=2, job_id="grow-test")
        out["lineage"] = comm.lineage
        x = np.full(8, me + 1, np.float32)
        comm.all_reduce(x)
        out["before"] = float(x[0])
        # An argument error names the count.
        try:
            comm.grow(0)
            out["zero"] = None
        except oxccl.InvalidArgument as e:
            out["zero"] = str(e)
        t0 = time.monotonic()
        big = comm.grow(1)
    else:
        store = TCPStore(host, port, is_master=False)
        # Nobody admits a newcomer of another job: it withdraws within its timeout.
        t0 = time.monotonic()
        try:
            oxccl.Communicator.join(store, job_id="no-such-job", timeout=0.5)
            out["stranger"] = None
        except oxccl.Error as e:
            out["stranger"] = [type(e).__name__, str(e), time.monotonic() - t0]
        t0 = time.monotonic()
        big = oxccl.Communicator.join(store, job_id="grow-test", timeout=30)
    out["grow_s"] = time.monotonic() - t0
    out["rank"], out["size"] = big.rank, big.world_size
    y = np.full(8, me + 1, np.float32)
    big.all_reduce(y)
    out["sum"] = float(y[0])
    big.destroy()
    launch.report(out)
    os._exit(0)


def test_a_newcomer_joins_through_torchs_store():
    ranks = launch.run("test_failures", "worker_grow", 3, timeout=120,
                       env={"OXCCL_TIMEOUT": "20"})
    for r in ranks:
        assert r.returncode == 0 and r.result, launch.explain(ranks)
    for me, r in enumerate(ranks):
        res = r.result
        assert (res["rank"], res["size"]) == (me, 3), res
        assert res["sum"] == 6.0, res  # 1 + 2 + 3
        assert res["grow_s"] < 20, res
    for me in (0, 1):
        res = ranks[me].result
        assert res["before"] == 3.0 and res["lineage"] == "grow-test", res
        assert res["zero"] and "count is 0" in res["zero"], res
    kind, msg, secs = ranks[2].result["stranger"]
    assert kind == "Error" and "no member of the job admitted it" in msg, msg
    assert 0.4 < secs < 5, secs


def worker_monitored_barrier_timeout():
    import datetime

    import torch
    import torch.distributed as dist

    import oxccl
    import oxccl.torch  # noqa: F401

    dist.init_process_group("oxccl")  # the group's timeout: torch's default, 30 minutes
    rank = dist.get_rank()
    out = {}
    wait = datetime.timedelta(seconds=2)

    def attempt(name, group):
        t0 = time.monotonic()
        try:
            dist.monitored_barrier(group, timeout=wait)
            out[name] = ["passed", time.monotonic() - t0]
        except Exception as e:  # noqa: BLE001
            out[name] = [type(e).__name__, time.monotonic() - t0, str(e),
                         isinstance(e, oxccl.Error), getattr(e, "peer", None)]

    # Both come: passes.
    attempt("both", None)
    # Rank 1 comes late, after rank 0 gave up (the world barrier orders it): rank 0's error
    # names rank 1; rank 1 is not released and says so within its timeout.
    late = dist.new_group([0, 1])
    if rank == 0:
        attempt("late", late)
    dist.barrier()
    if rank == 1:
        attempt("late", late)
    # Rank 1 never comes; wait_all_ranks lists it too.
    never = dist.new_group([0, 1])
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.monitored_barrier(never, timeout=wait, wait_all_ranks=True)
            out["never"] = "passed"
        except Exception as e:  # noqa: BLE001
            out["never"] = [type(e).__name__, time.monotonic() - t0, str(e)]
    # The world group still works.
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    # Teardown of every group (two of them failed on one side or both) within a bound.
    t0 = time.monotonic()
    dist.destroy_process_group()
    out["destroy_s"] = time.monotonic() - t0
    launch.report(out)
    # and the interpreter exits normally (the test bounds it)


def test_monitored_barrier_timeout_names_the_rank_and_tears_down(torch_available):
    t0 = time.monotonic()
    ranks = launch.run("test_failures", "worker_monitored_barrier_timeout", 2, timeout=90)
    took = time.monotonic() - t0
    assert all(r.returncode == 0 and r.result for r in ranks), launch.explain(ranks)
    assert took < 60, (took, launch.explain(ranks))
    r0, r1 = ranks[0].result, ranks[1].result
    for o in (r0, r1):
        assert o["both"][0] == "passed", o
        assert o["after"] == [2.0] * 3, o
        assert o["destroy_s"] < 10, o
    kind, secs, msg, is_oxccl, peer = r0["late"]
    assert kind == "Timeout" and is_oxccl and peer == 1, r0["late"]
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in msg and 1.5 < secs < 10, r0
    kind, secs, msg, is_oxccl, peer = r1["late"]
    assert kind == "Timeout" and is_oxccl and peer == 0, r1["late"]
    assert "rank 0 did not release" in msg and secs < 10, r1["late"]
    kind, secs, msg = r0["never"]
    assert kind == "Timeout" and "Rank 1 failed to pass" in msg and secs < 10, r0["never"]


def test_init_async_waits_aborts_and_completes():
    """``Communicator.init_async``: an init whose peer never comes is aborted from another
    thread and says what it waited for; two ranks that both come get working communicators."""
    import threading

    import numpy as np
    from torch.distributed import TCPStore

    import oxccl

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = master.port
    # Rank 1 of 2 never comes.
    lone = oxccl.Communicator.init_async(
        TCPStore("127.0.0.1", port, is_master=False), 0, 2, timeout=30, job_id="lonely"
    )
    with pytest.raises(oxccl.Timeout):
        lone.wait(timeout=0.3)
    assert not lone.done()
    t0 = time.monotonic()
    threading.Timer(0.2, lambda: lone.abort("the test gave up")).start()
    with pytest.raises(oxccl.Aborted) as e:
        lone.wait()
    took = time.monotonic() - t0
    assert 0.15 < took < 3, took
    msg = str(e.value)
    assert "the test gave up" in msg and "[1]" in msg, msg
    with pytest.raises(oxccl.InvalidArgument):
        lone.wait()
    # Both ranks come.
    pending = [
        oxccl.Communicator.init_async(
            TCPStore("127.0.0.1", port, is_master=False), r, 2, timeout=30, job_id="pair"
        )
        for r in range(2)
    ]
    comms = [p.wait(timeout=30) for p in pending]
    assert all(p.done() for p in pending)
    out = [None, None]

    def reduce(r):
        x = np.full(4, r + 1, np.float32)
        comms[r].all_reduce(x)
        out[r] = float(x[0])

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [3.0, 3.0], out
