"""`python -m benchmarks scaleout`: hosts as network namespaces.

- Unit: which targets a table of rows meets, and scaling efficiency.
- Smoke (seconds): the quick configuration (2 hosts x 1 rank over a veth
  pair shaped to 1 Gbit/s) writes scaleout.json with every variant, and the
  bytes counted on the veths follow what each variant sends: float16 about
  half of float32's, PowerSGD a few percent, layer drop fewer. Skipped, with
  the reason, where namespaces cannot be made (not root).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments import scaleout  # noqa: E402
from benchmarks.harness import fake_hosts as hosts  # noqa: E402
from benchmarks.workloads import scaleout_variants as sv  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(config, ms, link_bytes):
    h, r, g = config
    return [{"hosts": h, "ranks_per_host": r, "ranks": h * r, "link_gbit": g, "variant": v, "ms": ms[v],
             "over_torch": ms[v] / ms[sv.TORCH], "link_bytes": link_bytes.get(v, 1000.0)} for v in sv.VARIANTS]


def test_targets_and_efficiency_from_rows():
    base = {v: 100.0 for v in sv.VARIANTS}
    ms = dict(base, ours=99.0, ours_hierarchy=70.0, ours_adaptive=55.0, ours_layerdrop=85.0)
    rows = _rows((1, 1, None), base, {}) + _rows((2, 2, 1), ms, {"ours": 1000.0, "ours_adaptive": 300.0})
    scaleout._add_efficiency(rows)
    assert {r["efficiency"] for r in rows if r["ranks"] == 1} == {1.0}
    assert [r["efficiency"] for r in rows if r["variant"] == "ours_hierarchy" and r["ranks"] == 4] == [100 / 70]
    met = {t["target"]: t["met"] for t in scaleout.targets(rows)}
    assert met == {
        "ddp_ext without hooks / torch DDP time": True,
        "hierarchy: flat / hierarchical time (never below 1)": True,
        "hierarchy: flat / hierarchical time at 2x2, 1 Gbit/s": True,  # 99 / 70 = 1.41
        "adaptive: link bytes / float32's": True,  # 0.30
        "adaptive / torch DDP time": True,  # 0.55
        "layer drop p=0.5 / torch DDP time": False,  # 0.85
    }
    # One rank per host: no target applies (nothing to combine, no hierarchy).
    assert scaleout.targets(_rows((2, 1, 1), ms, {})) == []


def test_quick_run_counts_the_bytes_on_the_link(tmp_path):
    reason = hosts.cannot_make_namespaces()
    if reason:
        pytest.skip(f"scaleout smoke: {reason}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "scaleout", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with open(tmp_path / "scaleout.json") as f:
        result = json.load(f)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(sv.VARIANTS)
    for r in rows.values():
        assert (r["hosts"], r["ranks_per_host"], r["link_gbit"]) == (2, 1, 1)
        assert r["ms"] > 0
    flat = rows["ours"]["link_bytes"]
    params = sum(p.numel() for p in sv.ScaleoutMLP(0.0).parameters())
    # Two ranks: each host sends its whole float32 gradient once, plus headers.
    assert 2 * 4 * params <= flat <= 2 * 4 * params * 1.2, flat
    assert abs(rows["torch"]["link_bytes"] / flat - 1) < 0.05
    assert 0.4 < rows["torch_fp16"]["link_bytes"] / flat < 0.6
    assert rows["torch_powersgd"]["link_bytes"] / flat < 0.1
    assert rows["ours_adaptive"]["link_bytes"] / flat < 0.6  # float16 or 8 bits after its short warm-up
    assert rows["ours_layerdrop"]["link_bytes"] < flat
    assert (tmp_path / "scaleout.png").stat().st_size > 0
