"""Starting a coordinator and replicas as processes, injecting faults and
checking the outcome against local training (tests/fault_tolerance/test_fault_tolerance_*)."""

import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import torch

from tests.support import fault_tolerance_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "fault_tolerance_worker.py")


def _env(host=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    if host is not None:
        env["GLOO_SOCKET_IFNAME"] = host.veth  # Gloo on the host's link, as docs/FAULT_TOLERANCE.md says
    return env


def _on(host, cmd: List[str]) -> List[str]:
    """`cmd` run on a host of benchmarks/harness/fake_hosts.py (None: this one)."""
    return cmd if host is None else ["ip", "netns", "exec", host.netns, *cmd]


def _forked_main(module: str, argv: List[str], log_path: str) -> None:
    """A forked process's body: `module`.main(argv), its output to log_path."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 (_env()) makes a started process's
    sys.exit(importlib.import_module(module).main(argv))


def forked(module: str, argv: List[str], log_path: str) -> "_Forked":
    """`module`.main(argv) in a process forked from the forkserver (see
    forkserver()), with the Popen calls Run uses."""
    process = forkserver().Process(target=_forked_main, args=(module, argv, log_path), daemon=False)
    process.start()
    return _Forked(process)


class _Forked:
    """A worker forked from the forkserver, with the Popen calls Run uses."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("forked worker", timeout)
        return self.process.exitcode

    def send_signal(self, sig):
        os.kill(self.pid, sig)

    def kill(self):
        if self.process.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)


def forkserver():
    """A multiprocessing context whose server has imported torch, ddp_ext and
    the worker once: a replica forked from it is a new process with fresh
    state, started in milliseconds instead of the seconds that importing
    torch takes on a loaded machine."""
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: torch.optim imports it on first use, a few seconds on a loaded machine.
    context.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "ddp_ext", "ddp_ext.fault_tolerance",
                                    "tests.support.fault_tolerance_worker", "tests.support.fault_tolerance_harness",
                                    "tests.diloco.surviving_worker"])
    return context


class Run:
    """A coordinator and the replicas of one test, all killed at the end.
    `host` (a fake_hosts.Host) runs the coordinator in that namespace,
    listening on the host's address."""

    def __init__(self, tmp_path, min_replicas: int = 1, run_id: str = "default", host=None):
        self.tmp = tmp_path
        self.procs: Dict[str, subprocess.Popen] = {}
        self.coordinator = subprocess.Popen(
            _on(host, [sys.executable, "-m", "ddp_ext.fault_tolerance.coordinator", "--port", "0", "--host",
                       "127.0.0.1" if host is None else "0.0.0.0", "--min-replicas", str(min_replicas),
                       "--run-id", run_id]),
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in self.coordinator.stdout:  # c10d may warn first (no hostname in a namespace)
            seen.append(line)
            if "ready" in line or len(seen) > 20:
                break
        if not seen or "ready" not in seen[-1]:
            self.close()
            raise RuntimeError(f"coordinator did not start: {''.join(seen)!r}")
        line = seen[-1]
        fields = dict(kv.split("=") for kv in line.split()[3:])
        self.address = f"{'127.0.0.1' if host is None else host.addr}:{fields['port']}"
        self.coordinator_lines: List[str] = []
        threading.Thread(target=self._read_coordinator, daemon=True).start()

    def _read_coordinator(self) -> None:
        for line in self.coordinator.stdout:
            self.coordinator_lines.append(line.strip())

    def epochs(self) -> List[List[str]]:
        """The memberships the coordinator announced, in order."""
        return [json.loads(line.split(": ", 1)[1].replace("'", '"')) for line in list(self.coordinator_lines)
                if line.startswith("epoch ")]

    def start(self, replica_id: str, steps: int, host=None, **options) -> str:
        """Starts a worker (on `host`, a fake_hosts.Host, if given)."""
        out = str(self.tmp / f"{replica_id}.jsonl")
        cmd = [sys.executable, WORKER, "--coordinator", options.pop("coordinator", self.address), "--id", replica_id,
               "--steps", str(steps), "--out", out]
        for key, value in options.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        log = open(str(self.tmp / f"{replica_id}.log"), "w")
        self.procs[replica_id] = subprocess.Popen(_on(host, cmd), cwd=ROOT, env=_env(host), stdout=log,
                                                  stderr=subprocess.STDOUT)
        return out

    def fork(self, replica_id: str, steps: int, **options) -> str:
        """As start(), forked from the forkserver (see forkserver())."""
        out = str(self.tmp / f"{replica_id}.jsonl")
        argv = ["--coordinator", options.pop("coordinator", self.address), "--id", replica_id,
                "--steps", str(steps), "--out", out]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.procs[replica_id] = forked(worker.__name__, argv, str(self.tmp / f"{replica_id}.log"))
        return out

    def records(self, replica_id: str) -> List[dict]:
        path = self.tmp / f"{replica_id}.jsonl"
        if not path.exists():
            return []
        # The last piece after the final newline is a record still being written, or
        # one cut short by a kill: only whole lines are records.
        whole = path.read_text().split("\n")[:-1]
        return [json.loads(line) for line in whole if line.strip()]

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        self.dump_stacks()
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")

    def dump_stacks(self) -> None:
        """Every live replica writes its threads' stacks to its log."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(1.0)

    def wait(self, replica_ids, timeout: float = 300.0) -> Dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for rid in replica_ids:
            left = max(0.1, deadline - time.monotonic())
            try:
                codes[rid] = self.procs[rid].wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.dump_stacks()
                raise AssertionError(f"replica {rid} did not finish within {timeout} s\n{self.logs()}")
        return codes

    def signal(self, replica_id: str, sig) -> None:
        os.kill(self.procs[replica_id].pid, sig)

    def logs(self) -> str:
        parts = ["--- coordinator ---\n" + "\n".join(self.coordinator_lines[-40:])]
        for rid in self.procs:
            path = self.tmp / f"{rid}.log"
            if path.exists():
                parts.append(f"--- {rid} ---\n{path.read_text()[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in list(self.procs.values()) + [self.coordinator]:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                except OSError:
                    pass
                proc.kill()
                proc.wait(timeout=10)
        if self.coordinator.stdout:
            self.coordinator.stdout.close()


@contextlib.contextmanager
def runs_closed_after(tmp_path, **defaults):
    """A maker of Runs (keyword arguments on top of `defaults`), each closed
    when the block ends: the body of the tests' `run` fixtures."""
    made: List[Run] = []

    def make(**kwargs) -> Run:
        made.append(Run(tmp_path, **defaults, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for r in made:
            r.close()


def reference(first_source: str, steps: int, kind: str = "mlp") -> List[torch.Tensor]:
    """Local training from the first quorum's rank 0 model: each step on the
    whole global batch, which is the concatenation of the quorum's shards."""
    net = worker.model(worker.seed_of(first_source), kind)
    opt = worker.optimizer(net)
    for step in range(steps):
        opt.zero_grad()
        x, y = worker.global_batch(step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def check_run(run: Run, replica_ids, steps: int, finished: Optional[List[str]] = None,
              kind: str = "mlp", tolerance: Optional[dict] = None) -> Dict[int, dict]:
    """Every committed step: the replicas that recorded it are members of
    its quorum and hold bitwise equal parameters; every finished replica's
    parameters equal local training on the quorums' concatenated shards
    (within `tolerance`, float32 rounding by default)."""
    per_step: Dict[int, dict] = {}
    for rid in replica_ids:
        for r in run.records(rid):
            if r["kind"] != "step":
                continue
            assert rid in r["members"] and r["members"][r["rank"]] == rid
            assert r["world_size"] == len(r["members"])
            seen = per_step.setdefault(r["step"], {"members": r["members"], "hashes": {}})
            assert seen["members"] == r["members"], f"step {r['step']}: {seen['members']} vs {r['members']}"
            seen["hashes"][rid] = r["hash"]
    assert sorted(per_step) == list(range(steps)), f"committed steps {sorted(per_step)}"
    for step, seen in per_step.items():
        assert len(set(seen["hashes"].values())) == 1, f"step {step}: replicas differ: {seen['hashes']}"
    expected = reference(per_step[0]["members"][0], steps, kind)
    for rid in finished if finished is not None else replica_ids:
        done = [r for r in run.records(rid) if r["kind"] == "done"]
        assert done, f"{rid} did not finish\n{run.logs()}"
        for got, want in zip(done[0]["params"], expected):
            torch.testing.assert_close(torch.tensor(got), want, **(tolerance or dict(rtol=1e-4, atol=1e-5)))
    return per_step
