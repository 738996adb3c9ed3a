"""The c10d surface beyond the training stacks, on an "oxccl" default group of 2 ranks (run by
torch_stacks.worker_2): group names, split_group, batch_isend_irecv as one oxccl group with
tags, the coalescing manager, exact AVG, monitored_barrier, all_to_all with splits, the object
collectives, and clear errors for what oxccl refuses. ``check()`` returns {name: value}; the
test compares each value with what it must be."""

from __future__ import annotations

import datetime
import time


def check():
    import torch
    import torch.distributed as dist

    import oxccl.torch

    rank, n = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    world = dist.group.WORLD
    pg = oxccl.torch.backend(world)
    out = {}

    # Names: c10d names every group through its backend.
    sub = dist.new_group([0, 1])
    out["names"] = bool(world.group_name) and bool(sub.group_name) and (
        world.group_name != sub.group_name
    )
    out["backend_name"] = dist.get_backend(sub)

    # split_group: one group of both ranks, in reverse order.
    sp = dist.split_group(split_ranks=[[1, 0]])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=sp)
    out["split"] = [dist.get_rank(sp), t.item(), type(oxccl.torch.backend(sp)).__name__]

    # batch_isend_irecv: 1 MiB each way (a send that cannot finish before the peer's receive
    # starts), tags listed in different orders on the two ranks; one oxccl group.
    big = 1 << 18
    a = torch.full((big,), float(10 * rank + 1))
    b = torch.full((3,), float(10 * rank + 2))
    ra, rb = torch.zeros(big), torch.zeros(3)
    before = pg.batches
    if rank == 0:
        ops = [dist.P2POp(dist.isend, a, peer, tag=1), dist.P2POp(dist.isend, b, peer, tag=2),
               dist.P2POp(dist.irecv, rb, peer, tag=2), dist.P2POp(dist.irecv, ra, peer, tag=1)]
    else:
        ops = [dist.P2POp(dist.irecv, rb, peer, tag=2), dist.P2POp(dist.irecv, ra, peer, tag=1),
               dist.P2POp(dist.isend, b, peer, tag=2), dist.P2POp(dist.isend, a, peer, tag=1)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch"] = [ra[0].item(), ra[-1].item(), rb[0].item(), pg.batches - before]

    # Plain send/recv with a tag: accepted (matched in order).
    x = torch.full((4,), float(rank))
    if rank == 0:
        dist.send(x, 1, tag=7)
        dist.recv(x, 1, tag=8)
    else:
        dist.recv(x, 0, tag=7)
        dist.send(x + 5, 0, tag=8)
    out["tagged"] = x[0].item()

    # Coalescing manager: all-reduces, all-gathers and reduce-scatters in one block each.
    ts = [torch.full((k + 1,), float(rank + k)) for k in range(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    out["coalesced_allreduce"] = [t[0].item() for t in ts]
    ins = [torch.full((2,), float(rank + k)) for k in range(2)]
    outs = [torch.zeros(2 * n) for _ in range(2)]
    with dist._coalescing_manager():
        for i, o in zip(ins, outs):
            dist.all_gather_into_tensor(o, i)
    out["coalesced_allgather"] = [o.tolist() for o in outs]
    rs_in = [torch.arange(2 * n, dtype=torch.float32) * (rank + 1) for _ in range(2)]
    rs_out = [torch.zeros(2) for _ in range(2)]
    with dist._coalescing_manager():
        for i, o in zip(rs_in, rs_out):
            dist.reduce_scatter_tensor(o, i)
    out["coalesced_reduce_scatter"] = [o.tolist() for o in rs_out]

    # AVG computed by oxccl (ReduceOp.Avg, not SUM then a division in Python): (a + b) / 2
    # correctly rounded, the same bits on both ranks (it sums first, as NCCL does: near the
    # largest float32 the sum overflows).
    base = torch.tensor([3.0e37, 1.0, 3 * 2.0 ** -149, 1 / 3], dtype=torch.float32)
    mine, theirs = (base * 0.5, base) if rank == 0 else (base, base * 0.5)
    want = ((mine.double() + theirs.double()) / 2).float()
    got = mine.clone()
    dist.all_reduce(got, op=dist.ReduceOp.AVG)
    out["avg_exact"] = [torch.equal(got, want), got.tolist(), want.tolist()]

    # all_to_all_single with uneven splits.
    send_splits = [1, 2] if rank == 0 else [3, 1]
    recv_splits = [1, 3] if rank == 0 else [2, 1]
    inp = torch.arange(sum(send_splits), dtype=torch.float32) + 100 * rank
    got = torch.zeros(sum(recv_splits))
    dist.all_to_all_single(got, inp, recv_splits, send_splits)
    out["alltoall_splits"] = got.tolist()

    # Object collectives (what DCP uses).
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * (rank * 100)})
    out["all_gather_object"] = [(o["rank"], len(o["s"])) for o in objs]
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    out["gather_object"] = gathered if rank == 0 else "not root"
    lst = [{"k": 1}, "two", 3] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(lst, src=0)
    out["broadcast_object_list"] = lst
    got_obj = [None]
    dist.scatter_object_list(got_obj, [[1, "a"], [2, "bb" * 50]] if rank == 0 else None, src=0)
    out["scatter_object_list"] = got_obj[0]

    # monitored_barrier: passes when both come. Its timeout path (the missing rank named, the
    # late rank not released, teardown bounded) is test_failures.py's
    # test_monitored_barrier_timeout_names_the_rank_and_tears_down.
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.barrier()

    # Refused calls raise at once, naming the operation.
    def refused(fn):
        t0 = time.monotonic()
        try:
            fn()
            return "returned"
        except Exception as e:  # noqa: BLE001
            return [type(e).__name__, str(e), time.monotonic() - t0 < 5]

    out["refused_band"] = refused(
        lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND))
    out["refused_anysource"] = refused(lambda: dist.recv(torch.zeros(2)))
    dist.barrier()
    return out
