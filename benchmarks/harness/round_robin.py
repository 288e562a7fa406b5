"""Access to ddp_ext's round-robin process group (issue 4), which the roundrobin
experiment and the round-robin half of allreduce need."""

import ddp_ext

API = 'ddp_ext.new_round_robin_group(num_groups=N, backend="gloo")'


class RoundRobinUnavailable(RuntimeError):
    pass


def require_round_robin():
    """The group factory, or an error saying what is missing and what to do."""
    factory = getattr(ddp_ext, "new_round_robin_group", None)
    if factory is None:
        raise RoundRobinUnavailable(
            f"this ddp_ext ({ddp_ext.__file__}) has no {API}: the round-robin process group (issue 4) "
            "is not part of this build yet. Merge it and rebuild the extension, or, for allreduce, pass "
            "--no-round-robin to measure plain Gloo only."
        )
    return factory


def new_round_robin_group(num_groups: int, backend: str = "gloo"):
    """A round-robin group of `num_groups` `backend` children; collective, so every rank must call it."""
    return require_round_robin()(num_groups=num_groups, backend=backend)


def label(num_groups: int) -> str:
    return f"rr{num_groups}"
