"""`python -m benchmarks` without the `bench` extra: --help works, and a run
says which extra to install and exits non-zero, without a traceback."""

import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.harness import extra

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs `python -m benchmarks ARGS` with the extra's packages made unimportable.
_WITHOUT_EXTRA = textwrap.dedent(
    """
    import runpy, sys
    HIDDEN = {hidden!r}
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Hide())
    sys.argv = ["benchmarks", *{args!r}]
    runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    """
)


def _bench_without(hidden, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code = _WITHOUT_EXTRA.format(hidden=sorted(hidden), args=list(args))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_help_works_without_the_extra():
    done = _bench_without(extra.REQUIREMENTS, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m benchmarks" in done.stdout and "compare" in done.stdout
    assert extra.INSTALL_COMMAND in " ".join(done.stdout.split()), done.stdout


@pytest.mark.parametrize("hidden", [["matplotlib"], sorted(extra.REQUIREMENTS)], ids=["one", "all"])
def test_run_without_the_extra_names_it_and_fails(hidden):
    done = _bench_without(hidden, "compare", "--quick")
    assert done.returncode != 0
    assert extra.INSTALL_COMMAND in done.stderr, done.stderr
    for module in hidden:
        assert extra.REQUIREMENTS[module] in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_extra_lists_what_pyproject_lists():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        bench = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    names = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip() for r in bench)
    assert names == sorted(extra.REQUIREMENTS.values())


def test_the_old_command_says_where_the_benchmarks_went(tmp_path):
    # Run outside the checkout: the installed package alone answers.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "ddp_ext.bench", "compare", "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "python -m benchmarks compare --quick" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
