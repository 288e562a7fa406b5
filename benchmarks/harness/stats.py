"""Medians, spreads and ratios of interleaved measurements (see interleave.py)."""

from typing import Dict, List

import numpy as np

from benchmarks.harness.interleave import Blocks


def values(blocks: Blocks, phase: str = "total") -> List[float]:
    """Every measured sample's `phase` milliseconds, block after block."""
    return [sample[phase] for block in blocks for sample in block]


def summarize(blocks: Blocks, phase: str = "total") -> Dict[str, float]:
    """Median and interquartile range (milliseconds) over all measured iterations."""
    q25, median, q75 = np.percentile(values(blocks, phase), [25, 50, 75])
    return {"median_ms": float(median), "q25_ms": float(q25), "q75_ms": float(q75),
            "iterations": len(values(blocks, phase))}


def median_ms(blocks: Blocks, phase: str = "total") -> float:
    return float(np.median(values(blocks, phase)))


def ratio(numerator: Blocks, denominator: Blocks, phase: str = "total") -> Dict[str, float]:
    """median(numerator) / median(denominator) over all iterations, with the
    spread of the same ratio taken block pair by block pair (block i of one
    against block i of the other, measured back to back)."""
    per_block = [
        float(np.median([s[phase] for s in a]) / np.median([s[phase] for s in b]))
        for a, b in zip(numerator, denominator)
    ]
    q25, q75 = np.percentile(per_block, [25, 75])
    return {
        "ratio": median_ms(numerator, phase) / median_ms(denominator, phase),
        "per_block": {"min": min(per_block), "q25": float(q25), "q75": float(q75), "max": max(per_block),
                      "values": per_block},
    }
