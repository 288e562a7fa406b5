import os
import sys

# Tests import the checkout's ddp_ext (built in place by `pip install -e .` or
# `python setup.py build_ext --inplace`) and its benchmarks/, and spawned ranks
# inherit this path. Helpers and test doubles are in tests/support/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.support.fixtures import single_process_group  # noqa: E402,F401
