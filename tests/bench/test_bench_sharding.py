"""`python -m benchmarks sharding` runs end to end (a functionality check; it times nothing).

A --quick run of the scaleout MLP with 1 MiB buckets, on the loopback at 2
ranks and over 1 Gbit/s links at 2 hosts x 2 ranks (where network
namespaces can be made; elsewhere that configuration is skipped with its
reason), must write rows with the overlap experiment's keys plus
`bytes_per_rank` and `peak_mib` for every variant (torch_zero and
ours_sharded among them), the targets, and the comparisons: the sharded run
bitwise torch's DDP's at 2 ranks. The byte count and the held peak are
unit-tested.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments import sharding  # noqa: E402
from benchmarks.harness import fake_hosts as hosts  # noqa: E402
from benchmarks.harness import peak_memory, sent_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROW_KEYS = {"model", "hosts", "ranks_per_host", "link", "variant", "ms", "ratio_to_torch", "bound_ms", "over_bound",
            "peak_mib", "peak_ratio_to_torch", "bytes_per_rank", "bytes_ratio_to_torch"}
MIB = 2**20


def test_sharding_quick_writes_every_variants_row(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONFAULTHANDLER="1")
    command = [sys.executable, "-m", "benchmarks", "sharding", "--quick", "--models", "mlp", "--bucket-cap-mb", "1",
               "--world-size", "2", "--configs", "loopback,1gbit:2x2", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with open(tmp_path / "sharding.json") as f:
        result = json.load(f)
    assert set(sharding.VARIANTS) == {"torch", "torch_zero", "ours", "ours_overlap", "ours_sharded"}
    linked = hosts.cannot_make_namespaces() is None
    configs = [(1, 2, "loopback")] + ([(2, 2, "1gbit")] if linked else [])
    rows = result["rows"]
    assert [(r["hosts"], r["ranks_per_host"], r["link"], r["variant"]) for r in rows] == [
        (*c, v) for c in configs for v in sharding.VARIANTS]
    gradient = result["configs"]["loopback"]["models"]["mlp"]["gradient_bytes"]
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["ms"] > 0 and r["bound_ms"] > 0 and r["peak_mib"] > 0, r
        # Every variant holds at least the parameters and their gradients' worth at its peak.
        assert r["peak_mib"] >= 2 * gradient / MIB, r
        # Every DDP sends at least what a ring allreduce of the gradients does, less Gloo's rounding.
        assert r["bytes_per_rank"] >= 0.98 * 2 * (r["ranks"] - 1) / r["ranks"] * gradient, r
    torch_rows = [r for r in rows if r["variant"] == "torch"]
    assert all(r["ratio_to_torch"] == 1.0 and r["bytes_ratio_to_torch"] == 1.0 for r in torch_rows)
    loopback = result["configs"]["loopback"]["models"]["mlp"]["equality"]
    assert loopback["largest_difference_to_torch"]["ours_sharded"] == 0.0 and loopback["overlap_vs_ours_bitwise"]
    assert {t["target"].split(" ")[1] for t in result["targets"]} >= {"time", "bytes"}
    if linked:
        assert any("peak memory" in t["target"] and t["config"] == "2x2 1gbit" for t in result["targets"])
        assert any("<= 0.75" in t["target"] for t in result["targets"])
    else:
        assert any("1gbit:2x2 not measured" in note for note in result["notes"])
    assert "| mlp | 1x2 loopback | ddp_ext + overlap_optimizer(shard=True) + forward |" in done.stdout


def test_written_bytes_counts_what_the_process_writes(tmp_path):
    before = sent_bytes.written_bytes()
    with open(tmp_path / "out.bin", "wb", buffering=0) as f:
        f.write(b"x" * 100_000)
    assert 100_000 <= sent_bytes.written_bytes() - before < 110_000


def test_held_peak_counts_what_the_step_holds_and_what_it_adds():
    def build():
        kept = torch.ones(MIB // 4)  # 1 MiB held by the step

        def step():
            extra = torch.ones(MIB // 4)  # 1 MiB during each iteration
            return float(kept[0] + extra[0])

        return step

    assert 2 * MIB <= peak_memory.held_peak_bytes(build) < 2 * MIB + 4096
    assert MIB <= peak_memory.peak_bytes(build()) < MIB + 4096  # the growth alone: what the step adds


def test_bound_divides_the_optimizer_among_the_ranks():
    summary = {"phases_ms": {"local": {"forward": 10.0, "backward": 20.0, "optimizer": 40.0}},
               "gradient_bytes": 12_500_000}
    assert sharding.bound_ms(summary, 4, None) == pytest.approx(40.0)  # 10 + 20 + 40 / 4
    assert sharding.bound_ms(summary, 4, 1.0) == pytest.approx(150.0)  # 1.5 x 12.5 MB at 1 Gbit/s


def test_held_peak_counts_what_the_step_holds_and_an_unseen_free_at_its_address_reuse():
    def build():
        kept = torch.ones(MIB // 4)  # 1 MiB held by the step

        def step():
            temporary = torch.ones(MIB // 2)  # 2 MiB within each iteration
            return float(kept[0] + temporary[0])

        return step

    assert 3 * MIB <= peak_memory.held_peak_bytes(build) < 4 * MIB
    # 100 bytes at address 1 freed unseen (by another thread): counted until
    # its address is allocated again at t=3.
    memory = [{"ts": t, "args": {"Bytes": n, "Addr": a}} for t, n, a in
              [(0, 100, 1), (1, 50, 2), (2, -50, 2), (3, 100, 1), (4, -100, 1)]]
    changes = peak_memory._with_unseen_frees(memory)
    assert peak_memory.running_peak(changes) == 150
    assert sum(n for _, n in changes) == 0
    assert peak_memory._held_peak(changes, 2.5, 3.5) == 100
