"""The switches of the wrapper's iteration that several collaborators read
and write (under torch's DDP names on the wrapper)."""

import dataclasses


@dataclasses.dataclass
class SyncFlags:
    # require_backward_grad_sync: the next backward averages gradients
    # (False inside no_sync).
    backward: bool = True
    # require_forward_param_sync: the next forward broadcasts buffers (only
    # after a synchronising forward, paper section 4.1).
    forward_buffers: bool = True
    # static_graph: set by _set_static_graph, never unset.
    static_graph: bool = False
