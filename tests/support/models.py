"""Small models the multi-process tests train, each with its data and loss.

A ModelSpec bundles what a training loop needs to know about one model:
how to build it (from torch's global seed), the global batch of one
(step, micro-batch) and how each rank slices it, and the loss. Every rank and
every reference builds its data from the same seeds, so the concatenation of
the ranks' slices is exactly the global batch.
"""

import collections
import dataclasses
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    # (global batch size, generator) -> (input tensors, target), batch on dim 0
    data: Callable[[int, torch.Generator], Tuple[Tuple[torch.Tensor, ...], torch.Tensor]]
    # (model output, target) -> scalar loss, mean-reduced over the batch
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    # (rank, step, micro-batch) -> extra non-tensor forward arguments that may
    # differ between ranks (e.g. which branches to take); () when none.
    extra_args: Callable[[int, int, int], Tuple[Any, ...]] = lambda rank, step, micro: ()


def _regression(n_in: int, n_out: int, dtype=torch.float32):
    def data(n, gen):
        x = torch.randn(n, n_in, generator=gen, dtype=dtype)
        y = torch.randn(n, n_out, generator=gen, dtype=dtype)
        return (x,), y

    return data


def _mse(output, target):
    return F.mse_loss(output, target)


# --- Models of issue 2 --------------------------------------------------------


class SkippableNet(nn.Module):
    """Three layers; `skip` (settable later) leaves fc2 out of the forward:
    a parameter without a gradient, for the hang tests."""

    def __init__(self, skip=False):
        super().__init__()
        self.skip = skip
        self.fc0 = nn.Linear(4, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.fc1(torch.tanh(self.fc0(x))))
        return x if self.skip else self.fc2(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class ChannelsLastConvNet(ConvNet):
    """ConvNet whose convolution weights (and so gradients) are channels_last:
    bucket views must follow the parameters' strides."""

    def __init__(self):
        super().__init__()
        self.conv1.to(memory_format=torch.channels_last)
        self.conv2.to(memory_format=torch.channels_last)


class Transposed(nn.Module):
    """A parameter stored transposed (non-contiguous) and a 0-d parameter."""

    def __init__(self):
        super().__init__()
        self.weight_t = nn.Parameter(torch.randn(3, 6).t())  # shape (6, 3), strides (1, 6)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.tanh(x @ self.weight_t) * self.scale)


def _conv_data(n, gen):
    return (torch.randn(n, 2, 8, 8, generator=gen),), torch.randn(n, 3, generator=gen)


class SharedWeight(nn.Module):
    """`second.weight` is `first.weight`: one parameter used by two layers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.first(x))
        x = torch.tanh(self.second(x))
        return self.out(x)


class MixedDtype(nn.Module):
    """float32 layers feeding float64 layers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3).double()

    def forward(self, x):
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x.double()))
        x = torch.tanh(self.c(x.float()))
        return self.d(x.double())


def _inplace_loss(output, target):
    """Modifies the model's output in place before using it, as user code may."""
    output.mul_(0.5)
    return F.mse_loss(output, target)


def _mixed_loss(output, target):
    return F.mse_loss(output, target.double())


class Deep(nn.Module):
    """Dozens of tiny layers: many parameters, many gradients arriving one by one."""

    def __init__(self, depth: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its gradient would be rounding noise, which
        # Adam normalises to steps of full size in random directions.
        self.fc1 = nn.Linear(6, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


# --- Models of issue 3 --------------------------------------------------------

NUM_HEADS = 4


def branch_schedule(rank: int, step: int, micro: int) -> Tuple[int]:
    """The head each rank takes: differs between ranks, steps and micro-batches.
    With 2 or 3 ranks and 4 heads, some head is used by no rank in every step,
    and heads used in one step are unused in the next."""
    return ((rank + 2 * step + micro) % NUM_HEADS,)


class Branches(nn.Module):
    """A trunk, NUM_HEADS heads of which forward takes the ones it is told,
    a frozen layer, and a layer it never uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.heads = nn.ModuleList(nn.Linear(8, 3) for _ in range(NUM_HEADS))
        self.never_used = nn.Linear(8, 3)

    def forward(self, x, heads):
        h = torch.tanh(self.frozen(torch.tanh(self.trunk(x))))
        return sum(self.heads[i](h) for i in heads)


class NeverUsed(nn.Module):
    """An MLP with one layer registered in the middle that forward never calls."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.unused = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Checkpointed(nn.Module):
    """The middle layer runs under activation checkpointing."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.fc0 = nn.Linear(6, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.fc0(x))
        x = checkpoint(self._middle, x, use_reentrant=self.use_reentrant)
        return self.fc2(x)

    def _middle(self, x):
        return torch.tanh(self.fc1(x))


Pair = collections.namedtuple("Pair", ["main", "aux"])


@dataclasses.dataclass
class Outputs:
    main: torch.Tensor
    aux: List[torch.Tensor]


class MultiOutput(nn.Module):
    """Returns its main output together with auxiliary ones that the loss
    ignores, nested in a container of kind `kind`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.trunk = nn.Linear(6, 8)
        self.main = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)  # reached only from ignored outputs

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        main, aux = self.main(h), self.aux(h)
        if self.kind == "dict":
            return {"main": main, "extra": {"aux": aux, "h": h}}
        if self.kind == "namedtuple":
            return Pair(main, aux)
        if self.kind == "dataclass":
            return Outputs(main, [aux, h])
        raise ValueError(self.kind)


def _main_output(output):
    if isinstance(output, dict):
        return output["main"]
    return output.main


def _multi_output_loss(output, target):
    return F.mse_loss(_main_output(output), target)


# --- Models of gradient order prediction --------------------------------------

STACK_BLOCKS = 8
# Steps per phase of the models whose order (or branch) switches.
SWITCH_EVERY = 5
FORWARD = tuple(range(STACK_BLOCKS))
BACKWARD = tuple(reversed(FORWARD))


class Stack(nn.Module):
    """STACK_BLOCKS equal layers, applied in the order forward is given: with
    FORWARD, gradients arrive in reverse registration order (the
    construction guess); with BACKWARD, in registration order."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(STACK_BLOCKS))

    def forward(self, x, order):
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x


def phase(step: int, every: int = SWITCH_EVERY) -> int:
    """0 or 1, switching every `every` steps."""
    return (step // every) % 2


class SwitchingBranches(nn.Module):
    """A trunk and two branches of three layers; forward takes the branch it
    is told, so the other one gets no gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(2)
        )

    def forward(self, x, branch):
        return self.branches[branch](torch.tanh(self.trunk(x)))


LAYERDROP_SEED = 4242
LAYERDROP_BLOCKS = 5


class Dropping(nn.Module):
    """An input layer, LAYERDROP_BLOCKS blocks in a ddp_ext.LayerDrop with
    p=0.5 and a fixed seed, and an output layer. tied=True also ties block
    2's first weight to a layer outside the LayerDrop that runs every step,
    so that weight is never dropped while its bias is."""

    def __init__(self, tied: bool = False):
        super().__init__()
        import ddp_ext

        self.inp = nn.Linear(6, 8)
        self.blocks = ddp_ext.LayerDrop(
            [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(LAYERDROP_BLOCKS)],
            p=0.5,
            seed=LAYERDROP_SEED,
        )
        self.out = nn.Linear(8, 3)
        self.side = None
        if tied:
            self.side = nn.Linear(8, 8, bias=False)
            self.side.weight = self.blocks[2][0].weight

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.side is not None:
            h = h + self.side(h)
        return self.out(self.blocks(h))


MODELS: Dict[str, ModelSpec] = {
    "mlp": ModelSpec(MLP, _regression(6, 3), _mse),
    "conv": ModelSpec(ConvNet, _conv_data, _mse),
    "conv_channels_last": ModelSpec(ChannelsLastConvNet, _conv_data, _mse),
    "transposed": ModelSpec(Transposed, _regression(6, 3), _mse),
    "shared_weight": ModelSpec(SharedWeight, _regression(6, 3), _mse),
    "mixed_dtype": ModelSpec(MixedDtype, _regression(6, 3), _mixed_loss),
    "deep": ModelSpec(Deep, _regression(4, 4), _mse),
    "batchnorm": ModelSpec(BatchNormNet, _regression(6, 3), _mse),
    "mlp_inplace_loss": ModelSpec(MLP, _regression(6, 3), _inplace_loss),
    "branches": ModelSpec(Branches, _regression(6, 3), _mse, extra_args=lambda r, s, m: (branch_schedule(r, s, m),)),
    "never_used": ModelSpec(NeverUsed, _regression(6, 3), _mse),
    "outputs_dict": ModelSpec(lambda: MultiOutput("dict"), _regression(6, 3), _multi_output_loss),
    "outputs_namedtuple": ModelSpec(lambda: MultiOutput("namedtuple"), _regression(6, 3), _multi_output_loss),
    "outputs_dataclass": ModelSpec(lambda: MultiOutput("dataclass"), _regression(6, 3), _multi_output_loss),
    "checkpoint_reentrant": ModelSpec(lambda: Checkpointed(True), _regression(6, 3), _mse),
    "checkpoint_nonreentrant": ModelSpec(lambda: Checkpointed(False), _regression(6, 3), _mse),
    # Registration order the reverse of use.
    "stack_reversed": ModelSpec(Stack, _regression(8, 8), _mse, extra_args=lambda r, s, m: (BACKWARD,)),
    # Order of use reversed every SWITCH_EVERY steps.
    "stack_switching": ModelSpec(
        Stack, _regression(8, 8), _mse, extra_args=lambda r, s, m: ((FORWARD, BACKWARD)[phase(s)],)
    ),
    # Order of use reversed every step.
    "stack_alternating": ModelSpec(
        Stack, _regression(8, 8), _mse, extra_args=lambda r, s, m: ((FORWARD, BACKWARD)[phase(s, 1)],)
    ),
    # Rank 0 uses the layers in reverse, the others in registration order.
    "stack_per_rank": ModelSpec(
        Stack, _regression(8, 8), _mse, extra_args=lambda r, s, m: (BACKWARD if r == 0 else FORWARD,)
    ),
    # The branch used switches every SWITCH_EVERY steps.
    "branches_switching": ModelSpec(SwitchingBranches, _regression(6, 3), _mse, extra_args=lambda r, s, m: (phase(s),)),
    "layerdrop": ModelSpec(Dropping, _regression(6, 3), _mse),
    "layerdrop_tied": ModelSpec(lambda: Dropping(tied=True), _regression(6, 3), _mse),
}

MODEL_SEED = 1234
DATA_SEED = 777


def build(name: str, seed: int = MODEL_SEED) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name].build()


def global_batch(name: str, step: int, micro: int, size: int):
    """The global batch of (step, micro-batch): (input tensors, target)."""
    gen = torch.Generator().manual_seed(DATA_SEED + 1000 * step + micro)
    return MODELS[name].data(size, gen)


def rank_batch(name: str, step: int, micro: int, rank: int, world_size: int, per_rank: int):
    """Rank `rank`'s slice of the global batch, with its extra forward arguments."""
    inputs, target = global_batch(name, step, micro, per_rank * world_size)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    args = tuple(t[rows] for t in inputs) + tuple(MODELS[name].extra_args(rank, step, micro))
    return args, target[rows]
