"""The JIT path: a checkout without a prebuilt ddp_ext._C still imports, by
compiling the same sources with torch.utils.cpp_extension.load."""

import os
import shutil
import subprocess
import sys
import textwrap

from ddp_ext import _build_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh interpreter inside the copied checkout.
_PROBE = textwrap.dedent(
    """
    import os, sys
    # An editable install of another checkout would hand out its prebuilt _C.
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import torch, torch.distributed as dist
    import ddp_ext
    assert ddp_ext._C.__name__ == "ddp_ext_jit", ddp_ext._C.__name__
    assert os.path.dirname(ddp_ext.__file__).startswith(os.getcwd()), ddp_ext.__file__
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    net = torch.nn.Linear(3, 2)
    ddp = ddp_ext.DistributedDataParallel(net)
    ddp(torch.ones(4, 3)).sum().backward()
    assert torch.equal(net.weight.grad, torch.ones(2, 3) * 4), net.weight.grad
    dist.destroy_process_group()
    print("jit ok", ddp_ext._C.torch_version)
    """
)


def _copy_checkout_without_binaries(dest):
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "build")
    shutil.copytree(os.path.join(ROOT, "ddp_ext"), os.path.join(dest, "ddp_ext"), ignore=ignore)
    for source in _build_info.SOURCES:
        top = source.split("/")[0]
        target = os.path.join(dest, top)
        if os.path.exists(target):
            continue
        if os.path.isdir(os.path.join(ROOT, top)):
            shutil.copytree(os.path.join(ROOT, top), target, ignore=ignore)
        else:
            shutil.copy(os.path.join(ROOT, top), target)


def test_import_falls_back_to_jit_build_in_fresh_process(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _copy_checkout_without_binaries(str(checkout))
    env = dict(os.environ, PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=checkout, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    assert "jit ok" in done.stdout
