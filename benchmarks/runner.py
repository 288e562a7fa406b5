"""Runs one experiment and writes DIR/<name>.json (summary), DIR/<name>.png
and DIR/<name>.samples.json.gz (see Note [Results stored once])."""

import dataclasses
import os
import time

from benchmarks.experiments import EXPERIMENTS
from benchmarks.harness.machine import describe_machine, load_average
from benchmarks.harness.options import BenchOptions
from benchmarks.harness.progress import Progress
from benchmarks.report import render_section
from benchmarks.reporting import figures, results


def run_experiment(options: BenchOptions, command: str) -> dict:
    """Measures, then writes; prints the result's section; returns the paths written."""
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
    files = results.write_result(options.out, options.output_name, data)
    module.plot(data, files["png"])
    figures.stamp(files["png"], data)
    print(f"## {options.output_name}: {module.TITLE}\n\n{render_section(data, os.path.basename(files['png']))}")
    progress.say("wrote " + ", ".join(files.values()))
    return files
