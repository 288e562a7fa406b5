"""Bad input to fault-tolerant training: clear errors, and nothing lost on
the live replicas; and what replicas do when the coordinator dies."""

import signal
import time

import pytest
import torch

from ddp_ext.fault_tolerance import Replica
from tests.support.fault_tolerance_harness import check_run, runs_closed_after

STEPS = 12


@pytest.fixture
def runs(tmp_path):
    with runs_closed_after(tmp_path) as make:
        yield make


@pytest.mark.parametrize("timeout", [0, -1.0, 0.0])
def test_heartbeat_timeout_must_be_positive(timeout):
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive number of seconds"):
        Replica(net, None, coordinator="127.0.0.1:1", replica_id="r0", heartbeat_timeout=timeout)


def test_replica_makes_its_own_process_groups():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="do not pass 'process_group'"):
        Replica(net, None, coordinator="127.0.0.1:1", replica_id="r0", ddp_kwargs={"process_group": None})


def test_bad_joiners_are_refused_and_the_run_goes_on(runs, tmp_path):
    r = runs(min_replicas=2)
    other = runs(run_id="other")
    gate = tmp_path / "gate"
    for rid in ("r0", "r1"):
        r.fork(rid, STEPS, gate=f"4:{gate}")
    # The run's model is its first replica's: let the good ones in first.
    r.wait_for(lambda: all(any(rec["kind"] == "step" for rec in r.records(rid)) for rid in ("r0", "r1")), 300,
               "r0 and r1 to train")
    r.fork("r2", STEPS, model="wide")  # a different model
    r.fork("r3", STEPS, coordinator=other.address)  # another run's coordinator
    r.wait(["r2", "r3"])
    refused = {rid: [rec for rec in r.records(rid) if rec["kind"] == "refused"] for rid in ("r2", "r3")}
    assert "different model" in refused["r2"][0]["message"], refused
    assert "serves run 'other'" in refused["r3"][0]["message"], refused
    gate.touch()
    assert r.wait(["r0", "r1"]) == {"r0": 0, "r1": 0}, r.logs()
    per_step = check_run(r, ["r0", "r1"], STEPS)
    assert all(seen["members"] == per_step[0]["members"] for seen in per_step.values())


@pytest.mark.parametrize("hook", ["overlap", "overlap-in-step"])
def test_stepping_inside_the_backward_is_refused(runs, hook):
    """overlap_optimizer would step before the quorum decides: refused on
    every replica, from Replica(configure=...) or from a train_step, with
    no step applied."""
    r = runs(min_replicas=2)
    for rid in ("r0", "r1"):
        r.fork(rid, STEPS, hook=hook)
    assert r.wait(["r0", "r1"], timeout=120) == {"r0": 4, "r1": 4}, r.logs()
    for rid in ("r0", "r1"):
        records = r.records(rid)
        error = [rec for rec in records if rec["kind"] == "error"][0]
        assert error["type"] == "ValueError", error
        assert "cannot step parameters inside the backward (overlap_optimizer)" in error["message"], error
        assert "ddp_ext.fault_tolerance.Replica" in error["message"], error
        assert error["step"] == 0 and not [rec for rec in records if rec["kind"] == "step"], records


def test_the_coordinator_dying_stops_the_replicas_with_a_clear_error(runs):
    r = runs(min_replicas=2)
    for rid in ("r0", "r1"):
        r.fork(rid, 10_000, sleep=0.05, heartbeat=2.0)
    r.wait_for(lambda: any(rec["kind"] == "step" and rec["step"] >= 3 for rec in r.records("r0")), 120,
               "training to start")
    killed = time.time()
    r.coordinator.send_signal(signal.SIGKILL)
    codes = r.wait(["r0", "r1"], timeout=120)
    assert codes == {"r0": 4, "r1": 4}, r.logs()
    for rid in ("r0", "r1"):
        error = [rec for rec in r.records(rid) if rec["kind"] == "error"][0]
        assert error["type"] == "CoordinatorLost", error
        assert "coordinator" in error["message"]
        assert error["time"] - killed < 2.0 + 5.0  # never a hang: within the heartbeat timeout and slack
