"""Markdown tables and the number formats every table shares."""

from typing import Optional, Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; the first column left-aligned, the rest right-aligned."""
    align = [":--"] + ["--:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(value: Optional[float]) -> str:
    """Milliseconds with about three significant digits."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ms_iqr(summary: dict) -> str:
    """`median (q25-q75)` of a stats.summarize() result."""
    return f"{ms(summary['median_ms'])} ({ms(summary['q25_ms'])}-{ms(summary['q75_ms'])})"


def ratio(value: float) -> str:
    return f"{value:.3f}"


def ratio_spread(result: dict) -> str:
    """`ratio [min-max]` of a stats.ratio() result, the range over block pairs."""
    spread = result["per_block"]
    return f"{result['ratio']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}]"
