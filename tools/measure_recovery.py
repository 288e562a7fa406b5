"""Measures fault-tolerant training's recovery (docs/FAULT_TOLERANCE.md):
a coordinator and three replicas of tests/support/fault_tolerance_worker.py on this
machine, over Gloo on loopback.

    python tools/measure_recovery.py [--out recovery.json] [--heartbeat 2.0]

- kill_to_commit_s: from a replica's SIGKILL (mid-backward, and between
  steps) to the survivors' next committed step;
- hang_detect_s: from a replica's SIGSTOP to the survivors' next committed
  step (the collective and the coordinator both wait the heartbeat timeout);
- heal_s, heal_bytes: a replacement receiving the state from a live peer;
  wrap_s: a member re-wrapping the module over the new group;
- steps_lost: committed steps that some survivor does not hold (0 expected).
"""

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.fault_tolerance_harness import Run, check_run  # noqa: E402

STEPS = 40
AT = 20


def _commit_time(run, rid, step):
    return min(r["time"] for r in run.records(rid) if r["kind"] == "step" and r["step"] == step)


def _fault_time(run, rid):
    return [r["time"] for r in run.records(rid) if r["kind"] == "fault"][0]


def kill(tmp, fault, heartbeat):
    run = Run(tmp, min_replicas=3)
    try:
        for rid in ("r0", "r1", "r2"):
            run.start(rid, STEPS, heartbeat=heartbeat, fault=fault if rid == "r2" else "")
        run.wait(["r0", "r1", "r2"], 300)
        per_step = check_run(run, ["r0", "r1", "r2"], STEPS, finished=["r0", "r1"])
        next_step = AT + 1 if fault.startswith("kill-between") else AT
        wraps = [r["wrap_s"] for r in run.records("r0") if r["kind"] == "step" and r["step"] == next_step]
        return _commit_time(run, "r0", next_step) - _fault_time(run, "r2"), len(per_step), wraps[0]
    finally:
        run.close()


def stop(tmp, heartbeat):
    run = Run(tmp, min_replicas=3)
    try:
        for rid in ("r0", "r1", "r2"):
            run.start(rid, STEPS, heartbeat=heartbeat, fault=f"stop@{AT}" if rid == "r2" else "")
        run.wait(["r0", "r1"], 300)
        check_run(run, ["r0", "r1"], STEPS)
        return _commit_time(run, "r0", AT) - _fault_time(run, "r2")
    finally:
        run.close()


def replacement(tmp, heartbeat):
    run = Run(tmp, min_replicas=3)
    gate = tmp / "gate"
    try:
        for rid in ("r0", "r1", "r2"):
            run.start(rid, STEPS, heartbeat=heartbeat, fault="kill-between@3" if rid == "r2" else "",
                      gate=f"{AT}:{gate}" if rid != "r2" else "")
        run.wait_for(lambda: run.procs["r2"].poll() is not None, 300, "r2 to die")
        run.start("r3", STEPS, heartbeat=heartbeat)
        run.wait_for(lambda: any("r3" in m for m in run.epochs()), 300, "r3 to be let in")
        gate.touch()
        run.wait(["r0", "r1", "r3"], 300)
        check_run(run, ["r0", "r1", "r3"], STEPS, finished=["r0", "r1", "r3"])
        first = [r for r in run.records("r3") if r["kind"] == "step"][0]
        return first["heal_s"], first["heal_bytes"]
    finally:
        run.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="recovery.json")
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = pathlib.Path(tempfile.mkdtemp())
    result = {"heartbeat_timeout_s": args.heartbeat, "kill_to_commit_s": {}, "hang_detect_s": [], "wrap_s": []}
    lost = 0
    for i in range(args.repeats):
        for fault in (f"kill-backward@{AT}", f"kill-between@{AT}"):
            tmp = base / f"{fault.split('@')[0]}-{i}"
            tmp.mkdir()
            seconds, committed, wrap = kill(tmp, fault, args.heartbeat)
            lost += STEPS - committed
            result["kill_to_commit_s"].setdefault(fault.split("@")[0], []).append(round(seconds, 4))
            result["wrap_s"].append(round(wrap, 5))
        tmp = base / f"stop-{i}"
        tmp.mkdir()
        result["hang_detect_s"].append(round(stop(tmp, args.heartbeat), 4))
    tmp = base / "replacement"
    tmp.mkdir()
    heal_s, heal_bytes = replacement(tmp, args.heartbeat)
    result.update(heal_s=round(heal_s, 5), heal_bytes=heal_bytes, steps_lost=lost,
                  median_kill_to_commit_s=statistics.median(sum(result["kill_to_commit_s"].values(), [])),
                  median_hang_detect_s=statistics.median(result["hang_detect_s"]),
                  load_average=os.getloadavg(), command=" ".join(sys.argv))
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
