#!/usr/bin/env bash
# Totals of the fuzzing ledger (fuzz/HISTORY.tsv, one row per target per scripts/fuzz.sh run):
# per target, the runs, seconds and executions summed over the project's history, the findings,
# and whether the executions reached a goal (default 10,000,000).
#
#   scripts/fuzz-totals.sh [LEDGER] [GOAL]
#
# Exits 1 if any target listed in the ledger is short of the goal.
set -euo pipefail
cd "$(dirname "$0")/.."
ledger=${1:-fuzz/HISTORY.tsv}
goal=${2:-10000000}
awk -F'\t' -v goal="$goal" '
    NR == 1 || /^#/ || NF < 8 { next }
    {
        if (!($3 in runs)) order[++n] = $3
        runs[$3]++; secs[$3] += $4; execs[$3] += $5
        if ($8 != "ok") found[$3]++
        san[$3] = san[$3] (index(" " san[$3] " ", " " $7 " ") ? "" : (san[$3] == "" ? "" : ",") $7)
    }
    END {
        printf "%-16s %5s %8s %14s %9s %-16s %8s  %s\n", "target", "runs", "seconds", "executions", "exec/s", "sanitizers", "findings", "goal " goal
        short = 0
        for (i = 1; i <= n; i++) {
            t = order[i]
            ok = execs[t] >= goal
            if (!ok) short = 1
            printf "%-16s %5d %8d %14d %9.0f %-16s %8d  %s\n", t, runs[t], secs[t], execs[t],
                (secs[t] > 0 ? execs[t] / secs[t] : 0), san[t], found[t] + 0,
                (ok ? "reached" : "short by " goal - execs[t])
        }
        exit short
    }' "$ledger"
