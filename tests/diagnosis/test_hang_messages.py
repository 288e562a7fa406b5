"""The text of a hang report (ddp_ext/_diagnosis/messages.py): ranks
waiting for the same collective are in step and merely slow; ranks waiting
for different ones ran different collectives; a dead rank is named before
what its death caused on the others."""

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


def test_a_dead_rank_is_named_before_a_survivor_whose_backward_it_cut_short():
    # Rank 2 died mid-backward; rank 1, its neighbour on a ring of sends, failed
    # in its own backward and reported parameters without a gradient. The
    # death is the cause, so rank 0's message names rank 2 first.
    own = dict(rank=0, kind="failed", step=2, waiting_for="bucket", bucket=1, error="connection closed",
               waited_s=0.3)
    cut_short = dict(rank=1, kind="unfinished", step=2, unready=["fc0.weight"], unready_buckets=[2],
                     buckets_launched=2, buckets_total=3)
    message = hang_message(own, {1: cut_short, 2: None}, timeout_s=60.0, window_s=1.0, alive={1: True, 2: False})
    assert message.startswith("DistributedDataParallel: rank 2 died during training step 2: on rank 0"), message
    assert "left parameters without a gradient" not in message, message
    assert "rank 1: its backward of training step 2 ended with no gradient for fc0.weight" in message, message
    # Without the death, the unfinished backward is what the message names.
    message = hang_message(own, {1: cut_short}, timeout_s=60.0, window_s=1.0, alive={1: True})
    assert message.startswith("DistributedDataParallel: rank 1 left parameters without a gradient"), message
