"""DiLoCo's pure parts, in one process: the schedule, the fragments, the
settings' checks, 8- and 4-bit error feedback and cutting a payload
among a host's ranks."""

import pytest
import torch

from ddp_ext.diloco.fragments import split
from ddp_ext.diloco.host_split import HostSplit, parts_by_rank
from ddp_ext.diloco.int4 import LEVELS, SMALLEST, Int4ErrorFeedback
from ddp_ext.diloco.int8 import ErrorFeedback
from ddp_ext.diloco.schedule import Schedule
from ddp_ext.diloco.settings import Settings, default_mix


def _settings(sync_every, fragments=1, delay=0, bits=32, mix=1.0, int8_chunk=1024):
    return Settings(sync_every, fragments, delay, bits, mix, int8_chunk)


def _launches(schedule, steps):
    return {step: schedule.launches_at(step) for step in range(1, steps + 1) if schedule.launches_at(step)}


def test_schedule_spreads_fragments_over_each_window():
    assert _launches(Schedule(_settings(1)), 3) == {1: [0], 2: [0], 3: [0]}
    assert _launches(Schedule(_settings(4)), 9) == {4: [0], 8: [0]}
    assert _launches(Schedule(_settings(4, 2, 1)), 9) == {2: [0], 4: [1], 6: [0], 8: [1]}
    assert _launches(Schedule(_settings(5, 2)), 10) == {2: [0], 5: [1], 7: [0], 10: [1]}
    assert _launches(Schedule(_settings(3, 3)), 6) == {1: [0], 2: [1], 3: [2], 4: [0], 5: [1], 6: [2]}
    assert Schedule(_settings(4, 2, 1)).merge_step(6) == 7


@pytest.mark.parametrize("sync_every, fragments", [(1, 1), (4, 1), (4, 2), (5, 2), (3, 3), (25, 2), (7, 4)])
def test_next_event_is_the_first_later_launch_or_merge(sync_every, fragments):
    schedule = Schedule(_settings(sync_every, fragments))
    launches = _launches(schedule, 5 * sync_every)
    for step in range(0, 3 * sync_every):
        first_launch = min(t for t in launches if t > step)
        assert schedule.next_launch(step) == first_launch
        assert schedule.next_event(step, []) == first_launch
        assert schedule.next_event(step, [step + 1]) == step + 1


@pytest.mark.parametrize("args, problem", [
    ((1, 2), "sync_every=1 < fragments=2"),
    ((4, 2, 2), "delay=2 >= sync_every/fragments=4/2"),
    ((4, 1, 4), "delay=4 >= sync_every/fragments=4/1"),
    ((0,), "sync_every must be an integer >= 1"),
    ((4, 1, 0, 16), "bits must be one of (4, 8, 32)"),
    ((4, 1, 0, 32, 0.0), "mix must be a number in (0, 1]"),
])
def test_settings_problems(args, problem):
    problems = _settings(*args).problems()
    assert len(problems) == 1 and problem in problems[0], problems


def test_settings_accept_the_limits():
    assert _settings(4, 4).problems() == []
    assert _settings(5, 2, 2).problems() == []
    assert default_mix(0, None) == 1.0 and default_mix(1, None) == 0.5 and default_mix(1, 0.8) == 0.8


def test_fragments_are_consecutive_and_balanced():
    sizes = [10, 1, 1, 1, 100, 5]
    params = [torch.zeros(n) for n in sizes]
    assert split(params, 1) == [[0, 1, 2, 3, 4, 5]]
    assert split(params, 2) == [[0, 1, 2, 3], [4, 5]]
    assert split(params, 6) == [[0], [1], [2], [3], [4], [5]]
    # a large first parameter leaves each later one its own run
    assert split([torch.zeros(n) for n in [100, 1, 1, 1]], 3) == [[0], [1], [2, 3]]
    equal = split([torch.zeros(8) for _ in range(8)], 4)
    assert equal == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="fewer than fragments=3"):
        split(params[:2], 3)


def test_error_feedback_makes_the_sum_sent_track_the_true_sum():
    gen = torch.Generator().manual_seed(0)
    numel, chunk, syncs = 3000, 256, 40
    with_feedback = ErrorFeedback(numel, chunk)
    true_sum = torch.zeros(numel, dtype=torch.float64)
    sent_sum = torch.zeros(numel, dtype=torch.float64)
    plain_sum = torch.zeros(numel, dtype=torch.float64)
    for _ in range(syncs):
        values = torch.randn(numel, generator=gen) * 1e-2
        true_sum += values.double()
        sent_sum += with_feedback.decode_mean([with_feedback.encode(values)]).double()
        # without feedback: a fresh encoder every time
        once = ErrorFeedback(numel, chunk)
        plain_sum += once.decode_mean([once.encode(values)]).double()
    feedback_error = (true_sum - sent_sum).abs()
    # What is owed is exactly the residual (to float32 rounding of the sums) ...
    torch.testing.assert_close(true_sum - sent_sum, with_feedback.residual.double(), rtol=0, atol=1e-6)
    # ... at most half a scale step, a step being at most (largest |value + residual|) / 127 < 0.05 / 127.
    assert feedback_error.max().item() <= 0.5 * 0.05 / 127
    # Without feedback the rounding errors add up over the syncs.
    plain_error = (true_sum - plain_sum).abs()
    assert plain_error.mean().item() > 3 * feedback_error.mean().item()


def test_error_feedback_stays_finite_when_a_chunk_gets_only_zeros():
    # Each sync re-encodes what the last one missed, about 254 times smaller:
    # within 20 syncs a chunk whose values stay zero (embedding rows no batch
    # uses) reaches magnitudes whose scale is no normal float.
    codec = ErrorFeedback(2048, 1024)
    first = torch.randn(2048, generator=torch.Generator().manual_seed(0)) * 1e-5
    first[1024:] = 1.0
    means = [codec.decode_mean([codec.encode(first)])]
    for _ in range(20):
        means.append(codec.decode_mean([codec.encode(torch.zeros(2048))]))
    assert torch.isfinite(codec.residual).all() and all(torch.isfinite(m).all() for m in means)
    sent = torch.stack(means).double().sum(0)
    torch.testing.assert_close(sent + codec.residual.double(), first.double(), rtol=0, atol=1e-12)


def test_error_feedback_mean_is_in_payload_order_and_exact_for_codes():
    codec = ErrorFeedback(4, 4)
    a = codec.encode(torch.tensor([127.0, -127.0, 0.0, 1.0]))
    b = ErrorFeedback(4, 4).encode(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert codec.residual.abs().max().item() == 0  # these values are codes times a scale of 1
    assert torch.equal(codec.decode_mean([a, b]), torch.tensor([64.0, -63.0, 0.5, 1.0]))


def test_int4_round_trip_is_within_half_a_step_and_packs_two_a_byte():
    gen = torch.Generator().manual_seed(1)
    numel, chunk = 1001, 100  # an odd count, and a last chunk of one element
    codec = Int4ErrorFeedback(numel, chunk)
    values = torch.randn(numel, generator=gen)
    values[200:300] = 0.0  # a chunk of zeros
    payload = codec.encode(values)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes == 4 * 11 + 1002 // 2
    decoded = codec.decode(payload)
    step = torch.stack([values[i:i + chunk].abs().max() / 7 for i in range(0, numel, chunk)])
    bound = step.repeat_interleave(chunk)[:numel] / 2
    assert ((values - decoded).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(decoded[200:300], torch.zeros(100))
    torch.testing.assert_close(codec.residual, values - decoded, rtol=0, atol=0)  # what it missed is kept
    # largest magnitudes are sent exactly as +-7 steps
    assert (decoded - values).abs()[values.abs() == values.abs().max()].max() < 1e-6


def _plain_int4_encode(residual, values, chunk):
    """The 4-bit payload by the plain formula, each step a fresh tensor:
    what the in-place encoder must match bit for bit (residual updated)."""
    numel = residual.numel()
    count = -(-numel // chunk)
    residual.add_(values)
    padded = torch.zeros(count * chunk)
    padded[:numel] = residual
    chunks = padded.view(count, chunk)
    largest = chunks.abs().amax(dim=1)
    scales = torch.where(largest > SMALLEST, largest / LEVELS, torch.zeros_like(largest))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(chunks / safe[:, None]).clamp_(-LEVELS, LEVELS)
    codes = torch.where(scales[:, None] > 0, codes, torch.zeros_like(codes))
    residual.sub_((codes * scales[:, None]).reshape(-1)[:numel])
    nibbles = (codes.reshape(-1)[:numel] + 8).to(torch.uint8)
    if numel % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    return torch.cat([scales.view(torch.uint8), nibbles[0::2] | (nibbles[1::2] << 4)])


@pytest.mark.parametrize("numel, chunk", [(1, 1), (7, 4), (64, 32), (1000, 64), (4097, 1024), (33, 5)])
def test_int4_in_place_encoder_gives_the_plain_formulas_bits(numel, chunk):
    """Note [DiLoCo's 4-bit encoder works in place]: the same payloads and
    residuals, signed zeros, tiny and zero chunks included, sync after sync."""
    generator = torch.Generator().manual_seed(numel)
    codec, residual = Int4ErrorFeedback(numel, chunk), torch.zeros(numel)
    for sync in range(6):
        values = torch.randn(numel, generator=generator) * 10.0 ** (-3 * sync)
        if sync == 2:
            values[::3], values[1::3] = 0.0, -0.0
        if sync == 3:
            values.zero_()
        if sync == 4:
            values[:chunk] = 1e-31
        assert torch.equal(codec.encode(values), _plain_int4_encode(residual, values, chunk))
        assert torch.equal(codec.residual.view(torch.int32), residual.view(torch.int32))


def test_int4_error_feedback_makes_the_sum_sent_track_the_true_sum():
    gen = torch.Generator().manual_seed(0)
    numel, chunk, syncs = 3000, 256, 40
    codec = Int4ErrorFeedback(numel, chunk)
    true_sum = torch.zeros(numel, dtype=torch.float64)
    sent_sum = torch.zeros(numel, dtype=torch.float64)
    plain_sum = torch.zeros(numel, dtype=torch.float64)
    for _ in range(syncs):
        values = torch.randn(numel, generator=gen) * 1e-2
        true_sum += values.double()
        sent_sum += codec.decode_mean([codec.encode(values)]).double()
        once = Int4ErrorFeedback(numel, chunk)
        plain_sum += once.decode_mean([once.encode(values)]).double()
    torch.testing.assert_close(true_sum - sent_sum, codec.residual.double(), rtol=0, atol=1e-6)
    # half a step of at most (largest |value + residual|) / 7, below 0.06 / 7
    assert (true_sum - sent_sum).abs().max().item() <= 0.5 * 0.06 / 7
    assert (true_sum - plain_sum).abs().mean().item() > 3 * (true_sum - sent_sum).abs().mean().item()


def test_int4_stays_finite_when_a_chunk_gets_only_zeros_and_sums_in_payload_order():
    codec = Int4ErrorFeedback(64, 32)
    first = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 1e-5
    first[32:] = 1.0
    sent = [codec.decode_mean([codec.encode(first)])]
    for _ in range(60):  # each sync re-sends what the last missed, about 14 times smaller
        sent.append(codec.decode_mean([codec.encode(torch.zeros(64))]))
    assert torch.isfinite(codec.residual).all() and all(torch.isfinite(m).all() for m in sent)
    torch.testing.assert_close(torch.stack(sent).double().sum(0) + codec.residual.double(), first.double(),
                               rtol=0, atol=1e-12)
    a = Int4ErrorFeedback(4, 4).encode(torch.tensor([7.0, -7.0, 0.0, 1.0]))
    b = Int4ErrorFeedback(4, 4).encode(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert torch.equal(codec.__class__(4, 4).decode_mean([a, b]), torch.tensor([4.0, -3.0, 0.5, 1.0]))


@pytest.mark.parametrize("codec_type, chunk", [(ErrorFeedback, 8), (ErrorFeedback, 5), (Int4ErrorFeedback, 8),
                                               (Int4ErrorFeedback, 5)])
def test_a_cut_payload_is_the_payload_of_its_chunks_and_decodes_to_the_same_bits(codec_type, chunk):
    # A fragment of 101 elements (an odd, partial last chunk) cut into three
    # shares at the codec's alignment: each share's bytes equal those of
    # encoding its elements alone, and the mean of two hosts' shares decodes
    # to the bits of the whole payloads' mean at those elements.
    numel = 101
    hosts = [torch.randn(numel, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    whole = [codec_type(numel, chunk) for _ in hosts]
    payloads = [codec.encode(values) for codec, values in zip(whole, hosts)]
    mean = whole[0].decode_mean(payloads)
    bounds = HostSplit(0, 3, None, [0, 1, 2]).bounds(numel, whole[0].split_alignment)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % whole[0].split_alignment == 0 for start, _ in bounds)
    assert all(stop > start for start, stop in bounds)  # 101 elements give every share something here
    for start, stop in bounds:
        shares = [codec.cut(payload, start, stop) for codec, payload in zip(whole, payloads)]
        alone = codec_type(stop - start, chunk).encode(hosts[0][start:stop])
        assert torch.equal(shares[0], alone)
        assert torch.equal(whole[0].decode_mean_of_part(shares, stop - start), mean[start:stop])
    assert sum(codec_type(stop - start, chunk).payload_bytes for start, stop in bounds) == whole[0].payload_bytes


def test_parts_by_rank_give_each_host_every_part_once():
    # Two hosts {0, 1} and {2, 3}, outer groups {0, 2} and {1, 3}; and ones
    # pairing 0 with 3 and 1 with 2: a host's ranks hold both parts either way.
    assert parts_by_rank([[0, 2], [1, 3], [0, 2], [1, 3]]) == [0, 1, 0, 1]
    assert parts_by_rank([[0, 3], [1, 2], [1, 2], [0, 3]]) == [0, 1, 1, 0]
