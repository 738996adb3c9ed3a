"""Every collective × dtype × operator through torch.distributed on the "oxccl" backend,
checked against an independent reference computed from every rank's inputs and against Gloo's
results in the same job (where Gloo supports the dtype and operator)."""

from __future__ import annotations

import traceback

import launch

WORLD = 3  # not a power of two; roots other than 0

DTYPES = [
    "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2",
]
# The 8-bit floats' unit roundoff: a reduction rounds once per step (at most n - 1 steps on
# n ranks, and AVG's division), each within this relative distance; the inputs are positive,
# so the documented bound (oxccl_core::dtype) is relative to the exact result.
FP8_U = {"float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def _inputs(torch, dtype, rank, count):
    # Small positive integers: every reduction is exact in every dtype (3 ranks: products
    # up to 125, sums up to 15), so results compare exactly.
    i = torch.arange(count, dtype=torch.int64)
    return ((i * 7 + rank * 3) % 5 + 1).to(dtype)


def _reference(torch, dtype, op, count, world):
    xs = torch.stack([_inputs(torch, torch.float64, r, count) for r in range(world)])
    if op == "SUM":
        y = xs.sum(0)
    elif op == "PRODUCT":
        y = xs.prod(0)
    elif op == "MIN":
        y = xs.min(0).values
    elif op == "MAX":
        y = xs.max(0).values
    else:  # AVG: exact division for floats, truncating for integers (as oxccl does)
        y = xs.sum(0) / world
        if not dtype.is_floating_point:
            y = torch.floor(y)
    return y.to(dtype)


def _fp8(torch, dtype):
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _gloo_supports(torch, dtype, op):
    return dtype not in (torch.uint32, torch.uint64) and not _fp8(torch, dtype) and op != "AVG"


def _close(torch, a, b, dtype, op, world=WORLD):
    if _fp8(torch, dtype):
        if a.shape != b.shape:
            return False
        u = FP8_U[str(dtype).removeprefix("torch.")]
        # Reference and result each rounded: (1 + u)^n - 1 for the n roundings of the
        # result, the reference's own rounding within u of the exact value besides.
        rtol = (1 + u) ** world - 1 + u
        return torch.allclose(a.double(), b.double(), rtol=rtol, atol=0.0)
    if op == "AVG" and dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a.double(), b.double(), rtol=1e-2)
    return torch.equal(a, b)


def _same(torch, a, b, dtype):
    """Bit for bit (moved data); torch.equal has no 8-bit float kernel."""
    if _fp8(torch, dtype):
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def worker_collectives():
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401 - registers the backend

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ox = dist.new_group(backend="oxccl")
    gloo = dist.group.WORLD
    failures = []
    cases = 0

    def check(name, got, want, dtype, op="SUM"):
        nonlocal cases
        cases += 1
        if not _close(torch, got, want, dtype, op):
            failures.append(f"rank {rank}: {name}: got {got.tolist()}, expected {want.tolist()}")

    def check_moved(name, got, want, dtype):
        nonlocal cases
        cases += 1
        if not _same(torch, got, want, dtype):
            failures.append(f"rank {rank}: {name}: got {got.tolist()}, expected {want.tolist()}")

    def attempt(name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported as a failure of this case
            failures.append(f"rank {rank}: {name} raised:\n{traceback.format_exc()}")

    for dname in DTYPES:
        dtype = getattr(torch, dname)
        for op in OPS:
            rop = getattr(dist.ReduceOp, op)
            for count in (6, 3 * 4099):
                ref = _reference(torch, dtype, op, count, n)
                glo = _gloo_supports(torch, dtype, op)
                tag = f"{dname} {op} count {count}"

                def all_reduce():
                    t = _inputs(torch, dtype, rank, count)
                    dist.all_reduce(t, op=rop, group=ox)
                    check(f"all_reduce {tag}", t, ref, dtype, op)
                    if glo:
                        g = _inputs(torch, dtype, rank, count)
                        dist.all_reduce(g, op=rop, group=gloo)
                        check(f"all_reduce {tag} vs gloo", t, g, dtype, op)

                def reduce():
                    root = 2
                    t = _inputs(torch, dtype, rank, count)
                    dist.reduce(t, dst=root, op=rop, group=ox)
                    if rank == root:
                        check(f"reduce {tag}", t, ref, dtype, op)
                        if glo:
                            g = _inputs(torch, dtype, rank, count)
                            dist.reduce(g, dst=root, op=rop, group=gloo)
                            check(f"reduce {tag} vs gloo", t, g, dtype, op)
                    elif glo:
                        dist.reduce(_inputs(torch, dtype, rank, count), dst=root, op=rop, group=gloo)

                def reduce_scatter_tensor():
                    m = count // n
                    out = torch.empty(m, dtype=dtype)
                    dist.reduce_scatter_tensor(out, _inputs(torch, dtype, rank, count), op=rop, group=ox)
                    check(f"reduce_scatter_tensor {tag}", out, ref[rank * m:(rank + 1) * m], dtype, op)

                def reduce_scatter_list():
                    m = count // n
                    out = torch.empty(m, dtype=dtype)
                    ins = list(_inputs(torch, dtype, rank, count).chunk(n))
                    dist.reduce_scatter(out, ins, op=rop, group=ox)
                    check(f"reduce_scatter {tag}", out, ref[rank * m:(rank + 1) * m], dtype, op)

                for name, fn in [("all_reduce", all_reduce), ("reduce", reduce),
                                 ("reduce_scatter_tensor", reduce_scatter_tensor),
                                 ("reduce_scatter", reduce_scatter_list)]:
                    if count > 6 and name != "all_reduce":
                        continue
                    attempt(f"{name} {tag}", fn)

        # Data movement, per dtype.
        def moves():
            x = _inputs(torch, dtype, rank, 6)
            every = [_inputs(torch, dtype, r, 6) for r in range(n)]
            outs = [torch.empty(6, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, x, group=ox)
            for r in range(n):
                check_moved(f"all_gather {dname} block {r}", outs[r], every[r], dtype)
            flat = torch.empty(6 * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, x, group=ox)
            check_moved(f"all_gather_into_tensor {dname}", flat, torch.cat(every), dtype)
            b = x.clone()
            dist.broadcast(b, src=1, group=ox)
            check_moved(f"broadcast {dname}", b, every[1], dtype)
            # all_to_all: block j of rank i goes to rank j.
            send = [_inputs(torch, dtype, rank * n + j, 2) for j in range(n)]
            recv = [torch.empty(2, dtype=dtype) for _ in range(n)]
            dist.all_to_all(recv, send, group=ox)
            for i in range(n):
                check_moved(f"all_to_all {dname} from {i}", recv[i], _inputs(torch, dtype, i * n + rank, 2), dtype)
            out = torch.empty(2 * n, dtype=dtype)
            dist.all_to_all_single(out, torch.cat(send), group=ox)
            check_moved(f"all_to_all_single {dname}", out, torch.cat([_inputs(torch, dtype, i * n + rank, 2) for i in range(n)]), dtype)
            # Uneven splits: rank i sends i + j + 1 rows to rank j.
            sizes_in = [rank + j + 1 for j in range(n)]
            sizes_out = [i + rank + 1 for i in range(n)]
            src = torch.cat([_inputs(torch, dtype, 10 * rank + j, s) for j, s in enumerate(sizes_in)])
            dst = torch.empty(sum(sizes_out), dtype=dtype)
            dist.all_to_all_single(dst, src, sizes_out, sizes_in, group=ox)
            want = torch.cat([_inputs(torch, dtype, 10 * i + rank, s) for i, s in enumerate(sizes_out)])
            check_moved(f"all_to_all_single uneven {dname}", dst, want, dtype)
            g = [torch.empty(6, dtype=dtype) for _ in range(n)] if rank == 1 else None
            dist.gather(x, g, dst=1, group=ox)
            if rank == 1:
                for r in range(n):
                    check_moved(f"gather {dname} block {r}", g[r], every[r], dtype)
            s = torch.empty(6, dtype=dtype)
            dist.scatter(s, [_inputs(torch, dtype, 100 + r, 6) for r in range(n)] if rank == 2 else None, src=2, group=ox)
            check_moved(f"scatter {dname}", s, _inputs(torch, dtype, 100 + rank, 6), dtype)
            # send/recv around the ring.
            if rank % 2 == 0:
                dist.send(x, (rank + 1) % n, group=ox)
                r = torch.empty(6, dtype=dtype)
                dist.recv(r, (rank - 1) % n, group=ox)
            else:
                r = torch.empty(6, dtype=dtype)
                dist.recv(r, (rank - 1) % n, group=ox)
                dist.send(x, (rank + 1) % n, group=ox)
            check_moved(f"send/recv {dname}", r, every[(rank - 1) % n], dtype)

        attempt(f"data movement {dname}", moves)

    def others():
        # async ops, futures, coalesced all-reduce, barrier, complex, a subgroup, empty.
        t = _inputs(torch, torch.float32, rank, 1000)
        w = dist.all_reduce(t, group=ox, async_op=True)
        v = w.get_future().wait()
        check("async all_reduce future", v[0], _reference(torch, torch.float32, "SUM", 1000, n), torch.float32)
        w.wait()
        ts = [_inputs(torch, torch.float32, rank, k) for k in (1, 5, 9)] + [_inputs(torch, torch.int64, rank, 4)]
        with dist._coalescing_manager(group=ox, async_ops=True) as cm:
            for x in ts:
                dist.all_reduce(x, group=ox)
        cm.wait()
        for x, k in zip(ts, (1, 5, 9, 4)):
            check(f"coalesced all_reduce {x.dtype} {k}", x, _reference(torch, x.dtype, "SUM", k, n), x.dtype)
        dist.barrier(group=ox)
        c = torch.complex(_inputs(torch, torch.float32, rank, 4), _inputs(torch, torch.float32, rank + 1, 4))
        dist.all_reduce(c, group=ox)
        want = torch.complex(_reference(torch, torch.float32, "SUM", 4, n),
                             sum(_inputs(torch, torch.float32, r + 1, 4) for r in range(n)))
        check("complex all_reduce", c, want, torch.complex64)
        sub = dist.new_group([0, 2], backend="oxccl")
        if rank in (0, 2):
            s = _inputs(torch, torch.int32, rank, 5)
            dist.all_reduce(s, group=sub)
            check("subgroup [0, 2] all_reduce", s, _inputs(torch, torch.int32, 0, 5) + _inputs(torch, torch.int32, 2, 5), torch.int32)
        e = torch.empty(0)
        dist.all_reduce(e, group=ox)
        check("empty all_reduce", e, torch.empty(0), torch.float32)
        # isend, then irecv, not batched: the two fly together (one call at a time, a ring
        # of exchanges larger than the receivers' slots would never finish).
        big = 4 << 20
        mine = torch.arange(big, dtype=torch.int32) + rank * 7
        got = torch.zeros(big, dtype=torch.int32)
        s = dist.isend(mine, (rank + 1) % n, group=ox)
        r = dist.irecv(got, (rank - 1) % n, group=ox)
        r.wait()
        s.wait()
        want = torch.arange(big, dtype=torch.int32) + ((rank - 1) % n) * 7
        check("isend then irecv in flight", got, want, torch.int32)

    attempt("async, coalesced, complex, subgroup", others)
    dist.barrier()
    dist.destroy_process_group()
    launch.report({"cases": cases, "failures": failures})


def test_every_collective_dtype_op_matches_gloo(torch_available):
    ranks = launch.run("test_torch_collectives", "worker_collectives", WORLD, timeout=240)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures[:30])
    # Every rank checked something in every case it owns (roots check more).
    assert min(r.result["cases"] for r in ranks) > 350, [r.result["cases"] for r in ranks]
