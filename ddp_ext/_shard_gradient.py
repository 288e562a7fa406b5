"""What a parameter's .grad is after a sharded backward
(`ddp.overlap_optimizer(opt, shard=True)`, ddp_ext/_sharded_optimizer.py).

Note [Gradients after a sharded backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The averaged gradient exists only as each rank's shard of each bucket (Note
[Sharded buckets] in reducer/transport/reduce_scatter.h): no rank holds a
parameter's whole gradient any more. A .grad of None would be silently
different (torch.nn.utils.clip_grad_norm_ and a GradScaler's unscale_ skip
it and do nothing), and one of zeros outside the rank's range would give
each rank another norm. So a parameter some rank used gets a ShardGradient:
a tensor of the parameter's shape, dtype and device without memory, which
refuses every operation, on every rank alike, naming ddp.clip_grad_norm_,
except what optimizer.zero_grad() does to it: set_to_none drops it, and
zero_ (or _foreach_zero_) marks it zeroed. The wrapper drops a zeroed one
at its next forward (accumulating into zeros is accumulating into
nothing); accumulating a backward into one not zeroed raises in that
backward, with the reason. The optimizer's step and ddp.clip_grad_norm_
read the shards where the reducer keeps them.
"""

import torch

_aten = torch.ops.aten
_ZEROING = (_aten.zero_.default, _aten._foreach_zero_.default)


def refusal(name: str) -> str:
    return (f"the gradient of {name} holds only this rank's shard after a synchronising backward with "
            "overlap_optimizer(..., shard=True), so it cannot be read or changed: a norm of it, "
            "torch.nn.utils.clip_grad_norm_ or a GradScaler's unscale_ would differ between ranks. Clip with "
            "ddp.clip_grad_norm_(max_norm); call optimizer.zero_grad() before the next backward (accumulate with "
            "ddp.no_sync() instead of adding backwards to a stepped gradient).")


class ShardGradient(torch.Tensor):
    """A gradient held as shards elsewhere: shape, dtype and device, no memory."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str):
        grad = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False)
        grad.param_name = name
        grad.zeroed = False
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _ZEROING:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if all(isinstance(t, ShardGradient) for t in targets):
                for t in targets:
                    t.zeroed = True
                return None if func is _aten._foreach_zero_.default else args[0]
        names = [a.param_name for a in _flat(args, kwargs) if isinstance(a, ShardGradient)]
        raise RuntimeError(f"DistributedDataParallel: {refusal(names[0] if names else 'a parameter')} ({func})")

    def __repr__(self) -> str:
        return f"ShardGradient(shape={tuple(self.shape)}, dtype={self.dtype}: this rank's shard only)"

    def __deepcopy__(self, memo):
        copied = ShardGradient(self, self.param_name)
        copied.zeroed = self.zeroed
        return copied

    def __reduce_ex__(self, protocol):
        raise RuntimeError(f"DistributedDataParallel: {refusal(self.param_name)}")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def drop_zeroed(params) -> None:
    """Sets to None each .grad that is a zeroed ShardGradient."""
    for p in params:
        grad = p.grad
        if isinstance(grad, ShardGradient) and grad.zeroed:
            p.grad = None
