"""A fault-tolerant sync's exchange, each host's ranks sending a share of
their host's payload (Note [DiLoCo shares a host's exchange under fault
tolerance]): the same bits as every member all-gathering its whole payload,
with as many times fewer bytes across hosts as a host has members, in
quorums of several orders, with a host that did not train, and falling
back to the whole exchange where the split does not hold. Four ranks over
a Gloo group made as a replica makes its quorum's (tests/diloco/
quorum_workers.py); the real runs, hosts killed, are in
test_diloco_survival.py."""

import pytest
import torch

from ddp_ext.diloco.quorum_exchange import Contribution, host_shares
from tests.diloco import quorum_workers
from tests.support.worlds import shared_world

BOTH_TRAINED = ("a", "b")


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("members, trained", [
    (("a/0", "a/1", "b/0", "b/1"), BOTH_TRAINED),
    (("b/1", "a/0", "b/0", "a/1"), BOTH_TRAINED),  # hosts interleaved, ranks out of order
    (("a/0", "b/0", "a/1", "b/1"), ("a",)),  # b joins: zeros stand for it, the mean over a alone
])
def test_shared_exchange_has_the_bits_of_the_whole_one_with_half_the_bytes(members, trained, bits):
    results = shared_world(4).run(quorum_workers.exchange, members, bits, trained)
    first_whole = results[0][0]
    for whole, whole_bytes, shared, shared_bytes, split in results:
        assert split
        assert torch.equal(whole, first_whole)  # every rank the same bits
        assert torch.equal(shared, whole)
    for rank, (_, whole_bytes, _, shared_bytes, _) in enumerate(results):
        if members[rank][0] not in trained:
            assert shared_bytes == 0  # a joiner's zeros are known: not sent
            continue
        assert whole_bytes > 0
        # the host's two members send two parts that add up to one payload
        # (8 and 4 bits: each part its chunks' scales)
        mate = next(i for i, m in enumerate(members) if m[0] == members[rank][0] and i != rank)
        assert shared_bytes + results[mate][3] == whole_bytes
        assert 0.4 * whole_bytes < shared_bytes < 0.6 * whole_bytes
    assert not torch.equal(first_whole, torch.zeros_like(first_whole))


def test_a_member_that_asks_for_no_split_makes_every_member_exchange_whole():
    results = shared_world(4).run(quorum_workers.exchange, ("a/0", "a/1", "b/0", "b/1"), 8, BOTH_TRAINED, False)
    assert [split for *_, split in results] == [False] * 4
    assert all(torch.equal(whole, results[0][0]) for whole, *_ in results)


def test_host_shares_hold_only_for_hosts_of_equal_size_and_part():
    trained, joined = Contribution(True, True), Contribution(False, True)
    shares = host_shares(("b/1", "a/0", "b/0", "a/1"), [trained] * 4)
    assert (shares.host, shares.part, shares.parts) == ((0, 1, 0, 1), (0, 0, 1, 1), 2)
    assert host_shares(("a/0", "a/1", "b/0"), [trained] * 3) is None  # b lost a rank
    assert host_shares(("a/0", "b/0"), [trained] * 2) is None  # one rank per host: nothing to share
    assert host_shares(("a/0", "a/1", "b/0", "b/1"), [trained, joined, trained, trained]) is None
    assert host_shares(("a/0", "a/1", "b/0", "b/1"), [trained, trained, joined, joined]) is not None
    assert host_shares(("a/0", "a/1"), [trained, Contribution(True, False)]) is None
    assert host_shares(("x/y/0", "x/y/1"), [trained] * 2).parts == 2  # names are split at the last '/'
