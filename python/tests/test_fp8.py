"""The 8-bit floats against torch: oxccl's f32 -> fp8 rounding is torch's bit for bit (every
code, every midpoint between neighbours and the f32 values around it, the overflow edges,
signed zeros, NaN and infinities, and random f32 bit patterns); a reduction of every pair of
fp8 values over 2 ranks gives torch's bits for `(a.float() op b.float()).to(fp8)` (avg: the
sum rounded, then halved and rounded, as oxccl's avg divides the stored sum); fp8 tensors,
DLPack tensors and raw bytes with ``dtype=`` are accepted; and torch.distributed all-reduces
fp8 tensors on 4 ranks within the documented error bound of an f64 reference."""

from __future__ import annotations

import traceback

import pytest

import launch

FP8 = {"float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2"}


def _test_values(torch, dtype):
    """float32 values: every code, the midpoints and their neighbours, powers of two and
    their neighbours, specials, random bits; both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    finite = codes[torch.isfinite(codes)].unique().double().sort().values
    top = finite[-1].item()
    step = top - finite[-2].item()
    finite = torch.cat([finite, torch.tensor([top + step, top + 2 * step, top + 4 * step],
                                             dtype=torch.float64)])
    mids = ((finite[1:] + finite[:-1]) / 2).float()
    base = torch.cat([finite.float(), mids]).view(torch.int32)
    near = torch.cat([base + d for d in range(-3, 4)])
    pow2 = torch.cat([(torch.arange(255, dtype=torch.int32) << 23) | m
                      for m in (0, 1, 0x400000, 0x7FFFFF, 0x100000, 0x0FFFFF)])
    specials = torch.tensor([0, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7F7FFFFF, 1],
                            dtype=torch.int64).to(torch.int32)
    g = torch.Generator().manual_seed(8)
    rand = torch.randint(-(2 ** 31), 2 ** 31, (500_000,), generator=g, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([near, pow2, specials, rand])
    bits = torch.cat([bits, bits ^ torch.tensor(-(2 ** 31), dtype=torch.int32)])  # both signs
    return bits.view(torch.float32)


@pytest.mark.parametrize("tname", list(FP8))
def test_rounding_matches_torch_bit_for_bit(torch_available, tname):
    import torch

    import oxccl

    dtype = getattr(torch, tname)
    x = _test_values(torch, dtype)
    want = x.to(dtype).view(torch.uint8)
    got = torch.frombuffer(bytearray(oxccl._oxccl._fp8_convert(x.numpy().tobytes(), FP8[tname])),
                           dtype=torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [
        (hex(x.view(torch.int32)[i].item() & 0xFFFFFFFF), x[i].item(), hex(got[i].item()),
         hex(want[i].item())) for i in bad[:10]
    ]
    # Both spellings name the type.
    alias = FP8[tname].removeprefix("f8")
    assert oxccl._oxccl._fp8_convert(x[:1000].numpy().tobytes(), alias) == bytes(got[:1000].tolist())
    # Widening every code: torch's bits (NaN payloads included).
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    wide = torch.frombuffer(bytearray(oxccl._oxccl._fp8_convert(codes.numpy().tobytes(), tname, True)),
                            dtype=torch.int32)
    assert torch.equal(wide, codes.view(dtype).to(torch.float32).view(torch.int32))


def test_fp8_convert_names_bad_arguments():
    import oxccl

    with pytest.raises(ValueError, match="not an 8-bit float"):
        oxccl._oxccl._fp8_convert(b"\0\0\0\0", "bfloat16")
    with pytest.raises(ValueError, match="unknown data type"):
        oxccl._oxccl._fp8_convert(b"\0\0\0\0", "e4m3fnuz")
    with pytest.raises(ValueError, match="whole number"):
        oxccl._oxccl._fp8_convert(b"\0\0\0", "e4m3")


def worker_pairs():
    import numpy as np
    import torch

    import oxccl

    comm = oxccl.Communicator.from_env(timeout=60)
    rank = comm.rank
    failures = []

    def attempt(name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001
            failures.append(f"rank {rank}: {name} raised:\n{traceback.format_exc()}")

    def every_pair():
        # Rank 0 holds every code a, rank 1 every code b: all 65536 pairs.
        i = torch.arange(65536, dtype=torch.int64)
        a_codes = (i % 256).to(torch.uint8)
        b_codes = (i // 256).to(torch.uint8)
        for tname in FP8:
            dtype = getattr(torch, tname)
            a, b = a_codes.view(dtype), b_codes.view(dtype)
            mine = (a if rank == 0 else b).clone()
            ops = {
                "sum": lambda x, y: x + y,
                "prod": lambda x, y: x * y,
                "min": torch.fmin,
                "max": torch.fmax,
                # avg divides the stored (rounded) sum.
                "avg": lambda x, y: (x + y).to(dtype).float() / 2,
            }
            for op, f in ops.items():
                t = mine.clone()
                comm.all_reduce(t, op)
                want = f(a.float(), b.float()).to(dtype)
                g, w = t.view(torch.uint8), want.view(torch.uint8)
                nan = t.float().isnan() & want.float().isnan()
                # Which zero min(-0, +0) gives is unspecified (IEEE minNum).
                zeros = (t.float() == 0) & (want.float() == 0)
                bad = ((g != w) & ~nan & ~zeros).nonzero().flatten()
                if bad.numel():
                    failures.append(
                        f"rank {rank}: {tname} {op}: {bad.numel()} of 65536 pairs differ from "
                        f"torch, e.g. " + ", ".join(
                            f"{a[k].item()} {op} {b[k].item()} = {t[k].item()} "
                            f"({g[k].item():#04x}), torch {want[k].item()} ({w[k].item():#04x})"
                            for k in bad[:4].tolist()))
                if not torch.equal(t.float().isnan(), want.float().isnan()):
                    failures.append(f"rank {rank}: {tname} {op}: NaNs differ from torch")

    def raw_bytes_and_dlpack():
        # numpy has no fp8: the codes as uint8 with dtype= (1.0 in e4m3 is 0x38, 2.0 0x40).
        x = np.full(16, 0x38, dtype=np.uint8)
        comm.all_reduce(x, dtype="f8e4m3")
        if not (x == 0x40).all():
            failures.append(f"rank {rank}: uint8 bytes as f8e4m3: {x}")
        y = np.full(16, 0x3C, dtype=np.uint8)  # 1.0 in e5m2
        comm.all_reduce(y, dtype="e5m2")
        if not (y == 0x40).all():  # 2.0 in e5m2
            failures.append(f"rank {rank}: uint8 bytes as e5m2: {y}")

        class OnlyDLPack:
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, **kw):
                return self.t.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        d = torch.full((5,), 1.5, dtype=torch.float8_e5m2)
        comm.all_reduce(OnlyDLPack(d))
        if d.float().tolist() != [3.0] * 5:
            failures.append(f"rank {rank}: DLPack float8_e5m2: {d.float().tolist()}")
        # Gathered bytes move untouched, NaNs and all.
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        out = torch.empty(512, dtype=torch.float8_e4m3fn)
        comm.all_gather(codes, out)
        if not torch.equal(out.view(torch.uint8), codes.view(torch.uint8).repeat(2)):
            failures.append(f"rank {rank}: all_gather of every e4m3 code changed bytes")
        try:
            comm.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fnuz))
            failures.append(f"rank {rank}: float8_e4m3fnuz accepted")
        except oxccl.InvalidArgument as e:
            if "float8_e4m3fnuz" not in str(e) or "float8_e4m3fn," not in str(e):
                failures.append(f"rank {rank}: float8_e4m3fnuz message: {e}")

    attempt("every pair", every_pair)
    attempt("raw bytes and DLPack", raw_bytes_and_dlpack)
    comm.barrier()
    launch.report({"failures": failures})


def test_every_pair_reduces_as_torch_rounds(torch_available):
    ranks = launch.run("test_fp8", "worker_pairs", 2, timeout=120)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)


WORLD = 4


def worker_ddp_sum():
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401 - registers the backend

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ox = dist.new_group(backend="oxccl")
    failures = []
    worst = {}
    for tname, u in (("float8_e4m3fn", 2.0 ** -4), ("float8_e5m2", 2.0 ** -3)):
        dtype = getattr(torch, tname)
        # Every rank draws every rank's input (same seeds), magnitudes up to 16, both signs.
        xs = []
        for r in range(n):
            g = torch.Generator().manual_seed(1000 + r)
            xs.append((torch.randn(20_000, generator=g) * 4).clamp(-16, 16).to(dtype))
        t = xs[rank].clone()
        dist.all_reduce(t, group=ox)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        abs_sum = torch.stack([x.double().abs() for x in xs]).sum(0)
        # The documented bound, k = n - 1 roundings (the worst algorithm), smallest
        # subnormal s: ((1+u)^k - 1) sum|x| + (n-1)(1+u)^k s/2.
        k = n - 1
        s = torch.finfo(dtype).smallest_normal * 2.0 ** -(3 if "e4m3" in tname else 2)
        bound = ((1 + u) ** k - 1) * abs_sum + (n - 1) * (1 + u) ** k * s / 2
        err = (t.double() - exact).abs()
        if not bool((err <= bound).all()):
            i = int((err - bound).argmax())
            failures.append(f"rank {rank}: {tname}: element {i}: got {t[i].item()}, exact "
                            f"{exact[i].item()}, error {err[i].item()} > bound {bound[i].item()}")
        # Against torch's own: f64 sum cast once, then the gap to it within the bound plus
        # one rounding.
        ref = exact.to(dtype).double()
        if not bool(((t.double() - ref).abs() <= bound + u * exact.abs() + s / 2).all()):
            failures.append(f"rank {rank}: {tname}: farther from the cast f64 reference than the bound")
        worst[tname] = float((err / bound.clamp_min(1e-30)).max())
    dist.barrier()
    dist.destroy_process_group()
    launch.report({"failures": failures, "worst": worst})


def test_torch_backend_all_reduces_fp8_within_the_bound(torch_available):
    ranks = launch.run("test_fp8", "worker_ddp_sum", WORLD, timeout=120)
    assert all(r.returncode == 0 for r in ranks), launch.explain(ranks)
    failures = [f for r in ranks for f in r.result["failures"]]
    assert not failures, "\n".join(failures)
    print("largest error, fraction of the bound:", ranks[0].result["worst"])
