"""The shared-world helper: jobs reuse the same ranks, and a failed job ends
its world so that the next job gets a fresh one."""

import os

import pytest

from tests.support.spawn import RanksFailed
from tests.support.worlds import shared_world


def _pid_and_group_size(rank, world_size):
    import torch.distributed as dist

    return os.getpid(), dist.get_world_size(), rank


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def test_jobs_share_ranks_until_one_fails():
    first = shared_world(2).run(_pid_and_group_size)
    second = shared_world(2).run(_pid_and_group_size)
    assert [r for _, _, r in first] == [0, 1] and all(size == 2 for _, size, _ in first)
    assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second], "the second job started new ranks"

    with pytest.raises(RanksFailed, match="rank 1 fails on purpose"):
        shared_world(2).run(_fail_on_rank_1)
    third = shared_world(2).run(_pid_and_group_size)
    assert not {pid for pid, _, _ in third} & {pid for pid, _, _ in first}, "a failed job left its world running"
