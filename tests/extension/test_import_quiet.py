"""A bare `import ddp_ext` prints nothing (no NumPy warning from torch, no
build chatter when the extension is built)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_prints_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code = "import ddp_ext, os; assert ddp_ext.__file__.startswith(os.getcwd()), ddp_ext.__file__"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
