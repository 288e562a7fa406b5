"""The sharded optimizer's state in a form torch.distributed.checkpoint
(DCP) saves without gathering: `ddp.sharded_optimizer_state_dict()` and
`ddp.load_sharded_optimizer_state_dict(checkpoint_id)`.

Note [Sharded checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank's state is its range of each bucket (Note [Shard plan] in
ddp_ext/_shard_plan.py): rank r of N owns [r*S, (r+1)*S) of the bucket's L
elements, S = ceil(L / N), which is how a DTensor sharded on dimension 0
(Shard(0)) splits a tensor of L elements. So each elementwise state (Adam's
exp_avg, say) of each bucket is saved as one DTensor of global shape (L,)
whose local tensor is the rank's range, under `bucket.<b>.<key>`; elements no
parameter covers are zeros. The ranks first agree on each bucket's keys (one
all_gather_object), since DCP needs every rank's range of each: a range
holding no state (unused parameters only) saves zeros, and `keys.<name>`
says which parameters have state. DCP writes each rank's range from that
rank and can read any other split of it: loaded at N' ranks, each rank
reads the range the same rule gives it at N'. Scalar state (a parameter's `step`) is
saved per parameter under `param.<name>.<key>` by the ranks holding a piece
(all equal; DCP keeps one). `layout` names each bucket's parameters,
offsets and sizes, and `param_groups` the groups' values.

Loading waits for the plans: load_sharded_optimizer_state_dict() reads the
layout and the groups' values at once, and the ranges at the first
optimizer.step(), when the plans say which piece of which parameter this
rank steps (ShardedOptimizer._cut_loaded delegates to `PendingShards.cut`).
A replicated bucket (Note [Replicated plans] in ddp_ext/_shard_plan.py) is
saved as a sharded one is, rank r its range, and read whole: its pieces are
whole parameters.
Each piece is a range of its parameter in a saved bucket; DCP reads just
those ranges (`_Ranges`, any number of chunks of one saved tensor). So the
checkpoint loads at another world size or bucket_cap_mb, and before the
bucket rebuild as after it. A parameter the checkpoint lacks, or whose size
differs, is refused at that step on every rank (each sees the same plans)
before stepping. Until that step optimizer.state_dict() is refused, since
the state is not in place yet.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ddp_ext._shard_plan import ShardPlan, elementwise_state

Layout = Tuple[Tuple[str, int, int], ...]  # (parameter name, offset, numel) of each parameter of a bucket


def _error(sharded, what: str) -> str:
    return f"DistributedDataParallel on rank {sharded.rank}: {what}"


def named_layout(sharded, plan: ShardPlan) -> Layout:
    return tuple((sharded.names[id(sharded.params[index])], offset, numel) for index, offset, numel in plan.layout)


def _refusal(sharded) -> Optional[str]:
    """Why this rank cannot save its state now, if it cannot."""
    if sharded.loaded or getattr(sharded, "pending", None) is not None:
        return ("sharded_optimizer_state_dict() found state loaded but not yet cut into this rank's shards (that "
                "happens at the next optimizer.step()): save after a step, or save the gathered "
                "optimizer.state_dict().")
    if sharded.optimizer.state:
        return ("sharded_optimizer_state_dict() found optimizer state outside the shards "
                f"({len(sharded.optimizer.state)} parameters no bucket reduces): save the gathered "
                "optimizer.state_dict().")
    return None


def _bucket(sharded, plan: ShardPlan, out: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The rank's range of each elementwise state of the bucket, by key; its other entries go into `out`."""
    flats: Dict[str, torch.Tensor] = {}
    lo, hi = plan.sharded_range(sharded.rank)  # replicated or not (Note [Shard plan], and DTensor's Shard(0))
    for piece in plan.pieces:
        name = sharded.names[id(sharded.params[piece.index])]
        state = sharded.state.get(piece.flat, {})
        if state:
            out[f"keys.{name}"] = tuple(sorted(state))  # which state it has: zeros are not "none"
        at = plan.lo + piece.at  # the piece's first element in the bucket
        start, stop = plan.sharded_part(piece)
        for key, value in state.items():
            if elementwise_state(key, value, piece.stop - piece.start):
                flat = flats.setdefault(key, torch.zeros(hi - lo, dtype=value.dtype, device=value.device))
                if start < stop:
                    flat[start - lo:stop - lo].copy_(value[start - at:stop - at])
            else:
                out[f"param.{name}.{key}"] = value
    return flats


def state_dict(sharded) -> Dict[str, object]:
    """The rank's state as DCP saves it without gathering (Note [Sharded checkpoints]); a collective."""
    refusal = _refusal(sharded)
    plans = sorted(sharded.plans.values(), key=lambda plan: min(index for index, _, _ in plan.layout))
    out: Dict[str, object] = {"layout": [(named_layout(sharded, plan), plan.length) for plan in plans],
                              # (key, value) pairs: DCP would save a dict's values one by one
                              "param_groups": [tuple((k, v) for k, v in group.items() if k != "params")
                                               for group in sharded.optimizer.param_groups]}
    flats = [] if refusal else [_bucket(sharded, plan, out) for plan in plans]
    # The ranks agree on each bucket's keys (a range holding no state has none) and on any refusal: every
    # rank takes this one collective, so a refusing rank leaves none waiting.
    every = [None] * sharded.world_size
    dist.all_gather_object(every, (refusal, [{key: flat.dtype for key, flat in f.items()} for f in flats]),
                           group=sharded.group)
    if refusal:
        raise RuntimeError(_error(sharded, refusal))
    for rank, (what, _) in enumerate(every):
        if what:
            raise RuntimeError(_error(sharded, f"rank {rank} refused: {what}"))
    mesh = DeviceMesh.from_group(sharded.group, sharded.device.type)
    for b, plan in enumerate(plans):
        lo, hi = plan.sharded_range(sharded.rank)
        for _, keys in every:
            for key, dtype in keys[b].items():
                flats[b].setdefault(key, torch.zeros(hi - lo, dtype=dtype, device=sharded.device))
        for key, flat in sorted(flats[b].items()):
            out[f"bucket.{b}.{key}"] = DTensor.from_local(flat, mesh, [Shard(0)], run_check=False,
                                                          shape=torch.Size([plan.length]), stride=(1,))
    return out


class _Ranges(torch.Tensor):
    """Where DCP writes the chunks of one saved tensor this rank reads: a
    tensor of the saved size for DCP's checks, holding no elements itself."""

    @staticmethod
    def __new__(cls, size: torch.Size, ranges: List[Tuple[int, torch.Tensor]]):
        made = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=ranges[0][1].dtype))
        made.saved_size = size
        made.ranges = ranges
        return made

    def size(self, dim=None):
        return self.saved_size if dim is None else self.saved_size[dim]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=torch.Size([at]), sizes=torch.Size([t.numel()])) for at, t in self.ranges]

    def __get_tensor_shard__(self, index):
        return next(t for at, t in self.ranges if at == index.offset[0])


class PendingShards:
    """A checkpoint read at the first step (Note [Sharded checkpoints])."""

    def __init__(self, checkpoint_id, key: str, reader, metadata, layouts, rank: int):
        self.checkpoint_id = checkpoint_id
        self.key = key
        self.reader = reader
        self.metadata = metadata
        self.rank = rank
        # Where each saved parameter lies: (bucket, offset, numel), by name.
        self.places = {name: (b, offset, numel) for b, (layout, _) in enumerate(layouts)
                       for name, offset, numel in layout}

    def _saved(self, name: str):
        return self.metadata.state_dict_metadata.get(f"{self.key}.{name}")

    def cut(self, plan: ShardPlan, sharded) -> None:
        """Reads the ranges of every plan's pieces (a collective: every rank is at its first step)."""
        sharded.pending = None
        plans = list(sharded.plans.values())
        names = {id(piece): sharded.names[id(sharded.params[piece.index])] for p in plans for piece in p.pieces}
        # Every plan's parameters, not this rank's pieces: every rank refuses alike, before dcp.load.
        every = [(sharded.names[id(sharded.params[index])], numel) for p in plans for index, _, numel in p.layout
                 if numel]
        wrong = [f"{name!r} ({'not in the checkpoint' if name not in self.places else 'another size'})"
                 for name, numel in every if self.places.get(name, (0, 0, -1))[2] != numel]
        if wrong:
            raise RuntimeError(_error(sharded, (
                f"load_sharded_optimizer_state_dict(): cannot place the saved state of {', '.join(wrong[:3])}"
                f"{' and more' if len(wrong) > 3 else ''}: the checkpoint was saved from another model. Nothing "
                "was stepped.")))
        ranges: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        wanted: Dict[str, object] = {}
        states = []
        for p in plans:
            for piece in p.pieces:
                name = names[id(piece)]
                b, offset, _ = self.places[name]
                keys = self._saved(f"keys.{name}")
                if keys is None:
                    continue  # no state saved: none here either
                states.append((piece, name, b, offset))
                wanted[f"keys.{name}"] = None
                for fqn, md in self.metadata.state_dict_metadata.items():
                    short = fqn[len(self.key) + 1:]
                    if fqn.startswith(f"{self.key}.bucket.{b}."):
                        into = torch.empty(piece.stop - piece.start, dtype=md.properties.dtype, device=sharded.device)
                        ranges.setdefault(short, []).append((offset + piece.start, into))
                    elif fqn.startswith(f"{self.key}.param.{name}.") and hasattr(md, "size"):
                        wanted[short] = torch.empty(md.size, dtype=md.properties.dtype, device=sharded.device)
                    elif fqn.startswith(f"{self.key}.param.{name}."):
                        wanted[short] = None
        for short, found in ranges.items():
            wanted[short] = _Ranges(self.metadata.state_dict_metadata[f"{self.key}.{short}"].size, found)
        loaded = {self.key: wanted}
        dcp.load(loaded, checkpoint_id=self.checkpoint_id, storage_reader=self.reader)
        values = loaded[self.key]
        for piece, name, b, offset in states:
            state = {}
            for key in values[f"keys.{name}"]:
                scalar = values.get(f"param.{name}.{key}")
                if scalar is not None or f"param.{name}.{key}" in values:
                    state[key] = scalar
                else:
                    chunks = values[f"bucket.{b}.{key}"].ranges
                    state[key] = next(t for at, t in chunks if at == offset + piece.start)
            sharded.state[piece.flat] = state

    def refuse_state_dict(self, optimizer) -> None:
        raise RuntimeError(f"DistributedDataParallel on rank {self.rank}: optimizer.state_dict() after "
                           "load_sharded_optimizer_state_dict() and before the next optimizer.step(): the loaded "
                           "state takes its place in the shards at that step. Call it after a step.")


def load(sharded, checkpoint_id, key: str = "optimizer", storage_reader: Optional[object] = None) -> None:
    """Reads the layout and the groups' values that `sharded_optimizer_state_dict()`
    saved under `key` (a collective, as dcp.load); the ranges are read at
    the next optimizer.step()."""
    reader = storage_reader or dcp.FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    if f"{key}.layout" not in metadata.state_dict_metadata:
        raise RuntimeError(_error(sharded, f"load_sharded_optimizer_state_dict(): {checkpoint_id!r} has no sharded "
                                           f"optimizer state under {key!r} (no {key}.layout): save "
                                           f"{{{key!r}: ddp.sharded_optimizer_state_dict()}} with "
                                           "torch.distributed.checkpoint."))
    loaded = {key: {"layout": None, "param_groups": None}}
    dcp.load(loaded, checkpoint_id=checkpoint_id, storage_reader=reader)
    groups = loaded[key]["param_groups"]
    if len(groups) != len(sharded.optimizer.param_groups):
        raise RuntimeError(_error(sharded, f"load_sharded_optimizer_state_dict(): the checkpoint has {len(groups)} "
                                           f"parameter groups, the optimizer {len(sharded.optimizer.param_groups)}."))
    for group, saved in zip(sharded.optimizer.param_groups, groups):
        group.update(dict(saved))
    sharded.state.clear()
    sharded.loaded = {}
    sharded.active = None
    sharded.pending = PendingShards(checkpoint_id, key, reader, metadata, loaded[key]["layout"], sharded.rank)
    if not getattr(sharded, "_checkpoint_hooks", False):
        sharded.optimizer.register_state_dict_pre_hook(
            lambda opt: sharded.pending is not None and sharded.pending.refuse_state_dict(opt))
        sharded.optimizer.register_load_state_dict_pre_hook(lambda opt, state: setattr(sharded, "pending", None))
        sharded._checkpoint_hooks = True
