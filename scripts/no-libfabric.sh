#!/usr/bin/env bash
# Proves that a default build needs no libfabric, on this machine where libfabric is installed
# (CI installs it to build and test the ofi provider): in a private mount namespace, libfabric's
# headers, libraries and pkg-config file are hidden (an overlay whose whiteouts remove them, and
# an empty /usr/include/rdma), checked gone, and then
#   1. the README's first command runs there: `cargo run --release -p oxccl-cli -- perf
#      all_reduce -n 4` (built there, with default features), its results checked;
#   2. `ldd` of that binary shows no libfabric;
#   3. asking that build for ofi fails, saying how to get it (the `ofi` feature, libfabric-dev);
#   4. a build with the ofi feature (target/debug/oxccl, from the test suite's build, when
#      present) still runs there over shm, and asking it for ofi fails, saying to install
#      libfabric.
# Needs root (unshare, mount). Usage: scripts/no-libfabric.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
die() { echo "no-libfabric.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (a private mount namespace hides libfabric)"

if [ "${1:-}" != --inside ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    unshare --mount "$0" --inside "$work"
    exit
fi
work=$2
mount --make-rprivate /
# Whiteouts (character devices 0:0) in an overlay's upper layer hide the lower layer's files.
for dir in $(ls -d /usr/lib/*-linux-gnu /usr/lib /usr/local/lib 2>/dev/null); do
    hide=$(cd "$dir" && ls libfabric* pkgconfig/libfabric.pc 2>/dev/null || true)
    [ -n "$hide" ] || continue
    up="$work/up$(echo "$dir" | tr / _)"
    mkdir -p "$up/pkgconfig" "$up.work"
    for f in $hide; do mknod "$up/$f" c 0 0; done
    mount -t overlay overlay -o "lowerdir=$dir,upperdir=$up,workdir=$up.work" "$dir"
done
[ -d /usr/include/rdma ] && mount -t tmpfs tmpfs /usr/include/rdma
[ -d /usr/local/include/rdma ] && mount -t tmpfs tmpfs /usr/local/include/rdma

echo "== libfabric hidden: checking =="
[ ! -e /usr/include/rdma/fabric.h ] || die "rdma/fabric.h still visible"
left=$(find /usr/lib /usr/local/lib -name 'libfabric*' 2>/dev/null | head -3)
[ -z "$left" ] || die "libfabric files still visible: $left"
! pkg-config --exists libfabric 2>/dev/null || die "pkg-config still finds libfabric"
! python3 -c 'import ctypes; ctypes.CDLL("libfabric.so.1")' 2>/dev/null \
    || die "libfabric.so.1 still loads"
echo "   headers, libraries, .pc file and dlopen: all gone"

echo "== the README's first command, built here =="
export CARGO_TARGET_DIR="$root/target"
log="$work/perf.txt"
cargo run --release -q -p oxccl-cli -- perf all_reduce -n 4 | tee "$log"
grep -q "Out of bounds values : 0 OK" "$log" || die "perf reported wrong results"

echo "== ldd target/release/oxccl =="
if ldd target/release/oxccl | grep -i fabric; then die "the default build links libfabric"; fi
echo "   no libfabric"

want_error() { # what, expected text, command...
    local what=$1 text=$2
    shift 2
    local out rc=0
    out=$("$@" 2>&1) || rc=$?
    [ "$rc" != 0 ] || die "$what: succeeded, expected a failure"
    grep -q -- "$text" <<<"$out" || die "$what: the error does not say '$text': $out"
    echo "   $what: fails, saying \"$(grep -o -m1 -- "[^:]*$text[^;)]*" <<<"$out" | head -1)\""
}
echo "== asking for ofi =="
want_error "default build, OXCCL_PROVIDER=ofi" "libfabric-dev" \
    env OXCCL_PROVIDER=ofi target/release/oxccl perf all_reduce -n 2 -c 1 -e 1K
if [ -x target/debug/oxccl ] && [ "$(nm target/debug/oxccl 2>/dev/null | grep -c oxofi_load)" != 0 ]; then
    target/debug/oxccl perf all_reduce -n 2 -c 1 -e 1M >/dev/null \
        || die "the ofi-feature build fails over shm without libfabric"
    echo "   ofi-feature build over shm: runs"
    want_error "ofi-feature build, OXCCL_PROVIDER=ofi" "install libfabric" \
        env OXCCL_PROVIDER=ofi target/debug/oxccl perf all_reduce -n 2 -c 1 -e 1K
elif [ "${CI:-}" = true ]; then
    die "target/debug/oxccl with the ofi feature is missing (scripts/test.sh builds it)"
fi
echo "no-libfabric.sh: passed"
