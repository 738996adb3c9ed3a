#!/usr/bin/env bash
# The wheel, end to end: builds it with `pip wheel ./python` (maturin as the PEP 517 backend,
# release profile, in the workspace's target/, so an earlier `maturin develop --release` or
# wheel build is reused), installs it into a fresh venv with cargo off the PATH, and runs a
# multi-process smoke test through the installed package only: `oxccl run -n 2 python -c ...`
# (an all-reduce through oxccl.Communicator.from_env(), checked) and `oxccl perf all_reduce
# -n 2 -c 1` (ranks re-executed through the console script's Python, results checked).
# Prints the wheel's size, the build and install times, and the manylinux tag.
#
# The builder is the venv of scripts/python-env.sh (it has maturin): no download at build
# time (--no-build-isolation). The wheel lands in ${OXCCL_WHEEL_DIR:-target/wheels}. It is
# built for ${OXCCL_WHEEL_COMPAT:-manylinux_2_34} (python/pyproject.toml's compatibility,
# which a PEP 517 build does not apply by itself): maturin checks the glibc symbol versions
# and that nothing outside the manylinux set is linked; `off` builds a linux_x86_64 wheel.
# Under CI=true a missing prerequisite fails; otherwise it skips with the reason.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python="${OXCCL_PYTHON:-python3}"
out="${OXCCL_WHEEL_DIR:-$root/target/wheels}"
compat="${OXCCL_WHEEL_COMPAT:-manylinux_2_34}"

die() { echo "wheel-test.sh: $*" >&2; exit 1; }
skip() {
    [ "${CI:-}" = true ] && die "$* (CI=true: not skipping)"
    echo "wheel-test.sh: skipped: $*" >&2
    exit 0
}
command -v cargo >/dev/null || skip "no cargo on PATH to build the wheel"
command -v "$python" >/dev/null || skip "no Python interpreter '$python' (set OXCCL_PYTHON)"
"$python" -c 'import venv, ensurepip' 2>/dev/null \
    || skip "$python lacks the venv/ensurepip modules (Debian: apt-get install python3-venv)"

venv=$(scripts/python-env.sh)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/oxccl-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "== building the wheel (pip wheel ./python, $compat) =="
mkdir -p "$out"
rm -f "$out"/oxccl-*.whl
start=$(date +%s)
# (maturin's PEP 517 backend runs the maturin on the PATH.)
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip wheel --no-build-isolation --no-deps -q \
    -C maturin.build-args="--compatibility $compat" -w "$out" ./python \
    || die "pip wheel ./python failed (for $compat: see maturin's compliance check above)"
build_s=$(($(date +%s) - start))
wheels=("$out"/oxccl-*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || die "expected one oxccl wheel in $out"
wheel=${wheels[0]}
case "$compat,$(basename "$wheel")" in
off,* | *"${compat#manylinux_}"*) ;;
*) die "$(basename "$wheel") does not declare $compat" ;;
esac
echo "   $(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB, built in ${build_s} s"

# The machine without cargo: every directory holding cargo or rustc leaves the PATH.
clean_path=$(tr ':' '\n' <<<"$PATH" | while read -r d; do
    [ -n "$d" ] && [ ! -e "$d/cargo" ] && [ ! -e "$d/rustc" ] && echo "$d"
done | paste -sd: -)
echo "== installing it into a fresh venv, without cargo =="
"$python" -m venv "$tmp/venv" || die "$python -m venv failed"
export PATH="$tmp/venv/bin:$clean_path"
export VIRTUAL_ENV="$tmp/venv"
unset PYTHONPATH CARGO_HOME RUSTUP_HOME
if command -v cargo >/dev/null || command -v rustc >/dev/null; then
    die "cargo or rustc is still on the PATH of the install test: $(command -v cargo rustc)"
fi
start=$(date +%s%N)
python -m pip install -q --no-index "$wheel" || die "pip install $(basename "$wheel") failed"
install_ms=$((($(date +%s%N) - start) / 1000000))
install_s=$((install_ms / 1000)).$(printf %03d $((install_ms % 1000)))
echo "   installed in ${install_s} s"
command -v oxccl >/dev/null || die "the wheel installed no oxccl console script"
ext=$(python -c 'import oxccl._oxccl as m; print(m.__file__)')
case "$ext" in "$tmp"/venv/*) ;; *) die "oxccl was imported from $ext, not the fresh venv" ;; esac
if ldd "$ext" | grep -q 'not found'; then
    ldd "$ext" >&2
    die "the installed extension has unresolved libraries"
fi
echo "   extension links: $(ldd "$ext" | awk '{print $1}' | grep -v '^/' | paste -sd' ' -)"

cd "$tmp"
echo "== oxccl --version; oxccl run -n 2 python -c <all_reduce> =="
oxccl --version
oxccl run -n 2 --timeout 120 python -c '
import array, os, oxccl
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with oxccl.Communicator.from_env() as comm:
    assert (comm.rank, comm.world_size) == (rank, n), (comm.rank, comm.world_size)
    x = array.array("f", [float(rank + 1)] * 100_000)
    comm.all_reduce(x)
    want = n * (n + 1) / 2
    assert all(v == want for v in x), (rank, x[:4], want)
    print(f"rank {rank} of {n}: all_reduce of 100000 floats = {want}: ok", flush=True)
' || die "the all-reduce under oxccl run failed"
echo "== oxccl perf all_reduce -n 2 -c 1 =="
timeout 300 oxccl perf all_reduce -n 2 -c 1 -b 8 -e 4M -f 8 -w 1 -i 3 \
    || die "oxccl perf all_reduce failed"
echo "wheel-test.sh: ok: $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB; build ${build_s} s; install ${install_s} s)"
