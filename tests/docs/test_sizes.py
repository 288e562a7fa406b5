"""Size bounds: the files that grew into everything once stay small enough
to read (the Reducer's core, the wrapper, the README)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BOUNDS = {
    "reducer/core/reducer.cpp": 500,
    "reducer/core/reducer.h": 250,
    "ddp_ext/distributed.py": 450,
    "README.md": 200,
}


@pytest.mark.parametrize("path,bound", sorted(BOUNDS.items()))
def test_file_stays_within_its_bound(path, bound):
    with open(os.path.join(ROOT, path)) as f:
        lines = len(f.read().splitlines())
    assert 0 < lines <= bound, f"{path} has {lines} lines; its bound is {bound}: split it by concern"
