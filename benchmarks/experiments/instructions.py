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
"""

import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Dict, List

from benchmarks.harness import callgrind
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


def _count(options: BenchOptions, progress) -> List[List[callgrind.Dump]]:
    missing = callgrind.missing_tools()
    if missing:
        raise RuntimeError(f"instructions needs valgrind's callgrind: {', '.join(missing)} not found on PATH "
                           "(on Debian or Ubuntu: apt-get install valgrind)")
    order = ",".join(turns(options.blocks))
    # From the checkout's root, `python -m` finds benchmarks (and ddp_ext, where it is not installed).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = callgrind.environment(dict(os.environ))
    with tempfile.TemporaryDirectory() as folder:
        bases = [os.path.join(folder, f"rank{rank}") for rank in range(options.world_size)]
        logs = [open(base + ".log", "w") for base in bases]
        ranks = [subprocess.Popen(callgrind.command(base, [
                    sys.executable, "-m", "benchmarks.workloads.counted_rank", str(rank), str(options.world_size),
                    os.path.join(folder, "store"), str(options.block_iterations), str(options.warmup),
                    str(options.seed), str(options.threads), order]),
                    cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
                 for rank, (base, log) in enumerate(zip(bases, logs))]
        progress.say(f"{options.world_size} ranks under callgrind, turns {order}, "
                     f"{options.block_iterations} iterations each")
        try:
            failed = _wait(ranks, options.timeout_s)
        finally:
            for log in logs:
                log.close()
        if failed:
            raise RuntimeError("\n".join(f"{problem}:\n{_tail(bases[rank] + '.log')}" for rank, problem in failed))
        return [callgrind.read_dumps(base) for base in bases]


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


def run(options: BenchOptions, progress) -> dict:
    dumps = _count(options, progress)
    ranks = [per_iteration(rank_dumps, options.block_iterations) for rank_dumps in dumps]
    result = {**_summary(ranks), "per_rank": ranks,
              "workload": f"MLP {' -> '.join(map(str, SIZES))}, batch {BATCH} per rank, SGD, cross-entropy"}
    notes = ["instructions per iteration counted by callgrind, medians over ranks and turns [min-max]; "
             "DDP's part: a variant's main thread less local training's; the other threads (Gloo's) vary "
             "with timing and are not a measure of work. Counts, not times: the machine's load does not "
             "change them."]
    return {"models": {MODEL: result}, "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"seed {o['seed']}, each DDP's default bucket cap; per variant {o['warmup']} warm-up iterations, then "
            f"{o['blocks']} counted turns of {o['block_iterations']} iterations, in the order "
            f"{', '.join(turns(o['blocks']))}.")


def _thousands(value: float) -> str:
    return f"{value / 1000:.1f}k"


def table(data: dict) -> str:
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
