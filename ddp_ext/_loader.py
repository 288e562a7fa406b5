"""Finds the native core: the prebuilt ddp_ext._C, or a JIT build of the same sources."""

import importlib
import os

import torch

from ddp_ext import _build_info

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JIT_MODULE_NAME = "ddp_ext_jit"


def load_extension(verbose: bool = False):
    """Build (or reuse from torch's extension cache) and load the native core.

    Compiles the sources listed in ddp_ext/_build_info.py with
    torch.utils.cpp_extension.load, for notebooks and checkouts that were not
    installed with setup.py. The first call takes a few minutes; later calls
    reuse the cached build until a source file changes.
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
    return load(
        name=JIT_MODULE_NAME,
        sources=sources,
        extra_include_paths=[os.path.join(_REPO_ROOT, d) for d in _build_info.INCLUDE_DIRS],
        extra_cflags=_build_info.CXX_FLAGS,
        verbose=verbose,
    )


def _check_torch_version(module) -> None:
    built = module.torch_version
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
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
    except ImportError:
        module = load_extension()
    _check_torch_version(module)
    return module
