"""Where MPI is: the compile and link flags of the MPI the MPI backend
(ddp_ext._mpi) is built against, read from MPI's C compiler wrapper.

Both builds read it: setup.py, which builds ddp_ext._mpi only if MPI is found,
and the JIT loader (ddp_ext._loader.load_mpi_extension). Like _build_info,
it imports nothing from ddp_ext.

The wrapper is $MPICC if set, else `mpicc` on PATH. Open MPI's answers
`--showme:compile` and `--showme:link`; MPICH's (and Intel MPI's, MVAPICH's)
`-compile_info` and `-link_info`, which start with the compiler's name.
DDP_EXT_NO_MPI=1 builds without the MPI backend even where MPI is found.
"""

import os
import shlex
import shutil
import subprocess
from typing import List, NamedTuple, Optional

HOW_TO_INSTALL = (
    "Install MPI with its development files, then rebuild ddp_ext: on Debian or Ubuntu "
    "`apt-get install libopenmpi-dev openmpi-bin` (or libmpich-dev mpich), on Fedora "
    "`dnf install openmpi-devel` then `module load mpi`, with conda `conda install -c "
    "conda-forge openmpi`, on a cluster `module load openmpi` (or your site's MPI). "
    "The build looks for MPI's C compiler wrapper: `mpicc` on PATH, or the one $MPICC names."
)


class MpiFlags(NamedTuple):
    wrapper: str  # the compiler wrapper asked
    compile_args: List[str]  # -I and -D flags
    link_args: List[str]  # -L, -l and -Wl flags


def _ask(wrapper: str, *args: str) -> Optional[List[str]]:
    try:
        done = subprocess.run([wrapper, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shlex.split(done.stdout) if done.returncode == 0 and done.stdout.strip() else None


def _keep(words: List[str], prefixes: tuple) -> List[str]:
    return [w for w in words if w.startswith(prefixes)]


def find_mpi() -> Optional[MpiFlags]:
    """MPI's flags, or None where no MPI wrapper answers (or DDP_EXT_NO_MPI=1)."""
    if os.environ.get("DDP_EXT_NO_MPI") == "1":
        return None
    wrapper = os.environ.get("MPICC") or shutil.which("mpicc")
    if not wrapper:
        return None
    compile_words = _ask(wrapper, "--showme:compile")
    link_words = _ask(wrapper, "--showme:link")
    if compile_words is None or link_words is None:  # not Open MPI: MPICH-style
        compile_words = _ask(wrapper, "-compile_info")
        link_words = _ask(wrapper, "-link_info")
    if compile_words is None or link_words is None:
        return None
    link_args = _keep(link_words, ("-L", "-l", "-Wl,", "-pthread"))
    # An MPI outside the loader's default path (conda, modules) is found at
    # run time too.
    link_args += [f"-Wl,-rpath,{w[2:]}" for w in link_args if w.startswith("-L")]
    return MpiFlags(wrapper, _keep(compile_words, ("-I", "-D", "-pthread")), link_args)
