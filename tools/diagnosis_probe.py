"""What each DDP says when a rank skips a parameter, is late, or dies, side by side.

    python tools/diagnosis_probe.py [skip|late|dead ...]

Starts two ranks (spawned processes, Gloo over a FileStore) per scenario and
DDP, ddp_ext's with hang_timeout_s=2 and torch's, each over a process group
whose timeout is 10 s; prints, per rank, the seconds from the start of the
step that went wrong to the first error or warning, and its full text:

- skip: rank 1's forward leaves out the last layer in step 1
  (find_unused_parameters=False); both ranks then stay alive until every
  rank has raised or 30 s have passed.
- late: rank 1 sleeps 4 s in "data loading" before step 2.
- dead: rank 1 SIGKILLs itself in its backward of step 2.
- slow: rank 1 sleeps 30 ms in "data loading" before each of 60 steps;
  ddp_ext exchanges the ranks' phase figures every 10 steps
  (watch_stragglers(every=10)).

docs/DIAGNOSIS.md quotes its output.
"""

import datetime
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_ext  # noqa: E402

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=10)


class Net(nn.Module):
    def __init__(self, skip_last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.skip_last = skip_last
        self.fc0 = nn.Linear(4, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.fc1(torch.tanh(self.fc0(x))))
        return x if self.skip_last else self.fc2(x)


def wrap(kind, net, group):
    if kind == "ddp_ext":
        return ddp_ext.DistributedDataParallel(net, process_group=group, hang_timeout_s=2)
    return TorchDDP(net, process_group=group)


def _store_barrier(name):
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    deadline = time.monotonic() + 30
    while int(store.add(name, 0)) < WORLD and time.monotonic() < deadline:
        time.sleep(0.05)


def scenario(kind, name, rank):
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    net = Net(skip_last=(name == "skip" and rank == 1))
    ddp = wrap(kind, net, group)
    if name == "dead" and rank == 1:
        net.fc0.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL) if state["step"] == 2 else g)
    state = {"step": 0}
    if name == "slow" and kind == "ddp_ext":
        ddp.watch_stragglers(every=10)
    x = torch.randn(3, 4)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(1, 61 if name == "slow" else 4):
                state["step"] = step
                if name == "late" and rank == 1 and step == 2:
                    time.sleep(4)
                if name == "slow" and rank == 1:
                    time.sleep(0.03)
                if (name == "skip" and step == 1) or (name != "skip" and step == 2):
                    start = time.monotonic()
                ddp(x).pow(2).mean().backward()
            outcome = "trained to the end"
        except Exception as e:  # noqa: BLE001 - report whatever it is
            outcome = f"{type(e).__name__} after {time.monotonic() - start:.2f} s:\n{e}"
    notes = [f"{w.category.__name__}:\n{w.message}" for w in caught if "DistributedDataParallel" in str(w.message)]
    if name == "slow" and kind == "ddp_ext":
        notes.append(f"straggler_report():\n{ddp.straggler_report()}")
    if name == "skip":
        _store_barrier(f"{kind}-{name}")
    return outcome, notes


def rank_main(kind, name, rank, path, results):
    import torch._dynamo  # noqa: F401 - imported by the first forward otherwise, which would then take seconds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, WORLD), rank=rank, world_size=WORLD)
    outcome, notes = scenario(kind, name, rank)
    results.put((rank, outcome, notes))


def main(names):
    context = multiprocessing.get_context("spawn")
    for name in names:
        for kind in ("ddp_ext", "torch"):
            results = context.Queue()
            with tempfile.TemporaryDirectory() as tmp:
                procs = [
                    context.Process(target=rank_main, args=(kind, name, r, os.path.join(tmp, "store"), results))
                    for r in range(WORLD)
                ]
                for p in procs:
                    p.start()
                got = {}
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and len(got) < WORLD:
                    try:
                        rank, outcome, notes = results.get(timeout=1)
                        got[rank] = (outcome, notes)
                    except Exception:  # noqa: BLE001 - queue.Empty
                        if all(not p.is_alive() for p in procs):
                            break
                for p in procs:
                    p.join(timeout=5)
                    if p.is_alive():
                        p.kill()
            print(f"===== {name}, {kind}'s DDP =====")
            for rank in range(WORLD):
                if rank not in got:
                    print(f"--- rank {rank}: no answer (exit code {procs[rank].exitcode})")
                    continue
                outcome, notes = got[rank]
                for note in notes:
                    print(f"--- rank {rank} warned: {note}")
                print(f"--- rank {rank}: {outcome}")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] or ["skip", "late", "dead", "slow"])
