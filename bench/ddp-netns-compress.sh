#!/usr/bin/env bash
# The step time of compressed gradients where the wire is the bottleneck (issue 17):
# examples/train_ddp.py across 4 hosts (network namespaces, links shaped to RATE, default
# 1 Gbit/s), one rank per host under torchrun, as bench/ddp-netns.sh runs it, on oxccl
# uncompressed, then with --compress bfp8 and bfp4 (oxccl.torch.bfp_hook, error feedback), from
# the same seeds. Prints each run's summary and the step times against uncompressed; raw JSON
# and text in bench/results/ddp-netns-compress-<date>/. Needs root. Extra arguments go to the
# example.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
RATE=${RATE:-1g}
STEPS=${STEPS:-20}
venv=$(scripts/python-env.sh)
cargo build --release -q -p oxccl-testbed
(cd python && VIRTUAL_ENV="$venv" "$venv/bin/maturin" develop --release --quiet) >/dev/null
TB=$root/target/release/oxccl-testbed
trap '"$TB" down --owner $$ >/dev/null 2>&1 || true' EXIT
BED=$("$TB" up --rates "$RATE,$RATE,$RATE,$RATE" --owner-pid $$)
gbps=$(awk -v r="$RATE" 'BEGIN { s = tolower(r); v = s + 0; if (s ~ /m$/) v /= 1000; print v }')
res="$root/bench/results/ddp-netns-compress-$(date -u +%Y-%m-%d)"
mkdir -p "$res"
tmp=$(mktemp -d)
{
    echo "# bench/ddp-netns-compress.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; 4 hosts x 1 rank, links $RATE, $STEPS steps"
    port=29960
    for name in oxccl bfp8-ef bfp4-ef; do
        case $name in
            oxccl) extra=() ;;
            bfp8-ef) extra=(--compress bfp8) ;;
            bfp4-ef) extra=(--compress bfp4) ;;
        esac
        echo "== $name: rustc processes running now: $(pgrep -x rustc | wc -l)"
        pids=()
        for h in 0 1 2 3; do
            "$TB" exec "$BED" "$h" -- env OXCCL_SECRET=ddp-netns OMP_NUM_THREADS=1 \
                "$venv/bin/torchrun" --nnodes 4 --nproc-per-node 1 --node-rank "$h" \
                --master-addr 10.77.0.1 --master-port "$port" \
                examples/train_ddp.py --backend oxccl --steps "$STEPS" --link-gbps "$gbps" \
                --json "$res/$name.json" "${extra[@]}" "$@" >"$tmp/$name.$h" 2>&1 &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || { echo "a rank failed:"; cat "$tmp/$name".*; exit 1; }; done
        grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp' "$tmp/$name.0"
        port=$((port + 1))
    done
    "$venv/bin/python" - "$res" <<'PY'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
runs = {k: json.loads((res / f"{k}.json").read_text()) for k in ("oxccl", "bfp8-ef", "bfp4-ef")}
b = runs["oxccl"]
for k, d in runs.items():
    comm = d["median_step_s"] - d["median_compute_s"]
    print(f"{k:<8} median step {d['median_step_s']*1e3:7.1f} ms ({d['median_step_s']/b['median_step_s']:.3f}x), "
          f"compute only {d['median_compute_s']*1e3:7.1f} ms, exposed communication {comm*1e3:7.1f} ms, "
          f"final loss {d['losses'][-1]:.6f}")
PY
} | tee "$res/ddp-netns-compress.txt"
rm -rf "$tmp"
