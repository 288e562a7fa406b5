"""The framework adapters stay out of the way: `import ddp_ext` imports no
framework, and the Accelerate adapter's name swap is undone on the way out."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_ddp_ext_imports_no_framework():
    code = (
        "import sys, ddp_ext, ddp_ext.integrations\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric', 'accelerate'))\n"
        "assert not loaded, loaded\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_ddp_ext_as_torch_ddp_swaps_the_name_and_restores_it():
    pytest.importorskip("accelerate")
    import ddp_ext
    from ddp_ext.integrations.accelerate import ddp_ext_as_torch_ddp

    torch_ddp = torch.nn.parallel.DistributedDataParallel
    with pytest.raises(KeyError):
        with ddp_ext_as_torch_ddp():
            assert torch.nn.parallel.DistributedDataParallel is ddp_ext.DistributedDataParallel
            # torch's own module keeps its class.
            assert torch.nn.parallel.distributed.DistributedDataParallel is torch_ddp
            raise KeyError("leaving by an exception")
    assert torch.nn.parallel.DistributedDataParallel is torch_ddp
