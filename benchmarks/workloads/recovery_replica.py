"""One process of the recovery experiment (benchmarks/experiments/recovery.py).

    python -m benchmarks.workloads.recovery_replica --mode ft --coordinator H:P --id r0 --steps N --out F
    torchrun --nproc_per_node=3 --max-restarts=M -m benchmarks.workloads.recovery_replica --mode restart \\
        --checkpoint C --checkpoint-every K --steps N --out F

Both train the same MLP on the same global batches (each process its shard).
`ft`: a ddp_ext.fault_tolerance.Replica. `restart`: torch's answer, ddp_ext's
DistributedDataParallel under torchrun, resuming from the checkpoint rank 0
writes every K steps. Each process appends JSON lines to --out (its pid at
start, then one per committed step: step, time; in ft also heal bytes and
seconds); `restart` writes one file per rank (--out with .rank<r>)."""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 512
GLOBAL_BATCH = 96  # divisible by 1, 2 and 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def shard(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 64, generator=g)
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _ft(args, note):
    from ddp_ext.fault_tolerance import Replica

    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    replica = Replica(net, opt, coordinator=args.coordinator, replica_id=args.id,
                      heartbeat_timeout=args.heartbeat, ddp_kwargs={})

    def train_step(m):
        opt.zero_grad()
        x, y = shard(m.step, m.rank, m.world_size)
        F.cross_entropy(replica.ddp(x), y).backward()

    while replica.step < args.steps:
        result = replica.run_step(train_step)
        note(step=result.membership.step, time=time.time(), world_size=result.membership.world_size,
             heal_bytes=replica.last_heal_bytes, heal_s=replica.last_heal_s)
    replica.close()


def _restart(args, note):
    import torch.distributed as dist

    from ddp_ext import DistributedDataParallel

    # A fresh FileStore per attempt: every restart of the job meets anew.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", init_method=f"file://{args.checkpoint}.store{attempt}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    note(kind="resumed", step=step, time=time.time())
    ddp = DistributedDataParallel(net)
    while step < args.steps:
        opt.zero_grad()
        x, y = shard(step, rank, world_size)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        note(step=step - 1, time=time.time(), world_size=world_size)
        if rank == 0 and step % args.checkpoint_every == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.checkpoint)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ft", "restart"], required=True)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--id", default="")
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_path = args.out if args.mode == "ft" else f"{args.out}.rank{os.environ.get('RANK', '0')}"
    out = open(out_path, "a", buffering=1)

    def note(**record):
        out.write(json.dumps(record) + "\n")

    note(kind="pid", pid=os.getpid(), time=time.time())
    (_ft if args.mode == "ft" else _restart)(args, note)


if __name__ == "__main__":
    main()
