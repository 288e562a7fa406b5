"""The tests' own C++ extension: the test doubles in tests/support/native/, which the
shipped ddp_ext._C does not contain.

recording_backend() compiles them with torch.utils.cpp_extension.load on
first use and loads the result. The build is cached in the checkout's
build/tests_native/, one folder per Python, torch and flavour (sanitized or
not), so later calls and every process a test starts load the same library
without compiling again. Builds run under ddp_ext's build lock, so processes
that ask at once compile it once.

With DDP_EXT_SANITIZE=1 (tools/sanitized_tests.sh) it is compiled with the
same sanitizer flags as the sanitized product.
"""

import functools
import os
import sys

import torch

from ddp_ext import _build_info
from ddp_ext._build_lock import build_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "tests", "support", "native")
SOURCES = ["bindings.cpp", "recording_backend.cpp"]
MODULE_NAME = "ddp_ext_test_doubles"
BUILD_WAIT_S = 1800  # a build by another process, under load on 2 cores


def _sanitized() -> bool:
    return os.environ.get(_build_info.SANITIZE_ENV) == "1"


def build_directory() -> str:
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    flavour = "sanitized" if _sanitized() else "plain"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_minor}_{flavour}"
    return os.path.join(ROOT, "build", "tests_native", tag)


@functools.lru_cache(maxsize=None)
def recording_backend():
    """The module holding RecordingBackend, RecordingBackendOptions and
    RecordedCall (see tests/support/native/recording_backend.h), and
    accumulator_post_hook_count."""
    from torch.utils.cpp_extension import load

    sanitize = _build_info.SANITIZE_FLAGS if _sanitized() else []
    build_dir = build_directory()
    with build_lock(build_dir, timeout_s=BUILD_WAIT_S):
        return load(
            name=MODULE_NAME,
            sources=[os.path.join(NATIVE, s) for s in SOURCES],
            extra_include_paths=[NATIVE],
            extra_cflags=_build_info.CXX_FLAGS + sanitize,
            extra_ldflags=sanitize,
            build_directory=build_dir,
        )


def accumulator_post_hook_count(param: torch.Tensor) -> int:
    """Post hooks on the gradient accumulator of leaf tensor `param`: a
    reducer installs one per parameter and must remove it."""
    return recording_backend().accumulator_post_hook_count(param)
