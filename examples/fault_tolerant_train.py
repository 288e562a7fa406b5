"""Fault-tolerant data-parallel training: replicas die, hang or join, and
training goes on with the live ones. See docs/FAULT_TOLERANCE.md.

Start the coordinator once (its own process, on a host that outlives the
replicas):

    python -m ddp_ext.fault_tolerance.coordinator --port 29600 --min-replicas 2

then each replica under its own torchrun agent, so that a restart of one
replica (--max-restarts) touches no other:

    torchrun --nnodes=1 --nproc_per_node=1 --max-restarts=3 --rdzv-endpoint=localhost:0 \\
        examples/fault_tolerant_train.py --coordinator HOST:29600 --replica-id r0
    torchrun --nnodes=1 --nproc_per_node=1 --max-restarts=3 --rdzv-endpoint=localhost:0 \\
        examples/fault_tolerant_train.py --coordinator HOST:29600 --replica-id r1

(or plain `python examples/fault_tolerant_train.py ...`). On several hosts,
the same line on each, with GLOO_SOCKET_IFNAME=<the interface that reaches
the other hosts> in front (docs/FAULT_TOLERANCE.md). Kill one replica's
worker: the others commit their next step within about a second, and
torchrun restarts it; it rejoins, receives the model, the optimizer state and
the step from a live replica, and trains on. Each step, every replica takes
its shard of that step's global batch by its index among the live replicas.
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_ext.fault_tolerance import Replica

GLOBAL_BATCH = 240  # divisible by 1 to 6 replicas


def global_batch(step: int):
    """The same on every replica: a fixed function of the step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    return x, (x[:, :8].sum(dim=1) > 0).long()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", default="localhost:29600")
    parser.add_argument("--replica-id", default=os.environ.get("REPLICA_ID", f"pid{os.getpid()}"))
    parser.add_argument("--run-id", default="default")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--step-time", type=float, default=0.02, help="extra seconds per step, to watch it")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replica = Replica(model, optimizer, coordinator=args.coordinator, replica_id=args.replica_id,
                      run_id=args.run_id, heartbeat_timeout=args.heartbeat_timeout,
                      ddp_kwargs={"bucket_cap_mb": "auto"})

    def train_step(m):
        # m.step, m.rank, m.world_size: this step's quorum, to shard by.
        x, y = global_batch(m.step)
        shard = slice(m.rank * GLOBAL_BATCH // m.world_size, (m.rank + 1) * GLOBAL_BATCH // m.world_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(replica.ddp(x[shard]), y[shard])
        loss.backward()
        time.sleep(args.step_time)
        return loss.item()

    while replica.step < args.steps:
        result = replica.run_step(train_step)
        m = result.membership
        if m.step % 20 == 0 or result.attempts > 1:
            print(f"[{args.replica_id}] step {m.step} loss {result.value:.4f} with {m.world_size} replicas "
                  f"{list(m.members)} (attempts {result.attempts})", flush=True)
    print(f"[{args.replica_id}] done: {replica.step} committed steps", flush=True)
    replica.close()


if __name__ == "__main__":
    main()
