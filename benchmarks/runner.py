"""Runs one experiment and writes DIR/<name>.json (summary), DIR/<name>.png
and DIR/<name>.samples.json.gz (see Note [Results stored once]); or, where
the experiment fails after finishing some of its runs, DIR/<name>.incomplete.json
(Note [Finished runs are written] in benchmarks/harness/finished_runs.py)."""

import dataclasses
import os
import time

from benchmarks.experiments import EXPERIMENTS
from benchmarks.harness.finished_runs import Incomplete
from benchmarks.harness.machine import describe_machine, load_average
from benchmarks.harness.options import BenchOptions
from benchmarks.harness.progress import Progress
from benchmarks.report import render_section
from benchmarks.reporting import figures, results

INCOMPLETE_SUFFIX = ".incomplete"


def _not_measured_line(not_measured: dict) -> str:
    return "not measured: " + "; ".join(f"{name} ({why})" for name, why in not_measured.items())


def run_experiment(options: BenchOptions, command: str) -> dict:
    """Measures, then writes; prints the result's section; returns the paths written."""
    module = EXPERIMENTS[options.experiment]
    progress = Progress(options.output_name)
    machine = describe_machine(options.process_group_backend(), options.threads, options.device)
    started = time.time()
    progress.say(f"preset {options.preset}, writing to {options.out}")

    def record(payload: dict) -> dict:
        machine["load_average_at_end"] = load_average()
        return {
            "experiment": options.experiment,
            "title": module.TITLE,
            "paper_figure": module.FIGURE,
            "command": command,
            "options": dataclasses.asdict(options),
            "machine": machine,
            "duration_s": time.time() - started,
            **payload,
        }

    try:
        payload = module.run(options, progress)
    except Incomplete as incomplete:
        files = results.write_result(options.out, options.output_name + INCOMPLETE_SUFFIX,
                                     record({"runs": incomplete.runs, "not_measured": incomplete.not_measured}))
        progress.say(f"wrote the {len(incomplete.runs)} finished run(s) to {files['json']} and {files['samples']}; "
                     + _not_measured_line(incomplete.not_measured))
        raise
    data = record(payload)
    files = results.write_result(options.out, options.output_name, data)
    module.plot(data, files["png"])
    figures.stamp(files["png"], data)
    print(f"## {options.output_name}: {module.TITLE}\n\n{render_section(data, os.path.basename(files['png']))}")
    progress.say("wrote " + ", ".join(files.values()))
    if data.get("not_measured"):
        progress.say(_not_measured_line(data["not_measured"]))
    return files
