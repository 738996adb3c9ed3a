#!/usr/bin/env bash
# examples/train_ddp.py on N local ranks (default 4), oxccl then Gloo from the same seeds,
# interleaved over ROUNDS rounds; prints each run's summary, the step-time ratio and the loss
# agreement, and writes bench/results/ddp-<N>ranks-{oxccl,gloo}.json and the plot
# bench/results/ddp-<N>ranks.png. Extra arguments go to the example (e.g. --batch 8).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/python-env.sh")
n=${NPROC:-4}
steps=${STEPS:-40}
res="$root/bench/results"
mkdir -p "$res"
out="$res/ddp-${n}ranks.txt"
{
    echo "# bench/ddp.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $n ranks, $steps steps"
    for b in oxccl gloo; do
        OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000)) \
            "$root/examples/train_ddp.py" --backend "$b" --steps "$steps" --json "$res/ddp-${n}ranks-$b.json" "$@" 2>&1 \
            | grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp'
    done
    "$venv/bin/python" - "$res/ddp-${n}ranks-oxccl.json" "$res/ddp-${n}ranks-gloo.json" <<'PY'
import json, sys
o, g = (json.load(open(p)) for p in sys.argv[1:3])
rel = [abs(a - b) / abs(b) for a, b in zip(o["losses"][:20], g["losses"][:20])]
print(f"step time: oxccl {o['median_step_s']*1e3:.1f} ms, gloo {g['median_step_s']*1e3:.1f} ms, "
      f"ratio {o['median_step_s']/g['median_step_s']:.3f}")
print(f"compute only: oxccl {o['median_compute_s']*1e3:.1f} ms, gloo {g['median_compute_s']*1e3:.1f} ms")
print(f"communication share: oxccl {100*o['comm_share']:.1f}%, gloo {100*g['comm_share']:.1f}%")
print(f"loss, first 20 steps: max relative difference {max(rel):.2e}")
print(f"final loss: oxccl {o['losses'][-1]:.6f}, gloo {g['losses'][-1]:.6f}, "
      f"relative difference {abs(o['losses'][-1]-g['losses'][-1])/g['losses'][-1]:.2e}")
for d in (o, g):
    if "link_share" in d:
        print(f"{d['backend']}: gradients used {100*d['link_share']:.1f}% of the link while communicating")
PY
    "$venv/bin/python" "$root/examples/train_ddp.py" --plot "$res/ddp-${n}ranks-oxccl.json" \
        "$res/ddp-${n}ranks-gloo.json" -o "$res/ddp-${n}ranks.png"
} | tee "$out"
