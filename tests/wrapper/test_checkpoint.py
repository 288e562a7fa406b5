"""Checkpoints round-trip between ddp_ext's DDP and torch's (issue 2).

A state_dict saved from one wrapper (keys `module.<name>`, buffers included)
loads strictly into the other, which starts from different weights; trained
on from there, with the optimizer state restored too, both go on identically.
"""

import dataclasses
import io

import pytest
import torch

from tests.support import models, reference
from tests.support.harness import CaseTable, assert_states_close
from tests.support.reference import case

WRAPPERS = {"ddp_ext": reference.ext_ddp, "torch": reference.torch_ddp}


@dataclasses.dataclass(frozen=True)
class RoundTrip:
    model: str
    source: str  # key of WRAPPERS: the wrapper that saves
    target: str  # the wrapper that loads

    @property
    def id(self):
        return f"{self.model}-{self.source}_to_{self.target}"


ROUND_TRIPS = [RoundTrip(m, s, t) for m in ("mlp", "batchnorm") for s, t in (("ddp_ext", "torch"), ("torch", "ddp_ext"))]


def _round_trip(rank, world_size, rt):
    c = case(rt.model, "sgd")
    source_module = models.build(rt.model)
    source = WRAPPERS[rt.source](source_module)
    source_opt = reference.OPTIMIZERS[c.optimizer](source_module.parameters())
    reference.run_steps(source, source_opt, c, rank, world_size, range(0, 2))

    at_save = reference.state_tensors(source_module)
    saved = io.BytesIO()
    torch.save({"model": source.state_dict(), "optimizer": source_opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved)

    target_module = models.build(rt.model, seed=models.MODEL_SEED + 1)
    target = WRAPPERS[rt.target](target_module)
    target_keys = sorted(target.state_dict())
    target.load_state_dict(checkpoint["model"])  # strict: same keys both ways
    target_opt = reference.OPTIMIZERS[c.optimizer](target_module.parameters())
    target_opt.load_state_dict(checkpoint["optimizer"])
    loaded = reference.state_tensors(target_module)

    reference.run_steps(source, source_opt, c, rank, world_size, range(2, 4))
    reference.run_steps(target, target_opt, c, rank, world_size, range(2, 4))
    return dict(
        source_keys=sorted(checkpoint["model"]),
        target_keys=target_keys,
        at_save=at_save,
        loaded=loaded,
        source_final=reference.state_tensors(source_module),
        target_final=reference.state_tensors(target_module),
    )


TABLE = CaseTable(_round_trip, ROUND_TRIPS)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rt", ROUND_TRIPS, ids=lambda rt: rt.id)
def test_checkpoint_round_trip(rt, world_size):
    for rank, r in enumerate(TABLE.results(world_size, rt)):
        module_keys = sorted(models.build(rt.model).state_dict())
        assert r["source_keys"] == [f"module.{k}" for k in module_keys], r["source_keys"]
        assert r["target_keys"] == r["source_keys"], f"{rt.target}'s keys {r['target_keys']} differ"
        for kind, index in (("parameters", 0), ("buffers", 1)):
            assert_states_close(
                r["loaded"][index], r["at_save"][index], f"{rt.id}, rank {rank}: {kind} loaded", rtol=0, atol=0
            )
            assert_states_close(
                r["target_final"][index],
                r["source_final"][index],
                f"{rt.id}, rank {rank}: {kind} after training on from the checkpoint",
            )
