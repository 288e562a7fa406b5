"""Worker of tests/process_groups/test_two_hosts.py, started by torchrun on each of two hosts.

    two_host_train.py OUT_DIR train   trains tests.support.reference's CASE with ddp_ext,
                                      writes OUT_DIR/host<i>.pt (its trace)
    two_host_train.py OUT_DIR kill    trains until host 1 SIGKILLs itself at
                                      step KILL_STEP; host 0 writes
                                      OUT_DIR/error.json when its step raises

The host index i comes from TWO_HOST_INDEX (set by the test per namespace),
not from RANK: which node the rendezvous makes rank 0 is up to torchrun.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from tests.support import models, reference

CASE = reference.case("mlp", "adam", steps=5)
KILL_STEP = 3  # host 1 dies after this step's backward, before the optimizer
KILL_STEPS = 1000  # more than are ever reached: host 0 must fail first
PG_TIMEOUT_S = 20


def _train(out: str, host: int, rank: int, world: int) -> None:
    trace = reference.train_ddp(reference.ext_ddp, CASE, rank, world)
    torch.save(dict(trace, rank=rank), os.path.join(out, f"host{host}.pt"))


def _write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # the test never reads half a file


def _kill(out: str, host: int, rank: int, world: int) -> None:
    c = reference.case("mlp", steps=KILL_STEPS)
    module = models.build(c.model)
    ddp = reference.ext_ddp(module)
    optimizer = reference.OPTIMIZERS[c.optimizer](module.parameters())

    def die_at_kill_step(step):
        def on_step(ddp, module):
            if host == 1 and step == KILL_STEP:
                _write_json(os.path.join(out, "killed.json"), {"at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)

        return on_step

    try:
        for step in range(c.steps):
            reference.run_steps(ddp, optimizer, c, rank, world, [step], die_at_kill_step(step))
    except Exception as error:
        failed_at = time.time()
        _write_json(
            os.path.join(out, "error.json"),
            {"at": failed_at, "step": step, "type": type(error).__name__, "message": str(error)[:2000]},
        )
        sys.stdout.flush()
        os._exit(3)  # no teardown of a group whose peer is gone
    _write_json(os.path.join(out, f"finished{host}.json"), {"steps": c.steps})


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    host = int(os.environ["TWO_HOST_INDEX"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"host {host}: rank {rank} of {world}, gloo over {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
    {"train": _train, "kill": _kill}[mode](out, host, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
