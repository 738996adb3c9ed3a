#!/usr/bin/env bash
# A multi-host test bed on this machine: N hosts, each a network namespace with a veth link to a
# bridge, each link shaped in both directions with tc tbf. Brings the bed up, runs COMMAND in
# every host (in parallel, output prefixed with [hI]) or in one host (in the foreground, with the
# terminal), and always tears it down: on success, on failure, on Ctrl-C and on SIGTERM. A run
# killed with SIGKILL leaves the bed behind; the next bed created on the machine deletes it.
#
# The work is done by the oxccl-testbed binary (crates/oxccl-testbed), the same code the Rust
# tests use. Needs root.
#
# Usage:
#   bench/testbed.sh [--rates R,R,..] [--host I] [--mtu M] [--burst-us US] [--queue-us US] \
#                    [--] COMMAND [ARGS..]
#   bench/testbed.sh list | gc
#
#   --rates    one rate per host, in Mbit/s or with a suffix (250m, 1g), or `none` (unshaped);
#              default 1g,1g. Example: --rates 1g,1g,1g,0.25g
#   --host I   run COMMAND only in host I
#   --switch CMD
#              also run CMD (a shell command) in the bridge's namespace, where the switch
#              stands, with the address 10.77.0.254 on the bridge: it sees every host through
#              that host's shaped link, as a switch port does (the aggregation service, `oxccl
#              agg`, runs there). It starts first, output prefixed [sw]; it is stopped once
#              COMMAND ends. Hosts see OXCCL_TESTBED_SWITCH_ADDR=10.77.0.254.
#   --mtu, --burst-us, --queue-us
#              link MTU (default 9000), tbf bucket and queue as time at the link rate
#              (defaults 2000 and 50000 us); see oxccl_testbed::Shaping
#   list       the beds on this machine and whether their owner still runs
#   gc         delete the beds whose owner is gone
#
# COMMAND sees OXCCL_TESTBED_HOST (its index), OXCCL_TESTBED_HOSTS, OXCCL_TESTBED_ADDR (its
# address, 10.77.0.<I+1>), OXCCL_TESTBED_ADDRS (all, comma-separated) and OXCCL_TESTBED_BIN
# (the oxccl-testbed binary, whose tcp-sink/tcp-source measure a link). Example, one TCP stream
# from host 1 to host 0 over a 250 Mbit/s link:
#
#   bench/testbed.sh --rates 1g,250m -- sh -c 'if [ $OXCCL_TESTBED_HOST = 0 ];
#       then $OXCCL_TESTBED_BIN tcp-sink 5000; else $OXCCL_TESTBED_BIN tcp-source 10.77.0.1:5000 3; fi'
#
# Env: OXCCL_TESTBED_BIN=path skips the cargo build and uses that binary.
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -z "${OXCCL_TESTBED_BIN:-}" ]; then
    cargo build --release -q -p oxccl-testbed
    OXCCL_TESTBED_BIN=$PWD/target/release/oxccl-testbed
fi
BIN=$OXCCL_TESTBED_BIN
export OXCCL_TESTBED_BIN

case "${1:-}" in
list) exec "$BIN" list ;;
gc) exec "$BIN" gc ;;
esac

RATES=1g,1g
HOST=
SWITCH=
UP_OPTS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --rates) RATES=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --switch) SWITCH=$2; shift 2 ;;
    --mtu | --burst-us | --queue-us) UP_OPTS+=("$1" "$2"); shift 2 ;;
    --) shift; break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "testbed.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
    esac
done
if [ $# -eq 0 ]; then
    echo "testbed.sh: no command (see --help)" >&2
    exit 2
fi

# Everything this script brings up is owned by this shell's pid: `down --owner $$` removes it
# all, including a bed whose `up` was interrupted before it printed its name.
SWITCH_PID=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$SWITCH_PID" ]; then
        pkill -TERM -P "$SWITCH_PID" 2>/dev/null || true
        kill "$SWITCH_PID" 2>/dev/null || true
    fi
    "$BIN" down --owner $$ || echo "testbed.sh: teardown failed; \`$BIN gc\` retries" >&2
    wait 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

NAME=$("$BIN" up --rates "$RATES" --owner-pid $$ "${UP_OPTS[@]}")
IFS=, read -r -a HOSTS <<<"$RATES"
N=${#HOSTS[@]}
echo "== test bed $NAME: $N hosts, rates $RATES (Mbit/s unless suffixed) ==" >&2

if [ -n "$SWITCH" ]; then
    ip -n "$NAME-br" link set lo up
    ip -n "$NAME-br" addr add 10.77.0.254/24 dev br0
    (ip netns exec "$NAME-br" sh -c "$SWITCH" </dev/null 2>&1 | sed -u "s/^/[sw] /") &
    SWITCH_PID=$!
    export OXCCL_TESTBED_SWITCH_ADDR=10.77.0.254
    sleep 0.5
fi

if [ -n "$HOST" ]; then
    # One host, in the foreground, with this terminal.
    "$BIN" exec "$NAME" "$HOST" -- "$@"
    exit $?
fi

PIDS=()
for ((i = 0; i < N; i++)); do
    ("$BIN" exec "$NAME" "$i" -- "$@" </dev/null 2>&1 | sed -u "s/^/[h$i] /") &
    PIDS+=($!)
done
RC=0
for ((i = 0; i < N; i++)); do
    wait "${PIDS[$i]}" || {
        rc=$?
        echo "testbed.sh: host $i failed (exit $rc)" >&2
        RC=1
    }
done
exit $RC
