"""ddp_ext: distributed data-parallel training with a C++ gradient reducer.

    from ddp_ext import DistributedDataParallel
    model = DistributedDataParallel(model)   # instead of torch's DDP

Layers dropped at random, the same on every rank, and not communicated:

    self.layers = ddp_ext.LayerDrop([Block() for _ in range(12)], p=0.2)

Gradients sent in as few bits as pay, with error feedback:

    model.register_comm_hook(ddp_ext.AdaptivePrecision(), ddp_ext.adaptive_precision_hook)

Streaming DiLoCo across hosts (DDP inside each, an outer step every H steps):

    outer = ddp_ext.DiLoCo(ddp, inner_optimizer, sync_every=100)   # then outer.step() after each step

Round-robin process groups (importing ddp_ext also registers the
torch.distributed backend "round_robin"):

    rr = ddp_ext.new_round_robin_group(num_groups=3)

MPI (importing ddp_ext registers the backend "ddp_ext_mpi" and the rendezvous
"mpi://"; MPI itself is loaded by the first group that uses it):

    dist.init_process_group("ddp_ext_mpi", init_method="mpi://")   # under mpirun
"""

from ddp_ext._build_info import VERSION as __version__
from ddp_ext._loader import load_extension
from ddp_ext._native import core as _C

from ddp_ext.compression import AdaptivePrecision, adaptive_precision_hook  # noqa: E402
from ddp_ext.distributed import DistributedDataParallel  # noqa: E402
from ddp_ext.diloco import DiLoCo  # noqa: E402
from ddp_ext._late_gradients import LocalGradientWarning  # noqa: E402
from ddp_ext.layer_drop import LayerDrop  # noqa: E402
from ddp_ext.round_robin import RoundRobinOptions, new_round_robin_group, round_robin_group  # noqa: E402
from ddp_ext import mpi  # noqa: E402,F401  (registers "ddp_ext_mpi" and "mpi://")
from ddp_ext import _exit  # noqa: E402,F401  (releases process groups at exit: Note [Exit after training])

__all__ = [
    "AdaptivePrecision",
    "DiLoCo",
    "DistributedDataParallel",
    "LayerDrop",
    "LocalGradientWarning",
    "adaptive_precision_hook",
    "RoundRobinOptions",
    "load_extension",
    "new_round_robin_group",
    "round_robin_group",
    "__version__",
]
