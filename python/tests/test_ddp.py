"""20 steps of DistributedDataParallel on oxccl match Gloo: the example's byte-level GPT
(examples/train_ddp.py, smaller), trained twice in one job from the same seeds and batches,
once over an oxccl group and once over the default Gloo group. Also the example itself, end
to end under torchrun, on oxccl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def worker_ddp():
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import oxccl.torch  # noqa: F401
    import train_ddp

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ox = dist.new_group(backend="oxccl")
    args = train_ddp.main.__globals__["argparse"].Namespace(
        width=64, layers=2, heads=4, context=32)
    data = torch.frombuffer(bytearray(train_ddp.corpus(1 << 20)), dtype=torch.uint8).long()
    losses = {}
    finals = {}
    for name, group in (("gloo", dist.group.WORLD), ("oxccl", ox)):
        torch.manual_seed(7)
        model = train_ddp.build_model(torch, args)
        # Small buckets: several all-reduces per step, overlapping the backward pass.
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.05)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(100 + rank)
        out = []
        for _ in range(STEPS):
            i = torch.randint(0, len(data) - 33, (8,), generator=gen)
            x = torch.stack([data[j:j + 32] for j in i])
            y = torch.stack([data[j + 1:j + 33] for j in i])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
            lt = loss.detach().double().reshape(1)
            dist.all_reduce(lt, group=group)
            out.append(lt.item())
        losses[name] = out
        finals[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del ddp
    diff = (finals["oxccl"] - finals["gloo"]).abs().max().item()
    scale = finals["gloo"].abs().max().item()
    dist.barrier()
    dist.destroy_process_group()
    launch.report({"losses": losses, "param_diff": diff, "param_scale": scale})


def test_20_ddp_steps_match_gloo(torch_available):
    ranks = launch.run("test_ddp", "worker_ddp", 2, timeout=240)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    for r in ranks:
        g, o = r.result["losses"]["gloo"], r.result["losses"]["oxccl"]
        assert len(g) == len(o) == STEPS
        for s, (a, b) in enumerate(zip(g, o)):
            assert abs(a - b) <= 1e-4 * abs(a), f"step {s}: gloo {a}, oxccl {b}"
        assert g[-1] < g[0] * 0.9, g  # it trains
        assert r.result["param_diff"] <= 1e-4 * r.result["param_scale"], r.result


def test_example_under_torchrun(torch_available, tmp_path):
    log = tmp_path / "ox.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(launch.free_port()), str(ROOT / "examples" / "train_ddp.py"),
           "--backend", "oxccl", "--steps", "4", "--width", "64", "--layers", "2",
           "--heads", "4", "--context", "32", "--compute-steps", "1", "--warmup", "1",
           "--json", str(log)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(log.read_text())
    assert d["backend"] == "oxccl" and d["world"] == 2 and len(d["losses"]) == 4, d
    assert "median step" in p.stdout, p.stdout
    png = tmp_path / "ddp.png"
    q = subprocess.run([sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--plot",
                        str(log), "-o", str(png)], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and png.stat().st_size > 10_000, q.stderr
