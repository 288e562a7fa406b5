"""One replica of a fault-tolerant run, for tests/fault_tolerance/test_fault_tolerance_*.py.
Run as a script:

    python tests/support/fault_tolerance_worker.py --coordinator HOST:PORT --id r0 --steps 30 --out r0.jsonl \
        [--fault kill-backward@5]

It trains `model()` on `global_batch(step)`, taking its shard for the step's
quorum, and appends one JSON line per committed step to --out (its quorum and
a hash of the parameters after the step), then a final line with the
parameters. Faults it does to itself at step K: kill-forward@K,
kill-backward@K (mid-backward, after the last layers' buckets were launched),
kill-between@K (right after step K committed), stop@K (SIGSTOP in the forward
of step K; the test sends SIGCONT), stop-after-vote@K (SIGSTOP once its vote
for step K is in the store, before it reads the decision), kill-alone@K (in
the forward of step K once its quorum is itself), kill-heal (dies while
sending its state to a joiner), kill-receive (a joiner that dies while it
receives its state, after the payload's size came in), kill-bystander@K (from
step K on, dies in the next formation that heals a newcomer, while the state
is being sent to it), raise@K1,K2,... (a RuntimeError in train_step at each of
those steps, once: the quorum aborts and re-forms with the same members).

With --control DIR (the soak, tests/fault_tolerance/test_fault_tolerance_soak.py) the test
paces and arms it: before step S it waits until the file DIR/limit holds a
number above S, then reads DIR/arm-<id> if it exists, a fault as above.
"""

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GLOBAL_BATCH = 12  # divisible by every quorum size the tests reach (1 to 4)
IN, HIDDEN, OUT = 8, 32, 4
LR, MOMENTUM = 0.05, 0.9


def model(seed: int, kind: str = "mlp") -> nn.Module:
    """"mlp"; "wide" (another model, for a refused joiner); "layerdrop"
    (the middle layers in a ddp_ext.LayerDrop with a fixed seed)."""
    torch.manual_seed(seed)
    width = HIDDEN + 1 if kind == "wide" else HIDDEN
    middle = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3)]
    if kind == "layerdrop":
        from ddp_ext import LayerDrop

        return nn.Sequential(nn.Linear(IN, width), nn.Tanh(), LayerDrop(middle, p=0.3, seed=7), nn.Linear(width, OUT))
    layers = [nn.Linear(IN, width), nn.Tanh()]
    for block in middle:
        layers += [block[0], block[1]]
    layers.append(nn.Linear(width, OUT))
    return nn.Sequential(*layers)


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def shard(step: int, rank: int, world_size: int):
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def params_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:20]


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def seed_of(replica_id: str) -> int:
    return int("".join(c for c in replica_id if c.isdigit()) or 0)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--run-id", default="default")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--fault", default="")
    parser.add_argument("--gate", default="", help="STEP:FILE: before step STEP, wait until FILE exists")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--ddp", default="{}", help="JSON of DistributedDataParallel arguments")
    parser.add_argument("--hook", default="",
                        help='"adaptive": AdaptivePrecision on every new wrapper; "overlap": overlap_optimizer '
                             'on every new wrapper; "overlap-in-step": overlap_optimizer in train_step')
    parser.add_argument("--control", default="", help="DIR: paced by DIR/limit, faults armed by DIR/arm-<id>")
    parser.add_argument("--heal-delay", type=float, default=0.0,
                        help="seconds a heal's source waits between the payload's size and the payload")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks when a wait times out

    from ddp_ext.fault_tolerance import Replica

    out = open(args.out, "a", buffering=1)

    def note(**record):
        out.write(json.dumps(record) + "\n")

    net = model(seed_of(args.id), args.model)
    opt = optimizer(net)
    ddp_kwargs = {"bucket_cap_mb": 0.001}
    ddp_kwargs.update(json.loads(args.ddp))
    from ddp_ext.fault_tolerance import heal

    if args.fault == "kill-receive":
        def receive_then_die(group, src):
            size = torch.zeros(1, dtype=torch.int64)
            group.recv([size], src, 0).wait()
            die_here(signal.SIGKILL)

        heal.receive = receive_then_die
    if args.heal_delay:
        def slow_send(group, blob, dst):
            group.send([torch.tensor([len(blob)], dtype=torch.int64)], dst, 0).wait()
            time.sleep(args.heal_delay)
            group.send([torch.frombuffer(bytearray(blob), dtype=torch.uint8)], dst, 1).wait()

        heal.send = slow_send
    hooks = []  # the hook state of the current wrapper

    def configure(ddp, group):
        if args.hook == "overlap":
            ddp.overlap_optimizer(opt)
            return
        from ddp_ext import AdaptivePrecision, adaptive_precision_hook

        # Compression kept on (off_when_slower=False): a loopback would turn it off.
        state = AdaptivePrecision(group, warmup_iterations=1, check_every=2, off_when_slower=False)
        ddp.register_comm_hook(state, adaptive_precision_hook)
        hooks[:] = [state]

    try:
        replica = Replica(net, opt, coordinator=args.coordinator, replica_id=args.id, run_id=args.run_id,
                          heartbeat_timeout=args.heartbeat, ddp_kwargs=ddp_kwargs,
                          configure=configure if args.hook in ("adaptive", "overlap") else None)
    except Exception as exc:
        note(kind="refused", type=type(exc).__name__, message=str(exc))
        return 3
    note(kind="connected", pid=os.getpid(), time=time.time())

    def die_here(sig):
        note(kind="fault", fault=armed.get("kind") or args.fault, step=replica.step, time=time.time())
        out.flush()
        os.kill(os.getpid(), sig)

    armed = {}  # "kind", "step": the fault this process does to itself

    def arm(spec):
        kind, _, at = spec.partition("@")
        armed.update(kind=kind, step=int(at) if at and "," not in at else -1)

    arm(args.fault)
    fault = armed["kind"]

    def due(kind):
        return armed["kind"] == kind and replica.step == armed["step"]

    middle = net[4] if args.model != "layerdrop" else net[0]  # mlp: the third Linear, mid-backward
    middle.register_forward_pre_hook(lambda *_: die_here(signal.SIGKILL) if due("kill-forward") else None)
    middle.weight.register_hook(lambda g: die_here(signal.SIGKILL) if due("kill-backward") else None)
    if fault == "stop":
        state = {"done": False}

        def stop_once(*_):
            if replica.step == armed["step"] and not state["done"]:
                state["done"] = True
                die_here(signal.SIGSTOP)

        middle.register_forward_pre_hook(stop_once)

    if fault == "stop-after-vote":
        # SIGSTOP right after this replica's vote for step K reached the
        # store, before it reads the decision (the test sends SIGCONT).
        from ddp_ext.fault_tolerance import commit

        store_call = commit._store_call

        def vote_then_stop(link, call, *call_args):
            result = store_call(link, call, *call_args)
            if due("stop-after-vote") and getattr(call, "__name__", "") == "add" \
                    and str(call_args[0]).endswith("/votes") and call_args[1] == 1:
                die_here(signal.SIGSTOP)
                armed["kind"] = ""  # once
            return result

        commit._store_call = vote_then_stop
    # kill-alone@K: dies in the forward of step K once it trains alone.
    middle.register_forward_pre_hook(
        lambda *_: die_here(signal.SIGKILL)
        if due("kill-alone") and replica._formation.formed is not None and len(replica._formation.formed[1]) == 1 else None)

    if fault == "kill-heal":
        # Dies as the source of a heal, after the payload's size went out.
        first_send = heal.send

        def send_then_die(group, blob, dst):
            if replica.step == 0:  # the run's start (rank 0's model to all): not this fault
                return first_send(group, blob, dst)
            group.send([torch.tensor([len(blob)], dtype=torch.int64)], dst, 0).wait()
            die_here(signal.SIGKILL)

        heal.send = send_then_die

    # kill-bystander: a formation whose members include a newcomer (one not in
    # the last quorum this replica committed with) heals it; this replica dies
    # on its way out of that formation, while the source is still sending.
    last_members = []
    form = replica._form

    def form_then_maybe_die(epoch, members):
        if armed["kind"] == "kill-bystander" and 0 <= armed["step"] <= replica.step and args.id in last_members \
                and any(m not in last_members for m in members):
            replica._formation._wrap = lambda group: die_here(signal.SIGKILL)
        return form(epoch, members)

    replica._form = form_then_maybe_die

    def paced():
        limit_file = os.path.join(args.control, "limit")
        while True:
            try:
                with open(limit_file) as f:
                    if int(f.read() or 0) > replica.step:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.002)
        arm_file = os.path.join(args.control, f"arm-{args.id}")
        if os.path.exists(arm_file):
            with open(arm_file) as f:
                spec = f.read().strip()
            if spec and spec != armed.get("spec"):
                arm(spec)
                armed["spec"] = spec

    gate_step, _, gate_file = args.gate.partition(":")

    _, _, at = args.fault.partition("@")
    raise_at = {int(k) for k in at.split(",")} if fault == "raise" else set()

    def train_step(m):
        if m.step in raise_at:
            raise_at.discard(m.step)  # once: the step is run again and commits
            raise RuntimeError(f"injected failure at step {m.step}")
        if args.hook == "overlap-in-step":
            replica.ddp.overlap_optimizer(opt)
        opt.zero_grad()
        x, y = shard(m.step, m.rank, m.world_size)
        loss = nn.functional.mse_loss(replica.ddp(x), y)
        loss.backward()
        if args.sleep:
            time.sleep(args.sleep)
        return loss.item()

    while replica.step < args.steps:
        if args.control:
            paced()
        if gate_file and replica.step == int(gate_step):
            while not os.path.exists(gate_file):
                time.sleep(0.01)
        try:
            result = replica.run_step(train_step)
        except Exception as exc:
            note(kind="error", type=type(exc).__name__, message=str(exc), step=replica.step, time=time.time())
            return 4
        m = result.membership
        note(kind="step", step=m.step, epoch=m.epoch, rank=m.rank, world_size=m.world_size,
             members=list(m.members), attempts=result.attempts, hash=params_hash(net),
             heal_bytes=replica.last_heal_bytes, heal_s=replica.last_heal_s, wrap_s=replica.last_wrap_s,
             time=time.time(), caps=list(replica.ddp._bucket_caps_bytes),
             tuner=None if replica.ddp.bucket_tuner is None else replica.ddp.bucket_tuner.stage.value,
             draws=[m.draws for m in net.modules() if hasattr(m, "draws")],
             formats=list(hooks[0].formats) if hooks else None,
             threads=len(os.listdir("/proc/self/task")), fds=len(os.listdir("/proc/self/fd")),
             rss_kib=_rss_kib())
        last_members[:] = m.members
        if armed["kind"] == "kill-between" and m.step == armed["step"]:
            die_here(signal.SIGKILL)
    note(kind="done", params=[p.detach().tolist() for p in net.parameters()], rejoins=replica.rejoins)
    replica.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
