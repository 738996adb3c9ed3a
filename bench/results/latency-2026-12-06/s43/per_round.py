#!/usr/bin/env python3
"""Per-round paired ratios from bench/vs-openmpi.sh's raw outputs (RESULTS dir): for each
scenario, size and round r, Open MPI's time over oxccl's in round r (the two ran one after
the other); prints the median, min and max over the rounds. Usage: per_round.py RAW_DIR"""
import glob, os, statistics, sys

raw = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(raw, "*.rows"))):
    parts = os.path.basename(path).split(".")
    if len(parts) != 4:
        continue  # the best-of table
    scen, side, rnd, _ = parts
    for line in open(path):
        f = line.split()
        if len(f) >= 2:
            rows.setdefault((scen, int(f[0])), {}).setdefault(int(rnd), {})[side] = float(f[1])
print(f"{'scenario':8} {'size':>6} {'rounds':>6} {'median':>7} {'min':>6} {'max':>6}  (ompi_us / oxccl_us per round)")
for (scen, size), by_round in sorted(rows.items()):
    r = [v["ompi"] / v["oxccl"] for v in by_round.values() if "ompi" in v and "oxccl" in v]
    if r:
        print(f"{scen:8} {size:>6} {len(r):>6} {statistics.median(r):>7.3f} {min(r):>6.3f} {max(r):>6.3f}")
