#!/usr/bin/env bash
# A one-node Slurm cluster in a private directory, for tests and for trying srun by hand.
#
#   scripts/slurm-local.sh start    configure, start slurmctld and slurmd, wait for the node
#   scripts/slurm-local.sh status   say whether it runs and show sinfo
#   scripts/slurm-local.sh stop     cancel its jobs, stop both daemons, remove the directory
#
# Then: export SLURM_CONF="$OXCCL_SLURM_DIR/slurm.conf" (start prints it) and use srun, sbatch,
# squeue, sinfo as on any cluster.
#
# Environment:
#   OXCCL_SLURM_DIR        the private directory (default ${TMPDIR:-/tmp}/oxccl-slurm-$UID):
#                          slurm.conf, state, spool, logs and pid files; removed by `stop`
#   OXCCL_SLURM_PORT       the controller's port; slurmd takes the next one (default: the
#                          first free pair from 16817)
#   OXCCL_SLURM_WAIT       seconds `start` waits for the node to be idle (default 30)
#   OXCCL_SLURM_KEEP=1     `stop` keeps the directory (logs) instead of removing it
#   OXCCL_SLURM_FIRST_JOB_ID  the first job's id (default: random below 10^6, so that two
#                          clusters on one machine do not number their jobs alike, and
#                          programs that derive a port from the job id get different ones)
#
# The node is this host, under its real short hostname, with the CPU layout `slurmd -C`
# reads, reached over 127.0.0.1; no munge (AuthType=auth/none and CredType=cred/none, which
# Slurm 22.05 still ships), no cgroups (proctrack/linuxproc, task/none), no accounting. The
# partition lets a step run more tasks than there are CPUs when asked with `srun
# --overcommit` (`srun -O -n 4` on 2 cores). Needs root (slurmd starts tasks as the user who
# submitted them) and Debian's slurmctld, slurmd and slurm-client.
set -euo pipefail

dir=${OXCCL_SLURM_DIR:-${TMPDIR:-/tmp}/oxccl-slurm-$(id -u)}
conf=$dir/slurm.conf
wait_s=${OXCCL_SLURM_WAIT:-30}

die() {
    echo "slurm-local: $*" >&2
    exit 1
}

# The pid in a pid file, if that process is alive.
alive_pid() {
    local f=$1 pid
    [ -s "$f" ] || return 1
    pid=$(cat "$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

port_free() {
    # Nothing listens there (a refused connection). /dev/tcp is bash's own.
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

show_logs() {
    for f in "$dir"/slurmctld.log "$dir"/slurmd.log; do
        [ -f "$f" ] && { echo "--- last lines of $f:" >&2; tail -n 20 "$f" >&2; }
    done
    return 0
}

# Processes started by our slurmd (slurmstepd) carry our SLURM_CONF in their environment.
our_stepds() {
    local pid
    for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
        if { tr '\0' '\n' <"/proc/$pid/environ" | grep -qxF "SLURM_CONF=$conf"; } 2>/dev/null; then
            echo "$pid"
        fi
    done
}

# Stops processes by pid ("name:pid" pairs): SIGTERM to all, then SIGKILL to any that is
# still there after 10 s.
stop_pids() {
    local p i left
    for p in "$@"; do kill -TERM "${p#*:}" 2>/dev/null || true; done
    for i in $(seq 1 100); do
        left=""
        for p in "$@"; do kill -0 "${p#*:}" 2>/dev/null && left="$left $p"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    for p in $left; do
        echo "slurm-local: ${p%%:*} (pid ${p#*:}) ignored SIGTERM for 10 s; sending SIGKILL" >&2
        kill -KILL "${p#*:}" 2>/dev/null || true
    done
}

start() {
    [ "$(id -u)" = 0 ] || die "needs root (slurmd runs tasks as their submitting user)"
    local b
    for b in slurmctld slurmd srun sinfo scontrol; do
        command -v "$b" >/dev/null 2>&1 || die "$b not found: apt-get install slurmctld slurmd slurm-client"
    done
    if alive_pid "$dir/slurmctld.pid" >/dev/null || alive_pid "$dir/slurmd.pid" >/dev/null; then
        die "already running in $dir (scripts/slurm-local.sh stop first)"
    fi
    rm -rf "$dir"
    mkdir -p "$dir/state" "$dir/spool"
    chmod 700 "$dir"

    local port=${OXCCL_SLURM_PORT:-}
    if [ -z "$port" ]; then
        port=16817
        while ! { port_free "$port" && port_free $((port + 1)); }; do
            port=$((port + 2))
            [ "$port" -lt 16917 ] || die "no free pair of ports in 16817-16916 (set OXCCL_SLURM_PORT)"
        done
    fi
    local host hw
    host=$(hostname -s)
    # "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=..."
    hw=$(slurmd -C | head -n 1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ RealMemory=[0-9]*//')
    [[ $hw == CPUs=* ]] || die "cannot read this host's CPUs from \`slurmd -C\`: $hw"
    local first_job=${OXCCL_SLURM_FIRST_JOB_ID:-$(((RANDOM << 15 | RANDOM) % 1000000 + 1))}

    cat >"$conf" <<EOF
# Written by scripts/slurm-local.sh: a one-node cluster in $dir.
ClusterName=oxccl-local
FirstJobId=$first_job
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=10
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host $hw State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    export SLURM_CONF=$conf
    # -i: ignore state left by an earlier cluster (there is none: the directory is new).
    slurmctld -f "$conf" -i || { show_logs; die "slurmctld did not start"; }
    slurmd -f "$conf" || { show_logs; die "slurmd did not start"; }

    local deadline=$((SECONDS + wait_s)) state=""
    while :; do
        state=$(timeout 3 sinfo -h -N -n "$host" -o '%T' 2>/dev/null || true)
        [ "$state" = idle ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            show_logs
            stop_daemons
            die "node $host not idle within ${wait_s}s (state: ${state:-no answer from slurmctld on port $port}); logs above"
        fi
        sleep 0.2
    done
    echo "slurm-local: node $host idle ($hw); export SLURM_CONF=$conf"
}

stop_daemons() {
    local pid i pids=()
    if alive_pid "$dir/slurmctld.pid" >/dev/null; then
        scancel --full --quiet --partition=local 2>/dev/null || true
    fi
    # Steps still running: give them a moment to go, then end what our slurmd started.
    for i in $(seq 1 50); do
        [ -z "$(our_stepds)" ] && break
        sleep 0.1
    done
    for pid in $(our_stepds); do pids+=("slurmstepd:$pid"); done
    if pid=$(alive_pid "$dir/slurmd.pid"); then pids+=("slurmd:$pid"); fi
    if pid=$(alive_pid "$dir/slurmctld.pid"); then pids+=("slurmctld:$pid"); fi
    [ ${#pids[@]} -eq 0 ] || stop_pids "${pids[@]}"
}

stop() {
    [ -d "$dir" ] || { echo "slurm-local: not running ($dir does not exist)"; return 0; }
    export SLURM_CONF=$conf
    stop_daemons
    if [ "${OXCCL_SLURM_KEEP:-0}" = 1 ]; then
        echo "slurm-local: stopped; kept $dir"
    else
        rm -rf "$dir"
        echo "slurm-local: stopped; removed $dir"
    fi
}

status() {
    local c d
    c=$(alive_pid "$dir/slurmctld.pid" || true)
    d=$(alive_pid "$dir/slurmd.pid" || true)
    echo "slurm-local: $dir: slurmctld ${c:+pid }${c:-not running}, slurmd ${d:+pid }${d:-not running}"
    if [ -n "$c" ]; then
        SLURM_CONF=$conf sinfo -N -l || true
    fi
    [ -n "$c" ] && [ -n "$d" ]
}

case ${1:-} in
start) start ;;
stop) stop ;;
status) status ;;
*) die "usage: $0 start|stop|status" ;;
esac
