"""Communication hooks: the one place that turns what the user registers (a
Python hook under torch's contract, ddp_ext's adaptive-precision hook, or
one of torch's built-in hook types) into a C++ hook for the reducer. See
Note [Communication hooks] in comm_hooks/comm_hook.h for how they run."""

import hashlib
import inspect
from typing import List

import torch
import torch.distributed as dist

from ddp_ext import _model_check
from ddp_ext._native import core as _C
from ddp_ext._bound import Bound
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


# torch's hooks that step parameters themselves once their bucket is reduced
# (ZeroRedundancyOptimizer's overlap, the overlapped optimizers of
# _register_fused_optim): found by the module that defines them.
_STEPPING_HOOK_MODULES = (
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks",
)


def steps_parameters(hook) -> bool:
    return getattr(hook, "__module__", None) in _STEPPING_HOOK_MODULES


def hook_name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


class CommHooks(Bound):
    """The hooks registered on one wrapper (torch's `_comm_hooks`: (name,
    state) pairs), installed into its reducer; and the checks every rank
    runs at its first forward. A copy starts with none (the default
    reduction): hooks hold process groups and state that do not travel."""

    def __init__(self, reducer, group, device, logging, tuning, backward_steps):
        self.device = device
        self.logging = logging  # LoggingData: errors are recorded there, as torch's
        self.tuning = tuning  # CapTuning: a stateful hook stops it
        self.backward_steps = backward_steps  # BackwardSteps: admits a hook that steps parameters
        self.registered: List[tuple] = []
        self.first_forward_done = False  # torch's _lazy_init_ran
        self.store_key = None  # where the peers meet in the store (ddp_ext/_diagnosis)
        self.bind(reducer, group)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "registered": []}

    def check(self, hook) -> None:
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as error:
            self.logging.record_error(f"{type(error)}: {error}")  # as torch's _log_and_throw
            raise

    def register(self, state: object, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> torch.futures.Future`
        instead of the default averaging allreduce (torch's contract: the
        bucket holds gradients not yet divided by the world size; the
        future's value is the reduced buffer). Once only, between iterations."""
        self.check(hook)
        if steps_parameters(hook):
            self.backward_steps.check_stepping_hook(hook_name(hook))
        self._install(self._native_hook(state, hook), hook_name(hook), state)
        if steps_parameters(hook):
            self.backward_steps.stepping_hook_installed(hook_name(hook))

    def register_builtin(self, comm_hook_type) -> None:
        """A C++ hook that runs without the GIL: ALLREDUCE or FP16_COMPRESS."""
        self._install(_C.builtin_comm_hook(comm_hook_type, self.process_group), str(comm_hook_type), None)

    def _native_hook(self, state, hook):
        if hook is adaptive_precision_hook:
            # The same hook, run in C++ without the GIL.
            if not isinstance(state, AdaptivePrecision):
                raise TypeError(
                    f"adaptive_precision_hook needs a ddp_ext.AdaptivePrecision as its state, got {type(state).__name__}"
                )
            return _C.adaptive_precision_comm_hook(state._bind(self.process_group, meeting=self.store_key))
        return _C.python_comm_hook(state, hook)

    def _install(self, native, name: str, state) -> None:
        if getattr(self.backward_steps.overlap, "reduce_scatters", False):
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.process_group.rank()} cannot register the communication hook "
                f"{name} with overlap_optimizer(..., shard=True): the reducer reduce-scatters each bucket itself. "
                "Use one or the other.")
        self.reducer._register_comm_hook(native)
        self.registered.append((name, state))
        self.logging.hook_registered(name)
        # See Note [Hooks registered after the first forward] in reducer/agreement/step_check.h.
        self.reducer._set_comm_hook_fingerprint(self.fingerprint(), confirm=self.first_forward_done)
        if native.keeps_per_bucket_state:
            # stacklevel: the warning names the line that registered the hook.
            self.tuning.freeze(f"the communication hook {name} may keep state per bucket", stacklevel=5)

    def first_forward(self) -> None:
        """At the first forward, which every rank runs (a rank that joins
        before it runs it from its Join hook)."""
        self.backward_steps.check_no_optimizer_in_backward()
        self.agree()
        self.first_forward_done = True

    def agree(self) -> None:
        """Raises the same RuntimeError on every rank when the ranks
        registered different communication hooks (or a hook on some ranks
        only): their buckets would run different collectives, which pair
        wrongly or wait for each other. Run once, at the first forward,
        before any gradient is averaged; two small allgathers. Hooks are
        compared by name: their states may differ in type (None or the group
        a hook defaults to). A hook registered later is compared by every
        backward's step check (Note [Hooks registered after the first
        forward] in reducer/agreement/step_check.h)."""
        mine = self.text()
        group = self.process_group
        every_rank = [b.decode() for b in _model_check.allgather_bytes(group, mine.encode(), self.device)]
        if len(set(every_rank)) == 1:
            return
        described = "; ".join(f"rank {rank}: {hooks}" for rank, hooks in enumerate(every_rank))
        raise RuntimeError(
            f"DistributedDataParallel: the ranks registered different communication hooks ({described}). "
            "Each rank's buckets would run different collectives, which pair wrong gradients or wait for each other "
            "until the process group's timeout: register the same hook on every rank "
            "before the first forward."
        )

    def text(self) -> str:
        return "; ".join(name for name, _ in self.registered) or "none"

    def fingerprint(self) -> int:
        """1 without a hook; else a positive 62-bit hash of the hooks' names,
        the same on every rank for the same names."""
        text = self.text()
        if text == "none":
            return 1
        return 2 + int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % (2**62)


def register_fused_optim(ddp, optim: type, *args, optim_params=None, **kwargs) -> None:
    """Steps `optim` on each bucket as soon as it is reduced, through a
    communication hook that it registers on the wrapper `ddp` (torch's
    overlapped optimizers)."""
    from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

    overlapped = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
    try:
        overlapped.register_ddp(ddp)
    except NotImplementedError as e:
        raise RuntimeError(f"{optim} does not support overlapped DDP.") from e
