"""What a joiner receives (ddp_ext/fault_tolerance/heal.py), in one process:
the state round-trips into a different model, and the fingerprint tells
models apart. And the control connection's framing."""

import pytest
import torch
from torch import nn

from ddp_ext import LayerDrop
from ddp_ext._bucket_tuner import TuningStage
from ddp_ext._auto_buckets import AutoBuckets
from ddp_ext.fault_tolerance import _wire, heal


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), LayerDrop([nn.Linear(8, 8) for _ in range(2)], p=0.5, seed=seed),
                         nn.BatchNorm1d(8), nn.Linear(8, 2))


def _train(net, opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(6, 4)).sum().backward()
        opt.step()


def test_the_state_round_trips_into_a_fresh_replica():
    source, joiner = _model(1), _model(2)
    source_opt = torch.optim.Adam(source.parameters(), lr=0.1)
    joiner_opt = torch.optim.Adam(joiner.parameters(), lr=0.1)
    _train(source, source_opt, 3)
    tuner = AutoBuckets()
    tuner.tuner.stage = TuningStage.SETTLED
    tuner.tuner.current = 4
    blob = heal.capture(source, source_opt, 17, [1 << 20, 25 << 20], tuner)
    state = heal.restore(blob, joiner, joiner_opt)
    assert state["step"] == 17 and state["caps"] == [1 << 20, 25 << 20]
    assert (state["auto_buckets"].tuner.stage, state["auto_buckets"].tuner.current) == (TuningStage.SETTLED, 4)
    for a, b in zip(list(source.state_dict().values()), list(joiner.state_dict().values())):
        assert torch.equal(a, b)
    assert heal.layer_drop_counters(joiner) == heal.layer_drop_counters(source) == [(1, 3)]
    # Same optimizer state: one more identical step keeps them equal.
    torch.manual_seed(5)
    _train(source, source_opt, 1)
    torch.manual_seed(5)
    _train(joiner, joiner_opt, 1)
    for a, b in zip(source.parameters(), joiner.parameters()):
        assert torch.equal(a, b)


def test_the_fingerprint_tells_models_and_optimizers_apart():
    a, b = _model(1), _model(2)
    assert heal.fingerprint(a, torch.optim.SGD(a.parameters(), lr=1)) == heal.fingerprint(
        b, torch.optim.SGD(b.parameters(), lr=2))  # values do not matter
    wider = nn.Sequential(nn.Linear(4, 9))
    assert heal.fingerprint(a, None) != heal.fingerprint(wider, None)
    assert heal.fingerprint(a, torch.optim.SGD(a.parameters(), lr=1)) != heal.fingerprint(
        a, torch.optim.Adam(a.parameters()))


def test_control_messages_are_split_on_newlines():
    reader = _wire.LineReader()
    assert reader.feed(b'{"type": "hb"}\n{"type": "ab') == [{"type": "hb"}]
    assert reader.feed(b'ort", "epoch": 3}\n') == [{"type": "abort", "epoch": 3}]
    with pytest.raises(ValueError, match="longer than 1 MiB"):
        reader.feed(b"x" * (_wire.MAX_LINE + 1))


def test_coordinator_addresses():
    assert _wire.parse_address("node7:29600") == ("node7", 29600)
    assert _wire.parse_address(":29600") == ("127.0.0.1", 29600)
    with pytest.raises(ValueError, match="host:port"):
        _wire.parse_address("node7")
