#!/usr/bin/env bash
# kwker's one entry point for people and CI. Every command first does the set-up
# (idempotent): Debian packages, the virtual environment in .venv, and the build.
#
#   scripts/dev.sh example [args]  run examples/hf_generate on the embedded model
#   scripts/dev.sh test            every test: Criterion (plain, ASan+UBSan, fuzz), pytest, and the
#                                  plan-level pytest files again with kwker._C under ASan+UBSan
#   scripts/dev.sh setup           only the set-up
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
JOBS=${JOBS:-$(nproc)}

APT_PACKAGES=(libdnnl-dev libcriterion-dev libjemalloc2 libjemalloc-dev pkg-config clang libclang-rt-14-dev ninja-build)

step() { printf '\n== %s\n' "$*"; }

install_debian_packages() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return
    step "apt-get install ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

install_python_env() {
    [ -x "$PY" ] || { step "python3 -m venv .venv"; python3 -m venv "$VENV"; }
    local stamp=$VENV/.requirements.sha
    local want
    want=$(sha256sum requirements.txt | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        step "pip install -r requirements.txt"
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q -r requirements.txt
        echo "$want" >"$stamp"
    fi
}

install_kwker() {
    step "pip install --editable . (kwker._C built incrementally in build/py; Python sources used in place)"
    mkdir -p build
    if ! "$PY" -m pip install --no-build-isolation --no-deps --editable . >build/pip-install.log 2>&1; then
        cat build/pip-install.log >&2
        exit 1
    fi
}

setup() {
    install_debian_packages
    install_python_env
    install_kwker
}

# cmake_build DIR [cmake args...]: configure once, build incrementally.
cmake_build() {
    local dir=$1
    shift
    PATH=$VENV/bin:$PATH cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
    PATH=$VENV/bin:$PATH cmake --build "$dir" -j "$JOBS"
}

run_tests() {
    step "C tests (Criterion)"
    cmake_build build/c -DKW_TESTS=ON
    ctest --test-dir build/c --output-on-failure

    step "C tests under ASan+UBSan"
    cmake_build build/asan -DKW_TESTS=ON -DKW_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan --output-on-failure

    if [ -f tests/c/fuzz_capture.c ]; then
        step "fuzzing the capture builder (libFuzzer)"
        CC=clang cmake_build build/fuzz -DKW_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
        ctest --test-dir build/fuzz --output-on-failure
    fi

    step "Python tests (pytest)"
    "$PY" -m pytest -q tests/python

    step "Python tests of plans, threads, watches and kwker's ops, with kwker._C under ASan+UBSan"
    cmake_build build/py-asan -DKW_PYTHON=ON -DKW_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DPython_EXECUTABLE="$PY"
    # The sanitizer runtime first, and libstdc++ before it is needed: PyTorch
    # throws C++ exceptions, which ASan's interceptor must find the real thrower for.
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$PY" scripts/sanitized_pytest.py "$(find build/py-asan -name '_C.*.so' | head -n 1)" -q -p no:logging \
        tests/python/test_plan.py tests/python/test_reliability.py tests/python/test_decode_step.py \
        tests/python/test_steps.py tests/python/test_custom_ops.py
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup ;;
    test) setup && run_tests ;;
    example) setup && exec "$PY" examples/hf_generate/generate.py "$@" ;;
    *)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
