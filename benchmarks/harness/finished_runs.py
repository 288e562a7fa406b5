"""The runs an experiment has finished, kept for its result when a later run
or the final analysis fails: `FinishedRuns` and the `Incomplete` it raises.

Note [Finished runs are written]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An experiment made of several long runs (recovery's take minutes each)
computes its figures at the end. A failure there, or in a later run, must not
lose the runs already finished. Such an experiment keeps each run in a
FinishedRuns as it finishes and, on any failure, raises
`finished.incomplete(error)`: an Incomplete that carries the runs and names
what could not be measured (each run not finished, and the figures). The
runner (benchmarks/runner.py) writes them to OUT/<name>.incomplete.json, with
their series beside it as in any result (Note [Results stored once] in
benchmarks/reporting/results.py), prints what is missing, and fails with the
error. The name leaves a complete <name>.json of an earlier run in place, and
out of the report.

A figure that finished runs did not yield, with nothing failing, is no
failure: the result is written as usual with that figure None, and the
payload's `not_measured` maps its name to why; the runner prints those too.
"""

from typing import Dict, Iterable


class Incomplete(Exception):
    """An experiment's finished runs (name -> run) and what it could not measure (name -> why)."""

    def __init__(self, runs: Dict[str, object], not_measured: Dict[str, str]):
        super().__init__("not measured: " + "; ".join(f"{name} ({why})" for name, why in not_measured.items()))
        self.runs = runs
        self.not_measured = not_measured


class FinishedRuns:
    """The runs of an experiment, by name, as they finish."""

    def __init__(self, expected: Iterable[str]):
        self._expected = list(expected)
        self._runs: Dict[str, object] = {}

    def keep(self, name: str, run):
        """Records `run` as finished; returns it."""
        if name not in self._expected:
            raise ValueError(f"{name!r} is not one of the runs expected: {self._expected}")
        self._runs[name] = run
        return run

    @property
    def runs(self) -> Dict[str, object]:
        return dict(self._runs)

    def incomplete(self, error: BaseException) -> Incomplete:
        """The Incomplete to raise after `error`: the runs finished, and what is missing."""
        why = f"{type(error).__name__}: {error}"
        missing = {name: f"not run: {why}" for name in self._expected if name not in self._runs}
        missing["figures"] = f"not computed: {why}"
        return Incomplete(self.runs, missing)
