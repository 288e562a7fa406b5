"""The threads of this process, each named, with its context switches, from
/proc/self/task: a snapshot, and what each thread did between two snapshots.

A thread blocks and wakes once per voluntary switch (it waited: on a futex, a
socket, a poll); an involuntary switch is the scheduler taking the core from a
thread that could run on. Unlike instructions they depend on timing and on the
machine's load.
"""

import os
from dataclasses import dataclass
from typing import Dict, Tuple

TASK_DIR = "/proc/self/task"
_VOLUNTARY = "voluntary_ctxt_switches:"
_NONVOLUNTARY = "nonvoluntary_ctxt_switches:"


@dataclass(frozen=True)
class Task:
    name: str
    voluntary: int
    nonvoluntary: int


def parse_status(text: str) -> Tuple[int, int]:
    """(voluntary, nonvoluntary) context switches from the text of a /proc status file."""
    found = {}
    for line in text.splitlines():
        for key in (_VOLUNTARY, _NONVOLUNTARY):
            if line.startswith(key):
                found[key] = int(line[len(key):].strip())
    if len(found) != 2:
        raise ValueError("not a /proc status file with both context switch counts")
    return found[_VOLUNTARY], found[_NONVOLUNTARY]


def snapshot(task_dir: str = TASK_DIR) -> Dict[int, Task]:
    """Every thread alive now, by thread id. A thread that exits while it is read is left out."""
    tasks = {}
    for entry in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, entry, "comm")) as f:
                name = f.read().strip()
            with open(os.path.join(task_dir, entry, "status")) as f:
                voluntary, nonvoluntary = parse_status(f.read())
        except (FileNotFoundError, ProcessLookupError):
            continue
        tasks[int(entry)] = Task(name, voluntary, nonvoluntary)
    return tasks


def between(before: Dict[int, Task], after: Dict[int, Task]) -> Dict[int, Task]:
    """The switches of every thread alive at `after` since `before`; a thread
    started in between counts from its start. A thread that ended in between is
    not in `after`, and its switches are lost."""
    return {tid: Task(task.name, task.voluntary - before[tid].voluntary if tid in before else task.voluntary,
                      task.nonvoluntary - before[tid].nonvoluntary if tid in before else task.nonvoluntary)
            for tid, task in after.items()}


def to_json(tasks: Dict[int, Task]) -> Dict[str, list]:
    return {str(tid): [t.name, t.voluntary, t.nonvoluntary] for tid, t in tasks.items()}


def from_json(data: Dict[str, list]) -> Dict[int, Task]:
    return {int(tid): Task(name, voluntary, nonvoluntary) for tid, (name, voluntary, nonvoluntary) in data.items()}
