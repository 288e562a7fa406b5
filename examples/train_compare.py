"""The main job: train the same model with ddp_ext and with torch's DDP.

    torchrun --nproc_per_node=2 examples/train_compare.py [--steps 30]
    mpirun -np 2 python examples/train_compare.py --backend ddp_ext_mpi

Both start from the same seed and see the same data (each rank its own shard
of every global batch). Prints the median per-iteration time of each
implementation, measured in interleaved blocks so both see the same machine
conditions, and then its verdict: whether the trained parameters and buffers
match on every rank. Exits with status 1 if they do not.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext


class ConvNet(nn.Module):
    """A small image classifier with BatchNorm buffers."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x):
        return self.head(self.features(x))


def make_trainer(wrapper, seed: int):
    torch.manual_seed(seed)
    model = wrapper(ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return model, step


TOLERANCE = 1e-5  # max |difference| allowed between the two trained models
BENCH_COMMAND = "python -m benchmarks compare"


def largest_difference(ours: nn.Module, theirs: nn.Module):
    """(max |difference|, name of the tensor where it is) over parameters and
    buffers; a NaN counts as an infinite difference."""
    theirs_state = theirs.state_dict()
    return max(
        ((a - theirs_state[name]).abs().nan_to_num(nan=float("inf")).max().item(), name)
        for name, a in ours.state_dict().items()
    )


def verdict(differences) -> tuple:
    """(passed, line) from every rank's (max |difference|, tensor name)."""
    worst_rank = max(range(len(differences)), key=lambda r: differences[r][0])
    diff, name = differences[worst_rank]
    if diff <= TOLERANCE:
        return True, (f"PASS: ddp_ext trained the same model as torch's DDP on all {len(differences)} ranks "
                      f"(max |difference| {diff:.3g}, tolerance {TOLERANCE:g})")
    return False, (f"FAIL: ddp_ext and torch's DDP trained different models: `{name}` differs by {diff:.3g} "
                   f"on rank {worst_rank} (tolerance {TOLERANCE:g})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--block", type=int, default=5, help="iterations per interleaved block")
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument("--backend", choices=["gloo", "ddp_ext_mpi"], default="gloo",
                        help="ddp_ext_mpi: over MPI, launched by mpirun or srun (rank and size from MPI)")
    args = parser.parse_args()

    if args.backend == "ddp_ext_mpi":
        dist.init_process_group("ddp_ext_mpi", init_method="mpi://")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    ours, ours_step = make_trainer(ddp_ext.DistributedDataParallel, seed=0)
    theirs, theirs_step = make_trainer(TorchDDP, seed=0)

    data = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.steps):
        x = torch.randn(world * args.batch_per_rank, 3, 32, 32, generator=data)
        y = torch.randint(0, 10, (world * args.batch_per_rank,), generator=data)
        shard = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
        batches.append((x[shard], y[shard]))

    times = {"ddp_ext": [], "torch": []}
    for start in range(0, args.steps, args.block):
        block = batches[start : start + args.block]
        for name, step in (("ddp_ext", ours_step), ("torch", theirs_step)):
            for x, y in block:
                dist.barrier()
                t0 = time.perf_counter()
                step(x, y)
                times[name].append(time.perf_counter() - t0)

    differences = [None] * world
    dist.all_gather_object(differences, largest_difference(ours.module, theirs.module))
    passed, line = verdict(differences)
    if rank == 0:
        warm = min(2, args.steps - 1)  # the first iterations include one-off allocation
        ours_ms = statistics.median(times["ddp_ext"][warm:]) * 1e3
        torch_ms = statistics.median(times["torch"][warm:]) * 1e3
        print(f"world size {world} over {args.backend}, {args.steps} steps of SGD with momentum on a conv net with BatchNorm")
        print(f"median per-iteration time: ddp_ext {ours_ms:.2f} ms, torch DDP {torch_ms:.2f} ms, "
              f"ratio {ours_ms / torch_ms:.3f}")
        print(f"  (one short run: the ratio moves from run to run, the more so on a shared machine; it is not a "
              f"benchmark. For a proper comparison run `{BENCH_COMMAND}` at the repository root, which needs the bench extra)")
        print(line)
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
