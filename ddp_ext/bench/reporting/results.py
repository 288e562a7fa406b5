"""Reading and writing result files: DIR/<name>.json, .png and .md."""

import glob
import json
import os
from typing import List


def paths(out_dir: str, name: str) -> dict:
    return {ext: os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "png", "md")}


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def found(out_dir: str) -> List[str]:
    """Every result JSON in out_dir, sorted by name."""
    return sorted(glob.glob(os.path.join(out_dir, "*.json")))
