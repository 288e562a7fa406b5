"""bucket_cap_mb="auto": the tuner's decisions as a table (no processes), and
real runs over Gloo where every rank reads a fake clock that charges each
iteration by its bucket layout, differently per rank, so what the ranks
agree on (the slowest rank's figure) decides. Those runs must follow the
pure policy decision for decision, on every rank at the same iteration, and
change no result: bitwise what fixed caps give at 2 ranks, close at 3 (see
Note [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py), close to local
training and to torch's DDP.
"""

import copy
import dataclasses
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from ddp_ext._arguments import resolve_bucket_caps
from ddp_ext._auto_buckets import AutoBuckets, caps_bytes
from ddp_ext._bucket_tuner import BucketTuner, TuningStage, TunerPolicy
from tests.support import models, reference
from tests.support.harness import CaseTable, assert_states_close, same_bits

# --- the policy, without processes -------------------------------------------

SMALL = TunerPolicy(candidates_mb=((1, 25), (1,), (2,), (3,)), warmup=2, discard=1, trial=2, rounds=2,
                    window=3, drift=0.15, sustain=2)


def simulate(policy: TunerPolicy, iterations: int, cost: Callable[[int, int], float],
             distinct: Sequence[int] = (0, 1, 2, 3)) -> BucketTuner:
    """Records `cost(candidate in use, iteration)` for each iteration, as one
    rank whose figures are the agreed ones."""
    tuner = BucketTuner(policy)
    for k in range(iterations):
        if tuner.record(cost(tuner.current, k)):
            tuner.decide(tuner.figure(), lambda: distinct)
    return tuner


def events(tuner: BucketTuner, kinds=("settled", "drift", "frozen")) -> List[Tuple[str, int]]:
    return [(e.kind, e.candidate) for e in tuner.history if e.kind in kinds]


def trials(tuner: BucketTuner) -> List[int]:
    return [e.candidate for e in tuner.history if e.kind == "trial"]


def _after_switch(base: Dict[int, float], rebuild: float = 100.0):
    """Costs by candidate, plus `rebuild` for the first iteration after each
    switch (that iteration must not be timed)."""
    state = {"last": None}

    def cost(candidate, k):
        switched = state["last"] is not None and state["last"] != candidate
        state["last"] = candidate
        return base[candidate] + (rebuild if switched else 0.0)

    return cost


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    id: str
    cost: Callable[[], Callable[[int, int], float]]  # a fresh cost function per run
    iterations: int
    expected: List[Tuple[str, int]]  # settled / drift events, in order
    distinct: Tuple[int, ...] = (0, 1, 2, 3)
    trials: Optional[List[int]] = None


POLICY_ROWS = [
    PolicyRow("fastest_wins", lambda: (lambda c, k: {0: 10, 1: 8, 2: 5, 3: 9}[c]), 40, [("settled", 2)],
              trials=[0, 1, 2, 3, 3, 2, 1, 0]),
    PolicyRow("tie_goes_to_the_earlier_candidate", lambda: (lambda c, k: {0: 5, 1: 5, 2: 6, 3: 5}[c]), 40,
              [("settled", 0)]),
    PolicyRow("one_layout_settles_without_trials", lambda: (lambda c, k: 1.0), 10, [("settled", 0)],
              distinct=(0,), trials=[]),
    PolicyRow("same_layouts_are_tried_once", lambda: (lambda c, k: {0: 3, 2: 1}[c]), 30, [("settled", 2)],
              distinct=(0, 2), trials=[0, 2, 2, 0]),
    PolicyRow("first_interval_after_a_switch_is_not_timed", lambda: _after_switch({0: 10, 1: 9, 2: 1, 3: 9}), 40,
              [("settled", 2)]),
    # One slow iteration per trial is an outlier the rounds' medians ignore.
    PolicyRow("an_outlier_does_not_decide", lambda: (lambda c, k: 1000.0 if k == 8 else {0: 4, 1: 3, 2: 2, 3: 1}[c]),
              40, [("settled", 3)]),
    # Settled on 2 (figure 5) at iteration 24; from iteration 30 everything is
    # twice as slow and 1 becomes fastest: two drifting windows re-tune.
    PolicyRow("a_sustained_drift_retunes",
              lambda: (lambda c, k: {0: 10, 1: 8, 2: 5, 3: 9}[c] if k < 30 else {0: 12, 1: 9, 2: 10, 3: 12}[c]),
              80, [("settled", 2), ("drift", 2), ("settled", 1)]),
    PolicyRow("one_slow_window_does_not_retune",
              lambda: (lambda c, k: 50.0 if 30 <= k < 33 else {0: 10, 1: 8, 2: 5, 3: 9}[c]), 80, [("settled", 2)]),
    PolicyRow("drift_under_the_threshold_does_not_retune",
              lambda: (lambda c, k: {0: 10, 1: 8, 2: 5, 3: 9}[c] * (1.1 if k >= 30 else 1.0)), 80, [("settled", 2)]),
]


@pytest.mark.parametrize("row", POLICY_ROWS, ids=lambda r: r.id)
def test_policy_decisions(row):
    tuner = simulate(SMALL, row.iterations, row.cost(), row.distinct)
    assert events(tuner) == row.expected, tuner.history
    if row.trials is not None:
        assert trials(tuner) == row.trials, tuner.history
    assert tuner.stage is TuningStage.SETTLED


def test_policy_timeline():
    """When things happen: warm-up, trials of `trial` iterations each, one
    untimed iteration after each switch, none between rounds (same candidate)."""
    tuner = simulate(SMALL, 40, lambda c, k: {0: 10, 1: 8, 2: 5, 3: 9}[c])
    at = [(e.kind, e.candidate, e.iteration) for e in tuner.history]
    assert at == [
        ("trial", 0, 2), ("trial", 1, 4), ("trial", 2, 7), ("trial", 3, 10), ("trial", 3, 13),
        ("trial", 2, 15), ("trial", 1, 18), ("trial", 0, 21), ("settled", 2, 24),
    ]
    assert tuner.settled_figure == 5


def test_freeze_and_restart():
    tuner = simulate(SMALL, 6, lambda c, k: 1.0)
    assert tuner.stage is TuningStage.TUNING and tuner.current == 1
    tuner.restart()
    assert tuner.stage is TuningStage.WARMUP and tuner.current == 1  # keeps the caps in use
    tuner.freeze()
    assert not any(tuner.record(1.0) for _ in range(50))
    tuner.restart()
    assert tuner.stage is TuningStage.FROZEN


def test_former_names_still_work():
    """TunerPhase and BucketTuner.phase were the names of TuningStage and
    BucketTuner.stage; callers that use them keep working."""
    from ddp_ext._bucket_tuner import TunerPhase

    tuner = simulate(SMALL, 6, lambda c, k: 1.0)
    assert TunerPhase is TuningStage and tuner.phase is tuner.stage is TuningStage.TUNING
    tuner.phase = TunerPhase.FROZEN
    assert tuner.stage is TuningStage.FROZEN


@pytest.mark.parametrize("bad", [dict(candidates_mb=()), dict(candidates_mb=((1, 0),)), dict(trial=0),
                                 dict(window=0), dict(drift=0.0), dict(discard=-1)])
def test_policy_refuses_bad_settings(bad):
    with pytest.raises(ValueError, match="TunerPolicy|candidates_mb"):
        TunerPolicy(**bad)


@pytest.mark.parametrize("value", ["Auto", "fast", "", "AUTO", " auto"])
def test_other_strings_are_refused(value):
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number of MiB, or 'auto'.*got " + repr(value)):
        resolve_bucket_caps(value, None)


def test_auto_starts_from_the_default_and_refuses_a_list():
    caps = resolve_bucket_caps("auto", None)
    assert caps.auto and caps.caps_bytes == resolve_bucket_caps(None, None).caps_bytes
    assert not resolve_bucket_caps(5, None).auto
    with pytest.raises(ValueError, match="bucket_cap_mb_list=\\[1, 25\\]: pass one or the other"):
        resolve_bucket_caps("auto", [1, 25])


# --- real runs over Gloo ---------------------------------------------------------

# Stack: 8 layers of 288 bytes. Candidates: torch's default (1 bucket), then
# caps of exactly 1, 2 and 4 layers (8, 4 and 2 buckets: a bucket closes once
# it reaches its cap).
LAYER_BYTES = 288
CANDIDATES = ((1, 25),) + tuple((layers * LAYER_BYTES / 2**20,) for layers in (1, 2, 4))
BUCKETS_OF = {0: 1, 1: 8, 2: 4, 3: 2}
POLICY = dataclasses.replace(SMALL, candidates_mb=CANDIDATES)
DRIFT_AT = 35
STEPS = 75

# Seconds an iteration costs on each rank, by its number of buckets, before
# and from DRIFT_AT. Alone, rank 0 would pick 8 buckets; the slowest rank's
# figures pick 2, then after the drift 4.
COSTS = {
    0: ({1: 4.0, 8: 1.0, 4: 3.0, 2: 2.0}, {1: 10.0, 8: 12.0, 4: 6.0, 2: 12.0}),
    1: ({1: 4.0, 8: 5.0, 4: 3.0, 2: 2.5}, {1: 9.0, 8: 11.0, 4: 5.0, 2: 11.0}),
    2: ({1: 3.0, 8: 4.0, 4: 2.0, 2: 2.0}, {1: 9.0, 8: 10.0, 4: 5.0, 2: 10.0}),
}


def cost_on(rank: int, step: int, buckets: int) -> float:
    return COSTS[rank][step >= DRIFT_AT][buckets]


def expected_tuner(world_size: int) -> BucketTuner:
    """The pure policy fed the slowest rank's costs: what every rank must do."""
    return simulate(POLICY, STEPS - 1,
                    lambda c, k: max(cost_on(r, k, BUCKETS_OF[c]) for r in range(world_size)))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(frozen=True)
class AutoCase:
    model: str
    micro_batches: int = 1
    ddp: Tuple[Tuple[str, object], ...] = ()
    builtin_hook: bool = False

    @property
    def id(self) -> str:
        parts = [self.model] + [f"{k}={v}" for k, v in self.ddp]
        if self.micro_batches > 1:
            parts.append(f"micro{self.micro_batches}")
        if self.builtin_hook:
            parts.append("builtin_hook")
        return "-".join(parts)

    def as_case(self, **ddp) -> reference.Case:
        return reference.case(self.model, "sgd", steps=STEPS, micro_batches=self.micro_batches,
                              ddp=ddp)


CASES = [
    AutoCase("stack_reversed"),  # the first gradient-order rebuild reverses the buckets
    AutoCase("stack_switching"),  # continuous rebuilds while tuning
    AutoCase("stack_reversed", ddp=(("rebuild_buckets", "once"),)),
    AutoCase("stack_reversed", ddp=(("gradient_as_bucket_view", True),)),
    AutoCase("stack_reversed", ddp=(("static_graph", True),)),
    AutoCase("stack_switching", micro_batches=2),  # only synchronising iterations count
    AutoCase("stack_switching", micro_batches=2, ddp=(("gradient_as_bucket_view", True),)),
    AutoCase("stack_reversed", builtin_hook=True),  # a stateless hook lets tuning go on
]


def _auto_wrapper(c: AutoCase, clock: FakeClock, builtin_hook: bool):
    def wrap(module, **kwargs):
        ddp = reference.ext_ddp(module, **kwargs)
        ddp._auto_buckets = AutoBuckets(POLICY, clock=clock)
        if builtin_hook:
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        return ddp

    return wrap


def _train_auto(rank, world_size, c: AutoCase):
    clock = FakeClock()
    steps = []

    def on_step(ddp, module):
        layout = ddp.bucket_indices()
        clock.now += cost_on(rank, len(steps), len(layout))
        steps.append(dict(
            layout=layout,
            candidate=ddp.bucket_tuner.current,
            bucket_bytes_cap=ddp.bucket_bytes_cap,
            logged_cap=ddp._get_ddp_logging_data()["bucket_cap_bytes"],
            reducer_caps=ddp.reducer.bucket_caps,
        ))
        tuned.append(ddp)

    tuned = []
    auto = reference.train_ddp(_auto_wrapper(c, clock, c.builtin_hook), c.as_case(bucket_cap_mb="auto", **dict(c.ddp)),
                               rank, world_size, on_step=on_step)
    fixed = reference.train_ddp(reference.ext_ddp, c.as_case(**dict(c.ddp)), rank, world_size)
    torch_ddp = {k: v for k, v in c.ddp if k != "rebuild_buckets"}
    theirs = reference.train_ddp(reference.torch_ddp, c.as_case(**torch_ddp), rank, world_size)
    history = [(e.iteration, e.kind, e.candidate, e.figure) for e in tuned[-1].bucket_tuner.history]
    result = dict(auto=auto, fixed=fixed, torch=theirs, steps=steps, history=history)
    if rank == 0:
        result["local"] = reference.train_local(c.as_case(), world_size, concat=False)
    return result


TABLE = CaseTable(_train_auto, CASES)


def _check_auto_run(c: AutoCase, world_size: int):
    results = (THREE_RANK_TABLE if world_size == 3 else TABLE).results(world_size, c)
    histories = [r["history"] for r in results]
    # Every rank decided the same, at the same iteration, on the same figures.
    assert all(h == histories[0] for h in histories), histories
    expected = [(e.iteration, e.kind, e.candidate, e.figure) for e in expected_tuner(world_size).history]
    assert histories[0] == expected
    assert [k for _, k, _, _ in expected].count("settled") == 2, "the table should settle, drift and settle again"
    for rank, r in enumerate(results):
        layouts = [s["layout"] for s in r["steps"]]
        assert layouts == [s["layout"] for s in results[0]["steps"]], f"rank {rank} laid out other buckets"
        counts = [len(layout) for layout in layouts]
        assert set(counts) == {1, 2, 4, 8}, counts  # every candidate was tried
        for step, s in enumerate(r["steps"]):
            caps = caps_bytes(CANDIDATES[s["candidate"]])
            assert len(s["layout"]) == BUCKETS_OF[s["candidate"]], (step, s)
            assert s["reducer_caps"] == caps and s["bucket_bytes_cap"] == max(caps) == s["logged_cap"], (step, s)
    return results


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_two_ranks_agree_and_change_no_bit(c):
    results = _check_auto_run(c, 2)
    what = c.id
    for rank, r in enumerate(results):
        for name, value in r["auto"]["params"].items():
            assert same_bits(value, r["fixed"]["params"][name]), f"{what}, rank {rank}: {name} differs from fixed caps"
            assert same_bits(value, results[0]["auto"]["params"][name]), f"{what}: {name} differs between ranks"
    assert_states_close(results[0]["auto"]["params"], results[0]["torch"]["params"], f"{what}: vs torch's DDP")
    assert_states_close(results[0]["auto"]["params"], results[0]["local"]["params"], f"{what}: vs local training")


THREE_RANK_CASES = [CASES[0], CASES[5]]
THREE_RANK_TABLE = CaseTable(_train_auto, THREE_RANK_CASES)  # three ranks train only these, not all of CASES


@pytest.mark.parametrize("c", THREE_RANK_CASES, ids=lambda c: c.id)
def test_three_ranks_agree_and_stay_close(c):
    results = _check_auto_run(c, 3)
    for rank, r in enumerate(results):
        for name, value in r["auto"]["params"].items():
            assert same_bits(value, results[0]["auto"]["params"][name]), f"{c.id}: {name} differs between ranks"
        assert_states_close(r["auto"]["params"], r["fixed"]["params"], f"{c.id}, rank {rank}: vs fixed caps")
    assert_states_close(results[0]["auto"]["params"], results[0]["local"]["params"], f"{c.id}: vs local training")


# --- Join, communication hooks ---------------------------------------------------

JOIN_STEPS = {0: 40, 1: 12}  # rank 1 runs out of data and shadows from step 12 on


@dataclasses.dataclass(frozen=True)
class Scenario:
    id: str


def _join(rank, world_size, auto: bool):
    clock = FakeClock()
    spec = models.MODELS["stack_reversed"]
    module = models.build("stack_reversed")
    ddp = reference.ext_ddp(module, bucket_cap_mb="auto" if auto else None)
    if auto:
        ddp._auto_buckets = AutoBuckets(POLICY, clock=clock)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with ddp.join():
        for step in range(JOIN_STEPS[rank]):
            args, target = models.rank_batch("stack_reversed", step, 0, rank, world_size, 4)
            spec.loss(ddp(*args), target).backward()
            clock.now += cost_on(rank, step, len(ddp.bucket_indices()))
            optimizer.step()
            optimizer.zero_grad()
    history = [(e.iteration, e.kind, e.candidate) for e in ddp.bucket_tuner.history] if auto else []
    return dict(params=reference.state_tensors(module)[0], layout=ddp.bucket_indices(), history=history)


def _hook(rank, world_size):
    module = models.build("stack_reversed")
    ddp = reference.ext_ddp(module, bucket_cap_mb="auto")
    ddp._auto_buckets = AutoBuckets(POLICY, clock=FakeClock())
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp.register_comm_hook(ddp.process_group, allreduce_hook)
    counts = []
    clock = ddp._auto_buckets._clock
    for step in range(30):
        args, target = models.rank_batch("stack_reversed", step, 0, rank, world_size, 4)
        models.MODELS["stack_reversed"].loss(ddp(*args), target).backward()
        clock.now += cost_on(rank, step, len(ddp.bucket_indices()))
        counts.append(len(ddp.bucket_indices()))
    return dict(warnings=[str(w.message) for w in caught], counts=counts, phase=ddp.bucket_tuner.stage.value,
                history=[(e.iteration, e.kind) for e in ddp.bucket_tuner.history],
                logged=ddp._get_ddp_logging_data()["bucket_cap_auto"])


def _steps(ddp, rank, world_size, steps, first=0):
    for step in range(first, first + steps):
        args, target = models.rank_batch("stack_reversed", step, 0, rank, world_size, 4)
        models.MODELS["stack_reversed"].loss(ddp(*args), target).backward()
        ddp._auto_buckets._clock.now += cost_on(rank, step, len(ddp.bucket_indices()))


def _copy(rank, world_size):
    """A deep copy keeps the caps in use and tunes again from a warm-up."""
    ddp = reference.ext_ddp(models.build("stack_reversed"), bucket_cap_mb="auto")
    ddp._auto_buckets = AutoBuckets(POLICY, clock=FakeClock())
    _steps(ddp, rank, world_size, 30)
    twin = copy.deepcopy(ddp)
    kept = dict(current=(ddp.bucket_tuner.current, twin.bucket_tuner.current),
                cap=(ddp.bucket_bytes_cap, twin.bucket_bytes_cap),
                first_buckets=len(twin.bucket_indices()),
                twin_phase=twin.bucket_tuner.stage.value)
    before = len(twin.bucket_tuner.history)
    _steps(twin, rank, world_size, 2)  # the copy's first rebuild, at its second forward
    kept["buckets"] = (len(ddp.bucket_indices()), len(twin.bucket_indices()))
    _steps(twin, rank, world_size, 28, first=2)
    return dict(kept, twin_history=[(e.kind, e.candidate) for e in twin.bucket_tuner.history[before:]])


def _eval_on_one_rank(rank, world_size):
    """Rank 1 also runs a forward in eval mode, gradients enabled, every 4
    steps: not a training step, so decisions stay in step."""
    ddp = reference.ext_ddp(models.build("stack_reversed"), bucket_cap_mb="auto")
    ddp._auto_buckets = AutoBuckets(POLICY, clock=FakeClock())
    for step in range(30):
        if rank == 1 and step % 4 == 0:
            ddp.eval()
            ddp(*models.rank_batch("stack_reversed", step, 0, rank, world_size, 4)[0])
            ddp.train()
        _steps(ddp, rank, world_size, 1, first=step)
    return [(e.iteration, e.kind, e.candidate, e.figure) for e in ddp.bucket_tuner.history]


def _scenario(rank, world_size, s: Scenario):
    if s.id == "eval_on_one_rank":
        return _eval_on_one_rank(rank, world_size)
    if s.id == "join":
        return dict(auto=_join(rank, world_size, True), fixed=_join(rank, world_size, False))
    if s.id == "copy":
        return _copy(rank, world_size)
    return _hook(rank, world_size)


SCENARIOS = [Scenario("join"), Scenario("python_hook"), Scenario("copy"), Scenario("eval_on_one_rank")]
SCENARIO_TABLE = CaseTable(_scenario, SCENARIOS)


def test_a_joined_rank_follows_its_peers_decisions():
    results = SCENARIO_TABLE.results(2, SCENARIOS[0])
    auto = [r["auto"] for r in results]
    assert auto[0]["history"] == auto[1]["history"]
    assert any(it > JOIN_STEPS[1] for it, kind, _ in auto[0]["history"] if kind in ("trial", "settled")), \
        f"no decision while rank 1 had joined: {auto[0]['history']}"
    assert auto[0]["layout"] == auto[1]["layout"]
    for rank, r in enumerate(results):
        for name, value in r["auto"]["params"].items():
            assert same_bits(value, r["fixed"]["params"][name]), f"rank {rank}: {name} differs from fixed caps"
            assert same_bits(value, auto[0]["params"][name]), f"{name} differs between ranks"


def test_a_python_hook_freezes_the_caps():
    for rank, r in enumerate(SCENARIO_TABLE.results(2, SCENARIOS[1])):
        assert any("stops tuning" in w and "allreduce_hook" in w for w in r["warnings"]), r["warnings"]
        assert r["phase"] == "frozen" and r["logged"] == "frozen"
        assert r["history"] == [(0, "frozen")]
        assert set(r["counts"]) == {1}, f"rank {rank}: the layout's caps changed after the hook: {r['counts']}"


def test_a_copy_keeps_its_caps_and_tunes_again():
    results = SCENARIO_TABLE.results(2, SCENARIOS[2])
    for r in results:
        assert r["current"][0] == r["current"][1] != 0, r  # settled away from the default by step 30
        # The copy starts from torch's first buckets (one), as a copy of
        # torch's DDP does, and its first rebuild cuts them with the caps kept.
        assert r["first_buckets"] == 1, r
        assert r["cap"][0] == r["cap"][1] and r["buckets"][0] == r["buckets"][1], r
        assert r["twin_phase"] == "warmup"
        assert ("settled", 3) in r["twin_history"] and len(r["twin_history"]) > 2, r["twin_history"]
    assert results[0]["twin_history"] == results[1]["twin_history"]


def test_an_eval_forward_on_one_rank_is_not_a_step():
    histories = SCENARIO_TABLE.results(2, SCENARIOS[3])
    assert histories[0] == histories[1]
    assert ("settled", 3) in [(kind, c) for _, kind, c, _ in histories[0]], histories[0]
