#!/usr/bin/env bash
# The long version of issue 5's acceptance tests, "never hang, never corrupt"
# (crates/oxccl/tests/chaos.rs and soak.rs; `cargo test` runs a bounded version of each):
#
#   kill    every collective x {shm, tcp in network namespaces}: 4 ranks loop it, a random rank
#           is SIGKILLed at a random moment; every survivor must fail naming it within
#           OXCCL_TIMEOUT + 1 s. Prints a table per provider: trials, worst and median
#           detection time, error kinds.
#   stop    a random rank is SIGSTOPped (shm and tcp): the others must time out naming the
#           call, the peer, the step; after they abort, the continued rank fails within 2 s.
#           Plus abort() from another thread unblocking a blocked call (one process).
#   strangers  wrong secrets, garbage and malformed frames at the bootstrap store while a
#           job runs; the store closing a silent connection (needs >= 12 s).
#   soak    4 ranks, random collectives, every result checked; RSS and descriptors must not
#           grow. Plus the all-to-allv regression it found.
#   elastic random kill points in shrink, grow and init (shm, and tcp in network namespaces):
#           every survivor ends in a working communicator or with an error naming a rank
#           within the bound (tests/elastic_chaos.rs, tests/init_chaos.rs), CHAOS_TRIALS each.
#
#   scripts/chaos.sh            # everything, bounded by CHAOS_BUDGET seconds
#
# Variables (all optional):
#   CHAOS_TRIALS=20        kill trials per collective and provider (OXCCL_CHAOS_TRIALS)
#   CHAOS_COLLS=...        comma-separated collectives for the kill trials (default all 11)
#   CHAOS_STOP_RUNS=5      runs of each SIGSTOP test (a random rank each time)
#   CHAOS_STRANGER_SECS=15 how long strangers pester the running job (OXCCL_STRANGER_SECS)
#   CHAOS_SOAK_CALLS=10000 calls of the soak (OXCCL_SOAK_CALLS)
#   CHAOS_SEED=N           replays the random choices of the chaos tests (OXCCL_CHAOS_SEED;
#                          each test prints the seed it used)
#   CHAOS_SOAK_SEED=N      replays a soak sequence (OXCCL_SOAK_SEED)
#   CHAOS_BUDGET=1500      seconds for the whole run; a step still running when it is spent
#                          is killed and counts as failed
#   CHAOS_LOGS=target/chaos-logs   where each step's full output goes
#
# Exits 0 when every step passed, 1 otherwise (2 on bad usage). The kill trials over tcp print
# "SKIPPED" and pass where the machine cannot host network namespaces (not root).
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

trials=${CHAOS_TRIALS:-20}
stop_runs=${CHAOS_STOP_RUNS:-5}
stranger_secs=${CHAOS_STRANGER_SECS:-15}
soak_calls=${CHAOS_SOAK_CALLS:-10000}
budget=${CHAOS_BUDGET:-1500}
logs=${CHAOS_LOGS:-target/chaos-logs}
for v in "$trials" "$stop_runs" "$stranger_secs" "$soak_calls" "$budget"; do
    if ! [[ $v =~ ^[0-9]+$ ]]; then
        echo "$0: CHAOS_TRIALS, CHAOS_STOP_RUNS, CHAOS_STRANGER_SECS, CHAOS_SOAK_CALLS and" \
            "CHAOS_BUDGET take whole numbers (got '$v')" >&2
        exit 2
    fi
done
export OXCCL_CHAOS_TRIALS=$trials OXCCL_STRANGER_SECS=$stranger_secs OXCCL_SOAK_CALLS=$soak_calls
export OXCCL_ELASTIC_TRIALS=$trials OXCCL_INIT_CHAOS_TRIALS=$trials
[ -n "${CHAOS_SEED:-}" ] && export OXCCL_ELASTIC_SEED=$CHAOS_SEED
[ -n "${CHAOS_COLLS:-}" ] && export OXCCL_CHAOS_COLLS=$CHAOS_COLLS
[ -n "${CHAOS_SEED:-}" ] && export OXCCL_CHAOS_SEED=$CHAOS_SEED
[ -n "${CHAOS_SOAK_SEED:-}" ] && export OXCCL_SOAK_SEED=$CHAOS_SOAK_SEED
mkdir -p "$logs"

start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }

echo "== building the tests =="
if ! cargo test -p oxccl --test chaos --test soak --test elastic_chaos --test init_chaos \
    --no-run 2>&1 | tail -3; then
    echo "FAILED: the build" >&2
    exit 1
fi
cargo build -q -p oxccl-testbed 2>/dev/null || true

# Namespaces of a test killed at the budget's end are left behind; the next test bed (or
# this) deletes every bed whose owner is gone.
cleanup() { [ -x target/debug/oxccl-testbed ] && target/debug/oxccl-testbed gc >/dev/null 2>&1; }
trap cleanup EXIT

passed=() failed=()
# step NAME TEST-BINARY TEST-NAME: runs one test with what is left of the budget.
step() {
    local name=$1 bin=$2 test=$3 rem
    rem=$(left)
    if [ "$rem" -le 5 ]; then
        echo "== $name: no time left in CHAOS_BUDGET=$budget ==" >&2
        failed+=("$name (not run: budget spent)")
        return
    fi
    echo "== $name ($test; ${rem} s of the budget left) =="
    local t0=$(date +%s) rc
    # timeout signals the whole process group: the test and the ranks it spawned.
    timeout --kill-after=10 "$rem" cargo test -q -p oxccl --test "$bin" -- --exact "$test" \
        --nocapture --test-threads=1 >"$logs/$name.log" 2>&1
    rc=$?
    # The test's own lines (not the ranks' flight-recorder dumps, which are in the log).
    grep -v -e '^{"oxccl_flight_recorder"' -e '^oxccl WARN' "$logs/$name.log" |
        grep -v -e '^running [0-9]* test' -e '^test result' -e '^$' | tail -n 60
    if [ $rc -eq 0 ]; then
        passed+=("$name ($(($(date +%s) - t0)) s)")
    else
        [ $rc -eq 124 ] && echo "== $name: killed at the end of CHAOS_BUDGET ==" >&2
        failed+=("$name (exit $rc, $(($(date +%s) - t0)) s; log: $logs/$name.log)")
    fi
}

step kill-shm chaos kill_a_rank_during_every_collective_shm
step kill-tcp-netns chaos kill_a_rank_during_every_collective_tcp_netns
for i in $(seq 1 "$stop_runs"); do
    step "stop-shm-$i" chaos a_stopped_rank_times_the_others_out_and_fails_when_continued_shm
    step "stop-tcp-$i" chaos a_stopped_rank_times_the_others_out_and_fails_when_continued_tcp
done
step abort-in-process chaos abort_from_another_thread_unblocks_a_blocked_call
step strangers chaos strangers_at_the_store_do_not_disturb_a_running_job
step soak soak soak_random_collectives_shm
step all-to-allv-regression soak all_to_allv_with_one_block_over_the_mailbox_size_shm
step shrink-shm elastic_chaos random_kills_in_shrink_shm
step shrink-tcp-netns elastic_chaos random_kills_in_shrink_tcp_netns
step grow-shm elastic_chaos random_kills_in_grow_shm
step grow-tcp-netns elastic_chaos random_kills_in_grow_tcp_netns
step init-shm init_chaos kill_a_rank_during_init_shm
step init-tcp-netns init_chaos kill_a_rank_during_init_tcp_netns

echo
echo "== kill trials (from $logs/kill-*.log) =="
for f in "$logs"/kill-shm.log "$logs"/kill-tcp-netns.log; do
    [ -f "$f" ] && awk '/kill trials over/ {p = 1; print; next}
        p && !/^(collective|[a-z_]+ +(shm|tcp) +[0-9])/ {p = 0}
        p' "$f"
done
echo
echo "== elastic trials =="
for f in "$logs"/shrink-*.log "$logs"/grow-*.log "$logs"/init-*.log; do
    [ -f "$f" ] && grep -h -e 'trials ended cleanly' "$f"
done
echo
echo "== soak =="
[ -f "$logs/soak.log" ] && grep -e 'seed' -e '  rank [0-9]: ' -e 'calls per kind' "$logs/soak.log" |
    grep -v -e '^{"oxccl_flight_recorder"' -e '^@@' | head -n 8
echo
echo "== $((${#passed[@]})) passed, $((${#failed[@]})) failed, $(($(date +%s) - start)) s =="
for p in "${passed[@]}"; do echo "  ok      $p"; done
for f in "${failed[@]}"; do echo "  FAILED  $f"; done
[ ${#failed[@]} -eq 0 ]
