"""Exit status of a finished 2-rank training job, many times over.

Each run starts two Python processes, one per rank, that train a small MLP
for 5 steps over a Gloo process group, end with `dist.barrier()`, and then
either call `dist.destroy_process_group()` or not. Half of the runs register
`_register_fused_optim` on a subset of the parameters (the first layer) and
step the rest with an ordinary optimizer; half free the model when the
rank's function returns (a script's `main()`), half keep it until the
interpreter's shutdown (a module-level model). The 8 variants are
interleaved run by run, and the same sequence runs with ddp_ext's
DistributedDataParallel and with torch's, alternating.

    nice -n 10 python tests/support/exit_runs.py --runs 200            # both DDPs
    python tests/support/exit_runs.py --runs 16 --ddp ddp_ext --jobs 1 --json counts.json

Ranks are forked from this process once it has imported torch and ddp_ext
(--launch fork, the default; see _preload) or started as fresh
interpreters (--launch exec, slower); either way each leaves through the
interpreter's own shutdown. It prints, per DDP and variant, how many runs
had every rank exit with status 0, and the exit status, signal or hang of
the others (their output is kept under --keep). A rank still running
--timeout seconds after its job started is killed and counted as hung.
Exit status: 0 if every ddp_ext run ended with every rank at 0 (torch's
DDP is only a comparison), 1 otherwise.

See Note [Exit after training] in ddp_ext/_exit.py.
"""

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DDPS = ("ddp_ext", "torch")
# (destroy_process_group() at the end, _register_fused_optim on a subset,
#  the model kept alive until the interpreter's shutdown)
VARIANTS = tuple((destroy, fused, kept) for kept in (False, True) for fused in (False, True)
                 for destroy in (True, False))
WORLD_SIZE = 2
_KEPT = []  # a rank's model, when the variant keeps it to the interpreter's shutdown


def variant_name(destroy: bool, fused: bool, kept: bool) -> str:
    return (("destroy" if destroy else "no-destroy") + ("+fused-subset" if fused else "")
            + ("+model-kept" if kept else ""))


# --- one rank -------------------------------------------------------------


def rank_main(rank: int, world_size: int, store_path: str, ddp: str, destroy: bool, fused: bool, kept: bool,
              steps: int) -> None:
    """One rank's training job; returns normally, so that the process exits
    through the interpreter's shutdown as a training script's does. The
    model is freed when this function returns, as a script's `main()`
    frees it, or with `kept` only in the interpreter's shutdown, as a
    module-level model is."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    if ddp == "ddp_ext":
        import ddp_ext

        wrapper = ddp_ext.DistributedDataParallel
    else:
        wrapper = nn.parallel.DistributedDataParallel
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model = wrapper(model)
    params = list(model.module.parameters())
    if fused:
        # The first layer is stepped as its gradients are reduced, the rest
        # by an ordinary optimizer after backward.
        model._register_fused_optim(torch.optim.SGD, 0.01, optim_params=params[:2])
        optimizer = torch.optim.SGD(params[2:], lr=0.01)
    else:
        optimizer = torch.optim.SGD(params, lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    if destroy:
        dist.destroy_process_group()
    if kept:
        _KEPT.append((model, optimizer))


# --- one job --------------------------------------------------------------


def _describe(code) -> str:
    if code is None:
        return "hung"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def run_job(ddp: str, destroy: bool, fused: bool, kept: bool = False, steps: int = 5, timeout_s: float = 90.0,
            keep: str = "", env=None) -> dict:
    """Starts WORLD_SIZE fresh interpreters for one job and waits for them.
    Returns {"codes": [returncode or None if killed after timeout_s, ...],
    "ok": every rank exited 0, "output": {rank: its output} for a failed job}."""
    workdir = tempfile.mkdtemp(prefix="ddp_ext-exit-")
    procs, logs = [], []
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("PYTHONPATH", ROOT)
    try:
        for rank in range(WORLD_SIZE):
            log = open(os.path.join(workdir, f"rank{rank}.log"), "w+b")
            logs.append(log)
            rank_env = dict(run_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                            LOCAL_WORLD_SIZE=str(WORLD_SIZE))
            cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank),
                   "--store", os.path.join(workdir, "store"), "--ddp", ddp, "--steps", str(steps)]
            cmd += ["--destroy"] if destroy else []
            cmd += ["--fused"] if fused else []
            cmd += ["--kept"] if kept else []
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ok = all(code == 0 for code in codes)
        output = {}
        if not ok:
            for rank, log in enumerate(logs):
                log.seek(0)
                output[rank] = log.read().decode(errors="replace")[-4000:]
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copytree(workdir, os.path.join(keep, os.path.basename(workdir)), dirs_exist_ok=True)
        return {"codes": codes, "ok": ok, "output": output}
    finally:
        for log in logs:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


# --- forked jobs ----------------------------------------------------------

# Note on --launch fork: the parent imports torch, ddp_ext and torch's
# overlapped optimizers once and forks every rank from its main thread (it
# runs no other thread and never initializes a process group). Each child
# then leaves through the interpreter's own shutdown (sys.exit: atexit
# functions, threading's shutdown, Py_FinalizeEx, then the C++ static
# destructors in exit()), as an exec'd interpreter does; only the imports
# are shared. It saves the seconds of imports per rank that a loaded
# 2-core machine cannot spare. --launch exec starts fresh interpreters.


def _preload(ddps) -> None:
    import importlib

    # torch._dynamo: both DDPs' first forward imports it; the overlap module:
    # _register_fused_optim imports it (with FSDP), seconds each.
    for name in ("torch", "torch._dynamo", "torch.distributed.algorithms._optimizer_overlap"):
        importlib.import_module(name)
    if "ddp_ext" in ddps:
        importlib.import_module("ddp_ext")


def _fork_rank(rank: int, workdir: str, ddp: str, destroy: bool, fused: bool, kept: bool, steps: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The child: never returns into the caller's loop.
    code = 1
    try:
        fd = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                          LOCAL_WORLD_SIZE=str(WORLD_SIZE))
        rank_main(rank, WORLD_SIZE, os.path.join(workdir, "store"), ddp, destroy, fused, kept, steps)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    raise _ChildExit(code)


class _ChildExit(SystemExit):
    """Raised in a forked rank to leave through the interpreter's shutdown."""


class _ForkedJob:
    def __init__(self, ddp, destroy, fused, kept, steps, timeout_s):
        self.ddp, self.destroy, self.fused, self.kept = ddp, destroy, fused, kept
        self.workdir = tempfile.mkdtemp(prefix="ddp_ext-exit-")
        self.deadline = time.monotonic() + timeout_s
        self.pids = [_fork_rank(r, self.workdir, ddp, destroy, fused, kept, steps) for r in range(WORLD_SIZE)]
        self.codes = [None] * WORLD_SIZE
        self.running = set(range(WORLD_SIZE))

    def poll(self) -> bool:
        """Reaps what ended; kills what outlived its deadline; True when done."""
        for rank in list(self.running):
            pid, status = os.waitpid(self.pids[rank], os.WNOHANG)
            if pid:
                self.codes[rank] = os.waitstatus_to_exitcode(status)
                self.running.discard(rank)
        if self.running and time.monotonic() > self.deadline:
            for rank in self.running:
                os.kill(self.pids[rank], signal.SIGKILL)
                os.waitpid(self.pids[rank], 0)
            self.running.clear()
        return not self.running

    def result(self, keep: str) -> dict:
        ok = all(code == 0 for code in self.codes)
        output = {}
        if not ok:
            for rank in range(WORLD_SIZE):
                with open(os.path.join(self.workdir, f"rank{rank}.log"), "rb") as f:
                    output[rank] = f.read().decode(errors="replace")[-4000:]
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copytree(self.workdir, os.path.join(keep, os.path.basename(self.workdir)), dirs_exist_ok=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return {"codes": self.codes, "ok": ok, "output": output}


def _results_forked(plan, jobs: int, steps: int, timeout_s: float, keep: str):
    """Yields ((ddp, destroy, fused, kept), result) as forked jobs end; at most
    `jobs` at once. No try/finally or with here: see _fork_rank."""
    pending = list(plan)
    running = []
    while pending or running:
        while pending and len(running) < jobs:
            running.append(_ForkedJob(*pending.pop(0), steps, timeout_s))
        finished = [job for job in running if job.poll()]
        for job in finished:
            running.remove(job)
            yield (job.ddp, job.destroy, job.fused, job.kept), job.result(keep)
        if not finished:
            time.sleep(0.05)


def _results_exec(plan, jobs: int, steps: int, timeout_s: float, keep: str):
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_job, ddp, destroy, fused, kept, steps, timeout_s, keep): (ddp, destroy, fused, kept)
                   for ddp, destroy, fused, kept in plan}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()


# --- many jobs ------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per DDP, the variants interleaved")
    parser.add_argument("--ddp", default=",".join(DDPS), help="comma-separated, of: ddp_ext, torch")
    parser.add_argument("--jobs", type=int, default=2, help="jobs run at once (each has 2 ranks)")
    parser.add_argument("--launch", choices=("fork", "exec"), default="fork",
                        help="fork ranks from this process after its imports (default), or exec fresh interpreters")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before a job's ranks are killed")
    parser.add_argument("--keep", default="", help="folder to keep failed runs' output in")
    parser.add_argument("--json", default="", help="file to write the counts to")
    # one rank (internal)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--destroy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kept", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, WORLD_SIZE, args.store, args.ddp, args.destroy, args.fused, args.kept, args.steps)
        return 0

    ddps = [d for d in args.ddp.split(",") if d]
    unknown = [d for d in ddps if d not in DDPS]
    if unknown:
        parser.error(f"--ddp: unknown {unknown}; choose from {list(DDPS)}")
    # Interleaved: run i of each DDP uses variant i % 8, and the DDPs alternate.
    plan = [(ddp, *VARIANTS[i % len(VARIANTS)]) for i in range(args.runs) for ddp in ddps]
    counts = {ddp: collections.OrderedDict((variant_name(*v), collections.Counter()) for v in VARIANTS) for ddp in ddps}
    start = time.monotonic()
    print(f"{len(plan)} jobs of {WORLD_SIZE} ranks ({args.launch}), {args.jobs} at a time; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.launch == "fork":
        _preload(ddps)
        results = _results_forked(plan, args.jobs, args.steps, args.timeout, args.keep)
    else:
        results = _results_exec(plan, args.jobs, args.steps, args.timeout, args.keep)
    for done, ((ddp, destroy, fused, kept), result) in enumerate(results, 1):
        outcome = "ok" if result["ok"] else ", ".join(
            f"rank {r}: {_describe(c)}" for r, c in enumerate(result["codes"]) if c != 0)
        counts[ddp][variant_name(destroy, fused, kept)][outcome] += 1
        if not result["ok"]:
            tails = "".join(f"\n  rank {r}: ...{out[-300:]!r}" for r, out in result["output"].items())
            print(f"[{done}/{len(plan)}] {ddp} {variant_name(destroy, fused, kept)}: {outcome}{tails}", flush=True)
        elif done % 20 == 0:
            print(f"[{done}/{len(plan)}] {time.monotonic() - start:.0f} s", flush=True)

    print(f"\nload average at the end {os.getloadavg()[0]:.1f}; {time.monotonic() - start:.0f} s in all")
    summary = {}
    for ddp in ddps:
        total = sum(sum(c.values()) for c in counts[ddp].values())
        good = sum(c["ok"] for c in counts[ddp].values())
        print(f"{ddp}: {good} of {total} runs had every rank exit 0")
        for name, c in counts[ddp].items():
            bad = ", ".join(f"{n} x {k}" for k, n in c.items() if k != "ok")
            print(f"  {name:<36} {c['ok']} of {sum(c.values())}" + (f"   ({bad})" if bad else ""))
        summary[ddp] = {"runs": total, "all_ranks_exit_0": good,
                        "variants": {name: dict(c) for name, c in counts[ddp].items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    ddp_ext_bad = "ddp_ext" in summary and summary["ddp_ext"]["all_ranks_exit_0"] < summary["ddp_ext"]["runs"]
    return 1 if ddp_ext_bad else 0


if __name__ == "__main__":
    sys.exit(main())
