"""The text of a hang report when every rank reported and none is proven
gone or finished (ddp_ext/_diagnosis/messages.py): ranks waiting for the
same collective are in step and merely slow; ranks waiting for different
ones ran different collectives."""

from ddp_ext._diagnosis.messages import hang_message, proven


def stalled(rank: int, bucket: int, step: int = 4, waited_s: float = 1.2) -> dict:
    return dict(rank=rank, kind="stalled", step=step, waiting_for="bucket", bucket=bucket, waited_s=waited_s,
                buckets_launched=2, buckets_total=2)


def test_ranks_waiting_for_the_same_collective_are_called_slow_not_mismatched():
    own = stalled(1, bucket=0)
    message = hang_message(own, {0: stalled(0, bucket=0, waited_s=0.4)}, timeout_s=1.0, window_s=0.5)
    assert message.startswith("DistributedDataParallel: every rank is waiting for the allreduce of bucket 0 at "
                              "the end of the backward of training step 4 (this is rank 1"), message
    assert "slow rather than mismatched" in message and "do not pair up" not in message, message
    assert not proven(own, {0: stalled(0, bucket=0)})


def test_ranks_waiting_for_different_collectives_do_not_pair_up():
    own = stalled(1, bucket=0)
    for other in (stalled(0, bucket=1), stalled(0, bucket=0, step=5)):
        message = hang_message(own, {0: other}, timeout_s=1.0, window_s=0.5)
        assert "their collectives do not pair up in training step 4" in message, message
        assert "slow rather than mismatched" not in message, message


def test_a_rank_still_reporting_the_step_before_is_named_as_not_there_yet():
    # Rank 0's last report is a wait of step 3, which rank 1 has left: rank 0
    # is late for step 4 (or stuck in step 3), not waiting for another
    # collective of step 4.
    own = stalled(1, bucket=0, step=4)
    message = hang_message(own, {0: stalled(0, bucket=0, step=3, waited_s=2.5)}, timeout_s=1.0, window_s=0.5)
    assert message.startswith("DistributedDataParallel: rank 0 did not reach the end of the backward of training "
                              "step 4: rank 1 has waited 1.2 s"), message
    assert "rank 0 last reported a wait in training step 3" in message, message
    assert "do not pair up" not in message and "slow rather than mismatched" not in message, message
    assert not proven(own, {0: stalled(0, bucket=0, step=3)})
