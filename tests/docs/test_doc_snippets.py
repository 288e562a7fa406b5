"""Every ```python block of README.md and docs/ either runs as it stands, and
is run here, or is marked as a fragment (a line `<!-- fragment -->` just
before it), which must still be valid Python. A snippet that reads like a
script but fails when copied is the first thing a new user meets."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAGMENT = "<!-- fragment -->"
# Complete snippets that another test runs, with checks of their own.
RUN_ELSEWHERE = {("README.md", "# train.py: torchrun"): "tests/docs/test_readme.py"}
TORCHRUN = re.compile(r"^# \S+\.py: torchrun --nproc_per_node=(\d+) ")


def _snippets():
    """(page, line, is_fragment, code) for every ```python block."""
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    found = []
    for page in pages:
        with open(page) as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            found.append((os.path.relpath(page, ROOT), i + 1, previous == FRAGMENT, "\n".join(lines[i + 1:end]) + "\n"))
    return found


SNIPPETS = _snippets()


def _run_elsewhere(page, code):
    return next((test for (p, start), test in RUN_ELSEWHERE.items() if p == page and code.startswith(start)), None)


def test_there_are_snippets_of_both_kinds():
    assert any(fragment for _, _, fragment, _ in SNIPPETS)
    assert any(not fragment for _, _, fragment, _ in SNIPPETS)


@pytest.mark.parametrize("page, line, fragment, code", SNIPPETS, ids=[f"{p}:{n}" for p, n, _, _ in SNIPPETS])
def test_snippet_runs_or_is_a_fragment(page, line, fragment, code, tmp_path):
    compile(code, f"{page}:{line}", "exec")  # a fragment too: no typo in what users copy
    if fragment:
        return
    elsewhere = _run_elsewhere(page, code)
    if elsewhere is not None:
        assert os.path.exists(os.path.join(ROOT, elsewhere)), f"{page}:{line} is said to be run by {elsewhere}"
        return
    script = tmp_path / "snippet.py"
    script.write_text(code)
    launch = TORCHRUN.match(code)
    command = [sys.executable, str(script)]
    if launch:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={launch.group(1)}", str(script)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{page}:{line} fails when copied (mark it `{FRAGMENT}` if it is not meant to run alone):\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
