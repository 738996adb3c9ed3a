"""DeviceMesh on "oxccl" (issue 27's first failure: init_device_mesh raised "ProcessGroup name
not set"): a 1-D mesh whose group has a name and whose DTensor round-trips, and a 2-D (dp, tp)
mesh of 4 ranks whose named sub-meshes reduce over the right ranks. Expected values are
computed from the rank numbers, not by another backend."""

from __future__ import annotations

import launch


def worker_mesh():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import oxccl.torch  # noqa: F401

    dist.init_process_group("oxccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    out["name"] = mesh.get_group().group_name
    full = torch.arange(4.0 * world * 3).reshape(4 * world, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    out["local_rows"] = list(d.to_local().shape)
    out["round_trip"] = bool(torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full))
    if world == 4:
        m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=m2[dim].get_group())
            out[dim] = t.item()
    dist.destroy_process_group()
    launch.report(out)


def test_a_1d_mesh_and_a_2d_mesh_with_named_dims(torch_available):
    for n in (2, 4):
        ranks = launch.run("test_device_mesh", "worker_mesh", n, timeout=120)
        assert all(r.returncode == 0 and r.result for r in ranks), launch.explain(ranks)
        for rank, r in enumerate(ranks):
            o = r.result
            assert o["name"], o
            assert o["local_rows"] == [4, 3] and o["round_trip"], o
            if n == 4:
                # Mesh [[0, 1], [2, 3]]: tp groups are rows ({0,1}, {2,3}), dp columns.
                tp = {0: 1, 1: 1, 2: 5, 3: 5}[rank]
                dp = {0: 2, 1: 4, 2: 2, 3: 4}[rank]
                assert (o["tp"], o["dp"]) == (tp, dp), (rank, o)
