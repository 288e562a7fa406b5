"""A finished training process exits with status 0: Note [Exit after
training] in ddp_ext/_exit.py.

2-rank jobs (tests/support/exit_runs.py) in every variant: with and without
destroy_process_group(), with _register_fused_optim on a subset of the
parameters or not, the model freed by the rank's function or kept to the
interpreter's shutdown; all end with a final dist.barrier(). The race is
timing-dependent, so a few runs can pass without the fix: the full count is
tests/support/exit_runs.py --runs 200 (docs/RELIABILITY.md, "Exit status"). The
release itself is checked deterministically: after it, no Gloo worker
thread is left, including those of a group only the DDP module still holds.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tests", "support", "exit_runs.py")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_every_rank_exits_0_in_every_variant(tmp_path):
    counts = tmp_path / "counts.json"
    kept = tmp_path / "failed"
    done = subprocess.run(
        [sys.executable, TOOL, "--runs", "8", "--ddp", "ddp_ext", "--jobs", "2", "--timeout", "120",
         "--json", str(counts), "--keep", str(kept)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert counts.exists(), f"exit_runs.py wrote no counts:\n{done.stdout}\n{done.stderr}"
    summary = json.loads(counts.read_text())["ddp_ext"]
    assert summary["runs"] == 8
    for variant, outcomes in summary["variants"].items():
        assert outcomes == {"ok": 1}, f"{variant}: {outcomes}\n{done.stdout}"
    assert done.returncode == 0, done.stdout + done.stderr


RELEASE_SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    import ddp_ext
    from ddp_ext import _exit

    def gloo_threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        return sum(name.startswith("pt_gloo") for name in names)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = ddp_ext.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    dist.barrier()
    before = gloo_threads()
    dist.destroy_process_group()  # the DDP module and its reducer still hold the group
    after_destroy = gloo_threads()
    released = _exit.release_at_exit()
    print(before, after_destroy, released, gloo_threads())
""")


def test_release_at_exit_joins_the_gloo_threads_of_a_destroyed_group():
    done = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    before, after_destroy, released, after = done.stdout.split()[-4:]
    assert int(before) > 0, f"no Gloo worker thread found to start with: {done.stdout}"
    assert int(after_destroy) == int(before), "destroy_process_group() alone joined them: the test shows nothing"
    assert released == "True"
    assert int(after) == 0, f"{after} Gloo worker threads left after the release"
