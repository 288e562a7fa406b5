"""Outer gradients in 4 bits, with error feedback across syncs.

One 4-bit code per element, two a byte (the element of even index in the
low half), and one float32 scale per chunk of `chunk` elements, the
chunk's largest magnitude / 7: codes are -7 .. 7, stored plus 8. As in 8
bits (int8.py), what a sync's codes miss is kept and added to the same
fragment's next pseudo-gradient, so the sum sent tracks the sum of the true
pseudo-gradients to within one sync's rounding (half a scale step per
element). Plain torch operations: the same bits on every rank for the same
payloads in the same order.

# Note [DiLoCo's 4-bit encoder works in place]

Encoding takes a dozen passes over the fragment. Done with a fresh tensor
each (a fragment's worth, allocated from the system and faulted in page by
page at every sync), it took 2 to 16 ms for half a million elements on a
loaded core, where the 8-bit codec's native encoder takes 0.3: time a sync
with no delay blocks training for. So the encoder keeps two buffers of its
own (the residual padded to whole chunks, 4 bytes an element; one code a
byte) and works in them in place. The arithmetic is the plain formula's,
operation for operation (divide, round, clamp, zero where the scale is zero,
multiply back, subtract), so the payload and the residual keep their bits;
its two changes are exact: the largest magnitude is the larger of the
largest value and minus the smallest, and each code becomes a byte before
8 is added. The unit tests compare both with the plain formula's.
"""

from typing import List

import torch

LEVELS = 7
# Below this a chunk's largest magnitude is sent as zero (kept in the
# residual): dividing by a scale that is no normal float overflows.
SMALLEST = 1e-30


class Int4ErrorFeedback:
    """One fragment's 4-bit encoder: its residual and its chunk size."""

    def __init__(self, numel: int, chunk: int, device: torch.device = torch.device("cpu")):
        self.chunk = chunk
        self.numel = numel
        self.chunks = -(-numel // chunk)
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.payload_bytes = 4 * self.chunks + (numel + 1) // 2
        # Scratch (Note [DiLoCo's 4-bit encoder works in place]): the residual
        # in whole chunks, and one code a byte, an odd count's last padded with 8.
        self._work = torch.zeros(self.chunks, chunk, dtype=torch.float32, device=device)
        self._nibbles = torch.full((2 * ((numel + 1) // 2),), 8, dtype=torch.uint8, device=device)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The payload of `values` (1-D float32) plus what earlier payloads
        missed; the residual then holds what this one misses. Works in
        buffers of its own (Note [DiLoCo's 4-bit encoder works in place])."""
        self.residual.add_(values)
        work, n = self._work, self.numel
        flat = work.view(-1)
        flat[:n].copy_(self.residual)
        flat[n:].zero_()
        # The largest magnitude, exactly: the larger of the largest value and minus the smallest.
        largest = torch.maximum(work.amax(dim=1), work.amin(dim=1).neg_())
        scales = torch.where(largest > SMALLEST, largest / LEVELS, torch.zeros_like(largest))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = work.div_(safe[:, None]).round_().clamp_(-LEVELS, LEVELS)
        codes.masked_fill_(scales[:, None] <= 0, 0.0)
        nibbles = self._nibbles.view(torch.int8)[:n]
        nibbles.copy_(flat[:n])  # whole numbers in -7 .. 7: exact
        nibbles.add_(8)
        self.residual.sub_(codes.mul_(scales[:, None]).view(-1)[:n])
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=self.residual.device)
        payload[:4 * self.chunks].copy_(scales.view(torch.uint8))
        pairs = self._nibbles.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=payload[4 * self.chunks:])
        return payload

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The values one payload stands for (1-D float32, `numel` long)."""
        return _decode(payload, self.numel, self.chunk)

    def decode_mean(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """The mean of what `payloads` (one per outer rank, in rank order)
        stand for, summed in that order, so every rank gets the same bits."""
        return self.decode_mean_of_part(payloads, self.numel)

    @property
    def split_alignment(self) -> int:
        """Where a payload may be cut: at whole chunks of whole bytes."""
        return self.chunk if self.chunk % 2 == 0 else 2 * self.chunk

    def cut(self, payload: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The payload of elements [start, stop) alone (start a multiple of
        `split_alignment`), from one of all of them: the same bytes as
        encoding those elements alone would give (a chunk's scale and codes
        are its own; an odd tail's padding nibble is the same 8)."""
        first, last = start // self.chunk, -(-stop // self.chunk)
        packed = 4 * self.chunks
        return torch.cat([payload[4 * first:4 * last], payload[packed + start // 2:packed + -(-stop // 2)]])

    def decode_mean_of_part(self, payloads: List[torch.Tensor], numel: int) -> torch.Tensor:
        """`decode_mean` of payloads of `numel` elements (cut by `cut`)."""
        total = _decode(payloads[0], numel, self.chunk).clone()
        for payload in payloads[1:]:
            total.add_(_decode(payload, numel, self.chunk))
        return total.div_(len(payloads))

    def state_dict(self) -> dict:
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.residual.copy_(state["residual"])


def _decode(payload: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """The `numel` values a payload in chunks of `chunk` stands for."""
    chunks = -(-numel // chunk)
    scales = payload[:4 * chunks].view(torch.float32)
    packed = payload[4 * chunks:]
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
    codes = torch.zeros(chunks * chunk, dtype=torch.float32, device=payload.device)
    codes[:numel] = nibbles.to(torch.float32).sub_(8)
    return (codes.view(chunks, chunk) * scales[:, None]).reshape(-1)[:numel]
