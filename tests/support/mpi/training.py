"""Checks run on every rank under mpirun: training over the MPI backend (both
DDPs, plain and over a round-robin group of MPI children) equals local
training on the whole batch."""

import torch.distributed as dist

import ddp_ext
from tests.support import reference
from tests.support.harness import assert_same_on_every_rank, assert_states_close

CASES = [reference.case("conv"), reference.case("mlp", "adam")]


def _gather(trace, group):
    traces = [None] * dist.get_world_size()
    dist.all_gather_object(traces, trace, group=group)
    return traces


def check_training(rank, size, gloo, wrappers=("ext", "torch")) -> int:
    """Trains every case with each DDP over the default (MPI) group; returns
    how many trainings matched."""
    matched = 0
    for c in CASES:
        local = reference.train_local(c, size, concat=True)
        for name in wrappers:
            wrapper = reference.ext_ddp if name == "ext" else reference.torch_ddp
            trace = reference.train_ddp(wrapper, c, rank, size)
            what = f"{c.id}: {name} DDP over ddp_ext_mpi, world size {size}"
            assert_same_on_every_rank(_gather(trace, gloo), what)
            assert_states_close(trace["params"], local["params"], f"{what} vs local training")
            matched += 1
    return matched


def check_round_robin(rank, size, gloo) -> int:
    """A round-robin group of three MPI children: collectives go to each child
    in turn and equal Gloo's; ddp_ext's DDP over it trains as locally."""
    import torch

    rr = ddp_ext.new_round_robin_group(num_groups=3, backend="ddp_ext_mpi")
    backend = rr._get_backend(torch.device("cpu"))
    for i in range(4):
        assert backend.next_child_index == i % 3, (i, backend.next_child_index)
        t = torch.arange(5, dtype=torch.float32) * (rank + 1)
        ref = t.clone()
        dist.all_reduce(t, group=rr)
        dist.all_reduce(ref, group=gloo)
        assert torch.equal(t, ref), (t, ref)
    c = CASES[0]
    local = reference.train_local(c, size, concat=True)
    trace = reference.train_ddp(lambda m, **kw: ddp_ext.DistributedDataParallel(m, process_group=rr, **kw),
                                c, rank, size)
    assert_states_close(trace["params"], local["params"], "ddp_ext DDP over a round-robin group of MPI children")
    assert backend.forwarded_calls > 4
    dist.destroy_process_group(rr)
    return 1
