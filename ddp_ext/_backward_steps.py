"""What steps parameters inside the backward: the one owner of the
reducer's bucket step. At most one of overlap_optimizer (ddp_ext/
_optimizer_overlap.py), torch's communication hooks that step each bucket's
parameters themselves (ZeroRedundancyOptimizer's overlap,
_register_fused_optim), and optimizers applied in backward (Note
[Optimizers applied in backward]); none at all once refused (a caller that
applies steps itself: ddp_ext.fault_tolerance)."""

from typing import List, Optional, Tuple

import torch

from ddp_ext import _forward_tail
from ddp_ext._bound import Bound
from ddp_ext._optimizer_overlap import OptimizerOverlap, hooked_step_refusal, shown_names
from ddp_ext._shard_admission import agreed_shard_min_bytes, elementwise_refusal
from ddp_ext._sharded_optimizer import ShardedOptimizer


def has_optimizers_in_backward(parameters) -> bool:
    return any(hasattr(p, "_in_backward_optimizers") for p in parameters)


class BackwardSteps(Bound):
    """One wrapper's steps inside the backward. A copy starts with none: its
    reducer is new, and hooks and optimizers do not travel."""

    def __init__(self, reducer, group, module, module_parameters, named_params, mixed_precision):
        self.module = module  # the parameters' names, for errors
        self.module_parameters = module_parameters  # those not ignored
        self.named = named_params  # the reducer's parameters, in its order
        self.mixed_precision = mixed_precision
        self.overlap: Optional[OptimizerOverlap] = None
        self.stepping: List[str] = []  # the names of registered hooks that step parameters themselves
        self.in_backward_set_up = False  # Note [Optimizers applied in backward]
        self.refused: Optional[str] = None  # why nothing may step parameters in the backward
        self.bind(reducer, group)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "overlap": None, "stepping": [], "refused": None}

    def _rank(self) -> int:
        return self.process_group.rank()

    # --- refusing every step inside the backward ------------------------------

    def refuse(self, because: str) -> None:
        """From now on nothing may step parameters inside the backward.
        `because` ends the error; raises it at once where one is in place."""
        self.refused = because
        in_place = ("overlap_optimizer" if self.overlap is not None else
                    self.stepping[0] if self.stepping else
                    "optimizers applied in backward" if has_optimizers_in_backward(self.module_parameters) else None)
        if in_place:
            self.check(in_place)

    def check(self, what: str) -> None:
        """Raises if `what`, which steps parameters inside the backward, is refused here."""
        if self.refused:
            raise ValueError(f"DistributedDataParallel on rank {self._rank()} cannot step parameters inside the "
                             f"backward ({what}): {self.refused}")

    # --- communication hooks that step parameters (ddp_ext/_comm_hooks.py) ---

    def check_stepping_hook(self, name: str) -> None:
        self.check(name)
        if self.overlap is not None:
            raise RuntimeError(
                f"DistributedDataParallel on rank {self._rank()}: cannot register {name}, which steps parameters "
                "itself, after overlap_optimizer: the parameters would be stepped twice. Use one or the other.")

    def stepping_hook_installed(self, name: str) -> None:
        self.stepping.append(name)

    # --- overlap_optimizer ---------------------------------------------------------

    def overlap_optimizer(self, optimizer, overlap_forward, forward_refusal: Optional[str]) -> OptimizerOverlap:
        """Installs the overlapped optimizer, after refusing on every rank
        alike what it cannot do exactly, before anything is installed.
        `forward_refusal`: why the forward cannot be overlapped, if it cannot."""
        held = _forward_tail.fraction(overlap_forward)
        self.check("overlap_optimizer")
        self._check_optimizer(optimizer)
        if held and forward_refusal:
            raise ValueError(f"DistributedDataParallel.overlap_optimizer on rank {self._rank()} {forward_refusal}")
        self.overlap = OptimizerOverlap(self.reducer, optimizer, self.named, self._rank(), held)
        return self.overlap

    def shard_optimizer(self, optimizer, refusal: str, device, overlap_forward: bool,
                        shard_min_bytes: int, gather_group) -> ShardedOptimizer:
        """Installs the sharded optimizer (ddp_ext/_sharded_optimizer.py), after
        refusing on every rank alike what it cannot do exactly. `refusal`:
        why the wrapper's settings cannot shard, if they cannot; buckets of
        fewer than `shard_min_bytes` bytes are replicated (Note [Replicated
        small buckets] in reducer/transport/reduce_scatter.h). `gather_group`:
        the reducer's group, over which the parameters are all-gathered; a
        hierarchical one (ddp_ext/hierarchy.py) gives the reducer back the
        flat group (Note [Sharding over several hosts])."""
        self.check("overlap_optimizer(shard=True)")
        why = (elementwise_refusal(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else "") or refusal
        local = None
        if not why:
            try:  # this rank's own checks (a step hook may be registered on one rank only)
                self._check_optimizer(optimizer, sharded=True)
            except (TypeError, ValueError, RuntimeError) as error:
                local = error
        # A collective, which also tells every rank whether any rank refuses (its settings may be its own).
        why = agreed_shard_min_bytes(shard_min_bytes, self.process_group, device, why or str(local or ""))
        if local is not None:
            raise local
        if why:
            raise ValueError(f"DistributedDataParallel.overlap_optimizer(..., shard=True) on rank {self._rank()} "
                             f"{why}")
        self.overlap = ShardedOptimizer(optimizer, self.named, self.process_group, device, bool(overlap_forward),
                                        shard_min_bytes, gather_group)
        if gather_group is not self.process_group:
            self.reducer._update_process_group(self.process_group)  # Note [Sharding over several hosts]
        self.reducer._set_reduce_scatter(self.overlap.step_bucket, shard_min_bytes)  # Note [Sharded buckets]
        return self.overlap

    def check_regroup(self) -> None:
        """Raises if the process group may not change now (buckets still on the wire)."""
        if self.overlap is not None:
            self.overlap.check_regroup()

    def _error(self, what: str) -> str:
        return f"DistributedDataParallel on rank {self._rank()}: overlap_optimizer {what}"

    def _check_optimizer(self, optimizer, sharded: bool = False) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(self._error(f"needs a torch.optim.Optimizer, got {type(optimizer).__name__}"))
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(self._error(
                "cannot overlap torch.optim.LBFGS: its step needs a closure that runs forward and backward "
                "again, and mixes every parameter's gradient in one line search."))
        if self.reducer is None:
            raise ValueError(self._error(
                "has no bucket to step: every parameter is in delay_all_reduce_named_params, reduced after "
                "the backward."))
        if self.overlap is not None:
            raise RuntimeError(self._error("was called already on this wrapper; it takes one optimizer, once."))
        if getattr(optimizer, "_ddp_ext_overlapped", False):
            raise RuntimeError(self._error("was called already with this optimizer (on another wrapper)."))
        if self.mixed_precision is not None:
            raise ValueError(self._error(
                "does not support mixed_precision: the backward's gradients belong to the cast copies."))
        if has_optimizers_in_backward(self.module_parameters):
            raise RuntimeError(self._error(
                "cannot be used with optimizers applied in backward "
                "(torch.distributed.optim._apply_optimizer_in_backward): use one or the other."))
        if self.stepping:
            raise RuntimeError(self._error(
                f"cannot overlap the optimizer with a communication hook that steps parameters itself registered "
                f"({'; '.join(self.stepping)}): ZeroRedundancyOptimizer's and _register_fused_optim's hooks step "
                "each bucket's parameters once it is reduced, so they would be stepped twice. Use one or the other."))
        refusal = hooked_step_refusal(optimizer, sharded=sharded)
        if refusal:
            raise RuntimeError(self._error(refusal))
        reduced = {id(p) for _, p in self.named}
        names = {id(p): name for name, p in self.module.named_parameters()}
        foreign = []
        for number, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad and id(p) not in reduced:
                    foreign.append(f"{names.get(id(p), 'a parameter of shape ' + str(tuple(p.shape)))} "
                                   f"(param group {number})")
        if foreign:
            raise ValueError(self._error(
                f"cannot step parameters the wrapper does not reduce in buckets: {shown_names(foreign)}. Each is "
                "outside the wrapped module, in parameters_to_ignore or in delay_all_reduce_named_params, so no "
                "bucket's reduction says when its gradient is final. Give overlap_optimizer an optimizer over the "
                "wrapper's reduced parameters only (frozen parameters, requires_grad=False, may stay), and step "
                "the others with an optimizer of their own."))

    # --- torch.distributed.optim._apply_optimizer_in_backward: Note [Optimizers applied in backward] ---

    def setup_in_backward_optimizers(self, hooks: List[Tuple[str, object]]) -> None:
        """At the first forward (torch's DDP._setup_in_backward_optimizers):
        if parameters of the wrapper have optimizers applied in backward,
        removes their own hooks and steps them from the bucket step instead.
        Raises, before anything is changed, where that cannot be done
        exactly. `hooks`: the registered communication hooks."""
        params = self.module_parameters
        if not has_optimizers_in_backward(params):
            return
        self.check("optimizers applied in backward")
        rank = self._rank()
        what = "cannot apply optimizers in backward (torch.distributed.optim._apply_optimizer_in_backward) "
        if self.overlap is not None:
            raise RuntimeError(f"DistributedDataParallel on rank {rank} {what}and overlap_optimizer together: "
                               "use one or the other.")
        if hooks:
            names = "; ".join(name for name, _ in hooks)
            raise RuntimeError(
                f"DistributedDataParallel on rank {rank} {what}with a communication hook registered ({names}), as "
                "torch's DDP cannot either (it registers a hook of its own for them).")
        if self.mixed_precision is not None:
            raise RuntimeError(f"DistributedDataParallel on rank {rank} {what}with mixed_precision, as torch's "
                               "DDP cannot either.")
        if self.reducer is None:
            raise RuntimeError(f"DistributedDataParallel on rank {rank} {what}when every parameter is in "
                               "delay_all_reduce_named_params.")
        from torch.distributed.optim import apply_optimizer_in_backward as in_backward

        for p in params:
            for handle in in_backward.param_to_optim_hook_handle_map.get(p, []):
                handle.remove()
        self.reducer._set_bucket_step(_InBackwardSteps([p for _, p in self.named]))
        self.in_backward_set_up = True

    def check_no_optimizer_in_backward(self) -> None:
        """At the first forward, which every rank runs."""
        if self.in_backward_set_up:
            return
        if has_optimizers_in_backward(self.module_parameters):
            raise NotImplementedError(
                "ddp_ext.DistributedDataParallel does not support optimizers applied in backward "
                "(torch.distributed.optim._apply_optimizer_in_backward); step the optimizer after "
                "backward, or use _register_fused_optim."
            )


# Note [Optimizers applied in backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# _apply_optimizer_in_backward gives each parameter optimizers of its own
# (param._in_backward_optimizers) and hooks that step them as soon as the
# parameter's gradient is accumulated. Under torch's DDP (its
# _setup_in_backward_optimizers, at the first forward) the hooks of the
# wrapper's parameters are removed, and a communication hook steps each
# bucket's parameters once the bucket is reduced, with .grad set to the
# bucket's gradient (zeros for a parameter no rank used); at the end of the
# backward those parameters' .grad are None. ddp_ext does the same through
# the bucket step (Note [Stepping reduced buckets] in
# reducer/finish/step_per_bucket.h), without a communication hook: the step of
# each bucket runs when the backward ends, bucket after bucket as each is
# reduced, and the hook's wait inside the backward is gone. Parameters not
# reduced by the wrapper (parameters_to_ignore) keep torch's own hooks.


class _InBackwardSteps:
    """The bucket step for optimizers applied in backward."""

    def __init__(self, params):
        self.params = params  # the reducer's parameter indices

    def __call__(self, indices: List[int]) -> None:
        for i in indices:
            p = self.params[i]
            optimizers = getattr(p, "_in_backward_optimizers", None)
            if not optimizers:
                continue
            if p.grad is None:
                # Used by no rank: torch's hook steps it with the bucket's zeros.
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            for optimizer in optimizers:
                optimizer.step()
            p.grad = None
