"""The wrapper removes every autograd hook it installed when it is destroyed:
a backward through a graph built while it was alive then issues no
collective and never crashes. Without find_unused_parameters it runs purely
locally (as with torch's DDP); with it, the output sink notices and the
backward raises on every rank (torch's DDP raises too). Wrapping the same
module again reduces each gradient once."""

import dataclasses
import gc
import weakref

import pytest
import torch

from tests.support import models, reference
from tests.support.harness import CaseTable
from benchmarks.harness.recording_group import RecordingProcessGroup


@dataclasses.dataclass(frozen=True)
class Lifecycle:
    find_unused: bool

    @property
    def id(self):
        return "find_unused" if self.find_unused else "default"


def _destroy_then_backward(rank, world_size, lc):
    import torch.distributed as dist

    pg = RecordingProcessGroup(dist.distributed_c10d._get_default_group())
    module = models.build("mlp")
    spec = models.MODELS["mlp"]
    args, target = models.rank_batch("mlp", 0, 0, rank, world_size, 4)

    ddp = reference.ext_ddp(module, process_group=pg, find_unused_parameters=lc.find_unused)
    alive = weakref.ref(ddp)
    loss = spec.loss(ddp(*args), target)  # the reducer now expects gradients
    del ddp
    gc.collect()
    destroyed = alive() is None
    pg.take()
    error = ""
    try:
        loss.backward()  # hooks left behind would call into a destroyed reducer
    except RuntimeError as e:
        error = str(e)
    after_destroy = pg.take()
    same_as_local = False
    if not error:
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        local = models.build("mlp")
        spec.loss(local(*args), target).backward()
        local_grads = {n: p.grad for n, p in local.named_parameters()}
        same_as_local = all(torch.equal(grads[n], local_grads[n]) for n in grads)

    # Wrap the same module again: one allreduce per bucket (and the step
    # check), not more.
    module.zero_grad(set_to_none=True)
    ddp = reference.ext_ddp(module, process_group=pg, find_unused_parameters=lc.find_unused)
    pg.take()
    spec.loss(ddp(*args), target).backward()
    rewrapped = pg.take()
    return dict(
        error=error,
        destroyed=destroyed,
        after_destroy=after_destroy,
        same_as_local=same_as_local,
        rewrapped=rewrapped,
        n_buckets=len(ddp.bucket_indices()),
        n_params=len(list(module.parameters())),
        digest=reference.digest(module),
        grad_digest=reference.digest_tensors((n, p.grad) for n, p in module.named_parameters()),
    )


CASES = [Lifecycle(False), Lifecycle(True)]
TABLE = CaseTable(_destroy_then_backward, CASES, timeout=120)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("lc", CASES, ids=lambda lc: lc.id)
def test_destroying_the_wrapper_removes_its_hooks(lc, world_size):
    results = TABLE.results(world_size, lc)
    for rank, r in enumerate(results):
        assert r["destroyed"], f"rank {rank}: the DDP object outlived `del` and gc (a reference cycle?)"
        assert r["after_destroy"] == [], f"rank {rank}: collectives after the wrapper was destroyed: {r['after_destroy']}"
        if lc.find_unused:
            assert "was destroyed after its forward pass" in r["error"], f"rank {rank}: {r['error']!r}"
        else:
            assert not r["error"], f"rank {rank}: {r['error']}"
            assert r["same_as_local"], f"rank {rank}: gradients after destruction are not the local ones"
        allreduces = [c for c in r["rewrapped"] if c[0] == "allreduce"]
        # The step check, the buckets, and with find_unused the bitmap.
        expected = 1 + r["n_buckets"] + (1 if lc.find_unused else 0)
        assert len(allreduces) == expected, f"rank {rank}: {r['rewrapped']}"
    assert len({r["grad_digest"] for r in results}) == 1, "re-wrapped module: gradients differ between ranks"
