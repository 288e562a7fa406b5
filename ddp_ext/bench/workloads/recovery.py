"""The recovery experiment's runs: replicas of
ddp_ext/bench/workloads/recovery_replica.py trained with
ddp_ext.fault_tolerance (a coordinator process, replicas restarted one by
one as a per-replica torchrun agent would) or restarted by one
`torchrun --max-restarts` from checkpoints, with one replica SIGKILLed at
given steps; and one fault-tolerant run with a replica SIGSTOPped."""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

DEADLINE_S = 600.0


def _records(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steps(path: str) -> List[dict]:
    return [r for r in _records(path) if "step" in r and r.get("kind") is None]


def _replica_cmd(mode: str, steps: int, out: str, **extra) -> List[str]:
    cmd = ["-m", "ddp_ext.bench.workloads.recovery_replica", "--mode", mode, "--steps", str(steps), "--out", out]
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


def _wait_until(predicate, what: str, deadline: float) -> None:
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"recovery: timed out waiting for {what}")
        time.sleep(0.005)


def _latest(path: str) -> int:
    steps = _steps(path)
    return steps[-1]["step"] if steps else -1


def run_fault_tolerant(tmp: str, replicas: int, steps: int, kill_at: List[int], heartbeat: float,
                       stop_at: int = -1) -> Dict:
    """Kills the last replica when r0 has committed each step of `kill_at` (and a
    replacement started after the previous kill has committed a step), then
    starts it again; with stop_at >= 0, SIGSTOPs it there instead, once."""
    names = [f"r{i}" for i in range(replicas)]
    victim_id = names[-1]
    log = open(os.path.join(tmp, "ft.log"), "a")
    coordinator = _Coordinator(log, replicas)
    outs = {rid: os.path.join(tmp, f"ft-{rid}.jsonl") for rid in names}
    procs = {}

    def start(rid):
        cmd = _replica_cmd("ft", steps, outs[rid], coordinator=coordinator.address, id=rid, heartbeat=heartbeat)
        procs[rid] = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=log)

    deadline = time.monotonic() + DEADLINE_S
    kills, stop = [], None
    try:
        for rid in names:
            start(rid)
        for at in kill_at:
            committed_before = len(_steps(outs[victim_id]))
            _wait_until(lambda: _latest(outs["r0"]) >= at and len(_steps(outs[victim_id])) > 0,
                        f"step {at}", deadline)
            if procs["r0"].poll() is not None:
                break
            procs[victim_id].kill()
            kills.append({"time": time.time(), "after_step": _latest(outs["r0"])})
            procs[victim_id].wait()
            start(victim_id)
            _wait_until(lambda: len(_steps(outs[victim_id])) > committed_before or procs["r0"].poll() is not None,
                        "the replacement to commit a step", deadline)
        if stop_at >= 0:
            _wait_until(lambda: _latest(outs["r0"]) >= stop_at, f"step {stop_at}", deadline)
            procs[victim_id].send_signal(signal.SIGSTOP)
            stop = {"time": time.time(), "after_step": _latest(outs["r0"])}
            _wait_until(lambda: _latest(outs["r0"]) > stop["after_step"], "the survivors to go on", deadline)
            procs[victim_id].kill()
        _wait_until(lambda: procs["r0"].poll() is not None, "r0 to finish", deadline)
        if procs["r0"].returncode != 0:
            raise RuntimeError(f"recovery: replica r0 exited with {procs['r0'].returncode}; see {log.name}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        coordinator.close()
        log.close()
    victim = _steps(outs[victim_id])
    heals = [r for r in victim if r["heal_bytes"] > 0]
    return {"steps": _steps(outs["r0"]), "kills": kills, "stop": stop,
            "heal_bytes": heals[-1]["heal_bytes"] if heals else None,
            "heal_s": heals[-1]["heal_s"] if heals else None}


def run_restart(tmp: str, replicas: int, steps: int, kill_at: List[int], checkpoint_every: int) -> Dict:
    """torch's answer: one torchrun job of three workers restarting from the
    checkpoint rank 0 writes every `checkpoint_every` steps; the last rank is
    SIGKILLed when rank 0 has done each step of `kill_at`."""
    out = os.path.join(tmp, "restart.jsonl")
    log = open(os.path.join(tmp, "restart.log"), "a")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={replicas}",
           f"--max-restarts={len(kill_at) + 1}", "--standalone", "--monitor-interval=0.1",
           *_replica_cmd("restart", steps, out, checkpoint=os.path.join(tmp, "checkpoint.pt"),
                         checkpoint_every=checkpoint_every)]
    agent = subprocess.Popen(cmd, stdout=log, stderr=log)
    rank0, victim = f"{out}.rank0", f"{out}.rank{replicas - 1}"
    deadline = time.monotonic() + DEADLINE_S
    kills = []
    try:
        for at in kill_at:
            pids_before = len([r for r in _records(victim) if r.get("kind") == "pid"])
            _wait_until(lambda: (_latest(rank0) >= at and len([r for r in _records(victim) if r.get("kind") == "pid"])
                                 >= max(pids_before, 1)) or agent.poll() is not None, f"step {at}", deadline)
            if agent.poll() is not None:
                break
            pid = [r for r in _records(victim) if r.get("kind") == "pid"][-1]["pid"]
            kills.append({"time": time.time(), "after_step": _latest(rank0)})
            os.kill(pid, signal.SIGKILL)
            # Wait for the restarted job to record progress before the next kill.
            _wait_until(lambda: len([r for r in _records(rank0) if r.get("kind") == "resumed"]) > len(kills)
                        or agent.poll() is not None, "the restart", deadline)
        _wait_until(lambda: agent.poll() is not None, "the job to finish", deadline)
        if agent.returncode != 0:
            raise RuntimeError(f"recovery: the torchrun job exited with {agent.returncode}; see {log.name}")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()
    return {"steps": _steps(rank0), "kills": kills,
            "resumed": [r["step"] for r in _records(rank0) if r.get("kind") == "resumed"]}
