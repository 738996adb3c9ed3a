#!/usr/bin/env python3
"""DDP training on oxccl that survives a lost rank and takes a replacement (issue 32).

    python examples/elastic_ddp.py                       # 4 ranks; rank 2 dies at step 15,
                                                          # a replacement comes at step 30
    python examples/elastic_ddp.py --world 4 --steps 60 --kill-rank 2 --kill-step 15 \\
        --join-step 30 --json /tmp/elastic.json

The launcher (the default role) serves the rendezvous store (a TCPStore, in this process, so
that any rank may die), starts ``--world`` worker processes, and prints their events and a
summary. ``--kill-rank R --kill-step K``: rank R SIGKILLs itself in the middle of step K (in
its DDP communication hook, with its gradients computed and nothing of them sent yet).
``--join-step J``: once rank 0 has completed step J (after the failure), the launcher starts a
replacement. ``--host-prefix "CMD {host}"`` runs each process under a command (rank r on host
r, the store and the launcher's bookkeeping stay here but the store runs on host 0 as its own
process: bench/elastic.sh uses it with network namespaces).

How the workers go on (the shape of torchft's per-step quorum, on one process group that is
reconfigured instead of recreated):

- Each step: the rank's shard of the step's global batch (``--batch`` rows drawn from a seed
  and the step number, shard ``rank`` of ``world``, so that the data re-shards by itself when
  the world changes), forward, backward (DDP averages the gradients), the optimizer step, then
  one small all-reduce, the step's "quorum": the global loss and the number of replacements
  waiting (rank 0 reads it from the store).
- On ``oxccl.Error`` (``PeerFailed``; ``Aborted`` when a faster survivor's shrink stopped the
  group first), raised by any of these calls, the survivors call ``oxccl.torch.shrink()``: they
  agree through the store on who is gone, get a group of the survivors renumbered from 0 (the
  new default group), take new rank 0's model, optimizer state and step count by broadcast
  (its live state is the state after the last step it completed: a failed step never reaches
  its optimizer step), rebuild DDP on the new group and go on from there. The loss is scaled
  so that the averaged gradient is that of the global batch's mean loss whatever the world
  size: the loss curve is the one a run without failure would have drawn.
- When the quorum says a replacement waits, the members call ``oxccl.torch.grow(count)`` at
  the step boundary and the replacement ``oxccl.torch.join(store)``; rank 0 broadcasts the
  state to the grown group, DDP is rebuilt, and training goes on at the full size.

Every worker prints ``EVENT {json}`` lines (rank 0 one per step with the loss; every rank its
recovery and join times, wall clock); the launcher's summary gives kill -> survivors' first
completed step and replacement start -> its first completed step. ``--save DIR`` writes each
worker's final parameters (``DIR/final-<rank>.pt``) for a check against a serial run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WAITING = "elastic/waiting"  # replacements that announced themselves, not yet grown in


# -- the model, the data and one step (the test's serial reference uses these too) ---------------
def dims_of(args) -> list:
    dims = [int(v) for v in str(args.dims).split(",")]
    if len(dims) < 2 or min(dims) < 1:
        raise SystemExit(f"--dims {args.dims!r}: two or more positive widths")
    return dims


def build(torch, args):
    """The model (an MLP, from ``--seed``) and its optimizer (SGD with momentum, the momentum
    buffers made at once so that the state's shape never changes)."""
    dims = dims_of(args)
    torch.manual_seed(args.seed)
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for p in model.parameters():
        # SGD takes a first momentum buffer of g; 0.9 * 0 + g is the same number.
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return model, opt


def batch(torch, args, step: int):
    """Step ``step``'s global batch: ``--batch`` inputs from N(0, 1) and a fixed random
    teacher's outputs (tanh(x A) B), the same on every rank and in every run."""
    dims = dims_of(args)
    g = torch.Generator().manual_seed(args.seed + 7919)
    hidden = 64
    a = torch.randn(dims[0], hidden, generator=g) / dims[0] ** 0.5
    b = torch.randn(hidden, dims[-1], generator=g) / (0.394 * hidden) ** 0.5
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch, dims[0], generator=g)
    return x, torch.tanh(x @ a) @ b


def shard(n: int, rank: int, world: int) -> slice:
    return slice(n * rank // world, n * (rank + 1) // world)


def local_loss(torch, out, y, total: int, world: int):
    """This rank's part of the global batch's mean squared error, times ``world``: DDP
    averages the ranks' gradients, so their mean is the gradient of the global mean (for any
    world size and uneven shards). Returns (the scaled loss, its unscaled part of the mean)."""
    part = ((out - y) ** 2).sum() / (total * y.shape[1])
    return part * world, part.detach()


def state_tensors(model, opt) -> list:
    return [p.data for p in model.parameters()] + [
        opt.state[p]["momentum_buffer"] for p in model.parameters()
    ]


def sync_state(torch, dist, pg, model, opt, step: int) -> int:
    """Rank 0's step, model and optimizer state, to every rank of ``pg`` (two broadcasts)."""
    meta = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(meta, group=pg, group_src=0)
    flat = torch.cat([t.reshape(-1) for t in state_tensors(model, opt)])
    dist.broadcast(flat, group=pg, group_src=0)
    off = 0
    with torch.no_grad():
        for t in state_tensors(model, opt):
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
    return int(meta.item())


def rebuilt(torch, args, model, opt):
    """A fresh module and optimizer with ``model``'s and ``opt``'s state (the old module
    carries the old DDP's autograd hooks)."""
    new_model, new_opt = build(torch, args)
    with torch.no_grad():
        for dst, src in zip(state_tensors(new_model, new_opt), state_tensors(model, opt)):
            dst.copy_(src)
    return new_model, new_opt


# -- the worker ---------------------------------------------------------------------------------
def event(kind: str, **fields) -> None:
    print("EVENT " + json.dumps({"ev": kind, "t": time.time(), **fields}), flush=True)


def worker(args) -> None:
    t_start = float(os.environ.get("ELASTIC_T0", time.time()))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import oxccl
    import oxccl.torch

    t_imported = time.time()
    torch.set_num_threads(1)
    host, port = args.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout,
                          wait_for_workers=False)
    model, opt = build(torch, args)
    if args.join:
        # Everything local first (the first forward and backward pay one-time costs), then
        # announce this process and join.
        x, y = batch(torch, args, 0)
        ((model(x[:1]) - y[:1]) ** 2).sum().backward()
        opt.zero_grad(set_to_none=False)
        t_ready = time.time()
        store.add(WAITING, 1)
        pg = oxccl.torch.join(store, timeout=args.timeout)
        t_joined = time.time()
    else:
        dist.init_process_group("oxccl", store=store, rank=args.rank, world_size=args.world,
                                timeout=timeout)
        pg = dist.distributed_c10d._get_default_group()
    rank, world = pg.rank(), pg.size()
    # This process's identity across reconfigurations (its rank changes).
    me = f"pid{os.getpid()}"

    def wrap_ddp(model):
        ddp = DDP(model, process_group=pg, init_sync=False)
        if args.die_at_step is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def hook(state, bucket):
                if steps_done[0] == args.die_at_step:
                    event("kill", rank=rank, step=steps_done[0])
                    os.kill(os.getpid(), signal.SIGKILL)
                return default_hooks.allreduce_hook(pg, bucket)

            ddp.register_comm_hook(None, hook)
        return ddp

    steps_done = [0]
    step = 0
    if args.join:
        step = sync_state(torch, dist, pg, model, opt, 0)
        event("joined", me=me, rank=rank, world=world, step=step, t_start=t_start,
              t_imported=t_imported, t_ready=t_ready, t_joined=t_joined)
    ddp = wrap_ddp(model)
    recovering = None  # (when the failure was seen, the shrink's and the sync's seconds)
    first_step_pending = args.join
    while step < args.steps:
        steps_done[0] = step
        try:
            if recovering is not None and recovering[1] is None:
                # The survivors' group, new rank 0's state, DDP on the new group.
                t0 = time.time()
                ddp = None
                pg = oxccl.torch.shrink(pg)
                rank, world = pg.rank(), pg.size()
                t1 = time.time()
                model, opt = rebuilt(torch, args, model, opt)
                step = sync_state(torch, dist, pg, model, opt, step)
                steps_done[0] = step
                ddp = wrap_ddp(model)
                recovering = (recovering[0], t1 - t0, time.time() - t1)
            x, y = batch(torch, args, step)
            part = shard(args.batch, rank, world)
            opt.zero_grad(set_to_none=False)
            scaled, mine = local_loss(torch, ddp(x[part]), y[part], args.batch, world)
            scaled.backward()
            opt.step()
            step += 1
            # The step's quorum: the global loss, and replacements waiting (rank 0 asks).
            waiting = store.add(WAITING, 0) if rank == 0 else 0
            if rank == 0 and args.hold_after is not None and step > args.hold_after and (
                world < args.world and not waiting
            ):
                # --hold-after: a replacement is on its way (the launcher starts it after that
                # step); wait for it here (the others wait in the quorum) rather than finish
                # first. A real job trains on and grows whenever it comes.
                end = time.time() + args.timeout
                while not waiting and time.time() < end:
                    time.sleep(0.002)
                    waiting = store.add(WAITING, 0)
            q = torch.tensor([float(mine), float(waiting)], dtype=torch.float64)
            dist.all_reduce(q, group=pg)
            now = time.time()
            if rank == 0:
                event("step", step=step, world=world, loss=float(q[0]))
            if recovering is not None:
                event("recovered", me=me, rank=rank, world=world, step=step,
                      t_failure=recovering[0], shrink_s=recovering[1], sync_s=recovering[2],
                      t_first_step=now)
                recovering = None
            if first_step_pending:
                event("first_step", me=me, rank=rank, world=world, step=step,
                      t_start=t_start, t_first_step=now)
                first_step_pending = False
            count = int(q[1])
            if count:
                # Replacements wait: grow at this step boundary, hand them the state.
                t0 = time.time()
                ddp = None
                pg = oxccl.torch.grow(pg, count)
                if rank == 0:
                    store.add(WAITING, -count)
                rank, world = pg.rank(), pg.size()
                model, opt = rebuilt(torch, args, model, opt)
                step = sync_state(torch, dist, pg, model, opt, step)
                ddp = wrap_ddp(model)
                event("grew", me=me, rank=rank, world=world, step=step,
                      grow_s=time.time() - t0)
        except (oxccl.Error, RuntimeError) as e:
            # PeerFailed (a peer died), or Aborted (a faster survivor's shrink stopped the
            # group), raised by the quorum's all-reduce, a broadcast or a grow, or carried by
            # the RuntimeError of DDP's backward (is_failure reads it there).
            if not oxccl.torch.is_failure(e):
                raise
            if recovering is None or recovering[1] is not None:
                event("failure", me=me, rank=rank, step=step,
                      error=f"{type(e).__name__}: {str(e)[:200]}")
                recovering = (time.time(), None, None)
            else:
                recovering = (recovering[0], None, None)  # failed again while recovering
            e = None  # noqa: F841 - the traceback holds the old DDP
            continue
        if args.step_sleep:
            time.sleep(args.step_sleep)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    event("final", me=me, rank=rank, world=world, step=step, param_sum=digest)
    if args.save:
        torch.save([p.detach().clone() for p in model.parameters()],
                   Path(args.save) / f"final-{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)


def store_server(args) -> None:
    import torch.distributed as dist

    _ = dist.TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=args.timeout))
    print(f"STORE {args.port}", flush=True)
    sys.stdin.read()  # until the launcher closes our stdin or kills us


# -- the launcher -------------------------------------------------------------------------------
class Proc:
    def __init__(self, name: str, argv: list, host: int, args, env: dict):
        prefix = shlex.split(args.host_prefix.format(host=host)) if args.host_prefix else []
        self.name = name
        self.t0 = time.time()
        env = dict(env, ELASTIC_T0=repr(self.t0))
        self.p = subprocess.Popen(prefix + argv, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True,
                                  env=env, start_new_session=True)
        self.lines: list = []


def launch(args) -> int:
    import socket

    here = os.path.abspath(__file__)
    py = sys.executable
    common = ["--steps", str(args.steps), "--dims", args.dims, "--batch", str(args.batch),
              "--lr", str(args.lr), "--momentum", str(args.momentum), "--seed", str(args.seed),
              "--timeout", str(args.timeout), "--step-sleep", str(args.step_sleep)]
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        common += ["--save", args.save]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("OXCCL_SECRET", f"elastic-{os.getpid()}")
    events: list = []
    lock = threading.Lock()
    cond = threading.Condition(lock)
    procs: list = []
    keep = None
    if args.host_prefix:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The workers' store clients retry until it listens (up to --timeout).
        srv = Proc("store", [py, here, "store", "--port", str(port), "--timeout",
                             str(args.timeout)], 0, args, env)
        addr = f"{args.store_host}:{port}"
    else:
        import torch.distributed as dist

        keep = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=args.timeout))
        addr = f"127.0.0.1:{keep.port}"
        srv = None

    def reader(pr: Proc) -> None:
        for line in pr.p.stdout:
            pr.lines.append(line)
            if line.startswith("EVENT "):
                ev = json.loads(line[6:])
                ev["proc"] = pr.name
                with cond:
                    events.append(ev)
                    cond.notify_all()
            # (c10d's TCPStore clients log every slow poll of the store: not worth showing.)
            if not args.quiet and "socket.cpp" not in line:
                print(f"[{pr.name}] {line}", end="", flush=True)

    def start(name: str, extra: list, host: int) -> Proc:
        pr = Proc(name, [py, here, "worker", "--store", addr, *common, *extra], host, args, env)
        threading.Thread(target=reader, args=(pr,), daemon=True).start()
        procs.append(pr)
        return pr

    if srv is not None:
        threading.Thread(target=reader, args=(srv,), daemon=True).start()
    for r in range(args.world):
        extra = ["--rank", str(r), "--world", str(args.world)]
        if r == args.kill_rank:
            extra += ["--die-at-step", str(args.kill_step)]
        if args.kill_rank is not None and args.join_step is not None:
            extra += ["--hold-after", str(args.join_step)]
        start(f"rank{r}", extra, r)
    deadline = time.monotonic() + args.deadline

    def wait_for(pred) -> bool:
        with cond:
            while not any(pred(e) for e in events):
                left = deadline - time.monotonic()
                if left <= 0 or all(p.p.poll() is not None for p in procs):
                    return False
                cond.wait(min(left, 0.5))
            return True

    replacement = None
    if args.kill_rank is not None and args.join_step is not None:
        if wait_for(lambda e: e["ev"] == "recovered") and wait_for(
            lambda e: e["ev"] == "step" and e["step"] >= args.join_step
        ):
            replacement = start("replacement", ["--join"], args.kill_rank)
    rc = 0
    for pr in procs:
        try:
            pr.p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"launcher: {pr.name} still running after --deadline {args.deadline} s: "
                  "killing every process", file=sys.stderr)
            for q in procs:
                if q.p.poll() is None:
                    os.killpg(q.p.pid, signal.SIGKILL)
            rc = 1
    time.sleep(0.2)
    if srv is not None:
        srv.p.kill()
    for pr in procs:
        want = -signal.SIGKILL if pr.name == f"rank{args.kill_rank}" else 0
        if pr.p.returncode != want:
            print(f"launcher: {pr.name} exited {pr.p.returncode} (expected {want}); its last "
                  f"lines:\n{''.join(pr.lines[-30:])}", file=sys.stderr)
            rc = 1
    summary = summarize(events, args, replacement)
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "events": events}, indent=1))
    return rc


def summarize(events: list, args, replacement) -> dict:
    out: dict = {"world": args.world, "steps": args.steps}
    losses = {}
    for e in events:
        if e["ev"] == "step":
            losses[e["step"]] = [e["loss"], e["world"]]
    out["losses"] = [losses.get(s, [None, None])[0] for s in range(1, args.steps + 1)]
    out["worlds"] = [losses.get(s, [None, None])[1] for s in range(1, args.steps + 1)]
    kill = [e for e in events if e["ev"] == "kill"]
    rec = [e for e in events if e["ev"] == "recovered"]
    if kill and rec:
        tk = kill[0]["t"]
        out["kill_step"] = kill[0]["step"]
        out["resumed_from_step"] = min(e["step"] for e in rec) - 1
        out["detect_s"] = max(e["t_failure"] for e in rec) - tk
        out["shrink_s"] = max(e["shrink_s"] for e in rec)
        out["sync_s"] = max(e["sync_s"] for e in rec)
        out["kill_to_first_step_s"] = max(e["t_first_step"] for e in rec) - tk
        print(f"kill -> survivors' first completed step: {out['kill_to_first_step_s']:.3f} s "
              f"(detection {out['detect_s']:.3f} s, shrink {out['shrink_s']:.3f} s, state "
              f"broadcast {out['sync_s']:.3f} s; target <= 2 s)", flush=True)
    first = [e for e in events if e["ev"] == "first_step"]
    joined = [e for e in events if e["ev"] == "joined"]
    if first and joined:
        f, j = first[0], joined[0]
        out["replacement_start_to_first_step_s"] = f["t_first_step"] - f["t_start"]
        out["replacement_import_s"] = j["t_imported"] - j["t_start"]
        out["replacement_setup_s"] = j["t_ready"] - j["t_imported"]
        out["replacement_join_s"] = j["t_joined"] - j["t_ready"]
        out["replacement_sync_s"] = j["t"] - j["t_joined"]
        out["replacement_joined_at_step"] = j["step"]
        print(f"replacement start -> its first completed step: "
              f"{out['replacement_start_to_first_step_s']:.3f} s (python + torch + oxccl "
              f"import {out['replacement_import_s']:.3f} s, model set-up "
              f"{out['replacement_setup_s']:.3f} s, join {out['replacement_join_s']:.3f} s, "
              f"state broadcast {out['replacement_sync_s']:.3f} s; target <= 5 s)", flush=True)
    out["final"] = sorted(
        ([e["rank"], e["world"], e["step"], e["param_sum"]] for e in events if e["ev"] == "final"),
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="launch", choices=["launch", "worker", "store"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dims", default="256,1024,1024,256", help="the MLP's widths")
    ap.add_argument("--batch", type=int, default=96, help="the global batch (rows per step)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds: the group's timeout, every wait's bound")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds between steps")
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=15)
    ap.add_argument("--join-step", type=int, default=30,
                    help="start a replacement once rank 0 completed this step (after the kill)")
    ap.add_argument("--no-kill", action="store_true", help="no failure, no replacement")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--host-prefix", default=None,
                    help="run each process under this command, {host} its host index")
    ap.add_argument("--store-host", default="10.77.0.1",
                    help="with --host-prefix: the address of host 0, where the store runs")
    ap.add_argument("--json", default=None, help="write the summary and every event here")
    ap.add_argument("--save", default=None, help="directory for each worker's final parameters")
    ap.add_argument("--quiet", action="store_true", help="only the summary")
    # worker / store
    ap.add_argument("--store", default=None, help="worker: HOST:PORT of the store")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--join", action="store_true", help="worker: a replacement")
    ap.add_argument("--die-at-step", type=int, default=None,
                    help="worker: SIGKILL this process in the middle of that step")
    ap.add_argument("--hold-after", type=int, default=None,
                    help="worker: past this step, below --world ranks, rank 0 waits for a "
                    "replacement at the step boundary")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.no_kill:
        args.kill_rank = args.join_step = None
    if args.role == "worker":
        worker(args)
        return 0
    if args.role == "store":
        store_server(args)
        return 0
    if args.kill_rank is not None and not 0 <= args.kill_rank < args.world:
        raise SystemExit(f"--kill-rank {args.kill_rank}: outside {args.world} ranks")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
