#!/usr/bin/env python3
"""Trains a model with DistributedDataParallel (or FSDP2) on oxccl (or Gloo, the reference).

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend oxccl --json /tmp/ox.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo  --json /tmp/gloo.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --compress bfp8 --json /tmp/bfp8.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --model mlp --batch 32 --backend gloo \
        --hook fp16 --exposure --json /tmp/gloo-fp16.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --model mlp --batch 32 --fsdp
    python examples/train_ddp.py --plot /tmp/ox.json /tmp/gloo.json -o ddp.png

Two models (``--model``):

- ``gpt`` (the default): a byte-level GPT. The corpus is the Python standard library's own
  sources (every ``*.py`` file under ``sysconfig``'s stdlib path, in sorted order), so nothing
  is downloaded. The default GPT (6 layers, width 384, 128-byte context) has 10.8 M parameters.
- ``mlp``: a plain MLP (``--mlp-dims``, default 1024-2048-2048-2048-1024: 12.59 M parameters,
  50 MB of fp32 gradients) regressing a fixed random teacher network (1024 -> 256 tanh -> 1024,
  drawn from the seed), with mean squared error on inputs drawn from N(0, 1): a synthetic task
  that the student learns, so the loss falls.

Each rank draws its batches from its own seeded generator, so two runs with the same seeds see
the same data and differ only in how the gradients were summed.

Rank 0 prints each step's loss and time, and at the end the median step time, the median time
of the same step without gradient synchronisation (compute only, measured in the same run: DDP
under ``no_sync``; with ``--fsdp``, an unsharded local copy of the model and its optimizer) and
the share of the step that communication adds; ``--json`` writes all of it as JSON, ``--plot``
draws loss and step time of several logs overlaid (and, beside them, each log's loss relative
to the first one's).

Gradient averaging, as a user would set it up:

- ``--compress bfp8`` (``bfp4``, ``bfp8/16``, ...; oxccl only) registers the DDP communication
  hook ``oxccl.torch.bfp_hook``: the gradient buckets are averaged with a block-floating-point
  compressed all-reduce, with error feedback (a residual per bucket) unless
  ``--no-error-feedback``.
- ``--hook fp16`` (or ``bf16``; either backend) registers torch's own
  ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook`` (or
  ``bf16_compress_hook``): buckets cast to 16 bits, all-reduced, cast back.
- ``--fsdp``: FSDP2 instead of DDP (``fully_shard`` on each layer, then on the root, over a
  1-D CPU device mesh). Its reduce-scatters are whatever the backend does; an oxccl backend that
  reads ``OXCCL_REDUCE_SCATTER_COMPRESS`` (bfp8, ...) compresses them, and the log records the
  variable's value as ``rs_compress``.

``--exposure`` (DDP only) wraps whichever communication hook is in use (torch's
``default_hooks.allreduce_hook`` when none is chosen) in one that records, per bucket, when
DDP handed it over (the hook called), when the hook returned, and when its future completed,
all from the start of ``loss.backward()``, and when ``backward()`` returned (DDP returns only
once every bucket's future has completed). Per bucket: wire time (completed - called), the part
of it past the moment the last bucket was handed over, and its exposed share (the time from the
later of that moment and the previous bucket's completion to its own completion: the shares
sum to the communication left after the backward pass's compute). Medians over the steps after
``--warmup``, on rank 0, printed as a table and written to the JSON with every step's raw times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path


def corpus(limit: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            out += p.read_bytes()
        except OSError:
            continue
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def build_model(torch, args):
    """The model ``args.model`` names ("gpt" when the namespace has no ``model``), built from
    torch's global generator (seed it first)."""
    if getattr(args, "model", "gpt") == "mlp":
        return build_mlp(torch, args)
    return build_gpt(torch, args)


def build_gpt(torch, args):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.width
            self.tok = nn.Embedding(256, d)
            self.pos = nn.Embedding(args.context, d)
            self.blocks = nn.ModuleList(Block(d, args.heads) for _ in range(args.layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, 256, bias=False)
            mask = torch.triu(torch.full((args.context, args.context), float("-inf")), 1)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t))
            for b in self.blocks:
                x = b(x, self.mask[:t, :t])
            return self.head(self.ln(x))

    return GPT()


def mlp_dims(args) -> list[int]:
    dims = [int(v) for v in args.mlp_dims.split(",")]
    if len(dims) < 2 or min(dims) < 1:
        raise ValueError(f"--mlp-dims {args.mlp_dims!r}: two or more positive widths")
    return dims


def build_mlp(torch, args):
    """Linear layers of widths ``--mlp-dims`` with ReLU between them; ``layers`` is a
    ModuleList, so that FSDP2 can shard each layer on its own."""
    nn = torch.nn
    dims = mlp_dims(args)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i + 1 < len(self.layers):
                    x = torch.relu(x)
            return x

    return MLP()


def teacher(torch, args):
    """The MLP task's fixed target map, the same on every rank and backend: x -> tanh(x A) B,
    A and B random (from ``--seed``), scaled so that the targets have about unit variance."""
    dims = mlp_dims(args)
    g = torch.Generator().manual_seed(args.seed + 7919)
    hidden = 256
    a = torch.randn(dims[0], hidden, generator=g) / dims[0] ** 0.5
    # tanh of a unit normal has a variance of about 0.394.
    b = torch.randn(hidden, dims[-1], generator=g) / (0.394 * hidden) ** 0.5
    return lambda x: torch.tanh(x @ a) @ b


class Exposure:
    """Times each DDP gradient bucket around an inner communication hook.

    Register ``exposure_hook`` with an ``Exposure`` as its state; ``events`` maps each bucket
    index to ``[called, returned, done, bytes]`` (``time.perf_counter`` seconds: the hook
    called, the inner hook returned, its future completed; the bucket's size) for the current
    step. ``done`` is taken in a ``then`` callback of the inner future, on whatever thread
    completes it (the backend's), and DDP waits on that callback's future, so it is recorded
    before ``backward()`` can return."""

    def __init__(self, hook, state):
        self.hook = hook
        self.state = state
        self.events: dict = {}


def exposure_hook(ex, bucket):
    # No annotations: DDP compares them with GradBucket and Future as objects, and this
    # module's would be strings (from __future__ import annotations).
    t0 = time.perf_counter()
    buf = bucket.buffer()
    rec = [t0, None, None, buf.numel() * buf.element_size()]
    ex.events[bucket.index()] = rec
    fut = ex.hook(ex.state, bucket)
    rec[1] = time.perf_counter()

    def done(f):
        rec[2] = time.perf_counter()
        return f.value()

    return fut.then(done)


def exposure_summary(steps: list[dict]) -> dict:
    """Per-bucket medians of raw per-step records (``{"backward": [start, end], "buckets":
    {index: [called, returned, done, bytes]}}``, times from the start of backward)."""
    per: dict = {}
    tails, waits, lasts, ends = [], [], [], []
    for st in steps:
        b = {int(k): v for k, v in st["buckets"].items()}
        if not b or any(v[2] is None for v in b.values()):
            continue
        last = max(v[0] for v in b.values())
        prev = last
        for i, v in sorted(b.items(), key=lambda kv: kv[1][2]):
            exposed = max(0.0, v[2] - prev)
            prev = max(prev, v[2])
            d = per.setdefault(i, {"called": [], "returned": [], "done": [], "wire": [],
                                   "past_last": [], "exposed": [], "bytes": v[3]})
            d["called"].append(v[0])
            d["returned"].append(v[1])
            d["done"].append(v[2])
            d["wire"].append(v[2] - v[0])
            d["past_last"].append(max(0.0, v[2] - last))
            d["exposed"].append(exposed)
        lasts.append(last)
        waits.append(max(v[2] for v in b.values()) - last)
        ends.append(st["backward"][1])
        tails.append(st["backward"][1] - last)
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    buckets = [
        {"index": i, "bytes": d["bytes"], "called_s": med(d["called"]),
         "returned_s": med(d["returned"]), "done_s": med(d["done"]), "wire_s": med(d["wire"]),
         "past_last_call_s": med(d["past_last"]), "exposed_s": med(d["exposed"])}
        for i, d in sorted(per.items())
    ]
    return {
        "steps": len(lasts),
        "buckets": buckets,
        "last_call_s": med(lasts),
        "wait_after_last_call_s": med(waits),
        "backward_end_s": med(ends),
        "tail_after_last_call_s": med(tails),
    }


def print_exposure(ex: dict, bwd: float, bwd_compute: float, step: float, comp: float) -> None:
    ms = 1e3
    print(f"per-bucket communication, rank 0, median over {ex['steps']} steps, ms from the start "
          "of backward():")
    print(f"{'bucket':>6} {'MB':>7} {'called':>8} {'returned':>9} {'done':>8} {'wire':>8} "
          f"{'past last call':>15} {'exposed':>8}")
    for b in ex["buckets"]:
        print(f"{b['index']:>6} {b['bytes'] / 1e6:7.2f} {b['called_s'] * ms:8.1f} "
              f"{b['returned_s'] * ms:9.1f} {b['done_s'] * ms:8.1f} {b['wire_s'] * ms:8.1f} "
              f"{b['past_last_call_s'] * ms:15.1f} {b['exposed_s'] * ms:8.1f}")
    print(f"last bucket handed over at {ex['last_call_s'] * ms:.1f} ms; all done "
          f"{ex['wait_after_last_call_s'] * ms:.1f} ms after it; backward() returned at "
          f"{ex['backward_end_s'] * ms:.1f} ms ({ex['tail_after_last_call_s'] * ms:.1f} ms after "
          f"the last bucket); backward alone (no_sync) {bwd_compute * ms:.1f} ms, with sync "
          f"{bwd * ms:.1f} ms; exposed communication: step - compute-only step = "
          f"{(step - comp) * ms:.1f} ms", flush=True)


def train(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.backend == "oxccl":
        import oxccl.torch  # noqa: F401 - registers the backend

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = build_model(torch, args)
    params = sum(p.numel() for p in model.parameters())
    ex = None
    local = None
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # Compute only: an unsharded copy (same initial weights) with its own optimizer.
        torch.manual_seed(args.seed)
        local = build_model(torch, args)
        mesh = init_device_mesh("cpu", (world,))
        layers = model.layers if args.model == "mlp" else model.blocks
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        hook, state = None, None
        if args.compress:
            hook = oxccl.torch.bfp_hook
            state = oxccl.torch.BfpState(compress=args.compress,
                                         error_feedback=not args.no_error_feedback)
        elif args.hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook,
                    "bf16": default_hooks.bf16_compress_hook}[args.hook]
        if args.exposure:
            if hook is None:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = default_hooks.allreduce_hook
            ex = Exposure(hook, state)
            net.register_comm_hook(ex, exposure_hook)
        elif hook is not None:
            net.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    local_opt = torch.optim.AdamW(local.parameters(), lr=args.lr, weight_decay=0.0) if local else None
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)

    if args.model == "mlp":
        target = teacher(torch, args)
        dim_in = mlp_dims(args)[0]

        def batch():
            x = torch.randn(args.batch, dim_in, generator=gen)
            return x, target(x)

        def loss_of(out, y):
            return torch.nn.functional.mse_loss(out, y)
    else:
        data = torch.frombuffer(bytearray(corpus(args.corpus_mb << 20)), dtype=torch.uint8).long()

        def batch():
            i = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=gen)
            x = torch.stack([data[j : j + args.context] for j in i])
            y = torch.stack([data[j + 1 : j + args.context + 1] for j in i])
            return x, y

        def loss_of(out, y):
            return torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))

    bwd_times: list[float] = []
    bwd_compute: list[float] = []
    exposure_steps: list[dict] = []

    def step(sync: bool) -> float:
        x, y = batch()
        if sync:
            opt.zero_grad(set_to_none=True)
            loss = loss_of(net(x), y)
            if ex is not None:
                ex.events = {}
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            bwd_times.append(t1 - t0)
            if ex is not None:
                exposure_steps.append({
                    "backward": [0.0, t1 - t0],
                    "buckets": {i: [v[0] - t0, v[1] - t0, None if v[2] is None else v[2] - t0,
                                    v[3]] for i, v in ex.events.items()},
                })
            opt.step()
        elif local is not None:
            local_opt.zero_grad(set_to_none=True)
            loss = loss_of(local(x), y)
            t0 = time.perf_counter()
            loss.backward()
            bwd_compute.append(time.perf_counter() - t0)
            local_opt.step()
        else:
            opt.zero_grad(set_to_none=True)
            with net.no_sync():
                loss = loss_of(net(x), y)
                t0 = time.perf_counter()
                loss.backward()
                bwd_compute.append(time.perf_counter() - t0)
            opt.step()
        return loss.item()

    losses, times = [], []
    dist.barrier()
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss = step(True)
        dt = time.perf_counter() - t0
        # Every rank's loss, averaged: the job's loss, the same on every rank.
        lt = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(lt)
        losses.append(lt.item() / world)
        times.append(dt)
        if rank == 0 and (s % args.print_every == 0 or s == args.steps - 1):
            print(f"step {s:4d}  loss {losses[-1]:.6f}  {dt * 1e3:8.1f} ms", flush=True)
    # Compute only: the same steps (optimizer included) without gradient synchronisation,
    # after training, so that they change nothing reported.
    compute = []
    for _ in range(args.compute_steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(False)
        compute.append(time.perf_counter() - t0)
    skip = min(args.warmup, max(0, len(times) - 1))
    med = statistics.median(times[skip:])
    comp = statistics.median(compute) if compute else float("nan")
    bwd = statistics.median(bwd_times[skip:])
    bwd_comp = statistics.median(bwd_compute) if bwd_compute else float("nan")
    grad_bytes = 4 * params
    ring_bytes = 2 * (world - 1) / world * grad_bytes
    rs = os.environ.get("OXCCL_REDUCE_SCATTER_COMPRESS") if args.fsdp and args.backend == "oxccl" else None
    out = {
        "backend": args.backend,
        "model": args.model,
        "fsdp": args.fsdp,
        "hook": args.hook,
        "compress": args.compress,
        "error_feedback": bool(args.compress) and not args.no_error_feedback,
        "rs_compress": rs or None,
        "world": world,
        "params": params,
        "batch": args.batch,
        "context": args.context if args.model == "gpt" else None,
        "losses": losses,
        "step_s": times,
        "median_step_s": med,
        "median_compute_s": comp,
        "comm_share": max(0.0, 1 - comp / med) if compute else None,
        "exposed_s": med - comp if compute else None,
        "backward_s": bwd_times,
        "median_backward_s": bwd,
        "median_compute_backward_s": bwd_comp,
        "grad_bytes": grad_bytes,
        "ring_bytes_per_rank": ring_bytes,
        "argv": sys.argv,
    }
    if ex is not None:
        out["exposure"] = exposure_summary(exposure_steps[skip:])
        out["exposure"]["raw"] = exposure_steps
    if args.link_gbps:
        # The ring all-reduce sends ring_bytes per rank per step over each host's link.
        out["link_share"] = ring_bytes / max(med - comp, 1e-9) / (args.link_gbps * 1e9 / 8)
    if rank == 0:
        shape = f"{args.batch}x{args.context}" if args.model == "gpt" else f"{args.batch}"
        print(
            f"{label(out)}: {world} ranks, {params / 1e6:.2f} M parameters, batch "
            f"{shape}: median step {med * 1e3:.1f} ms, compute only "
            f"{comp * 1e3:.1f} ms, communication {100 * (out['comm_share'] or 0):.1f}% of the "
            f"step; final loss {losses[-1]:.6f}",
            flush=True,
        )
        if ex is not None:
            print_exposure(out["exposure"], bwd, bwd_comp, med, comp)
        if args.json:
            Path(args.json).write_text(json.dumps(out))
    dist.destroy_process_group()
    return out


def label(d: dict) -> str:
    """A log's name: its backend, FSDP2 (and its reduce-scatter compression), the DDP hook,
    its compression (with or without error feedback)."""
    name = d["backend"]
    if d.get("fsdp"):
        name += " fsdp"
        if d.get("rs_compress"):
            # What the environment asked for: whether the backend honoured it shows in the
            # losses (and the step time), not here.
            name += f", OXCCL_REDUCE_SCATTER_COMPRESS={d['rs_compress']}"
    if d.get("hook"):
        name += f" + {d['hook']} hook"
    if d.get("compress"):
        name += f" {d['compress']}" + (" + EF" if d.get("error_feedback") else " no EF")
    return name


def plot(logs: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in logs]
    panels = 3 if len(runs) > 1 else 2
    # Room under the panels for the legends (one line per log), so that they hide no curve.
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.3 + 0.16 * len(runs)))
    a, b = axes[0], axes[-1]
    base = runs[0]["losses"]
    win = 5
    for d in runs:
        lab = f"{label(d)} ({d['world']} ranks)"
        steps = range(len(d["losses"]))
        a.plot(steps, d["losses"], label=f"{lab}: final {d['losses'][-1]:.4f}")
        b.plot(steps, [t * 1e3 for t in d["step_s"]],
               label=f"{lab}: median {d['median_step_s'] * 1e3:.0f} ms")
        if panels == 3:
            # Relative to the first log, each a moving average over `win` steps.
            rel = [100 * (x - y) / y for x, y in zip(d["losses"], base)]
            avg = [sum(rel[max(0, i - win + 1) : i + 1]) / len(rel[max(0, i - win + 1) : i + 1])
                   for i in range(len(rel))]
            axes[1].plot(range(len(avg)), avg, label=lab)
    d0 = runs[0]
    mlp = d0.get("model") == "mlp"
    a.set(xlabel="step", ylabel="loss (mean squared error)" if mlp
          else "loss (cross-entropy, nats/byte)", title="training loss")
    b.set(xlabel="step", ylabel="step time (ms)", title="step time")
    b.set_ylim(bottom=0)
    if panels == 3:
        axes[1].set(xlabel="step", ylabel="%",
                    title=f"loss relative to {label(runs[0])} ({win}-step mean)")
        axes[1].axhline(0, color="black", lw=0.6)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    how = "FSDP2" if all(d.get("fsdp") for d in runs) else (
        "DDP and FSDP2" if any(d.get("fsdp") for d in runs) else "DDP")
    if mlp:
        what = f"MLP regressing a random teacher, {d0['params'] / 1e6:.1f} M parameters, batch {d0['batch']}"
    else:
        what = (f"byte-level GPT, {d0['params'] / 1e6:.1f} M parameters, batch "
                f"{d0['batch']}x{d0['context']}")
    fig.suptitle(f"{how}, {what} per rank")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="oxccl", choices=["oxccl", "gloo"])
    p.add_argument("--model", default="gpt", choices=["gpt", "mlp"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4, help="sequences (gpt) or samples (mlp) per rank and step")
    p.add_argument("--context", type=int, default=128, help="gpt: bytes per sequence")
    p.add_argument("--width", type=int, default=384, help="gpt")
    p.add_argument("--layers", type=int, default=6, help="gpt")
    p.add_argument("--heads", type=int, default=6, help="gpt")
    p.add_argument("--mlp-dims", default="1024,2048,2048,2048,1024",
                   help="mlp: the widths, input to output (default: 12.59 M parameters)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--corpus-mb", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--compute-steps", type=int, default=5)
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="each host's link rate, to report the share of it the gradients use")
    p.add_argument("--compress", default=None,
                   help="oxccl only: average the gradients with oxccl.torch.bfp_hook in this "
                   "BFP format (bfp8, bfp4, bfp8/16, ...)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="with --compress: no residual (what quantisation drops is lost)")
    p.add_argument("--hook", default=None, choices=["fp16", "bf16"],
                   help="register torch's fp16_compress_hook (bf16_compress_hook) with DDP")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard per layer and the root) instead of DDP")
    p.add_argument("--exposure", action="store_true",
                   help="DDP: time each bucket's communication against the backward pass")
    p.add_argument("--json", help="write the run's figures as JSON (rank 0)")
    p.add_argument("--plot", nargs="+", metavar="LOG", help="plot these logs instead of training")
    p.add_argument("-o", "--output", default="ddp.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.output)
    else:
        if "RANK" not in os.environ:
            p.error("run it under torchrun (torchrun --nproc-per-node 4 examples/train_ddp.py)")
        if args.compress in ("off", "none", ""):
            args.compress = None
        if args.compress and args.backend != "oxccl":
            p.error(f"--compress {args.compress} needs --backend oxccl")
        if args.no_error_feedback and not args.compress:
            p.error("--no-error-feedback goes with --compress")
        if args.compress and args.hook:
            p.error("--compress and --hook are two communication hooks: choose one")
        if args.fsdp and (args.compress or args.hook or args.exposure):
            p.error("--compress, --hook and --exposure are DDP's; with --fsdp, oxccl reads "
                    "OXCCL_REDUCE_SCATTER_COMPRESS")
        if args.model == "mlp":
            try:
                mlp_dims(args)
            except ValueError as e:
                p.error(str(e))
        train(args)


if __name__ == "__main__":
    main()
