"""Checks on communication hooks before they reach the C++ reducer; see
Note [Communication hooks] in reducer/reducer.cpp for how they run."""

import inspect

import torch
import torch.distributed as dist


def check_comm_hook(hook) -> None:
    """Raises as torch's DDP does for a hook that cannot be one."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
        )
    if getattr(hook, "__name__", "") in ("bf16_compress_hook", "bf16_compress_wrapper_hook"):
        nccl_ok = torch.version.cuda is not None and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
        if not nccl_ok:
            raise TypeError("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+")


def hook_name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__
