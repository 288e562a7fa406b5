"""Outer gradients in 8 bits, with error feedback across syncs.

The codec is ddp_ext's own (comm_hooks/compression/int8_codec.h): one int8
code per element and one float32 scale per chunk of `chunk` elements, the
scale being the chunk's largest magnitude / 127. What a sync's codes miss is
kept and added to the same fragment's next pseudo-gradient, so over many
syncs the sum sent tracks the sum of the true pseudo-gradients to within one
sync's rounding (half a scale step per element).
"""

from typing import List

import torch

from ddp_ext._native import core as _C


class ErrorFeedback:
    """One fragment's 8-bit encoder: its residual and its chunk size."""

    def __init__(self, numel: int, chunk: int, device: torch.device = torch.device("cpu")):
        self.chunk = chunk
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.payload_bytes = _C.int8_payload_bytes(numel, chunk)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The payload of `values` (1-D float32) plus what earlier payloads
        missed; the residual then holds what this one misses."""
        self.residual.add_(values)
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=self.residual.device)
        _C.encode_int8(self.residual, payload, self.chunk)
        return payload

    def decode_mean(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """The mean of what `payloads` (one per outer rank, in rank order)
        stand for, summed in that order, so every rank gets the same bits."""
        return self.decode_mean_of_part(payloads, self.residual.numel())

    @property
    def split_alignment(self) -> int:
        """Where a payload may be cut: at whole chunks."""
        return self.chunk

    def cut(self, payload: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The payload of elements [start, stop) alone (start a multiple of
        the chunk), from one of all of them: the same bytes as encoding
        those elements alone would give (a chunk's scale and codes are its
        own). Layout: every chunk's float32 scale, then every element's code."""
        chunks = -(-self.residual.numel() // self.chunk)
        first, last = start // self.chunk, -(-stop // self.chunk)
        return torch.cat([payload[4 * first:4 * last], payload[4 * chunks + start:4 * chunks + stop]])

    def decode_mean_of_part(self, payloads: List[torch.Tensor], numel: int) -> torch.Tensor:
        """`decode_mean` of payloads of `numel` elements (cut by `cut`)."""
        out = torch.empty(numel, dtype=torch.float32, device=self.residual.device)
        _C.decode_sum_int8(payloads, out, self.chunk)
        return out.div_(len(payloads))

    def state_dict(self) -> dict:
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.residual.copy_(state["residual"])
