"""DiLoCo in four ranks as two hosts of two, against references."""

import pytest
import torch

from tests.diloco import workers
from tests.support.worlds import shared_world

STEPS = 8


def _close(actual, expected, atol):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


def test_sync_every_step_with_plain_outer_sgd_is_local_sgd():
    # H = 1, outer SGD at lr 1 without momentum, one fragment, no delay, 32
    # bits: after each step the parameters become the hosts' mean, computed
    # here by hand. Not bitwise: DDP averages two ranks' mean gradients where
    # the reference takes one mean over the concatenated batch, and the outer
    # step computes synced - mean(synced - live) where the reference takes
    # mean(live); each rounds a few float32 ulps per step (values ~0.3, ulp
    # ~3e-8), so 1e-6 over 8 steps.
    # The groups are passed explicitly here (derived in the other tests).
    diloco = dict(sync_every=1, outer_optimizer=workers.plain_outer_sgd, explicit_groups=True)
    results = shared_world(4).run(workers.train, STEPS, "sgd", diloco)
    expected = workers.local_sgd_reference(STEPS, average=True)[0]
    for live, glob, _, _ in results:
        _close(live, expected, atol=1e-6)
        _close(glob, expected, atol=1e-6)
    # and differs from training without averaging, so the check could fail
    apart = workers.local_sgd_reference(STEPS, average=False)[0]
    assert max((a - e).abs().max().item() for a, e in zip(apart, expected)) > 1e-3


def test_no_outer_step_is_independent_training_per_host():
    # sync_every beyond the run: no fragment is ever launched; each host
    # trains as plain DDP over its ranks would, bit for bit, and as the
    # reference's independent training does, to rounding (see above).
    results = shared_world(4).run(workers.train_plain_and_diloco, STEPS, dict(sync_every=STEPS + 1))
    references = workers.local_sgd_reference(STEPS, average=False)
    for rank, (plain, diloco) in enumerate(results):
        for p, d in zip(plain, diloco, strict=True):
            assert torch.equal(p, d)
        _close(diloco, references[rank // workers.RANKS_PER_HOST], atol=1e-6)
    assert not torch.equal(results[0][1][0], results[2][1][0])  # the hosts did train apart


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_streaming_fragments_agree_on_global_parameters(bits):
    # F = 2 fragments, tau = 1, H = 4: fragment 0 launches at steps 2, 6, ...
    # 22, fragment 1 at 4, 8, ... 24 (in flight at the end), each merged a
    # step later with mix 0.5.
    diloco = dict(sync_every=4, fragments=2, delay=1, bits=bits)
    results = shared_world(4).run(workers.train, 24, "adamw", diloco)
    lives, globs = [r[0] for r in results], [r[1] for r in results]
    for glob in globs[1:]:
        for a, b in zip(globs[0], glob, strict=True):
            assert torch.equal(a, b)
    for host in (0, 2):  # DDP keeps a host's ranks equal
        for a, b in zip(lives[host], lives[host + 1], strict=True):
            assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(lives[0], lives[2]))  # hosts differ between syncs
    initial = list(workers.build_model().parameters())
    assert all(not torch.equal(g, p) for g, p in zip(globs[0], initial))  # every fragment was synced
    losses = results[0][2]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])
    numel = sum(p.numel() for p in initial)
    # Six launches of each fragment: every element sent six times by one of
    # its host's ranks, in 4 bytes, 1 or 1/2 (plus scales). In 32 bits the
    # two ranks send about half each; in 8 and 4 bits a fragment (about 133
    # elements) is one chunk of 1024, which is not cut: rank 0 sends it all.
    host_bytes = results[0][3] + results[1][3]
    if bits == 32:
        assert host_bytes == 6 * numel * 4
        assert results[0][3] > 0 and results[1][3] > 0
    else:
        assert 6 * numel * bits / 8 <= host_bytes < 6 * numel * bits / 8 * 1.1
        assert results[1][3] == 0


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_split_within_host_halves_bytes_and_keeps_the_bits(bits):
    # The same run with each host's two ranks exchanging half of each
    # fragment (the default) and with both exchanging all of it: every
    # element's mean adds the same two hosts' values in the same order,
    # and a part of a payload is the payload of its chunks alone, so the
    # parameters are bitwise equal; the bytes a host sends across hosts are
    # exactly half (chunks of 16 elements, so the 8- and 4-bit fragments
    # are cut too).
    diloco = dict(sync_every=4, fragments=2, delay=1, bits=bits, int8_chunk=16)
    results = shared_world(4).run(workers.train_split_and_whole, 24, "adamw", diloco)
    for split, whole in results:
        for a, b in zip(split[0] + split[1], whole[0] + whole[1], strict=True):
            assert torch.equal(a, b)
        assert split[2] == whole[2]  # the losses, step by step
    for host in (0, 2):
        split_bytes = [results[host + i][0][3] for i in range(2)]
        whole_bytes = [results[host + i][1][3] for i in range(2)]
        assert whole_bytes[0] == whole_bytes[1] > 0
        assert 2 * sum(split_bytes) == sum(whole_bytes)
        assert all(0.4 * whole_bytes[0] < b < 0.6 * whole_bytes[0] for b in split_bytes)
    # and the runs did sync: the global parameters moved from the start
    initial = list(workers.build_model().parameters())
    assert all(not torch.equal(g, p) for g, p in zip(results[0][0][1], initial))


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_checkpoint_mid_run_resumes_bit_for_bit(bits):
    # Saved after step 6, while fragment 0's exchange (launched at step 6)
    # is in flight; AdamW inside, Nesterov SGD outside.
    diloco = dict(sync_every=4, fragments=2, delay=1, bits=bits)
    results = shared_world(4).run(workers.checkpoint_and_resume, 12, 6, "adamw", diloco)
    for uninterrupted, resumed in results:
        for a, b in zip(uninterrupted[0] + uninterrupted[1], resumed[0] + resumed[1], strict=True):
            assert torch.equal(a, b)
