"""The main job (examples/train_compare.py): its verdict, and a short run
under torchrun that passes and says what its speed figure means."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_compare.py")


def _example():
    spec = importlib.util.spec_from_file_location("train_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdict_names_the_worst_rank_and_tensor():
    example = _example()
    passed, line = example.verdict([(0.0, "a.weight"), (0.0, "a.bias")])
    assert passed and line.startswith("PASS:") and "all 2 ranks" in line
    passed, line = example.verdict([(1e-7, "a.weight"), (0.5, "bn.running_mean"), (0.1, "a.bias")])
    assert not passed and line.startswith("FAIL:")
    assert "`bn.running_mean`" in line and "rank 1" in line and "0.5" in line


def test_short_run_passes_and_explains_its_speed_figure():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               "--steps", "4", "--block", "2", "--batch-per-rank", "4"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("PASS: ddp_ext trained the same model as torch's DDP on all 2 ranks"), done.stdout
    assert "it is not a benchmark" in done.stdout and _example().BENCH_COMMAND in done.stdout, done.stdout
