"""Two fake hosts for a test: network namespaces joined by a veth pair
(benchmarks/harness/fake_hosts.py), or the test skipped saying why."""

import contextlib
import subprocess

import pytest

from benchmarks.harness import fake_hosts


@contextlib.contextmanager
def two_hosts(what: str, tag: str):
    """Yields [host A, host B]; skips `what` where namespaces cannot be made."""
    reason = fake_hosts.cannot_make_namespaces()
    if reason:
        pytest.skip(f"{what}: {reason}")
    try:
        made = fake_hosts.fake_hosts(2, tag)
        pair = made.__enter__()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        pytest.skip(f"{what}: cannot create network namespaces joined by a veth pair: {detail}")
    try:
        yield pair
    finally:
        made.__exit__(None, None, None)
