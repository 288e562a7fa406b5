"""Errors that explain (issue 3).

Multi-process: each error is triggered on every rank, within a time limit,
and its message checked on every rank: the key phrase users of torch's DDP
search for, the parameters by name, and what to do. Single-process: invalid
constructor arguments raise ValueError or TypeError naming the argument.
"""

import dataclasses
import datetime
import warnings
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.support import reference
from tests.support.harness import CaseTable

# --- Multi-process ----------------------------------------------------------------


class _Skips(nn.Module):
    """Three layers; forward skips the ones named in `skip`."""

    def __init__(self, skip=("fc2",)):
        super().__init__()
        self.skip = set(skip)
        self.fc0 = nn.Linear(4, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        for name in ("fc0", "fc1", "fc2"):
            if name not in self.skip:
                x = torch.tanh(getattr(self, name)(x))
        return x


class _IgnoredOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return h, self.aux(h)


class _Checkpointed(nn.Module):
    """fc1 runs inside activation checkpointing."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.fc0 = nn.Linear(4, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.fc0(x))
        x = checkpoint(lambda t: torch.tanh(self.fc1(t)), x, use_reentrant=self.use_reentrant)
        return self.fc2(x)


def _loss(output):
    return (output[0] if isinstance(output, tuple) else output).pow(2).mean()


def _two_iterations(module, **ddp_kwargs):
    """Forward and backward, then the next forward: where an unfinished
    reduction is reported."""
    torch.manual_seed(0)
    ddp = reference.ext_ddp(module, **ddp_kwargs)
    x = torch.randn(3, 4)
    _loss(ddp(x)).backward()
    _loss(ddp(x)).backward()


def _regularised_two_iterations(module, **ddp_kwargs):
    """The loss also uses fc2.weight directly, outside the forward."""
    ddp = reference.ext_ddp(module, **ddp_kwargs)
    x = torch.randn(3, 4)
    for _ in range(2):
        (_loss(ddp(x)) + module.fc2.weight.pow(2).sum()).backward()


def _forward_without_backward(module, **ddp_kwargs):
    """Legal: a forward whose output is dropped, then a normal iteration."""
    ddp = reference.ext_ddp(module, **ddp_kwargs)
    x = torch.randn(3, 4)
    ddp(x)
    _loss(ddp(x)).backward()
    _loss(ddp(x)).backward()


def _construct(module, **ddp_kwargs):
    reference.ext_ddp(module, **ddp_kwargs)


def _two_iterations_short_timeout(module, **ddp_kwargs):
    """_two_iterations on a process group with a short timeout (which the
    ranks that wait would otherwise reach, see docs/DIAGNOSIS.md) and a
    shorter hang_timeout_s: those ranks name the rank that skipped."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    _two_iterations(module, process_group=group, hang_timeout_s=2, **ddp_kwargs)


class _SkipsOnLastRank(_Skips):
    """Skips fc2 on the last rank only."""

    def __init__(self):
        last = dist.get_rank() == dist.get_world_size() - 1
        super().__init__(("fc2",) if last else ())


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    id: str
    # None: no error expected. Otherwise the exception type's name.
    raises: Optional[str]
    # Substrings the message must hold, each on every rank.
    says: Tuple[str, ...] = ()
    # Substrings it must not hold (parameters that did get their gradient).
    not_says: Tuple[str, ...] = ()


ADVICE_FIND_UNUSED = "find_unused_parameters=True"
NOT_FINISHED = "Expected to have finished reduction in the prior iteration"
TWICE = "Expected to mark a variable ready only once"

# id -> (trigger(module, **ddp_kwargs), module factory, DDP keyword arguments)
TRIGGERS = {
    "unused_last_layer": (_two_iterations, lambda: _Skips(("fc2",)), {}),
    "unused_first_layer_tiny_buckets": (_two_iterations, lambda: _Skips(("fc0",)), dict(bucket_cap_mb=1e-9)),
    "unused_two_layers": (_two_iterations, lambda: _Skips(("fc0", "fc2")), {}),
    "ignored_output": (_two_iterations, _IgnoredOutput, {}),
    "reentrant_checkpoint_find_unused": (
        _two_iterations,
        lambda: _Checkpointed(use_reentrant=True),
        dict(find_unused_parameters=True),
    ),
    "parameter_used_outside_forward_find_unused": (
        _regularised_two_iterations,
        lambda: _Skips(("fc2",)),
        dict(find_unused_parameters=True),
    ),
    "no_parameter_requires_grad": (_construct, lambda: nn.Linear(4, 4).requires_grad_(False), {}),
    "no_parameters": (_construct, nn.ReLU, {}),
    # Not errors: these must run through.
    "forward_without_backward": (_forward_without_backward, lambda: _Skips(()), {}),
    "reentrant_checkpoint": (_two_iterations, lambda: _Checkpointed(use_reentrant=True), {}),
    "nonreentrant_checkpoint_find_unused": (
        _two_iterations,
        lambda: _Checkpointed(use_reentrant=False),
        dict(find_unused_parameters=True),
    ),
    "unused_on_one_rank": (_two_iterations_short_timeout, _SkipsOnLastRank, {}),
}

CASES = [
    ErrorCase(
        "unused_last_layer",
        "RuntimeError",
        (NOT_FINISHED, "fc2.weight", "fc2.bias", ADVICE_FIND_UNUSED, "rank"),
        ("fc0.", "fc1."),
    ),
    ErrorCase(
        "unused_first_layer_tiny_buckets",
        "RuntimeError",
        (NOT_FINISHED, "fc0.weight", "fc0.bias", ADVICE_FIND_UNUSED),
        ("fc1.", "fc2."),
    ),
    ErrorCase(
        "unused_two_layers",
        "RuntimeError",
        (NOT_FINISHED, "fc0.weight", "fc0.bias", "fc2.weight", "fc2.bias", ADVICE_FIND_UNUSED),
        ("fc1.",),
    ),
    ErrorCase("ignored_output", "RuntimeError", (NOT_FINISHED, "aux.weight", "aux.bias", ADVICE_FIND_UNUSED), ("fc.",)),
    ErrorCase("reentrant_checkpoint_find_unused", "RuntimeError", (TWICE, "fc1.", "use_reentrant=False")),
    ErrorCase(
        "parameter_used_outside_forward_find_unused",
        "RuntimeError",
        (TWICE, "fc2.weight", "forward"),
        ("fc0.", "fc1.", "fc2.bias"),
    ),
    ErrorCase("no_parameter_requires_grad", "RuntimeError", ("parameter that requires a gradient",)),
    ErrorCase("no_parameters", "RuntimeError", ("parameter that requires a gradient",)),
    ErrorCase("forward_without_backward", None),
    ErrorCase("reentrant_checkpoint", None),
    ErrorCase("nonreentrant_checkpoint_find_unused", None),
    # Last: on failure its ranks fall out of step.
    ErrorCase(
        "unused_on_one_rank",
        "RuntimeError",
        (NOT_FINISHED, "fc2.weight", "fc2.bias", ADVICE_FIND_UNUSED),
        ("fc0.", "fc1."),
    ),
]
def _trigger(rank, world_size, c):
    trigger, factory, kwargs = TRIGGERS[c.id]
    torch.manual_seed(0)
    try:
        trigger(factory(), **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


TABLE = CaseTable(_trigger, CASES, timeout=90, isolated=True)  # process groups time out on purpose


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "c",
    CASES,
    ids=lambda c: c.id,
)
def test_error_on_every_rank(c, world_size):
    for rank, raised in enumerate(TABLE.results(world_size, c)):
        if c.raises is None:
            assert raised is None, f"rank {rank}: unexpected {raised[0]}: {raised[1]}"
            continue
        assert raised is not None, f"rank {rank} of {world_size}: no error raised"
        kind, message = raised
        assert kind == c.raises, f"rank {rank}: {kind}: {message}"
        missing = [s for s in c.says if s not in message]
        assert not missing, f"rank {rank}: message lacks {missing}:\n{message}"
        wrong = [s for s in c.not_says if s in message]
        assert not wrong, f"rank {rank}: message names {wrong}, which did get gradients:\n{message}"
        if "rank" in c.says:
            assert f"rank {rank}" in message.lower(), f"rank {rank}: message does not say which rank:\n{message}"


# --- Single process: argument checks ------------------------------------------


# (id, constructor keyword arguments, exception type, argument the message must name)
BAD_ARGUMENTS = [
    ("bucket_cap_mb_nan", dict(bucket_cap_mb=float("nan")), ValueError, "bucket_cap_mb"),
    ("bucket_cap_mb_inf", dict(bucket_cap_mb=float("inf")), ValueError, "bucket_cap_mb"),
    ("bucket_cap_mb_str", dict(bucket_cap_mb="25"), (ValueError, TypeError), "bucket_cap_mb"),
    ("bucket_cap_mb_list_str", dict(bucket_cap_mb_list=[1, "2"]), (ValueError, TypeError), "bucket_cap_mb_list"),
    ("device_ids_cpu_module", dict(device_ids=[0]), ValueError, "device_ids"),
    ("output_device_cpu_module", dict(output_device=0), ValueError, "output_device"),
    ("process_group_object", dict(process_group=object()), TypeError, "process_group"),
    ("process_group_str", dict(process_group="gloo"), TypeError, "process_group"),
]


@pytest.mark.parametrize(
    "kwargs, error, argument", [row[1:] for row in BAD_ARGUMENTS], ids=[row[0] for row in BAD_ARGUMENTS]
)
def test_invalid_argument_names_it(single_process_group, kwargs, error, argument):
    with pytest.raises(error, match=argument):
        reference.ext_ddp(nn.Linear(2, 2), **kwargs)


def test_module_must_be_a_module(single_process_group):
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        reference.ext_ddp(lambda x: x)


@pytest.mark.parametrize("cap, warns", [(0, False), (-1.0, True), (True, True)], ids=["zero", "negative", "bool"])
def test_odd_bucket_caps_torch_accepts_are_accepted(single_process_group, cap, warns):
    """As torch's DDP: accepted; 0 and negatives mean a bucket per parameter,
    a bool is read as MiB; the nonsense ones warn."""
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = reference.ext_ddp(module, bucket_cap_mb=cap)
    assert any("bucket_cap_mb" in str(w.message) for w in caught) == warns
    assert ddp.bucket_indices() == [[0, 1, 2, 3]]  # torch's first buckets: one, whatever the cap
    ddp(torch.randn(1, 2)).sum().backward()
    ddp(torch.randn(1, 2)).sum().backward()  # its forward rebuilt the buckets with the cap
    expected = [[3, 2, 1, 0]] if cap is True else [[3], [2], [1], [0]]
    assert ddp.bucket_indices() == expected


def test_valid_arguments_construct(single_process_group):
    """The checks above reject only what they should: valid arguments build a
    wrapper that keeps them and trains (a world of one: the local gradients)."""
    for kwargs, cap_mb in ((dict(), 25), (dict(bucket_cap_mb=1e-3), 1e-3), (dict(bucket_cap_mb=100), 100),
                           (dict(process_group=single_process_group), 25)):
        module, x = nn.Linear(2, 2), torch.randn(1, 2)
        expected = torch.autograd.grad(module(x).sum(), list(module.parameters()))
        ddp = reference.ext_ddp(module, **kwargs)
        ddp(x).sum().backward()
        assert ddp.bucket_bytes_cap == int(cap_mb * 1024 * 1024), kwargs
        assert ddp.process_group is single_process_group, kwargs
        for p, g in zip(module.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_no_default_group_says_so():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        reference.ext_ddp(nn.Linear(2, 2))
