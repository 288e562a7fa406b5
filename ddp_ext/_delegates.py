"""One-line delegates: how the wrapper keeps torch's DDP method and attribute
names while its collaborators own the code and the state.

    _sync_module_states = delegate("_buffer_sync", "sync_module_states")
    modules_buffers = field("_buffer_sync", "modules_buffers")

`ddp._sync_module_states` is then `ddp._buffer_sync.sync_module_states`, the
collaborator's bound method itself (its signature and docstring included).
`part` may be dotted ("_settings.placement").
"""

from operator import attrgetter


class delegate:  # noqa: N801 - used like `property`
    """A method of the wrapper that is `<part>.<name>` (a non-data
    descriptor: an instance may still shadow it, as a plain method)."""

    def __init__(self, part: str, name: str):
        self.part = part
        self.name = name
        self._owner = attrgetter(part)

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        return getattr(self._owner(wrapper), self.name)


class field(property):  # noqa: N801 - used like `property`
    """An attribute of the wrapper that reads (and, if `settable`, writes)
    `<part>.<name>`."""

    def __init__(self, part: str, name: str, settable: bool = False):
        owner = attrgetter(part)

        def get(wrapper):
            return getattr(owner(wrapper), name)

        def set_(wrapper, value):
            setattr(owner(wrapper), name, value)

        super().__init__(get, set_ if settable else None, doc=f"torch's attribute, kept by {part}.{name}")
        self.part = part
        self.name = name
