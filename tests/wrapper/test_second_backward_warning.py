"""A second backward over a forward whose gradients were already averaged
leaves its gradients on each rank alone, as torch's DDP does; ddp_ext says
so once per rank with a LocalGradientWarning naming the parameters (Note
[Late gradients] in reducer/core/late_gradients.h), and stays silent where
nothing is lost: a normal loop, no_sync accumulation, find_unused_parameters,
and a backward through the wrapped module called directly (torch's own
tests accumulate that way on purpose). Made an error by a warnings filter,
it raises before the forward changes anything, and training goes on in
step. 2 ranks over Gloo, every result checked against torch's DDP doing the
same."""

import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.spawn import run_ranks

OursDDP = ddp_ext.DistributedDataParallel
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _model(kind):
    torch.manual_seed(0)
    if kind == "unused":
        return _WithUnused()
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(wrapper, rank, pattern, kind="plain", steps=4, **kwargs):
    """`steps` iterations of `pattern` with `wrapper`, then one more forward:
    the parameters at the end, and (step, message) of each
    LocalGradientWarning caught (the last forward counts as step `steps`)."""
    model = _model(kind)
    ddp = wrapper(model, **kwargs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    batches = [torch.randn(6, 4) + rank for _ in range(steps + 1)]
    caught = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step, x in enumerate(batches):
            before = len(seen)
            if step == steps:
                ddp(x)  # the forward after the last step checks too
            elif pattern == "second_backward" or (pattern == "as_error" and step == 0):
                loss = ddp(x).pow(2).mean()
                loss.backward(retain_graph=True)
                loss.backward()
            elif pattern == "as_error":
                if step == 1:
                    # The warning made an error raises before the forward
                    # changes anything: the ranks go on in step.
                    with warnings.catch_warnings():
                        warnings.simplefilter("error", ddp_ext.LocalGradientWarning)
                        try:
                            ddp(x)
                        except ddp_ext.LocalGradientWarning:
                            caught.append((step, "raised"))
                ddp(x).pow(2).mean().backward()
            elif pattern == "normal":
                ddp(x).pow(2).mean().backward()
            elif pattern == "no_sync":
                with ddp.no_sync():
                    ddp(x).pow(2).mean().backward()
                    loss = ddp(x * 2).pow(2).mean()
                    loss.backward(retain_graph=True)
                    loss.backward()  # local on purpose, inside no_sync
                ddp(x * 3).pow(2).mean().backward()
            elif pattern == "through_module":
                # torch's test_accumulate_gradients_module: every other step
                # runs the wrapped module directly, outside the wrapper.
                (ddp.module if step % 2 == 0 else ddp)(x).pow(2).mean().backward()
            if step < steps:
                optimizer.step()
                optimizer.zero_grad()
            caught += [(step, str(w.message)) for w in seen[before:]
                       if issubclass(w.category, ddp_ext.LocalGradientWarning)]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, caught


def _scenarios(rank, world_size):
    out = {}
    for pattern, kind, kwargs in (
        ("second_backward", "plain", {}),
        ("second_backward", "unused", {"find_unused_parameters": True}),
        ("normal", "plain", {}),
        ("normal", "unused", {"find_unused_parameters": True}),
        ("no_sync", "plain", {}),
        ("through_module", "plain", {}),
        ("as_error", "plain", {}),
    ):
        key = (pattern, kind)
        out[key] = {
            "ddp_ext": _train(OursDDP, rank, pattern, kind, **kwargs),
            "torch": _train(TorchDDP, rank, pattern, kind, **kwargs),
        }
    return out


def test_second_backward_warns_on_each_rank_and_nothing_else_does():
    ranks = run_ranks(_scenarios, 2)
    for rank, results in enumerate(ranks):
        for (pattern, kind), both in results.items():
            params, caught = both["ddp_ext"]
            expected, torch_caught = both["torch"]
            where = f"rank {rank}, {pattern} ({kind})"
            assert torch_caught == [], where
            # The same training as torch's DDP: the second backward stays local there too.
            for name in expected:
                torch.testing.assert_close(params[name], expected[name], msg=lambda m: f"{where}, {name}: {m}")
            if pattern == "as_error":
                assert caught == [(1, "raised")], f"{where}: {caught}"
                continue
            if pattern != "second_backward":
                assert caught == [], f"{where}: {caught}"
                continue
            # Once, at the forward after the first double backward.
            assert [step for step, _ in caught] == [1], f"{where}: {caught}"
            message = caught[0][1]
            assert f"rank {rank}:" in message, message
            names = NAMES if kind == "plain" else ["used.weight", "used.bias"]
            for name in names:
                assert name in message, (name, message)
            assert "unused.weight" not in message and "unused.bias" not in message, message
            assert "not averaged" in message and "no_sync()" in message and "sum the losses" in message, message
    # The second backward's gradients were local: the ranks diverged, as with torch's DDP.
    for key in ranks[0]:
        a, b = ranks[0][key]["ddp_ext"][0], ranks[1][key]["ddp_ext"][0]
        same = all(torch.equal(a[n], b[n]) for n in a)
        if key[0] in ("second_backward", "through_module", "as_error"):
            assert not same, f"{key}: the ranks should have diverged"
        else:
            assert same, f"{key}: the ranks should agree"
