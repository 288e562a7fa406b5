"""A BERT-like transformer encoder (Devlin et al., 2019) with a classification head.

`BertConfig()` with the defaults is BERT-base: 12 layers, hidden size 768, 12
attention heads, feed-forward size 3072, a 30522-token vocabulary; about 110 M
parameters. Post-layer-norm residual blocks and GELU, as in the original.
"""

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass
class BertConfig:
    vocab_size: int = 30522  # tokens in the vocabulary
    hidden: int = 768  # width of every token's representation
    layers: int = 12  # encoder blocks
    heads: int = 12  # attention heads per block (hidden must divide by it)
    ffn: int = 3072  # inner width of each block's feed-forward network
    max_positions: int = 512  # longest sequence the position embedding covers
    num_classes: int = 2  # outputs of the classification head
    dropout: float = 0.1  # dropout probability everywhere BERT applies it


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x):
        batch, seq, hidden = x.shape
        # (batch, seq, 3 * hidden) -> three tensors of (batch, heads, seq, head_dim)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return self.out(context.transpose(1, 2).reshape(batch, seq, hidden))


class EncoderLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = SelfAttention(config)
        self.norm1 = nn.LayerNorm(config.hidden)
        self.ffn = nn.Sequential(
            nn.Linear(config.hidden, config.ffn),
            nn.GELU(),
            nn.Linear(config.ffn, config.hidden),
        )
        self.norm2 = nn.LayerNorm(config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.norm1(x + self.dropout(self.attention(x)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class BertEncoder(nn.Module):
    """Token ids (batch, seq) -> class logits (batch, num_classes), read from the first token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.max_positions, config.hidden)
        self.embedding_norm = nn.LayerNorm(config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.Sequential(*(EncoderLayer(config) for _ in range(config.layers)))
        self.pooler = nn.Sequential(nn.Linear(config.hidden, config.hidden), nn.Tanh())
        self.classifier = nn.Linear(config.hidden, config.num_classes)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        x = self.layers(self.dropout(self.embedding_norm(x)))
        return self.classifier(self.pooler(x[:, 0]))
