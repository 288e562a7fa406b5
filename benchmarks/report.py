"""Renders results as markdown: one result's section, and docs/BENCHMARKS.md
with its pages (docs/benchmarks/) from the result summaries and the prose
beside them (reporting/document.py)."""

import os
from typing import Dict, List

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


def _read(paths: List[str]) -> List[str]:
    texts = []
    for path in paths:
        with open(path) as f:
            texts.append(f.read())
    return texts


def _build(texts: List[str], results_dir: str, text_dir: str, out_path: str) -> str:
    """`texts` assembled into the page `out_path`; figures are linked relative to it."""
    out_dir = os.path.dirname(os.path.abspath(out_path))

    def summary(name: str):
        files = results.paths(results_dir, name)
        if not os.path.exists(files["json"]):
            raise FileNotFoundError(f"{text_dir} places the result {name}, but {files['json']} does not exist; "
                                    f"run its experiment with --out {results_dir} first")
        return results.read_json(files["json"]), os.path.relpath(os.path.abspath(files["png"]), out_dir)

    def render(name: str) -> str:
        return render_section(*summary(name))

    def headline(name: str) -> str:
        return section.headline(*summary(name))

    return document.assemble(texts, render, headline)


def build_document(results_dir: str = RESULTS_DIR, text_dir: str = TEXT_DIR, doc_path: str = DOC_PATH) -> str:
    """The text of `doc_path` generated from `text_dir`'s prose and `results_dir`'s summaries."""
    return _build(_read(document.text_paths(text_dir)), results_dir, text_dir, doc_path)


def build_pages(results_dir: str = RESULTS_DIR, text_dir: str = TEXT_DIR, doc_path: str = DOC_PATH) -> Dict[str, str]:
    """{path: text} of every page beside `doc_path` (its method, each experiment's runs)."""
    return {page: _build(_read([text]), results_dir, text_dir, page)
            for page, text in document.page_paths(text_dir, doc_path).items()}


def write_document(results_dir: str = RESULTS_DIR, text_dir: str = TEXT_DIR, doc_path: str = DOC_PATH) -> None:
    """Writes `doc_path` and its pages."""
    generated = {doc_path: build_document(results_dir, text_dir, doc_path), **build_pages(results_dir, text_dir, doc_path)}
    for path, text in generated.items():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
