"""Mooncake Transfer Engine's 4 KiB synchronous round trip over its own TCP transport, the
reference bench/kv-vs-mooncake.sh holds oxccl-kv against (not part of the test suite).

    python bench/mooncake_lat.py [--op write|read] [--block-size 4096] [--secs 2] [--warmup 200]

The initiator (this process) spawns the target (`--role target`: a second process with its own
engine, P2PHANDSHAKE metadata, so no etcd), opens its segment and moves one request at a time
with `transfer_sync_write` / `transfer_sync_read`, timing each call. Prints one JSON line:
p50/p90/p99 in microseconds per request, the calling thread's CPU share (its own CPU time over
the wall time: Mooncake's waiting thread), and both processes' CPU over the wall time.

Needs the `mooncake-transfer-engine` wheel (bench/kv-vs-mooncake.sh installs it in its own
venv); its engine.so links libcuda.so.1, which a machine without a GPU lacks: the script is run
with a stand-in library on LD_LIBRARY_PATH whose every call says "no device".
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def engine():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        sys.exit(f"mooncake: initialize failed ({rc})")
    return e


def target(size):
    e = engine()
    buf = e.allocate_managed_buffer(size)
    if not buf:
        sys.exit(f"mooncake target: allocate_managed_buffer({size}) failed")
    # (allocate_managed_buffer registers it.)
    print(f"segment 127.0.0.1:{e.get_rpc_port()} addr {buf}", flush=True)
    sys.stdin.read()  # serve until the initiator closes our stdin
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"cpu {usage.ru_utime + usage.ru_stime}", flush=True)


def initiator(args):
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", "--buffer-size", str(args.buffer_size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().split()
    if len(line) != 4 or line[0] != "segment":
        sys.exit(f"mooncake initiator: the target said {line!r}")
    seg, raddr = line[1], int(line[3])
    e = engine()
    buf = e.allocate_managed_buffer(args.buffer_size)
    if not buf:
        sys.exit("mooncake initiator: allocate_managed_buffer failed")
    call = e.transfer_sync_write if args.op == "write" else e.transfer_sync_read
    n_slots = max(1, args.buffer_size // args.block_size)
    for i in range(args.warmup):
        off = (i % n_slots) * args.block_size
        rc = call(seg, buf + off, raddr + off, args.block_size)
        if rc != 0:
            sys.exit(f"mooncake initiator: warm-up transfer {i} failed ({rc})")
    lat = []
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    th0 = time.thread_time()
    t0 = time.perf_counter()
    end = t0 + args.secs
    i = 0
    now = t0
    while now < end:
        off = (i % n_slots) * args.block_size
        a = time.perf_counter_ns()
        rc = call(seg, buf + off, raddr + off, args.block_size)
        b = time.perf_counter_ns()
        if rc != 0:
            sys.exit(f"mooncake initiator: transfer {i} failed ({rc})")
        lat.append(b - a)
        i += 1
        now = time.perf_counter()
    wall = now - t0
    th = time.thread_time() - th0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    child.stdin.close()
    tail = child.stdout.read().split()
    child.wait(timeout=30)
    target_cpu = float(tail[1]) if len(tail) == 2 and tail[0] == "cpu" else None
    lat.sort()

    def pct(p):
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] / 1e3

    proc = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    print(
        json.dumps(
            {
                "engine": "mooncake",
                "op": args.op,
                "block": args.block_size,
                "iters": len(lat),
                "p50": round(pct(50), 3),
                "p90": round(pct(90), 3),
                "p99": round(pct(99), 3),
                "wait_cpu": round(100 * th / wall, 1),
                "init_cpu": round(100 * proc / wall, 1),
                # The target's whole life (start-up and warm-up included) over the measured
                # wall time: an upper bound.
                "target_cpu_total_s": target_cpu,
            },
            separators=(",", ":"),
        ),
        flush=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["initiator", "target"], default="initiator")
    p.add_argument("--op", choices=["write", "read"], default="write")
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--buffer-size", type=int, default=4 << 20)
    p.add_argument("--secs", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if args.role == "target":
        target(args.buffer_size)
    else:
        initiator(args)


if __name__ == "__main__":
    main()
