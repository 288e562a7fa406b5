#!/usr/bin/env bash
# Builds ddp_ext against other builds of torch, each in a virtual environment
# of its own, and runs tests against each (docs/VERSIONS.md):
#
#   tools/torch_builds.sh                 # every entry of BUILDS below
#   tools/torch_builds.sh 2.11.0:parity   # chosen entries, VERSION:TESTS
#
# TESTS is `all` (the whole test suite), `parity` (the parity and contract
# tests, and the checks of Gloo's ring order below) or `parity-without-ring`
# (the parity and contract tests alone: for the release the test command runs
# too, as in CI, whose run of the whole suite checks that release's Gloo).
# Every entry also runs tests/wrapper/test_cuda.py: without a GPU it must be
# skipped, with its reason; with one, it runs.
#
# torch comes from PyPI with `pip --isolated`, which ignores any pip
# configuration, so each version is the CUDA build GPU users install (no GPU
# is needed to build or import it). Each environment and a copy of the
# checkout, where ddp_ext is built in place, live in
# $TORCH_BUILDS_DIR/torch-VERSION (default: a folder under /tmp). The
# checkout's own in-place build is left alone. A second run reuses an
# environment whose install finished, and rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${TORCH_BUILDS_DIR:-${TMPDIR:-/tmp}/ddp_ext_torch_builds}"
PYTHON="${PYTHON:-python}"

# 2.13.0: the newest release, whole suite.
# 2.11.0: the version on the GPU machine we test on.
# 2.10.0: the oldest release pyproject.toml accepts (`torch>=2.10`); 2.8 does not build.
BUILDS=(2.13.0:all 2.11.0:parity 2.10.0:parity)
[ "$#" -gt 0 ] && BUILDS=("$@")

PARITY_TESTS=(tests/wrapper/test_parity_local.py tests/wrapper/test_parity_torch_ddp.py tests/wrapper/test_contract_parity.py)
# The carrier's test: at 3 ranks and more, the step check rides on bucket 0
# in a layout that depends on how this torch's Gloo cuts a buffer into ring
# segments (Note [Gloo's ring chunks]); each version checks it keeps the sums.
# Likewise the sharded reduce-scatter sums in Gloo's ring order (Note
# [Ring-ordered sum]), checked bitwise against torch's DDP at 3 to 5 ranks,
# in float32 and float64, each world size on fresh ranks of its own.
RING_TESTS=("tests/reducer/test_step_check_on_bucket0.py::test_the_carrier_keeps_the_order_of_the_sums"
            "tests/sharding/test_ring_order.py::test_the_shards_sum_is_torch_ddps_allreduce_bit_for_bit")

# Runs a command, printing what it does and how long it took.
step() {
    local what="$1" start=$SECONDS
    shift
    echo "== torch $VERSION: $what"
    "$@"
    echo "== torch $VERSION: $what: $((SECONDS - start)) s"
}

# The test extra's requirements (pyproject.toml), so the list lives in one place.
test_requirements() {
    "$PYTHON" -c 'import sys
try:
    import tomllib
except ImportError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib
print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["test"], sep="\n")' \
        "$ROOT/pyproject.toml"
}

install() {
    local venv="$1" tests="$2" requirements=(numpy pytest ninja)
    [ "$tests" = all ] && mapfile -t -O 3 requirements < <(test_requirements)
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    # torch==VERSION in every install, so no other requirement can move it.
    "$venv/bin/python" -m pip --isolated install -q --no-cache-dir --disable-pip-version-check \
        "torch==$VERSION" "${requirements[@]}"
    "$venv/bin/python" -c 'import sys, torch
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()}")' "$VERSION"
    echo "$tests" >"$venv/.installed"
}

# Copies the checkout's files (tracked, and untracked but not ignored) with
# their times, so that ninja rebuilds only what changed, and builds in place.
build() {
    local src="$1" python="$2"
    mkdir -p "$src"
    (cd "$ROOT" && git ls-files -z -co --exclude-standard |
        while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
        tar --null -T - -cf -) | tar -xf - -C "$src"
    (cd "$src" && "$python" setup.py -q build_ext --inplace >build.log 2>&1) ||
        { tail -50 "$src/build.log"; return 1; }
    # The tests must load this copy's build, not a JIT build nor another checkout's.
    (cd "$src" && PYTHONPATH="$src" "$python" -c 'import os, sys, ddp_ext
so = os.path.realpath(ddp_ext._C.__file__)
assert ddp_ext._C.__name__ == "ddp_ext._C" and so.startswith(os.path.realpath(sys.argv[1])), so
print(f"built {so}")' "$src")
}

# tests/wrapper/test_cuda.py: skipped with its reason where there is no GPU (the
# whole module is skipped, so pytest collects nothing and exits with 5).
cuda_tests() {
    local python="$1" out status=0
    out="$("$python" -m pytest tests/wrapper/test_cuda.py -q -rs -p no:cacheprovider 2>&1)" || status=$?
    echo "$out"
    if [ "$("$python" -c 'import torch; print(torch.cuda.is_available())')" = False ]; then
        grep -q "^SKIPPED .*test_cuda.py" <<<"$out" || { echo "tests/wrapper/test_cuda.py was not skipped"; return 1; }
        [ "$status" = 5 ] && status=0
    fi
    return "$status"
}

total=$SECONDS
for entry in "${BUILDS[@]}"; do
    VERSION="${entry%%:*}"
    tests="${entry#*:}"
    case "$tests" in all) selected=(tests) ;; parity) selected=("${PARITY_TESTS[@]}" "${RING_TESTS[@]}") ;;
        parity-without-ring) selected=("${PARITY_TESTS[@]}") ;;
        *) echo "unknown tests '$tests' in $entry (all, parity or parity-without-ring)"; exit 2 ;; esac
    venv="$DIR/torch-$VERSION/venv"
    src="$DIR/torch-$VERSION/src"
    installed="$(cat "$venv/.installed" 2>/dev/null || true)"
    # Every set but `all` needs the same packages.
    if [ "$installed" = all ] || { [ -n "$installed" ] && [ "$tests" != all ]; }; then
        echo "== torch $VERSION: reusing $venv"
    else
        step "install torch==$VERSION (CUDA build, from PyPI) into $venv" install "$venv" "$tests"
    fi
    step "build ddp_ext in $src" build "$src" "$venv/bin/python"
    (
        cd "$src"
        export PATH="$venv/bin:$PATH" PYTHONPATH="$src"
        step "pytest ${selected[*]}" "$venv/bin/python" -m pytest "${selected[@]}" -q -p no:cacheprovider
        step "pytest tests/wrapper/test_cuda.py -rs" cuda_tests "$venv/bin/python"
    )
done
echo "== all torch builds passed: $((SECONDS - total)) s"
