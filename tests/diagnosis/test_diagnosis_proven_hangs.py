"""Proven hangs: when the reports prove that a wait can never end, every
waiting rank raises within seconds, whatever hang_timeout_s is (Note [Proven
hangs] in ddp_ext/_diagnosis/hang.py, Note [Hang attribution] in
reducer/observation/stall_watch.h).

Every run here keeps the default settings (hang_timeout_s=60, on_hang="auto")
on the ranks that wait, so a rank that raised after the timeout, as before,
fails the bound on the elapsed time by far. The bounds leave room for a
loaded two-core machine but stay well below the 60 s default.
"""

import datetime
import os
import re
import time
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401 - else the first forward imports it, seconds that would look like a late rank
import torch.distributed as dist

import ddp_ext
from ddp_ext._diagnosis.hang import UNFINISHED_PROOF_S
from tests.support.spawn import run_ranks, run_ranks_with_a_victim
from tests.support.models import SkippableNet

PROVEN_WITHIN_S = 5.0  # the bound for a proof: one probe slice (1 s) and a loaded machine
PG_TIMEOUT_S = 120.0  # far above every bound: a rank that waited for it fails them
NOT_FINISHED = "Expected to have finished reduction in the prior iteration before starting a new one"


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    # The ranks inherit the environment: the defaults must be the defaults.
    monkeypatch.delenv("DDP_EXT_HANG_TIMEOUT_S", raising=False)
    monkeypatch.delenv("DDP_EXT_ON_HANG", raising=False)


def _group():
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _barrier_through_store(name, world_size):
    # Not a collective: the process group is unusable after a hang.
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    deadline = time.monotonic() + 90
    while int(store.add(name, 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def _check_waiting_ranks(outcomes, skip, within_s, says):
    for rank, (message, seconds) in enumerate(outcomes):
        if rank in skip:
            continue
        print(f"rank {rank}: raised after {seconds} s\n{message}")
        assert message is not None, f"rank {rank} did not raise"
        assert seconds < within_s, f"rank {rank} raised after {seconds:.1f} s, not within {within_s} s"
        for text in says:
            assert text in message, f"rank {rank}: the message lacks {text!r}:\n{message}"


# --- A rank leaves parameters without a gradient and stays alive ------------------------


def _skips_and_stays_alive(rank, world_size, next_forward):
    """The last rank leaves fc2 without a gradient in training step 2; with
    `next_forward` it then runs its next forward, which raises, catches the
    error and stays alive (a notebook, a retry loop); without, it stays
    alive without one (its backward ended unfinished). The others wait."""
    torch.manual_seed(0)
    last = rank == world_size - 1
    net = SkippableNet()
    ddp = ddp_ext.DistributedDataParallel(net, process_group=_group())
    assert ddp._hang_settings.timeout_s == 60.0 and ddp._hang_settings.on_hang == "auto"
    x = torch.randn(3, 4)
    ddp(x).pow(2).mean().backward()  # step 0: every rank
    net.skip = last
    loss = ddp(x).pow(2).mean()
    start = time.monotonic()
    outcome = (None, None)
    try:
        loss.backward()
        if last and next_forward:
            ddp(x)
    except RuntimeError as e:
        outcome = (str(e), time.monotonic() - start)
    _barrier_through_store(f"skip-done-{next_forward}", world_size)  # the last rank stays alive until then
    return outcome


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_skipped_a_parameter_and_caught_its_error_is_named_within_seconds(world_size):
    outcomes = run_ranks(_skips_and_stays_alive, world_size, True, timeout=150)
    last = world_size - 1
    assert outcomes[last][0] is not None and NOT_FINISHED in outcomes[last][0], outcomes[last]
    _check_waiting_ranks(
        outcomes,
        skip={last},
        within_s=PROVEN_WITHIN_S,
        says=(
            f"rank {last} left parameters without a gradient in the backward of training step 2",
            "fc2.weight, fc2.bias",
            "raised at its next forward",
            "raised without waiting for hang_timeout_s (60 s)",
            "find_unused_parameters=True",
            "hang_timeout_s=60",
        ),
    )
    for message, _ in outcomes[:last]:
        assert "fc0." not in message and "fc1." not in message, message


def test_a_backward_that_ended_unfinished_is_proof_once_the_wait_lasted_a_second_backwards_time():
    """Without its next forward, the rank's report says only that its
    backward ended unfinished: a second backward may still complete it, so
    it proves nothing until the others have waited UNFINISHED_PROOF_S."""
    outcomes = run_ranks(_skips_and_stays_alive, 2, False, timeout=150)
    assert outcomes[1] == (None, None), outcomes[1]
    _check_waiting_ranks(
        outcomes,
        skip={1},
        within_s=UNFINISHED_PROOF_S + PROVEN_WITHIN_S - 1.0,
        says=(
            "rank 1 left parameters without a gradient in the backward of training step 2",
            "fc2.weight, fc2.bias",
            "hang_timeout_s=60",
        ),
    )
    seconds = outcomes[0][1]
    assert seconds >= UNFINISHED_PROOF_S * 0.95, f"raised after {seconds:.2f} s: an unfinished backward is no proof yet"


# --- A peer dies mid-step ---------------------------------------------------------------


def _dies_mid_step(rank, world_size):
    torch.manual_seed(0)
    victim = world_size - 1
    net = SkippableNet()
    ddp = ddp_ext.DistributedDataParallel(net, process_group=_group(), bucket_cap_mb=1e-9)
    if rank == victim:
        # Dies in its backward of training step 2, after fc2's and fc1's buckets left.
        net.fc0.weight.register_hook(lambda g: os._exit(3) if ddp.reducer.training_steps == 2 else g)
    x = torch.randn(3, 4)
    start = None
    try:
        for _ in range(3):
            loss = ddp(x).pow(2).mean()
            start = time.monotonic()
            loss.backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None, None


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_died_mid_step_is_named_within_seconds(world_size):
    outcomes, exit_code = run_ranks_with_a_victim(_dies_mid_step, world_size)
    victim = world_size - 1
    assert exit_code == 3, f"the victim ended with {exit_code}"
    assert all(o is not None for o in outcomes), f"survivors that answered: {outcomes}"
    _check_waiting_ranks(
        outcomes,
        skip=set(),
        within_s=3.0,
        says=(f"rank {victim} died during training step 2", f"rank {victim}: reported nothing"),
    )


# --- A peer raised and left the collectives -----------------------------------------------


def _one_raises_and_leaves(rank, world_size):
    """Rank 0 alone gives up on late ranks after 1 s (on_hang="raise"), raises,
    catches its error and stays alive; the last rank is 3 s late for training
    step 2, whose forward does the first bucket rebuild (a broadcast). The
    others keep the defaults: their waits in step 2 can never end, since
    rank 0 left."""
    torch.manual_seed(0)
    late = world_size - 1
    settings = dict(hang_timeout_s=1.0, on_hang="raise") if rank == 0 else {}
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=_group(), **settings)
    x = torch.randn(3, 4) + rank
    outcome, raised_at = (None, None), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if rank == late and step == 1:
                time.sleep(3.0)  # "data loading"
            start = time.monotonic()
            try:
                ddp(x).pow(2).mean().backward()
            except RuntimeError as e:
                outcome = (str(e), time.monotonic() - start)
                raised_at = time.time()  # the ranks share a host, and its clock
                break
    _barrier_through_store("raised-done", world_size)
    warned = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    return outcome, warned, raised_at


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_raised_and_left_is_named_within_seconds(world_size):
    results = run_ranks(_one_raises_and_leaves, world_size, timeout=150)
    outcomes = [outcome for outcome, _, _ in results]
    late = world_size - 1
    # Rank 0 names the late rank (and, with 3 ranks, rank 1 too: a wait
    # short of its own hang_timeout_s publishes nothing).
    assert outcomes[0][0] is not None and "did not reach the forward of training step 2" in outcomes[0][0], outcomes[0]
    assert f"rank {late}: reported nothing" in outcomes[0][0], outcomes[0]
    # The late rank's step began after rank 0 left: the broadcast that rank 0
    # (and, with 3 ranks, rank 1) launched before leaving completes, and the
    # backward's first collective never does: it raises within seconds.
    _check_waiting_ranks(
        outcomes,
        skip=set(range(late)),
        within_s=PROVEN_WITHIN_S,
        says=("raised an error in training step 2 and left the collectives", "hang_timeout_s=60"),
    )
    for rank in range(1, world_size):
        message = outcomes[rank][0]
        assert message is not None, f"rank {rank} did not raise"
        since = results[rank][2] - results[0][2]
        assert since < 3.0 + PROVEN_WITHIN_S, f"rank {rank} raised {since:.1f} s after rank 0 left (3 s late)"
        # Rank 0, and with 3 ranks perhaps the other one, which raised first.
        assert re.search(r"DistributedDataParallel: ranks? 0(, \d)? raised an error in training step 2", message), message
        assert "hang_timeout_s=60" in message and "raised without waiting for hang_timeout_s" in message, message
    for rank, (_, warned, _) in enumerate(results[1:], start=1):
        assert warned == [], f"rank {rank} warned: {warned}"


# --- A merely late rank: hang_timeout_s still decides -------------------------------------


def _late_with_defaults(rank, world_size, late_s):
    torch.manual_seed(0)
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=_group())
    x = torch.randn(3, 4) + rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if rank == 1 and step == 1:
                time.sleep(late_s)
            ddp(x).pow(2).mean().backward()
    diagnosis = ddp._hang_diagnosis
    return (
        [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)],
        [p.grad.clone() for p in ddp.parameters()],
        (diagnosis.probes, diagnosis.probe_reads, list(diagnosis.messages)),
    )


def test_a_late_rank_is_no_proof_and_the_probes_read_no_report_without_one():
    """Rank 1 is 4 s late: rank 0's wait probes every second, reads only
    the proof counter, and the reports once (at UNFINISHED_PROOF_S), finds
    nothing proven, and waits on without a word (hang_timeout_s is 60 s)."""
    (warned0, grads0, (probes, reads, messages)), (warned1, grads1, _) = run_ranks(
        _late_with_defaults, 2, 4.0, timeout=150
    )
    print(f"rank 0: {probes} probes, {reads} of them read the reports")
    assert warned0 == [] and warned1 == [] and messages == [], (warned0, warned1, messages)
    assert probes >= 3, f"rank 0 probed {probes} times in a 4 s wait"
    assert 1 <= reads <= 2, f"rank 0 read the reports in {reads} probes: only every {UNFINISHED_PROOF_S} s"
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)


def _healthy_probes(rank, world_size, iterations):
    torch.manual_seed(0)
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=_group())
    x = torch.randn(3, 4) + rank
    for _ in range(iterations):
        ddp(x).pow(2).mean().backward()
    diagnosis = ddp._hang_diagnosis
    return diagnosis.probes, diagnosis.probe_reads, list(diagnosis.messages)


def test_healthy_training_reads_no_report():
    for rank, (probes, reads, messages) in enumerate(run_ranks(_healthy_probes, 2, 200, timeout=150)):
        # A wait longer than a slice may happen on a loaded machine; it reads
        # the counter only.
        assert reads == 0 and messages == [], f"rank {rank}: {probes} probes, {reads} reads, {messages}"


# --- The probe on its own, over an in-memory store ----------------------------------------


class _CountingStore:
    """A HashStore that counts the calls the probe makes."""

    def __init__(self):
        self.store = dist.HashStore()
        self.calls = []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.calls.append(name)
            return method(*args)

        return counted


def _report(kind, rank, step, waited_s=0.0, **extra):
    return dict(
        kind=kind, rank=rank, step=step, training_steps=step, phase="reducing", waiting_for="bucket", bucket=0,
        waited_s=waited_s, error="", buckets_launched=0, buckets_total=1, unready=["fc2.weight"], unready_buckets=[0],
        **extra,
    )


def _diagnoses(world_size, on_hang="auto"):
    from ddp_ext._diagnosis import HangDiagnosis, resolve_hang_settings
    from ddp_ext._diagnosis.side_channel import SideChannel

    store = _CountingStore()
    settings = resolve_hang_settings(None, on_hang)
    return store, [
        HangDiagnosis(settings, SideChannel(store, r, world_size, "test"), r, world_size) for r in range(world_size)
    ]


def test_a_probe_reads_one_counter_until_a_proof_moves_it():
    store, (waiting, skipping, other) = _diagnoses(3)
    store.calls.clear()
    assert waiting(_report("waiting", 0, 2, waited_s=1.0)) is None
    assert store.calls == ["add"], store.calls  # the counter, nothing else
    # An unfinished backward moves no counter, and is no proof before 3 s.
    skipping(_report("unfinished", 1, 2))
    store.calls.clear()
    assert waiting(_report("waiting", 0, 2, waited_s=2.0)) is None
    assert store.calls == ["add"], store.calls
    # At 3 s of waiting the probe reads the reports: the unfinished backward proves it.
    message = waiting(_report("waiting", 0, 2, waited_s=3.0))
    assert message is not None and "rank 1 left parameters without a gradient" in message, message
    assert "fc2.weight" in message and "raised without waiting for hang_timeout_s (60 s)" in message, message
    # Rank 0 raised: rank 2's next probe sees the counter move and raises at 1 s.
    message = other(_report("waiting", 2, 2, waited_s=1.0))
    assert message is not None and "rank 1 left parameters without a gradient" in message, message
    assert "rank 0: raised an error after its wait" in message, message


def test_a_proof_counts_at_once_for_its_own_step_only():
    store, (waiting, skipping) = _diagnoses(2)
    skipping(_report("abandoned", 1, 1))  # an earlier step's incident, survived
    assert waiting(_report("waiting", 0, 2, waited_s=1.0)) is None
    assert waiting.probe_reads == 1  # the counter moved: read once, not again
    assert waiting(_report("waiting", 0, 2, waited_s=2.0)) is None
    assert waiting.probe_reads == 1
    skipping(_report("abandoned", 1, 2))
    message = waiting(_report("waiting", 0, 2, waited_s=1.0))
    assert message is not None and "rank 1 left parameters without a gradient in the backward of training step 2" in message
    assert "and it raised at its next forward" in message, message


def test_on_hang_warn_does_not_probe():
    store, (waiting, skipping) = _diagnoses(2, on_hang="warn")
    skipping(_report("abandoned", 1, 2))
    store.calls.clear()
    assert waiting(_report("waiting", 0, 2, waited_s=5.0)) is None
    assert store.calls == [] and waiting.probes == 0


def test_a_repeated_report_does_not_wait_for_the_others():
    # Note [Repeated reports]: the first report of a wait gives the others a
    # window to report; the repeats read in one pass, so a wait that completes
    # meanwhile is not held up by a window it no longer needs.
    from ddp_ext._diagnosis import HangDiagnosis, resolve_hang_settings
    from ddp_ext._diagnosis.side_channel import SideChannel

    settings = resolve_hang_settings(2.0, "auto")
    store = _CountingStore()
    waiting = HangDiagnosis(settings, SideChannel(store, 0, 2, "test"), 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        assert waiting(_report("stalled", 0, 3, waited_s=2.0)) is None  # rank 1 is silent: warn, wait on
        first = time.monotonic() - start
        store.calls.clear()
        assert waiting(_report("stalled", 0, 3, waited_s=4.0)) is None
    assert first >= settings.window_s, f"the first report waited {first:.2f} s, less than its window"
    # The repeat: its report written, then one look for rank 1's report and one
    # for its process; no polling, whatever the machine's load.
    assert store.calls == ["set", "check", "check"], store.calls
    assert len(caught) == 1 and "rank 1 did not reach the end of the backward of training step 3" in str(caught[0].message)
    assert "reported nothing through the store within 4.0 s" in waiting.messages[1], waiting.messages[1]
