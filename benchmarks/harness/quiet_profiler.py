"""torch.profiler.profile without kineto's console lines: `quiet_profile(**kwargs)`.

Note [Quiet profiler]
~~~~~~~~~~~~~~~~~~~~~
Every start and stop of torch.profiler.profile writes a line to the process's
stderr, such as `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
profiler_start` (and `profiler_stop`). They come from kineto, the profiling
library inside libtorch_cpu, through its own C++ logger, not Python's
`logging`, so no Python log level reaches them. Their severity is kineto's
USDT (5), the highest: with torch 2.13 they print when KINETO_LOG_LEVEL is
unset, 4 or 5, and not at 6. That variable is the only switch, and kineto
reads it once, when a process first starts the profiler.

So quiet_profile sets KINETO_LOG_LEVEL=6 (nothing kineto logs, its errors
included) for the profile it opens, unless the user set it, and removes it
afterwards. Since kineto reads it at its first start, the level holds for
the rest of the process, and a process that started the profiler without
quiet_profile before stays loud: in the benchmark ranks every profile goes
through here. The profile's results are the same.
"""

import contextlib
import os

from torch.profiler import profile

LEVEL_VARIABLE = "KINETO_LOG_LEVEL"
SILENT = "6"  # above USDT (5), kineto's highest severity


@contextlib.contextmanager
def quiet_profile(**kwargs):
    """torch.profiler.profile(**kwargs) as a context manager, with kineto's log lines off."""
    set_here = LEVEL_VARIABLE not in os.environ
    if set_here:
        os.environ[LEVEL_VARIABLE] = SILENT
    try:
        with profile(**kwargs) as prof:
            yield prof
    finally:
        if set_here:
            os.environ.pop(LEVEL_VARIABLE, None)
