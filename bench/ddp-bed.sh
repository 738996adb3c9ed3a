#!/usr/bin/env bash
# DDP (and FSDP2) of a 12.59 M-parameter MLP (examples/train_ddp.py --model mlp, 50 MB of fp32
# gradients, batch 32 per rank) across 4 hosts (network namespaces, links shaped to RATE,
# default 1 Gbit/s), one rank per host under torchrun, launched as bench/ddp-netns.sh launches
# them (one torchrun per host, --nnodes 4, OXCCL_SECRET, GLOO_SOCKET_IFNAME=eth0,
# OMP_NUM_THREADS=1). Issue 27, items 3 and 4. Configurations:
#
#   gloo             DDP on Gloo, torch's default all-reduce
#   gloo-fp16        DDP on Gloo with torch's fp16_compress_hook
#   oxccl            DDP on oxccl, uncompressed
#   oxccl-bfp8       DDP on oxccl with oxccl.torch.bfp_hook, bfp8, error feedback
#   oxccl-bfp4       the same in bfp4
#   gloo-fsdp        FSDP2 (fully_shard per layer and root) on Gloo         } when FSDP=1
#   oxccl-fsdp       FSDP2 on oxccl                                         } (the default)
#   oxccl-fsdp-bfp8  FSDP2 on oxccl with OXCCL_REDUCE_SCATTER_COMPRESS=bfp8 }
#
# Every DDP run times each gradient bucket (--exposure: a wrapper around the hook in use,
# torch's allreduce_hook when there is none). The configurations run interleaved, ROUNDS times
# (default 2; every configuration once per round, so that the machine's noise hits all alike),
# STEPS steps each (default 60), all from the same seeds.
#
# Raw output in bench/results/ddp-bed-<UTC date>/ (OUT=dir to choose another): each run's JSON
# (<config>.r<round>.json, rank 0's) and every rank's log (<config>.r<round>.h<host>.log); the
# summary (ddp-bed.txt: per configuration the median step, its ratios to Gloo's and to
# Gloo+fp16's in the same round, exposed communication, final loss against uncompressed oxccl,
# and the issue's targets as "met"/"not met"); the plot (ddp-bed.png: loss and step time, from
# the last round). Fails, printing every rank's log, if any rank fails. Needs root.
#
# Env: RATE (1g), STEPS (60), ROUNDS (2), FSDP (1), BATCH (32), RUN_TIMEOUT (seconds per run,
# 900), OUT. Extra arguments go to the example (every run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
RATE=${RATE:-1g}
STEPS=${STEPS:-60}
ROUNDS=${ROUNDS:-2}
FSDP=${FSDP:-1}
BATCH=${BATCH:-32}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
venv=$(scripts/python-env.sh)
cargo build --release -q -p oxccl-testbed
(cd python && VIRTUAL_ENV="$venv" "$venv/bin/maturin" develop --release --quiet) >/dev/null
TB=$root/target/release/oxccl-testbed
trap '"$TB" down --owner $$ >/dev/null 2>&1 || true' EXIT
BED=$("$TB" up --rates "$RATE,$RATE,$RATE,$RATE" --owner-pid $$)
gbps=$(awk -v r="$RATE" 'BEGIN { s = tolower(r); v = s + 0; if (s ~ /m$/) v /= 1000; print v }')
res=${OUT:-$root/bench/results/ddp-bed-$(date -u +%Y-%m-%d)}
mkdir -p "$res"
configs=(gloo gloo-fp16 oxccl oxccl-bfp8 oxccl-bfp4)
if [ "$FSDP" = 1 ]; then
    configs+=(gloo-fsdp oxccl-fsdp oxccl-fsdp-bfp8)
fi
# Whether this tree's oxccl backend knows OXCCL_REDUCE_SCATTER_COMPRESS at all; where it does
# not, oxccl-fsdp-bfp8 runs uncompressed.
if grep -rqs OXCCL_REDUCE_SCATTER_COMPRESS python/oxccl crates; then
    rs_note="this tree's oxccl mentions OXCCL_REDUCE_SCATTER_COMPRESS"
else
    rs_note="this tree's oxccl does NOT read OXCCL_REDUCE_SCATTER_COMPRESS: oxccl-fsdp-bfp8 runs uncompressed"
fi

# Runs configuration $1, round $2, on the 4 hosts; returns when every rank has ended, or
# stops the others and fails at the first rank that fails.
run_config() {
    local name=$1 round=$2 backend extra envs pids h p q i rc alive
    shift 2
    case $name in
        gloo) backend=gloo; extra=(--exposure); envs=() ;;
        gloo-fp16) backend=gloo; extra=(--exposure --hook fp16); envs=() ;;
        oxccl) backend=oxccl; extra=(--exposure); envs=() ;;
        oxccl-bfp8) backend=oxccl; extra=(--exposure --compress bfp8); envs=() ;;
        oxccl-bfp4) backend=oxccl; extra=(--exposure --compress bfp4); envs=() ;;
        gloo-fsdp) backend=gloo; extra=(--fsdp); envs=() ;;
        oxccl-fsdp) backend=oxccl; extra=(--fsdp); envs=() ;;
        oxccl-fsdp-bfp8) backend=oxccl; extra=(--fsdp); envs=(OXCCL_REDUCE_SCATTER_COMPRESS=bfp8) ;;
        *) echo "ddp-bed.sh: unknown configuration $name" >&2; return 2 ;;
    esac
    local tag=$name.r$round
    echo "== $tag: rustc processes running now: $(pgrep -x rustc | wc -l)"
    rm -f "$res/$tag.json"
    pids=()
    for h in 0 1 2 3; do
        # Gloo advertises the address its host name resolves to (127.0.0.1 here), so it
        # needs GLOO_SOCKET_IFNAME across hosts; oxccl finds its address by itself.
        "$TB" exec "$BED" "$h" -- timeout -k 20 "$RUN_TIMEOUT" \
            env OXCCL_SECRET=ddp-bed OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "${envs[@]}" \
            "$venv/bin/python" -m torch.distributed.run --nnodes 4 --nproc-per-node 1 \
            --node-rank "$h" --master-addr 10.77.0.1 --master-port "$port" \
            examples/train_ddp.py --model mlp --batch "$BATCH" --backend "$backend" \
            --steps "$STEPS" --link-gbps "$gbps" --json "$res/$tag.json" \
            "${extra[@]}" "$@" >"$res/$tag.h$h.log" 2>&1 &
        pids+=($!)
    done
    port=$((port + 1))
    # Poll: the first rank to fail stops the others (a rank left alone would wait for its
    # peers until its backend's timeout).
    while [ ${#pids[@]} -gt 0 ]; do
        alive=()
        for p in "${pids[@]}"; do
            if kill -0 "$p" 2>/dev/null; then
                alive+=("$p")
                continue
            fi
            rc=0
            wait "$p" || rc=$?
            if [ "$rc" -ne 0 ]; then
                echo "ddp-bed.sh: $tag: a rank failed (exit $rc); every rank's log:"
                for q in "${pids[@]}"; do kill "$q" 2>/dev/null || true; done
                for i in 0 1 2 3; do echo "---- host $i"; cat "$res/$tag.h$i.log"; done
                return 1
            fi
        done
        pids=("${alive[@]}")
        [ ${#pids[@]} -gt 0 ] && sleep 1
    done
    [ -s "$res/$tag.json" ] || { echo "ddp-bed.sh: $tag wrote no JSON"; cat "$res/$tag.h0.log"; return 1; }
    grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp' "$res/$tag.h0.log"
}

{
    echo "# bench/ddp-bed.sh $*, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates python examples || echo '+changes'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; 4 hosts x 1 rank, links $RATE; MLP, batch $BATCH, $STEPS steps, $ROUNDS rounds: ${configs[*]}"
    echo "# $rs_note"
    port=29970
    for ((r = 1; r <= ROUNDS; r++)); do
        for c in "${configs[@]}"; do
            run_config "$c" "$r" "$@"
        done
    done
    "$venv/bin/python" - "$res" "$ROUNDS" "${configs[@]}" <<'PY'
import json
import statistics as st
import sys
from pathlib import Path

res, rounds, configs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
runs = {c: [json.loads((res / f"{c}.r{r}.json").read_text()) for r in range(1, rounds + 1)]
        for c in configs}
med = st.median


def ratio(c, base):
    """Median over rounds of c's median step over base's in the same round."""
    if base not in runs:
        return None
    return med([a["median_step_s"] / b["median_step_s"] for a, b in zip(runs[c], runs[base])])


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


ref = runs.get("oxccl")
print()
print(f"{'configuration':<16} {'median step':>11} {'/gloo':>6} {'/gloo+fp16':>10} "
      f"{'compute':>8} {'exposed':>8} {'after last':>10} {'final loss':>11} {'vs oxccl':>9}")
print(f"{'':<16} {'ms':>11} {'':>6} {'':>10} {'ms':>8} {'ms':>8} {'bucket ms':>10} {'':>11} {'%':>9}")
summary = {}
notes = []
for c in configs:
    ds = runs[c]
    step = med([t for d in ds for t in d["step_s"][min(3, len(d["step_s"]) - 1):]])
    comp = med([d["median_compute_s"] for d in ds])
    exposed = med([d["median_step_s"] - d["median_compute_s"] for d in ds])
    tail = (med([d["exposure"]["wait_after_last_call_s"] for d in ds])
            if all("exposure" in d for d in ds) else None)
    final = ds[-1]["losses"][-1]
    same = all(d["losses"] == ds[0]["losses"] for d in ds)
    rel = (med([abs(d["losses"][-1] - o["losses"][-1]) / abs(o["losses"][-1])
                for d, o in zip(ds, ref)]) if ref else None)
    summary[c] = dict(step=step, g=ratio(c, "gloo"), f=ratio(c, "gloo-fp16"), exposed=exposed,
                      tail=tail, rel=rel, fsdp=ratio(c, "gloo-fsdp"))
    if c == "oxccl-fsdp-bfp8" and "oxccl-fsdp" in runs and all(
            d["losses"] == o["losses"] for d, o in zip(ds, runs["oxccl-fsdp"])):
        notes.append("oxccl-fsdp-bfp8's losses are identical to oxccl-fsdp's in every round: its "
                     "reduce-scatters ran uncompressed")
    print(f"{c:<16} {step * 1e3:11.1f} {fmt(summary[c]['g']):>6} {fmt(summary[c]['f']):>10} "
          f"{comp * 1e3:8.1f} {exposed * 1e3:8.1f} {fmt(None if tail is None else tail * 1e3, '.1f'):>10} "
          f"{final:11.6f} {fmt(None if rel is None else 100 * rel, '.3f'):>9}"
          + ("" if same else "  (losses differ between rounds)"))
print("median step: over every round's steps after the warm-up; /gloo, /gloo+fp16: median over "
      "rounds of the ratio of the two medians in the same round; compute: the same step without "
      "gradient synchronisation (DDP no_sync; FSDP2: an unsharded local copy); exposed: median "
      "step - compute; after last bucket: from the last bucket handed to the hook until every "
      "bucket's future completed (DDP, rank 0); vs oxccl: the final loss's relative difference "
      "to uncompressed oxccl DDP's in the same round.")
for n in notes:
    print(f"note: {n}")

print()
print("per-bucket communication, rank 0, medians over steps and rounds, ms from the start of "
      "backward(): #bucket MB: hook called, returned -> future done (wire; exposed share)")
for c in configs:
    ds = [d for d in runs[c] if "exposure" in d]
    if not ds:
        continue
    parts = []
    for b in ds[0]["exposure"]["buckets"]:
        same = [x for d in ds for x in d["exposure"]["buckets"] if x["index"] == b["index"]]
        m = lambda k: med([x[k] for x in same]) * 1e3  # noqa: E731
        parts.append(f"#{b['index']} {b['bytes'] / 1e6:.1f} MB: {m('called_s'):.0f}, "
                     f"{m('returned_s'):.0f} -> "
                     f"{m('done_s'):.0f} ({m('wire_s'):.0f}; {m('exposed_s'):.0f})")
    bwd = med([d["median_backward_s"] for d in ds]) * 1e3
    bwc = med([d["median_compute_backward_s"] for d in ds]) * 1e3
    print(f"  {c:<14} " + "; ".join(parts) + f"; backward {bwd:.0f} ms with sync, {bwc:.0f} ms alone")

print()
print("targets (issue 27, item 3):")


def target(what, value, limit):
    if value is None:
        print(f"  {what}: not measured")
        return
    print(f"  {what}: {value:.3f} (target <= {limit}): {'met' if value <= limit else 'not met'}")


s = summary
if "oxccl" in s:
    target("oxccl / gloo", s["oxccl"]["g"], 1.0)
if "oxccl-bfp8" in s:
    target("oxccl bfp8 / gloo", s["oxccl-bfp8"]["g"], 0.40)
    target("oxccl bfp8 / gloo+fp16", s["oxccl-bfp8"]["f"], 0.70)
if "oxccl-bfp4" in s:
    target("oxccl bfp4 / gloo", s["oxccl-bfp4"]["g"], 0.30)
for c in ("oxccl-bfp8", "oxccl-bfp4"):
    if c in s and s[c]["rel"] is not None:
        v = s[c]["rel"]
        print(f"  {c} final loss vs oxccl: {100 * v:.3f}% (target within 1%): "
              f"{'met' if v <= 0.01 else 'not met'}")
if "oxccl-fsdp" in s:
    target("oxccl fsdp / gloo fsdp", s["oxccl-fsdp"]["fsdp"], 0.9)
if "oxccl-fsdp-bfp8" in s:
    v = s["oxccl-fsdp-bfp8"]["fsdp"]
    print(f"  oxccl fsdp + OXCCL_REDUCE_SCATTER_COMPRESS=bfp8 / gloo fsdp: {fmt(v)} (reported, "
          "no target)")
if "oxccl" in s and "gloo" in s and s["oxccl"]["tail"] is not None:
    o, g = s["oxccl"], s["gloo"]
    print(f"  overlap: oxccl's communication exposed after the last bucket {o['tail'] * 1e3:.1f} ms, "
          f"Gloo's {g['tail'] * 1e3:.1f} ms (target: no more than Gloo's): "
          f"{'met' if o['tail'] <= g['tail'] else 'not met'}; step - compute: oxccl "
          f"{o['exposed'] * 1e3:.1f} ms, Gloo {g['exposed'] * 1e3:.1f} ms: "
          f"{'met' if o['exposed'] <= g['exposed'] else 'not met'}")
PY
    # The plot: the last round of every configuration, uncompressed oxccl first (the others'
    # losses are drawn relative to it).
    logs=()
    for c in oxccl "${configs[@]}"; do
        case " ${logs[*]} " in *" $res/$c.r$ROUNDS.json "*) continue ;; esac
        [ -f "$res/$c.r$ROUNDS.json" ] && logs+=("$res/$c.r$ROUNDS.json")
    done
    "$venv/bin/python" examples/train_ddp.py --plot "${logs[@]}" -o "$res/ddp-bed.png"
} 2>&1 | tee "$res/ddp-bed.txt"
