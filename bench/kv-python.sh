#!/usr/bin/env bash
# The Python API's overhead on one synchronous transfer: a 4 KiB WRITE over shm between two
# engines of one process, timed in Rust (TransferEngine::transfer_sync, the example
# crates/oxccl-kv/examples/kv_sync_lat.rs) and in Python, rounds interleaved so that the noise
# of a shared machine hits both alike. Python is timed two ways:
#
#   mooncake-api  oxccl.kv.TransferEngine.transfer_sync_write(...)   (what ported code calls)
#   pyo3-layer    oxccl._oxccl.KvEngine.transfer(...)                  (the extension alone)
#
# overhead = Python's time per call - Rust's: the median of the per-round differences, and the
# best Python round less the best Rust round (target: <= 5 us for the Mooncake API).
# The Python side opens the segment by name on every call, as Mooncake's API does (the Rust
# loop opens it once): that lookup counts as overhead.
#
# Usage: bench/kv-python.sh            (env: ROUNDS=9 ITERS=20000 SIZE=4096 PROTOCOL=shm)
# The package must be built into the venv first (scripts/python-test.sh does it), or set
# BUILD=1 to run maturin here.
set -euo pipefail

cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-9}
ITERS=${ITERS:-20000}
SIZE=${SIZE:-4096}
PROTOCOL=${PROTOCOL:-shm}

venv=$(scripts/python-env.sh)
PY="$venv/bin/python"
echo "== building (release) =="
cargo build --release -q -p oxccl-kv --example kv_sync_lat
if [ "${BUILD:-0}" = 1 ]; then
    (cd python && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop --release --quiet) >/dev/null
fi
"$PY" -c 'import oxccl.kv' || { echo "oxccl.kv does not import: BUILD=1 $0" >&2; exit 1; }

export OXCCL_SECRET=${OXCCL_SECRET:-kv-python-bench-secret}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

cat >"$OUT/py_lat.py" <<'EOF'
import sys, time
from oxccl.kv import TransferEngine

protocol, size, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0, a.last_error()
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0, b.last_error()
abuf, bbuf = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
a.write_bytes_to_buffer(abuf, b"\x5a" * size, size)
seg = f"127.0.0.1:{b.get_rpc_port()}"
raw = a.get_engine()
for _ in range(min(iters, 5000)):
    assert a.transfer_sync_write(seg, abuf, bbuf, size) == 0, a.last_error()

def timed(call):
    t = time.perf_counter()
    for _ in range(iters):
        call(seg, abuf, bbuf, size)
    return (time.perf_counter() - t) * 1e6 / iters

w = a.transfer_sync_write
api = timed(w)
layer = timed(lambda s, x, y, n: raw.transfer(s, True, x, y, n))
# The lambda costs a Python call too: time it bare and take it out of the pyo3 layer's figure.
empty = timed(lambda s, x, y, n: None)
assert b.read_bytes_from_buffer(bbuf, size) == b"\x5a" * size
print(f"python mooncake-api {api:.3f} us pyo3-layer {layer - empty:.3f} us "
      f"(empty-lambda {empty:.3f} us; {size} B WRITE, {iters} calls)")
EOF

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
echo "== $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $cpu, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $("$PY" -V) =="
echo "== $ROUNDS rounds of $ITERS calls, $SIZE B WRITE over $PROTOCOL, two engines in one process =="
for r in $(seq 1 "$ROUNDS"); do
    rust=$(target/release/examples/kv_sync_lat --protocol "$PROTOCOL" --size "$SIZE" \
        --iters "$ITERS" --rounds 1 | sed -n 's/^rust round 0: \([0-9.]*\) us.*/\1/p')
    py=$("$PY" "$OUT/py_lat.py" "$PROTOCOL" "$SIZE" "$ITERS")
    api=$(echo "$py" | sed -n 's/.*mooncake-api \([0-9.]*\) us.*/\1/p')
    layer=$(echo "$py" | sed -n 's/.*pyo3-layer \([-0-9.]*\) us.*/\1/p')
    echo "round $r: rust $rust us | $py"
    echo "$rust $api $layer" >>"$OUT/rows"
done

"$PY" - "$OUT/rows" <<'EOF'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
rust, api, layer = zip(*rows)
med = statistics.median
print("== summary, us per call: median of the rounds [best round] ==")
print(f"rust transfer_sync            {med(rust):7.3f}  [{min(rust):.3f}]")
print(f"python transfer_sync_write    {med(api):7.3f}  [{min(api):.3f}]")
print(f"python KvEngine.transfer      {med(layer):7.3f}  [{min(layer):.3f}]")
print("== Python's overhead, us per call: median of the per-round differences [best - best] ==")
print(f"Mooncake API (oxccl.kv)       {med(a - r for r, a, _ in rows):7.3f}  "
      f"[{min(api) - min(rust):.3f}]   (target <= 5 us)")
print(f"pyo3 layer alone              {med(l - r for r, _, l in rows):7.3f}  "
      f"[{min(layer) - min(rust):.3f}]")
EOF
