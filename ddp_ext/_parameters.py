"""Which parameters the wrapper reduces, and torch's DDP helpers about them
that frameworks call (under torch's method names on the wrapper)."""

from typing import Dict, List, Tuple

from torch import nn


class ReducedParameters:
    """The module's parameters that require grad and are not ignored."""

    def __init__(self, module: nn.Module, ignored):
        self.module = module
        self.ignored = ignored  # names neither broadcast nor reduced

    def named(self, module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
        """(name, parameter) of every parameter of `module` that requires
        grad and is not ignored, each shared parameter once."""
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self.ignored]

    def with_sparsity(self):
        """torch's _build_params_for_reducer: (parameters, expect_sparse_gradient)."""
        params = [p for _, p in self.named(self.module)]
        sparse = self.with_sparse_gradients()
        return params, [id(p) in sparse for p in params]

    def with_sparse_gradients(self) -> set:
        """ids of the parameters whose modules produce sparse gradients."""
        return {
            id(p)
            for m in self.module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
            for p in m.parameters(recurse=False)
        }

    def debug_names(self, parameters) -> Dict[int, str]:
        """torch's _build_debug_param_to_name_mapping."""
        names = {p: n for n, p in self.named(self.module)}
        return {i: names[p] for i, p in enumerate(parameters)}


def get_parameters(m: nn.Module, recurse: bool = True):
    """torch's _get_parameters."""
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
