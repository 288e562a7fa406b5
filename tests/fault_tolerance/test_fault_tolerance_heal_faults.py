"""Kills during a heal (Note [What a replica holds] in
ddp_ext/fault_tolerance/heal.py), in real processes over Gloo: the joiner
killed while it receives the state, a member killed while the state is sent
to a joiner, and the only replica holding the state killed while it sends
it. The survivors go on and nothing is applied partially (every committed
step's replicas are bitwise equal and equal local training on the quorums'
shards); a joiner heals from a live peer, or fails with StateLost when none
holds the state, never hangs. The source killed mid-heal with another
holder alive is in tests/fault_tolerance/test_fault_tolerance_training.py."""

import signal

import pytest

from tests.support.fault_tolerance_harness import check_run, runs_closed_after

STEPS = 20
HEARTBEAT_S = 2.0
HEAL_DELAY_S = 0.3  # the source pauses between the payload's size and the payload
TIMEOUT_S = 180.0


@pytest.fixture
def run(tmp_path):
    with runs_closed_after(tmp_path) as make:
        yield make


def _connected(r, rid):
    return lambda: any(rec["kind"] == "connected" for rec in r.records(rid))


def _let_in(r, rid):
    return lambda: any(rid in members for members in r.epochs())


def _steps(r, rid):
    return [rec for rec in r.records(rid) if rec["kind"] == "step"]


def test_a_joiner_killed_while_it_receives_its_state(run):
    # r2 dies; its replacement r3 dies after the state's size came in; r4 heals.
    r = run(min_replicas=3)
    gate = r.tmp / "gate"
    r.fork("r0", STEPS, heartbeat=HEARTBEAT_S, heal_delay=HEAL_DELAY_S, gate=f"10:{gate}")
    r.wait_for(_connected(r, "r0"), TIMEOUT_S, "r0 to connect")
    r.fork("r1", STEPS, heartbeat=HEARTBEAT_S, gate=f"10:{gate}")
    r.fork("r2", STEPS, heartbeat=HEARTBEAT_S, fault="kill-between@3")
    r.wait_for(lambda: r.procs["r2"].poll() is not None, TIMEOUT_S, "r2 to die")
    r.fork("r3", STEPS, heartbeat=HEARTBEAT_S, fault="kill-receive")
    r.wait_for(_let_in(r, "r3"), TIMEOUT_S, "r3 to be let in")
    gate.touch()
    r.wait_for(lambda: r.procs["r3"].poll() is not None, TIMEOUT_S, "r3 to die mid-heal")
    survivors_at = max(rec["step"] for rec in _steps(r, "r0"))
    r.fork("r4", STEPS, heartbeat=HEARTBEAT_S)
    codes = r.wait(["r0", "r1", "r3", "r4"], TIMEOUT_S)
    assert codes == {"r0": 0, "r1": 0, "r3": -signal.SIGKILL, "r4": 0}, r.logs()
    assert [rec["fault"] for rec in r.records("r3") if rec["kind"] == "fault"] == ["kill-receive"]
    assert not _steps(r, "r3")  # it never trained with a half-received state
    per_step = check_run(r, ["r0", "r1", "r2", "r3", "r4"], STEPS, finished=["r0", "r1", "r4"])
    assert all("r3" not in seen["members"] and {"r0", "r1"} <= set(seen["members"])
               for seen in per_step.values())  # they went on without it
    r4 = _steps(r, "r4")
    assert r4[0]["step"] >= survivors_at and r4[0]["heal_bytes"] > 0
    assert sorted(per_step[STEPS - 1]["members"]) == ["r0", "r1", "r4"]


def test_a_member_killed_while_the_state_is_sent_to_a_joiner(run):
    # r2 dies; while r0 sends the state to its replacement r3, r1 dies.
    r = run(min_replicas=3)
    gate = r.tmp / "gate"
    r.fork("r0", STEPS, heartbeat=HEARTBEAT_S, heal_delay=HEAL_DELAY_S, gate=f"10:{gate}")
    r.wait_for(_connected(r, "r0"), TIMEOUT_S, "r0 to connect")
    r.fork("r1", STEPS, heartbeat=HEARTBEAT_S, gate=f"10:{gate}", fault="kill-bystander@3")
    r.fork("r2", STEPS, heartbeat=HEARTBEAT_S, fault="kill-between@3")
    r.wait_for(lambda: r.procs["r2"].poll() is not None, TIMEOUT_S, "r2 to die")
    r.fork("r3", STEPS, heartbeat=HEARTBEAT_S)
    r.wait_for(_let_in(r, "r3"), TIMEOUT_S, "r3 to be let in")
    gate.touch()
    codes = r.wait(["r0", "r1", "r3"], TIMEOUT_S)
    assert codes == {"r0": 0, "r1": -signal.SIGKILL, "r3": 0}, r.logs()
    assert [rec["fault"] for rec in r.records("r1") if rec["kind"] == "fault"] == ["kill-bystander"]
    per_step = check_run(r, ["r0", "r1", "r2", "r3"], STEPS, finished=["r0", "r3"])
    r3 = _steps(r, "r3")
    assert r3[0]["heal_bytes"] > 0 and "r1" not in r3[0]["members"]
    assert sorted(per_step[STEPS - 1]["members"]) == ["r0", "r3"]


def test_the_only_holder_killed_while_it_heals_a_joiner(run):
    # r0 trains alone; r1 joins; r0 dies after sending the state's size. No
    # live replica holds the state: r1 must say so, not hang or train afresh.
    r = run(min_replicas=1)
    gate = r.tmp / "gate"
    r.fork("r0", STEPS, heartbeat=HEARTBEAT_S, fault="kill-heal", gate=f"5:{gate}")
    r.wait_for(lambda: len(_steps(r, "r0")) == 5, TIMEOUT_S, "r0 to reach step 5")
    r.fork("r1", STEPS, heartbeat=HEARTBEAT_S)
    r.wait_for(_let_in(r, "r1"), TIMEOUT_S, "r1 to be let in")
    gate.touch()
    codes = r.wait(["r0", "r1"], TIMEOUT_S)
    assert codes == {"r0": -signal.SIGKILL, "r1": 4}, r.logs()
    errors = [rec for rec in r.records("r1") if rec["kind"] == "error"]
    assert [e["type"] for e in errors] == ["StateLost"], errors
    assert "restart the run from a checkpoint" in errors[0]["message"]
    assert not _steps(r, "r1")
    fault = [rec for rec in r.records("r0") if rec["kind"] == "fault"][0]
    assert errors[0]["time"] - fault["time"] < HEARTBEAT_S + 5, (fault, errors)  # 0.04 s measured
