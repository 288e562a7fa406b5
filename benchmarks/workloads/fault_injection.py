"""One rank fails on purpose while the others train: `run_fault(wrapper, fault, world_size)`.

Every rank trains a small MLP under a DDP wrapper (ddp_ext's or torch's);
at iteration FAULT_ITERATION the victim rank

- kill_forward: is SIGKILLed in the middle of its forward (a forward
  pre-hook of a middle layer);
- kill_backward: is SIGKILLed in the middle of its backward, from a hook on
  the first layer's weight gradient: the last to be computed, so the buckets
  of the later layers (one bucket per layer) have been launched;
- kill_between: is SIGKILLed after its optimizer step, between iterations;
- raise: raises an exception in its forward, which ends its process
  (status 1), as an uncaught exception ends a training script.

Just before the fault the victim writes the time (time.monotonic(), one
clock for every process of the machine) to a file; each survivor records
when it caught its error. The difference is the survivor's time to error.
"""

import dataclasses
import os
import signal
import tempfile
import time
from typing import List, Optional

FAULTS = ("kill_forward", "kill_backward", "kill_between", "raise")
WRAPPERS = ("ddp_ext", "torch")

FAULT_ITERATION = 3
ITERATIONS = 20  # survivors need collectives after the fault, so must not finish
LAYERS = 4
WIDTH = 64
BATCH = 8
# One layer's weight and bias, 16,640 bytes: every Linear layer's gradients
# fill a bucket of their own (ddp_ext fills a bucket up to its cap, torch's
# DDP closes one on reaching it; both give a bucket per layer).
LAYER_BYTES = (WIDTH + 1) * WIDTH * 4
BUCKET_CAP_MB = LAYER_BYTES / 2**20
# Run deadline beyond the process-group timeout (rank start, teardown).
DEADLINE_MARGIN_S = 30.0
ERROR_TEXT_CHARS = 300


class InjectedFault(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class FaultJob:
    wrapper: str  # one of WRAPPERS
    fault: str  # one of FAULTS
    victim: int
    fault_file: str


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def wrap(wrapper: str, module, **kwargs):
    if wrapper == "ddp_ext":
        import ddp_ext

        return ddp_ext.DistributedDataParallel(module, **kwargs)
    import torch

    return torch.nn.parallel.DistributedDataParallel(module, **kwargs)


def _arm(job: FaultJob, model, iteration: dict):
    """Installs the victim's fault; returns what to call after each optimizer step."""

    def fire(*_):
        if iteration["now"] != FAULT_ITERATION:
            return
        with open(job.fault_file, "w") as f:
            f.write(repr(time.monotonic()))
        if job.fault == "raise":
            raise InjectedFault(f"fault injected into rank {job.victim}'s forward")
        os.kill(os.getpid(), signal.SIGKILL)

    if job.fault in ("kill_forward", "raise"):
        model[LAYERS // 2].register_forward_pre_hook(fire)
    elif job.fault == "kill_backward":
        model[0][0].weight.register_hook(fire)
    return fire if job.fault == "kill_between" else (lambda: None)


def train_until_fault(rank: int, world_size: int, job: FaultJob) -> dict:
    """Trains ITERATIONS iterations; returns how this rank's training ended."""
    import torch

    model = build_model()
    ddp = wrap(job.wrapper, model, bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    iteration = {"now": -1}
    after_step = _arm(job, model, iteration) if rank == job.victim else (lambda: None)
    generator = torch.Generator().manual_seed(rank)
    # Read when reporting, not at construction: the first rebuild lays torch's first bucket out again.
    buckets = (lambda: len(ddp.bucket_indices())) if hasattr(ddp, "bucket_indices") else (lambda: None)
    phase = "forward"
    try:
        for i in range(ITERATIONS):
            iteration["now"] = i
            phase = "forward"
            loss = ddp(torch.randn(BATCH, WIDTH, generator=generator)).pow(2).mean()
            phase = "backward"
            loss.backward()
            phase = "step"
            optimizer.step()
            optimizer.zero_grad()
            after_step()
    except InjectedFault:
        raise
    except Exception as error:
        caught = time.monotonic()
        text = str(error).strip()
        return {
            "raised": True,
            "error_time": caught,
            "error_type": type(error).__name__,
            "error": (text.splitlines()[0] if text else "")[:ERROR_TEXT_CHARS],
            "phase": phase,
            "iteration": iteration["now"],
            "buckets": buckets(),
        }
    return {"raised": False, "phase": "finished", "iteration": iteration["now"], "buckets": buckets()}


@dataclasses.dataclass
class FaultRun:
    wrapper: str
    fault: str
    world_size: int
    victim: int
    pg_timeout_s: float
    outcomes: list  # fault_worlds.RankOutcome by rank
    fault_time: Optional[float]  # None: the victim never reached its fault

    @property
    def survivors(self) -> list:
        return [o for o in self.outcomes if o.rank != self.victim]

    def _raised(self, outcome) -> bool:
        return outcome.returned and outcome.value["raised"]

    def times_to_error(self) -> List[float]:
        """Seconds from the fault to each survivor's error, by survivor rank."""
        if self.fault_time is None:
            return []
        return [o.value["error_time"] - self.fault_time for o in self.survivors if self._raised(o)]

    def errors(self) -> List[dict]:
        return [o.value for o in self.survivors if self._raised(o)]

    def problems(self) -> List[str]:
        """Everything that differs from: the victim fails as told, and every
        survivor raises an exception and then exits cleanly."""
        found = []
        victim = self.outcomes[self.victim]
        expected_exit = 1 if self.fault == "raise" else -signal.SIGKILL
        if self.fault_time is None:
            found.append(f"rank {self.victim} never reached its fault: {victim.error or victim.value}")
        if victim.exitcode != expected_exit:
            found.append(f"victim rank {self.victim} exit code {victim.exitcode}, expected {expected_exit}")
        for o in self.survivors:
            if o.hung:
                found.append(f"rank {o.rank} was still running at the deadline (hang); killed")
            elif o.exitcode != 0:
                found.append(f"rank {o.rank} died with exit code {o.exitcode} (signal if negative)")
            if o.error is not None:
                found.append(f"rank {o.rank}: an exception escaped its training loop:\n{o.error}")
            elif not o.returned:
                found.append(f"rank {o.rank} reported nothing")
            elif not o.value["raised"]:
                found.append(f"rank {o.rank} finished all {ITERATIONS} iterations without an error")
        return found

    def describe(self) -> str:
        times = ", ".join(f"{t:.3f}" for t in self.times_to_error())
        lines = [f"{self.wrapper} {self.fault}, {self.world_size} ranks, victim rank {self.victim}: "
                 f"survivors' time to error {times or '-'} s"]
        lines += [f"  rank {o.rank}: exit {o.exitcode}; " + (
            f"{o.value['error_type']} in {o.value['phase']} of iteration {o.value['iteration']}: {o.value['error']}"
            if self._raised(o) else str(o.error or o.value)) for o in self.outcomes if o.rank != self.victim]
        return "\n".join(lines)


def run_fault(wrapper: str, fault: str, world_size: int, victim: int = 1, pg_timeout_s: float = 20.0) -> FaultRun:
    from benchmarks.workloads.fault_worlds import run_world

    assert wrapper in WRAPPERS and fault in FAULTS and 0 <= victim < world_size
    with tempfile.TemporaryDirectory(prefix="ddp_ext_fault_") as tmp:
        job = FaultJob(wrapper, fault, victim, os.path.join(tmp, "fault_time"))
        outcomes = run_world(train_until_fault, world_size, job, pg_timeout_s, pg_timeout_s + DEADLINE_MARGIN_S)
        fault_time = None
        if os.path.exists(job.fault_file):
            with open(job.fault_file) as f:
                fault_time = float(f.read())
    return FaultRun(wrapper, fault, world_size, victim, pg_timeout_s, outcomes, fault_time)
