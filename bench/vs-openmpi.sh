#!/usr/bin/env bash
# oxccl all-reduce against Open MPI's MPI_Allreduce (float, sum, out of place), side by side in one
# run: same sizes, same rank counts, the two interleaved so that the noise of a shared machine hits
# both.
#
# Usage:
#   bench/vs-openmpi.sh                         all scenarios, 8 B .. 128 MiB, x4 steps
#   SCENARIOS=shm2 MAX=16M bench/vs-openmpi.sh  one scenario, smaller sizes
#   ROUNDS=3 bench/vs-openmpi.sh                3 rounds, best round per size and side
#
# Scenarios (SCENARIOS, space or comma separated; default all):
#   shm2, shm4, shm8  2/4/8 ranks on this host over shared memory. Open MPI: pml ob1 with the
#                     self and vader BTLs (vader uses CMA single copy where it works);
#                     oxccl: OXCCL_PROVIDER=shm. 4 and 8 ranks oversubscribe a small machine.
#   tcp2              2 ranks over TCP on loopback. Open MPI: pml ob1 with the self and tcp BTLs
#                     on lo only, coll/sm excluded (the script checks, with btl_base_verbose, that
#                     the peer is reached over tcp and never vader); oxccl: OXCCL_PROVIDER=tcp.
#   Both sides run with --bind-to none / no pinning.
#
# Environment (defaults in brackets):
#   MIN [8] MAX [256M] FACTOR [4]  sizes in bytes (K/M/G suffixes = KiB/MiB/GiB): MIN, MIN*FACTOR,
#                                   ... up to MAX, as in nccl-tests, so the defaults stop at 128M
#                                   (8 * 4^12); MIN=4 or 16 gives 1M, 64M and 256M instead
#   WARMUP [5] ITERS [20]           warmup and timed iterations per size, the same for all sizes
#   ROUNDS [1]                      repetitions of each (ompi, oxccl) pair; per size the best
#                                   (fastest) round of each side is reported
#   RUN_TIMEOUT [1800]              seconds one benchmark run may take before it is killed
#   OXCCL_PERF_CMD                  the oxccl command, word-split [target/release/oxccl perf,
#                                   built here with cargo]; when set, nothing is built, so it can
#                                   point at another build (or a fake, for testing the script)
#   MPIRUN_EXTRA                    extra mpirun arguments, word-split
#                                   (e.g. "--mca mpi_yield_when_idle 1")
#   RESULTS                         directory for the raw outputs [target/bench/vs-openmpi/DATE]
#   JSON_TOOL                       python3 or jq [python3 when it works, else jq]
#
# What runs (N ranks):
#   mpirun -np N --oversubscribe --bind-to none --mca pml ob1 --mca btl ... \
#       target/bench/mpi_allreduce -b MIN -e MAX -f FACTOR -w WARMUP -i ITERS --json
#   OXCCL_PROVIDER=shm|tcp $OXCCL_PERF_CMD all_reduce -n N -b MIN -e MAX -f FACTOR -d float -o sum \
#       -c 1 -w WARMUP -i ITERS --json
# mpi_allreduce is bench/mpi/allreduce.c compiled with mpicc -O2 (nccl-tests' all_reduce_perf
# rules: time = slowest rank's average per iteration; busbw = size/time * 2(n-1)/n, GB = 1e9 B).
# From oxccl's JSON the out-of-place figures ("oop") are compared.
#
# Output per scenario, one row per size:
#   size  ompi_busbw  oxccl_busbw  ratio  ompi_us  oxccl_us  lat_ratio  ompi_wrong  oxccl_wrong
# ratio = oxccl_busbw / ompi_busbw and lat_ratio = ompi_us / oxccl_us: above 1 means oxccl is
# faster. With the same size and rank count the two are the same number (busbw is size / time
# times a constant); both are computed from the times, which keep their precision where a busbw is
# rounded to 0.00x, and a warning says when a side's busbw does not match its time. Then one
# summary line: geomean ratio over the sizes >= 1 MiB, and the smallest ratio over all sizes with
# its size.
#
# A busy machine ruins the figures: both sides poll while they wait, so when other processes hold
# the CPUs a rank that loses its CPU costs a scheduler tick (~4 ms) per step; the script prints
# the load average and warns. Run it on a quiet machine, with ROUNDS=3 on a noisy one.
#
# Exit status: 0 when every run succeeded, every size was measured by both sides and no element
# was wrong; 1 otherwise (the other scenarios still run); 2 for bad settings.
#
# Needs: mpirun/mpicc (installed with apt-get when mpirun is missing: openmpi-bin libopenmpi-dev;
# tested with Open MPI 4.1.4 from Debian 12), cargo, python3 or jq, GNU timeout.
set -euo pipefail

cd "$(dirname "$0")/.."

SCENARIOS=${SCENARIOS:-shm2 shm4 shm8 tcp2}
SCENARIOS=${SCENARIOS//,/ }
MIN=${MIN:-8}
MAX=${MAX:-256M}
FACTOR=${FACTOR:-4}
WARMUP=${WARMUP:-5}
ITERS=${ITERS:-20}
ROUNDS=${ROUNDS:-1}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
MPIRUN_EXTRA=${MPIRUN_EXTRA:-}
RESULTS=${RESULTS:-target/bench/vs-openmpi/$(date +%Y%m%d-%H%M%S)}

say() { echo "vs-openmpi: $*" >&2; }
die() { say "$*"; exit 2; }

# ---- settings ------------------------------------------------------------------------------
size_re='^[0-9]+[KkMmGg]?$'
[[ $MIN =~ $size_re ]] || die "MIN=$MIN is not a size (bytes, optional K/M/G suffix)"
[[ $MAX =~ $size_re ]] || die "MAX=$MAX is not a size (bytes, optional K/M/G suffix)"
for v in FACTOR WARMUP ITERS ROUNDS RUN_TIMEOUT; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "$v=${!v} is not a whole number"
done
((FACTOR >= 2)) || die "FACTOR=$FACTOR must be at least 2"
((ITERS >= 1 && ROUNDS >= 1 && RUN_TIMEOUT >= 1)) || die "ITERS, ROUNDS and RUN_TIMEOUT must be at least 1"
for s in $SCENARIOS; do
    case $s in
        shm2 | shm4 | shm8 | tcp2) ;;
        *) die "unknown scenario '$s' in SCENARIOS (known: shm2 shm4 shm8 tcp2)" ;;
    esac
done
[[ -n ${SCENARIOS// /} ]] || die "SCENARIOS is empty"
command -v timeout >/dev/null || die "GNU timeout (coreutils) is needed"

# JSON reader: python3, else jq (JSON_TOOL=python3|jq forces one).
case ${JSON_TOOL:-} in
    python3 | jq) command -v "$JSON_TOOL" >/dev/null 2>&1 || die "JSON_TOOL=$JSON_TOOL: not found" ;;
    '')
        if command -v python3 >/dev/null 2>&1 && python3 -c 'import json' >/dev/null 2>&1; then
            JSON_TOOL=python3
        elif command -v jq >/dev/null 2>&1; then
            JSON_TOOL=jq
        else
            die "need python3 or jq to read the benchmarks' JSON output; install one (apt-get install -y jq)"
        fi
        ;;
    *) die "JSON_TOOL=$JSON_TOOL: use python3 or jq" ;;
esac

# ---- tools and builds ----------------------------------------------------------------------
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    say "mpirun/mpicc not found: installing Open MPI (openmpi-bin libopenmpi-dev) with apt-get"
    command -v apt-get >/dev/null || die "no apt-get here: install Open MPI (mpirun, mpicc) by hand"
    SUDO=
    ((EUID == 0)) || SUDO=sudo
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openmpi-bin libopenmpi-dev ||
        die "apt-get install of openmpi-bin libopenmpi-dev failed (try apt-get update first)"
fi

MPI_BIN=target/bench/mpi_allreduce
mkdir -p target/bench
echo "== compiling bench/mpi/allreduce.c -> $MPI_BIN =="
mpicc -O2 -o "$MPI_BIN" bench/mpi/allreduce.c || die "mpicc failed on bench/mpi/allreduce.c"

if [[ -n ${OXCCL_PERF_CMD:-} ]]; then
    read -r -a OXCMD <<<"$OXCCL_PERF_CMD"
    echo "== oxccl: using OXCCL_PERF_CMD='$OXCCL_PERF_CMD' (nothing built) =="
else
    echo "== building oxccl (cargo build --release -p oxccl-cli) =="
    cargo build --release -q -p oxccl-cli || die "cargo build --release -p oxccl-cli failed"
    OXCMD=(target/release/oxccl perf)
    if ! "${OXCMD[@]}" --help >/dev/null 2>&1; then
        die "target/release/oxccl has no working 'perf' subcommand ('oxccl perf --help' failed); \
build one that has it, or point OXCCL_PERF_CMD at one"
    fi
fi

MPIRUN=(mpirun)
((EUID == 0)) && MPIRUN+=(--allow-run-as-root)
MPIRUN+=(--oversubscribe --bind-to none)
read -r -a MPIRUN_EXTRA_ARGS <<<"$MPIRUN_EXTRA"

# ---- header --------------------------------------------------------------------------------
mkdir -p "$RESULTS"
model=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo 2>/dev/null | head -n1)
rev=$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
echo "== machine: $(nproc) CPUs (${model:-unknown model}), $(uname -sr)"
echo "== open mpi: $(mpirun --version 2>&1 | head -n1)"
# How busy the CPUs are now: the non-idle share of CPU time over one second (/proc/stat).
cpu_busy() {
    local a b
    a=$(head -n1 /proc/stat 2>/dev/null) || return 1
    sleep 1
    b=$(head -n1 /proc/stat 2>/dev/null) || return 1
    awk -v a="$a" -v b="$b" 'BEGIN {
        n = split(a, x); split(b, y); tot = 0
        for (i = 2; i <= n; i++) tot += y[i] - x[i]
        idle = (y[5] - x[5]) + (y[6] - x[6])
        if (tot > 0) printf "%.0f\n", 100 * (tot - idle) / tot; else exit 1
    }'
}
busy=$(cpu_busy || echo "")
echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown); CPUs busy over the last second: ${busy:-unknown}%"
if [[ -n $busy ]] && ((busy >= 20)); then
    say "warning: the CPUs are ${busy}% busy with other work. Both sides poll while they wait; a rank"
    say "  that loses its CPU costs a scheduler tick (~4 ms) per step, so small sizes can read 1000x"
    say "  slow. Better a quiet machine; ROUNDS=3 keeps each side's best round."
fi
echo "== oxccl: git $rev, command: ${OXCMD[*]}"
echo "== sizes $MIN..$MAX x$FACTOR, warmup $WARMUP, iters $ITERS, rounds $ROUNDS, scenarios: $SCENARIOS"
echo "== raw outputs in $RESULTS (JSON reader: $JSON_TOOL)"

# ---- running -------------------------------------------------------------------------------
# bounded OUT ERR CMD...: runs CMD with stdin from /dev/null, stdout to OUT and stderr to ERR,
# killed (with its whole process group: timeout makes one) after RUN_TIMEOUT s. If this script is
# interrupted the run is stopped too, so no mpirun or ranks outlive it.
CHILD=
stop_child() {
    if [[ -n $CHILD ]]; then
        kill -TERM "$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
        CHILD=
    fi
}
trap 'stop_child' EXIT
trap 'say "interrupted"; stop_child; exit 130' INT TERM
bounded() {
    local out=$1 err=$2
    shift 2
    timeout -k 10 "$RUN_TIMEOUT" "$@" </dev/null >"$out" 2>"$err" &
    CHILD=$!
    local rc=0
    wait "$CHILD" || rc=$?
    CHILD=
    return "$rc"
}

# rows KIND FILE NRANKS: the rows of a benchmark's JSON as "size time_us busbw wrong" lines;
# KIND mpi (flat rows) or oxccl (the "oop" figures). Fails when the file is no such document.
rows() {
    local kind=$1 file=$2 n=$3
    if [[ $JSON_TOOL == python3 ]]; then
        python3 - "$kind" "$file" "$n" <<'EOF'
import json, sys
kind, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    with open(path) as f:
        doc = json.load(f)
    if "nranks" in doc and int(doc["nranks"]) != n:
        sys.exit(f"nranks is {doc['nranks']}, expected {n}")
    if not doc.get("rows"):
        sys.exit("no rows")
    for r in doc["rows"]:
        f = r["oop"] if kind == "oxccl" else r
        print(int(r["size"]), float(f["time_us"]), float(f["busbw"]), int(f["wrong"]))
except json.JSONDecodeError as e:
    sys.exit(f"not one JSON document: {e}")
except (KeyError, TypeError, ValueError, AttributeError) as e:
    sys.exit(f"a row lacks a field or has a bad value: {type(e).__name__} {e}")
EOF
    else
        local sel='.'
        [[ $kind == oxccl ]] && sel='.oop'
        jq -er --argjson n "$n" "
            if (.nranks // \$n) != \$n then error(\"nranks is \\(.nranks), expected \\(\$n)\")
            elif ((.rows // []) | length) == 0 then error(\"no rows\")
            else .rows[] | [.size, ($sel | .time_us, .busbw, .wrong)]
                | if any(.[]; type != \"number\")
                  then error(\"a row lacks a field or has a bad value: \\(.)\")
                  else map(tostring) | join(\" \") end
            end" "$file"
    fi
}

# show_failure WHAT RC OUT ERR: says why a run failed, with the ends of its outputs.
show_failure() {
    local what=$1 rc=$2 out=$3 err=$4
    if ((rc == 124 || rc == 137)); then
        say "$what: killed after RUN_TIMEOUT=${RUN_TIMEOUT}s"
    else
        say "$what: failed with exit status $rc"
    fi
    if [[ -s $err ]]; then
        say "  last lines of its stderr ($err):"
        tail -n 15 "$err" | sed 's/^/    /' >&2
    fi
    if [[ -s $out ]]; then
        say "  last lines of its stdout ($out):"
        tail -n 5 "$out" | cut -c1-400 | sed 's/^/    /' >&2
    fi
}

# tcp2's Open MPI arguments are checked once: the peer must be reached with the tcp BTL, never vader.
check_tcp_only() {
    local log=$RESULTS/tcp2.btl-check.log
    local rc=0
    bounded "$log" "$log.err" "${MPIRUN[@]}" -np 2 "$@" --mca btl_base_verbose 100 \
        "$MPI_BIN" -b 8 -e 8 -w 1 -i 1 || rc=$?
    if ((rc != 0)); then
        show_failure "tcp2 transport check (mpirun ... btl_base_verbose 100)" "$rc" "$log" "$log.err"
        return 1
    fi
    if grep -q 'Using vader btl' "$log" "$log.err"; then
        say "tcp2: Open MPI used the vader (shared memory) BTL despite '--mca btl self,tcp'; see $log.err"
        return 1
    fi
    if grep -q 'Using tcp btl for send' "$log" "$log.err"; then
        echo "  tcp2: checked: Open MPI reaches the peer over the tcp BTL (no vader)"
    else
        say "tcp2: warning: could not confirm the BTL from $log.err (message format changed?)"
    fi
}

FAILED=0
declare -a SUMMARY=()

for scen in $SCENARIOS; do
    n=${scen#shm}
    n=${n#tcp}
    case $scen in
        shm*)
            mpi_transport=(--mca pml ob1 --mca btl self,vader)
            provider=shm
            ;;
        tcp*)
            mpi_transport=(--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo --mca coll ^sm)
            provider=tcp
            ;;
    esac
    echo
    echo "== $scen: $n ranks; Open MPI ${mpi_transport[*]}; oxccl OXCCL_PROVIDER=$provider =="
    scen_ok=1
    if [[ $scen == tcp* ]] && ! check_tcp_only "${mpi_transport[@]}" "${MPIRUN_EXTRA_ARGS[@]}"; then
        FAILED=1
        SUMMARY+=("$scen: FAILED (Open MPI transport check)")
        continue
    fi
    table=$RESULTS/$scen.rows
    : >"$table"
    for ((r = 1; r <= ROUNDS; r++)); do
        for side in ompi oxccl; do
            base=$RESULTS/$scen.$side.$r
            if [[ $side == ompi ]]; then
                cmd=("${MPIRUN[@]}" -np "$n" "${mpi_transport[@]}" "${MPIRUN_EXTRA_ARGS[@]}"
                    "$MPI_BIN" -b "$MIN" -e "$MAX" -f "$FACTOR" -w "$WARMUP" -i "$ITERS" --json)
                kind=mpi
            else
                cmd=(env "OXCCL_PROVIDER=$provider" "${OXCMD[@]}" all_reduce -n "$n" -b "$MIN"
                    -e "$MAX" -f "$FACTOR" -d float -o sum -c 1 -w "$WARMUP" -i "$ITERS" --json)
                kind=oxccl
            fi
            echo "$ ${cmd[*]}" >"$base.cmd"
            t0=$(date +%s.%N)
            rc=0
            bounded "$base.json" "$base.err" "${cmd[@]}" || rc=$?
            secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
            if ((rc != 0)); then
                show_failure "$scen round $r $side ($(cat "$base.cmd"))" "$rc" "$base.json" "$base.err"
                scen_ok=0
                continue
            fi
            if ! rows "$kind" "$base.json" "$n" >"$base.rows" 2>"$base.parse-err"; then
                say "$scen round $r $side: its output is not the expected JSON: $(head -c 300 "$base.parse-err")"
                say "  start of its stdout ($base.json):"
                head -c 600 "$base.json" | sed 's/^/    /' >&2
                echo >&2
                scen_ok=0
                continue
            fi
            sed "s/^/$side /" "$base.rows" >>"$table"
            echo "  round $r/$ROUNDS $side: $(wc -l <"$base.rows") sizes in ${secs}s"
        done
    done

    # Per side and size: the fastest round, and the wrong elements summed over the rounds. Then the
    # side-by-side table and the summary line (stdout: table; last line "SUMMARY ... STATUS").
    result=$(sort -k2,2n -k1,1 "$table" | awk -v scen="$scen" -v n="$n" '
        function human(b) {
            if (b >= 1073741824 && b % 1073741824 == 0) return (b / 1073741824) "G"
            if (b >= 1048576 && b % 1048576 == 0) return (b / 1048576) "M"
            if (b >= 1024 && b % 1024 == 0) return (b / 1024) "K"
            return b
        }
        {
            side = $1; size = $2; key = side SUBSEP size
            if (!(size in seen)) { seen[size] = 1; order[++nsizes] = size }
            if (!(key in t) || $3 < t[key]) { t[key] = $3; bw[key] = $4 }
            wrong[key] += $5
            # The reported busbw must be nccl-tests busbw of the reported time (to its rounding).
            want = $3 > 0 ? size / ($3 * 1e3) * 2 * (n - 1) / n : 0
            d = $4 - want; if (d < 0) d = -d
            if (d > 0.01 * want + 0.0051 && !(side in warned)) {
                warned[side] = 1
                printf "  warning: %s reports busbw %s GB/s at %.0f B in %s us; %d ranks make that %.4f (ratios use the times)\n", \
                    side, $4, size, $3, n, want
            }
        }
        END {
            printf "  %8s %12s %12s %8s %12s %12s %10s %10s %11s\n", "size", "ompi_busbw", \
                "oxccl_busbw", "ratio", "ompi_us", "oxccl_us", "lat_ratio", "ompi_wrong", "oxccl_wrong"
            missing = 0; wo = 0; wx = 0; nbig = 0; logsum = 0; minr = -1
            for (i = 1; i <= nsizes; i++) {
                s = order[i]; o = "ompi" SUBSEP s; x = "oxccl" SUBSEP s
                has_o = (o in t); has_x = (x in t)
                ratio = "-"; lat = "-"
                if (has_o && has_x && t[o] > 0 && t[x] > 0) {
                    # Same size and rank count: the busbw ratio is the time ratio; from the
                    # times it keeps its precision where busbw is rounded to nothing.
                    r = t[o] / t[x]; ratio = sprintf("%.3f", r)
                    lat = ratio
                    if (s >= 1048576) { nbig++; logsum += log(r) }
                    if (minr < 0 || r < minr) { minr = r; minsize = s }
                }
                if (!has_o || !has_x) missing++
                wo += wrong[o]; wx += wrong[x]
                printf "  %8s %12s %12s %8s %12s %12s %10s %10s %11s\n", human(s), \
                    has_o ? sprintf("%.3f", bw[o]) : "-", has_x ? sprintf("%.3f", bw[x]) : "-", \
                    ratio, has_o ? sprintf("%.2f", t[o]) : "-", has_x ? sprintf("%.2f", t[x]) : "-", \
                    lat, has_o ? wrong[o] : "-", has_x ? wrong[x] : "-"
            }
            line = scen ":"
            line = line (nbig ? sprintf(" geomean ratio (oxccl/ompi busbw, sizes >= 1M) %.3f over %d sizes;", exp(logsum / nbig), nbig) : " no size >= 1M measured by both;")
            line = line (minr >= 0 ? sprintf(" min ratio %.3f at %s;", minr, human(minsize)) : " no ratio;")
            line = line sprintf(" #wrong ompi %.0f, oxccl %.0f", wo, wx)
            if (missing) line = line sprintf("; %d size(s) measured by one side only", missing)
            status = (wo > 0 || wx > 0 || missing > 0 || nsizes == 0) ? "BAD" : "OK"
            print "SUMMARY " status " " line
        }')
    grep -v '^SUMMARY ' <<<"$result"
    line=$(sed -n 's/^SUMMARY //p' <<<"$result")
    status=${line%% *}
    line=${line#* }
    if [[ $status != OK ]]; then scen_ok=0; fi
    if ((scen_ok)); then
        SUMMARY+=("$line")
    else
        FAILED=1
        SUMMARY+=("$line  [FAILED: see the messages above]")
    fi
    echo "  $line"
done

echo
echo "== summary (ratio > 1: oxccl faster) =="
for l in "${SUMMARY[@]}"; do echo "  $l"; done
echo "== raw outputs: $RESULTS"
if ((FAILED)); then
    say "some runs failed, missed sizes or computed wrong elements (see above)"
    exit 1
fi
