"""Catches parameters added to or replaced in a module after it was wrapped:
the reducer never sees them, so they would train on each rank alone.

torch's global registration hooks bump one counter whenever any module
anywhere registers a parameter or a submodule. A forward compares that
counter with the one it last saw (one integer comparison); only when it moved
does it compare the wrapped module's parameters with those the reducer was
built with, and raise if they differ.
"""

from typing import List, Tuple

import torch
from torch import nn

_registrations = 0
_hooks = None


def _count(*_args) -> None:
    global _registrations
    # Registrations that torch.compile traces happen at trace time, not in
    # the user's training loop; counting them would put a guard on the
    # counter into every compiled graph and recompile whenever it moves.
    if torch.compiler.is_compiling():
        return
    _registrations += 1


def _install_hooks() -> None:
    global _hooks
    if _hooks is None:
        module_hooks = torch.nn.modules.module
        _hooks = (
            module_hooks.register_module_parameter_registration_hook(_count),
            module_hooks.register_module_module_registration_hook(_count),
        )


class ParameterWatch:
    def __init__(self, module: nn.Module, ignored):
        _install_hooks()
        self.ignored = set(ignored)
        self.expected = self._snapshot(module)
        self.seen = _registrations

    def _snapshot(self, module: nn.Module) -> List[Tuple[str, int]]:
        return [(n, id(p)) for n, p in module.named_parameters() if n not in self.ignored]

    def check(self, module: nn.Module, process_group) -> None:
        if self.seen == _registrations:
            return
        self.seen = _registrations
        now = self._snapshot(module)
        if now == self.expected:
            return
        before, after = dict(self.expected), dict(now)
        added = [n for n in after if before.get(n) != after[n]]
        removed = [n for n in before if n not in after]
        raise RuntimeError(
            f"DistributedDataParallel on rank {process_group.rank()}: the module's parameters changed after it was "
            f"wrapped (added or replaced: {added or 'none'}; removed: {removed or 'none'}), and the "
            "reducer only synchronises the parameters it was built with, so the new ones would "
            "train on each rank alone. Finish building the module, then wrap it (or wrap it again)."
        )
