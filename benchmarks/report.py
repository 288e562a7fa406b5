"""Renders results as markdown: one result's section, and docs/BENCHMARKS.md
from the result summaries and the prose beside them (reporting/document.py)."""

import os

from benchmarks.experiments import EXPERIMENTS
from benchmarks.reporting import document, results, section

TEXT_DIR = "benchmarks/results/text"
RESULTS_DIR = "benchmarks/results"
DOC_PATH = "docs/BENCHMARKS.md"


def render_section(data: dict, figure_path: str) -> str:
    """The markdown section of one result, as the experiment that measured it describes it."""
    module = EXPERIMENTS[data["experiment"]]
    run_line = module.run_line(data) if hasattr(module, "run_line") else None
    return section.render(data, module.table(data), figure_path, run_line)


def build_document(results_dir: str = RESULTS_DIR, text_dir: str = TEXT_DIR, doc_path: str = DOC_PATH) -> str:
    """The text of `doc_path` generated from `text_dir`'s prose and `results_dir`'s summaries;
    figures are linked relative to `doc_path`."""
    texts = []
    for path in document.text_paths(text_dir):
        with open(path) as f:
            texts.append(f.read())
    doc_dir = os.path.dirname(os.path.abspath(doc_path))

    def render(name: str) -> str:
        files = results.paths(results_dir, name)
        if not os.path.exists(files["json"]):
            raise FileNotFoundError(f"{text_dir} places the result {name}, but {files['json']} does not exist; "
                                    f"run its experiment with --out {results_dir} first")
        figure = os.path.relpath(os.path.abspath(files["png"]), doc_dir)
        return render_section(results.read_json(files["json"]), figure)

    return document.assemble(texts, render)


def write_document(results_dir: str = RESULTS_DIR, text_dir: str = TEXT_DIR, doc_path: str = DOC_PATH) -> None:
    text = build_document(results_dir, text_dir, doc_path)
    with open(doc_path, "w") as f:
        f.write(text)
