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
