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


def paired_boxes(ax, settings, samples_of, labels) -> None:
    """Box plots of ddp_ext beside torch's DDP for each setting on the x axis;
    samples_of(setting, kind) gives the latencies of one box."""
    for offset, kind in ((-0.2, "ours"), (0.2, "torch")):
        boxes = ax.boxplot([samples_of(s, kind) for s in settings],
                           positions=[i + offset for i in range(len(settings))], widths=0.35,
                           patch_artist=True, manage_ticks=False, medianprops=MEDIAN)
        for patch in boxes["boxes"]:
            patch.set_facecolor(COLORS[kind])
        boxes["boxes"][0].set_label(labels[kind])
    ax.set_xticks(range(len(settings)), settings)
