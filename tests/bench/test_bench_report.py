"""The published results: docs/BENCHMARKS.md and its pages (docs/benchmarks/)
are generated from the summaries in benchmarks/results and the prose in
benchmarks/results/text, and are up to date with them; every summary is placed
once in full, compact, and comes with its figure and the figure's provenance;
the document stays one page a reader finishes."""

import glob
import os

import pytest

pytest.importorskip("matplotlib", reason="rendering the tables needs the `bench` extra")

from benchmarks import report  # noqa: E402
from benchmarks.reporting import document, figures, results, section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, report.RESULTS_DIR)
TEXT = os.path.join(ROOT, report.TEXT_DIR)
DOC = os.path.join(ROOT, report.DOC_PATH)
PAGES_DIR = os.path.join(os.path.dirname(DOC), document.PAGES_FOLDER)
# Summaries and figures only: raw samples are not published. About 70 kB for
# each of the 19 experiments and the instructions' runs at 4 and 8 ranks,
# and the sharding experiment's repeats (about 130 kB, stored compact).
MAX_PUBLISHED_BYTES = 1_440_000
# About 350 lines: the summary, the speed targets and a short section per
# experiment; the records of the runs belong on the pages.
MAX_DOC_LINES = 360


def _texts() -> list:
    texts = []
    for path in document.text_paths(TEXT) + list(document.page_paths(TEXT, DOC).values()):
        with open(path) as f:
            texts.append(f.read())
    return texts


def _placed() -> list:
    return [name for text in _texts() for name in document.results_named(text)]


def test_benchmarks_md_is_up_to_date_with_the_summaries():
    with open(DOC) as f:
        committed = f.read()
    generated = report.build_document(RESULTS, TEXT, DOC)
    assert generated == committed, "docs/BENCHMARKS.md is stale: run `python -m benchmarks report`"


def test_the_pages_are_up_to_date_and_none_is_left_over():
    generated = report.build_pages(RESULTS, TEXT, DOC)
    on_disk = sorted(glob.glob(os.path.join(PAGES_DIR, "*.md")))
    assert on_disk == sorted(generated), "docs/benchmarks/ holds pages the report does not generate, or lacks some"
    for path, text in generated.items():
        with open(path) as f:
            assert f.read() == text, f"{path} is stale: run `python -m benchmarks report`"


def test_the_document_stays_short_and_every_headline_is_placed_in_full():
    with open(DOC) as f:
        assert len(f.read().splitlines()) <= MAX_DOC_LINES
    placed = set(_placed())
    shown = [name for text in _texts() for name in document.figures_named(text)]
    assert shown and set(shown) <= placed, set(shown) - placed


def test_every_published_result_is_placed_once_with_its_figure():
    placed = _placed()
    assert len(placed) == len(set(placed)), placed
    # Reruns (repeats/) are cited by the prose, not placed; every other summary is.
    published = sorted(os.path.relpath(p, RESULTS)[:-len(".json")]
                       for p in glob.glob(os.path.join(RESULTS, "*.json")) + glob.glob(os.path.join(RESULTS, "mpi", "*.json")))
    assert sorted(placed) == published
    for name in placed:
        files = results.paths(RESULTS, name)
        summary = results.read_json(files["json"])
        stamped = figures.read_provenance(files["png"])
        assert stamped == figures.provenance(summary), name
        assert summary["machine"]["ddp_ext_commit"] in stamped["Commit"]


def test_summaries_hold_no_per_iteration_series():
    for path in glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True):
        summary = results.read_json(path)
        assert results.split(summary) == (summary, None), f"{path} holds raw samples"


def test_published_results_stay_small():
    published = [p for p in glob.glob(os.path.join(RESULTS, "**", "*"), recursive=True)
                 if os.path.isfile(p) and not p.endswith(".samples.json.gz")]
    assert sum(os.path.getsize(p) for p in published) < MAX_PUBLISHED_BYTES


def test_split_moves_series_out_and_merge_puts_them_back():
    data = {"command": "c", "notes": ["a"] * 25, "models": {"bert": {"ratio": 1.1, "samples_ms": {"ours": [1.0]},
                                                                     "losses": list(range(30)), "caps": [1, 5]}},
            "ranks": [{"rank": 0, "samples": [[i, 2] for i in range(20)]}, {"rank": 1, "samples": []}]}
    summary, samples = results.split(data)
    assert summary == {"command": "c", "notes": ["a"] * 25, "models": {"bert": {"ratio": 1.1, "caps": [1, 5]}},
                       "ranks": [{"rank": 0}, {"rank": 1, "samples": []}]}
    assert set(samples["models"]["bert"]) == {"samples_ms", "losses"}
    assert results.merge(summary, samples) == data


def test_write_result_then_read_result_gives_the_result_back(tmp_path):
    data = {"experiment": "compare", "losses": [0.5] * 40, "ratio": 0.9}
    files = results.write_result(str(tmp_path), "compare-x", data)
    assert results.read_json(files["json"]) == {"experiment": "compare", "ratio": 0.9}
    assert results.read_result(str(tmp_path), "compare-x") == data


def test_a_field_the_result_lacks_reads_not_recorded():
    data = {"options": {"world_size": 2}, "machine": {"cpu_model": "cpu"}}
    line = section.machine_line(data)
    assert line.startswith("cpu, not recorded usable of not recorded logical cores")
    assert "took not recorded" in line and "None" not in line
    assert figures.provenance({})["Commit"] == figures.NOT_RECORDED
