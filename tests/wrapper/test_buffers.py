"""Buffers (BatchNorm running statistics) follow torch's DDP (issue 3, paper
section 4.1).

With broadcast_buffers=True, rank 0's buffers are broadcast before each
forward that follows a synchronising one; inside no_sync, and after a forward
under torch.no_grad(), the broadcast is skipped until the next synchronising
forward. The buffers every forward sees, and the final parameters and buffers
on every rank, equal torch's DDP's.
"""

import dataclasses

import pytest
import torch

from tests.support import models, reference
from tests.support.harness import (
    CaseTable,
    assert_grad_layout_kept,
    assert_same_on_every_rank,
    assert_states_close,
    same_bits,
)
from tests.support.reference import Case, case


@dataclasses.dataclass(frozen=True)
class BufferCase:
    train: Case
    # After each step's backward: a forward under torch.no_grad() in train
    # mode, which updates the running statistics with this rank's batch only.
    no_grad_forward: bool = False

    @property
    def id(self):
        return self.train.id + ("-no_grad_forward" if self.no_grad_forward else "")


CASES = [
    BufferCase(case("batchnorm", opt, micro_batches=k, ddp=dict(broadcast_buffers=b)))
    for b in (True, False)
    for k, opt in ((1, "sgd"), (2, "adam"), (3, "sgd"))
]
CASES += [
    BufferCase(case("batchnorm", "sgd", micro_batches=2, ddp=dict(find_unused_parameters=True))),
    BufferCase(case("batchnorm", "sgd", micro_batches=2, ddp=dict(gradient_as_bucket_view=True))),
    BufferCase(case("batchnorm", "sgd"), no_grad_forward=True),
    BufferCase(case("batchnorm", "sgd", micro_batches=2), no_grad_forward=True),
]


def _train(rank, world_size, bc):
    def run(wrapper):
        seen = []  # the buffers each forward of the wrapped module starts from

        def wrap(module, **kwargs):
            module.register_forward_pre_hook(lambda m, args: seen.append(reference.state_tensors(m)[1]))
            return wrapper(module, **kwargs)

        def no_grad_forward(ddp, module):
            if bc.no_grad_forward:
                args, _ = models.rank_batch(bc.train.model, 99, 0, rank, world_size, bc.train.per_rank)
                with torch.no_grad():
                    ddp(*args)

        trace = reference.train_ddp(wrap, bc.train, rank, world_size, on_step=no_grad_forward)
        trace["seen"] = seen
        return trace

    return {"ext": run(reference.ext_ddp), "torch": run(reference.torch_ddp)}


TABLE = CaseTable(_train, CASES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bc", CASES, ids=lambda bc: bc.id)
def test_buffers_match_torch_ddp(bc, world_size):
    results = TABLE.results(world_size, bc)
    assert_same_on_every_rank([r["ext"] for r in results], f"{bc.id}, world size {world_size}")
    assert_grad_layout_kept([r["ext"] for r in results], f"{bc.id}, world size {world_size}")
    for rank, r in enumerate(results):
        what = f"{bc.id}, rank {rank} of {world_size}, ddp_ext vs torch DDP"
        ext, ref = r["ext"], r["torch"]
        assert len(ext["seen"]) == len(ref["seen"]), what
        for i, (a, e) in enumerate(zip(ext["seen"], ref["seen"])):
            assert_states_close(a, e, f"{what}: buffers at the start of forward {i}")
        assert_states_close(ext["params"], ref["params"], what + " parameters")
        assert_states_close(ext["buffers"], ref["buffers"], what + " buffers")


def test_broadcast_is_observable():
    """With broadcast_buffers=True the ranks' buffers agree at the start of the
    second step's forward and differ (each rank's own batch) at its end; with
    False they differ from the second step on. Guards the test above against
    data for which broadcasting would change nothing."""
    on = CASES[0]
    off = next(bc for bc in CASES if dict(bc.train.ddp) == dict(broadcast_buffers=False) and bc.train.micro_batches == 1)
    for bc, agree in ((on, True), (off, False)):
        seen = [r["ext"]["seen"][1]["bn.running_mean"] for r in TABLE.results(2, bc)]
        assert same_bits(seen[0], seen[1]) == agree, bc.id
    finals = [r["ext"]["buffers"]["bn.running_mean"] for r in TABLE.results(2, on)]
    assert not same_bits(finals[0], finals[1])
