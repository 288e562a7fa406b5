"""Bad constructor input, on every rank of 2- and 3-rank worlds, beside torch's DDP.

Each row of tests/support/bad_arguments.py gives every rank a module and constructor
arguments; the ranks wrap it with ddp_ext's DistributedDataParallel, then
with torch's, and record what each did: the exception, or the parameters
after STEPS steps of SGD. ddp_ext must either raise on every rank, the
message naming the argument (and holding torch's key phrase where torch has
one), or train exactly like local training (up to float rounding). torch's
DDP must do what the row says it does (docs/RELIABILITY.md lists both).
pytest -s prints every rank's outcome and each constructor's time to error.

Models that differ across ranks: ddp_ext raises on every rank (the table);
torch's DDP, which may raise on some ranks only, kill a rank (SIGABRT) or
carry on with misplaced values, runs each in a world of its own
(test_torch_with_models_that_differ).

Extends tests/diagnosis/test_errors.py (single-process argument checks, unused
parameters) and tests/diagnosis/test_model_check.py (parameters that differ across
ranks, ddp_ext only).
"""

import resource
import signal
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from benchmarks.workloads.fault_worlds import run_world
from tests.support import bad_arguments as rows
from tests.support import reference
from tests.support.harness import CaseTable

STEPS = 3
PER_RANK = 2
WRAPPERS = {"ddp_ext": reference.ext_ddp, "torch": reference.torch_ddp}


def _batch(step, size):
    return torch.randn(size, rows.IN_FEATURES, generator=torch.Generator().manual_seed(step))


def train(model, module, world_size, rank=None):
    """STEPS steps of SGD on the global batch of `world_size` ranks: its slice
    of rank `rank`, or all of it (rank None: local training, whose mean loss
    over the global batch averages the ranks' mean losses)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(STEPS):
        x = _batch(step, PER_RANK * world_size)
        if rank is not None:
            x = x[rank * PER_RANK:(rank + 1) * PER_RANK]
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _try(row, wrapper, rank, world_size):
    make_module, make_kwargs = rows.BUILD[row.id]
    module = make_module(rank, world_size)
    kwargs = make_kwargs(rank, world_size, module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations, odd bucket caps
        dist.barrier()  # times the constructor, not waiting for a slower rank
        started = time.perf_counter()
        try:
            ddp = wrapper(module, **kwargs)
        except Exception as e:  # noqa: BLE001 - recording whatever each raises
            return {"raised": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - started}
        group = ddp.process_group
        return {"raised": None, "params": train(ddp, module, group.size(), group.rank())}


def _run_row(rank, world_size, row):
    return {name: _try(row, WRAPPERS[name], rank, world_size) for name in ("ddp_ext", "torch")
            if name == "ddp_ext" or row.torch is not None}


TABLE = CaseTable(_run_row, rows.ROWS, timeout=180, isolated=True)


def _local(row, world_size):
    module = rows.BUILD[row.id][0](0, world_size)
    return train(module, module, world_size)


def _describe(outcome) -> str:
    if outcome["raised"] is None:
        return "no error"
    return f"{outcome['raised']} after {outcome['seconds'] * 1e3:.1f} ms: {outcome['message'].splitlines()[0][:160]}"


def _check_trained(outcome, expected, what):
    assert outcome["raised"] is None, f"{what}: raised {outcome['raised']}: {outcome['message']}"
    assert sorted(outcome["params"]) == sorted(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(outcome["params"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}: `{name}` differs from local training:\n{m}")


def _check(outcome, expect, row, rank, world_size, who):
    what = f"{row.id}, {who}, rank {rank} of {world_size}"
    if expect == rows.ALONE:
        expect = rows.TRAINS if rank == 0 else rows.RAISES
        world_size = 1 if rank == 0 else world_size
    if expect == rows.TRAINS:
        _check_trained(outcome, _local(row, world_size), what)
        return
    assert outcome["raised"] is not None, f"{what}: constructed, but should have raised"
    if who == "ddp_ext":
        kind, message = outcome["raised"], outcome["message"]
        assert kind == row.error, f"{what}: {kind}: {message}"
        missing = [s for s in row.says + ((row.phrase,) if row.phrase else ()) if s not in message]
        assert not missing, f"{what}: message lacks {missing}:\n{message}"
    elif row.phrase:
        assert row.phrase in outcome["message"], f"{what}: torch's phrase changed: {outcome['message']}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("row", rows.ROWS, ids=lambda r: r.id)
def test_bad_input(row, world_size):
    per_rank = TABLE.results(world_size, row)
    for rank, outcomes in enumerate(per_rank):
        print(f"{row.id}, rank {rank} of {world_size}: "
              + "; ".join(f"{name}: {_describe(o)}" for name, o in outcomes.items()))
        _check(outcomes["ddp_ext"], row.ours, row, rank, world_size, "ddp_ext")
        if row.torch is not None:
            _check(outcomes["torch"], row.torch, row, rank, world_size, "torch's DDP")
    if row.ours == rows.RAISES:
        messages = {o["ddp_ext"]["message"] for o in per_rank}
        assert len(messages) == 1, f"ranks raised different errors: {messages}"


# --- torch's DDP on models that differ across ranks, a world each ---------------


def _torch_construct(rank, world_size, row_id):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a rank may abort
    module = rows.DIFFERING[row_id](rank, world_size)
    started = time.perf_counter()
    try:
        reference.torch_ddp(module)
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - started}
    return {"raised": None, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


# row -> what torch's DDP does, 2 ranks
TORCH_DIFFERING = {
    "parameter_count_differs": "raises on every rank",
    "parameter_shape_differs": "raises on the differing rank only",
    "parameter_dtype_differs": "aborts a rank",
    "frozen_parameter_shape_differs": "misplaces parameters",
    "buffer_shape_differs": "constructs",
    "buffer_count_differs": "constructs",
    "rank0_has_more_buffers": "aborts a rank",
    "buffer_dtype_differs": "aborts a rank",
}


@pytest.mark.parametrize("row_id", sorted(TORCH_DIFFERING))
def test_torch_with_models_that_differ(row_id):
    outcomes = run_world(_torch_construct, 2, row_id, pg_timeout_s=10.0, deadline_s=40.0)
    summary = [(o.rank, o.exitcode, o.value and _describe(o.value)) for o in outcomes]
    print(row_id, summary)
    assert not any(o.hung for o in outcomes), summary
    behaviour = TORCH_DIFFERING[row_id]
    if behaviour == "aborts a rank":
        assert any(o.exitcode == -signal.SIGABRT for o in outcomes), summary
        return
    assert all(o.exitcode == 0 and o.returned for o in outcomes), summary
    first, last = outcomes[0].value, outcomes[-1].value
    if behaviour == "raises on every rank":
        assert all(rows.SAME_MODEL in o.value["message"] for o in outcomes), summary
    elif behaviour == "raises on the differing rank only":
        assert "appears not to match sizes" in last["message"], summary
        # Rank 0 passed the check; its broadcast failed once the other rank exited.
        assert first["raised"] is not None and "appears not to match" not in first["message"], summary
    else:
        assert first["raised"] is None and last["raised"] is None, summary
        misplaced = [n for n, value in first["params"].items()
                     if n != "frozen" and not torch.equal(value, last["params"][n])]
        assert bool(misplaced) == (behaviour == "misplaces parameters"), (misplaced, summary)
