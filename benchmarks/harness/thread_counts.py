"""A counted rank's turns, thread by thread: the instructions callgrind
counted for each thread (its dumps) and the context switches /proc counted
(the rank's snapshots, workloads/counted_rank.py), summed by the kind of
thread (harness/thread_kinds.py), per iteration.

A rank's record of snapshots is {"pid", "start", "turns": [{"label",
"before", "after"}]}, each snapshot task_switches.to_json's.
"""

from typing import Dict, List

from benchmarks.harness import callgrind, task_switches, thread_kinds


def _variant(label: str) -> str:
    return label.split(":", 1)[1]


def _turn_order(label: str) -> int:
    return int(label.split(":", 1)[0])


def dump_kinds(record: dict, dumps: List[callgrind.Dump]) -> Dict[str, Dict[int, str]]:
    """By turn label: the kind of thread of each of callgrind's thread numbers.
    Where a turn's threads cannot be told apart by name (Note [Callgrind's
    thread numbers]), thread 1 is the main thread and the others are OTHER."""
    pid = record["pid"]
    numbers_by_label: Dict[str, List[int]] = {}
    for d in dumps:
        numbers_by_label.setdefault(d.label, []).append(d.thread)
    seen = set(task_switches.from_json(record["start"]))
    kinds = {}
    for turn in record["turns"]:
        before, after = task_switches.from_json(turn["before"]), task_switches.from_json(turn["after"])
        seen |= set(before)
        numbers = callgrind.thread_numbers(seen, after)
        dumped = sorted(numbers_by_label.get(turn["label"], []))
        if numbers is None or dumped != sorted(numbers):
            kinds[turn["label"]] = {n: thread_kinds.MAIN if n == callgrind.MAIN_THREAD else thread_kinds.OTHER
                                    for n in dumped}
        else:
            kinds[turn["label"]] = {n: thread_kinds.kind(tid, pid, after[tid].name) for n, tid in numbers.items()}
        seen |= set(after)
    return kinds


def instructions(record: dict, dumps: List[callgrind.Dump], iterations: int) -> Dict[str, Dict[str, List[float]]]:
    """By variant, by kind of thread: instructions per iteration, one value per turn (in turn order)."""
    kinds = dump_kinds(record, dumps)
    turns: Dict[str, Dict[str, float]] = {}
    for d in dumps:
        per_kind = turns.setdefault(d.label, dict.fromkeys(set(kinds[d.label].values()), 0.0))
        per_kind[kinds[d.label][d.thread]] += d.instructions / iterations
    return _by_variant(turns)


def switches(record: dict, iterations: int) -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    """By variant, by kind of thread: "threads" (alive), "woken" (threads that
    switched at all), "voluntary" and "nonvoluntary" switches per iteration,
    one value per turn (in turn order)."""
    pid = record["pid"]
    turns: Dict[str, Dict[str, Dict[str, float]]] = {}
    for turn in record["turns"]:
        per_kind = turns.setdefault(turn["label"], {})
        done = task_switches.between(task_switches.from_json(turn["before"]), task_switches.from_json(turn["after"]))
        for tid, task in done.items():
            counts = per_kind.setdefault(thread_kinds.kind(tid, pid, task.name),
                                         {"threads": 0, "woken": 0, "voluntary": 0.0, "nonvoluntary": 0.0})
            counts["threads"] += 1
            counts["woken"] += 1 if task.voluntary + task.nonvoluntary else 0
            counts["voluntary"] += task.voluntary / iterations
            counts["nonvoluntary"] += task.nonvoluntary / iterations
    by_variant: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for label in sorted(turns, key=_turn_order):
        for kind, counts in turns[label].items():
            target = by_variant.setdefault(_variant(label), {}).setdefault(kind, {})
            for measure, value in counts.items():
                target.setdefault(measure, []).append(value)
    return by_variant


def _by_variant(turns: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, List[float]]]:
    by_variant: Dict[str, Dict[str, List[float]]] = {}
    for label in sorted(turns, key=_turn_order):
        for kind, value in turns[label].items():
            by_variant.setdefault(_variant(label), {}).setdefault(kind, []).append(value)
    return by_variant


def present(per_variant: Dict[str, Dict[str, object]]) -> List[str]:
    """The kinds of thread any variant has, in thread_kinds.KINDS order."""
    found = {kind for kinds in per_variant.values() for kind in kinds}
    return [kind for kind in thread_kinds.KINDS if kind in found]

