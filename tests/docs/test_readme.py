"""The README's promises: its minimal training script runs under torchrun and
its ranks agree, and CI runs the README's test command word for word, a
command that needs no root."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _minimal_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)
    scripts = [b for b in blocks if b.startswith("# train.py")]
    assert len(scripts) == 1, "README.md should hold one ```python block that starts with `# train.py`"
    return scripts[0]


def _test_command() -> str:
    commands = [line.strip() for line in _readme().splitlines()
                if line.startswith("    ") and "python -m pytest tests" in line]
    assert len(commands) == 1, commands
    return commands[0]


def test_minimal_script_trains_and_its_ranks_agree(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_minimal_script())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", done.stdout, flags=re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
    assert done.stdout.strip().splitlines()[-1] == "ranks agree: True", done.stdout


def test_ci_ends_with_the_readme_test_command_which_needs_no_root():
    command = _test_command()
    assert not re.search(r"\b(apt-get|apt|sudo|yum|dnf)\b", command), command
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert command in ci, f".ci/run does not run the README's test command:\n{command}"
    # Last, so that CI's output ends with the whole suite's summary.
    lines = [line for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[-1].strip() == command, f".ci/run's last command is not the README's test command:\n{lines[-1]}"
