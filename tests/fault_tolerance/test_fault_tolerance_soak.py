"""A soak of fault-tolerant training with real process kills: a coordinator
and three replicas over Gloo, 20 replica processes SIGKILLed at varied
points (in forward, mid-backward, between steps, a joiner while it receives
its state, a member while the state is being sent to a joiner), each
replaced at once by a new process that joins and heals.

Replicas are forked from a forkserver that imported torch once
(tests/support/fault_tolerance_harness.py): each replacement is a new process with
fresh state, started in milliseconds, so 20 of them fit in CI's time on a
loaded 2-core machine. The test paces the replicas (a step limit in a file)
and arms each fault at a step of its choosing, so every failure happens at
its point and the run has a fixed length.

Checked: no committed step is lost; every member of each committed step's
quorum recorded it, bitwise equal; the finished replicas equal local
training on the concatenation of each committed step's quorum shards; on
the replica that lives the whole run and on the coordinator, threads and
file descriptors end where they were after the first failure and RSS grows
less than RSS_BOUND_MIB; the coordinator's store keeps Gloo's rendezvous
keys and the last two steps' keys of each epoch, not every step's."""

import collections
import os
import signal
import time

import pytest
import torch.distributed as dist

from tests.support.fault_tolerance_harness import Run, check_run

STEPS = 300
STEPS_PER_CYCLE = 12
HEARTBEAT_S = 4.0  # kills are seen by closed connections; this only bounds a stuck collective
HEAL_DELAY_S = 0.3  # the source pauses mid-heal, so a kill "during a heal" is during it
SETTLE_TIMEOUT_S = 90.0  # one cycle; on a quiet machine it takes well under a second
RSS_BOUND_MIB = 12
LIFELONG = "r0"

# (the fault of the killed replica, what else dies in the same cycle):
# "receive": its replacement is killed while it receives the state, and
# replaced again; "bystander": the third replica is killed while the state
# is sent to that replacement. 8 x 1 + 6 x 2 = 20 kills.
CYCLES = [
    ("kill-backward", ""), ("kill-forward", "receive"), ("kill-between", ""), ("kill-backward", "bystander"),
    ("kill-forward", ""), ("kill-between", "receive"), ("kill-backward", ""), ("kill-forward", "bystander"),
    ("kill-between", ""), ("kill-backward", "receive"), ("kill-forward", ""), ("kill-between", "bystander"),
    ("kill-backward", ""), ("kill-forward", ""),
]
KILLS = sum(2 if extra else 1 for _, extra in CYCLES)


def _proc_usage(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_kib": rss}


def _store_keys(run: Run) -> int:
    host, port = run.address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False).num_keys()


def _paused_store_keys(run: Run):
    """(keys, bound, epochs) once the paused replicas' heartbeats reported
    their last commit (waits up to 10 s for that)."""
    deadline = time.monotonic() + 10
    while True:
        epochs = run.epochs()
        # Per epoch: its rendezvous keys and the two last steps' (Note [Deleting
        # commit keys]); the coordinator's two keys; slack for a lagging report.
        bound = sum(len(members) + 4 for members in epochs) + 2 + 4
        keys = _store_keys(run)
        if keys <= bound or time.monotonic() > deadline:
            return keys, bound, len(epochs)
        time.sleep(0.2)


class _Soak:
    def __init__(self, run: Run):
        self.run = run
        self.control = run.tmp / "control"
        self.control.mkdir()
        self.limit = 0
        self.ids = [LIFELONG, "r1", "r2"]
        self.rotating = ["r1", "r2"]
        self.next_id = 3
        self.joiner_faults = []  # given to the next replacements, in order
        self.deaths = []  # (replica id, exit code)

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        path = self.control / "limit"
        (self.control / "limit.tmp").write_text(str(limit))
        os.replace(self.control / "limit.tmp", path)

    def arm(self, rid: str, spec: str) -> None:
        (self.control / "arm.tmp").write_text(spec)
        os.replace(self.control / "arm.tmp", self.control / f"arm-{rid}")

    def start(self, rid: str, fault: str = "") -> None:
        self.run.fork(rid, STEPS, heartbeat=HEARTBEAT_S, control=self.control, heal_delay=HEAL_DELAY_S,
                      fault=fault)

    def replace_dead(self) -> None:
        """A dead replica's replacement is started at once."""
        assert self.run.procs[LIFELONG].poll() is None, f"{LIFELONG} exited\n{self.run.logs()}"
        assert self.run.coordinator.poll() is None, f"the coordinator exited\n{self.run.logs()}"
        for i, rid in enumerate(self.rotating):
            code = self.run.procs[rid].poll()
            if code is None:
                continue
            self.deaths.append((rid, code))
            new = f"r{self.next_id}"
            self.next_id += 1
            self.start(new, self.joiner_faults.pop(0) if self.joiner_faults else "")
            self.ids.append(new)
            self.rotating[i] = new

    def last_step(self, rid: str) -> int:
        steps = [r["step"] for r in self.run.records(rid) if r["kind"] == "step"]
        return steps[-1] if steps else -1

    def settle(self, deaths: int) -> None:
        """Waits until `deaths` replicas died in all and the three live ones
        committed step limit - 1; lets the survivors take one more step when
        a replacement is in the coordinator's latest epoch but they wait at
        the limit (it joins at their next step)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            self.replace_dead()
            live = [LIFELONG] + self.rotating
            at = {rid: self.last_step(rid) for rid in live}
            if len(self.deaths) >= deaths and all(s == self.limit - 1 for s in at.values()):
                assert len(self.deaths) == deaths, (self.deaths, deaths)
                return
            epochs = self.run.epochs()
            if at[LIFELONG] == self.limit - 1 and epochs and sorted(epochs[-1]) == sorted(live):
                self.set_limit(self.limit + 1)
            if time.monotonic() > deadline:
                raise AssertionError(f"no progress in {SETTLE_TIMEOUT_S} s: limit {self.limit}, at {at}, "
                                     f"deaths {self.deaths}\n{self.run.logs()}")
            time.sleep(0.01)


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path, min_replicas=3)
    yield r
    r.close()


def test_twenty_kills_and_replacements(run):
    soak = _Soak(run)
    soak.set_limit(STEPS_PER_CYCLE)
    soak.start(LIFELONG)  # first to say hello: rank 0, the source of every heal
    run.wait_for(lambda: any(r["kind"] == "connected" for r in run.records(LIFELONG)), 120, f"{LIFELONG} to connect")
    soak.start("r1")
    soak.start("r2")
    soak.settle(0)
    coordinator_pid = run.coordinator.pid
    baseline = None
    for i, (fault, extra) in enumerate(CYCLES):
        victim, other = soak.rotating[i % 2], soak.rotating[1 - i % 2]
        soak.arm(victim, f"{fault}@{soak.limit}")
        if extra == "bystander":
            soak.arm(other, f"kill-bystander@{soak.limit}")
        if extra == "receive":
            soak.joiner_faults.append("kill-receive")
        soak.set_limit(soak.limit + STEPS_PER_CYCLE)
        soak.settle(len(soak.deaths) + (2 if extra else 1))
        if baseline is None:  # after the first failure and its replacement, all three at the limit
            baseline = {"coordinator": _proc_usage(coordinator_pid), "step": soak.limit - 1}
    assert soak.limit < STEPS, f"the schedule took {soak.limit} steps of {STEPS}"
    end_coordinator = _proc_usage(coordinator_pid)
    keys_paused, paused_at = _paused_store_keys(run), soak.limit - 1
    soak.set_limit(STEPS)
    finishers = [LIFELONG] + soak.rotating
    codes = run.wait(finishers, timeout=120)
    assert codes == {rid: 0 for rid in finishers}, run.logs()
    assert len(soak.deaths) == KILLS and all(code == -signal.SIGKILL for _, code in soak.deaths), soak.deaths

    # Every death was the fault it was armed with, at its point.
    faults = collections.Counter()
    for rid, _ in soak.deaths:
        recorded = [r["fault"] for r in run.records(rid) if r["kind"] == "fault"]
        assert len(recorded) == 1, (rid, recorded, run.logs())
        faults[recorded[0]] += 1
    assert faults == {"kill-backward": 5, "kill-forward": 5, "kill-between": 4, "kill-receive": 3,
                      "kill-bystander": 3}, faults
    joins = []  # (connected, first committed step) of each replacement that committed a step
    for rid in soak.ids[3:]:
        connected = [r["time"] for r in run.records(rid) if r["kind"] == "connected"]
        steps = [r["time"] for r in run.records(rid) if r["kind"] == "step"]
        if steps:
            joins.append((connected[0], steps[0]))
    for rid, _ in soak.deaths:
        fault = [r for r in run.records(rid) if r["kind"] == "fault"][0]
        if fault["fault"] == "kill-receive":  # a joiner killed mid-heal never committed a step
            assert not [r for r in run.records(rid) if r["kind"] == "step"], rid
        if fault["fault"] == "kill-bystander":  # while a replacement was on its way in
            assert any(a < fault["time"] < b for a, b in joins), (rid, fault, joins)

    # No committed step lost; every member of a step's quorum recorded it, bitwise equal.
    per_step = check_run(run, soak.ids, STEPS, finished=finishers)
    for step, seen in per_step.items():
        assert sorted(seen["hashes"]) == sorted(seen["members"]), (step, seen)
    assert min(len(seen["members"]) for seen in per_step.values()) == 2  # the kills did shrink quorums
    assert len(run.epochs()) >= 2 * KILLS

    # The coordinator's store grows with epochs, not steps: what stays is
    # Gloo's rendezvous keys, one per member of each epoch, and each epoch's
    # last two steps' keys (Note [Deleting commit keys]).
    keys, bound, epochs = keys_paused
    print(f"coordinator store keys with the replicas paused at step {paused_at}: {keys} "
          f"(bound {bound}, {epochs} epochs; at least {2 * (paused_at + 1)} commit keys without deleting); "
          f"{_store_keys(run)} at the end")
    assert keys <= bound, keys_paused

    # Resources: the lifelong replica and the coordinator end where they were
    # after the first failure and its replacement (same quorum size, 3).
    records = {r["step"]: r for r in run.records(LIFELONG) if r["kind"] == "step"}
    before, after = records[baseline["step"]], records[STEPS - 1]
    assert before["world_size"] == after["world_size"] == 3
    usage = {"replica": (before, after), "coordinator": (baseline["coordinator"], end_coordinator)}
    print("soak usage (threads, fds, rss KiB), after the first failure -> at the end:",
          {k: [(b[x], a[x]) for x in ("threads", "fds", "rss_kib")] for k, (b, a) in usage.items()})
    # Each released epoch's group went at once (Note [A failed step holds
    # its wrapper]): no step after the baseline ran beside a dead group's threads.
    threads = {step: r["threads"] for step, r in records.items() if step >= baseline["step"]}
    assert max(threads.values()) == before["threads"], threads
    for who, (b, a) in usage.items():
        assert a["threads"] == b["threads"], (who, b, a)
        assert a["fds"] == b["fds"], (who, b, a)
        assert a["rss_kib"] - b["rss_kib"] < RSS_BOUND_MIB * 1024, (who, b, a)
