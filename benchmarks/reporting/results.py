"""Result files: DIR/<name>.json (the summary), DIR/<name>.png (the figure)
and DIR/<name>.samples.json.gz (the per-iteration samples the summary leaves out).

Note [Results stored once]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A measured result is one dict: options, machine, command, summaries (medians,
quartiles, ratios, counts) and the raw series they were computed from (every
iteration's milliseconds, training losses, memory samples). Tables are drawn
from the summaries alone, the figure from the whole dict at measurement time.
So the summary JSON is what gets published, with the figure; the series go to
a compressed file of their own, which the published results in benchmarks/results do
not keep (rerun the summary's command to get them again).
"""

import glob
import gzip
import json
import os
from typing import List, Tuple

# A list this long (of anything but strings) is a per-iteration or per-block
# series; summaries hold shorter lists only.
SERIES_LENGTH = 20
# Always raw, whatever their length: every measured iteration by block;
# instructions' counts of every rank's threads, turn by turn.
RAW_KEYS = ("samples_ms", "per_rank_threads")
# Always summary, whatever their length: tables of summarised records (one
# per configuration and variant).
SUMMARY_KEYS = ("rows", "targets")


def paths(out_dir: str, name: str) -> dict:
    return {"json": os.path.join(out_dir, f"{name}.json"), "png": os.path.join(out_dir, f"{name}.png"),
            "samples": os.path.join(out_dir, f"{name}.samples.json.gz")}


def _is_series(key: str, value) -> bool:
    if key in RAW_KEYS:
        return True
    if key in SUMMARY_KEYS:
        return False
    return isinstance(value, list) and len(value) >= SERIES_LENGTH and not all(isinstance(x, str) for x in value)


def split(data) -> Tuple[object, object]:
    """(summary, samples): `data` without its series, and the series alone,
    at the same keys (None where a part holds none)."""
    if isinstance(data, dict):
        summary, samples = {}, {}
        for key, value in data.items():
            if _is_series(key, value):
                samples[key] = value
                continue
            summary[key], inner = split(value)
            if inner:
                samples[key] = inner
        return summary, samples or None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        parts = [split(item) for item in data]
        inner = [p[1] for p in parts]
        return [p[0] for p in parts], (inner if any(inner) else None)
    return data, None


def merge(summary, samples):
    """The inverse of split: `summary` with `samples` put back at their keys."""
    if isinstance(summary, dict) and isinstance(samples, dict):
        merged = dict(summary)
        for key, value in samples.items():
            merged[key] = merge(summary[key], value) if key in summary else value
        return merged
    if isinstance(summary, list) and isinstance(samples, list):
        return [merge(s, r) if r else s for s, r in zip(summary, samples)]
    return summary


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_result(out_dir: str, name: str, data: dict) -> dict:
    """Writes the summary and the compressed samples of `data`; returns the paths of the result's files."""
    files = paths(out_dir, name)
    summary, samples = split(data)
    write_json(files["json"], summary)
    with gzip.open(files["samples"], "wt") as f:
        json.dump(samples or {}, f)
    return files


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_result(out_dir: str, name: str) -> dict:
    """A result as measured: its summary, with its samples where their file exists."""
    files = paths(out_dir, name)
    summary = read_json(files["json"])
    if not os.path.exists(files["samples"]):
        return summary
    with gzip.open(files["samples"], "rt") as f:
        return merge(summary, json.load(f))


def found(out_dir: str) -> List[str]:
    """Every result summary in out_dir, sorted by name."""
    return sorted(glob.glob(os.path.join(out_dir, "*.json")))
