#!/usr/bin/env bash
# Builds ddp_ext with AddressSanitizer and UndefinedBehaviorSanitizer and runs
# the reducer, round-robin, fault and sharded ring tests under it.
#
#   tools/sanitized_tests.sh [extra pytest arguments]
#
# The sanitized build lives in a copy of the checkout (build/sanitized/, or
# $SANITIZED_DIR), so the checkout's own in-place build is left alone and a
# second run recompiles only what changed. The sanitizer runtime is preloaded
# into Python, and every process the tests start inherits it. Any sanitizer
# report, from any process, fails the run and is printed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
COPY="${SANITIZED_DIR:-$ROOT/build/sanitized}"
PYTHON="${PYTHON:-python}"

TESTS=(reducer/test_unused_parameters.py reducer/test_static_graph.py reducer/test_no_sync.py
       reducer/test_reducer_lifetime.py reducer/test_hook_lifetime.py wrapper/test_parity_local.py
       wrapper/test_contract_parity.py reducer/test_communication.py reducer/test_buckets.py
       fault_tolerance/test_faults.py diagnosis/test_out_of_step.py reducer/test_gradient_order.py
       reducer/test_rebuild_buckets.py reducer/test_rebuild_buckets_contract.py reducer/test_layer_drop.py
       hooks/test_adaptive_precision.py reducer/test_auto_buckets.py
       sharding/test_ring_reduce_scatter.py sharding/test_ring_order.py
       sharding/test_step_check_on_replicated_bucket0.py)
TESTS+=($(cd "$ROOT/tests" && ls process_groups/test_round_robin_*.py))

# gcc's runtimes; -print-file-name echoes the bare name when it has none.
runtime() { readlink -f "$(gcc -print-file-name="$1")"; }
if [ ! -e "$(runtime libasan.so)" ] || [ ! -e "$(runtime libubsan.so)" ]; then
    echo "installing gcc's sanitizer runtimes (libasan, libubsan)" >&2
    apt-get update -q >&2 && apt-get install -y -q "libgcc-$(gcc -dumpversion | cut -d. -f1)-dev" >&2
fi
ASAN_LIB="$(runtime libasan.so)"
UBSAN_LIB="$(runtime libubsan.so)"

# Copy the checkout's files (tracked, and untracked but not ignored), keeping
# their times so that ninja rebuilds only what changed.
mkdir -p "$COPY"
(cd "$ROOT" && git ls-files -z -co --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -) | tar -xf - -C "$COPY"

start=$(date +%s)
# Without the MPI backend: none of these tests uses it.
(cd "$COPY" && DDP_EXT_NO_MPI=1 DDP_EXT_SANITIZE=1 "$PYTHON" setup.py -q build_ext --inplace >build.log 2>&1) ||
    { tail -50 "$COPY/build.log"; exit 1; }
echo "sanitized build: $(( $(date +%s) - start )) s (log: $COPY/build.log)"

LOGS="$COPY/sanitizer_logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB${LD_PRELOAD:+ $LD_PRELOAD}"
# No leak detection: Python and torch keep allocations alive until exit by
# design, which LeakSanitizer would report by the thousand.
export ASAN_OPTIONS="detect_leaks=0:log_path=$LOGS/asan"
# UBSan's start-up applies its log_path to ASan's reports, hence the same
# name; its own reports go to $LOGS/ubsan.<pid> (tools/sanitizer_site/).
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$LOGS/asan"
export DDP_EXT_UBSAN_LOG_PATH="$LOGS/ubsan"
# The tests' own C++ doubles (tests/support/native_extensions.py), compiled by the
# first test that uses them, get the same sanitizer flags as the build above.
export DDP_EXT_SANITIZE=1
export PYTHONPATH="$ROOT/tools/sanitizer_site${PYTHONPATH:+:$PYTHONPATH}"

cd "$COPY"
# The tests must load this copy's sanitized build, not a JIT build.
"$PYTHON" - "$COPY" <<'PY'
import sys, ddp_ext
so = ddp_ext._C.__file__
assert ddp_ext._C.__name__ == "ddp_ext._C" and so.startswith(sys.argv[1]), so
assert b"libasan" in open(so, "rb").read(), f"{so} is not built with AddressSanitizer"
print(f"testing {so}")
PY
present=()
for t in "${TESTS[@]}"; do [ -e "tests/$t" ] && present+=("tests/$t"); done
start=$(date +%s)
status=0
"$PYTHON" -m pytest "${present[@]}" -q -p no:cacheprovider "$@" || status=$?
echo "sanitized tests: $(( $(date +%s) - start )) s, pytest exit status $status"

reports=("$LOGS"/*)
if [ -e "${reports[0]}" ]; then
    echo "SANITIZER REPORTS (${#reports[@]} files in $LOGS):"
    for r in "${reports[@]}"; do echo "=== $r"; head -60 "$r"; done
    exit 1
fi
echo "no sanitizer reports"
exit "$status"
