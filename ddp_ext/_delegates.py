"""One-line delegates: how the wrapper keeps torch's DDP method and attribute
names while its collaborators own the code and the state.

    _sync_module_states = delegate("_buffer_sync", "sync_module_states")
    modules_buffers = field("_buffer_sync", "modules_buffers")

`ddp._sync_module_states` is then `ddp._buffer_sync.sync_module_states`, the
collaborator's bound method itself (its signature and docstring included).
`part` may be dotted ("_settings.placement"). Plain getattr calls, which
dynamo traces: a field read inside the forward's frames breaks no graph
(Note [torch.compile] in ddp_ext/distributed.py).
"""


def _owner(wrapper, path):
    for name in path:
        wrapper = getattr(wrapper, name)
    return wrapper


class delegate:  # noqa: N801 - used like `property`
    """A method of the wrapper that is `<part>.<name>` (a non-data
    descriptor: an instance may still shadow it, as a plain method)."""

    def __init__(self, part: str, name: str):
        self.part = part
        self.name = name
        self._path = tuple(part.split("."))

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        return getattr(_owner(wrapper, self._path), self.name)


class field(property):  # noqa: N801 - used like `property`
    """An attribute of the wrapper that reads (and, if `settable`, writes)
    `<part>.<name>`."""

    def __init__(self, part: str, name: str, settable: bool = False):
        path = tuple(part.split("."))

        def get(wrapper):
            return getattr(_owner(wrapper, path), name)

        def set_(wrapper, value):
            setattr(_owner(wrapper, path), name, value)

        super().__init__(get, set_ if settable else None, doc=f"torch's attribute, kept by {part}.{name}")
        self.part = part
        self.name = name
