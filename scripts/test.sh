#!/usr/bin/env bash
# Every test: the Rust workspace's (unit, cross-process, namespace, launcher tests), then the
# Python package's (pytest, in the cached venv that scripts/python-env.sh keeps under
# $HOME/.cache). The README's test command; CI runs it after fmt and clippy (.ci/run).
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p oxccl-verbs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# A hung test must fail the run with its name, not eat CI's whole budget: the tests run under
# a bound (builds first, unbounded), and cargo's harness names a test running past 60 s.
bounded() {
    local secs=$1
    shift
    local rc=0
    timeout -k 30 "$secs" "$@" || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "scripts/test.sh: '$*' did not finish within ${secs} s (a hung test: see the" \
            "\"has been running for over 60 seconds\" lines above)" >&2
    fi
    return "$rc"
}
# What the suite leaves in /dev/shm is checked at the end: nothing new may stay.
shm_before=$(ls /dev/shm 2>/dev/null | sort)
# The ofi provider (libfabric) is an opt-in feature: built and tested where libfabric's
# headers are installed, and always under CI=true (where their absence fails the build).
features=()
if [ "${CI:-}" = true ] || [ -e /usr/include/rdma/fabric.h ] \
    || pkg-config --exists libfabric 2>/dev/null; then
    features=(--features oxccl-verbs/ofi)
else
    echo "scripts/test.sh: the ofi provider is not built or tested: libfabric's headers are" \
        "not installed (Debian: apt-get install libfabric-dev)"
fi
echo "== cargo test --workspace ${features[*]} =="
cargo test --workspace "${features[@]}" --no-run "$@"
# The C API test builds liboxccl.so and `oxccl` with the test build's features, so that it
# compiles nothing but liboxccl.so again (crates/oxccl-c/tests/c_api.rs, WORKSPACE_TEST_FEATURES):
# checked here, where the features are the workspace's (extra arguments may change them).
fresh=0
if [ $# -eq 0 ]; then
    fresh=1
fi
OXCCL_C_API_EXPECT_FRESH=$fresh bounded 1500 cargo test --workspace "${features[@]}" "$@"
# The tcp provider again with three connections per queue pair (OXCCL_TCP_NSOCKS): WRITEs of
# 256 KiB and more are then striped, and the suites check that nothing else changes. Selected
# from the workspace (--workspace, not -p oxccl-verbs), so that the features resolve as above and
# the test binaries already built are run, not rebuilt.
echo "== tcp provider suites with striping (OXCCL_TCP_NSOCKS=3) =="
OXCCL_TCP_NSOCKS=3 bounded 600 cargo test --workspace "${features[@]}" \
    --test conformance --test properties --test hammer tcp
echo "== Python tests (scripts/python-test.sh) =="
scripts/python-test.sh
echo "== the wheel, installed without cargo (scripts/wheel-test.sh) =="
scripts/wheel-test.sh
echo "== /dev/shm as the suite found it =="
left=$(comm -13 <(echo "$shm_before") <(ls /dev/shm 2>/dev/null | sort))
if [ -n "$left" ]; then
    echo "scripts/test.sh: the tests left these in /dev/shm (or another process made them" \
        "meanwhile):" $left >&2
    exit 1
fi
echo "   nothing new left"
