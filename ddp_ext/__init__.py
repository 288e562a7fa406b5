"""ddp_ext: distributed data-parallel training with a C++ gradient reducer.

    from ddp_ext import DistributedDataParallel
    model = DistributedDataParallel(model)   # instead of torch's DDP
"""

from ddp_ext._build_info import VERSION as __version__
from ddp_ext._loader import load_extension, native_module

_C = native_module()

from ddp_ext.distributed import DistributedDataParallel  # noqa: E402

__all__ = ["DistributedDataParallel", "load_extension", "__version__"]
