"""The markdown section describing one result (command, machine, table, notes,
figure), and its headline (command, commit and machine in brief, figure)."""

import collections
import os

from benchmarks.reporting.figures import NOT_RECORDED


def machine_line(data: dict) -> str:
    """Where and when the result was measured; a field the result lacks reads "not recorded"."""
    m = collections.defaultdict(lambda: NOT_RECORDED, data.get("machine", {}))
    options = data["options"]
    gpu = f"{m['device']} (CUDA {m['cuda']}); " if "device" in m else ""
    duration = f"{data['duration_s']:.0f} s" if "duration_s" in data else NOT_RECORDED
    return (
        f"{gpu}{m['cpu_model']}, {m['usable_cores']} usable of {m['logical_cores']} logical cores, "
        f"{m['memory_gib']} GiB; torch {m['torch']}, ddp_ext {m['ddp_ext']} ({m['ddp_ext_commit']}), "
        f"Python {m['python']}; backend {m['backend']}, {data.get('ranks', options['world_size'])} ranks, "
        f"{m['threads_per_rank']} thread(s) per rank; load average {m['load_average_at_start']} at start, "
        f"{m['load_average_at_end']} at end; measured {m['started_utc']}, took {duration}."
    )


def bucket_cap_text(caps: list) -> str:
    if list(caps) == [None]:
        return "each DDP's default bucket cap (25 MiB, with a 1 MiB first bucket in both)"
    return f"bucket_cap_mb {', '.join(f'{c:g}' for c in caps)} for both DDPs"


def run_lengths_line(data: dict) -> str:
    o = data["options"]
    return (f"preset `{o['preset']}`, seed {o['seed']}, {bucket_cap_text(o['bucket_cap_mb'])}; per variant "
            f"{o['warmup']} warm-up iterations, then {o['blocks']} blocks of {o['discard_per_block']} discarded + "
            f"{o['block_iterations']} measured iterations, variants alternating block by block.")


QUICK_WARNING = ("**Quick run (`--quick`): this checks that the experiment works end to end; its numbers "
                 "are not a measurement and must not be reported.**")


def render(data: dict, table: str, figure_path: str, run_line: str = None) -> str:
    """Markdown for one result; figure_path is relative to where the markdown will live.
    run_line replaces the default description of the run lengths."""
    lines = [QUICK_WARNING, ""] if data["options"].get("quick") else []
    lines += [
        f"**Command:** `{data['command']}`",
        "",
        f"**Machine:** {machine_line(data)}",
        "",
        f"**Run:** {run_line or run_lengths_line(data)}",
        "",
        table,
        "",
    ]
    lines += [f"- {note}" for note in data.get("notes", [])]
    if data.get("notes"):
        lines.append("")
    lines.append(f"![{data['title']}]({figure_path.replace(os.sep, '/')})")
    return "\n".join(lines) + "\n"


def measured_line(data: dict) -> str:
    """The commit, date and machine of a result in brief; machine_line() has the rest."""
    m = collections.defaultdict(lambda: NOT_RECORDED, data.get("machine", {}))
    gpu = f"{m['device']}, " if "device" in m else ""
    started = m["started_utc"][:10] if "started_utc" in m else NOT_RECORDED
    return (f"ddp_ext {m['ddp_ext_commit']}, {started}; {gpu}{m['cpu_model']}, {m['usable_cores']} usable cores; "
            f"{data.get('ranks', data['options']['world_size'])} ranks over {m['backend']}")


def headline(data: dict, figure_path: str) -> str:
    """Markdown for a result's headline: its command, where and when in brief, its figure."""
    lines = [QUICK_WARNING, ""] if data["options"].get("quick") else []
    lines += [f"**Command:** `{data['command']}` ({measured_line(data)})", "",
              f"![{data['title']}]({figure_path.replace(os.sep, '/')})"]
    return "\n".join(lines) + "\n"
