"""A small character-level transformer (GPT-like, pre-norm, causal): the
`diloco` experiment's language model."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class CharModelShape:
    vocab: int = 256
    width: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 64


class _Block(nn.Module):
    def __init__(self, shape: CharModelShape):
        super().__init__()
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)
        self.norm2 = nn.LayerNorm(shape.width)
        self.mlp = nn.Sequential(nn.Linear(shape.width, 4 * shape.width), nn.GELU(),
                                 nn.Linear(4 * shape.width, shape.width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    def __init__(self, shape: CharModelShape = CharModelShape()):
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.position = nn.Parameter(torch.zeros(shape.context, shape.width))
        self.blocks = nn.Sequential(*[_Block(shape) for _ in range(shape.layers)])
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per character, in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def held_out_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, chunk: int = 64) -> float:
    """`loss` over a fixed evaluation set, in chunks of `chunk` sequences."""
    total = 0.0
    for start in range(0, inputs.shape[0], chunk):
        x, y = inputs[start:start + chunk], targets[start:start + chunk]
        total += loss(model(x), y).item() * x.shape[0]
    return total / inputs.shape[0]
