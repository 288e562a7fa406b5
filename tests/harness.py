"""Runs a table of cases in one spawned run per world size, and the checks the
parity tests share.

Starting ranks is expensive (each imports torch), so a test module runs all
its cases for one world size inside a single `run_ranks` call: every rank
loops over the cases, recording each case's return value or traceback, and
the parametrized tests then look their case up. A case that fails on every
rank alike (an exception) does not disturb the others; a hang fails the
whole run, with every rank's traceback, when run_ranks' time limit expires.
"""

import traceback
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
import torch

from tests.spawn import RanksFailed, run_ranks


def _run_cases(rank: int, world_size: int, case_fn: Callable, cases: Sequence[Any]) -> Dict[str, Any]:
    results = {}
    for c in cases:
        try:
            results[c.id] = (True, case_fn(rank, world_size, c))
        except Exception:
            results[c.id] = (False, traceback.format_exc())
    return results


class CaseTable:
    """`case_fn(rank, world_size, case)` over `cases`, run lazily once per world
    size. case_fn must be a module-level function; cases need an `id`."""

    def __init__(self, case_fn: Callable, cases: Sequence[Any], timeout: float = 240.0):
        ids = [c.id for c in cases]
        assert len(set(ids)) == len(ids), f"duplicate case ids in {ids}"
        self.case_fn = case_fn
        self.cases = list(cases)
        self.timeout = timeout
        self._runs: Dict[int, Any] = {}

    def results(self, world_size: int, c: Any) -> List[Any]:
        """Every rank's return value for case `c`; fails the test with every
        rank's traceback if the case raised anywhere."""
        if world_size not in self._runs:
            try:
                self._runs[world_size] = run_ranks(
                    _run_cases, world_size, self.case_fn, self.cases, timeout=self.timeout
                )
            except RanksFailed as failure:
                self._runs[world_size] = failure
        run = self._runs[world_size]
        if isinstance(run, RanksFailed):
            raise RanksFailed(f"the spawned run of all cases at world size {world_size} failed:\n{run}")
        per_rank = [by_case[c.id] for by_case in run]
        failed = [f"--- rank {r} ---\n{value}" for r, (ok, value) in enumerate(per_rank) if not ok]
        if failed:
            raise RanksFailed(f"case {c.id} raised at world size {world_size}:\n" + "\n".join(failed))
        return [value for _, value in per_rank]


# --- Comparisons ---------------------------------------------------------------

# Tolerances for "equal up to floating-point rounding" after a few optimizer
# steps, by the least precise dtype involved.
TOLERANCES = {
    np.dtype(np.float32): dict(rtol=1e-5, atol=1e-6),
    np.dtype(np.float64): dict(rtol=1e-10, atol=1e-12),
}


def tolerance(*states: Dict[str, np.ndarray]) -> Dict[str, float]:
    dtypes = {a.dtype for state in states for a in state.values() if a.dtype.kind == "f"}
    if not dtypes:
        return dict(rtol=0, atol=0)
    least_precise = min(dtypes, key=lambda d: d.itemsize)
    return TOLERANCES[least_precise]


def assert_states_close(actual: Dict[str, np.ndarray], expected: Dict[str, np.ndarray], what: str, **tol) -> None:
    """Same names, and every array equal up to rounding (exactly for integers)."""
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}"
    tol = tol or tolerance(actual, expected)
    for name in expected:
        a, e = torch.from_numpy(actual[name]), torch.from_numpy(expected[name])
        exact = not e.is_floating_point()
        torch.testing.assert_close(
            a,
            e,
            rtol=0 if exact else tol["rtol"],
            atol=0 if exact else tol["atol"],
            msg=lambda m, name=name: f"{what}: `{name}` differs:\n{m}",
        )


def assert_same_on_every_rank(traces: List[Dict[str, Any]], what: str) -> None:
    """Parameters bitwise identical on every rank; and, on every rank, each
    .grad strided like its parameter after every step."""
    for rank, t in enumerate(traces):
        off = t.get("grads_off_layout", [])
        assert not off, f"{what}: rank {rank}: .grad strided unlike the parameter for {off}"
    digests = [t["digest"] for t in traces]
    if len(set(digests)) != 1:
        diffs = []
        for rank, t in enumerate(traces[1:], start=1):
            for name, a in t["params"].items():
                if a.tobytes() != traces[0]["params"][name].tobytes():
                    diffs.append(f"rank {rank} `{name}` max |diff| {np.abs(a - traces[0]['params'][name]).max()}")
        raise AssertionError(f"{what}: parameters differ between ranks: {digests}\n" + "\n".join(diffs))
