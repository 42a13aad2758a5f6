#!/usr/bin/env bash
# Runs weft's cargo-fuzz targets one after another and prints a summary.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 20 s, every target)
#   RUNS=10000000 scripts/fuzz.sh 0 frame_decode         (a fixed number of inputs instead)
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). The kept corpora
# in fuzz/corpus/<target>/ are read, never written: inputs found during the run go to
# fuzz/scratch/<target>/ (to fold them into the kept corpus, see docs/fuzzing.md).
# Crashes and hangs are written to fuzz/artifacts/<target>/ and make the script exit 1.
# Per-target logs: fuzz/logs/<target>.log. Progress: libFuzzer's status lines on stderr.
# Environment: RUNS (inputs per target), TIMEOUT (seconds for one input, default 10),
# SANITIZER (address, the default, or none: 2-10x faster; the targets are safe Rust, so long
# runs use none and keep overflow checks and debug assertions, which are always on),
# NICE (niceness, default 10). Targets run one at a time, on purpose (shared cores).
set -euo pipefail

cd "$(dirname "$0")/.."
secs=${1:-20}
shift || true
all=(frame_decode handshake log_scan shm_ring group_msg)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=("${all[@]}"); fi
timeout=${TIMEOUT:-10}
niceness=${NICE:-10}
san=${SANITIZER:-address}

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: needs 'cargo +nightly fuzz' (rustup toolchain install nightly; cargo install cargo-fuzz)" >&2
    exit 2
fi

echo "fuzz.sh: building the targets (release, debug assertions on, sanitizer $san)" >&2
nice -n "$niceness" cargo +nightly fuzz build -O -a -s "$san" >&2

mkdir -p fuzz/logs
status=0
summary=()
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/scratch/$t" "fuzz/artifacts/$t"
    if [ -n "${RUNS:-}" ]; then
        limit=(-runs="$RUNS")
        what="$RUNS inputs"
    else
        limit=(-max_total_time="$secs")
        what="$secs s"
    fi
    echo "fuzz.sh: $t for $what" >&2
    log="fuzz/logs/$t.log"
    set +e
    nice -n "$niceness" cargo +nightly fuzz run -O -a -s "$san" "$t" "fuzz/scratch/$t" "fuzz/corpus/$t" -- \
        "${limit[@]}" -timeout="$timeout" -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -print_final_stats=1 -print_pcs=0 2>&1 | tee "$log" | grep --line-buffered -E '^#[0-9]+.*(pulse|DONE)|^==|ERROR|panicked|Done ' >&2
    rc=${PIPESTATUS[0]}
    set -e
    execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    took=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | tail -1 | grep -o 'in [0-9]*' | grep -o '[0-9]*' || true)
    # One artifact per failing input: crash-* (panic, signal), oom-*, timeout-* (a hang).
    crashes=$(grep -c -E 'Test unit written to .*/(crash|oom)-' "$log" || true)
    hangs=$(grep -c -E 'Test unit written to .*/timeout-' "$log" || true)
    if [ "$rc" -ne 0 ]; then
        status=1
        result="FAILED (exit $rc; see $log and fuzz/artifacts/$t/)"
    else
        result=ok
    fi
    summary+=("$(printf '%-13s execs=%-10s seconds=%-6s crashes=%s hangs=%s %s' "$t" "${execs:-?}" "${took:-?}" "$crashes" "$hangs" "$result")")
done

echo
echo "fuzz.sh summary:"
printf '  %s\n' "${summary[@]}"
exit $status
