"""Ahead-of-time build of ddp_ext._C.

Build with torch already installed, without build isolation:
    pip install --no-build-isolation .
"""

import os
import runpy

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = runpy.run_path(os.path.join(ROOT, "ddp_ext", "_build_info.py"))
TRANSLATION_UNITS = runpy.run_path(os.path.join(ROOT, "ddp_ext", "_translation_units.py"))
MPI = runpy.run_path(os.path.join(ROOT, "ddp_ext", "_mpi_build.py"))["find_mpi"]()

# DDP_EXT_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
# (see SANITIZE_FLAGS in ddp_ext/_build_info.py and tools/sanitized_tests.sh).
SANITIZE = BUILD_INFO["SANITIZE_FLAGS"] if os.environ.get(BUILD_INFO["SANITIZE_ENV"]) == "1" else []

# Two translation units: the bindings as one unit, and every other source as one
# (see ddp_ext/_translation_units.py), written under build/.
sources = TRANSLATION_UNITS["translation_units"](
    ROOT, BUILD_INFO["SOURCES"], BUILD_INFO["BINDING_SOURCES"], os.path.join(ROOT, "build", "units")
)

def extension(name, sources, compile_args=(), link_args=()):
    return CppExtension(
        name=name,
        sources=[os.path.relpath(s, ROOT) for s in sources],
        include_dirs=[os.path.join(ROOT, d) for d in BUILD_INFO["INCLUDE_DIRS"]],
        extra_compile_args={"cxx": BUILD_INFO["CXX_FLAGS"] + SANITIZE + list(compile_args)},
        extra_link_args=SANITIZE + list(link_args),
    )


extensions = [extension("ddp_ext._C", sources)]

# The MPI backend only where MPI is found (see ddp_ext/_mpi_build.py); without
# it everything else builds, and `import ddp_ext.mpi` says how to install MPI.
if MPI is not None:
    mpi_sources = TRANSLATION_UNITS["translation_units"](
        ROOT, BUILD_INFO["MPI_SOURCES"], BUILD_INFO["MPI_BINDING_SOURCE"], os.path.join(ROOT, "build", "units"),
        TRANSLATION_UNITS["MPI_UNIT_NAME"],
    )
    extensions.append(extension("ddp_ext._mpi", mpi_sources, MPI.compile_args, MPI.link_args))
    print(f"ddp_ext: building the MPI backend against the MPI of {MPI.wrapper}")
else:
    print("ddp_ext: no MPI found (no `mpicc` on PATH, nor $MPICC), building without the MPI backend")

setup(
    version=BUILD_INFO["VERSION"],
    packages=find_packages(include=["ddp_ext", "ddp_ext.*"]),
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
