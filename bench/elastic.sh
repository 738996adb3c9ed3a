#!/usr/bin/env bash
# examples/elastic_ddp.py across 4 hosts (network namespaces, links shaped to RATE, default
# 1 Gbit/s): DDP on 4 ranks, one per host; rank KILL_RANK (default 2) SIGKILLs itself in the
# middle of step KILL_STEP; the survivors shrink and train on; once rank 0 has done JOIN_STEP a
# replacement starts on the dead rank's host, joins, and the 4 go on. The rendezvous store runs
# as its own process on host 0 (it must outlive any rank). RUNS runs (default 3); each prints
# kill -> survivors' first completed step (target <= 2 s) and replacement start -> its first
# completed step (target <= 5 s). Raw output and each run's JSON (every event, the loss per
# step) in bench/results/elastic-<date>/. Needs root. Extra arguments go to the example.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
RATE=${RATE:-1g}
RUNS=${RUNS:-3}
STEPS=${STEPS:-60}
KILL_RANK=${KILL_RANK:-2}
KILL_STEP=${KILL_STEP:-15}
JOIN_STEP=${JOIN_STEP:-30}
venv=$(scripts/python-env.sh)
cargo build --release -q -p oxccl-testbed
(cd python && VIRTUAL_ENV="$venv" "$venv/bin/maturin" develop --release --quiet) >/dev/null
TB=$root/target/release/oxccl-testbed
trap '"$TB" down --owner $$ >/dev/null 2>&1 || true' EXIT
BED=$("$TB" up --rates "$RATE,$RATE,$RATE,$RATE" --owner-pid $$)
out=$root/bench/results/elastic-$(date -u +%Y-%m-%d)
mkdir -p "$out"
rm -f "$out"/run*.json
{
    echo "# bench/elastic.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs (shared, load $(cut -d' ' -f1-3 /proc/loadavg)); 4 hosts x 1 rank, links $RATE; kill rank $KILL_RANK in step $((KILL_STEP + 1)), replacement after step $JOIN_STEP"
    echo "OXCCL_TOPO_LEARN=${OXCCL_TOPO_LEARN:-default (on)}"
    for i in $(seq 1 "$RUNS"); do
        echo "## run $i"
        OXCCL_SECRET=elastic-bed OMP_NUM_THREADS=1 "$venv/bin/python" examples/elastic_ddp.py \
            --world 4 --steps "$STEPS" --kill-rank "$KILL_RANK" --kill-step "$KILL_STEP" \
            --join-step "$JOIN_STEP" --host-prefix "$TB exec $BED {host} --" \
            --store-host 10.77.0.1 --json "$out/run$i.json" --quiet "$@"
    done
    runs=()
    for i in $(seq 1 "$RUNS"); do runs+=("$out/run$i.json"); done
    "$venv/bin/python" - "${runs[@]}" <<'PY'
import json, statistics, sys
runs = [json.load(open(p))["summary"] for p in sys.argv[1:]]
k = [r["kill_to_first_step_s"] for r in runs if "kill_to_first_step_s" in r]
j = [r["replacement_start_to_first_step_s"] for r in runs
     if "replacement_start_to_first_step_s" in r]
print(f"{len(runs)} runs")
if k:
    print(f"kill -> survivors' first step: median {statistics.median(k):.3f} s, max {max(k):.3f} s "
          f"(target <= 2 s): {'met' if max(k) <= 2 else 'NOT met'}")
if j:
    print(f"replacement start -> its first step: median {statistics.median(j):.3f} s, "
          f"max {max(j):.3f} s (target <= 5 s): {'met' if max(j) <= 5 else 'NOT met'}")
for r in runs:
    ws = r["worlds"]
    print("worlds per step:", "".join(str(w) if w else "?" for w in ws))
PY
} 2>&1 | tee "$out/elastic.txt"
