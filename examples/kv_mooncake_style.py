#!/usr/bin/env python3
"""Prefill/decode KV-cache hand-off written against Mooncake's TransferEngine API.

    python examples/kv_mooncake_style.py --protocol tcp     # or shm, auto, rdma

Two processes, as in a disaggregated vLLM/SGLang deployment:

- decode starts an engine (``P2PHANDSHAKE``: no metadata service), registers its KV cache
  (a numpy array) and tells prefill, over a side channel (a multiprocessing queue standing in
  for the framework's ZMQ), its session (``host:rpc_port``) and where its cache lives;
- prefill computes KV blocks, WRITEs every other block straight into decode's cache in one
  batch, then sends a last block with a notification ``"done"``, which reaches decode only
  after all of that data;
- decode waits for the notification, READs the remaining blocks from prefill's memory itself,
  and checks every block byte for byte.

The engine code is Mooncake's API unchanged: only the import differs
(``from mooncake.engine import ...`` there), and no variable needs setting: the job secret
that authenticates the two engines comes from ``OXCCL_SECRET`` or ``OXCCL_SECRET_FILE`` when
set, else from the user's secret file (``~/.config/oxccl/secret``, created with mode 0600 on
first use), which both processes share.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from oxccl.kv import TransferEngine, TransferNotify, TransferOpcode  # was: mooncake.engine

HOST = "127.0.0.1"


def kv_block(i: int, block_size: int) -> np.ndarray:
    """What prefill computes for block ``i`` (deterministic, so decode can check it)."""
    return np.random.default_rng(1000 + i).integers(0, 256, block_size, dtype=np.uint8)


def decode(args: argparse.Namespace, to_prefill: mp.Queue, from_prefill: mp.Queue) -> None:
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", args.protocol, "") != 0:
        sys.exit("decode: initialize failed")
    session = f"{HOST}:{engine.get_rpc_port()}"
    cache = np.zeros(args.blocks * args.block_size, dtype=np.uint8)
    if engine.register_memory(cache.ctypes.data, cache.nbytes) != 0:
        sys.exit("decode: register_memory failed")
    to_prefill.put({"session": session, "cache": cache.ctypes.data})

    info = from_prefill.get(timeout=60)  # prefill's session and its blocks' addresses
    deadline = time.monotonic() + 60
    notifies = []
    while not notifies:
        notifies = engine.get_notifies()
        if time.monotonic() > deadline:
            sys.exit("decode: no notification within 60 s")
        time.sleep(0.001)
    assert [(n.name, n.msg) for n in notifies] == [("prefill", "done")], notifies
    print(f"decode: notification {notifies[0].name}/{notifies[0].msg} received")

    # Pull the odd blocks (prefill did not push them) straight from prefill's memory.
    odd = list(range(1, args.blocks, 2))
    ret = engine.batch_transfer_sync_read(
        info["session"],
        [cache.ctypes.data + i * args.block_size for i in odd],
        [info["blocks"] + i * args.block_size for i in odd],
        [args.block_size] * len(odd),
    )
    if ret < 0:
        sys.exit(f"decode: batch_transfer_sync_read failed ({ret})")
    for i in range(args.blocks):
        got = cache[i * args.block_size : (i + 1) * args.block_size]
        if not np.array_equal(got, kv_block(i, args.block_size)):
            sys.exit(f"decode: block {i} differs")
    print(f"decode: all blocks verified ({args.blocks} x {args.block_size} bytes)")
    to_prefill.put("bye")
    engine.unregister_memory(cache.ctypes.data)


def prefill(args: argparse.Namespace, from_decode: mp.Queue, to_decode: mp.Queue) -> None:
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", args.protocol, "") != 0:
        sys.exit("prefill: initialize failed")
    blocks = np.concatenate([kv_block(i, args.block_size) for i in range(args.blocks)])
    if engine.register_memory(blocks.ctypes.data, blocks.nbytes) != 0:
        sys.exit("prefill: register_memory failed")
    peer = from_decode.get(timeout=60)
    to_decode.put({"session": f"{HOST}:{engine.get_rpc_port()}", "blocks": blocks.ctypes.data})

    bs = args.block_size
    even = list(range(0, args.blocks - 1, 2))
    t0 = time.perf_counter()
    ret = engine.batch_transfer_sync_write(
        peer["session"],
        [blocks.ctypes.data + i * bs for i in even],
        [peer["cache"] + i * bs for i in even],
        [bs] * len(even),
    )
    if ret < 0:
        sys.exit(f"prefill: batch_transfer_sync_write failed ({ret})")
    # The last even block goes with the notification: decode sees "done" after its data.
    last = args.blocks - 1 if (args.blocks - 1) % 2 == 0 else args.blocks - 2
    ret = engine.transfer_sync(
        peer["session"],
        blocks.ctypes.data + last * bs,
        peer["cache"] + last * bs,
        bs,
        TransferOpcode.Write,
        TransferNotify("prefill", "done"),
    )
    if ret < 0:
        sys.exit(f"prefill: transfer_sync failed ({ret})")
    dt = time.perf_counter() - t0
    pushed = (len(even) + (last not in even)) * bs
    print(f"prefill: pushed {pushed} bytes in {dt * 1e3:.1f} ms ({pushed / dt / 1e9:.2f} GB/s)")
    assert from_decode.get(timeout=60) == "bye"  # decode read the rest from us
    engine.unregister_memory(blocks.ctypes.data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--protocol", default="tcp", help="tcp, rdma, shm or auto")
    ap.add_argument("--blocks", type=int, default=33)
    ap.add_argument("--block-size", type=int, default=256 << 10)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    d2p, p2d = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=decode, args=(args, d2p, p2d), name="decode"),
        ctx.Process(target=prefill, args=(args, d2p, p2d), name="prefill"),
    ]
    for p in procs:
        p.start()
    code = 0
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            print(f"{p.name}: still running after 120 s", file=sys.stderr)
            code = 1
        elif p.exitcode != 0:
            print(f"{p.name}: exit code {p.exitcode}", file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
