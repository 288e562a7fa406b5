"""Which parameters the wrapper reduces, and torch's DDP helpers about them
that frameworks call (functions of the wrapper, under torch's method names
there)."""

from typing import Dict

from torch import nn


def named_params_for_reducer(ddp, module: nn.Module):
    """(name, parameter) of every parameter that requires grad and is not
    ignored, each shared parameter once."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ddp.parameters_to_ignore]


def build_params_for_reducer(ddp):
    """torch's contract: (parameters, expect_sparse_gradient)."""
    params = [p for _, p in ddp._named_params_for_reducer(ddp.module)]
    sparse = ddp._parameters_with_sparse_gradients()
    ddp._assign_modules_buffers()
    return params, [id(p) in sparse for p in params]


def parameters_with_sparse_gradients(ddp) -> set:
    """ids of the parameters whose modules produce sparse gradients."""
    return {
        id(p)
        for m in ddp.module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


def build_debug_param_to_name_mapping(ddp, parameters) -> Dict[int, str]:
    names = {p: n for n, p in ddp._named_params_for_reducer(ddp.module)}
    return {i: names[p] for i, p in enumerate(parameters)}


def get_parameters(ddp, m, recurse=True):
    for mod in m.modules() if recurse else [m]:
        former = getattr(mod, "_former_parameters", None)
        yield from former.values() if former is not None else mod.parameters(recurse=False)


def get_data_parallel_params(module, named_params=False):
    for param in module.named_parameters() if named_params else module.parameters():
        if not hasattr(param[1] if named_params else param, "_ddp_ignored"):
            yield param


def set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
    """Parameters and buffers (fully qualified names) that DDP neither
    broadcasts nor reduces; call before wrapping the module."""
    module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name in params_and_buffers_to_ignore:
            tensor._ddp_ignored = True
