#!/usr/bin/env bash
# The disk tier's read bandwidth against fio, O_DIRECT on both sides, in one run.
#
# For each thread count T: rounds of (a) `disk_read_bw` (crates/oxccl-kv/examples), which writes a
# SIZE file through DiskTier (O_DIRECT required, preallocated) and reads it back PASSES times in
# 64 MiB calls that the tier splits into 1 MiB preads on T threads (the caller + T-1 workers), and
# (b) fio reading the same file with --direct=1 --ioengine=psync --bs=1M --numjobs=T (each job a
# contiguous SIZE/T slice, so T 1 MiB preads in flight, like the tier). Per T it prints the median
# and the best over all passes of each side, and their ratios. The page cache is not measured: both
# sides use O_DIRECT (the example refuses to run without it).
#
# usage: bench/kv-disk.sh [DIR] [SIZE_MIB] [ROUNDS] [THREADS...]
#   DIR: a directory on a disk file system (not tmpfs; default /var/tmp); SIZE_MIB default 1024;
#   ROUNDS default 6; THREADS: thread counts (default 1 2 4 8 4u); a trailing u reads into a buffer
#   one byte off a page boundary, so that every chunk goes through the tier's bounce buffers
#   (fio: unchanged)
# env: OUT=bench/results/kv-disk.txt (where the output is also saved), PASSES=2 (per side per round)
# The disk here is a shared virtual one whose bandwidth swings 2x from second to second: the
# sides alternate every few seconds and the medians over all passes are the figures to compare.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-/var/tmp}
SIZE_MIB=${2:-1024}
ROUNDS=${3:-6}
shift $(( $# < 3 ? $# : 3 ))
THREADS=("$@")
[ ${#THREADS[@]} -gt 0 ] || THREADS=(1 2 4 8 4u)
PASSES=${PASSES:-2}
OUT=${OUT:-bench/results/kv-disk.txt}
FILE="$DIR/oxccl-kv-disk-bench.$$.dat"
trap 'rm -f "$FILE"' EXIT

command -v fio >/dev/null || { echo "fio is not installed" >&2; exit 1; }
fstype=$(df --output=fstype "$DIR" | tail -1)
case "$fstype" in tmpfs|ramfs) echo "$DIR is $fstype, not a disk" >&2; exit 1 ;; esac

cargo build --release -q -p oxccl-kv --example disk_read_bw
BIN=target/release/examples/disk_read_bw

mkdir -p "$(dirname "$OUT")"
{
echo "# bench/kv-disk.sh $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "# cpu: $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) vCPUs), kernel $(uname -r)"
echo "# file system: $DIR on $(df --output=source "$DIR" | tail -1) ($fstype); file $SIZE_MIB MiB; $(fio --version)"
dev=$(basename "$(df --output=source "$DIR" | tail -1)")
[ -r "/sys/block/$dev/queue/rotational" ] && echo "# /sys/block/$dev: rotational=$(cat /sys/block/$dev/queue/rotational) nr_requests=$(cat /sys/block/$dev/queue/nr_requests) max_sectors_kb=$(cat /sys/block/$dev/queue/max_sectors_kb)"
echo "# GB/s = 10^9 bytes/s. A pass reads the whole file; $PASSES passes per side per round, sides alternating."
echo

summary=()
for cfg in "${THREADS[@]}"; do
  t=${cfg%u}; extra=(); label="threads=$t"
  [ "$t" = "$cfg" ] || { extra=(--unaligned); label="threads=$t unaligned"; }
  ox=(); fi=()
  for r in $(seq 1 "$ROUNDS"); do
    out=$("$BIN" --file "$FILE" --size "${SIZE_MIB}M" --threads "$t" --chunk 1M --op 64M --passes "$PASSES" --keep "${extra[@]}" | tee /dev/stderr)
    ox+=($(sed -n 's/^oxccl-disk read pass [0-9]*: \([0-9.]*\) GB.*/\1/p' <<<"$out"))
    per=$(( SIZE_MIB / t ))
    all=()
    for p in $(seq 1 "$PASSES"); do
      terse=$(fio --name=kvdisk --filename="$FILE" --direct=1 --ioengine=psync --rw=read --bs=1M \
          --numjobs="$t" --size="${per}M" --offset_increment="${per}M" --group_reporting --minimal)
      # terse v3: field 7 is the read bandwidth in KiB/s.
      all+=("$(awk -F';' '{printf "%.3f", $7 * 1024 / 1e9}' <<<"$terse")")
    done
    echo "fio numjobs=$t round $r: passes ${all[*]} GB/s (bs=1M psync direct=1)" >&2
    fi+=("${all[@]}")
  done
  med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  best() { printf '%s\n' "$@" | sort -g | tail -1; }
  mo=$(med "${ox[@]}"); mf=$(med "${fi[@]}")
  ratio=$(awk -v a="$mo" -v b="$mf" 'BEGIN {printf "%.2f", a / b}')
  bratio=$(awk -v a="$(best "${ox[@]}")" -v b="$(best "${fi[@]}")" 'BEGIN {printf "%.2f", a / b}')
  s="$label: median DiskTier ${mo} GB/s, fio ${mf} GB/s, ratio ${ratio}; best $(best "${ox[@]}") vs $(best "${fi[@]}"), ratio ${bratio} (${#ox[@]} and ${#fi[@]} passes)"
  echo "$s" >&2
  summary+=("$s")
done
echo
echo "# summary: median and best over all passes ($ROUNDS rounds x $PASSES)"
printf '%s\n' "${summary[@]}"
} 2>&1 | tee "$OUT"
