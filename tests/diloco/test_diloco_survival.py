"""Fault-tolerant DiLoCo in real processes: two hosts of two ranks, each
host a torch.distributed job of its own, meeting through a fault-tolerance
coordinator (tests/diloco/surviving_worker.py). One host's ranks are killed
(SIGKILL) between two syncs: the other goes on without a restart, and a
replacement host joins at a later sync and heals from it. Or they are
killed in a sync: the survivors run it again without them. With fragments
and 8 or 4 bits, the same, and without failures the same result as DiLoCo
in one job."""

import signal
import socket

import pytest
import torch

from tests.diloco import surviving_worker, workers
from tests.support.fault_tolerance_harness import forked, runs_closed_after
from tests.support.worlds import shared_world


@pytest.fixture
def run(tmp_path):
    with runs_closed_after(tmp_path) as make:
        yield make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_host(r, host: str, index: int, name: str, steps: int, sync_every: int, **options):
    """Starts a host's two ranks as replicas `name`0 and `name`1 of run `r`."""
    port = _free_port()
    for rank in range(workers.RANKS_PER_HOST):
        key = f"{name}{rank}"
        argv = ["--coordinator", r.address, "--host", host, "--host-index", str(index), "--rank", str(rank),
                "--port", str(port), "--steps", str(steps), "--sync-every", str(sync_every),
                "--out", str(r.tmp / f"{key}.jsonl")]
        for option, value in options.items():
            argv += [f"--{option.replace('_', '-')}", str(value)]
        # Forked from the harness's forkserver, which imported torch once: a new process, started at once.
        r.procs[key] = forked(surviving_worker.__name__, argv, str(r.tmp / f"{key}.log"))


def _steps(r, key):
    return [rec for rec in r.records(key) if rec["kind"] == "step"]


def _final(r, key):
    return torch.load(str(r.tmp / f"{key}.jsonl.pt"))


def test_without_failure_at_every_step_with_plain_outer_sgd_is_local_sgd(run):
    # As in test_diloco_training: H = 1, outer SGD at lr 1. The hosts start
    # from different models; the first quorum gives every rank its first
    # member's (the first to say hello).
    steps = 6
    r = run(min_replicas=4)
    _start_host(r, "a", 0, "a", steps, 1, outer="plain")
    _start_host(r, "b", 1, "b", steps, 1, outer="plain")
    assert r.wait(["a0", "a1", "b0", "b1"], timeout=240) == {k: 0 for k in ["a0", "a1", "b0", "b1"]}, r.logs()
    first = r.epochs()[0][0]
    expected = workers.local_sgd_reference(steps, average=True, seed={"a": 0, "b": 1}[first[0]])[0]
    for key in ["a0", "a1", "b0", "b1"]:
        final = _final(r, key)
        for actual, reference in zip(final["global"], expected, strict=True):
            torch.testing.assert_close(actual, reference, rtol=0, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(final["global"], _final(r, "a0")["global"]))
        syncs = [rec["members"] for rec in _steps(r, key)]
        assert all(sorted(m) == ["a/0", "a/1", "b/0", "b/1"] for m in syncs), syncs


def test_a_killed_host_is_dropped_and_a_replacement_heals(run):
    steps, sync_every = 40, 4
    r = run(min_replicas=4)
    gate = r.tmp / "gate"  # host a waits there (between syncs) until the replacement is let in
    _start_host(r, "a", 0, "a", steps, sync_every, sleep=0.05, gate=f"30:{gate}")
    _start_host(r, "b", 1, "b", steps, sync_every, sleep=0.05)
    # Kill host b between two syncs (its steps 10, 11: mid-fragment).
    r.wait_for(lambda: len(_steps(r, "b0")) >= 10 and len(_steps(r, "b1")) >= 10, 240, "host b to reach step 10")
    for key in ("b0", "b1"):
        r.signal(key, signal.SIGKILL)
    killed_at = max(rec["step"] for key in ("b0", "b1") for rec in _steps(r, key))
    # The survivors sync without b, with no restart.
    r.wait_for(lambda: any(sorted(rec["members"]) == ["a/0", "a/1"] for rec in _steps(r, "a0") if rec["members"]), 120,
               "host a to sync without host b")
    # A replacement host (another model, no state) joins and heals.
    _start_host(r, "b", 1, "c", steps, sync_every, sleep=0.05)
    announced = len(r.epochs())
    r.wait_for(lambda: any({"b/0", "b/1"} <= set(m) for m in r.epochs()[announced - 1:]), 120,
               "the replacement to be let in")
    gate.touch()
    codes = r.wait(["a0", "a1", "b0", "b1", "c0", "c1"], timeout=300)
    assert codes == {"a0": 0, "a1": 0, "b0": -signal.SIGKILL, "b1": -signal.SIGKILL, "c0": 0, "c1": 0}, r.logs()

    for key in ("a0", "a1"):
        recs = r.records(key)
        assert len({rec["pid"] for rec in recs}) == 1  # never restarted
        assert [rec["step"] for rec in _steps(r, key)] == list(range(1, steps + 1))
    syncs = {rec["step"]: sorted(rec["members"]) for rec in _steps(r, "a0") if rec["members"]}
    assert all(syncs[s] == ["a/0", "a/1", "b/0", "b/1"] for s in syncs if s < killed_at)
    alone = [s for s in syncs if syncs[s] == ["a/0", "a/1"]]
    assert alone and min(alone) > killed_at and min(alone) - killed_at <= sync_every
    assert syncs[steps] == ["a/0", "a/1", "b/0", "b/1"]  # the replacement, under the dead host's name

    joined = [rec for rec in r.records("c0") if rec["kind"] == "joined"][0]
    assert joined["step"] % sync_every == 0 and joined["step"] > max(alone)
    assert syncs[joined["step"]] == ["a/0", "a/1", "b/0", "b/1"]
    assert [rec["step"] for rec in _steps(r, "c0")] == list(range(joined["step"] + 1, steps + 1))

    finals = {key: _final(r, key) for key in ("a0", "a1", "c0", "c1")}
    for key, final in finals.items():  # the last step is a sync: everyone holds the same parameters
        for a, b in zip(final["global"] + final["live"], finals["a0"]["global"] + finals["a0"]["global"],
                        strict=True):
            assert torch.equal(a, b), key
    losses = [rec["loss"] for rec in _steps(r, "a0")]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def test_a_host_killed_in_a_sync_makes_the_survivors_run_it_again(run):
    steps, sync_every, dies_in = 20, 4, 3  # the sync at step 12
    r = run(min_replicas=4)
    _start_host(r, "a", 0, "a", steps, sync_every)
    _start_host(r, "b", 1, "b", steps, sync_every, die_in_sync=dies_in)
    codes = r.wait(["a0", "a1", "b0", "b1"], timeout=240)
    assert codes == {"a0": 0, "a1": 0, "b0": -signal.SIGKILL, "b1": -signal.SIGKILL}, r.logs()
    assert [rec["step"] for rec in r.records("b0") if rec["kind"] == "fault"] == [dies_in * sync_every]
    for key in ("a0", "a1"):
        syncs = {rec["step"]: rec for rec in _steps(r, key) if rec["members"]}
        assert sorted(syncs) == list(range(sync_every, steps + 1, sync_every))
        assert all(len(syncs[s]["members"]) == 4 and syncs[s]["attempts"] == 1 for s in (4, 8))
        # aborted with b in it, then committed by a alone; nothing of it applied twice or half
        assert sorted(syncs[12]["members"]) == ["a/0", "a/1"] and syncs[12]["attempts"] >= 2
        assert all(sorted(syncs[s]["members"]) == ["a/0", "a/1"] for s in (16, 20))
    a0, a1 = _final(r, "a0"), _final(r, "a1")
    for x, y in zip(a0["global"] + a0["live"], a1["global"] + a1["global"], strict=True):
        assert torch.equal(x, y)


def _syncs(r, key):
    """{the step a sync was launched at: the record of the step it was merged at}."""
    return {rec["launched"]: rec for rec in _steps(r, key) if rec["members"]}


@pytest.mark.parametrize("delay", [0, 1])
def test_without_failure_fragments_in_8_bits_train_as_diloco_in_one_job(run, delay):
    # Every host starts from the first member's model; DiLoCo in one job of
    # 4 ranks, from that model, is the reference: the same pseudo-gradients,
    # payloads and outer steps, the mean added over 4 members rather than 2
    # hosts (rounding).
    steps, sync_every = 12 + delay, 4
    settings = {"fragments": 2, "bits": 8, "mix": 0.5, "delay": delay}
    r = run(min_replicas=4)
    _start_host(r, "a", 0, "a", steps, sync_every, state_dict_at="2,3", **settings)
    _start_host(r, "b", 1, "b", steps, sync_every, **settings)
    assert r.wait(["a0", "a1", "b0", "b1"], timeout=240) == {k: 0 for k in ["a0", "a1", "b0", "b1"]}, r.logs()
    tries = {rec["step"]: rec for rec in r.records("a0") if rec["kind"] == "state_dict"}
    if delay:  # the sync launched at step 2 is in flight until step 3
        assert "a sync is in flight until its merge step" in tries[2]["error"] and "error" not in tries[3]
    else:
        assert "error" not in tries[2] and "error" not in tries[3]
    seed = {"a": 0, "b": 1}[r.epochs()[0][0][0]]
    reference = shared_world(4).run(workers.train, steps, "sgd", dict(settings, sync_every=sync_every), seed,
                                    timeout=120)
    for key, rank in (("a0", 0), ("a1", 1), ("b0", 2), ("b1", 3)):
        final = _final(r, key)
        live, glob = reference[rank][0], reference[rank][1]
        for actual, expected in zip(final["global"] + final["live"], glob + live, strict=True):
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        syncs = _syncs(r, key)
        assert sorted(syncs) == list(range(2, 13, 2)) and all(len(rec["members"]) == 4 for rec in syncs.values())


@pytest.mark.parametrize("bits, delay, dies", [(8, 0, "die_in_sync"), (4, 0, "die_in_sync"), (8, 1, "die_in_sync"),
                                               (8, 0, "die_after_parts")])
def test_fragments_in_few_bits_a_host_killed_in_a_sync_is_dropped_and_a_replacement_heals(run, bits, delay, dies):
    # F = 2, H = 4: syncs launched at steps 2, 4, 6, ..., the n-th of fragment
    # (n - 1) mod 2, merged `delay` steps later (the exchange in flight meanwhile).
    # Host b dies as the sync starts its exchange, or (die_after_parts) once
    # its ranks sent their parts across hosts: host a then holds b's parts,
    # but every member takes part in the exchange inside the hosts, so a's
    # fails, and the sync is aborted. There every rank also runs the whole
    # exchange at each sync, to compare.
    steps, sync_every, dies_in = 24 + delay, 4, 5  # the sync launched at step 10, fragment 0's
    settings = {"fragments": 2, "bits": bits, "delay": delay, "int8_chunk": 16}
    if dies == "die_after_parts":
        settings["split"] = "check"
    r = run(min_replicas=4)
    gate = r.tmp / "gate"  # host a waits there until the replacement is let in
    _start_host(r, "a", 0, "a", steps, sync_every, gate=f"16:{gate}", **settings)
    _start_host(r, "b", 1, "b", steps, sync_every, **{dies: dies_in}, **settings)
    r.wait_for(lambda: any(sorted(rec["members"]) == ["a/0", "a/1"] for rec in _steps(r, "a0") if rec["members"]), 120,
               "host a to sync without host b")
    _start_host(r, "b", 1, "c", steps, sync_every, **settings)
    announced = len(r.epochs())
    r.wait_for(lambda: any({"b/0", "b/1"} <= set(m) for m in r.epochs()[announced - 1:]), 120,
               "the replacement to be let in")
    gate.touch()
    codes = r.wait(["a0", "a1", "b0", "b1", "c0", "c1"], timeout=300)
    assert codes == {"a0": 0, "a1": 0, "b0": -signal.SIGKILL, "b1": -signal.SIGKILL, "c0": 0, "c1": 0}, r.logs()
    # b died as the sync launched at step 10 ran its exchange (with a delay: while training went on)
    assert [rec["step"] for rec in r.records("b0") if rec["kind"] == "fault"] in ([10], [10 + delay])

    for key in ("a0", "a1"):
        assert len({rec["pid"] for rec in r.records(key)}) == 1  # never restarted
        syncs = _syncs(r, key)
        assert sorted(syncs) == list(range(2, 25, 2))
        assert all(len(syncs[s]["members"]) == 4 and syncs[s]["attempts"] == 1 for s in (2, 4, 6, 8))
        # aborted with b in it, then committed by a alone
        assert sorted(syncs[10]["members"]) == ["a/0", "a/1"] and syncs[10]["attempts"] >= 2
        assert sorted(syncs[24]["members"]) == ["a/0", "a/1", "b/0", "b/1"]
    joined = [rec for rec in r.records("c0") if rec["kind"] == "joined"][0]
    assert joined["step"] % 2 == 0 and joined["step"] > 16 and sorted(joined["members"]) == [
        "a/0", "a/1", "b/0", "b/1"]
    assert [rec["step"] for rec in _steps(r, "c0")] == list(range(joined["step"] + 1, steps + 1))

    finals = {key: _final(r, key) for key in ("a0", "a1", "c0", "c1")}
    for key, final in finals.items():  # every fragment's synced parameters agree everywhere
        assert all(torch.equal(a, b) for a, b in zip(final["global"], finals["a0"]["global"], strict=True)), key
    for x, y in (("a0", "a1"), ("c0", "c1")):  # a host's ranks stay equal
        assert all(torch.equal(a, b) for a, b in zip(finals[x]["live"], finals[y]["live"], strict=True))
    losses = [rec["loss"] for rec in _steps(r, "a0")]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])
    if dies == "die_after_parts":
        for key in ("a0", "a1", "c0", "c1"):  # the split's mean had the whole's bits at every attempt
            exchanges = [rec for rec in r.records(key) if rec["kind"] == "exchange"]
            assert exchanges and all(rec["split"] and rec["equal"] for rec in exchanges), exchanges
        # the attempt with host b in it raised on host a: only the survivors' rerun finished
        tried = [rec for rec in r.records("a0") if rec["kind"] == "exchange" and rec["sync"] == dies_in]
        assert [len(rec["members"]) for rec in tried] == [2]


@pytest.mark.parametrize("bits", [32, 8])
def test_a_hosts_ranks_share_its_exchange_with_the_bits_of_the_whole_and_half_the_bytes(run, bits):
    # Each host's two ranks send half of each fragment across hosts (the
    # default). At every sync each rank also runs the whole exchange (every
    # member all-gathering its whole payload) and records whether the two
    # means are bitwise equal; a second run, every rank sending its whole
    # fragment, counts the bytes. Chunks of 16 elements, so the 8-bit
    # fragments are cut too.
    steps, sync_every = 12, 4
    settings = {"fragments": 2, "bits": bits, "int8_chunk": 16}
    shared, whole = run(min_replicas=4), run(min_replicas=4)
    for r, prefix, split in ((shared, "", "check"), (whole, "w", "off")):
        _start_host(r, "a", 0, prefix + "a", steps, sync_every, split=split, **settings)
        _start_host(r, "b", 1, prefix + "b", steps, sync_every, split=split, **settings)
    keys = ["a0", "a1", "b0", "b1"]
    assert shared.wait(keys, timeout=300) == {k: 0 for k in keys}, shared.logs()
    assert whole.wait(["w" + k for k in keys], timeout=300) == {"w" + k: 0 for k in keys}, whole.logs()

    for key in keys:
        exchanges = [rec for rec in shared.records(key) if rec["kind"] == "exchange"]
        assert len(exchanges) == steps // 2 and all(len(rec["members"]) == 4 for rec in exchanges)
        assert all(rec["split"] and rec["equal"] for rec in exchanges), exchanges
    sent = {key: [rec for rec in shared.records(key) if rec["kind"] == "done"][0]["bytes_sent"] for key in keys}
    sent_whole = {key: [rec for rec in whole.records("w" + key) if rec["kind"] == "done"][0]["bytes_sent"]
                  for key in keys}
    assert len(set(sent_whole.values())) == 1 and sent_whole["a0"] > 0
    for host in ("a", "b"):  # a host's two ranks send one whole payload between them
        assert sent[host + "0"] + sent[host + "1"] == sent_whole["a0"]
        assert all(0.4 * sent_whole["a0"] < sent[host + rank] < 0.6 * sent_whole["a0"] for rank in "01")

    finals = {key: _final(shared, key) for key in keys}
    for key in keys:  # the last step is a sync: everyone holds the same parameters
        assert all(torch.equal(a, b) for a, b in zip(finals[key]["global"], finals["a0"]["global"], strict=True))
    # Both runs started from the same model only if the same host said hello first.
    if shared.epochs()[0][0][0] == whole.epochs()[0][0][0]:
        for a, b in zip(finals["a0"]["global"], _final(whole, "wa0")["global"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # the members' order may differ: rounding
