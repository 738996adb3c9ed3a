"""Everything torch builds on a process group, on "oxccl", against Gloo (issue 27): the same
script (torch_stacks.py) runs once with init_process_group("gloo") and once with
init_process_group("oxccl"); each scenario's losses over 10 steps must agree to 1e-5
relative. 2 ranks: DeviceMesh + DDP, FSDP2 (uneven shards, reshard_after_forward both ways,
bf16 params with fp32 reduction), a DCP checkpoint saved halfway and loaded into a fresh model
(the losses of the uninterrupted run), tensor parallelism (sequence-parallel LayerNorm,
column-wise, row-wise), DTensor redistributions, and a 2-stage pipeline under GPipe and 1F1B;
4 ranks: a 2-D (dp, tp) mesh, TP inside and FSDP2 across. Then the rest of the c10d surface
on oxccl alone (surface.py)."""

from __future__ import annotations

import pytest

import launch

RTOL = 1e-5


def _job(tmp_path_factory, n, backend):
    if n == 2:
        where = str(tmp_path_factory.mktemp(f"stacks-{backend}"))
        ranks = launch.run("torch_stacks", "worker_2", 2, timeout=240, args=[backend, where])
    else:
        ranks = launch.run("torch_stacks", "worker_4", 4, timeout=240, args=[backend])
    assert all(r.returncode == 0 and r.result for r in ranks), launch.explain(ranks)
    return [r.result for r in ranks]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return {b: _job(tmp_path_factory, 2, b) for b in ("gloo", "oxccl")}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return {b: _job(tmp_path_factory, 4, b) for b in ("gloo", "oxccl")}


def _value(results, name, rank):
    r = results[rank][name]
    assert "error" not in r, f"rank {rank}: {name}: {r['error']}"
    return r["value"]


def _same_losses(jobs, name, ranks=None, trains=True):
    """``name``'s losses on oxccl equal Gloo's to RTOL on every rank (or ``ranks``)."""
    for rank in ranks if ranks is not None else range(len(jobs["gloo"])):
        g = _value(jobs["gloo"], name, rank)
        o = _value(jobs["oxccl"], name, rank)
        assert len(g) == len(o) >= 10, (g, o)
        for step, (a, b) in enumerate(zip(g, o)):
            assert abs(a - b) <= RTOL * abs(a), f"{name}, rank {rank}, step {step}: gloo {a}, oxccl {b}"
        if trains:
            assert o[-1] < 0.8 * o[0], f"{name} does not train: {o}"


def test_ddp_on_a_1d_mesh_matches_gloo(torch_available, two):
    _same_losses(two, "ddp")


def test_fsdp2_matches_gloo(torch_available, two):
    _same_losses(two, "fsdp2")


def test_fsdp2_bf16_params_fp32_reduce_matches_gloo(torch_available, two):
    _same_losses(two, "fsdp2_bf16")
    # bf16 parameters do change the losses (the policy took effect).
    assert _value(two["oxccl"], "fsdp2_bf16", 0) != _value(two["oxccl"], "fsdp2", 0)


def test_dcp_checkpoint_resumes_exactly(torch_available, two):
    for rank in range(2):
        resumed = _value(two["oxccl"], "dcp", rank)
        straight = _value(two["oxccl"], "fsdp2", rank)
        assert resumed == straight, (rank, resumed, straight)
    _same_losses(two, "dcp")


def test_tensor_parallel_matches_gloo(torch_available, two):
    _same_losses(two, "tp")


def test_dtensor_redistributions(torch_available, two):
    for rank in range(2):
        assert _value(two["oxccl"], "dtensor", rank) == 7
        assert _value(two["gloo"], "dtensor", rank) == 7


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_2_stages_matches_gloo(torch_available, two, schedule):
    # The last stage computes the losses (the first reports zeros).
    _same_losses(two, schedule, ranks=[1])


def test_2d_mesh_dp_tp_matches_gloo(torch_available, four):
    for rank, r in enumerate(four["oxccl"]):
        assert r["groups"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1], r["groups"]
        assert r["groups"]["dp"] == [rank % 2, rank % 2 + 2], r["groups"]
    _same_losses(four, "2d")


def test_c10d_surface(torch_available, two):
    for rank in range(2):
        s = _value(two["oxccl"], "surface", rank)
        peer = 1 - rank
        assert s["names"] and s["backend_name"] == "oxccl", s
        # split_group([[1, 0]]): this rank's place is reversed; 1 + 2 summed; an oxccl backend.
        assert s["split"] == [peer, 3.0, "ProcessGroupOxccl"], s["split"]
        # The 1 MiB and the 3 values crossed by tag, in one oxccl group.
        assert s["batch"] == [10 * peer + 1] * 2 + [10 * peer + 2, 1], s["batch"]
        assert s["tagged"] == (5.0 if rank == 0 else 0.0)
        assert s["coalesced_allreduce"] == [1.0, 3.0, 5.0]
        assert s["coalesced_allgather"] == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0]]
        want_rs = [[0.0, 3.0], [0.0, 3.0]] if rank == 0 else [[6.0, 9.0], [6.0, 9.0]]
        assert s["coalesced_reduce_scatter"] == want_rs
        assert s["avg_exact"][0], s["avg_exact"]
        assert s["alltoall_splits"] == ([0.0, 100.0, 101.0, 102.0] if rank == 0 else [1.0, 2.0, 103.0])
        assert s["all_gather_object"] == [[0, 0], [1, 100]]
        assert s["gather_object"] == ([["r", 0], ["r", 1]] if rank == 0 else "not root")
        assert s["broadcast_object_list"] == [{"k": 1}, "two", 3]
        assert s["scatter_object_list"] == ([1, "a"] if rank == 0 else [2, "bb" * 50])
        for key, words in (("refused_band", ["BAND"]), ("refused_anysource", ["any source"])):
            kind, msg, quick = s[key]
            assert kind == "InvalidArgument" and quick, s[key]
            assert all(w in msg for w in words), s[key]
