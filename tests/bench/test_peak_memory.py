"""The held peak of an iteration when another thread frees a tensor unseen
by the profiler (as Gloo's threads do): the least over several iterations."""

import threading

import pytest
import torch

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.harness import peak_memory  # noqa: E402

MIB = 1 << 20


def _build_with_a_ghost_in(iteration: int):
    """A step holding 1 MiB, taking 2 MiB more during each call; in call
    `iteration` it also takes 4 MiB that a thread of its own frees."""
    def build():
        kept = torch.zeros(MIB // 4)
        calls = [0]

        def step():
            calls[0] += 1
            scratch = torch.zeros(2 * MIB // 4)
            if calls[0] == iteration:
                held = [torch.zeros(4 * MIB // 4)]
                thread = threading.Thread(target=held.clear)
                thread.start()
                thread.join()
            return kept.sum() + scratch.sum()
        return step
    return build


def test_a_tensor_freed_unseen_counts_in_its_iteration_only_when_measured_alone():
    ghostly = peak_memory.held_peak_bytes(_build_with_a_ghost_in(4), before=3, measured=1)
    assert ghostly >= 7 * MIB  # 1 held, 2 scratch, 4 never seen freed
    least = peak_memory.held_peak_bytes(_build_with_a_ghost_in(6), before=3, measured=3)
    assert 3 * MIB <= least < 4 * MIB
