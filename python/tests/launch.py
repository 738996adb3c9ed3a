"""Runs a worker function of a test module as N ranks (separate processes), with the
environment torchrun gives its ranks, and collects what each printed.

A worker reports by printing one line ``RESULT <json>``; ``run`` returns each rank's exit
code, the parsed result (or None) and its output, and never waits past its timeout (the
ranks still running then are killed and the timeout is reported)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rank:
    rank: int
    returncode: int | None
    result: object
    output: str


def report(value: object) -> None:
    """Called by a worker: its result for the test."""
    print("RESULT " + json.dumps(value), flush=True)


def run(module: str, func: str, n: int, timeout: float = 120, env: dict | None = None,
        args: list[str] | None = None) -> list[Rank]:
    port = free_port()
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(n),
        LOCAL_WORLD_SIZE=str(n),
        OXCCL_SECRET=f"pytest-{port}-{os.getpid()}",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    base.update(env or {})
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import {module} as m; "
        f"m.{func}(*sys.argv[1:])"
    )
    procs = []
    for r in range(n):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, *(args or [])],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    # Every rank's output is read as it comes, on a thread per rank: a rank whose pipe is not
    # drained blocks in its next write (a flight-recorder dump is ~200 KB) and can stall the
    # others in a collective with it (as communicate() on one rank after the other did).
    chunks: list[list[str]] = [[] for _ in procs]

    def drain(p: subprocess.Popen, into: list[str]) -> None:
        for line in p.stdout:
            into.append(line)

    readers = [threading.Thread(target=drain, args=(p, c), daemon=True)
               for p, c in zip(procs, chunks)]
    for t in readers:
        t.start()
    end = time.monotonic() + timeout
    killed = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            p.wait()
    for t in readers:
        t.join(timeout=10)
    outs = ["".join(c) for c in chunks]
    if killed:
        outs = [o + f"\n[launch: killed after the {timeout} s timeout]" for o in outs]
    ranks = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        result = None
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        ranks.append(Rank(r, p.returncode, result, out))
    return ranks


def explain(ranks: list[Rank]) -> str:
    return "\n".join(
        f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in ranks
    )
