"""What makes a process a replica, and sending it from a live peer.

Note [What a replica holds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A replica that joins (a restarted or new process, or one the coordinator
dropped and that came back) receives, from the lowest-ranked member that
holds the newest committed state, over the new epoch's Gloo group (point to
point, nothing passes through the coordinator):
  - the module's state_dict (parameters and buffers) and the optimizer's;
  - the committed step count;
  - ddp_ext's replicated state: the bucket caps in use and, with
    bucket_cap_mb="auto", the bucket tuner (its stage, candidate and
    history); each LayerDrop's seed and plan count.
The bucket order is not sent: at every new epoch each member, survivors
included, wraps the module in a fresh DistributedDataParallel over the new
group (the reducer learns "the group changed" only through that), so all
members start from the same construction layout cut with the carried caps,
and the first backward in the new group rebuilds the order from rank 0's, as
torch's DDP does after a new process group. Per-rank state stays per rank:
compression residuals (error feedback) and communication hooks start afresh
on every member at a new epoch (hooks are registered again through the
Replica's `configure` callback).
"""

import hashlib
import io
import pickle
from typing import List, Optional, Tuple

import torch
from torch import nn

from ddp_ext.layer_drop import LayerDrop


def fingerprint(module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> str:
    """Names, shapes and dtypes of parameters and buffers, and the optimizer's class."""
    h = hashlib.sha256()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    h.update(type(optimizer).__name__.encode() if optimizer is not None else b"-")
    return h.hexdigest()[:16]


def layer_drops(module: nn.Module) -> List[LayerDrop]:
    return [m for m in module.modules() if isinstance(m, LayerDrop)]


def layer_drop_counters(module: nn.Module) -> List[Tuple[int, int]]:
    return [(m.seed, m.draws) for m in layer_drops(module)]


def set_layer_drop_counters(module: nn.Module, counters: List[Tuple[int, int]]) -> None:
    for m, (seed, draws) in zip(layer_drops(module), counters):
        m.seed, m.draws = int(seed), int(draws)


def capture(module, optimizer, step: int, caps: List[int], auto_buckets) -> bytes:
    state = {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "caps": list(caps),
        "auto_buckets": pickle.dumps(auto_buckets) if auto_buckets is not None else None,
        "layer_drops": layer_drop_counters(module),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def restore(blob: bytes, module, optimizer) -> dict:
    state = torch.load(io.BytesIO(blob), weights_only=False)
    module.load_state_dict(state["module"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_layer_drop_counters(module, state["layer_drops"])
    state["auto_buckets"] = pickle.loads(state["auto_buckets"]) if state["auto_buckets"] is not None else None
    return state


def send(group, blob: bytes, dst: int) -> None:
    payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    group.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0).wait()
    group.send([payload], dst, 1).wait()


def receive(group, src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([payload], src, 1).wait()
    return payload.numpy().tobytes()
