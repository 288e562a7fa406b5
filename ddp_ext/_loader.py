"""Finds the native core: the prebuilt ddp_ext._C, or a JIT build of the same sources."""

import importlib
import os
import sys
import time

import torch

from ddp_ext import _build_info
from ddp_ext._build_lock import build_lock
from ddp_ext._translation_units import CORE_UNIT_NAME, MPI_UNIT_NAME, translation_units

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JIT_MODULE_NAME = "ddp_ext_jit"
MPI_JIT_MODULE_NAME = "ddp_ext_mpi_jit"

# How long an import waits for another process's JIT build before giving up
# with a message that names the lock files (a first build takes minutes).
BUILD_WAIT_S = float(os.environ.get("DDP_EXT_BUILD_WAIT_S", 1800))


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def jit_build_directory(module_name: str = JIT_MODULE_NAME) -> str:
    """Where the JIT build and its cache live: a folder of torch's extension
    cache (TORCH_EXTENSIONS_DIR if set), one per Python and torch version."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{_torch_minor()}"
    return os.path.join(root, f"{module_name}_{tag}")


def _is_built(build_dir: str, module_name: str, sources: list) -> bool:
    """Whether a built library is there and newer than every C++ file in the
    source folders (a cheap guess at whether ninja will compile anything)."""
    from torch.utils.cpp_extension import LIB_EXT

    library = os.path.join(build_dir, module_name + LIB_EXT)
    if not os.path.exists(library):
        return False
    folders = {os.path.join(_REPO_ROOT, os.path.dirname(s)) for s in sources}
    newest = max(
        os.path.getmtime(os.path.join(folder, name))
        for folder in folders
        for name in os.listdir(folder)
        if name.endswith((".cpp", ".h"))
    )
    return os.path.getmtime(library) >= newest


def _say(message: str) -> None:
    print(f"ddp_ext: {message}", file=sys.stderr, flush=True)


def _jit_build(what: str, module_name: str, sources: list, binding_sources, unit_name: str,
               cflags=(), ldflags=(), verbose: bool = False):
    """Builds (or reuses from torch's extension cache) and loads `module_name`
    from `sources` (repository-relative), as two translation units."""
    from torch.utils.cpp_extension import load

    paths = [os.path.join(_REPO_ROOT, s) for s in sources]
    missing = [s for s in paths if not os.path.exists(s)]
    if missing:
        raise ImportError(
            f"ddp_ext: cannot JIT-build {what}, its C++ sources are not "
            f"next to the package (missing {missing[0]}). Install ddp_ext from a "
            "checkout with `pip install --no-build-isolation .`, or load it from "
            "the checkout itself."
        )
    build_dir = jit_build_directory(module_name)
    with build_lock(build_dir, timeout_s=BUILD_WAIT_S):
        units = translation_units(_REPO_ROOT, sources, binding_sources, build_dir, unit_name)
        building = not _is_built(build_dir, module_name, sources)
        if building:
            _say(
                f"compiling {what} now from the {len(paths)} C++ sources in {_REPO_ROOT} "
                "(the bindings as one unit, the others as another) with torch.utils.cpp_extension. "
                f"A first build takes minutes; it is cached in {build_dir}."
            )
        started = time.monotonic()
        module = load(
            name=module_name,
            sources=units,
            extra_include_paths=[os.path.join(_REPO_ROOT, d) for d in _build_info.INCLUDE_DIRS],
            extra_cflags=_build_info.CXX_FLAGS + list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=build_dir,
            verbose=verbose,
        )
        if building:
            _say(f"{what} built in {time.monotonic() - started:.0f} s, cached in {build_dir}")
    return module


def load_extension(verbose: bool = False):
    """Build (or reuse from torch's extension cache) and load the native core.

    Compiles the sources listed in ddp_ext/_build_info.py with
    torch.utils.cpp_extension.load, for notebooks and checkouts that were not
    installed with setup.py. A first build says what it does on stderr and
    takes a few minutes; later calls reuse the cached build until a source
    file changes. See ddp_ext/_build_lock.py for builds that were killed.
    """
    return _jit_build(
        "the native core", JIT_MODULE_NAME, _build_info.SOURCES, _build_info.BINDING_SOURCES, CORE_UNIT_NAME,
        verbose=verbose,
    )


def load_mpi_extension(verbose: bool = False):
    """Build (or reuse) and load the MPI backend, as load_extension does the
    native core, against the MPI that ddp_ext/_mpi_build.py finds. Raises
    ImportError saying how to install MPI where there is none."""
    from ddp_ext._mpi_build import HOW_TO_INSTALL, find_mpi

    mpi = find_mpi()
    if mpi is None:
        raise ImportError(f"ddp_ext: the MPI backend needs MPI, and none was found. {HOW_TO_INSTALL}")
    return _jit_build(
        "the MPI backend", MPI_JIT_MODULE_NAME, _build_info.MPI_SOURCES, _build_info.MPI_BINDING_SOURCE,
        MPI_UNIT_NAME, cflags=mpi.compile_args, ldflags=mpi.link_args, verbose=verbose,
    )


def _check_torch_version(module) -> None:
    built = module.torch_version
    running = _torch_minor()
    if built != running:
        raise ImportError(
            f"ddp_ext was built against torch {built} but torch {running} is "
            "installed. Rebuild it: `pip install --no-build-isolation --force-reinstall "
            "--no-deps .` from the ddp_ext checkout."
        )


def _prebuilt_or_jit(name: str, what: str, jit):
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        if not (isinstance(error, ModuleNotFoundError) and error.name == name):
            _say(f"the prebuilt {name} did not load ({error}); building {what} just in time instead")
        module = jit()
    _check_torch_version(module)
    return module


def native_module():
    """The prebuilt extension if there is one, else the JIT build."""
    return _prebuilt_or_jit("ddp_ext._C", "the native core", load_extension)


def mpi_module():
    """The prebuilt MPI backend (ddp_ext._mpi) if there is one, else its JIT
    build; ImportError saying how to install MPI where there is none."""
    return _prebuilt_or_jit("ddp_ext._mpi", "the MPI backend", load_mpi_extension)
