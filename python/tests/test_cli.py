"""The `oxccl` command line as the package carries it (`oxccl._cli`, the console script of
the wheel): the Rust CLI linked into the extension module, run by the interpreter. `perf`
starts its ranks by re-executing the interpreter (`python -P -m oxccl._cli`), and `run`
starts any program with torchrun's environment."""

from __future__ import annotations

import subprocess
import sys

import oxccl

CLI = [sys.executable, "-m", "oxccl._cli"]


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_version_and_usage():
    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"oxccl {oxccl.__version__}"
    r = cli("no-such-subcommand")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "oxccl" in r.stderr


def test_perf_relaunches_itself_through_python():
    r = cli("perf", "all_reduce", "-n", "2", "-b", "8", "-e", "64K", "-f", "16", "-w", "1",
            "-i", "2", "-c", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# Out of bounds values : 0 OK" in r.stdout, r.stdout
    assert "65536" in r.stdout, r.stdout


def test_run_starts_ranks_and_passes_their_exit_code(tmp_path):
    # Rank 1 fails (status 3) only once rank 0 has printed and exited: a rank that fails first
    # makes `oxccl run` stop the others, which would race rank 0's line.
    done = tmp_path / "rank0-done"
    prog = (
        "import os, sys, time, pathlib; r = int(os.environ['RANK']); d = pathlib.Path(sys.argv[1])\n"
        "print('rank', r, flush=True)\n"
        "if r == 0: d.touch(); sys.exit(0)\n"
        "t = time.monotonic()\n"
        "while not d.exists() and time.monotonic() - t < 60: time.sleep(0.01)\n"
        "time.sleep(0.2); sys.exit(3)"
    )
    r = cli("run", "-n", "2", sys.executable, "-c", prog, str(done))
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "[0] rank 0" in r.stdout and "[1] rank 1" in r.stdout, r.stdout
