"""The native core, loaded once for every module that calls into it: the
prebuilt ddp_ext._C, or a JIT build of the same sources (ddp_ext/_loader.py).

    from ddp_ext._native import core
"""

from ddp_ext._loader import native_module

core = native_module()
