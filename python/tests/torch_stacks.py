"""The workers of test_torch_stacks.py: what torch builds on a process group (DeviceMesh, DDP,
FSDP2, DTensor, tensor parallelism, pipelining, distributed checkpointing), run as one job on
the backend named by the first argument ("gloo" or "oxccl"), each scenario reporting its
losses so that the test can compare the two backends' runs.

Every scenario trains a small model for STEPS steps from the same seed on batches drawn from a
generator seeded by the step and the rank, so the same script on two backends computes the
same sums; only the order of additions in the collectives may differ."""

from __future__ import annotations

import os
import sys
import time
import traceback

import launch

STEPS = 10
# H odd: FSDP2's shards of the first layer are uneven; TP splits H_TP evenly.
D, H, H_TP, SEQ, BATCH = 16, 33, 32, 8, 4


def _batch(step: int, key: int, seq: int = SEQ):
    import torch

    g = torch.Generator().manual_seed(1000 * step + key)
    x = torch.randn(BATCH, seq, D, generator=g)
    # A target the model can learn: a fixed map of x, and a little noise.
    teacher = torch.randn(D, D, generator=torch.Generator().manual_seed(5)) / D**0.5
    y = torch.tanh(x @ teacher) + 0.01 * torch.randn(BATCH, seq, D, generator=g)
    return x, y


def _mlp(h=H):
    import torch
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.w1 = nn.Linear(D, h)
            self.w2 = nn.Linear(h, D)

        def forward(self, x):
            return self.w2(torch.relu(self.w1(self.norm(x))))

    torch.manual_seed(0)
    return Mlp()


def _mse(out, y):
    import torch

    return torch.nn.functional.mse_loss(out, y)


# -- scenarios: each returns a list of per-step losses (floats) -------------------------------
def ddp(mesh):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = mesh.get_rank()
    model = DDP(_mlp(), device_mesh=mesh, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fsdp_model(mesh, reshard, mixed):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import torch

    model = _mlp()
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    fully_shard(model.w1, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=not reshard, mp_policy=mp)
    return model


def _fsdp_steps(model, opt, rank, first, last):
    losses = []
    for step in range(first, last):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = _mse(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp2(mesh, mixed=False):
    import torch

    model = _fsdp_model(mesh, reshard=True, mixed=mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _fsdp_steps(model, opt, mesh.get_rank(), 0, STEPS)


def fsdp2_bf16(mesh):
    return fsdp2(mesh, mixed=True)


def dcp(mesh, where):
    """FSDP2 for STEPS/2 steps, a DCP checkpoint, a fresh model and optimizer loaded from it,
    then the rest of the steps: the losses of an uninterrupted run (fsdp2's)."""
    import torch
    import torch.distributed.checkpoint as dcp_
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = mesh.get_rank()
    half = STEPS // 2
    model = _fsdp_model(mesh, reshard=True, mixed=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _fsdp_steps(model, opt, rank, 0, half)
    msd, osd = get_state_dict(model, opt)
    dcp_.save({"model": msd, "optim": osd}, checkpoint_id=where)
    del model, opt, msd, osd
    model = _fsdp_model(mesh, reshard=True, mixed=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One step's worth of optimizer state must exist for it to be loaded into.
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp_.load(state, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return losses + _fsdp_steps(model, opt, rank, half, STEPS)


def _tp_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Replicate()),
    }


def tp(mesh, dp_mesh=None, key=0):
    """Megatron-style: a sequence-parallel LayerNorm, a column-wise then a row-wise Linear; each
    rank of the TP group feeds its slice of the sequence. With ``dp_mesh``, FSDP2 on top."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_rank, tp_size = mesh.get_local_rank(), mesh.size()
    model = parallelize_module(_mlp(H_TP), mesh, _tp_plan())
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    chunk = SEQ // tp_size
    for step in range(STEPS):
        x, y = _batch(step, key)
        x = x[:, tp_rank * chunk : (tp_rank + 1) * chunk].contiguous()
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def pipeline(world, schedule_name):
    """Two stages (rank 0: norm and w1; rank 1: w2), 4 microbatches."""
    import torch
    from torch import nn
    from torch.distributed import pipelining as pp

    rank = world.rank()
    full = _mlp()
    if rank == 0:
        sub = nn.Sequential(full.norm, full.w1, nn.ReLU())
    else:
        sub = nn.Sequential(full.w2)
    stage = pp.PipelineStage(sub, rank, 2, torch.device("cpu"), group=world)
    cls = getattr(pp, schedule_name)
    sched = cls(stage, n_microbatches=4, loss_fn=_mse)
    opt = torch.optim.AdamW(sub.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, 0)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
            losses.append(0.0)
        else:
            mb = []
            sched.step(target=y, losses=mb)
            losses.append(float(sum(m.item() for m in mb) / len(mb)))
        opt.step()
    return losses


def dtensor(mesh):
    """Redistributions between placements, each compared with the tensor it stands for;
    returns the number checked (raises on a wrong value)."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor

    n = mesh.size()
    rank = mesh.get_local_rank()
    torch.manual_seed(3)
    full = torch.randn(4 * n + 2, 6)  # not divisible: uneven shards
    checked = 0
    pairs = [
        ([Shard(0)], [Replicate()]),
        ([Replicate()], [Shard(1)]),
        ([Shard(0)], [Shard(1)]),
        ([Shard(1)], [Shard(0)]),
    ]
    for src, dst in pairs:
        d = distribute_tensor(full, mesh, src).redistribute(mesh, dst)
        torch.testing.assert_close(d.full_tensor(), full, rtol=0, atol=0)
        checked += 1
    # Partial: each rank holds rank+1 times the tensor; the sum is n(n+1)/2 times it.
    part = DTensor.from_local(full * (rank + 1), mesh, [Partial()])
    want = full * (n * (n + 1) / 2)
    for dst in ([Replicate()], [Shard(0)]):
        got = part.redistribute(mesh, dst).full_tensor()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        checked += 1
    avg = DTensor.from_local(full * (rank + 1), mesh, [Partial("avg")])
    got = avg.redistribute(mesh, [Replicate()]).to_local()
    torch.testing.assert_close(got, full * ((n + 1) / 2), rtol=1e-6, atol=1e-6)
    return checked + 1


# -- the jobs ------------------------------------------------------------------------------
def _run(results, name, fn, *args):
    t0 = time.monotonic()
    try:
        results[name] = {"value": fn(*args), "s": round(time.monotonic() - t0, 2)}
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails naming it
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}


def _init(backend):
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(backend)
    return dist


def worker_2(backend, where):
    """2 ranks: a 1-D mesh under DDP, FSDP2 (fp32 and bf16 params), DCP, TP, DTensor, and a
    2-stage pipeline under GPipe and 1F1B; on oxccl also the c10d surface (surface.py)."""
    dist = _init(backend)
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    _run(results, "ddp", ddp, mesh)
    _run(results, "fsdp2", fsdp2, mesh)
    _run(results, "fsdp2_bf16", fsdp2_bf16, mesh)
    _run(results, "dcp", dcp, mesh, os.path.join(where, f"ckpt-{backend}"))
    _run(results, "tp", tp, mesh)
    _run(results, "dtensor", dtensor, mesh)
    world = dist.group.WORLD
    _run(results, "gpipe", pipeline, world, "ScheduleGPipe")
    _run(results, "1f1b", pipeline, world, "Schedule1F1B")
    if backend == "oxccl":
        import surface

        _run(results, "surface", surface.check)
    dist.barrier()
    dist.destroy_process_group()
    launch.report(results)


def worker_4(backend):
    """4 ranks: a 2-D (dp, tp) mesh; TP inside each tp pair, FSDP2 across the dp pairs."""
    dist = _init(backend)
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    results["groups"] = {
        "tp": dist.get_process_group_ranks(tp_mesh.get_group()),
        "dp": dist.get_process_group_ranks(dp_mesh.get_group()),
    }
    _run(results, "2d", tp, tp_mesh, dp_mesh, dp_mesh.get_local_rank())
    dist.barrier()
    dist.destroy_process_group()
    launch.report(results)


if __name__ == "__main__":
    sys.exit("run by test_torch_stacks.py")
