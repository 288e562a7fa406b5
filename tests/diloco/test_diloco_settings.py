"""Bad settings raise at construction, on every rank, without a hang."""

import pytest

from tests.diloco import workers
from tests.support.worlds import shared_world

CASES = {
    "sync_every_below_fragments": "every rank: sync_every=1 < fragments=2",
    "delay_too_long": "every rank: delay=2 >= sync_every/fragments=4/2",
    "outer_optimizer_over_other_parameters": "outer_optimizer must build its optimizer over the parameters",
    "unequal_groups": "inner groups have unequal sizes [1, 3]",
    "outer_group_within_a_host": "outer group [0, 1] does not hold exactly one rank of each of the 2 inner groups",
    "delay_too_long_on_rank_0": "rank 0: delay=4 >= sync_every/fragments=4/1",
    "settings_differ_on_rank_3": "rank 3 has settings=",
    "fault_tolerance_with_outer_group": "with fault_tolerance the coordinator makes the outer groups",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_setting_raises_on_every_rank(case):
    messages = shared_world(4).run(workers.construct, case, timeout=60)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith("DiLoCo: ") and CASES[case] in message, message
