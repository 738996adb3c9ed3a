#!/usr/bin/env bash
# Per-request fixed costs of a 4 KiB sync WRITE over tcp: perf stat (context switches, task
# clock, both processes) and strace -f -c (syscalls), each as the difference of a 25000- and a
# 5000-request run divided by 20000 (start-up and warm-up cancel).
set -u
MAIN=$1; BR=$2
ps_run() { # LABEL CMD..
    local label=$1; shift
    local a b
    a=$(perf stat -x, -e context-switches,task-clock "$@" --iters 5000 --warmup 200 2>&1 >/dev/null | awk -F, '/context-switches/ {c=$1} /task-clock/ {t=$1} END {print c, t}')
    b=$(perf stat -x, -e context-switches,task-clock "$@" --iters 25000 --warmup 200 2>&1 >/dev/null | awk -F, '/context-switches/ {c=$1} /task-clock/ {t=$1} END {print c, t}')
    echo "$a $b" | awk -v l="$label" '{printf "%-22s context switches %.2f / request, CPU (both processes) %.1f us / request\n", l, ($3-$1)/20000, ($4-$2)*1000/20000}'
}
st_run() { # LABEL CMD..
    local label=$1; shift
    strace -f -c -o /tmp/kvlat-st-a.txt "$@" --iters 5000 --warmup 200 >/dev/null 2>&1
    strace -f -c -o /tmp/kvlat-st-b.txt "$@" --iters 25000 --warmup 200 >/dev/null 2>&1
    echo "$label: syscalls per request (strace -f -c, both processes; 25000 - 5000 requests)"
    awk 'FNR==1 {f++} FNR>2 && $NF !~ /^(total|syscall)$/ && $1 !~ /^-/ { n = ($5 ~ /^[0-9]+$/) ? $4 : $4; if (f==1) a[$NF]=n; else b[$NF]=n }
         END { for (k in b) { d=(b[k]-a[k])/20000; if (d >= 0.05) printf "    %-16s %6.2f\n", k, d } }' /tmp/kvlat-st-a.txt /tmp/kvlat-st-b.txt | sort -k2 -rn
}
K="kv-bench --protocol tcp --op write --sync --block-size 4K --json"
echo "== perf stat (per request)"
for r in 1 2; do
ps_run "main (sleep)" $MAIN $K
ps_run "branch --poll sleep" $BR $K --poll sleep
ps_run "branch --poll busy" $BR $K --poll busy
done
echo "== strace"
st_run "main (sleep)" $MAIN $K
st_run "branch --poll sleep" $BR $K --poll sleep
st_run "branch --poll busy" $BR $K --poll busy
