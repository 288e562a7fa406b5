"""Fixtures every test may use; tests/conftest.py makes them visible."""

import os

import pytest


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
