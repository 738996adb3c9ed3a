"""The ``oxccl`` command line (``oxccl run``, ``oxccl perf``, ``oxccl doctor``, ...) as the
package's console script: the same Rust code as the ``oxccl`` binary (the crate oxccl-cli),
linked into the extension module. ``python -m oxccl._cli ARGS`` runs it too.
"""

from __future__ import annotations

import signal
import sys


def _reexec() -> list[str]:
    """The command line that starts the CLI again: ``oxccl perf`` and ``oxccl topo`` start
    their ranks, ``verbs-perf`` its server and ``kv-bench`` its target this way, as the binary
    re-executes itself. ``-P`` (Python 3.11 and later): the working directory does not go on
    ``sys.path``, so a source checkout's ``oxccl/`` there cannot shadow the installed one."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "oxccl._cli"]


def main() -> None:
    """Runs ``oxccl`` with ``sys.argv[1:]`` and exits with its exit code."""
    # Ctrl-C stops the command as it stops the binary: Python's own handler would only raise
    # KeyboardInterrupt once the Rust code returned (`oxccl run` installs its own handlers
    # for its duration and forwards the signal to the ranks).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from ._oxccl import _cli_main

    sys.stdout.flush()
    sys.exit(_cli_main(_reexec(), ["oxccl", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
