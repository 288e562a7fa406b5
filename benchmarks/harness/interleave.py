"""Measures several variants side by side, alternating block by block.

Note [Interleaved measurement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a shared machine the background load drifts during a run. Measuring
variant A for a minute and then variant B would turn that drift into a
difference between A and B. Instead every variant runs `warmup` unmeasured
iterations, then the variants take turns, a block each, in an order that
changes from round to round (`balanced_order`). Rotating one order (A, B, C,
then B, C, A, ...) would move which variant goes first but keep who follows
whom: B would always come right after A. What a variant leaves behind (its
caches, its communication threads' state) then always weighs on the same
successor, and two identical replicas measured that way differed by 1 to 2%
on this machine. The rounds follow a Williams design instead: over a cycle
of rounds every variant runs at every position equally often and right after
every other variant equally often. Each block starts
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
        for name in balanced_order(names, block):
            step = variants[name]
            dist.barrier()
            for _ in range(discard_per_block):
                step()
            measured[name].append([step() for _ in range(block_iterations)])
        progress.say(f"{label}: block {block + 1}/{blocks}")
    return measured


def balanced_order(items: list, round_: int) -> list:
    """The order of `items` in round `round_` of a Williams design (see the
    Note): n rounds for an even count of items, 2n for an odd one, then the
    cycle repeats. The same on every rank: it depends on the arguments only."""
    n = len(items)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rounds = n if n % 2 == 0 else 2 * n
    r = round_ % rounds
    order = [items[(k + r) % n] for k in first]
    return order if r < n else order[::-1]


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
