#!/usr/bin/env python3
"""Trains a byte-level GPT with DistributedDataParallel on oxccl (or Gloo, the reference).

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend oxccl --json /tmp/ox.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo  --json /tmp/gloo.json
    torchrun --nproc-per-node 4 examples/train_ddp.py --compress bfp8 --json /tmp/bfp8.json
    python examples/train_ddp.py --plot /tmp/ox.json /tmp/gloo.json -o ddp.png

The corpus is the Python standard library's own sources (every ``*.py`` file under
``sysconfig``'s stdlib path, in sorted order), so nothing is downloaded. Each rank draws its
batches from its own seeded generator, so two runs with the same seeds see the same data and
differ only in how the gradients were summed. The default model (6 layers, width 384, 128-byte
context) has 10.8 M parameters.

Rank 0 prints each step's loss and time, and at the end the median step time, the median time
of the same step without gradient synchronisation (``no_sync``: compute only, measured in the
same run) and the share of the step that communication adds; ``--json`` writes all of it as
JSON, ``--plot`` draws loss and step time of several logs overlaid (and, beside them, each
log's loss relative to the first one's).

``--compress bfp8`` (``bfp4``, ``bfp8/16``, ...; oxccl only) registers the DDP communication
hook ``oxccl.torch.bfp_hook``: the gradient buckets are averaged with a block-floating-point
compressed all-reduce, with error feedback (a residual per bucket) unless
``--no-error-feedback``.
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
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    if args.compress:
        state = oxccl.torch.BfpState(compress=args.compress,
                                     error_feedback=not args.no_error_feedback)
        ddp.register_comm_hook(state, oxccl.torch.bfp_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    data = torch.frombuffer(bytearray(corpus(args.corpus_mb << 20)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)

    def batch():
        i = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=gen)
        x = torch.stack([data[j : j + args.context] for j in i])
        y = torch.stack([data[j + 1 : j + args.context + 1] for j in i])
        return x, y

    def step(sync: bool) -> float:
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        if sync:
            logits = ddp(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
        else:
            with ddp.no_sync():
                logits = ddp(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
                loss.backward()
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
    grad_bytes = 4 * params
    ring_bytes = 2 * (world - 1) / world * grad_bytes
    out = {
        "backend": args.backend,
        "compress": args.compress,
        "error_feedback": bool(args.compress) and not args.no_error_feedback,
        "world": world,
        "params": params,
        "batch": args.batch,
        "context": args.context,
        "losses": losses,
        "step_s": times,
        "median_step_s": med,
        "median_compute_s": comp,
        "comm_share": max(0.0, 1 - comp / med) if compute else None,
        "grad_bytes": grad_bytes,
        "ring_bytes_per_rank": ring_bytes,
        "argv": sys.argv,
    }
    if args.link_gbps:
        # The ring all-reduce sends ring_bytes per rank per step over each host's link.
        out["link_share"] = ring_bytes / max(med - comp, 1e-9) / (args.link_gbps * 1e9 / 8)
    if rank == 0:
        print(
            f"{label(out)}: {world} ranks, {params / 1e6:.2f} M parameters, batch "
            f"{args.batch}x{args.context}: median step {med * 1e3:.1f} ms, compute only "
            f"{comp * 1e3:.1f} ms, communication {100 * (out['comm_share'] or 0):.1f}% of the "
            f"step; final loss {losses[-1]:.6f}",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(out))
    dist.destroy_process_group()
    return out


def label(d: dict) -> str:
    """A log's name: its backend, and its compression (with or without error feedback)."""
    name = d["backend"]
    if d.get("compress"):
        name += f" {d['compress']}" + (" + EF" if d.get("error_feedback") else " no EF")
    return name


def plot(logs: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in logs]
    panels = 3 if len(runs) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.3))
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
    a.set(xlabel="step", ylabel="loss (cross-entropy, nats/byte)", title="training loss")
    b.set(xlabel="step", ylabel="step time (ms)", title="step time")
    b.set_ylim(bottom=0)
    if panels == 3:
        axes[1].set(xlabel="step", ylabel="%",
                    title=f"loss relative to {label(runs[0])} ({win}-step mean)")
        axes[1].axhline(0, color="black", lw=0.6)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    d0 = runs[0]
    fig.suptitle(
        f"DDP, byte-level GPT, {d0['params'] / 1e6:.1f} M parameters, batch "
        f"{d0['batch']}x{d0['context']} per rank"
    )
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="oxccl", choices=["oxccl", "gloo"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
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
        train(args)


if __name__ == "__main__":
    main()
