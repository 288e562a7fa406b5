import os
import sys

# Tests import the checkout's ddp_ext (built in place by `pip install -e .` or
# `python setup.py build_ext --inplace`), and spawned ranks inherit this path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture
def single_process_group(tmp_path):
    """The default process group of a world of one process (this one), for
    single-process tests of the wrapper; destroyed afterwards."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()
