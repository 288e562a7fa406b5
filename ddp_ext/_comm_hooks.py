"""Communication hooks: the one place that turns what the user registers (a
Python hook under torch's contract, ddp_ext's adaptive-precision hook, or
one of torch's built-in hook types) into a C++ hook for the reducer. See
Note [Communication hooks] in comm_hooks/comm_hook.h for how they run."""

import hashlib
import inspect

import torch
import torch.distributed as dist

from ddp_ext import _C, _model_check
from ddp_ext.compression import AdaptivePrecision, adaptive_precision_hook


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


def register_comm_hook(ddp, state: object, hook) -> None:
    """Reduce each bucket with `hook(state, bucket) -> torch.futures.Future`
    instead of the default averaging allreduce (torch's contract: the bucket
    holds gradients not yet divided by the world size; the future's value
    is the reduced buffer). Once only, between iterations."""
    ddp._check_comm_hook(hook)  # records the error in the logging data, as torch's
    native = _native_hook(ddp, state, hook)
    _install(ddp, native, hook_name(hook), state)
    if _stops_tuning(ddp, native):  # here, so that the warning names the caller's line
        ddp._auto_buckets.freeze(f"the communication hook {hook_name(hook)} may keep state per bucket")


def register_builtin_comm_hook(ddp, comm_hook_type) -> None:
    """A C++ hook that runs without the GIL: ALLREDUCE or FP16_COMPRESS."""
    native = _C.builtin_comm_hook(comm_hook_type, ddp.process_group)
    _install(ddp, native, str(comm_hook_type), None)
    if _stops_tuning(ddp, native):
        ddp._auto_buckets.freeze(f"the communication hook {comm_hook_type} may keep state per bucket")


def agree_on_hooks(ddp) -> None:
    """Raises the same RuntimeError on every rank when the ranks registered
    different communication hooks (or a hook on some ranks only): their
    buckets would run different collectives, which pair wrongly or wait for
    each other. Run once, at the first forward, before any gradient is
    averaged; two small allgathers. Hooks are compared by name: their states
    may differ in type (None or the group a hook defaults to). A hook
    registered later is compared by every backward's step check (Note [Hooks
    registered after the first forward] in reducer/agreement/step_check.h)."""
    mine = _hooks_text(ddp)
    every_rank = [b.decode() for b in _model_check.allgather_bytes(ddp.process_group, mine.encode(), ddp.device)]
    if len(set(every_rank)) == 1:
        return
    described = "; ".join(f"rank {rank}: {hooks}" for rank, hooks in enumerate(every_rank))
    raise RuntimeError(
        f"DistributedDataParallel: the ranks registered different communication hooks ({described}). "
        "Each rank's buckets would run different collectives, which pair wrong gradients or wait for each other "
        "until the process group's timeout: register the same hook on every rank "
        "before the first forward."
    )


def _native_hook(ddp, state, hook):
    if hook is adaptive_precision_hook:
        # The same hook, run in C++ without the GIL.
        if not isinstance(state, AdaptivePrecision):
            raise TypeError(
                f"adaptive_precision_hook needs a ddp_ext.AdaptivePrecision as its state, got {type(state).__name__}"
            )
        return _C.adaptive_precision_comm_hook(state._bind(ddp.process_group, meeting=ddp._store_key))
    return _C.python_comm_hook(state, hook)


def _install(ddp, native, name: str, state) -> None:
    ddp.reducer._register_comm_hook(native)
    ddp._comm_hooks.append((name, state))
    # See Note [Hooks registered after the first forward] in reducer/agreement/step_check.h.
    ddp.reducer._set_comm_hook_fingerprint(hooks_fingerprint(ddp), confirm=ddp._lazy_init_ran)


def _hooks_text(ddp) -> str:
    return "; ".join(name for name, _ in ddp._comm_hooks) or "none"


def hooks_fingerprint(ddp) -> int:
    """1 without a hook; else a positive 62-bit hash of the hooks' names, the
    same on every rank for the same names."""
    text = _hooks_text(ddp)
    if text == "none":
        return 1
    return 2 + int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % (2**62)


def _stops_tuning(ddp, native) -> bool:
    """See Note [Auto-tuned bucket caps], point 5: a layout change would hand
    the state of a hook that keeps some per bucket to other parameters."""
    return ddp._auto_buckets is not None and native.keeps_per_bucket_state


def register_fused_optim(ddp, optim: type, *args, optim_params=None, **kwargs) -> None:
    """Steps `optim` on each bucket as soon as it is reduced, through a
    communication hook (torch's overlapped optimizers)."""
    from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

    overlapped = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
    try:
        overlapped.register_ddp(ddp)
    except NotImplementedError as e:
        raise RuntimeError(f"{optim} does not support overlapped DDP.") from e
