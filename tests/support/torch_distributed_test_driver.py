"""Runs tests of torch's own DistributedTest._DistTestBase (shipped in the
wheel as torch.testing._internal.distributed.distributed_test) with
torch.nn.parallel.DistributedDataParallel replaced by ddp_ext's, the way
pytorch's test/distributed/test_distributed_spawn.py drives them: a
TestDistBackend subclass whose ranks are spawned processes, configured by
the environment (BACKEND, WORLD_SIZE, TEMP_DIR).

    BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python tests/support/torch_distributed_test_driver.py TestWithDdpExt.test_ddp_logging_data_cpu

Each spawned rank imports this file again as its main module, so the
replacement holds there too (tests/test_torch_c10d_behaviour.py runs it)."""

import os
import sys

# torch's run_tests writes an XML report (and needs xmlrunner) whenever CI is
# set; this driver reports through its exit status only.
os.environ.pop("CI", None)

import torch  # noqa: E402

import ddp_ext  # noqa: E402

# The tests call nn.parallel.DistributedDataParallel(...) at run time.
torch.nn.parallel.DistributedDataParallel = ddp_ext.DistributedDataParallel

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestWithDdpExt(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    assert torch.nn.parallel.DistributedDataParallel is ddp_ext.DistributedDataParallel
    sys.exit(run_tests())
