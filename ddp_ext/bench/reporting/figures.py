"""Matplotlib set up for writing PNG files without a display."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

# Colours per implementation, the same in every figure.
COLORS = {"ours": "tab:blue", "torch": "tab:orange", "local": "tab:gray"}


def panels(count: int, width_per_panel: float = 5.0, height: float = 4.0):
    """A figure with `count` side-by-side axes; returns (figure, list of axes)."""
    figure, axes = plt.subplots(1, count, figsize=(width_per_panel * count, height), squeeze=False)
    return figure, list(axes[0])


def save(figure, path: str, title: str) -> None:
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
# Box-plot medians in black, visible on every box colour.
MEDIAN = {"color": "black"}
