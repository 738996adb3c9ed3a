"""torch.distributed.all_reduce on the "oxccl" backend and on Gloo, side by side in one job
(one default Gloo group, one oxccl group over the same ranks), float32 SUM, in place; and the
Python layer's cost at 8 B: the Rust call in a loop (no Python), oxccl.Communicator.all_reduce
on a numpy array, and torch.distributed.all_reduce through the backend.

Run by bench/torch-vs-gloo.sh (under torchrun). Rank 0 prints one JSON object per line and a
table; times are the best of ROUNDS rounds (interleaved: gloo, oxccl, gloo, ...) of the mean of
ITERS calls each."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401

torch.set_num_threads(1)
SIZES = [int(s) for s in os.environ.get("SIZES", "8 1024 1048576 16777216 67108864").split()]
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def iters_for(nbytes: int, backend: str) -> int:
    if nbytes <= 4096:
        return 2000 if backend == "oxccl" else 200
    if nbytes <= 1 << 20:
        return 100
    return 5 if nbytes >= 1 << 26 else 20


def timed(fn, iters: int) -> float:
    dist.barrier()
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    # Every rank's mean; the slowest rank's is the collective's time.
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ox = dist.new_group(backend="oxccl")
    groups = {"gloo": dist.group.WORLD, "oxccl": ox}
    rows = []
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4))
        best = {"gloo": float("inf"), "oxccl": float("inf")}
        for _ in range(ROUNDS):
            for name, g in groups.items():
                dt = timed(lambda: dist.all_reduce(t, group=g), iters_for(nbytes, name))
                best[name] = min(best[name], dt)
        factor = 2 * (n - 1) / n
        row = {
            "ranks": n,
            "bytes": nbytes,
            "gloo_us": best["gloo"] * 1e6,
            "oxccl_us": best["oxccl"] * 1e6,
            "gloo_busbw_GBps": nbytes / best["gloo"] * factor / 1e9,
            "oxccl_busbw_GBps": nbytes / best["oxccl"] * factor / 1e9,
            "time_ratio": best["oxccl"] / best["gloo"],
        }
        row["busbw_ratio"] = row["oxccl_busbw_GBps"] / row["gloo_busbw_GBps"]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    # The Python layer at 8 B: Rust loop, the Python package, torch.distributed.
    comm = oxccl.torch.communicators()[-1]
    x = np.ones(2, dtype=np.float32)
    t8 = torch.ones(2)
    iters = 5000
    best = {"rust": float("inf"), "python": float("inf"), "torch": float("inf")}
    for _ in range(ROUNDS):
        dist.barrier()
        r = torch.tensor([comm._rust_loop("all_reduce", 8, iters)], dtype=torch.float64)
        dist.all_reduce(r, op=dist.ReduceOp.MAX)
        best["rust"] = min(best["rust"], r.item())
        best["python"] = min(best["python"], timed(lambda: comm.all_reduce(x), iters))
        best["torch"] = min(best["torch"], timed(lambda: dist.all_reduce(t8, group=ox), iters))
    over = {
        "ranks": n,
        "rust_us": best["rust"] * 1e6,
        "python_us": best["python"] * 1e6,
        "torch_us": best["torch"] * 1e6,
        "python_overhead_us": (best["python"] - best["rust"]) * 1e6,
        "torch_overhead_us": (best["torch"] - best["rust"]) * 1e6,
    }
    if rank == 0:
        print(json.dumps(over), flush=True)
        print(f"\n# {n} ranks, float32 sum, in place; best of {ROUNDS} rounds")
        print(f"{'bytes':>10} {'gloo us':>11} {'oxccl us':>11} {'gloo GB/s':>10} {'oxccl GB/s':>11} {'time ratio':>11} {'busbw ratio':>12}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['gloo_us']:>11.1f} {r['oxccl_us']:>11.1f} {r['gloo_busbw_GBps']:>10.3f} "
                  f"{r['oxccl_busbw_GBps']:>11.3f} {r['time_ratio']:>11.3f} {r['busbw_ratio']:>12.2f}")
        print(f"8 B: Rust loop {over['rust_us']:.2f} us, oxccl.Communicator.all_reduce {over['python_us']:.2f} us "
              f"(+{over['python_overhead_us']:.2f}), torch.distributed.all_reduce {over['torch_us']:.2f} us "
              f"(+{over['torch_overhead_us']:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
