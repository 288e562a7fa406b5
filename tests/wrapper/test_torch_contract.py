"""The wrapper is torch 2.13's DistributedDataParallel as far as code written
for torch can tell: the class, the constructor, every method torch's class
defines, pickling, the reducer attribute frameworks call, and torch's
messages. Single process, world of one (multi-process behaviour is in
tests/wrapper/test_contract_parity.py)."""

import copy
import inspect
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from ddp_ext._unsupported import UNSUPPORTED
from tests.support.native_extensions import accumulator_post_hook_count

OursDDP = ddp_ext.DistributedDataParallel

# Attributes of torch's class that are data, not behaviour.
_NOT_METHODS = {"__abstractmethods__", "__annotations__", "__doc__", "__module__", "_abc_impl", "_active_ddp_module"}


def _torch_methods():
    return sorted(name for name in vars(TorchDDP) if name not in _NOT_METHODS)


def test_is_a_torch_ddp():
    assert issubclass(OursDDP, TorchDDP)


@pytest.mark.parametrize("name", _torch_methods())
def test_every_torch_method_is_decided(name):
    """Fails when a torch upgrade adds a method ddp_ext has not decided about:
    each is either ddp_ext's own or refuses with NotImplementedError."""
    ours = inspect.getattr_static(OursDDP, name)
    assert ours is not vars(TorchDDP)[name], (
        f"torch's DistributedDataParallel.{name} would run torch's body against a reducer that "
        "does not exist: implement it in ddp_ext/distributed.py or list it in ddp_ext/_unsupported.py"
    )


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_internals_raise_naming_themselves(name, single_process_group):
    ddp = OursDDP(nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match=name):
        getattr(ddp, name)()


# ddp_ext's own constructor arguments, keyword-only after torch's
# (docs/TORCH_CONTRACT.md).
ADDITIONS = ["rebuild_buckets", "hang_timeout_s", "on_hang", "hierarchical_allreduce"]


def test_constructor_takes_torch_arguments_and_defaults():
    ours = inspect.signature(OursDDP.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    assert list(ours) == list(theirs) + ADDITIONS
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ADDITIONS)


def _both(make, *args, **kwargs):
    """What torch's and ddp_ext's constructor do with the same arguments:
    (type of exception or None, message)."""
    outcomes = []
    for wrapper in (TorchDDP, OursDDP):
        try:
            wrapper(make(), *args, **kwargs)
            outcomes.append((None, ""))
        except Exception as e:  # noqa: BLE001 - comparing whatever each raises
            outcomes.append((type(e), str(e)))
    return outcomes


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (lambda: nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)), {}),
        (lambda: nn.Linear(2, 2), {"delay_all_reduce_named_params": []}),
        (lambda: nn.Linear(2, 2), {"device_ids": [0, 1]}),
        (lambda: nn.Linear(2, 2).requires_grad_(False), {}),
    ],
    ids=["sync_batchnorm_on_cpu", "delay_without_hook_param", "two_device_ids", "nothing_to_train"],
)
def test_construction_errors_match_torch(single_process_group, make, kwargs):
    (their_type, their_message), (our_type, our_message) = _both(make, **kwargs)
    assert their_type is not None
    assert our_type is their_type
    assert their_message.split(".")[0] in our_message


def test_mixed_precision_computes_low_keeps_full_reduces_in_reduce_dtype(single_process_group):
    from torch.nn.parallel.distributed import _MixedPrecision

    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float16, buffer_dtype=torch.bfloat16)
    ddp = OursDDP(module, mixed_precision=config)
    out = ddp(torch.randn(5, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in module.parameters())
    assert module[1].running_mean.dtype == torch.bfloat16
    # Buckets hold float16: 2 bytes per element.
    assert sum(ddp.reducer.bucket_sizes()) == 2 * sum(p.numel() for p in module.parameters())
    with pytest.raises(RuntimeError, match="gradient_as_bucket_view needs buckets of the parameters' dtype"):
        OursDDP(nn.Linear(2, 2), mixed_precision=config, gradient_as_bucket_view=True)


def test_deprecated_arguments_warn_like_torch(single_process_group):
    for kwargs in ({"check_reduction": True}, {"broadcast_buffers": False}, {"broadcast_buffers": True, "forward_sync_buffers": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = OursDDP(nn.Linear(2, 2), **kwargs)
        assert any(issubclass(w.category, FutureWarning) for w in caught), kwargs
    assert ddp.forward_sync_buffers is False and ddp.broadcast_buffers is False


def test_bucket_cap_mb_list_caps_each_bucket_in_turn(single_process_group):
    # Four 4 KiB parameters; caps of 4 KiB then 8 KiB (the last repeats).
    module = nn.ParameterList([nn.Parameter(torch.zeros(1024)) for _ in range(4)])
    module.forward = lambda x: x
    kib = 1 / 1024
    ddp = OursDDP(module, bucket_cap_mb_list=[4 * kib, 8 * kib])
    # torch's first buckets: cut in registration order, the last one launched
    # first (Note [torch's first buckets] in reducer/layout/bucket_assignment.h).
    assert ddp.bucket_indices() == [[3], [1, 2], [0]]
    assert ddp.bucket_bytes_cap == 8 * 1024


def test_device_mesh_gives_its_group(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    ddp = OursDDP(nn.Linear(2, 2), device_mesh=mesh)
    assert ddp.process_group is mesh.get_group()
    with pytest.raises(RuntimeError, match="Cannot specify both"):
        OursDDP(nn.Linear(2, 2), device_mesh=mesh, process_group=single_process_group)


def test_comm_hook_registration_errors_match_torch(single_process_group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for wrapper in (TorchDDP, OursDDP):
        ddp = wrapper(nn.Linear(2, 2))
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)

    def bad_annotation(state, bucket: int):
        return bucket

    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
        OursDDP(nn.Linear(2, 2)).register_comm_hook(None, bad_annotation)
    with pytest.raises(TypeError, match="must be callable"):
        OursDDP(nn.Linear(2, 2)).register_comm_hook(None, 3)


def test_hook_that_returns_no_future_is_named(single_process_group):
    ddp = OursDDP(nn.Linear(2, 2), gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(RuntimeError, match="must return a torch.futures.Future"):
        ddp(torch.randn(3, 2)).sum().backward()


def test_logging_data_has_the_keys_frameworks_read(single_process_group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = OursDDP(nn.Linear(2, 2))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    for _ in range(2):
        ddp(torch.randn(3, 2)).sum().backward()
    data = ddp._get_ddp_logging_data()
    assert data["can_set_static_graph"] == 1
    assert data["iteration"] == 1  # as torch's: the second forward sampled iteration 1
    assert data["comm_hook"] == "allreduce_hook"
    assert data["bucket_sizes"] == str(6 * 4)
    assert data["world_size"] == 1 and data["backend_name"] == "gloo"


def test_static_graph_set_twice_warns_and_late_is_refused(single_process_group):
    ddp = OursDDP(nn.Linear(2, 2), static_graph=True)
    with pytest.warns(UserWarning, match="no need to set it again"):
        ddp._set_static_graph()
    late = OursDDP(nn.Linear(2, 2))
    late(torch.randn(3, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="before training loop starts"):
        late._set_static_graph()


def test_state_dict_helpers_see_the_same_keys_as_for_torch(single_process_group):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keys = []
    for wrapper in (TorchDDP, OursDDP):
        torch.manual_seed(0)
        keys.append(sorted(get_model_state_dict(wrapper(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))))
    assert keys[0] == keys[1]
    assert keys[1] == ["0.bias", "0.weight", "1.bias", "1.num_batches_tracked", "1.running_mean", "1.running_var", "1.weight"]


def test_deepcopy_and_pickle_rebuild_the_reducer(single_process_group):
    torch.manual_seed(0)
    ddp = OursDDP(nn.Linear(3, 2), static_graph=True)
    for clone in (copy.deepcopy(ddp), pickle.loads(pickle.dumps(ddp))):
        assert isinstance(clone, OursDDP)
        assert clone.process_group is single_process_group
        assert clone.reducer is not ddp.reducer and clone.static_graph
        assert clone.module.weight is not ddp.module.weight
        torch.testing.assert_close(clone.module.weight, ddp.module.weight)
        clone(torch.randn(4, 3)).sum().backward()
        assert clone.module.weight.grad is not None and ddp.module.weight.grad is None


def test_pickle_refuses_a_group_other_than_the_default(single_process_group):
    ddp = OursDDP(nn.Linear(2, 2), process_group=dist.new_group([0]))
    with pytest.raises(RuntimeError, match="only supported when using DDP with the default process group"):
        pickle.dumps(ddp)


def test_unprepared_backward_is_left_local_as_with_torch(single_process_group):
    # See Note [Unprepared backward]: as torch's reducer, an idle one ignores
    # the gradients of a backward it was not prepared for; they stay in .grad.
    # ddp_ext warns of the second backward at the next forward (Note [Late
    # gradients] in reducer/core/late_gradients.h), not of the first backward.
    grads, warned = {}, {}
    for wrapper in (OursDDP, TorchDDP):
        torch.manual_seed(0)
        ddp = wrapper(nn.Linear(2, 2))
        x = torch.randn(3, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp.module(x).sum().backward()  # a backward the wrapper's forward did not prepare
            out = ddp(x).sum()
            out.backward(retain_graph=True)
            out.backward()  # a second backward after the reduction finished
            grads[wrapper] = [p.grad.clone() for p in ddp.parameters()]
            ddp.zero_grad()
            ddp(x).sum().backward()  # and the next prepared one reduces as usual
        warned[wrapper] = [str(w.message) for w in caught if w.category is ddp_ext.LocalGradientWarning]
        for p, g in zip(ddp.parameters(), grads[wrapper]):
            torch.testing.assert_close(3 * p.grad, g)
    for ours, theirs in zip(grads[OursDDP], grads[TorchDDP]):
        assert torch.equal(ours, theirs)
    assert warned[TorchDDP] == []
    assert len(warned[OursDDP]) == 1 and "the gradients of weight, bias were produced" in warned[OursDDP][0]


def test_prepared_backward_outside_forward(single_process_group):
    ddp = OursDDP(nn.Linear(2, 2))
    # Said explicitly: local accumulation, or a prepared backward.
    with ddp.no_sync():
        ddp.module(torch.randn(3, 2)).sum().backward()
    ddp.reducer.prepare_for_backward([])
    ddp.module(torch.randn(3, 2)).sum().backward()
    ddp._check_reducer_finalized()
    # torch's entry point that frameworks call before preparing a backward
    # checks, as torch's does, that the last reduction finished.
    ddp.reducer._rebuild_buckets()
    ddp.reducer.prepare_for_backward([])
    ddp.module.weight.sum().backward()  # the bias's gradient never comes
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
        ddp.reducer._rebuild_buckets()


def test_ignored_parameters_and_buffers_stay_out(single_process_group):
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    OursDDP._set_params_and_buffers_to_ignore_for_model(module, ["2.weight", "1.running_mean"])
    assert module[2].weight._ddp_ignored and module[1].running_mean._ddp_ignored
    ddp = OursDDP(module)
    assert "2.weight" not in [n for n, _ in ddp._named_params_for_reducer(module)]
    assert "1.running_mean" not in ddp.named_module_buffers
    assert sum(len(b) for b in ddp.bucket_indices()) == 5


def test_remove_autograd_hooks_leaves_no_hook_behind(single_process_group):
    module = nn.Linear(2, 2)
    before = [accumulator_post_hook_count(p) for p in module.parameters()]
    ddp = OursDDP(module)
    assert [accumulator_post_hook_count(p) for p in module.parameters()] == [n + 1 for n in before]
    ddp._remove_autograd_hooks()
    assert [accumulator_post_hook_count(p) for p in module.parameters()] == before


def test_will_sync_module_buffers_follows_torch(single_process_group):
    for wrapper in (TorchDDP, OursDDP):
        with_buffers = wrapper(nn.BatchNorm1d(2))
        assert with_buffers.will_sync_module_buffers()
        with_buffers.require_forward_param_sync = False
        assert not with_buffers.will_sync_module_buffers()
        assert not wrapper(nn.Linear(2, 2)).will_sync_module_buffers()
        assert not wrapper(nn.BatchNorm1d(2), forward_sync_buffers=False).will_sync_module_buffers()


def test_hook_registered_after_training_started_is_used(single_process_group):
    """torch's DDP accepts a hook between iterations, not only before the
    first; so does ddp_ext, and the next backward goes through it."""
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    for wrapper in (TorchDDP, OursDDP):
        calls.clear()
        ddp = wrapper(nn.Linear(2, 2))
        ddp(torch.randn(3, 2)).sum().backward()
        ddp.register_comm_hook(None, counting_hook)
        ddp(torch.randn(3, 2)).sum().backward()
        assert calls == [0], wrapper
