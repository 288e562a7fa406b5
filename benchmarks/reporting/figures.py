"""Matplotlib set up for writing PNG files without a display, and the
provenance every figure file carries."""

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

# Colours per implementation, the same in every figure.
COLORS = {"ours": "tab:blue", "torch": "tab:orange", "local": "tab:gray"}
# Plots use few colours: a palette of this many keeps them as drawn at a third of the bytes.
PALETTE_COLORS = 128
NOT_RECORDED = "not recorded"


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


def provenance(data: dict) -> dict:
    """What a figure file records about how it was measured: command, commit, machine state."""
    m = data.get("machine", {})
    return {
        "Command": data.get("command", NOT_RECORDED),
        "Commit": m.get("ddp_ext_commit", NOT_RECORDED),
        "Machine": ", ".join(f"{key} {m.get(key, NOT_RECORDED)}" for key in (
            "cpu_model", "usable_cores", "memory_gib", "torch", "backend", "threads_per_rank",
            "load_average_at_start", "load_average_at_end", "started_utc")),
    }


def stamp(path: str, data: dict) -> None:
    """Rewrites the PNG at `path` with a palette of PALETTE_COLORS colours and
    the provenance of `data` in its text chunks (what `file` or an image
    viewer's properties show)."""
    from PIL import Image, PngImagePlugin

    with Image.open(path) as image:
        image.load()
    info = PngImagePlugin.PngInfo()
    for key, value in provenance(data).items():
        info.add_itxt(key, value)
    out = io.BytesIO()
    image.convert("RGB").quantize(colors=PALETTE_COLORS, method=Image.Quantize.MEDIANCUT,
                                  dither=Image.Dither.NONE).save(out, "PNG", optimize=True, pnginfo=info)
    with open(path, "wb") as f:
        f.write(out.getvalue())


def read_provenance(path: str) -> dict:
    from PIL import Image

    with Image.open(path) as image:
        return {key: image.text[key] for key in ("Command", "Commit", "Machine") if key in image.text}
