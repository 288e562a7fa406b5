"""instructions: the work of an iteration, counted, on fixedcost's tiny MLP.

fixedcost times what ddp_ext adds to a short iteration; on a shared machine
two identical implementations there differ by a percent or two from run to
run, and the difference between ddp_ext and torch's DDP is of that size. This
experiment counts instead of timing: each rank runs under valgrind's callgrind
(harness/callgrind.py) and counts the instructions every thread executes per
iteration, for local training, torch's DDP, ddp_ext and a second torch DDP
(the control), in the same processes and in turns (workloads/counted_rank.py).

The main thread (the forward, the backward with the reducer's hooks, waiting,
the optimizer) counts the same within a fraction of a percent from run to run.
Gloo's threads do not: its TCP loop wakes as often as data arrives, which
depends on timing. Both are reported; only the first is a measure of work.
What DDP adds to an iteration is a variant's count less local training's.

Thread by thread (harness/thread_counts.py), each rank's threads are told
apart by name (harness/thread_kinds.py: the main thread, Gloo's TCP loop,
Gloo's workers, reducer or watcher threads, other), and for each kind the
experiment reports its instructions, how many of its threads woke, and its
voluntary and involuntary context switches per iteration.

Note [Switches are counted without callgrind]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Valgrind runs one thread of a process at a time: a thread that could run
waits for valgrind's lock, which adds switches the program would not make and
moves others. So the ranks run their turns twice: under callgrind for the
instructions, then again without it, the same turns in the same order, for
the switches (/proc/self/task/*/status, read just before and after a turn's
iterations). Switches depend on timing and on the machine's load; the
instructions do not.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Dict, List, Tuple

from benchmarks.harness import callgrind, thread_counts, thread_kinds
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.tiny_mlp import BATCH, SIZES
from benchmarks.workloads.tiny_variants import LABELS, TORCH_CONTROL

NAME = "instructions"
FIGURE = "none (ddp_ext's own: the instructions of an iteration against torch's DDP)"
TITLE = "Instructions per iteration on a tiny MLP: ddp_ext vs torch DDP"
# blocks: rounds of turns (each round runs every variant once, the second in
# the reverse order); block_iterations: iterations counted per turn.
RUN_LENGTHS = {"warmup": 50, "blocks": 2, "block_iterations": 200, "discard_per_block": 0}

MODEL = "tinymlp"
KINDS = (LOCAL, TORCH, OURS, TORCH_CONTROL)
DDP_KINDS = (TORCH, OURS, TORCH_CONTROL)


def turns(rounds: int) -> List[str]:
    """The variants' turns: KINDS, then KINDS reversed, and so on."""
    return [kind for r in range(rounds) for kind in (KINDS if r % 2 == 0 else KINDS[::-1])]


def _launch(options: BenchOptions, folder: str, counter: str, progress) -> List[str]:
    """Runs the ranks' turns once, under callgrind (`counter` "callgrind") or
    not ("none"); returns each rank's base path: its dumps, its log (.log) and
    its snapshots of threads (.tasks.json)."""
    order = ",".join(turns(options.blocks))
    # From the checkout's root, `python -m` finds benchmarks (and ddp_ext, where it is not installed).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = callgrind.environment(dict(os.environ)) if counter == "callgrind" else dict(os.environ)
    bases = [os.path.join(folder, f"{counter}-rank{rank}") for rank in range(options.world_size)]
    logs = [open(base + ".log", "w") for base in bases]

    def argv(rank: int, base: str) -> List[str]:
        rank_argv = [sys.executable, "-m", "benchmarks.workloads.counted_rank", str(rank), str(options.world_size),
                     os.path.join(folder, f"{counter}-store"), str(options.block_iterations), str(options.warmup),
                     str(options.seed), str(options.threads), order, base + ".tasks.json", counter]
        return callgrind.command(base, rank_argv) if counter == "callgrind" else rank_argv

    ranks = [subprocess.Popen(argv(rank, base), cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
             for rank, (base, log) in enumerate(zip(bases, logs))]
    progress.say(f"{options.world_size} ranks {'under callgrind' if counter == 'callgrind' else 'counting switches'}"
                 f", turns {order}, {options.block_iterations} iterations each")
    try:
        failed = _wait(ranks, options.timeout_s)
    finally:
        for log in logs:
            log.close()
    if failed:
        raise RuntimeError("\n".join(f"{problem}:\n{_tail(bases[rank] + '.log')}" for rank, problem in failed))
    return bases


def _read_tasks(base: str) -> dict:
    with open(base + ".tasks.json") as f:
        return json.load(f)


def _count(options: BenchOptions, progress) -> Tuple[List[List[callgrind.Dump]], List[dict], List[dict]]:
    """Each rank's dumps and snapshots under callgrind, then its snapshots
    without it (Note [Switches are counted without callgrind])."""
    missing = callgrind.missing_tools()
    if missing:
        raise RuntimeError(f"instructions needs valgrind's callgrind: {', '.join(missing)} not found on PATH "
                           "(on Debian or Ubuntu: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as folder:
        counted = _launch(options, folder, "callgrind", progress)
        dumps = [callgrind.read_dumps(base) for base in counted]
        counted_tasks = [_read_tasks(base) for base in counted]
        native_tasks = [_read_tasks(base) for base in _launch(options, folder, "none", progress)]
    return dumps, counted_tasks, native_tasks


def _wait(ranks: List[subprocess.Popen], timeout_s: float) -> List[tuple]:
    """Waits for every rank; once one fails or time is up, stops the others
    (they would wait for it at the next barrier). Returns (rank, problem) pairs."""
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in ranks):
        failed = [(rank, f"rank {rank} exited with {proc.returncode}")
                  for rank, proc in enumerate(ranks) if proc.poll() not in (None, 0)]
        late = time.monotonic() > deadline
        if failed or late:
            for proc in ranks:
                proc.kill()
                proc.wait()
            return failed or [(0, f"the ranks did not finish within {timeout_s:.0f} s under callgrind")]
        time.sleep(0.5)
    return [(rank, f"rank {rank} exited with {proc.returncode}") for rank, proc in enumerate(ranks) if proc.returncode]


def _tail(path: str, characters: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-characters:]


def per_iteration(dumps: List[callgrind.Dump], iterations: int) -> Dict[str, Dict[str, List[float]]]:
    """By variant: the main thread's and the other threads' instructions per
    iteration, one value per turn."""
    turns_seen: Dict[str, Dict[str, float]] = {}
    for d in dumps:
        counts = turns_seen.setdefault(d.label, {"main": 0.0, "other_threads": 0.0})
        counts["main" if d.thread == callgrind.MAIN_THREAD else "other_threads"] += d.instructions / iterations
    by_kind: Dict[str, Dict[str, List[float]]] = {}
    for label, counts in sorted(turns_seen.items(), key=lambda item: int(item[0].split(":")[0])):
        kind = label.split(":", 1)[1]
        for thread, value in counts.items():
            by_kind.setdefault(kind, {}).setdefault(thread, []).append(value)
    return by_kind


def _summary(ranks: List[Dict[str, Dict[str, List[float]]]]) -> dict:
    counts = {kind: {thread: [v for rank in ranks for v in rank[kind][thread]] for thread in ("main", "other_threads")}
              for kind in KINDS}
    local = median(counts[LOCAL]["main"])
    result = {"per_iteration": {}}
    for kind in KINDS:
        main, others = counts[kind]["main"], counts[kind]["other_threads"]
        result["per_iteration"][kind] = {
            "main": median(main), "main_range": [min(main), max(main)],
            "other_threads": median(others), "other_threads_range": [min(others), max(others)],
            "ddp_main": median(main) - local,  # local's own: 0
        }
    added = {kind: result["per_iteration"][kind]["ddp_main"] for kind in DDP_KINDS}
    result["ours_over_torch_main"] = result["per_iteration"][OURS]["main"] / result["per_iteration"][TORCH]["main"]
    result["ours_over_torch_ddp_main"] = added[OURS] / added[TORCH]
    result["control_over_torch_ddp_main"] = added[TORCH_CONTROL] / added[TORCH]
    return result


def _thread_summary(instructions: List[dict], switches: List[dict]) -> Dict[str, Dict[str, dict]]:
    """By variant, by kind of thread: medians over ranks and turns of the
    instructions (callgrind's run) and of the threads, the threads woken and
    the switches (the run without callgrind), per iteration."""
    summary: Dict[str, Dict[str, dict]] = {}
    for variant in KINDS:
        for kind in thread_kinds.KINDS:
            counted = [v for rank in instructions for v in rank.get(variant, {}).get(kind, [])]
            switched = [rank[variant][kind] for rank in switches if kind in rank.get(variant, {})]
            entry = {}
            if counted:
                entry.update(instructions=median(counted), instructions_range=[min(counted), max(counted)])
            for measure in ("threads", "woken", "voluntary", "nonvoluntary"):
                values = [v for counts in switched for v in counts[measure]]
                if values:
                    entry[measure] = median(values)
                    entry[measure + "_range"] = [min(values), max(values)]
            if entry:
                summary.setdefault(variant, {})[kind] = entry
    return summary


def run(options: BenchOptions, progress) -> dict:
    dumps, counted_tasks, native_tasks = _count(options, progress)
    iterations = options.block_iterations
    ranks = [per_iteration(rank_dumps, iterations) for rank_dumps in dumps]
    thread_instructions = [thread_counts.instructions(record, rank_dumps, iterations)
                           for record, rank_dumps in zip(counted_tasks, dumps)]
    thread_switches = [thread_counts.switches(record, iterations) for record in native_tasks]
    result = {**_summary(ranks), "per_thread": _thread_summary(thread_instructions, thread_switches),
              "per_rank": ranks, "per_rank_threads": [{"instructions": i, "switches": s}
                                                      for i, s in zip(thread_instructions, thread_switches)],
              "workload": f"MLP {' -> '.join(map(str, SIZES))}, batch {BATCH} per rank, SGD, cross-entropy"}
    notes = ["instructions per iteration counted by callgrind, medians over ranks and turns [min-max]; "
             "DDP's part: a variant's main thread less local training's; the other threads (Gloo's) vary "
             "with timing and are not a measure of work. Counts, not times: the machine's load does not "
             "change them.",
             "per thread: each kind's threads summed, medians over ranks and turns [min-max]; threads woken: "
             "those that switched at all in a turn. Context switches come from a second run of the same turns "
             "without callgrind (/proc/self/task/*/status); unlike instructions they depend on timing and on "
             f"the machine's load ({options.world_size} ranks on the cores and load given above)."]
    return {"models": {MODEL: result}, "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"seed {o['seed']}, each DDP's default bucket cap; per variant {o['warmup']} warm-up iterations, then "
            f"{o['blocks']} counted turns of {o['block_iterations']} iterations, in the order "
            f"{', '.join(turns(o['blocks']))}.")


def _thousands(value: float) -> str:
    return f"{value / 1000:.1f}k"


def _main_table(data: dict) -> str:
    rows = []
    for model, r in data["models"].items():
        torch_added = r["per_iteration"][TORCH]["ddp_main"]
        for kind in KINDS:
            c = r["per_iteration"][kind]
            low, high = c["main_range"]
            rows.append([model, LABELS[kind], f"{_thousands(c['main'])} [{_thousands(low)}-{_thousands(high)}]",
                         _thousands(c["ddp_main"]) if kind != LOCAL else "",
                         markdown.ratio(c["ddp_main"] / torch_added) if kind != LOCAL else "",
                         _thousands(c["other_threads"])])
    return markdown.table(["model", "implementation", "main thread per iteration [range]", "DDP's part",
                           "DDP's part / torch's", "Gloo's threads (timing-dependent)"], rows)


def _measure_cell(entry: dict, measure: str) -> str:
    if measure not in entry:
        return "-"
    if measure == "woken":
        return f"{entry[measure]:g}"
    number = _thousands if measure == "instructions" else "{:.2f}".format
    low, high = entry[measure + "_range"]
    return f"{number(entry[measure])} [{number(low)}-{number(high)}]"


_THREAD_MEASURES = (("instructions", "instructions"), ("woken", "threads woken"),
                    ("voluntary", "voluntary switches"), ("nonvoluntary", "involuntary switches"))


def thread_table(r: dict) -> str:
    """Per kind of thread, side by side for every variant: instructions,
    threads woken and switches per iteration."""
    per_thread = r["per_thread"]
    rows = []
    for kind in thread_counts.present(per_thread):
        threads = max(per_thread[v][kind].get("threads", 0) for v in KINDS if kind in per_thread.get(v, {}))
        for measure, label in _THREAD_MEASURES:
            entries = [per_thread.get(v, {}).get(kind, {}) for v in KINDS]
            ours, theirs = per_thread.get(OURS, {}).get(kind, {}), per_thread.get(TORCH, {}).get(kind, {})
            ratio = (markdown.ratio(ours[measure] / theirs[measure])
                     if measure in ours and theirs.get(measure) else "-")
            rows.append([f"{kind} ({threads:g})", label, *[_measure_cell(e, measure) for e in entries], ratio])
    return markdown.table(["thread (how many)", "per iteration", *[LABELS[k] for k in KINDS],
                           f"{LABELS[OURS]} / {LABELS[TORCH]}"], rows)


def table(data: dict) -> str:
    tables = [_main_table(data)]
    tables += [f"Per thread, {model}:\n\n{thread_table(r)}" for model, r in data["models"].items() if "per_thread" in r]
    return "\n\n".join(tables)


def plot(data: dict, path: str) -> None:
    figure, axes = figures.panels(len(data["models"]), width_per_panel=7.0, height=3.5)
    for ax, (model, r) in zip(axes, data["models"].items()):
        kinds = list(DDP_KINDS)
        values = [r["per_iteration"][kind]["ddp_main"] / 1000 for kind in kinds]
        ax.bar(range(len(kinds)), values, color=[figures.COLORS.get(kind, "tab:cyan") for kind in kinds])
        ax.set_xticks(range(len(kinds)), [LABELS[k] for k in kinds], fontsize=7)
        ax.set_ylabel("thousand instructions per iteration")
        ax.set_title(f"{model}: DDP's part of the main thread", fontsize=9)
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks)")
