"""The recovery experiment's runs: replicas of
benchmarks/workloads/recovery_replica.py trained with
ddp_ext.fault_tolerance (a coordinator process, replicas restarted one by
one as a per-replica torchrun agent would) or restarted by one
`torchrun --max-restarts` from checkpoints, each for a fixed time from its
first step, with one replica SIGKILLed at given times; and one
fault-tolerant run with a replica SIGSTOPped, which waits (at most
STOPPED_WAIT_S) for the survivors' first step committed without it."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

DEADLINE_S = 600.0  # beyond the run's own length
# After a SIGSTOP, how long to wait for a step committed without the stopped
# replica: many heartbeat timeouts, far beyond any figure worth recording.
STOPPED_WAIT_S = 60.0
STEPS_FOREVER = 10**9  # the runs are ended by time


def _records(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    # The last line may be one a running process is still writing.
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _steps(path: str) -> List[dict]:
    return [r for r in _records(path) if "step" in r and r.get("kind") is None]


def _replica_cmd(mode: str, steps: int, out: str, **extra) -> List[str]:
    cmd = ["-m", "benchmarks.workloads.recovery_replica", "--mode", mode, "--steps", str(steps), "--out", out]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


class _Coordinator:
    def __init__(self, log, replicas: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_ext.fault_tolerance.coordinator", "--port", "0", "--host", "127.0.0.1",
             "--min-replicas", str(replicas)],
            stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"the coordinator did not start: {line!r}")
        self.address = "127.0.0.1:" + dict(kv.split("=") for kv in line.split()[3:])["port"]

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def _wait_until(predicate, what: str, deadline: float, pause: float = 0.005) -> None:
    if not _holds_by(predicate, deadline, pause):
        raise TimeoutError(f"recovery: timed out waiting for {what}")


def _holds_by(predicate, deadline: float, pause: float = 0.005) -> bool:
    """Whether `predicate` came to hold before the monotonic `deadline`."""
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
    return True


def _latest(path: str) -> int:
    steps = _steps(path)
    return steps[-1]["step"] if steps else -1


def progress_at(steps: List[dict], t: float) -> int:
    """Committed steps held at time t: the step after the last one recorded by
    then (a restarted job records from its checkpoint again, so its progress
    can fall back)."""
    before = [r for r in steps if r["time"] <= t]
    return before[-1]["step"] + 1 if before else 0


def steps_past(steps: List[dict], stop: dict) -> List[dict]:
    """The `steps` committed after `stop` (its time, and the last step committed before it)."""
    return [r for r in steps if r["time"] > stop["time"] and r["step"] > stop["after_step"]]


def first_commit_without(steps: List[dict], stop: dict, replicas: int):
    """The first of `steps` past `stop` committed by fewer than `replicas`:
    without the stopped replica. None if there is none yet. The first steps
    past the stop may still carry the stopped replica's vote, cast before it
    stopped."""
    return next((r for r in steps_past(steps, stop) if r["world_size"] < replicas), None)


def progress_series(steps: List[dict], t0: float, window_s: float, every_s: float = 1.0) -> List[Tuple[float, int]]:
    """(seconds since t0, committed steps held) every `every_s` over the window."""
    count = int(window_s / every_s)
    return [(i * every_s, progress_at(steps, t0 + i * every_s)) for i in range(count + 1)]


def run_fault_tolerant(tmp: str, replicas: int, window_s: float, kill_at_s: List[float], heartbeat: float,
                       stop_at_s: float = -1.0) -> Dict:
    """Runs for `window_s` seconds from r0's first committed step; at each
    time of `kill_at_s` (seconds into the window) SIGKILLs the last replica
    and starts it again at once; with stop_at_s >= 0, SIGSTOPs it there
    instead, once, and ends at the survivors' first step committed without
    it (first_commit_without), or STOPPED_WAIT_S after the stop if none came
    (the analysis names the figure then missing)."""
    tmp = tempfile.mkdtemp(prefix="ft-", dir=tmp)  # this run's own files
    names = [f"r{i}" for i in range(replicas)]
    victim_id = names[-1]
    log = open(os.path.join(tmp, "ft.log"), "a")
    coordinator = _Coordinator(log, replicas)
    outs = {rid: os.path.join(tmp, f"ft-{rid}.jsonl") for rid in names}
    procs = {}

    def start(rid):
        cmd = _replica_cmd("ft", STEPS_FOREVER, outs[rid], coordinator=coordinator.address, id=rid,
                           heartbeat=heartbeat)
        procs[rid] = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=log)

    deadline = time.monotonic() + window_s + DEADLINE_S
    kills, stop = [], None
    try:
        for rid in names:
            start(rid)
        _wait_until(lambda: _latest(outs["r0"]) >= 0, "the first step", deadline)
        t0 = _steps(outs["r0"])[0]["time"]
        for at in kill_at_s:
            _wait_until(lambda: time.time() >= t0 + at or procs["r0"].poll() is not None, f"{at} s", deadline)
            if procs["r0"].poll() is not None:
                break
            procs[victim_id].kill()
            kills.append({"time": time.time(), "after_step": _latest(outs["r0"])})
            procs[victim_id].wait()
            start(victim_id)
        if stop_at_s >= 0:
            _wait_until(lambda: time.time() >= t0 + stop_at_s, f"{stop_at_s} s", deadline)
            procs[victim_id].send_signal(signal.SIGSTOP)
            stop = {"time": time.time(), "after_step": _latest(outs["r0"]), "wait_limit_s": STOPPED_WAIT_S}

            def alone():
                return first_commit_without(_steps(outs["r0"]), stop, replicas) is not None

            _holds_by(lambda: alone() or procs["r0"].poll() is not None,
                      min(deadline, time.monotonic() + STOPPED_WAIT_S), 0.05)
            window_s = time.time() - t0
        _wait_until(lambda: time.time() >= t0 + window_s or procs["r0"].poll() is not None, "the window's end",
                    deadline)
        if procs["r0"].poll() is not None:
            raise RuntimeError(f"recovery: replica r0 exited with {procs['r0'].returncode}; see {log.name}")
        if kills:  # past the window if need be: the last replacement's heal
            _wait_until(lambda: any(r["time"] > kills[-1]["time"] and r["heal_bytes"] > 0
                                    for r in _steps(outs[victim_id])), "the replacement's heal", deadline, 0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        coordinator.close()
        log.close()
    victim = _steps(outs[victim_id])
    heals = [r for r in victim if r["heal_bytes"] > 0 and r["time"] > (kills[-1]["time"] if kills else 0)]
    return {"steps": _steps(outs["r0"]), "t0": t0, "window_s": window_s, "kills": kills, "stop": stop,
            "heal_bytes": heals[0]["heal_bytes"] if heals and kills else None,
            "heal_s": heals[0]["heal_s"] if heals and kills else None}


def _stop_job(agent: subprocess.Popen, pids: List[int]) -> None:
    """Ends a torchrun job: its agent stops its workers on SIGTERM; any worker
    still alive after that is killed."""
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_restart(tmp: str, replicas: int, window_s: float, kill_at_s: List[float], checkpoint_every: int) -> Dict:
    """torch's answer: one torchrun job of `replicas` workers restarting from
    the checkpoint rank 0 writes every `checkpoint_every` steps, run for
    `window_s` seconds from its first step; the last rank is SIGKILLed at each
    time of `kill_at_s`."""
    tmp = tempfile.mkdtemp(prefix="restart-", dir=tmp)  # this run's own files
    out = os.path.join(tmp, "restart.jsonl")
    log = open(os.path.join(tmp, "restart.log"), "a")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={replicas}",
           f"--max-restarts={len(kill_at_s) + 1}", "--standalone", "--monitor-interval=0.1",
           *_replica_cmd("restart", STEPS_FOREVER, out, checkpoint=os.path.join(tmp, "checkpoint.pt"),
                         checkpoint_every=checkpoint_every)]
    agent = subprocess.Popen(cmd, stdout=log, stderr=log)
    rank0 = f"{out}.rank0"
    outs = [f"{out}.rank{r}" for r in range(replicas)]
    deadline = time.monotonic() + window_s + DEADLINE_S
    kills = []
    try:
        _wait_until(lambda: _latest(rank0) >= 0 or agent.poll() is not None, "the first step", deadline)
        if agent.poll() is not None:
            raise RuntimeError(f"recovery: the torchrun job exited with {agent.returncode}; see {log.name}")
        t0 = _steps(rank0)[0]["time"]
        for at in kill_at_s:
            _wait_until(lambda: time.time() >= t0 + at or agent.poll() is not None, f"{at} s", deadline)
            if agent.poll() is not None:
                break
            pid = [r for r in _records(outs[-1]) if r.get("kind") == "pid"][-1]["pid"]
            kills.append({"time": time.time(), "after_step": _latest(rank0)})
            os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: time.time() >= t0 + window_s or agent.poll() is not None, "the window's end", deadline)
        if agent.poll() is not None:
            raise RuntimeError(f"recovery: the torchrun job exited with {agent.returncode}; see {log.name}")
    finally:
        _stop_job(agent, [r["pid"] for path in outs for r in _records(path) if r.get("kind") == "pid"])
        log.close()
    return {"steps": _steps(rank0), "t0": t0, "window_s": window_s, "kills": kills,
            "resumed": [{"step": r["step"], "time": r["time"]} for r in _records(rank0) if r.get("kind") == "resumed"]}
