"""Runs one experiment and writes DIR/<name>.json, DIR/<name>.png and DIR/<name>.md."""

import dataclasses
import os
import time

from ddp_ext.bench.experiments import EXPERIMENTS
from ddp_ext.bench.harness.machine import describe_machine, load_average
from ddp_ext.bench.harness.options import BenchOptions
from ddp_ext.bench.harness.progress import Progress
from ddp_ext.bench.reporting import results, section


def render_section(data: dict, figure_path: str) -> str:
    """The markdown section of one result, as the experiment that measured it describes it."""
    module = EXPERIMENTS[data["experiment"]]
    run_line = module.run_line(data) if hasattr(module, "run_line") else None
    return section.render(data, module.table(data), figure_path, run_line)


def render_outputs(data: dict, out_dir: str, name: str) -> dict:
    """Writes the figure and the markdown of an already measured result."""
    module = EXPERIMENTS[data["experiment"]]
    files = results.paths(out_dir, name)
    module.plot(data, files["png"])
    with open(files["md"], "w") as f:
        f.write(f"## {name}: {data['title']}\n\n")
        f.write(render_section(data, os.path.basename(files["png"])))
    return files


def run_experiment(options: BenchOptions, command: str) -> dict:
    """Measures, then writes; returns the paths written."""
    module = EXPERIMENTS[options.experiment]
    progress = Progress(options.output_name)
    machine = describe_machine(options.process_group_backend(), options.threads, options.device)
    started = time.time()
    progress.say(f"preset {options.preset}, writing to {options.out}")
    payload = module.run(options, progress)
    machine["load_average_at_end"] = load_average()
    data = {
        "experiment": options.experiment,
        "title": module.TITLE,
        "paper_figure": module.FIGURE,
        "command": command,
        "options": dataclasses.asdict(options),
        "machine": machine,
        "duration_s": time.time() - started,
        **payload,
    }
    files = results.paths(options.out, options.output_name)
    results.write_json(files["json"], data)
    render_outputs(data, options.out, options.output_name)
    progress.say("wrote " + ", ".join(files.values()))
    return files
