"""pytest with kwker._C taken from a build with AddressSanitizer and
UndefinedBehaviorSanitizer, for the tests that drive plans from Python
(threads, watches, refreshes): the C tests run under the sanitizers already,
these run the binding and the runtime together as a user's program does.

    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \\
    ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 \\
    .venv/bin/python scripts/sanitized_pytest.py build/py-asan/.../_C.cpython-311-x86_64-linux-gnu.so \\
        tests/python/test_plan.py ...

scripts/dev.sh test builds that module (build/py-asan) and runs this. The
sanitizer runtime must be loaded first, hence LD_PRELOAD, and libstdc++ with it
(ASan's interceptor of C++ throws, which PyTorch makes, needs it loaded by
then); CPython and PyTorch are not instrumented, so leaks are not looked for
(CPython keeps memory to the end by design) and mismatched allocation calls in
PyTorch are not reported."""

import importlib.util
import sys

import pytest


def main(module_path: str, *pytest_args: str) -> int:
    # Loaded under its package name before kwker is imported: every
    # `from kwker import _C` then finds this module in sys.modules.
    spec = importlib.util.spec_from_file_location("kwker._C", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kwker._C"] = module
    spec.loader.exec_module(module)
    return pytest.main(["-p", "no:cacheprovider", *pytest_args])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
