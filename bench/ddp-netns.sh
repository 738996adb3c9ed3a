#!/usr/bin/env bash
# examples/train_ddp.py across 4 hosts (network namespaces, links shaped to RATE, default
# 1 Gbit/s), one rank per host under torchrun (--nnodes 4, one torchrun per host, only its
# own rendezvous variables; no OXCCL_* variable but the secret; Gloo gets GLOO_SOCKET_IFNAME,
# without which it advertises 127.0.0.1 here), on oxccl then Gloo from the
# same seeds: each run's summary (median step, compute alone, communication share, the share
# of the link the gradients used while communicating) and the step-time ratio. Raw output in
# bench/results/ddp-netns.txt. Needs root. Extra arguments go to the example.
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
out=$root/bench/results/ddp-netns.txt
tmp=$(mktemp -d)
{
    echo "# bench/ddp-netns.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; 4 hosts x 1 rank, links $RATE"
    port=29950
    for b in oxccl gloo; do
        pids=()
        for h in 0 1 2 3; do
            # Gloo advertises the address its host name resolves to (127.0.0.1 here), so it
            # needs GLOO_SOCKET_IFNAME across hosts; oxccl finds its address by itself.
            "$TB" exec "$BED" "$h" -- env OXCCL_SECRET=ddp-netns OMP_NUM_THREADS=1 \
                GLOO_SOCKET_IFNAME=eth0 \
                "$venv/bin/torchrun" --nnodes 4 --nproc-per-node 1 --node-rank "$h" \
                --master-addr 10.77.0.1 --master-port "$port" \
                examples/train_ddp.py --backend "$b" --steps "$STEPS" --link-gbps "$gbps" \
                --json "$tmp/$b.json" "$@" >"$tmp/$b.$h" 2>&1 &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || { echo "a rank failed:"; cat "$tmp/$b".*; exit 1; }; done
        grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp' "$tmp/$b.0"
        port=$((port + 1))
    done
    "$venv/bin/python" - "$tmp/oxccl.json" "$tmp/gloo.json" <<'PY'
import json, sys
o, g = (json.load(open(p)) for p in sys.argv[1:3])
print(f"step time: oxccl {o['median_step_s']*1e3:.1f} ms, gloo {g['median_step_s']*1e3:.1f} ms, "
      f"ratio {o['median_step_s']/g['median_step_s']:.3f}")
rel = [abs(a - b) / abs(b) for a, b in zip(o["losses"][:20], g["losses"][:20])]
print(f"loss, first 20 steps: max relative difference {max(rel):.2e}")
for d in (o, g):
    print(f"{d['backend']}: compute only {d['median_compute_s']*1e3:.1f} ms, communication "
          f"{100*d['comm_share']:.1f}% of the step, link used {100*d.get('link_share', 0):.1f}% while communicating")
PY
} | tee "$out"
rm -rf "$tmp"
