"""The per-call cost of the Python ProcessGroup path for small all-reduces (float32 SUM, in
place), side by side in one job: Rust's own loop (``Communicator._rust_loop``: no Python),
``oxccl.Communicator.all_reduce`` called from Python on a torch tensor, ``dist.all_reduce`` on
the "oxccl" group (blocking, and ``async_op=True`` then ``wait()``), the functional collective
DTensor/TP use (``funcol.all_reduce`` then ``wait_tensor``), and ``dist.all_reduce`` on Gloo.

Run by bench/torch-overhead.sh under torchrun. Each cell: the best of ROUNDS rounds
(interleaved over the ways) of the slowest rank's mean over ITERS calls, in microseconds.
Rank 0 prints a table and one JSON line per size."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import oxccl.torch

torch.set_num_threads(1)
SIZES = [int(s) for s in os.environ.get("SIZES", "8 64 512 4096 32768 65536").split()]
ROUNDS = int(os.environ.get("ROUNDS", "5"))
ITERS = int(os.environ.get("ITERS", "2000"))
GLOO_ITERS = int(os.environ.get("GLOO_ITERS", "100"))
WAYS = os.environ.get("WAYS", "rust comm torch torch_async funcol gloo").split()


def slowest(dt: float) -> float:
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # on the default (Gloo) group
    return t.item()


def timed(fn, iters: int) -> float:
    dist.barrier()
    for _ in range(min(50, iters)):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest((time.perf_counter() - t0) / iters)


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ox = dist.new_group(backend="oxccl")
    comm = oxccl.torch.backend(ox).communicator
    gloo = dist.group.WORLD
    if rank == 0:
        print(f"# {n} ranks, float32 SUM in place; us per call (best of {ROUNDS} rounds of the "
              f"slowest rank's mean over {ITERS} calls, Gloo {GLOO_ITERS})", flush=True)
        print("# " + " ".join(f"{w:>11}" for w in ["bytes"] + WAYS) +
              "  torch-rust comm-rust", flush=True)
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4))
        ways = {
            "rust": None,
            "comm": lambda: comm.all_reduce(t),
            "torch": lambda: dist.all_reduce(t, group=ox),
            "torch_async": lambda: dist.all_reduce(t, group=ox, async_op=True).wait(),
            "funcol": lambda: funcol.wait_tensor(funcol.all_reduce(t, "sum", ox)),
            "gloo": lambda: dist.all_reduce(t, group=gloo),
        }
        best = {w: float("inf") for w in WAYS}
        for _ in range(ROUNDS):
            for w in WAYS:
                if w == "rust":
                    dist.barrier()
                    comm._rust_loop("all_reduce", nbytes, 50)
                    dist.barrier()
                    dt = slowest(comm._rust_loop("all_reduce", nbytes, ITERS))
                else:
                    dt = timed(ways[w], GLOO_ITERS if w == "gloo" else ITERS)
                best[w] = min(best[w], dt * 1e6)
        if rank == 0:
            extra = ""
            if "rust" in best and "torch" in best and "comm" in best:
                extra = f"  {best['torch'] - best['rust']:10.2f} {best['comm'] - best['rust']:9.2f}"
            print("  " + " ".join(f"{v:11.2f}" if isinstance(v, float) else f"{v:>11}"
                                  for v in [nbytes] + [best[w] for w in WAYS]) + extra,
                  flush=True)
            print(json.dumps({"ranks": n, "bytes": nbytes, "us": best}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
