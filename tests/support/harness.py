"""Runs a table of cases in one job per world size, and the checks the
parity tests share.

Starting ranks is expensive (each imports torch), so a test module runs all
its cases for one world size as a single job on the session's shared world
(tests/support/worlds.py), or on fresh ranks (`run_ranks`) for tables whose cases
must not share a world with other modules: every rank loops over the cases,
recording each case's return value or traceback, and the parametrized tests
then look their case up. A case that fails on every rank alike (an
exception) does not disturb the others; a hang fails the whole job, with
every rank's traceback, when its time limit expires.
"""

import io
import traceback
from typing import Any, Callable, Dict, List, Sequence

import torch

from tests.support.spawn import RanksFailed, run_ranks
from tests.support.worlds import shared_world


def _run_cases(rank: int, world_size: int, case_fn: Callable, cases: Sequence[Any]) -> Dict[str, Any]:
    results = {}
    for c in cases:
        try:
            payload = io.BytesIO()
            torch.save(case_fn(rank, world_size, c), payload)
            results[c.id] = (True, payload.getvalue())
        except Exception:
            results[c.id] = (False, traceback.format_exc())
    return results


class CaseTable:
    """`case_fn(rank, world_size, case)` over `cases`, run lazily once per world
    size. case_fn must be a module-level function; cases need an `id`.
    `isolated=True` runs them on fresh ranks instead of the shared world (for
    cases that time out process groups on purpose, or may leave ranks
    disagreeing). `backend` other than "gloo" (the shared worlds') needs
    isolated=True."""

    def __init__(
        self, case_fn: Callable, cases: Sequence[Any], timeout: float = 240.0, isolated: bool = False,
        backend: str = "gloo",
    ):
        ids = [c.id for c in cases]
        assert len(set(ids)) == len(ids), f"duplicate case ids in {ids}"
        assert isolated or backend == "gloo", "shared worlds run Gloo; pass isolated=True for another backend"
        self.backend = backend
        self.case_fn = case_fn
        self.cases = list(cases)
        self.timeout = timeout
        self.isolated = isolated
        self._runs: Dict[int, Any] = {}

    def results(self, world_size: int, c: Any) -> List[Any]:
        """Every rank's return value for case `c`; fails the test with every
        rank's traceback if the case raised anywhere."""
        if world_size not in self._runs:
            try:
                if self.isolated:
                    run = run_ranks(
                        _run_cases, world_size, self.case_fn, self.cases, timeout=self.timeout, backend=self.backend
                    )
                else:
                    run = shared_world(world_size).run(_run_cases, self.case_fn, self.cases, timeout=self.timeout)
                self._runs[world_size] = run
            except RanksFailed as failure:
                self._runs[world_size] = failure
        run = self._runs[world_size]
        if isinstance(run, RanksFailed):
            raise RanksFailed(f"the job of all cases at world size {world_size} failed:\n{run}")
        per_rank = [by_case[c.id] for by_case in run]
        failed = [f"--- rank {r} ---\n{value}" for r, (ok, value) in enumerate(per_rank) if not ok]
        if failed:
            raise RanksFailed(f"case {c.id} raised at world size {world_size}:\n" + "\n".join(failed))
        return [torch.load(io.BytesIO(value), weights_only=False) for _, value in per_rank]


# --- Comparisons ---------------------------------------------------------------

# Tolerances for "equal up to floating-point rounding" after a few optimizer
# steps, by the least precise dtype involved.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
}

State = Dict[str, torch.Tensor]


def tolerance(*states: State) -> Dict[str, float]:
    dtypes = {t.dtype for state in states for t in state.values() if t.is_floating_point()}
    if not dtypes:
        return dict(rtol=0, atol=0)
    least_precise = min(dtypes, key=lambda d: d.itemsize)
    return TOLERANCES[least_precise]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN equals NaN, -0.0 differs from 0.0)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_states_bitwise(actual: State, expected: State, what: str) -> None:
    """Same names, and every tensor the same bits (same_bits)."""
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}"
    differ = [name for name in expected if not same_bits(actual[name], expected[name])]
    assert not differ, f"{what}: not bitwise equal: {differ}"


def assert_states_close(actual: State, expected: State, what: str, **tol) -> None:
    """Same names, and every tensor equal up to rounding (exactly for integers)."""
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}"
    tol = tol or tolerance(actual, expected)
    for name in expected:
        a, e = actual[name], expected[name]
        exact = not e.is_floating_point()
        torch.testing.assert_close(
            a,
            e,
            rtol=0 if exact else tol["rtol"],
            atol=0 if exact else tol["atol"],
            msg=lambda m, name=name: f"{what}: `{name}` differs:\n{m}",
        )


def assert_grad_layout_kept(traces: List[Dict[str, Any]], what: str) -> None:
    """On every rank, after every step, each .grad strided like its parameter."""
    for rank, t in enumerate(traces):
        off = t["grads_off_layout"]
        assert not off, f"{what}: rank {rank}: .grad strided unlike the parameter for {off}"


def assert_same_on_every_rank(traces: List[Dict[str, Any]], what: str) -> None:
    """Parameters bitwise identical on every rank."""
    digests = [t["digest"] for t in traces]
    if len(set(digests)) != 1:
        diffs = []
        for rank, t in enumerate(traces[1:], start=1):
            for name, a in t["params"].items():
                b = traces[0]["params"][name]
                if not same_bits(a, b):
                    diffs.append(f"rank {rank} `{name}` max |diff| {(a - b).abs().max().item()}")
        raise AssertionError(f"{what}: parameters differ between ranks: {digests}\n" + "\n".join(diffs))
