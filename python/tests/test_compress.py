"""The compressed all-reduce from Python (`Communicator.all_reduce_compressed`): numpy float32
and float16, torch bfloat16, in place, the same bits on every rank, within one quantisation per
rank plus one rounding of the sum of the exact sum; bad formats and types are refused with errors that say why."""

from __future__ import annotations

import traceback

import launch


def worker_compress():
    import numpy as np

    import oxccl

    comm = oxccl.Communicator.from_env(timeout=30)
    rank, n = comm.rank, comm.world_size
    failures = []

    def expect(name, cond, detail=""):
        if not cond:
            failures.append(f"rank {rank}: {name} {detail}")

    def inputs(r, count, dt):
        g = np.random.default_rng(1234 + r)
        # Blocks of 32 at scales 2^-10 .. 2^10, both signs.
        scale = np.repeat(2.0 ** g.integers(-10, 11, size=(count + 31) // 32), 32)[:count]
        return (g.uniform(-1, 1, size=count) * scale).astype(dt)

    def within_bound(got, every, bits, block=32):
        exact = np.sum([e.astype(np.float64) for e in every], axis=0)
        for b in range(0, len(got), block):
            a = max(float(np.max(np.abs(e[b:b + block].astype(np.float64)))) for e in every)
            inputs_err = n * 2 * a / (2 ** bits - 1)
            # One quantisation per input, one rounding of the sum (re-encoded by its owner,
            # at most 2 max(a, A) / (2^M - 1), A the block's largest quantised sum), and f16's
            # own rounding when stored.
            big = abs(exact[b:b + block]).max() + inputs_err
            bound = (inputs_err + 2 * max(a, big) / (2 ** bits - 1)
                     + abs(exact[b:b + block]).max() * 2.0 ** -10)
            err = float(np.max(np.abs(got[b:b + block].astype(np.float64) - exact[b:b + block])))
            if err > bound:
                return f"block {b // 32}: error {err} > bound {bound}"
        return None

    try:
        for fmt, bits in (("bfp8", 8), ("bfp4", 4)):
            for dt in (np.float32, np.float16):
                x = inputs(rank, 1000, dt)
                every = [inputs(r, 1000, dt) for r in range(n)]
                comm.all_reduce_compressed(x, fmt)
                why = within_bound(x, every, bits)
                expect(f"{fmt} {dt.__name__} within the bound", why is None, why)
                # The same bits on every rank: all-gather them and compare.
                mine = np.frombuffer(x.tobytes(), dtype=np.uint8).copy()
                allb = np.zeros(n * mine.size, dtype=np.uint8)
                comm.all_gather(mine, allb)
                parts = allb.reshape(n, -1)
                expect(f"{fmt} {dt.__name__} same bits", all((p == parts[0]).all() for p in parts))
        # all_reduce(compress=...) is the same call, blocking or not; residual= is error
        # feedback: starting at zeros, it becomes x - Q(x), within half the agreed block unit,
        # plus, on the share of blocks this rank re-encodes (ceil(32 blocks / n) a rank), the
        # sum's rounding, within 2A/15 (A: the block's largest sum).
        for dt in (np.float32, np.float16):
            x = inputs(rank, 1000, dt)
            a, b, e = x.copy(), x.copy(), np.zeros_like(x)
            comm.all_reduce_compressed(a, "bfp4")
            comm.all_reduce(b, compress="bfp4", residual=e, async_op=True).wait()
            expect(f"{dt.__name__} all_reduce(compress=) same bits", a.tobytes() == b.tobytes())
            # (Half the unit of the agreed exponent: below the block's largest magnitude over
            # the ranks / 7.)
            every = [inputs(r, 1000, dt).astype(np.float64) for r in range(n)]
            share = -(-32 // n) * 32
            for i in range(0, 1000, 32):
                lim = max(np.abs(v[i:i + 32]).max() for v in every) / 7
                if rank * share <= i < (rank + 1) * share:
                    big = np.abs(np.sum(every, axis=0)[i:i + 32]).max() + n * lim
                    lim += 2 * big / 15
                expect(f"{dt.__name__} residual of block {i // 32} within its bound",
                       np.abs(e[i:i + 32]).max() <= lim * (1 + 1e-3), (np.abs(e[i:i + 32]).max(), lim))
            expect(f"{dt.__name__} residual not zero", np.abs(e).max() > 0)
        x = inputs(rank, 1000, np.float32)
        for bad, what in ((lambda: comm.all_reduce(x.copy(), "max", compress="bfp8"), "sums"),
                          (lambda: comm.all_reduce(x.copy(), out=np.zeros_like(x),
                                                   compress="bfp8"), "in place"),
                          (lambda: comm.all_reduce(x.copy(), residual=np.zeros_like(x)),
                           "needs compress="),
                          (lambda: comm.all_reduce(x.copy(), compress="bfp8",
                                                   residual=np.zeros(3, np.float32)),
                           "residual is 3"),
                          (lambda: comm.all_reduce(x.copy(), compress="fp8"), "bfp8 or bfp4")):
            try:
                bad()
                expect(f"refused ({what})", False)
            except (ValueError, oxccl.InvalidArgument) as err:
                expect(f"message names {what}", what in str(err), err)
        import torch

        t = torch.full((4, 64), float(rank + 1), dtype=torch.bfloat16)
        comm.all_reduce_compressed(t, "bfp8/16")
        expect("torch bf16 (small integers sum exactly)",
               bool((t == sum(range(1, n + 1))).all()), t)
        for bad, what in ((lambda: comm.all_reduce_compressed(np.zeros(4, np.float32), "bfp9"),
                           "bfp8 or bfp4"),
                          (lambda: comm.all_reduce_compressed(np.zeros(4, np.int32)),
                           "float32, float16 or bfloat16")):
            try:
                bad()
                expect(f"refused ({what})", False)
            except (ValueError, oxccl.InvalidArgument) as e:
                expect(f"message names {what}", what in str(e), e)
    except Exception:  # noqa: BLE001
        failures.append(f"rank {rank}: raised:\n{traceback.format_exc()}")
    comm.destroy()
    launch.report({"failures": failures})


def test_compressed_all_reduce(torch_available):
    ranks = launch.run("test_compress", "worker_compress", 3, timeout=120)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)
