"""One rank of one host of a fault-tolerant DiLoCo run (tests/diloco/
test_diloco_survival.py): the host is a two-rank torch.distributed job of
its own, the hosts meet through a fault-tolerance coordinator. Writes one
JSON line per event to --out, and the final parameters to --out + ".pt"."""

import argparse
import datetime
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ddp_ext  # noqa: E402
from ddp_ext.diloco import FaultTolerance, quorum_exchange, survival  # noqa: E402
from tests.diloco import workers  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--host-index", type=int, required=True, help="which ranks' batches: 2 * index + rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the host's own rendezvous port")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--outer", default="default", choices=["default", "plain"])
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per inner step")
    parser.add_argument("--gate", default="", help="STEP:FILE: before step STEP, wait until FILE exists")
    parser.add_argument("--die-in-sync", type=int, default=0, help="N: SIGKILL this rank as sync N starts its exchange")
    parser.add_argument("--die-after-parts", type=int, default=0,
                        help="N: SIGKILL this rank in sync N once its part went across hosts")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--mix", type=float, default=None)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--split", default="on", choices=["on", "off", "check"],
                        help="split_within_host; check: also run the whole exchange and record whether it agrees")
    parser.add_argument("--int8-chunk", type=int, default=1024)
    parser.add_argument("--state-dict-at", default="", help="STEP,...: after these steps, try outer.state_dict()")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    out = open(args.out, "a")

    def record(**fields):
        out.write(json.dumps(dict(fields, time=time.time(), pid=os.getpid())) + "\n")
        out.flush()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=workers.RANKS_PER_HOST, timeout=datetime.timedelta(seconds=60))
    ddp = ddp_ext.DistributedDataParallel(workers.build_model(seed=args.host_index))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outer_optimizer = workers.plain_outer_sgd if args.outer == "plain" else None
    record(kind="started")
    # A checked run also runs the whole exchange at each sync: more work per
    # sync, so a longer heartbeat timeout keeps a loaded machine from dropping
    # live replicas (a killed host is seen at once: its peers' collectives fail).
    heartbeat_timeout = 5.0 if args.split == "check" else 2.0
    if args.split == "check":  # before construction: a joiner's first sync runs in the constructor
        split_mean = survival.SurvivingSync._mean

        def checked(self, group, membership, contributions, payload, fragment):
            whole, _ = quorum_exchange.whole_mean(group, contributions, payload, fragment.codec)
            result = split_mean(self, group, membership, contributions, payload, fragment)
            record(kind="exchange", sync=membership.step, members=list(membership.members),
                   split=quorum_exchange.host_shares(membership.members, contributions) is not None,
                   equal=torch.equal(whole, result[0]))
            return result

        survival.SurvivingSync._mean = checked
    outer = ddp_ext.DiLoCo(ddp, optimizer, sync_every=args.sync_every, outer_optimizer=outer_optimizer,
                           fragments=args.fragments, bits=args.bits, mix=args.mix, delay=args.delay,
                           int8_chunk=args.int8_chunk, split_within_host=args.split != "off",
                           fault_tolerance=FaultTolerance(args.coordinator, args.host, heartbeat_timeout=heartbeat_timeout))
    record(kind="joined", step=outer.step_count, members=list(outer._surviving.last_members))
    if args.die_in_sync:
        exchange = outer._surviving._exchange

        def dying(membership):
            if membership.step == args.die_in_sync:
                record(kind="fault", step=outer.step_count)
                os.kill(os.getpid(), signal.SIGKILL)
            return exchange(membership)

        outer._surviving._exchange = dying
    if args.die_after_parts:
        living_mean, all_to_all = outer._surviving._mean, quorum_exchange._all_to_all

        def across_then_die(*call):
            try:
                return all_to_all(*call)  # the host's mate may be dead already: die all the same
            finally:
                record(kind="fault", step=outer.step_count)
                os.kill(os.getpid(), signal.SIGKILL)

        def dying_mean(group, membership, *rest):
            if membership.step == args.die_after_parts:
                quorum_exchange._all_to_all = across_then_die
            return living_mean(group, membership, *rest)

        outer._surviving._mean = dying_mean
    while outer.step_count < args.steps:
        step = outer.step_count
        if args.gate and step == int(args.gate.split(":")[0]):
            while not os.path.exists(args.gate.split(":", 1)[1]):
                time.sleep(0.05)
        x, y = workers.batch(step, workers.RANKS_PER_HOST * args.host_index + args.rank)
        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        outer.step()
        launched = outer.step_count - args.delay  # the launch of the sync merged at this step, if any
        synced = launched >= 1 and bool(outer._schedule.launches_at(launched))
        record(kind="step", step=outer.step_count, loss=loss.item(), launched=launched if synced else None,
               members=list(outer._surviving.last_members) if synced else None,
               attempts=outer._surviving.last_attempts if synced else None)
        if str(outer.step_count) in args.state_dict_at.split(","):
            try:
                saved = sorted(outer.state_dict())
                record(kind="state_dict", step=outer.step_count, saved=saved)
            except ValueError as error:
                record(kind="state_dict", step=outer.step_count, error=str(error))
        time.sleep(args.sleep)
    torch.save({"live": [p.detach().clone() for p in ddp.module.parameters()],
                "global": [p.clone() for p in outer.global_parameters()]}, args.out + ".pt")
    record(kind="done", step=outer.step_count, bytes_sent=outer.bytes_sent)
    outer._surviving.replica.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
