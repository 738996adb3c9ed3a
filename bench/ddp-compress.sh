#!/usr/bin/env bash
# Accuracy of compressed gradients (issue 17): examples/train_ddp.py on N local ranks (default
# 4) from the same seeds and batches, six times: uncompressed oxccl, Gloo, bfp8 and bfp4 with
# error feedback (oxccl.torch.bfp_hook), bfp8 and bfp4 without. Prints each run's summary, then
# the final losses, their relative gaps to uncompressed oxccl (targets: bfp8 + EF within 1%,
# bfp4 + EF within 3%; also the gap of the mean loss of the last 10 steps, which one batch
# moves less) and the step times; writes the raw JSON, this text and the plot to
# bench/results/ddp-compress-<date>/. Extra arguments go to the example (e.g. --batch 8).
#
# Losses are deterministic (same seeds, torch.use_deterministic_algorithms); step times only
# mean something on an otherwise idle machine: the header says how many compilers ran.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/python-env.sh")
n=${NPROC:-4}
steps=${STEPS:-60}
res="$root/bench/results/ddp-compress-$(date -u +%Y-%m-%d)"
mkdir -p "$res"
out="$res/ddp-compress-${n}ranks.txt"
start=$(date +%s)
run() {  # name, then the example's arguments
    local name=$1
    shift
    echo "== $name: rustc processes running now: $(pgrep -x rustc | wc -l)"
    OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nproc-per-node "$n" \
        --master-port $((29500 + RANDOM % 1000)) "$root/examples/train_ddp.py" \
        --steps "$steps" --json "$res/$name.json" "$@" 2>&1 \
        | grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp'
}
{
    echo "# bench/ddp-compress.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $n ranks, $steps steps"
    run oxccl --backend oxccl "$@"
    run gloo --backend gloo "$@"
    run bfp8-ef --backend oxccl --compress bfp8 "$@"
    run bfp4-ef --backend oxccl --compress bfp4 "$@"
    run bfp8-noef --backend oxccl --compress bfp8 --no-error-feedback "$@"
    run bfp4-noef --backend oxccl --compress bfp4 --no-error-feedback "$@"
    "$venv/bin/python" - "$res" <<'PY'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
names = ["oxccl", "gloo", "bfp8-ef", "bfp4-ef", "bfp8-noef", "bfp4-noef"]
runs = {k: json.loads((res / f"{k}.json").read_text()) for k in names}
base = runs["oxccl"]
last = lambda d: sum(d["losses"][-10:]) / len(d["losses"][-10:])
targets = {"bfp8-ef": 1.0, "bfp4-ef": 3.0}
print(f"{'run':<10} {'final loss':>10} {'gap':>8} {'last-10 mean':>12} {'gap':>8} "
      f"{'median step':>11} {'compute only':>12}  target")
for k, d in runs.items():
    f, m = d["losses"][-1], last(d)
    gf = 100 * (f - base["losses"][-1]) / base["losses"][-1]
    gm = 100 * (m - last(base)) / last(base)
    t = targets.get(k)
    verdict = "" if t is None else f"|gap| <= {t:.0f}%: {'met' if abs(gf) <= t else 'NOT met'}"
    print(f"{k:<10} {f:10.6f} {gf:+7.3f}% {m:12.6f} {gm:+7.3f}% "
          f"{d['median_step_s'] * 1e3:9.1f} ms {d['median_compute_s'] * 1e3:9.1f} ms  {verdict}")
PY
    "$venv/bin/python" "$root/examples/train_ddp.py" --plot \
        "$res/oxccl.json" "$res/gloo.json" "$res/bfp8-ef.json" "$res/bfp4-ef.json" \
        "$res/bfp8-noef.json" "$res/bfp4-noef.json" -o "$res/ddp-compress-${n}ranks.png"
    echo "# took $(($(date +%s) - start)) s"
} | tee "$out"
