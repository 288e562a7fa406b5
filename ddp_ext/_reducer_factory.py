"""Building the wrapper's C++ Reducer from its settings."""

from ddp_ext._native import core as _C
from ddp_ext._arguments import backend_name


def build_reducer(named_params, sparse_ids: set, settings, caps, static_graph: bool, process_group, reducer_group,
                  layer_units, buffers_broadcast: bool):
    """A Reducer over `named_params` (name, parameter) that reduces over
    `reducer_group`, cutting buckets with `caps` (a BucketCaps; its first
    buckets as torch's DDP with `static_graph` would); `sparse_ids`: ids of
    the parameters with sparse gradients; `buffers_broadcast`: whether the
    forward broadcasts buffers (Note [The step check on bucket 0] in
    reducer/agreement/step_check.h)."""
    params = [p for _, p in named_params]
    sparse = [id(p) in sparse_ids for p in params]
    if any(sparse) and backend_name(process_group) == "nccl":
        raise ValueError(
            "NCCL cannot reduce sparse gradients, and this module has an Embedding or "
            "EmbeddingBag with sparse=True: use sparse=False, or a Gloo process group."
        )
    options = settings.reducer_options(caps, layer_units, static_graph)
    options.buffers_broadcast = buffers_broadcast
    return _C.Reducer(params, [n for n, _ in named_params], reducer_group, options, sparse)
