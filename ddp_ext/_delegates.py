"""One-line delegates: how the wrapper keeps torch's DDP method and attribute
names while its collaborators own the code and the state.

    _sync_module_states = delegate("_buffer_sync", "sync_module_states")
    modules_buffers = field("_buffer_sync", "modules_buffers")

`ddp._sync_module_states` is then `ddp._buffer_sync.sync_module_states`, the
collaborator's bound method itself (its signature and docstring included).
"""

from operator import attrgetter
from typing import Optional


class delegate:  # noqa: N801 - used like `property`
    """A method of the wrapper that is `<part>.<name>` (a non-data
    descriptor: an instance may still shadow it, as a plain method)."""

    def __init__(self, part: str, name: str):
        self.part = attrgetter(part)
        self.name = name

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        return getattr(self.part(wrapper), self.name)


def field(part: str, name: str, settable: bool = False, doc: Optional[str] = None) -> property:
    """An attribute of the wrapper that reads (and, if `settable`, writes)
    `<part>.<name>`; `part` may be dotted ("_settings.placement")."""
    owner = attrgetter(part)

    def get(wrapper):
        return getattr(owner(wrapper), name)

    def set_(wrapper, value):
        setattr(owner(wrapper), name, value)

    return property(get, set_ if settable else None, doc=doc or f"torch's attribute, kept by {part}.{name}")
