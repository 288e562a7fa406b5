"""Finds the native core: the prebuilt ddp_ext._C, or a JIT build of the same sources."""

import importlib
import os
import sys
import time

import torch

from ddp_ext import _build_info
from ddp_ext._build_lock import build_lock
from ddp_ext._units import translation_units

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JIT_MODULE_NAME = "ddp_ext_jit"

# How long an import waits for another process's JIT build before giving up
# with a message that names the lock files (a first build takes minutes).
BUILD_WAIT_S = float(os.environ.get("DDP_EXT_BUILD_WAIT_S", 1800))


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def jit_build_directory() -> str:
    """Where the JIT build and its cache live: a folder of torch's extension
    cache (TORCH_EXTENSIONS_DIR if set), one per Python and torch version."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{_torch_minor()}"
    return os.path.join(root, f"{JIT_MODULE_NAME}_{tag}")


def _is_built(build_dir: str) -> bool:
    """Whether a built library is there and newer than every C++ file in the
    source folders (a cheap guess at whether ninja will compile anything)."""
    from torch.utils.cpp_extension import LIB_EXT

    library = os.path.join(build_dir, JIT_MODULE_NAME + LIB_EXT)
    if not os.path.exists(library):
        return False
    folders = {os.path.join(_REPO_ROOT, os.path.dirname(s)) for s in _build_info.SOURCES}
    newest = max(
        os.path.getmtime(os.path.join(folder, name))
        for folder in folders
        for name in os.listdir(folder)
        if name.endswith((".cpp", ".h"))
    )
    return os.path.getmtime(library) >= newest


def _say(message: str) -> None:
    print(f"ddp_ext: {message}", file=sys.stderr, flush=True)


def load_extension(verbose: bool = False):
    """Build (or reuse from torch's extension cache) and load the native core.

    Compiles the sources listed in ddp_ext/_build_info.py with
    torch.utils.cpp_extension.load, for notebooks and checkouts that were not
    installed with setup.py. A first build says what it does on stderr and
    takes a few minutes; later calls reuse the cached build until a source
    file changes. See ddp_ext/_build_lock.py for builds that were killed.
    """
    from torch.utils.cpp_extension import load

    sources = [os.path.join(_REPO_ROOT, s) for s in _build_info.SOURCES]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise ImportError(
            "ddp_ext: cannot JIT-build the native core, its C++ sources are not "
            f"next to the package (missing {missing[0]}). Install ddp_ext from a "
            "checkout with `pip install --no-build-isolation .`, or load it from "
            "the checkout itself."
        )
    build_dir = jit_build_directory()
    with build_lock(build_dir, timeout_s=BUILD_WAIT_S):
        units = translation_units(_REPO_ROOT, _build_info.SOURCES, _build_info.BINDING_SOURCE, build_dir)
        building = not _is_built(build_dir)
        if building:
            _say(
                f"compiling the native core now from the {len(sources)} C++ sources in {_REPO_ROOT} "
                f"({_build_info.BINDING_SOURCE}, and the others as one unit) with torch.utils.cpp_extension. "
                f"A first build takes minutes; it is cached in {build_dir}."
            )
        started = time.monotonic()
        module = load(
            name=JIT_MODULE_NAME,
            sources=units,
            extra_include_paths=[os.path.join(_REPO_ROOT, d) for d in _build_info.INCLUDE_DIRS],
            extra_cflags=_build_info.CXX_FLAGS,
            build_directory=build_dir,
            verbose=verbose,
        )
        if building:
            _say(f"native core built in {time.monotonic() - started:.0f} s, cached in {build_dir}")
    return module


def _check_torch_version(module) -> None:
    built = module.torch_version
    running = _torch_minor()
    if built != running:
        raise ImportError(
            f"ddp_ext was built against torch {built} but torch {running} is "
            "installed. Rebuild it: `pip install --no-build-isolation --force-reinstall "
            "--no-deps .` from the ddp_ext checkout."
        )


def native_module():
    """The prebuilt extension if there is one, else the JIT build."""
    try:
        module = importlib.import_module("ddp_ext._C")
    except ImportError as error:
        if not (isinstance(error, ModuleNotFoundError) and error.name == "ddp_ext._C"):
            _say(f"the prebuilt ddp_ext._C did not load ({error}); building the native core just in time instead")
        module = load_extension()
    _check_torch_version(module)
    return module
