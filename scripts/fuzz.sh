#!/usr/bin/env bash
# Bounded fuzzing of oxccl's pure wire decoders and schedule builder with cargo-fuzz (libFuzzer):
#   tcp_frame       crates/oxccl-verbs/src/tcp/frame.rs (Header::decode, decode_hello)
#   bootstrap_wire  crates/oxccl-bootstrap/src/wire.rs  (wire::decode)
#   seal_stream     crates/oxccl-seal (records): a sealed stream changed on the way (flipped,
#                   dropped, replayed, swapped, cut) reads as a prefix of what was sent, then an error
#   schedule        crates/oxccl-core/src/schedule/ (build) against the reference executor
#                   crates/oxccl-core/src/verify.rs (every rank's schedule run together); the input
#                   format and the checks are in fuzz/src/schedule.rs
#
#   scripts/fuzz.sh [SECONDS]     # each target for SECONDS (default 60), one after the other
#
# Each target starts from its committed seed corpus (fuzz/corpus-seed/<target>/), copied into a
# fresh scratch corpus (fuzz/corpus-run/<target>/, gitignored) that libFuzzer grows. Exits non-zero
# if any target finds a crash, a timeout or an out-of-memory input, printing the artifact's path
# (under fuzz/artifacts/<target>/) and how to replay it. Regenerate the seeds with
#   cargo run --manifest-path fuzz/Cargo.toml --example seed_corpus
#
# Builds carry debug assertions and overflow checks (cargo fuzz -a). After each target, one row
# is appended to the ledger of executions, fuzz/HISTORY.tsv (date, commit, target, seconds,
# executions, exec/s, sanitizer, result ok/FINDING); scripts/fuzz-totals.sh sums it per target.
#
# Knobs: FUZZ_SANITIZER=address|none (default address), FUZZ_TARGETS="tcp_frame ..." (default
# all four), FUZZ_LEDGER=path (default fuzz/HISTORY.tsv; empty: no row).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

secs=${1:-60}
if ! [[ $secs =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
    echo "usage: $0 [SECONDS]   (SECONDS >= 1, per target)" >&2
    exit 2
fi
read -r -a targets <<<"${FUZZ_TARGETS:-tcp_frame bootstrap_wire seal_stream schedule}"
ledger=${FUZZ_LEDGER-fuzz/HISTORY.tsv}
sanitizer=${FUZZ_SANITIZER:-address}

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz =="
    cargo install cargo-fuzz --locked
fi
cargo fuzz --version

# Only a stable toolchain is assumed. cargo-fuzz's coverage instrumentation (-Cpasses=sancov-module,
# -Cllvm-args=...) works on stable, but its default AddressSanitizer needs `-Zsanitizer=address`,
# a nightly-only flag. RUSTC_BOOTSTRAP=1 lets the stable compiler accept it (stable rustup
# toolchains ship the ASan runtime), and cargo-fuzz honours it. ASan matters little for these
# safe-Rust decoders' memory safety, but its allocator hooks are what make libFuzzer's
# -malloc_limit_mb (64 below) catch one oversized allocation driven by a small input: the
# decoders must never reserve more than the input can hold, and with inputs of at most 8 KiB
# nothing legitimate comes near 64 MiB. Without ASan that check is off (only the 2 GiB RSS limit
# remains) but runs are ~4x faster. If the ASan build fails anyway, we fall back to
# `--sanitizer none` (plain stable, coverage-guided) and say so.
export RUSTC_BOOTSTRAP=1
# Cargo caches rustc's target probe (target/.rustc_info.json) without RUSTC_BOOTSTRAP in the key:
# one earlier `cargo fuzz` run without it caches the "-Z is nightly-only" failure for good.
export CARGO_CACHE_RUSTC_INFO=0

echo "== building fuzz targets (sanitizer: $sanitizer) =="
build_start=$(date +%s)
for t in "${targets[@]}"; do
    if ! cargo fuzz build -a -s "$sanitizer" "$t"; then
        if [ "$sanitizer" = none ]; then
            echo "error: cargo fuzz build $t failed" >&2
            exit 1
        fi
        echo "warning: the $sanitizer-sanitizer build failed on this toolchain;" \
            "falling back to --sanitizer none (coverage-guided, no ASan)" >&2
        sanitizer=none
        cargo fuzz build -a -s none "$t"
    fi
done
echo "built in $(($(date +%s) - build_start)) s"

status=0
summary=()
mkdir -p fuzz/corpus-run
for t in "${targets[@]}"; do
    corpus=fuzz/corpus-run/$t
    rm -rf "$corpus"
    cp -r "fuzz/corpus-seed/$t" "$corpus"
    log=fuzz/corpus-run/$t.log
    echo "== fuzzing $t for ${secs} s (corpus $corpus, log $log) =="
    set +e
    # -timeout: an input that takes 10 s is a finding (a hang); -max_len: inputs up to 8 KiB
    # (room for keys at the 4 KiB cap); -malloc_limit_mb: see above.
    cargo fuzz run -a -s "$sanitizer" "$t" "$corpus" -- \
        -max_total_time="$secs" -timeout=10 -max_len=8192 -malloc_limit_mb=64 -print_final_stats=1 2>&1 \
        | tee "$log" | grep -E '^(INFO: seed|#[0-9]+[[:space:]]+(INITED|DONE)|Done |==[0-9]+==|.*panicked|.*Test unit written|SUMMARY)'
    rc=${PIPESTATUS[0]}
    set -e
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    added=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    line="$t: ${runs:-?} runs, ${rate:-?} exec/s, coverage ${cov:-?} edges, ${added:-?} new inputs, sanitizer $sanitizer"
    if [ "$rc" -ne 0 ]; then
        status=1
        artifacts=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log")
        line="$line -- FOUND A PROBLEM (exit $rc): ${artifacts:-no artifact written, see $log}"
        for a in $artifacts; do
            echo "artifact: $a"
            echo "  bytes: $(od -An -tx1 -v "$a" | tr -d ' \n' | head -c 2048)"
            echo "  replay: RUSTC_BOOTSTRAP=1 CARGO_CACHE_RUSTC_INFO=0 cargo fuzz run -a -s $sanitizer $t $a"
            echo "  minimize: RUSTC_BOOTSTRAP=1 CARGO_CACHE_RUSTC_INFO=0 cargo fuzz tmin -a -s $sanitizer $t $a"
        done
    fi
    if [ -n "$ledger" ]; then
        took=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
        [ -f "$ledger" ] || printf 'date\tcommit\ttarget\tseconds\texecutions\texec_per_s\tsanitizer\tresult\n' >"$ledger"
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
            "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$t" "${took:-$secs}" \
            "${runs:-0}" "${rate:-0}" "$sanitizer" "$([ "$rc" -eq 0 ] && echo ok || echo FINDING)" >>"$ledger"
    fi
    summary+=("$line")
done

echo "== summary (${secs} s per target) =="
printf '%s\n' "${summary[@]}"
if [ "$status" -ne 0 ]; then
    echo "fuzzing found a problem: see the artifacts above" >&2
fi
exit "$status"
