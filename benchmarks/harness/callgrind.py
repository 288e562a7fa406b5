"""Counting the instructions a process executes, with valgrind's callgrind.

A rank started by `command()` runs under callgrind with one dump per thread,
uninstrumented (several times faster: importing torch under full callgrind
takes minutes) until it calls `instrument()`. Between `zero()` and
`dump(label)` it counts what every thread executes; the
parent then reads each dump's totals with `read_dumps()`. Counts do not depend
on the machine's load or on how the threads are scheduled, which makes them a
measure of work that timing cannot give on a shared machine.

Note [Counting copies]
~~~~~~~~~~~~~~~~~~~~~~
Valgrind counts each repetition of a `rep movsb` as one instruction, and
glibc's memcpy and memset switch to those for copies of a few kilobytes and
more: a copy of 8 KB counts 8,000 instructions where the copy kernels torch
uses count a few hundred vector moves. `command()` raises glibc's thresholds
for them (GLIBC_TUNABLES), so that every copy is counted as the vector loop it
then runs, the same way whichever library made it.

Note [Callgrind's thread numbers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With --separate-threads=yes callgrind writes one file per thread, named by
valgrind's number for the thread: 1 for the main thread, then the lowest
number not in use when a thread starts. While no thread has ended, the numbers
therefore follow the order in which the threads started, which is the order of
their kernel thread ids: the i-th smallest id alive is thread i.
`thread_numbers()` relies on that and gives up (None) where a thread seen
earlier has ended, since a thread started after it takes its number. (A
thread that starts and ends between two looks goes unseen; the ranks that
`instructions` counts start theirs before the first turn and keep them.) On
a counted rank the numbers were checked against each file's functions: the
thread named gloo_tcp_loop runs gloo::transport::tcp::Loop::run, those named
pt_gloo_runloop c10d::ProcessGroupGloo::runLoop.
"""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence

TOOLS = ("valgrind", "callgrind_control")
_NEVER = str(1 << 30)
TUNABLES = f"glibc.cpu.x86_rep_movsb_threshold={_NEVER}:glibc.cpu.x86_rep_stosb_threshold={_NEVER}"
MAIN_THREAD = 1  # callgrind numbers threads from 1 in the order they start


def missing_tools() -> List[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def command(out_base: str, argv: Sequence[str]) -> List[str]:
    """`argv` under callgrind, counting once it calls instrument(), one dump file per thread."""
    return ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
            f"--callgrind-out-file={out_base}", *argv]


def environment(base: Dict[str, str]) -> Dict[str, str]:
    """`base` with glibc's copies counted as vector loops (Note [Counting copies])."""
    tunables = ":".join(filter(None, [base.get("GLIBC_TUNABLES"), TUNABLES]))
    return {**base, "GLIBC_TUNABLES": tunables}


def instrument() -> None:
    """From inside the counted process: start instrumenting, every thread (counts start with the next zero())."""
    _control("--instr=on")


def zero() -> None:
    """From inside the counted process: start counting afresh, every thread."""
    _control("-z")


def dump(label: str) -> None:
    """From inside the counted process: write what was counted since zero(), labelled."""
    _control(f"--dump={label}")


def _control(option: str) -> None:
    # callgrind_control exits with 0 even where it finds no such process.
    done = subprocess.run(["callgrind_control", option, str(os.getpid())], capture_output=True, text=True)
    if done.returncode != 0 or "OK." not in done.stdout:
        raise RuntimeError(f"callgrind_control {option} failed (is this process running under callgrind?): "
                           f"{done.stdout}{done.stderr}")


def thread_numbers(seen: Collection[int], alive: Collection[int]) -> Optional[Dict[int, int]]:
    """Callgrind's number of each thread in `alive` (kernel thread ids), as
    {number: thread id}, or None where a thread in `seen` (every thread seen
    earlier) is no longer alive (Note [Callgrind's thread numbers])."""
    if set(seen) - set(alive):
        return None
    return {number: tid for number, tid in enumerate(sorted(alive), start=1)}


@dataclass(frozen=True)
class Dump:
    label: str
    thread: int
    instructions: int


_DUMP_NAME = re.compile(r"\.(\d+)-(\d+)$")


def read_dumps(out_base: str) -> List[Dump]:
    """Every labelled dump of the process counted into `out_base`, one per thread
    (the process's final dump, at its exit, has no label and is left out)."""
    folder, prefix = os.path.split(out_base)
    found = []
    for name in sorted(os.listdir(folder)):
        match = _DUMP_NAME.search(name)
        if not name.startswith(prefix + ".") or match is None:
            continue
        label, total = _header(os.path.join(folder, name))
        found.append(Dump(label, int(match.group(2)), total))
    return found


def _header(path: str):
    label, total = None, None
    with open(path) as f:
        for line in f:
            if line.startswith("desc: Trigger: dump "):
                label = line[len("desc: Trigger: dump "):].strip()
            elif line.startswith("summary:"):
                total = int(line.split()[1])
            if label is not None and total is not None:
                break
    if total is None:
        raise ValueError(f"{path} is not a callgrind dump with a summary")
    return label, total
