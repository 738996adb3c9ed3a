#!/usr/bin/env python3
"""torchft's fault-tolerant DDP (its Manager, its DDP wrapper, its OptimizerWrapper) with
oxccl as the process group between replica groups.

    pip install torchft          # 0.2.0; not part of python/requirements-dev.txt
    python examples/torchft_oxccl.py                  # 3 replica groups of 1 rank; replica 1
                                                      # dies at step 8, a new one comes at 12

``ProcessGroupOxcclFT`` is torchft's reconfigurable process group shape
(``torchft.process_group.ProcessGroupWrapper``): at each new quorum the Manager calls
``configure(store_addr, replica_id, rank, world_size, ...)`` with a fresh store prefix, and
``_create_pg`` makes a new c10d ProcessGroup whose CPU backend is an
``oxccl.torch.ProcessGroupOxccl`` joined through that store (a new oxccl communicator per
quorum; the old one is aborted by the wrapper). Nothing else is changed: torchft heals a
newcomer (or a replica that fell behind) through its own checkpoint transport (HTTP), and
decides membership with its lighthouse; oxccl carries the gradient all-reduces (and, with
``--transport pg``, the newcomer's checkpoint: torchft's PGTransport over the same group).

The launcher starts a lighthouse, then ``--replicas`` worker processes (each its own replica
group of one rank, with its own TCPStore, as under torchrun), SIGKILLs one with
``--kill-replica R --kill-step K`` (in its DDP communication hook, mid-step), and starts a
fresh replica once the others have committed ``--join-step``. Each worker prints its
committed steps and loss; at the end the launcher checks that the replicas that finished hold
the same parameters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time


def make_process_group_class():
    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupWrapper

    import oxccl.torch

    class ProcessGroupOxcclFT(ProcessGroupWrapper):
        """torchft's reconfigurable process group over oxccl: a new oxccl communicator for
        each quorum, joined through the store prefix torchft hands ``configure``."""

        def _create_pg(self, store, rank: int, world_size: int):
            be = oxccl.torch.ProcessGroupOxccl(store, rank, world_size, self._timeout)
            pg = dist.ProcessGroup(store, rank, world_size)
            custom = dist.ProcessGroup.BackendType.CUSTOM
            pg._set_default_backend(custom)
            pg._register_backend(torch.device("cpu"), custom, be)
            return pg

        def getBackendName(self) -> str:  # noqa: N802 - torchft's name
            return "torchft-oxccl"

    return ProcessGroupOxcclFT


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    # This replica group's own store (torchrun would host it).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    if args.pg == "gloo":  # torchft's own, for comparison
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=args.timeout))
    else:
        pg = make_process_group_class()(timeout=datetime.timedelta(seconds=args.timeout))
    transport = None
    if args.transport == "pg":
        # The checkpoint a newcomer heals from travels over the same process group (torchft's
        # PGTransport: sends and receives) instead of HTTP.
        from torchft.checkpointing.pg_transport import PGTransport

        transport = PGTransport(pg, timeout=datetime.timedelta(seconds=args.timeout),
                                device=torch.device("cpu"))
    manager = Manager(
        checkpoint_transport=transport,
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"oxccl_{args.replica}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=args.timeout),
        quorum_timeout=datetime.timedelta(seconds=args.timeout),
        use_async_quorum=False,
    )
    die_at = args.die_at_step

    class DDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            # --die-at-step: SIGKILL in the middle of that step (gradients computed, nothing
            # of them sent yet).
            if die_at is not None and state.current_step() == die_at:
                print("EVENT " + json.dumps({"ev": "kill", "t": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            # torchft 0.2.0's own hook (torchft.ddp.DistributedDataParallel._comm_hook) asserts
            # on a failed all-reduce (its _ManagedWork.wait() returns False and leaves the
            # future chain unset; with torchft's ProcessGroupGloo too): the same, but a failed
            # step hands DDP the bucket as it is (the manager recorded the error, and
            # should_commit() then discards the step).
            work = state.allreduce(bucket.buffer())
            if not work.wait():
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            fut = work.get_future()
            return getattr(fut, "_fut", None) or fut

    ddp = DDP(manager, model)
    optimizer = OptimizerWrapper(manager, opt)
    g = torch.Generator().manual_seed(7)
    a = torch.randn(16, 8, generator=g)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(48, 16, generator=g)
        y = torch.tanh(x @ a)
        optimizer.zero_grad()  # starts the quorum
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()  # commits when the step's all-reduces succeeded everywhere
        print("EVENT " + json.dumps({
            "ev": "step", "t": time.time(), "replica": args.replica, "step": step,
            "committed": manager.current_step(), "participants": manager.num_participants(),
            "loss": float(loss.detach())}), flush=True)
        time.sleep(args.step_sleep)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    print("EVENT " + json.dumps({"ev": "final", "replica": args.replica,
                                 "step": manager.current_step(), "param_sum": digest}),
          flush=True)
    manager.shutdown(wait=False)
    os._exit(0)


def launch(args) -> int:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=2000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("OXCCL_SECRET", f"torchft-{os.getpid()}")
    procs, events = [], []
    cond = threading.Condition()

    def start(replica: int, extra: list):
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "worker", "--replica", str(replica),
             "--lighthouse", lighthouse.address(), "--steps", str(args.steps),
             "--timeout", str(args.timeout), "--step-sleep", str(args.step_sleep), "--pg", args.pg,
             "--transport", args.transport, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append((replica, p))

        def read():
            for line in p.stdout:
                if line.startswith("EVENT "):
                    with cond:
                        events.append(json.loads(line[6:]))
                        cond.notify_all()
                if not args.quiet or line.startswith("EVENT") or "rror" in line:
                    print(f"[replica{replica}] {line}", end="", flush=True)

        threading.Thread(target=read, daemon=True).start()

    for r in range(args.replicas):
        start(r, ["--die-at-step", str(args.kill_step)] if r == args.kill_replica else [])
    deadline = time.monotonic() + args.deadline
    with cond:
        while not any(e["ev"] == "step" and e["committed"] >= args.join_step for e in events):
            if time.monotonic() > deadline:
                break
            cond.wait(0.5)
    start(args.replicas, [])
    rc = 0
    for r, p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 1
        want = -signal.SIGKILL if r == args.kill_replica else 0
        if p.returncode != want:
            print(f"launcher: replica {r} exited {p.returncode} (expected {want})")
            rc = 1
    finals = [e for e in events if e["ev"] == "final"]
    sums = {round(e["param_sum"], 6) for e in finals}
    print(f"finished replicas: {len(finals)}, distinct final parameter sums: {sorted(sums)}")
    if len(sums) != 1:
        rc = 1
    lighthouse.shutdown()
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="launch", choices=["launch", "worker"])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-replica", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=8)
    ap.add_argument("--join-step", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--deadline", type=float, default=240.0)
    ap.add_argument("--step-sleep", type=float, default=0.2, help="seconds between steps")
    ap.add_argument("--quiet", action="store_true", help="only events and warnings")
    ap.add_argument("--pg", default="oxccl", choices=["oxccl", "gloo"],
                    help="the process group between replicas (gloo: torchft's own)")
    ap.add_argument("--transport", default="http", choices=["http", "pg"],
                    help="how a newcomer gets the state: torchft's HTTP transport, or its "
                    "PGTransport over the process group")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--lighthouse", default=None)
    ap.add_argument("--die-at-step", type=int, default=None)
    args = ap.parse_args()
    if args.role == "worker":
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
