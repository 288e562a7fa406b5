"""Measures several variants side by side, alternating block by block.

Note [Interleaved measurement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a shared machine the background load drifts during a run. Measuring
variant A for a minute and then variant B would turn that drift into a
difference between A and B. Instead every variant runs `warmup` unmeasured
iterations, then blocks alternate: A, B, C, then B, C, A, then C, A, B, ...
(the starting variant rotates so none is always first). Each block starts
with a barrier (so every rank begins it together) and `discard_per_block`
unmeasured iterations (switching replicas evicts caches; that cost belongs to
the interleaving, not to the variant), then `block_iterations` measured ones.
Per-block medians then let ratios be computed block pair by block pair.
"""

from typing import Callable, Dict, List

import torch.distributed as dist

from benchmarks.harness.progress import Progress

Sample = Dict[str, float]  # milliseconds per phase, with "total"
Blocks = List[List[Sample]]  # samples per block


def run_interleaved(variants: Dict[str, Callable[[], Sample]], warmup: int, blocks: int, block_iterations: int,
                    discard_per_block: int, progress: Progress, label: str) -> Dict[str, Blocks]:
    """Runs each variant's step as described in Note [Interleaved measurement];
    returns, per variant, its measured samples grouped by block."""
    for step in variants.values():
        for _ in range(warmup):
            step()
    measured: Dict[str, Blocks] = {name: [] for name in variants}
    names = list(variants)
    for block in range(blocks):
        for name in rotated(names, block):
            step = variants[name]
            dist.barrier()
            for _ in range(discard_per_block):
                step()
            measured[name].append([step() for _ in range(block_iterations)])
        progress.say(f"{label}: block {block + 1}/{blocks}")
    return measured


def rotated(items: list, by: int) -> list:
    """items starting at position `by` (modulo their count), wrapping around."""
    by %= len(items)
    return items[by:] + items[:by]


def merge_ranks(per_rank: List[Dict[str, Blocks]]) -> Dict[str, Blocks]:
    """One sample per iteration from every rank's samples of it: the slowest
    rank's, since a synchronous iteration ends when its last rank does."""
    merged: Dict[str, Blocks] = {}
    for name in per_rank[0]:
        merged[name] = [
            [max(samples, key=lambda s: s["total"]) for samples in zip(*(r[name][b] for r in per_rank))]
            for b in range(len(per_rank[0][name]))
        ]
    return merged
