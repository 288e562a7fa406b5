"""A communication hook, and its future's callback, may read the wrapper:
every reading method and property returns (or raises a clear error) instead
of blocking, and a change from inside the hook raises. The same hook trains
to the same parameters as under torch's DDP. See Note [Windows without the
lock] in reducer/core/state_lock.cpp."""

import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.spawn import run_ranks_for_each

STEPS = 4
TIMEOUT_S = 120.0  # a hook or callback that blocks on the reducer's lock hangs: fail instead

# Readers both DDPs have (torch's DDP attributes and methods frameworks use).
COMMON_READERS = {
    "_has_rebuilt_buckets": lambda d: d._has_rebuilt_buckets,
    "_get_ddp_logging_data()": lambda d: d._get_ddp_logging_data(),
    "process_group": lambda d: d.process_group.size(),
    "module": lambda d: d.module,
    "reducer": lambda d: d.reducer,
    "device_ids": lambda d: d.device_ids,
    "output_device": lambda d: d.output_device,
    "device_type": lambda d: d.device_type,
    "dim": lambda d: d.dim,
    "bucket_bytes_cap": lambda d: d.bucket_bytes_cap,
    "bucket_bytes_cap_default": lambda d: d.bucket_bytes_cap_default,
    "static_graph": lambda d: d.static_graph,
    "find_unused_parameters": lambda d: d.find_unused_parameters,
    "gradient_as_bucket_view": lambda d: d.gradient_as_bucket_view,
    "require_backward_grad_sync": lambda d: d.require_backward_grad_sync,
    "require_forward_param_sync": lambda d: d.require_forward_param_sync,
    "parameters_to_ignore": lambda d: d.parameters_to_ignore,
    "_module_parameters": lambda d: d._module_parameters,
    "broadcast_buffers": lambda d: d.broadcast_buffers,
    "mixed_precision": lambda d: d.mixed_precision,
    "join_device": lambda d: d.join_device,
    "join_process_group": lambda d: d.join_process_group,
    "_distributed_rank": lambda d: d._distributed_rank,
    "_lazy_init_ran": lambda d: d._lazy_init_ran,
    "_use_python_reducer": lambda d: d._use_python_reducer,
    "will_sync_module_buffers()": lambda d: d.will_sync_module_buffers(),
    "_get_active_ddp_module()": lambda d: d._get_active_ddp_module(),
    "named_parameters()": lambda d: list(d.named_parameters()),
    "state_dict()": lambda d: d.state_dict(),
}

# torch's DDP blocks for ever on this one inside a hook (its logger takes the
# lock its reducer holds while the hook runs): ddp_ext only.
TORCH_BLOCKS_ON = {"_get_ddp_logging_data()"}

# ddp_ext's own readers, and those of its reducer (what the wrapper delegates to).
EXT_READERS = {
    "bucket_indices()": lambda d: d.bucket_indices(),
    "_static_graph_delay_allreduce_enqueued": lambda d: d._static_graph_delay_allreduce_enqueued,
    "straggler_report()": lambda d: d.straggler_report(),
    "bucket_tuner": lambda d: d.bucket_tuner,
    "bucket_bytes_cap_list": lambda d: d.bucket_bytes_cap_list,
    "_bucket_caps_bytes": lambda d: d._bucket_caps_bytes,
    "reducer_group": lambda d: d.reducer_group,
    "reducer.bucket_indices()": lambda d: d.reducer.bucket_indices(),
    "reducer.bucket_sizes()": lambda d: d.reducer.bucket_sizes(),
    "reducer.has_rebuilt_buckets": lambda d: d.reducer.has_rebuilt_buckets,
    "reducer.rebuilds": lambda d: d.reducer.rebuilds,
    "reducer.overlap_fraction": lambda d: d.reducer.overlap_fraction,
    "reducer.launch_delay": lambda d: d.reducer.launch_delay,
    "reducer.observed_order()": lambda d: d.reducer.observed_order(),
    "reducer.bucket_caps": lambda d: d.reducer.bucket_caps,
    "reducer._layout_for_caps()": lambda d: d.reducer._layout_for_caps(list(d.reducer.bucket_caps)),
    "reducer.iterations": lambda d: d.reducer.iterations,
    "reducer.training_steps": lambda d: d.reducer.training_steps,
    "reducer.phase": lambda d: d.reducer.phase,
    "reducer.learning_static_graph": lambda d: d.reducer.learning_static_graph,
    "reducer.unused_parameters_stable": lambda d: d.reducer.unused_parameters_stable,
    "reducer._straggler_figures()": lambda d: d.reducer._straggler_figures(),
    "reducer._runtime_times()": lambda d: d.reducer._runtime_times(),
    "reducer._get_zeros_like_grad_buckets()": lambda d: d.reducer._get_zeros_like_grad_buckets(),
    "reducer._get_local_used_map()": lambda d: d.reducer._get_local_used_map(),
    # Raise while gradients are being reduced, as torch's do.
    "reducer._check_reducer_finalized()": lambda d: d.reducer._check_reducer_finalized(),
    "reducer._rebuild_buckets()": lambda d: d.reducer._rebuild_buckets(),
}
RAISE_WHILE_REDUCING = {"reducer._check_reducer_finalized()", "reducer._rebuild_buckets()"}

# Changes made from inside the hook: each raises, naming the hook.
EXT_CHANGERS = {
    "register_comm_hook": lambda d: d.register_comm_hook(None, _reading_hook),
    "set_overlap_with_backward": lambda d: d.set_overlap_with_backward(True),
    "reducer._set_static_graph()": lambda d: d.reducer._set_static_graph(),
}


def _read(ddp, readers, record):
    for name, read in readers.items():
        try:
            read(ddp)
        except Exception as error:  # noqa: BLE001 - recorded and checked by the test
            record.setdefault(name, set()).add(f"{type(error).__name__}: {error}".splitlines()[0][:200])
        else:
            record.setdefault(name, set()).add("ok")


def _reading_hook(state, bucket):
    ddp = state["ddp"]()
    readers = state["readers"]
    _read(ddp, readers, state["in_hook"])
    state["rebuilt_seen"].append(bool(ddp._has_rebuilt_buckets))
    if state["changers"]:
        for name, change in state["changers"].items():
            try:
                change(ddp)
            except RuntimeError as error:
                state["changes"].setdefault(name, set()).add(str(error).splitlines()[0])
            else:
                state["changes"].setdefault(name, set()).add("no error")
    world_size = dist.get_world_size(state["group"])
    fut = dist.all_reduce(bucket.buffer().div_(world_size), group=state["group"], async_op=True).get_future()

    def read_again(done):
        _read(state["ddp"](), readers, state["in_callback"])
        state["callbacks"] += 1
        return done.value()[0]

    return fut.then(read_again)


def _train(rank, world_size, impl):
    import ddp_ext
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    wrapper = ddp_ext.DistributedDataParallel if impl == "ddp_ext" else TorchDDP
    # Small caps: several buckets, so later hooks run while earlier futures complete.
    ddp = wrapper(model, bucket_cap_mb=0.0005)
    if impl == "ddp_ext":
        readers = dict(COMMON_READERS, **EXT_READERS)
    else:
        readers = {k: v for k, v in COMMON_READERS.items() if k not in TORCH_BLOCKS_ON}
    state = {
        "ddp": weakref.ref(ddp),
        "group": dist.group.WORLD,
        "readers": readers,
        "changers": EXT_CHANGERS if impl == "ddp_ext" else {},
        "in_hook": {},
        "in_callback": {},
        "changes": {},
        "rebuilt_seen": [],
        "callbacks": 0,
    }
    ddp.register_comm_hook(state, _reading_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(6, 8, generator=gen)
        y = torch.randn(6, 4, generator=gen)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "in_hook": state["in_hook"],
        "in_callback": state["in_callback"],
        "changes": state["changes"],
        "callbacks": state["callbacks"],
        "buckets": len(ddp.reducer.bucket_indices()) if impl == "ddp_ext" else None,
    }


def _check_reads(record, readers, where):
    assert set(record) == set(readers), f"{where}: readers not called: {set(readers) - set(record)}"
    for name, outcomes in record.items():
        if name in RAISE_WHILE_REDUCING:
            assert all(o == "ok" or o.startswith("RuntimeError") for o in outcomes), (where, name, outcomes)
        else:
            assert outcomes == {"ok"}, f"{where}: {name} gave {outcomes}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_hook_and_its_callback_read_every_property_and_train_as_torch(world_size):
    # Both on the same ranks, one after the other.
    ours, theirs = run_ranks_for_each(_train, world_size, ("ddp_ext", "torch"), timeout=2 * TIMEOUT_S)
    for rank in range(world_size):
        mine, reference = ours[rank], theirs[rank]
        assert mine["buckets"] > 1, "the test needs several buckets"
        readers = dict(COMMON_READERS, **EXT_READERS)
        _check_reads(mine["in_hook"], readers, f"rank {rank}, inside the hook")
        _check_reads(mine["in_callback"], readers, f"rank {rank}, inside the future's callback")
        torch_readers = {k: v for k, v in COMMON_READERS.items() if k not in TORCH_BLOCKS_ON}
        _check_reads(reference["in_hook"], torch_readers, f"torch, rank {rank}, inside the hook")
        _check_reads(reference["in_callback"], torch_readers, f"torch, rank {rank}, inside the future's callback")
        assert mine["callbacks"] >= STEPS * mine["buckets"] // 2 and reference["callbacks"] > 0
        for name, outcomes in mine["changes"].items():
            assert len(outcomes) == 1, (name, outcomes)
            (message,) = outcomes
            assert f"on rank {rank} cannot be changed" in message and "from inside its communication hook" in message, (
                name,
                message,
            )
        assert set(mine["changes"]) == set(EXT_CHANGERS)
        assert mine["params"].keys() == reference["params"].keys()
        for name, value in mine["params"].items():
            torch.testing.assert_close(value, reference["params"][name], msg=f"rank {rank}, {name}")
