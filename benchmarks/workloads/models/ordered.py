"""Models whose forward uses their layers in an order other than the one they
were registered in, for the `order` experiment (gradient order prediction).

All are stacks of equal Linear layers (WIDTH x WIDTH, about 1 MiB of float32
gradients each) whose last layer's WIDTH outputs are the class scores (no
separate head, so that every bucket holds whole layers); they differ only in
how registration and use disagree.
"""

import torch
from torch import nn

WIDTH = 512
DEPTH = 24
CLASSES = WIDTH  # the last layer's outputs


def layer_bytes(width: int = WIDTH) -> int:
    """Gradient bytes of one layer (float32 weight and bias)."""
    return (width * width + width) * 4


class ReversedStack(nn.Module):
    """Layers registered in the reverse of the order forward uses them (a
    decoder built by reversing an encoder's list of layers)."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


class GroupedBlocks(nn.Module):
    """Residual blocks whose two halves live in two lists, as transformers
    that keep their attention and feed-forward modules apart: registered
    all mixing layers first, used alternately."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.mixing = nn.ModuleList(nn.Linear(width, width) for _ in range(depth // 2))
        self.feed_forward = nn.ModuleList(nn.Linear(width, width) for _ in range(depth // 2))

    def forward(self, x):
        for mixing, feed_forward in zip(self.mixing, self.feed_forward):
            x = x + torch.tanh(mixing(x))
            x = x + torch.tanh(feed_forward(x))
        return x


class SwitchingStack(nn.Module):
    """Two stages of layers that forward runs in registration order until
    `swapped` is set, then second stage first: the order gradients arrive in
    changes in the middle of training (a curriculum that reorders stages)."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(depth // 2))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(depth // 2))
        self.swapped = False

    def forward(self, x):
        stages = (self.second, self.first) if self.swapped else (self.first, self.second)
        for stage in stages:
            for layer in stage:
                x = torch.tanh(layer(x))
        return x


ORDERED_MODELS = {"reversed": ReversedStack, "grouped": GroupedBlocks, "switching": SwitchingStack}
