"""Runs the C++ unit tests (tests/cpp/*_test.cpp, GoogleTest) as one pytest
test: builds the executable where anything changed (tests/cpp/build.py), runs
it, and names every failed C++ test with its message."""

import json
import subprocess

import pytest

from tests.cpp import build

# Fewer than this many C++ tests run means the build lost some.
MIN_TESTS = 25


def test_cpp_units(tmp_path):
    missing = build.gtest_missing()
    if missing is not None:
        pytest.skip(missing)
    executable = build.build()
    report = tmp_path / "gtest.json"
    run = subprocess.run(
        [executable, f"--gtest_output=json:{report}"], capture_output=True, text=True, timeout=300
    )
    assert report.exists(), f"the C++ tests wrote no report (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    results = json.loads(report.read_text())
    failed = [
        f"{suite['name']}.{case['name']}:\n" + "\n".join(f["failure"] for f in case.get("failures", []))
        for suite in results["testsuites"]
        for case in suite["testsuite"]
        if case.get("failures")
    ]
    assert not failed, "C++ tests failed:\n" + "\n\n".join(failed)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert results["tests"] >= MIN_TESTS, f"only {results['tests']} C++ tests ran"
